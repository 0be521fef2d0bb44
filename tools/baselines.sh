#!/usr/bin/env bash
# Baseline accuracy of the untrained memory agent (docs/RESULTS.md, "Baselines"): SmolLM2-135M-Instruct on
# needle and multihop at 2K, 4K and 8K tokens, 50 questions each, chunks of 512 tokens, greedy,
# the default templates of docs/DESIGN.md §1.1. About an hour on 2 CPU cores.
# Usage: tools/baselines.sh [OUT_DIR] [extra eval flags, e.g. --adapter DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/baselines}"
shift || true
mkdir -p "$OUT"
cargo build --release
SMOL="$(tools/fetch-smollm2.sh | tail -n 1)"
B=target/release/infomem-engine
files=()
for task in needle multihop; do
  for t in 2048 4096 8192; do
    f="$OUT/$task-$t.jsonl"
    [ -f "$f" ] || $B data synth --task "$task" --tokens "$t" --count 50 --seed $((t + 7)) --model "$SMOL" --out "$f"
    files+=("$f")
  done
done
# an --out that already holds results is refused: a finished run is reported as it stands
[ -f "$OUT/eval/results.json" ] && { echo "already evaluated: $OUT/eval (remove it to run again)"; exit 0; }
$B eval --model "$SMOL" --data "${files[@]}" --chunk-tokens 512 --memory-tokens 128 --answer-tokens 32 \
  --batch-queries 50 --out "$OUT/eval" "$@"
