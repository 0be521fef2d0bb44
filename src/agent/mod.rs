//! The chunk-wise memory agent: templates, token-level prompt assembly, and batched rollouts with
//! a shared section prefix (DESIGN.md §1, §3).
pub mod rollout;
pub mod templates;

pub use rollout::{rollout, AgentConfig, AgentQuery, ConvKind, Conversation, RolloutStats, Trajectory};
pub use templates::{PromptPlan, Templates};
