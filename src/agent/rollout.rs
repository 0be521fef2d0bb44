//! The memory agent's rollouts: for every query, `n` trajectories of `K + 1` conversations
//! (K memory updates, one final answer), batched across all live conversations of all groups.
//!
//! All queries advance in lockstep over the chunk index `t`. At each `t`, the shared prefix
//! `[template head, question, section c_t]` of every query is prefilled once and forked
//! (copy-on-write) by its `n` rollouts, which then read only their own `[memory, tail]` and
//! generate. The final prompt's prefix `[head, question]` is prefilled once per query and kept:
//! the final conversations fork it, `L(∅)` is scored from it once per query, and the memory curve
//! (optional) scores `L(M_t)` from it after every chunk. `L(M_K)` extends the cache of the final
//! prompt (kept after answering, truncated before the answer) by the gold tokens.
//! With `share_prefix = false` every conversation and every score is computed from scratch (the
//! naive loop), which the tests use as the reference.
use super::templates::{PromptPlan, Templates};
use crate::backend::{Backend, SampleParams};
use crate::reward::{self, outcome, Extract, Matcher};
use crate::runtime::{self, Finish, GenRequest, KvCache, Model, SchedOptions, ScoreRequest, Seq};
use crate::util::rng::Rng;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// One question over one long document.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentQuery {
    pub id: String,
    pub question: String,
    pub context: String,
    /// Gold answers; the first is canonical (used for the gain).
    pub answers: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentConfig {
    pub chunk_tokens: usize,
    pub memory_tokens: usize,
    pub answer_tokens: usize,
    pub group_size: usize,
    /// 0 → greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// Outcome matcher of the reward (em by default).
    pub matcher: Matcher,
    /// How the answer is cut out of the final reply.
    pub extract: Extract,
    pub share_prefix: bool,
    /// Score `L(M_K) − L(∅)` (Eq. 6) with the gold answer.
    pub answer_gain: bool,
    /// Score the query-conditioned gain (question as the target).
    pub query_gain: bool,
    /// Score `L(M_t) − L(∅)` after every chunk.
    pub memory_curve: bool,
    pub max_batch_tokens: usize,
    pub seed: u64,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            chunk_tokens: 512,
            memory_tokens: 256,
            answer_tokens: 32,
            group_size: 1,
            temperature: 0.0,
            top_p: 1.0,
            matcher: Matcher::Em,
            extract: Extract::Line,
            share_prefix: true,
            answer_gain: true,
            query_gain: false,
            memory_curve: false,
            max_batch_tokens: 2048,
            seed: 0,
        }
    }
}

impl AgentConfig {
    pub fn validate(&self) -> Result<()> {
        if self.chunk_tokens == 0 || self.memory_tokens == 0 || self.answer_tokens == 0 || self.group_size == 0 {
            bail!("chunk, memory and answer budgets and the group size must be positive");
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) || !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("temperature must be >= 0 and top-p in (0, 1]");
        }
        Ok(())
    }
    fn params(&self) -> SampleParams {
        if self.temperature <= 0.0 {
            SampleParams::GREEDY
        } else {
            SampleParams { temperature: self.temperature, top_p: self.top_p }
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum ConvKind {
    Update,
    Final,
}

/// One (prompt, generation) pair of a trajectory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Conversation {
    pub kind: ConvKind,
    /// Full prompt ids (the shared prefix included).
    pub prompt_ids: Vec<u32>,
    /// Tokens of the prompt shared by the group (before the memory slot).
    pub prefix_len: usize,
    pub gen_ids: Vec<u32>,
    /// Log-probabilities of the generated tokens under the sampling policy (temperature 1).
    pub gen_logprobs: Vec<f32>,
    pub finish: Finish,
    /// Wall time of the batched generation step that produced this conversation (shared by every
    /// conversation generated in that step: prefill and decode of all live groups at chunk t).
    pub step_s: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Trajectory {
    pub query_id: String,
    pub query_index: usize,
    pub rollout: usize,
    pub conversations: Vec<Conversation>,
    /// `M_1 .. M_K` as text.
    pub memories: Vec<String>,
    pub raw_answer: String,
    pub answer: String,
    pub em: f64,
    pub sub_em: f64,
    pub f1: f64,
    /// The outcome reward under the configured matcher (0/1).
    pub outcome: f64,
    /// `L(M_K)` and `L(∅)` (mean gold log-prob) and their difference, Eq. 6.
    pub logp_memory: Option<f64>,
    pub logp_empty: Option<f64>,
    pub gain: Option<f64>,
    pub query_gain: Option<f64>,
    /// `L(M_t) − L(∅)` for t = 1..K (with `memory_curve`).
    pub memory_curve: Option<Vec<f64>>,
    /// Gold-word recall of `M_0 = ∅, M_1, .., M_K`.
    pub recall: Vec<f64>,
    /// Final reward (set by `reward::assign`).
    pub reward: Option<f64>,
    /// Wall time of the scoring passes this trajectory took part in (gain, memory curve).
    pub score_s: f64,
}

impl Trajectory {
    pub fn generated_tokens(&self) -> usize {
        self.conversations.iter().map(|c| c.gen_ids.len()).sum()
    }
    /// The lexical signal: Σ_t [recall(M_t) − recall(M_{t−1})].
    pub fn lexical_gain(&self) -> f64 {
        self.recall.windows(2).map(|w| w[1] - w[0]).sum()
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RolloutStats {
    pub queries: usize,
    pub trajectories: usize,
    pub conversations: usize,
    pub generated_tokens: usize,
    /// Prompt tokens run through the model for the conversations, and what a naive
    /// per-conversation loop would run.
    pub prefill_tokens: usize,
    pub prefill_tokens_naive: usize,
    /// Tokens run for gain scoring (and the memory curve), and the naive per-rollout figure.
    pub score_tokens: usize,
    pub score_tokens_naive: usize,
    pub update_s: f64,
    pub final_s: f64,
    pub score_s: f64,
    pub total_s: f64,
}

impl RolloutStats {
    pub fn prefill_saving(&self) -> f64 {
        self.prefill_tokens_naive as f64 / self.prefill_tokens.max(1) as f64
    }
}

struct Prepared {
    q_ids: Vec<u32>,
    gold_ids: Vec<u32>,
    chunks: Vec<Vec<u32>>,
    /// final prompt with ∅: ids and prefix length
    final_empty: (Vec<u32>, usize),
}

struct State {
    mem_text: String,
    mem_ids: Vec<u32>,
    rng: Rng,
    traj: Trajectory,
}

/// Run `cfg.group_size` rollouts for every query. `on_progress(done_conversations, total)`.
pub fn rollout<B: Backend>(
    model: &Model<B>,
    kv: &mut KvCache<B>,
    queries: &[AgentQuery],
    cfg: &AgentConfig,
    templates: &Templates,
    mut on_progress: impl FnMut(usize, usize),
) -> Result<(Vec<Vec<Trajectory>>, RolloutStats)> {
    cfg.validate()?;
    templates.validate()?;
    let t_start = Instant::now();
    let tok = model.tokenizer()?;
    let upd = PromptPlan::new(tok, &templates.update)?;
    let fin = PromptPlan::new(tok, &templates.final_)?;
    let empty_ids = tok.encode(&templates.empty_memory)?;
    let n = cfg.group_size;
    let eos = model.eos_ids();
    let opts = SchedOptions { max_batch_tokens: cfg.max_batch_tokens };
    let share = cfg.share_prefix;
    let mut st = RolloutStats { queries: queries.len(), trajectories: queries.len() * n, ..Default::default() };

    let mut prep = Vec::with_capacity(queries.len());
    for (qi, q) in queries.iter().enumerate() {
        let gold = q.answers.first().map(|s| s.trim()).unwrap_or("");
        if gold.is_empty() {
            bail!("query {} ({}): no gold answer (answers must be non-empty)", qi, q.id);
        }
        let doc = tok.encode(&q.context)?;
        let q_ids = tok.encode(&q.question)?;
        if q_ids.is_empty() {
            bail!("query {} ({}): empty question", qi, q.id);
        }
        let chunks: Vec<Vec<u32>> = doc.chunks(cfg.chunk_tokens).map(|c| c.to_vec()).collect();
        let final_empty = fin.build(&q_ids, &[], &empty_ids);
        prep.push(Prepared { gold_ids: tok.encode(gold)?, q_ids, chunks, final_empty });
    }
    let total_convs: usize = prep.iter().map(|p| n * (p.chunks.len() + 1)).sum();
    let mut done_convs = 0;
    on_progress(0, total_convs);

    let mut states: Vec<Vec<State>> = queries
        .iter()
        .enumerate()
        .map(|(qi, q)| {
            (0..n)
                .map(|i| State {
                    mem_text: templates.empty_memory.clone(),
                    mem_ids: empty_ids.clone(),
                    rng: Rng::derive(cfg.seed, ((qi as u64) << 24) | i as u64),
                    traj: Trajectory {
                        query_id: q.id.clone(),
                        query_index: qi,
                        rollout: i,
                        conversations: vec![],
                        memories: vec![],
                        raw_answer: String::new(),
                        answer: String::new(),
                        em: 0.0,
                        sub_em: 0.0,
                        f1: 0.0,
                        outcome: 0.0,
                        logp_memory: None,
                        logp_empty: None,
                        gain: None,
                        query_gain: None,
                        memory_curve: if cfg.memory_curve { Some(vec![]) } else { None },
                        recall: vec![outcome::word_recall(&templates.empty_memory, &q.answers)],
                        reward: None,
                        score_s: 0.0,
                    },
                })
                .collect()
        })
        .collect();

    // Final-prompt prefixes [head, question], kept for the whole run (shared mode).
    let mut final_prefix: Vec<Option<Seq>> = (0..queries.len()).map(|_| None).collect();
    let mut result = Ok(());
    let mut run = || -> Result<()> {
        let t0 = Instant::now();
        if share {
            let items = prep.iter().map(|p| (Seq::default(), p.final_empty.0[..p.final_empty.1].to_vec())).collect();
            st.prefill_tokens += prep.iter().map(|p| p.final_empty.1).sum::<usize>();
            for (slot, s) in final_prefix.iter_mut().zip(runtime::prefill(model, kv, items, opts)?) {
                *slot = Some(s);
            }
        }
        // L(∅) (and its query-conditioned twin): once per query in shared mode.
        let targets_of = |p: &Prepared| {
            let mut t = vec![];
            if cfg.answer_gain || cfg.memory_curve {
                t.push(p.gold_ids.clone());
            }
            if cfg.query_gain {
                t.push(p.q_ids.clone());
            }
            t
        };
        let mut empty_lp: Vec<Vec<f64>> = vec![vec![]; queries.len()];
        {
            let mut reqs = vec![];
            let mut owner = vec![];
            for (qi, p) in prep.iter().enumerate() {
                for (k, tg) in targets_of(p).into_iter().enumerate() {
                    let (ids, pf) = &p.final_empty;
                    // naive: a per-rollout loop scores ∅ for each of the n rollouts
                    st.score_tokens_naive += n * (ids.len() + tg.len() - 1);
                    let (seq, context) = match &final_prefix[qi] {
                        Some(s) => (kv.fork(s), ids[*pf..].to_vec()),
                        None => (Seq::default(), ids.clone()),
                    };
                    st.score_tokens += context.len() + tg.len() - 1;
                    reqs.push(ScoreRequest { seq, context, targets: tg, keep_seq: false });
                    owner.push((qi, k));
                }
            }
            if !reqs.is_empty() {
                for ((qi, _), o) in owner.into_iter().zip(runtime::score(model, kv, reqs, opts)?) {
                    empty_lp[qi].push(reward::mean_logprob(&o.logprobs));
                }
            }
        }
        st.score_s += t0.elapsed().as_secs_f64();

        let max_k = prep.iter().map(|p| p.chunks.len()).max().unwrap_or(0);
        for t in 0..=max_k {
            let upd_q: Vec<usize> = (0..prep.len()).filter(|&q| t < prep[q].chunks.len()).collect();
            let fin_q: Vec<usize> = (0..prep.len()).filter(|&q| t == prep[q].chunks.len()).collect();
            if upd_q.is_empty() && fin_q.is_empty() {
                break;
            }
            let t_gen = Instant::now();
            // shared section prefixes of this step
            let mut sec_prefix: Vec<Option<Seq>> = (0..prep.len()).map(|_| None).collect();
            if share && !upd_q.is_empty() {
                let items: Vec<(Seq, Vec<u32>)> = upd_q
                    .iter()
                    .map(|&q| {
                        let p = &prep[q];
                        let (ids, pf) = upd.build(&p.q_ids, &p.chunks[t], &empty_ids);
                        st.prefill_tokens += pf;
                        (Seq::default(), ids[..pf].to_vec())
                    })
                    .collect();
                for (&q, s) in upd_q.iter().zip(runtime::prefill(model, kv, items, opts)?) {
                    sec_prefix[q] = Some(s);
                }
            }
            let mut reqs = Vec::new();
            let mut who = Vec::new(); // (query, rollout, kind, prompt ids, prefix len)
            for (&q, is_final) in upd_q.iter().map(|q| (q, false)).chain(fin_q.iter().map(|q| (q, true))) {
                let p = &prep[q];
                for (i, s) in states[q].iter_mut().enumerate() {
                    let (ids, pf) = if is_final { fin.build(&p.q_ids, &[], &s.mem_ids) } else { upd.build(&p.q_ids, &p.chunks[t], &s.mem_ids) };
                    let base = if is_final { &final_prefix[q] } else { &sec_prefix[q] };
                    let (seq, feed) = match base {
                        Some(b) => (kv.fork(b), ids[pf..].to_vec()),
                        None => (Seq::default(), ids.clone()),
                    };
                    st.prefill_tokens += feed.len();
                    st.prefill_tokens_naive += ids.len();
                    reqs.push(GenRequest {
                        seq,
                        feed,
                        max_new: if is_final { cfg.answer_tokens } else { cfg.memory_tokens },
                        params: cfg.params(),
                        rng: std::mem::replace(&mut s.rng, Rng::new(0)),
                        stop_ids: eos.clone(),
                        stop_strings: vec![],
                        keep_seq: is_final && (cfg.answer_gain || cfg.query_gain),
                    });
                    who.push((q, i, is_final, ids, pf));
                }
            }
            for s in sec_prefix.into_iter().flatten() {
                kv.release(&model.be, s);
            }
            let n_req = reqs.len();
            let outs = runtime::generate(model, kv, reqs, opts, |_| {})?;
            let dt = t_gen.elapsed().as_secs_f64();
            if upd_q.is_empty() {
                st.final_s += dt;
            } else {
                st.update_s += dt;
            }
            done_convs += n_req;
            on_progress(done_convs, total_convs);

            let mut kept = Vec::new(); // (q, i, seq, prompt ids) of finals for gain scoring
            for ((q, i, is_final, ids, pf), o) in who.into_iter().zip(outs) {
                let s = &mut states[q][i];
                // each rollout's sampler stream continues across its conversations
                s.rng = o.rng;
                st.generated_tokens += o.new_ids.len();
                let body: &[u32] = if o.finish == Finish::Eos { &o.new_ids[..o.new_ids.len() - 1] } else { &o.new_ids };
                let text = tok.decode(body, true)?;
                s.traj.conversations.push(Conversation {
                    kind: if is_final { ConvKind::Final } else { ConvKind::Update },
                    prompt_ids: ids.clone(),
                    prefix_len: pf,
                    gen_ids: o.new_ids.clone(),
                    gen_logprobs: o.logprobs.clone(),
                    finish: o.finish,
                    step_s: dt,
                });
                let golds = &queries[q].answers;
                if is_final {
                    s.traj.raw_answer = text.clone();
                    s.traj.answer = outcome::extract(cfg.extract, &text);
                    s.traj.em = outcome::em(&s.traj.answer, golds);
                    s.traj.sub_em = outcome::sub_em(&s.traj.answer, golds);
                    s.traj.f1 = outcome::f1(&s.traj.answer, golds);
                    s.traj.outcome = outcome::score(cfg.matcher, &s.traj.answer, golds).round();
                    if let Some(seq) = o.seq {
                        kept.push((q, i, seq, ids));
                    }
                } else {
                    let mem = text.trim();
                    s.mem_text = if mem.is_empty() { templates.empty_memory.clone() } else { mem.to_string() };
                    s.mem_ids = tok.encode(&s.mem_text)?;
                    s.traj.memories.push(s.mem_text.clone());
                    s.traj.recall.push(outcome::word_recall(&s.mem_text, golds));
                }
            }

            // ---- scoring: final gains, and the memory curve of this step's updates ----
            let t_sc = Instant::now();
            let mut reqs = Vec::new();
            let mut tags = Vec::new(); // (q, i, what): 0 = answer gain, 1 = query gain, 2 = curve
            for (q, i, seq, ids) in kept {
                let p = &prep[q];
                let mut targets = vec![];
                if cfg.answer_gain {
                    targets.push((0u8, p.gold_ids.clone()));
                }
                if cfg.query_gain {
                    targets.push((1u8, p.q_ids.clone()));
                }
                for (what, tg) in targets {
                    st.score_tokens_naive += ids.len() + tg.len() - 1;
                    let (s, context) = if share {
                        // extend the answered prompt's cache: drop the answer and the last prompt
                        // token, whose row then predicts the first target token
                        let mut f = kv.fork(&seq);
                        kv.truncate(&model.be, &mut f, ids.len() - 1);
                        (f, vec![ids[ids.len() - 1]])
                    } else {
                        (Seq::default(), ids.clone())
                    };
                    st.score_tokens += context.len() + tg.len() - 1;
                    reqs.push(ScoreRequest { seq: s, context, targets: tg, keep_seq: false });
                    tags.push((q, i, what));
                }
                kv.release(&model.be, seq);
            }
            if cfg.memory_curve {
                for &q in &upd_q {
                    let p = &prep[q];
                    for (i, s) in states[q].iter().enumerate() {
                        let (ids, pf) = fin.build(&p.q_ids, &[], &s.mem_ids);
                        st.score_tokens_naive += ids.len() + p.gold_ids.len() - 1;
                        let (seq, context) = match &final_prefix[q] {
                            Some(b) => (kv.fork(b), ids[pf..].to_vec()),
                            None => (Seq::default(), ids),
                        };
                        st.score_tokens += context.len() + p.gold_ids.len() - 1;
                        reqs.push(ScoreRequest { seq, context, targets: p.gold_ids.clone(), keep_seq: false });
                        tags.push((q, i, 2));
                    }
                }
            }
            if !reqs.is_empty() {
                let scored = runtime::score(model, kv, reqs, opts)?;
                let dt = t_sc.elapsed().as_secs_f64();
                let mut seen = std::collections::HashSet::new();
                for &(q, i, _) in &tags {
                    if seen.insert((q, i)) {
                        states[q][i].traj.score_s += dt;
                    }
                }
                for ((q, i, what), o) in tags.into_iter().zip(scored) {
                    let l = reward::mean_logprob(&o.logprobs);
                    let tr = &mut states[q][i].traj;
                    match what {
                        0 => {
                            tr.logp_memory = Some(l);
                            tr.logp_empty = Some(empty_lp[q][0]);
                            tr.gain = Some(l - empty_lp[q][0]);
                        }
                        1 => tr.query_gain = Some(l - *empty_lp[q].last().unwrap()),
                        _ => tr.memory_curve.get_or_insert_with(Vec::new).push(l - empty_lp[q][0]),
                    }
                }
            }
            st.score_s += t_sc.elapsed().as_secs_f64();
        }
        Ok(())
    };
    if let Err(e) = run() {
        result = Err(e);
    }
    for s in final_prefix.into_iter().flatten() {
        kv.release(&model.be, s);
    }
    result?;
    st.conversations = total_convs;
    st.total_s = t_start.elapsed().as_secs_f64();
    let trajs = states.into_iter().map(|g| g.into_iter().map(|s| s.traj).collect()).collect();
    Ok((trajs, st))
}
