//! The interpreter on small hand-written PTX (each test one property: reconvergence, the race
//! detector, bounds, divergent barriers, launch validation, unsupported instructions) and its
//! speed on a real kernel.
use super::exec::{self, Launch};
use super::launch::validate;
use super::mem::GlobalMem;
use super::Program;
use crate::backend::cuda::seam::KArg;
use anyhow::Result;

const HEAD: &str = ".version 8.8\n.target sm_90\n.address_size 64\n";

/// Load `body` (an entry's text) and run it on `block` threads of one CTA with `args`.
pub(super) fn run(body: &str, grid: u32, block: u32, args: &[KArg], gmem: &mut GlobalMem) -> Result<()> {
    let text = format!("{HEAD}{body}");
    let p = Program::load(&[("t", &text)], gmem)?;
    let f = &p.modules[0].funcs[0];
    let params = validate(f, "t", grid, block, 0, None, args, gmem)?;
    let l = Launch { module: "t", files: &p.modules[0].files, grid, block, dyn_smem: 0, params: &params, race_check: true, max_thread_insts: 1 << 24 };
    exec::run(f, &l, gmem).map(|_| ())
}

pub(super) fn read_u32(gmem: &mut GlobalMem, a: u64, n: usize) -> Vec<u32> {
    gmem.slice(a, n * 4, "test").unwrap().chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Thread t writes t to a shared word, then reads the word of thread t ^ 32 (the other warp).
/// `BARRIER` is replaced by a bar.sync or by nothing.
const EXCHANGE: &str = r#"
.visible .entry exchange(.param .u64 exchange_param_0)
.maxntid 64, 1, 1
{
    .reg .b32 %r<8>;
    .reg .b64 %rd<4>;
    .shared .align 4 .b8 buf[256];
    mov.u32 %r1, %tid.x;
    shl.b32 %r2, %r1, 2;
    mov.u32 %r3, buf;
    add.s32 %r4, %r3, %r2;
    st.shared.u32 [%r4], %r1;
    BARRIER
    xor.b32 %r5, %r2, 128;
    add.s32 %r6, %r3, %r5;
    ld.shared.u32 %r7, [%r6];
    ld.param.u64 %rd1, [exchange_param_0];
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd2, %rd2, %rd3;
    st.global.u32 [%rd2], %r7;
    ret;
}
"#;

#[test]
fn the_race_detector_needs_the_barrier() {
    let mut g = GlobalMem::new();
    let out = g.alloc(64 * 4);
    run(&EXCHANGE.replace("BARRIER", "bar.sync 0;"), 1, 64, &[KArg::Ptr(out)], &mut g).unwrap();
    let got = read_u32(&mut g, out, 64);
    assert_eq!(got, (0..64u32).map(|t| t ^ 32).collect::<Vec<_>>());
    let e = run(&EXCHANGE.replace("BARRIER", ""), 1, 64, &[KArg::Ptr(out)], &mut g).unwrap_err().to_string();
    assert!(e.contains("shared-memory race") && e.contains("kernel exchange") && e.contains("t.ptx line") && e.contains("block 0"), "{e}");
}

/// out[t] = in[t] for 64 threads.
const COPY: &str = r#"
.visible .entry copy(.param .u64 copy_param_0, .param .u64 copy_param_1)
{
    .reg .b32 %r<4>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [copy_param_0];
    ld.param.u64 %rd2, [copy_param_1];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.u32 %r2, [%rd4];
    add.s64 %rd5, %rd2, %rd3;
    st.global.u32 [%rd5], %r2;
    ret;
}
"#;

#[test]
fn an_out_of_bounds_read_names_kernel_line_thread_and_allocation() {
    let mut g = GlobalMem::new();
    let (src, dst) = (g.alloc(63 * 4), g.alloc(64 * 4));
    let e = run(COPY, 1, 64, &[KArg::Ptr(src), KArg::Ptr(dst)], &mut g).unwrap_err().to_string();
    assert!(e.contains("kernel copy") && e.contains("line 14") && e.contains("thread 63") && e.contains("out-of-bounds 4-byte global load"), "{e}");
    assert!(e.contains("past the end of the allocation") && e.contains("+252"), "{e}");
    // misaligned
    let e = run(COPY, 1, 32, &[KArg::Ptr(src + 2), KArg::Ptr(dst)], &mut g).unwrap_err().to_string();
    assert!(e.contains("misaligned"), "{e}");
    // use after free
    g.free(src).unwrap();
    let e = run(COPY, 1, 32, &[KArg::Ptr(dst), KArg::Ptr(src)], &mut g).unwrap_err().to_string();
    assert!(e.contains("outside every live allocation"), "{e}");
}

#[test]
fn launch_validation_checks_arguments_and_bounds() {
    let mut g = GlobalMem::new();
    let (a, b) = (g.alloc(256), g.alloc(256));
    let e = run(COPY, 1, 64, &[KArg::Ptr(a)], &mut g).unwrap_err().to_string();
    assert!(e.contains("1 arguments passed") && e.contains("2 parameters"), "{e}");
    let e = run(COPY, 1, 64, &[KArg::Ptr(a), KArg::I32(3)], &mut g).unwrap_err().to_string();
    assert!(e.contains("argument 1") && e.contains("wrong order or type"), "{e}");
    let e = run(EXCHANGE.replace("BARRIER", "bar.sync 0;").as_str(), 1, 96, &[KArg::Ptr(a)], &mut g).unwrap_err().to_string();
    assert!(e.contains(".maxntid 64"), "{e}");
    let e = run(COPY, 1, 64, &[KArg::Ptr(a), KArg::Ptr(b + 4096)], &mut g).unwrap_err().to_string();
    assert!(e.contains("pointer argument 1") && e.contains("outside every live allocation"), "{e}");
    // float vs int of the same size: reinterpreted bits on a GPU, an error here
    let text = format!("{HEAD}.visible .entry f(.param .f32 f_param_0, .param .u32 f_param_1)\n{{\n ret;\n}}\n");
    let p = Program::load(&[("t", &text)], &mut g).unwrap();
    let f = &p.modules[0].funcs[0];
    assert!(validate(f, "t", 1, 32, 0, None, &[KArg::F32(1.0), KArg::I32(2)], &g).is_ok());
    let e = validate(f, "t", 1, 32, 0, None, &[KArg::I32(2), KArg::F32(1.0)], &g).unwrap_err().to_string();
    assert!(e.contains("wrong order or type"), "{e}");
    let e = validate(f, "t", 1, 32, 64 << 10, None, &[KArg::F32(1.0), KArg::I32(2)], &g).unwrap_err().to_string();
    assert!(e.contains("dynamic shared memory"), "{e}");
}

/// Lanes take different arms by parity, reconverge, then a butterfly sum over the warp.
const DIVERGE: &str = r#"
.visible .entry diverge(.param .u64 diverge_param_0)
{
    .reg .pred %p<3>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<4>;
    mov.u32 %r1, %tid.x;
    and.b32 %r2, %r1, 1;
    setp.eq.s32 %p1, %r2, 0;
    @%p1 bra $EVEN;
    mul.lo.s32 %r3, %r1, 10;
    bra.uni $JOIN;
$EVEN:
    add.s32 %r3, %r1, 1000;
$JOIN:
    shfl.sync.bfly.b32 %r4|%p2, %r3, 16, 31, -1;
    add.s32 %r5, %r3, %r4;
    shfl.sync.bfly.b32 %r4|%p2, %r5, 8, 31, -1;
    add.s32 %r5, %r5, %r4;
    shfl.sync.bfly.b32 %r4|%p2, %r5, 4, 31, -1;
    add.s32 %r5, %r5, %r4;
    shfl.sync.bfly.b32 %r4|%p2, %r5, 2, 31, -1;
    add.s32 %r5, %r5, %r4;
    shfl.sync.bfly.b32 %r4|%p2, %r5, 1, 31, -1;
    add.s32 %r5, %r5, %r4;
    redux.sync.add.u32 %r6, %r3, -1;
    ld.param.u64 %rd1, [diverge_param_0];
    mul.wide.u32 %rd2, %r1, 8;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r5;
    st.global.u32 [%rd3+4], %r6;
    ret;
}
"#;

#[test]
fn divergent_lanes_reconverge_for_warp_collectives() {
    let mut g = GlobalMem::new();
    let out = g.alloc(64 * 8);
    run(DIVERGE, 1, 64, &[KArg::Ptr(out)], &mut g).unwrap();
    let got = read_u32(&mut g, out, 128);
    for w in 0..2u32 {
        let want: u32 = (w * 32..w * 32 + 32).map(|t| if t % 2 == 0 { t + 1000 } else { t * 10 }).sum();
        for l in 0..32 {
            let t = (w * 32 + l) as usize;
            assert_eq!((got[2 * t], got[2 * t + 1]), (want, want), "thread {t}");
        }
    }
    // a shuffle inside the odd arm only: a divergent warp-synchronous op
    let bad = DIVERGE.replace("    bra.uni $JOIN;", "    shfl.sync.bfly.b32 %r4|%p2, %r3, 1, 31, -1;\n    bra.uni $JOIN;");
    let e = run(&bad, 1, 32, &[KArg::Ptr(out)], &mut g).unwrap_err().to_string();
    assert!(e.contains("shfl.sync") && e.contains("divergent warp"), "{e}");
}

#[test]
fn a_barrier_in_one_arm_is_a_divergent_barrier() {
    let body = r#"
.visible .entry dbar()
{
    .reg .pred %p<2>;
    .reg .b32 %r<3>;
    mov.u32 %r1, %tid.x;
    setp.lt.u32 %p1, %r1, 32;
    @%p1 bra $A;
    bar.sync 0;
    bra.uni $B;
$A:
    bar.sync 0;
$B:
    ret;
}
"#;
    let mut g = GlobalMem::new();
    let e = run(body, 1, 64, &[], &mut g).unwrap_err().to_string();
    assert!(e.contains("divergent barrier") && e.contains("kernel dbar"), "{e}");
    // the same barrier reached by threads that took different paths to it is fine
    let ok = body.replace("    bar.sync 0;\n    bra.uni $B;", "    bra.uni $A;");
    run(&ok, 1, 64, &[], &mut g).unwrap();
}

#[test]
fn an_unsupported_instruction_fails_its_launch_by_name_and_line() {
    let body = r#"
.visible .entry tc()
{
    .reg .b32 %r<12>;
    .reg .f32 %f<8>;
    mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2}, {%r5}, {%f5, %f6, %f7, %f7};
    ret;
}
"#;
    let mut g = GlobalMem::new();
    // the module loads (other entries stay usable); the launch says what and where
    let e = run(body, 1, 32, &[], &mut g).unwrap_err().to_string();
    assert!(e.contains("kernel tc") && e.contains("PTX line 9") && e.contains("mma.sync.aligned.m16n8k8"), "{e}");
}

/// The interpreter's throughput on a real kernel (printed; the bound only catches a collapse).
#[test]
fn interpreter_speed_on_rmsnorm() {
    let Ok(be) = crate::backend::cuda::CudaBackend::emulated() else {
        println!("skipped: built without kernels");
        return;
    };
    use crate::backend::Backend;
    let (rows, d) = (64usize, 2048usize);
    let x: Vec<f32> = (0..rows * d).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let w: Vec<f32> = (0..d).map(|i| 1.0 + (i % 7) as f32 / 8.0).collect();
    let (xb, wb) = (be.upload_as(&x, crate::backend::cuda::Dtype::F32).unwrap(), be.upload(&w).unwrap());
    let mut out = be.zeros(rows * d).unwrap();
    let t = std::time::Instant::now();
    be.rmsnorm(&xb, &wb, 1e-6, rows, d, &mut out).unwrap();
    let wall = t.elapsed().as_secs_f64();
    let st = be.emulator_stats().unwrap();
    println!(
        "rmsnorm_f32 {rows}x{d}: {} thread-instructions in {:.3} s: {:.1} M thread-instructions/s ({wall:.3} s with the copies)",
        st.thread_insts,
        st.seconds,
        st.thread_insts_per_sec() / 1e6
    );
    assert!(st.thread_insts > 0);
    let y = be.download(&out).unwrap();
    let r0 = (x[..d].iter().map(|v| v * v).sum::<f32>() / d as f32 + 1e-6).sqrt().recip();
    assert!((y[3] - half::bf16::from_f32(x[3] * r0 * w[3]).to_f32()).abs() <= 1e-2 * y[3].abs().max(1e-3), "{} vs {}", y[3], x[3] * r0 * w[3]);
}

/// `fma.rn` is one rounding of the exact a·b + c; `mul.rn` then `add.rn` round twice. With
/// a = b = 1 + 2⁻¹² and c = −(1 + 2⁻¹¹): the exact result is 2⁻²⁴, the product alone rounds
/// the 2⁻²⁴ away (a tie, to even).
#[test]
fn fma_is_fused_and_mul_add_round_twice() {
    let body = r#"
.visible .entry fm(.param .u64 fm_param_0)
{
    .reg .f32 %f<6>;
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [fm_param_0];
    mov.f32 %f1, 0f3F800800;
    mov.f32 %f2, 0fBF801000;
    fma.rn.f32 %f3, %f1, %f1, %f2;
    mul.rn.f32 %f4, %f1, %f1;
    add.rn.f32 %f5, %f4, %f2;
    st.global.f32 [%rd1], %f3;
    st.global.f32 [%rd1+4], %f5;
    ret;
}
"#;
    let mut g = GlobalMem::new();
    let out = g.alloc(8);
    run(body, 1, 1, &[KArg::Ptr(out)], &mut g).unwrap();
    let v = read_u32(&mut g, out, 2);
    assert_eq!(f32::from_bits(v[0]), 2f32.powi(-24), "fused");
    assert_eq!(f32::from_bits(v[1]), 0.0, "rounded twice");
}

/// The FMA contraction policy (build.rs, NO_FMAD) as the embedded PTX shows it: the kernels that
/// claim their CPU twin's exact operation order leave ptxas nothing to contract (every f32
/// mul/add pinned `.rn`), so the emulator's bits are the GPU's for them; norm.cu keeps nvcc's
/// contraction (its PTX has fused multiply-adds the twin does not, covered by its tolerance).
#[test]
fn fma_contraction_policy_in_the_embedded_ptx() {
    let kernels = crate::backend::cuda::device::embedded_kernels();
    if kernels.is_empty() {
        println!("skipped: built without kernels");
        return;
    }
    let mut g = GlobalMem::new();
    let sources: Vec<(&str, &str)> = kernels.iter().map(|k| (k.0, k.2)).collect();
    let p = Program::load(&sources, &mut g).unwrap();
    let exact = ["rope_f32", "rope_bwd_f32", "qk_norm_rope_f32", "qk_norm_rope_bwd_f32_f32", "adamw_f32", "scale_f32"];
    for name in exact {
        let (_, f) = p.get(name).unwrap();
        assert_eq!(f.contractible_ops(), 0, "{name}: unpinned f32 mul/add that ptxas could fuse");
    }
    let (_, adamw) = p.get("adamw_f32").unwrap();
    assert_eq!(adamw.f32_fmas(), 0, "adamw_f32 claims the twin's separately rounded operations");
    let (_, norm) = p.get("rmsnorm_f32").unwrap();
    println!("rmsnorm_f32: {} fma.rn.f32, {} contractible", norm.f32_fmas(), norm.contractible_ops());
    assert!(norm.f32_fmas() > 0, "norm.cu is compiled with contraction");
}

/// Two blocks storing to the same element in one launch: unordered, a race (what duplicate
/// kv_store slots would do).
#[test]
fn blocks_writing_one_location_race() {
    let body = r#"
.visible .entry clash(.param .u64 clash_param_0, .param .u32 clash_param_1)
{
    .reg .b32 %r<4>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [clash_param_0];
    ld.param.u32 %r1, [clash_param_1];
    mov.u32 %r2, %ctaid.x;
    rem.u32 %r3, %r2, %r1;
    mul.wide.u32 %rd2, %r3, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r2;
    ret;
}
"#;
    let mut g = GlobalMem::new();
    let out = g.alloc(16);
    // 4 blocks into 4 slots: fine; 4 blocks into 3 slots: blocks 0 and 3 collide
    run(body, 4, 1, &[KArg::Ptr(out), KArg::U32(4)], &mut g).unwrap();
    assert_eq!(read_u32(&mut g, out, 4), vec![0, 1, 2, 3]);
    let e = run(body, 4, 1, &[KArg::Ptr(out), KArg::U32(3)], &mut g).unwrap_err().to_string();
    assert!(e.contains("global-memory race") && e.contains("block 3") && e.contains("store by block 0"), "{e}");
}

#[test]
fn a_runaway_loop_is_stopped() {
    let body = r#"
.visible .entry spin()
{
$TOP:
    bra.uni $TOP;
}
"#;
    let mut g = GlobalMem::new();
    let e = run(body, 1, 32, &[], &mut g).unwrap_err().to_string();
    assert!(e.contains("kernel spin") && e.contains("thread-instructions"), "{e}");
}
