//! Running what is left: the selection of cells, the dry run, the children spawned (logged, dying
//! with the study), the study directory's lock and the progress line.
use super::config::{EvalSet, LOCK_FILE, StudyConfig, p};
use super::plan::{Cell, cells, eval_command, reproduce_command, show_cmd, train_command};
use super::identity::{finished, record, record_unrecorded};
use super::report::report;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub(super) fn fmt_dur(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// What to run: the study, its selection of arms (`None` = all) and the binary to spawn.
pub struct RunOptions<'a> {
    pub only: Option<&'a [String]>,
    /// The arms' seeds to run in this sitting (`None` = all).
    pub seeds: Option<&'a [u64]>,
    /// The evaluation sets to run in this sitting (`None` = all); the others wait for a later one.
    pub evals: Option<&'a [String]>,
    pub dry_run: bool,
    pub exe: PathBuf,
}

/// Every name a selection flag gives must be one the study has: `--only: no arm named "x" (arms: …)`.
fn check_names(flag: &str, what: &str, kind: &str, names: &[String], known: &[&str]) -> Result<()> {
    match names.iter().find(|n| !known.contains(&n.as_str())) {
        Some(name) => bail!("{flag}: no {what} named {name:?} ({kind}: {})", known.join(", ")),
        None => Ok(()),
    }
}

/// The cells of this sitting: `only` names arms or `base` (the base model's cell), `seeds` the
/// arms' seeds; `None` = all. The base model's cell has no seed and is selected by `only` alone.
pub(super) fn selected(cfg: &StudyConfig, only: Option<&[String]>, seeds: Option<&[u64]>) -> Result<Vec<Cell>> {
    if let Some(o) = only {
        let known: Vec<&str> = std::iter::once("base").chain(cfg.arms.iter().map(|a| a.name.as_str())).collect();
        check_names("--only", "arm", "arms", o, &known)?;
    }
    if let Some(ss) = seeds {
        if let Some(s) = ss.iter().find(|s| !cfg.seeds.contains(s)) {
            bail!("--seeds: {s} is not one of the study's seeds ({})", cfg.seeds.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", "));
        }
    }
    Ok(cells(cfg)
        .into_iter()
        .filter(|c| only.is_none_or(|o| o.contains(&c.arm)) && c.seed.is_none_or(|s| seeds.is_none_or(|ss| ss.contains(&s))))
        .collect())
}

/// A cell that holds results but not their adapter gets nothing more unless its adapter can be
/// made again byte for byte (its kept hash, `reproduce_command`): refuse, before anything runs,
/// a sitting that would evaluate it otherwise (two adapters' results would be mixed in one cell),
/// or whose training again already gave other bytes (`reproduce/adapter`).
fn refuse_adding_to_kept_results(cfg: &StudyConfig, cells: &[Cell], evals: &[&EvalSet]) -> Result<()> {
    const WAYS_OUT: &str = "leave this cell out of the sitting (--only, --seeds, or --evals with finished sets)";
    for c in cells.iter().filter(|c| c.seed.is_some() && !c.trained()) {
        let left: Vec<&str> = evals.iter().filter(|e| !c.evaluated(&e.name)).map(|e| e.name.as_str()).collect();
        if left.is_empty() {
            continue;
        }
        match c.kept_adapter_sha256() {
            None if c.results_without_adapter() => bail!(
                "{} holds evaluations ({}) but neither the adapter that made them ({}) nor its hash to check a new training against \
                 (train/adapter.sha256, kept by tools/study_results.py): the sets left ({}) cannot be run on that adapter, \
                 and an unchecked training would mix two adapters' results in one cell.\n\
                 Restore the adapter, or {WAYS_OUT}, or delete the cell to train and evaluate it afresh:\n  rm -r {}",
                c.name(),
                c.finished_sets().join(", "),
                p(&c.adapter()),
                left.join(", "),
                p(&c.dir)
            ),
            Some(kept) => match c.reproduced_sha256()? {
                Some(made) if made != kept => bail!("{}", not_reproduced(c, &made, &kept)),
                Some(_) => {}
                // not trained again yet: a thread count other than the first training's gives
                // other bytes, found only after the whole training; refuse it now
                None => match (c.trained_threads(), cfg.threads.filter(|&t| t > 0)) {
                    (Some(then), Some(now)) if then != now => bail!(
                        "{}: its kept adapter was trained with --threads={then} (its log.txt) and this study runs --threads={now}: \
                         training again with another thread count does not give the same bytes, so it could never join the cell. \
                         Set `threads = {then}` in the study file, or {WAYS_OUT}.",
                        c.name()
                    ),
                    _ => {}
                },
            },
            None => {}
        }
    }
    Ok(())
}

/// Why a kept cell's training again cannot join it, and the ways out.
fn not_reproduced(c: &Cell, made: &str, kept: &str) -> String {
    format!(
        "{}: training again did not reproduce the adapter its results were made with ({made}, kept {kept}): this machine or \
         build computes otherwise (another CPU kind, thread count or version). The cell's results are untouched; the new training \
         stays apart in {}. Evaluate this cell where it was made, or leave it out of the sitting (--only, --seeds, or --evals with \
         finished sets), or delete the cell to train and evaluate it afresh.",
        c.name(),
        p(&c.reproduce_dir())
    )
}

/// The evaluation sets of this sitting: all, or those `--evals` names (each must exist).
pub(super) fn selected_evals<'c>(cfg: &'c StudyConfig, names: Option<&[String]>) -> Result<Vec<&'c EvalSet>> {
    let Some(names) = names else { return Ok(cfg.evals.iter().collect()) };
    check_names("--evals", "evaluation set", "sets", names, &cfg.evals.iter().map(|e| e.name.as_str()).collect::<Vec<_>>())?;
    Ok(cfg.evals.iter().filter(|e| names.contains(&e.name)).collect())
}

/// Run what is left of the study, then write the report. With `dry_run`, print the plan and the
/// exact commands instead (nothing is created).
pub fn run(cfg: &StudyConfig, o: &RunOptions) -> Result<()> {
    let cells = selected(cfg, o.only, o.seeds)?;
    let evals = selected_evals(cfg, o.evals)?;
    refuse_adding_to_kept_results(cfg, &cells, &evals)?;
    let total = cells.len();
    if o.dry_run {
        println!("study {}: {} cells ({} arms, {} seed(s), + base), {} evaluation set(s)", p(&cfg.out), total, cfg.arms.len(), cfg.seeds.len(), cfg.evals.len());
        for (i, c) in cells.iter().enumerate() {
            let cmds: Vec<_> = trains(cfg, c, &evals).into_iter().chain(evals.iter().filter_map(|e| eval_command(cfg, c, e))).collect();
            if cmds.is_empty() {
                println!("[cell {}/{total}] {}: finished, skipped", i + 1, c.name());
            }
            for (what, args) in cmds {
                println!("[cell {}/{total}] {}: {what}\n  {}", i + 1, c.name(), show_cmd(&o.exe, &args));
            }
        }
        return Ok(());
    }
    crate::util::interrupt::install();
    let _lock = lock(cfg)?;
    let start = Instant::now();
    let mut done_times: Vec<Duration> = Vec::new();
    for (i, c) in cells.iter().enumerate() {
        let tag = format!("[cell {}/{total}] {}", i + 1, c.name());
        let left = to_train(&cells[i..]);
        record_unrecorded(cfg, c, &tag)?;
        if finished(cfg, c) {
            eprintln!("{tag}: finished, skipped");
            continue;
        }
        // what this sitting runs for the cell (an evaluation's command does not depend on the training)
        let trains = trains(cfg, c, &evals);
        let reproducing = !c.trained() && c.kept_adapter_sha256().is_some() && trains.is_some();
        let eval_cmds: Vec<_> = evals.iter().filter_map(|e| eval_command(cfg, c, e)).collect();
        if trains.is_none() && eval_cmds.is_empty() {
            if c.results_without_adapter() {
                eprintln!("{tag}: nothing selected is left (its results are kept without their adapter; a sitting with a set it lacks trains that adapter again, checked by its kept hash)");
            } else {
                eprintln!("{tag}: nothing selected is left (its other evaluation sets run in a sitting without --evals)");
            }
            continue;
        }
        let t0 = Instant::now();
        std::fs::create_dir_all(&c.dir).with_context(|| format!("cannot create {}", c.dir.display()))?;
        let log = c.dir.join("log.txt");
        // training first: the evaluations need its adapter
        let trained_now = trains.is_some();
        if let Some((what, args)) = trains {
            eprintln!("{tag}: {what} ... ({})", progress(start, &done_times, left));
            record(cfg, c, "train")?;
            spawn_logged(&o.exe, &args, &log, &tag)?;
            if reproducing {
                adopt_reproduced(c)?;
                eprintln!("{tag}: the adapter is the kept one, byte for byte ({})", c.kept_adapter_sha256().unwrap_or_default());
            }
        }
        for (what, args) in eval_cmds {
            eprintln!("{tag}: {what} ... ({})", progress(start, &done_times, left));
            record(cfg, c, &what)?;
            spawn_logged(&o.exe, &args, &log, &tag)?;
        }
        // the ETA comes from the cells trained in this sitting only: a cell that only evaluated
        // (the base, or one trained in an earlier sitting) is much shorter
        if trained_now {
            done_times.push(t0.elapsed());
        }
        eprintln!("{tag}: done in {}", fmt_dur(t0.elapsed()));
    }
    report(cfg)?;
    eprintln!("study finished in {}: {}/study.md", fmt_dur(start.elapsed()), p(&cfg.out));
    Ok(())
}

/// The training a cell still needs. A cell kept without its adapter (a kept hash, or results)
/// gets one only to reproduce that adapter, and only when an evaluation is left to run on it.
fn trains(cfg: &StudyConfig, c: &Cell, evals: &[&EvalSet]) -> Option<(String, Vec<String>)> {
    if !c.trained() && (c.kept_adapter_sha256().is_some() || c.results_without_adapter()) {
        return evals.iter().any(|e| !c.evaluated(&e.name)).then(|| reproduce_command(cfg, c)).flatten();
    }
    train_command(cfg, c)
}

/// After a kept cell's training again: its adapter must be the kept one, byte for byte, to join
/// the cell (moved to `train/adapter`, `reproduce/` removed); otherwise the cell is left as it
/// was and the new training stays apart in `reproduce/`.
fn adopt_reproduced(c: &Cell) -> Result<()> {
    let kept = c.kept_adapter_sha256().context("no kept adapter hash")?;
    let dir = c.reproduce_dir();
    let made = c.reproduced_sha256()?.context("the training again left no adapter")?;
    if made != kept {
        bail!("{}", not_reproduced(c, &made, &kept));
    }
    std::fs::rename(dir.join("adapter"), c.adapter()).with_context(|| format!("cannot move the reproduced adapter to {}", p(&c.adapter())))?;
    std::fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", p(&dir)))?;
    Ok(())
}

/// Lock the study directory (created if missing) for this process's lifetime: one study
/// process per directory (`.study.lock`).
pub fn lock(cfg: &StudyConfig) -> Result<crate::util::lock::DirLock> {
    crate::util::lock::lock_dir_named(&cfg.out, LOCK_FILE, "study out")
}

/// `--report-only`: rewrite the report from the finished evaluations, under the study's lock;
/// refused when nothing has been evaluated yet (there is nothing to report).
pub fn report_only(cfg: &StudyConfig) -> Result<Value> {
    let any = cells(cfg).iter().any(|c| cfg.evals.iter().any(|e| c.evaluated(&e.name)));
    if !any {
        bail!(
            "--report-only: nothing has run in {} yet (no cell has a finished evaluation): run the study first (without --report-only)",
            p(&cfg.out)
        );
    }
    let _lock = lock(cfg)?;
    report(cfg)
}

/// The cells among these that still have to be trained (an arm's cell without its adapter):
/// what the ETA multiplies the mean training cell's time by.
pub(super) fn to_train(cells: &[Cell]) -> usize {
    // a kept cell without a hash is never trained; one with a hash is trained again (to reproduce it)
    cells.iter().filter(|c| !c.trained() && !(c.results_without_adapter() && c.kept_adapter_sha256().is_none())).count()
}

/// `elapsed …, ETA …`: the mean time of the cells trained in this sitting times the cells left
/// to train (`left`, the current one included); no ETA once nothing is left to train.
pub(super) fn progress(start: Instant, done: &[Duration], left: usize) -> String {
    let el = format!("elapsed {}", fmt_dur(start.elapsed()));
    if left == 0 {
        return el;
    }
    if done.is_empty() {
        return format!("{el}, ETA after the first trained cell");
    }
    let mean = done.iter().sum::<Duration>() / done.len() as u32;
    format!("{el}, ETA {}", fmt_dur(mean * left as u32))
}

/// Run one subcommand with its output appended to the cell's log; a failure names the cell,
/// the command, the log and its last lines.
pub(super) fn spawn_logged(exe: &Path, args: &[String], log: &Path, tag: &str) -> Result<()> {
    let cmd = show_cmd(exe, args);
    // a signal that came between two subprocesses: stop before starting the next
    if crate::util::interrupt::requested() {
        bail!("{tag}: interrupted; run the same study command again to resume");
    }
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(log).with_context(|| format!("cannot open {}", log.display()))?;
    writeln!(f, "\n== {} {cmd}", unix_now())?;
    let err = f.try_clone()?;
    let mut command = std::process::Command::new(exe);
    command.args(args).stdin(std::process::Stdio::null()).stdout(f).stderr(err);
    die_with_parent(&mut command);
    let mut child = command.spawn().with_context(|| format!("{tag}: cannot start {cmd}"))?;
    // a SIGTERM/SIGHUP sent to the study alone is passed on, so the cell saves its checkpoint
    let mut forwarded = false;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if crate::util::interrupt::requested() && !forwarded {
            #[cfg(unix)]
            unsafe {
                libc::kill(child.id() as i32, libc::SIGINT);
            }
            forwarded = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if status.success() {
        return Ok(());
    }
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(15)..].join("\n    ");
    if crate::util::interrupt::requested() {
        bail!("{tag}: interrupted ({status}); run the same study command again to resume (log {})", log.display());
    }
    bail!("{tag}: command failed ({status}):\n  {cmd}\n  log: {}\n  last lines:\n    {tail}", log.display())
}

/// The child dies with the study, however the study ends (`kill -9` included): Linux sends it
/// SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), and a child whose parent died before the
/// request took hold (it was reparented: getppid is no longer the study) exits at once. A killed
/// `train` resumes from its newest checkpoint when the study is run again. (The signal follows
/// the spawning thread; the study spawns from the command's thread, which lives as long as the
/// process.)
pub(super) fn die_with_parent(command: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid, _exit)
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(137);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

pub(super) fn unix_now() -> String {
    let s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format!("t={s}")
}
