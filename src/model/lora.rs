//! LoRA adapters in PEFT's on-disk format (`adapter_config.json` + `adapter_model.safetensors`,
//! keys `base_model.model.model.layers.{l}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`), so PEFT,
//! vLLM and transformers load what we write and we load what they write.
//!
//! The delta on a projection is `(alpha/r) · B A x` (`alpha/sqrt(r)` with rsLoRA), A `[r, in]`,
//! B `[out, r]`.
use super::config::ModelConfig;
use super::weights::{write_safetensors, HostTensor, SafetensorsSet};
use crate::util::rng::Rng;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// The seven projections a LoRA may target, in a fixed order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

pub const ALL_PROJS: [Proj; 7] = [Proj::Q, Proj::K, Proj::V, Proj::O, Proj::Gate, Proj::Up, Proj::Down];

impl Proj {
    pub fn module(self) -> &'static str {
        match self {
            Proj::Q => "q_proj",
            Proj::K => "k_proj",
            Proj::V => "v_proj",
            Proj::O => "o_proj",
            Proj::Gate => "gate_proj",
            Proj::Up => "up_proj",
            Proj::Down => "down_proj",
        }
    }
    pub fn parent(self) -> &'static str {
        match self {
            Proj::Q | Proj::K | Proj::V | Proj::O => "self_attn",
            _ => "mlp",
        }
    }
    pub fn from_module(name: &str) -> Option<Proj> {
        ALL_PROJS.iter().copied().find(|p| p.module() == name)
    }
    /// Short names accepted by `--lora-targets` (`q,k,v,o,gate,up,down` or the module names).
    pub fn parse(s: &str) -> Result<Proj> {
        let s = s.trim();
        let short = match s {
            "q" => Some(Proj::Q),
            "k" => Some(Proj::K),
            "v" => Some(Proj::V),
            "o" => Some(Proj::O),
            "gate" => Some(Proj::Gate),
            "up" => Some(Proj::Up),
            "down" => Some(Proj::Down),
            _ => None,
        };
        short
            .or_else(|| Proj::from_module(s))
            .ok_or_else(|| anyhow!("unknown LoRA target {s:?}: use q,k,v,o,gate,up,down"))
    }
    /// (in, out) features of this projection.
    pub fn dims(self, c: &ModelConfig) -> (usize, usize) {
        match self {
            Proj::Q => (c.hidden, c.q_dim()),
            Proj::K | Proj::V => (c.hidden, c.kv_dim()),
            Proj::O => (c.q_dim(), c.hidden),
            Proj::Gate | Proj::Up => (c.hidden, c.intermediate),
            Proj::Down => (c.intermediate, c.hidden),
        }
    }
    pub fn index(self) -> usize {
        self as usize
    }
    /// PEFT key (without `.default`) of this projection's A or B in layer `l`.
    pub fn peft_key(self, l: usize, which: char) -> String {
        format!("base_model.model.model.layers.{l}.{}.{}.lora_{which}.weight", self.parent(), self.module())
    }
}

#[derive(Clone, Debug)]
pub struct LoraPair {
    /// `[r, in]`
    pub a: HostTensor,
    /// `[out, r]`
    pub b: HostTensor,
}

#[derive(Clone, Debug)]
pub struct LoraAdapter {
    pub r: usize,
    pub alpha: f64,
    pub use_rslora: bool,
    pub targets: Vec<Proj>,
    /// `layers[l][proj.index()]`
    pub layers: Vec<[Option<LoraPair>; 7]>,
    pub base_model_name: Option<String>,
}

impl LoraAdapter {
    pub fn scale(&self) -> f32 {
        if self.use_rslora {
            (self.alpha / (self.r as f64).sqrt()) as f32
        } else {
            (self.alpha / self.r as f64) as f32
        }
    }

    /// A fresh adapter: A ~ Kaiming-uniform as PEFT initialises it (bound 1/sqrt(in)), B = 0.
    pub fn init(cfg: &ModelConfig, r: usize, alpha: f64, targets: &[Proj], seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let layers = (0..cfg.n_layers)
            .map(|_| {
                let mut row: [Option<LoraPair>; 7] = Default::default();
                for &p in targets {
                    let (din, dout) = p.dims(cfg);
                    let bound = 1.0 / (din as f64).sqrt();
                    let a = (0..r * din).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect();
                    row[p.index()] = Some(LoraPair {
                        a: HostTensor::new(vec![r, din], a),
                        b: HostTensor::zeros(vec![dout, r]),
                    });
                }
                row
            })
            .collect();
        LoraAdapter { r, alpha, use_rslora: false, targets: targets.to_vec(), layers, base_model_name: None }
    }

    /// Load a PEFT LoRA directory and check it fits `cfg` (keys, ranks, shapes, target_modules).
    pub fn load(dir: &Path, cfg: &ModelConfig) -> Result<Self> {
        if let Err(e) = std::fs::metadata(dir) {
            if crate::util::fs::is_symlink_loop(&e) {
                bail!("adapter directory {} is a symlink loop (following its symlinks never reaches a directory)", dir.display());
            }
        }
        let cpath = dir.join("adapter_config.json");
        crate::util::fs::stat(&cpath)?;
        let text = std::fs::read_to_string(&cpath)
            .with_context(|| format!("cannot read {} (is {} a PEFT adapter directory?)", cpath.display(), dir.display()))?;
        let c: Value = serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", cpath.display()))?;
        Self::load_with_config(dir, &c, cfg).with_context(|| format!("adapter {}", dir.display()))
    }

    fn load_with_config(dir: &Path, c: &Value, cfg: &ModelConfig) -> Result<Self> {
        let field = |k: &str| c.get(k).filter(|x| !x.is_null());
        let flag = |k: &str| -> Result<bool> {
            match field(k) {
                None => Ok(false),
                Some(x) => x.as_bool().ok_or_else(|| anyhow!("adapter_config.json: {k:?} must be true or false, got {x}")),
            }
        };
        let peft_type = match field("peft_type") {
            None => "LORA",
            Some(x) => x.as_str().ok_or_else(|| anyhow!("adapter_config.json: \"peft_type\" must be a string, got {x}"))?,
        };
        if peft_type != "LORA" {
            bail!("peft_type {peft_type:?} is not supported (only LORA)");
        }
        let r = match field("r") {
            None => bail!("adapter_config.json: missing \"r\" (the LoRA rank, a positive integer)"),
            Some(x) => match x.as_u64() {
                Some(r) if r > 0 => r as usize,
                _ => bail!("adapter_config.json: \"r\" must be a positive integer (the LoRA rank), got {x}"),
            },
        };
        let alpha = match field("lora_alpha") {
            None => 8.0, // PEFT's default
            Some(x) => match x.as_f64() {
                Some(a) if a.is_finite() => a,
                _ => bail!("adapter_config.json: \"lora_alpha\" must be a finite number, got {x}"),
            },
        };
        for (flag_name, what) in [("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out")] {
            if flag(flag_name)? {
                bail!("adapter_config.json: {what} adapters are not supported");
            }
        }
        for k in ["rank_pattern", "alpha_pattern"] {
            if c.get(k).and_then(Value::as_object).is_some_and(|o| !o.is_empty()) {
                bail!("adapter_config.json: per-module {k} is not supported");
            }
        }
        if c.get("layers_to_transform").is_some_and(|v| !v.is_null()) {
            bail!("adapter_config.json: layers_to_transform is not supported");
        }
        for k in ["exclude_modules", "target_parameters"] {
            if field(k).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
                bail!("adapter_config.json: {k} is not supported (only target_modules)");
            }
        }
        if c.get("modules_to_save").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
            bail!("adapter_config.json: modules_to_save is not supported (only LoRA matrices)");
        }
        if let Some(b) = c.get("bias").and_then(Value::as_str) {
            if b != "none" {
                bail!("adapter_config.json: bias {b:?} is not supported (only \"none\")");
            }
        }
        let use_rslora = flag("use_rslora")?;
        let targets = resolve_targets(c.get("target_modules"), cfg)?;

        let wpath = dir.join("adapter_model.safetensors");
        if crate::util::fs::stat(&wpath)?.is_none() {
            bail!("{} is missing (adapter_model.bin is not supported; save with safe_serialization)", wpath.display());
        }
        let set = SafetensorsSet::open_files(&[wpath.clone()])?;
        // Index every key into (layer, proj, A|B); anything else is an error, not silently ignored.
        let mut found: BTreeMap<(usize, Proj, char), String> = BTreeMap::new();
        let mut names: Vec<&str> = set.names().collect();
        names.sort(); // the first offending tensor named is the same on every run
        for name in names {
            let parsed = parse_peft_key(name)
                .ok_or_else(|| anyhow!("unexpected tensor {name} in {} (not a LoRA A/B weight of a decoder layer)", wpath.display()))?;
            if parsed.0 >= cfg.n_layers {
                bail!("tensor {name}: layer {} does not exist in the base model ({} layers)", parsed.0, cfg.n_layers);
            }
            // PEFT applies only what target_modules names: a tensor of another module would be
            // dropped there and applied here, so the file and the config must agree.
            if !targets.contains(&parsed.1) {
                bail!(
                    "{} holds {name}, but target_modules {} does not target {} (targets here: {}); add it to target_modules or remove its tensors",
                    wpath.display(),
                    c.get("target_modules").map(|t| t.to_string()).unwrap_or_else(|| "(absent: PEFT's default for llama, mistral, qwen2 and qwen3)".into()),
                    parsed.1.module(),
                    targets.iter().map(|p| p.module()).collect::<Vec<_>>().join(", ")
                );
            }
            found.insert(parsed, name.to_string());
        }
        if found.is_empty() {
            bail!("{} holds no LoRA tensors", wpath.display());
        }
        let mut layers: Vec<[Option<LoraPair>; 7]> = (0..cfg.n_layers).map(|_| Default::default()).collect();
        for l in 0..cfg.n_layers {
            for &p in &targets {
                let (din, dout) = p.dims(cfg);
                let a_name = found.get(&(l, p, 'A'));
                let b_name = found.get(&(l, p, 'B'));
                match (a_name, b_name) {
                    (Some(a), Some(b)) => {
                        let a = set.get_f32(a, Some(&[r, din])).with_context(|| format!("LoRA rank r = {r} from adapter_config.json"))?;
                        let b = set.get_f32(b, Some(&[dout, r])).with_context(|| format!("LoRA rank r = {r} from adapter_config.json"))?;
                        layers[l][p.index()] = Some(LoraPair { a, b });
                    }
                    (None, None) => bail!(
                        "layer {l} has no LoRA weights for {} in {}, but target_modules targets it in every layer",
                        p.module(),
                        wpath.display()
                    ),
                    _ => bail!("layer {l} {}: lora_A and lora_B must both be present", p.module()),
                }
            }
        }
        let base_model_name = c.get("base_model_name_or_path").and_then(Value::as_str).map(String::from);
        Ok(LoraAdapter { r, alpha, use_rslora, targets, layers, base_model_name })
    }

    pub fn n_params(&self) -> usize {
        self.layers.iter().flatten().flatten().map(|p| p.a.data.len() + p.b.data.len()).sum()
    }

    /// Tensors under PEFT's key names.
    pub fn to_peft_tensors(&self) -> BTreeMap<String, HostTensor> {
        let mut m = BTreeMap::new();
        for (l, row) in self.layers.iter().enumerate() {
            for &p in &self.targets {
                if let Some(pair) = &row[p.index()] {
                    m.insert(p.peft_key(l, 'A'), pair.a.clone());
                    m.insert(p.peft_key(l, 'B'), pair.b.clone());
                }
            }
        }
        m
    }

    /// Write `adapter_config.json` + `adapter_model.safetensors` as PEFT does.
    pub fn save_peft(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        write_safetensors(&dir.join("adapter_model.safetensors"), &self.to_peft_tensors(), Some(meta))?;
        let targets: Vec<&str> = self.targets.iter().map(|p| p.module()).collect();
        let cfg = json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model_name,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": self.use_rslora,
            "use_dora": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        });
        crate::util::fs::write_atomic_str(&dir.join("adapter_config.json"), &serde_json::to_string_pretty(&cfg)?)
    }

    /// Fold the adapter into base weights: `W += scale · B A` (used by `merge`).
    pub fn merge_into(&self, w: &mut crate::model::weights::ModelWeights, cfg: &ModelConfig) {
        let s = self.scale();
        let (q, kv, i) = (cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        for (l, row) in self.layers.iter().enumerate() {
            let lw = &mut w.layers[l];
            for &p in &self.targets {
                let Some(pair) = &row[p.index()] else { continue };
                let (din, dout) = p.dims(cfg);
                let (mat, row0) = match p {
                    Proj::Q => (&mut lw.qkv, 0),
                    Proj::K => (&mut lw.qkv, q),
                    Proj::V => (&mut lw.qkv, q + kv),
                    Proj::O => (&mut lw.o, 0),
                    Proj::Gate => (&mut lw.gate_up, 0),
                    Proj::Up => (&mut lw.gate_up, i),
                    Proj::Down => (&mut lw.down, 0),
                };
                for o in 0..dout {
                    let dst = &mut mat.data[(row0 + o) * din..(row0 + o + 1) * din];
                    for k in 0..self.r {
                        let bk = s * pair.b.data[o * self.r + k];
                        if bk == 0.0 {
                            continue;
                        }
                        let arow = &pair.a.data[k * din..(k + 1) * din];
                        for (d, a) in dst.iter_mut().zip(arow) {
                            *d += bk * a;
                        }
                    }
                }
            }
        }
    }
}

/// The module names of the base model as PEFT sees them (`named_modules()` of a
/// `LlamaForCausalLM` / `Qwen2ForCausalLM`), each with the projection it is, if it is one.
fn module_names(cfg: &ModelConfig) -> Vec<(String, Option<(usize, Proj)>)> {
    let mut m: Vec<(String, Option<(usize, Proj)>)> =
        ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
            .iter()
            .map(|n| (n.to_string(), None))
            .collect();
    for l in 0..cfg.n_layers {
        let base = format!("model.layers.{l}");
        for sub in ["", ".self_attn", ".mlp", ".mlp.act_fn", ".input_layernorm", ".post_attention_layernorm"] {
            m.push((format!("{base}{sub}"), None));
        }
        for p in ALL_PROJS {
            m.push((format!("{base}.{}.{}", p.parent(), p.module()), Some((l, p))));
        }
    }
    m
}

/// The projections an adapter's `target_modules` selects, matched as PEFT matches them:
/// - a list: an entry selects the modules whose name equals it or ends with `.` + it (`q_proj`,
///   `self_attn.q_proj`, `model.layers.0.self_attn.q_proj`); every entry must select something;
/// - a string: `all-linear` (any case) selects the seven projections of every layer (all linear
///   layers but the output head); any other string is a regular expression that must match a
///   whole module name (`re.fullmatch`; Oniguruma syntax, which agrees with Python's `re` on the
///   usual patterns such as `.*\.(q|v)_proj`);
/// - absent or null: PEFT's default for llama, mistral, qwen2 and qwen3, `["q_proj", "v_proj"]`.
///
/// Only the seven projections can carry LoRA here (not `lm_head` or `embed_tokens`), and a
/// projection must be selected in every layer or in none (no per-layer targeting).
fn resolve_targets(tm: Option<&Value>, cfg: &ModelConfig) -> Result<Vec<Proj>> {
    const VALID: &str = "a list of module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), \"all-linear\", or a regular expression over module paths such as model.layers.0.self_attn.q_proj";
    let modules = module_names(cfg);
    let mut selected: Vec<(&str, &str)> = Vec::new(); // (target, module name)
    match tm {
        None | Some(Value::Null) => {
            for (name, _) in &modules {
                if name.ends_with(".q_proj") || name.ends_with(".v_proj") {
                    selected.push(("q_proj/v_proj (PEFT's default)", name));
                }
            }
        }
        Some(Value::String(s)) if s.eq_ignore_ascii_case("all-linear") => {
            for (name, p) in &modules {
                if p.is_some() {
                    selected.push((s, name));
                }
            }
        }
        Some(Value::String(s)) => {
            // `\A(?:…)\z`: the whole name, as re.fullmatch (Oniguruma bounds backtracking).
            let re = tokenizers::utils::SysRegex::new(&format!(r"\A(?:{s})\z"))
                .map_err(|e| anyhow!("adapter_config.json: target_modules {s:?} is not a valid regular expression: {e}"))?;
            for (name, _) in &modules {
                if re.find_iter(name).next().is_some() {
                    selected.push((s, name));
                }
            }
            if selected.is_empty() {
                bail!(
                    "adapter_config.json: target_modules {s:?} (a regular expression matched against whole module names) matches no module of the model; valid: {VALID}"
                );
            }
        }
        Some(Value::Array(list)) => {
            if list.is_empty() {
                bail!("adapter_config.json: target_modules is empty; valid: {VALID}");
            }
            for t in list {
                let t = t.as_str().ok_or_else(|| anyhow!("adapter_config.json: target_modules entry {t} is not a string; valid: {VALID}"))?;
                let before = selected.len();
                for (name, _) in &modules {
                    if name == t || name.strip_suffix(t).is_some_and(|head| head.ends_with('.')) {
                        selected.push((t, name));
                    }
                }
                if selected.len() == before {
                    let hint = if t.eq_ignore_ascii_case("all-linear") { " (\"all-linear\" is a shorthand only as the whole string value, not as a list entry)" } else { "" };
                    bail!("adapter_config.json: target_modules entry {t:?} names no module of the model{hint}; valid: {VALID}");
                }
            }
        }
        Some(other) => bail!("adapter_config.json: target_modules must be a list of strings or a string, got {other}; valid: {VALID}"),
    }
    let by_name: BTreeMap<&str, Option<(usize, Proj)>> = modules.iter().map(|(n, p)| (n.as_str(), *p)).collect();
    let mut per_proj: BTreeMap<Proj, usize> = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    for (t, name) in selected {
        match by_name[name] {
            Some((l, p)) => {
                if seen.insert((l, p)) {
                    *per_proj.entry(p).or_default() += 1;
                }
            }
            None => bail!(
                "adapter_config.json: target_modules {t:?} selects {name}, which cannot carry a LoRA here (only the seven projections q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
            ),
        }
    }
    for (&p, &n) in &per_proj {
        if n != cfg.n_layers {
            bail!(
                "adapter_config.json: target_modules selects {} in {n} of the model's {} layers; only every layer or none is supported",
                p.module(),
                cfg.n_layers
            );
        }
    }
    Ok(per_proj.into_keys().collect())
}

/// `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (optionally with `.default`)
/// → (3, Q, 'A').
pub fn parse_peft_key(name: &str) -> Option<(usize, Proj, char)> {
    let rest = name.strip_prefix("base_model.model.")?;
    let rest = rest.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let mut parts: Vec<&str> = rest.split('.').collect();
    if parts.len() == 5 && parts[3] == "default" {
        parts.remove(3);
    }
    if parts.len() != 4 || parts[3] != "weight" {
        return None;
    }
    let proj = Proj::from_module(parts[1])?;
    if parts[0] != proj.parent() {
        return None;
    }
    let which = match parts[2] {
        "lora_A" => 'A',
        "lora_B" => 'B',
        _ => return None,
    };
    Some((layer, proj, which))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn keys_roundtrip() {
        for p in ALL_PROJS {
            assert_eq!(parse_peft_key(&p.peft_key(7, 'B')), Some((7, p, 'B')));
        }
        assert_eq!(
            parse_peft_key("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight"),
            Some((0, Proj::Up, 'A'))
        );
        assert_eq!(parse_peft_key("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight"), None);
        assert_eq!(parse_peft_key("base_model.model.lm_head.weight"), None);
    }
}
