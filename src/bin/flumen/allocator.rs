//! The `flumen` binary's allocator: jemalloc, tuned to hand what a query freed back to the
//! system within a second without paying for it on every large free.
//!
//! Measured on the shuffle bench (2 GiB sort at a 200 MB budget, release build, 2 cores):
//! mimalloc 12.4 s with an RSS rise of 3.12x the budget; jemalloc's defaults 16.2 s, 2.34x
//! (allocations over 8 MiB go to an arena that returns their pages at once, and a sort
//! makes and frees many); with this configuration 12.7 s, 2.26x. glibc's malloc (with
//! `return_freed_memory`'s trims) sits between the two on RSS. `_RJEM_MALLOC_CONF` in the
//! environment still overrides it. The shuffle bench includes this file so that both of its
//! engines allocate as the binary does.

/// jemalloc as the global allocator.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's compiled-in options (`malloc_conf`, read at its first allocation): no separate
/// arena for large allocations, and free pages returned after one second.
#[used]
#[unsafe(export_name = "_rjem_malloc_conf")]
static JEMALLOC_CONF: &u8 = &b"oversize_threshold:0,dirty_decay_ms:1000,muzzy_decay_ms:0\0"[0];
