//! CPU twins of the training ops (`TrainBackend`), as plain f32 functions over slices.
//!
//! - Attention (forward and backward) works on a dense batch of concatenated sequences, straight
//!   from the fused `qkv` rows (strided GEMMs, no gather): tiles of `BQ` query rows × the visible
//!   keys, so only a `[BQ, ctx]` score tile exists at a time. The forward keeps each row's
//!   log-sum-exp; the backward recomputes `P = exp(S − lse)` from it (flash-attention style).
//! - The head backward walks the vocabulary in tiles with an online softmax that also carries
//!   `Σ_v exp(l_v − m)·head_v` (rescaled when the running max moves), so `E_p[head]`, the
//!   log-probability and the entropy come out of one pass of two GEMMs per tile.
//! - Exponentials in the hot loops use a vectorizable polynomial (`exp_fast`, ~1 ulp), compiled
//!   for AVX2+FMA when the CPU has it.
use crate::backend::cpu::attention::{dot, stack_group, unstack_group};
use crate::backend::cpu::matmul::{gemm_raw, SendPtr};
use crate::backend::cpu::ops::{inv_rms, transpose};
use crate::backend::train::{AdamWStep, DenseSeq, HeadOut};
use crate::backend::AttnGeom;
use rayon::prelude::*;

/// Query rows per attention tile.
const BQ: usize = 64;
/// Vocabulary entries per head tile.
const VOCAB_TILE: usize = 1024;
/// At most this many rows per head task.
const HEAD_ROWS: usize = 256;
/// Rows per rayon task for row-wise ops.
const ROWS_PER_TASK: usize = 32;

// ---------------------------------------------------------------------------------------------
// Vectorizable exp

/// `e^x` for x in [-87, 88] (clamped outside), max relative error ~2e-7: Cody–Waite reduction
/// `x = n·ln2 + r`, Cephes' degree-6 polynomial for `e^r`, `2^n` assembled in the exponent bits.
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer kept in the low bits
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    let ni = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    er * f32::from_bits(((ni + 127) as u32) << 23)
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// Define a slice kernel whose body is compiled twice: for the baseline target and with
/// AVX2+FMA enabled (picked at run time), so the loops vectorize 8 wide where possible.
macro_rules! simd_kernel {
    ($(#[$m:meta])* pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) -> $ret {
                    body($($arg),*)
                }
                if has_avx2() {
                    // Safety: the CPU supports the enabled features.
                    return unsafe { wide($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

simd_kernel! {
    /// `x = exp(x − sub)`; returns `Σ x` (8 partial sums).
    pub fn exp_sub_sum(x: &mut [f32], sub: f32) -> f32 {
        let mut acc = [0f32; 8];
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            for l in 0..8 {
                c[l] = exp_fast(c[l] - sub);
                acc[l] += c[l];
            }
        }
        let mut s = 0f32;
        for v in chunks.into_remainder() {
            *v = exp_fast(*v - sub);
            s += *v;
        }
        s + acc.iter().sum::<f32>()
    }
}

simd_kernel! {
    /// `x = exp(x − sub)`; returns `(Σ x_new, Σ x_new·x_old)` (for the entropy).
    pub fn exp_sub_sum_dot(x: &mut [f32], sub: f32) -> (f32, f32) {
        let mut acc = [0f32; 8];
        let mut accl = [0f32; 8];
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            for l in 0..8 {
                let v = c[l];
                let e = exp_fast(v - sub);
                c[l] = e;
                acc[l] += e;
                accl[l] += e * v;
            }
        }
        let (mut s, mut sl) = (0f32, 0f32);
        for v in chunks.into_remainder() {
            let e = exp_fast(*v - sub);
            sl += e * *v;
            *v = e;
            s += e;
        }
        (s + acc.iter().sum::<f32>(), sl + accl.iter().sum::<f32>())
    }
}

simd_kernel! {
    /// `x = exp(x·scale − sub)` (probabilities of a score row from its log-sum-exp).
    pub fn exp_scaled_sub(x: &mut [f32], scale: f32, sub: f32) -> () {
        for v in x.iter_mut() {
            *v = exp_fast(*v * scale - sub);
        }
    }
}

simd_kernel! {
    /// `ds = p · (dp − di)` in place in `dp`.
    pub fn softmax_grad_row(p: &[f32], dp: &mut [f32], di: f32) -> () {
        for (d, &pp) in dp.iter_mut().zip(p) {
            *d = pp * (*d - di);
        }
    }
}

simd_kernel! {
    /// SwiGLU backward of one row: `dg = dact·u·σ(g)(1 + g(1 − σ(g)))`, `du = dact·g·σ(g)`.
    pub fn swiglu_bwd_row(g: &[f32], u: &[f32], dact: &[f32], dg: &mut [f32], du: &mut [f32]) -> () {
        for ((((&g, &u), &da), dg), du) in g.iter().zip(u).zip(dact).zip(dg.iter_mut()).zip(du.iter_mut()) {
            let sig = 1.0 / (1.0 + exp_fast(-g));
            *du = da * g * sig;
            *dg = da * u * sig * (1.0 + g * (1.0 - sig));
        }
    }
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

// ---------------------------------------------------------------------------------------------
// Attention

pub fn attn_dense(qkv: &[f32], seqs: &[DenseSeq], g: AttnGeom, out: &mut [f32], lse: &mut [f32]) {
    let (hd, nh, nkv) = (g.head_dim, g.n_heads, g.n_kv_heads);
    let group = nh / nkv;
    let (width, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    let outp = SendPtr(out.as_mut_ptr());
    let lsep = SendPtr(lse.as_mut_ptr());
    // One task per (sequence, kv head), longest first. The group's query heads share K and V, so
    // their rows are stacked into one product of `group·bq` rows per block (as in prefill).
    let mut tasks: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|s| (0..nkv).map(move |h| (s, h))).collect();
    tasks.sort_by_key(|&(s, _)| std::cmp::Reverse(seqs[s].len));
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

pub fn attn_dense_bwd(qkv: &[f32], out: &[f32], dout: &[f32], lse: &[f32], seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut [f32]) {
    let (hd, nh, nkv) = (g.head_dim, g.n_heads, g.n_kv_heads);
    let group = nh / nkv;
    let (width, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    let dp = SendPtr(dqkv.as_mut_ptr());
    // One task per (sequence, kv head): it owns the dk/dv columns of that head and the dq columns
    // of the group's query heads, so the GQA sum over the group needs no synchronisation.
    let mut tasks: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|s| (0..nkv).map(move |h| (s, h))).collect();
    tasks.sort_by_key(|&(s, _)| std::cmp::Reverse(seqs[s].len));
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

// ---------------------------------------------------------------------------------------------
// Row-wise ops

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

// ---------------------------------------------------------------------------------------------
// Projections

/// `w[row0 + o, :] += scale · (B A)[o, :]`.
#[allow(clippy::too_many_arguments)]
pub fn lora_merge(w: &mut [f32], row0: usize, a: &[f32], b: &[f32], scale: f32, k: usize, r: usize, n_out: usize) {
    // Safety: extents checked by the caller.
    unsafe {
        gemm_raw(n_out, k, r, w.as_mut_ptr().add(row0 * k), k as isize, 1, true, b.as_ptr(), r as isize, 1, a.as_ptr(), k as isize, 1, scale, true);
    }
}

/// `dx[m, k] (+)= dy[m, n] · w[n, k]`.
pub fn matmul_dx(dy: &[f32], w: &[f32], m: usize, n: usize, k: usize, dx: &mut [f32], accumulate: bool) {
    assert!(dy.len() >= m * n && w.len() >= n * k && dx.len() >= m * k, "matmul_dx: buffer too small");
    // Safety: sizes checked above; dx does not alias dy or w (distinct borrows).
    unsafe {
        gemm_raw(m, k, n, dx.as_mut_ptr(), k as isize, 1, accumulate, dy.as_ptr(), n as isize, 1, w.as_ptr(), k as isize, 1, 1.0, true);
    }
}

/// Rows per task of the LoRA backward (each task reduces its own partial dA, dB).
const LORA_ROWS: usize = 512;

#[allow(clippy::too_many_arguments)]
pub fn lora_bwd(
    x: &[f32],
    a: &[f32],
    b: &[f32],
    scale: f32,
    m: usize,
    k: usize,
    r: usize,
    n_out: usize,
    dy: &[f32],
    col0: usize,
    ld: usize,
    da: &mut [f32],
    db: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    assert!(x.len() >= m * k && a.len() >= r * k && b.len() >= n_out * r && dy.len() >= m * ld);
    if m == 0 {
        return;
    }
    // The rank-r GEMMs are thin: split the rows across tasks, each with serial GEMMs and its own
    // partial dA/dB, then add the partials.
    let per = m.div_ceil(rayon::current_num_threads().max(1)).clamp(1, LORA_ROWS);
    let dxp = dx.map(|v| SendPtr(v.as_mut_ptr()));
    let partials: Vec<(Vec<f32>, Vec<f32>)> = (0..m.div_ceil(per))
        .into_par_iter()
        .map(|c| {
            let (i0, mc) = (c * per, per.min(m - c * per));
            let mut pa = vec![0f32; r * k];
            let mut pb = vec![0f32; n_out * r];
            let mut u = vec![0f32; mc * r];
            let mut du = vec![0f32; mc * r];
            // Safety: row ranges are disjoint across tasks; every extent is inside the checked buffers.
            unsafe {
                let xs = x.as_ptr().add(i0 * k);
                let dys = dy.as_ptr().add(i0 * ld + col0);
                // u = x Aᵀ [mc, r] (recomputed: cheaper than keeping it)
                gemm_raw(mc, r, k, u.as_mut_ptr(), r as isize, 1, false, xs, k as isize, 1, a.as_ptr(), 1, k as isize, 1.0, false);
                // dB [n_out, r] += scale · dy_sᵀ u
                gemm_raw(n_out, r, mc, pb.as_mut_ptr(), r as isize, 1, false, dys, 1, ld as isize, u.as_ptr(), r as isize, 1, scale, false);
                // du [mc, r] = scale · dy_s B
                gemm_raw(mc, r, n_out, du.as_mut_ptr(), r as isize, 1, false, dys, ld as isize, 1, b.as_ptr(), r as isize, 1, scale, false);
                // dA [r, k] += duᵀ x
                gemm_raw(r, k, mc, pa.as_mut_ptr(), k as isize, 1, false, du.as_ptr(), 1, r as isize, xs, k as isize, 1, 1.0, false);
                // dx [mc, k] += du A
                if let Some(dxp) = dxp {
                    gemm_raw(mc, k, r, dxp.get().add(i0 * k), k as isize, 1, true, du.as_ptr(), r as isize, 1, a.as_ptr(), k as isize, 1, 1.0, false);
                }
            }
            (pa, pb)
        })
        .collect();
    for (pa, pb) in partials {
        crate::backend::cpu::ops::add(da, &pa);
        crate::backend::cpu::ops::add(db, &pb);
    }
}

// ---------------------------------------------------------------------------------------------
// Head

/// See `TrainBackend::head_grad`.
pub fn head_grad(h: &[f32], head: &[f32], targets: &[u32], d: usize, vocab: usize, g: &mut [f32]) -> HeadOut {
    let rows = targets.len();
    let mut out = HeadOut { logprobs: vec![0.0; rows], entropy: vec![0.0; rows] };
    if rows == 0 {
        return out;
    }
    let per = rows.div_ceil(rayon::current_num_threads().max(1)).clamp(1, HEAD_ROWS);
    g[..rows * d]
        .par_chunks_mut(per * d)
        .zip(h[..rows * d].par_chunks(per * d))
        .zip(targets.par_chunks(per))
        .zip(out.logprobs.par_chunks_mut(per).zip(out.entropy.par_chunks_mut(per)))
        .for_each(|(((gb, hb), tb), (lpb, entb))| head_block(hb, head, tb, d, vocab, gb, lpb, entb));
    out
}

#[allow(clippy::too_many_arguments)]
fn head_block(h: &[f32], head: &[f32], targets: &[u32], d: usize, vocab: usize, acc: &mut [f32], logp: &mut [f32], ent: &mut [f32]) {
    let rows = targets.len();
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut s = vec![0f32; rows];
    let mut el = vec![0f32; rows];
    let mut tl = vec![f32::NAN; rows];
    acc.fill(0.0);
    let mut logits = vec![0f32; rows * VOCAB_TILE.min(vocab)];
    let mut v0 = 0;
    while v0 < vocab {
        let vn = VOCAB_TILE.min(vocab - v0);
        let lg = &mut logits[..rows * vn];
        let wt = &head[v0 * d..(v0 + vn) * d];
        // Safety: extents are rows×d, vn×d and rows×vn.
        unsafe {
            gemm_raw(rows, vn, d, lg.as_mut_ptr(), vn as isize, 1, false, h.as_ptr(), d as isize, 1, wt.as_ptr(), 1, d as isize, 1.0, false);
        }
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
        unsafe {
            gemm_raw(rows, d, vn, acc.as_mut_ptr(), d as isize, 1, true, lg.as_ptr(), vn as isize, 1, wt.as_ptr(), d as isize, 1, 1.0, false);
        }
        v0 += vn;
    }
    for r in 0..rows {
        let lse = m[r] + s[r].ln();
        logp[r] = tl[r] - lse;
        ent[r] = lse - el[r] / s[r];
        let inv = 1.0 / s[r];
        let t = targets[r] as usize;
        let wt = &head[t * d..(t + 1) * d];
        for (a, &w) in acc[r * d..(r + 1) * d].iter_mut().zip(wt) {
            *a = *a * inv - w;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Optimizer

pub fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamWStep) {
    let t = h.step.max(1) as i32;
    let bc1 = 1.0 - (h.beta1 as f64).powi(t);
    let bc2 = 1.0 - (h.beta2 as f64).powi(t);
    let step_size = (h.lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let decay = 1.0 - h.lr * h.weight_decay;
    for i in 0..p.len() {
        let gi = g[i] * h.grad_scale;
        m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
        v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
        let denom = v[i].sqrt() / bc2_sqrt + h.eps;
        p[i] = p[i] * decay - step_size * m[i] / denom;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn exp_fast_matches_std() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let a = exp_fast(x) as f64;
            let b = (x as f64).exp();
            worst = worst.max(((a - b) / b).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        let mut v = vec![0.5f32, -1.0, 2.0, 3.0, -4.0, 0.0, 1.0, 7.0, 9.0, -3.5];
        let want: f32 = v.iter().map(|&x| (x - 1.0f32).exp()).sum();
        let got = exp_sub_sum(&mut v, 1.0);
        assert!((got - want).abs() < 1e-5 * want);
    }
}
