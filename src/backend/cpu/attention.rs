//! Causal GQA attention over a paged KV cache, on the CPU.
//!
//! Storage: one allocation per page, laid out `[layer][k|v][kv_head][page_size][head_dim]`, so a
//! head's keys within a page are contiguous and gathering a sequence's keys is one `memcpy` per
//! page. Pages are allocated on first write and recycled on release.
//!
//! Compute: one task per (sequence, kv head). Prefill and scoring chunks gather K and V of the
//! visible context once, then for each query head of the group and each block of query rows do
//! `S = Q Kᵀ` (GEMM), causal mask, softmax in f32, `O = P V` (GEMM); only a `[block, ctx]` score
//! tile exists at a time, never `[T, T]`. Decode rows (a few queries) read K and V straight from
//! the pages with dot products: a gather would copy the whole context per step.
use super::matmul::{gemm_raw, SendPtr};
use crate::backend::{AttnGeom, AttnSeq};
use rayon::prelude::*;

pub struct CpuKv {
    pub geom: AttnGeom,
    pages: Vec<Option<Box<[f32]>>>,
    spare: Vec<Box<[f32]>>,
    max_pages: usize,
}

impl CpuKv {
    pub fn new(geom: AttnGeom, max_pages: usize) -> Self {
        CpuKv { geom, pages: Vec::new(), spare: Vec::new(), max_pages }
    }

    fn page_len(&self) -> usize {
        let g = &self.geom;
        g.n_layers * 2 * g.n_kv_heads * g.page_size * g.head_dim
    }

    /// Offset inside a page of (layer, k|v, head, slot).
    #[inline]
    fn off(&self, layer: usize, kv: usize, head: usize, slot: usize) -> usize {
        let g = &self.geom;
        (((layer * 2 + kv) * g.n_kv_heads + head) * g.page_size + slot) * g.head_dim
    }

    fn page_mut(&mut self, p: u32) -> &mut [f32] {
        let p = p as usize;
        assert!(p < self.max_pages, "KV page {p} beyond the pool of {}", self.max_pages);
        if self.pages.len() <= p {
            self.pages.resize_with(p + 1, || None);
        }
        if self.pages[p].is_none() {
            let len = self.page_len();
            let buf = self.spare.pop().unwrap_or_else(|| vec![0f32; len].into_boxed_slice());
            self.pages[p] = Some(buf);
        }
        self.pages[p].as_deref_mut().unwrap()
    }

    fn page(&self, p: u32) -> &[f32] {
        self.pages
            .get(p as usize)
            .and_then(|x| x.as_deref())
            .unwrap_or_else(|| panic!("KV page {p} read before it was written"))
    }

    pub fn release(&mut self, p: u32) {
        if let Some(slot) = self.pages.get_mut(p as usize) {
            if let Some(buf) = slot.take() {
                self.spare.push(buf);
            }
        }
    }

    pub fn copy_page(&mut self, src: u32, dst: u32, n_tokens: usize) {
        let g = self.geom;
        let src_buf: Vec<f32> = self.page(src).to_vec();
        let offs: Vec<usize> = (0..g.n_layers * 2 * g.n_kv_heads).map(|i| i * g.page_size * g.head_dim).collect();
        let dst_buf = self.page_mut(dst);
        let n = n_tokens * g.head_dim;
        for o in offs {
            dst_buf[o..o + n].copy_from_slice(&src_buf[o..o + n]);
        }
    }

    /// Write k, v of `qkv` rows into `slots`.
    pub fn store(&mut self, layer: usize, qkv: &[f32], slots: &[u32]) {
        let g = self.geom;
        let (hd, q_dim, kv_dim) = (g.head_dim, g.q_dim(), g.kv_dim());
        let width = g.qkv_dim();
        for (row, &slot) in slots.iter().enumerate() {
            let (page, s) = (slot / g.page_size as u32, slot as usize % g.page_size);
            let src = &qkv[row * width..(row + 1) * width];
            let offs: Vec<(usize, usize)> = (0..g.n_kv_heads)
                .flat_map(|h| [(self.off(layer, 0, h, s), q_dim + h * hd), (self.off(layer, 1, h, s), q_dim + kv_dim + h * hd)])
                .collect();
            let buf = self.page_mut(page);
            for (dst, from) in offs {
                buf[dst..dst + hd].copy_from_slice(&src[from..from + hd]);
            }
        }
    }

    /// Contiguous `[n, hd]` keys (kv = 0) or values (kv = 1) of one head for positions 0..n.
    fn gather(&self, layer: usize, kv: usize, head: usize, pages: &[u32], n: usize, out: &mut [f32]) {
        let g = &self.geom;
        let (p, hd) = (g.page_size, g.head_dim);
        let mut done = 0;
        for &page in pages {
            if done >= n {
                break;
            }
            let take = (n - done).min(p);
            let o = self.off(layer, kv, head, 0);
            out[done * hd..(done + take) * hd].copy_from_slice(&self.page(page)[o..o + take * hd]);
            done += take;
        }
        assert_eq!(done, n, "sequence has {n} tokens but only {} pages", pages.len());
    }
}

/// Query rows per score tile.
const BQ: usize = 64;

pub fn attention(kv: &CpuKv, layer: usize, qkv: &[f32], seqs: &[AttnSeq], out: &mut [f32]) {
    let g = kv.geom;
    let (hd, group) = (g.head_dim, g.n_heads / g.n_kv_heads);
    let width = g.qkv_dim();
    let q_dim = g.q_dim();
    let scale = 1.0 / (hd as f32).sqrt();
    let outp = SendPtr(out.as_mut_ptr());
    let tasks: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|s| (0..g.n_kv_heads).map(move |h| (s, h))).collect();
    tasks.par_iter().for_each(|&(si, kvh)| {
        let s = &seqs[si];
        if s.n_q <= DIRECT_MAX_Q {
            // decode rows: read keys/values straight from the pages (no gather copy), once for
            // all query heads of the group
            for r in 0..s.n_q {
                let visible = s.ctx_len - s.n_q + r + 1;
                let row = s.q_row + r;
                let q = &qkv[row * width + kvh * group * hd..][..group * hd];
                let o = unsafe { std::slice::from_raw_parts_mut(outp.get().add(row * q_dim + kvh * group * hd), group * hd) };
                kv.attend_direct(layer, kvh, s.pages, visible, q, group, scale, o);
            }
            return;
        }
        let n = s.ctx_len;
        let mut kbuf = vec![0f32; n * hd];
        let mut vbuf = vec![0f32; n * hd];
        kv.gather(layer, 0, kvh, s.pages, n, &mut vbuf);
        // Kᵀ [hd, n], row-major: the score GEMM then packs its B panels by plain row copies
        // instead of a strided transpose per query block.
        // Safety: vbuf holds n rows of hd, kbuf hd rows of n; distinct buffers.
        unsafe { super::memory::transpose(vbuf.as_ptr(), hd, n, hd, kbuf.as_mut_ptr(), n) };
        kv.gather(layer, 1, kvh, s.pages, n, &mut vbuf);
        let first_pos = n - s.n_q; // position of the first query row
        // The group's query heads share K and V: stack their rows so each block is one GEMM of
        // `group·bq` rows (3× larger products than per head).
        let gq = group * hd;
        let cap = BQ.min(s.n_q) * group;
        let mut qg = vec![0f32; cap * hd];
        let mut og = vec![0f32; cap * hd];
        let mut scores = vec![0f32; cap * n];
        let mut r0 = 0;
        while r0 < s.n_q {
            let bq = BQ.min(s.n_q - r0);
            let kmax = first_pos + r0 + bq; // keys visible to the block's last row
            let m = group * bq;
            stack_group(qkv, width, s.q_row + r0, kvh * gq, bq, group, hd, &mut qg);
            unsafe {
                // S[m, kmax] = Qg[m, hd] · Kᵀ[hd, kmax]
                gemm_raw(m, kmax, hd, scores.as_mut_ptr(), kmax as isize, 1, false, qg.as_ptr(), hd as isize, 1, kbuf.as_ptr(), n as isize, 1, scale, false);
            }
            for i in 0..m {
                let visible = first_pos + r0 + i % bq + 1;
                let row = &mut scores[i * kmax..(i + 1) * kmax];
                softmax_inplace(&mut row[..visible]);
                row[visible..].fill(0.0);
            }
            unsafe {
                // Og[m, hd] = P[m, kmax] · V[kmax, hd]
                gemm_raw(m, hd, kmax, og.as_mut_ptr(), hd as isize, 1, false, scores.as_ptr(), kmax as isize, 1, vbuf.as_ptr(), hd as isize, 1, 1.0, false);
            }
            // Safety: rows r0.. of this sequence, heads of this kv group: written by this task only
            unsafe { unstack_group(&og, bq, group, hd, outp.get(), q_dim, s.q_row + r0, kvh * gq) };
            r0 += bq;
        }
    });
}

/// `qg[h·bq + r] = qkv[row0 + r, col0 + h·hd ..][..hd]`: the query heads of one GQA group for
/// `bq` rows, stacked head-major so one product of `group·bq` rows serves the whole group.
#[allow(clippy::too_many_arguments)]
pub(crate) fn stack_group(qkv: &[f32], width: usize, row0: usize, col0: usize, bq: usize, group: usize, hd: usize, qg: &mut [f32]) {
    for r in 0..bq {
        let src = &qkv[(row0 + r) * width + col0..][..group * hd];
        for h in 0..group {
            qg[(h * bq + r) * hd..(h * bq + r + 1) * hd].copy_from_slice(&src[h * hd..(h + 1) * hd]);
        }
    }
}

/// The inverse of `stack_group`, into `out` (rows of `ld`).
///
/// # Safety
/// `out` must cover rows `row0..row0 + bq` of `ld`, columns `col0..col0 + group·hd`, and no one
/// else may access them meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn unstack_group(og: &[f32], bq: usize, group: usize, hd: usize, out: *mut f32, ld: usize, row0: usize, col0: usize) {
    for r in 0..bq {
        let dst = out.add((row0 + r) * ld + col0);
        for h in 0..group {
            std::ptr::copy_nonoverlapping(og[(h * bq + r) * hd..][..hd].as_ptr(), dst.add(h * hd), hd);
        }
    }
}

/// Sequences with at most this many query rows read the pages directly; longer ones gather K/V
/// once and use GEMM tiles.
const DIRECT_MAX_Q: usize = 4;

impl CpuKv {
    /// One query row of the `group` query heads sharing kv head `kvh`, over `visible` cached
    /// positions: K is read once (scores of all heads), then V once (weighted sums).
    #[allow(clippy::too_many_arguments)]
    fn attend_direct(&self, layer: usize, kvh: usize, pages: &[u32], visible: usize, q: &[f32], group: usize, scale: f32, out: &mut [f32]) {
        let (ps, hd) = (self.geom.page_size, self.geom.head_dim);
        let (ko, vo) = (self.off(layer, 0, kvh, 0), self.off(layer, 1, kvh, 0));
        let n_pages = visible.div_ceil(ps);
        // scores[h * visible + t]
        let mut scores = vec![0f32; group * visible];
        for (pi, &p) in pages[..n_pages].iter().enumerate() {
            let t0 = pi * ps;
            let nt = ps.min(visible - t0);
            let keys = &self.page(p)[ko..ko + nt * hd];
            // the next page's keys are elsewhere in memory: fetch them while these are used
            let next = pages.get(pi + 1).filter(|_| pi + 1 < n_pages).map(|&np| self.page(np)[ko..].as_ptr());
            for (j, key) in keys.chunks_exact(hd).enumerate() {
                if let Some(np) = next {
                    prefetch_row(np.wrapping_add(j * hd), hd);
                }
                for h in 0..group {
                    scores[h * visible + t0 + j] = dot(&q[h * hd..(h + 1) * hd], key) * scale;
                }
            }
        }
        for h in 0..group {
            softmax_inplace(&mut scores[h * visible..(h + 1) * visible]);
        }
        out.fill(0.0);
        for (pi, &p) in pages[..n_pages].iter().enumerate() {
            let t0 = pi * ps;
            let nt = ps.min(visible - t0);
            let vals = &self.page(p)[vo..vo + nt * hd];
            let next = pages.get(pi + 1).filter(|_| pi + 1 < n_pages).map(|&np| self.page(np)[vo..].as_ptr());
            for (j, val) in vals.chunks_exact(hd).enumerate() {
                if let Some(np) = next {
                    prefetch_row(np.wrapping_add(j * hd), hd);
                }
                for h in 0..group {
                    super::simd::axpy(&mut out[h * hd..(h + 1) * hd], scores[h * visible + t0 + j], val);
                }
            }
        }
    }
}

/// Hint the cache to fetch `n` floats at `p` (one prefetch per 64-byte line; a no-op elsewhere).
#[inline(always)]
fn prefetch_row(p: *const f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..n).step_by(16) {
        // Safety: prefetch never faults; the address is only a hint.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.wrapping_add(i) as *const i8) };
    }
}

pub use super::simd::dot;

#[inline]
pub fn softmax_inplace(x: &mut [f32]) {
    let m = super::simd::max(x);
    let inv = 1.0 / super::simd::exp_sub_sum(x, m);
    for v in x.iter_mut() {
        *v *= inv;
    }
}
