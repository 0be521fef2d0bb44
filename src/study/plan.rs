//! The plan: its cells (an arm at a seed, or the base model) in run order, and the exact `train`
//! and `eval` command lines of each.
use super::config::{EvalSet, StudyConfig, flags_to_args, kv, merge, p};
use std::path::{Path, PathBuf};

/// One unit of the plan: an arm at a seed, or the base model (`arm` = "base", no seed).
#[derive(Debug, Clone)]
pub struct Cell {
    pub arm: String,
    pub seed: Option<u64>,
    pub dir: PathBuf,
}

impl Cell {
    pub fn name(&self) -> String {
        match self.seed {
            Some(s) => format!("{}-s{s}", self.arm),
            None => self.arm.clone(),
        }
    }
    pub(super) fn train_dir(&self) -> PathBuf {
        self.dir.join("train")
    }
    pub(super) fn adapter(&self) -> PathBuf {
        self.train_dir().join("adapter")
    }
    pub(super) fn eval_dir(&self, eval: &str) -> PathBuf {
        self.dir.join(format!("eval-{eval}"))
    }
    pub(super) fn trained(&self) -> bool {
        self.seed.is_none() || self.adapter().join("adapter_model.safetensors").exists()
    }
    /// An arm's training that would be kept: its adapter or a checkpoint to resume from.
    pub(super) fn has_training(&self) -> bool {
        self.seed.is_some() && (self.trained() || crate::rl::trainer::latest_checkpoint(&self.train_dir()).is_some())
    }
    pub(super) fn evaluated(&self, eval: &str) -> bool {
        self.eval_dir(eval).join("results.json").exists()
    }
    /// The sets whose evaluation finished in this cell (`eval-*/results.json`), named by the study
    /// file or not.
    pub(super) fn finished_sets(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().join("results.json").exists())
            .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("eval-").map(str::to_string))
            .collect();
        v.sort();
        v
    }
    /// An arm's cell that holds finished evaluations but not the adapter that made them (its
    /// results were kept without their weights, e.g. carried to another machine): what it holds
    /// is reported; an evaluation is added only on that very adapter (`reproduce_command`).
    pub(super) fn results_without_adapter(&self) -> bool {
        self.seed.is_some() && !self.trained() && !self.finished_sets().is_empty()
    }
    /// The SHA-256 (`sha256:<hex>`) of the adapter a cell's kept results were made with:
    /// `train/adapter.sha256`, written by tools/study_results.py when it keeps results without
    /// their weights. A training that makes these very bytes again may add to the cell.
    pub(super) fn kept_adapter_sha256(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.train_dir().join(ADAPTER_HASH_FILE)).ok()?;
        Some(text.trim().to_string()).filter(|s| s.starts_with("sha256:"))
    }
    /// Where the adapter of a kept-results cell is trained again, apart, until its bytes are
    /// shown to be the kept ones.
    pub(super) fn reproduce_dir(&self) -> PathBuf {
        self.dir.join("reproduce")
    }
    /// The SHA-256 of the adapter trained again in `reproduce/`, in the form of
    /// `kept_adapter_sha256` (`None` until that training has finished).
    pub(super) fn reproduced_sha256(&self) -> anyhow::Result<Option<String>> {
        let made = self.reproduce_dir().join("adapter/adapter_model.safetensors");
        if !made.exists() {
            return Ok(None);
        }
        Ok(Some(format!("sha256:{}", crate::util::sha256::sha256_file(&made)?)))
    }
    /// The thread count the cell's adapter was first trained with: `--threads=N` of the first
    /// `train` command in its log (`None` when the log is gone or gave none: all cores, unknown
    /// here). The bytes of a training depend on it, so a reproduction is checked against it.
    pub(super) fn trained_threads(&self) -> Option<usize> {
        let log = std::fs::read_to_string(self.dir.join("log.txt")).ok()?;
        let cmd = log.lines().filter_map(|l| l.strip_prefix("== t=")).find(|l| l.split_whitespace().nth(2) == Some("train"))?;
        cmd.split_whitespace().find_map(|a| a.strip_prefix("--threads=")).and_then(|n| n.parse().ok()).filter(|&n| n > 0)
    }
}

/// A kept cell's adapter hash (`Cell::kept_adapter_sha256`), beside its training's metrics.
pub const ADAPTER_HASH_FILE: &str = "adapter.sha256";

/// The cells in run order: the base model first (its evaluations), then seed by seed every arm
/// (so a study stopped early already has paired arms to compare).
pub fn cells(cfg: &StudyConfig) -> Vec<Cell> {
    let mut v = vec![Cell { arm: "base".into(), seed: None, dir: cfg.out.join("base") }];
    for &s in &cfg.seeds {
        for a in cfg.arms.iter().filter(|a| a.seeds.as_ref().is_none_or(|ss| ss.contains(&s))) {
            v.push(Cell { arm: a.name.clone(), seed: Some(s), dir: cfg.out.join("cells").join(format!("{}-s{s}", a.name)) });
        }
    }
    v
}

/// The study's dtype: its `dtype`, or `auto` (the default) resolved once, here, for this
/// machine, so that every cell runs, and its settings record, the same dtype.
fn study_dtype(cfg: &StudyConfig) -> String {
    match cfg.dtype.as_deref() {
        Some(d) if d != "auto" => d.to_string(),
        _ => {
            let cuda = [&cfg.train, &cfg.eval].iter().any(|t| t.get("backend").and_then(|b| b.as_str()) == Some("cuda"));
            crate::backend::Dtype::auto(cuda).0.name().to_string()
        }
    }
}

pub(super) fn common_args(cfg: &StudyConfig) -> Vec<String> {
    let mut v = vec![kv("dtype", &study_dtype(cfg))];
    if let Some(t) = cfg.threads {
        v.push(kv("threads", &t.to_string()));
    }
    v
}

/// The `train` arguments of an arm's cell as a fresh run (`None` for the base cell).
pub(super) fn train_args(cfg: &StudyConfig, cell: &Cell) -> Option<Vec<String>> {
    train_args_into(cfg, cell, &cell.train_dir())
}

fn train_args_into(cfg: &StudyConfig, cell: &Cell, out: &Path) -> Option<Vec<String>> {
    let seed = cell.seed?;
    let arm = cfg.arms.iter().find(|a| a.name == cell.arm)?;
    let mut args = vec!["train".to_string(), kv("model", &p(&cfg.model)), kv("out", &p(out)), kv("seed", &seed.to_string())];
    args.extend(flags_to_args(&merge(&cfg.train, &arm.flags)));
    args.extend(common_args(cfg));
    Some(args)
}

/// What is left of a cell's training, decided from its directory (as tools/demo.sh does): a
/// saved adapter = done; a complete checkpoint = `--resume`; a directory without one (stopped
/// before its first checkpoint) = start over with `--overwrite`; nothing = a fresh run.
pub fn train_command(cfg: &StudyConfig, cell: &Cell) -> Option<(String, Vec<String>)> {
    if cell.trained() {
        return None;
    }
    train_command_into(cfg, cell, &cell.train_dir())
}

/// The training of a kept cell's adapter again, into `reproduce/` (resumed like any other
/// training): `None` unless the cell has a kept adapter hash and no adapter. (A kept hash means
/// the cell was trained elsewhere: whatever is added to it must come from that adapter, results
/// or not.)
pub fn reproduce_command(cfg: &StudyConfig, cell: &Cell) -> Option<(String, Vec<String>)> {
    if cell.trained() || cell.kept_adapter_sha256().is_none() {
        return None;
    }
    let (what, args) = train_command_into(cfg, cell, &cell.reproduce_dir())?;
    Some((what.replacen("train", "train again to reproduce the kept adapter", 1), args))
}

fn train_command_into(cfg: &StudyConfig, cell: &Cell, dir: &Path) -> Option<(String, Vec<String>)> {
    let mut args = train_args_into(cfg, cell, dir)?;
    let what = if crate::rl::trainer::latest_checkpoint(dir).is_some() {
        // the same flags as the first run: `train --resume` refuses any change but --steps & co.
        args.insert(4, "--resume".into());
        "train (resume)"
    } else if dir.exists() {
        args.insert(4, "--overwrite".into());
        "train (restart)"
    } else {
        "train"
    };
    Some((what.to_string(), args))
}

/// The `eval` arguments of a cell on an evaluation set.
pub(super) fn eval_args(cfg: &StudyConfig, cell: &Cell, e: &EvalSet) -> Vec<String> {
    let mut args = vec!["eval".to_string(), kv("model", &p(&cfg.model))];
    if cell.seed.is_some() {
        args.push(kv("adapter", &p(&cell.adapter())));
    }
    // the directory is the cell's own and is evaluated only while it holds no finished
    // evaluation (results.json): what an interrupted one left there is replaced
    args.extend([kv("data", &p(&e.data)), kv("out", &p(&cell.eval_dir(&e.name))), "--overwrite".into()]);
    args.extend(flags_to_args(&merge(&cfg.eval, &e.flags)));
    args.extend(common_args(cfg));
    args
}

/// The eval command of a cell on an evaluation set, `None` when its results.json exists.
pub fn eval_command(cfg: &StudyConfig, cell: &Cell, e: &EvalSet) -> Option<(String, Vec<String>)> {
    if cell.evaluated(&e.name) {
        return None;
    }
    Some((format!("eval-{}", e.name), eval_args(cfg, cell, e)))
}

// ---- a cell's identity: the settings its parts were run with ---------------------------------

/// Shell-quoted command line, for the dry run and error messages.
pub(super) fn show_cmd(exe: &Path, args: &[String]) -> String {
    let q = |s: &str| {
        if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=,:@+".contains(c)) {
            s.to_string()
        } else {
            format!("'{}'", s.replace('\'', "'\\''"))
        }
    };
    std::iter::once(q(&exe.display().to_string())).chain(args.iter().map(|a| q(a))).collect::<Vec<_>>().join(" ")
}
