//! Row movement on the device: embedding lookup, row gather, and the training head's row scaling
//! and scatter-add (the bias add and the f32 → bf16 cast of the same file are launched by the ops
//! that need them). Kernels: kernels/memory.cu. CPU twin: src/backend/cpu/memory.rs. Parity test:
//! tests/cuda_parity/memory.rs.
use super::{CudaBackend, CudaBuf, Dtype};
use anyhow::{bail, ensure, Result};

/// The kernels of kernels/memory.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = (
    "memory",
    &[
        "embed_bf16",
        "gather_rows_b16",
        "gather_rows_b32",
        "f32_to_bf16",
        "add_bias_bf16",
        "add_bias_f32",
        "scale_rows_f32",
        "scatter_add_rows_f32",
        "scatter_add_rows_bf16",
    ],
);

pub(super) fn gather_rows(be: &CudaBackend, x: &CudaBuf, rows: &[u32], d: usize, out: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    if rows.is_empty() || d == 0 {
        return Ok(());
    }
    if let Some(&bad) = rows.iter().find(|&&r| (r as usize + 1) * d > x.len) {
        bail!("cuda gather_rows: row {bad} beyond a buffer of {} elements", x.len);
    }
    out.set_output(rows.len() * d, x.dtype, "gather_rows")?;
    let (src, dst, d64) = (x.ptr(), out.ptr(), d as i64);
    let rp = be.meta("rows", bytemuck::cast_slice(rows))?;
    let name = if x.dtype == Dtype::F32 { "gather_rows_b32" } else { "gather_rows_b16" };
    launch!(be, name, rows.len(), 256, src, rp, d64, dst)
}

pub(super) fn embed(be: &CudaBackend, table: &CudaBuf, ids: &[u32], d: usize, out: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    if ids.is_empty() {
        return Ok(());
    }
    let max = ids.iter().copied().max().unwrap() as usize;
    let t = be.weight_ptr(table, (max + 1) * d, "embed", "the embedding table")?;
    out.set_output(ids.len() * d, Dtype::F32, "embed")?;
    let (o, d32) = (out.ptr(), d as i32);
    let ip = be.meta("ids", bytemuck::cast_slice(ids))?;
    launch!(be, "embed_bf16", ids.len(), 256, t, ip, d32, o)
}

pub(super) fn scale_rows(be: &CudaBackend, x: &mut CudaBuf, coef: &[f32], d: usize) -> Result<()> {
    let _op = be.enter()?;
    let rows = coef.len();
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let xp = CudaBackend::grad_acc(x, rows * d, "scale_rows", "x")?;
    let cp = be.meta("row_coef", bytemuck::cast_slice(coef))?;
    let d32 = d as i32;
    launch!(be, "scale_rows_f32", rows, 256, xp, cp, d32)
}

pub(super) fn scatter_add_rows(be: &CudaBackend, src: &CudaBuf, rows: &[u32], d: usize, dst: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    if rows.is_empty() || d == 0 {
        return Ok(());
    }
    src.need(rows.len() * d, "scatter_add_rows", "src")?;
    let n_dst = dst.len / d;
    let mut seen = vec![false; n_dst];
    for &r in rows {
        let r = r as usize;
        ensure!(r < n_dst, "cuda scatter_add_rows: row {r} beyond the destination's {n_dst} rows");
        // distinct rows: one block per row writes it, no atomics (memory.cu)
        ensure!(!std::mem::replace(&mut seen[r], true), "cuda scatter_add_rows: row {r} appears twice");
    }
    let dp = CudaBackend::grad_acc(dst, n_dst * d, "scatter_add_rows", "dst")?;
    let rp = be.meta("rows", bytemuck::cast_slice(rows))?;
    let (sp, d32) = (src.ptr(), d as i32);
    launch!(be, &format!("scatter_add_rows_{}", src.dtype.name()), rows.len(), 256, sp, rp, d32, dp)
}
