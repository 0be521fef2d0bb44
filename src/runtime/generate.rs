//! Batched generation and teacher-forced scoring over sequences of different lengths.
//!
//! A scheduler feeds every live request each step: requests still reading their prompt get a
//! chunk of it (within a token budget per step), requests that are generating get their last
//! token. Prefill and decode share the same forward pass and the same paged KV cache.
use super::forward::{Entry, NonFiniteLogits, Want};
use super::kv::{KvCache, Seq};
use super::model::Model;
use crate::backend::{Backend, SampleParams};
use crate::util::rng::Rng;
use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// An end-of-sequence id was generated (it is included in `new_ids`).
    Eos,
    /// A stop string appeared in the decoded text.
    Stop,
    /// `max_new` tokens were generated.
    Length,
}

pub struct GenRequest {
    /// The sequence to continue: empty, or forked from a shared prefix already in the cache.
    pub seq: Seq,
    /// Prompt tokens still to read before generating (at least one).
    pub feed: Vec<u32>,
    pub max_new: usize,
    pub params: SampleParams,
    pub rng: Rng,
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    /// Keep the sequence (prompt + generated tokens) in the cache and return it.
    pub keep_seq: bool,
}

#[derive(Debug)]
pub struct GenOutput {
    pub new_ids: Vec<u32>,
    /// Log-probability of each generated token under the model (temperature 1).
    pub logprobs: Vec<f32>,
    pub finish: Finish,
    /// Length of the sequence when generation began (prefix + prompt).
    pub prompt_len: usize,
    pub seq: Option<Seq>,
    /// The request's sampler after generation (to continue its stream).
    pub rng: Rng,
}

#[derive(Clone, Copy, Debug)]
pub struct SchedOptions {
    /// Upper bound on tokens per forward step (prefill chunks are cut to fit).
    pub max_batch_tokens: usize,
}

impl Default for SchedOptions {
    fn default() -> Self {
        SchedOptions { max_batch_tokens: 2048 }
    }
}

struct Live {
    req: GenRequest,
    fed: usize,
    out: Vec<u32>,
    lps: Vec<f32>,
    finish: Option<Finish>,
    prompt_len: usize,
}

/// Generate for every request; outputs are in request order. `on_token` is called after every
/// step with the number of tokens generated in it (for progress bars).
pub fn generate<B: Backend>(
    model: &Model<B>,
    kv: &mut KvCache<B>,
    reqs: Vec<GenRequest>,
    opts: SchedOptions,
    mut on_token: impl FnMut(usize),
) -> Result<Vec<GenOutput>> {
    for (i, r) in reqs.iter().enumerate() {
        if r.feed.is_empty() {
            bail!("request {i}: empty prompt (at least one token must be read before generating)");
        }
    }
    let mut live: Vec<Live> = reqs
        .into_iter()
        .map(|req| {
            let prompt_len = req.seq.len + req.feed.len();
            let finish = if req.max_new == 0 { Some(Finish::Length) } else { None };
            Live { req, fed: 0, out: vec![], lps: vec![], finish, prompt_len }
        })
        .collect();
    let budget = opts.max_batch_tokens.max(1);
    let result = (|| -> Result<()> {
        loop {
            // Decode rows first (one token each), then prefill chunks in the remaining budget.
            let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (live idx, from, to) of feed or usize::MAX for decode
            let mut used = 0;
            for (i, l) in live.iter().enumerate() {
                if l.finish.is_none() && l.fed == l.req.feed.len() {
                    plan.push((i, usize::MAX, 0));
                    used += 1;
                }
            }
            for (i, l) in live.iter().enumerate() {
                if l.finish.is_none() && l.fed < l.req.feed.len() && used < budget {
                    let take = (l.req.feed.len() - l.fed).min(budget - used);
                    plan.push((i, l.fed, l.fed + take));
                    used += take;
                }
            }
            if plan.is_empty() {
                return Ok(());
            }
            crate::util::interrupt::check()?;
            // Build entries; sequences are moved out for the step's mutable borrows.
            let mut seqs: Vec<Seq> = plan.iter().map(|&(i, _, _)| std::mem::take(&mut live[i].req.seq)).collect();
            let toks: Vec<Vec<u32>> = plan
                .iter()
                .map(|&(i, a, b)| if a == usize::MAX { vec![*live[i].out.last().unwrap()] } else { live[i].req.feed[a..b].to_vec() })
                .collect();
            let wants: Vec<Want> = plan
                .iter()
                .map(|&(i, a, b)| {
                    let l = &mut live[i];
                    if a == usize::MAX || b == l.req.feed.len() {
                        let uniform = if l.req.params.is_greedy() { 0.0 } else { l.req.rng.next_f64() };
                        Want::Sample { params: l.req.params, uniform }
                    } else {
                        Want::Nothing
                    }
                })
                .collect();
            let mut entries: Vec<Entry> = seqs
                .iter_mut()
                .zip(&toks)
                .zip(wants)
                .zip(&plan)
                .map(|(((seq, t), want), &(_, a, _))| Entry { seq, tokens: t, want, sampled: a == usize::MAX })
                .collect();
            let outs = awake(&model.be, || model.step(kv, &mut entries));
            drop(entries);
            for (&(i, _, _), s) in plan.iter().zip(seqs.drain(..)) {
                live[i].req.seq = s;
            }
            // name the request and the token in the caller's terms
            let outs = outs.map_err(|e| {
                let msg = e.downcast_ref::<NonFiniteLogits>().map(|nf| {
                    let l = &live[plan[nf.entry].0];
                    let after = if l.out.is_empty() { "the prompt".to_string() } else { format!("new token {}", l.out.len()) };
                    format!(
                        "generation request {}: cannot pick new token {}: the logits after {after} (position {}) are NaN/Inf",
                        plan[nf.entry].0,
                        l.out.len() + 1,
                        nf.position
                    )
                });
                match msg {
                    Some(m) => e.context(m),
                    None => e,
                }
            })?;
            let mut produced = 0;
            for (&(i, a, b), o) in plan.iter().zip(outs) {
                let l = &mut live[i];
                if a != usize::MAX {
                    l.fed = b;
                }
                let Some(s) = o.sampled else { continue };
                produced += 1;
                l.out.push(s.token);
                l.lps.push(s.logprob);
                if l.req.stop_ids.contains(&s.token) {
                    l.finish = Some(Finish::Eos);
                } else if !l.req.stop_strings.is_empty() && hits_stop(model, &l.out, &l.req.stop_strings) {
                    l.finish = Some(Finish::Stop);
                } else if l.out.len() >= l.req.max_new {
                    l.finish = Some(Finish::Length);
                }
                if l.finish.is_some() && !l.req.keep_seq {
                    let s = std::mem::take(&mut l.req.seq);
                    kv.release(&model.be, s);
                }
            }
            on_token(produced);
        }
    })();
    if let Err(e) = result {
        for l in live {
            kv.release(&model.be, l.req.seq);
        }
        return Err(e);
    }
    Ok(live
        .into_iter()
        .map(|l| {
            let keep = l.req.keep_seq;
            GenOutput {
                new_ids: l.out,
                logprobs: l.lps,
                finish: l.finish.unwrap_or(Finish::Length),
                prompt_len: l.prompt_len,
                seq: if keep { Some(l.req.seq) } else { None },
                rng: l.req.rng,
            }
        })
        .collect())
}

/// One forward step with the CPU backend's threads kept awake between its ops (`util::awake`:
/// a decode step is ~200 short parallel ops).
fn awake<B: Backend, R>(be: &B, f: impl FnOnce() -> R) -> R {
    if be.host_compute() {
        crate::util::awake::keep_awake(f)
    } else {
        f()
    }
}

fn hits_stop<B: Backend>(model: &Model<B>, out: &[u32], stops: &[String]) -> bool {
    let Some(tok) = &model.tokenizer else { return false };
    let longest = stops.iter().map(|s| s.len()).max().unwrap_or(0);
    // A stop string of L bytes spans at most L tokens; decode a little more for safety.
    let tail = &out[out.len().saturating_sub(longest + 4)..];
    match tok.decode(tail, false) {
        Ok(text) => stops.iter().any(|s| text.contains(s.as_str())),
        Err(_) => false,
    }
}

/// Feed each sequence its tokens in chunks that fit `opts.max_batch_tokens` per step (all
/// sequences advance together). `want(i, a, b)` says what the chunk `a..b` of sequence `i` should
/// return; `on_out(i, out)` receives it. On error every sequence is released.
fn feed_chunks<B: Backend>(
    model: &Model<B>,
    kv: &mut KvCache<B>,
    seqs: &mut Vec<Seq>,
    feeds: &[Vec<u32>],
    opts: SchedOptions,
    want: impl Fn(usize, usize, usize) -> Want,
    mut on_out: impl FnMut(usize, super::forward::EntryOut),
) -> Result<()> {
    let mut cursor = vec![0usize; seqs.len()];
    let budget = opts.max_batch_tokens.max(1);
    let res = (|| -> Result<()> {
        loop {
            let mut plan = Vec::new();
            let mut used = 0;
            for i in 0..seqs.len() {
                if cursor[i] < feeds[i].len() && used < budget {
                    let take = (feeds[i].len() - cursor[i]).min(budget - used);
                    plan.push((i, cursor[i], cursor[i] + take));
                    used += take;
                }
            }
            if plan.is_empty() {
                return Ok(());
            }
            crate::util::interrupt::check()?;
            // sequences are moved out for the step's mutable borrows, and back after it
            let mut taken: Vec<Seq> = plan.iter().map(|&(i, _, _)| std::mem::take(&mut seqs[i])).collect();
            let mut entries: Vec<Entry> = plan
                .iter()
                .zip(taken.iter_mut())
                .map(|(&(i, a, b), seq)| Entry { seq, tokens: &feeds[i][a..b], want: want(i, a, b), sampled: false })
                .collect();
            let outs = awake(&model.be, || model.step(kv, &mut entries));
            drop(entries);
            for (&(i, _, b), s) in plan.iter().zip(taken.drain(..)) {
                seqs[i] = s;
                cursor[i] = b;
            }
            // entry/row of the step → sequence/index into its feed (score names the target)
            let outs = outs.map_err(|e| match e.downcast::<NonFiniteLogits>() {
                Ok(nf) => anyhow::Error::new(NonFiniteLogits { entry: plan[nf.entry].0, row: plan[nf.entry].1 + nf.row, position: nf.position }),
                Err(e) => e,
            })?;
            for (&(i, _, _), o) in plan.iter().zip(outs) {
                on_out(i, o);
            }
        }
    })();
    if res.is_err() {
        for s in seqs.drain(..) {
            kv.release(&model.be, s);
        }
    }
    res
}

/// Read `tokens` into each sequence (no outputs): e.g. a shared prefix before it is forked.
pub fn prefill<B: Backend>(model: &Model<B>, kv: &mut KvCache<B>, items: Vec<(Seq, Vec<u32>)>, opts: SchedOptions) -> Result<Vec<Seq>> {
    let (mut seqs, feeds): (Vec<Seq>, Vec<Vec<u32>>) = items.into_iter().unzip();
    feed_chunks(model, kv, &mut seqs, &feeds, opts, |_, _, _| Want::Nothing, |_, _| {})?;
    Ok(seqs)
}

pub struct ScoreRequest {
    /// Sequence to extend (empty, or a fork of a cached prompt).
    pub seq: Seq,
    /// Context tokens to read first (at least one: its last row predicts the first target).
    pub context: Vec<u32>,
    pub targets: Vec<u32>,
    pub keep_seq: bool,
}

pub struct ScoreOutput {
    pub logprobs: Vec<f32>,
    pub seq: Option<Seq>,
}

/// Teacher-forced log-probabilities of each request's targets after its context.
pub fn score<B: Backend>(model: &Model<B>, kv: &mut KvCache<B>, reqs: Vec<ScoreRequest>, opts: SchedOptions) -> Result<Vec<ScoreOutput>> {
    for (i, r) in reqs.iter().enumerate() {
        if r.context.is_empty() {
            bail!("score request {i}: the context is empty (a target needs at least one context token before it)");
        }
        if r.targets.is_empty() {
            bail!("score request {i}: the target is empty");
        }
    }
    // Tokens read per request: context ++ targets[..n-1]; row r predicts fed[r+1].
    let fed: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| r.context.iter().chain(&r.targets[..r.targets.len() - 1]).copied().collect())
        .collect();
    let mut seqs: Vec<Seq> = Vec::new();
    let mut keep = Vec::new();
    let mut ctx_len = Vec::new();
    let mut targets = Vec::new();
    for r in reqs {
        ctx_len.push(r.context.len());
        keep.push(r.keep_seq);
        targets.push(r.targets);
        seqs.push(r.seq);
    }
    let mut lps: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
    // rows a..b of fed[i]; row r predicts targets[i][r - (ctx_len - 1)] when r >= ctx_len - 1
    let want = |i: usize, a: usize, b: usize| {
        let first = (ctx_len[i] - 1).max(a);
        if first < b {
            let t0 = first - (ctx_len[i] - 1);
            Want::LogProbs { first_row: first - a, targets: targets[i][t0..t0 + (b - first)].to_vec() }
        } else {
            Want::Nothing
        }
    };
    feed_chunks(model, kv, &mut seqs, &fed, opts, want, |i, o| lps[i].extend(o.logprobs)).map_err(|e| {
        // fed row r predicts target r − (context length − 1)
        let msg = e.downcast_ref::<NonFiniteLogits>().map(|nf| {
            let t = nf.row + 1 - ctx_len[nf.entry];
            format!("score request {}: the log-probability of target {t} (position {}) is NaN/Inf", nf.entry, nf.position + 1)
        });
        match msg {
            Some(m) => e.context(m),
            None => e,
        }
    })?;
    Ok(seqs
        .into_iter()
        .zip(lps)
        .zip(keep)
        .map(|((s, l), k)| {
            let seq = if k {
                Some(s)
            } else {
                kv.release(&model.be, s);
                None
            };
            ScoreOutput { logprobs: l, seq }
        })
        .collect())
}
