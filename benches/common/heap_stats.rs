//! jemalloc's own count of live heap bytes, sampled while a run goes, beside its RSS: what
//! the run's data held at its peak against what the allocator kept resident.
//!
//! Only for a bench whose global allocator is the `flumen` binary's jemalloc
//! (`src/bin/flumen/allocator.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use flumen::HeapAllocator;

/// The live heap bytes jemalloc counts now.
fn allocated_now() -> u64 {
    crate::allocator::Jemalloc.usage().map_or(0, |u| u.live)
}

/// A thread sampling the live heap every few milliseconds until stopped.
pub struct HeapWatch {
    base: u64,
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HeapWatch {
    /// Start sampling.
    pub fn start() -> Self {
        let base = allocated_now();
        let peak = Arc::new(AtomicU64::new(base));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peak, stop) = (Arc::clone(&peak), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(allocated_now(), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        Self {
            base,
            peak,
            stop,
            thread: Some(thread),
        }
    }

    /// The live heap bytes when sampling started.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Stop sampling: the most live heap bytes seen.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}
