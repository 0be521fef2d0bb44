//! The binary driven from outside, as users and the outside checks drive it: a runner that
//! kills a hang, "exit 1 with these words" assertions, and a tiny model with a tokenizer, short
//! templates and a small dataset for the agent commands (`rollout`, `eval`).
use super::tiny_with_tokenizer;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_infomem-engine"))
}

pub struct Out {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Run `cmd` for at most `secs` seconds (killed after that: a hang fails the test instead of
/// hanging it); the output goes through files so a chatty child never blocks on a full pipe.
pub fn run_for(mut cmd: Command, secs: u64) -> Out {
    let dir = tempfile::tempdir().unwrap();
    let (o, e) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap())
        .env("RUST_BACKTRACE", "0")
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(secs) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{cmd:?} still running after {secs} s (a hang); stderr: {}", std::fs::read_to_string(&e).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Out {
        code: status.code(),
        stdout: std::fs::read_to_string(&o).unwrap_or_default(),
        stderr: String::from_utf8_lossy(&std::fs::read(&e).unwrap()).into_owned(),
    }
}

/// `args` must exit 1 (not a panic's 101, not an abort) with every needle in stderr.
pub fn fails_with(args: &[&str], needles: &[&str]) -> Out {
    let mut c = bin();
    c.args(args);
    fails_cmd(c, needles)
}

pub fn fails_cmd(c: Command, needles: &[&str]) -> Out {
    let what = format!("{c:?}");
    let out = run_for(c, 60);
    assert_eq!(out.code, Some(1), "exit code of {what} (101 = panic, None = killed by a signal); stdout: {}\nstderr: {}", out.stdout, out.stderr);
    assert!(!out.stderr.contains("panicked"), "panic for {what}: {}", out.stderr);
    for n in needles {
        assert!(out.stderr.contains(n), "stderr of {what} lacks {n:?}:\n{}", out.stderr);
    }
    out
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Short templates, so that the agent's prompts fit the tiny models' 256 positions.
pub fn short_templates(dir: &Path) -> PathBuf {
    let p = dir.join("templates.toml");
    std::fs::write(&p, "update = \"Q:{question}\\nS:{chunk}\\nM:{memory}\"\nfinal = \"Q:{question}\\nM:{memory}\"\nempty_memory = \"-\"\n").unwrap();
    p
}

pub fn write_data(path: &Path, question: &str) {
    let mut t = String::new();
    for i in 0..3 {
        t.push_str(&serde_json::json!({"id": format!("r{i}"), "question": question,
            "context": format!("Some filler. The code {i} is {}. More filler.", 2000 + i), "answers": [format!("{}", 2000 + i)]}).to_string());
        t.push('\n');
    }
    std::fs::write(path, t).unwrap();
}

/// A tiny model with a tokenizer, short templates and a small dataset; `run` starts an agent
/// command (`rollout` or `eval`) on them with budgets that fit.
pub struct Agent {
    _model_tmp: tempfile::TempDir,
    pub model: PathBuf,
    pub tmp: tempfile::TempDir,
    pub templates: PathBuf,
    pub data: PathBuf,
}

impl Agent {
    pub fn new() -> Self {
        let (_model_tmp, model) = tiny_with_tokenizer("llama");
        let tmp = tempfile::tempdir().unwrap();
        let templates = short_templates(tmp.path());
        let data = tmp.path().join("data.jsonl");
        write_data(&data, "What is the code?");
        Agent { _model_tmp, model, tmp, templates, data }
    }

    pub fn args(&self, cmd: &str, data: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
        let mut v: Vec<String> = vec![cmd.into(), "--model".into(), s(&self.model).into(), "--templates".into(), s(&self.templates).into()];
        v.extend(["--data".into(), s(data).into(), "--out".into(), s(out).into()]);
        let has = |f: &str| extra.contains(&f);
        for (f, d) in [("--chunk-tokens", "40"), ("--memory-tokens", "8"), ("--answer-tokens", "4")] {
            if !has(f) {
                v.extend([f.to_string(), d.to_string()]);
            }
        }
        if cmd == "rollout" && !has("--group-size") {
            v.extend(["--group-size".into(), "2".into()]);
        }
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    }

    pub fn fails(&self, cmd: &str, data: &Path, out: &Path, extra: &[&str], needles: &[&str]) -> Out {
        let a = self.args(cmd, data, out, extra);
        fails_with(&a.iter().map(|x| x.as_str()).collect::<Vec<_>>(), needles)
    }

    pub fn ok(&self, cmd: &str, data: &Path, out: &Path, extra: &[&str]) {
        let mut c = bin();
        c.args(self.args(cmd, data, out, extra));
        let o = run_for(c, 60);
        assert_eq!(o.code, Some(0), "{cmd} {extra:?} should succeed: {}", o.stderr);
    }
}

