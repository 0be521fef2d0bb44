//! Device memory for training: what is usable, the footprint model of a GRPO step behind the
//! "does not fit, this would" error, and how much the LoRA backward may keep (`keep_budget`).
//!
//! **Reuse between rollout and update.** Device memory comes from `device::Heap`: the
//! stream-ordered pool with its release threshold at "never", or plain allocations behind the
//! engine's own block cache where the pool is unavailable (see `device.rs`). Either way memory
//! freed in stream order (the rollout's KV cache when the trainer drops it, the update's
//! activations at the end of `policy_grads`) stays cached and serves the next phase's
//! allocations without a round trip to the driver. What is cached but unused counts as usable
//! ([`MemInfo::usable`]).
//!
//! **The footprint of one training step** beyond the resident weights, phase by phase (the two
//! phases never overlap: `Trainer::one_step` drops the KV cache before the update):
//! - rollout: the KV pool (`kv_tokens` × L·2·kv_dim bf16) + one forward step's activations over
//!   `max_batch_tokens` rows + the logits of the sampled rows;
//! - update: the allocations of `runtime::backward::policy_grads` over the micro-batch's rows
//!   (saved residual per layer, one layer's intermediates, their gradients, the head pass) plus the
//!   backend's scratch, listed term by term in [`update_bytes_per_row`];
//! - always: the LoRA state (f32 master + bf16 shadow, moments, micro-batch and accumulated
//!   gradients).
//! The model reproduces the allocation sizes exactly (every `zeros(n)` reserves 4·n bytes); it
//! leaves out allocator rounding and cuBLASLt's internal needs, hence a 10% margin.
use super::alloc::AllocMode;
use super::CudaBackend;
use crate::model::config::ModelConfig;
use anyhow::{bail, Result};

const GIB: f64 = (1u64 << 30) as f64;
/// Headroom over the modelled footprint (allocator granularity, cuBLASLt, fragmentation).
const MARGIN: f64 = 1.10;

/// Device memory as the allocator sees it (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemInfo {
    /// Free on the device (`cuMemGetInfo`).
    pub free: usize,
    pub total: usize,
    /// Held by the allocator for reuse but unused: the pool's reserved-minus-used memory, or
    /// the plain allocator's cached blocks.
    pub cached: usize,
    /// Bytes of live allocations of this backend.
    pub live: usize,
}

impl MemInfo {
    /// What new allocations can get: free device memory plus what the allocator holds unused.
    pub fn usable(&self) -> usize {
        self.free + self.cached
    }
}

impl CudaBackend {
    pub fn mem_info(&self) -> Result<MemInfo> {
        let d = self.dev.mem_info(*self.heap.mode() == AllocMode::Pool)?;
        let info = MemInfo { free: d.free, total: d.total, cached: d.pool_cached.unwrap_or_else(|| self.heap.cached_bytes()), live: self.heap.live_bytes() };
        Ok(info)
    }

    /// Check that a training run of `plan`'s shape fits next to the weights already on the
    /// device; the error names the knobs and the largest values that fit.
    pub fn check_train_fit(&self, cfg: &ModelConfig, plan: &TrainMemPlan) -> Result<TrainFootprint> {
        let info = self.mem_info()?;
        let fp = TrainFootprint::new(cfg, plan);
        fp.check(info.usable(), &self.device, plan)?;
        Ok(fp)
    }
}

/// The shape of a training run, as far as device memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainMemPlan {
    /// KV cache of a step's rollouts (tokens).
    pub kv_tokens: usize,
    /// Rows of one forward step during rollouts (`--max-batch-tokens`).
    pub rollout_rows: usize,
    /// Rows sampled in one decode step (live conversations: queries × group size, plus prefixes).
    pub sampled_rows: usize,
    /// Rows of one forward/backward pass of the update (the micro-batch; a conversation longer
    /// than `--micro-batch-tokens` forms its own).
    pub update_rows: usize,
    /// LoRA rank and the number of (layer, projection) pairs it adapts.
    pub lora_r: usize,
    pub lora_targets: usize,
    /// For the "what fits" advice: KV tokens one query of the step adds, and the queries per step.
    pub kv_tokens_per_query: usize,
    pub queries: usize,
}

/// Bytes of each phase (see the module comment).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainFootprint {
    pub kv_bytes: usize,
    pub rollout_act_bytes: usize,
    pub update_bytes: usize,
    pub lora_bytes: usize,
    pub update_per_row: usize,
    pub update_fixed: usize,
    pub kv_per_token: usize,
}

/// K and V of one token, all layers, bf16 (the device pool's element type).
pub fn kv_bytes_per_token(cfg: &ModelConfig) -> usize {
    cfg.n_layers * 2 * cfg.kv_dim() * 2
}

/// How much of `usable` device memory the LoRA backward may spend keeping layers' activations
/// instead of recomputing them, given the `working_set` the recompute pass itself allocates:
/// three quarters of what is left after that working set (+10 %) and a 1 GiB reserve for
/// cuBLASLt and fragmentation. Kept or recomputed, the gradients are bit-identical, so this only
/// trades memory for the recompute's forward (a third of a training step).
pub fn keep_budget(usable: usize, working_set: usize) -> usize {
    let reserve = (working_set as f64 * MARGIN) as usize + (1 << 30);
    usable.saturating_sub(reserve) / 4 * 3
}

/// Bytes the update pass allocates per row of the micro-batch: `policy_grads` (f32 room for every
/// `zeros`) and the backend's per-row scratch.
pub fn update_bytes_per_row(cfg: &ModelConfig, r: usize) -> usize {
    let (i, nh) = (cfg.intermediate, cfg.n_heads);
    let (q, qkv) = (cfg.q_dim(), cfg.q_dim() + 2 * cfg.kv_dim());
    let f32s = crate::backend::lora_backward_f32s_per_row(cfg);
    let scratch = 2 * qkv        // bf16 qkv for the attention kernels
        + 2 * q + 4 * nh         // bf16 dO and D = rowsum(dO∘O)
        + 2 * 2 * i              // the largest f32 → bf16 GEMM input conversion (dgu)
        + 2 * (i + 2 * i)        // dy conversions held by one lora_bwd (≤ gate_up width) + matmul_dx
        + 3 * 2 * r; // LoRA scratch x·Aᵀ, u, du (bf16)
    4 * f32s + scratch
}

/// Bytes of the update pass that do not grow with the rows: merged-weight scratch (f32 room for
/// one layer's four matrices), the head pass's tiles.
pub fn update_fixed_bytes(cfg: &ModelConfig) -> usize {
    let (d, i, q, qkv) = (cfg.hidden, cfg.intermediate, cfg.q_dim(), cfg.q_dim() + 2 * cfg.kv_dim());
    let merged = 4 * (qkv * d + d * q + 2 * i * d + d * i);
    let head = (super::logprob::LOGPROB_SCRATCH * 4) * 3 / 2; // f32 logits tile + bf16 probabilities tile
    merged + head
}

impl TrainFootprint {
    pub fn new(cfg: &ModelConfig, p: &TrainMemPlan) -> Self {
        let kv_per_token = kv_bytes_per_token(cfg);
        let (d, i, q, qkv) = (cfg.hidden, cfg.intermediate, cfg.q_dim(), cfg.q_dim() + 2 * cfg.kv_dim());
        // forward.rs step: x h qkv att o gu act per row, f32 room; logits of the sampled rows
        let rollout_act_bytes = 4 * p.rollout_rows * (3 * d + qkv + q + 3 * i) + 4 * 2 * p.sampled_rows * cfg.vocab;
        // per adapted (layer, proj): A [r, in] + B [out, r]; a bound: r·(in + out) ≤ r·2·max width
        let pair_params = p.lora_r * 2 * d.max(i).max(qkv);
        // f32 master + bf16 shadow + 2 moments + micro-batch and accumulated gradients
        let lora_bytes = p.lora_targets * pair_params * (4 + 2 + 8 + 8);
        let update_per_row = update_bytes_per_row(cfg, p.lora_r);
        let update_fixed = update_fixed_bytes(cfg);
        TrainFootprint {
            kv_bytes: p.kv_tokens * kv_per_token,
            rollout_act_bytes,
            update_bytes: update_fixed + p.update_rows * update_per_row,
            lora_bytes,
            update_per_row,
            update_fixed,
            kv_per_token,
        }
    }

    /// Peak of a step: the larger phase plus the LoRA state, with the margin.
    pub fn peak(&self) -> usize {
        let phase = (self.kv_bytes + self.rollout_act_bytes).max(self.update_bytes);
        ((phase + self.lora_bytes) as f64 * MARGIN) as usize
    }

    /// `Ok` when the peak fits `usable` bytes; otherwise an error that says which phase does not
    /// fit and the largest settings that would.
    pub fn check(&self, usable: usize, device: &str, p: &TrainMemPlan) -> Result<()> {
        if self.peak() <= usable {
            return Ok(());
        }
        let budget = (usable as f64 / MARGIN) as usize;
        let fixed = self.lora_bytes;
        let mut why = Vec::new();
        let rollout = self.kv_bytes + self.rollout_act_bytes;
        if rollout + fixed > budget {
            let room = budget.saturating_sub(fixed + self.rollout_act_bytes);
            let kv_fit = room / self.kv_per_token.max(1);
            let q_fit = kv_fit / p.kv_tokens_per_query.max(1);
            why.push(format!(
                "the rollouts' KV cache of {} tokens needs {:.2} GiB (+{:.2} GiB of step activations); {} tokens fit, i.e. --queries-per-step {} (now {}) at these --group-size/--chunk-tokens/--memory-tokens{}",
                p.kv_tokens,
                self.kv_bytes as f64 / GIB,
                self.rollout_act_bytes as f64 / GIB,
                kv_fit,
                q_fit,
                p.queries,
                if q_fit == 0 { " (none: lower --chunk-tokens or --group-size)" } else { "" }
            ));
        }
        if self.update_bytes + fixed > budget {
            let rows_fit = budget.saturating_sub(fixed + self.update_fixed) / self.update_per_row.max(1);
            why.push(format!(
                "the GRPO update over micro-batches of {} tokens needs {:.2} GiB ({:.1} KiB per token); micro-batches of at most {} tokens fit (--micro-batch-tokens {}; a single conversation — about chunk + memory + template tokens — must fit too)",
                p.update_rows,
                self.update_bytes as f64 / GIB,
                self.update_per_row as f64 / 1024.0,
                rows_fit,
                rows_fit
            ));
        }
        if why.is_empty() || fixed > budget / 2 {
            why.push(format!(
                "the LoRA state (rank {} on {} projections: f32 master, bf16 shadow, AdamW moments, gradients) needs {:.2} GiB; rank {} would take half of it",
                p.lora_r,
                p.lora_targets,
                fixed as f64 / GIB,
                (p.lora_r / 2).max(1)
            ));
        }
        bail!(
            "CUDA memory: this training run needs about {:.2} GiB beyond the model's weights, but {:.2} GiB are usable on {device}: {}",
            self.peak() as f64 / GIB,
            usable as f64 / GIB,
            why.join("; ")
        )
    }
}

/// `INFOMEM_KEEP_ACTIVATIONS_MB` if set; else a share of the device memory usable now (the
/// rollout's KV cache is freed before the update), after the recompute pass's own working
/// set: `memory::keep_budget`. On an H200 this keeps every layer of a 0.5B model's 8 × 4096
/// batch and spares the recompute's forward.
pub(super) fn keep_activation_bytes(be: &CudaBackend, working_set: usize) -> Result<usize> {
    if let Some(b) = crate::backend::keep_override()? {
        return Ok(b);
    }
    Ok(keep_budget(be.mem_info()?.usable(), working_set))
}


#[cfg(test)]
mod tests {
    use super::*;

    fn qwen05() -> ModelConfig {
        ModelConfig::from_json(&serde_json::json!({
            "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "tie_word_embeddings": true, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6
        }))
        .unwrap()
    }

    fn plan() -> TrainMemPlan {
        TrainMemPlan {
            kv_tokens: 4 * 11 * 6000,
            rollout_rows: 2048,
            sampled_rows: 64,
            update_rows: 32768,
            lora_r: 16,
            lora_targets: 24 * 7,
            kv_tokens_per_query: 11 * 6000,
            queries: 4,
        }
    }

    /// The per-row model adds up what policy_grads allocates for the 0.5B shape (by hand:
    /// 24·896 saved + 896 x + Acts 896+1152+896+14+896+896+9728+4864 + grads
    /// 896+4864+9728+896+896+1152 + head 4·896 floats, plus bf16/f32 scratch).
    #[test]
    fn footprint_terms() {
        let c = qwen05();
        let f32s = 24 * 896 + 896 + (896 + 1152 + 896 + 14 + 896 + 896 + 9728 + 4864) + (896 + 4864 + 9728 + 896 + 896 + 1152) + 4 * 896;
        let scratch = 2 * 1152 + 2 * 896 + 4 * 14 + 4 * 4864 + 2 * (3 * 4864) + 6 * 16;
        assert_eq!(update_bytes_per_row(&c, 16), 4 * f32s + scratch);
        assert_eq!(kv_bytes_per_token(&c), 24 * 2 * 128 * 2);
        let fp = TrainFootprint::new(&c, &plan());
        // 32K rows of the 0.5B shape: ~9.5 GiB of update state (~296 KB per row, 2.6 GiB of it the
        // saved residuals), ~3 GiB of KV
        assert!(fp.update_bytes > 9 * (1 << 30) && fp.update_bytes < 10 * (1 << 30), "{}", fp.update_bytes);
        assert!(fp.kv_bytes > 3 * (1 << 30) && fp.kv_bytes < 4 * (1 << 30), "{}", fp.kv_bytes); // 264000 tokens × 12 KiB
    }

    #[test]
    fn keep_budget_leaves_the_working_set() {
        const G: usize = 1 << 30;
        // 130 GiB usable, a 9.5 GiB recompute working set: 3/4 of (130 − 10.45 − 1)
        let b = keep_budget(130 * G, 19 * G / 2);
        let want = (130 * G - (19 * G / 2) * 11 / 10 - G) / 4 * 3;
        assert!((b as i64 - want as i64).abs() < (1 << 20), "{b} vs {want}");
        // what is kept plus the working set never exceeds what is usable
        for &(u, w) in &[(2 * G, G), (80 * G, 60 * G), (G / 2, G), (140 * G, 0)] {
            let k = keep_budget(u, w);
            assert!(k == 0 || k + w * 11 / 10 + G <= u, "usable {u} working set {w}: keeps {k}");
        }
        assert_eq!(keep_budget(G, 4 * G), 0, "nothing is kept when the working set alone does not fit");
    }

    #[test]
    fn the_error_says_what_fits() {
        let c = qwen05();
        let p = plan();
        let fp = TrainFootprint::new(&c, &p);
        assert!(fp.check(usize::MAX / 2, "test", &p).is_ok());
        let e = fp.check(2 << 30, "test GPU", &p).unwrap_err().to_string();
        assert!(e.contains("micro-batches of at most") && e.contains("--micro-batch-tokens"), "{e}");
        assert!(e.contains("2.00 GiB are usable on test GPU"), "{e}");
        // the advised micro-batch does fit
        let rows: usize = e.split("--micro-batch-tokens ").nth(1).unwrap().split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap();
        let p2 = TrainMemPlan { update_rows: rows, kv_tokens: 1000, ..p };
        assert!(TrainFootprint::new(&c, &p2).check(2 << 30, "test GPU", &p2).is_ok());
        // a KV cache that alone cannot fit names --queries-per-step
        let p3 = TrainMemPlan { kv_tokens: 40_000_000, update_rows: 1000, ..p };
        let e = TrainFootprint::new(&c, &p3).check(20 << 30, "test GPU", &p3).unwrap_err().to_string();
        assert!(e.contains("KV cache of 40000000 tokens") && e.contains("--queries-per-step"), "{e}");
    }
}
