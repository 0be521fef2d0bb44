//! The CPU runtime against PyTorch/transformers/PEFT reference outputs on the tiny fixtures of
//! every family (`common::ARCHS`) (tolerances from tests/fixtures/README.md), plus batching invariants.
mod common;
use common::*;
use infomem_engine::backend::SampleParams;
use infomem_engine::runtime::{self, Entry, GenRequest, SchedOptions, ScoreRequest, Seq, Want};
use infomem_engine::util::rng::Rng;

fn check_logits(got: &[Vec<f32>], shape: &[usize], want: &[f32], what: &str) {
    let v = shape[1];
    let maxref = want.iter().fold(0f32, |a, &b| a.max(b.abs())).max(1.0);
    let tol = 1e-3 * maxref;
    for (t, row) in got.iter().enumerate() {
        for (j, &x) in row.iter().enumerate() {
            let r = want[t * v + j];
            assert!((x - r).abs() <= tol, "{what}: logit[{t}][{j}] = {x}, reference {r} (tol {tol})");
        }
    }
}

#[test]
fn forward_logits_match_transformers() {
    let c = cases();
    for arch in ARCHS {
        let m = tiny(arch);
        for (i, fw) in c[arch]["forward"].as_array().unwrap().iter().enumerate() {
            let ids = ids(&fw["ids"]);
            let (shape, want) = expected(fw["logits"].as_str().unwrap());
            assert_eq!(shape, vec![ids.len(), m.cfg.vocab]);
            check_logits(&logits_incremental(&m, &ids), &shape, &want, &format!("{arch} forward {i} (decode path)"));
            // prefill path: all rows at once, log-probs of the next token at every row
            let mut kv = runtime::kv_for(&m, ids.len()).unwrap();
            let mut seq = Seq::default();
            let targets: Vec<u32> = ids[1..].to_vec();
            let mut e = [Entry { seq: &mut seq, tokens: &ids, want: Want::LogProbs { first_row: 0, targets: targets.clone() }, sampled: false }];
            let lps = m.step(&mut kv, &mut e).unwrap().remove(0).logprobs;
            for (t, &lp) in lps.iter().enumerate() {
                let r = log_softmax(&want[t * shape[1]..(t + 1) * shape[1]])[targets[t] as usize];
                assert!((lp as f64 - r).abs() < 1e-3, "{arch} forward {i} prefill row {t}: {lp} vs {r}");
            }
        }
    }
}

#[test]
fn greedy_tokens_match() {
    let c = cases();
    for arch in ARCHS {
        let m = tiny(arch);
        let g = &c[arch]["greedy"];
        let mut kv = runtime::kv_for(&m, 64).unwrap();
        let req = GenRequest {
            seq: Seq::default(),
            feed: ids(&g["prefix"]),
            max_new: 12,
            params: SampleParams::GREEDY,
            rng: Rng::new(0),
            stop_ids: m.eos_ids(),
            stop_strings: vec![],
            keep_seq: false,
        };
        let out = runtime::generate(&m, &mut kv, vec![req], SchedOptions::default(), |_| {}).unwrap();
        assert_eq!(out[0].new_ids, ids(&g["new_tokens"]), "{arch} greedy");
        assert_eq!(kv.pages_in_use(), 0, "sequence pages are released");
    }
}

#[test]
fn gain_logprobs_match() {
    let c = cases();
    for arch in ARCHS {
        let m = tiny(arch);
        let g = &c[arch]["gain"];
        let mut kv = runtime::kv_for(&m, 128).unwrap();
        let tgt = ids(&g["target"]);
        let reqs = ["with_ctx", "without_ctx"]
            .iter()
            .map(|k| ScoreRequest { seq: Seq::default(), context: ids(&g[*k]), targets: tgt.clone(), keep_seq: false })
            .collect();
        let out = runtime::score(&m, &mut kv, reqs, SchedOptions::default()).unwrap();
        let mut means = vec![];
        for (o, k) in out.iter().zip(["logprobs_with", "logprobs_without"]) {
            let want = floats(&g[k]);
            for (a, b) in o.logprobs.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-3, "{arch} {k}: {a} vs {b}");
            }
            means.push(o.logprobs.iter().map(|&x| x as f64).sum::<f64>() / o.logprobs.len() as f64);
        }
        let gain = means[0] - means[1];
        let want = g["gain"].as_f64().unwrap();
        assert!((gain - want).abs() < 1e-3, "{arch} gain {gain} vs {want}");
    }
}

#[test]
fn lora_logits_match_peft() {
    let c = cases();
    for arch in ARCHS {
        let mut m = tiny(arch);
        let l = &c[arch]["lora"];
        m.load_adapter(&fixtures().join(l["adapter_dir"].as_str().unwrap())).unwrap();
        let lora = m.lora.as_ref().unwrap();
        assert_eq!(lora.host.r, 4);
        assert_eq!(lora.host.targets.len(), 7);
        let ids = ids(&l["ids"]);
        let (shape, want) = expected(l["logits"].as_str().unwrap());
        check_logits(&logits_incremental(&m, &ids), &shape, &want, &format!("{arch} lora"));
        // switching the adapter off gives the base model back (the GRPO reference policy)
        m.lora_enabled = false;
        let base = tiny(arch);
        let a = logits_incremental(&m, &ids[..5]);
        let b = logits_incremental(&base, &ids[..5]);
        assert_eq!(a, b);
    }
}

/// Requests of different lengths batched together give what each gives alone.
#[test]
fn batched_generation_equals_one_by_one() {
    for arch in ["qwen2", "qwen3"] {
        batched_equals_one_by_one(arch);
    }
}

fn batched_equals_one_by_one(arch: &str) {
    let m = tiny(arch);
    let mut rng = Rng::new(11);
    let prompts: Vec<Vec<u32>> = [3usize, 17, 40, 1, 25]
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(500) as u32 + 3).collect())
        .collect();
    let mk = |p: &Vec<u32>, i: usize, params| GenRequest {
        seq: Seq::default(),
        feed: p.clone(),
        max_new: 10,
        params,
        rng: Rng::derive(42, i as u64),
        stop_ids: vec![],
        stop_strings: vec![],
        keep_seq: false,
    };
    for params in [SampleParams::GREEDY, SampleParams { temperature: 0.9, top_p: 0.9 }] {
        let mut kv = runtime::kv_for(&m, 1024).unwrap();
        // a small token budget forces prompts to be split across steps and mixed with decodes
        let batched = runtime::generate(&m, &mut kv, prompts.iter().enumerate().map(|(i, p)| mk(p, i, params)).collect(), SchedOptions { max_batch_tokens: 16 }, |_| {}).unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let mut kv1 = runtime::kv_for(&m, 1024).unwrap();
            let alone = runtime::generate(&m, &mut kv1, vec![mk(p, i, params)], SchedOptions::default(), |_| {}).unwrap();
            assert_eq!(batched[i].new_ids, alone[0].new_ids, "{arch} prompt {i} ({params:?})");
            for (a, b) in batched[i].logprobs.iter().zip(&alone[0].logprobs) {
                assert!((a - b).abs() < 1e-4);
            }
        }
        assert_eq!(kv.pages_in_use(), 0);
    }
}

#[test]
fn seeded_sampling_reproduces_and_seeds_differ() {
    let m = tiny("llama");
    let run = |seed| {
        let mut kv = runtime::kv_for(&m, 256).unwrap();
        let req = GenRequest {
            seq: Seq::default(),
            feed: vec![5, 6, 7],
            max_new: 30,
            params: SampleParams { temperature: 1.0, top_p: 1.0 },
            rng: Rng::derive(seed, 0),
            stop_ids: vec![],
            stop_strings: vec![],
            keep_seq: false,
        };
        runtime::generate(&m, &mut kv, vec![req], SchedOptions::default(), |_| {}).unwrap().remove(0).new_ids
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
}

/// Scoring a target after a forked cached prompt equals scoring from scratch.
#[test]
fn forked_prefix_scores_like_fresh() {
    let m = tiny("llama");
    let prefix: Vec<u32> = (10..60).collect();
    let tails = [vec![70u32, 71, 72], vec![80, 81]];
    let target = vec![90u32, 91, 92, 93];
    let mut kv = runtime::kv_for(&m, 1024).unwrap();
    let mut base = Seq::default();
    let mut e = [Entry { seq: &mut base, tokens: &prefix, want: Want::Nothing, sampled: false }];
    m.step(&mut kv, &mut e).unwrap();
    for tail in &tails {
        let fork = kv.fork(&base);
        let got = runtime::score(&m, &mut kv, vec![ScoreRequest { seq: fork, context: tail.clone(), targets: target.clone(), keep_seq: false }], SchedOptions::default()).unwrap();
        let full: Vec<u32> = prefix.iter().chain(tail).copied().collect();
        let mut kv2 = runtime::kv_for(&m, 1024).unwrap();
        let want = runtime::score(&m, &mut kv2, vec![ScoreRequest { seq: Seq::default(), context: full, targets: target.clone(), keep_seq: false }], SchedOptions::default()).unwrap();
        for (a, b) in got[0].logprobs.iter().zip(&want[0].logprobs) {
            // different batch shapes reassociate f32 sums: agreement to ~1e-6 relative
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
    kv.release(&m.be, base);
    assert_eq!(kv.pages_in_use(), 0);
}

/// The last layer runs only the rows a step returns (`Model::step`); the outputs equal those of
/// steps that drop no row, on every family, within 1e-4 relative: f32 sums of another row count
/// may be reassociated (the small-`m` product kernel against the packed GEMM; ~1.3e-5 measured),
/// while a wrong row, a wrong context length or a missing last-layer K/V moves them by far more.
#[test]
fn dropping_unwanted_rows_from_the_last_layer_changes_no_output() {
    for arch in ARCHS {
        let m = tiny(arch);
        for (i, (got, want)) in pruned_vs_every_row(&m).into_iter().enumerate() {
            assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{arch} output {i}: {got} with unwanted rows dropped, {want} with every row kept");
        }
    }
}
