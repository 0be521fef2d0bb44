//! The end-to-end workloads of `infomem-engine bench`, defined exactly as in `tools/bench_torch.py`
//! so the two can be compared side by side:
//! - `score`: 8 sequences × 512 tokens, teacher-forced log-probs of the last 64 tokens of each;
//!   tokens/s counts all 4096 input tokens.
//! - `decode`: 8 prompts × 256 tokens, 128 new tokens each, greedy, EOS ignored; new tokens/s,
//!   prefill included.
//! Token ids are drawn uniformly from [100, vocab − 100) with a fixed seed.
use crate::backend::{timed, Backend, SampleParams};
use crate::runtime::{self, GenRequest, Model, SchedOptions, ScoreRequest, Seq};
use crate::util::rng::Rng;
use anyhow::Result;

#[derive(Clone, Copy, Debug)]
pub struct BenchShape {
    pub batch: usize,
    pub seq_len: usize,
    pub score_last: usize,
    pub new_tokens: usize,
}

impl BenchShape {
    pub const SCORE: BenchShape = BenchShape { batch: 8, seq_len: 512, score_last: 64, new_tokens: 0 };
    pub const DECODE: BenchShape = BenchShape { batch: 8, seq_len: 256, score_last: 0, new_tokens: 128 };
}

pub fn random_ids(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    let lo = 100.min(vocab / 4);
    let span = (vocab - 2 * lo).max(1) as u64;
    (0..n).map(|_| lo as u32 + rng.below(span) as u32).collect()
}

/// Returns (tokens counted, seconds).
pub fn run_score<B: Backend>(model: &Model<B>, s: BenchShape, seed: u64) -> Result<(usize, f64)> {
    let mut rng = Rng::new(seed);
    let seqs: Vec<Vec<u32>> = (0..s.batch).map(|_| random_ids(&mut rng, s.seq_len, model.cfg.vocab)).collect();
    let mut kv = runtime::kv_for(model, s.batch * (s.seq_len + model.page_size))?;
    let reqs = seqs
        .iter()
        .map(|ids| {
            let cut = s.seq_len - s.score_last;
            ScoreRequest { seq: Seq::default(), context: ids[..cut].to_vec(), targets: ids[cut..].to_vec(), keep_seq: false }
        })
        .collect();
    let (out, secs) = timed(|| model.be.synchronize(), || runtime::score(model, &mut kv, reqs, SchedOptions { max_batch_tokens: s.batch * s.seq_len }))?;
    anyhow::ensure!(out.iter().all(|o| o.logprobs.len() == s.score_last && o.logprobs.iter().all(|x| x.is_finite())));
    Ok((s.batch * s.seq_len, secs))
}

/// Returns (new tokens, seconds).
pub fn run_decode<B: Backend>(model: &Model<B>, s: BenchShape, seed: u64) -> Result<(usize, f64)> {
    let mut rng = Rng::new(seed);
    let mut kv = runtime::kv_for(model, s.batch * (s.seq_len + s.new_tokens + model.page_size))?;
    let reqs: Vec<GenRequest> = (0..s.batch)
        .map(|i| GenRequest {
            seq: Seq::default(),
            feed: random_ids(&mut rng, s.seq_len, model.cfg.vocab),
            max_new: s.new_tokens,
            params: SampleParams::GREEDY,
            rng: Rng::derive(seed, i as u64),
            stop_ids: vec![],
            stop_strings: vec![],
            keep_seq: false,
        })
        .collect();
    let (out, secs) = timed(|| model.be.synchronize(), || runtime::generate(model, &mut kv, reqs, SchedOptions { max_batch_tokens: s.batch * s.seq_len }, |_| {}))?;
    let n: usize = out.iter().map(|o| o.new_ids.len()).sum();
    anyhow::ensure!(n == s.batch * s.new_tokens, "decode produced {n} tokens");
    Ok((n, secs))
}

/// The memory agent's generation pattern (as `tools/bench_torch.py --work rollout`): `batch`
/// rollouts read `chunks` sections of `seq_len` tokens; per section, prompt = [section (the same
/// for all rollouts) + that rollout's memory], then `new_tokens` greedy tokens (EOS ignored)
/// become the next memory. Here the section is prefilled once and forked (the shared prefix of
/// docs/DESIGN.md §4.1); PyTorch prefills it once per rollout. Returns (generated tokens, seconds).
pub fn run_rollout<B: Backend>(model: &Model<B>, s: BenchShape, chunks: usize, seed: u64) -> Result<(usize, f64)> {
    anyhow::ensure!(s.seq_len >= 2 && chunks >= 1, "rollout: sections of at least 2 tokens, at least one chunk");
    let mut rng = Rng::new(seed);
    let sections: Vec<Vec<u32>> = (0..chunks).map(|_| random_ids(&mut rng, s.seq_len, model.cfg.vocab)).collect();
    let per_seq = s.seq_len + s.new_tokens + 2 * model.page_size;
    let mut kv = runtime::kv_for(model, (s.batch + 1) * per_seq)?;
    let opts = SchedOptions { max_batch_tokens: s.seq_len.max(2048) };
    let mut memories: Vec<Vec<u32>> = vec![vec![]; s.batch];
    let mut generated = 0;
    let ((), secs) = timed(|| model.be.synchronize(), || {
        for sec in &sections {
            let (head, last) = sec.split_at(sec.len() - 1);
            let prefix = runtime::prefill(model, &mut kv, vec![(Seq::default(), head.to_vec())], opts)?.remove(0);
            let reqs: Vec<GenRequest> = (0..s.batch)
                .map(|i| GenRequest {
                    seq: kv.fork(&prefix),
                    feed: last.iter().chain(&memories[i]).copied().collect(),
                    max_new: s.new_tokens,
                    params: SampleParams::GREEDY,
                    rng: Rng::derive(seed, i as u64),
                    stop_ids: vec![],
                    stop_strings: vec![],
                    keep_seq: false,
                })
                .collect();
            kv.release(&model.be, prefix);
            let outs = runtime::generate(model, &mut kv, reqs, opts, |_| {})?;
            for (m, o) in memories.iter_mut().zip(outs) {
                generated += o.new_ids.len();
                *m = o.new_ids;
            }
        }
        Ok(())
    })?;
    anyhow::ensure!(generated == s.batch * chunks * s.new_tokens, "rollout generated {generated} tokens");
    Ok((generated, secs))
}
