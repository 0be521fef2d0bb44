//! Conformance probes (kernels/conformance.cu): `ex2.approx`, `rcp.approx`, `rcp.rn`, the bf16
//! conversions and one `mma.sync.m16n8k16` tile on chosen inputs. On the emulated device the
//! results are checked against references written from the IEEE/PTX rules (the test below); on a
//! GPU (`tests/cuda_parity/conformance.rs`, run first by `tools/gpu-check.sh contact`) the same
//! launches are compared with the emulator's, bit by bit where the model claims exact results and
//! within each model's stated bound otherwise, and every difference is reported: the first GPU
//! minutes calibrate the emulator's models and so the parity tolerances built on them.
use super::CudaBackend;
use anyhow::{ensure, Result};
use half::bf16;
use std::fmt::Write as _;

/// The kernels of kernels/conformance.cu.
pub(super) const KERNELS: (&str, &[&str]) = ("conformance", &["conformance_scalar", "conformance_mma"]);

/// The probes of `conformance_scalar`, in its output order (`CONF_PROBES` there).
pub const PROBES: [&str; 6] = ["ex2.approx.f32", "ex2.approx.ftz.f32", "rcp.approx.f32", "rcp.rn.f32", "cvt.rn.bf16.f32", "cvt.f32.bf16"];

/// Inputs of the scalar probes (f32 bit patterns; `cvt.f32.bf16` reads each one's low 16 bits).
pub fn scalar_inputs() -> Vec<u32> {
    let mut v: Vec<u32> = vec![
        // signed zeros, infinities, NaNs (quiet with a payload, and a signalling pattern)
        0x0000_0000, 0x8000_0000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0001, 0x7f80_0001, 0xffc1_2345,
        // bf16 rounding: exact, ties to even (down and up), just above a tie, just below
        0x3f80_0000, 0x3f80_8000, 0x3f81_8000, 0x3f80_8001, 0x3f80_7fff, 0xbf81_8000,
        // overflow: f32 max rounds up to inf in bf16; the largest value that rounds down
        0x7f7f_ffff, 0x7f7f_7fff, 0xff7f_8000,
        // subnormals: smallest, a tie at the bottom, a tie that rounds up, largest (rounds to
        // the smallest normal); and the smallest normal
        0x0000_0001, 0x0000_8000, 0x0001_8000, 0x007f_ffff, 0x8000_8001, 0x0080_0000,
    ];
    // ex2: integers (exact powers of two), results in the subnormal range and past it, near overflow
    for x in [1.0f32, -1.0, 0.5, 10.0, -10.0, 127.0, 127.99, 128.0, -126.0, -126.5, -130.25, -149.0, -149.5, -150.0, 1e-7, -1e-7] {
        v.push(x.to_bits());
    }
    // rcp: powers of two, values whose reciprocal is subnormal or overflows, and ordinary values
    for x in [3.0f32, -7.0, 0.1, 2f32.powi(126), 2f32.powi(127), 1.5 * 2f32.powi(-127), 2f32.powi(-128)] {
        v.push(x.to_bits());
    }
    // a deterministic spread: ex2 over [-40, 40), rcp over magnitudes 2^-60..2^60
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..200 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let u = (s >> 40) as f32 / (1u64 << 24) as f32;
        v.push(if i % 2 == 0 { (u * 80.0 - 40.0).to_bits() } else { ((u * 2.0 - 1.0) * 2f32.powi((i % 121) as i32 - 60)).to_bits() });
    }
    v
}

/// One mma tile's operands: A 16×16 and Bᵀ 8×16 row-major bf16 bits, C 16×8 f32.
pub struct MmaCase {
    pub a: Vec<u16>,
    pub bt: Vec<u16>,
    pub c: Vec<f32>,
}

/// Row r holds +2^20 at k = r and −2^20 at k = (r + 8) mod 16 (so the positive one comes first in
/// rows 0-7, last in rows 8-15) and small terms elsewhere; B is 2^(n−4)·(1 or 1.5 by the parity
/// of k + n), equal at both big k. The big products cancel exactly, so the result is the small
/// terms plus C, and how much of them survives depends on the order and width of the f32
/// accumulation.
pub fn mma_case() -> MmaCase {
    let b16 = |x: f32| bf16::from_f32(x).to_bits();
    let mut a = vec![0u16; 256];
    for r in 0..16 {
        for k in 0..16 {
            let x = if k == r {
                2f32.powi(20)
            } else if k == (r + 8) % 16 {
                -(2f32.powi(20))
            } else {
                (1.0 + k as f32 / 16.0) * if (k + r) % 2 == 0 { 1.0 } else { -1.0 }
            };
            a[r * 16 + k] = b16(x);
        }
    }
    let mut bt = vec![0u16; 128];
    for n in 0..8 {
        for k in 0..16 {
            bt[n * 16 + k] = b16(2f32.powi(n as i32 - 4) * (1.0 + ((k + n) % 2) as f32 / 2.0));
        }
    }
    let c = (0..128).map(|i| ((i / 8) as f32 - 8.0) * 2f32.powi((i % 8) as i32 - 6)).collect();
    MmaCase { a, bt, c }
}

impl MmaCase {
    /// The exact D = A·B + C (f64: every product and the sum are exact at these magnitudes) and
    /// Σ|terms| per element.
    pub fn exact(&self) -> Vec<(f64, f64)> {
        let f = |b: u16| bf16::from_bits(b).to_f64();
        (0..128)
            .map(|i| {
                let (r, n) = (i / 8, i % 8);
                let terms: Vec<f64> = (0..16).map(|k| f(self.a[r * 16 + k]) * f(self.bt[n * 16 + k])).chain([self.c[i] as f64]).collect();
                (terms.iter().sum(), terms.iter().map(|t| t.abs()).sum())
            })
            .collect()
    }
}

/// The bound any f32 accumulation of the 17 terms meets, in whatever order, rounding or
/// truncating each partial sum: 17 · 2^-23 · Σ|terms| (Higham's γ_n with u = 2^-23 for
/// truncation). It says nothing about which order a GPU uses; the report shows that.
pub fn mma_bound(abs_sum: f64) -> f64 {
    17.0 * 2f64.powi(-23) * abs_sum
}

impl CudaBackend {
    /// Run `conformance_scalar` on `x` (f32 bits): per input, the raw result of each of `PROBES`.
    pub fn conformance_scalar(&self, x: &[u32]) -> Result<Vec<[u32; 6]>> {
        ensure!(!x.is_empty() && x.len() <= i32::MAX as usize / 6, "conformance: {} inputs", x.len());
        let _op = self.enter()?;
        let mut inp = self.alloc(x.len() * 4)?;
        self.htod(bytemuck::cast_slice(x), &mut inp)?;
        let out = self.alloc_zeroed(x.len() * 24)?;
        let (xp, n, op) = (inp.ptr(), x.len() as i32, out.ptr());
        launch!(self, "conformance_scalar", x.len().div_ceil(256), 256, xp, n, op)?;
        let raw: Vec<u32> = self.dtoh(out.ptr(), x.len() * 6)?;
        Ok(raw.chunks(6).map(|c| c.try_into().unwrap()).collect())
    }

    /// Run `conformance_mma` (one warp, one tile): D, 16×8 row-major.
    pub fn conformance_mma(&self, case: &MmaCase) -> Result<Vec<f32>> {
        ensure!(case.a.len() == 256 && case.bt.len() == 128 && case.c.len() == 128, "conformance: an mma case is 16×16, 8×16 and 16×8");
        let _op = self.enter()?;
        let up = |b: &[u8]| -> Result<super::alloc::DevMem> {
            let mut m = self.alloc(b.len())?;
            self.htod(b, &mut m)?;
            Ok(m)
        };
        let (a, bt, c) = (up(bytemuck::cast_slice(&case.a))?, up(bytemuck::cast_slice(&case.bt))?, up(bytemuck::cast_slice(&case.c))?);
        let d = self.alloc_zeroed(128 * 4)?;
        let (ap, bp, cp, dp) = (a.ptr(), bt.ptr(), c.ptr(), d.ptr());
        launch!(self, "conformance_mma", 1, 32, ap, bp, cp, dp)?;
        self.dtoh(d.ptr(), 128)
    }
}

/// How a device's result of probe `k` on input `x` compares with the reference result `want`
/// (the emulator's, or a rule's).
#[derive(Debug, PartialEq)]
pub enum Verdict {
    Equal,
    /// Both NaN, different bits (the NaN a conversion produces is not fixed by the model).
    NanBits,
    /// Different but within the model's stated bound (ulps apart, for the report).
    Within(u32),
    /// Outside the bound: what the model claims that the device did not do.
    Violation(String),
}

fn ulps(a: f32, b: f32) -> u32 {
    // distance on the ordered integer line of f32 bit patterns
    let key = |x: f32| if x.to_bits() >> 31 == 1 { -((x.to_bits() & 0x7fff_ffff) as i64) } else { x.to_bits() as i64 };
    (key(a) - key(b)).unsigned_abs().min(u32::MAX as u64) as u32
}

/// Compare `got` with `want` for probe `k` on input bits `x`. Exact claims: `rcp.rn` (IEEE),
/// the bf16 conversions (round to nearest even; a shift), and the special values of the
/// approximate instructions (±0, ±inf). Bounds (PTX ISA): `ex2.approx` relative error
/// 2^-22 (plus one subnormal ulp where the result is subnormal), `rcp.approx` 1 ulp.
pub fn judge(k: usize, x: u32, got: u32, want: u32) -> Verdict {
    if got == want {
        return Verdict::Equal;
    }
    let (g, w) = if k == 4 {
        (f32::from_bits(got << 16), f32::from_bits(want << 16))
    } else {
        (f32::from_bits(got), f32::from_bits(want))
    };
    if g.is_nan() && w.is_nan() {
        return Verdict::NanBits;
    }
    let xf = f32::from_bits(x);
    let special = w.is_infinite() || w == 0.0 || xf.is_infinite() || xf == 0.0 || xf.is_nan();
    let what = format!("{} of 0x{x:08x} ({xf:e}): device 0x{got:08x} ({g:e}), reference 0x{want:08x} ({w:e})", PROBES[k]);
    match k {
        0 | 1 if !special && !g.is_nan() => {
            let exact = (xf as f64).exp2();
            let exact = if k == 1 && exact < f32::MIN_POSITIVE as f64 { 0.0 } else { exact };
            let err = (g as f64 - exact).abs();
            let bound = 2f64.powi(-22) * exact + if exact < f32::MIN_POSITIVE as f64 { 2f64.powi(-149) } else { 0.0 };
            if err <= bound {
                Verdict::Within(ulps(g, w))
            } else {
                Verdict::Violation(format!("{what}: |error| {err:e} > 2^-22 relative bound {bound:e}"))
            }
        }
        2 if !special && !g.is_nan() => {
            let n = ulps(g, w);
            // the reference is the correctly rounded 1/x: 1 ulp from it is the ISA's bound
            if n <= 1 {
                Verdict::Within(n)
            } else {
                Verdict::Violation(format!("{what}: {n} ulps from the correctly rounded reciprocal (bound 1)"))
            }
        }
        _ => Verdict::Violation(format!("{what}: the model claims this result exactly")),
    }
}

/// Judge every result; a text report (one line per non-equal result, then counts per probe) and
/// the violations.
pub fn report(x: &[u32], got: &[[u32; 6]], want: &[[u32; 6]]) -> (String, Vec<String>) {
    let mut lines = String::new();
    let mut bad = Vec::new();
    let mut tally = [[0usize; 4]; 6];
    for (i, &xi) in x.iter().enumerate() {
        for k in 0..6 {
            let v = judge(k, xi, got[i][k], want[i][k]);
            let slot = match &v {
                Verdict::Equal => 0,
                Verdict::NanBits => 1,
                Verdict::Within(_) => 2,
                Verdict::Violation(_) => 3,
            };
            tally[k][slot] += 1;
            match v {
                Verdict::Equal => {}
                Verdict::NanBits => writeln!(lines, "  NaN bits differ: {} of 0x{xi:08x}: device 0x{:08x}, reference 0x{:08x}", PROBES[k], got[i][k], want[i][k]).unwrap(),
                Verdict::Within(n) => writeln!(lines, "  within bound: {} of 0x{xi:08x} ({:e}): device 0x{:08x}, reference 0x{:08x}, {n} ulp", PROBES[k], f32::from_bits(xi), got[i][k], want[i][k]).unwrap(),
                Verdict::Violation(s) => {
                    writeln!(lines, "  VIOLATION: {s}").unwrap();
                    bad.push(s);
                }
            }
        }
    }
    let mut s = String::new();
    for (k, t) in tally.iter().enumerate() {
        writeln!(s, "{:<20} {} inputs: {} equal, {} NaN bits differ, {} within bound, {} violations", PROBES[k], x.len(), t[0], t[1], t[2], t[3]).unwrap();
    }
    (s + &lines, bad)
}

/// The mma tile against the exact result and the reference (the emulator's tile, when it has
/// one): per element the device's error in units of the smallest term's magnitude, and
/// violations of `mma_bound`.
pub fn report_mma(case: &MmaCase, got: &[f32], reference: Option<&[f32]>) -> (String, Vec<String>) {
    let mut s = String::new();
    let mut bad = Vec::new();
    let (mut equal_exact, mut equal_ref) = (0, 0);
    for (i, &(exact, abs_sum)) in case.exact().iter().enumerate() {
        let g = got[i] as f64;
        let err = (g - exact).abs();
        if err > mma_bound(abs_sum) {
            bad.push(format!("mma D[{}][{}] = {g:e}, exact {exact:e}: error {err:e} > bound {:e}", i / 8, i % 8, mma_bound(abs_sum)));
        }
        equal_exact += (g == (exact as f32) as f64) as usize;
        if let Some(r) = reference {
            if r[i].to_bits() == got[i].to_bits() {
                equal_ref += 1;
            } else {
                writeln!(s, "  mma D[{}][{}]: device {:e}, reference {:e}, exact {exact:e} (device error {err:e}, reference error {:e})", i / 8, i % 8, got[i], r[i], (r[i] as f64 - exact).abs()).unwrap();
            }
        }
    }
    let head = format!(
        "mma.sync m16n8k16 bf16: {equal_exact}/128 equal to the exact result rounded once{}, {} outside the bound 17·2^-23·Σ|terms|\n",
        reference.map(|_| format!(", {equal_ref}/128 bit-equal to the reference")).unwrap_or_default(),
        bad.len()
    );
    (head + &s, bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emulated() -> Option<CudaBackend> {
        CudaBackend::emulated().map_err(|e| println!("skipped: {e}")).ok()
    }

    /// bf16 round-to-nearest-even written from the rule (not half's): add 0x7fff plus the
    /// lowest kept bit, truncate. NaN is checked separately.
    fn rne_bf16(x: u32) -> u32 {
        (x + 0x7fff + ((x >> 16) & 1)) >> 16
    }

    /// The emulator's results against the rules: every scalar probe on every input is exact
    /// where the ISA fixes the result and within its bound elsewhere; a few by value.
    #[test]
    fn emulated_probes_follow_the_ptx_rules() {
        let Some(be) = emulated() else { return };
        let x = scalar_inputs();
        let got = be.conformance_scalar(&x).unwrap();
        let rule: Vec<[u32; 6]> = x
            .iter()
            .map(|&b| {
                let f = f32::from_bits(b);
                let ex2 = (f as f64).exp2() as f32;
                let ex2_ftz = if ex2.is_subnormal() || f.is_subnormal() { if f.is_subnormal() { 1.0f32.to_bits() } else { 0 } } else { ex2.to_bits() };
                let lo = b & 0xffff;
                [ex2.to_bits(), ex2_ftz, (1.0 / f).to_bits(), (1.0 / f).to_bits(), if f.is_nan() { 0x7fc0 } else { rne_bf16(b) }, lo << 16]
            })
            .collect();
        let (text, bad) = report(&x, &got, &rule);
        println!("{text}");
        assert!(bad.is_empty(), "{bad:#?}");
        let at = |bits: u32| x.iter().position(|&v| v == bits).unwrap();
        // ties to even, down and up; just above a tie; overflow; the subnormal ties
        assert_eq!(got[at(0x3f80_8000)][4], 0x3f80);
        assert_eq!(got[at(0x3f81_8000)][4], 0x3f82);
        assert_eq!(got[at(0x3f80_8001)][4], 0x3f81);
        assert_eq!(got[at(0x7f7f_ffff)][4], 0x7f80);
        assert_eq!(got[at(0x7f7f_7fff)][4], 0x7f7f);
        assert_eq!(got[at(0x0000_8000)][4], 0x0000);
        assert_eq!(got[at(0x0001_8000)][4], 0x0002);
        assert_eq!(got[at(0x007f_ffff)][4], 0x0080);
        // ex2 of integers is exact; of -150 underflows to 0; ftz flushes a subnormal result
        assert_eq!(got[at(10f32.to_bits())][0], 1024f32.to_bits());
        assert_eq!(got[at((-150f32).to_bits())][0], 0);
        assert_eq!(got[at((-130.25f32).to_bits())][1], 0);
        assert!(f32::from_bits(got[at((-130.25f32).to_bits())][0]).is_subnormal());
        // rcp of ±0 and ±inf
        assert_eq!(got[at(0x8000_0000)][3], f32::NEG_INFINITY.to_bits());
        assert_eq!(got[at(0x7f80_0000)][2], 0);
    }

    /// The judge itself: the bounds bite where they should.
    #[test]
    fn the_judge_separates_bounds_from_claims() {
        let one = 1.0f32.to_bits();
        assert_eq!(judge(3, 3f32.to_bits(), one, one), Verdict::Equal);
        assert!(matches!(judge(3, 3f32.to_bits(), one + 1, one), Verdict::Violation(_)), "rcp.rn is exact");
        assert_eq!(judge(2, 3f32.to_bits(), (1.0f32 / 3.0).to_bits() + 1, (1.0f32 / 3.0).to_bits()), Verdict::Within(1));
        assert!(matches!(judge(2, 3f32.to_bits(), (1.0f32 / 3.0).to_bits() + 2, (1.0f32 / 3.0).to_bits()), Verdict::Violation(_)));
        // ex2(0.5): 2 ulp of 2^-22 relative is inside, 8 ulp is not
        let w = 0.5f32.exp2().to_bits();
        assert_eq!(judge(0, 0.5f32.to_bits(), w + 2, w), Verdict::Within(2));
        assert!(matches!(judge(0, 0.5f32.to_bits(), w + 8, w), Verdict::Violation(_)));
        assert_eq!(judge(4, 0x7fc0_0001, 0x7fff, 0x7fc0), Verdict::NanBits);
        assert!(matches!(judge(4, 0x3f80_8000, 0x3f81, 0x3f80), Verdict::Violation(_)));
    }

    /// The mma tile: needs the interpreter's `mma.sync` (branch emu-mma, issue 54); until it is
    /// there the launch is refused by name and this test says so.
    #[test]
    fn emulated_mma_tile_meets_the_accumulation_bound() {
        let Some(be) = emulated() else { return };
        let case = mma_case();
        if let Some(why) = be.emulator_unsupported("conformance_mma") {
            assert!(why.contains("mma.sync"), "{why}");
            println!("skipped: the interpreter has no mma.sync yet (branch emu-mma): {why}");
            return;
        }
        be.emulator_reset_counters();
        let got = be.conformance_mma(&case).unwrap();
        let k = &be.emulator_counters().unwrap()["conformance_mma"];
        assert_eq!((k.launches, k.counters.mma), (1, 1), "one warp, one tensor-core issue");
        let (text, bad) = report_mma(&case, &got, None);
        println!("{text}");
        assert!(bad.is_empty(), "{bad:#?}");
        // the cancellation is real: the exact results are small next to the big products
        assert!(case.exact().iter().all(|&(e, s)| e.abs() < s * 1e-3));
    }
}
