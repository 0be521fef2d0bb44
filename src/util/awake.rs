//! Keep the pool's other threads awake through a loop of short parallel ops.
//!
//! A decode step on the CPU is ~200 parallel ops of 20–250 µs each (one per product, attention,
//! norm of every layer). Between two of them rayon's idle workers spin for ~32 `sched_yield`s
//! and then sleep on a futex, so nearly every op began by waking a sleeping thread — on a VM an
//! inter-processor interrupt and a hypervisor exit per wake-up: ~150 context switches per decode
//! step and 12 % of decode's time (`bench --work decode --dtype bf16`: 243 → 274 tokens/s, the
//! context switches of the whole run 22 181 → 1 832). [`keep_awake`] runs a closure while every
//! other thread of the current pool runs a loop that executes the pool's pending tasks as soon
//! as they appear (`rayon::yield_now`), so no worker goes to sleep. Idle, the loop pauses for
//! `SPIN` rounds and then calls `sched_yield` between checks: a core that another process needs
//! (tests running binaries side by side) is handed over instead of being held. The results do
//! not change: which thread runs a task never changes what it computes (every kernel's sums are
//! fixed by the task split, not by the threads).
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Idle rounds of `spin_loop` before the loop yields the core between checks (~50 µs).
const SPIN: u32 = 1000;

/// Run `f` on this thread while the pool's other threads stay awake. Outside a rayon pool, or
/// in a pool of one thread, it just runs `f`.
pub fn keep_awake<R>(f: impl FnOnce() -> R) -> R {
    keep_awake_counted(&Arc::new(AtomicUsize::new(0)), f)
}

/// [`keep_awake`], counting in `awake` the threads now in the loop.
fn keep_awake_counted<R>(awake: &Arc<AtomicUsize>, f: impl FnOnce() -> R) -> R {
    let (Some(me), threads) = (rayon::current_thread_index(), rayon::current_num_threads()) else { return f() };
    if threads < 2 {
        return f();
    }
    /// Ends the loops when `f` returns or unwinds.
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let stop = Stop(Arc::new(AtomicBool::new(false)));
    let (flag, count) = (stop.0.clone(), awake.clone());
    // one job per thread of the pool, each in that thread's own queue: no thread runs another's
    // (this thread's copy returns at once, whenever it gets to it)
    rayon::spawn_broadcast(move |ctx| {
        if ctx.index() == me {
            return;
        }
        count.fetch_add(1, Ordering::AcqRel);
        let mut idle = 0u32;
        while !flag.load(Ordering::Acquire) {
            if matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
                idle = 0;
            } else if idle < SPIN {
                idle += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        count.fetch_sub(1, Ordering::AcqRel);
    });
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::time::{Duration, Instant};

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let t = Instant::now();
        while !cond() {
            assert!(t.elapsed() < Duration::from_secs(20), "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Inside `keep_awake` every other thread of the pool is in the awake loop and still runs
    /// the parallel work it is given; when `f` returns, or panics, every loop ends; outside a
    /// pool `f` just runs.
    #[test]
    fn other_threads_stay_awake_and_are_released() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let awake = Arc::new(AtomicUsize::new(0));
        let sum: u64 = pool.install(|| {
            keep_awake_counted(&awake, || {
                wait_for("both other threads are in the loop", || awake.load(Ordering::Acquire) == 2);
                (0..100_000u64).into_par_iter().map(|i| i * i).sum::<u64>()
            })
        });
        assert_eq!(sum, (0..100_000u64).map(|i| i * i).sum::<u64>());
        wait_for("every loop has ended", || awake.load(Ordering::Acquire) == 0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                keep_awake_counted(&awake, || {
                    wait_for("the loops after a first call", || awake.load(Ordering::Acquire) == 2);
                    panic!("inside")
                })
            })
        }));
        assert!(r.is_err());
        wait_for("every loop has ended after a panic", || awake.load(Ordering::Acquire) == 0);
        assert_eq!(keep_awake_counted(&awake, || awake.load(Ordering::Acquire) + 7), 7, "outside a pool: f runs alone");
    }
}
