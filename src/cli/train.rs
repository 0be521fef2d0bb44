//! `grpo-grad`: the GRPO loss of a batch file and its gradient w.r.t. every LoRA tensor, written
//! as f32 safetensors under PEFT's key names (the engine's side of the fixture comparison).
use super::{print_json, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use infomem_engine::model::weights::write_safetensors;
use infomem_engine::rl::grpo;
use serde_json::json;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct GrpoGradArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Batch JSON: {"conversations": [{"prompt": [ids], "response": [ids], "advantage": A,
    /// "old_logprobs": [..]?, "ref_logprobs": [..]?}], "eps_low", "eps_high", "kl_coef"}.
    /// Missing old log-probs = the current policy (detached); missing reference log-probs are
    /// computed with the LoRA switched off.
    #[arg(long)]
    pub batch: PathBuf,
    /// Output safetensors file (f32 gradients, keys like
    /// base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight), written atomically.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long)]
    pub json: bool,
}

pub fn grpo_grad(a: GrpoGradArgs) -> Result<()> {
    if a.model.adapter.is_none() {
        anyhow::bail!("grpo-grad needs --adapter DIR: the gradients are taken w.r.t. a LoRA adapter's A and B");
    }
    let model = a.model.load_cpu()?;
    let text = std::fs::read_to_string(&a.batch).with_context(|| format!("cannot read batch file {}", a.batch.display()))?;
    let batch = grpo::parse_batch(&text, model.cfg.vocab).with_context(|| format!("batch file {}", a.batch.display()))?;
    let (stats, grads) = grpo::loss_and_grads(&model, &batch.conversations, &batch.cfg)?;
    let tensors = grads.to_peft(&model)?;
    if let Some((k, _)) = tensors.iter().find(|(_, t)| t.data.iter().any(|v| !v.is_finite())) {
        anyhow::bail!("gradient {k} has non-finite entries");
    }
    write_safetensors(&a.out, &tensors, None).with_context(|| format!("cannot write {}", a.out.display()))?;
    if a.json {
        print_json(&json!({
            "loss": stats.loss,
            "response_tokens": stats.response_tokens,
            "clipped_tokens": stats.clipped_tokens,
            "kl_mean": stats.kl_mean,
            "entropy_mean": stats.entropy_mean,
            "logp_mean": stats.logp_mean,
            "ratio_mean": stats.ratio_mean,
            "tensors": tensors.len(),
            "out": a.out.display().to_string(),
        }));
    } else {
        println!(
            "loss {:.8} over {} response tokens ({} clipped), KL {:.5}, entropy {:.4}; {} gradient tensors → {}",
            stats.loss,
            stats.response_tokens,
            stats.clipped_tokens,
            stats.kl_mean,
            stats.entropy_mean,
            tensors.len(),
            a.out.display()
        );
    }
    Ok(())
}
