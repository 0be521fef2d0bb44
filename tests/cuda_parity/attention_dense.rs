//! Training attention, forward and backward (kernels/attention_dense.cu ↔
//! src/backend/cpu/attention_dense.rs).
use super::*;

/// Dense causal GQA attention forward (out, lse) and backward (dq, dk, dv) for every supported
/// head_dim, GQA ratios 1–8, sequences crossing the 64-row / 64-key tiles, single-token sequences.
/// On the emulated device (interpreted PTX) the batch drops its two longest sequences.
#[test]
fn dense_attention_forward_and_backward() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let lens: &[usize] = if emulated(be) { &[5, 70, 1, 33, 130] } else { &[5, 70, 1, 33, 130, 64, 300] };
    for (nh, nkv, hd) in attention_shapes(&[(4, 1, 16), (14, 2, 64), (16, 2, 128), (6, 3, 32), (2, 2, 64), (8, 1, 128)]) {
        let t0 = std::time::Instant::now();
        let g = AttnGeom { n_layers: 1, n_heads: nh, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
        let mut rng = Rng::new(nh as u64 * 100 + hd as u64);
        let (seqs, rows) = batch(lens);
        let (w, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
        let qkv = CpuBuf::from(randn_bf(&mut rng, rows * w, 1.5));
        let (mut want, mut want_lse) = (CpuBuf::from(vec![0f32; rows * q_dim]), CpuBuf::from(vec![0f32; rows * nh]));
        cpu.attn_dense(&qkv, &seqs, g, &mut want, &mut want_lse).unwrap();
        let vmax = max_abs(&qkv);
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let dq = up(be, &qkv, dtype);
            let (mut out, mut lse) = (be.zeros(rows * q_dim).unwrap(), be.zeros(rows * nh).unwrap());
            be.attn_dense(&dq, &seqs, g, &mut out, &mut lse).unwrap();
            assert_eq!(out.dtype(), Dtype::Bf16);
            // P rounded to bf16 before P·V (≤ 2^-8·max|v|, Σp = 1) and the bf16 output (2^-8·|out|)
            check(&format!("attn_dense out hd{hd} {dtype:?}"), &be.download(&out).unwrap(), &want, BF16_ROUND, BF16_ROUND * vmax);
            // lse from unrounded f32 scores: f32 accuracy
            check(&format!("attn_dense lse hd{hd} {dtype:?}"), &be.download(&lse).unwrap(), &want_lse, 1e-5, 1e-5);
        }
        // backward on identical inputs: the forward output as the device stores it (bf16) and lse
        let out_bf = CpuBuf::from(want.iter().map(|&x| bf(x)).collect::<Vec<f32>>());
        let dout = CpuBuf::from(randn(&mut rng, rows * q_dim, 1.0));
        let mut wd = CpuBuf::from(vec![f32::NAN; rows * w]);
        cpu.attn_dense_bwd(&qkv, &out_bf, &dout, &want_lse, &seqs, g, &mut wd).unwrap();
        let mut dd = be.upload_as(&vec![f32::NAN; rows * w], Dtype::F32).unwrap();
        be.attn_dense_bwd(&up(be, &qkv, Dtype::F32), &up(be, &out_bf, Dtype::Bf16), &up(be, &dout, Dtype::F32), &up(be, &want_lse, Dtype::F32), &seqs, g, &mut dd)
            .unwrap();
        let got = be.download(&dd).unwrap();
        assert!(got.iter().all(|v| v.is_finite()), "hd {hd}: every column of every row of dqkv is written");
        // dO, P and dS enter the tensor cores as bf16 (2^-8 relative on one factor each): ~0.4%
        // relative noise (the lane-level emulation in backend::cuda::emulate::attention_dense measures
        // 2e-3 .. 4e-3); bound 1% of each part's norm and 3% of its largest entry per element
        for (name, cols) in [("dq", 0..q_dim), ("dk", q_dim..q_dim + kv_dim), ("dv", q_dim + kv_dim..w)] {
            let pick = |v: &[f32]| v.chunks(w).flat_map(|r| r[cols.clone()].to_vec()).collect::<Vec<f32>>();
            let (gp, wp) = (pick(&got), pick(&wd));
            let (e, cos) = rel_and_cos(&gp, &wp);
            println!("attn_dense_bwd nh {nh} nkv {nkv} hd {hd} {name}: ‖Δ‖/‖ref‖ {e:.2e}, cos {cos:.6}");
            assert!(e < 1e-2, "hd {hd} {name}: relative error {e}");
            check(&format!("attn_dense_bwd hd{hd} {name}"), &gp, &wp, 0.0, 3e-2 * max_abs(&wp));
        }
        println!("dense attention nh {nh} nkv {nkv} hd {hd}: {:.1} s", t0.elapsed().as_secs_f64());
    }
}
