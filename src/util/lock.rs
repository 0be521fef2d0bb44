//! An exclusive lock on a run directory for a process's lifetime (`flock` on a lock file inside
//! it), so two `train` (or `eval`) runs never write into one `--out`. The kernel drops the lock when the
//! holder exits, however it exits: a lock file left behind by a dead run blocks nothing.
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside a locked directory (also ignored when a directory's emptiness is
/// judged).
pub const LOCK_FILE: &str = ".train.lock";

/// Whether a directory entry is one of the engine's lock files (`.{what}.lock`): a lock left by
/// a finished run holds nothing, so it never makes a directory non-empty.
pub fn is_lock_file(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".lock")
}

/// Held while alive; dropping it (or the process ending) releases the lock.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    pub path: PathBuf,
}

/// Lock `dir` (created if missing) or fail, naming the holder's pid. `what` names the flag the
/// directory came from, for the message.
pub fn lock_dir(dir: &Path, what: &str) -> Result<DirLock> {
    lock_dir_named(dir, LOCK_FILE, what)
}

impl DirLock {
    /// Release the lock and, when the directory holds nothing but its lock file, remove both:
    /// what a command that created the directory and failed before writing leaves behind.
    pub fn remove_if_only_lock(self) {
        let path = self.path.clone();
        let Some(dir) = path.parent().map(Path::to_path_buf) else { return };
        let only_lock = std::fs::read_dir(&dir).map(|rd| rd.count() == 1).unwrap_or(false);
        drop(self);
        if only_lock {
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_dir(&dir);
        }
    }
}

/// [`lock_dir`] with another lock file name (`study` locks its directory with `.study.lock`, so
/// the file says which kind of process holds it).
pub fn lock_dir_named(dir: &Path, name: &str, what: &str) -> Result<DirLock> {
    std::fs::create_dir_all(dir).with_context(|| format!("{what}: cannot create {}", dir.display()))?;
    lock_path(&dir.join(name), &format!("{what} {}", dir.display()), what)
}

/// Lock the file `path` (created when missing) or fail: the reservation of a new output file
/// (`cli::output`). `what` names the flag and the output, for the message.
pub fn lock_file(path: &Path, what: &str) -> Result<DirLock> {
    lock_path(path, what, "path")
}

fn lock_path(path: &Path, subject: &str, what: &str) -> Result<DirLock> {
    let path = path.to_path_buf();
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true).write(true).create(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // never lock (and write a pid into) whatever a planted symlink points to
        opts.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    }
    let mut file = opts.open(&path).with_context(|| format!("{subject}: cannot open the lock file {}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        // Safety: flock on a file descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let holder = match text.trim().parse::<u32>() {
                    Ok(pid) => format!("pid {pid}"),
                    Err(_) => "a process that has not written its pid yet".to_string(),
                };
                bail!(
                    "{subject} is in use by another run ({holder}, holding {}); wait for it to finish or stop it, or choose another {what}",
                    path.display()
                );
            }
            return Err(e).with_context(|| format!("{subject}: cannot lock {}", path.display()));
        }
    }
    // the lock is ours: record our pid for whoever is refused next
    file.set_len(0).and_then(|_| file.rewind()).and_then(|_| writeln!(file, "{}", std::process::id())).and_then(|_| file.flush())
        .with_context(|| format!("{subject}: cannot write {}", path.display()))?;
    Ok(DirLock { _file: file, path })
}
