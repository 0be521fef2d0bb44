//! The training loop of `infomem-engine train`: rollouts of the live base+LoRA policy → outcome
//! and memory rewards → group advantages broadcast to every conversation → GRPO update of the
//! LoRA (micro-batches, token-mean loss, gradient clipping, AdamW, warm-up + constant/cosine LR).
//!
//! State that makes a run resumable lives in checkpoints (`out/checkpoints/step-NNNNNN/`: the
//! adapter in PEFT format, AdamW moments, and `state.json` with the step, data order and
//! position). Rollouts are seeded by (seed, step) and every reduction is in a fixed order, so a
//! run resumed from step k computes the same step k+1 as an uninterrupted one. Checkpoints are
//! written to a temporary directory and renamed into place; a kill never leaves a half one.
use super::grpo::{self, AdvNorm, Conversation, GrpoConfig, GrpoStats};
use super::optim::{AdamW, AdamWConfig};
use crate::agent::{self, AgentConfig, AgentQuery, Templates, Trajectory};
use crate::backend::TrainBackend;
use crate::model::lora::{LoraAdapter, Proj};
use crate::model::weights::{write_safetensors, SafetensorsSet};
use crate::reward::{self, Extract, Matcher, RewardMode};
use crate::runtime::{self, backward::{LoraGrads, NonFinite}, Model};
use crate::util::interrupt;
use crate::util::plot::{Chart, Series};
use crate::util::rng::Rng;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
    pub out: PathBuf,
    /// Start from this PEFT adapter instead of a fresh one.
    pub init_adapter: Option<PathBuf>,
    pub lora_r: usize,
    pub lora_alpha: f64,
    /// Any of q,k,v,o,gate,up,down.
    pub lora_targets: Vec<String>,
    pub steps: usize,
    /// Queries per step; each gets `group_size` rollouts.
    pub queries_per_step: usize,
    pub group_size: usize,
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
            out: PathBuf::from("runs/train"),
            init_adapter: None,
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

impl TrainConfig {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.model.is_some(), "no model: pass --model DIR (or `model = ...` in the config file)");
        ensure!(self.data.is_some(), "no training data: pass --data FILE (or `data = ...` in the config file)");
        ensure!(self.steps > 0 && self.queries_per_step > 0, "steps and queries per step must be positive");
        ensure!(self.group_size >= 2, "GRPO needs at least 2 rollouts per query (--group-size)");
        ensure!(self.lora_r > 0, "--lora-r must be positive");
        ensure!(self.lr > 0.0 && self.lr.is_finite(), "--lr must be a positive number");
        ensure!(self.micro_batch_tokens > 0 && self.max_batch_tokens > 0, "token budgets must be positive");
        ensure!(self.clip_low >= 0.0 && self.clip_high >= 0.0 && self.kl_coef >= 0.0 && self.beta.is_finite(), "clip ranges and kl_coef must be >= 0");
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

    pub fn agent(&self, seed: u64) -> AgentConfig {
        let sig = self.reward.signal();
        AgentConfig {
            chunk_tokens: self.chunk_tokens,
            memory_tokens: self.memory_tokens,
            answer_tokens: self.answer_tokens,
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
            return self.lr * (s + 1) as f64 / (self.warmup_steps + 1) as f64;
        }
        match self.schedule {
            Schedule::Constant => self.lr,
            Schedule::Cosine => {
                let span = (self.steps - self.warmup_steps).max(1) as f64;
                let t = ((s - self.warmup_steps) as f64 / span).min(1.0);
                self.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
            }
        }
    }
}

/// Where the data stream stands (saved in checkpoints).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataCursor {
    pub epoch: usize,
    pub pos: usize,
    pub order: Vec<usize>,
    pub rng: Rng,
}

impl DataCursor {
    pub fn new(n: usize, seed: u64) -> Self {
        let mut rng = Rng::derive(seed, 0xDA7A);
        let mut order: Vec<usize> = (0..n).collect();
        rng.shuffle(&mut order);
        DataCursor { epoch: 0, pos: 0, order, rng }
    }

    /// The next `k` record indices and the cursor after them (the cursor itself is unchanged, so
    /// a step that does not complete consumes nothing).
    pub fn peek(&self, k: usize) -> (Vec<usize>, DataCursor) {
        let mut c = self.clone();
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            if c.pos == c.order.len() {
                c.epoch += 1;
                c.pos = 0;
                c.rng.shuffle(&mut c.order);
            }
            out.push(c.order[c.pos]);
            c.pos += 1;
        }
        (out, c)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct CheckpointState {
    /// Completed steps.
    step: usize,
    cursor: DataCursor,
    config: TrainConfig,
    adam_step: u64,
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    #[serde(deserialize_with = "f64_or_nan")]
    pub lr: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub reward_mean: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub reward_std: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub success_rate: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub em: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub sub_em: f64,
    /// Mean answer gain over all rollouts and over the successful ones (nats/token).
    #[serde(deserialize_with = "f64_or_nan")]
    pub gain_mean: f64,
    pub gain_mean_success: Option<f64>,
    #[serde(deserialize_with = "f64_or_nan")]
    pub gain_std: f64,
    /// Groups whose rewards were not all equal (the ones GRPO learns from).
    pub informative_groups: usize,
    #[serde(deserialize_with = "f64_or_nan")]
    pub loss: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub kl_mean: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub clip_frac: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub entropy: f64,
    pub grad_norm: Option<f64>,
    pub skipped: Option<String>,
    pub gen_tokens: usize,
    /// Prompt + response tokens of all conversations, and of those that went through the
    /// forward/backward (advantage ≠ 0 or a KL term).
    pub train_tokens: usize,
    pub trained_tokens: usize,
    pub response_tokens: usize,
    #[serde(deserialize_with = "f64_or_nan")]
    pub gen_tokens_per_s: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub train_tokens_per_s: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub prefill_saving: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub rollout_s: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub score_s: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub update_s: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub step_s: f64,
}

/// serde_json writes NaN/Inf as `null`; read them back as NaN (a skipped step's loss may be NaN).
fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

pub struct Trainer<B: TrainBackend> {
    pub cfg: TrainConfig,
    pub model: Model<B>,
    pub opt: AdamW<B>,
    pub step: usize,
    pub cursor: DataCursor,
    queries: Vec<AgentQuery>,
    templates: Templates,
}

fn ckpt_root(out: &Path) -> PathBuf {
    out.join("checkpoints")
}

/// The newest complete checkpoint under `out`, if any.
pub fn latest_checkpoint(out: &Path) -> Option<PathBuf> {
    let mut best: Option<(usize, PathBuf)> = None;
    for e in std::fs::read_dir(ckpt_root(out)).ok()?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(n) = name.strip_prefix("step-").and_then(|s| s.parse::<usize>().ok()) else { continue };
        if e.path().join("state.json").exists() && best.as_ref().is_none_or(|b| n > b.0) {
            best = Some((n, e.path()));
        }
    }
    best.map(|b| b.1)
}

impl<B: TrainBackend> Trainer<B> {
    /// A new run (or, with `resume`, the continuation of the run in `cfg.out`). `make_model`
    /// loads the base model on the backend.
    pub fn new(mut cfg: TrainConfig, resume: bool, queries: Vec<AgentQuery>, make_model: impl FnOnce(&Path) -> Result<Model<B>>) -> Result<Self> {
        let mut resumed: Option<(PathBuf, CheckpointState)> = None;
        if resume {
            let dir = latest_checkpoint(&cfg.out)
                .with_context(|| format!("--resume: no checkpoint under {}", ckpt_root(&cfg.out).display()))?;
            let text = std::fs::read_to_string(dir.join("state.json")).with_context(|| format!("reading {}", dir.join("state.json").display()))?;
            let st: CheckpointState = serde_json::from_str(&text).with_context(|| format!("{} is not a valid checkpoint state", dir.display()))?;
            // the checkpoint defines the run; only its length and saving cadence may change
            let (steps, save_every, keep) = (cfg.steps, cfg.save_every, cfg.keep_checkpoints);
            cfg = st.config.clone();
            cfg.steps = steps.max(st.step);
            cfg.save_every = save_every;
            cfg.keep_checkpoints = keep;
            resumed = Some((dir, st));
        }
        cfg.validate()?;
        ensure!(!queries.is_empty(), "the training data has no records");
        let templates = match &cfg.templates {
            Some(p) => Templates::load(p)?,
            None => Templates::default(),
        };
        let mut model = make_model(cfg.model.as_deref().unwrap())?;
        model.tokenizer().context("training needs a model with a tokenizer and a chat template")?;
        let adapter = match (&resumed, &cfg.init_adapter) {
            (Some((dir, _)), _) => LoraAdapter::load(&dir.join("adapter"), &model.cfg)?,
            (None, Some(p)) => LoraAdapter::load(p, &model.cfg)?,
            (None, None) => {
                let mut a = LoraAdapter::init(&model.cfg, cfg.lora_r, cfg.lora_alpha, &cfg.targets()?, cfg.seed);
                a.base_model_name = cfg.model.as_ref().map(|p| p.display().to_string());
                a
            }
        };
        model.set_adapter(adapter)?;
        let mut opt = AdamW::new(&model, AdamWConfig { lr: cfg.lr as f32, weight_decay: cfg.weight_decay as f32, max_grad_norm: (cfg.grad_clip > 0.0).then_some(cfg.grad_clip as f32), ..Default::default() })?;
        let (step, cursor) = match resumed {
            Some((dir, st)) => {
                let set = SafetensorsSet::open_files(&[dir.join("optimizer.safetensors")])?;
                opt.load_state(&model, &set, st.adam_step)?;
                ensure!(st.cursor.order.len() == queries.len(), "the checkpoint was made with {} training records, the data now has {}", st.cursor.order.len(), queries.len());
                eprintln!("resuming from {} (step {})", dir.display(), st.step);
                (st.step, st.cursor)
            }
            None => (0, DataCursor::new(queries.len(), cfg.seed)),
        };
        Ok(Trainer { cfg, model, opt, step, cursor, queries, templates })
    }

    /// Run until `cfg.steps`. `on_step` sees every step's metrics (progress bars, logs).
    pub fn run(&mut self, mut on_step: impl FnMut(&StepMetrics)) -> Result<()> {
        std::fs::create_dir_all(&self.cfg.out).with_context(|| format!("cannot create {}", self.cfg.out.display()))?;
        let metrics_path = self.cfg.out.join("metrics.jsonl");
        self.truncate_metrics(&metrics_path)?;
        crate::util::fs::write_atomic_str(&self.cfg.out.join("config.toml"), &toml::to_string_pretty(&self.cfg)?)?;
        while self.step < self.cfg.steps {
            match self.one_step() {
                Ok(m) => {
                    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&metrics_path)?;
                    writeln!(f, "{}", serde_json::to_string(&m)?)?;
                    f.sync_data()?;
                    on_step(&m);
                    if self.cfg.save_every > 0 && self.step % self.cfg.save_every == 0 && self.step < self.cfg.steps {
                        self.save_checkpoint()?;
                    }
                }
                Err(e) if interrupt::is_interrupted(&e) => {
                    // the interrupted step changed nothing: save the last completed one
                    let dir = self.save_checkpoint()?;
                    eprintln!("interrupted: saved step {} to {}; continue with --resume", self.step, dir.display());
                    return Err(e);
                }
                Err(e) => return Err(e.context(format!("step {}", self.step + 1))),
            }
        }
        self.save_checkpoint()?;
        self.model.lora.as_ref().unwrap().host.save_peft(&self.cfg.out.join("adapter"))?;
        self.plot(&metrics_path)?;
        Ok(())
    }

    fn one_step(&mut self) -> Result<StepMetrics> {
        interrupt::check()?;
        let t_step = Instant::now();
        let s = self.step;
        let (idx, next_cursor) = self.cursor.peek(self.cfg.queries_per_step);
        let batch: Vec<AgentQuery> = idx.iter().map(|&i| self.queries[i].clone()).collect();
        let mut m = StepMetrics { step: s + 1, lr: self.cfg.lr_at(s), ..Default::default() };

        // ---- rollouts with the live policy ----
        let acfg = self.cfg.agent(self.cfg.seed ^ (s as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let kv_tokens = batch.len() * (self.cfg.group_size + 3) * (600 + 2 * self.cfg.chunk_tokens + self.cfg.memory_tokens + self.cfg.answer_tokens);
        let mut kv = runtime::kv_for(&self.model, kv_tokens)?;
        let (mut groups, st) = agent::rollout(&self.model, &mut kv, &batch, &acfg, &self.templates, |_, _| {})?;
        drop(kv);
        m.rollout_s = st.update_s + st.final_s;
        m.score_s = st.score_s;
        m.gen_tokens = st.generated_tokens;
        m.gen_tokens_per_s = st.generated_tokens as f64 / m.rollout_s.max(1e-9);
        m.prefill_saving = st.prefill_saving();

        // ---- rewards and advantages ----
        let norm = AdvNorm::parse(&self.cfg.adv_norm)?;
        let mut convs: Vec<Conversation> = Vec::new();
        for g in groups.iter_mut() {
            if let Err(e) = reward::assign(g, self.cfg.reward, self.cfg.beta) {
                // e.g. a NaN gain from a broken policy: never turn it into an update
                m.skipped = Some(format!("{e:#}"));
                for t in g.iter_mut() {
                    t.reward = Some(t.outcome);
                }
            }
            let rewards: Vec<f64> = g.iter().map(|t| t.reward.unwrap()).collect();
            if rewards.iter().any(|r| (r - rewards[0]).abs() > 1e-12) {
                m.informative_groups += 1;
            }
            let adv = grpo::group_advantages(&rewards, norm);
            let turns = g.iter().map(|t| t.conversations.iter().map(|c| (c.prompt_ids.clone(), c.gen_ids.clone())).collect()).collect();
            convs.extend(grpo::broadcast_advantages(turns, &adv)?);
        }
        let all: Vec<&Trajectory> = groups.iter().flatten().collect();
        let n = all.len() as f64;
        let rewards: Vec<f64> = all.iter().map(|t| t.reward.unwrap()).collect();
        m.reward_mean = rewards.iter().sum::<f64>() / n;
        m.reward_std = (rewards.iter().map(|r| (r - m.reward_mean).powi(2)).sum::<f64>() / n).sqrt();
        m.success_rate = all.iter().map(|t| t.outcome).sum::<f64>() / n;
        m.em = all.iter().map(|t| t.em).sum::<f64>() / n;
        m.sub_em = all.iter().map(|t| t.sub_em).sum::<f64>() / n;
        let gains: Vec<f64> = all.iter().filter_map(|t| t.gain).collect();
        if !gains.is_empty() {
            // (non-finite gains are reported as they are; the update is skipped above)
            m.gain_mean = gains.iter().sum::<f64>() / gains.len() as f64;
            m.gain_std = (gains.iter().map(|g| (g - m.gain_mean).powi(2)).sum::<f64>() / gains.len() as f64).sqrt();
        }
        let gs: Vec<f64> = all.iter().filter(|t| t.outcome == 1.0).filter_map(|t| t.gain).collect();
        m.gain_mean_success = (!gs.is_empty()).then(|| gs.iter().sum::<f64>() / gs.len() as f64);

        // ---- GRPO update: micro-batches, token-mean loss over the whole batch ----
        let t_up = Instant::now();
        convs.retain(|c| !c.response.is_empty());
        let response_tokens: usize = convs.iter().map(|c| c.response.len()).sum();
        m.response_tokens = response_tokens;
        m.train_tokens = convs.iter().map(|c| c.prompt.len() + c.response.len()).sum();
        let gcfg = GrpoConfig { eps_low: self.cfg.clip_low, eps_high: self.cfg.clip_high, kl_coef: self.cfg.kl_coef, token_norm: response_tokens };
        // Without a KL term, a conversation with advantage 0 adds exactly nothing to the
        // gradient (its tokens still count in the token mean N): skip its forward/backward.
        // Groups whose rollouts all got the same reward are the common case early on.
        if self.cfg.kl_coef == 0.0 {
            convs.retain(|c| c.advantage != 0.0);
        }
        m.trained_tokens = convs.iter().map(|c| c.prompt.len() + c.response.len()).sum();
        let mut total = GrpoStats::default();
        let mut grads: Option<LoraGrads<B>> = None;
        let (mut kl_w, mut ent_w) = (0.0, 0.0);
        for mb in micro_batches(&convs, self.cfg.micro_batch_tokens) {
            if m.skipped.is_some() {
                break;
            }
            interrupt::check()?;
            let (stats, g) = match grpo::loss_and_grads(&self.model, mb, &gcfg) {
                Ok(x) => x,
                Err(e) if e.downcast_ref::<NonFinite>().is_some() => {
                    m.skipped = Some(format!("{e}; the adapter was not updated"));
                    break;
                }
                Err(e) => return Err(e),
            };
            total.loss += stats.loss;
            total.response_tokens += stats.response_tokens;
            total.clipped_tokens += stats.clipped_tokens;
            kl_w += stats.kl_mean * stats.kl_tokens as f64;
            total.kl_tokens += stats.kl_tokens;
            ent_w += stats.entropy_mean * stats.response_tokens as f64;
            match &mut grads {
                None => grads = Some(g),
                Some(acc) => acc.add(&self.model.be, &g)?,
            }
        }
        m.loss = total.loss;
        m.clip_frac = total.clipped_tokens as f64 / total.response_tokens.max(1) as f64;
        m.kl_mean = if total.kl_tokens > 0 { kl_w / total.kl_tokens as f64 } else { 0.0 };
        m.entropy = ent_w / total.response_tokens.max(1) as f64;
        match grads {
            _ if m.skipped.is_some() => {}
            None if response_tokens > 0 => m.skipped = Some("every group's rewards were equal: no learning signal (advantages all 0)".into()),
            None => m.skipped = Some("no generated tokens in the batch".into()),
            Some(g) => {
                let norm2 = g.sum_squares(&self.model.be)?;
                if !m.loss.is_finite() {
                    m.skipped = Some(format!("non-finite loss ({}); the adapter was not updated", m.loss));
                } else if !norm2.is_finite() {
                    m.skipped = Some(format!("non-finite gradient norm ({norm2}); the adapter was not updated"));
                } else {
                    self.opt.cfg.lr = m.lr as f32;
                    m.grad_norm = Some(self.opt.step(&mut self.model, &g)?);
                }
            }
        }
        if let Some(why) = &m.skipped {
            eprintln!("step {}: skipped update: {why}", s + 1);
        }
        // the optimizer step may still be running on a GPU: time what the device did
        self.model.be.synchronize()?;
        m.update_s = t_up.elapsed().as_secs_f64();
        m.train_tokens_per_s = m.trained_tokens as f64 / m.update_s.max(1e-9);
        m.step_s = t_step.elapsed().as_secs_f64();
        // the step is complete: commit the data position
        self.cursor = next_cursor;
        self.step += 1;
        Ok(m)
    }

    /// Write `out/checkpoints/step-NNNNNN` atomically (temp dir + rename); keep the newest few.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let root = ckpt_root(&self.cfg.out);
        std::fs::create_dir_all(&root)?;
        let final_dir = root.join(format!("step-{:06}", self.step));
        if final_dir.join("state.json").exists() {
            return Ok(final_dir);
        }
        let tmp = root.join(format!(".tmp-step-{:06}-{}", self.step, std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        self.model.lora.as_ref().unwrap().host.save_peft(&tmp.join("adapter"))?;
        write_safetensors(&tmp.join("optimizer.safetensors"), &self.opt.state_tensors(&self.model)?, None)?;
        let st = CheckpointState { step: self.step, cursor: self.cursor.clone(), config: self.cfg.clone(), adam_step: self.opt.step };
        crate::util::fs::write_atomic_str(&tmp.join("state.json"), &serde_json::to_string_pretty(&st)?)?;
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir)?;
        }
        std::fs::rename(&tmp, &final_dir).with_context(|| format!("cannot move checkpoint into {}", final_dir.display()))?;
        if let Ok(d) = std::fs::File::open(&root) {
            let _ = d.sync_all();
        }
        // prune old checkpoints
        let mut steps: Vec<(usize, PathBuf)> = std::fs::read_dir(&root)?
            .flatten()
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().strip_prefix("step-")?.parse::<usize>().ok()?;
                Some((n, e.path()))
            })
            .collect();
        steps.sort();
        let keep = self.cfg.keep_checkpoints.max(1);
        for (_, p) in steps.iter().take(steps.len().saturating_sub(keep)) {
            let _ = std::fs::remove_dir_all(p);
        }
        Ok(final_dir)
    }

    /// Drop metric lines of steps after the current one (left by a run that died before saving).
    fn truncate_metrics(&self, path: &Path) -> Result<()> {
        let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
        let kept: Vec<&str> = text
            .lines()
            .filter(|l| serde_json::from_str::<StepMetrics>(l).map(|m| m.step <= self.step).unwrap_or(false))
            .collect();
        let mut out = kept.join("\n");
        if !out.is_empty() {
            out.push('\n');
        }
        crate::util::fs::write_atomic_str(path, &out)
    }

    fn plot(&self, metrics_path: &Path) -> Result<()> {
        let text = std::fs::read_to_string(metrics_path)?;
        let ms: Vec<StepMetrics> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let series = |name: &str, f: &dyn Fn(&StepMetrics) -> f64| Series { name: name.into(), points: ms.iter().map(|m| (m.step as f64, f(m))).collect() };
        Chart {
            title: format!("GRPO ({}) on {}", self.cfg.reward.name(), self.cfg.data.as_ref().map(|p| p.display().to_string()).unwrap_or_default()),
            x_label: "step".into(),
            y_label: "per-step mean".into(),
            series: vec![series("reward", &|m| m.reward_mean), series("success rate", &|m| m.success_rate), series("gain (nats/token)", &|m| m.gain_mean)],
            y_range: None,
            x_ticks_at_data: false,
        }
        .save_png(&self.cfg.out.join("curves.png"), 960, 560)
    }
}

/// Consecutive conversations grouped so each group stays within `budget` tokens (a longer single
/// conversation forms its own group).
pub fn micro_batches(convs: &[Conversation], budget: usize) -> Vec<&[Conversation]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for (i, c) in convs.iter().enumerate() {
        let t = c.prompt.len() + c.response.len();
        if i > start && used + t > budget {
            out.push(&convs[start..i]);
            start = i;
            used = 0;
        }
        used += t;
    }
    if start < convs.len() {
        out.push(&convs[start..]);
    }
    out
}

/// The configuration saved with the newest checkpoint under `out`.
pub fn saved_config(out: &Path) -> Result<TrainConfig> {
    let dir = latest_checkpoint(out).with_context(|| format!("--resume: no checkpoint under {}", ckpt_root(out).display()))?;
    let text = std::fs::read_to_string(dir.join("state.json")).with_context(|| format!("reading {}", dir.join("state.json").display()))?;
    let st: CheckpointState = serde_json::from_str(&text).with_context(|| format!("{} is not a valid checkpoint state", dir.display()))?;
    Ok(st.config)
}

/// Refuse an output directory that holds another run unless resuming.
pub fn check_fresh_out(out: &Path, resume: bool) -> Result<()> {
    if !resume && latest_checkpoint(out).is_some() {
        bail!(
            "{} already holds a training run (checkpoints exist): pass --resume to continue it, or choose another --out",
            out.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_and_cursor() {
        let c = TrainConfig { lr: 1.0, warmup_steps: 3, steps: 13, schedule: Schedule::Cosine, ..Default::default() };
        assert_eq!(c.lr_at(0), 0.25);
        assert_eq!(c.lr_at(3), 1.0);
        assert!((c.lr_at(13) - 0.1).abs() < 1e-12);
        let cur = DataCursor::new(3, 7);
        let (a, c1) = cur.peek(2);
        let (b, c2) = c1.peek(2);
        assert_eq!(c2.epoch, 1);
        let mut seen = a.clone();
        seen.push(b[0]);
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2], "an epoch visits every record once");
        assert_eq!(cur.peek(2).0, a, "peek does not advance");
    }

    #[test]
    fn micro_batches_respect_the_budget() {
        let conv = |n| Conversation { prompt: vec![1; n], response: vec![2; 1], ..Default::default() };
        let cs = vec![conv(4), conv(4), conv(9), conv(1)];
        let mb = micro_batches(&cs, 10);
        assert_eq!(mb.iter().map(|m| m.len()).collect::<Vec<_>>(), vec![2, 1, 1]);
    }
}
