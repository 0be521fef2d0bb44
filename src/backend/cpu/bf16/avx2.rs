//! The AVX2 kernel (no AVX512_BF16): each pair row of a panel widened to f32 (shift / mask) and
//! the `vdpbf16ps` steps as `vfmadd231ps`, on strips whose operands pass `plain_fma_exact` (then these
//! FMAs are the native steps, see there). 16 ymm registers: 4 rows × 16 columns (8 accumulators,
//! 4 widened weight vectors reused by the 4 rows, 2 broadcasts), or 1 row × 32 columns.
use super::pack::NR;
use super::portable::Tile;
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
