//! The agent's token budgets, stated once: [`Budget`] is embedded (not copied) by the commands'
//! flags (`rollout`/`eval`), by `TrainConfig` (flat keys in its TOML) and by `AgentConfig`; and
//! the one function that sizes a rollout's KV cache from them ([`rollout_kv_tokens`]), which
//! `train`, `eval`, `rollout` and the CUDA memory plan all call.
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Tokens per chunk, per memory rewrite and per answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct Budget {
    /// Tokens per document chunk (a chunk never splits a token).
    #[arg(long, default_value_t = 512)]
    pub chunk_tokens: usize,
    /// Budget of each memory rewrite (new tokens).
    #[arg(long, default_value_t = 256)]
    pub memory_tokens: usize,
    /// Budget of the final answer (new tokens).
    #[arg(long, default_value_t = 32)]
    pub answer_tokens: usize,
}

impl Default for Budget {
    /// The agent commands' defaults (`train` has its own, in `rl::config`).
    fn default() -> Self {
        Budget { chunk_tokens: 512, memory_tokens: 256, answer_tokens: 32 }
    }
}

/// Positions a conversation holds beyond the question, the chunk and the memories: the
/// templates' literal text and the chat markup (the built-in templates take ~120; the rest is
/// room for a longer user template and page rounding).
pub const PROMPT_SLACK: usize = 400;

/// An upper estimate of a question's tokens from its bytes (BPE vocabularies average more than
/// 2 bytes a token on text; the 64 covers short questions of rare bytes).
pub fn question_tokens_bound(question: &str) -> usize {
    question.len() / 2 + 64
}

impl Budget {
    /// Every budget at least 1 (a 0 chunk divides by zero; 0 memory or answer tokens can say
    /// nothing).
    pub fn check(&self) -> Result<()> {
        for (flag, v) in [("--chunk-tokens", self.chunk_tokens), ("--memory-tokens", self.memory_tokens), ("--answer-tokens", self.answer_tokens)] {
            if v == 0 {
                bail!("{flag} must be at least 1 (got 0)");
            }
        }
        Ok(())
    }

    /// KV positions one conversation of a question of `question_tokens` is given: prompt
    /// slack, question, twice the chunk (room for the new memory, which is at most a chunk's
    /// worth past the old one in every template), the memory and the answer. Saturating: the
    /// budgets are checked against the model's positions elsewhere, but a size that overflows
    /// must stay huge, not wrap small.
    pub fn conversation_tokens(&self, question_tokens: usize) -> usize {
        (PROMPT_SLACK + question_tokens)
            .saturating_add(self.chunk_tokens.saturating_mul(2))
            .saturating_add(self.memory_tokens)
            .saturating_add(self.answer_tokens)
    }
}

/// The KV cache (tokens) that the rollouts of a batch of `questions`, `group_size` rollouts each,
/// need at once: per question, every live conversation of the group plus the shared section
/// prefix, the empty-memory score and page slack (the `+ 3`), each as long as the batch's
/// longest question allows. The one sizing function: `train`'s steps and its CUDA memory plan,
/// `eval` and `rollout` use it, so they agree on what a batch holds.
pub fn rollout_kv_tokens<'a>(b: &Budget, group_size: usize, questions: impl IntoIterator<Item = &'a str>) -> usize {
    let (mut n, mut longest) = (0usize, 0usize);
    for q in questions {
        n += 1;
        longest = longest.max(question_tokens_bound(q));
    }
    n.saturating_mul(group_size.saturating_add(3)).saturating_mul(b.conversation_tokens(longest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_a_batch_by_its_longest_question() {
        let b = Budget { chunk_tokens: 128, memory_tokens: 96, answer_tokens: 24 };
        // 400 + (20/2 + 64) + 2·128 + 96 + 24
        assert_eq!(b.conversation_tokens(question_tokens_bound(&"x".repeat(20))), 400 + 74 + 256 + 96 + 24);
        let qs = ["short", &"y".repeat(200)];
        // 2 questions × (4 + 3) conversations × the longer question's conversation
        assert_eq!(rollout_kv_tokens(&b, 4, qs.iter().copied()), 2 * 7 * b.conversation_tokens(164));
        assert_eq!(rollout_kv_tokens(&b, 4, std::iter::empty()), 0);
        // absurd budgets saturate instead of wrapping to a small cache
        let huge = Budget { chunk_tokens: usize::MAX, memory_tokens: usize::MAX, answer_tokens: 1 };
        assert_eq!(rollout_kv_tokens(&huge, usize::MAX, ["q"]), usize::MAX);
    }

    #[test]
    fn zero_budgets_are_refused_by_flag() {
        let e = Budget { memory_tokens: 0, ..Budget::default() }.check().unwrap_err().to_string();
        assert!(e.contains("--memory-tokens must be at least 1"), "{e}");
    }
}
