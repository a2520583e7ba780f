//! Source tasks run in worker processes (`SET flumen.workers = 'process'`).
//!
//! A CPU source task's work (its operator's fragment over one source split, with the
//! operator's output exchange on top) is cut out as an ordinary DataFusion plan, encoded with
//! `datafusion-proto` and sent to a worker of the session's [`WorkerPool`]. The worker keeps
//! the blocks; the driver records where each one lives and fetches it over Arrow Flight when
//! a consumer reads it. A block whose worker died is recomputed here from its lineage by
//! running the same plan through the same block cutter ([`plan_blocks`]), so the recomputed
//! block is the lost one. Tasks that cannot be cut out this way (fragments without a source
//! split, plans the codec cannot encode) run on the driver's threads as before.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::block_store::BlockId;
use crate::lineage::{TaskId, TaskKind};
use crate::operators::Operator;
use crate::scheduler::QueryRun;
use crate::split_source::SplitSourceExec;
use crate::stats::OperatorStats;
use crate::worker::plan_blocks;
use crate::worker_pool::{RemoteBlock, WorkerPool, worker_binary};

/// The plan a worker runs for source split `split` of `partition` of `op`; `None` when the
/// fragment has no source split to cut it at.
fn remote_plan(op: &Operator, partition: usize, split: usize) -> Option<Arc<dyn ExecutionPlan>> {
    let mut found = false;
    let plan = Arc::clone(&op.fragment)
        .transform_up(|node| {
            if let Some(source) = node.downcast_ref::<SplitSourceExec>()
                && let Some(scan) = source.split_plan(partition, split)
                && reads_local_files(&scan)
            {
                found = true;
                return Ok(Transformed::yes(scan));
            }
            Ok(Transformed::no(node))
        })
        .ok()?
        .data;
    if !found || plan.output_partitioning().partition_count() != 1 {
        return None;
    }
    match &op.output_split {
        None => Some(plan),
        Some(split) => Some(Arc::new(
            RepartitionExec::try_new(plan, split.clone()).ok()?,
        )),
    }
}

/// Whether `scan` reads local files only: workers are not given the driver's object stores
/// (nor their credentials) yet, so remote tables are read by the driver.
fn reads_local_files(scan: &Arc<dyn ExecutionPlan>) -> bool {
    scan.downcast_ref::<DataSourceExec>()
        .and_then(|s| s.data_source().downcast_ref::<FileScanConfig>())
        .is_some_and(|config| config.object_store_url.as_str().starts_with("file://"))
}

impl QueryRun {
    /// Run source task `task` in a worker process. `Ok(false)`: it cannot run there, run it
    /// here instead.
    pub(crate) async fn execute_remote(self: &Arc<Self>, task: TaskId) -> Result<bool> {
        let Some(slot) = self.worker_slot() else {
            return Ok(false);
        };
        let (op_id, partition, kind) = self.task_identity(task);
        let TaskKind::Source { split } = kind else {
            return Ok(false);
        };
        let op = &self.graph.operators[op_id];
        let Some(plan) = remote_plan(op, partition, split) else {
            return Ok(false);
        };
        let bytes = match datafusion_proto::bytes::physical_plan_to_bytes(Arc::clone(&plan)) {
            Ok(bytes) => bytes,
            Err(e) => {
                log::debug!("operator {op_id} ({}) runs here: {e}", op.name);
                return Ok(false);
            }
        };
        let config = self.config();
        let binary = worker_binary(&config.worker_binary)?;
        let pool = slot.get_or_start(binary, config.worker_processes).await?;
        let describe = format!(
            "task {task} (partition {partition}, split {split}) of flumen operator {op_id} ({})",
            op.name
        );
        let blocks = self.run_on_pool(&pool, op_id, &bytes, &describe).await?;
        OperatorStats::add(&op.stats.remote_tasks, 1);
        self.remote_plans.lock().unwrap().insert(task, plan);
        for (seq, block) in blocks.into_iter().enumerate() {
            self.put_remote_block(task, op_id, partition, seq, block)?;
        }
        Ok(true)
    }

    /// Fetch a block that lives in a worker; `None` when it is not remote or was lost with
    /// its worker. The first loss seen from a worker starts the recovery of everything it
    /// held ([`Self::recover_worker`]).
    pub(crate) async fn fetch_remote(self: &Arc<Self>, id: BlockId) -> Result<Option<RecordBatch>> {
        let Some(block) = self.remote_blocks.lock().unwrap().remove(&id) else {
            return Ok(None);
        };
        let fetched = WorkerPool::fetch(&block).await?;
        if fetched.is_none() {
            self.lost_blocks.lock().unwrap().insert(id);
            if let Some(meta) = self.block_meta(id) {
                OperatorStats::add(&self.graph.operators[meta.operator].stats.blocks_lost, 1);
            }
            self.recover_worker(block.worker.pid);
        }
        Ok(fetched)
    }

    /// A worker died: every block it still held is lost. Re-run their producer tasks at once,
    /// in parallel on the live workers, instead of one by one when each is read.
    fn recover_worker(self: &Arc<Self>, pid: u32) {
        if !self.dead_workers.lock().unwrap().insert(pid) {
            return;
        }
        let lost: Vec<BlockId> = {
            let mut remote = self.remote_blocks.lock().unwrap();
            let ids: Vec<BlockId> = remote
                .iter()
                .filter(|(_, b)| b.worker.pid == pid)
                .map(|(id, _)| *id)
                .collect();
            for id in &ids {
                remote.remove(id);
            }
            ids
        };
        let mut tasks = HashSet::new();
        {
            let mut lost_set = self.lost_blocks.lock().unwrap();
            for id in lost {
                if let Some(meta) = self.block_meta(id) {
                    OperatorStats::add(&self.graph.operators[meta.operator].stats.blocks_lost, 1);
                    tasks.insert(meta.task);
                }
                lost_set.insert(id);
            }
        }
        for task in tasks {
            let run = Arc::clone(self);
            // On the query's runtime: this may be called from an accelerator worker's thread,
            // whose runtime only runs while that worker has a task.
            self.runtime().spawn(async move {
                let lock = run.recompute_lock(task);
                let _guard = lock.lock().await;
                if let Err(e) = run.rerun_remote(task).await {
                    log::warn!(
                        "re-running task {task} on a worker failed ({e}); readers recompute here"
                    );
                }
            });
        }
    }

    /// Re-run remotely run task `task` on a live worker and re-home its lost blocks there.
    /// The caller holds the task's recompute lock. `Ok(false)`: not a remote task.
    pub(crate) async fn rerun_remote(self: &Arc<Self>, task: TaskId) -> Result<bool> {
        let outputs = self.task_outputs(task);
        let lost: Vec<(BlockId, usize)> = {
            let lost_set = self.lost_blocks.lock().unwrap();
            outputs
                .iter()
                .filter(|(id, _)| lost_set.contains(id))
                .map(|(id, meta)| (*id, meta.seq))
                .collect()
        };
        if lost.is_empty() {
            return Ok(true);
        }
        let Some(plan) = self.remote_plans.lock().unwrap().get(&task).cloned() else {
            return Ok(false);
        };
        let Some(slot) = self.worker_slot() else {
            return Ok(false);
        };
        let Some(pool) = slot.current().await else {
            return Ok(false);
        };
        let bytes = datafusion_proto::bytes::physical_plan_to_bytes(plan)?;
        let (op_id, partition, _) = self.task_identity(task);
        let op = &self.graph.operators[op_id];
        let describe = format!(
            "recomputing task {task} (partition {partition}) of flumen operator {op_id} ({})",
            op.name
        );
        let blocks = self.run_on_pool(&pool, op_id, &bytes, &describe).await?;
        OperatorStats::add(&op.stats.recomputed, 1);
        let mut by_seq: HashMap<usize, RemoteBlock> = blocks.into_iter().enumerate().collect();
        let mut lost_set = self.lost_blocks.lock().unwrap();
        let mut remote = self.remote_blocks.lock().unwrap();
        for (id, seq) in lost {
            if let Some(block) = by_seq.remove(&seq) {
                lost_set.remove(&id);
                remote.insert(id, block);
            }
        }
        // Blocks of the new run that no lost block needs.
        for (_, block) in by_seq {
            WorkerPool::release(block);
        }
        Ok(true)
    }

    /// Run an encoded plan on the pool for operator `op_id`, counting its retries and the
    /// pool's restarts.
    async fn run_on_pool(
        &self,
        pool: &Arc<WorkerPool>,
        op_id: usize,
        bytes: &[u8],
        describe: &str,
    ) -> Result<Vec<RemoteBlock>> {
        let config = self.config();
        let (blocks, retries) = pool
            .run_task(
                bytes,
                config.target_block_rows,
                config.max_task_retries,
                describe,
            )
            .await?;
        let op = &self.graph.operators[op_id];
        OperatorStats::add(&op.stats.tasks_retried, retries as u64);
        self.note_restarts(pool);
        Ok(blocks)
    }

    /// Count the pool's worker restarts since this run first used it into the graph's
    /// `workers_restarted` (shown by `EXPLAIN ANALYZE`).
    fn note_restarts(&self, pool: &WorkerPool) {
        let now = pool.restarted();
        let since = *self.restarts_at_start.get_or_init(|| now);
        self.graph
            .workers_restarted
            .fetch_max(now - since, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether block `id` lives in a worker that is still alive.
    pub(crate) fn remote_alive(&self, id: BlockId) -> bool {
        self.remote_blocks
            .lock()
            .unwrap()
            .get(&id)
            .is_some_and(|b| b.worker.is_alive())
    }

    /// Forget where block `id` lived (it was recomputed here, or released); tell its worker.
    pub(crate) fn forget_remote(&self, id: BlockId) {
        if let Some(block) = self.remote_blocks.lock().unwrap().remove(&id) {
            WorkerPool::release(block);
        }
    }

    /// The outputs of a task run remotely, recomputed here from the same plan:
    /// `(seq, tag, block)`. `None` when the task did not run remotely.
    pub(crate) async fn recompute_remote_outputs(
        &self,
        task: TaskId,
    ) -> Result<Option<Vec<(usize, usize, RecordBatch)>>> {
        let Some(plan) = self.remote_plans.lock().unwrap().get(&task).cloned() else {
            return Ok(None);
        };
        let blocks =
            plan_blocks(plan, self.base_context(), self.config().target_block_rows).await?;
        Ok(Some(
            blocks
                .into_iter()
                .enumerate()
                .map(|(seq, (tag, block))| (seq, tag, block))
                .collect(),
        ))
    }

    fn put_remote_block(
        &self,
        task: TaskId,
        op_id: usize,
        partition: usize,
        seq: usize,
        block: RemoteBlock,
    ) -> Result<()> {
        let (rows, bytes, tag) = (block.info.rows, block.info.bytes, block.info.tag);
        let pid = block.worker.pid;
        let id = self.new_block_id();
        let dropped = self.drops_block(op_id, partition, seq, rows, Some(pid));
        if !dropped {
            self.remote_blocks.lock().unwrap().insert(id, block);
        }
        self.record_block(
            id,
            task,
            op_id,
            partition,
            seq,
            tag,
            rows,
            if dropped { 0 } else { bytes },
        );
        Ok(())
    }
}
