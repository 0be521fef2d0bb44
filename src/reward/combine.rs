//! Turning a group's outcomes and memory signals into final rewards — every reward mode behind
//! one function, so ablations are one flag apart (docs/DESIGN.md §1.4 and §1.5; Algorithm 1 of the paper).
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum RewardMode {
    /// Plain GRPO: `R_i = R_outcome,i`.
    Outcome,
    /// InfoMem: answer-conditioned gain, z-normalized over the successes only, added to them.
    Infomem,
    /// Gain on every rollout, z-normalized over the whole group, added to every rollout.
    InfomemAll,
    /// Success-only, raw gain added (normalized only afterwards, by GRPO's group advantage).
    InfomemRaw,
    /// InfoMem with the question as the teacher-forced target instead of the gold answer.
    InfomemQuery,
    /// ReMemR1-style baseline: per memory turn, the gain in gold-word recall of the memory.
    Lexical,
}

impl RewardMode {
    /// Which memory signal the mode consumes.
    pub fn signal(self) -> Signal {
        match self {
            RewardMode::Outcome => Signal::None,
            RewardMode::Infomem | RewardMode::InfomemAll | RewardMode::InfomemRaw => Signal::AnswerGain,
            RewardMode::InfomemQuery => Signal::QueryGain,
            RewardMode::Lexical => Signal::LexicalGain,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            RewardMode::Outcome => "outcome",
            RewardMode::Infomem => "infomem",
            RewardMode::InfomemAll => "infomem-all",
            RewardMode::InfomemRaw => "infomem-raw",
            RewardMode::InfomemQuery => "infomem-query",
            RewardMode::Lexical => "lexical",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    None,
    /// `mean log p(y* | M_K) − mean log p(y* | ∅)` (Eq. 6)
    AnswerGain,
    /// `mean log p(x | M_K) − mean log p(x | ∅)`
    QueryGain,
    /// `Σ_t [recall(M_t) − recall(M_{t−1})]` of the gold answer's words
    LexicalGain,
}

/// Below this the successes' gains count as all equal: every z is 0.
pub const SIGMA_EPS: f64 = 1e-8;

/// z-scores of `xs` with the population standard deviation; all 0 when σ < 1e-8.
///
/// Computed on `xs / 2^e`, `2^e` the power of two at or below max|x| (z-scores do not change
/// with the scale): finite inputs near ±f64::MAX give finite z-scores instead of overflowing the
/// sum or the squares, and since dividing by a power of two is exact, every other input gets
/// the same bits as without it. σ is compared with [`SIGMA_EPS`] in the inputs' own units.
pub fn zscores(xs: &[f64]) -> Vec<f64> {
    let max = xs.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    if xs.is_empty() || max == 0.0 || !max.is_finite() {
        return vec![0.0; xs.len()];
    }
    // the exponent bits of `max` alone; subnormals (exponent 0) are scaled by 1
    let pow2 = f64::from_bits(max.to_bits() & 0x7ff0_0000_0000_0000);
    let scale = if pow2 == 0.0 { 1.0 } else { pow2 };
    let ys: Vec<f64> = xs.iter().map(|x| x / scale).collect();
    let n = ys.len() as f64;
    let mu = ys.iter().sum::<f64>() / n;
    let sigma = (ys.iter().map(|y| (y - mu).powi(2)).sum::<f64>() / n).sqrt();
    if sigma * scale < SIGMA_EPS {
        return vec![0.0; xs.len()];
    }
    ys.iter().map(|y| (y - mu) / sigma).collect()
}

/// Final rewards of one group. `outcomes` are 0/1; `signal[i]` is the mode's memory signal of
/// rollout i (ignored by `outcome`).
pub fn combine(mode: RewardMode, outcomes: &[f64], signal: &[f64], beta: f64) -> Vec<f64> {
    assert_eq!(outcomes.len(), signal.len(), "one signal per rollout");
    match mode {
        RewardMode::Outcome => outcomes.to_vec(),
        RewardMode::Infomem | RewardMode::InfomemQuery => {
            // Algorithm 1: S = successes; |S| = 0 → outcome; |S| = 1 → 1 + β·r (raw);
            // |S| ≥ 2 → 1 + β·z over S. Failures keep R_outcome.
            let succ: Vec<usize> = (0..outcomes.len()).filter(|&i| outcomes[i] == 1.0).collect();
            let mut r = outcomes.to_vec();
            match succ.len() {
                0 => {}
                1 => r[succ[0]] = 1.0 + beta * signal[succ[0]],
                _ => {
                    let z = zscores(&succ.iter().map(|&i| signal[i]).collect::<Vec<_>>());
                    for (&i, z) in succ.iter().zip(z) {
                        r[i] = 1.0 + beta * z;
                    }
                }
            }
            r
        }
        RewardMode::InfomemAll => {
            let z = zscores(signal);
            outcomes.iter().zip(z).map(|(o, z)| o + beta * z).collect()
        }
        RewardMode::InfomemRaw => outcomes
            .iter()
            .zip(signal)
            .map(|(&o, &g)| if o == 1.0 { 1.0 + beta * g } else { o })
            .collect(),
        RewardMode::Lexical => outcomes.iter().zip(signal).map(|(o, g)| o + beta * g).collect(),
    }
}

/// One rollout as the reward sees it: its 0/1 outcome and the memory signals scored for it
/// (`None`: not scored during the rollout).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RolloutSignals {
    pub outcome: f64,
    /// `L(M_K) − L(∅)` of the gold answer (Eq. 6).
    pub answer_gain: Option<f64>,
    /// `L(M_K) − L(∅)` of the question.
    pub query_gain: Option<f64>,
    /// `Σ_t [recall(M_t) − recall(M_{t−1})]`.
    pub lexical_gain: f64,
}

/// Final rewards of one group (the `n` rollouts of a query) under `mode`, in group order.
/// Errors when the mode's signal was not scored during the rollout, or is not finite.
pub fn assign(group: &[RolloutSignals], mode: RewardMode, beta: f64) -> anyhow::Result<Vec<f64>> {
    let outcomes: Vec<f64> = group.iter().map(|r| r.outcome).collect();
    let scored = |x: Option<f64>, what: &str| x.ok_or_else(|| anyhow::anyhow!("reward {}: the {what} was not scored", mode.name()));
    let signal: Vec<f64> = match mode.signal() {
        Signal::None => vec![0.0; group.len()],
        Signal::AnswerGain => group.iter().map(|r| scored(r.answer_gain, "answer gain")).collect::<anyhow::Result<_>>()?,
        Signal::QueryGain => group.iter().map(|r| scored(r.query_gain, "query gain")).collect::<anyhow::Result<_>>()?,
        Signal::LexicalGain => group.iter().map(|r| r.lexical_gain).collect(),
    };
    if let Some(x) = signal.iter().find(|x| !x.is_finite()) {
        anyhow::bail!("reward {}: non-finite memory signal {x}", mode.name());
    }
    Ok(combine(mode, &outcomes, &signal, beta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_on_a_small_group() {
        let o = [1.0, 0.0, 1.0, 1.0];
        let g = [0.5, 9.0, 1.5, 1.0];
        assert_eq!(combine(RewardMode::Outcome, &o, &g, 0.5), o.to_vec());
        // successes' gains 0.5, 1.5, 1.0 → z = -1.2247, 1.2247, 0
        let r = combine(RewardMode::Infomem, &o, &g, 0.5);
        let z = 1.5f64.sqrt();
        assert!((r[0] - (1.0 - 0.5 * z)).abs() < 1e-12 && r[1] == 0.0 && (r[2] - (1.0 + 0.5 * z)).abs() < 1e-12 && r[3] == 1.0);
        let raw = combine(RewardMode::InfomemRaw, &o, &g, 0.5);
        assert_eq!(raw, vec![1.25, 0.0, 1.75, 1.5]);
        let all = combine(RewardMode::InfomemAll, &o, &g, 0.5);
        assert!(all[1] > 0.5, "the failure with the largest gain gets a bonus in infomem-all");
        // one success: raw gain
        assert_eq!(combine(RewardMode::Infomem, &[0.0, 1.0], &[3.0, -0.4], 0.5), vec![0.0, 0.8]);
        // equal gains: z = 0
        assert_eq!(combine(RewardMode::Infomem, &[1.0, 1.0], &[0.7, 0.7], 0.5), vec![1.0, 1.0]);
    }

    #[test]
    fn z_scores_near_the_largest_doubles_stay_finite_and_exact_elsewhere() {
        // a sum of two 1e308s overflowed to inf before (σ = NaN, every reward NaN)
        let z = zscores(&[1e308, -1e308, 1e308]);
        let want = [1.0 / 2f64.sqrt(), -2.0 / 2f64.sqrt(), 1.0 / 2f64.sqrt()];
        for (a, b) in z.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{z:?}");
        }
        let r = combine(RewardMode::Infomem, &[1.0, 1.0, 0.0], &[1.7e308, -1.7e308, 5.0], 0.5);
        assert_eq!(r, vec![1.5, 0.5, 0.0]);
        // ordinary gains: the same bits as the unscaled formula
        let xs = [0.31, -1.25, 0.07, 2.5e-3];
        let n = xs.len() as f64;
        let mu = xs.iter().sum::<f64>() / n;
        let sigma = (xs.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / n).sqrt();
        let plain: Vec<f64> = xs.iter().map(|x| (x - mu) / sigma).collect();
        assert_eq!(zscores(&xs), plain);
    }
}
