//! The projections through cuBLASLt (src/backend/cuda/gemm.rs ↔ src/backend/cpu/matmul.rs).
use super::*;

#[test]
fn matmul_bias_and_lora() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(4);
    for &(m, k, n) in &[(1usize, 896usize, 1152usize), (64, 896, 9728), (333, 2048, 256), (7, 64, 96)] {
        let x = CpuBuf::from(randn_bf(&mut rng, m * k, 1.0));
        let w = CpuBuf::from(randn_bf(&mut rng, n * k, 0.05));
        let b = CpuBuf::from(randn_bf(&mut rng, n, 0.5));
        let (dx, dw, db) = (be.upload(&x).unwrap(), be.upload(&w).unwrap(), be.upload(&b).unwrap());
        let mut out = be.zeros(m * n).unwrap();
        be.matmul(&dx, &dw, Some(&db), m, k, n, &mut out).unwrap();
        let mut want = CpuBuf::from(vec![0f32; m * n]);
        cpu.matmul(&x, &w, Some(&b), m, k, n, &mut want).unwrap();
        // products of bf16 values are exact in f32; only the summation order differs:
        // |error| <= k·2^-24·Σ|x||w| ≈ 1e-4·(typical |y|·sqrt(k)) — bound 2e-4 of the row max + 1e-4
        let got = be.download(&out).unwrap();
        check_rows(&format!("matmul m{m} k{k} n{n}"), &got, &want, n, 2e-4, 1e-4);

        // LoRA into a column slice of a wider output, on top of the product
        let (r, col0, ld, n_out) = (8, 16, n + 32, n.min(64));
        let a = CpuBuf::from(randn_bf(&mut rng, r * k, 0.05));
        let bb = CpuBuf::from(randn_bf(&mut rng, n_out * r, 0.5));
        let base = CpuBuf::from(randn(&mut rng, m * ld, 1.0));
        let mut dout = be.upload_as(&base, Dtype::F32).unwrap();
        let (da, dbb) = (be.upload(&a).unwrap(), be.upload(&bb).unwrap());
        be.lora(&dx, &da, &dbb, 2.0, m, k, r, n_out, &mut dout, col0, ld).unwrap();
        let mut cw = base.clone();
        cpu.lora(&x, &a, &bb, 2.0, m, k, r, n_out, &mut cw, col0, ld).unwrap();
        // the device rounds x·Aᵀ to bf16 (2^-8 rel) before the second GEMM: the delta errs by
        // <= 2^-8 · scale · Σ_j |xa_j||B_j|, well under 1e-2 of the delta row max
        let got = be.download(&dout).unwrap();
        let delta_w: Vec<f32> = cw.iter().zip(&base).map(|(a, b)| a - b).collect();
        let delta_g: Vec<f32> = got.iter().zip(&base).map(|(a, b)| a - b).collect();
        check_rows("lora delta", &delta_g, &delta_w, ld, 1e-2, 1e-4);
        for r_ in 0..m {
            for c in (0..ld).filter(|c| *c < col0 || *c >= col0 + n_out) {
                assert_eq!(got[r_ * ld + c], base[r_ * ld + c], "lora wrote outside its column slice");
            }
        }
    }
}

/// Frozen-projection input gradients, the LoRA pair gradients on a column slice, and the lazily
/// merged weights (lora_merge → matmul / matmul_dx / download).
#[test]
fn projections_lora_backward_and_merge() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(4);
    for &(m, k, n) in &[(1usize, 896usize, 1152usize), (333, 896, 4864), (64, 2048, 256), (7, 64, 96)] {
        let w = CpuBuf::from(randn_bf(&mut rng, n * k, 0.05));
        let dy = CpuBuf::from(randn_bf(&mut rng, m * n, 1.0));
        let prior = CpuBuf::from(randn(&mut rng, m * k, 1.0));
        let dw = be.upload(&w).unwrap();
        let ddy = up(be, &dy, Dtype::F32);
        for accumulate in [false, true] {
            let mut dx = up(be, &prior, Dtype::F32);
            be.matmul_dx(&ddy, &dw, m, n, k, &mut dx, accumulate).unwrap();
            let mut want = prior.clone();
            cpu.matmul_dx(&dy, &w, m, n, k, &mut want, accumulate).unwrap();
            // bf16 products exact in f32, sums in another order (as the forward matmul test)
            check_rows(&format!("matmul_dx m{m} k{k} n{n} acc {accumulate}"), &be.download(&dx).unwrap(), &want, k, 2e-4, 1e-4);
        }

        // LoRA pair on columns col0 .. col0 + n_out of a fused output of width ld = n
        let (r, col0, n_out, scale) = (16, n / 4, n / 2, 2.0f32);
        let x = CpuBuf::from(randn_bf(&mut rng, m * k, 1.0));
        let a = CpuBuf::from(randn_bf(&mut rng, r * k, 0.05));
        let b = CpuBuf::from(randn_bf(&mut rng, n_out * r, 0.5));
        let (pa, pb) = (CpuBuf::from(randn(&mut rng, r * k, 0.1)), CpuBuf::from(randn(&mut rng, n_out * r, 0.1)));
        let (dxx, da_, db_) = (be.upload(&x).unwrap(), be.upload(&a).unwrap(), be.upload(&b).unwrap());
        let (mut ga, mut gb, mut gx) = (up(be, &pa, Dtype::F32), up(be, &pb, Dtype::F32), up(be, &prior, Dtype::F32));
        // the realistic case: an f32 gradient that the device rounds to bf16 itself
        let dyf = CpuBuf::from(randn(&mut rng, m * n, 1.0));
        be.lora_bwd(&dxx, &da_, &db_, scale, m, k, r, n_out, &up(be, &dyf, Dtype::F32), col0, n, &mut ga, &mut gb, Some(&mut gx)).unwrap();
        let (mut wa, mut wb, mut wx) = (pa.clone(), pb.clone(), prior.clone());
        cpu.lora_bwd(&x, &a, &b, scale, m, k, r, n_out, &dyf, col0, n, &mut wa, &mut wb, Some(&mut wx)).unwrap();
        // dy, u = x·Aᵀ and du = scale·dy·B are rounded to bf16 on the device (one 2^-8 relative
        // error on one factor each): ~0.4% noise on the increments; the priors are exact
        for (name, got, want, prior) in [("dA", &ga, &wa, &pa), ("dB", &gb, &wb, &pb), ("dx", &gx, &wx, &prior)] {
            let got: Vec<f32> = be.download(got).unwrap().iter().zip(prior.iter()).map(|(g, p)| g - p).collect();
            let want: Vec<f32> = want.iter().zip(prior.iter()).map(|(w, p)| w - p).collect();
            let (e, cos) = rel_and_cos(&got, &want);
            println!("lora_bwd m{m} k{k} n{n} {name}: ‖Δ‖/‖ref‖ {e:.2e}, cos {cos:.6}");
            assert!(e < 1e-2, "lora_bwd {name}: relative error {e}");
        }

        // lazy merge: W' = W + scale·B·A on rows col0 .. col0 + n_out
        let mut merged = be.zeros(n * k).unwrap();
        be.copy(&dw, &mut merged).unwrap();
        be.lora_merge(&mut merged, col0, &da_, &db_, scale, k, r, n_out).unwrap();
        let mut cw = w.clone();
        cpu.lora_merge(&mut cw, col0, &a, &b, scale, k, r, n_out).unwrap();
        // download materializes the terms in f32 on the host: f32 sums in another order
        check_rows("lora_merge (downloaded)", &be.download(&merged).unwrap(), &cw, k, 1e-6, 1e-7);
        let mut y = be.zeros(m * n).unwrap();
        be.matmul(&dxx, &merged, None, m, k, n, &mut y).unwrap();
        let mut wy = CpuBuf::from(vec![0f32; m * n]);
        cpu.matmul(&x, &cw, None, m, k, n, &mut wy).unwrap();
        // base product as matmul (2e-4 of the row); the delta has x·Aᵀ rounded to bf16 (2^-8 of
        // scale·|x·Aᵀ|·|B|, bounded by 1e-2 of the delta's row max)
        let mut delta = CpuBuf::from(vec![0f32; m * n]);
        cpu.lora(&x, &a, &b, scale, m, k, r, n_out, &mut delta, col0, n).unwrap();
        let got_y = be.download(&y).unwrap();
        for row in 0..m {
            let (dmax, ymax) = (max_abs(&delta[row * n..(row + 1) * n]), max_abs(&wy[row * n..(row + 1) * n]));
            check(&format!("matmul on merged weight row {row}"), &got_y[row * n..(row + 1) * n], &wy[row * n..(row + 1) * n], 0.0, 2e-4 * ymax + 1e-2 * dmax + 1e-4);
        }
        let mut dxm = be.zeros(m * k).unwrap();
        be.matmul_dx(&ddy, &merged, m, n, k, &mut dxm, false).unwrap();
        let mut wdx = CpuBuf::from(vec![0f32; m * k]);
        cpu.matmul_dx(&dy, &cw, m, n, k, &mut wdx, false).unwrap();
        check_rows("matmul_dx on merged weight", &be.download(&dxm).unwrap(), &wdx, k, 1e-2, 1e-4);
        // a merged weight is not a plain weight: other readers refuse it
        assert!(be.logprobs(&dxx, &merged, &[0], k, n).is_err());
        // any write drops the pending terms
        be.copy(&dw, &mut merged).unwrap();
        assert_eq!(merged.pending_lora_terms(), 0);
    }
}

/// A lazily merged weight owns copies of its LoRA pair: freeing (or changing) the adapter's A
/// and B after `lora_merge` does not change what the merged weight stands for (before, its
/// terms kept raw device addresses: a use after free on the device).
#[test]
fn merged_weight_owns_its_lora_pair() {
    let be = cuda_or_skip!();
    let mut rng = Rng::new(13);
    let (m, k, n, r, row0, n_out) = (5usize, 64usize, 48usize, 8usize, 8usize, 24usize);
    let w = randn_bf(&mut rng, n * k, 0.05);
    let x = randn_bf(&mut rng, m * k, 1.0);
    let dw = be.upload(&w).unwrap();
    let mut merged = be.zeros(n * k).unwrap();
    be.copy(&dw, &mut merged).unwrap();
    let (a, b) = (randn_bf(&mut rng, r * k, 0.05), randn_bf(&mut rng, n_out * r, 0.5));
    let (mut da, db) = (be.upload(&a).unwrap(), be.upload(&b).unwrap());
    be.lora_merge(&mut merged, row0, &da, &db, 2.0, k, r, n_out).unwrap();
    let before = be.download(&merged).unwrap();
    let dx = be.upload(&x).unwrap();
    let mut y0 = be.zeros(m * n).unwrap();
    be.matmul(&dx, &merged, None, m, k, n, &mut y0).unwrap();
    // the adapter changes A in place, then frees both
    be.write(&mut da, &vec![0.0; r * k]).unwrap();
    drop((da, db));
    assert_eq!(be.download(&merged).unwrap(), before, "the merged weight stands for the pair at merge time");
    let mut y1 = be.zeros(m * n).unwrap();
    be.matmul(&dx, &merged, None, m, k, n, &mut y1).unwrap();
    assert_eq!(be.download(&y1).unwrap(), be.download(&y0).unwrap());
}
