//! `grpo-grad`: the GRPO loss of a batch file and its gradient w.r.t. every LoRA tensor, written
//! as f32 safetensors under PEFT's key names (the engine's side of the fixture comparison).
use super::{print_json, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use infomem_engine::model::weights::write_safetensors;
use infomem_engine::backend::Dtype;
use infomem_engine::backend::TrainBackend;
use infomem_engine::data::{self, QaRecord, ReadOptions};
use infomem_engine::rl::grpo;
use infomem_engine::rl::trainer::{self, TrainConfig, Trainer};
use infomem_engine::runtime::Model;
use infomem_engine::util::progress;
use serde_json::json;
use std::collections::BTreeSet;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct GrpoGradArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Batch JSON: {"conversations": [{"prompt": [ids], "response": [ids], "advantage": A,
    /// "old_logprobs": [..]?, "ref_logprobs": [..]?}], "eps_low", "eps_high", "kl_coef"}.
    /// Missing old log-probs = the current policy (detached); missing reference log-probs are
    /// computed with the LoRA switched off.
    #[arg(long)]
    pub batch: PathBuf,
    /// Output safetensors file (f32 gradients, keys like
    /// base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), written atomically.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace --out if it exists (it may never be one of the inputs).
    #[arg(long)]
    pub overwrite: bool,
    /// Print the loss statistics as one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn grpo_grad(a: GrpoGradArgs) -> Result<()> {
    let Some(adapter) = &a.model.adapter else {
        anyhow::bail!("grpo-grad needs --adapter DIR: the gradients are taken w.r.t. a LoRA adapter's A and B");
    };
    // the output is checked before any work: never one of the inputs, new unless --overwrite
    let inputs: Vec<PathBuf> =
        [super::limits::model_files(&a.model.model), super::limits::model_files(adapter), vec![a.batch.clone()]].concat();
    let _out = super::output::check_out_file("--out", &a.out, &inputs, a.overwrite)?;
    let model = a.model.load_cpu(super::Work::Reference)?;
    // a batch file is JSON of token ids and numbers: 1 GiB is far beyond any real one
    let text = infomem_engine::util::fs::read_input_text(&a.batch, "--batch", 1 << 30)?;
    let batch = grpo::parse_batch(&text, model.cfg.vocab).with_context(|| format!("batch file {}", a.batch.display()))?;
    super::limits::check_conversations_fit(&batch.conversations, model.cfg.max_position, &model.cfg.position_limit()).with_context(|| format!("batch file {}", a.batch.display()))?;
    let (stats, grads) = grpo::loss_and_grads(&model, &batch.conversations, &batch.cfg)?;
    let tensors = grads.to_peft(&model)?;
    if let Some((k, _)) = tensors.iter().find(|(_, t)| t.data.iter().any(|v| !v.is_finite())) {
        anyhow::bail!("gradient {k} has non-finite entries");
    }
    write_safetensors(&a.out, &tensors, None).with_context(|| format!("cannot write {}", a.out.display()))?;
    if a.json {
        print_json(&json!({
            "loss": stats.loss,
            "response_tokens": stats.response_tokens,
            "clipped_tokens": stats.clipped_tokens,
            "kl_mean": stats.kl_mean,
            "entropy_mean": stats.entropy_mean,
            "logp_mean": stats.logp_mean,
            "ratio_mean": stats.ratio_mean,
            "tensors": tensors.len(),
            "out": a.out.display().to_string(),
        }));
    } else {
        println!(
            "loss {:.8} over {} response tokens ({} clipped), KL {:.5}, entropy {:.4}; {} gradient tensors → {}",
            stats.loss,
            stats.response_tokens,
            stats.clipped_tokens,
            stats.kl_mean,
            stats.entropy_mean,
            tensors.len(),
            a.out.display()
        );
    }
    Ok(())
}

/// `train`: flags override the TOML config file, which overrides the defaults.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// TOML file with any of the options below (snake_case keys, e.g. `queries_per_step = 4`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Continue the run in --out from its newest checkpoint with its saved settings; only --steps, --save-every and --keep-checkpoints may change (any other flag or config value that differs is refused, as is changed data).
    #[arg(long)]
    pub resume: bool,
    /// Start a fresh run in a non-empty --out: first delete the previous run's checkpoints/, adapter/, metrics.jsonl, config.toml and curves.png there (other files stay).
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// HF model directory.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute backend (`cuda` needs a build with `--features cuda` and an sm_90 GPU, or INFOMEM_CUDA_EMULATE=1 for the emulated device on the CPU, for checking).
    #[arg(long, value_enum, default_value_t = super::BackendKind::Cpu)]
    pub backend: super::BackendKind,
    /// Weight storage: f32 or bf16 (rounded once; f32 accumulation; LoRA masters, gradients and optimizer state f32: docs/DESIGN.md §3). Saved with the run: a resume keeps it. Default f32 (bf16 on CUDA).
    #[arg(long, value_enum)]
    pub dtype: Option<super::DtypeArg>,
    /// Training data JSONL.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Output directory: metrics.jsonl, curves.png, adapter/, checkpoints/.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Start from this PEFT adapter directory instead of a fresh one (its r, α and targets are used).
    #[arg(long)]
    pub init_adapter: Option<PathBuf>,
    /// LoRA rank r of a fresh adapter (default 16).
    #[arg(long)]
    pub lora_r: Option<usize>,
    /// LoRA α of a fresh adapter; the delta is scaled by α/r (default 32).
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// Comma-separated: q,k,v,o,gate,up,down.
    #[arg(long, value_delimiter = ',')]
    pub lora_targets: Option<Vec<String>>,
    /// Optimizer steps to run; with --resume, the new total (default 20).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Questions per step; each gets --group-size rollouts (default 4).
    #[arg(long)]
    pub queries_per_step: Option<usize>,
    /// Rollouts per question, the GRPO group (at least 2; default 4).
    #[arg(long)]
    pub group_size: Option<usize>,
    /// Tokens per document chunk (default 512).
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
    /// Budget of each memory rewrite in new tokens (default 128).
    #[arg(long)]
    pub memory_tokens: Option<usize>,
    /// Budget of the final answer in new tokens (default 24).
    #[arg(long)]
    pub answer_tokens: Option<usize>,
    /// Sampling temperature of the rollouts (default 1.0).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus (top-p) mass of the rollouts in (0, 1] (default 1.0).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// TOML file with `update` / `final` templates and `empty_memory` (default: the built-in templates).
    #[arg(long)]
    pub templates: Option<PathBuf>,
    /// How the answer is cut out of the final reply (default line).
    #[arg(long, value_enum)]
    pub extract: Option<infomem_engine::reward::Extract>,
    /// Outcome matcher: em, sub-em or f1 (rounded to 0/1) (default em).
    #[arg(long = "match", value_enum)]
    pub matcher: Option<infomem_engine::reward::Matcher>,
    /// Reward mode (default infomem; docs/DESIGN.md §1.5).
    #[arg(long, value_enum)]
    pub reward: Option<infomem_engine::reward::RewardMode>,
    /// Weight β of the memory signal in the reward (default 0.5).
    #[arg(long)]
    pub beta: Option<f64>,
    /// Advantage normalization: std = (R − mean)/(sample std + 1e-6), mean = R − mean (default std).
    #[arg(long)]
    pub adv_norm: Option<String>,
    /// ε_low: the ratio is clipped below at 1 − ε_low (default 0.2).
    #[arg(long)]
    pub clip_low: Option<f64>,
    /// ε_high: the ratio is clipped above at 1 + ε_high (default 0.28).
    #[arg(long)]
    pub clip_high: Option<f64>,
    /// Weight of the k3 KL term to the LoRA-off reference policy; 0 skips the reference pass (default 0).
    #[arg(long)]
    pub kl_coef: Option<f64>,
    /// Peak learning rate of AdamW (default 1e-4).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Steps of linear learning-rate warm-up (default 2).
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    /// Order of the training records: a seeded shuffle every pass, or the file's order (a length curriculum: short documents first) (default shuffled).
    #[arg(long, value_enum)]
    pub data_order: Option<infomem_engine::rl::trainer::DataOrder>,
    /// Learning rate after the warm-up: constant, or a cosine decay toward 10% of --lr (default constant).
    #[arg(long, value_enum)]
    pub schedule: Option<infomem_engine::rl::trainer::Schedule>,
    /// AdamW decoupled weight decay (default 0).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Clip the global gradient norm to this; 0 turns clipping off (default 1.0).
    #[arg(long)]
    pub grad_clip: Option<f64>,
    /// Prompt + response tokens per forward/backward micro-batch of the update (default 4096).
    #[arg(long)]
    pub micro_batch_tokens: Option<usize>,
    /// Upper bound on tokens per forward step during rollouts (default 2048).
    #[arg(long)]
    pub max_batch_tokens: Option<usize>,
    /// Write a checkpoint every N steps; 0 only at the end (default 5).
    #[arg(long)]
    pub save_every: Option<usize>,
    /// Checkpoints to keep, newest first (default 2).
    #[arg(long)]
    pub keep_checkpoints: Option<usize>,
    /// Seed of the adapter's initialization, the data order and the rollouts (default 0).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl TrainArgs {
    /// The configuration, and the settings given explicitly (config-file keys and flags): what
    /// `--resume` checks against the checkpoint.
    pub fn config_and_explicit(&self) -> Result<(TrainConfig, BTreeSet<String>)> {
        let mut explicit = BTreeSet::new();
        let mut c = match &self.config {
            Some(p) => {
                let text = infomem_engine::util::fs::read_input_text(p, "--config", 64 << 20)?;
                let c = toml::from_str::<TrainConfig>(&text).with_context(|| format!("config {}", p.display()))?;
                explicit.extend(toml::from_str::<toml::Table>(&text).with_context(|| format!("config {}", p.display()))?.keys().cloned());
                c
            }
            None => TrainConfig::default(),
        };
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = &self.$f { c.$f = v.clone().into(); explicit.insert(stringify!($f).to_string()); } )* };
        }
        set!(data_order, steps, queries_per_step, group_size, chunk_tokens, memory_tokens, answer_tokens, temperature, top_p, extract, matcher, reward, beta,
             adv_norm, clip_low, clip_high, kl_coef, lr, warmup_steps, schedule, weight_decay, grad_clip, micro_batch_tokens, max_batch_tokens,
             save_every, keep_checkpoints, seed, lora_r, lora_alpha, lora_targets);
        if let Some(d) = self.dtype {
            c.dtype = match d {
                super::DtypeArg::Auto => None,
                super::DtypeArg::F32 => Some(Dtype::F32),
                super::DtypeArg::Bf16 => Some(Dtype::Bf16),
            };
            explicit.insert("dtype".into());
        }
        if let Some(v) = &self.out {
            c.out = v.clone();
        }
        for (key, dst, src) in [("model", &mut c.model, &self.model), ("data", &mut c.data, &self.data), ("init_adapter", &mut c.init_adapter, &self.init_adapter), ("templates", &mut c.templates, &self.templates)] {
            if src.is_some() {
                *dst = src.clone();
                explicit.insert(key.to_string());
            }
        }
        Ok((c, explicit))
    }
}

pub fn train(a: TrainArgs) -> Result<()> {
    infomem_engine::util::interrupt::install();
    let (mut cfg, explicit) = a.config_and_explicit()?;
    // `auto` (or no dtype) resolved here, once: the run records the dtype it ran with
    let asked = match cfg.dtype {
        None => super::DtypeArg::Auto,
        Some(Dtype::F32) => super::DtypeArg::F32,
        Some(Dtype::Bf16) => super::DtypeArg::Bf16,
    };
    let (dtype, why) = asked.resolve(a.backend, super::Work::Agent)?;
    cfg.dtype = Some(dtype);
    if a.resume && !cfg.out.is_dir() {
        anyhow::bail!("--resume: --out {} is not a directory with a training run (no such directory)", cfg.out.display());
    }
    // settings first: a bad value is refused before the directory is touched
    if !a.resume {
        cfg.validate()?;
    }
    // one run per directory for the whole run (released when the process ends, however it ends)
    let created = !cfg.out.exists();
    let lock = infomem_engine::util::lock::lock_dir(&cfg.out, "--out")?;
    let res = train_locked(&a, cfg, &explicit, &why);
    if res.is_err() && created {
        // a run that failed before writing anything leaves no directory (nor lock) behind
        lock.remove_if_only_lock();
    }
    res
}

/// `train` once its --out is locked.
fn train_locked(a: &TrainArgs, cfg: TrainConfig, explicit: &BTreeSet<String>, why: &str) -> Result<()> {
    if !a.resume {
        // a fresh run's directory holds none of its inputs (the model directory as --out) and
        // no evaluation; --overwrite deletes the previous run's files, never one the new run
        // reads (its --init-adapter taken from that run's adapter/, say)
        let dir_files = |d: &Option<PathBuf>| d.as_deref().map(super::limits::model_files).unwrap_or_default();
        let inputs: Vec<PathBuf> = [dir_files(&cfg.model), dir_files(&cfg.init_adapter), cfg.data.iter().chain(&cfg.templates).chain(&a.config).cloned().collect()].concat();
        super::output::check_not_other_kind("--out", &cfg.out, &["results.json", "predictions.jsonl"], "an evaluation")?;
        let model_inputs: Vec<PathBuf> = [dir_files(&cfg.model), dir_files(&cfg.init_adapter)].concat();
        super::output::check_holds_no_input("--out", &cfg.out, &model_inputs)?;
        for name in trainer::RUN_FILES {
            super::output::check_replaceable("--out", &cfg.out.join(name), &inputs)?;
        }
    }
    trainer::check_fresh_out(&cfg.out, a.resume, a.overwrite)?;
    // the run's model and data: from the checkpoint when resuming (changed settings refused)
    let run_cfg = if a.resume { trainer::resume_config(&cfg, explicit)? } else { cfg.clone() };
    run_cfg.validate()?;
    let model_dir = run_cfg.model.clone().unwrap();
    // a run saved before dtypes were recorded ran in f32
    let dtype = run_cfg.dtype.unwrap_or(Dtype::F32);
    super::say_dtype(dtype, if a.resume && !explicit.contains("dtype") { "the run's own, from its checkpoint" } else { why });
    match a.backend {
        super::BackendKind::Cpu => train_on(Model::load(&model_dir, super::cpu_backend_for(dtype))?, a, cfg, &run_cfg, |_, _, _| Ok(())),
        super::BackendKind::Cuda => {
            if dtype == Dtype::F32 {
                // a resumed f32 run cannot continue on the CUDA backend (bf16 only)
                super::DtypeArg::F32.resolve(super::BackendKind::Cuda, super::Work::Agent)?;
            }
            #[cfg(feature = "cuda")]
            {
                let model = Model::load(&model_dir, super::open_cuda(0)?)?;
                train_on(model, a, cfg, &run_cfg, cuda_fit)
            }
            #[cfg(not(feature = "cuda"))]
            {
                anyhow::bail!("--backend cuda: this binary was built without CUDA support (rebuild with `cargo build --release --features cuda`)")
            }
        }
    }
}

/// Refuse, before the first step, a run whose rollout KV cache or update pass cannot fit next to
/// the weights, naming the settings that would (backend::cuda::footprint).
#[cfg(feature = "cuda")]
fn cuda_fit(model: &Model<infomem_engine::backend::cuda::CudaBackend>, c: &TrainConfig, recs: &[QaRecord]) -> Result<()> {
    use infomem_engine::backend::cuda::footprint::TrainMemPlan;
    // the KV budget of one step, as Trainer::one_step sizes it, for the data's longest question
    let longest_q = recs.iter().max_by_key(|r| r.question.len()).map(|r| r.question.as_str()).unwrap_or("");
    let per_query = infomem_engine::agent::rollout_kv_tokens(&c.budget(), c.group_size, [longest_q]);
    // the longest single conversation is a micro-batch of its own when it exceeds the budget
    let longest = c.budget().conversation_tokens(infomem_engine::agent::budget::question_tokens_bound(longest_q));
    let plan = TrainMemPlan {
        kv_tokens: c.queries_per_step * per_query,
        rollout_rows: c.max_batch_tokens,
        sampled_rows: c.queries_per_step * (c.group_size + 1),
        update_rows: c.micro_batch_tokens.max(longest),
        lora_r: c.lora_r,
        lora_targets: c.targets()?.len() * model.cfg.n_layers,
        kv_tokens_per_query: per_query,
        queries: c.queries_per_step,
    };
    let fp = model.be.check_train_fit(&model.cfg, &plan)?;
    eprintln!(
        "cuda memory plan: rollout KV {:.2} GiB, update {:.2} GiB ({} tokens per micro-batch), LoRA state {:.2} GiB; {:.2} GiB usable",
        fp.kv_bytes as f64 / (1u64 << 30) as f64,
        fp.update_bytes as f64 / (1u64 << 30) as f64,
        plan.update_rows,
        fp.lora_bytes as f64 / (1u64 << 30) as f64,
        model.be.mem_info()?.usable() as f64 / (1u64 << 30) as f64
    );
    Ok(())
}

/// The training run on a loaded model (any backend): data, trainer, progress, final report.
/// `fit` checks the backend's memory plan once the data is known (CUDA; a no-op on the CPU).
fn train_on<B: TrainBackend>(model: Model<B>, a: &TrainArgs, cfg: TrainConfig, run_cfg: &TrainConfig, fit: impl FnOnce(&Model<B>, &TrainConfig, &[QaRecord]) -> Result<()>) -> Result<()> {
    let model_dir = run_cfg.model.clone().unwrap();
    let data_path = run_cfg.data.clone().unwrap();
    let (recs, report) = data::read_records(&data_path, ReadOptions { tokenizer: model.tokenizer.as_ref(), ..Default::default() })?;
    if !report.skipped.is_empty() {
        eprintln!("{}: skipped {} malformed records", data_path.display(), report.skipped.len());
    }
    // sizes that cannot fit are refused before anything is allocated: every record's
    // conversations against max_position_embeddings, a step's rollouts and the adapter in memory
    let scored = super::limits::Scored { gold: true, question: run_cfg.reward.signal() == infomem_engine::reward::Signal::QueryGain };
    let templates = match &run_cfg.templates {
        Some(p) => infomem_engine::agent::Templates::load(p)?,
        None => infomem_engine::agent::Templates::default(),
    };
    let held = super::limits::Held { queries: run_cfg.queries_per_step, group: run_cfg.group_size };
    super::limits::check_agent_plan(&model.cfg, &model_dir.display().to_string(), model.tokenizer()?, &templates, &recs, &run_cfg.budget(), scored, held)?;
    super::limits::check_lora_fits(&model.cfg, run_cfg.lora_r, &run_cfg.targets()?)?;
    fit(&model, run_cfg, &recs)?;
    let n_records = recs.len();
    let mut t = Trainer::new(cfg, a.resume, recs, move |_| Ok(model))?;
    if a.resume && t.step == t.cfg.steps {
        eprintln!("note: the run in {} has already done its {} steps; nothing to train (pass a larger --steps to continue it)", t.cfg.out.display(), t.step);
    }
    let pb = progress::bar(t.cfg.steps as u64, "steps");
    pb.set_position(t.step as u64);
    eprintln!(
        "training {} on {} ({} records): {} steps × {} queries × {} rollouts, reward {}, out {}",
        model_dir.display(),
        data_path.display(),
        n_records,
        t.cfg.steps,
        t.cfg.queries_per_step,
        t.cfg.group_size,
        t.cfg.reward.name(),
        t.cfg.out.display()
    );
    let res = t.run(|m| {
        pb.set_position(m.step as u64);
        pb.set_message(format!("reward {:.3} success {:.0}% gain {:+.3}", m.reward_mean, 100.0 * m.success_rate, m.gain_mean));
        let line = format!(
            "step {:>4}: reward {:.3} success {:>5.1}% answers cut {:>3.0}% gain {:+.3} kl {:.4} clip {:.3} | rollout {:.1}s score {:.1}s update {:.1}s ({:.0} train tok/s){}",
            m.step,
            m.reward_mean,
            100.0 * m.success_rate,
            100.0 * m.answer_cut.unwrap_or(0.0),
            m.gain_mean,
            m.kl_mean,
            m.clip_frac,
            m.rollout_s,
            m.score_s,
            m.update_s,
            m.train_tokens_per_s,
            m.skipped.as_ref().map(|s| format!(" [skipped: {s}]")).unwrap_or_default()
        );
        // without a terminal the bar is hidden: the step lines still go to the log
        if pb.is_hidden() {
            eprintln!("{line}");
        } else {
            pb.println(line);
        }
    });
    pb.finish_and_clear();
    match res {
        Ok(()) => {
            eprintln!("done: adapter in {}, metrics in {}, curves in {}", t.cfg.out.join("adapter").display(), t.cfg.out.join("metrics.jsonl").display(), t.cfg.out.join("curves.png").display());
            Ok(())
        }
        // 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP (the checkpoint is saved)
        Err(e) if infomem_engine::util::interrupt::is_interrupted(&e) => std::process::exit(infomem_engine::util::interrupt::exit_code()),
        Err(e) => Err(e),
    }
}


#[derive(Args, Debug)]
pub struct MergeArgs {
    /// Base HF model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT LoRA adapter directory.
    #[arg(long)]
    pub adapter: PathBuf,
    /// Output HF model directory, new or empty (model.safetensors in f32, config and tokenizer files copied).
    #[arg(long)]
    pub out: PathBuf,
    /// Write into a non-empty --out: first delete the model files there (*.safetensors, the shard index, configs, tokenizer, chat template; other files stay).
    #[arg(long)]
    pub overwrite: bool,
}

pub fn merge(a: MergeArgs) -> Result<()> {
    use infomem_engine::model::config::ModelConfig;
    use infomem_engine::model::lora::LoraAdapter;
    use infomem_engine::model::weights::ModelWeights;
    if a.out.canonicalize().ok() == a.model.canonicalize().ok() {
        anyhow::bail!("--out must differ from --model (the base directory is never overwritten)");
    }
    // a complete model directory or nothing: stale files (a shard index, old shards) would be
    // loaded instead of, or mixed with, the merged weights
    let inputs = [super::limits::model_files(&a.model), super::limits::model_files(&a.adapter)].concat();
    super::output::check_out_dir("--out", &a.out, &inputs, a.overwrite, super::output::model_dir_file)?;
    let cfg = ModelConfig::load(&a.model)?;
    let mut w = ModelWeights::load(&a.model, &cfg)?;
    let adapter = LoraAdapter::load(&a.adapter, &cfg)?;
    let scale = adapter.scale();
    anyhow::ensure!(scale.is_finite(), "adapter {}: its scale lora_alpha / r = {} / {} is not finite; refusing to merge", a.adapter.display(), adapter.alpha, adapter.r);
    if let Some((k, _)) = adapter.to_peft_tensors().iter().find(|(_, t)| t.data.iter().any(|v| !v.is_finite())) {
        anyhow::bail!("adapter {}: tensor {k} has non-finite values (NaN or infinity); refusing to merge it into {}", a.adapter.display(), a.model.display());
    }
    adapter.merge_into(&mut w, &cfg);
    let merged = w.to_hf(&cfg);
    if let Some((k, _)) = merged.iter().find(|(_, t)| t.data.iter().any(|v| !v.is_finite())) {
        anyhow::bail!("merged weight {k} has non-finite values (the base weight or the adapter's product overflows f32); nothing was written to {}", a.out.display());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
    super::output::clear_owned("--out", &a.out, super::output::model_dir_file)?;
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "special_tokens_map.json"] {
        let src = a.model.join(f);
        if src.exists() {
            std::fs::copy(&src, a.out.join(f)).with_context(|| format!("copying {}", src.display()))?;
        }
    }
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    write_safetensors(&a.out.join("model.safetensors"), &merged, Some(meta))?;
    // config last: a directory with config.json is complete
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(a.model.join("config.json"))?)?;
    c["torch_dtype"] = json!("float32");
    c["dtype"] = json!("float32");
    infomem_engine::util::fs::write_atomic_str(&a.out.join("config.json"), &serde_json::to_string_pretty(&c)?)?;
    eprintln!("merged {} into {} → {}", a.adapter.display(), a.model.display(), a.out.display());
    println!("{}", a.out.display());
    Ok(())
}
