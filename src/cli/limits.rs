//! Checks made before any work starts, so that bad input is a clear error instead of a panic, an
//! allocation abort, a hang, or a failure after all the compute: the CPU thread count, output
//! paths (writable, and not one of the inputs), the memory agent's budgets against the model's
//! positions, and planned sizes against the memory available. Each error names the flag and the
//! value at fault and what would be valid. `train` uses the same checks (see `check_agent_plan`,
//! `check_lora_fits`).
use anyhow::{anyhow, bail, Result};
use infomem_engine::agent::{Budget, Conversation, PromptPlan, Templates};
use infomem_engine::data::QaRecord;
use infomem_engine::model::config::ModelConfig;
use infomem_engine::model::lora::Proj;
use infomem_engine::model::tokenizer::TextTokenizer;
use std::path::{Path, PathBuf};

// ---- CPU threads ------------------------------------------------------------------------------

/// The most CPU threads `--threads` (or `RAYON_NUM_THREADS`) may ask for. Rayon starts every
/// thread of the pool up front, each with its own stack, and the CPU kernels split their work
/// per thread, so threads past the core count only add contention; 1024 is above the hardware
/// threads of any one machine and starts in milliseconds (100000 took minutes, i.e. a hang).
pub const MAX_THREADS: usize = 1024;

/// Start the global CPU thread pool: `n` threads, or one per core when `n` is 0 (rayon's default,
/// which honours `RAYON_NUM_THREADS`). A count over [`MAX_THREADS`] or a pool that cannot start
/// (e.g. no memory for the stacks) is an error; rayon would otherwise panic on first use.
pub fn init_threads(n: usize) -> Result<()> {
    let env = std::env::var("RAYON_NUM_THREADS").ok();
    let (asked, source) = match (n, env.as_deref().map(|v| (v, v.trim().parse::<usize>()))) {
        (0, Some((v, Ok(k)))) if k > 0 => (k, format!("RAYON_NUM_THREADS={v}")),
        (0, _) => (0, "--threads 0 (one per core)".to_string()),
        (n, _) => (n, format!("--threads {n}")),
    };
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if asked > MAX_THREADS {
        bail!("{source}: at most {MAX_THREADS} CPU threads can be used (this machine has {cores} cores; 0 = one per core)");
    }
    if asked > cores {
        // allowed (a machine may hide cores from available_parallelism), but never silently:
        // on 2 cores, 1024 threads made a training step 100x slower
        eprintln!(
            "warning: {source} asks for more threads than this machine's {cores} cores; every CPU kernel splits its work per thread, \
             so the extra threads only contend (expect each step to be several times slower). 0 = one per core"
        );
    }
    // the pool rayon will start: `asked`, or one per core
    check_thread_address_space(&source, if asked > 0 { asked } else { cores })?;
    let mut b = rayon::ThreadPoolBuilder::new().stack_size(pool_stack_bytes() as usize);
    if n > 0 {
        b = b.num_threads(n);
    }
    b.build_global().map_err(|e| anyhow!("{source}: cannot start the CPU thread pool ({e}); ask for fewer threads"))
}

/// Stack of each pool thread: the command itself runs on one of them (`main`), so it gets the
/// main thread's usual 8 MiB, or `RUST_MIN_STACK` where that asks for more. Address space only:
/// pages are committed as they are touched.
fn pool_stack_bytes() -> u64 {
    const MAIN: u64 = 8 << 20;
    std::env::var("RUST_MIN_STACK").ok().and_then(|v| v.trim().parse::<u64>().ok()).map_or(MAIN, |v| v.max(MAIN))
}

/// Refuse a pool whose thread stacks cannot fit in the address space left under `ulimit -v`
/// (RLIMIT_AS). Rayon reports a thread whose stack cannot be mapped as an error, but a thread
/// whose stack fits and whose signal stack then does not (std maps one per thread as it starts)
/// aborts the whole process, and which of the two happens is a race; so the sum is checked first.
/// Per thread: its stack ([`pool_stack_bytes`]) plus 1 MiB for the guard and
/// signal stack pages and libc's per-thread state; 128 MiB stay free for the work itself. This is
/// a lower bound (glibc's malloc arenas, up to 64 MiB each, come on top), so a pool just under it
/// can still fail to start, which rayon then reports as an error in all but that race.
fn check_thread_address_space(source: &str, threads: usize) -> Result<()> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes the struct it is given
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        return Ok(());
    }
    const MIB: u64 = 1 << 20;
    let stack = pool_stack_bytes();
    let used = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("VmSize:").and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())))
        .map_or(0, |kb| kb * 1024);
    let need = threads as u64 * (stack + MIB) + 128 * MIB;
    let left = lim.rlim_cur.saturating_sub(used);
    if need > left {
        bail!(
            "{source}: cannot start the CPU thread pool: {threads} threads need at least {} MiB of address space and the limit (ulimit -v) leaves {} MiB; ask for fewer threads",
            need / MIB,
            left / MIB
        );
    }
    Ok(())
}

// ---- output paths -----------------------------------------------------------------------------

/// Refuse an output that is one of the inputs: the same file after symlinks, or a hard link of
/// it (same device and inode). Writing it would destroy the input. A directory input stands for
/// every file under it (pass a model directory through [`model_files`]).
pub fn check_not_input(flag: &str, out: &Path, inputs: &[PathBuf]) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    // an output that does not exist yet cannot be an input
    let Ok(o) = std::fs::metadata(out) else { return Ok(()) };
    if o.is_dir() {
        return Ok(());
    }
    let same = |p: &Path| std::fs::metadata(p).is_ok_and(|m| (m.dev(), m.ino()) == (o.dev(), o.ino()));
    for input in inputs {
        if let Some(hit) = find_file(input, 3, &same) {
            bail!(
                "{flag} {}: this file is also an input ({}); writing it would destroy that input — choose another output path",
                out.display(),
                hit.display()
            );
        }
    }
    Ok(())
}

/// Two paths naming one file (after symlinks and hard links); paths that cannot be read are
/// compared as written.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => (x.dev(), x.ino()) == (y.dev(), y.ino()),
        _ => a == b,
    }
}

/// The files of a model or adapter directory that loading reads (`*.json`, `*.safetensors`,
/// `*.jinja`), so that an output kept beside them (a `traj.jsonl`) is not taken for an input.
pub fn model_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else { return vec![dir.to_path_buf()] };
    rd.flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json" || x == "safetensors" || x == "jinja"))
        .collect()
}

/// `path` itself, or a file under it (down to `depth` levels), for which `hit` holds.
fn find_file(path: &Path, depth: usize, hit: &dyn Fn(&Path) -> bool) -> Option<PathBuf> {
    if path.is_dir() {
        if depth == 0 {
            return None;
        }
        let entries = std::fs::read_dir(path).ok()?;
        entries.flatten().find_map(|e| find_file(&e.path(), depth - 1, hit))
    } else {
        hit(path).then(|| path.to_path_buf())
    }
}

/// Fail now, not after the compute, if a file cannot be written at `out` (atomically: a new file
/// in its directory, then a rename; missing directories are created).
pub fn check_writable_file(flag: &str, out: &Path) -> Result<()> {
    if out.is_dir() {
        bail!("{flag} {}: is a directory (expected a file path)", out.display());
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    probe_dir(flag, out, parent)
}

/// Fail now if files cannot be written into the directory `out` (created when missing).
pub fn check_writable_dir(flag: &str, out: &Path) -> Result<()> {
    if out.exists() && !out.is_dir() {
        bail!("{flag} {}: exists and is not a directory (expected an output directory)", out.display());
    }
    probe_dir(flag, out, out)
}

/// Create and remove a file in `dir`, or, when `dir` does not exist yet, in its nearest existing
/// ancestor (the directories in between are created later). Permission bits alone would not
/// stop root, so this tries the real thing.
fn probe_dir(flag: &str, out: &Path, dir: &Path) -> Result<()> {
    let mut at = dir.to_path_buf();
    while !at.exists() {
        // a dangling symlink on the way cannot be created through either
        if at.symlink_metadata().is_ok() {
            bail!("{flag} {}: {} is a broken symbolic link", out.display(), at.display());
        }
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p.to_path_buf(),
            _ => at = PathBuf::from("."),
        }
    }
    if !at.is_dir() {
        bail!("{flag} {}: cannot be created, {} is not a directory", out.display(), at.display());
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let probe = at.join(format!(".infomem-write-probe.{}.{nanos}", std::process::id()));
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => bail!("{flag} {}: cannot write in {} ({e})", out.display(), at.display()),
    }
}

// ---- memory -----------------------------------------------------------------------------------

/// Bytes of memory this process can still take: `MemAvailable`, or less under a cgroup (v2)
/// limit. `None` where neither can be read (the memory checks are then skipped).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines().find_map(|l| l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()).map(|kb| kb * 1024)
    });
    let read = |f: &str| std::fs::read_to_string(Path::new("/sys/fs/cgroup").join(f)).ok()?.trim().parse::<u64>().ok();
    let cgroup = read("memory.max").map(|max| max.saturating_sub(read("memory.current").unwrap_or(0)));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `1.5 GiB`-style size.
pub fn human(bytes: u128) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// Refuse a plan that needs at least `need` bytes when less is available; `what` says what
/// needs it and `hint` what to lower.
pub fn check_memory(need: u128, what: &str, hint: &str) -> Result<()> {
    if let Some(avail) = available_memory() {
        if need > avail as u128 {
            bail!("{what} need at least {} of memory, but {} is available; {hint}", human(need), human(avail as u128));
        }
    }
    Ok(())
}

/// The LoRA adapter `train` creates: A and B of every targeted projection in every layer, with
/// their gradients and AdamW's two moments (f32 each). Call before `LoraAdapter::init`.
#[allow(dead_code)] // for `train` (src/cli/train.rs), which does not call it yet
pub fn check_lora_fits(cfg: &ModelConfig, r: usize, targets: &[Proj]) -> Result<()> {
    let per_rank: u128 = targets.iter().map(|p| p.dims(cfg)).map(|(i, o)| (i + o) as u128).sum::<u128>() * cfg.n_layers as u128;
    let bytes_per_rank = per_rank * 4 * 4;
    let fits = available_memory().map(|a| a as u128 / bytes_per_rank.max(1));
    check_memory(
        r as u128 * bytes_per_rank,
        &format!("--lora-r {r}: the adapter's parameters, gradients and AdamW moments ({} targets × {} layers)", targets.len(), cfg.n_layers),
        &match fits {
            Some(f) => format!("at most --lora-r {f} fits"),
            None => "lower --lora-r".into(),
        },
    )
}

/// `machine --read-mb`: the bandwidth test's buffer, held whole.
pub fn check_probe_fits(read_mb: usize) -> Result<()> {
    check_memory((read_mb as u128) << 20, &format!("--read-mb {read_mb}: the bandwidth test's {read_mb} MiB"), "lower --read-mb")
}

/// Sizes `data synth` will hold: every record, then the whole JSONL text (at least 2 bytes a
/// token each: no tokenizer gives English text fewer than 2 characters a token).
pub fn check_synth_fits(tokens: usize, count: usize) -> Result<()> {
    check_memory(
        tokens as u128 * count as u128 * 2 * 2,
        &format!("--count {count} records of --tokens {tokens}"),
        "lower --count or --tokens (or write several files with different --seed)",
    )
}

/// What one `bench` run holds at once (see `cli::bench::bench_plan`).
pub struct BenchPlan {
    /// The flags, for messages.
    pub what: String,
    /// The longest sequence, in positions.
    pub positions: u128,
    /// Tokens of the KV cache.
    pub kv_tokens: u128,
    /// Rows of activations computed at once.
    pub rows: u128,
    /// Whether every layer's activations are kept (train's backward needs them).
    pub kept_layers: bool,
    /// Rows of logits (vocabulary-wide) computed at once.
    pub logit_rows: u128,
    /// Other bytes held for the whole run (rollout's sections).
    pub held_bytes: u128,
}

/// Bytes of a KV cache of `tokens` tokens, K and V of every layer in bf16: a lower bound (the
/// f32 path stores f32) for the memory checks.
pub fn kv_bytes(cfg: &ModelConfig, tokens: u128) -> u128 {
    tokens * (cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2) as u128
}

/// A `bench` shape against the model's positions and the memory available, before the model
/// loads. The memory is a lower bound (K/V in bf16, each activation row's hidden and MLP
/// vectors in f32 once): a shape refused here cannot run, one let through may still need more.
pub fn check_bench_fits(cfg: &ModelConfig, p: &BenchPlan) -> Result<()> {
    if p.positions > cfg.max_position as u128 {
        bail!("{}: sequences of {} positions, but the model has {}", p.what, p.positions, cfg.position_limit());
    }
    let kv = kv_bytes(cfg, p.kv_tokens);
    let row = ((cfg.hidden + 2 * cfg.intermediate) * 4) as u128 * if p.kept_layers { cfg.n_layers as u128 } else { 1 };
    let need = kv + p.rows * row + p.logit_rows * cfg.vocab as u128 * 4 + p.held_bytes;
    check_memory(need, &format!("{}: its KV cache and activations", p.what), "lower --batch or --seq-len")
}

// ---- the memory agent's budgets ---------------------------------------------------------------

/// What is teacher-forced after the final prompt besides the answer: the gold answer (gain,
/// memory curve) and the question (query gain).
#[derive(Clone, Copy, Debug)]
pub struct Scored {
    pub gold: bool,
    pub question: bool,
}

/// How many rollouts are held in memory at once: `queries` queries × `group` rollouts.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub queries: usize,
    pub group: usize,
}

/// Check, before any rollout, that every record's conversations fit the model's positions
/// (template + question + chunk + memory + what is generated or scored after it, for the memory
/// update and for the final prompt), and that the trajectories of `held` rollouts fit in memory.
/// Returns each record's document length in tokens (the agent's chunk count needs it).
///
/// `train` calls this with all its records and `Held { queries: queries_per_step, group:
/// group_size }`, `Scored { gold: true, question: reward == infomem-query }`.
#[allow(clippy::too_many_arguments)]
pub fn check_agent_plan(
    cfg: &ModelConfig,
    model_name: &str,
    tok: &TextTokenizer,
    templates: &Templates,
    recs: &[QaRecord],
    b: &Budget,
    scored: Scored,
    held: Held,
) -> Result<Vec<usize>> {
    b.check()?;
    if held.group == 0 {
        bail!("--group-size must be at least 1 (got 0)");
    }
    let upd_lit = PromptPlan::new(tok, &templates.update)?.literal_len();
    let fin_lit = PromptPlan::new(tok, &templates.final_)?.literal_len();
    let empty = tok.encode(&templates.empty_memory)?.len();
    // the memory slot holds the empty memory or a memory of at most --memory-tokens tokens
    let mem = b.memory_tokens.max(empty);
    let p = cfg.max_position;
    let mut docs = Vec::with_capacity(recs.len());
    let mut traj_bytes: Vec<u128> = Vec::with_capacity(recs.len());
    let mut worst: Option<(usize, usize, String)> = None; // (record, positions, breakdown)
    let mut bad = 0usize;
    for (i, r) in recs.iter().enumerate() {
        let q = tok.encode(&r.question)?.len();
        let n = tok.encode(&r.context)?.len();
        let gold = tok.encode(r.answers.first().map_or("", |a| a.trim()))?.len();
        let chunk = b.chunk_tokens.min(n);
        let update = [upd_lit, q, chunk, mem, b.memory_tokens].iter().fold(0usize, |a, &x| a.saturating_add(x));
        let after = b.answer_tokens.max(if scored.gold { gold } else { 0 }).max(if scored.question { q } else { 0 });
        let fin = [fin_lit, q, mem, after].iter().fold(0usize, |a, &x| a.saturating_add(x));
        let (need, why) = if update >= fin {
            (update, format!("the memory update needs {update} positions: template {upd_lit} + question {q} + chunk {chunk} + memory {mem} + new memory {} (--memory-tokens)", b.memory_tokens))
        } else {
            let what = if after == b.answer_tokens { "answer (--answer-tokens)" } else if after == q && scored.question { "scored question" } else { "scored gold answer" };
            (fin, format!("the final prompt needs {fin} positions: template {fin_lit} + question {q} + memory {mem} + {what} {after}"))
        };
        if need > p {
            bad += 1;
            if worst.as_ref().is_none_or(|(_, w, _)| need > *w) {
                worst = Some((i, need, why));
            }
        }
        docs.push(n);
        // a trajectory keeps every prompt's ids (u32): K update prompts (template + question,
        // the chunks adding up to the document) and the final prompt; memories not counted
        let k = n.div_ceil(b.chunk_tokens) as u128;
        traj_bytes.push(4 * (k * (upd_lit + q) as u128 + n as u128 + (fin_lit + q) as u128));
    }
    if let Some((i, _, why)) = worst {
        bail!(
            "record {} ({} of {} records do not fit): {why}, but {model_name} has {}; \
             lower --chunk-tokens, --memory-tokens or --answer-tokens, or shorten the templates (--templates) or the questions",
            recs[i].id,
            bad,
            recs.len(),
            cfg.position_limit()
        );
    }
    let per_query: u128 = if held.queries == recs.len() {
        traj_bytes.iter().sum()
    } else {
        traj_bytes.iter().min().copied().unwrap_or(0) * held.queries as u128
    };
    let need = per_query * held.group as u128;
    let fits = available_memory().map(|a| a as u128 * held.group as u128 / need.max(1));
    check_memory(
        need,
        &format!("{} queries × {} rollouts each (--group-size {}): their trajectories alone", held.queries, held.group, held.group),
        &match fits {
            Some(f) => format!("at most --group-size {f} fits with these queries"),
            None => "lower --group-size or the number of queries".into(),
        },
    )?;
    Ok(docs)
}

/// Every conversation of a GRPO batch fits the model's positions (prompt + response). For
/// `grpo-grad`, right after `grpo::parse_batch`.
#[allow(dead_code)] // for `grpo-grad` (src/cli/train.rs), which does not call it yet
pub fn check_conversations_fit(convs: &[Conversation], max_position: usize, limit: &str) -> Result<()> {
    for (i, c) in convs.iter().enumerate() {
        let n = c.prompt.len().saturating_add(c.response.len());
        if n > max_position {
            bail!(
                "conversation {i}: prompt {} + response {} = {n} positions, more than the model's {limit}",
                c.prompt.len(),
                c.response.len()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use infomem_engine::agent::Conversation;
    use infomem_engine::model::lora::ALL_PROJS;

    fn tiny_cfg() -> ModelConfig {
        ModelConfig::from_json(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256
        }))
        .unwrap()
    }

    #[test]
    fn lora_rank_against_memory() {
        let cfg = tiny_cfg();
        assert!(check_lora_fits(&cfg, 16, &ALL_PROJS).is_ok());
        if available_memory().is_some() {
            // 10^12 × 7 targets × 2 layers × (in + out) × 16 bytes: petabytes
            let e = check_lora_fits(&cfg, 1_000_000_000_000, &ALL_PROJS).unwrap_err().to_string();
            assert!(e.contains("--lora-r 1000000000000") && e.contains("at most --lora-r"), "{e}");
        }
    }

    #[test]
    fn conversations_against_positions() {
        let conv = |p: usize, r: usize| Conversation { prompt: vec![1; p], response: vec![2; r], ..Default::default() };
        assert!(check_conversations_fit(&[conv(250, 6)], 256, "max_position_embeddings 256").is_ok());
        let e = check_conversations_fit(&[conv(3, 2), conv(300, 2)], 256, "max_position_embeddings 256").unwrap_err().to_string();
        assert!(e.contains("conversation 1") && e.contains("302") && e.contains("max_position_embeddings 256"), "{e}");
    }
}
