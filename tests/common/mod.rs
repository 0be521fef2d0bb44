//! Shared helpers for the integration tests: fixture paths, the reference data, the SmolLM2 dir.
#![allow(dead_code)]
#[cfg(feature = "cuda")]
#[macro_use]
pub mod cuda;
pub mod cli;
pub mod train;
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::model::weights::SafetensorsSet;
use infomem_engine::runtime::Model;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The tiny fixture models (`tests/fixtures/tiny-<arch>`), one per supported family: Llama,
/// Qwen2, Qwen3 (head_dim ≠ hidden/heads, q/k norms), Mistral and a Llama-3.2-style model (tied,
/// `llama3` RoPE scaling, inputs past its original context).
#[allow(dead_code)]
pub const ARCHS: [&str; 5] = ["llama", "qwen2", "qwen3", "mistral", "llama32"];

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn cases() -> Value {
    let text = std::fs::read_to_string(fixtures().join("cases.json")).expect("tests/fixtures/cases.json");
    serde_json::from_str(&text).unwrap()
}

/// A tensor of `expected.safetensors` as (shape, data).
pub fn expected(name: &str) -> (Vec<usize>, Vec<f32>) {
    let set = SafetensorsSet::open_files(&[fixtures().join("expected.safetensors")]).unwrap();
    let t = set.get_f32(name, None).unwrap();
    (t.shape, t.data)
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

pub fn tiny(arch: &str) -> Model<CpuBackend> {
    Model::load(&fixtures().join(format!("tiny-{arch}")), CpuBackend::new()).unwrap()
}

/// Logits of every position, one token per step (exercises the KV cache).
#[allow(dead_code)]
pub fn logits_incremental<B: infomem_engine::backend::Backend>(m: &Model<B>, ids: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = infomem_engine::runtime::kv_for(m, ids.len()).unwrap();
    let mut seq = infomem_engine::runtime::Seq::default();
    let mut out = vec![];
    for t in 0..ids.len() {
        let mut e = [infomem_engine::runtime::Entry { seq: &mut seq, tokens: &ids[t..t + 1], want: infomem_engine::runtime::Want::Logits, sampled: false }];
        out.push(m.step(&mut kv, &mut e).unwrap().remove(0).logits.unwrap());
    }
    out
}

pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().map(|&x| x as f64).fold(f64::NEG_INFINITY, f64::max);
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// `n` QA records for the CLI tests (`data` JSONL): "What is code i?" answered by 2000 + i, planted
/// in a line of filler; `salt` goes into the filler (a changed data file with the same answers).
pub fn write_code_qa(path: &Path, n: usize, salt: &str) {
    let mut t = String::new();
    for i in 0..n {
        t.push_str(&serde_json::json!({"id": format!("r{i}"), "question": format!("What is code {i}?"),
            "context": format!("Some filler{salt}. The code {i} is {}. Then more filler text.", 2000 + i), "answers": [format!("{}", 2000 + i)]}).to_string());
        t.push('\n');
    }
    std::fs::write(path, t).unwrap();
}

/// The SmolLM2-135M-Instruct HF directory made by tools/fetch-smollm2.sh, if present.
/// With INFOMEM_REQUIRE_SMOL=1 (set by .ci/run) a missing model fails the test instead of skipping.
pub fn smol_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("SMOL_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("INFOMEM_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/infomem-engine"));
        cache.join("SmolLM2-135M-Instruct")
    });
    if dir.join("config.json").exists() {
        return Some(dir);
    }
    if std::env::var("INFOMEM_REQUIRE_SMOL").as_deref() == Ok("1") {
        panic!("SmolLM2 not found at {} (run tools/fetch-smollm2.sh)", dir.display());
    }
    eprintln!("skipped: SmolLM2 not found at {} (run tools/fetch-smollm2.sh)", dir.display());
    None
}

/// GPT-2's byte → printable-char map (the ByteLevel alphabet of `tokenizers`).
fn byte_level_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        map[*b as usize] = char::from_u32(c).unwrap();
    }
    map
}

/// `tiny_with_tokenizer` with `max_position_embeddings` raised from 256 to 2048, for runs of the
/// memory agent through the binary: its templates rendered with the chat template make prompts of
/// ~460 tokens, which `train`, `rollout` and `eval` refuse on a 256-position model. The fixtures'
/// RoPE is the default kind, so the limit changes no computed value.
pub fn tiny_for_agent(arch: &str) -> (tempfile::TempDir, PathBuf) {
    let (t, d) = tiny_with_tokenizer(arch);
    let p = d.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 2048.into();
    std::fs::write(&p, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    (t, d)
}

/// A copy of a tiny fixture model with a byte-level tokenizer (ids 3..258 = bytes, 0/1/2 =
/// <|endoftext|>, <|im_start|>, <|im_end|>) and SmolLM2's chat template, so text-level code (the
/// agent) can run on the tiny models in milliseconds.
pub fn tiny_with_tokenizer(arch: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join(format!("tiny-{arch}-tok"));
    std::fs::create_dir_all(&d).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join(format!("tiny-{arch}")).join(f), d.join(f)).unwrap();
    }
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut vocab = serde_json::Map::new();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert(s.to_string(), i.into());
    }
    for (b, c) in byte_level_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), (3 + b).into());
    }
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(d.join("tokenizer.json"), serde_json::to_string(&tok).unwrap()).unwrap();
    std::fs::write(d.join("tokenizer_config.json"), r#"{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}"#).unwrap();
    std::fs::copy(fixtures().join("smollm2-hf-meta/chat_template.jinja"), d.join("chat_template.jinja")).unwrap();
    (t, d)
}

/// The training pass of `model` on `seqs` with every `TrainBackend::scratch` buffer NaN-filled
/// (`poison_scratch`) against uninitialized, 1 layer kept and all kept: the log-probs and LoRA
/// gradients must be finite, bit for bit equal, and not all zero. `label` names the case.
pub fn assert_scratch_unread(model: &Model<CpuBackend>, seqs: &[infomem_engine::runtime::backward::TrainSeq], label: &str) {
    use infomem_engine::backend::cpu::poison_scratch;
    use infomem_engine::model::lora::ALL_PROJS;
    use infomem_engine::runtime::backward::policy_grads_keeping;
    let run = |keep: usize, poison: bool| {
        let was = poison_scratch(poison);
        let out = policy_grads_keeping(model, seqs, keep, |s| {
            let g = s.logprobs.iter().map(|v| (0..v.len()).map(|t| 0.3 + 0.1 * t as f32).collect()).collect();
            Ok((s.logprobs.clone(), g))
        })
        .unwrap();
        poison_scratch(was);
        out
    };
    for keep in [1, 99] {
        let (lp0, g0) = run(keep, false);
        let (lp, g) = run(keep, true);
        assert!(lp.iter().flatten().all(|v| v.is_finite()), "{label} keep {keep}: non-finite log-probs with NaN-filled scratch");
        assert_eq!(lp, lp0, "{label} keep {keep}: log-probs differ with NaN-filled scratch");
        let mut nonzero = 0;
        for (l, (ra, rb)) in g.layers.iter().zip(&g0.layers).enumerate() {
            for p in ALL_PROJS {
                let (a, b) = (ra[p.index()].as_ref().unwrap(), rb[p.index()].as_ref().unwrap());
                for (x, y) in [(&a.0, &b.0), (&a.1, &b.1)] {
                    assert!(x.iter().all(|v| v.is_finite()), "{label} keep {keep}: layer {l} {}: non-finite gradient with NaN-filled scratch", p.module());
                    let ndiff = x.iter().zip(y.iter()).filter(|(u, v)| u.to_bits() != v.to_bits()).count();
                    assert_eq!(ndiff, 0, "{label} keep {keep}: layer {l} {}: {ndiff} of {} gradient entries differ with NaN-filled scratch", p.module(), x.len());
                    nonzero += x.iter().filter(|v| **v != 0.0).count();
                }
            }
        }
        assert!(nonzero > 0, "{label} keep {keep}: every gradient is zero");
    }
}

/// One step mixing a prefill entry that wants nothing, a scoring entry that wants rows 2..5 of
/// 12, a logits entry and a decode row (`sampled`) — so the last layer runs only the wanted rows
/// (`Model::step`) — against the same outputs from steps that drop no row: rows 2..5 as part of
/// log-probs over all 12 rows; the logits entry's last row, and the decode row, each fed alone
/// (one row) after the rows before it were read by a step that wants nothing (whose last layer
/// stops at storing K/V). Returns (pruned, reference) pairs: the three log-probs, then every
/// logit of the logits entry and of the decode row.
pub fn pruned_vs_every_row<B: infomem_engine::backend::Backend>(m: &Model<B>) -> Vec<(f32, f32)> {
    use infomem_engine::runtime::{kv_for, Entry, Seq, Want};
    let toks = |n: usize, base: u32| -> Vec<u32> { (0..n as u32).map(|i| base + (i * 37) % 200).collect() };
    let (p, q, s, dp) = (toks(12, 5), toks(9, 40), toks(7, 90), toks(90, 150));
    let step = |kv: &mut _, entries: &mut [Entry]| m.step(kv, entries).unwrap();
    // every row of P wanted
    let mut kv = kv_for(m, 1024).unwrap();
    let mut sp = Seq::default();
    let next: Vec<u32> = p[1..].iter().copied().chain([7]).collect();
    let all = step(&mut kv, &mut [Entry { seq: &mut sp, tokens: &p, want: Want::LogProbs { first_row: 0, targets: next.clone() }, sampled: false }]).remove(0).logprobs;
    // S's first rows wanting nothing, then its last row alone; the decode row after its prompt
    let mut kv = kv_for(m, 1024).unwrap();
    let (mut ss, mut sd) = (Seq::default(), Seq::default());
    step(&mut kv, &mut [Entry { seq: &mut ss, tokens: &s[..6], want: Want::Nothing, sampled: false }, Entry { seq: &mut sd, tokens: &dp, want: Want::Nothing, sampled: false }]);
    let alone = step(&mut kv, &mut [Entry { seq: &mut ss, tokens: &s[6..], want: Want::Logits, sampled: false }]).remove(0).logits.unwrap();
    let decode_alone = step(&mut kv, &mut [Entry { seq: &mut sd, tokens: &[33], want: Want::Logits, sampled: true }]).remove(0).logits.unwrap();
    // the mixed step (the decode row's prompt read first)
    let mut kv = kv_for(m, 1024).unwrap();
    let (mut a, mut b, mut c, mut d) = (Seq::default(), Seq::default(), Seq::default(), Seq::default());
    step(&mut kv, &mut [Entry { seq: &mut d, tokens: &dp, want: Want::Nothing, sampled: false }]);
    let mut mixed = [
        Entry { seq: &mut a, tokens: &q, want: Want::Nothing, sampled: false },
        Entry { seq: &mut b, tokens: &p, want: Want::LogProbs { first_row: 2, targets: next[2..5].to_vec() }, sampled: false },
        Entry { seq: &mut c, tokens: &s, want: Want::Logits, sampled: false },
        Entry { seq: &mut d, tokens: &[33], want: Want::Logits, sampled: true },
    ];
    let out = step(&mut kv, &mut mixed);
    assert_eq!(out[1].logprobs.len(), 3);
    let mut pairs: Vec<(f32, f32)> = out[1].logprobs.iter().copied().zip(all[2..5].iter().copied()).collect();
    pairs.extend(out[2].logits.as_ref().unwrap().iter().copied().zip(alone));
    pairs.extend(out[3].logits.as_ref().unwrap().iter().copied().zip(decode_alone));
    pairs
}
