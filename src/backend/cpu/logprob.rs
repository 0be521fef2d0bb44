//! The LM head on the CPU without `[rows, vocab]` logits (twin of kernels/logprob.cu, launched by
//! src/backend/cuda/logprob.rs):
//! - `logprobs` (scoring): the vocabulary is cut into tiles; each tile's logits `[rows, tile]`
//!   are computed, folded into a per-row running (max, Σexp) and the target's logit picked out,
//!   then dropped. Tiles run in parallel and their partial log-sum-exps are merged at the end.
//! - `head_grad` (training): the vocabulary in tiles with an online softmax that also carries
//!   `Σ_v exp(l_v − m)·head_v` (rescaled when the running max moves), so `E_p[head]`, the
//!   log-probability and the entropy come out of one pass of two GEMMs per tile.
use super::buf::PackedWeight;
use super::bf16::{matmul_bf16_with, matmul_dx_bf16_with, Kernel};
use super::matmul::{gemm_raw, matmul_serial};
use super::simd::exp_sub_sum_dot;
use crate::backend::HeadOut;
use rayon::prelude::*;

const VOCAB_TILE: usize = 2048;
const ROW_BLOCK: usize = 256;
/// Vocabulary entries per tile of the head backward.
const GRAD_VOCAB_TILE: usize = 1024;
/// At most this many rows per head-backward task.
const GRAD_ROWS: usize = 256;

/// The head's rows: f32 `[vocab, d]`, or bf16 tiles (`--dtype bf16`). Every method runs on the
/// calling thread (the passes below parallelize over tiles or rows).
pub trait HeadRows: Sync {
    /// `out[rows, vn] = h[rows, d] · head[v0 .. v0 + vn]ᵀ`.
    fn logits(&self, h: &[f32], rows: usize, d: usize, v0: usize, vn: usize, out: &mut [f32]);
    /// The same product for `head_grad` (the f32 head uses the GEMM kernel directly there).
    fn logits_grad(&self, h: &[f32], rows: usize, d: usize, v0: usize, vn: usize, out: &mut [f32]) {
        self.logits(h, rows, d, v0, vn, out)
    }
    /// `acc[rows, d] += p[rows, vn] · head[v0 .. v0 + vn]`.
    fn acc(&self, p: &[f32], rows: usize, d: usize, v0: usize, vn: usize, acc: &mut [f32]);
    /// Row `t` of the head.
    fn row(&self, t: usize, d: usize, out: &mut [f32]);
}

impl HeadRows for [f32] {
    fn logits(&self, h: &[f32], rows: usize, d: usize, v0: usize, vn: usize, out: &mut [f32]) {
        matmul_serial(h, &self[v0 * d..(v0 + vn) * d], rows, d, vn, out);
    }
    fn logits_grad(&self, h: &[f32], rows: usize, d: usize, v0: usize, vn: usize, out: &mut [f32]) {
        let wt = &self[v0 * d..(v0 + vn) * d];
        // Safety: extents are rows×d, vn×d and rows×vn.
        unsafe {
            gemm_raw(rows, vn, d, out.as_mut_ptr(), vn as isize, 1, false, h.as_ptr(), d as isize, 1, wt.as_ptr(), 1, d as isize, 1.0, false);
        }
    }
    fn acc(&self, p: &[f32], rows: usize, d: usize, v0: usize, vn: usize, acc: &mut [f32]) {
        let wt = &self[v0 * d..(v0 + vn) * d];
        // Safety: extents are rows×vn, vn×d and rows×d.
        unsafe {
            gemm_raw(rows, d, vn, acc.as_mut_ptr(), d as isize, 1, true, p.as_ptr(), vn as isize, 1, wt.as_ptr(), d as isize, 1, 1.0, false);
        }
    }
    fn row(&self, t: usize, d: usize, out: &mut [f32]) {
        out[..d].copy_from_slice(&self[t * d..(t + 1) * d]);
    }
}

impl HeadRows for PackedWeight {
    fn logits(&self, h: &[f32], rows: usize, d: usize, v0: usize, vn: usize, out: &mut [f32]) {
        if let Some(t) = self.tile(v0, vn) {
            matmul_bf16_with(h, t, None, rows, d, vn, out, Kernel::Auto, false);
            return;
        }
        // the range spans several stored tiles: each into its columns of `out`
        for (r0, t) in self.tiles.iter().filter(|(r0, t)| *r0 < v0 + vn && r0 + t.n() > v0) {
            assert!(*r0 >= v0 && r0 + t.n() <= v0 + vn, "head tile {r0}+{} straddles the pass's tile {v0}+{vn}", t.n());
            let tn = t.n();
            let mut y = vec![0f32; rows * tn];
            matmul_bf16_with(h, t, None, rows, d, tn, &mut y, Kernel::Auto, false);
            for r in 0..rows {
                out[r * vn + r0 - v0..r * vn + r0 - v0 + tn].copy_from_slice(&y[r * tn..(r + 1) * tn]);
            }
        }
    }
    fn acc(&self, p: &[f32], rows: usize, d: usize, v0: usize, vn: usize, acc: &mut [f32]) {
        let t = self.tile(v0, vn).expect("the head-gradient tile is a stored bf16 tile (buf::TILE_ROWS)");
        matmul_dx_bf16_with(p, t, rows, vn, d, acc, true, Kernel::Auto, false);
    }
    fn row(&self, t: usize, _d: usize, out: &mut [f32]) {
        PackedWeight::row(self, t, out);
    }
}

/// Per-row statistics of one vocabulary tile.
struct TileStats {
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// `logprob[r] = log softmax(h[r] · headᵀ)[targets[r]]`.
pub fn logprobs<H: HeadRows + ?Sized>(h: &[f32], head: &H, targets: &[u32], d: usize, vocab: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(targets.len());
    for (hb, tb) in h.chunks(ROW_BLOCK * d).zip(targets.chunks(ROW_BLOCK)) {
        out.extend(block(hb, head, tb, d, vocab));
    }
    out
}

fn block<H: HeadRows + ?Sized>(h: &[f32], head: &H, targets: &[u32], d: usize, vocab: usize) -> Vec<f32> {
    let rows = targets.len();
    let n_tiles = vocab.div_ceil(VOCAB_TILE);
    let parts: Vec<(TileStats, Vec<(usize, f32)>)> = (0..n_tiles)
        .into_par_iter()
        .map(|t| {
            let v0 = t * VOCAB_TILE;
            let vn = VOCAB_TILE.min(vocab - v0);
            let mut logits = vec![0f32; rows * vn];
            head.logits(h, rows, d, v0, vn, &mut logits);
            let mut st = TileStats { max: vec![0.0; rows], sum: vec![0.0; rows] };
            let mut picked = Vec::new();
            for r in 0..rows {
                let row = &logits[r * vn..(r + 1) * vn];
                let m = super::simd::max(row);
                st.max[r] = m;
                st.sum[r] = super::simd::sum_exp_sub(row, m);
                let tgt = targets[r] as usize;
                if (v0..v0 + vn).contains(&tgt) {
                    picked.push((r, row[tgt - v0]));
                }
            }
            (st, picked)
        })
        .collect();
    let mut target_logit = vec![f32::NAN; rows];
    for (_, picked) in &parts {
        for &(r, l) in picked {
            target_logit[r] = l;
        }
    }
    (0..rows)
        .map(|r| {
            let m = parts.iter().map(|p| p.0.max[r]).fold(f32::NEG_INFINITY, f32::max);
            let s: f64 = parts.iter().map(|p| p.0.sum[r] as f64 * ((p.0.max[r] - m) as f64).exp()).sum();
            target_logit[r] - m - s.ln() as f32
        })
        .collect()
}

/// See `TrainBackend::head_grad`.
pub fn head_grad<H: HeadRows + ?Sized>(h: &[f32], head: &H, targets: &[u32], d: usize, vocab: usize, g: &mut [f32]) -> HeadOut {
    let rows = targets.len();
    let mut out = HeadOut { logprobs: vec![0.0; rows], entropy: vec![0.0; rows] };
    if rows == 0 {
        return out;
    }
    let per = rows.div_ceil(rayon::current_num_threads().max(1)).clamp(1, GRAD_ROWS);
    g[..rows * d]
        .par_chunks_mut(per * d)
        .zip(h[..rows * d].par_chunks(per * d))
        .zip(targets.par_chunks(per))
        .zip(out.logprobs.par_chunks_mut(per).zip(out.entropy.par_chunks_mut(per)))
        .for_each(|(((gb, hb), tb), (lpb, entb))| head_block(hb, head, tb, d, vocab, gb, lpb, entb));
    out
}

#[allow(clippy::too_many_arguments)]
fn head_block<H: HeadRows + ?Sized>(h: &[f32], head: &H, targets: &[u32], d: usize, vocab: usize, acc: &mut [f32], logp: &mut [f32], ent: &mut [f32]) {
    let rows = targets.len();
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut s = vec![0f32; rows];
    let mut el = vec![0f32; rows];
    let mut tl = vec![f32::NAN; rows];
    acc.fill(0.0);
    let mut logits = vec![0f32; rows * GRAD_VOCAB_TILE.min(vocab)];
    let mut v0 = 0;
    while v0 < vocab {
        let vn = GRAD_VOCAB_TILE.min(vocab - v0);
        let lg = &mut logits[..rows * vn];
        head.logits_grad(h, rows, d, v0, vn, lg);
        for r in 0..rows {
            let row = &mut lg[r * vn..(r + 1) * vn];
            let t = targets[r] as usize;
            if (v0..v0 + vn).contains(&t) {
                tl[r] = row[t - v0];
            }
            let tm = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if tm > m[r] {
                let alpha = (m[r] - tm).exp();
                s[r] *= alpha;
                el[r] *= alpha;
                acc[r * d..(r + 1) * d].iter_mut().for_each(|v| *v *= alpha);
                m[r] = tm;
            }
            let (ps, pl) = exp_sub_sum_dot(row, m[r]);
            s[r] += ps;
            el[r] += pl;
        }
        // acc += P · W_tile
        head.acc(lg, rows, d, v0, vn, acc);
        v0 += vn;
    }
    let mut wt = vec![0f32; d];
    for r in 0..rows {
        let lse = m[r] + s[r].ln();
        logp[r] = tl[r] - lse;
        ent[r] = lse - el[r] / s[r];
        let inv = 1.0 / s[r];
        head.row(targets[r] as usize, d, &mut wt);
        for (a, &w) in acc[r * d..(r + 1) * d].iter_mut().zip(&wt) {
            *a = *a * inv - w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn equals_dense_log_softmax() {
        let mut rng = crate::util::rng::Rng::new(5);
        let (rows, d, vocab) = (3, 16, 5000);
        let h: Vec<f32> = (0..rows * d).map(|_| rng.normal() as f32).collect();
        let w: Vec<f32> = (0..vocab * d).map(|_| rng.normal() as f32).collect();
        let targets = [0u32, 4999, 2048];
        let lp = logprobs(&h, w.as_slice(), &targets, d, vocab);
        for r in 0..rows {
            let logits: Vec<f64> = (0..vocab)
                .map(|v| (0..d).map(|k| h[r * d + k] as f64 * w[v * d + k] as f64).sum())
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + logits.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            let want = logits[targets[r] as usize] - lse;
            assert!((lp[r] as f64 - want).abs() < 1e-4, "{} vs {want}", lp[r]);
        }
    }
}
