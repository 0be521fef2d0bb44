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
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("cannot read {} (is {} an HF model directory?)", path.display(), dir.display())
        })?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&v).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_json(v: &Value) -> Result<Self> {
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
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
        let get_usize = |k: &str| -> Result<usize> {
            let x = v.get(k).with_context(|| format!("missing field {k:?}"))?;
            x.as_u64()
                .map(|n| n as usize)
                .with_context(|| format!("field {k:?} must be a non-negative integer, got {x}"))
        };
        let hidden = get_usize("hidden_size")?;
        let n_heads = get_usize("num_attention_heads")?;
        let n_kv_heads = match v.get("num_key_value_heads") {
            Some(Value::Null) | None => n_heads,
            Some(_) => get_usize("num_key_value_heads")?,
        };
        let head_dim = match v.get("head_dim") {
            Some(Value::Null) | None => {
                if n_heads == 0 || hidden % n_heads != 0 {
                    bail!("hidden_size {hidden} is not divisible by num_attention_heads {n_heads}");
                }
                hidden / n_heads
            }
            Some(_) => get_usize("head_dim")?,
        };
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            bail!("num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}");
        }
        if head_dim % 2 != 0 {
            bail!("head_dim {head_dim} must be even for RoPE");
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                bail!("hidden_act {act:?} is not supported (only silu / SwiGLU)");
            }
        }
        if v.get("mlp_bias").and_then(Value::as_bool) == Some(true) {
            bail!("mlp_bias = true is not supported");
        }
        if arch == Arch::Qwen2 && v.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            bail!("use_sliding_window = true is not supported (sliding-window attention)");
        }

        // rope: transformers 5 writes `rope_parameters`, older checkpoints `rope_theta` + `rope_scaling`.
        let rp = v.get("rope_parameters").filter(|x| x.is_object());
        let rope_theta = rp
            .and_then(|p| p.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0);
        let scaling_block = rp.or_else(|| v.get("rope_scaling").filter(|x| x.is_object()));
        let rope_scaling = match scaling_block {
            None => RopeScaling::None,
            Some(s) => {
                let ty = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                let f = |k: &str| -> Result<f64> {
                    s.get(k).and_then(Value::as_f64).with_context(|| format!("rope {ty}: missing {k:?}"))
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
        let id = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as u32);
        let eos_token_ids = match v.get("eos_token_id") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
            Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            None => vec![],
        };
        let qkv_bias = match arch {
            Arch::Qwen2 => true,
            Arch::Llama => v.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
        };
        let cfg = ModelConfig {
            arch,
            hidden,
            intermediate: get_usize("intermediate_size")?,
            n_layers: get_usize("num_hidden_layers")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab: get_usize("vocab_size")?,
            rms_eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            qkv_bias,
            max_position: v.get("max_position_embeddings").and_then(Value::as_u64).unwrap_or(4096) as usize,
            bos_token_id: id("bos_token_id"),
            eos_token_ids,
        };
        for (name, x) in [("hidden_size", cfg.hidden), ("intermediate_size", cfg.intermediate),
            ("num_hidden_layers", cfg.n_layers), ("vocab_size", cfg.vocab)] {
            if x == 0 {
                bail!("{name} must be positive");
            }
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

    /// Parameters of the base model (for reports).
    pub fn n_params(&self) -> usize {
        let d = self.hidden;
        let attn = d * self.q_dim() * 2 + d * self.kv_dim() * 2;
        let mlp = 3 * d * self.intermediate;
        let emb = self.vocab * d * if self.tie_word_embeddings { 1 } else { 2 };
        self.n_layers * (attn + mlp + 2 * d) + emb + d
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
