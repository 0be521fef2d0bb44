//! `reward`: recombine dumped groups under any reward mode (scriptable, one JSON line per group).
use anyhow::Result;
use clap::Args;
use infomem_engine::reward::{self, RewardMode};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct RewardArgs {
    /// JSONL, one group per line: {"outcomes": [0/1...], "gains": [...]}.
    #[arg(long)]
    pub groups: PathBuf,
    /// Reward mode; the groups' `gains` are used as the mode's memory signal (docs/DESIGN.md §1.5).
    #[arg(long, value_enum, default_value_t = RewardMode::Infomem)]
    pub mode: RewardMode,
    /// Weight of the memory signal.
    #[arg(long, default_value_t = 0.5)]
    pub beta: f64,
}

pub fn reward(a: RewardArgs) -> Result<()> {
    anyhow::ensure!(a.beta.is_finite(), "--beta must be a finite number, got {:e}", a.beta);
    // a weight the mode never uses would be ignored in silence
    if a.mode == RewardMode::Outcome && a.beta != 0.5 {
        anyhow::bail!("--beta {} has no effect with --mode outcome (the outcome alone is the reward); leave it out", a.beta);
    }
    let text = infomem_engine::util::fs::read_input_text(&a.groups, "--groups", 1 << 30)?;
    let groups = reward::parse_groups(&text, &a.groups.display().to_string())?;
    if groups.is_empty() {
        anyhow::bail!("{}: no groups (expected one JSON line per group: {{\"outcomes\": [...], \"gains\": [...]}})", a.groups.display());
    }
    // every group is combined before the first is printed: an error leaves no partial output
    let mut lines = Vec::with_capacity(groups.len());
    for (i, g) in groups.iter().enumerate() {
        let r = reward::combine(a.mode, &g.outcomes, &g.gains, a.beta);
        if let Some(x) = r.iter().find(|x| !x.is_finite()) {
            anyhow::bail!("{}: group {} (line {}): a final reward is {x}: --beta {} times its gains overflows", a.groups.display(), i + 1, g.line, a.beta);
        }
        lines.push(serde_json::json!({ "final_rewards": r }).to_string());
    }
    println!("{}", lines.join("\n"));
    Ok(())
}
