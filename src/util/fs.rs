//! Atomic writes: a crash or a kill never leaves a half-written file under the final name.
//!
//! Temp files and directories get an unpredictable name (`pid` + a random suffix) and are created
//! exclusively (`O_EXCL` / `mkdir`), so a symlink planted where a temp file will appear is never
//! followed: creation fails on it and another name is tried.
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Names tried before giving up (a collision needs a 64-bit random match, or an attacker who
/// can list the directory and win a race).
const TEMP_ATTEMPTS: usize = 64;

/// 64 unpredictable bits: std's `RandomState` is seeded from the OS's randomness once per
/// thread and advanced on every call; the clock and a counter are mixed in as well.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

/// `{pid}-{16 hex digits}`: the pid lets a later run tell a dead process's leftovers from a live
/// one's; the random part makes the name unguessable.
pub fn unique_suffix() -> String {
    format!("{}-{:016x}", std::process::id(), random_u64())
}

/// Create a new, empty temp file `dir/.{stem}.tmp.{pid}-{random}` exclusively (never through an
/// existing file or symlink), retrying on a name collision.
pub fn create_temp_file(dir: &Path, stem: &str) -> Result<(PathBuf, File)> {
    for _ in 0..TEMP_ATTEMPTS {
        let tmp = dir.join(format!(".{stem}.tmp.{}", unique_suffix()));
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create {}", tmp.display())),
        }
    }
    bail!("cannot create a temp file in {}: {TEMP_ATTEMPTS} names were all taken", dir.display())
}

/// Create a new temp directory `{parent}/{prefix}-{pid}-{random}` exclusively (mkdir fails on an
/// existing entry, a planted symlink included), retrying on a name collision.
pub fn create_temp_dir(parent: &Path, prefix: &str) -> Result<PathBuf> {
    for _ in 0..TEMP_ATTEMPTS {
        let tmp = parent.join(format!("{prefix}-{}", unique_suffix()));
        match std::fs::create_dir(&tmp) {
            Ok(()) => return Ok(tmp),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create {}", tmp.display())),
        }
    }
    bail!("cannot create a temp directory in {}: {TEMP_ATTEMPTS} names were all taken", parent.display())
}

/// Write `data` to `path` through a temporary file in the same directory, fsync, then rename.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create directory {}", dir.display()))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let (tmp, mut f) = create_temp_file(dir, &name)?;
    let res = (|| -> Result<()> {
        f.write_all(data).with_context(|| format!("cannot write {}", tmp.display()))?;
        f.sync_all().with_context(|| format!("cannot sync {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

pub fn write_atomic_str(path: &Path, text: &str) -> Result<()> {
    write_atomic(path, text.as_bytes())
}

/// Refuse an input that is not a regular file (after symlinks): a directory would fail later
/// with an obscure message ("No such device" from mmap), a FIFO would block the read forever,
/// and a device such as /dev/zero would be read without end. `what` names the flag or file.
pub fn check_regular_file(path: &Path, what: &str) -> Result<()> {
    let m = std::fs::metadata(path).with_context(|| format!("{what} {}: cannot read it", path.display()))?;
    if m.is_dir() {
        bail!("{what} {}: is a directory, not a file", path.display());
    }
    if !m.is_file() {
        bail!("{what} {}: is not a regular file (a pipe, socket or device); give a file", path.display());
    }
    Ok(())
}

/// Read a whole input text file after [`check_regular_file`], refusing one over `max_bytes`
/// (a config or batch file that large is not one).
pub fn read_input_text(path: &Path, what: &str, max_bytes: u64) -> Result<String> {
    check_regular_file(path, what)?;
    let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    if len > max_bytes {
        bail!("{what} {}: {len} bytes, more than the {max_bytes} such a file may have", path.display());
    }
    std::fs::read_to_string(path).with_context(|| format!("{what} {}: cannot read it as UTF-8 text", path.display()))
}

/// `p` as an absolute path: canonical when it exists (symlinks resolved), else joined to the
/// working directory. Saved run configurations use it so they mean the same from anywhere.
pub fn absolute_path(p: &Path) -> PathBuf {
    p.canonicalize().or_else(|_| std::path::absolute(p)).unwrap_or_else(|_| p.to_path_buf())
}

/// Whether a process with this pid exists (signal 0 probes without sending; EPERM means it
/// exists under another user).
pub fn pid_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
        if pid <= 0 {
            return false;
        }
        // Safety: kill with signal 0 only checks for existence and permission.
        if unsafe { libc::kill(pid, 0) } == 0 {
            return true;
        }
        std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Whether the path exists, following symlinks (`None`: nothing there). A symlink loop, a
/// symlink to nothing or an unreadable parent is an error that says which, so a model file in a
/// bad state is never reported as merely missing.
pub fn stat(path: &Path) -> Result<Option<std::fs::Metadata>> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if is_symlink_loop(&e) => {
            bail!("{} is a symlink loop (following its symlinks never reaches a file)", path.display())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::read_link(path) {
            Ok(target) => bail!("{} is a broken symlink: its target {} does not exist", path.display(), target.display()),
            Err(_) => Ok(None),
        },
        Err(e) => Err(e).with_context(|| format!("cannot access {}", path.display())),
    }
}

/// ELOOP: too many levels of symbolic links (std has no stable ErrorKind for it).
pub fn is_symlink_loop(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    return e.raw_os_error() == Some(libc::ELOOP);
    #[cfg(not(unix))]
    return false;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planted_symlink_at_the_old_temp_name_is_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        // the name the old code used: `.{name}.tmp.{pid}`, opened with O_TRUNC
        std::os::unix::fs::symlink(&victim, t.path().join(format!(".out.txt.tmp.{}", std::process::id()))).unwrap();
        write_atomic_str(&t.path().join("out.txt"), "new").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert!(std::fs::symlink_metadata(t.path().join("out.txt")).unwrap().file_type().is_file());
        assert_eq!(std::fs::read_to_string(t.path().join("out.txt")).unwrap(), "new");
        // temp names differ between calls
        let (a, _) = create_temp_file(t.path(), "x").unwrap();
        let (b, _) = create_temp_file(t.path(), "x").unwrap();
        assert_ne!(a, b);
    }
}
