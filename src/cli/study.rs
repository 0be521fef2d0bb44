//! `study`: arms × seeds × evaluation sets as one resumable plan (src/study, docs/STUDY.md).
use super::BackendKind;
use anyhow::{bail, Context, Result};
use clap::{Args, Command, CommandFactory, FromArgMatches, Parser};
use infomem_engine::study::{self, Sub};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct StudyArgs {
    /// Study file (TOML): model, out, seeds, [train] and [eval] flag tables, [[arms]] and [[evals]] (docs/STUDY.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Print the plan (cells and the exact commands still to run) and run nothing.
    #[arg(long, conflicts_with = "report_only")]
    pub dry_run: bool,
    /// Train and evaluate nothing: rewrite study.json, study.md and the plots from the finished cells.
    #[arg(long)]
    pub report_only: bool,
    /// Run only these arms (comma-separated names; `base` is the base model's cell, run only when named here or when --only is not given).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Run only the arms' cells at these seeds (comma-separated), e.g. one seed per sitting; the base model's cell has no seed (--only selects it).
    #[arg(long, value_delimiter = ',', conflicts_with = "report_only")]
    pub seeds: Vec<u64>,
    /// Run only these evaluation sets in this sitting (comma-separated names), e.g. the cheap ones while the cells train; the others run in a later sitting, and the report shows every finished one.
    #[arg(long, value_delimiter = ',', conflicts_with = "report_only")]
    pub evals: Vec<String>,
}

/// `train` as a study cell runs it: its own arguments and the global `--threads`.
#[derive(Parser, Debug)]
#[command(name = "train")]
struct TrainCmd {
    #[arg(long, default_value_t = 0)]
    threads: usize,
    #[command(flatten)]
    args: super::train::TrainArgs,
}

/// `eval` as a study cell runs it.
#[derive(Parser, Debug)]
#[command(name = "eval")]
struct EvalCmd {
    #[arg(long, default_value_t = 0)]
    threads: usize,
    #[command(flatten)]
    args: super::agent::EvalArgs,
}

/// The long flags of a subcommand, with underscores (the keys a study's flag tables may use).
fn flags_of(cmd: Command) -> BTreeSet<String> {
    cmd.get_arguments().filter_map(|a| a.get_long()).map(|l| l.replace('-', "_")).collect()
}

/// clap's message on one line, without its `error: `, usage and `--help` hint (the study names
/// the key around it), e.g. `invalid value 'x' for '--reward <REWARD>' [possible values: …]`.
fn clap_error(e: clap::Error) -> anyhow::Error {
    let text = e.render().to_string();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect();
    anyhow::anyhow!(lines.join(" ").trim_start_matches("error: ").to_string())
}

fn check_threads(n: usize) -> Result<()> {
    if n > super::limits::MAX_THREADS {
        bail!("--threads {n}: at most {} CPU threads can be used (0 = one per core)", super::limits::MAX_THREADS);
    }
    Ok(())
}

/// `--backend` and `--dtype` as the subcommand checks them when it loads the model.
fn check_backend(backend: BackendKind, dtype: Option<super::DtypeArg>) -> Result<()> {
    if backend == BackendKind::Cuda {
        dtype.unwrap_or(super::DtypeArg::Auto).resolve(backend, super::Work::Agent)?;
        if !cfg!(feature = "cuda") {
            bail!("--backend cuda: this binary was built without CUDA support (rebuild with `cargo build --release --features cuda`)");
        }
    }
    Ok(())
}

/// A raw flag value as JSON: a bool or a number when it reads as one, else the string.
fn raw_json(s: &str) -> Value {
    match s {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => match (s.parse::<i64>(), s.parse::<f64>()) {
            (Ok(i), _) => serde_json::json!(i),
            (_, Ok(x)) if x.is_finite() => serde_json::json!(x),
            _ => Value::String(s.to_string()),
        },
    }
}

/// The study's view of `train` and `eval`: their own parsers and the checks they make before
/// running anything.
struct Subcommands;

impl study::Commands for Subcommands {
    fn flags(&self, sub: Sub) -> BTreeSet<String> {
        use clap::Args as _;
        match sub {
            Sub::Train => flags_of(super::train::TrainArgs::augment_args(Command::new("train"))),
            Sub::Eval => flags_of(super::agent::EvalArgs::augment_args(Command::new("eval"))),
        }
    }

    fn resolve(&self, sub: Sub, args: &[String]) -> Result<serde_json::Map<String, Value>> {
        match sub {
            Sub::Train => {
                let c = TrainCmd::try_parse_from(args).map_err(clap_error)?;
                check_threads(c.threads)?;
                let (cfg, _) = c.args.config_and_explicit()?;
                cfg.validate()?;
                check_backend(c.args.backend, c.args.dtype)?;
                let Value::Object(mut m) = serde_json::to_value(&cfg)? else { bail!("train settings are not a JSON object") };
                m.insert("backend".into(), Value::String(format!("{:?}", c.args.backend).to_lowercase()));
                Ok(m)
            }
            Sub::Eval => {
                let cmd = EvalCmd::command();
                let matches = cmd.clone().try_get_matches_from(args).map_err(clap_error)?;
                let c = EvalCmd::from_arg_matches(&matches).map_err(clap_error)?;
                check_threads(c.threads)?;
                c.args.agent.budget.check()?;
                if c.args.lengths.contains(&0) {
                    bail!("--lengths: 0 is not a length to pad to (each must be at least 1 token)");
                }
                check_backend(c.args.model.backend, Some(c.args.model.dtype))?;
                // every argument as parsed, defaults included
                let mut m = serde_json::Map::new();
                for arg in cmd.get_arguments() {
                    let (Some(long), id) = (arg.get_long(), arg.get_id().as_str()) else { continue };
                    if matches!(long, "help" | "version") {
                        continue;
                    }
                    let Some(raw) = matches.get_raw(id) else { continue };
                    let vals: Vec<Value> = raw.map(|v| raw_json(&v.to_string_lossy())).collect();
                    let v = if vals.len() == 1 && arg.get_value_delimiter().is_none() { vals.into_iter().next().unwrap_or(Value::Null) } else { Value::Array(vals) };
                    m.insert(long.replace('-', "_"), v);
                }
                Ok(m)
            }
        }
    }
}

pub fn study(a: StudyArgs) -> Result<()> {
    let cfg = study::load(&a.config, &Subcommands)?;
    if a.report_only {
        study::report_only(&cfg)?;
        eprintln!("wrote {}/study.json, study.md and the plots from the finished cells", cfg.out.display());
        return Ok(());
    }
    let exe = std::env::current_exe().context("cannot find this program's path to run its train/eval subcommands")?;
    let only = (!a.only.is_empty()).then_some(a.only.as_slice());
    let evals = (!a.evals.is_empty()).then_some(a.evals.as_slice());
    let seeds = (!a.seeds.is_empty()).then_some(a.seeds.as_slice());
    let res = study::run(&cfg, &study::RunOptions { only, seeds, evals, dry_run: a.dry_run, exe });
    // stopped by Ctrl-C, SIGTERM or SIGHUP: the running cell saved its checkpoint; exit as `train`
    // does, with 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), not 1
    if let Err(e) = &res {
        if infomem_engine::util::interrupt::requested() {
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            std::process::exit(infomem_engine::util::interrupt::exit_code());
        }
    }
    res
}
