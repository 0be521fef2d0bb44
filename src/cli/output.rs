//! One rule for every command's outputs (docs/RELIABILITY.md), checked before any work:
//! - an output never names one of the command's inputs, `--overwrite` or not;
//! - an existing output file, or an output directory holding anything, is refused unless
//!   `--overwrite`; with it, the command replaces only the files it writes itself (other files
//!   in a directory stay).
//!
//! `train` keeps its own run-directory rule (`rl::trainer::check_fresh_out`: the same word, plus
//! `--resume`); everything else goes through here.
use super::limits::{check_not_input, check_writable_dir, check_writable_file};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The sentence every refusal ends with.
const HOW: &str = "pass --overwrite to replace it, or choose another path";

/// An output file: writable, not one of `inputs`, and new unless `overwrite`. A new output is
/// reserved now by a lock next to it (`.{name}.lock`, held for the command's life; the kernel
/// drops it however the command ends), so a second command started on the same path is refused
/// at once instead of both computing and the last rename winning. The output path itself is
/// untouched until the command writes it whole. Hold the guard until the end.
pub fn check_out_file(flag: &str, out: &Path, inputs: &[PathBuf], overwrite: bool) -> Result<Reserved> {
    check_writable_file(flag, out)?;
    check_not_input(flag, out, inputs)?;
    // symlink_metadata: a dangling symlink is an existing entry too (writing replaces it)
    let exists = || out.symlink_metadata().is_ok();
    if !overwrite && exists() {
        bail!("{flag} {}: already exists; {HOW}", out.display());
    }
    if overwrite {
        return Ok(Reserved(None));
    }
    let dir = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("{flag} {}: cannot create {}", out.display(), dir.display()))?;
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let lock = infomem_engine::util::lock::lock_file(&dir.join(format!(".{name}.lock")), &format!("{flag} {}", out.display()))?;
    // checked again under the lock: another command may have finished it meanwhile
    if exists() {
        bail!("{flag} {}: already exists (another command just wrote it); {HOW}", out.display());
    }
    Ok(Reserved(Some(lock)))
}

/// The lock that reserves a new output (see [`check_out_file`]); its file is removed on drop.
#[derive(Debug)]
pub struct Reserved(Option<infomem_engine::util::lock::DirLock>);

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(l) = self.0.take() {
            let p = l.path.clone();
            drop(l);
            let _ = std::fs::remove_file(p);
        }
    }
}

/// An output directory into which the command writes the files `owns` accepts (by file name):
/// writable; none of its existing owned files an input; empty (but for lock files) unless
/// `overwrite`. Call [`clear_owned`] right before writing, so a failure before that point keeps
/// the old files.
pub fn check_out_dir(flag: &str, out: &Path, inputs: &[PathBuf], overwrite: bool, owns: fn(&str) -> bool) -> Result<()> {
    check_writable_dir(flag, out)?;
    check_holds_no_input(flag, out, inputs)?;
    let entries = entries(flag, out)?;
    for name in entries.iter().filter(|n| owns(n)) {
        check_replaceable(flag, &out.join(name), inputs)?;
    }
    if !overwrite && !entries.is_empty() {
        let mut names = entries;
        let more = if names.len() > 8 { format!(" and {} more", names.len() - 8) } else { String::new() };
        names.truncate(8);
        bail!("{flag} {} is not empty (it has {}{more}); {HOW} (only the files this command writes are replaced)", out.display(), names.join(", "));
    }
    Ok(())
}

/// Refuse to replace `path` (a file, or a directory with everything under it) when it is or
/// holds one of `inputs` (`--overwrite` deletes it before the inputs are read).
pub fn check_replaceable(flag: &str, path: &Path, inputs: &[PathBuf]) -> Result<()> {
    if !path.symlink_metadata().is_ok_and(|m| m.is_dir()) {
        return check_not_input(flag, path, inputs);
    }
    let Ok(dir) = path.canonicalize() else { return Ok(()) };
    for input in inputs {
        if input.canonicalize().is_ok_and(|i| i.starts_with(&dir)) {
            bail!(
                "{flag}: {} would be replaced, but it holds an input ({}); choose another output path, or move that input first",
                path.display(),
                input.display()
            );
        }
    }
    Ok(())
}

/// Refuse an output directory that holds one of the inputs (the model directory as an eval's
/// or a run's --out): its outputs would be mixed into an input.
pub fn check_holds_no_input(flag: &str, out: &Path, inputs: &[PathBuf]) -> Result<()> {
    let Ok(dir) = out.canonicalize() else { return Ok(()) };
    if let Some(i) = inputs.iter().find(|i| i.canonicalize().is_ok_and(|i| i.starts_with(&dir))) {
        bail!("{flag} {}: holds {}, which is also an input of this command; outputs are never written among the inputs — choose another directory", out.display(), i.display());
    }
    Ok(())
}

/// Refuse a directory that holds another kind of output (`names`, with `kind` for the message):
/// a train run and an evaluation are never mixed in one directory, `--overwrite` or not.
pub fn check_not_other_kind(flag: &str, out: &Path, names: &[&str], kind: &str) -> Result<()> {
    if let Some(n) = names.iter().find(|n| out.join(n).symlink_metadata().is_ok()) {
        bail!("{flag} {}: holds {kind} ({n}); runs of different kinds are never mixed in one directory — choose another", out.display());
    }
    Ok(())
}

/// Delete the files of `out` that `owns` accepts (what `--overwrite` replaces), so that no file
/// of an earlier output is left to mix with the new one (a stale shard index, say).
pub fn clear_owned(flag: &str, out: &Path, owns: fn(&str) -> bool) -> Result<()> {
    for name in entries(flag, out)?.into_iter().filter(|n| owns(n)) {
        let p = out.join(&name);
        let res = if p.symlink_metadata().is_ok_and(|m| m.is_dir()) { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        res.with_context(|| format!("{flag} --overwrite: cannot delete {}", p.display()))?;
    }
    Ok(())
}

/// The names in `out` (none when it does not exist), lock files left out: a lock file left by
/// a finished run holds nothing.
fn entries(flag: &str, out: &Path) -> Result<Vec<String>> {
    let rd = match std::fs::read_dir(out) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(e).with_context(|| format!("{flag} {} cannot be read as a directory", out.display())),
    };
    let mut names: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !infomem_engine::util::lock::is_lock_file(n))
        .collect();
    names.sort();
    Ok(names)
}

/// The files of an HF model directory that a loader reads (`merge` and `import-gguf` write one):
/// weights (every `*.safetensors` and the shard index), configs, tokenizer, chat template, and
/// `import-gguf`'s completion marker. A stale one of these left beside a new model would change
/// what loads.
pub fn model_dir_file(name: &str) -> bool {
    name.ends_with(".safetensors")
        || matches!(
            name,
            "model.safetensors.index.json"
                | "config.json"
                | "generation_config.json"
                | "tokenizer.json"
                | "tokenizer_config.json"
                | "special_tokens_map.json"
                | "chat_template.jinja"
                | ".import-ok"
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_directories_follow_one_rule() {
        let t = tempfile::tempdir().unwrap();
        let input = t.path().join("in.jsonl");
        std::fs::write(&input, "x").unwrap();
        let ins = vec![input.clone()];
        // a new file is fine; an existing one needs --overwrite; an input never
        {
            // a new output is reserved while the guard lives, and released unwritten
            let g = check_out_file("--out", &t.path().join("new.jsonl"), &ins, false).unwrap();
            assert!(!t.path().join("new.jsonl").exists(), "the output path is untouched until written");
            drop(g);
            assert!(!t.path().join(".new.jsonl.lock").exists());
            // written over (a rename): kept
            let g = check_out_file("--out", &t.path().join("new.jsonl"), &ins, false).unwrap();
            infomem_engine::util::fs::write_atomic_str(&t.path().join("new.jsonl"), "x").unwrap();
            drop(g);
            assert_eq!(std::fs::read_to_string(t.path().join("new.jsonl")).unwrap(), "x");
            std::fs::remove_file(t.path().join("new.jsonl")).unwrap();
        }
        let old = t.path().join("old.jsonl");
        std::fs::write(&old, "y").unwrap();
        let e = check_out_file("--out", &old, &ins, false).unwrap_err().to_string();
        assert!(e.contains("already exists") && e.contains("--overwrite"), "{e}");
        assert!(check_out_file("--out", &old, &ins, true).is_ok());
        let e = check_out_file("--out", &input, &ins, true).unwrap_err().to_string();
        assert!(e.contains("also an input"), "{e}");

        // a directory: empty (or lock only) is fine; anything else needs --overwrite, which
        // clears the owned files only
        let d = t.path().join("model");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join(".train.lock"), "1").unwrap();
        assert!(check_out_dir("--out", &d, &ins, false, model_dir_file).is_ok());
        std::fs::write(d.join("model.safetensors.index.json"), "{}").unwrap();
        std::fs::write(d.join("notes.txt"), "mine").unwrap();
        let e = check_out_dir("--out", &d, &ins, false, model_dir_file).unwrap_err().to_string();
        assert!(e.contains("not empty") && e.contains("model.safetensors.index.json") && e.contains("notes.txt"), "{e}");
        assert!(check_out_dir("--out", &d, &ins, true, model_dir_file).is_ok());
        clear_owned("--out", &d, model_dir_file).unwrap();
        assert!(!d.join("model.safetensors.index.json").exists());
        assert_eq!(std::fs::read_to_string(d.join("notes.txt")).unwrap(), "mine");
        // an owned file that is an input is refused even with --overwrite
        std::fs::write(d.join("model.safetensors"), "w").unwrap();
        let e = check_out_dir("--out", &d, &[d.join("model.safetensors")], true, model_dir_file).unwrap_err().to_string();
        assert!(e.contains("also an input"), "{e}");
        // a file where a directory is expected
        let e = check_out_dir("--out", &old, &ins, true, model_dir_file).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }
}
