//! An independent oracle for the PTX interpreter's tensor-core instruction (tests only).
//!
//! This module once held hand-written lane-by-lane ports of the attention kernels and the
//! sampler, compared with the CPU twins while the interpreter could not run `mma.sync` and
//! `cp.async`. Now the kernels' real PTX runs on the emulated device against the same twins
//! (`tests/cuda_parity/attention.rs`, `attention_dense.rs`, `sample.rs`), so the ports are
//! retired: they duplicated the kernels' index math by hand and checked a copy, not the code a
//! GPU runs. Kept is `mma`, which assembles m16n8k16 operands from per-lane fragments by the
//! register-level layout written in `kernels/mma.cuh` — a description independent of the
//! per-element PTX ISA tables in `ptx/mma.rs`; `ptx/tests_mma_cp.rs` requires the two to agree
//! bit for bit, so a slip in either layout shows. Same arithmetic model as `ptx/mma.rs` (the 16
//! products added in k order in f32 onto the accumulator).

/// One lane's A fragment: 4 registers of two bf16 (low half first).
pub type AFrag = [[f32; 2]; 4];
/// One lane's B fragment: 2 registers of two bf16.
pub type BFrag = [[f32; 2]; 2];
/// One lane's C/D fragment: 4 f32.
pub type CFrag = [f32; 4];

/// `D += A·B` for one warp (m16n8k16), operands assembled from the lanes' fragments.
pub fn mma(d: &mut [CFrag; 32], a: &[AFrag; 32], b: &[BFrag; 32]) {
    let mut am = [[f32::NAN; 16]; 16];
    let mut bm = [[f32::NAN; 8]; 16];
    for lane in 0..32 {
        let (gid, tq) = (lane / 4, lane % 4);
        for reg in 0..4 {
            for h in 0..2 {
                am[gid + 8 * (reg & 1)][2 * tq + h + 8 * (reg >> 1)] = a[lane][reg][h];
            }
        }
        for reg in 0..2 {
            for h in 0..2 {
                bm[2 * tq + h + 8 * reg][gid] = b[lane][reg][h];
            }
        }
    }
    // every element owned by exactly one lane
    assert!(am.iter().flatten().chain(bm.iter().flatten()).all(|v| !v.is_nan()), "mma operand element not covered by any lane (or NaN input)");
    for (lane, dl) in d.iter_mut().enumerate() {
        let (gid, tq) = (lane / 4, lane % 4);
        for (idx, dv) in dl.iter_mut().enumerate() {
            let (row, col) = (gid + 8 * (idx >> 1), 2 * tq + (idx & 1));
            let mut s = *dv;
            for k in 0..16 {
                s += am[row][k] * bm[k][col];
            }
            *dv = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The emulated `mma` follows the documented ownership: A·B of known matrices.
    #[test]
    fn mma_fragment_layout() {
        let a: [[f32; 16]; 16] = std::array::from_fn(|r| std::array::from_fn(|c| (r * 16 + c) as f32 / 256.0));
        let b: [[f32; 8]; 16] = std::array::from_fn(|k| std::array::from_fn(|n| ((k * 8 + n) % 7) as f32 - 3.0));
        let af: [AFrag; 32] = std::array::from_fn(|lane| {
            let (gid, tq) = (lane / 4, lane % 4);
            // a0 = A[gid][2tq..], a1 = A[gid+8][2tq..], a2 = A[gid][2tq+8..], a3 = A[gid+8][2tq+8..]
            [[a[gid][2 * tq], a[gid][2 * tq + 1]], [a[gid + 8][2 * tq], a[gid + 8][2 * tq + 1]], [a[gid][2 * tq + 8], a[gid][2 * tq + 9]], [a[gid + 8][2 * tq + 8], a[gid + 8][2 * tq + 9]]]
        });
        let bfr: [BFrag; 32] = std::array::from_fn(|lane| {
            let (gid, tq) = (lane / 4, lane % 4);
            [[b[2 * tq][gid], b[2 * tq + 1][gid]], [b[2 * tq + 8][gid], b[2 * tq + 9][gid]]]
        });
        let mut d = [[0f32; 4]; 32];
        mma(&mut d, &af, &bfr);
        for (lane, dl) in d.iter().enumerate() {
            let (gid, tq) = (lane / 4, lane % 4);
            for (idx, &v) in dl.iter().enumerate() {
                let (r, c) = (gid + 8 * (idx >> 1), 2 * tq + (idx & 1));
                let want: f32 = (0..16).map(|k| a[r][k] * b[k][c]).sum();
                assert!((v - want).abs() < 1e-4, "lane {lane} c{idx}");
            }
        }
    }
}
