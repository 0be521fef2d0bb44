//! `infomem-engine study` through the binary on a tiny model: config errors name the key, every
//! value is checked before anything runs, a dry run prints the commands and creates nothing, a
//! real 2 arms × 1 seed × 1 eval set plan writes its report, a second run skips everything, a
//! lost evaluation alone is redone, a cell without its adapter resumes from its checkpoint, a
//! changed setting is refused, unpaired answers are not tested, and an interrupted or killed
//! study leaves nothing running. (The statistics: src/study/stats.rs.)
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

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let t = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), t).unwrap();
        }
    }
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
    assert!(out.contains("--reward=outcome") && out.contains("--beta=0.5 --chunk-tokens=40") && out.contains("--reward=infomem"), "{out}");
    assert!(out.contains("--lora-targets=q,v") && out.contains("--no-memory-curve") && out.contains("--seed=7"), "{out}");
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
    assert_eq!(j["pairwise"][0]["per_seed"][0]["paired"], true);
    assert_eq!(j["evals_with_different_questions"], serde_json::json!([]));
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

    // capture and retention per arm, and paired between the arms (docs/DESIGN.md §1.9)
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("study.json")).unwrap()).unwrap();
    let cap = j["capture"].as_array().unwrap();
    assert_eq!(cap.iter().map(|c| c["arm"].as_str().unwrap()).collect::<Vec<_>>(), ["base", "outcome", "infomem"], "{j}");
    for c in cap {
        assert_eq!(c["recorded"], true, "{c}");
        let l = &c["lengths"][0];
        assert_eq!(l["n"], 4, "{c}");
        let (cs, fs) = (l["captured"]["share"].as_f64().unwrap(), l["in_final"]["share"].as_f64().unwrap());
        assert!((0.0..=1.0).contains(&cs) && fs <= cs, "{c}");
    }
    let cp = j["capture_pairwise"].as_array().unwrap();
    assert_eq!(cp.iter().map(|c| c["metric"].as_str().unwrap()).collect::<Vec<_>>(), ["captured", "in_final"], "{j}");
    assert_eq!(cp[0]["pooled"]["seeds"], 1, "{j}");
    let md = std::fs::read_to_string(out.join("study.md")).unwrap();
    assert!(md.contains("| arm | length | n | captured | in final | kept \\| captured |") && md.contains("| outcome vs infomem | captured |"), "{md}");
    // an evaluation from before capture was recorded: "not recorded", not an error
    let preds = out.join("cells/infomem-s7/eval-held/predictions.jsonl");
    let old: String = std::fs::read_to_string(&preds)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            for k in ["captured", "in_final"] {
                v.as_object_mut().unwrap().remove(k);
            }
            format!("{v}\n")
        })
        .collect();
    std::fs::write(&preds, old).unwrap();
    let o = study(&cfg, &["--report-only"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let md = std::fs::read_to_string(out.join("study.md")).unwrap();
    assert!(md.contains("| infomem | – | – | not recorded |") && md.contains("| outcome vs infomem | captured, in final | not recorded |"), "{md}");
}

/// Issue 55: a study split over machines that keep only the small files. `--only` (with `base`)
/// and `--seeds` choose a sitting's cells; a cell whose results were kept without their adapter
/// is reported and finished, and a sitting that would add to it is refused before anything runs
/// (a new training would mix two adapters' results in one cell).
#[test]
fn results_kept_without_their_adapter_are_reported_and_never_added_to() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    let out = tmp.path().join("out");
    std::fs::write(&cfg, std::fs::read_to_string(&cfg).unwrap().replace("seeds = [7]", "seeds = [7, 9]")).unwrap();
    // the selection: an arm at a seed, without the base; base by name; an unknown seed refused
    let o = study(&cfg, &["--dry-run", "--only", "infomem", "--seeds", "9"]);
    let plan_out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success() && plan_out.contains("infomem-s9: train"), "{plan_out}{}", stderr(&o));
    assert!(!plan_out.contains("base:") && !plan_out.contains("-s7") && !plan_out.contains("outcome"), "{plan_out}");
    let o = study(&cfg, &["--dry-run", "--only", "base"]);
    let plan_out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success() && plan_out.contains("base: eval-held") && !plan_out.contains("-s"), "{plan_out}");
    let o = study(&cfg, &["--dry-run", "--seeds", "3"]);
    assert!(!o.status.success() && stderr(&o).contains("--seeds: 3 is not one of the study's seeds (7, 9)"), "{}", stderr(&o));

    let o = study(&cfg, &["--seeds", "7"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!out.join("cells/outcome-s9").exists() && out.join("cells/infomem-s7/eval-held/results.json").exists());
    // infomem-s7 keeps its results, not its weights (adapter and checkpoints gone)
    std::fs::remove_dir_all(out.join("cells/infomem-s7/train")).unwrap();
    std::fs::remove_file(out.join("study.md")).unwrap();
    let o = study(&cfg, &["--report-only"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("study.json")).unwrap()).unwrap();
    let cell = j["cells"].as_array().unwrap().iter().find(|c| c["arm"] == "infomem" && c["seed"] == 7).unwrap().clone();
    assert!(cell["evals"]["held"]["n"] == 4 && cell["trained"] == false && cell["finished"] == true, "{cell}");
    assert_eq!(j["pairwise"][0]["per_seed"][0]["n"], 4, "{j}");
    // finished: skipped, not trained again
    let o = study(&cfg, &["--seeds", "7"]);
    let err = stderr(&o);
    assert!(o.status.success() && err.matches("finished, skipped").count() == 3 && !err.contains(": train"), "{err}");
    assert!(!out.join("cells/infomem-s7/train").exists());
    // a new evaluation set: refused for that cell, naming what it holds, what is left and the ways out
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str(&format!("\n[[evals]]\nname = \"again\"\ndata = {:?}\n", tmp.path().join("data.jsonl").display().to_string()));
    std::fs::write(&cfg, text).unwrap();
    for mode in [&["--seeds", "7"][..], &["--dry-run"]] {
        let o = study(&cfg, mode);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{mode:?}: {err}");
        assert!(err.contains("infomem-s7 holds evaluations (held) but neither the adapter that made them") && err.contains("the sets left (again)"), "{err}");
        assert!(err.contains("--only, --seeds, or --evals") && err.contains(&format!("rm -r {}", out.join("cells/infomem-s7").display())), "{err}");
    }
    assert!(!out.join("base/eval-again").exists() && !out.join("cells/outcome-s7/eval-again").exists(), "the refused sitting ran something");
    // the sitting leaves it out: the others are evaluated, it is not touched
    let o = study(&cfg, &["--seeds", "7", "--only", "base,outcome"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("cells/outcome-s7/eval-again/results.json").exists() && !out.join("cells/infomem-s7/eval-again").exists());
    let o = study(&cfg, &["--seeds", "7", "--evals", "held"]);
    assert!(o.status.success() && !stderr(&o).contains(": train"), "{}", stderr(&o));

    // carried to another machine by tools/study_results.py: no weights, the same report
    let py = |args: &[&Path]| Command::new("python3").arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/study_results.py")).args(args).output().unwrap();
    let (kept, out2) = (tmp.path().join("kept"), tmp.path().join("out2"));
    for _ in 0..2 {
        // twice: the second finds every file identical and writes nothing new
        let o = py(&[Path::new("save"), &out, &kept]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert!(kept.join("cells/outcome-s7/eval-again/predictions.jsonl.xz").exists() && kept.join("cells/outcome-s7/train/metrics.jsonl").exists());
    assert!(!kept.join("cells/outcome-s7/train/adapter").exists() && !kept.join("cells/outcome-s7/train/checkpoints").exists());
    let o = py(&[Path::new("restore"), &kept, &out2]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(out2.join("cells/outcome-s7/eval-again/predictions.jsonl")).unwrap(), std::fs::read(out.join("cells/outcome-s7/eval-again/predictions.jsonl")).unwrap());
    let cfg2 = tmp.path().join("carried.toml");
    std::fs::write(&cfg2, std::fs::read_to_string(&cfg).unwrap().replace(&format!("{:?}", out.display().to_string()), &format!("{:?}", out2.display().to_string()))).unwrap();
    let o = study(&cfg2, &["--report-only"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let pairwise = |d: &Path| serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(d.join("study.json")).unwrap()).unwrap()["pairwise"].clone();
    assert_eq!(pairwise(&out2), pairwise(&out));
    assert!(kept.join("cells/outcome-s7/train/adapter.sha256").exists() && !kept.join("cells/infomem-s7/train/adapter.sha256").exists());

    // a set added later: the kept adapter is trained again apart and joins the cell only with the
    // kept bytes (the same binary, machine and threads make the same adapter); then it is evaluated
    let mut text = std::fs::read_to_string(&cfg2).unwrap();
    text.push_str(&format!("\n[[evals]]\nname = \"third\"\ndata = {:?}\n", tmp.path().join("data.jsonl").display().to_string()));
    std::fs::write(&cfg2, text).unwrap();
    let out3 = tmp.path().join("out3");
    copy_dir(&out2, &out3);
    let o = study(&cfg2, &["--dry-run", "--only", "outcome"]);
    let plan_out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success() && plan_out.contains("outcome-s7: train again to reproduce the kept adapter") && plan_out.contains("cells/outcome-s7/reproduce"), "{plan_out}{}", stderr(&o));
    // another thread count gives other bytes: refused before the training, naming the kept one
    let cfg2t = tmp.path().join("carried-threads.toml");
    std::fs::write(&cfg2t, std::fs::read_to_string(&cfg2).unwrap().replace("threads = 1", "threads = 2")).unwrap();
    let o = study(&cfg2t, &["--only", "outcome"]);
    let err = stderr(&o);
    assert!(o.status.code() == Some(1) && err.contains("outcome-s7: its kept adapter was trained with --threads=1") && err.contains("Set `threads = 1`"), "{err}");
    assert!(!out2.join("cells/outcome-s7/reproduce").exists(), "the refused sitting trained");
    let o = study(&cfg2, &["--only", "outcome"]);
    let err = stderr(&o);
    assert!(o.status.success() && err.contains("the adapter is the kept one, byte for byte"), "{err}");
    assert!(out2.join("cells/outcome-s7/eval-third/results.json").exists() && out2.join("cells/outcome-s7/train/adapter/adapter_model.safetensors").exists());
    assert!(!out2.join("cells/outcome-s7/reproduce").exists());
    // a kept hash without results yet (trained elsewhere, not evaluated): trained again to that hash, never afresh
    let out4 = tmp.path().join("out4");
    std::fs::create_dir_all(out4.join("cells/outcome-s7/train")).unwrap();
    for f in ["train/adapter.sha256", "train/config.toml", "train/metrics.jsonl", "settings.json"] {
        std::fs::copy(kept.join("cells/outcome-s7").join(f), out4.join("cells/outcome-s7").join(f)).unwrap();
    }
    let cfg4 = tmp.path().join("carried4.toml");
    std::fs::write(&cfg4, std::fs::read_to_string(&cfg2).unwrap().replace(&format!("{:?}", out2.display().to_string()), &format!("{:?}", out4.display().to_string()))).unwrap();
    let o = study(&cfg4, &["--dry-run", "--only", "outcome"]);
    let plan_out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success() && plan_out.contains("outcome-s7: train again to reproduce the kept adapter") && !plan_out.contains("train (restart)"), "{plan_out}{}", stderr(&o));
    // another hash (as another machine's training would give): refused, the cell untouched
    let cfg3 = tmp.path().join("carried3.toml");
    std::fs::write(&cfg3, std::fs::read_to_string(&cfg2).unwrap().replace(&format!("{:?}", out2.display().to_string()), &format!("{:?}", out3.display().to_string()))).unwrap();
    std::fs::write(out3.join("cells/outcome-s7/train/adapter.sha256"), format!("sha256:{}\n", "0".repeat(64))).unwrap();
    let o = study(&cfg3, &["--only", "outcome"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("training again did not reproduce the adapter its results were made with") && err.contains("cells/outcome-s7/reproduce"), "{err}");
    assert!(!out3.join("cells/outcome-s7/eval-third").exists() && !out3.join("cells/outcome-s7/train/adapter").exists());
    // the next sitting knows before it trains anything, and names the ways out
    let o = study(&cfg3, &["--only", "outcome"]);
    let err = stderr(&o);
    assert!(o.status.code() == Some(1) && err.contains("did not reproduce") && err.contains("--only, --seeds, or --evals") && !err.contains("to reproduce the kept adapter"), "{err}");

    // one cell, two adapters (out3's kept hash is another's): refused both ways, nothing written
    let before = std::fs::read_to_string(kept.join("cells/outcome-s7/train/adapter.sha256")).unwrap();
    for args in [[Path::new("save"), &out3, &kept], [Path::new("restore"), &kept, &out3]] {
        let o = py(&args);
        assert!(!o.status.success() && stderr(&o).contains("hold it with different adapters") && stderr(&o).contains("Nothing was written"), "{}", stderr(&o));
    }
    assert_eq!(std::fs::read_to_string(kept.join("cells/outcome-s7/train/adapter.sha256")).unwrap(), before);
    std::fs::write(out3.join("cells/outcome-s7/train/adapter.sha256"), &before).unwrap();
    // a finished result is never replaced, and a refusal writes nothing
    std::fs::write(out3.join("cells/outcome-s7/eval-held/results.md"), "edited").unwrap();
    std::fs::remove_file(out3.join("cells/outcome-s7/eval-held/results.json")).unwrap();
    let o = py(&[Path::new("restore"), &kept, &out3]);
    assert!(!o.status.success() && stderr(&o).contains("exists and differs"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(out3.join("cells/outcome-s7/eval-held/results.md")).unwrap(), "edited");
    assert!(!out3.join("cells/outcome-s7/eval-held/results.json").exists(), "a refused restore wrote something");
    // nothing is restored into a cell whose training there is under way
    std::fs::remove_file(out3.join("cells/outcome-s7/eval-held/results.md")).unwrap();
    std::fs::create_dir_all(out3.join("cells/infomem-s7/train/checkpoints")).unwrap();
    let o = py(&[Path::new("restore"), &kept, &out3]);
    assert!(!o.status.success() && stderr(&o).contains("has a training of its own under way"), "{}", stderr(&o));
    assert!(!out3.join("cells/outcome-s7/eval-held/results.md").exists(), "a refused restore wrote something");
    // and where it is not: every kept file is laid back
    std::fs::remove_dir_all(out3.join("cells/infomem-s7/train")).unwrap();
    let o = py(&[Path::new("restore"), &kept, &out3]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out3.join("cells/outcome-s7/eval-held/results.json").exists());
}

#[test]
fn a_failing_cell_names_its_command_and_log() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    // training data that cannot be read (every value is valid: the failure comes at run time)
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{not json\n").unwrap();
    let text = std::fs::read_to_string(&cfg).unwrap().replace("reward = \"outcome\"", &format!("reward = \"outcome\"\ndata = {:?}", bad.display().to_string()));
    std::fs::write(&cfg, text).unwrap();
    let o = study(&cfg, &["--only", "outcome"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("outcome-s7: command failed") && err.contains("--data=") && err.contains("bad.jsonl") && err.contains("outcome-s7/log.txt"), "{err}");
    assert!(err.contains("line 1"), "the log's last lines are shown: {err}");
    // the data mended (another file): the failed training kept nothing (train leaves no
    // directory after an early failure), so its settings may change; it starts afresh
    assert!(!tmp.path().join("out/cells/outcome-s7/train").exists());
    let good = tmp.path().join("good.jsonl");
    write_code_qa(&good, 4, "");
    std::fs::write(&cfg, std::fs::read_to_string(&cfg).unwrap().replace(&bad.display().to_string(), &good.display().to_string())).unwrap();
    let o = study(&cfg, &["--only", "outcome"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("outcome-s7: train ..."), "{}", stderr(&o));
}

/// Item 10 of issue 51: every value is checked before the first cell runs (`--dry-run` too), by
/// the subcommands' own parsers, and the error names the key.
#[test]
fn values_are_checked_before_anything_runs() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let good = std::fs::read_to_string(plan(tmp.path(), &model, "")).unwrap();
    let mut cases: Vec<(&str, String, Vec<&str>)> = vec![
        ("invalid enum value", good.replace("reward = \"infomem\"", "reward = \"infomem_all\""), vec!["arms[1] (infomem).reward = \"infomem_all\"", "invalid value 'infomem_all' for '--reward", "[possible values: "]),
        ("negative count", good.replace("steps = 2", "steps = -4"), vec!["train.steps = -4", "invalid value '-4' for '--steps"]),
        ("NaN", good.replace("lr = 0.005", "lr = nan"), vec!["train.lr = nan", "--lr", "must be in (0, 1]"]),
        ("threads", good.replace("threads = 1", "threads = 5000"), vec!["threads = 5000", "at most 1024 CPU threads"]),
        ("empty list", good.replace("no_memory_curve = true", "no_memory_curve = true\nlengths = []"), vec!["eval.lengths", "empty list"]),
        ("zero length", good.replace("no_memory_curve = true", "no_memory_curve = true\nlengths = [0, 100]"), vec!["eval.lengths = [0, 100]", "--lengths: 0"]),
        ("out-of-range train value", good.replace("group_size = 3", "group_size = 1"), vec!["train.group_size = 1", "--group-size"]),
        ("zero eval budget", good.replace("[eval]\nchunk_tokens = 40", "[eval]\nchunk_tokens = 0"), vec!["eval.chunk_tokens = 0", "--chunk-tokens must be at least 1"]),
        ("bad matcher in a set", good.replace("name = \"held\"", "name = \"held\"\nmatch = \"exact\""), vec!["evals[0] (held).match = \"exact\"", "invalid value 'exact'"]),
    ];
    if !cfg!(feature = "cuda") {
        cases.push(("cuda without CUDA", good.replace("steps = 2", "steps = 2\nbackend = \"cuda\""), vec!["train.backend = \"cuda\"", "built without CUDA support"]));
    }
    for (what, text, want) in cases {
        let cfg = tmp.path().join("bad.toml");
        std::fs::write(&cfg, text).unwrap();
        let o = study(&cfg, &["--dry-run"]);
        assert_eq!(o.status.code(), Some(1), "{what}: {}", stderr(&o));
        for w in want {
            assert!(stderr(&o).contains(w), "{what}: want {w:?} in {}", stderr(&o));
        }
        assert!(!stderr(&o).contains("unexpected argument") && !stderr(&o).contains("panicked"), "{what}: {}", stderr(&o));
    }
    assert!(!tmp.path().join("out").exists(), "a refused study created its out directory");
    // a train config file: checked with the flags that override it (train's own order)
    let tc = tmp.path().join("train-config.toml");
    std::fs::write(&tc, "lr = -1.0\nkl_coef = -2.0\n").unwrap();
    let cfg = tmp.path().join("config.toml");
    std::fs::write(&cfg, good.replace("steps = 2", &format!("steps = 2\nconfig = {:?}", tc.display().to_string()))).unwrap();
    let o = study(&cfg, &["--dry-run"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cell outcome-s7: train settings") && err.contains("--kl-coef") && err.contains("got -2"), "lr is overridden by the flag, kl_coef is not: {err}");
    // the train config file's spelling of the matcher works as the flag's does
    let cfg = tmp.path().join("matcher.toml");
    std::fs::write(&cfg, good.replace("steps = 2", "steps = 2\nmatcher = \"sub-em\"")).unwrap();
    let o = study(&cfg, &["--dry-run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("--match=sub-em"), "{}", String::from_utf8_lossy(&o.stdout));
}

/// Item 4 of issue 51: a changed setting never shows old results as new ones. A cell run with
/// other settings is refused (naming the key, its old and new values and what to delete), in
/// every mode; deleting what it names redoes exactly that. The report pairs only what is paired.
#[test]
fn changed_settings_are_refused_and_unpaired_answers_not_tested() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    let out = tmp.path().join("out");
    let good = std::fs::read_to_string(&cfg).unwrap();
    let o = study(&cfg, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("cells/infomem-s7/settings.json")).unwrap()).unwrap();
    assert_eq!(rec["train"]["beta"], 0.5);
    assert_eq!(rec["train"]["steps"], 2);
    assert_eq!(rec["train"]["save_every"], serde_json::Value::Null, "save_every does not shape a result");
    assert!(rec["train"]["data"].as_str().unwrap().starts_with("sha256:"), "{rec}");
    assert_eq!(rec["eval-held"]["chunk_tokens"], 40);
    assert_eq!(rec["eval-held"]["train"], rec["train"]);
    let adapter = out.join("cells/infomem-s7/train/adapter/adapter_model.safetensors");
    let mtime = || std::fs::metadata(&adapter).unwrap().modified().unwrap();
    let before = mtime();

    // beta of one arm: that arm's cell, in every mode
    std::fs::write(&cfg, good.replace("beta = 0.5", "beta = 0.7")).unwrap();
    for mode in [&[][..], &["--dry-run"], &["--report-only"], &["--only", "outcome"]] {
        let o = study(&cfg, mode);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{mode:?}: {err}");
        assert!(err.contains("cells/infomem-s7 train: beta 0.5 → 0.7") && !err.contains("outcome-s7"), "{mode:?}: {err}");
        assert!(err.contains(&format!("rm -r {}", out.join("cells/infomem-s7").display())), "{mode:?}: {err}");
        assert!(!err.contains("skipped"), "{mode:?}: {err}");
    }
    assert_eq!(mtime(), before);
    // an [eval] setting: every evaluation, the base's too, only the evaluations to delete
    std::fs::write(&cfg, good.replace("[eval]\nchunk_tokens = 40", "[eval]\nchunk_tokens = 32")).unwrap();
    let o = study(&cfg, &["--only", "infomem"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    for c in ["base eval-held: chunk_tokens 40 → 32", "cells/outcome-s7 eval-held: chunk_tokens 40 → 32", "cells/infomem-s7 eval-held: chunk_tokens 40 → 32"] {
        assert!(err.contains(c), "{c}: {err}");
    }
    assert!(!err.contains("train:"), "{err}");
    // the training data's content (same path)
    let data = tmp.path().join("data.jsonl");
    let saved = std::fs::read(&data).unwrap();
    std::fs::write(&cfg, &good).unwrap();
    write_code_qa(&data, 5, "");
    let o = study(&cfg, &["--dry-run"]);
    assert!(o.status.code() == Some(1) && stderr(&o).contains("cells/outcome-s7 train: data sha256:"), "{}", stderr(&o));
    std::fs::write(&data, saved).unwrap();
    // restored: everything is as it was
    let o = study(&cfg, &[]);
    assert!(o.status.success() && stderr(&o).matches("finished, skipped").count() == 3, "{}", stderr(&o));
    // deleting what the refusal names redoes exactly that, under the new settings
    std::fs::write(&cfg, good.replace("[eval]\nchunk_tokens = 40", "[eval]\nchunk_tokens = 32")).unwrap();
    for d in ["base/eval-held", "cells/outcome-s7/eval-held", "cells/infomem-s7/eval-held"] {
        std::fs::remove_dir_all(out.join(d)).unwrap();
    }
    let o = study(&cfg, &[]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches(": eval-held ...").count(), 3, "{err}");
    assert!(!err.contains(": train"), "{err}");
    assert_eq!(mtime(), before);
    let rec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("base/settings.json")).unwrap()).unwrap();
    assert_eq!(rec["eval-held"]["chunk_tokens"], 32);

    // answers that are not the same questions are not paired: no test, no p-value
    let preds = out.join("cells/infomem-s7/eval-held/predictions.jsonl");
    let text = std::fs::read_to_string(&preds).unwrap().replace("\"id\":\"r", "\"id\":\"other-r");
    assert!(text.contains("other-r0"), "{text}");
    std::fs::write(&preds, text).unwrap();
    let o = study(&cfg, &["--report-only"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("study.json")).unwrap()).unwrap();
    let pw = &j["pairwise"][0];
    assert_eq!(pw["per_seed"][0]["paired"], false, "{pw}");
    assert_eq!(pw["per_seed"][0]["why"], "no paired questions: 4 and 4 questions, none in common");
    assert!(pw["pooled"].is_null() && pw["per_seed"][0]["p"].is_null(), "{pw}");
    let md = std::fs::read_to_string(out.join("study.md")).unwrap();
    assert!(md.contains("s7: not paired (no paired questions") && !md.contains("p=1.0000"), "{md}");
    assert!(md.contains("Not every run above answered the same questions"), "{md}");
    assert_eq!(j["evals_with_different_questions"], serde_json::json!(["held"]));
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed().as_secs() < secs, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A process that is gone (or a zombie: dead, not yet reaped by its new parent).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

fn checkpoint_steps(train: &Path) -> usize {
    infomem_engine::rl::trainer::latest_checkpoint(train)
        .and_then(|d| d.file_name()?.to_str()?.strip_prefix("step-")?.parse().ok())
        .unwrap_or(0)
}

/// Item 12 and the cosmetics of issue 51: `--report-only` refuses a study that never ran and
/// waits for the study's lock (`.study.lock`); Ctrl-C stops a study with 130; `kill -9` of a
/// study takes its train child with it; the next run resumes the cell.
#[cfg(target_os = "linux")]
#[test]
fn interrupted_and_killed_studies_leave_nothing_running() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    let steps = 60;
    std::fs::write(&cfg, std::fs::read_to_string(&cfg).unwrap().replace("steps = 2", &format!("steps = {steps}"))).unwrap();
    let out = tmp.path().join("out");
    let train = out.join("cells/outcome-s7/train");

    let o = study(&cfg, &["--report-only"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--report-only: nothing has run in") && stderr(&o).contains("run the study first"), "{}", stderr(&o));
    assert!(!out.exists(), "--report-only created {}", out.display());

    let spawn = || bin().args(["study", "--config", cfg.to_str().unwrap(), "--only", "base,outcome"]).stderr(std::process::Stdio::null()).spawn().unwrap();
    // Ctrl-C to the study alone: passed on to the cell, which saves; the study exits 130
    let mut s = spawn();
    wait_for("a first checkpoint", 120, || checkpoint_steps(&train) >= 1);
    assert!(out.join(".study.lock").exists() && !out.join(".train.lock").exists());
    // the study holds its directory: --report-only waits its turn
    let o = study(&cfg, &["--report-only"]);
    assert!(!o.status.success() && stderr(&o).contains("in use by another run"), "{}", stderr(&o));
    unsafe { libc::kill(s.id() as i32, libc::SIGINT) };
    assert_eq!(s.wait().unwrap().code(), Some(130));
    let at = checkpoint_steps(&train);
    assert!(at >= 1 && at < steps, "{at}");

    // kill -9 of the study: its train child dies with it
    let mut s = spawn();
    wait_for("a newer checkpoint", 120, || checkpoint_steps(&train) > at);
    let child: u32 = std::fs::read_to_string(train.join(".train.lock")).unwrap().trim().parse().unwrap();
    assert!(!gone(child));
    s.kill().unwrap();
    s.wait().unwrap();
    wait_for("the train child to die with the study", 5, || gone(child));
    let at = checkpoint_steps(&train);
    assert!(at < steps, "the run finished before the kill: make it longer");

    // the next run is not refused: it resumes the cell and finishes the study
    let o = study(&cfg, &["--only", "outcome"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("outcome-s7: train (resume)"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(train.join("metrics.jsonl")).unwrap().lines().count(), steps);
    assert!(out.join("cells/outcome-s7/eval-held/results.json").exists());
}

/// Sets that name the same `curve` form one length curve per arm: em per length and the share
/// of the shortest length's em kept at the longest, in study.md and study.json.
#[test]
fn sets_with_one_curve_name_form_a_length_curve() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    let (short, long) = (tmp.path().join("short.jsonl"), tmp.path().join("long.jsonl"));
    write_code_qa(&short, 4, "");
    write_code_qa(&long, 4, &" and then some more words about nothing".repeat(6));
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    for (name, data) in [("short", &short), ("long", &long)] {
        text.push_str(&format!("\n[[evals]]\nname = {name:?}\ndata = {:?}\ncurve = \"codes\"\n", data.display().to_string()));
    }
    std::fs::write(&cfg, text).unwrap();
    let o = study(&cfg, &["--only", "base,outcome"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = tmp.path().join("out");
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("study.json")).unwrap()).unwrap();
    let curves = j["length_curves"].as_array().unwrap();
    assert_eq!(curves.iter().map(|c| c["arm"].as_str().unwrap()).collect::<Vec<_>>(), ["base", "outcome"], "{j}");
    for c in curves {
        assert_eq!(c["curve"], "codes");
        let pts = c["points"].as_array().unwrap();
        assert_eq!(pts.len(), 2, "{c}");
        let (l0, l1) = (pts[0]["length"].as_u64().unwrap(), pts[1]["length"].as_u64().unwrap());
        assert!(l0 < l1, "{c}");
        assert_eq!(c["kept"]["from"].as_u64(), Some(l0));
        assert_eq!(c["kept"]["to"].as_u64(), Some(l1));
        // the ratio is em(long) / em(short) whenever the short em is not 0
        let (e0, e1) = (pts[0]["em"].as_f64().unwrap(), pts[1]["em"].as_f64().unwrap());
        if e0 > 0.0 {
            assert!((c["kept"]["kept"].as_f64().unwrap() - e1 / e0).abs() < 1e-9, "{c}");
        }
    }
    let md = std::fs::read_to_string(out.join("study.md")).unwrap();
    assert!(md.contains("## Length curve `codes`") && md.contains(" kept |"), "{md}");
    // the plain set `held` keeps its own section and is not part of the curve
    assert!(md.contains("## held"), "{md}");
}

/// `--evals` runs only the named evaluation sets in this sitting; a later sitting without it runs
/// the rest, and a misspelt name is refused.
#[test]
fn evals_selects_the_sets_of_a_sitting() {
    let (_t, model) = tiny_for_agent("llama");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = plan(tmp.path(), &model, "");
    let other = tmp.path().join("other.jsonl");
    write_code_qa(&other, 3, " else");
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str(&format!("\n[[evals]]\nname = \"later\"\ndata = {:?}\n", other.display().to_string()));
    std::fs::write(&cfg, text).unwrap();
    let o = study(&cfg, &["--evals", "helt"]);
    assert!(!o.status.success() && stderr(&o).contains("--evals: no evaluation set named \"helt\" (sets: held, later)"), "{}", stderr(&o));
    let out = tmp.path().join("out");
    let o = study(&cfg, &["--evals", "held"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for cell in ["base", "cells/outcome-s7", "cells/infomem-s7"] {
        assert!(out.join(cell).join("eval-held/results.json").exists(), "{cell}: {}", stderr(&o));
        assert!(!out.join(cell).join("eval-later").exists(), "{cell} ran an unselected set");
    }
    // the same selection again: nothing left to run
    let o = study(&cfg, &["--evals", "held"]);
    assert!(o.status.success() && stderr(&o).matches("nothing selected is left").count() == 3, "{}", stderr(&o));
    // without --evals: only the sets left run, nothing is retrained
    let o = study(&cfg, &[]);
    let err = stderr(&o);
    assert!(o.status.success() && err.matches(": eval-later").count() == 3 && !err.contains(": train") && !err.contains(": eval-held"), "{err}");
}
