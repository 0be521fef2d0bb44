//! `infomem-engine train` end to end through the binary on a tiny model: TOML config + flags,
//! SIGINT saves and exits 130, SIGKILL loses at most the steps since the last checkpoint, and
//! `--resume` finishes with exactly the adapter an uninterrupted run produces. Also `merge`.
mod common;
use common::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_infomem-engine"))
}

fn write_config(path: &Path, model: &Path, data: &Path, steps: usize) {
    std::fs::write(
        path,
        format!(
            "model = {:?}\ndata = {:?}\nsteps = {steps}\nqueries_per_step = 2\ngroup_size = 3\nchunk_tokens = 40\nmemory_tokens = 8\nanswer_tokens = 4\ntemperature = 8.0\nlora_r = 4\nlora_alpha = 8.0\nlr = 0.005\nwarmup_steps = 0\nkl_coef = 0.05\nsave_every = 1\nseed = 5\n",
            model.display().to_string(),
            data.display().to_string()
        ),
    )
    .unwrap();
}

fn train(cfg: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    bin().args(["train", "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()]).args(extra).output().unwrap()
}

fn wait_for_checkpoint(out: &Path, step: usize, child: &mut std::process::Child) {
    let want = out.join(format!("checkpoints/step-{step:06}/state.json"));
    let t = Instant::now();
    while !want.exists() {
        assert!(child.try_wait().unwrap().is_none(), "training exited before step {step}");
        assert!(t.elapsed() < Duration::from_secs(120), "no checkpoint of step {step} after 2 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn interrupt_kill_and_resume() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    write_code_qa(&data, 6, "");
    let cfg = tmp.path().join("train.toml");
    write_config(&cfg, &model, &data, 6);

    // reference: uninterrupted
    let full = tmp.path().join("full");
    let o = train(&cfg, &full, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_to_string(full.join("metrics.jsonl")).unwrap().lines().count(), 6);

    // the same out directory again without --resume is refused
    let o = train(&cfg, &full, &[]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--resume"));

    // SIGINT after the second checkpoint: saves, exits 130
    let run = tmp.path().join("run");
    let mut child = bin()
        .args(["train", "--config", cfg.to_str().unwrap(), "--out", run.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_checkpoint(&run, 2, &mut child);
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume"));

    // resume, then SIGKILL mid-run (no chance to save): the last checkpoint survives intact
    let mut child = bin()
        .args(["train", "--config", cfg.to_str().unwrap(), "--out", run.to_str().unwrap(), "--resume"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_checkpoint(&run, 4, &mut child);
    child.kill().unwrap();
    child.wait().unwrap();

    // resume to the end: same adapter as the uninterrupted run, metrics without duplicates
    let o = train(&cfg, &run, &["--resume"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let a = std::fs::read(full.join("adapter/adapter_model.safetensors")).unwrap();
    let b = std::fs::read(run.join("adapter/adapter_model.safetensors")).unwrap();
    assert!(a == b, "interrupted + killed + resumed run ends with a different adapter");
    let steps: Vec<u64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5, 6]);

    // merge: the merged model scores like base + adapter
    let merged = tmp.path().join("merged");
    let o = bin().args(["merge", "--model", model.to_str().unwrap(), "--adapter", full.join("adapter").to_str().unwrap(), "--out", merged.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let score = |extra: &[&str], m: &Path| {
        let o = bin().args(["score", "--model", m.to_str().unwrap(), "--context-ids", "5,6,7,8", "--target-ids", "9,10,11", "--json"]).args(extra).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["mean_logprob"].as_f64().unwrap()
    };
    let with_adapter = score(&["--adapter", full.join("adapter").to_str().unwrap()], &model);
    let merged_lp = score(&[], &merged);
    assert!((with_adapter - merged_lp).abs() < 1e-3, "{with_adapter} vs {merged_lp}");
}
