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
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::backend::{Backend, Dtype};
use infomem_engine::runtime::Model;
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The CPU (f32 or bf16 weights).
    Cpu,
    /// One sm_90 GPU (a build with `--features cuda`); without a GPU, INFOMEM_CUDA_EMULATE=1 runs it on the emulated device (the kernels' PTX interpreted on the CPU: slow, for checking).
    Cuda,
}

/// The environment variable that opts `--backend cuda` into the emulated device (`open_cuda`).
#[cfg(feature = "cuda")]
pub const CUDA_EMULATE_ENV: &str = "INFOMEM_CUDA_EMULATE";

/// The CUDA backend on device `ordinal`, or — with INFOMEM_CUDA_EMULATE=1, an explicit opt-in
/// that never happens by itself — on the emulated device (every kernel's real PTX run by the
/// interpreter, cuBLASLt emulated: backend/cuda/emulated.rs), said on stderr. Without a GPU the
/// plain error says so and names the opt-in.
#[cfg(feature = "cuda")]
pub fn open_cuda(ordinal: usize) -> Result<infomem_engine::backend::cuda::CudaBackend> {
    use infomem_engine::backend::cuda::{device_present, CudaBackend};
    let v = std::env::var(CUDA_EMULATE_ENV).unwrap_or_default();
    match v.as_str() {
        "1" => {
            eprintln!(
                "--backend cuda: running on the EMULATED device ({CUDA_EMULATE_ENV}=1): the kernels' real PTX interpreted on the CPU, \
                 cuBLASLt emulated (bf16, f32 accumulation) — for checking the backend without a GPU, far slower than one"
            );
            let be = CudaBackend::emulated()?;
            // refused here, not at the first launch of such a kernel halfway through the work
            if let Some((name, why)) = be.emulator_blockers().first() {
                bail!(
                    "{CUDA_EMULATE_ENV}=1: the emulated device cannot run kernel {name} yet ({why}; {} kernel(s) in all) — the interpreter \
                     does not model that instruction (issue 54)",
                    be.emulator_blockers().len()
                );
            }
            Ok(be)
        }
        "" | "0" => CudaBackend::new(ordinal).map_err(|e| {
            if device_present() {
                e
            } else {
                anyhow::anyhow!(
                    "{e:#} (to run the CUDA backend without a GPU, on the emulated device — the kernels' PTX interpreted on the CPU, \
                     slow, for checking — set {CUDA_EMULATE_ENV}=1)"
                )
            }
        }),
        _ => bail!("{CUDA_EMULATE_ENV}={v:?}: expected 1 (run --backend cuda on the emulated device) or 0 / unset (the GPU)"),
    }
}

/// `--dtype`: how the model's weight matrices are stored, or `auto` (resolved once, here at the
/// edge, into the library's [`Dtype`] by [`DtypeArg::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeArg {
    /// bf16 for the agent's work (rollout, eval, train, bench, study) where the CPU has AMX or AVX512_BF16, and on CUDA; f32 otherwise and for the reference commands (generate, score, grpo-grad).
    Auto,
    /// f32 weights (CPU only): the reference path the fixture tests check.
    F32,
    /// bf16 weights, f32 accumulation (the CUDA backend's only mode; on the CPU the AMX / vdpbf16ps kernels).
    Bf16,
}

/// What a command computes, for `--dtype auto`: the memory agent's work, where speed matters, or
/// a reference command whose numbers are compared against PyTorch's f32 references.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    Agent,
    Reference,
}

impl DtypeArg {
    /// The dtype to run, and why (for the line every command prints). f32 with CUDA is refused:
    /// the CUDA backend stores weights in bf16 only.
    pub fn resolve(self, backend: BackendKind, work: Work) -> Result<(Dtype, String)> {
        let cuda = backend == BackendKind::Cuda;
        Ok(match self {
            DtypeArg::F32 if cuda => bail!("--dtype f32 is not available with --backend cuda: the CUDA backend stores weights in bf16 (use --dtype bf16 or auto)"),
            DtypeArg::F32 => (Dtype::F32, "--dtype f32".into()),
            DtypeArg::Bf16 => (Dtype::Bf16, "--dtype bf16".into()),
            DtypeArg::Auto if work == Work::Reference && !cuda => (Dtype::F32, "auto: a reference command stays f32".into()),
            DtypeArg::Auto => {
                let (d, why) = Dtype::auto(cuda);
                (d, format!("auto: {why}"))
            }
        })
    }
}

/// Print the resolved dtype once, on stderr (stdout stays the command's output).
pub fn say_dtype(d: Dtype, why: &str) {
    eprintln!("dtype {d} ({why})");
}

/// The CPU backend for a dtype.
pub fn cpu_backend_for(d: Dtype) -> CpuBackend {
    CpuBackend::with_weights(d)
}

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// HF model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Compute backend (`cuda`: a build with `--features cuda` and an sm_90 GPU, or with INFOMEM_CUDA_EMULATE=1 the emulated device on the CPU, for checking).
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Weight storage: f32, bf16 (rounded once at load; products sum in f32; the residual stream, norms, LoRA masters, gradients and optimizer state stay f32: docs/DESIGN.md §3), or auto. The choice is printed on stderr.
    #[arg(long, value_enum, default_value_t = DtypeArg::Auto)]
    pub dtype: DtypeArg,
}

impl ModelArgs {
    /// Load the model (and adapter) on the CPU; `--backend cuda` is refused here (commands that
    /// can run on either backend use `with_model!`).
    pub fn load_cpu(&self, work: Work) -> Result<Model<CpuBackend>> {
        if self.backend != BackendKind::Cpu {
            bail!("--backend cuda is not supported by this command yet (it runs on the CPU backend only)");
        }
        self.load_on(self.cpu_backend(work)?)
    }

    /// `--dtype` resolved for this command (printed once).
    pub fn dtype(&self, work: Work) -> Result<Dtype> {
        let (d, why) = self.dtype.resolve(self.backend, work)?;
        say_dtype(d, &why);
        Ok(d)
    }

    /// The CPU backend for `--dtype`.
    pub fn cpu_backend(&self, work: Work) -> Result<CpuBackend> {
        Ok(cpu_backend_for(self.dtype(work)?))
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

/// `with_model!(args, work, |model| body)`: load the model on the backend chosen by `--backend`
/// (with `--dtype` resolved for `work`) and evaluate `body` with `model: Model<B>` for that
/// backend (generic dispatch: `body` is compiled once per backend). `--backend cuda` in a build
/// without the `cuda` feature is a clear error.
#[macro_export]
macro_rules! with_model {
    ($args:expr, $work:expr, |$m:ident| $body:expr) => {
        match $args.backend {
            $crate::cli::BackendKind::Cpu => {
                let $m = $args.load_on($args.cpu_backend($work)?)?;
                $body
            }
            $crate::cli::BackendKind::Cuda => {
                $args.dtype($work)?;
                #[cfg(feature = "cuda")]
                {
                    let $m = $args.load_on($crate::cli::open_cuda(0)?)?;
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
