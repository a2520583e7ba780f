//! Blocks and where they live.
//!
//! - [`block`]: the [`block::Block`] value (id, producer, output partition, rows, bytes) and its
//!   location (memory, spilled, or held by a worker process).
//! - [`block_digest`]: a hash of a block's rows, which its recomputation must reproduce.
//! - [`block_memory`]: the bytes a block's rows hold, and a copy holding only those.
//! - [`block_store`]: the memory-budgeted store that knows where each block lives.
//! - [`counting_allocator`]: a global allocator wrapper counting live bytes, for programs
//!   whose allocator cannot tell flumen what the heap holds.
//! - [`cutter`]: the one block cutter every task's output goes through.
//! - [`freed_memory`]: handing what finished tasks freed back to the operating system.
//! - [`heap_share`]: the heap nobody reserved, as a share of a run's memory budget.
//! - [`memory_budget`]: how much a run may hold, and what holds it besides blocks
//!   (operators' reservations, the heap nobody reserved).
//! - [`memory_counters`]: what a run's memory did (peaks, refusals, evictions, spill files).
//! - [`owned_dir`]: temporary directories a process owns, swept by the next one when it
//!   died without removing them.
//! - [`operator_memory`]: the memory pool of a run's operators, sharing the store's budget.
//! - [`process_heap`]: the process's allocator: its live bytes, and handing freed pages back.
//! - [`ramp`]: small first blocks at a run's start, doubling up to the target.
//! - [`spill_candidates`]: which blocks in memory are written out first when it is full.
//! - [`spill_runs`]: the files blocks are written out to beyond the budget, a run per group.
//! - [`range_split`]: a batch's rows split by range, in arrow's row format.

pub(crate) mod block;
pub(crate) mod block_digest;
pub(crate) mod block_memory;
pub use block_memory::rows_bytes;
pub(crate) mod block_store;
pub mod counting_allocator;
pub(crate) mod cutter;
pub(crate) mod freed_memory;
pub(crate) mod heap_share;
pub(crate) mod memory_budget;
pub(crate) mod memory_counters;
pub(crate) mod operator_memory;
pub(crate) mod owned_dir;
pub mod process_heap;
pub(crate) mod ramp;
pub(crate) mod range_split;
pub(crate) mod spill_candidates;
pub(crate) mod spill_runs;
