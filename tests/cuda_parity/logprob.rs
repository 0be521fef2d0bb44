//! The LM head (kernels/logprob.cu ↔ src/backend/cpu/logprob.rs).
use super::*;

/// (rows, d, vocab): a tiny one, a vocabulary that is not a multiple of the 256-column tile at
/// Qwen2.5-0.5B's width, and more rows than one block of 4096 (the emulated device takes 40 rows
/// of the second: the same tiles, a tenth of the interpreter's time).
fn shapes(be: &CudaBackend) -> [(usize, usize, usize); 3] {
    let rows = if emulated(be) { 40 } else { 300 };
    [(3, 64, 512), (rows, 896, 50_003), (4200, 64, 3000)]
}

#[test]
fn logprobs_over_vocab_tiles() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(5);
    for &(rows, d, vocab) in &shapes(be) {
        let h = CpuBuf::from(randn_bf(&mut rng, rows * d, 1.0));
        let head = CpuBuf::from(randn_bf(&mut rng, vocab * d, 0.1));
        let targets: Vec<u32> = (0..rows).map(|i| if i == 0 { vocab as u32 - 1 } else { rng.below(vocab as u64) as u32 }).collect();
        let (dh, dw) = (be.upload(&h).unwrap(), be.upload(&head).unwrap());
        let got = be.logprobs(&dh, &dw, &targets, d, vocab).unwrap();
        let want = cpu.logprobs(&h, &head, &targets, d, vocab).unwrap();
        // identical bf16 inputs, f32 logits summed in another order, online f32 log-sum-exp:
        // errors ~1e-5·|logit|; 2e-3 absolute is ample (model.rs' `model_tol`, 5e-2 + 2e-2·|ref|, is for whole models)
        check(&format!("logprobs rows {rows} vocab {vocab}"), &got, &want, 0.0, 2e-3);
    }
}

#[test]
fn head_grad_over_vocab_tiles() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(5);
    for &(rows, d, vocab) in &shapes(be) {
        let h = CpuBuf::from(randn_bf(&mut rng, rows * d, 1.0));
        let head = CpuBuf::from(randn_bf(&mut rng, vocab * d, 0.1));
        let targets: Vec<u32> = (0..rows).map(|i| if i == 0 { vocab as u32 - 1 } else { rng.below(vocab as u64) as u32 }).collect();
        let mut g = be.zeros(rows * d).unwrap();
        let got = be.head_grad(&be.upload(&h).unwrap(), &be.upload(&head).unwrap(), &targets, d, vocab, &mut g).unwrap();
        let mut wg = CpuBuf::from(vec![0f32; rows * d]);
        let want = cpu.head_grad(&h, &head, &targets, d, vocab, &mut wg).unwrap();
        // identical bf16 inputs; f32 logits summed in another order (as the logprobs test)
        check(&format!("head_grad logprobs rows {rows} vocab {vocab}"), &got.logprobs, &want.logprobs, 0.0, 2e-3);
        check(&format!("head_grad entropy rows {rows} vocab {vocab}"), &got.entropy, &want.entropy, 1e-3, 2e-3);
        // g = E_p[W] − W_target: p rounded to bf16 before P·W (≤ 2^-8·max|W|, Σp = 1)
        check(&format!("head_grad g rows {rows} vocab {vocab}"), &be.download(&g).unwrap(), &wg, 0.0, BF16_ROUND * max_abs(&head) + 1e-5);
    }
    assert!(be.head_grad(&be.upload(&[0.0; 4]).unwrap(), &be.upload(&[0.0; 8]).unwrap(), &[2], 4, 2, &mut be.zeros(4).unwrap()).is_err(), "target outside the vocabulary");
}
