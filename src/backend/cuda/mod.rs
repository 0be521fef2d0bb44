//! The CUDA backend: bf16 storage, f32 accumulation, hand-written kernels (kernels/*.cu, compiled
//! by build.rs and embedded) for everything but the GEMMs, which go to cuBLASLt.
//!
//! **Buffers.** A `CudaBuf` is device bytes plus an element count and a dtype. Which dtype a
//! buffer holds is decided by the op that writes it, so the runtime's generic code needs no
//! dtype knowledge:
//! - `upload`/`upload_vec` store bf16 (weights, norms, biases, LoRA factors: bf16 is their
//!   checkpoint precision); `zeros(n)` allocates room for n f32 (either dtype fits) and reads as
//!   f32 zeros;
//! - GEMM outputs, the embedding output and the residual stream are **f32**: the residual stream
//!   accumulates ~2·n_layers deltas and bf16 would lose their low bits (HF keeps it bf16; f32 here
//!   costs a few MB of bandwidth per step and buys parity with the f32 CPU path);
//! - ops whose output feeds a GEMM (rmsnorm, add_rmsnorm, swiglu, attention) write **bf16**, the
//!   GEMM's input type. A GEMM given an f32 input converts it first (a copy; the runtime never
//!   does this).
//! Kernels take f32 or bf16 activations (template instantiations); weights must be bf16.
//!
//! **KV cache.** One preallocated bf16 pool `[page][layer][k|v][kv_head][page_size][head_dim]`
//! (`kv_new` allocates all of it); copy-on-write of a page is one contiguous device copy.
//!
//! **Training** (`TrainBackend`; the backward kernels sit beside their forward in each family's
//! kernel file, the optimizer in `optim.cu`):
//! - gradients are **f32** buffers (every `zeros` is f32); an f32 gradient that feeds a GEMM is
//!   rounded to bf16 on the way in (as PyTorch's bf16 autocast does), accumulation stays f32;
//! - LoRA parameters are **f32 masters with a bf16 shadow**: the first `adamw` on a bf16 buffer
//!   widens it to f32 and keeps the bf16 bytes as its shadow; the AdamW kernel then writes both
//!   (an lr·1e-4 update would vanish in bf16's 8-bit significand). Ops that read a weight
//!   (`weight_ptr`) read the shadow of an f32 master; `write` refreshes both;
//! - `lora_merge` is **lazy**: instead of rounding `W + scale·B·A` to bf16 (which would drop a
//!   young adapter's delta below W's half-ulp), the merged copy keeps `W` in bf16 plus a list of
//!   pending LoRA terms (device copies of the pair's bf16 A and B, owned by the term). `matmul` applies them as
//!   `y += scale·(x Aᵀ) Bᵀ` in f32 (exactly the rollout's `lora` op), `matmul_dx` as
//!   `dx += scale·(dy B) A`, `download` materializes them on the host. Any write to the buffer
//!   (`touch`) drops the terms, and any other weight reader refuses a buffer that has some; the
//!   runtime re-merges each layer right before using it, so the pointers are always the live
//!   adapter's;
//! - memory: allocations come from the stream-ordered pool, or plain allocations behind the
//!   engine's block cache where the pool does not work (`alloc.rs`); either keeps what one phase
//!   frees (the rollout's KV cache) for the next (the update's activations); `footprint.rs` has
//!   the footprint model, the "what would fit" error and how much the backward may keep.
//!
//! **Streams and metadata.** Everything runs in order on one stream. Small per-call host data
//! (token ids, positions, slots, page tables) is uploaded through a per-kind cache that skips
//! the upload when the bytes equal the previous call's: a step passes the same positions, slots
//! and attention tables to every layer, so only the first layer pays for the copy.
//!
//! **Layout.** `device.rs` is the runtime (buffers, copies, caches) over the device seam
//! (`seam.rs`: the `Device` trait; `real.rs` the driver + cuBLASLt, `emulated.rs` the CPU
//! emulation running the embedded PTX in the interpreter `ptx/`, cuBLASLt's matmul in
//! `emulated_gemm.rs`), `alloc.rs` the allocator,
//! `footprint.rs` the memory plan; every other file is one op
//! family mirroring `kernels/<family>.cu` and `src/backend/cpu/<family>.rs` (the table in
//! `backend/mod.rs`): it launches the family's kernels, forward and backward, and holds the
//! family's host-side tables. `gemm.rs` wraps cuBLASLt and launches the projections. This file
//! routes the two traits' methods to them. `emulate.rs` (tests only) is a lane-level mma oracle
//! for the interpreter.
#![allow(clippy::too_many_arguments)] // the family functions mirror the backend traits' signatures

/// Launch a kernel of `$be` by name through the device seam. Arguments must be locals whose
/// Rust types match the kernel's C types: u64 for pointers, i32 for int, i64 for long long, f32
/// (`seam::IntoKArg`); the emulated device checks them against the entry's `.param` list.
macro_rules! launch {
    ($be:expr, $name:expr, $grid:expr, $block:expr, $($arg:ident),* $(,)?) => {
        launch_dyn!($be, $name, $grid, $block, 0u32, $($arg),*)
    };
}

/// `launch!` with `$smem` bytes of dynamic shared memory (kernels that declare
/// `extern __shared__`; more than 48 KiB needs the attribute set in `CudaBackend::new`).
macro_rules! launch_dyn {
    ($be:expr, $name:expr, $grid:expr, $block:expr, $smem:expr, $($arg:ident),* $(,)?) => {{
        let name: &str = $name;
        let args = [$( $crate::backend::cuda::seam::IntoKArg::karg(&$arg) ),*];
        $be.dev.launch(name, $grid as u32, $block as u32, $smem as u32, &args)
    }};
}

pub mod alloc;
pub mod attention;
pub mod attention_dense;
#[cfg(test)]
mod bounds;
pub mod conformance;
pub mod device;
#[cfg(test)]
pub(crate) mod emulate;
pub mod emulated;
pub mod emulated_gemm;
#[cfg(test)]
mod emulated_kernels;
pub mod footprint;
pub mod gemm;
pub mod ptx;
mod real;
pub mod seam;
mod logprob;
mod memory;
mod norm;
mod optim;
mod rope;
mod sample;
mod swiglu;

pub use attention::{CudaKv, HEAD_DIMS};
pub use device::{device_present, kernels_missing, nvcc_version, CudaBackend, CudaBuf, Dtype};
use device::{grid_for, LoraTerm};
#[cfg(test)]
use device::KERNEL_NAMES as KERNEL_TABLE;

use super::{AdamWStep, AttnGeom, AttnSeq, Backend, DenseSeq, HeadOut, SampleParams, Sampled, TrainBackend};
use anyhow::Result;

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Kv = CudaKv;

    fn name(&self) -> String {
        format!("cuda ({}, {} SMs, bf16 storage / f32 accumulation, {} allocator)", self.device, self.n_sm, self.heap.mode().short())
    }
    fn synchronize(&self) -> Result<()> {
        device::synchronize(self)
    }
    fn upload(&self, data: &[f32]) -> Result<CudaBuf> {
        device::upload(self, data)
    }
    fn upload_param(&self, data: &[f32]) -> Result<CudaBuf> {
        device::upload_param(self, data)
    }
    fn zeros(&self, n: usize) -> Result<CudaBuf> {
        device::zeros(self, n)
    }
    fn download(&self, buf: &CudaBuf) -> Result<Vec<f32>> {
        device::download(self, buf)
    }
    fn write(&self, buf: &mut CudaBuf, data: &[f32]) -> Result<()> {
        device::write(self, buf, data)
    }
    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }
    fn kv_new(&self, geom: AttnGeom, max_pages: usize) -> Result<CudaKv> {
        attention::kv_new(self, geom, max_pages)
    }
    fn kv_copy_page(&self, kv: &mut CudaKv, src: u32, dst: u32, _n_tokens: usize) -> Result<()> {
        attention::kv_copy_page(self, kv, src, dst, _n_tokens)
    }
    fn kv_release_page(&self, _kv: &mut CudaKv, _page: u32) {}
    fn gather_rows(&self, x: &CudaBuf, rows: &[u32], d: usize, out: &mut CudaBuf) -> Result<()> {
        memory::gather_rows(self, x, rows, d, out)
    }
    fn embed(&self, table: &CudaBuf, ids: &[u32], d: usize, out: &mut CudaBuf) -> Result<()> {
        memory::embed(self, table, ids, d, out)
    }
    fn rmsnorm(&self, x: &CudaBuf, w: &CudaBuf, eps: f32, rows: usize, d: usize, out: &mut CudaBuf) -> Result<()> {
        norm::rmsnorm(self, x, w, eps, rows, d, out)
    }
    fn add_rmsnorm(&self, resid: &mut CudaBuf, delta: &CudaBuf, w: &CudaBuf, eps: f32, rows: usize, d: usize, out: &mut CudaBuf) -> Result<()> {
        norm::add_rmsnorm(self, resid, delta, w, eps, rows, d, out)
    }
    fn add(&self, resid: &mut CudaBuf, delta: &CudaBuf, n: usize) -> Result<()> {
        norm::add(self, resid, delta, n)
    }
    fn matmul(&self, x: &CudaBuf, w: &CudaBuf, bias: Option<&CudaBuf>, m: usize, k: usize, n: usize, out: &mut CudaBuf) -> Result<()> {
        gemm::matmul(self, x, w, bias, m, k, n, out)
    }
    fn lora(&self, x: &CudaBuf, a: &CudaBuf, b: &CudaBuf, scale: f32, m: usize, k: usize, r: usize, n_out: usize, out: &mut CudaBuf, col0: usize, ld: usize) -> Result<()> {
        gemm::lora(self, x, a, b, scale, m, k, r, n_out, out, col0, ld)
    }
    fn rope(&self, qkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        rope::rope(self, qkv, positions, inv_freq, g)
    }
    fn qk_norm_rope(&self, qkv: &mut CudaBuf, q_norm: &CudaBuf, k_norm: &CudaBuf, eps: f32, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        rope::qk_norm_rope(self, qkv, q_norm, k_norm, eps, positions, inv_freq, g)
    }
    fn kv_store(&self, kv: &mut CudaKv, layer: usize, qkv: &CudaBuf, slots: &[u32], g: AttnGeom) -> Result<()> {
        attention::kv_store(self, kv, layer, qkv, slots, g)
    }
    fn attention(&self, kv: &CudaKv, layer: usize, qkv: &CudaBuf, seqs: &[AttnSeq], g: AttnGeom, out: &mut CudaBuf) -> Result<()> {
        attention::attention(self, kv, layer, qkv, seqs, g, out)
    }
    fn swiglu(&self, gate_up: &CudaBuf, m: usize, i: usize, out: &mut CudaBuf) -> Result<()> {
        swiglu::swiglu(self, gate_up, m, i, out)
    }
    fn logprobs(&self, h: &CudaBuf, head: &CudaBuf, targets: &[u32], d: usize, vocab: usize) -> Result<Vec<f32>> {
        logprob::logprobs(self, h, head, targets, d, vocab)
    }
    fn sample(&self, logits: &CudaBuf, vocab: usize, params: &[SampleParams], uniform: &[f64]) -> Result<Vec<Sampled>> {
        sample::sample(self, logits, vocab, params, uniform)
    }
}

impl TrainBackend for CudaBackend {
    fn keep_activation_bytes(&self, working_set: usize) -> Result<usize> {
        footprint::keep_activation_bytes(self, working_set)
    }
    fn copy(&self, src: &CudaBuf, dst: &mut CudaBuf) -> Result<()> {
        device::copy(self, src, dst)
    }
    fn lora_merge(&self, w: &mut CudaBuf, row0: usize, a: &CudaBuf, b: &CudaBuf, scale: f32, k: usize, r: usize, n_out: usize) -> Result<()> {
        gemm::lora_merge(self, w, row0, a, b, scale, k, r, n_out)
    }
    fn attn_dense(&self, qkv: &CudaBuf, seqs: &[DenseSeq], g: AttnGeom, out: &mut CudaBuf, lse: &mut CudaBuf) -> Result<()> {
        attention_dense::attn_dense(self, qkv, seqs, g, out, lse)
    }
    fn attn_dense_bwd(&self, qkv: &CudaBuf, out: &CudaBuf, dout: &CudaBuf, lse: &CudaBuf, seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut CudaBuf) -> Result<()> {
        attention_dense::attn_dense_bwd(self, qkv, out, dout, lse, seqs, g, dqkv)
    }
    fn rmsnorm_bwd(&self, x: &CudaBuf, w: &CudaBuf, dy: &CudaBuf, eps: f32, rows: usize, d: usize, dx: &mut CudaBuf, accumulate: bool) -> Result<()> {
        norm::rmsnorm_bwd(self, x, w, dy, eps, rows, d, dx, accumulate)
    }
    fn rope_bwd(&self, dqkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        rope::rope_bwd(self, dqkv, positions, inv_freq, g)
    }
    fn qk_norm_rope_bwd(&self, pre: &CudaBuf, q_norm: &CudaBuf, k_norm: &CudaBuf, eps: f32, dqkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        rope::qk_norm_rope_bwd(self, pre, q_norm, k_norm, eps, dqkv, positions, inv_freq, g)
    }
    fn swiglu_bwd(&self, gate_up: &CudaBuf, dact: &CudaBuf, m: usize, i: usize, dgate_up: &mut CudaBuf) -> Result<()> {
        swiglu::swiglu_bwd(self, gate_up, dact, m, i, dgate_up)
    }
    fn matmul_dx(&self, dy: &CudaBuf, w: &CudaBuf, m: usize, n: usize, k: usize, dx: &mut CudaBuf, accumulate: bool) -> Result<()> {
        gemm::matmul_dx(self, dy, w, m, n, k, dx, accumulate)
    }
    fn lora_bwd(&self, x: &CudaBuf, a: &CudaBuf, b: &CudaBuf, scale: f32, m: usize, k: usize, r: usize, n_out: usize, dy: &CudaBuf, col0: usize, ld: usize, da: &mut CudaBuf, db: &mut CudaBuf, dx: Option<&mut CudaBuf>) -> Result<()> {
        gemm::lora_bwd(self, x, a, b, scale, m, k, r, n_out, dy, col0, ld, da, db, dx)
    }
    fn head_grad(&self, h: &CudaBuf, head: &CudaBuf, targets: &[u32], d: usize, vocab: usize, g: &mut CudaBuf) -> Result<HeadOut> {
        logprob::head_grad(self, h, head, targets, d, vocab, g)
    }
    fn scale_rows(&self, x: &mut CudaBuf, coef: &[f32], d: usize) -> Result<()> {
        memory::scale_rows(self, x, coef, d)
    }
    fn scatter_add_rows(&self, src: &CudaBuf, rows: &[u32], d: usize, dst: &mut CudaBuf) -> Result<()> {
        memory::scatter_add_rows(self, src, rows, d, dst)
    }
    fn sum_squares(&self, x: &CudaBuf) -> Result<f64> {
        optim::sum_squares(self, x)
    }
    fn scale(&self, x: &mut CudaBuf, s: f32) -> Result<()> {
        optim::scale(self, x, s)
    }
    fn accumulate(&self, acc: &mut CudaBuf, x: &CudaBuf) -> Result<()> {
        norm::accumulate(self, acc, x)
    }
    fn adamw(&self, p: &mut CudaBuf, g: &CudaBuf, m: &mut CudaBuf, v: &mut CudaBuf, h: AdamWStep) -> Result<()> {
        optim::adamw(self, p, g, m, v, h)
    }
}
