//! `study`: arms × seeds × evaluation sets as one resumable plan (src/study, docs/STUDY.md).
use anyhow::{Context, Result};
use clap::{Args, Command};
use infomem_engine::study;
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
    /// Run only these arms (comma-separated names); the base model's evaluations always run.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
}

/// The long flags of a subcommand, with underscores (the keys a study's flag tables may use).
fn flags_of(cmd: Command) -> BTreeSet<String> {
    cmd.get_arguments().filter_map(|a| a.get_long()).map(|l| l.replace('-', "_")).collect()
}

pub fn study(a: StudyArgs) -> Result<()> {
    use clap::Args as _;
    let train = flags_of(super::train::TrainArgs::augment_args(Command::new("train")));
    let eval = flags_of(super::agent::EvalArgs::augment_args(Command::new("eval")));
    let cfg = study::load(&a.config, &train, &eval)?;
    if a.report_only {
        study::report(&cfg)?;
        eprintln!("wrote {}/study.json, study.md and the plots from the finished cells", cfg.out.display());
        return Ok(());
    }
    let exe = std::env::current_exe().context("cannot find this program's path to run its train/eval subcommands")?;
    let only = (!a.only.is_empty()).then_some(a.only.as_slice());
    study::run(&cfg, &study::RunOptions { only, dry_run: a.dry_run, exe })
}
