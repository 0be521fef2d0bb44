use super::gemm::*;
use super::kernel::*;
use super::pack::*;
use super::portable::*;
use crate::util::rng::Rng;
use half::bf16;

const U: f64 = 1.0 / (1u64 << 24) as f64; // unit roundoff of f32

fn kernels() -> Vec<Kernel> {
    let mut v = vec![];
    if native_available() {
        v.push(Kernel::Native);
    } else {
        eprintln!("note: no AVX512_BF16 on this CPU, the vdpbf16ps kernel is not tested");
    }
    if avx2_available() {
        v.push(Kernel::Avx2);
    }
    v.push(Kernel::Portable);
    v
}

/// `kernels()` and, where this machine allows it, AMX: checked against the f64 bounds and for
/// batch invariance (not for the `vdpbf16ps` bits, which AMX does not reproduce).
fn all_kernels() -> Vec<Kernel> {
    let mut v = kernels();
    if amx_available() {
        v.push(Kernel::Amx);
    } else {
        eprintln!("note: no AMX on this CPU (or INFOMEM_AMX=0), the AMX kernel is not tested");
    }
    v
}

fn normal(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.normal() as f32).collect()
}

/// The summation order of the module doc, written directly on the unpacked values with the
/// exact step: what every kernel must reproduce bit for bit. `w(p)` is the reduction's weight.
fn spec(x: &[f32], w: impl Fn(usize) -> u16, init: Option<f32>, bias: Option<f32>) -> f32 {
    let red = x.len();
    let pairs = red.div_ceil(2);
    let kc = k_block_pairs(pairs);
    let get = |p: usize| if p < red { (bf16_daz(f32_to_bf16_bits(x[p])), bf16_daz(w(p))) } else { (0.0, 0.0) };
    let mut v = init;
    for q0 in (0..pairs).step_by(kc) {
        let mut acc = 0f32;
        for q in q0..(q0 + kc).min(pairs) {
            let ((xe, we), (xo, wo)) = (get(2 * q), get(2 * q + 1));
            acc = step_exact(acc, xo, wo);
            acc = step_exact(acc, xe, we);
        }
        v = Some(v.map_or(acc, |v| v + acc));
    }
    let v = v.unwrap_or(0.0);
    bias.map_or(v, |b| v + b)
}

fn same_bits(got: f32, want: f32) -> bool {
    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
}

/// `f32_to_bf16_bits` is `half::bf16::from_f32` on every 61st of the 2^32 inputs, plus the
/// special neighbourhoods; the AVX-512 strip conversion gives the same words.
#[test]
fn rounding_matches_half() {
    // zeros, denormals, the largest denormal (rounds up to a normal), ties, overflow, inf, NaN
    let specials = [0u32, 0x8000_0000, 0x0000_0001, 0x007f_ffff, 0x0080_0000, 0x007f_8000, 0x0000_8000, 0x3f80_8000, 0x3f81_8000];
    let specials = specials.into_iter().chain([0x3f80_8001, 0x7f7f_ffff, 0x7f7f_8000, 0x7f80_0000, 0xff80_0000, 0x7f80_0001, 0x7fc0_0000, 0xffff_ffff, 0x7fff_ffff]);
    let stride = if cfg!(debug_assertions) { 4099 } else { 61 };
    let mut bits: Vec<u32> = (0..=u32::MAX).step_by(stride).collect();
    for s in specials {
        for d in 0..64u32 {
            bits.push(s.wrapping_add(d));
            bits.push(s.wrapping_sub(d));
        }
    }
    for &b in &bits {
        let x = f32::from_bits(b);
        assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(x).to_bits(), "{b:#010x}");
        assert_eq!(f32_to_bf16(x).to_bits(), bf16::from_f32(x).to_bits());
    }
    if native_available() {
        let xs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let rows = 3;
        let red: usize = 2 * 16 * 5 + 7; // 84 pairs: 5 vector rounds, 3 scalar pairs, an odd element
        let pairs = red.div_ceil(2);
        for chunk in xs.chunks_exact(rows * red).take(2000) {
            let (mut a, mut b) = (vec![0u32; rows * pairs], vec![0u32; rows * pairs]);
            unsafe {
                convert_strip(chunk.as_ptr(), red, rows, 0, pairs, a.as_mut_ptr(), true);
                convert_strip(chunk.as_ptr(), red, rows, 0, pairs, b.as_mut_ptr(), false);
            }
            assert_eq!(a, b);
            assert_eq!(a[pairs - 1] as u16, bf16::from_f32(chunk[red - 1]).to_bits());
            assert_eq!(a[pairs - 1] >> 16, 0);
        }
    }
    // the AVX2 kernel's layout: the same bits as f32 values, a zero pad, each row's smallest
    // exponent (zero is 255, a denormal 0; sign ignored)
    for (h, e) in [(0u16, 255u8), (0x8000, 255), (0x0001, 0), (0x807f, 0), (0x0080, 1), (0x8080, 1), (0x2380, 71), (0xa3ff, 71), (0x3f80, 127), (0x7f80, 255), (0xffc1, 255)] {
        assert_eq!(bf16_exp(h), e, "{h:#06x}");
    }
    assert!(plain_fma_exact(71, 71) && plain_fma_exact(1, 141) && plain_fma_exact(141, 1));
    assert!(!plain_fma_exact(71, 70) && !plain_fma_exact(0, 255) && !plain_fma_exact(255, 0));
    // rows drawn from the whole list (every sign, exponent, special), shuffled
    let mut rng = Rng::new(4);
    let mut xs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    for i in (1..xs.len()).rev() {
        xs.swap(i, rng.next_u64() as usize % (i + 1));
    }
    let (rows, red) = (3, 67);
    let mut seen = [0usize; 256];
    for chunk in xs.chunks_exact(rows * red).take(20_000) {
        let (mut d, mut exps) = (vec![7f32; rows * (red + 1)], [9u8; 3]);
        unsafe { convert_wide(chunk.as_ptr(), red, rows, d.as_mut_ptr(), exps.as_mut_ptr()) };
        for r in 0..rows {
            let want: Vec<u16> = chunk[r * red..(r + 1) * red].iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
            let got = &d[r * (red + 1)..(r + 1) * (red + 1)];
            assert!(got[..red].iter().zip(&want).all(|(g, &w)| g.to_bits() == (w as u32) << 16));
            assert_eq!(got[red].to_bits(), 0);
            assert_eq!(exps[r], want.iter().map(|&h| bf16_exp(h)).min().unwrap());
            seen[exps[r] as usize] += 1;
        }
    }
    assert!(seen[0] > 0 && seen.iter().filter(|&&c| c > 0).count() > 20, "row minima: {seen:?}");
}

/// Packing keeps every value (`get`, `to_f32`), pads with zeros, and `from_bf16` packs the same words.
#[test]
fn packing_roundtrip() {
    let mut rng = Rng::new(1);
    for &(n, k) in &[(1, 1), (5, 3), (33, 64), (70, 641), (40, 1537)] {
        let w = normal(&mut rng, n * k);
        let pw = PackedBf16::from_f32(&w, n, k);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let pb = PackedBf16::from_bf16(&wb, n, k);
        assert_eq!(pw.bytes(), n.div_ceil(NR) * k.div_ceil(2) * NR * 4);
        assert!(pw.data.iter().zip(pb.data.iter()).all(|(a, b)| a.0 == b.0));
        let un = pw.to_f32();
        for j in 0..n {
            for p in 0..k {
                assert_eq!(pw.get(j, p).to_bits(), wb[j * k + p].to_bits(), "({j},{p}) of [{n},{k}]");
                assert_eq!(un[j * k + p], wb[j * k + p].to_f32());
            }
        }
        // padding: columns past n and the odd k's last high half are zero
        for q in 0..pw.pairs {
            for j in 0..pw.panels * NR {
                let word = pw.word(j, q);
                if j >= n {
                    assert_eq!(word, 0);
                } else if 2 * q + 1 == k {
                    assert_eq!(word >> 16, 0);
                }
            }
        }
    }
}

/// The `dy W` repack of a block equals the forward packing of Wᵀ (same words, same padding).
#[test]
fn dx_repack_is_packed_transpose() {
    let mut rng = Rng::new(2);
    for &(n, k) in &[(1, 1), (3, 5), (65, 33), (77, 700), (700, 77), (1537, 40)] {
        let w = normal(&mut rng, n * k);
        let pw = PackedBf16::from_f32(&w, n, k);
        let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
        let pt = PackedBf16::from_f32(&wt, k, n);
        for b in 0..pt.blocks() {
            let (t0, kb) = pt.block(b);
            for (p0, p1) in [(0, pt.panels), (pt.panels / 2, pt.panels)] {
                let mut d = vec![0u32; (p1 - p0) * kb * NR];
                unsafe { repack_dx(&pw, p0, p1, t0, kb, d.as_mut_ptr()) };
                let off = pt.block_off(b) + p0 * kb * NR;
                let want: Vec<u32> = (0..d.len()).map(|i| pt.data[(off + i) / 16].0[(off + i) % 16]).collect();
                assert_eq!(d, want, "[{n}, {k}] block {b} panels {p0}..{p1}");
            }
        }
    }
}

/// (m, k, n): m = 1, 2, 8, 12, 13, 37, 100; k = 1, odd, not a multiple of 32, several k
/// blocks (k > 640); n below, at and past panel edges.
const SHAPES: &[(usize, usize, usize)] =
    &[(1, 1, 1), (1, 2, 3), (2, 7, 33), (13, 31, 32), (13, 64, 65), (100, 33, 97), (1, 576, 960), (8, 641, 40), (12, 1536, 70), (37, 1537, 100), (2, 2000, 129), (100, 577, 64), (45, 64, 97), (70, 1024, 100), (3, 130, 65), (5, 577, 40), (6, 64, 33), (7, 641, 96), (11, 200, 70)];

/// x Wᵀ + b against an f64 reference on the bf16-rounded inputs, within the worst-case bound
/// of a sequential f32 sum: |err| ≤ (k + blocks + 2)·u·(Σ|x·w| + |b|), u = 2⁻²⁴.
#[test]
fn matmul_matches_f64_reference() {
    let mut rng = Rng::new(3);
    for &(m, k, n) in SHAPES {
        let x = normal(&mut rng, m * k);
        let w = normal(&mut rng, n * k);
        let bias = normal(&mut rng, n);
        let pw = PackedBf16::from_f32(&w, n, k);
        let (xr, wr): (Vec<f64>, Vec<f64>) = (x.iter().map(|&v| bf16::from_f32(v).to_f64()).collect(), pw.to_f32().iter().map(|&v| v as f64).collect());
        let blocks = k.div_ceil(2).div_ceil(k_block_pairs(k.div_ceil(2)));
        for kernel in all_kernels() {
            for with_bias in [false, true] {
                let mut out = vec![f32::NAN; m * n + 3];
                matmul_bf16_with(&x, &pw, with_bias.then_some(&bias[..]), m, k, n, &mut out, kernel, true);
                assert!(out[m * n..].iter().all(|v| v.is_nan()), "wrote past the output");
                for i in 0..m {
                    for j in 0..n {
                        let (mut dot, mut mag) = (0f64, 0f64);
                        for p in 0..k {
                            dot += xr[i * k + p] * wr[j * k + p];
                            mag += (xr[i * k + p] * wr[j * k + p]).abs();
                        }
                        let b = if with_bias { bias[j] as f64 } else { 0.0 };
                        let tol = (k + blocks + 2) as f64 * U * (mag + b.abs());
                        let got = out[i * n + j] as f64;
                        assert!((got - dot - b).abs() <= tol, "{kernel:?} m{m} k{k} n{n} ({i},{j}): {got} vs {} (tol {tol:e})", dot + b);
                    }
                }
            }
        }
    }
}

/// dx (+)= dy W against f64, both modes, within the same bound over the n-long sums.
#[test]
fn dx_matches_f64_reference() {
    let mut rng = Rng::new(4);
    for &(m, n, k) in SHAPES {
        let dy = normal(&mut rng, m * n);
        let w = normal(&mut rng, n * k);
        let dx0 = normal(&mut rng, m * k);
        let pw = PackedBf16::from_f32(&w, n, k);
        let (dr, wr): (Vec<f64>, Vec<f64>) = (dy.iter().map(|&v| bf16::from_f32(v).to_f64()).collect(), pw.to_f32().iter().map(|&v| v as f64).collect());
        let blocks = n.div_ceil(2).div_ceil(k_block_pairs(n.div_ceil(2)));
        for kernel in all_kernels() {
            for accumulate in [false, true] {
                let mut dx = dx0.clone();
                dx.push(f32::NAN);
                matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, accumulate, kernel, true);
                assert!(dx[m * k].is_nan(), "wrote past dx");
                for i in 0..m {
                    for p in 0..k {
                        let (mut dot, mut mag) = (0f64, 0f64);
                        for j in 0..n {
                            dot += dr[i * n + j] * wr[j * k + p];
                            mag += (dr[i * n + j] * wr[j * k + p]).abs();
                        }
                        let init = if accumulate { dx0[i * k + p] as f64 } else { 0.0 };
                        let tol = (n + blocks + 2) as f64 * U * (mag + init.abs());
                        let got = dx[i * k + p] as f64;
                        assert!((got - dot - init).abs() <= tol, "{kernel:?} acc={accumulate} m{m} n{n} k{k} ({i},{p}): {got} vs {}", dot + init);
                    }
                }
            }
        }
    }
}

/// Both kernels give the bits of `spec` (the documented order), forward with and without
/// bias and dx in both modes, on shapes with several k blocks, odd k and partial panels.
#[test]
fn kernels_give_the_spec_bits() {
    let mut rng = Rng::new(5);
    for &(m, k, n) in SHAPES {
        let x = normal(&mut rng, m * k);
        let w = normal(&mut rng, n * k);
        let bias = normal(&mut rng, n);
        let dy = normal(&mut rng, m * n);
        let dx0 = normal(&mut rng, m * k);
        let pw = PackedBf16::from_f32(&w, n, k);
        let wb: Vec<u16> = w.iter().map(|&v| f32_to_bf16_bits(v)).collect();
        for kernel in kernels() {
            let mut out = vec![0f32; m * n];
            matmul_bf16_with(&x, &pw, Some(&bias), m, k, n, &mut out, kernel, true);
            for i in 0..m {
                for j in 0..n {
                    let want = spec(&x[i * k..(i + 1) * k], |p| wb[j * k + p], None, Some(bias[j]));
                    assert!(same_bits(out[i * n + j], want), "{kernel:?} x·Wᵀ m{m} k{k} n{n} ({i},{j}): {} vs {want}", out[i * n + j]);
                }
            }
            for accumulate in [false, true] {
                let mut dx = dx0.clone();
                matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, accumulate, kernel, true);
                for i in 0..m {
                    for p in 0..k {
                        let want = spec(&dy[i * n..(i + 1) * n], |j| wb[j * k + p], accumulate.then_some(dx0[i * k + p]), None);
                        assert!(same_bits(dx[i * k + p], want), "{kernel:?} dy·W acc={accumulate} m{m} n{n} k{k} ({i},{p}): {} vs {want}", dx[i * k + p]);
                    }
                }
            }
        }
    }
}

/// A row's bits do not depend on the other rows of the call, on its position, on the thread
/// count, or on the kernel (native vs portable); with AMX, on the first three.
#[test]
fn rows_are_batch_invariant() {
    let mut rng = Rng::new(6);
    for &(m, k, n) in &[(100, 641, 70), (40, 1536, 200), (29, 577, 960), (70, 576, 96)] {
        let x = normal(&mut rng, m * k);
        let w = normal(&mut rng, n * k);
        let bias = normal(&mut rng, n);
        let pw = PackedBf16::from_f32(&w, n, k);
        let dy = normal(&mut rng, m * n);
        for kernel in all_kernels() {
            let reference = if kernel == Kernel::Amx { kernel } else { kernels()[0] };
            let mut all = vec![0f32; m * n];
            matmul_bf16_with(&x, &pw, Some(&bias), m, k, n, &mut all, reference, true);
            let mut all_dx = vec![0f32; m * k];
            matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut all_dx, false, reference, true);
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| {
                    // every row alone, and sub-batches of 2, 13 and 16 rows at odd offsets
                    for (r0, rows) in (0..m).map(|i| (i, 1)).chain([(3, 2), (5, 13), (m - 16, 16), (0, m)]) {
                        let mut out = vec![0f32; rows * n];
                        matmul_bf16_with(&x[r0 * k..(r0 + rows) * k], &pw, Some(&bias), rows, k, n, &mut out, kernel, threads > 1);
                        assert!(out.iter().zip(&all[r0 * n..(r0 + rows) * n]).all(|(a, b)| a.to_bits() == b.to_bits()), "{kernel:?} {threads} threads, rows {r0}+{rows} of m{m} k{k} n{n}");
                        let mut dx = vec![0f32; rows * k];
                        matmul_dx_bf16_with(&dy[r0 * n..(r0 + rows) * n], &pw, rows, n, k, &mut dx, false, kernel, threads > 1);
                        assert!(dx.iter().zip(&all_dx[r0 * k..(r0 + rows) * k]).all(|(a, b)| a.to_bits() == b.to_bits()), "dx: {kernel:?} {threads} threads, rows {r0}+{rows}");
                    }
                });
            }
        }
    }
}

/// Tiny values: partial sums cross 2⁻¹²⁶ (flushed), bf16 denormals (read as zero), and the
/// exact-±2⁻¹²⁶ edge the portable kernel redoes exactly: both kernels give `spec`'s bits,
/// and the cases measured on this CPU's `vdpbf16ps` hold.
#[test]
fn denormals_flush_like_vdpbf16ps() {
    let p2 = |e: i32| 2f32.powi(e);
    // (x, w) over k = 4; pairs are (0,1), (2,3) and the odd element of a pair goes first
    let cases: &[([f32; 4], [f32; 4], f32)] = &[
        // 2⁻¹²⁶, then − 1.5·2⁻¹⁵¹: exact value rounds (24 bits) below 2⁻¹²⁶ → flushed to 0
        ([p2(-63), 0.0, p2(-75), 0.0], [p2(-63), 0.0, -1.5 * p2(-76), 0.0], 0.0),
        // − 2⁻¹⁵¹ is a tie that rounds back up to 2⁻¹²⁶: kept
        ([p2(-63), 0.0, p2(-75), 0.0], [p2(-63), 0.0, -p2(-76), 0.0], p2(-126)),
        // a product of −2⁻¹⁴⁰ alone is flushed to −0 (the last step; +0 + −0 would be +0)
        ([0.0, 0.0, p2(-70), 0.0], [0.0, 0.0, -p2(-70), 0.0], -0.0),
        // a bf16 denormal input reads as zero even against a huge weight (1.5 otherwise), in
        // x or in w (the AVX2 kernel checks each side)
        ([f32::from_bits(0x0040_0000), 0.0, 1.0, 0.0], [p2(126), 0.0, 1.0, 0.0], 1.0),
        ([p2(126), 0.0, 1.0, 0.0], [f32::from_bits(0x0040_0000), 0.0, 1.0, 0.0], 1.0),
        // after 1: the odd element of a pair is added first, each sum rounded:
        // 1 − 1 = 0, + 2⁻³⁰ = 2⁻³⁰; and 1 + 2⁻³⁰ = 1, − 1 = 0 (one rounding would give 2⁻³⁰ both)
        ([1.0, 0.0, p2(-30), -1.0], [1.0, 0.0, 1.0, 1.0], p2(-30)),
        ([1.0, 0.0, -1.0, p2(-30)], [1.0, 0.0, 1.0, 1.0], 0.0),
        // exponents one short of `plain_fma_exact` (71 + 70): products on the grid of 2⁻¹²⁷
        // cancel to 2⁻¹²⁷, flushed to +0 (a plain FMA keeps the denormal)
        ([p2(-56) * (1.0 + p2(-7)), 0.0, -p2(-56), 0.0], [p2(-57) * (1.0 + p2(-7)), 0.0, p2(-57) * (1.0 + p2(-6)), 0.0], 0.0),
    ];
    for kernel in kernels() {
        for (x, w, want) in cases {
            let pw = PackedBf16::from_f32(w, 1, 4);
            let mut out = [7f32];
            matmul_bf16_with(x, &pw, None, 1, 4, 1, &mut out, kernel, false);
            assert_eq!(out[0].to_bits(), want.to_bits(), "{kernel:?} x {x:?} w {w:?}: {} vs {want}", out[0]);
        }
    }
    // random tiny operands: products around 2⁻¹²⁶, sums crossing the boundary all the time;
    // both sides tiny, or one side (then x or w alone must send the AVX2 kernel to the
    // portable steps)
    let mut rng = Rng::new(7);
    let (m, k, n) = (13, 301, 45);
    for (xs, ws) in [(-63, -63), (-64, -63), (-66, -63), (0, -126), (-126, 0)] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32 * p2(xs)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.normal() as f32 * p2(ws)).collect();
        let pw = PackedBf16::from_f32(&w, n, k);
        let wb: Vec<u16> = w.iter().map(|&v| f32_to_bf16_bits(v)).collect();
        let mut outs = vec![];
        for kernel in kernels() {
            let mut out = vec![0f32; m * n];
            matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, kernel, true);
            for i in 0..m {
                for j in 0..n {
                    let want = spec(&x[i * k..(i + 1) * k], |p| wb[j * k + p], None, None);
                    assert_eq!(out[i * n + j].to_bits(), want.to_bits(), "{kernel:?} 2^{xs}, 2^{ws} ({i},{j})");
                }
            }
            outs.push(out);
        }
        let zeros = outs[0].iter().filter(|v| **v == 0.0).count();
        assert!(zeros > 0 && zeros < m * n, "the case should mix flushed and kept sums ({zeros} zeros)");
    }
}

/// Random bit patterns (all exponents, specials, denormals; operands near 2⁻¹²⁶ half of the
/// time) through k = 4 (the first pair sets an arbitrary accumulator): native, portable and
/// `spec` agree bit for bit (NaN payloads aside).
#[test]
fn random_bits_match_spec() {
    let mut rng = Rng::new(9);
    let (m, k, n) = (12, 4, 64);
    let mut pick = |narrow: bool| {
        let b = rng.next_u64() as u32;
        let e = if narrow { 40 + (b >> 23) % 50 } else { (b >> 23) & 0xff };
        f32::from_bits((b & 0x807f_ffff) | e << 23)
    };
    for call in 0..600 {
        // 0: any exponent; 1: near 2⁻¹²⁶; 2: zeros and exponents ≥ 71 only, so the AVX2
        // kernel runs its plain FMAs (overflow, inf − inf, signed zeros included)
        let mode = call % 3;
        let mut draw = |_| {
            let v = pick(mode == 1);
            if mode != 2 || v.to_bits() & 0x7f80_0000 >= 71 << 23 {
                v
            } else if v.to_bits() & 0x10 == 0 {
                f32::from_bits(v.to_bits() & 0x8000_0000) // ±0
            } else {
                f32::from_bits(v.to_bits() | 71 << 23)
            }
        };
        let x: Vec<f32> = (0..m * k).map(&mut draw).collect();
        let w: Vec<f32> = (0..n * k).map(&mut draw).collect();
        let pw = PackedBf16::from_f32(&w, n, k);
        let wb: Vec<u16> = w.iter().map(|&v| f32_to_bf16_bits(v)).collect();
        for kernel in kernels() {
            let mut out = vec![0f32; m * n];
            matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, kernel, false);
            for i in 0..m {
                for j in 0..n {
                    let want = spec(&x[i * k..(i + 1) * k], |p| wb[j * k + p], None, None);
                    assert!(same_bits(out[i * n + j], want), "{kernel:?} x {:?} w {:?}: {} vs {want}", &x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k], out[i * n + j]);
                }
            }
        }
    }
}

/// One row with a bf16 denormal among normal rows (in the second of two row batches, too):
/// its strip takes the portable steps (the denormal reads as zero against a 2¹²⁶ weight,
/// 0.5 otherwise), the others the plain FMAs; the AVX2 kernel gives the portable bits on
/// 1–3 threads, forward and dx.
#[test]
fn a_tiny_row_among_normal_ones() {
    if !avx2_available() {
        eprintln!("note: no AVX2 on this CPU, the AVX2 kernel is not tested");
        return;
    }
    let mut rng = Rng::new(10);
    // 16 MiB / (3072 · 8 bytes) → row batches of 1356 rows in the AVX2 layout
    let (m, k, n) = (2800, 3072, 40);
    let mut x = normal(&mut rng, m * k);
    let mut w = normal(&mut rng, n * k);
    let mut dy = normal(&mut rng, m * n);
    w[3 * k + 5] = 2f32.powi(126);
    for r in [57, 1400] {
        x[r * k + 5] = f32::from_bits(0x0040_0000);
        dy[r * n + 3] = f32::from_bits(0x0040_0000);
    }
    let pw = PackedBf16::from_f32(&w, n, k);
    let (mut want, mut want_dx) = (vec![0f32; m * n], vec![0f32; m * k]);
    matmul_bf16_with(&x, &pw, None, m, k, n, &mut want, Kernel::Portable, true);
    matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut want_dx, false, Kernel::Portable, true);
    assert!(want[57 * n + 3].is_finite() && want_dx[57 * k + 5].is_finite());
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let (mut out, mut dx) = (vec![0f32; m * n], vec![0f32; m * k]);
            matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, Kernel::Avx2, true);
            matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, false, Kernel::Avx2, true);
            for (got, want, what) in [(&out, &want, "x·Wᵀ"), (&dx, &want_dx, "dy·W")] {
                let bad = got.iter().zip(want.iter()).position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(bad.is_none(), "{what}, {threads} threads: first difference at {bad:?}");
            }
        });
    }
}

/// NaN and ±inf: a NaN in a row of x makes that row NaN, a NaN in a row of W that column,
/// inf·0 is NaN; the rest stays finite. Same positions for both kernels and for dx.
#[test]
fn nan_and_inf_propagate() {
    let (m, k, n) = (5, 67, 40);
    let mut rng = Rng::new(8);
    let mut x = normal(&mut rng, m * k);
    let mut w = normal(&mut rng, n * k);
    x[k + 66] = f32::NAN; // row 1, the odd k's last element
    w[3 * k + 10] = f32::NAN; // column 3
    x[3 * k + 5] = f32::INFINITY; // row 3 · column 7 (zero there): NaN; elsewhere ±inf
    w[7 * k + 5] = 0.0;
    let pw = PackedBf16::from_f32(&w, n, k);
    let expect_nan = |i: usize, j: usize| i == 1 || j == 3 || (i == 3 && j == 7);
    for kernel in kernels() {
        let mut out = vec![0f32; m * n];
        matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, kernel, true);
        for i in 0..m {
            for j in 0..n {
                let v = out[i * n + j];
                assert_eq!(v.is_nan(), expect_nan(i, j), "{kernel:?} ({i},{j}) = {v}");
                if !expect_nan(i, j) {
                    assert_eq!(v.is_infinite(), i == 3, "{kernel:?} ({i},{j}) = {v}");
                }
            }
        }
        // dx = dy W: a NaN in W's row 3 reaches every dx row whose dy[·,3] is nonzero, in column 10
        let dy = normal(&mut rng, m * n);
        let mut dx = vec![0f32; m * k];
        matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, false, kernel, true);
        for i in 0..m {
            for p in 0..k {
                assert_eq!(dx[i * k + p].is_nan(), p == 10, "{kernel:?} dx ({i},{p})");
            }
        }
    }
}

/// Degenerate sizes: k = 0 (bias or zeros), n = 0 for dx (zeros or untouched), m = 0.
#[test]
fn degenerate_shapes() {
    let pw = PackedBf16::from_f32(&[], 3, 0);
    let mut out = vec![9f32; 6];
    matmul_bf16(&[], &pw, Some(&[1.0, 2.0, 3.0]), 2, 0, 3, &mut out);
    assert_eq!(out, [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    matmul_bf16(&[], &pw, None, 2, 0, 3, &mut out);
    assert_eq!(out, [0.0; 6]);
    let pw = PackedBf16::from_f32(&[], 0, 4);
    let mut dx = vec![5f32; 8];
    matmul_dx_bf16(&[], &pw, 2, 0, 4, &mut dx, true);
    assert_eq!(dx, [5.0; 8]);
    matmul_dx_bf16(&[], &pw, 2, 0, 4, &mut dx, false);
    assert_eq!(dx, [0.0; 8]);
    let pw = PackedBf16::from_f32(&[1.0; 12], 3, 4);
    matmul_bf16(&[], &pw, None, 0, 4, 3, &mut []);
}
