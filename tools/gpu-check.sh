#!/usr/bin/env bash
# The GPU check of infomem-engine's CUDA backend, in two halves:
#
#   tools/gpu-check.sh build   # here (Rust, nvcc): build the CUDA binaries and pack gpu-bundle/
#   tools/gpu-check.sh run     # on the GPU machine, from the repo root with gpu-bundle/ carried
#
# `build` runs `cargo build --release --features cuda` and `cargo test --release --features cuda
# --no-run` in their own target directory (${INFOMEM_CUDA_TARGET:-target/cuda}, so a concurrent
# CPU build cannot replace the binary), and copies into gpu-bundle/ (gitignored, < 60 MB): the
# engine binary and the cuda_parity test binary (debug info stripped), and the path the tests
# were built in.
#
# `run` needs only the GPU machine's image (CUDA 13.0 driver, Python 3.12 + torch 2.11 +
# transformers 5; no Rust, no network). It stops with a clear line when no GPU is visible.
# Otherwise, with a time limit per step (the whole run stays under 8 minutes):
#   1. the CUDA parity tests (INFOMEM_REQUIRE_CUDA=1: a missing device fails instead of skipping);
#   2. random-weight Qwen2 0.5B and 3B models (tools/make_random_model.py: seeded, bf16);
#   3. for each model, infomem-engine `bench --backend cuda` and tools/bench_torch.py
#      (--device cuda --dtype bfloat16) on: score 8 × 4096 tokens (log-probs of the last 64),
#      decode batch 64 (prompt 1024, 256 new tokens), decode batch 1 (same);
#   4. $OUT/summary.md: tokens/s ours vs torch, the ratio, and each side's fraction of the
#      roofline (decode: weights + KV bytes per step over 4.3 TB/s, prefill included as FLOPs;
#      score: FLOPs over 790 TFLOP/s bf16); next to it parity.log, bench.jsonl (every JSON line),
#      steps.txt (status and seconds per step) and logs.tar.gz (every step's full log) — 7 files,
#      within what the device tool brings back from $OUT.
# OUT defaults to ./gpu-check-out. The cuBLAS libraries come from the torch environment's
# site-packages/nvidia/*/lib folders (put on LD_LIBRARY_PATH).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUNDLE="$ROOT/gpu-bundle"

die() { echo "gpu-check: $*" >&2; exit 2; }

build() {
  set -e
  command -v cargo >/dev/null || die "cargo not found (the build half runs on a machine with Rust)"
  export CARGO_TARGET_DIR="${INFOMEM_CUDA_TARGET:-$ROOT/target/cuda}"
  cargo build --release --features cuda
  local json
  json="$(cargo test --release --features cuda --no-run --message-format=json)"
  local parity
  parity="$(printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_parity":
        print(m["executable"])
')"
  [ -n "$parity" ] || die "cargo did not report the cuda_parity test executable"
  local bin="$CARGO_TARGET_DIR/release/infomem-engine"
  if grep -aqF 'nvcc was not found at build time' "$bin"; then
    die "the binary was built without kernels (nvcc not found): run tools/install-nvcc.sh first"
  fi
  grep -aqF 'attention_hd64_bf16' "$bin" || die "$bin has no CUDA kernels embedded"
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE"
  cp "$bin" "$BUNDLE/infomem-engine"
  cp "$parity" "$BUNDLE/cuda_parity"
  if command -v strip >/dev/null; then strip --strip-debug "$BUNDLE/infomem-engine" "$BUNDLE/cuda_parity"; fi
  # the tests find tests/fixtures through the absolute path they were built in
  printf '%s\n' "$ROOT" > "$BUNDLE/manifest_dir"
  git rev-parse HEAD > "$BUNDLE/commit" 2>/dev/null || echo unknown > "$BUNDLE/commit"
  du -sh "$BUNDLE"/* | sed 's/^/gpu-check build: /'
  local total
  total="$(du -sm "$BUNDLE" | cut -f1)"
  [ "$total" -le 60 ] || die "gpu-bundle is ${total} MB (over 60 MB)"
  echo "gpu-check build: ok — carry gpu-bundle/ to the GPU machine and run: tools/gpu-check.sh run"
}

# ---------------------------------------------------------------------------------------------

START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-460}
elapsed() { echo $(( $(date +%s) - START )); }

# step NAME TIMEOUT CMD...: run with a time limit, log to $OUT/NAME.log, record the status.
step() {
  local name="$1" limit="$2"; shift 2
  local left=$(( BUDGET - $(elapsed) ))
  if [ "$left" -le 10 ]; then
    echo "skipped (time budget)" > "$LOGS/$name.log"
    echo "$name skipped-budget" >> "$OUT/steps.txt"
    echo "gpu-check: $name skipped: the time budget is spent" >&2
    return 1
  fi
  [ "$limit" -le "$left" ] || limit="$left"
  echo "gpu-check: [$(elapsed)s] $name (limit ${limit}s)" >&2
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc secs=$(( $(date +%s) - t0 ))" >> "$OUT/steps.txt"
  [ "$rc" = 0 ] || { echo "gpu-check: $name failed (rc $rc); last lines:" >&2; tail -n 15 "$LOGS/$name.log" >&2; }
  return "$rc"
}

run() {
  OUT="${OUT:-$ROOT/gpu-check-out}"
  LOGS="$OUT/logs"
  mkdir -p "$OUT" "$LOGS"
  : > "$OUT/steps.txt"
  [ -x "$BUNDLE/infomem-engine" ] && [ -x "$BUNDLE/cuda_parity" ] || die "no gpu-bundle/ here: run 'tools/gpu-check.sh build' on the build machine and carry gpu-bundle/"
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no GPU visible (nvidia-smi lists no device): nothing to check here; stopping." | tee "$OUT/summary.md" >&2
    exit 3
  fi
  nvidia-smi -L | tee "$OUT/gpu.txt"
  local PY="${TORCH_PYTHON:-python3}"
  "$PY" -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null \
    || die "$PY has no CUDA-enabled torch + transformers"
  # cuBLAS / cuBLASLt (CUDA 13) from the torch environment
  local libs
  libs="$("$PY" - <<'PYEOF'
import glob, os
import nvidia
dirs = []
for base in nvidia.__path__:
    dirs += sorted(glob.glob(os.path.join(base, "*", "lib")))
print(":".join(d for d in dirs if os.path.isdir(d)))
PYEOF
)"
  export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" > "$OUT/env.txt"
  # the parity tests read tests/fixtures through the absolute path they were built in
  local built
  built="$(cat "$BUNDLE/manifest_dir")"
  if [ "$built" != "$ROOT" ] && [ ! -e "$built" ]; then
    mkdir -p "$(dirname "$built")" && ln -s "$ROOT" "$built"
  fi
  export PYTHONUNBUFFERED=1

  step parity 180 env INFOMEM_REQUIRE_CUDA=1 RUST_BACKTRACE=1 "$BUNDLE/cuda_parity" --test-threads=1 --nocapture
  local parity_rc=$?

  local MODELS="${GPU_CHECK_MODELS:-qwen2-0.5b qwen2-3b}"
  local MDIR="${GPU_CHECK_MODEL_DIR:-/tmp/infomem-gpu-check}"
  mkdir -p "$MDIR"
  : > "$OUT/bench.jsonl"
  for shape in $MODELS; do
    local dir="$MDIR/$shape"
    if [ ! -f "$dir/config.json" ]; then
      step "make-$shape" 150 "$PY" tools/make_random_model.py --shape "$shape" --out "$dir" || continue
    fi
    # name  engine flags (score / decode)                  torch flags
    while read -r name work args; do
      step "ours-$shape-$name" 150 "$BUNDLE/infomem-engine" bench --model "$dir" --backend cuda --work "$work" $args --json \
        && tail -n 1 "$LOGS/ours-$shape-$name.log" | sed "s/^{/{\"shape\":\"$shape\",\"case\":\"$name\",/" >> "$OUT/bench.jsonl"
      step "torch-$shape-$name" 150 "$PY" tools/bench_torch.py --model "$dir" --work "$work" --device cuda --dtype bfloat16 $args --json \
        && tail -n 1 "$LOGS/torch-$shape-$name.log" | sed "s/^{/{\"shape\":\"$shape\",\"case\":\"$name\",/" >> "$OUT/bench.jsonl"
    done <<'CASES'
score-8x4096 score --batch 8 --seq-len 4096 --score-last 64
decode-b64 decode --batch 64 --seq-len 1024 --new-tokens 256
decode-b1 decode --batch 1 --seq-len 1024 --new-tokens 256
CASES
  done

  "$PY" - "$OUT" "$MDIR" "$parity_rc" "$(cat "$BUNDLE/commit")" <<'PYEOF' > "$OUT/summary.md"
import json, os, sys
out, mdir, parity_rc, commit = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
HBM, BF16 = 4.3e12, 790e12  # measured copy bandwidth and bf16 matrix rate on this machine kind

def shape_numbers(shape):
    c = json.load(open(os.path.join(mdir, shape, "config.json")))
    d, L, V, I = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or d // nh
    per_layer = d * (nh * hd + 2 * nkv * hd) + (nh * hd + 2 * nkv * hd) + nh * hd * d + 3 * d * I + 2 * d
    body = L * per_layer + d
    head = V * d  # tied or not, the head is a V x d product
    return dict(d=d, L=L, V=V, nh=nh, nkv=nkv, hd=hd, body=body, head=head)

def attn_flops(s, t_ctx0, n_new):
    # causal attention: QK^T and PV, 2 FLOPs per MAC, for n_new queries after t_ctx0 cached keys
    keys = n_new * t_ctx0 + n_new * (n_new + 1) / 2
    return 4 * s["L"] * s["nh"] * s["hd"] * keys

def ideal_seconds(s, r):
    B = r["batch"]
    if r["work"] == "score":
        T, last = r["seq_len"], r.get("score_last") or 64
        fl = 2 * s["body"] * B * T + B * attn_flops(s, 0, T) + 2 * s["head"] * B * last
        return fl / BF16
    P, N = r.get("seq_len") or r.get("prompt_len"), r["new_tokens"]
    fl = 2 * s["body"] * B * P + B * attn_flops(s, 0, P) + 2 * s["head"] * B
    t = fl / BF16
    kv_tok = s["L"] * 2 * s["nkv"] * s["hd"] * 2  # bf16 K and V, all layers
    wbytes = 2 * (s["body"] + s["head"])
    for i in range(1, N):  # decode steps (the first new token comes from the prefill)
        t += (wbytes + B * (P + i) * kv_tok) / HBM
    return t

rows = {}
for line in open(os.path.join(out, "bench.jsonl")):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    r.setdefault("seq_len", r.get("prompt_len"))
    key = (r["shape"], r["case"])
    rows.setdefault(key, {})["ours" if r["impl"] == "infomem-engine" else "torch"] = r

print(f"# infomem-engine GPU check ({commit[:12]})\n")
gpu = open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(os.path.join(out, "gpu.txt")) else "?"
print(f"GPU: {gpu}  \nCUDA parity tests: {'passed' if parity_rc == 0 else f'FAILED (rc {parity_rc}, see parity.log)'}\n")
print("| model | workload | ours tok/s | torch tok/s | ours/torch | ours roofline | torch roofline |")
print("|---|---|---:|---:|---:|---:|---:|")
for (shape, case), v in sorted(rows.items()):
    s = shape_numbers(shape)
    o, t = v.get("ours"), v.get("torch")
    base = o or t
    ideal = ideal_seconds(s, base)
    def f(r):
        return f"{r['tokens_per_s']:.0f}" if r else "—"
    def roof(r):
        return f"{ideal / r['seconds']:.1%}" if r else "—"
    ratio = f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}×" if o and t else "—"
    print(f"| {shape} | {case} | {f(o)} | {f(t)} | {ratio} | {roof(o)} | {roof(t)} |")
print("\nRoofline: score = FLOPs (2·params·tokens + causal attention + head on the scored rows) / 790 TFLOP/s;")
print("decode = prefill FLOPs / 790 TFLOP/s + Σ_steps (bf16 weights + K/V read) / 4.3 TB/s. Fraction = ideal / measured.")
print("\nSteps (rc, seconds):\n")
for line in open(os.path.join(out, "steps.txt")):
    print(f"- {line.strip()}")
PYEOF
  cp "$LOGS/parity.log" "$OUT/parity.log" 2>/dev/null || true
  tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
  cat "$OUT/summary.md"
  echo "gpu-check: done in $(elapsed)s; logs in $OUT"
  [ "$parity_rc" = 0 ]
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
