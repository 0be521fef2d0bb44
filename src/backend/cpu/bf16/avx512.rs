//! The `vdpbf16ps` microkernel (AVX512_BF16): strips of MR = 12 rows against 1, 2 or 4 panels;
//! per pair 2 weight vectors, and per row a 32-bit broadcast and 2 `vdpbf16ps` (12 × 2
//! accumulators + 2 + 1 of the 32 zmm registers: the instruction's latency needs ≥ 12 independent
//! accumulators). Short strips (decode) take 2 or 4 panels per call to keep 8–16 accumulators busy.
//! Also `vdp_product` (operands in the AMX layout, for the bf16 attention and the thin products)
//! and `round16` (`f32_to_bf16_bits` on 16 lanes).
use super::pack::{MR, NR};
use super::portable::Tile;
use std::arch::x86_64::*;

/// 16 f32 → their bf16 bits (low halves), as `f32_to_bf16_bits`.
#[inline(always)]
pub(crate) unsafe fn round16(b: __m512i) -> __m512i {
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))));
    let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff)), _mm512_set1_epi32(0x7f80_0000));
    _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40)))
}

/// The first 16·⌊pairs/16⌋ pair words of `convert_strip`; returns how many it did.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn convert_pairs(src: *const f32, dst: *mut u32, pairs: usize) -> usize {
    let mut q = 0;
    while q + 16 <= pairs {
        let lo = _mm512_cvtepi32_epi16(round16(_mm512_loadu_si512(src.add(2 * q) as *const _)));
        let hi = _mm512_cvtepi32_epi16(round16(_mm512_loadu_si512(src.add(2 * q + 16) as *const _)));
        _mm512_storeu_si512(dst.add(q) as *mut _, _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi));
        q += 16;
    }
    q
}

pub(super) unsafe fn dispatch<const PF: bool>(t: &Tile, rows: usize, p: usize) {
    match (rows, p) {
        (12, _) => kernel::<12, 1, PF>(t),
        (11, _) => kernel::<11, 1, PF>(t),
        (10, _) => kernel::<10, 1, PF>(t),
        (9, _) => kernel::<9, 1, PF>(t),
        (8, _) => kernel::<8, 1, PF>(t),
        (7, _) => kernel::<7, 1, PF>(t),
        (6, _) => kernel::<6, 1, PF>(t),
        (5, _) => kernel::<5, 1, PF>(t),
        (4, 2) => kernel::<4, 2, PF>(t),
        (4, _) => kernel::<4, 1, PF>(t),
        (3, 2) => kernel::<3, 2, PF>(t),
        (3, _) => kernel::<3, 1, PF>(t),
        (2, 4) => kernel::<2, 4, PF>(t),
        (2, 2) => kernel::<2, 2, PF>(t),
        (2, _) => kernel::<2, 1, PF>(t),
        (1, 4) => kernel::<1, 4, PF>(t),
        (1, 2) => kernel::<1, 2, PF>(t),
        (1, _) => kernel::<1, 1, PF>(t),
        _ => unreachable!("tile of {rows} rows × {p} panels"),
    }
}

/// R rows × P panels: R·P·2 accumulators of 16 columns; per pair P·2 weight vectors and R
/// broadcasts of the rows' pairs. PF: prefetch the panels PF_PAIRS pairs ahead into L2.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn kernel<const R: usize, const P: usize, const PF: bool>(t: &Tile) {
    // 6 KiB ahead into L2 (T1): on a Zen 4, 8-row decode products take as long on their
    // vdpbf16ps as on their bytes, and T0 at 4 KiB (tuned on a Zen 5) left the two barely
    // overlapped: 8 rows × 576 × 3072 from DRAM 16 → 21–22 GiB/s on one thread, 24–26 →
    // 30–31 on two; 64 or 96 pairs ahead no better (docs/log/results-log.md, 2026-12-06, Zen 4)
    const PF_PAIRS: usize = 48;
    let mut acc = [[[_mm512_setzero_ps(); 2]; P]; R];
    for q in 0..t.kb {
        let mut bv: [[__m512bh; 2]; P] = std::mem::zeroed();
        for (p, v) in bv.iter_mut().enumerate() {
            let bp = t.b.add(p * t.pstride + q * NR);
            if PF {
                // past the panel's end this is the next panel (or nothing: only a hint)
                _mm_prefetch::<_MM_HINT_T1>(bp.wrapping_add(PF_PAIRS * NR) as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(bp.wrapping_add(PF_PAIRS * NR + 16) as *const i8);
            }
            v[0] = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp as *const _));
            v[1] = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp.add(16) as *const _));
        }
        for (r, ar) in acc.iter_mut().enumerate() {
            let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*t.a.add(r * t.lda + q) as i32));
            for (ap, v) in ar.iter_mut().zip(&bv) {
                ap[0] = _mm512_dpbf16_ps(ap[0], v[0], av);
                ap[1] = _mm512_dpbf16_ps(ap[1], v[1], av);
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        let cr = t.c.add(r * t.ldc);
        for (p, ap) in ar.iter().enumerate() {
            for (h, &a) in ap.iter().enumerate() {
                let off = p * NR + h * 16;
                if off >= t.cols {
                    continue;
                }
                let w = t.cols - off;
                let mask: __mmask16 = if w >= 16 { 0xffff } else { ((1u32 << w) - 1) as u16 };
                let mut v = a;
                if !t.overwrite {
                    v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, cr.add(off)), v);
                }
                if !t.bias.is_null() {
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, t.bias.add(off)));
                }
                _mm512_mask_storeu_ps(cr.add(off), mask, v);
            }
        }
    }
}

/// `C = A · B` on the `vdpbf16ps` kernel, for operands in the AMX layout (`attention::tiled`): A's
/// first `m` rows of `pairs` pair words (row stride `lda`), `panels` panels of B (`pstride` words
/// apart, `[pairs][NR]` each), C's `m` × `panels·NR` block stored (row stride `ldc`; its rows
/// past `m` untouched), or with `add` added to C (`C += A · B`). One k block from +0, so each element is the kernel's pair sequence over
/// `pairs` (`bf16/mod.rs`), whatever `m` and its row's place in it. Strips of MR rows under one panel at a time (the
/// panel stays in L1 while the strips pass).
///
/// # Safety
/// AVX512_BF16 present; the extents are inside the caller's buffers.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn vdp_product(a: *const u32, lda: usize, m: usize, b: *const u32, pstride: usize, panels: usize, pairs: usize, c: *mut f32, ldc: usize, add: bool) {
    for p in 0..panels {
        let mut i = 0;
        while i < m {
            let rows = MR.min(m - i);
            let t = Tile {
                a: a.add(i * lda),
                lda,
                wide: false,
                exact: false,
                b: b.add(p * pstride),
                pstride,
                kb: pairs,
                c: c.add(i * ldc + p * NR),
                ldc,
                cols: NR,
                overwrite: !add,
                bias: std::ptr::null(),
                first: false,
            };
            dispatch::<false>(&t, rows, 1);
            i += rows;
        }
    }
}
