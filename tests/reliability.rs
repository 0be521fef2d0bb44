//! Issue 51 through the real binary: no command replaces an input or an existing output unasked
//! (one rule, one word: `--overwrite`), nothing silently wrong, sizes checked up front, errors
//! early and clear. docs/RELIABILITY.md lists each promise with the test here that checks it.
mod common;
use common::cli::{bin, fails_cmd, fails_with, run_for, s, Agent};
use common::{cases, fixtures, write_code_qa};
use std::path::Path;
use std::time::{Duration, Instant};

fn ok(args: &[&str]) -> common::cli::Out {
    let mut c = bin();
    c.args(args);
    let o = run_for(c, 120);
    assert_eq!(o.code, Some(0), "{args:?} should succeed: {}", o.stderr);
    o
}

/// The llama GRPO case of the fixtures as a batch file; returns (model, adapter, batch).
fn grpo_case(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let g = &cases()["llama"]["grpo"];
    let batch = dir.join("batch.json");
    std::fs::write(&batch, serde_json::to_string(g).unwrap()).unwrap();
    // copies: a refused --out must leave these bytes as they were
    let model = dir.join("model");
    let adapter = dir.join("adapter");
    for (src, dst) in [(fixtures().join("tiny-llama"), &model), (fixtures().join(g["adapter_dir"].as_str().unwrap()), &adapter)] {
        std::fs::create_dir_all(dst).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
    (model, adapter, batch)
}

// ---- items 1-3: outputs -------------------------------------------------------------------------

#[test]
fn grpo_grad_never_writes_over_an_input_or_an_old_output() {
    let t = tempfile::tempdir().unwrap();
    let (model, adapter, batch) = grpo_case(t.path());
    let base = ["grpo-grad", "--model", s(&model), "--adapter", s(&adapter), "--batch", s(&batch)];
    let inputs = [adapter.join("adapter_model.safetensors"), model.join("model.safetensors"), model.join("config.json"), batch.clone()];
    let before: Vec<Vec<u8>> = inputs.iter().map(|p| std::fs::read(p).unwrap()).collect();
    for out in &inputs {
        for extra in [&[][..], &["--overwrite"][..]] {
            let mut a = base.to_vec();
            a.extend(["--out", s(out)]);
            a.extend(extra);
            fails_with(&a, &["--out", "is also an input"]);
        }
    }
    for (p, b) in inputs.iter().zip(&before) {
        assert_eq!(&std::fs::read(p).unwrap(), b, "{} was modified", p.display());
    }
    // an existing output is refused without --overwrite, replaced with it
    let out = t.path().join("grads.safetensors");
    std::fs::write(&out, "keep").unwrap();
    let mut a = base.to_vec();
    a.extend(["--out", s(&out)]);
    fails_with(&a, &["--out", "already exists", "--overwrite"]);
    assert_eq!(std::fs::read(&out).unwrap(), b"keep");
    a.push("--overwrite");
    ok(&a);
    assert!(std::fs::metadata(&out).unwrap().len() > 1000, "the gradients were not written");
}

#[test]
fn data_and_rollout_outputs_are_new_unless_overwrite() {
    let a = Agent::new();
    let t = a.tmp.path();
    let forty = t.join("forty.jsonl");
    write_code_qa(&forty, 40, "x");
    let original = std::fs::read(&forty).unwrap();
    let synth = ["data", "synth", "--task", "needle", "--tokens", "100", "--count", "1", "--out", s(&forty)];
    let convert = ["data", "convert", "--data", s(&a.data), "--out", s(&forty)];
    fails_with(&synth, &["--out", "forty.jsonl", "already exists", "--overwrite"]);
    fails_with(&convert, &["--out", "forty.jsonl", "already exists", "--overwrite"]);
    a.fails("rollout", &a.data, &forty, &[], &["--out", "already exists", "--overwrite"]);
    assert_eq!(std::fs::read(&forty).unwrap(), original, "a refused command changed its --out");
    ok(&[&synth[..], &["--overwrite"]].concat());
    assert_eq!(std::fs::read_to_string(&forty).unwrap().lines().count(), 1);
    ok(&[&convert[..], &["--overwrite"]].concat());
    assert_eq!(std::fs::read_to_string(&forty).unwrap().lines().count(), 3);
    a.ok("rollout", &a.data, &forty, &["--overwrite"]);
}

#[test]
fn import_gguf_refuses_a_model_directory_and_names_a_directory_given_as_the_file() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("model");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("config.json"), "{}").unwrap();
    std::fs::write(out.join("model.safetensors.index.json"), "{}").unwrap();
    let gguf = t.path().join("m.gguf");
    std::fs::write(&gguf, "GGUF").unwrap();
    fails_with(&["import-gguf", "--gguf", s(&gguf), "--out", s(&out)], &["--out", "not empty", "config.json", "--overwrite"]);
    assert_eq!(std::fs::read_to_string(out.join("config.json")).unwrap(), "{}");
    // with --overwrite a file that fails its checks leaves the old model whole
    fails_with(&["import-gguf", "--gguf", s(&gguf), "--out", s(&out), "--overwrite"], &["m.gguf"]);
    assert!(out.join("model.safetensors.index.json").exists(), "the old files were deleted before the GGUF was checked");
    // a directory (or a FIFO, which would block on open) given as the GGUF file
    fails_with(&["import-gguf", "--gguf", s(t.path()), "--out", s(&t.path().join("o"))], &["is a directory", "--gguf takes a .gguf file"]);
    let fifo = t.path().join("pipe.gguf");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    fails_with(&["import-gguf", "--gguf", s(&fifo), "--out", s(&t.path().join("o"))], &["not a regular file"]);
}

/// The real import over a directory with a stale shard index: `--overwrite` leaves a model that
/// loads (the index would have sent the loader to shards that do not exist). Needs SmolLM2's
/// GGUF from tools/fetch-smollm2.sh.
#[test]
fn import_gguf_overwrite_leaves_no_stale_model_file() {
    let Some(smol) = common::smol_dir() else { return };
    // tools/fetch-smollm2.sh keeps the GGUF in $INFOMEM_CACHE/gguf, beside the model directory
    let gguf = smol.parent().unwrap().join("gguf/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.exists() {
        assert!(std::env::var("INFOMEM_REQUIRE_SMOL").as_deref() != Ok("1"), "{} is missing (run tools/fetch-smollm2.sh)", gguf.display());
        eprintln!("skipped: {} is missing", gguf.display());
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("model");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("model.safetensors.index.json"), r#"{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}"#).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    ok(&["import-gguf", "--gguf", s(&gguf), "--out", s(&out), "--overwrite"]);
    assert!(!out.join("model.safetensors.index.json").exists());
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine", "a file import-gguf does not write was deleted");
    ok(&["score", "--model", s(&out), "--context-ids", "1,2,3", "--target-ids", "4"]);
}

#[test]
fn merge_overwrite_replaces_the_model_files_only() {
    let t = tempfile::tempdir().unwrap();
    let (model, adapter, _) = grpo_case(t.path());
    let out = t.path().join("merged");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("model.safetensors.index.json"), r#"{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}"#).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    fails_with(&["merge", "--model", s(&model), "--adapter", s(&adapter), "--out", s(&out)], &["not empty", "--overwrite"]);
    ok(&["merge", "--model", s(&model), "--adapter", s(&adapter), "--out", s(&out), "--overwrite"]);
    assert!(!out.join("model.safetensors.index.json").exists(), "a stale shard index was left beside the merged weights");
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
    ok(&["score", "--model", s(&out), "--context-ids", "1,2,3", "--target-ids", "4"]);
    // the adapter's own directory as --out: its files are inputs
    fails_with(&["merge", "--model", s(&model), "--adapter", s(&adapter), "--out", s(&adapter), "--overwrite"], &["is also an input"]);
}

// ---- items 5, 6, 11: eval -------------------------------------------------------------------------

#[test]
fn eval_lengths_and_data_are_each_counted_once_and_labelled_truly() {
    let a = Agent::new();
    let out = a.tmp.path().join("ev");
    a.fails("eval", &a.data, &out, &["--lengths", "600,600"], &["--lengths", "600", "more than once"]);
    let data = s(&a.data).to_string();
    a.fails("eval", &a.data, &out, &["--data", &data], &["--data", "more than once"]);
    // the records are ~20 tokens on their own: a row labelled 5 would hold 4x longer documents
    a.fails("eval", &a.data, &out, &["--lengths", "5"], &["--lengths 5", "on their own", "at least"]);
    // three short records cannot pad each other to 100000 tokens
    a.fails("eval", &a.data, &out, &["--lengths", "100000"], &["--lengths 100000", "at most"]);
    assert!(!out.exists(), "a refused eval left its --out behind");
}

#[test]
fn eval_takes_its_lock_before_any_work() {
    let a = Agent::new();
    let out = a.tmp.path().join("ev");
    std::fs::create_dir(&out).unwrap();
    // another process holds the directory (as a live train or eval would)
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(out.join(".train.lock")).unwrap();
    use std::os::unix::io::AsRawFd;
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let t = Instant::now();
    let o = a.fails("eval", &a.data, &out, &[], &["--out", "in use by another run"]);
    assert!(t.elapsed() < Duration::from_secs(20));
    assert!(!o.stderr.contains("conversations"), "the eval ran before it was refused: {}", o.stderr);
    drop(lock);
    a.ok("eval", &a.data, &out, &[]);
    // a finished evaluation is replaced only with --overwrite
    a.fails("eval", &a.data, &out, &[], &["already holds an evaluation", "--overwrite"]);
    a.ok("eval", &a.data, &out, &["--overwrite"]);
}

// ---- items 7, 8: grpo-grad batches, reward -----------------------------------------------------

#[test]
fn grpo_grad_batch_keys_are_known_and_logprobs_not_positive() {
    let t = tempfile::tempdir().unwrap();
    let (model, adapter, batch) = grpo_case(t.path());
    let g = cases()["llama"]["grpo"].clone();
    let run = |g: &serde_json::Value, needles: &[&str]| {
        std::fs::write(&batch, serde_json::to_string(g).unwrap()).unwrap();
        let out = t.path().join("g.safetensors");
        fails_with(&["grpo-grad", "--model", s(&model), "--adapter", s(&adapter), "--batch", s(&batch), "--out", s(&out)], needles);
        assert!(!out.exists());
    };
    let mut misspelt = g.clone();
    let c0 = misspelt["conversations"][0].as_object_mut().unwrap();
    let v = c0.remove("old_logprobs").expect("the fixture's first conversation has old_logprobs");
    c0.insert("old_logprob".into(), v);
    run(&misspelt, &["unknown key", "old_logprob", "old_logprobs"]);
    let mut top = g.clone();
    top["token_norms"] = 64.into();
    run(&top, &["unknown key", "token_norms", "did you mean \"token_norm\""]);
    let mut conv = g.clone();
    conv["conversations"][1]["weight"] = 2.into();
    run(&conv, &["conversation 1", "unknown key", "weight"]);
    let mut positive = g.clone();
    positive["conversations"][0]["old_logprobs"][0] = 0.5.into();
    run(&positive, &["old_logprobs[0] = 0.5", "positive"]);
}

#[test]
fn reward_of_extreme_gains_is_finite_and_an_empty_file_an_error() {
    let t = tempfile::tempdir().unwrap();
    let g = t.path().join("g.jsonl");
    std::fs::write(&g, "{\"outcomes\": [1, 1, 0], \"gains\": [1.7e308, -1.7e308, 3.0]}\n").unwrap();
    let o = ok(&["reward", "--groups", s(&g)]);
    let v: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert_eq!(v["final_rewards"], serde_json::json!([1.5, 0.5, 0.0]));
    // a reward that overflows (--beta × a raw gain) is an error naming the group
    std::fs::write(&g, "{\"outcomes\": [1, 0], \"gains\": [1e308, 0]}\n").unwrap();
    fails_with(&["reward", "--groups", s(&g), "--mode", "infomem-raw", "--beta", "10"], &["group 1", "line 1", "overflows"]);
    std::fs::write(&g, "\n").unwrap();
    fails_with(&["reward", "--groups", s(&g)], &["no groups"]);
    std::fs::write(&g, "{\"outcomes\": [1], \"gains\": [0.1], \"gain\": 2}\n").unwrap();
    fails_with(&["reward", "--groups", s(&g)], &["line 1", "gain"]);
}

// ---- item 9: bench sizes ------------------------------------------------------------------------

#[test]
fn bench_shapes_are_checked_before_the_model_loads() {
    let m = fixtures().join("tiny-llama");
    for (extra, needles) in [
        (&["--work", "score", "--seq-len", "4000000000"][..], &["--seq-len 4000000000", "max_position_embeddings 256"][..]),
        (&["--work", "score", "--seq-len", "300"], &["300 positions", "max_position_embeddings 256"]),
        (&["--work", "decode", "--seq-len", "200", "--new-tokens", "100"], &["300 positions"]),
        (&["--work", "score", "--batch", "100000000000", "--seq-len", "32", "--score-last", "8"], &["--batch 100000000000", "memory", "lower --batch"]),
        (&["--work", "train", "--batch", "100000000000", "--seq-len", "200", "--score-last", "8"], &["memory"]),
        (&["--work", "score", "--chunks", "3"], &["--chunks", "rollout only"]),
    ] {
        let mut a = vec!["bench", "--model", s(&m)];
        a.extend(extra);
        let t = Instant::now();
        fails_with(&a, needles);
        assert!(t.elapsed() < Duration::from_secs(10), "{a:?} took {:?} to be refused", t.elapsed());
    }
    // the JSON has each size only where the work uses it
    let o = ok(&["bench", "--model", s(&m), "--work", "score", "--seq-len", "32", "--score-last", "8", "--batch", "1", "--json"]);
    let v: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert!(v["new_tokens"].is_null() && v["score_last"] == 8, "{v}");
}

// ---- items 13, 14, cosmetics ---------------------------------------------------------------------

#[test]
fn train_refuses_a_non_utf8_out_before_making_it() {
    use std::os::unix::ffi::OsStrExt;
    let a = Agent::new();
    let bad = a.tmp.path().join(std::ffi::OsStr::from_bytes(b"run-\xff"));
    let mut c = bin();
    c.args(["train", "--model", s(&a.model), "--data", s(&a.data), "--templates", s(&a.templates), "--steps", "1", "--out"]).arg(&bad);
    fails_cmd(c, &["--out", "run-", "not valid UTF-8"]);
    assert!(!bad.exists(), "the refused run left its directory behind");
    // a run refused after its lock was taken leaves neither
    let out = a.tmp.path().join("run");
    fails_with(&["train", "--model", s(&a.model), "--data", s(&a.tmp.path().join("none.jsonl")), "--steps", "1", "--out", s(&out)], &["none.jsonl"]);
    assert!(!out.exists(), "the failed run left {} behind", out.display());
}

#[test]
fn more_threads_than_cores_is_said() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("s.jsonl");
    let o = ok(&["--threads", "1024", "data", "synth", "--task", "needle", "--tokens", "100", "--count", "1", "--out", s(&out)]);
    assert!(o.stderr.contains("--threads 1024") && o.stderr.contains("more threads than") && o.stderr.contains("cores"), "{}", o.stderr);
    let o = ok(&["--threads", "1", "data", "synth", "--task", "needle", "--tokens", "100", "--count", "1", "--out", s(&out), "--overwrite"]);
    assert!(!o.stderr.contains("more threads than"), "{}", o.stderr);
}

#[test]
fn device_json_reports_its_failure_as_json() {
    let mut c = bin();
    c.args(["device", "--json", "--ordinal", "99"]);
    let o = run_for(c, 60);
    if o.code == Some(0) {
        return; // a machine with 100 GPUs
    }
    assert_eq!(o.code, Some(1), "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", o.stdout));
    assert_eq!(v["ok"], false);
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
}

#[test]
fn resume_with_fewer_steps_than_done_is_refused_and_equal_is_said() {
    let (_m, model) = common::tiny_for_agent("llama");
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("d.jsonl");
    write_code_qa(&data, 4, "r");
    let out = t.path().join("run");
    let base = ["train", "--model", s(&model), "--data", s(&data), "--out", s(&out), "--queries-per-step", "1", "--group-size", "2", "--chunk-tokens", "40", "--memory-tokens", "8", "--answer-tokens", "4", "--lora-r", "2"];
    ok(&[&base[..], &["--steps", "2"]].concat());
    let metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let config = std::fs::read(out.join("config.toml")).unwrap();
    fails_with(&["train", "--out", s(&out), "--resume", "--steps", "1"], &["--steps 1", "already at step 2", "at least 2"]);
    let o = ok(&["train", "--out", s(&out), "--resume", "--steps", "2"]);
    assert!(o.stderr.contains("already done its 2 steps"), "{}", o.stderr);
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), metrics);
    assert_eq!(std::fs::read(out.join("config.toml")).unwrap(), config);
    // --overwrite deletes the old run's files, so it may not start from that run's adapter
    let adapter = std::fs::read(out.join("adapter/adapter_model.safetensors")).unwrap();
    let init = out.join("adapter");
    fails_with(&[&base[..], &["--steps", "1", "--overwrite", "--init-adapter", s(&init)]].concat(), &["--out", "adapter", "also an input"]);
    assert_eq!(std::fs::read(out.join("adapter/adapter_model.safetensors")).unwrap(), adapter);
}

// ---- the outside sweep's findings (docs/RELIABILITY.md, "How this was swept") -------------------

#[test]
fn inputs_that_are_not_regular_files_are_refused_by_name() {
    let t = tempfile::tempdir().unwrap();
    let (model, adapter, _) = grpo_case(t.path());
    let fifo = t.path().join("fifo");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let out = t.path().join("o.safetensors");
    for args in [
        vec!["grpo-grad", "--model", s(&model), "--adapter", s(&adapter), "--batch", s(&fifo), "--out", s(&out)],
        vec!["grpo-grad", "--model", s(&model), "--adapter", s(&adapter), "--batch", "/dev/zero", "--out", s(&out)],
        vec!["reward", "--groups", s(&fifo)],
        vec!["train", "--config", s(&fifo)],
        vec!["study", "--config", s(&fifo), "--dry-run"],
    ] {
        let t0 = Instant::now();
        fails_with(&args, &["not a regular file"]);
        assert!(t0.elapsed() < Duration::from_secs(10), "{args:?}");
    }
    // a directory where the weights file should be
    let m2 = t.path().join("m2");
    std::fs::create_dir(&m2).unwrap();
    std::fs::copy(model.join("config.json"), m2.join("config.json")).unwrap();
    std::fs::create_dir(m2.join("model.safetensors")).unwrap();
    fails_with(&["score", "--model", s(&m2), "--context-ids", "1,2", "--target-ids", "3"], &["model.safetensors", "is a directory"]);
}

#[test]
fn a_new_output_is_reserved_so_a_second_command_is_refused_at_once() {
    let a = Agent::new();
    let out = a.tmp.path().join("race.jsonl");
    // the first command is still running (a bigger batch of work) when the second starts
    let mut first = bin();
    first.args(a.args("rollout", &a.data, &out, &["--group-size", "8"]));
    let mut child = first.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let t0 = Instant::now();
    let lock = a.tmp.path().join(".race.jsonl.lock");
    while !lock.exists() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let second = a.fails("rollout", &a.data, &out, &[], &["--out", "race.jsonl", "in use by another run"]);
    assert!(!second.stderr.contains("panicked"));
    assert!(child.wait().unwrap().success());
    assert!(std::fs::read_to_string(&out).unwrap().lines().count() >= 3, "the first command's output is whole");
    // a refused or failed command leaves no placeholder behind
    let out2 = a.tmp.path().join("never.jsonl");
    a.fails("rollout", &a.data, &out2, &["--group-size", "0"], &["--group-size"]);
    a.fails("rollout", &a.tmp.path().join("missing.jsonl"), &out2, &[], &["missing.jsonl"]);
    assert!(!out2.exists() && !a.tmp.path().join(".never.jsonl.lock").exists(), "a failed rollout left its reservation behind");
    assert!(!lock.exists(), "the finished rollout left its reservation behind");
}

#[test]
fn runs_of_different_kinds_and_inputs_never_share_a_directory() {
    let a = Agent::new();
    let t = a.tmp.path();
    // the model directory as an eval's or a train's --out
    a.fails("eval", &a.data, &a.model, &["--overwrite"], &["--out", "also an input"]);
    fails_with(&["train", "--model", s(&a.model), "--data", s(&a.data), "--templates", s(&a.templates), "--out", s(&a.model), "--overwrite", "--steps", "1"], &["--out", "also an input"]);
    // an evaluation into a train run's directory, and a run into an evaluation's
    let run = t.join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "").unwrap();
    a.fails("eval", &a.data, &run, &["--overwrite"], &["--out", "a training run", "metrics.jsonl"]);
    let ev = t.join("ev");
    a.ok("eval", &a.data, &ev, &[]);
    fails_with(&["train", "--model", s(&a.model), "--data", s(&a.data), "--templates", s(&a.templates), "--out", s(&ev), "--overwrite", "--steps", "1"], &["--out", "an evaluation", "results.json"]);
    // one file given twice (a symlink, a copy): each question once
    let link = t.join("link.jsonl");
    std::os::unix::fs::symlink(&a.data, &link).unwrap();
    a.fails("eval", &a.data, &t.join("e2"), &["--data", s(&link)], &["--data", "more than once"]);
    let copy = t.join("copy.jsonl");
    std::fs::copy(&a.data, &copy).unwrap();
    a.fails("eval", &a.data, &t.join("e3"), &["--data", s(&copy)], &["record id", "twice"]);
}

/// One KV sizing for the agent (`agent::rollout_kv_tokens`, which `train`'s steps and its CUDA
/// memory plan call too): the cache `eval` and `rollout` say a batch needs is that function's
/// value for the same budgets, group and questions.
#[test]
fn eval_and_rollout_size_the_kv_cache_by_the_one_function() {
    use infomem_engine::agent::{rollout_kv_tokens, Budget};
    let a = Agent::new();
    let out = a.tmp.path().join("kv.jsonl");
    let text = std::fs::read_to_string(&a.data).unwrap();
    let questions: Vec<String> = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["question"].as_str().unwrap().to_string()).collect();
    let budget = Budget { chunk_tokens: 40, memory_tokens: 8, answer_tokens: 4 };
    for (cmd, group) in [("eval", 1), ("rollout", 2)] {
        let o = a.fails(cmd, &a.data, &out, &["--kv-tokens", "1", "--batch-queries", "100"], &["--kv-tokens 1", "needs"]);
        let need: usize = o.stderr.split(" needs ").nth(1).and_then(|t| t.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{}", o.stderr));
        assert_eq!(need, rollout_kv_tokens(&budget, group, questions.iter().map(|q| q.as_str())), "{cmd}: {}", o.stderr);
    }
}

#[test]
fn zero_and_unholdable_batch_settings_are_refused_before_the_rollout() {
    let a = Agent::new();
    let out = a.tmp.path().join("o.jsonl");
    for cmd in ["rollout", "eval"] {
        a.fails(cmd, &a.data, &out, &["--batch-queries", "0"], &["--batch-queries", "1.."]);
        a.fails(cmd, &a.data, &out, &["--max-batch-tokens", "0"], &["--max-batch-tokens"]);
        let o = a.fails(cmd, &a.data, &out, &["--kv-tokens", "1"], &["--kv-tokens 1", "needs"]);
        assert!(!o.stderr.contains("KV cache is full"), "{}", o.stderr);
    }
    let m = fixtures().join("tiny-llama");
    fails_with(&["bench", "--model", s(&m), "--work", "score", "--seq-len", "16", "--score-last", "4", "--repeat", "99999999999"], &["--repeat", "1..="]);
    fails_with(&["bench", "--model", s(&m), "--work", "rollout", "--seq-len", "16", "--new-tokens", "4", "--chunks", "99999999"], &["--chunks"]);
}

#[test]
fn json_failures_are_json_and_numbers_beyond_f32_are_named() {
    let t = tempfile::tempdir().unwrap();
    let (model, adapter, batch) = grpo_case(t.path());
    let mut g = cases()["llama"]["grpo"].clone();
    g["conversations"][0]["advantage"] = 1e308.into();
    std::fs::write(&batch, serde_json::to_string(&g).unwrap()).unwrap();
    let mut c = bin();
    c.args(["grpo-grad", "--model", s(&model), "--adapter", s(&adapter), "--batch", s(&batch), "--out", s(&t.path().join("g.st")), "--json"]);
    let o = fails_cmd(c, &["advantage", "does not fit in f32"]);
    let v: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", o.stdout));
    assert_eq!(v["ok"], false);
    assert!(v["error"].as_str().unwrap().contains("does not fit in f32"), "{v}");
    // a weight that the mode never reads
    let gp = t.path().join("g.jsonl");
    std::fs::write(&gp, "{\"outcomes\": [1, 0], \"gains\": [0.1, 0.2]}\n").unwrap();
    fails_with(&["reward", "--groups", s(&gp), "--mode", "outcome", "--beta", "5"], &["--beta", "no effect", "outcome"]);
}

#[test]
fn a_resume_refuses_edited_templates_and_model_files() {
    let (_m, model) = common::tiny_for_agent("llama");
    let t = tempfile::tempdir().unwrap();
    let data = t.path().join("d.jsonl");
    write_code_qa(&data, 4, "r");
    let tpl = t.path().join("t.toml");
    std::fs::write(&tpl, "update = \"Q:{question}\\nS:{chunk}\\nM:{memory}\"\nfinal = \"Q:{question}\\nM:{memory}\"\nempty_memory = \"-\"\n").unwrap();
    let out = t.path().join("run");
    ok(&["train", "--model", s(&model), "--data", s(&data), "--templates", s(&tpl), "--out", s(&out), "--steps", "1", "--queries-per-step", "1", "--group-size", "2",
        "--chunk-tokens", "40", "--memory-tokens", "8", "--answer-tokens", "4", "--lora-r", "2"]);
    std::fs::write(&tpl, "update = \"Question:{question}\\nS:{chunk}\\nM:{memory}\"\nfinal = \"Q:{question}\\nM:{memory}\"\nempty_memory = \"-\"\n").unwrap();
    fails_with(&["train", "--out", s(&out), "--resume", "--steps", "2"], &["--resume", "changed", "templates"]);
    std::fs::write(&tpl, "update = \"Q:{question}\\nS:{chunk}\\nM:{memory}\"\nfinal = \"Q:{question}\\nM:{memory}\"\nempty_memory = \"-\"\n").unwrap();
    let cfg = model.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("\"rms_norm_eps\": 0.00001", "\"rms_norm_eps\": 0.000001").replace("\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": 1e-06")).unwrap();
    assert_ne!(std::fs::read_to_string(&cfg).unwrap(), text, "the fixture's rms_norm_eps spelling changed: edit another value");
    fails_with(&["train", "--out", s(&out), "--resume", "--steps", "2"], &["--resume", "changed", "model/config.json"]);
    std::fs::write(&cfg, text).unwrap();
    // the data moved (a copy with the same content, as a study may name it): the run goes on
    // from the new path; a copy with other content is refused
    let moved = t.path().join("moved.jsonl");
    std::fs::copy(&data, &moved).unwrap();
    ok(&["train", "--out", s(&out), "--resume", "--steps", "2", "--data", s(&moved)]);
    write_code_qa(&moved, 5, "other");
    fails_with(&["train", "--out", s(&out), "--resume", "--steps", "3", "--data", s(&moved)], &["--resume", "data"]);
}
