//! ggml tensor types and their dequantization to f32: F32, F16, BF16, Q4_0, Q4_1 and Q8_0 with
//! ggml's block layouts and ggml's own float32 arithmetic (so the result is bit-identical to
//! `gguf-py`/transformers). Any other type is refused, named by `ggml_type_name`.
use anyhow::{bail, Result};

/// The ggml tensor types this reader dequantizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
}

impl GgmlType {
    /// The supported type with this ggml number, if any.
    pub fn from_u32(t: u32) -> Option<GgmlType> {
        Some(match t {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }
    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => 32,
        }
    }
    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q8_0 => 2 + 32,
        }
    }
}

/// ggml's name for a type number, for error messages.
pub(super) fn ggml_type_name(t: u32) -> &'static str {
    const NAMES: &[&str] = &[
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2 (removed)",
        "Q4_3 (removed)",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4 (removed)",
        "Q4_0_4_8 (removed)",
        "Q4_0_8_8 (removed)",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4 (removed)",
        "IQ4_NL_4_8 (removed)",
        "IQ4_NL_8_8 (removed)",
        "MXFP4",
    ];
    NAMES.get(t as usize).copied().unwrap_or("unknown")
}

pub(super) const SUPPORTED_TYPES_MSG: &str =
    "supported: F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), Q8_0 (8), BF16 (30)";

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantize `out.len()` elements of type `ty` from `data` (exactly the tensor's bytes).
///
/// The arithmetic is ggml's: f16 scales widened to f32, then `d*q` (Q8_0), `d*(q-8)` (Q4_0) or
/// `d*q + m` (Q4_1) in f32, one rounding per operation (no fused multiply-add).
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let n = out.len();
    let be = ty.block_elems();
    if n % be != 0 {
        bail!("{n} elements is not a multiple of the {ty:?} block size {be}");
    }
    let need = n / be * ty.block_bytes();
    if data.len() != need {
        bail!(
            "{ty:?} data is {} bytes, expected {need} for {n} elements",
            data.len()
        );
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(18)) {
                let d = f16_at(b, 0);
                let qs = &b[2..18];
                for j in 0..16 {
                    o[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
                    o[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let qs = &b[4..20];
                for j in 0..16 {
                    o[j] = (qs[j] & 0x0F) as f32 * d + m;
                    o[j + 16] = (qs[j] >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    o[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::test_builders::{h, q4_1, q8_0};

    #[test]
    fn dequant_q4_1_layout() {
        let mut q = [0u8; 32];
        for (j, x) in q.iter_mut().enumerate() {
            *x = ((j * 7) % 16) as u8;
        }
        let raw = q4_1(&[(0.5, -1.25, q)]);
        // Nibble placement: byte j holds value j (low) and value j+16 (high).
        assert_eq!(raw[4], q[0] | (q[16] << 4));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &raw, &mut out).unwrap();
        for j in 0..32 {
            assert_eq!(out[j], q[j] as f32 * 0.5 - 1.25, "j={j}");
        }
    }

    #[test]
    fn dequant_q8_0_q4_0_f16_bf16() {
        let mut q = [0i8; 32];
        for (j, x) in q.iter_mut().enumerate() {
            *x = (j as i32 * 9 - 128) as i8;
        }
        let raw = q8_0(&[(0.25, q), (-2.0, q)]);
        let mut out = [0f32; 64];
        dequantize(GgmlType::Q8_0, &raw, &mut out).unwrap();
        for j in 0..32 {
            assert_eq!(out[j], q[j] as f32 * 0.25);
            assert_eq!(out[32 + j], q[j] as f32 * -2.0);
        }

        let mut raw = h(0.5).to_vec();
        for j in 0..16u8 {
            raw.push(j | ((15 - j) << 4));
        }
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &raw, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], ((15 - j) as f32 - 8.0) * 0.5);
        }

        let vals = [1.5f32, -0.125, 65504.0];
        let raw: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
        let mut out = [0f32; 3];
        dequantize(GgmlType::F16, &raw, &mut out).unwrap();
        assert_eq!(out, vals);
        let raw: Vec<u8> = vals
            .iter()
            .flat_map(|&v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        dequantize(GgmlType::BF16, &raw, &mut out).unwrap();
        assert_eq!(out, [1.5, -0.125, 65280.0]);

        // Wrong byte count is an error, not a panic.
        assert!(dequantize(GgmlType::Q8_0, &raw, &mut [0f32; 32]).is_err());
    }
}
