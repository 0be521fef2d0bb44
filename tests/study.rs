//! `infomem-engine study` through the binary on a tiny model: config errors name the key, a
//! dry run prints the commands and creates nothing, a real 2 arms × 1 seed × 1 eval set plan
//! writes its report, a second run skips everything, a lost evaluation alone is redone and a
//! cell without its adapter resumes from its checkpoint. (The statistics: src/study/stats.rs.)
mod common;
use common::*;
use std::path::Path;
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_infomem-engine"))
}

fn study(cfg: &Path, extra: &[&str]) -> Output {
    bin().args(["study", "--config", cfg.to_str().unwrap()]).args(extra).output().unwrap()
}

/// A plan on the tiny model: arms `outcome` and `infomem`, seed 7, eval set `held`, 2 steps.
fn plan(dir: &Path, model: &Path, extra: &str) -> std::path::PathBuf {
    let data = dir.join("data.jsonl");
    write_code_qa(&data, 4, "");
    let cfg = dir.join("study.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"model = {model:?}
out = {out:?}
threads = 1
seeds = [7]
{extra}
[train]
data = {data:?}
steps = 2
queries_per_step = 2
group_size = 3
chunk_tokens = 40
memory_tokens = 8
answer_tokens = 4
temperature = 8.0
lora_r = 4
lora_alpha = 8.0
lora_targets = ["q", "v"]
lr = 0.005
warmup_steps = 0
save_every = 1

[eval]
chunk_tokens = 40
memory_tokens = 8
answer_tokens = 4
no_memory_curve = true

[[arms]]
name = "outcome"
reward = "outcome"

[[arms]]
name = "infomem"
reward = "infomem"
beta = 0.5

[[evals]]
name = "held"
data = {data:?}
"#,
            model = model.display().to_string(),
            out = dir.join("out").display().to_string(),
            data = data.display().to_string(),
        ),
    )
    .unwrap();
    cfg
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn config_errors_name_the_key() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(plan(tmp.path(), &model, "")).unwrap();
    let cases: [(&str, String, &str); 8] = [
        ("unknown top-level key", good.replace("threads = 1", "threads = 1\nbogus = 3"), "bogus"),
        ("unknown train flag", good.replace("steps = 2", "steps = 2\nstepz = 3"), "train.stepz"),
        ("duplicate arm", good.replace("name = \"infomem\"", "name = \"outcome\""), "used twice"),
        ("missing data file", good.replace("name = \"held\"\ndata = ", "name = \"held\"\ndata = \"/nonexistent/x.jsonl\"\n#"), "evals[0] (held).data"),
        ("no seeds", good.replace("seeds = [7]", "seeds = []"), "seeds"),
        ("bad arm name", good.replace("name = \"infomem\"", "name = \"info mem\""), "arms name"),
        ("arm seed outside the study's", good.replace("reward = \"infomem\"", "reward = \"infomem\"\nseeds = [8]"), "arms[1] (infomem).seeds: seed 8"),
        ("empty arm seeds", good.replace("reward = \"infomem\"", "reward = \"infomem\"\nseeds = []"), "arms[1] (infomem).seeds"),
    ];
    for (what, text, want) in cases {
        let cfg = tmp.path().join("bad.toml");
        std::fs::write(&cfg, text).unwrap();
        let o = study(&cfg, &["--dry-run"]);
        assert!(!o.status.success(), "{what}: accepted");
        assert!(stderr(&o).contains(want), "{what}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{what}: {}", stderr(&o));
    }
    assert!(!tmp.path().join("out").exists(), "a refused study created its out directory");
}

#[test]
fn dry_run_prints_commands_and_creates_nothing() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    let o = study(&cfg, &["--dry-run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("[cell 2/3] outcome-s7: train"), "{out}");
    assert!(out.contains("--reward outcome") && out.contains("--beta 0.5 --chunk-tokens 40") && out.contains("--reward infomem"), "{out}");
    assert!(out.contains("--lora-targets q,v") && out.contains("--no-memory-curve") && out.contains("--seed 7"), "{out}");
    assert!(out.contains("base: eval-held") && out.contains("infomem-s7: eval-held"), "{out}");
    assert!(!tmp.path().join("out").exists(), "--dry-run created the study directory");
    // an arm limited to some of the study's seeds is trained only with those
    let text = std::fs::read_to_string(&cfg).unwrap().replace("seeds = [7]", "seeds = [7, 9]").replace("reward = \"infomem\"", "reward = \"infomem\"\nseeds = [9]");
    let cfg2 = tmp.path().join("subset.toml");
    std::fs::write(&cfg2, text).unwrap();
    let o = study(&cfg2, &["--dry-run"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("4 cells"), "{out}{}", stderr(&o));
    assert!(out.contains("outcome-s7: train") && out.contains("outcome-s9: train") && out.contains("infomem-s9: train"), "{out}");
    assert!(!out.contains("infomem-s7"), "{out}");
    // --only with an unknown arm is refused
    let o = study(&cfg, &["--dry-run", "--only", "nope"]);
    assert!(!o.status.success() && stderr(&o).contains("no arm named \"nope\""), "{}", stderr(&o));
}

#[test]
fn runs_skips_and_resumes() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    let out = tmp.path().join("out");
    let o = study(&cfg, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    for f in ["study.json", "study.md", "accuracy_vs_step.png", "accuracy_vs_length.png", "base/eval-held/results.json"] {
        assert!(out.join(f).exists(), "{f} missing; {}", stderr(&o));
    }
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("study.json")).unwrap()).unwrap();
    let cells = j["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 3);
    assert!(cells.iter().all(|c| c["finished"] == true && c["evals"]["held"]["n"] == 4), "{j}");
    let summary = j["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 3, "{j}");
    assert_eq!(j["pairwise"].as_array().unwrap().len(), 1, "{j}");
    assert_eq!(j["pairwise"][0]["per_seed"][0]["n"], 4);
    let md = std::fs::read_to_string(out.join("study.md")).unwrap();
    assert!(md.contains("| outcome | 4 × 1 |") && md.contains("| base | 4 × 1 |") && md.contains("| outcome vs infomem |"), "{md}");

    // again: everything is skipped, nothing retrained
    let adapter = out.join("cells/outcome-s7/train/adapter/adapter_model.safetensors");
    let mtime = || std::fs::metadata(&adapter).unwrap().modified().unwrap();
    let before = mtime();
    let o = study(&cfg, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.matches("finished, skipped").count(), 3, "{err}");
    assert!(!err.contains(": train") && !err.contains(": eval"), "{err}");
    assert_eq!(mtime(), before, "a finished cell was retrained");

    // a lost evaluation: only that evaluation reruns
    std::fs::remove_file(out.join("cells/infomem-s7/eval-held/results.json")).unwrap();
    let o = study(&cfg, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("infomem-s7: eval-held"), "{err}");
    assert!(!err.contains(": train"), "{err}");
    assert_eq!(err.matches("finished, skipped").count(), 2, "{err}");
    assert!(out.join("cells/infomem-s7/eval-held/results.json").exists());

    // a cell stopped after its last checkpoint but before its adapter: resumed, not redone
    let cell = out.join("cells/outcome-s7");
    std::fs::remove_dir_all(cell.join("train/adapter")).unwrap();
    std::fs::remove_dir_all(cell.join("eval-held")).unwrap();
    let o = study(&cfg, &["--only", "outcome"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("outcome-s7: train (resume)"), "{}", stderr(&o));
    let log = std::fs::read_to_string(cell.join("log.txt")).unwrap();
    assert!(log.contains("--resume"), "{log}");
    assert_eq!(std::fs::read_to_string(cell.join("train/metrics.jsonl")).unwrap().lines().count(), 2, "the resumed cell retrained");
    assert!(adapter.exists() && cell.join("eval-held/results.json").exists());

    // --report-only rewrites the report from the cells
    std::fs::remove_file(out.join("study.md")).unwrap();
    let o = study(&cfg, &["--report-only"]);
    assert!(o.status.success() && out.join("study.md").exists(), "{}", stderr(&o));
}

#[test]
fn a_failing_cell_names_its_command_and_log() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    let text = std::fs::read_to_string(&cfg).unwrap().replace("group_size = 3", "group_size = 1");
    std::fs::write(&cfg, text).unwrap();
    let o = study(&cfg, &["--only", "outcome"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("outcome-s7: command failed") && err.contains("--group-size 1") && err.contains("outcome-s7/log.txt"), "{err}");
    assert!(err.contains("group"), "the log's last lines are shown: {err}");
}
