//! The CPU backend: f32 on host memory, rayon across cores, our AVX-512 GEMM (or the `gemm`
//! crate) for large products and hand-written kernels for the rest. One file per op family
//! (forward and backward together, the table in `backend/mod.rs`); the larger families are rooms:
//! `bf16/` (the bf16-weight products, one file per microkernel) and `attention/` (paged, decode,
//! tiled). Shared below them: `simd` (vector loops), `par` (splitting work across threads),
//! `arena` (packed weights on huge pages). This file only routes the trait methods to them.
pub(crate) mod arena;
pub mod attention;
pub mod attention_dense;
pub mod buf;
#[cfg(target_arch = "x86_64")]
pub mod gemm512;
pub mod bf16;
pub mod logprob;
pub mod lora;
pub mod machine;
pub mod matmul;
pub mod memory;
pub mod norm;
pub mod optim;
pub(crate) mod par;
pub mod rope;
pub mod sample;
pub mod simd;
pub mod swiglu;

use super::{AdamWStep, AttnGeom, AttnSeq, Backend, Dtype, LoraSlice, DenseSeq, HeadOut, SampleParams, Sampled, TrainBackend};
use anyhow::{ensure, Result};
use attention::CpuKv;
pub use buf::CpuBuf;
use buf::PackedWeight;


#[derive(Clone, Debug)]
pub struct CpuBackend {
    threads: usize,
    weights: Dtype,
    /// Keep LoRA unmerged in training with f32 weights too (tests: the unmerged passes against
    /// the f32 fixtures, without bf16's rounding in the way).
    unmerged: bool,
}

impl CpuBackend {
    /// Uses rayon's global pool (sized by `init_threads` or `RAYON_NUM_THREADS`); f32 weights.
    pub fn new() -> Self {
        Self::with_weights(Dtype::F32)
    }
    /// Weight matrices stored as `weights` (everything else is f32 either way).
    pub fn with_weights(weights: Dtype) -> Self {
        CpuBackend { threads: rayon::current_num_threads(), weights, unmerged: false }
    }
    /// The training passes keep LoRA unmerged whatever the weight dtype (see `lora_unmerged`).
    pub fn with_unmerged_lora(mut self) -> Self {
        self.unmerged = true;
        self
    }
    pub fn weight_dtype(&self) -> Dtype {
        self.weights
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
    use arena::HUGE;
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
    type Buf = CpuBuf;
    type Kv = CpuKv;

    fn name(&self) -> String {
        match self.weights {
            Dtype::F32 => format!("cpu ({} threads, f32)", self.threads),
            Dtype::Bf16 => {
                format!("cpu ({} threads, bf16 weights, {})", self.threads, bf16::auto_kernel())
            }
        }
    }

    fn host_compute(&self) -> bool {
        true
    }

    fn upload(&self, data: &[f32]) -> Result<CpuBuf> {
        Ok(data.to_vec().into())
    }
    fn upload_vec(&self, data: Vec<f32>) -> Result<CpuBuf> {
        Ok(huge_page_copy(data).into())
    }
    fn upload_weight(&self, data: Vec<f32>, n: usize, k: usize) -> Result<CpuBuf> {
        ensure!(data.len() == n * k, "upload_weight: {} values for [{n}, {k}]", data.len());
        match self.weights {
            Dtype::F32 => self.upload_vec(data),
            Dtype::Bf16 => Ok(CpuBuf::packed(PackedWeight::from_f32(&data, n, k))),
        }
    }
    fn zeros(&self, n: usize) -> Result<CpuBuf> {
        Ok(vec![0.0; n].into())
    }
    fn download(&self, buf: &CpuBuf) -> Result<Vec<f32>> {
        Ok(match buf.bf16() {
            Some(w) => w.to_f32(),
            None => buf.to_vec(),
        })
    }
    fn write(&self, buf: &mut CpuBuf, data: &[f32]) -> Result<()> {
        ensure!(buf.bf16().is_none(), "write: a bf16 weight is frozen");
        ensure!(buf.len() == data.len(), "write: length {} into buffer of {}", data.len(), buf.len());
        buf.copy_from_slice(data);
        Ok(())
    }
    fn len(&self, buf: &CpuBuf) -> usize {
        buf.elems()
    }

    fn kv_new(&self, geom: AttnGeom, max_pages: usize) -> Result<CpuKv> {
        // the KV cache follows the weights' dtype, as on CUDA (bf16 there always)
        Ok(CpuKv::new(geom, max_pages, self.weights == Dtype::Bf16))
    }
    fn kv_copy_page(&self, kv: &mut CpuKv, src: u32, dst: u32, n_tokens: usize) -> Result<()> {
        kv.copy_page(src, dst, n_tokens);
        Ok(())
    }
    fn kv_release_page(&self, kv: &mut CpuKv, page: u32) {
        kv.release(page);
    }

    fn gather_rows(&self, x: &CpuBuf, rows: &[u32], d: usize, out: &mut CpuBuf) -> Result<()> {
        memory::gather_rows(x, rows, d, out);
        Ok(())
    }
    fn embed(&self, table: &CpuBuf, ids: &[u32], d: usize, out: &mut CpuBuf) -> Result<()> {
        match table.bf16() {
            Some(w) => {
                use rayon::prelude::*;
                out[..ids.len() * d].par_chunks_mut(d).zip(ids).for_each(|(o, &t)| w.row(t as usize, o));
            }
            None => memory::embed(table, ids, d, out),
        }
        Ok(())
    }
    fn rmsnorm(&self, x: &CpuBuf, w: &CpuBuf, eps: f32, rows: usize, d: usize, out: &mut CpuBuf) -> Result<()> {
        norm::rmsnorm(x, w, eps, rows, d, out);
        Ok(())
    }
    fn add_rmsnorm(&self, resid: &mut CpuBuf, delta: &CpuBuf, w: &CpuBuf, eps: f32, rows: usize, d: usize, out: &mut CpuBuf) -> Result<()> {
        norm::add_rmsnorm(resid, delta, w, eps, rows, d, out);
        Ok(())
    }
    fn add(&self, resid: &mut CpuBuf, delta: &CpuBuf, n: usize) -> Result<()> {
        norm::add(&mut resid[..n], &delta[..n]);
        Ok(())
    }
    fn matmul(&self, x: &CpuBuf, w: &CpuBuf, bias: Option<&CpuBuf>, m: usize, k: usize, n: usize, out: &mut CpuBuf) -> Result<()> {
        match w.bf16() {
            Some(pw) => {
                ensure!(pw.n == n && pw.k == k, "matmul: bf16 weight [{}, {}] for a [{n}, {k}] product", pw.n, pw.k);
                pw.matmul(x, bias.map(|b| b.as_slice()), m, out);
            }
            None => matmul::matmul(x, w, bias.map(|b| b.as_slice()), m, k, n, out),
        }
        Ok(())
    }
    fn lora(&self, x: &CpuBuf, a: &CpuBuf, b: &CpuBuf, scale: f32, m: usize, k: usize, r: usize, n_out: usize, out: &mut CpuBuf, col0: usize, ld: usize) -> Result<()> {
        ensure!(x.len() >= m * k && a.len() >= r * k && b.len() >= n_out * r && col0 + n_out <= ld && out.len() >= m * ld, "lora: buffers too small");
        // under --dtype bf16 the LoRA products take bf16 operands too (docs/DESIGN.md §3)
        match self.weights {
            Dtype::Bf16 => lora::lora_bf16(x, m, k, &lora::Pair::new(a, b, scale, r, col0, n_out), out, ld),
            Dtype::F32 => lora::lora(x, m, k, &lora::Pair::new(a, b, scale, r, col0, n_out), out, ld),
        }
        Ok(())
    }
    fn matmul_lora(&self, x: &CpuBuf, w: &CpuBuf, bias: Option<&CpuBuf>, m: usize, k: usize, n: usize, out: &mut CpuBuf, pairs: &[LoraSlice<'_, CpuBuf>]) -> Result<()> {
        // fused on a one-tile bf16 weight (lora::matmul_lora); else the separate ops
        let Some(pw) = w.bf16().and_then(|p| p.single()) else {
            return super::matmul_lora_separate(self, x, w, bias, m, k, n, out, pairs);
        };
        ensure!(pw.n() == n && pw.k() == k, "matmul_lora: bf16 weight [{}, {}] for a [{n}, {k}] product", pw.n(), pw.k());
        ensure!(x.len() >= m * k && out.len() >= m * n && bias.is_none_or(|b| b.len() >= n), "matmul_lora: buffers too small");
        let hp = host_pairs(pairs, k, n)?;
        lora::matmul_lora(x, pw, bias.map(|b| b.as_slice()), m, k, n, out, &hp);
        Ok(())
    }
    fn matmul_lora_swiglu(&self, x: &CpuBuf, w: &CpuBuf, m: usize, k: usize, i: usize, gate_up: &mut CpuBuf, act: &mut CpuBuf, pairs: &[LoraSlice<'_, CpuBuf>]) -> Result<()> {
        // fused on a one-tile bf16 weight (lora::matmul_lora_swiglu); else the separate ops
        let Some(pw) = w.bf16().and_then(|p| p.single()) else {
            return super::matmul_lora_swiglu_separate(self, x, w, m, k, i, gate_up, act, pairs);
        };
        ensure!(pw.n() == 2 * i && pw.k() == k, "matmul_lora_swiglu: bf16 weight [{}, {}] for a [{}, {k}] gate/up product", pw.n(), pw.k(), 2 * i);
        ensure!(x.len() >= m * k && gate_up.len() >= m * 2 * i && act.len() >= m * i, "matmul_lora_swiglu: buffers too small");
        let hp = host_pairs(pairs, k, 2 * i)?;
        lora::matmul_lora_swiglu(x, pw, m, k, i, gate_up, act, &hp);
        Ok(())
    }
    fn rope(&self, qkv: &mut CpuBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        check_freqs("rope", inv_freq, g)?;
        rope::rope_qkv(qkv, positions, inv_freq, g.n_heads, g.n_kv_heads, g.head_dim, 1.0);
        Ok(())
    }
    fn qk_norm_rope(&self, qkv: &mut CpuBuf, q_norm: &CpuBuf, k_norm: &CpuBuf, eps: f32, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        ensure!(q_norm.len() == g.head_dim && k_norm.len() == g.head_dim, "qk_norm_rope: norm weights of {} and {} for head_dim {}", q_norm.len(), k_norm.len(), g.head_dim);
        ensure!(qkv.len() >= positions.len() * g.qkv_dim(), "qk_norm_rope: qkv too small");
        check_freqs("qk_norm_rope", inv_freq, g)?;
        rope::qk_norm_rope(qkv, q_norm, k_norm, eps, positions, inv_freq, g);
        Ok(())
    }
    fn kv_store(&self, kv: &mut CpuKv, layer: usize, qkv: &CpuBuf, slots: &[u32], _g: AttnGeom) -> Result<()> {
        kv.store(layer, qkv, slots);
        Ok(())
    }
    fn attention(&self, kv: &CpuKv, layer: usize, qkv: &CpuBuf, seqs: &[AttnSeq], _g: AttnGeom, out: &mut CpuBuf) -> Result<()> {
        attention::attention(kv, layer, qkv, seqs, out);
        Ok(())
    }
    fn swiglu(&self, gate_up: &CpuBuf, m: usize, i: usize, out: &mut CpuBuf) -> Result<()> {
        swiglu::swiglu(gate_up, m, i, out);
        Ok(())
    }
    fn logprobs(&self, h: &CpuBuf, head: &CpuBuf, targets: &[u32], d: usize, vocab: usize) -> Result<Vec<f32>> {
        Ok(match head.bf16() {
            Some(w) => logprob::logprobs(&h[..targets.len() * d], w, targets, d, vocab),
            None => logprob::logprobs(&h[..targets.len() * d], head.as_slice(), targets, d, vocab),
        })
    }
    fn sample(&self, logits: &CpuBuf, vocab: usize, params: &[SampleParams], uniform: &[f64]) -> Result<Vec<Sampled>> {
        use rayon::prelude::*;
        Ok(params
            .par_iter()
            .enumerate()
            .map(|(r, &p)| sample::sample_row(&logits[r * vocab..(r + 1) * vocab], p, uniform[r]))
            .collect())
    }
}

/// Whether `scratch` fills its buffers with NaN (see `poison_scratch`).
static POISON_SCRATCH: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(cfg!(debug_assertions));

/// Make every later `TrainBackend::scratch` buffer NaN-filled (`true`) or uninitialized (`false`;
/// the release default). A test hook: with NaN in every element an op did not write, a result
/// that reads one first is NaN or differs in its bits from the uninitialized run's. Returns the
/// previous setting (debug builds start with `true`).
pub fn poison_scratch(on: bool) -> bool {
    POISON_SCRATCH.swap(on, std::sync::atomic::Ordering::Relaxed)
}

/// `TrainBackend::matmul_dx_lora` on a one-tile bf16 weight (`lora::matmul_dx_lora`), its pairs'
/// input as rows or formed from gate/up.
#[allow(clippy::too_many_arguments)]
fn fused_dx_lora(dy: &CpuBuf, pw: &bf16::PackedBf16, m: usize, n: usize, k: usize, dx: &mut CpuBuf, x: lora::XRows, pairs: &[LoraSlice<'_, CpuBuf>], grads: &mut [(&mut CpuBuf, &mut CpuBuf)]) -> Result<()> {
    ensure!(pairs.len() == grads.len(), "matmul_dx_lora: {} pairs, {} gradient pairs", pairs.len(), grads.len());
    ensure!(pw.n() == n && pw.k() == k, "matmul_dx_lora: bf16 weight [{}, {}] for [{n}, {k}]", pw.n(), pw.k());
    let xw = x.width(k);
    ensure!(x.len() >= m * xw && dy.len() >= m * n && dx.len() >= m * k, "matmul_dx_lora: x, dy or dx smaller than [{m}, {xw}], [{m}, {n}], [{m}, {k}]");
    let hp = host_pairs(pairs, k, n)?;
    for (p, (ga, gb)) in hp.iter().zip(grads.iter()) {
        ensure!(ga.len() == p.r * k && gb.len() == p.n_out * p.r, "matmul_dx_lora: gradient buffers do not match A [{}, {k}], B [{}, {}]", p.r, p.n_out, p.r);
    }
    let mut g: Vec<(&mut [f32], &mut [f32])> = grads.iter_mut().map(|(a, b)| (a.as_mut_slice(), b.as_mut_slice())).collect();
    lora::matmul_dx_lora(dy, pw, m, n, k, dx, x, &hp, &mut g);
    Ok(())
}

impl TrainBackend for CpuBackend {
    /// Uninitialized memory from the allocator (NaN under `poison_scratch`): a buffer reused
    /// from the heap is not zeroed first, and a fresh one is zero pages either way.
    unsafe fn scratch(&self, n: usize) -> Result<CpuBuf> {
        if POISON_SCRATCH.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(vec![f32::NAN; n].into());
        }
        let mut v = Vec::with_capacity(n);
        // Safety: the capacity holds n f32; the caller writes every element before reading any
        // (the trait's contract), and f32 has no invalid bit patterns to drop. Uninitialized on
        // purpose: zeroing a step's scratch costs a pass over it (`tests/grpo_grad.rs`
        // `scratch_buffers_are_written_before_they_are_read` checks the contract).
        #[allow(clippy::uninit_vec)]
        v.set_len(n);
        Ok(v.into())
    }

    fn copy(&self, src: &CpuBuf, dst: &mut CpuBuf) -> Result<()> {
        ensure!(src.elems() == dst.elems() && dst.bf16().is_none(), "copy: {} elements into a buffer of {}", src.elems(), dst.elems());
        match src.bf16() {
            // a bf16 weight into f32 scratch: the training passes merge LoRA into it in f32 (the
            // CUDA backend's lazy merge computes the same W_bf16 + scale·B·A)
            Some(w) => dst.copy_from_slice(&w.to_f32()),
            None => dst.copy_from_slice(src),
        }
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
    /// bf16 weights stay packed in training: LoRA runs beside them (docs/DESIGN.md §3).
    fn lora_unmerged(&self) -> bool {
        self.weights == Dtype::Bf16 || self.unmerged
    }
    fn lora_merge(&self, w: &mut CpuBuf, row0: usize, a: &CpuBuf, b: &CpuBuf, scale: f32, k: usize, r: usize, n_out: usize) -> Result<()> {
        ensure!(w.bf16().is_none(), "lora_merge: merge into an f32 copy of a bf16 weight (copy), not into the weight");
        ensure!(w.len() >= (row0 + n_out) * k && a.len() >= r * k && b.len() >= n_out * r, "lora_merge: buffers too small");
        matmul::lora_merge(w, row0, a, b, scale, k, r, n_out);
        Ok(())
    }
    fn attn_dense(&self, qkv: &CpuBuf, seqs: &[DenseSeq], g: AttnGeom, out: &mut CpuBuf, lse: &mut CpuBuf) -> Result<()> {
        check_seqs(seqs, qkv.len(), g.qkv_dim())?;
        attention_dense::attn_dense(qkv, seqs, g, out, lse, self.weights == Dtype::Bf16);
        Ok(())
    }
    fn attn_dense_bwd(&self, qkv: &CpuBuf, out: &CpuBuf, dout: &CpuBuf, lse: &CpuBuf, seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut CpuBuf) -> Result<()> {
        check_seqs(seqs, qkv.len(), g.qkv_dim())?;
        attention_dense::attn_dense_bwd(qkv, out, dout, lse, seqs, g, dqkv, self.weights == Dtype::Bf16);
        Ok(())
    }
    fn rmsnorm_bwd(&self, x: &CpuBuf, w: &CpuBuf, dy: &CpuBuf, eps: f32, rows: usize, d: usize, dx: &mut CpuBuf, accumulate: bool) -> Result<()> {
        norm::rmsnorm_bwd(x, w, dy, eps, rows, d, dx, accumulate);
        Ok(())
    }
    fn rope_bwd(&self, dqkv: &mut CpuBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        check_freqs("rope_bwd", inv_freq, g)?;
        rope::rope_qkv(dqkv, positions, inv_freq, g.n_heads, g.n_kv_heads, g.head_dim, -1.0);
        Ok(())
    }
    fn qk_norm_rope_bwd(&self, pre: &CpuBuf, q_norm: &CpuBuf, k_norm: &CpuBuf, eps: f32, dqkv: &mut CpuBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        ensure!(q_norm.len() == g.head_dim && k_norm.len() == g.head_dim, "qk_norm_rope_bwd: norm weights of {} and {} for head_dim {}", q_norm.len(), k_norm.len(), g.head_dim);
        ensure!(pre.len() >= positions.len() * g.qkv_dim() && dqkv.len() >= positions.len() * g.qkv_dim(), "qk_norm_rope_bwd: buffers too small");
        check_freqs("qk_norm_rope_bwd", inv_freq, g)?;
        rope::qk_norm_rope_bwd(pre, q_norm, k_norm, eps, dqkv, positions, inv_freq, g);
        Ok(())
    }
    fn swiglu_bwd(&self, gate_up: &CpuBuf, dact: &CpuBuf, m: usize, i: usize, dgate_up: &mut CpuBuf) -> Result<()> {
        swiglu::swiglu_bwd(gate_up, dact, m, i, dgate_up);
        Ok(())
    }
    fn matmul_dx(&self, dy: &CpuBuf, w: &CpuBuf, m: usize, n: usize, k: usize, dx: &mut CpuBuf, accumulate: bool) -> Result<()> {
        match w.bf16() {
            Some(pw) => {
                ensure!(pw.n == n && pw.k == k, "matmul_dx: bf16 weight [{}, {}] for [{n}, {k}]", pw.n, pw.k);
                pw.matmul_dx(dy, m, dx, accumulate);
            }
            None => matmul::matmul_dx(dy, w, m, n, k, dx, accumulate),
        }
        Ok(())
    }
    fn matmul_dx_lora(&self, dy: &CpuBuf, w: &CpuBuf, m: usize, n: usize, k: usize, dx: &mut CpuBuf, x: &CpuBuf, pairs: &[LoraSlice<'_, CpuBuf>], grads: &mut [(&mut CpuBuf, &mut CpuBuf)]) -> Result<()> {
        let Some(pw) = w.bf16().and_then(|p| p.single()) else {
            return super::matmul_dx_lora_separate(self, dy, w, m, n, k, dx, x, pairs, grads);
        };
        fused_dx_lora(dy, pw, m, n, k, dx, lora::XRows::Plain(x), pairs, grads)
    }
    fn matmul_dx_lora_swiglu(&self, dy: &CpuBuf, w: &CpuBuf, m: usize, n: usize, k: usize, dx: &mut CpuBuf, gate_up: &CpuBuf, pairs: &[LoraSlice<'_, CpuBuf>], grads: &mut [(&mut CpuBuf, &mut CpuBuf)]) -> Result<()> {
        // fused on a one-tile bf16 weight, x's rows formed per block; else x made whole first
        let Some(pw) = w.bf16().and_then(|p| p.single()) else {
            return super::matmul_dx_lora_swiglu_separate(self, dy, w, m, n, k, dx, gate_up, pairs, grads);
        };
        fused_dx_lora(dy, pw, m, n, k, dx, lora::XRows::Swiglu(gate_up), pairs, grads)
    }
    fn lora_bwd(
        &self,
        x: &CpuBuf,
        a: &CpuBuf,
        b: &CpuBuf,
        scale: f32,
        m: usize,
        k: usize,
        r: usize,
        n_out: usize,
        dy: &CpuBuf,
        col0: usize,
        ld: usize,
        da: &mut CpuBuf,
        db: &mut CpuBuf,
        dx: Option<&mut CpuBuf>,
    ) -> Result<()> {
        ensure!(col0 + n_out <= ld && dy.len() >= m * ld, "lora_bwd: column slice {col0}+{n_out} outside rows of {ld}");
        ensure!(da.len() == r * k && db.len() == n_out * r, "lora_bwd: gradient buffers do not match A [{r}, {k}], B [{n_out}, {r}]");
        ensure!(x.len() >= m * k && a.len() >= r * k && b.len() >= n_out * r, "lora_bwd: x, A or B smaller than [{m}, {k}], [{r}, {k}], [{n_out}, {r}]");
        ensure!(dx.as_ref().is_none_or(|d| d.len() >= m * k), "lora_bwd: dx smaller than [{m}, {k}]");
        match self.weights {
            Dtype::Bf16 => lora::lora_bwd_bf16(x, m, k, &lora::Pair::new(a, b, scale, r, col0, n_out), dy, ld, (da, db), dx.map(|v| v.as_mut_slice())),
            Dtype::F32 => lora::lora_bwd(x, m, k, &lora::Pair::new(a, b, scale, r, col0, n_out), dy, ld, (da, db), dx.map(|v| v.as_mut_slice()), None),
        }
        Ok(())
    }
    fn head_grad(&self, h: &CpuBuf, head: &CpuBuf, targets: &[u32], d: usize, vocab: usize, g: &mut CpuBuf) -> Result<HeadOut> {
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("head_grad: target id {t} is outside the vocabulary (size {vocab})");
        }
        Ok(match head.bf16() {
            Some(w) => logprob::head_grad(h, w, targets, d, vocab, g),
            None => logprob::head_grad(h, head.as_slice(), targets, d, vocab, g),
        })
    }
    fn scale_rows(&self, x: &mut CpuBuf, coef: &[f32], d: usize) -> Result<()> {
        memory::scale_rows(x, coef, d);
        Ok(())
    }
    fn scatter_add_rows(&self, src: &CpuBuf, rows: &[u32], d: usize, dst: &mut CpuBuf) -> Result<()> {
        memory::scatter_add_rows(src, rows, d, dst);
        Ok(())
    }
    fn sum_squares(&self, x: &CpuBuf) -> Result<f64> {
        Ok(optim::sum_squares(x))
    }
    fn scale(&self, x: &mut CpuBuf, s: f32) -> Result<()> {
        optim::scale(x, s);
        Ok(())
    }
    fn accumulate(&self, acc: &mut CpuBuf, x: &CpuBuf) -> Result<()> {
        ensure!(acc.len() == x.len(), "accumulate: {} elements into {}", x.len(), acc.len());
        norm::add(acc, x);
        Ok(())
    }
    fn adamw(&self, p: &mut CpuBuf, g: &CpuBuf, m: &mut CpuBuf, v: &mut CpuBuf, h: AdamWStep) -> Result<()> {
        ensure!(p.len() == g.len() && p.len() == m.len() && p.len() == v.len(), "adamw: buffers of different lengths");
        optim::adamw(p, g, m, v, h);
        Ok(())
    }
}

/// RoPE's rows of cos/sin take the first `head_dim/2` inverse frequencies.
fn check_freqs(op: &str, inv_freq: &[f32], g: AttnGeom) -> Result<()> {
    ensure!(inv_freq.len() >= g.head_dim / 2, "{op}: {} inverse frequencies for head_dim {}", inv_freq.len(), g.head_dim);
    Ok(())
}

fn check_seqs(seqs: &[DenseSeq], qkv_len: usize, width: usize) -> Result<()> {
    let rows = qkv_len / width.max(1);
    for s in seqs {
        ensure!(s.row0 + s.len <= rows, "dense sequence rows {}..{} beyond the batch's {rows} rows", s.row0, s.row0 + s.len);
    }
    Ok(())
}

/// The pairs as host slices, checked against a product of `n` output columns over `k` inputs.
fn host_pairs<'a>(pairs: &[LoraSlice<'a, CpuBuf>], k: usize, n: usize) -> Result<Vec<lora::Pair<'a>>> {
    pairs
        .iter()
        .map(|p| {
            ensure!(p.a.len() >= p.r * k && p.b.len() >= p.n_out * p.r && p.col0 + p.n_out <= n, "LoRA pair A [{}, {k}], B [{}, {}] at column {} does not fit a product [{n}, {k}]", p.r, p.n_out, p.r, p.col0);
            Ok(lora::Pair::new(p.a.as_slice(), p.b.as_slice(), p.scale, p.r, p.col0, p.n_out).with_shadows(p.a.shadow(), p.b.shadow()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::Rng;

    fn rand(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// A LoRA parameter's bf16 copies (`bf16::thin::Shadow`, kept in its `CpuBuf` under `--dtype
    /// bf16`) follow its values: after `write` and after an in-place update through `&mut` (as
    /// AdamW's), the fused forward and backward, on decode- and prefill-sized row counts, give
    /// the bits of fresh buffers (no copies yet) holding the new values.
    #[test]
    fn lora_shadows_follow_writes() {
        let mut rng = Rng::new(9);
        let be = CpuBackend::with_weights(Dtype::Bf16);
        let (k, n, r) = (64usize, 96usize, 8usize);
        let w = be.upload_weight(rand(&mut rng, n * k), n, k).unwrap();
        let (a0, b0, a1) = (rand(&mut rng, r * k), rand(&mut rng, n * r), rand(&mut rng, r * k));
        for m in [5usize, 40] {
            let (x, dy) = (be.upload(&rand(&mut rng, m * k)).unwrap(), be.upload(&rand(&mut rng, m * n)).unwrap());
            // (out, dx, dA, dB) of the fused ops with these A and B
            let run = |a: &CpuBuf, b: &CpuBuf| {
                let pairs = [LoraSlice { a, b, scale: 1.5, r, col0: 0, n_out: n }];
                let mut out = be.zeros(m * n).unwrap();
                be.matmul_lora(&x, &w, None, m, k, n, &mut out, &pairs).unwrap();
                let (mut dx, mut ga, mut gb) = (be.zeros(m * k).unwrap(), be.zeros(r * k).unwrap(), be.zeros(n * r).unwrap());
                be.matmul_dx_lora(&dy, &w, m, n, k, &mut dx, &x, &pairs, &mut [(&mut ga, &mut gb)]).unwrap();
                [out, dx, ga, gb].map(|v| v.to_vec())
            };
            let fresh = |a: &[f32], b: &[f32]| run(&be.upload(a).unwrap(), &be.upload(b).unwrap());
            let (mut a, mut b) = (be.upload(&a0).unwrap(), be.upload(&b0).unwrap());
            let before = run(&a, &b); // makes the copies
            assert!(before == fresh(&a0, &b0), "m {m}: kept copies differ from fresh ones");
            be.write(&mut a, &a1).unwrap();
            let want = fresh(&a1, &b0);
            assert!(want != before, "m {m}: the new A changed nothing");
            assert!(run(&a, &b) == want, "m {m}: after write, the bf16 copies of A are stale");
            b.iter_mut().for_each(|v| *v *= -0.5);
            let b1: Vec<f32> = b0.iter().map(|v| v * -0.5).collect();
            assert!(run(&a, &b) == fresh(&a1, &b1), "m {m}: after an in-place update, the bf16 copies of B are stale");
        }
    }

    /// The backend's fused ops give the separate ops' bits on every weight kind they route:
    /// one-tile bf16 (fused), tiled bf16 (≥ 8192 rows: separate ops inside) and f32, at a
    /// decode-sized and a prefill-sized row count; and a count mismatch is an error.
    #[test]
    fn fused_ops_equal_the_separate_ops() {
        let mut rng = Rng::new(3);
        for (dtype, n) in [(Dtype::Bf16, 1000usize), (Dtype::Bf16, 8200), (Dtype::F32, 1000)] {
            let be = CpuBackend::with_weights(dtype);
            let k = 72;
            let w = be.upload_weight(rand(&mut rng, n * k), n, k).unwrap();
            let bias = be.upload(&rand(&mut rng, n)).unwrap();
            // (r, col0, n_out)
            let shape = [(8usize, 0usize, 300usize), (4, 290, 700)];
            let ab: Vec<(CpuBuf, CpuBuf)> = shape.iter().map(|&(r, _, no)| (be.upload(&rand(&mut rng, r * k)).unwrap(), be.upload(&rand(&mut rng, no * r)).unwrap())).collect();
            let pairs: Vec<LoraSlice<CpuBuf>> = shape.iter().zip(&ab).map(|(&(r, col0, n_out), (a, b))| LoraSlice { a, b, scale: 1.5, r, col0, n_out }).collect();
            for m in [5usize, 40] {
                let x = be.upload(&rand(&mut rng, m * k)).unwrap();
                let dy = be.upload(&rand(&mut rng, m * n)).unwrap();
                let mut want = be.zeros(m * n).unwrap();
                be.matmul(&x, &w, Some(&bias), m, k, n, &mut want).unwrap();
                for p in &pairs {
                    be.lora(&x, p.a, p.b, p.scale, m, k, p.r, p.n_out, &mut want, p.col0, n).unwrap();
                }
                let mut got = be.upload(&vec![f32::NAN; m * n]).unwrap();
                be.matmul_lora(&x, &w, Some(&bias), m, k, n, &mut got, &pairs).unwrap();
                assert!(got.as_slice() == want.as_slice(), "matmul_lora differs ({dtype:?}, n {n}, m {m})");

                let g0: Vec<(Vec<f32>, Vec<f32>)> = shape.iter().map(|&(r, _, no)| (rand(&mut rng, r * k), rand(&mut rng, no * r))).collect();
                let mut want_dx = be.zeros(m * k).unwrap();
                be.matmul_dx(&dy, &w, m, n, k, &mut want_dx, false).unwrap();
                let mut want_g: Vec<(CpuBuf, CpuBuf)> = g0.iter().map(|(a, b)| (be.upload(a).unwrap(), be.upload(b).unwrap())).collect();
                for (p, (ga, gb)) in pairs.iter().zip(want_g.iter_mut()) {
                    be.lora_bwd(&x, p.a, p.b, p.scale, m, k, p.r, p.n_out, &dy, p.col0, n, ga, gb, Some(&mut want_dx)).unwrap();
                }
                let mut got_dx = be.upload(&vec![f32::NAN; m * k]).unwrap();
                let mut got_g: Vec<(CpuBuf, CpuBuf)> = g0.iter().map(|(a, b)| (be.upload(a).unwrap(), be.upload(b).unwrap())).collect();
                let mut gr: Vec<(&mut CpuBuf, &mut CpuBuf)> = got_g.iter_mut().map(|(a, b)| (a, b)).collect();
                be.matmul_dx_lora(&dy, &w, m, n, k, &mut got_dx, &x, &pairs, &mut gr).unwrap();
                assert!(got_dx.as_slice() == want_dx.as_slice(), "matmul_dx_lora's dx differs ({dtype:?}, n {n}, m {m})");
                for ((ga, gb), (wa, wb)) in got_g.iter().zip(&want_g) {
                    assert!(ga.as_slice() == wa.as_slice() && gb.as_slice() == wb.as_slice(), "matmul_dx_lora's gradients differ ({dtype:?}, n {n}, m {m})");
                }
                let mut one: Vec<(&mut CpuBuf, &mut CpuBuf)> = got_g.iter_mut().take(1).map(|(a, b)| (a, b)).collect();
                assert!(be.matmul_dx_lora(&dy, &w, m, n, k, &mut got_dx, &x, &pairs, &mut one).is_err(), "two pairs with one gradient pair must be refused");
            }
        }
    }
}
