//! Sampling on the device: greedy / temperature / top-p on the device, token for token equal to the
//! CPU sampler. Kernels: kernels/sample.cu. CPU twin:
//! src/backend/cpu/sample.rs. Parity test: tests/cuda_parity/sample.rs.
use super::{CudaBackend, CudaBuf};
use crate::backend::{SampleParams, Sampled};
use anyhow::{ensure, Result};

const SAMPLE_THREADS: u32 = 512;

/// The kernels of kernels/sample.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = (
    "sample",
    &[
        "sample_f32",
        "sample_bf16",
    ],
);

pub(super) fn sample(be: &CudaBackend, logits: &CudaBuf, vocab: usize, params: &[SampleParams], uniform: &[f64]) -> Result<Vec<Sampled>> {
    let _op = be.enter()?;
    let rows = params.len();
    if rows == 0 {
        return Ok(Vec::new());
    }
    ensure!(uniform.len() >= rows, "sample: {} uniforms for {rows} rows", uniform.len());
    logits.need(rows * vocab, "sample", "logits")?;
    let temps: Vec<f32> = params.iter().map(|p| p.temperature).collect();
    let top_ps: Vec<f32> = params.iter().map(|p| p.top_p).collect();
    let tp = be.meta("temps", bytemuck::cast_slice(&temps))?;
    let pp = be.meta("top_ps", bytemuck::cast_slice(&top_ps))?;
    let up = be.meta("uniforms", bytemuck::cast_slice(&uniform[..rows]))?;
    let res = be.scratch("sample_out", rows * 8)?;
    let (lp, tok, vocab32) = (logits.ptr(), res, vocab as i32);
    let lps = res + (rows * 4) as u64;
    launch!(be, &format!("sample_{}", logits.dtype.name()), rows, SAMPLE_THREADS, lp, vocab32, tp, pp, up, tok, lps)?;
    let toks: Vec<u32> = be.dtoh(tok, rows)?;
    let lps: Vec<f32> = be.dtoh(lps, rows)?;
    Ok(toks.into_iter().zip(lps).map(|(token, logprob)| Sampled { token, logprob }).collect())
}
