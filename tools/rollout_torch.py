#!/usr/bin/env python3
"""A GRPO step's rollout phase as a plain PyTorch + transformers loop (the baseline of
tools/rollout-compare.sh; issue 15's "rollout phase" comparison).

    python3 tools/rollout_torch.py --model DIR --data FILE.jsonl --templates FILE.toml
        [--queries 2] [--group-size 4] [--chunk-tokens 256] [--memory-tokens 64]
        [--answer-tokens 16] [--temperature 1.0] [--top-p 1.0] [--threads N]
        [--dtype float32|bfloat16] [--seed 0] [--json]

The work is what `infomem-engine rollout` does for the first `--queries` records of the data
(docs/DESIGN.md §1.1): each of `--group-size` rollouts per query reads the document in chunks
of `--chunk-tokens` tokens (token slices of the tokenized context, as the engine cuts them),
rewriting its memory after each chunk (at most `--memory-tokens` new tokens, sampled at
`--temperature`/`--top-p`, stopping at EOS), then answers from the final memory (at most
`--answer-tokens`). Prompts are built as the engine builds them: the template's user turn is
rendered once through the model's chat template with markers in place of the slots, cut at the
markers, and the pieces' token ids are concatenated with the slots' ids (question, chunk,
memory); an empty reply leaves the memory at the template's `empty_memory`.

Plain HF: one `generate` call per turn, batched over every live conversation of that turn (all
queries x all rollouts; left padding), with transformers' default KV cache and no prefix
sharing (each rollout prefills its whole prompt). Then the InfoMem gain inputs, as the engine
scores them: log p(gold | final prompt with the memory) for every rollout and with the empty
memory once per query, in one batched forward (timed separately: `score_s`).

Generated tokens count every sampled token up to and including the first EOS (what the engine
counts). tokens/s = generated tokens / (seconds of the generate calls).
"""

import argparse
import json
import os
import sys
import time
import tomllib

import torch

MARK = "\ue000"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Plan:
    """A user-turn template rendered once, cut at the slot markers (agent/templates.rs)."""

    def __init__(self, tok, text):
        marked = (text.replace("{question}", f"{MARK}q{MARK}")
                  .replace("{chunk}", f"{MARK}c{MARK}")
                  .replace("{memory}", f"{MARK}m{MARK}"))
        rendered = tok.apply_chat_template([{"role": "user", "content": marked}], tokenize=False,
                                           add_generation_prompt=True)
        self.pieces = []
        for i, part in enumerate(rendered.split(MARK)):
            if i % 2 == 1:
                self.pieces.append(("slot", part))
            elif part:
                self.pieces.append(("lit", tok(part, add_special_tokens=False).input_ids))

    def build(self, q, c, m):
        ids = []
        for kind, v in self.pieces:
            if kind == "lit":
                ids += v
            else:
                ids += {"q": q, "c": c, "m": m}[v]
        return ids


def left_pad(seqs, pad):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = torch.tensor(s)
        mask[i, n - len(s):] = 1
    return ids, mask


def generate(model, prompts, max_new, args, pad, eos):
    """One HF generate over a batch of prompts; returns the new ids of each, cut after EOS."""
    ids, mask = left_pad(prompts, pad)
    kw = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0) \
        if args.temperature > 0 else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                         pad_token_id=pad, eos_token_id=sorted(eos), use_cache=True, **kw)
    news = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = []
        for t in row:
            cut.append(t)
            if t in eos:
                break
        news.append(cut)
    return news


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--data", required=True, help="JSONL records (question, context, answers)")
    p.add_argument("--templates", required=True, help="TOML with update, final, empty_memory")
    p.add_argument("--queries", type=int, default=2, help="records rolled out (the first N)")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per query")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--memory-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                   help="attention implementation (default: sdpa, transformers' default; eager was used until 2026-12-04)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line last on stdout")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn)
    model.eval()
    with open(args.templates, "rb") as f:
        tpl = tomllib.load(f)
    upd, fin = Plan(tok, tpl["update"]), Plan(tok, tpl["final"])
    empty = tok(tpl.get("empty_memory", "(empty)"), add_special_tokens=False).input_ids
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else min(eos)
    recs = [json.loads(l) for l in open(args.data) if l.strip()][:args.queries]
    if len(recs) < args.queries:
        sys.exit(f"rollout_torch: {args.data} has {len(recs)} records, fewer than --queries {args.queries}")

    n = args.group_size
    qs = [tok(r["question"], add_special_tokens=False).input_ids for r in recs]
    docs = [tok(r["context"], add_special_tokens=False).input_ids for r in recs]
    chunks = [[d[i:i + args.chunk_tokens] for i in range(0, len(d), args.chunk_tokens)] for d in docs]
    K = max(len(c) for c in chunks)
    mem = [[empty] * n for _ in recs]
    gen_tokens = prefill = 0
    gen_s = 0.0
    t_all = time.perf_counter()
    with torch.inference_mode():
        # one generate per turn over every live conversation (all queries x rollouts)
        for t in range(K):
            live = [(qi, i) for qi in range(len(recs)) if t < len(chunks[qi]) for i in range(n)]
            prompts = [upd.build(qs[qi], chunks[qi][t], mem[qi][i]) for qi, i in live]
            prefill += sum(len(x) for x in prompts)
            t0 = time.perf_counter()
            news = generate(model, prompts, args.memory_tokens, args, pad, eos)
            gen_s += time.perf_counter() - t0
            for (qi, i), new in zip(live, news):
                gen_tokens += len(new)
                text = tok.decode([x for x in new if x not in eos], skip_special_tokens=True).strip()
                mem[qi][i] = tok(text, add_special_tokens=False).input_ids if text else empty
        prompts = [fin.build(qs[qi], [], mem[qi][i]) for qi in range(len(recs)) for i in range(n)]
        prefill += sum(len(x) for x in prompts)
        t0 = time.perf_counter()
        news = generate(model, prompts, args.answer_tokens, args, pad, eos)
        gen_s += time.perf_counter() - t0
        gen_tokens += sum(len(x) for x in news)
        # InfoMem's inputs: log p(gold | final prompt) with each memory and with the empty one
        t0 = time.perf_counter()
        seqs, spans = [], []
        for qi, r in enumerate(recs):
            gold = tok(r["answers"][0], add_special_tokens=False).input_ids
            for m in [empty] + mem[qi]:
                pr = fin.build(qs[qi], [], m)
                seqs.append(pr + gold)
                spans.append((len(pr), len(gold)))
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), pad, dtype=torch.long)
        att = torch.zeros((len(seqs), L), dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, :len(s)] = torch.tensor(s)
            att[j, :len(s)] = 1
        logits = model(input_ids=ids, attention_mask=att).logits.float()
        lp = torch.log_softmax(logits, -1)
        gains = []
        for j, (a, g) in enumerate(spans):
            tgt = ids[j, a:a + g]
            gains.append(lp[j, a - 1:a - 1 + g].gather(-1, tgt[:, None]).sum().item())
        score_s = time.perf_counter() - t0
    total_s = time.perf_counter() - t_all
    res = {
        "impl": "torch", "work": "rollout-phase", "torch": torch.__version__,
        "transformers": transformers.__version__, "dtype": args.dtype, "attn": args.attn, "threads": args.threads,
        "queries": len(recs), "group_size": n, "chunks": K, "chunk_tokens": args.chunk_tokens,
        "memory_tokens": args.memory_tokens, "answer_tokens": args.answer_tokens,
        "temperature": args.temperature, "generated_tokens": gen_tokens, "prefill_tokens": prefill,
        "rollout_s": gen_s, "score_s": score_s, "seconds": total_s,
        "tokens_per_s": gen_tokens / gen_s,
    }
    log(f"torch rollout phase: {gen_tokens} generated tokens in {gen_s:.2f} s "
        f"({res['tokens_per_s']:.1f} tok/s), gain scoring {score_s:.2f} s, {prefill} prompt tokens")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
