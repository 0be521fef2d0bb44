//! The trainer on a tiny model with a byte-level tokenizer: a resumed run computes exactly the
//! step an uninterrupted one computes, checkpoints are complete, a NaN never reaches the
//! adapter. (Ctrl-C is in tests/train_interrupt.rs: its flag is process-wide.)
mod common;
use common::train::*;
use common::*;
use infomem_engine::reward::RewardMode;
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::model::lora::LoraAdapter;
use infomem_engine::model::weights::SafetensorsSet;
use infomem_engine::rl::trainer::{latest_checkpoint, StepMetrics};
use infomem_engine::runtime::Model;
use std::path::Path;


fn metrics(out: &Path) -> Vec<StepMetrics> {
    std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn resume_gives_the_same_next_step() {
    resume_case("qwen2");
}

/// The whole loop on Qwen3 (q/k norms, q wider than hidden): rollouts, scoring, the update
/// through the norms, checkpoints and resume.
#[test]
fn qwen3_trains_and_resumes() {
    resume_case("qwen3");
}

fn resume_case(arch: &str) {
    let (_t, model) = tiny_with_tokenizer(arch);
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));

    let mut ta = trainer(config(&model, &a, 3), false, &model);
    ta.run(|_| {}).unwrap();
    // a second run: 2 steps, then resumed to 3
    let mut tb = trainer(config(&model, &b, 2), false, &model);
    tb.run(|_| {}).unwrap();
    let mut tb = trainer(config(&model, &b, 3), true, &model);
    assert_eq!(tb.step, 2);
    tb.run(|_| {}).unwrap();

    assert_eq!(adapter_bytes(&a.join("adapter")), adapter_bytes(&b.join("adapter")), "resumed step 3 differs from the uninterrupted one");
    let (ma, mb) = (metrics(&a), metrics(&b));
    assert_eq!(ma.len(), 3);
    assert_eq!(mb.len(), 3);
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!((x.step, x.reward_mean, x.loss, x.grad_norm, x.answer_cut), (y.step, y.reward_mean, y.loss, y.grad_norm, y.answer_cut));
    }
    // every step says how many final answers ran out of their 4-token budget: all of them here
    // (the random tiny model samples its end-of-text byte-level id almost never)
    assert!(ma.iter().all(|m| m.answer_cut == Some(1.0)), "{:?}", ma.iter().map(|m| m.answer_cut).collect::<Vec<_>>());
    // it learned something: the adapter moved, B is no longer zero
    let ad = LoraAdapter::load(&a.join("adapter"), &Model::load(&model, CpuBackend::new()).unwrap().cfg).unwrap();
    let b_norm: f32 = ad.layers.iter().flatten().flatten().map(|p| p.b.data.iter().map(|x| x * x).sum::<f32>()).sum();
    assert!(b_norm > 0.0, "the adapter was never updated");
    assert!(ma.iter().all(|m| m.skipped.is_none()), "{:?}", ma.iter().map(|m| &m.skipped).collect::<Vec<_>>());
    // checkpoints: only complete ones, the newest is the last step, the PNG exists
    let ck = latest_checkpoint(&a).unwrap();
    assert!(ck.ends_with("step-000003"));
    for e in std::fs::read_dir(a.join("checkpoints")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        assert!(name.starts_with("step-") && e.path().join("state.json").exists(), "stray checkpoint entry {name}");
        let opt = SafetensorsSet::open_files(&[e.path().join("optimizer.safetensors")]).unwrap();
        assert!(opt.names().any(|n| n.ends_with("lora_B.weight.exp_avg_sq")));
    }
    assert!(a.join("curves.png").exists());
}

#[test]
fn nan_never_reaches_the_adapter() {
    let (_t, model) = tiny_with_tokenizer("llama");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let cfg0 = Model::load(&model, CpuBackend::new()).unwrap().cfg;
    // an adapter with a NaN: every forward is poisoned
    let mut ad = LoraAdapter::init(&cfg0, 4, 8.0, &[infomem_engine::model::lora::Proj::Q], 1);
    ad.layers[0][0].as_mut().unwrap().b.data[0] = f32::NAN;
    let init = tmp.path().join("nan-adapter");
    ad.save_peft(&init).unwrap();
    let mut cfg = config(&model, &out, 2);
    cfg.init_adapter = Some(init.clone());
    cfg.reward = RewardMode::Outcome;
    let mut t = trainer(cfg, false, &model);
    t.run(|_| {}).unwrap();
    let ms = metrics(&out);
    assert!(ms.iter().all(|m| m.skipped.as_deref().is_some_and(|s| s.contains("non-finite"))), "{:?}", ms.iter().map(|m| &m.skipped).collect::<Vec<_>>());
    assert_eq!(adapter_bytes(&out.join("adapter")).len(), adapter_bytes(&init).len());
    let after = LoraAdapter::load(&out.join("adapter"), &cfg0).unwrap();
    let (a0, a1) = (&ad.layers[0][0].as_ref().unwrap().a.data, &after.layers[0][0].as_ref().unwrap().a.data);
    assert_eq!(a0, a1, "a skipped step must leave the adapter as it was");
}
