//! The extra ops LoRA training needs on top of [`Backend`]: a dense attention forward that keeps
//! the per-row log-sum-exp, the backward of every op of the transformer block (base weights,
//! norms and embeddings frozen: only input gradients, plus dA/dB of the LoRA pairs), the fused
//! head backward in vocabulary tiles, and the optimizer arithmetic (squared norms, scaling, AdamW).
//!
//! Same flavor as [`Backend`]: bulk data in `Self::Buf`, small metadata as host slices, row-major
//! layouts (module doc of `backend`). Additional layouts used here:
//! - a *dense batch* is sequences concatenated along the rows (`DenseSeq`: rows
//!   `row0 .. row0 + len`, positions `0 .. len`); no KV cache, every sequence attends causally to
//!   its own rows only;
//! - `lse [rows, n_heads]`: log-sum-exp of the scaled scores of each query row and head, from the
//!   attention forward, so the backward recomputes probabilities without a `[T, T]` matrix;
//! - gradients have the layout of the tensor they belong to (`dqkv` like `qkv`, `dA` like `A`).
//!
//! The CPU twins are plain functions in `train/cpu.rs`; a CUDA backend implements the same ops
//! as kernels and is checked against them.
pub mod cpu;

use super::cpu::CpuBackend;
use super::{AttnGeom, Backend};
use anyhow::{ensure, Result};

/// One sequence of a dense batch: rows `row0 .. row0 + len`, at positions `0 .. len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenseSeq {
    pub row0: usize,
    pub len: usize,
}

/// Per-row results of the fused head pass.
#[derive(Clone, Debug, Default)]
pub struct HeadOut {
    /// `log softmax(h·headᵀ)[target]`
    pub logprobs: Vec<f32>,
    /// Entropy (nats) of the row's next-token distribution.
    pub entropy: Vec<f32>,
}

/// One AdamW step (PyTorch's `torch.optim.AdamW` semantics: decoupled weight decay applied as
/// `p ← p·(1 − lr·wd)` before the Adam update, bias-corrected moments).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count (for the bias corrections).
    pub step: u64,
    /// Multiplies the gradient before use (gradient clipping, loss scaling); 1 = unchanged.
    pub grad_scale: f32,
}

pub trait TrainBackend: Backend {
    /// `dst = src` (same length).
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf) -> Result<()>;

    /// Bytes the backward may spend keeping layers' activations (and merged weights) from the
    /// forward instead of recomputing them, besides the `working_set` bytes the pass allocates
    /// with every layer recomputed. 0 (the default) recomputes every layer. Gradients are
    /// bit-identical either way; `INFOMEM_KEEP_ACTIVATIONS_MB` overrides every backend's choice.
    fn keep_activation_bytes(&self, working_set: usize) -> Result<usize> {
        let _ = working_set;
        Ok(keep_override()?.unwrap_or(0))
    }

    // ---- forward ----
    /// Fold a LoRA pair into (a copy of) a frozen weight: `w[row0 + o, :] += scale · Σ_j b[o, j]·a[j, :]`
    /// for `o < n_out`; `w` rows of `k`, `a [r, k]`, `b [n_out, r]`. The training passes run on
    /// these merged weights (`y = x (W + scale·B A)ᵀ`, `dx = dy (W + scale·B A)`), which costs one
    /// small GEMM per layer instead of thin rank-r GEMMs over every row of the batch.
    #[allow(clippy::too_many_arguments)]
    fn lora_merge(&self, w: &mut Self::Buf, row0: usize, a: &Self::Buf, b: &Self::Buf, scale: f32, k: usize, r: usize, n_out: usize) -> Result<()>;
    /// Causal GQA attention over a dense batch: `qkv [rows, qkv_dim]` (q and k already rotated)
    /// → `out [rows, q_dim]` and `lse [rows, n_heads]` (natural log of Σ exp of the scaled scores,
    /// `1/sqrt(head_dim)` scaling). Only a tile of scores exists at a time.
    fn attn_dense(&self, qkv: &Self::Buf, seqs: &[DenseSeq], geom: AttnGeom, out: &mut Self::Buf, lse: &mut Self::Buf) -> Result<()>;

    // ---- backward ----
    /// Backward of `attn_dense`: given its inputs/outputs and `dout [rows, q_dim]`, overwrite
    /// `dqkv [rows, qkv_dim]` (every row of `seqs`) with dq, dk, dv (w.r.t. the rotated q, k).
    /// dk/dv of a kv head sum the contributions of all query heads of its group.
    #[allow(clippy::too_many_arguments)]
    fn attn_dense_bwd(
        &self,
        qkv: &Self::Buf,
        out: &Self::Buf,
        dout: &Self::Buf,
        lse: &Self::Buf,
        seqs: &[DenseSeq],
        geom: AttnGeom,
        dqkv: &mut Self::Buf,
    ) -> Result<()>;
    /// Backward of `rmsnorm` w.r.t. its input (the weight is frozen): `dx (+)= ∂(x/rms(x)·w)/∂x ᵀ dy`,
    /// rows of `d`; accumulates into `dx` when `accumulate`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_bwd(&self, x: &Self::Buf, w: &Self::Buf, dy: &Self::Buf, eps: f32, rows: usize, d: usize, dx: &mut Self::Buf, accumulate: bool) -> Result<()>;
    /// Backward of `rope`: the inverse rotation of the q and k parts of `dqkv` in place (v untouched).
    fn rope_bwd(&self, dqkv: &mut Self::Buf, positions: &[u32], inv_freq: &[f32], geom: AttnGeom) -> Result<()>;
    /// Backward of `swiglu`: `dgate_up [m, 2i]` (overwritten) from `gate_up [m, 2i]` and `dact [m, i]`.
    fn swiglu_bwd(&self, gate_up: &Self::Buf, dact: &Self::Buf, m: usize, i: usize, dgate_up: &mut Self::Buf) -> Result<()>;
    /// Input gradient of a frozen projection `y = x wᵀ`: `dx[m, k] (+)= dy[m, n] · w[n, k]`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_dx(&self, dy: &Self::Buf, w: &Self::Buf, m: usize, n: usize, k: usize, dx: &mut Self::Buf, accumulate: bool) -> Result<()>;
    /// Backward of `Backend::lora` (`y[:, col0..col0+n_out] += scale·(x Aᵀ) Bᵀ`, `y` rows of `ld`):
    /// with `dy` the gradient of the whole `y` (rows of `ld`), accumulate
    /// `dA [r, k] += scale·(dy_s B)ᵀ x`, `dB [n_out, r] += scale·dy_sᵀ (x Aᵀ)` and, when given,
    /// `dx [m, k] += scale·(dy_s B) A`, where `dy_s` is the column slice.
    #[allow(clippy::too_many_arguments)]
    fn lora_bwd(
        &self,
        x: &Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        scale: f32,
        m: usize,
        k: usize,
        r: usize,
        n_out: usize,
        dy: &Self::Buf,
        col0: usize,
        ld: usize,
        da: &mut Self::Buf,
        db: &mut Self::Buf,
        dx: Option<&mut Self::Buf>,
    ) -> Result<()>;
    /// The fused head pass of training, in vocabulary tiles with an online softmax (never a
    /// `[rows, vocab]` matrix): per row of `h [rows, d]`, the log-probability of `targets[row]`,
    /// the entropy, and `g [rows, d] = Σ_v p_v head_v − head_target`, the gradient of
    /// `log p(target)` w.r.t. `h` with the sign flipped (`∂logp/∂h = −g`).
    fn head_grad(&self, h: &Self::Buf, head: &Self::Buf, targets: &[u32], d: usize, vocab: usize, g: &mut Self::Buf) -> Result<HeadOut>;
    /// `x[row] *= coef[row]`, rows of `d`.
    fn scale_rows(&self, x: &mut Self::Buf, coef: &[f32], d: usize) -> Result<()>;
    /// `dst[rows[i]] += src[i]`, rows of `d` (`rows` distinct).
    fn scatter_add_rows(&self, src: &Self::Buf, rows: &[u32], d: usize, dst: &mut Self::Buf) -> Result<()>;

    // ---- optimizer arithmetic ----
    /// `Σ x²`, accumulated in f64.
    fn sum_squares(&self, x: &Self::Buf) -> Result<f64>;
    /// `x *= s`.
    fn scale(&self, x: &mut Self::Buf, s: f32) -> Result<()>;
    /// `acc += x` (same length).
    fn accumulate(&self, acc: &mut Self::Buf, x: &Self::Buf) -> Result<()>;
    /// One AdamW update of parameters `p` with gradient `g` and moments `m`, `v` (same length).
    fn adamw(&self, p: &mut Self::Buf, g: &Self::Buf, m: &mut Self::Buf, v: &mut Self::Buf, h: AdamWStep) -> Result<()>;
}

/// `INFOMEM_KEEP_ACTIVATIONS_MB` in bytes, if set (a malformed value is an error, never a
/// silent default).
pub fn keep_override() -> Result<Option<usize>> {
    match std::env::var("INFOMEM_KEEP_ACTIVATIONS_MB") {
        Ok(v) => {
            let mb: usize = v.trim().parse().map_err(|_| anyhow::anyhow!("INFOMEM_KEEP_ACTIVATIONS_MB={v:?} is not a whole number of MiB (0 recomputes every layer)"))?;
            let bytes = mb.checked_mul(1 << 20).ok_or_else(|| anyhow::anyhow!("INFOMEM_KEEP_ACTIVATIONS_MB={v:?} is too large"))?;
            Ok(Some(bytes))
        }
        Err(_) => Ok(None),
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
        if let Some(b) = keep_override()? {
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
        cpu::lora_merge(w, row0, a, b, scale, k, r, n_out);
        Ok(())
    }
    fn attn_dense(&self, qkv: &Vec<f32>, seqs: &[DenseSeq], g: AttnGeom, out: &mut Vec<f32>, lse: &mut Vec<f32>) -> Result<()> {
        check_seqs(seqs, qkv.len(), g.qkv_dim())?;
        cpu::attn_dense(qkv, seqs, g, out, lse);
        Ok(())
    }
    fn attn_dense_bwd(&self, qkv: &Vec<f32>, out: &Vec<f32>, dout: &Vec<f32>, lse: &Vec<f32>, seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut Vec<f32>) -> Result<()> {
        check_seqs(seqs, qkv.len(), g.qkv_dim())?;
        cpu::attn_dense_bwd(qkv, out, dout, lse, seqs, g, dqkv);
        Ok(())
    }
    fn rmsnorm_bwd(&self, x: &Vec<f32>, w: &Vec<f32>, dy: &Vec<f32>, eps: f32, rows: usize, d: usize, dx: &mut Vec<f32>, accumulate: bool) -> Result<()> {
        cpu::rmsnorm_bwd(x, w, dy, eps, rows, d, dx, accumulate);
        Ok(())
    }
    fn rope_bwd(&self, dqkv: &mut Vec<f32>, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        super::cpu::ops::rope_qkv(dqkv, positions, inv_freq, g.n_heads, g.n_kv_heads, g.head_dim, -1.0);
        Ok(())
    }
    fn swiglu_bwd(&self, gate_up: &Vec<f32>, dact: &Vec<f32>, m: usize, i: usize, dgate_up: &mut Vec<f32>) -> Result<()> {
        cpu::swiglu_bwd(gate_up, dact, m, i, dgate_up);
        Ok(())
    }
    fn matmul_dx(&self, dy: &Vec<f32>, w: &Vec<f32>, m: usize, n: usize, k: usize, dx: &mut Vec<f32>, accumulate: bool) -> Result<()> {
        cpu::matmul_dx(dy, w, m, n, k, dx, accumulate);
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
        cpu::lora_bwd(x, a, b, scale, m, k, r, n_out, dy, col0, ld, da, db, dx.map(|v| v.as_mut_slice()));
        Ok(())
    }
    fn head_grad(&self, h: &Vec<f32>, head: &Vec<f32>, targets: &[u32], d: usize, vocab: usize, g: &mut Vec<f32>) -> Result<HeadOut> {
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!("head_grad: target id {t} is outside the vocabulary (size {vocab})");
        }
        Ok(cpu::head_grad(h, head, targets, d, vocab, g))
    }
    fn scale_rows(&self, x: &mut Vec<f32>, coef: &[f32], d: usize) -> Result<()> {
        for (row, &c) in x.chunks_exact_mut(d).zip(coef) {
            for v in row {
                *v *= c;
            }
        }
        Ok(())
    }
    fn scatter_add_rows(&self, src: &Vec<f32>, rows: &[u32], d: usize, dst: &mut Vec<f32>) -> Result<()> {
        for (s, &r) in src.chunks_exact(d).zip(rows) {
            let r = r as usize;
            for (a, b) in dst[r * d..(r + 1) * d].iter_mut().zip(s) {
                *a += b;
            }
        }
        Ok(())
    }
    fn sum_squares(&self, x: &Vec<f32>) -> Result<f64> {
        Ok(x.iter().map(|&v| v as f64 * v as f64).sum())
    }
    fn scale(&self, x: &mut Vec<f32>, s: f32) -> Result<()> {
        x.iter_mut().for_each(|v| *v *= s);
        Ok(())
    }
    fn accumulate(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        ensure!(acc.len() == x.len(), "accumulate: {} elements into {}", x.len(), acc.len());
        super::cpu::ops::add(acc, x);
        Ok(())
    }
    fn adamw(&self, p: &mut Vec<f32>, g: &Vec<f32>, m: &mut Vec<f32>, v: &mut Vec<f32>, h: AdamWStep) -> Result<()> {
        ensure!(p.len() == g.len() && p.len() == m.len() && p.len() == v.len(), "adamw: buffers of different lengths");
        cpu::adamw(p, g, m, v, h);
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
