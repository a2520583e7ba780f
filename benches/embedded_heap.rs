//! flumen embedded in a program that allocates with the system's allocator (glibc's
//! malloc), as most Rust programs do: TPC-H queries under a memory budget with that heap
//! counted (`flumen::CountingAllocator`) and not (`benches/common/embedded_heap_runs.rs`).
//!
//! `cargo bench --bench embedded_heap [-- --sf 10 --runs 2 --budget 1GB --queries 7,9,18,21]`

#[path = "common/embedded_heap_runs.rs"]
mod embedded_heap_runs;

use std::alloc::System;

/// The system's allocator, counted: what an embedding program adds to use flumen's budget.
/// Its free pages go back with glibc's `malloc_trim`.
#[global_allocator]
static ALLOCATOR: flumen::CountingAllocator<System> = flumen::CountingAllocator::new(System);

#[tokio::main]
async fn main() -> datafusion::error::Result<()> {
    embedded_heap_runs::main_with(&ALLOCATOR, "glibc (the system's)").await
}
