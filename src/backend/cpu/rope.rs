//! RoPE on the CPU (twin of kernels/rope.cu, launched by src/backend/cuda/rope.rs): HF's
//! rotate_half convention on the q and k parts of the fused qkv rows; the backward is the same
//! rotation by the opposite angle (`sign` = −1).
use super::ROWS_PER_TASK;
use rayon::prelude::*;

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
}
