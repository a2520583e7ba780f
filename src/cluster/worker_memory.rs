//! The memory of a worker's CPU task: its operators share the query's budget with the
//! query's blocks on the worker's shelf.
//!
//! Each task gets a pool of the query's `flumen.memory_budget` over the worker's slots, at
//! least [`MIN_TASK_MEMORY`] (less only under a session's own smaller limit) (DataFusion's `FairSpillPool`: spilling operators, sorts and aggregates, split what the
//! others leave and spill to the worker's disk beyond it; a join's build side is refused,
//! and the driver then runs the task alone). What the operators hold also counts against
//! the query's blocks on the shelf: as operators grow, the query's blocks in memory go to
//! spill files, so blocks and operators together stay within the budget on each worker, as
//! the driver's store and operators share it on the driver.
//!
//! A session that set a memory limit of its own (`datafusion.runtime.memory_limit`) runs
//! its tasks on the driver under that limit, not under flumen's budget; the cluster's slots
//! split that limit ([`task_memory_limit`]), so that the query's operators on the workers
//! stay within it too, and a query that spills or fails under it on the driver does so on
//! the workers.

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::execution::TaskContext;
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
    /// `slots` tasks at once and keeping blocks on `shelf`; no more than `task_limit`, the
    /// task's share of its session's own memory limit where it set one.
    pub(crate) fn new(
        shelf: Arc<BlockShelf>,
        query: &str,
        budget: u64,
        slots: usize,
        task_limit: Option<u64>,
    ) -> Self {
        let share = (budget / slots.max(1) as u64).max(MIN_TASK_MEMORY);
        let share = task_limit.map_or(share, |limit| share.min(limit));
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

/// The task option that bounds a task's operators on a worker: the session's own memory
/// limit over the cluster's slots, in bytes.
pub(crate) const TASK_MEMORY_LIMIT: &str = "flumen.task_memory_limit";

/// The option a task carries to its worker when the session set a memory limit of its own
/// (`datafusion.runtime.memory_limit`): that limit over the `cluster_slots` tasks the
/// cluster's workers run at once, so that the query's operators on the workers together
/// stay within it, as they do on the driver. `None` when the session set none (its
/// operators then share flumen's budget, which the task carries as `flumen.memory_budget`).
pub(crate) fn task_memory_limit(
    session: &TaskContext,
    cluster_slots: usize,
) -> Option<(String, String)> {
    match session.runtime_env().memory_pool.memory_limit() {
        MemoryLimit::Finite(bytes) => Some((
            TASK_MEMORY_LIMIT.to_string(),
            (bytes / cluster_slots.max(1)).to_string(),
        )),
        MemoryLimit::Infinite | MemoryLimit::Unknown => None,
    }
}

/// The bound on a task's operators that its `options` carry, in bytes; `None` when they
/// carry none.
pub(crate) fn carried_task_limit(options: &[(String, String)]) -> Option<u64> {
    let (_, limit) = options.iter().find(|(key, _)| key == TASK_MEMORY_LIMIT)?;
    limit.parse().ok()
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

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::runtime_env::RuntimeEnvBuilder;

    fn share(budget: u64, slots: usize, task_limit: Option<u64>) -> u64 {
        let shelf = Arc::new(BlockShelf::new(budget));
        TaskMemory::new(shelf, "q", budget, slots, task_limit).share
    }

    #[test]
    fn a_task_gets_the_budget_over_the_slots_and_no_more_than_its_limit() {
        assert_eq!(share(1 << 30, 4, None), 1 << 28);
        assert_eq!(share(1 << 20, 4, None), MIN_TASK_MEMORY);
        assert_eq!(share(1 << 30, 4, Some(1 << 20)), 1 << 20);
        assert_eq!(share(1 << 20, 4, Some(256)), 256);
        assert_eq!(share(1 << 30, 4, Some(1 << 40)), 1 << 28);
    }

    #[test]
    fn a_sessions_limit_travels_over_the_clusters_slots_only_when_it_set_one() {
        let unlimited = TaskContext::default();
        assert_eq!(task_memory_limit(&unlimited, 4), None);
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_limit(1 << 20, 1.0)
            .build_arc()
            .unwrap();
        let limited = TaskContext::default().with_runtime(runtime);
        let option = task_memory_limit(&limited, 4).unwrap();
        assert_eq!(
            option,
            (TASK_MEMORY_LIMIT.to_string(), "262144".to_string())
        );
        assert_eq!(carried_task_limit(&[option]), Some(1 << 18));
        assert_eq!(carried_task_limit(&[]), None);
        assert_eq!(task_memory_limit(&limited, 0).unwrap().1, "1048576");
    }
}
