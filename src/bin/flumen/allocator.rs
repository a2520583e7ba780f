//! The `flumen` binary's allocator: jemalloc, tuned to hand what a query freed back to the
//! system soon without paying for it on every large free, and installed as the process's
//! [`flumen::HeapAllocator`]: its count of live bytes lets the memory budget cover what no
//! operator reserved, and finished tasks purge the pages it holds free.
//!
//! Measured on the shuffle bench (2 GiB sort at a 200 MB budget, release build, 2 cores):
//! mimalloc 12.4 s with an RSS rise of 3.12x the budget; jemalloc's defaults 16.2 s, 2.34x
//! (allocations over 8 MiB go to an arena that returns their pages at once, and a sort
//! makes and frees many); `oversize_threshold:0,dirty_decay_ms:1000` 12.7 s, 2.26x, of which
//! 1.41x was live heap. glibc's malloc (with `return_freed_memory`'s trims) sits between the
//! two on RSS. Transparent huge pages for jemalloc's mappings (`thp:always`; the kernel's
//! setting is `madvise`): the pages a task faults in after a purge come 2 MiB at a time,
//! and the kernel's share of a run falls (2026-11-27: the sort 16.3/17.4 → 15.2/16.1 s, its
//! RSS rise 1.10x either way; TPC-H SF10 under 1 GB, q3/q5/q9/q10 1.40/2.22/8.59/2.28 →
//! 1.22/1.89/6.27/1.79 s). `_RJEM_MALLOC_CONF` in the environment still overrides the
//! options. The shuffle and TPC-H benches include this file so that both of their engines
//! allocate as the binary does.

/// jemalloc as the global allocator.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's compiled-in options (`malloc_conf`, read at its first allocation): no separate
/// arena for large allocations, free pages returned after one second (sooner when a task
/// ends: [`Jemalloc::return_freed`]), huge pages where the kernel allows them.
#[used]
#[unsafe(export_name = "_rjem_malloc_conf")]
static JEMALLOC_CONF: &u8 =
    &b"oversize_threshold:0,dirty_decay_ms:1000,muzzy_decay_ms:0,thp:always\0"[0];

/// jemalloc, as flumen asks of an allocator.
pub struct Jemalloc;

impl flumen::HeapAllocator for Jemalloc {
    fn usage(&self) -> Option<flumen::HeapUsage> {
        use tikv_jemalloc_ctl::{epoch, stats};
        // jemalloc's statistics are a snapshot taken at each `epoch` advance. Pages in
        // active extents hold allocations (and their rounding); resident pages beyond them
        // and jemalloc's own metadata are free ones it keeps.
        epoch::advance().ok()?;
        let live = stats::allocated::read().ok()? as u64;
        let active = stats::active::read().ok()? as u64;
        let resident = stats::resident::read().ok()? as u64;
        let metadata = stats::metadata::read().ok()? as u64;
        let idle = resident.saturating_sub(active + metadata);
        Some(flumen::HeapUsage { live, idle })
    }

    fn return_freed(&self) {
        // `arena.<MALLCTL_ARENAS_ALL>.purge` (4096 in jemalloc 5): every arena's unused
        // dirty pages, now. A command with no value; a failure leaves them to the decay.
        // SAFETY: a documented jemalloc control that reads and writes nothing: every
        // pointer is null and the length 0, as its interface requires.
        unsafe {
            tikv_jemalloc_sys::mallctl(
                c"arena.4096.purge".as_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            );
        }
    }
}

/// Tell flumen that jemalloc is the process's allocator (before the first query).
pub fn install() {
    static JEMALLOC: Jemalloc = Jemalloc;
    flumen::install_heap_allocator(&JEMALLOC);
}
