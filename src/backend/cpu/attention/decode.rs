//! Decode rows: a few queries read K and V straight from the pages, both dtypes side by side.
//!
//! Element type (`KvElem`): f32 with `--dtype f32`, bf16 with `--dtype bf16` (as on CUDA: K and V
//! rounded to nearest even when stored, widened to f32 when read). The f32-arithmetic kernels
//! (`scores_page`, `values_page`: AVX-512, AVX2 or scalar, the same bits on each) serve both
//! element types; bf16 pages on a CPU with AVX512_BF16 take `decode_row` instead, on bf16 operands
//! with f32 sums (`vdpbf16ps`), as the fed rows (`tiled`) and the CUDA kernel, so a sampled token's
//! log-prob equals its score.
use super::tiled::{softmax_row, to_pairs, T};
use crate::backend::cpu::bf16::vdp_available;
use crate::backend::cpu::par::prefetch_l2;
use std::cell::RefCell;

/// A KV page's element: f32 (`--dtype f32`), or bf16 bits (`--dtype bf16`, the CUDA backend's
/// policy: half the bytes every decode step streams; values rounded once, to nearest even, as
/// they are stored; the arithmetic stays f32).
pub trait KvElem: Copy + Default + Send + Sync + 'static {
    /// bf16 pages: fed rows run on bf16 operands where the CPU has AMX or AVX512_BF16 (`attention::tiled`).
    const BF16: bool;
    /// `x` as stored (bf16: rounded to nearest even).
    fn round(x: f32) -> Self;
    /// The stored value as f32 (exact).
    fn widen(self) -> f32;
    /// The stored value as bf16 bits (f32: rounded to nearest even).
    fn bits(self) -> u16;
    /// Widen `src` into `dst` (same length).
    fn get(dst: &mut [f32], src: &[Self]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = x.widen();
        }
    }
}

impl KvElem for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn round(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn bits(self) -> u16 {
        crate::backend::cpu::bf16::f32_to_bf16_bits(self)
    }
    fn get(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for u16 {
    const BF16: bool = true;
    #[inline(always)]
    fn round(x: f32) -> u16 {
        crate::backend::cpu::bf16::f32_to_bf16_bits(x)
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        // a bf16 is the high half of an f32
        f32::from_bits((self as u32) << 16)
    }
    #[inline(always)]
    fn bits(self) -> u16 {
        self
    }
}

/// Where one page's decode scores go: `out[h·visible + t0 + j] = scale · q_h · key_j` for the
/// query heads `h < group` (rows of `hd` in `q`).
pub(super) struct Scores<'a> {
    pub(super) q: &'a [f32],
    pub(super) group: usize,
    pub(super) hd: usize,
    pub(super) scale: f32,
    pub(super) out: &'a mut [f32],
    pub(super) visible: usize,
    pub(super) t0: usize,
    /// The next block to stream (K or V, same shape), asked into L2 one row per row of this
    /// page's keys as the vector kernels go (`prefetch_row`), or null.
    pub(super) next: *const u8,
}

/// The scores of the first `nt` keys of one page, from its `Kᵀ` block (`kt[d·ps + j]`). Every
/// path computes a key's score the same way — from +0, one fused multiply-add per `d` in order,
/// then × scale — so the bits do not depend on the instruction set, the key's place in a vector
/// or the page size.
pub(super) fn scores_page<T: KvElem>(sc: Scores, kt: &[T], ps: usize, nt: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::backend::cpu::simd::has_avx512f() {
            // Safety: AVX-512F is present; kt holds hd rows of ps.
            return unsafe { x512::scores(sc, kt, ps, nt) };
        }
        if crate::backend::cpu::simd::has_avx2_fma() {
            // Safety: AVX2 and FMA are present; as above.
            return unsafe { x256::scores(sc, kt, ps, nt) };
        }
    }
    scores_keys(sc, kt, ps, 0, nt)
}

/// Keys `j0..nt` one at a time (pages narrower than a vector, the last keys of odd page sizes,
/// and CPUs without AVX2).
pub(super) fn scores_keys<T: KvElem>(sc: Scores, kt: &[T], ps: usize, j0: usize, nt: usize) {
    let hd = sc.hd;
    for j in j0..nt {
        for h in 0..sc.group {
            let q = &sc.q[h * hd..(h + 1) * hd];
            let s = q.iter().enumerate().fold(0f32, |s, (d, &qd)| qd.mul_add(kt[d * ps + j].widen(), s));
            sc.out[h * sc.visible + sc.t0 + j] = s * sc.scale;
        }
    }
}

/// `out_h += Σ_j p[h·visible + j] · value_j` over one page's `nt = vals.len() / hd` values, for
/// every head `h < group`: per element, one fused multiply-add per key in key order, on every path.
pub(super) fn values_page<T: KvElem>(p: &[f32], visible: usize, vals: &[T], group: usize, hd: usize, out: &mut [f32], next: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::backend::cpu::simd::has_avx512f() {
            // Safety: AVX-512F is present; p rows hold nt values, out group rows of hd.
            return unsafe { x512::values(p, visible, vals, group, hd, out, next) };
        }
        if crate::backend::cpu::simd::has_avx2_fma() {
            // Safety: AVX2 and FMA are present; as above.
            return unsafe { x256::values(p, visible, vals, group, hd, out, next) };
        }
    }
    let _ = next;
    values_cols(p, visible, vals, group, hd, 0, out)
}

/// Columns `c0..hd` of `values_page`, one at a time.
pub(super) fn values_cols<T: KvElem>(p: &[f32], visible: usize, vals: &[T], group: usize, hd: usize, c0: usize, out: &mut [f32]) {
    for h in 0..group {
        for c in c0..hd {
            let o = &mut out[h * hd + c];
            for (j, val) in vals.chunks_exact(hd).enumerate() {
                *o = p[h * visible + j].mul_add(val[c].widen(), *o);
            }
        }
    }
}

/// The decode kernels for one vector width. Scores: a block of `NB` vectors of consecutive keys ×
/// `H` ≤ 3 query heads of accumulators; per `d`, the keys' element `d` is loaded (widened from
/// bf16) once and multiplied by each head's broadcast `q_h[d]` — no horizontal sums, and K is
/// read once for the whole group. Values: `H` heads × `NB` vectors of columns, per key one row
/// load and a broadcast weight per head. Registers: H·NB accumulators + NB loads + 1 broadcast
/// (AVX-512: 12 + 4 + 1 of 32; AVX2, NB ≤ 3: 9 + 3 + 1 of 16).
#[cfg(target_arch = "x86_64")]
macro_rules! decode_kernels {
    ($m:ident, $feat:literal, $v:ty, $lanes:literal, $nb_max:literal, $zero:ident, $set1:ident, $fma:ident, $load:ident, $store:ident, $wide:path, $bf16_load:ty, $bf16_loadu:ident) => {
        mod $m {
            use crate::backend::cpu::attention::decode::{prefetch_row, scores_keys, values_cols, KvElem, Scores};
            use std::arch::x86_64::*;
            const L: usize = $lanes;

            #[target_feature(enable = $feat)]
            #[inline]
            unsafe fn load<T: KvElem>(p: *const T) -> $v {
                if std::mem::size_of::<T>() == 2 {
                    // a bf16 is the high half of an f32: widen to 32 bits, shift into place
                    $wide($bf16_loadu(p as *const $bf16_load))
                } else {
                    $load(p as *const f32)
                }
            }

            /// # Safety
            /// The CPU has the features; `kt` holds `hd` rows of `ps`.
            #[target_feature(enable = $feat)]
            pub unsafe fn scores<T: KvElem>(mut sc: Scores, kt: &[T], ps: usize, nt: usize) {
                let mut j0 = 0;
                // whole vectors of keys while they stay inside the block; lanes past nt are
                // computed from whatever the page holds there and dropped
                while j0 < nt && j0 + L <= ps {
                    let nb = (nt - j0).div_ceil(L).min($nb_max).min((ps - j0) / L);
                    let mut h = 0;
                    while h < sc.group {
                        let hc = (sc.group - h).min(3);
                        match (hc, nb) {
                            (1, 1) => keys::<T, 1, 1>(&mut sc, kt, ps, h, j0, nt), (1, 2) => keys::<T, 1, 2>(&mut sc, kt, ps, h, j0, nt), (1, 3) => keys::<T, 1, 3>(&mut sc, kt, ps, h, j0, nt), (1, 4) => keys::<T, 1, 4>(&mut sc, kt, ps, h, j0, nt),
                            (2, 1) => keys::<T, 2, 1>(&mut sc, kt, ps, h, j0, nt), (2, 2) => keys::<T, 2, 2>(&mut sc, kt, ps, h, j0, nt), (2, 3) => keys::<T, 2, 3>(&mut sc, kt, ps, h, j0, nt), (2, 4) => keys::<T, 2, 4>(&mut sc, kt, ps, h, j0, nt),
                            (3, 1) => keys::<T, 3, 1>(&mut sc, kt, ps, h, j0, nt), (3, 2) => keys::<T, 3, 2>(&mut sc, kt, ps, h, j0, nt), (3, 3) => keys::<T, 3, 3>(&mut sc, kt, ps, h, j0, nt), (3, 4) => keys::<T, 3, 4>(&mut sc, kt, ps, h, j0, nt),
                            _ => unreachable!(),
                        }
                        h += hc;
                    }
                    j0 += nb * L;
                }
                scores_keys(sc, kt, ps, j0.min(nt), nt)
            }

            /// Keys `j0..j0 + NB·L` (stored up to `nt`) for heads `h0..h0 + H`.
            #[target_feature(enable = $feat)]
            #[inline]
            unsafe fn keys<T: KvElem, const H: usize, const NB: usize>(sc: &mut Scores, kt: &[T], ps: usize, h0: usize, j0: usize, nt: usize) {
                let hd = sc.hd;
                debug_assert!(j0 + NB * L <= ps && kt.len() >= hd * ps && NB <= $nb_max);
                let (q, k) = (sc.q.as_ptr().add(h0 * hd), kt.as_ptr().add(j0));
                let sz = std::mem::size_of::<T>();
                let pf = if h0 == 0 { sc.next } else { std::ptr::null() };
                let mut acc = [[$zero(); NB]; H];
                for d in 0..hd {
                    prefetch_row(pf, (d * ps + j0) * sz, NB * L * sz);
                    let row = k.add(d * ps);
                    let mut kv = [$zero(); NB];
                    for (b, x) in kv.iter_mut().enumerate() {
                        *x = load(row.add(b * L));
                    }
                    for (c, a) in acc.iter_mut().enumerate() {
                        let qv = $set1(*q.add(c * hd + d));
                        for b in 0..NB {
                            a[b] = $fma(qv, kv[b], a[b]);
                        }
                    }
                }
                let mut tmp = [0f32; 4 * L];
                let n = (nt - j0).min(NB * L);
                for (c, a) in acc.iter().enumerate() {
                    for b in 0..NB {
                        $store(tmp.as_mut_ptr().add(b * L), a[b]);
                    }
                    let dst = &mut sc.out[(h0 + c) * sc.visible + sc.t0 + j0..][..n];
                    for (o, &t) in dst.iter_mut().zip(&tmp[..n]) {
                        *o = t * sc.scale;
                    }
                }
            }

            /// # Safety
            /// The CPU has the features; `p` rows hold `vals.len() / hd` values, `out` `group` rows of `hd`.
            #[target_feature(enable = $feat)]
            pub unsafe fn values<T: KvElem>(p: &[f32], visible: usize, vals: &[T], group: usize, hd: usize, out: &mut [f32], next: *const u8) {
                let nt = vals.len() / hd;
                let mut c0 = 0;
                while c0 + L <= hd {
                    let nb = ((hd - c0) / L).min($nb_max);
                    let mut h = 0;
                    while h < group {
                        // the next block's rows: with the first heads' columns only
                        let pf = if h == 0 { next } else { std::ptr::null() };
                        let hc = (group - h).min(3);
                        match (hc, nb) {
                            (1, 1) => cols::<T, 1, 1>(p, visible, vals, nt, hd, h, c0, out, pf), (1, 2) => cols::<T, 1, 2>(p, visible, vals, nt, hd, h, c0, out, pf), (1, 3) => cols::<T, 1, 3>(p, visible, vals, nt, hd, h, c0, out, pf), (1, 4) => cols::<T, 1, 4>(p, visible, vals, nt, hd, h, c0, out, pf),
                            (2, 1) => cols::<T, 2, 1>(p, visible, vals, nt, hd, h, c0, out, pf), (2, 2) => cols::<T, 2, 2>(p, visible, vals, nt, hd, h, c0, out, pf), (2, 3) => cols::<T, 2, 3>(p, visible, vals, nt, hd, h, c0, out, pf), (2, 4) => cols::<T, 2, 4>(p, visible, vals, nt, hd, h, c0, out, pf),
                            (3, 1) => cols::<T, 3, 1>(p, visible, vals, nt, hd, h, c0, out, pf), (3, 2) => cols::<T, 3, 2>(p, visible, vals, nt, hd, h, c0, out, pf), (3, 3) => cols::<T, 3, 3>(p, visible, vals, nt, hd, h, c0, out, pf), (3, 4) => cols::<T, 3, 4>(p, visible, vals, nt, hd, h, c0, out, pf),
                            _ => unreachable!(),
                        }
                        h += hc;
                    }
                    c0 += nb * L;
                }
                values_cols(p, visible, vals, group, hd, c0, out)
            }

            /// Columns `c0..c0 + NB·L` of heads `h0..h0 + H`.
            #[target_feature(enable = $feat)]
            #[inline]
            #[allow(clippy::too_many_arguments)]
            unsafe fn cols<T: KvElem, const H: usize, const NB: usize>(p: &[f32], visible: usize, vals: &[T], nt: usize, hd: usize, h0: usize, c0: usize, out: &mut [f32], pf: *const u8) {
                debug_assert!(c0 + NB * L <= hd && vals.len() >= nt * hd && NB <= $nb_max);
                let o = out.as_mut_ptr().add(h0 * hd + c0);
                let mut acc = [[$zero(); NB]; H];
                for (c, a) in acc.iter_mut().enumerate() {
                    for b in 0..NB {
                        a[b] = $load(o.add(c * hd + b * L));
                    }
                }
                let (pp, v) = (p.as_ptr().add(h0 * visible), vals.as_ptr().add(c0));
                let sz = std::mem::size_of::<T>();
                for t in 0..nt {
                    prefetch_row(pf, (t * hd + c0) * sz, NB * L * sz);
                    let row = v.add(t * hd);
                    let mut vv = [$zero(); NB];
                    for (b, x) in vv.iter_mut().enumerate() {
                        *x = load(row.add(b * L));
                    }
                    for (c, a) in acc.iter_mut().enumerate() {
                        let pv = $set1(*pp.add(c * visible + t));
                        for b in 0..NB {
                            a[b] = $fma(pv, vv[b], a[b]);
                        }
                    }
                }
                for (c, a) in acc.iter().enumerate() {
                    for b in 0..NB {
                        $store(o.add(c * hd + b * L), a[b]);
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn widen512(x: std::arch::x86_64::__m256i) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(x)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn widen256(x: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(x)))
}

#[cfg(target_arch = "x86_64")]
decode_kernels!(x512, "avx512f,avx512bw,avx2,fma", __m512, 16, 4, _mm512_setzero_ps, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_storeu_ps, crate::backend::cpu::attention::decode::widen512, __m256i, _mm256_loadu_si256);
#[cfg(target_arch = "x86_64")]
decode_kernels!(x256, "avx2,fma", __m256, 8, 3, _mm256_setzero_ps, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_storeu_ps, crate::backend::cpu::attention::decode::widen256, __m128i, _mm_loadu_si128);

/// Ask L2 for bytes `off..off + len` of the block at `next` (nothing if null): the lines a
/// decode kernel's row of the next block covers.
#[inline(always)]
fn prefetch_row(next: *const u8, off: usize, len: usize) {
    if !next.is_null() {
        prefetch_l2(next.wrapping_add(off), len);
    }
}

#[inline]
pub fn softmax_inplace(x: &mut [f32]) {
    let m = crate::backend::cpu::simd::max(x);
    let inv = 1.0 / crate::backend::cpu::simd::exp_sub_sum(x, m);
    for v in x.iter_mut() {
        *v *= inv;
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
    use crate::backend::cpu::attention::tiled::T;
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
    use super::*;

    /// The decode kernels give the same bits on every path (AVX-512, AVX2, one key or column at a
    /// time), for both element types: what makes a run's numbers independent of the CPU's vector
    /// width. Pages of 64 and 24 keys, heads 1–4 of a group, head sizes 64 and 40.
    #[test]
    fn decode_kernels_agree_bit_for_bit_across_paths() {
        fn check<T: KvElem>(group: usize, hd: usize, ps: usize, nt: usize) {
            let mut st = 99u64;
            let mut rnd = || {
                st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((st >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            };
            let q: Vec<f32> = (0..group * hd).map(|_| rnd()).collect();
            let kt: Vec<T> = (0..hd * ps).map(|_| T::round(rnd())).collect();
            let vals: Vec<T> = (0..nt * hd).map(|_| T::round(rnd())).collect();
            let visible = nt + 5;
            let p: Vec<f32> = (0..group * visible).map(|_| rnd().abs()).collect();
            let run_scores = |path: usize| {
                let mut out = vec![f32::NAN; group * visible];
                let sc = Scores { q: &q, group, hd, scale: 0.125, out: &mut out, visible, t0: 3, next: std::ptr::null() };
                match path {
                    // Safety: the features are checked before these paths run.
                    0 => unsafe { x512::scores(sc, &kt, ps, nt) },
                    1 => unsafe { x256::scores(sc, &kt, ps, nt) },
                    _ => scores_keys(sc, &kt, ps, 0, nt),
                }
                out
            };
            let run_values = |path: usize| {
                let mut out: Vec<f32> = (0..group * hd).map(|i| i as f32 * 0.01).collect();
                match path {
                    // Safety: as above.
                    0 => unsafe { x512::values(&p[2..], visible, &vals, group, hd, &mut out, std::ptr::null()) },
                    1 => unsafe { x256::values(&p[2..], visible, &vals, group, hd, &mut out, std::ptr::null()) },
                    _ => values_cols(&p[2..], visible, &vals, group, hd, 0, &mut out),
                }
                out
            };
            let (s_ref, v_ref) = (run_scores(2), run_values(2));
            assert!(s_ref[3..3 + nt].iter().all(|x| x.is_finite()));
            let paths = [crate::backend::cpu::simd::has_avx512f(), crate::backend::cpu::simd::has_avx2_fma()];
            for (path, _) in paths.iter().enumerate().filter(|(_, &has)| has) {
                let (s, v) = (run_scores(path), run_values(path));
                let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same(&s, &s_ref), "scores, path {path}, group {group}, hd {hd}, page {ps}, {nt} keys");
                assert!(same(&v, &v_ref), "values, path {path}, group {group}, hd {hd}, page {ps}, {nt} keys");
            }
        }
        for (group, hd, ps, nt) in [(3, 64, 64, 64), (3, 64, 64, 37), (4, 40, 24, 24), (1, 64, 24, 7), (2, 40, 64, 50)] {
            check::<f32>(group, hd, ps, nt);
            check::<u16>(group, hd, ps, nt);
        }
    }
}
