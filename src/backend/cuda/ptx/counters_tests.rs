//! The counters (`counters.rs`) on hand-written PTX whose counts follow from the access
//! pattern alone: a warp's 32 contiguous f32 are 4 sectors, stride 2 is 8; 32 lanes 32 words
//! apart in shared memory are one bank 32 times (32 wavefronts, 31 of them conflicts); a
//! broadcast is one; a 128-bit access of 32 lanes is 4 wavefronts and 16 sectors with no excess.
use super::counters::{sectors, wavefronts, Counters, Requests, Traffic};
use super::exec::{self, Launch};
use super::launch::validate;
use super::mem::GlobalMem;
use super::Program;
use crate::backend::cuda::seam::KArg;

const HEAD: &str = ".version 8.8\n.target sm_90\n.address_size 64\n";

fn counted(body: &str, grid: u32, block: u32, args: &[KArg], gmem: &mut GlobalMem) -> Counters {
    let text = format!("{HEAD}{body}");
    let p = Program::load(&[("t", &text)], gmem).unwrap();
    let f = &p.modules[0].funcs[0];
    let params = validate(f, "t", grid, block, 0, None, args, gmem).unwrap();
    let l = Launch { module: "t", files: &p.modules[0].files, grid, block, dyn_smem: 0, params: &params, race_check: true, max_thread_insts: 1 << 24 };
    let st = exec::run(f, &l, gmem).unwrap();
    assert_eq!(st.thread_insts, st.counters.thread_insts);
    st.counters
}

/// Thread t loads in[t·stride], stores it to shared word (t·stride mod 1024) and to out[t].
/// 17 instructions, straight line.
const STRIDED: &str = r#"
.visible .entry strided(.param .u64 strided_param_0, .param .u64 strided_param_1, .param .u32 strided_param_2)
{
    .reg .b32 %r<8>;
    .reg .b64 %rd<8>;
    .shared .align 16 .b8 sbuf[4096];
    ld.param.u64 %rd1, [strided_param_0];
    ld.param.u64 %rd2, [strided_param_1];
    ld.param.u32 %r1, [strided_param_2];
    mov.u32 %r2, %tid.x;
    mul.lo.s32 %r3, %r2, %r1;
    mul.wide.u32 %rd3, %r3, 4;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.u32 %r4, [%rd4];
    and.b32 %r5, %r3, 1023;
    shl.b32 %r5, %r5, 2;
    mov.u32 %r6, sbuf;
    add.s32 %r6, %r6, %r5;
    st.shared.u32 [%r6], %r4;
    mul.wide.u32 %rd5, %r2, 4;
    add.s64 %rd6, %rd2, %rd5;
    st.global.u32 [%rd6], %r4;
    ret;
}
"#;

#[test]
fn coalescing_and_bank_conflicts_of_strided_accesses() {
    let mut g = GlobalMem::new();
    let (src, dst) = (g.alloc(32 * 32 * 4), g.alloc(64 * 4));
    // (stride, global sectors of the load, shared wavefronts of the store)
    for (stride, sect, waves) in [(1u32, 4u64, 1u64), (2, 8, 2), (8, 32, 8), (32, 32, 32)] {
        let c = counted(STRIDED, 1, 32, &[KArg::Ptr(src), KArg::Ptr(dst), KArg::U32(stride)], &mut g);
        let at = format!("stride {stride}");
        assert_eq!((c.warp_insts, c.thread_insts), (17, 17 * 32), "{at}");
        assert_eq!(c.global_ld, Requests { requests: 1, actual: sect, ideal: 4 }, "{at}");
        assert_eq!(c.global_st, Requests { requests: 1, actual: 4, ideal: 4 }, "{at}");
        assert_eq!(c.shared_st, Requests { requests: 1, actual: waves, ideal: 1 }, "{at}");
        assert_eq!(c.bank_conflicts(), waves - 1, "{at}");
        assert_eq!(c.bytes_of(Traffic::GlobalLd), 128, "{at}");
        assert_eq!(c.bytes_of(Traffic::GlobalSt), 128, "{at}");
        assert_eq!(c.bytes_of(Traffic::SharedSt), 128, "{at}");
        assert_eq!(c.bytes_of(Traffic::Param), 32 * (8 + 8 + 4), "{at}");
        assert_eq!((c.hbm_read_sectors, c.hbm_write_sectors), (sect, 4), "{at}");
        assert_eq!((c.fp_flops, c.sfu_ops, c.mma), (0, 0, 0), "{at}");
    }
    // two warps: two requests of each, and two blocks: the same sectors read twice count once in HBM
    let c = counted(STRIDED, 1, 64, &[KArg::Ptr(src), KArg::Ptr(dst), KArg::U32(1)], &mut g);
    assert_eq!(c.global_ld, Requests { requests: 2, actual: 8, ideal: 8 });
    assert_eq!(c.shared_st, Requests { requests: 2, actual: 2, ideal: 2 });
    assert_eq!(c.warp_insts, 34);
}

/// A broadcast shared load, a 128-bit shared load and a 128-bit global load by 32 lanes;
/// then, for lanes 0-15 only (a guard), fma + add + ex2 and a contiguous f32 global load.
const WIDE: &str = r#"
.visible .entry wide(.param .u64 wide_param_0)
{
    .reg .pred %p<2>;
    .reg .b32 %r<16>;
    .reg .f32 %f<8>;
    .reg .b64 %rd<6>;
    .shared .align 16 .b8 sb[512];
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, sb;
    ld.shared.u32 %r3, [%r2];
    shl.b32 %r4, %r1, 4;
    add.s32 %r5, %r2, %r4;
    ld.shared.v4.u32 {%r6, %r7, %r8, %r9}, [%r5];
    ld.param.u64 %rd1, [wide_param_0];
    mul.wide.u32 %rd2, %r1, 16;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.v4.u32 {%r10, %r11, %r12, %r13}, [%rd3];
    setp.lt.u32 %p1, %r1, 16;
    mov.f32 %f1, 0f3F800000;
    @%p1 fma.rn.f32 %f2, %f1, %f1, %f1;
    @%p1 add.f32 %f3, %f2, %f1;
    @%p1 ex2.approx.f32 %f4, %f3;
    mul.wide.u32 %rd4, %r1, 4;
    add.s64 %rd5, %rd1, %rd4;
    @%p1 ld.global.u32 %r14, [%rd5];
    ret;
}
"#;

#[test]
fn broadcasts_vectors_guards_and_arithmetic() {
    let mut g = GlobalMem::new();
    let buf = g.alloc(512);
    let c = counted(WIDE, 1, 32, &[KArg::Ptr(buf)], &mut g);
    // shared: the broadcast is 1 wavefront (ideal 1), the 512 contiguous bytes 4 (ideal 4)
    assert_eq!(c.shared_ld, Requests { requests: 2, actual: 1 + 4, ideal: 1 + 4 });
    assert_eq!(c.bank_conflicts(), 0);
    assert_eq!(c.bytes_of(Traffic::SharedLd), 32 * 4 + 32 * 16);
    // global: 512 contiguous bytes = 16 sectors; 16 lanes × 4 bytes = 2 sectors
    assert_eq!(c.global_ld, Requests { requests: 2, actual: 16 + 2, ideal: 16 + 2 });
    assert_eq!(c.bytes_of(Traffic::GlobalLd), 512 + 64);
    assert_eq!(c.hbm_read_sectors, 16, "the second load's sectors are among the first's");
    // 16 lanes: fma 2 + add 1 flops, one ex2
    assert_eq!((c.fp_flops, c.sfu_ops), (16 * 3, 16));
    assert_eq!(c.bytes_of(Traffic::Param), 32 * 8);
    // 19 issues; the 4 guarded ones execute on 16 lanes
    assert_eq!((c.warp_insts, c.thread_insts), (19, 15 * 32 + 4 * 16));
    let s = c.to_string();
    assert!(s.contains("19 warp issues") && s.contains("16 SFU ops"), "{s}");
}

#[test]
fn sector_and_wavefront_rules() {
    // straddling: one 8-byte access across a sector boundary touches 2 sectors (ideal 1)
    assert_eq!(sectors(&mut [(28, 36)], |_| {}), (2, 1));
    // two lanes on the same bytes: 1 sector
    assert_eq!(sectors(&mut [(0, 4), (0, 4)], |_| {}), (1, 1));
    // shared: two lanes on different words of bank 0 (0 and 128 bytes) = 2 wavefronts, same word = 1
    assert_eq!(wavefronts(&mut [(0, 4), (128, 132)]), (2, 1));
    assert_eq!(wavefronts(&mut [(0, 4), (0, 4)]), (1, 1));
    // 64-bit accesses by 32 lanes, contiguous: 64 words, 2 per bank = 2 wavefronts, ideal 2
    let mut r: Vec<(u64, u64)> = (0..32).map(|l| (l * 8, l * 8 + 8)).collect();
    assert_eq!(wavefronts(&mut r), (2, 2));
}

/// 32 lanes copy 16 contiguous bytes each with cp.async (512 bytes: 16 sectors, one request),
/// wait, read them back from shared memory; then one mma.sync of the warp (zeros).
const ASYNC_MMA: &str = r#"
.visible .entry am(.param .u64 am_param_0)
{
    .reg .b32 %r<16>;
    .reg .f32 %f<8>;
    .reg .b64 %rd<4>;
    .shared .align 16 .b8 buf[512];
    ld.param.u64 %rd1, [am_param_0];
    mov.u32 %r1, %tid.x;
    shl.b32 %r2, %r1, 4;
    mov.u32 %r3, buf;
    add.s32 %r4, %r3, %r2;
    mul.wide.u32 %rd2, %r1, 16;
    add.s64 %rd3, %rd1, %rd2;
    cp.async.cg.shared.global [%r4], [%rd3], 16;
    cp.async.commit_group;
    cp.async.wait_group 0;
    ld.shared.v4.u32 {%r5, %r6, %r7, %r8}, [%r4];
    mov.f32 %f1, 0f00000000;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f2, %f3, %f4, %f5}, {%r5, %r6, %r7, %r8}, {%r5, %r6}, {%f1, %f1, %f1, %f1};
    ret;
}
"#;

#[test]
fn cp_async_bytes_and_mma_issues() {
    let mut g = GlobalMem::new();
    let src = g.alloc(512);
    let c = counted(ASYNC_MMA, 1, 32, &[KArg::Ptr(src)], &mut g);
    assert_eq!(c.bytes_of(Traffic::CpAsync), 512);
    assert_eq!(c.bytes_of(Traffic::GlobalLd), 0, "the copy's global reads are cp.async bytes");
    assert_eq!(c.global_ld, Requests { requests: 1, actual: 16, ideal: 16 });
    assert_eq!(c.hbm_read_sectors, 16);
    assert_eq!(c.shared_ld, Requests { requests: 1, actual: 4, ideal: 4 });
    assert_eq!(c.mma, 1);
    assert_eq!(c.flops(), 4096);
    // two warps: one mma issue each
    let src2 = g.alloc(1024);
    let c = counted(&ASYNC_MMA.replace("buf[512]", "buf[1024]"), 1, 64, &[KArg::Ptr(src2)], &mut g);
    assert_eq!((c.mma, c.global_ld.requests, c.bytes_of(Traffic::CpAsync)), (2, 2, 1024));
}
