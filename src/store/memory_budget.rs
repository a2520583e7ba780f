//! A run's memory budget as its block store counts it: blocks in memory, operators'
//! reservations (they share the budget: [`crate::store::operator_memory`]) and, where the
//! allocator says what it holds, the heap nobody reserved ([`crate::store::heap_share`]).
//! It says how much is held and whether a block fits; which blocks leave memory when one
//! does not is the store's choice ([`crate::store::spill_candidates`]), where they go is
//! its placement ([`crate::store::block_store`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::store::heap_share::HeapShare;
use crate::store::memory_counters::MemoryCounters;
use crate::store::process_heap::{HeapAllocator, HeapGauge, READ_INTERVAL};

/// How many bytes one run may hold, and what holds them beside its blocks.
#[derive(Default)]
pub(crate) struct MemoryBudget {
    /// The budget in bytes (`flumen.memory_budget`).
    bytes: u64,
    /// Bytes the run's operators hold (their state shares the budget:
    /// [`crate::store::operator_memory::OperatorMemory`]).
    operator_bytes: AtomicU64,
    /// The heap nobody reserved: its share of the budget.
    heap: HeapShare,
    /// Where the run's plan counts its memory too, for `EXPLAIN ANALYZE`.
    counters: Option<Arc<MemoryCounters>>,
}

impl MemoryBudget {
    /// A budget of `bytes` that counts blocks and operators' reservations only.
    pub(crate) fn new(bytes: u64) -> Self {
        Self {
            bytes,
            ..Self::default()
        }
    }

    /// Count the memory `allocator` holds for the run too, and have it hand back its idle
    /// pages when they pass an eighth of the budget; `None`: only blocks and operators'
    /// reservations count.
    pub(crate) fn with_heap(self, allocator: Option<&'static dyn HeapAllocator>) -> Self {
        let idle_limit = (self.bytes / 8).max(4 << 20);
        let gauge = allocator.and_then(|a| HeapGauge::new(a, READ_INTERVAL, idle_limit));
        self.with_gauge(gauge)
    }

    /// Count the heap as `gauge` reads it (none: not at all).
    pub(crate) fn with_gauge(mut self, gauge: Option<HeapGauge>) -> Self {
        self.heap = HeapShare::new(gauge, self.bytes);
        self
    }

    /// Count peaks and hand-backs in `counters` too.
    pub(crate) fn with_counters(mut self, counters: Arc<MemoryCounters>) -> Self {
        self.counters = Some(counters);
        self
    }

    /// The budget in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The run's memory counters, if its plan keeps them.
    pub(crate) fn counters(&self) -> Option<&MemoryCounters> {
        self.counters.as_deref()
    }

    /// Whether the allocator's heap is counted.
    pub(crate) fn counts_heap(&self) -> bool {
        self.heap.counts_heap()
    }

    /// Bytes the run's operators hold now.
    pub(crate) fn operator_bytes(&self) -> u64 {
        self.operator_bytes.load(Ordering::Relaxed)
    }

    /// Record what the run's operators hold now.
    pub(crate) fn set_operator_bytes(&self, bytes: u64) {
        self.operator_bytes.store(bytes, Ordering::Relaxed);
    }

    /// The heap nobody reserved as last read, and the allocator's idle pages then.
    pub(crate) fn last_unreserved(&self) -> (u64, u64) {
        (self.heap.last_share(), self.heap.last_idle())
    }

    /// Everything the budget holds with `memory_bytes` of blocks in memory: those, the
    /// operators' reservations and the heap nobody reserved ([`HeapShare::share`]), given
    /// a new `reading` of the allocator (else the share found at the last one).
    pub(crate) fn held(&self, memory_bytes: u64, reading: Option<u64>) -> u64 {
        let reserved = memory_bytes + self.operator_bytes();
        reserved + self.heap.share(reading, reserved, self.counters())
    }

    /// Readings of the allocator for one attempt to fit the budget ([`HeapReadings`]).
    pub(crate) fn readings(&self) -> HeapReadings<'_> {
        HeapReadings {
            next: self.heap.reading(self.counters()),
            budget: self,
            handed_back: false,
        }
    }

    /// Bytes a spill run gathers at least when it is written (unless its group has fewer in
    /// memory): an eighth of the budget, between 1 MiB and 64 MiB.
    pub(crate) fn run_bytes(&self) -> u64 {
        (self.bytes / 8).clamp(1 << 20, 64 << 20)
    }

    /// Bytes a group's run file takes before the next spill starts a new one: four runs'
    /// worth (4–256 MiB). A run's space returns to the disk when its last block is read, so
    /// smaller files free space sooner; larger ones mean fewer files.
    pub(crate) fn run_cap(&self) -> u64 {
        4 * self.run_bytes()
    }

    /// Bytes of blocks always kept in memory, whatever operators and the heap nobody
    /// reserved hold: a sixteenth of the budget. When those two alone fill the budget
    /// (a join's build at its peak, a heap count near its cap), writing out the last
    /// blocks frees little and costs a small spill file per block put: TPC-H q7 at SF10
    /// under 1 GB spilled 1.85K blocks in 2.54K writes and took 1.6x as long, its peak
    /// RSS no lower.
    pub(crate) fn block_floor(&self) -> u64 {
        self.bytes / 16
    }

    /// Whether `held` bytes, of which `memory_bytes` are blocks in memory, fit: within the
    /// budget, or blocks no more than [`Self::block_floor`].
    pub(crate) fn fits(&self, held: u64, memory_bytes: u64) -> bool {
        held <= self.bytes || memory_bytes <= self.block_floor()
    }
}

/// The allocator's readings over one attempt to fit the budget: a reading when one is due,
/// then, once, a reading after the allocator handed its idle pages back: pages it keeps
/// free go back before any block goes to disk.
pub(crate) struct HeapReadings<'a> {
    budget: &'a MemoryBudget,
    /// The reading not yet counted ([`MemoryBudget::held`] takes it).
    next: Option<u64>,
    handed_back: bool,
}

impl HeapReadings<'_> {
    /// The new reading, if one was made since the last call.
    pub(crate) fn take(&mut self) -> Option<u64> {
        self.next.take()
    }

    /// Whether the allocator may hand pages back first: it holds idle ones and has not
    /// handed back in this attempt.
    pub(crate) fn may_hand_back(&self) -> bool {
        !self.handed_back && self.budget.heap.holds_idle_pages()
    }

    /// Have the allocator hand its idle pages back and read it again (call without the
    /// store's lock: it takes a moment).
    pub(crate) fn hand_back(&mut self) {
        self.handed_back = true;
        self.next = self
            .budget
            .heap
            .reading_after_hand_back(self.budget.counters());
    }
}
