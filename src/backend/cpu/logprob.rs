//! Teacher-forced log-probabilities without `[rows, vocab]` logits: the vocabulary is cut into
//! tiles; each tile's logits `[rows, tile]` are computed, folded into a per-row running
//! (max, Σexp) and the target's logit picked out, then dropped. Tiles run in parallel and their
//! partial log-sum-exps are merged at the end.
use super::matmul::matmul_serial;
use rayon::prelude::*;

const VOCAB_TILE: usize = 2048;
const ROW_BLOCK: usize = 256;

/// Per-row statistics of one vocabulary tile.
struct TileStats {
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// `logprob[r] = log softmax(h[r] · headᵀ)[targets[r]]`.
pub fn logprobs(h: &[f32], head: &[f32], targets: &[u32], d: usize, vocab: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(targets.len());
    for (hb, tb) in h.chunks(ROW_BLOCK * d).zip(targets.chunks(ROW_BLOCK)) {
        out.extend(block(hb, head, tb, d, vocab));
    }
    out
}

fn block(h: &[f32], head: &[f32], targets: &[u32], d: usize, vocab: usize) -> Vec<f32> {
    let rows = targets.len();
    let n_tiles = vocab.div_ceil(VOCAB_TILE);
    let parts: Vec<(TileStats, Vec<(usize, f32)>)> = (0..n_tiles)
        .into_par_iter()
        .map(|t| {
            let v0 = t * VOCAB_TILE;
            let vn = VOCAB_TILE.min(vocab - v0);
            let mut logits = vec![0f32; rows * vn];
            matmul_serial(h, &head[v0 * d..(v0 + vn) * d], rows, d, vn, &mut logits);
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
        let lp = logprobs(&h, &w, &targets, d, vocab);
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
