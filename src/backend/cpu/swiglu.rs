//! SwiGLU on the CPU (twin of kernels/swiglu.cu, launched by src/backend/cuda/swiglu.rs):
//! `silu(gate)·up` from the fused gate_up rows, and its backward.
use super::simd;
use super::par::ROWS_PER_TASK;
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
/// from the backend's one exp, 16 lanes at a time with AVX-512, else 8 (the same bits).
fn swiglu_bwd_row(g: &[f32], u: &[f32], dact: &[f32], dg: &mut [f32], du: &mut [f32]) {
    let grad = |g: f32, u: f32, da: f32, sig: f32| (da * u * sig * (1.0 + g * (1.0 - sig)), da * g * sig);
    let n = g.len();
    let (u, dact, dg, du) = (&u[..n], &dact[..n], &mut dg[..n], &mut du[..n]);
    let mut n16 = 0;
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx512f() {
        // Safety: AVX-512F checked; the five slices have n elements.
        n16 = unsafe { x512::bwd(g.as_ptr(), u.as_ptr(), dact.as_ptr(), dg.as_mut_ptr(), du.as_mut_ptr(), n) };
    }
    let n8 = n16 + ((n - n16) & !7);
    for i in (n16..n8).step_by(8) {
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

/// `swiglu_bwd_row` on 16 lanes: the scalar formula's operations in its order (the same bits).
#[cfg(target_arch = "x86_64")]
mod x512 {
    use super::simd::avx512::exp_neg;
    use std::arch::x86_64::*;

    /// The whole vectors of `n`; returns how many were done.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn bwd(g: *const f32, u: *const f32, da: *const f32, dg: *mut f32, du: *mut f32, n: usize) -> usize {
        let n16 = n & !15;
        let one = _mm512_set1_ps(1.0);
        for i in (0..n16).step_by(16) {
            let (gv, uv, dv) = (_mm512_loadu_ps(g.add(i)), _mm512_loadu_ps(u.add(i)), _mm512_loadu_ps(da.add(i)));
            let sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_neg(gv)));
            // da·u·σ·(1 + g·(1 − σ)), da·g·σ
            let a = _mm512_mul_ps(_mm512_mul_ps(dv, uv), sig);
            let b = _mm512_add_ps(one, _mm512_mul_ps(gv, _mm512_sub_ps(one, sig)));
            _mm512_storeu_ps(dg.add(i), _mm512_mul_ps(a, b));
            _mm512_storeu_ps(du.add(i), _mm512_mul_ps(_mm512_mul_ps(dv, gv), sig));
        }
        n16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Forward and backward rows give the scalar formulas' bits on every path (16 lanes, 8, the
    /// tail), for ±0, large magnitudes, infinities and NaN among ordinary values.
    #[test]
    fn rows_match_the_scalar_formulas() {
        // the special values first (the 16-lane path), again at 16.. (the 8-lane path without
        // AVX-512) and at the end (the scalar tail)
        let special = [0.0, -0.0, 88.5, -88.5, 1e30, -1e30, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -2.5];
        let mut g: Vec<f32> = special.iter().chain(&[0.5; 6]).chain(&special).copied().collect();
        g.extend((0..700).map(|i| (i as f32 - 350.0) * 0.211));
        g.extend(special);
        let vals = |mul: usize, off: f32| (0..g.len()).map(|i| ((i * mul % 97) as f32 - 48.0) * off).collect::<Vec<f32>>();
        let (u, da) = (vals(31, 0.37), vals(53, 0.05));
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for n in [g.len(), 725, 700, 26, 15, 7] {
            let (mut dg, mut du, mut act) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            swiglu_bwd_row(&g[..n], &u[..n], &da[..n], &mut dg, &mut du);
            let mut gu = g[..n].to_vec();
            gu.extend_from_slice(&u[..n]);
            swiglu(&gu, 1, n, &mut act);
            for i in 0..n {
                let sig = 1.0 / (1.0 + simd::exp(-g[i]));
                let (wg, wu) = (da[i] * u[i] * sig * (1.0 + g[i] * (1.0 - sig)), da[i] * g[i] * sig);
                assert!(same(dg[i], wg) && same(du[i], wu), "bwd at g {} (n {n}): ({}, {}) vs ({wg}, {wu})", g[i], dg[i], du[i]);
                assert!(same(act[i], silu(g[i]) * u[i]), "fwd at g {} (n {n}): {} vs {}", g[i], act[i], silu(g[i]) * u[i]);
            }
        }
    }
}
