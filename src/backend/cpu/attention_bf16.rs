//! bf16 attention: the many-row attention of `--dtype bf16` (prefill in `attention.rs`, the
//! training forward and backward in `attention_dense.rs`; decode rows straight from the pages in
//! `decode_row`, on `vdpbf16ps`) with bf16 operands and f32 sums, on AMX
//! tiles (`tdpbf16ps`, `gemm_bf16::amx_available`) or, where AMX is missing, on the `vdpbf16ps`
//! GEMM kernel (`gemm_bf16::vdp_product`, e.g. AMD Zen 4/5), for a head size that is a whole
//! number of 32-element steps. Without AVX512_BF16 the f32 attention runs instead.
//!
//! Why: in f32 these products have a reduction of one head (64) or one 64-row query block, too
//! short for the f32 GEMM's packing to pay off; they ran at ~120 GFLOP/s, a third of the FMA peak,
//! and were the largest op of scoring and of training. `tdpbf16ps` multiplies 16 × 32 by 32 × 16
//! bf16 per instruction; `vdpbf16ps` runs at twice the f32 FMA rate. On a 2-core Zen 5 without
//! AMX (`cargo bench --bench kernels -- attention/`, one layer, 8 × 512 tokens, f32 → bf16):
//! prefill 9.6 → 6.7 ms, training forward 11.7 → 7.4 ms, backward 28.7 → 17.8 ms.
//!
//! Numerics (docs/DESIGN.md §3): the CUDA backend's tensor-core attention — Q, K, V, the softmax
//! numerators `exp(s − max)` (in the backward dO, dS and P) are rounded to bf16, every product sums in
//! f32; scores, max, sum, lse, the normalisation and the gradients' accumulators are f32. The
//! numerators' exponential is in base 2 as in the CUDA kernels (`2^(s·scale·log2e − m)`, one fused
//! multiply-add, then SLEEF's `exp2f` polynomial: `x512::exp2`, within 1 ulp) and their rounding
//! `vcvtneps2bf16` (both 2–3× fewer instructions than the f32 path's bit-twin exp and emulated
//! rounding; the softmax pass was ~38 % of a training forward's attention). Each
//! output element's `tdpbf16ps` (or `vdpbf16ps`) sequence depends only on its own row and the key
//! positions (keys go in 32-key steps from position 0; steps past a row's visible keys multiply
//! zeros), so a row's result does not depend on the other rows, the query block or the batch (the
//! backward's dK and dV sum over a sequence's rows, block after block in a fixed order). The two
//! instructions' bits differ (AMX's internal order and precision are its own), within the same
//! bounds (the tests below run on either).
//!
//! Operands, as `gemm_bf16`'s AMX kernel takes them (the packed layout of its `vdpbf16ps`
//! kernel too): an A operand is rows of pair words (low half the even element) padded with zero
//! rows to strips of 32; a B operand is panels of 32 columns, each `[pairs][32 words]` (the word
//! for pair q, column j holds elements 2q and 2q+1 of the reduction for output column j).
#[cfg(target_arch = "x86_64")]
use super::gemm_bf16::amx;
use super::gemm_bf16::{amx_available, vdp_available, Tiles};
#[cfg(not(target_arch = "x86_64"))]
use super::gemm_bf16::f32_to_bf16_bits;
use std::cell::RefCell;
use std::f32::consts::{LN_2, LOG2_E};

/// Keys (or columns) per panel, rows per strip: the 32 × 32 sums of one AMX block (and the
/// `vdpbf16ps` kernel's panel width).
pub const T: usize = 32;
const _: () = assert!(T == super::gemm_bf16::NR, "the attention's panels are the GEMM kernels' panels");

/// Whether this attention runs for heads of `hd`: on AMX tiles, or on `vdpbf16ps` where AMX is
/// missing (`gemm_bf16::vdp_available`).
pub fn usable(hd: usize) -> bool {
    cfg!(target_arch = "x86_64") && hd.is_multiple_of(T) && (amx_available() || vdp_available())
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    f32_to_bf16_bits(lo) as u32 | (f32_to_bf16_bits(hi) as u32) << 16
}

/// `dst[q] = pair(src[2q], src[2q + 1])` (src of even length): little-endian, the pair words of a
/// row are its bf16 values in order, so this is a narrowing copy.
#[inline]
pub fn to_pairs(src: &[f32], dst: &mut [u32]) {
    let d: &mut [u16] = bytemuck::cast_slice_mut(dst);
    let n = src.len().min(d.len());
    #[cfg(target_arch = "x86_64")]
    // Safety: AVX-512F/BW/VL are present wherever this attention runs (`usable`: AMX or
    // AVX512_BF16, `simd::has_avx512bf16`); n fits both slices.
    unsafe {
        x512::to_bf16(src.as_ptr(), d.as_mut_ptr(), n)
    }
    #[cfg(not(target_arch = "x86_64"))]
    for (h, &x) in d[..n].iter_mut().zip(src) {
        *h = f32_to_bf16_bits(x);
    }
}

/// One softmax row: `e = exp(scale·x − scale·max)` over `row`, their bf16 values into `dst` (a
/// pair-word row: its first `row.len()` halves, the rest untouched); with `WRITE` `row` is
/// overwritten with e (f32). Returns the row's log-sum-exp of `scale·x` and Σ e (f32); computed in
/// base 2 as the CUDA kernel does (e = 2^(x·scale·log2e − m), lse = (m + log2 Σ e)·ln 2).
/// `usable()` implies AVX-512.
#[inline]
fn softmax_row<const WRITE: bool>(row: &mut [f32], scale: f32, dst: &mut [u32]) -> (f32, f32) {
    let d: &mut [u16] = bytemuck::cast_slice_mut(dst);
    assert!(d.len() >= row.len());
    #[cfg(target_arch = "x86_64")]
    // Safety: AVX-512F/BW/VL are present wherever this attention runs (`usable`); `d` holds
    // `row.len()` halves.
    unsafe {
        let (m, sum) = x512::softmax_row::<WRITE>(row.as_mut_ptr(), row.len(), scale * LOG2_E, d.as_mut_ptr());
        ((m + sum.log2()) * LN_2, sum)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("usable() is false off x86_64")
}

#[cfg(target_arch = "x86_64")]
mod x512 {
    use std::arch::x86_64::*;

    use crate::backend::cpu::gemm_bf16::round16;

    /// 2^t of 16 lanes for the softmax numerators, whose exponents come in base 2 as in the CUDA
    /// kernels (`exp2f(s·scale·log2e − m·log2e)`: the score's scaling and the shift are one fused
    /// multiply-add): t = n + f with n = round(t), f = t − n exact, 2^f by SLEEF's degree-6
    /// polynomial for `exp2f_u10` on fused multiply-adds, 2ⁿ applied by `vscalefps`. 10
    /// instructions (the natural-log Cephes form before took 16: its two-part ln 2 reduction and
    /// clamps). t is clamped below at −126 (2⁻¹²⁶, the smallest normal: −∞ gives it, a NaN stays
    /// NaN); above 128 the result is +∞. `fast_exp2_is_within_one_ulp` bounds the error
    /// (measured 0.83 ulp).
    #[inline(always)]
    pub(super) unsafe fn exp2(t: __m512) -> __m512 {
        let ps = _mm512_set1_ps;
        // max(lo, t) keeps a NaN t NaN
        let t = _mm512_max_ps(ps(-126.0), t);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, n);
        let mut y = ps(EXP2_P[0]);
        for &p in &EXP2_P[1..] {
            y = _mm512_fmadd_ps(y, f, ps(p));
        }
        _mm512_scalef_ps(y, n)
    }

    /// SLEEF's `xexp2f` (u10, with FMA) coefficients, highest degree first: 2^f on [−½, ½].
    // 6.931_471_8e-1 is a fitted coefficient that happens to round like ln 2, not the constant
    #[allow(clippy::approx_constant, clippy::excessive_precision)]
    const EXP2_P: [f32; 7] = [1.535_920_9e-4, 1.339_262_7e-3, 9.618_384_8e-3, 5.550_347_3e-2, 2.402_264_5e-1, 6.931_471_8e-1, 1.0];

    /// 16 f32 → bf16, round to nearest even (`vcvtneps2bf16`): `f32_to_bf16_bits` except that a
    /// denormal input gives ±0 (the instruction treats denormals as zero). Here that is a
    /// numerator or dS below 2⁻¹²⁶, nothing next to the terms it is summed with.
    #[inline(always)]
    pub(super) unsafe fn bf16x16(x: __m512) -> __m256i {
        std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x))
    }

    /// `dst[i] = f32_to_bf16_bits(src[i])` for i < n (16 lanes, the same bits).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn to_bf16(src: *const f32, dst: *mut u16, n: usize) {
        let mut i = 0;
        while i + 16 <= n {
            let r = _mm512_cvtepi32_epi16(round16(_mm512_loadu_si512(src.add(i) as *const _)));
            _mm256_storeu_si256(dst.add(i) as *mut __m256i, r);
            i += 16;
        }
        if i < n {
            let k: __mmask16 = ((1u32 << (n - i)) - 1) as u16;
            let r = _mm512_cvtepi32_epi16(round16(_mm512_maskz_loadu_epi32(k, src.add(i) as *const _)));
            _mm256_mask_storeu_epi16(dst.add(i) as *mut i16, k, r);
        }
    }

    /// `dst[i] = bf16(lo[i]) | bf16(hi[i]) << 16` for i < n.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn zip(lo: *const f32, hi: *const f32, dst: *mut u32, n: usize) {
        let mut i = 0;
        while i < n {
            let k: __mmask16 = if n - i >= 16 { 0xffff } else { ((1u32 << (n - i)) - 1) as u16 };
            let l = round16(_mm512_maskz_loadu_epi32(k, lo.add(i) as *const _));
            let h = round16(_mm512_maskz_loadu_epi32(k, hi.add(i) as *const _));
            _mm512_mask_storeu_epi32(dst.add(i) as *mut _, k, _mm512_or_si512(l, _mm512_slli_epi32::<16>(h)));
            i += 16;
        }
    }

    /// `softmax_row` with `scale` in base 2 (`scale·log2e`): returns (the row's max·scale in base
    /// 2, Σ e).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn softmax_row<const WRITE: bool>(
        x: *mut f32,
        n: usize,
        scale2: f32,
        dst: *mut u16,
    ) -> (f32, f32) {
        let tail = (n % 16) as u32;
        let n16 = n - tail as usize;
        let km: __mmask16 = (1u32 << tail).wrapping_sub(1) as u16;
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < n16 {
            m = _mm512_max_ps(m, _mm512_loadu_ps(x.add(i)));
            i += 16;
        }
        if tail > 0 {
            m = _mm512_max_ps(
                m,
                _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), km, x.add(n16)),
            );
        }
        let mx = _mm512_reduce_max_ps(m) * scale2;
        let (sc, nb) = (_mm512_set1_ps(scale2), _mm512_set1_ps(-mx));
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < n16 {
            let e = exp2(_mm512_fmadd_ps(_mm512_loadu_ps(x.add(i)), sc, nb));
            acc = _mm512_add_ps(acc, e);
            if WRITE {
                _mm512_storeu_ps(x.add(i), e);
            }
            _mm256_storeu_si256(dst.add(i) as *mut __m256i, bf16x16(e));
            i += 16;
        }
        if tail > 0 {
            let e = exp2(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(km, x.add(n16)), sc, nb));
            let e = _mm512_maskz_mov_ps(km, e);
            acc = _mm512_add_ps(acc, e);
            if WRITE {
                _mm512_mask_storeu_ps(x.add(n16), km, e);
            }
            _mm256_mask_storeu_epi16(dst.add(n16) as *mut i16, km, bf16x16(e));
        }
        (mx, _mm512_reduce_add_ps(acc))
    }

    /// Lanes `< n − c0` of a 16-lane chunk starting at `c0`.
    #[inline(always)]
    fn lanes(n: usize, c0: usize) -> __mmask16 {
        if n >= c0 + 16 {
            0xffff
        } else if n <= c0 {
            0
        } else {
            ((1u32 << (n - c0)) - 1) as u16
        }
    }

    /// Rows 2w and 2w+1 of one backward block over `kpad` keys (a multiple of 32): from the
    /// scores `s[r]` and `dP` rows `dp[r]`, `P = 2^(scale2·s − lse2)` (= exp(scale·s − lse): both
    /// in base 2) on the row's `vis` keys and 0 past them, `dS = P ∘ (dP − di)`; writes dS as the
    /// row's bf16 values (`dsa[r]`, kpad halves)
    /// and P and dS zipped across the two rows (`pz`, `dsz`: panels of 32 keys, `wp` pair words
    /// of rows per key, this pair's at w). A row with `vis` 0 (past the block) gives zeros.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn bwd_pair(
        s: [*const f32; 2],
        dp: [*const f32; 2],
        vis: [usize; 2],
        lse2: [f32; 2],
        di: [f32; 2],
        scale2: f32,
        kpad: usize,
        dsa: [*mut u16; 2],
        (pz, dsz, wp, w): (*mut u32, *mut u32, usize, usize),
    ) {
        let sc = _mm512_set1_ps(scale2);
        let mut c = 0;
        while c < kpad {
            let mut pb = [_mm512_setzero_si512(); 2];
            let mut db = [_mm512_setzero_si512(); 2];
            for r in 0..2 {
                let k = lanes(vis[r], c);
                let mut dh = _mm256_setzero_si256();
                if k != 0 {
                    // P = 2^(s·scale2 − lse2) as in `softmax_row`; dS as softmax_grad_row
                    let x = _mm512_maskz_loadu_ps(k, s[r].add(c));
                    let p = _mm512_maskz_mov_ps(k, exp2(_mm512_fmadd_ps(x, sc, _mm512_set1_ps(-lse2[r]))));
                    let d = _mm512_maskz_loadu_ps(k, dp[r].add(c));
                    let ds = _mm512_maskz_mov_ps(k, _mm512_mul_ps(p, _mm512_sub_ps(d, _mm512_set1_ps(di[r]))));
                    dh = bf16x16(ds);
                    pb[r] = _mm512_cvtepu16_epi32(bf16x16(p));
                    db[r] = _mm512_cvtepu16_epi32(dh);
                }
                _mm256_storeu_si256(dsa[r].add(c) as *mut __m256i, dh);
            }
            let at = ((c / 32) * wp + w) * 32 + c % 32;
            _mm512_storeu_si512(pz.add(at) as *mut _, _mm512_or_si512(pb[0], _mm512_slli_epi32::<16>(pb[1])));
            _mm512_storeu_si512(dsz.add(at) as *mut _, _mm512_or_si512(db[0], _mm512_slli_epi32::<16>(db[1])));
            c += 16;
        }
    }

    /// `dst[l·ldd + j] = bf16(lo[j][l]) | bf16(hi[j][l]) << 16` for l, j < 16: 16 pairs of rows
    /// (16 values each; null: zeros) zipped into pair words and transposed.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn zip_transposed(lo: &[*const f32; 16], hi: &[*const f32; 16], dst: *mut u32, ldd: usize) {
        let load = |p: *const f32| if p.is_null() { _mm512_setzero_si512() } else { round16(_mm512_loadu_si512(p as *const _)) };
        transpose_store(std::array::from_fn(|j| _mm512_or_si512(load(lo[j]), _mm512_slli_epi32::<16>(load(hi[j])))), dst, ldd);
    }

    /// The 16 × 16 words at `src` (row stride `lds`) transposed to `dst` (row stride `ldd`).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose16(src: *const u32, lds: usize, dst: *mut u32, ldd: usize) {
        transpose_store(std::array::from_fn(|i| _mm512_loadu_si512(src.add(i * lds) as *const _)), dst, ldd);
    }

    /// 16 vectors of 16 words (`r[i]` lane j) transposed in registers and stored as 16 rows at
    /// `dst` (row stride `ldd`): row j lane i.
    #[inline(always)]
    unsafe fn transpose_store(mut r: [__m512i; 16], dst: *mut u32, ldd: usize) {
        // 32-bit interleave, 64-bit interleave, then 128-bit lane shuffles in two rounds
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for i in 0..4 {
            for h in 0..2 {
                r[4 * i + 2 * h] = _mm512_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);
                r[4 * i + 2 * h + 1] = _mm512_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);
            }
        }
        // now r[4i + q] holds, in each 128-bit lane L, column 4L + q of rows 4i..4i+4
        for i in 0..2 {
            for q in 0..4 {
                t[8 * i + q] = _mm512_shuffle_i32x4::<0x88>(r[8 * i + q], r[8 * i + 4 + q]);
                t[8 * i + 4 + q] = _mm512_shuffle_i32x4::<0xdd>(r[8 * i + q], r[8 * i + 4 + q]);
            }
        }
        for q in 0..8 {
            r[q] = _mm512_shuffle_i32x4::<0x88>(t[q], t[8 + q]);
            r[8 + q] = _mm512_shuffle_i32x4::<0xdd>(t[q], t[8 + q]);
        }
        for (j, v) in r.iter().enumerate() {
            _mm512_storeu_si512(dst.add(j * ldd) as *mut _, *v);
        }
    }
}

/// `dst[q] = pair(lo[q], hi[q])`: two rows zipped.
#[inline]
fn zip_pairs(lo: &[f32], hi: &[f32], dst: &mut [u32]) {
    let n = dst.len().min(lo.len()).min(hi.len());
    #[cfg(target_arch = "x86_64")]
    // Safety: as in `to_pairs`; n fits all three slices.
    unsafe {
        x512::zip(lo.as_ptr(), hi.as_ptr(), dst.as_mut_ptr(), n)
    }
    #[cfg(not(target_arch = "x86_64"))]
    for ((w, &l), &h) in dst[..n].iter_mut().zip(lo).zip(hi) {
        *w = pair(l, h);
    }
}

/// A operand: `rows` rows of `k` elements (`row(i)`, k even) as pair words, `k/2` per row,
/// padded with zero rows to whole strips. Returns the row stride in words.
pub fn pack_rows<'a>(
    dst: &mut Vec<u32>,
    rows: usize,
    k: usize,
    row: impl Fn(usize) -> &'a [f32],
) -> usize {
    let kp = k / 2;
    dst.clear();
    dst.resize(rows.next_multiple_of(T) * kp, 0);
    for (i, d) in dst.chunks_exact_mut(kp).take(rows).enumerate() {
        to_pairs(&row(i)[..k], d);
    }
    kp
}

/// Rows read ahead of the one being packed (`pack_panels_rows`, `pack_panels_cols`): the rows of
/// one kv head are `hd` values a qkv row (~4 KB) apart, a stride the hardware prefetchers do not
/// follow across pages, so without this every row's lines were demand misses (in the training
/// backward's profile the conversion's first instruction after its load held ~10 % of the samples).
const ROWS_AHEAD: usize = 8;

/// Row `j + ROWS_AHEAD` of `row` (if any) asked into L2.
#[inline]
fn prefetch_ahead<'a>(row: &impl Fn(usize) -> &'a [f32], j: usize, n: usize, k: usize) {
    if j + ROWS_AHEAD < n {
        super::attention::prefetch_l2(row(j + ROWS_AHEAD).as_ptr(), k);
    }
}

/// B operand for `out[i, j] = Σ_c a[i, c] · x[j, c]` (x: `n` rows of `k` elements, as the keys of
/// `Q·Kᵀ`), from x's rows (`row(j)`): panels of 32 rows of x, each `[k/2 pairs][32]`; rows past
/// `n` are zeros. Per panel the 32 rows are converted to pair words, then transposed 16 × 16 words
/// at a time in registers (a scalar scatter of one word per 128 bytes before).
pub fn pack_panels_rows<'a>(
    dst: &mut Vec<u32>,
    n: usize,
    k: usize,
    row: impl Fn(usize) -> &'a [f32],
) {
    let kp = k / 2;
    dst.clear();
    dst.resize(n.div_ceil(T) * kp * T, 0);
    let mut w = vec![0u32; T * kp];
    for (p, panel) in dst.chunks_exact_mut(kp * T).enumerate() {
        for (jj, wr) in w.chunks_exact_mut(kp).enumerate() {
            let j = p * T + jj;
            prefetch_ahead(&row, j, n, k);
            if j < n {
                to_pairs(&row(j)[..k], wr);
            } else {
                wr.fill(0);
            }
        }
        // panel[q·T + j] = w[j·kp + q]
        #[cfg(target_arch = "x86_64")]
        if kp.is_multiple_of(16) {
            for q0 in (0..kp).step_by(16) {
                for j0 in [0, 16] {
                    // Safety: AVX-512F wherever this attention runs (`usable`); the 16 × 16 words
                    // at w[j0·kp + q0] (stride kp) and panel[q0·T + j0] (stride T) are inside both.
                    unsafe { x512::transpose16(w.as_ptr().add(j0 * kp + q0), kp, panel.as_mut_ptr().add(q0 * T + j0), T) };
                }
            }
            continue;
        }
        for (jj, wr) in w.chunks_exact(kp).enumerate() {
            for (q, &x) in wr.iter().enumerate() {
                panel[q * T + jj] = x;
            }
        }
    }
}

/// B operand for `out[i, c] = Σ_j a[i, j] · x[j, c]` (x: `n` rows of `width` elements, as the
/// values of `P·V`), from x's rows: `width/32` panels of 32 columns, each `[⌈n/32⌉·16 pairs of
/// rows][32]`, zero past `n`. Returns the panel stride in words.
pub fn pack_panels_cols<'a>(
    dst: &mut Vec<u32>,
    n: usize,
    width: usize,
    row: impl Fn(usize) -> &'a [f32],
) -> usize {
    let np = n.next_multiple_of(T) / 2;
    dst.clear();
    dst.resize(width.div_ceil(T) * np * T, 0);
    let zero = vec![0f32; width];
    for q in 0..n.div_ceil(2) {
        prefetch_ahead(&row, 2 * q, n, width);
        prefetch_ahead(&row, 2 * q + 1, n, width);
        let lo = &row(2 * q)[..width];
        let hi = if 2 * q + 1 < n {
            &row(2 * q + 1)[..width]
        } else {
            &zero[..]
        };
        for p in 0..width / T {
            zip_pairs(
                &lo[p * T..(p + 1) * T],
                &hi[p * T..(p + 1) * T],
                &mut dst[p * np * T + q * T..][..T],
            );
        }
    }
    np * T
}

/// The products' engine for this thread: AMX tiles where the CPU has them (held while it lives:
/// `Tiles`), else the `vdpbf16ps` kernel on the same operands.
pub struct Products {
    tiles: Tiles,
}

impl Products {
    #[allow(clippy::new_without_default)] // configuring tiles is not a default value
    pub fn new() -> Self {
        assert!(amx_available() || vdp_available(), "bf16 attention: neither AMX nor AVX512_BF16 on this CPU (check `usable` first)");
        Products { tiles: Tiles::new() }
    }
}

/// `C = A · B` for A's first `m` rows (`a`: strips of 32 rows, `lda` words per row) and B's first
/// `panels` panels (`pstride` words apart), over `pairs` pairs (a multiple of 16), stored into `c`
/// (row stride `ldc`), which holds `m` rounded up to 32 rows: AMX stores whole 32 × 32 blocks (A's
/// zero rows give zero rows), `vdpbf16ps` the first `m` rows only; callers read those. The first
/// `add` panels' columns are added to C instead (`C += A · B`: the tiles start from C's blocks, so
/// a sum over blocks needs no pass of its own, and columns a sum has not reached yet are stored,
/// so its accumulator needs no zeroing).
#[allow(clippy::too_many_arguments)]
pub fn product(
    pr: &Products,
    a: &[u32],
    lda: usize,
    m: usize,
    b: &[u32],
    pstride: usize,
    panels: usize,
    pairs: usize,
    c: &mut [f32],
    ldc: usize,
    add: usize,
) {
    let mp = m.next_multiple_of(T);
    assert!(pairs.is_multiple_of(16) && pairs <= lda && a.len() >= mp * lda);
    assert!(
        panels == 0
            || (b.len() >= (panels - 1) * pstride + pairs * T
                && panels * T <= ldc
                && c.len() >= (mp - 1) * ldc + panels * T)
    );
    #[cfg(target_arch = "x86_64")]
    {
        if !pr.tiles.held() {
            // Safety: `Products::new` asserted AVX512_BF16 (no AMX here); the extents are
            // asserted above.
            unsafe {
                let (a, b, c, add) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), add.min(panels));
                super::gemm_bf16::vdp_product(a, lda, m, b, pstride, add, pairs, c, ldc, true);
                super::gemm_bf16::vdp_product(a, lda, m, b.add(add * pstride), pstride, panels - add, pairs, c.add(add * T), ldc, false);
            };
            return;
        }
        for s in (0..m).step_by(T) {
            for p in 0..panels {
                // Safety: the tiles are configured (`pr`); the strip's 32 rows × `pairs` words, the
                // panel's `pairs` × 32 words and the 32 × 32 block of C are inside the slices (asserted).
                unsafe {
                    let (a, b, c) = (a.as_ptr().add(s * lda), b.as_ptr().add(p * pstride), c.as_mut_ptr().add(s * ldc + p * T));
                    // row-major A: a 16-pair step is 16 words on
                    if p < add {
                        amx::block_add(a, lda, 16, b, pairs, c, ldc)
                    } else {
                        amx::block_to(a, lda, 16, b, pairs, c, ldc)
                    }
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("usable() is false off x86_64");
}

thread_local! {
    /// This thread's packed K, V and block buffers, reused across calls (attention runs per layer
    /// and sequence; fresh allocations of this size cost page faults each time).
    static SCRATCH: RefCell<(Vec<u32>, Vec<u32>, Scratch)> = RefCell::new(Default::default());
}

/// `f(kt, v, scratch)` with this thread's reusable buffers.
pub fn with_scratch<R>(f: impl FnOnce(&mut Vec<u32>, &mut Vec<u32>, &mut Scratch) -> R) -> R {
    let mut s = SCRATCH.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let r = f(&mut s.0, &mut s.1, &mut s.2);
    SCRATCH.with(|c| *c.borrow_mut() = s);
    r
}

/// Reused buffers of one task.
#[derive(Default)]
pub struct Scratch {
    /// A operands: the block's queries, then its softmax numerators (pair words)
    pub qa: Vec<u32>,
    pub pa: Vec<u32>,
    /// scores of the block's rows, `[m][keys]`
    pub s: Vec<f32>,
    /// the block's outputs `[m][hd]`
    pub o: Vec<f32>,
    /// 1 / the softmax sums of the block's rows
    pub inv: Vec<f32>,
}

/// The forward of one query block of `m` rows against packed keys (`kt`: `pack_panels_rows` of K)
/// and values (`v`: `pack_panels_cols` of V, panels `v_stride` apart) of one kv head. `q(i)`: row
/// i's query (`hd` long, unscaled); `visible(i)`: the keys row i sees (≥ 1). Leaves row i's output
/// in `sc.o[i·hd..][..hd]` and calls `lse(i, log-sum-exp of its scaled scores)`.
#[allow(clippy::too_many_arguments)]
pub fn forward<'a>(
    pr: &Products,
    kt: &[u32],
    v: &[u32],
    v_stride: usize,
    hd: usize,
    m: usize,
    q: impl Fn(usize) -> &'a [f32],
    visible: impl Fn(usize) -> usize,
    scale: f32,
    sc: &mut Scratch,
    mut lse: impl FnMut(usize, f32),
) {
    let kmax = (0..m).map(&visible).max().unwrap_or(0);
    let kpad = kmax.next_multiple_of(T);
    let mp = m.next_multiple_of(T);
    let hp = pack_rows(&mut sc.qa, m, hd, q);
    // S = Q Kᵀ
    sc.s.resize(mp * kpad, 0.0);
    product(pr, &sc.qa, hp, m, kt, hp * T, kpad / T, hp, &mut sc.s, kpad, 0);
    // numerators e = exp(scale·s − max) in f32, rounded to bf16 as P·V's A operand; their f32 sum
    // normalises the output
    let kp = kpad / 2;
    // every word of the first m rows is written below, the rows past them are zeroed
    sc.pa.resize(mp * kp, 0);
    sc.pa[m * kp..].fill(0);
    sc.inv.resize(m, 0.0);
    for i in 0..m {
        let vis = visible(i);
        let row: &mut [u32] = &mut sc.pa[i * kp..(i + 1) * kp];
        let (l, sum) = softmax_row::<false>(&mut sc.s[i * kpad..i * kpad + vis], scale, row);
        // the keys past the visible ones multiply zeros (a real V row may sit there)
        bytemuck::cast_slice_mut::<u32, u16>(row)[vis..].fill(0);
        lse(i, l);
        sc.inv[i] = 1.0 / sum;
    }
    // O = E V / sum
    sc.o.resize(mp * hd, 0.0);
    product(pr, &sc.pa, kp, m, v, v_stride, hd / T, kp, &mut sc.o, hd, 0);
    for (o, &inv) in sc.o.chunks_exact_mut(hd).zip(&sc.inv) {
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// `forward` over the `n_q` query rows of one GQA group, in blocks of `bq` rows × the group's
/// heads stacked head-major (one product per block serves every head sharing the kv head). Row r
/// is qkv row `q_row + r` (rows `width` wide) at key position `first_pos + r`; the heads are
/// `h0..h0 + group`. `out(row, head, o)` and `lse(row, head, value)` receive each result, `row`
/// being the qkv row.
#[allow(clippy::too_many_arguments)]
pub fn forward_rows(
    pr: &Products,
    kt: &[u32],
    v: &[u32],
    v_stride: usize,
    hd: usize,
    (qkv, width): (&[f32], usize),
    (q_row, n_q, first_pos): (usize, usize, usize),
    (h0, group, bq): (usize, usize, usize),
    scale: f32,
    sc: &mut Scratch,
    mut out: impl FnMut(usize, usize, &[f32]),
    mut lse: impl FnMut(usize, usize, f32),
) {
    let mut r0 = 0;
    while r0 < n_q {
        // the next block's query rows (strided, so beyond the hardware prefetchers) come from
        // memory while this block computes
        let next = (r0 + bq).min(n_q);
        for r in next..(next + bq).min(n_q) {
            super::attention::prefetch_l2(qkv[(q_row + r) * width + h0 * hd..].as_ptr(), group * hd);
        }
        let bq = bq.min(n_q - r0);
        let at = |i: usize| (q_row + r0 + i % bq, h0 + i / bq);
        let q = |i: usize| {
            let (row, h) = at(i);
            &qkv[row * width + h * hd..][..hd]
        };
        forward(pr, kt, v, v_stride, hd, group * bq, q, |i| first_pos + r0 + i % bq + 1, scale, sc, |i, x| {
            let (row, h) = at(i);
            lse(row, h, x)
        });
        for (i, o) in sc.o.chunks_exact(hd).take(group * bq).enumerate() {
            let (row, h) = at(i);
            out(row, h, o);
        }
        r0 += bq;
    }
}

/// Buffers of one backward task, reused across calls.
#[derive(Default)]
pub struct BwdScratch {
    /// K and V as `Q·Kᵀ`-style operands (`kt`, `vt`), K as a `P·V`-style operand (`kc`)
    pub kt: Vec<u32>,
    pub vt: Vec<u32>,
    pub kc: Vec<u32>,
    /// the block's A operands: Q, dO, dS rows; Qᵀ, dOᵀ (pairs of query rows)
    qa: Vec<u32>,
    doa: Vec<u32>,
    dsa: Vec<u32>,
    qt: Vec<u32>,
    dot: Vec<u32>,
    /// P and dS as B operands (pairs of query rows × 32-key panels)
    pz: Vec<u32>,
    dsz: Vec<u32>,
    /// f32 blocks: P, dP → dS, dQ of the block
    p: Vec<f32>,
    ds: Vec<f32>,
    dq: Vec<f32>,
    /// dKᵀ (unscaled: `scale` multiplies it once at the end), dVᵀ accumulators `[hd rounded up to
    /// 32][n rounded up to 32]`, written in their first `seen` columns (a multiple of 32: the
    /// blocks' products store the columns past it and add into those before it)
    pub dkt: Vec<f32>,
    pub dvt: Vec<f32>,
    pub seen: usize,
}

thread_local! {
    static BWD: RefCell<BwdScratch> = RefCell::new(Default::default());
}

/// `f(scratch)` with this thread's reusable backward buffers.
pub fn with_bwd_scratch<R>(f: impl FnOnce(&mut BwdScratch) -> R) -> R {
    let mut s = BWD.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let r = f(&mut s);
    BWD.with(|c| *c.borrow_mut() = s);
    r
}

/// `dst[c·(mp/2) + w] = pair(x(2w)[c], x(2w + 1)[c])` for the first `m` rows (zeros past them):
/// an A operand with the rows' index as its reduction (`Qᵀ`, `dOᵀ`), `width` rows (a multiple of
/// 16), zipped and transposed 16 × 16 pair words at a time.
fn pack_transposed<'a>(dst: &mut Vec<u32>, m: usize, width: usize, row: impl Fn(usize) -> &'a [f32]) -> usize {
    let wp = m.next_multiple_of(T) / 2;
    assert!(width.is_multiple_of(16));
    dst.resize(width * wp, 0); // every word written below
    #[cfg(target_arch = "x86_64")]
    for w0 in (0..wp).step_by(16) {
        for c0 in (0..width).step_by(16) {
            let at = |i: usize| if i < m { row(i)[c0..c0 + 16].as_ptr() } else { std::ptr::null() };
            let lo: [*const f32; 16] = std::array::from_fn(|j| at(2 * (w0 + j)));
            let hi: [*const f32; 16] = std::array::from_fn(|j| at(2 * (w0 + j) + 1));
            // Safety: AVX-512F/BW wherever this attention runs (`usable`); each pointer is 16
            // values of a row (sliced above); the 16 × 16 words at (c0, w0) are inside `dst`
            // (wp is a multiple of 16).
            unsafe { x512::zip_transposed(&lo, &hi, dst.as_mut_ptr().add(c0 * wp + w0), wp) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("usable() is false off x86_64");
    wp
}

/// The backward of one query block of `m` rows (as in `forward`), for packed `sc.kt`, `sc.vt`
/// (K, V as `pack_panels_rows`) and `sc.kc` (K as `pack_panels_cols`, panels `kc_stride` apart).
/// `q(i)`, `dout(i)`, `o(i)`: row i's query, output gradient and forward output; `lse(i)` its
/// log-sum-exp from the forward. Calls `dq(i, row)` with row i's query gradient and adds the
/// block's key gradient divided by `scale` (`Qᵀ dS`: the caller scales the sum once) and its value
/// gradient into `sc.dkt`, `sc.dvt` (`[hd][ld]`, ld a multiple of 32 ≥ the keys seen; their
/// columns past `sc.seen` are stored rather than added to, and `sc.seen` grows to the keys seen).
/// P is recomputed from the lse on the same bf16 operands as the forward; dO and dS are rounded
/// to bf16 as they enter a product, the accumulators are f32.
#[allow(clippy::too_many_arguments)]
pub fn backward<'a>(
    pr: &Products,
    sc: &mut BwdScratch,
    kc_stride: usize,
    hd: usize,
    ld: usize,
    m: usize,
    q: impl Fn(usize) -> &'a [f32],
    dout: impl Fn(usize) -> &'a [f32],
    o: impl Fn(usize) -> &'a [f32],
    lse: impl Fn(usize) -> f32,
    visible: impl Fn(usize) -> usize,
    scale: f32,
    mut dq: impl FnMut(usize, &[f32]),
) {
    let kmax = (0..m).map(&visible).max().unwrap_or(0);
    let kpad = kmax.next_multiple_of(T);
    let mp = m.next_multiple_of(T);
    let hp = pack_rows(&mut sc.qa, m, hd, &q);
    pack_rows(&mut sc.doa, m, hd, &dout);
    // S = Q Kᵀ (into p), dP = dO Vᵀ (into ds)
    sc.p.resize(mp * kpad, 0.0);
    sc.ds.resize(mp * kpad, 0.0);
    product(pr, &sc.qa, hp, m, &sc.kt, hp * T, kpad / T, hp, &mut sc.p, kpad, 0);
    product(pr, &sc.doa, hp, m, &sc.vt, hp * T, kpad / T, hp, &mut sc.ds, kpad, 0);
    // P = exp(scale·S − lse) (in base 2: `bwd_pair`), dS = P ∘ (dP − dO·O), zero past the visible keys and the rows; dS
    // as pair words along the keys (dQ's A operand), P and dS zipped across row pairs (the B
    // operands of dVᵀ and dKᵀ), in one pass over each pair of rows
    let (kp, wp) = (kpad / 2, mp / 2);
    sc.dsa.resize(mp * kp, 0); // every word of these three is written below
    sc.pz.resize(kpad * wp, 0);
    sc.dsz.resize(kpad * wp, 0);
    for w in 0..wp {
        let rows = [2 * w, 2 * w + 1];
        let vis = rows.map(|i| if i < m { visible(i) } else { 0 });
        let l = rows.map(|i| if i < m { lse(i) * LOG2_E } else { 0.0 });
        let di = rows.map(|i| if i < m { super::simd::dot(&dout(i)[..hd], &o(i)[..hd]) } else { 0.0 });
        #[cfg(target_arch = "x86_64")]
        // Safety: AVX-512F/BW wherever this attention runs (`usable`); rows 2w, 2w + 1 < mp of the
        // `[mp][kpad]` buffers, and of dsa (kpad halves per row); pz and dsz hold kpad · wp words.
        unsafe {
            let dsa = sc.dsa.as_mut_ptr() as *mut u16;
            x512::bwd_pair(
                rows.map(|i| sc.p.as_ptr().add(i * kpad)),
                rows.map(|i| sc.ds.as_ptr().add(i * kpad)),
                vis,
                l,
                di,
                scale * LOG2_E,
                kpad,
                rows.map(|i| dsa.add(i * kpad)),
                (sc.pz.as_mut_ptr(), sc.dsz.as_mut_ptr(), wp, w),
            )
        };
    }
    // dQ = scale · dS K
    sc.dq.resize(mp * hd, 0.0);
    product(pr, &sc.dsa, kp, m, &sc.kc, kc_stride, hd / T, kp, &mut sc.dq, hd, 0);
    for i in 0..m {
        let row = &mut sc.dq[i * hd..(i + 1) * hd];
        row.iter_mut().for_each(|x| *x *= scale);
        dq(i, row);
    }
    // dKᵀ += Qᵀ dS (the caller scales the sum once, after the last block), dVᵀ += dOᵀ P:
    // reductions over the block's rows, added into the accumulators by the products themselves
    pack_transposed(&mut sc.qt, m, hd, &q);
    pack_transposed(&mut sc.dot, m, hd, &dout);
    let zs = wp * T;
    let add = sc.seen / T;
    product(pr, &sc.qt, wp, hd, &sc.dsz, zs, kpad / T, wp, &mut sc.dkt, ld, add);
    product(pr, &sc.dot, wp, hd, &sc.pz, zs, kpad / T, wp, &mut sc.dvt, ld, add);
    sc.seen = sc.seen.max(kpad);
}

/// `dst[j·ldd + c] = src[c·lds + j]` for c < `rows`, j < `cols`: the `[hd][keys]` gradient
/// accumulators back to rows of keys (16 × 16 blocks in registers, the edges one by one).
///
/// # Safety
/// AVX-512F (wherever `usable`); `dst` holds `cols` rows of `ldd` from which `rows` values are
/// written; nothing else aliases them.
pub unsafe fn transpose_out(src: &[f32], lds: usize, rows: usize, cols: usize, dst: *mut f32, ldd: usize) {
    assert!(rows == 0 || src.len() >= (rows - 1) * lds + cols);
    // the part the register blocks write (none off x86_64: the edge loop then does it all)
    let (r16, c16) = if cfg!(target_arch = "x86_64") { (rows & !15, cols & !15) } else { (0, 0) };
    #[cfg(target_arch = "x86_64")]
    for c0 in (0..r16).step_by(16) {
        for j0 in (0..c16).step_by(16) {
            // Safety: AVX-512F wherever this attention runs; the block is inside both (asserted,
            // and the caller's contract)
            x512::transpose16(src.as_ptr().add(c0 * lds + j0) as *const u32, lds, dst.add(j0 * ldd + c0) as *mut u32, ldd);
        }
    }
    for c in 0..rows {
        let from = if c < r16 { c16 } else { 0 };
        for j in from..cols {
            *dst.add(j * ldd + c) = src[c * lds + j];
        }
    }
}

/// `$m::$f::<H, NB>(a)` for `hc` ≤ 3 heads and `nb` ≤ 2 blocks (constants of the kernels).
macro_rules! heads_blocks {
    ($m:ident::$f:ident, $hc:expr, $nb:expr, $a:expr) => {
        match ($hc, $nb) {
            (1, 1) => $m::$f::<1, 1>($a),
            (2, 1) => $m::$f::<2, 1>($a),
            (3, 1) => $m::$f::<3, 1>($a),
            (1, _) => $m::$f::<1, 2>($a),
            (2, _) => $m::$f::<2, 2>($a),
            _ => $m::$f::<3, 2>($a),
        }
    };
}

/// Whether a decode row of heads of `hd` over pages of `ps` keys runs on `decode_row`
/// (`vdpbf16ps`, whole blocks of 32 keys and 32 columns).
pub fn decode_usable(hd: usize, ps: usize) -> bool {
    cfg!(target_arch = "x86_64") && hd.is_multiple_of(T) && ps.is_multiple_of(T) && vdp_available()
}

/// One decode row (one query) of the `group` query heads sharing a kv head, over the first
/// `visible` keys of its pages, on bf16 operands as the fed rows here and the CUDA kernel: Q
/// rounded to bf16, `S = Q·Kᵀ` by `vdpbf16ps` over pairs of dimensions, the softmax numerators
/// rounded to bf16 (`softmax_row`), `P·V` by `vdpbf16ps` over pairs of keys, divided by the
/// numerators' f32 sum at the end. The f32 kernels these rows ran on before
/// (`attention::attend_direct`) were bound by their fused multiply-adds (~92 % of one core's f32
/// peak with the keys in cache); `vdpbf16ps` does two products per lane and instruction.
///
/// `kt(i)`, `vals(i)`: page i's `Kᵀ` block (`[hd][ps]`) and values (`[ps][hd]`); `next(i)`: the
/// block read after block i (K blocks `0..n`, then V blocks `n..2n`, `n` pages), asked into L2
/// row by row while block i is read (null: none). `out`: `group` rows of `hd`. Needs
/// `decode_usable(hd, ps)`.
#[allow(clippy::too_many_arguments)]
pub fn decode_row<'a>(
    kt: impl Fn(usize) -> &'a [u16],
    vals: impl Fn(usize) -> &'a [u16],
    next: impl Fn(usize) -> *const u16,
    (ps, hd, visible): (usize, usize, usize),
    q: &[f32],
    group: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(decode_usable(hd, ps) && q.len() >= group * hd && out.len() >= group * hd && visible > 0);
    DECODE_SCRATCH.with_borrow_mut(|d| {
        let DecodeScratch { qp, scores, pp, sums, vps, vnext } = d;
        let n_pages = visible.div_ceil(ps);
        let half = hd / 2;
        // Q as pair words, head after head
        qp.resize(group * half, 0);
        for h in 0..group {
            to_pairs(&q[h * hd..(h + 1) * hd], &mut qp[h * half..(h + 1) * half]);
        }
        // scores[h·visible + t] (every one written below); numerators as pair words, pw per head
        scores.resize(group * visible, 0.0);
        let pw = visible.div_ceil(2);
        pp.resize(group * pw, 0);
        if visible % 2 == 1 {
            // an odd last key's partner: `softmax_row` writes `visible` halves, this one must be 0
            for h in 0..group {
                pp[h * pw + pw - 1] = 0;
            }
        }
        sums.resize(group, 0.0);
        #[cfg(target_arch = "x86_64")]
        // Safety: decode_usable: AVX512_BF16 (with F/BW); every block holds hd·ps values, the keys
        // read are < ps of each page (whole 32-key blocks), scores/pp/out are sized above.
        unsafe {
            // ≤ 3 heads × ≤ 2 blocks of 32 keys (or columns) a pass: 6–12 sums in flight, as many as
            // `vdpbf16ps`'s latency needs with the weights' rows shared
            let mut h0 = 0;
            while h0 < group {
                let hc = (group - h0).min(3);
                for pi in 0..n_pages {
                    let (t0, k) = (pi * ps, kt(pi));
                    assert!(k.len() >= hd * ps);
                    let nt = ps.min(visible - t0);
                    let pf = if h0 == 0 { next(pi + 1) } else { std::ptr::null() };
                    let mut j0 = 0;
                    while j0 < nt {
                        let nb = if nt - j0 > T && j0 + 2 * T <= ps { 2 } else { 1 };
                        let n = (nt - j0).min(nb * T);
                        let (qh, o) = (qp.as_ptr().add(h0 * half), scores.as_mut_ptr().add(h0 * visible + t0 + j0));
                        let a = (k.as_ptr(), ps, hd, j0, qh, half, o, visible, n, pf);
                        heads_blocks!(decode_x512::scores, hc, nb, a);
                        j0 += nb * T;
                    }
                }
                h0 += hc;
            }
            for h in 0..group {
                sums[h] = softmax_row::<false>(&mut scores[h * visible..(h + 1) * visible], scale, &mut pp[h * pw..(h + 1) * pw]).1;
            }
            // the value blocks and what to prefetch during each
            vps.clear();
            vnext.clear();
            for pi in 0..n_pages {
                let v = vals(pi);
                assert!(v.len() >= ps.min(visible - pi * ps) * hd);
                vps.push(v.as_ptr());
                vnext.push(next(n_pages + pi + 1));
            }
            let mut h0 = 0;
            while h0 < group {
                let hc = (group - h0).min(3);
                let mut c0 = 0;
                while c0 < hd {
                    let nb = if c0 + 2 * T <= hd { 2 } else { 1 };
                    let pf: &[*const u16] = if h0 == 0 && c0 == 0 { vnext } else { &[] };
                    let a = (&vps[..], pf, ps, hd, visible, c0, pp.as_ptr().add(h0 * pw), pw, &sums[h0..], out.as_mut_ptr().add(h0 * hd));
                    heads_blocks!(decode_x512::values, hc, nb, a);
                    c0 += nb * T;
                }
                h0 += hc;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("decode_usable() is false off x86_64");
    })
}

/// `decode_row`'s buffers (Q pairs, scores, numerator pairs, sums, the value blocks and what to
/// prefetch during each), kept by each thread: a decode step runs one `decode_row` per sequence,
/// kv head and layer.
struct DecodeScratch {
    qp: Vec<u32>,
    scores: Vec<f32>,
    pp: Vec<u32>,
    sums: Vec<f32>,
    vps: Vec<*const u16>,
    vnext: Vec<*const u16>,
}

thread_local! {
    static DECODE_SCRATCH: RefCell<DecodeScratch> = const { RefCell::new(DecodeScratch { qp: Vec::new(), scores: Vec::new(), pp: Vec::new(), sums: Vec::new(), vps: Vec::new(), vnext: Vec::new() }) };
}

/// `decode_row`'s two products. A pair row is `unpacklo/hi_epi16` of two rows of 32 bf16 (two
/// dimensions of 32 keys, or two keys of 32 columns): lane `4L + w` of the low half holds element
/// `8L + w` of the 32, of the high half element `8L + 4 + w` (`L` the 128-bit lane, `w < 4`);
/// `unshuffle` puts the sums back in element order.
#[cfg(target_arch = "x86_64")]
mod decode_x512 {
    use super::T;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn unshuffle(lo: __m512, hi: __m512) -> (__m512, __m512) {
        let first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
        let second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
        (_mm512_permutex2var_ps(lo, first, hi), _mm512_permutex2var_ps(lo, second, hi))
    }

    /// Two rows of 32 bf16 as the pair words of their elements, low and high half (the lane
    /// order of the module doc).
    #[inline(always)]
    unsafe fn pair_rows(x: __m512i, y: __m512i) -> (__m512bh, __m512bh) {
        (std::mem::transmute::<__m512i, __m512bh>(_mm512_unpacklo_epi16(x, y)), std::mem::transmute::<__m512i, __m512bh>(_mm512_unpackhi_epi16(x, y)))
    }

    /// One pair word in every lane.
    #[inline(always)]
    unsafe fn word(w: u32) -> __m512bh {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(w as i32))
    }

    #[inline(always)]
    unsafe fn pf_l2(p: *const u16, elems: usize) {
        if !p.is_null() {
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(elems) as *const i8);
        }
    }

    type ScoresArgs = (*const u16, usize, usize, usize, *const u32, usize, *mut f32, usize, usize, *const u16);

    /// Raw scores `q_h·k_j` of keys `j0..j0 + 32·NB` (the first `n` written) of one `Kᵀ` block
    /// for heads `0..H` (Q pairs `qp[h·qs + p]`), into `out[h·os + j]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn scores<const H: usize, const NB: usize>((kt, ps, hd, j0, qp, qs, out, os, n, pf): ScoresArgs) {
        let mut lo = [[_mm512_setzero_ps(); NB]; H];
        let mut hi = [[_mm512_setzero_ps(); NB]; H];
        for p in 0..hd / 2 {
            let (r0, r1) = (2 * p * ps + j0, (2 * p + 1) * ps + j0);
            let mut pl = [std::mem::zeroed::<__m512bh>(); NB];
            let mut ph = [std::mem::zeroed::<__m512bh>(); NB];
            for b in 0..NB {
                pf_l2(pf, r0 + b * T);
                pf_l2(pf, r1 + b * T);
                let (x, y) = (_mm512_loadu_si512(kt.add(r0 + b * T) as *const _), _mm512_loadu_si512(kt.add(r1 + b * T) as *const _));
                (pl[b], ph[b]) = pair_rows(x, y);
            }
            for h in 0..H {
                let qv = word(*qp.add(h * qs + p));
                for b in 0..NB {
                    lo[h][b] = _mm512_dpbf16_ps(lo[h][b], pl[b], qv);
                    hi[h][b] = _mm512_dpbf16_ps(hi[h][b], ph[b], qv);
                }
            }
        }
        for h in 0..H {
            for b in 0..NB {
                let (e0, e1) = unshuffle(lo[h][b], hi[h][b]);
                for (i, e) in [e0, e1].into_iter().enumerate() {
                    let at = b * T + 16 * i;
                    if at < n {
                        let k = (n - at).min(16);
                        _mm512_mask_storeu_ps(out.add(h * os + at), ((1u32 << k) - 1) as u16, e);
                    }
                }
            }
        }
    }

    type ValuesArgs<'v> = (&'v [*const u16], &'v [*const u16], usize, usize, usize, usize, *const u32, usize, &'v [f32], *mut f32);

    /// Columns `c0..c0 + 32·NB` of `out_h = Σ_t P[h][t]·v_t / sums[h]` for heads `0..H` over every
    /// page's value block `vps[i]` (numerator pair words `pp[h·pw + u]` = keys 2u, 2u + 1), stored
    /// at `out[h·hd + c]`; during page i its rows of `pfs[i]` are asked into L2 (if any).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn values<const H: usize, const NB: usize>((vps, pfs, ps, hd, visible, c0, pp, pw, sums, out): ValuesArgs) {
        let mut lo = [[_mm512_setzero_ps(); NB]; H];
        let mut hi = [[_mm512_setzero_ps(); NB]; H];
        for (pi, &v) in vps.iter().enumerate() {
            let t0 = pi * ps;
            let nt = ps.min(visible - t0);
            let pf = pfs.get(pi).copied().unwrap_or(std::ptr::null());
            let vp = v.add(c0);
            let mut t = 0;
            while t < nt {
                // a missing partner key (odd `visible`) is a zero row: its numerator is 0 too,
                // and the page's row past `visible` may hold anything
                let mut pl = [std::mem::zeroed::<__m512bh>(); NB];
                let mut ph = [std::mem::zeroed::<__m512bh>(); NB];
                for b in 0..NB {
                    let x = _mm512_loadu_si512(vp.add(t * hd + b * T) as *const _);
                    let y = if t + 1 < nt { _mm512_loadu_si512(vp.add((t + 1) * hd + b * T) as *const _) } else { _mm512_setzero_si512() };
                    (pl[b], ph[b]) = pair_rows(x, y);
                }
                for c in (0..hd).step_by(T) {
                    pf_l2(pf, t * hd + c);
                    pf_l2(pf, (t + 1) * hd + c);
                }
                let u = (t0 + t) / 2;
                for h in 0..H {
                    let pv = word(*pp.add(h * pw + u));
                    for b in 0..NB {
                        lo[h][b] = _mm512_dpbf16_ps(lo[h][b], pl[b], pv);
                        hi[h][b] = _mm512_dpbf16_ps(hi[h][b], ph[b], pv);
                    }
                }
                t += 2;
            }
        }
        for h in 0..H {
            let inv = _mm512_set1_ps(1.0 / sums[h]);
            for b in 0..NB {
                let (e0, e1) = unshuffle(lo[h][b], hi[h][b]);
                let o = out.add(h * hd + c0 + b * T);
                _mm512_storeu_ps(o, _mm512_mul_ps(e0, inv));
                _mm512_storeu_ps(o.add(16), _mm512_mul_ps(e1, inv));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::attention_dense::attn_dense;
    use crate::backend::cpu::gemm_bf16::f32_to_bf16_bits;
    use crate::backend::{AttnGeom, DenseSeq};
    use crate::util::rng::Rng;

    /// Sequences of 70, 1, 33, 130 and 32 rows back to back (across the 64-row block and the
    /// 32-key panel boundaries): the geometry, the sequences and the row count.
    fn batch(nh: usize, nkv: usize, hd: usize) -> (AttnGeom, Vec<DenseSeq>, usize) {
        let g = AttnGeom { n_layers: 1, n_heads: nh, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
        let mut seqs = Vec::new();
        let mut row = 0;
        for len in [70usize, 1, 33, 130, 32] {
            seqs.push(DenseSeq { row0: row, len });
            row += len;
        }
        (g, seqs, row)
    }

    /// `decode_row` against an f64 reference on the same rounded operands (Q and the softmax
    /// numerators to bf16, as the kernel): groups of 1, 3 and 8 query heads (8: two passes of
    /// ≤ 6), heads of 64 and 128, pages of 32 and 64 keys, contexts ending mid-page, on an odd key
    /// and on a page boundary; the slots past the context hold NaN (a recycled page's leftovers
    /// may be anything) and must not reach the output.
    #[test]
    fn decode_row_matches_f64_on_rounded_operands() {
        if !super::decode_usable(64, 64) {
            eprintln!("no AVX512_BF16 here: decode rows use the f32 kernels");
            return;
        }
        let bf = |x: f32| f32::from_bits((f32_to_bf16_bits(x) as u32) << 16);
        let mut rng = Rng::new(7);
        for &(group, hd, ps) in &[(3usize, 64usize, 64usize), (8, 64, 32), (1, 128, 64), (3, 128, 32)] {
            for visible in [1usize, 37, 64, 95, 128, 129] {
                let n_pages = visible.div_ceil(ps);
                // keys Kᵀ [hd][ps] and values [ps][hd] per page, NaN past the context
                let mut kt = vec![vec![f32_to_bf16_bits(f32::NAN); hd * ps]; n_pages];
                let mut vv = vec![vec![f32_to_bf16_bits(f32::NAN); hd * ps]; n_pages];
                let mut keys = vec![vec![0f32; hd]; visible];
                let mut vals = vec![vec![0f32; hd]; visible];
                for t in 0..visible {
                    for d in 0..hd {
                        keys[t][d] = bf((rng.next_f64() * 4.0 - 2.0) as f32);
                        vals[t][d] = bf((rng.next_f64() * 4.0 - 2.0) as f32);
                        kt[t / ps][d * ps + t % ps] = f32_to_bf16_bits(keys[t][d]);
                        vv[t / ps][(t % ps) * hd + d] = f32_to_bf16_bits(vals[t][d]);
                    }
                }
                let q: Vec<f32> = (0..group * hd).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect();
                let scale = 1.0 / (hd as f32).sqrt();
                let mut out = vec![f32::NAN; group * hd];
                super::decode_row(|i| &kt[i][..], |i| &vv[i][..], |_| std::ptr::null(), (ps, hd, visible), &q, group, scale, &mut out);
                for h in 0..group {
                    let qh: Vec<f64> = q[h * hd..(h + 1) * hd].iter().map(|&x| bf(x) as f64).collect();
                    let s: Vec<f64> = keys.iter().map(|k| k.iter().zip(&qh).map(|(&a, b)| a as f64 * b).sum::<f64>() * scale as f64).collect();
                    let m = s.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let l: f64 = e.iter().sum();
                    for c in 0..hd {
                        let want = e.iter().zip(&vals).map(|(&p, v)| bf(p as f32) as f64 * v[c] as f64).sum::<f64>() / l;
                        let got = out[h * hd + c] as f64;
                        // the numerators' roundings may differ where the f32 and f64 scores
                        // straddle a bf16 boundary: one ulp (2⁻⁸ relative) of a term, of |v| ≤ 2
                        assert!((got - want).abs() < 2f64.powi(-7) * 2.0 / l.max(1.0) + 1e-5, "group {group}, hd {hd}, pages of {ps}, {visible} keys, head {h}, column {c}: {got} vs {want}");
                    }
                }
            }
        }
    }

    /// Whether this CPU lacks the bf16 attention (then the test has nothing to check; said so).
    fn not_here() -> bool {
        let no = !super::usable(64);
        if no {
            eprintln!("neither AMX nor AVX512_BF16 here: the bf16 attention is not used on this CPU");
        }
        no
    }

    fn r16(x: f32) -> f64 {
        f32::from_bits((f32_to_bf16_bits(x) as u32) << 16) as f64
    }

    /// The training forward (AMX or `vdpbf16ps`) against f64 on the bf16-rounded Q, K, V: the output within
    /// the numerators' rounding (≤ 2⁻⁸ relative each, so ≤ 2⁻⁸·max|v|), the lse within f32
    /// rounding; and each sequence alone gives the bits it gets in the batch. Lengths cross the
    /// 64-row block and 32-key panel boundaries; GQA 9/3 and 4/1, heads of 64 and 32.
    #[test]
    fn dense_forward_matches_f64_and_is_batch_invariant() {
        if not_here() {
            return;
        }
        for &(nh, nkv, hd) in &[(9usize, 3usize, 64usize), (4, 1, 32)] {
            let (g, seqs, row) = batch(nh, nkv, hd);
            let (w, qd, group) = (g.qkv_dim(), g.q_dim(), nh / nkv);
            let mut rng = Rng::new(5);
            let qkv: Vec<f32> = (0..row * w).map(|_| (rng.normal() * 1.5) as f32).collect();
            let mut out = vec![f32::NAN; row * qd];
            let mut lse = vec![f32::NAN; row * nh];
            attn_dense(&qkv, &seqs, g, &mut out, &mut lse, true);
            let scale = 1.0 / (hd as f64).sqrt();
            for s in &seqs {
                for i in 0..s.len {
                    let r = s.row0 + i;
                    for qh in 0..nh {
                        let kvh = qh / group;
                        let sc: Vec<f64> = (0..=i)
                            .map(|j| (0..hd).map(|c| r16(qkv[r * w + qh * hd + c]) * r16(qkv[(s.row0 + j) * w + qd + kvh * hd + c])).sum::<f64>() * scale)
                            .collect();
                        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                        let want_lse = m + z.ln();
                        let got_lse = lse[r * nh + qh] as f64;
                        assert!((got_lse - want_lse).abs() < 1e-5 * want_lse.abs().max(1.0), "lse row {r} head {qh}: {got_lse} vs {want_lse}");
                        let mut vmax = 0f64;
                        for c in 0..hd {
                            let mut o = 0.0;
                            for (j, x) in sc.iter().enumerate() {
                                let v = r16(qkv[(s.row0 + j) * w + qd + g.kv_dim() + kvh * hd + c]);
                                vmax = vmax.max(v.abs());
                                o += (x - m).exp() / z * v;
                            }
                            let got = out[r * qd + qh * hd + c] as f64;
                            assert!((got - o).abs() <= 2f64.powi(-8) * vmax + 1e-5, "out row {r} head {qh} col {c}: {got} vs {o}");
                        }
                    }
                }
            }
            // each sequence alone: the same bits
            for s in &seqs {
                let one = &qkv[s.row0 * w..(s.row0 + s.len) * w];
                let (mut o1, mut l1) = (vec![0f32; s.len * qd], vec![0f32; s.len * nh]);
                attn_dense(one, &[DenseSeq { row0: 0, len: s.len }], g, &mut o1, &mut l1, true);
                assert!(o1.iter().zip(&out[s.row0 * qd..]).all(|(a, b)| a.to_bits() == b.to_bits()), "sequence of {} alone differs", s.len);
                assert!(l1.iter().zip(&lse[s.row0 * nh..]).all(|(a, b)| a.to_bits() == b.to_bits()), "lse of {} alone differs", s.len);
            }
        }
    }

    /// The softmax numerators' 2^t (`x512::exp2`: fused multiply-adds, `vscalefps`) against f64
    /// over its whole domain: within 1 ulp (measured: 0.83) wherever the result is a normal f32
    /// (t down to the clamp at −126), exactly 1 at 0, NaN kept, −∞ and t < −126 clamped to 2⁻¹²⁶;
    /// and `x512::bf16x16` (`vcvtneps2bf16`) against `f32_to_bf16_bits` (nearest even) on normal
    /// values and NaN, ±0 for denormals.
    #[test]
    fn fast_exp2_is_within_one_ulp() {
        if not_here() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            // Safety: AVX-512F and AVX512_BF16 (`usable`, checked above)
            #[target_feature(enable = "avx512f,avx512bf16")]
            unsafe fn run(x: &[f32; 16]) -> ([f32; 16], [u16; 16]) {
                let v = _mm512_loadu_ps(x.as_ptr());
                let (mut e, mut h) = ([0f32; 16], [0u16; 16]);
                _mm512_storeu_ps(e.as_mut_ptr(), super::x512::exp2(v));
                _mm256_storeu_si256(h.as_mut_ptr() as *mut __m256i, super::x512::bf16x16(v));
                (e, h)
            }
            // |error| in units of the spacing of f32 at the true value
            let ulp = |got: f32, want: f64| {
                let w = want as f32;
                (got as f64 - want).abs() / (f32::from_bits(w.to_bits() + 1) - w) as f64
            };
            let mut worst = (0f64, 0f32);
            let mut rng = Rng::new(11);
            let mut xs: Vec<f32> = (0..1 << 21).map(|i| -126.0 * (i as f32) / (1 << 21) as f32).collect();
            xs.extend((0..1 << 16).map(|_| -(rng.next_f64() as f32) * 126.0));
            // slightly positive: a numerator's argument rounds a little above 0
            xs.extend((0..1 << 12).map(|_| (rng.next_f64() as f32) * 1e-5));
            xs.extend((0..1 << 12).map(|_| -(rng.next_f64() as f32) * 1e-3));
            for c in xs.chunks(16) {
                let mut x = [0f32; 16];
                x[..c.len()].copy_from_slice(c);
                let (e, h) = unsafe { run(&x) };
                for (l, (&xi, &ei)) in x.iter().zip(&e).enumerate().take(c.len()) {
                    let want = (xi as f64).exp2();
                    let u = ulp(ei, want);
                    if u > worst.0 {
                        worst = (u, xi);
                    }
                    assert_eq!(h[l], f32_to_bf16_bits(xi), "bf16 of {xi}");
                }
            }
            eprintln!("exp2: at most {:.3} ulp (at {})", worst.0, worst.1);
            assert!(worst.0 <= 1.0, "exp2 is {} ulp off at {}", worst.0, worst.1);
            let mut x = [0f32; 16];
            x[1] = f32::NAN;
            x[2] = f32::NEG_INFINITY;
            x[3] = 1e-40; // denormal
            x[4] = -1e-40;
            x[5] = 3.0e38;
            x[6] = -0.0;
            x[7] = -200.0;
            x[8] = -1.0;
            let (e, h) = unsafe { run(&x) };
            assert_eq!(e[0], 1.0);
            assert!(e[1].is_nan() && h[1] & 0x7fff > 0x7f80, "NaN: exp {} bf16 {:#x}", e[1], h[1]);
            assert_eq!((e[2], e[7]), (2f32.powi(-126), 2f32.powi(-126)), "2^−∞ and 2^−200 clamp to 2^−126");
            assert_eq!(e[8], 0.5);
            assert_eq!((h[3], h[4]), (0, 0x8000), "denormals to ±0");
            assert_eq!(h[5], f32_to_bf16_bits(3.0e38));
            assert_eq!((e[6], h[6]), (1.0, 0x8000));
        }
    }

    /// `transpose_out` (16 × 16 blocks in registers, the edges one by one) and `pack_transposed`
    /// (zipped and transposed in registers) against their definitions, on shapes off the 16 and
    /// 32 grids, into buffers holding other values first.
    #[test]
    fn transposes_match_their_definitions() {
        if not_here() {
            return;
        }
        let mut rng = Rng::new(7);
        for &(rows, cols) in &[(64usize, 70usize), (32, 1), (48, 33), (5, 130), (16, 16)] {
            let lds = cols.next_multiple_of(32) + 3;
            let src: Vec<f32> = (0..rows * lds).map(|_| rng.normal() as f32).collect();
            let ldd = rows + 5;
            let mut dst = vec![f32::NAN; cols * ldd];
            // Safety: dst holds cols rows of ldd ≥ rows
            unsafe { super::transpose_out(&src, lds, rows, cols, dst.as_mut_ptr(), ldd) };
            for j in 0..cols {
                for c in 0..ldd {
                    let want = if c < rows { src[c * lds + j].to_bits() } else { f32::NAN.to_bits() };
                    assert_eq!(dst[j * ldd + c].to_bits(), want, "transpose_out {rows}x{cols}: ({c}, {j})");
                }
            }
        }
        for &(m, width) in &[(1usize, 32usize), (33, 64), (70, 16), (192, 64)] {
            let x: Vec<Vec<f32>> = (0..m).map(|_| (0..width).map(|_| rng.normal() as f32).collect()).collect();
            let mut dst = vec![0xdead_beef; 40];
            let wp = super::pack_transposed(&mut dst, m, width, |i| &x[i]);
            assert_eq!((wp, dst.len()), (m.next_multiple_of(32) / 2, width * wp));
            let h = |i: usize, c: usize| if i < m { f32_to_bf16_bits(x[i][c]) as u32 } else { 0 };
            for c in 0..width {
                for w in 0..wp {
                    assert_eq!(dst[c * wp + w], h(2 * w, c) | h(2 * w + 1, c) << 16, "pack_transposed m {m}: ({c}, {w})");
                }
            }
        }
    }

    /// The training backward (AMX or `vdpbf16ps`) against the f32 twin (itself checked against finite
    /// differences in tests/grpo_grad.rs) on the same bf16-rounded Q, K, V and dO, with the
    /// forward's out and lse: it rounds dS (and P for dV) to bf16, ≤ 2⁻⁸ relative each, so
    /// each of dQ, dK, dV within 0.5 % in norm (measured 0.15–0.17 % on AMX); every element written; each sequence alone gives the
    /// bits it gets in the batch.
    #[test]
    fn dense_backward_matches_f32_twin_and_is_batch_invariant() {
        use crate::backend::cpu::attention_dense::attn_dense_bwd;
        if not_here() {
            return;
        }
        for &(nh, nkv, hd) in &[(9usize, 3usize, 64usize), (4, 1, 32)] {
            let (g, seqs, row) = batch(nh, nkv, hd);
            let (w, qd) = (g.qkv_dim(), g.q_dim());
            let mut rng = Rng::new(6);
            let qkv: Vec<f32> = (0..row * w).map(|_| r16((rng.normal() * 1.5) as f32) as f32).collect();
            let dout: Vec<f32> = (0..row * qd).map(|_| r16(rng.normal() as f32) as f32).collect();
            let (mut out, mut lse) = (vec![0f32; row * qd], vec![0f32; row * nh]);
            attn_dense(&qkv, &seqs, g, &mut out, &mut lse, true);
            let mut got = vec![f32::NAN; row * w];
            attn_dense_bwd(&qkv, &out, &dout, &lse, &seqs, g, &mut got, true);
            assert!(got.iter().all(|v| v.is_finite()), "every element of dqkv is written");
            let mut want = vec![0f32; row * w];
            attn_dense_bwd(&qkv, &out, &dout, &lse, &seqs, g, &mut want, false);
            for (name, c0, c1) in [("dQ", 0, qd), ("dK", qd, qd + g.kv_dim()), ("dV", qd + g.kv_dim(), w)] {
                let (mut d, mut r) = (0f64, 0f64);
                for i in 0..row {
                    for c in c0..c1 {
                        d += (got[i * w + c] as f64 - want[i * w + c] as f64).powi(2);
                        r += (want[i * w + c] as f64).powi(2);
                    }
                }
                let e = (d / r).sqrt();
                assert!(e < 5e-3, "{name} (heads {nh}/{nkv}, hd {hd}): ‖Δ‖/‖f32‖ = {e:.2e}");
            }
            for s in &seqs {
                let one = &qkv[s.row0 * w..(s.row0 + s.len) * w];
                let mut g1 = vec![0f32; s.len * w];
                let one_seq = [DenseSeq { row0: 0, len: s.len }];
                attn_dense_bwd(one, &out[s.row0 * qd..], &dout[s.row0 * qd..], &lse[s.row0 * nh..], &one_seq, g, &mut g1, true);
                assert!(g1.iter().zip(&got[s.row0 * w..]).all(|(a, b)| a.to_bits() == b.to_bits()), "sequence of {} alone differs", s.len);
            }
        }
    }
}
