//! `config.json` of an HF model directory, reduced to what this transformer needs.
//!
//! Supports Llama (SmolLM2, Llama 3.x with `llama3` rope scaling; tied or untied head), Mistral
//! (Llama-shaped; a sliding window is a context limit, see [`ModelConfig::position_limit`]),
//! Qwen2 (Qwen2.5: q/k/v biases) and Qwen3 (per-head q/k RMSNorm, `head_dim` independent of
//! `hidden_size`). Both the classic top-level `rope_theta`/`rope_scaling` and transformers 5's
//! `rope_parameters` block are read. Known architectures the engine does not implement (MoE,
//! hybrid linear attention, Gemma) are refused with what is missing, before any weight is read;
//! anything else unknown is refused with what was found.
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    /// From `model_type`, else from `architectures` (older checkpoints omit the former).
    fn detect(model_type: &str, archs: &[&str]) -> Option<Arch> {
        let by_type = |t: &str| match t {
            "llama" => Some(Arch::Llama),
            "mistral" => Some(Arch::Mistral),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        };
        if !model_type.is_empty() {
            return by_type(model_type);
        }
        archs.iter().find_map(|a| match *a {
            "LlamaForCausalLM" => Some(Arch::Llama),
            "MistralForCausalLM" => Some(Arch::Mistral),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            _ => None,
        })
    }
}

/// The supported architectures, for messages.
pub const SUPPORTED: &str = "llama (Llama 2/3.x, SmolLM2), mistral, qwen2 (Qwen2/2.5), qwen3 (dense Qwen3)";

/// Families people bring that this engine does not implement, matched on `model_type` or an
/// `architectures` entry (lower-cased substring), with what is missing.
const UNSUPPORTED: &[(&[&str], &str, &str)] = &[
    (
        &["qwen3_5", "qwen3.5", "qwen3_next", "qwen3next"],
        "Qwen3.5 / Qwen3-Next",
        "hybrid linear attention (Gated DeltaNet layers interleaved with gated full attention) is not implemented; only softmax attention is",
    ),
    (
        &["moe", "mixtral", "deepseek_v2", "deepseek_v3", "deepseekv2", "deepseekv3", "gpt_oss", "gptoss", "llama4", "dbrx", "jamba", "jetmoe", "arctic", "minimax"],
        "a mixture-of-experts model",
        "routed expert MLPs (router, top-k experts, load balancing) are not implemented; only dense SwiGLU MLPs are",
    ),
    (
        &["gemma"],
        "Gemma",
        "Gemma's (1 + w) RMSNorm, GeGLU (gelu_tanh) MLP, √hidden embedding scale, and in Gemma 2/3 logit soft-capping, interleaved sliding-window layers and q/k norms are not implemented",
    ),
];

fn unsupported_family(model_type: &str, archs: &[&str]) -> Option<(&'static str, &'static str)> {
    let names: Vec<String> = std::iter::once(model_type).chain(archs.iter().copied()).map(str::to_lowercase).collect();
    UNSUPPORTED
        .iter()
        .find(|(keys, _, _)| keys.iter().any(|k| names.iter().any(|n| n.contains(k))))
        .map(|&(_, family, missing)| (family, missing))
}

/// RoPE frequency scaling. `Llama3` is the piecewise rescaling of Llama 3.1+.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f64 },
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position: f64 },
}

/// Which config field bounds the sequence length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionLimit {
    MaxPositionEmbeddings,
    /// `sliding_window` is smaller than `max_position_embeddings`: a longer sequence would need
    /// windowed attention, which the engine does not implement, so it is refused.
    SlidingWindow,
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
    /// q/k/v projections carry a bias (Qwen2 always; the others when `attention_bias`).
    pub qkv_bias: bool,
    /// o_proj carries a bias (Llama and Qwen3 with `attention_bias`; never Qwen2 or Mistral).
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (`q_norm`/`k_norm`, Qwen3).
    pub qk_norm: bool,
    /// The longest sequence (positions) a run may reach: `max_position_embeddings`, or a smaller
    /// sliding window (Mistral), since attention beyond the window is not implemented.
    pub max_position: usize,
    /// What sets `max_position`, for error messages (see [`ModelConfig::position_limit`]).
    pub position_limit_source: PositionLimit,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        crate::util::fs::stat(&path)?; // a symlink loop is named as such
        crate::util::fs::check_regular_file(&path, "model config")?;
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
        let arch = match Arch::detect(model_type, &archs) {
            Some(a) => a,
            None => match unsupported_family(model_type, &archs) {
                Some((family, missing)) => bail!(
                    "unsupported architecture: model_type {model_type:?} (architectures {archs:?}) is {family}: {missing}. Supported: {SUPPORTED}"
                ),
                None => bail!("unsupported architecture: model_type {model_type:?} (architectures {archs:?}). Supported: {SUPPORTED}"),
            },
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
        if matches!(arch, Arch::Qwen2 | Arch::Qwen3) && opt_bool(v, "use_sliding_window")? == Some(true) {
            bail!("use_sliding_window = true is not supported (sliding-window attention is not implemented)");
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
        // transformers: Llama and Qwen3 put `attention_bias` on q, k, v and o; Qwen2 has q/k/v
        // biases and none on o; Mistral has no biases (and no such field)
        let attention_bias = opt_bool(v, "attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias) = match arch {
            Arch::Qwen2 => (true, false),
            Arch::Mistral => (false, false),
            Arch::Llama | Arch::Qwen3 => (attention_bias, attention_bias),
        };
        // Missing eps: HF's LlamaConfig default. A value that is not a positive f32 (0, negative,
        // below f32's range) makes rmsnorm divide by zero or take the root of a negative: NaN.
        let rms_eps = opt_f64(v, "rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_eps > 0.0 && (rms_eps as f32) > 0.0 && (rms_eps as f32).is_finite()) {
            bail!("rms_norm_eps must be a positive number (got {rms_eps}); HF models use values like 1e-5 or 1e-6");
        }
        let max_position_embeddings = match field(v, "max_position_embeddings") {
            None => 4096,
            Some(_) => get_usize("max_position_embeddings")?,
        };
        // Mistral's sliding window: attention over the last `sliding_window` positions. Up to the
        // window it is plain causal attention; past it the engine would need windowed attention,
        // so the window becomes the run's context limit (checked against every budget up front).
        let window = match (arch, field(v, "sliding_window")) {
            (Arch::Mistral, Some(_)) => Some(get_usize("sliding_window")?),
            _ => None,
        };
        let (max_position, position_limit_source) = match window {
            Some(w) if w < max_position_embeddings => (w, PositionLimit::SlidingWindow),
            _ => (max_position_embeddings, PositionLimit::MaxPositionEmbeddings),
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
            o_bias,
            qk_norm: arch == Arch::Qwen3,
            max_position,
            position_limit_source,
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

    /// `max_position` with what sets it, for messages: "max_position_embeddings 4096" or
    /// "sliding_window 4096 (attention beyond the window is not implemented)".
    pub fn position_limit(&self) -> String {
        match self.position_limit_source {
            PositionLimit::MaxPositionEmbeddings => format!("max_position_embeddings {}", self.max_position),
            PositionLimit::SlidingWindow => format!(
                "sliding_window {} (Mistral's windowed attention is not implemented, so sequences are limited to the window)",
                self.max_position
            ),
        }
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
        let layer = attn.checked_add(mlp)?.checked_add(d.checked_mul(2)?)?.checked_add(self.head_dim.checked_mul(2)?)?;
        self.n_layers.checked_mul(layer)?.checked_add(emb)?.checked_add(d)
    }

    /// Parameters of the base model (for reports).
    pub fn n_params(&self) -> usize {
        let d = self.hidden;
        let attn = d * self.q_dim() * 2 + d * self.kv_dim() * 2;
        let mlp = 3 * d * self.intermediate;
        let emb = self.vocab * d * if self.tie_word_embeddings { 1 } else { 2 };
        let qk_norm = if self.qk_norm { 2 * self.head_dim } else { 0 };
        self.n_layers * (attn + mlp + 2 * d + qk_norm) + emb + d
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
        v["model_type"] = json!("falcon");
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("falcon") && e.contains("qwen3") && e.contains("mistral"), "{e}");
    }

    /// Families users bring that are not implemented: named, with what is missing.
    #[test]
    fn unsupported_families_say_what_is_missing() {
        for (mt, arch, want) in [
            ("qwen3_5", "Qwen3_5ForConditionalGeneration", "linear attention"),
            ("qwen3_next", "Qwen3NextForCausalLM", "linear attention"),
            ("qwen3_moe", "Qwen3MoeForCausalLM", "expert"),
            ("mixtral", "MixtralForCausalLM", "expert"),
            ("deepseek_v3", "DeepseekV3ForCausalLM", "expert"),
            ("gemma2", "Gemma2ForCausalLM", "soft-capping"),
            ("gemma3", "Gemma3ForConditionalGeneration", "Gemma"),
            ("", "Gemma3ForCausalLM", "Gemma"),
        ] {
            let mut v = base();
            v["model_type"] = json!(mt);
            v["architectures"] = json!([arch]);
            let e = ModelConfig::from_json(&v).unwrap_err().to_string();
            assert!(e.contains("unsupported architecture") && e.contains(want) && e.contains("Supported:"), "{mt}: {e}");
        }
    }

    #[test]
    fn qwen3_and_mistral() {
        let mut v = base();
        v["model_type"] = json!("qwen3");
        v["head_dim"] = json!(32); // q is 128 wide with hidden 64
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!((c.arch, c.qk_norm, c.qkv_bias, c.q_dim(), c.kv_dim()), (Arch::Qwen3, true, false, 128, 64));
        v["attention_bias"] = json!(true);
        assert!(ModelConfig::from_json(&v).unwrap().qkv_bias);
        v["use_sliding_window"] = json!(true);
        assert!(ModelConfig::from_json(&v).unwrap_err().to_string().contains("sliding"));

        let mut v = base();
        v["model_type"] = json!("mistral");
        v["max_position_embeddings"] = json!(32768);
        v["sliding_window"] = json!(null);
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!((c.arch, c.qk_norm, c.max_position), (Arch::Mistral, false, 32768));
        v["sliding_window"] = json!(4096);
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!((c.max_position, c.position_limit_source), (4096, PositionLimit::SlidingWindow));
        assert!(c.position_limit().contains("sliding_window 4096"), "{}", c.position_limit());
        v["sliding_window"] = json!(131072); // larger than any reachable sequence: plain causal
        assert_eq!(ModelConfig::from_json(&v).unwrap().max_position, 32768);
        v["sliding_window"] = json!(0);
        assert!(ModelConfig::from_json(&v).is_err());
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
