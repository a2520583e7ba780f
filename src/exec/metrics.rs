//! Per-operator counters, shown by `EXPLAIN ANALYZE` and by progress displays.

use crate::cluster::on_driver::OnDriver;
use crate::cluster::plan_metrics::CarriedSums;
use crate::store::memory_counters::MemoryCounters;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Counters of one operator, accumulated over every run of its plan.
#[derive(Debug, Default)]
pub struct OperatorStats {
    /// Rows in output blocks.
    pub rows: AtomicU64,
    /// Output blocks.
    pub blocks: AtomicU64,
    /// Bytes of output blocks (as the block store counts them).
    pub bytes: AtomicU64,
    /// Tasks finished.
    pub tasks: AtomicU64,
    /// Tasks running now.
    pub running: AtomicU64,
    /// Nanoseconds tasks spent running.
    pub busy_ns: AtomicU64,
    /// Nanoseconds the operator had a ready task held back by backpressure.
    pub backpressure_ns: AtomicU64,
    /// Most bytes of this operator's output held in the block store at once.
    pub peak_bytes: AtomicU64,
    /// Tasks run again to recompute lost blocks.
    pub recomputed: AtomicU64,
    /// Output blocks spilled to disk.
    pub spilled: AtomicU64,
    /// Tasks run in worker processes.
    pub remote_tasks: AtomicU64,
    /// Those tasks per worker host (the host part of the worker's address).
    pub remote_tasks_by_host: Mutex<BTreeMap<String, u64>>,
    /// Tasks of a worker-mode query that ran on the driver, per reason
    /// ([`OnDriver::name`]).
    pub on_driver: Mutex<BTreeMap<&'static str, u64>>,
    /// DataFusion's counters of its tasks' plans run in workers (pruning, spilling), summed.
    pub worker_plan_metrics: CarriedSums,
    /// Output blocks lost with the worker that held them.
    pub blocks_lost: AtomicU64,
    /// Task attempts retried on another worker after theirs died.
    pub tasks_retried: AtomicU64,
    /// Of the remote tasks, split tasks not sent to their worker: the bounds they started
    /// from ruled out every file of their split
    /// ([`crate::plan::split_pruning::nothing_to_read`]).
    pub tasks_pruned_at_launch: AtomicU64,
    /// Joins whose build side came out empty, so that the splits of this operator's scans
    /// started from `false` ([`crate::plan::build_bounds`]).
    pub empty_build_sides: AtomicU64,
    /// Bounds made from a join's build side (its tasks' summaries of their keys merged, or
    /// `false` for an empty one) that this operator's splits started from
    /// ([`crate::plan::build_bounds`]).
    pub bounds_from_build_sides: AtomicU64,
    /// Tasks whose sort was refused memory to concatenate its batches, run again with their
    /// sorts in pieces.
    pub retried_in_pieces: AtomicU64,
    /// Tasks refused memory beside others, run again alone.
    pub retried_alone: AtomicU64,
    /// Tasks refused memory even alone, run again with sort-merge joins.
    pub merge_join_fallbacks: AtomicU64,
    /// Partitions refused memory, cut into slices of their join's build side.
    pub partitions_sliced: AtomicU64,
    /// Slice tasks those partitions were cut into.
    pub slices: AtomicU64,
    /// Bytes of input blocks its remote tasks fetched straight from the workers holding
    /// them.
    pub input_bytes_by_ticket: AtomicU64,
    /// Bytes of input blocks the driver put into its remote tasks' requests.
    pub input_bytes_via_driver: AtomicU64,
    /// Bytes of its output blocks the driver fetched from the workers holding them (for
    /// the tasks it runs itself, and the query's result).
    pub output_bytes_to_driver: AtomicU64,
    /// Bytes of its output blocks that came back to the driver with their task's reply
    /// (`flumen.carried_output_bytes`), never fetched from a worker.
    pub output_bytes_carried: AtomicU64,
    /// Bytes of output per output partition, for an operator whose output is split (an
    /// exchange's map side): how even the split is.
    pub partition_bytes: Mutex<Vec<u64>>,
    /// What its accelerator workers last reported about how they run (e.g. the batch size
    /// they chose), by name.
    pub model_metrics: Mutex<BTreeMap<String, u64>>,
}

/// A plain copy of [`OperatorStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Rows in output blocks.
    pub rows: u64,
    /// Output blocks.
    pub blocks: u64,
    /// Bytes of output blocks.
    pub bytes: u64,
    /// Tasks finished.
    pub tasks: u64,
    /// Tasks running now.
    pub running: u64,
    /// Nanoseconds tasks spent running.
    pub busy_ns: u64,
    /// Nanoseconds held back by backpressure.
    pub backpressure_ns: u64,
    /// Peak bytes held.
    pub peak_bytes: u64,
    /// Tasks recomputed.
    pub recomputed: u64,
    /// Blocks spilled.
    pub spilled: u64,
    /// Tasks run in worker processes.
    pub remote_tasks: u64,
    /// Tasks of a worker-mode query that ran on the driver.
    pub tasks_on_driver: u64,
    /// Blocks lost with their worker.
    pub blocks_lost: u64,
    /// Task attempts retried after a worker died.
    pub tasks_retried: u64,
    /// Of the remote tasks, split tasks not sent, their split ruled out by their bounds.
    pub tasks_pruned_at_launch: u64,
    /// Joins whose empty build side ruled out this operator's scans.
    pub empty_build_sides: u64,
    /// Bounds made from a join's build side that this operator's splits started from.
    pub bounds_from_build_sides: u64,
    /// Tasks run again with their sorts in pieces after a sort was refused memory.
    pub retried_in_pieces: u64,
    /// Tasks run again alone after being refused memory.
    pub retried_alone: u64,
    /// Tasks run again with sort-merge joins after being refused memory alone.
    pub merge_join_fallbacks: u64,
    /// Partitions cut into slices of their join's build side after being refused memory.
    pub partitions_sliced: u64,
    /// Slice tasks they were cut into.
    pub slices: u64,
    /// Input bytes fetched worker to worker.
    pub input_bytes_by_ticket: u64,
    /// Input bytes sent by the driver.
    pub input_bytes_via_driver: u64,
    /// Output bytes fetched by the driver from workers.
    pub output_bytes_to_driver: u64,
    /// Output bytes carried back with task replies.
    pub output_bytes_carried: u64,
}

impl OperatorStats {
    /// Add `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Count `bytes` of output into output partition `partition` (of `partitions`).
    pub fn observe_partition(&self, partition: usize, partitions: usize, bytes: u64) {
        let mut sizes = self.partition_bytes.lock().unwrap();
        if sizes.len() < partitions {
            sizes.resize(partitions, 0);
        }
        if let Some(size) = sizes.get_mut(partition) {
            *size += bytes;
        }
    }

    /// Bytes of output per output partition (empty when the output is not split).
    pub fn partition_sizes(&self) -> Vec<u64> {
        self.partition_bytes.lock().unwrap().clone()
    }

    /// Keep what an accelerator worker reported after a task (newer figures replace older).
    pub fn observe_model_metrics(&self, metrics: Vec<(String, u64)>) {
        if metrics.is_empty() {
            return;
        }
        let mut held = self.model_metrics.lock().unwrap();
        for (name, value) in metrics {
            // The cache's figures count per call: summed; a worker's are its latest.
            match name.starts_with("model_cache_") {
                true => *held.entry(name).or_default() += value,
                false => {
                    held.insert(name, value);
                }
            }
        }
    }

    /// The accelerator workers' figures, by name.
    pub fn model_metrics(&self) -> BTreeMap<String, u64> {
        self.model_metrics.lock().unwrap().clone()
    }

    /// Count a task of a worker-mode query that ran on the driver for `why`.
    pub fn count_on_driver(&self, why: &OnDriver) {
        *self
            .on_driver
            .lock()
            .unwrap()
            .entry(why.name())
            .or_default() += 1;
    }

    /// Tasks that ran on the driver, per reason.
    pub fn on_driver(&self) -> BTreeMap<&'static str, u64> {
        self.on_driver.lock().unwrap().clone()
    }

    /// Count a task of this operator that ran on a worker of `host`.
    pub fn count_remote_on(&self, host: &str) {
        *self
            .remote_tasks_by_host
            .lock()
            .unwrap()
            .entry(host.to_string())
            .or_default() += 1;
    }

    /// Its tasks run on workers, per host.
    pub fn remote_tasks_by_host(&self) -> BTreeMap<String, u64> {
        self.remote_tasks_by_host.lock().unwrap().clone()
    }

    /// Raise the peak of held bytes to `bytes` if higher.
    pub fn observe_held(&self, bytes: u64) {
        self.peak_bytes.fetch_max(bytes, Ordering::Relaxed);
    }

    /// Read every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            rows: r(&self.rows),
            blocks: r(&self.blocks),
            bytes: r(&self.bytes),
            tasks: r(&self.tasks),
            running: r(&self.running),
            busy_ns: r(&self.busy_ns),
            backpressure_ns: r(&self.backpressure_ns),
            peak_bytes: r(&self.peak_bytes),
            recomputed: r(&self.recomputed),
            spilled: r(&self.spilled),
            remote_tasks: r(&self.remote_tasks),
            tasks_on_driver: self.on_driver.lock().unwrap().values().sum(),
            blocks_lost: r(&self.blocks_lost),
            tasks_retried: r(&self.tasks_retried),
            tasks_pruned_at_launch: r(&self.tasks_pruned_at_launch),
            empty_build_sides: r(&self.empty_build_sides),
            bounds_from_build_sides: r(&self.bounds_from_build_sides),
            retried_in_pieces: r(&self.retried_in_pieces),
            retried_alone: r(&self.retried_alone),
            merge_join_fallbacks: r(&self.merge_join_fallbacks),
            partitions_sliced: r(&self.partitions_sliced),
            slices: r(&self.slices),
            input_bytes_by_ticket: r(&self.input_bytes_by_ticket),
            input_bytes_via_driver: r(&self.input_bytes_via_driver),
            output_bytes_to_driver: r(&self.output_bytes_to_driver),
            output_bytes_carried: r(&self.output_bytes_carried),
        }
    }
}

/// The counters of every run of one plan, owned by its [`FlumenExec`](super::FlumenExec)
/// (the planned operator graph holds none): per operator, and for the whole run.
#[derive(Debug, Default)]
pub struct RunMetrics {
    operators: Vec<Arc<OperatorStats>>,
    /// Most bytes the block store held in memory during any run.
    peak_store: AtomicU64,
    /// Worker processes restarted (after one died) during runs.
    workers_restarted: AtomicU64,
    /// Passes of the scheduler (task creation and launch decisions): one per change it
    /// reacts to (a block produced or read, a task ended or paused, a reader waiting).
    scheduler_passes: AtomicU64,
    /// Workers lost, joined and rejoined during runs (pools attached to a cluster).
    membership: [AtomicU64; 3],
    /// Tasks run on each worker host (the host part of its address).
    tasks_by_host: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
    /// What operator state did under the memory budget (each run's pool counts here).
    pub memory: Arc<MemoryCounters>,
}

impl RunMetrics {
    /// Counters for a graph of `operators` operators, all zero.
    pub fn new(operators: usize) -> Self {
        Self {
            operators: (0..operators).map(|_| Arc::default()).collect(),
            ..Default::default()
        }
    }

    /// The counters of operator `id` (shown by `EXPLAIN ANALYZE`).
    pub fn operator(&self, id: usize) -> &Arc<OperatorStats> {
        &self.operators[id]
    }

    /// Most bytes of output blocks any one operator has produced.
    pub fn most_bytes_produced(&self) -> u64 {
        (self.operators.iter())
            .map(|op| op.bytes.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
    }

    /// Most bytes the block store held in memory during any run.
    pub fn peak_store_bytes(&self) -> u64 {
        self.peak_store.load(Ordering::Relaxed)
    }

    /// Record that the block store held `bytes` in memory.
    pub fn observe_store(&self, bytes: u64) {
        self.peak_store.fetch_max(bytes, Ordering::Relaxed);
    }

    /// Worker processes restarted during runs.
    pub fn workers_restarted(&self) -> u64 {
        self.workers_restarted.load(Ordering::Relaxed)
    }

    /// Raise the count of restarted workers to `total` if higher.
    pub fn observe_workers_restarted(&self, total: u64) {
        self.workers_restarted.fetch_max(total, Ordering::Relaxed);
    }

    /// Workers `[lost, joined, rejoined]` during runs.
    pub fn membership(&self) -> [u64; 3] {
        self.membership
            .each_ref()
            .map(|count| count.load(Ordering::Relaxed))
    }

    /// Raise the counts of workers `[lost, joined, rejoined]` to `totals` where higher.
    pub fn observe_membership(&self, totals: [u64; 3]) {
        for (count, total) in self.membership.iter().zip(totals) {
            count.fetch_max(total, Ordering::Relaxed);
        }
    }

    /// Count a task run on a worker of `host`.
    pub fn count_task_on(&self, host: &str) {
        *self
            .tasks_by_host
            .lock()
            .unwrap()
            .entry(host.to_string())
            .or_default() += 1;
    }

    /// Tasks run on each worker host.
    pub fn tasks_by_host(&self) -> Vec<(String, u64)> {
        let tasks = self.tasks_by_host.lock().unwrap();
        tasks.iter().map(|(host, n)| (host.clone(), *n)).collect()
    }

    /// Scheduler passes during runs.
    pub fn scheduler_passes(&self) -> u64 {
        self.scheduler_passes.load(Ordering::Relaxed)
    }

    /// Count one scheduler pass.
    pub fn count_scheduler_pass(&self) {
        self.scheduler_passes.fetch_add(1, Ordering::Relaxed);
    }
}
