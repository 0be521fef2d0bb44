#!/usr/bin/env python3
"""Held-out checks of every supported model family through the release binary, against
transformers and PEFT (float64 reference math on the same float32 weights).

    python3 tools/check_families.py [--seed 7] [--bin target/release/infomem-engine] [--keep DIR]

For each family it writes a fresh random checkpoint whose shapes and seed differ from every
fixture in tests/fixtures (so passing is not a matter of matching stored numbers):

  qwen3     head_dim ≠ hidden / heads, non-trivial q_norm/k_norm, tied head (Qwen3-0.6B/4B-like)
  qwen3-untied   the same with an untied head and attention_bias (Qwen3-8B-like head)
  mistral   sliding_window larger than the sequences (plain causal attention)
  llama32   Llama 3.2: tied embeddings, `llama3` rope scaling, sequences well past
            original_max_position_embeddings

and a random PEFT LoRA adapter (r 4, all seven projections, non-zero B), then compares
`score --json` log-probs (base and `--adapter`) within 1e-3 and `generate --greedy --json` tokens
(exactly, up to the first step whose reference top-1/top-2 margin is under 1e-3, where a float32
tie may go either way). It also checks the refusals: a Mistral window shorter than the input, and
unsupported families (Qwen3-MoE, Qwen3.5, Gemma 3) named before any weight is read.

Needs torch, transformers and peft (the venv `tools/bench-compare.sh` makes:
$INFOMEM_CACHE/torch-venv). Prints one JSON line per check; exits 1 if any fails.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

TOL = 1e-3


def make(kind, out, seed):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=389, num_hidden_layers=3, rms_norm_eps=1e-6, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    if kind == "qwen3":
        cfg = Qwen3Config(hidden_size=72, intermediate_size=136, num_attention_heads=6, num_key_value_heads=2,
                          head_dim=20, rope_theta=1e6, tie_word_embeddings=True, **common)
    elif kind == "qwen3-untied":
        cfg = Qwen3Config(hidden_size=48, intermediate_size=100, num_attention_heads=3, num_key_value_heads=3,
                          head_dim=24, rope_theta=1e6, tie_word_embeddings=False, attention_bias=True, **common)
    elif kind == "mistral":
        cfg = MistralConfig(hidden_size=80, intermediate_size=144, num_attention_heads=5, num_key_value_heads=1,
                            head_dim=16, rope_theta=1e4, sliding_window=1024, tie_word_embeddings=False, **common)
    elif kind == "llama32":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=8, tie_word_embeddings=True, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 24},
                          **common)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))  # non-trivial norms: a skipped norm shows
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.12)
    model.save_pretrained(out)
    return model


def add_adapter(model, out, seed):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 1000)
    lc = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm = get_peft_model(model, lc)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    pm.save_pretrained(out)
    return pm


def run(bin_, *args):
    r = subprocess.run([bin_, *args], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def ref_logprobs(model, ctx, tgt):
    ids = torch.tensor([ctx + tgt])
    with torch.no_grad():
        lsm = torch.log_softmax(model(ids).logits[0].double(), -1)
    return [lsm[len(ctx) - 1 + j, t].item() for j, t in enumerate(tgt)]


def ref_greedy(model, prompt, n):
    ids = list(prompt)
    toks, margins = [], []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1].double()
        top = torch.topk(row, 2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(toks[-1])
    return toks, margins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--bin", default="target/release/infomem-engine")
    ap.add_argument("--keep", help="write the checkpoints here instead of a temporary directory")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    root = a.keep or tempfile.mkdtemp(prefix="check-families-")
    os.makedirs(root, exist_ok=True)
    failed = 0

    def report(**kw):
        nonlocal failed
        failed += not kw["ok"]
        print(json.dumps(kw), flush=True)

    g = torch.Generator().manual_seed(a.seed)
    for kind in ["qwen3", "qwen3-untied", "mistral", "llama32"]:
        mdir, adir = os.path.join(root, kind), os.path.join(root, kind + "-lora")
        base = make(kind, mdir, a.seed).double().eval()
        vocab = base.config.vocab_size
        ctx = torch.randint(3, vocab, (70,), generator=g).tolist()  # 70 + 30 > llama32's original 24
        tgt = torch.randint(3, vocab, (30,), generator=g).tolist()
        csv = lambda xs: ",".join(map(str, xs))  # noqa: E731

        want = ref_logprobs(base, ctx, tgt)
        rc, out, err = run(a.bin, "score", "--model", mdir, "--context-ids", csv(ctx), "--target-ids", csv(tgt), "--json")
        got = json.loads(out.strip().splitlines()[-1])["logprobs"] if rc == 0 else None
        diff = max(abs(x - y) for x, y in zip(want, got)) if got else None
        report(family=kind, check="score", ok=got is not None and diff <= TOL, max_abs_diff=diff, err=err[-300:] if rc else "")

        toks, margins = ref_greedy(base, ctx, 16)
        rc, out, err = run(a.bin, "generate", "--model", mdir, "--prompt-ids", csv(ctx), "--max-new-tokens", "16",
                           "--greedy", "--ignore-eos", "--json")
        got = json.loads(out.strip().splitlines()[-1]).get("new_ids") if rc == 0 else None
        n_sure = next((i for i, m in enumerate(margins) if m < 1e-3), 16)
        ok = got is not None and got[:n_sure] == toks[:n_sure]
        report(family=kind, check="generate", ok=ok, compared=n_sure, want=toks, got=got, err=err[-300:] if rc else "")

        peft = add_adapter(make(kind, os.path.join(root, kind + "-tmp"), a.seed), adir, a.seed).double().eval()
        want = ref_logprobs(peft, ctx, tgt)
        rc, out, err = run(a.bin, "score", "--model", mdir, "--adapter", adir, "--context-ids", csv(ctx),
                           "--target-ids", csv(tgt), "--json")
        got = json.loads(out.strip().splitlines()[-1])["logprobs"] if rc == 0 else None
        diff = max(abs(x - y) for x, y in zip(want, got)) if got else None
        moved = max(abs(x - y) for x, y in zip(want, ref_logprobs(base, ctx, tgt)))
        report(family=kind, check="score --adapter (PEFT)", ok=got is not None and diff <= TOL and moved > 1e-2,
               max_abs_diff=diff, adapter_moves_logprobs_by=moved, err=err[-300:] if rc else "")

    # a Mistral window shorter than the input: refused, naming the window
    mdir = os.path.join(root, "mistral")
    cfg = json.load(open(os.path.join(mdir, "config.json")))
    cfg["sliding_window"] = 64
    small = os.path.join(root, "mistral-window64")
    os.makedirs(small, exist_ok=True)
    json.dump(cfg, open(os.path.join(small, "config.json"), "w"))
    os.symlink(os.path.join(mdir, "model.safetensors"), os.path.join(small, "model.safetensors"))
    rc, out, err = run(a.bin, "score", "--model", small, "--context-ids", ",".join(["5"] * 70), "--target-ids", "6,7", "--json")
    report(family="mistral", check="window shorter than the input is refused", ok=rc != 0 and "sliding_window 64" in err,
           err=err.strip()[-300:])

    # unsupported families: named, with what is missing, before any weight is read (no weights here)
    for mt, arch, word in [("qwen3_moe", "Qwen3MoeForCausalLM", "expert"),
                           ("qwen3_5", "Qwen3_5ForConditionalGeneration", "linear attention"),
                           ("gemma3", "Gemma3ForConditionalGeneration", "Gemma")]:
        d = os.path.join(root, mt)
        os.makedirs(d, exist_ok=True)
        json.dump({"model_type": mt, "architectures": [arch], "hidden_size": 64, "num_attention_heads": 4,
                   "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}, open(os.path.join(d, "config.json"), "w"))
        rc, out, err = run(a.bin, "score", "--model", d, "--context-ids", "1,2", "--target-ids", "3", "--json")
        report(family=mt, check="refused with what is missing", ok=rc != 0 and word in err and "unsupported architecture" in err,
               err=err.strip()[-300:])

    print(json.dumps({"checks_failed": failed, "dir": root}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
