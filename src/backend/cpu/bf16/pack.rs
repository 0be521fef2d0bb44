//! W packed for the kernels (`PackedBf16`, made once at load), and the f32 → bf16 rounding.
//!
//! W is `[n, k]` row-major (HF: `y = x Wᵀ`). Its rows (the output columns) are cut into panels of
//! NR = 32 and k into pairs (k odd: the last pair's second element is a zero pad). The word for
//! (pair q, column j) holds `W[j][2q]` in its low and `W[j][2q+1]` in its high half: what one f32
//! lane of `vdpbf16ps` multiplies with a broadcast pair of x. k is cut into blocks
//! (`k_block_pairs`, a function of k only) and storage is block-major: `[block][panel][pair of the
//! block][32 columns]`, so one k block of a run of panels is one contiguous stretch (decode streams
//! it front to back); 64-byte aligned, on 2 MiB pages (placed back to back with the model's other
//! matrices: `arena`). 2·n·k bytes plus padding: no second copy (`dy · W` repacks, see `gemm`).
use crate::backend::cpu::arena::Lines;
use crate::backend::cpu::par::SendPtr;
use half::bf16;
use rayon::prelude::*;

/// Output columns per packed panel: two 16-lane f32 accumulators per row.
pub const NR: usize = 32;
/// Rows per microkernel strip.
pub const MR: usize = 12;
/// Rows per strip of the AMX kernel: two 16-row A tiles.
pub(super) const AMX_MR: usize = 32;
/// Words from one 16-pair step of a strip to the next in the AMX kernel's A (`convert_tiles`).
pub(super) const TILE_STEP: usize = AMX_MR * 16;
/// Reductions of up to this many pairs are one k block (a 12-row strip is then ≤ 15 KiB).
pub(super) const KC_ONE: usize = 320;
/// Longer reductions are cut into equal blocks of at most this many pairs.
pub(super) const KC_MAX: usize = 256;

/// Pairs per k block for a reduction of `pairs` pairs: a function of the length only (part of the
/// summation order, see `bf16/mod.rs`).
pub fn k_block_pairs(pairs: usize) -> usize {
    if pairs <= KC_ONE {
        pairs.max(1)
    } else {
        pairs.div_ceil(pairs.div_ceil(KC_MAX))
    }
}

/// f32 → bf16 bits, round to nearest even; NaN stays NaN (quieted). The bits of
/// `half::bf16::from_f32` (denormals rounded, not flushed), written without branches so that
/// loops over it vectorize.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    (if b & 0x7fff_ffff > 0x7f80_0000 { nan } else { rounded }) as u16
}

/// `f32_to_bf16_bits` as a `half::bf16`.
pub fn f32_to_bf16(x: f32) -> bf16 {
    bf16::from_bits(f32_to_bf16_bits(x))
}

/// A bf16 as the kernel reads it: its f32 value, denormals as signed zero.
#[inline(always)]
pub(super) fn bf16_daz(h: u16) -> f32 {
    let b = (h as u32) << 16;
    f32::from_bits(if b & 0x7f80_0000 == 0 { b & 0x8000_0000 } else { b })
}

/// When the AVX2 kernel's plain FMAs give the `vdpbf16ps` bits, from the smallest biased
/// exponent of the nonzero values on each side (`min_exp`: 0 for a bf16 denormal, 255 for none).
/// A nonzero bf16 of biased exponent e (8 significant bits) is a multiple of 2^(e − 134), so with
/// e_x + e_w ≥ 142 every product is an exact multiple of 2⁻¹²⁶, and so is every partial sum: +0
/// is, and an FMA's rounded result of a multiple of 2⁻¹²⁶ either is that multiple (below 2⁻¹⁰²,
/// where 24 bits hold it exactly) or lies on a grid coarser than 2⁻¹²⁶. A nonzero multiple of
/// 2⁻¹²⁶ is a normal f32, so no sum is ever flushed (nor, with no denormal operand, read as zero),
/// and the FMA's rounding is `vdpbf16ps`'s. E.g. weights ≥ 2⁻²⁰ allow activations ≥ 2⁻⁹²: a
/// strip outside that (a bf16 denormal, softmax numerators far below the row's maximum) takes the
/// portable steps.
#[inline(always)]
pub(super) fn plain_fma_exact(ex: u8, ew: u8) -> bool {
    ex >= 1 && ew >= 1 && ex as u16 + ew as u16 >= 142
}

/// The biased exponent of a bf16 for `plain_fma_exact`: 255 for ±0 (no constraint), 0 for a
/// denormal.
#[inline(always)]
pub(super) fn bf16_exp(h: u16) -> u8 {
    if h & 0x7fff == 0 {
        255
    } else {
        ((h >> 7) & 0xff) as u8
    }
}

/// A `[n, k]` row-major weight rounded to bf16 and packed for the kernels (see this module's doc).
pub struct PackedBf16 {
    pub(super) n: usize,
    pub(super) k: usize,
    /// ⌈k/2⌉
    pub(super) pairs: usize,
    /// pairs per k block (`k_block_pairs(pairs)`)
    pub(super) kc: usize,
    /// ⌈n/NR⌉
    pub(super) panels: usize,
    pub(super) data: Lines,
    /// the smallest `bf16_exp` of the weights (see `plain_fma_exact`)
    pub(super) min_exp: u8,
}

impl PackedBf16 {
    /// Round `w` (`[n, k]` row-major f32) to bf16 and pack it.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Self {
        assert!(w.len() >= n * k, "PackedBf16::from_f32: {} values for [{n}, {k}]", w.len());
        Self::pack(n, k, |j, p| f32_to_bf16_bits(w[j * k + p]))
    }

    /// Pack an already-bf16 `[n, k]` row-major weight (a bf16 checkpoint: no rounding).
    pub fn from_bf16(w: &[bf16], n: usize, k: usize) -> Self {
        assert!(w.len() >= n * k, "PackedBf16::from_bf16: {} values for [{n}, {k}]", w.len());
        Self::pack(n, k, |j, p| w[j * k + p].to_bits())
    }

    pub(super) fn pack(n: usize, k: usize, get: impl Fn(usize, usize) -> u16 + Sync) -> Self {
        let pairs = k.div_ceil(2);
        let kc = k_block_pairs(pairs);
        let panels = n.div_ceil(NR);
        let mut data = Lines::zeroed(panels * pairs * NR / 16);
        let mut me = PackedBf16 { n, k, pairs, kc, panels, data: Lines::empty(), min_exp: 255 };
        let dst = SendPtr(data.as_mut_ptr() as *mut u32);
        let fill = |pn: usize| {
            for b in 0..me.blocks() {
                let (q0, kb) = me.block(b);
                // Safety: panel pn of block b is the disjoint range [off, off + kb·NR) of data.
                let d = unsafe { dst.get().add(me.block_off(b) + pn * kb * NR) };
                for q in 0..kb {
                    for c in 0..NR {
                        let (j, p) = (pn * NR + c, 2 * (q0 + q));
                        let lo = if j < n { get(j, p) } else { 0 };
                        let hi = if j < n && p + 1 < k { get(j, p + 1) } else { 0 };
                        unsafe { *d.add(q * NR + c) = lo as u32 | (hi as u32) << 16 };
                    }
                }
            }
        };
        if n * k >= 1 << 16 {
            (0..panels).into_par_iter().for_each(fill);
        } else {
            (0..panels).for_each(fill);
        }
        me.min_exp = data.iter().flat_map(|l| l.0).map(|w| bf16_exp(w as u16).min(bf16_exp((w >> 16) as u16))).min().unwrap_or(255);
        me.data = data;
        me
    }

    pub fn n(&self) -> usize {
        self.n
    }
    pub fn k(&self) -> usize {
        self.k
    }
    /// Bytes of packed storage (≈ 2·n·k plus the padding of the last panel and of an odd k).
    pub fn bytes(&self) -> usize {
        self.data.len() * 64
    }

    pub(super) fn blocks(&self) -> usize {
        self.pairs.div_ceil(self.kc)
    }
    /// (first pair, pairs) of k block `b`.
    pub(super) fn block(&self, b: usize) -> (usize, usize) {
        let q0 = b * self.kc;
        (q0, self.kc.min(self.pairs - q0))
    }
    /// Word offset of k block `b` (every earlier block is full).
    pub(super) fn block_off(&self, b: usize) -> usize {
        b * self.kc * self.panels * NR
    }
    pub(super) fn words(&self) -> *const u32 {
        self.data.as_ptr() as *const u32
    }
    /// Panel `pn` of k block `b` (`pn` up to `panels`: one past a block's last panel is where the
    /// next block starts).
    pub(super) fn panel(&self, b: usize, pn: usize) -> *const u32 {
        debug_assert!(b < self.blocks() && pn <= self.panels);
        // Safety: inside the packed data, or one past its end
        unsafe { self.words().add(self.block_off(b) + pn * self.block(b).1 * NR) }
    }
    /// The word holding `W[j][2q]`, `W[j][2q+1]`.
    pub(super) fn word(&self, j: usize, q: usize) -> u32 {
        let b = q / self.kc;
        let (q0, kb) = self.block(b);
        let i = self.block_off(b) + (j / NR) * kb * NR + (q - q0) * NR + j % NR;
        self.data[i / 16].0[i % 16]
    }

    /// `W[j][p]` as stored.
    pub fn get(&self, j: usize, p: usize) -> bf16 {
        assert!(j < self.n && p < self.k);
        bf16::from_bits((self.word(j, p / 2) >> (16 * (p % 2))) as u16)
    }

    /// The stored weight unpacked to `[n, k]` row-major f32 (exact: every bf16 is an f32).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.n * self.k];
        for j in 0..self.n {
            for q in 0..self.pairs {
                let word = self.word(j, q);
                w[j * self.k + 2 * q] = f32::from_bits(word << 16);
                if 2 * q + 1 < self.k {
                    w[j * self.k + 2 * q + 1] = f32::from_bits(word & 0xffff_0000);
                }
            }
        }
        w
    }
}
