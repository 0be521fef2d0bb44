//! The fixed set of ops this transformer needs, behind two small traits: `Backend` (inference:
//! what a forward step, generation and scoring use) and `TrainBackend` (the LoRA backward and
//! the optimizer on top of it). Two devices implement them: `cpu/` (f32 on host memory) and
//! `cuda/` (bf16 storage, f32 accumulation, kernels/*.cu). Each device folder has one file per op
//! family, named like the kernel file that implements the family on the GPU, holding the
//! forward and backward of that family:
//!
//! | family | ops | CPU twin | CUDA launch | kernel |
//! |---|---|---|---|---|
//! | norm | rmsnorm, add_rmsnorm, add, rmsnorm_bwd | cpu/norm.rs | cuda/norm.rs | kernels/norm.cu |
//! | rope | rope, rope_bwd, qk_norm_rope, qk_norm_rope_bwd (Qwen3's per-head q/k norm fused with RoPE) | cpu/rope.rs | cuda/rope.rs | kernels/rope.cu |
//! | swiglu | swiglu, swiglu_bwd | cpu/swiglu.rs | cuda/swiglu.rs | kernels/swiglu.cu |
//! | memory | embed, gather_rows, scale_rows, scatter_add_rows, casts | cpu/memory.rs | cuda/memory.rs | kernels/memory.cu |
//! | attention | paged causal GQA attention (prefill, scoring, decode); the KV cache (kv_new, kv_store, kv_copy_page) | cpu/attention.rs | cuda/attention.rs | kernels/attention.cu |
//! | attention_dense | training attention forward (+ lse) and backward | cpu/attention_dense.rs | cuda/attention_dense.rs | kernels/attention_dense.cu |
//! | matmul | matmul, lora, matmul_lora, matmul_lora_swiglu, matmul_dx, lora_bwd, matmul_dx_lora, lora_merge | cpu/matmul.rs (+ gemm512.rs, lora.rs) | cuda/gemm.rs (cuBLASLt) | — |
//! | logprob | logprobs, head_grad (vocabulary tiles, online softmax) | cpu/logprob.rs | cuda/logprob.rs | kernels/logprob.cu |
//! | sample | sample | cpu/sample.rs | cuda/sample.rs | kernels/sample.cu |
//! | optim | sum_squares, scale, accumulate, adamw | cpu/optim.rs | cuda/optim.rs | kernels/optim.cu |
//!
//! The parity test of a family is `tests/cuda_parity/<family>.rs` (CUDA against the CPU twin);
//! the CPU twins are checked against PyTorch-computed fixtures by `tests/runtime_tiny.rs`,
//! `tests/grpo_grad.rs` and `tests/smollm2.rs`.
//!
//! Bulk data lives in `Backend::Buf` (one flat array); small per-call metadata (token ids,
//! positions, page tables, sampling parameters) is passed as host slices and moved by the backend.
//!
//! Layout conventions (all row-major):
//! - activations `[rows, features]`; weights `[out, in]` as in HF checkpoints, so a projection is
//!   `y = x Wᵀ (+ b)`;
//! - the fused `qkv` activation holds q (`n_heads·hd`), then k, then v (`n_kv_heads·hd` each);
//! - the fused `gate_up` activation holds gate (`inter`), then up (`inter`);
//! - the paged KV cache is addressed by slot = page·page_size + offset (see `runtime::kv`);
//! - a *dense batch* (training) is sequences concatenated along the rows (`DenseSeq`: rows
//!   `row0 .. row0 + len`, positions `0 .. len`); no KV cache, every sequence attends causally to
//!   its own rows only;
//! - `lse [rows, n_heads]`: log-sum-exp of the scaled scores of each query row and head, from the
//!   training attention forward, so the backward recomputes probabilities without a `[T, T]` matrix;
//! - gradients have the layout of the tensor they belong to (`dqkv` like `qkv`, `dA` like `A`).
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::model::config::ModelConfig;
use anyhow::Result;

/// How a model's weight matrices are stored: f32, or bf16 rounded once at load with f32
/// accumulation (docs/DESIGN.md §3). The one dtype type of the library: parsed once at the
/// command line (`--dtype`), recorded by `train`, read by both backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }

    /// What `--dtype auto` gives for the agent's work on this machine, and why: bf16 on CUDA (its
    /// only mode) and on a CPU with bf16 products (AMX or AVX512_BF16: 1.5-2.5x faster end to
    /// end, docs/RESULTS.md), else f32.
    pub fn auto(cuda: bool) -> (Dtype, &'static str) {
        if cuda {
            return (Dtype::Bf16, "the CUDA backend's only mode");
        }
        if cpu::bf16::amx_available() {
            (Dtype::Bf16, "this CPU has AMX")
        } else if cpu::bf16::vdp_available() {
            (Dtype::Bf16, "this CPU has AVX512_BF16")
        } else {
            (Dtype::F32, "this CPU has neither AMX nor AVX512_BF16")
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Geometry of the attention and KV cache, fixed per model.
#[derive(Clone, Copy, Debug)]
pub struct AttnGeom {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub page_size: usize,
}

impl AttnGeom {
    pub fn new(cfg: &ModelConfig, page_size: usize) -> Self {
        AttnGeom {
            n_layers: cfg.n_layers,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            page_size,
        }
    }
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
}

/// One sequence's share of a batched attention call: its query rows are
/// `q_row .. q_row + n_q` of the batch, they sit at positions `ctx_len - n_q .. ctx_len` of the
/// sequence, and the sequence's keys/values (including those rows) are in `pages`.
#[derive(Clone, Debug)]
pub struct AttnSeq<'a> {
    pub q_row: usize,
    pub n_q: usize,
    pub ctx_len: usize,
    pub pages: &'a [u32],
    /// The rows are the sequence's own sampled tokens (decode), not fed text. The CPU's bf16
    /// attention computes sampled rows with its direct kernels and fed rows on AMX tiles, so a
    /// row gets the same bits however the scheduler chunks a prompt (`cpu::attention`).
    pub sampled: bool,
}

/// How to pick the next token of one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0 → greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 keeps the whole vocabulary.
    pub top_p: f32,
}

impl SampleParams {
    pub const GREEDY: SampleParams = SampleParams { temperature: 0.0, top_p: 1.0 };
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// A picked token and its log-probability under the model (log-softmax at temperature 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
}

/// One sequence of a dense batch: rows `row0 .. row0 + len`, at positions `0 .. len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenseSeq {
    pub row0: usize,
    pub len: usize,
}

/// Per-row results of the fused head pass.
#[derive(Clone, Debug, Default)]
pub struct HeadOut {
    /// `log softmax(h·headᵀ)[target]`
    pub logprobs: Vec<f32>,
    /// Entropy (nats) of the row's next-token distribution.
    pub entropy: Vec<f32>,
}

/// One AdamW step (PyTorch's `torch.optim.AdamW` semantics: decoupled weight decay applied as
/// `p ← p·(1 − lr·wd)` before the Adam update, bias-corrected moments).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count (for the bias corrections).
    pub step: u64,
    /// Multiplies the gradient before use (gradient clipping, loss scaling); 1 = unchanged.
    pub grad_scale: f32,
}

/// The per-step constants of an AdamW update, computed once on the host for every backend.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConstants {
    /// `lr / (1 − β1^t)`: the bias-corrected step size.
    pub step_size: f32,
    /// `√(1 − β2^t)`: the second moment's bias correction, applied as `√v / bc2_sqrt`.
    pub bc2_sqrt: f32,
    /// `1 − lr·wd`: the decoupled weight decay factor.
    pub decay: f32,
}

impl AdamWStep {
    /// The bias corrections in f64, each rounded to f32 once (as PyTorch's AdamW computes them).
    pub fn constants(&self) -> AdamWConstants {
        let t = self.step.max(1) as i32;
        let bc1 = 1.0 - (self.beta1 as f64).powi(t);
        let bc2 = 1.0 - (self.beta2 as f64).powi(t);
        AdamWConstants { step_size: (self.lr as f64 / bc1) as f32, bc2_sqrt: bc2.sqrt() as f32, decay: 1.0 - self.lr * self.weight_decay }
    }
}

/// One LoRA pair on a column slice of a projection's output: `out[:, col0..col0+n_out] +=
/// scale · (x Aᵀ) Bᵀ`, `A [r, k]`, `B [n_out, r]` (`Backend::matmul_lora`, `TrainBackend::matmul_dx_lora`).
pub struct LoraSlice<'a, Buf> {
    pub a: &'a Buf,
    pub b: &'a Buf,
    pub scale: f32,
    pub r: usize,
    pub col0: usize,
    pub n_out: usize,
}

/// `Backend::matmul_lora_swiglu` as the separate ops: `matmul_lora` into `gate_up`, then
/// `swiglu` (the trait's default, and the CPU backend's path where it does not fuse).
#[allow(clippy::too_many_arguments)]
pub fn matmul_lora_swiglu_separate<B: Backend + ?Sized>(be: &B, x: &B::Buf, w: &B::Buf, m: usize, k: usize, i: usize, gate_up: &mut B::Buf, act: &mut B::Buf, pairs: &[LoraSlice<'_, B::Buf>]) -> Result<()> {
    be.matmul_lora(x, w, None, m, k, 2 * i, gate_up, pairs)?;
    be.swiglu(gate_up, m, i, act)
}

/// `Backend::matmul_lora` as the separate ops: `matmul`, then `lora` of each pair in order (the
/// trait's default, and the CPU backend's path where it does not fuse).
#[allow(clippy::too_many_arguments)]
pub fn matmul_lora_separate<B: Backend + ?Sized>(be: &B, x: &B::Buf, w: &B::Buf, bias: Option<&B::Buf>, m: usize, k: usize, n: usize, out: &mut B::Buf, pairs: &[LoraSlice<'_, B::Buf>]) -> Result<()> {
    be.matmul(x, w, bias, m, k, n, out)?;
    for p in pairs {
        be.lora(x, p.a, p.b, p.scale, m, k, p.r, p.n_out, out, p.col0, n)?;
    }
    Ok(())
}

/// `TrainBackend::matmul_dx_lora` as the separate ops: `matmul_dx` (dx overwritten), then
/// `lora_bwd` of each pair in order with dx (the trait's default, and the CPU backend's path
/// where it does not fuse).
#[allow(clippy::too_many_arguments)]
pub fn matmul_dx_lora_separate<B: TrainBackend + ?Sized>(be: &B, dy: &B::Buf, w: &B::Buf, m: usize, n: usize, k: usize, dx: &mut B::Buf, x: &B::Buf, pairs: &[LoraSlice<'_, B::Buf>], grads: &mut [(&mut B::Buf, &mut B::Buf)]) -> Result<()> {
    anyhow::ensure!(pairs.len() == grads.len(), "matmul_dx_lora: {} pairs, {} gradient pairs", pairs.len(), grads.len());
    be.matmul_dx(dy, w, m, n, k, dx, false)?;
    for (p, (ga, gb)) in pairs.iter().zip(grads.iter_mut()) {
        be.lora_bwd(x, p.a, p.b, p.scale, m, k, p.r, p.n_out, dy, p.col0, n, ga, gb, Some(&mut *dx))?;
    }
    Ok(())
}

/// `TrainBackend::matmul_dx_lora_swiglu` as the separate ops: x = `swiglu(gate_up)` into a
/// buffer, then `matmul_dx_lora` (the trait's default, and the CPU backend's path where it does
/// not fuse).
#[allow(clippy::too_many_arguments)]
pub fn matmul_dx_lora_swiglu_separate<B: TrainBackend + ?Sized>(be: &B, dy: &B::Buf, w: &B::Buf, m: usize, n: usize, k: usize, dx: &mut B::Buf, gate_up: &B::Buf, pairs: &[LoraSlice<'_, B::Buf>], grads: &mut [(&mut B::Buf, &mut B::Buf)]) -> Result<()> {
    anyhow::ensure!(be.len(gate_up) >= m * 2 * k, "matmul_dx_lora_swiglu: gate_up smaller than [{m}, {}]", 2 * k);
    // Safety: `swiglu` writes it whole
    let mut x = unsafe { be.scratch(m * k)? };
    be.swiglu(gate_up, m, k, &mut x)?;
    be.matmul_dx_lora(dy, w, m, n, k, dx, &x, pairs, grads)
}

pub trait Backend: Send + Sync {
    /// A flat array on the backend's device.
    type Buf: Send + Sync;
    /// The paged KV cache storage for all layers.
    type Kv: Send + Sync;

    fn name(&self) -> String;

    /// Wait until every op enqueued so far has finished (a GPU backend returns from most ops
    /// before their kernels run; the CPU computes in the call). Timings read the clock after it
    /// ([`timed`]), and it surfaces asynchronous device errors.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Whether the ops compute on the calling process's rayon threads (the CPU backend): then a
    /// loop of short ops keeps those threads awake (`util::awake`). A GPU backend's host threads
    /// only enqueue: the default, no.
    fn host_compute(&self) -> bool {
        false
    }

    // ---- memory ----
    fn upload(&self, data: &[f32]) -> Result<Self::Buf>;
    /// Like `upload`, taking ownership (the CPU backend keeps the vector without copying).
    fn upload_vec(&self, data: Vec<f32>) -> Result<Self::Buf> {
        self.upload(&data)
    }
    /// Upload a trainable parameter (a LoRA A or B). Backends that store weights in lower
    /// precision keep an exact master copy, so a checkpoint restores the adapter bit for bit.
    fn upload_param(&self, data: &[f32]) -> Result<Self::Buf> {
        self.upload(data)
    }
    /// Upload a frozen weight matrix `[n, k]` (row-major, HF layout): stored in the backend's
    /// weight dtype (bf16 on CUDA; f32 or bf16 on the CPU per `--dtype`). Norms, biases and
    /// trainable parameters use `upload_vec` / `upload_param`.
    fn upload_weight(&self, data: Vec<f32>, n: usize, k: usize) -> Result<Self::Buf> {
        let _ = (n, k);
        self.upload_vec(data)
    }
    /// A zero-filled buffer of `n` elements.
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Overwrite `buf` (same length) with host data.
    fn write(&self, buf: &mut Self::Buf, data: &[f32]) -> Result<()>;
    fn len(&self, buf: &Self::Buf) -> usize;

    // ---- KV cache ----
    /// Storage for at most `max_pages` pages (backends may allocate lazily).
    fn kv_new(&self, geom: AttnGeom, max_pages: usize) -> Result<Self::Kv>;
    /// Copy the first `n_tokens` slots of page `src` to page `dst` (copy-on-write of a shared page).
    fn kv_copy_page(&self, kv: &mut Self::Kv, src: u32, dst: u32, n_tokens: usize) -> Result<()>;
    /// Let the backend reclaim a page's memory (it may keep it for reuse).
    fn kv_release_page(&self, kv: &mut Self::Kv, page: u32);

    // ---- forward ops ----
    /// `out[i] = x[rows[i]]`, rows of `d` (picks the rows whose logits are wanted).
    fn gather_rows(&self, x: &Self::Buf, rows: &[u32], d: usize, out: &mut Self::Buf) -> Result<()>;
    /// `out[i] = table[ids[i]]`, rows of `d`.
    fn embed(&self, table: &Self::Buf, ids: &[u32], d: usize, out: &mut Self::Buf) -> Result<()>;
    /// `out = x / rms(x) · w` per row of `d`.
    fn rmsnorm(&self, x: &Self::Buf, w: &Self::Buf, eps: f32, rows: usize, d: usize, out: &mut Self::Buf) -> Result<()>;
    /// `resid += delta; out = rmsnorm(resid) · w` (the residual add fused with the next norm).
    #[allow(clippy::too_many_arguments)]
    fn add_rmsnorm(
        &self,
        resid: &mut Self::Buf,
        delta: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
        rows: usize,
        d: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `resid += delta`.
    fn add(&self, resid: &mut Self::Buf, delta: &Self::Buf, n: usize) -> Result<()>;
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])`.
    #[allow(clippy::too_many_arguments)]
    fn matmul(&self, x: &Self::Buf, w: &Self::Buf, bias: Option<&Self::Buf>, m: usize, k: usize, n: usize, out: &mut Self::Buf) -> Result<()>;
    /// LoRA delta into a column slice of `out`: `out[:, col0..col0+n_out] += scale · (x Aᵀ) Bᵀ`,
    /// `x [m, k]`, `A [r, k]`, `B [n_out, r]`, `out` rows of `ld` — `B·A` is never formed.
    #[allow(clippy::too_many_arguments)]
    fn lora(&self, x: &Self::Buf, a: &Self::Buf, b: &Self::Buf, scale: f32, m: usize, k: usize, r: usize, n_out: usize, out: &mut Self::Buf, col0: usize, ld: usize) -> Result<()>;
    /// `matmul`, then `lora` of each pair in order (input `x [m, k]`, `out` rows of `n`), as one
    /// op so that a backend can add the deltas while the output is in cache (the CPU's bf16
    /// GEMM does). The same result as the separate ops.
    #[allow(clippy::too_many_arguments)]
    fn matmul_lora(&self, x: &Self::Buf, w: &Self::Buf, bias: Option<&Self::Buf>, m: usize, k: usize, n: usize, out: &mut Self::Buf, pairs: &[LoraSlice<'_, Self::Buf>]) -> Result<()> {
        matmul_lora_separate(self, x, w, bias, m, k, n, out, pairs)
    }
    /// Rotate the q and k parts of the fused `qkv [rows, qkv_dim]` in place (HF's rotate_half
    /// convention) at `positions[row]`, with `inv_freq` (`head_dim/2`).
    fn rope(&self, qkv: &mut Self::Buf, positions: &[u32], inv_freq: &[f32], geom: AttnGeom) -> Result<()>;
    /// Qwen3's q/k norm fused with RoPE, in place on the fused `qkv [rows, qkv_dim]`: each q head
    /// (`head_dim` wide) becomes `rmsnorm(q_h) · q_norm` and each k head `rmsnorm(k_h) · k_norm`
    /// (`q_norm`, `k_norm` of `head_dim`; eps `eps`, the model's `rms_norm_eps`), then q and k are
    /// rotated exactly as [`Backend::rope`]; v is untouched.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(&self, qkv: &mut Self::Buf, q_norm: &Self::Buf, k_norm: &Self::Buf, eps: f32, positions: &[u32], inv_freq: &[f32], geom: AttnGeom) -> Result<()>;
    /// Store the k and v parts of `qkv` rows into the cache of `layer` at `slots[row]`.
    fn kv_store(&self, kv: &mut Self::Kv, layer: usize, qkv: &Self::Buf, slots: &[u32], geom: AttnGeom) -> Result<()>;
    /// Causal attention of each sequence's query rows over its cached keys/values (GQA):
    /// `out [rows, q_dim]`.
    fn attention(&self, kv: &Self::Kv, layer: usize, qkv: &Self::Buf, seqs: &[AttnSeq], geom: AttnGeom, out: &mut Self::Buf) -> Result<()>;
    /// `out[m, i] = silu(gate) · up` from `gate_up [m, 2i]`.
    fn swiglu(&self, gate_up: &Self::Buf, m: usize, i: usize, out: &mut Self::Buf) -> Result<()>;
    /// `matmul_lora` of `x [m, k]` through the gate/up weight `w [2i, k]` into `gate_up [m, 2i]`,
    /// then `swiglu` into `act [m, i]`, as one op so that a backend can apply SwiGLU to each block
    /// of the product while it is in registers and never write `gate_up` (the CPU's bf16 GEMM on
    /// AMX does; `gate_up` then holds whatever it held). The same `act` as the separate ops. For
    /// the forward without gradients: the training forward keeps `gate_up` for the backward.
    #[allow(clippy::too_many_arguments)]
    fn matmul_lora_swiglu(&self, x: &Self::Buf, w: &Self::Buf, m: usize, k: usize, i: usize, gate_up: &mut Self::Buf, act: &mut Self::Buf, pairs: &[LoraSlice<'_, Self::Buf>]) -> Result<()> {
        matmul_lora_swiglu_separate(self, x, w, m, k, i, gate_up, act, pairs)
    }
    /// Log-probability of `targets[row]` under `softmax(h[row] · headᵀ)`, `h [rows, d]`, without
    /// materializing `[rows, vocab]` logits (vocab tiles, online log-sum-exp).
    fn logprobs(&self, h: &Self::Buf, head: &Self::Buf, targets: &[u32], d: usize, vocab: usize) -> Result<Vec<f32>>;
    /// Pick one token per row of `logits [rows, vocab]`; `uniform[row]` in [0,1) drives the draw.
    fn sample(&self, logits: &Self::Buf, vocab: usize, params: &[SampleParams], uniform: &[f64]) -> Result<Vec<Sampled>>;
}

/// The extra ops LoRA training needs on top of [`Backend`]: a dense attention forward that keeps
/// the per-row log-sum-exp, the backward of every op of the transformer block (base weights,
/// norms and embeddings frozen: only input gradients, plus dA/dB of the LoRA pairs), the fused
/// head backward in vocabulary tiles, and the optimizer arithmetic (squared norms, scaling, AdamW).
pub trait TrainBackend: Backend {
    /// `dst = src` (same length).
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf) -> Result<()>;

    /// Room for `n` elements whose values are unspecified, for a buffer that an op is about to
    /// write whole: the training forward's kept activations (~94 MB a layer for SmolLM2 at 4096
    /// rows), whose zeroing by `zeros` was a single-threaded `memset` in the middle of the step.
    /// The default is `zeros`.
    ///
    /// # Safety
    /// Every element must be written before any is read: on the CPU the memory is uninitialized
    /// (NaN-filled in debug builds and under `cpu::poison_scratch`, which the tests use to show
    /// that no element is read first).
    unsafe fn scratch(&self, n: usize) -> Result<Self::Buf> {
        self.zeros(n)
    }

    /// Bytes the backward may spend keeping layers' activations (and merged weights) from the
    /// forward instead of recomputing them, besides the `working_set` bytes the pass allocates
    /// with every layer recomputed. 0 (the default) recomputes every layer. Gradients are
    /// bit-identical either way; `INFOMEM_KEEP_ACTIVATIONS_MB` overrides every backend's choice.
    fn keep_activation_bytes(&self, working_set: usize) -> Result<usize> {
        let _ = working_set;
        Ok(keep_override()?.unwrap_or(0))
    }

    /// Whether the training passes should keep LoRA unmerged: the frozen weights as stored, each
    /// pair applied as its own low-rank product (`lora`, and `lora_bwd` with `dx`). For weights
    /// the merged copy could not keep in their dtype (the CPU's bf16 weights: a merged copy would
    /// be f32 and lose the bf16 GEMMs). The default merges (`lora_merge`).
    fn lora_unmerged(&self) -> bool {
        false
    }

    // ---- forward ----
    /// Fold a LoRA pair into (a copy of) a frozen weight: `w[row0 + o, :] += scale · Σ_j b[o, j]·a[j, :]`
    /// for `o < n_out`; `w` rows of `k`, `a [r, k]`, `b [n_out, r]`. The training passes run on
    /// these merged weights (`y = x (W + scale·B A)ᵀ`, `dx = dy (W + scale·B A)`), which costs one
    /// small GEMM per layer instead of thin rank-r GEMMs over every row of the batch.
    #[allow(clippy::too_many_arguments)]
    fn lora_merge(&self, w: &mut Self::Buf, row0: usize, a: &Self::Buf, b: &Self::Buf, scale: f32, k: usize, r: usize, n_out: usize) -> Result<()>;
    /// Causal GQA attention over a dense batch: `qkv [rows, qkv_dim]` (q and k already rotated)
    /// → `out [rows, q_dim]` and `lse [rows, n_heads]` (natural log of Σ exp of the scaled scores,
    /// `1/sqrt(head_dim)` scaling). Only a tile of scores exists at a time.
    fn attn_dense(&self, qkv: &Self::Buf, seqs: &[DenseSeq], geom: AttnGeom, out: &mut Self::Buf, lse: &mut Self::Buf) -> Result<()>;

    // ---- backward ----
    /// Backward of `attn_dense`: given its inputs/outputs and `dout [rows, q_dim]`, overwrite
    /// `dqkv [rows, qkv_dim]` (every row of `seqs`) with dq, dk, dv (w.r.t. the rotated q, k).
    /// dk/dv of a kv head sum the contributions of all query heads of its group.
    #[allow(clippy::too_many_arguments)]
    fn attn_dense_bwd(
        &self,
        qkv: &Self::Buf,
        out: &Self::Buf,
        dout: &Self::Buf,
        lse: &Self::Buf,
        seqs: &[DenseSeq],
        geom: AttnGeom,
        dqkv: &mut Self::Buf,
    ) -> Result<()>;
    /// Backward of `rmsnorm` w.r.t. its input (the weight is frozen): `dx (+)= ∂(x/rms(x)·w)/∂x ᵀ dy`,
    /// rows of `d`; accumulates into `dx` when `accumulate`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_bwd(&self, x: &Self::Buf, w: &Self::Buf, dy: &Self::Buf, eps: f32, rows: usize, d: usize, dx: &mut Self::Buf, accumulate: bool) -> Result<()>;
    /// Backward of `rope`: the inverse rotation of the q and k parts of `dqkv` in place (v untouched).
    fn rope_bwd(&self, dqkv: &mut Self::Buf, positions: &[u32], inv_freq: &[f32], geom: AttnGeom) -> Result<()>;
    /// Backward of `qk_norm_rope` (the norm weights are frozen): `pre [rows, qkv_dim]` is its input
    /// (the projections' output); `dqkv` holds the gradient w.r.t. its output and is overwritten in
    /// place, on its q and k parts, with the gradient w.r.t. `pre` (inverse rotation, then the
    /// per-head RMSNorm backward); the v part is untouched.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_bwd(&self, pre: &Self::Buf, q_norm: &Self::Buf, k_norm: &Self::Buf, eps: f32, dqkv: &mut Self::Buf, positions: &[u32], inv_freq: &[f32], geom: AttnGeom) -> Result<()>;
    /// Backward of `swiglu`: `dgate_up [m, 2i]` (overwritten) from `gate_up [m, 2i]` and `dact [m, i]`.
    fn swiglu_bwd(&self, gate_up: &Self::Buf, dact: &Self::Buf, m: usize, i: usize, dgate_up: &mut Self::Buf) -> Result<()>;
    /// Input gradient of a frozen projection `y = x wᵀ`: `dx[m, k] (+)= dy[m, n] · w[n, k]`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_dx(&self, dy: &Self::Buf, w: &Self::Buf, m: usize, n: usize, k: usize, dx: &mut Self::Buf, accumulate: bool) -> Result<()>;
    /// `matmul_dx` (dx overwritten), then `lora_bwd` of each pair in order with `dx` (`x [m, k]`
    /// the projection's input, `dy [m, n]`; `grads[i]` = pair i's (dA, dB), accumulated), as one
    /// op so that a backend can add the pairs' input gradients while dx is in cache (the CPU's
    /// bf16 GEMM does). The same result as the separate ops.
    #[allow(clippy::too_many_arguments)]
    fn matmul_dx_lora(&self, dy: &Self::Buf, w: &Self::Buf, m: usize, n: usize, k: usize, dx: &mut Self::Buf, x: &Self::Buf, pairs: &[LoraSlice<'_, Self::Buf>], grads: &mut [(&mut Self::Buf, &mut Self::Buf)]) -> Result<()> {
        matmul_dx_lora_separate(self, dy, w, m, n, k, dx, x, pairs, grads)
    }
    /// `matmul_dx_lora` of the down projection with its input given as the gate/up rows it was
    /// made of: `x = swiglu(gate_up)` (`gate_up [m, 2k]`, x `[m, k]`), so that a backend can form
    /// x's rows where its pairs read them and the backward never recomputes x into a buffer (the
    /// CPU's bf16 path does). The default forms x with `swiglu` and calls `matmul_dx_lora`. The
    /// same result either way.
    #[allow(clippy::too_many_arguments)]
    fn matmul_dx_lora_swiglu(&self, dy: &Self::Buf, w: &Self::Buf, m: usize, n: usize, k: usize, dx: &mut Self::Buf, gate_up: &Self::Buf, pairs: &[LoraSlice<'_, Self::Buf>], grads: &mut [(&mut Self::Buf, &mut Self::Buf)]) -> Result<()> {
        matmul_dx_lora_swiglu_separate(self, dy, w, m, n, k, dx, gate_up, pairs, grads)
    }
    /// Backward of `Backend::lora` (`y[:, col0..col0+n_out] += scale·(x Aᵀ) Bᵀ`, `y` rows of `ld`):
    /// with `dy` the gradient of the whole `y` (rows of `ld`), accumulate
    /// `dA [r, k] += scale·(dy_s B)ᵀ x`, `dB [n_out, r] += scale·dy_sᵀ (x Aᵀ)` and, when given,
    /// `dx [m, k] += scale·(dy_s B) A`, where `dy_s` is the column slice.
    #[allow(clippy::too_many_arguments)]
    fn lora_bwd(
        &self,
        x: &Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        scale: f32,
        m: usize,
        k: usize,
        r: usize,
        n_out: usize,
        dy: &Self::Buf,
        col0: usize,
        ld: usize,
        da: &mut Self::Buf,
        db: &mut Self::Buf,
        dx: Option<&mut Self::Buf>,
    ) -> Result<()>;
    /// The fused head pass of training, in vocabulary tiles with an online softmax (never a
    /// `[rows, vocab]` matrix): per row of `h [rows, d]`, the log-probability of `targets[row]`,
    /// the entropy, and `g [rows, d] = Σ_v p_v head_v − head_target`, the gradient of
    /// `log p(target)` w.r.t. `h` with the sign flipped (`∂logp/∂h = −g`).
    fn head_grad(&self, h: &Self::Buf, head: &Self::Buf, targets: &[u32], d: usize, vocab: usize, g: &mut Self::Buf) -> Result<HeadOut>;
    /// `x[row] *= coef[row]`, rows of `d`.
    fn scale_rows(&self, x: &mut Self::Buf, coef: &[f32], d: usize) -> Result<()>;
    /// `dst[rows[i]] += src[i]`, rows of `d` (`rows` distinct).
    fn scatter_add_rows(&self, src: &Self::Buf, rows: &[u32], d: usize, dst: &mut Self::Buf) -> Result<()>;

    // ---- optimizer arithmetic ----
    /// `Σ x²`, accumulated in f64.
    fn sum_squares(&self, x: &Self::Buf) -> Result<f64>;
    /// `x *= s`.
    fn scale(&self, x: &mut Self::Buf, s: f32) -> Result<()>;
    /// `acc += x` (same length).
    fn accumulate(&self, acc: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// One AdamW update of parameters `p` with gradient `g` and moments `m`, `v` (same length).
    fn adamw(&self, p: &mut Self::Buf, g: &Self::Buf, m: &mut Self::Buf, v: &mut Self::Buf, h: AdamWStep) -> Result<()>;
}

/// `INFOMEM_KEEP_ACTIVATIONS_MB` in bytes, if set (a malformed value is an error, never a
/// silent default).
pub fn keep_override() -> Result<Option<usize>> {
    match std::env::var("INFOMEM_KEEP_ACTIVATIONS_MB") {
        Ok(v) => {
            let mb: usize = v.trim().parse().map_err(|_| anyhow::anyhow!("INFOMEM_KEEP_ACTIVATIONS_MB={v:?} is not a whole number of MiB (0 recomputes every layer)"))?;
            let bytes = mb.checked_mul(1 << 20).ok_or_else(|| anyhow::anyhow!("INFOMEM_KEEP_ACTIVATIONS_MB={v:?} is too large"))?;
            Ok(Some(bytes))
        }
        Err(_) => Ok(None),
    }
}

/// f32 elements the LoRA backward (`runtime::backward::policy_grads`) allocates per row of its batch when every layer is recomputed:
/// the saved input residual of every layer, the residual stream, one layer's intermediates
/// (`Acts`), their gradients, and the head pass's rows (at most one per row). The CUDA memory
/// plan adds its scratch to this (`cuda::footprint::update_bytes_per_row`); the CPU and CUDA backends size what they may keep
/// beside it (`TrainBackend::keep_activation_bytes`). It lives here, below the runtime, because
/// both the runtime and the CUDA memory plan need it.
pub fn lora_backward_f32s_per_row(cfg: &ModelConfig) -> usize {
    let (d, l, i, nh) = (cfg.hidden, cfg.n_layers, cfg.intermediate, cfg.n_heads);
    let (q, qkv) = (cfg.q_dim(), cfg.q_dim() + 2 * cfg.kv_dim());
    let qkv_pre = if cfg.qk_norm { qkv } else { 0 }; // Qwen3: the projections' output before the q/k norm
    l * d                                   // saved input residual of every layer
        + d                                 // the residual stream x
        + d + qkv_pre + qkv + q + nh + d + d + 2 * i + i // Acts: h1 qkv_pre qkv att lse o h2 gu act
        + d + i + 2 * i + d + q + qkv       // dres dact dgu dhid datt dqkv
        + 4 * d // head rows: sel hn dh dsel
}

/// Run `f` and return its result with its duration in seconds as the device sees it: `sync`
/// (the backend's `synchronize`) runs before the clock starts, so earlier enqueued work is not
/// counted, and before it stops, so work `f` only enqueued is — PyTorch's benchmarks time the
/// same way (`torch.cuda.synchronize()` on both sides).
pub fn timed<T>(sync: impl Fn() -> Result<()>, f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    sync()?;
    let t = std::time::Instant::now();
    let out = f()?;
    sync()?;
    Ok((out, t.elapsed().as_secs_f64()))
}


#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    /// A device still busy for 300 ms when `timed` starts, whose op's work finishes 60 ms after `f` returns: `timed` must count it
    /// (the clock stops after `synchronize`), and must not count work enqueued before it starts.
    #[test]
    fn timed_waits_for_enqueued_work() {
        let busy_until = Cell::new(Instant::now() + Duration::from_millis(300)); // earlier work
        let sync = || {
            let now = Instant::now();
            if busy_until.get() > now {
                std::thread::sleep(busy_until.get() - now);
            }
            Ok(())
        };
        let ((), secs) = timed(sync, || {
            busy_until.set(Instant::now() + Duration::from_millis(60)); // an op that returns at once
            Ok(())
        })
        .unwrap();
        assert!((0.055..0.3).contains(&secs), "{secs} s: the 60 ms of enqueued work, not the 300 ms before");
        // an error of the device surfaces instead of a timing
        assert!(timed(|| anyhow::bail!("an earlier kernel failed"), || Ok(())).is_err());
    }
}
