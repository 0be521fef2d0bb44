//! Subcommand implementations (argument structs + glue to the library).
pub mod agent;
pub mod bench;
pub mod data;
pub mod device;
pub mod limits;
pub mod output;
pub mod reward;
pub mod run;
pub mod study;
pub mod train;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use infomem_engine::backend::cpu::{CpuBackend, WeightDtype};
use infomem_engine::backend::Backend;
use infomem_engine::runtime::Model;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

/// How the model's weight matrices are stored (`--dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeArg {
    /// f32 weights (CPU only).
    F32,
    /// bf16 weights, f32 accumulation (the CUDA backend's only mode; on the CPU the vdpbf16ps kernels).
    Bf16,
}

impl DtypeArg {
    /// The CPU backend for this dtype.
    pub fn cpu(self) -> CpuBackend {
        match self {
            DtypeArg::F32 => CpuBackend::with_weights(WeightDtype::F32),
            DtypeArg::Bf16 => CpuBackend::with_weights(WeightDtype::Bf16),
        }
    }
    /// `--dtype` against the backend: CUDA stores weights in bf16 only.
    pub fn check(self, backend: BackendKind) -> Result<()> {
        if backend == BackendKind::Cuda && self == DtypeArg::F32 {
            bail!("--dtype f32 is not available with --backend cuda: the CUDA backend stores weights in bf16 (use --dtype bf16 or leave --dtype out)");
        }
        Ok(())
    }
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
    /// Weight storage: f32, or bf16 (rounded once at load; products sum in f32; the residual stream, norms, LoRA masters, gradients and optimizer state stay f32: docs/DESIGN.md §3). Default: f32 on the CPU, bf16 on CUDA (its only mode).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
}

impl ModelArgs {
    /// Load the model (and adapter) on the CPU; `--backend cuda` is refused here (commands that
    /// can run on either backend use `with_model!`).
    pub fn load_cpu(&self) -> Result<Model<CpuBackend>> {
        if self.backend != BackendKind::Cpu {
            bail!("--backend cuda is not supported by this command yet (it runs on the CPU backend only)");
        }
        self.load_on(self.cpu_backend()?)
    }

    /// The CPU backend for `--dtype` (f32 unless bf16 is asked for).
    pub fn cpu_backend(&self) -> Result<CpuBackend> {
        Ok(self.dtype.unwrap_or(DtypeArg::F32).cpu())
    }

    /// Load the model (and adapter) on a given backend.
    pub fn load_on<B: Backend>(&self, be: B) -> Result<Model<B>> {
        let mut m = Model::load(&self.model, be)?;
        if let Some(a) = &self.adapter {
            m.load_adapter(a)?;
        }
        Ok(m)
    }
}

/// `with_model!(args, |model| body)`: load the model on the backend chosen by `--backend` and
/// evaluate `body` with `model: Model<B>` for that backend (generic dispatch: `body` is compiled
/// once per backend). `--backend cuda` in a build without the `cuda` feature is a clear error.
#[macro_export]
macro_rules! with_model {
    ($args:expr, |$m:ident| $body:expr) => {
        match $args.backend {
            $crate::cli::BackendKind::Cpu => {
                let $m = $args.load_on($args.cpu_backend()?)?;
                $body
            }
            $crate::cli::BackendKind::Cuda => {
                if let Some(d) = $args.dtype {
                    d.check($crate::cli::BackendKind::Cuda)?;
                }
                #[cfg(feature = "cuda")]
                {
                    let $m = $args.load_on(infomem_engine::backend::cuda::CudaBackend::new(0)?)?;
                    $body
                }
                #[cfg(not(feature = "cuda"))]
                {
                    anyhow::bail!(
                        "--backend cuda: this binary was built without CUDA support (rebuild with `cargo build --release --features cuda`)"
                    )
                }
            }
        }
    };
}

/// Print a value as one JSON line.
pub fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string(v).expect("JSON values always serialize"));
}
