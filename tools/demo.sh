#!/usr/bin/env bash
# The main job on a fresh machine, on the CPU: fetch SmolLM2-135M-Instruct, make a synthetic
# needle task (train + held-out), evaluate the base model, train a LoRA with GRPO + InfoMem,
# evaluate the trained adapter on the same held-out questions, print the comparison.
# About 15 minutes on 2 cores. Usage: tools/demo.sh [OUT_DIR] [extra train flags...]
#   e.g. tools/demo.sh runs/demo-outcome --reward outcome     (the ablation at the same budget)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/demo}"
shift || true
mkdir -p "$OUT"

cargo build --release
SMOL="$(tools/fetch-smollm2.sh | tail -n 1)"
B=target/release/infomem-engine
AGENT=(--chunk-tokens 128 --memory-tokens 48 --answer-tokens 24 --extract first-number --templates examples/demo-templates.toml)
# DTYPE=bf16 tools/demo.sh DIR: the same run with bf16 weights (every model command gets --dtype)
DT=(); [ -n "${DTYPE:-}" ] && DT=(--dtype "$DTYPE")

echo "== data: needle task, ~170-token documents (2 chunks of 128 tokens), numeric answers"
[ -f "$OUT/train.jsonl" ] || $B data synth --task needle --tokens 170 --count 200 --seed 100 --model "$SMOL" --out "$OUT/train.jsonl"
[ -f "$OUT/heldout.jsonl" ] || $B data synth --task needle --tokens 170 --count 50 --seed 200 --model "$SMOL" --out "$OUT/heldout.jsonl"

echo "== base model on 50 held-out questions (greedy)"
[ -f "$OUT/eval-base/results.json" ] || $B eval --model "$SMOL" --data "$OUT/heldout.jsonl" "${AGENT[@]}" "${DT[@]}" --out "$OUT/eval-base" --overwrite

echo "== GRPO training (examples/demo-train.toml)"
if [ -f "$OUT/train/adapter/adapter_model.safetensors" ]; then
  echo "already trained: $OUT/train/adapter"
elif [ -d "$OUT/train/checkpoints" ]; then
  $B train --config examples/demo-train.toml --out "$OUT/train" --resume "$@"
else
  # a run stopped before its first checkpoint left a non-empty --out: start it over
  OVERWRITE=(); [ -d "$OUT/train" ] && OVERWRITE=(--overwrite)
  $B train --config examples/demo-train.toml --model "$SMOL" --data "$OUT/train.jsonl" --out "$OUT/train" "${OVERWRITE[@]}" "${DT[@]}" "$@"
fi

echo "== trained adapter on the same held-out questions (greedy)"
[ -f "$OUT/eval-trained/results.json" ] || $B eval --model "$SMOL" --adapter "$OUT/train/adapter" --data "$OUT/heldout.jsonl" "${AGENT[@]}" "${DT[@]}" --out "$OUT/eval-trained" --overwrite

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
b = json.load(open(f"{out}/eval-base/results.json"))["rows"][0]
t = json.load(open(f"{out}/eval-trained/results.json"))["rows"][0]
ms = [json.loads(l) for l in open(f"{out}/train/metrics.jsonl")]
k = max(1, len(ms) // 4)
first = sum(m["success_rate"] for m in ms[:k]) / k
last = sum(m["success_rate"] for m in ms[-k:]) / k
print(f"\nheld-out questions: {b['n']}")
print(f"{'':24}{'base':>10}{'trained':>10}")
for key in ["em", "sub_em", "f1"]:
    print(f"{key:24}{b[key]:>10.3f}{t[key]:>10.3f}")
print(f"{'mean gain (nats/token)':24}{b['mean_gain']:>+10.3f}{t['mean_gain']:>+10.3f}")
print(f"training success rate (sampled): first {k} steps {first:.2f}, last {k} steps {last:.2f}")
print(f"curves: {out}/train/curves.png; reports: {out}/eval-base, {out}/eval-trained")
PY
