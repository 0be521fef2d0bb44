//! bf16 weights on the CPU: `out = x Wᵀ (+ bias)` and `dx (+)= dy W` with W stored once in bf16
//! (rounded to nearest-even from f32 at load: `half::bf16::from_f32`'s bits), activations f32,
//! rounded to bf16 on the fly, products accumulated in f32 by `vdpbf16ps` (AVX512_BF16).
//!
//! Why: on this 2-core Zen 5 the register-resident `vdpbf16ps` peak measures 1110 GFLOP/s on
//! both cores, twice the f32 FMA peak (570), and decode streams half the weight bytes. Measured
//! (`cargo bench --bench kernels -- "bf16|machine"`, best of 3 runs on a shared machine):
//! 4096-row `x Wᵀ` on SmolLM2-135M's shapes runs at 965–1010 GFLOP/s (f32: 475–510), `dy W` at
//! 860–985 (f32: 475–510); decode streams 37–71 GiB/s of weights on 2 threads (streaming-read
//! bandwidth: 70 GiB/s; 38 on one core), so a decode product takes 40–55 % of the f32 time.
//!
//! **Layout** (`PackedBf16`, made once at load). W is `[n, k]` row-major (HF: `y = x Wᵀ`). Its
//! rows (the output columns) are cut into panels of NR = 32 and k into pairs (k odd: the last
//! pair's second element is a zero pad). The word for (pair q, column j) holds `W[j][2q]` in its
//! low and `W[j][2q+1]` in its high half: what one f32 lane of `vdpbf16ps` multiplies with a
//! broadcast pair of x. k is cut into blocks (`k_block_pairs`, a function of k only) and storage
//! is block-major: `[block][panel][pair of the block][32 columns]`, so one k block of a run of
//! panels is one contiguous stretch (decode streams it front to back); 64-byte aligned, on 2 MiB
//! pages (placed back to back with the model's other matrices: `arena`). 2·n·k bytes plus
//! padding: no second copy (see `dy · W`).
//!
//! **Kernel** (BLIS with B packed at load). x is converted to bf16 pairs once per call (in row
//! batches of ≤ 16 MiB, rayon over rows; converting per strip and k block instead cost ~13 % of
//! the time, x being re-read for every run of panels). A task owns a run of panels (its k block
//! ≤ 512 KiB, kept in L2) and a range of rows; per k block it sweeps strips of MR = 12 rows over
//! its panels: per pair 2 weight vectors, and per row a 32-bit broadcast and 2 `vdpbf16ps` (12 × 2
//! accumulators + 2 + 1 of the 32 zmm registers; latency ~6 cycles at 2 per cycle needs ≥ 12
//! independent accumulators). Short strips (decode, m ≤ 4) take 2 or 4 panels per call to keep
//! 8–16 accumulators busy, and a task's first strip prefetches its panels 6 KiB ahead into L2 when it
//! reads one or two panel streams. Tasks (runs of panels × row ranges, ~4 per thread) go to
//! rayon, each reading its panels from memory once; decode (one strip, or ≤ 16 rows) splits
//! columns only, so every weight byte is read from memory once per call.
//!
//! **`dy · W`** needs pairs along n instead. A second packed copy kept with the weight would
//! double its memory, so each call repacks W, every k block of this product (pairs of W's rows)
//! and output panel, from the forward layout into the same block-major panel format (a shuffle
//! of bf16 words, no rounding; in parallel, into the calling thread's scratch, 2·n·k bytes: 3.5
//! MiB for SmolLM2's gate/up; O(n·k) per call against O(m·n·k) products), and the tasks run the
//! same kernel on it. Repacking per task instead repeated it for every row group (~4× at 4096
//! rows: ~9 % of gate/up's `dy W`). Small m pays the repack on each call (the backward has many
//! rows).
//!
//! **Determinism.** Every output element has its own f32 accumulator lane and is computed by the
//! same sequence of operations whatever m, its row's position, the thread count, the task split
//! and the microkernel shape (rows per strip and panels per call only choose which register
//! holds it). Per k block, from +0: for each pair in order `acc ← acc + x₂q₊₁·w₂q₊₁`, then
//! `acc ← acc + x₂q·w₂q` (fused multiply-adds rounded to nearest even, bf16 denormals read as
//! zero, denormal results flushed to signed zero: `vdpbf16ps` as the Intel SDM specifies it,
//! checked on this CPU, see `denormals_flush_like_vdpbf16ps`). Block sums are added to the output
//! in block order (the first block stores, or with `accumulate` adds to dx), then the bias. The
//! block size depends only on the reduction length. So there is one summation order for every
//! m (no small-m kernel with another), and a batch equals its rows one by one bit for bit
//! (`rows_are_batch_invariant`, 1–3 threads, both kernels).
//!
//! **AMX** (Intel Sapphire Rapids and later: `amx_available`, off with `INFOMEM_AMX=0`). There
//! `vdpbf16ps` issues at half the f32 FMA rate (measured on a 2-core Xeon with AMX: 237 GFLOP/s
//! bf16 peak vs 469 f32, the 4096-row products at 220 GFLOP/s), while `tdpbf16ps` multiplies a
//! 16-row × 32-bf16 tile by a 32 × 16 tile per instruction. The packed panels are already its B
//! operand (a pair row of a panel is 32 words = two 16-column tile rows, loaded with a 128-byte
//! stride), and A is converted straight into its A operand: per strip of 32 rows and 16-pair step,
//! the two 16 × 16-word tiles as 2 KiB contiguous (`convert_tiles`; rows `pairs` words apart
//! instead cost 5–20 %: 16 lines far apart per tile load); the driver is the same, with strips of 32
//! rows (A padded with zero rows to whole strips) and one panel per call: 4 accumulator tiles, 2 A
//! and 2 B tiles, per 16-pair step 4 tile loads and 4 `tdpbf16ps`. C and the converted A must start
//! on cache lines (the binary's allocator, `util::alloc`, and `CONVERTED`): a tile row that
//! straddles two lines costs 15–20 % per operand (measured on the kernel alone). Each k block's 32 × 32 sums go
//! to a scratch tile and into C as the other kernels store them. It takes the products whose k
//! blocks are whole 16-pair steps (`amx_fits`; SmolLM2's reductions 576, 960, 1536, 3072 all are),
//! chosen per product, never per row count: each element's `tdpbf16ps` sequence does not depend
//! on the other rows, so rows stay batch invariant (tested, 1–3 threads). Its bits are not the
//! `vdpbf16ps` order's (the hardware's internal order and precision differ; within the same f64
//! bounds). Measured on that Xeon (`cargo bench --bench kernels -- "bf16 gemm"`): 4096-row
//! products 980–1450 GFLOP/s (vdpbf16ps 210–225, f32 270–325) before A's tile layout and aligned
//! buffers, 1145–1900 after (2026-12-05; PyTorch's oneDNN 2310–2780 on the same shapes). One
//! core's `tdpbf16ps` alone issue at ~3 TFLOP/s there, with their four tile loads from L1 at 2.2;
//! writing C (f32, 4 KiB per 32 × 32 block, write-allocate) is most of what is left. Strips of ≤ 16 valid rows
//! (decode) take `block16`: one A tile and two alternating sets of B tiles, so the next step's
//! loads overlap this step's products (the same `tdpbf16ps` sequence per element: same bits).
//! Decode then streamed 14–23 GiB/s of bf16 weights at 1 row (12–20 with the 32-row strip;
//! vdpbf16ps 17–29; read bandwidth 23): still faster than f32 per product (half the bytes), but
//! below `vdpbf16ps`. A tile register is loaded again only after the products reading it, so the
//! tile loads alone keep few lines in flight: `block16` also asks L2 for the weight rows 8 KiB
//! ahead, on into the panel its caller reads next (the next k block's, the up half's, the next
//! task's first). One core then streams ~11 GiB/s of the 14 a plain read gets; in a decode step
//! the gate/up product went from ~175 to ~160 µs per layer (2026-12-05, docs/RESULTS.md).
//! Without gradients the gate/up product can end in SwiGLU (`matmul_swiglu_bf16_tails`, AMX only:
//! its sums land in scratch tiles anyway), so the gate/up matrix is never written.
//!
//! **Without AVX512_BF16** (`Kernel::Avx2`: what `Auto` runs on such a CPU, e.g. AMD Zen 2/3
//! or Intel client cores; `INFOMEM_BF16_PORTABLE=1` forces it where `vdpbf16ps` exists): the same
//! driver and packed data. A is converted to f32 values rounded to bf16 (two words per pair, so
//! its broadcasts are plain loads), with a flag per row; each pair row of a panel is widened to
//! f32 by a shift and a mask, and the `vdpbf16ps` steps run as `vfmadd231ps` on 4 rows × 16
//! columns (8 accumulators, 4 widened weight vectors and 2 broadcasts of the 16 ymm registers),
//! the last 1–3 rows of a strip on all 32 columns (4–12 accumulators: see `avx2::panel`). Plain
//! FMAs are the native steps whenever
//! the smallest exponents of a strip's rows and of the weight matrix keep every product on the
//! grid of 2⁻¹²⁶ (`plain_fma_exact`: then every partial sum is a multiple of 2⁻¹²⁶, so nothing is
//! ever flushed or read as zero); a 12-row strip outside that takes the portable steps below, so
//! the results are the native bits either way (tested on this path: the spec's bits on normal
//! data and on random bit patterns without tiny values, tiny data in x alone, in w alone and in
//! both, one tiny row among normal ones, the exponent-sum boundary). Measured on a 2-core AMD
//! EPYC (Zen 3: AVX2, no AVX-512; `cargo bench --bench kernels -- "bf16"`, a shared machine): 4096-row products 133–143 GFLOP/s
//! (f32 there, the `gemm` crate: 130–160; the portable steps: 31); decode with 1 row streams
//! 14–24 GiB/s of bf16 weights (f32: 17–21 GiB/s of twice the bytes), with 8 rows 7.5–10.5 in
//! that bench (f32: 14–17, the same time per product) before the passes over a panel shared its
//! memory stream (`avx2::Prefetch`): 8 rows × 32 columns would need 32 accumulators, so a panel
//! is read in 4 passes at the FMA rate, and only the first one came from memory. 8 rows × 576 ×
//! 3072 with cold weights now run at 125–138 GFLOP/s (15–16 GiB/s) against 98–107 before.
//! So on such a CPU bf16 weights run at about the f32 speed (0.9–1.3× in `bench` on the Zen 3:
//! docs/RESULTS.md) with half the weight memory, where the portable steps alone ran 2–5× slower.
//!
//! **Portable steps** (`Kernel::Portable`, a tiny strip of the AVX2 kernel, a CPU without AVX2):
//! the same driver and packed data; each pair row of a panel is widened to f32 (denormals to zero)
//! and the same two FMAs per pair run in f32 lanes, the flush as a compare-and-select. One case
//! needs more: `vdpbf16ps` calls a result denormal after rounding it to 24 bits with an unbounded
//! exponent, so an exact sum in (2⁻¹²⁶ − 2⁻¹⁵⁰, 2⁻¹²⁶ − 2⁻¹⁵¹] is flushed though an f32 FMA rounds
//! it up to 2⁻¹²⁶ (measured). When a lane's FMA gives exactly ±2⁻¹²⁶, the panel is redone with an
//! exact step in f64: the bf16 product is exact there, and either the sum is exact too (≤ 53
//! significant bits) or the smaller operand is under 2⁻²⁸ of the larger, an f32 value that both
//! the exact and the f64 sum then round to. The results are the native bits (checked on random
//! data, tiny data, random bit patterns), NaN payloads aside (which NaN propagates is not
//! reproduced; where NaNs appear is). ~25× slower than `vdpbf16ps` (39 GFLOP/s on 2 threads; 31
//! on the Zen 3): the reference the other kernels are tested against, and the rare tiny strip.
use super::arena::Lines;
use super::lora::{BfB, Out};
use super::matmul::SendPtr;
use half::bf16;
use rayon::prelude::*;
use std::cell::RefCell;

/// Output columns per packed panel: two 16-lane f32 accumulators per row.
pub const NR: usize = 32;
/// Rows per microkernel strip.
pub const MR: usize = 12;
/// Rows per strip of the AMX kernel: two 16-row A tiles.
const AMX_MR: usize = 32;
/// Words from one 16-pair step of a strip to the next in the AMX kernel's A (`convert_tiles`).
const TILE_STEP: usize = AMX_MR * 16;
/// Reductions of up to this many pairs are one k block (a 12-row strip is then ≤ 15 KiB).
const KC_ONE: usize = 320;
/// Longer reductions are cut into equal blocks of at most this many pairs.
const KC_MAX: usize = 256;
/// Packed bytes of one task's panels in one k block: about half of a 1 MiB L2.
const CHUNK_BYTES: usize = 512 << 10;
/// At most this much of A is converted to bf16 at a time (longer products go in row batches).
const CONVERTED_BYTES: usize = 16 << 20;
/// Rows per parallel piece of the conversion.
const CONVERT_ROWS: usize = 64;

/// Pairs per k block for a reduction of `pairs` pairs: a function of the length only (part of the
/// summation order, see the module doc).
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
fn bf16_daz(h: u16) -> f32 {
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
fn plain_fma_exact(ex: u8, ew: u8) -> bool {
    ex >= 1 && ew >= 1 && ex as u16 + ew as u16 >= 142
}

/// The biased exponent of a bf16 for `plain_fma_exact`: 255 for ±0 (no constraint), 0 for a
/// denormal.
#[inline(always)]
fn bf16_exp(h: u16) -> u8 {
    if h & 0x7fff == 0 {
        255
    } else {
        ((h >> 7) & 0xff) as u8
    }
}

/// Which microkernel computes the products (the results are the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// `vdpbf16ps` when the CPU has it and `INFOMEM_BF16_PORTABLE` is unset (or "0"), else
    /// `Avx2` (or `Portable` without AVX2+FMA).
    Auto,
    /// `vdpbf16ps`; panics without AVX512_BF16.
    Native,
    /// AMX tiles (`tdpbf16ps`) where the reduction allows it (see `amx_fits`), else `vdpbf16ps`;
    /// panics without AMX-BF16 (or without the kernel's permission to use it).
    Amx,
    /// f32 FMAs emulating `vdpbf16ps` (any CPU).
    Portable,
    /// AVX2+FMA: the `vdpbf16ps` steps as plain f32 FMAs on widened bf16, for every strip whose
    /// operands cannot reach the denormal range (`plain_fma_exact`), else the portable steps; panics
    /// without AVX2+FMA.
    Avx2,
}

/// Whether this CPU runs the `vdpbf16ps` kernel.
pub fn native_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::simd::has_avx512bf16()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether `Kernel::Auto` runs `vdpbf16ps` here (AVX512_BF16, `INFOMEM_BF16_PORTABLE` unset):
/// also what lets the bf16 attention run its products on it where AMX is missing.
pub fn vdp_available() -> bool {
    native_available() && !forced_portable()
}

/// Whether this CPU runs the AVX2 kernel (AVX2 and FMA).
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::simd::has_avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What `Kernel::Auto` runs on this machine, in words (for the backend's name).
pub fn auto_kernel() -> &'static str {
    if vdp_available() {
        if amx_available() {
            "AMX tiles (vdpbf16ps where a reduction is not a multiple of 32)"
        } else {
            "vdpbf16ps"
        }
    } else if avx2_available() {
        "AVX2 FMAs on widened bf16: no AVX512_BF16"
    } else {
        "portable kernel: no AVX512_BF16, no AVX2"
    }
}

/// `INFOMEM_BF16_PORTABLE` set to anything but "" or "0" (read once).
fn forced_portable() -> bool {
    use std::sync::OnceLock;
    static FORCED: OnceLock<bool> = OnceLock::new();
    *FORCED.get_or_init(|| std::env::var_os("INFOMEM_BF16_PORTABLE").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// The microkernel a product runs on (chosen per call from the kernel and the reduction only, so
/// every row of a product, alone or in any batch, takes the same one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Micro {
    Amx,
    Avx512,
    Avx2,
    Portable,
}

impl Kernel {
    /// The microkernel for a reduction of `pairs` pairs in k blocks of `kc`.
    fn micro(self, pairs: usize, kc: usize) -> Micro {
        match self {
            Kernel::Auto if vdp_available() => {
                if amx_available() && amx_fits(pairs, kc) {
                    Micro::Amx
                } else {
                    Micro::Avx512
                }
            }
            Kernel::Auto if avx2_available() => Micro::Avx2,
            Kernel::Auto | Kernel::Portable => Micro::Portable,
            Kernel::Avx2 => {
                assert!(avx2_available(), "gemm_bf16: Kernel::Avx2 needs AVX2 and FMA, which this CPU lacks");
                Micro::Avx2
            }
            Kernel::Native => {
                assert!(native_available(), "gemm_bf16: Kernel::Native needs AVX512_BF16, which this CPU lacks");
                Micro::Avx512
            }
            Kernel::Amx => {
                assert!(amx_available(), "gemm_bf16: Kernel::Amx needs AMX-BF16, which this CPU (or its kernel) does not allow");
                if amx_fits(pairs, kc) {
                    Micro::Amx
                } else {
                    Micro::Avx512
                }
            }
        }
    }
}

/// Whether the AMX kernel takes a reduction: every k block a whole number of 16-pair tile steps
/// (SmolLM2's 576, 1536 and 960, Qwen's 896, 2048, 4096… do; a remainder would need a second
/// tile shape, and the `vdpbf16ps` kernel serves those).
fn amx_fits(pairs: usize, kc: usize) -> bool {
    pairs % 16 == 0 && kc % 16 == 0
}

/// Whether this process may run the AMX kernel: the CPU has AMX-TILE and AMX-BF16 (and
/// AVX512_BF16, whose conversion the driver shares), `INFOMEM_AMX` is not "0", and Linux granted
/// the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, once per process, for all threads).
pub fn amx_available() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var_os("INFOMEM_AMX").is_some_and(|v| v == "0") || !native_available() {
            return false;
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // Safety: a plain syscall; it fails (and we fall back) on kernels without AMX support
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// 64 bytes: one cache line of packed words (keeps the packed data aligned; AMX tile rows and
/// stores that straddle two lines cost 15–20 %).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u32; 16]);

/// The AMX tile state held for a scope: configured by `new` where this process may use AMX
/// (`amx_available`), released on drop (a thread without tile state has smaller context
/// switches and signal frames); nothing elsewhere. Tile products inside the scope need not
/// configure (`lora::product_bf(…, configured: true)`, the bf16 attention's `Products`).
pub(crate) struct Tiles(bool);

impl Tiles {
    pub(crate) fn new() -> Tiles {
        let held = amx_available();
        #[cfg(target_arch = "x86_64")]
        if held {
            // Safety: AMX is present and granted to this process (`amx_available`).
            unsafe { amx::configure() };
        }
        Tiles(held)
    }

    /// Whether the tiles are held (this process uses AMX).
    pub(crate) fn held(&self) -> bool {
        self.0
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if self.0 {
            // Safety: releasing the tile state is always allowed.
            unsafe { amx::release() };
        }
    }
}

/// A `[n, k]` row-major weight rounded to bf16 and packed for the kernels (see the module doc).
pub struct PackedBf16 {
    n: usize,
    k: usize,
    /// ⌈k/2⌉
    pairs: usize,
    /// pairs per k block (`k_block_pairs(pairs)`)
    kc: usize,
    /// ⌈n/NR⌉
    panels: usize,
    data: Lines,
    /// the smallest `bf16_exp` of the weights (see `plain_fma_exact`)
    min_exp: u8,
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

    fn pack(n: usize, k: usize, get: impl Fn(usize, usize) -> u16 + Sync) -> Self {
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

    fn blocks(&self) -> usize {
        self.pairs.div_ceil(self.kc)
    }
    /// (first pair, pairs) of k block `b`.
    fn block(&self, b: usize) -> (usize, usize) {
        let q0 = b * self.kc;
        (q0, self.kc.min(self.pairs - q0))
    }
    /// Word offset of k block `b` (every earlier block is full).
    fn block_off(&self, b: usize) -> usize {
        b * self.kc * self.panels * NR
    }
    fn words(&self) -> *const u32 {
        self.data.as_ptr() as *const u32
    }
    /// Panel `pn` of k block `b` (`pn` up to `panels`: one past a block's last panel is where the
    /// next block starts).
    fn panel(&self, b: usize, pn: usize) -> *const u32 {
        debug_assert!(b < self.blocks() && pn <= self.panels);
        // Safety: inside the packed data, or one past its end
        unsafe { self.words().add(self.block_off(b) + pn * self.block(b).1 * NR) }
    }
    /// The word holding `W[j][2q]`, `W[j][2q+1]`.
    fn word(&self, j: usize, q: usize) -> u32 {
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

/// `out[m, n] = x[m, k] · Wᵀ (+ bias)` with `w` packed from `[n, k]`, on the machine's threads.
pub fn matmul_bf16(x: &[f32], w: &PackedBf16, bias: Option<&[f32]>, m: usize, k: usize, n: usize, out: &mut [f32]) {
    matmul_bf16_with(x, w, bias, m, k, n, out, Kernel::Auto, true)
}

/// `matmul_bf16` with the kernel chosen and, with `parallel = false`, on the calling thread only
/// (for use inside already-parallel loops). The result does not depend on either.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bf16_with(x: &[f32], w: &PackedBf16, bias: Option<&[f32]>, m: usize, k: usize, n: usize, out: &mut [f32], kernel: Kernel, parallel: bool) {
    // Safety: no tails
    unsafe { matmul_bf16_tails(x, w, bias, m, k, n, out, kernel, parallel, &[], None) }
}

/// `matmul_bf16_with`, then each `Tail` added to its columns of `out` (in order) while a strip of
/// rows is in cache; with `tail_u`, the tails' `u` computed here from x first (`TailU`).
///
/// # Safety
/// Each tail's pointers must cover its extents (`u` `m` rows of `ldu` with `r` columns; `b` rows
/// `0..r` of `ldb` with `ncols` columns), `col0 + ncols ≤ n`; `tail_u`'s as `TailU` says; none
/// may alias `x` or `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_bf16_tails(x: &[f32], w: &PackedBf16, bias: Option<&[f32]>, m: usize, k: usize, n: usize, out: &mut [f32], kernel: Kernel, parallel: bool, tails: &[Tail], tail_u: Option<&TailU>) {
    assert!(w.n == n && w.k == k, "matmul_bf16: weight packed as [{}, {}], product wants [{n}, {k}]", w.n, w.k);
    assert!(out.len() >= m * n, "matmul_bf16: buffer too small");
    matmul_bf16_strided(x, w, bias, m, out.as_mut_ptr(), n, kernel, parallel, tails, tail_u)
}

/// `matmul_bf16_tails` with the output's rows `ldo ≥ w.n` apart: `out[r·ldo + j]` for `j < w.n`,
/// the product written into a column slice of a wider `[m, ldo]` output (a vocabulary tile of
/// the LM head, `buf.rs`). The same bits.
///
/// # Safety
/// As `matmul_bf16_tails` (`n` = `w.n`); `out` must point at `m` rows of `ldo` f32 (the last row
/// `w.n` long), which no one else accesses meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_bf16_strided(x: &[f32], w: &PackedBf16, bias: Option<&[f32]>, m: usize, out: *mut f32, ldo: usize, kernel: Kernel, parallel: bool, tails: &[Tail], tail_u: Option<&TailU>) {
    let (n, k) = (w.n, w.k);
    assert!(ldo >= n, "matmul_bf16: a row stride of {ldo} for {n} columns");
    assert!(tails.iter().all(|t| t.col0 + t.ncols <= n) && (tails.is_empty() || k > 0), "matmul_bf16: a tail outside the output, or a tail with k = 0");
    assert!(x.len() >= m * k, "matmul_bf16: buffer too small");
    assert!(bias.is_none_or(|b| b.len() >= n), "matmul_bf16: bias shorter than {n}");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for r in 0..m {
            let row = std::slice::from_raw_parts_mut(out.add(r * ldo), n);
            match bias {
                Some(b) => row.copy_from_slice(&b[..n]),
                None => row.fill(0.0),
            }
        }
        return;
    }
    let job = Job {
        c: SendPtr(out),
        ldc: ldo,
        bias: bias.map_or(SendPtr(std::ptr::null_mut()), |b| SendPtr(b.as_ptr() as *mut f32)),
        micro: kernel.micro(w.pairs, w.kc),
        ..Job::forward(x, w, m, tails, tail_u)
    };
    job.run(parallel);
}

/// Whether `matmul_swiglu_bf16_tails` runs fused for the gate/up weight `w` (`[2·inter, k]`) on
/// this machine: on AMX tiles (the kernel whose blocks land in scratch tiles anyway), with the
/// gate and up halves in whole panels.
pub fn swiglu_fusable(w: &PackedBf16, inter: usize) -> bool {
    w.n == 2 * inter && inter > 0 && inter.is_multiple_of(NR) && w.k > 0 && Kernel::Auto.micro(w.pairs, w.kc) == Micro::Amx
}

/// `act[m, inter] = silu(g) · u` where `[g | u] = x · Wᵀ` (+ each tail, as `matmul_bf16_tails`
/// adds them) and `W` is the `[2·inter, k]` gate rows then up rows: SwiGLU fused into the
/// product. Each strip of 32 rows × 32 columns of g and of u is summed over every k block in
/// scratch tiles (the same block sums, added in the same order, then the tails, as the unfused
/// product writes to C), and `simd::silu_mul` — `swiglu`'s own function — turns the pair into
/// `act`. So the bits are those of `matmul_bf16_tails` then `swiglu::swiglu`, and the `[m,
/// 2·inter]` gate/up matrix is never written: at 4096 rows × 1536 that is 50 MB written (and
/// read for ownership) and read back, per layer. Only where `swiglu_fusable`.
///
/// # Safety
/// As `matmul_bf16_tails` (the tails' columns are the gate/up columns).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_swiglu_bf16_tails(x: &[f32], w: &PackedBf16, m: usize, k: usize, inter: usize, act: &mut [f32], parallel: bool, tails: &[Tail], tail_u: Option<&TailU>) {
    assert!(swiglu_fusable(w, inter) && w.k == k, "matmul_swiglu_bf16: weight [{}, {}] is not a fusable gate/up pair for inter {inter}, k {k}", w.n, w.k);
    assert!(tails.iter().all(|t| t.col0 + t.ncols <= 2 * inter), "matmul_swiglu_bf16: a tail outside the output");
    assert!(x.len() >= m * k && act.len() >= m * inter, "matmul_swiglu_bf16: buffer too small");
    if m == 0 {
        return;
    }
    let job = Job { glu: SendPtr(act.as_mut_ptr()), ..Job::forward(x, w, m, tails, tail_u) };
    job.run(parallel);
}

/// `dx[m, k] (+)= dy[m, n] · W` with `w` packed from `[n, k]`, on the machine's threads.
pub fn matmul_dx_bf16(dy: &[f32], w: &PackedBf16, m: usize, n: usize, k: usize, dx: &mut [f32], accumulate: bool) {
    matmul_dx_bf16_with(dy, w, m, n, k, dx, accumulate, Kernel::Auto, true)
}

/// `matmul_dx_bf16` with the kernel and the parallelism chosen (same bits either way).
#[allow(clippy::too_many_arguments)]
pub fn matmul_dx_bf16_with(dy: &[f32], w: &PackedBf16, m: usize, n: usize, k: usize, dx: &mut [f32], accumulate: bool, kernel: Kernel, parallel: bool) {
    // Safety: no tails
    unsafe { matmul_dx_bf16_tails(dy, w, m, n, k, dx, accumulate, kernel, parallel, &[]) }
}

/// `matmul_dx_bf16_with`, then each `Tail` added to its columns of `dx` (in order) while a
/// strip of rows is in cache.
///
/// # Safety
/// As `matmul_bf16_tails`, with `dy` for `x`, `dx` for `out` and `k` for `n`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_dx_bf16_tails(dy: &[f32], w: &PackedBf16, m: usize, n: usize, k: usize, dx: &mut [f32], accumulate: bool, kernel: Kernel, parallel: bool, tails: &[Tail]) {
    matmul_dx_bf16_hooked(dy, w, m, n, k, dx, accumulate, kernel, parallel, tails, None)
}

/// Work on `dy`'s rows while they are in cache: `f(row0, rows, convert)` is called once for each
/// piece of `rows` rows of `dy` (`row0` a multiple of `piece`, the last piece possibly shorter,
/// pieces in parallel), before any product reads them — so before the tails of those rows run,
/// which may read what `f` wrote. `f` converts the piece itself, part by part (`convert(row,
/// n)`, rows `row..row + n`, `row` a multiple of 32), each part right before its own work on it:
/// a whole piece (256 rows of gate/up's dy: 3 MiB) would leave L2 before `f` read it back.
pub(crate) struct RowHook<'a> {
    pub(crate) f: &'a RowFn<'a>,
    /// rows per piece: a multiple of 32 (the AMX strips)
    pub(crate) piece: usize,
}

/// A `RowHook`'s work: `f(row0, rows, convert)`.
pub(crate) type RowFn<'a> = dyn Fn(usize, usize, &dyn Fn(usize, usize)) + Sync + 'a;

/// `matmul_dx_bf16_tails` with a `RowHook` run during A's conversion (the LoRA backward's
/// per-chunk products, `lora::matmul_dx_lora`).
///
/// # Safety
/// As `matmul_dx_bf16_tails`; what the tails read of the hook's output is written by the hook
/// for the same rows.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_dx_bf16_hooked(dy: &[f32], w: &PackedBf16, m: usize, n: usize, k: usize, dx: &mut [f32], accumulate: bool, kernel: Kernel, parallel: bool, tails: &[Tail], hook: Option<&RowHook>) {
    assert!(hook.is_none_or(|h| h.piece > 0 && h.piece.is_multiple_of(AMX_MR)), "matmul_dx_bf16: a row hook's pieces must be whole AMX strips");
    assert!(w.n == n && w.k == k, "matmul_dx_bf16: weight packed as [{}, {}], product wants [{n}, {k}]", w.n, w.k);
    assert!(tails.iter().all(|t| t.col0 + t.ncols <= k) && (tails.is_empty() || n > 0), "matmul_dx_bf16: a tail outside dx, or with n = 0");
    assert!(dy.len() >= m * n && dx.len() >= m * k, "matmul_dx_bf16: buffer too small");
    if m == 0 || k == 0 || n == 0 {
        if n == 0 && !accumulate {
            dx[..m * k].fill(0.0);
        }
        // the hook still sees every row (its products need not be empty); nothing to convert
        if let Some(h) = hook {
            (0..m).step_by(h.piece).for_each(|r0| (h.f)(r0, h.piece.min(m - r0), &|_, _| {}));
        }
        return;
    }
    let pairs = n.div_ceil(2);
    let job = Job {
        a: SendPtr(dy.as_ptr() as *mut f32),
        red: n,
        pairs,
        kc: k_block_pairs(pairs),
        m,
        cols: k,
        panels: k.div_ceil(NR),
        c: SendPtr(dx.as_mut_ptr()),
        ldc: k,
        bias: SendPtr(std::ptr::null_mut()),
        accumulate,
        src: Source::Transposed(w),
        micro: kernel.micro(pairs, k_block_pairs(pairs)),
        tails,
        tail_u: None,
        hook,
        glu: SendPtr(std::ptr::null_mut()),
    };
    job.run(parallel);
}

/// A low-rank term added to a column slice of a product's output, strip by strip while the
/// strip's rows are in cache (a LoRA pair fused into the GEMM; see `lora::matmul_lora`):
/// `C[i, col0 + j] += alpha · Σ_l bf(u[i, l]) · B[l, j]` for `j < ncols` (`lora::product_bf`,
/// B `[r, ncols]` rounded once), after the element's GEMM sums and bias. Without the GEMM's rows
/// in cache this read-modify-write of C was ~a quarter of the LoRA products' time.
pub(crate) struct Tail {
    /// `m` rows of `ldu`, this tail's `r` columns first (the pairs of one product share one u)
    pub(crate) u: SendPtr<f32>,
    pub(crate) ldu: usize,
    pub(crate) b: SendPtr<BfB>,
    pub(crate) alpha: f32,
    pub(crate) col0: usize,
    pub(crate) ncols: usize,
}

/// The forward tails' `u = bf(A_rows) · Aᵀ` for every LoRA pair on the product (`at`: each
/// pair's Aᵀ `[red, r]` in bf16 and its first column in u; `u` `[m, ldu]`), computed per piece
/// of rows as the GEMM converts them, so the f32 rows are read from memory once for the GEMM and
/// all the pairs.
pub(crate) struct TailU {
    pub(crate) at: Vec<(SendPtr<BfB>, usize)>,
    pub(crate) r: usize,
    pub(crate) u: SendPtr<f32>,
}

/// Where a task's packed panels come from.
enum Source<'a> {
    /// `x Wᵀ`: the stored panels themselves.
    Forward(&'a PackedBf16),
    /// `dy W`: panels of Wᵀ repacked per k block into scratch.
    Transposed(&'a PackedBf16),
}

/// One product `C[m, cols] (+)= A[m, red] · B` with B in packed panels over `cols`, pairs over `red`.
struct Job<'a> {
    /// `[m, red]` row-major f32
    a: SendPtr<f32>,
    red: usize,
    pairs: usize,
    kc: usize,
    m: usize,
    cols: usize,
    panels: usize,
    /// `[m, cols]`, rows `ldc` apart
    c: SendPtr<f32>,
    ldc: usize,
    /// `[cols]` or null
    bias: SendPtr<f32>,
    accumulate: bool,
    src: Source<'a>,
    micro: Micro,
    /// added to C per strip after the last k block
    tails: &'a [Tail],
    /// computed per converted piece of rows, for the tails
    tail_u: Option<&'a TailU>,
    /// called per converted piece of rows (`RowHook`)
    hook: Option<&'a RowHook<'a>>,
    /// SwiGLU fused (`matmul_swiglu_bf16_tails`): C is not written; `act [m, cols / 2]` gets
    /// `silu(C[:, j]) · C[:, cols / 2 + j]`. Null otherwise.
    glu: SendPtr<f32>,
}

thread_local! {
    /// The calling thread's A converted to bf16 pairs (reused across calls; on cache lines, so
    /// that no tile row or vector load straddles two).
    static CONVERTED: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
    /// The smallest `bf16_exp` of each row of the calling thread's converted A (AVX2 kernel).
    static ROW_EXP: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's repacked panels of `dy W` (reused across calls).
    static REPACK: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

impl<'a> Job<'a> {
    /// `x · Wᵀ` for `x [m, w.k]`: no C, bias or SwiGLU yet (the entry points set theirs), the
    /// microkernel `Auto` picks.
    fn forward(x: &[f32], w: &'a PackedBf16, m: usize, tails: &'a [Tail], tail_u: Option<&'a TailU>) -> Self {
        Job {
            a: SendPtr(x.as_ptr() as *mut f32),
            red: w.k,
            pairs: w.pairs,
            kc: w.kc,
            m,
            cols: w.n,
            panels: w.panels,
            c: SendPtr(std::ptr::null_mut()),
            ldc: w.n,
            bias: SendPtr(std::ptr::null_mut()),
            accumulate: false,
            src: Source::Forward(w),
            micro: Kernel::Auto.micro(w.pairs, w.kc),
            tails,
            tail_u,
            hook: None,
            glu: SendPtr(std::ptr::null_mut()),
        }
    }

    /// Words per row of converted A: a pair word each, or for the AVX2 kernel (`wide`) both
    /// values of a pair as f32 (rounded to bf16), so its broadcasts are plain loads.
    fn lda(&self) -> usize {
        if self.wide() {
            2 * self.pairs
        } else {
            self.pairs
        }
    }

    /// A in the AVX2 kernel's layout (see `lda`).
    fn wide(&self) -> bool {
        self.micro == Micro::Avx2
    }

    fn weight(&self) -> &PackedBf16 {
        match self.src {
            Source::Forward(w) | Source::Transposed(w) => w,
        }
    }

    fn run(&self, parallel: bool) {
        let threads = if parallel && self.m * self.cols * self.red >= 1 << 16 { rayon::current_num_threads() } else { 1 };
        // A is converted once per call, in batches of rows of at most CONVERTED_BYTES. The AMX
        // kernel reads strips of AMX_MR rows: the batch's last strip is padded with zero rows.
        let mr = if self.micro == Micro::Amx { AMX_MR } else { MR };
        let (lda, wide) = (self.lda(), self.wide());
        let mut batch = self.m.min((CONVERTED_BYTES / (lda * 4) / mr).max(1) * mr);
        // pieces of the conversion: a hook's, so batches are whole pieces of it
        let piece_rows = self.hook.map_or(CONVERT_ROWS, |h| h.piece);
        if self.hook.is_some() && batch < self.m {
            batch = (batch / piece_rows).max(1) * piece_rows;
        }
        let mut conv = CONVERTED.with(|s| std::mem::take(&mut *s.borrow_mut()));
        if conv.len() * 16 < batch.next_multiple_of(mr) * lda {
            conv.resize((batch.next_multiple_of(mr) * lda).div_ceil(16), Line([0; 16])); // grown only: every row used is written first
        }
        let mut exps = if wide { ROW_EXP.with(|s| std::mem::take(&mut *s.borrow_mut())) } else { Vec::new() };
        if wide && exps.len() < batch {
            exps.resize(batch, 0);
        }
        let cp = SendPtr(conv.as_mut_ptr() as *mut u32);
        let ep = SendPtr(exps.as_mut_ptr());
        // dy·W: Wᵀ's panels repacked once per call for every task (each task repacked its own,
        // so every row group repeated the whole repack: ~4× at 4096 rows, ~10 % of `dy·W` for
        // gate/up's shape in `perf`)
        let mut repacked = Vec::new();
        if let Source::Transposed(w) = self.src {
            repacked = REPACK.with(|s| std::mem::take(&mut *s.borrow_mut()));
            let words = self.pairs * self.panels * NR; // every k block's panels, as PackedBf16 lays them out
            if repacked.len() * 16 < words {
                repacked.resize(words.div_ceil(16), Line([0; 16])); // grown only: every word is written below
            }
            let (d, blocks) = (SendPtr(repacked.as_mut_ptr() as *mut u32), self.pairs.div_ceil(self.kc));
            let per = 4; // panels per piece
            let pieces = self.panels.div_ceil(per);
            let piece = |t: usize| {
                let (b, p0) = (t / pieces, t % pieces * per);
                let (q0, p1) = (b * self.kc, (p0 + per).min(self.panels));
                let kb = self.kc.min(self.pairs - q0);
                // Safety: block b's panels p0..p1 are the disjoint words [off, off + (p1 − p0)·kb·NR) of `repacked`
                unsafe { repack_dx(w, p0, p1, q0, kb, d.get().add(q0 * self.panels * NR + p0 * kb * NR)) };
            };
            if threads > 1 {
                (0..blocks * pieces).into_par_iter().for_each(piece);
            } else {
                (0..blocks * pieces).for_each(piece);
            }
        }
        let rp = SendPtr(repacked.as_mut_ptr() as *mut u32);
        for rb in (0..self.m).step_by(batch) {
            let rows = batch.min(self.m - rb);
            // rows i0..i1 of the batch (i0 a multiple of AMX_MR)
            let convert_rows = |i0: usize, i1: usize| {
                // Safety: rows rb+i0..rb+i1 of A exist; pieces write disjoint rows of `conv`.
                unsafe {
                    let rows_f32 = self.a.get().add((rb + i0) * self.red);
                    if wide {
                        convert_wide(rows_f32, self.red, i1 - i0, cp.get().add(i0 * lda) as *mut f32, ep.get().add(i0));
                    } else if mr == AMX_MR {
                        convert_tiles(rows_f32, self.red, i1 - i0, self.pairs, cp.get().add(i0 * self.pairs)); // i0: a multiple of AMX_MR
                    } else {
                        convert_strip(rows_f32, self.red, i1 - i0, 0, self.pairs, cp.get().add(i0 * self.pairs), self.micro != Micro::Portable);
                    }
                    // the rows are in cache now; u covers [m, r] (the caller's contract)
                    if let Some(tu) = self.tail_u {
                        let outs: Vec<Out> = tu.at.iter().map(|(b, o)| Out { b: &*b.0, j0: 0, j1: (*b.0).n(), c: tu.u.get().add((rb + i0) * tu.r + o), ldc: tu.r }).collect();
                        super::lora::products_bf(i1 - i0, rows_f32, self.red, 1, &outs, 1.0, false, false);
                    }
                }
            };
            let convert = |piece: usize| {
                let (i0, i1) = (piece * piece_rows, ((piece + 1) * piece_rows).min(rows));
                let Some(h) = self.hook else { return convert_rows(i0, i1) };
                // the hook converts the piece's rows itself, a part at a time, each before its work
                let done = std::cell::Cell::new(0);
                (h.f)(rb + i0, i1 - i0, &|a: usize, n: usize| {
                    assert!(a >= rb + i0 && a + n <= rb + i1 && (a - rb).is_multiple_of(AMX_MR), "matmul_dx_bf16: a row hook converted rows {a}..{} outside its piece", a + n);
                    convert_rows(a - rb, a - rb + n);
                    done.set(done.get() + n);
                });
                assert!(done.get() == i1 - i0, "matmul_dx_bf16: a row hook converted {} of its {} rows", done.get(), i1 - i0);
            };
            let pieces = rows.div_ceil(piece_rows);
            if threads > 1 && pieces > 1 {
                (0..pieces).into_par_iter().for_each(convert);
            } else {
                (0..pieces).for_each(convert);
            }
            if mr == AMX_MR && !rows.is_multiple_of(AMX_MR) {
                // the last strip's rows past the batch: zero rows of its tiles
                let strip = cp.get().wrapping_add((rows - rows % AMX_MR) * self.pairs);
                for g in 0..self.pairs / 16 {
                    // Safety: the strip's AMX_MR·pairs words lie inside `conv` (sized to whole strips)
                    unsafe { std::slice::from_raw_parts_mut(strip.add(g * TILE_STEP + rows % AMX_MR * 16), (AMX_MR - rows % AMX_MR) * 16).fill(0) };
                }
            }
            self.run_rows(rb, rows, cp.get(), if wide { ep.get() } else { std::ptr::null_mut() }, rp.get(), threads, mr);
        }
        if let Source::Transposed(_) = self.src {
            REPACK.with(|s| *s.borrow_mut() = repacked);
        }
        CONVERTED.with(|s| *s.borrow_mut() = conv);
        if wide {
            ROW_EXP.with(|s| *s.borrow_mut() = exps);
        }
    }

    /// Rows `rb..rb+rows`, converted at `conv` (row stride `lda()`; for the AVX2 kernel their
    /// smallest exponents at `exps`, else null), split into tasks; `repacked`: `dy W`'s panels
    /// (null for `x Wᵀ`).
    #[allow(clippy::too_many_arguments)]
    fn run_rows(&self, rb: usize, rows: usize, conv: *const u32, exps: *const u8, repacked: *const u32, threads: usize, mr: usize) {
        // Columns: runs of panels whose k block fits CHUNK_BYTES, equal-sized; decode (one strip,
        // or up to FEW_ROWS rows) splits into ~4 runs per thread for balance, each task taking
        // all the rows: its panels come from memory once and serve a second strip from L2.
        // (Split into row groups as well, the two strips' tasks ran on both threads and each
        // streamed the same panels from DRAM: 16 decode rows 789–808 → 906–960 tokens/s on a
        // 2-core Zen 4, `bench --work decode --batch 16 --dtype bf16`; at 24 rows, two full
        // strips, the products are compute-bound and the row groups' finer split was ~2 %
        // faster.) Fused SwiGLU runs over the gate panels, each with its up panel and every k
        // block.
        const FEW_ROWS: usize = 16;
        let glu = !self.glu.get().is_null();
        let (units, unit_bytes) = if glu { (self.panels / 2, 2 * self.pairs * NR * 4) } else { (self.panels, self.kc * NR * 4) };
        let cap = (CHUNK_BYTES / unit_bytes).max(1);
        let strips = rows.div_ceil(mr);
        let mut chunks = units.div_ceil(cap);
        let few = strips == 1 || rows <= FEW_ROWS;
        if threads > 1 && few {
            chunks = chunks.max((4 * threads).min(units));
        }
        let per_chunk = units.div_ceil(chunks);
        let chunks = units.div_ceil(per_chunk);
        // Rows: enough groups for ~4 tasks per thread, a multiple of the thread count.
        let mut groups = 1;
        if threads > 1 && !few {
            groups = (4 * threads).div_ceil(chunks);
            while (chunks * groups) % threads != 0 {
                groups += 1;
            }
            groups = groups.min(strips);
        }
        let per_group = strips.div_ceil(groups) * mr;
        let groups = rows.div_ceil(per_group);
        let conv = SendPtr(conv as *mut u32);
        let exps = SendPtr(exps as *mut u8);
        let repacked = SendPtr(repacked as *mut u32);
        let lda = self.lda();
        let task = |t: usize| {
            let (ci, gi) = (t % chunks, t / chunks);
            let (p0, p1) = (ci * per_chunk, ((ci + 1) * per_chunk).min(units));
            let (r0, r1) = (gi * per_group, ((gi + 1) * per_group).min(rows));
            // Safety: tasks write disjoint (row range × column run) tiles of C; every extent was
            // checked against the buffers by the public entry points.
            unsafe { self.task(p0, p1, rb + r0, rb + r1, conv.get().add(r0 * lda), exps.get().wrapping_add(r0), repacked.get()) } // exps is null (never read) unless wide
        };
        let tasks = chunks * groups;
        if threads > 1 && tasks > 1 {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
    }

    /// Panels `p0..p1` × rows `r0..r1` (converted at `a`, row stride `lda()`; for the AVX2
    /// kernel the rows' smallest exponents at `exps`), every k block; `dy W`'s panels at
    /// `repacked`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn task(&self, p0: usize, p1: usize, r0: usize, r1: usize, a: *const u32, exps: *const u8, repacked: *const u32) {
        #[cfg(target_arch = "x86_64")]
        if !self.glu.get().is_null() {
            return self.task_glu(p0, p1, r0, r1, a);
        }
        let blocks = self.pairs.div_ceil(self.kc);
        // panel pn of k block b: the stored one, or the call's repacked one (`run`)
        let panel = |b: usize, pn: usize| -> *const u32 {
            match self.src {
                Source::Forward(w) => w.panel(b, pn),
                Source::Transposed(_) => repacked.add(b * self.kc * self.panels * NR + pn * self.kc.min(self.pairs - b * self.kc) * NR),
            }
        };
        #[cfg(target_arch = "x86_64")]
        if self.micro == Micro::Amx {
            amx::configure();
        }
        for b in 0..blocks {
            let q0 = b * self.kc;
            let kb = self.kc.min(self.pairs - q0);
            let panels = panel(b, p0);
            #[cfg(target_arch = "x86_64")]
            if self.micro == Micro::Amx {
                // where this task reads after block b: the next block's first panel; after the
                // last block, the panel after its run, the next task's first (the one a thread
                // mostly takes next: rayon splits the range in halves)
                let next = if b + 1 < blocks {
                    panel(b + 1, p0)
                } else if p1 < self.panels {
                    panel(b, p1)
                } else {
                    std::ptr::null()
                };
                self.block_amx(b, blocks, q0, kb, panels, next, p0, p1, r0, r1, a);
                continue;
            }
            let (lda, wide) = (self.lda(), self.wide());
            let mut i = r0;
            while i < r1 {
                let rows = MR.min(r1 - i);
                // the AVX2 kernel's plain FMAs only where they are the native steps
                let exact = wide && !plain_fma_exact((0..rows).map(|r| *exps.add(i - r0 + r)).min().unwrap_or(255), self.weight().min_exp);
                let mut pn = p0;
                while pn < p1 {
                    let j0 = pn * NR;
                    let t = Tile {
                        a: a.add((i - r0) * lda + if wide { 2 * q0 } else { q0 }),
                        lda,
                        wide,
                        exact,
                        b: panels.add((pn - p0) * kb * NR),
                        pstride: kb * NR,
                        kb,
                        c: self.c.get().add(i * self.ldc + j0),
                        ldc: self.ldc,
                        cols: self.cols - j0,
                        overwrite: b == 0 && !self.accumulate,
                        bias: if b + 1 == blocks && !self.bias.get().is_null() { self.bias.get().add(j0) } else { std::ptr::null() },
                        first: i == r0,
                    };
                    pn += t.run(rows, p1 - pn, self.micro);
                }
                if b + 1 == blocks {
                    self.tails_at(i, rows, p0, p1);
                }
                i += rows;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if self.micro == Micro::Amx {
            amx::release();
        }
    }

    /// k block `b` (pairs `q0..q0+kb`) of panels `p0..p1` × rows `r0..r1` on AMX tiles: strips of
    /// 32 rows (A is padded to whole strips) × one panel; each strip-panel's 32 × 32 block sums
    /// go into C with the other kernels' store (`Tile::store`: the first block stores, later ones
    /// add, the bias after the last) — a whole block that only stores goes straight from the tile
    /// registers into C, the others through a scratch tile. `next`: the panel the task reads
    /// after this block's last one (null: none), for `block16`'s prefetch.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block_amx(&self, b: usize, blocks: usize, q0: usize, kb: usize, panels: *const u32, next: *const u32, p0: usize, p1: usize, r0: usize, r1: usize, a: *const u32) {
        let mut acc = amx::Sums([0f32; AMX_MR * NR]);
        let overwrite = b == 0 && !self.accumulate;
        let bias = if b + 1 == blocks { self.bias.get() as *const f32 } else { std::ptr::null() };
        let mut i = r0;
        while i < r1 {
            let rows = AMX_MR.min(r1 - i);
            for pn in p0..p1 {
                let j0 = pn * NR;
                // the strip's tiles (`convert_tiles`) from pair q0 on
                let (ai, bp) = (a.add((i - r0) * self.pairs + q0 / 16 * TILE_STEP), panels.add((pn - p0) * kb * NR));
                let cols = (self.cols - j0).min(NR);
                // a whole block written, not added to: the tiles store into C in place (the
                // same bits as through `acc`, without the copy)
                let direct = overwrite && rows == AMX_MR && cols == NR;
                if direct {
                    amx::block_to(ai, 16, TILE_STEP, bp, kb, self.c.get().add(i * self.ldc + j0), self.ldc);
                } else if rows <= 16 {
                    // decode: one A tile; the same tdpbf16ps sequence per element (same bits)
                    amx::block16(ai, 16, TILE_STEP, bp, kb, if pn + 1 < p1 { bp.add(kb * NR) } else { next }, &mut acc);
                } else {
                    amx::block(ai, 16, TILE_STEP, bp, kb, &mut acc);
                }
                for r in 0..rows {
                    let c = std::slice::from_raw_parts_mut(self.c.get().add((i + r) * self.ldc + j0), cols);
                    let s = &acc.0[r * NR..r * NR + cols];
                    if !overwrite {
                        c.iter_mut().zip(s).for_each(|(c, &s)| *c += s); // C + sums: IEEE addition commutes (Tile::store)
                    } else if !direct {
                        c.copy_from_slice(s);
                    }
                    if !bias.is_null() {
                        let bs = std::slice::from_raw_parts(bias.add(j0), cols);
                        c.iter_mut().zip(bs).for_each(|(c, &b)| *c += b);
                    }
                }
            }
            if b + 1 == blocks {
                self.tails_at(i, rows, p0, p1);
            }
            i += AMX_MR;
        }
    }

    /// The tails on rows `i..i+rows` (complete: after the last k block) × panels `p0..p1`.
    ///
    /// # Safety
    /// The rows are this task's; the tails' extents as the entry points require.
    unsafe fn tails_at(&self, i: usize, rows: usize, p0: usize, p1: usize) {
        let (lo, hi) = (p0 * NR, (p1 * NR).min(self.cols));
        self.tails_into(i, rows, lo, hi, self.c.get().add(i * self.ldc + lo), self.ldc);
    }

    /// The tails on rows `i..i+rows` × columns `lo..hi`, into `c` (column `lo` of row `i`, row
    /// stride `ldc`).
    unsafe fn tails_into(&self, i: usize, rows: usize, lo: usize, hi: usize, c: *mut f32, ldc: usize) {
        for t in self.tails {
            let (j0, j1) = (lo.max(t.col0), hi.min(t.col0 + t.ncols));
            if j0 < j1 {
                // inside an AMX task the tiles are configured (the same palette) and stay so
                super::lora::product_bf(rows, t.u.get().add(i * t.ldu), t.ldu, 1, &*t.b.0, j0 - t.col0, j1 - t.col0, c.add(j0 - lo), ldc, t.alpha, true, self.micro == Micro::Amx);
            }
        }
    }

    /// Fused SwiGLU (`matmul_swiglu_bf16_tails`): gate panels `p0..p1` (each with its up panel
    /// `h` panels on) × rows `r0..r1`, every k block per strip and panel pair. Per 32 × 32 block:
    /// the first k block's sums, then each later block's added, then the tails — `block_amx`'s
    /// arithmetic on C (the gate/up product has no bias) — then `silu_mul` of the gate and up
    /// blocks into `act`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn task_glu(&self, p0: usize, p1: usize, r0: usize, r1: usize, a: *const u32) {
        let (w, h) = (self.weight(), self.panels / 2);
        let inter = h * NR;
        let blocks = self.pairs.div_ceil(self.kc);
        let mut acc = amx::Sums([0f32; AMX_MR * NR]);
        let mut sums = [amx::Sums([0f32; AMX_MR * NR]), amx::Sums([0f32; AMX_MR * NR])];
        amx::configure();
        let mut i = r0;
        while i < r1 {
            let rows = AMX_MR.min(r1 - i);
            for pn in p0..p1 {
                for (half, s) in sums.iter_mut().enumerate() {
                    let pp = pn + half * h;
                    for b in 0..blocks {
                        let q0 = b * self.kc;
                        let kb = self.kc.min(self.pairs - q0);
                        let (ai, bp) = (a.add((i - r0) * self.pairs + q0 / 16 * TILE_STEP), w.panel(b, pp));
                        let dst = if b == 0 { &mut *s } else { &mut acc };
                        if rows <= 16 {
                            // read next: this panel's next block, else the up panel, else the next gate
                            // panel (past the task's run: the next task's first)
                            let next = if b + 1 < blocks {
                                w.panel(b + 1, pp)
                            } else if half == 0 {
                                w.panel(0, pn + h)
                            } else if pn + 1 < h {
                                w.panel(0, pn + 1)
                            } else {
                                std::ptr::null()
                            };
                            amx::block16(ai, 16, TILE_STEP, bp, kb, next, dst);
                        } else {
                            amx::block(ai, 16, TILE_STEP, bp, kb, dst);
                        }
                        if b > 0 {
                            s.0[..rows * NR].iter_mut().zip(&acc.0[..rows * NR]).for_each(|(c, &x)| *c += x);
                        }
                    }
                    self.tails_into(i, rows, pp * NR, pp * NR + NR, s.0.as_mut_ptr(), NR);
                }
                for r in 0..rows {
                    let out = std::slice::from_raw_parts_mut(self.glu.get().add((i + r) * inter + pn * NR), NR);
                    super::simd::silu_mul(&sums[0].0[r * NR..(r + 1) * NR], &sums[1].0[r * NR..(r + 1) * NR], out);
                }
            }
            i += AMX_MR;
        }
        amx::release();
    }
}

/// Rows `0..rows` of A (row stride `red`), pairs `q0..q0+kb`, to bf16 pair words `dst[r·kb + q]`
/// (an odd reduction's last pair gets a zero high half).
unsafe fn convert_strip(a: *const f32, red: usize, rows: usize, q0: usize, kb: usize, dst: *mut u32, native: bool) {
    let elems = (red - 2 * q0).min(2 * kb);
    let full = elems / 2;
    for r in 0..rows {
        let src = a.add(r * red + 2 * q0);
        let d = dst.add(r * kb);
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if native {
            done = avx512::convert_pairs(src, d, full);
        }
        let _ = native;
        let (s, o) = (std::slice::from_raw_parts(src, elems), std::slice::from_raw_parts_mut(d, kb));
        for q in done..full {
            o[q] = f32_to_bf16_bits(s[2 * q]) as u32 | (f32_to_bf16_bits(s[2 * q + 1]) as u32) << 16;
        }
        if elems % 2 == 1 {
            o[full] = f32_to_bf16_bits(s[elems - 1]) as u32;
        }
    }
}

/// Rows `0..rows` of A (row stride `red`, `rows` from a strip's first row) to the AMX kernel's
/// layout: per strip of AMX_MR rows, per step of 16 pairs, its AMX_MR × 16 pair words row by row
/// (word `(r / 32)·32·pairs + (q / 16)·512 + (r % 32)·16 + q % 16`), so that each A tile is 1 KiB
/// contiguous: 16 whole lines, against 16 rows `pairs` words apart that the hardware prefetcher
/// does not follow (`pairs` is a multiple of 16: `amx_fits`).
unsafe fn convert_tiles(a: *const f32, red: usize, rows: usize, pairs: usize, dst: *mut u32) {
    debug_assert!(pairs.is_multiple_of(16) && red.div_ceil(2) == pairs);
    for r in 0..rows {
        let d = dst.add(r / AMX_MR * AMX_MR * pairs + r % AMX_MR * 16);
        for g in 0..pairs / 16 {
            convert_strip(a.add(r * red), red, 1, 16 * g, 16, d.add(g * TILE_STEP), true);
        }
    }
}

/// Rows `0..rows` of A (row stride `red`) rounded to bf16 and written as f32 values, the AVX2
/// kernel's layout (`dst[r·lda + i]`, lda = 2⌈red/2⌉: an odd reduction's pad zero); `exps[r]` is
/// row r's smallest `bf16_exp`.
unsafe fn convert_wide(a: *const f32, red: usize, rows: usize, dst: *mut f32, exps: *mut u8) {
    let lda = 2 * red.div_ceil(2);
    for r in 0..rows {
        let src = std::slice::from_raw_parts(a.add(r * red), red);
        let d = std::slice::from_raw_parts_mut(dst.add(r * lda) as *mut u32, lda);
        let mut least = 255u32;
        for (o, &x) in d.iter_mut().zip(src) {
            let h = f32_to_bf16_bits(x);
            *o = (h as u32) << 16;
            // `bf16_exp(h)` without a branch, so the loop vectorizes
            let e = if h & 0x7fff == 0 { 255 } else { (h as u32 >> 7) & 0xff };
            least = least.min(e);
        }
        if red % 2 == 1 {
            d[red] = 0;
        }
        *exps.add(r) = least as u8;
    }
}

/// The `dy W` panels: output panels `p0..p1` (W's columns `32P..32P+32`) × pairs of W's rows
/// `t0..t0+kb`, in the forward panel format, into `dst` (`(p1 − p0)·kb·NR` words). Word (P, t, c)
/// holds `W[2t][32P+c]` low and `W[2t+1][32P+c]` high, zero past n or k.
unsafe fn repack_dx(w: &PackedBf16, p0: usize, p1: usize, t0: usize, kb: usize, dst: *mut u32) {
    let base = w.words();
    for pn in p0..p1 {
        let out = dst.add((pn - p0) * kb * NR);
        // forward pairs q = 16·pn + qq hold W's columns 2q, 2q+1
        let qn = 16.min(w.pairs - 16 * pn);
        let mut rows = [std::ptr::null::<u32>(); 16];
        let mut t = 0;
        while t < kb {
            // the rows 2t, 2t+1 of W in forward panel `jp`, up to its end
            let j = 2 * (t0 + t);
            let jp = j / NR;
            let t_end = kb.min(t + (NR - j % NR) / 2);
            for (qq, row) in rows.iter_mut().enumerate().take(qn) {
                let q = 16 * pn + qq;
                let b = q / w.kc;
                let (bq0, bkb) = w.block(b);
                *row = base.add(w.block_off(b) + jp * bkb * NR + (q - bq0) * NR);
            }
            for tt in t..t_end {
                let jj = 2 * (t0 + tt) - jp * NR;
                let o = out.add(tt * NR);
                for (qq, row) in rows.iter().enumerate().take(qn) {
                    let (lo, hi) = (*row.add(jj), *row.add(jj + 1));
                    *o.add(2 * qq) = (lo & 0xffff) | (hi << 16);
                    *o.add(2 * qq + 1) = (lo >> 16) | (hi & 0xffff_0000);
                }
                for c in 2 * qn..NR {
                    *o.add(c) = 0;
                }
            }
            t = t_end;
        }
    }
}

/// One microkernel call: `rows` ≤ MR rows of converted A against 1, 2 or 4 panels.
struct Tile {
    /// pair words, row stride `lda` (`wide`: two f32 words per pair)
    a: *const u32,
    lda: usize,
    /// A as f32 values (the AVX2 kernel's layout) rather than pair words
    wide: bool,
    /// plain FMAs are not the native steps here (`plain_fma_exact`): the AVX2 kernel takes the
    /// portable steps
    exact: bool,
    /// first panel (pair-major rows of NR words); panel p at `b + p·pstride`
    b: *const u32,
    pstride: usize,
    kb: usize,
    c: *mut f32,
    ldc: usize,
    /// valid columns from `c` on (may exceed the panels of this call)
    cols: usize,
    /// store the block's sum (else add it to C)
    overwrite: bool,
    /// bias from this tile's first column, added after the last k block; null if none
    bias: *const f32,
    /// the task's first strip: its panels come from memory (prefetch them when ≤ 2 streams)
    first: bool,
}

impl Tile {
    /// Runs the widest call for `rows` (4 panels for 1–2 rows, 2 for 3–4, else 1) that `avail`
    /// panels allow; returns the panels done.
    unsafe fn run(&self, rows: usize, avail: usize, micro: Micro) -> usize {
        #[cfg(target_arch = "x86_64")]
        if micro == Micro::Avx2 && !self.exact {
            avx2::panel(self, rows);
            return 1;
        }
        let want = if rows <= 2 {
            4
        } else if rows <= 4 {
            2
        } else {
            1
        };
        let p = if want.min(avail) >= 4 {
            4
        } else if want.min(avail) >= 2 {
            2
        } else {
            1
        };
        #[cfg(target_arch = "x86_64")]
        if micro == Micro::Avx512 {
            // A task's first strip streams its panels from memory: with one or two panel streams
            // (≥ 3 rows) software prefetch helps (decode with 8 rows: +15–25 % on a Zen 5, and
            // +8–14 % more on a Zen 4 with the prefetch into L2, `kernel`);
            // four streams (1–2 rows) keep the hardware prefetchers busy enough.
            if self.first && p <= 2 {
                avx512::dispatch::<true>(self, rows, p);
            } else {
                avx512::dispatch::<false>(self, rows, p);
            }
            return p;
        }
        for q in 0..p {
            self.portable(rows, q);
        }
        p
    }

    /// Store one finished accumulator of row r, column `off` (same operations as the native store).
    #[inline(always)]
    unsafe fn store(&self, r: usize, off: usize, acc: f32) {
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
    unsafe fn x_pair(&self, r: usize, q: usize) -> (u16, u16) {
        if self.wide {
            let x = self.a.add(r * self.lda + 2 * q);
            ((*x >> 16) as u16, (*x.add(1) >> 16) as u16)
        } else {
            let xw = *self.a.add(r * self.lda + q);
            (xw as u16, (xw >> 16) as u16)
        }
    }

    /// Panel `p` of this call with f32 FMAs: the `vdpbf16ps` steps, see the module doc.
    unsafe fn portable(&self, rows: usize, p: usize) {
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
fn step_f32(acc: f32, x: f32, w: f32) -> (f32, u32) {
    let s = x.mul_add(w, acc);
    let m = s.abs();
    let edge = (m == f32::MIN_POSITIVE) as u32;
    (if m < f32::MIN_POSITIVE { f32::from_bits(s.to_bits() & 0x8000_0000) } else { s }, edge)
}

/// The half-step exactly: the product of two bf16 is exact in f64 and the f64 sum decides the
/// flush like `vdpbf16ps` (a result whose 24-bit rounding, exponent unbounded, is below 2⁻¹²⁶
/// becomes signed zero). See the module doc for why the f64 rounding cannot change the result.
#[inline]
fn step_exact(acc: f32, x: f32, w: f32) -> f32 {
    const TINY: f64 = 1.0 / (1u128 << 126) as f64 - 1.0 / (1u128 << 127) as f64 / (1u64 << 24) as f64;
    let s = acc as f64 + x as f64 * w as f64;
    if s.abs() < TINY {
        f32::from_bits(((s.to_bits() >> 32) as u32) & 0x8000_0000)
    } else {
        s as f32
    }
}

/// `C = A · B` on the `vdpbf16ps` kernel, for operands in the AMX layout (`attention_bf16`): A's
/// first `m` rows of `pairs` pair words (row stride `lda`), `panels` panels of B (`pstride` words
/// apart, `[pairs][NR]` each), C's `m` × `panels·NR` block stored (row stride `ldc`; its rows
/// past `m` untouched), or with `add` added to C (`C += A · B`). One k block from +0, so each element is the kernel's pair sequence over
/// `pairs` (the module doc), whatever `m` and its row's place in it. Strips of MR rows under one panel at a time (the
/// panel stays in L1 while the strips pass).
///
/// # Safety
/// AVX512_BF16 present; the extents are inside the caller's buffers.
#[cfg(target_arch = "x86_64")]
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
            avx512::dispatch::<false>(&t, rows, 1);
            i += rows;
        }
    }
}

/// The AMX microkernel (`tdpbf16ps`: per output element and 16-pair step, the 32 products of a
/// tile row with a tile column summed into the f32 accumulator; the hardware's order and internal
/// precision are not those of `vdpbf16ps`, so AMX results differ from the other kernels' in the
/// last bits, measured within the same bf16 bounds; each element's operations still do not depend
/// on the other rows, so batches equal their rows one by one). Stable Rust has no AMX intrinsics:
/// the instructions are written as inline assembly; the tile registers are not known to the
/// compiler, which never uses them.
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx {
    use super::{AMX_MR, NR};
    use std::arch::asm;

    /// The 32 × 32 f32 sums of one strip and panel (row stride NR).
    #[repr(C, align(64))]
    pub struct Sums(pub [f32; AMX_MR * NR]);

    #[repr(C, align(64))]
    struct TileCfg {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    /// Palette 1, tiles 0–7 each 16 rows × 64 bytes: tmm0–3 the sums (rows 0–15 / 16–31 × columns
    /// 0–15 / 16–31), tmm4–5 A (16 rows × 16 pairs), tmm6–7 the panel's column halves (16 pairs
    /// × 16 columns). Per thread; `task` calls it before its first block.
    pub unsafe fn configure() {
        let mut cfg = TileCfg { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileCfg, options(nostack, readonly));
    }

    /// Drop the tile state (a thread without it has smaller context switches and signal frames).
    pub unsafe fn release() {
        asm!("tilerelease", options(nostack, nomem));
    }

    /// `sums = A[32 rows at a] · panel[kb pairs at b]` for one k block (kb a multiple of 16). A's
    /// rows are `lda` words apart, and its 16-pair steps `astep` words apart: row-major A has
    /// (lda, astep) = (pairs, 16), the GEMM's tile layout (16, TILE_STEP). B tiles load straight
    /// from the packed panel (a pair row is NR words = 128 bytes; its two 16-column halves are the
    /// two B tiles).
    pub unsafe fn block(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, sums: &mut Sums) {
        block_to(a, lda, astep, b, kb, sums.0.as_mut_ptr(), NR);
    }

    /// `block` storing the 32 × 32 sums at `c` (row stride `ldc` f32), all 32 rows and columns.
    pub unsafe fn block_to(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, c: *mut f32, ldc: usize) {
        block_into::<false>(a, lda, astep, b, kb, c, ldc);
    }

    /// `block_to` adding the sums to the 32 × 32 block at `c` instead: the tiles start from C's
    /// values (loaded), so no separate pass reads the sums back to add them.
    pub unsafe fn block_add(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, c: *mut f32, ldc: usize) {
        block_into::<true>(a, lda, astep, b, kb, c, ldc);
    }

    #[inline(always)]
    unsafe fn block_into<const ADD: bool>(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, c: *mut f32, ldc: usize) {
        debug_assert!(kb % 16 == 0);
        if ADD {
            asm!(
                "tileloadd tmm0, [{c0} + {sc}*1]",
                "tileloadd tmm1, [{c1} + {sc}*1]",
                "tileloadd tmm2, [{c2} + {sc}*1]",
                "tileloadd tmm3, [{c3} + {sc}*1]",
                c0 = in(reg) c,
                c1 = in(reg) c.add(16),
                c2 = in(reg) c.add(16 * ldc),
                c3 = in(reg) c.add(16 * ldc + 16),
                sc = in(reg) ldc * 4,
                options(nostack, readonly),
            );
        } else {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        }
        let mut s = 0;
        while s < kb {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a.add(s / 16 * astep),
                a1 = in(reg) a.add(16 * lda + s / 16 * astep),
                sa = in(reg) lda * 4,
                b0 = in(reg) b.add(s * NR),
                b1 = in(reg) b.add(s * NR + 16),
                sb = in(reg) NR * 4,
                options(nostack, readonly),
            );
            s += 16;
        }
        asm!(
            "tilestored [{c0} + {sc}*1], tmm0",
            "tilestored [{c1} + {sc}*1], tmm1",
            "tilestored [{c2} + {sc}*1], tmm2",
            "tilestored [{c3} + {sc}*1], tmm3",
            c0 = in(reg) c,
            c1 = in(reg) c.add(16),
            c2 = in(reg) c.add(16 * ldc),
            c3 = in(reg) c.add(16 * ldc + 16),
            sc = in(reg) ldc * 4,
            options(nostack),
        );
    }

    /// Pair rows `r..r+16` of the panel at `b` (`kb` pair rows), or past its end those of `next`
    /// (the panel the caller reads after this one; null: none), asked into L2.
    #[inline(always)]
    unsafe fn prefetch_rows(b: *const u32, kb: usize, next: *const u32, r: usize) {
        let p = if r < kb {
            b.wrapping_add(r * NR)
        } else if !next.is_null() {
            next.wrapping_add((r - kb) * NR)
        } else {
            return;
        } as *const u8;
        // 16 pair rows of NR words: 32 lines (a prefetch is only a hint: never faults)
        for l in 0..32 {
            asm!("prefetcht1 [{p}]", p = in(reg) p.wrapping_add(64 * l), options(nostack, readonly, preserves_flags));
        }
    }

    /// `block` for strips of at most 16 rows (decode): the first 16 rows of `sums` only. One A
    /// tile and the panel's two B tiles per step, alternating between two register sets so the
    /// next step's tile loads (from memory: the weights stream) overlap this step's products.
    /// Each accumulator sees the same `tdpbf16ps` sequence as in `block`, so the bits are equal.
    ///
    /// The tile loads alone keep too few lines in flight (the tile registers are reused only
    /// after the products that read them): each step also asks L2 for the rows `PF_AHEAD` pairs
    /// on, continuing into `next` (the panel read after this one, or null) past this one's end.
    pub unsafe fn block16(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, next: *const u32, sums: &mut Sums) {
        /// 8 KiB of the stream ahead (measured 4–32 KiB: 4 and 16 KiB ahead gained less)
        const PF_AHEAD: usize = 64;
        debug_assert!(kb % 16 == 0);
        asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
        let mut s = 0;
        while s + 32 <= kb {
            prefetch_rows(b, kb, next, s + PF_AHEAD);
            prefetch_rows(b, kb, next, s + PF_AHEAD + 16);
            asm!(
                "tileloadd tmm2, [{a0} + {sa}*1]",
                "tileloadd tmm4, [{b0} + {sb}*1]",
                "tileloadd tmm5, [{b1} + {sb}*1]",
                "tileloadd tmm3, [{a2} + {sa}*1]",
                "tileloadd tmm6, [{b2} + {sb}*1]",
                "tileloadd tmm7, [{b3} + {sb}*1]",
                "tdpbf16ps tmm0, tmm2, tmm4",
                "tdpbf16ps tmm1, tmm2, tmm5",
                "tdpbf16ps tmm0, tmm3, tmm6",
                "tdpbf16ps tmm1, tmm3, tmm7",
                a0 = in(reg) a.add(s / 16 * astep),
                a2 = in(reg) a.add((s / 16 + 1) * astep),
                sa = in(reg) lda * 4,
                b0 = in(reg) b.add(s * NR),
                b1 = in(reg) b.add(s * NR + 16),
                b2 = in(reg) b.add((s + 16) * NR),
                b3 = in(reg) b.add((s + 16) * NR + 16),
                sb = in(reg) NR * 4,
                options(nostack, readonly),
            );
            s += 32;
        }
        if s < kb {
            prefetch_rows(b, kb, next, s + PF_AHEAD);
            asm!(
                "tileloadd tmm2, [{a0} + {sa}*1]",
                "tileloadd tmm4, [{b0} + {sb}*1]",
                "tileloadd tmm5, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm2, tmm4",
                "tdpbf16ps tmm1, tmm2, tmm5",
                a0 = in(reg) a.add(s / 16 * astep),
                sa = in(reg) lda * 4,
                b0 = in(reg) b.add(s * NR),
                b1 = in(reg) b.add(s * NR + 16),
                sb = in(reg) NR * 4,
                options(nostack, readonly),
            );
        }
        let c = sums.0.as_mut_ptr();
        asm!(
            "tilestored [{c0} + {sc}*1], tmm0",
            "tilestored [{c1} + {sc}*1], tmm1",
            c0 = in(reg) c,
            c1 = in(reg) c.add(16),
            sc = in(reg) NR * 4,
            options(nostack),
        );
    }
}

/// `f32_to_bf16_bits` on 16 lanes (for the bf16 attention's and LoRA products' operands).
#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::round16;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Tile, NR};
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

    pub unsafe fn dispatch<const PF: bool>(t: &Tile, rows: usize, p: usize) {
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
        // 30–31 on two; 64 or 96 pairs ahead no better (docs/RESULTS.md, 2026-12-06, Zen 4)
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
}

/// The AVX2 kernel (no AVX512_BF16): each pair row of a panel widened to f32 (shift / mask) and
/// the `vdpbf16ps` steps as `vfmadd231ps`, on strips whose operands pass `plain_fma_exact` (then these
/// FMAs are the native steps, see there). 16 ymm registers: 4 rows × 16 columns (8 accumulators,
/// 4 widened weight vectors reused by the 4 rows, 2 broadcasts), or 1 row × 32 columns.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Tile, NR};
    use std::arch::x86_64::*;

    /// `rows` ≤ MR rows × one panel: each group of 4 rows in two passes of 16 columns (8 sums),
    /// the last 1–3 rows in one pass over all 32 columns (4–12 sums: a pass of 3 rows × 16
    /// columns would keep only 6 FMA chains in flight for a latency of 4 cycles × 2 FMA pipes).
    /// Batch 5 with the 16-column passes alone ran at 69 GFLOP/s against 104 this way, batch 8
    /// as 3 + 3 + 2 rows on whole panels at 120–126 against 138 this way (weights from DRAM).
    pub unsafe fn panel(t: &Tile, rows: usize) {
        let full = rows / 4 * 4;
        let rest = rows - full;
        let np = full / 2 + usize::from(rest > 0);
        let mut j = 0;
        for c0 in [0, 16] {
            for r in (0..full).step_by(4) {
                if c0 < t.cols {
                    kernel::<4, 2>(t, r, c0, j, np);
                }
                j += 1;
            }
        }
        match rest {
            1 => kernel::<1, 4>(t, full, 0, j, np),
            2 => wide::<2>(t, full, j, np),
            3 => wide::<3>(t, full, j, np),
            _ => {}
        }
    }

    /// The software prefetch of a task's first strip, whose panels come from memory. The first
    /// pass reads the panel 48 pairs ahead into L2 (6 KiB; `cargo bench --bench kernels -- "bf16
    /// decode"` with 8 rows: 4.9–6.1 → 7.5–8.5 GiB/s; 32, 96, 128 pairs less; into L1 less).
    /// Every pass also fetches its share of the next panel, a pair row every `np` pairs: the
    /// later passes over a panel hit the cache, so without it the memory stream stalled while
    /// they ran and the first pass waited on it (8 rows × 576 × 3072 from DRAM: 107 → 138
    /// GFLOP/s; 5 rows 70 → 104; measured best of 200 alternated runs, 2026-12-03, Zen 3).
    struct Prefetch {
        on: bool,
        ahead: bool,
        b: *const u32,
        next: *const u32,
        row: usize,
        end: usize,
        wait: usize,
        np: usize,
    }

    impl Prefetch {
        /// For pass `j` of the `np` passes over panel `t.b`.
        #[inline(always)]
        fn new(t: &Tile, j: usize, np: usize) -> Prefetch {
            let per = t.kb.div_ceil(np);
            // past the task's last panel this is the next task's first one (or past the data:
            // a prefetch is only a hint)
            let next = t.b.wrapping_add(t.pstride);
            Prefetch { on: t.first, ahead: j == 0, b: t.b, next, row: j * per, end: ((j + 1) * per).min(t.kb), wait: 0, np }
        }

        #[inline(always)]
        unsafe fn step(&mut self, q: usize) {
            const PF_PAIRS: usize = 48;
            if !self.on {
                return;
            }
            if self.ahead {
                let p = self.b.wrapping_add((q + PF_PAIRS) * NR);
                _mm_prefetch::<_MM_HINT_T1>(p as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(16) as *const i8);
            }
            if self.wait == 0 {
                if self.row < self.end {
                    let p = self.next.wrapping_add(self.row * NR);
                    _mm_prefetch::<_MM_HINT_T1>(p as *const i8);
                    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(16) as *const i8);
                    self.row += 1;
                }
                self.wait = self.np;
            }
            self.wait -= 1;
        }
    }

    /// Rows `r0..r0+R` (R ≤ 3) × the whole panel, 4R sums: per pair the odd halves of the 4
    /// weight vectors, widened one at a time, against R broadcasts, then the even halves (each
    /// sum's order is `kernel`'s: odd, then even, pair after pair).
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // v and r name registers: acc[r][v] in lockstep with x[r]
    unsafe fn wide<const R: usize>(t: &Tile, r0: usize, j: usize, np: usize) {
        let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let a = (t.a as *const f32).add(r0 * t.lda);
        let mut pf = Prefetch::new(t, j, np);
        for q in 0..t.kb {
            pf.step(q);
            let w = t.b.add(q * NR) as *const __m256i;
            let mut x = [_mm256_setzero_ps(); R];
            for (r, xr) in x.iter_mut().enumerate() {
                *xr = _mm256_broadcast_ss(&*a.add(r * t.lda + 2 * q + 1));
            }
            // 12 sums + 3 broadcasts + 1 weight vector fill the 16 registers: an opaque pointer
            // per phase makes the compiler load the weights again rather than keep all four
            // (which spilled the sums: 118 → 94 GFLOP/s)
            let wb = std::hint::black_box(w);
            for v in 0..4 {
                let wo = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wb.add(v)), hi));
                for r in 0..R {
                    acc[r][v] = _mm256_fmadd_ps(x[r], wo, acc[r][v]);
                }
            }
            for (r, xr) in x.iter_mut().enumerate() {
                *xr = _mm256_broadcast_ss(&*a.add(r * t.lda + 2 * q));
            }
            let wb = std::hint::black_box(w);
            for v in 0..4 {
                let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_loadu_si256(wb.add(v))));
                for r in 0..R {
                    acc[r][v] = _mm256_fmadd_ps(x[r], we, acc[r][v]);
                }
            }
        }
        store(t, r0, 0, &acc);
    }

    /// Rows `r0..r0+R` × columns `c0..c0+8V` of the panel: per pair V words of weights widened to
    /// 2V f32 vectors; per row a broadcast of each half of its pair and 2V FMAs, odd first.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn kernel<const R: usize, const V: usize>(t: &Tile, r0: usize, c0: usize, j: usize, np: usize) {
        let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let mut acc = [[_mm256_setzero_ps(); V]; R];
        let a = (t.a as *const f32).add(r0 * t.lda);
        let b = t.b.add(c0);
        let mut pf = Prefetch::new(t, j, np);
        for q in 0..t.kb {
            pf.step(q);
            let mut we = [_mm256_setzero_ps(); V];
            let mut wo = [_mm256_setzero_ps(); V];
            for v in 0..V {
                let w = _mm256_loadu_si256(b.add(q * NR + 8 * v) as *const __m256i);
                we[v] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
                wo[v] = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
            }
            for (r, ar) in acc.iter_mut().enumerate() {
                let xe = _mm256_broadcast_ss(&*a.add(r * t.lda + 2 * q));
                let xo = _mm256_broadcast_ss(&*a.add(r * t.lda + 2 * q + 1));
                for v in 0..V {
                    ar[v] = _mm256_fmadd_ps(xo, wo[v], ar[v]);
                    ar[v] = _mm256_fmadd_ps(xe, we[v], ar[v]);
                }
            }
        }
        store(t, r0, c0, &acc);
    }

    /// The finished sums of rows `r0..r0+R` × columns `c0..c0+8V` into C (`Tile::store`'s
    /// operations, 8 lanes at a time).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store<const R: usize, const V: usize>(t: &Tile, r0: usize, c0: usize, acc: &[[__m256; V]; R]) {
        for (r, ar) in acc.iter().enumerate() {
            let cr = t.c.add((r0 + r) * t.ldc);
            for (v, &s) in ar.iter().enumerate() {
                let off = c0 + 8 * v;
                if off >= t.cols {
                    break;
                }
                if t.cols - off >= 8 {
                    let mut s = s;
                    if !t.overwrite {
                        s = _mm256_add_ps(_mm256_loadu_ps(cr.add(off)), s);
                    }
                    if !t.bias.is_null() {
                        s = _mm256_add_ps(s, _mm256_loadu_ps(t.bias.add(off)));
                    }
                    _mm256_storeu_ps(cr.add(off), s);
                } else {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), s);
                    for (l, &x) in lanes.iter().enumerate().take(t.cols - off) {
                        t.store(r0 + r, off + l, x);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::Rng;

    const U: f64 = 1.0 / (1u64 << 24) as f64; // unit roundoff of f32

    fn kernels() -> Vec<Kernel> {
        let mut v = vec![];
        if native_available() {
            v.push(Kernel::Native);
        } else {
            eprintln!("note: no AVX512_BF16 on this CPU, the vdpbf16ps kernel is not tested");
        }
        if avx2_available() {
            v.push(Kernel::Avx2);
        }
        v.push(Kernel::Portable);
        v
    }

    /// `kernels()` and, where this machine allows it, AMX: checked against the f64 bounds and for
    /// batch invariance (not for the `vdpbf16ps` bits, which AMX does not reproduce).
    fn all_kernels() -> Vec<Kernel> {
        let mut v = kernels();
        if amx_available() {
            v.push(Kernel::Amx);
        } else {
            eprintln!("note: no AMX on this CPU (or INFOMEM_AMX=0), the AMX kernel is not tested");
        }
        v
    }

    fn normal(rng: &mut Rng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.normal() as f32).collect()
    }

    /// The summation order of the module doc, written directly on the unpacked values with the
    /// exact step: what every kernel must reproduce bit for bit. `w(p)` is the reduction's weight.
    fn spec(x: &[f32], w: impl Fn(usize) -> u16, init: Option<f32>, bias: Option<f32>) -> f32 {
        let red = x.len();
        let pairs = red.div_ceil(2);
        let kc = k_block_pairs(pairs);
        let get = |p: usize| if p < red { (bf16_daz(f32_to_bf16_bits(x[p])), bf16_daz(w(p))) } else { (0.0, 0.0) };
        let mut v = init;
        for q0 in (0..pairs).step_by(kc) {
            let mut acc = 0f32;
            for q in q0..(q0 + kc).min(pairs) {
                let ((xe, we), (xo, wo)) = (get(2 * q), get(2 * q + 1));
                acc = step_exact(acc, xo, wo);
                acc = step_exact(acc, xe, we);
            }
            v = Some(v.map_or(acc, |v| v + acc));
        }
        let v = v.unwrap_or(0.0);
        bias.map_or(v, |b| v + b)
    }

    fn same_bits(got: f32, want: f32) -> bool {
        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
    }

    /// `f32_to_bf16_bits` is `half::bf16::from_f32` on every 61st of the 2^32 inputs, plus the
    /// special neighbourhoods; the AVX-512 strip conversion gives the same words.
    #[test]
    fn rounding_matches_half() {
        // zeros, denormals, the largest denormal (rounds up to a normal), ties, overflow, inf, NaN
        let specials = [0u32, 0x8000_0000, 0x0000_0001, 0x007f_ffff, 0x0080_0000, 0x007f_8000, 0x0000_8000, 0x3f80_8000, 0x3f81_8000];
        let specials = specials.into_iter().chain([0x3f80_8001, 0x7f7f_ffff, 0x7f7f_8000, 0x7f80_0000, 0xff80_0000, 0x7f80_0001, 0x7fc0_0000, 0xffff_ffff, 0x7fff_ffff]);
        let stride = if cfg!(debug_assertions) { 4099 } else { 61 };
        let mut bits: Vec<u32> = (0..=u32::MAX).step_by(stride).collect();
        for s in specials {
            for d in 0..64u32 {
                bits.push(s.wrapping_add(d));
                bits.push(s.wrapping_sub(d));
            }
        }
        for &b in &bits {
            let x = f32::from_bits(b);
            assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(x).to_bits(), "{b:#010x}");
            assert_eq!(f32_to_bf16(x).to_bits(), bf16::from_f32(x).to_bits());
        }
        if native_available() {
            let xs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let rows = 3;
            let red: usize = 2 * 16 * 5 + 7; // 84 pairs: 5 vector rounds, 3 scalar pairs, an odd element
            let pairs = red.div_ceil(2);
            for chunk in xs.chunks_exact(rows * red).take(2000) {
                let (mut a, mut b) = (vec![0u32; rows * pairs], vec![0u32; rows * pairs]);
                unsafe {
                    convert_strip(chunk.as_ptr(), red, rows, 0, pairs, a.as_mut_ptr(), true);
                    convert_strip(chunk.as_ptr(), red, rows, 0, pairs, b.as_mut_ptr(), false);
                }
                assert_eq!(a, b);
                assert_eq!(a[pairs - 1] as u16, bf16::from_f32(chunk[red - 1]).to_bits());
                assert_eq!(a[pairs - 1] >> 16, 0);
            }
        }
        // the AVX2 kernel's layout: the same bits as f32 values, a zero pad, each row's smallest
        // exponent (zero is 255, a denormal 0; sign ignored)
        for (h, e) in [(0u16, 255u8), (0x8000, 255), (0x0001, 0), (0x807f, 0), (0x0080, 1), (0x8080, 1), (0x2380, 71), (0xa3ff, 71), (0x3f80, 127), (0x7f80, 255), (0xffc1, 255)] {
            assert_eq!(bf16_exp(h), e, "{h:#06x}");
        }
        assert!(plain_fma_exact(71, 71) && plain_fma_exact(1, 141) && plain_fma_exact(141, 1));
        assert!(!plain_fma_exact(71, 70) && !plain_fma_exact(0, 255) && !plain_fma_exact(255, 0));
        // rows drawn from the whole list (every sign, exponent, special), shuffled
        let mut rng = Rng::new(4);
        let mut xs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        for i in (1..xs.len()).rev() {
            xs.swap(i, rng.next_u64() as usize % (i + 1));
        }
        let (rows, red) = (3, 67);
        let mut seen = [0usize; 256];
        for chunk in xs.chunks_exact(rows * red).take(20_000) {
            let (mut d, mut exps) = (vec![7f32; rows * (red + 1)], [9u8; 3]);
            unsafe { convert_wide(chunk.as_ptr(), red, rows, d.as_mut_ptr(), exps.as_mut_ptr()) };
            for r in 0..rows {
                let want: Vec<u16> = chunk[r * red..(r + 1) * red].iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
                let got = &d[r * (red + 1)..(r + 1) * (red + 1)];
                assert!(got[..red].iter().zip(&want).all(|(g, &w)| g.to_bits() == (w as u32) << 16));
                assert_eq!(got[red].to_bits(), 0);
                assert_eq!(exps[r], want.iter().map(|&h| bf16_exp(h)).min().unwrap());
                seen[exps[r] as usize] += 1;
            }
        }
        assert!(seen[0] > 0 && seen.iter().filter(|&&c| c > 0).count() > 20, "row minima: {seen:?}");
    }

    /// Packing keeps every value (`get`, `to_f32`), pads with zeros, and `from_bf16` packs the same words.
    #[test]
    fn packing_roundtrip() {
        let mut rng = Rng::new(1);
        for &(n, k) in &[(1, 1), (5, 3), (33, 64), (70, 641), (40, 1537)] {
            let w = normal(&mut rng, n * k);
            let pw = PackedBf16::from_f32(&w, n, k);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let pb = PackedBf16::from_bf16(&wb, n, k);
            assert_eq!(pw.bytes(), n.div_ceil(NR) * k.div_ceil(2) * NR * 4);
            assert!(pw.data.iter().zip(pb.data.iter()).all(|(a, b)| a.0 == b.0));
            let un = pw.to_f32();
            for j in 0..n {
                for p in 0..k {
                    assert_eq!(pw.get(j, p).to_bits(), wb[j * k + p].to_bits(), "({j},{p}) of [{n},{k}]");
                    assert_eq!(un[j * k + p], wb[j * k + p].to_f32());
                }
            }
            // padding: columns past n and the odd k's last high half are zero
            for q in 0..pw.pairs {
                for j in 0..pw.panels * NR {
                    let word = pw.word(j, q);
                    if j >= n {
                        assert_eq!(word, 0);
                    } else if 2 * q + 1 == k {
                        assert_eq!(word >> 16, 0);
                    }
                }
            }
        }
    }

    /// The `dy W` repack of a block equals the forward packing of Wᵀ (same words, same padding).
    #[test]
    fn dx_repack_is_packed_transpose() {
        let mut rng = Rng::new(2);
        for &(n, k) in &[(1, 1), (3, 5), (65, 33), (77, 700), (700, 77), (1537, 40)] {
            let w = normal(&mut rng, n * k);
            let pw = PackedBf16::from_f32(&w, n, k);
            let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
            let pt = PackedBf16::from_f32(&wt, k, n);
            for b in 0..pt.blocks() {
                let (t0, kb) = pt.block(b);
                for (p0, p1) in [(0, pt.panels), (pt.panels / 2, pt.panels)] {
                    let mut d = vec![0u32; (p1 - p0) * kb * NR];
                    unsafe { repack_dx(&pw, p0, p1, t0, kb, d.as_mut_ptr()) };
                    let off = pt.block_off(b) + p0 * kb * NR;
                    let want: Vec<u32> = (0..d.len()).map(|i| pt.data[(off + i) / 16].0[(off + i) % 16]).collect();
                    assert_eq!(d, want, "[{n}, {k}] block {b} panels {p0}..{p1}");
                }
            }
        }
    }

    /// (m, k, n): m = 1, 2, 8, 12, 13, 37, 100; k = 1, odd, not a multiple of 32, several k
    /// blocks (k > 640); n below, at and past panel edges.
    const SHAPES: &[(usize, usize, usize)] =
        &[(1, 1, 1), (1, 2, 3), (2, 7, 33), (13, 31, 32), (13, 64, 65), (100, 33, 97), (1, 576, 960), (8, 641, 40), (12, 1536, 70), (37, 1537, 100), (2, 2000, 129), (100, 577, 64), (45, 64, 97), (70, 1024, 100), (3, 130, 65), (5, 577, 40), (6, 64, 33), (7, 641, 96), (11, 200, 70)];

    /// x Wᵀ + b against an f64 reference on the bf16-rounded inputs, within the worst-case bound
    /// of a sequential f32 sum: |err| ≤ (k + blocks + 2)·u·(Σ|x·w| + |b|), u = 2⁻²⁴.
    #[test]
    fn matmul_matches_f64_reference() {
        let mut rng = Rng::new(3);
        for &(m, k, n) in SHAPES {
            let x = normal(&mut rng, m * k);
            let w = normal(&mut rng, n * k);
            let bias = normal(&mut rng, n);
            let pw = PackedBf16::from_f32(&w, n, k);
            let (xr, wr): (Vec<f64>, Vec<f64>) = (x.iter().map(|&v| bf16::from_f32(v).to_f64()).collect(), pw.to_f32().iter().map(|&v| v as f64).collect());
            let blocks = k.div_ceil(2).div_ceil(k_block_pairs(k.div_ceil(2)));
            for kernel in all_kernels() {
                for with_bias in [false, true] {
                    let mut out = vec![f32::NAN; m * n + 3];
                    matmul_bf16_with(&x, &pw, with_bias.then_some(&bias[..]), m, k, n, &mut out, kernel, true);
                    assert!(out[m * n..].iter().all(|v| v.is_nan()), "wrote past the output");
                    for i in 0..m {
                        for j in 0..n {
                            let (mut dot, mut mag) = (0f64, 0f64);
                            for p in 0..k {
                                dot += xr[i * k + p] * wr[j * k + p];
                                mag += (xr[i * k + p] * wr[j * k + p]).abs();
                            }
                            let b = if with_bias { bias[j] as f64 } else { 0.0 };
                            let tol = (k + blocks + 2) as f64 * U * (mag + b.abs());
                            let got = out[i * n + j] as f64;
                            assert!((got - dot - b).abs() <= tol, "{kernel:?} m{m} k{k} n{n} ({i},{j}): {got} vs {} (tol {tol:e})", dot + b);
                        }
                    }
                }
            }
        }
    }

    /// dx (+)= dy W against f64, both modes, within the same bound over the n-long sums.
    #[test]
    fn dx_matches_f64_reference() {
        let mut rng = Rng::new(4);
        for &(m, n, k) in SHAPES {
            let dy = normal(&mut rng, m * n);
            let w = normal(&mut rng, n * k);
            let dx0 = normal(&mut rng, m * k);
            let pw = PackedBf16::from_f32(&w, n, k);
            let (dr, wr): (Vec<f64>, Vec<f64>) = (dy.iter().map(|&v| bf16::from_f32(v).to_f64()).collect(), pw.to_f32().iter().map(|&v| v as f64).collect());
            let blocks = n.div_ceil(2).div_ceil(k_block_pairs(n.div_ceil(2)));
            for kernel in all_kernels() {
                for accumulate in [false, true] {
                    let mut dx = dx0.clone();
                    dx.push(f32::NAN);
                    matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, accumulate, kernel, true);
                    assert!(dx[m * k].is_nan(), "wrote past dx");
                    for i in 0..m {
                        for p in 0..k {
                            let (mut dot, mut mag) = (0f64, 0f64);
                            for j in 0..n {
                                dot += dr[i * n + j] * wr[j * k + p];
                                mag += (dr[i * n + j] * wr[j * k + p]).abs();
                            }
                            let init = if accumulate { dx0[i * k + p] as f64 } else { 0.0 };
                            let tol = (n + blocks + 2) as f64 * U * (mag + init.abs());
                            let got = dx[i * k + p] as f64;
                            assert!((got - dot - init).abs() <= tol, "{kernel:?} acc={accumulate} m{m} n{n} k{k} ({i},{p}): {got} vs {}", dot + init);
                        }
                    }
                }
            }
        }
    }

    /// Both kernels give the bits of `spec` (the documented order), forward with and without
    /// bias and dx in both modes, on shapes with several k blocks, odd k and partial panels.
    #[test]
    fn kernels_give_the_spec_bits() {
        let mut rng = Rng::new(5);
        for &(m, k, n) in SHAPES {
            let x = normal(&mut rng, m * k);
            let w = normal(&mut rng, n * k);
            let bias = normal(&mut rng, n);
            let dy = normal(&mut rng, m * n);
            let dx0 = normal(&mut rng, m * k);
            let pw = PackedBf16::from_f32(&w, n, k);
            let wb: Vec<u16> = w.iter().map(|&v| f32_to_bf16_bits(v)).collect();
            for kernel in kernels() {
                let mut out = vec![0f32; m * n];
                matmul_bf16_with(&x, &pw, Some(&bias), m, k, n, &mut out, kernel, true);
                for i in 0..m {
                    for j in 0..n {
                        let want = spec(&x[i * k..(i + 1) * k], |p| wb[j * k + p], None, Some(bias[j]));
                        assert!(same_bits(out[i * n + j], want), "{kernel:?} x·Wᵀ m{m} k{k} n{n} ({i},{j}): {} vs {want}", out[i * n + j]);
                    }
                }
                for accumulate in [false, true] {
                    let mut dx = dx0.clone();
                    matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, accumulate, kernel, true);
                    for i in 0..m {
                        for p in 0..k {
                            let want = spec(&dy[i * n..(i + 1) * n], |j| wb[j * k + p], accumulate.then_some(dx0[i * k + p]), None);
                            assert!(same_bits(dx[i * k + p], want), "{kernel:?} dy·W acc={accumulate} m{m} n{n} k{k} ({i},{p}): {} vs {want}", dx[i * k + p]);
                        }
                    }
                }
            }
        }
    }

    /// A row's bits do not depend on the other rows of the call, on its position, on the thread
    /// count, or on the kernel (native vs portable); with AMX, on the first three.
    #[test]
    fn rows_are_batch_invariant() {
        let mut rng = Rng::new(6);
        for &(m, k, n) in &[(100, 641, 70), (40, 1536, 200), (29, 577, 960), (70, 576, 96)] {
            let x = normal(&mut rng, m * k);
            let w = normal(&mut rng, n * k);
            let bias = normal(&mut rng, n);
            let pw = PackedBf16::from_f32(&w, n, k);
            let dy = normal(&mut rng, m * n);
            for kernel in all_kernels() {
                let reference = if kernel == Kernel::Amx { kernel } else { kernels()[0] };
                let mut all = vec![0f32; m * n];
                matmul_bf16_with(&x, &pw, Some(&bias), m, k, n, &mut all, reference, true);
                let mut all_dx = vec![0f32; m * k];
                matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut all_dx, false, reference, true);
                for threads in [1, 2, 3] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| {
                        // every row alone, and sub-batches of 2, 13 and 16 rows at odd offsets
                        for (r0, rows) in (0..m).map(|i| (i, 1)).chain([(3, 2), (5, 13), (m - 16, 16), (0, m)]) {
                            let mut out = vec![0f32; rows * n];
                            matmul_bf16_with(&x[r0 * k..(r0 + rows) * k], &pw, Some(&bias), rows, k, n, &mut out, kernel, threads > 1);
                            assert!(out.iter().zip(&all[r0 * n..(r0 + rows) * n]).all(|(a, b)| a.to_bits() == b.to_bits()), "{kernel:?} {threads} threads, rows {r0}+{rows} of m{m} k{k} n{n}");
                            let mut dx = vec![0f32; rows * k];
                            matmul_dx_bf16_with(&dy[r0 * n..(r0 + rows) * n], &pw, rows, n, k, &mut dx, false, kernel, threads > 1);
                            assert!(dx.iter().zip(&all_dx[r0 * k..(r0 + rows) * k]).all(|(a, b)| a.to_bits() == b.to_bits()), "dx: {kernel:?} {threads} threads, rows {r0}+{rows}");
                        }
                    });
                }
            }
        }
    }

    /// Tiny values: partial sums cross 2⁻¹²⁶ (flushed), bf16 denormals (read as zero), and the
    /// exact-±2⁻¹²⁶ edge the portable kernel redoes exactly: both kernels give `spec`'s bits,
    /// and the cases measured on this CPU's `vdpbf16ps` hold.
    #[test]
    fn denormals_flush_like_vdpbf16ps() {
        let p2 = |e: i32| 2f32.powi(e);
        // (x, w) over k = 4; pairs are (0,1), (2,3) and the odd element of a pair goes first
        let cases: &[([f32; 4], [f32; 4], f32)] = &[
            // 2⁻¹²⁶, then − 1.5·2⁻¹⁵¹: exact value rounds (24 bits) below 2⁻¹²⁶ → flushed to 0
            ([p2(-63), 0.0, p2(-75), 0.0], [p2(-63), 0.0, -1.5 * p2(-76), 0.0], 0.0),
            // − 2⁻¹⁵¹ is a tie that rounds back up to 2⁻¹²⁶: kept
            ([p2(-63), 0.0, p2(-75), 0.0], [p2(-63), 0.0, -p2(-76), 0.0], p2(-126)),
            // a product of −2⁻¹⁴⁰ alone is flushed to −0 (the last step; +0 + −0 would be +0)
            ([0.0, 0.0, p2(-70), 0.0], [0.0, 0.0, -p2(-70), 0.0], -0.0),
            // a bf16 denormal input reads as zero even against a huge weight (1.5 otherwise), in
            // x or in w (the AVX2 kernel checks each side)
            ([f32::from_bits(0x0040_0000), 0.0, 1.0, 0.0], [p2(126), 0.0, 1.0, 0.0], 1.0),
            ([p2(126), 0.0, 1.0, 0.0], [f32::from_bits(0x0040_0000), 0.0, 1.0, 0.0], 1.0),
            // after 1: the odd element of a pair is added first, each sum rounded:
            // 1 − 1 = 0, + 2⁻³⁰ = 2⁻³⁰; and 1 + 2⁻³⁰ = 1, − 1 = 0 (one rounding would give 2⁻³⁰ both)
            ([1.0, 0.0, p2(-30), -1.0], [1.0, 0.0, 1.0, 1.0], p2(-30)),
            ([1.0, 0.0, -1.0, p2(-30)], [1.0, 0.0, 1.0, 1.0], 0.0),
            // exponents one short of `plain_fma_exact` (71 + 70): products on the grid of 2⁻¹²⁷
            // cancel to 2⁻¹²⁷, flushed to +0 (a plain FMA keeps the denormal)
            ([p2(-56) * (1.0 + p2(-7)), 0.0, -p2(-56), 0.0], [p2(-57) * (1.0 + p2(-7)), 0.0, p2(-57) * (1.0 + p2(-6)), 0.0], 0.0),
        ];
        for kernel in kernels() {
            for (x, w, want) in cases {
                let pw = PackedBf16::from_f32(w, 1, 4);
                let mut out = [7f32];
                matmul_bf16_with(x, &pw, None, 1, 4, 1, &mut out, kernel, false);
                assert_eq!(out[0].to_bits(), want.to_bits(), "{kernel:?} x {x:?} w {w:?}: {} vs {want}", out[0]);
            }
        }
        // random tiny operands: products around 2⁻¹²⁶, sums crossing the boundary all the time;
        // both sides tiny, or one side (then x or w alone must send the AVX2 kernel to the
        // portable steps)
        let mut rng = Rng::new(7);
        let (m, k, n) = (13, 301, 45);
        for (xs, ws) in [(-63, -63), (-64, -63), (-66, -63), (0, -126), (-126, 0)] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32 * p2(xs)).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.normal() as f32 * p2(ws)).collect();
            let pw = PackedBf16::from_f32(&w, n, k);
            let wb: Vec<u16> = w.iter().map(|&v| f32_to_bf16_bits(v)).collect();
            let mut outs = vec![];
            for kernel in kernels() {
                let mut out = vec![0f32; m * n];
                matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, kernel, true);
                for i in 0..m {
                    for j in 0..n {
                        let want = spec(&x[i * k..(i + 1) * k], |p| wb[j * k + p], None, None);
                        assert_eq!(out[i * n + j].to_bits(), want.to_bits(), "{kernel:?} 2^{xs}, 2^{ws} ({i},{j})");
                    }
                }
                outs.push(out);
            }
            let zeros = outs[0].iter().filter(|v| **v == 0.0).count();
            assert!(zeros > 0 && zeros < m * n, "the case should mix flushed and kept sums ({zeros} zeros)");
        }
    }

    /// Random bit patterns (all exponents, specials, denormals; operands near 2⁻¹²⁶ half of the
    /// time) through k = 4 (the first pair sets an arbitrary accumulator): native, portable and
    /// `spec` agree bit for bit (NaN payloads aside).
    #[test]
    fn random_bits_match_spec() {
        let mut rng = Rng::new(9);
        let (m, k, n) = (12, 4, 64);
        let mut pick = |narrow: bool| {
            let b = rng.next_u64() as u32;
            let e = if narrow { 40 + (b >> 23) % 50 } else { (b >> 23) & 0xff };
            f32::from_bits((b & 0x807f_ffff) | e << 23)
        };
        for call in 0..600 {
            // 0: any exponent; 1: near 2⁻¹²⁶; 2: zeros and exponents ≥ 71 only, so the AVX2
            // kernel runs its plain FMAs (overflow, inf − inf, signed zeros included)
            let mode = call % 3;
            let mut draw = |_| {
                let v = pick(mode == 1);
                if mode != 2 || v.to_bits() & 0x7f80_0000 >= 71 << 23 {
                    v
                } else if v.to_bits() & 0x10 == 0 {
                    f32::from_bits(v.to_bits() & 0x8000_0000) // ±0
                } else {
                    f32::from_bits(v.to_bits() | 71 << 23)
                }
            };
            let x: Vec<f32> = (0..m * k).map(&mut draw).collect();
            let w: Vec<f32> = (0..n * k).map(&mut draw).collect();
            let pw = PackedBf16::from_f32(&w, n, k);
            let wb: Vec<u16> = w.iter().map(|&v| f32_to_bf16_bits(v)).collect();
            for kernel in kernels() {
                let mut out = vec![0f32; m * n];
                matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, kernel, false);
                for i in 0..m {
                    for j in 0..n {
                        let want = spec(&x[i * k..(i + 1) * k], |p| wb[j * k + p], None, None);
                        assert!(same_bits(out[i * n + j], want), "{kernel:?} x {:?} w {:?}: {} vs {want}", &x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k], out[i * n + j]);
                    }
                }
            }
        }
    }

    /// One row with a bf16 denormal among normal rows (in the second of two row batches, too):
    /// its strip takes the portable steps (the denormal reads as zero against a 2¹²⁶ weight,
    /// 0.5 otherwise), the others the plain FMAs; the AVX2 kernel gives the portable bits on
    /// 1–3 threads, forward and dx.
    #[test]
    fn a_tiny_row_among_normal_ones() {
        if !avx2_available() {
            eprintln!("note: no AVX2 on this CPU, the AVX2 kernel is not tested");
            return;
        }
        let mut rng = Rng::new(10);
        // 16 MiB / (3072 · 8 bytes) → row batches of 1356 rows in the AVX2 layout
        let (m, k, n) = (2800, 3072, 40);
        let mut x = normal(&mut rng, m * k);
        let mut w = normal(&mut rng, n * k);
        let mut dy = normal(&mut rng, m * n);
        w[3 * k + 5] = 2f32.powi(126);
        for r in [57, 1400] {
            x[r * k + 5] = f32::from_bits(0x0040_0000);
            dy[r * n + 3] = f32::from_bits(0x0040_0000);
        }
        let pw = PackedBf16::from_f32(&w, n, k);
        let (mut want, mut want_dx) = (vec![0f32; m * n], vec![0f32; m * k]);
        matmul_bf16_with(&x, &pw, None, m, k, n, &mut want, Kernel::Portable, true);
        matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut want_dx, false, Kernel::Portable, true);
        assert!(want[57 * n + 3].is_finite() && want_dx[57 * k + 5].is_finite());
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (mut out, mut dx) = (vec![0f32; m * n], vec![0f32; m * k]);
                matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, Kernel::Avx2, true);
                matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, false, Kernel::Avx2, true);
                for (got, want, what) in [(&out, &want, "x·Wᵀ"), (&dx, &want_dx, "dy·W")] {
                    let bad = got.iter().zip(want.iter()).position(|(a, b)| a.to_bits() != b.to_bits());
                    assert!(bad.is_none(), "{what}, {threads} threads: first difference at {bad:?}");
                }
            });
        }
    }

    /// NaN and ±inf: a NaN in a row of x makes that row NaN, a NaN in a row of W that column,
    /// inf·0 is NaN; the rest stays finite. Same positions for both kernels and for dx.
    #[test]
    fn nan_and_inf_propagate() {
        let (m, k, n) = (5, 67, 40);
        let mut rng = Rng::new(8);
        let mut x = normal(&mut rng, m * k);
        let mut w = normal(&mut rng, n * k);
        x[k + 66] = f32::NAN; // row 1, the odd k's last element
        w[3 * k + 10] = f32::NAN; // column 3
        x[3 * k + 5] = f32::INFINITY; // row 3 · column 7 (zero there): NaN; elsewhere ±inf
        w[7 * k + 5] = 0.0;
        let pw = PackedBf16::from_f32(&w, n, k);
        let expect_nan = |i: usize, j: usize| i == 1 || j == 3 || (i == 3 && j == 7);
        for kernel in kernels() {
            let mut out = vec![0f32; m * n];
            matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, kernel, true);
            for i in 0..m {
                for j in 0..n {
                    let v = out[i * n + j];
                    assert_eq!(v.is_nan(), expect_nan(i, j), "{kernel:?} ({i},{j}) = {v}");
                    if !expect_nan(i, j) {
                        assert_eq!(v.is_infinite(), i == 3, "{kernel:?} ({i},{j}) = {v}");
                    }
                }
            }
            // dx = dy W: a NaN in W's row 3 reaches every dx row whose dy[·,3] is nonzero, in column 10
            let dy = normal(&mut rng, m * n);
            let mut dx = vec![0f32; m * k];
            matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, false, kernel, true);
            for i in 0..m {
                for p in 0..k {
                    assert_eq!(dx[i * k + p].is_nan(), p == 10, "{kernel:?} dx ({i},{p})");
                }
            }
        }
    }

    /// Degenerate sizes: k = 0 (bias or zeros), n = 0 for dx (zeros or untouched), m = 0.
    #[test]
    fn degenerate_shapes() {
        let pw = PackedBf16::from_f32(&[], 3, 0);
        let mut out = vec![9f32; 6];
        matmul_bf16(&[], &pw, Some(&[1.0, 2.0, 3.0]), 2, 0, 3, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        matmul_bf16(&[], &pw, None, 2, 0, 3, &mut out);
        assert_eq!(out, [0.0; 6]);
        let pw = PackedBf16::from_f32(&[], 0, 4);
        let mut dx = vec![5f32; 8];
        matmul_dx_bf16(&[], &pw, 2, 0, 4, &mut dx, true);
        assert_eq!(dx, [5.0; 8]);
        matmul_dx_bf16(&[], &pw, 2, 0, 4, &mut dx, false);
        assert_eq!(dx, [0.0; 8]);
        let pw = PackedBf16::from_f32(&[1.0; 12], 3, 4);
        matmul_bf16(&[], &pw, None, 0, 4, 3, &mut []);
    }
}
