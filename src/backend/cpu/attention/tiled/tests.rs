use super::super::decode::{decode_row, decode_usable};
use crate::backend::cpu::attention_dense::attn_dense;
use crate::backend::cpu::bf16::f32_to_bf16_bits;
use crate::backend::{AttnGeom, DenseSeq};
use crate::util::rng::Rng;

/// Sequences of 70, 1, 33, 130 and 32 rows back to back (across the 64-row block and the
/// 32-key panel boundaries): the geometry, the sequences and the row count.
fn batch(nh: usize, nkv: usize, hd: usize) -> (AttnGeom, Vec<DenseSeq>, usize) {
    let g = AttnGeom { n_layers: 1, n_heads: nh, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
    let mut seqs = Vec::new();
    let mut row = 0;
    for len in [70usize, 1, 33, 130, 32] {
        seqs.push(DenseSeq { row0: row, len });
        row += len;
    }
    (g, seqs, row)
}

/// `decode_row` against an f64 reference on the same rounded operands (Q and the softmax
/// numerators to bf16, as the kernel): groups of 1, 3 and 8 query heads (8: two passes of
/// ≤ 6), heads of 64 and 128, pages of 32 and 64 keys, contexts ending mid-page, on an odd key
/// and on a page boundary; the slots past the context hold NaN (a recycled page's leftovers
/// may be anything) and must not reach the output.
#[test]
fn decode_row_matches_f64_on_rounded_operands() {
    if !decode_usable(64, 64) {
        eprintln!("no AVX512_BF16 here: decode rows use the f32 kernels");
        return;
    }
    let bf = |x: f32| f32::from_bits((f32_to_bf16_bits(x) as u32) << 16);
    let mut rng = Rng::new(7);
    for &(group, hd, ps) in &[(3usize, 64usize, 64usize), (8, 64, 32), (1, 128, 64), (3, 128, 32)] {
        for visible in [1usize, 37, 64, 95, 128, 129] {
            let n_pages = visible.div_ceil(ps);
            // keys Kᵀ [hd][ps] and values [ps][hd] per page, NaN past the context
            let mut kt = vec![vec![f32_to_bf16_bits(f32::NAN); hd * ps]; n_pages];
            let mut vv = vec![vec![f32_to_bf16_bits(f32::NAN); hd * ps]; n_pages];
            let mut keys = vec![vec![0f32; hd]; visible];
            let mut vals = vec![vec![0f32; hd]; visible];
            for t in 0..visible {
                for d in 0..hd {
                    keys[t][d] = bf((rng.next_f64() * 4.0 - 2.0) as f32);
                    vals[t][d] = bf((rng.next_f64() * 4.0 - 2.0) as f32);
                    kt[t / ps][d * ps + t % ps] = f32_to_bf16_bits(keys[t][d]);
                    vv[t / ps][(t % ps) * hd + d] = f32_to_bf16_bits(vals[t][d]);
                }
            }
            let q: Vec<f32> = (0..group * hd).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let mut out = vec![f32::NAN; group * hd];
            decode_row(|i| &kt[i][..], |i| &vv[i][..], |_| std::ptr::null(), (ps, hd, visible), &q, group, scale, &mut out);
            for h in 0..group {
                let qh: Vec<f64> = q[h * hd..(h + 1) * hd].iter().map(|&x| bf(x) as f64).collect();
                let s: Vec<f64> = keys.iter().map(|k| k.iter().zip(&qh).map(|(&a, b)| a as f64 * b).sum::<f64>() * scale as f64).collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = e.iter().sum();
                for c in 0..hd {
                    let want = e.iter().zip(&vals).map(|(&p, v)| bf(p as f32) as f64 * v[c] as f64).sum::<f64>() / l;
                    let got = out[h * hd + c] as f64;
                    // the numerators' roundings may differ where the f32 and f64 scores
                    // straddle a bf16 boundary: one ulp (2⁻⁸ relative) of a term, of |v| ≤ 2
                    assert!((got - want).abs() < 2f64.powi(-7) * 2.0 / l.max(1.0) + 1e-5, "group {group}, hd {hd}, pages of {ps}, {visible} keys, head {h}, column {c}: {got} vs {want}");
                }
            }
        }
    }
}

/// Whether this CPU lacks the bf16 attention (then the test has nothing to check; said so).
fn not_here() -> bool {
    let no = !super::usable(64);
    if no {
        eprintln!("neither AMX nor AVX512_BF16 here: the bf16 attention is not used on this CPU");
    }
    no
}

fn r16(x: f32) -> f64 {
    f32::from_bits((f32_to_bf16_bits(x) as u32) << 16) as f64
}

/// The training forward (AMX or `vdpbf16ps`) against f64 on the bf16-rounded Q, K, V: the output within
/// the numerators' rounding (≤ 2⁻⁸ relative each, so ≤ 2⁻⁸·max|v|), the lse within f32
/// rounding; and each sequence alone gives the bits it gets in the batch. Lengths cross the
/// 64-row block and 32-key panel boundaries; GQA 9/3 and 4/1, heads of 64 and 32.
#[test]
fn dense_forward_matches_f64_and_is_batch_invariant() {
    if not_here() {
        return;
    }
    for &(nh, nkv, hd) in &[(9usize, 3usize, 64usize), (4, 1, 32)] {
        let (g, seqs, row) = batch(nh, nkv, hd);
        let (w, qd, group) = (g.qkv_dim(), g.q_dim(), nh / nkv);
        let mut rng = Rng::new(5);
        let qkv: Vec<f32> = (0..row * w).map(|_| (rng.normal() * 1.5) as f32).collect();
        let mut out = vec![f32::NAN; row * qd];
        let mut lse = vec![f32::NAN; row * nh];
        attn_dense(&qkv, &seqs, g, &mut out, &mut lse, true);
        let scale = 1.0 / (hd as f64).sqrt();
        for s in &seqs {
            for i in 0..s.len {
                let r = s.row0 + i;
                for qh in 0..nh {
                    let kvh = qh / group;
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| (0..hd).map(|c| r16(qkv[r * w + qh * hd + c]) * r16(qkv[(s.row0 + j) * w + qd + kvh * hd + c])).sum::<f64>() * scale)
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    let want_lse = m + z.ln();
                    let got_lse = lse[r * nh + qh] as f64;
                    assert!((got_lse - want_lse).abs() < 1e-5 * want_lse.abs().max(1.0), "lse row {r} head {qh}: {got_lse} vs {want_lse}");
                    let mut vmax = 0f64;
                    for c in 0..hd {
                        let mut o = 0.0;
                        for (j, x) in sc.iter().enumerate() {
                            let v = r16(qkv[(s.row0 + j) * w + qd + g.kv_dim() + kvh * hd + c]);
                            vmax = vmax.max(v.abs());
                            o += (x - m).exp() / z * v;
                        }
                        let got = out[r * qd + qh * hd + c] as f64;
                        assert!((got - o).abs() <= 2f64.powi(-8) * vmax + 1e-5, "out row {r} head {qh} col {c}: {got} vs {o}");
                    }
                }
            }
        }
        // each sequence alone: the same bits
        for s in &seqs {
            let one = &qkv[s.row0 * w..(s.row0 + s.len) * w];
            let (mut o1, mut l1) = (vec![0f32; s.len * qd], vec![0f32; s.len * nh]);
            attn_dense(one, &[DenseSeq { row0: 0, len: s.len }], g, &mut o1, &mut l1, true);
            assert!(o1.iter().zip(&out[s.row0 * qd..]).all(|(a, b)| a.to_bits() == b.to_bits()), "sequence of {} alone differs", s.len);
            assert!(l1.iter().zip(&lse[s.row0 * nh..]).all(|(a, b)| a.to_bits() == b.to_bits()), "lse of {} alone differs", s.len);
        }
    }
}

/// The softmax numerators' 2^t (`x512::exp2`: fused multiply-adds, `vscalefps`) against f64
/// over its whole domain: within 1 ulp (measured: 0.83) wherever the result is a normal f32
/// (t down to the clamp at −126), exactly 1 at 0, NaN kept, −∞ and t < −126 clamped to 2⁻¹²⁶;
/// and `x512::bf16x16` (`vcvtneps2bf16`) against `f32_to_bf16_bits` (nearest even) on normal
/// values and NaN, ±0 for denormals.
#[test]
fn fast_exp2_is_within_one_ulp() {
    if not_here() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // Safety: AVX-512F and AVX512_BF16 (`usable`, checked above)
        #[target_feature(enable = "avx512f,avx512bf16")]
        unsafe fn run(x: &[f32; 16]) -> ([f32; 16], [u16; 16]) {
            let v = _mm512_loadu_ps(x.as_ptr());
            let (mut e, mut h) = ([0f32; 16], [0u16; 16]);
            _mm512_storeu_ps(e.as_mut_ptr(), super::x512::exp2(v));
            _mm256_storeu_si256(h.as_mut_ptr() as *mut __m256i, super::x512::bf16x16(v));
            (e, h)
        }
        // |error| in units of the spacing of f32 at the true value
        let ulp = |got: f32, want: f64| {
            let w = want as f32;
            (got as f64 - want).abs() / (f32::from_bits(w.to_bits() + 1) - w) as f64
        };
        let mut worst = (0f64, 0f32);
        let mut rng = Rng::new(11);
        let mut xs: Vec<f32> = (0..1 << 21).map(|i| -126.0 * (i as f32) / (1 << 21) as f32).collect();
        xs.extend((0..1 << 16).map(|_| -(rng.next_f64() as f32) * 126.0));
        // slightly positive: a numerator's argument rounds a little above 0
        xs.extend((0..1 << 12).map(|_| (rng.next_f64() as f32) * 1e-5));
        xs.extend((0..1 << 12).map(|_| -(rng.next_f64() as f32) * 1e-3));
        for c in xs.chunks(16) {
            let mut x = [0f32; 16];
            x[..c.len()].copy_from_slice(c);
            let (e, h) = unsafe { run(&x) };
            for (l, (&xi, &ei)) in x.iter().zip(&e).enumerate().take(c.len()) {
                let want = (xi as f64).exp2();
                let u = ulp(ei, want);
                if u > worst.0 {
                    worst = (u, xi);
                }
                assert_eq!(h[l], f32_to_bf16_bits(xi), "bf16 of {xi}");
            }
        }
        eprintln!("exp2: at most {:.3} ulp (at {})", worst.0, worst.1);
        assert!(worst.0 <= 1.0, "exp2 is {} ulp off at {}", worst.0, worst.1);
        let mut x = [0f32; 16];
        x[1] = f32::NAN;
        x[2] = f32::NEG_INFINITY;
        x[3] = 1e-40; // denormal
        x[4] = -1e-40;
        x[5] = 3.0e38;
        x[6] = -0.0;
        x[7] = -200.0;
        x[8] = -1.0;
        let (e, h) = unsafe { run(&x) };
        assert_eq!(e[0], 1.0);
        assert!(e[1].is_nan() && h[1] & 0x7fff > 0x7f80, "NaN: exp {} bf16 {:#x}", e[1], h[1]);
        assert_eq!((e[2], e[7]), (2f32.powi(-126), 2f32.powi(-126)), "2^−∞ and 2^−200 clamp to 2^−126");
        assert_eq!(e[8], 0.5);
        assert_eq!((h[3], h[4]), (0, 0x8000), "denormals to ±0");
        assert_eq!(h[5], f32_to_bf16_bits(3.0e38));
        assert_eq!((e[6], h[6]), (1.0, 0x8000));
    }
}

/// `transpose_out` (16 × 16 blocks in registers, the edges one by one) and `pack_transposed`
/// (zipped and transposed in registers) against their definitions, on shapes off the 16 and
/// 32 grids, into buffers holding other values first.
#[test]
fn transposes_match_their_definitions() {
    if not_here() {
        return;
    }
    let mut rng = Rng::new(7);
    for &(rows, cols) in &[(64usize, 70usize), (32, 1), (48, 33), (5, 130), (16, 16)] {
        let lds = cols.next_multiple_of(32) + 3;
        let src: Vec<f32> = (0..rows * lds).map(|_| rng.normal() as f32).collect();
        let ldd = rows + 5;
        let mut dst = vec![f32::NAN; cols * ldd];
        // Safety: dst holds cols rows of ldd ≥ rows
        unsafe { super::transpose_out(&src, lds, rows, cols, dst.as_mut_ptr(), ldd) };
        for j in 0..cols {
            for c in 0..ldd {
                let want = if c < rows { src[c * lds + j].to_bits() } else { f32::NAN.to_bits() };
                assert_eq!(dst[j * ldd + c].to_bits(), want, "transpose_out {rows}x{cols}: ({c}, {j})");
            }
        }
    }
    for &(m, width) in &[(1usize, 32usize), (33, 64), (70, 16), (192, 64)] {
        let x: Vec<Vec<f32>> = (0..m).map(|_| (0..width).map(|_| rng.normal() as f32).collect()).collect();
        let mut dst = vec![0xdead_beef; 40];
        let wp = super::pack_transposed(&mut dst, m, width, |i| &x[i]);
        assert_eq!((wp, dst.len()), (m.next_multiple_of(32) / 2, width * wp));
        let h = |i: usize, c: usize| if i < m { f32_to_bf16_bits(x[i][c]) as u32 } else { 0 };
        for c in 0..width {
            for w in 0..wp {
                assert_eq!(dst[c * wp + w], h(2 * w, c) | h(2 * w + 1, c) << 16, "pack_transposed m {m}: ({c}, {w})");
            }
        }
    }
}

/// The training backward (AMX or `vdpbf16ps`) against the f32 twin (itself checked against finite
/// differences in tests/grpo_grad.rs) on the same bf16-rounded Q, K, V and dO, with the
/// forward's out and lse: it rounds dS (and P for dV) to bf16, ≤ 2⁻⁸ relative each, so
/// each of dQ, dK, dV within 0.5 % in norm (measured 0.15–0.17 % on AMX); every element written; each sequence alone gives the
/// bits it gets in the batch.
#[test]
fn dense_backward_matches_f32_twin_and_is_batch_invariant() {
    use crate::backend::cpu::attention_dense::attn_dense_bwd;
    if not_here() {
        return;
    }
    for &(nh, nkv, hd) in &[(9usize, 3usize, 64usize), (4, 1, 32)] {
        let (g, seqs, row) = batch(nh, nkv, hd);
        let (w, qd) = (g.qkv_dim(), g.q_dim());
        let mut rng = Rng::new(6);
        let qkv: Vec<f32> = (0..row * w).map(|_| r16((rng.normal() * 1.5) as f32) as f32).collect();
        let dout: Vec<f32> = (0..row * qd).map(|_| r16(rng.normal() as f32) as f32).collect();
        let (mut out, mut lse) = (vec![0f32; row * qd], vec![0f32; row * nh]);
        attn_dense(&qkv, &seqs, g, &mut out, &mut lse, true);
        let mut got = vec![f32::NAN; row * w];
        attn_dense_bwd(&qkv, &out, &dout, &lse, &seqs, g, &mut got, true);
        assert!(got.iter().all(|v| v.is_finite()), "every element of dqkv is written");
        let mut want = vec![0f32; row * w];
        attn_dense_bwd(&qkv, &out, &dout, &lse, &seqs, g, &mut want, false);
        for (name, c0, c1) in [("dQ", 0, qd), ("dK", qd, qd + g.kv_dim()), ("dV", qd + g.kv_dim(), w)] {
            let (mut d, mut r) = (0f64, 0f64);
            for i in 0..row {
                for c in c0..c1 {
                    d += (got[i * w + c] as f64 - want[i * w + c] as f64).powi(2);
                    r += (want[i * w + c] as f64).powi(2);
                }
            }
            let e = (d / r).sqrt();
            assert!(e < 5e-3, "{name} (heads {nh}/{nkv}, hd {hd}): ‖Δ‖/‖f32‖ = {e:.2e}");
        }
        for s in &seqs {
            let one = &qkv[s.row0 * w..(s.row0 + s.len) * w];
            let mut g1 = vec![0f32; s.len * w];
            let one_seq = [DenseSeq { row0: 0, len: s.len }];
            attn_dense_bwd(one, &out[s.row0 * qd..], &dout[s.row0 * qd..], &lse[s.row0 * nh..], &one_seq, g, &mut g1, true);
            assert!(g1.iter().zip(&got[s.row0 * w..]).all(|(a, b)| a.to_bits() == b.to_bits()), "sequence of {} alone differs", s.len);
        }
    }
}
