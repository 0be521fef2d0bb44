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
use crate::agent::{self, Templates, Trajectory};
use crate::backend::TrainBackend;
use crate::data::QaRecord;
use crate::model::lora::LoraAdapter;
use crate::model::weights::{write_safetensors, HostTensor, SafetensorsSet};
use crate::reward;
use crate::runtime::{self, backward::{LoraGrads, NonFinite}, Model};
use crate::util::interrupt;
use crate::util::plot::{Chart, Series};
use crate::util::rng::Rng;
use crate::util::sha256::sha256_file;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use super::config::{DataOrder, Schedule, TrainConfig, MAX_GROUP, MAX_LORA_R, MAX_NONFINITE_STEPS_IN_A_ROW, MAX_QUERIES, MAX_STEPS, MAX_TOKENS};

/// Where the data stream stands (saved in checkpoints).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataCursor {
    pub epoch: usize,
    pub pos: usize,
    pub order: Vec<usize>,
    pub rng: Rng,
    /// Reshuffle at every new pass (`DataOrder::Shuffled`; checkpoints before it existed were).
    #[serde(default = "yes")]
    pub shuffled: bool,
}

fn yes() -> bool {
    true
}

impl DataCursor {
    pub fn new(n: usize, seed: u64) -> Self {
        Self::with_order(n, seed, DataOrder::Shuffled)
    }

    pub fn with_order(n: usize, seed: u64, data_order: DataOrder) -> Self {
        let mut rng = Rng::derive(seed, 0xDA7A);
        let mut order: Vec<usize> = (0..n).collect();
        let shuffled = data_order == DataOrder::Shuffled;
        if shuffled {
            rng.shuffle(&mut order);
        }
        DataCursor { epoch: 0, pos: 0, order, rng, shuffled }
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
                if c.shuffled {
                    c.rng.shuffle(&mut c.order);
                }
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
    /// SHA-256 of the training data file (checked on `--resume`; absent in older checkpoints and
    /// when the records did not come from a file).
    #[serde(default)]
    data_sha256: Option<String>,
    /// Fingerprints of the other files the run reads (`input_fingerprints`): checked on
    /// `--resume` like the data (absent in older checkpoints).
    #[serde(default)]
    inputs: BTreeMap<String, String>,
}

/// Model files up to this size are fingerprinted by content; larger ones (the weights) by size
/// and modification time, so that a resume does not read gigabytes to hash them.
const HASHED_FILE_BYTES: u64 = 64 << 20;

/// What the run reads besides its data, each file's fingerprint: the templates file and every
/// file of the model directory (config, tokenizer, chat template, weights). An input edited in
/// place would otherwise change a resumed run in silence (a new `rms_norm_eps`, new prompts).
fn input_fingerprints(cfg: &TrainConfig) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut files: Vec<(String, PathBuf)> = cfg.templates.iter().map(|p| ("templates".to_string(), p.clone())).collect();
    if let Some(dir) = &cfg.model {
        let mut names: Vec<PathBuf> = std::fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))?.flatten().map(|e| e.path()).collect();
        names.retain(|p| p.is_file() && p.extension().is_some_and(|x| x == "json" || x == "safetensors" || x == "jinja"));
        names.sort();
        files.extend(names.into_iter().map(|p| (format!("model/{}", p.file_name().unwrap_or_default().to_string_lossy()), p)));
    }
    for (key, p) in files {
        let m = std::fs::metadata(&p).with_context(|| format!("cannot read {}", p.display()))?;
        let fp = if m.len() <= HASHED_FILE_BYTES {
            format!("sha256:{}", sha256_file(&p)?)
        } else {
            let mtime = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
            format!("size:{} mtime_ns:{mtime}", m.len())
        };
        out.insert(key, fp);
    }
    Ok(out)
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
    /// Share of the rollouts whose final answer used its whole budget (`answer_tokens`) without
    /// ending: a policy drifting into long replies loses answers to it (absent in older logs).
    #[serde(default)]
    pub answer_cut: Option<f64>,
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
    queries: Vec<QaRecord>,
    templates: Templates,
    data_sha256: Option<String>,
    inputs: BTreeMap<String, String>,
    /// Non-finite updates skipped in a row (see MAX_NONFINITE_STEPS_IN_A_ROW).
    nonfinite_in_a_row: usize,
    /// The optimizer moments after the last good update: what a non-finite update is undone to
    /// (kept here so each step downloads the moments once).
    good_moments: Option<BTreeMap<String, HostTensor>>,
}

/// The state an update can change, taken just before it.
struct Snapshot {
    adapter: LoraAdapter,
    moments: BTreeMap<String, HostTensor>,
    adam_step: u64,
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
    /// loads the base model on the backend. A resumed run takes everything from its newest
    /// checkpoint except `out`, `steps`, `save_every` and `keep_checkpoints` (see
    /// [`resume_config`] for refusing other changes); its data file must hash as it did.
    pub fn new(mut cfg: TrainConfig, resume: bool, queries: Vec<QaRecord>, make_model: impl FnOnce(&Path) -> Result<Model<B>>) -> Result<Self> {
        let mut resumed: Option<(PathBuf, CheckpointState)> = None;
        if resume {
            let (dir, st) = read_latest_state(&cfg.out)?;
            cfg = merge_resumed(st.config.clone(), st.step, &cfg);
            resumed = Some((dir, st));
        }
        cfg.validate()?;
        ensure!(!queries.is_empty(), "the training data has no records");
        for p in remove_stale_partial_checkpoints(&cfg.out) {
            eprintln!("removed {}: a partial checkpoint of a process that is gone", p.display());
        }
        // what a fresh adapter records as its base: the path as given (PEFT's convention)
        let base_model_name = cfg.model.as_ref().map(|p| p.display().to_string());
        // saved absolute, so the run means the same from any working directory
        for p in [&mut cfg.model, &mut cfg.data, &mut cfg.init_adapter, &mut cfg.templates].into_iter().flatten() {
            *p = crate::util::fs::absolute_path(p);
        }
        let data_sha256 = match &cfg.data {
            Some(p) if p.is_file() => Some(sha256_file(p)?),
            _ => None,
        };
        if let Some((dir, st)) = &resumed {
            if let Some(saved) = &st.data_sha256 {
                let path = cfg.data.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
                match &data_sha256 {
                    Some(now) if now == saved => {}
                    Some(now) => bail!(
                        "--resume: the training data {path} changed since {} was saved (sha256 {saved} then, {now} now); \
                         resume with the data the run started with, or start a new run in another --out",
                        dir.display()
                    ),
                    None => bail!("--resume: the training data {path} of {} is gone (its sha256 was {saved})", dir.display()),
                }
            }
        }
        let inputs = input_fingerprints(&cfg)?;
        if let Some((dir, st)) = &resumed {
            let changed: Vec<String> = st
                .inputs
                .iter()
                .filter(|(k, v)| inputs.get(*k) != Some(*v))
                .map(|(k, v)| format!("{k} ({v} then, {} now)", inputs.get(k).map_or("gone", |s| s.as_str())))
                .collect();
            if !changed.is_empty() {
                bail!(
                    "--resume: files the run reads changed since {} was saved: {}; resume with the files the run started with, or start a new run in another --out",
                    dir.display(),
                    changed.join("; ")
                );
            }
        }
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
                a.base_model_name = base_model_name;
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
            None => (0, DataCursor::with_order(queries.len(), cfg.seed, cfg.data_order)),
        };
        Ok(Trainer { cfg, model, opt, step, cursor, queries, templates, data_sha256, inputs, nonfinite_in_a_row: 0, good_moments: None })
    }

    /// Run until `cfg.steps`. `on_step` sees every step's metrics (progress bars, logs).
    pub fn run(&mut self, mut on_step: impl FnMut(&StepMetrics)) -> Result<()> {
        std::fs::create_dir_all(&self.cfg.out).with_context(|| format!("cannot create {}", self.cfg.out.display()))?;
        let metrics_path = self.cfg.out.join("metrics.jsonl");
        self.truncate_metrics(&metrics_path)?;
        crate::util::fs::write_atomic_str(&self.cfg.out.join("config.toml"), &toml::to_string_pretty(&self.cfg)?)?;
        while self.step < self.cfg.steps {
            match self.one_step() {
                Ok((m, nonfinite)) => {
                    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&metrics_path)?;
                    writeln!(f, "{}", serde_json::to_string(&m)?)?;
                    f.sync_data()?;
                    on_step(&m);
                    self.nonfinite_in_a_row = if nonfinite { self.nonfinite_in_a_row + 1 } else { 0 };
                    if self.nonfinite_in_a_row >= MAX_NONFINITE_STEPS_IN_A_ROW {
                        // every such step was undone: the state saved is that of the last good one
                        let dir = self.save_checkpoint()?;
                        bail!(
                            "stopping at step {}: {MAX_NONFINITE_STEPS_IN_A_ROW} steps in a row were skipped for non-finite values (last: {}); \
                             each was undone, so the adapter is that of the last good step (saved in {}). Lower --lr, keep --grad-clip on, \
                             or check the model, adapter and data",
                            self.step,
                            m.skipped.as_deref().unwrap_or("?"),
                            dir.display()
                        );
                    }
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

    /// One step; also says whether its update was skipped for a non-finite value.
    fn one_step(&mut self) -> Result<(StepMetrics, bool)> {
        interrupt::check()?;
        let t_step = Instant::now();
        let s = self.step;
        let (idx, next_cursor) = self.cursor.peek(self.cfg.queries_per_step);
        let batch: Vec<QaRecord> = idx.iter().map(|&i| self.queries[i].clone()).collect();
        let mut m = StepMetrics { step: s + 1, lr: self.cfg.lr_at(s), ..Default::default() };
        let mut nonfinite = false;

        // ---- rollouts with the live policy ----
        let acfg = self.cfg.agent(self.cfg.seed ^ (s as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let kv_tokens = agent::rollout_kv_tokens(&self.cfg.budget(), self.cfg.group_size, batch.iter().map(|r| r.question.as_str()));
        let mut kv = runtime::kv_for(&self.model, kv_tokens)?;
        let (mut groups, st) = match agent::rollout(&self.model, &mut kv, &batch, &acfg, &self.templates, |_, _| {}) {
            Ok(x) => x,
            Err(e) if is_non_finite_logits(&e) => {
                // a poisoned policy (NaN/Inf in the adapter, or overflowing activations) has
                // nothing to learn from: skip the step like a NaN loss (counted, see run)
                m.skipped = Some(format!("non-finite logits in the rollouts ({e:#}); the adapter was not updated"));
                eprintln!("step {}: skipped update: {}", s + 1, m.skipped.as_deref().unwrap_or_default());
                m.step_s = t_step.elapsed().as_secs_f64();
                self.cursor = next_cursor;
                self.step += 1;
                return Ok((m, true));
            }
            Err(e) => return Err(e),
        };
        drop(kv);
        m.rollout_s = st.update_s + st.final_s;
        m.score_s = st.score_s;
        m.gen_tokens = st.generated_tokens;
        m.gen_tokens_per_s = st.generated_tokens as f64 / m.rollout_s.max(1e-9);
        m.prefill_saving = st.prefill_saving();

        // ---- rewards and advantages ----
        let norm = AdvNorm::parse(&self.cfg.adv_norm)?;
        for g in groups.iter_mut() {
            let signals: Vec<_> = g.iter().map(Trajectory::reward_signals).collect();
            let rewards = reward::assign(&signals, self.cfg.reward, self.cfg.beta).unwrap_or_else(|e| {
                // e.g. a NaN gain from a broken policy: never turn it into an update
                m.skipped = Some(format!("{e:#}"));
                nonfinite = true;
                signals.iter().map(|s| s.outcome).collect()
            });
            for (t, &r) in g.iter_mut().zip(&rewards) {
                t.reward = Some(r);
            }
            if rewards.iter().any(|r| (r - rewards[0]).abs() > 1e-12) {
                m.informative_groups += 1;
            }
            let adv = grpo::group_advantages(&rewards, norm);
            grpo::broadcast_advantages(g, &adv)?;
        }
        let all: Vec<&Trajectory> = groups.iter().flatten().collect();
        let n = all.len() as f64;
        let rewards: Vec<f64> = all.iter().map(|t| t.reward.unwrap()).collect();
        m.reward_mean = rewards.iter().sum::<f64>() / n;
        m.reward_std = (rewards.iter().map(|r| (r - m.reward_mean).powi(2)).sum::<f64>() / n).sqrt();
        m.success_rate = all.iter().map(|t| t.outcome).sum::<f64>() / n;
        m.em = all.iter().map(|t| t.em).sum::<f64>() / n;
        m.sub_em = all.iter().map(|t| t.sub_em).sum::<f64>() / n;
        let cut: Vec<bool> = all.iter().filter_map(|t| t.answer_cut()).collect();
        m.answer_cut = (!cut.is_empty()).then(|| cut.iter().filter(|&&c| c).count() as f64 / cut.len() as f64);
        let gains: Vec<f64> = all.iter().filter_map(|t| t.gain).collect();
        if !gains.is_empty() {
            // (non-finite gains are reported as they are; the update is skipped above)
            m.gain_mean = gains.iter().sum::<f64>() / gains.len() as f64;
            m.gain_std = (gains.iter().map(|g| (g - m.gain_mean).powi(2)).sum::<f64>() / gains.len() as f64).sqrt();
        }
        let gs: Vec<f64> = all.iter().filter(|t| t.outcome == 1.0).filter_map(|t| t.gain).collect();
        m.gain_mean_success = (!gs.is_empty()).then(|| gs.iter().sum::<f64>() / gs.len() as f64);
        let mut convs: Vec<Conversation> = groups.into_iter().flatten().flat_map(|t| t.turns.into_iter().map(|turn| turn.conv)).collect();

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
                Err(e) if e.downcast_ref::<NonFinite>().is_some() || is_non_finite_logits(&e) => {
                    m.skipped = Some(format!("{e}; the adapter was not updated"));
                    nonfinite = true;
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
                    nonfinite = true;
                } else if !norm2.is_finite() {
                    m.skipped = Some(format!("non-finite gradient norm ({norm2}); the adapter was not updated"));
                    nonfinite = true;
                } else {
                    self.opt.cfg.lr = m.lr as f32;
                    let before = self.snapshot()?;
                    m.grad_norm = Some(self.opt.step(&mut self.model, &g)?);
                    // finite gradients can still overflow AdamW's moments or the parameters
                    let after = self.opt.state_tensors(&self.model)?;
                    let bad = non_finite_lora(&self.model.lora.as_ref().unwrap().host).or_else(|| non_finite_tensor(&after));
                    match bad {
                        None => self.good_moments = Some(after),
                        Some(name) => {
                            self.restore(before)?;
                            m.skipped = Some(format!("non-finite values in {name} after the update; the adapter and optimizer state were restored"));
                            nonfinite = true;
                        }
                    }
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
        Ok((m, nonfinite))
    }

    /// The adapter, the optimizer moments and its step count, before an update.
    fn snapshot(&mut self) -> Result<Snapshot> {
        let moments = match self.good_moments.take() {
            Some(m) => m,
            None => self.opt.state_tensors(&self.model)?,
        };
        Ok(Snapshot { adapter: self.model.lora.as_ref().context("no LoRA adapter")?.host.clone(), moments, adam_step: self.opt.step })
    }

    /// Undo an update: the adapter (host copy and device buffers) and the optimizer state as
    /// they were in `s`.
    fn restore(&mut self, s: Snapshot) -> Result<()> {
        self.model.lora.as_mut().context("no LoRA adapter")?.host = s.adapter;
        self.model.sync_adapter()?;
        // AdamW restores its moments from a safetensors file only (as on --resume): a temp one
        let (tmp, f) = crate::util::fs::create_temp_file(&self.cfg.out, "optimizer-restore.safetensors")?;
        drop(f);
        let res = write_safetensors(&tmp, &s.moments, None)
            .and_then(|_| SafetensorsSet::open_files(std::slice::from_ref(&tmp)))
            .and_then(|set| self.opt.load_state(&self.model, &set, s.adam_step));
        let _ = std::fs::remove_file(&tmp);
        res.context("cannot restore the optimizer state after a non-finite update")?;
        self.good_moments = Some(s.moments);
        Ok(())
    }

    /// Write `out/checkpoints/step-NNNNNN` atomically (temp dir + rename); keep the newest few.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let root = ckpt_root(&self.cfg.out);
        std::fs::create_dir_all(&root)?;
        let final_dir = root.join(format!("step-{:06}", self.step));
        if final_dir.join("state.json").exists() {
            return Ok(final_dir);
        }
        // a new directory (mkdir is exclusive), named `.tmp-step-N-PID-RANDOM` so a later run can
        // tell a dead process's leftover (remove_stale_partial_checkpoints)
        let tmp = crate::util::fs::create_temp_dir(&root, &format!(".tmp-step-{:06}", self.step))?;
        let res = (|| -> Result<()> {
            self.model.lora.as_ref().unwrap().host.save_peft(&tmp.join("adapter"))?;
            write_safetensors(&tmp.join("optimizer.safetensors"), &self.opt.state_tensors(&self.model)?, None)?;
            let st = CheckpointState { step: self.step, cursor: self.cursor.clone(), config: self.cfg.clone(), adam_step: self.opt.step, data_sha256: self.data_sha256.clone(), inputs: self.inputs.clone() };
            crate::util::fs::write_atomic_str(&tmp.join("state.json"), &serde_json::to_string_pretty(&st)?)?;
            if final_dir.exists() {
                std::fs::remove_dir_all(&final_dir)?;
            }
            std::fs::rename(&tmp, &final_dir).with_context(|| format!("cannot move checkpoint into {}", final_dir.display()))
        })();
        if let Err(e) = res {
            // e.g. a full disk: no half checkpoint is left behind
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e.context(format!("cannot save the checkpoint of step {} under {}", self.step, root.display())));
        }
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

/// The newest checkpoint under `out` and its state.
fn read_latest_state(out: &Path) -> Result<(PathBuf, CheckpointState)> {
    let dir = latest_checkpoint(out).with_context(|| format!("--resume: no checkpoint under {}", ckpt_root(out).display()))?;
    let text = std::fs::read_to_string(dir.join("state.json")).with_context(|| format!("reading {}", dir.join("state.json").display()))?;
    let st: CheckpointState = serde_json::from_str(&text).with_context(|| format!("{} is not a valid checkpoint state", dir.display()))?;
    Ok((dir, st))
}

/// The settings a resumed run may change: where it is written (always `--out`, wherever the
/// checkpoint was made), how long it runs and how often it saves.
pub const RESUME_MAY_CHANGE: &[&str] = &["out", "steps", "save_every", "keep_checkpoints"];

/// The saved configuration of a run with the changeable settings taken from `requested`.
fn merge_resumed(mut saved: TrainConfig, saved_step: usize, requested: &TrainConfig) -> TrainConfig {
    saved.out = requested.out.clone();
    saved.steps = requested.steps.max(saved_step);
    saved.save_every = requested.save_every;
    saved.keep_checkpoints = requested.keep_checkpoints;
    // data given again at another path: `resume_config` let it through only with the saved
    // content (and `Trainer::new` checks the hash again)
    if requested.data.is_some() {
        saved.data = requested.data.clone();
    }
    saved
}

/// The configuration of the run in `requested.out` to resume: its newest checkpoint's, with
/// `out`, `steps`, `save_every` and `keep_checkpoints` from `requested`. Every other setting in
/// `explicit` (given as a flag or in the config file) must equal the saved one (paths compared
/// as absolute paths), or the resume is refused naming each difference: a resumed run silently
/// ignoring a changed --lr or --data would be a different run than the one asked for.
pub fn resume_config(requested: &TrainConfig, explicit: &BTreeSet<String>) -> Result<TrainConfig> {
    let (dir, st) = read_latest_state(&requested.out)?;
    if explicit.contains("steps") && requested.steps < st.step {
        bail!(
            "--resume --steps {}: the run in {} is already at step {}; --steps is the new total, so pass at least {} (nothing was changed)",
            requested.steps,
            requested.out.display(),
            st.step,
            st.step
        );
    }
    // the requested values in range first (a NaN would otherwise show as a mere difference);
    // model and data may come from the checkpoint
    TrainConfig { model: st.config.model.clone(), data: st.config.data.clone(), ..requested.clone() }.validate()?;
    let (saved, now) = (serde_json::to_value(&st.config)?, serde_json::to_value(requested)?);
    let show = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "(none)".to_string(),
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    let mut diffs = Vec::new();
    for key in explicit.iter().filter(|k| !RESUME_MAY_CHANGE.contains(&k.as_str())) {
        let (a, b) = (&saved[key.as_str()], &now[key.as_str()]);
        let same = match key.as_str() {
            // the same set of projections in any order
            "lora_targets" => st.config.targets().ok() == requested.targets().ok(),
            // the data is the same when its content is (a study, which identifies data by its
            // SHA-256, may name a moved copy): the run then reads it from the new path
            "data" if st.data_sha256.is_some() && requested.data.as_ref().is_some_and(|p| p.is_file() && sha256_file(p).ok() == st.data_sha256) => true,
            "model" | "data" | "init_adapter" | "templates" => {
                let abs = |v: &serde_json::Value| v.as_str().map(|p| crate::util::fs::absolute_path(Path::new(p)));
                abs(a) == abs(b)
            }
            // numbers went through JSON and back: equal up to the last bits
            _ => match (a.as_f64(), b.as_f64()) {
                (Some(x), Some(y)) => x == y || (x - y).abs() <= 1e-12 * x.abs().max(y.abs()),
                _ => a == b,
            },
        };
        if !same {
            let b = match key.as_str() {
                "model" | "data" | "init_adapter" | "templates" => b.as_str().map(|p| crate::util::fs::absolute_path(Path::new(p)).display().to_string()).unwrap_or_else(|| show(b)),
                _ => show(b),
            };
            diffs.push(format!("{key} is {} in the checkpoint but {b} now", show(a)));
        }
    }
    if !diffs.is_empty() {
        bail!(
            "--resume: {} was made with other settings: {}. A resumed run keeps the settings it started with (only --steps, --save-every and \
             --keep-checkpoints may change; they are in {}): drop the changed flags or config values, or start a new run in another --out",
            dir.display(),
            diffs.join("; "),
            requested.out.join("config.toml").display()
        );
    }
    Ok(merge_resumed(st.config, st.step, requested))
}

/// The files a run writes into its `--out` (what `--overwrite` deletes).
pub const RUN_FILES: &[&str] = &["checkpoints", "adapter", "metrics.jsonl", "config.toml", "curves.png"];

/// Refuse a fresh run in a non-empty `out` (another run's files would be overwritten or mixed
/// with this one's), unless `resume`; with `overwrite`, delete the previous run's files
/// ([`RUN_FILES`]) first and leave anything else there alone. The run-directory lock
/// (crate::util::lock::LOCK_FILE) does not count.
pub fn check_fresh_out(out: &Path, resume: bool, overwrite: bool) -> Result<()> {
    if resume {
        return Ok(());
    }
    let mut entries: Vec<String> = match std::fs::read_dir(out) {
        Ok(rd) => rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n != crate::util::lock::LOCK_FILE).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot read --out {}", out.display())),
    };
    if entries.is_empty() {
        return Ok(());
    }
    entries.sort();
    if overwrite {
        for name in RUN_FILES {
            let p = out.join(name);
            let res = match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(&p),
                Ok(_) => std::fs::remove_file(&p),
                Err(_) => continue,
            };
            res.with_context(|| format!("--overwrite: cannot delete {}", p.display()))?;
        }
        return Ok(());
    }
    let shown: Vec<&str> = entries.iter().take(8).map(|s| s.as_str()).collect();
    let more = if entries.len() > shown.len() { format!(" and {} more", entries.len() - shown.len()) } else { String::new() };
    let hint = if latest_checkpoint(out).is_some() { "It holds a training run: pass --resume to continue it," } else { "It has no checkpoint to --resume from: pass" };
    bail!(
        "--out {} is not empty (it has {}{more}); a fresh run would overwrite or mix with those files. {hint} \
         --overwrite to start over (deletes its {}; other files stay), or choose another --out",
        out.display(),
        shown.join(", "),
        RUN_FILES.join(", ")
    )
}

/// Remove `checkpoints/.tmp-step-N-PID[-RANDOM]` directories whose process is gone (a save
/// interrupted by a kill or a crash); a live process's are left alone. Returns what was removed.
pub fn remove_stale_partial_checkpoints(out: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(rd) = std::fs::read_dir(ckpt_root(out)) else { return removed };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(".tmp-step-") else { continue };
        let mut parts = rest.split('-');
        let (Some(_step), Some(pid)) = (parts.next(), parts.next().and_then(|p| p.parse::<u32>().ok())) else { continue };
        // our own pid here is a dead process's that had it before us: we have not saved yet
        if pid == std::process::id() || !crate::util::fs::pid_alive(pid) {
            let p = e.path();
            let res = match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(&p),
                _ => std::fs::remove_file(&p),
            };
            if res.is_ok() {
                removed.push(p);
            }
        }
    }
    removed
}

/// Whether `e` is (or wraps) the forward pass's refusal of NaN/Inf logits.
fn is_non_finite_logits(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<runtime::forward::NonFiniteLogits>())
}

/// The name of the first tensor with a NaN or an infinity.
fn non_finite_tensor(tensors: &BTreeMap<String, HostTensor>) -> Option<String> {
    tensors.iter().find(|(_, t)| t.data.iter().any(|v| !v.is_finite())).map(|(k, _)| k.clone())
}

/// The PEFT key of the first adapter tensor with a NaN or an infinity.
fn non_finite_lora(a: &LoraAdapter) -> Option<String> {
    for (l, row) in a.layers.iter().enumerate() {
        for p in crate::model::lora::ALL_PROJS {
            let Some(pair) = &row[p.index()] else { continue };
            for (which, t) in [('A', &pair.a), ('B', &pair.b)] {
                if t.data.iter().any(|v| !v.is_finite()) {
                    return Some(p.peft_key(l, which));
                }
            }
        }
    }
    None
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
        // the file's order, pass after pass: a curriculum file is read shortest first
        let cur = DataCursor::with_order(3, 7, DataOrder::File);
        let (a, c1) = cur.peek(5);
        assert_eq!(a, vec![0, 1, 2, 0, 1]);
        assert_eq!((c1.epoch, c1.peek(2).0), (1, vec![2, 0]));
    }

    #[test]
    fn micro_batches_respect_the_budget() {
        let conv = |n| Conversation { prompt: vec![1; n], response: vec![2; 1], ..Default::default() };
        let cs = vec![conv(4), conv(4), conv(9), conv(1)];
        let mb = micro_batches(&cs, 10);
        assert_eq!(mb.iter().map(|m| m.len()).collect::<Vec<_>>(), vec![2, 1, 1]);
    }
}
