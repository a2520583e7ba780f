//! What a running worker task hands out, in order ([`Produced`]): its blocks as they are
//! cut ([`crate::cluster::worker_tasks`]), signs that it advances and the bounds it
//! tightens ([`crate::cluster::task_watch`]), and its end. The worker turns them into the
//! events of its reply to the driver.

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;
use tokio::sync::mpsc::UnboundedSender;

use crate::cluster::plan_metrics::TaskFigures;
use crate::cluster::sent_bounds::SentBound;

/// What a running task hands out, in order.
#[derive(Debug)]
pub(crate) enum Produced {
    /// An output block and its tag (the output partition it belongs to).
    Block(usize, RecordBatch),
    /// Output rows so far (after each output batch): the task advances.
    Rows(usize),
    /// Bounds its aggregates and TopK sorts tightened since the last they sent
    /// ([`crate::cluster::task_watch`]): the task advances.
    Bounds(Vec<SentBound>),
    /// Its plan did work since the last look, output or not
    /// ([`crate::cluster::task_watch`]): the task advances.
    Advanced,
    /// The task ended: `Ok` with DataFusion's counters of its plan and its models' figures
    /// when it finished, else its error.
    Finished(Result<TaskFigures>),
}

/// Where a running task's [`Produced`] items go.
pub(crate) type ProducedSender = UnboundedSender<Produced>;
