//! Outcome reward (Eq. 5): answer extraction, the usual QA normalization, and the matchers.
//!
//! Extraction: trim, keep the text before the first newline. Normalization: lowercase, drop ASCII
//! punctuation, drop the words a/an/the, collapse whitespace. `em` compares normalized strings
//! (max over golds, the training default); `sub_em` accepts either containing the other (an empty
//! prediction scores 0); `f1` is the SQuAD token-overlap F1 (reported, not used as a reward).
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Matcher {
    Em,
    SubEm,
    F1,
}

/// How the answer is cut out of the generated reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Extract {
    /// Trimmed, up to the first newline (docs/DESIGN.md §1.2).
    Line,
    /// The first run of digits in the first line (for tasks whose answers are numbers/codes: a
    /// sentence around the number is accepted, listing several candidates is not — only the
    /// first counts).
    FirstNumber,
}

/// The answer part of a generated reply: trimmed, up to the first newline.
pub fn extract_answer(raw: &str) -> String {
    raw.trim().split('\n').next().unwrap_or("").trim().to_string()
}

pub fn extract(e: Extract, raw: &str) -> String {
    let line = extract_answer(raw);
    match e {
        Extract::Line => line,
        Extract::FirstNumber => {
            let start = line.find(|c: char| c.is_ascii_digit());
            match start {
                Some(i) => line[i..].chars().take_while(|c| c.is_ascii_digit()).collect(),
                None => String::new(),
            }
        }
    }
}

pub fn normalize(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punct: String = lower.chars().filter(|c| !c.is_ascii_punctuation()).collect();
    no_punct
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn em(pred: &str, golds: &[String]) -> f64 {
    let p = normalize(pred);
    golds.iter().any(|g| normalize(g) == p) as u8 as f64
}

pub fn sub_em(pred: &str, golds: &[String]) -> f64 {
    let p = normalize(pred);
    if p.is_empty() {
        return 0.0;
    }
    golds
        .iter()
        .map(|g| normalize(g))
        .any(|g| !g.is_empty() && (p.contains(&g) || g.contains(&p))) as u8 as f64
}

pub fn f1(pred: &str, golds: &[String]) -> f64 {
    let p = normalize(pred);
    let pt: Vec<&str> = p.split_whitespace().collect();
    golds
        .iter()
        .map(|g| {
            let g = normalize(g);
            let gt: Vec<&str> = g.split_whitespace().collect();
            if pt.is_empty() || gt.is_empty() {
                return (pt.is_empty() && gt.is_empty()) as u8 as f64;
            }
            // multiset intersection
            let mut counts = std::collections::HashMap::new();
            for t in &gt {
                *counts.entry(*t).or_insert(0i32) += 1;
            }
            let mut common = 0;
            for t in &pt {
                if let Some(c) = counts.get_mut(t) {
                    if *c > 0 {
                        *c -= 1;
                        common += 1;
                    }
                }
            }
            if common == 0 {
                return 0.0;
            }
            let prec = common as f64 / pt.len() as f64;
            let rec = common as f64 / gt.len() as f64;
            2.0 * prec * rec / (prec + rec)
        })
        .fold(0.0, f64::max)
}

pub fn score(m: Matcher, pred: &str, golds: &[String]) -> f64 {
    match m {
        Matcher::Em => em(pred, golds),
        Matcher::SubEm => sub_em(pred, golds),
        Matcher::F1 => f1(pred, golds),
    }
}

/// Fraction of the gold answer's normalized words present in `memory` (max over golds): the
/// word-recall signal of the `lexical` (ReMemR1-style) baseline.
pub fn word_recall(memory: &str, golds: &[String]) -> f64 {
    let mem = normalize(memory);
    let words: std::collections::HashSet<&str> = mem.split_whitespace().collect();
    golds
        .iter()
        .map(|g| {
            let g = normalize(g);
            let gt: Vec<&str> = g.split_whitespace().collect();
            if gt.is_empty() {
                return 0.0;
            }
            gt.iter().filter(|w| words.contains(*w)).count() as f64 / gt.len() as f64
        })
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    fn g(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn extraction_and_normalization() {
        assert_eq!(extract_answer("  The Eiffel Tower.\nIt is in Paris."), "The Eiffel Tower.");
        assert_eq!(extract(Extract::FirstNumber, "The passcode of Bob is 99120. Alice: 48213"), "99120");
        assert_eq!(extract(Extract::FirstNumber, "none here\n12345"), "");
        assert_eq!(normalize("The  Eiffel-Tower, a TOWER!"), "eiffeltower tower");
        assert_eq!(normalize("an apple and the pear"), "apple and pear");
    }

    #[test]
    fn matchers() {
        let golds = g(&["Eiffel Tower", "la tour Eiffel"]);
        assert_eq!(em("the eiffel tower.", &golds), 1.0);
        assert_eq!(em("Eiffel", &golds), 0.0);
        assert_eq!(sub_em("Eiffel", &golds), 1.0); // gold contains prediction
        assert_eq!(sub_em("It is the Eiffel Tower in Paris", &golds), 1.0);
        assert_eq!(sub_em("", &golds), 0.0); // empty prediction guard
        assert_eq!(sub_em("   .  ", &golds), 0.0); // empty after normalization
        assert!((f1("Eiffel", &golds) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(f1("Louvre", &golds), 0.0);
        assert_eq!(word_recall("memory: the tower named Eiffel", &g(&["Eiffel Tower"])), 1.0);
        assert_eq!(word_recall("memory: Eiffel", &g(&["Eiffel Tower"])), 0.5);
    }
}
