//! Worker pools that run tasks.
//!
//! CPU tasks run on the caller's tokio runtime; the scheduler bounds how many run at once
//! with `flumen.cpu_slots`. Accelerator tasks run on [`AcceleratorPool`]: long-lived worker
//! threads of their own (actors), so a busy device never takes a CPU slot and whatever a
//! worker loads (a model) stays loaded across tasks and queries of the session.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::mpsc;

/// A job for a worker: builds the task's future on the worker thread.
pub type Job = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

/// Long-lived accelerator worker threads, shared by every query of a session.
#[derive(Debug)]
pub struct AcceleratorPool {
    sender: mpsc::UnboundedSender<Job>,
    receiver: Arc<Mutex<mpsc::UnboundedReceiver<Job>>>,
    workers: Mutex<usize>,
}

impl Default for AcceleratorPool {
    fn default() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Self {
            sender,
            receiver: Arc::new(Mutex::new(receiver)),
            workers: Mutex::new(0),
        }
    }
}

impl AcceleratorPool {
    /// Make sure at least `n` workers run.
    pub fn ensure_workers(&self, n: usize) {
        let mut workers = self.workers.lock().unwrap();
        while *workers < n {
            let receiver = Arc::clone(&self.receiver);
            let index = *workers;
            std::thread::Builder::new()
                .name(format!("flumen-accel-{index}"))
                .spawn(move || worker_loop(receiver))
                .expect("spawn accelerator worker thread");
            *workers += 1;
        }
    }

    /// Number of worker threads started.
    pub fn workers(&self) -> usize {
        *self.workers.lock().unwrap()
    }

    /// Queue a job for the next free worker.
    pub fn submit(&self, job: Job) {
        // The receiver lives as long as the pool, so sending cannot fail.
        let _ = self.sender.send(job);
    }
}

fn worker_loop(receiver: Arc<Mutex<mpsc::UnboundedReceiver<Job>>>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("build accelerator worker runtime");
    loop {
        let job = {
            let mut rx = receiver.lock().unwrap();
            rx.blocking_recv()
        };
        let Some(job) = job else { return };
        // The job reports its own panics; this only keeps the worker alive.
        let _ = runtime.block_on(AssertUnwindSafe(async move { job().await }).catch_unwind());
    }
}
