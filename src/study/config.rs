//! The study file: its structure (`StudyConfig`: arms, seeds, evaluation sets, flag tables), and
//! the checks that refuse a misspelt key or a bad value before anything runs (every value parsed
//! by the subcommand's own parser, the error naming the key).
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

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
    /// Sets with the same curve name (one task at several document lengths) form one length
    /// curve per arm in the report (`study::curves`); not an eval flag, not part of a cell.
    #[serde(default)]
    pub curve: Option<String>,
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
pub(super) const TRAIN_RESERVED: [&str; 7] = ["model", "out", "seed", "resume", "overwrite", "dtype", "threads"];
pub(super) const EVAL_RESERVED: [&str; 8] = ["model", "adapter", "data", "out", "dtype", "threads", "json", "overwrite"];
/// Flag values that are paths: checked to exist before anything runs.
pub(super) const PATH_FLAGS: [&str; 4] = ["data", "templates", "init_adapter", "config"];
/// Other spellings of a flag's key: the train config file (`TrainConfig`) calls the outcome
/// matcher `matcher`, the flag is `--match`; a study accepts both and runs `--match`.
pub(super) const ALIASES: [(&str, &str); 1] = [("matcher", "match")];
/// The study directory's lock file (a train run's is `.train.lock`).
pub const LOCK_FILE: &str = ".study.lock";
/// Each cell's record of the settings its parts were run with (docs/STUDY.md).
pub(super) const SETTINGS_FILE: &str = "settings.json";

/// `~/…` → `$HOME/…` (for `model` and `out`, so a study file can name the model cache).
pub(super) fn home(p: &Path) -> PathBuf {
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(h)) => PathBuf::from(h).join(rest),
        _ => p.to_path_buf(),
    }
}

pub(super) fn normalize_table(t: &mut toml::Table, at: &str) -> Result<()> {
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

pub(super) fn normalize_aliases(cfg: &mut StudyConfig) -> Result<()> {
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

pub(super) fn check_name(what: &str, name: &str, seen: &mut BTreeSet<String>) -> Result<()> {
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

pub(super) fn check_flags(table: &toml::Table, at: &str, known: &BTreeSet<String>, reserved: &[&str], cmd: &str) -> Result<()> {
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
pub(super) fn probe_args(cfg: &StudyConfig, sub: Sub, key: &str, extra: Vec<String>) -> Vec<String> {
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
pub(super) fn check_values(cfg: &StudyConfig, cmds: &dyn Commands) -> Result<()> {
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
pub(super) fn flag_value(v: &toml::Value) -> Result<Option<String>> {
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

pub(super) fn merge(base: &toml::Table, over: &toml::Table) -> toml::Table {
    let mut m = base.clone();
    for (k, v) in over {
        m.insert(k.clone(), v.clone());
    }
    m
}

/// `--key=value`: one argument, so a value that starts with `-` (`steps = -4`) reaches the
/// flag's parser as a value (and is refused there, naming the flag) instead of passing for a flag.
pub(super) fn kv(key: &str, value: &str) -> String {
    format!("--{}={value}", key.replace('_', "-"))
}

pub(super) fn flags_to_args(t: &toml::Table) -> Vec<String> {
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

pub(super) fn p(p: &Path) -> String {
    p.display().to_string()
}
