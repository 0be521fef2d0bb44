//! The interpreter's tensor-core and asynchronous-copy instructions on hand-written PTX:
//! `mma.sync` against plain f64 matrix products and against the independent lane-level port
//! (`backend::cuda::emulate::mma`, written from `kernels/mma.cuh`), its fragment layout by
//! distinct values, its warp-collective rule; `cp.async` visibility only after the issuer's
//! wait, zero fill, commit groups, and the in-flight hazards.
use super::mem::GlobalMem;
use super::mma::{a_elem, b_elem, c_elem};
use super::tests::{read_u32, run};
use crate::backend::cuda::emulate;
use crate::backend::cuda::seam::KArg;
use crate::util::rng::Rng;
use half::bf16;

/// Each lane loads its A (4 regs), C (4 f32) and B (2 regs) from `in + 48·lane`, runs one mma
/// and stores D to `out + 16·lane`. `BRANCH` is replaced by a divergent branch or nothing.
const MMA: &str = r#"
.visible .entry mma_t(.param .u64 mma_t_param_0, .param .u64 mma_t_param_1)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .f32 %f<9>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [mma_t_param_0];
    ld.param.u64 %rd2, [mma_t_param_1];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 48;
    add.s64 %rd4, %rd1, %rd3;
    ld.global.v4.u32 {%r2, %r3, %r4, %r5}, [%rd4];
    ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd4+16];
    ld.global.v2.u32 {%r6, %r7}, [%rd4+32];
    BRANCH
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f5, %f6, %f7, %f8}, {%r2, %r3, %r4, %r5}, {%r6, %r7}, {%f1, %f2, %f3, %f4};
$L_skip:
    mul.wide.u32 %rd5, %r1, 16;
    add.s64 %rd6, %rd2, %rd5;
    st.global.v4.f32 [%rd6], {%f5, %f6, %f7, %f8};
    ret;
}
"#;
const MMA_LINE: u32 = 20; // the mma's line in the loaded text (3 header lines + MMA)

/// Per-lane registers packed from whole matrices by the register-level description of
/// `kernels/mma.cuh` (lane = 4·gid + tq; a0 = A[gid][2tq, 2tq+1], a1 = A[gid+8][..],
/// a2 = A[gid][2tq+8, 2tq+9], a3 = A[gid+8][2tq+8, ..]; b0 = B[2tq, 2tq+1][gid], b1 = B[2tq+8, 2tq+9][gid];
/// c0 = C[gid][2tq], c1 = C[gid][2tq+1], c2 = C[gid+8][2tq], c3 = C[gid+8][2tq+1]) — written
/// independently of `mma.rs`'s per-element ISA formulas, so a slip in either shows.
fn pack(a: &[[f32; 16]; 16], b: &[[f32; 8]; 16], c: &[[f32; 8]; 16]) -> Vec<u8> {
    let h = |x: f32| bf16::from_f32(x).to_bits() as u32;
    let pair = |lo: f32, hi: f32| h(lo) | (h(hi) << 16);
    let mut out = Vec::new();
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        let regs = [
            pair(a[g][2 * t], a[g][2 * t + 1]),
            pair(a[g + 8][2 * t], a[g + 8][2 * t + 1]),
            pair(a[g][2 * t + 8], a[g][2 * t + 9]),
            pair(a[g + 8][2 * t + 8], a[g + 8][2 * t + 9]),
        ];
        let cs = [c[g][2 * t], c[g][2 * t + 1], c[g + 8][2 * t], c[g + 8][2 * t + 1]];
        let bs = [pair(b[2 * t][g], b[2 * t + 1][g]), pair(b[2 * t + 8][g], b[2 * t + 9][g])];
        regs.iter().for_each(|r| out.extend(r.to_le_bytes()));
        cs.iter().for_each(|x| out.extend(x.to_bits().to_le_bytes()));
        bs.iter().for_each(|r| out.extend(r.to_le_bytes()));
        out.extend([0u8; 8]);
    }
    out
}

/// Run `MMA` on whole matrices; D as a 16×8 matrix, unpacked by the same description.
fn run_mma(a: &[[f32; 16]; 16], b: &[[f32; 8]; 16], c: &[[f32; 8]; 16], branch: &str) -> anyhow::Result<[[f32; 8]; 16]> {
    let mut g = GlobalMem::new();
    let bytes = pack(a, b, c);
    let (inp, out) = (g.alloc(bytes.len()), g.alloc(32 * 16));
    g.slice_mut(inp, bytes.len(), "test")?.copy_from_slice(&bytes);
    run(&MMA.replace("BRANCH", branch), 1, 32, &[KArg::Ptr(inp), KArg::Ptr(out)], &mut g)?;
    let v = read_u32(&mut g, out, 32 * 4);
    let mut d = [[f32::NAN; 8]; 16];
    for lane in 0..32 {
        let (gr, t) = (lane / 4, lane % 4);
        let f = |i: usize| f32::from_bits(v[lane * 4 + i]);
        d[gr][2 * t] = f(0);
        d[gr][2 * t + 1] = f(1);
        d[gr + 8][2 * t] = f(2);
        d[gr + 8][2 * t + 1] = f(3);
    }
    Ok(d)
}

#[test]
fn mma_fragment_tables_cover_each_element_once() {
    let (mut sa, mut sb, mut sc) = ([[0; 16]; 16], [[0; 8]; 16], [[0; 8]; 16]);
    for lane in 0..32 {
        (0..8).for_each(|i| sa[a_elem(lane, i).0][a_elem(lane, i).1] += 1);
        (0..4).for_each(|i| sb[b_elem(lane, i).0][b_elem(lane, i).1] += 1);
        (0..4).for_each(|i| sc[c_elem(lane, i).0][c_elem(lane, i).1] += 1);
    }
    assert!(sa.iter().flatten().chain(sb.iter().flatten()).chain(sc.iter().flatten()).all(|&n| n == 1));
    // spot values straight from the ISA's figures: lane 5 (group 1, thread 1)
    assert_eq!((0..8).map(|i| a_elem(5, i)).collect::<Vec<_>>(), [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]);
    assert_eq!((0..4).map(|i| b_elem(5, i)).collect::<Vec<_>>(), [(2, 1), (3, 1), (10, 1), (11, 1)]);
    assert_eq!((0..4).map(|i| c_elem(5, i)).collect::<Vec<_>>(), [(1, 2), (1, 3), (9, 2), (9, 3)]);
}

/// Distinct values: A[r][k] = 16r + k (integers < 256, exact in bf16) selected column by column
/// through B, C[r][n] = 1024·(8r + n); every D element then names the A and C elements it came
/// from, exactly (all sums are integers below 2^24).
#[test]
fn mma_fragment_layout_by_distinct_values() {
    let mut a = [[0f32; 16]; 16];
    let mut c = [[0f32; 8]; 16];
    for r in 0..16 {
        for k in 0..16 {
            a[r][k] = (16 * r + k) as f32;
        }
        for n in 0..8 {
            c[r][n] = 1024.0 * (8 * r + n) as f32;
        }
    }
    for sel in 0..2 {
        let mut b = [[0f32; 8]; 16];
        for n in 0..8 {
            b[n + 8 * sel][n] = 1.0;
        }
        let d = run_mma(&a, &b, &c, "").unwrap();
        for r in 0..16 {
            for n in 0..8 {
                assert_eq!(d[r][n], a[r][n + 8 * sel] + c[r][n], "D[{r}][{n}] with B selecting column {}", n + 8 * sel);
            }
        }
    }
    // B by distinct values through A = I
    let mut eye = [[0f32; 16]; 16];
    (0..16).for_each(|i| eye[i][i] = 1.0);
    let mut b = [[0f32; 8]; 16];
    for k in 0..16 {
        for n in 0..8 {
            b[k][n] = (8 * k + n) as f32;
        }
    }
    let d = run_mma(&eye, &b, &[[0f32; 8]; 16], "").unwrap();
    for r in 0..16 {
        for n in 0..8 {
            assert_eq!(d[r][n], b[r][n], "D[{r}][{n}] = B[{r}][{n}] through A = I");
        }
    }
}

/// Random bf16 tiles: D within the stated model's bound of the f64 product (module doc of
/// `mma.rs`: γ_16·(|c| + Σ|a·b|), γ_16 = 16u/(1 − 16u), u = 2^-24), and bit-identical to the
/// lane-level port `emulate::mma`, which sums in the same k order from fragments it assembles
/// by its own (mma.cuh) layout.
#[test]
fn mma_matches_f64_products_and_the_lane_level_port() {
    let mut rng = Rng::new(54);
    let bfr = |x: f64| bf16::from_f64(x).to_f32();
    let u = 2f64.powi(-24);
    let gamma16 = 16.0 * u / (1.0 - 16.0 * u);
    let mut worst = 0f64;
    for trial in 0..20 {
        let scale = [1.0, 1e-3, 3e4][trial % 3];
        let mut a = [[0f32; 16]; 16];
        let mut b = [[0f32; 8]; 16];
        let mut c = [[0f32; 8]; 16];
        a.iter_mut().flatten().for_each(|x| *x = bfr(rng.normal() * scale));
        b.iter_mut().flatten().for_each(|x| *x = bfr(rng.normal()));
        c.iter_mut().flatten().for_each(|x| *x = (rng.normal() * scale) as f32);
        let d = run_mma(&a, &b, &c, "").unwrap();
        // the port: per-lane fragments by its own ownership rule
        let mut fa = [[[0f32; 2]; 4]; 32];
        let mut fb = [[[0f32; 2]; 2]; 32];
        let mut fd = [[0f32; 4]; 32];
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            fa[lane] = [[a[g][2 * t], a[g][2 * t + 1]], [a[g + 8][2 * t], a[g + 8][2 * t + 1]], [a[g][2 * t + 8], a[g][2 * t + 9]], [a[g + 8][2 * t + 8], a[g + 8][2 * t + 9]]];
            fb[lane] = [[b[2 * t][g], b[2 * t + 1][g]], [b[2 * t + 8][g], b[2 * t + 9][g]]];
            fd[lane] = [c[g][2 * t], c[g][2 * t + 1], c[g + 8][2 * t], c[g + 8][2 * t + 1]];
        }
        emulate::mma(&mut fd, &fa, &fb);
        for r in 0..16 {
            for n in 0..8 {
                let exact: f64 = c[r][n] as f64 + (0..16).map(|k| a[r][k] as f64 * b[k][n] as f64).sum::<f64>();
                let mag: f64 = (c[r][n] as f64).abs() + (0..16).map(|k| (a[r][k] as f64 * b[k][n] as f64).abs()).sum::<f64>();
                let err = (d[r][n] as f64 - exact).abs();
                assert!(err <= gamma16 * mag, "trial {trial} D[{r}][{n}] = {} vs exact {exact}: error {err:e} > γ16·{mag:e}", d[r][n]);
                worst = worst.max(err / mag);
                let port = fd[4 * (r % 8) + n / 2][2 * (r / 8) + n % 2];
                assert_eq!(d[r][n].to_bits(), port.to_bits(), "trial {trial} D[{r}][{n}]: interpreter {} vs lane-level port {port}", d[r][n]);
            }
        }
    }
    println!("mma: worst |D − exact| / (|c| + Σ|ab|) = {worst:.2e} (bound γ16 = {gamma16:.2e})");
    assert!(worst > 0.0, "some sum must round, or the bound was never exercised");
}

#[test]
fn mma_by_part_of_a_warp_is_an_error() {
    let z16 = [[0f32; 16]; 16];
    let z8 = [[0f32; 8]; 16];
    let e = run_mma(&z16, &z8, &z8, "setp.lt.u32 %p1, %r1, 16; @%p1 bra $L_skip;").unwrap_err().to_string();
    assert!(e.contains("kernel mma_t") && e.contains(&format!("t.ptx line {MMA_LINE}")) && e.contains("warp-collective") && e.contains("0x0000ffff"), "{e}");
    // a guard false for some lanes is the same error
    let guarded = MMA.replace("BRANCH\n    mma", "setp.lt.u32 %p1, %r1, 31; @%p1 mma");
    let mut g = GlobalMem::new();
    let (inp, out) = (g.alloc(32 * 48), g.alloc(32 * 16));
    let e = run(&guarded, 1, 32, &[KArg::Ptr(inp), KArg::Ptr(out)], &mut g).unwrap_err().to_string();
    assert!(e.contains("warp-collective") && e.contains("0x80000000"), "{e}");
}

/// 64 threads; thread t copies 16 bytes `in[16t..]` to `buf[16t..]` (group 0, `SRCSIZE` bytes
/// from global, the rest zero) and to `buf2[16t..]` (group 1), then `WAIT`, `BAR`, and reads
/// 16 bytes of `BUFREAD` at its own slot xor `READXOR` (512: the slot of thread t ^ 32, the
/// other warp) into `out[16t..]`.
const CPA: &str = r#"
.visible .entry cpa(.param .u64 cpa_param_0, .param .u64 cpa_param_1)
.maxntid 64, 1, 1
{
    .reg .b32 %r<16>;
    .reg .b64 %rd<8>;
    .shared .align 16 .b8 buf[1024];
    .shared .align 16 .b8 buf2[1024];
    ld.param.u64 %rd1, [cpa_param_0];
    ld.param.u64 %rd2, [cpa_param_1];
    mov.u32 %r1, %tid.x;
    shl.b32 %r2, %r1, 4;
    mov.u32 %r3, buf;
    add.s32 %r4, %r3, %r2;
    mul.wide.u32 %rd3, %r1, 16;
    add.s64 %rd4, %rd1, %rd3;
    mov.u32 %r10, SRCSIZE;
    cp.async.cg.shared.global [%r4], [%rd4], 16, %r10;
    cp.async.commit_group;
    mov.u32 %r5, BUF2;
    add.s32 %r6, %r5, %r2;
    cp.async.cg.shared.global [%r6], [%rd4], 16;
    cp.async.commit_group;
    WAIT
    BAR
    xor.b32 %r7, %r2, READXOR;
    add.s32 %r8, BUFREAD, %r7;
    ld.shared.v4.u32 {%r11, %r12, %r13, %r14}, [%r8];
    add.s64 %rd5, %rd2, %rd3;
    st.global.v4.u32 [%rd5], {%r11, %r12, %r13, %r14};
    ret;
}
"#;
const CPA_LINE1: u32 = 21; // the first cp.async
const CPA_LINE2: u32 = 25; // the second

/// Run `CPA` with `(placeholder, text)` substitutions over the defaults (wait 0, barrier, read
/// the other warp's buf slot, 16 source bytes); `out` as u32 words.
fn run_cpa(subs: &[(&str, &str)]) -> anyhow::Result<(Vec<u32>, Vec<u32>)> {
    let mut text = CPA.to_string();
    for (k, v) in subs {
        text = text.replace(k, v);
    }
    for (k, v) in [("SRCSIZE", "16"), ("BUF2", "buf2"), ("WAIT", "cp.async.wait_group 0;"), ("BAR", "bar.sync 0;"), ("READXOR", "512"), ("BUFREAD", "%r3")] {
        text = text.replace(k, v);
    }
    let mut g = GlobalMem::new();
    let (inp, out) = (g.alloc(64 * 16), g.alloc(64 * 16));
    let src: Vec<u32> = (0..256u32).map(|i| 0x1000_0000 + i).collect();
    g.slice_mut(inp, 1024, "test")?.copy_from_slice(&src.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    run(&text, 1, 64, &[KArg::Ptr(inp), KArg::Ptr(out)], &mut g)?;
    Ok((src, read_u32(&mut g, out, 256)))
}

#[test]
fn cp_async_lands_at_the_wait_and_zero_fills() {
    // wait + barrier: thread t sees thread (t ^ 32)'s 16 bytes
    let (src, got) = run_cpa(&[]).unwrap();
    for t in 0..64 {
        assert_eq!(got[4 * t..4 * t + 4], src[4 * (t ^ 32)..4 * (t ^ 32) + 4], "thread {t}");
    }
    // src-size 8: the upper 8 bytes of each copy are zero
    let (src, got) = run_cpa(&[("SRCSIZE", "8")]).unwrap();
    for t in 0..64 {
        let o = t ^ 32;
        assert_eq!(got[4 * t..4 * t + 4], [src[4 * o], src[4 * o + 1], 0, 0], "thread {t}");
    }
    // wait_group 1 completes group 0 (buf) but not group 1; wait_all completes both
    let (src, got) = run_cpa(&[("WAIT", "cp.async.wait_group 1;")]).unwrap();
    assert_eq!(got[0..4], src[128..132]);
    let (src, got) = run_cpa(&[("WAIT", "cp.async.wait_all;"), ("BUFREAD", "%r5")]).unwrap();
    assert_eq!(got[0..4], src[128..132]);
}

#[test]
fn reading_an_in_flight_copy_is_an_error() {
    // a barrier does not land another thread's copies: thread 0 reads thread 32's slot
    let e = run_cpa(&[("WAIT", "")]).unwrap_err().to_string();
    assert!(e.contains("kernel cpa") && e.contains("thread 0") && e.contains(&format!("cp.async issued by thread 32 at PTX line {CPA_LINE1}")) && e.contains("in flight"), "{e}");
    // group 1 is still in flight after wait_group 1
    let e = run_cpa(&[("WAIT", "cp.async.wait_group 1;"), ("BUFREAD", "%r5")]).unwrap_err().to_string();
    assert!(e.contains(&format!("cp.async issued by thread 32 at PTX line {CPA_LINE2}")), "{e}");
    // the issuing thread itself, before its wait
    let e = run_cpa(&[("WAIT", ""), ("BAR", ""), ("READXOR", "0")]).unwrap_err().to_string();
    assert!(e.contains("thread 0") && e.contains("cp.async issued by thread 0 at PTX line"), "{e}");
    // a second copy into bytes still in flight
    let e = run_cpa(&[("BUF2", "buf")]).unwrap_err().to_string();
    assert!(e.contains("this cp.async at shared offset 0") && e.contains(&format!("thread 0 at PTX line {CPA_LINE1}")), "{e}");
}

#[test]
fn a_landed_copy_still_needs_the_barrier() {
    // waited for but no barrier: warp 0 reads warp 1's slots before warp 1 has copied into
    // them; warp 1's copy then races with that read
    let e = run_cpa(&[("BAR", "")]).unwrap_err().to_string();
    assert!(e.contains("shared-memory race") && e.contains("kernel cpa") && e.contains("this cp.async (warp 1)"), "{e}");
}
