//! The fixed set of ops this transformer needs, behind one small trait. The CPU backend computes
//! in f32 on host memory; the CUDA backend stores bf16 on the device and accumulates in f32.
//! Bulk data lives in `Backend::Buf` (one flat array); small per-call metadata (token ids,
//! positions, page tables, sampling parameters) is passed as host slices and moved by the backend.
//!
//! Layout conventions (all row-major):
//! - activations `[rows, features]`; weights `[out, in]` as in HF checkpoints, so a projection is
//!   `y = x Wᵀ (+ b)`;
//! - the fused `qkv` activation holds q (`n_heads·hd`), then k, then v (`n_kv_heads·hd` each);
//! - the fused `gate_up` activation holds gate (`inter`), then up (`inter`);
//! - the paged KV cache is addressed by slot = page·page_size + offset (see `runtime::kv`).
pub mod cpu;

use crate::model::config::ModelConfig;
use anyhow::Result;

/// Geometry of the attention and KV cache, fixed per model.
#[derive(Clone, Copy, Debug)]
pub struct AttnGeom {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub page_size: usize,
}

impl AttnGeom {
    pub fn new(cfg: &ModelConfig, page_size: usize) -> Self {
        AttnGeom {
            n_layers: cfg.n_layers,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            page_size,
        }
    }
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
}

/// One sequence's share of a batched attention call: its query rows are
/// `q_row .. q_row + n_q` of the batch, they sit at positions `ctx_len - n_q .. ctx_len` of the
/// sequence, and the sequence's keys/values (including those rows) are in `pages`.
#[derive(Clone, Debug)]
pub struct AttnSeq<'a> {
    pub q_row: usize,
    pub n_q: usize,
    pub ctx_len: usize,
    pub pages: &'a [u32],
}

/// How to pick the next token of one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0 → greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 keeps the whole vocabulary.
    pub top_p: f32,
}

impl SampleParams {
    pub const GREEDY: SampleParams = SampleParams { temperature: 0.0, top_p: 1.0 };
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// A picked token and its log-probability under the model (log-softmax at temperature 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
}

pub trait Backend: Send + Sync {
    /// A flat array on the backend's device.
    type Buf: Send + Sync;
    /// The paged KV cache storage for all layers.
    type Kv: Send + Sync;

    fn name(&self) -> String;

    /// Wait until every op enqueued so far has finished (a GPU backend returns from most ops
    /// before their kernels run; the CPU computes in the call). Timings read the clock after it
    /// ([`timed`]), and it surfaces asynchronous device errors.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    // ---- memory ----
    fn upload(&self, data: &[f32]) -> Result<Self::Buf>;
    /// Like `upload`, taking ownership (the CPU backend keeps the vector without copying).
    fn upload_vec(&self, data: Vec<f32>) -> Result<Self::Buf> {
        self.upload(&data)
    }
    /// Upload a trainable parameter (a LoRA A or B). Backends that store weights in lower
    /// precision keep an exact master copy, so a checkpoint restores the adapter bit for bit.
    fn upload_param(&self, data: &[f32]) -> Result<Self::Buf> {
        self.upload(data)
    }
    /// A zero-filled buffer of `n` elements.
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>>;
    /// Overwrite `buf` (same length) with host data.
    fn write(&self, buf: &mut Self::Buf, data: &[f32]) -> Result<()>;
    fn len(&self, buf: &Self::Buf) -> usize;

    // ---- KV cache ----
    /// Storage for at most `max_pages` pages (backends may allocate lazily).
    fn kv_new(&self, geom: AttnGeom, max_pages: usize) -> Result<Self::Kv>;
    /// Copy the first `n_tokens` slots of page `src` to page `dst` (copy-on-write of a shared page).
    fn kv_copy_page(&self, kv: &mut Self::Kv, src: u32, dst: u32, n_tokens: usize) -> Result<()>;
    /// Let the backend reclaim a page's memory (it may keep it for reuse).
    fn kv_release_page(&self, kv: &mut Self::Kv, page: u32);

    // ---- forward ops ----
    /// `out[i] = x[rows[i]]`, rows of `d` (picks the rows whose logits are wanted).
    fn gather_rows(&self, x: &Self::Buf, rows: &[u32], d: usize, out: &mut Self::Buf) -> Result<()>;
    /// `out[i] = table[ids[i]]`, rows of `d`.
    fn embed(&self, table: &Self::Buf, ids: &[u32], d: usize, out: &mut Self::Buf) -> Result<()>;
    /// `out = x / rms(x) · w` per row of `d`.
    fn rmsnorm(&self, x: &Self::Buf, w: &Self::Buf, eps: f32, rows: usize, d: usize, out: &mut Self::Buf) -> Result<()>;
    /// `resid += delta; out = rmsnorm(resid) · w` (the residual add fused with the next norm).
    fn add_rmsnorm(
        &self,
        resid: &mut Self::Buf,
        delta: &Self::Buf,
        w: &Self::Buf,
        eps: f32,
        rows: usize,
        d: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `resid += delta`.
    fn add(&self, resid: &mut Self::Buf, delta: &Self::Buf, n: usize) -> Result<()>;
    /// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])`.
    fn matmul(&self, x: &Self::Buf, w: &Self::Buf, bias: Option<&Self::Buf>, m: usize, k: usize, n: usize, out: &mut Self::Buf) -> Result<()>;
    /// LoRA delta into a column slice of `out`: `out[:, col0..col0+n_out] += scale · (x Aᵀ) Bᵀ`,
    /// `x [m, k]`, `A [r, k]`, `B [n_out, r]`, `out` rows of `ld` — `B·A` is never formed.
    #[allow(clippy::too_many_arguments)]
    fn lora(&self, x: &Self::Buf, a: &Self::Buf, b: &Self::Buf, scale: f32, m: usize, k: usize, r: usize, n_out: usize, out: &mut Self::Buf, col0: usize, ld: usize) -> Result<()>;
    /// Rotate the q and k parts of the fused `qkv [rows, qkv_dim]` in place (HF's rotate_half
    /// convention) at `positions[row]`, with `inv_freq` (`head_dim/2`).
    fn rope(&self, qkv: &mut Self::Buf, positions: &[u32], inv_freq: &[f32], geom: AttnGeom) -> Result<()>;
    /// Store the k and v parts of `qkv` rows into the cache of `layer` at `slots[row]`.
    fn kv_store(&self, kv: &mut Self::Kv, layer: usize, qkv: &Self::Buf, slots: &[u32], geom: AttnGeom) -> Result<()>;
    /// Causal attention of each sequence's query rows over its cached keys/values (GQA):
    /// `out [rows, q_dim]`.
    fn attention(&self, kv: &Self::Kv, layer: usize, qkv: &Self::Buf, seqs: &[AttnSeq], geom: AttnGeom, out: &mut Self::Buf) -> Result<()>;
    /// `out[m, i] = silu(gate) · up` from `gate_up [m, 2i]`.
    fn swiglu(&self, gate_up: &Self::Buf, m: usize, i: usize, out: &mut Self::Buf) -> Result<()>;
    /// Log-probability of `targets[row]` under `softmax(h[row] · headᵀ)`, `h [rows, d]`, without
    /// materializing `[rows, vocab]` logits (vocab tiles, online log-sum-exp).
    fn logprobs(&self, h: &Self::Buf, head: &Self::Buf, targets: &[u32], d: usize, vocab: usize) -> Result<Vec<f32>>;
    /// Pick one token per row of `logits [rows, vocab]`; `uniform[row]` in [0,1) drives the draw.
    fn sample(&self, logits: &Self::Buf, vocab: usize, params: &[SampleParams], uniform: &[f64]) -> Result<Vec<Sampled>>;
}

/// Run `f` and return its result with its duration in seconds as the device sees it: `sync`
/// (the backend's `synchronize`) runs before the clock starts, so earlier enqueued work is not
/// counted, and before it stops, so work `f` only enqueued is — PyTorch's benchmarks time the
/// same way (`torch.cuda.synchronize()` on both sides).
pub fn timed<T>(sync: impl Fn() -> Result<()>, f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    sync()?;
    let t = std::time::Instant::now();
    let out = f()?;
    sync()?;
    Ok((out, t.elapsed().as_secs_f64()))
}

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod train;

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    /// A device still busy for 300 ms when `timed` starts, whose op's work finishes 60 ms after `f` returns: `timed` must count it
    /// (the clock stops after `synchronize`), and must not count work enqueued before it starts.
    #[test]
    fn timed_waits_for_enqueued_work() {
        let busy_until = Cell::new(Instant::now() + Duration::from_millis(300)); // earlier work
        let sync = || {
            let now = Instant::now();
            if busy_until.get() > now {
                std::thread::sleep(busy_until.get() - now);
            }
            Ok(())
        };
        let ((), secs) = timed(sync, || {
            busy_until.set(Instant::now() + Duration::from_millis(60)); // an op that returns at once
            Ok(())
        })
        .unwrap();
        assert!((0.055..0.3).contains(&secs), "{secs} s: the 60 ms of enqueued work, not the 300 ms before");
        // an error of the device surfaces instead of a timing
        assert!(timed(|| anyhow::bail!("an earlier kernel failed"), || Ok(())).is_err());
    }
}
