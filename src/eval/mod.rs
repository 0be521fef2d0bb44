//! Evaluation reports: accuracy (em, sub_em, f1) per task and context length, capture and
//! retention of the gold answer in the memories ([`capture`]), the memory curve summary, written
//! as Markdown tables, JSON and PNG plots.
pub mod capture;

use crate::agent::Trajectory;
use capture::{CaptureRow, BINS};
use crate::util::plot::{Chart, Series};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// One evaluated question: its task, length bucket, the (greedy) trajectory, whether its gold
/// answer was in each memory, and the chunk its answer was planted in (when the data says).
pub struct Evaluated<'a> {
    pub task: String,
    pub length: usize,
    pub traj: &'a Trajectory,
    pub capture: capture::Capture,
    pub planted_chunk: Option<usize>,
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
    /// Capture and retention of the gold answer (docs/DESIGN.md §1.9); absent in files written
    /// before it was recorded.
    #[serde(default)]
    pub capture: Option<CaptureRow>,
    /// Share of memory updates answered with the keep action (templates with `keep` only).
    #[serde(default)]
    pub keep_share: Option<f64>,
    /// Share of final answers cut by the answer budget (`answer_tokens` generated without an
    /// end): a reply that restates the question first can lose the answer's last characters.
    #[serde(default)]
    pub answer_cut: Option<f64>,
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
    let mut groups: BTreeMap<(String, usize), Vec<&Evaluated>> = BTreeMap::new();
    for it in items {
        groups.entry((it.task.clone(), it.length)).or_default().push(it);
    }
    let all: Vec<&Evaluated> = items.iter().collect();
    let mut rows: Vec<EvalRow> = groups.into_iter().map(|((task, length), its)| row(task, length, &its)).collect();
    if !all.is_empty() {
        rows.push(row(OVERALL.into(), 0, &all));
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

fn row(task: String, length: usize, its: &[&Evaluated]) -> EvalRow {
    let ts: Vec<&Trajectory> = its.iter().map(|it| it.traj).collect();
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
        capture: capture::row(&its.iter().map(|it| capture::Item { capture: &it.capture, em: it.traj.em, planted_chunk: it.planted_chunk }).collect::<Vec<_>>()),
        keep_share: {
            let (k, u) = ts.iter().fold((0, 0), |(k, u), t| (k + t.kept.iter().filter(|&&x| x).count(), u + t.kept.len()));
            if u == 0 { None } else { Some(k as f64 / u as f64) }
        },
        answer_cut: {
            let cut: Vec<bool> = ts.iter().filter_map(|t| t.answer_cut()).collect();
            if cut.is_empty() { None } else { Some(cut.iter().filter(|&&c| c).count() as f64 / cut.len() as f64) }
        },
    }
}

pub fn markdown_table(rows: &[EvalRow]) -> String {
    // the keep column only where the templates had a keep action
    let keeps = rows.iter().any(|r| r.keep_share.is_some());
    let mut s = String::from("| task | length (tokens) | n | em | sub_em | f1 | mean gain | lost after peak | answers cut by the budget |");
    s.push_str(if keeps { " updates kept |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n" } else { "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" });
    for r in rows {
        let keep = match (keeps, r.keep_share) {
            (false, _) => String::new(),
            (true, Some(k)) => format!(" {:.0}% |", 100.0 * k),
            (true, None) => " – |".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {} | {} |{keep}\n",
            if r.is_overall() { "**all**".to_string() } else { r.task.clone() },
            if r.is_overall() { "all".to_string() } else { r.length.to_string() },
            r.n,
            r.em,
            r.sub_em,
            r.f1,
            r.mean_gain.map(|g| format!("{g:+.3}")).unwrap_or_else(|| "–".into()),
            r.lost_after_peak.map(|g| format!("{:.0}%", 100.0 * g)).unwrap_or_else(|| "–".into()),
            r.answer_cut.map(|g| format!("{:.0}%", 100.0 * g)).unwrap_or_else(|| "–".into()),
        ));
    }
    s
}

/// What the capture table's columns mean (results.md; docs/DESIGN.md §1.9 says it at length).
pub const CAPTURE_LEGEND: &str = "A memory **holds** the gold answer when the gold, normalized as exact match normalizes it \
(lowercase, ASCII punctuation and the words a/an/the dropped, whitespace collapsed), appears as whole words of the \
normalized memory. Chunks count from 0; the memory of chunk i is the one written after reading it. \
**captured**: some memory held it; **in final**: the final memory (the one answered from) held it; \
**kept | captured**: in final, of those captured; **lost at chunk**: the first chunk after the first capture whose memory \
no longer held it (median [min–max] over the questions that lost it; the relative positions are in results.json); \
**regained**: held again later, of those lost; **em | in final** / **em | not in final**: accuracy of the questions whose \
final memory held / did not hold the answer (a low em | in final is the answer step failing with the answer in hand); \
**planted**: for data that records where its answer was planted (`data synth`), first held at the planted chunk / \
later / before it / never, of the questions located. Shares are k/n with Wilson 95 % intervals in results.json.\n";

/// The capture-and-retention table, one line per row that has memories.
pub fn capture_table(rows: &[EvalRow]) -> String {
    let mut s = String::from(
        "| task | length (tokens) | n | captured | in final | kept \\| captured | lost at chunk | regained | em \\| in final | em \\| not in final | planted: at / later / before / never |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let Some(c) = &r.capture else { continue };
        let lost = c.lost_at_chunk.as_ref().map(|l| format!("{} [{}–{}]", l.median, l.min, l.max)).unwrap_or_else(|| "–".into());
        let planted = c
            .planted
            .as_ref()
            .map(|p| format!("{} / {} / {} / {} of {}", p.at_planted.k, p.later, p.before, p.never, p.n))
            .unwrap_or_else(|| "not recorded".into());
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            if r.is_overall() { "**all**".to_string() } else { r.task.clone() },
            if r.is_overall() { "all".to_string() } else { r.length.to_string() },
            c.n,
            c.captured.md(),
            c.in_final.md(),
            c.kept.md(),
            lost,
            c.regained.md(),
            c.em_in_final.md(),
            c.em_not_in_final.md(),
            planted,
        ));
    }
    s
}

/// Write `results.json`, `results.md`, `accuracy.png` and `memory_curve.png` (capture and
/// retention, and the scored memory curve when there is one) into `dir`.
pub fn write_report(dir: &Path, rows: &[EvalRow], title: &str, extra: serde_json::Value) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    // "rows" ends with the overall row (task "all", length 0), also given as "overall"
    let overall = rows.iter().find(|r| r.is_overall());
    let json = serde_json::json!({ "title": title, "rows": rows, "overall": overall, "run": extra });
    crate::util::fs::write_atomic_str(&dir.join("results.json"), &serde_json::to_string_pretty(&json)?)?;
    let mut md = format!("# {title}\n\n{}", markdown_table(rows));
    if rows.iter().any(|r| r.capture.is_some()) {
        md.push_str(&format!("\n## Capture and retention of the gold answer\n\n{}\n{CAPTURE_LEGEND}", capture_table(rows)));
    }
    crate::util::fs::write_atomic_str(&dir.join("results.md"), &md)?;
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
    let mut panels = capture_charts(title, rows);
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
        panels.push(Chart {
            title: format!("{title}: memory curve"),
            x_label: "chunk t".into(),
            y_label: "L(M_t) - L(empty)".into(),
            series: curves,
            y_range: None,
            x_ticks_at_data: false,
        });
    }
    if !panels.is_empty() {
        Chart::save_stacked_png(&panels, &dir.join("memory_curve.png"), 900, 560)?;
    }
    Ok(())
}

/// The two capture panels of memory_curve.png: the shares per length (with the accuracy beside
/// them), and the share of questions whose memory holds the gold answer as the document is read.
fn capture_charts(title: &str, rows: &[EvalRow]) -> Vec<Chart> {
    let with: Vec<(&EvalRow, &CaptureRow)> = rows.iter().filter_map(|r| r.capture.as_ref().map(|c| (r, c))).collect();
    if with.is_empty() {
        return vec![];
    }
    let many_tasks = with.iter().any(|(r, _)| r.task != with[0].0.task);
    let name = |r: &EvalRow, what: &str| if many_tasks { format!("{} {what}", r.task) } else { what.to_string() };
    let mut tasks: Vec<&str> = with.iter().map(|(r, _)| r.task.as_str()).collect();
    tasks.dedup();
    let mut shares = Vec::new();
    for t in &tasks {
        let of: Vec<&(&EvalRow, &CaptureRow)> = with.iter().filter(|(r, _)| r.task == *t).collect();
        type Pick = fn(&EvalRow, &CaptureRow) -> Option<f64>;
        let metrics: [(&str, Pick); 5] = [
            ("captured", |_, c| c.captured.share),
            ("in final", |_, c| c.in_final.share),
            ("kept|captured", |_, c| c.kept.share),
            ("em", |r, _| Some(r.em)),
            ("em|in final", |_, c| c.em_in_final.share),
        ];
        for (what, f) in metrics {
            shares.push(Series {
                name: name(of[0].0, what),
                points: of.iter().filter_map(|(r, c)| f(r, c).map(|y| (r.length as f64, y))).collect(),
            });
        }
    }
    let held: Vec<Series> = with
        .iter()
        .map(|(r, c)| Series {
            name: if many_tasks { format!("{} {}", r.task, r.length) } else { format!("{} tokens", r.length) },
            points: c.held_by_position.iter().enumerate().map(|(j, &y)| ((j + 1) as f64 / BINS as f64, y)).collect(),
        })
        .collect();
    vec![
        Chart {
            title: format!("{title}: capture and retention of the gold answer"),
            x_label: "context length (tokens)".into(),
            y_label: "share of questions".into(),
            series: shares,
            y_range: Some((0.0, 1.0)),
            x_ticks_at_data: true,
        },
        Chart {
            title: "gold answer in the memory as the document is read".into(),
            x_label: "fraction of the document read".into(),
            y_label: "share of questions".into(),
            series: held,
            y_range: Some((0.0, 1.0)),
            x_ticks_at_data: false,
        },
    ]
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
        use crate::agent::{ConvKind, Turn};
        use crate::runtime::Finish;
        let mk = |em: f64, finish: Finish| {
            let mut t = Trajectory::start("q", 0, 0, "(empty)", &["1".to_string()], false);
            (t.em, t.sub_em, t.f1) = (em, em, em);
            let turn = |kind, finish| Turn { kind, conv: Default::default(), prefix_len: 0, gen_logprobs: vec![], finish, step_s: 0.0 };
            // an update that ran out of tokens is not an answer cut
            t.turns = vec![turn(ConvKind::Update, Finish::Length), turn(ConvKind::Final, finish)];
            t
        };
        let ts = [mk(1.0, Finish::Eos), mk(0.0, Finish::Length), mk(1.0, Finish::Eos), mk(1.0, Finish::Stop)];
        let items: Vec<Evaluated> = ts
            .iter()
            .zip([("a", 100), ("a", 100), ("a", 400), ("b", 100)])
            .map(|(t, (task, length))| Evaluated { task: task.into(), length, traj: t, capture: capture::capture(&t.memories, &[]), planted_chunk: None })
            .collect();
        let rows = summarize(&items);
        assert_eq!(rows.len(), 4);
        assert_eq!((rows[0].task.as_str(), rows[0].length, rows[0].n, rows[0].em), ("a", 100, 2, 0.5));
        let all = rows.last().unwrap();
        assert!(all.is_overall());
        assert_eq!((all.n, all.em), (4, 0.75));
        // one answer of the four ran out of its budget: a's 100-token row holds it
        assert_eq!((rows[0].answer_cut, all.answer_cut, rows[1].answer_cut), (Some(0.5), Some(0.25), Some(0.0)));
        let md = markdown_table(&rows);
        assert!(md.lines().last().unwrap().starts_with("| **all** | all | 4 | 0.750 |") && md.lines().last().unwrap().ends_with("| 25% |"), "{md}");
    }

    #[test]
    fn reports_carry_capture_and_retention() {
        let gold = vec!["48213".to_string()];
        let mk = |mems: &[&str], em: f64| {
            let mut t = Trajectory::start("q", 0, 0, "(empty)", &gold, false);
            t.memories = mems.iter().map(|m| m.to_string()).collect();
            t.em = em;
            t
        };
        // length 100: one kept to the end and right, one never captured; length 400: one lost
        let ts = [mk(&["x", "code 48213"], 1.0), mk(&["x", "y"], 0.0), mk(&["48213", "48213", "x", "y"], 0.0)];
        let items: Vec<Evaluated> = ts
            .iter()
            .zip([100, 100, 400])
            .zip([Some(1), Some(0), None])
            .map(|((t, length), planted_chunk)| Evaluated { task: "needle".into(), length, traj: t, capture: capture::capture(&t.memories, &gold), planted_chunk })
            .collect();
        let rows = summarize(&items);
        let c: Vec<&CaptureRow> = rows.iter().map(|r| r.capture.as_ref().unwrap()).collect();
        assert_eq!((c[0].captured.k, c[0].in_final.k, c[0].n), (1, 1, 2));
        assert_eq!((c[1].captured.k, c[1].in_final.k, c[1].lost.k), (1, 0, 1));
        assert_eq!(c[1].lost_at_chunk.as_ref().map(|l| l.median), Some(2));
        assert!(c[1].planted.is_none());
        assert_eq!((c[2].n, c[2].captured.k, c[2].kept.k, c[2].kept.n), (3, 2, 1, 2));
        let md = capture_table(&rows);
        assert!(md.contains("| needle | 100 | 2 | 0.50 (1/2) | 0.50 (1/2) | 1.00 (1/1) | – |"), "{md}");
        assert!(md.contains("| 1 / 0 / 0 / 1 of 2 |"), "{md}");
        assert!(md.contains("| needle | 400 | 1 |") && md.contains("| 2 [2–2] |") && md.contains("| not recorded |"), "{md}");
        let dir = tempfile::tempdir().unwrap();
        write_report(dir.path(), &rows, "t", serde_json::json!({})).unwrap();
        let md = std::fs::read_to_string(dir.path().join("results.md")).unwrap();
        assert!(md.contains("## Capture and retention") && md.contains(CAPTURE_LEGEND.trim()), "{md}");
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("results.json")).unwrap()).unwrap();
        assert_eq!(json["rows"][0]["capture"]["captured"]["k"], 1);
        // a results.json written before capture was recorded still reads, as "not recorded"
        let mut old = json["rows"][0].clone();
        old.as_object_mut().unwrap().remove("capture");
        let back: EvalRow = serde_json::from_value(old).unwrap();
        assert!(back.capture.is_none());
        // two capture panels, no scored curve: 900 × 2·560
        let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(dir.path().join("memory_curve.png")).unwrap()));
        let info = dec.read_info().unwrap();
        assert_eq!((info.info().width, info.info().height), (900, 1120));
    }
}
