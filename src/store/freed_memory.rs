//! Handing memory that tasks freed back to the operating system.
//!
//! glibc's malloc keeps what a thread frees in that thread's arena for its next allocation,
//! so after hundreds of tasks on a pool of threads each arena holds the high-water mark of
//! the tasks it ran: a 1.9 GiB sort at a 50 MB budget peaked at 586 MB of RSS for ~143 MB of
//! live heap. [`return_freed_memory`], called as tasks finish, asks the allocator to give
//! back whole free pages (`malloc_trim`), at most once per [`TRIM_INTERVAL`] so that runs of
//! many short tasks do not pay for it each time. A program that installed its allocator
//! ([`crate::store::process_heap::install`], as the `flumen` binary does for jemalloc) has
//! that allocator's [`return_freed`](crate::store::process_heap::HeapAllocator::return_freed)
//! called too, unless the run counts that allocator's heap in its budget: its gauge hands
//! the idle pages back once they pass a share of the budget (each purge here sent the next
//! tasks' allocations to fresh pages, which the kernel zeroes: TPC-H q5 spent 15% of its
//! samples clearing pages, against 3% for vanilla DataFusion); other allocators return
//! memory on their own schedule. A task that ran on an
//! accelerator worker has its trim run on a thread of its own
//! ([`return_freed_memory_elsewhere`]): a trim takes milliseconds, which the device would
//! otherwise sit idle for before the worker's next task.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Least time between two trims.
pub(crate) const TRIM_INTERVAL: Duration = Duration::from_millis(100);

/// Milliseconds since [`epoch`], plus one interval, when the last trim started (0: never).
static LAST_TRIM_MS: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Give the pages glibc, and the installed allocator when `allocator_too`, hold free back
/// to the system, unless another thread did so less than [`TRIM_INTERVAL`] ago. True when
/// this call trimmed.
pub(crate) fn return_freed_memory(allocator_too: bool) -> bool {
    if !trim_due() {
        return false;
    }
    trim(allocator_too);
    true
}

/// [`return_freed_memory`] on a thread of its own, so that the caller (a thread feeding an
/// accelerator, whose next batch should not wait for the allocator) goes on at once.
pub(crate) fn return_freed_memory_elsewhere(allocator_too: bool) {
    if trim_due() {
        // A thread that cannot start leaves the pages to the next trim.
        let _ = std::thread::Builder::new()
            .name("flumen-trim".into())
            .spawn(move || trim(allocator_too));
    }
}

/// Whether this caller is to trim now (see [`claim_trim`]).
fn trim_due() -> bool {
    // Offset by one interval so that the first call, at 0 ms, is due.
    let now_ms = (epoch().elapsed() + TRIM_INTERVAL).as_millis() as u64;
    claim_trim(&LAST_TRIM_MS, now_ms)
}

/// Whether a trim is due at `now_ms` given the last one's time in `last_trim_ms`; the
/// caller that gets true has recorded `now_ms` and trims, any other gets false.
fn claim_trim(last_trim_ms: &AtomicU64, now_ms: u64) -> bool {
    let last = last_trim_ms.load(Ordering::Relaxed);
    now_ms >= last + TRIM_INTERVAL.as_millis() as u64
        && last_trim_ms
            .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// The installed allocator's way of returning pages when `allocator_too`, and glibc's
/// `malloc_trim` (libraries written in C allocate from it whatever Rust's global allocator
/// is).
fn trim(allocator_too: bool) {
    if allocator_too && let Some(allocator) = crate::store::process_heap::installed() {
        allocator.return_freed();
    }
    trim_glibc();
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_glibc() {
    // SAFETY: malloc_trim only walks glibc's own arenas under their locks; it takes no
    // pointers and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_glibc() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_at_most_once_per_interval() {
        let last = AtomicU64::new(0);
        assert!(claim_trim(&last, 100));
        assert!(!claim_trim(&last, 150));
        assert!(!claim_trim(&last, 199));
        assert!(claim_trim(&last, 200));
        assert_eq!(last.load(Ordering::Relaxed), 200);
    }
}
