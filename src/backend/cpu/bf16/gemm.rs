//! The driver of the bf16 products (BLIS with B packed at load): `matmul_bf16` (`x Wᵀ`),
//! `matmul_dx_bf16` (`dy W`), and the variants that fuse the thin LoRA products (`Tail`) or SwiGLU.
//!
//! x is converted to bf16 pairs once per call (in row batches of ≤ 16 MiB, rayon over rows). A task
//! owns a run of panels (its k block ≤ 512 KiB, kept in L2) and a range of rows; per k block it
//! sweeps strips of rows over its panels on the chosen microkernel (`kernel::Micro`). Tasks (runs
//! of panels × row ranges, ~4 per thread) go to rayon, each reading its panels from memory once;
//! decode (one strip, or ≤ 16 rows) splits columns only, so every weight byte is read from memory
//! once per call.
//!
//! **`dy · W`** needs pairs along n instead. A second packed copy kept with the weight would
//! double its memory, so each call repacks W, every k block of this product (pairs of W's rows)
//! and output panel, from the forward layout into the same block-major panel format (a shuffle of
//! bf16 words, no rounding; in parallel, into the calling thread's scratch, 2·n·k bytes; O(n·k) per
//! call against O(m·n·k) products), and the tasks run the same kernel on it.
use super::kernel::{Kernel, Micro};
use super::pack::{f32_to_bf16_bits, k_block_pairs, plain_fma_exact, PackedBf16, AMX_MR, MR, NR, TILE_STEP};
use super::portable::Tile;
use super::thin::{BfB, Out};
#[cfg(target_arch = "x86_64")]
use super::amx;
#[cfg(target_arch = "x86_64")]
use super::avx2;
#[cfg(target_arch = "x86_64")]
use super::avx512;
use crate::backend::cpu::arena::Line;
use crate::backend::cpu::par::SendPtr;
use rayon::prelude::*;
use std::cell::RefCell;

/// Packed bytes of one task's panels in one k block: about half of a 1 MiB L2.
pub(super) const CHUNK_BYTES: usize = 512 << 10;
/// At most this much of A is converted to bf16 at a time (longer products go in row batches).
pub(super) const CONVERTED_BYTES: usize = 16 << 20;
/// Rows per parallel piece of the conversion.
pub(super) const CONVERT_ROWS: usize = 64;

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
/// `C[i, col0 + j] += alpha · Σ_l bf(u[i, l]) · B[l, j]` for `j < ncols` (`bf16::thin::product_bf`,
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
pub(super) enum Source<'a> {
    /// `x Wᵀ`: the stored panels themselves.
    Forward(&'a PackedBf16),
    /// `dy W`: panels of Wᵀ repacked per k block into scratch.
    Transposed(&'a PackedBf16),
}

/// One product `C[m, cols] (+)= A[m, red] · B` with B in packed panels over `cols`, pairs over `red`.
pub(super) struct Job<'a> {
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
                        super::thin::products_bf(i1 - i0, rows_f32, self.red, 1, &outs, 1.0, false, false);
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
                super::thin::product_bf(rows, t.u.get().add(i * t.ldu), t.ldu, 1, &*t.b.0, j0 - t.col0, j1 - t.col0, c.add(j0 - lo), ldc, t.alpha, true, self.micro == Micro::Amx);
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
                    crate::backend::cpu::simd::silu_mul(&sums[0].0[r * NR..(r + 1) * NR], &sums[1].0[r * NR..(r + 1) * NR], out);
                }
            }
            i += AMX_MR;
        }
        amx::release();
    }
}

/// Rows `0..rows` of A (row stride `red`), pairs `q0..q0+kb`, to bf16 pair words `dst[r·kb + q]`
/// (an odd reduction's last pair gets a zero high half).
pub(super) unsafe fn convert_strip(a: *const f32, red: usize, rows: usize, q0: usize, kb: usize, dst: *mut u32, native: bool) {
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
pub(super) unsafe fn convert_tiles(a: *const f32, red: usize, rows: usize, pairs: usize, dst: *mut u32) {
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
pub(super) unsafe fn convert_wide(a: *const f32, red: usize, rows: usize, dst: *mut f32, exps: *mut u8) {
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
pub(super) unsafe fn repack_dx(w: &PackedBf16, p0: usize, p1: usize, t0: usize, kb: usize, dst: *mut u32) {
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

impl Tile {
    /// Runs the widest call for `rows` (4 panels for 1–2 rows, 2 for 3–4, else 1) that `avail`
    /// panels allow; returns the panels done.
    pub(super) unsafe fn run(&self, rows: usize, avail: usize, micro: Micro) -> usize {
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

}
