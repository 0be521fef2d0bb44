//! Kernel micro-benchmarks on SmolLM2-135M's shapes (2 threads here): our AVX-512 GEMM against
//! the `gemm` crate, prefill and decode attention (f32 and bf16 KV cache), and the training
//! attention forward/backward; the LoRA products; the bf16
//! weight kernels (`cpu::bf16`) against f32, and the machine's limits they are measured against
//! (streaming read bandwidth, `vdpbf16ps` and f32 FMA peaks).
//!
//! `cargo bench --bench kernels` (add a filter, e.g. `-- gemm`). Whole-model figures against
//! PyTorch come from `tools/bench-compare.sh`; these isolate one kernel at a time.
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use infomem_engine::backend::cpu::bf16::{self, matmul_bf16, matmul_bf16_with, matmul_dx_bf16, matmul_dx_bf16_with, Kernel, PackedBf16};
use infomem_engine::backend::cpu::{attention, matmul, matmul::gemm_raw, CpuBackend};
use infomem_engine::backend::Dtype;
use infomem_engine::backend::{DenseSeq, TrainBackend};
use infomem_engine::backend::{AttnGeom, AttnSeq, Backend};
use std::hint::black_box;
use std::time::Duration;

/// The binary's allocator, so that buffers here start on cache lines as the engine's do.
#[global_allocator]
static ALLOC: infomem_engine::util::alloc::CachingAlloc = infomem_engine::util::alloc::CachingAlloc::new();

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
    let (seqs_n, len) = (8usize, 512usize);
    let rows = seqs_n * len;
    let qkv = data(rows * GEOM.qkv_dim(), 3);
    let pages_per = len / GEOM.page_size;
    let mut g = c.benchmark_group("attention");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    g.throughput(Throughput::Elements(rows as u64)); // tokens
    // f32, and bf16 (its cache; on CPUs with AMX or AVX512_BF16 the bf16 attention of `attention::tiled`)
    for (name, be) in [("f32", CpuBackend::new()), ("bf16", CpuBackend::with_weights(Dtype::Bf16))] {
        let mut kv = be.kv_new(GEOM, seqs_n * pages_per).unwrap();
        let slots: Vec<u32> = (0..rows as u32).collect(); // sequence s owns pages s·8 .. s·8+8
        let qkv_buf = be.upload(&qkv).unwrap();
        be.kv_store(&mut kv, 0, &qkv_buf, &slots, GEOM).unwrap();
        let pages: Vec<Vec<u32>> = (0..seqs_n).map(|s| ((s * pages_per) as u32..((s + 1) * pages_per) as u32).collect()).collect();
        let seqs: Vec<AttnSeq> = (0..seqs_n).map(|s| AttnSeq { q_row: s * len, n_q: len, ctx_len: len, pages: &pages[s], sampled: false }).collect();
        let mut out = vec![0f32; rows * GEOM.q_dim()];
        g.bench_function(format!("prefill 8x512, {name} (one layer)"), |b| b.iter(|| attention::attention(&kv, 0, black_box(&qkv), &seqs, &mut out)));

        let dense: Vec<DenseSeq> = (0..seqs_n).map(|s| DenseSeq { row0: s * len, len }).collect();
        let mut o = be.zeros(rows * GEOM.q_dim()).unwrap();
        let mut lse = be.zeros(rows * GEOM.n_heads).unwrap();
        g.bench_function(format!("train fwd 8x512, {name} (one layer)"), |b| b.iter(|| be.attn_dense(&qkv_buf, &dense, GEOM, &mut o, &mut lse).unwrap()));
        let dout = be.upload(&data(rows * GEOM.q_dim(), 4)).unwrap();
        let mut dqkv = be.zeros(rows * GEOM.qkv_dim()).unwrap();
        g.bench_function(format!("train bwd 8x512, {name} (one layer)"), |b| b.iter(|| be.attn_dense_bwd(&qkv_buf, &o, &dout, &lse, &dense, GEOM, &mut dqkv).unwrap()));
    }
    g.finish();
}

/// Decode attention: 8 sequences, one new row each, over 384 cached positions (the decode bench's
/// context at its end), one layer, with the f32 and the bf16 KV cache; throughput in bytes of K
/// and V read (the bound is the read bandwidth of `machine`).
fn decode_attention(c: &mut Criterion) {
    let (seqs_n, len) = (8usize, 384usize);
    let rows = seqs_n * len;
    let qkv = data(rows * GEOM.qkv_dim(), 5);
    let pages_per = len / GEOM.page_size;
    let pages: Vec<Vec<u32>> = (0..seqs_n).map(|s| ((s * pages_per) as u32..((s + 1) * pages_per) as u32).collect()).collect();
    let seqs: Vec<AttnSeq> = (0..seqs_n).map(|s| AttnSeq { q_row: s * len + len - 1, n_q: 1, ctx_len: len, pages: &pages[s], sampled: true }).collect();
    let mut out = vec![0f32; rows * GEOM.q_dim()];
    let mut g = c.benchmark_group("decode attention");
    g.sample_size(20).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    for (name, dt, bytes) in [("f32", Dtype::F32, 4usize), ("bf16", Dtype::Bf16, 2)] {
        let be = CpuBackend::with_weights(dt);
        let mut kv = be.kv_new(GEOM, seqs_n * pages_per).unwrap();
        let slots: Vec<u32> = (0..rows as u32).collect();
        be.kv_store(&mut kv, 0, &be.upload(&qkv).unwrap(), &slots, GEOM).unwrap();
        g.throughput(Throughput::Bytes((rows * 2 * GEOM.kv_dim() * bytes) as u64));
        g.bench_function(format!("8 rows x {len} positions, {name} KV (one layer)"), |b| b.iter(|| attention::attention(&kv, 0, black_box(&qkv), &seqs, &mut out)));
    }
    g.finish();
}

/// bf16 weights against f32 on the prefill/training shapes (4096 rows): `x·Wᵀ` and `dy·W`, FLOP/s.
fn gemm_bf16(c: &mut Criterion) {
    let mut g = c.benchmark_group("bf16 gemm");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    // (rows, k, n): q/k/v (n = 576 + 2·192), gate/up, down
    for &(m, k, n) in &[(4096usize, 576usize, 960usize), (4096, 576, 3072), (4096, 1536, 576)] {
        let x = data(m * k, 1);
        let w = data(n * k, 2);
        let pw = PackedBf16::from_f32(&w, n, k);
        let dy = data(m * n, 3);
        let mut out = vec![0f32; m * n];
        let mut dx = vec![0f32; m * k];
        g.throughput(Throughput::Elements((2 * m * n * k) as u64)); // FLOP
        g.bench_function(format!("bf16 x·Wᵀ {m}x{k}x{n}"), |b| b.iter(|| matmul_bf16(&x, &pw, None, m, k, n, &mut out)));
        g.bench_function(format!("f32 x·Wᵀ {m}x{k}x{n}"), |b| b.iter(|| matmul::matmul(&x, &w, None, m, k, n, &mut out)));
        g.bench_function(format!("bf16 dy·W {m}x{n}x{k}"), |b| b.iter(|| matmul_dx_bf16(&dy, &pw, m, n, k, &mut dx, false)));
        g.bench_function(format!("f32 dy·W {m}x{n}x{k}"), |b| b.iter(|| matmul::matmul_dx(&dy, &w, m, n, k, &mut dx, false)));
        if n == 960 {
            // the fallback for CPUs without AVX512_BF16 (same bits, f32 FMAs)
            g.bench_function(format!("bf16 portable x·Wᵀ {m}x{k}x{n}"), |b| b.iter(|| matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, Kernel::Portable, true)));
            if bf16::avx2_available() {
                // what a CPU without AVX512_BF16 runs (same bits, f32 FMAs on widened bf16)
                g.bench_function(format!("bf16 AVX2 x·Wᵀ {m}x{k}x{n}"), |b| b.iter(|| matmul_bf16_with(&x, &pw, None, m, k, n, &mut out, Kernel::Avx2, true)));
                g.bench_function(format!("bf16 AVX2 dy·W {m}x{n}x{k}"), |b| b.iter(|| matmul_dx_bf16_with(&dy, &pw, m, n, k, &mut dx, false, Kernel::Avx2, true)));
            }
        }
    }
    g.finish();
}

/// Decode with bf16 weights against f32: 1 and 8 rows against each weight matrix, weights from
/// DRAM (several copies cycled), throughput in weight bytes streamed.
fn decode_bf16(c: &mut Criterion) {
    let mut g = c.benchmark_group("bf16 decode");
    g.sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    for &(k, n) in &[(576usize, 960usize), (576, 3072), (1536, 576), (576, 49152)] {
        let copies = (256 << 20) / (n * k * 2) + 1;
        let pws: Vec<PackedBf16> = (0..copies).map(|i| PackedBf16::from_f32(&data(n * k, i as u32), n, k)).collect();
        let copies32 = (256 << 20) / (n * k * 4) + 1;
        let ws: Vec<Vec<f32>> = (0..copies32).map(|i| data(n * k, i as u32)).collect();
        for rows in [1usize, 8] {
            let x = data(rows * k, 9);
            let mut out = vec![0f32; rows * n];
            let mut i = 0;
            g.throughput(Throughput::Bytes((n * k * 2) as u64));
            g.bench_function(format!("bf16 {rows} rows x {k}x{n}"), |b| {
                b.iter(|| {
                    i = (i + 1) % copies;
                    matmul_bf16(&x, &pws[i], None, rows, k, n, &mut out)
                })
            });
            g.throughput(Throughput::Bytes((n * k * 4) as u64));
            g.bench_function(format!("f32 {rows} rows x {k}x{n}"), |b| {
                b.iter(|| {
                    i = (i + 1) % copies32;
                    matmul::matmul(&x, &ws[i], None, rows, k, n, &mut out)
                })
            });
        }
    }
    g.finish();
}

/// The LoRA delta and gradients (rank 16, 8 × 512 rows) on the q, gate (a column slice of the
/// fused gate_up output) and down shapes, in f32 and on bf16 operands; throughput in FLOP (2
/// products forward, 5 backward).
fn lora_products(c: &mut Criterion) {
    use infomem_engine::backend::cpu::lora;
    let mut g = c.benchmark_group("lora");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let (m, r) = (4096usize, 16usize);
    // (name, k, n_out, ld of the output / its gradient)
    for &(name, k, n, ld) in &[("q", 576usize, 576usize, 960usize), ("gate", 576, 1536, 3072), ("down", 1536, 576, 576)] {
        let (x, a, b) = (data(m * k, 1), data(r * k, 2), data(n * r, 3));
        let mut out = data(m * ld, 4);
        let (mut da, mut db, mut dx) = (vec![0f32; r * k], vec![0f32; n * r], vec![0f32; m * k]);
        let pair = lora::Pair::new(&a, &b, 2.0, r, 0, n);
        g.throughput(Throughput::Elements((2 * m * r * (k + n)) as u64));
        g.bench_function(format!("forward {name} {m}x{k}→{n} r{r}"), |bch| bch.iter(|| lora::lora(&x, m, k, &pair, &mut out, ld)));
        g.throughput(Throughput::Elements((2 * m * r * (3 * k + 2 * n)) as u64));
        g.bench_function(format!("backward {name} {m}x{k}→{n} r{r}"), |bch| bch.iter(|| lora::lora_bwd(&x, m, k, &pair, &out, ld, (&mut da, &mut db), Some(&mut dx), None)));
        // `--dtype bf16`'s: bf16 operands, f32 sums (AMX tiles, else `vdpbf16ps`, else the f32
        // kernel on rounded values: `bf16::thin::products_bf`)
        g.throughput(Throughput::Elements((2 * m * r * (k + n)) as u64));
        g.bench_function(format!("forward bf16 {name} {m}x{k}→{n} r{r}"), |bch| bch.iter(|| lora::lora_bf16(&x, m, k, &pair, &mut out, ld)));
        g.throughput(Throughput::Elements((2 * m * r * (3 * k + 2 * n)) as u64));
        g.bench_function(format!("backward bf16 {name} {m}x{k}→{n} r{r}"), |bch| bch.iter(|| lora::lora_bwd_bf16(&x, m, k, &pair, &out, ld, (&mut da, &mut db), Some(&mut dx))));
    }
    // A training backward's input gradient with its pairs' gradients, one op (`dy·W` with the
    // pairs fused, as `TrainBackend::matmul_dx_lora` runs it under `--dtype bf16`): q/k/v and
    // gate/up; throughput in the GEMM's FLOP.
    for &(name, k, outs) in &[("qkv", 576usize, &[576usize, 192, 192][..]), ("gate_up", 576, &[1536, 1536][..])] {
        let n: usize = outs.iter().sum();
        let (x, w, dy) = (data(m * k, 1), data(n * k, 2), data(m * n, 3));
        let pw = PackedBf16::from_f32(&w, n, k);
        let ab: Vec<(Vec<f32>, Vec<f32>)> = outs.iter().map(|&no| (data(r * k, 4), data(no * r, 5))).collect();
        let pairs: Vec<lora::Pair> = outs.iter().scan(0, |c, &no| Some(std::mem::replace(c, *c + no))).zip(outs).zip(&ab).map(|((c0, &no), (a, b))| lora::Pair::new(a, b, 2.0, r, c0, no)).collect();
        let mut grads: Vec<(Vec<f32>, Vec<f32>)> = outs.iter().map(|&no| (vec![0f32; r * k], vec![0f32; no * r])).collect();
        let mut dx = vec![0f32; m * k];
        g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        g.bench_function(format!("dy·W + pairs' backward bf16 {name} {m}x{n}→{k} r{r}"), |bch| {
            bch.iter(|| {
                let mut gr: Vec<(&mut [f32], &mut [f32])> = grads.iter_mut().map(|(a, b)| (&mut a[..], &mut b[..])).collect();
                lora::matmul_dx_lora(&dy, &pw, m, n, k, &mut dx, lora::XRows::Plain(&x), &pairs, &mut gr)
            })
        });
    }
    g.finish();
}

/// What the kernels are measured against: DRAM streaming read bandwidth (1 GiB, one thread and
/// all), and the register-resident `vdpbf16ps` and f32 FMA peaks on every thread.
fn machine(c: &mut Criterion) {
    use rayon::prelude::*;
    let mut g = c.benchmark_group("machine");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let threads = rayon::current_num_threads();
    let buf: Vec<u64> = (0..(1usize << 30) / 8).map(|i| i as u64).collect();
    g.throughput(Throughput::Bytes((buf.len() * 8) as u64));
    let sum = |s: &[u64]| s.iter().fold(0u64, |a, &v| a.wrapping_add(v));
    g.bench_function("read 1 GiB, 1 thread", |b| b.iter(|| black_box(sum(&buf))));
    g.bench_function(format!("read 1 GiB, {threads} threads"), |b| b.iter(|| black_box(buf.par_chunks(1 << 20).map(sum).reduce(|| 0, u64::wrapping_add))));
    drop(buf);
    #[cfg(target_arch = "x86_64")]
    {
        use infomem_engine::backend::cpu::machine::peak;
        const ITERS: usize = 1 << 22;
        if infomem_engine::backend::cpu::bf16::native_available() {
            g.throughput(Throughput::Elements((threads * ITERS * peak::FLOPS_BF16) as u64));
            g.bench_function(format!("vdpbf16ps peak, {threads} threads"), |b| b.iter(|| rayon::broadcast(|_| unsafe { black_box(peak::bf16(ITERS)) })));
        }
        if is_x86_feature_detected!("avx512f") {
            g.throughput(Throughput::Elements((threads * ITERS * peak::FLOPS_FMA) as u64));
            g.bench_function(format!("f32 FMA peak, {threads} threads"), |b| b.iter(|| rayon::broadcast(|_| unsafe { black_box(peak::fma(ITERS)) })));
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // a CPU without AVX-512 (the f32 GEMM and the bf16 fallback then run 8-lane FMAs)
            g.throughput(Throughput::Elements((threads * ITERS * peak::FLOPS_AVX2) as u64));
            g.bench_function(format!("f32 FMA peak (AVX2), {threads} threads"), |b| b.iter(|| rayon::broadcast(|_| unsafe { black_box(peak::fma_avx2(ITERS)) })));
        }
    }
    g.finish();
}

criterion_group!(benches, gemms, decode_matmul, prefill_attention, decode_attention, gemm_bf16, decode_bf16, lora_products, machine);
criterion_main!(benches);
