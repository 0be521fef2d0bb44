//! The LM head on the device: teacher-forced log-probabilities over vocabulary tiles (cuBLASLt
//! logits + `logprob_tile`) and the training head's backward (`head_probs_tile`,
//! `head_grad_finish`). Kernels: kernels/logprob.cu. CPU twin: src/backend/cpu/logprob.rs.
//! Parity test: tests/cuda_parity/logprob.rs.
use super::{gemm, CudaBackend, CudaBuf, Dtype};
use crate::backend::HeadOut;
use anyhow::{bail, Result};

/// Threads per block of the head kernels (`LP_THREADS` in logprob.cu).
const LP_THREADS: u32 = 256;
/// Logits scratch of the log-prob op: at most this many f32 per vocabulary tile (64 MB).
pub(super) const LOGPROB_SCRATCH: usize = 16 << 20;
const LOGPROB_MAX_ROWS: usize = 4096;

/// The kernels of kernels/logprob.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = ("logprob", &["logprob_tile", "head_probs_tile", "head_grad_finish"]);

/// Vocabulary tile for a block of `rb` rows: as wide as the logits scratch allows, a multiple
/// of 256 columns.
fn vocab_tile(rb: usize, vocab: usize) -> usize {
    ((LOGPROB_SCRATCH / rb) / 256 * 256).clamp(256, vocab.next_multiple_of(256)).min(vocab)
}

/// Pass over the vocabulary for rows `hrows` (bf16, `rb` × `d`): each tile's logits by cuBLASLt
/// into `logits`, folded by `logprob_tile` into the running max `run_m`, sum `run_s` and the
/// target logit `tgt` (device arrays of `rb` f32). After it, lse = m + log s.
#[allow(clippy::too_many_arguments)]
fn lse_pass(be: &CudaBackend, hrows: u64, wp: u64, rb: usize, d: usize, vocab: usize, vt: usize, logits: u64, tp: u64, run_m: u64, run_s: u64, tgt: u64) -> Result<()> {
    for v0 in (0..vocab).step_by(vt) {
        let vn = vt.min(vocab - v0);
        let w = wp + (v0 * d * 2) as u64;
        be.gemm(gemm::GemmArgs { m: rb, n: vn, k: d, x: hrows, ldx: d, w, ldw: d, y: logits, ldy: vn, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
        let (vn32, v032, first) = (vn as i32, v0 as i32, (v0 == 0) as i32);
        launch!(be, "logprob_tile", rb, LP_THREADS, logits, vn32, v032, tp, run_m, run_s, tgt, first)?;
    }
    Ok(())
}

pub(super) fn logprobs(be: &CudaBackend, h: &CudaBuf, head: &CudaBuf, targets: &[u32], d: usize, vocab: usize) -> Result<Vec<f32>> {
    let _op = be.enter()?;
    let rows = targets.len();
    if rows == 0 {
        return Ok(Vec::new());
    }
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        bail!("logprobs: target {bad} outside the vocabulary of {vocab}");
    }
    h.need(rows * d, "logprobs", "h")?;
    let wp = be.weight_ptr(head, vocab * d, "logprobs", "the head")?;
    let (hp, _keep) = be.bf16_input(h, rows * d)?;
    let mut out = Vec::with_capacity(rows);
    for r0 in (0..rows).step_by(LOGPROB_MAX_ROWS) {
        let rb = LOGPROB_MAX_ROWS.min(rows - r0);
        let vt = vocab_tile(rb, vocab);
        let logits = be.scratch("lp_logits", rb * vt * 4)?;
        let state = be.scratch("lp_state", rb * 3 * 4)?;
        let (run_m, run_s, tgt) = (state, state + (rb * 4) as u64, state + (rb * 8) as u64);
        let tp = be.meta("targets", bytemuck::cast_slice(&targets[r0..r0 + rb]))?;
        let hrows = hp + (r0 * d * 2) as u64;
        lse_pass(be, hrows, wp, rb, d, vocab, vt, logits, tp, run_m, run_s, tgt)?;
        let st: Vec<f32> = be.dtoh(state, rb * 3)?;
        let (m, s, t) = (&st[..rb], &st[rb..2 * rb], &st[2 * rb..]);
        out.extend((0..rb).map(|i| (t[i] as f64 - m[i] as f64 - (s[i] as f64).ln()) as f32));
    }
    Ok(out)
}

pub(super) fn head_grad(be: &CudaBackend, h: &CudaBuf, head: &CudaBuf, targets: &[u32], d: usize, vocab: usize, g: &mut CudaBuf) -> Result<HeadOut> {
    let _op = be.enter()?;
    let rows = targets.len();
    if rows == 0 {
        return Ok(HeadOut::default());
    }
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
        bail!("head_grad: target id {t} is outside the vocabulary (size {vocab})");
    }
    h.need(rows * d, "head_grad", "h")?;
    let wp = be.weight_ptr(head, vocab * d, "head_grad", "the head")?;
    let (hp, _keep) = be.bf16_input(h, rows * d)?;
    g.set_output(rows * d, Dtype::F32, "head_grad")?;
    let gp = g.ptr();
    let mut out = HeadOut { logprobs: Vec::with_capacity(rows), entropy: Vec::with_capacity(rows) };
    for r0 in (0..rows).step_by(LOGPROB_MAX_ROWS) {
        let rb = LOGPROB_MAX_ROWS.min(rows - r0);
        let vt = vocab_tile(rb, vocab);
        let logits = be.scratch("lp_logits", rb * vt * 4)?;
        // probability rows padded to a multiple of 8 columns: 16-byte aligned GEMM operand rows
        let ldp = vt.next_multiple_of(8);
        let probs = be.scratch("head_probs", rb * ldp * 2)?;
        let state = be.scratch("head_state", rb * 4 * 4)?;
        let (run_m, run_s, tgt, ent) = (state, state + (rb * 4) as u64, state + (rb * 8) as u64, state + (rb * 12) as u64);
        let tp = be.meta("targets", bytemuck::cast_slice(&targets[r0..r0 + rb]))?;
        let hrows = hp + (r0 * d * 2) as u64;
        let grows = gp + (r0 * d * 4) as u64;
        // pass 1: running max / sum and the target logit
        lse_pass(be, hrows, wp, rb, d, vocab, vt, logits, tp, run_m, run_s, tgt)?;
        // pass 2: P = exp(l − lse) per tile, entropy, g += P·W_tile (W_tile stored [vn, d]: wt)
        for v0 in (0..vocab).step_by(vt) {
            let vn = vt.min(vocab - v0);
            let w = wp + (v0 * d * 2) as u64;
            be.gemm(gemm::GemmArgs { m: rb, n: vn, k: d, x: hrows, ldx: d, w, ldw: d, y: logits, ldy: vn, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
            let (vn32, ldp32, first) = (vn as i32, ldp as i32, (v0 == 0) as i32);
            launch!(be, "head_probs_tile", rb, LP_THREADS, logits, vn32, run_m, run_s, probs, ldp32, ent, first)?;
            let beta = if v0 == 0 { 0.0 } else { 1.0 };
            be.gemm(gemm::GemmArgs { m: rb, n: d, k: vn, x: probs, ldx: ldp, w, ldw: d, y: grows, ldy: d, y_bf16: false, alpha: 1.0, beta, xt: false, wt: true })?;
        }
        let d32 = d as i32;
        launch!(be, "head_grad_finish", rb, LP_THREADS, grows, wp, tp, d32)?;
        let st: Vec<f32> = be.dtoh(state, rb * 4)?;
        let (m, s, t, e) = (&st[..rb], &st[rb..2 * rb], &st[2 * rb..3 * rb], &st[3 * rb..]);
        out.logprobs.extend((0..rb).map(|i| (t[i] as f64 - m[i] as f64 - (s[i] as f64).ln()) as f32));
        out.entropy.extend_from_slice(e);
    }
    Ok(out)
}
