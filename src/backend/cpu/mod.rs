//! The CPU backend: f32 on host memory, rayon across cores, our AVX-512 GEMM (or the `gemm`
//! crate) for large products and hand-written kernels for the rest. One file per op family
//! (forward and backward together, the table in `backend/mod.rs`); this file only routes the
//! trait methods to them.
pub mod attention;
pub mod attention_dense;
#[cfg(target_arch = "x86_64")]
pub mod gemm512;
pub mod logprob;
pub mod matmul;
pub mod memory;
pub mod norm;
pub mod optim;
pub mod rope;
pub mod sample;
pub mod simd;
pub mod swiglu;

use super::{AdamWStep, AttnGeom, AttnSeq, Backend, DenseSeq, HeadOut, SampleParams, Sampled, TrainBackend};
use anyhow::{ensure, Result};
use attention::CpuKv;

/// Rows per rayon task for cheap row-wise ops (keeps task overhead well below the work; the
/// split does not change any result: rows are independent).
pub(crate) const ROWS_PER_TASK: usize = 64;

#[derive(Clone, Debug)]
pub struct CpuBackend {
    threads: usize,
}

impl CpuBackend {
    /// Uses rayon's global pool (sized by `init_threads` or `RAYON_NUM_THREADS`).
    pub fn new() -> Self {
        CpuBackend { threads: rayon::current_num_threads() }
    }
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// Large weight matrices are streamed from DRAM on every decode step; backing them with 2 MiB
/// pages (transparent huge pages, on request) removes most TLB misses and lets the hardware
/// prefetcher run across 4 KiB boundaries (~25% faster streaming measured on the small-M
/// kernel). The buffer is advised before it is first written, so the pages are huge from the
/// start. Small buffers and non-Linux targets are returned unchanged.
fn huge_page_copy(data: Vec<f32>) -> Vec<f32> {
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if data.len() * 4 >= 2 * HUGE {
        let mut v: Vec<f32> = Vec::with_capacity(data.len());
        let start = v.as_mut_ptr() as usize;
        let a = (start + HUGE - 1) & !(HUGE - 1);
        let e = (start + data.len() * 4) & !(HUGE - 1);
        if e > a {
            // Safety: [a, e) lies inside v's allocation; madvise only changes paging policy.
            unsafe {
                libc::madvise(a as *mut libc::c_void, e - a, libc::MADV_HUGEPAGE);
            }
        }
        v.extend_from_slice(&data);
        return v;
    }
    data
}

/// Size rayon's global pool once (0 = all cores). Later calls are no-ops.
pub fn init_threads(n: usize) {
    let mut b = rayon::ThreadPoolBuilder::new();
    if n > 0 {
        b = b.num_threads(n);
    }
    let _ = b.build_global();
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Kv = CpuKv;

    fn name(&self) -> String {
        format!("cpu ({} threads, f32)", self.threads)
    }

    fn upload(&self, data: &[f32]) -> Result<Vec<f32>> {
        Ok(data.to_vec())
    }
    fn upload_vec(&self, data: Vec<f32>) -> Result<Vec<f32>> {
        Ok(huge_page_copy(data))
    }
    fn zeros(&self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }
    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }
    fn write(&self, buf: &mut Vec<f32>, data: &[f32]) -> Result<()> {
        ensure!(buf.len() == data.len(), "write: length {} into buffer of {}", data.len(), buf.len());
        buf.copy_from_slice(data);
        Ok(())
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn kv_new(&self, geom: AttnGeom, max_pages: usize) -> Result<CpuKv> {
        Ok(CpuKv::new(geom, max_pages))
    }
    fn kv_copy_page(&self, kv: &mut CpuKv, src: u32, dst: u32, n_tokens: usize) -> Result<()> {
        kv.copy_page(src, dst, n_tokens);
        Ok(())
    }
    fn kv_release_page(&self, kv: &mut CpuKv, page: u32) {
        kv.release(page);
    }

    fn gather_rows(&self, x: &Vec<f32>, rows: &[u32], d: usize, out: &mut Vec<f32>) -> Result<()> {
        memory::gather_rows(x, rows, d, out);
        Ok(())
    }
    fn embed(&self, table: &Vec<f32>, ids: &[u32], d: usize, out: &mut Vec<f32>) -> Result<()> {
        memory::embed(table, ids, d, out);
        Ok(())
    }
    fn rmsnorm(&self, x: &Vec<f32>, w: &Vec<f32>, eps: f32, rows: usize, d: usize, out: &mut Vec<f32>) -> Result<()> {
        norm::rmsnorm(x, w, eps, rows, d, out);
        Ok(())
    }
    fn add_rmsnorm(&self, resid: &mut Vec<f32>, delta: &Vec<f32>, w: &Vec<f32>, eps: f32, rows: usize, d: usize, out: &mut Vec<f32>) -> Result<()> {
        norm::add_rmsnorm(resid, delta, w, eps, rows, d, out);
        Ok(())
    }
    fn add(&self, resid: &mut Vec<f32>, delta: &Vec<f32>, n: usize) -> Result<()> {
        norm::add(&mut resid[..n], &delta[..n]);
        Ok(())
    }
    fn matmul(&self, x: &Vec<f32>, w: &Vec<f32>, bias: Option<&Vec<f32>>, m: usize, k: usize, n: usize, out: &mut Vec<f32>) -> Result<()> {
        matmul::matmul(x, w, bias.map(|b| b.as_slice()), m, k, n, out);
        Ok(())
    }
    fn lora(&self, x: &Vec<f32>, a: &Vec<f32>, b: &Vec<f32>, scale: f32, m: usize, k: usize, r: usize, n_out: usize, out: &mut Vec<f32>, col0: usize, ld: usize) -> Result<()> {
        ensure!(x.len() >= m * k && a.len() >= r * k && b.len() >= n_out * r && col0 + n_out <= ld && out.len() >= m * ld, "lora: buffers too small");
        matmul::lora(x, a, b, scale, m, k, r, n_out, out, col0, ld);
        Ok(())
    }
    fn rope(&self, qkv: &mut Vec<f32>, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        rope::rope_qkv(qkv, positions, inv_freq, g.n_heads, g.n_kv_heads, g.head_dim, 1.0);
        Ok(())
    }
    fn qk_norm_rope(&self, qkv: &mut Vec<f32>, q_norm: &Vec<f32>, k_norm: &Vec<f32>, eps: f32, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        ensure!(q_norm.len() == g.head_dim && k_norm.len() == g.head_dim, "qk_norm_rope: norm weights of {} and {} for head_dim {}", q_norm.len(), k_norm.len(), g.head_dim);
        ensure!(qkv.len() >= positions.len() * g.qkv_dim(), "qk_norm_rope: qkv too small");
        rope::qk_norm_rope(qkv, q_norm, k_norm, eps, positions, inv_freq, g);
        Ok(())
    }
    fn kv_store(&self, kv: &mut CpuKv, layer: usize, qkv: &Vec<f32>, slots: &[u32], _g: AttnGeom) -> Result<()> {
        kv.store(layer, qkv, slots);
        Ok(())
    }
    fn attention(&self, kv: &CpuKv, layer: usize, qkv: &Vec<f32>, seqs: &[AttnSeq], _g: AttnGeom, out: &mut Vec<f32>) -> Result<()> {
        attention::attention(kv, layer, qkv, seqs, out);
        Ok(())
    }
    fn swiglu(&self, gate_up: &Vec<f32>, m: usize, i: usize, out: &mut Vec<f32>) -> Result<()> {
        swiglu::swiglu(gate_up, m, i, out);
        Ok(())
    }
    fn logprobs(&self, h: &Vec<f32>, head: &Vec<f32>, targets: &[u32], d: usize, vocab: usize) -> Result<Vec<f32>> {
        Ok(logprob::logprobs(&h[..targets.len() * d], head, targets, d, vocab))
    }
    fn sample(&self, logits: &Vec<f32>, vocab: usize, params: &[SampleParams], uniform: &[f64]) -> Result<Vec<Sampled>> {
        use rayon::prelude::*;
        Ok(params
            .par_iter()
            .enumerate()
            .map(|(r, &p)| sample::sample_row(&logits[r * vocab..(r + 1) * vocab], p, uniform[r]))
            .collect())
    }
}

impl TrainBackend for CpuBackend {
    fn copy(&self, src: &Vec<f32>, dst: &mut Vec<f32>) -> Result<()> {
        ensure!(src.len() == dst.len(), "copy: {} elements into a buffer of {}", src.len(), dst.len());
        dst.copy_from_slice(src);
        Ok(())
    }

    /// `INFOMEM_KEEP_ACTIVATIONS_MB` if set, else a third of the available memory, at most 8 GiB:
    /// recomputing a layer costs as much as its forward (a third of the training step), so RAM
    /// is better spent here than left idle. (The working set is not subtracted: a third of the
    /// RAM leaves room for it on the model sizes a CPU trains.)
    fn keep_activation_bytes(&self, _working_set: usize) -> Result<usize> {
        if let Some(b) = super::keep_override()? {
            return Ok(b);
        }
        // no /proc/meminfo (not Linux): keep nothing, the memory-safe choice
        let avail_kb = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| m.lines().find(|l| l.starts_with("MemAvailable:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<usize>().ok()))
            .unwrap_or(0);
        Ok((avail_kb * 1024 / 3).min(8 << 30))
    }
    fn lora_merge(&self, w: &mut Vec<f32>, row0: usize, a: &Vec<f32>, b: &Vec<f32>, scale: f32, k: usize, r: usize, n_out: usize) -> Result<()> {
        ensure!(w.len() >= (row0 + n_out) * k && a.len() >= r * k && b.len() >= n_out * r, "lora_merge: buffers too small");
        matmul::lora_merge(w, row0, a, b, scale, k, r, n_out);
        Ok(())
    }
    fn attn_dense(&self, qkv: &Vec<f32>, seqs: &[DenseSeq], g: AttnGeom, out: &mut Vec<f32>, lse: &mut Vec<f32>) -> Result<()> {
        check_seqs(seqs, qkv.len(), g.qkv_dim())?;
        attention_dense::attn_dense(qkv, seqs, g, out, lse);
        Ok(())
    }
    fn attn_dense_bwd(&self, qkv: &Vec<f32>, out: &Vec<f32>, dout: &Vec<f32>, lse: &Vec<f32>, seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut Vec<f32>) -> Result<()> {
        check_seqs(seqs, qkv.len(), g.qkv_dim())?;
        attention_dense::attn_dense_bwd(qkv, out, dout, lse, seqs, g, dqkv);
        Ok(())
    }
    fn rmsnorm_bwd(&self, x: &Vec<f32>, w: &Vec<f32>, dy: &Vec<f32>, eps: f32, rows: usize, d: usize, dx: &mut Vec<f32>, accumulate: bool) -> Result<()> {
        norm::rmsnorm_bwd(x, w, dy, eps, rows, d, dx, accumulate);
        Ok(())
    }
    fn rope_bwd(&self, dqkv: &mut Vec<f32>, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        rope::rope_qkv(dqkv, positions, inv_freq, g.n_heads, g.n_kv_heads, g.head_dim, -1.0);
        Ok(())
    }
    fn qk_norm_rope_bwd(&self, pre: &Vec<f32>, q_norm: &Vec<f32>, k_norm: &Vec<f32>, eps: f32, dqkv: &mut Vec<f32>, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        ensure!(q_norm.len() == g.head_dim && k_norm.len() == g.head_dim, "qk_norm_rope_bwd: norm weights of {} and {} for head_dim {}", q_norm.len(), k_norm.len(), g.head_dim);
        ensure!(pre.len() >= positions.len() * g.qkv_dim() && dqkv.len() >= positions.len() * g.qkv_dim(), "qk_norm_rope_bwd: buffers too small");
        rope::qk_norm_rope_bwd(pre, q_norm, k_norm, eps, dqkv, positions, inv_freq, g);
        Ok(())
    }
    fn swiglu_bwd(&self, gate_up: &Vec<f32>, dact: &Vec<f32>, m: usize, i: usize, dgate_up: &mut Vec<f32>) -> Result<()> {
        swiglu::swiglu_bwd(gate_up, dact, m, i, dgate_up);
        Ok(())
    }
    fn matmul_dx(&self, dy: &Vec<f32>, w: &Vec<f32>, m: usize, n: usize, k: usize, dx: &mut Vec<f32>, accumulate: bool) -> Result<()> {
        matmul::matmul_dx(dy, w, m, n, k, dx, accumulate);
        Ok(())
    }
    fn lora_bwd(
        &self,
        x: &Vec<f32>,
        a: &Vec<f32>,
        b: &Vec<f32>,
        scale: f32,
        m: usize,
        k: usize,
        r: usize,
        n_out: usize,
        dy: &Vec<f32>,
        col0: usize,
        ld: usize,
        da: &mut Vec<f32>,
        db: &mut Vec<f32>,
        dx: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        ensure!(col0 + n_out <= ld && dy.len() >= m * ld, "lora_bwd: column slice {col0}+{n_out} outside rows of {ld}");
        ensure!(da.len() == r * k && db.len() == n_out * r, "lora_bwd: gradient buffers do not match A [{r}, {k}], B [{n_out}, {r}]");
        matmul::lora_bwd(x, a, b, scale, m, k, r, n_out, dy, col0, ld, da, db, dx.map(|v| v.as_mut_slice()));
        Ok(())
    }
    fn head_grad(&self, h: &Vec<f32>, head: &Vec<f32>, targets: &[u32], d: usize, vocab: usize, g: &mut Vec<f32>) -> Result<HeadOut> {
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("head_grad: target id {t} is outside the vocabulary (size {vocab})");
        }
        Ok(logprob::head_grad(h, head, targets, d, vocab, g))
    }
    fn scale_rows(&self, x: &mut Vec<f32>, coef: &[f32], d: usize) -> Result<()> {
        memory::scale_rows(x, coef, d);
        Ok(())
    }
    fn scatter_add_rows(&self, src: &Vec<f32>, rows: &[u32], d: usize, dst: &mut Vec<f32>) -> Result<()> {
        memory::scatter_add_rows(src, rows, d, dst);
        Ok(())
    }
    fn sum_squares(&self, x: &Vec<f32>) -> Result<f64> {
        Ok(optim::sum_squares(x))
    }
    fn scale(&self, x: &mut Vec<f32>, s: f32) -> Result<()> {
        optim::scale(x, s);
        Ok(())
    }
    fn accumulate(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        ensure!(acc.len() == x.len(), "accumulate: {} elements into {}", x.len(), acc.len());
        norm::add(acc, x);
        Ok(())
    }
    fn adamw(&self, p: &mut Vec<f32>, g: &Vec<f32>, m: &mut Vec<f32>, v: &mut Vec<f32>, h: AdamWStep) -> Result<()> {
        ensure!(p.len() == g.len() && p.len() == m.len() && p.len() == v.len(), "adamw: buffers of different lengths");
        optim::adamw(p, g, m, v, h);
        Ok(())
    }
}

fn check_seqs(seqs: &[DenseSeq], qkv_len: usize, width: usize) -> Result<()> {
    let rows = qkv_len / width.max(1);
    for s in seqs {
        ensure!(s.row0 + s.len <= rows, "dense sequence rows {}..{} beyond the batch's {rows} rows", s.row0, s.row0 + s.len);
    }
    Ok(())
}
