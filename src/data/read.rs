//! Readers: JSONL question/context/answers records (ours and the common public shapes) and
//! HotpotQA's distractor JSON, with the RULER/MemAgent padding recipe.
//!
//! Accepted record shapes (one JSON object per line, or the elements of a top-level array):
//! - question: `"question"` or `"input"` (or `"query"`);
//! - context: `"context"` as a string, or as a list of documents; or `"documents"`, a list. A
//!   document is a string, an object with `"text"` (and optionally `"title"`), or HotpotQA's
//!   `[title, [sentence, ...]]` (or `[title, text]`);
//! - answers: `"answers"` or `"answer"` (or `"outputs"`), a string, a number or a list of them;
//! - optional: `"id"`/`"_id"`, `"task"`/`"dataset"`, `"meta"` (kept as is), `"supporting_facts"`.
//!
//! Other keys: a near miss of one of the keys above ([`RECORD_KEYS`]; `"tsk"`, `"Answers"`,
//! `"contxt"`, see [`super::keys::near_miss`]) is an error naming the key it resembles, never a
//! silent default (a lost `"task"` would label the record with the file's name). Any other key
//! is kept in the record's `meta` when its value is a string, a number or a boolean and the record
//! has no `"meta"` object of its own; otherwise it is dropped (a top-level `"target_tokens"` is
//! kept beside a given `"meta"`).
//!
//! A file whose first character is `[` is a JSON array (HotpotQA's distractor files are detected
//! by their `supporting_facts` and list-valued contexts); anything else is JSONL. Errors name the
//! file and the 1-based line (of the JSONL line, or where the array element starts). A JSONL line
//! may be at most [`MAX_LINE_BYTES`] long: the file is read a line at a time, and a longer line
//! is an error (or skipped with `skip_bad`) without ever being held in memory. The input must be
//! a regular file: a FIFO would block the read, a device such as /dev/zero would be read without
//! end.
use super::{QaRecord, TokenCounter, DEFAULT_CHARS_PER_TOKEN};
use crate::model::tokenizer::TextTokenizer;
use crate::util::rng::Rng;
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::Path;

/// Longest JSONL line (one record) the reader accepts: 32 MiB, about 7M tokens of English text.
/// Records are parsed and later tokenized whole, and tokenizing takes hundreds of bytes per
/// token (a 50 MB line took 13.7 GB), so a longer line is refused rather than risking the
/// machine's memory. `synth::MAX_TOKENS` keeps synthetic records under it.
pub const MAX_LINE_BYTES: usize = 32 << 20;

#[derive(Clone, Copy, Default)]
pub struct ReadOptions<'a> {
    /// Skip malformed records (reported in [`ReadReport::skipped`]) instead of failing.
    pub skip_bad: bool,
    /// Pad every record to about this many tokens with documents of other records.
    pub pad_to_tokens: Option<usize>,
    /// Token counting for padding; without it, [`DEFAULT_CHARS_PER_TOKEN`] characters a token.
    pub tokenizer: Option<&'a TextTokenizer>,
    /// Seed of the padding draw and shuffle.
    pub seed: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReadReport {
    /// Records read successfully.
    pub read: usize,
    /// (1-based line, reason) of every record skipped with `skip_bad`.
    pub skipped: Vec<(usize, String)>,
    /// `"jsonl"`, `"hotpotqa"` or `"json-array"`.
    pub format: String,
    /// Things the caller should know, e.g. records that could not be padded to the target.
    pub warnings: Vec<String>,
}

impl ReadReport {
    /// One line for a CLI: "read 98 records (jsonl), skipped 2: line 3: missing question; ...".
    pub fn summary(&self, path: &Path) -> String {
        let mut s = format!("{}: read {} records ({})", path.display(), self.read, self.format);
        if !self.skipped.is_empty() {
            s.push_str(&format!(", skipped {}:", self.skipped.len()));
            for (line, why) in self.skipped.iter().take(10) {
                s.push_str(&format!(" [line {line}: {why}]"));
            }
            if self.skipped.len() > 10 {
                s.push_str(&format!(" … and {} more", self.skipped.len() - 10));
            }
        }
        s
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Doc {
    title: Option<String>,
    text: String,
}

enum Body {
    Text(String),
    Docs(Vec<Doc>),
}

struct Parsed {
    id: String,
    question: String,
    answers: Vec<String>,
    task: String,
    meta: Value,
    body: Body,
}

fn render_docs(docs: &[&Doc]) -> String {
    let mut out = String::new();
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            out.push_str("\n\n");
        }
        out.push_str(&format!("Document {}:\n", i + 1));
        if let Some(t) = &d.title {
            out.push_str(t);
            out.push('\n');
        }
        out.push_str(&d.text);
    }
    out
}

fn as_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn parse_doc(v: &Value, what: &str) -> std::result::Result<Doc, String> {
    let bad = || format!("{what}: expected a string, an object with \"text\", or [title, sentences]");
    match v {
        Value::String(s) => Ok(Doc { title: None, text: s.clone() }),
        Value::Object(o) => {
            let text = match o.get("text").or_else(|| o.get("paragraph_text")).or_else(|| o.get("content")) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(a)) => {
                    a.iter().map(|x| x.as_str().map(String::from).ok_or_else(bad)).collect::<Result<Vec<_>, _>>()?.concat()
                }
                _ => return Err(bad()),
            };
            let title = o.get("title").and_then(Value::as_str).map(String::from);
            Ok(Doc { title, text })
        }
        Value::Array(a) if a.len() == 2 => {
            let title = a[0].as_str().ok_or_else(bad)?.to_string();
            let text = match &a[1] {
                Value::String(s) => s.clone(),
                Value::Array(sents) => {
                    sents.iter().map(|x| x.as_str().map(String::from).ok_or_else(bad)).collect::<Result<Vec<_>, _>>()?.concat()
                }
                _ => return Err(bad()),
            };
            Ok(Doc { title: Some(title), text })
        }
        _ => Err(bad()),
    }
}

/// Every top-level key the reader reads (see the module doc).
pub const RECORD_KEYS: &[&str] = &[
    "question", "input", "query", "answers", "answer", "outputs", "context", "documents", "id", "_id", "task", "dataset",
    "meta", "supporting_facts", "target_tokens",
];

/// One record from a JSON value; the error is the reason, without file and line.
fn parse_record(v: &Value, source: &str, line: usize, default_task: &str) -> std::result::Result<Parsed, String> {
    let o = v.as_object().ok_or_else(|| "expected a JSON object".to_string())?;
    // a misspelt key would be ignored and a default used in its place (a "tsk" makes the task
    // the file's name, which eval groups accuracy by): a near miss of a known key is refused
    for k in o.keys() {
        if let Some(known) = super::keys::near_miss(k, RECORD_KEYS) {
            return Err(format!(
                "unknown key {k:?} looks like a misspelling of {known:?}; rename it (or move it under \"meta\" if it is metadata)"
            ));
        }
    }
    let (qkey, q) = ["question", "input", "query"]
        .iter()
        .find_map(|k| o.get(*k).map(|q| (*k, q)))
        .ok_or_else(|| "missing question (expected \"question\" or \"input\")".to_string())?;
    let question = q.as_str().ok_or_else(|| format!("\"{qkey}\" is not a string"))?.to_string();
    if question.trim().is_empty() {
        return Err("empty question".into());
    }
    let (akey, a) = ["answers", "answer", "outputs"]
        .iter()
        .find_map(|k| o.get(*k).filter(|a| !a.is_null()).map(|a| (*k, a)))
        .ok_or_else(|| "missing answers (expected \"answers\" or \"answer\")".to_string())?;
    let answers: Vec<String> = match a {
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(i, x)| as_text(x).ok_or_else(|| format!("\"{akey}\"[{i}] is not a string")))
            .collect::<Result<_, _>>()?,
        other => vec![as_text(other).ok_or_else(|| format!("\"{akey}\" must be a string or a list of strings"))?],
    };
    if answers.is_empty() {
        return Err(format!("empty answers (\"{akey}\" is an empty list)"));
    }
    if let Some(i) = answers.iter().position(|s| s.trim().is_empty()) {
        return Err(if answers.len() == 1 { "empty answers".to_string() } else { format!("empty answers (\"{akey}\"[{i}] is empty)") });
    }
    let (ckey, c) = ["context", "documents"]
        .iter()
        .find_map(|k| o.get(*k).map(|c| (*k, c)))
        .ok_or_else(|| "missing context (expected \"context\" or \"documents\")".to_string())?;
    let body = match c {
        Value::String(s) => {
            if s.trim().is_empty() {
                return Err("empty context".into());
            }
            Body::Text(s.clone())
        }
        Value::Array(list) => {
            let docs: Vec<Doc> = list
                .iter()
                .enumerate()
                .map(|(i, d)| parse_doc(d, &format!("\"{ckey}\"[{i}]")))
                .collect::<Result<_, _>>()?;
            let docs: Vec<Doc> = docs.into_iter().filter(|d| !d.text.trim().is_empty()).collect();
            if docs.is_empty() {
                return Err(format!("empty context (\"{ckey}\" has no non-empty document)"));
            }
            Body::Docs(docs)
        }
        _ => return Err(format!("\"{ckey}\" must be a string or a list of documents")),
    };
    // present but of the wrong type is an error, not the default (the task labels eval's rows)
    let present = |keys: [&'static str; 2]| keys.into_iter().find_map(|k| o.get(k).filter(|v| !v.is_null()).map(|v| (k, v)));
    let id = match present(["id", "_id"]) {
        Some((k, v)) => as_text(v).ok_or_else(|| format!("\"{k}\" must be a string or a number"))?,
        None => format!("{source}-{line}"),
    };
    let task = match present(["task", "dataset"]) {
        Some((k, v)) => v.as_str().map(String::from).ok_or_else(|| format!("\"{k}\" must be a string"))?,
        None => default_task.to_string(),
    };
    let meta = match o.get("meta") {
        Some(Value::Object(m)) => {
            let mut m = m.clone();
            // a top-level target length (eval groups by it) is kept beside a given meta
            if let Some(t @ Value::Number(_)) = o.get("target_tokens") {
                m.entry("target_tokens").or_insert_with(|| t.clone());
            }
            Value::Object(m)
        }
        _ => {
            let mut m = Map::new();
            m.insert("source".into(), json!(source));
            m.insert("line".into(), json!(line));
            for (k, v) in o {
                // every scalar other than the fields themselves is kept ("dataset" and
                // "target_tokens" included: eval reads the latter from meta)
                let field = RECORD_KEYS.contains(&k.as_str()) && k != "dataset" && k != "target_tokens";
                if !field && (v.is_string() || v.is_number() || v.is_boolean()) {
                    m.insert(k.clone(), v.clone());
                }
            }
            if let Some(Value::Array(sf)) = o.get("supporting_facts") {
                let mut titles: Vec<String> = Vec::new();
                for f in sf {
                    if let Some(t) = f.get(0).and_then(Value::as_str) {
                        if !titles.iter().any(|x| x == t) {
                            titles.push(t.to_string());
                        }
                    }
                }
                m.insert("supporting_titles".into(), json!(titles));
            }
            Value::Object(m)
        }
    };
    Ok(Parsed { id, question, answers, task, meta, body })
}

/// Byte offsets where the elements of a top-level JSON array start (the text is valid JSON).
fn array_element_starts(text: &str) -> Vec<usize> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut in_str = false;
    let mut esc = false;
    let mut want = false; // at depth 1, waiting for the next element
    for (i, &c) in b.iter().enumerate() {
        if in_str {
            if esc {
                esc = false;
            } else if c == b'\\' {
                esc = true;
            } else if c == b'"' {
                in_str = false;
            }
            continue;
        }
        if want && !c.is_ascii_whitespace() && c != b']' {
            out.push(i);
            want = false;
        }
        match c {
            b'"' => in_str = true,
            b'[' | b'{' => {
                depth += 1;
                if depth == 1 {
                    want = true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' if depth == 1 => want = true,
            _ => {}
        }
    }
    out
}

fn line_of(text: &str, byte: usize) -> usize {
    text.as_bytes()[..byte.min(text.len())].iter().filter(|&&c| c == b'\n').count() + 1
}

/// The first byte that is not ASCII whitespace (after a UTF-8 byte-order mark), the file then
/// rewound to its start.
fn first_non_space(file: &mut std::fs::File) -> std::io::Result<Option<u8>> {
    let mut buf = [0u8; 1 << 16];
    let mut at_start = true;
    let found = loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break None;
        }
        let mut chunk = &buf[..n];
        if at_start {
            chunk = chunk.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(chunk);
            at_start = false;
        }
        if let Some(&c) = chunk.iter().find(|c| !c.is_ascii_whitespace()) {
            break Some(c);
        }
    };
    file.seek(SeekFrom::Start(0))?;
    Ok(found)
}

enum Line {
    /// A line (its `\n` and a `\r` before it removed) is in the buffer.
    Text,
    /// A line of this many bytes, over [`MAX_LINE_BYTES`], was passed over unread.
    TooLong(u64),
    End,
}

/// The next line of `r` into `buf`, holding at most [`MAX_LINE_BYTES`] + 2 bytes of it.
fn next_line(r: &mut impl BufRead, buf: &mut Vec<u8>) -> std::io::Result<Line> {
    buf.clear();
    let limit = MAX_LINE_BYTES as u64 + 2; // the line and its "\r\n"
    // one allocation of the most a line may take (its pages are touched only as the line fills
    // them), not a doubling Vec that holds the old and the new block at each step
    buf.reserve_exact(limit as usize);
    let n = r.by_ref().take(limit).read_until(b'\n', buf)? as u64;
    if n == 0 {
        return Ok(Line::End);
    }
    let ended = buf.last() == Some(&b'\n');
    if !ended && n == limit {
        // pass over the rest of the line without keeping it
        let mut len = n;
        loop {
            let chunk = r.fill_buf()?;
            if chunk.is_empty() {
                break;
            }
            match chunk.iter().position(|&c| c == b'\n') {
                Some(i) => {
                    len += i as u64;
                    r.consume(i + 1);
                    break;
                }
                None => {
                    let k = chunk.len();
                    len += k as u64;
                    r.consume(k);
                }
            }
        }
        buf.clear();
        return Ok(Line::TooLong(len));
    }
    if ended {
        buf.pop();
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    if buf.len() > MAX_LINE_BYTES {
        let len = buf.len() as u64;
        buf.clear();
        return Ok(Line::TooLong(len));
    }
    Ok(Line::Text)
}

/// Read a file of records. See the module doc for the accepted shapes.
pub fn read_records(path: &Path, opts: ReadOptions) -> Result<(Vec<QaRecord>, ReadReport)> {
    if opts.pad_to_tokens == Some(0) {
        bail!("padding to 0 tokens: the target length must be at least 1 token");
    }
    crate::util::fs::check_regular_file(path, "data file")?;
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let stem = path.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "data".into());
    let shown = path.display();
    let mut report = ReadReport::default();
    let mut parsed: Vec<(usize, Parsed)> = Vec::new();
    let fail = |report: &mut ReadReport, line: usize, why: String| -> Result<()> {
        if opts.skip_bad {
            report.skipped.push((line, why));
            Ok(())
        } else {
            bail!("{shown}: line {line}: {why}")
        }
    };
    let first = first_non_space(&mut file).with_context(|| format!("cannot read {}", path.display()))?;
    if first == Some(b'[') {
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).with_context(|| format!("cannot read {}", path.display()))?;
        let body = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&bytes);
        let text = std::str::from_utf8(body).map_err(|e| {
            let line = body[..e.valid_up_to()].iter().filter(|&&c| c == b'\n').count() + 1;
            anyhow::anyhow!("{shown}: line {line}: not valid UTF-8")
        })?;
        let values: Vec<Value> = serde_json::from_str(text)
            .map_err(|e| anyhow::anyhow!("{shown}: line {}: bad JSON: {e} (a JSON array file cannot skip bad records)", e.line()))?;
        let starts = array_element_starts(text);
        let hotpot = values.first().is_some_and(|v| v.get("supporting_facts").is_some() && v.get("context").is_some_and(Value::is_array));
        report.format = if hotpot { "hotpotqa" } else { "json-array" }.into();
        let default_task = if hotpot { "hotpotqa".to_string() } else { stem.clone() };
        for (k, v) in values.iter().enumerate() {
            let line = starts.get(k).map_or(1, |&b| line_of(text, b));
            match parse_record(v, &stem, line, &default_task) {
                Ok(p) => parsed.push((line, p)),
                Err(why) => fail(&mut report, line, format!("record {}: {why}", k + 1))?,
            }
        }
    } else {
        report.format = "jsonl".into();
        let mut reader = BufReader::with_capacity(1 << 16, file);
        let mut buf = Vec::new();
        let mut line = 0usize;
        loop {
            let got = next_line(&mut reader, &mut buf).with_context(|| format!("cannot read {}", path.display()))?;
            line += 1;
            let raw: &[u8] = match got {
                Line::End => break,
                Line::TooLong(len) => {
                    let why = format!(
                        "line of {:.1} MiB, longer than the {} MiB a record may take",
                        len as f64 / (1 << 20) as f64,
                        MAX_LINE_BYTES >> 20
                    );
                    fail(&mut report, line, why)?;
                    continue;
                }
                Line::Text => &buf,
            };
            let raw = if line == 1 { raw.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(raw) } else { raw };
            if raw.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let Ok(text) = std::str::from_utf8(raw) else {
                fail(&mut report, line, "not valid UTF-8".into())?;
                continue;
            };
            let v: Value = match serde_json::from_str(text) {
                Ok(v) => v,
                Err(e) => {
                    fail(&mut report, line, format!("bad JSON: {e}"))?;
                    continue;
                }
            };
            match parse_record(&v, &stem, line, &stem) {
                Ok(p) => parsed.push((line, p)),
                Err(why) => fail(&mut report, line, why)?,
            }
        }
    }
    if parsed.is_empty() {
        match report.skipped.first() {
            Some((line, why)) => bail!(
                "{shown}: no usable records ({} skipped; the first at line {line}: {why})",
                report.skipped.len()
            ),
            None => bail!("{shown}: no records"),
        }
    }
    report.read = parsed.len();
    let records = match opts.pad_to_tokens {
        None => parsed
            .into_iter()
            .map(|(_, p)| {
                let context = match p.body {
                    Body::Text(s) => s,
                    Body::Docs(d) => render_docs(&d.iter().collect::<Vec<_>>()),
                };
                QaRecord { id: p.id, question: p.question, context, answers: p.answers, task: p.task, meta: p.meta }
            })
            .collect(),
        Some(target) => pad(parsed, target, &opts, &mut report)?,
    };
    Ok((records, report))
}

/// RULER/MemAgent padding: every record keeps its own documents and gets documents of other
/// records (drawn at random, without repeats) until about `target` tokens; then all its documents
/// are shuffled, so the gold ones land at random positions.
fn pad(parsed: Vec<(usize, Parsed)>, target: usize, opts: &ReadOptions, report: &mut ReadReport) -> Result<Vec<QaRecord>> {
    let counter = TokenCounter::new(opts.tokenizer, DEFAULT_CHARS_PER_TOKEN);
    // the pool: every document of the file, once
    let mut pool: Vec<Doc> = Vec::new();
    let mut index: HashMap<Doc, usize> = HashMap::new();
    let own: Vec<Vec<usize>> = parsed
        .iter()
        .map(|(_, p)| {
            let docs = match &p.body {
                Body::Text(s) => vec![Doc { title: None, text: s.clone() }],
                Body::Docs(d) => d.clone(),
            };
            let mut ids = Vec::new();
            for d in docs {
                let id = *index.entry(d.clone()).or_insert_with(|| {
                    pool.push(d);
                    pool.len() - 1
                });
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            ids
        })
        .collect();
    let header = counter.count("\n\nDocument 10:\n")?;
    let cost: Vec<usize> = pool
        .par_iter()
        .map(|d| {
            let t = match &d.title {
                Some(t) => counter.count(&format!("{t}\n{}", d.text)),
                None => counter.count(&d.text),
            };
            t.map(|t| t + header)
        })
        .collect::<Result<_>>()?;
    let results: Vec<(QaRecord, Option<String>)> = parsed
        .into_par_iter()
        .enumerate()
        .map(|(ri, (line, p))| -> Result<(QaRecord, Option<String>)> {
            let mut rng = Rng::derive(opts.seed, ri as u64);
            let gold = &own[ri];
            let mut chosen: Vec<usize> = gold.clone();
            let mut taken: HashSet<usize> = gold.iter().copied().collect();
            let mut total: usize = gold.iter().map(|&i| cost[i]).sum();
            let others = pool.len() - gold.len();
            let mut misses = 0usize;
            let mut attempts = 0usize;
            while total < target && taken.len() < pool.len() && attempts < 20 * pool.len() + 100 && misses < 64 {
                attempts += 1;
                let j = rng.below(pool.len() as u64) as usize;
                if taken.contains(&j) {
                    continue;
                }
                if total + cost[j] <= target {
                    taken.insert(j);
                    chosen.push(j);
                    total += cost[j];
                } else if total + cost[j] - target < target - total {
                    // overshooting with this one lands closer to the target than stopping short
                    taken.insert(j);
                    chosen.push(j);
                    break;
                } else {
                    misses += 1;
                }
            }
            rng.shuffle(&mut chosen);
            let gold_positions: Vec<usize> =
                chosen.iter().enumerate().filter(|(_, j)| gold.contains(j)).map(|(k, _)| k).collect();
            let docs: Vec<&Doc> = chosen.iter().map(|&j| &pool[j]).collect();
            let context = render_docs(&docs);
            let tokens = counter.count(&context)?;
            let warn = (tokens < target * 9 / 10).then(|| {
                format!(
                    "record {} (line {line}) padded to only {tokens} of {target} tokens ({} other documents in the file)",
                    p.id, others
                )
            });
            let mut meta = match p.meta {
                Value::Object(m) => m,
                other => {
                    let mut m = Map::new();
                    if !other.is_null() {
                        m.insert("original_meta".into(), other);
                    }
                    m
                }
            };
            meta.insert(
                "padding".into(),
                json!({
                    "target_tokens": target,
                    "tokens": tokens,
                    "token_count": counter.describe(),
                    "documents": chosen.len(),
                    "gold_documents": gold.len(),
                    "gold_positions": gold_positions,
                    "seed": opts.seed,
                }),
            );
            let rec = QaRecord { id: p.id, question: p.question, context, answers: p.answers, task: p.task, meta: Value::Object(meta) };
            Ok((rec, warn))
        })
        .collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(results.len());
    let mut short = 0usize;
    for (r, w) in results {
        if let Some(w) = w {
            short += 1;
            if short <= 5 {
                report.warnings.push(w);
            }
        }
        out.push(r);
    }
    if short > 5 {
        report.warnings.push(format!("… {} records in all were padded to less than 90% of {target} tokens", short));
    }
    Ok(out)
}
