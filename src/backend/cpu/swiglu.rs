//! SwiGLU on the CPU (twin of kernels/swiglu.cu, launched by src/backend/cuda/swiglu.rs):
//! `silu(gate)·up` from the fused gate_up rows, and its backward.
use super::simd;
use super::ROWS_PER_TASK;
use rayon::prelude::*;

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + simd::exp(-x))
}

pub fn swiglu(gate_up: &[f32], m: usize, i: usize, out: &mut [f32]) {
    out[..m * i]
        .par_chunks_mut(i * ROWS_PER_TASK)
        .zip(gate_up[..m * 2 * i].par_chunks(2 * i * ROWS_PER_TASK))
        .for_each(|(o, gu)| {
            for (orow, gurow) in o.chunks_exact_mut(i).zip(gu.chunks_exact(2 * i)) {
                let (g, u) = gurow.split_at(i);
                simd::silu_mul(g, u, orow);
            }
        });
}

pub fn swiglu_bwd(gate_up: &[f32], dact: &[f32], m: usize, i: usize, dgate_up: &mut [f32]) {
    dgate_up[..m * 2 * i]
        .par_chunks_mut(2 * i * ROWS_PER_TASK)
        .zip(gate_up[..m * 2 * i].par_chunks(2 * i * ROWS_PER_TASK))
        .zip(dact[..m * i].par_chunks(i * ROWS_PER_TASK))
        .for_each(|((dgu, gu), da)| {
            for ((dgur, gur), dar) in dgu.chunks_exact_mut(2 * i).zip(gu.chunks_exact(2 * i)).zip(da.chunks_exact(i)) {
                let (g, u) = gur.split_at(i);
                let (dg, du) = dgur.split_at_mut(i);
                swiglu_bwd_row(g, u, dar, dg, du);
            }
        });
}

/// SwiGLU backward of one row: `dg = dact·u·σ(g)(1 + g(1 − σ(g)))`, `du = dact·g·σ(g)`, with σ
/// from the backend's one exp, 8 lanes at a time.
fn swiglu_bwd_row(g: &[f32], u: &[f32], dact: &[f32], dg: &mut [f32], du: &mut [f32]) {
    let grad = |g: f32, u: f32, da: f32, sig: f32| (da * u * sig * (1.0 + g * (1.0 - sig)), da * g * sig);
    let n8 = g.len() & !7;
    for i in (0..n8).step_by(8) {
        let mut neg = [0f32; 8];
        for l in 0..8 {
            neg[l] = -g[i + l];
        }
        let e = simd::exp8(neg);
        for l in 0..8 {
            (dg[i + l], du[i + l]) = grad(g[i + l], u[i + l], dact[i + l], 1.0 / (1.0 + e[l]));
        }
    }
    for i in n8..g.len() {
        (dg[i], du[i]) = grad(g[i], u[i], dact[i], 1.0 / (1.0 + simd::exp(-g[i])));
    }
}
