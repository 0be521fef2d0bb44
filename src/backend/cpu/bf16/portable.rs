//! `Tile`, the call every microkernel takes, and the portable steps (`Kernel::Portable`, a tiny
//! strip of the AVX2 kernel, a CPU without AVX2): the reference the other kernels are tested
//! against.
//!
//! The same driver and packed data; each pair row of a panel is widened to f32 (denormals to zero)
//! and the same two FMAs per pair run in f32 lanes, the flush as a compare-and-select. One case
//! needs more: `vdpbf16ps` calls a result denormal after rounding it to 24 bits with an unbounded
//! exponent, so an exact sum in (2⁻¹²⁶ − 2⁻¹⁵⁰, 2⁻¹²⁶ − 2⁻¹⁵¹] is flushed though an f32 FMA rounds
//! it up to 2⁻¹²⁶ (measured). When a lane's FMA gives exactly ±2⁻¹²⁶, the panel is redone with an
//! exact step in f64: the bf16 product is exact there, and either the sum is exact too (≤ 53
//! significant bits) or the smaller operand is under 2⁻²⁸ of the larger, an f32 value that both
//! the exact and the f64 sum then round to. The results are the native bits (checked on random
//! data, tiny data, random bit patterns), NaN payloads aside (which NaN propagates is not
//! reproduced; where NaNs appear is).
use super::pack::{bf16_daz, MR, NR};

/// One microkernel call: `rows` ≤ MR rows of converted A against 1, 2 or 4 panels.
pub(super) struct Tile {
    /// pair words, row stride `lda` (`wide`: two f32 words per pair)
    pub(super) a: *const u32,
    pub(super) lda: usize,
    /// A as f32 values (the AVX2 kernel's layout) rather than pair words
    pub(super) wide: bool,
    /// plain FMAs are not the native steps here (`plain_fma_exact`): the AVX2 kernel takes the
    /// portable steps
    pub(super) exact: bool,
    /// first panel (pair-major rows of NR words); panel p at `b + p·pstride`
    pub(super) b: *const u32,
    pub(super) pstride: usize,
    pub(super) kb: usize,
    pub(super) c: *mut f32,
    pub(super) ldc: usize,
    /// valid columns from `c` on (may exceed the panels of this call)
    pub(super) cols: usize,
    /// store the block's sum (else add it to C)
    pub(super) overwrite: bool,
    /// bias from this tile's first column, added after the last k block; null if none
    pub(super) bias: *const f32,
    /// the task's first strip: its panels come from memory (prefetch them when ≤ 2 streams)
    pub(super) first: bool,
}

impl Tile {
    /// Store one finished accumulator of row r, column `off` (same operations as the native store).
    #[inline(always)]
    pub(super) unsafe fn store(&self, r: usize, off: usize, acc: f32) {
        let c = self.c.add(r * self.ldc + off);
        let mut v = acc;
        if !self.overwrite {
            v += *c; // C + acc: IEEE addition commutes, so the native `C + acc` bits
        }
        if !self.bias.is_null() {
            v += *self.bias.add(off);
        }
        *c = v;
    }

    /// Row r's pair q as (even, odd) bf16 bits, in either layout of A.
    #[inline(always)]
    pub(super) unsafe fn x_pair(&self, r: usize, q: usize) -> (u16, u16) {
        if self.wide {
            let x = self.a.add(r * self.lda + 2 * q);
            ((*x >> 16) as u16, (*x.add(1) >> 16) as u16)
        } else {
            let xw = *self.a.add(r * self.lda + q);
            (xw as u16, (xw >> 16) as u16)
        }
    }

    /// Panel `p` of this call with f32 FMAs: the `vdpbf16ps` steps, see the module doc.
    pub(super) unsafe fn portable(&self, rows: usize, p: usize) {
        let b = self.b.add(p * self.pstride);
        let mut acc = [[0f32; NR]; MR];
        let mut edge = [0u32; NR];
        for q in 0..self.kb {
            let wq = std::slice::from_raw_parts(b.add(q * NR), NR);
            let (mut we, mut wo) = ([0f32; NR], [0f32; NR]);
            for c in 0..NR {
                we[c] = bf16_daz(wq[c] as u16);
                wo[c] = bf16_daz((wq[c] >> 16) as u16);
            }
            for (r, ar) in acc.iter_mut().enumerate().take(rows) {
                let (xe, xo) = self.x_pair(r, q);
                let (xe, xo) = (bf16_daz(xe), bf16_daz(xo));
                for c in 0..NR {
                    let (s, e1) = step_f32(ar[c], xo, wo[c]);
                    let (s, e2) = step_f32(s, xe, we[c]);
                    ar[c] = s;
                    edge[c] |= e1 | e2;
                }
            }
        }
        if edge.iter().any(|&e| e != 0) {
            // a sum landed on ±2⁻¹²⁶: redo the panel with the exact step
            for (r, ar) in acc.iter_mut().enumerate().take(rows) {
                for (c, a) in ar.iter_mut().enumerate() {
                    let mut s = 0f32;
                    for q in 0..self.kb {
                        let ((xe, xo), ww) = (self.x_pair(r, q), *b.add(q * NR + c));
                        s = step_exact(s, bf16_daz(xo), bf16_daz((ww >> 16) as u16));
                        s = step_exact(s, bf16_daz(xe), bf16_daz(ww as u16));
                    }
                    *a = s;
                }
            }
        }
        let cols = self.cols.saturating_sub(p * NR).min(NR);
        for (r, ar) in acc.iter().enumerate().take(rows) {
            for (c, &v) in ar.iter().enumerate().take(cols) {
                self.store(r, p * NR + c, v);
            }
        }
    }
}

/// One `vdpbf16ps` half-step in f32: `acc + x·w` fused, a denormal result flushed to signed zero.
/// The second value is 1 when the sum is exactly ±2⁻¹²⁶ (where the flush decision needs the
/// exact step).
#[inline(always)]
pub(super) fn step_f32(acc: f32, x: f32, w: f32) -> (f32, u32) {
    let s = x.mul_add(w, acc);
    let m = s.abs();
    let edge = (m == f32::MIN_POSITIVE) as u32;
    (if m < f32::MIN_POSITIVE { f32::from_bits(s.to_bits() & 0x8000_0000) } else { s }, edge)
}

/// The half-step exactly: the product of two bf16 is exact in f64 and the f64 sum decides the
/// flush like `vdpbf16ps` (a result whose 24-bit rounding, exponent unbounded, is below 2⁻¹²⁶
/// becomes signed zero). See the module doc for why the f64 rounding cannot change the result.
#[inline]
pub(super) fn step_exact(acc: f32, x: f32, w: f32) -> f32 {
    const TINY: f64 = 1.0 / (1u128 << 126) as f64 - 1.0 / (1u128 << 127) as f64 / (1u64 << 24) as f64;
    let s = acc as f64 + x as f64 * w as f64;
    if s.abs() < TINY {
        f32::from_bits(((s.to_bits() >> 32) as u32) & 0x8000_0000)
    } else {
        s as f32
    }
}
