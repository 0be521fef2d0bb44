//! Capture and retention per arm in the study report (docs/DESIGN.md §1.9): per length, the
//! shares of questions whose gold answer entered a memory, was in the final memory, and was kept
//! of those captured, with the same bootstrap as the accuracy; and between arms, the same paired
//! tests on the same questions. Evaluations written before eval recorded capture say so.
use super::answers::{ci_json, ci_md, f3, fp, num, paired_with, signed, Pred};
use super::stats;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};

/// One run of the report: the base (one seed) or an arm's seeds, each seed's answers.
pub(super) struct Run<'a> {
    pub(super) name: &'a str,
    pub(super) seeds: Vec<&'a [Pred]>,
}

fn recorded(r: &Run) -> bool {
    r.seeds.iter().all(|ps| ps.iter().all(|x| x.captured.is_some() && x.in_final.is_some()))
}

fn one(b: Option<bool>) -> f64 {
    b.map_or(f64::NAN, |b| b as u8 as f64)
}

/// The shares and their two-level bootstrap intervals, one value per question of each seed.
fn share(seeds: &[Vec<f64>]) -> (f64, (f64, f64), usize) {
    let n = seeds.iter().map(|s| s.len()).sum();
    (stats::pooled_mean(seeds), stats::bootstrap_ci(seeds, stats::RESAMPLES, stats::BOOT_SEED), n)
}

/// The capture table of one evaluation set (Markdown) and its rows (study.json).
pub(super) fn table(eval: &str, runs: &[Run]) -> (String, Vec<Value>) {
    let mut md = String::from(
        "\nCapture and retention of the gold answer (docs/DESIGN.md §1.9; the eval's results.md legend): captured = some memory held it, in final = the final memory held it, kept = in final of those captured; em \\| in final = right of those whose final memory held it (low: the answer step fails with the answer in hand); answers cut = the answer ran out of its token budget (– where not recorded); n = questions × seeds; 95 % intervals as above.\n\n| arm | length | n | captured | in final | kept \\| captured | em \\| in final | answers cut |\n|---|---:|---:|---|---|---|---|---|\n",
    );
    let mut rows = Vec::new();
    for r in runs {
        if !recorded(r) {
            md.push_str(&format!("| {} | – | – | not recorded | not recorded | not recorded | not recorded | – |\n", r.name));
            rows.push(json!({"eval": eval, "arm": r.name, "recorded": false}));
            continue;
        }
        let lengths: BTreeSet<u64> = r.seeds.iter().flat_map(|ps| ps.iter().map(|x| x.length as u64)).collect();
        let mut per_len = Vec::new();
        for l in lengths {
            let at = |f: &dyn Fn(&Pred) -> Option<f64>| -> Vec<Vec<f64>> {
                r.seeds.iter().map(|ps| ps.iter().filter(|x| x.length as u64 == l).filter_map(f).collect()).collect()
            };
            let cap = share(&at(&|x| Some(one(x.captured))));
            let fin = share(&at(&|x| Some(one(x.in_final))));
            let kept = share(&at(&|x| (x.captured == Some(true)).then(|| one(x.in_final))));
            let em_fin = share(&at(&|x| (x.in_final == Some(true)).then_some(x.em)));
            let all_cut = r.seeds.iter().all(|ps| ps.iter().filter(|x| x.length as u64 == l).all(|x| x.answer_cut.is_some()));
            let cut = all_cut.then(|| share(&at(&|x| Some(one(x.answer_cut)))));
            let cell = |(m, ci, _): (f64, (f64, f64), usize)| if m.is_finite() { format!("{} {}", f3(m), ci_md(ci)) } else { "–".into() };
            md.push_str(&format!(
                "| {} | {l} | {} | {} | {} | {} (of {}) | {} (of {}) | {} |\n",
                r.name,
                cap.2,
                cell(cap),
                cell(fin),
                cell(kept),
                kept.2,
                cell(em_fin),
                em_fin.2,
                cut.map_or("–".into(), cell)
            ));
            let js = |(m, ci, n): (f64, (f64, f64), usize)| json!({"share": num(m), "ci95": ci_json(ci), "n": n});
            per_len.push(json!({"length": l, "n": cap.2, "captured": js(cap), "in_final": js(fin), "kept_given_captured": js(kept),
                "em_given_in_final": js(em_fin), "answer_cut": cut.map(js)}));
        }
        rows.push(json!({"eval": eval, "arm": r.name, "recorded": true, "seeds": r.seeds.len(), "lengths": per_len}));
    }
    (md, rows)
}

/// Paired tests of captured and in_final between two arms, on the seeds both have and only on
/// the same questions (as the accuracy's). `None` when neither arm recorded capture.
pub(super) fn paired_rows(eval: &str, a: &str, b: &str, pa: &BTreeMap<u64, Vec<Pred>>, pb: &BTreeMap<u64, Vec<Pred>>) -> (String, Vec<Value>) {
    let rec = |m: &BTreeMap<u64, Vec<Pred>>| m.values().all(|v| v.iter().all(|x| x.captured.is_some() && x.in_final.is_some()));
    if !rec(pa) || !rec(pb) {
        let md = format!("| {a} vs {b} | captured, in final | not recorded | – | – | – |\n");
        return (md, vec![json!({"eval": eval, "a": a, "b": b, "recorded": false})]);
    }
    let (mut md, mut out) = (String::new(), Vec::new());
    type Pick = fn(&Pred) -> f64;
    let metrics: [(&str, Pick); 2] = [("captured", |x| one(x.captured)), ("in_final", |x| one(x.in_final))];
    for (metric, f) in metrics {
        let (mut sb, mut sc) = (0u64, 0u64);
        let mut diffs: Vec<Vec<f64>> = Vec::new();
        for (seed, xa) in pa {
            let Some(xb) = pb.get(seed) else { continue };
            // unpaired seeds are named by the accuracy's table; they are left out here too
            let Ok(pairs) = paired_with(xa, xb, f) else { continue };
            let (bb, cc) = stats::discordant(&pairs);
            sb += bb;
            sc += cc;
            diffs.push(pairs.iter().map(|(x, y)| x - y).collect());
        }
        if diffs.is_empty() {
            md.push_str(&format!("| {a} vs {b} | {metric} | no paired seed | – | – | – |\n"));
            out.push(json!({"eval": eval, "a": a, "b": b, "metric": metric, "recorded": true, "pooled": Value::Null}));
            continue;
        }
        let p = stats::mcnemar_exact(sb, sc);
        let (d, ci) = (stats::pooled_mean(&diffs), stats::bootstrap_ci(&diffs, stats::RESAMPLES, stats::BOOT_SEED));
        md.push_str(&format!("| {a} vs {b} | {metric} | {sb}/{sc} | {} | {} | {} |\n", fp(p), signed(d), ci_md(ci)));
        out.push(json!({"eval": eval, "a": a, "b": b, "metric": metric, "recorded": true, "pooled": {"b": sb, "c": sc, "p": p, "seeds": diffs.len()},
            "mean_diff": num(d), "diff_ci95": ci_json(ci)}));
    }
    (md, out)
}

/// The header of the paired capture table.
pub(super) const PAIRED_HEADER: &str = "\nPaired capture tests (as the accuracy's: b = held by the first arm's memory and not the second's, c = the reverse, pooled over seeds; diff = share(first) − share(second)):\n\n| arms | metric | pooled b/c | pooled p | mean diff | 95 % CI |\n|---|---|---|---|---|---|\n";
