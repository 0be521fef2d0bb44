//! A cell's identity is its resolved settings: what shapes its results (files by content), recorded
//! in `settings.json` when a part first runs and compared with the study file on every load, so a
//! changed setting is refused by name rather than reported as a finished cell.
use super::config::{Commands, SETTINGS_FILE, StudyConfig, Sub, p};
use super::plan::{Cell, cells, eval_args, show_cmd, train_args};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Settings that do not shape a result: where it goes, how often it is saved, how many threads
/// compute it, and the adapter path (an evaluation's identity holds its training's settings).
pub(super) const NOT_IDENTITY: [&str; 8] = ["out", "save_every", "keep_checkpoints", "threads", "json", "adapter", "config", "overwrite"];
/// Settings naming files whose content shapes a result: identified by content (SHA-256), so the
/// same file from another directory is the same setting and an edited one is not.
pub(super) const CONTENT_KEYS: [&str; 3] = ["data", "templates", "init_adapter"];

/// `sha256:<hex>` of a file, or of every file of a directory (name:hash, in order of name).
pub(super) fn content_id(path: &str, cache: &mut BTreeMap<PathBuf, String>) -> Result<String> {
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
pub(super) fn identity(mut m: serde_json::Map<String, Value>, cache: &mut BTreeMap<PathBuf, String>) -> Result<serde_json::Map<String, Value>> {
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
pub(super) fn resolve_cells(cfg: &StudyConfig, cmds: &dyn Commands) -> Result<BTreeMap<String, BTreeMap<String, Value>>> {
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

pub(super) fn read_record(cell: &Cell) -> Result<serde_json::Map<String, Value>> {
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

/// Settings that newer versions added, with the default that gives the behaviour of the versions
/// before them: a cell recorded without the key is the same cell when the key is at this value.
const ADDED_LATER: [(&str, &str); 1] = [("data_order", "shuffled")];

/// The differences between a recorded identity and the current one, as `key: old → new`
/// (nested objects as `train.key`).
pub(super) fn diff(prefix: &str, old: &Value, new: &Value, out: &mut Vec<String>) {
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
            // a setting added after the record was made, now at its default: the old behaviour
            (None, Some(Value::String(v))) if ADDED_LATER.contains(&(name.as_str(), v.as_str())) => {}
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
pub(super) fn check_recorded(cfg: &StudyConfig) -> Result<()> {
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
pub(super) fn record(cfg: &StudyConfig, cell: &Cell, part: &str) -> Result<()> {
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
pub(super) fn record_unrecorded(cfg: &StudyConfig, cell: &Cell, tag: &str) -> Result<()> {
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

/// Every evaluation set of the study has its results in the cell (its adapter may be gone: a
/// cell whose results were kept without their weights is finished too).
pub(super) fn finished(cfg: &StudyConfig, cell: &Cell) -> bool {
    cfg.evals.iter().all(|e| cell.evaluated(&e.name))
}
