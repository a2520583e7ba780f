//! The scheduler's rules, apart from its bookkeeping: what each execution mode changes
//! ([`ModePolicy`]), and the decisions themselves as plain functions of numbers the run
//! state holds (slots per operator, when a producer is held back, when a task pauses,
//! when the run is stalled), so that each is tested on its own.

use crate::config::ExecMode;
use crate::plan::graph::Pool;

/// What `flumen.mode` changes in the scheduler, in one place.
///
/// - `streaming` (Ray Data's streaming executor): operators run at once, joins stream their
///   probe input, producers are held back by their readers, and CPU tasks pause while
///   their reader is behind.
/// - `static`: as streaming, with a fixed number of slots per operator.
/// - `batch` (stage by stage, as Spark or Ray Data's bulk executor): an operator starts
///   once its producer has finished, one operator runs at a time, and the output is read
///   once complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModePolicy {
    mode: ExecMode,
}

impl ModePolicy {
    /// The policy of `mode`.
    pub fn new(mode: ExecMode) -> Self {
        Self { mode }
    }

    /// Joins may start with the query and stream their probe input as it arrives, and the
    /// operators feeding a streamed input wait until it is asked for.
    pub fn streams_join_inputs(self) -> bool {
        self.mode != ExecMode::Batch
    }

    /// A consumer waits for its producer to finish before it starts, and the query's
    /// reader for the root operator to finish.
    pub fn waits_for_producers(self) -> bool {
        self.mode == ExecMode::Batch
    }

    /// Only one operator runs tasks at a time (no backpressure is needed then).
    pub fn one_operator_at_a_time(self) -> bool {
        self.mode == ExecMode::Batch
    }

    /// Each operator has a fixed number of slots ([`static_slots`]), and the accelerator
    /// pool starts at its full size.
    pub fn fixed_slots(self) -> bool {
        self.mode == ExecMode::Static
    }

    /// Running CPU tasks pause while their unread output is too far ahead of its reader.
    pub fn pauses_tasks(self) -> bool {
        self.mode == ExecMode::Streaming
    }
}

/// The fixed slots of each operator under `flumen.mode = 'static'`, given each operator's
/// pool: each pool's slots split evenly over its operators (at least one each), as fixed
/// pools of tasks and of model workers per operator would be.
pub fn static_slots(pools: &[Pool], cpu_slots: usize, accelerator_slots: usize) -> Vec<usize> {
    let per_operator = |pool: Pool, slots: usize| {
        let operators = pools.iter().filter(|p| **p == pool).count();
        (slots / operators.max(1)).max(1)
    };
    let cpu = per_operator(Pool::Cpu, cpu_slots);
    let accelerator = per_operator(Pool::Accelerator, accelerator_slots);
    pools
        .iter()
        .map(|pool| match pool {
            Pool::Cpu => cpu,
            Pool::Accelerator => accelerator,
        })
        .collect()
}

/// Rows of unconsumed input that keep a per-block consumer busy while its producer refills
/// the queue: a block of `block_rows` for each slot of either pool (every consumer slot has
/// its next bundle waiting, every producer slot may have a task in flight whose block lands
/// in the queue). Twice as much held a device-bound pipeline's queue at 1 s of device work
/// for no speed, and its peak RSS 1.2–1.3x higher at 10x the rows than at 1x, where the
/// first run never filled it (`docs/benchmarks.md`, issue 25 part 11).
pub fn queue_limit_rows(consumer_slots: usize, producer_slots: usize, block_rows: usize) -> u64 {
    ((consumer_slots + producer_slots) * block_rows.max(1)) as u64
}

/// Unread rows of its own output at which a running task pauses: half its operator's
/// queue bound (so the operator's tasks together stay near it), at least one block.
pub fn pause_rows(queue_limit: u64, block_rows: usize) -> u64 {
    (queue_limit / 2).max(block_rows.max(1) as u64)
}

/// Unread rows at which a paused task may resume: half its pause threshold.
pub fn resume_rows(pause_rows: u64) -> u64 {
    pause_rows / 2
}

/// What the backpressure rule looks at for one producer operator.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProducerLoad {
    /// Its consumer is an all-to-all exchange (whose input spills rather than waits).
    pub feeds_exchange: bool,
    /// Its output is a streamed join input (read as it comes, so its queue is bounded).
    pub feeds_streamed_input: bool,
    /// The most unread rows its reader keeps queued, when its output is read as it comes.
    pub queue_limit: Option<u64>,
    /// Unread rows of its output.
    pub held_rows: u64,
    /// Unread bytes of its output.
    pub held_bytes: u64,
    /// Its share of the memory budget.
    pub share: u64,
    /// Bytes the store holds in memory.
    pub store_bytes: u64,
    /// The store's memory budget.
    pub budget: u64,
}

/// Whether a producer is held back (starts no task): its reader's queue is full, or its
/// unread output is over its share of the budget, or the store's memory is full. A
/// producer feeding an exchange is never held back (its blocks spill instead), unless the
/// exchange streams it.
pub fn held_back(load: &ProducerLoad) -> bool {
    if load.feeds_exchange && !load.feeds_streamed_input {
        return false;
    }
    load.queue_limit
        .is_some_and(|limit| load.held_rows >= limit)
        || load.held_bytes >= load.share
        || load.store_bytes >= load.budget
}

/// Whether no task can make progress by itself: no slot runs a task and every streaming
/// task (a join reading its probe input) waits for blocks. The liveness rule then launches
/// or resumes a task regardless of backpressure.
pub fn stalled(
    running_in_slots: usize,
    streaming_waiting: usize,
    streaming_running: usize,
) -> bool {
    running_in_slots == 0 && streaming_waiting >= streaming_running
}

/// The accelerator slots to use next: one more when every one in use is busy and a task
/// waits, up to `max`.
pub fn grow_accelerators(running: usize, target: usize, max: usize) -> usize {
    if running >= target && target < max {
        target + 1
    } else {
        target
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_differ_only_where_they_should() {
        let streaming = ModePolicy::new(ExecMode::Streaming);
        let batch = ModePolicy::new(ExecMode::Batch);
        let fixed = ModePolicy::new(ExecMode::Static);
        assert!(streaming.streams_join_inputs() && fixed.streams_join_inputs());
        assert!(!batch.streams_join_inputs());
        assert!(batch.waits_for_producers() && batch.one_operator_at_a_time());
        assert!(!streaming.waits_for_producers() && !fixed.one_operator_at_a_time());
        assert!(fixed.fixed_slots() && !streaming.fixed_slots() && !batch.fixed_slots());
        assert!(streaming.pauses_tasks() && !fixed.pauses_tasks() && !batch.pauses_tasks());
    }

    #[test]
    fn static_slots_split_each_pool_over_its_operators() {
        use Pool::*;
        assert_eq!(static_slots(&[Cpu, Accelerator, Cpu], 8, 2), vec![4, 2, 4]);
        // More operators than slots: one each.
        assert_eq!(static_slots(&[Cpu, Cpu, Cpu], 2, 1), vec![1, 1, 1]);
        assert_eq!(static_slots(&[Accelerator], 2, 3), vec![3]);
        assert_eq!(
            static_slots(&[Cpu, Accelerator, Cpu, Accelerator], 2, 2),
            vec![1, 1, 1, 1]
        );
    }

    #[test]
    fn queues_and_pauses_scale_with_slots_and_blocks() {
        assert_eq!(queue_limit_rows(2, 1, 100), 300);
        assert_eq!(queue_limit_rows(1, 1, 0), 2, "a block is at least one row");
        assert_eq!(pause_rows(600, 100), 300);
        assert_eq!(
            pause_rows(100, 8192),
            8192,
            "a task may always finish one block"
        );
        assert_eq!(resume_rows(300), 150);
    }

    #[test]
    fn a_producer_is_held_back_by_its_queue_its_share_or_a_full_store() {
        let free = ProducerLoad {
            queue_limit: Some(1000),
            held_rows: 10,
            held_bytes: 10,
            share: 100,
            store_bytes: 10,
            budget: 1000,
            ..Default::default()
        };
        assert!(!held_back(&free));
        assert!(held_back(&ProducerLoad {
            held_rows: 1000,
            ..free
        }));
        assert!(held_back(&ProducerLoad {
            held_bytes: 100,
            ..free
        }));
        assert!(held_back(&ProducerLoad {
            store_bytes: 1000,
            ..free
        }));
        // Feeding an exchange: never held back, its blocks spill ...
        let over = ProducerLoad {
            held_bytes: 1 << 40,
            feeds_exchange: true,
            ..free
        };
        assert!(!held_back(&over));
        // ... unless the exchange's consumer streams it.
        assert!(held_back(&ProducerLoad {
            feeds_streamed_input: true,
            ..over
        }));
    }

    #[test]
    fn stalled_only_when_nothing_can_move() {
        assert!(stalled(0, 0, 0));
        assert!(stalled(0, 2, 2), "every streaming task waits");
        assert!(!stalled(0, 1, 2), "a streaming task still works");
        assert!(!stalled(1, 2, 2), "a slot runs a task");
    }

    #[test]
    fn accelerators_grow_one_at_a_time_up_to_the_limit() {
        assert_eq!(grow_accelerators(1, 1, 4), 2);
        assert_eq!(grow_accelerators(0, 1, 4), 1, "a free worker: no growth");
        assert_eq!(grow_accelerators(4, 4, 4), 4);
    }
}
