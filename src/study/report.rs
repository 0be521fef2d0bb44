//! The report, rebuilt from the finished work every time: per arm and evaluation set, accuracy
//! with bootstrap intervals, paired differences against the base (exact McNemar tests on the same
//! questions only), capture and retention per arm (`retention`), study.json, study.md and the
//! two PNGs.
use super::answers::{ci_json, ci_md, f3, fp, num, paired, read_preds, signed, Pred};
use super::retention::{self, Run};
use super::stats;
use super::config::{EvalSet, StudyConfig, p};
use super::curves;
use super::plan::{Cell, cells};
use super::identity::finished;
use crate::util::plot::{Chart, Series};
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Training success rate per step of a cell (`metrics.jsonl`), non-finite values left out.
pub(super) fn read_steps(train_dir: &Path) -> Vec<(f64, f64)> {
    let Ok(text) = std::fs::read_to_string(train_dir.join("metrics.jsonl")) else { return vec![] };
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|m| Some((m["step"].as_f64()?, m["success_rate"].as_f64()?)))
        .filter(|(_, y)| y.is_finite())
        .collect()
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
            if !c.evaluated(&e.name) {
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
    let (mut capture, mut capture_pairwise) = (Vec::new(), Vec::new());
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
        // capture and retention: the same runs, the same pairs
        let mut runs: Vec<Run> = base.get(&e.name).map(|b| Run { name: "base", seeds: vec![&b[..]] }).into_iter().collect();
        for a in &cfg.arms {
            if let Some(by_seed) = preds.get(&(a.name.clone(), e.name.clone())) {
                runs.push(Run { name: &a.name, seeds: by_seed.values().map(|v| &v[..]).collect() });
            }
        }
        let (cap_md, cap_rows) = retention::table(&e.name, &runs);
        let mut cap_pairs = String::new();
        for (i, a) in cfg.arms.iter().enumerate() {
            for b in &cfg.arms[i + 1..] {
                let (Some(pa), Some(pb)) = (preds.get(&(a.name.clone(), e.name.clone())), preds.get(&(b.name.clone(), e.name.clone()))) else { continue };
                let (m, j) = retention::paired_rows(&e.name, &a.name, &b.name, pa, pb);
                cap_pairs.push_str(&m);
                capture_pairwise.extend(j);
            }
        }
        if !rows.is_empty() {
            md.push_str("\nPaired tests (b = first arm right and second wrong, c = the reverse; exact McNemar, two-sided; pooled = discordant pairs summed over seeds; diff = em(first) − em(second)):\n\n| arms | per seed b/c, p | pooled b/c | pooled p | mean diff | 95 % CI |\n|---|---|---|---|---|---|\n");
            md.push_str(&rows);
        }
        if !runs.is_empty() {
            md.push_str(&cap_md);
            capture.extend(cap_rows);
        }
        if !cap_pairs.is_empty() {
            md.push_str(retention::PAIRED_HEADER);
            md.push_str(&cap_pairs);
        }
        md.push('\n');
    }
    // length curves: the sets sharing a `curve` name, one curve per arm and the base
    let mut curve_rows = Vec::new();
    for (curve, sets) in curve_sets(cfg) {
        let mut runs = Vec::new();
        let base_run = curves::CurveRun {
            name: "base",
            by_length: sets.iter().filter_map(|e| base.get(&e.name).map(|b| (curves::set_length(b), BTreeMap::from([(0u64, &b[..])])))).collect(),
        };
        if !base_run.by_length.is_empty() {
            runs.push(base_run);
        }
        for a in &cfg.arms {
            let by_length: BTreeMap<u64, BTreeMap<u64, &[Pred]>> = sets
                .iter()
                .filter_map(|e| preds.get(&(a.name.clone(), e.name.clone())))
                .filter_map(|by_seed| {
                    let first = by_seed.values().next()?;
                    Some((curves::set_length(first), by_seed.iter().map(|(s, v)| (*s, &v[..])).collect()))
                })
                .collect();
            if !by_length.is_empty() {
                runs.push(curves::CurveRun { name: &a.name, by_length });
            }
        }
        let (m, rows) = curves::table(curve, &runs);
        md.push_str(&m);
        curve_rows.extend(rows);
    }
    md.push_str("Plots: `accuracy_vs_step.png` (training success rate, mean over seeds), `accuracy_vs_length.png` (held-out em per length).\n");

    plot_steps(cfg, &all)?;
    plot_lengths(cfg, &preds, &base)?;
    let out = json!({"model": p(&cfg.model), "seeds": cfg.seeds, "arms": cfg.arms.iter().map(|a| a.name.clone()).collect::<Vec<_>>(),
        "evals": cfg.evals.iter().map(|e| json!({"name": e.name, "data": p(&e.data)})).collect::<Vec<_>>(),
        "bootstrap": {"resamples": stats::RESAMPLES, "seed": stats::BOOT_SEED, "interval": "percentile 2.5/97.5, resample seeds then questions"},
        "cells": cell_rows, "summary": summary, "length_curves": curve_rows, "pairwise": pairwise, "capture": capture, "capture_pairwise": capture_pairwise,
        "evals_with_different_questions": unequal});
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("cannot create {}", cfg.out.display()))?;
    crate::util::fs::write_atomic_str(&cfg.out.join("study.json"), &serde_json::to_string_pretty(&out)?)?;
    crate::util::fs::write_atomic_str(&cfg.out.join("study.md"), &md)?;
    Ok(out)
}

/// The mean of the `y`s at each `x` of (x, y) points, in order of `x`: a plot series.
pub(super) fn means_by_x(points: impl Iterator<Item = (u64, f64)>) -> Vec<(f64, f64)> {
    let mut m: BTreeMap<u64, (f64, usize)> = BTreeMap::new();
    for (x, y) in points {
        let e = m.entry(x).or_default();
        e.0 += y;
        e.1 += 1;
    }
    m.iter().map(|(&x, &(s, n))| (x as f64, s / n as f64)).collect()
}

/// accuracy_vs_step.png: per arm, the training success rate at each step averaged over the
/// seeds that reached it (cells whose training finished, whether or not their adapter is kept).
pub(super) fn plot_steps(cfg: &StudyConfig, all: &[Cell]) -> Result<()> {
    let mut series = Vec::new();
    for a in &cfg.arms {
        let cells = all.iter().filter(|c| c.arm == a.name && c.seed.is_some() && (c.trained() || c.results_without_adapter()));
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

/// The evaluation sets of each length curve, by curve name, in the study file's order.
fn curve_sets(cfg: &StudyConfig) -> BTreeMap<&str, Vec<&EvalSet>> {
    let mut m: BTreeMap<&str, Vec<&EvalSet>> = BTreeMap::new();
    for e in &cfg.evals {
        if let Some(c) = &e.curve {
            m.entry(c.as_str()).or_default().push(e);
        }
    }
    m
}

/// accuracy_vs_length.png: held-out em per length, per arm (pooled over seeds) and the base
/// model; one series per arm and length curve (the sets sharing a `curve` name), then one per
/// arm and evaluation set outside a curve.
pub(super) fn plot_lengths(cfg: &StudyConfig, preds: &BTreeMap<(String, String), BTreeMap<u64, Vec<Pred>>>, base: &BTreeMap<String, Vec<Pred>>) -> Result<()> {
    let by_len = |ps: &mut dyn Iterator<Item = &Pred>| means_by_x(ps.map(|x| (x.length as u64, x.em)));
    let many = cfg.evals.len() > 1;
    let label = |arm: &str, e: &str| if many { format!("{arm} ({e})") } else { arm.to_string() };
    let mut series = Vec::new();
    for (curve, sets) in curve_sets(cfg) {
        let b: Vec<&Pred> = sets.iter().filter_map(|e| base.get(&e.name)).flatten().collect();
        if !b.is_empty() {
            series.push(Series { name: format!("base ({curve})"), points: by_len(&mut b.into_iter()) });
        }
        for a in &cfg.arms {
            let ps: Vec<&Pred> = sets.iter().filter_map(|e| preds.get(&(a.name.clone(), e.name.clone()))).flat_map(|s| s.values().flatten()).collect();
            if !ps.is_empty() {
                series.push(Series { name: format!("{} ({curve})", a.name), points: by_len(&mut ps.into_iter()) });
            }
        }
    }
    for e in cfg.evals.iter().filter(|e| e.curve.is_none()) {
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
