#!/usr/bin/env bash
# Data of the memory-agent study at length (examples/study-long.toml, issue 55): multikey
# questions (a fact and a decoy about someone else, at any chunk), 5-digit answers, SmolLM2's
# tokenizer, half procedural and half essay filler (tools/fetch-haystack.sh first).
#
#   train-curriculum.jsonl  48 documents of 256 tokens (2 chunks of 128), then 192 of 512 (4 chunks),
#                           each stage alternating the two fillers: read in the file's order
#                           (data_order = "file"), the steps go from 2 to 4 chunks
#   train-4chunks.jsonl     240 documents of 512 tokens (the no-curriculum ablation)
#   train-curriculum-8.jsonl  48 of 256 tokens, 96 of 512, then 96 of 1,024 (8 chunks): the
#                           curriculum to 8 chunks (examples/study-long-ablate.toml, arm curriculum-8)
#   valid-512.jsonl         100 of 512 tokens, both fillers (β is chosen on it)
#   heldout-{procedural,essays}-{512,1024,2048,4096,8192}.jsonl
#                           100 questions per filler and length: 1×, 2×, 4×, 8×, 16× the training
#                           length; every arm answers the same questions (paired)
#   heldout-{procedural,essays}-16384.jsonl
#                           100 per filler at 16,384 tokens: 16× the 8-chunk stage (study-long-8)
#
# Usage: tools/make-long-data.sh [OUT_DIR]   (default runs/study-long; existing files are kept)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/study-long}"
B="${INFOMEM_BIN:-target/release/infomem-engine}"
M="${SMOL_DIR:-${INFOMEM_CACHE:-$HOME/.cache/infomem-engine}/SmolLM2-135M-Instruct}"
[[ -x "$B" ]] || { echo "make-long-data: $B not found: cargo build --release" >&2; exit 1; }
[[ -d "$M" ]] || { echo "make-long-data: $M not found: tools/fetch-smollm2.sh" >&2; exit 1; }
mkdir -p "$OUT/parts"
synth() { # filler tokens count seed file
    [[ -f "$5" ]] || "$B" data synth --task multikey --distractors 1 --filler "$1" --tokens "$2" --count "$3" --seed "$4" --model "$M" --out "$5" >&2
}
# interleave two JSONL files line by line (a, b, a, b, ...) into a new file
interleave() {
    [[ -f "$3" ]] || python3 - "$1" "$2" "$3" <<'PY'
import sys
a, b = (open(p).read().splitlines() for p in sys.argv[1:3])
out = [x for pair in zip(a, b) for x in pair] + a[len(b):] + b[len(a):]
with open(sys.argv[3] + ".tmp", "w") as f:
    f.write("\n".join(out) + "\n")
import os; os.replace(sys.argv[3] + ".tmp", sys.argv[3])
PY
}
P="$OUT/parts"
synth procedural 256 24 100 "$P/train-256-p.jsonl"; synth essays 256 24 101 "$P/train-256-e.jsonl"
synth procedural 512 120 102 "$P/train-512-p.jsonl"; synth essays 512 120 103 "$P/train-512-e.jsonl"
interleave "$P/train-256-p.jsonl" "$P/train-256-e.jsonl" "$P/stage-256.jsonl"
interleave "$P/train-512-p.jsonl" "$P/train-512-e.jsonl" "$P/stage-512.jsonl"
[[ -f "$OUT/train-curriculum.jsonl" ]] || { cat "$P/stage-256.jsonl" <(head -n 192 "$P/stage-512.jsonl") > "$OUT/train-curriculum.jsonl.tmp" && mv "$OUT/train-curriculum.jsonl.tmp" "$OUT/train-curriculum.jsonl"; }
[[ -f "$OUT/train-4chunks.jsonl" ]] || cp "$P/stage-512.jsonl" "$OUT/train-4chunks.jsonl"
synth procedural 1024 48 104 "$P/train-1024-p.jsonl"; synth essays 1024 48 105 "$P/train-1024-e.jsonl"
interleave "$P/train-1024-p.jsonl" "$P/train-1024-e.jsonl" "$P/stage-1024.jsonl"
[[ -f "$OUT/train-curriculum-8.jsonl" ]] || { cat "$P/stage-256.jsonl" <(head -n 96 "$P/stage-512.jsonl") "$P/stage-1024.jsonl" > "$OUT/train-curriculum-8.jsonl.tmp" && mv "$OUT/train-curriculum-8.jsonl.tmp" "$OUT/train-curriculum-8.jsonl"; }
synth procedural 512 50 150 "$P/valid-p.jsonl"; synth essays 512 50 151 "$P/valid-e.jsonl"
interleave "$P/valid-p.jsonl" "$P/valid-e.jsonl" "$OUT/valid-512.jsonl"
seed=300
for f in procedural essays; do
    for n in 512 1024 2048 4096 8192; do
        synth "$f" "$n" 100 "$seed" "$OUT/heldout-$f-$n.jsonl"
        seed=$((seed + 1))
    done
done
# 16× the 8-chunk recipe's last stage (examples/study-long-8.toml)
synth procedural 16384 100 310 "$OUT/heldout-procedural-16384.jsonl"
synth essays 16384 100 311 "$OUT/heldout-essays-16384.jsonl"
wc -l "$OUT"/*.jsonl >&2
