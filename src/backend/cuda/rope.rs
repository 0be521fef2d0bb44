//! RoPE on the device: the rotation of the q/k heads of the fused qkv rows, and its backward (the
//! same kernel template with the opposite angle); Qwen3's per-head q/k RMSNorm fused with it, and
//! that fusion's backward. Kernels: kernels/rope.cu. CPU twin:
//! src/backend/cpu/rope.rs. Parity test: tests/cuda_parity/rope.rs.
use super::{CudaBackend, CudaBuf};
use crate::backend::AttnGeom;
use anyhow::{ensure, Result};

/// The kernels of kernels/rope.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = (
    "rope",
    &[
        "rope_f32",
        "rope_bf16",
        "rope_bwd_f32",
        "rope_bwd_bf16",
        "qk_norm_rope_f32",
        "qk_norm_rope_bf16",
        "qk_norm_rope_bwd_f32_f32",
        "qk_norm_rope_bwd_f32_bf16",
        "qk_norm_rope_bwd_bf16_f32",
        "qk_norm_rope_bwd_bf16_bf16",
    ],
);

pub(super) fn rope(be: &CudaBackend, qkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    rotate(be, "rope", "qkv", qkv, positions, inv_freq, g)
}

pub(super) fn rope_bwd(be: &CudaBackend, dqkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    rotate(be, "rope_bwd", "dqkv", dqkv, positions, inv_freq, g)
}

/// The forward (`op` = "rope") or backward ("rope_bwd") rotation on the q/k heads of a
/// `[rows, qkv_dim]` buffer (named `buf` in errors), in place.
fn rotate(be: &CudaBackend, op: &str, buf: &str, qkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    let _op = be.enter()?;
    if positions.is_empty() {
        return Ok(());
    }
    ensure!(inv_freq.len() * 2 == g.head_dim, "cuda {op}: {} frequencies for head_dim {}", inv_freq.len(), g.head_dim);
    qkv.touch();
    qkv.need(positions.len() * g.qkv_dim(), op, buf)?;
    let pp = be.meta("positions", bytemuck::cast_slice(positions))?;
    let fp = be.meta("inv_freq", bytemuck::cast_slice(inv_freq))?;
    let (q, heads, hd, width) = (qkv.ptr(), (g.n_heads + g.n_kv_heads) as i32, g.head_dim as i32, g.qkv_dim() as i32);
    launch!(be, &format!("{op}_{}", qkv.dtype.name()), positions.len(), 128, q, pp, fp, heads, hd, width)
}

/// Threads per block of the q/k-norm kernels (`QKN_THREADS` in rope.cu: 4 warps, one head each).
const QKN_THREADS: u32 = 128;
/// The largest head_dim the q/k-norm kernels take (`QKN_MAXP` = 4 pairs per lane: 2·32·4).
const QKN_MAX_HEAD_DIM: usize = 256;

/// Qwen3's per-head q/k RMSNorm fused with RoPE, in place on the q/k heads of `[rows, qkv_dim]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn qk_norm_rope(be: &CudaBackend, qkv: &mut CudaBuf, q_norm: &CudaBuf, k_norm: &CudaBuf, eps: f32, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    const OP: &str = "qk_norm_rope";
    let _op = be.enter()?;
    if positions.is_empty() {
        return Ok(());
    }
    check_qk_norm(OP, q_norm, k_norm, inv_freq, g)?;
    qkv.touch();
    qkv.need(positions.len() * g.qkv_dim(), OP, "qkv")?;
    let qn = be.weight_ptr(q_norm, g.head_dim, OP, "q_norm")?;
    let kn = be.weight_ptr(k_norm, g.head_dim, OP, "k_norm")?;
    let pp = be.meta("positions", bytemuck::cast_slice(positions))?;
    let fp = be.meta("inv_freq", bytemuck::cast_slice(inv_freq))?;
    let (q, nh, nkv, hd, width) = (qkv.ptr(), g.n_heads as i32, g.n_kv_heads as i32, g.head_dim as i32, g.qkv_dim() as i32);
    launch!(be, &format!("{OP}_{}", qkv.dtype.name()), positions.len(), QKN_THREADS, q, pp, fp, qn, kn, eps, nh, nkv, hd, width)
}

/// Backward of [`qk_norm_rope`]: `dqkv`'s q/k heads (the gradient w.r.t. its output) become, in
/// place, the gradient w.r.t. its input `pre`; the v columns are untouched.
#[allow(clippy::too_many_arguments)]
pub(super) fn qk_norm_rope_bwd(be: &CudaBackend, pre: &CudaBuf, q_norm: &CudaBuf, k_norm: &CudaBuf, eps: f32, dqkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    const OP: &str = "qk_norm_rope_bwd";
    let _op = be.enter()?;
    if positions.is_empty() {
        return Ok(());
    }
    check_qk_norm(OP, q_norm, k_norm, inv_freq, g)?;
    let n = positions.len() * g.qkv_dim();
    pre.need(n, OP, "pre")?;
    dqkv.touch();
    dqkv.need(n, OP, "dqkv")?;
    let qn = be.weight_ptr(q_norm, g.head_dim, OP, "q_norm")?;
    let kn = be.weight_ptr(k_norm, g.head_dim, OP, "k_norm")?;
    let pp = be.meta("positions", bytemuck::cast_slice(positions))?;
    let fp = be.meta("inv_freq", bytemuck::cast_slice(inv_freq))?;
    let (xp, dp, nh, nkv, hd, width) = (pre.ptr(), dqkv.ptr(), g.n_heads as i32, g.n_kv_heads as i32, g.head_dim as i32, g.qkv_dim() as i32);
    let name = format!("{OP}_{}_{}", pre.dtype.name(), dqkv.dtype.name());
    launch!(be, &name, positions.len(), QKN_THREADS, xp, qn, kn, dp, pp, fp, eps, nh, nkv, hd, width)
}

/// The geometry the q/k-norm kernels take, and norm weights of exactly head_dim (as the CPU twin).
fn check_qk_norm(op: &str, q_norm: &CudaBuf, k_norm: &CudaBuf, inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    ensure!(
        g.head_dim >= 2 && g.head_dim % 2 == 0 && g.head_dim <= QKN_MAX_HEAD_DIM,
        "cuda {op}: head_dim {} is not an even size from 2 to {QKN_MAX_HEAD_DIM}",
        g.head_dim
    );
    ensure!(inv_freq.len() * 2 == g.head_dim, "cuda {op}: {} frequencies for head_dim {}", inv_freq.len(), g.head_dim);
    ensure!(
        q_norm.len == g.head_dim && k_norm.len == g.head_dim,
        "cuda {op}: norm weights of {} and {} for head_dim {}",
        q_norm.len,
        k_norm.len,
        g.head_dim
    );
    Ok(())
}
