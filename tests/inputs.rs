//! Bad inputs of the data commands and of what they read beside the data (templates, a model's
//! tokenizer files, essays): each is a clear error naming the flag, file, key or value (exit 1),
//! never a hang, unbounded memory, a silent default or a misleading label.
#[allow(dead_code)]
mod common;
use common::cli::{bin, fails_cmd, fails_with, run_for, s, Agent};
use common::tiny_with_tokenizer;
use std::path::{Path, PathBuf};
use std::process::Command;

fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().expect("mkfifo");
    assert!(st.success());
}

fn ok(args: &[&str]) -> common::cli::Out {
    let mut c = bin();
    c.args(args);
    let o = run_for(c, 60);
    assert_eq!(o.code, Some(0), "{args:?} should succeed: {}", o.stderr);
    o
}

fn good_data(dir: &Path) -> PathBuf {
    let p = dir.join("good.jsonl");
    common::cli::write_data(&p, "What is the code?");
    p
}

// ------------------------------------------------------------------ not a regular file

#[test]
fn data_inputs_that_are_not_regular_files_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let fifo = t.path().join("fifo.jsonl");
    mkfifo(&fifo);
    let out = t.path().join("out.jsonl");
    // a FIFO blocked the read forever; /dev/zero was read without end (7 GB); a directory
    for (data, words) in [
        (s(&fifo), &["--data", "fifo.jsonl", "not a regular file"][..]),
        ("/dev/zero", &["--data", "/dev/zero", "not a regular file"][..]),
        (s(t.path()), &["--data", "is a directory"][..]),
    ] {
        fails_with(&["data", "inspect", "--data", data], words);
        fails_with(&["data", "convert", "--data", data, "--out", s(&out)], words);
    }
    assert!(!out.exists());
    // the agent commands read --data through the same reader
    let a = Agent::new();
    a.fails("eval", &fifo, &a.tmp.path().join("ev"), &[], &["fifo.jsonl", "not a regular file"]);
    a.fails("rollout", Path::new("/dev/zero"), &a.tmp.path().join("r.jsonl"), &[], &["/dev/zero", "not a regular file"]);
}

#[test]
fn templates_that_are_not_regular_files_are_refused() {
    let a = Agent::new();
    let fifo = a.tmp.path().join("t.toml");
    mkfifo(&fifo);
    let mut args = a.args("rollout", &a.data, &a.tmp.path().join("r.jsonl"), &[]);
    let i = args.iter().position(|x| x == "--templates").unwrap();
    args[i + 1] = s(&fifo).into();
    let mut c = bin();
    c.args(&args);
    fails_cmd(c, &["templates file", "t.toml", "not a regular file"]);
}

#[test]
fn tokenizer_files_that_are_not_regular_files_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let data = good_data(t.path());
    for (name, fifo) in [("tokenizer.json", true), ("tokenizer_config.json", true), ("chat_template.jinja", false), ("generation_config.json", true)] {
        let (_m, model) = tiny_with_tokenizer("llama");
        let p = model.join(name);
        let _ = std::fs::remove_file(&p);
        if fifo {
            mkfifo(&p);
        } else {
            std::fs::create_dir(&p).unwrap();
        }
        let why = if fifo { "not a regular file" } else { "is a directory" };
        fails_with(&["data", "inspect", "--model", s(&model), "--data", s(&data)], &[name, why]);
    }
}

#[test]
fn essays_that_are_not_regular_files_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let essays = t.path().join("essays");
    std::fs::create_dir(&essays).unwrap();
    std::fs::write(essays.join("a.txt"), "One sentence here. ".repeat(200)).unwrap();
    mkfifo(&essays.join("b.txt"));
    let out = t.path().join("o.jsonl");
    fails_with(
        &["data", "synth", "--task", "needle", "--tokens", "200", "--count", "1", "--filler", "essays", "--essays-dir", s(&essays), "--out", s(&out)],
        &["essay", "b.txt", "not a regular file"],
    );
}

/// Peak resident memory (KiB) and exit code of a child, through wait4 (the process's own
/// rusage, not that of the other tests' children).
fn peak_rss_kib(mut c: Command) -> (i64, i32) {
    let child = c.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let pid = child.id() as libc::pid_t;
    let start = std::time::Instant::now();
    loop {
        let mut status = 0;
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // Safety: wait4 on our own child with valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
        if r == pid {
            return (ru.ru_maxrss, if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { -1 });
        }
        assert!(start.elapsed().as_secs() < 60, "still running after 60 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_huge_jsonl_line_is_refused_without_being_held_in_memory() {
    let t = tempfile::tempdir().unwrap();
    let big = t.path().join("big.jsonl");
    // a good record, then one line of 160 MiB (5 times the 32 MiB cap), then a good record
    let good = r#"{"question":"q?","context":"c.","answers":["a"]}"#;
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&big).unwrap());
        writeln!(f, "{good}").unwrap();
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..160 {
            f.write_all(&chunk).unwrap();
        }
        writeln!(f).unwrap();
        writeln!(f, "{good}").unwrap();
    }
    fails_with(&["data", "inspect", "--data", s(&big)], &["big.jsonl", "line 2", "160.0 MiB", "32 MiB"]);
    // skipped with --skip-bad, the lines after it still read; the whole file was never in memory
    let mut c = bin();
    c.args(["data", "inspect", "--skip-bad", "--data", s(&big)]);
    let (rss, code) = peak_rss_kib(c);
    assert_eq!(code, 0);
    assert!(rss < 80 << 10, "peak RSS {} MiB reading a 160 MiB line", rss >> 10);
    let o = ok(&["data", "inspect", "--skip-bad", "--json", "--data", s(&big)]);
    let v: serde_json::Value = serde_json::from_str(o.stdout.trim()).unwrap();
    assert_eq!(v["records"], 2);
    assert_eq!(v["skipped"][0]["line"], 2);
}

// ------------------------------------------------------------------ synth --chars-per-token

#[test]
fn chars_per_token_is_bounded_and_printed_compactly() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("x.jsonl");
    let base = ["data", "synth", "--task", "needle", "--tokens", "200", "--count", "1", "--out", s(&out), "--chars-per-token"];
    // these hung, growing ~1 GB in 10 s: every filler sentence rounded to 0 tokens
    for (v, shown) in [("400", "400"), ("1000", "1000"), ("1e6", "1000000"), ("1e300", "1e300")] {
        let mut args = base.to_vec();
        args.push(v);
        let mut c = bin();
        c.args(&args);
        let o = run_for(c, 20);
        assert_eq!(o.code, Some(1), "{v}: {}", o.stderr);
        for w in ["--chars-per-token", "at most 64", &format!("got {shown}")] {
            assert!(o.stderr.contains(w), "{v}: {w:?} not in {}", o.stderr);
        }
    }
    let mut args = base.to_vec();
    args.push("1e-300");
    let o = fails_with(&args, &["--chars-per-token", "more than 0.5", "got 1e-300"]);
    assert!(o.stderr.len() < 400, "a long number in: {}", o.stderr);
    assert!(!out.exists());
    // the bound itself works, and quickly
    let mut args = base.to_vec();
    args.push("64");
    ok(&args);
    assert!(out.exists());
}

// ------------------------------------------------------------------ synth flags that do not apply

#[test]
fn synth_flags_the_task_does_not_use_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("x.jsonl");
    let run = |task: &str, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["data", "synth", "--task", task, "--tokens", "300", "--count", "1", "--out", s(&out), "--overwrite"]
            .iter()
            .map(|x| x.to_string())
            .collect();
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let fails = |task: &str, extra: &[&str], words: &[&str]| {
        let a = run(task, extra);
        fails_with(&a.iter().map(String::as_str).collect::<Vec<_>>(), words);
    };
    fails("needle", &["--hop-order", "shuffled"], &["--hop-order", "multihop", "needle"]);
    fails("vartrack", &["--hop-order", "forward"], &["--hop-order", "multihop"]);
    fails("multihop", &["--var-question", "which"], &["--var-question", "vartrack", "multihop"]);
    fails("needle", &["--answer-kind", "word", "--digits", "3"], &["--digits", "--answer-kind number"]);
    fails("multikey", &["--hops", "3"], &["--hops", "multihop and vartrack", "multikey"]);
    let (_m, model) = tiny_with_tokenizer("llama");
    fails("needle", &["--model", s(&model), "--chars-per-token", "4"], &["--chars-per-token", "without --model"]);
    assert!(!out.exists());
    // where they apply they work, as do the defaults
    for (task, extra) in [
        ("multihop", &["--hop-order", "shuffled", "--hops", "3"][..]),
        ("vartrack", &["--var-question", "which", "--hops", "2"][..]),
        ("needle", &["--digits", "3", "--chars-per-token", "4"][..]),
        ("multikey", &[][..]),
    ] {
        let a = run(task, extra);
        ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    }
    let line = std::fs::read_to_string(&out).unwrap();
    assert!(line.contains("\"task\":\"multikey\""));
    // --seed of inspect/convert draws the padding only
    let data = good_data(t.path());
    fails_with(&["data", "inspect", "--data", s(&data), "--seed", "3"], &["--seed", "--pad-to-tokens"]);
    ok(&["data", "inspect", "--data", s(&data), "--seed", "3", "--pad-to-tokens", "50"]);
    // --model of convert sizes the padding only
    let conv = t.path().join("c.jsonl");
    fails_with(&["data", "convert", "--data", s(&data), "--model", s(&model), "--out", s(&conv)], &["--model", "--pad-to-tokens"]);
    ok(&["data", "convert", "--data", s(&data), "--model", s(&model), "--pad-to-tokens", "50", "--out", s(&conv)]);
}

// ------------------------------------------------------------------ strict templates

#[test]
fn templates_files_are_strict() {
    let a = Agent::new();
    let tpl = a.tmp.path().join("bad.toml");
    let base = "update = \"Q:{question}\\nS:{chunk}\\nM:{memory}\"\nfinal = \"Q:{question}\\nM:{memory}\"\n";
    for (text, words) in [
        // a misspelt key used to be ignored and the default empty memory used
        (format!("{base}empty_memroy = \"-\"\n"), &["unknown key `empty_memroy`", "did you mean `empty_memory`", "bad.toml"][..]),
        (format!("{base}[extra]\nx = 1\n"), &["unknown key `extra`", "`update`, `final`, `empty_memory`"][..]),
        // an unknown placeholder was rendered literally
        (base.replace("S:{chunk}", "S:{chunk} {bogus}"), &["unknown placeholder {bogus}", "{question}, {chunk}, {memory}", "update"][..]),
        (base.replace("final = \"Q:{question}\\nM:{memory}\"", "final = \"Q:{question}\\nM:{memory} {memroy}\""), &["{memroy}", "did you mean {memory}", "{question}, {memory}", "final"][..]),
    ] {
        std::fs::write(&tpl, text).unwrap();
        let mut args = a.args("rollout", &a.data, &a.tmp.path().join("r.jsonl"), &[]);
        let i = args.iter().position(|x| x == "--templates").unwrap();
        args[i + 1] = s(&tpl).into();
        let mut c = bin();
        c.args(&args);
        fails_cmd(c, words);
    }
    // literal braces that are not `{word}` stay text
    std::fs::write(&tpl, base.replace("S:{chunk}", "S:{chunk} {} {\\\"a\\\": 1}")).unwrap();
    let mut args = a.args("rollout", &a.data, &a.tmp.path().join("r.jsonl"), &[]);
    let i = args.iter().position(|x| x == "--templates").unwrap();
    args[i + 1] = s(&tpl).into();
    let mut c = bin();
    c.args(&args);
    let o = run_for(c, 120);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
}

// ------------------------------------------------------------------ record keys

#[test]
fn a_misspelt_record_key_is_refused_not_defaulted() {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join("d.jsonl");
    let good = r#"{"id":"a","question":"q?","context":"c.","answers":["x"],"task":"t"}"#;
    for (bad, words) in [
        // "tsk" silently made the task the file's name, the label eval groups accuracy by
        (r#"{"id":"b","question":"q?","context":"c.","answers":["x"],"tsk":"t"}"#, &["d.jsonl", "line 2", "\"tsk\"", "\"task\""][..]),
        (r#"{"id":"b","question":"q?","context":"c.","Answers":["x"],"answers":["y"]}"#, &["line 2", "\"Answers\"", "\"answers\""][..]),
        (r#"{"id":"b","questoin":"q?","question":"q","context":"c.","answers":["x"]}"#, &["line 2", "\"questoin\"", "\"question\""][..]),
        (r#"{"id":"b","question":"q?","context":"c.","answers":["x"],"task":5}"#, &["line 2", "\"task\" must be a string"][..]),
        (r#"{"id":["b"],"question":"q?","context":"c.","answers":["x"]}"#, &["line 2", "\"id\" must be a string or a number"][..]),
    ] {
        std::fs::write(&p, format!("{good}\n{bad}\n")).unwrap();
        fails_with(&["data", "inspect", "--data", s(&p)], words);
    }
    // keys of other datasets are no typos: kept in meta
    std::fs::write(&p, format!("{good}\n{}\n", r#"{"qid":"b","question":"q?","context":"c.","answers":["x"],"type":"bridge","level":"hard"}"#)).unwrap();
    let out = t.path().join("o.jsonl");
    ok(&["data", "convert", "--data", s(&p), "--out", s(&out)]);
    let second: serde_json::Value = serde_json::from_str(std::fs::read_to_string(&out).unwrap().lines().nth(1).unwrap()).unwrap();
    assert_eq!(second["meta"]["qid"], "b");
    assert_eq!(second["meta"]["type"], "bridge");
    assert_eq!(second["task"], "d");
}

// ------------------------------------------------------------------ tokenizer config types

#[test]
fn a_special_token_of_the_wrong_type_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let data = good_data(t.path());
    for (file, text, words) in [
        ("tokenizer_config.json", r#"{"bos_token": "<|im_start|>", "eos_token": ["x"]}"#, &["tokenizer_config.json", "\"eos_token\"", "a list"][..]),
        ("tokenizer_config.json", r#"{"bos_token": 5, "eos_token": "<|im_end|>"}"#, &["tokenizer_config.json", "\"bos_token\"", "a number"][..]),
        ("tokenizer_config.json", r#"{"eos_token": {"text": "<|im_end|>"}}"#, &["tokenizer_config.json", "\"eos_token\"", "\"content\""][..]),
        ("tokenizer_config.json", r#"{"eos_token": "<|im_end|>", "pad_token": true}"#, &["tokenizer_config.json", "\"pad_token\"", "a boolean"][..]),
        ("tokenizer_config.json", r#"{"eos_token": "<|im_end|>", "chat_template": 3}"#, &["tokenizer_config.json", "\"chat_template\"", "a number"][..]),
        ("tokenizer_config.json", r#"["eos_token"]"#, &["tokenizer_config.json", "a JSON object"][..]),
        ("generation_config.json", r#"{"eos_token_id": "2"}"#, &["generation_config.json", "\"eos_token_id\"", "not a token id"][..]),
        ("generation_config.json", r#"{"eos_token_id": [2, -1]}"#, &["generation_config.json", "\"eos_token_id\"", "-1"][..]),
    ] {
        let (_m, model) = tiny_with_tokenizer("llama");
        std::fs::write(model.join(file), text).unwrap();
        fails_with(&["data", "inspect", "--model", s(&model), "--data", s(&data)], words);
    }
    // the AddedToken form and null are fine
    let (_m, model) = tiny_with_tokenizer("llama");
    std::fs::write(model.join("tokenizer_config.json"), r#"{"bos_token": null, "eos_token": {"content": "<|im_end|>"}, "pad_token": null}"#).unwrap();
    ok(&["data", "inspect", "--model", s(&model), "--data", s(&data)]);
}
