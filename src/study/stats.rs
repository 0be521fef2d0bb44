//! The statistics of a study (docs/STUDY.md): accuracy with a two-level bootstrap interval
//! (seeds, then questions within a seed), the exact McNemar test on paired answers, and the
//! mean paired difference with the same bootstrap. Pure functions on plain vectors.
use crate::util::rng::Rng;

/// Resamples of every bootstrap in a study report.
pub const RESAMPLES: usize = 10_000;
/// Seed of the bootstrap generator: a report regenerated from the same cells is identical.
pub const BOOT_SEED: u64 = 0x5eed_57d7;

/// Mean over every value of every seed (questions × seeds pooled; with the same questions in
/// every seed this equals the mean of the per-seed means). NaN when there is nothing.
pub fn pooled_mean(seeds: &[Vec<f64>]) -> f64 {
    let n: usize = seeds.iter().map(|s| s.len()).sum();
    if n == 0 {
        return f64::NAN;
    }
    seeds.iter().flatten().sum::<f64>() / n as f64
}

/// The q-quantile of sorted values, linear between order statistics (position q·(n−1)).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Percentile 95 % interval of the pooled mean by a two-level bootstrap: each resample draws
/// as many seeds as there are, with replacement, then within each drawn seed as many questions
/// as it has, with replacement; the statistic is the pooled mean of the drawn values. Seed-to-seed
/// variation (training noise) and question sampling both widen the interval; with one seed it is
/// the ordinary bootstrap over questions. (NaN, NaN) when there is nothing.
pub fn bootstrap_ci(seeds: &[Vec<f64>], resamples: usize, rng_seed: u64) -> (f64, f64) {
    let seeds: Vec<&Vec<f64>> = seeds.iter().filter(|s| !s.is_empty()).collect();
    if seeds.is_empty() || resamples == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mut rng = Rng::new(rng_seed);
    let mut stats = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        let (mut sum, mut n) = (0.0, 0usize);
        for _ in 0..seeds.len() {
            let s = seeds[rng.below(seeds.len() as u64) as usize];
            for _ in 0..s.len() {
                sum += s[rng.below(s.len() as u64) as usize];
            }
            n += s.len();
        }
        stats.push(sum / n as f64);
    }
    stats.sort_by(|a, b| a.total_cmp(b));
    (quantile(&stats, 0.025), quantile(&stats, 0.975))
}

/// Two-sided exact McNemar p-value from the discordant counts: b = A right and B wrong,
/// c = A wrong and B right. Under the null each discordant pair is A's with probability ½:
/// p = min(1, 2·P[X ≤ min(b, c)]), X ~ Bin(b + c, ½); 1 when there is no discordant pair.
pub fn mcnemar_exact(b: u64, c: u64) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    // log C(n, i) by the recurrence C(n, i) = C(n, i−1)·(n−i+1)/i: stable for any n
    let ln2n = n as f64 * std::f64::consts::LN_2;
    let (mut log_c, mut tail) = (0.0f64, 0.0f64);
    for i in 0..=k {
        if i > 0 {
            log_c += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (log_c - ln2n).exp();
    }
    (2.0 * tail).min(1.0)
}

/// Discordant counts of two arms' answers paired by question: (b, c) where b counts A right and
/// B wrong, c the reverse. An answer is right when its em is ≥ ½ (em is 0 or 1).
pub fn discordant(pairs: &[(f64, f64)]) -> (u64, u64) {
    let (mut b, mut c) = (0, 0);
    for &(a, bb) in pairs {
        match (a >= 0.5, bb >= 0.5) {
            (true, false) => b += 1,
            (false, true) => c += 1,
            _ => {}
        }
    }
    (b, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcnemar_hand_values() {
        // n = 8: P[X ≤ 1] = (1 + 8)/256, doubled
        assert!((mcnemar_exact(1, 7) - 0.0703125).abs() < 1e-15);
        assert!((mcnemar_exact(7, 1) - 0.0703125).abs() < 1e-15);
        // n = 5: P[X = 0] = 1/32, doubled
        assert!((mcnemar_exact(0, 5) - 0.0625).abs() < 1e-15);
        // n = 6: (1 + 6 + 15 + 20)/64 doubled > 1
        assert_eq!(mcnemar_exact(3, 3), 1.0);
        assert_eq!(mcnemar_exact(0, 0), 1.0);
        // n = 10, k = 2: (1 + 10 + 45)/1024 · 2
        assert!((mcnemar_exact(2, 8) - 112.0 / 1024.0).abs() < 1e-15);
        // large n stays finite and tiny: all 2000 discordant pairs one way
        let p = mcnemar_exact(0, 2000);
        assert!((0.0..1e-300).contains(&p), "{p}");
        // large balanced n: p = 1
        assert_eq!(mcnemar_exact(5000, 5000), 1.0);
        // 10 vs 30 of 40: symmetric, between 0 and 1
        let p = mcnemar_exact(10, 30);
        assert!(p > 0.0 && p < 0.01, "{p}");
        assert_eq!(p, mcnemar_exact(30, 10));
    }

    #[test]
    fn discordant_counts() {
        let pairs = [(1.0, 0.0), (1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (1.0, 0.0)];
        assert_eq!(discordant(&pairs), (2, 1));
    }

    #[test]
    fn quantile_interpolates() {
        let v = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.5), 2.0);
        assert_eq!(quantile(&v, 0.0), 0.0);
        assert_eq!(quantile(&v, 1.0), 4.0);
        assert!((quantile(&v, 0.025) - 0.1).abs() < 1e-12);
        assert!((quantile(&v, 0.975) - 3.9).abs() < 1e-12);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn pooled_mean_weights_every_question() {
        assert_eq!(pooled_mean(&[vec![1.0, 0.0], vec![1.0, 1.0]]), 0.75);
        assert_eq!(pooled_mean(&[vec![1.0], vec![0.0, 0.0, 0.0]]), 0.25);
        assert!(pooled_mean(&[]).is_nan());
    }

    #[test]
    fn bootstrap_degenerate_and_known_cases() {
        // no variation anywhere: the interval is the point
        assert_eq!(bootstrap_ci(&[vec![1.0; 10], vec![1.0; 10]], 500, 1), (1.0, 1.0));
        assert_eq!(bootstrap_ci(&[vec![0.0; 3]], 500, 1), (0.0, 0.0));
        let (lo, hi) = bootstrap_ci(&[], 500, 1);
        assert!(lo.is_nan() && hi.is_nan());
        // seeds that differ only between them: resampling seeds gives the per-seed means {0, 1},
        // mixed as k/2 for 2 seeds: P(0) = P(1) = ¼, so the 2.5 % and 97.5 % points are 0 and 1
        let (lo, hi) = bootstrap_ci(&[vec![0.0; 5], vec![1.0; 5]], 4000, 7);
        assert_eq!((lo, hi), (0.0, 1.0));
        // one seed, 100 questions at 50 %: the interval is about 0.5 ± 1.96·0.05
        let v: Vec<f64> = (0..100).map(|i| (i % 2) as f64).collect();
        let (lo, hi) = bootstrap_ci(std::slice::from_ref(&v), RESAMPLES, BOOT_SEED);
        assert!((lo - 0.402).abs() < 0.02 && (hi - 0.598).abs() < 0.02, "{lo} {hi}");
        // deterministic for a fixed seed
        assert_eq!(bootstrap_ci(std::slice::from_ref(&v), 1000, 3), bootstrap_ci(&[v], 1000, 3));
    }
}
