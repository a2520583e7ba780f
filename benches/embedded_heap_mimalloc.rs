//! flumen embedded in a program that allocates with mimalloc: TPC-H queries under a memory
//! budget with that heap counted (`flumen::CountingAllocator`, handing mimalloc's free
//! pages back with `mi_collect`) and not (`benches/common/embedded_heap_runs.rs`).
//!
//! `cargo bench --bench embedded_heap_mimalloc [-- --sf 10 --runs 2 --budget 1GB]`

#[path = "common/embedded_heap_runs.rs"]
mod embedded_heap_runs;

use mimalloc::MiMalloc;

/// mimalloc, counted, its free pages handed back by [`collect`].
#[global_allocator]
static ALLOCATOR: flumen::CountingAllocator<MiMalloc> =
    flumen::CountingAllocator::with_hand_back(MiMalloc, collect);

/// mimalloc's own hand-back: every thread's free pages and segments, now.
fn collect() {
    // SAFETY: `mi_collect` takes no pointers; it walks mimalloc's own heaps.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

#[tokio::main]
async fn main() -> datafusion::error::Result<()> {
    embedded_heap_runs::main_with(&ALLOCATOR, "mimalloc").await
}
