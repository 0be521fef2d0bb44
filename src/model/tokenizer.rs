//! Text ↔ ids through the `tokenizers` crate, and the model's chat template rendered with
//! minijinja configured the way transformers configures Jinja2 (`trim_blocks`, `lstrip_blocks`,
//! loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII), so the
//! rendered prompt is byte-identical to `apply_chat_template`.
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::path::Path;

pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Ids that end generation: config eos ids ∪ generation_config eos ids ∪ the tokenizer's eos.
    pub eos_ids: Vec<u32>,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn user(content: &str) -> Self {
        ChatMessage { role: "user".into(), content: content.into() }
    }
}

/// A special-token field of tokenizer_config.json: absent or null (none), a string, or an
/// AddedToken object with a string `content`. Anything else is an error naming the file and the
/// key: a wrong type would otherwise leave the model without its end-of-sequence token, silently.
fn token_string(cfg: &Value, key: &str, file: &Path) -> Result<Option<String>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => bail!("{}: \"{key}\" is an object without a string \"content\" (expected a token string or {{\"content\": \"...\"}})", file.display()),
        },
        Some(other) => bail!(
            "{}: \"{key}\" is {}, expected a token string (or {{\"content\": \"...\"}}, or null)",
            file.display(),
            json_kind(other)
        ),
    }
}

/// "a list", "a number", … for messages about a JSON value of the wrong type.
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// An id of generation_config.json's `eos_token_id` (a number or a list of them).
fn token_id(v: &Value, file: &Path) -> Result<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| {
        anyhow!("{}: \"eos_token_id\" holds {v}, which is not a token id (a non-negative integer)", file.display())
    })
}

/// The special-token fields of tokenizer_config.json that are checked (bos and eos are read;
/// the others would be wrong the same way).
const SPECIAL_TOKEN_KEYS: [&str; 7] = ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"];

/// Largest tokenizer.json read (the biggest real ones, 250K-token vocabularies, are ~35 MB).
const MAX_TOKENIZER_BYTES: u64 = 512 << 20;
/// Largest tokenizer_config.json / chat_template.jinja / generation_config.json read.
const MAX_TOKENIZER_CONFIG_BYTES: u64 = 64 << 20;

impl TextTokenizer {
    /// Load `tokenizer.json` (+ chat template) from an HF directory. `Ok(None)` when the directory
    /// has no tokenizer (the tiny test models): callers then only accept ids.
    pub fn load(dir: &Path, config_eos: &[u32]) -> Result<Option<Self>> {
        let tpath = dir.join("tokenizer.json");
        // stat: a symlink loop is an error, not "no tokenizer"
        if crate::util::fs::stat(&tpath)?.is_none() {
            return Ok(None);
        }
        // every file is checked to be a regular file first: a FIFO would block the read, a
        // device would be read without end, a directory would fail with an obscure message
        let text = crate::util::fs::read_input_text(&tpath, "tokenizer file", MAX_TOKENIZER_BYTES)?;
        let tok: tokenizers::Tokenizer =
            text.parse().map_err(|e| anyhow!("cannot load {}: {e}", tpath.display()))?;
        drop(text);
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = if crate::util::fs::stat(&cfg_path)?.is_some() {
            let text = crate::util::fs::read_input_text(&cfg_path, "tokenizer config", MAX_TOKENIZER_CONFIG_BYTES)?;
            let v: Value = serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", cfg_path.display()))?;
            if !v.is_object() {
                bail!("{}: expected a JSON object, found {}", cfg_path.display(), json_kind(&v));
            }
            v
        } else {
            Value::Null
        };
        // transformers prefers chat_template.jinja over the tokenizer_config.json entry.
        let jinja_path = dir.join("chat_template.jinja");
        // the config's entry is checked even where the .jinja file wins: a wrong type is an error
        let config_template = match cfg.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(String::from),
            Some(other) => bail!(
                "{}: \"chat_template\" is {}, expected a string (or a list of {{\"name\", \"template\"}})",
                cfg_path.display(),
                json_kind(other)
            ),
        };
        let chat_template = if crate::util::fs::stat(&jinja_path)?.is_some() {
            Some(crate::util::fs::read_input_text(&jinja_path, "chat template", MAX_TOKENIZER_CONFIG_BYTES)?)
        } else {
            config_template
        };
        for key in SPECIAL_TOKEN_KEYS {
            token_string(&cfg, key, &cfg_path)?;
        }
        let bos_token = token_string(&cfg, "bos_token", &cfg_path)?;
        let eos_token = token_string(&cfg, "eos_token", &cfg_path)?;
        let mut eos_ids: Vec<u32> = config_eos.to_vec();
        let gen_path = dir.join("generation_config.json");
        if crate::util::fs::stat(&gen_path)?.is_some() {
            let text = crate::util::fs::read_input_text(&gen_path, "generation config", MAX_TOKENIZER_CONFIG_BYTES)?;
            let g: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", gen_path.display()))?;
            match g.get("eos_token_id") {
                None | Some(Value::Null) => {}
                Some(Value::Array(a)) => {
                    for x in a {
                        eos_ids.push(token_id(x, &gen_path)?);
                    }
                }
                Some(x) => eos_ids.push(token_id(x, &gen_path)?),
            }
        }
        if let Some(e) = &eos_token {
            eos_ids.extend(tok.token_to_id(e));
        }
        eos_ids.sort();
        eos_ids.dedup();
        Ok(Some(TextTokenizer { tok, chat_template, bos_token, eos_token, eos_ids }))
    }

    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }

    /// Ids of `text` with no special tokens added (special tokens written in the text are kept).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tok.encode(text, false).map_err(|e| anyhow!("tokenizer failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The index, in `encode(text)`, of the token that holds byte `byte` of `text` (the count of
    /// tokens ending at or before it): where a span of the text lands among its tokens.
    pub fn token_index_at(&self, text: &str, byte: usize) -> Result<usize> {
        let enc = self.tok.encode(text, false).map_err(|e| anyhow!("tokenizer failed: {e}"))?;
        Ok(enc.get_offsets().partition_point(|&(_, end)| end <= byte))
    }

    /// Ids of `text` as `tokenizer(text)` gives them (the post-processor's special tokens added).
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tok.encode(text, true).map_err(|e| anyhow!("tokenizer failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tok.decode(ids, skip_special).map_err(|e| anyhow!("cannot decode ids: {e}"))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tok.token_to_id(token)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Render `messages` through the model's chat template.
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tpl = self.chat_template.as_deref().ok_or_else(|| {
            anyhow!("this model has no chat template (tokenizer_config.json has no chat_template and there is no chat_template.jinja)")
        })?;
        render_template(tpl, messages, add_generation_prompt, self.bos_token.as_deref(), self.eos_token.as_deref())
    }

    /// Chat-render then encode.
    pub fn encode_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>> {
        self.encode(&self.render_chat(messages, add_generation_prompt)?)
    }
}

/// Instructions a chat template may run for one rendering. Real templates take thousands; a
/// template that loops 10^10 times would otherwise run forever.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// Most bytes a rendering may produce besides 4× the messages' own text: templates repeat a
/// message a few times at most, and anything far larger (a loop printing 100 KB a turn) would be
/// tokenized whole afterwards, which takes hundreds of bytes of memory per byte.
pub const TEMPLATE_OUTPUT_SLACK: usize = 16 << 20;

/// An `io::Write` into memory that refuses to grow past `limit` bytes (the render then stops with
/// a write error, which `render_template` reports as the size limit).
struct CappedOutput {
    buf: Vec<u8>,
    limit: usize,
    over: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.limit {
            self.over = true;
            return Err(std::io::Error::other("chat template output over the limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Render a Jinja chat template as transformers does, within [`TEMPLATE_FUEL`] instructions and
/// [`TEMPLATE_OUTPUT_SLACK`] + 4× the messages' bytes of output.
pub fn render_template(
    tpl: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| -> String { strftime_now(&fmt) });
    // transformers' tojson: json.dumps(x, ensure_ascii=False, indent=indent)
    env.add_filter("tojson", |v: minijinja::Value, indent: Option<usize>| -> std::result::Result<String, minijinja::Error> {
        let j: Value = serde_json::to_value(&v)
            .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string()))?;
        Ok(python_json_dumps(&j, indent, 0))
    });
    env.add_template("chat", tpl).map_err(|e| anyhow!("the chat template does not parse: {e}"))?;
    let t = env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
    let ctx = minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token.unwrap_or(""),
        eos_token => eos_token.unwrap_or(""),
        tools => minijinja::Value::from(()),
    };
    let text_bytes: usize = messages.iter().map(|m| m.content.len() + m.role.len()).sum();
    let limit = TEMPLATE_OUTPUT_SLACK.saturating_add(text_bytes.saturating_mul(4));
    let mut out = CappedOutput { buf: Vec::new(), limit, over: false };
    let res = t.render_captured_to(ctx, &mut out).map(drop);
    match res {
        Ok(()) => String::from_utf8(out.buf).map_err(|_| anyhow!("the chat template produced invalid UTF-8")),
        Err(_) if out.over => bail!(
            "rendering the chat template failed: its output passed {} MiB ({} MiB + 4× the {} bytes of messages); the template is broken",
            limit >> 20,
            TEMPLATE_OUTPUT_SLACK >> 20,
            text_bytes
        ),
        Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
            bail!("rendering the chat template failed: it ran more than {TEMPLATE_FUEL} instructions (a runaway loop?)")
        }
        Err(e) => bail!("rendering the chat template failed: {e}"),
    }
}

/// `json.dumps` with Python's separators (", " and ": "), non-ASCII kept.
fn python_json_dumps(v: &Value, indent: Option<usize>, level: usize) -> String {
    let (nl, pad, pad_in) = match indent {
        Some(n) => ("\n", " ".repeat(n * level), " ".repeat(n * (level + 1))),
        None => ("", String::new(), String::new()),
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(a) if !a.is_empty() => {
            let items: Vec<String> =
                a.iter().map(|x| format!("{pad_in}{}", python_json_dumps(x, indent, level + 1))).collect();
            format!("[{nl}{}{nl}{pad}]", items.join(&format!("{item_sep}{nl}")))
        }
        Value::Object(o) if !o.is_empty() => {
            let items: Vec<String> = o
                .iter()
                .map(|(k, x)| {
                    format!("{pad_in}{}: {}", serde_json::to_string(k).unwrap_or_default(), python_json_dumps(x, indent, level + 1))
                })
                .collect();
            format!("{{{nl}{}{nl}{pad}}}", items.join(&format!("{item_sep}{nl}")))
        }
        other => serde_json::to_string(other).unwrap_or_default(),
    }
}

/// Minimal strftime for the date formats chat templates use (%d %b %Y %B %m %H %M %S).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86400);
    let rem = secs.rem_euclid(86400);
    // civil-from-days (Howard Hinnant)
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    const MON: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August",
        "September", "October", "November", "December"];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('B') => out.push_str(MON[(m - 1) as usize]),
            Some('b') => out.push_str(&MON[(m - 1) as usize][..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Parse a comma-separated id list (`1,2,3`), naming the bad entry.
pub fn parse_ids(s: &str, what: &str) -> Result<Vec<u32>> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(vec![]);
    }
    s.split(',')
        .map(|x| {
            let x = x.trim();
            x.parse::<u32>().map_err(|_| anyhow!("{what}: {x:?} is not a token id (expected non-negative integers separated by commas)"))
        })
        .collect()
}

/// Check every id is inside the vocabulary.
pub fn check_ids(ids: &[u32], vocab: usize, what: &str) -> Result<()> {
    if let Some((i, &bad)) = ids.iter().enumerate().find(|(_, &x)| x as usize >= vocab) {
        bail!("{what}: id {bad} at position {i} is outside the vocabulary (size {vocab})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trim_blocks_like_jinja2() {
        let tpl = "{% for m in messages %}\n  {% if loop.first %}[{{ m.role }}]{% endif %}\n{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}";
        let msgs = vec![ChatMessage::user("a"), ChatMessage::user("b")];
        // Jinja2 with trim_blocks+lstrip_blocks gives this (checked with jinja2 3.1).
        assert_eq!(render_template(tpl, &msgs, true, None, None).unwrap(), "[user]a\nb\n>");
    }

    #[test]
    fn python_methods_and_exceptions() {
        let tpl = "{{ messages[0].content.strip().upper() }}{% if messages|length > 1 %}{{ raise_exception('too many') }}{% endif %}";
        assert_eq!(render_template(tpl, &[ChatMessage::user("  hi ")], false, None, None).unwrap(), "HI");
        let e = render_template(tpl, &[ChatMessage::user("a"), ChatMessage::user("b")], false, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("too many"), "{e}");
    }

    #[test]
    fn tojson_like_python() {
        let v: Value = serde_json::json!({"a": [1, "é"], "b": {}});
        assert_eq!(python_json_dumps(&v, None, 0), "{\"a\": [1, \"é\"], \"b\": {}}");
    }

    #[test]
    fn ids_parse_errors_name_the_value() {
        assert_eq!(parse_ids("1, 2,3", "x").unwrap(), vec![1, 2, 3]);
        assert!(parse_ids("1,a", "--prompt-ids").unwrap_err().to_string().contains("\"a\""));
        assert!(check_ids(&[1, 600], 512, "--prompt-ids").unwrap_err().to_string().contains("600"));
    }
}
