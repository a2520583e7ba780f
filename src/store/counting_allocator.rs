//! A global allocator that counts its live bytes, for programs that embed flumen with an
//! allocator that cannot tell them (the system's, mimalloc, ...).
//!
//! flumen's budget covers the heap nobody reserved (readers' buffers, pieces of blocks not
//! yet cut) only when the process's allocator reports its live bytes
//! ([`crate::HeapAllocator`]). The `flumen` binary installs jemalloc's statistics; a program
//! with another allocator got no such count, and on TPC-H SF10 under a 1 GB budget q18's
//! RSS rose 1.8 GiB. Wrapping the allocator in [`CountingAllocator`] and installing it gives
//! such a program the same budget:
//!
//! ```no_run
//! #[global_allocator]
//! static ALLOCATOR: flumen::CountingAllocator<std::alloc::System> =
//!     flumen::CountingAllocator::new(std::alloc::System);
//!
//! fn main() {
//!     flumen::install_heap_allocator(&ALLOCATOR);
//!     // ... flumen::session(...) as usual
//! }
//! ```
//!
//! Each allocation adds its requested size to one of [`STRIPES`] counters, picked per
//! thread, and each free takes it off there: threads seldom share a counter's cache line,
//! so counting costs one uncontended atomic add, not a line bounced between cores. Reading
//! sums the stripes.
//!
//! The inner allocator does not say what it keeps beyond the live bytes (its rounding, the
//! free pages it has not returned), so the idle bytes reported are the process's resident
//! memory beyond the live bytes, less that same gap at the first reading (the binary, the
//! runtime, what was idle then). With live bytes alone, glibc's malloc let TPC-H SF10 q21
//! rise 1.35x over a 1 GB budget (`benches/embedded_heap.rs`). Handing back calls glibc's
//! `malloc_trim`, which is what the system's allocator keeps; another allocator's own call
//! is given with [`CountingAllocator::with_hand_back`] (mimalloc's `mi_collect`, say:
//! `benches/embedded_heap_mimalloc.rs`).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};

use crate::store::process_heap::{HeapAllocator, HeapUsage};

/// How many counters the live bytes are spread over.
pub const STRIPES: usize = 64;

/// One counter on a cache line (pair) of its own.
#[repr(align(128))]
struct Stripe(AtomicI64);

/// `A`, counting the bytes allocated through it and not yet freed (see the module's doc).
pub struct CountingAllocator<A> {
    inner: A,
    /// Bytes allocated less bytes freed, per stripe; a stripe may go negative (a thread
    /// frees what another allocated), the sum does not.
    stripes: [Stripe; STRIPES],
    /// Resident bytes beyond the live ones at the first reading, plus one (0: none yet).
    first_gap: AtomicU64,
    /// What hands `inner`'s free pages back to the system; `None`: glibc's `malloc_trim`.
    hand_back: Option<fn()>,
}

impl<A> CountingAllocator<A> {
    /// `inner`, counted from now (usable in a `static`); its free pages are handed back
    /// with glibc's `malloc_trim` (the system's allocator on Linux).
    pub const fn new(inner: A) -> Self {
        Self {
            inner,
            stripes: [const { Stripe(AtomicI64::new(0)) }; STRIPES],
            first_gap: AtomicU64::new(0),
            hand_back: None,
        }
    }

    /// `inner`, counted from now, whose free pages `hand_back` returns to the system (for an
    /// allocator other than glibc's, e.g. `|| unsafe { libmimalloc_sys::mi_collect(true) }`).
    pub const fn with_hand_back(inner: A, hand_back: fn()) -> Self {
        Self {
            inner,
            stripes: [const { Stripe(AtomicI64::new(0)) }; STRIPES],
            first_gap: AtomicU64::new(0),
            hand_back: Some(hand_back),
        }
    }

    /// Resident bytes beyond `live` that were not there at the first reading: pages the
    /// inner allocator keeps free, by all it can tell (0 where the resident size is unknown).
    fn idle_bytes(&self, live: u64) -> u64 {
        let Some(resident) = resident_bytes() else {
            return 0;
        };
        let gap = resident.saturating_sub(live);
        let first =
            match self
                .first_gap
                .compare_exchange(0, gap + 1, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => gap + 1,
                Err(first) => first,
            };
        gap.saturating_sub(first - 1)
    }

    /// Bytes allocated through this allocator and not yet freed.
    pub fn live_bytes(&self) -> u64 {
        let sum: i64 = self
            .stripes
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .sum();
        sum.max(0) as u64
    }

    fn count(&self, delta: i64) {
        self.stripes[stripe_of_this_thread()]
            .0
            .fetch_add(delta, Ordering::Relaxed);
    }
}

/// The process's resident memory (`/proc/self/statm`), where the system tells it.
pub(crate) fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

#[cfg(unix)]
fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system; no pointers.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as u64 } else { 4096 }
}

#[cfg(not(unix))]
fn page_size() -> u64 {
    4096
}

/// This thread's stripe: threads take stripes in turn as they first allocate. The
/// thread-local holds a plain integer (no destructor to register, which could allocate).
fn stripe_of_this_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE
        .try_with(|stripe| {
            if stripe.get() == usize::MAX {
                stripe.set(NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES);
            }
            stripe.get()
        })
        .unwrap_or(0)
}

// SAFETY: every call is passed to `inner` unchanged; the counting only reads the layouts and
// the returned pointers' nullness.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAllocator<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc`, passed on.
        let ptr = unsafe { self.inner.alloc(layout) };
        if !ptr.is_null() {
            self.count(layout.size() as i64);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        let ptr = unsafe { self.inner.alloc_zeroed(layout) };
        if !ptr.is_null() {
            self.count(layout.size() as i64);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { self.inner.dealloc(ptr, layout) };
        self.count(-(layout.size() as i64));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc`, passed on.
        let moved = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            self.count(new_size as i64 - layout.size() as i64);
        }
        moved
    }
}

impl<A: GlobalAlloc + Send + Sync> HeapAllocator for CountingAllocator<A> {
    fn usage(&self) -> Option<HeapUsage> {
        let live = self.live_bytes();
        Some(HeapUsage {
            live,
            idle: self.idle_bytes(live),
        })
    }

    /// The hand-back given to [`CountingAllocator::with_hand_back`]; else glibc's
    /// `malloc_trim` (the system's allocator on Linux), nothing elsewhere.
    fn return_freed(&self) {
        if let Some(hand_back) = self.hand_back {
            hand_back();
            return;
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only walks glibc's own arenas under their locks.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;

    /// A hand-back given at construction is what handing back calls.
    #[test]
    fn hands_back_with_the_function_it_was_given() {
        static CALLS: AtomicUsize = AtomicUsize::new(0);
        fn hand_back() {
            CALLS.fetch_add(1, Ordering::SeqCst);
        }
        let counting = CountingAllocator::with_hand_back(System, hand_back);
        counting.return_freed();
        counting.return_freed();
        assert_eq!(CALLS.load(Ordering::SeqCst), 2);
        // The plain constructor keeps glibc's trim, not the function.
        CountingAllocator::new(System).return_freed();
        assert_eq!(CALLS.load(Ordering::SeqCst), 2);
    }

    /// Allocations, growth, shrinking and frees add up, from many threads at once.
    #[test]
    fn counts_what_is_allocated_and_not_yet_freed() {
        let counting: &'static CountingAllocator<System> =
            Box::leak(Box::new(CountingAllocator::new(System)));
        let layout = Layout::from_size_align(1_000, 8).unwrap();
        // SAFETY: each pointer is freed (or grown) once, with the layout it has.
        unsafe {
            let a = counting.alloc(layout);
            let b = counting.alloc_zeroed(layout);
            assert_eq!(counting.live_bytes(), 2_000);
            let a = counting.realloc(a, layout, 5_000);
            assert_eq!(counting.live_bytes(), 6_000);
            let a = counting.realloc(a, Layout::from_size_align(5_000, 8).unwrap(), 300);
            assert_eq!(counting.live_bytes(), 1_300);
            counting.dealloc(a, Layout::from_size_align(300, 8).unwrap());
            counting.dealloc(b, layout);
        }
        assert_eq!(counting.live_bytes(), 0);

        // Eight threads, each keeping one block in ten and handing the rest to another
        // thread to free: stripes go negative, the sum stays exact.
        let (kept_tx, kept_rx) = std::sync::mpsc::channel::<usize>();
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let kept_tx = kept_tx.clone();
                std::thread::spawn(move || {
                    let layout = Layout::from_size_align(64, 8).unwrap();
                    let mut handed = vec![];
                    for i in 0..1_000 {
                        // SAFETY: freed below (by this thread or the main one), once.
                        let p = unsafe { counting.alloc(layout) };
                        if i % 10 == 0 {
                            kept_tx.send(p as usize).unwrap();
                        } else {
                            handed.push(p as usize);
                        }
                    }
                    handed
                })
            })
            .collect();
        drop(kept_tx);
        let handed: Vec<usize> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert_eq!(counting.live_bytes(), 8 * 1_000 * 64);
        let layout = Layout::from_size_align(64, 8).unwrap();
        for p in handed {
            // SAFETY: allocated above with this layout, freed once.
            unsafe { counting.dealloc(p as *mut u8, layout) };
        }
        assert_eq!(counting.live_bytes(), 8 * 100 * 64);
        for p in kept_rx {
            // SAFETY: as above.
            unsafe { counting.dealloc(p as *mut u8, layout) };
        }
        assert_eq!(counting.live_bytes(), 0);
        assert_eq!(
            counting.usage().map(|u| u.live),
            Some(0),
            "what flumen reads"
        );
    }
}
