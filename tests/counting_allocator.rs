//! A program that embeds flumen with the system's allocator, wrapped in
//! `flumen::CountingAllocator` and installed: the heap its runs hold beyond blocks and
//! operators' reservations counts against the budget, as in the `flumen` binary.

mod common;

use std::alloc::System;
use std::sync::atomic::Ordering;

use datafusion::prelude::{SessionConfig, SessionContext};
use flumen::HeapAllocator;
use flumen::exec::FlumenExec;

#[global_allocator]
static ALLOCATOR: flumen::CountingAllocator<System> = flumen::CountingAllocator::new(System);

/// A flumen session under a 64 MB budget, counting the heap or not.
fn session(counts_heap: bool) -> SessionContext {
    let mut config = flumen::FlumenConfig::default();
    config.memory_budget = "64MB".parse().unwrap();
    config.budget_counts_heap = counts_heap;
    flumen::session_with_config(SessionConfig::new().with_target_partitions(2), config)
}

/// The most heap nobody reserved that a run of `sql` counted against its budget.
async fn peak_unreserved(ctx: &SessionContext, sql: &str) -> u64 {
    let (batches, plan) = common::run_plan(ctx, sql).await;
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 1000);
    let exec = plan
        .downcast_ref::<FlumenExec>()
        .expect("flumen ran the query");
    exec.run_metrics()
        .memory
        .peak_unreserved_bytes
        .load(Ordering::Relaxed)
}

/// One test, so that no other test's allocations move the count while it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_system_allocators_heap_counts_against_the_budget() {
    assert!(flumen::install_heap_allocator(&ALLOCATOR));

    // The count follows what is allocated and freed.
    let before = ALLOCATOR.live_bytes();
    let held = vec![7u8; 64 << 20];
    let with = ALLOCATOR.usage().unwrap().live;
    assert!(
        with >= before + (64 << 20) && with < before + (65 << 20),
        "64 MiB held: {before} -> {with}"
    );
    drop(held);
    assert!(ALLOCATOR.live_bytes() < before + (1 << 20));

    // Resident memory the counter did not see (here mapped directly, as an allocator keeps
    // freed pages) shows as idle, and goes when unmapped.
    let idle_before = ALLOCATOR.usage().unwrap().idle;
    let len = 64 << 20;
    // SAFETY: an anonymous private mapping, written within its length, unmapped once.
    unsafe {
        let pages = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(pages, libc::MAP_FAILED);
        std::ptr::write_bytes(pages as *mut u8, 1, len);
        let idle = ALLOCATOR.usage().unwrap().idle;
        assert!(
            idle >= idle_before + (60 << 20),
            "64 MiB resident: idle {idle_before} -> {idle}"
        );
        libc::munmap(pages, len);
    }
    let idle_after = ALLOCATOR.usage().unwrap().idle;
    assert!(
        idle_after < idle_before + (4 << 20),
        "unmapped: idle {idle_before} -> {idle_after}"
    );

    // A run counts the heap nobody reserved (hash tables' growth, pieces of blocks) only
    // when the session says so.
    let sql = "SELECT value % 1000 AS k, count(*) FROM generate_series(1, 2000000) GROUP BY k";
    let counted = peak_unreserved(&session(true), sql).await;
    assert!(counted > 0, "no heap counted with the counting allocator");
    assert!(
        counted <= 48 << 20,
        "{counted} bytes: more than the cap of three quarters of the budget"
    );
    assert_eq!(
        peak_unreserved(&session(false), sql).await,
        0,
        "heap counted with flumen.budget_counts_heap off"
    );
}
