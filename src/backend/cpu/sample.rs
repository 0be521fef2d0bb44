//! Picking the next token from one row of logits: greedy (argmax, lowest id on ties, like
//! `torch.argmax`), or temperature + nucleus (top-p) sampling driven by one uniform draw.
use crate::backend::{SampleParams, Sampled};

pub fn sample_row(logits: &[f32], p: SampleParams, u: f64) -> Sampled {
    let m = super::simd::max(logits);
    let lse = m as f64 + (super::simd::sum_exp_sub(logits, m) as f64).ln();
    let logprob = |t: usize| (logits[t] as f64 - lse) as f32;
    if p.is_greedy() {
        let t = logits.iter().position(|&x| x == m).unwrap_or(0);
        return Sampled { token: t as u32, logprob: logprob(t) };
    }
    let inv_t = 1.0 / p.temperature as f64;
    // unnormalized probabilities at temperature T
    let w: Vec<f64> = logits.iter().map(|&x| ((x - m) as f64 * inv_t).exp()).collect();
    let total: f64 = w.iter().sum();
    let t = if p.top_p >= 1.0 {
        pick(w.iter().copied().enumerate(), total, u)
    } else {
        // The nucleus is the smallest prefix (by probability) with mass >= top_p. Only tokens
        // above a threshold can be in it when those already carry the mass: sort just those.
        let need = p.top_p as f64 * total;
        let mut thr = total * 1e-6;
        let cand = loop {
            let mut c: Vec<(usize, f64)> = w.iter().copied().enumerate().filter(|&(_, x)| x >= thr).collect();
            let mass: f64 = c.iter().map(|x| x.1).sum();
            if mass >= need || thr == 0.0 {
                c.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
                break c;
            }
            thr = if thr < total * 1e-12 { 0.0 } else { thr * 1e-3 };
        };
        let mut kept = Vec::new();
        let mut cum = 0.0;
        for (i, x) in cand {
            kept.push((i, x));
            cum += x;
            if cum >= need {
                break;
            }
        }
        pick(kept.into_iter(), cum, u)
    };
    Sampled { token: t as u32, logprob: logprob(t) }
}

fn pick(items: impl Iterator<Item = (usize, f64)>, total: f64, u: f64) -> usize {
    let target = u * total;
    let mut acc = 0.0;
    let mut last = 0;
    for (i, x) in items {
        if x <= 0.0 {
            continue;
        }
        acc += x;
        last = i;
        if acc > target {
            return i;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_max() {
        let s = sample_row(&[1.0, 3.0, 3.0, -1.0], SampleParams::GREEDY, 0.5);
        assert_eq!(s.token, 1);
        let lse = (1f64.exp() + 2.0 * 3f64.exp() + (-1f64).exp()).ln();
        assert!((s.logprob as f64 - (3.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn top_p_restricts_to_nucleus() {
        // probs ~ [0.6, 0.3, 0.1]: top_p 0.5 → only token 0; top_p 0.8 → tokens 0, 1.
        let l: Vec<f32> = [0.6f32, 0.3, 0.1].iter().map(|p| p.ln()).collect();
        let p = |top_p| SampleParams { temperature: 1.0, top_p };
        for i in 0..100 {
            let u = i as f64 / 100.0;
            assert_eq!(sample_row(&l, p(0.5), u).token, 0);
            assert!(sample_row(&l, p(0.8), u).token < 2);
        }
        // full distribution: frequencies follow the probabilities
        let mut counts = [0; 3];
        for i in 0..1000 {
            counts[sample_row(&l, p(1.0), (i as f64 + 0.5) / 1000.0).token as usize] += 1;
        }
        assert_eq!(counts, [600, 300, 100]);
    }
}
