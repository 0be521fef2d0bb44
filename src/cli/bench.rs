//! `bench`: end-to-end throughput of fixed workloads (see `infomem_engine::bench`).
use super::{print_json, ModelArgs};
use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use infomem_engine::backend::Backend;
use infomem_engine::bench::{self, BenchShape};
use infomem_engine::runtime::Model;
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Stat {
    Median,
    Best,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Work {
    /// Teacher-forced log-probs of the last --score-last tokens of --batch sequences of --seq-len.
    Score,
    /// --batch prompts of --seq-len, --new-tokens greedy new tokens each (EOS ignored), prefill included.
    Decode,
    /// LoRA r16 (α 32) on all 7 projections, GRPO token loss on the last 128 tokens of each
    /// sequence, one forward + backward (CPU or CUDA backend).
    Train,
    /// The memory agent's pattern: --batch rollouts over --chunks sections of --seq-len tokens,
    /// --new-tokens of memory generated per section (shared section prefix).
    Rollout,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The workload to time (defined as in tools/bench_torch.py).
    #[arg(long, value_enum)]
    pub work: Work,
    /// Sequences per run (default: 8; rollout: 16 rollouts).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence: the whole sequence for `score` and `train`, the prompt for `decode`,
    /// one section for `rollout` (default: 512 for score and train, 256 for decode, 2048 for rollout).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// `score`: teacher-forced targets at the end of each sequence (default: 64); `train`: tokens
    /// with loss at the end of each sequence (default: 128).
    #[arg(long)]
    pub score_last: Option<usize>,
    /// `decode`: new tokens per sequence (default: 128); `rollout`: memory tokens generated per
    /// section (default: 512).
    #[arg(long)]
    pub new_tokens: Option<usize>,
    /// `rollout`: sections read per rollout (default: 8).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Timed repetitions; one untimed warm-up run with the same shapes precedes them (as in
    /// tools/bench_torch.py: decode warms up with 8 new tokens, rollout with 2 rollouts of one section).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Which of the repetitions' times is reported (median, as tools/bench_torch.py does by default).
    #[arg(long, value_enum, default_value_t = Stat::Median)]
    pub stat: Stat,
    /// Print one JSON line (shape, tokens, seconds, tokens_per_s, every run's time) instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    // every shape against the model's positions and the memory, before the model is loaded
    let cfg = infomem_engine::model::config::ModelConfig::load(&a.model.model)?;
    let shape = shape_of(&a)?;
    super::limits::check_bench_fits(&cfg, &bench_plan(&a, shape))?;
    if a.work == Work::Train {
        // the LoRA forward + backward (TrainBackend), on either backend
        return crate::with_model!(a.model, super::Work::Agent, |model| {
            let mut model = model;
            if model.lora.is_none() {
                model.set_adapter(infomem_engine::bench::bench_adapter(&model.cfg))?;
            }
            train_fit(&model, &a)?;
            measure(&model, &a, |s, seed| {
                let shape = infomem_engine::bench::TrainShape { batch: s.batch, seq_len: s.seq_len, train_last: s.score_last };
                infomem_engine::bench::run_train_bench(&model, shape, seed)
            })
        });
    }
    crate::with_model!(a.model, super::Work::Agent, |model| {
        match a.work {
            Work::Score => measure(&model, &a, |s, seed| bench::run_score(&model, s, seed)),
            Work::Rollout => {
                let chunks = a.chunks.unwrap_or(8);
                // the untimed warm-up (seed 1) reads one section only
                measure(&model, &a, |s, seed| bench::run_rollout(&model, s, if seed == 1 { 1 } else { chunks }, seed))
            }
            _ => measure(&model, &a, |s, seed| bench::run_decode(&model, s, seed)),
        }
    })
}

/// On the CUDA backend, refuse a train workload whose update pass cannot fit (with what would).
fn train_fit<B: Backend + 'static>(model: &Model<B>, a: &BenchArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        use infomem_engine::backend::cuda::{footprint::TrainMemPlan, CudaBackend};
        if let Some(be) = (&model.be as &dyn std::any::Any).downcast_ref::<CudaBackend>() {
            let rows = a.batch.unwrap_or(8) * a.seq_len.unwrap_or(512);
            let lora = model.lora.as_ref().map(|l| (l.host.r, l.layers.iter().flatten().flatten().count())).unwrap_or((16, 7 * model.cfg.n_layers));
            let plan = TrainMemPlan { kv_tokens: 0, rollout_rows: 0, sampled_rows: 0, update_rows: rows, lora_r: lora.0, lora_targets: lora.1, kv_tokens_per_query: 1, queries: 0 };
            be.check_train_fit(&model.cfg, &plan)?;
        }
    }
    let _ = (model, a);
    Ok(())
}

/// The defaults of each work (as `tools/bench_torch.py`), overridden by the flags, checked.
fn shape_of(a: &BenchArgs) -> Result<BenchShape> {
    let base = match a.work {
        Work::Score => BenchShape::SCORE,
        Work::Decode => BenchShape::DECODE,
        Work::Train => BenchShape { batch: 8, seq_len: 512, score_last: 128, new_tokens: 0 },
        Work::Rollout => BenchShape { batch: 16, seq_len: 2048, score_last: 0, new_tokens: 512 },
    };
    // every run's time is kept: a count past this is a typo, not a benchmark
    const MAX_REPEAT: usize = 100_000;
    if a.repeat == 0 || a.repeat > MAX_REPEAT {
        bail!("--repeat must be in 1..={MAX_REPEAT} (got {})", a.repeat);
    }
    if a.chunks.is_some_and(|c| c > MAX_REPEAT) {
        bail!("--chunks must be at most {MAX_REPEAT} (got {})", a.chunks.unwrap_or(0));
    }
    let shape = BenchShape {
        batch: a.batch.unwrap_or(base.batch),
        seq_len: a.seq_len.unwrap_or(base.seq_len),
        score_last: a.score_last.unwrap_or(base.score_last),
        new_tokens: a.new_tokens.unwrap_or(base.new_tokens),
    };
    if shape.batch == 0 || shape.seq_len == 0 {
        bail!("--batch and --seq-len must be at least 1");
    }
    match a.work {
        Work::Score | Work::Train if shape.score_last == 0 || shape.score_last >= shape.seq_len => {
            bail!("--score-last must be in 1..{} (below --seq-len)", shape.seq_len)
        }
        Work::Decode | Work::Rollout if shape.new_tokens == 0 => bail!("--new-tokens must be at least 1"),
        Work::Rollout if shape.seq_len < 2 => bail!("--seq-len must be at least 2 for rollout (a section's last token is fed with the memory)"),
        Work::Rollout if a.chunks == Some(0) => bail!("--chunks must be at least 1"),
        _ => {}
    }
    if a.work != Work::Rollout && a.chunks.is_some() {
        bail!("--chunks applies to --work rollout only");
    }
    Ok(shape)
}

/// What a work's shape needs: the longest sequence (positions), the KV cache's tokens, the rows
/// of activations held at once (times the layers for train, whose backward keeps them), and the
/// rows of logits.
fn bench_plan(a: &BenchArgs, s: BenchShape) -> super::limits::BenchPlan {
    let (b, l, n) = (s.batch as u128, s.seq_len as u128, s.new_tokens as u128);
    let what = format!("--work {} with --batch {} --seq-len {}", format!("{:?}", a.work).to_lowercase(), s.batch, s.seq_len);
    match a.work {
        Work::Score => super::limits::BenchPlan { what, positions: l, kv_tokens: s.score_kv_tokens(), rows: b * l, kept_layers: false, logit_rows: b * s.score_last as u128, held_bytes: 0 },
        Work::Decode => super::limits::BenchPlan { what: format!("{what} --new-tokens {}", s.new_tokens), positions: l + n, kv_tokens: s.decode_kv_tokens(), rows: b * l, kept_layers: false, logit_rows: b, held_bytes: 0 },
        Work::Train => super::limits::BenchPlan { what, positions: l, kv_tokens: 0, rows: b * l, kept_layers: true, logit_rows: b * s.score_last as u128, held_bytes: 0 },
        // per section: the section, the memory fed after it, the new memory
        // the sections are random ids held whole before the run (4 bytes a token)
        Work::Rollout => super::limits::BenchPlan {
            what: format!("{what} --new-tokens {} --chunks {}", s.new_tokens, a.chunks.unwrap_or(8)),
            positions: l + 2 * n,
            kv_tokens: s.rollout_kv_tokens(),
            rows: l.max(2048),
            kept_layers: false,
            logit_rows: b,
            held_bytes: a.chunks.unwrap_or(8) as u128 * l * 4,
        },
    }
}

/// Warm up, time `--repeat` runs of `run` (the best counts), report.
fn measure<B: Backend>(model: &Model<B>, a: &BenchArgs, run: impl Fn(BenchShape, u64) -> Result<(usize, f64)>) -> Result<()> {
    let shape = shape_of(a)?;
    // Warm-up with the timed shapes (thread pool, caches and the allocator reach steady state),
    // except the long generations: decode/rollout produce only a few tokens, rollout with 2 rows.
    let warm = match a.work {
        Work::Rollout => BenchShape { batch: shape.batch.min(2), new_tokens: shape.new_tokens.min(8), ..shape },
        _ => BenchShape { new_tokens: shape.new_tokens.min(8), ..shape },
    };
    run(warm, 1)?;
    let mut times = Vec::with_capacity(a.repeat);
    let mut tokens = 0;
    for r in 0..a.repeat {
        let (n, s) = run(shape, 7 + r as u64)?;
        tokens = n;
        times.push(s);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let secs = match a.stat {
        Stat::Best => sorted[0],
        // statistics.median: the mean of the middle two for an even count
        Stat::Median => (sorted[(sorted.len() - 1) / 2] + sorted[sorted.len() / 2]) / 2.0,
    };
    let tps = tokens as f64 / secs;
    let work = format!("{:?}", a.work).to_lowercase();
    let cuda = model.be.name().starts_with("cuda");
    if a.json {
        print_json(&json!({
            "impl": "infomem-engine",
            "work": work,
            "model": model.dir.display().to_string(),
            "backend": model.be.name(),
            "device": if cuda { "cuda" } else { "cpu" },
            // the weights' storage, in PyTorch's names (bench_torch.py's "dtype")
            "dtype": match a.model.dtype.resolve(a.model.backend, super::Work::Agent)?.0 {
                infomem_engine::backend::Dtype::Bf16 => "bfloat16",
                infomem_engine::backend::Dtype::F32 => "float32",
            },
            "threads": rayon::current_num_threads(),
            "batch": shape.batch,
            "seq_len": shape.seq_len,
            // each size only where the work uses it (null otherwise)
            "score_last": matches!(a.work, Work::Score | Work::Train).then_some(shape.score_last),
            "new_tokens": matches!(a.work, Work::Decode | Work::Rollout).then_some(shape.new_tokens),
            "chunks": if a.work == Work::Rollout { Some(a.chunks.unwrap_or(8)) } else { None },
            "tokens": tokens,
            "seconds": secs,
            "tokens_per_s": tps,
            "repeat": a.repeat,
            "stat": format!("{:?}", a.stat).to_lowercase(),
            "seconds_all": times,
        }));
    } else {
        println!("{work}: {tokens} tokens in {secs:.3} s = {tps:.1} tokens/s ({})", model.be.name());
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct MachineArgs {
    /// Megabytes read per pass of the bandwidth test (much larger than the last-level cache, so
    /// the rate is the memory's).
    #[arg(long, default_value_t = infomem_engine::backend::cpu::machine::READ_MB)]
    pub read_mb: usize,
    /// Print one JSON line instead of the one text line.
    #[arg(long)]
    pub json: bool,
}

/// `machine`: this host's bounds now (`backend::cpu::machine`), what `bench`'s rates are
/// compared against. The text is one line, which the compare scripts print as it is.
pub fn machine(a: MachineArgs) -> Result<()> {
    if !(1..=1 << 20).contains(&a.read_mb) {
        bail!("--read-mb must be between 1 and 1048576 (got {})", a.read_mb);
    }
    super::limits::check_probe_fits(a.read_mb)?;
    let m = infomem_engine::backend::cpu::machine::probe_with(a.read_mb << 20, infomem_engine::backend::cpu::machine::PEAK_ITERS);
    if a.json {
        print_json(&serde_json::to_value(&m)?);
        return Ok(());
    }
    let bf16 = m.bf16_gflop_s.map_or("- (no AVX512_BF16)".into(), |r| format!("{r:.0} GFLOP/s"));
    let f32 = match (m.f32_gflop_s, m.f32_isa) {
        (Some(r), Some(isa)) => format!("{r:.0} GFLOP/s ({isa})"),
        _ => "- (neither AVX-512 nor AVX2+FMA)".into(),
    };
    println!(
        "read {:.1} GiB/s on 1 thread, {:.1} on {} ({} MiB, median of 5); vdpbf16ps peak {bf16}; f32 FMA peak {f32}",
        m.read_gib_s_1,
        m.read_gib_s_all,
        m.threads,
        m.read_bytes >> 20
    );
    Ok(())
}
