//! `infomem-engine study`: arms (train settings) × seeds × evaluation sets as one resumable
//! plan (docs/STUDY.md). Each cell's training and evaluations run as subprocesses of this very
//! binary, so a cell's directory behaves exactly like a `train` / `eval` run directory (locks,
//! checkpoints, `--resume`); the study only decides, from what is on disk, what is left to do.
//! Before anything runs, every value is checked by the subcommands' own parsers and every part
//! of a cell on disk is compared with the settings it was recorded with (`settings.json`): a
//! changed setting is refused, never reported as a finished cell. The children die with the
//! study. The report (study.json, study.md, two PNGs) is rebuilt from the finished work every
//! time, and pairs only answers to the same questions.

mod answers;
mod config;
mod curves;
mod identity;
mod plan;
mod report;
mod retention;
mod run;
pub mod stats;
#[cfg(test)]
mod tests;

pub use config::{Arm, Commands, EvalSet, StudyConfig, Sub, LOCK_FILE};
pub use plan::{cells, eval_command, train_command, Cell};
pub use report::report;
pub use run::{lock, report_only, run, RunOptions};

use anyhow::{Context, Result};
use config::{check_values, home, normalize_aliases, validate};
use identity::{check_recorded, resolve_cells};
use std::path::Path;

/// Read and check a study file: its structure, every value of every flag table (parsed and
/// checked by the subcommand's own parser, the error naming the key), every cell's full argument
/// lists, and every cell already on disk against the settings it was run with. A misspelt key, a
/// bad value or a changed setting is refused here, before anything runs.
pub fn load(path: &Path, cmds: &dyn Commands) -> Result<StudyConfig> {
    let text = crate::util::fs::read_input_text(path, "study config", 64 << 20)?;
    let ctx = || format!("study config {}", path.display());
    let mut cfg: StudyConfig = toml::from_str(&text).with_context(ctx)?;
    cfg.model = home(&cfg.model);
    cfg.out = home(&cfg.out);
    normalize_aliases(&mut cfg).with_context(ctx)?;
    validate(&cfg, &cmds.flags(Sub::Train), &cmds.flags(Sub::Eval)).with_context(ctx)?;
    check_values(&cfg, cmds).with_context(ctx)?;
    cfg.settings = resolve_cells(&cfg, cmds).with_context(ctx)?;
    check_recorded(&cfg).with_context(ctx)?;
    Ok(cfg)
}
