//! The update and final prompts of docs/DESIGN.md §1.1, rendered through the model's chat template and
//! assembled at the token level.
//!
//! The user turn is rendered once with placeholder markers; the rendered text is cut at the
//! markers into literal pieces (tokenized once) and slots (question, chunk, memory). A prompt is
//! the concatenation of the pieces' ids with the slots' ids — so a chunk is exactly the document's
//! token slice (chunking never re-tokenizes), and every token before the first memory slot is
//! identical across a group's rollouts: that prefix is what gets prefilled once and shared.
use crate::model::tokenizer::{ChatMessage, TextTokenizer};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const DEFAULT_UPDATE: &str = "You are reading a long document one section at a time to answer a question. Keep a short memory of everything that helps answer it.\n\nQuestion:\n{question}\n\nNew section:\n{chunk}\n\nMemory so far:\n{memory}\n\nRewrite the memory: keep what still matters, add what this section contributes, drop the rest. Reply with the new memory only.";
pub const DEFAULT_FINAL: &str = "Answer the question using only your memory of a long document.\n\nQuestion:\n{question}\n\nMemory:\n{memory}\n\nReply with the answer only, as a short phrase.";
pub const DEFAULT_EMPTY_MEMORY: &str = "(empty)";

/// The user-turn texts. `{question}`, `{chunk}` (update only) and `{memory}` are the slots.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Templates {
    pub update: String,
    #[serde(rename = "final")]
    pub final_: String,
    #[serde(default = "default_empty")]
    pub empty_memory: String,
    /// The keep action: an update reply whose first line is this word (case, surrounding spaces
    /// and a final `.` ignored) leaves the memory as it was. The update template must offer it.
    #[serde(default)]
    pub keep: Option<String>,
}

fn default_empty() -> String {
    DEFAULT_EMPTY_MEMORY.to_string()
}

impl Default for Templates {
    fn default() -> Self {
        Templates { update: DEFAULT_UPDATE.into(), final_: DEFAULT_FINAL.into(), empty_memory: DEFAULT_EMPTY_MEMORY.into(), keep: None }
    }
}

impl Templates {
    /// Read a TOML file with `update = "..."`, `final = "..."`, optional `empty_memory`; any
    /// other key (a table included) is refused by name, with the key it resembles.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::util::fs::read_input_text(path, "templates file", MAX_TEMPLATES_BYTES)?;
        let table: toml::Table =
            toml::from_str(&text).with_context(|| format!("{}: expected TOML with `update` and `final` strings", path.display()))?;
        for k in table.keys() {
            if !KEYS.contains(&k.as_str()) {
                let hint = match crate::data::keys::near_miss(k, &KEYS) {
                    Some(near) => format!(" (did you mean `{near}`?)"),
                    None => String::new(),
                };
                bail!("{}: unknown key `{k}`{hint}; a templates file has only {}", path.display(), KEYS.map(|k| format!("`{k}`")).join(", "));
            }
        }
        let t: Templates =
            table.try_into().with_context(|| format!("{}: expected TOML with `update` and `final` strings", path.display()))?;
        t.validate().with_context(|| format!("in {}", path.display()))?;
        Ok(t)
    }

    pub fn validate(&self) -> Result<()> {
        if self.final_.contains("{chunk}") {
            bail!("the final template must not contain {{chunk}}");
        }
        // a `{word}` that is not a slot would reach the model as literal text: a misspelt slot
        // (`{memroy}`) would leave the prompt without the memory
        for (name, text, slots) in [("update", &self.update, &["question", "chunk", "memory"][..]), ("final", &self.final_, &["question", "memory"][..])] {
            if let Some(p) = placeholders(text).into_iter().find(|p| !slots.contains(p)) {
                let list = slots.iter().map(|s| format!("{{{s}}}")).collect::<Vec<_>>().join(", ");
                let hint = match crate::data::keys::near_miss(p, slots) {
                    Some(near) => format!(" (did you mean {{{near}}}?)"),
                    None => String::new(),
                };
                bail!("the {name} template has an unknown placeholder {{{p}}}{hint}; its slots are {list}");
            }
        }
        for (name, text, slots) in [
            ("update", &self.update, &["{question}", "{chunk}", "{memory}"][..]),
            ("final", &self.final_, &["{question}", "{memory}"][..]),
        ] {
            for s in slots {
                match text.matches(s).count() {
                    1 => {}
                    0 => bail!("the {name} template has no {s} slot"),
                    n => bail!("the {name} template has {s} {n} times (exactly once is supported)"),
                }
            }
        }
        if self.empty_memory.trim().is_empty() {
            bail!("empty_memory must be a non-empty text (the model reads it as the initial memory)");
        }
        if let Some(k) = &self.keep {
            let w = k.trim();
            if w.is_empty() || w.len() > 32 || w.contains('\n') || w.ends_with('.') {
                bail!("keep must be a short one-line word the model replies with (at most 32 bytes, no final `.`), got {k:?}");
            }
            if !self.update.contains(w) {
                bail!("keep = {w:?}, but the update template never mentions {w:?}: the model would not know the keep action exists");
            }
        }
        Ok(())
    }
}

/// Whether an update `reply` is the keep action `word`: its first non-blank line, trimmed and
/// without one final `.`, equals `word` ignoring ASCII case.
pub fn is_keep(reply: &str, word: &str) -> bool {
    let Some(line) = reply.lines().map(str::trim).find(|l| !l.is_empty()) else { return false };
    let line = line.strip_suffix('.').unwrap_or(line).trim_end();
    line.eq_ignore_ascii_case(word.trim())
}

/// The keys of a templates file.
const KEYS: [&str; 4] = ["update", "final", "empty_memory", "keep"];

/// Largest templates file read: a prompt template of more than 1 MiB is not one.
const MAX_TEMPLATES_BYTES: u64 = 1 << 20;

/// The names of the `{identifier}` patterns of `text` (an ASCII letter or `_`, then letters,
/// digits or `_`), in order. Other braces (`{}`, `{ x }`, JSON such as `{"a": 1}`) are text.
fn placeholders(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find('{') {
        rest = &rest[i + 1..];
        let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        let name = &rest[..end];
        if rest[end..].starts_with('}') && name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
            out.push(name);
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Question,
    Chunk,
    Memory,
}

#[derive(Clone, Debug)]
enum Piece {
    Lit(Vec<u32>),
    Slot(Slot),
}

/// A rendered, pre-tokenized prompt with slots.
#[derive(Clone, Debug)]
pub struct PromptPlan {
    pieces: Vec<Piece>,
}

const MARK: char = '\u{E000}';

impl PromptPlan {
    pub fn new(tok: &TextTokenizer, user_text: &str) -> Result<Self> {
        let marked = user_text
            .replace("{question}", &format!("{MARK}q{MARK}"))
            .replace("{chunk}", &format!("{MARK}c{MARK}"))
            .replace("{memory}", &format!("{MARK}m{MARK}"));
        let rendered = tok.render_chat(&[ChatMessage::user(&marked)], true)?;
        let mut pieces = Vec::new();
        for (i, part) in rendered.split(MARK).enumerate() {
            if i % 2 == 1 {
                pieces.push(Piece::Slot(match part {
                    "q" => Slot::Question,
                    "c" => Slot::Chunk,
                    "m" => Slot::Memory,
                    other => bail!("the chat template altered a slot marker ({other:?})"),
                }));
            } else if !part.is_empty() {
                pieces.push(Piece::Lit(tok.encode(part)?));
            }
        }
        Ok(PromptPlan { pieces })
    }

    /// Tokens of the literal pieces: the prompt's length with every slot empty (what the
    /// template itself costs, for checking budgets against the model's positions).
    pub fn literal_len(&self) -> usize {
        self.pieces.iter().map(|p| if let Piece::Lit(v) = p { v.len() } else { 0 }).sum()
    }

    /// Ids of the prompt with the slots filled, and the length of the prefix before the first
    /// memory slot (the part shared by all rollouts of a group).
    pub fn build(&self, question: &[u32], chunk: &[u32], memory: &[u32]) -> (Vec<u32>, usize) {
        let mut ids = Vec::new();
        let mut prefix = None;
        for p in &self.pieces {
            match p {
                Piece::Lit(v) => ids.extend_from_slice(v),
                Piece::Slot(Slot::Question) => ids.extend_from_slice(question),
                Piece::Slot(Slot::Chunk) => ids.extend_from_slice(chunk),
                Piece::Slot(Slot::Memory) => {
                    prefix.get_or_insert(ids.len());
                    ids.extend_from_slice(memory)
                }
            }
        }
        let n = ids.len();
        (ids, prefix.unwrap_or(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(Templates::default().validate().is_ok());
        let mut t = Templates::default();
        t.update = t.update.replace("{chunk}", "");
        assert!(t.validate().unwrap_err().to_string().contains("{chunk}"));
        let mut t = Templates::default();
        t.final_.push_str("{memory}");
        assert!(t.validate().unwrap_err().to_string().contains("2 times"));
        // a `{word}` that is not a slot is refused, naming it and the slots
        let mut t = Templates::default();
        t.update.push_str(" {bogus}");
        let e = t.validate().unwrap_err().to_string();
        assert!(e.contains("{bogus}") && e.contains("{question}, {chunk}, {memory}"), "{e}");
        let mut t = Templates::default();
        t.final_.push_str(" {memroy}");
        let e = t.validate().unwrap_err().to_string();
        assert!(e.contains("{memroy}") && e.contains("did you mean {memory}") && e.contains("{question}, {memory}"), "{e}");
        // other braces are text
        let mut t = Templates::default();
        t.update.push_str(" Reply as JSON: {\"memory\": \"...\"} or {} or { memory } or {1st}.");
        t.validate().unwrap();
        assert_eq!(placeholders("a {b} {c d} {_e}{f}} {{g}} {"), vec!["b", "_e", "f", "g"]);
        // the shipped example still loads
        Templates::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/demo-templates.toml")).unwrap();
    }

    #[test]
    fn keep_action() {
        for yes in ["KEEP", " keep.\n", "\n\nKeep", "KEEP\nthe notes so far"] {
            assert!(is_keep(yes, "KEEP"), "{yes:?}");
        }
        for no in ["", "KEEP the notes", "I KEEP", "KEEP..", "The code of Ana is 12345. KEEP"] {
            assert!(!is_keep(no, "KEEP"), "{no:?}");
        }
        let mut t = Templates::default();
        t.keep = Some("KEEP".into());
        let e = t.validate().unwrap_err().to_string();
        assert!(e.contains("never mentions"), "{e}");
        t.update.push_str(" If the section adds nothing, reply KEEP.");
        t.validate().unwrap();
        for bad in ["", "  ", "KEEP.", "a\nb"] {
            t.keep = Some(bad.into());
            assert!(t.validate().is_err(), "{bad:?}");
        }
    }
}
