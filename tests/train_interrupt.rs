//! Ctrl-C during training: the trainer saves the last completed step and a resumed run ends
//! where an uninterrupted one does. Alone in its binary: the interrupt flag is process-wide.
mod common;
use common::*;
use infomem_engine::agent::AgentQuery;
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::reward::RewardMode;
use infomem_engine::rl::trainer::{latest_checkpoint, TrainConfig, Trainer};
use infomem_engine::util::interrupt;
use infomem_engine::runtime::Model;
use std::path::Path;

fn queries() -> Vec<AgentQuery> {
    (0..5)
        .map(|i| AgentQuery {
            id: format!("q{i}"),
            question: format!("What is code {i}?"),
            context: format!("Filler words here. The code {i} is {}. More filler after it.", 1000 + i).repeat(1 + i % 2),
            answers: vec![format!("{}", 1000 + i)],
        })
        .collect()
}

fn config(model: &Path, out: &Path, steps: usize) -> TrainConfig {
    TrainConfig {
        model: Some(model.to_path_buf()),
        data: Some(out.join("unused.jsonl")),
        out: out.to_path_buf(),
        lora_r: 4,
        lora_alpha: 8.0,
        steps,
        queries_per_step: 2,
        group_size: 3,
        chunk_tokens: 40,
        memory_tokens: 8,
        answer_tokens: 4,
        // the tiny random model's logits are huge: sample hot so groups differ
        temperature: 8.0,
        reward: RewardMode::Infomem,
        kl_coef: 0.05,
        lr: 5e-3,
        warmup_steps: 0,
        micro_batch_tokens: 300,
        save_every: 1,
        keep_checkpoints: 3,
        seed: 3,
        ..Default::default()
    }
}

fn trainer(cfg: TrainConfig, resume: bool, model_dir: &Path) -> Trainer<CpuBackend> {
    Trainer::new(cfg, resume, queries(), |_| Model::load(model_dir, CpuBackend::new())).unwrap()
}

fn adapter_bytes(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("adapter_model.safetensors")).unwrap()
}


#[test]
fn ctrl_c_saves_and_resumes_exactly() {
    let (_t, model) = tiny_with_tokenizer("qwen2");
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let mut cfg_b = config(&model, &b, 2);
    cfg_b.save_every = 0; // only the interrupt saves
    let mut tb = trainer(cfg_b.clone(), false, &model);
    let err = tb.run(|m| {
        if m.step == 1 {
            interrupt::set_requested(true); // as the SIGINT handler would
        }
    });
    interrupt::set_requested(false);
    let err = err.unwrap_err();
    assert!(interrupt::is_interrupted(&err), "{err:#}");
    assert!(latest_checkpoint(&b).unwrap().ends_with("step-000001"));
    let mut tb = trainer(cfg_b, true, &model);
    tb.run(|_| {}).unwrap();
    let mut cfg_a = config(&model, &a, 2);
    cfg_a.save_every = 0;
    trainer(cfg_a, false, &model).run(|_| {}).unwrap();
    assert_eq!(adapter_bytes(&a.join("adapter")), adapter_bytes(&b.join("adapter")));
}
