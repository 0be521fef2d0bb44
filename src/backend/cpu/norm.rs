//! RMSNorm family on the CPU (twin of kernels/norm.cu, launched by src/backend/cuda/norm.rs):
//! the norm, the residual add fused with the next norm, the plain residual add, and the norm's
//! backward with respect to its input (the weight is frozen).
use super::simd::{self, simd_kernel};
use super::par::ROWS_PER_TASK;
use rayon::prelude::*;

/// 1/rms of a row, accumulated in f32 like transformers' `hidden.pow(2).mean(-1)`.
#[inline]
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss = simd::dot(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, rows: usize, d: usize, out: &mut [f32]) {
    out[..rows * d]
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(x[..rows * d].par_chunks(d * ROWS_PER_TASK))
        .for_each(|(o, x)| {
            for (orow, xrow) in o.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                let s = inv_rms(xrow, eps);
                for ((o, &v), &g) in orow.iter_mut().zip(xrow).zip(w) {
                    *o = v * s * g;
                }
            }
        });
}

pub fn add_rmsnorm(resid: &mut [f32], delta: &[f32], w: &[f32], eps: f32, rows: usize, d: usize, out: &mut [f32]) {
    out[..rows * d]
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(resid[..rows * d].par_chunks_mut(d * ROWS_PER_TASK))
        .zip(delta[..rows * d].par_chunks(d * ROWS_PER_TASK))
        .for_each(|((o, r), dl)| {
            for ((orow, rrow), drow) in o.chunks_exact_mut(d).zip(r.chunks_exact_mut(d)).zip(dl.chunks_exact(d)) {
                for (a, b) in rrow.iter_mut().zip(drow) {
                    *a += b;
                }
                let s = inv_rms(rrow, eps);
                for ((o, &v), &g) in orow.iter_mut().zip(rrow.iter()).zip(w) {
                    *o = v * s * g;
                }
            }
        });
}

pub fn add(resid: &mut [f32], delta: &[f32]) {
    for (a, b) in resid.iter_mut().zip(delta) {
        *a += b;
    }
}

#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd(x: &[f32], w: &[f32], dy: &[f32], eps: f32, rows: usize, d: usize, dx: &mut [f32], accumulate: bool) {
    dx[..rows * d]
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(x[..rows * d].par_chunks(d * ROWS_PER_TASK))
        .zip(dy[..rows * d].par_chunks(d * ROWS_PER_TASK))
        .for_each(|((dxc, xc), dyc)| {
            for ((dxr, xr), dyr) in dxc.chunks_exact_mut(d).zip(xc.chunks_exact(d)).zip(dyc.chunks_exact(d)) {
                let s = inv_rms(xr, eps);
                rmsnorm_bwd_row(xr, w, dyr, s, dxr, accumulate);
            }
        });
}

simd_kernel! {
    /// One row of the RMSNorm backward: `dx (+)= s·w∘dy − x·s³·(Σ w∘dy∘x)/d`, `s = 1/rms(x)`.
    pub fn rmsnorm_bwd_row(x: &[f32], w: &[f32], dy: &[f32], s: f32, dx: &mut [f32], accumulate: bool) -> () {
        let mut acc = [0f32; 8];
        let n8 = x.len() & !7;
        for i in (0..n8).step_by(8) {
            for l in 0..8 {
                acc[l] += w[i + l] * dy[i + l] * x[i + l];
            }
        }
        let mut dotv: f32 = acc.iter().sum();
        for i in n8..x.len() {
            dotv += w[i] * dy[i] * x[i];
        }
        let c = dotv * s * s * s / x.len() as f32;
        if accumulate {
            for i in 0..x.len() {
                dx[i] += s * w[i] * dy[i] - c * x[i];
            }
        } else {
            for i in 0..x.len() {
                dx[i] = s * w[i] * dy[i] - c * x[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_add_norm_equals_two_steps() {
        let d = 8;
        let mut r1: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.5).collect();
        let mut r2 = r1.clone();
        let delta: Vec<f32> = (0..16).map(|i| (i as f32).cos()).collect();
        let w: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 * 0.01).collect();
        let (mut o1, mut o2) = (vec![0.0; 16], vec![0.0; 16]);
        add_rmsnorm(&mut r1, &delta, &w, 1e-5, 2, d, &mut o1);
        add(&mut r2, &delta);
        rmsnorm(&r2, &w, 1e-5, 2, d, &mut o2);
        assert_eq!(r1, r2);
        assert_eq!(o1, o2);
        // RMS of a normalized row (w = 1) is 1.
        let ones = vec![1.0; 8];
        rmsnorm(&r2, &ones, 0.0, 2, d, &mut o2);
        let ms: f32 = o2[..8].iter().map(|x| x * x).sum::<f32>() / 8.0;
        assert!((ms - 1.0).abs() < 1e-5);
    }
}
