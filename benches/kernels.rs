//! Kernel micro-benchmarks on SmolLM2-135M's shapes (2 threads here): our AVX-512 GEMM against
//! the `gemm` crate, prefill attention, and the training attention forward/backward.
//!
//! `cargo bench --bench kernels` (add a filter, e.g. `-- gemm`). Whole-model figures against
//! PyTorch come from `tools/bench-compare.sh`; these isolate one kernel at a time.
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use infomem_engine::backend::cpu::{attention, matmul, matmul::gemm_raw, CpuBackend};
use infomem_engine::backend::{DenseSeq, TrainBackend};
use infomem_engine::backend::{AttnGeom, AttnSeq, Backend};
use std::hint::black_box;
use std::time::Duration;

const GEOM: AttnGeom = AttnGeom { n_layers: 1, n_heads: 9, n_kv_heads: 3, head_dim: 64, page_size: 64 };

fn data(n: usize, seed: u32) -> Vec<f32> {
    // cheap deterministic values in [-1, 1)
    (0..n as u32).map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0).collect()
}

fn gemms(c: &mut Criterion) {
    let mut g = c.benchmark_group("gemm");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let threads = rayon::current_num_threads();
    // (rows, k, n): the q/k/v/o, gate/up and down products of 8 × 512 tokens
    for &(m, k, n) in &[(4096usize, 576usize, 960usize), (4096, 576, 3072), (4096, 1536, 576)] {
        let x = data(m * k, 1);
        let w = data(n * k, 2);
        let mut out = vec![0f32; m * n];
        g.throughput(Throughput::Elements((2 * m * n * k) as u64)); // FLOP
        g.bench_function(format!("ours x·Wᵀ {m}x{k}x{n}"), |b| {
            b.iter(|| unsafe { gemm_raw(m, n, k, out.as_mut_ptr(), n as isize, 1, false, x.as_ptr(), k as isize, 1, w.as_ptr(), 1, k as isize, 1.0, true) })
        });
        g.bench_function(format!("gemm crate x·Wᵀ {m}x{k}x{n}"), |b| {
            b.iter(|| unsafe {
                gemm::gemm(m, n, k, out.as_mut_ptr(), 1, n as isize, false, x.as_ptr(), 1, k as isize, w.as_ptr(), k as isize, 1, 1.0, 1.0, false, false, false, gemm::Parallelism::Rayon(threads))
            })
        });
    }
    g.finish();
}

/// Decode: 8 rows against each weight matrix, bandwidth-bound (throughput in weight bytes).
fn decode_matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode matmul");
    g.sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    // qkv, gate_up, down and the LM head of SmolLM2-135M; several copies so the weights come from DRAM
    for &(k, n) in &[(576usize, 960usize), (576, 3072), (1536, 576), (576, 49152)] {
        let copies = (256 << 20) / (n * k * 4) + 1;
        let ws: Vec<Vec<f32>> = (0..copies).map(|i| data(n * k, i as u32)).collect();
        let x = data(8 * k, 9);
        let mut out = vec![0f32; 8 * n];
        let mut i = 0;
        g.throughput(Throughput::Bytes((n * k * 4) as u64));
        g.bench_function(format!("8 rows x {k}x{n}"), |b| {
            b.iter(|| {
                i = (i + 1) % copies;
                matmul::matmul(&x, &ws[i], None, 8, k, n, &mut out)
            })
        });
    }
    g.finish();
}

fn prefill_attention(c: &mut Criterion) {
    let be = CpuBackend::new();
    let (seqs_n, len) = (8usize, 512usize);
    let rows = seqs_n * len;
    let qkv = data(rows * GEOM.qkv_dim(), 3);
    let pages_per = len / GEOM.page_size;
    let mut kv = be.kv_new(GEOM, seqs_n * pages_per).unwrap();
    let slots: Vec<u32> = (0..rows as u32).collect(); // sequence s owns pages s·8 .. s·8+8
    let qkv_buf = be.upload(&qkv).unwrap();
    be.kv_store(&mut kv, 0, &qkv_buf, &slots, GEOM).unwrap();
    let pages: Vec<Vec<u32>> = (0..seqs_n).map(|s| ((s * pages_per) as u32..((s + 1) * pages_per) as u32).collect()).collect();
    let seqs: Vec<AttnSeq> = (0..seqs_n).map(|s| AttnSeq { q_row: s * len, n_q: len, ctx_len: len, pages: &pages[s] }).collect();
    let mut out = vec![0f32; rows * GEOM.q_dim()];
    let mut g = c.benchmark_group("attention");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    g.throughput(Throughput::Elements(rows as u64)); // tokens
    g.bench_function("prefill 8x512 (one layer)", |b| b.iter(|| attention::attention(&kv, 0, black_box(&qkv), &seqs, &mut out)));

    let dense: Vec<DenseSeq> = (0..seqs_n).map(|s| DenseSeq { row0: s * len, len }).collect();
    let mut o = be.zeros(rows * GEOM.q_dim()).unwrap();
    let mut lse = be.zeros(rows * GEOM.n_heads).unwrap();
    g.bench_function("train fwd 8x512 (one layer)", |b| b.iter(|| be.attn_dense(&qkv_buf, &dense, GEOM, &mut o, &mut lse).unwrap()));
    let dout = be.upload(&data(rows * GEOM.q_dim(), 4)).unwrap();
    let mut dqkv = be.zeros(rows * GEOM.qkv_dim()).unwrap();
    g.bench_function("train bwd 8x512 (one layer)", |b| b.iter(|| be.attn_dense_bwd(&qkv_buf, &o, &dout, &lse, &dense, GEOM, &mut dqkv).unwrap()));
    g.finish();
}

criterion_group!(benches, gemms, decode_matmul, prefill_attention);
criterion_main!(benches);
