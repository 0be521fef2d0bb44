use super::config::*;
use super::plan::*;
use std::time::{Duration, Instant};
use super::identity::*;
use super::report::*;
use super::run::*;
use serde_json::json;

#[test]
fn flag_tables_become_arguments() {
    let t: toml::Table = toml::from_str("beta = 0.5\nsteps = -4\nno_memory_curve = true\nskip_bad = false\nlora_targets = [\"q\", \"v\"]\nlengths = [100, 200]\nreward = \"outcome\"").unwrap();
    let args = flags_to_args(&t);
    // one argument per value, `--key=value`: a negative number reaches its flag as a value
    assert_eq!(args, ["--beta=0.5", "--lengths=100,200", "--lora-targets=q,v", "--no-memory-curve", "--reward=outcome", "--steps=-4"]);
    assert!(flag_value(&toml::Value::Table(Default::default())).is_err());
    let e = flag_value(&toml::Value::Array(vec![])).unwrap_err().to_string();
    assert!(e.contains("empty list"), "{e}");
}

#[test]
fn matcher_is_match() {
    let mut t: toml::Table = toml::from_str("matcher = \"f1\"").unwrap();
    normalize_table(&mut t, "train").unwrap();
    assert_eq!(flags_to_args(&t), ["--match=f1"]);
    let mut both: toml::Table = toml::from_str("matcher = \"f1\"\nmatch = \"em\"").unwrap();
    let e = normalize_table(&mut both, "arms[0] (a)").unwrap_err().to_string();
    assert!(e.contains("arms[0] (a): `match` and `matcher` are one setting"), "{e}");
}

fn pred(id: &str, length: f64, em: f64) -> Pred {
    Pred { key: format!("{id}@{length}"), length, em }
}

#[test]
fn only_the_same_questions_are_paired() {
    let a = vec![pred("q1", 300.0, 1.0), pred("q2", 300.0, 0.0)];
    let b = vec![pred("q2", 300.0, 1.0), pred("q1", 300.0, 1.0)];
    assert_eq!(paired(&a, &b).unwrap(), vec![(1.0, 1.0), (0.0, 1.0)]);
    // the same ids at other lengths: nothing in common, no test
    let b7 = vec![pred("q1", 700.0, 1.0), pred("q2", 700.0, 1.0)];
    assert_eq!(paired(&a, &b7).unwrap_err(), "no paired questions: 2 and 2 questions, none in common");
    assert!(paired(&a, &[]).unwrap_err().starts_with("no paired questions"));
    // partly overlapping sets: not the same questions, no test either
    let b3 = vec![pred("q1", 300.0, 1.0), pred("q3", 300.0, 1.0)];
    assert_eq!(paired(&a, &b3).unwrap_err(), "different questions: 2 and 2, 1 in common");
    let dup = vec![pred("q1", 300.0, 1.0), pred("q1", 300.0, 0.0), pred("q2", 300.0, 1.0)];
    assert!(paired(&dup, &a).unwrap_err().contains("more than once"));
}

#[test]
fn changed_settings_are_named() {
    let old = json!({"beta": 0.5, "steps": 2, "lengths": [300, 700], "train": {"reward": "infomem", "lr": 0.005}});
    let new = json!({"beta": 0.7, "steps": 2.0, "lengths": [400, 800], "train": {"reward": "infomem", "lr": 0.005}, "kl_coef": 0.0});
    let mut d = Vec::new();
    diff("", &old, &new, &mut d);
    assert_eq!(d, ["beta 0.5 → 0.7", "kl_coef (none) → 0.0", "lengths [300,700] → [400,800]"]);
    let mut d = Vec::new();
    diff("", &old, &json!({"beta": 0.5, "steps": 2, "lengths": [300, 700], "train": {"reward": "outcome", "lr": 0.005}}), &mut d);
    assert_eq!(d, ["train.reward infomem → outcome"]);
}

#[test]
fn eta_counts_only_cells_left_to_train() {
    let tmp = tempfile::tempdir().unwrap();
    let cell = |arm: &str, seed: Option<u64>| Cell { arm: arm.into(), seed, dir: tmp.path().join(arm) };
    let cells = [cell("base", None), cell("a", Some(0)), cell("b", Some(0))];
    // a is trained (its adapter exists) and only has evaluations left: not a cell to train
    std::fs::create_dir_all(cells[1].adapter()).unwrap();
    std::fs::write(cells[1].adapter().join("adapter_model.safetensors"), b"x").unwrap();
    assert_eq!(to_train(&cells), 1);
    assert_eq!(to_train(&cells[2..]), 1);
    let start = Instant::now();
    assert!(progress(start, &[Duration::from_secs(60)], 2).ends_with("ETA 2m00s"), "{}", progress(start, &[Duration::from_secs(60)], 2));
    assert!(!progress(start, &[Duration::from_secs(60)], 0).contains("ETA"));
    assert!(progress(start, &[], 1).contains("ETA after the first trained cell"));
}

#[test]
fn arm_overrides_win() {
    let base: toml::Table = toml::from_str("reward = \"infomem\"\nsteps = 3").unwrap();
    let over: toml::Table = toml::from_str("reward = \"outcome\"").unwrap();
    let m = merge(&base, &over);
    assert_eq!(m["reward"].as_str(), Some("outcome"));
    assert_eq!(m["steps"].as_integer(), Some(3));
}
