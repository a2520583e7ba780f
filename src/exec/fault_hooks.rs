//! The fault-injection hooks of tests and benches, installed as session extensions:
//! - a [`BlockDropper`] drops chosen blocks from the store right after they are produced,
//!   as if the worker holding them had died, so that lineage recomputes them;
//! - a [`PlanCheckFault`] fails the check that a worker decodes a task's plan as planned
//!   (`plan_checks`) for chosen tasks, after a delay, as a plan that datafusion-proto
//!   carries wrongly fails it in a release build: the task, already sent to its worker,
//!   is stopped there and runs on the driver.

use std::fmt;
use std::sync::Arc;

use crate::plan::graph::OperatorId;

/// What a fault injector sees of a worker task whose plan is about to be checked.
#[derive(Debug, Clone)]
pub struct CheckedTask {
    /// The task's operator.
    pub operator: OperatorId,
    /// The operator's name.
    pub operator_name: String,
    /// The task's partition (a source task's split).
    pub partition: usize,
}

/// Test hook: for each task it returns `Some(delay)` for, the check of the task's plan
/// says "decodes differently" `delay` after the task was placed on a worker (so a task
/// that ran quicker has handed back its blocks by then, which are held and dropped), in
/// every build. Install with `SessionConfig::with_extension`.
#[derive(Clone)]
pub struct PlanCheckFault(pub Arc<CheckFailsAfter>);

/// What a [`PlanCheckFault`] asks of each checked task: after how long its check fails.
pub type CheckFailsAfter = dyn Fn(&CheckedTask) -> Option<std::time::Duration> + Send + Sync;

impl fmt::Debug for PlanCheckFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PlanCheckFault")
    }
}

/// What a fault injector sees of a block when it is produced.
#[derive(Debug, Clone)]
pub struct BlockInfo {
    /// Producer operator id.
    pub operator: OperatorId,
    /// Producer operator's name.
    pub operator_name: String,
    /// Partition of the producer task.
    pub partition: usize,
    /// Position in the producer task's output.
    pub seq: usize,
    /// Rows in the block.
    pub rows: usize,
    /// The worker process that holds it (`flumen.workers = 'process'`), else `None`.
    pub worker_pid: Option<u32>,
    /// Its task's place among the tasks of its partition (the same task in every run of
    /// the same plan over the same data).
    pub task_index: usize,
    /// How long its task had run (less pauses) when the block was made: for a task in a
    /// worker process, whose blocks all arrive when it ends, the task's whole time.
    pub task_elapsed: std::time::Duration,
}

/// Test hook: drops chosen blocks from the store right after they are produced, as if the
/// worker that held them had died. Install with `SessionConfig::with_extension`.
#[derive(Clone)]
pub struct BlockDropper(pub Arc<dyn Fn(&BlockInfo) -> bool + Send + Sync>);

impl fmt::Debug for BlockDropper {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BlockDropper")
    }
}
