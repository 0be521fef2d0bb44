#!/usr/bin/env python3
"""PyTorch side of infomem-engine's side-by-side benchmarks.

Measures PyTorch + transformers (+ PEFT for `train`) on the same workloads that
`infomem-engine bench` runs, and prints one JSON line per workload on stdout
(the last line of stdout) plus a human-readable line on stderr.

    python3 tools/bench_torch.py (--model DIR | --shape NAME) --work WORK
        [--device cpu|cuda] [--dtype float32|bfloat16] [--threads N]
        [--repeat R] [--stat median|best] [--json]

Model: `--model DIR` loads an HF directory; `--shape qwen2-0.5b|qwen2-3b|qwen3-1.7b|qwen3-4b|
smollm2-135m` builds random weights from a config with the real model's shape, directly on the
device in the requested dtype. Attention: SDPA, transformers' default (`--attn eager` for the
explicit softmax(QKᵀ)V path; until 2026-12-04 the CPU default was eager, which on a 2-core Xeon
measured score ~0.65–0.75× and decode ~0.85× of SDPA's speed: docs/RESULTS.md).

Inputs are seeded (torch.Generator, seed 0); token ids are uniform in [100, vocab - 100).
Each workload runs once as a warm-up (same shapes; decode/rollout with few new tokens),
then `--repeat` timed runs; `seconds` is the median (or best, `--stat best`) of those.

Workloads (defaults are the sizes `infomem-engine bench` uses; all overridable by flags):

  score    `--batch` 8 sequences x `--seq-len` 512 tokens, one forward under
           torch.inference_mode(); teacher-forced log-probs (log_softmax in float32,
           gathered at the target ids) of the last `--score-last` 64 tokens of each
           sequence. The LM head is computed only for the positions needed
           (`logits_to_keep`) when transformers supports it, unless `--full-logits`; the
           JSON says whether it did.
           tokens/s = batch * seq_len / seconds.

  decode   `--batch` 8 prompts x `--seq-len` 256 tokens (equal length, no padding),
           `--new-tokens` 128 new tokens each, greedy, EOS ignored
           (min_new_tokens = max_new_tokens, do_sample=False), HF `generate` with its
           default KV cache, under torch.inference_mode().
           tokens/s = batch * new_tokens / seconds (prefill included in seconds).

  train    LoRA r16 alpha32 (dropout 0) on q,k,v,o,gate,up,down via PEFT. `--batch` 8
           sequences x `--seq-len` 512 tokens; GRPO token loss (docs/DESIGN.md §1.6) on the
           last `--train-last` 128 tokens of each: logp = log_softmax(logits)[target],
           advantage per sequence +1,-1,+1,... , old_logp = logp.detach(),
           ref_logp = logp.detach() - 0.01,
               ratio = exp(logp - old_logp)
               surr  = min(ratio*A, clip(ratio, 1-0.2, 1+0.28)*A)
               d     = ref_logp - logp;  kl = clamp(exp(d) - d - 1, -10, 10)
               loss  = sum(-surr + 0.05*kl) / number_of_loss_tokens
           One timed step = zero grads + forward + loss + backward (no optimizer step).
           tokens/s = batch * seq_len / seconds.

  rollout  The memory agent's generation pattern: `--rollout-n` 16 rollouts,
           `--chunks` 8 chunks of `--chunk-tokens` 2048 tokens, memory of
           `--memory-tokens` 512 tokens. For each chunk: prompt = [section (the same
           2048 tokens for all n rollouts) + that rollout's memory], batched over the n
           rollouts; greedy `generate` of memory_tokens new tokens, EOS ignored; the
           generated tokens become the next chunk's memory (the first chunk has an empty
           memory). Plain HF: the shared section is prefilled n times (no prefix sharing).
           tokens/s = n * chunks * memory_tokens generated tokens / total seconds.

  all      score, decode, train in sequence (one JSON line each).

`--grad-checkpointing` (train): recompute each layer's activations in the backward
(transformers' gradient checkpointing, non-reentrant), so larger shapes fit in memory; the
JSON says which was used.

Several cases in one process (the model is built once; PEFT wraps it for `train`, so train
cases run last): `--case NAME:WORK:FLAGS` (repeatable), e.g.
    --case "score-8x4096:score:--batch 8 --seq-len 4096 --score-last 64"
Each case prints its JSON line with "case": NAME; a case that fails (out of memory, say)
prints {"impl": "torch", "case": NAME, "work": WORK, "error": "..."} and the others still run.
"""

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch

SHAPES = {
    "qwen2-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen2-3b": dict(
        model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645,
    ),
    # Qwen3 (transformers' Qwen3Config): per-head q/k RMSNorm, head_dim 128 independent of
    # hidden/heads (Qwen3-4B's q is 4096 wide on a 2560 hidden), no q/k/v bias
    "qwen3-1.7b": dict(
        model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=False,
        max_position_embeddings=40960, max_window_layers=28, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-4b": dict(
        model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=False,
        max_position_embeddings=40960, max_window_layers=36, bos_token_id=151643, eos_token_id=151645,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        tie_word_embeddings=True, rope_theta=1e5, rms_norm_eps=1e-5,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
}

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CLIP_LOW, CLIP_HIGH, KL_COEF = 0.2, 0.28, 0.05


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Model construction

def make_config(shape):
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    theta = spec["rope_theta"]
    cfg = AutoConfig.for_model(model_type, **spec)
    # transformers 5 keeps rope settings in `rope_parameters`; older versions in `rope_theta`.
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict):
        rope["rope_theta"] = theta
        rope.setdefault("rope_type", "default")
    cfg.rope_theta = theta
    if model_type in ("qwen2", "qwen3"):
        cfg.use_sliding_window = False
    return cfg


def load_model(args, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, attn_implementation=args.attn)
        model.to(device)
        name = os.path.basename(os.path.normpath(args.model))
    else:
        cfg = make_config(args.shape)
        with torch.device(device):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=args.attn)
        name = args.shape + " (random weights)"
    model.eval()
    model.requires_grad_(False)
    return model, name


def head_kwargs(model, n, full_logits=False):
    """Keyword arguments asking forward() to compute the LM head only on the last n positions."""
    if full_logits:
        return {}
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        return {"logits_to_keep": n}
    if "num_logits_to_keep" in params:  # transformers 4.45-4.49
        return {"num_logits_to_keep": n}
    return {}


def random_ids(gen, vocab, *shape):
    return torch.randint(100, vocab - 100, shape, generator=gen, dtype=torch.long)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


# ---------------------------------------------------------------------------------------------
# Workloads. Each returns (run(warmup: bool) -> None, tokens counted per run, extra JSON fields).

def target_logprobs(model, ids, last, kw):
    """log p(ids[:, -last:]) under teacher forcing, float32, shape [batch, last]."""
    if kw:
        logits = model(input_ids=ids, use_cache=False, **kw).logits  # [B, last+1, V]
    else:
        logits = model(input_ids=ids, use_cache=False).logits[:, -(last + 1):]
    logits = logits[:, :-1].float()
    targets = ids[:, -last:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def work_score(model, args, device, vocab, gen):
    ids = random_ids(gen, vocab, args.batch, args.seq_len).to(device)
    kw = head_kwargs(model, args.score_last + 1, args.full_logits)
    result = {}

    def run(warmup):
        with torch.inference_mode():
            lp = target_logprobs(model, ids, args.score_last, kw)
        result["mean_logp"] = float(lp.mean())

    extra = {"batch": args.batch, "seq_len": args.seq_len, "score_last": args.score_last,
             "logits_to_keep": bool(kw), "head_positions": args.score_last + 1 if kw else args.seq_len,
             "result": result}
    return run, args.batch * args.seq_len, extra


def greedy(model, ids, new_tokens, pad_id):
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
        num_beams=1, use_cache=True, temperature=None, top_p=None, top_k=None)


def pad_id_of(model):
    cfg = model.config
    for v in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return v
    return 0


def work_decode(model, args, device, vocab, gen):
    ids = random_ids(gen, vocab, args.batch, args.seq_len).to(device)
    pad = pad_id_of(model)

    def run(warmup):
        n = min(4, args.new_tokens) if warmup else args.new_tokens
        with torch.inference_mode():
            out = greedy(model, ids, n, pad)
        assert out.shape == (args.batch, args.seq_len + n), out.shape

    extra = {"batch": args.batch, "prompt_len": args.seq_len, "new_tokens": args.new_tokens,
             "cache": "dynamic", "prefill_included": True}
    return run, args.batch * args.new_tokens, extra


def work_train(model, args, device, vocab, gen):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                      target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    if args.grad_checkpointing:
        # non-reentrant checkpointing needs no input that requires grad (the base is frozen);
        # transformers >= 5.2x names it activation checkpointing
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model = get_peft_model(model, lora)
    peft_model.train()
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)

    ids = random_ids(gen, vocab, args.batch, args.seq_len).to(device)
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(args.batch)], device=device)
    kw = head_kwargs(model, args.train_last + 1, args.full_logits)  # PEFT passes kwargs through to the base model
    result = {}

    def run(warmup):
        peft_model.zero_grad(set_to_none=True)
        logp = target_logprobs(peft_model, ids, args.train_last, kw)  # [B, T]
        old_logp = logp.detach()
        ref_logp = logp.detach() - 0.01
        a = adv[:, None]
        ratio = torch.exp(logp - old_logp)
        surr = torch.minimum(ratio * a, torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
        d = ref_logp - logp
        kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
        loss = (-surr + KL_COEF * kl).sum() / logp.numel()
        loss.backward()
        result["loss"] = loss.item()

    extra = {"batch": args.batch, "seq_len": args.seq_len, "loss_tokens_per_seq": args.train_last,
             "lora_r": 16, "lora_alpha": 32, "lora_targets": LORA_TARGETS,
             "trainable_params": trainable, "logits_to_keep": bool(kw),
             "grad_checkpointing": bool(args.grad_checkpointing),
             "optimizer_step": False, "result": result}
    return run, args.batch * args.seq_len, extra


def work_rollout(model, args, device, vocab, gen):
    sections = random_ids(gen, vocab, args.chunks, args.chunk_tokens).to(device)
    n, pad = args.rollout_n, pad_id_of(model)
    result = {}

    def run(warmup):
        chunks = 1 if warmup else args.chunks
        new = min(8, args.memory_tokens) if warmup else args.memory_tokens
        memory = torch.empty(n, 0, dtype=torch.long, device=device)
        prefill = 0
        with torch.inference_mode():
            for c in range(chunks):
                prompt = torch.cat([sections[c].expand(n, -1), memory], dim=1)
                prefill += prompt.numel()
                out = greedy(model, prompt, new, pad)
                memory = out[:, prompt.shape[1]:][:, :args.memory_tokens]
        result["prefill_tokens"] = prefill

    # batch / seq_len / new_tokens: the names infomem-engine's bench JSON uses for the same sizes
    extra = {"rollout_n": n, "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
             "memory_tokens": args.memory_tokens, "batch": n, "seq_len": args.chunk_tokens,
             "new_tokens": args.memory_tokens, "prefix_sharing": False,
             "generated_tokens": n * args.chunks * args.memory_tokens, "result": result}
    return run, n * args.chunks * args.memory_tokens, extra


WORKS = {"score": work_score, "decode": work_decode, "train": work_train, "rollout": work_rollout}


# ---------------------------------------------------------------------------------------------

def bench(work, args, device, dtype, loaded=None):
    model, name = loaded or load_model(args, device, dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    run, tokens, extra = WORKS[work](model, args, device, vocab, gen)

    for _ in range(args.warmup):
        warm_s, _ = timed(device, lambda: run(True))
        log(f"[torch {work}] warm-up {warm_s:.2f}s")
    times = []
    for i in range(args.repeat):
        s, _ = timed(device, lambda: run(False))
        times.append(s)
        log(f"[torch {work}] run {i + 1}/{args.repeat}: {s:.3f}s")
    seconds = min(times) if args.stat == "best" else statistics.median(times)

    import transformers
    rec = {
        "impl": "torch", "work": work, "model": name, "device": device.type,
        "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2),
        "stat": args.stat, "repeat": args.repeat, "seconds_all": [round(t, 4) for t in times],
        "attn": args.attn, "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
    }
    if work == "train":
        import peft
        rec["peft"] = peft.__version__
    if device.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(device)
        rec["max_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if getattr(args, "case", None):
        rec["case"] = args.case
    rec.update(extra)

    human = (f"torch {work}: {tokens} tokens in {seconds:.3f}s ({args.stat} of {args.repeat}) = "
             f"{tokens / seconds:.1f} tok/s  [{name}, {device.type}, {rec['dtype']}, "
             f"{rec['threads']} threads, attn={args.attn}]")
    log(human)
    if not args.json:
        print(human, flush=True)
    emit(args, rec)

    del model, run
    if device.type == "cuda":
        torch.cuda.empty_cache()


def emit(args, rec):
    """Print one JSON line (and append it to --jsonl), with the --tag fields."""
    for kv in args.tag or []:
        k, _, v = kv.partition("=")
        rec[k] = v
    line = json.dumps(rec)
    print(line, flush=True)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(line + "\n")


def run_cases(p, args, device, dtype):
    """--case NAME:WORK:FLAGS ...: one model, several workloads (train last: PEFT wraps the model)."""
    import shlex
    cases = []
    for spec in args.case:
        name, work, flags = (spec.split(":", 2) + ["", ""])[:3]
        if work not in WORKS:
            sys.exit(f"bench_torch: --case {spec!r}: work must be one of {sorted(WORKS)}")
        cases.append((name, work, flags))
    cases.sort(key=lambda c: c[1] == "train")
    base = [a for a in sys.argv[1:]]
    loaded = None
    for name, work, flags in cases:
        # the case's flags override the command line's (argparse keeps the last value)
        cargs = p.parse_args(_without_cases(base) + ["--work", work] + shlex.split(flags))
        cargs.case = name
        cargs.seq_len = cargs.seq_len or (256 if work == "decode" else 512)
        try:
            last = {"score": cargs.score_last, "train": cargs.train_last}.get(work, 0)
            if last >= cargs.seq_len:
                raise ValueError(f"--seq-len {cargs.seq_len} must exceed {last} for {work}")
            if loaded is None:
                loaded = load_model(cargs, device, dtype)
            bench(work, cargs, device, dtype, loaded)
        except Exception as e:  # noqa: BLE001 (an OOM in one case must not lose the others)
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:500]
            log(f"[torch {work}] case {name} failed: {msg}")
            emit(cargs, {"impl": "torch", "case": name, "work": work, "error": msg})
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _without_cases(argv):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--case", "--work"):
            skip = True
            continue
        if a.startswith("--case=") or a.startswith("--work="):
            continue
        out.append(a)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF model directory")
    src.add_argument("--shape", choices=sorted(SHAPES), help="random weights with this real shape")
    p.add_argument("--work", choices=[*WORKS, "all"], help="the workload (or --case)")
    p.add_argument("--case", action="append", metavar="NAME:WORK:FLAGS",
                   help="run several workloads on one model (see the module help); repeatable")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="train: recompute activations in the backward (fits larger shapes)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation (default: sdpa, transformers' default)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeat", type=int, default=1, help="timed runs (default 1)")
    p.add_argument("--stat", choices=["median", "best"], default="median")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs (default 1)")
    p.add_argument("--full-logits", action="store_true",
                   help="score/train: compute the LM head on every position (no logits_to_keep)")
    p.add_argument("--json", action="store_true", help="stdout carries only the JSON lines")
    p.add_argument("--jsonl", metavar="FILE", help="also append each JSON line to FILE as it is produced")
    p.add_argument("--tag", action="append", metavar="KEY=VALUE",
                   help="add KEY: VALUE to every JSON line (repeatable)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, help="default: 512 (score, train), 256 (decode prompt)")
    p.add_argument("--score-last", type=int, default=64)
    p.add_argument("--train-last", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rollout-n", type=int, default=16)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--memory-tokens", type=int, default=512)
    args = p.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_torch: --device cuda but torch.cuda.is_available() is False")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    torch.set_num_threads(args.threads)

    if args.case:
        return run_cases(p, args, device, dtype)
    if not args.work:
        sys.exit("bench_torch: give --work WORK or --case NAME:WORK:FLAGS")
    works = ["score", "decode", "train"] if args.work == "all" else [args.work]
    seq_len = args.seq_len
    for work in works:
        args.seq_len = seq_len or (256 if work == "decode" else 512)
        last = {"score": args.score_last, "train": args.train_last}.get(work, 0)
        if last >= args.seq_len:
            sys.exit(f"bench_torch: --seq-len {args.seq_len} must exceed {last} for {work}")
        bench(work, args, device, dtype)


if __name__ == "__main__":
    main()
