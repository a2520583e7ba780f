//! What a run's memory did (`EXPLAIN ANALYZE` shows it): counted by the operators' memory
//! pool ([`crate::store::operator_memory`]) and by the block store it shares the budget with
//! (evictions, spill files, the heap nobody reserved).

use std::sync::atomic::{AtomicU64, Ordering};

/// What operator memory did, counted over the runs of a plan (`EXPLAIN ANALYZE` shows it).
#[derive(Debug, Default)]
pub struct MemoryCounters {
    /// Most bytes operators held at once in any run.
    pub peak_operator_bytes: AtomicU64,
    /// Allocations refused: each made an operator spill its state (or failed it).
    pub refusals: AtomicU64,
    /// Blocks written from memory to disk to make room for operator state, and their bytes.
    pub blocks_evicted: AtomicU64,
    pub bytes_evicted: AtomicU64,
    /// Spill files the block store wrote (each a run of one or more blocks of one group).
    pub spill_files: AtomicU64,
    /// Most bytes of heap nobody reserved that the block store counted against the budget
    /// at once (0 without an installed allocator: [`crate::store::process_heap`]).
    pub peak_unreserved_bytes: AtomicU64,
    /// Times the installed allocator was asked to hand its idle pages back for a run
    /// ([`crate::store::process_heap::HeapGauge`]).
    pub heap_hand_backs: AtomicU64,
}

impl MemoryCounters {
    /// `[peak operator bytes, refusals, blocks evicted, bytes evicted]`.
    pub fn snapshot(&self) -> [u64; 4] {
        [
            &self.peak_operator_bytes,
            &self.refusals,
            &self.blocks_evicted,
            &self.bytes_evicted,
        ]
        .map(|c| c.load(Ordering::Relaxed))
    }
}
