//! A small persistent thread pool for the decode path's many short parallel loops.
//!
//! Decoding one token runs ~8 parallel matvecs per layer, each a few microseconds long. A
//! general-purpose pool that puts idle workers to sleep pays a wake-up (tens of microseconds) per
//! loop; here workers spin briefly on an epoch counter, so a loop started within that window
//! dispatches in well under a microsecond, and fall asleep on a condvar after `SPIN` without work.
//!
//! Contract: [`SpinPool::run`] calls `f(i)` exactly once for every `i < n_tasks`, on the calling
//! thread and the workers, and returns after all calls have finished. Calls are serialised by a
//! mutex, so the pool may be shared. A panic in `f` on a worker aborts the process (it would
//! otherwise leave the caller waiting forever); the kernels it runs do not panic.
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long an idle worker spins before sleeping.
const SPIN: Duration = Duration::from_micros(200);

type Task<'a> = dyn Fn(usize) + Sync + 'a;

struct Shared {
    /// Bumped once per job; workers run a job when they see a new value.
    epoch: AtomicU64,
    /// The current job: a pointer to the caller's `&Task` (valid while `run` waits), task count.
    job: AtomicPtr<()>,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
    /// Workers that finished the current job.
    done: AtomicUsize,
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
            job: AtomicPtr::new(std::ptr::null_mut()),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
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
        // Workers read `fref` only between the epoch bump below and their `done` increment, and
        // we wait for every worker's `done` before returning, so it outlives every use.
        let fref: &&Task = &f;
        s.job
            .store(fref as *const &Task as *mut (), Ordering::Relaxed);
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        // SeqCst pairs with the worker's `sleepers` increment then `epoch` check: one of the two
        // sides sees the other's write, so a worker going to sleep is never missed.
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        run_tasks(s, f, n_tasks);
        let n_workers = self.workers.len();
        while s.done.load(Ordering::Acquire) < n_workers {
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

fn worker(s: &Shared) {
    // The epoch at construction (not at thread start: a job may be published before we run).
    let mut seen = 0;
    loop {
        let t0 = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen || s.stop.load(Ordering::Relaxed) {
                break e;
            }
            spins += 1;
            if spins.is_multiple_of(1024) && t0.elapsed() > SPIN {
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
        let n = s.n_tasks.load(Ordering::Relaxed);
        // SAFETY: `job` points at the caller's `&Task`, which `run` keeps alive until every
        // worker has reported `done` (the Acquire load of `epoch` orders this read after it).
        let f: &Task = unsafe { *(s.job.load(Ordering::Relaxed) as *const &Task) };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_tasks(s, f, n)));
        if r.is_err() {
            std::process::abort();
        }
        s.done.fetch_add(1, Ordering::Release);
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
        for threads in [1, 2, 3] {
            let pool = SpinPool::new(threads);
            for round in 0..2000 {
                let n = round % 37;
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "threads {threads} round {round}"
                );
                if round == 1000 {
                    std::thread::sleep(SPIN * 5); // workers fall asleep; the next job must wake them
                }
            }
        }
    }
}
