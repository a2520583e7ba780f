//! The heap nobody reserved, as a share of a run's memory budget.
//!
//! Blocks and operators' reservations are what flumen counts by itself; readers' buffers,
//! pieces of blocks not yet cut, the store's own maps, the allocator's rounding and the free
//! pages it keeps are not. When the process's allocator can say what it holds
//! ([`crate::store::process_heap`]), what it holds beyond the blocks in memory and the
//! reservations takes its share of the budget, up to three quarters of it, and its idle
//! pages are handed back before any block is written out.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::store::memory_counters::MemoryCounters;
use crate::store::process_heap::HeapGauge;

/// The heap nobody reserved, for one run's block store.
#[derive(Default)]
pub(crate) struct HeapShare {
    /// The process's heap, when its allocator counts what it holds; `None`: the share is 0.
    gauge: Option<HeapGauge>,
    /// The most of the budget the share may take ([`Self::cap_of`]).
    cap: u64,
    /// The share, as of the gauge's last reading: blocks written out or released since
    /// then change the store's bytes in memory, not it.
    last: AtomicU64,
}

impl HeapShare {
    /// The share of a run with `budget` bytes, read from `gauge` (none: always 0).
    pub(crate) fn new(gauge: Option<HeapGauge>, budget: u64) -> Self {
        Self {
            gauge,
            cap: Self::cap_of(budget),
            last: AtomicU64::new(0),
        }
    }

    /// The most of `budget` that memory nobody reserved may take from blocks: the rest
    /// stays theirs, so that a model's weights loaded in the middle of a run, say, do not
    /// send every later block to disk.
    fn cap_of(budget: u64) -> u64 {
        budget / 4 * 3
    }

    /// Whether the allocator's heap is counted.
    pub(crate) fn counts_heap(&self) -> bool {
        self.gauge.is_some()
    }

    /// The share: given a new `reading` of what the allocator holds for the run
    /// ([`Self::reading`]), that beyond `reserved` (the blocks in memory now and operators'
    /// reservations), up to the cap; without one, the share found at the last reading (a
    /// reading a few milliseconds old still holds blocks written out since: set against
    /// the blocks in memory now, they would count twice). Its peak goes to `counters`.
    pub(crate) fn share(
        &self,
        reading: Option<u64>,
        reserved: u64,
        counters: Option<&MemoryCounters>,
    ) -> u64 {
        let Some(held) = reading else {
            return self.last_share();
        };
        let share = held.saturating_sub(reserved).min(self.cap);
        self.last.store(share, Ordering::Relaxed);
        if let Some(counters) = counters {
            counters
                .peak_unreserved_bytes
                .fetch_max(share, Ordering::Relaxed);
        }
        share
    }

    /// The share as of the last reading.
    pub(crate) fn last_share(&self) -> u64 {
        self.last.load(Ordering::Relaxed)
    }

    /// The allocator's idle pages at the last reading (0 when the heap is not counted).
    pub(crate) fn last_idle(&self) -> u64 {
        self.gauge.as_ref().map_or(0, HeapGauge::last_idle)
    }

    /// A new reading of what the allocator holds for the run ([`HeapGauge::reading`]),
    /// when the heap is counted and one is due (read before taking the store's lock).
    pub(crate) fn reading(&self, counters: Option<&MemoryCounters>) -> Option<u64> {
        let reading = self.gauge.as_ref().and_then(HeapGauge::reading);
        // Only a reading made (at most every 2 ms, not at every put) may have handed back.
        if reading.is_some() {
            self.count_hand_backs(counters);
        }
        reading
    }

    /// Whether the last reading found free pages worth handing back.
    pub(crate) fn holds_idle_pages(&self) -> bool {
        self.gauge.as_ref().is_some_and(HeapGauge::holds_idle_pages)
    }

    /// A reading made after the allocator handed its free pages back.
    pub(crate) fn reading_after_hand_back(&self, counters: Option<&MemoryCounters>) -> Option<u64> {
        let reading = self
            .gauge
            .as_ref()
            .and_then(HeapGauge::reading_after_hand_back);
        self.count_hand_backs(counters);
        reading
    }

    /// The gauge's hand-backs so far, into `counters`.
    fn count_hand_backs(&self, counters: Option<&MemoryCounters>) {
        if let (Some(gauge), Some(counters)) = (&self.gauge, counters) {
            counters
                .heap_hand_backs
                .fetch_max(gauge.hand_backs(), Ordering::Relaxed);
        }
    }
}
