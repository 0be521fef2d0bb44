#![allow(dead_code)]
//! Trainer fixtures shared by tests/train.rs and tests/train_interrupt.rs.
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::data::QaRecord;
use infomem_engine::reward::RewardMode;
use infomem_engine::rl::trainer::{TrainConfig, Trainer};
use infomem_engine::runtime::Model;
use std::path::Path;

pub fn queries() -> Vec<QaRecord> {
    (0..5)
        .map(|i| QaRecord {
            id: format!("q{i}"),
            question: format!("What is code {i}?"),
            context: format!("Filler words here. The code {i} is {}. More filler after it.", 1000 + i).repeat(1 + i % 2),
            answers: vec![format!("{}", 1000 + i)],
            task: "test".into(),
            meta: Default::default(),
        })
        .collect()
}

/// A few fast steps on a tiny model: 2 questions × 3 rollouts, checkpoint every step.
pub fn config(model: &Path, out: &Path, steps: usize) -> TrainConfig {
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

pub fn trainer(cfg: TrainConfig, resume: bool, model_dir: &Path) -> Trainer<CpuBackend> {
    Trainer::new(cfg, resume, queries(), |_| Model::load(model_dir, CpuBackend::new())).unwrap()
}

pub fn adapter_bytes(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("adapter_model.safetensors")).unwrap()
}
