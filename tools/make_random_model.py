#!/usr/bin/env python3
"""Write a random-weight HF model directory with a real model's shape, for GPU benchmarks.

    python3 tools/make_random_model.py --shape qwen2-0.5b --out DIR [--device cuda] [--seed 0]

Shapes are tools/bench_torch.py's SHAPES (qwen2-0.5b, qwen2-3b, qwen3-1.7b, qwen3-4b,
smollm2-135m): the config is built by its make_config, the weights by transformers' own
initialization (normal(0, 0.02) for projections and embeddings, ones for norms, Qwen3's q/k norms
included) under torch.manual_seed(seed), directly in bfloat16 on the device, then saved with
save_pretrained (config.json + *.safetensors, bf16; Qwen3-4B is ~8 GB). No tokenizer:
the benchmarks feed token ids. Both infomem-engine and tools/bench_torch.py --model load it, so
the two sides run the very same weights.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import SHAPES, make_config  # noqa: E402  (the one definition of the shapes)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    t0 = time.time()
    cfg = make_config(args.shape)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"make_random_model: {args.shape} ({n / 1e6:.1f}M parameters, bf16, seed {args.seed}) "
          f"→ {args.out} in {time.time() - t0:.1f}s", file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
