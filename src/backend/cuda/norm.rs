//! RMSNorm family on the device: rmsnorm, add_rmsnorm and add (forward), rmsnorm_bwd (training),
//! and `accumulate` (the optimizer's `acc += x`, which is norm.cu's `add` kernel). Kernels:
//! kernels/norm.cu. CPU twin: src/backend/cpu/norm.rs. Parity test: tests/cuda_parity/norm.rs.
use super::{CudaBackend, CudaBuf, Dtype, grid_for};
use anyhow::{ensure, Result};

/// Threads per block of the row kernels (`NORM_THREADS` in norm.cu).
const NORM_THREADS: u32 = 256;

/// The kernels of kernels/norm.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = (
    "norm",
    &[
        "rmsnorm_f32",
        "rmsnorm_bf16",
        "add_rmsnorm_f32_f32",
        "add_rmsnorm_f32_bf16",
        "add_rmsnorm_bf16_f32",
        "add_rmsnorm_bf16_bf16",
        "add_f32_f32",
        "add_f32_bf16",
        "add_bf16_f32",
        "add_bf16_bf16",
        "rmsnorm_bwd_f32_f32",
        "rmsnorm_bwd_f32_bf16",
        "rmsnorm_bwd_bf16_f32",
        "rmsnorm_bwd_bf16_bf16",
    ],
);

pub(super) fn rmsnorm(be: &CudaBackend, x: &CudaBuf, w: &CudaBuf, eps: f32, rows: usize, d: usize, out: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    if rows == 0 {
        return Ok(());
    }
    x.need(rows * d, "rmsnorm", "x")?;
    let wp = be.weight_ptr(w, d, "rmsnorm", "the norm weight")?;
    out.set_output(rows * d, Dtype::Bf16, "rmsnorm")?;
    let (xp, op, d32) = (x.ptr(), out.ptr(), d as i32);
    launch!(be, &format!("rmsnorm_{}", x.dtype.name()), rows, NORM_THREADS, xp, wp, eps, d32, op)
}

pub(super) fn add_rmsnorm(be: &CudaBackend, resid: &mut CudaBuf, delta: &CudaBuf, w: &CudaBuf, eps: f32, rows: usize, d: usize, out: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    if rows == 0 {
        return Ok(());
    }
    resid.touch();
    resid.need(rows * d, "add_rmsnorm", "resid")?;
    delta.need(rows * d, "add_rmsnorm", "delta")?;
    let wp = be.weight_ptr(w, d, "add_rmsnorm", "the norm weight")?;
    out.set_output(rows * d, Dtype::Bf16, "add_rmsnorm")?;
    let (rp, dp, op, d32) = (resid.ptr(), delta.ptr(), out.ptr(), d as i32);
    let name = format!("add_rmsnorm_{}_{}", resid.dtype.name(), delta.dtype.name());
    launch!(be, &name, rows, NORM_THREADS, rp, dp, wp, eps, d32, op)
}

pub(super) fn add(be: &CudaBackend, resid: &mut CudaBuf, delta: &CudaBuf, n: usize) -> Result<()> {
    let _op = be.enter()?;
    if n == 0 {
        return Ok(());
    }
    resid.touch();
    resid.need(n, "add", "resid")?;
    delta.need(n, "add", "delta")?;
    let (rp, dp, n64) = (resid.ptr(), delta.ptr(), n as i64);
    let name = format!("add_{}_{}", resid.dtype.name(), delta.dtype.name());
    launch!(be, &name, grid_for(n, 256), 256, rp, dp, n64)
}

pub(super) fn rmsnorm_bwd(be: &CudaBackend, x: &CudaBuf, w: &CudaBuf, dy: &CudaBuf, eps: f32, rows: usize, d: usize, dx: &mut CudaBuf, accumulate: bool) -> Result<()> {
    let _op = be.enter()?;
    if rows == 0 {
        return Ok(());
    }
    x.need(rows * d, "rmsnorm_bwd", "x")?;
    dy.need(rows * d, "rmsnorm_bwd", "dy")?;
    let wp = be.weight_ptr(w, d, "rmsnorm_bwd", "the norm weight")?;
    let dxp = if accumulate {
        CudaBackend::grad_acc(dx, rows * d, "rmsnorm_bwd", "dx")?
    } else {
        dx.set_output(rows * d, Dtype::F32, "rmsnorm_bwd")?;
        dx.ptr()
    };
    let (xp, dyp, d32, acc) = (x.ptr(), dy.ptr(), d as i32, accumulate as i32);
    let name = format!("rmsnorm_bwd_{}_{}", x.dtype.name(), dy.dtype.name());
    launch!(be, &name, rows, NORM_THREADS, xp, wp, dyp, eps, d32, dxp, acc)
}

pub(super) fn accumulate(be: &CudaBackend, acc: &mut CudaBuf, x: &CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    ensure!(acc.len == x.len, "accumulate: {} elements into {}", x.len, acc.len);
    let n = acc.len;
    if n == 0 {
        return Ok(());
    }
    let ap = CudaBackend::grad_acc(acc, n, "accumulate", "acc")?;
    let (xp, n64) = (x.ptr(), n as i64);
    launch!(be, &format!("add_f32_{}", x.dtype.name()), grid_for(n, 256), 256, ap, xp, n64)
}
