//! `config.json` of an HF model directory, reduced to what this transformer needs.
//!
//! Supports Llama (SmolLM2, Llama 3.x; tied or untied head) and Qwen2 (Qwen2.5: q/k/v biases).
//! Both the classic top-level `rope_theta`/`rope_scaling` and transformers 5's `rope_parameters`
//! block are read. Anything else is refused with a message naming what was found.
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
}

/// RoPE frequency scaling. `Llama3` is the piecewise rescaling of Llama 3.1+.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f64 },
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position: f64 },
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2 always; Llama when `attention_bias`).
    pub qkv_bias: bool,
    pub max_position: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        super::weights::stat(&path)?; // a symlink loop is named as such
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("cannot read {} (is {} an HF model directory?)", path.display(), dir.display())
        })?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&v).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_json(v: &Value) -> Result<Self> {
        let model_type = opt_str(v, "model_type")?.unwrap_or("");
        let archs: Vec<&str> = v
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let arch = match model_type {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "" if archs.iter().any(|a| *a == "LlamaForCausalLM") => Arch::Llama,
            "" if archs.iter().any(|a| *a == "Qwen2ForCausalLM") => Arch::Qwen2,
            other => bail!(
                "unsupported architecture: model_type {:?} (architectures {:?}); supported: llama, qwen2",
                other,
                archs
            ),
        };
        // Sizes are positive integers: 0 would give empty matrices and a model that silently
        // outputs nothing useful.
        let get_usize = |k: &str| -> Result<usize> {
            let x = v.get(k).with_context(|| format!("missing field {k:?}"))?;
            match x.as_u64() {
                Some(n) if n > 0 => Ok(n as usize),
                _ => bail!("field {k:?} must be a positive integer, got {x}"),
            }
        };
        let hidden = get_usize("hidden_size")?;
        let n_heads = get_usize("num_attention_heads")?;
        let n_kv_heads = match field(v, "num_key_value_heads") {
            None => n_heads,
            Some(_) => get_usize("num_key_value_heads")?,
        };
        let head_dim = match field(v, "head_dim") {
            None => {
                if hidden % n_heads != 0 {
                    bail!("hidden_size {hidden} is not divisible by num_attention_heads {n_heads}");
                }
                hidden / n_heads
            }
            Some(_) => get_usize("head_dim")?,
        };
        if n_heads % n_kv_heads != 0 {
            bail!("num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}");
        }
        if head_dim % 2 != 0 {
            bail!("head_dim {head_dim} must be even for RoPE");
        }
        if let Some(act) = opt_str(v, "hidden_act")? {
            if act != "silu" {
                bail!("hidden_act {act:?} is not supported (only silu / SwiGLU)");
            }
        }
        if opt_bool(v, "mlp_bias")? == Some(true) {
            bail!("mlp_bias = true is not supported");
        }
        if arch == Arch::Qwen2 && opt_bool(v, "use_sliding_window")? == Some(true) {
            bail!("use_sliding_window = true is not supported (sliding-window attention)");
        }

        // rope: transformers 5 writes `rope_parameters`, older checkpoints `rope_theta` + `rope_scaling`.
        let rp = opt_object(v, "rope_parameters")?;
        let rope_theta = match rp.map(|p| opt_f64(p, "rope_theta")).transpose()?.flatten() {
            Some(t) => t,
            None => opt_f64(v, "rope_theta")?.unwrap_or(10000.0),
        };
        // theta ≤ 0 gives NaN frequencies: every logit NaN, and generation would emit token 0.
        if !(rope_theta > 0.0 && rope_theta.is_finite()) {
            bail!("rope_theta must be a positive number (got {rope_theta}); HF models use values like 10000 or 500000");
        }
        let scaling_block = match rp {
            Some(p) => Some(p),
            None => opt_object(v, "rope_scaling")?,
        };
        let rope_scaling = match scaling_block {
            None => RopeScaling::None,
            Some(s) => {
                let ty = match opt_str(s, "rope_type")? {
                    Some(t) => t,
                    None => opt_str(s, "type")?.unwrap_or("default"),
                };
                // every scaling parameter divides or scales a frequency: positive and finite
                let f = |k: &str| -> Result<f64> {
                    let x = opt_f64(s, k)
                        .with_context(|| format!("rope {ty}"))?
                        .with_context(|| format!("rope {ty}: missing {k:?}"))?;
                    if !(x > 0.0 && x.is_finite()) {
                        bail!("rope {ty}: {k:?} must be a positive number, got {x}");
                    }
                    Ok(x)
                };
                match ty {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear { factor: f("factor")? },
                    "llama3" => RopeScaling::Llama3 {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position: f("original_max_position_embeddings")?,
                    },
                    other => bail!("rope type {other:?} is not supported (default, linear, llama3)"),
                }
            }
        };
        let vocab = get_usize("vocab_size")?;
        // A token id names a row of the embeddings: one past the vocabulary would be read out of
        // bounds (or never match), so it is refused here rather than at the first use.
        let token_id = |k: &str, x: &Value| -> Result<u32> {
            match x.as_u64() {
                Some(t) if (t as usize) < vocab => Ok(t as u32),
                _ => bail!("field {k:?} must be a token id in 0..{vocab} (vocab_size), got {x}"),
            }
        };
        let bos_token_id = field(v, "bos_token_id").map(|x| token_id("bos_token_id", x)).transpose()?;
        let eos_token_ids = match field(v, "eos_token_id") {
            Some(Value::Array(a)) => a.iter().map(|x| token_id("eos_token_id", x)).collect::<Result<_>>()?,
            Some(x) => vec![token_id("eos_token_id", x)?],
            None => vec![],
        };
        let qkv_bias = match arch {
            Arch::Qwen2 => true,
            Arch::Llama => opt_bool(v, "attention_bias")?.unwrap_or(false),
        };
        // Missing eps: HF's LlamaConfig default. A value that is not a positive f32 (0, negative,
        // below f32's range) makes rmsnorm divide by zero or take the root of a negative: NaN.
        let rms_eps = opt_f64(v, "rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_eps > 0.0 && (rms_eps as f32) > 0.0 && (rms_eps as f32).is_finite()) {
            bail!("rms_norm_eps must be a positive number (got {rms_eps}); HF models use values like 1e-5 or 1e-6");
        }
        let max_position = match field(v, "max_position_embeddings") {
            None => 4096,
            Some(_) => get_usize("max_position_embeddings")?,
        };
        let cfg = ModelConfig {
            arch,
            hidden,
            intermediate: get_usize("intermediate_size")?,
            n_layers: get_usize("num_hidden_layers")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            rms_eps: rms_eps as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: opt_bool(v, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            max_position,
            bos_token_id,
            eos_token_ids,
        };
        // Sizes whose products overflow cannot match any weights file; refuse them before any
        // shape arithmetic wraps.
        if cfg.checked_params().is_none() {
            bail!(
                "the sizes in config.json are too large (hidden_size {}, intermediate_size {}, num_hidden_layers {}, vocab_size {}, heads {} × head_dim {}): the parameter count overflows",
                cfg.hidden, cfg.intermediate, cfg.n_layers, cfg.vocab, cfg.n_heads, cfg.head_dim
            );
        }
        // rope_theta and the scaling are each valid, yet extreme combinations (theta 1e-300) still
        // give frequencies outside f32: check what the kernels will use.
        if let Some(f) = cfg.rope_inv_freq().iter().find(|&&f| !(f > 0.0 && (f as f32).is_finite() && (f as f32) > 0.0)) {
            bail!(
                "rope_theta {} with head_dim {} and rope scaling {:?} gives a RoPE frequency of {f}, outside f32's range",
                cfg.rope_theta, cfg.head_dim, cfg.rope_scaling
            );
        }
        Ok(cfg)
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Inverse frequencies of the rotary embedding (`head_dim/2` of them), scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let half = self.head_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / self.head_dim as f64))
            .collect();
        match &self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                // transformers' _compute_llama3_parameters
                let low_wl = original_max_position / low_freq_factor;
                let high_wl = original_max_position / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wl = 2.0 * std::f64::consts::PI / f;
                        if wl < high_wl {
                            f
                        } else if wl > low_wl {
                            f / factor
                        } else {
                            let smooth = (original_max_position / wl - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// `n_params` in checked arithmetic: `None` when the sizes overflow.
    fn checked_params(&self) -> Option<usize> {
        let d = self.hidden;
        let q = self.n_heads.checked_mul(self.head_dim)?;
        let kv = self.n_kv_heads.checked_mul(self.head_dim)?;
        let attn = d.checked_mul(q)?.checked_mul(2)?.checked_add(d.checked_mul(kv)?.checked_mul(2)?)?;
        let mlp = d.checked_mul(self.intermediate)?.checked_mul(3)?;
        let emb = self.vocab.checked_mul(d)?.checked_mul(2)?;
        let layer = attn.checked_add(mlp)?.checked_add(d.checked_mul(2)?)?;
        self.n_layers.checked_mul(layer)?.checked_add(emb)?.checked_add(d)
    }

    /// Parameters of the base model (for reports).
    pub fn n_params(&self) -> usize {
        let d = self.hidden;
        let attn = d * self.q_dim() * 2 + d * self.kv_dim() * 2;
        let mlp = 3 * d * self.intermediate;
        let emb = self.vocab * d * if self.tie_word_embeddings { 1 } else { 2 };
        self.n_layers * (attn + mlp + 2 * d) + emb + d
    }
}

/// Field `k` of an object when present and not `null` (HF writes `null` for "not set").
fn field<'a>(v: &'a Value, k: &str) -> Option<&'a Value> {
    v.get(k).filter(|x| !x.is_null())
}

// Typed optional fields: absent or null is `None`; a value of the wrong type is an error naming
// the field and the value, never a silent default.
fn opt_f64(v: &Value, k: &str) -> Result<Option<f64>> {
    field(v, k).map(|x| x.as_f64().with_context(|| format!("field {k:?} must be a number, got {x}"))).transpose()
}

fn opt_bool(v: &Value, k: &str) -> Result<Option<bool>> {
    field(v, k).map(|x| x.as_bool().with_context(|| format!("field {k:?} must be true or false, got {x}"))).transpose()
}

fn opt_str<'a>(v: &'a Value, k: &str) -> Result<Option<&'a str>> {
    field(v, k).map(|x| x.as_str().with_context(|| format!("field {k:?} must be a string, got {x}"))).transpose()
}

fn opt_object<'a>(v: &'a Value, k: &str) -> Result<Option<&'a Value>> {
    match field(v, k) {
        Some(x) if !x.is_object() => bail!("field {k:?} must be an object, got {x}"),
        x => Ok(x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 512, "rms_norm_eps": 1e-5})
    }

    #[test]
    fn rope_theta_top_level_and_block() {
        let mut v = base();
        v["rope_theta"] = json!(5e5);
        assert_eq!(ModelConfig::from_json(&v).unwrap().rope_theta, 5e5);
        v["rope_parameters"] = json!({"rope_theta": 1e6, "rope_type": "default"});
        assert_eq!(ModelConfig::from_json(&v).unwrap().rope_theta, 1e6);
        assert_eq!(ModelConfig::from_json(&base()).unwrap().rope_theta, 10000.0);
    }

    #[test]
    fn llama3_scaling_matches_transformers() {
        // Llama 3.2 values; reference numbers from transformers' _compute_llama3_parameters.
        let mut v = base();
        v["head_dim"] = json!(64);
        v["rope_theta"] = json!(500000.0);
        v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_json(&v).unwrap();
        let f = c.rope_inv_freq();
        assert_eq!(f[0], 1.0); // high frequencies untouched
        let last_base = 1.0 / 500000f64.powf(62.0 / 64.0);
        assert!((f[31] - last_base / 32.0).abs() < 1e-15); // low frequencies divided by factor
    }

    #[test]
    fn unknown_arch_is_named() {
        let mut v = base();
        v["model_type"] = json!("mistral");
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("mistral") && e.contains("llama, qwen2"), "{e}");
    }

    #[test]
    fn bad_heads_rejected() {
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("multiple"));
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("yarn"));
    }
}
