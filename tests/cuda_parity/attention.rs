//! Paged attention and the KV cache (kernels/attention.cu ↔ src/backend/cpu/attention.rs).
use super::*;

/// kv_store + attention over shared pages, prefill chunks, a single-token prompt and long decode
/// rows (which the device splits), for every supported head_dim.
#[test]
fn paged_attention_mixed_batch() {
    let be = gpu_or_skip!("the attention kernels use mma.sync / cp.async (issue 54)");
    let cpu = CpuBackend::new();
    for (nh, nkv, hd) in attention_shapes(&[(14, 2, 64), (16, 2, 128), (4, 1, 16), (6, 3, 32), (9, 3, 64)]) {
        let g = AttnGeom { n_layers: 2, n_heads: nh, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
        let mut rng = Rng::new(nh as u64 * 100 + hd as u64);
        let max_pages = 400;
        let mut dkv = be.kv_new(g, max_pages).unwrap();
        let mut ckv = cpu.kv_new(g, max_pages).unwrap();
        let width = g.qkv_dim();
        let layer = 1;
        let write = |dkv: &mut cuda::CudaKv, ckv: &mut _, pages: &[u32], from: usize, to: usize, rng: &mut Rng| {
            let n = to - from;
            let qkv = CpuBuf::from(randn_bf(rng, n * width, 1.0));
            let slots: Vec<u32> = (from..to).map(|p| pages[p / 16] * 16 + (p % 16) as u32).collect();
            let dq = be.upload(&qkv).unwrap();
            be.kv_store(dkv, layer, &dq, &slots, g).unwrap();
            cpu.kv_store(ckv, layer, &qkv, &slots, g).unwrap();
        };
        // A: 2500 tokens (pages 0..157); B shares A's first 20 pages then owns 200..; C: 1 token;
        // D: a copy-on-write page (A's page 3 copied to 390, 7 slots) then its own tokens.
        let pa: Vec<u32> = (0..157).collect();
        let mut pb: Vec<u32> = (0..20).collect();
        pb.extend(200..240u32);
        let pc = vec![300u32];
        write(&mut dkv, &mut ckv, &pa, 0, 2500, &mut rng);
        write(&mut dkv, &mut ckv, &pb, 320, 900, &mut rng);
        write(&mut dkv, &mut ckv, &pc, 0, 1, &mut rng);
        be.kv_copy_page(&mut dkv, 3, 390, 7).unwrap();
        cpu.kv_copy_page(&mut ckv, 3, 390, 7).unwrap();
        let pd = vec![0u32, 1, 2, 390];
        write(&mut dkv, &mut ckv, &pd, 55, 64, &mut rng);
        let seqs = vec![
            AttnSeq { q_row: 0, n_q: 1, ctx_len: 2500, pages: &pa, sampled: false },
            AttnSeq { q_row: 1, n_q: 580, ctx_len: 900, pages: &pb, sampled: false },
            AttnSeq { q_row: 581, n_q: 1, ctx_len: 1, pages: &pc, sampled: false },
            AttnSeq { q_row: 582, n_q: 9, ctx_len: 64, pages: &pd, sampled: false },
            AttnSeq { q_row: 591, n_q: 1, ctx_len: 700, pages: &pb, sampled: false },
        ];
        let rows = 592;
        let qkv = CpuBuf::from(randn_bf(&mut rng, rows * width, 1.5));
        let dq = be.upload(&qkv).unwrap();
        let mut dout = be.zeros(rows * g.q_dim()).unwrap();
        be.attention(&dkv, layer, &dq, &seqs, g, &mut dout).unwrap();
        let mut want = CpuBuf::from(vec![0f32; rows * g.q_dim()]);
        cpu.attention(&ckv, layer, &qkv, &seqs, g, &mut want).unwrap();
        // The device rounds P (in [0,1]) to bf16 before P·V and the output to bf16: the output errs
        // by <= 2^-8·max|v| from P plus 2^-8·|out|; V ~ N(0,1) here, so 1e-2·max|V| bounds both
        // with margin (a bound relative to the row max of the output would be too tight for
        // rows that average to ~0).
        let got = be.download(&dout).unwrap();
        check(&format!("attention hd{hd}"), &got, &want, BF16_ROUND, 1e-2 * 4.5);
        // an f32 q input takes the other kernel instantiation
        let dq32 = be.upload_as(&qkv, Dtype::F32).unwrap();
        be.attention(&dkv, layer, &dq32, &seqs, g, &mut dout).unwrap();
        check(&format!("attention hd{hd} (f32 q)"), &be.download(&dout).unwrap(), &want, BF16_ROUND, 1e-2 * 4.5);
    }
}
