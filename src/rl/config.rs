//! What a training run is defined by: [`TrainConfig`] (the TOML file and/or `train`'s flags, saved
//! in every checkpoint), its defaults, and the checks of every value before anything is loaded
//! or written.
use crate::backend::Dtype;
use crate::model::lora::Proj;
use crate::agent::{AgentConfig, Budget};
use super::grpo::AdvNorm;
use crate::reward::{self, Extract, Matcher, RewardMode};
use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The order in which steps draw the training records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DataOrder {
    /// A fresh seeded shuffle every pass over the data.
    #[default]
    Shuffled,
    /// The file's order, pass after pass: a length curriculum is a data file with its short
    /// documents first (`cat` of `data synth` outputs, shortest first).
    File,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    Constant,
    Cosine,
}

/// Everything a run is defined by (TOML file and/or flags; saved in every checkpoint).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub model: Option<PathBuf>,
    /// Training data (JSONL, see `data synth`).
    pub data: Option<PathBuf>,
    /// How steps draw from the data: shuffled, or in the file's order (a curriculum).
    pub data_order: DataOrder,
    pub out: PathBuf,
    /// Start from this PEFT adapter instead of a fresh one.
    pub init_adapter: Option<PathBuf>,
    /// Weight storage of the base model (`--dtype`; `"auto"` or absent = `None`, resolved by
    /// `train` before the run starts); part of the run, so a resume keeps it (gradients are
    /// bit-exact across a resume within one dtype).
    #[serde(deserialize_with = "dtype_or_auto", skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    pub lora_r: usize,
    pub lora_alpha: f64,
    /// Any of q,k,v,o,gate,up,down.
    pub lora_targets: Vec<String>,
    pub steps: usize,
    /// Queries per step; each gets `group_size` rollouts.
    pub queries_per_step: usize,
    pub group_size: usize,
    /// The agent's budget ([`Budget`], through [`TrainConfig::budget`]): three keys of the file
    /// rather than an embedded struct, because serde's `flatten` would cost every error in the
    /// file its line and the list of known keys.
    pub chunk_tokens: usize,
    pub memory_tokens: usize,
    pub answer_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub templates: Option<PathBuf>,
    pub extract: Extract,
    pub matcher: Matcher,
    pub reward: RewardMode,
    pub beta: f64,
    /// `std` or `mean`.
    pub adv_norm: String,
    pub clip_low: f64,
    pub clip_high: f64,
    pub kl_coef: f64,
    pub lr: f64,
    pub warmup_steps: usize,
    pub schedule: Schedule,
    pub weight_decay: f64,
    /// Global gradient-norm clip (0 = off).
    pub grad_clip: f64,
    /// Tokens (prompt + response) per forward/backward micro-batch.
    pub micro_batch_tokens: usize,
    /// Tokens per forward step during rollouts.
    pub max_batch_tokens: usize,
    pub save_every: usize,
    pub keep_checkpoints: usize,
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: None,
            data: None,
            data_order: DataOrder::Shuffled,
            out: PathBuf::from("runs/train"),
            init_adapter: None,
            dtype: None,
            lora_r: 16,
            lora_alpha: 32.0,
            lora_targets: ["q", "k", "v", "o", "gate", "up", "down"].iter().map(|s| s.to_string()).collect(),
            steps: 20,
            queries_per_step: 4,
            group_size: 4,
            chunk_tokens: 512,
            memory_tokens: 128,
            answer_tokens: 24,
            temperature: 1.0,
            top_p: 1.0,
            templates: None,
            extract: Extract::Line,
            matcher: Matcher::Em,
            reward: RewardMode::Infomem,
            beta: 0.5,
            adv_norm: "std".into(),
            clip_low: 0.2,
            clip_high: 0.28,
            kl_coef: 0.0,
            lr: 1e-4,
            warmup_steps: 2,
            schedule: Schedule::Constant,
            weight_decay: 0.0,
            grad_clip: 1.0,
            micro_batch_tokens: 4096,
            max_batch_tokens: 2048,
            save_every: 5,
            keep_checkpoints: 2,
            seed: 0,
        }
    }
}

/// `dtype = "f32" | "bf16" | "auto"` (auto = `None`).
fn dtype_or_auto<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Dtype>, D::Error> {
    match String::deserialize(d)?.as_str() {
        "auto" => Ok(None),
        "f32" => Ok(Some(Dtype::F32)),
        "bf16" => Ok(Some(Dtype::Bf16)),
        other => Err(serde::de::Error::custom(format!("dtype must be \"auto\", \"f32\" or \"bf16\", got {other:?}"))),
    }
}

/// Upper bounds of the count-like settings: far beyond any real run, low enough that no budget
/// arithmetic overflows (the model- and memory-dependent limits are checked where they are known).
pub const MAX_STEPS: usize = 1_000_000_000;
pub const MAX_TOKENS: usize = 1 << 24;
pub const MAX_GROUP: usize = 1 << 16;
pub const MAX_QUERIES: usize = 1 << 20;
pub const MAX_LORA_R: usize = 1 << 16;

/// Non-finite updates (loss, gradient, reward or the parameters after AdamW) in a row after which
/// `train` stops with an error instead of skipping on: the run is broken, not unlucky.
pub const MAX_NONFINITE_STEPS_IN_A_ROW: usize = 5;

/// The flag of a config field, with its config-file key, for messages.
fn flag(key: &str) -> String {
    format!("--{} (`{key}` in a config file)", key.replace('_', "-"))
}

impl TrainConfig {
    /// Every setting finite and in its range, before anything is loaded or written: a NaN or an
    /// absurd value would otherwise ruin the adapter (or wrap the schedule) and still exit 0.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.model.is_some(), "no model: pass --model DIR (or `model = ...` in the config file)");
        ensure!(self.data.is_some(), "no training data: pass --data FILE (or `data = ...` in the config file)");
        // the run's config.toml records every path as text, so a path that is not UTF-8 could be
        // saved (and resumed) only changed: refused here, before the directory is touched
        let paths = [("out", Some(&self.out)), ("model", self.model.as_ref()), ("data", self.data.as_ref()), ("init_adapter", self.init_adapter.as_ref()), ("templates", self.templates.as_ref())];
        for (key, p) in paths {
            if let Some(p) = p.filter(|p| p.to_str().is_none()) {
                bail!("{} {}: the path is not valid UTF-8 (the run's config.toml records it as text); rename it or choose another", flag(key), p.display());
            }
        }
        let int = |key: &str, v: usize, lo: usize, hi: usize, why: &str| -> Result<()> {
            ensure!((lo..=hi).contains(&v), "{} must be an integer in {lo}..={hi}{why}, got {v}", flag(key));
            Ok(())
        };
        int("steps", self.steps, 1, MAX_STEPS, "")?;
        int("warmup_steps", self.warmup_steps, 0, MAX_STEPS, "")?;
        int("queries_per_step", self.queries_per_step, 1, MAX_QUERIES, "")?;
        int("group_size", self.group_size, 2, MAX_GROUP, " (GRPO compares at least 2 rollouts of a query)")?;
        int("lora_r", self.lora_r, 1, MAX_LORA_R, "")?;
        int("chunk_tokens", self.chunk_tokens, 1, MAX_TOKENS, "")?;
        int("memory_tokens", self.memory_tokens, 1, MAX_TOKENS, "")?;
        int("answer_tokens", self.answer_tokens, 1, MAX_TOKENS, "")?;
        int("micro_batch_tokens", self.micro_batch_tokens, 1, MAX_TOKENS, "")?;
        int("max_batch_tokens", self.max_batch_tokens, 1, MAX_TOKENS, "")?;
        int("save_every", self.save_every, 0, MAX_STEPS, " (0 = only at the end)")?;
        int("keep_checkpoints", self.keep_checkpoints, 1, MAX_STEPS, " (the newest checkpoint is always kept)")?;
        // (a NaN fails every comparison, so `ok` is false for it)
        let real = |key: &str, v: f64, ok: bool, range: &str| -> Result<()> {
            ensure!(v.is_finite() && ok, "{} must be {range}, got {v}", flag(key));
            Ok(())
        };
        real("lr", self.lr, self.lr > 0.0 && self.lr <= 1.0, "in (0, 1]")?;
        real("weight_decay", self.weight_decay, (0.0..=1.0).contains(&self.weight_decay), "in [0, 1]")?;
        real("grad_clip", self.grad_clip, (0.0..=1e9).contains(&self.grad_clip), "in [0, 1e9] (0 = off)")?;
        real("lora_alpha", self.lora_alpha, self.lora_alpha > 0.0 && self.lora_alpha <= 65536.0, "in (0, 65536]")?;
        real("temperature", self.temperature as f64, (0.0..=100.0).contains(&self.temperature), "in [0, 100] (0 = greedy)")?;
        real("top_p", self.top_p as f64, self.top_p > 0.0 && self.top_p <= 1.0, "in (0, 1]")?;
        real("beta", self.beta, (-1000.0..=1000.0).contains(&self.beta), "in [-1000, 1000]")?;
        real("clip_low", self.clip_low, (0.0..=1.0).contains(&self.clip_low), "in [0, 1] (the ratio is clipped below at 1 - clip_low)")?;
        real("clip_high", self.clip_high, (0.0..=100.0).contains(&self.clip_high), "in [0, 100]")?;
        real("kl_coef", self.kl_coef, (0.0..=1000.0).contains(&self.kl_coef), "in [0, 1000]")?;
        AdvNorm::parse(&self.adv_norm)?;
        self.targets()?;
        Ok(())
    }

    pub fn targets(&self) -> Result<Vec<Proj>> {
        let mut t: Vec<Proj> = self.lora_targets.iter().map(|s| Proj::parse(s)).collect::<Result<_>>()?;
        t.sort();
        t.dedup();
        ensure!(!t.is_empty(), "--lora-targets is empty");
        Ok(t)
    }

    /// The run's chunk, memory and answer budgets.
    pub fn budget(&self) -> Budget {
        Budget { chunk_tokens: self.chunk_tokens, memory_tokens: self.memory_tokens, answer_tokens: self.answer_tokens }
    }

    pub fn agent(&self, seed: u64) -> AgentConfig {
        let sig = self.reward.signal();
        AgentConfig {
            budget: self.budget(),
            group_size: self.group_size,
            temperature: self.temperature,
            top_p: self.top_p,
            matcher: self.matcher,
            extract: self.extract,
            share_prefix: true,
            // the gain is cheap (it extends the final prompt's cache): always report it
            answer_gain: true,
            query_gain: sig == reward::Signal::QueryGain,
            memory_curve: false,
            max_batch_tokens: self.max_batch_tokens,
            seed,
        }
    }

    /// Learning rate at (0-based) step `s`: linear warm-up, then constant or cosine to 10%.
    pub fn lr_at(&self, s: usize) -> f64 {
        if s < self.warmup_steps {
            // in f64: `warmup_steps + 1` must not wrap (to 0, giving lr = inf)
            return self.lr * (s as f64 + 1.0) / (self.warmup_steps as f64 + 1.0);
        }
        match self.schedule {
            Schedule::Constant => self.lr,
            Schedule::Cosine => {
                let span = self.steps.saturating_sub(self.warmup_steps).max(1) as f64;
                let t = ((s - self.warmup_steps) as f64 / span).min(1.0);
                self.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
            }
        }
    }
}

