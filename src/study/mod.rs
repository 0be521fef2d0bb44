//! `infomem-engine study`: arms (train settings) × seeds × evaluation sets as one resumable
//! plan (docs/STUDY.md). Each cell's training and evaluations run as subprocesses of this very
//! binary, so a cell's directory behaves exactly like a `train` / `eval` run directory (locks,
//! checkpoints, `--resume`); the study only decides, from what is on disk, what is left to do.
//! Before anything runs, every value is checked by the subcommands' own parsers and every part
//! of a cell on disk is compared with the settings it was recorded with (`settings.json`): a
//! changed setting is refused, never reported as a finished cell. The children die with the
//! study. The report (study.json, study.md, two PNGs) is rebuilt from the finished work every
//! time, and pairs only answers to the same questions.
pub mod stats;

use crate::util::plot::{Chart, Series};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The study file (TOML). Flag tables map `key = value` to `--key=value` (docs/STUDY.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StudyConfig {
    /// HF model directory, shared by every cell and the base evaluation.
    pub model: PathBuf,
    /// The study directory: cells/, base/, study.json, study.md, the plots.
    pub out: PathBuf,
    /// `--dtype` of every train and eval: auto (the default, resolved once for the machine the
    /// study runs on), f32 or bf16.
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
    /// Every cell's settings (its identity), resolved by [`load`]: cell name → part (`train`,
    /// `eval-<set>`) → the settings that part is run with. Not part of the file.
    #[serde(skip)]
    pub settings: BTreeMap<String, BTreeMap<String, Value>>,
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

/// The two subcommands a study runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sub {
    Train,
    Eval,
}

impl Sub {
    pub fn name(self) -> &'static str {
        match self {
            Sub::Train => "train",
            Sub::Eval => "eval",
        }
    }
}

/// What a study needs of the `train` and `eval` subcommands, given by the command line with
/// their own argument parsers and value checks (src/cli/study.rs): every cell's arguments are
/// checked exactly as its subprocess will check them, before the first cell runs.
pub trait Commands {
    /// The long flags the subcommand accepts, `-` written `_` (the keys a flag table may use).
    fn flags(&self, sub: Sub) -> BTreeSet<String>;
    /// Parse and check an argument list (`args[0]` is the subcommand's name) as the subcommand
    /// does before it runs anything, and return every setting it resolves to (defaults and a
    /// train `config` file's values included) as a JSON object keyed by setting name.
    fn resolve(&self, sub: Sub, args: &[String]) -> Result<serde_json::Map<String, Value>>;
}

/// Flags the study sets itself (per cell): refused in the flag tables.
const TRAIN_RESERVED: [&str; 7] = ["model", "out", "seed", "resume", "overwrite", "dtype", "threads"];
const EVAL_RESERVED: [&str; 8] = ["model", "adapter", "data", "out", "dtype", "threads", "json", "overwrite"];
/// Flag values that are paths: checked to exist before anything runs.
const PATH_FLAGS: [&str; 4] = ["data", "templates", "init_adapter", "config"];
/// Other spellings of a flag's key: the train config file (`TrainConfig`) calls the outcome
/// matcher `matcher`, the flag is `--match`; a study accepts both and runs `--match`.
const ALIASES: [(&str, &str); 1] = [("matcher", "match")];
/// The study directory's lock file (a train run's is `.train.lock`).
pub const LOCK_FILE: &str = ".study.lock";
/// Each cell's record of the settings its parts were run with (docs/STUDY.md).
const SETTINGS_FILE: &str = "settings.json";

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

/// `~/…` → `$HOME/…` (for `model` and `out`, so a study file can name the model cache).
fn home(p: &Path) -> PathBuf {
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(h)) => PathBuf::from(h).join(rest),
        _ => p.to_path_buf(),
    }
}

fn normalize_table(t: &mut toml::Table, at: &str) -> Result<()> {
    for (alias, name) in ALIASES {
        if let Some(v) = t.remove(alias) {
            if t.contains_key(name) {
                bail!("{at}: `{name}` and `{alias}` are one setting (the flag --{name}; `{alias}` in a train config file): give it once");
            }
            t.insert(name.to_string(), v);
        }
    }
    Ok(())
}

fn normalize_aliases(cfg: &mut StudyConfig) -> Result<()> {
    normalize_table(&mut cfg.train, "train")?;
    normalize_table(&mut cfg.eval, "eval")?;
    for (i, a) in cfg.arms.iter_mut().enumerate() {
        normalize_table(&mut a.flags, &format!("arms[{i}] ({})", a.name))?;
    }
    for (i, e) in cfg.evals.iter_mut().enumerate() {
        normalize_table(&mut e.flags, &format!("evals[{i}] ({})", e.name))?;
    }
    Ok(())
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

/// Check a parsed study's structure before anything runs; errors name the offending key.
pub fn validate(cfg: &StudyConfig, train_flags: &BTreeSet<String>, eval_flags: &BTreeSet<String>) -> Result<()> {
    if !cfg.model.join("config.json").exists() {
        bail!("model: {} is not a model directory (no config.json)", cfg.model.display());
    }
    if cfg.out.symlink_metadata().is_ok() && !cfg.out.is_dir() {
        bail!("out: {} exists and is not a directory (a study writes a directory of cells there); choose another out", cfg.out.display());
    }
    if cfg.seeds.is_empty() {
        bail!("seeds: give at least one seed, e.g. seeds = [0, 1, 2]");
    }
    if cfg.seeds.iter().collect::<BTreeSet<_>>().len() != cfg.seeds.len() {
        bail!("seeds: a seed is listed twice");
    }
    if let Some(d) = &cfg.dtype {
        if !["auto", "f32", "bf16"].contains(&d.as_str()) {
            bail!("dtype: {d:?} is not auto, f32 or bf16");
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

/// The arguments of a probe of one setting: the subcommand with placeholders for what it
/// requires (nothing is read or run), then the setting.
fn probe_args(cfg: &StudyConfig, sub: Sub, key: &str, extra: Vec<String>) -> Vec<String> {
    let mut a = vec![sub.name().to_string(), kv("model", &p(&cfg.model)), kv("out", &p(&cfg.out.join("probe")))];
    match sub {
        Sub::Train if key != "data" => a.push(kv("data", &p(&cfg.model.join("config.json")))),
        Sub::Train => {}
        Sub::Eval => a.push(kv("data", &p(&cfg.evals[0].data))),
    }
    a.extend(extra);
    a
}

/// Every value of the study, one at a time, through the subcommand's own parser and checks (so
/// an error names the key it comes from): the top-level `dtype` and `threads`, then every key of
/// every flag table. Every cell's complete argument lists are checked after this, by
/// [`resolve_cells`] (settings that are only wrong together, a train `config` file).
fn check_values(cfg: &StudyConfig, cmds: &dyn Commands) -> Result<()> {
    for (key, val) in [("dtype", cfg.dtype.clone()), ("threads", cfg.threads.map(|t| t.to_string()))] {
        let Some(val) = val else { continue };
        for sub in [Sub::Train, Sub::Eval] {
            cmds.resolve(sub, &probe_args(cfg, sub, key, vec![kv(key, &val)])).with_context(|| format!("{key} = {val}"))?;
        }
    }
    let mut tables: Vec<(String, &toml::Table, Sub)> = vec![("train".into(), &cfg.train, Sub::Train), ("eval".into(), &cfg.eval, Sub::Eval)];
    tables.extend(cfg.arms.iter().enumerate().map(|(i, a)| (format!("arms[{i}] ({})", a.name), &a.flags, Sub::Train)));
    tables.extend(cfg.evals.iter().enumerate().map(|(i, e)| (format!("evals[{i}] ({})", e.name), &e.flags, Sub::Eval)));
    for (at, table, sub) in tables {
        // a train `config` file's values may be overridden by the table's flags: it is checked
        // with them, in its cells' complete argument lists (below)
        for (k, v) in table.iter().filter(|(k, _)| k.as_str() != "config") {
            let one: toml::Table = [(k.clone(), v.clone())].into_iter().collect();
            cmds.resolve(sub, &probe_args(cfg, sub, k, flags_to_args(&one))).with_context(|| format!("{at}.{k} = {v}"))?;
        }
    }
    Ok(())
}

/// A TOML value as a flag value: `None` for `false` (the flag is left out), `Some("")` for
/// `true` (a bare switch), arrays comma-joined (an empty one is refused: leave the key out).
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
        toml::Value::Array(a) if a.is_empty() => bail!("an empty list: give at least one value, or leave the key out for the default"),
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

/// `--key=value`: one argument, so a value that starts with `-` (`steps = -4`) reaches the
/// flag's parser as a value (and is refused there, naming the flag) instead of passing for a flag.
fn kv(key: &str, value: &str) -> String {
    format!("--{}={value}", key.replace('_', "-"))
}

fn flags_to_args(t: &toml::Table) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in t {
        // validated: flag_value cannot fail here
        match (v, flag_value(v)) {
            (toml::Value::Boolean(true), _) => out.push(format!("--{}", k.replace('_', "-"))),
            (_, Ok(Some(s))) => out.push(kv(k, &s)),
            _ => {}
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
    /// An arm's training that would be kept: its adapter or a checkpoint to resume from.
    fn has_training(&self) -> bool {
        self.seed.is_some() && (self.trained() || crate::rl::trainer::latest_checkpoint(&self.train_dir()).is_some())
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

fn common_args(cfg: &StudyConfig) -> Vec<String> {
    let mut v = vec![kv("dtype", &study_dtype(cfg))];
    if let Some(t) = cfg.threads {
        v.push(kv("threads", &t.to_string()));
    }
    v
}

fn p(p: &Path) -> String {
    p.display().to_string()
}

/// The `train` arguments of an arm's cell as a fresh run (`None` for the base cell).
fn train_args(cfg: &StudyConfig, cell: &Cell) -> Option<Vec<String>> {
    let seed = cell.seed?;
    let arm = cfg.arms.iter().find(|a| a.name == cell.arm)?;
    let mut args = vec!["train".to_string(), kv("model", &p(&cfg.model)), kv("out", &p(&cell.train_dir())), kv("seed", &seed.to_string())];
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
    let mut args = train_args(cfg, cell)?;
    let dir = cell.train_dir();
    let what = if crate::rl::trainer::latest_checkpoint(&dir).is_some() {
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
fn eval_args(cfg: &StudyConfig, cell: &Cell, e: &EvalSet) -> Vec<String> {
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

/// Settings that do not shape a result: where it goes, how often it is saved, how many threads
/// compute it, and the adapter path (an evaluation's identity holds its training's settings).
const NOT_IDENTITY: [&str; 8] = ["out", "save_every", "keep_checkpoints", "threads", "json", "adapter", "config", "overwrite"];
/// Settings naming files whose content shapes a result: identified by content (SHA-256), so the
/// same file from another directory is the same setting and an edited one is not.
const CONTENT_KEYS: [&str; 3] = ["data", "templates", "init_adapter"];

/// `sha256:<hex>` of a file, or of every file of a directory (name:hash, in order of name).
fn content_id(path: &str, cache: &mut BTreeMap<PathBuf, String>) -> Result<String> {
    let abs = crate::util::fs::absolute_path(Path::new(path));
    if let Some(h) = cache.get(&abs) {
        return Ok(h.clone());
    }
    let h = if abs.is_dir() {
        let mut names: Vec<PathBuf> = std::fs::read_dir(&abs).with_context(|| format!("cannot read {}", abs.display()))?.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect();
        names.sort();
        let parts = names
            .iter()
            .map(|f| Ok(format!("{}:{}", f.file_name().unwrap_or_default().to_string_lossy(), crate::util::sha256::sha256_file(f)?)))
            .collect::<Result<Vec<_>>>()?;
        format!("sha256:{}", crate::util::sha256::sha256_hex(parts.join(",").as_bytes()))
    } else {
        format!("sha256:{}", crate::util::sha256::sha256_file(&abs)?)
    };
    cache.insert(abs, h.clone());
    Ok(h)
}

/// A part's identity from its resolved settings: the settings that shape its result, files by
/// content, the model by its absolute path.
fn identity(mut m: serde_json::Map<String, Value>, cache: &mut BTreeMap<PathBuf, String>) -> Result<serde_json::Map<String, Value>> {
    for k in NOT_IDENTITY {
        m.remove(k);
    }
    if let Some(Value::String(s)) = m.get("model") {
        let abs = crate::util::fs::absolute_path(Path::new(s));
        m.insert("model".into(), json!(p(&abs)));
    }
    for k in CONTENT_KEYS {
        let v = match m.get(k) {
            Some(Value::String(s)) => json!(content_id(s, cache)?),
            Some(Value::Array(a)) => Value::Array(a.iter().map(|x| Ok(json!(content_id(x.as_str().unwrap_or_default(), cache)?))).collect::<Result<_>>()?),
            _ => continue,
        };
        m.insert(k.to_string(), v);
    }
    Ok(m)
}

/// Every cell's parts with the settings they run with (checked by the subcommands' parsers):
/// `train` (an arm's cell) and `eval-<set>`, whose identity includes its training's.
fn resolve_cells(cfg: &StudyConfig, cmds: &dyn Commands) -> Result<BTreeMap<String, BTreeMap<String, Value>>> {
    let mut cache = BTreeMap::new();
    let mut out = BTreeMap::new();
    for c in cells(cfg) {
        let mut parts = BTreeMap::new();
        let mut train = None;
        if let Some(args) = train_args(cfg, &c) {
            let m = cmds.resolve(Sub::Train, &args).with_context(|| format!("cell {}: train settings (the arm's flags over [train])", c.name()))?;
            let id = Value::Object(identity(m, &mut cache)?);
            parts.insert("train".to_string(), id.clone());
            train = Some(id);
        }
        for e in &cfg.evals {
            let m = cmds.resolve(Sub::Eval, &eval_args(cfg, &c, e)).with_context(|| format!("cell {}: eval settings of {} (the set's flags over [eval])", c.name(), e.name))?;
            let mut id = identity(m, &mut cache)?;
            if let Some(t) = &train {
                id.insert("train".into(), t.clone());
            }
            parts.insert(format!("eval-{}", e.name), Value::Object(id));
        }
        out.insert(c.name(), parts);
    }
    Ok(out)
}

fn read_record(cell: &Cell) -> Result<serde_json::Map<String, Value>> {
    let path = cell.dir.join(SETTINGS_FILE);
    match std::fs::read_to_string(&path) {
        Ok(t) => match serde_json::from_str::<Value>(&t).with_context(|| format!("{} is not a settings record (JSON)", path.display()))? {
            Value::Object(m) => Ok(m),
            _ => bail!("{} is not a settings record (a JSON object)", path.display()),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Default::default()),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// The differences between a recorded identity and the current one, as `key: old → new`
/// (nested objects as `train.key`).
fn diff(prefix: &str, old: &Value, new: &Value, out: &mut Vec<String>) {
    let show = |v: Option<&Value>| match v {
        None | Some(Value::Null) => "(none)".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    let (Value::Object(a), Value::Object(b)) = (old, new) else { return };
    let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for k in keys {
        let (x, y) = (a.get(k), b.get(k));
        let name = format!("{prefix}{k}");
        match (x, y) {
            (Some(x @ Value::Object(_)), Some(y @ Value::Object(_))) => diff(&format!("{name}."), x, y, out),
            (Some(Value::Number(x)), Some(Value::Number(y))) if x.as_f64() == y.as_f64() => {}
            _ if x == y => {}
            _ => out.push(format!("{name} {} → {}", show(x), show(y))),
        }
    }
}

/// Refuse a study whose cells on disk were run with other settings than the file now gives
/// (every cell of the study, selected or not: the report shows them all). A part is compared
/// when it has something that would be kept: a training with a checkpoint or its adapter, an
/// evaluation with its results.json (a part without is run again in full, under the file's
/// settings, anyway). A part run before settings were recorded has no record and is taken as it
/// is (and recorded by the next run).
fn check_recorded(cfg: &StudyConfig) -> Result<()> {
    let mut lines = Vec::new();
    let mut remove: Vec<PathBuf> = Vec::new();
    for c in cells(cfg) {
        if !c.dir.exists() {
            continue;
        }
        let rec = read_record(&c)?;
        let now = &cfg.settings[&c.name()];
        let rel = c.dir.strip_prefix(&cfg.out).unwrap_or(&c.dir).display().to_string();
        if c.seed.is_some() && c.has_training() {
            if let (Some(old), Some(new)) = (rec.get("train"), now.get("train")) {
                let mut d = Vec::new();
                diff("", old, new, &mut d);
                if !d.is_empty() {
                    lines.push(format!("{rel} train: {}", d.join(", ")));
                    remove.push(c.dir.clone());
                    continue;
                }
            }
        }
        for e in &cfg.evals {
            let part = format!("eval-{}", e.name);
            if !c.evaluated(&e.name) {
                continue;
            }
            if let (Some(old), Some(new)) = (rec.get(&part), now.get(&part)) {
                let mut d = Vec::new();
                diff("", old, new, &mut d);
                if !d.is_empty() {
                    lines.push(format!("{rel} {part}: {}", d.join(", ")));
                    remove.push(c.eval_dir(&e.name));
                }
            }
        }
    }
    if lines.is_empty() {
        return Ok(());
    }
    let n = lines.len();
    let mut shown = lines.into_iter().take(20).map(|l| format!("  {l}")).collect::<Vec<_>>();
    if n > 20 {
        shown.push(format!("  … and {} more", n - 20));
    }
    let rm = remove.iter().map(|d| show_cmd(Path::new("rm"), &[p(d)]).trim_start_matches("rm ").to_string()).collect::<Vec<_>>().join(" ");
    bail!(
        "{} was run with other settings than this file gives now (a cell's results are never shown or reused under other settings):\n{}\n\
         Either restore those values, or delete what was made with the old ones so that the study redoes it:\n  rm -r {rm}\n\
         or give the changed study another `out`.",
        p(&cfg.out),
        shown.join("\n")
    )
}

/// Record a part's settings in its cell's `settings.json` (before it runs, so a part stopped
/// half-way is compared too).
fn record(cfg: &StudyConfig, cell: &Cell, part: &str) -> Result<()> {
    let Some(v) = cfg.settings.get(&cell.name()).and_then(|s| s.get(part)) else { return Ok(()) };
    let mut rec = read_record(cell)?;
    if rec.get(part) == Some(v) {
        return Ok(());
    }
    rec.insert(part.to_string(), v.clone());
    crate::util::fs::write_atomic_str(&cell.dir.join(SETTINGS_FILE), &serde_json::to_string_pretty(&Value::Object(rec))?)
}

/// Parts on disk without a record (run before settings were recorded): recorded as the study
/// file's now, with a note.
fn record_unrecorded(cfg: &StudyConfig, cell: &Cell, tag: &str) -> Result<()> {
    if !cell.dir.exists() {
        return Ok(());
    }
    let rec = read_record(cell)?;
    let mut parts: Vec<(String, PathBuf, bool)> = cfg.evals.iter().map(|e| (format!("eval-{}", e.name), cell.eval_dir(&e.name), cell.evaluated(&e.name))).collect();
    if cell.seed.is_some() {
        parts.insert(0, ("train".into(), cell.train_dir(), cell.has_training()));
    }
    for (part, dir, kept) in parts {
        if kept && !rec.contains_key(&part) {
            eprintln!("{tag}: note: {} has no settings record (made before they were recorded): taken as run with this study file's", dir.display());
            record(cfg, cell, &part)?;
        }
    }
    Ok(())
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
    let _lock = lock(cfg)?;
    let start = Instant::now();
    let mut done_times: Vec<Duration> = Vec::new();
    for (i, c) in cells.iter().enumerate() {
        let tag = format!("[cell {}/{total}] {}", i + 1, c.name());
        let left = to_train(&cells[i..]);
        record_unrecorded(cfg, c, &tag)?;
        if finished(cfg, c) {
            eprintln!("{tag}: finished, skipped");
            continue;
        }
        let t0 = Instant::now();
        std::fs::create_dir_all(&c.dir).with_context(|| format!("cannot create {}", c.dir.display()))?;
        let log = c.dir.join("log.txt");
        // training first: the evaluations need its adapter
        let trains = train_command(cfg, c);
        let trained_now = trains.is_some();
        if let Some((what, args)) = trains {
            eprintln!("{tag}: {what} ... ({})", progress(start, &done_times, left));
            record(cfg, c, "train")?;
            spawn_logged(&o.exe, &args, &log, &tag)?;
        }
        for e in &cfg.evals {
            if let Some((what, args)) = eval_command(cfg, c, e) {
                eprintln!("{tag}: {what} ... ({})", progress(start, &done_times, left));
                record(cfg, c, &what)?;
                spawn_logged(&o.exe, &args, &log, &tag)?;
            }
        }
        // the ETA comes from the cells trained in this sitting only: a cell that only evaluated
        // (the base, or one trained in an earlier sitting) is much shorter
        if trained_now {
            done_times.push(t0.elapsed());
        }
        eprintln!("{tag}: done in {}", fmt_dur(t0.elapsed()));
    }
    report(cfg)?;
    eprintln!("study finished in {}: {}/study.md", fmt_dur(start.elapsed()), p(&cfg.out));
    Ok(())
}

/// Lock the study directory (created if missing) for this process's lifetime: one study
/// process per directory (`.study.lock`).
pub fn lock(cfg: &StudyConfig) -> Result<crate::util::lock::DirLock> {
    crate::util::lock::lock_dir_named(&cfg.out, LOCK_FILE, "study out")
}

/// `--report-only`: rewrite the report from the finished evaluations, under the study's lock;
/// refused when nothing has been evaluated yet (there is nothing to report).
pub fn report_only(cfg: &StudyConfig) -> Result<Value> {
    let any = cells(cfg).iter().any(|c| c.trained() && cfg.evals.iter().any(|e| c.evaluated(&e.name)));
    if !any {
        bail!(
            "--report-only: nothing has run in {} yet (no cell has a finished evaluation): run the study first (without --report-only)",
            p(&cfg.out)
        );
    }
    let _lock = lock(cfg)?;
    report(cfg)
}

/// The cells among these that still have to be trained (an arm's cell without its adapter):
/// what the ETA multiplies the mean training cell's time by.
fn to_train(cells: &[Cell]) -> usize {
    cells.iter().filter(|c| !c.trained()).count()
}

/// `elapsed …, ETA …`: the mean time of the cells trained in this sitting times the cells left
/// to train (`left`, the current one included); no ETA once nothing is left to train.
fn progress(start: Instant, done: &[Duration], left: usize) -> String {
    let el = format!("elapsed {}", fmt_dur(start.elapsed()));
    if left == 0 {
        return el;
    }
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
    let mut command = std::process::Command::new(exe);
    command.args(args).stdin(std::process::Stdio::null()).stdout(f).stderr(err);
    die_with_parent(&mut command);
    let mut child = command.spawn().with_context(|| format!("{tag}: cannot start {cmd}"))?;
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

/// The child dies with the study, however the study ends (`kill -9` included): Linux sends it
/// SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), and a child whose parent died before the
/// request took hold (it was reparented: getppid is no longer the study) exits at once. A killed
/// `train` resumes from its newest checkpoint when the study is run again. (The signal follows
/// the spawning thread; the study spawns from the command's thread, which lives as long as the
/// process.)
fn die_with_parent(command: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid, _exit)
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(137);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
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

/// Two arms' answers of one seed paired by question, or why they cannot be: a paired test needs
/// both to have answered the same questions (the same ids at the same lengths), each once.
fn paired(xa: &[Pred], xb: &[Pred]) -> std::result::Result<Vec<(f64, f64)>, String> {
    let ma: BTreeMap<&str, f64> = xa.iter().map(|x| (x.key.as_str(), x.em)).collect();
    let mb: BTreeMap<&str, f64> = xb.iter().map(|x| (x.key.as_str(), x.em)).collect();
    let common = ma.keys().filter(|k| mb.contains_key(*k)).count();
    if common == 0 {
        return Err(format!("no paired questions: {} and {} questions, none in common", xa.len(), xb.len()));
    }
    if ma.len() != xa.len() || mb.len() != xb.len() {
        return Err(format!("a question was answered more than once ({} answers for {} questions, {} for {})", xa.len(), ma.len(), xb.len(), mb.len()));
    }
    if common != ma.len() || common != mb.len() {
        return Err(format!("different questions: {} and {}, {common} in common", xa.len(), xb.len()));
    }
    // in the first arm's order (the bootstrap of the differences draws by position)
    Ok(xa.iter().map(|x| (x.em, mb[x.key.as_str()])).collect())
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
    let mut unequal: Vec<String> = Vec::new();
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
            // "n × seeds" only when every seed answered the same questions
            let keysets: BTreeSet<BTreeSet<&str>> = by_seed.values().map(|ps| ps.iter().map(|x| x.key.as_str()).collect()).collect();
            let same = keysets.len() <= 1;
            let n_md = if same {
                format!("{nq} × {}", v.len())
            } else {
                format!("{} (per seed; the seeds' questions differ)", by_seed.values().map(|x| x.len().to_string()).collect::<Vec<_>>().join(" + "))
            };
            md.push_str(&format!("| {} | {} | {} | {} |\n", a.name, n_md, f3(m), ci_md(ci)));
            summary.push(json!({"eval": e.name, "arm": a.name, "seeds": v.len(), "seed_list": by_seed.keys().collect::<Vec<_>>(), "n_questions": nq,
                "n_per_seed": by_seed.values().map(|x| x.len()).collect::<Vec<_>>(), "same_questions": same, "em": num(m), "ci95": ci_json(ci)}));
        }
        // the rows are comparable only when every run answered the same questions
        let mut all_sets: BTreeSet<BTreeSet<&str>> = BTreeSet::new();
        all_sets.extend(base.get(&e.name).map(|b| b.iter().map(|x| x.key.as_str()).collect()));
        for a in &cfg.arms {
            if let Some(by_seed) = preds.get(&(a.name.clone(), e.name.clone())) {
                all_sets.extend(by_seed.values().map(|ps| ps.iter().map(|x| x.key.as_str()).collect::<BTreeSet<_>>()));
            }
        }
        if all_sets.len() > 1 {
            md.push_str("\nNot every run above answered the same questions (other lengths or data): these accuracies are not comparable row to row.\n");
            unequal.push(e.name.clone());
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
                    let pairs = match paired(xa, xb) {
                        Ok(pairs) => pairs,
                        Err(why) => {
                            per_seed.push(json!({"seed": seed, "paired": false, "why": why}));
                            seed_md.push(format!("s{seed}: not paired ({why})"));
                            continue;
                        }
                    };
                    let (bb, cc) = stats::discordant(&pairs);
                    let pv = stats::mcnemar_exact(bb, cc);
                    sb += bb;
                    sc += cc;
                    diffs.push(pairs.iter().map(|(x, y)| x - y).collect());
                    per_seed.push(json!({"seed": seed, "paired": true, "n": pairs.len(), "b": bb, "c": cc, "p": pv}));
                    seed_md.push(format!("s{seed}: {bb}/{cc}, p={}", fp(pv)));
                }
                if per_seed.is_empty() {
                    continue;
                }
                if diffs.is_empty() {
                    // no seed with paired questions: no test, no difference
                    rows.push_str(&format!("| {} vs {} | {} | – | – | – | – |\n", a.name, b.name, seed_md.join("; ")));
                    pairwise.push(json!({"eval": e.name, "a": a.name, "b": b.name, "per_seed": per_seed, "pooled": Value::Null, "mean_diff": Value::Null, "diff_ci95": Value::Null}));
                    continue;
                }
                let pooled = stats::mcnemar_exact(sb, sc);
                let (md_, ci) = (stats::pooled_mean(&diffs), stats::bootstrap_ci(&diffs, stats::RESAMPLES, stats::BOOT_SEED));
                rows.push_str(&format!("| {} vs {} | {} | {}/{} | {} | {} | {} |\n", a.name, b.name, seed_md.join("; "), sb, sc, fp(pooled), signed(md_), ci_md(ci)));
                pairwise.push(json!({"eval": e.name, "a": a.name, "b": b.name, "per_seed": per_seed,
                    "pooled": {"b": sb, "c": sc, "p": pooled, "seeds": diffs.len()}, "mean_diff": num(md_), "diff_ci95": ci_json(ci)}));
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
        "cells": cell_rows, "summary": summary, "pairwise": pairwise, "evals_with_different_questions": unequal});
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
        let t: toml::Table = toml::from_str("beta = 0.5\nsteps = -4\nno_memory_curve = true\nskip_bad = false\nlora_targets = [\"q\", \"v\"]\nlengths = [100, 200]\nreward = \"outcome\"").unwrap();
        let args = flags_to_args(&t);
        // one argument per value, `--key=value`: a negative number reaches its flag as a value
        assert_eq!(args, ["--beta=0.5", "--lengths=100,200", "--lora-targets=q,v", "--no-memory-curve", "--reward=outcome", "--steps=-4"]);
        assert!(flag_value(&toml::Value::Table(Default::default())).is_err());
        let e = flag_value(&toml::Value::Array(vec![])).unwrap_err().to_string();
        assert!(e.contains("empty list"), "{e}");
    }

    #[test]
    fn matcher_is_match() {
        let mut t: toml::Table = toml::from_str("matcher = \"f1\"").unwrap();
        normalize_table(&mut t, "train").unwrap();
        assert_eq!(flags_to_args(&t), ["--match=f1"]);
        let mut both: toml::Table = toml::from_str("matcher = \"f1\"\nmatch = \"em\"").unwrap();
        let e = normalize_table(&mut both, "arms[0] (a)").unwrap_err().to_string();
        assert!(e.contains("arms[0] (a): `match` and `matcher` are one setting"), "{e}");
    }

    fn pred(id: &str, length: f64, em: f64) -> Pred {
        Pred { key: format!("{id}@{length}"), length, em }
    }

    #[test]
    fn only_the_same_questions_are_paired() {
        let a = vec![pred("q1", 300.0, 1.0), pred("q2", 300.0, 0.0)];
        let b = vec![pred("q2", 300.0, 1.0), pred("q1", 300.0, 1.0)];
        assert_eq!(paired(&a, &b).unwrap(), vec![(1.0, 1.0), (0.0, 1.0)]);
        // the same ids at other lengths: nothing in common, no test
        let b7 = vec![pred("q1", 700.0, 1.0), pred("q2", 700.0, 1.0)];
        assert_eq!(paired(&a, &b7).unwrap_err(), "no paired questions: 2 and 2 questions, none in common");
        assert!(paired(&a, &[]).unwrap_err().starts_with("no paired questions"));
        // partly overlapping sets: not the same questions, no test either
        let b3 = vec![pred("q1", 300.0, 1.0), pred("q3", 300.0, 1.0)];
        assert_eq!(paired(&a, &b3).unwrap_err(), "different questions: 2 and 2, 1 in common");
        let dup = vec![pred("q1", 300.0, 1.0), pred("q1", 300.0, 0.0), pred("q2", 300.0, 1.0)];
        assert!(paired(&dup, &a).unwrap_err().contains("more than once"));
    }

    #[test]
    fn changed_settings_are_named() {
        let old = json!({"beta": 0.5, "steps": 2, "lengths": [300, 700], "train": {"reward": "infomem", "lr": 0.005}});
        let new = json!({"beta": 0.7, "steps": 2.0, "lengths": [400, 800], "train": {"reward": "infomem", "lr": 0.005}, "kl_coef": 0.0});
        let mut d = Vec::new();
        diff("", &old, &new, &mut d);
        assert_eq!(d, ["beta 0.5 → 0.7", "kl_coef (none) → 0.0", "lengths [300,700] → [400,800]"]);
        let mut d = Vec::new();
        diff("", &old, &json!({"beta": 0.5, "steps": 2, "lengths": [300, 700], "train": {"reward": "outcome", "lr": 0.005}}), &mut d);
        assert_eq!(d, ["train.reward infomem → outcome"]);
    }

    #[test]
    fn eta_counts_only_cells_left_to_train() {
        let tmp = tempfile::tempdir().unwrap();
        let cell = |arm: &str, seed: Option<u64>| Cell { arm: arm.into(), seed, dir: tmp.path().join(arm) };
        let cells = [cell("base", None), cell("a", Some(0)), cell("b", Some(0))];
        // a is trained (its adapter exists) and only has evaluations left: not a cell to train
        std::fs::create_dir_all(cells[1].adapter()).unwrap();
        std::fs::write(cells[1].adapter().join("adapter_model.safetensors"), b"x").unwrap();
        assert_eq!(to_train(&cells), 1);
        assert_eq!(to_train(&cells[2..]), 1);
        let start = Instant::now();
        assert!(progress(start, &[Duration::from_secs(60)], 2).ends_with("ETA 2m00s"), "{}", progress(start, &[Duration::from_secs(60)], 2));
        assert!(!progress(start, &[Duration::from_secs(60)], 0).contains("ETA"));
        assert!(progress(start, &[], 1).contains("ETA after the first trained cell"));
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
