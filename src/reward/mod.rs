//! Rewards: the outcome reward (answer extraction, normalization, em / sub_em / f1), the memory
//! gain of Eq. 6, and the InfoMem combination with its ablations — all behind `combine`.
pub mod combine;
pub mod outcome;

pub use combine::{combine, zscores, RewardMode, Signal};
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
pub struct GroupLine {
    pub outcomes: Vec<f64>,
    pub gains: Vec<f64>,
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
        let g: GroupLine = serde_json::from_str(line)
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
        out.push(g);
    }
    Ok(out)
}

/// Set `reward` on every trajectory of one group (the `n` rollouts of a query) under `mode`.
/// Errors when the mode's signal was not scored during the rollout.
pub fn assign(group: &mut [crate::agent::Trajectory], mode: RewardMode, beta: f64) -> anyhow::Result<()> {
    let outcomes: Vec<f64> = group.iter().map(|t| t.outcome).collect();
    let signal: Vec<f64> = match mode.signal() {
        Signal::None => vec![0.0; group.len()],
        Signal::AnswerGain => group
            .iter()
            .map(|t| t.gain.ok_or_else(|| anyhow::anyhow!("reward {}: the answer gain was not scored", mode.name())))
            .collect::<anyhow::Result<_>>()?,
        Signal::QueryGain => group
            .iter()
            .map(|t| t.query_gain.ok_or_else(|| anyhow::anyhow!("reward {}: the query gain was not scored", mode.name())))
            .collect::<anyhow::Result<_>>()?,
        Signal::LexicalGain => group.iter().map(|t| t.lexical_gain()).collect(),
    };
    if let Some(x) = signal.iter().find(|x| !x.is_finite()) {
        anyhow::bail!("reward {}: non-finite memory signal {x}", mode.name());
    }
    for (t, r) in group.iter_mut().zip(combine(mode, &outcomes, &signal, beta)) {
        t.reward = Some(r);
    }
    Ok(())
}
