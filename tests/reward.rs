//! InfoMem reward groups of the fixtures reproduced exactly, and `reward --groups` end to end.
mod common;
use common::*;
use infomem_engine::reward::{combine, RewardMode};
use std::process::Command;

#[test]
fn fixture_groups_reproduce_exactly() {
    for (i, g) in cases()["infomem_reward"].as_array().unwrap().iter().enumerate() {
        let r = combine(RewardMode::Infomem, &floats(&g["outcomes"]), &floats(&g["gains"]), g["beta"].as_f64().unwrap());
        let want = floats(&g["final_rewards"]);
        assert_eq!(r.len(), want.len());
        for (a, b) in r.iter().zip(&want) {
            assert!((a - b).abs() < 1e-12, "group {i}: {r:?} vs {want:?}");
        }
    }
}

fn run_reward(groups: &str, mode: &str) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g.jsonl");
    std::fs::write(&p, groups).unwrap();
    Command::new(env!("CARGO_BIN_EXE_infomem-engine"))
        .args(["reward", "--groups", p.to_str().unwrap(), "--mode", mode, "--beta", "0.5"])
        .output()
        .unwrap()
}

#[test]
fn cli_modes_and_errors() {
    let out = run_reward("{\"outcomes\": [1, 0, 1], \"gains\": [0.2, 5.0, 0.4]}\n\n{\"outcomes\": [0, 0], \"gains\": [1, 2]}\n", "infomem-raw");
    assert!(out.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["final_rewards"], serde_json::json!([1.1, 0.0, 1.2]));
    assert_eq!(lines[1]["final_rewards"], serde_json::json!([0.0, 0.0]));
    for (bad, needle) in [
        ("{\"outcomes\": [1], \"gains\": [0.1]}\n{\"outcomes\": [1, 0], \"gains\": [0.1]}\n", ":2: 2 outcomes but 1 gains"),
        ("{\"outcomes\": [0.5], \"gains\": [0.1]}\n", ":1: outcome 0.5 is not 0 or 1"),
        ("{\"outcomes\": [1], \"gains\": [0.1]}\nnot json\n", ":2: expected"),
        ("{\"outcomes\": [], \"gains\": []}\n", ":1: empty group"),
    ] {
        let out = run_reward(bad, "infomem");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(needle), "{err} lacks {needle}");
    }
}
