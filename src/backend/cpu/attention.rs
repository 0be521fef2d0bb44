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
//!
//! Element type (`KvElem`): f32 with `--dtype f32`, bf16 with `--dtype bf16` (as on CUDA: K and V
//! rounded to nearest even when stored, widened to f32 when read; scores, softmax and sums f32).
use super::matmul::{gemm_raw, SendPtr};
use crate::backend::{AttnGeom, AttnSeq};
use rayon::prelude::*;

/// A KV page's element: f32 (`--dtype f32`), or bf16 bits (`--dtype bf16`, the CUDA backend's
/// policy: half the bytes every decode step streams; values rounded once, to nearest even, as
/// they are stored; the arithmetic stays f32).
pub trait KvElem: Copy + Default + Send + Sync + 'static {
    /// Round `src` into `dst` (same length).
    fn put(dst: &mut [Self], src: &[f32]);
    /// Widen `src` into `dst` (same length).
    fn get(dst: &mut [f32], src: &[Self]);
    /// Σ q[i]·k[i] in f32.
    fn dot(q: &[f32], k: &[Self]) -> f32;
    /// y += alpha·x in f32.
    fn axpy(y: &mut [f32], alpha: f32, x: &[Self]);
    /// 8 values at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p` must hold 8 values.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElem for f32 {
    fn put(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
    fn get(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn dot(q: &[f32], k: &[f32]) -> f32 {
        super::simd::dot(q, k)
    }
    #[inline(always)]
    fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
        super::simd::axpy(y, alpha, x)
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl KvElem for u16 {
    fn put(dst: &mut [u16], src: &[f32]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = super::gemm_bf16::f32_to_bf16_bits(x);
        }
    }
    fn get(dst: &mut [f32], src: &[u16]) {
        super::simd::widen_bf16(dst, src)
    }
    #[inline(always)]
    fn dot(q: &[f32], k: &[u16]) -> f32 {
        super::simd::dot_bf16(q, k)
    }
    #[inline(always)]
    fn axpy(y: &mut [f32], alpha: f32, x: &[u16]) {
        super::simd::axpy_bf16(y, alpha, x)
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    #[inline(always)]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // a bf16 is the high half of an f32: widen to 32 bits, shift into place
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
    }
}

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

impl<T: KvElem> KvPages<T> {
    pub fn new(geom: AttnGeom, max_pages: usize) -> Self {
        KvPages { geom, pages: Vec::new(), spare: Vec::new(), max_pages }
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

    pub fn copy_page(&mut self, src: u32, dst: u32, n_tokens: usize) {
        let g = self.geom;
        let src_buf: Vec<T> = self.page(src).to_vec();
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
                T::put(&mut buf[dst..dst + hd], &src[from..from + hd]);
            }
        }
    }

    /// Contiguous f32 `[n, hd]` keys (kv = 0) or values (kv = 1) of one head for positions 0..n.
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
            T::get(&mut out[done * hd..(done + take) * hd], &self.page(page)[o..o + take * hd]);
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

impl<T: KvElem> KvPages<T> {
    /// One query row of the `group` query heads sharing kv head `kvh`, over `visible` cached
    /// positions: K is read once (scores of all heads), then V once (weighted sums), page by page.
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
            // the next page is elsewhere in memory: ask for its first keys while these are used
            if let Some(&np) = pages.get(pi + 1).filter(|_| pi + 1 < n_pages) {
                prefetch_row(self.page(np)[ko..].as_ptr(), 8 * hd);
            }
            scores_page(q, &self.page(p)[ko..ko + nt * hd], group, hd, scale, &mut scores, visible, t0);
        }
        for h in 0..group {
            softmax_inplace(&mut scores[h * visible..(h + 1) * visible]);
        }
        out.fill(0.0);
        for (pi, &p) in pages[..n_pages].iter().enumerate() {
            let t0 = pi * ps;
            let nt = ps.min(visible - t0);
            if let Some(&np) = pages.get(pi + 1).filter(|_| pi + 1 < n_pages) {
                prefetch_row(self.page(np)[vo..].as_ptr(), 8 * hd);
            }
            values_page(&scores, &self.page(p)[vo..vo + nt * hd], group, hd, visible, t0, out);
        }
    }
}

/// `scores[h·visible + t0 + j] = scale · q_h · key_j` for the `nt = keys.len() / hd` keys of one
/// page and every head `h` of the group.
#[allow(clippy::too_many_arguments)]
fn scores_page<T: KvElem>(q: &[f32], keys: &[T], group: usize, hd: usize, scale: f32, scores: &mut [f32], visible: usize, t0: usize) {
    #[allow(unused_mut)]
    let mut j0 = 0;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    if hd % 8 == 0 {
        // blocks of 8 keys: one accumulator per key, reduced together (one tree for 8 dots)
        while j0 + 8 <= keys.len() / hd {
            for h in 0..group {
                // Safety: q holds group·hd values, keys nt·hd; scores row h has visible ≥ t0 + nt.
                unsafe { avx::dot8(q[h * hd..].as_ptr(), keys[j0 * hd..].as_ptr(), hd, scale, scores[h * visible + t0 + j0..].as_mut_ptr()) };
            }
            j0 += 8;
        }
    }
    for (j, key) in keys.chunks_exact(hd).enumerate().skip(j0) {
        for h in 0..group {
            scores[h * visible + t0 + j] = T::dot(&q[h * hd..(h + 1) * hd], key) * scale;
        }
    }
}

/// `out_h += Σ_j p[h·visible + t0 + j] · value_j` over one page's values, for every head `h`,
/// key after key (the order of the plain `axpy` loop, so the same bits).
fn values_page<T: KvElem>(p: &[f32], vals: &[T], group: usize, hd: usize, visible: usize, t0: usize, out: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    if hd % 8 == 0 {
        for h in 0..group {
            // Safety: out row h and p row h as above; vals holds nt·hd values.
            unsafe { avx::weighted_sum(p[h * visible + t0..].as_ptr(), vals.as_ptr(), vals.len() / hd, hd, out[h * hd..].as_mut_ptr()) };
        }
        return;
    }
    for (j, val) in vals.chunks_exact(hd).enumerate() {
        for h in 0..group {
            T::axpy(&mut out[h * hd..(h + 1) * hd], p[h * visible + t0 + j], val);
        }
    }
}

/// The decode kernels with AVX2 (the crate's baseline, .cargo/config.toml), for `hd % 8 == 0`.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
mod avx {
    use super::KvElem;
    use std::arch::x86_64::*;

    /// `out[j] = scale · Σ_d q[d]·k_j[d]` for 8 consecutive keys `k_j` of `hd` values.
    ///
    /// # Safety
    /// `q` holds `hd` values, `k` 8·`hd`, `out` 8; `hd % 8 == 0`.
    #[inline(always)]
    pub unsafe fn dot8<T: KvElem>(q: *const f32, k: *const T, hd: usize, scale: f32, out: *mut f32) {
        let mut a = [_mm256_setzero_ps(); 8];
        let mut d = 0;
        while d < hd {
            let qv = _mm256_loadu_ps(q.add(d));
            for (j, aj) in a.iter_mut().enumerate() {
                *aj = _mm256_fmadd_ps(qv, T::load8(k.add(j * hd + d)), *aj);
            }
            d += 8;
        }
        // 8 horizontal sums at once: pairwise adds, then the two 128-bit halves
        let t0 = _mm256_hadd_ps(a[0], a[1]);
        let t1 = _mm256_hadd_ps(a[2], a[3]);
        let t2 = _mm256_hadd_ps(a[4], a[5]);
        let t3 = _mm256_hadd_ps(a[6], a[7]);
        let u0 = _mm256_hadd_ps(t0, t1); // keys 0–3: low half dims 0–3 of each lane group, high half 4–7
        let u1 = _mm256_hadd_ps(t2, t3);
        let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
        let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
        _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
    }

    /// `out[0..hd] += Σ_j p[j] · v_j[0..hd]` over `nt` rows of `hd` values, 32 columns at a
    /// time held in registers; per element the same fused multiply-adds in key order as `axpy`.
    ///
    /// # Safety
    /// `p` holds `nt` values, `v` `nt·hd`, `out` `hd`; `hd % 8 == 0`.
    #[inline(always)]
    pub unsafe fn weighted_sum<T: KvElem>(p: *const f32, v: *const T, nt: usize, hd: usize, out: *mut f32) {
        let mut d = 0;
        while d + 32 <= hd {
            let mut a = [_mm256_loadu_ps(out.add(d)), _mm256_loadu_ps(out.add(d + 8)), _mm256_loadu_ps(out.add(d + 16)), _mm256_loadu_ps(out.add(d + 24))];
            for j in 0..nt {
                let pj = _mm256_set1_ps(*p.add(j));
                let row = v.add(j * hd + d);
                for (i, ai) in a.iter_mut().enumerate() {
                    *ai = _mm256_fmadd_ps(pj, T::load8(row.add(8 * i)), *ai);
                }
            }
            for (i, ai) in a.iter().enumerate() {
                _mm256_storeu_ps(out.add(d + 8 * i), *ai);
            }
            d += 32;
        }
        while d < hd {
            let mut a = _mm256_loadu_ps(out.add(d));
            for j in 0..nt {
                a = _mm256_fmadd_ps(_mm256_set1_ps(*p.add(j)), T::load8(v.add(j * hd + d)), a);
            }
            _mm256_storeu_ps(out.add(d), a);
            d += 8;
        }
    }
}

/// Hint the cache to fetch `n` elements at `p` (one prefetch per 64-byte line; a no-op elsewhere).
#[inline(always)]
fn prefetch_row<T>(p: *const T, n: usize) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..n).step_by(64 / std::mem::size_of::<T>()) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::gemm_bf16::f32_to_bf16_bits;

    /// Causal GQA attention in f64 for the last `n_q` rows of a sequence whose K and V are `qkv`
    /// rows `row0..row0 + len` (K and V rounded to bf16 first when `bf16`).
    fn reference(qkv: &[f32], g: AttnGeom, row0: usize, len: usize, n_q: usize, bf16: bool) -> Vec<f64> {
        let (w, hd, group) = (g.qkv_dim(), g.head_dim, g.n_heads / g.n_kv_heads);
        let kvv = |x: f32| if bf16 { f32::from_bits((f32_to_bf16_bits(x) as u32) << 16) as f64 } else { x as f64 };
        let mut out = vec![0f64; n_q * g.q_dim()];
        for r in 0..n_q {
            let pos = len - n_q + r;
            for qh in 0..g.n_heads {
                let kvh = qh / group;
                let q = &qkv[(row0 + pos) * w + qh * hd..][..hd];
                let sc: Vec<f64> = (0..=pos)
                    .map(|t| {
                        let k = &qkv[(row0 + t) * w + g.q_dim() + kvh * hd..][..hd];
                        q.iter().zip(k).map(|(&a, &b)| a as f64 * kvv(b)).sum::<f64>() / (hd as f64).sqrt()
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

    /// Decode rows (the direct kernels: 8-key blocks, the tail keys, 32- and 8-column value
    /// passes, and the plain loops where `hd % 8 != 0`) and prefill rows (gather + GEMM) against
    /// f64, with the f32 and the bf16 cache, across pages of 16.
    #[test]
    fn decode_and_prefill_rows_match_f64() {
        for &(hd, n_heads, n_kv) in &[(64usize, 9usize, 3usize), (24, 4, 2), (20, 2, 2), (40, 8, 1)] {
            let g = AttnGeom { n_layers: 1, n_heads, n_kv_heads: n_kv, head_dim: hd, page_size: 16 };
            let w = g.qkv_dim();
            let lens = [70usize, 9, 33, 5];
            let n_q = [1usize, 3, 20, 4];
            let rows: usize = lens.iter().sum();
            let mut st = 12345u64;
            let qkv: Vec<f32> = (0..rows * w)
                .map(|_| {
                    st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((st >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                })
                .collect();
            for bf16 in [false, true] {
                let total: usize = lens.iter().map(|l| l.div_ceil(16)).sum();
                let mut kv = CpuKv::new(g, total, bf16);
                let (mut pages, mut slots, mut next, mut row0) = (Vec::new(), Vec::new(), 0u32, 0);
                let mut starts = Vec::new();
                for &len in &lens {
                    let p: Vec<u32> = (next..next + len.div_ceil(16) as u32).collect();
                    next += p.len() as u32;
                    slots.extend((0..len).map(|t| p[t / 16] * 16 + (t % 16) as u32));
                    pages.push(p);
                    starts.push(row0);
                    row0 += len;
                }
                kv.store(0, &qkv, &slots);
                let seqs: Vec<AttnSeq> = (0..lens.len()).map(|i| AttnSeq { q_row: starts[i] + lens[i] - n_q[i], n_q: n_q[i], ctx_len: lens[i], pages: &pages[i] }).collect();
                let mut out = vec![f32::NAN; rows * g.q_dim()];
                attention(&kv, 0, &qkv, &seqs, &mut out);
                for i in 0..lens.len() {
                    let want = reference(&qkv, g, starts[i], lens[i], n_q[i], bf16);
                    let got = &out[(starts[i] + lens[i] - n_q[i]) * g.q_dim()..][..n_q[i] * g.q_dim()];
                    let err = got.iter().zip(&want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0f64, f64::max);
                    assert!(err < 2e-5, "hd {hd}, heads {n_heads}/{n_kv}, bf16 {bf16}, sequence {i} (len {}, {} rows): max error {err:.2e}", lens[i], n_q[i]);
                }
            }
        }
    }
}
