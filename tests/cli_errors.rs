//! Bad input through the real binary: every case must exit non-zero with a message that names
//! the file, tensor or value at fault — never a panic, never a silent success.
mod common;
use common::fixtures;
use infomem_engine::model::weights::{write_safetensors, HostTensor, SafetensorsSet};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_infomem-engine"))
}

/// Run the binary; assert failure and that stderr contains every `needle`.
fn fails_with(args: &[&str], needles: &[&str]) {
    let out = bin().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure for {args:?}, got success; stdout: {}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(out.status.code(), Some(1), "exit code for {args:?} (a panic exits 101): {err}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr for {args:?} lacks {n:?}:\n{err}");
    }
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn tiny_copy(arch: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join(format!("tiny-{arch}"));
    copy_dir(&fixtures().join(format!("tiny-{arch}")), &d);
    (t, d)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn score_args(model: &str) -> Vec<String> {
    ["score", "--model", model, "--context-ids", "1,2,3", "--target-ids", "4,5"].iter().map(|x| x.to_string()).collect()
}

fn fails_score(model: &Path, needles: &[&str]) {
    let a = score_args(s(model));
    fails_with(&a.iter().map(|x| x.as_str()).collect::<Vec<_>>(), needles);
}

/// Rewrite model.safetensors with `edit` applied to the tensor map.
fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut BTreeMap<String, HostTensor>)) {
    let path = dir.join("model.safetensors");
    let set = SafetensorsSet::open_files(&[path.clone()]).unwrap();
    let mut m: BTreeMap<String, HostTensor> = set.names().map(|n| (n.to_string(), set.get_f32(n, None).unwrap())).collect();
    drop(set);
    edit(&mut m);
    write_safetensors(&path, &m, None).unwrap();
}

#[test]
fn missing_model_dir() {
    fails_score(Path::new("/nonexistent/model"), &["/nonexistent/model", "does not exist"]);
}

#[test]
fn missing_and_corrupt_config() {
    let (_t, d) = tiny_copy("llama");
    std::fs::remove_file(d.join("config.json")).unwrap();
    fails_score(&d, &["config.json"]);
    std::fs::write(d.join("config.json"), "{ not json").unwrap();
    fails_score(&d, &["config.json", "not valid JSON"]);
}

#[test]
fn unknown_architecture() {
    let (_t, d) = tiny_copy("llama");
    let text = std::fs::read_to_string(d.join("config.json")).unwrap().replace("\"llama\"", "\"gpt_neox\"");
    std::fs::write(d.join("config.json"), text).unwrap();
    fails_score(&d, &["unsupported architecture", "gpt_neox", "Supported: llama", "mistral", "qwen2", "qwen3"]);
    // a family people bring that is not implemented: named, with what is missing, and refused
    // before the weights are read (these are a Llama's, which a MoE loader would reject anyway)
    let text = std::fs::read_to_string(d.join("config.json")).unwrap().replace("\"gpt_neox\"", "\"qwen3_moe\"");
    std::fs::write(d.join("config.json"), text).unwrap();
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    fails_score(&d, &["unsupported architecture", "qwen3_moe", "mixture-of-experts", "expert MLPs"]);
}

#[test]
fn missing_and_corrupt_weights() {
    let (_t, d) = tiny_copy("qwen2");
    let w = d.join("model.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
    fails_score(&d, &["model.safetensors", "not a valid safetensors file"]);
    std::fs::remove_file(&w).unwrap();
    fails_score(&d, &["no weights in", "model.safetensors"]);
}

#[test]
fn tensor_with_wrong_shape() {
    let (_t, d) = tiny_copy("llama");
    rewrite_weights(&d, |m| {
        m.insert("model.layers.1.mlp.up_proj.weight".into(), HostTensor::zeros(vec![100, 64]));
    });
    fails_score(&d, &["model.layers.1.mlp.up_proj.weight", "[100, 64]", "[128, 64]"]);
}

#[test]
fn tensor_missing() {
    let (_t, d) = tiny_copy("qwen2");
    rewrite_weights(&d, |m| {
        m.remove("model.layers.0.self_attn.k_proj.bias");
    });
    fails_score(&d, &["model.layers.0.self_attn.k_proj.bias", "not found"]);
}

#[test]
fn tensor_with_wrong_dtype() {
    use safetensors::tensor::TensorView;
    let (_t, d) = tiny_copy("llama");
    let path = d.join("model.safetensors");
    let set = SafetensorsSet::open_files(&[path.clone()]).unwrap();
    let mut bufs: Vec<(String, Vec<u8>, Vec<usize>, safetensors::Dtype)> = vec![];
    for n in set.names() {
        let t = set.get_f32(n, None).unwrap();
        if n == "model.norm.weight" {
            let ints: Vec<i64> = t.data.iter().map(|&x| x as i64).collect();
            bufs.push((n.into(), bytemuck::cast_slice(&ints).to_vec(), t.shape, safetensors::Dtype::I64));
        } else {
            bufs.push((n.into(), bytemuck::cast_slice(&t.data).to_vec(), t.shape, safetensors::Dtype::F32));
        }
    }
    drop(set);
    let views: Vec<(String, TensorView)> = bufs.iter().map(|(n, b, s, dt)| (n.clone(), TensorView::new(*dt, s.clone(), b).unwrap())).collect();
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    fails_score(&d, &["model.norm.weight", "I64", "not supported"]);
}

#[test]
fn bad_prompts_and_ids() {
    let m = fixtures().join("tiny-llama");
    let m = s(&m);
    fails_with(&["generate", "--model", m, "--prompt-ids", "", "--max-new-tokens", "3"], &["prompt is empty"]);
    fails_with(&["generate", "--model", m, "--prompt-ids", "1,x,3", "--max-new-tokens", "3"], &["--prompt-ids", "\"x\""]);
    fails_with(&["generate", "--model", m, "--prompt-ids", "1,512,3", "--max-new-tokens", "3"], &["512", "outside the vocabulary"]);
    fails_with(&["generate", "--model", m, "--prompt-ids=-1", "--max-new-tokens", "3"], &["\"-1\"", "not a token id"]);
    let long = (0..250).map(|i| (i % 500).to_string()).collect::<Vec<_>>().join(",");
    fails_with(&["generate", "--model", m, "--prompt-ids", &long, "--max-new-tokens", "10"], &["too long", "max_position_embeddings 256"]);
    fails_with(&["generate", "--model", m, "--prompt", "hello", "--max-new-tokens", "3"], &["no tokenizer", "--prompt-ids"]);
    fails_with(&["generate", "--model", m, "--prompt-ids", "1,2", "--max-new-tokens", "3", "--temperature", "0"], &["--temperature"]);
    fails_with(&["generate", "--model", m, "--prompt-ids", "1,2", "--max-new-tokens", "3", "--temperature", "1", "--top-p", "1.5"], &["--top-p"]);
    fails_with(&["score", "--model", m, "--context-ids", "1,2", "--target-ids", ""], &["target is empty"]);
    fails_with(&["score", "--model", m, "--context-ids", "1,2", "--target", "abc"], &["no tokenizer"]);
}

fn adapter_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join(name);
    copy_dir(&fixtures().join(name), &d);
    (t, d)
}

fn score_with_adapter(model: &str, adapter: &Path, needles: &[&str]) {
    fails_with(&["score", "--model", model, "--adapter", s(adapter), "--context-ids", "1,2", "--target-ids", "3"], needles);
}

#[test]
fn bad_adapters() {
    let llama = fixtures().join("tiny-llama");
    let qwen = fixtures().join("tiny-qwen2");
    // rank in the config disagrees with the tensors
    let (_t, a) = adapter_copy("tiny-llama-lora");
    let cfg = std::fs::read_to_string(a.join("adapter_config.json")).unwrap().replace("\"r\": 4", "\"r\": 8");
    std::fs::write(a.join("adapter_config.json"), cfg).unwrap();
    score_with_adapter(s(&llama), &a, &["lora_A.weight", "[4, 64]", "[8, 64]", "r = 8"]);
    // an adapter trained on another base (k_proj is 32 wide in tiny-llama, 16 in tiny-qwen2)
    score_with_adapter(s(&qwen), &fixtures().join("tiny-llama-lora"), &["k_proj.lora_B.weight", "[32, 4]", "[16, 4]"]);
    // unexpected keys
    let (_t2, a2) = adapter_copy("tiny-qwen2-lora");
    let p = a2.join("adapter_model.safetensors");
    let set = SafetensorsSet::open_files(&[p.clone()]).unwrap();
    let mut m: BTreeMap<String, HostTensor> = set.names().map(|n| (n.to_string(), set.get_f32(n, None).unwrap())).collect();
    drop(set);
    m.insert("base_model.model.lm_head.weight".into(), HostTensor::zeros(vec![2, 2]));
    write_safetensors(&p, &m, None).unwrap();
    score_with_adapter(s(&qwen), &a2, &["unexpected tensor", "base_model.model.lm_head.weight"]);
    // lora_B missing for one module
    m.remove("base_model.model.lm_head.weight");
    m.remove("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight");
    write_safetensors(&p, &m, None).unwrap();
    score_with_adapter(s(&qwen), &a2, &["layer 1", "up_proj", "lora_A and lora_B"]);
    // no adapter directory / no weights
    score_with_adapter(s(&qwen), Path::new("/nonexistent/adapter"), &["adapter_config.json"]);
    std::fs::remove_file(&p).unwrap();
    score_with_adapter(s(&qwen), &a2, &["adapter_model.safetensors", "missing"]);
    // DoRA is refused, not silently treated as LoRA
    let (_t3, a3) = adapter_copy("tiny-llama-lora");
    let cfg = std::fs::read_to_string(a3.join("adapter_config.json")).unwrap().replace("\"use_dora\": false", "\"use_dora\": true");
    std::fs::write(a3.join("adapter_config.json"), cfg).unwrap();
    score_with_adapter(s(&llama), &a3, &["DoRA"]);
}

#[test]
fn good_input_still_succeeds() {
    // the control: the same commands with valid input exit 0 and print JSON
    let m = fixtures().join("tiny-llama");
    let out = bin().args(["generate", "--model", s(&m), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["prompt_ids"], serde_json::json!([1, 2, 3]));
    assert!(v["new_ids"].as_array().unwrap().len() <= 4);
}

/// `bench --json` names the weights' storage as bench_torch.py does (bench-compare's tables and
/// anyone reading the raw lines rely on it): float32 with `--dtype f32`, bfloat16 with `--dtype
/// bf16`, and by default (`auto`) what this CPU gets: bfloat16 with AMX or AVX512_BF16.
#[test]
fn bench_json_reports_the_weight_dtype() {
    let m = fixtures().join("tiny-llama");
    let auto = match infomem_engine::backend::Dtype::auto(false).0 {
        infomem_engine::backend::Dtype::Bf16 => "bfloat16",
        infomem_engine::backend::Dtype::F32 => "float32",
    };
    for (dtype, want) in [(None, auto), (Some("auto"), auto), (Some("f32"), "float32"), (Some("bf16"), "bfloat16")] {
        let mut args = vec!["bench", "--model", s(&m), "--work", "score", "--batch", "1", "--seq-len", "8", "--score-last", "4", "--repeat", "1", "--json"];
        if let Some(d) = dtype {
            args.extend(["--dtype", d]);
        }
        let out = bin().args(&args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let last = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_string();
        let v: serde_json::Value = serde_json::from_str(&last).unwrap();
        assert_eq!(v["dtype"], want, "{args:?}: {last}");
        assert_eq!(v["tokens"], 8, "{args:?}: {last}"); // score counts every token of the batch
    }
}

#[test]
fn bad_activation_budget_variable() {
    let dir = tempfile::tempdir().unwrap();
    let batch = dir.path().join("batch.json");
    std::fs::write(&batch, r#"{"eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0, "conversations": [{"prompt": [1, 2, 3], "response": [4, 5], "advantage": 1.0}]}"#).unwrap();
    let (model, adapter, out) = (fixtures().join("tiny-llama"), fixtures().join("tiny-llama-lora"), dir.path().join("g.safetensors"));
    let args = ["grpo-grad", "--model", s(&model), "--adapter", s(&adapter), "--batch", s(&batch), "--out", s(&out)];
    let run = |v: &str| bin().args(args).env("INFOMEM_KEEP_ACTIVATIONS_MB", v).output().unwrap();
    let bad = run("lots");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(1), "{err}");
    assert!(err.contains("INFOMEM_KEEP_ACTIVATIONS_MB=\"lots\" is not a whole number of MiB"), "{err}");
    assert!(run("0").status.success(), "a valid budget (0: recompute every layer) must work");
}
