//! A block: the unit of data between operators, one Arrow batch, and what the run records
//! of it (its producer task and place in that task's output, for lineage).

use std::fmt::Debug;
use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;

use crate::plan::graph::OperatorId;

/// Identifier of a block, unique within one query run.
pub type BlockId = u64;

/// One block a task produced.
#[derive(Debug, Clone)]
pub struct Block {
    /// Its id within the run.
    pub id: BlockId,
    /// The operator that produced it.
    pub operator: OperatorId,
    /// The task that produced it (its index in the run).
    pub task: usize,
    /// Its position in that task's output (the same in every run of the task).
    pub seq: usize,
    /// The output partition it belongs to (its consumer's input partition).
    pub tag: usize,
    /// Rows in it.
    pub rows: usize,
    /// Bytes it takes where it lives (0 once lost).
    pub bytes: u64,
}

/// A block's data as a task hands it over: here, or kept by the worker process that made it.
#[derive(Debug)]
pub enum BlockData {
    /// In this process.
    Local(RecordBatch),
    /// In a worker process.
    Held(Arc<dyn HeldBlock>),
}

/// The driver's handle on a block kept by a worker process (implemented by the cluster's
/// worker pool, so that the store needs to know nothing of workers).
#[async_trait::async_trait]
pub trait HeldBlock: Debug + Send + Sync {
    /// The process id of the worker that holds it (on its host).
    fn holder_pid(&self) -> u32;
    /// The driver's number for the worker that holds it (its attachment: unique across
    /// hosts and restarts).
    fn holder_id(&self) -> u64;
    /// Whether that worker is believed alive.
    fn holder_alive(&self) -> bool;
    /// Its data; `None` when it was lost with its worker. The worker then drops it.
    async fn fetch(&self) -> Result<Option<RecordBatch>>;
    /// Tell the worker the block is no longer needed.
    fn release(&self);
    /// Where another worker can fetch it directly.
    fn location(&self) -> HeldAt;
}

/// Where a held block lives, for a worker to fetch it without the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldAt {
    /// The holding worker's `host:port`.
    pub address: String,
    /// Whether that worker speaks TLS.
    pub tls: bool,
    /// The block's key there.
    pub key: String,
}
