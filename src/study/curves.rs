//! Length curves in the study report: evaluation sets that share a `curve` name (the same task at
//! several document lengths, one set per length) form one curve per arm. The report gives each
//! arm's accuracy per length with the study's two-level bootstrap, and the share of its accuracy
//! at the shortest length that it keeps at the longest (`em(longest) / em(shortest)`), with a
//! bootstrap interval that resamples the seeds once for both lengths and the questions of each
//! length independently (they are different questions).
use super::answers::{ci_json, ci_md, f3, num, Pred};
use super::stats;
use crate::util::rng::Rng;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// One arm's (or the base's) runs on one curve: per length, each seed's answers.
pub(super) struct CurveRun<'a> {
    pub(super) name: &'a str,
    /// length (the sets' mean document length, tokens) → seed → answers
    pub(super) by_length: BTreeMap<u64, BTreeMap<u64, &'a [Pred]>>,
}

/// The mean document length of a set's answers, rounded: the curve's x.
pub(super) fn set_length(ps: &[Pred]) -> u64 {
    if ps.is_empty() {
        return 0;
    }
    (ps.iter().map(|p| p.length).sum::<f64>() / ps.len() as f64).round() as u64
}

fn ems(ps: &[Pred]) -> Vec<f64> {
    ps.iter().map(|p| p.em).collect()
}

/// `em(long) / em(short)` pooled over seeds, and its percentile 95 % interval: each resample
/// draws the seeds (present at both lengths) with replacement once, then within each drawn seed
/// the questions of each length with replacement; resamples whose short-length accuracy is 0
/// have no ratio and are left out (their count is returned). NaN when there is nothing to pair.
pub fn kept_ratio(short: &[Vec<f64>], long: &[Vec<f64>], resamples: usize, rng_seed: u64) -> (f64, (f64, f64), usize) {
    let seeds: Vec<(&Vec<f64>, &Vec<f64>)> = short.iter().zip(long).filter(|(s, l)| !s.is_empty() && !l.is_empty()).collect();
    let nan = (f64::NAN, (f64::NAN, f64::NAN), 0);
    if seeds.is_empty() || resamples == 0 {
        return nan;
    }
    // pooled means: every question of every seed counts once
    let mean = |vs: &mut dyn Iterator<Item = &Vec<f64>>| {
        let (sum, n) = vs.fold((0.0, 0usize), |(s, n), v| (s + v.iter().sum::<f64>(), n + v.len()));
        sum / n as f64
    };
    let (ms, ml) = (mean(&mut seeds.iter().map(|p| p.0)), mean(&mut seeds.iter().map(|p| p.1)));
    let point = if ms > 0.0 { ml / ms } else { f64::NAN };
    let mut rng = Rng::new(rng_seed);
    let mut out = Vec::with_capacity(resamples);
    let mut undefined = 0;
    for _ in 0..resamples {
        let (mut ss, mut ns, mut sl, mut nl) = (0.0, 0usize, 0.0, 0usize);
        for _ in 0..seeds.len() {
            let (s, l) = seeds[rng.below(seeds.len() as u64) as usize];
            for _ in 0..s.len() {
                ss += s[rng.below(s.len() as u64) as usize];
            }
            for _ in 0..l.len() {
                sl += l[rng.below(l.len() as u64) as usize];
            }
            ns += s.len();
            nl += l.len();
        }
        if ss > 0.0 {
            out.push((sl / nl as f64) / (ss / ns as f64));
        } else {
            undefined += 1;
        }
    }
    out.sort_by(|a, b| a.total_cmp(b));
    (point, (stats::quantile(&out, 0.025), stats::quantile(&out, 0.975)), undefined)
}

/// The Markdown section and the study.json rows of one curve.
pub(super) fn table(curve: &str, runs: &[CurveRun]) -> (String, Vec<Value>) {
    let lengths: Vec<u64> = {
        let mut v: Vec<u64> = runs.iter().flat_map(|r| r.by_length.keys().copied()).collect();
        v.sort();
        v.dedup();
        v
    };
    if lengths.is_empty() {
        return (String::new(), Vec::new());
    }
    let (lo, hi) = (lengths[0], *lengths.last().unwrap());
    let mut md = format!(
        "## Length curve `{curve}`\n\nem per document length (tokens; the sets' mean), questions × seeds pooled, 95 % two-level bootstrap; **kept** = em at {hi} / em at {lo}, its interval resampling the seeds once and each length's questions apart.\n\n| arm |"
    );
    for l in &lengths {
        md.push_str(&format!(" {l} |"));
    }
    md.push_str(" kept |\n|---|");
    md.push_str(&"---|".repeat(lengths.len() + 1));
    md.push('\n');
    let mut rows = Vec::new();
    for r in runs {
        md.push_str(&format!("| {} |", r.name));
        let mut points = Vec::new();
        for l in &lengths {
            match r.by_length.get(l) {
                Some(by_seed) => {
                    let v: Vec<Vec<f64>> = by_seed.values().map(|ps| ems(ps)).collect();
                    let (m, ci) = (stats::pooled_mean(&v), stats::bootstrap_ci(&v, stats::RESAMPLES, stats::BOOT_SEED));
                    md.push_str(&format!(" {} {} |", f3(m), ci_md(ci)));
                    points.push(json!({"length": l, "em": num(m), "ci95": ci_json(ci), "seeds": v.len(), "n": v.iter().map(|x| x.len()).sum::<usize>()}));
                }
                None => md.push_str(" – |"),
            }
        }
        let kept = match (r.by_length.get(&lo), r.by_length.get(&hi)) {
            (Some(s), Some(l)) if lo != hi => {
                let common: Vec<u64> = s.keys().filter(|k| l.contains_key(k)).copied().collect();
                let sv: Vec<Vec<f64>> = common.iter().map(|k| ems(s[k])).collect();
                let lv: Vec<Vec<f64>> = common.iter().map(|k| ems(l[k])).collect();
                let (k, ci, undefined) = kept_ratio(&sv, &lv, stats::RESAMPLES, stats::BOOT_SEED);
                md.push_str(&format!(" {} {} |\n", pct(k), ci_pct(ci)));
                json!({"from": lo, "to": hi, "kept": num(k), "ci95": ci_json(ci), "resamples_without_ratio": undefined, "seeds": common})
            }
            _ => {
                md.push_str(" – |\n");
                Value::Null
            }
        };
        rows.push(json!({"curve": curve, "arm": r.name, "points": points, "kept": kept}));
    }
    md.push('\n');
    (md, rows)
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.0} %", 100.0 * x)
    } else {
        "–".into()
    }
}

fn ci_pct(ci: (f64, f64)) -> String {
    if ci.0.is_finite() && ci.1.is_finite() {
        format!("[{:.0}, {:.0}] %", 100.0 * ci.0, 100.0 * ci.1)
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(ones: usize, n: usize) -> Vec<f64> {
        (0..n).map(|i| (i < ones) as u8 as f64).collect()
    }

    #[test]
    fn kept_ratio_point_and_interval() {
        // 80/100 at the short length, 40/100 at the long: half kept
        let (k, (lo, hi), undef) = kept_ratio(&[v(80, 100)], &[v(40, 100)], 4000, 7);
        assert!((k - 0.5).abs() < 1e-12);
        assert_eq!(undef, 0);
        // delta method: sd of the ratio ≈ 0.5·sqrt(0.6/40 + 0.2/80) ≈ 0.066
        assert!(lo < 0.5 && hi > 0.5 && (hi - lo) > 0.18 && (hi - lo) < 0.34, "[{lo}, {hi}]");
        // pooled over seeds: (40 + 60) / (80 + 80)
        let (k, _, _) = kept_ratio(&[v(80, 100), v(80, 100)], &[v(40, 100), v(60, 100)], 100, 7);
        assert!((k - 0.625).abs() < 1e-12);
        // nothing right at the short length: no ratio, every resample undefined
        let (k, ci, undef) = kept_ratio(&[v(0, 10)], &[v(5, 10)], 50, 7);
        assert!(k.is_nan() && ci.0.is_nan() && undef == 50);
    }

    #[test]
    fn table_lists_every_length_and_the_ratio() {
        let mk = |em: f64, n: usize, len: f64| (0..n).map(|i| Pred { key: format!("q{i}@{len}"), length: len, em, captured: None, in_final: None, answer_cut: None }).collect::<Vec<_>>();
        let (s, l) = (mk(1.0, 10, 512.0), mk(0.0, 10, 8192.0));
        assert_eq!((set_length(&s), set_length(&l)), (512, 8192));
        let mut by_length = BTreeMap::new();
        by_length.insert(512, BTreeMap::from([(0u64, &s[..])]));
        by_length.insert(8192, BTreeMap::from([(0u64, &l[..])]));
        let (md, rows) = table("essays", &[CurveRun { name: "infomem", by_length }]);
        assert!(md.contains("| 512 | 8192 | kept |") && md.contains("| infomem | 1.000 ") && md.contains(" 0 % [0, 0] % |"), "{md}");
        assert_eq!(rows[0]["kept"]["kept"], json!(0.0));
    }
}
