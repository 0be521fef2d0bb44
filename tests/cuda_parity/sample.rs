//! Sampling (kernels/sample.cu ↔ src/backend/cpu/sample.rs).
use super::*;

#[test]
fn sampling_matches_cpu_token_for_token() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(6);
    // Qwen's vocabulary (not a multiple of the block); 16 rows on the emulated device still
    // cover the four parameter kinds and the tied rows
    let (rows, vocab) = (if emulated(be) { 16 } else { 64 }, 151_936);
    let mut logits = randn(&mut rng, rows * vocab, 3.0);
    // ties in some rows: the lowest id must win greedy
    for r in (0..rows).step_by(5) {
        let row = &mut logits[r * vocab..(r + 1) * vocab];
        let m = max_abs(row) + 1.0;
        row[77] = m;
        row[150_000] = m;
    }
    let params: Vec<SampleParams> = (0..rows)
        .map(|r| match r % 4 {
            0 => SampleParams::GREEDY,
            1 => SampleParams { temperature: 1.0, top_p: 1.0 },
            2 => SampleParams { temperature: 0.7, top_p: 0.9 },
            _ => SampleParams { temperature: 1.5, top_p: 0.3 },
        })
        .collect();
    let uniform: Vec<f64> = (0..rows).map(|_| rng.next_f64()).collect();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let host = CpuBuf::from(if dtype == Dtype::F32 { logits.clone() } else { logits.iter().map(|&x| bf(x)).collect() });
        let dl = be.upload_as(&host, dtype).unwrap();
        let got = be.sample(&dl, vocab, &params, &uniform).unwrap();
        let want = cpu.sample(&host, vocab, &params, &uniform).unwrap();
        for r in 0..rows {
            // same logits and uniform, f64 weights on both sides: the same token unless u·C falls
            // within f64 rounding of a cumulative boundary (probability ~1e-12)
            assert_eq!(got[r].token, want[r].token, "{dtype:?} row {r} {:?} u {}", params[r], uniform[r]);
            assert!((got[r].logprob - want[r].logprob).abs() < 1e-4, "{dtype:?} row {r}: logprob {} vs {}", got[r].logprob, want[r].logprob);
        }
    }
}
