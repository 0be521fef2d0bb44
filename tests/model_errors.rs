//! Models, adapters and numerics through the real binary (issue 13, items 15, 16 and 18): a model
//! whose logits are NaN/Inf is an error in every command that samples or scores (never token 0
//! repeated, never a hang); config.json values are checked when the model loads; an adapter
//! applies exactly the modules its `target_modules` names; and the messages for overflowing
//! lengths, bad ranks, symlink loops and shard indexes that point outside the model say what is
//! wrong. Everything runs on the tiny fixture models.
mod common;
use common::{fixtures, tiny_with_tokenizer};
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::model::lora::{LoraAdapter, Proj};
use infomem_engine::model::weights::{write_safetensors, HostTensor, SafetensorsSet};
use infomem_engine::runtime::{self, Model, SchedOptions, ScoreRequest, Seq};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// Run the binary with a deadline: a hang is a test failure, not a stuck test run.
fn run(args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_infomem-engine"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()).ok());
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{args:?} hung (no exit after 20 s)");
        }
    }
}

/// Exit 1 (not a panic's 101, not 0) with every needle in stderr.
fn fails_with(args: &[&str], needles: &[&str]) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure for {args:?}, got success; stdout: {}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(out.status.code(), Some(1), "exit code for {args:?} (a panic exits 101): {err}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr for {args:?} lacks {n:?}:\n{err}");
    }
}

/// Exit 0; the last stdout line as JSON.
fn succeeds(args: &[&str]) -> Value {
    let out = run(args);
    assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or("")).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

/// A copy of a fixture directory (`tiny-llama`, `tiny-llama-lora`, …) in a temp dir.
fn fixture_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join(name);
    copy_dir(&fixtures().join(name), &d);
    (t, d)
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn edit_tensors(path: &Path, edit: impl FnOnce(&mut BTreeMap<String, HostTensor>)) {
    let set = SafetensorsSet::open_files(&[path.to_path_buf()]).unwrap();
    let mut m: BTreeMap<String, HostTensor> = set.names().map(|n| (n.to_string(), set.get_f32(n, None).unwrap())).collect();
    drop(set);
    edit(&mut m);
    write_safetensors(path, &m, None).unwrap();
}

/// One NaN in the final norm: every logit is NaN.
fn poison_weights(model: &Path) {
    edit_tensors(&model.join("model.safetensors"), |m| m.get_mut("model.norm.weight").unwrap().data[0] = f32::NAN);
}

fn generate_args(model: &str) -> Vec<&str> {
    vec!["generate", "--model", model, "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json"]
}

fn score_lps(args: &[&str]) -> Vec<f64> {
    succeeds(args)["logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

// ---- item 15: non-finite logits ----------------------------------------------------------------

#[test]
fn nonfinite_logits_fail_generate_and_score() {
    let (_t, m) = fixture_copy("tiny-llama");
    poison_weights(&m);
    let needles = ["generation request 0", "new token 1", "NaN/Inf", "weights or the adapter"];
    // greedy: before, exit 0 with token 0 repeated and null log-probs
    fails_with(&generate_args(s(&m)), &needles);
    // nucleus sampling: before, the top-p search never ended on NaN weights
    let mut a = generate_args(s(&m));
    a.extend(["--temperature", "0.7", "--top-p", "0.9"]);
    fails_with(&a, &needles);
    let mut a = generate_args(s(&m));
    a.extend(["--temperature", "0.7"]);
    fails_with(&a, &needles);
    fails_with(&["score", "--model", s(&m), "--context-ids", "1,2,3", "--target-ids", "4,5"], &["score request 0", "target 0", "NaN/Inf"]);

    // a NaN in an adapter poisons the same way
    let base = fixtures().join("tiny-llama");
    let (_ta, ad) = fixture_copy("tiny-llama-lora");
    edit_tensors(&ad.join("adapter_model.safetensors"), |m| {
        m.get_mut("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight").unwrap().data[0] = f32::NAN;
    });
    let mut a = generate_args(s(&base));
    a.extend(["--adapter", s(&ad)]);
    fails_with(&a, &needles);

    // the control: the fixtures still generate, greedy and sampled
    let good = fixtures().join("tiny-llama-lora");
    let mut a = generate_args(s(&base));
    a.extend(["--adapter", s(&good)]);
    assert_eq!(succeeds(&a)["new_ids"].as_array().unwrap().len(), 3);
    let mut a = generate_args(s(&base));
    a.extend(["--temperature", "0.7", "--top-p", "0.9"]);
    assert!(succeeds(&a)["logprobs"].as_array().unwrap().iter().all(|x| x.as_f64().is_some_and(f64::is_finite)));
}

#[test]
fn nonfinite_logits_fail_rollout_eval_and_train() {
    let (_t, m) = tiny_with_tokenizer("llama");
    poison_weights(&m);
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    let rec = json!({"id": "r0", "question": "What is the code?", "context": "Filler. The code is 2001. More filler.", "answers": ["2001"]});
    std::fs::write(&data, format!("{rec}\n")).unwrap();
    // short templates: the default ones alone exceed the tiny model's 256 positions
    let templates = tmp.path().join("templates.toml");
    std::fs::write(&templates, "update = \"Q:{question}\\nS:{chunk}\\nM:{memory}\"\nfinal = \"Q:{question}\\nM:{memory}\"\nempty_memory = \"-\"\n").unwrap();
    let budgets = ["--chunk-tokens", "40", "--memory-tokens", "8", "--answer-tokens", "4", "--templates", s(&templates)];
    let needles = ["logits are not finite", "NaN/Inf"];

    let traj = tmp.path().join("traj.jsonl");
    let mut a = vec!["rollout", "--model", s(&m), "--data", s(&data), "--group-size", "2", "--out", s(&traj)];
    a.extend(budgets);
    fails_with(&a, &needles);

    let ev = tmp.path().join("eval");
    let mut a = vec!["eval", "--model", s(&m), "--data", s(&data), "--out", s(&ev)];
    a.extend(budgets);
    fails_with(&a, &needles);

    // train skips a step whose rollouts hit NaN/Inf logits (the reason in metrics.jsonl) and
    // stops with an error after MAX_NONFINITE_STEPS_IN_A_ROW of them; before, it hung in the
    // top-p draw (and with top-p 1 ran on with NaN rewards)
    let run_dir = tmp.path().join("run");
    let steps = (infomem_engine::rl::trainer::MAX_NONFINITE_STEPS_IN_A_ROW + 1).to_string();
    let mut a = vec![
        "train", "--model", s(&m), "--data", s(&data), "--out", s(&run_dir), "--steps", &steps, "--queries-per-step", "1",
        "--group-size", "2", "--temperature", "1.0", "--top-p", "0.9", "--lora-r", "2",
    ];
    a.extend(budgets);
    fails_with(&a, &["in a row", "logits are not finite", "NaN/Inf"]);
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().all(|l| l.contains("non-finite logits in the rollouts")), "{metrics}");
}

// ---- items 15 and 18: config.json values ------------------------------------------------------

#[test]
fn config_values_are_checked_at_load() {
    type Edit = fn(&mut Value);
    let cases: Vec<(Edit, Vec<&str>)> = vec![
        (|c| c["rope_parameters"]["rope_theta"] = json!(0.0), vec!["rope_theta", "positive", "got 0"]),
        (|c| c["rope_parameters"]["rope_theta"] = json!(-5.0), vec!["rope_theta", "got -5"]),
        (|c| c["rope_parameters"]["rope_theta"] = json!(1e-300), vec!["rope_theta", "RoPE frequency", "f32"]),
        (|c| c["rope_parameters"]["rope_theta"] = json!("big"), vec!["rope_theta", "must be a number", "\"big\""]),
        (|c| c["rope_parameters"] = json!({"rope_theta": 10000.0, "rope_type": "linear", "factor": 0.0}), vec!["factor", "positive", "got 0"]),
        (|c| c["rms_norm_eps"] = json!(-1.0), vec!["rms_norm_eps", "positive", "got -1"]),
        (|c| c["rms_norm_eps"] = json!(0.0), vec!["rms_norm_eps", "positive", "got 0"]),
        (|c| c["rms_norm_eps"] = json!(1e-50), vec!["rms_norm_eps", "positive"]),
        (|c| c["rms_norm_eps"] = json!("abc"), vec!["rms_norm_eps", "must be a number", "\"abc\""]),
        (|c| c["max_position_embeddings"] = json!(0), vec!["max_position_embeddings", "positive integer", "got 0"]),
        (|c| c["max_position_embeddings"] = json!("abc"), vec!["max_position_embeddings", "positive integer", "\"abc\""]),
        (|c| c["eos_token_id"] = json!(512), vec!["eos_token_id", "token id in 0..512", "got 512"]),
        (|c| c["eos_token_id"] = json!([2, "x"]), vec!["eos_token_id", "token id", "\"x\""]),
        (|c| c["bos_token_id"] = json!(-1), vec!["bos_token_id", "token id", "got -1"]),
        (|c| c["head_dim"] = json!(0), vec!["head_dim", "positive integer", "got 0"]),
        (|c| c["num_attention_heads"] = json!(0), vec!["num_attention_heads", "positive integer", "got 0"]),
        (|c| c["num_key_value_heads"] = json!(0), vec!["num_key_value_heads", "positive integer", "got 0"]),
        (|c| c["vocab_size"] = json!(-3), vec!["vocab_size", "positive integer", "got -3"]),
        (|c| c["tie_word_embeddings"] = json!("yes"), vec!["tie_word_embeddings", "true or false", "\"yes\""]),
        (|c| c["hidden_size"] = json!(1u64 << 62), vec!["too large", "overflows"]),
    ];
    let (_t, m) = fixture_copy("tiny-llama");
    let cfg = m.join("config.json");
    let orig = std::fs::read_to_string(&cfg).unwrap();
    for (edit, mut needles) in cases {
        std::fs::write(&cfg, &orig).unwrap();
        edit_json(&cfg, edit);
        needles.push("config.json");
        fails_with(&generate_args(s(&m)), &needles);
    }
    // generation_config.json's stop ids are token ids too
    let (_tt, mt) = tiny_with_tokenizer("llama");
    std::fs::write(mt.join("generation_config.json"), r#"{"eos_token_id": [2, 9999]}"#).unwrap();
    fails_with(&generate_args(s(&mt)), &["eos_token_id 9999", "generation_config.json", "vocab_size is 512"]);
    // the control: the unedited config, and one without the optional fields (their HF defaults)
    std::fs::write(&cfg, &orig).unwrap();
    succeeds(&generate_args(s(&m)));
    edit_json(&cfg, |c| {
        for k in ["rms_norm_eps", "max_position_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id"] {
            c.as_object_mut().unwrap().remove(k);
        }
    });
    succeeds(&generate_args(s(&m)));
}

// ---- item 16: target_modules --------------------------------------------------------------------

/// The fixture adapter reduced to `keep` projections, with `target_modules` set to `targets`.
fn adapter_with(keep: &[&str], targets: Value) -> (tempfile::TempDir, PathBuf) {
    let (t, a) = fixture_copy("tiny-llama-lora");
    edit_tensors(&a.join("adapter_model.safetensors"), |m| m.retain(|k, _| keep.iter().any(|p| k.contains(&format!(".{p}.")))));
    edit_json(&a.join("adapter_config.json"), |c| c["target_modules"] = targets);
    (t, a)
}

/// Log-probs of the q_proj part of the fixture adapter alone, computed in-process.
fn q_only_reference(model: &Path) -> Vec<f64> {
    let mut mdl = Model::load(model, CpuBackend::new()).unwrap();
    let mut ad = LoraAdapter::load(&fixtures().join("tiny-llama-lora"), &mdl.cfg).unwrap();
    for row in ad.layers.iter_mut() {
        for (i, pair) in row.iter_mut().enumerate() {
            if i != Proj::Q.index() {
                *pair = None;
            }
        }
    }
    ad.targets = vec![Proj::Q];
    mdl.set_adapter(ad).unwrap();
    let mut kv = runtime::kv_for(&mdl, 16).unwrap();
    let req = ScoreRequest { seq: Seq::default(), context: vec![1, 2, 3], targets: vec![4, 5], keep_seq: false };
    let out = runtime::score(&mdl, &mut kv, vec![req], SchedOptions::default()).unwrap().remove(0);
    out.logprobs.iter().map(|&x| x as f64).collect()
}

#[test]
fn adapter_target_modules_are_applied_exactly() {
    let base = fixtures().join("tiny-llama");
    let score = |adapter: Option<&Path>| -> Vec<String> {
        let mut a: Vec<String> = ["score", "--model", s(&base), "--context-ids", "1,2,3", "--target-ids", "4,5", "--json"].iter().map(|x| x.to_string()).collect();
        if let Some(ad) = adapter {
            a.extend(["--adapter".to_string(), s(ad).to_string()]);
        }
        a
    };
    let lps = |adapter: Option<&Path>| {
        let a = score(adapter);
        score_lps(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let fails = |adapter: &Path, needles: &[&str]| {
        let a = score(Some(adapter));
        fails_with(&a.iter().map(String::as_str).collect::<Vec<_>>(), needles)
    };
    let close = |x: &[f64], y: &[f64]| x.len() == y.len() && x.iter().zip(y).all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + b.abs()));
    let all = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    let lp_base = lps(None);
    let lp_full = lps(Some(&fixtures().join("tiny-llama-lora")));
    let lp_q = q_only_reference(&base);
    assert!(!close(&lp_q, &lp_base) && !close(&lp_q, &lp_full), "the q_proj part must change the output on its own");

    // tensors for modules target_modules does not name: before, all seven were applied
    let (_t1, a1) = adapter_with(&all, json!(["q_proj"]));
    fails(&a1, &["mlp.down_proj.lora_A.weight", "target_modules [\"q_proj\"] does not target down_proj", "add it to target_modules"]);
    // a target the model does not have: before, loaded and applied everything
    let (_t2, a2) = adapter_with(&all, json!(["q_proj", "foo_proj"]));
    fails(&a2, &["target_modules entry \"foo_proj\" names no module of the model", "valid:"]);
    // modules that cannot carry a LoRA here are refused, not skipped
    let (_t3, a3) = adapter_with(&["q_proj"], json!(["q_proj", "lm_head"]));
    fails(&a3, &["\"lm_head\" selects lm_head", "cannot carry a LoRA"]);
    let (_t4, a4) = adapter_with(&["q_proj"], json!(r"model\.layers\.0\.self_attn\.q_proj"));
    fails(&a4, &["q_proj in 1 of the model's 2 layers", "every layer or none"]);
    let (_t5, a5) = adapter_with(&["q_proj"], json!("(q_proj"));
    fails(&a5, &["\"(q_proj\"", "not a valid regular expression"]);
    let (_t6, a6) = adapter_with(&["q_proj"], json!(42));
    fails(&a6, &["target_modules must be a list of strings or a string, got 42"]);
    // targeted but missing: PEFT's default (q_proj, v_proj) when target_modules is absent
    let (_t7, a7) = adapter_with(&["q_proj"], Value::Null);
    fails(&a7, &["layer 0 has no LoRA weights for v_proj"]);

    // exactly the targeted modules are applied: a list (plain or suffix form), a regular
    // expression matched against whole module paths, and "all-linear"
    let (_t8, a8) = adapter_with(&["q_proj"], json!(["q_proj"]));
    assert!(close(&lps(Some(&a8)), &lp_q), "[\"q_proj\"]: {:?} vs {lp_q:?}", lps(Some(&a8)));
    let (_t9, a9) = adapter_with(&["q_proj"], json!(["self_attn.q_proj"]));
    assert!(close(&lps(Some(&a9)), &lp_q));
    let (_t10, a10) = adapter_with(&["q_proj"], json!(r".*\.q_proj"));
    assert!(close(&lps(Some(&a10)), &lp_q));
    let (_t11, a11) = adapter_with(&all, json!("all-linear"));
    assert!(close(&lps(Some(&a11)), &lp_full));
    let (_t12, a12) = adapter_with(&all, json!(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"));
    assert!(close(&lps(Some(&a12)), &lp_full));
}

// ---- item 18: messages that mislead -------------------------------------------------------------

#[test]
fn max_new_tokens_overflow_names_the_limit() {
    let m = fixtures().join("tiny-llama");
    // before: the sum wrapped and the run failed later with "KV cache is full"
    let huge = (u64::MAX - 1).to_string();
    fails_with(
        &["generate", "--model", s(&m), "--prompt-ids", "1,2,3", "--max-new-tokens", &huge],
        &["--max-new-tokens 18446744073709551614", "max_position_embeddings 256", "at most 253"],
    );
    fails_with(&["generate", "--model", s(&m), "--prompt-ids", "1,2,3", "--max-new-tokens", "254"], &["at most 253"]);
    succeeds(&["generate", "--model", s(&m), "--prompt-ids", "1,2,3", "--max-new-tokens", "253", "--json", "--ignore-eos"]);
}

#[test]
fn adapter_rank_must_be_a_positive_integer() {
    let m = fixtures().join("tiny-llama");
    for (r, shown) in [(json!(-4), "-4"), (json!(0), "0"), (json!(4.5), "4.5"), (json!("4"), "\"4\"")] {
        let (_t, a) = fixture_copy("tiny-llama-lora");
        edit_json(&a.join("adapter_config.json"), |c| c["r"] = r);
        fails_with(
            &["score", "--model", s(&m), "--adapter", s(&a), "--context-ids", "1,2", "--target-ids", "3"],
            &["\"r\" must be a positive integer", &format!("got {shown}")],
        );
    }
}

#[test]
fn symlink_loops_are_named() {
    use std::os::unix::fs::symlink;
    let loop_at = |p: &Path| {
        let _ = std::fs::remove_file(p);
        let other = p.with_extension("loop");
        symlink(&other, p).unwrap();
        symlink(p, &other).unwrap();
    };
    let score = |model: &Path, adapter: Option<&Path>, needles: &[&str]| {
        let mut a = vec!["score", "--model", s(model), "--context-ids", "1,2", "--target-ids", "3"];
        if let Some(ad) = adapter {
            a.extend(["--adapter", s(ad)]);
        }
        fails_with(&a, needles);
    };
    let tmp = tempfile::tempdir().unwrap();
    // the model directory itself: before, "does not exist"
    let dir = tmp.path().join("model-dir");
    loop_at(&dir);
    score(&dir, None, &["model-dir", "symlink loop"]);
    // config.json, model.safetensors (before: "no weights"), a shard named by the index
    for f in ["config.json", "model.safetensors"] {
        let (_t, m) = fixture_copy("tiny-llama");
        loop_at(&m.join(f));
        score(&m, None, &[f, "symlink loop"]);
    }
    let (_t, m) = fixture_copy("tiny-llama");
    std::fs::rename(m.join("model.safetensors"), m.join("shard-1.safetensors")).unwrap();
    std::fs::write(m.join("model.safetensors.index.json"), r#"{"weight_map": {"model.norm.weight": "shard-2.safetensors"}}"#).unwrap();
    loop_at(&m.join("shard-2.safetensors"));
    score(&m, None, &["shard-2.safetensors", "symlink loop"]);
    // tokenizer.json: before, the model silently had no tokenizer
    let (_tt, mt) = tiny_with_tokenizer("llama");
    loop_at(&mt.join("tokenizer.json"));
    score(&mt, None, &["tokenizer.json", "symlink loop"]);
    // the adapter directory and its files
    let base = fixtures().join("tiny-llama");
    let ad = tmp.path().join("adapter-dir");
    loop_at(&ad);
    score(&base, Some(&ad), &["adapter-dir", "symlink loop"]);
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        let (_ta, a) = fixture_copy("tiny-llama-lora");
        loop_at(&a.join(f));
        score(&base, Some(&a), &[f, "symlink loop"]);
    }
}

#[test]
fn shard_index_must_stay_inside_the_model_dir() {
    let (t, m) = fixture_copy("tiny-llama");
    // the weights moved next to the model directory, the index pointing at them
    std::fs::rename(m.join("model.safetensors"), t.path().join("outside.safetensors")).unwrap();
    let names: Vec<String> = SafetensorsSet::open_files(&[t.path().join("outside.safetensors")]).unwrap().names().map(String::from).collect();
    let index = |file: &str| {
        let map: serde_json::Map<String, Value> = names.iter().map(|n| (n.clone(), json!(file))).collect();
        std::fs::write(m.join("model.safetensors.index.json"), json!({"metadata": {}, "weight_map": map}).to_string()).unwrap();
    };
    let score = ["score", "--model", s(&m), "--context-ids", "1,2", "--target-ids", "3", "--json"];
    let outside = t.path().join("outside.safetensors");
    for file in ["../outside.safetensors", s(&outside), "./../tiny-llama/../outside.safetensors"] {
        index(file);
        fails_with(&score, &["model.safetensors.index.json", file, "not a file inside", "without \"..\""]);
    }
    index("");
    fails_with(&score, &["model.safetensors.index.json", "not a file inside"]);
    std::fs::write(m.join("model.safetensors.index.json"), r#"{"weight_map": {"model.norm.weight": 7}}"#).unwrap();
    fails_with(&score, &["weight_map[\"model.norm.weight\"] must be a file name, got 7"]);
    // the control: the same shard inside the directory (also under a subdirectory)
    std::fs::create_dir_all(m.join("shards")).unwrap();
    std::fs::rename(&outside, m.join("shards/model-00001-of-00001.safetensors")).unwrap();
    index("shards/model-00001-of-00001.safetensors");
    succeeds(&score);
}

/// Weights the config does not describe are refused rather than ignored: an o_proj bias on a
/// model whose config says `attention_bias` false, a q_norm on a Llama, a layer past
/// num_hidden_layers. With `attention_bias: true` a Llama's o_proj bias is loaded and used, as
/// transformers does (q/k/v and o all carry one).
#[test]
fn unused_tensors_are_refused_and_attention_bias_covers_o_proj() {
    for (extra, shape) in [
        ("model.layers.0.self_attn.o_proj.bias", vec![64]),
        ("model.layers.1.self_attn.q_norm.weight", vec![16]),
        ("model.layers.2.input_layernorm.weight", vec![64]),
    ] {
        let (_t, d) = fixture_copy("tiny-llama");
        edit_tensors(&d.join("model.safetensors"), |m| {
            m.insert(extra.into(), HostTensor::new(shape.clone(), vec![0.5; shape.iter().product()]));
        });
        fails_with(&["score", "--model", s(&d), "--context-ids", "1,2,3", "--target-ids", "4", "--json"], &["does not use", extra]);
    }
    // attention_bias: q/k/v biases and the o bias, all required and all applied
    let (_t, d) = fixture_copy("tiny-llama");
    let base = score_lps(&["score", "--model", s(&d), "--context-ids", "1,2,3,4,5", "--target-ids", "6,7", "--json"]);
    edit_json(&d.join("config.json"), |c| c["attention_bias"] = json!(true));
    fails_with(&["score", "--model", s(&d), "--context-ids", "1,2,3", "--target-ids", "4", "--json"], &["q_proj.bias"]);
    edit_tensors(&d.join("model.safetensors"), |m| {
        for l in 0..2 {
            for (p, n) in [("q_proj", 64), ("k_proj", 32), ("v_proj", 32)] {
                m.insert(format!("model.layers.{l}.self_attn.{p}.bias"), HostTensor::new(vec![n], vec![0.0; n]));
            }
            m.insert(format!("model.layers.{l}.self_attn.o_proj.bias"), HostTensor::new(vec![64], vec![0.0; 64]));
        }
    });
    // zero biases: the same numbers as without
    let zero = score_lps(&["score", "--model", s(&d), "--context-ids", "1,2,3,4,5", "--target-ids", "6,7", "--json"]);
    for (a, b) in base.iter().zip(&zero) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    // a non-zero o bias moves them: it is applied
    edit_tensors(&d.join("model.safetensors"), |m| {
        m.insert("model.layers.1.self_attn.o_proj.bias".into(), HostTensor::new(vec![64], (0..64).map(|i| (i as f32 * 0.37).sin()).collect()));
    });
    let moved = score_lps(&["score", "--model", s(&d), "--context-ids", "1,2,3,4,5", "--target-ids", "6,7", "--json"]);
    assert!(base.iter().zip(&moved).any(|(a, b)| (a - b).abs() > 1e-3), "{base:?} vs {moved:?}");
}
