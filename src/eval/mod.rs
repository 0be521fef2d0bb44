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

/// Length buckets for documents of measured (unpadded) lengths: sorted, a bucket grows while a
/// length is within 25 % of the bucket's shortest, and is named by its (lower) median length. Returns
/// each input's bucket label. Documents made to a few target lengths (±10 %, say) fall into one
/// bucket per target instead of one row per exact token count.
pub fn bucket_lengths(lens: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| lens[i]);
    let mut label = vec![0; lens.len()];
    let mut start = 0;
    while start < order.len() {
        let lo = lens[order[start]];
        let mut end = start + 1;
        while end < order.len() && lens[order[end]] as f64 <= 1.25 * lo as f64 {
            end += 1;
        }
        let median = lens[order[start + (end - start - 1) / 2]];
        for &i in &order[start..end] {
            label[i] = median;
        }
        start = end;
    }
    label
}

/// Per (task, length) rows, then one overall row (task "all", length 0: every question).
pub fn summarize(items: &[Evaluated]) -> Vec<EvalRow> {
    let mut groups: BTreeMap<(String, usize), Vec<&Trajectory>> = BTreeMap::new();
    for it in items {
        groups.entry((it.task.clone(), it.length)).or_default().push(it.traj);
    }
    let all: Vec<&Trajectory> = items.iter().map(|it| it.traj).collect();
    let mut rows: Vec<EvalRow> = groups.into_iter().map(|((task, length), ts)| row(task, length, ts)).collect();
    if !all.is_empty() {
        rows.push(row(OVERALL.into(), 0, all));
    }
    rows
}

/// The task name of the overall row.
pub const OVERALL: &str = "all";

impl EvalRow {
    pub fn is_overall(&self) -> bool {
        self.task == OVERALL && self.length == 0
    }
}

fn row(task: String, length: usize, ts: Vec<&Trajectory>) -> EvalRow {
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
}

pub fn markdown_table(rows: &[EvalRow]) -> String {
    let mut s = String::from("| task | length (tokens) | n | em | sub_em | f1 | mean gain | lost after peak |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {} |\n",
            if r.is_overall() { "**all**".to_string() } else { r.task.clone() },
            if r.is_overall() { "all".to_string() } else { r.length.to_string() },
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
    // "rows" ends with the overall row (task "all", length 0), also given as "overall"
    let overall = rows.iter().find(|r| r.is_overall());
    let json = serde_json::json!({ "title": title, "rows": rows, "overall": overall, "run": extra });
    crate::util::fs::write_atomic_str(&dir.join("results.json"), &serde_json::to_string_pretty(&json)?)?;
    crate::util::fs::write_atomic_str(&dir.join("results.md"), &format!("# {title}\n\n{}", markdown_table(rows)))?;
    // the plots show the per-length rows
    let rows: Vec<EvalRow> = rows.iter().filter(|r| !r.is_overall()).cloned().collect();
    let rows = &rows[..];
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_group_near_lengths_and_name_them_by_the_median() {
        // three sets around 190, 530 and 1040 tokens, shuffled
        let lens = [187, 531, 1038, 193, 190, 526, 1046, 185, 540, 1040, 199];
        let b = bucket_lengths(&lens);
        assert_eq!(b, vec![190, 531, 1040, 190, 190, 531, 1040, 190, 531, 1040, 190]);
        // a chain of lengths each within 25 % of the previous one still splits, at 1.25x the
        // bucket's shortest
        assert_eq!(bucket_lengths(&[100, 120, 125, 126, 150]), vec![120, 120, 120, 126, 126]);
        assert_eq!(bucket_lengths(&[]), Vec::<usize>::new());
        assert_eq!(bucket_lengths(&[7]), vec![7]);
    }

    #[test]
    fn summary_ends_with_an_overall_row() {
        let mk = |em: f64| {
            let mut t = Trajectory::start("q", 0, 0, "(empty)", &["1".to_string()], false);
            (t.em, t.sub_em, t.f1) = (em, em, em);
            t
        };
        let ts = [mk(1.0), mk(0.0), mk(1.0), mk(1.0)];
        let items: Vec<Evaluated> = ts
            .iter()
            .zip([("a", 100), ("a", 100), ("a", 400), ("b", 100)])
            .map(|(t, (task, length))| Evaluated { task: task.into(), length, traj: t })
            .collect();
        let rows = summarize(&items);
        assert_eq!(rows.len(), 4);
        assert_eq!((rows[0].task.as_str(), rows[0].length, rows[0].n, rows[0].em), ("a", 100, 2, 0.5));
        let all = rows.last().unwrap();
        assert!(all.is_overall());
        assert_eq!((all.n, all.em), (4, 0.75));
        let md = markdown_table(&rows);
        assert!(md.lines().last().unwrap().starts_with("| **all** | all | 4 | 0.750 |"), "{md}");
    }
}
