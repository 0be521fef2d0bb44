#!/usr/bin/env bash
# The GPU check of infomem-engine's CUDA backend, in stages that fit a short GPU window.
#
# On the build machine (Rust + nvcc, no GPU needed; ~6 min on 2 cores):
#   tools/gpu-check.sh build       CUDA release binary + the CUDA parity test binary -> gpu-bundle/
#                                  (gitignored, < 60 MB; carried to the GPU machine)
#
# On the GPU machine, from the repository root, with gpu-bundle/ beside the source tree.
# Run them in this order; each is one command with its own time limit, writes $OUT/summary.md
# (rewritten after every step, so a stopped stage still says what finished) and $OUT/log.txt
# (every step's output, streamed as it runs), at most 8 files in all:
#   tools/gpu-check.sh contact     <= 4 min. The environment (driver, CUDA, which libcuda and
#                                  libcublasLt were loaded and from where, free memory, the
#                                  allocator in use), then the conformance probes (ex2/rcp.approx,
#                                  rcp.rn, bf16 conversions, one mma.sync tile: the GPU against the
#                                  emulator's models, every difference listed), then every CUDA parity test, inference and
#                                  training (failures rerun alone to tell them from collateral),
#                                  then compute-sanitizer memcheck and racecheck on the paged- and
#                                  dense-attention tests where it exists, then the plain-allocation
#                                  fallback (the device report, a whole model, the allocator test),
#                                  then, while time is left, compute-sanitizer on Qwen3's q/k-norm
#                                  RoPE kernels (forward and backward tests).
#                                  Files: summary.md log.txt steps.jsonl meta.json device.json
#                                  conformance.json.
#                                  Exit 0 only if every parity test passed in the one process.
#   tools/gpu-check.sh bench       <= 5 min. Ours vs PyTorch + transformers (SDPA) + PEFT on the
#                                  same GPU and the same random weights, shape by shape in this
#                                  order while time is left (a shape not reached is skipped):
#                                  Qwen2-0.5B: score 8x4096, decode batch 64 and batch 1 (prompt
#                                  1024, 256 new), the memory-agent rollout (16 rollouts, 4 chunks
#                                  of 2048, memory 256), train 8x4096 (LoRA r16, loss on the last
#                                  128 of each); Qwen3-1.7B, then Qwen3-4B (q/k norms, head_dim
#                                  128): short cases, score 8x2048, decode batch 16 (prompt 512,
#                                  64 new), train 4x2048; Qwen2-3B: score/decode/train as 0.5B's
#                                  (PyTorch train with gradient checkpointing there: without it
#                                  8x4096 needs ~144 GB). Tokens/s, the ratio and each side's
#                                  roofline fraction. Files: summary.md log.txt steps.jsonl
#                                  meta.json bench.jsonl.
#   tools/gpu-check.sh train       <= 3 min. A few GRPO + InfoMem steps on the GPU (SmolLM2-135M-
#                                  shaped random model, byte-level tokenizer, synthetic needle
#                                  data), the rollout / scoring / update split per step, then
#                                  rollout, eval and PEFT's check of the trained adapter. Files:
#                                  summary.md log.txt steps.jsonl meta.json metrics.jsonl curves.png.
# With the project's `device` tool: call run with command "tools/gpu-check.sh contact",
# carry ["gpu-bundle"] and timeout_s 270 (bench: 330, train: 210; each stage stops itself
# 30 s before that and prints its summary). Read summary.md first, log.txt for details.
#
# Anywhere (CI runs it):
#   tools/gpu-check.sh selftest    the summary and roofline code (tools/gpu_check_summary.py) on
#                                  recorded runs in tools/gpu-check-selftest/: success, our
#                                  failure, PyTorch's failure, a half-finished stage.
#
# Environment: OUT (results; default ./gpu-check-out/<stage>), TORCH_PYTHON (default python3),
# GPU_CHECK_BUDGET_S (the stage's own budget), GPU_CHECK_MODELS (the bench shapes, in order;
# default "qwen2-0.5b qwen3-1.7b qwen3-4b qwen2-3b", any of tools/bench_torch.py's SHAPES),
# GPU_CHECK_CASES (bench case names to run), GPU_CHECK_TRAIN_STEPS (8),
# GPU_CHECK_BACKEND=cpu GPU_CHECK_TRAIN_SHAPE=tiny (a CPU dry run of `train`, BIN=... to pick
# the binary). The cuBLAS libraries come from the torch environment's site-packages/nvidia/*/lib
# (put on LD_LIBRARY_PATH); the Hugging Face libraries run offline.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUNDLE="$ROOT/gpu-bundle"
SUMMARY="$ROOT/tools/gpu_check_summary.py"

die() { echo "gpu-check: $*" >&2; exit 2; }

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

build() {
  set -e
  command -v cargo >/dev/null || die "cargo not found (the build half runs on a machine with Rust)"
  export CARGO_TARGET_DIR="${INFOMEM_CUDA_TARGET:-$ROOT/target/cuda}"
  cargo build --release --features cuda
  local json
  json="$(cargo test --release --features cuda --no-run --message-format=json)"
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
  local parity
  parity="$(exe cuda_parity)"
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
  if ! git diff --quiet HEAD 2>/dev/null; then echo "+uncommitted changes" >> "$BUNDLE/commit"; fi
  du -sh "$BUNDLE"/* | sed 's/^/gpu-check build: /'
  local total
  total="$(du -sm "$BUNDLE" | cut -f1)"
  [ "$total" -le 60 ] || die "gpu-bundle is ${total} MB (over 60 MB)"
  echo "gpu-check build: ok — carry gpu-bundle/ to the GPU machine and run, in order: tools/gpu-check.sh contact | bench | train"
}

# ---------------------------------------------------------------------------------------------
# the step runner: each step has a time limit inside the stage's budget, its output goes to
# log.txt as it runs, its start and end to steps.jsonl, and the summary is rewritten after it

START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

# event NAME JSON-FIELDS: one line of steps.jsonl
event() { printf '{"event":"%s","step":"%s","t":%s%s}\n' "$1" "$2" "$(elapsed)" "${3:-}" >> "$OUT/steps.jsonl"; }

summarize() { python3 "$SUMMARY" "$STAGE" "$OUT" > /dev/null 2>> "$OUT/log.txt" || true; }

# step NAME LIMIT CMD...: run CMD with a time limit; stdout and stderr to log.txt. With
# STEP_STDOUT=FILE, stdout also goes to FILE. Returns CMD's status (124 on timeout, 99 if skipped).
step() {
  local name="$1" limit="$2"; shift 2
  local left=$(( BUDGET - $(elapsed) ))
  if [ "$left" -lt 15 ]; then
    event skip "$name" ',"why":"the stage'"'"'s time budget is spent"'
    echo "gpu-check: [$(elapsed)s] $name skipped: the time budget is spent" >&2
    summarize
    return 99
  fi
  [ "$limit" -le $(( left - 5 )) ] || limit=$(( left - 5 ))
  echo "gpu-check: [$(elapsed)s] $name (limit ${limit}s)" >&2
  printf '\n===== step %s (limit %ss, at %ss) =====\n' "$name" "$limit" "$(elapsed)" >> "$OUT/log.txt"
  event start "$name" ",\"limit\":$limit"
  local t0 rc
  t0=$(date +%s)
  if [ -n "${STEP_STDOUT:-}" ]; then
    timeout --kill-after=5 "$limit" "$@" 2>> "$OUT/log.txt" | tee -a "$OUT/log.txt" > "$STEP_STDOUT"
    rc=${PIPESTATUS[0]}
  else
    timeout --kill-after=5 "$limit" "$@" >> "$OUT/log.txt" 2>&1
    rc=$?
  fi
  event end "$name" ",\"rc\":$rc,\"secs\":$(( $(date +%s) - t0 ))"
  [ "$rc" = 0 ] || echo "gpu-check: $name failed (rc $rc); see log.txt" >&2
  summarize
  return "$rc"
}

# stage_init STAGE DEFAULT_BUDGET: the output folder, the budget, meta.json
stage_init() {
  STAGE="$1"
  BUDGET="${GPU_CHECK_BUDGET_S:-$2}"
  OUT="${OUT:-$ROOT/gpu-check-out/$STAGE}"
  mkdir -p "$OUT"
  : > "$OUT/steps.jsonl"
  : > "$OUT/log.txt"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
}

# write_meta KEY=VALUE...: meta.json with the stage, commit, time, budget, GPU lines and extras
write_meta() {
  local gpu="" drv=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpu="$(nvidia-smi -L 2>&1 | head -n 2 | tr '\n' ' ')"
    drv="$(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | head -n 1)"
  fi
  python3 - "$OUT/meta.json" "$STAGE" "$(cat "$BUNDLE/commit" 2>/dev/null | tr '\n' ' ' || echo unknown)" "$BUDGET" "$gpu" "$drv" "$@" <<'PYEOF'
import datetime, json, sys
path, stage, commit, budget, gpu, drv, *extra = sys.argv[1:]
meta = {"stage": stage, "commit": commit.strip(), "budget_s": int(budget), "gpu": gpu.strip(), "driver": drv.strip(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "tools": {}}
for kv in extra:
    k, _, v = kv.partition("=")
    if k.startswith("tool:"):
        meta["tools"][k[5:]] = v
    else:
        meta[k] = v
json.dump(meta, open(path, "w"), indent=1)
PYEOF
}

# The GPU machine: a visible GPU (exit 3 with a clear line otherwise), the bundle, cuBLAS on
# LD_LIBRARY_PATH, the tests' fixture path.
gpu_env() {
  [ -x "$BUNDLE/infomem-engine" ] && [ -x "$BUNDLE/cuda_parity" ] \
    || die "no complete gpu-bundle/ here: run 'tools/gpu-check.sh build' on the build machine and carry gpu-bundle/"
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no GPU visible (nvidia-smi lists no device): nothing to check here; stopping." | tee "$OUT/summary.md" >&2
    exit 3
  fi
  PY="${TORCH_PYTHON:-python3}"
  # cuBLAS / cuBLASLt (CUDA 13) from the torch environment, where there is one
  local libs
  libs="$("$PY" - 2>/dev/null <<'PYEOF'
import glob, os
import nvidia
dirs = []
for base in nvidia.__path__:
    dirs += sorted(glob.glob(os.path.join(base, "*", "lib")))
print(":".join(d for d in dirs if os.path.isdir(d)))
PYEOF
)"
  [ -n "$libs" ] && export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # the parity tests read tests/fixtures through the absolute path they were built in
  local built
  built="$(cat "$BUNDLE/manifest_dir")"
  if [ "$built" != "$ROOT" ] && [ ! -e "$built" ]; then
    mkdir -p "$(dirname "$built")" && ln -s "$ROOT" "$built"
  fi
}

finish() {
  summarize
  cat "$OUT/summary.md"
  echo "gpu-check $STAGE: done in $(elapsed)s; results in $OUT ($(ls "$OUT" | tr '\n' ' '))" >&2
}

# ---------------------------------------------------------------------------------------------
# contact: is the CUDA backend right?

contact() {
  stage_init contact 230
  gpu_env
  local san="not found on PATH"
  command -v compute-sanitizer >/dev/null 2>&1 && san="$(compute-sanitizer --version 2>&1 | tail -n 1)"
  write_meta "tool:compute-sanitizer=$san" "tool:LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  local BIN="$BUNDLE/infomem-engine"
  STEP_STDOUT="$OUT/device.json" step device 60 "$BIN" device --json

  local status=0 suite=cuda_parity
  # first the conformance probes: the GPU's ex2/rcp/bf16-conversion/mma results against the
  # emulator's models (bit for bit where a model claims exactness, within the ISA bounds
  # elsewhere); the differences calibrate the emulator and the parity bounds built on it
  step conformance 40 env INFOMEM_REQUIRE_CUDA=1 INFOMEM_CONFORMANCE_OUT="$OUT/conformance.json" \
    "$BUNDLE/$suite" conformance::gpu_matches_the_emulator_models --exact --test-threads=1 --nocapture || status=1
  step "list:$suite" 20 "$BUNDLE/$suite" --list
  # one process for every family's tests, inference and training (the fast path), one thread,
  # the tests' measurements shown
  step "parity:$suite" 200 env INFOMEM_REQUIRE_CUDA=1 RUST_BACKTRACE=1 "$BUNDLE/$suite" --test-threads=1 --show-output || status=1
  # a failure (or a crash) poisons the process's CUDA context: rerun what did not pass, each
  # alone, to tell real failures from collateral ones
  local t
  for t in $(python3 "$SUMMARY" failed-tests "$OUT" "parity:$suite" 2>/dev/null | head -n 12); do
    step "rerun:$suite:$t" 60 env INFOMEM_REQUIRE_CUDA=1 RUST_BACKTRACE=1 "$BUNDLE/$suite" "$t" --exact --test-threads=1 --show-output
  done
  # compute-sanitizer on the attention kernels (paged: inference; dense: training), head_dim 64
  # and 128 only (INFOMEM_SANITIZER=1: racecheck slows shared-memory kernels by orders of magnitude)
  if command -v compute-sanitizer >/dev/null 2>&1; then
    local tool
    for tool in memcheck racecheck; do
      step "$tool:attention::paged_attention_mixed_batch" 45 env INFOMEM_REQUIRE_CUDA=1 INFOMEM_SANITIZER=1 compute-sanitizer --tool "$tool" --error-exitcode 1 \
        "$BUNDLE/cuda_parity" attention::paged_attention_mixed_batch --exact --test-threads=1
      step "$tool:attention_dense::dense_attention_forward_and_backward" 45 env INFOMEM_REQUIRE_CUDA=1 INFOMEM_SANITIZER=1 compute-sanitizer --tool "$tool" --error-exitcode 1 \
        "$BUNDLE/cuda_parity" attention_dense::dense_attention_forward_and_backward --exact --test-threads=1
    done
  fi
  # the plain-allocation fallback on real hardware: the device report and a whole-model test
  step "plain-alloc" 60 env INFOMEM_CUDA_ALLOC=plain INFOMEM_REQUIRE_CUDA=1 sh -c \
    '"$1" device && "$2" model::tiny_models_generate_and_score device::plain_allocator_matches_the_default --test-threads=1' _ "$BIN" "$BUNDLE/cuda_parity"
  # compute-sanitizer on Qwen3's q/k-norm RoPE kernels (rope.cu; small, so both tests at once),
  # last: skipped when the budget is spent
  if command -v compute-sanitizer >/dev/null 2>&1; then
    local tool
    for tool in memcheck racecheck; do
      step "$tool:rope::qk_norm_rope" 40 env INFOMEM_REQUIRE_CUDA=1 INFOMEM_SANITIZER=1 compute-sanitizer --tool "$tool" --error-exitcode 1 \
        "$BUNDLE/cuda_parity" rope::qk_norm_rope_matches_cpu rope::qk_norm_rope_backward_matches_cpu --exact --test-threads=1
    done
  fi
  finish
  return "$status"
}

# ---------------------------------------------------------------------------------------------
# bench: ours vs PyTorch on the same GPU

# name|work|engine flags|torch flags (the train workload names its loss tokens --score-last on
# our side, --train-last on torch's)
CASES_05B='score-8x4096|score|--batch 8 --seq-len 4096 --score-last 64|--batch 8 --seq-len 4096 --score-last 64
decode-b64|decode|--batch 64 --seq-len 1024 --new-tokens 256|--batch 64 --seq-len 1024 --new-tokens 256
decode-b1|decode|--batch 1 --seq-len 1024 --new-tokens 256|--batch 1 --seq-len 1024 --new-tokens 256
rollout-n16|rollout|--batch 16 --seq-len 2048 --new-tokens 256 --chunks 4|--rollout-n 16 --chunks 4 --chunk-tokens 2048 --memory-tokens 256
train-8x4096|train|--batch 8 --seq-len 4096 --score-last 128|--batch 8 --seq-len 4096 --train-last 128'
CASES_3B='score-8x4096|score|--batch 8 --seq-len 4096 --score-last 64|--batch 8 --seq-len 4096 --score-last 64
decode-b64|decode|--batch 64 --seq-len 1024 --new-tokens 256|--batch 64 --seq-len 1024 --new-tokens 256
train-8x4096|train|--batch 8 --seq-len 4096 --score-last 128|--batch 8 --seq-len 4096 --train-last 128 --grad-checkpointing'
# Qwen3-1.7B and Qwen3-4B: short cases, so both fit after 0.5B's (PyTorch's train 4x2048 needs
# ~55 GB of activations on the 4B shape without checkpointing)
CASES_QWEN3='score-8x2048|score|--batch 8 --seq-len 2048 --score-last 64|--batch 8 --seq-len 2048 --score-last 64
decode-b16|decode|--batch 16 --seq-len 512 --new-tokens 64|--batch 16 --seq-len 512 --new-tokens 64
train-4x2048|train|--batch 4 --seq-len 2048 --score-last 128|--batch 4 --seq-len 2048 --train-last 128'

bench() {
  stage_init bench 290
  gpu_env
  write_meta
  : > "$OUT/bench.jsonl"
  local MDIR="${GPU_CHECK_MODEL_DIR:-/tmp/infomem-gpu-check}"
  mkdir -p "$MDIR"
  local shape
  for shape in ${GPU_CHECK_MODELS:-qwen2-0.5b qwen3-1.7b qwen3-4b qwen2-3b}; do
    local dir="$MDIR/$shape" cases
    case "$shape" in qwen2-3b) cases="$CASES_3B" ;; qwen3-*) cases="$CASES_QWEN3" ;; *) cases="$CASES_05B" ;; esac
    if [ ! -f "$dir/config.json" ]; then
      # written beside, then renamed: a make stopped by the budget (Qwen3-4B is ~8 GB) leaves no
      # directory that a later run on the same machine would take for a complete model
      rm -rf "$dir.partial"
      step "make:$shape" 120 "$PY" tools/make_random_model.py --shape "$shape" --out "$dir.partial" \
        && mv "$dir.partial" "$dir" || continue
    fi
    python3 -c 'import json,sys; print(json.dumps({"shape": sys.argv[1], "config": json.load(open(sys.argv[2]))}))' "$shape" "$dir/config.json" >> "$OUT/bench.jsonl"
    local torch_args=() name work ours theirs
    while IFS='|' read -r name work ours theirs; do
      case " ${GPU_CHECK_CASES:-$name} " in *" $name "*) ;; *) continue ;; esac
      local cap="$OUT/.ours.out"
      # (stdin from /dev/null: the loop reads its cases from stdin)
      STEP_STDOUT="$cap" step "ours:$shape:$name" 90 "$BUNDLE/infomem-engine" bench --model "$dir" --backend cuda --work "$work" $ours --json </dev/null \
        && python3 "$SUMMARY" tag-json "$shape" "$name" < "$cap" >> "$OUT/bench.jsonl"
      rm -f "$cap"
      torch_args+=(--case "$name:$work:$theirs")
    done <<< "$cases"
    # PyTorch: one process for all of the shape's cases (the model is built once); each case's
    # JSON line is appended as it finishes, so a stop keeps the finished ones
    [ "${#torch_args[@]}" -gt 0 ] && step "torch:$shape" 200 "$PY" tools/bench_torch.py --model "$dir" --device cuda --dtype bfloat16 \
      --jsonl "$OUT/bench.jsonl" --tag "shape=$shape" "${torch_args[@]}" </dev/null
  done
  finish
}

# ---------------------------------------------------------------------------------------------
# train: a short InfoMem training run on the GPU

train() {
  local backend="${GPU_CHECK_BACKEND:-cuda}"
  stage_init train 170
  if [ "$backend" = cuda ]; then
    gpu_env
  else
    PY="${TORCH_PYTHON:-python3}"
  fi
  local BIN="${BIN:-$BUNDLE/infomem-engine}"
  [ -x "$BIN" ] || die "no engine binary at $BIN"
  local shape="${GPU_CHECK_TRAIN_SHAPE:-smollm2}"
  write_meta "backend=$backend" "model=$shape-shaped random weights, byte-level tokenizer"
  local W="${GPU_CHECK_TRAIN_DIR:-/tmp/infomem-gpu-train}"
  rm -rf "$W" && mkdir -p "$W"
  local steps="${GPU_CHECK_TRAIN_STEPS:-8}"

  # 1. a random-weight model with a byte-level tokenizer and SmolLM2's chat template
  step make-model 90 "$PY" - "$W/model" "$shape" "$backend" "$ROOT/tests/fixtures/smollm2-hf-meta/chat_template.jinja" <<'PYEOF' || { finish; return 1; }
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
  step data 30 "$BIN" data synth --task needle --tokens 1500 --count 32 --seed 1 --model "$W/model" --out "$W/train.jsonl" || { finish; return 1; }
  step data-eval 30 "$BIN" data synth --task needle --tokens 1500 --count 8 --seed 2 --model "$W/model" --out "$W/eval.jsonl" || { finish; return 1; }

  # 3. GRPO on the GPU: infomem-all puts the gain on every rollout and the KL term trains every
  # conversation, so a random model's steps are never skipped for lack of signal. Its
  # metrics.jsonl is copied into $OUT as it grows (a stop keeps the finished steps).
  step train "$(( BUDGET - 60 ))" "$BIN" train --backend "$backend" --model "$W/model" --data "$W/train.jsonl" --out "$W/run" \
    --steps "$steps" --queries-per-step 4 --group-size 4 --chunk-tokens 512 --memory-tokens 64 --answer-tokens 16 \
    --reward infomem-all --kl-coef 0.01 --lr 1e-4 --warmup-steps 1 --micro-batch-tokens 8192 --max-batch-tokens 8192 \
    --save-every 4 --seed 3 &
  local train_pid=$!
  # copy the metrics as they grow (the run directory is outside $OUT)
  while kill -0 "$train_pid" 2>/dev/null; do
    cp "$W/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null && summarize
    sleep 5
  done
  wait "$train_pid"
  local train_rc=$?
  cp "$W/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null || true
  cp "$W/run/curves.png" "$OUT/curves.png" 2>/dev/null || true
  summarize

  # 4. the trained adapter through rollout and eval on the same backend, and PEFT's view of it
  if [ "$train_rc" = 0 ]; then
    step rollout 40 "$BIN" rollout --backend "$backend" --model "$W/model" --adapter "$W/run/adapter" --data "$W/eval.jsonl" \
      --limit 4 --group-size 2 --chunk-tokens 512 --memory-tokens 64 --answer-tokens 16 --out "$W/rollout.jsonl" --json
    step eval 40 "$BIN" eval --backend "$backend" --model "$W/model" --adapter "$W/run/adapter" --data "$W/eval.jsonl" \
      --limit 4 --chunk-tokens 512 --memory-tokens 64 --answer-tokens 16 --out "$W/eval" --json
    if "$PY" -c 'import peft' 2>/dev/null; then
      step check-peft 60 "$PY" tools/check_peft.py --model "$W/model" --adapter "$W/run/adapter" --bin "$BIN"
    else
      event skip check-peft ',"why":"peft is not importable"'
    fi
  fi
  finish
  [ "$train_rc" = 0 ]
}

selftest() {
  python3 "$SUMMARY" selftest "$ROOT/tools/gpu-check-selftest"
}

case "${1:-}" in
  build) build ;;
  contact) contact ;;
  bench) bench ;;
  train) train ;;
  selftest) selftest ;;
  -h|--help|help) usage; exit 0 ;;
  *) usage; exit 2 ;;
esac
