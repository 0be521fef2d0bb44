//! RMSNorm family (kernels/norm.cu ↔ src/backend/cpu/norm.rs).
use super::*;

#[test]
fn rmsnorm_and_residual_add() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(1);
    for &(rows, d) in &[(1usize, 64usize), (37, 896), (5, 2048), (3, 4097)] {
        let x = CpuBuf::from(randn(&mut rng, rows * d, 3.0));
        let delta = CpuBuf::from(randn(&mut rng, rows * d, 1.0));
        let w = CpuBuf::from(randn_bf(&mut rng, d, 1.0));
        // device: f32 residual and delta (as in the forward pass), bf16 weight
        let (dx, dd, dw) = (be.upload_as(&x, Dtype::F32).unwrap(), be.upload_as(&delta, Dtype::F32).unwrap(), be.upload(&w).unwrap());
        let mut out = be.zeros(rows * d).unwrap();
        be.rmsnorm(&dx, &dw, 1e-6, rows, d, &mut out).unwrap();
        let mut want = CpuBuf::from(vec![0f32; rows * d]);
        cpu.rmsnorm(&x, &w, 1e-6, rows, d, &mut want).unwrap();
        // bf16 output: one rounding (2^-8 rel); f32 sum of squares in another order (~1e-6 rel)
        check("rmsnorm", &be.download(&out).unwrap(), &want, BF16_ROUND, 1e-6);

        let mut resid = be.upload_as(&x, Dtype::F32).unwrap();
        be.add_rmsnorm(&mut resid, &dd, &dw, 1e-6, rows, d, &mut out).unwrap();
        let mut cres = x.clone();
        cpu.add_rmsnorm(&mut cres, &delta, &w, 1e-6, rows, d, &mut want).unwrap();
        check("add_rmsnorm resid (f32, same single add)", &be.download(&resid).unwrap(), &cres, 0.0, 0.0);
        check("add_rmsnorm out", &be.download(&out).unwrap(), &want, BF16_ROUND, 1e-6);

        be.add(&mut resid, &dd, rows * d).unwrap();
        cpu.add(&mut cres, &delta, rows * d).unwrap();
        check("add", &be.download(&resid).unwrap(), &cres, 0.0, 0.0);
    }
}

#[test]
fn rmsnorm_backward() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(1);
    for &(rows, d) in &[(1usize, 64usize), (37, 896), (5, 2048), (3, 4097)] {
        let w = CpuBuf::from(randn_bf(&mut rng, d, 1.0));
        let dy = CpuBuf::from(randn(&mut rng, rows * d, 1.0));
        let prior = CpuBuf::from(randn(&mut rng, rows * d, 1.0));
        for x_dtype in [Dtype::F32, Dtype::Bf16] {
            let x = CpuBuf::from(randn(&mut rng, rows * d, 3.0).into_iter().map(|v| if x_dtype == Dtype::Bf16 { bf(v) } else { v }).collect::<Vec<f32>>());
            let (dx_, dw, ddy) = (up(be, &x, x_dtype), be.upload(&w).unwrap(), up(be, &dy, Dtype::F32));
            for accumulate in [false, true] {
                let mut dd = up(be, &prior, Dtype::F32);
                be.rmsnorm_bwd(&dx_, &dw, &ddy, 1e-6, rows, d, &mut dd, accumulate).unwrap();
                let mut want = prior.clone();
                cpu.rmsnorm_bwd(&x, &w, &dy, 1e-6, rows, d, &mut want, accumulate).unwrap();
                // same f32 formula; the two row sums (Σx², Σw·dy·x) in another order: ~1e-6 relative
                check_rows(&format!("rmsnorm_bwd {rows}x{d} {x_dtype:?} acc {accumulate}"), &be.download(&dd).unwrap(), &want, d, 2e-5, 1e-6);
            }
        }
    }
}
