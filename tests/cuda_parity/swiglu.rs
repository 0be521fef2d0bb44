//! SwiGLU (kernels/swiglu.cu ↔ src/backend/cpu/swiglu.rs).
use super::*;

#[test]
fn swiglu_forward() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(3);
    let (m, inter) = (19, 4864);
    let gu = CpuBuf::from(randn(&mut rng, m * 2 * inter, 3.0));
    let dg = be.upload_as(&gu, Dtype::F32).unwrap();
    let mut out = be.zeros(m * inter).unwrap();
    be.swiglu(&dg, m, inter, &mut out).unwrap();
    let mut want = CpuBuf::from(vec![0f32; m * inter]);
    cpu.swiglu(&gu, m, inter, &mut want).unwrap();
    // bf16 output rounding; expf vs libm exp ~1 ulp
    check("swiglu", &be.download(&out).unwrap(), &want, BF16_ROUND, 1e-6);
}

#[test]
fn swiglu_backward() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(3);
    let (m, inter) = (19, 4864);
    let gu = CpuBuf::from(randn(&mut rng, m * 2 * inter, 3.0));
    let da = CpuBuf::from(randn(&mut rng, m * inter, 1.0));
    let mut out = be.zeros(m * 2 * inter).unwrap();
    be.swiglu_bwd(&up(be, &gu, Dtype::F32), &up(be, &da, Dtype::F32), m, inter, &mut out).unwrap();
    let mut want = CpuBuf::from(vec![0f32; m * 2 * inter]);
    cpu.swiglu_bwd(&gu, &da, m, inter, &mut want).unwrap();
    // f32 both; expf vs the CPU's polynomial exp (~2e-7 relative) through σ and σ(1 − σ)
    check_rows("swiglu_bwd", &be.download(&out).unwrap(), &want, 2 * inter, 1e-5, 1e-7);
    // bf16 gate_up (the other instantiation)
    let gub = CpuBuf::from(gu.iter().map(|&v| bf(v)).collect::<Vec<f32>>());
    be.swiglu_bwd(&up(be, &gub, Dtype::Bf16), &up(be, &da, Dtype::F32), m, inter, &mut out).unwrap();
    cpu.swiglu_bwd(&gub, &da, m, inter, &mut want).unwrap();
    check_rows("swiglu_bwd bf16", &be.download(&out).unwrap(), &want, 2 * inter, 1e-5, 1e-7);
}
