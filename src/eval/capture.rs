//! Capture and retention (docs/DESIGN.md §1.9): whether a question's gold answer ever entered
//! the agent's memory, whether the final memory still held it, and at which chunk it was lost.
//! A memory agent fails in one of two places — the answer never entered a memory (capture), or
//! a later rewrite dropped it (retention) — and these say which, per question and per length.
use crate::reward::outcome::normalize;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Whether `memory` holds a gold answer: some gold, normalized as exact match normalizes
/// (`reward::outcome::normalize`), appears as a run of whole words of the normalized memory.
/// Whole words, so that the gold "7" is not found in "1978". A gold that normalizes to nothing
/// is never held.
pub fn holds(memory: &str, golds: &[String]) -> bool {
    let mem = format!(" {} ", normalize(memory));
    golds.iter().map(|g| normalize(g)).any(|g| !g.is_empty() && mem.contains(&format!(" {g} ")))
}

/// One question's capture and retention. Chunks count from 0: `held[i]` is whether the memory
/// written after reading chunk `i` holds the gold answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Capture {
    pub held: Vec<bool>,
    /// Held by some memory.
    pub captured: bool,
    /// Held by the final memory (the one the answer is read from).
    pub in_final: bool,
    pub first_captured_chunk: Option<usize>,
    /// The first chunk after the first capture whose memory no longer holds the answer.
    pub lost_at_chunk: Option<usize>,
    /// Held again by some memory after `lost_at_chunk`.
    pub regained: bool,
}

/// The capture record of one trajectory's memories `M_1 .. M_K` (one per chunk).
pub fn capture(memories: &[String], golds: &[String]) -> Capture {
    let held: Vec<bool> = memories.iter().map(|m| holds(m, golds)).collect();
    let first = held.iter().position(|&h| h);
    let lost = first.and_then(|f| held[f..].iter().position(|&h| !h).map(|i| f + i));
    let regained = lost.is_some_and(|l| held[l..].iter().any(|&h| h));
    Capture { captured: first.is_some(), in_final: held.last() == Some(&true), first_captured_chunk: first, lost_at_chunk: lost, regained, held }
}

/// Where chunk `i` of `k` lies in the document: the fraction read once it is, `(i + 1) / k`.
pub fn relative(i: usize, k: usize) -> f64 {
    (i + 1) as f64 / k.max(1) as f64
}

/// The text of the planted fact that carries the gold answer, from a synthetic record's
/// `meta.facts` (`data synth`): the fact with role `needle`, else the first fact that is not a
/// distractor and holds a gold answer. `None` when the record has no such fact (other data).
pub fn planted_text<'a>(meta: &'a Value, golds: &[String]) -> Option<&'a str> {
    let facts = meta.get("facts")?.as_array()?;
    let text = |f: &'a Value| f.get("text").and_then(Value::as_str);
    let role = |f: &Value| f.get("role").and_then(Value::as_str).map(str::to_owned);
    facts
        .iter()
        .find(|f| role(f).as_deref() == Some("needle"))
        .and_then(text)
        .or_else(|| facts.iter().filter(|f| role(f).as_deref() != Some("distractor")).filter_map(text).find(|t| holds(t, golds)))
}

/// A share `k / n` with its Wilson 95 % interval (Wilson 1927, z = 1.96): a binomial interval
/// that stays inside [0, 1] and is not empty at 0/n or n/n, where the bootstrap of one run's
/// questions would collapse to a point. `None`s when `n` is 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Share {
    pub k: usize,
    pub n: usize,
    pub share: Option<f64>,
    pub ci95: Option<[f64; 2]>,
}

impl Share {
    pub fn new(k: usize, n: usize) -> Share {
        assert!(k <= n, "share {k} of {n}");
        if n == 0 {
            return Share { k, n, share: None, ci95: None };
        }
        Share { k, n, share: Some(k as f64 / n as f64), ci95: Some(wilson(k, n)) }
    }

    /// `0.42 (21/50)`, or `–` of nothing.
    pub fn md(&self) -> String {
        match self.share {
            Some(s) => format!("{s:.2} ({}/{})", self.k, self.n),
            None => "–".into(),
        }
    }
}

/// Wilson score interval for `k` successes in `n > 0` trials at z = 1.96.
pub fn wilson(k: usize, n: usize) -> [f64; 2] {
    const Z: f64 = 1.959_963_984_540_054;
    let (n, p) = (n as f64, k as f64 / n as f64);
    let z2 = Z * Z;
    let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
    let half = Z / (1.0 + z2 / n) * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    [(centre - half).max(0.0), (centre + half).min(1.0)]
}

/// Bins of relative position over (0, 1]: bin `b` holds (b/BINS, (b+1)/BINS].
pub const BINS: usize = 10;

fn bin_of(rel: f64) -> usize {
    ((rel * BINS as f64).ceil() as usize).clamp(1, BINS) - 1
}

/// Minimum, median (lower), maximum and mean of chunk indices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub min: usize,
    pub median: usize,
    pub max: usize,
    pub mean: f64,
}

fn spread(mut v: Vec<usize>) -> Option<Spread> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    Some(Spread { min: v[0], median: v[(v.len() - 1) / 2], max: v[v.len() - 1], mean: v.iter().sum::<usize>() as f64 / v.len() as f64 })
}

/// Counts per relative-position bin (lower bound exclusive, upper inclusive).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bin {
    pub lo: f64,
    pub hi: f64,
    pub n: usize,
}

fn histogram(rels: impl Iterator<Item = f64>) -> Vec<Bin> {
    let mut n = [0usize; BINS];
    for r in rels {
        n[bin_of(r)] += 1;
    }
    (0..BINS).map(|b| Bin { lo: b as f64 / BINS as f64, hi: (b + 1) as f64 / BINS as f64, n: n[b] }).collect()
}

/// Where the gold answer was planted against where the memory first held it, over the
/// questions whose planted chunk is known.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Planted {
    /// Questions whose planted chunk is known (the rest: not recorded by their data).
    pub n: usize,
    /// First held by the memory written after reading the planted chunk itself.
    pub at_planted: Share,
    /// First held later than that (kept out at first, written in from a later mention or a guess).
    pub later: usize,
    /// First held before the planted chunk (a guess, or an earlier mention).
    pub before: usize,
    pub never: usize,
    /// Where the answer was planted (relative position), and how many of those were captured.
    pub planted_at: Vec<Bin>,
    pub captured_by_planted_bin: Vec<usize>,
}

/// What one question contributes to a row: its capture record, its em and its planted chunk.
pub struct Item<'a> {
    pub capture: &'a Capture,
    pub em: f64,
    pub planted_chunk: Option<usize>,
}

/// Capture and retention over the questions of one row (docs/DESIGN.md §1.9).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CaptureRow {
    /// Questions with at least one memory (the rest read no chunk and are left out).
    pub n: usize,
    pub captured: Share,
    pub in_final: Share,
    /// In the final memory, of those captured.
    pub kept: Share,
    /// Lost at some chunk, of those captured.
    pub lost: Share,
    /// Held again after being lost, of those lost.
    pub regained: Share,
    /// em of the questions whose final memory holds the answer, and of the others.
    pub em_in_final: Share,
    pub em_not_in_final: Share,
    pub first_captured_chunk: Option<Spread>,
    pub lost_at_chunk: Option<Spread>,
    /// `lost_at_chunk` by relative position `(lost_at + 1) / chunks`.
    pub lost_at_relative: Vec<Bin>,
    /// Share of the questions whose gold answer is in the memory after reading
    /// `(j + 1) / BINS` of the document, j = 0 .. BINS (the memory of chunk ⌈x·K⌉ − 1).
    pub held_by_position: Vec<f64>,
    pub planted: Option<Planted>,
}

pub fn row(items: &[Item]) -> Option<CaptureRow> {
    let items: Vec<&Item> = items.iter().filter(|it| !it.capture.held.is_empty()).collect();
    let n = items.len();
    if n == 0 {
        return None;
    }
    let count = |f: &dyn Fn(&Item) -> bool| items.iter().filter(|it| f(it)).count();
    let captured = count(&|it| it.capture.captured);
    let in_final = count(&|it| it.capture.in_final);
    let lost = count(&|it| it.capture.lost_at_chunk.is_some());
    let right = |it: &Item| it.em >= 0.5;
    let held_by_position = (1..=BINS)
        .map(|j| {
            let at = |k: usize| ((j * k).div_ceil(BINS)).max(1) - 1;
            count(&|it| it.capture.held[at(it.capture.held.len())]) as f64 / n as f64
        })
        .collect();
    let located: Vec<(&Item, usize)> = items.iter().filter_map(|it| it.planted_chunk.map(|p| (*it, p))).collect();
    let planted = (!located.is_empty()).then(|| {
        let first = |it: &Item| it.capture.first_captured_chunk;
        let planted_bins: Vec<usize> = located.iter().map(|(it, p)| bin_of(relative(*p, it.capture.held.len()))).collect();
        let mut captured_by_planted_bin = vec![0; BINS];
        for ((it, _), &b) in located.iter().zip(&planted_bins) {
            captured_by_planted_bin[b] += it.capture.captured as usize;
        }
        Planted {
            n: located.len(),
            at_planted: Share::new(located.iter().filter(|(it, p)| first(it) == Some(*p)).count(), located.len()),
            later: located.iter().filter(|(it, p)| first(it).is_some_and(|f| f > *p)).count(),
            before: located.iter().filter(|(it, p)| first(it).is_some_and(|f| f < *p)).count(),
            never: located.iter().filter(|(it, _)| first(it).is_none()).count(),
            planted_at: histogram(located.iter().map(|(it, p)| relative(*p, it.capture.held.len()))),
            captured_by_planted_bin,
        }
    });
    Some(CaptureRow {
        n,
        captured: Share::new(captured, n),
        in_final: Share::new(in_final, n),
        kept: Share::new(count(&|it| it.capture.captured && it.capture.in_final), captured),
        lost: Share::new(lost, captured),
        regained: Share::new(count(&|it| it.capture.regained), lost),
        em_in_final: Share::new(count(&|it| it.capture.in_final && right(it)), in_final),
        em_not_in_final: Share::new(count(&|it| !it.capture.in_final && right(it)), n - in_final),
        first_captured_chunk: spread(items.iter().filter_map(|it| it.capture.first_captured_chunk).collect()),
        lost_at_chunk: spread(items.iter().filter_map(|it| it.capture.lost_at_chunk).collect()),
        lost_at_relative: histogram(items.iter().filter_map(|it| it.capture.lost_at_chunk.map(|l| relative(l, it.capture.held.len())))),
        held_by_position,
        planted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }
    fn mems(xs: &[&str]) -> Vec<String> {
        g(xs)
    }

    #[test]
    fn holding_uses_the_exact_match_normalization_on_whole_words() {
        let gold = g(&["The Eiffel-Tower"]);
        // case, punctuation, articles and spacing as `normalize` treats them
        assert!(holds("Noted: the EIFFELTOWER, in Paris.", &gold));
        assert!(holds("a  eiffeltower", &gold));
        assert!(!holds("the Eiffel Tower", &gold)); // "eiffel tower" is not "eiffeltower"
        // whole words: 7 is not held by 1978 nor 7th, but by "7." and "(7)"
        let seven = g(&["7"]);
        assert!(!holds("born 1978", &seven));
        assert!(!holds("the 7th", &seven));
        assert!(holds("code is 7.", &seven));
        assert!(holds("(7)", &seven));
        // multi-word gold: contiguous words only
        assert!(holds("key: blue whale here", &g(&["Blue Whale"])));
        assert!(!holds("blue big whale", &g(&["Blue Whale"])));
        // any of several golds; a gold that normalizes to nothing is never held
        assert!(holds("la tour eiffel", &g(&["Eiffel Tower", "la tour Eiffel"])));
        assert!(!holds("anything at all", &g(&["the", "..."])));
        assert!(!holds("", &seven));
    }

    #[test]
    fn captured_lost_then_regained() {
        let c = capture(&mems(&["nothing", "pass 48213", "pass 48213 kept", "forgot", "still no", "48213 again"]), &g(&["48213"]));
        assert_eq!(c.held, vec![false, true, true, false, false, true]);
        assert!(c.captured && c.in_final && c.regained);
        assert_eq!((c.first_captured_chunk, c.lost_at_chunk), (Some(1), Some(3)));
    }

    #[test]
    fn never_captured_and_captured_at_the_last_chunk() {
        let never = capture(&mems(&["a", "b", "c"]), &g(&["48213"]));
        assert_eq!(never, Capture { held: vec![false; 3], captured: false, in_final: false, first_captured_chunk: None, lost_at_chunk: None, regained: false });
        let last = capture(&mems(&["a", "b", "48213"]), &g(&["48213"]));
        assert!(last.captured && last.in_final && !last.regained);
        assert_eq!((last.first_captured_chunk, last.lost_at_chunk), (Some(2), None));
        // lost for good at the last chunk
        let dropped = capture(&mems(&["48213", "48213", "x"]), &g(&["48213"]));
        assert!(dropped.captured && !dropped.in_final && !dropped.regained);
        assert_eq!((dropped.first_captured_chunk, dropped.lost_at_chunk), (Some(0), Some(2)));
        // no chunk read at all
        let none = capture(&[], &g(&["48213"]));
        assert!(!none.captured && !none.in_final && none.held.is_empty());
    }

    #[test]
    fn wilson_interval_hand_values() {
        // 0/10: upper bound z²/(n + z²) = 3.8415/13.8415 = 0.27753
        let [lo, hi] = wilson(0, 10);
        assert_eq!(lo, 0.0);
        assert!((hi - 0.277_532).abs() < 1e-5, "{hi}");
        // 5/10: 0.5 ± 1.96·sqrt(0.025 + 0.0096)/1.38415 → [0.23659, 0.76341]
        let [lo, hi] = wilson(5, 10);
        assert!((lo - 0.236_593).abs() < 1e-5 && (hi - 0.763_407).abs() < 1e-5, "{lo} {hi}");
        // symmetric: k/n and (n−k)/n mirror
        let (a, b) = (wilson(3, 17), wilson(14, 17));
        assert!((a[0] - (1.0 - b[1])).abs() < 1e-12 && (a[1] - (1.0 - b[0])).abs() < 1e-12);
        assert_eq!(Share::new(0, 0), Share { k: 0, n: 0, share: None, ci95: None });
    }

    #[test]
    fn row_counts_hand_made_trajectories() {
        let gold = g(&["48213"]);
        let caps = [
            capture(&mems(&["x", "48213", "y", "48213"]), &gold),   // captured at 1, lost at 2, regained, in final
            capture(&mems(&["x", "x", "x", "x"]), &gold),           // never
            capture(&mems(&["48213", "48213", "x", "x"]), &gold),   // captured at 0, lost at 2 (rel 0.75)
            capture(&mems(&["x", "48213"]), &gold),                 // captured at the last chunk
        ];
        let ems = [1.0, 0.0, 1.0, 0.0];
        let planted = [Some(1), Some(3), Some(1), None];
        let items: Vec<Item> = caps.iter().zip(ems).zip(planted).map(|((c, em), p)| Item { capture: c, em, planted_chunk: p }).collect();
        let r = row(&items).unwrap();
        assert_eq!(r.n, 4);
        assert_eq!((r.captured.k, r.captured.n), (3, 4));
        assert_eq!((r.in_final.k, r.in_final.n), (2, 4));
        assert_eq!((r.kept.k, r.kept.n), (2, 3));
        assert_eq!((r.lost.k, r.lost.n), (2, 3));
        assert_eq!((r.regained.k, r.regained.n), (1, 2));
        assert_eq!((r.em_in_final.k, r.em_in_final.n), (1, 2));
        assert_eq!((r.em_not_in_final.k, r.em_not_in_final.n), (1, 2));
        assert_eq!(r.first_captured_chunk, Some(Spread { min: 0, median: 1, max: 1, mean: 2.0 / 3.0 }));
        assert_eq!(r.lost_at_chunk, Some(Spread { min: 2, median: 2, max: 2, mean: 2.0 }));
        // both lost at chunk 2 of 4: relative 0.75, bin (0.7, 0.8]
        let hist: Vec<usize> = r.lost_at_relative.iter().map(|b| b.n).collect();
        assert_eq!(hist, vec![0, 0, 0, 0, 0, 0, 0, 2, 0, 0]);
        // after reading 1/10 of each document (chunk 0): only the third holds it; at the end:
        // the first and the fourth; halfway (chunk 1 of 4, chunk 0 of 2): the first and third
        assert_eq!(r.held_by_position[0], 0.25);
        assert_eq!(r.held_by_position[4], 0.5);
        assert_eq!(r.held_by_position[BINS - 1], r.in_final.share.unwrap());
        let p = r.planted.unwrap();
        assert_eq!(p.n, 3);
        // the first at its planted chunk, the third before it (chunk 0 < 1), the second never
        assert_eq!((p.at_planted.k, p.later, p.before, p.never), (1, 0, 1, 1));
        assert_eq!(p.planted_at.iter().map(|b| b.n).sum::<usize>(), 3);
        assert_eq!(p.planted_at[4].n, 2); // chunk 1 of 4 = 0.5
        assert_eq!((p.captured_by_planted_bin[4], p.captured_by_planted_bin[9]), (2, 0));
        assert!(row(&[]).is_none());
    }

    #[test]
    fn planted_fact_from_synthetic_meta() {
        let gold = g(&["48213"]);
        let meta = serde_json::json!({"facts": [
            {"role": "distractor", "text": "Bob's passcode is 48213."},
            {"role": "needle", "text": "Alice's passcode is 48213."}]});
        assert_eq!(planted_text(&meta, &gold), Some("Alice's passcode is 48213."));
        let hops = serde_json::json!({"facts": [
            {"role": "distractor", "text": "Carol's pet is 48213."},
            {"role": "hop", "hop": 1, "text": "Alice's friend is Dan."},
            {"role": "hop", "hop": 2, "text": "Dan's code is 48213."}]});
        assert_eq!(planted_text(&hops, &gold), Some("Dan's code is 48213."));
        assert_eq!(planted_text(&serde_json::json!({}), &gold), None);
        assert_eq!(planted_text(&serde_json::Value::Null, &gold), None);
    }
}
