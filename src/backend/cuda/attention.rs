//! Paged causal GQA attention on the device and its KV cache: `kv_new`, `kv_copy_page`,
//! `kv_store` (slot-addressed store of the k/v rows) and `attention` (prefill chunks, scoring rows
//! and decode rows in one launch of kernels/attention.cu, split-K for long decode rows merged by
//! `attn_combine`). The host builds the per-call tables here (`plan`: sequences, concatenated page
//! tables, work items heaviest first, split-K workspace rows). CPU twin:
//! src/backend/cpu/attention.rs. Parity test (on a GPU or the emulated device):
//! tests/cuda_parity/attention.rs.
use super::alloc::DevMem;
use super::{CudaBackend, CudaBuf, Dtype};
use crate::backend::{AttnGeom, AttnSeq};
use anyhow::{anyhow, bail, ensure, Result};

/// Head dims the attention kernels are instantiated for.
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];
/// Threads per block of `attention_impl` (`ATTN_THREADS`).
const ATTN_THREADS: u32 = 128;

/// The kernels of kernels/attention.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = (
    "attention",
    &[
        "kv_store_f32",
        "kv_store_bf16",
        "attention_hd16_f32",
        "attention_hd32_f32",
        "attention_hd64_f32",
        "attention_hd128_f32",
        "attention_hd16_bf16",
        "attention_hd32_bf16",
        "attention_hd64_bf16",
        "attention_hd128_bf16",
        "attn_combine",
    ],
);

/// The paged KV cache on the device: one bf16 pool `[page][layer][k|v][kv_head][page_size][head_dim]`,
/// allocated whole by `kv_new`; copy-on-write of a page is one contiguous device copy.
pub struct CudaKv {
    pub(super) pool: DevMem,
    pub(super) geom: AttnGeom,
    pub(super) max_pages: usize,
    /// bf16 elements per page (all layers, k and v, all kv heads).
    pub(super) page_elems: usize,
}

impl CudaKv {
    pub(super) fn ptr(&self) -> u64 {
        self.pool.ptr()
    }
}

pub(super) fn kv_new(be: &CudaBackend, geom: AttnGeom, max_pages: usize) -> Result<CudaKv> {
    let _op = be.enter()?;
    ensure!(
        HEAD_DIMS.contains(&geom.head_dim),
        "the CUDA attention kernel supports head_dim {:?}, this model has {}",
        HEAD_DIMS,
        geom.head_dim
    );
    ensure!(geom.page_size > 0 && max_pages > 0, "kv_new: empty pool");
    let page_elems = geom.n_layers * 2 * geom.n_kv_heads * geom.page_size * geom.head_dim;
    let bytes = max_pages * page_elems * 2;
    // say what fits before asking the driver for what cannot
    if let Ok(m) = be.mem_info() {
        if bytes > m.usable() {
            let tokens_fit = m.usable() / (page_elems * 2) * geom.page_size;
            bail!(
                "cuda: the KV cache for {} tokens ({max_pages} pages, {:.2} GiB) does not fit: {:.2} GiB usable on {}; at most {tokens_fit} tokens fit \
                 (fewer queries or rollouts per batch, or shorter chunks/memories)",
                max_pages * geom.page_size,
                bytes as f64 / (1u64 << 30) as f64,
                m.usable() as f64 / (1u64 << 30) as f64,
                be.device
            );
        }
    }
    let pool = be.alloc_zeroed(bytes).map_err(|e| {
        anyhow!("cuda: the KV cache ({max_pages} pages, {:.2} GiB) does not fit on the device: {e:#}", bytes as f64 / (1u64 << 30) as f64)
    })?;
    Ok(CudaKv { pool, geom, max_pages, page_elems })
}

/// The call's geometry must be the cache's: the kernels index the pool with the call's page
/// size, layer count and kv-head count, and a different one addresses other rows of the pool.
fn same_geometry(op: &str, kv: &CudaKv, g: &AttnGeom) -> Result<()> {
    let k = &kv.geom;
    ensure!(
        (g.n_layers, g.n_kv_heads, g.head_dim, g.page_size) == (k.n_layers, k.n_kv_heads, k.head_dim, k.page_size),
        "{op}: the call's geometry (layers {}, kv heads {}, head_dim {}, page size {}) is not the KV cache's (layers {}, kv heads {}, head_dim {}, page size {})",
        g.n_layers,
        g.n_kv_heads,
        g.head_dim,
        g.page_size,
        k.n_layers,
        k.n_kv_heads,
        k.head_dim,
        k.page_size
    );
    Ok(())
}

pub(super) fn kv_copy_page(be: &CudaBackend, kv: &mut CudaKv, src: u32, dst: u32, _n_tokens: usize) -> Result<()> {
    let _op = be.enter()?;
    ensure!((src as usize) < kv.max_pages && (dst as usize) < kv.max_pages, "kv_copy_page: page beyond the pool of {}", kv.max_pages);
    // The whole page (all layers): slots past n_tokens are rewritten before they are read.
    let bytes = kv.page_elems * 2;
    let base = kv.ptr();
    be.dev.dtod(base + (dst as usize * bytes) as u64, base + (src as usize * bytes) as u64, bytes)
}

pub(super) fn kv_store(be: &CudaBackend, kv: &mut CudaKv, layer: usize, qkv: &CudaBuf, slots: &[u32], g: AttnGeom) -> Result<()> {
    let _op = be.enter()?;
    if slots.is_empty() {
        return Ok(());
    }
    same_geometry("kv_store", kv, &g)?;
    ensure!(layer < kv.geom.n_layers, "kv_store: layer {layer} of {}", kv.geom.n_layers);
    if let Some(&bad) = slots.iter().find(|&&s| s as usize / g.page_size >= kv.max_pages) {
        bail!("kv_store: slot {bad} beyond the pool of {} pages", kv.max_pages);
    }
    // one block per slot writes it: a slot given twice is two blocks racing on the same rows
    let mut sorted = slots.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        bail!("kv_store: slot {} appears twice in one call (two blocks would write the same cache rows)", w[0]);
    }
    qkv.need(slots.len() * g.qkv_dim(), "kv_store", "qkv")?;
    let sp = be.meta("slots", bytemuck::cast_slice(slots))?;
    let (pool, q) = (kv.ptr(), qkv.ptr());
    let (layer, n_layers, n_kv, hd, ps, q_dim, width) =
        (layer as i32, g.n_layers as i32, g.n_kv_heads as i32, g.head_dim as i32, g.page_size as i32, g.q_dim() as i32, g.qkv_dim() as i32);
    launch!(be, &format!("kv_store_{}", qkv.dtype.name()), slots.len(), 128, pool, q, sp, layer, n_layers, n_kv, hd, ps, q_dim, width)
}

pub(super) fn attention(be: &CudaBackend, kv: &CudaKv, layer: usize, qkv: &CudaBuf, seqs: &[AttnSeq], g: AttnGeom, out: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    let rows = seqs.iter().map(|s| s.q_row + s.n_q).max().unwrap_or(0);
    if rows == 0 {
        return Ok(());
    }
    ensure!(HEAD_DIMS.contains(&g.head_dim), "cuda attention: head_dim {} not in {:?}", g.head_dim, HEAD_DIMS);
    same_geometry("attention", kv, &g)?;
    ensure!(layer < kv.geom.n_layers, "attention: layer {layer} of {}", kv.geom.n_layers);
    qkv.need(rows * g.qkv_dim(), "attention", "qkv")?;
    let p = plan(seqs, &g, kv.max_pages, rows, be.n_sm)?;
    out.set_output(rows * g.q_dim(), Dtype::Bf16, "attention")?;
    if p.items.is_empty() {
        return Ok(());
    }
    let sp = be.meta("attn_seqs", bytemuck::cast_slice(&p.seqs))?;
    let pg = be.meta("attn_pages", bytemuck::cast_slice(&p.pages))?;
    let ip = be.meta("attn_items", bytemuck::cast_slice(&p.items))?;
    let po = be.scratch("attn_part_o", p.part_slots * g.head_dim * 4)?;
    let pm = be.scratch("attn_part_ml", p.part_slots * 2 * 4)?;
    let (pool, q, o) = (kv.ptr(), qkv.ptr(), out.ptr());
    let (layer, n_layers, n_kv, ps, width, q_dim, group) =
        (layer as i32, g.n_layers as i32, g.n_kv_heads as i32, g.page_size as i32, g.qkv_dim() as i32, g.q_dim() as i32, (g.n_heads / g.n_kv_heads) as i32);
    let scale_log2 = (1.0 / (g.head_dim as f32).sqrt()) * std::f32::consts::LOG2_E;
    let name = format!("attention_hd{}_{}", g.head_dim, qkv.dtype.name());
    launch!(be, &name, p.items.len(), ATTN_THREADS, pool, layer, n_layers, n_kv, ps, q, width, q_dim, group, o, sp, pg, ip, po, pm, scale_log2)?;
    if !p.combine.is_empty() {
        let cp = be.meta("attn_combine", bytemuck::cast_slice(&p.combine))?;
        let hd = g.head_dim as i32;
        launch!(be, "attn_combine", p.combine.len(), 64, po, pm, cp, sp, hd, group, q_dim, o)?;
    }
    Ok(())
}


// ---------------------------------------------------------------------------------------------
// The per-call tables of attention_impl

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
    items.sort_by_key(|x| std::cmp::Reverse(x.0));
    p.items = items.into_iter().map(|x| x.1).collect();
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

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
                let s = AttnSeq { q_row: rows, n_q, ctx_len: ctx, pages: &pages, sampled: false };
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
}
