//! RoPE on the CPU (twin of kernels/rope.cu, launched by src/backend/cuda/rope.rs): HF's
//! rotate_half convention on the q and k parts of the fused qkv rows; the backward is the same
//! rotation by the opposite angle (`sign` = −1). Qwen3's per-head q/k RMSNorm runs fused with it
//! (`qk_norm_rope`): each head is normalized, scaled by its norm weight, then rotated; the
//! backward rotates back and applies the RMSNorm backward to the head's pre-norm values.
use super::norm::{inv_rms, rmsnorm_bwd_row};
use super::par::ROWS_PER_TASK;
use crate::backend::AttnGeom;
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

/// cos/sin of every row of a position list: row i is `[cos; half] ++ [sin; half]` of
/// `positions[i]` (`rope_cos_sin`'s values, so the same bits).
struct Angles {
    positions: Vec<u32>,
    inv_freq: Vec<f32>,
    cs: Vec<f32>,
}

impl Angles {
    /// Row `i`: (cos, sin).
    #[inline]
    fn row(&self, i: usize) -> (&[f32], &[f32]) {
        let half = self.inv_freq.len();
        self.cs[2 * half * i..2 * half * (i + 1)].split_at(half)
    }
}

thread_local! {
    static LAST: std::cell::RefCell<Option<std::sync::Arc<Angles>>> = const { std::cell::RefCell::new(None) };
}

/// The angles of `positions` for a head of `hd` (the first `hd/2` frequencies). A step asks for the same list once per layer, forward and
/// backward, so the last list's table is kept (per calling thread) and reused while the
/// positions and frequencies match: `sin`/`cos` per row and layer were ~half of a decode step's
/// RoPE time (8 rows: 256 `sincosf` per layer).
fn angles(positions: &[u32], inv_freq: &[f32], hd: usize) -> std::sync::Arc<Angles> {
    let inv_freq = &inv_freq[..hd / 2];
    if let Some(a) = LAST.with(|l| l.borrow().clone()) {
        if a.positions == positions && a.inv_freq == inv_freq {
            return a;
        }
    }
    let half = inv_freq.len();
    let mut cs = vec![0f32; 2 * half * positions.len()];
    if half > 0 {
        cs.par_chunks_mut(2 * half * ROWS_PER_TASK).zip(positions.par_chunks(ROWS_PER_TASK)).for_each(|(rows, pos)| {
            for (row, &p) in rows.chunks_exact_mut(2 * half).zip(pos) {
                let (c, s) = row.split_at_mut(half);
                rope_cos_sin(p, inv_freq, c, s);
            }
        });
    }
    let a = std::sync::Arc::new(Angles { positions: positions.to_vec(), inv_freq: inv_freq.to_vec(), cs });
    LAST.with(|l| *l.borrow_mut() = Some(a.clone()));
    a
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
    let ang = angles(positions, inv_freq, hd);
    qkv[..positions.len() * width].par_chunks_mut(width * ROWS_PER_TASK).enumerate().for_each(|(t, rows)| {
        for (i, row) in rows.chunks_exact_mut(width).enumerate() {
            let (cos, sin) = ang.row(t * ROWS_PER_TASK + i);
            for h in 0..n_heads + n_kv {
                rope_apply(&mut row[h * hd..(h + 1) * hd], cos, sin, sign);
            }
        }
    });
}

/// Qwen3: per-head RMSNorm of q (weight `qn`) and k (weight `kn`), then RoPE, in place.
pub fn qk_norm_rope(qkv: &mut [f32], qn: &[f32], kn: &[f32], eps: f32, positions: &[u32], inv_freq: &[f32], g: AttnGeom) {
    let (hd, nh, nkv, width) = (g.head_dim, g.n_heads, g.n_kv_heads, g.qkv_dim());
    let ang = angles(positions, inv_freq, hd);
    qkv[..positions.len() * width].par_chunks_mut(width * ROWS_PER_TASK).enumerate().for_each(|(t, rows)| {
        for (i, row) in rows.chunks_exact_mut(width).enumerate() {
            let (cos, sin) = ang.row(t * ROWS_PER_TASK + i);
            for h in 0..nh + nkv {
                let w = if h < nh { qn } else { kn };
                let v = &mut row[h * hd..(h + 1) * hd];
                let s = inv_rms(v, eps);
                for (x, &wi) in v.iter_mut().zip(w) {
                    *x = *x * s * wi;
                }
                rope_apply(v, cos, sin, 1.0);
            }
        }
    });
}

/// Backward of [`qk_norm_rope`]: `dqkv`'s q/k heads (gradient w.r.t. the output) become the
/// gradient w.r.t. `pre` (the input): inverse rotation, then the RMSNorm backward of each head.
pub fn qk_norm_rope_bwd(pre: &[f32], qn: &[f32], kn: &[f32], eps: f32, dqkv: &mut [f32], positions: &[u32], inv_freq: &[f32], g: AttnGeom) {
    let (hd, nh, nkv, width) = (g.head_dim, g.n_heads, g.n_kv_heads, g.qkv_dim());
    let n = positions.len();
    let ang = angles(positions, inv_freq, hd);
    dqkv[..n * width]
        .par_chunks_mut(width * ROWS_PER_TASK)
        .zip(pre[..n * width].par_chunks(width * ROWS_PER_TASK))
        .enumerate()
        .for_each(|(t, (drows, prows))| {
            let mut dy = vec![0f32; hd];
            for (i, (drow, prow)) in drows.chunks_exact_mut(width).zip(prows.chunks_exact(width)).enumerate() {
                let (cos, sin) = ang.row(t * ROWS_PER_TASK + i);
                for h in 0..nh + nkv {
                    let w = if h < nh { qn } else { kn };
                    let (d, x) = (&mut drow[h * hd..(h + 1) * hd], &prow[h * hd..(h + 1) * hd]);
                    dy.copy_from_slice(d);
                    rope_apply(&mut dy, cos, sin, -1.0);
                    rmsnorm_bwd_row(x, w, &dy, inv_rms(x, eps), d, false);
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept table never outlives its positions or frequencies: each call's rows are rotated
    /// by their own angles (checked against `rope_cos_sin` per row) when the list changes in
    /// values only, in length, or the frequencies change; and more rows than one task holds.
    #[test]
    fn kept_angles_follow_the_positions() {
        let (nh, nkv, hd) = (2, 1, 8);
        let width = (nh + 2 * nkv) * hd;
        let inv: Vec<f32> = (0..hd / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / hd as f32)).collect();
        let inv2: Vec<f32> = inv.iter().map(|f| f * 0.25).collect();
        let want = |x: &[f32], pos: &[u32], inv: &[f32]| -> Vec<f32> {
            let mut y = x.to_vec();
            let (mut c, mut s) = (vec![0.0; hd / 2], vec![0.0; hd / 2]);
            for (row, &p) in y.chunks_exact_mut(width).zip(pos) {
                rope_cos_sin(p, inv, &mut c, &mut s);
                for h in 0..nh + nkv {
                    rope_apply(&mut row[h * hd..(h + 1) * hd], &c, &s, 1.0);
                }
            }
            y
        };
        let long: Vec<u32> = (0..150).map(|i| (i * 37 % 500) as u32).collect();
        for (pos, f) in [(vec![5u32, 9, 100], &inv), (vec![6, 9, 100], &inv), (vec![6, 9, 100], &inv2), (vec![6, 9], &inv2), (long, &inv), (vec![6, 9, 100], &inv)] {
            let x: Vec<f32> = (0..pos.len() * width).map(|i| (i as f32 * 0.61).sin()).collect();
            let mut y = x.clone();
            rope_qkv(&mut y, &pos, f, nh, nkv, hd, 1.0);
            assert!(y.iter().zip(want(&x, &pos, f)).all(|(a, b)| a.to_bits() == b.to_bits()), "positions {:?}", &pos[..pos.len().min(4)]);
        }
    }

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

    /// The backward against central finite differences of the forward (f64 on a tiny head).
    #[test]
    fn qk_norm_rope_backward_matches_finite_differences() {
        let g = AttnGeom { n_layers: 1, n_heads: 2, n_kv_heads: 1, head_dim: 8, page_size: 16 };
        let w = g.qkv_dim();
        let rows = 3;
        let inv: Vec<f32> = (0..4).map(|i| 1.0 / 100f32.powf(2.0 * i as f32 / 8.0)).collect();
        let pos = [0u32, 5, 77];
        let pre: Vec<f32> = (0..rows * w).map(|i| ((i as f32) * 0.73).sin() * 1.5).collect();
        let qn: Vec<f32> = (0..8).map(|i| 0.5 + 0.1 * i as f32).collect();
        let kn: Vec<f32> = (0..8).map(|i| 1.5 - 0.07 * i as f32).collect();
        let up: Vec<f32> = (0..rows * w).map(|i| ((i as f32) * 0.31).cos()).collect();
        // loss = Σ up · f(pre)
        let loss = |x: &[f32]| -> f64 {
            let mut y = x.to_vec();
            qk_norm_rope(&mut y, &qn, &kn, 1e-6, &pos, &inv, g);
            y.iter().zip(&up).map(|(a, b)| *a as f64 * *b as f64).sum()
        };
        let mut d = up.clone();
        qk_norm_rope_bwd(&pre, &qn, &kn, 1e-6, &mut d, &pos, &inv, g);
        for i in 0..rows * w {
            let col = i % w;
            if col >= g.q_dim() + g.kv_dim() {
                assert_eq!(d[i], up[i], "v passes through");
                continue;
            }
            let h = 1e-2f32;
            let (mut a, mut b) = (pre.clone(), pre.clone());
            a[i] += h;
            b[i] -= h;
            let fd = (loss(&a) - loss(&b)) / (2.0 * h as f64);
            assert!((d[i] as f64 - fd).abs() < 2e-3 * (1.0 + fd.abs()), "element {i}: {} vs fd {fd}", d[i]);
        }
    }
}
