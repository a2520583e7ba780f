//! The memory of a worker's CPU task: its operators share the query's budget with the
//! query's blocks on the worker's shelf.
//!
//! Each task gets a pool of the query's `flumen.memory_budget` over the worker's slots, at
//! least [`MIN_TASK_MEMORY`] (DataFusion's `FairSpillPool`: spilling operators, sorts and aggregates, split what the
//! others leave and spill to the worker's disk beyond it; a join's build side is refused,
//! and the driver then runs the task alone). What the operators hold also counts against
//! the query's blocks on the shelf: as operators grow, the query's blocks in memory go to
//! spill files, so blocks and operators together stay within the budget on each worker, as
//! the driver's store and operators share it on the driver.

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::execution::memory_pool::{
    FairSpillPool, MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};

use crate::cluster::block_shelf::BlockShelf;

/// Fewest bytes a task's pool gets, whatever the budget: a task's operators need a few
/// input batches at least (a `TopK` holds the batches its rows are in: 358 KB of one for 50
/// rows of a 40,000-row table), which a budget of a few hundred KB over two slots cannot
/// give. Partitions are sized far below it, so the bound bites only on tiny budgets.
const MIN_TASK_MEMORY: u64 = 16 << 20;

/// The pool one task's operators run under, and its size.
pub(crate) struct TaskMemory {
    /// The pool its runtime gets.
    pub(crate) pool: Arc<dyn MemoryPool>,
    /// Bytes the pool holds at most.
    pub(crate) share: u64,
}

impl TaskMemory {
    /// The memory of a task of `query` (whose budget is `budget`) on a worker running
    /// `slots` tasks at once and keeping blocks on `shelf`.
    pub(crate) fn new(shelf: Arc<BlockShelf>, query: &str, budget: u64, slots: usize) -> Self {
        let share = (budget / slots.max(1) as u64).max(MIN_TASK_MEMORY);
        let pool = QueryMemoryPool {
            inner: FairSpillPool::new(usize::try_from(share).unwrap_or(usize::MAX)),
            shelf,
            query: query.to_string(),
            budget,
        };
        Self {
            pool: Arc::new(pool),
            share,
        }
    }
}

/// A task's `FairSpillPool` whose grants also count against its query's blocks on the
/// worker's shelf (which spills them to make room).
struct QueryMemoryPool {
    inner: FairSpillPool,
    shelf: Arc<BlockShelf>,
    query: String,
    budget: u64,
}

impl std::fmt::Debug for QueryMemoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryMemoryPool")
            .field("inner", &self.inner)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Display for QueryMemoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} within the query's {} bytes", self.inner, self.budget)
    }
}

impl MemoryPool for QueryMemoryPool {
    fn name(&self) -> &str {
        "flumen worker task"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        self.inner.register(consumer)
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        self.inner.unregister(consumer)
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.inner.grow(reservation, additional);
        if let Err(e) = self
            .shelf
            .operators_grew(&self.query, additional as u64, self.budget)
        {
            log::warn!("flumen worker: blocks could not make room for operators: {e}");
        }
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        self.inner.shrink(reservation, shrink);
        self.shelf.operators_shrank(&self.query, shrink as u64);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        self.inner.try_grow(reservation, additional)?;
        if let Err(e) = self
            .shelf
            .operators_grew(&self.query, additional as u64, self.budget)
        {
            self.inner.shrink(reservation, additional);
            self.shelf.operators_shrank(&self.query, additional as u64);
            return Err(e);
        }
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.inner.reserved()
    }

    fn memory_limit(&self) -> MemoryLimit {
        self.inner.memory_limit()
    }
}
