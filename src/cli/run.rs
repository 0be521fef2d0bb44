//! `generate`, `score` and `import-gguf`.
use super::{print_json, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use infomem_engine::backend::{Backend, SampleParams};
use infomem_engine::model::tokenizer::{check_ids, parse_ids, ChatMessage};
use infomem_engine::runtime::{self, GenRequest, Model, SchedOptions, ScoreRequest, Seq};
use infomem_engine::util::rng::Rng;
use serde_json::json;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "chat", "prompt_ids"])))]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Raw prompt text (tokenized as `tokenizer(text)` would, special tokens of the post-processor included).
    #[arg(long)]
    pub prompt: Option<String>,
    /// One user message, rendered through the model's chat template with the generation prompt.
    #[arg(long)]
    pub chat: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    pub prompt_ids: Option<String>,
    /// Maximum number of new tokens to generate (generation also stops at an end-of-sequence id or a --stop string).
    #[arg(long)]
    pub max_new_tokens: usize,
    /// Greedy decoding (the default when no temperature is given).
    #[arg(long, conflicts_with_all = ["temperature", "top_p"])]
    pub greedy: bool,
    /// Sample at this temperature (> 0) instead of greedy decoding.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens with this probability mass, in (0, 1] (needs --temperature; default 1 = whole vocabulary).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Seed of the sampler: the same seed reproduces the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when this string appears in the output (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON line (prompt_ids, new_ids, text, finish, logprobs) instead of the text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("ctx").required(true).args(["context", "chat", "context_ids"])))]
#[command(group(clap::ArgGroup::new("tgt").required(true).args(["target", "target_ids"])))]
pub struct ScoreArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Context as raw text.
    #[arg(long)]
    pub context: Option<String>,
    /// Context as one user message through the chat template (generation prompt on); the target
    /// is then the assistant reply.
    #[arg(long)]
    pub chat: Option<String>,
    /// Context as comma-separated token ids.
    #[arg(long)]
    pub context_ids: Option<String>,
    /// Target text (tokenized without special tokens).
    #[arg(long)]
    pub target: Option<String>,
    /// Target as comma-separated token ids.
    #[arg(long)]
    pub target_ids: Option<String>,
    /// Print one JSON line (context_ids, target_ids, logprobs, mean_logprob) instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The .gguf file.
    #[arg(long)]
    pub gguf: PathBuf,
    /// Output HF model directory, new or empty.
    #[arg(long)]
    pub out: PathBuf,
    /// Write into a non-empty --out: delete the model files there first (*.safetensors, the shard index, configs, tokenizer, chat template; other files stay), once the GGUF file has been checked.
    #[arg(long)]
    pub overwrite: bool,
}

/// `ids` must be non-empty, in the vocabulary, and fit the model's positions together with
/// `extra` more tokens (`extra_what`: the flag that sets them, or what they are, for the message).
fn check_len<B: Backend>(m: &Model<B>, what: &str, ids: &[u32], extra: usize, extra_what: &str) -> Result<()> {
    if ids.is_empty() {
        bail!("{what} is empty");
    }
    check_ids(ids, m.cfg.vocab, what)?;
    let max = m.cfg.max_position;
    if ids.len() > max {
        bail!("{what} is too long: {} tokens exceed the model's {}", ids.len(), m.cfg.position_limit());
    }
    // compared as room left, not as a sum: a huge `extra` must not wrap around (2^64 − 2 new
    // tokens would otherwise pass and fail later as a full KV cache)
    let room = max - ids.len();
    if extra > room {
        let (added, limit) = if extra_what.starts_with("--") {
            (format!("{extra_what} {extra}"), format!("{extra_what} can be at most {room} after it"))
        } else {
            (format!("{extra} {extra_what}"), format!("at most {room} {extra_what} fit after it"))
        };
        bail!("{what} is too long: {} tokens + {added} exceed the model's {}; {limit}", ids.len(), m.cfg.position_limit());
    }
    Ok(())
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    // an empty stop string matches everywhere: generation would stop after one token
    if a.stop.iter().any(String::is_empty) {
        bail!("--stop: an empty string is not a stop string (it would stop after the first token)");
    }
    crate::with_model!(a.model, super::Work::Reference, |model| generate_on(&model, &a))
}

fn generate_on<B: Backend>(model: &Model<B>, a: &GenerateArgs) -> Result<()> {
    let prompt: Vec<u32> = if let Some(s) = &a.prompt_ids {
        parse_ids(s, "--prompt-ids")?
    } else if let Some(t) = &a.prompt {
        model.tokenizer()?.encode_with_special(t)?
    } else {
        let c = a.chat.as_deref().unwrap_or_default();
        model.tokenizer()?.encode_chat(&[ChatMessage::user(c)], true)?
    };
    check_len(model, "the prompt", &prompt, a.max_new_tokens, "--max-new-tokens")?;
    if !a.stop.is_empty() && model.tokenizer.is_none() {
        // a stop string is matched on the decoded text, which needs the tokenizer
        model.tokenizer().map_err(|e| anyhow::anyhow!("--stop needs the model's tokenizer to match text: {e}"))?;
    }
    let params = match (a.greedy, a.temperature) {
        (true, _) | (false, None) => SampleParams::GREEDY,
        (false, Some(t)) => {
            let top_p = a.top_p.unwrap_or(1.0);
            if !(t > 0.0 && t.is_finite()) {
                bail!("--temperature must be a positive number (got {t}); use --greedy for argmax decoding");
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                bail!("--top-p must be in (0, 1] (got {top_p})");
            }
            SampleParams { temperature: t, top_p }
        }
    };
    if a.top_p.is_some() && a.temperature.is_none() {
        bail!("--top-p needs --temperature");
    }
    let mut kv = runtime::kv_for(model, prompt.len() + a.max_new_tokens)?;
    let req = GenRequest {
        seq: Seq::default(),
        feed: prompt.clone(),
        max_new: a.max_new_tokens,
        params,
        rng: Rng::derive(a.seed, 0),
        stop_ids: if a.ignore_eos { vec![] } else { model.eos_ids() },
        stop_strings: a.stop.clone(),
        keep_seq: false,
    };
    let out = runtime::generate(model, &mut kv, vec![req], SchedOptions::default(), |_| {})?.remove(0);
    let text = match &model.tokenizer {
        Some(t) => {
            let ids = match out.finish {
                runtime::Finish::Eos => &out.new_ids[..out.new_ids.len() - 1],
                _ => &out.new_ids[..],
            };
            Some(t.decode(ids, false)?)
        }
        None => None,
    };
    if a.json {
        print_json(&json!({
            "prompt_ids": prompt,
            "new_ids": out.new_ids,
            "text": text,
            "finish": out.finish,
            "logprobs": out.logprobs,
        }));
    } else {
        match text {
            Some(t) => println!("{t}"),
            None => println!("{}", out.new_ids.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")),
        }
    }
    Ok(())
}

pub fn score(a: ScoreArgs) -> Result<()> {
    crate::with_model!(a.model, super::Work::Reference, |model| score_on(&model, &a))
}

fn score_on<B: Backend>(model: &Model<B>, a: &ScoreArgs) -> Result<()> {
    let context: Vec<u32> = if let Some(s) = &a.context_ids {
        parse_ids(s, "--context-ids")?
    } else if let Some(t) = &a.context {
        model.tokenizer()?.encode_with_special(t)?
    } else {
        let c = a.chat.as_deref().unwrap_or_default();
        model.tokenizer()?.encode_chat(&[ChatMessage::user(c)], true)?
    };
    let target: Vec<u32> = if let Some(s) = &a.target_ids {
        parse_ids(s, "--target-ids")?
    } else {
        let t = a.target.as_deref().unwrap_or_default();
        model.tokenizer()?.encode(t)?
    };
    check_len(model, "the target", &target, 0, "")?;
    check_len(model, "the context", &context, target.len(), "target tokens")?;
    let mut kv = runtime::kv_for(model, context.len() + target.len())?;
    let req = ScoreRequest { seq: Seq::default(), context: context.clone(), targets: target.clone(), keep_seq: false };
    let out = runtime::score(model, &mut kv, vec![req], SchedOptions { max_batch_tokens: 4096 })?.remove(0);
    let lps = out.logprobs;
    let mean = lps.iter().map(|&x| x as f64).sum::<f64>() / lps.len() as f64;
    if lps.iter().any(|x| !x.is_finite()) {
        bail!("non-finite log-probability in the output (the model produced NaN/Inf)");
    }
    if a.json {
        print_json(&json!({
            "context_ids": context,
            "target_ids": target,
            "logprobs": lps,
            "mean_logprob": mean,
        }));
    } else {
        println!("mean log-prob {mean:.6} over {} target tokens", lps.len());
        println!("{}", lps.iter().map(|x| format!("{x:.5}")).collect::<Vec<_>>().join(" "));
    }
    Ok(())
}

pub fn import_gguf(a: ImportArgs) -> Result<()> {
    use super::output::{check_out_dir, clear_owned, model_dir_file};
    check_out_dir("--out", &a.out, std::slice::from_ref(&a.gguf), a.overwrite, model_dir_file)?;
    let s = infomem_engine::model::gguf::import_gguf_with(&a.gguf, &a.out, &mut || clear_owned("--out", &a.out, model_dir_file))
        .with_context(|| format!("importing {}", a.gguf.display()))?;
    eprintln!("imported {} ({} tensors, {:.1}M parameters) into {}", s.arch, s.tensors, s.params as f64 / 1e6, a.out.display());
    println!("{}", a.out.display());
    Ok(())
}
