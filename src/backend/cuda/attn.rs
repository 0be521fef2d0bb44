//! Host side of `kernels/attention.cu`: the per-call tables (sequences, concatenated page tables,
//! work items, split-K workspace rows) and, under `#[cfg(test)]`, a CPU emulation of the kernel's
//! tiling, masking, online softmax, split and combine on an emulated paged pool, checked against
//! the CPU twin — the index math is the part of a kernel that is easiest to get wrong and that
//! the CPU can verify without a GPU.
use crate::backend::{AttnGeom, AttnSeq};
use anyhow::{bail, Result};

/// Packed rows (query × head-of-group) per work item: 4 warps × 16 rows (`ATTN_BM`).
pub const BM: usize = 64;
/// Split lengths are multiples of this (a multiple of both key-tile sizes, 32 and 64).
pub const SPLIT_QUANTUM: usize = 64;
/// No split gets fewer keys than this.
pub const MIN_SPLIT_KEYS: usize = 128;
pub const MAX_SPLITS: usize = 64;

/// `struct AttnSeqDev` of attention.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnSeqDev {
    pub q_row: i32,
    pub n_q: i32,
    pub ctx_len: i32,
    pub page_off: i32,
    pub n_splits: i32,
    pub split_len: i32,
    /// First workspace slot of a split sequence: slot = part_base + (kvh·n_rows + row)·n_splits + split.
    pub part_base: i32,
    pub pad: i32,
}

/// `struct AttnItem` of attention.cu: one block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnItem {
    pub seq: i32,
    pub kvh: i32,
    pub tile: i32,
    pub split: i32,
}

#[derive(Debug, Default)]
pub struct AttnPlan {
    pub seqs: Vec<AttnSeqDev>,
    pub pages: Vec<u32>,
    pub items: Vec<AttnItem>,
    /// attn_combine entries: (sequence, kv_head · n_rows + packed row).
    pub combine: Vec<[i32; 2]>,
    /// Workspace slots (rows × splits) of head_dim floats.
    pub part_slots: usize,
}

/// Keys seen by the last query of tile `tile` (the tile's key range is `0 .. kend`).
pub fn tile_kend(s: &AttnSeqDev, group: usize, tile: usize) -> usize {
    let n_rows = s.n_q as usize * group;
    let r_last = (tile * BM + BM).min(n_rows) - 1;
    s.ctx_len as usize - s.n_q as usize + r_last / group + 1
}

/// Build the tables for one attention call. `n_sm` sizes the split-K decision: decode rows are
/// split until there are about 4 blocks per multiprocessor (never below MIN_SPLIT_KEYS keys).
pub fn plan(seqs: &[AttnSeq], g: &AttnGeom, max_pages: usize, rows_in_batch: usize, n_sm: usize) -> Result<AttnPlan> {
    if g.n_kv_heads == 0 || g.n_heads % g.n_kv_heads != 0 {
        bail!("attention: {} heads is not a multiple of {} kv heads", g.n_heads, g.n_kv_heads);
    }
    let group = g.n_heads / g.n_kv_heads;
    let ps = g.page_size;
    let mut p = AttnPlan::default();
    let big = i32::MAX as usize;
    let mut base_items = 0usize;
    for s in seqs {
        if s.n_q == 0 {
            continue;
        }
        if s.ctx_len < s.n_q || s.q_row + s.n_q > rows_in_batch {
            bail!("attention: sequence rows {}..{} with context {} do not fit a batch of {rows_in_batch} rows", s.q_row, s.q_row + s.n_q, s.ctx_len);
        }
        let need = s.ctx_len.div_ceil(ps);
        if s.pages.len() < need {
            bail!("attention: a sequence of {} tokens has {} pages of {ps}", s.ctx_len, s.pages.len());
        }
        if let Some(&bad) = s.pages[..need].iter().find(|&&pg| pg as usize >= max_pages) {
            bail!("attention: page {bad} is outside the KV pool of {max_pages} pages");
        }
        if s.ctx_len > big || s.n_q * group > big || p.pages.len() + need > big {
            bail!("attention: sizes beyond 32-bit indices");
        }
        p.seqs.push(AttnSeqDev {
            q_row: s.q_row as i32,
            n_q: s.n_q as i32,
            ctx_len: s.ctx_len as i32,
            page_off: p.pages.len() as i32,
            n_splits: 1,
            split_len: s.ctx_len as i32,
            part_base: 0,
            pad: 0,
        });
        p.pages.extend_from_slice(&s.pages[..need]);
        base_items += g.n_kv_heads * (s.n_q * group).div_ceil(BM);
    }
    // split-K for single-query rows (decode) with long contexts
    let want = (4 * n_sm.max(1)).div_ceil(base_items.max(1)).clamp(1, MAX_SPLITS);
    for (si, s) in p.seqs.iter_mut().enumerate() {
        let ctx = s.ctx_len as usize;
        if s.n_q != 1 || want == 1 || ctx < 2 * MIN_SPLIT_KEYS {
            continue;
        }
        let n = want.min(ctx / MIN_SPLIT_KEYS).max(1);
        let len = ctx.div_ceil(n).div_ceil(SPLIT_QUANTUM) * SPLIT_QUANTUM;
        let n = ctx.div_ceil(len);
        if n <= 1 {
            continue;
        }
        s.n_splits = n as i32;
        s.split_len = len as i32;
        let rows = g.n_kv_heads * group; // n_q = 1
        if p.part_slots + rows * n > big {
            bail!("attention: split workspace beyond 32-bit indices");
        }
        s.part_base = p.part_slots as i32;
        for y in 0..rows {
            p.combine.push([si as i32, y as i32]);
        }
        p.part_slots += rows * n;
    }
    // items, heaviest (longest key range) first so the tail of the grid is short
    let mut items: Vec<(usize, AttnItem)> = Vec::new();
    for (si, s) in p.seqs.iter().enumerate() {
        let tiles = (s.n_q as usize * group).div_ceil(BM);
        for kvh in 0..g.n_kv_heads {
            for tile in 0..tiles {
                let kend = tile_kend(s, group, tile);
                for split in 0..s.n_splits as usize {
                    let k0 = split * s.split_len as usize;
                    let work = kend.min(k0 + s.split_len as usize).saturating_sub(k0);
                    items.push((work, AttnItem { seq: si as i32, kvh: kvh as i32, tile: tile as i32, split: split as i32 }));
                }
            }
        }
    }
    items.sort_by(|a, b| b.0.cmp(&a.0));
    p.items = items.into_iter().map(|x| x.1).collect();
    Ok(p)
}

#[cfg(test)]
pub(crate) mod emulate {
    //! A line-by-line CPU port of attention_impl + attn_combine (f32 math, bf16 rounding where the
    //! kernel rounds: Q and P to bf16, K/V stored bf16, output bf16). Only the mma reduction order
    //! differs (the kernel sums 16-wide k-steps in the tensor core).
    use super::*;
    use half::bf16;

    pub fn bf(x: f32) -> f32 {
        bf16::from_f32(x).to_f32()
    }

    /// The device pool layout: [page][layer][k|v][kv_head][page_size][head_dim].
    pub fn pool_off(g: &AttnGeom, page: usize, layer: usize, which: usize, h: usize, slot: usize) -> usize {
        ((((page * g.n_layers + layer) * 2 + which) * g.n_kv_heads + h) * g.page_size + slot) * g.head_dim
    }

    /// kv_store_impl.
    pub fn kv_store(pool: &mut [f32], g: &AttnGeom, layer: usize, qkv: &[f32], slots: &[u32]) {
        let (q_dim, kv_dim, width) = (g.q_dim(), g.kv_dim(), g.qkv_dim());
        for (row, &slot) in slots.iter().enumerate() {
            let (page, s) = (slot as usize / g.page_size, slot as usize % g.page_size);
            for e in 0..2 * kv_dim {
                let which = e / kv_dim;
                let rem = e % kv_dim;
                let (h, d) = (rem / g.head_dim, rem % g.head_dim);
                pool[pool_off(g, page, layer, which, h, s) + d] = bf(qkv[row * width + q_dim + e]);
            }
        }
    }

    /// attention_impl over every item of the plan, then attn_combine.
    pub fn attention(pool: &[f32], g: &AttnGeom, layer: usize, qkv: &[f32], plan: &AttnPlan, out: &mut [f32]) {
        let hd = g.head_dim;
        let bk = if hd <= 64 { 64 } else { 32 };
        let group = g.n_heads / g.n_kv_heads;
        let (width, q_dim) = (g.qkv_dim(), g.q_dim());
        let scale_log2 = (1.0 / (hd as f32).sqrt()) * std::f32::consts::LOG2_E;
        let mut part_o = vec![f32::NAN; plan.part_slots * hd];
        let mut part_ml = vec![f32::NAN; plan.part_slots * 2];
        for it in &plan.items {
            let s = plan.seqs[it.seq as usize];
            let n_rows = s.n_q as usize * group;
            let r0 = it.tile as usize * BM;
            let first_pos = (s.ctx_len - s.n_q) as usize;
            let kend = tile_kend(&s, group, it.tile as usize);
            let k_begin = it.split as usize * s.split_len as usize;
            let k_stop = kend.min(k_begin + s.split_len as usize);
            for r in r0..(r0 + BM).min(n_rows) {
                let (qi, h) = (r / group, r % group);
                let pos = first_pos + qi;
                let q: Vec<f32> = (0..hd).map(|d| bf(qkv[(s.q_row as usize + qi) * width + (it.kvh as usize * group + h) * hd + d])).collect();
                let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                let mut o = vec![0f32; hd];
                let mut kt0 = k_begin;
                while kt0 < k_stop {
                    // one key tile: scores, mask, online softmax, P·V
                    let mut sc = vec![f32::NEG_INFINITY; bk];
                    for (j, scj) in sc.iter_mut().enumerate() {
                        let key = kt0 + j;
                        if key < k_stop && key <= pos {
                            let page = plan.pages[s.page_off as usize + key / g.page_size] as usize;
                            let ko = pool_off(g, page, layer, 0, it.kvh as usize, key % g.page_size);
                            let dot: f32 = (0..hd).map(|d| q[d] * pool[ko + d]).sum();
                            *scj = dot * scale_log2;
                        }
                    }
                    let mx = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mn = m.max(mx);
                    let mu = if mn == f32::NEG_INFINITY { 0.0 } else { mn };
                    let corr = (m - mu).exp2();
                    m = mn;
                    let p: Vec<f32> = sc.iter().map(|&v| (v - mu).exp2()).collect();
                    l = l * corr + p.iter().sum::<f32>();
                    for x in o.iter_mut() {
                        *x *= corr;
                    }
                    for (j, &pj) in p.iter().enumerate() {
                        let key = kt0 + j;
                        if key < k_stop && key <= pos {
                            let page = plan.pages[s.page_off as usize + key / g.page_size] as usize;
                            let vo = pool_off(g, page, layer, 1, it.kvh as usize, key % g.page_size);
                            for d in 0..hd {
                                o[d] += bf(pj) * pool[vo + d];
                            }
                        }
                    }
                    kt0 += bk;
                }
                if s.n_splits == 1 {
                    let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                    for d in 0..hd {
                        out[(s.q_row as usize + qi) * q_dim + (it.kvh as usize * group + h) * hd + d] = bf(o[d] * inv);
                    }
                } else {
                    let slot = s.part_base as usize + (it.kvh as usize * n_rows + r) * s.n_splits as usize + it.split as usize;
                    part_o[slot * hd..(slot + 1) * hd].copy_from_slice(&o);
                    part_ml[slot * 2] = m;
                    part_ml[slot * 2 + 1] = l;
                }
            }
        }
        for e in &plan.combine {
            let s = plan.seqs[e[0] as usize];
            let n_rows = s.n_q as usize * group;
            let y = e[1] as usize;
            let (kvh, r) = (y / n_rows, y % n_rows);
            let (qi, h) = (r / group, r % group);
            let base = s.part_base as usize + y * s.n_splits as usize;
            let ns = s.n_splits as usize;
            let mx = (0..ns).map(|i| part_ml[(base + i) * 2]).fold(f32::NEG_INFINITY, f32::max);
            let w: Vec<f32> = (0..ns)
                .map(|i| {
                    let ms = part_ml[(base + i) * 2];
                    if ms == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (ms - mx).exp2()
                    }
                })
                .collect();
            let l: f32 = (0..ns).map(|i| if w[i] > 0.0 { part_ml[(base + i) * 2 + 1] * w[i] } else { 0.0 }).sum();
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            for d in 0..hd {
                let acc: f32 = (0..ns).map(|i| if w[i] > 0.0 { part_o[(base + i) * hd + d] * w[i] } else { 0.0 }).sum();
                out[(s.q_row as usize + qi) * q_dim + (kvh * group + h) * hd + d] = bf(acc * inv);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::emulate::*;
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::Backend;
    use crate::util::rng::Rng;

    fn geom(n_heads: usize, n_kv: usize, hd: usize) -> AttnGeom {
        AttnGeom { n_layers: 2, n_heads, n_kv_heads: n_kv, head_dim: hd, page_size: 16 }
    }

    /// Every (sequence, kv head, packed row) sees each key 0..=pos in exactly one item, and the
    /// workspace slots of split rows are distinct and in range.
    #[test]
    fn items_cover_each_visible_key_once() {
        let g = geom(14, 2, 64);
        let group = 7;
        let pages: Vec<u32> = (0..400).collect();
        let shapes = [(1usize, 1usize), (1, 700), (1, 5000), (5, 9), (37, 37), (100, 1300), (1, 129), (3, 2000)];
        let mut rows = 0;
        let seqs: Vec<AttnSeq> = shapes
            .iter()
            .map(|&(n_q, ctx)| {
                let s = AttnSeq { q_row: rows, n_q, ctx_len: ctx, pages: &pages };
                rows += n_q;
                s
            })
            .collect();
        for n_sm in [1, 132] {
            let p = plan(&seqs, &g, 400, rows, n_sm).unwrap();
            let mut seen = std::collections::HashMap::new();
            let mut slots = std::collections::HashSet::new();
            for it in &p.items {
                let s = p.seqs[it.seq as usize];
                let n_rows = s.n_q as usize * group;
                let kend = tile_kend(&s, group, it.tile as usize);
                let k0 = it.split as usize * s.split_len as usize;
                let k1 = kend.min(k0 + s.split_len as usize);
                for r in it.tile as usize * BM..((it.tile as usize + 1) * BM).min(n_rows) {
                    let pos = (s.ctx_len - s.n_q) as usize + r / group;
                    for key in k0..k1.min(pos + 1) {
                        *seen.entry((it.seq, it.kvh, r, key)).or_insert(0) += 1;
                    }
                    if s.n_splits > 1 {
                        let slot = s.part_base as usize + (it.kvh as usize * n_rows + r) * s.n_splits as usize + it.split as usize;
                        assert!(slot < p.part_slots && slots.insert(slot));
                    }
                }
            }
            let mut want = 0;
            for (si, s) in p.seqs.iter().enumerate() {
                for kvh in 0..2 {
                    for r in 0..s.n_q as usize * group {
                        let pos = (s.ctx_len - s.n_q) as usize + r / group;
                        for key in 0..=pos {
                            assert_eq!(seen.get(&(si as i32, kvh, r, key)), Some(&1), "seq {si} kvh {kvh} row {r} key {key}");
                            want += 1;
                        }
                    }
                }
            }
            assert_eq!(seen.len(), want);
            assert_eq!(slots.len(), p.part_slots);
            if n_sm == 132 {
                assert!(p.seqs.iter().any(|s| s.n_splits > 1), "long decode rows are split");
                assert!(p.seqs.iter().all(|s| s.n_splits == 1 || s.n_q == 1));
            }
        }
    }

    /// The emulated kernel (paged bf16 pool, tiles, splits, combine) equals the CPU twin on
    /// bf16-rounded inputs, for mixed prefill/decode batches with shared (forked) pages.
    #[test]
    fn emulated_kernel_matches_cpu_twin() {
        for &(nh, nkv, hd) in &[(4usize, 1usize, 16usize), (14, 2, 64), (16, 2, 128), (6, 3, 32)] {
            let g = geom(nh, nkv, hd);
            let mut rng = Rng::new(nh as u64 * 31 + hd as u64);
            let be = CpuBackend::new();
            let max_pages = 64;
            let mut kv = be.kv_new(g, max_pages).unwrap();
            let mut pool = vec![0f32; max_pages * g.n_layers * 2 * g.kv_dim() * g.page_size];
            let width = g.qkv_dim();
            // sequence A: 300 tokens in pages 0..19; B shares A's first 10 pages (160 tokens)
            // and owns pages 20..; a decode row of A, a prefill chunk of B, a 1-token prompt C.
            let pa: Vec<u32> = (0..19).collect();
            let mut pb: Vec<u32> = (0..10).collect();
            pb.extend(20..30u32);
            let pc = vec![40u32];
            let layer = 1;
            let write = |kv: &mut _, pool: &mut Vec<f32>, rng: &mut Rng, pages: &[u32], from: usize, to: usize| {
                let n = to - from;
                let qkv: Vec<f32> = (0..n * width).map(|_| bf(rng.normal() as f32)).collect();
                let slots: Vec<u32> = (from..to).map(|p| pages[p / 16] * 16 + (p % 16) as u32).collect();
                be.kv_store(kv, layer, &qkv, &slots, g).unwrap();
                kv_store(pool, &g, layer, &qkv, &slots);
            };
            write(&mut kv, &mut pool, &mut rng, &pa, 0, 300);
            write(&mut kv, &mut pool, &mut rng, &pb, 160, 250);
            write(&mut kv, &mut pool, &mut rng, &pc, 0, 1);
            let seqs = vec![
                AttnSeq { q_row: 0, n_q: 1, ctx_len: 300, pages: &pa },
                AttnSeq { q_row: 1, n_q: 70, ctx_len: 250, pages: &pb },
                AttnSeq { q_row: 71, n_q: 1, ctx_len: 1, pages: &pc },
            ];
            let rows = 72;
            let qkv: Vec<f32> = (0..rows * width).map(|_| bf(rng.normal() as f32 * 2.0)).collect();
            let mut want = vec![0f32; rows * g.q_dim()];
            be.attention(&kv, layer, &qkv, &seqs, g, &mut want).unwrap();
            for n_sm in [1, 132] {
                let p = plan(&seqs, &g, max_pages, rows, n_sm).unwrap();
                let mut got = vec![f32::NAN; rows * g.q_dim()];
                attention(&pool, &g, layer, &qkv, &p, &mut got);
                for r in 0..rows {
                    let w = &want[r * g.q_dim()..(r + 1) * g.q_dim()];
                    let o = &got[r * g.q_dim()..(r + 1) * g.q_dim()];
                    let scale = w.iter().fold(0f32, |a, &b| a.max(b.abs())).max(1e-3);
                    for (a, b) in o.iter().zip(w) {
                        // bf16 output rounding (2^-8 relative) plus P rounded to bf16
                        assert!((a - b).abs() <= 1e-2 * scale, "hd {hd} n_sm {n_sm} row {r}: {a} vs {b}");
                    }
                }
            }
        }
    }
}
