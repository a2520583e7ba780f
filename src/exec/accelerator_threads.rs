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
//! than `flumen.accelerator_min_slots` remain. Dropping the pool (its session) stops the
//! workers and waits until they have dropped their models: a program that ends right after
//! its session does not exit while a worker thread is still releasing a GPU context.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;

/// A job for a worker: builds the task's future on the worker thread.
pub type Job = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

#[derive(Debug)]
struct Shared {
    receiver: Mutex<mpsc::Receiver<Job>>,
    state: Mutex<PoolState>,
    /// Signalled when a worker exits (after it dropped what it loaded).
    exited: Condvar,
}

/// How long dropping a pool waits for its workers to finish their jobs and drop their models.
const DROP_WAIT: Duration = Duration::from_secs(30);

thread_local! {
    /// Set on a pool's worker threads (which must not wait for themselves).
    static IS_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[derive(Debug)]
struct PoolState {
    /// Workers alive now.
    live: usize,
    /// Workers that left and are still dropping what they loaded.
    unloading: usize,
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
    /// `None` once the pool is being dropped (the workers see the channel close).
    sender: Mutex<Option<mpsc::Sender<Job>>>,
    shared: Arc<Shared>,
}

impl Default for AcceleratorPool {
    fn default() -> Self {
        let (sender, receiver) = mpsc::channel();
        Self {
            sender: Mutex::new(Some(sender)),
            shared: Arc::new(Shared {
                receiver: Mutex::new(receiver),
                exited: Condvar::new(),
                state: Mutex::new(PoolState {
                    live: 0,
                    unloading: 0,
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
        // The receiver lives as long as the pool; the sender is gone only while it drops.
        if let Some(sender) = &*self.sender.lock().unwrap() {
            let _ = sender.send(job);
        }
    }
}

impl Drop for AcceleratorPool {
    /// Close the queue and wait (up to [`DROP_WAIT`]) until every worker has run the jobs
    /// already queued, dropped its models and exited. A worker dropping its own pool (the
    /// last reference held by a job) does not wait for itself.
    fn drop(&mut self) {
        drop(self.sender.lock().unwrap().take());
        if IS_WORKER.with(|w| w.get()) {
            return;
        }
        let deadline = Instant::now() + DROP_WAIT;
        let mut state = self.shared.state.lock().unwrap();
        while state.live + state.unloading > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            state = self.shared.exited.wait_timeout(state, left).unwrap().0;
        }
    }
}

/// A worker leaves the pool: counted out of `live` at once (under the lock its decision
/// was taken under), and out of `unloading` once it has dropped what it loaded.
fn exit_worker(shared: &Shared, mut state: std::sync::MutexGuard<'_, PoolState>) {
    state.live -= 1;
    state.unloading += 1;
    drop(state);
    crate::functions::accelerator::unload_workers();
    shared.state.lock().unwrap().unloading -= 1;
    shared.exited.notify_all();
}

fn worker_loop(shared: Arc<Shared>) {
    IS_WORKER.with(|w| w.set(true));
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
                let state = shared.state.lock().unwrap();
                if state.live > state.min {
                    return exit_worker(&shared, state);
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => {
                return exit_worker(&shared, shared.state.lock().unwrap());
            }
        };
        // The job reports its own panics; this only keeps the worker alive.
        let _ = runtime.block_on(AssertUnwindSafe(async move { job().await }).catch_unwind());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::AtomicBool;
    use std::sync::atomic::Ordering::SeqCst;

    use datafusion::arrow::array::ArrayRef;
    use datafusion::arrow::datatypes::DataType;
    use datafusion::config::ConfigOptions;
    use datafusion::error::Result as DfResult;
    use datafusion::logical_expr::{Signature, Volatility};

    use crate::functions::accelerator;

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

    /// A model whose release takes a while, and says when it is done.
    #[derive(Debug)]
    struct SlowToRelease {
        signature: Signature,
        released: Arc<AtomicBool>,
    }

    struct SlowWorker(Arc<AtomicBool>);

    impl Drop for SlowWorker {
        fn drop(&mut self) {
            std::thread::sleep(Duration::from_millis(200));
            self.0.store(true, SeqCst);
        }
    }

    impl accelerator::AcceleratorWorker for SlowWorker {
        fn process(&mut self, args: &[ArrayRef], _return_type: &DataType) -> DfResult<ArrayRef> {
            Ok(Arc::clone(&args[0]))
        }
    }

    impl accelerator::AcceleratorFunction for SlowToRelease {
        fn name(&self) -> &str {
            "slow_to_release"
        }
        fn signature(&self) -> &Signature {
            &self.signature
        }
        fn return_type(&self, arg_types: &[DataType]) -> DfResult<DataType> {
            Ok(arg_types[0].clone())
        }
        fn load(
            &self,
            _config: &ConfigOptions,
        ) -> DfResult<Box<dyn accelerator::AcceleratorWorker>> {
            Ok(Box::new(SlowWorker(Arc::clone(&self.released))))
        }
    }

    #[test]
    fn dropping_the_pool_waits_until_its_workers_released_their_models() {
        let released = Arc::new(AtomicBool::new(false));
        let udf = Arc::new(accelerator::accelerator_udf(SlowToRelease {
            signature: Signature::any(1, Volatility::Immutable),
            released: Arc::clone(&released),
        }));
        let pool = AcceleratorPool::default();
        pool.ensure_workers(1);
        let (tx, rx) = mpsc::channel();
        pool.submit(Box::new(move || {
            async move {
                let config = ConfigOptions::default();
                accelerator::preload(&udf, &config).unwrap();
                tx.send(()).unwrap();
            }
            .boxed()
        }));
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(!released.load(SeqCst));
        drop(pool);
        // Without the wait, the worker would still be in its 200 ms release here.
        assert!(
            released.load(SeqCst),
            "the pool's drop returned before its worker dropped the model"
        );
    }
}
