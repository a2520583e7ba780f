//! jemalloc's own count of live heap bytes, sampled while a run goes, beside its RSS: what
//! the run's data held at its peak against what the allocator kept resident.
//!
//! Only for a bench whose global allocator is the `flumen` binary's jemalloc
//! (`src/bin/flumen/allocator.rs`).

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

unsafe extern "C" {
    /// jemalloc's control interface, under the prefix `tikv-jemalloc-sys` builds it with.
    fn _rjem_mallctl(
        name: *const c_char,
        oldp: *mut c_void,
        oldlenp: *mut usize,
        newp: *mut c_void,
        newlen: usize,
    ) -> c_int;
}

/// The live heap bytes jemalloc counts now (`stats.allocated`, after an `epoch` refresh).
fn allocated_now() -> u64 {
    let mut epoch: u64 = 1;
    let mut len = std::mem::size_of::<u64>();
    let mut allocated: usize = 0;
    let mut allocated_len = std::mem::size_of::<usize>();
    // SAFETY: both names are jemalloc's documented controls; the pointers and lengths
    // describe live locals of the types jemalloc reads and writes for them.
    unsafe {
        _rjem_mallctl(
            c"epoch".as_ptr(),
            &mut epoch as *mut u64 as *mut c_void,
            &mut len,
            &mut epoch as *mut u64 as *mut c_void,
            std::mem::size_of::<u64>(),
        );
        if _rjem_mallctl(
            c"stats.allocated".as_ptr(),
            &mut allocated as *mut usize as *mut c_void,
            &mut allocated_len,
            std::ptr::null_mut(),
            0,
        ) != 0
        {
            return 0;
        }
    }
    allocated as u64
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
