//! What this machine can deliver, measured in a second or two: the memory read bandwidth (one
//! thread and the pool's threads) and the register-resident `vdpbf16ps` and f32 FMA peaks on every
//! thread — the bounds the CPU kernels are judged against (`infomem-engine machine`; the criterion
//! `machine` group runs the same peak loops, and its own 1 GiB read).
//!
//! Why in the binary: a shared VM's bounds move within minutes (an example: docs/log/code-notes.md),
//! so a side-by-side run means little without the host's state at that time; `tools/bench-compare.sh` and
//! `tools/rollout-compare.sh` record it before and after their runs from the same binary.
use rayon::prelude::*;
use std::time::Instant;

/// One measurement of the machine. Rates are the median of `passes` timed passes.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Probe {
    /// threads of the pool (the "all threads" figures)
    pub threads: usize,
    /// bytes read per pass (a buffer much larger than the last-level cache, for the real bound)
    pub read_bytes: usize,
    /// GiB/s summing the buffer on one thread
    pub read_gib_s_1: f64,
    /// GiB/s summing it on every thread of the pool (1 MiB chunks)
    pub read_gib_s_all: f64,
    /// GFLOP/s of `vdpbf16ps` on every thread (4 FLOPs per f32 lane: two products, two adds), if
    /// the CPU has AVX512_BF16
    pub bf16_gflop_s: Option<f64>,
    /// GFLOP/s of f32 fused multiply-adds on every thread (AVX-512, else AVX2), if either
    pub f32_gflop_s: Option<f64>,
    /// which f32 FMA loop ran: "avx512" or "avx2"
    pub f32_isa: Option<&'static str>,
}

/// Passes per rate (the median is reported).
const PASSES: usize = 5;

/// The full probe's buffer: 512 MiB, far past any last-level cache, so the rate is DRAM's.
pub const READ_MB: usize = 512;
/// The full probe's peak loops: iterations a pass, ~10 ms at one instruction a cycle.
pub const PEAK_ITERS: usize = 1 << 21;

/// `read_bytes` read per pass and `iters` iterations of the peak loops (16 instructions each, 12
/// for AVX2) per pass; the full probe is `probe_with(READ_MB << 20, PEAK_ITERS)`.
pub fn probe_with(read_bytes: usize, iters: usize) -> Probe {
    let iters = iters.max(1);
    let threads = rayon::current_num_threads();
    let words = (read_bytes / 8).max(1);
    // written once, so every page is backed before the timed passes
    let buf: Vec<u64> = (0..words).into_par_iter().map(|i| i as u64).collect();
    let sum = |s: &[u64]| s.iter().fold(0u64, |a, &v| a.wrapping_add(v));
    let gib = (words * 8) as f64 / (1u64 << 30) as f64;
    let read_gib_s_1 = gib / median_secs(|| {
        std::hint::black_box(sum(&buf));
    });
    let read_gib_s_all = gib / median_secs(|| {
        std::hint::black_box(buf.par_chunks(1 << 17).map(sum).reduce(|| 0, u64::wrapping_add));
    });
    drop(buf);
    let (mut bf16_gflop_s, mut f32_gflop_s, mut f32_isa) = (None, None, None);
    #[cfg(target_arch = "x86_64")]
    {
        use peak::{FLOPS_AVX2, FLOPS_BF16, FLOPS_FMA};
        let all = |f: unsafe fn(usize) -> f32, flops_per_iter: usize| {
            let flops = (threads * iters * flops_per_iter) as f64;
            // Safety: each caller checked the loop's CPU features first
            flops / median_secs(|| {
                rayon::broadcast(|_| std::hint::black_box(unsafe { f(iters) }));
            }) / 1e9
        };
        if super::simd::has_avx512bf16() {
            bf16_gflop_s = Some(all(peak::bf16, FLOPS_BF16));
        }
        if super::simd::has_avx512f() {
            (f32_gflop_s, f32_isa) = (Some(all(peak::fma, FLOPS_FMA)), Some("avx512"));
        } else if super::simd::has_avx2_fma() {
            (f32_gflop_s, f32_isa) = (Some(all(peak::fma_avx2, FLOPS_AVX2)), Some("avx2"));
        }
    }
    Probe { threads, read_bytes: words * 8, read_gib_s_1, read_gib_s_all, bf16_gflop_s, f32_gflop_s, f32_isa }
}

/// The median wall time of `PASSES` runs of `f`, after one untimed run (faults, frequency ramp).
fn median_secs(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..PASSES)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[PASSES / 2].max(1e-9)
}

/// The peak loops: one instruction on 16 (12 for AVX2) independent accumulators, so neither the
/// instruction's latency nor memory limits them.
#[cfg(target_arch = "x86_64")]
pub mod peak {
    use std::arch::x86_64::*;
    /// The accumulators `peak_loop!` spells out (zmm0–15; the FLOP counts multiply by this, so
    /// it must match the assembly): more than latency × throughput (6 cycles × 2 per cycle).
    pub const ACC: usize = 16;
    /// FLOPs per iteration of each loop: `vdpbf16ps` does 2 products and 2 adds per f32 lane, an
    /// FMA 1 and 1; 16 lanes a zmm, 8 a ymm. Each loop's folded sum is `iters · FLOPS / 256`
    /// (every FLOP pair adds 2⁻⁷), which the tests check exactly.
    pub const FLOPS_BF16: usize = ACC * 16 * 4;
    pub const FLOPS_FMA: usize = ACC * 16 * 2;
    pub const FLOPS_AVX2: usize = ACC_AVX2 * 8 * 2;

    /// `op zmm_i, w, x` on 16 accumulators in zmm0–15, 16 per iteration, `iters` times, then
    /// the 16 folded into one so that none of the work is dead. In assembly: with intrinsics
    /// over an array of accumulators rustc kept them on the stack (a load and a store around
    /// every `vdpbf16ps`), which measured 182 GFLOP/s on a Zen 4 whose GEMM runs 420.
    macro_rules! peak_loop {
        ($op:literal, $w:expr, $x:expr, $iters:expr) => {{
            let sum: __m512;
            std::arch::asm!(
                "vxorps zmm0, zmm0, zmm0", "vmovaps zmm1, zmm0", "vmovaps zmm2, zmm0", "vmovaps zmm3, zmm0",
                "vmovaps zmm4, zmm0", "vmovaps zmm5, zmm0", "vmovaps zmm6, zmm0", "vmovaps zmm7, zmm0",
                "vmovaps zmm8, zmm0", "vmovaps zmm9, zmm0", "vmovaps zmm10, zmm0", "vmovaps zmm11, zmm0",
                "vmovaps zmm12, zmm0", "vmovaps zmm13, zmm0", "vmovaps zmm14, zmm0", "vmovaps zmm15, zmm0",
                "2:",
                concat!($op, " zmm0, {w}, {x}"), concat!($op, " zmm1, {w}, {x}"), concat!($op, " zmm2, {w}, {x}"), concat!($op, " zmm3, {w}, {x}"),
                concat!($op, " zmm4, {w}, {x}"), concat!($op, " zmm5, {w}, {x}"), concat!($op, " zmm6, {w}, {x}"), concat!($op, " zmm7, {w}, {x}"),
                concat!($op, " zmm8, {w}, {x}"), concat!($op, " zmm9, {w}, {x}"), concat!($op, " zmm10, {w}, {x}"), concat!($op, " zmm11, {w}, {x}"),
                concat!($op, " zmm12, {w}, {x}"), concat!($op, " zmm13, {w}, {x}"), concat!($op, " zmm14, {w}, {x}"), concat!($op, " zmm15, {w}, {x}"),
                "dec {n}", "jnz 2b",
                "vaddps zmm0, zmm0, zmm1", "vaddps zmm2, zmm2, zmm3", "vaddps zmm4, zmm4, zmm5", "vaddps zmm6, zmm6, zmm7",
                "vaddps zmm8, zmm8, zmm9", "vaddps zmm10, zmm10, zmm11", "vaddps zmm12, zmm12, zmm13", "vaddps zmm14, zmm14, zmm15",
                "vaddps zmm0, zmm0, zmm2", "vaddps zmm4, zmm4, zmm6", "vaddps zmm8, zmm8, zmm10", "vaddps zmm12, zmm12, zmm14",
                "vaddps zmm0, zmm0, zmm4", "vaddps zmm8, zmm8, zmm12", "vaddps zmm0, zmm0, zmm8",
                w = in(zmm_reg) $w, x = in(zmm_reg) $x, n = inout(reg) $iters.max(1) => _,
                out("zmm0") sum, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                options(nomem, nostack),
            );
            _mm512_reduce_add_ps(sum)
        }};
    }

    /// `vdpbf16ps`: 16 lanes × 2 products (4 FLOPs per lane); returns the folded sums,
    /// `iters · ACC · 16 · 2 · 2⁻⁷` (what the test checks: the loop ran `iters` times).
    ///
    /// # Safety
    /// The CPU has AVX512_BF16 (with AVX-512F).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn bf16(iters: usize) -> f32 {
        let w = _mm512_set1_epi32(0x3f80_3f80); // bf16 pairs (1, 1)
        let x = _mm512_set1_epi32(0x3c00_3c00); // (2⁻⁷, 2⁻⁷)
        peak_loop!("vdpbf16ps", w, x, iters)
    }

    /// f32 FMAs (two FLOPs per lane); returns `iters · ACC · 16 · 2⁻⁷`.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma(iters: usize) -> f32 {
        let (w, x) = (_mm512_set1_ps(1.0), _mm512_set1_ps(1.0 / 128.0));
        peak_loop!("vfmadd231ps", w, x, iters)
    }

    /// 12 of the 16 ymm registers: more than latency × throughput (4–5 cycles × 2 per cycle).
    pub const ACC_AVX2: usize = 12;

    /// f32 FMAs on 8 lanes, 12 accumulators in ymm0–11; returns `iters · ACC_AVX2 · 8 · 2⁻⁷`. In
    /// assembly like the zmm loops: with intrinsics LLVM turned `fma(1.0, x, acc)` into an add,
    /// which issues on fewer ports on some CPUs than an FMA.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(iters: usize) -> f32 {
        let (w, x) = (_mm256_set1_ps(1.0), _mm256_set1_ps(1.0 / 128.0));
        let sum: __m256;
        std::arch::asm!(
            "vxorps ymm0, ymm0, ymm0", "vmovaps ymm1, ymm0", "vmovaps ymm2, ymm0", "vmovaps ymm3, ymm0",
            "vmovaps ymm4, ymm0", "vmovaps ymm5, ymm0", "vmovaps ymm6, ymm0", "vmovaps ymm7, ymm0",
            "vmovaps ymm8, ymm0", "vmovaps ymm9, ymm0", "vmovaps ymm10, ymm0", "vmovaps ymm11, ymm0",
            "2:",
            "vfmadd231ps ymm0, {w}, {x}", "vfmadd231ps ymm1, {w}, {x}", "vfmadd231ps ymm2, {w}, {x}", "vfmadd231ps ymm3, {w}, {x}",
            "vfmadd231ps ymm4, {w}, {x}", "vfmadd231ps ymm5, {w}, {x}", "vfmadd231ps ymm6, {w}, {x}", "vfmadd231ps ymm7, {w}, {x}",
            "vfmadd231ps ymm8, {w}, {x}", "vfmadd231ps ymm9, {w}, {x}", "vfmadd231ps ymm10, {w}, {x}", "vfmadd231ps ymm11, {w}, {x}",
            "dec {n}", "jnz 2b",
            "vaddps ymm0, ymm0, ymm1", "vaddps ymm2, ymm2, ymm3", "vaddps ymm4, ymm4, ymm5", "vaddps ymm6, ymm6, ymm7",
            "vaddps ymm8, ymm8, ymm9", "vaddps ymm10, ymm10, ymm11",
            "vaddps ymm0, ymm0, ymm2", "vaddps ymm4, ymm4, ymm6", "vaddps ymm8, ymm8, ymm10",
            "vaddps ymm0, ymm0, ymm4", "vaddps ymm0, ymm0, ymm8",
            w = in(ymm_reg) w, x = in(ymm_reg) x, n = inout(reg) iters.max(1) => _,
            out("ymm0") sum, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
            out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            options(nomem, nostack),
        );
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        lanes.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    /// Each peak loop did its `iters` iterations on every accumulator with the instruction it is
    /// credited with: its folded sum is `iters · FLOPS / 256` exactly (multiples of 2⁻⁷ far
    /// below 2²⁴ · 2⁻⁷), so a loop that ran fewer instructions, dropped one, or a FLOP constant
    /// that does not match its loop (lanes, accumulators, FLOPs per lane) gives another number.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn peak_loops_do_the_work_they_are_credited_with() {
        use super::peak;
        let iters = 1000usize;
        if super::super::simd::has_avx512bf16() {
            assert_eq!(unsafe { peak::bf16(iters) }, (iters * peak::FLOPS_BF16) as f32 / 256.0);
        }
        if super::super::simd::has_avx512f() {
            assert_eq!(unsafe { peak::fma(iters) }, (iters * peak::FLOPS_FMA) as f32 / 256.0);
        }
        if super::super::simd::has_avx2_fma() {
            assert_eq!(unsafe { peak::fma_avx2(iters) }, (iters * peak::FLOPS_AVX2) as f32 / 256.0);
        }
    }

    /// A small probe returns finite, positive rates, the buffer size asked, and a peak exactly
    /// where the CPU has the instruction.
    #[test]
    fn a_small_probe_reports_what_it_measured() {
        let p = super::probe_with(8 << 20, 1 << 12);
        assert_eq!(p.read_bytes, 8 << 20);
        assert_eq!(p.threads, rayon::current_num_threads());
        for r in [p.read_gib_s_1, p.read_gib_s_all] {
            assert!(r.is_finite() && r > 0.0, "read rate {r}");
        }
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(p.bf16_gflop_s.is_some(), super::super::simd::has_avx512bf16());
            assert_eq!(p.f32_gflop_s.is_some(), super::super::simd::has_avx512f() || super::super::simd::has_avx2_fma());
        }
        for r in [p.bf16_gflop_s, p.f32_gflop_s].into_iter().flatten() {
            assert!(r.is_finite() && r > 0.0, "peak {r}");
        }
    }
}
