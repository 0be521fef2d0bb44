//! The optimizer's arithmetic on the device: squared norms (fixed-order block partials), scaling,
//! AdamW with an f32 master and its bf16 shadow. Kernels: kernels/optim.cu. CPU twin:
//! src/backend/cpu/optim.rs. Parity test: tests/cuda_parity/optim.rs.
use super::{CudaBackend, CudaBuf, Dtype, grid_for};
use crate::backend::{AdamWConstants, AdamWStep};
use anyhow::{ensure, Result};

/// Blocks of the sum-of-squares reduction (at most; fewer for short inputs).
const SS_BLOCKS: usize = 256;
const OPT_THREADS: u32 = 256;

/// The kernels of kernels/optim.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = (
    "optim",
    &[
        "sum_squares_f32",
        "sum_squares_bf16",
        "scale_f32",
        "adamw_f32",
        "widen_bf16",
    ],
);

pub(super) fn sum_squares(be: &CudaBackend, x: &CudaBuf) -> Result<f64> {
    let _op = be.enter()?;
    let n = x.len;
    if n == 0 {
        return Ok(0.0);
    }
    let blocks = n.div_ceil(OPT_THREADS as usize).min(SS_BLOCKS);
    let partial = be.scratch("ss_partial", blocks * 8)?;
    let (xp, n64) = (x.ptr(), n as i64);
    launch!(be, &format!("sum_squares_{}", x.dtype.name()), blocks, OPT_THREADS, xp, n64, partial)?;
    // the partials in block order: a fixed summation order
    Ok(be.dtoh::<f64>(partial, blocks)?.iter().sum())
}

pub(super) fn scale(be: &CudaBackend, x: &mut CudaBuf, s: f32) -> Result<()> {
    let _op = be.enter()?;
    let n = x.len;
    if n == 0 {
        return Ok(());
    }
    let xp = CudaBackend::grad_acc(x, n, "scale", "x")?;
    let n64 = n as i64;
    launch!(be, "scale_f32", grid_for(n, 256), 256, xp, s, n64)
}

pub(super) fn adamw(be: &CudaBackend, p: &mut CudaBuf, g: &CudaBuf, m: &mut CudaBuf, v: &mut CudaBuf, h: AdamWStep) -> Result<()> {
    let _op = be.enter()?;
    let n = p.len;
    ensure!(g.len == n && m.len == n && v.len == n, "adamw: buffers of different lengths");
    ensure!(g.dtype == Dtype::F32, "cuda adamw: the gradient must be f32");
    if n == 0 {
        return Ok(());
    }
    let mp = CudaBackend::grad_acc(m, n, "adamw", "the first moment")?;
    let vp = CudaBackend::grad_acc(v, n, "adamw", "the second moment")?;
    p.terms.clear();
    // promote a bf16 parameter to an f32 master; its bf16 bytes become the shadow
    if p.dtype == Dtype::Bf16 {
        let f32mem = be.alloc(n * 4)?;
        let (src, dst, n64) = (p.ptr(), f32mem.ptr(), n as i64);
        launch!(be, "widen_bf16", grid_for(n, 256), 256, src, dst, n64)?;
        let old = std::mem::replace(&mut p.mem, f32mem);
        p.shadow = Some(old);
        p.dtype = Dtype::F32;
    } else if p.shadow.is_none() {
        p.shadow = Some(be.alloc(n * 2)?);
    }
    let shp = p.shadow.as_ref().expect("set just above").ptr();
    // the host constants of the CPU twin (`AdamWStep::constants`)
    let AdamWConstants { step_size, bc2_sqrt, decay } = h.constants();
    let (b1, omb1, b2, omb2, eps, gs) = (h.beta1, 1.0 - h.beta1, h.beta2, 1.0 - h.beta2, h.eps, h.grad_scale);
    let (pp, gp, n64) = (p.ptr(), g.ptr(), n as i64);
    launch!(be, "adamw_f32", grid_for(n, 256), 256, pp, shp, gp, mp, vp, n64, b1, omb1, b2, omb2, eps, decay, step_size, bc2_sqrt, gs)
}
