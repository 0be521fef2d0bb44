//! Whole models on the device against the CPU: generation, scoring, batched = one by one.
use super::*;

/// The same checkpoint on the CPU with bf16-rounded weights (the reference) and on the device.
fn pair(cfg: ModelConfig, w: ModelWeights) -> (Model<CpuBackend>, Model<CudaBackend>) {
    let mut wr = w;
    round_weights(&mut wr);
    let dir = std::path::Path::new("(in memory)");
    let c = Model::from_weights(cfg.clone(), wr.clone(), None, CpuBackend::new(), dir).unwrap();
    let d = Model::from_weights(cfg, wr, None, CudaBackend::new(0).unwrap(), dir).unwrap();
    (c, d)
}

/// Greedy logits along a fixed token path, one token per step (prefill of `prefix` first).
fn step_logits<B: Backend>(m: &Model<B>, prefix: &[u32], path: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = runtime::kv_for(m, prefix.len() + path.len() + 1).unwrap();
    let mut seq = Seq::default();
    let mut out = Vec::new();
    let mut feed = prefix.to_vec();
    for i in 0..=path.len() {
        let mut e = [Entry { seq: &mut seq, tokens: &feed, want: Want::Logits }];
        out.push(m.step(&mut kv, &mut e).unwrap().remove(0).logits.unwrap());
        if i < path.len() {
            feed = vec![path[i]];
        }
    }
    out
}

/// Whole-model bound on log-probs and logits: every GEMM input, the attention output and the KV
/// cache are bf16 on the device (each a 2^-8 relative rounding, ~6 per layer), so the device's
/// logits carry ~1e-2 relative noise; log-probs inherit it in proportion to their magnitude.
fn model_tol(reference: f32) -> f32 {
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
    for arch in ["llama", "qwen2"] {
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
        let mut e = [Entry { seq: &mut base, tokens: prompt, want: Want::Nothing }];
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
