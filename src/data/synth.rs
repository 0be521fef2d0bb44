//! Synthetic long-document tasks with planted facts: `needle`, `multikey`, `multihop`, `vartrack`.
//!
//! A record is built in three steps: the task draws its facts, question and gold answer; filler
//! paragraphs are drawn until the document reaches the token target (sentences mentioning any
//! planted term are refused); the facts are inserted between filler sentences at their planned
//! depths. Every record is then checked by [`verify_record`]: each planted sentence occurs exactly
//! once, no filler mentions a key name, variable or answer, and the gold answer is re-derived from
//! the text alone. Record `i` draws only from its own stream of `Rng::derive(seed, ..)`, so a file is byte-identical
//! for a given seed whatever the thread count.
//!
//! Answers are short numbers by default (SmolLM2-135M copies numbers well and rare words badly,
//! see the task choice in docs/RESULTS.md); `AnswerKind::Word` uses common single words instead.
use super::filler::{Essays, Procedural};
use super::{count_substr, count_word, QaRecord, TokenCounter};
use crate::model::tokenizer::TextTokenizer;
use crate::util::rng::Rng;
use anyhow::{anyhow, bail, ensure, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    Needle,
    Multikey,
    Multihop,
    Vartrack,
}

impl Task {
    pub fn name(self) -> &'static str {
        match self {
            Task::Needle => "needle",
            Task::Multikey => "multikey",
            Task::Multihop => "multihop",
            Task::Vartrack => "vartrack",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AnswerKind {
    Number,
    Word,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FillerKind {
    Procedural,
    Essays,
}

/// Order of the chain's sentences in a `multihop` document.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum HopOrder {
    /// The sentence naming the question's key comes first, the value last: the memory must keep a
    /// partial answer ("X's badge = Y's locker") until the value shows up.
    Forward,
    /// Random order: the memory must also keep facts whose relevance shows only later.
    Shuffled,
}

/// What a `vartrack` question asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum VarQuestion {
    /// "What is the value of VAR X?" (the last variable of the gold chain): a number.
    Value,
    /// "Which variables are assigned the value V?": the gold chain's names in order.
    Which,
}

/// Longest synthetic document, in tokens. A record is one JSONL line and the readers cap lines
/// at `read::MAX_LINE_BYTES` (32 MiB): 4M tokens of English text (4.4–4.75 characters a token)
/// is about 19 MB, which leaves room for the JSON around it. It also keeps the sizing arithmetic
/// far from overflow (`--tokens 2^64-1` used to give 11-token documents).
pub const MAX_TOKENS: usize = 4_000_000;

/// Most characters per token `--chars-per-token` may claim. Real tokenizers give 2 to 6 on
/// English text; the estimate rounds each filler sentence to whole tokens, and at hundreds of
/// characters a token every sentence rounds to 0, so the filler never reached its target (the
/// generator drew sentences forever, gigabytes of them). At 64 a sentence of 32 characters
/// still counts one token.
pub const MAX_CHARS_PER_TOKEN: f64 = 64.0;

#[derive(Clone, Debug)]
pub struct SynthConfig {
    pub task: Task,
    /// Target context length in tokens.
    pub tokens: usize,
    pub count: usize,
    pub seed: u64,
    pub answer_kind: AnswerKind,
    /// Digits of a numeric answer (first digit never 0).
    pub digits: usize,
    /// multihop: facts in the chain (default 2); vartrack: reassignments per chain (default 4).
    pub hops: Option<usize>,
    /// multikey: other keys (default 3); multihop: other people's values (default 2); vartrack:
    /// other chains (default 1); needle: none (must be 0).
    pub distractors: Option<usize>,
    pub hop_order: HopOrder,
    pub var_question: VarQuestion,
    /// needle/multikey: name this many candidate answers in the question (0 = none): the gold,
    /// the document's decoy values first, then fresh ones, shuffled. A guessable task: an agent
    /// that kept nothing still succeeds 1/choices of the time, which the outcome reward pays.
    pub choices: usize,
    pub filler: FillerKind,
    pub essays_dir: Option<PathBuf>,
    /// Used when no tokenizer is given.
    pub chars_per_token: f64,
}

impl SynthConfig {
    pub fn new(task: Task, tokens: usize, count: usize, seed: u64) -> Self {
        SynthConfig {
            task,
            tokens,
            count,
            seed,
            answer_kind: AnswerKind::Number,
            digits: 5,
            hops: None,
            distractors: None,
            hop_order: HopOrder::Forward,
            var_question: VarQuestion::Value,
            choices: 0,
            filler: FillerKind::Procedural,
            essays_dir: None,
            chars_per_token: super::DEFAULT_CHARS_PER_TOKEN,
        }
    }

    pub fn hops(&self) -> usize {
        self.hops.unwrap_or(match self.task {
            Task::Vartrack => 4,
            _ => 2,
        })
    }

    pub fn distractors(&self) -> usize {
        self.distractors.unwrap_or(match self.task {
            Task::Needle => 0,
            Task::Multikey => 3,
            Task::Multihop => 2,
            Task::Vartrack => 1,
        })
    }

    /// Check every field (called by [`synthesize`]; callers may call it first to fail early).
    pub fn validate(&self) -> Result<()> {
        ensure!(self.count > 0, "--count must be at least 1");
        ensure!(self.tokens >= 64, "--tokens {} is too small (at least 64)", self.tokens);
        ensure!(
            self.tokens <= MAX_TOKENS,
            "--tokens {} is too large (at most {MAX_TOKENS}: a record is one JSONL line, and readers take lines of at most {} MiB)",
            self.tokens,
            super::read::MAX_LINE_BYTES >> 20
        );
        ensure!((3..=12).contains(&self.digits), "--digits must be between 3 and 12, got {}", self.digits);
        ensure!(
            self.chars_per_token.is_finite() && self.chars_per_token > 0.5 && self.chars_per_token <= MAX_CHARS_PER_TOKEN,
            "--chars-per-token must be more than 0.5 and at most {MAX_CHARS_PER_TOKEN} (tokenizers give 2 to 6 characters a token; SmolLM2 about 4.6), got {}",
            super::short_num(self.chars_per_token)
        );
        match self.task {
            Task::Needle => ensure!(self.distractors() == 0, "needle has no distractors (use --task multikey)"),
            Task::Multikey => ensure!((1..=40).contains(&self.distractors()), "multikey needs 1 to 40 distractor keys"),
            Task::Multihop => {
                ensure!((2..=8).contains(&self.hops()), "multihop needs 2 to 8 hops, got {}", self.hops());
                ensure!(self.distractors() <= 40, "multihop takes at most 40 distractors");
            }
            Task::Vartrack => {
                ensure!((1..=20).contains(&self.hops()), "vartrack needs 1 to 20 hops, got {}", self.hops());
                ensure!(self.distractors() <= 10, "vartrack takes at most 10 distractor chains");
            }
        }
        if self.choices > 0 {
            ensure!(matches!(self.task, Task::Needle | Task::Multikey), "--choices applies to needle and multikey");
            ensure!((2..=10).contains(&self.choices), "--choices must be 0 (none) or 2 to 10, got {}", self.choices);
            ensure!(
                self.answer_kind == AnswerKind::Number || 1 + self.distractors() + self.choices <= ANSWER_WORDS.len(),
                "too many distinct word answers for --choices {}",
                self.choices
            );
        }
        if self.task == Task::Multihop || self.task == Task::Multikey {
            let people = 1 + self.distractors() + if self.task == Task::Multihop { self.hops() } else { 0 };
            ensure!(people <= FIRST_NAMES.len(), "too many keys: {people} names needed, {} available", FIRST_NAMES.len());
        }
        Ok(())
    }
}

const FIRST_NAMES: &[&str] = &[
    "Odalys", "Thaddeus", "Marisol", "Ignatius", "Rosalind", "Cornelius", "Evangeline", "Leopold", "Philippa",
    "Barnaby", "Octavia", "Lysander", "Henrietta", "Ambrose", "Cordelia", "Percival", "Imogen", "Casimir",
    "Ottoline", "Florian", "Wilhelmina", "Desmond", "Anneliese", "Bartholomew", "Genevieve", "Horatio", "Seraphina",
    "Lucius", "Marguerite", "Crispin", "Theodora", "Emeric", "Isadora", "Fitzroy", "Clementine", "Ezekiel",
    "Rosamund", "Valentin", "Ophelia", "Augustin", "Priscilla", "Leander", "Beatrix", "Cyprian", "Delphine",
];
const LAST_NAMES: &[&str] = &[
    "Brennick", "Quintero", "Halvorsen", "Okonkwo", "Vasquez", "Lindqvist", "Abernathy", "Castellano",
    "Winterbourne", "Petrakis", "Gallagher", "Nakamura", "Delacroix", "Ferreira", "Kowalczyk", "Ashworth",
    "Sorensen", "Bellamy", "Hargreaves", "Oyelaran", "Rasmussen", "Thornbury", "Valentini", "Whitfield", "Zeller",
    "Marchetti", "Fairweather", "Lachance", "Pemberton", "Szabo", "Iverson", "Holloway", "Devereux", "Albrecht",
    "Moreau", "Eriksson", "Kovalenko", "Trevelyan", "Ostrowski", "Mbeki", "Castillo", "Drummond", "Vandermeer",
    "Achterberg", "Ruskin",
];
const NUMBER_ATTRS: &[&str] = &[
    "passcode", "locker number", "badge number", "room number", "ticket number", "account number",
    "license number", "gate code", "member number", "parcel number", "pin code", "serial number",
];
const WORD_ATTRS: &[&str] = &["code word", "password", "call sign", "secret word", "watchword", "pass phrase"];
const ANSWER_WORDS: &[&str] = &[
    "falcon", "copper", "violet", "tiger", "marble", "comet", "cactus", "banjo", "glacier", "walnut", "rocket",
    "pencil", "guitar", "dolphin", "pepper", "mango", "orbit", "velvet", "cobalt", "jaguar", "tulip", "anchor",
    "puzzle", "zebra", "piano", "lemon", "canyon", "ember", "crystal", "blizzard", "coconut", "panther",
    "sapphire", "trumpet", "meteor", "lobster", "robin", "yogurt", "cello", "magnet", "parrot", "bamboo",
    "pebble", "thunder", "silver", "orchid", "tractor", "waffle", "kayak", "igloo", "penguin", "raven", "cherry",
    "olive", "ginger", "hazel", "cedar", "maple", "willow", "tornado",
];

/// The name pools, attribute phrases and answer words the tasks use (for tests: none may appear
/// in procedural filler).
pub fn planted_vocabulary() -> Vec<&'static str> {
    let mut v = Vec::new();
    v.extend_from_slice(FIRST_NAMES);
    v.extend_from_slice(LAST_NAMES);
    v.extend_from_slice(NUMBER_ATTRS);
    v.extend_from_slice(WORD_ATTRS);
    v.extend_from_slice(ANSWER_WORDS);
    v
}

/// One fact to plant, with where it goes (0 = start, 1 = end of the filler).
struct Fact {
    text: String,
    role: Value,
    depth: f64,
}

/// What a task contributes to a record before the filler is drawn.
struct Plan {
    question: String,
    answers: Vec<String>,
    facts: Vec<Fact>,
    /// Names, values and variables that only planted sentences may contain.
    terms: Vec<String>,
    /// Task-specific metadata (merged into `meta`).
    meta: serde_json::Map<String, Value>,
}

struct Draw<'a> {
    rng: &'a mut Rng,
    cfg: &'a SynthConfig,
    used_first: Vec<usize>,
    used_last: Vec<usize>,
    used_values: Vec<String>,
}

impl Draw<'_> {
    fn name(&mut self) -> String {
        let f = loop {
            let i = self.rng.below(FIRST_NAMES.len() as u64) as usize;
            if !self.used_first.contains(&i) {
                break i;
            }
        };
        let l = loop {
            let i = self.rng.below(LAST_NAMES.len() as u64) as usize;
            if !self.used_last.contains(&i) {
                break i;
            }
        };
        self.used_first.push(f);
        self.used_last.push(l);
        format!("{} {}", FIRST_NAMES[f], LAST_NAMES[l])
    }

    fn value(&mut self) -> String {
        loop {
            let v = random_value(self.cfg, &mut self.rng);
            if !self.used_values.contains(&v) {
                self.used_values.push(v.clone());
                return v;
            }
        }
    }

    fn attrs(&self) -> &'static [&'static str] {
        match self.cfg.answer_kind {
            AnswerKind::Number => NUMBER_ATTRS,
            AnswerKind::Word => WORD_ATTRS,
        }
    }

    fn attr(&mut self) -> &'static str {
        let a = self.attrs();
        a[self.rng.below(a.len() as u64) as usize]
    }

    fn var_name(&mut self, used: &[String]) -> String {
        loop {
            let v: String = (0..5).map(|_| (b'A' + self.rng.below(26) as u8) as char).collect();
            if !used.contains(&v) {
                return v;
            }
        }
    }
}

/// A numeric or word answer drawn from `rng`.
fn random_value(cfg: &SynthConfig, rng: &mut Rng) -> String {
    match cfg.answer_kind {
        AnswerKind::Number => {
            let lo = 10u64.pow(cfg.digits as u32 - 1);
            (lo + rng.below(9 * lo)).to_string()
        }
        AnswerKind::Word => ANSWER_WORDS[rng.below(ANSWER_WORDS.len() as u64) as usize].to_string(),
    }
}

/// (sentence, the prefix before the value, question) for "attribute of name is value".
fn fact_form(form: u64, attr: &str, name: &str, value: &str) -> (String, String, String) {
    let (prefix, question) = match form {
        0 => (format!("The {attr} of {name} is "), format!("What is the {attr} of {name}?")),
        1 => (format!("{name}'s {attr} is "), format!("What is {name}'s {attr}?")),
        _ => (format!("Remember this: the {attr} of {name} is "), format!("What is the {attr} of {name}?")),
    };
    (format!("{prefix}{value}."), prefix, question)
}

fn plan_needle_like(d: &mut Draw, keys: usize) -> Plan {
    let form = d.rng.below(3);
    let attr = d.attr();
    let mut names = Vec::new();
    let mut values = Vec::new();
    for _ in 0..keys {
        names.push(d.name());
        values.push(d.value());
    }
    let target = d.rng.below(keys as u64) as usize;
    // facts in a random order, spread over `keys` equal strata of the document
    let mut order: Vec<usize> = (0..keys).collect();
    d.rng.shuffle(&mut order);
    let mut facts = Vec::new();
    let mut prefix_gold = String::new();
    let mut question = String::new();
    for (slot, &k) in order.iter().enumerate() {
        let (text, prefix, q) = fact_form(form, attr, &names[k], &values[k]);
        let depth = (slot as f64 + d.rng.next_f64()) / keys as f64;
        let role = if k == target {
            prefix_gold = prefix;
            question = q;
            json!({"role": "needle"})
        } else {
            json!({"role": "distractor"})
        };
        facts.push(Fact { text, role, depth });
    }
    let mut terms = names.clone();
    for n in &names {
        terms.extend(n.split(' ').map(String::from));
    }
    terms.extend(values.iter().cloned());
    terms.push(attr.to_string());
    let mut meta = serde_json::Map::new();
    meta.insert("key".into(), json!(names[target]));
    meta.insert("attribute".into(), json!(attr));
    meta.insert("answer_prefix".into(), json!(prefix_gold));
    if keys > 1 {
        meta.insert("keys".into(), json!(names));
    }
    if d.cfg.choices > 0 {
        // the gold, then the decoys the document states for other keys, then fresh values; from
        // a generator of their own (seeded by the record's facts), so the document is the one
        // the same seed gives without --choices
        let mut crng = Rng::new(names.iter().chain(&values).flat_map(|s| s.bytes()).fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3)));
        let mut choices = vec![values[target].clone()];
        choices.extend(values.iter().enumerate().filter(|&(k, _)| k != target).map(|(_, v)| v.clone()).take(d.cfg.choices - 1));
        while choices.len() < d.cfg.choices {
            let v = random_value(d.cfg, &mut crng);
            if !d.used_values.contains(&v) && !choices.contains(&v) {
                choices.push(v);
            }
        }
        crng.shuffle(&mut choices);
        question = format!("{question} It is one of: {}.", choices.join(", "));
        meta.insert("choices".into(), json!(choices));
    }
    Plan { question, answers: vec![values[target].clone()], facts, terms, meta }
}

fn plan_multihop(d: &mut Draw) -> Plan {
    let hops = d.cfg.hops();
    let names: Vec<String> = (0..hops).map(|_| d.name()).collect();
    let mut attrs: Vec<&str> = Vec::new();
    for i in 0..hops {
        let a = loop {
            let a = d.attr();
            if i == 0 || a != attrs[i - 1] {
                break a;
            }
        };
        attrs.push(a);
    }
    let value = d.value();
    let mut chain_text = Vec::new();
    for i in 0..hops - 1 {
        chain_text.push(format!("{}'s {} is the same as {}'s {}.", names[i], attrs[i], names[i + 1], attrs[i + 1]));
    }
    chain_text.push(format!("{}'s {} is {}.", names[hops - 1], attrs[hops - 1], value));
    // chain slots: one per stratum, kept in the middle half of it, so consecutive chain sentences
    // are at least half a stratum apart
    let mut slot_of: Vec<usize> = (0..hops).collect();
    if d.cfg.hop_order == HopOrder::Shuffled {
        d.rng.shuffle(&mut slot_of);
    }
    let mut facts = Vec::new();
    for (i, text) in chain_text.iter().enumerate() {
        let depth = (slot_of[i] as f64 + 0.25 + 0.5 * d.rng.next_f64()) / hops as f64;
        facts.push(Fact { text: text.clone(), role: json!({"role": "hop", "hop": i + 1}), depth });
    }
    let mut terms: Vec<String> = Vec::new();
    let mut distractor_names = Vec::new();
    for _ in 0..d.cfg.distractors() {
        let n = d.name();
        let a = attrs[d.rng.below(hops as u64) as usize];
        let v = d.value();
        facts.push(Fact { text: format!("{n}'s {a} is {v}."), role: json!({"role": "distractor"}), depth: d.rng.next_f64() });
        terms.push(v);
        distractor_names.push(n);
    }
    for n in names.iter().chain(&distractor_names) {
        terms.push(n.clone());
        terms.extend(n.split(' ').map(String::from));
    }
    terms.push(value.clone());
    terms.extend(attrs.iter().map(|a| a.to_string()));
    let mut meta = serde_json::Map::new();
    meta.insert("hops".into(), json!(hops));
    meta.insert("hop_order".into(), json!(d.cfg.hop_order));
    meta.insert(
        "chain".into(),
        json!(names.iter().zip(&attrs).map(|(n, a)| json!({"name": n, "attribute": a})).collect::<Vec<_>>()),
    );
    Plan {
        question: format!("What is {}'s {}?", names[0], attrs[0]),
        answers: vec![value],
        facts,
        terms,
        meta,
    }
}

fn plan_vartrack(d: &mut Draw) -> Plan {
    let hops = d.cfg.hops();
    let nchains = 1 + d.cfg.distractors();
    let mut vars: Vec<String> = Vec::new();
    let mut chains: Vec<Vec<String>> = Vec::new();
    let mut values = Vec::new();
    for _ in 0..nchains {
        let mut c = Vec::new();
        for _ in 0..=hops {
            let v = d.var_name(&vars);
            vars.push(v.clone());
            c.push(v);
        }
        chains.push(c);
        values.push(d.value());
    }
    // statements of each chain in order; chains interleaved at random
    let mut next = vec![0usize; nchains];
    let total = nchains * (hops + 1);
    let mut facts = Vec::new();
    for slot in 0..total {
        let remaining: Vec<usize> = (0..nchains).flat_map(|c| std::iter::repeat_n(c, hops + 1 - next[c])).collect();
        let c = remaining[d.rng.below(remaining.len() as u64) as usize];
        let k = next[c];
        next[c] += 1;
        let rhs = if k == 0 { values[c].clone() } else { format!("VAR {}", chains[c][k - 1]) };
        let text = format!("VAR {} = {rhs}.", chains[c][k]);
        let depth = (slot as f64 + d.rng.next_f64()) / total as f64;
        facts.push(Fact { text, role: json!({"role": if c == 0 { "chain" } else { "distractor" }, "chain": c, "step": k}), depth });
    }
    let gold = &chains[0];
    let (question, answers) = match d.cfg.var_question {
        VarQuestion::Value => (format!("What is the value of VAR {}?", gold[hops]), vec![values[0].clone()]),
        VarQuestion::Which => (
            format!("Which variables are assigned the value {}?", values[0]),
            vec![gold.join(" "), gold.join(", ")],
        ),
    };
    let mut terms = vars.clone();
    terms.extend(values.iter().cloned());
    terms.push("VAR".into());
    let mut meta = serde_json::Map::new();
    meta.insert("hops".into(), json!(hops));
    meta.insert("question_kind".into(), json!(d.cfg.var_question));
    meta.insert("query_var".into(), json!(gold[hops]));
    meta.insert("value".into(), json!(values[0]));
    meta.insert("chains".into(), json!(chains));
    Plan { question, answers, facts, terms, meta }
}

enum Source<'a> {
    Procedural(Procedural),
    Essays(super::filler::EssayReader<'a>),
}

impl Source<'_> {
    fn paragraph(&mut self) -> Vec<String> {
        match self {
            Source::Procedural(p) => p.paragraph(),
            Source::Essays(e) => e.paragraph(),
        }
    }
}

struct FillerPiece {
    text: String,
    cost: usize,
    new_para: bool,
}

/// Filler sentences drawn lazily from a source, refusing any that mention a planted term.
struct FillerDraw<'a> {
    source: Source<'a>,
    terms_lower: &'a [String],
    counter: TokenCounter<'a>,
    pieces: Vec<FillerPiece>,
    /// cum[k] = tokens of the first k pieces
    cum: Vec<usize>,
    refused_in_a_row: usize,
}

impl FillerDraw<'_> {
    /// Draw whole paragraphs until the pieces hold at least `want` tokens. Paragraphs that add no
    /// token at all (every sentence measured as 0 tokens) end it with an error after a while,
    /// rather than drawing forever.
    fn draw_until(&mut self, want: usize) -> Result<()> {
        let mut empty_in_a_row = 0usize;
        while *self.cum.last().unwrap() < want {
            let before = *self.cum.last().unwrap();
            if empty_in_a_row >= 1000 {
                bail!(
                    "the filler's sentences measure 0 tokens each ({}): the document can never reach its size",
                    self.counter.describe()
                );
            }
            let mut first = true;
            for s in self.source.paragraph() {
                if mentions_any(&s, self.terms_lower) {
                    self.refused_in_a_row += 1;
                    ensure!(
                        self.refused_in_a_row < 1000,
                        "the filler keeps mentioning planted names or values (1000 sentences in a row refused)"
                    );
                    continue;
                }
                self.refused_in_a_row = 0;
                let cost = self.counter.count(&format!(" {s}"))?;
                self.pieces.push(FillerPiece { text: s, cost, new_para: first });
                self.cum.push(self.cum.last().unwrap() + cost);
                first = false;
            }
            if *self.cum.last().unwrap() == before {
                empty_in_a_row += 1;
            } else {
                empty_in_a_row = 0;
            }
        }
        Ok(())
    }

    /// How many pieces come closest to `goal` tokens.
    fn cut_for(&self, goal: f64) -> usize {
        let k = self.cum.iter().position(|&c| c as f64 >= goal).unwrap_or(self.cum.len() - 1);
        if k > 0 && goal - self.cum[k - 1] as f64 <= self.cum[k] as f64 - goal {
            k - 1
        } else {
            k
        }
    }
}

struct Rendered {
    context: String,
    /// (byte, char, approximate token) offset of each fact
    fact_pos: Vec<(usize, usize, usize)>,
    tok_total: usize,
}

/// Join filler pieces and facts: facts go before filler piece `round(depth * n)`, inside the
/// paragraph; paragraphs are separated by a blank line, sentences by a space.
fn render(pieces: &[FillerPiece], facts: &[Fact], fact_tokens: &[usize]) -> Rendered {
    let n = pieces.len();
    let mut inserts: Vec<Vec<usize>> = vec![Vec::new(); n + 1];
    for (fi, f) in facts.iter().enumerate() {
        let p = ((f.depth.clamp(0.0, 1.0) * n as f64).round() as usize).min(n);
        inserts[p].push(fi);
    }
    let mut out = Rendered { context: String::new(), fact_pos: vec![(0, 0, 0); facts.len()], tok_total: 0 };
    let mut chars = 0usize;
    let mut push = |out: &mut Rendered, text: &str, new_para: bool| -> (usize, usize) {
        if !out.context.is_empty() {
            let sep = if new_para { "\n\n" } else { " " };
            out.context.push_str(sep);
            chars += sep.len();
        }
        let at = (out.context.len(), chars);
        out.context.push_str(text);
        chars += text.chars().count();
        at
    };
    for p in 0..=n {
        for &fi in &inserts[p] {
            let (b, c) = push(&mut out, &facts[fi].text, false);
            out.fact_pos[fi] = (b, c, out.tok_total);
            out.tok_total += fact_tokens[fi];
        }
        if p < n {
            push(&mut out, &pieces[p].text, pieces[p].new_para);
            out.tok_total += pieces[p].cost;
        }
    }
    out
}

fn mentions_any(sentence: &str, terms_lower: &[String]) -> bool {
    let s = sentence.to_lowercase();
    terms_lower.iter().any(|t| count_word(&s, t) > 0)
}

fn build_record(cfg: &SynthConfig, index: usize, counter: TokenCounter, essays: Option<&Essays>) -> Result<QaRecord> {
    // one stream per (task, record): files of different tasks with one seed share nothing
    let mut rng = Rng::derive(cfg.seed, ((cfg.task as u64 + 1) << 48) | index as u64);
    let mut draw = Draw { rng: &mut rng, cfg, used_first: vec![], used_last: vec![], used_values: vec![] };
    let mut plan = match cfg.task {
        Task::Needle => plan_needle_like(&mut draw, 1),
        Task::Multikey => plan_needle_like(&mut draw, 1 + cfg.distractors()),
        Task::Multihop => plan_multihop(&mut draw),
        Task::Vartrack => plan_vartrack(&mut draw),
    };
    // stable sort by depth: chain order is kept where depths say so
    plan.facts.sort_by(|a, b| a.depth.total_cmp(&b.depth));
    let terms_lower: Vec<String> = plan.terms.iter().map(|t| t.to_lowercase()).collect();

    let fact_tokens: Vec<usize> =
        plan.facts.iter().map(|f| counter.count(&format!(" {}", f.text))).collect::<Result<_>>()?;
    let planted: usize = fact_tokens.iter().sum();
    ensure!(
        cfg.tokens >= planted + 32,
        "--tokens {} is too small for this task: the planted facts alone take {planted} tokens",
        cfg.tokens
    );
    let budget = cfg.tokens - planted;

    let mut filler = FillerDraw {
        source: match (cfg.filler, essays) {
            (FillerKind::Essays, Some(e)) => Source::Essays(e.reader(&mut rng)),
            (FillerKind::Essays, None) => bail!("essays filler requested but no essays loaded"),
            (FillerKind::Procedural, _) => Source::Procedural(Procedural::new(Rng::new(rng.next_u64()))),
        },
        terms_lower: &terms_lower,
        counter,
        pieces: Vec::new(),
        cum: vec![0],
        refused_in_a_row: 0,
    };
    // Size in two or three passes: the sum of per-sentence counts misses what joining costs
    // (paragraph breaks, merges across the seams), so measure the real count and re-cut the same
    // filler stream by the observed ratio.
    let mut goal = budget as f64;
    let mut best: Option<(usize, Rendered)> = None;
    for _pass in 0..3 {
        filler.draw_until(goal.ceil() as usize + 1)?;
        let cut = filler.cut_for(goal);
        let r = render(&filler.pieces[..cut], &plan.facts, &fact_tokens);
        let real = counter.count(&r.context)?;
        let off = real.abs_diff(cfg.tokens);
        let better = best.as_ref().is_none_or(|(t, _)| off < t.abs_diff(cfg.tokens));
        let estimated = planted + filler.cum[cut];
        if better {
            best = Some((real, r));
        }
        if (off as f64) <= 0.005 * cfg.tokens as f64 || cut == 0 || estimated == 0 {
            break;
        }
        let ratio = real as f64 / estimated as f64;
        goal = (cfg.tokens as f64 / ratio - planted as f64).max(0.0);
    }
    let (tokens, Rendered { context, fact_pos, tok_total: tok_pos }) = best.expect("at least one pass");

    let facts_meta: Vec<Value> = plan
        .facts
        .iter()
        .zip(&fact_pos)
        .map(|(f, &(b, c, t))| {
            let mut o = f.role.as_object().cloned().unwrap_or_default();
            o.insert("text".into(), json!(f.text));
            o.insert("byte_offset".into(), json!(b));
            o.insert("char_offset".into(), json!(c));
            o.insert("token_offset".into(), json!(t));
            o.insert("depth".into(), json!((t as f64 / tok_pos.max(1) as f64 * 1000.0).round() / 1000.0));
            Value::Object(o)
        })
        .collect();
    let mut meta = serde_json::Map::new();
    meta.insert("generator".into(), json!("infomem-engine data synth"));
    meta.insert("seed".into(), json!(cfg.seed));
    meta.insert("index".into(), json!(index));
    meta.insert("filler".into(), json!(cfg.filler));
    meta.insert("answer_kind".into(), json!(cfg.answer_kind));
    meta.insert("target_tokens".into(), json!(cfg.tokens));
    meta.insert("tokens".into(), json!(tokens));
    meta.insert("token_count".into(), json!(counter.describe()));
    meta.insert("facts".into(), Value::Array(facts_meta));
    meta.insert("planted_terms".into(), json!(plan.terms));
    meta.extend(plan.meta);
    let rec = QaRecord {
        id: format!("{}-s{}-{:06}", cfg.task.name(), cfg.seed, index),
        question: plan.question,
        context,
        answers: plan.answers,
        task: cfg.task.name().into(),
        meta: Value::Object(meta),
    };
    verify_record(&rec).with_context(|| format!("internal error: synthesized record {} failed its check", rec.id))?;
    Ok(rec)
}

/// Generate `cfg.count` records. `tokenizer` sizes documents in the model's tokens; without it
/// `cfg.chars_per_token` is used.
pub fn synthesize(cfg: &SynthConfig, tokenizer: Option<&TextTokenizer>) -> Result<Vec<QaRecord>> {
    cfg.validate()?;
    let essays = match cfg.filler {
        FillerKind::Essays => {
            let dir = cfg.essays_dir.clone().unwrap_or_else(default_essays_dir);
            Some(Essays::load(&dir)?)
        }
        FillerKind::Procedural => None,
    };
    let counter = TokenCounter::new(tokenizer, cfg.chars_per_token);
    (0..cfg.count).into_par_iter().map(|i| build_record(cfg, i, counter, essays.as_ref())).collect()
}

/// `${INFOMEM_CACHE:-$HOME/.cache/infomem-engine}/haystack`, where tools/fetch-haystack.sh puts
/// the essays.
pub fn default_essays_dir() -> PathBuf {
    let cache = std::env::var_os("INFOMEM_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/infomem-engine")
    });
    cache.join("haystack")
}

fn meta_str<'a>(meta: &'a Value, key: &str) -> Result<&'a str> {
    meta.get(key).and_then(Value::as_str).ok_or_else(|| anyhow!("meta.{key} missing"))
}

/// The text after `prefix` up to the next '.', when `prefix` occurs exactly once.
fn value_after(context: &str, prefix: &str) -> Result<String> {
    let n = count_substr(context, prefix);
    ensure!(n == 1, "{prefix:?} occurs {n} times in the context (expected once)");
    let at = context.find(prefix).unwrap() + prefix.len();
    let rest = &context[at..];
    let end = rest.find('.').ok_or_else(|| anyhow!("no '.' after {prefix:?}"))?;
    Ok(rest[..end].to_string())
}

/// Every `VAR A = rhs.` statement of a text, in order.
pub fn parse_var_statements(context: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = context[from..].find("VAR ") {
        let s = from + i;
        from = s + 4;
        let rest = &context[s + 4..];
        let name_len = rest.bytes().take_while(u8::is_ascii_uppercase).count();
        if name_len == 0 || !rest[name_len..].starts_with(" = ") {
            continue;
        }
        let rhs_all = &rest[name_len + 3..];
        let Some(end) = rhs_all.find('.') else { continue };
        out.push((rest[..name_len].to_string(), rhs_all[..end].to_string()));
        from = s + 4 + name_len + 3 + end;
    }
    out
}

/// Follow `VAR` references from `var` to a literal value.
fn resolve_var(stmts: &[(String, String)], var: &str) -> Result<String> {
    let mut cur = var.to_string();
    for _ in 0..=stmts.len() {
        let defs: Vec<&String> = stmts.iter().filter(|(v, _)| *v == cur).map(|(_, r)| r).collect();
        ensure!(defs.len() == 1, "VAR {cur} is assigned {} times (expected once)", defs.len());
        match defs[0].strip_prefix("VAR ") {
            Some(next) => cur = next.to_string(),
            None => return Ok(defs[0].clone()),
        }
    }
    bail!("VAR {var}: the assignments form a cycle")
}

/// Check a synthesized record against its own text: each planted sentence occurs exactly once
/// (at its recorded offset), no other sentence mentions a planted name, variable or value, and
/// the canonical answer is re-derived from the context alone (for `multihop` by following the
/// chain from the question's key, for `vartrack` by resolving the assignments).
pub fn verify_record(rec: &QaRecord) -> Result<()> {
    let meta = &rec.meta;
    ensure!(!rec.answers.is_empty() && !rec.answers[0].is_empty(), "no gold answer");
    let facts = meta.get("facts").and_then(Value::as_array).ok_or_else(|| anyhow!("meta.facts missing"))?;
    let mut fact_texts = Vec::new();
    for f in facts {
        let text = meta_str(f, "text")?;
        let n = count_substr(&rec.context, text);
        ensure!(n == 1, "planted sentence {text:?} occurs {n} times (expected once)");
        let at = f.get("byte_offset").and_then(Value::as_u64).ok_or_else(|| anyhow!("fact without byte_offset"))? as usize;
        ensure!(rec.context.get(at..at + text.len()) == Some(text), "planted sentence {text:?} is not at byte {at}");
        fact_texts.push(text.to_lowercase());
    }
    let ctx_lower = rec.context.to_lowercase();
    if let Some(terms) = meta.get("planted_terms").and_then(Value::as_array) {
        for t in terms.iter().filter_map(Value::as_str) {
            let t = t.to_lowercase();
            let in_ctx = count_word(&ctx_lower, &t);
            let in_facts: usize = fact_texts.iter().map(|f| count_word(f, &t)).sum();
            ensure!(in_ctx == in_facts, "{t:?} occurs {in_ctx} times in the context but {in_facts} times in the planted sentences");
        }
    }
    if let Some(ch) = meta.get("choices") {
        let ch: Vec<&str> = ch.as_array().ok_or_else(|| anyhow!("meta.choices is not a list"))?.iter().filter_map(Value::as_str).collect();
        ensure!(ch.len() >= 2 && ch.contains(&rec.answers[0].as_str()), "meta.choices {ch:?} must name the gold {:?} among at least 2", rec.answers[0]);
        ensure!(ch.iter().all(|c| rec.question.contains(c)), "the question does not name every choice");
    }
    let derived = match rec.task.as_str() {
        "needle" | "multikey" => value_after(&rec.context, meta_str(meta, "answer_prefix")?)?,
        "multihop" => {
            let chain = meta.get("chain").and_then(Value::as_array).ok_or_else(|| anyhow!("meta.chain missing"))?;
            let first = chain.first().ok_or_else(|| anyhow!("empty chain"))?;
            let mut name = meta_str(first, "name")?.to_string();
            let mut attr = meta_str(first, "attribute")?.to_string();
            let mut steps = 0;
            loop {
                ensure!(steps <= 16, "multihop chain does not end");
                steps += 1;
                let link = format!("{name}'s {attr} is the same as ");
                if count_substr(&rec.context, &link) == 1 {
                    let target = value_after(&rec.context, &link)?;
                    let (n, a) = target.split_once("'s ").ok_or_else(|| anyhow!("bad link target {target:?}"))?;
                    name = n.to_string();
                    attr = a.to_string();
                } else {
                    break value_after(&rec.context, &format!("{name}'s {attr} is "))?;
                }
            }
        }
        "vartrack" => {
            let stmts = parse_var_statements(&rec.context);
            match meta_str(meta, "question_kind")? {
                "value" => resolve_var(&stmts, meta_str(meta, "query_var")?)?,
                _ => {
                    let value = meta_str(meta, "value")?;
                    let mut names = Vec::new();
                    for (v, _) in &stmts {
                        if resolve_var(&stmts, v)? == value {
                            names.push(v.clone());
                        }
                    }
                    names.join(" ")
                }
            }
        }
        other => bail!("unknown synthetic task {other:?}"),
    };
    ensure!(derived == rec.answers[0], "the context gives {derived:?} but the gold answer is {:?}", rec.answers[0]);
    Ok(())
}
