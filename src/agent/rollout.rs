//! The memory agent's rollouts: for every query, `n` trajectories of `K + 1` turns (K memory
//! updates, one final answer), batched across all live conversations of all groups.
//!
//! All queries advance in lockstep over the chunk index `t`. At each `t`, the shared prefix
//! `[template head, question, section c_t]` of every query — and on as far as its rollouts'
//! prompts agree: at `t = 0`, where every memory is the empty one, all but the last token — is
//! prefilled once and forked (copy-on-write) by its `n` rollouts, which then read only the rest
//! (`[memory, tail]`) and generate. The final prompt's prefix `[head, question]` is prefilled once per query and kept:
//! the final conversations fork it, `L(∅)` is scored from it once per query, and the memory curve
//! (optional) scores `L(M_t)` from it after every chunk. `L(M_K)` extends the cache of the final
//! prompt (kept after answering, truncated before the answer) by the gold tokens.
//! With `share_prefix = false` every conversation and every score is computed from scratch (the
//! naive loop), which the tests use as the reference.
//!
//! [`rollout`] lists the phases; each is a function below, in the order they run.
use super::budget::Budget;
use super::templates::{is_keep, PromptPlan, Templates};
use super::trajectory::{ConvKind, Conversation, Trajectory, Turn};
use crate::backend::{Backend, SampleParams};
use crate::data::QaRecord;
use crate::model::tokenizer::TextTokenizer;
use crate::reward::{self, outcome, Extract, Matcher};
use crate::runtime::{self, Finish, GenOutput, GenRequest, KvCache, Model, SchedOptions, ScoreOutput, ScoreRequest, Seq};
use crate::util::rng::Rng;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentConfig {
    /// Chunk, memory and answer tokens (flat keys in JSON).
    #[serde(flatten)]
    pub budget: Budget,
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
            budget: Budget::default(),
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
        self.budget.check()?;
        if self.group_size == 0 {
            bail!("the group size must be positive");
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
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

/// Run `cfg.group_size` rollouts for every query. `on_progress(done_conversations, total)`.
pub fn rollout<B: Backend>(
    model: &Model<B>,
    kv: &mut KvCache<B>,
    queries: &[QaRecord],
    cfg: &AgentConfig,
    templates: &Templates,
    mut on_progress: impl FnMut(usize, usize),
) -> Result<(Vec<Vec<Trajectory>>, RolloutStats)> {
    cfg.validate()?;
    templates.validate()?;
    let t_start = Instant::now();
    let cx = Ctx::new(model, cfg, templates)?;
    let mut st = RolloutStats { queries: queries.len(), trajectories: queries.len() * cfg.group_size, ..Default::default() };
    let prep = prepare(&cx, queries)?;
    let total_convs: usize = prep.iter().map(|p| cfg.group_size * (p.chunks.len() + 1)).sum();
    on_progress(0, total_convs);
    let mut states = start_states(&cx, queries);
    let final_prefix = prefill_final_prefixes(&cx, kv, &prep, &mut st)?;
    let result = read_chunks(&cx, kv, queries, &prep, &final_prefix, &mut states, &mut st, |done| on_progress(done, total_convs));
    // held until here whether or not every chunk was read
    release_all(&cx, kv, final_prefix);
    result?;
    st.conversations = total_convs;
    st.total_s = t_start.elapsed().as_secs_f64();
    Ok((states.into_iter().map(|g| g.into_iter().map(|s| s.traj).collect()).collect(), st))
}

/// `L(∅)` once per query, then chunk by chunk: generate the updates and answers, record them as
/// turns (memories, outcomes), score the gains and the memory curve.
#[allow(clippy::too_many_arguments)]
fn read_chunks<B: Backend>(
    cx: &Ctx<B>,
    kv: &mut KvCache<B>,
    queries: &[QaRecord],
    prep: &[Prepared],
    final_prefix: &[Option<Seq>],
    states: &mut [Vec<State>],
    st: &mut RolloutStats,
    mut on_progress: impl FnMut(usize),
) -> Result<()> {
    let empty = score_empty(cx, kv, prep, final_prefix, st)?;
    // each query's last section prefix, held until the next step's is read from it
    let mut held: Vec<Option<Held>> = (0..prep.len()).map(|_| None).collect();
    let mut done_convs = 0;
    let mut run = || -> Result<()> {
        for step in steps(prep) {
            let (generated, step_s) = generate_step(cx, kv, prep, final_prefix, &mut held, &step, states, st)?;
            done_convs += generated.len();
            on_progress(done_convs);
            let answered = record_turns(cx, queries, states, generated, step_s, st)?;
            score_step(cx, kv, prep, final_prefix, &empty, &step, answered, states, st)?;
        }
        Ok(())
    };
    let result = run();
    release_all(cx, kv, held.into_iter().map(|h| h.map(|h| h.seq)).collect());
    result
}

/// A prefilled prompt prefix kept in the cache for later prompts that begin the same way.
struct Held {
    seq: Seq,
    ids: Vec<u32>,
}

/// What every phase reads: the model, the configuration and the tokenized templates.
struct Ctx<'a, B: Backend> {
    model: &'a Model<B>,
    cfg: &'a AgentConfig,
    templates: &'a Templates,
    tok: &'a TextTokenizer,
    upd: PromptPlan,
    fin: PromptPlan,
    empty_ids: Vec<u32>,
    eos: Vec<u32>,
    opts: SchedOptions,
}

impl<'a, B: Backend> Ctx<'a, B> {
    fn new(model: &'a Model<B>, cfg: &'a AgentConfig, templates: &'a Templates) -> Result<Self> {
        let tok = model.tokenizer()?;
        Ok(Ctx {
            model,
            cfg,
            templates,
            tok,
            upd: PromptPlan::new(tok, &templates.update)?,
            fin: PromptPlan::new(tok, &templates.final_)?,
            empty_ids: tok.encode(&templates.empty_memory)?,
            eos: model.eos_ids(),
            opts: SchedOptions { max_batch_tokens: cfg.max_batch_tokens },
        })
    }
}

/// A query, tokenized.
struct Prepared {
    q_ids: Vec<u32>,
    gold_ids: Vec<u32>,
    chunks: Vec<Vec<u32>>,
    /// final prompt with ∅: ids and prefix length
    final_empty: (Vec<u32>, usize),
}

/// One rollout in progress: its current memory, its sampler stream and what it has produced.
struct State {
    mem_text: String,
    mem_ids: Vec<u32>,
    rng: Rng,
    traj: Trajectory,
}

/// What a scoring pass measures, as `L − L(∅)` with the matching `L(∅)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScoreKind {
    /// The gold answer after the final memory `M_K` (Eq. 6).
    AnswerGain,
    /// The question after `M_K`.
    QueryGain,
    /// The gold answer after the memory `M_t` of this step.
    MemoryCurve,
}

/// `L(∅)` of one query, of the gold answer (for the gain and the curve) and of the question.
#[derive(Default)]
struct EmptyScores {
    answer: Option<f64>,
    question: Option<f64>,
}

/// The queries live at chunk index `t`: those reading chunk `t` (a memory update) and those
/// whose document has ended (the final answer).
struct Step {
    t: usize,
    updates: Vec<usize>,
    finals: Vec<usize>,
}

/// A conversation sent to generation: whose it is and its prompt.
struct Pending {
    q: usize,
    i: usize,
    kind: ConvKind,
    prompt: Vec<u32>,
    prefix_len: usize,
}

/// A final answer whose sequence stayed in the cache for its gain.
struct Answered {
    q: usize,
    i: usize,
    seq: Seq,
    prompt: Vec<u32>,
}

/// Who a score request belongs to and what it measures.
struct ScoreTag {
    q: usize,
    i: usize,
    kind: ScoreKind,
}

/// Tokenize every query (question, gold answer, document chunks, final prompt over ∅).
fn prepare<B: Backend>(cx: &Ctx<B>, queries: &[QaRecord]) -> Result<Vec<Prepared>> {
    let mut prep = Vec::with_capacity(queries.len());
    for (qi, q) in queries.iter().enumerate() {
        let gold = q.answers.first().map(|s| s.trim()).unwrap_or("");
        if gold.is_empty() {
            bail!("query {} ({}): no gold answer (answers must be non-empty)", qi, q.id);
        }
        let doc = cx.tok.encode(&q.context)?;
        let q_ids = cx.tok.encode(&q.question)?;
        if q_ids.is_empty() {
            bail!("query {} ({}): empty question", qi, q.id);
        }
        let chunks: Vec<Vec<u32>> = doc.chunks(cx.cfg.budget.chunk_tokens).map(|c| c.to_vec()).collect();
        let final_empty = cx.fin.build(&q_ids, &[], &cx.empty_ids);
        prep.push(Prepared { gold_ids: cx.tok.encode(gold)?, q_ids, chunks, final_empty });
    }
    Ok(prep)
}

/// `n` rollouts per query, each with the empty memory and its own sampler stream.
fn start_states<B: Backend>(cx: &Ctx<B>, queries: &[QaRecord]) -> Vec<Vec<State>> {
    queries
        .iter()
        .enumerate()
        .map(|(qi, q)| {
            (0..cx.cfg.group_size)
                .map(|i| State {
                    mem_text: cx.templates.empty_memory.clone(),
                    mem_ids: cx.empty_ids.clone(),
                    rng: Rng::derive(cx.cfg.seed, ((qi as u64) << 24) | i as u64),
                    traj: Trajectory::start(&q.id, qi, i, &cx.templates.empty_memory, &q.answers, cx.cfg.memory_curve),
                })
                .collect()
        })
        .collect()
}

/// The final prompts' prefixes `[head, question]`, prefilled once per query and held for the
/// whole run (shared mode; all `None` otherwise). Counted as scoring time: `L(∅)` reads them first.
fn prefill_final_prefixes<B: Backend>(cx: &Ctx<B>, kv: &mut KvCache<B>, prep: &[Prepared], st: &mut RolloutStats) -> Result<Vec<Option<Seq>>> {
    let t0 = Instant::now();
    let mut final_prefix: Vec<Option<Seq>> = (0..prep.len()).map(|_| None).collect();
    if cx.cfg.share_prefix {
        let items = prep.iter().map(|p| (Seq::default(), p.final_empty.0[..p.final_empty.1].to_vec())).collect();
        st.prefill_tokens += prep.iter().map(|p| p.final_empty.1).sum::<usize>();
        for (slot, s) in final_prefix.iter_mut().zip(runtime::prefill(cx.model, kv, items, cx.opts)?) {
            *slot = Some(s);
        }
    }
    st.score_s += t0.elapsed().as_secs_f64();
    Ok(final_prefix)
}

/// `L(∅)` of the gold answer (when the gain or the curve is scored) and of the question (for the
/// query gain): once per query in shared mode, where a naive loop scores it per rollout.
fn score_empty<B: Backend>(cx: &Ctx<B>, kv: &mut KvCache<B>, prep: &[Prepared], final_prefix: &[Option<Seq>], st: &mut RolloutStats) -> Result<Vec<EmptyScores>> {
    let t0 = Instant::now();
    let cfg = cx.cfg;
    let mut reqs = vec![];
    let mut owner = vec![];
    for (qi, p) in prep.iter().enumerate() {
        let mut targets = vec![];
        if cfg.answer_gain || cfg.memory_curve {
            targets.push((ScoreKind::AnswerGain, &p.gold_ids));
        }
        if cfg.query_gain {
            targets.push((ScoreKind::QueryGain, &p.q_ids));
        }
        for (kind, tg) in targets {
            let (ids, pf) = &p.final_empty;
            // naive: a per-rollout loop scores ∅ for each of the n rollouts
            st.score_tokens_naive += cfg.group_size * (ids.len() + tg.len() - 1);
            let (seq, context) = match &final_prefix[qi] {
                Some(s) => (kv.fork(s), ids[*pf..].to_vec()),
                None => (Seq::default(), ids.clone()),
            };
            st.score_tokens += context.len() + tg.len() - 1;
            reqs.push(ScoreRequest { seq, context, targets: tg.clone(), keep_seq: false });
            owner.push((qi, kind));
        }
    }
    let mut empty: Vec<EmptyScores> = (0..prep.len()).map(|_| EmptyScores::default()).collect();
    if !reqs.is_empty() {
        for ((qi, kind), o) in owner.into_iter().zip(runtime::score(cx.model, kv, reqs, cx.opts)?) {
            let l = reward::mean_logprob(&o.logprobs);
            match kind {
                ScoreKind::QueryGain => empty[qi].question = Some(l),
                _ => empty[qi].answer = Some(l),
            }
        }
    }
    st.score_s += t0.elapsed().as_secs_f64();
    Ok(empty)
}

/// The steps `t = 0..=K_max`, each with the queries that update or answer at it.
fn steps(prep: &[Prepared]) -> Vec<Step> {
    let max_k = prep.iter().map(|p| p.chunks.len()).max().unwrap_or(0);
    let mut out = Vec::new();
    for t in 0..=max_k {
        let updates: Vec<usize> = (0..prep.len()).filter(|&q| t < prep[q].chunks.len()).collect();
        let finals: Vec<usize> = (0..prep.len()).filter(|&q| t == prep[q].chunks.len()).collect();
        if updates.is_empty() && finals.is_empty() {
            break;
        }
        out.push(Step { t, updates, finals });
    }
    out
}

/// One batched generation: every rollout of the step's queries, memory updates (from the shared
/// section prefix) and final answers (from the final prefix). Returns each conversation with its
/// output, in request order, and the step's wall time.
#[allow(clippy::too_many_arguments)]
fn generate_step<B: Backend>(
    cx: &Ctx<B>,
    kv: &mut KvCache<B>,
    prep: &[Prepared],
    final_prefix: &[Option<Seq>],
    held: &mut [Option<Held>],
    step: &Step,
    states: &mut [Vec<State>],
    st: &mut RolloutStats,
) -> Result<(Vec<(Pending, GenOutput)>, f64)> {
    let t_gen = Instant::now();
    let live: Vec<(usize, ConvKind)> = step.updates.iter().map(|&q| (q, ConvKind::Update)).chain(step.finals.iter().map(|&q| (q, ConvKind::Final))).collect();
    let prompts: Vec<Vec<(Vec<u32>, usize)>> = live
        .iter()
        .map(|&(q, kind)| {
            let p = &prep[q];
            states[q]
                .iter()
                .map(|s| if kind == ConvKind::Final { cx.fin.build(&p.q_ids, &[], &s.mem_ids) } else { cx.upd.build(&p.q_ids, &p.chunks[step.t], &s.mem_ids) })
                .collect()
        })
        .collect();
    let sec_prefix = prefill_section_prefixes(cx, kv, prep, final_prefix, held, &live, &prompts, st)?;
    let mut reqs = Vec::new();
    let mut pending = Vec::new();
    for ((&(q, kind), group), sec) in live.iter().zip(prompts).zip(&sec_prefix) {
        let is_final = kind == ConvKind::Final;
        for (i, (s, (ids, pf))) in states[q].iter_mut().zip(group).enumerate() {
            // an update reads on from its section prefix, a final answer from the final prefix
            let base = if is_final { final_prefix[q].as_ref().map(|b| (b, pf)) } else { sec.as_ref().map(|h| (&h.seq, h.ids.len())) };
            let (seq, feed) = match base {
                Some((b, len)) => (kv.fork(b), ids[len..].to_vec()),
                None => (Seq::default(), ids.clone()),
            };
            st.prefill_tokens += feed.len();
            st.prefill_tokens_naive += ids.len();
            reqs.push(GenRequest {
                seq,
                feed,
                max_new: if is_final { cx.cfg.budget.answer_tokens } else { cx.cfg.budget.memory_tokens },
                params: cx.cfg.params(),
                rng: std::mem::replace(&mut s.rng, Rng::new(0)),
                stop_ids: cx.eos.clone(),
                stop_strings: vec![],
                keep_seq: is_final && (cx.cfg.answer_gain || cx.cfg.query_gain),
            });
            pending.push(Pending { q, i, kind, prompt: ids, prefix_len: pf });
        }
    }
    // the new section prefixes replace the held ones (the next step's begin with the same head);
    // a query answering now reads no more sections
    for (&(q, kind), sec) in live.iter().zip(sec_prefix) {
        let old = match kind {
            ConvKind::Final => held[q].take(),
            ConvKind::Update => sec.and_then(|h| held[q].replace(h)),
        };
        if let Some(old) = old {
            kv.release(&cx.model.be, old.seq);
        }
    }
    let outs = runtime::generate(cx.model, kv, reqs, cx.opts, |_| {})?;
    let dt = t_gen.elapsed().as_secs_f64();
    if step.updates.is_empty() {
        st.final_s += dt;
    } else {
        st.update_s += dt;
    }
    Ok((pending.into_iter().zip(outs).collect(), dt))
}

/// The section prefixes of the step's memory updates, one per updating query (shared mode; all
/// `None` otherwise), each with its length: `[head, question, c_t]` and on as far as every
/// rollout's prompt agrees, less the last token (each rollout reads one of its own to sample
/// from). At `t = 0` every memory is the empty one, so the group's prompts are equal and the
/// whole prompt is read once instead of `n` times; later the memories differ and the prefix
/// ends at or soon after the memory slot.
///
/// A prefix is read on from the longest run of its tokens already in the cache: the query's
/// previous section prefix (`held`: the template head and the question, up to the chunk) or its
/// final prefix (the chat template's system turn), forked and cut there.
#[allow(clippy::too_many_arguments)]
fn prefill_section_prefixes<B: Backend>(
    cx: &Ctx<B>,
    kv: &mut KvCache<B>,
    prep: &[Prepared],
    final_prefix: &[Option<Seq>],
    held: &[Option<Held>],
    live: &[(usize, ConvKind)],
    prompts: &[Vec<(Vec<u32>, usize)>],
    st: &mut RolloutStats,
) -> Result<Vec<Option<Held>>> {
    let mut sec_prefix: Vec<Option<Held>> = live.iter().map(|_| None).collect();
    if !cx.cfg.share_prefix {
        return Ok(sec_prefix);
    }
    let mut items = vec![];
    let mut at = vec![];
    for (j, (&(q, kind), group)) in live.iter().zip(prompts).enumerate() {
        if let (ConvKind::Update, Some((first, _))) = (kind, group.first()) {
            let len = shared_len(group.iter().map(|(ids, _)| ids.as_slice()));
            let want = &first[..len];
            let (fin, fin_len) = &prep[q].final_empty;
            let cached = [held[q].as_ref().map(|h| (&h.seq, h.ids.as_slice())), final_prefix[q].as_ref().map(|s| (s, &fin[..*fin_len]))];
            // at least one token is read (a prefill item is never empty)
            let best = cached.into_iter().flatten().map(|(s, ids)| (s, common_len(ids, want).min(len.saturating_sub(1)))).max_by_key(|c| c.1);
            let (seq, from) = match best {
                Some((s, n)) if n > 0 => {
                    let mut f = kv.fork(s);
                    kv.truncate(&cx.model.be, &mut f, n);
                    (f, n)
                }
                _ => (Seq::default(), 0),
            };
            st.prefill_tokens += len - from;
            items.push((seq, want[from..].to_vec()));
            at.push((j, want.to_vec()));
        }
    }
    if !items.is_empty() {
        for ((j, ids), seq) in at.into_iter().zip(runtime::prefill(cx.model, kv, items, cx.opts)?) {
            sec_prefix[j] = Some(Held { seq, ids });
        }
    }
    Ok(sec_prefix)
}

/// How many leading tokens `a` and `b` have in common.
fn common_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The longest prefix common to all `prompts`, shortened to leave each at least one token.
fn shared_len<'p>(mut prompts: impl Iterator<Item = &'p [u32]>) -> usize {
    let Some(first) = prompts.next() else { return 0 };
    let mut len = first.len().saturating_sub(1);
    for p in prompts {
        len = len.min(p.len().saturating_sub(1));
        len = common_len(&first[..len], p);
    }
    len
}

/// Append each generation to its trajectory as a turn: an update's reply becomes the memory, a
/// final reply gives the answer and its outcome. Returns the answers kept for their gains.
fn record_turns<B: Backend>(cx: &Ctx<B>, queries: &[QaRecord], states: &mut [Vec<State>], generated: Vec<(Pending, GenOutput)>, step_s: f64, st: &mut RolloutStats) -> Result<Vec<Answered>> {
    let mut answered = Vec::new();
    for (p, o) in generated {
        let s = &mut states[p.q][p.i];
        // each rollout's sampler stream continues across its conversations
        s.rng = o.rng;
        st.generated_tokens += o.new_ids.len();
        let body: &[u32] = if o.finish == Finish::Eos { &o.new_ids[..o.new_ids.len() - 1] } else { &o.new_ids };
        let text = cx.tok.decode(body, true)?;
        s.traj.turns.push(Turn {
            kind: p.kind,
            conv: Conversation { prompt: p.prompt.clone(), response: o.new_ids, ..Default::default() },
            prefix_len: p.prefix_len,
            gen_logprobs: o.logprobs,
            finish: o.finish,
            step_s,
        });
        let golds = &queries[p.q].answers;
        match p.kind {
            ConvKind::Final => {
                judge_answer(cx.cfg, &mut s.traj, text, golds);
                if let Some(seq) = o.seq {
                    answered.push(Answered { q: p.q, i: p.i, seq, prompt: p.prompt });
                }
            }
            ConvKind::Update => take_memory(cx, s, &text, golds)?,
        }
    }
    Ok(answered)
}

/// The outcome (Eq. 5): the answer cut out of the final reply, matched against the golds.
fn judge_answer(cfg: &AgentConfig, traj: &mut Trajectory, reply: String, golds: &[String]) {
    traj.answer = outcome::extract(cfg.extract, &reply);
    traj.raw_answer = reply;
    traj.em = outcome::em(&traj.answer, golds);
    traj.sub_em = outcome::sub_em(&traj.answer, golds);
    traj.f1 = outcome::f1(&traj.answer, golds);
    traj.outcome = outcome::score(cfg.matcher, &traj.answer, golds).round();
}

/// An update's reply becomes the next memory (the empty-memory text when it is blank), unless it
/// is the templates' keep word: then the memory stays as it was (docs/DESIGN.md §1.1).
fn take_memory<B: Backend>(cx: &Ctx<B>, s: &mut State, reply: &str, golds: &[String]) -> Result<()> {
    let next = next_memory(cx.templates, reply);
    if cx.templates.keep.is_some() {
        s.traj.kept.push(next.is_none());
    }
    if let Some(mem) = next {
        s.mem_ids = cx.tok.encode(&mem)?;
        s.mem_text = mem;
    }
    s.traj.memories.push(s.mem_text.clone());
    s.traj.recall.push(outcome::word_recall(&s.mem_text, golds));
    Ok(())
}

/// The memory an update's reply writes: `Some(M_t)`, or `None` for the keep action
/// (`M_t = M_{t−1}`).
pub fn next_memory(templates: &Templates, reply: &str) -> Option<String> {
    if templates.keep.as_deref().is_some_and(|w| is_keep(reply, w)) {
        return None;
    }
    let mem = reply.trim();
    Some(if mem.is_empty() { templates.empty_memory.clone() } else { mem.to_string() })
}

/// One scoring pass for the step: the gains of the answers, then (with `memory_curve`) the curve
/// point `L(M_t)` of every rollout that updated its memory.
#[allow(clippy::too_many_arguments)]
fn score_step<B: Backend>(
    cx: &Ctx<B>,
    kv: &mut KvCache<B>,
    prep: &[Prepared],
    final_prefix: &[Option<Seq>],
    empty: &[EmptyScores],
    step: &Step,
    answered: Vec<Answered>,
    states: &mut [Vec<State>],
    st: &mut RolloutStats,
) -> Result<()> {
    let t_sc = Instant::now();
    let mut batch = gain_requests(cx, kv, prep, answered, st);
    if cx.cfg.memory_curve {
        batch.extend(curve_requests(cx, kv, prep, final_prefix, &step.updates, states, st));
    }
    if !batch.is_empty() {
        let (tags, reqs): (Vec<ScoreTag>, Vec<ScoreRequest>) = batch.into_iter().unzip();
        let scored = runtime::score(cx.model, kv, reqs, cx.opts)?;
        let dt = t_sc.elapsed().as_secs_f64();
        record_scores(states, empty, tags, scored, dt);
    }
    st.score_s += t_sc.elapsed().as_secs_f64();
    Ok(())
}

/// `L(M_K)` of the gold answer and/or the question for every kept answer; releases its sequence.
fn gain_requests<B: Backend>(cx: &Ctx<B>, kv: &mut KvCache<B>, prep: &[Prepared], answered: Vec<Answered>, st: &mut RolloutStats) -> Vec<(ScoreTag, ScoreRequest)> {
    let mut out = Vec::new();
    for Answered { q, i, seq, prompt: ids } in answered {
        let p = &prep[q];
        let mut targets = vec![];
        if cx.cfg.answer_gain {
            targets.push((ScoreKind::AnswerGain, p.gold_ids.clone()));
        }
        if cx.cfg.query_gain {
            targets.push((ScoreKind::QueryGain, p.q_ids.clone()));
        }
        for (kind, tg) in targets {
            st.score_tokens_naive += ids.len() + tg.len() - 1;
            let (s, context) = if cx.cfg.share_prefix {
                // extend the answered prompt's cache: drop the answer and the last prompt
                // token, whose row then predicts the first target token
                let mut f = kv.fork(&seq);
                kv.truncate(&cx.model.be, &mut f, ids.len() - 1);
                (f, vec![ids[ids.len() - 1]])
            } else {
                (Seq::default(), ids.clone())
            };
            st.score_tokens += context.len() + tg.len() - 1;
            out.push((ScoreTag { q, i, kind }, ScoreRequest { seq: s, context, targets: tg, keep_seq: false }));
        }
        kv.release(&cx.model.be, seq);
    }
    out
}

/// `L(M_t)` of the gold answer with each updated memory in the final prompt.
fn curve_requests<B: Backend>(
    cx: &Ctx<B>,
    kv: &mut KvCache<B>,
    prep: &[Prepared],
    final_prefix: &[Option<Seq>],
    updated: &[usize],
    states: &[Vec<State>],
    st: &mut RolloutStats,
) -> Vec<(ScoreTag, ScoreRequest)> {
    let mut out = Vec::new();
    for &q in updated {
        let p = &prep[q];
        for (i, s) in states[q].iter().enumerate() {
            let (ids, pf) = cx.fin.build(&p.q_ids, &[], &s.mem_ids);
            st.score_tokens_naive += ids.len() + p.gold_ids.len() - 1;
            let (seq, context) = match &final_prefix[q] {
                Some(b) => (kv.fork(b), ids[pf..].to_vec()),
                None => (Seq::default(), ids),
            };
            st.score_tokens += context.len() + p.gold_ids.len() - 1;
            out.push((ScoreTag { q, i, kind: ScoreKind::MemoryCurve }, ScoreRequest { seq, context, targets: p.gold_ids.clone(), keep_seq: false }));
        }
    }
    out
}

/// Store every score as `L − L(∅)` on its trajectory; the pass's wall time is charged once to
/// each trajectory that took part.
fn record_scores(states: &mut [Vec<State>], empty: &[EmptyScores], tags: Vec<ScoreTag>, scored: Vec<ScoreOutput>, dt: f64) {
    let mut seen = std::collections::HashSet::new();
    for tag in &tags {
        if seen.insert((tag.q, tag.i)) {
            states[tag.q][tag.i].traj.score_s += dt;
        }
    }
    for (ScoreTag { q, i, kind }, o) in tags.into_iter().zip(scored) {
        let l = reward::mean_logprob(&o.logprobs);
        let tr = &mut states[q][i].traj;
        let empty_answer = || empty[q].answer.expect("L(∅) of the gold answer is scored whenever a gain or the curve is");
        match kind {
            ScoreKind::AnswerGain => {
                tr.logp_memory = Some(l);
                tr.logp_empty = Some(empty_answer());
                tr.gain = Some(l - empty_answer());
            }
            ScoreKind::QueryGain => tr.query_gain = Some(l - empty[q].question.expect("L(∅) of the question is scored with the query gain")),
            ScoreKind::MemoryCurve => tr.memory_curve.get_or_insert_with(Vec::new).push(l - empty_answer()),
        }
    }
}

/// Hand sequences held for a phase back to the cache.
fn release_all<B: Backend>(cx: &Ctx<B>, kv: &mut KvCache<B>, seqs: Vec<Option<Seq>>) {
    for s in seqs.into_iter().flatten() {
        kv.release(&cx.model.be, s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_leaves_the_memory_and_a_rewrite_replaces_it() {
        let mut t = Templates::default();
        assert_eq!(next_memory(&t, " KEEP "), Some("KEEP".to_string()), "no keep action: the reply is the memory");
        assert_eq!(next_memory(&t, "  \n"), Some(t.empty_memory.clone()));
        t.keep = Some("KEEP".into());
        assert_eq!(next_memory(&t, "keep."), None);
        assert_eq!(next_memory(&t, "KEEP the old notes"), Some("KEEP the old notes".to_string()));
        assert_eq!(next_memory(&t, "new notes"), Some("new notes".to_string()));
    }
}
