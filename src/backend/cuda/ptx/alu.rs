//! Per-lane arithmetic of the interpreter: the integer, predicate and float semantics of the
//! ALU instructions, conversions and comparisons, on register bits (a u64 holding the value
//! zero-extended). Float rounding modes and the approximate instructions are in `float.rs`.
use super::float::{self, mask};
use super::ir::{BinOp, Cmp, Rnd, Ty, UnOp};
use anyhow::{bail, Result};

#[inline(always)]
pub(super) fn sext(v: u64, bits: u32) -> i64 {
    if bits >= 64 {
        v as i64
    } else {
        ((v << (64 - bits)) as i64) >> (64 - bits)
    }
}

#[inline(always)]
fn f32b(v: u64) -> f32 {
    f32::from_bits(v as u32)
}

pub(super) fn unary(op: UnOp, ty: Ty, ftz: bool, x: u64) -> u64 {
    let bits = ty.bits();
    match (op, ty) {
        (UnOp::Mov, _) => x & mask(bits.max(if ty == Ty::Pred { 1 } else { bits })),
        (UnOp::Neg, Ty::F32) => (x ^ 0x8000_0000) & 0xffff_ffff,
        (UnOp::Neg, Ty::F64) => x ^ (1 << 63),
        (UnOp::Neg, _) => (x as i64).wrapping_neg() as u64 & mask(bits),
        (UnOp::Abs, Ty::F32) => x & 0x7fff_ffff,
        (UnOp::Abs, Ty::F64) => x & !(1 << 63),
        (UnOp::Abs, _) => sext(x, bits).unsigned_abs() & mask(bits),
        (UnOp::Not, Ty::Pred) => (x == 0) as u64,
        (UnOp::Not, _) => !x & mask(bits),
        (UnOp::Sqrt, Ty::F32) => f32b(x).sqrt().to_bits() as u64,
        (UnOp::Sqrt, _) => f64::from_bits(x).sqrt().to_bits(),
        (UnOp::Rcp, Ty::F32) => (1.0 / f32b(x)).to_bits() as u64,
        (UnOp::Rcp, _) => (1.0 / f64::from_bits(x)).to_bits(),
        (UnOp::RcpApprox, Ty::F32) => float::rcp_approx_f32(f32b(x)).to_bits() as u64,
        (UnOp::RcpApprox, _) => float::rcp_approx_f64(f64::from_bits(x)).to_bits(),
        (UnOp::Ex2Approx, _) => float::ex2_approx(f32b(x), ftz).to_bits() as u64,
        (UnOp::Lg2Approx, _) => float::lg2_approx(f32b(x)).to_bits() as u64,
        (UnOp::RsqrtApprox, _) => float::rsqrt_approx(f32b(x)).to_bits() as u64,
        (UnOp::SinApprox, _) => float::sin_approx(f32b(x)).to_bits() as u64,
        (UnOp::CosApprox, _) => float::cos_approx(f32b(x)).to_bits() as u64,
        (UnOp::Popc, _) => (x & mask(bits)).count_ones() as u64,
        (UnOp::Clz, _) => ((x & mask(bits)).leading_zeros() - (64 - bits)) as u64,
        (UnOp::Brev, _) => (x.reverse_bits() >> (64 - bits)) & mask(bits),
    }
}

/// `None`: integer division by zero.
pub(super) fn binary(op: BinOp, ty: Ty, _rnd: Rnd, x: u64, y: u64) -> Option<u64> {
    let bits = ty.bits();
    let m = mask(bits);
    Some(match ty {
        Ty::F32 => {
            let (a, b) = (f32b(x), f32b(y));
            (match op {
                BinOp::Add => a + b,
                BinOp::Sub => a - b,
                BinOp::MulLo => a * b,
                BinOp::Div => a / b,
                BinOp::Min => a.min(b),
                BinOp::Max => a.max(b),
                _ => return int_binary(op, ty, x, y),
            })
            .to_bits() as u64
        }
        Ty::F64 => {
            let (a, b) = (f64::from_bits(x), f64::from_bits(y));
            (match op {
                BinOp::Add => a + b,
                BinOp::Sub => a - b,
                BinOp::MulLo => a * b,
                BinOp::Div => a / b,
                BinOp::Min => a.min(b),
                BinOp::Max => a.max(b),
                _ => return int_binary(op, ty, x, y),
            })
            .to_bits()
        }
        Ty::Pred => match op {
            BinOp::And => x & y,
            BinOp::Or => x | y,
            BinOp::Xor => x ^ y,
            _ => 0,
        },
        _ => return int_binary(op, ty, x, y).map(|v| v & if op == BinOp::MulWide { mask(bits * 2) } else { m }),
    })
}

fn int_binary(op: BinOp, ty: Ty, x: u64, y: u64) -> Option<u64> {
    let bits = ty.bits();
    let m = mask(bits);
    let (x, y) = (x & m, y & m);
    let (sx, sy) = (sext(x, bits), sext(y, bits));
    let s = ty.signed();
    Some(match op {
        BinOp::Add => x.wrapping_add(y),
        BinOp::Sub => x.wrapping_sub(y),
        BinOp::MulLo => x.wrapping_mul(y),
        BinOp::MulWide => {
            if s {
                sx.wrapping_mul(sy) as u64
            } else {
                x.wrapping_mul(y)
            }
        }
        BinOp::MulHi => {
            if s {
                ((sx as i128 * sy as i128) >> bits) as u64
            } else {
                ((x as u128 * y as u128) >> bits) as u64
            }
        }
        BinOp::Div => {
            if y == 0 {
                return None;
            }
            if s {
                sx.wrapping_div(sy) as u64
            } else {
                x / y
            }
        }
        BinOp::Rem => {
            if y == 0 {
                return None;
            }
            if s {
                sx.wrapping_rem(sy) as u64
            } else {
                x % y
            }
        }
        BinOp::Min => {
            if s {
                sx.min(sy) as u64
            } else {
                x.min(y)
            }
        }
        BinOp::Max => {
            if s {
                sx.max(sy) as u64
            } else {
                x.max(y)
            }
        }
        BinOp::And => x & y,
        BinOp::Or => x | y,
        BinOp::Xor => x ^ y,
        BinOp::Shl => {
            let k = y & 0xffff_ffff;
            if k >= bits as u64 {
                0
            } else {
                x << k
            }
        }
        BinOp::Shr => {
            let k = (y & 0xffff_ffff).min(bits as u64 - 1 + (!s) as u64);
            if s {
                (sx >> k.min(63)) as u64
            } else if k >= bits as u64 {
                0
            } else {
                x >> k
            }
        }
    })
}

pub(super) fn compare(cmp: Cmp, ty: Ty, x: u64, y: u64) -> bool {
    use std::cmp::Ordering::*;
    if ty.float() {
        let (a, b) = if ty == Ty::F32 { (f32b(x) as f64, f32b(y) as f64) } else { (f64::from_bits(x), f64::from_bits(y)) };
        let nan = a.is_nan() || b.is_nan();
        return match cmp {
            Cmp::Eq => !nan && a == b,
            Cmp::Ne => !nan && a != b,
            Cmp::Lt => !nan && a < b,
            Cmp::Le => !nan && a <= b,
            Cmp::Gt => !nan && a > b,
            Cmp::Ge => !nan && a >= b,
            Cmp::Equ => nan || a == b,
            Cmp::Neu => nan || a != b,
            Cmp::Ltu => nan || a < b,
            Cmp::Leu => nan || a <= b,
            Cmp::Gtu => nan || a > b,
            Cmp::Geu => nan || a >= b,
            Cmp::Num => !nan,
            Cmp::Nan => nan,
        };
    }
    let bits = ty.bits();
    let o = if ty.signed() { sext(x, bits).cmp(&sext(y, bits)) } else { (x & mask(bits)).cmp(&(y & mask(bits))) };
    match cmp {
        Cmp::Eq | Cmp::Equ => o == Equal,
        Cmp::Ne | Cmp::Neu => o != Equal,
        Cmp::Lt | Cmp::Ltu => o == Less,
        Cmp::Le | Cmp::Leu => o != Greater,
        Cmp::Gt | Cmp::Gtu => o == Greater,
        Cmp::Ge | Cmp::Geu => o != Less,
        Cmp::Num => true,
        Cmp::Nan => false,
    }
}

/// `cvt.dty.sty` with its rounding / saturation.
pub(super) fn convert(dty: Ty, sty: Ty, rnd: Rnd, sat: bool, ftz: bool, x: u64) -> Result<u64> {
    let src_f: Option<f64> = match sty {
        Ty::F32 => {
            let v = f32b(x);
            Some(if ftz && v.is_subnormal() { 0.0 } else { v as f64 })
        }
        Ty::F64 => Some(f64::from_bits(x)),
        Ty::Bf16 => Some(f32::from_bits(((x & 0xffff) as u32) << 16) as f64),
        Ty::F16 => Some(half::f16::from_bits(x as u16).to_f64()),
        _ => None,
    };
    let sat01 = |v: f64| if v.is_nan() { 0.0 } else { v.clamp(0.0, 1.0) };
    Ok(match (dty.float(), src_f) {
        // float → float
        (true, Some(v)) => {
            let v = if let Rnd::Ri(mode) = rnd { float::round_int(v, mode) } else { v };
            let v = if sat { sat01(v) } else { v };
            match dty {
                Ty::F32 => {
                    let r = match rnd {
                        Rnd::Rn | Rnd::Default | Rnd::Ri(_) => v as f32,
                        _ => float::round_pair_f32(v, 0.0, rnd),
                    };
                    let r = if ftz && r.is_subnormal() { 0.0f32.copysign(r) } else { r };
                    r.to_bits() as u64
                }
                Ty::F64 => v.to_bits(),
                Ty::Bf16 => {
                    if !matches!(rnd, Rnd::Rn) {
                        bail!("cvt to bf16 other than .rn is not modelled");
                    }
                    // f64 → f32 first is exact for the f32 sources nvcc converts
                    half::bf16::from_f32(v as f32).to_bits() as u64
                }
                Ty::F16 => half::f16::from_f64(v).to_bits() as u64,
                _ => unreachable!(),
            }
        }
        // float → int
        (false, Some(v)) => {
            let mode = match rnd {
                Rnd::Ri(m) => m,
                _ => bail!("float→integer cvt needs an integer rounding (.rni/.rzi/.rmi/.rpi)"),
            };
            float::f_to_int(v, mode, dty.bits(), dty.signed())
        }
        // int → float
        (true, None) => {
            let v = if sty.signed() { sext(x, sty.bits()) as f64 } else { (x & mask(sty.bits())) as f64 };
            // i64 → f64 / f32 through `as` rounds to nearest; other modes are not used
            let exact_i = if sty.signed() { sext(x, sty.bits()) as i128 } else { (x & mask(sty.bits())) as i128 };
            if !matches!(rnd, Rnd::Rn | Rnd::Default) {
                bail!("int→float cvt with rounding other than .rn is not modelled");
            }
            match dty {
                Ty::F32 => (if sty.signed() { exact_i as i64 as f32 } else { exact_i as u64 as f32 }).to_bits() as u64,
                Ty::F64 => (if sty.signed() { exact_i as i64 as f64 } else { exact_i as u64 as f64 }).to_bits(),
                Ty::Bf16 => half::bf16::from_f32(v as f32).to_bits() as u64,
                _ => bail!("int→{dty:?} cvt is not modelled"),
            }
        }
        // int → int: the source's width and signedness decide the extension
        (false, None) => {
            if sat {
                bail!("saturating integer cvt is not modelled");
            }
            let v = if sty.signed() { sext(x, sty.bits()) as u64 } else { x & mask(sty.bits()) };
            v & mask(dty.bits())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_semantics() {
        assert_eq!(binary(BinOp::MulWide, Ty::S32, Rnd::Default, (-3i32) as u32 as u64, 5).unwrap(), (-15i64) as u64);
        assert_eq!(binary(BinOp::Shr, Ty::S32, Rnd::Default, 0x8000_0000, 40).unwrap(), 0xffff_ffff);
        assert_eq!(binary(BinOp::Shl, Ty::B32, Rnd::Default, 1, 32).unwrap(), 0);
        assert!(binary(BinOp::Div, Ty::U32, Rnd::Default, 1, 0).is_none());
        assert_eq!(convert(Ty::S64, Ty::S32, Rnd::Default, false, false, 0xffff_fffe).unwrap(), (-2i64) as u64);
        assert_eq!(convert(Ty::S32, Ty::S8, Rnd::Default, false, false, 0x80).unwrap(), 0xffff_ff80);
        assert!(compare(Cmp::Lt, Ty::S32, 0xffff_ffff, 0));
        assert!(!compare(Cmp::Lt, Ty::U32, 0xffff_ffff, 0));
    }

    #[test]
    fn float_semantics() {
        let nan = f32::NAN.to_bits() as u64;
        assert!(!compare(Cmp::Ne, Ty::F32, nan, 0));
        assert!(compare(Cmp::Neu, Ty::F32, nan, 0));
        // bf16 rounding to nearest even
        assert_eq!(convert(Ty::Bf16, Ty::F32, Rnd::Rn, false, false, 0x3f80_8000).unwrap(), 0x3f80);
        assert_eq!(convert(Ty::Bf16, Ty::F32, Rnd::Rn, false, false, 0x3f81_8000).unwrap(), 0x3f82);
        assert_eq!(convert(Ty::F32, Ty::Bf16, Rnd::Default, false, false, 0x3f82).unwrap(), 0x3f82_0000);
        assert_eq!(f32::from_bits(convert(Ty::F32, Ty::F32, Rnd::Default, true, false, 2.5f32.to_bits() as u64).unwrap() as u32), 1.0);
        assert_eq!(convert(Ty::S32, Ty::F32, Rnd::Ri('n'), false, false, 2.5f32.to_bits() as u64).unwrap(), 2);
    }
}
