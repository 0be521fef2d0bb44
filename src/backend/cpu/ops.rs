//! Element-wise and row-wise ops of the transformer on the CPU, as plain functions over f32
//! slices (the CPU twins of the CUDA kernels; the backward passes live in `runtime::backward`).
use rayon::prelude::*;

/// Rows per rayon task for cheap row-wise ops (keeps task overhead well below the work).
const ROWS_PER_TASK: usize = 64;

pub fn embed(table: &[f32], ids: &[u32], d: usize, out: &mut [f32]) {
    for (row, &id) in out.chunks_exact_mut(d).zip(ids) {
        let id = id as usize;
        row.copy_from_slice(&table[id * d..(id + 1) * d]);
    }
}

pub fn gather_rows(x: &[f32], rows: &[u32], d: usize, out: &mut [f32]) {
    for (o, &r) in out.chunks_exact_mut(d).zip(rows) {
        let r = r as usize;
        o.copy_from_slice(&x[r * d..(r + 1) * d]);
    }
}

/// `dst[c·dst_rs + r] = src[r·src_rs + c]` for `rows × cols`: the attention kernels keep Kᵀ
/// (and dKᵀ, dVᵀ) with the key index contiguous, so their GEMMs read B row-major.
///
/// # Safety
/// Both strided extents must be valid and must not overlap.
pub unsafe fn transpose(src: *const f32, src_rs: usize, rows: usize, cols: usize, dst: *mut f32, dst_rs: usize) {
    for r in 0..rows {
        for c in 0..cols {
            *dst.add(c * dst_rs + r) = *src.add(r * src_rs + c);
        }
    }
}

/// 1/rms of a row, accumulated in f32 like transformers' `hidden.pow(2).mean(-1)`.
#[inline]
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss = super::simd::dot(x, x);
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

/// cos/sin of `pos · inv_freq` in f32, as transformers computes them.
#[inline]
pub fn rope_cos_sin(pos: u32, inv_freq: &[f32], cos: &mut [f32], sin: &mut [f32]) {
    for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
        let a = pos as f32 * f;
        *c = a.cos();
        *s = a.sin();
    }
}

/// Rotate one head vector (rotate_half convention: pairs (i, i + hd/2)). `sign` = -1 applies the
/// inverse rotation (used by the backward pass).
#[inline]
pub fn rope_apply(v: &mut [f32], cos: &[f32], sin: &[f32], sign: f32) {
    let half = v.len() / 2;
    let (a, b) = v.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        let s = sign * sin[i];
        a[i] = x1 * cos[i] - x2 * s;
        b[i] = x2 * cos[i] + x1 * s;
    }
}

/// RoPE on the q and k parts of fused qkv rows (`qkv_dim` wide), in place.
pub fn rope_qkv(qkv: &mut [f32], positions: &[u32], inv_freq: &[f32], n_heads: usize, n_kv: usize, hd: usize, sign: f32) {
    let width = (n_heads + 2 * n_kv) * hd;
    qkv[..positions.len() * width]
        .par_chunks_mut(width * ROWS_PER_TASK)
        .zip(positions.par_chunks(ROWS_PER_TASK))
        .for_each(|(rows, pos)| {
            let half = hd / 2;
            let mut cos = vec![0f32; half];
            let mut sin = vec![0f32; half];
            for (row, &p) in rows.chunks_exact_mut(width).zip(pos) {
                rope_cos_sin(p, inv_freq, &mut cos, &mut sin);
                for h in 0..n_heads + n_kv {
                    rope_apply(&mut row[h * hd..(h + 1) * hd], &cos, &sin, sign);
                }
            }
        });
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + super::simd::exp(-x))
}

pub fn swiglu(gate_up: &[f32], m: usize, i: usize, out: &mut [f32]) {
    out[..m * i]
        .par_chunks_mut(i * ROWS_PER_TASK)
        .zip(gate_up[..m * 2 * i].par_chunks(2 * i * ROWS_PER_TASK))
        .for_each(|(o, gu)| {
            for (orow, gurow) in o.chunks_exact_mut(i).zip(gu.chunks_exact(2 * i)) {
                let (g, u) = gurow.split_at(i);
                super::simd::silu_mul(g, u, orow);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_inverse_and_norm_preserving() {
        let inv: Vec<f32> = (0..8).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / 16.0)).collect();
        let mut v: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
        let orig = v.clone();
        let (mut c, mut s) = (vec![0.0; 8], vec![0.0; 8]);
        rope_cos_sin(123, &inv, &mut c, &mut s);
        rope_apply(&mut v, &c, &s, 1.0);
        let n0: f32 = orig.iter().map(|x| x * x).sum();
        let n1: f32 = v.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() < 1e-5);
        assert!(v.iter().zip(&orig).any(|(a, b)| (a - b).abs() > 1e-2));
        rope_apply(&mut v, &c, &s, -1.0);
        for (a, b) in v.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }

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
