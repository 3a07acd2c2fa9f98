//! A small persistent thread pool for the decode path's many short parallel loops.
//!
//! Decoding one token runs ~8 parallel matvecs per layer, each a few microseconds long. A
//! general-purpose pool that puts idle workers to sleep pays a wake-up (tens of microseconds) per
//! loop; here workers spin briefly on an epoch counter, so a loop started within that window
//! dispatches in well under a microsecond, and park on a condvar after the poll window without
//! work (llama.cpp's `--poll`: [`set_poll`], 0 parks at once, 100 spins longest).
//!
//! On a busy machine a worker may not run for a whole scheduler slice. So a job never waits for
//! a worker that has not joined it: the caller runs every task nobody has taken, closes the job,
//! and waits only for the workers that joined it (each holds at most the task it is running). A
//! worker that arrives after the close skips the job.
//!
//! Contract: [`SpinPool::run`] calls `f(i)` exactly once for every `i < n_tasks`, on the calling
//! thread and the workers, and returns after all calls have finished. Calls are serialised by a
//! mutex, so the pool may be shared. A panic in `f` on a worker aborts the process (it would
//! otherwise leave the caller waiting forever); the kernels it runs do not panic.
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking at poll level 100 (the default, 50, is half).
const SPIN_MAX: Duration = Duration::from_micros(400);
/// The poll level of every pool: 0..=100.
static POLL: AtomicU32 = AtomicU32::new(DEFAULT_POLL);
pub const DEFAULT_POLL: u32 = 50;

/// Set how long idle workers poll for the next job before parking: 0 (park at once, least CPU
/// when idle, a wake-up per job) to 100 (longest spin); as llama.cpp's `--poll`.
pub fn set_poll(level: u32) {
    POLL.store(level.min(100), Ordering::Relaxed);
}

fn spin_window() -> Duration {
    SPIN_MAX * POLL.load(Ordering::Relaxed) / 100
}

/// The job's open flag in [`Shared::state`]; the low bits count the workers that joined it.
const OPEN: usize = 1 << (usize::BITS - 1);

type Task<'a> = dyn Fn(usize) + Sync + 'a;

struct Shared {
    /// Bumped once per job; idle workers watch it.
    epoch: AtomicU64,
    /// `OPEN` while workers may join the current job, plus the number that joined and have not
    /// finished.
    state: AtomicUsize,
    /// The current job: a pointer to the caller's `&Task` (valid while `run` waits), task count.
    job: AtomicPtr<()>,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
    stop: AtomicBool,
    sleepers: AtomicUsize,
    wake_lock: Mutex<()>,
    wake: Condvar,
}

pub struct SpinPool {
    shared: Arc<Shared>,
    workers: Vec<std::thread::JoinHandle<()>>,
    serial: Mutex<()>,
}

impl SpinPool {
    /// A pool of `threads` threads in all: the caller plus `threads - 1` workers.
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            state: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("dejavu-worker-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawning a worker thread")
            })
            .collect();
        Self {
            shared,
            workers,
            serial: Mutex::new(()),
        }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Run `f(0..n_tasks)` across the pool; returns when every call has finished.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync + '_)) {
        if self.workers.is_empty() || n_tasks <= 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        let _guard = self.serial.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // Workers read `fref` only while they are counted in `state` (joined, not finished),
        // and we wait for that count to reach zero before returning, so it outlives every use.
        let fref: &&Task = &f;
        s.job
            .store(fref as *const &Task as *mut (), Ordering::Relaxed);
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        // Release: a worker that joins (Acquire on `state`) sees the job above.
        s.state.store(OPEN, Ordering::Release);
        // SeqCst pairs with the worker's `sleepers` increment then `epoch` check: one of the two
        // sides sees the other's write, so a worker going to sleep is never missed.
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        run_tasks(s, f, n_tasks);
        // Close the job: late workers skip it; wait only for those that joined.
        s.state.fetch_and(!OPEN, Ordering::AcqRel);
        let t0 = Instant::now();
        let mut spins = 0u32;
        while s.state.load(Ordering::Acquire) != 0 {
            spins += 1;
            // A joined worker that lost its core: let it run rather than spin against it.
            if spins.is_multiple_of(256) && t0.elapsed() > Duration::from_micros(50) {
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
    }
}

fn run_tasks(s: &Shared, f: &Task<'_>, n: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

/// Join the open job: true if this worker is now counted in `state`.
fn join(s: &Shared) -> bool {
    let mut cur = s.state.load(Ordering::Relaxed);
    while cur & OPEN != 0 {
        match s
            .state
            .compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
    false
}

fn worker(s: &Shared) {
    // The epoch at construction (not at thread start: a job may be published before we run).
    let mut seen = 0;
    loop {
        let t0 = Instant::now();
        let window = spin_window();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen || s.stop.load(Ordering::Relaxed) {
                break e;
            }
            spins += 1;
            if window.is_zero() || (spins.is_multiple_of(1024) && t0.elapsed() > window) {
                // Sleep until the next job (re-check under the lock so no wake-up is missed).
                let mut g = s.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
            std::hint::spin_loop();
        };
        if s.stop.load(Ordering::Relaxed) {
            return;
        }
        seen = epoch;
        if !join(s) {
            continue; // closed before we came: the caller ran our share
        }
        // Joined: the caller waits for us, so the job is current and stays valid; a newer epoch
        // than `epoch` cannot exist yet, but read it again to be exact.
        seen = s.epoch.load(Ordering::Acquire);
        let n = s.n_tasks.load(Ordering::Relaxed);
        // SAFETY: `job` points at the caller's `&Task`, which `run` keeps alive until every
        // joined worker has left `state` (the Acquire of the join orders this read after the
        // job's stores).
        let f: &Task = unsafe { *(s.job.load(Ordering::Relaxed) as *const &Task) };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_tasks(s, f, n)));
        if r.is_err() {
            std::process::abort();
        }
        s.state.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _l = self
                .shared
                .wake_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_jobs_and_after_sleep() {
        for (threads, poll) in [(1, 50), (2, 50), (3, 50), (2, 0), (3, 100)] {
            set_poll(poll);
            let pool = SpinPool::new(threads);
            for round in 0..2000 {
                let n = round % 37;
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "threads {threads} poll {poll} round {round}"
                );
                if round == 1000 {
                    std::thread::sleep(SPIN_MAX * 5); // workers fall asleep; the next job must wake them
                }
            }
        }
        set_poll(DEFAULT_POLL);
    }

    /// Jobs whose workers join late (parked, or busy with a long task) still run every task
    /// once: the caller takes what nobody took. Many short jobs with tasks of uneven length.
    #[test]
    fn uneven_tasks_and_late_workers() {
        let pool = SpinPool::new(4);
        for round in 0..300 {
            let n = 1 + round % 9;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                if (i + round) % 5 == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "round {round}"
            );
        }
    }
}
