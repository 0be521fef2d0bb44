//! Evaluation reports: accuracy (em, sub_em, f1) per task and context length, the memory curve
//! summary, written as a Markdown table, JSON and a PNG plot.
use crate::agent::Trajectory;
use crate::util::plot::{Chart, Series};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// One evaluated question: its task, length bucket and the (greedy) trajectory.
pub struct Evaluated<'a> {
    pub task: String,
    pub length: usize,
    pub traj: &'a Trajectory,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EvalRow {
    pub task: String,
    pub length: usize,
    pub n: usize,
    pub em: f64,
    pub sub_em: f64,
    pub f1: f64,
    /// Mean answer gain `L(M_K) − L(∅)` (nats/token).
    pub mean_gain: Option<f64>,
    /// Mean memory curve `L(M_t) − L(∅)` over questions with at least t chunks.
    pub memory_curve: Option<Vec<f64>>,
    /// Fraction of questions whose curve peaked before the end and lost ≥ 0.5 nats/token by the
    /// end (the answer entered the memory, then a later update dropped it).
    pub lost_after_peak: Option<f64>,
}

pub fn summarize(items: &[Evaluated]) -> Vec<EvalRow> {
    let mut groups: BTreeMap<(String, usize), Vec<&Trajectory>> = BTreeMap::new();
    for it in items {
        groups.entry((it.task.clone(), it.length)).or_default().push(it.traj);
    }
    groups
        .into_iter()
        .map(|((task, length), ts)| {
            let n = ts.len();
            let mean = |f: &dyn Fn(&Trajectory) -> f64| ts.iter().map(|t| f(t)).sum::<f64>() / n as f64;
            let gains: Vec<f64> = ts.iter().filter_map(|t| t.gain).collect();
            let curves: Vec<&Vec<f64>> = ts.iter().filter_map(|t| t.memory_curve.as_ref()).filter(|c| !c.is_empty()).collect();
            let memory_curve = if curves.is_empty() {
                None
            } else {
                let k = curves.iter().map(|c| c.len()).max().unwrap();
                Some(
                    (0..k)
                        .map(|t| {
                            let v: Vec<f64> = curves.iter().filter_map(|c| c.get(t).copied()).collect();
                            v.iter().sum::<f64>() / v.len() as f64
                        })
                        .collect(),
                )
            };
            let lost_after_peak = if curves.is_empty() {
                None
            } else {
                let lost = curves
                    .iter()
                    .filter(|c| {
                        let peak = c.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        peak - c.last().unwrap() >= 0.5
                    })
                    .count();
                Some(lost as f64 / curves.len() as f64)
            };
            EvalRow {
                task,
                length,
                n,
                em: mean(&|t| t.em),
                sub_em: mean(&|t| t.sub_em),
                f1: mean(&|t| t.f1),
                mean_gain: if gains.is_empty() { None } else { Some(gains.iter().sum::<f64>() / gains.len() as f64) },
                memory_curve,
                lost_after_peak,
            }
        })
        .collect()
}

pub fn markdown_table(rows: &[EvalRow]) -> String {
    let mut s = String::from("| task | length (tokens) | n | em | sub_em | f1 | mean gain | lost after peak |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {} |\n",
            r.task,
            r.length,
            r.n,
            r.em,
            r.sub_em,
            r.f1,
            r.mean_gain.map(|g| format!("{g:+.3}")).unwrap_or_else(|| "–".into()),
            r.lost_after_peak.map(|g| format!("{:.0}%", 100.0 * g)).unwrap_or_else(|| "–".into()),
        ));
    }
    s
}

/// Write `results.json`, `results.md` and `accuracy.png` (and `memory_curve.png` when curves
/// were scored) into `dir`.
pub fn write_report(dir: &Path, rows: &[EvalRow], title: &str, extra: serde_json::Value) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let json = serde_json::json!({ "title": title, "rows": rows, "run": extra });
    crate::util::fs::write_atomic_str(&dir.join("results.json"), &serde_json::to_string_pretty(&json)?)?;
    crate::util::fs::write_atomic_str(&dir.join("results.md"), &format!("# {title}\n\n{}", markdown_table(rows)))?;
    let mut tasks: Vec<&str> = rows.iter().map(|r| r.task.as_str()).collect();
    tasks.dedup();
    let mut series = Vec::new();
    for t in &tasks {
        for (metric, f) in [("em", (|r: &EvalRow| r.em) as fn(&EvalRow) -> f64), ("sub_em", |r: &EvalRow| r.sub_em)] {
            series.push(Series {
                name: format!("{t} {metric}"),
                points: rows.iter().filter(|r| r.task == *t).map(|r| (r.length as f64, f(r))).collect(),
            });
        }
    }
    Chart {
        title: title.to_string(),
        x_label: "context length (tokens)".into(),
        y_label: "accuracy".into(),
        series,
        y_range: Some((0.0, 1.0)),
        x_ticks_at_data: true,
    }
    .save_png(&dir.join("accuracy.png"), 900, 560)?;
    let curves: Vec<Series> = rows
        .iter()
        .filter_map(|r| {
            r.memory_curve.as_ref().map(|c| Series {
                name: format!("{} {}", r.task, r.length),
                points: c.iter().enumerate().map(|(t, &v)| ((t + 1) as f64, v)).collect(),
            })
        })
        .collect();
    if !curves.is_empty() {
        Chart {
            title: format!("{title}: memory curve"),
            x_label: "chunk t".into(),
            y_label: "L(M_t) - L(empty)".into(),
            series: curves,
            y_range: None,
            x_ticks_at_data: false,
        }
        .save_png(&dir.join("memory_curve.png"), 900, 560)?;
    }
    Ok(())
}
