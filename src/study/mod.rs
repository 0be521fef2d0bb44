//! `infomem-engine study`: arms (train settings) × seeds × evaluation sets as one resumable
//! plan (docs/STUDY.md). Each cell's training and evaluations run as subprocesses of this very
//! binary, so a cell's directory behaves exactly like a `train` / `eval` run directory (locks,
//! checkpoints, `--resume`); the study only decides, from what is on disk, what is left to do.
//! The report (study.json, study.md, two PNGs) is rebuilt from the finished work every time.
pub mod stats;

use crate::util::plot::{Chart, Series};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The study file (TOML). Flag tables map `key = value` to `--key value` (docs/STUDY.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StudyConfig {
    /// HF model directory, shared by every cell and the base evaluation.
    pub model: PathBuf,
    /// The study directory: cells/, base/, study.json, study.md, the plots.
    pub out: PathBuf,
    /// `--dtype` of every train and eval (f32 or bf16).
    #[serde(default)]
    pub dtype: Option<String>,
    /// `--threads` of every subprocess.
    #[serde(default)]
    pub threads: Option<usize>,
    /// Training seeds: each arm is trained once per seed.
    pub seeds: Vec<u64>,
    /// Default train flags of every arm.
    #[serde(default)]
    pub train: toml::Table,
    /// Default eval flags of every evaluation set.
    #[serde(default)]
    pub eval: toml::Table,
    pub arms: Vec<Arm>,
    pub evals: Vec<EvalSet>,
}

/// One arm: a name, optionally the seeds it is trained with (a subset of the study's, e.g. one
/// seed for an ablation), and the train flags it overrides (any other key).
#[derive(Debug, Clone, Deserialize)]
pub struct Arm {
    pub name: String,
    #[serde(default)]
    pub seeds: Option<Vec<u64>>,
    #[serde(flatten)]
    pub flags: toml::Table,
}

/// One evaluation set: a name, a JSONL file and the eval flags it overrides.
#[derive(Debug, Clone, Deserialize)]
pub struct EvalSet {
    pub name: String,
    pub data: PathBuf,
    #[serde(flatten)]
    pub flags: toml::Table,
}

/// Flags the study sets itself (per cell): refused in the flag tables.
const TRAIN_RESERVED: [&str; 7] = ["model", "out", "seed", "resume", "overwrite", "dtype", "threads"];
const EVAL_RESERVED: [&str; 8] = ["model", "adapter", "data", "out", "dtype", "threads", "json", "overwrite"];
/// Flag values that are paths: checked to exist before anything runs.
const PATH_FLAGS: [&str; 4] = ["data", "templates", "init_adapter", "config"];

/// Read and check a study file. `train_flags` / `eval_flags` are the long flags (underscored)
/// the `train` and `eval` subcommands accept: a misspelt key is refused here, not hours later.
pub fn load(path: &Path, train_flags: &BTreeSet<String>, eval_flags: &BTreeSet<String>) -> Result<StudyConfig> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read study config {}", path.display()))?;
    let mut cfg: StudyConfig = toml::from_str(&text).with_context(|| format!("study config {}", path.display()))?;
    cfg.model = home(&cfg.model);
    cfg.out = home(&cfg.out);
    validate(&cfg, train_flags, eval_flags).with_context(|| format!("study config {}", path.display()))?;
    Ok(cfg)
}

/// `~/…` → `$HOME/…` (for `model` and `out`, so a study file can name the model cache).
fn home(p: &Path) -> PathBuf {
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(h)) => PathBuf::from(h).join(rest),
        _ => p.to_path_buf(),
    }
}

fn check_name(what: &str, name: &str, seen: &mut BTreeSet<String>) -> Result<()> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        bail!("{what} name {name:?}: use letters, digits, '_' and '-' only (it names directories)");
    }
    if name == "base" && what == "arms" {
        bail!("arms name \"base\" is reserved for the untrained model's evaluation");
    }
    if !seen.insert(name.to_string()) {
        bail!("{what}: the name {name:?} is used twice");
    }
    Ok(())
}

fn check_flags(table: &toml::Table, at: &str, known: &BTreeSet<String>, reserved: &[&str], cmd: &str) -> Result<()> {
    for (k, v) in table {
        if reserved.contains(&k.as_str()) {
            bail!("{at}.{k}: set by the study itself, not a flag to give here");
        }
        if !known.contains(k) {
            bail!("{at}.{k}: `{cmd}` has no flag --{} (see `infomem-engine {cmd} --help`)", k.replace('_', "-"));
        }
        flag_value(v).with_context(|| format!("{at}.{k}"))?;
        if PATH_FLAGS.contains(&k.as_str()) {
            let p = v.as_str().with_context(|| format!("{at}.{k}: a path (string) is expected"))?;
            if !Path::new(p).exists() {
                bail!("{at}.{k}: {p} does not exist");
            }
        }
    }
    Ok(())
}

/// Check a parsed study before anything runs; errors name the offending key.
pub fn validate(cfg: &StudyConfig, train_flags: &BTreeSet<String>, eval_flags: &BTreeSet<String>) -> Result<()> {
    if !cfg.model.join("config.json").exists() {
        bail!("model: {} is not a model directory (no config.json)", cfg.model.display());
    }
    if cfg.seeds.is_empty() {
        bail!("seeds: give at least one seed, e.g. seeds = [0, 1, 2]");
    }
    if cfg.seeds.iter().collect::<BTreeSet<_>>().len() != cfg.seeds.len() {
        bail!("seeds: a seed is listed twice");
    }
    if let Some(d) = &cfg.dtype {
        if d != "f32" && d != "bf16" {
            bail!("dtype: {d:?} is not f32 or bf16");
        }
    }
    if cfg.arms.is_empty() {
        bail!("arms: give at least one [[arms]] table with a name");
    }
    if cfg.evals.is_empty() {
        bail!("evals: give at least one [[evals]] table with a name and data");
    }
    check_flags(&cfg.train, "train", train_flags, &TRAIN_RESERVED, "train")?;
    check_flags(&cfg.eval, "eval", eval_flags, &EVAL_RESERVED, "eval")?;
    let mut seen = BTreeSet::new();
    for (i, a) in cfg.arms.iter().enumerate() {
        check_name("arms", &a.name, &mut seen)?;
        check_flags(&a.flags, &format!("arms[{i}] ({})", a.name), train_flags, &TRAIN_RESERVED, "train")?;
        if let Some(ss) = &a.seeds {
            if ss.is_empty() || ss.iter().collect::<BTreeSet<_>>().len() != ss.len() {
                bail!("arms[{i}] ({}).seeds: give distinct seeds, at least one", a.name);
            }
            if let Some(x) = ss.iter().find(|x| !cfg.seeds.contains(x)) {
                bail!("arms[{i}] ({}).seeds: seed {x} is not one of the study's seeds {:?}", a.name, cfg.seeds);
            }
        }
        let merged = merge(&cfg.train, &a.flags);
        if !merged.contains_key("data") && !merged.contains_key("config") {
            bail!("arms[{i}] ({}): no training data: set `data` in [train] or in the arm", a.name);
        }
    }
    let mut seen = BTreeSet::new();
    for (i, e) in cfg.evals.iter().enumerate() {
        check_name("evals", &e.name, &mut seen)?;
        if !e.data.exists() {
            bail!("evals[{i}] ({}).data: {} does not exist", e.name, e.data.display());
        }
        check_flags(&e.flags, &format!("evals[{i}] ({})", e.name), eval_flags, &EVAL_RESERVED, "eval")?;
    }
    Ok(())
}

/// A TOML value as a flag value: `None` for `false` (the flag is left out), `Some("")` for
/// `true` (a bare switch), arrays comma-joined.
fn flag_value(v: &toml::Value) -> Result<Option<String>> {
    let scalar = |v: &toml::Value| -> Result<String> {
        Ok(match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            _ => bail!("expected a string, number, bool or array of those, got {v}"),
        })
    };
    Ok(match v {
        toml::Value::Boolean(false) => None,
        toml::Value::Boolean(true) => Some(String::new()),
        toml::Value::Array(a) => Some(a.iter().map(scalar).collect::<Result<Vec<_>>>()?.join(",")),
        v => Some(scalar(v)?),
    })
}

fn merge(base: &toml::Table, over: &toml::Table) -> toml::Table {
    let mut m = base.clone();
    for (k, v) in over {
        m.insert(k.clone(), v.clone());
    }
    m
}

fn flags_to_args(t: &toml::Table) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in t {
        // validated: flag_value cannot fail here
        if let Ok(Some(s)) = flag_value(v) {
            out.push(format!("--{}", k.replace('_', "-")));
            if !s.is_empty() || !matches!(v, toml::Value::Boolean(true)) {
                out.push(s);
            }
        }
    }
    out
}

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
    fn train_dir(&self) -> PathBuf {
        self.dir.join("train")
    }
    fn adapter(&self) -> PathBuf {
        self.train_dir().join("adapter")
    }
    fn eval_dir(&self, eval: &str) -> PathBuf {
        self.dir.join(format!("eval-{eval}"))
    }
    fn trained(&self) -> bool {
        self.seed.is_none() || self.adapter().join("adapter_model.safetensors").exists()
    }
    fn evaluated(&self, eval: &str) -> bool {
        self.eval_dir(eval).join("results.json").exists()
    }
}

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

fn common_args(cfg: &StudyConfig) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(d) = &cfg.dtype {
        v.extend(["--dtype".to_string(), d.clone()]);
    }
    if let Some(t) = cfg.threads {
        v.extend(["--threads".to_string(), t.to_string()]);
    }
    v
}

fn p(p: &Path) -> String {
    p.display().to_string()
}

/// What is left of a cell's training, decided from its directory (as tools/demo.sh does): a
/// saved adapter = done; a complete checkpoint = `--resume`; a directory without one (stopped
/// before its first checkpoint) = start over with `--overwrite`; nothing = a fresh run.
pub fn train_command(cfg: &StudyConfig, cell: &Cell) -> Option<(String, Vec<String>)> {
    let seed = cell.seed?;
    if cell.trained() {
        return None;
    }
    let arm = cfg.arms.iter().find(|a| a.name == cell.arm)?;
    let dir = cell.train_dir();
    let mut args = vec!["train".to_string(), "--model".into(), p(&cfg.model), "--out".into(), p(&dir), "--seed".into(), seed.to_string()];
    let what = if crate::rl::trainer::latest_checkpoint(&dir).is_some() {
        // the same flags as the first run: `train --resume` refuses any change but --steps & co.
        args.push("--resume".into());
        "train (resume)"
    } else if dir.exists() {
        args.push("--overwrite".into());
        "train (restart)"
    } else {
        "train"
    };
    args.extend(flags_to_args(&merge(&cfg.train, &arm.flags)));
    args.extend(common_args(cfg));
    Some((what.to_string(), args))
}

/// The eval command of a cell on an evaluation set, `None` when its results.json exists.
pub fn eval_command(cfg: &StudyConfig, cell: &Cell, e: &EvalSet) -> Option<(String, Vec<String>)> {
    if cell.evaluated(&e.name) {
        return None;
    }
    let mut args = vec!["eval".to_string(), "--model".into(), p(&cfg.model)];
    if cell.seed.is_some() {
        args.extend(["--adapter".into(), p(&cell.adapter())]);
    }
    // the directory is the cell's own and holds no finished evaluation (results.json): what an
    // interrupted one left there is replaced
    args.extend(["--data".into(), p(&e.data), "--out".into(), p(&cell.eval_dir(&e.name)), "--overwrite".into()]);
    args.extend(flags_to_args(&merge(&cfg.eval, &e.flags)));
    args.extend(common_args(cfg));
    Some((format!("eval-{}", e.name), args))
}

fn finished(cfg: &StudyConfig, cell: &Cell) -> bool {
    cell.trained() && cfg.evals.iter().all(|e| cell.evaluated(&e.name))
}

/// Shell-quoted command line, for the dry run and error messages.
fn show_cmd(exe: &Path, args: &[String]) -> String {
    let q = |s: &str| {
        if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=,:@+".contains(c)) {
            s.to_string()
        } else {
            format!("'{}'", s.replace('\'', "'\\''"))
        }
    };
    std::iter::once(q(&exe.display().to_string())).chain(args.iter().map(|a| q(a))).collect::<Vec<_>>().join(" ")
}

fn fmt_dur(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// What to run: the study, its selection of arms (`None` = all) and the binary to spawn.
pub struct RunOptions<'a> {
    pub only: Option<&'a [String]>,
    pub dry_run: bool,
    pub exe: PathBuf,
}

fn selected(cfg: &StudyConfig, only: Option<&[String]>) -> Result<Vec<Cell>> {
    if let Some(o) = only {
        for name in o {
            if !cfg.arms.iter().any(|a| &a.name == name) {
                bail!("--only: no arm named {name:?} (arms: {})", cfg.arms.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join(", "));
            }
        }
    }
    // the base evaluation always runs: every comparison needs it and it is cheap
    Ok(cells(cfg).into_iter().filter(|c| c.seed.is_none() || only.is_none_or(|o| o.contains(&c.arm))).collect())
}

/// Run what is left of the study, then write the report. With `dry_run`, print the plan and the
/// exact commands instead (nothing is created).
pub fn run(cfg: &StudyConfig, o: &RunOptions) -> Result<()> {
    let cells = selected(cfg, o.only)?;
    let total = cells.len();
    if o.dry_run {
        println!("study {}: {} cells ({} arms, {} seed(s), + base), {} evaluation set(s)", p(&cfg.out), total, cfg.arms.len(), cfg.seeds.len(), cfg.evals.len());
        for (i, c) in cells.iter().enumerate() {
            let cmds: Vec<_> = train_command(cfg, c).into_iter().chain(cfg.evals.iter().filter_map(|e| eval_command(cfg, c, e))).collect();
            if cmds.is_empty() {
                println!("[cell {}/{total}] {}: finished, skipped", i + 1, c.name());
            }
            for (what, args) in cmds {
                println!("[cell {}/{total}] {}: {what}\n  {}", i + 1, c.name(), show_cmd(&o.exe, &args));
            }
        }
        return Ok(());
    }
    crate::util::interrupt::install();
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("cannot create {}", cfg.out.display()))?;
    let _lock = crate::util::lock::lock_dir(&cfg.out, "study out")?;
    let start = Instant::now();
    let mut done_times: Vec<Duration> = Vec::new();
    for (i, c) in cells.iter().enumerate() {
        let tag = format!("[cell {}/{total}] {}", i + 1, c.name());
        // trained cells left, this one included
        let left = cells[i..].iter().filter(|c| c.seed.is_some()).count();
        if finished(cfg, c) {
            eprintln!("{tag}: finished, skipped");
            continue;
        }
        let t0 = Instant::now();
        std::fs::create_dir_all(&c.dir).with_context(|| format!("cannot create {}", c.dir.display()))?;
        let log = c.dir.join("log.txt");
        // training first: the evaluations need its adapter
        if let Some((what, args)) = train_command(cfg, c) {
            eprintln!("{tag}: {what} ... ({})", progress(start, &done_times, left));
            spawn_logged(&o.exe, &args, &log, &tag)?;
        }
        for e in &cfg.evals {
            if let Some((what, args)) = eval_command(cfg, c, e) {
                eprintln!("{tag}: {what} ... ({})", progress(start, &done_times, left));
                spawn_logged(&o.exe, &args, &log, &tag)?;
            }
        }
        // the ETA comes from trained cells only: the base cell (evaluations alone) is much shorter
        if c.seed.is_some() {
            done_times.push(t0.elapsed());
        }
        eprintln!("{tag}: done in {}", fmt_dur(t0.elapsed()));
    }
    report(cfg)?;
    eprintln!("study finished in {}: {}/study.md", fmt_dur(start.elapsed()), p(&cfg.out));
    Ok(())
}

fn progress(start: Instant, done: &[Duration], left: usize) -> String {
    let el = format!("elapsed {}", fmt_dur(start.elapsed()));
    if done.is_empty() {
        return format!("{el}, ETA after the first trained cell");
    }
    let mean = done.iter().sum::<Duration>() / done.len() as u32;
    format!("{el}, ETA {}", fmt_dur(mean * left as u32))
}

/// Run one subcommand with its output appended to the cell's log; a failure names the cell,
/// the command, the log and its last lines.
fn spawn_logged(exe: &Path, args: &[String], log: &Path, tag: &str) -> Result<()> {
    let cmd = show_cmd(exe, args);
    // a signal that came between two subprocesses: stop before starting the next
    if crate::util::interrupt::requested() {
        bail!("{tag}: interrupted; run the same study command again to resume");
    }
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(log).with_context(|| format!("cannot open {}", log.display()))?;
    writeln!(f, "\n== {} {cmd}", unix_now())?;
    let err = f.try_clone()?;
    let mut child = std::process::Command::new(exe)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(f)
        .stderr(err)
        .spawn()
        .with_context(|| format!("{tag}: cannot start {cmd}"))?;
    // a SIGTERM/SIGHUP sent to the study alone is passed on, so the cell saves its checkpoint
    let mut forwarded = false;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if crate::util::interrupt::requested() && !forwarded {
            #[cfg(unix)]
            unsafe {
                libc::kill(child.id() as i32, libc::SIGINT);
            }
            forwarded = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if status.success() {
        return Ok(());
    }
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(15)..].join("\n    ");
    if crate::util::interrupt::requested() {
        bail!("{tag}: interrupted ({status}); run the same study command again to resume (log {})", log.display());
    }
    bail!("{tag}: command failed ({status}):\n  {cmd}\n  log: {}\n  last lines:\n    {tail}", log.display())
}

fn unix_now() -> String {
    let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format!("t={s}")
}

/// One evaluated question: pairing key (id and length, so `--lengths` copies stay apart), length, em.
struct Pred {
    key: String,
    length: f64,
    em: f64,
}

fn read_preds(dir: &Path) -> Result<Vec<Pred>> {
    let path = dir.join("predictions.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut v = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let r: Value = serde_json::from_str(line).with_context(|| format!("{} line {}", path.display(), i + 1))?;
        let id = match &r["id"] {
            Value::String(s) => s.clone(),
            Value::Null => format!("#{i}"),
            x => x.to_string(),
        };
        let length = r["length"].as_f64().unwrap_or(0.0);
        let em = r["em"].as_f64().with_context(|| format!("{} line {}: no numeric `em`", path.display(), i + 1))?;
        v.push(Pred { key: format!("{id}@{length}"), length, em });
    }
    Ok(v)
}

/// Training success rate per step of a cell (`metrics.jsonl`), non-finite values left out.
fn read_steps(train_dir: &Path) -> Vec<(f64, f64)> {
    let Ok(text) = std::fs::read_to_string(train_dir.join("metrics.jsonl")) else { return vec![] };
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|m| Some((m["step"].as_f64()?, m["success_rate"].as_f64()?)))
        .filter(|(_, y)| y.is_finite())
        .collect()
}

fn ci_json(ci: (f64, f64)) -> Value {
    let f = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
    json!([f(ci.0), f(ci.1)])
}

fn num(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

/// Rewrite study.json, study.md and the plots from the cells finished so far (a cell's
/// evaluation counts once its results.json exists). Returns the study.json value.
pub fn report(cfg: &StudyConfig) -> Result<Value> {
    let all = cells(cfg);
    // (arm, eval) → seed → predictions
    let mut preds: BTreeMap<(String, String), BTreeMap<u64, Vec<Pred>>> = BTreeMap::new();
    let mut base: BTreeMap<String, Vec<Pred>> = BTreeMap::new();
    let mut cell_rows = Vec::new();
    for c in &all {
        let mut evals = serde_json::Map::new();
        for e in &cfg.evals {
            if !(c.trained() && c.evaluated(&e.name)) {
                continue;
            }
            let ps = read_preds(&c.eval_dir(&e.name))?;
            let em = stats::pooled_mean(&[ps.iter().map(|x| x.em).collect()]);
            evals.insert(e.name.clone(), json!({"em": num(em), "n": ps.len()}));
            match c.seed {
                Some(s) => {
                    preds.entry((c.arm.clone(), e.name.clone())).or_default().insert(s, ps);
                }
                None => {
                    base.insert(e.name.clone(), ps);
                }
            }
        }
        let steps = read_steps(&c.train_dir());
        cell_rows.push(json!({"arm": c.arm, "seed": c.seed, "dir": p(&c.dir), "trained": c.trained(), "finished": finished(cfg, c),
            "train_steps": if c.seed.is_some() { json!(steps.len()) } else { Value::Null }, "evals": evals}));
    }
    let ems = |v: &[Pred]| v.iter().map(|x| x.em).collect::<Vec<f64>>();

    let mut summary = Vec::new();
    let mut md = String::from("# Study report\n\n");
    md.push_str(&format!("Model `{}`; seeds {:?}; accuracy = exact match (em). 95 % intervals: two-level percentile bootstrap (seeds, then questions), {} resamples.\n\n", p(&cfg.model), cfg.seeds, stats::RESAMPLES));
    let mut pairwise = Vec::new();
    for e in &cfg.evals {
        md.push_str(&format!("## {}\n\n| arm | n questions × seeds | em | 95 % CI |\n|---|---|---|---|\n", e.name));
        if let Some(b) = base.get(&e.name) {
            let v = vec![ems(b)];
            let (m, ci) = (stats::pooled_mean(&v), stats::bootstrap_ci(&v, stats::RESAMPLES, stats::BOOT_SEED));
            md.push_str(&format!("| base | {} × 1 | {} | {} |\n", b.len(), f3(m), ci_md(ci)));
            summary.push(json!({"eval": e.name, "arm": "base", "seeds": 1, "n_questions": b.len(), "em": num(m), "ci95": ci_json(ci)}));
        }
        for a in &cfg.arms {
            let Some(by_seed) = preds.get(&(a.name.clone(), e.name.clone())) else { continue };
            let v: Vec<Vec<f64>> = by_seed.values().map(|ps| ems(ps)).collect();
            let (m, ci) = (stats::pooled_mean(&v), stats::bootstrap_ci(&v, stats::RESAMPLES, stats::BOOT_SEED));
            let nq = by_seed.values().map(|x| x.len()).max().unwrap_or(0);
            md.push_str(&format!("| {} | {} × {} | {} | {} |\n", a.name, nq, v.len(), f3(m), ci_md(ci)));
            summary.push(json!({"eval": e.name, "arm": a.name, "seeds": v.len(), "seed_list": by_seed.keys().collect::<Vec<_>>(), "n_questions": nq, "em": num(m), "ci95": ci_json(ci)}));
        }
        // pairwise: every pair of arms on the seeds both have, questions paired by id
        let mut rows = String::new();
        for (i, a) in cfg.arms.iter().enumerate() {
            for b in &cfg.arms[i + 1..] {
                let (Some(pa), Some(pb)) = (preds.get(&(a.name.clone(), e.name.clone())), preds.get(&(b.name.clone(), e.name.clone()))) else { continue };
                let mut per_seed = Vec::new();
                let (mut sb, mut sc) = (0u64, 0u64);
                let mut diffs: Vec<Vec<f64>> = Vec::new();
                let mut seed_md = Vec::new();
                for (seed, xa) in pa {
                    let Some(xb) = pb.get(seed) else { continue };
                    let mb: BTreeMap<&str, f64> = xb.iter().map(|x| (x.key.as_str(), x.em)).collect();
                    let pairs: Vec<(f64, f64)> = xa.iter().filter_map(|x| mb.get(x.key.as_str()).map(|&y| (x.em, y))).collect();
                    let (bb, cc) = stats::discordant(&pairs);
                    let pv = stats::mcnemar_exact(bb, cc);
                    sb += bb;
                    sc += cc;
                    diffs.push(pairs.iter().map(|(x, y)| x - y).collect());
                    per_seed.push(json!({"seed": seed, "n": pairs.len(), "b": bb, "c": cc, "p": pv}));
                    seed_md.push(format!("s{seed}: {bb}/{cc}, p={}", fp(pv)));
                }
                if per_seed.is_empty() {
                    continue;
                }
                let pooled = stats::mcnemar_exact(sb, sc);
                let (md_, ci) = (stats::pooled_mean(&diffs), stats::bootstrap_ci(&diffs, stats::RESAMPLES, stats::BOOT_SEED));
                rows.push_str(&format!("| {} vs {} | {} | {}/{} | {} | {} | {} |\n", a.name, b.name, seed_md.join("; "), sb, sc, fp(pooled), signed(md_), ci_md(ci)));
                pairwise.push(json!({"eval": e.name, "a": a.name, "b": b.name, "per_seed": per_seed,
                    "pooled": {"b": sb, "c": sc, "p": pooled}, "mean_diff": num(md_), "diff_ci95": ci_json(ci)}));
            }
        }
        if !rows.is_empty() {
            md.push_str("\nPaired tests (b = first arm right and second wrong, c = the reverse; exact McNemar, two-sided; pooled = discordant pairs summed over seeds; diff = em(first) − em(second)):\n\n| arms | per seed b/c, p | pooled b/c | pooled p | mean diff | 95 % CI |\n|---|---|---|---|---|---|\n");
            md.push_str(&rows);
        }
        md.push('\n');
    }
    md.push_str("Plots: `accuracy_vs_step.png` (training success rate, mean over seeds), `accuracy_vs_length.png` (held-out em per length).\n");

    plot_steps(cfg, &all)?;
    plot_lengths(cfg, &preds, &base)?;
    let out = json!({"model": p(&cfg.model), "seeds": cfg.seeds, "arms": cfg.arms.iter().map(|a| a.name.clone()).collect::<Vec<_>>(),
        "evals": cfg.evals.iter().map(|e| json!({"name": e.name, "data": p(&e.data)})).collect::<Vec<_>>(),
        "bootstrap": {"resamples": stats::RESAMPLES, "seed": stats::BOOT_SEED, "interval": "percentile 2.5/97.5, resample seeds then questions"},
        "cells": cell_rows, "summary": summary, "pairwise": pairwise});
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("cannot create {}", cfg.out.display()))?;
    crate::util::fs::write_atomic_str(&cfg.out.join("study.json"), &serde_json::to_string_pretty(&out)?)?;
    crate::util::fs::write_atomic_str(&cfg.out.join("study.md"), &md)?;
    Ok(out)
}

fn f3(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3}")
    } else {
        "–".into()
    }
}

fn signed(x: f64) -> String {
    if x.is_finite() {
        format!("{x:+.3}")
    } else {
        "–".into()
    }
}

fn fp(x: f64) -> String {
    if x < 1e-4 {
        format!("{x:.1e}")
    } else {
        format!("{x:.4}")
    }
}

fn ci_md(ci: (f64, f64)) -> String {
    if ci.0.is_finite() {
        format!("[{:.3}, {:.3}]", ci.0, ci.1)
    } else {
        "–".into()
    }
}

/// The mean of the `y`s at each `x` of (x, y) points, in order of `x`: a plot series.
fn means_by_x(points: impl Iterator<Item = (u64, f64)>) -> Vec<(f64, f64)> {
    let mut m: BTreeMap<u64, (f64, usize)> = BTreeMap::new();
    for (x, y) in points {
        let e = m.entry(x).or_default();
        e.0 += y;
        e.1 += 1;
    }
    m.iter().map(|(&x, &(s, n))| (x as f64, s / n as f64)).collect()
}

/// accuracy_vs_step.png: per arm, the training success rate at each step averaged over the
/// seeds that reached it (trained cells only).
fn plot_steps(cfg: &StudyConfig, all: &[Cell]) -> Result<()> {
    let mut series = Vec::new();
    for a in &cfg.arms {
        let cells = all.iter().filter(|c| c.arm == a.name && c.seed.is_some() && c.trained());
        let points = means_by_x(cells.flat_map(|c| read_steps(&c.train_dir())).map(|(s, y)| (s as u64, y)));
        if !points.is_empty() {
            series.push(Series { name: a.name.clone(), points });
        }
    }
    if series.is_empty() {
        return Ok(());
    }
    Chart {
        title: "training success rate (mean over seeds)".into(),
        x_label: "step".into(),
        y_label: "success rate".into(),
        series,
        y_range: Some((0.0, 1.0)),
        x_ticks_at_data: false,
    }
    .save_png(&cfg.out.join("accuracy_vs_step.png"), 900, 560)
}

/// accuracy_vs_length.png: held-out em per length, per arm (pooled over seeds) and the base
/// model; one series per arm and evaluation set.
fn plot_lengths(cfg: &StudyConfig, preds: &BTreeMap<(String, String), BTreeMap<u64, Vec<Pred>>>, base: &BTreeMap<String, Vec<Pred>>) -> Result<()> {
    let by_len = |ps: &mut dyn Iterator<Item = &Pred>| means_by_x(ps.map(|x| (x.length as u64, x.em)));
    let many = cfg.evals.len() > 1;
    let label = |arm: &str, e: &str| if many { format!("{arm} ({e})") } else { arm.to_string() };
    let mut series = Vec::new();
    for e in &cfg.evals {
        if let Some(b) = base.get(&e.name) {
            series.push(Series { name: label("base", &e.name), points: by_len(&mut b.iter()) });
        }
        for a in &cfg.arms {
            if let Some(s) = preds.get(&(a.name.clone(), e.name.clone())) {
                series.push(Series { name: label(&a.name, &e.name), points: by_len(&mut s.values().flatten()) });
            }
        }
    }
    if series.is_empty() {
        return Ok(());
    }
    Chart {
        title: "held-out accuracy vs document length".into(),
        x_label: "context length (tokens)".into(),
        y_label: "em".into(),
        series,
        y_range: Some((0.0, 1.0)),
        x_ticks_at_data: true,
    }
    .save_png(&cfg.out.join("accuracy_vs_length.png"), 900, 560)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_tables_become_arguments() {
        let t: toml::Table = toml::from_str("beta = 0.5\nsteps = 3\nno_memory_curve = true\nskip_bad = false\nlora_targets = [\"q\", \"v\"]\nlengths = [100, 200]\nreward = \"outcome\"").unwrap();
        let args = flags_to_args(&t);
        assert_eq!(
            args,
            ["--beta", "0.5", "--lengths", "100,200", "--lora-targets", "q,v", "--no-memory-curve", "--reward", "outcome", "--steps", "3"]
        );
        assert!(flag_value(&toml::Value::Table(Default::default())).is_err());
    }

    #[test]
    fn arm_overrides_win() {
        let base: toml::Table = toml::from_str("reward = \"infomem\"\nsteps = 3").unwrap();
        let over: toml::Table = toml::from_str("reward = \"outcome\"").unwrap();
        let m = merge(&base, &over);
        assert_eq!(m["reward"].as_str(), Some("outcome"));
        assert_eq!(m["steps"].as_integer(), Some(3));
    }
}
