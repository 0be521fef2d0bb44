//! `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: D = A·B + C for one warp, A 16×16
//! bf16, B 16×8 bf16, C and D 16×8 f32, each matrix spread over the 32 lanes' registers.
//!
//! **Fragments**, written from the PTX ISA's tables ("Matrix Fragments for mma.m16n8k16 with
//! floating point type"), not from `kernels/mma.cuh` or `emulate/`, so that each checks the
//! other. groupID = laneid >> 2, threadID_in_group = laneid % 4; a register holds two bf16,
//! the lower-indexed element in the low 16 bits:
//! - A: a0..a7 in 4 registers (a_i in register i / 2); row = groupID for a_i with i < 2 or
//!   4 ≤ i < 6, groupID + 8 otherwise; col = threadID_in_group·2 + (i & 1), + 8 for i ≥ 4.
//! - B: b0..b3 in 2 registers; row = threadID_in_group·2 + (i & 1), + 8 for i ≥ 2; col = groupID.
//! - C, D: c0..c3 in 4 f32 registers; row = groupID for i < 2, groupID + 8 otherwise;
//!   col = threadID_in_group·2 + (i & 1).
//!
//! **Arithmetic model** (the hardware's internal order and rounding are not documented):
//! each product a·b is exact in f32 (bf16 × bf16 has at most 16 significant bits ≤ f32's 24,
//! and bf16 has f32's exponent range, so only products beyond f32's range or below its normal
//! range round); D = (((c + p_0) + p_1) + … + p_15), 16 additions in k order, each rounded to
//! nearest even in f32 with IEEE subnormals, inf and NaN. Its error against the exact
//! value is at most γ_16·(|c| + Σ_k |p_k|) with γ_16 = 16u/(1 − 16u), u = 2^-24 (Higham, Accuracy
//! and Stability of Numerical Algorithms, §4.2, recursive summation), i.e. < 9.6e-7 of the
//! absolute sum; an exactly rounded sum would err by u·|D|. Measurements of real tensor cores
//! (Fasi, Higham, Mikaitis, Pranesh 2021, "Numerical behavior of NVIDIA tensor cores") found a
//! different scheme — products exact, then a multi-operand sum aligned to the largest exponent
//! and truncated — whose error is of the same order; until a GPU calibrates it, bounds in the
//! tests that depend on the order must cover both (the parity tests' bf16-level bounds, ~2^-8,
//! are 10^4 times larger).
/// (row, col) of A element `i` (0..8) held by `lane`.
pub fn a_elem(lane: usize, i: usize) -> (usize, usize) {
    let (group, tig) = (lane >> 2, lane % 4);
    let row = if i < 2 || (4..6).contains(&i) { group } else { group + 8 };
    let col = tig * 2 + (i & 1) + if i >= 4 { 8 } else { 0 };
    (row, col)
}

/// (row, col) of B element `i` (0..4) held by `lane`.
pub fn b_elem(lane: usize, i: usize) -> (usize, usize) {
    let (group, tig) = (lane >> 2, lane % 4);
    let row = tig * 2 + (i & 1) + if i >= 2 { 8 } else { 0 };
    (row, group)
}

/// (row, col) of C/D element `i` (0..4) held by `lane`.
pub fn c_elem(lane: usize, i: usize) -> (usize, usize) {
    let (group, tig) = (lane >> 2, lane % 4);
    let row = if i < 2 { group } else { group + 8 };
    (row, tig * 2 + (i & 1))
}

fn bf16_at(reg: u64, half: usize) -> f32 {
    f32::from_bits((((reg >> (16 * half)) & 0xffff) as u32) << 16)
}

/// The warp's D registers from its A, B (bf16 pairs) and C (f32 bits) registers, lane-indexed.
pub fn mma_m16n8k16_bf16(a: &[[u64; 4]; 32], b: &[[u64; 2]; 32], c: &[[u64; 4]; 32]) -> [[u64; 4]; 32] {
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    let mut cm = [[0f32; 8]; 16];
    for lane in 0..32 {
        for i in 0..8 {
            let (r, k) = a_elem(lane, i);
            am[r][k] = bf16_at(a[lane][i / 2], i % 2);
        }
        for i in 0..4 {
            let (k, n) = b_elem(lane, i);
            bm[k][n] = bf16_at(b[lane][i / 2], i % 2);
        }
        for i in 0..4 {
            let (r, n) = c_elem(lane, i);
            cm[r][n] = f32::from_bits(c[lane][i] as u32);
        }
    }
    let mut d = [[0u64; 4]; 32];
    for (lane, dl) in d.iter_mut().enumerate() {
        for (i, di) in dl.iter_mut().enumerate() {
            let (r, n) = c_elem(lane, i);
            let mut s = cm[r][n];
            for k in 0..16 {
                s += am[r][k] * bm[k][n]; // the product is exact (see the module doc): one rounding per step
            }
            *di = s.to_bits() as u64;
        }
    }
    d
}
