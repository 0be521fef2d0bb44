//! Opt-in wall-clock accounting per op (`INFOMEM_PROFILE=1`): each forward op adds its time to
//! a named counter and the totals are printed to stderr by `report()`. Off, it costs one
//! relaxed atomic load per op.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
static INIT: std::sync::Once = std::sync::Once::new();
static TABLE: Mutex<Vec<(&'static str, u64, u64)>> = Mutex::new(Vec::new());

pub fn enabled() -> bool {
    INIT.call_once(|| ON.store(std::env::var("INFOMEM_PROFILE").is_ok_and(|v| v == "1"), Ordering::Relaxed));
    ON.load(Ordering::Relaxed)
}

/// Time `f` under `name` when profiling is on.
#[inline]
pub fn time<T>(name: &'static str, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let t = Instant::now();
    let r = f();
    let ns = t.elapsed().as_nanos() as u64;
    let mut tab = TABLE.lock().unwrap();
    match tab.iter_mut().find(|e| e.0 == name) {
        Some(e) => {
            e.1 += ns;
            e.2 += 1;
        }
        None => tab.push((name, ns, 1)),
    }
    r
}

/// Print the accumulated table (largest first) to stderr.
pub fn report() {
    if !enabled() {
        return;
    }
    let mut tab = TABLE.lock().unwrap().clone();
    tab.sort_by(|a, b| b.1.cmp(&a.1));
    let total: u64 = tab.iter().map(|e| e.1).sum();
    eprintln!("profile (INFOMEM_PROFILE=1): {:.3} s in timed ops", total as f64 / 1e9);
    for (name, ns, calls) in tab {
        eprintln!("  {:<20} {:>9.3} s {:>5.1}% {:>8} calls", name, ns as f64 / 1e9, 100.0 * ns as f64 / total.max(1) as f64, calls);
    }
}
