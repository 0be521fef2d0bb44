//! The end-to-end workloads of `infomem-engine bench`, defined exactly as in `tools/bench_torch.py`
//! so the two can be compared side by side:
//! - `score`: 8 sequences × 512 tokens, teacher-forced log-probs of the last 64 tokens of each;
//!   tokens/s counts all 4096 input tokens.
//! - `decode`: 8 prompts × 256 tokens, 128 new tokens each, greedy, EOS ignored; new tokens/s,
//!   prefill included.
//! - `rollout`: the memory agent's generation pattern ([`run_rollout`]).
//! - `train`: one GRPO forward + backward to every LoRA tensor ([`run_train_bench`]).
//! Token ids are drawn uniformly from [100, vocab − 100) with a fixed seed.
use crate::backend::{timed, Backend, SampleParams, TrainBackend};
use crate::model::config::ModelConfig;
use crate::model::lora::{LoraAdapter, ALL_PROJS};
use crate::rl::grpo::{grpo_loss, Conversation, GrpoConfig};
use crate::runtime::backward::{policy_grads, TrainSeq};
use crate::runtime::{self, GenRequest, Model, SchedOptions, ScoreRequest, Seq, PAGE_SIZE};
use crate::util::rng::Rng;
use anyhow::{ensure, Result};

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

    /// KV tokens each workload allocates (a page of slack per sequence), as the runs below size
    /// their caches and as `bench` checks the memory before the model loads (in u128: the
    /// check sees absurd flags without overflow).
    pub fn score_kv_tokens(&self) -> u128 {
        self.batch as u128 * (self.seq_len as u128 + PAGE_SIZE as u128)
    }
    pub fn decode_kv_tokens(&self) -> u128 {
        self.batch as u128 * (self.seq_len as u128 + self.new_tokens as u128 + PAGE_SIZE as u128)
    }
    /// Per rollout: the shared section, the memory fed after it and the new memory; plus the
    /// section's own prefix (the `+ 1`).
    pub fn rollout_kv_tokens(&self) -> u128 {
        (self.batch as u128 + 1) * (self.seq_len as u128 + 2 * self.new_tokens as u128 + PAGE_SIZE as u128)
    }
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
    let mut kv = runtime::kv_for(model, usize::try_from(s.score_kv_tokens())?)?;
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
    let mut kv = runtime::kv_for(model, usize::try_from(s.decode_kv_tokens())?)?;
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
    let mut kv = runtime::kv_for(model, usize::try_from(s.rollout_kv_tokens())?)?;
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

/// The `train` workload of `tools/bench_torch.py`: `batch` random sequences of `seq_len` tokens,
/// GRPO token loss on the last `train_last` of each, one forward + backward (no optimizer step).
#[derive(Clone, Copy, Debug)]
pub struct TrainShape {
    pub batch: usize,
    pub seq_len: usize,
    pub train_last: usize,
}

impl TrainShape {
    pub const TRAIN: TrainShape = TrainShape { batch: 8, seq_len: 512, train_last: 128 };
}

/// The benchmark's adapter: LoRA r 16, α 32 on all seven projections (PEFT init: B = 0).
pub fn bench_adapter(cfg: &ModelConfig) -> LoraAdapter {
    LoraAdapter::init(cfg, 16, 32.0, &ALL_PROJS, 0)
}

/// One timed training step (forward + GRPO loss + backward to every LoRA tensor) on the
/// workload of `tools/bench_torch.py --work train`: advantages +1, −1, +1, …, `logp_old = logp`
/// detached, `logp_ref = logp − 0.01`, ε 0.2/0.28, kl_coef 0.05. The model must carry an
/// adapter (e.g. `model.set_adapter(bench_adapter(&model.cfg))`). Returns (tokens, seconds),
/// tokens = batch · seq_len.
pub fn run_train_bench<B: TrainBackend>(model: &Model<B>, s: TrainShape, seed: u64) -> Result<(usize, f64)> {
    ensure!(model.lora.is_some(), "the train benchmark needs a LoRA adapter on the model (see bench::bench_adapter)");
    ensure!(s.train_last >= 1 && s.train_last < s.seq_len, "train_last {} must be in 1..{}", s.train_last, s.seq_len);
    let mut rng = Rng::new(seed);
    let seqs: Vec<Vec<u32>> = (0..s.batch).map(|_| random_ids(&mut rng, s.seq_len, model.cfg.vocab)).collect();
    let cut = s.seq_len - s.train_last;
    let tseqs: Vec<TrainSeq> = seqs.iter().map(|ids| TrainSeq { prompt: &ids[..cut], response: &ids[cut..] }).collect();
    let c = GrpoConfig { eps_low: 0.2, eps_high: 0.28, kl_coef: 0.05, token_norm: 0 };
    // `timed` synchronizes before reading the clock: on a GPU the layers' backward is still
    // enqueued when policy_grads returns (its last host sync is the head-gradient download)
    let ((stats, grads), secs) = timed(|| model.be.synchronize(), || policy_grads(model, &tseqs, |scores| {
        let convs: Vec<Conversation> = (0..s.batch)
            .map(|i| Conversation {
                prompt: vec![],
                response: vec![0; s.train_last],
                advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
                old_logprobs: None,
                ref_logprobs: Some(scores.logprobs[i].iter().map(|x| x - 0.01).collect()),
            })
            .collect();
        grpo_loss(&convs, scores, &[], &c)
    }))?;
    ensure!(stats.loss.is_finite() && stats.response_tokens == s.batch * s.train_last, "train bench produced a bad loss {}", stats.loss);
    ensure!(grads.sum_squares(&model.be)?.is_finite(), "train bench produced non-finite gradients");
    Ok((s.batch * s.seq_len, secs))
}
