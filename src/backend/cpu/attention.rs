//! Causal GQA attention over a paged KV cache, on the CPU.
//!
//! Storage: one allocation per page, laid out `[layer][k|v][kv_head][page_size][head_dim]`, so a
//! head's keys within a page are contiguous and gathering a sequence's keys is one `memcpy` per
//! page. Pages are allocated on first write and recycled on release.
//!
//! Compute: one task per (sequence, kv head): gather K and V of the visible context once, then
//! for each query head of the group and each block of query rows, `S = Q Kᵀ` (GEMM), causal mask,
//! softmax in f32, `O = P V` (GEMM). Only a `[block, ctx]` score tile exists at a time, never
//! `[T, T]`. Single query rows (decode) use plain dot products instead of GEMM calls.
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
        let n = s.ctx_len;
        let mut kbuf = vec![0f32; n * hd];
        let mut vbuf = vec![0f32; n * hd];
        kv.gather(layer, 0, kvh, s.pages, n, &mut kbuf);
        kv.gather(layer, 1, kvh, s.pages, n, &mut vbuf);
        let first_pos = n - s.n_q; // position of the first query row
        let mut scores = vec![0f32; BQ.min(s.n_q) * n];
        for qh in kvh * group..(kvh + 1) * group {
            let mut r0 = 0;
            while r0 < s.n_q {
                let bq = BQ.min(s.n_q - r0);
                let kmax = first_pos + r0 + bq; // keys visible to the block's last row
                let qptr = unsafe { qkv.as_ptr().add((s.q_row + r0) * width + qh * hd) };
                let optr = unsafe { outp.get().add((s.q_row + r0) * q_dim + qh * hd) };
                if bq == 1 {
                    // decode: one query row, dot products then a weighted sum
                    let q = unsafe { std::slice::from_raw_parts(qptr, hd) };
                    let sc = &mut scores[..kmax];
                    for (j, sj) in sc.iter_mut().enumerate() {
                        let k = &kbuf[j * hd..(j + 1) * hd];
                        *sj = dot(q, k) * scale;
                    }
                    softmax_inplace(sc);
                    let o = unsafe { std::slice::from_raw_parts_mut(optr, hd) };
                    o.fill(0.0);
                    for (j, &p) in sc.iter().enumerate() {
                        let v = &vbuf[j * hd..(j + 1) * hd];
                        for (oo, vv) in o.iter_mut().zip(v) {
                            *oo += p * vv;
                        }
                    }
                } else {
                    unsafe {
                        // S[bq, kmax] = Q[bq, hd] · K[kmax, hd]ᵀ
                        gemm_raw(bq, kmax, hd, scores.as_mut_ptr(), kmax as isize, 1, false, qptr, width as isize, 1, kbuf.as_ptr(), 1, hd as isize, scale, false);
                    }
                    for r in 0..bq {
                        let visible = first_pos + r0 + r + 1;
                        let row = &mut scores[r * kmax..(r + 1) * kmax];
                        softmax_inplace(&mut row[..visible]);
                        row[visible..].fill(0.0);
                    }
                    unsafe {
                        // O[bq, hd] = P[bq, kmax] · V[kmax, hd]
                        gemm_raw(bq, hd, kmax, optr, q_dim as isize, 1, false, scores.as_ptr(), kmax as isize, 1, vbuf.as_ptr(), hd as isize, 1, 1.0, false);
                    }
                }
                r0 += bq;
            }
        }
    });
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // 8 partial sums so the compiler vectorizes without reassociation flags
    let mut acc = [0f32; 8];
    let n8 = a.len() & !7;
    for i in (0..n8).step_by(8) {
        for l in 0..8 {
            acc[l] += a[i + l] * b[i + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[inline]
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}
