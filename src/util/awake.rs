//! Keep the pool's other threads awake through a forward step's short parallel ops.
//!
//! A decode step on the CPU is ~200 parallel ops of 20–250 µs each (one per product, attention,
//! norm of every layer). Between two of them rayon's idle workers yield ~32 times and then sleep
//! on a futex, so nearly every op began by waking a sleeping thread — on a VM an interrupt and a
//! hypervisor exit per wake-up: ~150 context switches per decode step (`bench --work decode
//! --dtype bf16`, 2 threads: 219 → 263 tokens/s, the run's context switches 22 181 → 1 832).
//! [`keep_awake`] runs a closure (one forward step) while every other thread of the current pool
//! runs a loop that executes the pool's pending tasks as soon as they appear
//! (`rayon::yield_now`). Idle, the loop pauses (`spin_loop`) for `SPIN` rounds, then calls
//! `sched_yield` between checks (a core that another process needs is offered, not held), and
//! after `IDLE_EXIT` without work it ends on its own; otherwise it ends when the closure
//! returns. The threads stay busy (100 % of a core) for the step; `generate` and the
//! prefill/score loop call it once per step, so between steps they sleep as before.
//!
//! Why the loop ends on its own: rayon takes a thread's queued broadcast job whenever that
//! thread waits inside a `join` with nothing else to do, so a thread that picked up one of the
//! step's tasks before its loop job could start the loop *inside* that task; the task (and the
//! step waiting for it) would then wait for a loop that waits for the step. Ending after
//! `IDLE_EXIT` without work — the step waits, so no new work comes — turns that into a stall of
//! a few milliseconds instead of a hang. One `keep_awake` runs at a time in the process (a
//! nested or concurrent call just runs its closure), none when the pool has more threads than
//! the machine has cores (spinning threads would take the cores of threads with work).
//!
//! The results do not change: which thread runs a task never changes what it computes (every
//! kernel's sums are fixed by the task split, not by the threads).
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Idle rounds of `spin_loop` before the loop yields the core between checks (~50 µs).
const SPIN: u32 = 1000;
/// Without work for this long the loop ends by itself (see the module doc). Longer than a
/// step's serial stretches, also when the host preempts the calling thread: at 1 ms decode
/// lost ~10 % against 5 ms (loops ending inside steps), and 50 ms measured the same as 5.
const IDLE_EXIT: Duration = Duration::from_millis(5);

/// A `keep_awake` is running somewhere in the process.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Run `f` on this thread while the pool's other threads stay awake. Outside a rayon pool, in a
/// pool of one thread or of more threads than cores, or while another `keep_awake` runs, it
/// just runs `f`.
pub fn keep_awake<R>(f: impl FnOnce() -> R) -> R {
    keep_awake_counted(&Arc::default(), IDLE_EXIT, f)
}

/// Threads in the loop now, and loops entered so far.
#[derive(Default)]
struct Count {
    now: AtomicUsize,
    entered: AtomicUsize,
}

/// [`keep_awake`], counting the loops in `awake`; a loop ends by itself after `idle_exit`
/// without work.
fn keep_awake_counted<R>(awake: &Arc<Count>, idle_exit: Duration, f: impl FnOnce() -> R) -> R {
    let (Some(me), threads) = (rayon::current_thread_index(), rayon::current_num_threads()) else { return f() };
    // asked once: it reads the affinity mask and the cgroup's CPU quota (files) on Linux
    static CORES: OnceLock<usize> = OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if threads < 2 || threads > cores || ACTIVE.swap(true, Ordering::AcqRel) {
        return f();
    }
    /// Ends the loops and frees the process-wide slot when `f` returns or unwinds.
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
            ACTIVE.store(false, Ordering::Release);
        }
    }
    let stop = Stop(Arc::new(AtomicBool::new(false)));
    let (flag, count) = (stop.0.clone(), awake.clone());
    // one job per thread of the pool, each in that thread's own queue (no thread steals
    // another's); this thread's copy returns at once, whenever it gets to it
    rayon::spawn_broadcast(move |ctx| {
        if ctx.index() == me {
            return;
        }
        count.entered.fetch_add(1, Ordering::AcqRel);
        count.now.fetch_add(1, Ordering::AcqRel);
        let (mut idle, mut since) = (0u32, Instant::now());
        while !flag.load(Ordering::Acquire) {
            if matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
                idle = 0;
            } else if idle < SPIN {
                if idle == 0 {
                    since = Instant::now();
                }
                idle += 1;
                std::hint::spin_loop();
            } else if since.elapsed() < idle_exit {
                std::thread::yield_now();
            } else {
                break;
            }
        }
        count.now.fetch_sub(1, Ordering::AcqRel);
    });
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// The loop's idle exit in the tests that watch it run (the production value, `IDLE_EXIT`, is
    /// shorter than a loaded machine's scheduling gaps).
    const LONG: Duration = Duration::from_secs(60);

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let t = Instant::now();
        while !cond() {
            assert!(t.elapsed() < Duration::from_secs(20), "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Inside `keep_awake` the pool's other thread is in the loop and runs the pool's tasks
    /// from there (two tasks that each wait for both to have started finish only if the loop
    /// thread takes one); the loop ends when `f` returns or panics, and on its own when `f`
    /// gives it no work; nested calls and calls outside a pool just run `f`. (One test:
    /// `keep_awake` admits one caller per process.)
    #[test]
    fn other_threads_stay_awake_and_are_released() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let awake = Arc::new(Count::default());
        let now = || awake.now.load(Ordering::Acquire);
        if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
            // more threads than cores: keep_awake stands aside
            pool.install(|| keep_awake_counted(&awake, LONG, || std::thread::sleep(Duration::from_millis(50))));
            assert_eq!(awake.entered.load(Ordering::Acquire), 0);
            return;
        }
        let started = AtomicUsize::new(0);
        let sum: u64 = pool.install(|| {
            keep_awake_counted(&awake, LONG, || {
                wait_for("the other thread is in the loop", || now() == 1);
                (0..2).into_par_iter().with_max_len(1).for_each(|_| {
                    started.fetch_add(1, Ordering::AcqRel);
                    wait_for("both tasks have started", || started.load(Ordering::Acquire) == 2);
                });
                assert_eq!(keep_awake(|| 5), 5, "a nested call runs its closure");
                (0..100_000u64).into_par_iter().map(|i| i * i).sum::<u64>()
            })
        });
        assert_eq!(sum, (0..100_000u64).map(|i| i * i).sum::<u64>());
        wait_for("the loop has ended", || now() == 0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                keep_awake_counted(&awake, LONG, || {
                    wait_for("the loop of a second call", || now() == 1);
                    panic!("inside")
                })
            })
        }));
        assert!(r.is_err());
        wait_for("the loop has ended after a panic", || now() == 0);
        let idle = Arc::new(Count::default());
        pool.install(|| {
            keep_awake_counted(&idle, Duration::from_millis(1), || {
                // no work for the loop: it ends by itself while f still runs
                wait_for("an idle loop ends on its own", || idle.entered.load(Ordering::Acquire) == 1 && idle.now.load(Ordering::Acquire) == 0);
            })
        });
        assert_eq!(keep_awake_counted(&awake, LONG, || now() + 7), 7, "outside a pool: f runs alone");
    }
}
