//! Paged attention and the KV cache (kernels/attention.cu ↔ src/backend/cpu/attention.rs).
use super::*;

/// kv_store + attention over shared pages, prefill chunks, a single-token prompt and long decode
/// rows (which the device splits), for every supported head_dim and GQA ratios 1–8.
///
/// On the emulated device (the kernels' PTX interpreted, ~10^3 times slower than a GPU) the
/// same batch shape is shrunk: a 300-key decode row (still split in two), a 70-query prefill
/// chunk over 150 keys whose packed rows and keys cross the 64-row and 32/64-key tile edges,
/// and shorter shared prefixes.
#[test]
fn paged_attention_mixed_batch() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let emu = emulated(be);
    // (A's context, pages B shares with A, B's own pages, B's query rows, E's context)
    let (a_ctx, b_shared, b_own, b_nq, e_ctx) = if emu { (300usize, 4u32, 10u32, 70usize, 130usize) } else { (2500, 20, 40, 580, 700) };
    for (nh, nkv, hd) in attention_shapes(&[(14, 2, 64), (16, 2, 128), (4, 1, 16), (6, 3, 32), (9, 3, 64), (4, 4, 128)]) {
        let t0 = std::time::Instant::now();
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
        // A: a_ctx tokens; B shares A's first pages then owns 200..; C: 1 token;
        // D: a copy-on-write page (A's page 3 copied to 390, 7 slots) then its own tokens.
        let pa: Vec<u32> = (0..a_ctx.div_ceil(16) as u32).collect();
        let mut pb: Vec<u32> = (0..b_shared).collect();
        pb.extend(200..200 + b_own);
        let pc = vec![300u32];
        let (b_from, b_ctx) = (b_shared as usize * 16, (b_shared + b_own) as usize * 16 - 60);
        write(&mut dkv, &mut ckv, &pa, 0, a_ctx, &mut rng);
        write(&mut dkv, &mut ckv, &pb, b_from, b_ctx, &mut rng);
        write(&mut dkv, &mut ckv, &pc, 0, 1, &mut rng);
        be.kv_copy_page(&mut dkv, 3, 390, 7).unwrap();
        cpu.kv_copy_page(&mut ckv, 3, 390, 7).unwrap();
        let pd = vec![0u32, 1, 2, 390];
        write(&mut dkv, &mut ckv, &pd, 55, 64, &mut rng);
        let seqs = vec![
            AttnSeq { q_row: 0, n_q: 1, ctx_len: a_ctx, pages: &pa, sampled: false },
            AttnSeq { q_row: 1, n_q: b_nq, ctx_len: b_ctx, pages: &pb, sampled: false },
            AttnSeq { q_row: 1 + b_nq, n_q: 1, ctx_len: 1, pages: &pc, sampled: false },
            AttnSeq { q_row: 2 + b_nq, n_q: 9, ctx_len: 64, pages: &pd, sampled: false },
            AttnSeq { q_row: 11 + b_nq, n_q: 1, ctx_len: e_ctx, pages: &pb, sampled: false },
        ];
        let rows = 12 + b_nq;
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
        println!("paged attention nh {nh} nkv {nkv} hd {hd}: {:.1} s", t0.elapsed().as_secs_f64());
    }
}

/// kv_store alone (no tensor cores, so it runs on the emulated device too): every k and v value
/// lands at its slot of the pool layout `[page][layer][k|v][kv_head][page_size][head_dim]`, as
/// bf16; the call's geometry must be the cache's, and a slot may not appear twice in one call.
#[test]
fn kv_store_layout_and_contracts() {
    let be = cuda_or_skip!();
    let mut rng = Rng::new(12);
    for (nh, nkv, hd) in [(14usize, 2usize, 64usize), (16, 8, 128), (4, 1, 16)] {
        let g = AttnGeom { n_layers: 3, n_heads: nh, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
        let max_pages = 5;
        let mut kv = be.kv_new(g, max_pages).unwrap();
        let (width, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
        // ragged: 21 rows into scattered slots of pages 4, 0 and 2
        let slots: Vec<u32> = (0..21u32).map(|i| [4u32, 0, 2][i as usize % 3] * 16 + (i * 5) % 16).collect();
        let mut uniq = slots.clone();
        uniq.sort();
        uniq.dedup();
        let slots = uniq;
        let rows = slots.len();
        let qkv = randn(&mut rng, rows * width, 1.0);
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let layer = 2;
            be.kv_store(&mut kv, layer, &up(be, &qkv, dtype), &slots, g).unwrap();
            let pool = be.kv_download(&kv).unwrap();
            let page_elems = g.n_layers * 2 * nkv * 16 * hd;
            for (r, &slot) in slots.iter().enumerate() {
                let (page, s) = (slot as usize / 16, slot as usize % 16);
                for e in 0..2 * kv_dim {
                    let (which, h, d) = (e / kv_dim, (e % kv_dim) / hd, e % hd);
                    let off = page * page_elems + (((layer * 2 + which) * nkv + h) * 16 + s) * hd + d;
                    // one rounding to bf16, the same on both sides: exact equality
                    assert_eq!(pool[off], bf(qkv[r * width + q_dim + e]), "{dtype:?} hd {hd} row {r} slot {slot} elem {e}");
                }
            }
        }
        let dq = be.upload(&qkv).unwrap();
        let e = be.kv_store(&mut kv, 0, &dq, &[3, 9, 3], g).unwrap_err().to_string();
        assert!(e.contains("slot 3 appears twice"), "{e}");
        let other = AttnGeom { page_size: 8, ..g };
        let e = be.kv_store(&mut kv, 0, &dq, &[1], other).unwrap_err().to_string();
        assert!(e.contains("is not the KV cache's"), "{e}");
        let other_kv = if nkv == 1 { 2 } else { 1 };
        let e = be.kv_store(&mut kv, 0, &dq, &[1], AttnGeom { n_kv_heads: other_kv, n_heads: other_kv * (nh / nkv), ..g }).unwrap_err().to_string();
        assert!(e.contains("is not the KV cache's"), "{e}");
        let mut out = be.zeros(q_dim).unwrap();
        let seq = AttnSeq { q_row: 0, n_q: 1, ctx_len: 1, pages: &[0], sampled: false };
        let e = be.attention(&kv, 0, &dq, &[seq], AttnGeom { n_layers: 2, ..g }, &mut out).unwrap_err().to_string();
        assert!(e.contains("is not the KV cache's"), "{e}");
    }
}
