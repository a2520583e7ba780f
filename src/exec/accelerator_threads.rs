//! Worker pools that run tasks.
//!
//! CPU tasks run on the caller's tokio runtime; the scheduler bounds how many run at once
//! with `flumen.cpu_slots`. Accelerator tasks run on [`AcceleratorPool`]: long-lived worker
//! threads of their own (actors), so a busy device never takes a CPU slot and whatever a
//! worker loads (a model) stays loaded across tasks and queries of the session.
//!
//! The pool is elastic: the scheduler grows it, one worker at a time up to
//! `flumen.accelerator_slots`, while accelerator tasks wait and every worker is busy; a worker
//! idle for `flumen.accelerator_idle_secs` exits (dropping what it loaded) as long as more
//! than `flumen.accelerator_min_slots` remain.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

/// A job for a worker: builds the task's future on the worker thread.
pub type Job = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

#[derive(Debug)]
struct Shared {
    receiver: Mutex<mpsc::Receiver<Job>>,
    state: Mutex<PoolState>,
}

#[derive(Debug)]
struct PoolState {
    /// Workers alive now.
    live: usize,
    /// Workers ever started (names them).
    started: usize,
    /// Fewest workers kept when idle.
    min: usize,
    /// How long a worker waits for a job before it may exit.
    idle: Duration,
}

/// Long-lived accelerator worker threads, shared by every query of a session.
#[derive(Debug)]
pub struct AcceleratorPool {
    sender: Mutex<mpsc::Sender<Job>>,
    shared: Arc<Shared>,
}

impl Default for AcceleratorPool {
    fn default() -> Self {
        let (sender, receiver) = mpsc::channel();
        Self {
            sender: Mutex::new(sender),
            shared: Arc::new(Shared {
                receiver: Mutex::new(receiver),
                state: Mutex::new(PoolState {
                    live: 0,
                    started: 0,
                    min: 1,
                    idle: Duration::from_secs(60),
                }),
            }),
        }
    }
}

impl AcceleratorPool {
    /// Set the fewest workers kept and how long an idle worker waits before it exits.
    pub fn configure(&self, min: usize, idle: Duration) {
        let mut state = self.shared.state.lock().unwrap();
        state.min = min;
        state.idle = idle.max(Duration::from_millis(10));
    }

    /// Make sure at least `n` workers run.
    pub fn ensure_workers(&self, n: usize) {
        let mut state = self.shared.state.lock().unwrap();
        while state.live < n {
            let shared = Arc::clone(&self.shared);
            let index = state.started;
            std::thread::Builder::new()
                .name(format!("flumen-accel-{index}"))
                .spawn(move || worker_loop(shared))
                .expect("spawn accelerator worker thread");
            state.live += 1;
            state.started += 1;
        }
    }

    /// Number of worker threads alive.
    pub fn workers(&self) -> usize {
        self.shared.state.lock().unwrap().live
    }

    /// Queue a job for the next free worker.
    pub fn submit(&self, job: Job) {
        // The receiver lives as long as the pool, so sending cannot fail.
        let _ = self.sender.lock().unwrap().send(job);
    }
}

fn worker_loop(shared: Arc<Shared>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("build accelerator worker runtime");
    loop {
        let idle = shared.state.lock().unwrap().idle;
        let job = shared.receiver.lock().unwrap().recv_timeout(idle);
        let job = match job {
            Ok(job) => job,
            Err(RecvTimeoutError::Timeout) => {
                let mut state = shared.state.lock().unwrap();
                if state.live > state.min {
                    state.live -= 1;
                    return;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => {
                shared.state.lock().unwrap().live -= 1;
                return;
            }
        };
        // The job reports its own panics; this only keeps the worker alive.
        let _ = runtime.block_on(AssertUnwindSafe(async move { job().await }).catch_unwind());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_workers_above_the_minimum_exit() {
        let pool = AcceleratorPool::default();
        pool.configure(1, Duration::from_millis(50));
        pool.ensure_workers(3);
        assert_eq!(pool.workers(), 3);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pool.workers() > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            pool.workers(),
            1,
            "idle workers did not shrink to the minimum"
        );
        // A job still runs on the remaining worker.
        let (tx, rx) = mpsc::channel();
        pool.submit(Box::new(move || {
            async move {
                tx.send(std::thread::current().name().unwrap().to_string())
                    .unwrap();
            }
            .boxed()
        }));
        let name = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(name.starts_with("flumen-accel-"), "{name}");
    }
}
