//! `rollout` and `eval`: the memory agent over a dataset.
use super::limits::{self, Held, Scored};
use super::{print_json, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use infomem_engine::agent::{self, AgentConfig, Budget, RolloutStats, Templates, Trajectory};
use infomem_engine::backend::Backend;
use infomem_engine::data::{self, QaRecord, ReadOptions};
use infomem_engine::eval;
use infomem_engine::reward::{self, Extract, Matcher, RewardMode};
use infomem_engine::runtime::{self, Model};
use infomem_engine::util::progress;
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Options shared by every command that runs the memory agent.
#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// --chunk-tokens, --memory-tokens, --answer-tokens.
    #[command(flatten)]
    pub budget: Budget,
    /// TOML file with `update` / `final` templates ({question}, {chunk}, {memory}) and `empty_memory`.
    #[arg(long)]
    pub templates: Option<PathBuf>,
    /// Outcome matcher used as the reward.
    #[arg(long = "match", value_enum, default_value_t = Matcher::Em)]
    pub matcher: Matcher,
    /// How the answer is cut out of the final reply (first line, or its first number).
    #[arg(long, value_enum, default_value_t = Extract::Line)]
    pub extract: Extract,
    /// Compute every conversation from scratch instead of sharing the section prefix (reference path).
    #[arg(long)]
    pub no_share: bool,
    /// Upper bound on tokens per forward step.
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Queries rolled out together (bounds KV-cache memory).
    #[arg(long, default_value_t = 16)]
    pub batch_queries: usize,
    /// KV-cache capacity in tokens (default: sized from --batch-queries and the budgets).
    #[arg(long)]
    pub kv_tokens: Option<usize>,
}

#[derive(Args, Debug, Clone)]
pub struct DataArgs {
    /// Skip malformed records (counted and reported) instead of stopping at the first.
    #[arg(long)]
    pub skip_bad: bool,
    /// Use only the first N records of each file.
    #[arg(long)]
    pub limit: Option<usize>,
}

#[derive(Args, Debug)]
pub struct RolloutArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub agent: AgentArgs,
    #[command(flatten)]
    pub dargs: DataArgs,
    /// JSONL dataset (see `data synth` / `data inspect`).
    #[arg(long)]
    pub data: PathBuf,
    /// Pad each record with other records' paragraphs to about this many tokens (RULER recipe).
    #[arg(long)]
    pub pad_to_tokens: Option<usize>,
    /// Rollouts per query.
    #[arg(long, default_value_t = 8)]
    pub group_size: usize,
    /// Sampling temperature of every conversation (0 = greedy).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus (top-p) mass in (0, 1]; 1 keeps the whole vocabulary.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the samplers (and of --pad-to-tokens): the same seed reproduces the same trajectories.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Reward mode written into each trajectory's `reward` (docs/DESIGN.md §1.5).
    #[arg(long, value_enum, default_value_t = RewardMode::Infomem)]
    pub reward: RewardMode,
    /// Weight β of the memory signal in the reward.
    #[arg(long, default_value_t = 0.5)]
    pub beta: f64,
    /// Score L(M_t) − L(∅) after every chunk.
    #[arg(long)]
    pub memory_curve: bool,
    /// Output: one trajectory per line (new unless --overwrite).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out if it exists (it may never be one of the inputs).
    #[arg(long)]
    pub overwrite: bool,
    /// Print the run statistics as one JSON line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub agent: AgentArgs,
    #[command(flatten)]
    pub dargs: DataArgs,
    /// JSONL datasets (one or more).
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Evaluate each record padded to each of these token lengths (RULER recipe); without it,
    /// records are grouped by their target length (`target_tokens`, top-level or in `meta`, as
    /// synthetic data has), else by their measured length in buckets (lengths within 25 % of a
    /// bucket's shortest share it, named by the median). An overall row always follows.
    #[arg(long, value_delimiter = ',')]
    pub lengths: Vec<usize>,
    /// Skip the per-chunk memory curve (saves one short scoring pass per chunk).
    #[arg(long)]
    pub no_memory_curve: bool,
    /// Seed of the --lengths padding (decoding is greedy).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (results.json, results.md, accuracy.png, memory_curve.png, predictions.jsonl),
    /// new or empty unless --overwrite; locked for the whole evaluation.
    #[arg(long)]
    pub out: PathBuf,
    /// Evaluate into a non-empty --out: replace the files an evaluation writes there (other files stay).
    #[arg(long)]
    pub overwrite: bool,
    /// Also print the result rows and the run's settings as one JSON line.
    #[arg(long)]
    pub json: bool,
}

impl AgentArgs {
    /// The budgets and the batch sizes, before the model loads (a 0 was silently made 1).
    pub fn check(&self) -> Result<()> {
        self.budget.check()?;
        let max = infomem_engine::rl::trainer::MAX_TOKENS;
        for (flag, v) in [("--batch-queries", self.batch_queries), ("--max-batch-tokens", self.max_batch_tokens)] {
            if v == 0 || v > max {
                bail!("{flag} must be in 1..={max} (got {v})");
            }
        }
        if self.kv_tokens == Some(0) {
            bail!("--kv-tokens must be at least 1 (got 0); leave it out to size the cache from --batch-queries and the budgets");
        }
        Ok(())
    }
}

/// KV tokens one batch of queries needs (the one sizing, `agent::rollout_kv_tokens`).
fn kv_need(cfg: &AgentConfig, queries: &[QaRecord]) -> usize {
    agent::rollout_kv_tokens(&cfg.budget, cfg.group_size, queries.iter().map(|q| q.question.as_str()))
}

/// `--kv-tokens`, when given, against what a batch needs (else the rollout fails mid-way with
/// "KV cache is full") and against the memory.
fn check_kv<B: Backend>(model: &Model<B>, a: &AgentArgs, cfg: &AgentConfig, recs: &[QaRecord]) -> Result<()> {
    let Some(kv) = a.kv_tokens else { return Ok(()) };
    let bq = a.batch_queries.min(recs.len()).max(1);
    let need = recs.chunks(bq).map(|b| kv_need(cfg, b)).max().unwrap_or(0);
    if kv < need {
        bail!(
            "--kv-tokens {kv}: a batch of {bq} queries × (--group-size {} + 3) conversations needs {need} tokens of KV cache; give at least that, or leave --kv-tokens out",
            cfg.group_size
        );
    }
    limits::check_memory(limits::kv_bytes(&model.cfg, kv as u128), &format!("--kv-tokens {kv}: the KV cache"), "lower --kv-tokens (or leave it out)")
}

/// Every file the command reads: an output must not be one of them.
fn inputs(m: &ModelArgs, a: &AgentArgs, data: &[PathBuf]) -> Vec<PathBuf> {
    let mut v = data.to_vec();
    v.extend(limits::model_files(&m.model));
    v.extend(m.adapter.iter().flat_map(|d| limits::model_files(d)));
    v.extend(a.templates.iter().cloned());
    v
}

/// The agent's budgets against the model's positions and the trajectories against memory,
/// before any rollout (`limits::check_agent_plan`); returns each record's document tokens.
fn check_plan<B: Backend>(model: &Model<B>, a: &AgentArgs, templates: &Templates, recs: &[QaRecord], scored: Scored, group: usize) -> Result<Vec<usize>> {
    let name = model.dir.display().to_string();
    let held = Held { queries: recs.len(), group };
    limits::check_agent_plan(&model.cfg, &name, model.tokenizer()?, templates, recs, &a.budget, scored, held)
}

pub fn load_templates(a: &AgentArgs) -> Result<Templates> {
    match &a.templates {
        Some(p) => Templates::load(p),
        None => Ok(Templates::default()),
    }
}

pub fn read_data<B: Backend>(model: &Model<B>, path: &Path, d: &DataArgs, pad: Option<usize>, seed: u64) -> Result<Vec<QaRecord>> {
    let opts = ReadOptions { skip_bad: d.skip_bad, pad_to_tokens: pad, tokenizer: model.tokenizer.as_ref(), seed };
    let (mut recs, report) = data::read_records(path, opts)?;
    if !report.skipped.is_empty() {
        eprintln!("{}: skipped {} malformed record(s):", path.display(), report.skipped.len());
        for (line, why) in report.skipped.iter().take(10) {
            eprintln!("  line {line}: {why}");
        }
    }
    // e.g. records padded to well under the target: their rows are labelled with the target
    for w in &report.warnings {
        eprintln!("warning: {}: {w}", path.display());
    }
    if let Some(n) = d.limit {
        recs.truncate(n);
    }
    if recs.is_empty() {
        bail!("{}: no records to run", path.display());
    }
    Ok(recs)
}

/// Run the agent over `queries` (whose documents are `doc_tokens` long, from `check_plan`) in
/// batches of `batch_queries`, with a progress bar.
pub fn run_batches<B: Backend>(
    model: &Model<B>,
    queries: &[QaRecord],
    doc_tokens: &[usize],
    cfg: &AgentConfig,
    a: &AgentArgs,
    templates: &Templates,
    label: &str,
) -> Result<(Vec<Vec<Trajectory>>, RolloutStats)> {
    let bq = a.batch_queries;
    let mut total_convs = 0u64;
    for &n_tok in doc_tokens {
        total_convs = total_convs.saturating_add((cfg.group_size as u64).saturating_mul(n_tok.div_ceil(cfg.budget.chunk_tokens) as u64 + 1));
    }
    let pb = progress::bar(total_convs, "conversations");
    pb.set_message(label.to_string());
    let mut all = Vec::new();
    let mut stats = RolloutStats::default();
    let mut base = 0u64;
    for (bi, batch) in queries.chunks(bq).enumerate() {
        let need = a.kv_tokens.unwrap_or_else(|| kv_need(cfg, batch));
        let mut kv = runtime::kv_for(model, need)?;
        let mut c = cfg.clone();
        c.seed = cfg.seed.wrapping_add((bi as u64) << 32);
        let (trajs, st) = agent::rollout(model, &mut kv, batch, &c, templates, |done, _| pb.set_position(base + done as u64))
            .with_context(|| format!("rollout of queries {}..{}", bi * bq, bi * bq + batch.len()))?;
        base += st.conversations as u64;
        pb.set_position(base);
        if pb.is_hidden() {
            // no terminal (a log file): one line per batch instead of the bar
            let el = pb.elapsed().as_secs_f64();
            let eta = el / base.max(1) as f64 * total_convs.saturating_sub(base) as f64;
            eprintln!("{label}: {base}/{total_convs} conversations, {el:.0} s elapsed, ETA {eta:.0} s");
        }
        merge_stats(&mut stats, &st);
        all.extend(trajs);
    }
    pb.finish_and_clear();
    Ok((all, stats))
}

fn merge_stats(acc: &mut RolloutStats, s: &RolloutStats) {
    acc.queries += s.queries;
    acc.trajectories += s.trajectories;
    acc.conversations += s.conversations;
    acc.generated_tokens += s.generated_tokens;
    acc.prefill_tokens += s.prefill_tokens;
    acc.prefill_tokens_naive += s.prefill_tokens_naive;
    acc.score_tokens += s.score_tokens;
    acc.score_tokens_naive += s.score_tokens_naive;
    acc.update_s += s.update_s;
    acc.final_s += s.final_s;
    acc.score_s += s.score_s;
    acc.total_s += s.total_s;
}

/// The agent options and sampling; what is scored besides the outcome is the caller's to set.
fn agent_config(a: &AgentArgs, group_size: usize, temperature: f32, top_p: f32, seed: u64) -> AgentConfig {
    AgentConfig {
        budget: a.budget,
        group_size,
        temperature,
        top_p,
        matcher: a.matcher,
        extract: a.extract,
        share_prefix: !a.no_share,
        max_batch_tokens: a.max_batch_tokens,
        seed,
        ..Default::default()
    }
}

pub fn rollout(a: RolloutArgs) -> Result<()> {
    let _out = check_rollout_args(&a)?;
    crate::with_model!(a.model, super::Work::Agent, |model| rollout_on(&model, &a))
}

/// Every flag that needs no model, before loading it: budgets, sampling, reward weight, and an
/// --out that can be written and is not an input.
fn check_rollout_args(a: &RolloutArgs) -> Result<super::output::Reserved> {
    a.agent.check()?;
    if a.group_size == 0 {
        bail!("--group-size must be at least 1 (got 0)");
    }
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        bail!("--temperature must be a number ≥ 0 (0 = greedy), got {}", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    if !a.beta.is_finite() {
        bail!("--beta must be a finite number, got {}", a.beta);
    }
    if a.pad_to_tokens == Some(0) {
        bail!("--pad-to-tokens must be at least 1 (got 0)");
    }
    super::output::check_out_file("--out", &a.out, &inputs(&a.model, &a.agent, std::slice::from_ref(&a.data)), a.overwrite)
}

fn rollout_on<B: Backend>(model: &Model<B>, a: &RolloutArgs) -> Result<()> {
    let templates = load_templates(&a.agent)?;
    let recs = read_data(model, &a.data, &a.dargs, a.pad_to_tokens, a.seed)?;
    let sig = a.reward.signal();
    let cfg = AgentConfig {
        answer_gain: sig == reward::Signal::AnswerGain || a.memory_curve,
        query_gain: sig == reward::Signal::QueryGain,
        memory_curve: a.memory_curve,
        ..agent_config(&a.agent, a.group_size, a.temperature, a.top_p, a.seed)
    };
    let scored = Scored { gold: cfg.answer_gain, question: cfg.query_gain };
    let docs = check_plan(model, &a.agent, &templates, &recs, scored, a.group_size)?;
    check_kv(model, &a.agent, &cfg, &recs)?;
    let (mut groups, st) = run_batches(model, &recs, &docs, &cfg, &a.agent, &templates, "rollout")?;
    let mut out = Vec::new();
    for (g, rec) in groups.iter_mut().zip(&recs) {
        let signals: Vec<_> = g.iter().map(Trajectory::reward_signals).collect();
        for (t, r) in g.iter_mut().zip(reward::assign(&signals, a.reward, a.beta)?) {
            t.reward = Some(r);
        }
        for t in g.iter() {
            let mut v = serde_json::to_value(t)?;
            v["task"] = json!(rec.task);
            v["gold"] = json!(rec.answers);
            v["question"] = json!(rec.question);
            writeln!(out, "{}", serde_json::to_string(&v)?)?;
        }
    }
    infomem_engine::util::fs::write_atomic(&a.out, &out)?;
    let all: Vec<&Trajectory> = groups.iter().flatten().collect();
    let n = all.len() as f64;
    let success = all.iter().map(|t| t.outcome).sum::<f64>() / n;
    let gains: Vec<f64> = all.iter().filter_map(|t| t.gain).collect();
    let mean_gain = if gains.is_empty() { None } else { Some(gains.iter().sum::<f64>() / gains.len() as f64) };
    let summary = json!({
        "queries": st.queries,
        "trajectories": st.trajectories,
        "success_rate": success,
        "em": all.iter().map(|t| t.em).sum::<f64>() / n,
        "sub_em": all.iter().map(|t| t.sub_em).sum::<f64>() / n,
        "mean_reward": all.iter().filter_map(|t| t.reward).sum::<f64>() / n,
        "mean_gain": mean_gain,
        "generated_tokens": st.generated_tokens,
        "prefill_tokens": st.prefill_tokens,
        "prefill_tokens_naive": st.prefill_tokens_naive,
        "prefill_saving": st.prefill_saving(),
        "score_tokens": st.score_tokens,
        "score_tokens_naive": st.score_tokens_naive,
        "seconds": st.total_s,
        "update_s": st.update_s,
        "final_s": st.final_s,
        "score_s": st.score_s,
        "out": a.out.display().to_string(),
    });
    eprintln!(
        "{} queries × {} rollouts: success {:.1}%, mean gain {}, prefill {} tokens vs {} naive ({:.2}× saved), {:.1} s",
        st.queries,
        a.group_size,
        100.0 * success,
        mean_gain.map(|g| format!("{g:+.3}")).unwrap_or_else(|| "–".into()),
        st.prefill_tokens,
        st.prefill_tokens_naive,
        st.prefill_saving(),
        st.total_s
    );
    if a.memory_curve {
        for t in all.iter().take(4) {
            if let Some(c) = &t.memory_curve {
                let s: Vec<String> = c.iter().map(|v| format!("{v:+.2}")).collect();
                eprintln!("  memory curve {} #{}: [{}] answer {:?} (em {})", t.query_id, t.rollout, s.join(", "), t.answer, t.em);
            }
        }
    }
    if a.json {
        print_json(&summary);
    }
    Ok(())
}

/// What `eval` writes into --out (eval::write_report and `predictions.jsonl`).
const EVAL_OUTPUTS: [&str; 5] = ["predictions.jsonl", "results.json", "results.md", "accuracy.png", "memory_curve.png"];

fn eval_output(name: &str) -> bool {
    EVAL_OUTPUTS.contains(&name)
}

/// A padded record's length may miss its `--lengths` target by this much before the row's
/// label would misstate it: at most a quarter over (a gold document longer than the target, or
/// one padding document overshooting), at most a tenth under (the file ran out of documents).
const LENGTH_OVER: (usize, usize) = (5, 4);
const LENGTH_UNDER: (usize, usize) = (9, 10);

pub fn eval(a: EvalArgs) -> Result<()> {
    a.agent.check()?;
    if a.lengths.contains(&0) {
        bail!("--lengths: 0 is not a length to pad to (each must be at least 1 token)");
    }
    if let Some(l) = a.lengths.iter().enumerate().find_map(|(i, l)| a.lengths[..i].contains(l).then_some(l)) {
        bail!("--lengths lists {l} more than once: each length is one row, evaluated once");
    }
    if let Some(d) = a.data.iter().enumerate().find_map(|(i, d)| a.data[..i].iter().any(|e| limits::same_file(d, e)).then_some(d)) {
        bail!("--data lists {} more than once: its questions would be counted twice", d.display());
    }
    let ins = inputs(&a.model, &a.agent, &a.data);
    // the directory is locked for the whole evaluation (a second eval, or a live train, into
    // the same --out is refused before any work, not after it), then checked under the lock
    let created = !a.out.exists();
    limits::check_writable_dir("--out", &a.out)?;
    let lock = infomem_engine::util::lock::lock_dir(&a.out, "--out")?;
    let finished = || -> Result<()> {
        if !a.overwrite && a.out.join("results.json").exists() {
            bail!("--out {}: already holds an evaluation (results.json); pass --overwrite to replace it, or choose another --out", a.out.display());
        }
        Ok(())
    };
    let res = finished()
        .and_then(|()| super::output::check_not_other_kind("--out", &a.out, infomem_engine::rl::trainer::RUN_FILES, "a training run"))
        .and_then(|()| super::output::check_out_dir("--out", &a.out, &ins, a.overwrite, eval_output))
        .and_then(|()| crate::with_model!(a.model, super::Work::Agent, |model| eval_on(&model, &a)));
    if res.is_err() && created {
        // nothing of this run is left behind: its lock, and the directory it made
        lock.remove_if_only_lock();
    }
    res
}

/// Refuse a `--lengths` row whose records are not about that long: records longer than the
/// target on their own, or a file whose documents cannot pad them that far.
fn check_padded(path: &Path, target: usize, recs: &[QaRecord]) -> Result<()> {
    let tokens = |r: &QaRecord| r.meta.get("padding").and_then(|p| p.get("tokens")).and_then(|t| t.as_u64()).map(|t| t as usize);
    let lens: Vec<usize> = recs.iter().filter_map(tokens).collect();
    let (Some(&lo), Some(&hi)) = (lens.iter().min(), lens.iter().max()) else { return Ok(()) };
    if lo * LENGTH_OVER.1 > target * LENGTH_OVER.0 {
        bail!(
            "--lengths {target}: the records of {} are {lo} tokens or more on their own (their gold documents), \
             so a row labelled {target} would hold longer documents; ask for lengths of at least {lo}",
            path.display()
        );
    }
    if hi * LENGTH_UNDER.1 < target * LENGTH_UNDER.0 {
        bail!(
            "--lengths {target}: the documents of {} pad its records to at most {hi} tokens, \
             so a row labelled {target} would hold shorter documents; ask for lengths of at most {hi}, or pad from a larger file",
            path.display()
        );
    }
    if let Some(r) = recs.iter().find(|r| tokens(r).is_some_and(|t| t * LENGTH_OVER.1 > target * LENGTH_OVER.0 || t * LENGTH_UNDER.1 < target * LENGTH_UNDER.0)) {
        bail!(
            "--lengths {target}: record {} of {} is {} tokens after padding, too far from {target} for a row with that label",
            r.id,
            path.display(),
            tokens(r).unwrap_or(0)
        );
    }
    Ok(())
}

fn eval_on<B: Backend>(model: &Model<B>, a: &EvalArgs) -> Result<()> {
    let templates = load_templates(&a.agent)?;
    let cfg = AgentConfig { answer_gain: true, query_gain: false, memory_curve: !a.no_memory_curve, ..agent_config(&a.agent, 1, 0.0, 1.0, a.seed) };
    // every evaluated question: its (task, length) and its record
    let mut items: Vec<(String, usize)> = Vec::new();
    let mut recs: Vec<QaRecord> = Vec::new();
    for path in &a.data {
        if a.lengths.is_empty() {
            // a record's target length (`target_tokens`, in `meta` or top-level: synthetic data
            // carries it), else its measured length, bucketed (eval::bucket_lengths) per file
            let file_recs = read_data(model, path, &a.dargs, None, a.seed)?;
            let mut lens: Vec<Option<usize>> =
                file_recs.iter().map(|r| r.meta.get("target_tokens").and_then(|v| v.as_u64()).map(|v| v as usize)).collect();
            let free: Vec<usize> = (0..lens.len()).filter(|&i| lens[i].is_none()).collect();
            let measured = free.iter().map(|&i| Ok(model.tokenizer()?.encode(&file_recs[i].context)?.len())).collect::<Result<Vec<_>>>()?;
            for (&i, b) in free.iter().zip(eval::bucket_lengths(&measured)) {
                lens[i] = Some(b);
            }
            for (r, len) in file_recs.into_iter().zip(lens) {
                items.push((r.task.clone(), len.expect("every length is given or bucketed above")));
                recs.push(r);
            }
        } else {
            for &l in &a.lengths {
                let file_recs = read_data(model, path, &a.dargs, Some(l), a.seed)?;
                check_padded(path, l, &file_recs)?;
                for r in file_recs {
                    items.push((r.task.clone(), l));
                    recs.push(r);
                }
            }
        }
    }
    // a question counted twice (one file given twice under other names, a copy, or a repeated
    // id) would weigh twice in the accuracy and break the study's pairing by id
    let mut seen = std::collections::HashMap::new();
    for ((_, len), r) in items.iter().zip(&recs) {
        if seen.insert((r.id.as_str(), *len), ()).is_some() {
            bail!("record id {:?} appears twice in --data{}: each question is evaluated once; remove the repeated file or record", r.id, if a.lengths.is_empty() { String::new() } else { format!(" (at length {len})") });
        }
    }
    let scored = Scored { gold: cfg.answer_gain, question: cfg.query_gain };
    let docs = check_plan(model, &a.agent, &templates, &recs, scored, 1)?;
    check_kv(model, &a.agent, &cfg, &recs)?;
    let (groups, st) = run_batches(model, &recs, &docs, &cfg, &a.agent, &templates, "eval")?;
    let tok = model.tokenizer()?;
    let mut evaluated: Vec<eval::Evaluated> = Vec::with_capacity(items.len());
    for (((task, len), r), g) in items.iter().zip(&recs).zip(&groups) {
        let capture = eval::capture::capture(&g[0].memories, &r.answers);
        // the chunk the answer's fact was planted in, found by its text (padding moves it)
        let planted_chunk = match eval::capture::planted_text(&r.meta, &r.answers).and_then(|t| r.context.find(t)) {
            Some(byte) => Some(tok.token_index_at(&r.context, byte)? / cfg.budget.chunk_tokens),
            None => None,
        };
        evaluated.push(eval::Evaluated { task: task.clone(), length: *len, traj: &g[0], capture, planted_chunk });
    }
    let rows = eval::summarize(&evaluated);
    // --overwrite: the earlier evaluation's files go just before the new ones are written
    super::output::clear_owned("--out", &a.out, eval_output)?;
    let mut preds = Vec::new();
    for ((task, len), (r, ev)) in items.iter().zip(recs.iter().zip(&evaluated)) {
        let (t, c) = (ev.traj, &ev.capture);
        writeln!(
            preds,
            "{}",
            json!({"id": r.id, "task": task, "length": len, "question": r.question, "answers": r.answers, "answer": t.answer,
                   "raw_answer": t.raw_answer, "answer_cut": t.answer_cut(), "em": t.em, "sub_em": t.sub_em, "f1": t.f1, "gain": t.gain,
                   "chunks": c.held.len(), "captured": c.captured, "in_final": c.in_final, "first_captured_chunk": c.first_captured_chunk,
                   "lost_at_chunk": c.lost_at_chunk, "regained": c.regained, "held": c.held, "planted_chunk": ev.planted_chunk,
                   "memory_curve": t.memory_curve, "memories": t.memories})
        )?;
    }
    infomem_engine::util::fs::write_atomic(&a.out.join("predictions.jsonl"), &preds)?;
    let adapter = a.model.adapter.as_ref().map(|p| p.display().to_string());
    let title = format!("{} {}", model.dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(), if adapter.is_some() { "+ adapter" } else { "(base)" });
    let run = json!({"model": model.dir.display().to_string(), "adapter": adapter, "chunk_tokens": cfg.budget.chunk_tokens,
        "memory_tokens": cfg.budget.memory_tokens, "answer_tokens": cfg.budget.answer_tokens, "questions": items.len(), "seconds": st.total_s,
        "generated_tokens": st.generated_tokens, "prefill_tokens": st.prefill_tokens, "score_tokens": st.score_tokens,
        "update_s": st.update_s, "final_s": st.final_s, "score_s": st.score_s, "data": a.data.iter().map(|p| p.display().to_string()).collect::<Vec<_>>()});
    eval::write_report(&a.out, &rows, &title, run.clone())?;
    eprint!("{}", eval::markdown_table(&rows));
    eprint!("{}", eval::capture_table(&rows));
    eprintln!("wrote {}/results.{{json,md}}, accuracy.png, predictions.jsonl ({:.1} s)", a.out.display(), st.total_s);
    if a.json {
        print_json(&json!({"rows": rows, "run": run}));
    }
    Ok(())
}
