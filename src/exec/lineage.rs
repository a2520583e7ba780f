//! Lineage: what produced each block, and recomputing lost blocks from it.
//!
//! Every block records its producer task; every task records what it read (a source split,
//! its input blocks, or a whole input partition). When a reader finds a block missing from
//! the store it re-runs the producer task, fetching that task's inputs the same way, so the
//! recursion goes back only as far as blocks are missing. Re-run outputs that are still
//! needed are put back in the store; the rest are dropped.

use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use futures::FutureExt;
use futures::future::BoxFuture;

use crate::exec::metrics::OperatorStats;
use crate::exec::run::QueryRun;
use crate::exec::task_kind::TaskId;
use crate::exec::task_runner::{InProcess, OnWorker, TaskRunner};
use crate::exec::task_sink::{RecomputeSink, TaskSink};
use crate::exec::task_spec::{TaskPlace, TaskSpec};
use crate::store::block::BlockId;

/// Longest a recompute refused memory waits for a running task to end before it gives up.
const RECOMPUTE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

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

    /// Run task `task` again for its blocks no longer held, and for block `asked` when a
    /// reader asked for one: on a worker of its pool when `on_worker` allows, it ran on one,
    /// that pool is up and the block (or, with none asked, one of the task's blocks) was
    /// lost with its worker; else, a reader having asked, in process. The caller holds the
    /// task's recompute lock.
    pub(super) async fn run_again(
        self: &Arc<Self>,
        task: TaskId,
        asked: Option<BlockId>,
        on_worker: bool,
    ) -> Result<RecomputeSink> {
        let spec = self.spec_again(task).await;
        if let Some(why) = self.graph.operators[spec.operator].runs_again_unlike {
            return Err(DataFusionError::Execution(format!(
                "{}: its blocks were lost, and it cannot be run again alone: {why}",
                spec.describe
            )));
        }
        let mut sink = RecomputeSink::new(self, &spec, asked);
        let outputs = match asked {
            Some(id) => vec![id],
            None => self.state.lock().unwrap().tasks[task].outputs.to_vec(),
        };
        let lost = {
            let lost = self.workers.lost_blocks.lock().unwrap();
            outputs.iter().any(|id| lost.contains(id))
        };
        if let TaskPlace::Worker { pool, .. } = &spec.place
            && lost
            && on_worker
        {
            match OnWorker(Arc::clone(pool)).run(self, &spec, &mut sink).await {
                Ok(None) if sink.lost_ones_back() => {
                    OperatorStats::add(&self.stats(spec.operator).recomputed, 1);
                    return Ok(sink);
                }
                Err(e) if sink.diverged() => return Err(e),
                Err(e) => log::info!("{}: on a worker: {e}", sink.describe()),
                Ok(_) => {}
            }
        }
        if asked.is_none() {
            // Nobody waits for these blocks yet: a reader recomputes each when it asks.
            return Ok(sink);
        }
        OperatorStats::add(&self.stats(spec.operator).recomputed, 1);
        self.run_in_process_again(&spec, &mut sink).await?;
        Ok(sink)
    }

    /// Run task `spec` again in process into `sink`. A recompute runs outside the pools'
    /// slots, beside the tasks in them: refused memory (a join's build side beside theirs),
    /// it tries again as soon as one of them has ended since its attempt began, and gives up
    /// when none ended and none is left to end, or none ended for [`RECOMPUTE_WAIT`] (its
    /// caller may be the one task still running: a task refused memory runs again alone).
    async fn run_in_process_again(
        self: &Arc<Self>,
        spec: &TaskSpec,
        sink: &mut RecomputeSink,
    ) -> Result<()> {
        let task = spec.task;
        let mut changes = self.changes.subscribe();
        loop {
            let ended_before = self.state.lock().unwrap().tasks_ended;
            sink.restart();
            let error = match InProcess.run(self, spec, sink).await {
                Err(e) if matches!(e.find_root(), DataFusionError::ResourcesExhausted(_)) => e,
                other => return other.map(|_| ()),
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
        // A block re-homed on the worker that made it again may be lost with that worker
        // too before it is read: then it is made here.
        let mut describe = String::new();
        for on_worker in [true, false] {
            let mut sink = self.run_again(block.task, Some(id), on_worker).await?;
            if let Some(batch) = sink.asked_rows() {
                return Ok(batch);
            }
            if let Some(batch) = self.read_block(id).await? {
                return Ok(batch);
            }
            describe = sink.describe().to_string();
        }
        Err(DataFusionError::Execution(format!(
            "{describe}: block {id} was not among its outputs: the task's output is not \
             deterministic"
        )))
    }
}
