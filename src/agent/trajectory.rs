//! What a rollout produces: trajectories of turns, each turn one conversation (the unit GRPO
//! trains on) plus how it was generated.
use crate::reward::{self, outcome};
use crate::runtime::Finish;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One (prompt, response) pair: what a rollout generated and what GRPO trains on. The rollout
/// fills `prompt` and `response`; the trainer sets `advantage` (the trajectory's, broadcast to
/// each of its turns). `rl::grpo` uses this type as its batch element.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Conversation {
    /// Full prompt ids (the shared prefix included).
    pub prompt: Vec<u32>,
    /// The generated ids (an end-of-sequence id included when generation stopped on it).
    pub response: Vec<u32>,
    pub advantage: f32,
    /// `None`: the current policy, detached (one update per rollout batch).
    pub old_logprobs: Option<Vec<f32>>,
    /// `None`: computed with the LoRA switched off (skipped when `kl_coef` is 0).
    pub ref_logprobs: Option<Vec<f32>>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum ConvKind {
    Update,
    Final,
}

/// One turn of a trajectory: a memory update or the final answer.
#[derive(Clone, Debug)]
pub struct Turn {
    pub kind: ConvKind,
    pub conv: Conversation,
    /// Tokens of the prompt shared by the group (before the memory slot).
    pub prefix_len: usize,
    /// Log-probabilities of the generated tokens under the sampling policy (temperature 1).
    pub gen_logprobs: Vec<f32>,
    pub finish: Finish,
    /// Wall time of the batched generation step that produced this turn (shared by every turn
    /// generated in that step: prefill and decode of all live groups at chunk t).
    pub step_s: f64,
}

/// A turn as the trajectory JSONL (`rollout --out`) has always written it: these names, in this
/// order; the training-only fields of [`Conversation`] are not part of it.
#[derive(Serialize)]
struct TurnOut<'a> {
    kind: ConvKind,
    prompt_ids: &'a [u32],
    prefix_len: usize,
    gen_ids: &'a [u32],
    gen_logprobs: &'a [f32],
    finish: Finish,
    step_s: f64,
}

#[derive(Deserialize)]
struct TurnIn {
    kind: ConvKind,
    prompt_ids: Vec<u32>,
    prefix_len: usize,
    gen_ids: Vec<u32>,
    gen_logprobs: Vec<f32>,
    finish: Finish,
    step_s: f64,
}

impl Serialize for Turn {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        TurnOut {
            kind: self.kind,
            prompt_ids: &self.conv.prompt,
            prefix_len: self.prefix_len,
            gen_ids: &self.conv.response,
            gen_logprobs: &self.gen_logprobs,
            finish: self.finish,
            step_s: self.step_s,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Turn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let t = TurnIn::deserialize(d)?;
        Ok(Turn {
            kind: t.kind,
            conv: Conversation { prompt: t.prompt_ids, response: t.gen_ids, ..Default::default() },
            prefix_len: t.prefix_len,
            gen_logprobs: t.gen_logprobs,
            finish: t.finish,
            step_s: t.step_s,
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Trajectory {
    pub query_id: String,
    pub query_index: usize,
    pub rollout: usize,
    /// The `K` memory updates, then the final answer.
    #[serde(rename = "conversations")]
    pub turns: Vec<Turn>,
    /// `M_1 .. M_K` as text.
    pub memories: Vec<String>,
    /// Per update: whether the reply was the templates' keep word, so `M_t = M_{t−1}` (empty
    /// when the templates define no keep action).
    #[serde(default)]
    pub kept: Vec<bool>,
    pub raw_answer: String,
    pub answer: String,
    pub em: f64,
    pub sub_em: f64,
    pub f1: f64,
    /// The outcome reward under the configured matcher (0/1).
    pub outcome: f64,
    /// `L(M_K)` and `L(∅)` (mean gold log-prob) and their difference, Eq. 6.
    pub logp_memory: Option<f64>,
    pub logp_empty: Option<f64>,
    pub gain: Option<f64>,
    pub query_gain: Option<f64>,
    /// `L(M_t) − L(∅)` for t = 1..K (with `memory_curve`).
    pub memory_curve: Option<Vec<f64>>,
    /// Gold-word recall of `M_0 = ∅, M_1, .., M_K`.
    pub recall: Vec<f64>,
    /// Final reward (set from `reward::assign` by the caller of the rollout).
    pub reward: Option<f64>,
    /// Wall time of the scoring passes this trajectory took part in (gain, memory curve).
    pub score_s: f64,
}

impl Trajectory {
    /// Whether the final answer ran out of its token budget (`answer_tokens`) before it ended:
    /// a long-winded reply cut before the answer's last characters (`None` before it is given).
    pub fn answer_cut(&self) -> Option<bool> {
        self.turns.last().filter(|t| t.kind == ConvKind::Final).map(|t| t.finish == Finish::Length)
    }
    /// Rollout `rollout` of query `query_index` before its first turn: memory `M_0 = empty_memory`.
    pub fn start(query_id: &str, query_index: usize, rollout: usize, empty_memory: &str, golds: &[String], memory_curve: bool) -> Self {
        Trajectory {
            query_id: query_id.to_string(),
            query_index,
            rollout,
            turns: vec![],
            memories: vec![],
            kept: vec![],
            raw_answer: String::new(),
            answer: String::new(),
            em: 0.0,
            sub_em: 0.0,
            f1: 0.0,
            outcome: 0.0,
            logp_memory: None,
            logp_empty: None,
            gain: None,
            query_gain: None,
            memory_curve: if memory_curve { Some(vec![]) } else { None },
            recall: vec![outcome::word_recall(empty_memory, golds)],
            reward: None,
            score_s: 0.0,
        }
    }

    pub fn generated_tokens(&self) -> usize {
        self.turns.iter().map(|t| t.conv.response.len()).sum()
    }

    /// The lexical signal: Σ_t [recall(M_t) − recall(M_{t−1})].
    pub fn lexical_gain(&self) -> f64 {
        self.recall.windows(2).map(|w| w[1] - w[0]).sum()
    }

    /// This rollout as the reward sees it.
    pub fn reward_signals(&self) -> reward::RolloutSignals {
        reward::RolloutSignals { outcome: self.outcome, answer_gain: self.gain, query_gain: self.query_gain, lexical_gain: self.lexical_gain() }
    }
}
