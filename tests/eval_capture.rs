//! `eval`'s capture and retention through the binary on the tiny model (docs/DESIGN.md §1.9):
//! every question's record in predictions.jsonl agrees with its own memories (rechecked here by
//! a second, independent reading of the definition), the per-length shares in results.json are
//! the counts of those records, the planted chunk agrees with the token offset `data synth`
//! recorded, and results.md and memory_curve.png carry them.
mod common;
use common::cli::{bin, run_for, s, write_data, Agent};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The definition read again, independently of `reward::outcome::normalize`: lowercase, ASCII
/// punctuation removed, words split on whitespace without a/an/the, and the gold's words found
/// as a contiguous run of the memory's words.
fn holds(memory: &str, golds: &[Value]) -> bool {
    let words = |t: &str| -> Vec<String> {
        let t: String = t.to_lowercase().chars().filter(|c| !c.is_ascii_punctuation()).collect();
        t.split_whitespace().filter(|w| !["a", "an", "the"].contains(w)).map(String::from).collect()
    };
    let m = words(memory);
    golds.iter().any(|g| {
        let g = words(g.as_str().unwrap());
        !g.is_empty() && m.windows(g.len()).any(|w| w == &g[..])
    })
}

fn lines(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Check every record against its memories and every results.json row against the records;
/// returns the records.
fn check_eval(out: &Path) -> Vec<Value> {
    let preds = lines(&out.join("predictions.jsonl"));
    assert!(!preds.is_empty());
    for p in &preds {
        let mems: Vec<&str> = p["memories"].as_array().unwrap().iter().map(|m| m.as_str().unwrap()).collect();
        let held: Vec<bool> = mems.iter().map(|m| holds(m, p["answers"].as_array().unwrap())).collect();
        assert_eq!(p["held"], serde_json::json!(held), "{p}");
        assert_eq!(p["chunks"], mems.len(), "{p}");
        let first = held.iter().position(|&h| h);
        assert_eq!(p["captured"], first.is_some(), "{p}");
        assert_eq!(p["in_final"], held.last() == Some(&true), "{p}");
        assert_eq!(p["first_captured_chunk"], serde_json::json!(first), "{p}");
        let lost = first.and_then(|f| (f..held.len()).find(|&i| !held[i]));
        assert_eq!(p["lost_at_chunk"], serde_json::json!(lost), "{p}");
        assert_eq!(p["regained"], lost.is_some_and(|l| held[l..].contains(&true)), "{p}");
        // in_final ⇒ captured
        assert!(p["in_final"] == false || p["captured"] == true, "{p}");
    }
    let res: Value = serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = res["rows"].as_array().unwrap();
    for r in rows {
        let of: Vec<&Value> = preds.iter().filter(|p| r["length"] == 0 || (p["length"] == r["length"] && p["task"] == r["task"])).collect();
        let c = &r["capture"];
        let count = |f: &dyn Fn(&Value) -> bool| of.iter().filter(|p| f(p)).count();
        let captured = count(&|p| p["captured"] == true);
        let in_final = count(&|p| p["in_final"] == true);
        let lost = count(&|p| !p["lost_at_chunk"].is_null());
        for (name, k, n) in [("captured", captured, of.len()), ("in_final", in_final, of.len()), ("kept", in_final, captured), ("lost", lost, captured)] {
            assert_eq!((c[name]["k"].as_u64(), c[name]["n"].as_u64()), (Some(k as u64), Some(n as u64)), "{name} of {r}");
            match c[name]["share"].as_f64() {
                Some(sh) => {
                    assert!((sh - k as f64 / n as f64).abs() < 1e-12 && (0.0..=1.0).contains(&sh), "{name} of {r}");
                    let ci = &c[name]["ci95"];
                    let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
                    assert!(0.0 <= lo && lo <= sh && sh <= hi && hi <= 1.0, "{name} of {r}");
                }
                None => assert_eq!(n, 0, "{name} of {r}"),
            }
        }
        // the share of answers cut by the budget is the records' own
        let cut = count(&|p| p["answer_cut"] == true);
        assert!(of.iter().all(|p| p["answer_cut"].is_boolean()), "{r}");
        assert!((r["answer_cut"].as_f64().unwrap() - cut as f64 / of.len() as f64).abs() < 1e-12, "{r}");
        // em given in final / not in final split the row's right answers
        let right = count(&|p| p["em"].as_f64().unwrap() >= 0.5);
        assert_eq!(c["em_in_final"]["k"].as_u64().unwrap() + c["em_not_in_final"]["k"].as_u64().unwrap(), right as u64, "{r}");
        let hist: u64 = c["lost_at_relative"].as_array().unwrap().iter().map(|b| b["n"].as_u64().unwrap()).sum();
        assert_eq!(hist, lost as u64, "{r}");
        let curve = c["held_by_position"].as_array().unwrap();
        assert_eq!(curve.last().unwrap().as_f64(), c["in_final"]["share"].as_f64(), "{r}");
        assert!(curve.iter().all(|v| (0.0..=1.0).contains(&v.as_f64().unwrap())), "{r}");
    }
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("## Capture and retention of the gold answer") && md.contains("| kept \\| captured |"), "{md}");
    let png = std::fs::read(out.join("memory_curve.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    preds
}

#[test]
fn eval_records_capture_and_retention_per_question_and_length() {
    let a = Agent::new();
    let t = a.tmp.path();
    // synthetic needles counted in the model's tokens: the planted fact's token offset is known
    let synth = t.join("needle.jsonl");
    let mut c = bin();
    c.args(["data", "synth", "--task", "needle", "--tokens", "300", "--count", "4", "--seed", "3", "--model", s(&a.model), "--out", s(&synth)]);
    let o = run_for(c, 120);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let out = t.join("ev");
    a.ok("eval", &synth, &out, &["--no-memory-curve"]);
    let preds = check_eval(&out);
    let recs: BTreeMap<String, Value> = lines(&synth).into_iter().map(|r| (r["id"].as_str().unwrap().to_string(), r)).collect();
    for p in &preds {
        let meta = &recs[p["id"].as_str().unwrap()]["meta"];
        let needle = meta["facts"].as_array().unwrap().iter().find(|f| f["role"] == "needle").unwrap();
        // the byte-level tokenizer: one token a byte, so the recorded offset is exact
        let want = needle["token_offset"].as_u64().unwrap() / 40;
        assert_eq!(p["planted_chunk"].as_u64(), Some(want), "{p}");
        assert!(want < p["chunks"].as_u64().unwrap());
    }
    let res: Value = serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let planted = &res["rows"][0]["capture"]["planted"];
    assert_eq!(planted["n"], 4, "{planted}");
    let parts = ["later", "before", "never"].iter().map(|k| planted[k].as_u64().unwrap()).sum::<u64>() + planted["at_planted"]["k"].as_u64().unwrap();
    assert_eq!(parts, 4, "{planted}");

    // padded (--lengths): each document among others, shuffled; the fact is found where it
    // landed, by its text, not by the offsets recorded before padding
    let out_pad = t.join("ev-pad");
    a.ok("eval", &synth, &out_pad, &["--no-memory-curve", "--lengths", "900"]);
    let padded = check_eval(&out_pad);
    assert_eq!(padded.len(), 4);
    for p in &padded {
        // about 900 tokens of 40: padded, not the 300-token original (8 chunks)
        assert_eq!(p["length"], 900, "{p}");
        assert!(p["chunks"].as_u64().unwrap() >= 20, "{p}");
        assert!(p["planted_chunk"].as_u64().unwrap() < p["chunks"].as_u64().unwrap(), "{p}");
    }

    // data that records no planted fact: located nowhere, said so
    let plain = t.join("plain.jsonl");
    write_data(&plain, "What is the code?");
    let out2 = t.join("ev2");
    a.ok("eval", &plain, &out2, &["--no-memory-curve"]);
    let preds = check_eval(&out2);
    assert!(preds.iter().all(|p| p["planted_chunk"].is_null()));
    let md = std::fs::read_to_string(out2.join("results.md")).unwrap();
    assert!(md.contains("| not recorded |"), "{md}");

    // a one-token answer budget: every answer is cut (the tiny model ends none in one token),
    // said per record, in results.json and in results.md's accuracy table
    let out3 = t.join("ev3");
    a.ok("eval", &plain, &out3, &["--no-memory-curve", "--answer-tokens", "1"]);
    let preds = check_eval(&out3);
    assert!(preds.iter().all(|p| p["answer_cut"] == true), "{preds:?}");
    let md = std::fs::read_to_string(out3.join("results.md")).unwrap();
    assert!(md.contains("| answers cut by the budget |") && md.contains("| 100% |"), "{md}");
}
