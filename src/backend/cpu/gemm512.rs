//! `C = (accumulate ? C : 0) + alpha · A · B` with AVX-512: the GEMM behind every large product.
//!
//! Why our own: the `gemm` crate uses AVX2 microkernels on stable Rust; this kernel uses the
//! 512-bit FMAs and runs this transformer's shapes faster (`x Wᵀ` and `dy W`; measurements:
//! docs/log/code-notes.md), so it speeds up prefill, scoring and both passes of training.
//!
//! The idea (BLIS with one level dropped): B is packed per block of `kc × nc` into panels of
//! NR = 32 columns stored k-major, so the microkernel reads two aligned 16-lane vectors per k;
//! the panel stays in L2 while every MR = 12-row strip of A sweeps across it. A is not packed:
//! every caller's A has unit column stride, and a strip of 12 rows × kc is read straight from
//! its rows into broadcasts (packing it measured slower, since `n` is often small). 12 × 2
//! accumulators + 2 B vectors + 1 broadcast = 27 of the 32 zmm registers, no spills. (An A
//! with another layout, such as the transposed `dSᵀ` of the attention backward, has each strip
//! copied into a row-major scratch first.)
//! Column edges use masked loads/stores on zero-padded panels; row edges use the same kernel
//! with fewer rows (a const generic).
//!
//! Every output row is computed the same way whatever `m`, the thread count or the row's
//! position: the k-blocking depends only on `k`, and each row has its own accumulators. So a
//! sequence scores identically alone or in a batch, and results do not depend on threads.
use super::par::SendPtr;
use rayon::prelude::*;
use std::arch::x86_64::*;
use std::cell::RefCell;

const MR: usize = 12;
const NR: usize = 32;
/// Columns per packed B block: 1024 × kc floats stays within L2 + L3 share and amortizes packing.
const NC: usize = 1024;

/// Whether this machine runs the kernel (AVX-512F).
pub fn available() -> bool {
    super::simd::has_avx512f()
}

/// The depth of one k block: all of `k` up to 640 (a 12-row strip of A is then ≤ 30 KB, in L1),
/// else equal blocks of at most 512.
fn k_block(k: usize) -> usize {
    if k <= 640 {
        k
    } else {
        k.div_ceil(k.div_ceil(512))
    }
}

thread_local! {
    /// Packed-B scratch of the calling thread, reused across calls (attention calls this in
    /// loops; reallocating each time showed up in profiles).
    static PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// # Safety
/// `available()` must be true. A is `[m, k]` with strides `(a_rs, a_cs)`; B is
/// `[k, n]` with strides `(b_rs, b_cs)`; C is `[m, n]` with row stride `ldc` and unit column
/// stride. All extents must be valid and C must not alias A or B.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(m: usize, n: usize, k: usize, c: *mut f32, ldc: usize, accumulate: bool, a: *const f32, a_rs: isize, a_cs: isize, b: *const f32, b_rs: isize, b_cs: isize, alpha: f32, parallel: bool) {
    debug_assert!(available());
    if m == 0 || n == 0 || k == 0 {
        return; // callers handle k == 0 (zeroing) before dispatching here
    }
    let kc = k_block(k);
    let nc = NC.min(n.next_multiple_of(NR));
    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    let mut pack = PACK.with(|p| std::mem::take(&mut *p.borrow_mut()));
    if pack.len() < kc * nc {
        pack.resize(kc * nc, 0.0); // grown only: pack_b writes every element a panel uses
    }
    let (cp, ap, bp, pk) = (SendPtr(c), SendPtr(a as *mut f32), SendPtr(b as *mut f32), SendPtr(pack.as_mut_ptr()));
    for pc in (0..k).step_by(kc) {
        let kb = kc.min(k - pc);
        // The first k block writes C (or adds to it when accumulating); later ones add.
        let overwrite = pc == 0 && !accumulate;
        for jc in (0..n).step_by(nc) {
            let nb = nc.min(n - jc);
            let panels = nb.div_ceil(NR);
            let pack_panel = |q: usize| pack_b(pk.get().add(q * kb * NR), bp.get(), b_rs, b_cs, pc, kb, jc + q * NR, NR.min(n - jc - q * NR));
            if threads > 1 && panels > 1 {
                (0..panels).into_par_iter().for_each(pack_panel);
            } else {
                (0..panels).for_each(pack_panel);
            }
            // Rows are split into about 4 strips per thread for balance, each a multiple of MR.
            let strip = if threads > 1 { m.div_ceil(threads * 4).next_multiple_of(MR) } else { m };
            let run = |s: usize| {
                let (r0, r1) = (s * strip, ((s + 1) * strip).min(m));
                let mut strip_a = if a_cs == 1 { Vec::new() } else { vec![0f32; MR * kb] };
                let mut i = r0;
                while i < r1 {
                    let rows = MR.min(r1 - i);
                    let at = |r: usize, p: usize| ap.get().offset((i + r) as isize * a_rs + (pc + p) as isize * a_cs);
                    let (a, lda) = if a_cs == 1 {
                        (at(0, 0) as *const f32, a_rs as usize)
                    } else {
                        for p in 0..kb {
                            for r in 0..rows {
                                strip_a[r * kb + p] = *at(r, p);
                            }
                        }
                        (strip_a.as_ptr(), kb)
                    };
                    for q in 0..panels {
                        let j0 = jc + q * NR;
                        let t = Tile { kb, a, lda, b: pk.get().add(q * kb * NR), c: cp.get().add(i * ldc + j0), ldc, cols: NR.min(n - j0), overwrite, alpha };
                        t.run(rows);
                    }
                    i += rows;
                }
            };
            let strips = m.div_ceil(strip);
            if strips > 1 {
                (0..strips).into_par_iter().for_each(run);
            } else {
                run(0);
            }
        }
    }
    PACK.with(|p| *p.borrow_mut() = pack);
}

/// Pack `B[pc..pc+kb, j0..j0+w]` into one k-major panel of NR columns, zero-padded past `w`.
unsafe fn pack_b(dst: *mut f32, b: *const f32, b_rs: isize, b_cs: isize, pc: usize, kb: usize, j0: usize, w: usize) {
    if b_cs == 1 && w == NR {
        // Row-major B (`dy · W`): each k row of the panel is a contiguous copy.
        for p in 0..kb {
            std::ptr::copy_nonoverlapping(b.offset((pc + p) as isize * b_rs + j0 as isize), dst.add(p * NR), NR);
        }
        return;
    }
    // Column-major B (`x · Wᵀ`: a column of B is a row of W): walk each column contiguously.
    for jj in 0..NR {
        if jj < w {
            let src = b.offset(pc as isize * b_rs + (j0 + jj) as isize * b_cs);
            for p in 0..kb {
                *dst.add(p * NR + jj) = *src.offset(p as isize * b_rs);
            }
        } else {
            for p in 0..kb {
                *dst.add(p * NR + jj) = 0.0;
            }
        }
    }
}

/// One microkernel call: up to MR rows of A against one packed panel, into `cols` ≤ NR columns of C.
struct Tile {
    kb: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    overwrite: bool,
    alpha: f32,
}

impl Tile {
    unsafe fn run(&self, rows: usize) {
        match rows {
            12 => self.kernel::<12>(),
            11 => self.kernel::<11>(),
            10 => self.kernel::<10>(),
            9 => self.kernel::<9>(),
            8 => self.kernel::<8>(),
            7 => self.kernel::<7>(),
            6 => self.kernel::<6>(),
            5 => self.kernel::<5>(),
            4 => self.kernel::<4>(),
            3 => self.kernel::<3>(),
            2 => self.kernel::<2>(),
            1 => self.kernel::<1>(),
            _ => unreachable!("tile rows {rows} > MR"),
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn kernel<const R: usize>(&self) {
        let mut lo = [_mm512_setzero_ps(); R];
        let mut hi = [_mm512_setzero_ps(); R];
        for p in 0..self.kb {
            let b0 = _mm512_loadu_ps(self.b.add(p * NR));
            let b1 = _mm512_loadu_ps(self.b.add(p * NR + 16));
            for r in 0..R {
                let av = _mm512_set1_ps(*self.a.add(r * self.lda + p));
                lo[r] = _mm512_fmadd_ps(av, b0, lo[r]);
                hi[r] = _mm512_fmadd_ps(av, b1, hi[r]);
            }
        }
        let w = self.cols;
        let m0: __mmask16 = if w >= 16 { 0xffff } else { ((1u32 << w) - 1) as u16 };
        let m1: __mmask16 = if w >= 32 { 0xffff } else if w <= 16 { 0 } else { ((1u32 << (w - 16)) - 1) as u16 };
        let al = _mm512_set1_ps(self.alpha);
        for r in 0..R {
            let cr = self.c.add(r * self.ldc);
            let mut v0 = _mm512_mul_ps(lo[r], al);
            let mut v1 = _mm512_mul_ps(hi[r], al);
            if !self.overwrite {
                v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, cr), v0);
                v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, cr.add(16)), v1);
            }
            _mm512_mask_storeu_ps(cr, m0, v0);
            _mm512_mask_storeu_ps(cr.add(16), m1, v1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape class (row/column edges, several k blocks, both B layouts, accumulate,
    /// alpha, serial and parallel) against an f64 reference.
    #[test]
    fn matches_f64_reference() {
        if !available() {
            eprintln!("skipped: no AVX-512F on this CPU (the gemm crate serves every product)");
            return;
        }
        let mut rng = crate::util::rng::Rng::new(11);
        for &(m, k, n) in &[(1, 1, 1), (5, 3, 31), (12, 64, 32), (13, 100, 33), (37, 641, 65), (50, 1536, 40), (200, 576, 1100)] {
            for &(b_col_major, accumulate, alpha, parallel) in &[(true, false, 1.0f32, true), (false, true, 0.5, false), (true, true, -2.0, false), (false, false, 1.0, true)] {
                let lda = k + 3;
                let ldc = n + 5;
                // A row-major (row stride k + 3) or, for half the cases, transposed in memory
                // (element (i, p) at p·(m + 2) + i), which takes the strip-copy path
                let (a_rs, a_cs) = if b_col_major { (lda as isize, 1isize) } else { (1isize, (m + 2) as isize) };
                let a: Vec<f32> = (0..m.max(k) * (lda.max(m + 2))).map(|_| rng.normal() as f32).collect();
                let at = |i: usize, p: usize| a[(i as isize * a_rs + p as isize * a_cs) as usize];
                let bv: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
                let (b_rs, b_cs) = if b_col_major { (1isize, k as isize) } else { (n as isize, 1isize) };
                let c0: Vec<f32> = (0..m * ldc).map(|_| rng.normal() as f32).collect();
                let mut c = c0.clone();
                unsafe { gemm(m, n, k, c.as_mut_ptr(), ldc, accumulate, a.as_ptr(), a_rs, a_cs, bv.as_ptr(), b_rs, b_cs, alpha, parallel) };
                for i in 0..m {
                    for j in 0..ldc {
                        let got = c[i * ldc + j] as f64;
                        if j >= n {
                            assert_eq!(got, c0[i * ldc + j] as f64, "wrote past column {n} (m{m} k{k} n{n})");
                            continue;
                        }
                        let dot: f64 = (0..k).map(|p| at(i, p) as f64 * bv[(p as isize * b_rs + j as isize * b_cs) as usize] as f64).sum();
                        let want = if accumulate { c0[i * ldc + j] as f64 } else { 0.0 } + alpha as f64 * dot;
                        let tol = 2e-6 * (k as f64).sqrt() * (alpha.abs() as f64).max(1.0) * 4.0 + 1e-6;
                        assert!((got - want).abs() < tol, "m{m} k{k} n{n} col_major={b_col_major} acc={accumulate} ({i},{j}): {got} vs {want}");
                    }
                }
            }
        }
    }

    /// A row's result does not depend on how many rows are multiplied with it or on threads.
    #[test]
    fn rows_are_batch_invariant() {
        if !available() {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let mut rng = crate::util::rng::Rng::new(5);
        let (m, k, n) = (61, 700, 70);
        let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
        let mut all = vec![0f32; m * n];
        unsafe { gemm(m, n, k, all.as_mut_ptr(), n, false, a.as_ptr(), k as isize, 1, b.as_ptr(), 1, k as isize, 1.0, true) };
        for i in [0, 7, 60] {
            let mut one = vec![0f32; n];
            unsafe { gemm(1, n, k, one.as_mut_ptr(), n, false, a.as_ptr().add(i * k), k as isize, 1, b.as_ptr(), 1, k as isize, 1.0, false) };
            assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
        }
    }
}
