//! infomem-engine: train long-context memory agents with GRPO and the InfoMem reward.
//!
//! Data flows one way: `model` (configs, weights, tokenizer, LoRA) → `backend` (the fixed set of
//! ops this transformer needs, CPU and CUDA) → `runtime` (forward with a paged KV cache, batched
//! generation, teacher-forced log-probs, LoRA backward) → `agent` (chunked memory rollouts) →
//! `reward` (outcome, gain, InfoMem) → `rl` (GRPO, AdamW, trainer) → `eval`, `data`.
pub mod agent;
pub mod backend;
pub mod bench;
pub mod data;
pub mod eval;
pub mod model;
pub mod reward;
pub mod rl;
pub mod runtime;
pub mod study;
pub mod util;
