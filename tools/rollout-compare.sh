#!/usr/bin/env bash
# A GRPO step's rollout phase, side by side: `infomem-engine rollout` against a plain PyTorch +
# transformers loop (tools/rollout_torch.py: HF `generate` per turn over all live conversations,
# no prefix sharing) on the same work, generated tokens per second of rollout time.
#
# usage: tools/rollout-compare.sh [--model DIR] [--engine-dtype f32|bf16] [--dtype float32|bfloat16]
#                                 [--repeat R] [--queries Q] [--group-size G] [--doc-tokens T]
#
#   defaults: SmolLM2-135M-Instruct from the cache, the engine in bf16, PyTorch in float32,
#   R = 3 seeds each side (median reported), Q = 2 queries x G = 4 rollouts, needle documents of
#   T = 512 tokens read in chunks of 256, memory <= 64 new tokens, answer <= 16, T = 1.0, the
#   demo's templates (examples/demo-templates.toml).
# Both sides sample (different streams), so their generated lengths differ; the rate is
# generated tokens / seconds spent in the memory updates and the final answers (the gain scoring
# is timed separately: `score_s`). Threads: the engine's default (all cores) and the same count
# for PyTorch. KEEP=DIR keeps the raw JSON lines (engine.jsonl, torch.jsonl) and the data.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${INFOMEM_CACHE:-$HOME/.cache/infomem-engine}"
MODEL="$CACHE/SmolLM2-135M-Instruct"
EDT=bf16
TDT=float32
REPEAT=3
Q=2
G=4
DOC=512
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --engine-dtype) EDT="$2"; shift 2 ;;
    --dtype) TDT="$2"; shift 2 ;;
    --repeat) REPEAT="$2"; shift 2 ;;
    --queries) Q="$2"; shift 2 ;;
    --group-size) G="$2"; shift 2 ;;
    --doc-tokens) DOC="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "rollout-compare: unknown argument: $1" >&2; exit 2 ;;
  esac
done
B="${INFOMEM_BIN:-target/release/infomem-engine}"
PY="${TORCH_PYTHON:-$CACHE/torch-venv/bin/python}"
[ -x "$B" ] || { echo "rollout-compare: no engine binary at $B (cargo build --release)" >&2; exit 2; }
[ -d "$MODEL" ] || { echo "rollout-compare: model directory not found: $MODEL" >&2; exit 2; }
"$PY" -c 'import torch, transformers' 2>/dev/null || { echo "rollout-compare: $PY lacks torch/transformers (see tools/bench-compare.sh)" >&2; exit 2; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
[ -n "${KEEP:-}" ] && trap 'mkdir -p "$KEEP" && cp "$TMP"/*.jsonl "$KEEP"/; rm -rf "$TMP"' EXIT
THREADS="$(nproc)"
AG=(--chunk-tokens 256 --memory-tokens 64 --answer-tokens 16 --temperature 1.0
    --templates examples/demo-templates.toml --extract first-number)
"$B" data synth --task needle --tokens "$DOC" --count "$Q" --seed 300 --model "$MODEL" --out "$TMP/docs.jsonl" >/dev/null 2>&1
# the host's bounds before and after (a shared VM's bandwidth moves within minutes); a binary
# without the `machine` subcommand leaves the files empty
"$B" machine 2>/dev/null | tail -n 1 > "$TMP/machine-before.txt" || true
for s in $(seq 1 "$REPEAT"); do
  "$B" rollout --model "$MODEL" --dtype "$EDT" --data "$TMP/docs.jsonl" --limit "$Q" --group-size "$G" "${AG[@]}" \
    --seed "$s" --out "$TMP/traj-$s.jsonl" --json 2>/dev/null | tail -n 1 >> "$TMP/engine.jsonl"
  "$PY" tools/rollout_torch.py --model "$MODEL" --dtype "$TDT" --data "$TMP/docs.jsonl" --queries "$Q" --group-size "$G" \
    --chunk-tokens 256 --memory-tokens 64 --answer-tokens 16 --temperature 1.0 \
    --templates examples/demo-templates.toml --threads "$THREADS" --seed "$s" --json 2>/dev/null | tail -n 1 >> "$TMP/torch.jsonl"
done
"$B" machine 2>/dev/null | tail -n 1 > "$TMP/machine-after.txt" || true
python3 - "$TMP" "$EDT" "$TDT" "$THREADS" "$Q" "$G" "$DOC" <<'PY'
import json, statistics, sys, platform
tmp, edt, tdt, threads, q, g, doc = sys.argv[1:]
def rows(f):
    return [json.loads(l) for l in open(f"{tmp}/{f}") if l.strip()]
e, t = rows("engine.jsonl"), rows("torch.jsonl")
er = [r["generated_tokens"] / (r["update_s"] + r["final_s"]) for r in e]
tr = [r["tokens_per_s"] for r in t]
em, tm = statistics.median(er), statistics.median(tr)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
print(f"rollout phase: {q} queries x {g} rollouts, {doc}-token needle documents in chunks of 256, memory <= 64, answer <= 16, T = 1.0; {cpu}, {threads} threads")
print("| side | generated tokens (per seed) | rollout s (per seed) | tokens/s (median) | gain scoring s |")
print("|---|---|---|---|---|")
def cells(rs, secs):
    gen = ", ".join(str(r["generated_tokens"]) for r in rs)
    sec = ", ".join("%.2f" % secs(r) for r in rs)
    return gen, sec, statistics.median(r["score_s"] for r in rs)
eg, es, esc = cells(e, lambda r: r["update_s"] + r["final_s"])
tg, ts, tsc = cells(t, lambda r: r["rollout_s"])
print(f"| infomem-engine ({edt}) | {eg} | {es} | {em:.1f} | {esc:.3f} |")
print(f"| PyTorch {t[0]['torch']} + transformers {t[0]['transformers']} ({tdt}, {t[0]['attn']} attention) | {tg} | {ts} | {tm:.1f} | {tsc:.3f} |")
# each seed runs the engine then PyTorch back to back: their ratio pairs the same minute
per = [a / b for a, b in zip(er, tr)]
print(f"\nengine / PyTorch: {em / tm:.2f}x (ratio of the medians; per seed, each pair back to back: {', '.join(f'{x:.2f}' for x in per)}; their median {statistics.median(per):.2f}x)")
host = lambda f: open(f"{tmp}/{f}").read().strip() or "n/a"
print(f"host's bounds (infomem-engine machine), before: {host('machine-before.txt')}; after: {host('machine-after.txt')}")
PY
