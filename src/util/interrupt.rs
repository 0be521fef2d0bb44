//! Ctrl-C (SIGINT), SIGTERM and SIGHUP as a request, not a kill: the first one sets a flag that
//! long loops (generation, scoring, training) check between steps, so the trainer can save a
//! checkpoint and exit cleanly (with 128 + the signal's number, as a shell reports a signal); a
//! second one exits at once. SIGTERM is what `kill`, job schedulers and container stops send, and
//! SIGHUP what a closed terminal sends: both must save like Ctrl-C.
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);
/// The signal that raised the flag (0: none, or set by `set_requested`).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    // async-signal-safe: atomic operations and _exit only
    if REQUESTED.load(Ordering::SeqCst) {
        unsafe { libc::_exit(128 + sig) };
    }
    // the signal first, so a loop that sees the flag also sees which signal raised it
    let _ = SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Install the handler for SIGINT, SIGTERM and SIGHUP (idempotent). Without it these signals
/// terminate the process as usual.
pub fn install() {
    #[cfg(unix)]
    unsafe {
        let handler: extern "C" fn(libc::c_int) = on_signal;
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::signal(sig, handler as libc::sighandler_t);
        }
    }
}

pub fn requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}

/// The exit status of a process stopped by the request: 128 + the signal (130 for Ctrl-C, 143
/// for SIGTERM, 129 for SIGHUP); 130 when no signal is known.
pub fn exit_code() -> i32 {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => 130,
        sig => 128 + sig,
    }
}

fn signal_name() -> &'static str {
    #[cfg(unix)]
    match SIGNAL.load(Ordering::SeqCst) {
        libc::SIGTERM => return "SIGTERM",
        libc::SIGHUP => return "SIGHUP",
        _ => {}
    }
    "Ctrl-C"
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
        write!(f, "interrupted ({})", signal_name())
    }
}

impl std::error::Error for Interrupted {}

pub fn is_interrupted(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Interrupted>().is_some()
}

/// For tests: raise or clear the flag as Ctrl-C would.
pub fn set_requested(v: bool) {
    SIGNAL.store(0, Ordering::SeqCst);
    REQUESTED.store(v, Ordering::SeqCst);
}
