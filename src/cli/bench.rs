//! `bench`: end-to-end throughput of fixed workloads (see `infomem_engine::bench`).
use super::{print_json, ModelArgs};
use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use infomem_engine::backend::Backend;
use infomem_engine::bench::{self, BenchShape};
use infomem_engine::runtime::Model;
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Work {
    Score,
    Decode,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, value_enum)]
    pub work: Work,
    /// Sequences per run (default: 8).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence: the whole sequence for `score`, the prompt for `decode`
    /// (default: 512 for score, 256 for decode).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// `score`: teacher-forced targets at the end of each sequence (default: 64).
    #[arg(long)]
    pub score_last: Option<usize>,
    /// `decode`: new tokens per sequence (default: 128).
    #[arg(long)]
    pub new_tokens: Option<usize>,
    /// Timed repetitions (the best is reported); one untimed warm-up run precedes them.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    #[arg(long)]
    pub json: bool,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    crate::with_model!(a.model, |model| bench_on(&model, &a))
}

fn bench_on<B: Backend>(model: &Model<B>, a: &BenchArgs) -> Result<()> {
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let (base, run): (BenchShape, fn(&Model<B>, BenchShape, u64) -> Result<(usize, f64)>) = match a.work {
        Work::Score => (BenchShape::SCORE, bench::run_score::<B>),
        Work::Decode => (BenchShape::DECODE, bench::run_decode::<B>),
    };
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
        Work::Score if shape.score_last == 0 || shape.score_last >= shape.seq_len => {
            bail!("--score-last must be in 1..{} (below --seq-len)", shape.seq_len)
        }
        Work::Decode if shape.new_tokens == 0 => bail!("--new-tokens must be at least 1"),
        _ => {}
    }
    // warm-up: same shapes, fewer sequences
    let warm = BenchShape { batch: shape.batch.min(2), new_tokens: shape.new_tokens.min(8), ..shape };
    run(model, warm, 1)?;
    let mut best = f64::INFINITY;
    let mut tokens = 0;
    for r in 0..a.repeat {
        let (n, s) = run(model, shape, 7 + r as u64)?;
        tokens = n;
        best = best.min(s);
    }
    let tps = tokens as f64 / best;
    let work = format!("{:?}", a.work).to_lowercase();
    if a.json {
        print_json(&json!({
            "impl": "infomem-engine",
            "work": work,
            "model": model.dir.display().to_string(),
            "backend": model.be.name(),
            "device": if model.be.name().starts_with("cuda") { "cuda" } else { "cpu" },
            "dtype": if model.be.name().starts_with("cuda") { "bfloat16" } else { "float32" },
            "threads": rayon::current_num_threads(),
            "batch": shape.batch,
            "seq_len": shape.seq_len,
            "score_last": shape.score_last,
            "new_tokens": shape.new_tokens,
            "tokens": tokens,
            "seconds": best,
            "tokens_per_s": tps,
            "repeat": a.repeat,
        }));
    } else {
        println!("{work}: {tokens} tokens in {best:.3} s = {tps:.1} tokens/s ({})", model.be.name());
    }
    Ok(())
}
