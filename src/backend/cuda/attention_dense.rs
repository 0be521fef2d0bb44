//! Dense causal GQA attention for training on the device: `attn_dense` (forward keeping the
//! per-row log-sum-exp) and `attn_dense_bwd` (`attn_bwd_prep`, then one dQ kernel and one dK/dV
//! kernel, each the sole writer of its output), all in kernels/attention_dense.cu; the per-call
//! tables (`plan`) and the dK/dV kernel's dynamic shared-memory layout. CPU twin:
//! src/backend/cpu/attention_dense.rs. Parity test (on a GPU or the emulated device):
//! tests/cuda_parity/attention_dense.rs.
use super::{grid_for, CudaBackend, CudaBuf, Dtype, HEAD_DIMS};
use crate::backend::{AttnGeom, DenseSeq};
use anyhow::{bail, ensure, Result};

/// The kernels of kernels/attention_dense.cu this family launches (loaded by name when the backend opens).
pub(super) const KERNELS: (&str, &[&str]) = (
    "attention_dense",
    &[
        "attn_dense_fwd_hd16",
        "attn_dense_fwd_hd32",
        "attn_dense_fwd_hd64",
        "attn_dense_fwd_hd128",
        "attn_bwd_prep_bf16_f32",
        "attn_bwd_prep_bf16_bf16",
        "attn_bwd_prep_f32_f32",
        "attn_bwd_prep_f32_bf16",
        "attn_dense_dq_hd16",
        "attn_dense_dq_hd32",
        "attn_dense_dq_hd64",
        "attn_dense_dq_hd128",
        "attn_dense_dkdv_hd16",
        "attn_dense_dkdv_hd32",
        "attn_dense_dkdv_hd64",
        "attn_dense_dkdv_hd128",
    ],
);

pub(super) fn attn_dense(be: &CudaBackend, qkv: &CudaBuf, seqs: &[DenseSeq], g: AttnGeom, out: &mut CudaBuf, lse: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    let p = be.dense_plan(qkv, seqs, &g)?;
    if p.rows == 0 {
        return Ok(());
    }
    let (width, q_dim, kv_dim, nh) = (g.qkv_dim(), g.q_dim(), g.kv_dim(), g.n_heads);
    out.set_output(p.rows * q_dim, Dtype::Bf16, "attn_dense")?;
    lse.set_output(p.rows * nh, Dtype::F32, "attn_dense")?;
    let q16 = be.qkv_bf16(qkv, p.rows * width)?;
    let sp = be.meta("dense_seqs", bytemuck::cast_slice(&p.seqs))?;
    let ip = be.meta("dense_q_items", bytemuck::cast_slice(&p.q_items))?;
    let (op, lp) = (out.ptr(), lse.ptr());
    let (w32, q32, kv32, grp, nh32) = (width as i32, q_dim as i32, kv_dim as i32, (g.n_heads / g.n_kv_heads) as i32, nh as i32);
    let scale_log2 = (1.0 / (g.head_dim as f32).sqrt()) * std::f32::consts::LOG2_E;
    let name = format!("attn_dense_fwd_hd{}", g.head_dim);
    launch!(be, &name, p.q_items.len(), THREADS, q16, w32, q32, kv32, grp, nh32, sp, ip, op, lp, scale_log2)
}

pub(super) fn attn_dense_bwd(be: &CudaBackend, qkv: &CudaBuf, out: &CudaBuf, dout: &CudaBuf, lse: &CudaBuf, seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    let p = be.dense_plan(qkv, seqs, &g)?;
    if p.rows == 0 {
        return Ok(());
    }
    let (width, q_dim, kv_dim, nh, hd) = (g.qkv_dim(), g.q_dim(), g.kv_dim(), g.n_heads, g.head_dim);
    out.need(p.rows * q_dim, "attn_dense_bwd", "out")?;
    dout.need(p.rows * q_dim, "attn_dense_bwd", "dout")?;
    ensure!(lse.dtype == Dtype::F32, "cuda attn_dense_bwd: lse must be the f32 buffer attn_dense wrote");
    lse.need(p.rows * nh, "attn_dense_bwd", "lse")?;
    dqkv.set_output(p.rows * width, Dtype::F32, "attn_dense_bwd")?;
    let q16 = be.qkv_bf16(qkv, p.rows * width)?;
    // D = rowsum(dO ∘ O) and the bf16 dO
    let do16 = be.scratch("attn_dout16", p.rows * q_dim * 2)?;
    let dsum = be.scratch("attn_dsum", p.rows * nh * 4)?;
    let (outp, doutp, rows32, nh32, hd32) = (out.ptr(), dout.ptr(), p.rows as i32, nh as i32, hd as i32);
    let prep = format!("attn_bwd_prep_{}_{}", out.dtype.name(), dout.dtype.name());
    launch!(be, &prep, (p.rows * nh).div_ceil(8), 256, outp, doutp, rows32, nh32, hd32, do16, dsum)?;
    let sp = be.meta("dense_seqs", bytemuck::cast_slice(&p.seqs))?;
    let qip = be.meta("dense_q_items", bytemuck::cast_slice(&p.q_items))?;
    let kip = be.meta("dense_k_items", bytemuck::cast_slice(&p.k_items))?;
    let (lp, dp) = (lse.ptr(), dqkv.ptr());
    let (w32, q32, kv32, grp) = (width as i32, q_dim as i32, kv_dim as i32, (g.n_heads / g.n_kv_heads) as i32);
    let scale = 1.0 / (hd as f32).sqrt();
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    launch!(be, &format!("attn_dense_dq_hd{hd}"), p.q_items.len(), THREADS, q16, w32, q32, kv32, grp, nh32, sp, qip, do16, lp, dsum, dp, scale_log2, scale)?;
    let smem = dkdv_smem_bytes(hd);
    launch_dyn!(be, &format!("attn_dense_dkdv_hd{hd}"), p.k_items.len(), THREADS, smem, q16, w32, q32, kv32, grp, nh32, sp, kip, do16, lp, dsum, dp, scale_log2, scale)
}


impl CudaBackend {
    /// A bf16 copy of the fused `qkv` rows for the attention kernels: the buffer itself when it
    /// is bf16, else the f32 values rounded into a scratch buffer (valid for this op).
    pub(super) fn qkv_bf16(&self, qkv: &CudaBuf, n: usize) -> Result<u64> {
        if qkv.dtype == Dtype::Bf16 {
            return Ok(qkv.ptr());
        }
        let dst = self.scratch("attn_qkv16", n * 2)?;
        let (src, n64) = (qkv.ptr(), n as i64);
        launch!(self, "f32_to_bf16", grid_for(n, 256), 256, src, dst, n64)?;
        Ok(dst)
    }

    /// Run the dense-attention plan checks shared by the forward and the backward.
    pub(super) fn dense_plan(&self, qkv: &CudaBuf, seqs: &[DenseSeq], g: &AttnGeom) -> Result<DensePlan> {
        ensure!(HEAD_DIMS.contains(&g.head_dim), "cuda dense attention: head_dim {} not in {:?}", g.head_dim, HEAD_DIMS);
        let width = g.qkv_dim();
        let p = plan(seqs, g, qkv.len / width.max(1))?;
        qkv.need(p.rows * width, "dense attention", "qkv")?;
        Ok(p)
    }
}

// ---------------------------------------------------------------------------------------------
// The per-call tables of the dense kernels

/// Packed query rows per forward / dQ work item (`DENSE_BM`): 4 warps × 16 rows.
pub const BM: usize = 64;
/// Keys per dK/dV work item (`DENSE_BN`): 4 warps × 16 keys.
pub const BN: usize = 64;
/// Threads per block of the dense kernels (`DENSE_THREADS`).
pub const THREADS: u32 = 128;

/// Keys per tile of the forward and dQ kernels (`BK`): registers decide.
pub fn bk(hd: usize) -> usize {
    if hd <= 64 {
        64
    } else {
        32
    }
}

/// Packed query rows per tile of the dK/dV kernel (`DkdvSmem::BQ`).
pub fn bq(hd: usize) -> usize {
    if hd <= 64 {
        64
    } else {
        32
    }
}

/// Byte offsets of the dK/dV kernel's dynamic shared memory (`DkdvSmem` in attention_dense.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DkdvSmem {
    pub sk: usize,
    pub sv: usize,
    pub sq: usize,
    pub sdo: usize,
    pub slse: usize,
    pub sd: usize,
    pub sqi: usize,
    pub bytes: usize,
}

pub fn dkdv_smem_layout(hd: usize) -> DkdvSmem {
    let (q, hdp) = (bq(hd), hd + 8);
    let sk = 0;
    let sv = sk + BN * hdp * 2;
    let sq = sv + BN * hdp * 2;
    let sdo = sq + 2 * q * hdp * 2;
    let slse = sdo + 2 * q * hdp * 2;
    let sd = slse + 2 * q * 4;
    let sqi = sd + 2 * q * 4;
    DkdvSmem { sk, sv, sq, sdo, slse, sd, sqi, bytes: sqi + 2 * q * 4 }
}

/// Dynamic shared memory of `attn_dense_dkdv_hd{hd}`; the kernel traps when given less.
pub fn dkdv_smem_bytes(hd: usize) -> usize {
    dkdv_smem_layout(hd).bytes
}

/// `struct DenseSeqDev` of mma.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct DenseSeqDev {
    pub row0: i32,
    pub len: i32,
}

/// `struct DenseItem` of mma.cuh: one block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct DenseItem {
    pub seq: i32,
    pub kvh: i32,
    /// A tile of BM packed query rows (forward, dQ) or of BN keys (dK/dV).
    pub tile: i32,
    pub pad: i32,
}

#[derive(Debug, Default)]
pub struct DensePlan {
    pub seqs: Vec<DenseSeqDev>,
    /// Forward and dQ items: (sequence, kv head, tile of BM packed rows), heaviest first.
    pub q_items: Vec<DenseItem>,
    /// dK/dV items: (sequence, kv head, tile of BN keys), heaviest first.
    pub k_items: Vec<DenseItem>,
    /// Rows the sequences cover: max(row0 + len).
    pub rows: usize,
}

/// Keys the last query of forward/dQ tile `tile` sees (the tile's key range is `0 .. kend`).
pub fn tile_kend(s: &DenseSeqDev, group: usize, tile: usize) -> usize {
    let n_rows = s.len as usize * group;
    ((tile * BM + BM).min(n_rows) - 1) / group + 1
}

/// The tables of one dense attention call over a batch of `rows_in_batch` rows.
pub fn plan(seqs: &[DenseSeq], g: &AttnGeom, rows_in_batch: usize) -> Result<DensePlan> {
    if g.n_kv_heads == 0 || g.n_heads % g.n_kv_heads != 0 {
        bail!("attention: {} heads is not a multiple of {} kv heads", g.n_heads, g.n_kv_heads);
    }
    let group = g.n_heads / g.n_kv_heads;
    let mut p = DensePlan::default();
    let big = i32::MAX as usize;
    let mut q_items: Vec<(usize, DenseItem)> = Vec::new();
    let mut k_items: Vec<(usize, DenseItem)> = Vec::new();
    for s in seqs {
        if s.len == 0 {
            continue;
        }
        if s.row0 + s.len > rows_in_batch {
            bail!("dense attention: sequence rows {}..{} beyond the batch's {rows_in_batch} rows", s.row0, s.row0 + s.len);
        }
        // row offsets are 64-bit in the kernels; packed row indices and keys are int
        if s.row0 + s.len > big || s.len * group > big {
            bail!("dense attention: a sequence of {} rows at row {} is beyond 32-bit indices", s.len, s.row0);
        }
        let si = p.seqs.len() as i32;
        let d = DenseSeqDev { row0: s.row0 as i32, len: s.len as i32 };
        p.seqs.push(d);
        p.rows = p.rows.max(s.row0 + s.len);
        let n_rows = s.len * group;
        for kvh in 0..g.n_kv_heads {
            for tile in 0..n_rows.div_ceil(BM) {
                // cost ∝ keys scanned × rows
                let work = tile_kend(&d, group, tile) * BM.min(n_rows - tile * BM);
                q_items.push((work, DenseItem { seq: si, kvh: kvh as i32, tile: tile as i32, pad: 0 }));
            }
            for tile in 0..s.len.div_ceil(BN) {
                // packed rows that see the tile's keys × keys
                let work = (n_rows - tile * BN * group) * BN.min(s.len - tile * BN);
                k_items.push((work, DenseItem { seq: si, kvh: kvh as i32, tile: tile as i32, pad: 0 }));
            }
        }
    }
    if q_items.len() > big || k_items.len() > big {
        bail!("dense attention: too many work items");
    }
    q_items.sort_by_key(|x| std::cmp::Reverse(x.0));
    k_items.sort_by_key(|x| std::cmp::Reverse(x.0));
    p.q_items = q_items.into_iter().map(|x| x.1).collect();
    p.k_items = k_items.into_iter().map(|x| x.1).collect();
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(n_heads: usize, n_kv: usize, hd: usize) -> AttnGeom {
        AttnGeom { n_layers: 1, n_heads, n_kv_heads: n_kv, head_dim: hd, page_size: 16 }
    }

    fn batch(lens: &[usize]) -> (Vec<DenseSeq>, usize) {
        let mut row = 0;
        let seqs = lens
            .iter()
            .map(|&len| {
                let s = DenseSeq { row0: row, len };
                row += len;
                s
            })
            .collect();
        (seqs, row)
    }

    /// Every (sequence, kv head, packed row) is in exactly one forward/dQ item, every (sequence,
    /// kv head, key) in exactly one dK/dV item, and the packed rows a dK/dV item walks
    /// (k0·G .. len·G) are exactly the rows that see any of its keys.
    #[test]
    fn items_cover_rows_and_keys_once() {
        let g = geom(14, 2, 64);
        let group = 7;
        let (seqs, rows) = batch(&[1, 9, 64, 65, 130, 700, 0, 3]);
        let p = plan(&seqs, &g, rows).unwrap();
        assert_eq!(p.rows, rows);
        assert_eq!(p.seqs.len(), 7, "empty sequences are dropped");
        let mut seen_rows = std::collections::HashMap::new();
        for it in &p.q_items {
            let s = p.seqs[it.seq as usize];
            let n_rows = s.len as usize * group;
            let r0 = it.tile as usize * BM;
            assert!(r0 < n_rows);
            let kend = tile_kend(&s, group, it.tile as usize);
            for r in r0..(r0 + BM).min(n_rows) {
                assert!(r / group < kend, "a row's own key is inside the tile's key range");
                *seen_rows.entry((it.seq, it.kvh, r)).or_insert(0) += 1;
            }
        }
        let mut seen_keys = std::collections::HashMap::new();
        for it in &p.k_items {
            let s = p.seqs[it.seq as usize];
            let k0 = it.tile as usize * BN;
            assert!(k0 < s.len as usize);
            for key in k0..(k0 + BN).min(s.len as usize) {
                *seen_keys.entry((it.seq, it.kvh, key)).or_insert(0) += 1;
                // rows r with r / G >= key are exactly r >= key·G >= k0·G
                assert!(key * group >= k0 * group);
            }
        }
        for (si, s) in p.seqs.iter().enumerate() {
            for kvh in 0..2 {
                for r in 0..s.len as usize * group {
                    assert_eq!(seen_rows.get(&(si as i32, kvh, r)), Some(&1), "seq {si} kvh {kvh} row {r}");
                }
                for key in 0..s.len as usize {
                    assert_eq!(seen_keys.get(&(si as i32, kvh, key)), Some(&1), "seq {si} kvh {kvh} key {key}");
                }
            }
        }
        assert_eq!(seen_rows.len(), p.seqs.iter().map(|s| s.len as usize * group * 2).sum::<usize>());
        assert_eq!(seen_keys.len(), p.seqs.iter().map(|s| s.len as usize * 2).sum::<usize>());
        assert!(plan(&seqs, &g, rows - 1).is_err(), "rows beyond the batch are refused");
        assert!(plan(&seqs, &geom(14, 3, 64), rows).is_err(), "heads not a multiple of kv heads");
    }

    /// The dK/dV kernel's dynamic shared memory: regions disjoint, 16-byte aligned where cp.async
    /// writes, within what an H100/H200 block may have, and the sizes the kernel comment states.
    #[test]
    fn dkdv_shared_memory_layout() {
        for (hd, want) in [(16usize, 19968usize), (32, 32256), (64, 56832), (128, 70400)] {
            let l = dkdv_smem_layout(hd);
            let regions = [l.sk, l.sv, l.sq, l.sdo, l.slse, l.sd, l.sqi, l.bytes];
            assert!(regions.windows(2).all(|w| w[0] < w[1]), "hd {hd}: {l:?}");
            assert!([l.sk, l.sv, l.sq, l.sdo].iter().all(|o| o % 16 == 0), "cp.async destinations 16-byte aligned");
            let hdp = hd + 8;
            assert_eq!(l.sv - l.sk, BN * hdp * 2);
            assert_eq!(l.sdo - l.sq, 2 * bq(hd) * hdp * 2);
            assert_eq!(l.bytes, want, "hd {hd}");
            assert!(l.bytes <= 227 * 1024);
        }
    }
}
