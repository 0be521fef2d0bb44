//! One batched forward step over any mix of sequences: prefill chunks, single decode tokens and
//! teacher-forced scoring share one pass (continuous batching). Every token's K/V goes into the
//! paged cache; only the rows whose outputs are wanted go through the last layer's attention and
//! MLP and reach the final norm and the head (a prefill chunk that does not end its prompt, or the
//! context before scored targets, stops at storing its last-layer K/V).
use super::kv::{KvCache, Seq};
use super::model::Model;
use crate::backend::{AttnSeq, Backend, LoraSlice, SampleParams, Sampled};
use crate::model::lora::Proj;
use crate::util::prof;
use anyhow::{bail, Result};

/// What a step should return for one entry.
#[derive(Clone, Debug)]
pub enum Want {
    /// Only extend the cache (a prefill chunk that does not end the prompt).
    Nothing,
    /// Logits of the entry's last row, downloaded to the host.
    Logits,
    /// Sample the next token from the last row.
    Sample { params: SampleParams, uniform: f64 },
    /// Log-probabilities: row `first_row + j` of the entry predicts `targets[j]`.
    LogProbs { first_row: usize, targets: Vec<u32> },
}

pub struct Entry<'a> {
    pub seq: &'a mut Seq,
    pub tokens: &'a [u32],
    pub want: Want,
    /// `tokens` were sampled by this sequence (decode), not fed (see `AttnSeq::sampled`).
    pub sampled: bool,
}

/// A row's logits were not finite (NaN or Inf: NaN/Inf weights or adapter, or an overflow in
/// the activations). Sampling from them would emit token 0 (or never finish a top-p draw) and
/// scoring would turn rewards into NaN, so a step fails with this instead. Callers name the
/// request and token in their own terms ([`super::generate`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteLogits {
    /// Index of the entry in the step.
    pub entry: usize,
    /// Row within the entry's tokens whose logits are at fault.
    pub row: usize,
    /// Sequence position of that row's token (its logits predict position + 1).
    pub position: usize,
}

impl std::fmt::Display for NonFiniteLogits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the model's logits are not finite (NaN or Inf) at entry {} of the batch, row {}, position {}: the weights or the adapter hold NaN/Inf values, or the activations overflow",
            self.entry, self.row, self.position
        )
    }
}

impl std::error::Error for NonFiniteLogits {}

#[derive(Debug, Default, Clone)]
pub struct EntryOut {
    pub logits: Option<Vec<f32>>,
    pub sampled: Option<Sampled>,
    pub logprobs: Vec<f32>,
}

impl<B: Backend> Model<B> {
    pub fn step(&self, kv: &mut KvCache<B>, entries: &mut [Entry]) -> Result<Vec<EntryOut>> {
        let be = &self.be;
        let cfg = &self.cfg;
        let g = self.geom();
        let (d, inter) = (cfg.hidden, cfg.intermediate);
        let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
        let qkv_dim = q_dim + 2 * kv_dim;

        let n: usize = entries.iter().map(|e| e.tokens.len()).sum();
        if n == 0 {
            return Ok(entries.iter().map(|_| EntryOut::default()).collect());
        }
        // each entry's first row in the step
        let row0: Vec<usize> = entries.iter().scan(0, |r, e| Some(std::mem::replace(r, *r + e.tokens.len()))).collect();
        // ---- the rows that leave the model: an entry's last row (sampling, logits) or its
        // log-prob rows; every other row only extends the cache ----
        let mut last_rows = Vec::new(); // (entry, row)
        let mut lp_rows = Vec::new();
        let mut lp_targets = Vec::new();
        let mut lp_owner = Vec::new();
        let mut runs = Vec::new(); // (entry, first row, rows): each entry's wanted rows, one run
        for (i, e) in entries.iter().enumerate() {
            // checked before any slot is reserved
            if e.tokens.is_empty() && !matches!(e.want, Want::Nothing) {
                bail!("a step entry with no tokens cannot produce outputs");
            }
            if let Some(&bad) = e.tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
                bail!("token id {bad} is outside the vocabulary (size {})", cfg.vocab);
            }
            match &e.want {
                Want::Nothing => {}
                Want::Logits | Want::Sample { .. } => {
                    last_rows.push((i, (row0[i] + e.tokens.len() - 1) as u32));
                    runs.push((i, e.tokens.len() - 1, 1));
                }
                Want::LogProbs { first_row, targets } => {
                    if first_row.checked_add(targets.len()).is_none_or(|end| end > e.tokens.len()) {
                        bail!("log-prob rows {}..{} beyond the entry's {} tokens", first_row, first_row.saturating_add(targets.len()), e.tokens.len());
                    }
                    for (j, &t) in targets.iter().enumerate() {
                        if t as usize >= cfg.vocab {
                            bail!("target id {t} is outside the vocabulary (size {})", cfg.vocab);
                        }
                        lp_rows.push((row0[i] + first_row + j) as u32);
                        lp_targets.push(t);
                        lp_owner.push(i);
                    }
                    if !targets.is_empty() {
                        runs.push((i, *first_row, targets.len()));
                    }
                }
            }
        }
        // ascending (entries in order, one run each), so a row's place in it is a binary search
        let kept: Vec<u32> = runs.iter().flat_map(|&(i, a, len)| (row0[i] + a..row0[i] + a + len).map(|r| r as u32)).collect();

        // ---- layout: every row's token, position and cache slot ----
        let mut ids = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        for e in entries.iter_mut() {
            ids.extend_from_slice(e.tokens);
            positions.extend((e.seq.len..e.seq.len + e.tokens.len()).map(|p| p as u32));
            slots.extend(kv.reserve(be, e.seq, e.tokens.len())?);
        }
        let seqs: Vec<AttnSeq> = entries
            .iter()
            .zip(&row0)
            .filter(|(e, _)| !e.tokens.is_empty())
            .map(|(e, &r)| AttnSeq { q_row: r, n_q: e.tokens.len(), ctx_len: e.seq.len + e.tokens.len(), pages: &e.seq.pages, sampled: e.sampled })
            .collect();

        // ---- the transformer ----
        let mut x = be.zeros(n * d)?;
        let mut h = be.zeros(n * d)?;
        let mut qkv = be.zeros(n * qkv_dim)?;
        let mut att = be.zeros(n * q_dim)?;
        let mut o = be.zeros(n * d)?;
        let mut gu = be.zeros(n * 2 * inter)?;
        let mut act = be.zeros(n * inter)?;
        be.embed(&self.embed, &ids, d, &mut x)?;
        be.rmsnorm(&x, &self.layers[0].attn_norm, cfg.rms_eps, n, d, &mut h)?;
        let n_layers = self.layers.len();
        for (l, w) in self.layers.iter().enumerate() {
            let ls = |projs: &[(Proj, usize)]| self.lora_slices(l, projs);
            prof::time("matmul_qkv", || be.matmul_lora(&h, &w.qkv, w.qkv_bias.as_ref(), n, d, qkv_dim, &mut qkv, &ls(&[(Proj::Q, 0), (Proj::K, q_dim), (Proj::V, q_dim + kv_dim)])))?;
            prof::time("rope", || self.rope_layer(l, &mut qkv, &positions))?;
            prof::time("kv_store", || be.kv_store(&mut kv.store, l, &qkv, &slots, g))?;
            if l + 1 == n_layers && kept.len() < n {
                // The last layer's output reaches only the final norm and the head, so the rows
                // that leave nothing stop once their K/V are stored: the kept rows alone go on
                // (on the CPU in bf16 a row's results do not depend on the other rows of its
                // batch, so theirs are the same bits; f32 and CUDA sum some products in another
                // order for another row count).
                let kseqs: Vec<AttnSeq> = runs
                    .iter()
                    .map(|&(i, a, len)| {
                        let e = &entries[i];
                        // the run as the last rows of a context that ends at its last row
                        AttnSeq { q_row: row0[i] + a, n_q: len, ctx_len: e.seq.len + a + len, pages: &e.seq.pages, sampled: e.sampled }
                    })
                    .collect();
                if let Some(xk) = self.last_layer_rows(l, &x, &qkv, &mut att, &kseqs, &kept, kv)? {
                    x = xk;
                }
                break;
            }
            prof::time("attention", || be.attention(&kv.store, l, &qkv, &seqs, g, &mut att))?;
            self.o_and_mlp(l, n, &att, &mut x, &mut o, &mut h, &mut gu, &mut act)?;
            match self.layers.get(l + 1) {
                Some(next) => be.add_rmsnorm(&mut x, &o, &next.attn_norm, cfg.rms_eps, n, d, &mut h)?,
                None => be.add(&mut x, &o, n * d)?,
            }
        }
        drop(seqs);
        for e in entries.iter_mut() {
            e.seq.len += e.tokens.len();
        }
        // x holds the kept rows, in order, whenever some rows were dropped: a row's place there
        let at = |r: u32| if kept.len() < n { kept.binary_search(&r).expect("a wanted row is kept") as u32 } else { r };

        // ---- outputs: only the wanted rows go through the final norm and the head ----
        let mut outs: Vec<EntryOut> = entries.iter().map(|_| EntryOut::default()).collect();
        if !last_rows.is_empty() {
            let rows: Vec<u32> = last_rows.iter().map(|r| at(r.1)).collect();
            let m = rows.len();
            let mut sel = be.zeros(m * d)?;
            let mut hn = be.zeros(m * d)?;
            be.gather_rows(&x, &rows, d, &mut sel)?;
            be.rmsnorm(&sel, &self.final_norm, cfg.rms_eps, m, d, &mut hn)?;
            let mut logits = be.zeros(m * cfg.vocab)?;
            prof::time("head_logits", || be.matmul(&hn, self.head(), None, m, d, cfg.vocab, &mut logits))?;
            let mut params = Vec::new();
            let mut uniform = Vec::new();
            let mut sample_idx = Vec::new();
            let mut host_logits = None;
            for (k, &(i, _)) in last_rows.iter().enumerate() {
                match entries[i].want {
                    Want::Sample { params: p, uniform: u } => {
                        params.push(p);
                        uniform.push(u);
                        sample_idx.push((k, i));
                    }
                    Want::Logits => {
                        if host_logits.is_none() {
                            host_logits = Some(be.download(&logits)?);
                        }
                        let hl = host_logits.as_ref().unwrap();
                        let row = hl[k * cfg.vocab..(k + 1) * cfg.vocab].to_vec();
                        if row.iter().any(|x| !x.is_finite()) {
                            let r = entries[i].tokens.len() - 1;
                            return Err(NonFiniteLogits { entry: i, row: r, position: positions[row0[i] + r] as usize }.into());
                        }
                        outs[i].logits = Some(row);
                    }
                    _ => unreachable!(),
                }
            }
            if !sample_idx.is_empty() {
                // Sampling rows must be contiguous in `logits`: compact them when mixed with Logits rows.
                let compacted;
                let src = if sample_idx.len() == m {
                    &logits
                } else {
                    let rows: Vec<u32> = sample_idx.iter().map(|&(k, _)| k as u32).collect();
                    let mut sub = be.zeros(rows.len() * cfg.vocab)?;
                    be.gather_rows(&logits, &rows, cfg.vocab, &mut sub)?;
                    compacted = sub;
                    &compacted
                };
                // A greedy pick returns logit[argmax] − logsumexp(row): finite exactly when the
                // row holds no NaN or +Inf. Greedy rows get it from their own draw; before any
                // temperature draw (whose nucleus search need not end on NaN weights) a greedy pass
                // over the rows checks them: one read of the logits, small beside the head GEMM.
                let nonfinite = |picked: &[Sampled]| -> Result<()> {
                    if let Some(k) = picked.iter().position(|s| !s.logprob.is_finite()) {
                        let i = sample_idx[k].1;
                        let r = entries[i].tokens.len() - 1;
                        return Err(NonFiniteLogits { entry: i, row: r, position: positions[row0[i] + r] as usize }.into());
                    }
                    Ok(())
                };
                if params.iter().any(|p| !p.is_greedy()) {
                    let n = params.len();
                    nonfinite(&be.sample(src, cfg.vocab, &vec![SampleParams::GREEDY; n], &vec![0.0; n])?)?;
                }
                let picked = be.sample(src, cfg.vocab, &params, &uniform)?;
                nonfinite(&picked)?;
                for (&(_, i), s) in sample_idx.iter().zip(picked) {
                    outs[i].sampled = Some(s);
                }
            }
        }
        if !lp_rows.is_empty() {
            let m = lp_rows.len();
            let mut sel = be.zeros(m * d)?;
            let mut hn = be.zeros(m * d)?;
            be.gather_rows(&x, &lp_rows.iter().map(|&r| at(r)).collect::<Vec<u32>>(), d, &mut sel)?;
            be.rmsnorm(&sel, &self.final_norm, cfg.rms_eps, m, d, &mut hn)?;
            let lps = prof::time("head_logprobs", || be.logprobs(&hn, self.head(), &lp_targets, d, cfg.vocab))?;
            for (k, (lp, &i)) in lps.into_iter().zip(&lp_owner).enumerate() {
                // a finite row gives a finite log-prob for every target; NaN/Inf would turn a
                // score, a gain or a reward into NaN downstream
                if !lp.is_finite() {
                    let r = lp_rows[k] as usize - row0[i];
                    return Err(NonFiniteLogits { entry: i, row: r, position: positions[lp_rows[k] as usize] as usize }.into());
                }
                outs[i].logprobs.push(lp);
            }
        }
        Ok(outs)
    }

    /// The last layer for the `kept` rows alone (ascending rows of the step; `kseqs`, their
    /// runs as attention rows), its K/V already stored: attention, o, the MLP and the residual
    /// adds. Returns their residual stream, `[kept.len(), hidden]` in `kept`'s order (`None`
    /// when no row is kept).
    #[allow(clippy::too_many_arguments)]
    fn last_layer_rows(&self, l: usize, x: &B::Buf, qkv: &B::Buf, att: &mut B::Buf, kseqs: &[AttnSeq], kept: &[u32], kv: &KvCache<B>) -> Result<Option<B::Buf>> {
        let (be, cfg) = (&self.be, &self.cfg);
        let (d, inter, q_dim) = (cfg.hidden, cfg.intermediate, cfg.q_dim());
        let m = kept.len();
        if m == 0 {
            return Ok(None);
        }
        prof::time("attention", || be.attention(&kv.store, l, qkv, kseqs, self.geom(), att))?;
        let (mut xk, mut ak) = (be.zeros(m * d)?, be.zeros(m * q_dim)?);
        be.gather_rows(x, kept, d, &mut xk)?;
        be.gather_rows(att, kept, q_dim, &mut ak)?;
        let (mut o, mut h) = (be.zeros(m * d)?, be.zeros(m * d)?);
        let (mut gu, mut act) = (be.zeros(m * 2 * inter)?, be.zeros(m * inter)?);
        self.o_and_mlp(l, m, &ak, &mut xk, &mut o, &mut h, &mut gu, &mut act)?;
        be.add(&mut xk, &o, m * d)?;
        Ok(Some(xk))
    }

    /// Layer `l` of `rows` rows from its attention output `att` on: the o projection added to
    /// the residual `x`, the MLP norm into `h`, the MLP (gate/up and SwiGLU into `gu`/`act`), its
    /// output left in `o` for the caller to add. One body for every row set the step runs.
    #[allow(clippy::too_many_arguments)]
    fn o_and_mlp(&self, l: usize, rows: usize, att: &B::Buf, x: &mut B::Buf, o: &mut B::Buf, h: &mut B::Buf, gu: &mut B::Buf, act: &mut B::Buf) -> Result<()> {
        let (be, cfg, w) = (&self.be, &self.cfg, &self.layers[l]);
        let (d, inter, q_dim) = (cfg.hidden, cfg.intermediate, cfg.q_dim());
        let ls = |projs: &[(Proj, usize)]| self.lora_slices(l, projs);
        prof::time("matmul_o", || be.matmul_lora(att, &w.o, w.o_bias.as_ref(), rows, q_dim, d, o, &ls(&[(Proj::O, 0)])))?;
        prof::time("add_rmsnorm", || be.add_rmsnorm(x, o, &w.mlp_norm, cfg.rms_eps, rows, d, h))?;
        prof::time("matmul_gate_up_swiglu", || be.matmul_lora_swiglu(h, &w.gate_up, rows, d, inter, gu, act, &ls(&[(Proj::Gate, 0), (Proj::Up, inter)])))?;
        prof::time("matmul_down", || be.matmul_lora(act, &w.down, None, rows, inter, d, o, &ls(&[(Proj::Down, 0)])))
    }

    /// The adapter's pairs among `projs` (projection, its first column in the fused output) of
    /// `layer`, for `Backend::matmul_lora` / `TrainBackend::matmul_dx_lora`.
    pub(crate) fn lora_slices(&self, layer: usize, projs: &[(Proj, usize)]) -> Vec<LoraSlice<'_, B::Buf>> {
        projs.iter().filter_map(|&(p, col0)| self.lora_slice(layer, p, col0)).collect()
    }

    /// The adapter's pair of (layer, proj), if any, on the columns from `col0`.
    pub(crate) fn lora_slice(&self, layer: usize, p: Proj, col0: usize) -> Option<LoraSlice<'_, B::Buf>> {
        let (a, b, scale, r) = self.lora_pair(layer, p)?;
        Some(LoraSlice { a, b, scale, r, col0, n_out: p.dims(&self.cfg).1 })
    }
}
