//! Running one task: its fragment executed over its inputs, its output cut into blocks
//! ([`BlockCutter`]) that go to the store with their lineage, or (recomputing) back to the
//! caller.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use futures::StreamExt;

use crate::cluster::on_driver::OnDriver;
use crate::exec::fault_hooks::BlockInfo;
use crate::exec::metrics::OperatorStats;
use crate::exec::run::QueryRun;
use crate::exec::streams::TaskProvider;
use crate::exec::task_kind::TaskId;
use crate::exec::task_runner::{InProcess, TaskRunner};
use crate::exec::task_sink::{MadeBlock, StoreSink, TaskSink};
use crate::exec::task_spec::{TaskPlace, TaskSpec};
use crate::plan::OperatorId;
use crate::plan::dynamic_filters::{self, OneTask};
use crate::plan::graph::{Pool, RunsAgainUnlike};
use crate::plan::merge_join_fallback::as_sort_merge_join;
use crate::plan::recursive_queries;
use crate::plan::stage_input::{TaskInputs, reads_a_table};
use crate::store::block::{Block, BlockData};
use crate::store::block_memory::compact;
use crate::store::block_store::Placement;
use crate::store::cutter::BlockCutter;

/// Longest a task runs on its runtime thread without yielding it, when its input never makes
/// it wait.
const YIELD_EVERY: Duration = Duration::from_millis(5);

/// Hand the blocks cut from one input batch, each with its output partition, to `sink`
/// (empty ones skipped), then tell it the batch is done. A block cut out of a larger batch
/// is compacted first: it would keep the whole batch alive while counting as its own rows.
fn hand_over(blocks: Vec<(usize, RecordBatch)>, sink: &mut dyn TaskSink) -> Result<()> {
    for (tag, batch) in blocks {
        if batch.num_rows() == 0 {
            continue;
        }
        let (batch, bytes) = compact(batch);
        sink.take(MadeBlock::Local { tag, batch, bytes })?;
    }
    sink.taken();
    Ok(())
}

impl QueryRun {
    /// Run a task for the first time, its blocks to the store: on a worker when the session
    /// has them and the task can go there ([`QueryRun::run_placed`]), else here.
    pub(super) async fn run_task(self: &Arc<Self>, task: TaskId) -> Result<()> {
        let spec = match self.workers.in_use() {
            false => self.task_spec(task, TaskPlace::InProcess(None)),
            true => match self.run_placed(task).await? {
                None => return Ok(()),
                Some(spec) => spec,
            },
        };
        if let TaskPlace::InProcess(Some(why)) = &spec.place {
            self.count_on_driver(task, why);
        }
        let mut sink = StoreSink::new(self, &spec);
        InProcess.run(self, &spec, &mut sink).await.map(|_| ())
    }

    /// Count a worker-mode task that runs here, and say why (at debug level for the
    /// driver's tasks by design, at info for a fallback).
    fn count_on_driver(&self, task: TaskId, why: &OnDriver) {
        let (op_id, partition, _) = self.task_identity(task);
        self.stats(op_id).count_on_driver(why);
        if let Some(slot) = self.worker_slot() {
            slot.tasks_on_driver().count(why);
        }
        let op = &self.graph.operators[op_id].name;
        match why.by_design() {
            true => {
                log::debug!("task {task} (partition {partition}) of {op} runs on the driver: {why}")
            }
            false => {
                log::info!("task {task} (partition {partition}) of {op} runs on the driver: {why}")
            }
        }
    }

    /// `plan` as task `task` runs it, here or on a worker: with bounds of its own for its
    /// aggregates and TopK sorts, and pruning by the bounds the run's tasks had made when
    /// its first run started, the same for every run of it ([`crate::plan::task_bounds`]).
    /// A worker's plan (`on_worker`) is the task's alone, down to its leaves
    /// ([`dynamic_filters::for_worker_task`]).
    pub(super) fn with_task_bounds(
        &self,
        task: TaskId,
        plan: &Arc<dyn ExecutionPlan>,
        on_worker: bool,
    ) -> Result<OneTask> {
        let at_launch = Arc::clone(&self.state.lock().unwrap().tasks[task].bounds_at_launch);
        let at_launch = at_launch.get_or_init(|| self.bounds.at_launch());
        match on_worker {
            true => dynamic_filters::for_worker_task(plan, at_launch),
            false => dynamic_filters::for_one_task(plan, at_launch),
        }
    }

    /// Run a task's fragment here, each block to `sink` as it is cut. A first run records
    /// what the task reads and pauses while it is ahead of its readers.
    pub(super) async fn execute_task(
        self: &Arc<Self>,
        spec: &TaskSpec,
        sink: &mut dyn TaskSink,
    ) -> Result<()> {
        let task = spec.task;
        let first_run = sink.first_run();
        let (op_id, partition, kind) = (spec.operator, spec.partition, spec.kind.clone());
        let (merge_join, sorts_in_pieces, scan_row_filter) = {
            let st = self.state.lock().unwrap();
            if st.cancelled {
                return Err(DataFusionError::Execution("query cancelled".into()));
            }
            let t = &st.tasks[task];
            (
                t.merge_join,
                t.sorts_in_pieces,
                Arc::clone(&t.scan_row_filter),
            )
        };
        let op = &self.graph.operators[op_id];
        // Refused memory even alone: its hash joins become sort-merge joins, which spill.
        let fragment = match merge_join {
            true => as_sort_merge_join(&op.fragment)?.unwrap_or_else(|| Arc::clone(&op.fragment)),
            false => Arc::clone(&op.fragment),
        };
        let fragment = match op.runs_again_unlike {
            Some(RunsAgainUnlike::RecursiveQuery) => recursive_queries::afresh(&fragment)?,
            _ => fragment,
        };
        let one_task = self.with_task_bounds(task, &fragment, false)?;
        // Tasks launched while it runs start from its bounds so far too.
        let _running = self.bounds.running(one_task.filters());
        let fragment = one_task.plan;
        let split = kind.source_split();
        let provider = Arc::new(TaskProvider {
            run: Arc::clone(self),
            task,
            operator: op_id,
            kind,
            record: first_run,
        });
        let inputs = TaskInputs {
            provider,
            split: split.unwrap_or(0),
            scan_row_filter,
            dropping_by: match split {
                Some(_) => self.build_bounds_made_for(op_id),
                None => Default::default(),
            },
            batch_rows: self.input_batch_rows(op_id),
        };
        // A task here in worker mode is one partition of its operator's joins while others
        // may run on workers: it must not wait for their build sides.
        let joins_alone =
            self.workers.in_use() && dynamic_filters::joins_wait_for_every_partition(&fragment);
        let context = self.task_context(
            inputs,
            sorts_in_pieces,
            joins_alone,
            reads_a_table(&fragment),
        );
        let mut stream = fragment.execute(partition, context)?;
        let mut cutter = BlockCutter::new(
            fragment.schema(),
            op.output_split.as_ref(),
            partition,
            fragment.output_partitioning().partition_count(),
            self.graph.piece_rows(op_id),
        )?
        // The first splits of a split scan read small batches: their blocks ramp up.
        .with_ramp(
            self.graph.batching.first_rows_of_task(&op.fragment, split),
            self.graph.batching.piece_rows,
        );
        // A run again never pauses: its output goes back in place of lost blocks.
        let pause_rows = if first_run {
            self.pause_rows(op_id)
        } else {
            None
        };
        // A first run of a join's build producer sums up its keys, for the join's probe scans
        // ([`crate::plan::build_bounds`]); a run again makes what the first run summed up.
        let mut summer = match first_run {
            true => self.key_summer(op_id, &fragment.schema()),
            false => None,
        };
        let mut blocks = vec![];
        let mut ran_since_yield = Instant::now();
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            if let Some(summing) = &mut summer
                && let Err(e) = summing.observe(&batch)
            {
                log::info!("{}: its build keys are not summed up: {e}", spec.describe);
                summer = None;
            }
            cutter.push(batch, &mut blocks)?;
            if !blocks.is_empty() {
                hand_over(std::mem::take(&mut blocks), sink)?;
            }
            // After every batch: its reader may be behind, or an operator nearer the output
            // may wait for this task's slot.
            if let Some(rows) = pause_rows {
                self.pause_while_ahead(task, rows).await;
            }
            // A fragment whose input is always ready (a scan of cached pages) never waits,
            // so the task would hold its runtime thread until it ends; futures queued
            // behind it there (the query's output stream, a consumer's reader) would wait
            // that long for the blocks it has already put. Yielding after every batch
            // instead cost TPC-H q5 1.5x: once per `YIELD_EVERY`.
            if ran_since_yield.elapsed() >= YIELD_EVERY {
                tokio::task::yield_now().await;
                ran_since_yield = Instant::now();
            }
        }
        cutter.finish(&mut blocks)?;
        if !blocks.is_empty() {
            hand_over(blocks, sink)?;
        }
        if let Some(summer) = summer {
            self.keep_key_summary(task, summer, &spec.describe);
        }
        Ok(())
    }

    /// Put a block a task produced where it lives (the store's memory or spill, or its
    /// worker) and record it: one path for local and worker tasks. The test hook may drop
    /// it first, as if its holder had died. The caller calls [`Self::changed`] once it has
    /// put a batch's blocks.
    pub(super) fn put_block(&self, mut block: Block, data: BlockData) -> Result<()> {
        let holder = match &data {
            BlockData::Local(_) => None,
            BlockData::Held(held) => Some(held.holder_pid()),
        };
        if self.drops_block(&block, holder) {
            block.bytes = 0;
        } else {
            match data {
                BlockData::Local(batch) => {
                    let group = (block.operator, block.tag);
                    if self.store.put(block.id, batch, block.bytes, group)? == Placement::Spilled {
                        OperatorStats::add(&self.stats(block.operator).spilled, 1);
                    }
                }
                BlockData::Held(held) => self.store.put_held(block.id, held, block.bytes),
            }
        }
        self.record_block(block);
        Ok(())
    }

    /// Count a produced block and record its lineage; its `bytes` are what it keeps (0 if
    /// lost).
    fn record_block(&self, block: Block) {
        let stats = self.stats(block.operator);
        self.metrics.observe_store(self.store.memory_bytes());
        OperatorStats::add(&stats.rows, block.rows as u64);
        OperatorStats::add(&stats.bytes, block.bytes);
        OperatorStats::add(&stats.blocks, 1);
        if let Some(split) = &self.graph.operators[block.operator].output_split {
            stats.observe_partition(block.tag, split.partition_count(), block.bytes);
        }
        let mut st = self.state.lock().unwrap();
        let held_rows = if block.bytes > 0 {
            block.rows as u64
        } else {
            0
        };
        st.tasks[block.task].outputs.push(block.id, block.tag);
        st.tasks[block.task].held_rows += held_rows;
        let os = &mut st.operators[block.operator];
        os.log.push(block.id, block.tag);
        os.held_bytes += block.bytes;
        os.held_rows += held_rows;
        stats.observe_held(os.held_bytes);
        st.blocks.insert(block.id, block);
    }

    /// Most rows per batch a task of `op` hands its fragment from its stage inputs
    /// ([`TaskInputs::batch_rows`]): the session's batch size for a CPU operator, none for
    /// a model's (its pieces are cut for its forward passes).
    pub(super) fn input_batch_rows(&self, op: OperatorId) -> usize {
        match self.graph.operators[op].pool {
            Pool::Cpu => self.base.session_config().batch_size(),
            Pool::Accelerator => 0,
        }
    }

    /// The context a task's fragment executes in: the session's, with `inputs`, sorts
    /// within the task's share of the budget, and (`sorts_in_pieces`) sorts that never
    /// concatenate their batches.
    ///
    /// `joins_alone`: the task runs one partition of its fragment's hash joins while the
    /// others may run elsewhere (a worker-mode task that runs here), and those joins would
    /// wait for every partition ([`dynamic_filters::joins_wait_for_every_partition`]):
    /// partitions that ran on workers never report to the driver's node, so such a task
    /// waited for ever. Its joins make no dynamic filter then (the context's
    /// `enable_join_dynamic_filter_pushdown` is off): its probe scans read every row the
    /// join would have let them skip, and the answer is the same. (An
    /// `information_schema.df_settings` scan in the same fragment would show the setting
    /// off.)
    ///
    /// Only the context of a task that scans a table (`reads_a_table`) carries the session's
    /// functions: a table's scan may read them as it runs (`information_schema.routines`
    /// lists them from its context, as may a user's own table), while the operators over a
    /// task's input blocks are planned already and never look a function up by name (DataFusion's do not, nor flumen's;
    /// decoding a plan uses the run's own context, [`QueryRun::base_context`]). Copying the
    /// ~400 functions into every task's context, and freeing them after, was a quarter of
    /// the CPU a 20-row block cost (`benches/scheduler.rs`).
    pub(super) fn task_context(
        &self,
        inputs: TaskInputs,
        sorts_in_pieces: bool,
        joins_alone: bool,
        reads_a_table: bool,
    ) -> Arc<TaskContext> {
        let base = &self.base;
        let mut config = base
            .session_config()
            .clone()
            .with_extension(Arc::new(inputs));
        // A sort reserves memory for merging its spill files up front: within the task's
        // share of the budget, or it could never start under a small one.
        let share =
            usize::try_from(self.config.memory_budget.0 / (8 * self.config.cpu_slots as u64))
                .unwrap_or(usize::MAX);
        let execution = &mut config.options_mut().execution;
        execution.sort_spill_reservation_bytes = execution.sort_spill_reservation_bytes.min(share);
        execution.sort_in_place_threshold_bytes = if sorts_in_pieces {
            // Below this size a sort concatenates its batches: never (see `TaskRecord`).
            0
        } else {
            execution.sort_in_place_threshold_bytes.min(share)
        };
        if joins_alone {
            config
                .options_mut()
                .optimizer
                .enable_join_dynamic_filter_pushdown = false;
        }
        Arc::new(TaskContext::new(
            base.task_id(),
            base.session_id(),
            config,
            copied_if(reads_a_table, base.scalar_functions()),
            copied_if(reads_a_table, base.higher_order_functions()),
            copied_if(reads_a_table, base.aggregate_functions()),
            copied_if(reads_a_table, base.window_functions()),
            Arc::clone(&self.runtime),
        ))
    }

    /// Whether the test hook drops `block` as it is produced; `worker_pid`: the worker
    /// that holds it, if any.
    fn drops_block(&self, block: &Block, worker_pid: Option<u32>) -> bool {
        let Some(dropper) = &self.dropper else {
            return false;
        };
        let (partition, task_index, task_elapsed) = {
            let st = self.state.lock().unwrap();
            let record = &st.tasks[block.task];
            let index = st.operators[block.operator].partitions[record.partition]
                .tasks
                .iter()
                .position(|t| *t == block.task)
                .unwrap_or(usize::MAX);
            let elapsed = record.launched.map_or(Duration::ZERO, |at| {
                at.elapsed()
                    .saturating_sub(Duration::from_nanos(record.paused_ns))
            });
            (record.partition, index, elapsed)
        };
        (dropper.0)(&BlockInfo {
            operator: block.operator,
            operator_name: self.graph.operators[block.operator].name.clone(),
            partition,
            seq: block.seq,
            rows: block.rows,
            worker_pid,
            task_index,
            task_elapsed,
        })
    }

    pub(super) fn panic_error(
        &self,
        task: TaskId,
        panic: Box<dyn std::any::Any + Send>,
    ) -> DataFusionError {
        let message = crate::panic_message(&*panic);
        let (op, partition) = {
            let st = self.state.lock().unwrap();
            (st.tasks[task].operator, st.tasks[task].partition)
        };
        DataFusionError::Execution(format!(
            "task {task} (partition {partition}) of flumen operator {op} ({}) panicked: {message}",
            self.graph.operators[op].name
        ))
    }
}

/// A copy of the session's functions `all` where `copy`, none otherwise
/// ([`QueryRun::task_context`]).
fn copied_if<F>(copy: bool, all: &HashMap<String, Arc<F>>) -> HashMap<String, Arc<F>> {
    match copy {
        true => all.clone(),
        false => HashMap::new(),
    }
}
