//! The AMX microkernel (`tdpbf16ps`: per output element and 16-pair step, the 32 products of a
//! tile row with a tile column summed into the f32 accumulator; the hardware's order and internal
//! precision are not those of `vdpbf16ps`, so AMX results differ from the other kernels' in the
//! last bits, measured within the same bf16 bounds; each element's operations still do not depend
//! on the other rows, so batches equal their rows one by one). Stable Rust has no AMX intrinsics:
//! the instructions are written as inline assembly; the tile registers are not known to the
//! compiler, which never uses them.
use super::pack::{AMX_MR, NR};
use std::arch::asm;

/// The 32 × 32 f32 sums of one strip and panel (row stride NR).
#[repr(C, align(64))]
pub struct Sums(pub [f32; AMX_MR * NR]);

#[repr(C, align(64))]
struct TileCfg {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Palette 1, tiles 0–7 each 16 rows × 64 bytes: tmm0–3 the sums (rows 0–15 / 16–31 × columns
/// 0–15 / 16–31), tmm4–5 A (16 rows × 16 pairs), tmm6–7 the panel's column halves (16 pairs
/// × 16 columns). Per thread; `task` calls it before its first block.
pub unsafe fn configure() {
    let mut cfg = TileCfg { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    for t in 0..8 {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileCfg, options(nostack, readonly));
}

/// Drop the tile state (a thread without it has smaller context switches and signal frames).
pub unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem));
}

/// `sums = A[32 rows at a] · panel[kb pairs at b]` for one k block (kb a multiple of 16). A's
/// rows are `lda` words apart, and its 16-pair steps `astep` words apart: row-major A has
/// (lda, astep) = (pairs, 16), the GEMM's tile layout (16, TILE_STEP). B tiles load straight
/// from the packed panel (a pair row is NR words = 128 bytes; its two 16-column halves are the
/// two B tiles).
pub unsafe fn block(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, sums: &mut Sums) {
    block_to(a, lda, astep, b, kb, sums.0.as_mut_ptr(), NR);
}

/// `block` storing the 32 × 32 sums at `c` (row stride `ldc` f32), all 32 rows and columns.
pub unsafe fn block_to(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, c: *mut f32, ldc: usize) {
    block_into::<false>(a, lda, astep, b, kb, c, ldc);
}

/// `block_to` adding the sums to the 32 × 32 block at `c` instead: the tiles start from C's
/// values (loaded), so no separate pass reads the sums back to add them.
pub unsafe fn block_add(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, c: *mut f32, ldc: usize) {
    block_into::<true>(a, lda, astep, b, kb, c, ldc);
}

#[inline(always)]
unsafe fn block_into<const ADD: bool>(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, c: *mut f32, ldc: usize) {
    debug_assert!(kb % 16 == 0);
    if ADD {
        asm!(
            "tileloadd tmm0, [{c0} + {sc}*1]",
            "tileloadd tmm1, [{c1} + {sc}*1]",
            "tileloadd tmm2, [{c2} + {sc}*1]",
            "tileloadd tmm3, [{c3} + {sc}*1]",
            c0 = in(reg) c,
            c1 = in(reg) c.add(16),
            c2 = in(reg) c.add(16 * ldc),
            c3 = in(reg) c.add(16 * ldc + 16),
            sc = in(reg) ldc * 4,
            options(nostack, readonly),
        );
    } else {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    }
    let mut s = 0;
    while s < kb {
        asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm6, [{b0} + {sb}*1]",
            "tileloadd tmm7, [{b1} + {sb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a.add(s / 16 * astep),
            a1 = in(reg) a.add(16 * lda + s / 16 * astep),
            sa = in(reg) lda * 4,
            b0 = in(reg) b.add(s * NR),
            b1 = in(reg) b.add(s * NR + 16),
            sb = in(reg) NR * 4,
            options(nostack, readonly),
        );
        s += 16;
    }
    asm!(
        "tilestored [{c0} + {sc}*1], tmm0",
        "tilestored [{c1} + {sc}*1], tmm1",
        "tilestored [{c2} + {sc}*1], tmm2",
        "tilestored [{c3} + {sc}*1], tmm3",
        c0 = in(reg) c,
        c1 = in(reg) c.add(16),
        c2 = in(reg) c.add(16 * ldc),
        c3 = in(reg) c.add(16 * ldc + 16),
        sc = in(reg) ldc * 4,
        options(nostack),
    );
}

/// Pair rows `r..r+16` of the panel at `b` (`kb` pair rows), or past its end those of `next`
/// (the panel the caller reads after this one; null: none), asked into L2.
#[inline(always)]
unsafe fn prefetch_rows(b: *const u32, kb: usize, next: *const u32, r: usize) {
    let p = if r < kb {
        b.wrapping_add(r * NR)
    } else if !next.is_null() {
        next.wrapping_add((r - kb) * NR)
    } else {
        return;
    } as *const u8;
    // 16 pair rows of NR words: 32 lines (a prefetch is only a hint: never faults)
    for l in 0..32 {
        asm!("prefetcht1 [{p}]", p = in(reg) p.wrapping_add(64 * l), options(nostack, readonly, preserves_flags));
    }
}

/// `block` for strips of at most 16 rows (decode): the first 16 rows of `sums` only. One A
/// tile and the panel's two B tiles per step, alternating between two register sets so the
/// next step's tile loads (from memory: the weights stream) overlap this step's products.
/// Each accumulator sees the same `tdpbf16ps` sequence as in `block`, so the bits are equal.
///
/// The tile loads alone keep too few lines in flight (the tile registers are reused only
/// after the products that read them): each step also asks L2 for the rows `PF_AHEAD` pairs
/// on, continuing into `next` (the panel read after this one, or null) past this one's end.
pub unsafe fn block16(a: *const u32, lda: usize, astep: usize, b: *const u32, kb: usize, next: *const u32, sums: &mut Sums) {
    /// 8 KiB of the stream ahead (measured 4–32 KiB: 4 and 16 KiB ahead gained less)
    const PF_AHEAD: usize = 64;
    debug_assert!(kb % 16 == 0);
    asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
    let mut s = 0;
    while s + 32 <= kb {
        prefetch_rows(b, kb, next, s + PF_AHEAD);
        prefetch_rows(b, kb, next, s + PF_AHEAD + 16);
        asm!(
            "tileloadd tmm2, [{a0} + {sa}*1]",
            "tileloadd tmm4, [{b0} + {sb}*1]",
            "tileloadd tmm5, [{b1} + {sb}*1]",
            "tileloadd tmm3, [{a2} + {sa}*1]",
            "tileloadd tmm6, [{b2} + {sb}*1]",
            "tileloadd tmm7, [{b3} + {sb}*1]",
            "tdpbf16ps tmm0, tmm2, tmm4",
            "tdpbf16ps tmm1, tmm2, tmm5",
            "tdpbf16ps tmm0, tmm3, tmm6",
            "tdpbf16ps tmm1, tmm3, tmm7",
            a0 = in(reg) a.add(s / 16 * astep),
            a2 = in(reg) a.add((s / 16 + 1) * astep),
            sa = in(reg) lda * 4,
            b0 = in(reg) b.add(s * NR),
            b1 = in(reg) b.add(s * NR + 16),
            b2 = in(reg) b.add((s + 16) * NR),
            b3 = in(reg) b.add((s + 16) * NR + 16),
            sb = in(reg) NR * 4,
            options(nostack, readonly),
        );
        s += 32;
    }
    if s < kb {
        prefetch_rows(b, kb, next, s + PF_AHEAD);
        asm!(
            "tileloadd tmm2, [{a0} + {sa}*1]",
            "tileloadd tmm4, [{b0} + {sb}*1]",
            "tileloadd tmm5, [{b1} + {sb}*1]",
            "tdpbf16ps tmm0, tmm2, tmm4",
            "tdpbf16ps tmm1, tmm2, tmm5",
            a0 = in(reg) a.add(s / 16 * astep),
            sa = in(reg) lda * 4,
            b0 = in(reg) b.add(s * NR),
            b1 = in(reg) b.add(s * NR + 16),
            sb = in(reg) NR * 4,
            options(nostack, readonly),
        );
    }
    let c = sums.0.as_mut_ptr();
    asm!(
        "tilestored [{c0} + {sc}*1], tmm0",
        "tilestored [{c1} + {sc}*1], tmm1",
        c0 = in(reg) c,
        c1 = in(reg) c.add(16),
        sc = in(reg) NR * 4,
        options(nostack),
    );
}
