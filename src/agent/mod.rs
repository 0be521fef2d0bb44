//! The chunk-wise memory agent: templates, token-level prompt assembly, batched rollouts with a
//! shared section prefix, and the trajectories they produce.
pub mod budget;
pub mod rollout;
pub mod templates;
pub mod trajectory;

pub use budget::{rollout_kv_tokens, Budget};
pub use rollout::{rollout, AgentConfig, RolloutStats};
pub use templates::{PromptPlan, Templates};
pub use trajectory::{ConvKind, Conversation, Trajectory, Turn};
