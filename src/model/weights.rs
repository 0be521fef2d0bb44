//! Loading an HF checkpoint's safetensors (single file or sharded with
//! `model.safetensors.index.json`), memory-mapped, converted to f32 on the host.
//!
//! The projections are fused at load time: q,k,v into one `[q+2kv, d]` matrix and gate,up into one
//! `[2i, d]` matrix, so a layer runs 4 GEMMs instead of 7 (LoRA deltas are added to column slices
//! of the fused outputs, see `runtime`).
use super::config::ModelConfig;
use crate::util::fs::stat;
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// A host tensor in f32, row-major.
#[derive(Clone, Debug, Default)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        HostTensor { shape, data }
    }
    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        HostTensor { shape, data: vec![0.0; n] }
    }
}

/// One transformer block's weights, projections fused (see module doc).
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: HostTensor,
    /// `[q_dim + 2 kv_dim, hidden]`: rows of q_proj, then k_proj, then v_proj.
    pub qkv: HostTensor,
    /// `[q_dim + 2 kv_dim]` when the architecture has q/k/v biases.
    pub qkv_bias: Option<HostTensor>,
    /// `[hidden]`: o_proj's bias (Llama-family `attention_bias = true`).
    pub o_bias: Option<HostTensor>,
    /// `(q_norm [head_dim], k_norm [head_dim])`: Qwen3's per-head q/k RMSNorm weights.
    pub qk_norm: Option<(HostTensor, HostTensor)>,
    pub o: HostTensor,
    pub mlp_norm: HostTensor,
    /// `[2 intermediate, hidden]`: rows of gate_proj, then up_proj.
    pub gate_up: HostTensor,
    pub down: HostTensor,
}

#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub embed: HostTensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: HostTensor,
    /// `None` when the head is tied to the embeddings.
    pub lm_head: Option<HostTensor>,
}

/// The memory-mapped safetensors files of a checkpoint, with the name → file map.
pub struct SafetensorsSet {
    maps: Vec<(PathBuf, Mmap)>,
    index: HashMap<String, usize>,
}

impl SafetensorsSet {
    /// Open `model.safetensors`, or the shards listed by `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if stat(&index_path)?.is_some() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| anyhow!("{} has no \"weight_map\" object", index_path.display()))?;
            let mut names: Vec<&str> = Vec::with_capacity(map.len());
            for (tensor, file) in map {
                let name = file.as_str().ok_or_else(|| {
                    anyhow!("{}: weight_map[{tensor:?}] must be a file name, got {file}", index_path.display())
                })?;
                // transformers joins the name to the model directory: only plain relative names
                // (no `..`, no absolute path) stay inside it. Reading files elsewhere is refused.
                let inside = !name.is_empty()
                    && Path::new(name).components().all(|c| matches!(c, std::path::Component::Normal(_)));
                if !inside {
                    bail!(
                        "{}: weight_map[{tensor:?}] names {name:?}, which is not a file inside {} (shard names must be relative, without \"..\")",
                        index_path.display(),
                        dir.display()
                    );
                }
                names.push(name);
            }
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if stat(&single)?.is_some() {
            vec![single]
        } else {
            bail!(
                "no weights in {}: expected model.safetensors or model.safetensors.index.json",
                dir.display()
            );
        };
        Self::open_files(&files)
    }

    pub fn open_files(files: &[PathBuf]) -> Result<Self> {
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            stat(path)?; // a symlink loop is named as such, not as an open failure
            // a directory, FIFO or device: a clear error, not "No such device" or a blocked open
            crate::util::fs::check_regular_file(path, "weights file")?;
            let f = File::open(path).with_context(|| format!("cannot open weights file {}", path.display()))?;
            // Safety: the file is opened read-only; we never hand out references past the Mmap's life.
            let map = unsafe { Mmap::map(&f) }.with_context(|| format!("cannot mmap {}", path.display()))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| {
                anyhow!("{} is not a valid safetensors file: {e}", path.display())
            })?;
            for name in st.names() {
                index.insert(name.to_string(), i);
            }
            maps.push((path.clone(), map));
        }
        Ok(SafetensorsSet { maps, index })
    }

    /// Drop the mapped pages read so far from this process's resident memory (they stay in the
    /// page cache; a later read faults them back in). Loading calls it after each layer, so the
    /// checkpoint's bytes are not resident beside the converted weights.
    pub fn release_pages(&self) {
        for (_, map) in &self.maps {
            // Safety: a read-only file mapping: DONTNEED only drops clean pages, whose contents
            // a later access reads back from the file; no reference into them is live here.
            let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(|s| s.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Read tensor `name` as f32, checking its shape against `expect` (when given).
    pub fn get_f32(&self, name: &str, expect: Option<&[usize]>) -> Result<HostTensor> {
        let &fi = self.index.get(name).ok_or_else(|| {
            let files: Vec<String> = self.maps.iter().map(|(p, _)| p.display().to_string()).collect();
            anyhow!("tensor {name} not found in {}", files.join(", "))
        })?;
        let (path, map) = &self.maps[fi];
        let st = SafeTensors::deserialize(map).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let view = st.tensor(name).map_err(|e| anyhow!("{}: tensor {name}: {e}", path.display()))?;
        let shape = view.shape().to_vec();
        if let Some(e) = expect {
            if shape != e {
                bail!(
                    "tensor {name} in {} has shape {:?}, expected {:?} (from config.json / the base model)",
                    path.display(),
                    shape,
                    e
                );
            }
        }
        let bytes = view.data();
        let data = decode_f32(view.dtype(), bytes)
            .with_context(|| format!("tensor {name} in {}", path.display()))?;
        Ok(HostTensor { shape, data })
    }
}

/// Convert raw little-endian bytes of a float dtype to f32.
pub fn decode_f32(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => bail!("dtype {other:?} is not supported (F32, F16 or BF16)"),
    })
}

fn concat_rows(parts: Vec<HostTensor>) -> HostTensor {
    let cols = parts[0].shape.get(1).copied();
    let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
    let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
    for p in parts {
        data.extend_from_slice(&p.data);
    }
    let shape = match cols {
        Some(c) => vec![rows, c],
        None => vec![rows],
    };
    HostTensor { shape, data }
}

impl ModelWeights {
    pub fn load(dir: &Path, cfg: &ModelConfig) -> Result<Self> {
        let set = SafetensorsSet::open_dir(dir)?;
        Self::from_set(&set, cfg).with_context(|| format!("loading weights from {}", dir.display()))
    }

    pub fn from_set(set: &SafetensorsSet, cfg: &ModelConfig) -> Result<Self> {
        Self::check_unused(set, cfg)?;
        let embed = Self::embed(set, cfg)?;
        let layers = (0..cfg.n_layers).map(|l| Self::layer(set, cfg, l)).collect::<Result<Vec<_>>>()?;
        let (final_norm, lm_head) = Self::final_norm_and_head(set, cfg)?;
        Ok(ModelWeights { embed, layers, final_norm, lm_head })
    }

    /// The token embeddings `[vocab, hidden]`.
    pub fn embed(set: &SafetensorsSet, cfg: &ModelConfig) -> Result<HostTensor> {
        set.get_f32("model.embed_tokens.weight", Some(&[cfg.vocab, cfg.hidden]))
    }

    /// The final norm and the untied head (`None` when tied to the embeddings).
    pub fn final_norm_and_head(set: &SafetensorsSet, cfg: &ModelConfig) -> Result<(HostTensor, Option<HostTensor>)> {
        let d = cfg.hidden;
        let final_norm = set.get_f32("model.norm.weight", Some(&[d]))?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else if set.contains("lm_head.weight") {
            Some(set.get_f32("lm_head.weight", Some(&[cfg.vocab, d]))?)
        } else {
            bail!("lm_head.weight is missing and config.json does not set tie_word_embeddings = true");
        };
        Ok((final_norm, lm_head))
    }

    /// Layer `l`'s tensors, q/k/v and gate/up fused.
    pub fn layer(set: &SafetensorsSet, cfg: &ModelConfig, l: usize) -> Result<LayerWeights> {
        let (d, q, kv, i) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        let p = format!("model.layers.{l}");
        let g = |n: &str, s: &[usize]| set.get_f32(&format!("{p}.{n}"), Some(s));
        let qkv = concat_rows(vec![
            g("self_attn.q_proj.weight", &[q, d])?,
            g("self_attn.k_proj.weight", &[kv, d])?,
            g("self_attn.v_proj.weight", &[kv, d])?,
        ]);
        let qkv_bias = if cfg.qkv_bias {
            Some(concat_rows(vec![
                g("self_attn.q_proj.bias", &[q])?,
                g("self_attn.k_proj.bias", &[kv])?,
                g("self_attn.v_proj.bias", &[kv])?,
            ]))
        } else {
            None
        };
        let o_bias = if cfg.o_bias { Some(g("self_attn.o_proj.bias", &[d])?) } else { None };
        let qk_norm = if cfg.qk_norm {
            Some((g("self_attn.q_norm.weight", &[cfg.head_dim])?, g("self_attn.k_norm.weight", &[cfg.head_dim])?))
        } else {
            None
        };
        Ok(LayerWeights {
            attn_norm: g("input_layernorm.weight", &[d])?,
            qkv,
            qkv_bias,
            o_bias,
            qk_norm,
            o: g("self_attn.o_proj.weight", &[d, q])?,
            mlp_norm: g("post_attention_layernorm.weight", &[d])?,
            gate_up: concat_rows(vec![g("mlp.gate_proj.weight", &[i, d])?, g("mlp.up_proj.weight", &[i, d])?]),
            down: g("mlp.down_proj.weight", &[d, i])?,
        })
    }

    /// Refuse a checkpoint with tensors the config does not describe (checked before any load).
    pub fn check_unused(set: &SafetensorsSet, cfg: &ModelConfig) -> Result<()> {
        // A tensor nothing above read is a part of the model the engine does not compute (a bias,
        // a norm, an extra block): running without it would give silently wrong outputs.
        let used = |n: &str| -> bool {
            let Some(rest) = n.strip_prefix("model.layers.") else {
                return matches!(n, "model.embed_tokens.weight" | "model.norm.weight" | "lm_head.weight");
            };
            let Some((l, t)) = rest.split_once('.') else { return false };
            if !l.parse::<usize>().is_ok_and(|l| l < cfg.n_layers) {
                return false;
            }
            let proj = ["q_proj", "k_proj", "v_proj", "o_proj"].iter().any(|p| t == format!("self_attn.{p}.weight"))
                || ["gate_proj", "up_proj", "down_proj"].iter().any(|p| t == format!("mlp.{p}.weight"))
                || matches!(t, "input_layernorm.weight" | "post_attention_layernorm.weight");
            let qkv_b = cfg.qkv_bias && ["q_proj", "k_proj", "v_proj"].iter().any(|p| t == format!("self_attn.{p}.bias"));
            let o_b = cfg.o_bias && t == "self_attn.o_proj.bias";
            let qk = cfg.qk_norm && matches!(t, "self_attn.q_norm.weight" | "self_attn.k_norm.weight");
            // RoPE tables some exporters store: recomputed from the config
            proj || qkv_b || o_b || qk || t.ends_with("rotary_emb.inv_freq")
        };
        let mut unused: Vec<&str> = set.names().filter(|n| !used(n)).collect();
        if !unused.is_empty() {
            unused.sort();
            let n = unused.len();
            unused.truncate(5);
            bail!(
                "the checkpoint has {n} tensor(s) the {} implementation does not use, e.g. {}: config.json does not describe these weights (a bias, norm or layer this engine does not compute), so the outputs would be wrong",
                cfg.arch.name(),
                unused.join(", ")
            );
        }
        Ok(())
    }

    /// The unfused HF tensors (for merge/export): name → tensor.
    pub fn to_hf(&self, cfg: &ModelConfig) -> BTreeMap<String, HostTensor> {
        let (d, q, kv, i) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        let rows = |t: &HostTensor, a: usize, b: usize, cols: usize| {
            HostTensor::new(vec![b - a, cols], t.data[a * cols..b * cols].to_vec())
        };
        let vecpart = |t: &HostTensor, a: usize, b: usize| HostTensor::new(vec![b - a], t.data[a..b].to_vec());
        let mut m = BTreeMap::new();
        m.insert("model.embed_tokens.weight".into(), self.embed.clone());
        for (l, w) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            m.insert(format!("{p}.input_layernorm.weight"), w.attn_norm.clone());
            m.insert(format!("{p}.self_attn.q_proj.weight"), rows(&w.qkv, 0, q, d));
            m.insert(format!("{p}.self_attn.k_proj.weight"), rows(&w.qkv, q, q + kv, d));
            m.insert(format!("{p}.self_attn.v_proj.weight"), rows(&w.qkv, q + kv, q + 2 * kv, d));
            if let Some(b) = &w.qkv_bias {
                m.insert(format!("{p}.self_attn.q_proj.bias"), vecpart(b, 0, q));
                m.insert(format!("{p}.self_attn.k_proj.bias"), vecpart(b, q, q + kv));
                m.insert(format!("{p}.self_attn.v_proj.bias"), vecpart(b, q + kv, q + 2 * kv));
            }
            if let Some(b) = &w.o_bias {
                m.insert(format!("{p}.self_attn.o_proj.bias"), b.clone());
            }
            if let Some((qn, kn)) = &w.qk_norm {
                m.insert(format!("{p}.self_attn.q_norm.weight"), qn.clone());
                m.insert(format!("{p}.self_attn.k_norm.weight"), kn.clone());
            }
            m.insert(format!("{p}.self_attn.o_proj.weight"), w.o.clone());
            m.insert(format!("{p}.post_attention_layernorm.weight"), w.mlp_norm.clone());
            m.insert(format!("{p}.mlp.gate_proj.weight"), rows(&w.gate_up, 0, i, d));
            m.insert(format!("{p}.mlp.up_proj.weight"), rows(&w.gate_up, i, 2 * i, d));
            m.insert(format!("{p}.mlp.down_proj.weight"), w.down.clone());
        }
        m.insert("model.norm.weight".into(), self.final_norm.clone());
        if let Some(h) = &self.lm_head {
            m.insert("lm_head.weight".into(), h.clone());
        }
        m
    }
}

/// Write f32 tensors as a safetensors file, atomically (temp file + rename).
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    use safetensors::tensor::TensorView;
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(k, t)| (k.clone(), bytemuck::cast_slice::<f32, u8>(&t.data).to_vec(), t.shape.clone()))
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(k, b, s)| Ok((k.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<std::result::Result<_, safetensors::SafeTensorError>>()?;
    let data = safetensors::serialize(views, metadata)?;
    crate::util::fs::write_atomic(path, &data)
}
