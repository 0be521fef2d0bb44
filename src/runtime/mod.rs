//! Running the transformer: a loaded model on a backend, the paged KV cache, the batched forward
//! step, generation and teacher-forced scoring, and (for training) the LoRA backward.
pub mod backward;
pub mod forward;
pub mod generate;
pub mod kv;
pub mod model;

pub use forward::{Entry, EntryOut, NonFiniteLogits, Want};
pub use generate::{generate, prefill, score, Finish, GenOutput, GenRequest, SchedOptions, ScoreOutput, ScoreRequest};
pub use kv::{KvCache, Seq};
pub use model::{Model, PAGE_SIZE};

use crate::backend::Backend;
use anyhow::Result;

/// A KV cache sized for at most `max_tokens` cached tokens.
pub fn kv_for<B: Backend>(model: &Model<B>, max_tokens: usize) -> Result<KvCache<B>> {
    let g = model.geom();
    KvCache::new(&model.be, g, max_tokens.div_ceil(g.page_size).max(1))
}
