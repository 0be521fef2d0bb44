//! The training run directory through the binary (issue 13, items 1–7 and 9): `--resume` continues
//! the run in `--out` and refuses changed settings or data, one `train` at a time per directory,
//! no fresh run over an old one, hyperparameters checked up front and non-finite updates undone,
//! `merge` into a clean directory only, temp files that never follow a planted symlink, SIGTERM and
//! SIGHUP saving like SIGINT, and stale partial checkpoints cleaned up. Tiny models only.
mod common;
use common::*;
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::model::lora::{LoraAdapter, Proj};
use infomem_engine::model::weights::SafetensorsSet;
use infomem_engine::runtime::Model;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_infomem-engine"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The settings of tests/train_cli.rs (fast steps on a tiny model); model and data as given
/// (relative paths stay relative).
fn write_config(path: &Path, model: &Path, data: &Path, steps: usize, lr: &str) {
    std::fs::write(
        path,
        format!(
            "model = {:?}\ndata = {:?}\nsteps = {steps}\nqueries_per_step = 2\ngroup_size = 3\nchunk_tokens = 40\nmemory_tokens = 8\nanswer_tokens = 4\ntemperature = 8.0\nlora_r = 4\nlora_alpha = 8.0\nlr = {lr}\nwarmup_steps = 0\nkl_coef = 0.05\nsave_every = 1\nseed = 5\n",
            model.display().to_string(),
            data.display().to_string()
        ),
    )
    .unwrap();
}

/// A model with a tokenizer, training data and a config file in a fresh temp dir.
struct Setup {
    _model_tmp: tempfile::TempDir,
    model: PathBuf,
    tmp: tempfile::TempDir,
    data: PathBuf,
    cfg: PathBuf,
}

fn setup(steps: usize) -> Setup {
    let (_model_tmp, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    write_code_qa(&data, 6, "");
    let cfg = tmp.path().join("train.toml");
    write_config(&cfg, &model, &data, steps, "0.005");
    Setup { _model_tmp, model, tmp, data, cfg }
}

fn train(cfg: &Path, out: &Path, extra: &[&str]) -> Output {
    bin().args(["train", "--config", s(cfg), "--out", s(out)]).args(extra).output().unwrap()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "exit {:?}: {}", o.status.code(), err(o));
}

/// Exit 1 (not a panic, not 0) with every needle in stderr.
fn refused(o: &Output, needles: &[&str]) {
    let e = err(o);
    assert_eq!(o.status.code(), Some(1), "expected a refusal (exit 1), stderr:\n{e}");
    assert!(!e.contains("panicked"), "{e}");
    for n in needles {
        assert!(e.contains(n), "stderr lacks {n:?}:\n{e}");
    }
}

fn metric_steps(out: &Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect()
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn wait_for_checkpoint(out: &Path, step: usize, child: &mut Child) {
    let want = out.join(format!("checkpoints/step-{step:06}/state.json"));
    let t = Instant::now();
    while !want.exists() {
        assert!(child.try_wait().unwrap().is_none(), "training exited before step {step}");
        assert!(t.elapsed() < Duration::from_secs(120), "no checkpoint of step {step} after 2 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn spawn_train(cfg: &Path, out: &Path, extra: &[&str]) -> Child {
    bin().args(["train", "--config", s(cfg), "--out", s(out)]).args(extra).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Item 1: `--resume` continues the run in `--out` (not the one its checkpoint was saved from),
/// paths are saved absolute, and changed settings or data are refused by name.
#[test]
fn resume_uses_out_and_refuses_changed_settings() {
    let st = setup(2);
    let root = st.tmp.path();
    // relative model/data paths, run from `root`
    std::fs::create_dir_all(root.join("models")).unwrap();
    let model_rel = Path::new("models/m");
    std::fs::rename(&st.model, root.join(model_rel)).unwrap();
    let cfg_rel = root.join("rel.toml");
    write_config(&cfg_rel, model_rel, Path::new("data.jsonl"), 2, "0.005");
    let run = |args: &[&str], cwd: &Path| bin().args(["train"]).args(args).current_dir(cwd).output().unwrap();
    ok(&run(&["--config", "rel.toml", "--out", "runs/A"], root));
    std::fs::rename(root.join("runs/A"), root.join("runs/B")).unwrap();
    ok(&run(&["--config", "rel.toml", "--out", "runs/A"], root));
    let a = root.join("runs/A");
    let before = (std::fs::read(a.join("adapter/adapter_model.safetensors")).unwrap(), metric_steps(&a), listing(&a.join("checkpoints")));

    // resumed from another working directory, with no config file: the saved (absolute) paths
    let elsewhere = tempfile::tempdir().unwrap();
    let b = root.join("runs/B");
    ok(&run(&["--out", s(&b), "--resume", "--steps", "3"], elsewhere.path()));
    assert_eq!(metric_steps(&b), vec![1, 2, 3]);
    let after = (std::fs::read(a.join("adapter/adapter_model.safetensors")).unwrap(), metric_steps(&a), listing(&a.join("checkpoints")));
    assert!(before == after, "resuming runs/B changed runs/A");
    let saved = std::fs::read_to_string(b.join("config.toml")).unwrap();
    let abs_model = root.join(model_rel).canonicalize().unwrap();
    assert!(saved.contains(&format!("model = {:?}", s(&abs_model))), "saved paths are not absolute:\n{saved}");

    // the same config file from its own directory still resumes
    ok(&run(&["--config", "rel.toml", "--out", "runs/B", "--resume", "--steps", "4"], root));
    assert_eq!(metric_steps(&b), vec![1, 2, 3, 4]);

    // changed settings: refused, naming each difference
    refused(&run(&["--config", "rel.toml", "--out", "runs/B", "--resume", "--steps", "5", "--lr", "0.01"], root), &["lr", "0.005", "0.01"]);
    refused(&run(&["--config", "rel.toml", "--out", "runs/B", "--resume", "--steps", "5", "--lora-r", "8"], root), &["lora_r", "4", "8"]);
    let other_model = root.join("models/other");
    std::fs::create_dir_all(&other_model).unwrap();
    for e in std::fs::read_dir(root.join(model_rel)).unwrap().flatten() {
        std::fs::copy(e.path(), other_model.join(e.file_name())).unwrap();
    }
    refused(&run(&["--config", "rel.toml", "--out", "runs/B", "--resume", "--steps", "5", "--model", "models/other"], root), &["model", "models/other"]);
    refused(&run(&["--config", "rel.toml", "--out", "runs/B", "--resume", "--steps", "5", "--data", s(&st.cfg)], root), &["data"]);
    write_config(&root.join("changed.toml"), model_rel, Path::new("data.jsonl"), 2, "0.007");
    refused(&run(&["--config", "changed.toml", "--out", "runs/B", "--resume", "--steps", "5"], root), &["lr", "0.007"]);
    // same file, same record count, different content
    write_code_qa(&st.data, 6, " edited");
    refused(&run(&["--out", "runs/B", "--resume", "--steps", "5"], root), &["data.jsonl", "sha256"]);
    assert_eq!(metric_steps(&b), vec![1, 2, 3, 4], "a refused resume must not touch the run");
}

/// Item 2: one `train` per `--out` at a time; the second is refused with the holder's pid, and
/// the lock dies with its holder.
#[test]
fn second_train_on_a_busy_out_is_refused() {
    let st = setup(2);
    let out = st.tmp.path().join("run");
    let mut a = spawn_train(&st.cfg, &out, &["--steps", "100000"]);
    wait_for_checkpoint(&out, 1, &mut a);
    let pid = format!("pid {}", a.id());
    let o = train(&st.cfg, &out, &["--resume", "--steps", "1"]);
    let o2 = train(&st.cfg, &out, &[]);
    let fresh = train(&st.cfg, &st.tmp.path().join("other"), &["--steps", "1"]);
    a.kill().unwrap();
    a.wait().unwrap();
    refused(&o, &[&pid, s(&out)]);
    refused(&o2, &[&pid]);
    ok(&fresh);
    // the holder is gone: its lock file no longer blocks (a resume to the steps it has done:
    // fewer are refused, tests/reliability.rs)
    let done = listing(&out.join("checkpoints")).iter().filter_map(|n| n.strip_prefix("step-")?.parse::<usize>().ok()).max().unwrap();
    ok(&train(&st.cfg, &out, &["--resume", "--steps", &done.to_string()]));
}

/// Item 3: a fresh run never writes over another run's files; `--overwrite` starts over and
/// deletes only the run's own files.
#[test]
fn fresh_train_into_a_non_empty_out_is_refused() {
    let st = setup(2);
    let out = st.tmp.path().join("run");
    std::fs::create_dir_all(out.join("adapter")).unwrap();
    std::fs::write(out.join("adapter/adapter_config.json"), "{}").unwrap();
    std::fs::write(out.join("metrics.jsonl"), "{\"step\": 7}\n").unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    refused(&train(&st.cfg, &out, &[]), &[s(&out), "--resume", "--overwrite", "metrics.jsonl"]);
    assert_eq!(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap(), "{\"step\": 7}\n");
    assert_eq!(std::fs::read_to_string(out.join("adapter/adapter_config.json")).unwrap(), "{}");
    ok(&train(&st.cfg, &out, &["--overwrite"]));
    assert_eq!(metric_steps(&out), vec![1, 2]);
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine");
    assert!(out.join("adapter/adapter_model.safetensors").exists());
    // an empty directory is a fresh one
    let empty = st.tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    ok(&train(&st.cfg, &empty, &["--steps", "1"]));
}

/// Item 4, up front: every numeric hyperparameter is finite and in range, from flags and from
/// the config file, before anything is loaded or written.
#[test]
fn bad_hyperparameters_are_refused_up_front() {
    let st = setup(2);
    let cases: &[(&str, &str, &str)] = &[
        ("--weight-decay", "NaN", "--weight-decay"),
        ("--lora-alpha", "NaN", "--lora-alpha"),
        ("--warmup-steps", "18446744073709551615", "--warmup-steps"),
        ("--lr", "1e30", "--lr"),
        ("--lr", "0", "--lr"),
        ("--beta", "NaN", "--beta"),
        ("--clip-low", "1.5", "--clip-low"),
        ("--clip-high", "inf", "--clip-high"),
        ("--kl-coef", "NaN", "--kl-coef"),
        ("--grad-clip", "-1", "--grad-clip"),
        ("--temperature", "inf", "--temperature"),
        ("--top-p", "0", "--top-p"),
        ("--steps", "0", "--steps"),
        ("--chunk-tokens", "0", "--chunk-tokens"),
    ];
    for (i, (flag, v, needle)) in cases.iter().enumerate() {
        let out = st.tmp.path().join(format!("run{i}"));
        let o = train(&st.cfg, &out, &[&format!("{flag}={v}")]);
        refused(&o, &[needle, "got"]);
        assert!(!out.join("metrics.jsonl").exists(), "{flag} {v}: a refused run wrote metrics");
    }
    let bad = st.tmp.path().join("bad.toml");
    std::fs::write(&bad, std::fs::read_to_string(&st.cfg).unwrap() + "weight_decay = nan\n").unwrap();
    refused(&train(&bad, &st.tmp.path().join("runf"), &[]), &["weight_decay", "NaN"]);
}

/// Item 4, after the update: parameters or optimizer moments that turn non-finite are restored
/// and the step skipped with the reason in metrics.jsonl; too many such steps in a row stop the
/// run with an error. (A huge LoRA A with B = 0 leaves the forward finite, but without gradient
/// clipping its B gradient squared overflows AdamW's second moment.)
#[test]
fn non_finite_updates_are_undone_and_stop_the_run() {
    let st = setup(8);
    let cfg0 = Model::load(&st.model, CpuBackend::new()).unwrap().cfg;
    let mut ad = LoraAdapter::init(&cfg0, 4, 8.0, &[Proj::Q, Proj::V], 1);
    for row in ad.layers.iter_mut() {
        for p in row.iter_mut().flatten() {
            p.a.data.iter_mut().for_each(|x| *x = if *x > 0.0 { 1e30 } else { -1e30 });
        }
    }
    let init = st.tmp.path().join("huge-adapter");
    ad.save_peft(&init).unwrap();
    let out = st.tmp.path().join("run");
    let o = train(&st.cfg, &out, &["--init-adapter", s(&init), "--grad-clip", "0", "--save-every", "0"]);
    refused(&o, &["in a row", "non-finite"]);
    let ms: Vec<serde_json::Value> =
        std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let restored = ms.iter().filter(|m| m["skipped"].as_str().is_some_and(|s| s.contains("exp_avg_sq") && s.contains("restored"))).count();
    let n = infomem_engine::rl::trainer::MAX_NONFINITE_STEPS_IN_A_ROW;
    assert!(restored == n && ms.len() == n, "expected {n} restored steps, then a stop: {ms:?}");
    // the checkpoint saved at the stop holds the initial adapter and finite moments
    let ck = infomem_engine::rl::trainer::latest_checkpoint(&out).expect("a checkpoint of the last good step");
    let opt = SafetensorsSet::open_files(&[ck.join("optimizer.safetensors")]).unwrap();
    for name in opt.names() {
        assert!(opt.get_f32(name, None).unwrap().data.iter().all(|v| v.is_finite()), "{name} is not finite in the checkpoint");
    }
    let saved = LoraAdapter::load(&ck.join("adapter"), &cfg0).unwrap();
    for (x, y) in saved.layers.iter().flatten().flatten().zip(ad.layers.iter().flatten().flatten()) {
        assert!(x.a.data == y.a.data && x.b.data == y.b.data, "a restored step changed the adapter");
    }
}

/// Item 5: `merge` writes only into a new or empty directory and refuses non-finite adapters.
#[test]
fn merge_refuses_a_non_empty_out_and_a_non_finite_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-llama");
    let adapter = fixtures().join("tiny-llama-lora");
    let out = tmp.path().join("merged");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("model.safetensors.index.json"), r#"{"weight_map": {}}"#).unwrap();
    let merge = |ad: &Path, out: &Path| bin().args(["merge", "--model", s(&model), "--adapter", s(ad), "--out", s(out)]).output().unwrap();
    refused(&merge(&adapter, &out), &[s(&out), "model.safetensors.index.json", "not empty"]);
    assert_eq!(listing(&out), vec!["model.safetensors.index.json"]);

    let cfg = Model::load(&model, CpuBackend::new()).unwrap().cfg;
    let mut ad = LoraAdapter::load(&adapter, &cfg).unwrap();
    ad.layers[0].iter_mut().flatten().next().unwrap().b.data[3] = f32::NAN;
    let nan = tmp.path().join("nan-adapter");
    ad.save_peft(&nan).unwrap();
    let out2 = tmp.path().join("merged2");
    refused(&merge(&nan, &out2), &["non-finite", "lora_B"]);
    assert!(!out2.join("model.safetensors").exists() && !out2.join("config.json").exists());
    // an empty directory is fine
    let out3 = tmp.path().join("merged3");
    std::fs::create_dir_all(&out3).unwrap();
    ok(&merge(&adapter, &out3));
}

/// Item 6: a symlink planted where the old code put its temp file (`.NAME.tmp.PID`, opened with
/// O_TRUNC) is never followed: the victim file stays as it was and the output is a regular file.
/// The binary's pid is not known before it starts, so links are planted for the next few
/// thousand pids (Linux hands them out in order).
#[test]
fn atomic_writes_do_not_follow_planted_symlinks() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    let dir = tmp.path().join("d");
    std::fs::create_dir_all(&dir).unwrap();
    let next = Command::new("true").spawn().unwrap();
    let p0 = next.id();
    let mut next = next;
    next.wait().unwrap();
    for p in p0 + 1..p0 + 4000 {
        std::os::unix::fs::symlink(&victim, dir.join(format!(".data.jsonl.tmp.{p}"))).unwrap();
    }
    let o = bin().args(["data", "synth", "--task", "needle", "--tokens", "200", "--count", "2", "--out", s(&dir.join("data.jsonl"))]).output().unwrap();
    ok(&o);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious", "the write followed a planted symlink");
    let meta = std::fs::symlink_metadata(dir.join("data.jsonl")).unwrap();
    assert!(meta.file_type().is_file(), "the output is not a regular file");
}

/// Item 7: SIGTERM and SIGHUP save the last completed step like SIGINT and exit 128 + signal;
/// the run resumes from that checkpoint.
#[test]
fn sigterm_and_sighup_save_a_checkpoint() {
    let st = setup(6);
    for (sig, code) in [(libc::SIGTERM, 143), (libc::SIGHUP, 129)] {
        let out = st.tmp.path().join(format!("run{sig}"));
        let mut child = spawn_train(&st.cfg, &out, &["--save-every", "2"]);
        wait_for_checkpoint(&out, 2, &mut child);
        unsafe { libc::kill(child.id() as i32, sig) };
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(code), "signal {sig}: {}", err(&o));
        assert!(err(&o).contains("--resume"), "{}", err(&o));
        let ck = infomem_engine::rl::trainer::latest_checkpoint(&out).unwrap();
        let n: usize = ck.file_name().unwrap().to_str().unwrap()["step-".len()..].parse().unwrap();
        assert!(n >= 2 && metric_steps(&out).len() == n, "checkpoint {n} vs metrics {:?}", metric_steps(&out));
        ok(&train(&st.cfg, &out, &["--resume"]));
        assert_eq!(metric_steps(&out), vec![1, 2, 3, 4, 5, 6]);
    }
}

/// Item 9: partial checkpoint directories of dead processes are removed when a run starts or
/// resumes; one whose pid is alive is left alone.
#[test]
fn stale_partial_checkpoints_are_removed() {
    let st = setup(1);
    let out = st.tmp.path().join("run");
    ok(&train(&st.cfg, &out, &[]));
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let ck = out.join("checkpoints");
    let stale = [ck.join(format!(".tmp-step-000002-{dead_pid}")), ck.join(format!(".tmp-step-000002-{dead_pid}-0123abcd"))];
    let live = ck.join(format!(".tmp-step-000002-{}", std::process::id()));
    for d in stale.iter().chain([&live]) {
        std::fs::create_dir_all(d.join("adapter")).unwrap();
        std::fs::write(d.join("adapter/adapter_model.safetensors"), "partial").unwrap();
    }
    ok(&train(&st.cfg, &out, &["--resume", "--steps", "2"]));
    for d in &stale {
        assert!(!d.exists(), "{} was not removed", d.display());
    }
    assert!(live.exists(), "a live process's partial checkpoint was removed");
}

/// A run whose conversations cannot fit the model's positions (or whose adapter cannot fit in
/// memory) is refused before the first step, naming the budget and the limit; nothing is written
/// but the lock file.
#[test]
fn train_refuses_conversations_past_max_position() {
    let st = setup(2);
    // the fixture's own 256 positions: the default templates alone make ~460-token prompts
    let cfg_path = st.model.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 256.into();
    std::fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    let out = st.tmp.path().join("run");
    refused(&train(&st.cfg, &out, &[]), &["max_position_embeddings 256", "positions"]);
    assert!(!out.exists(), "a run refused before its first step leaves no directory (nor lock) behind");
}
