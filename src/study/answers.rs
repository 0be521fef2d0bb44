//! An evaluation's answers as the study report reads them (`predictions.jsonl`), their pairing
//! between two runs by question, and how the report writes its numbers; shared by `report` and
//! `retention`.
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// One evaluated question: pairing key (id and length, so `--lengths` copies stay apart), length,
/// em, and whether its gold answer was captured / in the final memory (`None`: an evaluation
/// from before eval recorded them).
pub(super) struct Pred {
    pub(super) key: String,
    pub(super) length: f64,
    pub(super) em: f64,
    pub(super) captured: Option<bool>,
    pub(super) in_final: Option<bool>,
    /// Whether the answer used its whole token budget without ending (`None`: not recorded).
    pub(super) answer_cut: Option<bool>,
}

pub(super) fn read_preds(dir: &Path) -> Result<Vec<Pred>> {
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
        v.push(Pred { key: format!("{id}@{length}"), length, em, captured: r["captured"].as_bool(), in_final: r["in_final"].as_bool(), answer_cut: r["answer_cut"].as_bool() });
    }
    Ok(v)
}

/// Two arms' answers of one seed paired by question, or why they cannot be: a paired test needs
/// both to have answered the same questions (the same ids at the same lengths), each once.
pub(super) fn paired(xa: &[Pred], xb: &[Pred]) -> std::result::Result<Vec<(f64, f64)>, String> {
    paired_with(xa, xb, |x| x.em)
}

/// [`paired`] of any per-question value `f`.
pub(super) fn paired_with(xa: &[Pred], xb: &[Pred], f: impl Fn(&Pred) -> f64) -> std::result::Result<Vec<(f64, f64)>, String> {
    let ma: BTreeMap<&str, f64> = xa.iter().map(|x| (x.key.as_str(), f(x))).collect();
    let mb: BTreeMap<&str, f64> = xb.iter().map(|x| (x.key.as_str(), f(x))).collect();
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
    Ok(xa.iter().map(|x| (f(x), mb[x.key.as_str()])).collect())
}

pub(super) fn ci_json(ci: (f64, f64)) -> Value {
    let f = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
    json!([f(ci.0), f(ci.1)])
}

pub(super) fn num(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

pub(super) fn f3(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3}")
    } else {
        "–".into()
    }
}

pub(super) fn signed(x: f64) -> String {
    if x.is_finite() {
        format!("{x:+.3}")
    } else {
        "–".into()
    }
}

pub(super) fn fp(x: f64) -> String {
    if x < 1e-4 {
        format!("{x:.1e}")
    } else {
        format!("{x:.4}")
    }
}

pub(super) fn ci_md(ci: (f64, f64)) -> String {
    if ci.0.is_finite() {
        format!("[{:.3}, {:.3}]", ci.0, ci.1)
    } else {
        "–".into()
    }
}
