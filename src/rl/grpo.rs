//! GRPO, exactly as docs/DESIGN.md §1.6: group advantages, the multi-conversation broadcast, the clipped
//! token loss with the k3 KL to the LoRA-off reference, and its gradient w.r.t. the LoRA
//! parameters (through `runtime::backward`).
//!
//! Per generated token, with `A` the conversation's advantage:
//!
//! ```text
//! ratio = exp(logp − logp_old)
//! surr  = min(ratio·A, clip(ratio, 1−ε_low, 1+ε_high)·A)
//! d     = logp_ref − logp
//! kl    = clamp(exp(d) − d − 1, −10, 10)
//! loss  = Σ_tokens (−surr + kl_coef·kl) / N
//! ```
//!
//! `N` is the number of generated tokens of the whole batch (`GrpoConfig::token_norm`, so that
//! micro-batches of one optimizer step add up to the token mean). The derivative w.r.t. `logp`
//! is PyTorch autograd's: `torch.minimum` splits the gradient equally between two equal
//! arguments (which is what happens whenever the ratio lies inside the clip range), and
//! `torch.clamp` passes the gradient where `min ≤ x ≤ max` (inclusive, PyTorch's
//! `clamp_backward`) and zero outside. With one update per rollout batch, `logp_old` is the
//! current `logp` detached (ratio 1), which is what a missing `old_logprobs` means here.
//!
//! Token math is done in f64 on the f32 log-probabilities.
use crate::agent::Trajectory;
use crate::backend::TrainBackend;
use crate::runtime::backward::{policy_grads, response_logprobs, LoraGrads, Policy, TokenScores, TrainSeq};
use crate::runtime::Model;
use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

/// The batch element: a rollout's (prompt, response) with the trajectory's advantage and,
/// optionally, the log-probabilities under the old and the reference policies. One type with the
/// rollout's output, so the trainer sets advantages in place instead of copying turns.
pub use crate::agent::Conversation;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrpoConfig {
    pub eps_low: f64,
    pub eps_high: f64,
    pub kl_coef: f64,
    /// Generated tokens of the whole optimizer batch across micro-batches (the loss divisor);
    /// 0 = the tokens of this call.
    pub token_norm: usize,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig { eps_low: 0.2, eps_high: 0.28, kl_coef: 0.05, token_norm: 0 }
    }
}

/// Statistics of one loss evaluation (one micro-batch).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct GrpoStats {
    /// This micro-batch's share of the loss: `Σ_tokens (−surr + kl_coef·kl) / N`.
    pub loss: f64,
    pub response_tokens: usize,
    /// Tokens where the clipped surrogate is strictly the smaller one (it is the one taken, and
    /// its gradient is zero): `clip(ratio)·A < ratio·A`.
    pub clipped_tokens: usize,
    /// Mean of the clamped k3 KL over the tokens that have a reference log-prob.
    pub kl_mean: f64,
    pub kl_tokens: usize,
    /// Mean entropy (nats) of the current policy at the response tokens.
    pub entropy_mean: f64,
    pub logp_mean: f64,
    pub ratio_mean: f64,
}

/// One token's loss terms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenTerms {
    /// `−surr + kl_coef·kl` (not yet divided by N).
    pub loss: f64,
    /// `∂loss/∂logp` (not yet divided by N).
    pub dlogp: f64,
    pub ratio: f64,
    pub kl: f64,
    pub clipped: bool,
}

/// The per-token GRPO terms; `ref_logp = None` drops the KL term.
pub fn token_terms(logp: f64, old_logp: f64, ref_logp: Option<f64>, adv: f64, c: &GrpoConfig) -> TokenTerms {
    let ratio = (logp - old_logp).exp();
    let (lo, hi) = (1.0 - c.eps_low, 1.0 + c.eps_high);
    let s1 = ratio * adv;
    let s2 = ratio.clamp(lo, hi) * adv;
    let surr = s1.min(s2);
    // torch.minimum: all gradient to the smaller argument, half to each on a tie
    let (w1, w2) = if s1 < s2 {
        (1.0, 0.0)
    } else if s2 < s1 {
        (0.0, 1.0)
    } else {
        (0.5, 0.5)
    };
    let dclamp = if (lo..=hi).contains(&ratio) { 1.0 } else { 0.0 };
    let dsurr_dlogp = (w1 * adv + w2 * adv * dclamp) * ratio;
    let (kl, dkl_dlogp) = match ref_logp {
        Some(r) => {
            let d = r - logp;
            let ed = d.exp();
            let raw = ed - d - 1.0;
            // d(kl)/d(logp) = −(e^d − 1) inside the clamp range
            (raw.clamp(-10.0, 10.0), if (-10.0..=10.0).contains(&raw) { 1.0 - ed } else { 0.0 })
        }
        None => (0.0, 0.0),
    };
    TokenTerms { loss: -surr + c.kl_coef * kl, dlogp: -dsurr_dlogp + c.kl_coef * dkl_dlogp, ratio, kl, clipped: s2 < s1 }
}

/// The GRPO loss on given per-token log-probabilities: returns the statistics and
/// `∂loss/∂logp` per token. `old`/`ref` default as in [`Conversation`]; `ref_lp[i]` fills in a
/// missing `ref_logprobs` of conversation `i`.
pub fn grpo_loss(convs: &[Conversation], scores: &TokenScores, ref_lp: &[Option<Vec<f32>>], c: &GrpoConfig) -> Result<(GrpoStats, Vec<Vec<f32>>)> {
    ensure!(scores.logprobs.len() == convs.len(), "{} log-prob rows for {} conversations", scores.logprobs.len(), convs.len());
    let total: usize = convs.iter().map(|c| c.response.len()).sum();
    let norm = if c.token_norm > 0 { c.token_norm } else { total.max(1) } as f64;
    let mut st = GrpoStats { response_tokens: total, ..Default::default() };
    let (mut kl_sum, mut ent_sum, mut lp_sum, mut ratio_sum) = (0.0, 0.0, 0.0, 0.0);
    let mut grads = Vec::with_capacity(convs.len());
    for (i, conv) in convs.iter().enumerate() {
        let lps = &scores.logprobs[i];
        ensure!(lps.len() == conv.response.len(), "conversation {i}: {} log-probs for {} response tokens", lps.len(), conv.response.len());
        let refs = conv.ref_logprobs.as_ref().or(ref_lp.get(i).and_then(|r| r.as_ref()));
        let mut g = Vec::with_capacity(lps.len());
        for (t, &lp) in lps.iter().enumerate() {
            let lp = lp as f64;
            let old = conv.old_logprobs.as_ref().map_or(lp, |o| o[t] as f64);
            let rf = refs.map(|r| r[t] as f64);
            let tt = token_terms(lp, old, rf, conv.advantage as f64, c);
            st.loss += tt.loss / norm;
            g.push((tt.dlogp / norm) as f32);
            st.clipped_tokens += tt.clipped as usize;
            if rf.is_some() {
                kl_sum += tt.kl;
                st.kl_tokens += 1;
            }
            lp_sum += lp;
            ratio_sum += tt.ratio;
            if let Some(e) = scores.entropy.get(i).and_then(|e| e.get(t)) {
                ent_sum += *e as f64;
            }
        }
        grads.push(g);
    }
    let tot = total.max(1) as f64;
    st.kl_mean = kl_sum / st.kl_tokens.max(1) as f64;
    st.entropy_mean = ent_sum / tot;
    st.logp_mean = lp_sum / tot;
    st.ratio_mean = ratio_sum / tot;
    Ok((st, grads))
}

/// Check a conversation list: old/ref lengths match the responses, everything finite.
pub fn validate(convs: &[Conversation], vocab: usize) -> Result<()> {
    for (i, c) in convs.iter().enumerate() {
        for (field, ids) in [("prompt", &c.prompt), ("response", &c.response)] {
            if let Some(j) = ids.iter().position(|&t| t as usize >= vocab) {
                bail!("conversation {i}: {field}[{j}] = {} is outside the vocabulary (size {vocab})", ids[j]);
            }
        }
        if !c.response.is_empty() && c.prompt.is_empty() {
            bail!("conversation {i}: prompt is empty (the first response token needs a context)");
        }
        if !c.advantage.is_finite() {
            bail!("conversation {i}: advantage is {} (not a finite number)", c.advantage);
        }
        for (field, v) in [("old_logprobs", &c.old_logprobs), ("ref_logprobs", &c.ref_logprobs)] {
            if let Some(v) = v {
                if v.len() != c.response.len() {
                    bail!("conversation {i}: {field} has {} values but the response has {} tokens", v.len(), c.response.len());
                }
                if let Some(j) = v.iter().position(|x| !x.is_finite()) {
                    bail!("conversation {i}: {field}[{j}] is {} (not a finite number)", v[j]);
                }
            }
        }
    }
    Ok(())
}

/// Loss and LoRA gradients of one micro-batch. Conversations without `ref_logprobs` get them
/// from a LoRA-off forward (unless `kl_coef` is 0); without `old_logprobs`, `logp_old = logp`.
pub fn loss_and_grads<B: TrainBackend>(model: &Model<B>, convs: &[Conversation], c: &GrpoConfig) -> Result<(GrpoStats, LoraGrads<B>)> {
    validate(convs, model.cfg.vocab)?;
    let ref_lp = reference_logprobs(model, convs, c)?;
    let seqs: Vec<TrainSeq> = convs.iter().map(|c| TrainSeq { prompt: &c.prompt, response: &c.response }).collect();
    policy_grads(model, &seqs, |scores| grpo_loss(convs, scores, &ref_lp, c))
}

/// Reference log-probs (LoRA off) of the conversations that lack them; `None` where given (or
/// where `kl_coef` is 0).
pub fn reference_logprobs<B: TrainBackend>(model: &Model<B>, convs: &[Conversation], c: &GrpoConfig) -> Result<Vec<Option<Vec<f32>>>> {
    let mut out: Vec<Option<Vec<f32>>> = vec![None; convs.len()];
    if c.kl_coef == 0.0 {
        return Ok(out);
    }
    let missing: Vec<usize> = (0..convs.len()).filter(|&i| convs[i].ref_logprobs.is_none()).collect();
    if missing.is_empty() {
        return Ok(out);
    }
    let seqs: Vec<TrainSeq> = missing.iter().map(|&i| TrainSeq { prompt: &convs[i].prompt, response: &convs[i].response }).collect();
    for (i, lp) in missing.into_iter().zip(response_logprobs(model, &seqs, Policy::Reference)?) {
        out[i] = Some(lp);
    }
    Ok(out)
}

/// Log-probabilities of the responses under the current policy, no gradient (old log-probs when
/// a batch is reused for several updates).
pub fn current_logprobs<B: TrainBackend>(model: &Model<B>, convs: &[Conversation]) -> Result<Vec<Vec<f32>>> {
    let seqs: Vec<TrainSeq> = convs.iter().map(|c| TrainSeq { prompt: &c.prompt, response: &c.response }).collect();
    response_logprobs(model, &seqs, Policy::Current)
}

// ---------------------------------------------------------------------------------------------
// Advantages

/// How group rewards become advantages (`--adv-norm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdvNorm {
    /// `(R_i − mean) / (std + 1e-6)`, `std` the **sample** standard deviation (n − 1), as
    /// `torch.std` computes it in TRL's and verl's GRPO. A group of one gets advantage 0.
    Std,
    /// `R_i − mean` (MemAgent / Dr. GRPO).
    Mean,
}

impl AdvNorm {
    pub fn parse(s: &str) -> Result<AdvNorm> {
        match s {
            "std" => Ok(AdvNorm::Std),
            "mean" => Ok(AdvNorm::Mean),
            _ => bail!("unknown advantage normalization {s:?}: use std or mean"),
        }
    }
}

/// Advantages of one group of rollouts of the same query.
pub fn group_advantages(rewards: &[f64], norm: AdvNorm) -> Vec<f64> {
    let n = rewards.len();
    if n == 0 {
        return vec![];
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    match norm {
        AdvNorm::Mean => rewards.iter().map(|r| r - mean).collect(),
        AdvNorm::Std => {
            if n == 1 {
                return vec![0.0];
            }
            let var = rewards.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>() / (n - 1) as f64;
            let std = var.sqrt();
            rewards.iter().map(|r| (r - mean) / (std + 1e-6)).collect()
        }
    }
}

/// Multi-conversation credit assignment: every turn of trajectory `i` (its `K` memory updates
/// and the final answer) trains with the trajectory's advantage `A_i`.
pub fn broadcast_advantages(group: &mut [Trajectory], advantages: &[f64]) -> Result<()> {
    ensure!(group.len() == advantages.len(), "{} trajectories but {} advantages", group.len(), advantages.len());
    for (t, &a) in group.iter_mut().zip(advantages) {
        for turn in &mut t.turns {
            turn.conv.advantage = a as f32;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Batch files (`grpo-grad --batch`)

/// A batch in the format of `fixtures/cases.json → <arch>.grpo` (extra fields ignored).
#[derive(Clone, Debug)]
pub struct GrpoBatch {
    pub conversations: Vec<Conversation>,
    pub cfg: GrpoConfig,
}

/// JSON has no NaN/Infinity, but Python's `json.dump` writes them bare: turn those tokens into
/// strings so the parse succeeds and validation can name the field.
fn quote_nonfinite(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let (mut i, mut in_str, mut esc) = (0, false, false);
    while i < b.len() {
        let ch = b[i];
        if in_str {
            if esc {
                esc = false;
            } else if ch == b'\\' {
                esc = true;
            } else if ch == b'"' {
                in_str = false;
            }
        } else if ch == b'"' {
            in_str = true;
        } else {
            let mut hit = false;
            for tok in ["-Infinity", "Infinity", "NaN"] {
                if text[i..].starts_with(tok) {
                    out.push('"');
                    out.push_str(tok);
                    out.push('"');
                    i += tok.len();
                    hit = true;
                    break;
                }
            }
            if hit {
                continue;
            }
        }
        // copy one UTF-8 character
        let len = match ch {
            0x00..=0x7f => 1,
            0xc0..=0xdf => 2,
            0xe0..=0xef => 3,
            _ => 4,
        };
        out.push_str(&text[i..(i + len).min(b.len())]);
        i += len;
    }
    out
}

fn number(v: Option<&Value>, what: &str) -> Result<f64> {
    let v = v.with_context(|| format!("missing field {what:?}"))?;
    let x = match v {
        Value::Number(n) => n.as_f64().with_context(|| format!("{what} = {n} is not representable"))?,
        Value::String(s) if ["NaN", "Infinity", "-Infinity"].contains(&s.as_str()) => bail!("{what} is {s} (not a finite number)"),
        other => bail!("{what} must be a number, got {other}"),
    };
    ensure!(x.is_finite(), "{what} is {x} (not a finite number)");
    Ok(x)
}

/// A number the loss keeps in f32: finite there too (1e308 would become inf).
fn number_f32(v: Option<&Value>, what: &str) -> Result<f32> {
    let x = number(v, what)?;
    ensure!(x.abs() <= f32::MAX as f64, "{what} = {x:e} does not fit in f32 (|x| ≤ {:e}), in which the loss is computed", f32::MAX);
    Ok(x as f32)
}

fn float_list(v: &Value, what: &str) -> Result<Vec<f32>> {
    let a = v.as_array().with_context(|| format!("{what} must be an array of numbers, got {v}"))?;
    a.iter().enumerate().map(|(j, x)| number_f32(Some(x), &format!("{what}[{j}]"))).collect()
}

fn id_list(v: Option<&Value>, what: &str, vocab: usize) -> Result<Vec<u32>> {
    let v = v.with_context(|| format!("missing field {what:?}"))?;
    let a = v.as_array().with_context(|| format!("{what} must be an array of token ids, got {v}"))?;
    a.iter()
        .enumerate()
        .map(|(j, x)| {
            let id = x.as_u64().with_context(|| format!("{what}[{j}] = {x} is not a token id (a non-negative integer)"))?;
            ensure!((id as usize) < vocab, "{what}[{j}] = {id} is outside the vocabulary (size {vocab})");
            Ok(id as u32)
        })
        .collect()
}

/// Refuse a key of `obj` that is not in `known`, naming it and the keys that are.
fn known_keys(obj: &serde_json::Map<String, Value>, known: &[&str], what: &str) -> Result<()> {
    near_miss_keys(obj, known, what)?;
    if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
        bail!("{what} has an unknown key {k:?} (known: {})", known.join(", "));
    }
    Ok(())
}

/// Refuse an unknown key of `obj` that is a near miss of a known one (`data::keys::near_miss`:
/// case, `-` and `_` ignored, a few edits): a misspelling, whose value would otherwise be
/// dropped in silence.
fn near_miss_keys(obj: &serde_json::Map<String, Value>, known: &[&str], what: &str) -> Result<()> {
    for k in obj.keys() {
        if let Some(m) = crate::data::keys::near_miss(k, known) {
            bail!("{what} has an unknown key {k:?}; did you mean {m:?}? (known: {})", known.join(", "));
        }
    }
    Ok(())
}

/// Parse and validate a GRPO batch file against a vocabulary of `vocab` ids. Errors name the
/// conversation index and the field.
pub fn parse_batch(text: &str, vocab: usize) -> Result<GrpoBatch> {
    let v: Value = serde_json::from_str(&quote_nonfinite(text)).context("the batch is not valid JSON")?;
    let obj = v.as_object().context("the batch must be a JSON object with \"conversations\", \"eps_low\", \"eps_high\", \"kl_coef\"")?;
    // a misspelt key would otherwise be ignored and its default used in silence (an
    // `old_logprob` meant the current policy instead of the given one). Other top-level keys
    // are the file's own notes (the fixtures keep their expected loss there) and stay ignored.
    near_miss_keys(obj, &["conversations", "eps_low", "eps_high", "kl_coef", "token_norm"], "the batch")?;
    let cfg = GrpoConfig {
        eps_low: number(obj.get("eps_low"), "eps_low")?,
        eps_high: number(obj.get("eps_high"), "eps_high")?,
        kl_coef: number(obj.get("kl_coef"), "kl_coef")?,
        token_norm: match obj.get("token_norm") {
            None | Some(Value::Null) => 0,
            Some(x) => x.as_u64().with_context(|| format!("token_norm must be a non-negative integer, got {x}"))? as usize,
        },
    };
    ensure!((0.0..1.0).contains(&cfg.eps_low), "eps_low must be in [0, 1), got {}", cfg.eps_low);
    ensure!(cfg.eps_high >= 0.0, "eps_high must be ≥ 0, got {}", cfg.eps_high);
    ensure!(cfg.kl_coef >= 0.0, "kl_coef must be ≥ 0, got {}", cfg.kl_coef);
    let list = obj.get("conversations").context("missing field \"conversations\"")?;
    let list = list.as_array().context("\"conversations\" must be an array")?;
    ensure!(!list.is_empty(), "\"conversations\" is empty");
    let mut convs = Vec::with_capacity(list.len());
    for (i, c) in list.iter().enumerate() {
        let conv = (|| -> Result<Conversation> {
            let o = c.as_object().context("must be an object with prompt, response, advantage")?;
            let opt = |k: &str| -> Result<Option<Vec<f32>>> {
                match o.get(k) {
                    None | Some(Value::Null) => Ok(None),
                    Some(x) => float_list(x, k).map(Some),
                }
            };
            let conv = Conversation {
                prompt: id_list(o.get("prompt"), "prompt", vocab)?,
                response: id_list(o.get("response"), "response", vocab)?,
                advantage: number_f32(o.get("advantage"), "advantage")?,
                old_logprobs: opt("old_logprobs")?,
                ref_logprobs: opt("ref_logprobs")?,
            };
            // after the fields, so that a misspelt required key reads as the missing field
            known_keys(o, &["prompt", "response", "advantage", "old_logprobs", "ref_logprobs"], "a conversation")?;
            // a log-probability is ≤ 0 (a probability ≤ 1); a positive one is a value of something else
            for (k, v) in [("old_logprobs", &conv.old_logprobs), ("ref_logprobs", &conv.ref_logprobs)] {
                if let Some((j, x)) = v.iter().flatten().enumerate().find(|(_, &x)| x > 0.0) {
                    bail!("{k}[{j}] = {x} is positive; log-probabilities are ≤ 0");
                }
            }
            Ok(conv)
        })()
        .map_err(|e| anyhow::anyhow!("conversation {i}: {e:#}"))?;
        convs.push(conv);
    }
    validate(&convs, vocab)?;
    ensure!(convs.iter().any(|c| !c.response.is_empty()), "no conversation has response tokens: nothing to score");
    Ok(GrpoBatch { conversations: convs, cfg })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::{ConvKind, Turn};
    use crate::runtime::Finish;

    #[test]
    fn token_terms_match_hand_derivatives() {
        let c = GrpoConfig::default();
        // inside the clip range: tie → full gradient −A·ratio, plus the KL slope
        let t = token_terms(-1.0, -1.05, Some(-1.2), 2.0, &c);
        let ratio = (0.05f64).exp();
        let d = -0.2f64;
        assert!((t.dlogp - (-2.0 * ratio + 0.05 * (1.0 - d.exp()))).abs() < 1e-12);
        assert!(!t.clipped);
        // above 1+ε_high with A > 0: clipped branch is smaller, zero surrogate gradient
        let t = token_terms(0.0, -0.5, None, 1.0, &c);
        assert!(t.clipped && t.dlogp == 0.0);
        // above 1+ε_high with A < 0: unclipped branch smaller, gradient flows
        let t = token_terms(0.0, -0.5, None, -1.0, &c);
        assert!(!t.clipped && (t.dlogp - (0.5f64).exp()).abs() < 1e-12);
        // KL clamp: exp(d) − d − 1 > 10 → no KL gradient
        let t = token_terms(-20.0, -20.0, Some(-5.0), 0.0, &c);
        assert_eq!(t.kl, 10.0);
        assert_eq!(t.dlogp, 0.0);
    }

    #[test]
    fn advantages() {
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], AdvNorm::Std);
        let std = (1.0f64 / 3.0).sqrt(); // sample std of {1,0,0,1}
        assert!((a[0] - 0.5 / (std + 1e-6)).abs() < 1e-12);
        assert_eq!(group_advantages(&[1.0, 0.0], AdvNorm::Mean), vec![0.5, -0.5]);
        assert_eq!(group_advantages(&[3.0], AdvNorm::Std), vec![0.0]);
        assert_eq!(group_advantages(&[2.0, 2.0], AdvNorm::Std), vec![0.0, 0.0]);
        let traj = |turns: &[(u32, u32)]| {
            let mut t = Trajectory::start("q", 0, 0, "none", &[], false);
            for &(p, r) in turns {
                let conv = Conversation { prompt: vec![p], response: vec![r], ..Default::default() };
                t.turns.push(Turn { kind: ConvKind::Update, conv, prefix_len: 0, gen_logprobs: vec![], finish: Finish::Length, step_s: 0.0 });
            }
            t
        };
        let mut group = vec![traj(&[(1, 2), (3, 4)]), traj(&[(5, 6)])];
        broadcast_advantages(&mut group, &[0.5, -1.0]).unwrap();
        let advs: Vec<f32> = group.iter().flat_map(|t| t.turns.iter().map(|c| c.conv.advantage)).collect();
        assert_eq!(advs, vec![0.5, 0.5, -1.0]);
    }

    #[test]
    fn batch_errors_name_the_field() {
        let ok = r#"{"eps_low":0.2,"eps_high":0.28,"kl_coef":0.05,"conversations":[{"prompt":[1,2],"response":[3,4],"advantage":1.0}]}"#;
        assert_eq!(parse_batch(ok, 10).unwrap().conversations.len(), 1);
        let e = |s: &str| format!("{:#}", parse_batch(s, 10).unwrap_err());
        let nan = ok.replace("\"advantage\":1.0", "\"advantage\":1.0,\"old_logprobs\":[-1.0,NaN]");
        assert!(e(&nan).contains("conversation 0") && e(&nan).contains("old_logprobs[1] is NaN"), "{}", e(&nan));
        let short = ok.replace("\"advantage\":1.0", "\"advantage\":1.0,\"ref_logprobs\":[-1.0]");
        assert!(e(&short).contains("ref_logprobs has 1 values but the response has 2 tokens"), "{}", e(&short));
        let big = ok.replace("[3,4]", "[3,40]");
        assert!(e(&big).contains("response[1] = 40 is outside the vocabulary"), "{}", e(&big));
        let miss = ok.replace("\"advantage\":1.0", "\"adv\":1.0");
        assert!(e(&miss).contains("conversation 0") && e(&miss).contains("missing field \"advantage\""), "{}", e(&miss));
        assert!(e(&ok.replace("\"kl_coef\":0.05,", "")).contains("kl_coef"));
    }
}
