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
        let x = randn(&mut rng, rows * g.qkv_dim(), 2.0);
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
        let x = randn(&mut rng, rows * g.qkv_dim(), 2.0);
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
