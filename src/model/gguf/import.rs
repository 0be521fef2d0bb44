//! The importer: validates the whole GGUF (architecture, tokenizer, tensor names, types and
//! shapes), then writes the HF directory file by file, each atomically, `config.json` last.
use super::names::{hf_llama_name, llama_config_json, llama_hparams, llama_tensor_shapes, unpermute_qk_rows, Permute};
use super::reader::{get_str, get_usize, GgufFile, GgufTensorInfo};
use super::tokenizer::build_tokenizer;
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What [`import_gguf`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportSummary {
    /// Tensors written to `model.safetensors`.
    pub tensors: usize,
    /// Total number of parameters (f32 values) written.
    pub params: usize,
    /// The GGUF's `general.architecture`.
    pub arch: String,
}

impl fmt::Display for ImportSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tensors, {} parameters, architecture {}",
            self.tensors, self.params, self.arch
        )
    }
}

/// Architectures [`import_gguf`] can convert.
pub const SUPPORTED_ARCHS: &[&str] = &["llama"];

// ---------------------------------------------------------------------------------------------
// Atomic writes
// ---------------------------------------------------------------------------------------------

// Not `crate::util::fs::write_atomic` (one byte buffer, also syncs the directory): safetensors
// streams `model.safetensors` into the temp file by path.

/// Create the temp file for `path` exclusively (`O_EXCL`) under an unpredictable name,
/// `.NAME.tmp-PID-RANDOM` (crate::util::fs::unique_suffix), retrying on a collision: a symlink
/// planted where a temp file will appear is never followed.
fn create_tmp(path: &Path) -> Result<(PathBuf, File)> {
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    for _ in 0..64 {
        let tmp = path.with_file_name(format!(".{name}.tmp-{}", crate::util::fs::unique_suffix()));
        match fs::OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create {}", tmp.display())),
        }
    }
    bail!("cannot create a temp file next to {}: every name tried was taken", path.display())
}

/// The path a writer should open to reach `file`: on Linux its own descriptor
/// (`/proc/self/fd/N`), so the write lands in the file created above even if its name were
/// swapped for a symlink in between; elsewhere `tmp`.
fn open_path(file: &File, tmp: &Path) -> PathBuf {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::io::AsRawFd;
        let p = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        if p.exists() {
            return p;
        }
    }
    let _ = file;
    tmp.to_path_buf()
}

/// Create `path` atomically: `write` fills a new temp file in the same directory (given the
/// path to open), which is synced and renamed over `path`; on failure the temp file is removed.
fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let (tmp, file) = create_tmp(path)?;
    let r = write(&open_path(&file, &tmp))
        .with_context(|| format!("cannot write {}", tmp.display()))
        .and_then(|_| {
            file.sync_all()
                .with_context(|| format!("cannot sync {}", tmp.display()))?;
            fs::rename(&tmp, path)
                .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
        });
    if r.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    r
}

fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| {
        let mut f =
            File::create(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        Ok(())
    })
}

fn write_json_atomic(path: &Path, v: &Value) -> Result<()> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    write_bytes_atomic(path, s.as_bytes())
}

/// transformers' `VERY_LARGE_INTEGER` (`int(1e30)`), written as an exact integer like HF does.
const MODEL_MAX_LENGTH_PLACEHOLDER: &str = "@@infomem:model_max_length@@";
const VERY_LARGE_INTEGER: &str = "1000000000000000019884624838656";

/// Read a GGUF file (v2/v3) and write an HF model directory: config.json, model.safetensors (f32),
/// tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json.
///
/// Everything is validated (architecture, tokenizer, tensor names, types, shapes) before the first
/// file is written. Each file is written atomically; `model.safetensors` is written last but one
/// and `config.json` last, and a `config.json` (and `.import-ok` marker) left by an earlier import
/// is removed first, so an interrupted import never leaves a directory that looks complete.
pub fn import_gguf(gguf: &Path, out_dir: &Path) -> Result<ImportSummary> {
    import_gguf_with(gguf, out_dir, &mut || Ok(()))
}

/// [`import_gguf`], calling `before_write` once the whole file has been checked and before
/// anything is written (the CLI clears an `--overwrite`n directory there, so a file that fails
/// its checks leaves the old model whole).
pub fn import_gguf_with(gguf: &Path, out_dir: &Path, before_write: &mut dyn FnMut() -> Result<()>) -> Result<ImportSummary> {
    let g = GgufFile::open(gguf)?;
    let src = g.source.clone();

    let arch = get_str(&g, "general.architecture")?
        .ok_or_else(|| anyhow!("{src}: required metadata `general.architecture` is missing"))?
        .to_string();
    if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
        bail!(
            "{src}: unsupported architecture `{arch}` (supported: {})",
            SUPPORTED_ARCHS.join(", ")
        );
    }

    let tok = build_tokenizer(&g)?;
    let hp = llama_hparams(&g, &arch, tok.tokens.len())?;
    if hp.vocab != tok.tokens.len() {
        bail!(
            "{src}: {arch}.vocab_size {} differs from the {} tokens of the tokenizer",
            hp.vocab,
            tok.tokens.len()
        );
    }

    // Map and check every tensor before writing anything.
    let mut plan: Vec<(&GgufTensorInfo, String, Permute)> = Vec::with_capacity(g.tensors.len());
    for t in &g.tensors {
        let (hf, p) = hf_llama_name(&t.name).ok_or_else(|| {
            anyhow!(
                "{src}: tensor `{}` has no HF Llama equivalent (unexpected for `{arch}`)",
                t.name
            )
        })?;
        g.tensor_type(t)?;
        plan.push((t, hf, p));
    }
    let have: HashMap<&str, &GgufTensorInfo> =
        plan.iter().map(|(t, hf, _)| (hf.as_str(), *t)).collect();
    let tied = !have.contains_key("lm_head.weight");
    let expect = llama_tensor_shapes(&hp, tied);
    for (name, shape) in &expect {
        let t = have
            .get(name.as_str())
            .ok_or_else(|| anyhow!("{src}: tensor for `{name}` is missing"))?;
        if &t.hf_shape() != shape {
            bail!(
                "{src}: tensor `{}` ({name}) has HF shape {:?}, expected {shape:?}",
                t.name,
                t.hf_shape()
            );
        }
    }
    if expect.len() != plan.len() {
        let known: BTreeSet<&str> = expect.iter().map(|(n, _)| n.as_str()).collect();
        let extra: Vec<&str> = plan
            .iter()
            .filter(|(_, hf, _)| !known.contains(hf.as_str()))
            .map(|(t, _, _)| t.name.as_str())
            .collect();
        bail!(
            "{src}: unexpected tensors for {} layers: {extra:?}",
            hp.layers
        );
    }

    // Token ids for the configs.
    let id_of = |key: &str| -> Result<Option<usize>> {
        let id = get_usize(&g, key)?;
        if let Some(id) = id {
            if id >= tok.tokens.len() {
                bail!(
                    "{src}: `{key}` = {id} is outside the vocabulary of {}",
                    tok.tokens.len()
                );
            }
        }
        Ok(id)
    };
    let bos = id_of("tokenizer.ggml.bos_token_id")?;
    let eos = id_of("tokenizer.ggml.eos_token_id")?;
    let pad = id_of("tokenizer.ggml.padding_token_id")?;
    let unk = id_of("tokenizer.ggml.unknown_token_id")?;
    let chat_template = get_str(&g, "tokenizer.chat_template")?;

    before_write()?;
    // Output directory: make sure it can't look complete while we write.
    fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create output directory {}", out_dir.display()))?;
    for stale in ["config.json", ".import-ok"] {
        let p = out_dir.join(stale);
        if p.exists() {
            fs::remove_file(&p).with_context(|| format!("cannot remove stale {}", p.display()))?;
        }
    }

    // Tokenizer files.
    write_json_atomic(&out_dir.join("tokenizer.json"), &tok.tokenizer_json)?;
    let mut tc = Map::new();
    tc.insert("backend".into(), json!("tokenizers"));
    tc.insert("tokenizer_class".into(), json!("TokenizersBackend"));
    tc.insert(
        "model_max_length".into(),
        json!(MODEL_MAX_LENGTH_PLACEHOLDER),
    );
    for (k, id) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("pad_token", pad),
        ("unk_token", unk),
    ] {
        if let Some(id) = id {
            tc.insert(k.into(), json!(tok.tokens[id]));
        }
    }
    let tc_text = serde_json::to_string_pretty(&Value::Object(tc))?.replace(
        &format!("\"{MODEL_MAX_LENGTH_PLACEHOLDER}\""),
        VERY_LARGE_INTEGER,
    ) + "\n";
    write_bytes_atomic(&out_dir.join("tokenizer_config.json"), tc_text.as_bytes())?;
    let ct_path = out_dir.join("chat_template.jinja");
    match chat_template {
        Some(t) => write_bytes_atomic(&ct_path, t.as_bytes())?,
        None => {
            if ct_path.exists() {
                fs::remove_file(&ct_path)
                    .with_context(|| format!("cannot remove stale {}", ct_path.display()))?;
            }
        }
    }
    let mut gc = Map::new();
    for (k, id) in [
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("pad_token_id", pad),
    ] {
        if let Some(id) = id {
            gc.insert(k.into(), json!(id));
        }
    }
    write_json_atomic(&out_dir.join("generation_config.json"), &Value::Object(gc))?;

    // Weights: dequantize (in parallel), un-permute Q/K, write f32 safetensors.
    let (n_head, n_head_kv) = (hp.n_head, hp.n_head_kv);
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = plan
        .par_iter()
        .map(|(t, hf, p)| {
            let mut data = g.tensor_f32(t)?;
            let shape = t.hf_shape();
            let cols = shape.last().copied().unwrap_or(1);
            match p {
                Permute::None => {}
                Permute::Q => {
                    data = unpermute_qk_rows(&data, n_head, cols)
                        .with_context(|| format!("{src}: `{}`", t.name))?
                }
                Permute::K => {
                    data = unpermute_qk_rows(&data, n_head_kv, cols)
                        .with_context(|| format!("{src}: `{}`", t.name))?
                }
            }
            Ok((hf.clone(), shape, data))
        })
        .collect::<Result<_>>()?;
    let params: usize = tensors.iter().map(|(_, _, d)| d.len()).sum();
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                shape.clone(),
                bytemuck::cast_slice(data),
            )
            .map(|v| (name.clone(), v))
            .map_err(|e| anyhow!("tensor {name}: {e}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let st_path = out_dir.join("model.safetensors");
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    write_atomic_with(&st_path, |tmp| {
        safetensors::tensor::serialize_to_file(views, Some(meta), tmp)
            .map_err(|e| anyhow!("cannot write {}: {e}", tmp.display()))
    })?;
    drop(tensors);

    // config.json last: its presence marks a complete directory.
    let mut cfg = llama_config_json(&hp, tied);
    let obj = cfg.as_object_mut().unwrap();
    for (k, id) in [
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("pad_token_id", pad),
        ("unk_token_id", unk),
    ] {
        if let Some(id) = id {
            obj.insert(k.into(), json!(id));
        }
    }
    if let Some(name) = get_str(&g, "general.name")? {
        obj.insert("_model_name_or_path".into(), json!(name));
    }
    write_json_atomic(&out_dir.join("config.json"), &cfg)?;

    Ok(ImportSummary {
        tensors: plan.len(),
        params,
        arch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::reader::GgufValue;
    use crate::model::gguf::test_builders::{build, f32s, kv, q4_1, q8_0, s, tmpdir, T};

    /// A 1-layer llama: hidden 32, 4 heads of 8, 2 kv heads, ffn 64, vocab 32 (byte-level tokens).
    fn tiny_llama(ty_unknown: Option<u32>) -> (Vec<u8>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (hidden, ffn, vocab) = (32usize, 64usize, 32usize);
        let mut tokens: Vec<String> = vec![
            "<|endoftext|>".into(),
            "<|im_start|>".into(),
            "<|im_end|>".into(),
            "<tool>".into(),
        ];
        for c in "abcdefghijklmnopqrstuvwxyz".chars().take(vocab - 6) {
            tokens.push(c.to_string());
        }
        tokens.push("Ġ".into());
        tokens.push("ab".into());
        assert_eq!(tokens.len(), vocab);
        let types: Vec<GgufValue> = (0..vocab)
            .map(|i| {
                GgufValue::I32(if i < 3 {
                    3
                } else if i == 3 {
                    4
                } else {
                    1
                })
            })
            .collect();
        let kvs = vec![
            kv("general.architecture", s("llama")),
            kv("general.name", s("tiny")),
            kv("llama.block_count", GgufValue::U32(1)),
            kv("llama.context_length", GgufValue::U32(128)),
            kv("llama.embedding_length", GgufValue::U32(hidden as u32)),
            kv("llama.feed_forward_length", GgufValue::U32(ffn as u32)),
            kv("llama.attention.head_count", GgufValue::U32(4)),
            kv("llama.attention.head_count_kv", GgufValue::U32(2)),
            kv("llama.rope.freq_base", GgufValue::F32(10000.0)),
            kv(
                "llama.attention.layer_norm_rms_epsilon",
                GgufValue::F32(1e-5),
            ),
            kv("llama.vocab_size", GgufValue::U32(vocab as u32)),
            kv("tokenizer.ggml.model", s("gpt2")),
            kv(
                "tokenizer.ggml.tokens",
                GgufValue::Array(tokens.iter().map(|t| s(t)).collect()),
            ),
            kv("tokenizer.ggml.token_type", GgufValue::Array(types)),
            kv("tokenizer.ggml.merges", GgufValue::Array(vec![s("a b")])),
            kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1)),
            kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2)),
            kv("tokenizer.ggml.padding_token_id", GgufValue::U32(2)),
            kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(0)),
            kv(
                "tokenizer.chat_template",
                s("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"),
            ),
        ];
        let blocks_q41 = |rows: usize, seed: u32| -> (Vec<u8>, Vec<f32>) {
            let mut bl = Vec::new();
            let mut vals = Vec::new();
            for r in 0..rows {
                let d = 0.015625 * (1 + (r as u32 + seed) % 5) as f32;
                let m = -0.0625 * ((r as u32 * 3 + seed) % 7) as f32;
                let mut q = [0u8; 32];
                for (j, x) in q.iter_mut().enumerate() {
                    *x = ((j as u32 * 5 + r as u32 * 3 + seed) % 16) as u8;
                }
                let dd = half::f16::from_f32(d).to_f32();
                let mm = half::f16::from_f32(m).to_f32();
                vals.extend(q.iter().map(|&x| x as f32 * dd + mm));
                bl.push((d, m, q));
            }
            (q4_1(&bl), vals)
        };
        let (q_raw, q_vals) = blocks_q41(32, 1); // [32 rows, 32 cols]
        let (k_raw, k_vals) = blocks_q41(16, 2); // [16 rows, 32 cols]
        let mut emb_blocks = Vec::new();
        let mut emb_vals = Vec::new();
        for r in 0..vocab {
            let mut q = [0i8; 32];
            for (j, x) in q.iter_mut().enumerate() {
                *x = ((j as i32 * 11 + r as i32 * 13) % 255 - 127) as i8;
            }
            let d = 0.01 * (r + 1) as f32;
            let dd = half::f16::from_f32(d).to_f32();
            emb_vals.extend(q.iter().map(|&x| x as f32 * dd));
            emb_blocks.push((d, q));
        }
        let f = |n: usize, base: f32| {
            f32s(&(0..n).map(|i| base + i as f32 * 0.001).collect::<Vec<_>>())
        };
        let mut t = vec![
            T {
                name: "token_embd.weight".into(),
                dims: vec![hidden as u64, vocab as u64],
                ty: 8,
                data: q8_0(&emb_blocks),
            },
            T {
                name: "blk.0.attn_norm.weight".into(),
                dims: vec![hidden as u64],
                ty: 0,
                data: f(hidden, 1.0),
            },
            T {
                name: "blk.0.attn_q.weight".into(),
                dims: vec![hidden as u64, 32],
                ty: 3,
                data: q_raw,
            },
            T {
                name: "blk.0.attn_k.weight".into(),
                dims: vec![hidden as u64, 16],
                ty: 3,
                data: k_raw,
            },
            T {
                name: "blk.0.attn_v.weight".into(),
                dims: vec![hidden as u64, 16],
                ty: 0,
                data: f(16 * hidden, 0.1),
            },
            T {
                name: "blk.0.attn_output.weight".into(),
                dims: vec![32, hidden as u64],
                ty: 0,
                data: f(32 * hidden, 0.2),
            },
            T {
                name: "blk.0.ffn_norm.weight".into(),
                dims: vec![hidden as u64],
                ty: 0,
                data: f(hidden, 0.9),
            },
            T {
                name: "blk.0.ffn_gate.weight".into(),
                dims: vec![hidden as u64, ffn as u64],
                ty: 0,
                data: f(ffn * hidden, 0.3),
            },
            T {
                name: "blk.0.ffn_up.weight".into(),
                dims: vec![hidden as u64, ffn as u64],
                ty: 0,
                data: f(ffn * hidden, 0.4),
            },
            T {
                name: "blk.0.ffn_down.weight".into(),
                dims: vec![ffn as u64, hidden as u64],
                ty: 0,
                data: f(ffn * hidden, 0.5),
            },
            T {
                name: "output_norm.weight".into(),
                dims: vec![hidden as u64],
                ty: 0,
                data: f(hidden, 1.1),
            },
        ];
        if let Some(ty) = ty_unknown {
            t[5].ty = ty;
        }
        (build(3, &kvs, &t, 32), emb_vals, q_vals, k_vals)
    }

    #[test]
    fn imports_a_tiny_llama() {
        let dir = tmpdir("tiny");
        let p = dir.join("tiny.gguf");
        let (bytes, emb, q_stored, k_stored) = tiny_llama(None);
        fs::write(&p, bytes).unwrap();
        let out = dir.join("hf");
        let sum = import_gguf(&p, &out).unwrap();
        assert_eq!(sum.arch, "llama");
        assert_eq!(sum.tensors, 11);
        assert_eq!(
            sum.params,
            32 * 32 + 32 * 3 + 32 * 32 + 16 * 32 * 2 + 32 * 32 + 64 * 32 * 3
        );

        let st_bytes = fs::read(out.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
        let get = |n: &str| -> (Vec<usize>, Vec<f32>) {
            let t = st.tensor(n).unwrap();
            assert_eq!(t.dtype(), safetensors::Dtype::F32);
            (
                t.shape().to_vec(),
                t.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            )
        };
        let (sh, e) = get("model.embed_tokens.weight");
        assert_eq!(sh, vec![32, 32]);
        assert_eq!(e, emb);
        let (sh, q) = get("model.layers.0.self_attn.q_proj.weight");
        assert_eq!(sh, vec![32, 32]);
        // 4 heads of 8 rows: HF row 1 of head 0 is stored row 2, HF row 4 is stored row 1.
        assert_eq!(q[32..64], q_stored[64..96]);
        assert_eq!(q[4 * 32..5 * 32], q_stored[32..64]);
        assert_eq!(q, unpermute_qk_rows(&q_stored, 4, 32).unwrap());
        let (sh, k) = get("model.layers.0.self_attn.k_proj.weight");
        assert_eq!(sh, vec![16, 32]);
        assert_eq!(k, unpermute_qk_rows(&k_stored, 2, 32).unwrap());
        assert_ne!(k, k_stored);
        let (sh, _) = get("model.layers.0.mlp.down_proj.weight");
        assert_eq!(sh, vec![32, 64]);
        let (sh, n) = get("model.norm.weight");
        assert_eq!(sh, vec![32]);
        assert_eq!(n[1], 1.1 + 0.001);
        assert!(st.tensor("lm_head.weight").is_err());

        let cfg: Value =
            serde_json::from_slice(&fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["model_type"], "llama");
        assert_eq!(cfg["head_dim"], 8);
        assert_eq!(cfg["num_key_value_heads"], 2);
        assert_eq!(cfg["tie_word_embeddings"], true);
        assert_eq!(cfg["rms_norm_eps"].as_f64().unwrap(), 1e-5f32 as f64);
        assert_eq!(cfg["rope_parameters"]["rope_theta"], 10000.0);
        assert_eq!(cfg["pad_token_id"], 2);
        let gc: Value =
            serde_json::from_slice(&fs::read(out.join("generation_config.json")).unwrap()).unwrap();
        assert_eq!(
            gc,
            json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
        );
        let tc_text = fs::read_to_string(out.join("tokenizer_config.json")).unwrap();
        assert!(
            tc_text.contains("\"model_max_length\": 1000000000000000019884624838656"),
            "{tc_text}"
        );
        let tc: Value = serde_json::from_str(&tc_text).unwrap();
        assert_eq!(tc["bos_token"], "<|im_start|>");
        assert_eq!(tc["unk_token"], "<|endoftext|>");
        assert_eq!(
            fs::read_to_string(out.join("chat_template.jinja")).unwrap(),
            "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        );

        let tk = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        let enc = tk.encode("<|im_start|>ab c<tool>", false).unwrap();
        // "ab" merges; " c" is "Ġ" + "c"; specials are matched whole.
        assert_eq!(enc.get_ids(), &[1, 31, 30, 6, 3]);
        let tj: Value =
            serde_json::from_slice(&fs::read(out.join("tokenizer.json")).unwrap()).unwrap();
        assert_eq!(tj["added_tokens"][3]["special"], false);
        assert_eq!(tj["added_tokens"][2]["special"], true);

        // No temp files left behind.
        for e in fs::read_dir(&out).unwrap() {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!n.contains(".tmp-"), "{n}");
        }

        // A failing re-import (unsupported tensor type) is refused before anything is written: the
        // previous complete import stays as it was.
        let (bytes, ..) = tiny_llama(Some(13));
        fs::write(&p, bytes).unwrap();
        let e = format!("{:#}", import_gguf(&p, &out).unwrap_err());
        assert!(
            e.contains("blk.0.attn_output.weight") && e.contains("13 (Q5_K)"),
            "{e}"
        );
        assert!(out.join("config.json").exists());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn atomic_writes_do_not_follow_a_planted_symlink() {
        let dir = tmpdir("symlink");
        let victim = dir.join("victim");
        fs::write(&victim, "keep").unwrap();
        // the name the old code opened with O_TRUNC: `.NAME.tmp-PID`
        for name in ["config.json", "model.safetensors"] {
            std::os::unix::fs::symlink(&victim, dir.join(format!(".{name}.tmp-{}", std::process::id()))).unwrap();
        }
        write_bytes_atomic(&dir.join("config.json"), b"{}").unwrap();
        write_atomic_with(&dir.join("model.safetensors"), |tmp| {
            let data = [1.0f32, 2.0];
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], bytemuck::cast_slice(&data)).unwrap();
            safetensors::tensor::serialize_to_file(vec![("t", v)], None, tmp).map_err(|e| anyhow!("{e}"))
        })
        .unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep");
        for name in ["config.json", "model.safetensors"] {
            assert!(fs::symlink_metadata(dir.join(name)).unwrap().file_type().is_file(), "{name}");
        }
        assert_eq!(fs::read_to_string(dir.join("config.json")).unwrap(), "{}");
        let _ = fs::remove_dir_all(&dir);
    }
}
