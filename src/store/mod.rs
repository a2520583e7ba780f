//! Blocks and where they live.
//!
//! - [`block`]: the [`Block`] value (id, producer, output partition, rows, bytes) and its
//!   location (memory, spilled, or held by a worker process).
//! - [`block_store`]: the memory-budgeted store that holds blocks in memory or spills them.
//! - [`cutter`]: the one block cutter every task's output goes through.

pub(crate) mod block;
pub(crate) mod block_store;
pub(crate) mod cutter;
