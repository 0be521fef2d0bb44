//! Dense causal GQA attention for training on the CPU (twin of kernels/attention_dense.cu,
//! launched by src/backend/cuda/attention_dense.rs): a dense batch of concatenated sequences,
//! straight from the fused `qkv` rows (strided GEMMs, no gather), in tiles of `BQ` query rows ×
//! the visible keys, so only a `[BQ, ctx]` score tile exists at a time. The forward keeps each
//! row's log-sum-exp; the backward recomputes `P = exp(S − lse)` from it (flash-attention style).
use super::attention::paged::{stack_group, unstack_group};
use super::attention::tiled;
use super::matmul::gemm_raw;
use super::memory::transpose;
use super::par::{prefetch_l2, SendPtr};
use super::simd::{dot, exp_scaled_sub, exp_sub_sum, simd_kernel};
use crate::backend::{AttnGeom, DenseSeq};
use rayon::prelude::*;

/// Query rows per attention tile.
const BQ: usize = 64;

/// One task per (sequence, kv head), longest sequences first (the last tasks are the short ones).
fn kv_tasks(seqs: &[DenseSeq], nkv: usize) -> Vec<(usize, usize)> {
    let mut tasks: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|s| (0..nkv).map(move |h| (s, h))).collect();
    tasks.sort_by_key(|&(s, _)| std::cmp::Reverse(seqs[s].len));
    tasks
}

simd_kernel! {
    /// `ds = p · (dp − di)` in place in `dp`.
    pub fn softmax_grad_row(p: &[f32], dp: &mut [f32], di: f32) -> () {
        for (d, &pp) in dp.iter_mut().zip(p) {
            *d = pp * (*d - di);
        }
    }
}

/// `bf16`: `--dtype bf16`, whose attention runs on bf16 operands where the CPU has AMX or
/// AVX512_BF16 (`attention::tiled`; Q, K, V and the softmax numerators rounded to bf16, as on CUDA).
pub fn attn_dense(qkv: &[f32], seqs: &[DenseSeq], g: AttnGeom, out: &mut [f32], lse: &mut [f32], bf16: bool) {
    if bf16 && tiled::usable(g.head_dim) {
        return attn_dense_bf16(qkv, seqs, g, out, lse);
    }
    let (hd, nh, nkv) = (g.head_dim, g.n_heads, g.n_kv_heads);
    let group = nh / nkv;
    let (width, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    let outp = SendPtr(out.as_mut_ptr());
    let lsep = SendPtr(lse.as_mut_ptr());
    // One task per (sequence, kv head), longest first. The group's query heads share K and V, so
    // their rows are stacked into one product of `group·bq` rows per block (as in prefill).
    let tasks = kv_tasks(seqs, nkv);
    tasks.par_iter().for_each(|&(si, kvh)| {
        let s = seqs[si];
        let n = s.len;
        let cap = BQ.min(n) * group;
        let mut scores = vec![0f32; cap * n];
        let (mut qg, mut og) = (vec![0f32; cap * hd], vec![0f32; cap * hd]);
        // Kᵀ [hd, n]: the score product then reads its B operand row-major
        let mut kt = vec![0f32; hd * n];
        // Safety: pointers stay inside qkv/out/lse; this task writes only its rows × its group's heads.
        unsafe {
            let kptr = qkv.as_ptr().add(s.row0 * width + q_dim + kvh * hd);
            let vptr = kptr.add(kv_dim);
            transpose(kptr, width, n, hd, kt.as_mut_ptr(), n);
            let mut r0 = 0;
            while r0 < n {
                let bq = BQ.min(n - r0);
                let kmax = r0 + bq;
                let m = group * bq;
                stack_group(qkv, width, s.row0 + r0, kvh * group * hd, bq, group, hd, &mut qg);
                // S[m, kmax] = scale · Qg Kᵀ
                gemm_raw(m, kmax, hd, scores.as_mut_ptr(), kmax as isize, 1, false, qg.as_ptr(), hd as isize, 1, kt.as_ptr(), n as isize, 1, scale, false);
                for i in 0..m {
                    let (h, r) = (i / bq, i % bq);
                    let vis = r0 + r + 1;
                    let row = &mut scores[i * kmax..(i + 1) * kmax];
                    let mx = row[..vis].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let sum = exp_sub_sum(&mut row[..vis], mx);
                    let inv = 1.0 / sum;
                    row[..vis].iter_mut().for_each(|p| *p *= inv);
                    row[vis..].fill(0.0);
                    *lsep.get().add((s.row0 + r0 + r) * nh + kvh * group + h) = mx + sum.ln();
                }
                // Og[m, hd] = P V
                gemm_raw(m, hd, kmax, og.as_mut_ptr(), hd as isize, 1, false, scores.as_ptr(), kmax as isize, 1, vptr, width as isize, 1, 1.0, false);
                unstack_group(&og, bq, group, hd, outp.get(), q_dim, s.row0 + r0, kvh * group * hd);
                r0 += bq;
            }
        }
    });
}

/// `attn_dense` on bf16 operands: per (sequence, kv head) K and V packed once, then blocks of `BQ`
/// query rows of all the group's heads (`attention::tiled::forward`).
fn attn_dense_bf16(qkv: &[f32], seqs: &[DenseSeq], g: AttnGeom, out: &mut [f32], lse: &mut [f32]) {
    let (hd, nh, nkv) = (g.head_dim, g.n_heads, g.n_kv_heads);
    let group = nh / nkv;
    let (width, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    let outp = SendPtr(out.as_mut_ptr());
    let lsep = SendPtr(lse.as_mut_ptr());
    let tasks = kv_tasks(seqs, nkv);
    tasks.par_iter().for_each(|&(si, kvh)| {
        let s = seqs[si];
        let n = s.len;
        tiled::with_scratch(|kt, vp, sc| {
            let pr = tiled::Products::new();
            let kcol = q_dim + kvh * hd;
            tiled::pack_panels_rows(kt, n, hd, |j| &qkv[(s.row0 + j) * width + kcol..][..hd]);
            let vs = tiled::pack_panels_cols(vp, n, hd, |j| {
                &qkv[(s.row0 + j) * width + kcol + kv_dim..][..hd]
            });
            // Safety (both writers): rows of this sequence, heads of this kv group: this task's only
            let out_at = |row: usize, h: usize, o: &[f32]| unsafe { std::ptr::copy_nonoverlapping(o.as_ptr(), outp.get().add(row * q_dim + h * hd), hd) };
            let lse_at = |row: usize, h: usize, v: f32| unsafe { *lsep.get().add(row * nh + h) = v };
            tiled::forward_rows(&pr, kt, vp, vs, hd, (qkv, width), (s.row0, n, 0), (kvh * group, group, BQ), scale, sc, out_at, lse_at);
        });
    });
}

/// `bf16`: as in `attn_dense` (`attention::tiled::backward`).
#[allow(clippy::too_many_arguments)]
pub fn attn_dense_bwd(qkv: &[f32], out: &[f32], dout: &[f32], lse: &[f32], seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut [f32], bf16: bool) {
    if bf16 && tiled::usable(g.head_dim) {
        return attn_dense_bwd_bf16(qkv, out, dout, lse, seqs, g, dqkv);
    }
    let (hd, nh, nkv) = (g.head_dim, g.n_heads, g.n_kv_heads);
    let group = nh / nkv;
    let (width, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    let dp = SendPtr(dqkv.as_mut_ptr());
    // One task per (sequence, kv head): it owns the dk/dv columns of that head and the dq columns
    // of the group's query heads, so the GQA sum over the group needs no synchronisation.
    let tasks = kv_tasks(seqs, nkv);
    tasks.par_iter().for_each(|&(si, kvh)| {
        let s = seqs[si];
        let n = s.len;
        let mut pbuf = vec![0f32; BQ.min(n) * n];
        let mut dsbuf = vec![0f32; BQ.min(n) * n];
        // Kᵀ, Vᵀ [hd, n] and the accumulators dKᵀ, dVᵀ: with the key index contiguous, every
        // product below reads its B operand row-major (cheap panel copies) and the dK/dV
        // products take the small Qᵀ/dOᵀ as their strided A, not the large dSᵀ/Pᵀ.
        let (mut kt, mut vt) = (vec![0f32; hd * n], vec![0f32; hd * n]);
        let (mut dkt, mut dvt) = (vec![0f32; hd * n], vec![0f32; hd * n]);
        // Safety: every write below goes to rows of this sequence, in columns owned by this task.
        unsafe {
            let kptr = qkv.as_ptr().add(s.row0 * width + q_dim + kvh * hd);
            let vptr = kptr.add(kv_dim);
            transpose(kptr, width, n, hd, kt.as_mut_ptr(), n);
            transpose(vptr, width, n, hd, vt.as_mut_ptr(), n);
            for qh in kvh * group..(kvh + 1) * group {
                let mut r0 = 0;
                while r0 < n {
                    let bq = BQ.min(n - r0);
                    let kmax = r0 + bq;
                    let p = &mut pbuf[..bq * kmax];
                    let ds = &mut dsbuf[..bq * kmax];
                    let row_a = s.row0 + r0;
                    let qptr = qkv.as_ptr().add(row_a * width + qh * hd);
                    let doptr = dout.as_ptr().add(row_a * q_dim + qh * hd);
                    // S = Q Kᵀ (unscaled; the scale goes into the exponent)
                    gemm_raw(bq, kmax, hd, p.as_mut_ptr(), kmax as isize, 1, false, qptr, width as isize, 1, kt.as_ptr(), n as isize, 1, 1.0, false);
                    // dP = dO Vᵀ
                    gemm_raw(bq, kmax, hd, ds.as_mut_ptr(), kmax as isize, 1, false, doptr, q_dim as isize, 1, vt.as_ptr(), n as isize, 1, 1.0, false);
                    for r in 0..bq {
                        let vis = r0 + r + 1;
                        let row = row_a + r;
                        let prow = &mut p[r * kmax..(r + 1) * kmax];
                        exp_scaled_sub(&mut prow[..vis], scale, lse[row * nh + qh]);
                        prow[vis..].fill(0.0);
                        let o = &out[row * q_dim + qh * hd..row * q_dim + (qh + 1) * hd];
                        let dor = &dout[row * q_dim + qh * hd..row * q_dim + (qh + 1) * hd];
                        let di = dot(dor, o);
                        let dsrow = &mut ds[r * kmax..(r + 1) * kmax];
                        softmax_grad_row(&prow[..vis], &mut dsrow[..vis], di);
                        dsrow[vis..].fill(0.0);
                    }
                    // dQ = scale · dS K
                    let dqptr = dp.get().add(row_a * width + qh * hd);
                    gemm_raw(bq, hd, kmax, dqptr, width as isize, 1, false, ds.as_ptr(), kmax as isize, 1, kptr, width as isize, 1, scale, false);
                    // dKᵀ[:, ..kmax] += scale · Qᵀ dS
                    gemm_raw(hd, kmax, bq, dkt.as_mut_ptr(), n as isize, 1, true, qptr, 1, width as isize, ds.as_ptr(), kmax as isize, 1, scale, false);
                    // dVᵀ[:, ..kmax] += dOᵀ P
                    gemm_raw(hd, kmax, bq, dvt.as_mut_ptr(), n as isize, 1, true, doptr, 1, q_dim as isize, p.as_ptr(), kmax as isize, 1, 1.0, false);
                    r0 += bq;
                }
            }
            let dkptr = dp.get().add(s.row0 * width + q_dim + kvh * hd);
            let dvptr = dkptr.add(kv_dim);
            transpose(dkt.as_ptr(), n, hd, n, dkptr, width);
            transpose(dvt.as_ptr(), n, hd, n, dvptr, width);
        }
    });
}

/// `attn_dense_bwd` on bf16 operands: per (sequence, kv head) K and V packed once, then blocks of `BQ`
/// query rows of all the group's heads (`attention::tiled::backward`); dK and dV accumulate over the
/// blocks in f32 and are written once at the end.
fn attn_dense_bwd_bf16(qkv: &[f32], out: &[f32], dout: &[f32], lse: &[f32], seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut [f32]) {
    let (hd, nh, nkv) = (g.head_dim, g.n_heads, g.n_kv_heads);
    let group = nh / nkv;
    let (width, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    let dp = SendPtr(dqkv.as_mut_ptr());
    let tasks = kv_tasks(seqs, nkv);
    tasks.par_iter().for_each(|&(si, kvh)| {
        let s = seqs[si];
        let n = s.len;
        let kcol = q_dim + kvh * hd;
        let krow = |j: usize| &qkv[(s.row0 + j) * width + kcol..][..hd];
        let vrow = |j: usize| &qkv[(s.row0 + j) * width + kcol + kv_dim..][..hd];
        tiled::with_bwd_scratch(|sc| {
            let pr = tiled::Products::new();
            tiled::pack_panels_rows(&mut sc.kt, n, hd, krow);
            tiled::pack_panels_rows(&mut sc.vt, n, hd, vrow);
            let ks = tiled::pack_panels_cols(&mut sc.kc, n, hd, krow);
            let ld = n.next_multiple_of(tiled::T);
            // no zeroing: each block's products store the columns no block has reached yet
            sc.dkt.resize(hd * ld, 0.0);
            sc.dvt.resize(hd * ld, 0.0);
            sc.seen = 0;
            let mut r0 = 0;
            while r0 < n {
                let bq = BQ.min(n - r0);
                // the group's query heads stacked head-major: i = h·bq + r
                let at = |i: usize| (s.row0 + r0 + i % bq, kvh * group + i / bq);
                let q = |i: usize| {
                    let (row, h) = at(i);
                    &qkv[row * width + h * hd..][..hd]
                };
                let d_o = |i: usize| {
                    let (row, h) = at(i);
                    &dout[row * q_dim + h * hd..][..hd]
                };
                let o = |i: usize| {
                    let (row, h) = at(i);
                    &out[row * q_dim + h * hd..][..hd]
                };
                let l = |i: usize| {
                    let (row, h) = at(i);
                    lse[row * nh + h]
                };
                let dq = |i: usize, v: &[f32]| {
                    let (row, h) = at(i);
                    // Safety: rows of this sequence, the query columns of this kv group's heads:
                    // written by this task only
                    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), dp.get().add(row * width + h * hd), hd) };
                };
                // the next block's rows of Q, dO, O and dQ (strided, so beyond the hardware
                // prefetchers) come from memory while this block computes
                let c = kvh * group * hd;
                for r in s.row0 + r0 + bq..s.row0 + (r0 + bq + BQ).min(n) {
                    prefetch_l2(qkv[r * width + c..].as_ptr(), group * hd);
                    prefetch_l2(dout[r * q_dim + c..].as_ptr(), group * hd);
                    prefetch_l2(out[r * q_dim + c..].as_ptr(), group * hd);
                    prefetch_l2(dp.get().wrapping_add(r * width + c), group * hd);
                }
                tiled::backward(&pr, sc, ks, hd, ld, group * bq, q, d_o, o, l, |i| r0 + i % bq + 1, scale, dq);
                r0 += bq;
            }
            // every key's column is written (the last block sees them all)
            assert!(sc.seen >= n, "attention backward: {} of {n} keys' gradients written", sc.seen);
            // dK = scale · Σ over the blocks of Qᵀ dS
            sc.dkt[..hd * ld].iter_mut().for_each(|x| *x *= scale);
            // Safety: this sequence's rows, this kv head's K and V columns: this task's only
            unsafe {
                let dk = dp.get().add(s.row0 * width + kcol);
                tiled::transpose_out(&sc.dkt, ld, hd, n, dk, width);
                tiled::transpose_out(&sc.dvt, ld, hd, n, dk.add(kv_dim), width);
            }
        });
    });
}
