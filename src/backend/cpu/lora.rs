//! LoRA on the CPU (twin of `lora` and `lora_bwd` in src/backend/cuda/gemm.rs): the delta
//! `y[:, col0..col0+n] += s·(x Aᵀ) Bᵀ` and its backward, with `u = x Aᵀ` recomputed:
//! `dB += s·dyᵀ u`, `du = s·dy B`, `dA += duᵀ x`, `dx += du A`.
//!
//! Every one of these products has a thin side, the rank r (8–64). A packed GEMM spends more on
//! packing than on such a product, and five separate passes over `x` `[m, k]` and `dy` `[m, n]`
//! made the backward memory-bound (~50 GFLOP/s, a quarter of a bf16 training step). Here the rows
//! go in blocks of `BLOCK`: a block does all of its products while its rows of x and dy are in
//! L2, each on one unpacked kernel (AVX-512, or its AVX2 twin), `C (+)= α·A·B` with B's rows
//! contiguous and A read by broadcasts at any strides (`product`); A and B are transposed once
//! per call so that every product has that form (for a decode step's few rows, x is transposed
//! instead: `lora_few`).
//! The sums of dA and dB are taken per fixed `CHUNK` of rows (counted from the call's first row)
//! and the partials added in order, so they do not depend on the thread count; each row's
//! output and dx come from the same FMA chain whatever the row count, so they do not depend on
//! how rows were batched either.
//!
//! With a bf16 weight the pairs are fused into the projection's GEMM (`matmul_lora`,
//! `matmul_dx_lora`): the same products, computed while the GEMM has the rows in cache (x in
//! the forward, dy in the backward: each read from memory once for the GEMM and the pairs), and
//! the pairs on one input (q/k/v, gate/up) read x once for all of them (`bwd_pairs`). Under
//! `--dtype bf16` (`lora_bf16`, `lora_bwd_bf16`, the fused ops) every one of them reads bf16
//! operands and sums in f32, as CUDA's (`products_bf`): on AMX a tile product per 32-row
//! strip and 32-column panel (without AMX, the `vdpbf16ps` kernel on the same operands where
//! AVX512_BF16 is, else the f32 kernel on rounded values), B rounded once (`BfB`; A's and B's
//! kept in their `CpuBuf`s, `Shadow`), the m-reductions (dA, dB) with the block's rows as B's
//! pairs (`src/backend/cpu/bf16/thin.rs`; measurements: docs/log/code-notes.md).
use super::bf16::thin::{op, product, product_bf, products_bf, BfB, Op, Out, Shadow};
use super::bf16::{matmul_bf16_tails, matmul_bf16_with, matmul_dx_bf16_hooked, matmul_dx_bf16_tails, matmul_swiglu_bf16_tails, swiglu_fusable, Kernel, PackedBf16, RowHook, Tail, TailU, Tiles};
use super::par::SendPtr;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Rows per block: x and dy rows of a block (≤ 64 × 1536 f32 each) stay in L2.
const BLOCK: usize = 64;
/// Rows per partial dA/dB (a rayon task); fixed, so the sums do not depend on the thread count.
const CHUNK: usize = 256;

/// `t[c, r] = m[r, c]` for a row-major `[rows, cols]` matrix, as a new buffer.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert!(m.len() >= rows * cols, "transpose: {} elements for [{rows}, {cols}]", m.len());
    let mut t = vec![0f32; rows * cols];
    // Safety: both extents are rows × cols (checked above), in distinct buffers.
    unsafe { super::memory::transpose(m.as_ptr(), cols, rows, cols, t.as_mut_ptr(), rows) };
    t
}

/// `out[:, col0..col0+n_out] += scale · (x Aᵀ) Bᵀ` (`Backend::lora`) for x `[m, k]` and the
/// pair `p` (A, B, scale, r and its column slice), out's rows of `ld`.
pub fn lora(x: &[f32], m: usize, k: usize, p: &Pair, out: &mut [f32], ld: usize) {
    let (a, b, scale, r, n_out, col0) = (p.a, p.b, p.scale, p.r, p.n_out, p.col0);
    assert!(x.len() >= m * k && a.len() >= r * k && b.len() >= n_out * r && col0 + n_out <= ld && out.len() >= m * ld, "lora: buffers too small");
    if m == 0 || r == 0 || n_out == 0 {
        return;
    }
    if m <= FEW_ROWS {
        return lora_few(x, m, k, p, out, ld);
    }
    let (at, bt) = (transpose(&a[..r * k], r, k), transpose(&b[..n_out * r], n_out, r));
    let outp = SendPtr(out.as_mut_ptr());
    let run = |i0: usize, rows: usize| {
        let mut u = vec![0f32; BLOCK.min(rows) * r];
        for b0 in (i0..i0 + rows).step_by(BLOCK) {
            let mb = BLOCK.min(i0 + rows - b0);
            // Safety: rows b0..b0+mb are this task's; extents checked above.
            unsafe {
                // u [mb, r] = x_blk Aᵀ; out_blk += scale · u Bᵀ
                product(mb, r, k, x.as_ptr().add(b0 * k), k, 1, at.as_ptr(), r, u.as_mut_ptr(), r, 1.0, false);
                product(mb, n_out, r, u.as_ptr(), r, 1, bt.as_ptr(), n_out, outp.get().add(b0 * ld + col0), ld, scale, true);
            }
        }
    };
    // rows are independent here (no partial sums): one task per block
    if m <= BLOCK {
        run(0, m);
    } else {
        (0..m.div_ceil(BLOCK)).into_par_iter().for_each(|c| run(c * BLOCK, BLOCK.min(m - c * BLOCK)));
    }
}

/// Up to this many rows (decode steps), `lora` transposes x instead of A and B.
const FEW_ROWS: usize = 16;

/// `lora` for a few rows: `uᵀ = A·xᵀ` and `(u Bᵀ)ᵀ = B·uᵀ`, so only the m rows of x are
/// transposed (a decode step's 8 rows of 576 are cheaper than A and B, every call). Each element
/// is the same FMA chain over the same products in the same order as in `lora` (a product
/// commutes exactly), and the scale is applied as there, so a row gets the same bits either way.
fn lora_few(x: &[f32], m: usize, k: usize, p: &Pair, out: &mut [f32], ld: usize) {
    let (a, b, scale, r, n_out, col0) = (p.a, p.b, p.scale, p.r, p.n_out, p.col0);
    let xt = transpose(&x[..m * k], m, k);
    let (mut ut, mut yt) = (vec![0f32; r * m], vec![0f32; n_out * m]);
    // Safety: the buffers hold these extents (checked by the caller).
    unsafe {
        product(r, m, k, a.as_ptr(), k, 1, xt.as_ptr(), m, ut.as_mut_ptr(), m, 1.0, false);
        product(n_out, m, r, b.as_ptr(), r, 1, ut.as_ptr(), m, yt.as_mut_ptr(), m, 1.0, false);
    }
    for i in 0..m {
        for (o, y) in out[i * ld + col0..][..n_out].iter_mut().enumerate() {
            *y += scale * yt[o * m + i];
        }
    }
}

/// `lora` with bf16 operands (`--dtype bf16`, `product_bf`): `u = bf(x)·bf(Aᵀ)`, then
/// `out += scale·bf(u)·bf(Bᵀ)`, f32 sums. The fused forward's few-rows path and its reference.
/// Its bf16 operands are kept where the pair has shadows.
pub fn lora_bf16(x: &[f32], m: usize, k: usize, p: &Pair, out: &mut [f32], ld: usize) {
    let (r, n_out, col0) = (p.r, p.n_out, p.col0);
    assert!(x.len() >= m * k && p.a.len() >= r * k && p.b.len() >= n_out * r && col0 + n_out <= ld && out.len() >= m * ld, "lora: buffers too small");
    if m == 0 || r == 0 || n_out == 0 {
        return;
    }
    let (ba, bb) = (p.bf_at(k), p.bf_bt());
    let outp = SendPtr(out.as_mut_ptr());
    let run = |i0: usize, rows: usize| {
        let mut u = vec![0f32; rows * r];
        let _tiles = Tiles::new();
        // Safety: rows i0..i0+rows are this task's; extents checked above.
        unsafe {
            product_bf(rows, x.as_ptr().add(i0 * k), k, 1, &ba, 0, r, u.as_mut_ptr(), r, 1.0, false, true);
            product_bf(rows, u.as_ptr(), r, 1, &bb, 0, n_out, outp.get().add(i0 * ld + col0), ld, p.scale, true, true);
        }
    };
    if m <= BLOCK {
        run(0, m);
    } else {
        (0..m.div_ceil(BLOCK)).into_par_iter().for_each(|c| run(c * BLOCK, BLOCK.min(m - c * BLOCK)));
    }
}

/// `lora_bwd` with bf16 operands (`--dtype bf16`): the fused backward's reference.
pub fn lora_bwd_bf16(x: &[f32], m: usize, k: usize, p: &Pair, dy: &[f32], ld: usize, (da, db): (&mut [f32], &mut [f32]), dx: Option<&mut [f32]>) {
    bwd_pairs(XRows::Plain(x), m, k, &[p], dy, ld, &mut [(da, db)], dx, None, true, in_parallel);
}

/// The LoRA pair's gradients (`TrainBackend::lora_bwd`): `dA += duᵀ x`, `dB += scale·dy_sᵀ u`
/// with `u = x Aᵀ`, `du = scale·dy_s B`, and `dx += du A` when `dx` is given (the pair is not
/// merged into the weight its input gradient went through). `dy_s` = columns `col0..col0+n_out`
/// of `dy`, rows of `ld`. With `keep_du`, du (`[m, r]`) is written there as well
/// (`matmul_dx_lora` adds `du A` to dx as a tail of the `dy W` product instead).
pub fn lora_bwd(x: &[f32], m: usize, k: usize, p: &Pair, dy: &[f32], ld: usize, (da, db): (&mut [f32], &mut [f32]), dx: Option<&mut [f32]>, keep_du: Option<&mut [f32]>) {
    // every size is checked (`bwd_pairs`) even when there is nothing to do
    let keep = keep_du.map(|d| (SendPtr(d.as_mut_ptr()), d.len()));
    bwd_pairs(XRows::Plain(x), m, k, &[p], dy, ld, &mut [(da, db)], dx, keep, false, in_parallel);
}

/// Where each pair's r columns start when the pairs' u (du, Aᵀ) sit side by side, and the total
/// width Σ r.
fn side_by_side(pairs: &[&Pair]) -> (Vec<usize>, usize) {
    let offs = pairs.iter().scan(0, |o, p| Some(std::mem::replace(o, *o + p.r))).collect();
    (offs, pairs.iter().map(|p| p.r).sum())
}

/// The pairs' Aᵀ side by side: `[k, rs]` (rs = Σ r).
fn stacked_at(pairs: &[&Pair], k: usize, rs: usize) -> Vec<f32> {
    transpose(&pairs.iter().flat_map(|p| &p.a[..p.r * k]).copied().collect::<Vec<f32>>(), rs, k)
}

/// `lora_bwd` of the pairs on one product (all reading x `[m, k]`; dy's rows of `ld`), in one
/// pass over the rows: per block, u of every pair is one product (their Aᵀ side by side) and so
/// is dA (their du side by side), so each block of x is read from memory once for all of them
/// (a q/k/v or gate/up group: three or two passes before); du, dB and dx per pair, in order.
/// The same bits as one `lora_bwd` per pair: every element is the same FMA chain, and dx takes
/// the pairs' terms in pair order. `keep` (`[m, rs]`, rs = Σ r; where, and its length): du of
/// every pair side by side. `run` runs the chunks (`Runner`); not called when there is nothing
/// to do (m or Σ r zero).
#[allow(clippy::too_many_arguments)]
fn bwd_pairs(x: XRows, m: usize, k: usize, pairs: &[&Pair], dy: &[f32], ld: usize, grads: &mut [(&mut [f32], &mut [f32])], dx: Option<&mut [f32]>, keep: Option<(SendPtr<f32>, usize)>, bf: bool, run: impl Runner) {
    let (offs, rs) = side_by_side(pairs);
    assert!(pairs.len() == grads.len() && x.len() >= x.width(k) * m && dx.as_ref().is_none_or(|d| d.len() >= m * k) && keep.is_none_or(|(_, len)| len >= m * rs), "lora_bwd: x, dx or du too small");
    for (p, (da, db)) in pairs.iter().zip(grads.iter()) {
        assert!(p.a.len() >= p.r * k && p.b.len() >= p.n_out * p.r && p.col0 + p.n_out <= ld && dy.len() >= m * ld && da.len() >= p.r * k && db.len() >= p.n_out * p.r, "lora_bwd: a buffer too small");
    }
    if m == 0 || rs == 0 {
        return;
    }
    let (dxp, keep) = (dx.map(|v| SendPtr(v.as_mut_ptr())), keep.map(|(p, _)| p));
    if bf {
        return bwd_pairs_bf(x, m, k, pairs, &offs, rs, dy, ld, grads, dxp, keep, run);
    }
    let XRows::Plain(x) = x else { unreachable!("the f32 pairs take x as rows") };
    let at = stacked_at(pairs, k, rs);
    let partials = chunk_partials(m, k, rs, pairs, keep, run, || (), |_, b| {
        let (b0, mb, u, dup) = (b.b0, b.mb, b.u, b.dup);
        // Safety: rows b0..b0+mb are this task's (dx, keep); every extent is inside the checked buffers.
        unsafe {
            let xs = x.as_ptr().add(b0 * k);
            // u [mb, rs] = x_blk Aᵀ
            product(mb, rs, k, xs, k, 1, at.as_ptr(), rs, u, rs, 1.0, false);
            for ((p, &o), pb) in pairs.iter().zip(&offs).zip(b.pb.iter_mut()) {
                let dys = dy.as_ptr().add(b0 * ld + p.col0);
                // du_p [mb, r] = scale · dy_blk B
                product(mb, p.r, p.n_out, dys, ld, 1, p.b.as_ptr(), p.r, dup.add(o), rs, p.scale, false);
                // dB [n_out, r] += scale · dy_blkᵀ u_p: A = dyᵀ (element (o, i) at o + i·ld)
                product(p.n_out, p.r, mb, dys, 1, ld, u.add(o), rs, pb.as_mut_ptr(), p.r, p.scale, true);
            }
            // dA [rs, k] += duᵀ x_blk
            product(rs, k, mb, dup, 1, rs, xs, k, b.pa.as_mut_ptr(), k, 1.0, true);
            // dx_blk [mb, k] += du_p A_p, pair after pair
            if let Some(dxp) = dxp {
                for (p, &o) in pairs.iter().zip(&offs) {
                    product(mb, k, p.r, dup.add(o), rs, 1, p.a.as_ptr(), k, dxp.get().add(b0 * k), k, 1.0, true);
                }
            }
        }
    });
    for (pa, pb) in partials {
        for (((da, db), p), (&o, pb)) in grads.iter_mut().zip(pairs).zip(offs.iter().zip(&pb)) {
            super::norm::add(&mut da[..p.r * k], &pa[o * k..(o + p.r) * k]);
            super::norm::add(&mut db[..p.n_out * p.r], pb);
        }
    }
}

/// One block of rows of the LoRA backward (`chunk_partials`): rows `b0..b0+mb`; `u` and `dup`
/// (du; `keep`'s rows when kept) hold `[mb, rs]`; `pa` and `pb` are the chunk's partial dA
/// `[rs, k]` and each pair's partial dB (`n_out·r` values).
struct Blk<'a> {
    b0: usize,
    mb: usize,
    u: *mut f32,
    dup: *mut f32,
    pa: &'a mut [f32],
    pb: &'a mut [Vec<f32>],
}

/// One chunk's partial dA (`[rs, k]`) and dB per pair.
type Partial = (Vec<f32>, Vec<Vec<f32>>);

/// One chunk of the LoRA backward: `chunk(c, before)` calls `before(row0, rows)` ahead of each
/// block of rows.
type Chunk<'a> = dyn Fn(usize, &dyn Fn(usize, usize)) -> Partial + Sync + 'a;

/// Runs `chunks` chunks of the LoRA backward and returns their partials in chunk order:
/// `in_parallel`, or inside the `dy W` product's conversion (`matmul_dx_lora`).
trait Runner: FnOnce(usize, &Chunk) -> Vec<Partial> {}
impl<F: FnOnce(usize, &Chunk) -> Vec<Partial>> Runner for F {}

/// The chunks on rayon.
fn in_parallel(chunks: usize, chunk: &Chunk) -> Vec<Partial> {
    (0..chunks).into_par_iter().map(|c| chunk(c, &|_, _| {})).collect()
}

/// The LoRA backward's rows: chunks of `CHUNK` (run by `run`, in parallel), each with its own
/// partials (zero), u and du scratch and state (`init`), its blocks of `BLOCK` rows in order
/// (`block`). Returns each chunk's (dA, dB per pair) partials, in row order: fixed chunks, so the
/// sums do not depend on the thread count.
#[allow(clippy::too_many_arguments)]
fn chunk_partials<S>(m: usize, k: usize, rs: usize, pairs: &[&Pair], keep: Option<SendPtr<f32>>, run: impl Runner, init: impl Fn() -> S + Sync, block: impl Fn(&mut S, Blk) + Sync) -> Vec<Partial> {
    let chunk = |c: usize, before: &dyn Fn(usize, usize)| {
        let (i0, rows) = (c * CHUNK, CHUNK.min(m - c * CHUNK));
        let mut pa = vec![0f32; rs * k];
        let mut pb: Vec<Vec<f32>> = pairs.iter().map(|p| vec![0f32; p.n_out * p.r]).collect();
        let (mut u, mut du) = (vec![0f32; BLOCK.min(rows) * rs], vec![0f32; BLOCK.min(rows) * rs]);
        let mut state = init();
        for b0 in (i0..i0 + rows).step_by(BLOCK) {
            // Safety (`add`): keep holds [m, rs] (the callers' contract)
            let dup = keep.map_or(du.as_mut_ptr(), |kp| unsafe { kp.get().add(b0 * rs) });
            let mb = BLOCK.min(i0 + rows - b0);
            before(b0, mb);
            block(&mut state, Blk { b0, mb, u: u.as_mut_ptr(), dup, pa: &mut pa, pb: &mut pb });
        }
        (pa, pb)
    };
    run(m.div_ceil(CHUNK), &chunk)
}

/// `bwd_pairs` with bf16 operands: per block of rows the same products, each on `product_bf`.
/// The two m-reductions take the block's rows as pairs of B (x for dA, dy's slice for dB,
/// rounded by vectors), so dB is formed transposed per chunk (`[r, n_out]`) and turned once.
#[allow(clippy::too_many_arguments)]
fn bwd_pairs_bf(x: XRows, m: usize, k: usize, pairs: &[&Pair], offs: &[usize], rs: usize, dy: &[f32], ld: usize, grads: &mut [(&mut [f32], &mut [f32])], dxp: Option<SendPtr<f32>>, keep: Option<SendPtr<f32>>, run: impl Runner) {
    let ats: Vec<Op> = pairs.iter().map(|p| p.bf_at(k)).collect();
    let bbs: Vec<Op> = pairs.iter().map(|p| p.bf_b()).collect();
    let bas: Vec<Op> = if dxp.is_some() { pairs.iter().map(|p| p.bf_a(k)).collect() } else { Vec::new() };
    // per chunk: the block's x and dy slices as B, the tiles held, and the block's x rows when
    // they are formed here (`XRows::Swiglu`)
    let init = || (BfB::empty(), BfB::empty(), Tiles::new(), Vec::new());
    let partials = chunk_partials(m, k, rs, pairs, keep, run, init, |(bdy, bx, _, xb), b| {
        let (b0, mb, u, dup) = (b.b0, b.mb, b.u, b.dup);
        let xs = x.block(b0, mb, k, xb);
        // Safety: rows b0..b0+mb are this task's (dx, keep); every extent is inside the checked buffers.
        unsafe {
            // u [mb, rs] = x_blk Aᵀ, every pair's from one conversion of the block
            let outs: Vec<Out> = ats.iter().zip(offs).map(|(a, &o)| Out { b: a, j0: 0, j1: a.n, c: u.add(o), ldc: rs }).collect();
            products_bf(mb, xs, k, 1, &outs, 1.0, false, true);
            for (((p, &o), pbt), bb) in pairs.iter().zip(offs).zip(b.pb.iter_mut()).zip(&bbs) {
                let dys = dy.as_ptr().add(b0 * ld + p.col0);
                // du_p [mb, r] = scale · dy_blk B
                product_bf(mb, dys, ld, 1, bb, 0, p.r, dup.add(o), rs, p.scale, false, true);
                // dBᵀ [r, n_out] += scale · u_pᵀ dy_blk
                bdy.fill(dys, ld, mb, p.n_out);
                product_bf(p.r, u.add(o), 1, rs, bdy, 0, p.n_out, pbt.as_mut_ptr(), p.n_out, p.scale, true, true);
            }
            // dA [rs, k] += duᵀ x_blk
            bx.fill(xs, k, mb, k);
            product_bf(rs, dup, 1, rs, bx, 0, k, b.pa.as_mut_ptr(), k, 1.0, true, true);
            // dx_blk [mb, k] += du_p A_p, pair after pair
            if let Some(dxp) = dxp {
                for (&o, ba) in offs.iter().zip(&bas) {
                    product_bf(mb, dup.add(o), rs, 1, ba, 0, k, dxp.get().add(b0 * k), k, 1.0, true, true);
                }
            }
        }
    });
    for (pa, pbt) in partials {
        for (((da, db), p), (&o, pbt)) in grads.iter_mut().zip(pairs).zip(offs.iter().zip(&pbt)) {
            super::norm::add(&mut da[..p.r * k], &pa[o * k..(o + p.r) * k]);
            for (oi, row) in db[..p.n_out * p.r].chunks_exact_mut(p.r).enumerate() {
                row.iter_mut().enumerate().for_each(|(j, v)| *v += pbt[j * p.n_out + oi]);
            }
        }
    }
}

/// The pairs' input x `[m, k]` in the backward: its rows, or (the down projection's) the gate/up
/// rows it was made of, `x = silu(g)·u` of `[g | u]` (`[m, 2k]`), formed per block of rows by
/// `simd::silu_mul` (`swiglu`'s own function, so the same values) while the block is in cache:
/// the backward then neither recomputes x into a buffer nor reads it back.
#[derive(Clone, Copy)]
pub enum XRows<'a> {
    Plain(&'a [f32]),
    Swiglu(&'a [f32]),
}

impl XRows<'_> {
    /// Stored values per row of x `[m, k]`.
    pub(crate) fn width(&self, k: usize) -> usize {
        match self {
            XRows::Plain(_) => k,
            XRows::Swiglu(_) => 2 * k,
        }
    }
    /// Stored values.
    pub(crate) fn len(&self) -> usize {
        match self {
            XRows::Plain(x) | XRows::Swiglu(x) => x.len(),
        }
    }
    /// Rows `b0..b0+mb` of x (row stride k): in place, or formed into `scratch`.
    fn block(&self, b0: usize, mb: usize, k: usize, scratch: &mut Vec<f32>) -> *const f32 {
        match *self {
            XRows::Plain(x) => x[b0 * k..(b0 + mb) * k].as_ptr(),
            XRows::Swiglu(gu) => {
                scratch.resize(mb * k, 0.0);
                for (r, row) in scratch.chunks_exact_mut(k).enumerate() {
                    let (g, u) = gu[(b0 + r) * 2 * k..(b0 + r + 1) * 2 * k].split_at(k);
                    super::simd::silu_mul(g, u, row);
                }
                scratch.as_ptr()
            }
        }
    }
}

/// One LoRA pair on a column slice of a projection's output (`Backend::matmul_lora`).
pub struct Pair<'a> {
    /// `[r, k]`
    pub a: &'a [f32],
    /// `[n_out, r]`
    pub b: &'a [f32],
    pub scale: f32,
    pub r: usize,
    pub col0: usize,
    pub n_out: usize,
    /// Where A's and B's bf16 operands are kept between calls (their `CpuBuf`s); none: made per call.
    shadows: [Option<&'a Shadow>; 2],
}

impl<'a> Pair<'a> {
    pub fn new(a: &'a [f32], b: &'a [f32], scale: f32, r: usize, col0: usize, n_out: usize) -> Self {
        Pair { a, b, scale, r, col0, n_out, shadows: [None, None] }
    }

    /// The pair with A's and B's bf16 operands kept in `a` and `b` (`--dtype bf16`).
    pub fn with_shadows(self, a: &'a Shadow, b: &'a Shadow) -> Self {
        Pair { shadows: [Some(a), Some(b)], ..self }
    }

    fn check(&self, k: usize, n: usize) {
        assert!(self.a.len() >= self.r * k && self.b.len() >= self.n_out * self.r && self.col0 + self.n_out <= n, "LoRA pair [{}, {k}] x [{}, {}] at column {} does not fit a product of {n} columns", self.r, self.n_out, self.r, self.col0);
    }

    // The bf16 right operands (checked by `check` or the callers' asserts first).
    /// Aᵀ `[k, r]`: `u = x Aᵀ`.
    fn bf_at(&self, k: usize) -> Op<'a> {
        let (a, r) = (self.a, self.r);
        // Safety: Aᵀ is [k, r], row-major.
        op(self.shadows[0].map(|s| &s.t), k, r, || unsafe { BfB::new(transpose(&a[..r * k], r, k).as_ptr(), r, k, r) })
    }
    /// A `[r, k]`: `dx += du A`.
    fn bf_a(&self, k: usize) -> Op<'a> {
        let (a, r) = (self.a, self.r);
        // Safety: A holds [r, k] (checked).
        op(self.shadows[0].map(|s| &s.n), r, k, || unsafe { BfB::new(a.as_ptr(), k, r, k) })
    }
    /// Bᵀ `[r, n_out]`: `y += s·u Bᵀ`.
    fn bf_bt(&self) -> Op<'a> {
        let (b, r, n) = (self.b, self.r, self.n_out);
        // Safety: Bᵀ is [r, n_out], row-major.
        op(self.shadows[1].map(|s| &s.t), r, n, || unsafe { BfB::new(transpose(&b[..n * r], n, r).as_ptr(), n, r, n) })
    }
    /// B `[n_out, r]`: `du = s·dy B`.
    fn bf_b(&self) -> Op<'a> {
        let (b, r, n) = (self.b, self.r, self.n_out);
        // Safety: B holds [n_out, r] (checked).
        op(self.shadows[1].map(|s| &s.n), n, r, || unsafe { BfB::new(b.as_ptr(), r, n, r) })
    }
}

/// `out = x Wᵀ (+ bias)` on the bf16 `w`, then `lora` of each pair in order — fused: each
/// pair's `u = x Aᵀ` is computed as the GEMM converts x's rows, and `scale·u Bᵀ` is added to each
/// strip of out right after the GEMM wrote it (`bf16::Tail`), instead of two more passes
/// over x and a read-modify-write of out per pair. Same bits as the separate ops (every element
/// is the same FMA chain; `fused_equals_separate`). A decode step's few rows take the separate
/// ops (`lora_few`).
#[allow(clippy::too_many_arguments)]
pub fn matmul_lora(x: &[f32], w: &PackedBf16, bias: Option<&[f32]>, m: usize, k: usize, n: usize, out: &mut [f32], pairs: &[Pair]) {
    matmul_lora_with(x, w, bias, m, k, n, out, pairs, Kernel::Auto)
}

/// `matmul_lora` on the given GEMM kernel.
#[allow(clippy::too_many_arguments)]
fn matmul_lora_with(x: &[f32], w: &PackedBf16, bias: Option<&[f32]>, m: usize, k: usize, n: usize, out: &mut [f32], pairs: &[Pair], kernel: Kernel) {
    pairs.iter().for_each(|p| p.check(k, n));
    let pairs: Vec<&Pair> = pairs.iter().filter(|p| p.r > 0 && p.n_out > 0).collect();
    if m <= FEW_ROWS || k == 0 || pairs.is_empty() {
        matmul_bf16_with(x, w, bias, m, k, n, out, kernel, true);
        for p in pairs {
            lora_bf16(x, m, k, p, out, n);
        }
        return;
    }
    // Safety: the tails' buffers (`with_forward_tails`); columns checked in `check`.
    with_forward_tails(&pairs, m, k, |tails, tu| unsafe { matmul_bf16_tails(x, w, bias, m, k, n, out, kernel, true, tails, Some(tu)) })
}

/// The forward's pairs as the GEMM's tails: `u` of every pair from one product (their Aᵀ side by
/// side, `[k, rs]`; u `[m, rs]`, filled by the GEMM: `TailU`), each pair's Bᵀ; `run` gets the
/// tails and their `TailU`, valid while it runs.
fn with_forward_tails<R>(pairs: &[&Pair], m: usize, k: usize, run: impl FnOnce(&[Tail], &TailU) -> R) -> R {
    let (offs, rs) = side_by_side(pairs);
    let ats: Vec<Op> = pairs.iter().map(|p| p.bf_at(k)).collect();
    let bts: Vec<Op> = pairs.iter().map(|p| p.bf_bt()).collect();
    let mut u = vec![0f32; m * rs];
    let up = SendPtr(u.as_mut_ptr());
    // Safety (`add`): offsets inside u's rows
    let tails: Vec<Tail> = pairs.iter().zip(&bts).zip(&offs).map(|((p, bt), &o)| Tail { u: SendPtr(unsafe { up.get().add(o) }), ldu: rs, b: SendPtr(&**bt as *const BfB as *mut BfB), alpha: p.scale, col0: p.col0, ncols: p.n_out }).collect();
    let tu = TailU { at: ats.iter().zip(&offs).map(|(b, &o)| (SendPtr(&**b as *const BfB as *mut BfB), o)).collect(), r: rs, u: up };
    run(&tails, &tu)
}

/// `act[m, inter] = silu(g) · u` of `[g | u] = x Wᵀ` plus the pairs' terms (`matmul_lora`), `w`
/// the `[2·inter, k]` gate/up weight. Fused where `swiglu_fusable` (and, with pairs, on more than
/// `FEW_ROWS` rows, where the GEMM carries the pairs as tails): `gate_up` is not written then.
/// Otherwise `matmul_lora` into `gate_up`, then `swiglu`. The same bits either way.
#[allow(clippy::too_many_arguments)]
pub fn matmul_lora_swiglu(x: &[f32], w: &PackedBf16, m: usize, k: usize, inter: usize, gate_up: &mut [f32], act: &mut [f32], pairs: &[Pair]) {
    let n = 2 * inter;
    pairs.iter().for_each(|p| p.check(k, n));
    let live: Vec<&Pair> = pairs.iter().filter(|p| p.r > 0 && p.n_out > 0).collect();
    if !swiglu_fusable(w, inter) || (m <= FEW_ROWS && !live.is_empty()) {
        matmul_lora(x, w, None, m, k, n, gate_up, pairs);
        return super::swiglu::swiglu(gate_up, m, inter, act);
    }
    if live.is_empty() {
        // Safety: no tails
        return unsafe { matmul_swiglu_bf16_tails(x, w, m, k, inter, act, true, &[], None) };
    }
    // Safety: the tails' buffers (`with_forward_tails`); columns checked in `check`.
    with_forward_tails(&live, m, k, |tails, tu| unsafe { matmul_swiglu_bf16_tails(x, w, m, k, inter, act, true, tails, Some(tu)) })
}

/// `dx = dy W` on the bf16 `w` (`dy [m, n]`), then `lora_bwd` of each pair in order with dx
/// (`x [m, k]` the projection's input; `grads[i]` pair i's dA and dB, accumulated) — fused: the
/// pairs' chunks of rows run inside the product's conversion of dy (each 64-row block right
/// after its rows are converted, `bf16::RowHook`), so dy is read from memory once; each
/// pair's `du` is kept (`[m, r]`) and `du A` added to each strip of dx right after the `dy W`
/// product wrote it. Same bits as the separate ops (`fused_equals_separate`).
#[allow(clippy::too_many_arguments)]
pub fn matmul_dx_lora(dy: &[f32], w: &PackedBf16, m: usize, n: usize, k: usize, dx: &mut [f32], x: XRows, pairs: &[Pair], grads: &mut [(&mut [f32], &mut [f32])]) {
    matmul_dx_lora_with(dy, w, m, n, k, dx, x, pairs, grads, Kernel::Auto)
}

/// `matmul_dx_lora` on the given GEMM kernel.
#[allow(clippy::too_many_arguments)]
fn matmul_dx_lora_with(dy: &[f32], w: &PackedBf16, m: usize, n: usize, k: usize, dx: &mut [f32], x: XRows, pairs: &[Pair], grads: &mut [(&mut [f32], &mut [f32])], kernel: Kernel) {
    assert!(pairs.len() == grads.len(), "matmul_dx_lora: {} pairs, {} gradient pairs", pairs.len(), grads.len());
    assert!(x.len() >= m * x.width(k) && dy.len() >= m * n && dx.len() >= m * k, "matmul_dx_lora: buffers too small");
    pairs.iter().for_each(|p| p.check(k, n));
    // the pairs' du side by side ([m, rs]), from one pass over the rows for all pairs
    let (live, mut gs): (Vec<&Pair>, Vec<(&mut [f32], &mut [f32])>) = pairs.iter().zip(grads.iter_mut()).filter(|(p, _)| p.r > 0).map(|(p, (a, b))| (p, (&mut **a, &mut **b))).unzip();
    let (offs, rs) = side_by_side(&live);
    let mut du = vec![0f32; m * rs];
    // the pairs write du and the tails read it: both through this pointer
    let dup = SendPtr(du.as_mut_ptr());
    let bas: Vec<Op> = live.iter().map(|p| p.bf_a(k)).collect();
    // Safety (`add`): offsets inside du's rows
    let tails: Vec<Tail> = live.iter().zip(&offs).zip(&bas).filter(|_| m > 0 && n > 0).map(|((_, &o), ba)| Tail { u: SendPtr(unsafe { dup.get().add(o) }), ldu: rs, b: SendPtr(&**ba as *const BfB as *mut BfB), alpha: 1.0, col0: 0, ncols: k }).collect();
    if m == 0 || rs == 0 {
        // Safety: no tails (m = 0 or no live pair)
        return unsafe { matmul_dx_bf16_tails(dy, w, m, n, k, dx, false, kernel, true, &[]) };
    }
    // The pairs' chunks run inside the product's conversion of dy, each block right after its
    // rows are converted (dy is read from memory once for the product and the pairs: at 4096
    // rows the pairs' own pass re-read 84 MB a layer, ~10 GB/s per core here), and before the
    // tails of those rows read their du. Chunks and blocks as in `bwd_pairs`: the same bits.
    bwd_pairs(x, m, k, &live, dy, n, &mut gs, None, Some((dup, m * rs)), true, |chunks: usize, chunk: &Chunk| {
        let slots: Vec<OnceLock<Partial>> = (0..chunks).map(|_| OnceLock::new()).collect();
        // each block's rows of dy converted for the product right before the block reads them
        let f = |r0: usize, _rows: usize, convert: &dyn Fn(usize, usize)| {
            let c = r0 / CHUNK;
            assert!(slots[c].set(chunk(c, convert)).is_ok(), "matmul_dx_lora: chunk {c} run twice");
        };
        // Safety: du [m, rs] is written by the hook for the rows the tails then read; A [r, k] checked.
        unsafe { matmul_dx_bf16_hooked(dy, w, m, n, k, dx, false, kernel, true, &tails, Some(&RowHook { f: &f, piece: CHUNK })) };
        slots.into_iter().map(|s| s.into_inner().expect("matmul_dx_lora: every chunk runs in the conversion")).collect()
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::bf16::f32_to_bf16_bits;
    use crate::util::rng::Rng;

    fn rand(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// The forward and backward in f64 from the definitions: (y slice, dA, dB, dx). `q` is applied
    /// to every value a product reads (x, A, B, dy, and u and du as the next products read them):
    /// the identity for the f32 ops, bf16 rounding for the bf16 ones.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn reference(x: &[f32], a: &[f32], b: &[f32], s: f64, m: usize, k: usize, r: usize, n: usize, dy: &[f32], col0: usize, ld: usize, q: fn(f64) -> f64) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (x, a, b, dy) = [x, a, b, dy].map(|v| v.iter().map(|&e| q(e as f64)).collect::<Vec<f64>>()).into();
        let u: Vec<f64> = (0..m * r).map(|e| q((0..k).map(|t| x[e / r * k + t] * a[e % r * k + t]).sum())).collect();
        let du: Vec<f64> = (0..m * r).map(|e| q(s * (0..n).map(|o| dy[e / r * ld + col0 + o] * b[o * r + e % r]).sum::<f64>())).collect();
        let y: Vec<f64> = (0..m * n).map(|e| s * (0..r).map(|j| u[e / n * r + j] * b[e % n * r + j]).sum::<f64>()).collect();
        let da: Vec<f64> = (0..r * k).map(|e| (0..m).map(|i| du[i * r + e / k] * x[i * k + e % k]).sum()).collect();
        let db: Vec<f64> = (0..n * r).map(|e| s * (0..m).map(|i| dy[i * ld + col0 + e / r] * u[i * r + e % r]).sum::<f64>()).collect();
        let dx: Vec<f64> = (0..m * k).map(|e| (0..r).map(|j| du[e / k * r + j] * a[j * k + e % k]).sum()).collect();
        (y, da, db, dx)
    }

    fn rel(got: &[f32], want: &[f64]) -> f64 {
        let num: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - w).powi(2)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        (num / den.max(1e-300)).sqrt()
    }

    type Fwd = fn(&[f32], usize, usize, &Pair, &mut [f32], usize);
    type Bwd = fn(&[f32], usize, usize, &Pair, &[f32], usize, (&mut [f32], &mut [f32]), Option<&mut [f32]>);

    /// Forward and backward against the f64 `reference` (with `q`) over shapes that cross the
    /// block and chunk edges, ranks that are not a multiple of 16 (or of 2), a k off the pairs and
    /// a column slice of a wider output; accumulation into what the buffers held.
    fn check_against_f64(name: &str, fwd: Fwd, bwd: Bwd, q: fn(f64) -> f64, bound: f64, seed: u64) {
        let mut rng = Rng::new(seed);
        for &(m, k, r, n, col0, ld) in &[(1, 12, 3, 7, 6, 20), (21, 12, 3, 7, 6, 20), (64, 100, 16, 70, 0, 70), (65, 576, 16, 192, 576, 960), (300, 64, 17, 130, 5, 140), (530, 96, 48, 64, 32, 96), (33, 31, 5, 40, 1, 41)] {
            let s = 1.7f32;
            let (x, a, b, dy) = (rand(&mut rng, m * k), rand(&mut rng, r * k), rand(&mut rng, n * r), rand(&mut rng, m * ld));
            let (y, da, db, dx) = reference(&x, &a, &b, s as f64, m, k, r, n, &dy, col0, ld, q);
            let prior = rand(&mut rng, m * ld);
            let mut out = prior.clone();
            let pair = Pair::new(&a, &b, s, r, col0, n);
            fwd(&x, m, k, &pair, &mut out, ld);
            let got: Vec<f32> = (0..m * n).map(|e| out[e / n * ld + col0 + e % n] - prior[e / n * ld + col0 + e % n]).collect();
            let untouched = (0..m * ld).filter(|e| !(col0..col0 + n).contains(&(e % ld))).all(|e| out[e] == prior[e]);
            assert!(untouched, "{name} wrote outside its column slice at {m}x{k} r{r}");
            let (pa, pb, px) = (rand(&mut rng, r * k), rand(&mut rng, n * r), rand(&mut rng, m * k));
            let (mut ga, mut gb, mut gx) = (pa.clone(), pb.clone(), px.clone());
            bwd(&x, m, k, &pair, &dy, ld, (&mut ga, &mut gb), Some(&mut gx));
            let minus = |g: &[f32], p: &[f32]| g.iter().zip(p).map(|(g, p)| g - p).collect::<Vec<f32>>();
            for (what, g, want) in [("y", got, y), ("dA", minus(&ga, &pa), da), ("dB", minus(&gb, &pb), db), ("dx", minus(&gx, &px), dx)] {
                let e = rel(&g, &want);
                assert!(e < bound, "{name}: {what} at m {m} k {k} r {r} n {n}: relative error {e:.2e}");
            }
        }
    }

    /// The f32 ops: f32 sums of ≤ 576 terms, ~1e-7 per term in norm; 1e-5 leaves room, a wrong
    /// index or a dropped block is O(1).
    #[test]
    fn forward_and_backward_match_f64() {
        check_against_f64("lora", lora, |x, m, k, p, dy, ld, g, dx| lora_bwd(x, m, k, p, dy, ld, g, dx, None), |v| v, 1e-5, 21);
    }

    /// The bf16-operand ops (`lora_bf16`, `lora_bwd_bf16`; AMX where present, else `vdpbf16ps`,
    /// else the f32 kernel on rounded values) against the reference on bf16-rounded operands, u and du rounded where
    /// the next product reads them: what is left is f32 summation (and a rare bf16 rounding of u
    /// or du that f32 sums tip the other way), so the bound is 1e-4 in norm, where an unrounded
    /// operand alone is ~2e-3 and a wrong index O(1).
    #[test]
    fn bf16_forward_and_backward_match_f64() {
        check_against_f64("lora_bf16", lora_bf16, lora_bwd_bf16, |v| f32::from_bits((f32_to_bf16_bits(v as f32) as u32) << 16) as f64, 1e-4, 22);
    }

    /// `matmul_lora_swiglu` gives `matmul_lora` then `swiglu`'s bits, 1 and 2 threads, fused
    /// (where this CPU has AMX: then `gate_up` is left as it was) or not: with and without pairs,
    /// tails on the gate half, the up half and across the two, one and three k blocks (k 576,
    /// 1536), decode rows (fused without pairs, separate with), rows off the 32-row strips, an
    /// odd k, A in two row batches, and an `inter` off the panels (never fused).
    #[test]
    fn swiglu_fused_equals_separate() {
        use crate::backend::cpu::bf16::{swiglu_fusable, PackedBf16};
        let mut rng = Rng::new(34);
        // (m, k, inter, pairs as (r, col0, n_out))
        let cases: &[(usize, usize, usize, &[(usize, usize, usize)])] = &[
            (70, 576, 1536, &[(16, 0, 1536), (16, 1536, 1536)]),
            (8, 576, 1536, &[]),
            (8, 576, 1536, &[(16, 0, 1536)]),
            (17, 576, 1536, &[(16, 1536, 1536)]),
            (100, 1536, 256, &[(4, 100, 50), (8, 200, 200)]),
            (45, 64, 64, &[]),
            (13, 31, 96, &[(3, 90, 20)]),
            (2800, 3072, 64, &[(8, 0, 128)]),
            (20, 64, 40, &[(4, 30, 20)]),
        ];
        let mut fused_any = false;
        for &(m, k, inter, shape) in cases {
            let n = 2 * inter;
            let x = rand(&mut rng, m * k);
            let w = rand(&mut rng, n * k);
            let pw = PackedBf16::from_f32(&w, n, k);
            let ab: Vec<(Vec<f32>, Vec<f32>)> = shape.iter().map(|&(r, _, n_out)| (rand(&mut rng, r * k), rand(&mut rng, n_out * r))).collect();
            let pairs: Vec<Pair> = shape.iter().zip(&ab).map(|(&(r, col0, n_out), (a, b))| Pair::new(a, b, 0.7, r, col0, n_out)).collect();
            let fused = swiglu_fusable(&pw, inter) && (m > FEW_ROWS || pairs.is_empty());
            fused_any |= fused;
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| {
                    let mut gu = vec![0f32; m * n];
                    matmul_lora(&x, &pw, None, m, k, n, &mut gu, &pairs);
                    let mut want = vec![0f32; m * inter];
                    super::super::swiglu::swiglu(&gu, m, inter, &mut want);
                    assert!(want.iter().any(|&v| v != want[0]), "values, not one number");
                    let mut scratch = vec![f32::NAN; m * n];
                    let mut got = vec![f32::NAN; m * inter + 1];
                    matmul_lora_swiglu(&x, &pw, m, k, inter, &mut scratch, &mut got[..m * inter], &pairs);
                    assert!(got[m * inter].is_nan(), "wrote past act");
                    let bad = got[..m * inter].iter().zip(&want).position(|(g, w)| g.to_bits() != w.to_bits());
                    assert!(bad.is_none(), "m{m} k{k} inter{inter} pairs {shape:?}, {threads} threads (fused {fused}): element {bad:?} differs");
                    assert_eq!(scratch.iter().all(|v| v.is_nan()), fused, "gate_up scratch written iff not fused");
                });
            }
        }
        if !fused_any {
            eprintln!("note: no AMX on this CPU (or INFOMEM_AMX=0): the fused SwiGLU was not run, only its fallback");
        }
    }

    /// Every bf16 GEMM kernel this CPU runs.
    fn bf16_kernels() -> Vec<Kernel> {
        use crate::backend::cpu::bf16::{amx_available, avx2_available, native_available};
        let mut kernels = vec![Kernel::Portable];
        kernels.extend([(avx2_available(), Kernel::Avx2), (native_available(), Kernel::Native), (amx_available(), Kernel::Amx)].into_iter().filter(|(ok, _)| *ok).map(|(_, k)| k));
        kernels
    }

    /// The pairs' input given as gate/up rows (`XRows::Swiglu`, the down projection's in the
    /// backward) gives the bits of the same op on `swiglu(gate_up)` as rows: dx, dA and dB, on
    /// every bf16 kernel, 1 and 2 threads, rows over several chunks and batches and off the blocks.
    #[test]
    fn swiglu_input_equals_its_rows() {
        use super::super::bf16::PackedBf16;
        let mut rng = Rng::new(35);
        let kernels = bf16_kernels();
        // (m, k = inter, n = hidden)
        for &(m, k, n) in &[(70usize, 96usize, 64usize), (600, 64, 96), (3000, 32, 2800)] {
            let gu: Vec<f32> = rand(&mut rng, m * 2 * k).iter().map(|v| 4.0 * v).collect();
            let mut act = vec![0f32; m * k];
            super::super::swiglu::swiglu(&gu, m, k, &mut act);
            let (w, dy) = (rand(&mut rng, n * k), rand(&mut rng, m * n));
            let pw = PackedBf16::from_f32(&w, n, k);
            let (a, b) = (rand(&mut rng, 8 * k), rand(&mut rng, n * 8));
            let pairs = [Pair::new(&a, &b, 0.7, 8, 0, n)];
            for &kernel in &kernels {
                for threads in [1, 2] {
                    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(|| {
                        let run = |x: XRows| {
                            let (mut dx, mut ga, mut gb) = (vec![f32::NAN; m * k], vec![0f32; 8 * k], vec![0f32; n * 8]);
                            matmul_dx_lora_with(&dy, &pw, m, n, k, &mut dx, x, &pairs, &mut [(&mut ga[..], &mut gb[..])], kernel);
                            (dx, ga, gb)
                        };
                        let (want, got) = (run(XRows::Plain(&act)), run(XRows::Swiglu(&gu)));
                        assert!(want.1.iter().any(|&v| v != 0.0) && want.2.iter().any(|&v| v != 0.0), "gradients, not zeros");
                        assert!(got == want, "m {m} k {k} n {n} ({kernel:?}, {threads} threads): the gate/up input differs from its rows");
                    });
                }
            }
        }
    }

    /// The fused ops give the separate ops' bits: `out`, `dx`, dA and dB, on every bf16 kernel
    /// this CPU has, 1 and 2 threads; shapes with one and three k blocks (k 576, 1536), row
    /// counts through the decode cut (16 / 17) and off the 32-row strips, several runs of panels
    /// (n 3072), two pairs on one output, a pair inside one panel and one across panel edges,
    /// A converted in two row batches (forward and backward), an odd k and a partial last panel.
    #[test]
    fn fused_equals_separate() {
        use super::super::bf16::{matmul_dx_bf16_with, PackedBf16};
        let mut rng = Rng::new(33);
        let kernels = bf16_kernels();
        // (m, k, n, pairs as (r, col0, n_out))
        let cases: &[(usize, usize, usize, &[(usize, usize, usize)])] = &[
            (70, 576, 960, &[(16, 0, 576), (16, 576, 192), (8, 768, 192)]),
            (17, 1536, 576, &[(16, 0, 576)]),
            (16, 576, 3072, &[(16, 0, 1536), (4, 1536, 1536)]),
            (100, 96, 3072, &[(3, 5, 20), (16, 1000, 1100)]),
            // a rank-0 pair between two others (skipped; the gradients stay aligned with their pairs)
            (40, 64, 256, &[(8, 0, 64), (0, 64, 64), (4, 128, 128)]),
            // A converted in row batches (16 MiB / 6 KiB per row: 2720 rows on AMX strips, 2724
            // on 12-row ones, then the rest; AVX2's f32 layout: 1356 rows), the forward's x,
            // then the backward's dy (whole chunks of the pairs: 2560 rows, 1280 on AVX2)
            (2800, 3072, 64, &[(8, 0, 64)]),
            (2800, 64, 3072, &[(8, 3000, 72)]),
            // odd k (a zero-padded last pair: AMX declines it), n off the 32-column panels, two
            // pairs on the same columns 990..995 (their order matters)
            (45, 97, 1000, &[(8, 990, 10), (4, 0, 995)]),
        ];
        for &(m, k, n, shape) in cases {
            let x = rand(&mut rng, m * k);
            let w = rand(&mut rng, n * k);
            let bias = rand(&mut rng, n);
            let dy = rand(&mut rng, m * n);
            let pw = PackedBf16::from_f32(&w, n, k);
            let ab: Vec<(Vec<f32>, Vec<f32>)> = shape.iter().map(|&(r, _, n_out)| (rand(&mut rng, r * k), rand(&mut rng, n_out * r))).collect();
            let pairs: Vec<Pair> = shape.iter().zip(&ab).map(|(&(r, col0, n_out), (a, b))| Pair::new(a, b, 0.7, r, col0, n_out)).collect();
            let g0: Vec<(Vec<f32>, Vec<f32>)> = shape.iter().map(|&(r, _, n_out)| (rand(&mut rng, r * k), rand(&mut rng, n_out * r))).collect();
            for &kernel in &kernels {
                for threads in [1, 2] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| {
                        // separate
                        let mut want = vec![0f32; m * n];
                        matmul_bf16_with(&x, &pw, Some(&bias), m, k, n, &mut want, kernel, true);
                        for p in &pairs {
                            lora_bf16(&x, m, k, p, &mut want, n);
                        }
                        let mut got = vec![f32::NAN; m * n];
                        matmul_lora_with(&x, &pw, Some(&bias), m, k, n, &mut got, &pairs, kernel);
                        assert!(got == want, "matmul_lora differs from matmul + lora at m {m} k {k} n {n} ({kernel:?}, {threads} threads)");

                        let mut want_dx = vec![0f32; m * k];
                        matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut want_dx, false, kernel, true);
                        let mut want_g = g0.clone();
                        for (p, (ga, gb)) in pairs.iter().zip(want_g.iter_mut()) {
                            lora_bwd_bf16(&x, m, k, p, &dy, n, (ga, gb), Some(&mut want_dx));
                        }
                        let mut got_dx = vec![f32::NAN; m * k];
                        let mut got_g = g0.clone();
                        let mut gr: Vec<(&mut [f32], &mut [f32])> = got_g.iter_mut().map(|(a, b)| (&mut a[..], &mut b[..])).collect();
                        matmul_dx_lora_with(&dy, &pw, m, n, k, &mut got_dx, XRows::Plain(&x), &pairs, &mut gr, kernel);
                        assert!(got_dx == want_dx, "matmul_dx_lora's dx differs at m {m} k {k} n {n} ({kernel:?}, {threads} threads)");
                        assert!(got_g == want_g, "matmul_dx_lora's dA/dB differ at m {m} k {k} n {n} ({kernel:?}, {threads} threads)");
                        // and the sums are not vacuous: the deltas changed the outputs
                        let mut plain = vec![0f32; m * n];
                        matmul_bf16_with(&x, &pw, Some(&bias), m, k, n, &mut plain, kernel, true);
                        for p in pairs.iter().filter(|p| p.r > 0) {
                            let c = p.col0 + p.n_out / 2;
                            assert!(plain[(m - 1) * n + c] != got[(m - 1) * n + c], "the pair at column {} left the last row unchanged", p.col0);
                        }
                    });
                }
            }
        }
    }

    /// A row's output bits do not depend on the rows beside it nor on the thread count; dA and
    /// dB do not depend on the thread count.
    #[test]
    fn rows_are_batch_and_thread_invariant() {
        let mut rng = Rng::new(5);
        let (m, k, r, n) = (600, 64, 16, 96);
        let (x, a, b, dy) = (rand(&mut rng, m * k), rand(&mut rng, r * k), rand(&mut rng, n * r), rand(&mut rng, m * n));
        let mut all = vec![0f32; m * n];
        let pair = Pair::new(&a, &b, 0.5, r, 0, n);
        lora(&x, m, k, &pair, &mut all, n);
        // 1, 5 and 16 rows take `lora_few`, 17 the blocked path
        for &(i0, rows) in &[(0, 1), (7, 5), (13, 16), (250, 17), (599, 1)] {
            let mut part = vec![0f32; rows * n];
            lora(&x[i0 * k..(i0 + rows) * k], rows, k, &pair, &mut part, n);
            assert!(part == all[i0 * n..(i0 + rows) * n], "rows {i0}..+{rows} differ when run alone");
        }
        let grads = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (mut da, mut db, mut dx) = (vec![0f32; r * k], vec![0f32; n * r], vec![0f32; m * k]);
                lora_bwd(&x, m, k, &pair, &dy, n, (&mut da, &mut db), Some(&mut dx), None);
                (da, db, dx)
            })
        };
        assert!(grads(1) == grads(3), "LoRA gradients depend on the thread count");
    }
}
