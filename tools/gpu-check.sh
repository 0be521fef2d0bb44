#!/usr/bin/env bash
# The GPU check of infomem-engine's CUDA backend, in three parts:
#
#   tools/gpu-check.sh build   # here (Rust, nvcc): build the CUDA binaries and pack gpu-bundle/
#   tools/gpu-check.sh run     # on the GPU machine, from the repo root with gpu-bundle/ carried
#   tools/gpu-check.sh train   # on the GPU machine: a short InfoMem GRPO training run on the GPU
#
# `build` runs `cargo build --release --features cuda` and `cargo test --release --features cuda
# --no-run` in their own target directory (${INFOMEM_CUDA_TARGET:-target/cuda}, so a concurrent
# CPU build cannot replace the binary), and copies into gpu-bundle/ (gitignored, < 60 MB): the
# engine binary, the cuda_parity and cuda_train_parity test binaries (debug info stripped), and
# the path the tests were built in.
#
# `run` needs only the GPU machine's image (CUDA 13.0 driver, Python 3.12 + torch 2.11 +
# transformers 5 + peft; no Rust, no network). It stops with a clear line when no GPU is
# visible. Otherwise, with a time limit per step (the whole run stays under 8 minutes; steps past
# the budget are skipped and listed):
#   1. the CUDA parity tests, forward (cuda_parity) and training (cuda_train_parity), with
#      INFOMEM_REQUIRE_CUDA=1: a missing device fails instead of skipping;
#   2. random-weight Qwen2 0.5B and 3B models (tools/make_random_model.py: seeded, bf16);
#   3. for each model, infomem-engine `bench --backend cuda` and tools/bench_torch.py
#      (--device cuda --dtype bfloat16; PyTorch + PEFT with SDPA for train) on: train 8 × 4096
#      tokens (LoRA r16 on all projections, GRPO loss on the last 128 of each, one forward +
#      backward), score 8 × 4096 tokens (log-probs of the last 64), decode batch 64 (prompt 1024,
#      256 new tokens), decode batch 1 (same);
#   4. $OUT/summary.md: tokens/s ours vs torch, the ratio, and each side's fraction of the
#      roofline — train: model-FLOPs utilization (formula below the table), score: FLOPs over
#      790 TFLOP/s bf16, decode: weights + KV bytes per step over 4.3 TB/s with the prefill as
#      FLOPs; next to it parity.log, bench.jsonl (every JSON line), steps.txt (status and
#      seconds per step) and logs.tar.gz (every step's full log).
# `train` makes a SmolLM2-135M-shaped random-weight model with a byte-level tokenizer and the
# SmolLM2 chat template (the GPU machine has no network), synthetic needle data with
# `infomem-engine data synth`, and runs `train --backend cuda` for GPU_CHECK_TRAIN_STEPS (12)
# steps with --reward infomem-all and a KL term (so every step has a learning signal even from a
# random model), then `rollout` and `eval` with the trained adapter on the GPU and, when peft is
# importable, tools/check_peft.py on the exported adapter. $OUT/train-summary.md: the reward
# curve and the step time split (rollout / scoring / update) from metrics.jsonl. Under 5 minutes.
# GPU_CHECK_BACKEND=cpu GPU_CHECK_TRAIN_SHAPE=tiny runs the same pipeline on the CPU (a dry run
# of the script where there is no GPU; needs a CPU build in gpu-bundle/ or BIN=...).
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
  local exe
  exe() {
    printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$1"
  }
  local parity train_parity
  parity="$(exe cuda_parity)"
  train_parity="$(exe cuda_train_parity)"
  [ -n "$parity" ] || die "cargo did not report the cuda_parity test executable"
  [ -n "$train_parity" ] || die "cargo did not report the cuda_train_parity test executable"
  local bin="$CARGO_TARGET_DIR/release/infomem-engine"
  if grep -aqF 'nvcc was not found at build time' "$bin"; then
    die "the binary was built without kernels (nvcc not found): run tools/install-nvcc.sh first"
  fi
  grep -aqF 'attention_hd64_bf16' "$bin" || die "$bin has no CUDA kernels embedded"
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE"
  cp "$bin" "$BUNDLE/infomem-engine"
  cp "$parity" "$BUNDLE/cuda_parity"
  cp "$train_parity" "$BUNDLE/cuda_train_parity"
  if command -v strip >/dev/null; then strip --strip-debug "$BUNDLE/infomem-engine" "$BUNDLE/cuda_parity" "$BUNDLE/cuda_train_parity"; fi
  # the tests find tests/fixtures through the absolute path they were built in
  printf '%s\n' "$ROOT" > "$BUNDLE/manifest_dir"
  git rev-parse HEAD > "$BUNDLE/commit" 2>/dev/null || echo unknown > "$BUNDLE/commit"
  du -sh "$BUNDLE"/* | sed 's/^/gpu-check build: /'
  local total
  total="$(du -sm "$BUNDLE" | cut -f1)"
  [ "$total" -le 60 ] || die "gpu-bundle is ${total} MB (over 60 MB)"
  echo "gpu-check build: ok — carry gpu-bundle/ to the GPU machine and run: tools/gpu-check.sh run (then: tools/gpu-check.sh train)"
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

# The GPU machine's environment: a visible GPU (exit 3 with a clear line otherwise), torch with
# CUDA (as $PY), cuBLAS on LD_LIBRARY_PATH, the tests' fixture path. Sets OUT, LOGS, PY.
gpu_env() {
  local summary="$1"
  OUT="${OUT:-$ROOT/gpu-check-out}"
  LOGS="$OUT/logs"
  mkdir -p "$OUT" "$LOGS"
  : > "$OUT/steps.txt"
  [ -x "$BUNDLE/infomem-engine" ] && [ -x "$BUNDLE/cuda_parity" ] && [ -x "$BUNDLE/cuda_train_parity" ] \
    || die "no complete gpu-bundle/ here: run 'tools/gpu-check.sh build' on the build machine and carry gpu-bundle/"
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no GPU visible (nvidia-smi lists no device): nothing to check here; stopping." | tee "$OUT/$summary" >&2
    exit 3
  fi
  nvidia-smi -L | tee "$OUT/gpu.txt"
  PY="${TORCH_PYTHON:-python3}"
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
}

run() {
  gpu_env summary.md

  step parity 150 env INFOMEM_REQUIRE_CUDA=1 RUST_BACKTRACE=1 "$BUNDLE/cuda_parity" --test-threads=1 --nocapture
  local parity_rc=$?
  step train-parity 120 env INFOMEM_REQUIRE_CUDA=1 RUST_BACKTRACE=1 "$BUNDLE/cuda_train_parity" --test-threads=1 --nocapture
  local train_parity_rc=$?

  local MODELS="${GPU_CHECK_MODELS:-qwen2-0.5b qwen2-3b}"
  local MDIR="${GPU_CHECK_MODEL_DIR:-/tmp/infomem-gpu-check}"
  mkdir -p "$MDIR"
  : > "$OUT/bench.jsonl"
  for shape in $MODELS; do
    local dir="$MDIR/$shape"
    if [ ! -f "$dir/config.json" ]; then
      step "make-$shape" 150 "$PY" tools/make_random_model.py --shape "$shape" --out "$dir" || continue
    fi
    # name | work | engine flags | torch flags (the train workload names its loss tokens
    # --score-last on our side, --train-last on torch's). GPU_CHECK_CASES picks some by name.
    while IFS='|' read -r name work ours theirs; do
      case " ${GPU_CHECK_CASES:-train-8x4096 score-8x4096 decode-b64 decode-b1 rollout-n16} " in *" $name "*) ;; *) continue ;; esac
      # (stdin from /dev/null: the loop reads its cases from stdin)
      step "ours-$shape-$name" 150 "$BUNDLE/infomem-engine" bench --model "$dir" --backend cuda --work "$work" $ours --json </dev/null \
        && tail -n 1 "$LOGS/ours-$shape-$name.log" | sed "s/^{/{\"shape\":\"$shape\",\"case\":\"$name\",/" >> "$OUT/bench.jsonl"
      step "torch-$shape-$name" 150 "$PY" tools/bench_torch.py --model "$dir" --work "$work" --device cuda --dtype bfloat16 $theirs --json </dev/null \
        && tail -n 1 "$LOGS/torch-$shape-$name.log" | sed "s/^{/{\"shape\":\"$shape\",\"case\":\"$name\",/" >> "$OUT/bench.jsonl"
    done <<'CASES'
train-8x4096|train|--batch 8 --seq-len 4096 --score-last 128|--batch 8 --seq-len 4096 --train-last 128
score-8x4096|score|--batch 8 --seq-len 4096 --score-last 64|--batch 8 --seq-len 4096 --score-last 64
decode-b64|decode|--batch 64 --seq-len 1024 --new-tokens 256|--batch 64 --seq-len 1024 --new-tokens 256
decode-b1|decode|--batch 1 --seq-len 1024 --new-tokens 256|--batch 1 --seq-len 1024 --new-tokens 256
rollout-n16|rollout|--batch 16 --seq-len 2048 --new-tokens 512 --chunks 8|--rollout-n 16 --chunks 8 --chunk-tokens 2048 --memory-tokens 512
CASES
  done

  "$PY" - "$OUT" "$MDIR" "$parity_rc" "$(cat "$BUNDLE/commit")" "$train_parity_rc" <<'PYEOF' > "$OUT/summary.md"
import json, os, sys
out, mdir, parity_rc, commit, train_parity_rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
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

def train_flops(s, r):
    # LoRA training, one forward + backward: the frozen weights need the forward (2N per token)
    # and the input gradients (2N per token), not weight gradients (the LoRA ones are ~1e-3 of
    # that); attention is forward (QK^T, PV) plus its backward (2x the forward); the head only on
    # the loss rows, forward and input gradient. Recomputation is not counted (model FLOPs).
    B, T = r["batch"], r["seq_len"]
    last = r.get("score_last") or r.get("loss_tokens_per_seq") or 128
    return 4 * s["body"] * B * T + 3 * B * attn_flops(s, 0, T) + 4 * s["head"] * B * last

def ideal_seconds(s, r):
    B = r["batch"]
    if r["work"] == "train":
        return train_flops(s, r) / BF16
    if r["work"] == "score":
        T, last = r["seq_len"], r.get("score_last") or 64
        fl = 2 * s["body"] * B * T + B * attn_flops(s, 0, T) + 2 * s["head"] * B * last
        return fl / BF16
    kv_tok = s["L"] * 2 * s["nkv"] * s["hd"] * 2  # bf16 K and V, all layers
    wbytes = 2 * (s["body"] + s["head"])
    if r["work"] == "rollout":
        # per chunk: the section once (shared prefix) + each rollout's memory, then the memory's
        # decode steps; ideal for our shared-prefix schedule (PyTorch prefills the section n times)
        C, S, N = r.get("chunks") or 8, r["seq_len"], r["new_tokens"]
        t = 0.0
        for c in range(C):
            mem = 0 if c == 0 else N
            fl = 2 * s["body"] * (S + B * mem) + attn_flops(s, 0, S) + B * attn_flops(s, S, mem) + 2 * s["head"] * B
            t += fl / BF16
            for i in range(1, N):
                t += (wbytes + B * (S + mem + i) * kv_tok) / HBM
        return t
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
print(f"GPU: {gpu}  \nCUDA parity tests: {'passed' if parity_rc == 0 else f'FAILED (rc {parity_rc}, see parity.log)'}  ")
print(f"CUDA training parity tests: {'passed' if train_parity_rc == 0 else f'FAILED (rc {train_parity_rc}, see train-parity.log)'}\n")
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
print("\nRoofline: train = model-FLOPs utilization, FLOPs = 4·N·tokens (forward 2N + backward to the inputs 2N,")
print("N = non-embedding parameters; frozen weights get no weight gradient) + 3 × causal attention (forward")
print("4·L·heads·hd·T(T+1)/2 per sequence, backward twice that) + 4·V·d per loss token (head forward + input")
print("gradient), over 790 TFLOP/s bf16 (recomputation not counted); score = FLOPs (2·params·tokens + causal")
print("attention + head on the scored rows) / 790 TFLOP/s; decode = prefill FLOPs / 790 TFLOP/s + Σ_steps")
print("(bf16 weights + K/V read) / 4.3 TB/s; rollout = the same per chunk with the section prefilled once")
print("(n = 16 rollouts, 8 chunks of 2048 tokens, 512 memory tokens). Fraction = ideal / measured.")
print("\nSteps (rc, seconds):\n")
for line in open(os.path.join(out, "steps.txt")):
    print(f"- {line.strip()}")
PYEOF
  cp "$LOGS/parity.log" "$OUT/parity.log" 2>/dev/null || true
  cp "$LOGS/train-parity.log" "$OUT/train-parity.log" 2>/dev/null || true
  tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
  cat "$OUT/summary.md"
  echo "gpu-check: done in $(elapsed)s; logs in $OUT"
  [ "$parity_rc" = 0 ] && [ "$train_parity_rc" = 0 ]
}

# ---------------------------------------------------------------------------------------------
# train: a short InfoMem training run on the GPU

train() {
  local backend="${GPU_CHECK_BACKEND:-cuda}"
  BUDGET=${GPU_CHECK_BUDGET_S:-290}
  if [ "$backend" = cuda ]; then
    gpu_env train-summary.md
  else
    OUT="${OUT:-$ROOT/gpu-check-out}"; LOGS="$OUT/logs"; mkdir -p "$OUT" "$LOGS"; : > "$OUT/steps.txt"
    PY="${TORCH_PYTHON:-python3}"
  fi
  local BIN="${BIN:-$BUNDLE/infomem-engine}"
  [ -x "$BIN" ] || die "no engine binary at $BIN"
  local shape="${GPU_CHECK_TRAIN_SHAPE:-smollm2}"
  local W="${GPU_CHECK_TRAIN_DIR:-/tmp/infomem-gpu-train}"
  rm -rf "$W" && mkdir -p "$W"
  local steps="${GPU_CHECK_TRAIN_STEPS:-12}"

  # 1. a random-weight model with a byte-level tokenizer and SmolLM2's chat template
  step make-model 120 "$PY" - "$W/model" "$shape" "$backend" "$ROOT/tests/fixtures/smollm2-hf-meta/chat_template.jinja" <<'PYEOF' || return 1
import json, os, shutil, sys
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
out, shape, backend, template = sys.argv[1:5]
# SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads of 64) with a vocabulary of 320: 3
# specials + 256 bytes (+ 61 unused ids); "tiny" is a 2-layer version for dry runs on a CPU
dims = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
if shape == "tiny":
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
cfg = LlamaConfig(vocab_size=320, head_dim=64 if shape != "tiny" else 16, tie_word_embeddings=True, rope_theta=1e5,
                  rms_norm_eps=1e-5, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0, **dims)
torch.manual_seed(0)
with torch.device("cuda" if backend == "cuda" else "cpu"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
# GPT-2's byte -> printable-char map (the ByteLevel alphabet), as tests/common/mod.rs writes it
bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
cs = bs[:]
n = 0
for b in range(256):
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
byte_char = dict(zip(bs, cs))
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
vocab = {s: i for i, s in enumerate(specials)}
for b in range(256):
    vocab[chr(byte_char[b])] = 3 + b
added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
         for i, s in enumerate(specials)]
tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
       "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
       "post_processor": None,
       "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                 "fuse_unk": False, "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": []}}
json.dump(tok, open(os.path.join(out, "tokenizer.json"), "w"))
json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, open(os.path.join(out, "tokenizer_config.json"), "w"))
shutil.copy(template, os.path.join(out, "chat_template.jinja"))
print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {out}", file=sys.stderr)
PYEOF

  # 2. synthetic long documents (~1500 tokens = 3 chunks of 512) measured by that tokenizer
  step data 60 "$BIN" data synth --task needle --tokens 1500 --count 32 --seed 1 --model "$W/model" --out "$W/train.jsonl" || return 1
  step data-eval 60 "$BIN" data synth --task needle --tokens 1500 --count 8 --seed 2 --model "$W/model" --out "$W/eval.jsonl" || return 1

  # 3. GRPO on the GPU: infomem-all puts the gain on every rollout and the KL term trains every
  # conversation, so a random model's steps are never skipped for lack of signal
  step train "$(( BUDGET - 60 ))" "$BIN" train --backend "$backend" --model "$W/model" --data "$W/train.jsonl" --out "$W/run" \
    --steps "$steps" --queries-per-step 4 --group-size 4 --chunk-tokens 512 --memory-tokens 64 --answer-tokens 16 \
    --reward infomem-all --kl-coef 0.01 --lr 1e-4 --warmup-steps 1 --micro-batch-tokens 8192 --max-batch-tokens 8192 \
    --save-every 4 --seed 3
  local train_rc=$?
  cp "$W/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null || true
  cp "$W/run/curves.png" "$OUT/curves.png" 2>/dev/null || true

  # 4. the trained adapter through rollout and eval on the same backend, and PEFT's view of it
  if [ "$train_rc" = 0 ]; then
    step rollout 60 "$BIN" rollout --backend "$backend" --model "$W/model" --adapter "$W/run/adapter" --data "$W/eval.jsonl" \
      --limit 4 --group-size 2 --chunk-tokens 512 --memory-tokens 64 --answer-tokens 16 --out "$W/rollout.jsonl" --json
    step eval 60 "$BIN" eval --backend "$backend" --model "$W/model" --adapter "$W/run/adapter" --data "$W/eval.jsonl" \
      --limit 4 --chunk-tokens 512 --memory-tokens 64 --answer-tokens 16 --out "$W/eval" --json
    if "$PY" -c 'import peft' 2>/dev/null; then
      step check-peft 60 "$PY" tools/check_peft.py --model "$W/model" --adapter "$W/run/adapter" --bin "$BIN"
    else
      echo "check-peft skipped-no-peft" >> "$OUT/steps.txt"
    fi
  fi

  "$PY" - "$OUT" "$backend" "$shape" "$train_rc" <<'PYEOF' > "$OUT/train-summary.md"
import json, os, sys
out, backend, shape, rc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
print(f"# infomem-engine train on {backend} ({shape}-shape random model, byte-level tokenizer)\n")
print(f"train exit status: {rc}\n")
path = os.path.join(out, "metrics.jsonl")
ms = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
if ms:
    print("| step | reward | success | gain | loss | kl | grad norm | rollout s | score s | update s | step s | train tok/s | skipped |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    f = lambda v, p=3: "—" if v is None else f"{v:.{p}f}"
    e = lambda v: "—" if v is None else f"{v:.2e}"
    for m in ms:
        print(f"| {m['step']} | {f(m['reward_mean'], 4)} | {f(m['success_rate'])} | {f(m['gain_mean'], 4)} | {f(m['loss'], 4)} | "
              f"{e(m['kl_mean'])} | {f(m.get('grad_norm'), 4)} | {f(m['rollout_s'], 2)} | {f(m['score_s'], 2)} | "
              f"{f(m['update_s'], 2)} | {f(m['step_s'], 2)} | {f(m['train_tokens_per_s'], 0)} | {m.get('skipped') or ''} |")
    tot = {k: sum(m[k] or 0 for m in ms) for k in ("rollout_s", "score_s", "update_s", "step_s")}
    st = max(tot["step_s"], 1e-9)
    print(f"\nTime split over {len(ms)} steps ({tot['step_s']:.1f} s): rollout {100 * tot['rollout_s'] / st:.0f}%, "
          f"scoring {100 * tot['score_s'] / st:.0f}%, update {100 * tot['update_s'] / st:.0f}%, "
          f"other (rewards, bookkeeping, checkpoints) {100 * (st - tot['rollout_s'] - tot['score_s'] - tot['update_s']) / st:.0f}%.")
    upd = [m for m in ms if not m.get("skipped")]
    print(f"Updates applied: {len(upd)} of {len(ms)} steps.  ")
    print("Reward curve: " + ", ".join(f"{m['reward_mean']:.4f}" for m in ms) + "  ")
    print("Answer-gain curve (nats/token; the learning signal a random model can move): " + ", ".join(f"{m['gain_mean']:+.4f}" for m in ms))
else:
    print("no metrics.jsonl (see logs.tar.gz)")
print("\nSteps (rc, seconds):\n")
for line in open(os.path.join(out, "steps.txt")):
    print(f"- {line.strip()}")
PYEOF
  cp "$LOGS/train.log" "$OUT/train.log" 2>/dev/null || true
  tar czf "$OUT/train-logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
  cat "$OUT/train-summary.md"
  echo "gpu-check train: done in $(elapsed)s; results in $OUT"
  [ "$train_rc" = 0 ]
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  train) train ;;
  *) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
