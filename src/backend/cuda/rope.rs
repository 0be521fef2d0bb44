//! RoPE on the device: the rotation of the q/k heads of the fused qkv rows, and its backward (the
//! same kernel template with the opposite angle). Kernels: kernels/rope.cu. CPU twin:
//! src/backend/cpu/rope.rs. Parity test: tests/cuda_parity/rope.rs.
use super::{CudaBackend, CudaBuf};
use crate::backend::AttnGeom;
use anyhow::{ensure, Result};

/// The kernels of kernels/rope.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = ("rope", &["rope_f32", "rope_bf16", "rope_bwd_f32", "rope_bwd_bf16"]);

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
    launch!(be, &format!("{op}_{}", qkv.dtype.suffix()), positions.len(), 128, q, pp, fp, heads, hd, width)
}

/// Qwen3's per-head q/k RMSNorm fused with RoPE (placeholder until the kernel lands).
#[allow(clippy::too_many_arguments)]
pub(super) fn qk_norm_rope(be: &CudaBackend, qkv: &mut CudaBuf, q_norm: &CudaBuf, k_norm: &CudaBuf, eps: f32, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    let _ = (be, qkv, q_norm, k_norm, eps, positions, inv_freq, g);
    anyhow::bail!("cuda qk_norm_rope: not implemented yet")
}

#[allow(clippy::too_many_arguments)]
pub(super) fn qk_norm_rope_bwd(be: &CudaBackend, pre: &CudaBuf, q_norm: &CudaBuf, k_norm: &CudaBuf, eps: f32, dqkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    let _ = (be, pre, q_norm, k_norm, eps, dqkv, positions, inv_freq, g);
    anyhow::bail!("cuda qk_norm_rope_bwd: not implemented yet")
}
