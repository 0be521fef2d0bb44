//! bf16 attention: the many-row attention of `--dtype bf16` (prefill in `paged`, the training
//! forward and backward in `dense`; decode rows straight from the pages: `decode::decode_row`) with bf16 operands and f32 sums, on AMX
//! tiles (`tdpbf16ps`, `bf16::amx_available`) or, where AMX is missing, on the `vdpbf16ps`
//! GEMM kernel (`bf16::avx512::vdp_product`, e.g. AMD Zen 4/5), for a head size that is a whole
//! number of 32-element steps. Without AVX512_BF16 the f32 attention runs instead.
//!
//! Why: in f32 these products have a reduction of one head (64) or one 64-row query block, too
//! short for the f32 GEMM's packing to pay off (measurements: docs/log/code-notes.md).
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
//! Operands, as `cpu::bf16`'s AMX kernel takes them (the packed layout of its `vdpbf16ps`
//! kernel too): an A operand is rows of pair words (low half the even element) padded with zero
//! rows to strips of 32; a B operand is panels of 32 columns, each `[pairs][32 words]` (the word
//! for pair q, column j holds elements 2q and 2q+1 of the reduction for output column j).
#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::bf16::amx;
use crate::backend::cpu::bf16::{amx_available, vdp_available, Tiles};
#[cfg(not(target_arch = "x86_64"))]
use crate::backend::cpu::bf16::f32_to_bf16_bits;
use std::cell::RefCell;
use std::f32::consts::{LN_2, LOG2_E};

/// Keys (or columns) per panel, rows per strip: the 32 × 32 sums of one AMX block (and the
/// `vdpbf16ps` kernel's panel width).
pub const T: usize = 32;
const _: () = assert!(T == crate::backend::cpu::bf16::NR, "the attention's panels are the GEMM kernels' panels");

/// Whether this attention runs for heads of `hd`: on AMX tiles, or on `vdpbf16ps` where AMX is
/// missing (`bf16::vdp_available`).
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
pub(super) fn softmax_row<const WRITE: bool>(row: &mut [f32], scale: f32, dst: &mut [u32]) -> (f32, f32) {
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

    use crate::backend::cpu::bf16::avx512::round16;

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
        crate::backend::cpu::par::prefetch_l2(row(j + ROWS_AHEAD).as_ptr(), k);
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
                crate::backend::cpu::bf16::avx512::vdp_product(a, lda, m, b, pstride, add, pairs, c, ldc, true);
                crate::backend::cpu::bf16::avx512::vdp_product(a, lda, m, b.add(add * pstride), pstride, panels - add, pairs, c.add(add * T), ldc, false);
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
            crate::backend::cpu::par::prefetch_l2(qkv[(q_row + r) * width + h0 * hd..].as_ptr(), group * hd);
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
        let di = rows.map(|i| if i < m { crate::backend::cpu::simd::dot(&dout(i)[..hd], &o(i)[..hd]) } else { 0.0 });
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

#[cfg(test)]
mod tests;
