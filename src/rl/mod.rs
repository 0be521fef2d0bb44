//! Reinforcement learning on the memory agent: GRPO (group advantages, the multi-conversation
//! broadcast, the clipped token loss with the KL to the LoRA-off reference, its gradient through
//! `runtime::backward`), the AdamW optimizer on the adapter, and the training loop with
//! checkpoints; `config` is what a run is defined by.
pub mod config;
pub mod grpo;
pub mod optim;
pub mod trainer;
