//! RoPE (kernels/rope.cu ↔ src/backend/cpu/rope.rs).
use super::*;

#[test]
fn rope_on_fused_qkv() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(2);
    for &(nh, nkv, hd, theta) in &[(14usize, 2usize, 64usize, 1e6f64), (16, 2, 128, 1e6), (4, 1, 16, 1e4)] {
        let g = AttnGeom { n_layers: 1, n_heads: nh, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
        let rows = 23;
        let inv: Vec<f32> = (0..hd / 2).map(|i| (1.0 / theta.powf(2.0 * i as f64 / hd as f64)) as f32).collect();
        let pos: Vec<u32> = (0..rows).map(|i| if i % 2 == 0 { i as u32 } else { 30000 + i as u32 * 7 }).collect();
        let x = CpuBuf::from(randn(&mut rng, rows * g.qkv_dim(), 2.0));
        let mut dq = be.upload_as(&x, Dtype::F32).unwrap();
        be.rope(&mut dq, &pos, &inv, g).unwrap();
        let mut want = x.clone();
        cpu.rope(&mut want, &pos, &inv, g).unwrap();
        // same f32 angle, accurate sincosf vs libm: a few ulp of the outputs
        check_rows("rope", &be.download(&dq).unwrap(), &want, g.qkv_dim(), 1e-5, 1e-6);
    }
}

#[test]
fn rope_backward_inverts_the_rotation() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(2);
    for &(nh, nkv, hd, theta) in &[(14usize, 2usize, 64usize, 1e6f64), (16, 2, 128, 1e6), (4, 1, 16, 1e4)] {
        let g = AttnGeom { n_layers: 1, n_heads: nh, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
        let rows = 23;
        let inv: Vec<f32> = (0..hd / 2).map(|i| (1.0 / theta.powf(2.0 * i as f64 / hd as f64)) as f32).collect();
        let pos: Vec<u32> = (0..rows).map(|i| if i % 2 == 0 { i as u32 } else { 30000 + i as u32 * 7 }).collect();
        let x = CpuBuf::from(randn(&mut rng, rows * g.qkv_dim(), 2.0));
        let mut dq = up(be, &x, Dtype::F32);
        be.rope_bwd(&mut dq, &pos, &inv, g).unwrap();
        let mut want = x.clone();
        cpu.rope_bwd(&mut want, &pos, &inv, g).unwrap();
        // same f32 angle, accurate sincosf vs libm: a few ulp
        let got = be.download(&dq).unwrap();
        check_rows("rope_bwd", &got, &want, g.qkv_dim(), 1e-5, 1e-6);
        // forward then backward is the identity (rotation, f32)
        be.rope(&mut dq, &pos, &inv, g).unwrap();
        check_rows("rope ∘ rope_bwd", &be.download(&dq).unwrap(), &x, g.qkv_dim(), 1e-5, 1e-6);
        // the v columns are untouched
        for r in 0..rows {
            let v0 = r * g.qkv_dim() + g.q_dim() + g.kv_dim();
            assert_eq!(&got[v0..v0 + g.kv_dim()], &x[v0..v0 + g.kv_dim()]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Qwen3's per-head q/k RMSNorm fused with RoPE (qk_norm_rope, qk_norm_rope_bwd)

/// (n_heads, n_kv_heads, head_dim, rope_theta): Qwen3-1.7B, Qwen3-4B, the tiny fixture's
/// head_dim, a tiny one, the largest head_dim the kernel takes (4 pairs per lane) and one whose
/// hd/2 = 40 leaves lanes idle in its second pair.
const QK_SHAPES: [(usize, usize, usize, f64); 6] = [(16, 8, 128, 1e6), (32, 8, 128, 1e6), (4, 2, 32, 1e6), (2, 1, 8, 1e4), (2, 1, 256, 1e6), (3, 1, 80, 1e4)];
/// Qwen3's rms_norm_eps. Heads of scale 1e-3 have mean(x²) ~ 1e-6, so eps weighs on them.
const QK_EPS: f32 = 1e-6;

/// The inputs of one q/k-norm case: `rows` fused qkv rows whose heads have magnitudes 1e-3 ..
/// 10 (head h: 10^(h mod 5 − 3)), positions 0, small and ~30000 (angles up to ~3e4 rad), the
/// frequencies, and bf16-exact norm weights (q and k different, so a swap shows).
struct QkCase {
    g: AttnGeom,
    x: Vec<f32>,
    head_scale: Vec<f32>,
    pos: Vec<u32>,
    inv: Vec<f32>,
    qn: CpuBuf,
    kn: CpuBuf,
}

fn qk_case(rng: &mut Rng, (nh, nkv, hd, theta): (usize, usize, usize, f64), rows: usize) -> QkCase {
    let g = AttnGeom { n_layers: 1, n_heads: nh, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
    let inv: Vec<f32> = (0..hd / 2).map(|i| (1.0 / theta.powf(2.0 * i as f64 / hd as f64)) as f32).collect();
    let pos: Vec<u32> = (0..rows).map(|i| if i % 2 == 0 { i as u32 } else { 30000 + i as u32 * 7 }).collect();
    let heads = g.qkv_dim() / hd;
    let head_scale: Vec<f32> = (0..heads).map(|h| 10f32.powi(h as i32 % 5 - 3)).collect();
    let x: Vec<f32> = randn(rng, rows * g.qkv_dim(), 1.0).iter().enumerate().map(|(i, v)| v * head_scale[(i % g.qkv_dim()) / hd]).collect();
    let qn: Vec<f32> = (0..hd).map(|_| bf(1.0 + 0.5 * rng.normal() as f32)).collect();
    let kn: Vec<f32> = (0..hd).map(|_| bf(0.7 + 0.3 * rng.normal() as f32)).collect();
    QkCase { g, x, head_scale, pos, inv, qn: qn.into(), kn: kn.into() }
}

fn round_bf(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf(v)).collect()
}

/// Per head (chunks of head_dim: the q, k and v heads of every row):
/// |got − want| <= rel·|want| + frac·max|want head|.
fn check_heads(what: &str, got: &[f32], want: &[f32], hd: usize, rel: f32, frac: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (h, (g, w)) in got.chunks(hd).zip(want.chunks(hd)).enumerate() {
        check(&format!("{what} head chunk {h}"), g, w, rel, frac * max_abs(w));
    }
}

/// The v columns of every row are bit-identical to the input's.
fn assert_v_untouched(what: &str, got: &[f32], input: &[f32], g: AttnGeom) {
    for (r, (a, b)) in got.chunks(g.qkv_dim()).zip(input.chunks(g.qkv_dim())).enumerate() {
        let v0 = g.q_dim() + g.kv_dim();
        assert!(a[v0..] == b[v0..], "{what}: row {r}: the v columns changed");
    }
}

#[test]
fn qk_norm_rope_matches_cpu() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(31);
    for &shape in &QK_SHAPES {
        let c = qk_case(&mut rng, shape, 19);
        let g = c.g;
        let (dqn, dkn) = (be.upload(&c.qn).unwrap(), be.upload(&c.kn).unwrap());
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let what = format!("qk_norm_rope {shape:?} {dtype:?}");
            let x = if dtype == Dtype::Bf16 { round_bf(&c.x) } else { c.x.clone() };
            let mut dq = up(be, &x, dtype);
            be.qk_norm_rope(&mut dq, &dqn, &dkn, QK_EPS, &c.pos, &c.inv, g).unwrap();
            let got = be.download(&dq).unwrap();
            let mut want = CpuBuf::from(x.clone());
            cpu.qk_norm_rope(&mut want, &c.qn, &c.kn, QK_EPS, &c.pos, &c.inv, g).unwrap();
            // f32: the same f32 formula per element ((x·s)·w, then the rotation by the same f32
            // angle); Σx² summed in another order (~1e-6 relative on s), accurate sincosf vs
            // libm and FMA contraction (a few ulp): 2e-5 of the head's largest output.
            // bf16: the same values rounded once when written: + 2^-8 relative (BF16_ROUND).
            let rel = if dtype == Dtype::Bf16 { BF16_ROUND } else { 0.0 };
            check_heads(&what, &got, &want, g.head_dim, rel, 2e-5);
            assert_v_untouched(&what, &got, &x, g);
            if dtype == Dtype::F32 {
                // independent of the CPU twin: the rotation keeps each head's norm, so
                // ‖out_h‖² = Σ_i (x_i·s·w_i)², s = 1/sqrt(mean(x²) + eps) (f64 here)
                for (r, (orow, xrow)) in got.chunks(g.qkv_dim()).zip(x.chunks(g.qkv_dim())).enumerate() {
                    for h in 0..g.n_heads + g.n_kv_heads {
                        let w = if h < g.n_heads { &c.qn } else { &c.kn };
                        let (o, xh) = (&orow[h * g.head_dim..(h + 1) * g.head_dim], &xrow[h * g.head_dim..(h + 1) * g.head_dim]);
                        let ms = xh.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / g.head_dim as f64;
                        let s = 1.0 / (ms + QK_EPS as f64).sqrt();
                        let want_n2: f64 = xh.iter().zip(w).map(|(&v, &wi)| (v as f64 * s * wi as f64).powi(2)).sum();
                        let got_n2: f64 = o.iter().map(|&v| v as f64 * v as f64).sum();
                        assert!((got_n2 - want_n2).abs() <= 1e-5 * want_n2, "{what}: row {r} head {h}: ‖out‖² {got_n2} vs {want_n2}");
                    }
                }
            }
        }
    }
}

#[test]
fn qk_norm_rope_backward_matches_cpu() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(32);
    for &shape in &QK_SHAPES {
        let c = qk_case(&mut rng, shape, 19);
        let g = c.g;
        let (dqn, dkn) = (be.upload(&c.qn).unwrap(), be.upload(&c.kn).unwrap());
        let up_grad = randn(&mut rng, c.x.len(), 1.0);
        // (pre, dqkv): training runs f32/f32 (pre is the projections' f32 output); the others
        // are the kernel's other instantiations
        for (pre_t, grad_t) in [(Dtype::F32, Dtype::F32), (Dtype::Bf16, Dtype::F32), (Dtype::F32, Dtype::Bf16), (Dtype::Bf16, Dtype::Bf16)] {
            let what = format!("qk_norm_rope_bwd {shape:?} pre {pre_t:?} grad {grad_t:?}");
            let pre = CpuBuf::from(if pre_t == Dtype::Bf16 { round_bf(&c.x) } else { c.x.clone() });
            let gin = if grad_t == Dtype::Bf16 { round_bf(&up_grad) } else { up_grad.clone() };
            let dpre = up(be, &pre, pre_t);
            let mut dg = up(be, &gin, grad_t);
            be.qk_norm_rope_bwd(&dpre, &dqn, &dkn, QK_EPS, &mut dg, &c.pos, &c.inv, g).unwrap();
            let got = be.download(&dg).unwrap();
            let mut want = CpuBuf::from(gin.clone());
            cpu.qk_norm_rope_bwd(&pre, &c.qn, &c.kn, QK_EPS, &mut want, &c.pos, &c.inv, g).unwrap();
            // the same f32 formula per element (inverse rotation, then s·w·dy − c·x); the head
            // sums Σx² and Σw·dy·x in another order (~1e-6 relative), sincosf vs libm, FMA
            // contraction: 2e-5 of the head's largest gradient (norm.rs' rmsnorm_bwd bound);
            // a bf16 gradient is rounded once when written: + 2^-8 relative
            let rel = if grad_t == Dtype::Bf16 { BF16_ROUND } else { 0.0 };
            check_heads(&what, &got, &want, g.head_dim, rel, 2e-5);
            assert_v_untouched(&what, &got, &gin, g);
        }
    }
}

/// The backward is the forward's vector-Jacobian product: for a direction δ and an upstream
/// gradient u, per q/k head (each head's output depends on that head's input only),
/// Σ u·(f(x + hδ) − f(x − hδ))/2h = Σ bwd(u)·δ up to O(h²). Forward and backward both run on
/// `be` (`up32` uploads f32 activations), so this checks the device's two kernels against each
/// other, independently of the CPU twin. Bound: with δ of the head's own scale and h = 3e-3, the
/// O(h²) term is ~1e-5 and the f32 rounding of the outputs, divided by 2h, ~1e-4 of the head's
/// ‖(bwd(u)_i·δ_i)_i‖ (the CPU twin, exact in this respect, stays under 1e-4: the test below); a
/// missing term of the norm's backward (its −c·x part is ~1/sqrt(hd) of the gradient) or a wrong
/// angle gives errors of several percent and more.
fn qk_norm_rope_vjp_check<B: TrainBackend>(be: &B, up32: &dyn Fn(&[f32]) -> B::Buf, name: &str) {
    let mut rng = Rng::new(33);
    for &shape in &QK_SHAPES {
        let c = qk_case(&mut rng, shape, 7);
        let (g, w, hd) = (c.g, c.g.qkv_dim(), c.g.head_dim);
        let delta: Vec<f32> = randn(&mut rng, c.x.len(), 1.0).iter().enumerate().map(|(i, v)| v * c.head_scale[(i % w) / hd]).collect();
        let u = randn(&mut rng, c.x.len(), 1.0);
        let (qn, kn) = (be.upload(&c.qn).unwrap(), be.upload(&c.kn).unwrap());
        let h = 3e-3f32;
        let fwd = |sign: f32| -> Vec<f32> {
            let xs: Vec<f32> = c.x.iter().zip(&delta).map(|(&x, &d)| x + sign * h * d).collect();
            let mut b = up32(&xs);
            be.qk_norm_rope(&mut b, &qn, &kn, QK_EPS, &c.pos, &c.inv, g).unwrap();
            be.download(&b).unwrap()
        };
        let (plus, minus) = (fwd(1.0), fwd(-1.0));
        let mut d = up32(&u);
        be.qk_norm_rope_bwd(&up32(&c.x), &qn, &kn, QK_EPS, &mut d, &c.pos, &c.inv, g).unwrap();
        let dx = be.download(&d).unwrap();
        assert_v_untouched(&format!("{name} {shape:?} backward"), &dx, &u, g);
        for r in 0..c.pos.len() {
            for head in 0..g.n_heads + g.n_kv_heads {
                let span = r * w + head * hd..r * w + (head + 1) * hd;
                let fd: f64 = span.clone().map(|i| u[i] as f64 * (plus[i] as f64 - minus[i] as f64)).sum::<f64>() / (2.0 * h as f64);
                let an: f64 = span.clone().map(|i| dx[i] as f64 * delta[i] as f64).sum();
                let scale = span.map(|i| (dx[i] as f64 * delta[i] as f64).powi(2)).sum::<f64>().sqrt();
                assert!(
                    (fd - an).abs() <= 2e-3 * scale,
                    "{name} {shape:?} row {r} (position {}) head {head}: finite difference {fd} vs backward {an} (scale {scale})",
                    c.pos[r]
                );
            }
        }
    }
}

/// [`qk_norm_rope_vjp_check`] on the CPU twin: runs without a GPU and shows the check and its
/// bound hold for an exact implementation.
#[test]
fn qk_norm_rope_vjp_check_holds_on_cpu() {
    let cpu = CpuBackend::new();
    qk_norm_rope_vjp_check(&cpu, &|x: &[f32]| CpuBuf::from(x.to_vec()), "cpu");
}

#[test]
fn qk_norm_rope_backward_is_the_forwards_vjp_on_device() {
    let be = cuda_or_skip!();
    qk_norm_rope_vjp_check(be, &|x: &[f32]| be.upload_as(x, Dtype::F32).unwrap(), "cuda");
}

/// The launchers' checks: empty input, norm weights of the wrong length, a head_dim the kernel
/// does not take, a short buffer.
#[test]
fn qk_norm_rope_refuses_bad_arguments() {
    let be = cuda_or_skip!();
    let mut rng = Rng::new(34);
    let c = qk_case(&mut rng, (4, 2, 32, 1e6), 3);
    let g = c.g;
    let (qn, kn) = (be.upload(&c.qn).unwrap(), be.upload(&c.kn).unwrap());
    let mut x = up(be, &c.x, Dtype::F32);
    be.qk_norm_rope(&mut x, &qn, &kn, QK_EPS, &[], &c.inv, g).unwrap();
    let pre = up(be, &c.x, Dtype::F32);
    let mut d0 = up(be, &c.x, Dtype::F32);
    be.qk_norm_rope_bwd(&pre, &qn, &kn, QK_EPS, &mut d0, &[], &c.inv, g).unwrap();
    assert_eq!(be.download(&x).unwrap(), c.x, "no rows: nothing changes");
    assert_eq!(be.download(&d0).unwrap(), c.x, "no rows: nothing changes (backward)");
    let short = be.upload(&c.qn[..16]).unwrap();
    assert!(be.qk_norm_rope(&mut x, &short, &kn, QK_EPS, &c.pos, &c.inv, g).is_err(), "q_norm of 16 for head_dim 32");
    assert!(be.qk_norm_rope(&mut x, &qn, &short, QK_EPS, &c.pos, &c.inv, g).is_err(), "k_norm of 16 for head_dim 32");
    let big = AttnGeom { head_dim: 512, n_heads: 1, n_kv_heads: 1, ..g };
    let inv512 = vec![1.0f32; 256];
    let (qn512, kn512) = (be.upload(&vec![1.0; 512]).unwrap(), be.upload(&vec![1.0; 512]).unwrap());
    let mut xb = be.zeros(4 * 512).unwrap();
    assert!(be.qk_norm_rope(&mut xb, &qn512, &kn512, QK_EPS, &[0], &inv512, big).is_err(), "head_dim 512");
    assert!(be.qk_norm_rope(&mut x, &qn, &kn, QK_EPS, &[0, 1, 2, 3], &c.inv, g).is_err(), "4 rows in a buffer of 3");
    let mut dg = up(be, &c.x, Dtype::F32);
    let pre_short = up(be, &c.x[..2 * g.qkv_dim()], Dtype::F32);
    assert!(be.qk_norm_rope_bwd(&pre_short, &qn, &kn, QK_EPS, &mut dg, &c.pos, &c.inv, g).is_err(), "pre of 2 rows for 3");
}
