//! CPU emulations of device algorithms that have no one-to-one CPU twin, used to de-risk the
//! kernels without a GPU: `sample_row` ports kernels/sample.cu (radix descent by mass over 64-bit
//! keys) to Rust, and the tests check it against the CPU twin `backend::cpu::sample::sample_row`
//! token for token.
use crate::backend::{SampleParams, Sampled};

const NOT_FOUND: u64 = u64::MAX;

struct Row<'a> {
    x: &'a [f32],
    m: f32,
    inv_t: f64,
    by_id: bool,
}

impl Row<'_> {
    fn key(&self, j: usize) -> u64 {
        if self.by_id {
            j as u64
        } else {
            // m − x >= 0; +0.0 for −0.0 so that equal weights get equal keys
            let dl = self.m - self.x[j];
            let dl = if dl == 0.0 { 0.0f32 } else { dl };
            (dl.to_bits() as u64) << 32 | j as u64
        }
    }
    fn weight(&self, j: usize) -> f64 {
        (((self.x[j] - self.m) as f64) * self.inv_t).exp()
    }
}

/// select_by_mass of sample.cu.
fn select_by_mass(r: &Row, level0: usize, thr: f64, strict: bool, cum_out: &mut f64) -> u64 {
    let mut prefix = 0u64;
    let mut below = 0f64;
    for level in level0..16 {
        let shift = 60 - 4 * level as u32;
        let (mut hm, mut hc) = ([0f64; 16], [0u32; 16]);
        for j in 0..r.x.len() {
            let k = r.key(j);
            let hi = if shift + 4 >= 64 { 0 } else { k >> (shift + 4) };
            if hi == prefix {
                let dg = ((k >> shift) & 15) as usize;
                hm[dg] += r.weight(j);
                hc[dg] += 1;
            }
        }
        let mut cum = below;
        let mut chosen = None;
        for b in 0..16 {
            let nb = cum + hm[b];
            if if strict { nb > thr } else { nb >= thr } {
                chosen = Some(b);
                break;
            }
            cum = nb;
        }
        if chosen.is_none() && level > level0 {
            chosen = (0..16).rev().find(|&b| hm[b] > 0.0);
            cum = below + hm[..chosen.unwrap_or(0)].iter().sum::<f64>();
        }
        let Some(b) = chosen else { return NOT_FOUND };
        below = cum;
        prefix = (prefix << 4) | b as u64;
        if level == 15 {
            *cum_out = below + hm[b];
            return prefix;
        }
        if hc[b] == 1 {
            let k = (0..r.x.len()).map(|j| r.key(j)).filter(|k| k >> shift == prefix).min().unwrap();
            *cum_out = below + hm[b];
            return k;
        }
    }
    NOT_FOUND
}

fn last_positive(r: &Row, limit: u64) -> u64 {
    (0..r.x.len()).filter(|&j| r.key(j) <= limit && r.weight(j) > 0.0).map(|j| r.key(j)).max().unwrap_or(NOT_FOUND)
}

/// sample_impl of sample.cu for one row.
pub fn sample_row(x: &[f32], p: SampleParams, u: f64) -> Sampled {
    let vocab = x.len();
    let (mut m, mut arg) = (f32::NEG_INFINITY, vocab);
    for (j, &v) in x.iter().enumerate() {
        if v > m {
            m = v;
            arg = j;
        }
    }
    if arg >= vocab {
        arg = 0;
    }
    let greedy = !(p.temperature > 0.0);
    let inv_t = if greedy { 1.0 } else { 1.0 / p.temperature as f64 };
    let z: f64 = x.iter().map(|&v| ((v - m) as f64).exp()).sum();
    let lse = m as f64 + z.ln();
    let mut token = arg;
    if !greedy {
        let wsum: f64 = x.iter().map(|&v| ((v - m) as f64 * inv_t).exp()).sum();
        let r = Row { x, m, inv_t, by_id: p.top_p >= 1.0 };
        let mut cum = 0.0;
        if r.by_id {
            let mut bits = 1;
            while bits < 32 && ((vocab as u32 - 1) >> bits) != 0 {
                bits += 1;
            }
            let level0 = 16 - (bits + 3) / 4;
            let mut k = select_by_mass(&r, level0, u * wsum, true, &mut cum);
            if k == NOT_FOUND {
                k = last_positive(&r, NOT_FOUND - 1);
            }
            token = if k == NOT_FOUND { arg } else { k as usize };
        } else {
            let need = p.top_p as f64 * wsum;
            let mut kn = select_by_mass(&r, 0, need, false, &mut cum);
            if kn == NOT_FOUND {
                kn = NOT_FOUND - 1;
                cum = wsum;
            }
            let mut kp = select_by_mass(&r, 0, u * cum, true, &mut cum);
            if kp == NOT_FOUND || kp > kn {
                kp = last_positive(&r, kn);
            }
            token = if kp == NOT_FOUND { arg } else { (kp & 0xffff_ffff) as usize };
        }
    }
    Sampled { token: token as u32, logprob: (x[token] as f64 - lse) as f32 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::sample::sample_row as cpu_sample;
    use crate::util::rng::Rng;

    /// The device algorithm picks the CPU twin's token for every (logits, T, top_p, u), including
    /// ties (repeated logits), -inf logits, peaked and flat distributions.
    #[test]
    fn radix_descent_matches_cpu_sampler() {
        let mut rng = Rng::new(11);
        let mut checked = 0;
        for case in 0..300 {
            let vocab = [2usize, 7, 50, 513, 3000][case % 5];
            let scale = [0.1f64, 1.0, 4.0, 12.0][case % 4];
            let mut x: Vec<f32> = (0..vocab).map(|_| (rng.normal() * scale) as f32).collect();
            if case % 3 == 0 {
                // ties: quantize so many logits repeat exactly
                for v in x.iter_mut() {
                    *v = (*v * 2.0).round() / 2.0;
                }
            }
            if case % 7 == 0 {
                x[rng.below(vocab as u64) as usize] = f32::NEG_INFINITY;
            }
            for &(t, top_p) in &[(0.0f32, 1.0f32), (1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (1.0, 0.999), (0.2, 0.1)] {
                for _ in 0..4 {
                    let u = rng.next_f64();
                    let p = SampleParams { temperature: t, top_p };
                    let want = cpu_sample(&x, p, u);
                    let got = sample_row(&x, p, u);
                    assert_eq!(got.token, want.token, "case {case} vocab {vocab} T {t} top_p {top_p} u {u} x {x:?}");
                    assert!((got.logprob - want.logprob).abs() < 1e-5);
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 300 * 6 * 4);
    }
}
