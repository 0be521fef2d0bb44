//! Manual backward through the transformer for the LoRA parameters (llm.c style: every layer's
//! forward and backward written out as plain steps over `TrainBackend` ops).
//!
//! A training batch is a list of (prompt, response) pairs processed as **one dense batch**: the
//! sequences `prompt ++ response[..len-1]` are concatenated along the rows, positions restart at 0
//! for each, attention is causal within each sequence, and there is no KV cache. Row
//! `prompt.len() - 1 + t` of a sequence predicts `response[t]`; the last response token is never
//! fed (nothing is scored after it).
//!
//! Memory: the forward keeps each layer's input residual `[rows, hidden]`, and for the top layers
//! that fit the backend's budget (`TrainBackend::keep_activation_bytes`) also what their backward
//! needs (rotated qkv, attention output and log-sum-exp, gate/up, the residual after attention,
//! the merged weights). The backward walks the layers top-down; a layer that kept nothing first
//! **recomputes** its intermediates from its input residual (norms, projections with LoRA, RoPE,
//! attention with its log-sum-exp, SwiGLU; not the down projection, whose output the backward
//! does not need), then back-propagates through it. Base weights, norms and embeddings are
//! frozen: only input gradients flow through them, and only the LoRA A/B of every targeted
//! projection get gradient buffers. Cost: two (all layers kept) to three (none kept) forward
//! passes of GEMMs plus ~2.5× the attention for its backward. On the CPU the budget is a third of
//! the available memory (≤ 8 GiB): 8 × 512 rows of SmolLM2-135M keep all 30 layers in 2.9 GB.
//!
//! LoRA inside the passes: each layer's LoRA pairs are folded into scratch copies of its frozen
//! weights, `W' = W + scale·B A` (one small GEMM per pair and layer, redone in the forward and in
//! the backward), so every projection is one large GEMM and its input gradient is `dy·W'`. The
//! pairs' own gradients come from `TrainBackend::lora_bwd` on the layer's saved inputs:
//! `dB = scale·dyᵀ(x Aᵀ)`, `dA = scale·(dy B)ᵀ x`.
//!
//! The loss is supplied by the caller as a function of the response tokens' log-probabilities
//! (and entropies) returning `∂loss/∂logp` per token (`rl::grpo` builds the GRPO one on this).
use super::model::Model;
use crate::backend::{DenseSeq, TrainBackend};
use crate::backend::Backend;
use crate::model::lora::{Proj, ALL_PROJS};
use crate::model::weights::HostTensor;
use crate::util::prof;
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;

/// One (prompt, response) pair: the response tokens are scored given the prompt.
#[derive(Clone, Copy, Debug)]
pub struct TrainSeq<'a> {
    pub prompt: &'a [u32],
    pub response: &'a [u32],
}

/// Which policy a forward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The model with its LoRA adapter (when one is attached and enabled).
    Current,
    /// The base model, LoRA switched off (GRPO's reference policy).
    Reference,
}

/// Row layout of a dense batch.
#[derive(Clone, Debug, Default)]
pub struct DenseBatch {
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub seqs: Vec<DenseSeq>,
    /// Rows whose output predicts a response token, sequence by sequence.
    pub loss_rows: Vec<u32>,
    /// The token each of `loss_rows` predicts.
    pub targets: Vec<u32>,
    /// `loss_rows[token_offsets[i]..token_offsets[i + 1]]` belong to input sequence `i`.
    pub token_offsets: Vec<usize>,
}

impl DenseBatch {
    /// Lay out `seqs`; ids are checked against `vocab`. A sequence with an empty response adds no
    /// rows; one with a response needs a non-empty prompt.
    pub fn new(vocab: usize, seqs: &[TrainSeq]) -> Result<Self> {
        let mut b = DenseBatch { token_offsets: vec![0], ..Default::default() };
        for (i, s) in seqs.iter().enumerate() {
            for (field, ids) in [("prompt", s.prompt), ("response", s.response)] {
                if let Some(j) = ids.iter().position(|&t| t as usize >= vocab) {
                    bail!("sequence {i}: {field}[{j}] = {} is outside the vocabulary (size {vocab})", ids[j]);
                }
            }
            if !s.response.is_empty() {
                if s.prompt.is_empty() {
                    bail!("sequence {i}: empty prompt (the first response token needs a context to be predicted from)");
                }
                let row0 = b.ids.len();
                let len = s.prompt.len() + s.response.len() - 1;
                b.ids.extend_from_slice(s.prompt);
                b.ids.extend_from_slice(&s.response[..s.response.len() - 1]);
                b.positions.extend(0..len as u32);
                b.seqs.push(DenseSeq { row0, len });
                for (t, &tok) in s.response.iter().enumerate() {
                    b.loss_rows.push((row0 + s.prompt.len() - 1 + t) as u32);
                    b.targets.push(tok);
                }
            }
            b.token_offsets.push(b.loss_rows.len());
        }
        Ok(b)
    }

    pub fn rows(&self) -> usize {
        self.ids.len()
    }

    /// Cut a flat per-token vector into per-sequence vectors.
    pub fn split(&self, flat: &[f32]) -> Vec<Vec<f32>> {
        self.token_offsets.windows(2).map(|w| flat[w[0]..w[1]].to_vec()).collect()
    }
}

/// `(dA, dB)` of each projection of one layer, indexed by `Proj::index`.
pub type LayerGrads<B> = [Option<(<B as Backend>::Buf, <B as Backend>::Buf)>; 7];

/// Gradients of the loss w.r.t. every LoRA pair: `layers[l][proj.index()] = (dA [r, in], dB [out, r])`.
pub struct LoraGrads<B: Backend> {
    pub layers: Vec<LayerGrads<B>>,
}

impl<B: TrainBackend> LoraGrads<B> {
    /// Zero gradients shaped like the model's adapter.
    pub fn zeros(model: &Model<B>) -> Result<Self> {
        let lora = model.lora.as_ref().context("the model has no LoRA adapter: nothing to train")?;
        let mut layers = Vec::with_capacity(lora.layers.len());
        for row in &lora.host.layers {
            let mut g: LayerGrads<B> = Default::default();
            for p in ALL_PROJS {
                if let Some(pair) = &row[p.index()] {
                    g[p.index()] = Some((model.be.zeros(pair.a.data.len())?, model.be.zeros(pair.b.data.len())?));
                }
            }
            layers.push(g);
        }
        Ok(LoraGrads { layers })
    }

    /// `self += other` (gradient accumulation over micro-batches).
    pub fn add(&mut self, be: &B, other: &Self) -> Result<()> {
        for (a, b) in self.layers.iter_mut().zip(&other.layers) {
            for (x, y) in a.iter_mut().zip(b) {
                if let (Some((xa, xb)), Some((ya, yb))) = (x, y) {
                    be.accumulate(xa, ya)?;
                    be.accumulate(xb, yb)?;
                }
            }
        }
        Ok(())
    }

    /// Σ of squared entries over all tensors (the squared global gradient norm).
    pub fn sum_squares(&self, be: &B) -> Result<f64> {
        let mut s = 0.0;
        for (a, b) in self.layers.iter().flatten().flatten() {
            s += be.sum_squares(a)? + be.sum_squares(b)?;
        }
        Ok(s)
    }

    pub fn scale(&mut self, be: &B, f: f32) -> Result<()> {
        for (a, b) in self.layers.iter_mut().flatten().flatten() {
            be.scale(a, f)?;
            be.scale(b, f)?;
        }
        Ok(())
    }

    /// Host copies under PEFT's key names (`base_model.model.model.layers.{l}.…lora_A.weight`,
    /// no `.default`), shaped like the adapter's tensors.
    pub fn to_peft(&self, model: &Model<B>) -> Result<BTreeMap<String, HostTensor>> {
        let lora = model.lora.as_ref().context("the model has no LoRA adapter")?;
        let mut m = BTreeMap::new();
        for (l, (row, host)) in self.layers.iter().zip(&lora.host.layers).enumerate() {
            for p in ALL_PROJS {
                if let (Some((ga, gb)), Some(pair)) = (&row[p.index()], &host[p.index()]) {
                    m.insert(p.peft_key(l, 'A'), HostTensor::new(pair.a.shape.clone(), model.be.download(ga)?));
                    m.insert(p.peft_key(l, 'B'), HostTensor::new(pair.b.shape.clone(), model.be.download(gb)?));
                }
            }
        }
        Ok(m)
    }
}

/// Per-token outputs of the policy on the response tokens, one vector per input sequence.
#[derive(Clone, Debug, Default)]
pub struct TokenScores {
    pub logprobs: Vec<Vec<f32>>,
    pub entropy: Vec<Vec<f32>>,
}

/// A layer's intermediates over the dense batch (reused across layers).
struct Acts<B: Backend> {
    h1: B::Buf,
    /// The projections' output before Qwen3's q/k norm (the norm's backward needs it); `None`
    /// for architectures without one.
    qkv_pre: Option<B::Buf>,
    qkv: B::Buf,
    att: B::Buf,
    lse: B::Buf,
    o: B::Buf,
    h2: B::Buf,
    gu: B::Buf,
    act: B::Buf,
}

impl<B: TrainBackend> Acts<B> {
    fn new(model: &Model<B>, n: usize) -> Result<Self> {
        let c = &model.cfg;
        let be = &model.be;
        // Safety: `layer_fwd_inner` writes each whole before it reads it (the norms, products,
        // attention and SwiGLU in order; `o` by the o and down products), and the backward's
        // kept layers write h1, h2 and (LoRA merged) act again before use; with LoRA unmerged
        // the backward does not read act (the down pairs form it from gate/up)
        let s = |n: usize| unsafe { be.scratch(n) };
        Ok(Acts {
            h1: s(n * c.hidden)?,
            qkv_pre: if c.qk_norm { Some(s(n * (c.q_dim() + 2 * c.kv_dim()))?) } else { None },
            qkv: s(n * (c.q_dim() + 2 * c.kv_dim()))?,
            att: s(n * c.q_dim())?,
            lse: s(n * c.n_heads)?,
            o: s(n * c.hidden)?,
            h2: s(n * c.hidden)?,
            gu: s(n * 2 * c.intermediate)?,
            act: s(n * c.intermediate)?,
        })
    }
}

/// One layer's frozen weights as a pass uses them: the base tensors, or scratch copies with the
/// policy's LoRA pairs folded in (`W + scale·B A`, see `TrainBackend::lora_merge`).
struct LayerW<'a, B: Backend> {
    attn_norm: &'a B::Buf,
    qkv: &'a B::Buf,
    qkv_bias: Option<&'a B::Buf>,
    qk_norm: Option<(&'a B::Buf, &'a B::Buf)>,
    o: &'a B::Buf,
    o_bias: Option<&'a B::Buf>,
    /// `Some(l)`: the weights are the frozen ones and layer `l`'s LoRA pairs are applied as
    /// separate low-rank products (`TrainBackend::lora_unmerged`); `None`: merged (or no LoRA).
    lora_layer: Option<usize>,
    mlp_norm: &'a B::Buf,
    gate_up: &'a B::Buf,
    down: &'a B::Buf,
}

/// Scratch for merged weights: slot 0 is reused layer after layer; a layer whose activations
/// the backward keeps also keeps its merged weights in slot `1 + l`, so they are merged once.
struct Merged<B: Backend> {
    slots: Vec<Option<([B::Buf; 4], [bool; 4])>>,
    /// The backend keeps LoRA unmerged (`TrainBackend::lora_unmerged`); then `policy` says
    /// whether the passes add the deltas.
    lazy: bool,
    policy: Policy,
}

impl<B: TrainBackend> Merged<B> {
    fn new(model: &Model<B>) -> Self {
        Merged { slots: (0..=model.cfg.n_layers).map(|_| None).collect(), lazy: model.be.lora_unmerged(), policy: Policy::Current }
    }

    /// Bytes one slot holds (f32 on the CPU, the only backend that keeps slots); none when the
    /// backend keeps LoRA unmerged (`merge` then allocates no slot).
    fn slot_bytes(model: &Model<B>) -> usize {
        let be = &model.be;
        if be.lora_unmerged() {
            return 0;
        }
        let w = &model.layers[0];
        4 * (be.len(&w.qkv) + be.len(&w.o) + be.len(&w.gate_up) + be.len(&w.down))
    }

    /// Merge layer `l`'s LoRA pairs under `policy` into copies of its weights in `slot`.
    fn merge(&mut self, model: &Model<B>, policy: Policy, l: usize, slot: usize) -> Result<()> {
        self.policy = policy;
        if self.lazy {
            return Ok(()); // the passes apply the pairs themselves (LayerW::lora_layer)
        }
        let be = &model.be;
        let c = &model.cfg;
        let w = &model.layers[l];
        let (q_dim, kv_dim, inter) = (c.q_dim(), c.kv_dim(), c.intermediate);
        let pair = |p: Proj| match policy {
            Policy::Current => model.lora_pair(l, p),
            Policy::Reference => None,
        };
        // (matrix index, base, [(proj, first row)])
        type Group<'g, Buf> = (usize, &'g Buf, &'g [(Proj, usize)]);
        let groups: [Group<B::Buf>; 4] = [
            (0, &w.qkv, &[(Proj::Q, 0), (Proj::K, q_dim), (Proj::V, q_dim + kv_dim)]),
            (1, &w.o, &[(Proj::O, 0)]),
            (2, &w.gate_up, &[(Proj::Gate, 0), (Proj::Up, inter)]),
            (3, &w.down, &[(Proj::Down, 0)]),
        ];
        let mut merged = [false; 4];
        for (i, base, projs) in groups {
            if projs.iter().all(|&(p, _)| pair(p).is_none()) {
                continue;
            }
            if self.slots[slot].is_none() {
                let bufs = [be.zeros(be.len(&w.qkv))?, be.zeros(be.len(&w.o))?, be.zeros(be.len(&w.gate_up))?, be.zeros(be.len(&w.down))?];
                self.slots[slot] = Some((bufs, [false; 4]));
            }
            let dst = &mut self.slots[slot].as_mut().unwrap().0[i];
            be.copy(base, dst)?;
            for &(p, row0) in projs {
                if let Some((a, b, scale, r)) = pair(p) {
                    let (din, dout) = p.dims(c);
                    be.lora_merge(dst, row0, a, b, scale, din, r, dout)?;
                }
            }
            merged[i] = true;
        }
        if let Some((_, flags)) = self.slots[slot].as_mut() {
            *flags = merged;
        }
        Ok(())
    }

    /// The weights of layer `l` as last merged into `slot` (base tensors where nothing merged).
    fn get<'a>(&'a self, model: &'a Model<B>, l: usize, slot: usize) -> LayerW<'a, B> {
        let w = &model.layers[l];
        let pick = |i: usize, base: &'a B::Buf| -> &'a B::Buf {
            match &self.slots[slot] {
                Some((b, m)) if m[i] => &b[i],
                _ => base,
            }
        };
        LayerW {
            attn_norm: &w.attn_norm,
            qkv: pick(0, &w.qkv),
            qkv_bias: w.qkv_bias.as_ref(),
            qk_norm: w.qk_norm.as_ref().map(|(q, k)| (q, k)),
            o: pick(1, &w.o),
            o_bias: w.o_bias.as_ref(),
            lora_layer: (self.lazy && self.policy == Policy::Current).then_some(l),
            mlp_norm: &w.mlp_norm,
            gate_up: pick(2, &w.gate_up),
            down: pick(3, &w.down),
        }
    }
}

/// What the backward needs of a layer beyond its input residual, kept from the forward when the
/// backend's budget allows (`TrainBackend::keep_activation_bytes`): the rotated qkv, the attention
/// output and its log-sum-exp, gate/up, and the residual after attention. The norms' outputs and
/// SwiGLU are cheap and recomputed from these, with the same arithmetic as in the forward (with
/// LoRA unmerged SwiGLU is not recomputed into a buffer at all: the down pairs form it from
/// gate/up where they read it, `TrainBackend::matmul_dx_lora_swiglu`).
struct Kept<B: Backend> {
    qkv_pre: Option<B::Buf>,
    qkv: B::Buf,
    att: B::Buf,
    lse: B::Buf,
    gu: B::Buf,
    xm: B::Buf,
}

impl<B: TrainBackend> Kept<B> {
    /// Bytes kept per batch row (every `zeros(n)` reserves 4·n bytes on either backend).
    fn bytes_per_row(model: &Model<B>) -> usize {
        let c = &model.cfg;
        let qkv = c.q_dim() + 2 * c.kv_dim();
        let pre = if c.qk_norm { qkv } else { 0 };
        4 * (pre + qkv + c.q_dim() + c.n_heads + 2 * c.intermediate + c.hidden)
    }
}

/// One decoder layer forward over the dense batch with weights `w`. `x` is the layer input; on
/// return it is the layer output (`full`) or the residual after attention, `x + o` (`!full`: the
/// recompute of the backward, which needs no down projection). `a` receives every intermediate.
fn layer_fwd<B: TrainBackend>(model: &Model<B>, w: &LayerW<B>, batch: &DenseBatch, x: &mut B::Buf, a: &mut Acts<B>, full: bool) -> Result<()> {
    layer_fwd_inner(model, w, batch, x, a, full, None)
}

/// [`layer_fwd`], also copying the residual after attention into `xm` when given.
#[allow(clippy::too_many_arguments)]
fn layer_fwd_inner<B: TrainBackend>(model: &Model<B>, w: &LayerW<B>, batch: &DenseBatch, x: &mut B::Buf, a: &mut Acts<B>, full: bool, xm: Option<&mut B::Buf>) -> Result<()> {
    let be = &model.be;
    let c = &model.cfg;
    let g = model.geom();
    let n = batch.rows();
    let (d, inter, q_dim, kv_dim) = (c.hidden, c.intermediate, c.q_dim(), c.kv_dim());
    let qkv_dim = q_dim + 2 * kv_dim;
    // attention block
    be.rmsnorm(x, w.attn_norm, c.rms_eps, n, d, &mut a.h1)?;
    let ls = |projs: &[(Proj, usize)]| w.lora_layer.map_or(Vec::new(), |l| model.lora_slices(l, projs));
    prof::time("train_matmul", || be.matmul_lora(&a.h1, w.qkv, w.qkv_bias, n, d, qkv_dim, &mut a.qkv, &ls(&[(Proj::Q, 0), (Proj::K, q_dim), (Proj::V, q_dim + kv_dim)])))?;
    match (w.qk_norm, a.qkv_pre.as_mut()) {
        (Some((qn, kn)), Some(pre)) => {
            be.copy(&a.qkv, pre)?;
            be.qk_norm_rope(&mut a.qkv, qn, kn, c.rms_eps, &batch.positions, &model.inv_freq, g)?;
        }
        (None, _) => be.rope(&mut a.qkv, &batch.positions, &model.inv_freq, g)?,
        (Some(_), None) => bail!("internal: a q/k-norm layer without its pre-norm buffer"),
    }
    prof::time("train_attn", || be.attn_dense(&a.qkv, &batch.seqs, g, &mut a.att, &mut a.lse))?;
    prof::time("train_matmul", || be.matmul_lora(&a.att, w.o, w.o_bias, n, q_dim, d, &mut a.o, &ls(&[(Proj::O, 0)])))?;
    // x ← x + o; h2 = rmsnorm(x)
    be.add_rmsnorm(x, &a.o, w.mlp_norm, c.rms_eps, n, d, &mut a.h2)?;
    if let Some(xm) = xm {
        be.copy(x, xm)?;
    }
    // MLP block
    prof::time("train_matmul", || be.matmul_lora(&a.h2, w.gate_up, None, n, d, 2 * inter, &mut a.gu, &ls(&[(Proj::Gate, 0), (Proj::Up, inter)])))?;
    // the backward's recompute with LoRA unmerged forms the down pairs' input from gate/up
    // itself (`matmul_dx_lora_swiglu`): act is not needed then
    if full || w.lora_layer.is_none() {
        be.swiglu(&a.gu, n, inter, &mut a.act)?;
    }
    if full {
        prof::time("train_matmul", || be.matmul_lora(&a.act, w.down, None, n, inter, d, &mut a.o, &ls(&[(Proj::Down, 0)])))?;
        be.add(x, &a.o, n * d)?;
    }
    Ok(())
}

/// The final norm of the loss rows: returns (selected residual rows, normed rows).
fn final_rows<B: TrainBackend>(model: &Model<B>, x: &B::Buf, rows: &[u32]) -> Result<(B::Buf, B::Buf)> {
    let be = &model.be;
    let d = model.cfg.hidden;
    let m = rows.len();
    let mut sel = be.zeros(m * d)?;
    let mut hn = be.zeros(m * d)?;
    be.gather_rows(x, rows, d, &mut sel)?;
    be.rmsnorm(&sel, &model.final_norm, model.cfg.rms_eps, m, d, &mut hn)?;
    Ok((sel, hn))
}

/// Log-probabilities of every response token under `policy`, without gradients (old/reference
/// log-probs for GRPO). Same dense forward as training.
pub fn response_logprobs<B: TrainBackend>(model: &Model<B>, seqs: &[TrainSeq], policy: Policy) -> Result<Vec<Vec<f32>>> {
    let batch = DenseBatch::new(model.cfg.vocab, seqs)?;
    let n = batch.rows();
    if n == 0 {
        return Ok(seqs.iter().map(|_| Vec::new()).collect());
    }
    let be = &model.be;
    let d = model.cfg.hidden;
    let mut x = be.zeros(n * d)?;
    be.embed(&model.embed, &batch.ids, d, &mut x)?;
    let mut acts = Acts::new(model, n)?;
    let mut merged = Merged::new(model);
    for l in 0..model.cfg.n_layers {
        merged.merge(model, policy, l, 0)?;
        layer_fwd(model, &merged.get(model, l, 0), &batch, &mut x, &mut acts, true)?;
    }
    drop(acts);
    let (_, hn) = final_rows(model, &x, &batch.loss_rows)?;
    let lp = prof::time("train_head", || be.logprobs(&hn, model.head(), &batch.targets, d, model.cfg.vocab))?;
    Ok(batch.split(&lp))
}

/// Forward + backward of a loss on the response tokens' log-probabilities.
///
/// `loss` gets the current policy's log-probabilities and entropies of every response token and
/// returns its statistics and `∂loss/∂logp` per token (same shape). Returns those statistics
/// and the gradients of every LoRA A/B (fresh buffers; add them up with [`LoraGrads::add`] for
/// gradient accumulation).
pub fn policy_grads<B: TrainBackend, S>(
    model: &Model<B>,
    seqs: &[TrainSeq],
    loss: impl FnOnce(&TokenScores) -> Result<(S, Vec<Vec<f32>>)>,
) -> Result<(S, LoraGrads<B>)> {
    let per_layer = |rows: usize| rows * Kept::<B>::bytes_per_row(model) + Merged::<B>::slot_bytes(model);
    let n_keep = |rows: usize| -> Result<usize> {
        let working_set = rows * 4 * crate::backend::lora_backward_f32s_per_row(&model.cfg) + Merged::<B>::slot_bytes(model);
        Ok(model.be.keep_activation_bytes(working_set)? / per_layer(rows).max(1))
    };
    grads_inner(model, seqs, n_keep, loss)
}


/// [`policy_grads`] keeping the activations of the top `n_keep` layers from the forward (the
/// others are recomputed in the backward). The same gradients, bit for bit, for any `n_keep`.
pub fn policy_grads_keeping<B: TrainBackend, S>(
    model: &Model<B>,
    seqs: &[TrainSeq],
    n_keep: usize,
    loss: impl FnOnce(&TokenScores) -> Result<(S, Vec<Vec<f32>>)>,
) -> Result<(S, LoraGrads<B>)> {
    grads_inner(model, seqs, |_| Ok(n_keep), loss)
}

/// The forward + backward; `n_keep(rows)` says how many top layers keep their activations.
fn grads_inner<B: TrainBackend, S>(
    model: &Model<B>,
    seqs: &[TrainSeq],
    n_keep: impl FnOnce(usize) -> Result<usize>,
    loss: impl FnOnce(&TokenScores) -> Result<(S, Vec<Vec<f32>>)>,
) -> Result<(S, LoraGrads<B>)> {
    ensure!(model.lora.is_some() && model.lora_enabled, "the model has no enabled LoRA adapter: nothing to train");
    let batch = DenseBatch::new(model.cfg.vocab, seqs)?;
    let mut grads = LoraGrads::zeros(model)?;
    let be = &model.be;
    let c = &model.cfg;
    let (d, inter, q_dim, kv_dim) = (c.hidden, c.intermediate, c.q_dim(), c.kv_dim());
    let qkv_dim = q_dim + 2 * kv_dim;
    let n = batch.rows();
    let m = batch.loss_rows.len();
    if m == 0 {
        let empty = TokenScores { logprobs: batch.split(&[]), entropy: batch.split(&[]) };
        let (stats, _) = loss(&empty)?;
        return Ok((stats, grads));
    }

    // ---- forward, keeping each layer's input residual ----
    let mut x = be.zeros(n * d)?;
    be.embed(&model.embed, &batch.ids, d, &mut x)?;
    let mut acts = Acts::new(model, n)?;
    let mut merged = Merged::new(model);
    // The top `n_keep` layers keep their activations (the backward reaches them first).
    let n_keep = n_keep(n)?.min(c.n_layers);
    let keeps = |l: usize| l + n_keep >= c.n_layers;
    let mut saved: Vec<B::Buf> = Vec::with_capacity(c.n_layers);
    let mut kept: Vec<Option<Kept<B>>> = (0..c.n_layers).map(|_| None).collect();
    // The buffers kept per layer come from `scratch`, not `zeros`: each is written whole before it
    // is read (noted at each), so zeroing them was wasted (`tests/grpo_grad.rs` runs this with
    // NaN-filled scratch and checks the bits).
    for l in 0..c.n_layers {
        // Safety: `copy` writes it whole
        let mut keep = unsafe { be.scratch(n * d)? };
        be.copy(&x, &mut keep)?;
        saved.push(keep);
        let slot = if keeps(l) { 1 + l } else { 0 };
        prof::time("train_merge", || merged.merge(model, Policy::Current, l, slot))?;
        let w = merged.get(model, l, slot);
        if keeps(l) {
            // Safety: `layer_fwd_inner` copies the residual into it whole
            let mut xm = unsafe { be.scratch(n * d)? };
            layer_fwd_inner(model, &w, &batch, &mut x, &mut acts, true, Some(&mut xm))?;
            // Safety: the buffers put in place of the kept ones are written whole before they are
            // read, by the next layer's forward or the backward's recompute (qkv and gu by their
            // products, qkv_pre by `copy`, att and lse by `attn_dense`), or dropped unread (the
            // backward puts the kept ones back)
            let take = |b: &mut B::Buf| -> Result<B::Buf> { Ok(std::mem::replace(b, unsafe { be.scratch(be.len(b))? })) };
            let qkv_pre = match acts.qkv_pre.as_mut() {
                Some(p) => Some(take(p)?),
                None => None,
            };
            kept[l] = Some(Kept { qkv_pre, qkv: take(&mut acts.qkv)?, att: take(&mut acts.att)?, lse: take(&mut acts.lse)?, gu: take(&mut acts.gu)?, xm });
        } else {
            layer_fwd(model, &w, &batch, &mut x, &mut acts, true)?;
        }
    }

    // ---- head: log-probs, entropies and ∂logp/∂h in one tiled pass ----
    let (sel, hn) = final_rows(model, &x, &batch.loss_rows)?;
    let mut dh = be.zeros(m * d)?;
    let head = prof::time("train_head", || be.head_grad(&hn, model.head(), &batch.targets, d, c.vocab, &mut dh))?;
    if let Some(i) = head.logprobs.iter().position(|v| !v.is_finite()) {
        bail!(NonFinite(format!("log-probability of response token {i} is {} (the model produces non-finite logits)", head.logprobs[i])));
    }
    let scores = TokenScores { logprobs: batch.split(&head.logprobs), entropy: batch.split(&head.entropy) };
    let (stats, dlogp) = loss(&scores)?;
    ensure!(dlogp.len() == seqs.len(), "loss returned gradients for {} sequences, expected {}", dlogp.len(), seqs.len());
    let mut coef = Vec::with_capacity(m);
    for (i, (g, lp)) in dlogp.iter().zip(&scores.logprobs).enumerate() {
        ensure!(g.len() == lp.len(), "loss returned {} gradients for sequence {i}, which has {} response tokens", g.len(), lp.len());
        // head_grad gives g = −∂logp/∂h, so ∂loss/∂h = −(∂loss/∂logp)·g
        coef.extend(g.iter().map(|v| -v));
    }
    be.scale_rows(&mut dh, &coef, d)?;
    // final norm backward, scattered back to the rows of the batch
    let mut dsel = be.zeros(m * d)?;
    be.rmsnorm_bwd(&sel, &model.final_norm, &dh, c.rms_eps, m, d, &mut dsel, false)?;
    drop((sel, hn, dh));
    let mut dres = be.zeros(n * d)?; // ∂loss/∂(residual stream) at the current layer boundary
    be.scatter_add_rows(&dsel, &batch.loss_rows, d, &mut dres)?;
    drop(dsel);

    // ---- backward, layer by layer, recomputing each layer from its input residual ----
    // Safety: per layer each is written whole before it is read: dact, dhid and datt by their
    // products (`accumulate` false), dgu by `swiglu_bwd`, dqkv by `attn_dense_bwd`; below layer
    // 0 dhid is neither written nor read
    let (mut dact, mut dgu, mut dhid, mut datt, mut dqkv) = unsafe { (be.scratch(n * inter)?, be.scratch(n * 2 * inter)?, be.scratch(n * d)?, be.scratch(n * q_dim)?, be.scratch(n * qkv_dim)?) };
    let xm = &mut x; // reused: the recomputed residual after attention
    for l in (0..c.n_layers).rev() {
        let xin = saved.pop().expect("one saved residual per layer");
        let slot = if let Some(k) = kept[l].take() {
            // restore the kept activations; the norms and SwiGLU are recomputed (cheap)
            acts.qkv_pre = k.qkv_pre;
            acts.qkv = k.qkv;
            acts.att = k.att;
            acts.lse = k.lse;
            acts.gu = k.gu;
            *xm = k.xm;
            be.rmsnorm(&xin, &model.layers[l].attn_norm, c.rms_eps, n, d, &mut acts.h1)?;
            be.rmsnorm(&*xm, &model.layers[l].mlp_norm, c.rms_eps, n, d, &mut acts.h2)?;
            1 + l
        } else {
            prof::time("train_merge", || merged.merge(model, Policy::Current, l, 0))?;
            be.copy(&xin, xm)?;
            prof::time("train_recompute", || layer_fwd(model, &merged.get(model, l, 0), &batch, xm, &mut acts, false))?;
            0
        };
        let w = merged.get(model, l, slot);
        let lazy = w.lora_layer.is_some();
        if !lazy && slot != 0 {
            // a kept layer, LoRA merged: act recomputed from its gate/up for the down pairs (a
            // recomputed layer has it; unmerged, the pairs form it themselves, below)
            be.swiglu(&acts.gu, n, inter, &mut acts.act)?;
        }
        let gl = &mut grads.layers[l];
        let a = &acts;

        // MLP: out = x_mid + down(swiglu(gate_up(rmsnorm(x_mid)))); per projection, the input
        // gradient through the merged weight (LoRA included) and the LoRA pairs' own gradients,
        // or with LoRA unmerged the pairs' input gradients added in the same op (`dx_lora`)
        // the down pairs' input act = swiglu(gu): unmerged, formed where the pairs read it and
        // never recomputed into a buffer (50 MB written and read back a layer at 4096 rows)
        let act = if lazy { PairsIn::SwigluOf(&a.gu) } else { PairsIn::X(&a.act) };
        dx_lora(model, l, n, w.down, &[(Proj::Down, 0)], act, &dres, d, inter, Some(&mut dact), lazy, gl)?;
        be.swiglu_bwd(&a.gu, &dact, n, inter, &mut dgu)?;
        dx_lora(model, l, n, w.gate_up, &[(Proj::Gate, 0), (Proj::Up, inter)], PairsIn::X(&a.h2), &dgu, 2 * inter, d, Some(&mut dhid), lazy, gl)?;
        be.rmsnorm_bwd(&*xm, w.mlp_norm, &dhid, c.rms_eps, n, d, &mut dres, true)?;

        // attention: x_mid = x + o(attn(rope(qkv(rmsnorm(x)))))
        dx_lora(model, l, n, w.o, &[(Proj::O, 0)], PairsIn::X(&a.att), &dres, d, q_dim, Some(&mut datt), lazy, gl)?;
        prof::time("train_attn_bwd", || be.attn_dense_bwd(&a.qkv, &a.att, &datt, &a.lse, &batch.seqs, model.geom(), &mut dqkv))?;
        match (w.qk_norm, a.qkv_pre.as_ref()) {
            (Some((qn, kn)), Some(pre)) => be.qk_norm_rope_bwd(pre, qn, kn, c.rms_eps, &mut dqkv, &batch.positions, &model.inv_freq, model.geom())?,
            _ => be.rope_bwd(&mut dqkv, &batch.positions, &model.inv_freq, model.geom())?,
        }
        // The embeddings are frozen: below layer 0 no input gradient is needed.
        let qkv_projs = [(Proj::Q, 0), (Proj::K, q_dim), (Proj::V, q_dim + kv_dim)];
        dx_lora(model, l, n, w.qkv, &qkv_projs, PairsIn::X(&a.h1), &dqkv, qkv_dim, d, (l > 0).then_some(&mut dhid), lazy, gl)?;
        if l > 0 {
            be.rmsnorm_bwd(&xin, w.attn_norm, &dhid, c.rms_eps, n, d, &mut dres, true)?;
        }
    }
    Ok((stats, grads))
}

/// The input gradient `dx = dy·W` through a projection's (merged) weight `w` (`dy [n, ld]`, dx
/// `[n, k]`; none below layer 0), and the gradients of the LoRA pairs of `projs` (projection, its
/// first column in `dy`) on the input `x`. Unmerged (`lazy`), the pairs' input gradients go
/// into dx as well, in one op (`TrainBackend::matmul_dx_lora`, fused on the CPU's bf16 GEMM).
#[allow(clippy::too_many_arguments)]
fn dx_lora<B: TrainBackend>(
    model: &Model<B>,
    l: usize,
    n: usize,
    w: &B::Buf,
    projs: &[(Proj, usize)],
    x: PairsIn<B>,
    dy: &B::Buf,
    ld: usize,
    k: usize,
    dx: Option<&mut B::Buf>,
    lazy: bool,
    grads: &mut LayerGrads<B>,
) -> Result<()> {
    let dx = match dx {
        Some(dx) if lazy => dx,
        dx => {
            let PairsIn::X(x) = x else { bail!("internal: the pairs' input as gate/up needs the fused op (LoRA unmerged, dx wanted)") };
            if let Some(dx) = dx {
                prof::time("train_matmul_dx", || model.be.matmul_dx(dy, w, n, ld, k, dx, false))?;
            }
            for &(p, col0) in projs {
                lora_grad(model, l, n, p, x, dy, col0, ld, grads, None)?;
            }
            return Ok(());
        }
    };
    let mut slots: Vec<Option<&mut (B::Buf, B::Buf)>> = grads.iter_mut().map(|g| g.as_mut()).collect();
    let (mut pairs, mut gs) = (Vec::new(), Vec::new());
    for &(p, col0) in projs {
        if let (Some(slice), Some(g)) = (model.lora_slice(l, p, col0), slots[p.index()].take()) {
            pairs.push(slice);
            gs.push((&mut g.0, &mut g.1));
        }
    }
    prof::time("train_matmul_dx", || match x {
        PairsIn::X(x) => model.be.matmul_dx_lora(dy, w, n, ld, k, dx, x, &pairs, &mut gs),
        PairsIn::SwigluOf(gu) => model.be.matmul_dx_lora_swiglu(dy, w, n, ld, k, dx, gu, &pairs, &mut gs),
    })
}

/// The LoRA pairs' input in `dx_lora`: x itself, or the gate/up rows `[n, 2k]` whose SwiGLU it
/// is (the down projection's, `TrainBackend::matmul_dx_lora_swiglu`).
enum PairsIn<'a, B: Backend> {
    X(&'a B::Buf),
    SwigluOf(&'a B::Buf),
}

/// Accumulate the gradients of (layer, proj)'s LoRA pair, if any, from its input `x` and the
/// gradient `dy` of the fused output (column slice `col0..`, rows of `ld`). Its input gradient
/// already went through the merged weight.
#[allow(clippy::too_many_arguments)]
fn lora_grad<B: TrainBackend>(
    model: &Model<B>,
    l: usize,
    n: usize,
    p: Proj,
    x: &B::Buf,
    dy: &B::Buf,
    col0: usize,
    ld: usize,
    grads: &mut LayerGrads<B>,
    dx: Option<&mut B::Buf>,
) -> Result<()> {
    let (Some((a, b, scale, r)), Some((ga, gb))) = (model.lora_pair(l, p), grads[p.index()].as_mut()) else {
        return Ok(());
    };
    let (din, dout) = p.dims(&model.cfg);
    prof::time("train_lora_grad", || model.be.lora_bwd(x, a, b, scale, n, din, r, dout, dy, col0, ld, ga, gb, dx))
}

/// A NaN/Inf met in the forward or backward pass. The trainer skips the step on it (the adapter
/// is left untouched) instead of failing the run.
#[derive(Debug)]
pub struct NonFinite(pub String);

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NonFinite {}
