//! Predicted lower bounds per kernel family on real model shapes (issue 54): what each op's
//! kernels must move and compute, measured by the interpreter's counters (`ptx::counters`) on
//! the emulated device at three small sizes, fitted affine in the dimension the op scales with
//! (tokens, rows, elements), checked on the third size, extrapolated to a call at the model's
//! shape, and set against the H200's peaks: the time no implementation of that kernel can beat.
//! Attention (tensor cores) is measured per sequence of 512 (causal) or per decode row (context
//! 2048) and scaled by the number of sequences; the op's definition is printed beside it (and
//! used alone where the interpreter cannot run the kernel). The GEMMs (cuBLASLt) are outside the
//! table. Regenerate docs/KERNEL-BOUNDS.md with
//! `cargo test --release --features cuda --lib backend::cuda::bounds -- --ignored --nocapture`.
use super::{CudaBackend, Dtype};
use crate::backend::{AdamWStep, AttnGeom, AttnSeq, Backend, DenseSeq, SampleParams, TrainBackend};
use anyhow::Result;
use std::fmt::Write as _;

/// H200 SXM peaks (NVIDIA's H200 datasheet): HBM3e 4.8 TB/s; dense BF16 tensor 989 TFLOP/s
/// (1,979 is with sparsity); FP32 on the CUDA cores 67 TFLOP/s. SFU (ex2, rcp, rsqrt...): 16
/// results per clock per SM (CUDA C++ Programming Guide, arithmetic throughput, cc 9.0) × 132
/// SMs × 1.98 GHz boost.
const HBM_BPS: f64 = 4.8e12;
const TENSOR_FLOPS: f64 = 989e12;
const FP32_FLOPS: f64 = 67e12;
const SFU_OPS: f64 = 16.0 * 132.0 * 1.98e9;

/// A model's shape: the `config.json` values of its Hugging Face release.
struct Shape {
    name: &'static str,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    vocab: usize,
    /// Qwen3's per-head q/k RMSNorm (`qk_norm_rope` instead of `rope`).
    qk_norm: bool,
}

const MODELS: [Shape; 3] = [
    // HuggingFaceTB/SmolLM2-135M-Instruct config.json
    Shape { name: "SmolLM2-135M", hidden: 576, heads: 9, kv_heads: 3, head_dim: 64, inter: 1536, vocab: 49152, qk_norm: false },
    // Qwen/Qwen2.5-0.5B config.json
    Shape { name: "Qwen2.5-0.5B", hidden: 896, heads: 14, kv_heads: 2, head_dim: 64, inter: 4864, vocab: 151_936, qk_norm: false },
    // Qwen/Qwen3-1.7B config.json
    Shape { name: "Qwen3-1.7B", hidden: 2048, heads: 16, kv_heads: 8, head_dim: 128, inter: 6144, vocab: 151_936, qk_norm: true },
];

/// Tokens of a training micro-batch / prefill call; rows of a decode step; LoRA rank.
const TOKENS: usize = 4096;
const DECODE_ROWS: usize = 64;
const DECODE_CTX: usize = 2048;
const LORA_RANK: usize = 16;

/// What one call did: compulsory HBM bytes, CUDA-core flops (f64 counted as f32: the bound
/// stays a lower one), tensor flops, SFU ops, warp issues.
#[derive(Clone, Copy, Debug, Default)]
struct Cost {
    hbm: f64,
    fp: f64,
    tensor: f64,
    sfu: f64,
    issues: f64,
}

impl Cost {
    fn fields(&self) -> [f64; 5] {
        [self.hbm, self.fp, self.tensor, self.sfu, self.issues]
    }
    fn from(f: [f64; 5]) -> Cost {
        Cost { hbm: f[0], fp: f[1], tensor: f[2], sfu: f[3], issues: f[4] }
    }
    /// (bound in seconds, what sets it)
    fn bound(&self) -> (f64, &'static str) {
        let t = [(self.hbm / HBM_BPS, "HBM"), (self.fp / FP32_FLOPS, "FP32"), (self.tensor / TENSOR_FLOPS, "tensor"), (self.sfu / SFU_OPS, "SFU")];
        t.into_iter().fold((0.0, "HBM"), |a, b| if b.0 > a.0 { b } else { a })
    }
}

/// Run `op` at size `n` on a clean counter set: the summed cost of the kernels it launched.
fn measure(be: &CudaBackend, op: &dyn Fn(&CudaBackend, usize) -> Result<()>, n: usize) -> Result<(Cost, Vec<String>)> {
    be.emulator_reset_counters();
    op(be, n)?;
    let snap = be.emulator_counters().unwrap_or_default();
    let mut c = Cost::default();
    for k in snap.values() {
        let k = &k.counters;
        c.hbm += k.hbm_bytes() as f64;
        c.fp += k.fp_flops as f64;
        c.tensor += (k.mma * super::ptx::counters::MMA_FLOPS) as f64;
        c.sfu += k.sfu_ops as f64;
        c.issues += k.warp_insts as f64;
    }
    Ok((c, snap.keys().cloned().collect()))
}

/// Affine fit `a + b·n` from sizes n0, n1, checked at n2: the cost at `target` and the worst
/// relative miss of the fit at n2 over the fields that are not zero.
fn extrapolate(be: &CudaBackend, op: &dyn Fn(&CudaBackend, usize) -> Result<()>, sizes: [usize; 3], target: usize) -> Result<(Cost, f64, Vec<String>)> {
    let (c0, names) = measure(be, op, sizes[0])?;
    let (c1, _) = measure(be, op, sizes[1])?;
    let (c2, _) = measure(be, op, sizes[2])?;
    let (n0, n1, n2) = (sizes[0] as f64, sizes[1] as f64, sizes[2] as f64);
    let (f0, f1, f2) = (c0.fields(), c1.fields(), c2.fields());
    let mut at = [0.0; 5];
    let mut miss = 0f64;
    for i in 0..5 {
        let b = (f1[i] - f0[i]) / (n1 - n0);
        let a = f0[i] - b * n0;
        at[i] = a + b * target as f64;
        if f2[i] > 0.0 {
            miss = miss.max(((a + b * n2) - f2[i]).abs() / f2[i]);
        }
    }
    Ok((Cost::from(at), miss, names))
}

fn vals(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5).collect()
}

/// One table row.
struct Row {
    family: &'static str,
    call: String,
    cost: Cost,
    how: String,
}

/// The measured families of `s`, extrapolated to their call shapes.
fn measured(be: &CudaBackend, s: &Shape) -> Result<Vec<Row>> {
    let (d, hd, nq, nkv, inter, vocab) = (s.hidden, s.head_dim, s.heads, s.kv_heads, s.inter, s.vocab);
    let qkv_w = (nq + 2 * nkv) * hd;
    let geom = AttnGeom { n_layers: 1, n_heads: nq, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
    let inv_freq: Vec<f32> = (0..hd / 2).map(|i| 1e6f32.powf(-2.0 * i as f32 / hd as f32)).collect();
    let lora = |k: usize, n: usize| LORA_RANK * (k + n);
    // LoRA parameters of one layer (q, k, v, o, gate, up, down)
    let lora_params = lora(d, nq * hd) + 2 * lora(d, nkv * hd) + lora(nq * hd, d) + 2 * lora(d, inter) + lora(inter, d);
    type Op = Box<dyn Fn(&CudaBackend, usize) -> Result<()>>;
    let tok = [4usize, 8, 12];
    let mut ops: Vec<(&'static str, String, Op, [usize; 3], usize)> = vec![
        (
            "norm: add_rmsnorm",
            format!("{TOKENS} tok × {d}"),
            Box::new(move |be, t| {
                let mut resid = be.upload_as(&vals(t * d, 1), Dtype::F32)?;
                let (delta, w) = (be.upload_as(&vals(t * d, 2), Dtype::F32)?, be.upload(&vals(d, 3))?);
                let mut out = be.zeros(t * d)?;
                be.add_rmsnorm(&mut resid, &delta, &w, 1e-6, t, d, &mut out)
            }),
            tok,
            TOKENS,
        ),
        (
            "norm: rmsnorm_bwd",
            format!("{TOKENS} tok × {d}"),
            Box::new(move |be, t| {
                let (x, w, dy) = (be.upload_as(&vals(t * d, 1), Dtype::F32)?, be.upload(&vals(d, 3))?, be.upload_as(&vals(t * d, 2), Dtype::F32)?);
                let mut dx = be.zeros(t * d)?;
                be.rmsnorm_bwd(&x, &w, &dy, 1e-6, t, d, &mut dx, true)
            }),
            tok,
            TOKENS,
        ),
        (
            if s.qk_norm { "rope: qk_norm_rope" } else { "rope: rope" },
            format!("{TOKENS} tok × {qkv_w}"),
            Box::new({
                let (inv_freq, qk) = (inv_freq.clone(), s.qk_norm);
                move |be, t| {
                    let mut qkv = be.upload_as(&vals(t * qkv_w, 4), Dtype::F32)?;
                    let pos: Vec<u32> = (0..t as u32).map(|p| p * 7).collect();
                    if qk {
                        let (qn, kn) = (be.upload(&vals(hd, 5))?, be.upload(&vals(hd, 6))?);
                        be.qk_norm_rope(&mut qkv, &qn, &kn, 1e-6, &pos, &inv_freq, geom)
                    } else {
                        be.rope(&mut qkv, &pos, &inv_freq, geom)
                    }
                }
            }),
            tok,
            TOKENS,
        ),
        (
            "kv_store",
            format!("{TOKENS} tok × 2×{nkv}×{hd}"),
            Box::new(move |be, t| {
                let mut kv = be.kv_new(geom, t.div_ceil(16) + 1)?;
                let qkv = be.upload_as(&vals(t * qkv_w, 4), Dtype::F32)?;
                let slots: Vec<u32> = (0..t as u32).collect();
                be.kv_store(&mut kv, 0, &qkv, &slots, geom)
            }),
            tok,
            TOKENS,
        ),
        (
            "swiglu",
            format!("{TOKENS} tok × {inter}"),
            Box::new(move |be, t| {
                let gu = be.upload_as(&vals(t * 2 * inter, 7), Dtype::F32)?;
                let mut out = be.zeros(t * inter)?;
                be.swiglu(&gu, t, inter, &mut out)
            }),
            tok,
            TOKENS,
        ),
        (
            "swiglu_bwd",
            format!("{TOKENS} tok × {inter}"),
            Box::new(move |be, t| {
                let (gu, da) = (be.upload_as(&vals(t * 2 * inter, 7), Dtype::F32)?, be.upload_as(&vals(t * inter, 8), Dtype::F32)?);
                let mut dgu = be.zeros(t * 2 * inter)?;
                be.swiglu_bwd(&gu, &da, t, inter, &mut dgu)
            }),
            tok,
            TOKENS,
        ),
        (
            "memory: embed (distinct ids)",
            format!("{TOKENS} tok × {d}"),
            Box::new(move |be, t| {
                let table = be.upload(&vals(1024 * d, 9))?;
                let ids: Vec<u32> = (0..t as u32).map(|i| (i * 37) % 1024).collect();
                let mut out = be.zeros(t * d)?;
                be.embed(&table, &ids, d, &mut out)
            }),
            tok,
            TOKENS,
        ),
        (
            "logprob: logprob_tile",
            format!("{TOKENS} rows × {vocab}"),
            Box::new(move |be, t| {
                let (h, head) = (be.upload(&vals(t * d, 10))?, be.upload(&vals(vocab * d, 11))?);
                let targets: Vec<u32> = (0..t as u32).map(|i| i * 101 % vocab as u32).collect();
                be.logprobs(&h, &head, &targets, d, vocab).map(|_| ())
            }),
            [1, 2, 3],
            TOKENS,
        ),
        (
            "sample",
            format!("{DECODE_ROWS} rows × {vocab}"),
            Box::new(move |be, r| {
                let logits = be.upload_as(&vals(r * vocab, 12).iter().map(|v| v * 8.0).collect::<Vec<_>>(), Dtype::F32)?;
                let params: Vec<SampleParams> = (0..r).map(|i| if i % 2 == 0 { SampleParams::GREEDY } else { SampleParams { temperature: 0.8, top_p: 0.9 } }).collect();
                let u: Vec<f64> = (0..r).map(|i| (i as f64 + 0.5) / r as f64).collect();
                be.sample(&logits, vocab, &params, &u).map(|_| ())
            }),
            [2, 4, 6],
            DECODE_ROWS,
        ),
        (
            "optim: adamw",
            format!("{lora_params} f32 params (a layer's LoRA r{LORA_RANK})"),
            Box::new(move |be, n| {
                let mut p = be.upload_as(&vals(n, 13), Dtype::F32)?;
                let g = be.upload_as(&vals(n, 14), Dtype::F32)?;
                let (mut m, mut v) = (be.zeros(n)?, be.zeros(n)?);
                be.adamw(&mut p, &g, &mut m, &mut v, AdamWStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step: 3, grad_scale: 1.0 })
            }),
            [4096, 8192, 12288],
            lora_params,
        ),
    ];
    let mut rows = Vec::new();
    for (family, call, op, sizes, target) in ops.drain(..) {
        let (cost, miss, names) = extrapolate(be, &*op, sizes, target)?;
        rows.push(Row { family, call, cost, how: format!("measured at {sizes:?}, affine fit off by {:.2}% at the third; kernels {}", 100.0 * miss, names.join(", ")) });
    }
    Ok(rows)
}

/// Attention measured: sequences of `SEQ` tokens (dense forward / backward, paged prefill) or
/// decode rows at `DECODE_CTX` (paged decode), fitted in the number of sequences.
fn attention_measured(be: &CudaBackend, s: &Shape) -> Result<Vec<Row>> {
    const SEQ: usize = 512;
    let (hd, nq, nkv) = (s.head_dim, s.heads, s.kv_heads);
    let qkv_w = (nq + 2 * nkv) * hd;
    let g = AttnGeom { n_layers: 1, n_heads: nq, n_kv_heads: nkv, head_dim: hd, page_size: 16 };
    let dense = move |n: usize| -> Vec<DenseSeq> { (0..n).map(|i| DenseSeq { row0: i * SEQ, len: SEQ }).collect() };
    type Op = Box<dyn Fn(&CudaBackend, usize) -> Result<()>>;
    let fwd: Op = Box::new(move |be, n| {
        let qkv = be.upload_as(&vals(n * SEQ * qkv_w, 20), Dtype::Bf16)?;
        let (mut out, mut lse) = (be.zeros(n * SEQ * nq * hd)?, be.zeros(n * SEQ * nq)?);
        be.attn_dense(&qkv, &dense(n), g, &mut out, &mut lse)
    });
    let bwd: Op = Box::new(move |be, n| {
        let qkv = be.upload_as(&vals(n * SEQ * qkv_w, 20), Dtype::Bf16)?;
        let (mut out, mut lse) = (be.zeros(n * SEQ * nq * hd)?, be.zeros(n * SEQ * nq)?);
        be.attn_dense(&qkv, &dense(n), g, &mut out, &mut lse)?;
        let dout = be.upload_as(&vals(n * SEQ * nq * hd, 21), Dtype::F32)?;
        let mut dqkv = be.zeros(n * SEQ * qkv_w)?;
        be.emulator_reset_counters(); // the forward above is setup
        be.attn_dense_bwd(&qkv, &out, &dout, &lse, &dense(n), g, &mut dqkv)
    });
    // paged: the context stored first (setup), then the attention call measured
    let paged = move |be: &CudaBackend, n: usize, n_q: usize, ctx: usize| -> Result<()> {
        let pages_per = ctx.div_ceil(16);
        let mut kv = be.kv_new(g, n * pages_per)?;
        let ctx_qkv = be.upload_as(&vals(n * ctx * qkv_w, 22), Dtype::F32)?;
        let slots: Vec<u32> = (0..(n * ctx) as u32).map(|t| (t as usize / ctx * pages_per * 16 + t as usize % ctx) as u32).collect();
        be.kv_store(&mut kv, 0, &ctx_qkv, &slots, g)?;
        let pages: Vec<Vec<u32>> = (0..n).map(|i| ((i * pages_per) as u32..((i + 1) * pages_per) as u32).collect()).collect();
        let seqs: Vec<AttnSeq> = (0..n).map(|i| AttnSeq { q_row: i * n_q, n_q, ctx_len: ctx, pages: &pages[i], sampled: n_q == 1 }).collect();
        let q = be.upload_as(&vals(n * n_q * qkv_w, 23), Dtype::Bf16)?;
        let mut out = be.zeros(n * n_q * nq * hd)?;
        be.emulator_reset_counters();
        be.attention(&kv, 0, &q, &seqs, g, &mut out)
    };
    let prefill: Op = Box::new(move |be, n| paged(be, n, SEQ, SEQ));
    let decode: Op = Box::new(move |be, n| paged(be, n, 1, DECODE_CTX));
    let mut rows = Vec::new();
    for (family, call, op, target) in [
        ("attention: dense fwd", format!("8 seq × {SEQ} causal"), fwd, 8),
        ("attention: dense bwd", format!("8 seq × {SEQ} causal"), bwd, 8),
        ("attention: paged prefill", format!("8 seq × {SEQ} causal"), prefill, 8),
        ("attention: paged decode", format!("{DECODE_ROWS} seq × 1 tok, ctx {DECODE_CTX}"), decode, DECODE_ROWS),
    ] {
        let sizes = [1, 2, 3];
        let (cost, miss, names) = extrapolate(be, &*op, sizes, target)?;
        rows.push(Row { family, call, cost, how: format!("measured at {sizes:?} seq, affine fit off by {:.2}% at the third; kernels {}", 100.0 * miss, names.join(", ")) });
    }
    Ok(rows)
}

/// Attention from the op's definition (bf16 Q/K/V/O; causal prefill: half of the L×L scores;
/// forward 2 matmuls QKᵀ and PV, backward 5: QKᵀ again, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K,
/// dK = dSᵀ·Q; exp per score on the SFU). Sequences of `TOKENS` = 8 × 512.
fn attention_by_definition(s: &Shape) -> Vec<Row> {
    let (hd, nq, nkv) = (s.head_dim as f64, s.heads as f64, s.kv_heads as f64);
    let (b, l) = (8.0, 512.0);
    let scores = b * nq * l * (l + 1.0) / 2.0;
    let mm = 2.0 * scores * hd;
    let qkvo = b * l * (2.0 * nq + 2.0 * nkv) * hd * 2.0;
    let ctx = DECODE_CTX as f64;
    let rows = DECODE_ROWS as f64;
    vec![
        Row { family: "attention: dense fwd", call: "8 seq × 512 causal".into(), cost: Cost { hbm: qkvo + b * l * nq * 4.0, tensor: 2.0 * mm, sfu: scores, ..Cost::default() }, how: "definition".into() },
        Row {
            family: "attention: dense bwd",
            call: "8 seq × 512 causal".into(),
            // reads Q, K, V, O, dO and the f32 lse; writes dQ, dK, dV
            cost: Cost { hbm: b * l * hd * 2.0 * (4.0 * nq + 4.0 * nkv) + b * l * nq * 4.0, tensor: 5.0 * mm, sfu: scores, ..Cost::default() },
            how: "definition".into(),
        },
        Row { family: "attention: paged prefill", call: "8 seq × 512 causal".into(), cost: Cost { hbm: qkvo, tensor: 2.0 * mm, sfu: scores, ..Cost::default() }, how: "definition".into() },
        Row {
            family: "attention: paged decode",
            call: format!("{DECODE_ROWS} seq × 1 tok, ctx {DECODE_CTX}"),
            cost: Cost { hbm: rows * (ctx * 2.0 * nkv * hd * 2.0 + 2.0 * nq * hd * 2.0), tensor: rows * 4.0 * ctx * nq * hd, sfu: rows * nq * ctx, ..Cost::default() },
            how: "definition".into(),
        },
    ]
}

fn table(be: &CudaBackend) -> Result<String> {
    let mut s = String::new();
    writeln!(s, "| model | family | call | HBM MB | GFLOP (FP32 / tensor) | SFU Mops | bound µs | set by | source |").unwrap();
    writeln!(s, "|---|---|---|---|---|---|---|---|---|").unwrap();
    for m in &MODELS {
        let mut rows = measured(be, m)?;
        let runs = ["attention_hd64_bf16", "attn_dense_fwd_hd64", "attn_dense_dq_hd64"].iter().all(|k| be.emulator_unsupported(k).is_none());
        if runs {
            rows.extend(attention_measured(be, m)?);
        }
        rows.extend(attention_by_definition(m).into_iter().map(|mut r| {
            r.family = match r.family {
                "attention: dense fwd" => "attention: dense fwd (definition)",
                "attention: dense bwd" => "attention: dense bwd (definition)",
                "attention: paged prefill" => "attention: paged prefill (definition)",
                _ => "attention: paged decode (definition)",
            };
            r
        }));
        for r in rows {
            let (t, by) = r.cost.bound();
            writeln!(
                s,
                "| {} | {} | {} | {:.2} | {:.3} / {:.3} | {:.2} | {:.2} | {by} | {} |",
                m.name,
                r.family,
                r.call,
                r.cost.hbm / 1e6,
                r.cost.fp / 1e9,
                r.cost.tensor / 1e9,
                r.cost.sfu / 1e6,
                t * 1e6,
                r.how
            )
            .unwrap();
        }
    }
    Ok(s)
}

#[test]
#[ignore = "minutes of interpretation: prints docs/KERNEL-BOUNDS.md's table"]
fn kernel_bounds_table() {
    let be = match CudaBackend::emulated() {
        Ok(b) => b,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let t = std::time::Instant::now();
    let s = table(&be).unwrap();
    println!("{s}\n(H200 peaks: HBM {:.1} TB/s, tensor bf16 {:.0} TFLOP/s, FP32 {:.0} TFLOP/s, SFU {:.2} Tops/s; {:.0} s of interpretation)", HBM_BPS / 1e12, TENSOR_FLOPS / 1e12, FP32_FLOPS / 1e12, SFU_OPS / 1e12, t.elapsed().as_secs_f64());
}

/// The fit and the counters agree on a kernel whose traffic is known exactly: add_rmsnorm over
/// t rows of d reads resid (f32) and delta (f32), writes resid back and out (bf16), and reads w
/// (bf16) once: 4d + 4d + 2d bytes per row + 2d, in whole 32-byte sectors.
#[test]
fn the_fit_reproduces_a_known_traffic() {
    let Ok(be) = CudaBackend::emulated() else { return };
    let d = 512usize;
    let op = move |be: &CudaBackend, t: usize| -> Result<()> {
        let mut resid = be.upload_as(&vals(t * d, 1), Dtype::F32)?;
        let (delta, w) = (be.upload_as(&vals(t * d, 2), Dtype::F32)?, be.upload(&vals(d, 3))?);
        let mut out = be.zeros(t * d)?;
        be.add_rmsnorm(&mut resid, &delta, &w, 1e-6, t, d, &mut out)
    };
    let (c, miss, _) = extrapolate(&be, &op, [2, 4, 6], 1000).unwrap();
    // read sectors: resid + delta + w; written: resid + out (distinct sets, so 4d counted twice)
    let want = 1000.0 * (4.0 * d as f64 * 2.0 + 4.0 * d as f64 + 2.0 * d as f64) + 2.0 * d as f64;
    assert!(miss < 1e-9, "add_rmsnorm's counts are affine in rows: miss {miss}");
    assert_eq!(c.hbm, want, "hbm bytes");
}

/// The counters on real kernels whose access patterns are known: rows of contiguous elements,
/// each warp reading consecutive words, so every global request touches exactly the ideal
/// number of sectors; the per-kernel table is printed.
#[test]
fn row_kernels_are_coalesced() {
    let Ok(be) = CudaBackend::emulated() else { return };
    let (t, d, inter) = (4usize, 2048usize, 1536usize);
    be.emulator_reset_counters();
    let x = be.upload_as(&vals(t * d, 1), Dtype::F32).unwrap();
    let w = be.upload(&vals(d, 2)).unwrap();
    let mut out = be.zeros(t * d).unwrap();
    be.rmsnorm(&x, &w, 1e-6, t, d, &mut out).unwrap();
    let gu = be.upload_as(&vals(t * 2 * inter, 3), Dtype::F32).unwrap();
    let mut act = be.zeros(t * inter).unwrap();
    be.swiglu(&gu, t, inter, &mut act).unwrap();
    let snap = be.emulator_counters().unwrap();
    println!("{}", super::emulated::counters_table(&snap));
    for name in ["rmsnorm_f32", "swiglu_f32"] {
        let k = &snap[name];
        assert_eq!(k.launches, 1, "{name}");
        let c = &k.counters;
        assert!(c.global_ld.requests > 0 && c.global_st.requests > 0, "{name}: {c}");
        assert_eq!(c.global_ld.actual, c.global_ld.ideal, "{name}: loads not coalesced: {c}");
        assert_eq!(c.global_st.actual, c.global_st.ideal, "{name}: stores not coalesced: {c}");
    }
    // rmsnorm reads x (f32) and w (bf16), writes out (bf16): every byte once
    assert_eq!(snap["rmsnorm_f32"].counters.hbm_bytes() as usize, t * d * 4 + d * 2 + t * d * 2);
    assert_eq!(snap["swiglu_f32"].counters.hbm_bytes() as usize, t * 2 * inter * 4 + t * inter * 2);
}
