//! Subcommand implementations (argument structs + glue to the library).
pub mod bench;
pub mod reward;
pub mod run;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::runtime::Model;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// HF model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Compute backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
}

impl ModelArgs {
    pub fn load_cpu(&self) -> Result<Model<CpuBackend>> {
        if self.backend != BackendKind::Cpu {
            bail!("--backend cuda: this binary was built without CUDA support (rebuild with `cargo build --release --features cuda`)");
        }
        let mut m = Model::load(&self.model, CpuBackend::new())?;
        if let Some(a) = &self.adapter {
            m.load_adapter(a)?;
        }
        Ok(m)
    }
}

/// Print a value as one JSON line.
pub fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string(v).expect("JSON values always serialize"));
}
