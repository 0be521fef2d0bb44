//! The thin products of LoRA: every one has a side of the rank r (8–64), where a packed GEMM
//! would spend more on packing than on the product. `product` is the unpacked f32 kernel
//! (AVX-512, or its AVX2 twin): `C (+)= α·A·B` with B's rows contiguous and A read by broadcasts at
//! any strides. Under `--dtype bf16`, `products_bf` takes bf16 operands and sums in f32 (below).
use super::kernel::{amx_available, vdp_available};
use super::pack::f32_to_bf16_bits;
use crate::backend::cpu::arena::Line;
use std::cell::RefCell;
use std::sync::OnceLock;

// ---- bf16 operands (`--dtype bf16`) ----
//
// Under `--dtype bf16` every LoRA product rounds its operands to bf16 (x, dy, A, B, u, du) and
// sums in f32: the policy of the CUDA backend, whose LoRA GEMMs read the bf16 shadows of A and B
// and round u and du to bf16 (`src/backend/cuda/gemm.rs`). The masters, gradients and AdamW
// moments stay f32. On AMX the products run on tiles (`tdpbf16ps`); in f32 they took ~18 % of a
// bf16 training step on a 2-core Xeon, at a sixteenth of the tiles' rate. Without AMX they run on
// `vdpbf16ps` with the same operands, and without AVX512_BF16 `product` on the rounded values
// (exact products, one f32 FMA chain per element).

/// `buf` holding at least `words` words (grown only; the contents are the caller's to write).
pub(super) fn reserve(buf: &mut Vec<Line>, words: usize) -> *mut u32 {
    if buf.len() * 16 < words {
        buf.resize(words.div_ceil(16), Line([0; 16]));
    }
    buf.as_mut_ptr() as *mut u32
}

thread_local! {
    /// The calling thread's A operand of `product_bf`: pair words (AMX, `vdpbf16ps`), else the
    /// rounded values as f32 (reused across calls).
    static A_WORDS: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// The right operand `B [kk, n]` of a bf16 LoRA product, rounded once. With AMX or AVX512_BF16
/// (`panels`): panels of 32 columns, each `pairs` pair rows of 32 words, `bf(B[2q, j]) |
/// bf(B[2q+1, j]) << 16` (`pairs` = ⌈kk/2⌉ up to a multiple of 16; zero past kk and n): the tile
/// and `vdpbf16ps` kernels' B operand, as `cpu::bf16`'s packed panels. Without: the rounded
/// values as f32 `[kk, n]`.
pub(crate) struct BfB {
    pub(crate) kk: usize,
    pub(crate) n: usize,
    pub(crate) pairs: usize,
    pub(crate) panels: bool,
    pub(crate) data: Vec<Line>,
}

/// Whether the bf16 LoRA products run on pair words (AMX tiles, else `vdpbf16ps`, as the GEMM's
/// `Kernel::Auto` and the bf16 attention choose) rather than the f32 kernel on rounded values.
pub(super) fn pair_words() -> bool {
    amx_available() || vdp_available()
}

impl BfB {
    pub(crate) fn empty() -> BfB {
        BfB { kk: 0, n: 0, pairs: 0, panels: pair_words(), data: Vec::new() }
    }

    /// # Safety
    /// `b` covers `kk` rows `ldb` apart of `n` columns.
    pub(crate) unsafe fn new(b: *const f32, ldb: usize, kk: usize, n: usize) -> BfB {
        let mut o = BfB::empty();
        o.fill(b, ldb, kk, n);
        o
    }

    /// This operand made from another B, in the same storage (a block's rows, block after block).
    ///
    /// # Safety
    /// As `new`.
    pub(crate) unsafe fn fill(&mut self, b: *const f32, ldb: usize, kk: usize, n: usize) {
        (self.kk, self.n, self.pairs) = (kk, n, kk.div_ceil(2).next_multiple_of(16));
        if !self.panels {
            let d = reserve(&mut self.data, kk * n);
            for l in 0..kk {
                for j in 0..n {
                    *d.add(l * n + j) = (f32_to_bf16_bits(*b.add(l * ldb + j)) as u32) << 16;
                }
            }
            return;
        }
        let d = reserve(&mut self.data, n.div_ceil(32) * self.pairs * 32);
        #[cfg(target_arch = "x86_64")]
        x512::b_panels(b, ldb, kk, n, self.pairs, d);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (b, ldb, d);
    }

    fn words(&self) -> *const u32 {
        self.data.as_ptr() as *const u32
    }

    /// Columns.
    pub(crate) fn n(&self) -> usize {
        self.n
    }
}

/// One output of `products_bf`: `C[·, j1 − j0]` from columns `j0..j1` of `b`, rows `ldc` apart.
pub(crate) struct Out<'b> {
    pub b: &'b BfB,
    pub j0: usize,
    pub j1: usize,
    pub c: *mut f32,
    pub ldc: usize,
}

/// `C[m, j1 − j0] (+)= alpha · bf(A)[m, kk] · B[kk, j0..j1]` with f32 sums; A's element (i, l)
/// at `a[i·a_rs + l·a_cs]` (row-major `a_cs = 1` is converted by vectors), C's row i at
/// `c[i·ldc..]`. On AMX each element is its `tdpbf16ps` sequence over all of B's pairs (one
/// block), elsewhere its `vdpbf16ps` or FMA chain: it depends on neither m nor the other rows or
/// columns, so a batch gives its rows' bits one by one. `configured`: the caller holds the tiles
/// (a GEMM task, `Tiles`; ignored without AMX); otherwise they are configured and released here.
///
/// # Safety
/// The pointers cover those extents; `c` does not alias A or B; `j0 ≤ j1 ≤ b.n`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product_bf(m: usize, a: *const f32, a_rs: usize, a_cs: usize, b: &BfB, j0: usize, j1: usize, c: *mut f32, ldc: usize, alpha: f32, accumulate: bool, configured: bool) {
    products_bf(m, a, a_rs, a_cs, &[Out { b, j0, j1, c, ldc }], alpha, accumulate, configured)
}

/// `product_bf` into several outputs from one A (their B of one kk), A converted once.
///
/// # Safety
/// As `product_bf`, for every output.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn products_bf(m: usize, a: *const f32, a_rs: usize, a_cs: usize, outs: &[Out], alpha: f32, accumulate: bool, configured: bool) {
    let Some(kk) = outs.first().map(|o| o.b.kk) else { return };
    assert!(outs.iter().all(|o| o.b.kk == kk && o.j0 <= o.j1 && o.j1 <= o.b.n), "products_bf: outputs of another reduction or beyond their B");
    if m == 0 {
        return;
    }
    if kk == 0 {
        for o in outs.iter().filter(|_| !accumulate) {
            (0..m).for_each(|i| std::slice::from_raw_parts_mut(o.c.add(i * o.ldc), o.j1 - o.j0).fill(0.0));
        }
        return;
    }
    A_WORDS.with(|buf| {
        let mut buf = buf.borrow_mut();
        if !outs[0].b.panels {
            // the rounded values as f32 [m, kk], then the f32 kernel (bf16 × bf16 is exact in f32)
            let ar = reserve(&mut buf, m * kk) as *mut f32;
            let round = |x: f32| f32::from_bits((f32_to_bf16_bits(x) as u32) << 16);
            for i in 0..m {
                let dst = std::slice::from_raw_parts_mut(ar.add(i * kk), kk);
                if a_cs == 1 {
                    // contiguous, so the loop vectorizes (the strided one rounded ~2.5 G values a
                    // training step one by one)
                    dst.iter_mut().zip(std::slice::from_raw_parts(a.add(i * a_rs), kk)).for_each(|(o, &x)| *o = round(x));
                } else {
                    dst.iter_mut().enumerate().for_each(|(l, o)| *o = round(*a.add(i * a_rs + l * a_cs)));
                }
            }
            for o in outs {
                product(m, o.j1 - o.j0, kk, ar, kk, 1, (o.b.words() as *const f32).add(o.j0), o.b.n, o.c, o.ldc, alpha, accumulate);
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        pair_products(m, a, a_rs, a_cs, outs, alpha, accumulate, configured, &mut buf);
    })
}

/// `products_bf` on pair words (A converted into `buf`): per 32-row strip and 32-column panel,
/// the block's sums on AMX tiles, else on the `vdpbf16ps` kernel (`bf16::avx512::vdp_product`, or
/// `vdp_half` for a half panel: the strip's rows and B's pairs only), then scaled into C. Without
/// AMX this replaced the f32 kernel after a scalar rounding pass, which had cost a `vdpbf16ps`
/// training step ~5 %.
///
/// # Safety
/// As `products_bf`; AMX or AVX512_BF16 is available (`pair_words`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pair_products(m: usize, a: *const f32, a_rs: usize, a_cs: usize, outs: &[Out], alpha: f32, accumulate: bool, configured: bool, buf: &mut Vec<Line>) {
    use super::amx;
    use super::avx512::vdp_product;
    let kk = outs[0].b.kk;
    let tiles = amx_available();
    // A as pair words, rows of `pairs`, whole strips of 32 rows (zero past m and kk)
    let pairs = outs[0].b.pairs;
    let d = reserve(buf, m.next_multiple_of(32) * pairs);
    if a_cs == 1 {
        x512::a_rows(a, a_rs, m, kk, pairs, d);
    } else {
        // a column-major A (duᵀ, uᵀ: r × a block's rows) is small
        std::slice::from_raw_parts_mut(d, m.next_multiple_of(32) * pairs).fill(0);
        for i in 0..m {
            for l in 0..kk {
                *d.add(i * pairs + l / 2) |= (f32_to_bf16_bits(*a.add(i * a_rs + l * a_cs)) as u32) << (16 * (l % 2));
            }
        }
    }
    if tiles && !configured {
        amx::configure();
    }
    let mut sums = amx::Sums([0f32; 32 * 32]);
    for s in (0..m).step_by(32) {
        let rows = (m - s).min(32);
        for o in outs {
            let (j0, j1) = (o.j0, o.j1);
            for p in j0 / 32..j1.div_ceil(32) {
                let (sa, sb) = (d.add(s * pairs), o.b.words().add(p * pairs * 32));
                let (lo, hi) = (j0.max(32 * p), j1.min(32 * p + 32));
                if tiles {
                    amx::block_to(sa, pairs, 16, sb, pairs, sums.0.as_mut_ptr(), 32);
                } else {
                    // only the pairs that hold values (tiles take whole 16-pair steps), and only
                    // the half panel a rank-16 side needs
                    let (kb, h) = (kk.div_ceil(2), (lo - 32 * p) / 16);
                    if h == (hi - 1 - 32 * p) / 16 {
                        x512::vdp_half(sa, pairs, rows, sb.add(16 * h), kb, sums.0.as_mut_ptr().add(16 * h), 32);
                    } else {
                        vdp_product(sa, pairs, rows, sb, pairs * 32, 1, kb, sums.0.as_mut_ptr(), 32, false);
                    }
                }
                for r in 0..rows {
                    let out = std::slice::from_raw_parts_mut(o.c.add((s + r) * o.ldc + lo - j0), hi - lo);
                    let sr = &sums.0[r * 32 + lo - 32 * p..r * 32 + hi - 32 * p];
                    if accumulate {
                        out.iter_mut().zip(sr).for_each(|(o, &v)| *o += alpha * v);
                    } else {
                        out.iter_mut().zip(sr).for_each(|(o, &v)| *o = alpha * v);
                    }
                }
            }
        }
    }
    if tiles && !configured {
        amx::release();
    }
}

/// bf16 copies of an f32 matrix `M [rows, cols]` (a LoRA A or B) as the right operand of its
/// products: `t` = Mᵀ (`u = x Aᵀ`, `y += u Bᵀ`), `n` = M (`du = dy B`, `dx += du A`). Made on
/// first use, kept in the parameter's `CpuBuf` and dropped on any write to it (`deref_mut`):
/// the CPU twin of CUDA's bf16 shadow of each LoRA master, so a decode step does not round A and
/// B again for every layer and pair.
#[derive(Default)]
pub struct Shadow {
    pub(crate) t: OnceLock<BfB>,
    pub(crate) n: OnceLock<BfB>,
}

/// A bf16 operand kept in a `Shadow` or made for one call.
pub(crate) enum Op<'a> {
    Kept(&'a BfB),
    Made(BfB),
}

impl std::ops::Deref for Op<'_> {
    type Target = BfB;
    fn deref(&self) -> &BfB {
        match self {
            Op::Kept(b) => b,
            Op::Made(b) => b,
        }
    }
}

/// The operand `[kk, n]` from `cell` (made there on first use), or made now (no cell, or the
/// cell holds another shape).
pub(crate) fn op<'a>(cell: Option<&'a OnceLock<BfB>>, kk: usize, n: usize, make: impl Fn() -> BfB) -> Op<'a> {
    if let Some(c) = cell {
        let b = c.get_or_init(&make);
        if (b.kk, b.n) == (kk, n) {
            return Op::Kept(b);
        }
    }
    Op::Made(make())
}

/// The bf16 operands' conversions (AVX512F/BW, which AMX implies).
#[cfg(target_arch = "x86_64")]
mod x512 {
    use crate::backend::cpu::bf16::avx512::round16;
    use std::arch::x86_64::*;

    fn mask(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as u16
        }
    }

    /// `BfB`'s panels of `B [kk, n]` (rows `ldb` apart) at `dst`: `n.div_ceil(32)` panels of
    /// `pairs` pair rows × 32 words, zero past kk and n.
    ///
    /// # Safety
    /// AVX512F/BW; the extents.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn b_panels(b: *const f32, ldb: usize, kk: usize, n: usize, pairs: usize, dst: *mut u32) {
        let panels = n.div_ceil(32);
        for p in 0..panels {
            let dp = dst.add(p * pairs * 32);
            let (k0, k1) = (mask(n - 32 * p), mask((n - 32 * p).saturating_sub(16)));
            for q in 0..pairs {
                let (lo, hi) = if 2 * q + 1 < kk {
                    let (r0, r1) = (b.add(2 * q * ldb + 32 * p) as *const i32, b.add((2 * q + 1) * ldb + 32 * p) as *const i32);
                    (
                        [round16(_mm512_maskz_loadu_epi32(k0, r0)), round16(_mm512_maskz_loadu_epi32(k1, r0.add(16)))],
                        [round16(_mm512_maskz_loadu_epi32(k0, r1)), round16(_mm512_maskz_loadu_epi32(k1, r1.add(16)))],
                    )
                } else if 2 * q < kk {
                    let r0 = b.add(2 * q * ldb + 32 * p) as *const i32;
                    ([round16(_mm512_maskz_loadu_epi32(k0, r0)), round16(_mm512_maskz_loadu_epi32(k1, r0.add(16)))], [_mm512_setzero_si512(); 2])
                } else {
                    ([_mm512_setzero_si512(); 2], [_mm512_setzero_si512(); 2])
                };
                for v in 0..2 {
                    _mm512_store_si512(dp.add(q * 32 + 16 * v) as *mut _, _mm512_or_si512(lo[v], _mm512_slli_epi32::<16>(hi[v])));
                }
            }
        }
    }

    /// Rows `0..m` of a row-major A (`a_rs` apart, `kk` values) as pair words at `dst`, rows of
    /// `pairs` words (zero past kk), then zero rows up to a multiple of 32.
    ///
    /// # Safety
    /// AVX512F/BW; the extents.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn a_rows(a: *const f32, a_rs: usize, m: usize, kk: usize, pairs: usize, dst: *mut u32) {
        for i in 0..m {
            let (src, d) = (a.add(i * a_rs) as *const i32, dst.add(i * pairs));
            for g in 0..pairs / 16 {
                let l0 = 32 * g;
                let (k0, k1) = (mask(kk.saturating_sub(l0)), mask(kk.saturating_sub(l0 + 16)));
                let lo = _mm512_cvtepi32_epi16(round16(_mm512_maskz_loadu_epi32(k0, src.add(l0))));
                let hi = _mm512_cvtepi32_epi16(round16(_mm512_maskz_loadu_epi32(k1, src.add(l0 + 16))));
                _mm512_storeu_si512(d.add(16 * g) as *mut _, _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi));
            }
        }
        std::slice::from_raw_parts_mut(dst.add(m * pairs), (m.next_multiple_of(32) - m) * pairs).fill(0);
    }

    /// `C[m, 16] = A · B` on `vdpbf16ps` for half a panel: A's rows of pair words (`lda` apart;
    /// rows up to the next multiple of 8 readable), `kb` pair rows of B's 16 words (a panel's
    /// rows, 32 words apart), C's `m` rows `ldc` apart. Each element is `bf16::avx512::vdp_product`'s
    /// chain (from +0, pair after pair), so the bits of the whole panel's product; a rank-16
    /// operand fills only half of a 32-column panel, which the whole-panel kernel computes anyway.
    ///
    /// # Safety
    /// AVX512_BF16; the extents.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn vdp_half(a: *const u32, lda: usize, m: usize, b: *const u32, kb: usize, c: *mut f32, ldc: usize) {
        const R: usize = 8;
        for i in (0..m).step_by(R) {
            let mut acc = [_mm512_setzero_ps(); R];
            for q in 0..kb {
                let bv: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * 32) as *const _));
                for (r, s) in acc.iter_mut().enumerate() {
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add((i + r) * lda + q) as i32));
                    *s = _mm512_dpbf16_ps(*s, bv, av);
                }
            }
            for (r, s) in acc.iter().enumerate().take(m - i) {
                _mm512_storeu_ps(c.add((i + r) * ldc), *s);
            }
        }
    }
}

/// `C[m, n] (+)= alpha · A[m, kk] · B[kk, n]`, serial: A's element (i, l) at `a[i·a_rs + l·a_cs]`,
/// B's row l at `b[l·ldb..]` (contiguous), C's row i at `c[i·ldc..]`. Each C element is one
/// FMA chain over l in order, whatever m and n.
///
/// # Safety
/// The pointers must cover those extents; `c` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product(m: usize, n: usize, kk: usize, a: *const f32, a_rs: usize, a_cs: usize, b: *const f32, ldb: usize, c: *mut f32, ldc: usize, alpha: f32, accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let p = Prod { kk, a, a_rs, a_cs, b, ldb, c, ldc, alpha, accumulate };
        if crate::backend::cpu::simd::has_avx512f() {
            return avx512::product(m, n, p);
        }
        if crate::backend::cpu::simd::has_avx2_fma() {
            return avx2::product(m, n, p);
        }
    }
    portable(m, n, kk, a, a_rs, a_cs, b, ldb, c, ldc, alpha, accumulate)
}

/// `product` without AVX-512 or AVX2: the same sums in the same order, so the same bits (one
/// FMA chain per element in l order; the compiler vectorizes the loop over a row's columns).
///
/// # Safety
/// As `product`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn portable(m: usize, n: usize, kk: usize, a: *const f32, a_rs: usize, a_cs: usize, b: *const f32, ldb: usize, c: *mut f32, ldc: usize, alpha: f32, accumulate: bool) {
    let mut acc = vec![0f32; n];
    for i in 0..m {
        acc.fill(0.0);
        for l in 0..kk {
            let ail = *a.add(i * a_rs + l * a_cs);
            let bl = std::slice::from_raw_parts(b.add(l * ldb), n);
            for (s, &bv) in acc.iter_mut().zip(bl) {
                *s = ail.mul_add(bv, *s);
            }
        }
        let ci = std::slice::from_raw_parts_mut(c.add(i * ldc), n);
        for (o, &s) in ci.iter_mut().zip(&acc) {
            *o = if accumulate { *o + alpha * s } else { alpha * s };
        }
    }
}

/// One product's operands (see `product`), for the vector kernels.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Prod {
    kk: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    accumulate: bool,
}

/// The tile kernel for one vector width (`avx512`: 16 lanes; `avx2`, for Zen 2/3 and Intel client
/// cores: 8). Column strips of up to `vmax` vectors; in each, tiles of as many rows as keep the
/// accumulators in registers (`rmax[v - 1]` rows of v vectors, plus v B vectors and a broadcast:
/// AVX-512 12 × 1, 8 × 2, 8 × 3, 6 × 4 of 32 registers; AVX2 12 × 1, 6 × 2, 4 × 3 of 16). Each
/// element is one FMA chain in l order on either width, so both give the portable loop's bits.
/// (Without a vector kernel the portable loop keeps each row's sums in memory, a load and a store
/// per FMA: ~17 GFLOP/s, a quarter of a training step on a Zen 3.)
#[cfg(target_arch = "x86_64")]
macro_rules! product_kernels {
    (
        $m:ident, $feat:literal, $vec:ty, $lanes:literal, $mask:ty, vmax $vmax:literal, rmax $rmax:expr,
        full $full:expr, tail |$cnt:ident| $tail:expr, load |$lp:ident, $lm:ident| $load:expr, store |$sp:ident, $sm:ident, $sv:ident| $store:expr,
        $zero:ident, $set1:ident, $fma:ident, $mul:ident, $add:ident, tiles { $($nv:literal: $($r:literal)*;)* }
    ) => {
        mod $m {
            use crate::backend::cpu::bf16::thin::Prod;
            use std::arch::x86_64::*;
            const L: usize = $lanes;

            /// # Safety
            /// The CPU has the features; the pointers cover `super::product`'s extents.
            #[target_feature(enable = $feat)]
            pub unsafe fn product(m: usize, n: usize, p: Prod) {
                assert!(p.a_cs == 1 || p.a_rs == 1, "lora product: A must be row- or column-major");
                let cm = p.a_rs == 1 && p.a_cs != 1;
                let mut j0 = 0;
                while j0 < n {
                    let w = (n - j0).min($vmax * L);
                    let v = w.div_ceil(L);
                    // lanes of the last vector inside the strip
                    let last: $mask = {
                        let $cnt = w - L * (v - 1);
                        $tail
                    };
                    let rmax: [usize; $vmax] = $rmax;
                    let mut i0 = 0;
                    while i0 < m {
                        let rows = (m - i0).min(rmax[v - 1]);
                        // wrapping: with kk = 0 A and B may be empty (dangling); nothing is read then
                        let q = Prod { a: p.a.wrapping_add(i0 * p.a_rs), b: p.b.wrapping_add(j0), c: p.c.add(i0 * p.ldc + j0), ..p };
                        match (v, rows, cm) {
                            $($(($nv, $r, true) => tile::<$r, $nv, true>(q, last), ($nv, $r, false) => tile::<$r, $nv, false>(q, last),)*)*
                            _ => unreachable!("tile {rows} x {v}"),
                        }
                        i0 += rows;
                    }
                    j0 += w;
                }
            }

            /// `C[R, V vectors] (+)= alpha · Σ_l A[i, l] · B[l, ·]`; the last vector masked by `last`.
            /// `CM`: A is column-major (`a_rs == 1`), its R elements of step l side by side; else A
            /// is row-major (`a_cs == 1`) and l goes 4 at a time, so the R row addresses (a chain of
            /// adds through the stride, as the compiler forms them) are paid once per 4 steps —
            /// with one vector per row that chain, not the FMAs, set the pace. Either way each
            /// accumulator takes its FMAs in l order.
            #[target_feature(enable = $feat)]
            #[allow(clippy::needless_range_loop)] // registers indexed by (row, vector), as in gemm512
            unsafe fn tile<const R: usize, const V: usize, const CM: bool>(p: Prod, last: $mask) {
                let mut mask: [$mask; V] = [$full; V];
                mask[V - 1] = last;
                // a macro, not a closure: the intrinsics inline into this function's features
                macro_rules! load {
                    ($at:expr, $k:expr) => {{
                        let ($lp, $lm): (*const f32, $mask) = ($at, $k);
                        $load
                    }};
                }
                let mut s: [[$vec; V]; R] = [[$zero(); V]; R];
                macro_rules! step {
                    ($l:expr, $ai:expr) => {{
                        let bl = p.b.add($l * p.ldb);
                        let mut bv: [$vec; V] = [$zero(); V];
                        for v in 0..V {
                            bv[v] = load!(bl.add(L * v), mask[v]);
                        }
                        for i in 0..R {
                            let ai = $set1($ai(i));
                            for v in 0..V {
                                s[i][v] = $fma(ai, bv[v], s[i][v]);
                            }
                        }
                    }};
                }
                if CM {
                    for l in 0..p.kk {
                        let al = p.a.add(l * p.a_cs);
                        step!(l, |i: usize| *al.add(i));
                    }
                } else {
                    let mut l = 0;
                    while l + 4 <= p.kk {
                        for u in 0..4 {
                            step!(l + u, |i: usize| *p.a.add(i * p.a_rs + l + u));
                        }
                        l += 4;
                    }
                    for l in l..p.kk {
                        step!(l, |i: usize| *p.a.add(i * p.a_rs + l));
                    }
                }
                let alpha = $set1(p.alpha);
                for i in 0..R {
                    let ci = p.c.add(i * p.ldc);
                    for v in 0..V {
                        let mut y = $mul(alpha, s[i][v]);
                        if p.accumulate {
                            y = $add(load!(ci.add(L * v) as *const f32, mask[v]), y);
                        }
                        let ($sp, $sm, $sv) = (ci.add(L * v), mask[v], y);
                        $store;
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
product_kernels!(
    avx512, "avx512f", __m512, 16, __mmask16, vmax 4, rmax [12, 8, 8, 6],
    full 0xffff, tail |n| if n == 16 { 0xffff } else { ((1u32 << n) - 1) as u16 },
    load |p, k| _mm512_maskz_loadu_ps(k, p), store |p, k, y| _mm512_mask_storeu_ps(p, k, y),
    _mm512_setzero_ps, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps,
    tiles { 1: 1 2 3 4 5 6 7 8 9 10 11 12; 2: 1 2 3 4 5 6 7 8; 3: 1 2 3 4 5 6 7 8; 4: 1 2 3 4 5 6; }
);
#[cfg(target_arch = "x86_64")]
product_kernels!(
    avx2, "avx2,fma", __m256, 8, __m256i, vmax 3, rmax [12, 6, 4],
    full _mm256_set1_epi32(-1), tail |n| _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
    load |p, k| _mm256_maskload_ps(p, k), store |p, k, y| _mm256_maskstore_ps(p, k, y),
    _mm256_setzero_ps, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps,
    tiles { 1: 1 2 3 4 5 6 7 8 9 10 11 12; 2: 1 2 3 4 5 6; 3: 1 2 3 4; }
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::Rng;

    fn rand(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// The AVX-512 and AVX2 kernels (each where the CPU has it) and the portable loop give the
    /// same bits, for row- and column-major A, every tile shape of both kernels and accumulation.
    #[test]
    fn kernels_and_portable_agree_bit_for_bit() {
        let mut rng = Rng::new(8);
        // strips of 1–4 vectors of 16 and 1–3 of 8 (n 16, 20, 96 = 64 + 32 = 4 × 24, 48, 33,
        // 70, 200, 40, 7), row remainders of both kernels' tiles, l tails of 1–3 after the 4-step
        // loop, and kk = 0
        for &(m, n, kk) in &[(1, 1, 1), (13, 16, 577), (9, 20, 11), (5, 96, 3), (25, 48, 7), (7, 70, 64), (30, 200, 19), (12, 33, 5), (3, 40, 0), (11, 7, 9), (64, 16, 64)] {
            for &(col_major, accumulate) in &[(false, false), (true, true), (false, true)] {
                let (a, b, c0) = (rand(&mut rng, m * kk), rand(&mut rng, kk * n), rand(&mut rng, m * n));
                let (rs, cs) = if col_major { (1, m) } else { (kk, 1) };
                let mut want = c0.clone();
                unsafe { portable(m, n, kk, a.as_ptr(), rs, cs, b.as_ptr(), n, want.as_mut_ptr(), n, 0.7, accumulate) };
                // values, not all one number (a comparison of zeros would prove nothing)
                assert!(want.iter().any(|&x| x != want[0]) || m * n == 1 || (kk == 0 && !accumulate));
                #[cfg(target_arch = "x86_64")]
                type Kernel = unsafe fn(usize, usize, Prod);
                let kernels: [(&str, bool, Kernel); 2] = [("AVX-512", crate::backend::cpu::simd::has_avx512f(), avx512::product), ("AVX2", crate::backend::cpu::simd::has_avx2_fma(), avx2::product)];
                for (name, _, kernel) in kernels.into_iter().filter(|k| k.1) {
                    let mut got = c0.clone();
                    let p = Prod { kk, a: a.as_ptr(), a_rs: rs, a_cs: cs, b: b.as_ptr(), ldb: n, c: got.as_mut_ptr(), ldc: n, alpha: 0.7, accumulate };
                    // Safety: the CPU has the kernel's features; the buffers hold these extents.
                    unsafe { kernel(m, n, p) };
                    let same = got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{name} kernel and portable loop differ at {m}x{n}x{kk} (column-major A: {col_major}, accumulate {accumulate})");
                }
            }
        }
    }
}
