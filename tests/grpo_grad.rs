//! GRPO loss and LoRA gradients: the fixtures (PyTorch + PEFT), central finite differences of the
//! whole LoRA gradient on a random tiny model, and per-op gradient checks of the training ops
//! (`TrainBackend` on the CPU) against finite differences of float64 reference implementations.
//!
//! Tolerances (stated where checked):
//! - fixtures: loss within 1e-5, each gradient tensor ‖Δ‖/‖ref‖ ≤ 1e-3, clipped tokens exact;
//! - whole model (f32 forward, Richardson-extrapolated central differences): directional
//!   derivatives within 1e-3·‖g‖, single coordinates within 2e-2 relative (+ 2e-3 of the largest gradient);
//! - ops (float64 reference, h = 1e-5): ‖analytic − FD‖/‖FD‖ ≤ 1e-4 over the checked coordinates.
//!
//! Training-step throughput is measured by `infomem-engine bench --work train`, not here.
mod common;

use common::{cases, expected, fixtures, ARCHS};
use infomem_engine::backend::cpu::{CpuBackend, CpuBuf};
use infomem_engine::backend::{AdamWStep, DenseSeq, TrainBackend};
use infomem_engine::backend::{AttnGeom, Backend};
use infomem_engine::model::config::ModelConfig;
use infomem_engine::model::lora::{LoraAdapter, Proj, ALL_PROJS};
use infomem_engine::model::weights::{HostTensor, LayerWeights, ModelWeights};
use infomem_engine::rl::grpo::{self, Conversation, GrpoConfig};
use infomem_engine::runtime::backward::{response_logprobs, Policy, TrainSeq};
use infomem_engine::runtime::Model;
use infomem_engine::util::rng::Rng;
use serde_json::json;
use std::path::Path;

fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    num / den.max(1e-300)
}

/// `randn` as a backend buffer.
fn randb(rng: &mut Rng, n: usize, s: f64) -> CpuBuf {
    randn(rng, n, s).into()
}

fn randn(rng: &mut Rng, n: usize, s: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * s) as f32).collect()
}

// =============================================================================================
// Fixtures

fn fixture_model(arch: &str) -> Model<CpuBackend> {
    let g = &cases()[arch]["grpo"];
    let mut m = common::tiny(arch);
    m.load_adapter(&fixtures().join(g["adapter_dir"].as_str().unwrap())).unwrap();
    m
}

fn fixture_case(arch: &str) {
    fixture_case_on(arch, fixture_model(arch));
}

fn fixture_case_on(arch: &str, model: Model<CpuBackend>) {
    let g = &cases()[arch]["grpo"];
    let batch = grpo::parse_batch(&serde_json::to_string(g).unwrap(), model.cfg.vocab).unwrap();
    let (st, grads) = grpo::loss_and_grads(&model, &batch.conversations, &batch.cfg).unwrap();
    let want_loss = g["loss"].as_f64().unwrap();
    println!("{arch}: loss {:.10} vs {want_loss:.10} (|Δ| {:.2e})", st.loss, (st.loss - want_loss).abs());
    assert!((st.loss - want_loss).abs() < 1e-5, "{arch}: loss {} vs {want_loss}", st.loss);
    assert_eq!(st.clipped_tokens as u64, g["clipped_tokens"].as_u64().unwrap(), "{arch}: clipped tokens");
    assert_eq!(st.response_tokens as u64, g["response_tokens"].as_u64().unwrap());
    let got = grads.to_peft(&model).unwrap();
    let prefix = g["grad_prefix"].as_str().unwrap();
    let mut worst = (0.0, String::new());
    let mut n = 0;
    for (name, t) in &got {
        let (shape, want) = expected(&format!("{prefix}{name}"));
        assert_eq!(shape, t.shape, "{name}");
        let e = rel_err(&t.data.iter().map(|&x| x as f64).collect::<Vec<_>>(), &want.iter().map(|&x| x as f64).collect::<Vec<_>>());
        if e > worst.0 {
            worst = (e, name.clone());
        }
        n += 1;
    }
    assert_eq!(n, 28, "2 layers × 7 projections × (A, B)");
    println!("{arch}: worst gradient ‖Δ‖/‖ref‖ = {:.2e} ({})", worst.0, worst.1);
    assert!(worst.0 <= 1e-3, "{arch}: {} relative error {:.3e}", worst.1, worst.0);
}

#[test]
fn fixture_llama() {
    fixture_case("llama");
}

#[test]
fn fixture_qwen2() {
    fixture_case("qwen2");
}

/// The training passes with LoRA kept unmerged (low-rank products beside the frozen weights, as
/// `--dtype bf16` runs them) give PyTorch's gradients within the same 1e-3.
#[test]
fn fixture_unmerged_lora_all_families() {
    for arch in ARCHS {
        let g = &cases()[arch]["grpo"];
        let mut m = Model::load(&fixtures().join(format!("tiny-{arch}")), CpuBackend::new().with_unmerged_lora()).unwrap();
        m.load_adapter(&fixtures().join(g["adapter_dir"].as_str().unwrap())).unwrap();
        fixture_case_on(arch, m);
    }
}

/// Through Qwen3's per-head q/k norms, with q wider than the hidden size.
#[test]
fn fixture_qwen3() {
    fixture_case("qwen3");
}

#[test]
fn fixture_mistral() {
    fixture_case("mistral");
}

/// Llama 3.2 style: tied head, `llama3` RoPE scaling.
#[test]
fn fixture_llama32() {
    fixture_case("llama32");
}

/// Missing `ref_logprobs` are computed with the LoRA off: they must match the fixture's
/// (PyTorch, LoRA off); missing `old_logprobs` mean ratio 1 (nothing clipped).
#[test]
fn fixture_defaults_for_old_and_ref() {
    for arch in ARCHS {
        let g = &cases()[arch]["grpo"];
        let model = fixture_model(arch);
        let full = grpo::parse_batch(&serde_json::to_string(g).unwrap(), model.cfg.vocab).unwrap();
        let mut no_ref = full.conversations.clone();
        no_ref.iter_mut().for_each(|c| c.ref_logprobs = None);
        let refs = grpo::reference_logprobs(&model, &no_ref, &full.cfg).unwrap();
        let mut worst = 0f32;
        for (c, r) in full.conversations.iter().zip(&refs) {
            for (a, b) in c.ref_logprobs.as_ref().unwrap().iter().zip(r.as_ref().unwrap()) {
                worst = worst.max((a - b).abs());
            }
        }
        println!("{arch}: LoRA-off log-probs vs fixture ref_logprobs: max |Δ| {worst:.2e}");
        assert!(worst < 1e-3, "{arch}: reference log-probs off by {worst}");
        let (a, _) = grpo::loss_and_grads(&model, &full.conversations, &full.cfg).unwrap();
        let (b, _) = grpo::loss_and_grads(&model, &no_ref, &full.cfg).unwrap();
        assert!((a.loss - b.loss).abs() < 1e-4, "{arch}: loss with computed ref {} vs given {}", b.loss, a.loss);

        let mut no_old = full.conversations.clone();
        no_old.iter_mut().for_each(|c| c.old_logprobs = None);
        let (st, _) = grpo::loss_and_grads(&model, &no_old, &full.cfg).unwrap();
        assert_eq!(st.clipped_tokens, 0);
        assert!((st.ratio_mean - 1.0).abs() < 1e-12);
        // old = the current policy's log-probs computed separately gives the same loss
        let cur = grpo::current_logprobs(&model, &full.conversations).unwrap();
        let mut old_cur = full.conversations.clone();
        old_cur.iter_mut().zip(cur).for_each(|(c, lp)| c.old_logprobs = Some(lp));
        let (st2, _) = grpo::loss_and_grads(&model, &old_cur, &full.cfg).unwrap();
        assert!((st.loss - st2.loss).abs() < 1e-5, "{} vs {}", st.loss, st2.loss);
    }
}

/// Gradient accumulation: micro-batches with `token_norm` = the whole batch's tokens add up to
/// the full batch (loss and every gradient); a conversation with no response tokens adds nothing.
#[test]
fn micro_batches_add_up() {
    let g = &cases()["qwen2"]["grpo"];
    let model = fixture_model("qwen2");
    let b = grpo::parse_batch(&serde_json::to_string(g).unwrap(), model.cfg.vocab).unwrap();
    let cfg = GrpoConfig { token_norm: 19, ..b.cfg };
    let (full, gfull) = grpo::loss_and_grads(&model, &b.conversations, &cfg).unwrap();
    let (s1, mut g1) = grpo::loss_and_grads(&model, &b.conversations[..2], &cfg).unwrap();
    let (s2, g2) = grpo::loss_and_grads(&model, &b.conversations[2..], &cfg).unwrap();
    g1.add(&model.be, &g2).unwrap();
    assert!((s1.loss + s2.loss - full.loss).abs() < 1e-7, "{} + {} vs {}", s1.loss, s2.loss, full.loss);
    assert_eq!(s1.clipped_tokens + s2.clipped_tokens, full.clipped_tokens);
    let (a, f) = (g1.to_peft(&model).unwrap(), gfull.to_peft(&model).unwrap());
    for (k, t) in &f {
        let e = rel_err(&f64v(&a[k].data), &f64v(&t.data));
        assert!(e < 1e-5, "{k}: micro-batch sum vs full batch {e}");
    }
    let mut with_empty = b.conversations.clone();
    with_empty.insert(1, Conversation { prompt: vec![5, 6], response: vec![], advantage: 3.0, old_logprobs: None, ref_logprobs: None });
    let (se, ge) = grpo::loss_and_grads(&model, &with_empty, &b.cfg).unwrap();
    assert!((se.loss - full.loss).abs() < 1e-7);
    let ge = ge.to_peft(&model).unwrap();
    for (k, t) in &f {
        assert!(rel_err(&f64v(&ge[k].data), &f64v(&t.data)) < 1e-5, "{k}");
    }
}

#[test]
fn batch_file_errors() {
    let model = common::tiny("llama");
    let base = json!({"eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.05,
        "conversations": [{"prompt": [1, 2, 3], "response": [4, 5], "advantage": 1.0},
                          {"prompt": [6], "response": [7, 8, 9], "advantage": -1.0, "old_logprobs": [-1.0, -2.0, -3.0]}]});
    let err = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = base.clone();
        f(&mut v);
        format!("{:#}", grpo::parse_batch(&v.to_string(), model.cfg.vocab).unwrap_err())
    };
    assert!(grpo::parse_batch(&base.to_string(), model.cfg.vocab).is_ok());
    let e = err(&|v| v["conversations"][1]["old_logprobs"] = json!([-1.0]));
    assert!(e.contains("conversation 1") && e.contains("old_logprobs has 1 values but the response has 3 tokens"), "{e}");
    let e = err(&|v| v["conversations"][0]["response"] = json!([4, 512]));
    assert!(e.contains("conversation 0") && e.contains("response[1] = 512 is outside the vocabulary (size 512)"), "{e}");
    let e = err(&|v| {
        v["conversations"][1].as_object_mut().unwrap().remove("prompt");
    });
    assert!(e.contains("conversation 1") && e.contains("missing field \"prompt\""), "{e}");
    let e = err(&|v| v["conversations"][0]["ref_logprobs"] = json!([-1.0, "x"]));
    assert!(e.contains("conversation 0") && e.contains("ref_logprobs[1] must be a number"), "{e}");
    let e = err(&|v| {
        v.as_object_mut().unwrap().remove("eps_high");
    });
    assert!(e.contains("eps_high"), "{e}");
    // Python's json.dump writes NaN bare
    let text = base.to_string().replace("[-1.0,-2.0,-3.0]", "[-1.0,NaN,-3.0]");
    let e = format!("{:#}", grpo::parse_batch(&text, model.cfg.vocab).unwrap_err());
    assert!(e.contains("conversation 1") && e.contains("old_logprobs[1] is NaN"), "{e}");
    let text = base.to_string().replace("\"advantage\":1.0", "\"advantage\":-Infinity");
    let e = format!("{:#}", grpo::parse_batch(&text, model.cfg.vocab).unwrap_err());
    assert!(e.contains("conversation 0") && e.contains("advantage is -Infinity"), "{e}");
}

// =============================================================================================
// Whole model: central finite differences of the full LoRA gradient

fn random_model(arch: &str, seed: u64) -> Model<CpuBackend> {
    random_model_on(arch, seed, CpuBackend::new())
}

/// `random_model` on a given CPU backend (f32 or bf16 weights).
fn random_model_on(arch: &str, seed: u64, backend: CpuBackend) -> Model<CpuBackend> {
    let cfg = ModelConfig::from_json(&json!({
        "model_type": arch, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        // Qwen3: head_dim 12, so q (48 wide) is wider than hidden (32), as in Qwen3-4B
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": if arch == "qwen3" { 12 } else { 8 }, "vocab_size": 97,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": arch == "llama"
    }))
    .unwrap();
    let mut rng = Rng::new(seed);
    let (d, q, kv, i) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
    let mut t = |shape: Vec<usize>, s: f64| {
        let n = shape.iter().product();
        HostTensor::new(shape, randn(&mut rng, n, s))
    };
    let norm = |rng: &mut Rng| HostTensor::new(vec![d], (0..d).map(|_| (1.0 + 0.1 * rng.normal()) as f32).collect());
    let mut layers = Vec::new();
    let mut nrng = Rng::new(seed + 1);
    for _ in 0..cfg.n_layers {
        layers.push(LayerWeights {
            attn_norm: norm(&mut nrng),
            qkv: t(vec![q + 2 * kv, d], 1.0 / (d as f64).sqrt()),
            o_bias: None,
            qkv_bias: if cfg.qkv_bias { Some(t(vec![q + 2 * kv], 0.1)) } else { None },
            qk_norm: cfg.qk_norm.then(|| {
                let hn = |rng: &mut Rng| HostTensor::new(vec![cfg.head_dim], (0..cfg.head_dim).map(|_| (1.0 + 0.2 * rng.normal()) as f32).collect());
                (hn(&mut nrng), hn(&mut nrng))
            }),
            o: t(vec![d, q], 1.0 / (q as f64).sqrt()),
            mlp_norm: norm(&mut nrng),
            gate_up: t(vec![2 * i, d], 1.0 / (d as f64).sqrt()),
            down: t(vec![d, i], 1.0 / (i as f64).sqrt()),
        });
    }
    let embed = t(vec![cfg.vocab, d], 1.0);
    let lm_head = if cfg.tie_word_embeddings { None } else { Some(t(vec![cfg.vocab, d], 2.0 / (d as f64).sqrt())) };
    let w = ModelWeights { embed, layers, final_norm: norm(&mut nrng), lm_head };
    let mut model = Model::from_weights(cfg.clone(), w, None, backend, Path::new("random-tiny")).unwrap();
    let mut ad = LoraAdapter::init(&cfg, 4, 8.0, &ALL_PROJS, seed + 2);
    let mut brng = Rng::new(seed + 3);
    for pair in ad.layers.iter_mut().flatten().flatten() {
        pair.b.data = randn(&mut brng, pair.b.data.len(), 0.1);
    }
    model.set_adapter(ad).unwrap();
    model
}

fn fd_batch(model: &Model<CpuBackend>, seed: u64) -> (Vec<Conversation>, GrpoConfig) {
    let mut rng = Rng::new(seed);
    let v = model.cfg.vocab as u64;
    let mut ids = |n: usize| (0..n).map(|_| rng.below(v) as u32).collect::<Vec<u32>>();
    let shapes = [(5, 4, 1.0), (60, 12, -0.8), (3, 7, 0.5), (1, 3, 1.5)];
    let mut convs: Vec<Conversation> = shapes
        .iter()
        .map(|&(p, r, a)| Conversation { prompt: ids(p), response: ids(r), advantage: a, old_logprobs: None, ref_logprobs: None })
        .collect();
    // Fixed old/ref log-probs near the current ones: ratio inside the clip range and the KL
    // below its clamp, so the loss is smooth around the current parameters.
    let cur = grpo::current_logprobs(model, &convs).unwrap();
    let mut noise = Rng::new(seed + 7);
    for (c, lp) in convs.iter_mut().zip(cur) {
        c.old_logprobs = Some(lp.iter().map(|x| x + (noise.next_f64() * 0.1 - 0.05) as f32).collect());
        c.ref_logprobs = Some(lp.iter().map(|x| x + (noise.next_f64() - 0.5) as f32).collect());
    }
    (convs, GrpoConfig { eps_low: 0.2, eps_high: 0.28, kl_coef: 0.5, token_norm: 1 })
}

/// The loss alone (no-gradient forward), as FD evaluates it.
fn loss_only(model: &Model<CpuBackend>, convs: &[Conversation], c: &GrpoConfig) -> f64 {
    let seqs: Vec<TrainSeq> = convs.iter().map(|c| TrainSeq { prompt: &c.prompt, response: &c.response }).collect();
    let lp = response_logprobs(model, &seqs, Policy::Current).unwrap();
    let scores = infomem_engine::runtime::backward::TokenScores { logprobs: lp, entropy: vec![] };
    grpo::grpo_loss(convs, &scores, &[], c).unwrap().0.loss
}

/// Add `h · dir` to every LoRA tensor (dir laid out like the adapter, A then B per pair).
fn nudge(model: &mut Model<CpuBackend>, dir: &[(usize, Proj, char, Vec<f32>)], h: f64) {
    let lora = model.lora.as_mut().unwrap();
    for (l, p, which, v) in dir {
        let pair = lora.host.layers[*l][p.index()].as_mut().unwrap();
        let t = if *which == 'A' { &mut pair.a.data } else { &mut pair.b.data };
        for (x, dv) in t.iter_mut().zip(v) {
            *x = (*x as f64 + h * *dv as f64) as f32;
        }
    }
    model.sync_adapter().unwrap();
}

/// Central difference along `dir` with steps h = 2e-3 and h/2, Richardson-extrapolated
/// (`(4·D(h/2) − D(h))/3`, truncation error O(h⁴)): large enough steps that f32 rounding of the
/// loss stays negligible, without the O(h²) bias of a plain central difference.
fn richardson(model: &mut Model<CpuBackend>, dir: &[(usize, Proj, char, Vec<f32>)], convs: &[Conversation], c: &GrpoConfig) -> f64 {
    let mut central = |h: f64| {
        nudge(model, dir, h);
        let lp = loss_only(model, convs, c);
        nudge(model, dir, -2.0 * h);
        let lm = loss_only(model, convs, c);
        nudge(model, dir, h);
        (lp - lm) / (2.0 * h)
    };
    let (d1, d2) = (central(2e-3), central(1e-3));
    (4.0 * d2 - d1) / 3.0
}

fn model_fd(arch: &str) {
    let mut model = random_model(arch, 11);
    let (convs, c) = fd_batch(&model, 5);
    let (st, grads) = grpo::loss_and_grads(&model, &convs, &c).unwrap();
    let l0 = loss_only(&model, &convs, &c);
    assert!((st.loss - l0).abs() < 1e-4 * l0.abs().max(1.0), "training-pass loss {} vs scoring-pass loss {l0}", st.loss);
    assert_eq!(st.clipped_tokens, 0);
    // gradients as (layer, proj, A|B, values)
    let mut g: Vec<(usize, Proj, char, Vec<f32>)> = Vec::new();
    for (l, row) in grads.layers.iter().enumerate() {
        for p in ALL_PROJS {
            let (ga, gb) = row[p.index()].as_ref().unwrap();
            g.push((l, p, 'A', ga.to_vec()));
            g.push((l, p, 'B', gb.to_vec()));
        }
    }
    let gmax = g.iter().flat_map(|t| t.3.iter()).fold(0f32, |m, &x| m.max(x.abs())) as f64;
    assert!(gmax > 0.0);

    // (1) directional derivatives: along the gradient itself and along a random direction
    let mut rng = Rng::new(3);
    let random_dir: Vec<_> = g.iter().map(|(l, p, w, v)| (*l, *p, *w, randn(&mut rng, v.len(), 1.0))).collect();
    for (name, dir) in [("gradient", g.clone()), ("random", random_dir)] {
        let norm: f64 = dir.iter().flat_map(|t| t.3.iter()).map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        let unit: Vec<_> = dir.iter().map(|(l, p, w, v)| (*l, *p, *w, v.iter().map(|&x| (x as f64 / norm) as f32).collect())).collect();
        let analytic: f64 = g.iter().zip(&unit).map(|(a, u)| a.3.iter().zip(&u.3).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>()).sum();
        let fd = richardson(&mut model, &unit, &convs, &c);
        // relative to the largest directional derivative there is, ‖g‖ (= `analytic` along g)
        let gnorm: f64 = g.iter().flat_map(|t| t.3.iter()).map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        let e = (analytic - fd).abs() / gnorm;
        println!("{arch}: directional derivative along the {name} direction: analytic {analytic:.6e}, FD {fd:.6e}, |Δ|/‖g‖ {e:.2e}");
        assert!(e < 1e-3, "{arch}: {name} direction: analytic {analytic} vs FD {fd}");
    }

    // (2) single coordinates: the largest entry of every tensor plus a random one
    let mut worst = 0f64;
    let mut checked = 0;
    for (ti, (l, p, which, v)) in g.iter().enumerate() {
        let imax = (0..v.len()).max_by(|&a, &b| v[a].abs().total_cmp(&v[b].abs())).unwrap();
        let irand = Rng::new(ti as u64).below(v.len() as u64) as usize;
        for idx in [imax, irand] {
            let mut e = vec![0f32; v.len()];
            e[idx] = 1.0;
            let dir = vec![(*l, *p, *which, e)];
            let fd = richardson(&mut model, &dir, &convs, &c);
            let a = v[idx] as f64;
            let err = (a - fd).abs() / (a.abs().max(fd.abs()) + 0.1 * gmax);
            worst = worst.max(err);
            checked += 1;
            assert!(
                (a - fd).abs() <= 2e-2 * a.abs().max(fd.abs()) + 2e-3 * gmax,
                "{arch}: layer {l} {} lora_{which}[{idx}]: analytic {a:.6e} vs FD {fd:.6e}",
                p.module()
            );
        }
    }
    println!("{arch}: {checked} coordinates, worst |Δ|/(max(|a|,|fd|) + 0.1·max|g|) = {worst:.2e}");
}

#[test]
fn whole_model_finite_differences_qwen2() {
    model_fd("qwen2");
}

#[test]
fn whole_model_finite_differences_llama() {
    model_fd("llama");
}

/// Qwen3: the gradient flows back through the per-head q/k norms (head_dim ≠ hidden / heads).
#[test]
fn whole_model_finite_differences_qwen3() {
    model_fd("qwen3");
}

// =============================================================================================
// Per-op checks: analytic backward (f32, CpuBackend) vs central differences of a float64
// reference forward (h = 1e-5), ‖Δ‖/‖FD‖ ≤ 1e-4 unless stated.

const H: f64 = 1e-5;

/// Central differences of `f` at the coordinates `idx` of `x`.
fn fd_grad(x: &[f64], idx: &[usize], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut x = x.to_vec();
    idx.iter()
        .map(|&i| {
            let x0 = x[i];
            x[i] = x0 + H;
            let p = f(&x);
            x[i] = x0 - H;
            let m = f(&x);
            x[i] = x0;
            (p - m) / (2.0 * H)
        })
        .collect()
}

fn f64v(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn dot64(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Dense causal GQA attention in f64: (out, lse).
fn attn_ref(qkv: &[f64], seqs: &[DenseSeq], g: AttnGeom) -> (Vec<f64>, Vec<f64>) {
    let (hd, nh, group) = (g.head_dim, g.n_heads, g.n_heads / g.n_kv_heads);
    let (w, qd, kvd) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
    let rows: usize = seqs.iter().map(|s| s.row0 + s.len).max().unwrap();
    let mut out = vec![0.0; rows * qd];
    let mut lse = vec![0.0; rows * nh];
    let scale = 1.0 / (hd as f64).sqrt();
    for s in seqs {
        for qh in 0..nh {
            let kvh = qh / group;
            for i in 0..s.len {
                let r = s.row0 + i;
                let q = &qkv[r * w + qh * hd..r * w + (qh + 1) * hd];
                let sc: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k0 = (s.row0 + j) * w + qd + kvh * hd;
                        scale * dot64(q, &qkv[k0..k0 + hd])
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l = m + sc.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                lse[r * nh + qh] = l;
                for (j, sj) in sc.iter().enumerate() {
                    let p = (sj - l).exp();
                    let v0 = (s.row0 + j) * w + qd + kvd + kvh * hd;
                    for dd in 0..hd {
                        out[r * qd + qh * hd + dd] += p * qkv[v0 + dd];
                    }
                }
            }
        }
    }
    (out, lse)
}

#[test]
fn op_attention_gqa_several_sequences() {
    let be = CpuBackend::new();
    let g = AttnGeom { n_layers: 1, n_heads: 6, n_kv_heads: 2, head_dim: 8, page_size: 16 };
    // lengths 5, 70 (crosses a 64-row tile), 1, 33; rows laid out back to back
    let lens = [5usize, 70, 1, 33];
    let mut seqs = Vec::new();
    let mut row = 0;
    for &len in &lens {
        seqs.push(DenseSeq { row0: row, len });
        row += len;
    }
    let rows = row;
    let w = g.qkv_dim();
    let mut rng = Rng::new(1);
    let qkv = randb(&mut rng, rows * w, 1.0);
    let c = randb(&mut rng, rows * g.q_dim(), 1.0);
    let mut out = CpuBuf::from(vec![0f32; rows * g.q_dim()]);
    let mut lse = CpuBuf::from(vec![0f32; rows * g.n_heads]);
    be.attn_dense(&qkv, &seqs, g, &mut out, &mut lse).unwrap();
    let (out_ref, lse_ref) = attn_ref(&f64v(&qkv), &seqs, g);
    assert!(rel_err(&f64v(&out), &out_ref) < 1e-5, "forward out {:.2e}", rel_err(&f64v(&out), &out_ref));
    assert!(rel_err(&f64v(&lse), &lse_ref) < 1e-5, "forward lse");

    let mut dqkv = CpuBuf::from(vec![f32::NAN; rows * w]);
    be.attn_dense_bwd(&qkv, &out, &c, &lse, &seqs, g, &mut dqkv).unwrap();
    assert!(dqkv.iter().all(|v| v.is_finite()), "every row and column of dqkv is written");
    // rows: first/last of every sequence, both sides of the 64-row tile boundary, a middle one
    let check_rows = [0usize, 4, 5, 6, 40, 68, 69, 70, 74, 75, 90, 107];
    let idx: Vec<usize> = check_rows.iter().flat_map(|&r| (0..w).map(move |j| r * w + j)).collect();
    let c64 = f64v(&c);
    let fd = fd_grad(&f64v(&qkv), &idx, |x| dot64(&attn_ref(x, &seqs, g).0, &c64));
    let an: Vec<f64> = idx.iter().map(|&i| dqkv[i] as f64).collect();
    let e = rel_err(&an, &fd);
    println!("attention backward (GQA 6/2, lengths {lens:?}): ‖Δ‖/‖FD‖ = {e:.2e} over {} coordinates", idx.len());
    assert!(e < 1e-4, "attention backward {e}");
}

#[test]
fn op_rmsnorm_backward() {
    let be = CpuBackend::new();
    let (rows, d, eps) = (70, 40, 1e-5f32);
    let mut rng = Rng::new(2);
    let x = randb(&mut rng, rows * d, 2.0);
    let w: CpuBuf = (0..d).map(|_| (1.0 + 0.3 * rng.normal()) as f32).collect::<Vec<f32>>().into();
    let c = randb(&mut rng, rows * d, 1.0);
    let prior = randb(&mut rng, rows * d, 1.0);
    let mut dx = prior.clone();
    be.rmsnorm_bwd(&x, &w, &c, eps, rows, d, &mut dx, true).unwrap();
    let (w64, c64) = (f64v(&w), f64v(&c));
    let f = |x: &[f64]| {
        let mut l = 0.0;
        for r in 0..rows {
            let xr = &x[r * d..(r + 1) * d];
            let s = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps as f64).sqrt();
            for j in 0..d {
                l += c64[r * d + j] * xr[j] * s * w64[j];
            }
        }
        l
    };
    let idx: Vec<usize> = (0..rows * d).step_by(7).collect();
    let fd = fd_grad(&f64v(&x), &idx, f);
    let an: Vec<f64> = idx.iter().map(|&i| (dx[i] - prior[i]) as f64).collect();
    let e = rel_err(&an, &fd);
    println!("rmsnorm backward: ‖Δ‖/‖FD‖ = {e:.2e}");
    assert!(e < 1e-4, "rmsnorm backward {e}");
}

#[test]
fn op_rope_backward() {
    // RoPE is linear: FD (of the f32 forward, h = 1) equals the transpose exactly up to rounding.
    let be = CpuBackend::new();
    let g = AttnGeom { n_layers: 1, n_heads: 3, n_kv_heads: 1, head_dim: 8, page_size: 16 };
    let w = g.qkv_dim();
    let positions: Vec<u32> = vec![0, 1, 2, 7, 300, 0, 5];
    let rows = positions.len();
    let inv: CpuBuf = (0..4).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / 8.0)).collect::<Vec<f32>>().into();
    let mut rng = Rng::new(3);
    let x = randb(&mut rng, rows * w, 1.0);
    let c = randb(&mut rng, rows * w, 1.0);
    let mut dx = c.clone();
    be.rope_bwd(&mut dx, &positions, &inv, g).unwrap();
    let f = |x: &[f32]| {
        let mut y = CpuBuf::from(x.to_vec());
        be.rope(&mut y, &positions, &inv, g).unwrap();
        dot64(&f64v(&y), &f64v(&c))
    };
    let mut fd = Vec::new();
    for i in 0..rows * w {
        let (mut p, mut m) = (x.clone(), x.clone());
        p[i] += 1.0;
        m[i] -= 1.0;
        fd.push((f(&p) - f(&m)) / 2.0);
    }
    let e = rel_err(&f64v(&dx), &fd);
    println!("rope backward: ‖Δ‖/‖FD‖ = {e:.2e}");
    assert!(e < 1e-5, "rope backward {e}");
}

#[test]
fn op_swiglu_backward() {
    let be = CpuBackend::new();
    let (m, i) = (40, 24);
    let mut rng = Rng::new(4);
    let gu = randb(&mut rng, m * 2 * i, 3.0);
    let c = randb(&mut rng, m * i, 1.0);
    let mut dgu = CpuBuf::from(vec![0f32; m * 2 * i]);
    be.swiglu_bwd(&gu, &c, m, i, &mut dgu).unwrap();
    let c64 = f64v(&c);
    let f = |x: &[f64]| {
        let mut l = 0.0;
        for r in 0..m {
            for j in 0..i {
                let (gv, uv) = (x[r * 2 * i + j], x[r * 2 * i + i + j]);
                l += c64[r * i + j] * gv / (1.0 + (-gv).exp()) * uv;
            }
        }
        l
    };
    let idx: Vec<usize> = (0..m * 2 * i).collect();
    let fd = fd_grad(&f64v(&gu), &idx, f);
    let e = rel_err(&f64v(&dgu), &fd);
    println!("swiglu backward: ‖Δ‖/‖FD‖ = {e:.2e}");
    assert!(e < 1e-4, "swiglu backward {e}");
}

#[test]
fn op_head_backward_tiled() {
    let be = CpuBackend::new();
    // 2500 entries: three vocabulary tiles, the last one partial; rows split across tasks
    let (rows, d, vocab) = (7, 24, 2500);
    let mut rng = Rng::new(5);
    let h = randb(&mut rng, rows * d, 1.0);
    let head = randb(&mut rng, vocab * d, 1.0);
    let targets: Vec<u32> = vec![0, 2499, 1023, 1024, 7, 2048, 1500];
    let c = randb(&mut rng, rows, 1.0);
    let mut g = CpuBuf::from(vec![0f32; rows * d]);
    let out = be.head_grad(&h, &head, &targets, d, vocab, &mut g).unwrap();
    let head64 = f64v(&head);
    // float64 log-probs and entropies
    let logp_ent = |h: &[f64]| -> (Vec<f64>, Vec<f64>) {
        let mut lps = Vec::new();
        let mut ents = Vec::new();
        for r in 0..rows {
            let l: Vec<f64> = (0..vocab).map(|v| dot64(&h[r * d..(r + 1) * d], &head64[v * d..(v + 1) * d])).collect();
            let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            lps.push(l[targets[r] as usize] - lse);
            ents.push(-l.iter().map(|x| (x - lse).exp() * (x - lse)).sum::<f64>());
        }
        (lps, ents)
    };
    let (lp_ref, ent_ref) = logp_ent(&f64v(&h));
    for r in 0..rows {
        assert!((out.logprobs[r] as f64 - lp_ref[r]).abs() < 1e-4, "logp row {r}: {} vs {}", out.logprobs[r], lp_ref[r]);
        assert!((out.entropy[r] as f64 - ent_ref[r]).abs() < 1e-4, "entropy row {r}: {} vs {}", out.entropy[r], ent_ref[r]);
    }
    let c64 = f64v(&c);
    let idx: Vec<usize> = (0..rows * d).collect();
    let fd = fd_grad(&f64v(&h), &idx, |x| dot64(&logp_ent(x).0, &c64));
    // ∂(Σ c·logp)/∂h = −c·g
    let an: Vec<f64> = idx.iter().map(|&i| -(c[i / d] as f64) * g[i] as f64).collect();
    let e = rel_err(&an, &fd);
    println!("head backward (vocab {vocab}, tiles of 1024): ‖Δ‖/‖FD‖ = {e:.2e}");
    assert!(e < 1e-4, "head backward {e}");
}

#[test]
fn op_lora_and_projection_backward() {
    let be = CpuBackend::new();
    let (m, k, r, n_out, ld, col0, scale) = (21, 12, 3, 7, 20, 6, 1.7f32);
    let mut rng = Rng::new(6);
    let x = randb(&mut rng, m * k, 1.0);
    let a = randb(&mut rng, r * k, 0.5);
    let b = randb(&mut rng, n_out * r, 0.5);
    let c = randb(&mut rng, m * ld, 1.0);
    let (mut da, mut db) = (CpuBuf::from(vec![0f32; r * k]), CpuBuf::from(vec![0f32; n_out * r]));
    let prior = randb(&mut rng, m * k, 1.0);
    let mut dx = prior.clone();
    be.lora_bwd(&x, &a, &b, scale, m, k, r, n_out, &c, col0, ld, &mut da, &mut db, Some(&mut dx)).unwrap();
    let c64 = f64v(&c);
    // L = Σ c ∘ y, y[:, col0..col0+n_out] = scale·(x Aᵀ) Bᵀ
    let f = |x: &[f64], a: &[f64], b: &[f64]| {
        let mut l = 0.0;
        for i in 0..m {
            for o in 0..n_out {
                let mut y = 0.0;
                for j in 0..r {
                    y += b[o * r + j] * dot64(&x[i * k..(i + 1) * k], &a[j * k..(j + 1) * k]);
                }
                l += c64[i * ld + col0 + o] * scale as f64 * y;
            }
        }
        l
    };
    let (x64, a64, b64) = (f64v(&x), f64v(&a), f64v(&b));
    let fa = fd_grad(&a64, &(0..r * k).collect::<Vec<_>>(), |v| f(&x64, v, &b64));
    let fb = fd_grad(&b64, &(0..n_out * r).collect::<Vec<_>>(), |v| f(&x64, &a64, v));
    let fx = fd_grad(&x64, &(0..m * k).collect::<Vec<_>>(), |v| f(v, &a64, &b64));
    let dxa: Vec<f64> = dx.iter().zip(&prior).map(|(a, b)| (a - b) as f64).collect();
    for (name, an, fd) in [("dA", f64v(&da), fa), ("dB", f64v(&db), fb), ("dx", dxa, fx)] {
        let e = rel_err(&an, &fd);
        println!("lora backward {name}: ‖Δ‖/‖FD‖ = {e:.2e}");
        assert!(e < 1e-4, "lora {name} {e}");
    }
    // dA/dB accumulate
    let da1 = da.clone();
    be.lora_bwd(&x, &a, &b, scale, m, k, r, n_out, &c, col0, ld, &mut da, &mut db, None).unwrap();
    assert!(da.iter().zip(&da1).all(|(x, y)| (x - 2.0 * y).abs() <= 1e-5 * y.abs().max(1.0)));

    // frozen projection: dx = dy · W, L = Σ c ∘ (x Wᵀ)
    let (n, kk) = (9, 13);
    let wt = randb(&mut rng, n * kk, 1.0);
    let xx = randb(&mut rng, m * kk, 1.0);
    let cc = randb(&mut rng, m * n, 1.0);
    let mut dxx = CpuBuf::from(vec![0f32; m * kk]);
    be.matmul_dx(&cc, &wt, m, n, kk, &mut dxx, false).unwrap();
    let (w64, cc64) = (f64v(&wt), f64v(&cc));
    let fp = |x: &[f64]| {
        let mut l = 0.0;
        for i in 0..m {
            for o in 0..n {
                l += cc64[i * n + o] * dot64(&x[i * kk..(i + 1) * kk], &w64[o * kk..(o + 1) * kk]);
            }
        }
        l
    };
    let fd = fd_grad(&f64v(&xx), &(0..m * kk).collect::<Vec<_>>(), fp);
    let e = rel_err(&f64v(&dxx), &fd);
    println!("projection dx: ‖Δ‖/‖FD‖ = {e:.2e}");
    assert!(e < 1e-4, "matmul_dx {e}");
}

#[test]
fn op_adamw_matches_pytorch_formula() {
    let be = CpuBackend::new();
    let mut rng = Rng::new(7);
    let n = 50;
    let mut p = randb(&mut rng, n, 1.0);
    let (mut m, mut v) = (CpuBuf::from(vec![0f32; n]), CpuBuf::from(vec![0f32; n]));
    let mut p64 = f64v(&p);
    let (mut m64, mut v64) = (vec![0f64; n], vec![0f64; n]);
    let (lr, b1, b2, eps, wd, gs) = (1e-2, 0.9, 0.999, 1e-8, 0.1, 0.5);
    for step in 1..=3u64 {
        let g = randb(&mut rng, n, 1.0);
        be.adamw(&mut p, &g, &mut m, &mut v, AdamWStep { lr: lr as f32, beta1: b1 as f32, beta2: b2 as f32, eps: eps as f32, weight_decay: wd as f32, step, grad_scale: gs as f32 })
            .unwrap();
        for i in 0..n {
            let gi = g[i] as f64 * gs;
            p64[i] *= 1.0 - lr * wd;
            m64[i] = b1 * m64[i] + (1.0 - b1) * gi;
            v64[i] = b2 * v64[i] + (1.0 - b2) * gi * gi;
            let denom = v64[i].sqrt() / (1.0 - b2.powi(step as i32)).sqrt() + eps;
            p64[i] -= lr / (1.0 - b1.powi(step as i32)) * m64[i] / denom;
        }
    }
    let e = rel_err(&f64v(&p), &p64);
    assert!(e < 1e-6, "adamw {e}");
}

/// One AdamW step on the LoRA with the GRPO gradient lowers the loss (small lr, no clipping).
#[test]
fn optimizer_step_lowers_the_loss() {
    use infomem_engine::rl::optim::{AdamW, AdamWConfig};
    let mut model = random_model("qwen2", 21);
    let (convs, c) = fd_batch(&model, 9);
    let l0 = loss_only(&model, &convs, &c);
    let (_, grads) = grpo::loss_and_grads(&model, &convs, &c).unwrap();
    let mut opt = AdamW::new(&model, AdamWConfig { lr: 1e-3, max_grad_norm: None, ..Default::default() }).unwrap();
    let norm = opt.step(&mut model, &grads).unwrap();
    let l1 = loss_only(&model, &convs, &c);
    println!("loss {l0:.6} → {l1:.6} after one AdamW step (grad norm {norm:.4})");
    assert!(l1 < l0, "{l1} !< {l0}");
    // the device copy and the host master agree
    let lora = model.lora.as_ref().unwrap();
    let (a, _) = lora.layers[0][0].as_ref().unwrap();
    assert_eq!(a, &lora.host.layers[0][0].as_ref().unwrap().a.data);
}

/// The training pass takes the buffers it keeps per layer from `TrainBackend::scratch`
/// (uninitialized memory on the CPU), promising that an op writes each whole before it is read.
/// With every scratch buffer NaN-filled (`poison_scratch`) the log-probs and gradients must be
/// finite and bit for bit those of the uninitialized run, for f32 and bf16 weights, every layer
/// kept or only the top one (the rest recomputed).
#[test]
fn scratch_buffers_are_written_before_they_are_read() {
    use infomem_engine::backend::Dtype;
    for (arch, dtype) in [("qwen2", Dtype::F32), ("qwen3", Dtype::F32), ("llama", Dtype::Bf16), ("qwen2", Dtype::Bf16)] {
        let model = random_model_on(arch, 23, CpuBackend::with_weights(dtype));
        let (convs, _) = fd_batch(&model, 9);
        let seqs: Vec<TrainSeq> = convs.iter().map(|c| TrainSeq { prompt: &c.prompt, response: &c.response }).collect();
        common::assert_scratch_unread(&model, &seqs, &format!("{arch} {dtype:?}"));
    }
}

/// Keeping a layer's activations from the forward instead of recomputing them in the backward
/// changes only where the intermediates come from: the gradients are bit for bit the same for 0, 1
/// and all layers kept (the budget depends on free memory; a resumed run must not depend on it).
#[test]
fn kept_activations_match_recompute() {
    use infomem_engine::runtime::backward::policy_grads_keeping;
    for arch in ["qwen2", "llama", "qwen3"] {
        let model = random_model(arch, 21);
        let (convs, _) = fd_batch(&model, 9);
        let seqs: Vec<TrainSeq> = convs.iter().map(|c| TrainSeq { prompt: &c.prompt, response: &c.response }).collect();
        // a loss with a different weight per token: Σ w_t · logp_t
        let run = |keep: usize| {
            policy_grads_keeping(&model, &seqs, keep, |s| {
                let g = s.logprobs.iter().map(|v| (0..v.len()).map(|t| 0.3 + 0.1 * t as f32).collect()).collect();
                Ok((s.logprobs.clone(), g))
            })
            .unwrap()
        };
        let (lp0, g0) = run(0);
        for keep in [1, 2, 99] {
            let (lp, g) = run(keep);
            assert_eq!(lp, lp0, "{arch}: forward log-probs differ with {keep} layers kept");
            for (l, (ra, rb)) in g.layers.iter().zip(&g0.layers).enumerate() {
                for p in ALL_PROJS {
                    let (a, b) = (ra[p.index()].as_ref().unwrap(), rb[p.index()].as_ref().unwrap());
                    for (x, y) in [(&a.0, &b.0), (&a.1, &b.1)] {
                        assert!(y.iter().any(|v| *v != 0.0), "{arch}: layer {l} {}: zero gradient", p.module());
                        let ndiff = x.iter().zip(y.iter()).filter(|(u, v)| u.to_bits() != v.to_bits()).count();
                        assert_eq!(ndiff, 0, "{arch}: keep {keep}: layer {l} {}: {ndiff} of {} gradient entries differ", p.module(), x.len());
                    }
                }
            }
        }
    }
}
