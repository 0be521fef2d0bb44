//! Ctrl-C (SIGINT) as a request, not a kill: the first one sets a flag that long loops
//! (generation, scoring, training) check between steps, so the trainer can save a checkpoint and
//! exit cleanly; a second one exits at once.
use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_sigint(_: libc::c_int) {
    // async-signal-safe: an atomic swap and _exit only
    if REQUESTED.swap(true, Ordering::SeqCst) {
        unsafe { libc::_exit(130) };
    }
}

/// Install the handler (idempotent). Without it Ctrl-C terminates the process as usual.
pub fn install() {
    #[cfg(unix)]
    unsafe {
        let handler: extern "C" fn(libc::c_int) = on_sigint;
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

pub fn requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}

/// An error to return from a loop that stops because of Ctrl-C.
pub fn check() -> anyhow::Result<()> {
    if requested() {
        anyhow::bail!(Interrupted);
    }
    Ok(())
}

/// The error value of an interrupted loop (callers can downcast to tell it from real failures).
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted (Ctrl-C)")
    }
}

impl std::error::Error for Interrupted {}

pub fn is_interrupted(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Interrupted>().is_some()
}

/// For tests: raise or clear the flag as Ctrl-C would.
pub fn set_requested(v: bool) {
    REQUESTED.store(v, Ordering::SeqCst);
}
