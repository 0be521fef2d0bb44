//! The whole CUDA backend end to end through the binary, as a user runs it: `score`, `generate`,
//! `rollout`, `eval` and `train` with `--backend cuda` on the tiny Llama, Qwen2 and Qwen3
//! fixtures, against the CPU backend in bf16 (`--dtype bf16`: the same rounding points — bf16
//! weights, bf16 GEMM inputs, a bf16 KV cache — so what differs is the device's summation order
//! and the roundings inside its attention tiles). Without a GPU the commands run on the emulated
//! device (INFOMEM_CUDA_EMULATE=1: the kernels' real PTX interpreted, cuBLASLt emulated); on a
//! GPU on the GPU. Until the interpreter models every kernel's instructions (mma.sync / cp.async
//! in the attention kernels: issue 54) the tests that need them are skipped with that reason.
//!
//! Bounds, all from model.rs' `model_tol` on every logit (where it says what it covers: the
//! device against the f32 computation on the same bf16 weights; the CPU in bf16 rounds at the
//! same points, so it is within the same bound of it, and the two within twice it — `PAIR`): a
//! log-prob `lp_t = z_t − LSE(z)` moves by at most `tol(z_t) + Σ_j p_j·tol(z_j)` (first order:
//! `ΔLSE = Σ_j p_j·Δz_j`), computed from the reference's own logits at that position — on the
//! tiny random models logits reach ±40 where a sampled token's log-prob is only −10, so a bound
//! scaled by |lp| alone would be too tight there (measured: 0.36 on such a token). A mean
//! log-prob L (the agent's `L(M)`, `L(∅)`) gets the mean of its tokens' bounds, a gain
//! `L(M) − L(∅)` the sum of its two terms'. A greedy token may differ from the reference's argmax
//! only where the reference's margin between the two is within both logits' bounds (a near-tie
//! bf16 may flip); the comparison is teacher-forced along the device's own path, so every step
//! is checked. LoRA gradients of a GRPO step on the device's own rollout group:
//! `model_train::TINY_BOUND` under the same upstream gradient (as `model_train::compare_grads`).
use super::model::model_tol;
use super::model_train::{compare_tensors, TINY_BOUND};
use super::*;
use common::cli::{bin, run_for, s, short_templates, Out};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// The three families this file drives (Mistral and Llama-3.2 share Llama's code paths; their
/// device parity is in model.rs).
const E2E_ARCHS: [&str; 3] = ["llama", "qwen2", "qwen3"];

/// A command's wall limit: the emulated device runs a tiny model's step in well under a second;
/// this only turns a hang into a failure.
const LIMIT_S: u64 = 600;

/// How `--backend cuda` runs here: on the real device as is, else on the emulated one (the
/// opt-in), or None — a visible skip — where the emulated device cannot run every kernel yet.
fn cuda_env(what: &str) -> Option<Vec<(&'static str, &'static str)>> {
    let Some(be) = cuda_be() else {
        eprintln!("{what}: skipped: no CUDA device and no kernels for the emulated one");
        return None;
    };
    if !emulated(be) {
        return Some(vec![]);
    }
    if let Some((k, why)) = be.emulator_blockers().first() {
        eprintln!("{what}: skipped on the emulated device: kernel {k} cannot run there yet ({why}); issue 54 (mma.sync / cp.async)");
        return None;
    }
    Some(vec![("INFOMEM_CUDA_EMULATE", "1")])
}

/// Run the binary with `args` (and `env`), which must succeed; on the emulated device its stderr
/// must say so.
fn ok(args: &[String], env: &[(&str, &str)]) -> Out {
    let mut c = bin();
    c.args(args).env_remove("INFOMEM_CUDA_EMULATE");
    for (k, v) in env {
        c.env(k, v);
    }
    let what = format!("{args:?}");
    let o = run_for(c, LIMIT_S);
    assert_eq!(o.code, Some(0), "{what}: exit code; stderr:\n{}", o.stderr);
    if env.iter().any(|(k, _)| *k == "INFOMEM_CUDA_EMULATE") {
        assert!(o.stderr.contains("running on the EMULATED device"), "{what}: stderr does not say it runs on the emulated device:\n{}", o.stderr);
    }
    o
}

fn json_line(o: &Out) -> Value {
    serde_json::from_str(o.stdout.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("stdout is not a JSON line ({e}): {}", o.stdout))
}

fn floats32(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// The CPU reference in this process: the same directory on the CPU backend in bf16, as
/// `--backend cpu --dtype bf16` loads it.
fn cpu_ref(dir: &Path, adapter: Option<&Path>) -> Model<CpuBackend> {
    let mut m = Model::load(dir, CpuBackend::with_weights(Dtype::Bf16)).unwrap();
    if let Some(a) = adapter {
        m.load_adapter(a).unwrap();
    }
    m
}

fn score_ref(m: &Model<CpuBackend>, ctx: &[u32], tgt: &[u32]) -> Vec<f32> {
    let mut kv = runtime::kv_for(m, ctx.len() + tgt.len() + 16).unwrap();
    let r = ScoreRequest { seq: Seq::default(), context: ctx.to_vec(), targets: tgt.to_vec(), keep_seq: false };
    runtime::score(m, &mut kv, vec![r], SchedOptions::default()).unwrap().remove(0).logprobs
}

/// Device and CPU-in-bf16 are each within `model_tol` of the f32 computation on the same bf16
/// weights (module doc), so within twice it of each other (measured on tiny-llama: the CPU in
/// bf16 0.34 from f32 on a log-prob of −29.8, the device 0.29 the other way).
const PAIR: f64 = 2.0;

/// The bound on a device log-prob of token `t` given the reference's logits `row` there (see the
/// module doc): `PAIR·(tol(z_t) + Σ_j p_j·tol(z_j))`.
fn lp_bound(row: &[f32], t: usize) -> f64 {
    let lsm = log_softmax(row);
    let lse_move: f64 = row.iter().zip(&lsm).map(|(&z, &l)| l.exp() * model_tol(z) as f64).sum();
    PAIR * (model_tol(row[t]) as f64 + lse_move)
}

/// The bounds of scoring `tgt` after `ctx`, one per target token, from the reference's logits.
fn lp_bounds(r: &Model<CpuBackend>, ctx: &[u32], tgt: &[u32]) -> Vec<f64> {
    let logits = super::model::step_logits(r, ctx, &tgt[..tgt.len() - 1]);
    tgt.iter().zip(&logits).map(|(&t, row)| lp_bound(row, t as usize)).collect()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// A device's greedy `path` after `prompt` against the reference's logits along that same path
/// (teacher-forced): at every step the device's token is the reference's argmax, or within both
/// logits' bounds (`PAIR`·`model_tol` each) of it (a near-tie). Returns how many steps were near-ties.
fn check_greedy_path(what: &str, r: &Model<CpuBackend>, prompt: &[u32], path: &[u32]) -> usize {
    let logits = super::model::step_logits(r, prompt, path);
    let mut ties = 0;
    for (i, &t) in path.iter().enumerate() {
        let row = &logits[i];
        let best = (0..row.len()).fold(0, |b, j| if row[j] > row[b] { j } else { b });
        if best == t as usize {
            continue;
        }
        let margin = row[best] - row[t as usize];
        let bound = PAIR as f32 * (model_tol(row[best]) + model_tol(row[t as usize]));
        assert!(margin <= bound, "{what}: step {i}: device chose {t}, the reference's argmax is {best} by {margin} (> the bound {bound}: not a near-tie)");
        ties += 1;
    }
    ties
}

/// Without a GPU and without the opt-in, `--backend cuda` says there is none and names the
/// opt-in; a malformed opt-in value is refused; with it, the command says it runs on the
/// emulated device (and, while the interpreter lacks an instruction some kernel needs, fails
/// at once naming the kernel, never halfway).
#[test]
fn no_gpu_is_said_and_the_emulated_device_is_opt_in() {
    if cuda::device_present() || cuda::kernels_missing().is_some() {
        eprintln!("skipped: a CUDA device is present, or no kernels are built");
        return;
    }
    let (_t, dir) = tiny_with_tokenizer("llama");
    let args = ["score", "--model", s(&dir), "--backend", "cuda", "--context-ids", "5,6,7", "--target-ids", "8,9"];
    let mut c = bin();
    c.args(args).env_remove("INFOMEM_CUDA_EMULATE");
    common::cli::fails_cmd(c, &["no CUDA device", "INFOMEM_CUDA_EMULATE=1", "emulated device"]);
    let mut c = bin();
    c.args(args).env("INFOMEM_CUDA_EMULATE", "yes");
    common::cli::fails_cmd(c, &["INFOMEM_CUDA_EMULATE=\"yes\"", "expected 1"]);
    let mut c = bin();
    c.args(args).env("INFOMEM_CUDA_EMULATE", "1");
    let o = run_for(c, LIMIT_S);
    assert!(o.stderr.contains("running on the EMULATED device"), "{}", o.stderr);
    let be = cuda_be().unwrap();
    match be.emulator_blockers().first() {
        Some((k, _)) => {
            assert_eq!(o.code, Some(1), "{}", o.stderr);
            assert!(o.stderr.contains(&format!("cannot run kernel {k}")), "{}", o.stderr);
        }
        None => assert_eq!(o.code, Some(0), "{}", o.stderr),
    }
}

/// `score` (with and without the fixture's LoRA adapter) and greedy `generate` on the device
/// against the CPU in bf16.
#[test]
fn score_and_generate_match_cpu() {
    let Some(env) = cuda_env("score_and_generate_match_cpu") else { return };
    let cases = cases();
    for arch in E2E_ARCHS {
        let (_t, dir) = tiny_with_tokenizer(arch);
        let g = &cases[arch]["gain"];
        let (ctx, tgt) = (ids(&g["with_ctx"]), ids(&g["target"]));
        for adapter in [None, Some(fixtures().join(format!("tiny-{arch}-lora")))] {
            let mut base = strs(&["score", "--model", s(&dir), "--context-ids", &csv(&ctx), "--target-ids", &csv(&tgt), "--json"]);
            if let Some(a) = &adapter {
                base.extend(strs(&["--adapter", s(a)]));
            }
            let dev = floats32(&json_line(&ok(&[base.clone(), strs(&["--backend", "cuda"])].concat(), &env))["logprobs"]);
            let cpu = floats32(&json_line(&ok(&[base, strs(&["--backend", "cpu", "--dtype", "bf16"])].concat(), &[]))["logprobs"]);
            assert_eq!(dev.len(), tgt.len());
            let bounds = lp_bounds(&cpu_ref(&dir, adapter.as_deref()), &ctx, &tgt);
            for (j, ((d, c), b)) in dev.iter().zip(&cpu).zip(&bounds).enumerate() {
                assert!(((d - c).abs() as f64) <= *b, "tiny-{arch} adapter {} score target {j}: device {d} vs CPU {c} (bound {b})", adapter.is_some());
            }
            println!("tiny-{arch} score (adapter {}): {} log-probs, max |Δ| {:.2e}", adapter.is_some(), dev.len(), dev.iter().zip(&cpu).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max));
        }
        let prefix = ids(&cases[arch]["greedy"]["prefix"]);
        let args = strs(&["generate", "--model", s(&dir), "--backend", "cuda", "--prompt-ids", &csv(&prefix), "--max-new-tokens", "12", "--ignore-eos", "--json"]);
        let v = json_line(&ok(&args, &env));
        let path: Vec<u32> = ids(&v["new_ids"]);
        assert_eq!(path.len(), 12, "{v}");
        let ties = check_greedy_path(&format!("tiny-{arch} generate"), &cpu_ref(&dir, None), &prefix, &path);
        println!("tiny-{arch} generate: 12 greedy tokens, {ties} near-tie(s)");
    }
}

fn read_jsonl(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// `rollout` on the device (groups of 2 sampled hot — temperature 8: the tiny random models'
/// logits are huge — so members differ; the fixture adapter on): each trajectory's `L(∅)`,
/// `L(M_K)` and gain against the CPU reference re-scoring the device's own final prompt (sampled
/// tokens differ between backends once logits differ, so the reference
/// scores what the device generated); then one GRPO step's LoRA gradients on those
/// conversations, device against CPU. `eval` (greedy) on the device against `eval` on the CPU:
/// the gains wherever both wrote the same memories (where they did not, a greedy near-tie
/// parted them: `score_and_generate_match_cpu` checks greedy paths step by step).
#[test]
fn rollout_gains_grpo_gradients_and_eval_match_cpu() {
    let Some(env) = cuda_env("rollout_gains_grpo_gradients_and_eval_match_cpu") else { return };
    for arch in E2E_ARCHS {
        let (_t, dir) = tiny_for_agent(arch);
        let tmp = tempfile::tempdir().unwrap();
        let templates = short_templates(tmp.path());
        let data = tmp.path().join("data.jsonl");
        write_code_qa(&data, 2, "x");
        let adapter = fixtures().join(format!("tiny-{arch}-lora"));
        let agent = strs(&["--model", s(&dir), "--templates", s(&templates), "--data", s(&data), "--chunk-tokens", "40", "--memory-tokens", "8", "--answer-tokens", "4"]);
        let (dev_out, cpu_out) = (tmp.path().join("dev.jsonl"), tmp.path().join("cpu.jsonl"));
        let roll = |out: &Path, backend: &[&str], env: &[(&str, &str)]| {
            let a = [strs(&["rollout"]), agent.clone(), strs(&["--adapter", s(&adapter), "--group-size", "2", "--temperature", "8", "--seed", "5", "--out", s(out)]), strs(backend)].concat();
            ok(&a, env);
            read_jsonl(out)
        };
        let dev = roll(&dev_out, &["--backend", "cuda"], &env);
        let cpu = roll(&cpu_out, &["--backend", "cpu", "--dtype", "bf16"], &[]);
        assert_eq!(dev.len(), 4, "2 queries × 2 rollouts");
        let r = cpu_ref(&dir, Some(&adapter));
        let tok = r.tokenizer.as_ref().unwrap();
        // the reference's L(M_K) and L(∅) with their bounds: the final prompt (over the device's
        // memory: its final turn's prompt; over ∅: built as the rollout builds it), then the gold
        // answer; checked first on the CPU's own trajectories, which they must reproduce
        let tpl = infomem_engine::agent::Templates::load(&templates).unwrap();
        let fin = infomem_engine::agent::PromptPlan::new(tok, &tpl.final_).unwrap();
        let scored = |ctx: &[u32], t: &Value| {
            let gold = tok.encode(t["gold"][0].as_str().unwrap().trim()).unwrap();
            (reward_mean(&score_ref(&r, ctx, &gold)), mean(&lp_bounds(&r, ctx, &gold)))
        };
        let l_mem = |t: &Value| scored(&ids(&t["conversations"].as_array().unwrap().last().unwrap()["prompt_ids"]), t);
        let l_empty = |t: &Value| {
            let q = tok.encode(t["question"].as_str().unwrap()).unwrap();
            scored(&fin.build(&q, &[], &tok.encode(&tpl.empty_memory).unwrap()).0, t)
        };
        for t in &cpu {
            for (what, want, got) in [("L(M_K)", l_mem(t).0, &t["logp_memory"]), ("L(∅)", l_empty(t).0, &t["logp_empty"])] {
                let got = got.as_f64().unwrap();
                assert!((want - got).abs() <= 1e-4 * (1.0 + want.abs()), "tiny-{arch}: the reference does not reproduce the CPU rollout's {what}: {want} vs {got}");
            }
        }
        let mut worst = 0f64;
        for (i, t) in dev.iter().enumerate() {
            let ((lm, bm), (le, be)) = (l_mem(t), l_empty(t));
            for (what, got, want, b) in [("L(M_K)", &t["logp_memory"], lm, bm), ("L(∅)", &t["logp_empty"], le, be)] {
                let got = got.as_f64().unwrap();
                assert!((got - want).abs() <= b, "tiny-{arch} trajectory {i} {what}: device {got} vs reference {want} (bound {b})");
            }
            let (g, want) = (t["gain"].as_f64().unwrap(), lm - le);
            assert!((g - want).abs() <= bm + be, "tiny-{arch} trajectory {i}: gain {g} vs reference {want} (bound {})", bm + be);
            worst = worst.max((g - want).abs());
        }
        println!("tiny-{arch} rollout: {} trajectories, gains max |Δ| {worst:.2e}", dev.len());

        // one GRPO step on the device's group: every turn of every trajectory, advantage = the
        // trajectory's reward minus its group's mean (as the trainer forms them)
        let mut convs = Vec::new();
        for grp in dev.chunks(2) {
            let mean = grp.iter().map(|t| t["reward"].as_f64().unwrap()).sum::<f64>() / grp.len() as f64;
            for t in grp {
                for turn in t["conversations"].as_array().unwrap() {
                    let (prompt, response) = (ids(&turn["prompt_ids"]), ids(&turn["gen_ids"]));
                    if !response.is_empty() {
                        let advantage = (t["reward"].as_f64().unwrap() - mean) as f32;
                        convs.push(Conversation { prompt, response, advantage, old_logprobs: None, ref_logprobs: None });
                    }
                }
            }
        }
        // a group whose rewards tie has no advantage: the KL term alone still drives the gradient
        // (the reference is the CPU in bf16, `r`, as everywhere in this file)
        let mut d = Model::load(&dir, own_backend()).unwrap();
        d.load_adapter(&adapter).unwrap();
        let gcfg = GrpoConfig { eps_low: 0.2, eps_high: 0.28, kl_coef: 0.05, token_norm: 0 };
        grpo_step_grads(&format!("tiny-{arch} GRPO step on the device's rollout group ({} conversations)", convs.len()), &r, &d, &convs, &gcfg);

        // eval: greedy, one trajectory per question, the same adapter: its L(∅) is the
        // rollout's (same question, same final prompt over ∅), so the CPU's gain + L(∅) is its L(M_K)
        let (dev_ev, cpu_ev) = (tmp.path().join("ev-dev"), tmp.path().join("ev-cpu"));
        for (out, backend, env) in [(&dev_ev, ["--backend", "cuda"], &env[..]), (&cpu_ev, ["--backend", "cpu"], &[])] {
            let dtype: &[&str] = if backend[1] == "cpu" { &["--dtype", "bf16"] } else { &[] };
            ok(&[strs(&["eval"]), agent.clone(), strs(&["--adapter", s(&adapter), "--out", s(out)]), strs(&backend), strs(dtype)].concat(), env);
        }
        let (pd, pc) = (read_jsonl(&dev_ev.join("predictions.jsonl")), read_jsonl(&cpu_ev.join("predictions.jsonl")));
        assert_eq!(pd.len(), 2);
        let mut same = 0;
        for (a, b) in pd.iter().zip(&pc) {
            assert_eq!(a["id"], b["id"]);
            let (gd, gc) = (a["gain"].as_f64().unwrap(), b["gain"].as_f64().unwrap());
            assert!(gd.is_finite(), "{a}");
            // the device's memories are greedy: where they are the CPU's, so is the final prompt
            if a["memories"] == b["memories"] {
                // L(∅)'s bound from the reference; L(M_K)'s from the rollout's final prompts, the
                // largest (the eval's own final prompt is not in its output)
                let t = cpu.iter().find(|t| t["query_id"] == a["id"]).unwrap();
                let bm = cpu.iter().filter(|t| t["query_id"] == a["id"]).chain(dev.iter().filter(|t| t["query_id"] == a["id"])).map(|t| l_mem(t).1).fold(0f64, f64::max);
                let bound = l_empty(t).1 + bm;
                assert!((gd - gc).abs() <= bound, "tiny-{arch} eval {}: gain {gd} vs CPU {gc} (bound {bound})", a["id"]);
                same += 1;
            }
        }
        // where the memories differ, a greedy near-tie parted them: the same greedy agent as a
        // rollout (one trajectory per question, temperature 0, as eval runs it) writes its turns'
        // prompts and tokens, and every greedy token is checked against the reference
        let greedy = tmp.path().join("greedy.jsonl");
        ok(&[strs(&["rollout"]), agent.clone(), strs(&["--adapter", s(&adapter), "--group-size", "1", "--temperature", "0", "--out", s(&greedy), "--backend", "cuda"])].concat(), &env);
        let (mut steps, mut ties) = (0, 0);
        for t in read_jsonl(&greedy) {
            for (k, turn) in t["conversations"].as_array().unwrap().iter().enumerate() {
                let path = ids(&turn["gen_ids"]);
                ties += check_greedy_path(&format!("tiny-{arch} greedy rollout {} turn {k}", t["query_id"]), &r, &ids(&turn["prompt_ids"]), &path);
                steps += path.len();
            }
        }
        let gm: Vec<Value> = read_jsonl(&greedy).iter().map(|t| t["memories"].clone()).collect();
        assert_eq!(gm, pd.iter().map(|p| p["memories"].clone()).collect::<Vec<_>>(), "tiny-{arch}: eval and the greedy rollout wrote different memories on the device");
        println!("tiny-{arch} eval: {same} of {} questions with the same memories as the CPU; greedy turns: {steps} tokens, {ties} near-tie(s)", pd.len());
    }
}

/// `model_train::compare_grads` with this file's log-prob bound: both backends back-propagate
/// the same upstream gradient (the reference's GRPO ∂loss/∂logp per response token), the
/// response log-probs within `lp_bound` of the reference's, the LoRA gradients within
/// `TINY_BOUND`.
fn grpo_step_grads(what: &str, c: &Model<CpuBackend>, d: &Model<CudaBackend>, convs: &[Conversation], cfg: &GrpoConfig) {
    let seqs: Vec<TrainSeq> = convs.iter().map(|c| TrainSeq { prompt: &c.prompt, response: &c.response }).collect();
    let refs = grpo::reference_logprobs(c, convs, cfg).unwrap();
    let (mut dlogp, mut cpu_lp, mut dev_lp) = (Vec::new(), Vec::new(), Vec::new());
    let (stats, gc) = policy_grads(c, &seqs, |sc| {
        let r = grpo::grpo_loss(convs, sc, &refs, cfg)?;
        dlogp = r.1.clone();
        cpu_lp = sc.logprobs.clone();
        Ok(r)
    })
    .unwrap();
    let ((), gd) = policy_grads(d, &seqs, |sc| {
        dev_lp = sc.logprobs.clone();
        Ok(((), dlogp.clone()))
    })
    .unwrap();
    for (i, conv) in convs.iter().enumerate() {
        let bounds = lp_bounds(c, &conv.prompt, &conv.response);
        for (j, ((x, y), b)) in dev_lp[i].iter().zip(&cpu_lp[i]).zip(&bounds).enumerate() {
            assert!(((x - y).abs() as f64) <= *b, "{what}: conversation {i} token {j}: log p {x} vs {y} (bound {b})");
        }
    }
    println!("{what}: CPU GRPO loss {:.6} over {} tokens ({} clipped)", stats.loss, stats.response_tokens, stats.clipped_tokens);
    compare_tensors(what, &gc.to_peft(c).unwrap(), &gd.to_peft(d).unwrap(), TINY_BOUND);
}

fn reward_mean(lps: &[f32]) -> f64 {
    infomem_engine::reward::mean_logprob(lps)
}

/// `train --backend cuda` for 2 steps writes an adapter that loads (the engine's PEFT reader,
/// checked against PEFT itself by tests/runtime_tiny.rs) and scores on the device as on the
/// CPU; where torch + peft are installed, tools/check_peft.py loads it in PEFT and compares
/// with the CPU's f32 `score` (1e-3), else that step says it is skipped.
#[test]
fn train_writes_an_adapter_peft_loads() {
    let Some(env) = cuda_env("train_writes_an_adapter_peft_loads") else { return };
    let (_t, dir) = tiny_for_agent("qwen2");
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    write_code_qa(&data, 4, "t");
    let templates = short_templates(tmp.path());
    let out = tmp.path().join("run");
    let args = strs(&[
        "train", "--model", s(&dir), "--data", s(&data), "--templates", s(&templates), "--out", s(&out), "--backend", "cuda", "--steps", "2",
        "--queries-per-step", "1", "--group-size", "2", "--temperature", "4", "--chunk-tokens", "40", "--memory-tokens", "8", "--answer-tokens", "4",
        // the gain on every rollout: a tiny random model never answers right, so the success-only
        // InfoMem reward would tie every group and leave nothing to learn
        "--reward", "infomem-all",
        // rank 8: cuBLASLt's bf16 tensor-core kernels need leading dimensions of 8 (gemm::ld_hint)
        "--lora-r", "8",
    ]);
    ok(&args, &env);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
    for l in metrics.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        assert!(v["skipped"].is_null() && v["grad_norm"].as_f64().is_some_and(|g| g.is_finite() && g > 0.0), "a step did not train: {l}");
    }
    let adapter = out.join("adapter");
    let cfg = ModelConfig::load(&dir).unwrap();
    let ad = LoraAdapter::load(&adapter, &cfg).unwrap();
    assert_eq!(ad.r, 8);
    // two AdamW steps moved B off its zero init
    assert!(ad.layers.iter().flatten().flatten().any(|p| p.b.data.iter().any(|&x| x != 0.0)), "the adapter's B is still zero after 2 steps; metrics:\n{metrics}");
    let (ctx, tgt) = ("5,6,7,8,9,10,11,12", "13,14,15,16");
    let base = strs(&["score", "--model", s(&dir), "--adapter", s(&adapter), "--context-ids", ctx, "--target-ids", tgt, "--json"]);
    let dev = floats32(&json_line(&ok(&[base.clone(), strs(&["--backend", "cuda"])].concat(), &env))["logprobs"]);
    let cpu = floats32(&json_line(&ok(&[base, strs(&["--backend", "cpu", "--dtype", "bf16"])].concat(), &[]))["logprobs"]);
    let ids_of = |v: &str| v.split(',').map(|x| x.parse().unwrap()).collect::<Vec<u32>>();
    let bounds = lp_bounds(&cpu_ref(&dir, Some(&adapter)), &ids_of(ctx), &ids_of(tgt));
    for (j, ((d, c), b)) in dev.iter().zip(&cpu).zip(&bounds).enumerate() {
        assert!(((d - c).abs() as f64) <= *b, "trained adapter, target {j}: device {d} vs CPU {c} (bound {b})");
    }
    let has_peft = Command::new("python3").args(["-c", "import torch, peft, transformers"]).output().is_ok_and(|o| o.status.success());
    if !has_peft {
        eprintln!("train_writes_an_adapter_peft_loads: PEFT check skipped: python3 lacks torch / peft / transformers (tools/check_peft.py)");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = Command::new("python3")
        .arg(root.join("tools/check_peft.py"))
        .args(["--model", s(&dir), "--adapter", s(&adapter), "--context-ids", ctx, "--target-ids", tgt, "--bin", env!("CARGO_BIN_EXE_infomem-engine")])
        .output()
        .unwrap();
    assert!(o.status.success(), "tools/check_peft.py: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}
