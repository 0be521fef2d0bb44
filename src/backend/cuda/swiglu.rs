//! SwiGLU on the device: silu(gate)·up and its backward. Kernels: kernels/swiglu.cu. CPU twin:
//! src/backend/cpu/swiglu.rs. Parity test: tests/cuda_parity/swiglu.rs.
use super::{CudaBackend, CudaBuf, Dtype, grid_for};
use anyhow::Result;

/// The kernels of kernels/swiglu.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = (
    "swiglu",
    &[
        "swiglu_f32",
        "swiglu_bf16",
        "swiglu_bwd_f32_f32",
        "swiglu_bwd_f32_bf16",
        "swiglu_bwd_bf16_f32",
        "swiglu_bwd_bf16_bf16",
    ],
);

pub(super) fn swiglu(be: &CudaBackend, gate_up: &CudaBuf, m: usize, i: usize, out: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    if m == 0 || i == 0 {
        return Ok(());
    }
    gate_up.need(m * 2 * i, "swiglu", "gate_up")?;
    out.set_output(m * i, Dtype::Bf16, "swiglu")?;
    let (gp, op, m64, i32_) = (gate_up.ptr(), out.ptr(), m as i64, i as i32);
    launch!(be, &format!("swiglu_{}", gate_up.dtype.name()), grid_for(m * i, 256), 256, gp, m64, i32_, op)
}

pub(super) fn swiglu_bwd(be: &CudaBackend, gate_up: &CudaBuf, dact: &CudaBuf, m: usize, i: usize, dgate_up: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    if m == 0 || i == 0 {
        return Ok(());
    }
    gate_up.need(m * 2 * i, "swiglu_bwd", "gate_up")?;
    dact.need(m * i, "swiglu_bwd", "dact")?;
    dgate_up.set_output(m * 2 * i, Dtype::F32, "swiglu_bwd")?;
    let (gp, dp, op, m64, i32_) = (gate_up.ptr(), dact.ptr(), dgate_up.ptr(), m as i64, i as i32);
    let name = format!("swiglu_bwd_{}_{}", gate_up.dtype.name(), dact.dtype.name());
    launch!(be, &name, grid_for(m * i, 256), 256, gp, dp, m64, i32_, op)
}
