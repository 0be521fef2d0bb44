//! The paged KV cache (`CpuKv`, `KvPages`) and causal GQA attention over it.
//!
//! Storage: one allocation per page, laid out `[layer][k|v][kv_head][block]`. A head's values
//! in a page are `[page_size][head_dim]` (a key's values contiguous) and its keys are stored
//! transposed, `[head_dim][page_size]`: the decode kernel then multiplies a broadcast query
//! element by up to 64 consecutive keys' element `d` at once (no horizontal sums), and prefill's
//! `Kᵀ` operand is a row copy per page. Pages are allocated on first write and recycled on release.
//!
//! Compute: one task per (sequence, kv head). Prefill and scoring chunks gather `Kᵀ` and V of the
//! visible context once, then for each query head of the group and each block of query rows do
//! `S = Q Kᵀ` (GEMM), causal mask, softmax in f32, `O = P V` (GEMM); only a `[block, ctx]` score
//! tile exists at a time, never `[T, T]`. Decode rows (a few queries) read K and V straight from
//! the pages (`decode`): a gather would copy the whole context per step.
use super::decode::{decode_row, decode_usable, scores_page, softmax_inplace, values_page, KvElem, Scores};
use super::tiled;
use crate::backend::cpu::matmul::gemm_raw;
use crate::backend::cpu::par::{prefetch_l2, SendPtr};
use crate::backend::{AttnGeom, AttnSeq};
use rayon::prelude::*;

/// The paged KV cache of one element type.
pub struct KvPages<T> {
    pub geom: AttnGeom,
    pages: Vec<Option<Box<[T]>>>,
    spare: Vec<Box<[T]>>,
    max_pages: usize,
}

/// The CPU's KV cache: f32 pages, or bf16 pages with `--dtype bf16`.
pub enum CpuKv {
    F32(KvPages<f32>),
    Bf16(KvPages<u16>),
}

/// `$body` with `$p` bound to the cache's `KvPages`, whatever its element type.
macro_rules! with_pages {
    ($kv:expr, $p:ident => $body:expr) => {
        match $kv {
            CpuKv::F32($p) => $body,
            CpuKv::Bf16($p) => $body,
        }
    };
}

impl CpuKv {
    /// A cache of at most `max_pages` pages, each allocated on first write; bf16 or f32 values.
    pub fn new(geom: AttnGeom, max_pages: usize, bf16: bool) -> Self {
        if bf16 {
            CpuKv::Bf16(KvPages::new(geom, max_pages))
        } else {
            CpuKv::F32(KvPages::new(geom, max_pages))
        }
    }
    pub fn release(&mut self, page: u32) {
        with_pages!(self, p => p.release(page))
    }
    pub fn copy_page(&mut self, src: u32, dst: u32, n_tokens: usize) {
        with_pages!(self, p => p.copy_page(src, dst, n_tokens))
    }
    /// Write k, v of `qkv` rows into `slots`.
    pub fn store(&mut self, layer: usize, qkv: &[f32], slots: &[u32]) {
        with_pages!(self, p => p.store(layer, qkv, slots))
    }
}

/// Offset inside a page of the block of (layer, k|v, head): keys `[head_dim][page_size]`,
/// values `[page_size][head_dim]`.
#[inline]
fn block(g: &AttnGeom, layer: usize, kv: usize, head: usize) -> usize {
    ((layer * 2 + kv) * g.n_kv_heads + head) * g.page_size * g.head_dim
}

impl<T: KvElem> KvPages<T> {
    pub fn new(geom: AttnGeom, max_pages: usize) -> Self {
        KvPages { geom, pages: Vec::new(), spare: Vec::new(), max_pages }
    }

    fn page_len(&self) -> usize {
        let g = &self.geom;
        g.n_layers * 2 * g.n_kv_heads * g.page_size * g.head_dim
    }

    fn page_mut(&mut self, p: u32) -> &mut [T] {
        let p = p as usize;
        assert!(p < self.max_pages, "KV page {p} beyond the pool of {}", self.max_pages);
        if self.pages.len() <= p {
            self.pages.resize_with(p + 1, || None);
        }
        if self.pages[p].is_none() {
            let len = self.page_len();
            let buf = self.spare.pop().unwrap_or_else(|| vec![T::default(); len].into_boxed_slice());
            self.pages[p] = Some(buf);
        }
        self.pages[p].as_deref_mut().unwrap()
    }

    fn page(&self, p: u32) -> &[T] {
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

    /// Copy the first `n_tokens` slots of page `src` into page `dst` (copy-on-write of a
    /// shared prefix's last page).
    pub fn copy_page(&mut self, src: u32, dst: u32, n_tokens: usize) {
        let g = self.geom;
        let (ps, hd) = (g.page_size, g.head_dim);
        let src_buf: Vec<T> = self.page(src).to_vec();
        let dst_buf = self.page_mut(dst);
        for (l, h) in (0..g.n_layers).flat_map(|l| (0..g.n_kv_heads).map(move |h| (l, h))) {
            let (kb, vb) = (block(&g, l, 0, h), block(&g, l, 1, h));
            for d in 0..hd {
                let o = kb + d * ps;
                dst_buf[o..o + n_tokens].copy_from_slice(&src_buf[o..o + n_tokens]);
            }
            dst_buf[vb..vb + n_tokens * hd].copy_from_slice(&src_buf[vb..vb + n_tokens * hd]);
        }
    }

    /// Write k, v of `qkv` rows into `slots`. Rows whose slots follow each other in one page (a
    /// prompt, a scoring chunk) form a run: its keys go in as `[head_dim][run]` strips — each
    /// destination line written once, not one element per row — and the (run, kv head) tasks run
    /// in parallel when there are enough rows to pay for it.
    pub fn store(&mut self, layer: usize, qkv: &[f32], slots: &[u32]) {
        let g = self.geom;
        let (hd, ps, q_dim, kv_dim) = (g.head_dim, g.page_size, g.q_dim(), g.kv_dim());
        let width = g.qkv_dim();
        assert!(qkv.len() >= slots.len() * width, "kv store: {} rows of qkv for {} slots", qkv.len() / width.max(1), slots.len());
        // the writes below go through raw pointers: the block offsets must stay inside a page
        assert!(layer < g.n_layers, "kv store: layer {layer} of a cache for {}", g.n_layers);
        // runs (first row, rows, page): consecutive slots inside one page
        let mut runs: Vec<(usize, usize, u32)> = Vec::new();
        let mut row = 0;
        while row < slots.len() {
            let first = slots[row];
            let mut len = 1;
            while row + len < slots.len() && slots[row + len] == first + len as u32 && (first as usize % ps) + len < ps {
                len += 1;
            }
            self.page_mut(first / ps as u32); // allocated before any pointer is taken
            runs.push((row, len, first / ps as u32));
            row += len;
        }
        // one base pointer per page, taken after every allocation
        let mut pages: Vec<u32> = runs.iter().map(|r| r.2).collect();
        pages.sort_unstable();
        pages.dedup();
        let bases: Vec<SendPtr<T>> = pages.iter().map(|&p| SendPtr(self.pages[p as usize].as_deref_mut().expect("allocated above").as_mut_ptr())).collect();
        let base_of = |p: u32| bases[pages.binary_search(&p).expect("a run's page")];
        // in parallel from 4 rows (a batch of decode rows writes each key's 64 lines of Kᵀ on
        // cold cache: 31 → 26 µs per layer at 8 rows on 2 threads), if no slot is written twice —
        // no two runs' slot ranges overlap (the runtime's slots are unique; otherwise two tasks
        // would write one element: then serially, the last row winning)
        let parallel = slots.len() >= 4 && {
            let mut ranges: Vec<(u32, usize)> = runs.iter().map(|&(r0, len, _)| (slots[r0], len)).collect();
            ranges.sort_unstable();
            ranges.windows(2).all(|w| w[0].0 as usize + w[0].1 <= w[1].0 as usize)
        };
        let write = |&(run, h): &(usize, usize)| {
            let (r0, len, page) = runs[run];
            let base = base_of(page);
            let s0 = slots[r0] as usize % ps;
            let (kb, vb) = (block(&g, layer, 0, h), block(&g, layer, 1, h));
            // Safety: each (run, head) task writes only its own slots s0..s0+len (s0 + len ≤
            // page_size) of its own head's blocks (layer < n_layers), inside a page allocated
            // above; in parallel no two runs share a slot (checked), so these slices are
            // disjoint across concurrent tasks.
            let strip = |off: usize, n: usize| unsafe { std::slice::from_raw_parts_mut(base.get().add(off), n) };
            for d in 0..hd {
                let col = q_dim + h * hd + d;
                for (j, o) in strip(kb + d * ps + s0, len).iter_mut().enumerate() {
                    *o = T::round(qkv[(r0 + j) * width + col]);
                }
            }
            for j in 0..len {
                let v = &qkv[(r0 + j) * width + q_dim + kv_dim + h * hd..][..hd];
                for (o, &x) in strip(vb + (s0 + j) * hd, hd).iter_mut().zip(v) {
                    *o = T::round(x);
                }
            }
        };
        let tasks: Vec<(usize, usize)> = (0..runs.len()).flat_map(|r| (0..g.n_kv_heads).map(move |h| (r, h))).collect();
        if parallel {
            tasks.par_iter().for_each(write);
        } else {
            tasks.iter().for_each(write);
        }
    }

    /// Positions 0..n of one head, as f32: `Kᵀ` `[hd, n]` (kv = 0) or V `[n, hd]` (kv = 1).
    fn gather(&self, layer: usize, kv: usize, head: usize, pages: &[u32], n: usize, out: &mut [f32]) {
        let g = &self.geom;
        let (ps, hd) = (g.page_size, g.head_dim);
        let b = block(g, layer, kv, head);
        let mut done = 0;
        for &page in pages {
            if done >= n {
                break;
            }
            let take = (n - done).min(ps);
            let src = self.page(page);
            if kv == 0 {
                for d in 0..hd {
                    T::get(&mut out[d * n + done..][..take], &src[b + d * ps..][..take]);
                }
            } else {
                T::get(&mut out[done * hd..(done + take) * hd], &src[b..b + take * hd]);
            }
            done += take;
        }
        assert_eq!(done, n, "sequence has {n} tokens but only {} pages", pages.len());
    }
}

/// Query rows per score tile.
const BQ: usize = 64;

pub fn attention(kv: &CpuKv, layer: usize, qkv: &[f32], seqs: &[AttnSeq], out: &mut [f32]) {
    with_pages!(kv, p => attention_pages(p, layer, qkv, seqs, out))
}

fn attention_pages<T: KvElem>(kv: &KvPages<T>, layer: usize, qkv: &[f32], seqs: &[AttnSeq], out: &mut [f32]) {
    let g = kv.geom;
    let (hd, group) = (g.head_dim, g.n_heads / g.n_kv_heads);
    let width = g.qkv_dim();
    let q_dim = g.q_dim();
    let scale = 1.0 / (hd as f32).sqrt();
    let outp = SendPtr(out.as_mut_ptr());
    let tasks: Vec<(usize, usize)> = (0..seqs.len()).flat_map(|s| (0..g.n_kv_heads).map(move |h| (s, h))).collect();
    // bf16 with AMX or AVX512_BF16: fed rows on `attention::tiled`, sampled rows direct (on bf16
    // operands too where `decode_usable`: `attend_direct`), whatever their number (a row's bits
    // must not depend on how a prompt was chunked); otherwise both kernels give the same bits and
    // the row count chooses
    let bf16_rows = T::BF16 && tiled::usable(hd);
    let direct = |s: &AttnSeq| (bf16_rows && s.sampled) || (!bf16_rows && s.n_q <= DIRECT_MAX_Q);
    tasks.par_iter().enumerate().for_each(|(ti, &(si, kvh))| {
        let s = &seqs[si];
        if direct(s) {
            // the next task's first key block, asked for during this one's last values (a thread
            // mostly takes the tasks after its own: rayon splits the range in halves)
            let after = match tasks.get(ti + 1) {
                Some(&(sn, hn)) if direct(&seqs[sn]) && !seqs[sn].pages.is_empty() => kv.page(seqs[sn].pages[0])[block(&g, layer, 0, hn)..].as_ptr(),
                _ => std::ptr::null(),
            };
            // decode rows: read keys/values straight from the pages (no gather copy), once for
            // all query heads of the group
            for r in 0..s.n_q {
                let visible = s.ctx_len - s.n_q + r + 1;
                let row = s.q_row + r;
                let q = &qkv[row * width + kvh * group * hd..][..group * hd];
                let o = unsafe { std::slice::from_raw_parts_mut(outp.get().add(row * q_dim + kvh * group * hd), group * hd) };
                kv.attend_direct(layer, kvh, s.pages, visible, q, group, scale, o, if r + 1 == s.n_q { after } else { std::ptr::null() });
            }
            return;
        }
        let n = s.ctx_len;
        if bf16_rows {
            return tiled::with_scratch(|kt, vp, sc| kv.prefill_bf16(layer, qkv, s, kvh, kt, vp, sc, &outp));
        }
        // Kᵀ [hd, n], row-major (as the pages hold it): the score GEMM packs its B panels by
        // plain row copies instead of a strided transpose per query block.
        let mut kbuf = vec![0f32; n * hd];
        let mut vbuf = vec![0f32; n * hd];
        kv.gather(layer, 0, kvh, s.pages, n, &mut kbuf);
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

impl<T: KvElem> KvPages<T> {
    /// Prefill rows of one (sequence, kv head) on bf16 operands (`attention::tiled`: Q and the softmax
    /// numerators rounded to bf16, as the CUDA backend's tensor-core attention does); K and V are
    /// packed straight from the pages.
    #[allow(clippy::too_many_arguments)]
    fn prefill_bf16(
        &self,
        layer: usize,
        qkv: &[f32],
        s: &AttnSeq,
        kvh: usize,
        kt: &mut Vec<u32>,
        vp: &mut Vec<u32>,
        sc: &mut tiled::Scratch,
        outp: &SendPtr<f32>,
    ) {
        let g = self.geom;
        let (hd, group, n, ps) = (g.head_dim, g.n_heads / g.n_kv_heads, s.ctx_len, g.page_size);
        let (width, q_dim) = (g.qkv_dim(), g.q_dim());
        let scale = 1.0 / (hd as f32).sqrt();
        let (kb, vb) = (block(&g, layer, 0, kvh), block(&g, layer, 1, kvh));
        // Kᵀ panels: word (pair q, key j) = K[j][2q], K[j][2q+1]; V panels: word (pair q of keys,
        // column c) = V[2q][c], V[2q+1][c] (see `attention::tiled`'s operand layout); panels of pw
        let pw = tiled::T;
        let (kp, np) = (hd / 2, n.next_multiple_of(pw) / 2);
        kt.clear();
        kt.resize(n.div_ceil(pw) * kp * pw, 0);
        vp.clear();
        vp.resize(hd / pw * np * pw, 0);
        assert!(
            n.div_ceil(ps) <= s.pages.len(),
            "sequence has {n} tokens but only {} pages",
            s.pages.len()
        );
        // by runs of keys inside one page and one panel: there a pair row of Kᵀ is two
        // contiguous runs of the page's `[head_dim][page_size]` keys, zipped (the same words as
        // key by key, without a strided gather per element)
        let mut j = 0;
        while j < n {
            let page = self.page(s.pages[j / ps]);
            let end = ((j / ps + 1) * ps).min((j / pw + 1) * pw).min(n);
            let (len, o) = (end - j, j % ps);
            let kt_run = (j / pw) * kp * pw + j % pw;
            for q in 0..kp {
                let lo = &page[kb + 2 * q * ps + o..][..len];
                let hi = &page[kb + (2 * q + 1) * ps + o..][..len];
                let dst = &mut kt[kt_run + q * pw..][..len];
                for ((d, l), h) in dst.iter_mut().zip(lo).zip(hi) {
                    *d = l.bits() as u32 | (h.bits() as u32) << 16;
                }
            }
            for jj in j..end {
                // value row jj is the low (jj even) or high half of its pair's words
                let (vals, shift) = (&page[vb + (jj % ps) * hd..][..hd], 16 * (jj % 2));
                for (c0, vs) in vals.chunks(pw).enumerate() {
                    let dst = &mut vp[c0 * np * pw + (jj / 2) * pw..][..vs.len()];
                    for (d, v) in dst.iter_mut().zip(vs) {
                        *d |= (v.bits() as u32) << shift;
                    }
                }
            }
            j = end;
        }
        let pr = tiled::Products::new();
        let qs = (s.q_row, s.n_q, n - s.n_q);
        tiled::forward_rows(&pr, kt, vp, np * pw, hd, (qkv, width), qs, (kvh * group, group, BQ), scale, sc, |row, h, o| {
            // Safety: rows of this sequence, columns of this kv group's heads: this task's only
            unsafe { std::ptr::copy_nonoverlapping(o.as_ptr(), outp.get().add(row * q_dim + h * hd), hd) }
        }, |_, _, _| {});
    }
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

impl<T: KvElem> KvPages<T> {
    /// One query row of the `group` query heads sharing kv head `kvh`, over `visible` cached
    /// positions: K is read once (scores of all heads), then V once (weighted sums), page by page.
    /// `after`: the block read next after this row (null: unknown), asked into L2 during the
    /// last values.
    #[allow(clippy::too_many_arguments)]
    fn attend_direct(&self, layer: usize, kvh: usize, pages: &[u32], visible: usize, q: &[f32], group: usize, scale: f32, out: &mut [f32], after: *const T) {
        let (ps, hd) = (self.geom.page_size, self.geom.head_dim);
        let (kb, vb) = (block(&self.geom, layer, 0, kvh), block(&self.geom, layer, 1, kvh));
        let n_pages = visible.div_ceil(ps);
        // Each block (a page's keys or values of this head, 8 KiB for 64 × 64 bf16) is a short
        // stream elsewhere in memory: fetched on demand, row after row, its loads wait on memory
        // one after the other. So the next block is asked into L2 while this one is used
        // (decode loop, cold cache: 0.79 → 0.74 s of attention per 127 steps, one run each):
        // a row of it per row of this one inside the kernels (`Scores::next`, `values_page`).
        // Asked as a whole, 128 prefetches at once waited on the line fill buffers: those loops
        // were 8 % of a decode step's samples.
        let block_len = hd * ps;
        let next = |pi: usize| -> Option<*const T> {
            match pi {
                _ if pi < n_pages => Some(self.page(pages[pi])[kb..].as_ptr()),
                _ if pi < 2 * n_pages => Some(self.page(pages[pi - n_pages])[vb..].as_ptr()),
                _ if pi == 2 * n_pages && !after.is_null() => Some(after),
                _ => None,
            }
        };
        prefetch_l2(next(0).unwrap(), block_len);
        if let Some(kv16) = as_bf16(self) {
            if decode_usable(hd, ps) {
                // bf16 operands, as the fed rows (`attention::tiled`) and the CUDA kernel: a sampled
                // token's log-prob then equals its score. The f32 kernels below were bound by
                // their FMAs with K and V in cache (8 rows × 384 keys, one layer: 69.8 → 42.4 µs,
                // `cargo bench --bench kernels -- "decode attention"`)
                let blk = |pi: usize, b: usize| &kv16.page(pages[pi])[b..b + hd * ps];
                let nx = |i: usize| next(i).map_or(std::ptr::null(), |p| p as *const u16);
                return decode_row(|pi| blk(pi, kb), |pi| blk(pi, vb), nx, (ps, hd, visible), q, group, scale, out);
            }
        }
        // scores[h * visible + t]
        let mut scores = vec![0f32; group * visible];
        for (pi, &p) in pages[..n_pages].iter().enumerate() {
            let t0 = pi * ps;
            let nt = ps.min(visible - t0);
            let sc = Scores { q, group, hd, scale, out: &mut scores, visible, t0, next: next(pi + 1).map_or(std::ptr::null(), |p| p as *const u8) };
            scores_page(sc, &self.page(p)[kb..kb + hd * ps], ps, nt);
        }
        for h in 0..group {
            softmax_inplace(&mut scores[h * visible..(h + 1) * visible]);
        }
        out.fill(0.0);
        for (pi, &p) in pages[..n_pages].iter().enumerate() {
            let t0 = pi * ps;
            let nt = ps.min(visible - t0);
            let np = next(n_pages + pi + 1).map_or(std::ptr::null(), |p| p as *const u8);
            values_page(&scores[t0..], visible, &self.page(p)[vb..vb + nt * hd], group, hd, out, np);
        }
    }
}

/// This cache as bf16 pages when it is one.
fn as_bf16<T: KvElem>(kv: &KvPages<T>) -> Option<&KvPages<u16>> {
    // Safety: T is u16 (checked): the same type.
    (std::any::TypeId::of::<T>() == std::any::TypeId::of::<u16>()).then(|| unsafe { &*(kv as *const KvPages<T> as *const KvPages<u16>) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::bf16::f32_to_bf16_bits;

    /// Causal GQA attention in f64 for the last `n_q` rows of a sequence whose K and V are `qkv`
    /// rows `row0..row0 + len` (K and V rounded to bf16 first when `bf16`).
    /// With `round_q` the queries are rounded to bf16 too (the bf16 prefill's operands).
    fn reference(qkv: &[f32], g: AttnGeom, row0: usize, len: usize, n_q: usize, bf16: bool, round_q: bool) -> Vec<f64> {
        let (w, hd, group) = (g.qkv_dim(), g.head_dim, g.n_heads / g.n_kv_heads);
        let kvv = |x: f32| if bf16 { f32::from_bits((f32_to_bf16_bits(x) as u32) << 16) as f64 } else { x as f64 };
        let qv = |x: f32| if round_q { kvv(x) } else { x as f64 };
        let mut out = vec![0f64; n_q * g.q_dim()];
        for r in 0..n_q {
            let pos = len - n_q + r;
            for qh in 0..g.n_heads {
                let kvh = qh / group;
                let q = &qkv[(row0 + pos) * w + qh * hd..][..hd];
                let sc: Vec<f64> = (0..=pos)
                    .map(|t| {
                        let k = &qkv[(row0 + t) * w + g.q_dim() + kvh * hd..][..hd];
                        q.iter().zip(k).map(|(&a, &b)| qv(a) * kvv(b)).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                for (t, x) in sc.iter().enumerate() {
                    let v = &qkv[(row0 + t) * w + g.q_dim() + g.kv_dim() + kvh * hd..][..hd];
                    for d in 0..hd {
                        out[r * g.q_dim() + qh * hd + d] += (x - m).exp() / z * kvv(v[d]);
                    }
                }
            }
        }
        out
    }

    /// `store` puts each row's k and v where `gather` finds them, whatever the slot order: runs
    /// that stop at a page edge or start mid-page, slots out of order, a second layer, few rows
    /// (serial) and many (parallel), f32 and bf16 pages.
    #[test]
    fn store_places_every_row() {
        let g = AttnGeom { n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 20, page_size: 16 };
        let w = g.qkv_dim();
        // 5 pages of 16; rows: 10..40 in order (across three pages), then 5, 4, 3 backwards, then
        // 70..74 with 45 inside, and the rest in runs that start and stop mid-page: 75 rows
        let mut slots: Vec<u32> = (10..40).chain([5, 4, 3]).chain([70, 45, 71, 72, 73]).collect();
        slots.extend((46..70).chain(0..3).chain(74..80).chain(6..10));
        assert_eq!(slots.len(), 75);
        let value = |row: usize, c: usize| ((row * 131 + c * 7) % 1000) as f32 / 64.0 - 7.0;
        for bf16 in [false, true] {
            for n in [3, 5, slots.len()] {
                let qkv: Vec<f32> = (0..n * w).map(|e| value(e / w, e % w)).collect();
                let mut kv = KvPages::<u16>::new(g, 5);
                let mut kf = KvPages::<f32>::new(g, 5);
                if bf16 {
                    kv.store(1, &qkv, &slots[..n]);
                } else {
                    kf.store(1, &qkv, &slots[..n]);
                }
                for h in 0..g.n_kv_heads {
                    let (mut kt, mut vv) = (vec![0f32; 20 * 80], vec![0f32; 80 * 20]);
                    let pages = [0u32, 1, 2, 3, 4];
                    let touched: Vec<u32> = (0..5).filter(|p| slots[..n].iter().any(|s| s / 16 == *p)).collect();
                    if touched.len() < 5 {
                        continue; // gather needs all five pages; the n ≤ 5 cases check below
                    }
                    if bf16 {
                        kv.gather(1, 0, h, &pages, 80, &mut kt);
                        kv.gather(1, 1, h, &pages, 80, &mut vv);
                    } else {
                        kf.gather(1, 0, h, &pages, 80, &mut kt);
                        kf.gather(1, 1, h, &pages, 80, &mut vv);
                    }
                    for (row, &slot) in slots[..n].iter().enumerate() {
                        for d in 0..20 {
                            let (k, v) = (value(row, g.q_dim() + h * 20 + d), value(row, g.q_dim() + g.kv_dim() + h * 20 + d));
                            let r = |x: f32| if bf16 { f32::from_bits((crate::backend::cpu::bf16::f32_to_bf16_bits(x) as u32) << 16) } else { x };
                            assert_eq!(kt[d * 80 + slot as usize], r(k), "bf16 {bf16}, {n} rows: key of row {row} (slot {slot}, head {h}, d {d})");
                            assert_eq!(vv[slot as usize * 20 + d], r(v), "bf16 {bf16}, {n} rows: value of row {row} (slot {slot}, head {h}, d {d})");
                        }
                    }
                }
                if n <= 5 {
                    // 3 rows: the serial path, 5 the parallel one: rows 10.. of page 0, read back
                    // from the page directly
                    let page: Vec<f32> = if bf16 { kv.page(0).iter().map(|x| x.widen()).collect() } else { kf.page(0).to_vec() };
                    for (row, &slot) in slots[..n].iter().enumerate() {
                        let k = value(row, g.q_dim() + 20 + 3); // head 1, d 3, layer 1
                        let got = page[block(&g, 1, 0, 1) + 3 * 16 + slot as usize];
                        assert!((got - k).abs() <= k.abs() / 128.0, "bf16 {bf16}: serial store of row {row}: {got} vs {k}");
                    }
                }
            }
        }
    }

    /// A slot written twice in one call (of a size that would otherwise run in parallel) holds
    /// the later row, as one-by-one writes would leave it.
    #[test]
    fn store_repeated_slot_keeps_the_last_row() {
        let g = AttnGeom { n_layers: 1, n_heads: 2, n_kv_heads: 1, head_dim: 16, page_size: 64 };
        let w = g.qkv_dim();
        let slots: Vec<u32> = (0..70).chain([5]).collect();
        let qkv: Vec<f32> = (0..slots.len() * w).map(|e| (e / w) as f32 + (e % w) as f32 / 64.0).collect();
        let mut kv = KvPages::<f32>::new(g, 2);
        kv.store(0, &qkv, &slots);
        let (mut kt, mut vv) = (vec![0f32; 16 * 70], vec![0f32; 70 * 16]);
        kv.gather(0, 0, 0, &[0, 1], 70, &mut kt);
        kv.gather(0, 1, 0, &[0, 1], 70, &mut vv);
        assert_eq!(kt[3 * 70 + 5], qkv[70 * w + g.q_dim() + 3], "key of slot 5");
        assert_eq!(vv[5 * 16 + 3], qkv[70 * w + g.q_dim() + g.kv_dim() + 3], "value of slot 5");
        assert_eq!(vv[6 * 16 + 3], qkv[6 * w + g.q_dim() + g.kv_dim() + 3], "value of slot 6");
    }

    /// Decode rows (the direct kernels: 1–4 vectors of keys or columns × 1–3 heads, the tail
    /// keys and columns one at a time, group sizes 3, 2, 1, 8 and 7; with bf16 pages of 32 and
    /// 64 keys and heads of 64 and 128 also `attention::decode::decode_row`, odd context lengths
    /// included) and prefill rows (gather + GEMM) against f64, with the f32 and the bf16 cache,
    /// across pages of 16, 64 and 20 (not a whole number of vectors).
    #[test]
    fn decode_and_prefill_rows_match_f64() {
        for &(hd, n_heads, n_kv, ps) in &[(64usize, 9usize, 3usize, 16usize), (64, 9, 3, 64), (24, 4, 2, 16), (20, 2, 2, 20), (40, 8, 1, 64), (48, 6, 3, 64), (128, 8, 1, 64), (64, 14, 2, 32)] {
            let g = AttnGeom { n_layers: 1, n_heads, n_kv_heads: n_kv, head_dim: hd, page_size: ps };
            let w = g.qkv_dim();
            let lens = [70usize, 9, 33, 5, 100];
            let n_q = [1usize, 3, 20, 4, 90];
            let rows: usize = lens.iter().sum();
            let mut st = 12345u64;
            let qkv: Vec<f32> = (0..rows * w)
                .map(|_| {
                    st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((st >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                })
                .collect();
            for bf16 in [false, true] {
                let total: usize = lens.iter().map(|l| l.div_ceil(ps)).sum();
                let mut kv = CpuKv::new(g, total, bf16);
                let (mut pages, mut slots, mut next, mut row0) = (Vec::new(), Vec::new(), 0u32, 0);
                let mut starts = Vec::new();
                for &len in &lens {
                    let p: Vec<u32> = (next..next + len.div_ceil(ps) as u32).collect();
                    next += p.len() as u32;
                    slots.extend((0..len).map(|t| p[t / ps] * ps as u32 + (t % ps) as u32));
                    pages.push(p);
                    starts.push(row0);
                    row0 += len;
                }
                kv.store(0, &qkv, &slots);
                let seqs: Vec<AttnSeq> = (0..lens.len()).map(|i| AttnSeq { q_row: starts[i] + lens[i] - n_q[i], n_q: n_q[i], ctx_len: lens[i], pages: &pages[i], sampled: n_q[i] <= DIRECT_MAX_Q }).collect();
                let mut out = vec![f32::NAN; rows * g.q_dim()];
                attention(&kv, 0, &qkv, &seqs, &mut out);
                for i in 0..lens.len() {
                    // bf16 rows on `attention::tiled` (fed rows; sampled rows where `decode_usable`)
                    // round Q (in the reference too) and the softmax numerators (each by ≤ 2⁻⁸
                    // relative, so the output by ≤ 2⁻⁸·max|v| = 2⁻⁷)
                    let rounded = bf16 && tiled::usable(hd) && (!seqs[i].sampled || decode_usable(hd, ps));
                    let tol = if rounded { 2f64.powi(-7) + 2e-5 } else { 2e-5 };
                    let want = reference(&qkv, g, starts[i], lens[i], n_q[i], bf16, rounded);
                    let got = &out[(starts[i] + lens[i] - n_q[i]) * g.q_dim()..][..n_q[i] * g.q_dim()];
                    let err = got.iter().zip(&want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0f64, f64::max);
                    assert!(err < tol, "hd {hd}, heads {n_heads}/{n_kv}, pages of {ps}, bf16 {bf16}, sequence {i} (len {}, {} rows): max error {err:.2e}", lens[i], n_q[i]);
                }
            }
        }
    }

}
