//! Lineage: what produced each block, and recomputing lost blocks from it.
//!
//! Every block records its producer task; every task records what it read (a source split,
//! its input blocks, or a whole input partition). When a reader finds a block missing from
//! the store it re-runs the producer task, fetching that task's inputs the same way, so the
//! recursion goes back only as far as blocks are missing. Re-run outputs that are still
//! needed are put back in the store; the rest are dropped.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use futures::FutureExt;
use futures::future::BoxFuture;

use crate::exec::metrics::OperatorStats;
use crate::exec::run::QueryRun;
use crate::plan::graph::OperatorId;
use crate::store::block::{BlockId, OutputPlace, OutputPlaces};
use crate::store::block_digest;

/// Longest a recompute refused memory waits for a running task to end before it gives up.
const RECOMPUTE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Index of a task within one query run.
pub type TaskId = usize;

/// What a task reads: enough to run it again and get the same blocks.
#[derive(Debug, Clone)]
pub enum TaskKind {
    /// Source split `split` of the task's partition.
    Source {
        /// Split index within the partition.
        split: usize,
    },
    /// These input blocks, in order (a block-wise task).
    Blocks {
        /// Input block ids.
        inputs: Vec<BlockId>,
    },
    /// The whole partition of every input (a per-partition task).
    Partition,
    /// One slice of a per-partition task cut because its partition was too large
    /// ([`crate::plan::partition_slices`]): these blocks of input `input` (its join's build
    /// side), and the whole partition of every other input.
    Slice {
        /// The stage input the slice cuts.
        input: usize,
        /// Its blocks of that input, in order.
        blocks: Vec<BlockId>,
    },
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

impl QueryRun {
    /// The data of block `id`: from where the store says it lives, else recomputed from
    /// its lineage.
    pub(super) fn fetch(self: &Arc<Self>, id: BlockId) -> BoxFuture<'static, Result<RecordBatch>> {
        let run = Arc::clone(self);
        async move {
            match run.read_block(id).await? {
                Some(batch) => Ok(batch),
                None => run.recompute(id).await,
            }
        }
        .boxed()
    }

    /// The data of block `id` where it lives (the store's memory or spill file, or its
    /// worker); `None` when it is not there (lost with its worker, or dropped).
    async fn read_block(self: &Arc<Self>, id: BlockId) -> Result<Option<RecordBatch>> {
        if let Some(batch) = self.take_from_store(id)? {
            return Ok(Some(batch));
        }
        self.fetch_held(id).await
    }

    /// Run task `task` again here for its outputs. A recompute runs outside the pools'
    /// slots, beside the tasks in them: refused memory (a join's build side beside theirs),
    /// it tries again as soon as one of them has ended since its attempt began, and gives up
    /// when none ended and none is left to end, or none ended for [`RECOMPUTE_WAIT`] (its
    /// caller may be the one task still running: a task refused memory runs again alone).
    async fn rerun_for_outputs(
        self: &Arc<Self>,
        task: TaskId,
    ) -> Result<Vec<(usize, usize, RecordBatch)>> {
        let mut changes = self.changes.subscribe();
        loop {
            let ended_before = self.state.lock().unwrap().tasks_ended;
            let error = match self.execute_task(task, true).await {
                Err(e) if matches!(e.find_root(), DataFusionError::ResourcesExhausted(_)) => e,
                other => return other,
            };
            loop {
                {
                    let st = self.state.lock().unwrap();
                    if st.error.is_some() || st.cancelled {
                        return Err(error);
                    }
                    // A task ended since the attempt began (perhaps the last one running):
                    // what it held may be free now.
                    if st.tasks_ended > ended_before {
                        break;
                    }
                    if st.running.iter().sum::<usize>() == 0 {
                        return Err(error);
                    }
                }
                match tokio::time::timeout(RECOMPUTE_WAIT, changes.changed()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) | Err(_) => return Err(error),
                }
            }
            log::info!(
                "flumen: recomputing task {task} again: a task ended since it was refused memory"
            );
        }
    }

    async fn recompute(self: Arc<Self>, id: BlockId) -> Result<RecordBatch> {
        let block = self.block(id).ok_or_else(|| {
            DataFusionError::Internal(format!("flumen has no lineage for block {id}"))
        })?;
        let lock = self.recompute_lock(block.task);
        let _guard = lock.lock().await;
        // Another reader (or a worker's recovery) may have recomputed it while we waited.
        if let Some(batch) = self.read_block(id).await? {
            return Ok(batch);
        }
        // A block lost with its worker: re-run its task on a live worker if we can.
        if self.lost_blocks.lock().unwrap().contains(&id)
            && self.rerun_remote(block.task).await.unwrap_or(false)
            && let Some(batch) = self.fetch_held(id).await?
        {
            return Ok(batch);
        }
        self.lost_blocks.lock().unwrap().remove(&id);
        let op = &self.graph.operators[block.operator];
        OperatorStats::add(&self.stats(block.operator).recomputed, 1);
        let mut outputs = match self.recompute_remote_outputs(block.task).await? {
            Some(outputs) => outputs,
            None => self.rerun_for_outputs(block.task).await?,
        };
        // Matched by place, not `seq`: the run may have interleaved its output partitions
        // differently.
        let mut places = OutputPlaces::default();
        outputs.sort_by_key(|(seq, _, _)| *seq);
        let by_place: HashMap<OutputPlace, RecordBatch> = outputs
            .into_iter()
            .map(|(_, tag, b)| (places.next(tag), b))
            .collect();
        let not_reproduced = |what: &str| {
            DataFusionError::Execution(format!(
                "recomputing block {id} of operator {} ({}) did not reproduce it ({what}): \
                 the task's output is not deterministic",
                block.operator, op.name
            ))
        };
        let mut wanted = None;
        // Put back the task's other outputs that a reader may still ask for.
        for (place, recorded) in OutputPlaces::of(self.task_outputs(block.task)) {
            let batch = by_place.get(&place);
            // A digest is taken of the recomputed rows only where the original has one.
            let again = |b: &RecordBatch| {
                let digest = recorded.digest.and_then(|_| block_digest::digest(b));
                (b.num_rows(), digest)
            };
            if recorded.id == id {
                let batch = batch.ok_or_else(|| not_reproduced("no such block"))?;
                if let Some(how) =
                    block_digest::differs((recorded.rows, recorded.digest), again(batch))
                {
                    return Err(not_reproduced(&how));
                }
                wanted = Some(batch.clone());
            } else if !self.store.is_available(recorded.id)
                && let Some(batch) = batch.filter(|b| {
                    block_digest::differs((recorded.rows, recorded.digest), again(b)).is_none()
                })
            {
                self.store.remove(recorded.id);
                self.restore(&recorded, batch.clone())?;
            }
        }
        wanted.ok_or_else(|| not_reproduced("not among the task's outputs"))
    }
}
