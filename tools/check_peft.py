#!/usr/bin/env python3
"""Load an adapter written by `infomem-engine train` with PEFT in PyTorch and check that it gives
the same log-probabilities as `infomem-engine score --adapter` (float32, CPU).

    python3 tools/check_peft.py --model DIR --adapter DIR [--context-ids 1,2,3 --target-ids 4,5]
                                [--bin target/release/infomem-engine]

Needs torch, transformers and peft (e.g. the venv made by tools/bench-compare.sh). Exits 1 when
any per-token log-prob differs by more than 1e-3.
"""
import argparse, json, subprocess, sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--context-ids", default="5,6,7,8,9,10,11,12")
    ap.add_argument("--target-ids", default="13,14,15,16")
    ap.add_argument("--bin", default="target/release/infomem-engine")
    a = ap.parse_args()
    ctx = [int(x) for x in a.context_ids.split(",")]
    tgt = [int(x) for x in a.target_ids.split(",")]

    base = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, a.adapter)  # exactly how users load it
    model.eval()
    ids = torch.tensor([ctx + tgt])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    lsm = torch.log_softmax(logits, dim=-1)
    torch_lp = [lsm[len(ctx) - 1 + j, t].item() for j, t in enumerate(tgt)]

    out = subprocess.run([a.bin, "score", "--model", a.model, "--adapter", a.adapter,
                          "--context-ids", a.context_ids, "--target-ids", a.target_ids, "--json"],
                         capture_output=True, text=True, check=True)
    ours = json.loads(out.stdout.strip().splitlines()[-1])["logprobs"]
    err = max(abs(x - y) for x, y in zip(torch_lp, ours))
    print(json.dumps({"max_abs_diff": err, "peft": torch_lp, "engine": ours}))
    sys.exit(0 if err <= 1e-3 else 1)


if __name__ == "__main__":
    main()
