//! Rewards: the outcome reward (answer extraction, normalization, em / sub_em / f1), the memory
//! gain of Eq. 6, and the InfoMem combination with its ablations — all behind `combine`.
//!
//! Pure functions over numbers and strings: this module imports nothing from the rest of the
//! crate. Callers hand in a group as [`RolloutSignals`] and set the rewards they get back.
pub mod combine;
pub mod outcome;

pub use combine::{assign, combine, zscores, RewardMode, RolloutSignals, Signal};
pub use outcome::{extract, extract_answer, normalize, Extract, Matcher};

/// Mean of per-token log-probabilities (the `L(M)` of Eq. 6).
pub fn mean_logprob(lps: &[f32]) -> f64 {
    if lps.is_empty() {
        return f64::NAN;
    }
    lps.iter().map(|&x| x as f64).sum::<f64>() / lps.len() as f64
}

/// One line of `reward --groups`: a group's outcomes and memory signals.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupLine {
    pub outcomes: Vec<f64>,
    pub gains: Vec<f64>,
    /// Its 1-based line in the file (for messages).
    #[serde(skip)]
    pub line: usize,
}

/// Parse and check a `reward --groups` JSONL text; errors name the 1-based line.
pub fn parse_groups(text: &str, file: &str) -> anyhow::Result<Vec<GroupLine>> {
    use anyhow::bail;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let ln = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut g: GroupLine = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("{file}:{ln}: expected {{\"outcomes\": [...], \"gains\": [...]}}: {e}"))?;
        if g.outcomes.len() != g.gains.len() {
            bail!("{file}:{ln}: {} outcomes but {} gains", g.outcomes.len(), g.gains.len());
        }
        if g.outcomes.is_empty() {
            bail!("{file}:{ln}: empty group");
        }
        if let Some(x) = g.outcomes.iter().find(|&&x| x != 0.0 && x != 1.0) {
            bail!("{file}:{ln}: outcome {x} is not 0 or 1");
        }
        if let Some(x) = g.gains.iter().find(|x| !x.is_finite()) {
            bail!("{file}:{ln}: gain {x} is not a finite number");
        }
        g.line = ln;
        out.push(g);
    }
    Ok(out)
}
