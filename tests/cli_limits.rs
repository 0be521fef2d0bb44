//! Limits through the real binary: outputs that would overwrite an input, sizes and budgets that
//! cannot fit, runaway chat templates, thread counts, values that would be silently wrong, and
//! outputs that cannot be written. Every case must exit 1 with a message naming the flag, file or
//! value — never a panic, an abort or a hang (the cases that used to hang run under a timeout).
mod common;
use common::cli::{bin, fails_cmd, fails_with, run_for, s, write_data, Agent};
use common::{fixtures, tiny_with_tokenizer};
use std::path::PathBuf;
use std::process::Command;

// ---- issue 13, item 8: an output that is an input -------------------------------------------

#[test]
fn output_that_is_an_input_is_refused() {
    let a = Agent::new();
    let t = a.tmp.path();
    let original = std::fs::read(&a.data).unwrap();
    let link = t.join("link.jsonl");
    std::os::unix::fs::symlink(&a.data, &link).unwrap();
    let hard = t.join("hard.jsonl");
    std::fs::hard_link(&a.data, &hard).unwrap();
    let dotted = t.join("sub/../data.jsonl");
    std::fs::create_dir_all(t.join("sub")).unwrap();
    for out in [&a.data, &link, &hard, &dotted] {
        a.fails("rollout", &a.data, out, &[], &["--out", "is also an input", "data.jsonl"]);
        a.fails("rollout", out, &a.data, &[], &["--out", "is also an input"]);
    }
    // eval writes predictions.jsonl into --out
    let preds = t.join("ev/predictions.jsonl");
    std::fs::create_dir_all(t.join("ev")).unwrap();
    std::fs::copy(&a.data, &preds).unwrap();
    a.fails("eval", &preds, &t.join("ev"), &[], &["--out", "predictions.jsonl", "is also an input"]);
    // the templates file and the model's own files are inputs too
    a.fails("rollout", &a.data, &a.templates, &[], &["is also an input", "templates.toml"]);
    a.fails("rollout", &a.data, &a.model.join("tokenizer.json"), &[], &["is also an input", "tokenizer.json"]);
    // data convert and data synth
    fails_with(&["data", "convert", "--data", s(&a.data), "--out", s(&link)], &["--out", "is also an input"]);
    fails_with(&["data", "convert", "--data", s(&hard), "--out", s(&a.data)], &["--out", "is also an input"]);
    let tok = std::fs::read(a.model.join("tokenizer.json")).unwrap();
    fails_with(
        &["data", "synth", "--task", "needle", "--tokens", "100", "--count", "1", "--model", s(&a.model), "--out", s(&a.model.join("tokenizer.json"))],
        &["--out", "is also an input", "tokenizer.json"],
    );
    assert_eq!(std::fs::read(&a.data).unwrap(), original, "the dataset was modified");
    assert_eq!(std::fs::read(a.model.join("tokenizer.json")).unwrap(), tok, "the tokenizer was modified");
    // a different file is fine, also one kept beside the model's files
    a.ok("rollout", &a.data, &t.join("traj.jsonl"), &[]);
    std::fs::write(a.model.join("traj.jsonl"), "old\n").unwrap();
    // (an existing output needs --overwrite: tests/reliability.rs)
    a.ok("rollout", &a.data, &a.model.join("traj.jsonl"), &["--overwrite"]);
    a.ok("eval", &a.data, &t.join("ev2"), &[]);
    // an evaluation is never written over: a second eval into ev2 is refused and the first is kept
    let before = std::fs::read(t.join("ev2/results.json")).unwrap();
    a.fails("eval", &a.data, &t.join("ev2"), &[], &["--out", "already holds an evaluation", "results.json"]);
    assert_eq!(std::fs::read(t.join("ev2/results.json")).unwrap(), before);
}

// ---- item 10: --chunk-tokens 0 ----------------------------------------------------------------

#[test]
fn zero_budgets_are_refused() {
    let a = Agent::new();
    let out = a.tmp.path().join("o");
    for cmd in ["rollout", "eval"] {
        a.fails(cmd, &a.data, &out, &["--chunk-tokens", "0"], &["--chunk-tokens", "at least 1"]);
        a.fails(cmd, &a.data, &out, &["--memory-tokens", "0"], &["--memory-tokens", "at least 1"]);
        a.fails(cmd, &a.data, &out, &["--answer-tokens", "0"], &["--answer-tokens", "at least 1"]);
    }
    a.fails("rollout", &a.data, &out, &["--group-size", "0"], &["--group-size", "at least 1"]);
}

// ---- item 11: --threads -----------------------------------------------------------------------

#[test]
fn thread_counts_are_capped_and_pool_failures_reported() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("s.jsonl");
    let synth = ["data", "synth", "--task", "needle", "--tokens", "100", "--count", "1", "--out", s(&out)];
    for n in ["100000", "1025", "18446744073709551615"] {
        let mut a = vec!["--threads", n];
        a.extend(synth);
        fails_with(&a, &["--threads", n, "at most 1024"]);
    }
    let mut c = bin();
    c.env("RAYON_NUM_THREADS", "100000").args(synth);
    fails_cmd(c, &["RAYON_NUM_THREADS", "100000", "at most 1024"]);
    // a pool that cannot start (here: too little address space for 1000 thread stacks) is an
    // error, not rayon's "global thread pool has not been initialized" panic
    let mut c = Command::new("sh");
    c.arg("-c").arg(format!("ulimit -v 1000000 && exec {} --threads 1000 {}", env!("CARGO_BIN_EXE_infomem-engine"), synth.join(" ")));
    fails_cmd(c, &["--threads 1000", "cannot start"]);
    let mut a = vec!["--threads", "3"];
    a.extend(synth);
    assert!(bin().args(&a).output().unwrap().status.success());
}

// ---- item 12: sizes that cannot fit -----------------------------------------------------------

#[test]
fn sizes_that_cannot_fit_are_errors() {
    let a = Agent::new();
    let out = a.tmp.path().join("o.jsonl");
    a.fails("rollout", &a.data, &out, &["--group-size", "1000000000"], &["--group-size", "1000000000", "memory"]);
    a.fails("rollout", &a.data, &out, &["--group-size", "18446744073709551615"], &["--group-size", "18446744073709551615"]);
    let synth = |tokens: &str, count: &str| {
        vec!["data", "synth", "--task", "needle", "--tokens", tokens, "--count", count, "--out", s(&out)].into_iter().map(String::from).collect::<Vec<_>>()
    };
    let v = synth("1000000000000", "1");
    fails_with(&v.iter().map(|x| x.as_str()).collect::<Vec<_>>(), &["--tokens", "1000000000000", "at most"]);
    let v = synth("100", "18446744073709551615");
    fails_with(&v.iter().map(|x| x.as_str()).collect::<Vec<_>>(), &["--count", "18446744073709551615", "memory"]);
    let v = synth("1000000", "1000000");
    fails_with(&v.iter().map(|x| x.as_str()).collect::<Vec<_>>(), &["--count", "1000000", "memory"]);
    // a 40 MB line: refused by the JSONL reader (named by line), in every command that reads data
    let big = a.tmp.path().join("big.jsonl");
    let mut text = serde_json::json!({"question": "q?", "context": "word ".repeat(8_000_000), "answers": ["a"]}).to_string();
    text.push('\n');
    text.push_str(&std::fs::read_to_string(&a.data).unwrap());
    std::fs::write(&big, text).unwrap();
    fails_with(&["data", "inspect", "--data", s(&big)], &["big.jsonl", "line 1", "MiB"]);
    a.fails("rollout", &big, &out, &[], &["big.jsonl", "line 1", "MiB"]);
    // with --skip-bad it is skipped like any malformed line
    let o = bin().args(["data", "inspect", "--skip-bad", "--json", "--data", s(&big)]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["records"], 3);
    assert_eq!(v["skipped"][0]["line"], 1);
}

// ---- item 13: agent budgets vs max_position_embeddings -----------------------------------------

#[test]
fn agent_budgets_are_checked_against_max_position() {
    let a = Agent::new();
    let out = a.tmp.path().join("o.jsonl");
    // a memory budget far past the model's 256 positions used to generate on and on
    for cmd in ["rollout", "eval"] {
        a.fails(cmd, &a.data, &out, &["--memory-tokens", "1000000000"], &["max_position_embeddings", "256", "--memory-tokens"]);
        a.fails(cmd, &a.data, &out, &["--answer-tokens", "300"], &["max_position_embeddings", "256"]);
    }
    // a 300-token question (byte-level tokenizer: one token a byte) cannot fit 256 positions
    let long_q = a.tmp.path().join("longq.jsonl");
    write_data(&long_q, &format!("What is the code? {}", "x".repeat(300)));
    a.fails("rollout", &long_q, &out, &[], &["r0", "question", "max_position_embeddings", "256"]);
    a.fails("eval", &long_q, &a.tmp.path().join("ev"), &[], &["r0", "question", "max_position_embeddings", "256"]);
    // the default templates alone take more than 256 tokens of the byte-level tokenizer
    let mut c = bin();
    c.args(["rollout", "--model", s(&a.model), "--data", s(&a.data), "--out", s(&out), "--chunk-tokens", "40", "--memory-tokens", "8"]);
    fails_cmd(c, &["max_position_embeddings", "256", "template"]);
    // budgets that fit still run
    a.ok("rollout", &a.data, &out, &["--chunk-tokens", "100", "--memory-tokens", "30"]);
}

/// `grpo-grad` with a sequence past the model's positions is refused (`limits::check_conversations_fit`).
#[test]
fn grpo_grad_refuses_sequences_past_max_position() {
    let t = tempfile::tempdir().unwrap();
    let batch = t.path().join("b.json");
    let prompt: Vec<u32> = (0..300).map(|i| 3 + i % 500).collect();
    let b = serde_json::json!({"eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.05,
        "conversations": [{"prompt": [1, 2, 3], "response": [4, 5], "advantage": 1.0},
                          {"prompt": prompt, "response": [7, 8], "advantage": -1.0}]});
    std::fs::write(&batch, b.to_string()).unwrap();
    let m = fixtures().join("tiny-llama");
    let ad = fixtures().join("tiny-llama-lora");
    fails_with(
        &["grpo-grad", "--model", s(&m), "--adapter", s(&ad), "--batch", s(&batch), "--out", s(&t.path().join("g.safetensors"))],
        &["conversation 1", "302", "max_position_embeddings", "256"],
    );
}

// ---- item 14: chat templates are bounded -------------------------------------------------------

#[test]
fn chat_templates_are_bounded() {
    let (_t, model) = tiny_with_tokenizer("llama");
    let tpl = model.join("chat_template.jinja");
    let generate = |extra: &str| {
        // bounded address space: an unbounded render aborts instead of eating the machine
        let mut c = Command::new("sh");
        c.arg("-c").arg(format!(
            "ulimit -v 4000000 && exec {} generate --model {} --chat hi --max-new-tokens 1 {extra}",
            env!("CARGO_BIN_EXE_infomem-engine"),
            s(&model)
        ));
        c
    };
    // 10^10 loop iterations: used to run forever
    std::fs::write(&tpl, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}").unwrap();
    fails_cmd(generate(""), &["chat template", "instructions"]);
    // 40 MB of output for a 2-byte message: used to be tokenized whole (GBs)
    std::fs::write(&tpl, "{% for i in range(40000) %}{{ 'x' * 1000 }}{% endfor %}{{ messages[0].content }}").unwrap();
    fails_cmd(generate(""), &["chat template", "MiB"]);
    // the real template still renders
    std::fs::copy(fixtures().join("smollm2-hf-meta/chat_template.jinja"), &tpl).unwrap();
    let o = run_for(generate("--json"), 60);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
}

// ---- item 17: values that would be silently wrong ----------------------------------------------

#[test]
fn silently_wrong_values_are_refused() {
    let a = Agent::new();
    let t = a.tmp.path();
    fails_with(
        &["data", "synth", "--task", "needle", "--tokens", "18446744073709551615", "--count", "1", "--out", s(&t.join("s.jsonl"))],
        &["--tokens", "18446744073709551615", "at most"],
    );
    assert!(!t.join("s.jsonl").exists());
    a.fails("eval", &a.data, &t.join("ev"), &["--lengths", "0"], &["--lengths", "0", "at least 1"]);
    a.fails("eval", &a.data, &t.join("ev"), &["--lengths", "100,0"], &["--lengths", "0", "at least 1"]);
    a.fails("rollout", &a.data, &t.join("o.jsonl"), &["--pad-to-tokens", "0"], &["--pad-to-tokens", "at least 1"]);
    fails_with(&["data", "convert", "--data", s(&a.data), "--pad-to-tokens", "0", "--out", s(&t.join("c.jsonl"))], &["--pad-to-tokens", "at least 1"]);
    for beta in ["NaN", "inf", "-inf"] {
        a.fails("rollout", &a.data, &t.join("o.jsonl"), &[&format!("--beta={beta}")], &["--beta", "finite"]);
    }
    a.fails("rollout", &a.data, &t.join("o.jsonl"), &["--temperature", "NaN"], &["--temperature"]);
    a.fails("rollout", &a.data, &t.join("o.jsonl"), &["--top-p", "0"], &["--top-p"]);
    fails_with(
        &["generate", "--model", s(&a.model), "--chat", "hi", "--max-new-tokens", "4", "--stop", "ok", "--stop", ""],
        &["--stop", "empty"],
    );
}

// ---- item 18 (part): an --out that cannot be written fails before the compute --------------------

#[test]
fn unwritable_out_fails_before_any_compute() {
    let a = Agent::new();
    let t = a.tmp.path();
    let file = t.join("a-file");
    std::fs::write(&file, "x").unwrap();
    // under a regular file; under a directory that cannot be created (/proc refuses new entries
    // even to root, where permission bits would not stop us); an existing directory as a file
    for out in [file.join("o.jsonl"), file.join("sub/o.jsonl"), PathBuf::from("/proc/infomem-no-such-dir/o.jsonl"), t.to_path_buf()] {
        let o = a.fails("rollout", &a.data, &out, &[], &["--out", s(&out)]);
        assert!(!o.stderr.contains("conversations"), "the rollout ran before the error:\n{}", o.stderr);
    }
    for out in [file.join("ev"), PathBuf::from("/proc/infomem-no-such-dir/ev"), file.clone()] {
        let o = a.fails("eval", &a.data, &out, &[], &["--out", s(&out)]);
        assert!(!o.stderr.contains("conversations"), "the eval ran before the error:\n{}", o.stderr);
    }
    fails_with(&["data", "synth", "--task", "needle", "--tokens", "100", "--out", s(&file.join("s.jsonl"))], &["--out"]);
    // no probe file is left behind in a writable directory
    a.ok("rollout", &a.data, &t.join("new/dir/o.jsonl"), &[]);
    let left: Vec<_> = std::fs::read_dir(t.join("new/dir")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("o.jsonl")]);
}

// ---- `machine`: the host's bounds, printed by tools/bench-compare.sh and tools/rollout-compare.sh

/// Out-of-range sizes are refused with the flag named; a small probe's JSON has finite positive
/// rates and one `threads` as asked, and its text is the one line the compare scripts print.
#[test]
fn machine_probe_sizes_are_checked_and_its_output_is_what_the_scripts_print() {
    fails_with(&["machine", "--read-mb", "0"], &["--read-mb", "between 1 and"]);
    fails_with(&["machine", "--read-mb", "2000000"], &["--read-mb", "between 1 and"]);
    // a buffer larger than the memory available is refused before it is allocated (an abort or
    // the OOM killer otherwise), unless this host has over 1 TiB free
    let avail_kb = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()));
    if avail_kb.is_some_and(|kb| kb < 1 << 30) {
        fails_with(&["machine", "--read-mb", "1048576"], &["--read-mb 1048576", "available", "lower --read-mb"]);
    }
    let mut c = bin();
    c.args(["--threads", "1", "machine", "--read-mb", "8", "--json"]);
    let out = run_for(c, 120);
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(out.stdout.trim().lines().last().unwrap()).unwrap();
    assert_eq!(v["threads"], 1);
    assert_eq!(v["read_bytes"], 8 << 20);
    for k in ["read_gib_s_1", "read_gib_s_all"] {
        let r = v[k].as_f64().unwrap_or(f64::NAN);
        assert!(r.is_finite() && r > 0.0, "{k}: {}", v[k]);
    }
    // a peak is a positive number where the CPU has the instruction, null where it does not
    for k in ["bf16_gflop_s", "f32_gflop_s"] {
        assert!(v[k].is_null() || v[k].as_f64().is_some_and(|r| r.is_finite() && r > 0.0), "{k}: {}", v[k]);
    }
    // the text the scripts print as it is: one line naming the read rates and both peaks
    let mut c = bin();
    c.args(["--threads", "1", "machine", "--read-mb", "8"]);
    let out = run_for(c, 120);
    assert_eq!(out.code, Some(0), "stderr: {}", out.stderr);
    assert_eq!(out.stdout.lines().count(), 1, "{}", out.stdout);
    for n in ["GiB/s on 1 thread", " on 1 (8 MiB, median of 5)", "vdpbf16ps peak", "f32 FMA peak"] {
        assert!(out.stdout.contains(n), "{n:?} not in {}", out.stdout);
    }
}
