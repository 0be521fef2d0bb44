use super::config::*;
use super::plan::*;
use std::time::{Duration, Instant};
use super::identity::*;
use super::answers::*;
use super::retention::{self, Run};
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
    Pred { key: format!("{id}@{length}"), length, em, captured: None, in_final: None, answer_cut: None }
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

fn cpred(id: &str, length: f64, captured: bool, in_final: bool) -> Pred {
    Pred { key: format!("{id}@{length}"), length, em: in_final as u8 as f64, captured: Some(captured), in_final: Some(in_final), answer_cut: Some(false) }
}

#[test]
fn capture_per_arm_and_length_and_paired() {
    // arm a: at 100 tokens 2 of 2 captured, 1 kept; at 200, 1 of 2 captured, kept
    let mut a = vec![cpred("q1", 100.0, true, true), cpred("q2", 100.0, true, false), cpred("q3", 200.0, true, true), cpred("q4", 200.0, false, false)];
    // q3's answer is wrong though its final memory held it: its reply was cut by the budget
    (a[2].em, a[2].answer_cut) = (0.0, Some(true));
    // arm b: nothing captured anywhere
    let b: Vec<Pred> = ["q1", "q2", "q3", "q4"].iter().zip([100.0, 100.0, 200.0, 200.0]).map(|(q, l)| cpred(q, l, false, false)).collect();
    // base: an evaluation written before capture was recorded
    let old = vec![pred("q1", 100.0, 1.0)];
    let runs = [Run { name: "base", seeds: vec![&old[..]] }, Run { name: "a", seeds: vec![&a[..]] }, Run { name: "b", seeds: vec![&b[..]] }];
    let (md, rows) = retention::table("held", &runs);
    assert!(md.contains("| base | – | – | not recorded | not recorded | not recorded | not recorded | – |"), "{md}");
    assert_eq!(rows[0]["recorded"], false);
    // one seed: the bootstrap over 2 questions of shares 1 and 0 spans [0, 1]; of shares 1, 1: [1, 1]
    assert!(md.contains("| a | 100 | 2 | 1.000 [1.000, 1.000] | 0.500 [0.000, 1.000] | 0.500 [0.000, 1.000] (of 2) | 1.000 [1.000, 1.000] (of 1) | 0.000 [0.000, 0.000] |"), "{md}");
    assert!(md.contains("| a | 200 | 2 | 0.500 [0.000, 1.000] | 0.500 [0.000, 1.000] | 1.000 [1.000, 1.000] (of 1) | 0.000 [0.000, 0.000] (of 1) | 0.500 [0.000, 1.000] |"), "{md}");
    assert!(md.contains("| b | 200 | 2 | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] | – (of 0) | – (of 0) | 0.000 [0.000, 0.000] |"), "{md}");
    assert_eq!(rows[1]["lengths"][1]["answer_cut"]["share"], 0.5);
    assert_eq!(rows[1]["lengths"][1]["em_given_in_final"]["n"], 1);
    assert_eq!(rows[1]["lengths"][0]["captured"]["share"], 1.0);
    assert_eq!(rows[1]["lengths"][1]["kept_given_captured"]["n"], 1);
    // paired on the same questions: a captured 3 that b did not (b = 3, c = 0): p = 2/8
    let (pa, pb) = (std::collections::BTreeMap::from([(7u64, a)]), std::collections::BTreeMap::from([(7u64, b)]));
    let (md, js) = retention::paired_rows("held", "a", "b", &pa, &pb);
    assert!(md.contains("| a vs b | captured | 3/0 | 0.2500 | +0.750 |"), "{md}");
    assert!(md.contains("| a vs b | in_final | 2/0 | 0.5000 | +0.500 |"), "{md}");
    assert_eq!(js[0]["pooled"]["b"], 3);
    // an arm without the record: not recorded, no test
    let pold = std::collections::BTreeMap::from([(7u64, old)]);
    let (md, js) = retention::paired_rows("held", "a", "old", &pa, &pold);
    assert!(md.contains("not recorded") && js[0]["recorded"] == false, "{md}");
}

#[test]
fn a_setting_added_later_at_its_default_is_no_change() {
    let old = json!({"lr": 0.0002, "steps": 60});
    let mut d = Vec::new();
    diff("", &old, &json!({"lr": 0.0002, "steps": 60, "data_order": "shuffled"}), &mut d);
    assert!(d.is_empty(), "{d:?}");
    diff("", &old, &json!({"lr": 0.0002, "steps": 60, "data_order": "file"}), &mut d);
    assert_eq!(d, ["data_order (none) → file"]);
    let mut d = Vec::new();
    diff("", &json!({"data_order": "file"}), &json!({"data_order": "shuffled"}), &mut d);
    assert_eq!(d, ["data_order file → shuffled"]);
}

