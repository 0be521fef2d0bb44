//! The tokenizer rebuild: a byte-level BPE `tokenizer.json` (HF `tokenizers` format) from the
//! GGUF's `tokenizer.ggml.*` metadata. Only the `gpt2` tokenizer model is supported.
use super::reader::{get_str, get_usize, GgufFile, GgufValue};
use anyhow::{anyhow, bail, Result};
use serde_json::{json, Map, Value};

/// What the importer writes from the tokenizer metadata: `tokenizer.json`, and the token strings
/// (for `tokenizer_config.json` and the vocabulary-size check).
pub(super) struct TokenizerFiles {
    pub(super) tokenizer_json: Value,
    pub(super) tokens: Vec<String>,
}

fn string_array(g: &GgufFile, key: &str) -> Result<Vec<String>> {
    let v = g
        .get(key)
        .ok_or_else(|| anyhow!("{}: required metadata `{key}` is missing", g.source))?;
    let a = v
        .as_array()
        .ok_or_else(|| anyhow!("{}: `{key}` should be an array of strings", g.source))?;
    a.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_str().map(str::to_string).ok_or_else(|| {
                anyhow!(
                    "{}: `{key}`[{i}] should be a string, got {}",
                    g.source,
                    x.type_name()
                )
            })
        })
        .collect()
}

/// `tokenizer.json` from `tokenizer.ggml.*`: vocab and merges, control and user-defined tokens as
/// added tokens, and bos/eos framing when `add_bos_token`/`add_eos_token` ask for it.
pub(super) fn build_tokenizer(g: &GgufFile) -> Result<TokenizerFiles> {
    let model = get_str(g, "tokenizer.ggml.model")?.ok_or_else(|| {
        anyhow!(
            "{}: required metadata `tokenizer.ggml.model` is missing",
            g.source
        )
    })?;
    if model != "gpt2" {
        bail!(
            "{}: tokenizer model `{model}` is not supported (supported: gpt2, i.e. byte-level BPE)",
            g.source
        );
    }
    let tokens = string_array(g, "tokenizer.ggml.tokens")?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(v) => {
            let a = v.as_array().ok_or_else(|| {
                anyhow!(
                    "{}: `tokenizer.ggml.token_type` should be an array",
                    g.source
                )
            })?;
            a.iter()
                .map(|x| {
                    x.as_i64().ok_or_else(|| {
                        anyhow!(
                            "{}: `tokenizer.ggml.token_type` should hold integers",
                            g.source
                        )
                    })
                })
                .collect::<Result<_>>()?
        }
    };
    if types.len() != tokens.len() {
        bail!(
            "{}: {} token types for {} tokens",
            g.source,
            types.len(),
            tokens.len()
        );
    }
    let merges_raw = string_array(g, "tokenizer.ggml.merges")?;
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let mut parts = m.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {
                merges.push(json!([a, b]))
            }
            _ => bail!(
                "{}: merge #{i} {m:?} is not two tokens separated by a single space",
                g.source
            ),
        }
    }
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        // A duplicated token string keeps its first id (HF's vocab is a map).
        vocab.entry(t.clone()).or_insert(json!(id));
    }
    let mut added = Vec::new();
    for (id, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        // llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
        if ty == 3 || ty == 4 {
            added.push(json!({
                "id": id,
                "content": t,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": ty == 3,
            }));
        }
    }
    // Post-processor: `$A` (and `$A $B`), framed by bos/eos when the GGUF asks for them.
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let add_eos = g
        .get("tokenizer.ggml.add_eos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let special_tok = |key: &str| -> Result<(usize, String)> {
        let id = get_usize(g, key)?.ok_or_else(|| {
            anyhow!(
                "{}: `{key}` is needed (add_*_token is true) but missing",
                g.source
            )
        })?;
        let t = tokens
            .get(id)
            .ok_or_else(|| anyhow!("{}: `{key}` {id} is outside the vocabulary", g.source))?;
        Ok((id, t.clone()))
    };
    let bos = if add_bos {
        Some(special_tok("tokenizer.ggml.bos_token_id")?)
    } else {
        None
    };
    let eos = if add_eos {
        Some(special_tok("tokenizer.ggml.eos_token_id")?)
    } else {
        None
    };
    let mut specials = Map::new();
    for (id, t) in bos.iter().chain(eos.iter()) {
        specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    let frame = |seq: &str, type_id: u32| -> Vec<Value> {
        let mut v = Vec::new();
        if let Some((_, t)) = &bos {
            v.push(json!({"SpecialToken": {"id": t, "type_id": type_id}}));
        }
        v.push(json!({"Sequence": {"id": seq, "type_id": type_id}}));
        if let Some((_, t)) = &eos {
            v.push(json!({"SpecialToken": {"id": t, "type_id": type_id}}));
        }
        v
    };
    let single = frame("A", 0);
    let pair: Vec<Value> = frame("A", 0).into_iter().chain(frame("B", 1)).collect();
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });
    Ok(TokenizerFiles {
        tokenizer_json,
        tokens,
    })
}
