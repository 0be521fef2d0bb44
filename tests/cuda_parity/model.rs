//! Whole models on the device against the CPU: generation, scoring, batched = one by one.
use super::*;

/// The same checkpoint on the CPU with bf16-rounded weights (the reference) and on the device.
fn pair(cfg: ModelConfig, w: ModelWeights) -> (Model<CpuBackend>, Model<CudaBackend>) {
    let mut wr = w;
    round_weights(&mut wr);
    let dir = std::path::Path::new("(in memory)");
    let c = Model::from_weights(cfg.clone(), wr.clone(), None, CpuBackend::new(), dir).unwrap();
    let d = Model::from_weights(cfg, wr, None, own_backend(), dir).unwrap();
    (c, d)
}

/// Greedy logits along a fixed token path, one token per step (prefill of `prefix` first).
pub(super) fn step_logits<B: Backend>(m: &Model<B>, prefix: &[u32], path: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = runtime::kv_for(m, prefix.len() + path.len() + 1).unwrap();
    let mut seq = Seq::default();
    let mut out = Vec::new();
    let mut feed = prefix.to_vec();
    for i in 0..=path.len() {
        let mut e = [Entry { seq: &mut seq, tokens: &feed, want: Want::Logits, sampled: false }];
        out.push(m.step(&mut kv, &mut e).unwrap().remove(0).logits.unwrap());
        if i < path.len() {
            feed = vec![path[i]];
        }
    }
    out
}

/// Device logits along a fixed token path (`step_logits`: prefill of `prefix`, then one token of
/// `path` per step) against the CPU reference's: every logit within `model_tol` of it. Returns
/// the largest difference.
pub(super) fn check_step_logits<D: Backend>(what: &str, c: &Model<CpuBackend>, d: &Model<D>, prefix: &[u32], path: &[u32]) -> f32 {
    let (want, got) = (step_logits(c, prefix, path), step_logits(d, prefix, path));
    assert_eq!(got.len(), want.len());
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: step {i}: logits");
        for (j, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(a.is_finite() && (a - b).abs() <= model_tol(*b), "{what}: step {i} logit {j}: device {a} vs reference {b}");
            worst = worst.max((a - b).abs());
        }
    }
    println!("{what}: {} steps of {} logits, max |Δ| {worst:.2e}", got.len(), want[0].len());
    worst
}

/// Whole-model bound on log-probs and logits: every GEMM input, the attention output and the KV
/// cache are bf16 on the device (each a 2^-8 relative rounding, ~6 per layer), so the device's
/// logits carry ~1e-2 relative noise; log-probs inherit it in proportion to their magnitude.
pub(super) fn model_tol(reference: f32) -> f32 {
    5e-2 + 2e-2 * reference.abs()
}

fn greedy_req(prefix: &[u32], n: usize) -> GenRequest {
    GenRequest {
        seq: Seq::default(),
        feed: prefix.to_vec(),
        max_new: n,
        params: SampleParams::GREEDY,
        rng: Rng::new(0),
        stop_ids: vec![],
        stop_strings: vec![],
        keep_seq: false,
    }
}

/// Greedy generation on the device of one prompt, checked by `check_path`.
fn check_greedy(what: &str, c: &Model<CpuBackend>, d: &Model<CudaBackend>, prefix: &[u32], n: usize) {
    let mut dkv = runtime::kv_for(d, prefix.len() + n + 1).unwrap();
    let got = runtime::generate(d, &mut dkv, vec![greedy_req(prefix, n)], SchedOptions::default(), |_| {}).unwrap().remove(0).new_ids;
    check_path(what, c, prefix, &got);
}

/// A device greedy path follows the CPU reference's argmax at every step where the reference's
/// top-1/top-2 margin exceeds max(0.1, 1e-2·|top logit|) — a fixed 0.1-logit margin, widened for large
/// logits since the device's logits carry bf16-level relative noise; after a near-tie the paths
/// may legitimately part, so the comparison stops there.
fn check_path(what: &str, c: &Model<CpuBackend>, prefix: &[u32], got: &[u32]) {
    let logits = step_logits(c, prefix, got);
    for (i, &t) in got.iter().enumerate() {
        let row = &logits[i];
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        let (top, second) = (row[idx[0]], row[idx[1]]);
        if top - second <= (1e-2 * top.abs()).max(0.1) {
            eprintln!("{what}: step {i}: reference margin {} under the noise bound; stop comparing", top - second);
            return;
        }
        assert_eq!(t as usize, idx[0], "{what}: step {i}: device picked {t}, reference argmax {} (margin {})", idx[0], top - second);
    }
}

fn tiny_pair(arch: &str) -> (Model<CpuBackend>, Model<CudaBackend>) {
    let dir = fixtures().join(format!("tiny-{arch}"));
    let cfg = ModelConfig::load(&dir).unwrap();
    let w = ModelWeights::load(&dir, &cfg).unwrap();
    pair(cfg, w)
}

fn score_one<B: Backend>(m: &Model<B>, ctx: &[u32], tgt: &[u32]) -> Vec<f32> {
    let mut kv = runtime::kv_for(m, ctx.len() + tgt.len() + 16).unwrap();
    let r = ScoreRequest { seq: Seq::default(), context: ctx.to_vec(), targets: tgt.to_vec(), keep_seq: false };
    runtime::score(m, &mut kv, vec![r], SchedOptions::default()).unwrap().remove(0).logprobs
}

#[test]
fn tiny_models_generate_and_score() {
    let _ = cuda_or_skip!();
    let cases = cases();
    // every fixture family (tests/common: Llama, Qwen2, Qwen3 with its q/k norms and
    // head_dim ≠ hidden/heads, Mistral, Llama-3.2 with llama3 RoPE scaling)
    for arch in ARCHS {
        let (mut c, mut d) = tiny_pair(arch);
        let g = &cases[arch]["greedy"];
        check_greedy(&format!("tiny-{arch} greedy"), &c, &d, &ids(&g["prefix"]), 12);
        for with_lora in [false, true] {
            if with_lora {
                let a = fixtures().join(format!("tiny-{arch}-lora"));
                c.load_adapter(&a).unwrap();
                d.load_adapter(&a).unwrap();
            }
            let gain = &cases[arch]["gain"];
            for ctx_key in ["with_ctx", "without_ctx"] {
                let (ctx, tgt) = (ids(&gain[ctx_key]), ids(&gain["target"]));
                let want = score_one(&c, &ctx, &tgt);
                let got = score_one(&d, &ctx, &tgt);
                for (j, (g_, w_)) in got.iter().zip(&want).enumerate() {
                    assert!((g_ - w_).abs() <= model_tol(*w_), "tiny-{arch} lora={with_lora} {ctx_key} target {j}: {g_} vs {w_}");
                }
            }
        }
    }
}

/// One Qwen2-0.5B-shaped layer (hidden 896, 14/2 heads of 64, inter 4864, vocab 151936, tied
/// head, q/k/v bias), HF-like init (std 0.02): batched scoring with a forked shared prefix, and
/// batched greedy decoding of rows of different lengths in one step.
#[test]
fn qwen2_half_b_layer_batched() {
    let _ = cuda_or_skip!();
    let cfg = ModelConfig::from_json(&serde_json::json!({
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 1,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": true, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "eos_token_id": 151645, "hidden_act": "silu"
    }))
    .unwrap();
    let mut rng = Rng::new(7);
    let (d, inter, qkv) = (cfg.hidden, cfg.intermediate, cfg.q_dim() + 2 * cfg.kv_dim());
    let t = |rng: &mut Rng, shape: Vec<usize>, std: f32| {
        let n = shape.iter().product();
        HostTensor::new(shape, randn(rng, n, std))
    };
    let ones = |n: usize| HostTensor::new(vec![n], vec![1.0; n]);
    let layer = LayerWeights {
        attn_norm: ones(d),
        qkv: t(&mut rng, vec![qkv, d], 0.02),
        qkv_bias: Some(t(&mut rng, vec![qkv], 0.1)),
        qk_norm: None,
        o_bias: None,
        o: t(&mut rng, vec![d, cfg.q_dim()], 0.02),
        mlp_norm: ones(d),
        gate_up: t(&mut rng, vec![2 * inter, d], 0.02),
        down: t(&mut rng, vec![d, inter], 0.02),
    };
    let w = ModelWeights { embed: t(&mut rng, vec![cfg.vocab, d], 0.02), layers: vec![layer], final_norm: ones(d), lm_head: None };
    let (c, dm) = pair(cfg.clone(), w);

    let prompt: Vec<u32> = (0..700).map(|_| rng.below(150_000) as u32).collect();
    let tails: Vec<Vec<u32>> = (0..3).map(|i| (0..40 + 30 * i).map(|_| rng.below(150_000) as u32).collect()).collect();
    // scoring: a cached shared prefix, forked three times, each fork scored on its own tail
    fn score_forks<B: Backend>(m: &Model<B>, prompt: &[u32], tails: &[Vec<u32>]) -> Vec<Vec<f32>> {
        let mut kv = runtime::kv_for(m, 4 * 1000).unwrap();
        let mut base = Seq::default();
        let mut e = [Entry { seq: &mut base, tokens: prompt, want: Want::Nothing, sampled: false }];
        m.step(&mut kv, &mut e).unwrap();
        let reqs = tails
            .iter()
            .map(|t| ScoreRequest { seq: kv.fork(&base), context: t[..10].to_vec(), targets: t[10..].to_vec(), keep_seq: false })
            .collect();
        runtime::score(m, &mut kv, reqs, SchedOptions { max_batch_tokens: 64 }).unwrap().into_iter().map(|o| o.logprobs).collect()
    }
    let want = score_forks(&c, &prompt, &tails);
    let got = score_forks(&dm, &prompt, &tails);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        for (j, (a, b)) in g.iter().zip(w).enumerate() {
            assert!((a - b).abs() <= model_tol(*b), "0.5B layer fork {i} target {j}: {a} vs {b}");
        }
    }
    // greedy decoding of a batch whose rows have different lengths (prefill + decode mixed)
    for (i, tail) in tails.iter().enumerate() {
        let mut p = prompt[..100 * (i + 1)].to_vec();
        p.extend_from_slice(tail);
        check_greedy(&format!("0.5B layer prompt {i}"), &c, &dm, &p, 6);
    }
    // one batched generate: five prompts of different lengths, prefill chunks and decode rows
    // mixed in the same steps; each device path is checked against the CPU reference
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt[..50 + 130 * i].to_vec()).collect();
    let mut dkv = runtime::kv_for(&dm, 5 * 700).unwrap();
    let reqs = prompts.iter().map(|p| greedy_req(p, 8)).collect();
    let outs = runtime::generate(&dm, &mut dkv, reqs, SchedOptions { max_batch_tokens: 256 }, |_| {}).unwrap();
    for (i, (p, o)) in prompts.iter().zip(&outs).enumerate() {
        check_path(&format!("0.5B layer batched request {i}"), &c, p, &o.new_ids);
    }
}

/// Qwen3 per-layer shapes for the whole-model tests (model_train.rs' `qwen3_shape_*`):
/// (name, hidden, n_heads, n_kv_heads, intermediate), head_dim 128 (so q is n_heads·128 wide,
/// not hidden), rms eps 1e-6, rope_theta 1e6, tied head — Qwen3-1.7B's and Qwen3-4B's layers.
pub(super) const QWEN3_SHAPES: [(&str, usize, usize, usize, usize); 2] = [("qwen3-1.7b", 2048, 16, 8, 6144), ("qwen3-4b", 2560, 32, 8, 9728)];

/// A random-weight Qwen3 checkpoint with `shape`'s layer sizes, `layers` layers and a vocabulary
/// of `vocab`, written as an HF directory (config.json + model.safetensors in bf16, tied head, HF
/// tensor names including `self_attn.q_norm.weight` / `k_norm.weight`) in a temporary directory,
/// for the engine's own reader. HF-like init: projections and embeddings normal(0, 0.02),
/// attention/MLP/final norms 1; the q/k norm weights random around 1 (q and k different, as in
/// trained checkpoints, so a swap or an indexing error shows). Returns the directory (kept alive
/// by the TempDir) and the path.
pub(super) fn qwen3_shape_dir(shape: (&str, usize, usize, usize, usize), layers: usize, vocab: usize, seed: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    use safetensors::tensor::TensorView;
    let (name, d, nh, nkv, inter) = shape;
    let hd = 128;
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": d, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
        "vocab_size": vocab, "tie_word_embeddings": true, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "attention_bias": false, "hidden_act": "silu", "use_sliding_window": false,
        "sliding_window": null, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    let mut rng = Rng::new(seed);
    let bytes = |v: Vec<f32>| -> Vec<u8> { v.into_iter().flat_map(|x| half::bf16::from_f32(x).to_le_bytes()).collect() };
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, data: Vec<f32>| tensors.push((name, shape, bytes(data)));
    add("model.embed_tokens.weight".into(), vec![vocab, d], randn(&mut rng, vocab * d, 0.02));
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![d], vec![1.0; d]);
        add(format!("{p}.self_attn.q_proj.weight"), vec![nh * hd, d], randn(&mut rng, nh * hd * d, 0.02));
        add(format!("{p}.self_attn.k_proj.weight"), vec![nkv * hd, d], randn(&mut rng, nkv * hd * d, 0.02));
        add(format!("{p}.self_attn.v_proj.weight"), vec![nkv * hd, d], randn(&mut rng, nkv * hd * d, 0.02));
        add(format!("{p}.self_attn.q_norm.weight"), vec![hd], (0..hd).map(|_| 1.0 + 0.3 * rng.normal() as f32).collect());
        add(format!("{p}.self_attn.k_norm.weight"), vec![hd], (0..hd).map(|_| 0.8 + 0.2 * rng.normal() as f32).collect());
        add(format!("{p}.self_attn.o_proj.weight"), vec![d, nh * hd], randn(&mut rng, d * nh * hd, 0.02));
        add(format!("{p}.post_attention_layernorm.weight"), vec![d], vec![1.0; d]);
        add(format!("{p}.mlp.gate_proj.weight"), vec![inter, d], randn(&mut rng, inter * d, 0.02));
        add(format!("{p}.mlp.up_proj.weight"), vec![inter, d], randn(&mut rng, inter * d, 0.02));
        add(format!("{p}.mlp.down_proj.weight"), vec![d, inter], randn(&mut rng, d * inter, 0.02));
    }
    add("model.norm.weight".into(), vec![d], vec![1.0; d]);
    let views: Vec<(String, TensorView)> = tensors.iter().map(|(n, s, b)| (n.clone(), TensorView::new(safetensors::Dtype::BF16, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    (t, dir)
}

/// The Qwen3 directory writer produces what the engine reads as Qwen3 (runs without a GPU): the
/// config's geometry, the q/k norm weights at their place, the tied head, bf16-exact values.
#[test]
fn qwen3_shape_dir_loads_as_qwen3() {
    let shape = ("qwen3-small", 256, 4, 2, 384);
    let (_t, dir) = qwen3_shape_dir(shape, 2, 64, 5);
    let cfg = ModelConfig::load(&dir).unwrap();
    assert_eq!((cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.q_dim(), cfg.intermediate, cfg.vocab), (256, 4, 2, 128, 512, 384, 64));
    assert!(cfg.qk_norm && !cfg.qkv_bias, "qwen3: q/k norms, no q/k/v bias");
    assert_eq!(cfg.rms_eps, 1e-6);
    let w = ModelWeights::load(&dir, &cfg).unwrap();
    assert!(w.lm_head.is_none(), "tied head");
    assert_eq!(w.layers.len(), 2);
    for l in &w.layers {
        let (qn, kn) = l.qk_norm.as_ref().expect("q/k norm weights");
        assert_eq!((qn.shape.as_slice(), kn.shape.as_slice()), (&[128usize][..], &[128usize][..]));
        assert!(qn.data != kn.data && qn.data.iter().all(|&x| x == bf(x)));
        assert_eq!(l.qkv.shape, vec![512 + 2 * 256, 256]);
    }
}
