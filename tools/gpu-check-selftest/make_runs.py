#!/usr/bin/env python3
"""Writes the recorded runs that `tools/gpu-check.sh selftest` summarizes (one folder per run,
with expect.json: the strings its summary must and must not contain, and the tests to rerun).

No GPU has run the check yet, so these are written in the exact formats the stages produce
(libtest's output with --test-threads=1 --show-output, compute-sanitizer's summaries, the
engine's and bench_torch.py's JSON lines, steps.jsonl events) rather than copied from a run;
when a GPU run happens, its output folder can be added here as another case.

    python3 tools/gpu-check-selftest/make_runs.py   # rewrites every case folder
"""
import json, os, shutil
root = os.path.dirname(os.path.abspath(__file__))
for d in os.listdir(root):
    if os.path.isdir(os.path.join(root, d)):
        shutil.rmtree(os.path.join(root, d))

# the suite's tests (`cuda_parity --list`), one module per op family
TESTS = """attention::paged_attention_mixed_batch attention_dense::dense_attention_forward_and_backward
device::plain_allocator_matches_the_default footprint::memory_plan_says_what_fits gemm::matmul_bias_and_lora
gemm::projections_lora_backward_and_merge logprob::head_grad_over_vocab_tiles logprob::logprobs_over_vocab_tiles
memory::embed_and_gather_rows memory::scale_and_scatter_add_rows model::qwen2_half_b_layer_batched
model::tiny_models_generate_and_score model_train::fixture_lora_gradients_match_cpu
model_train::qwen2_half_b_lora_gradients_and_step_match_cpu model_train::whole_model_bounds_hold_for_the_device_rounding_model
norm::rmsnorm_and_residual_add norm::rmsnorm_backward optim::reductions_scale_and_adamw rope::rope_backward_inverts_the_rotation
rope::rope_on_fused_qkv sample::sampling_matches_cpu_token_for_token swiglu::swiglu_backward swiglu::swiglu_forward""".split()
N = len(TESTS)

class Run:
    def __init__(self, name, stage, expect):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.stage, self.t = stage, 0
        self.log, self.steps = [], []
        json.dump(dict(expect, stage=stage), open(os.path.join(self.dir, "expect.json"), "w"), indent=1)
    def meta(self, **kw):
        m = {"stage": self.stage, "commit": "0123456789abcdef0123", "budget_s": 230, "gpu": "GPU 0: NVIDIA H200 (UUID: GPU-1234)",
             "driver": "NVIDIA H200, 580.159.04, 143771 MiB, 0 MiB, 345 MHz, 1980 MHz", "started": "2026-12-01 10:00:00 UTC", "tools": {}}
        m.update(kw)
        json.dump(m, open(os.path.join(self.dir, "meta.json"), "w"), indent=1)
    def step(self, name, limit, out, rc=0, secs=3, end=True, skip=None):
        if skip:
            self.steps.append({"event": "skip", "step": name, "t": self.t, "why": skip})
            return
        self.log.append(f"\n===== step {name} (limit {limit}s, at {self.t}s) =====\n" + out)
        self.steps.append({"event": "start", "step": name, "t": self.t, "limit": limit})
        self.t += secs
        if end:
            self.steps.append({"event": "end", "step": name, "t": self.t, "rc": rc, "secs": secs})
    def file(self, name, text):
        open(os.path.join(self.dir, name), "w").write(text)
    def close(self, cut_steps=False):
        self.file("log.txt", "".join(self.log))
        lines = "".join(json.dumps(s) + "\n" for s in self.steps)
        if cut_steps:
            lines += '{"event":"end","step":"tr'  # a line cut off by the kill
        self.file("steps.jsonl", lines)

def listing(tests):
    return "".join(f"{t}: test\n" for t in tests) + f"\n{len(tests)} tests, 0 benchmarks\n"

def suite_ok(tests, secs=12.3, extra=""):
    s = f"\nrunning {len(tests)} tests\n" + "".join(f"test {t} ... ok\n" for t in tests)
    s += "\nsuccesses:\n\n" + "".join(f"---- {t} stdout ----\n{extra.get(t, '') if isinstance(extra, dict) else ''}\n" for t in tests)
    s += "\nsuccesses:\n" + "".join(f"    {t}\n" for t in tests)
    s += f"\ntest result: ok. {len(tests)} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in {secs}s\n\n"
    return s

DEVICE = {"device": "NVIDIA H200", "compute_capability": "9.0", "multiprocessors": 132, "driver_cuda_version": "13.0",
          "cublaslt_version": "13.1.0", "libcuda": "/usr/lib/x86_64-linux-gnu/libcuda.so.1 -> /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04",
          "libcublasLt": "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcublasLt.so.13",
          "memory_total_gib": 139.8, "memory_free_gib": 139.2, "allocator": "pool",
          "allocator_detail": "stream-ordered pool (cuMemAllocAsync, freed memory kept by the pool)",
          "kernels_nvcc": "Cuda compilation tools, release 13.0, V13.0.88", "kernel_modules": 9, "kernels": 70}

def san(tool, errors):
    if tool == "memcheck":
        body = "========= COMPUTE-SANITIZER\n"
        if errors:
            body += ("========= Invalid __global__ read of size 16 bytes\n=========     at attention_hd64_bf16+0x1a30\n"
                     "=========     by thread (3,0,0) in block (17,0,0)\n=========     Address 0x7f0000400000 is out of bounds\n")
        body += "\nrunning 1 test\ntest paged_attention_mixed_batch ... " + ("FAILED" if errors else "ok") + "\n"
        return body + f"========= ERROR SUMMARY: {errors} error{'s' if errors != 1 else ''}\n"
    body = "========= COMPUTE-SANITIZER\n\nrunning 1 test\ntest dense_attention_forward_and_backward ... ok\n"
    return body + f"========= RACECHECK SUMMARY: {errors} hazards displayed (0 errors, {errors} warnings)\n"

# ---- contact: everything passes
PAGED, DENSE = "attention::paged_attention_mixed_batch", "attention_dense::dense_attention_forward_and_backward"
r = Run("contact-pass", "contact", {"contains": [f"PASS: {N} of {N} parity tests", "NVIDIA H200", "libcublasLt.so.13", "| allocator | pool |",
        f"| memcheck | {PAGED} | clean |", f"| racecheck | {DENSE} | clean |", f"**{N} of {N} passed**",
        "| ex2.approx.f32 | 245 | 212 | 1 | 32 | 0 |", "| cvt.rn.bf16.f32 | 245 | 243 | 2 | 0 | 0 |",
        "mma.sync m16n8k16 bf16: 96/128 equal to the exact result", "within bound: ex2.approx.f32 of 0x3f000000"],
        "absent": ["FAIL", "INCOMPLETE"], "failed_tests": {"parity:cuda_parity": []}})
r.meta(tools={"compute-sanitizer": "Version 2025.3.1.0 (build 36398583) (public-release)"})
r.file("device.json", json.dumps(DEVICE) + "\n")
r.step("device", 60, json.dumps(DEVICE) + "\n", secs=2)
# the conformance probes' report (the format of src/backend/cuda/conformance.rs::report)
CONF = "".join(f"{p:<20} 245 inputs: {e} equal, {nb} NaN bits differ, {w} within bound, 0 violations\n" for p, e, nb, w in
               [("ex2.approx.f32", 212, 1, 32), ("ex2.approx.ftz.f32", 214, 1, 30), ("rcp.approx.f32", 240, 0, 5),
                ("rcp.rn.f32", 245, 0, 0), ("cvt.rn.bf16.f32", 243, 2, 0), ("cvt.f32.bf16", 245, 0, 0)])
CONF += ("  within bound: ex2.approx.f32 of 0x3f000000 (5e-1): device 0x3fb504f4, reference 0x3fb504f3, 1 ulp\n"
         "  NaN bits differ: cvt.rn.bf16.f32 of 0x7fc00001: device 0x00007fff, reference 0x00007fc0\n")
r.step("conformance", 40, "\nrunning 1 test\nconformance, scalar probes, GPU vs emulator:\n" + CONF
       + "conformance, mma.sync m16n8k16 bf16: 96/128 equal to the exact result rounded once, 128/128 bit-equal to the reference, 0 outside the bound 17·2^-23·Σ|terms|\n"
       + "test conformance::gpu_matches_the_emulator_models ... ok\n\ntest result: ok. 1 passed; 0 failed\n", secs=2)
r.step("list:cuda_parity", 20, listing(TESTS), secs=0)
r.step("parity:cuda_parity", 200, suite_ok(TESTS, extra={PAGED: "attention hd64: max |Δ| 3.1e-3\n"}), secs=78)
r.step(f"memcheck:{PAGED}", 45, san("memcheck", 0).replace("paged_attention_mixed_batch", PAGED), secs=20)
r.step(f"memcheck:{DENSE}", 45, san("memcheck", 0).replace("test paged_attention_mixed_batch", "test " + DENSE), secs=18)
r.step(f"racecheck:{PAGED}", 45, san("racecheck", 0).replace("dense_attention_forward_and_backward", PAGED), secs=30)
r.step(f"racecheck:{DENSE}", 45, san("racecheck", 0).replace("dense_attention_forward_and_backward", DENSE), secs=31)
r.step("plain-alloc", 60, "allocator: plain\n" + suite_ok(["device::plain_allocator_matches_the_default", "model::tiny_models_generate_and_score"]), secs=4)
r.close()

# ---- contact: a kernel fault poisons the context (the next tests fail with it), then a crash
# ends the process before the rest; memcheck finds the fault; the budget runs out
r = Run("contact-fail", "contact", {"contains": [f"FAIL: 2 of {N} parity tests failed", f"compute-sanitizer findings in memcheck:{PAGED}",
        "passed when run alone: collateral", "attention hd64: element 77: got nan want 0.25", "**1 error**", "Invalid __global__ read",
        "did not finish or were not reached", f"`racecheck:{PAGED}`: skipped", "killed by signal 11", "The conformance probes did not run."],
        "absent": ["PASS"],
        "failed_tests": {"parity:cuda_parity": TESTS[:3] + TESTS[12:]}})
r.meta(tools={"compute-sanitizer": "Version 2025.3.1.0"})
r.file("device.json", json.dumps(DEVICE) + "\n")
r.step("device", 60, json.dumps(DEVICE) + "\n", secs=2)
r.step("list:cuda_parity", 20, listing(TESTS), secs=0)
fault = ("thread '{t}' panicked at tests/cuda_parity/{f}.rs:40:60:\ncalled `Result::unwrap()` on an `Err` value: cuda: stream synchronize "
         "(an earlier kernel may have failed) failed: DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access was encountered\")\n")
out = f"\nrunning {N} tests\ntest {PAGED} ... FAILED\ntest {DENSE} ... FAILED\ntest {TESTS[2]} ... FAILED\n"
out += "".join(f"test {t} ... ok\n" for t in TESTS[3:12])
out += f"test {TESTS[12]} ... Segmentation fault (core dumped)\n"
first = ("\nfailures:\n\n---- " + PAGED + " stdout ----\n\nthread '" + PAGED + "' panicked at tests/cuda_parity/attention.rs:60:9:\n"
         "attention hd64: element 77: got nan want 0.25 (bound 0.045 + 0.00390625·|want|)\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n\n")
out += first
r.step("parity:cuda_parity", 200, out, rc=139, secs=30)
r.step(f"rerun:cuda_parity:{PAGED}", 60, "\nrunning 1 test\ntest " + PAGED + " ... FAILED\n" + first + "failures:\n    " + PAGED + "\n\ntest result: FAILED. 0 passed; 1 failed\n", rc=101, secs=3)
r.step(f"rerun:cuda_parity:{DENSE}", 60, suite_ok([DENSE]), secs=6)
r.step(f"rerun:cuda_parity:{TESTS[2]}", 60, suite_ok([TESTS[2]]), secs=2)
r.step(f"rerun:cuda_parity:{TESTS[12]}", 60, f"\nrunning 1 test\ntest {TESTS[12]} ... Segmentation fault (core dumped)\n", rc=139, secs=3)
for t in TESTS[13:]:
    r.step(f"rerun:cuda_parity:{t}", 60, suite_ok([t]), secs=3)
r.step(f"memcheck:{PAGED}", 45, san("memcheck", 1).replace("paged_attention_mixed_batch", PAGED), rc=1, secs=25)
r.step(f"memcheck:{DENSE}", 45, "========= COMPUTE-SANITIZER\n", end=False, secs=45)
r.steps.append({"event": "end", "step": f"memcheck:{DENSE}", "t": r.t, "rc": 124, "secs": 45})
r.step(f"racecheck:{PAGED}", 45, "", skip="the stage's time budget is spent")
r.close()

# ---- bench: both sides succeed on 0.5B; the 3B shape runs out of time
CFG05 = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True)
def ours(work, case, tps, secs, **kw):
    r = {"impl": "infomem-engine", "work": work, "backend": "cuda (NVIDIA H200, 132 SMs, bf16 storage / f32 accumulation, pool allocator)",
         "tokens": int(tps * secs), "seconds": secs, "tokens_per_s": tps, "shape": "qwen2-0.5b", "case": case}
    r.update(kw)
    return r
def torch(work, case, tps, secs, **kw):
    r = {"impl": "torch", "work": work, "device": "cuda", "dtype": "bfloat16", "tokens": int(tps * secs), "seconds": secs,
         "tokens_per_s": tps, "shape": "qwen2-0.5b", "case": case}
    r.update(kw)
    return r
ours_rows = [ours("score", "score-8x4096", 210000.0, 0.156, batch=8, seq_len=4096, score_last=64),
             ours("decode", "decode-b64", 9100.0, 1.8, batch=64, seq_len=1024, new_tokens=256),
             ours("decode", "decode-b1", 420.0, 0.61, batch=1, seq_len=1024, new_tokens=256),
             ours("rollout", "rollout-n16", 5200.0, 3.15, batch=16, seq_len=2048, new_tokens=256, chunks=4),
             ours("train", "train-8x4096", 61000.0, 0.537, batch=8, seq_len=4096, score_last=128)]
torch_rows = [torch("score", "score-8x4096", 150000.0, 0.218, batch=8, seq_len=4096, score_last=64),
              torch("decode", "decode-b64", 2400.0, 6.8, batch=64, prompt_len=1024, new_tokens=256),
              torch("decode", "decode-b1", 38.0, 6.7, batch=1, prompt_len=1024, new_tokens=256),
              torch("rollout", "rollout-n16", 160.0, 102.0, rollout_n=16, chunks=4, chunk_tokens=2048, memory_tokens=256),
              torch("train", "train-8x4096", 40000.0, 0.82, batch=8, seq_len=4096, loss_tokens_per_seq=128, grad_checkpointing=False)]
r = Run("bench-ok", "bench", {"contains": ["| qwen2-0.5b | score-8x4096 | 210000 | 150000 | 1.40× |", "| qwen2-0.5b | rollout-n16 | 5200 | 160 | 32.50× |",
        "| qwen2-0.5b | decode-b64 | 9100 | 2400 | 3.79× |", "| qwen2-3b | score-8x4096 | — | — | — | — | — | ours: skipped (the stage",
        "`make:qwen2-3b`: **timed out**"], "absent": ["could not"]})
r.meta(budget_s=290)
lines = [json.dumps({"shape": "qwen2-0.5b", "config": CFG05})]
r.step("make:qwen2-0.5b", 120, "make_random_model: qwen2-0.5b (494.0M parameters, bf16, seed 0) → /tmp/x in 9.1s\n", secs=12)
for row in ours_rows:
    r.step(f"ours:qwen2-0.5b:{row['case']}", 90, "infomem-engine bench ...\n" + json.dumps(row) + "\n", secs=8)
    lines.append(json.dumps(row))
r.step("torch:qwen2-0.5b", 200, "".join(json.dumps(t) + "\n" for t in torch_rows), secs=150)
lines += [json.dumps(t) for t in torch_rows]
r.step("make:qwen2-3b", 120, "", rc=124, secs=60)
r.file("bench.jsonl", "\n".join(lines) + "\n")
# the 3B cases never ran: the shell records them as skipped steps
for c in ("score-8x4096",):
    r.step(f"ours:qwen2-3b:{c}", 90, "", skip="the stage's time budget is spent")
r.close()

# ---- bench: our rollout fails (the likely first-contact failure) while PyTorch's succeeds, and
# PyTorch's JSON has no batch/seq_len/new_tokens (bench_torch.py before this change)
r = Run("bench-ours-failed", "bench", {"contains": ["| qwen2-0.5b | rollout-n16 | — | 160 | — | — | 0.4% |", "ours: failed (rc 1",
        "CUDA_ERROR_ILLEGAL_ADDRESS", "| qwen2-0.5b | score-8x4096 | 210000 | 150000 | 1.40× |"]})
r.meta(budget_s=290)
lines = [json.dumps({"shape": "qwen2-0.5b", "config": CFG05})]
r.step("make:qwen2-0.5b", 120, "ok\n", secs=12)
r.step("ours:qwen2-0.5b:score-8x4096", 90, json.dumps(ours_rows[0]) + "\n", secs=8)
lines.append(json.dumps(ours_rows[0]))
r.step("ours:qwen2-0.5b:rollout-n16", 90, "error: cuda: stream synchronize (an earlier kernel may have failed) failed: DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access was encountered\")\n", rc=1, secs=4)
old_torch_rollout = {"impl": "torch", "work": "rollout", "tokens": 16384, "seconds": 102.0, "tokens_per_s": 160.0, "rollout_n": 16, "chunks": 4,
                     "chunk_tokens": 2048, "memory_tokens": 256, "prefix_sharing": False, "shape": "qwen2-0.5b", "case": "rollout-n16"}
r.step("torch:qwen2-0.5b", 200, json.dumps(torch_rows[0]) + "\n" + json.dumps(old_torch_rollout) + "\n", secs=130)
lines += [json.dumps(torch_rows[0]), json.dumps(old_torch_rollout)]
r.file("bench.jsonl", "\n".join(lines) + "\n")
r.close()

# ---- bench: PyTorch fails (OOM in one case, the whole process in the other shape), ours succeeds
CFG3 = dict(CFG05, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, head_dim=128)
r = Run("bench-torch-failed", "bench", {"contains": ["| qwen2-0.5b | train-8x4096 | 61000 | — | — |", "torch: OutOfMemoryError: CUDA out of memory",
        "| qwen2-3b | score-8x4096 | 70000 | — |", "torch: failed (rc 1", "ModuleNotFoundError"]})
r.meta(budget_s=290)
lines = [json.dumps({"shape": "qwen2-0.5b", "config": CFG05})]
r.step("ours:qwen2-0.5b:train-8x4096", 90, json.dumps(ours_rows[4]) + "\n", secs=10)
lines.append(json.dumps(ours_rows[4]))
oom = {"impl": "torch", "case": "train-8x4096", "work": "train", "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 9.27 GiB.", "shape": "qwen2-0.5b"}
r.step("torch:qwen2-0.5b", 200, json.dumps(oom) + "\n", secs=40)
lines.append(json.dumps(oom))
lines.append(json.dumps({"shape": "qwen2-3b", "config": CFG3}))
r3 = dict(ours_rows[0], shape="qwen2-3b", tokens_per_s=70000.0, seconds=0.468)
r.step("ours:qwen2-3b:score-8x4096", 90, json.dumps(r3) + "\n", secs=9)
lines.append(json.dumps(r3))
r.step("torch:qwen2-3b", 200, "Traceback (most recent call last):\n  File \"tools/bench_torch.py\", line 1\nModuleNotFoundError: No module named 'peft'\n", rc=1, secs=5)
r.file("bench.jsonl", "\n".join(lines) + "\n")
r.close()

# ---- bench: stopped mid-run: a step still running, the last JSON line cut off, no meta.json
r = Run("bench-half", "bench", {"contains": ["`torch:qwen2-0.5b`: **did not finish**", "| qwen2-0.5b | score-8x4096 | 210000 | 150000 | 1.40× |",
        "| qwen2-0.5b | decode-b64 | 9100 | — | — |", "commit ?"]})
lines = [json.dumps({"shape": "qwen2-0.5b", "config": CFG05}), json.dumps(ours_rows[0]), json.dumps(ours_rows[1]), json.dumps(torch_rows[0])]
r.step("ours:qwen2-0.5b:score-8x4096", 90, json.dumps(ours_rows[0]) + "\n", secs=8)
r.step("ours:qwen2-0.5b:decode-b64", 90, json.dumps(ours_rows[1]) + "\n", secs=8)
r.step("torch:qwen2-0.5b", 200, json.dumps(torch_rows[0]) + "\n[torch decode] warm-up 1.2s\n", end=False)
r.file("bench.jsonl", "\n".join(lines) + "\n" + json.dumps(torch_rows[1])[:40])
r.close(cut_steps=True)

# ---- train: stopped during training: metrics of 3 steps, the last line cut off
r = Run("train-half", "train", {"contains": ["`train`: **did not finish**", "| 1 | 0.1250 |", "Time split over 3 steps", "Updates applied: 2 of 3 steps",
        "Not run (the training step did not finish)", "every group's rewards were equal"]})
r.meta(budget_s=170, backend="cuda", model="smollm2-shaped random weights, byte-level tokenizer")
r.step("make-model", 90, "smollm2: 134.5M parameters -> /tmp/m\n", secs=15)
r.step("data", 30, "wrote 32 records\n", secs=1)
r.step("data-eval", 30, "wrote 8 records\n", secs=1)
r.step("train", 110, "step 1/8 ...\nstep 2/8 ...\n", end=False)
def m(step, reward, skipped=None):
    return {"step": step, "reward_mean": reward, "success_rate": 0.0, "gain_mean": -0.01 * step, "loss": 0.002, "kl_mean": 1e-4,
            "grad_norm": None if skipped else 0.5, "rollout_s": 3.1, "score_s": 0.4, "update_s": 1.2, "step_s": 4.9,
            "train_tokens_per_s": 21000.0, "skipped": skipped}
r.file("metrics.jsonl", json.dumps(m(1, 0.125)) + "\n" + json.dumps(m(2, 0.0, "every group's rewards were equal: no learning signal (advantages all 0)")) + "\n"
       + json.dumps(m(3, 0.25)) + "\n" + json.dumps(m(4, 0.3))[:50])
r.close()
print(f"wrote the recorded runs under {root}")
