//! Float semantics of the PTX instructions the kernels use: IEEE operations with their rounding
//! modes (fused `fma` with one rounding; `mul`/`add` each rounded — the emulator never contracts,
//! so a kernel whose PTX still has unpinned `mul.f32`/`add.f32` pairs may round differently
//! once ptxas fuses them; `fma_contractible` counts those), and the approximate instructions
//! modelled by their exact value rounded to nearest, with the ISA's error bound stated beside each:
//! a test whose tolerance would not absorb that bound is claiming more than hardware delivers.
use super::ir::Rnd;

/// `ex2.approx.f32`: the PTX ISA gives a maximum relative error of 2^-22 over the full range
/// (about 2 ulp; `.ftz` flushes subnormal inputs and results to zero). Model: exact 2^x rounded.
pub fn ex2_approx(x: f32, ftz: bool) -> f32 {
    let x = if ftz && x.is_subnormal() { 0.0 } else { x };
    let r = (x as f64).exp2() as f32;
    if ftz && r.is_subnormal() {
        0.0f32.copysign(r)
    } else {
        r
    }
}

/// `lg2.approx.f32`: ISA bound 2^-22 absolute error for x in (0.5, 2), else 2^-22 relative.
pub fn lg2_approx(x: f32) -> f32 {
    (x as f64).log2() as f32
}

/// `rcp.approx.f32`: ISA bound 1 ulp. `rcp.approx.ftz.f64`: a ~23-bit seed (the ISA gives
/// a maximum relative error of about 2^-23); nvcc uses it only as the start of a Newton
/// iteration, which the model's exact seed converges from as well. Model: exact reciprocal.
pub fn rcp_approx_f32(x: f32) -> f32 {
    1.0 / x
}
pub fn rcp_approx_f64(x: f64) -> f64 {
    1.0 / x
}

/// `rsqrt.approx.f32`: ISA bound 2^-22.9 relative. Model: exact, rounded.
pub fn rsqrt_approx(x: f32) -> f32 {
    (1.0 / (x as f64).sqrt()) as f32
}

/// `sin.approx.f32` / `cos.approx.f32`: ISA bound 2^-20.9 absolute in [-π, π]. Model: exact, rounded.
pub fn sin_approx(x: f32) -> f32 {
    (x as f64).sin() as f32
}
pub fn cos_approx(x: f32) -> f32 {
    (x as f64).cos() as f32
}

/// Round the exact value `s + e` (|e| ≤ ulp(s)/2, from a TwoSum) to f32 in mode `rnd`.
pub fn round_pair_f32(s: f64, e: f64, rnd: Rnd) -> f32 {
    let f = s as f32;
    if !s.is_finite() || !f.is_finite() {
        return f;
    }
    // sign of (s + e) - f, exact enough: s - f is exact (Sterbenz) and e is tiny
    let diff = (s - f as f64) + e;
    match rnd {
        Rnd::Rm | Rnd::Ri('m') => {
            if diff < 0.0 {
                f.next_down()
            } else {
                f
            }
        }
        Rnd::Rp | Rnd::Ri('p') => {
            if diff > 0.0 {
                f.next_up()
            } else {
                f
            }
        }
        Rnd::Rz | Rnd::Ri('z') => {
            if f > 0.0 && diff < 0.0 {
                f.next_down()
            } else if f < 0.0 && diff > 0.0 {
                f.next_up()
            } else {
                f
            }
        }
        _ => {
            // nearest: s itself was rounded once to f64; a tie in f32 can only be broken
            // wrongly when e moves it, which the diff test catches
            let ulp_half = (f.next_up() as f64 - f as f64).abs() / 2.0;
            if diff.abs() > ulp_half || (diff.abs() == ulp_half && e != 0.0) {
                if diff > 0.0 {
                    f.next_up()
                } else {
                    f.next_down()
                }
            } else {
                f
            }
        }
    }
}

/// `fma.{rn,rz,rm,rp}.f32`: one rounding of the exact a·b + c.
pub fn fma_f32(a: f32, b: f32, c: f32, rnd: Rnd) -> f32 {
    match rnd {
        Rnd::Rn | Rnd::Default => a.mul_add(b, c),
        _ => {
            // a·b is exact in f64 (24 + 24 bits); TwoSum gives the exact sum as s + e
            let p = a as f64 * b as f64;
            let cf = c as f64;
            let s = p + cf;
            let bb = s - p;
            let e = (p - (s - bb)) + (cf - bb);
            if !s.is_finite() {
                return a.mul_add(b, c);
            }
            round_pair_f32(s, e, rnd)
        }
    }
}

/// `cvt.rni/rzi/rmi/rpi` of a float to an integer value (still a float).
pub fn round_int(x: f64, mode: char) -> f64 {
    match mode {
        'n' => x.round_ties_even(),
        'z' => x.trunc(),
        'm' => x.floor(),
        _ => x.ceil(),
    }
}

/// Float → integer of `bits` bits (signed or not): PTX saturates, NaN gives 0.
pub fn f_to_int(x: f64, mode: char, bits: u32, signed: bool) -> u64 {
    if x.is_nan() {
        return 0;
    }
    let r = round_int(x, mode);
    if signed {
        let (lo, hi) = (-(2f64.powi(bits as i32 - 1)), 2f64.powi(bits as i32 - 1) - 1.0);
        let v = if r <= lo { i64::MIN >> (64 - bits) } else if r >= hi { i64::MAX >> (64 - bits) } else { r as i64 };
        (v as u64) & mask(bits)
    } else {
        let hi = 2f64.powi(bits as i32) - 1.0;
        if r <= 0.0 {
            0
        } else if r >= hi {
            mask(bits)
        } else {
            r as u64
        }
    }
}

pub fn mask(bits: u32) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directed_fma_rounds_the_exact_value() {
        // 1 + 2^-30 is between 1 and next_up(1): rm gives 1, rp the next float
        let (a, b, c) = (1.0f32, 2f32.powi(-30), 1.0f32);
        assert_eq!(fma_f32(a, b, c, Rnd::Rm), 1.0);
        assert_eq!(fma_f32(a, b, c, Rnd::Rp), 1.0f32.next_up());
        assert_eq!(fma_f32(a, b, c, Rnd::Rn), 1.0);
        assert_eq!(fma_f32(-a, b, -c, Rnd::Rm), (-1.0f32).next_down());
        assert_eq!(fma_f32(-a, b, -c, Rnd::Rz), -1.0);
        // exact results are unchanged in every mode
        for r in [Rnd::Rm, Rnd::Rp, Rnd::Rz, Rnd::Rn] {
            assert_eq!(fma_f32(3.0, 0.5, 0.25, r), 1.75);
        }
    }

    #[test]
    fn float_to_int_saturates() {
        assert_eq!(f_to_int(3.5, 'n', 32, true), 4);
        assert_eq!(f_to_int(2.5, 'n', 32, true), 2);
        assert_eq!(f_to_int(-1e20, 'n', 32, true), i32::MIN as u32 as u64);
        assert_eq!(f_to_int(1e20, 'z', 32, false), u32::MAX as u64);
        assert_eq!(f_to_int(f64::NAN, 'z', 32, true), 0);
    }
}
