//! The optimizer's arithmetic (kernels/optim.cu ↔ src/backend/cpu/optim.rs).
use super::*;

#[test]
fn reductions_scale_and_adamw() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(6);
    let (rows, d) = (37, 896);
    let x = CpuBuf::from(randn(&mut rng, rows * d, 1.0));
    for n in [1usize, 1000, 3_000_000] {
        let v = CpuBuf::from(randn(&mut rng, n, 1.0));
        let got = be.sum_squares(&up(be, &v, Dtype::F32)).unwrap();
        let want = cpu.sum_squares(&v).unwrap();
        // f64 sums of the same f32 squares in another order
        assert!((got - want).abs() <= 1e-12 * want, "sum_squares n {n}: {got} vs {want}");
    }
    let mut dv = up(be, &x, Dtype::F32);
    be.scale(&mut dv, 0.37).unwrap();
    let mut wv = x.clone();
    cpu.scale(&mut wv, 0.37).unwrap();
    check("scale", &be.download(&dv).unwrap(), &wv, 0.0, 0.0);
    be.accumulate(&mut dv, &up(be, &x, Dtype::F32)).unwrap();
    cpu.accumulate(&mut wv, &x).unwrap();
    check("accumulate", &be.download(&dv).unwrap(), &wv, 0.0, 0.0);

    // AdamW: a bf16 parameter (as uploaded) becomes an f32 master with a bf16 shadow; the update
    // follows the CPU twin's f32 operations one for one (no FMA contraction on the device)
    let n = 5000;
    let p0 = CpuBuf::from(randn_bf(&mut rng, n, 0.05));
    let mut p = be.upload(&p0).unwrap();
    let (mut m, mut v) = (be.zeros(n).unwrap(), be.zeros(n).unwrap());
    let (mut cp, mut cm, mut cv) = (p0.clone(), CpuBuf::from(vec![0f32; n]), CpuBuf::from(vec![0f32; n]));
    for step in 1..=3u64 {
        let g = CpuBuf::from(randn(&mut rng, n, 1e-3));
        let h = AdamWStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step, grad_scale: 0.7 };
        be.adamw(&mut p, &up(be, &g, Dtype::F32), &mut m, &mut v, h).unwrap();
        cpu.adamw(&mut cp, &g, &mut cm, &mut cv, h).unwrap();
    }
    assert!(p.has_shadow() && p.dtype() == Dtype::F32);
    let got = be.download(&p).unwrap();
    let ulps = got.iter().zip(&cp).map(|(a, b)| (a.to_bits() as i64 - b.to_bits() as i64).abs()).max().unwrap();
    println!("adamw: max ulp difference to the CPU twin {ulps}");
    // optim.cu claims the twin's operations one for one (__fmul_rn/__fadd_rn/__fdiv_rn/__fsqrt_rn:
    // each IEEE-rounded, nothing for ptxas to fuse — the FMA policy of build.rs): bits, not a bound
    assert_eq!(ulps, 0, "adamw p differs from the CPU twin");
    check("adamw p", &got, &cp, 0.0, 0.0);
    check("adamw m", &be.download(&m).unwrap(), &cm, 0.0, 0.0);
    check("adamw v", &be.download(&v).unwrap(), &cv, 0.0, 0.0);
    // an update of lr·1e-4 relative survives (it would vanish in bf16)
    assert!(got.iter().zip(&p0).filter(|(a, b)| a != b).count() > n / 2);
    // the shadow is what weight readers see: a matmul through p equals one with bf16(p)
    let xr = CpuBuf::from(randn_bf(&mut rng, 3 * n, 1.0));
    let mut y = be.zeros(3).unwrap();
    be.matmul(&be.upload(&xr).unwrap(), &p, None, 3, n, 1, &mut y).unwrap();
    let pb = CpuBuf::from(cp.iter().map(|&x| bf(x)).collect::<Vec<f32>>());
    let mut wy = CpuBuf::from(vec![0f32; 3]);
    cpu.matmul(&xr, &pb, None, 3, n, 1, &mut wy).unwrap();
    check("matmul through the shadow", &be.download(&y).unwrap(), &wy, 1e-4, 1e-4);
    // write refreshes master and shadow
    let p1 = randn(&mut rng, n, 0.05);
    be.write(&mut p, &p1).unwrap();
    assert_eq!(be.download(&p).unwrap(), p1);
    be.matmul(&be.upload(&xr).unwrap(), &p, None, 3, n, 1, &mut y).unwrap();
    let pb = CpuBuf::from(p1.iter().map(|&x| bf(x)).collect::<Vec<f32>>());
    cpu.matmul(&xr, &pb, None, 3, n, 1, &mut wy).unwrap();
    check("matmul through the rewritten shadow", &be.download(&y).unwrap(), &wy, 1e-4, 1e-4);
}
