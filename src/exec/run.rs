//! One run of an operator graph: the streaming batch scheduler's state and life.
//!
//! The run's state (under one lock, [`super::state`]) holds the ready tasks of every
//! operator and the free slots of each pool. Whenever something changes (a block is
//! produced or released, a task ends, an input is asked for) the thread that changed it
//! schedules ([`QueryRun::changed`]): it creates the tasks that became ready
//! ([`super::tasks`]) and launches as many as slots allow ([`super::launch`]), by the rules
//! of [`super::policy`]. Tasks run in [`super::task`]; readers walk blocks through
//! [`super::streams`]; a lost block is recomputed by [`super::lineage`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::memory_pool::MemoryLimit;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::logical_expr::ScalarUDF;
use datafusion::physical_plan::empty::EmptyExec;
use futures::FutureExt;
use tokio::sync::watch;

use crate::cluster::worker_pool::WorkerPoolSlot;
use crate::config::{ByteSize, FlumenConfig, WorkerMode};
use crate::exec::accelerator_threads::AcceleratorPool;
use crate::exec::fault_hooks::BlockDropper;
use crate::exec::metrics::{OperatorStats, RunMetrics};
use crate::exec::policy::{self, ModePolicy};
use crate::exec::state::{
    OperatorState, PartitionState, RunState, TaskRecord, TaskStatus, pool_index,
};
use crate::exec::task_kind::{TaskId, TaskKind};
use crate::exec::timeline::{TaskSpan, Timeline};
use crate::exec::worker_run::WorkerRun;
use crate::functions::accelerator_devices;
use crate::plan::graph::{OperatorGraph, OperatorId, Pool, TaskShape};
use crate::plan::merge_join_fallback::as_sort_merge_join;
use crate::plan::stage_input::InputExchange;
use crate::plan::task_bounds::BoundsMade;
use crate::store::block::{Block, BlockId};
use crate::store::block_store::{BlockStore, ReadSoon};
use crate::store::operator_memory::OperatorMemory;

/// The name DataFusion gives a sort's buffer of batches in the memory pool
/// (`ExternalSorter[partition]`), as it appears in a refusal.
const SORT_BUFFER_CONSUMER: &str = "ExternalSorter[";

/// One execution of an operator graph.
#[derive(Debug)]
pub struct QueryRun {
    pub(super) graph: Arc<OperatorGraph>,
    /// Where every block of the run lives.
    pub(super) store: Arc<BlockStore>,
    /// The runtime every task of the run executes in: the session's, with the run's
    /// [`OperatorMemory`] (sharing the store's budget) as its memory pool.
    pub(super) runtime: Arc<RuntimeEnv>,
    /// The counters of this run (and of earlier runs of the same plan).
    pub(super) metrics: Arc<RunMetrics>,
    /// What `flumen.mode` changes.
    pub(super) policy: ModePolicy,
    pub(super) config: FlumenConfig,
    pub(super) base: Arc<TaskContext>,
    pub(super) state: Mutex<RunState>,
    pub(super) changes: watch::Sender<u64>,
    pub(super) accelerators: Arc<AcceleratorPool>,
    pub(super) dropper: Option<Arc<BlockDropper>>,
    pub(super) handle: tokio::runtime::Handle,
    pub(super) next_block: AtomicU64,
    pub(super) recompute_locks: Mutex<HashMap<TaskId, Arc<tokio::sync::Mutex<()>>>>,
    /// `flumen.mode = 'static'`: the most tasks each operator may run at once.
    pub(super) static_slots: Vec<usize>,
    /// `flumen.workers = 'process'`: the session's worker processes, and what the run
    /// keeps of them.
    pub(super) workers: WorkerRun,
    /// When the run started (`flumen.query_timeout_secs` counts from it).
    pub(super) started_at: Instant,
    /// `flumen.timeline_file`: the tasks' spans, written there when the run ends.
    pub(super) timeline: Option<Timeline>,
    /// The bounds of aggregates and TopK sorts the run's ended tasks made, which the
    /// tasks launched after them prune by.
    pub(super) bounds: BoundsMade,
}

impl QueryRun {
    /// Start running `graph`: creates the source tasks and launches the first of them.
    pub fn start(
        graph: Arc<OperatorGraph>,
        metrics: Arc<RunMetrics>,
        base: Arc<TaskContext>,
    ) -> Result<Arc<Self>> {
        let mut config = base
            .session_config()
            .options()
            .extensions
            .get::<FlumenConfig>()
            .cloned()
            .unwrap_or_default();
        if config.cpu_slots == 0 {
            return Err(DataFusionError::Configuration(
                "flumen.cpu_slots must be at least 1".into(),
            ));
        }
        if config.memory_budget.0 == 0 {
            return Err(DataFusionError::Configuration(
                "flumen.memory_budget must be above 0: it is the bytes of blocks held in memory \
                 (beyond it they spill to disk)"
                    .into(),
            ));
        }
        // The accelerator pool's size, resolved once for the run (0: one per GPU); a plan
        // without a model does not ask the CUDA driver.
        config.accelerator_slots = match graph
            .operators
            .iter()
            .any(|op| op.pool == Pool::Accelerator)
        {
            true => accelerator_devices::accelerator_workers(&config),
            false => config.accelerator_slots.max(1),
        };
        let accelerators = base
            .session_config()
            .get_extension::<AcceleratorPool>()
            .unwrap_or_default();
        let min_accel = config
            .accelerator_min_slots
            .clamp(1, config.accelerator_slots);
        accelerators.configure(min_accel, Duration::from_secs(config.accelerator_idle_secs));
        let mode = ModePolicy::new(config.mode);
        let accelerator_target = if mode.fixed_slots() {
            config.accelerator_slots
        } else {
            accelerators
                .workers()
                .clamp(min_accel, config.accelerator_slots)
        };
        accelerators.ensure_workers(accelerator_target);
        let dropper = base.session_config().get_extension::<BlockDropper>();
        let mut state = RunState {
            accelerator_target,
            build_bounds: vec![Default::default(); graph.build_bounds.len()],
            ..Default::default()
        };
        for op in &graph.operators {
            let mut os = OperatorState {
                partitions: (0..op.partitions())
                    .map(|_| PartitionState::default())
                    .collect(),
                ..Default::default()
            };
            if op.shape == TaskShape::Source {
                for (p, splits) in op.splits.iter().enumerate() {
                    for split in 0..*splits {
                        let id = state.tasks.len();
                        state
                            .tasks
                            .push(TaskRecord::new(op.id, p, TaskKind::Source { split }));
                        os.partitions[p].tasks.push(id);
                    }
                    os.partitions[p].closed = true;
                }
                os.started = true;
            }
            state.operators.push(os);
        }
        let (changes, _) = watch::channel(0);
        let pools: Vec<_> = graph.operators.iter().map(|op| op.pool).collect();
        let static_slots = policy::static_slots(&pools, config.cpu_slots, config.accelerator_slots);
        let workers = (config.workers == WorkerMode::Process).then(|| {
            base.session_config()
                .get_extension::<WorkerPoolSlot>()
                .unwrap_or_default()
        });
        let spill_root = (!config.spill_dir.is_empty()).then(|| config.spill_dir.clone().into());
        let store = Arc::new(
            BlockStore::new(config.memory_budget.0)
                .with_heap(
                    config
                        .budget_counts_heap
                        .then(crate::store::process_heap::installed)
                        .flatten(),
                )
                .with_spill_root(spill_root)
                .with_counters(Arc::clone(&metrics.memory))
                .with_read_soon(read_soon(&graph)),
        );
        let operator_memory = Arc::new(OperatorMemory::new(
            Arc::clone(&store),
            Arc::clone(&metrics.memory),
        ));
        // A session given a memory limit of its own (`datafusion.runtime.memory_limit`)
        // keeps its pool; otherwise operators share flumen's budget.
        let runtime = match base.runtime_env().memory_pool.memory_limit() {
            MemoryLimit::Infinite => RuntimeEnvBuilder::from_runtime_env(&base.runtime_env())
                .with_memory_pool(operator_memory)
                .build_arc()?,
            _ => base.runtime_env(),
        };
        let started_at = Instant::now();
        let timeline = (!config.timeline_file.is_empty() && !is_statement(&graph))
            .then(|| Timeline::new(config.timeline_file.clone().into(), started_at, &store));
        let run = Arc::new(Self {
            static_slots,
            store,
            runtime,
            metrics,
            policy: mode,
            graph,
            config,
            base,
            state: Mutex::new(state),
            changes,
            accelerators,
            dropper,
            handle: tokio::runtime::Handle::current(),
            next_block: AtomicU64::new(0),
            recompute_locks: Mutex::new(HashMap::new()),
            workers: WorkerRun::new(workers),
            started_at,
            timeline,
            bounds: BoundsMade::default(),
        });
        run.preload_models(accelerator_target);
        run.schedule();
        Ok(run)
    }

    /// Send each of the first `workers` accelerator workers a job that loads the models the
    /// run's accelerator operators call, ahead of their first task: the load (files, device
    /// context, weights: about half a second for `embed` on a GPU) then overlaps planning's
    /// end and the scan's first blocks instead of following them. A worker that has the
    /// model already does nothing; a load that fails is left for the first task to report.
    /// Tasks that run in worker processes load there, so nothing is loaded here for them.
    /// Nor is a model whose outputs the model-output cache keeps: a query the cache
    /// answers in full loads none.
    fn preload_models(&self, workers: usize) {
        if self.workers.in_use() {
            return;
        }
        let mut udfs: Vec<ScalarUDF> = vec![];
        for op in &self.graph.operators {
            if op.pool == Pool::Accelerator {
                for udf in op.accelerator_udfs() {
                    if !udfs.contains(&udf) {
                        udfs.push(udf);
                    }
                }
            }
        }
        let options = Arc::clone(self.base.session_config().options());
        // A model the cache may answer for entirely is loaded by its first miss, if any.
        udfs.retain(|udf| !crate::plan::model_cache_lookup::cache_may_answer(udf, &options));
        if udfs.is_empty() {
            return;
        }
        for _ in 0..workers {
            let (udfs, options) = (udfs.clone(), Arc::clone(&options));
            self.accelerators.submit(Box::new(move || {
                for udf in &udfs {
                    let _ = crate::functions::accelerator::preload(udf, &options);
                }
                futures::future::ready(()).boxed()
            }));
        }
    }

    /// Wake every reader waiting on the run (they re-check what they wait for).
    pub(super) fn notify(&self) {
        self.changes.send_modify(|v| *v += 1);
    }

    /// Something the scheduler decides on changed (a block produced or released, a task
    /// ended, an input asked for): schedule at once on this thread, then wake the readers
    /// (they may wait for what changed, or for tasks created, partitions closed or
    /// operators completed just now).
    /// Scheduling where the change happens costs no thread switch, where a scheduler loop
    /// of its own would be woken (and would wake a runtime thread to launch) per block.
    pub(super) fn changed(self: &Arc<Self>) {
        self.schedule();
        self.notify();
    }

    /// True when the root operator is run by the consumer of the output (its fragment is
    /// stateful, and it does not run on the workers: [`OperatorGraph::root_on_workers`]);
    /// otherwise the consumer reads the root operator's blocks.
    pub(super) fn root_runs_in_output(&self) -> bool {
        self.graph.root().shape == TaskShape::Barrier
            && !(self.graph.root_on_workers && self.worker_slot().is_some())
    }

    /// Create ready tasks and launch (or resume) what slots and memory allow.
    pub(super) fn schedule(self: &Arc<Self>) {
        self.metrics.count_scheduler_pass();
        let mut launches = vec![];
        {
            let mut st = self.state.lock().unwrap();
            if st.error.is_some() || st.cancelled {
                return;
            }
            self.create_tasks(&mut st);
            self.settle_build_bounds(&mut st);
            self.pick_launches(&mut st, &mut launches);
        }
        for task in launches {
            self.launch(task);
        }
    }

    pub(super) fn task_finished(
        self: &Arc<Self>,
        task: TaskId,
        result: Result<()>,
        started: Instant,
    ) {
        let mut st = self.state.lock().unwrap();
        let op_id = st.tasks[task].operator;
        let op = &self.graph.operators[op_id];
        let pool = pool_index(op.pool);
        if self.streams_inputs(op_id) {
            st.streaming_running -= 1;
        } else {
            st.running[pool] -= 1;
        }
        st.operators[op_id].running -= 1;
        st.tasks_ended += 1;
        self.stats(op_id).running.fetch_sub(1, Ordering::Relaxed);
        let busy = started.elapsed().as_nanos() as u64;
        OperatorStats::add(
            &self.stats(op_id).busy_ns,
            busy.saturating_sub(st.tasks[task].paused_ns),
        );
        if let Some(timeline) = &self.timeline {
            let t = &st.tasks[task];
            let rows = t
                .outputs
                .iter()
                .filter_map(|id| st.blocks.get(id))
                .map(|b| b.rows as u64);
            timeline.record(TaskSpan {
                operator: op_id,
                name: op.name.clone(),
                pool: op.pool,
                task,
                partition: t.partition,
                start: timeline.since_start(started),
                end: timeline.since_start(Instant::now()),
                paused: Duration::from_nanos(t.paused_ns),
                blocks: t.outputs.len(),
                rows: rows.sum(),
                ok: result.is_ok(),
            });
        }
        if st.running_alone == Some(task) {
            st.running_alone = None;
        }
        match result {
            Ok(()) => {
                OperatorStats::add(&self.stats(op_id).tasks, 1);
                st.tasks[task].status = TaskStatus::Done;
                let mut consumed = std::mem::take(&mut st.tasks[task].consumed);
                let slice = match &st.tasks[task].kind {
                    TaskKind::Blocks { inputs } => {
                        consumed.extend(inputs.iter().copied());
                        None
                    }
                    TaskKind::Slice { blocks, .. } => Some(blocks.clone()),
                    TaskKind::Source { .. } | TaskKind::Partition => None,
                };
                if let Some(own) = slice {
                    // Its sibling slices read the same blocks of the other inputs.
                    st.tasks[task].consumed = consumed;
                    consumed = self.finished_slice_inputs(&mut st, task, &own);
                }
                let shared = self.shared_inputs(op_id);
                consumed
                    .retain(|id| (st.blocks.get(id)).is_none_or(|b| !shared.contains(&b.operator)));
                for id in consumed {
                    self.release(&mut st, id);
                }
                self.update_complete(&mut st, op_id);
                if st.operators[op_id].complete {
                    for producer in shared {
                        let made = st.operators[producer].log.to_vec();
                        for id in made {
                            self.release(&mut st, id);
                        }
                    }
                }
            }
            Err(e) if self.retry_alone(&mut st, task, &e) => {}
            Err(e) => {
                if st.error.is_none() {
                    st.error = Some(Arc::new(self.naming_the_budget(e)));
                }
                for abort in st.aborts.drain(..) {
                    abort.abort();
                }
            }
        }
        drop(st);
        // A thread feeding a device goes on to its next task at once; its trim runs beside it.
        // A store counting the heap hands the allocator's idle pages back itself, past a
        // share of the budget: purged here too, every task's allocations came from fresh
        // pages.
        let allocator_too = !self.store.counts_heap();
        if op.pool == Pool::Accelerator {
            crate::store::freed_memory::return_freed_memory_elsewhere(allocator_too);
        } else {
            crate::store::freed_memory::return_freed_memory(allocator_too);
        }
        self.changed();
    }

    /// `error` as the user should read it: DataFusion's own refusals ("Not enough memory to
    /// continue external sort", which names `datafusion.runtime.memory_limit`; "Cannot merge
    /// sorted runs") also name the budget its operators share here, `flumen.memory_budget`,
    /// unless the session set a memory limit of its own.
    pub(super) fn naming_the_budget(&self, error: DataFusionError) -> DataFusionError {
        let own_pool = matches!(
            self.base.runtime_env().memory_pool.memory_limit(),
            MemoryLimit::Infinite
        );
        match error.find_root() {
            DataFusionError::ResourcesExhausted(message)
                if own_pool && !message.contains("flumen.memory_budget") =>
            {
                DataFusionError::ResourcesExhausted(format!(
                    "{message} Here operators share flumen.memory_budget ({}; never less \
                     than {} for operators): raise flumen.memory_budget.",
                    ByteSize(self.store.budget()),
                    ByteSize(crate::store::operator_memory::MIN_OPERATOR_BYTES),
                ))
            }
            _ => error,
        }
    }

    /// Queue task `task`, refused memory (`ResourcesExhausted`), to run again with its sorts
    /// in pieces when a sort's buffer was refused (once), else alone, and
    /// say so. The first refusal runs it again as it was: a hot partition (a skewed key's
    /// join build side) may need most of the budget, which it gets once the tasks beside it
    /// have finished. A second refusal (alone) runs it again with its partitioned hash joins
    /// as sort-merge joins, which spill ([`as_sort_merge_join`]): a hot key larger than the
    /// budget. False when it cannot be: refused a third time or with no hash join to
    /// rewrite, it wrote output (its readers may have it), it streams its inputs beside the
    /// slots, or the run has ended. Its input blocks are still in the store (a task's inputs
    /// are released only when it succeeds).
    fn retry_alone(&self, st: &mut RunState, task: TaskId, error: &DataFusionError) -> bool {
        let t = &st.tasks[task];
        let root = error.find_root();
        let refused = matches!(root, DataFusionError::ResourcesExhausted(_));
        if !refused
            || !t.outputs.is_empty()
            || self.streams_inputs(t.operator)
            || st.cancelled
            || st.error.is_some()
        {
            return false;
        }
        let op_id = t.operator;
        // A sort's own buffer refused: first run again at once, its sorts never
        // concatenating (the usual cause: a sort holding its whole share could not grow by
        // the copy of what it holds). Refused again, it runs alone as below.
        if !t.sorts_in_pieces && root.to_string().contains(SORT_BUFFER_CONSUMER) {
            log::info!(
                "flumen: a sort of task {task} of operator {op_id} ({}) was refused memory; \
                 it runs again with its sorts in pieces: {root}",
                self.graph.operators[op_id].name,
            );
            let t = &mut st.tasks[task];
            t.sorts_in_pieces = true;
            t.status = TaskStatus::Pending;
            t.consumed.clear();
            t.paused_ns = 0;
            st.waiting_in_pieces.push_back(task);
            OperatorStats::add(&self.stats(op_id).retried_in_pieces, 1);
            return true;
        }
        let op = &self.graph.operators[op_id];
        let merge_join = match (t.retried_alone, t.merge_join) {
            (false, _) => false,
            (true, false) if matches!(as_sort_merge_join(&op.fragment), Ok(Some(_))) => true,
            _ => return false,
        };
        let how = if merge_join {
            "even alone; it runs again with sort-merge joins"
        } else {
            "; it runs again alone"
        };
        log::info!(
            "flumen: task {task} of operator {op_id} ({}) was refused memory beside {} other \
             task(s){how}: {}",
            op.name,
            st.running.iter().sum::<usize>(),
            error.find_root()
        );
        let t = &mut st.tasks[task];
        t.retried_alone = true;
        t.merge_join |= merge_join;
        t.status = TaskStatus::Pending;
        t.consumed.clear();
        t.paused_ns = 0;
        st.waiting_alone.push_back(task);
        let stats = self.stats(op_id);
        if merge_join {
            OperatorStats::add(&stats.merge_join_fallbacks, 1);
        } else {
            OperatorStats::add(&stats.retried_alone, 1);
        }
        true
    }

    /// The producers of `op_id` whose every block each of its partitions reads in worker
    /// mode (a gathered input of an operator of several partitions: a `CollectLeft` join's
    /// build side). On the driver its tasks share one read of them (the join's build is
    /// built once); on the workers each task reads them itself, so they are released once
    /// every task of `op_id` is done, not when the first is.
    fn shared_inputs(&self, op_id: OperatorId) -> Vec<OperatorId> {
        let op = &self.graph.operators[op_id];
        if self.worker_slot().is_none() || op.partitions() <= 1 {
            return vec![];
        }
        (op.inputs.iter().zip(&op.input_exchanges))
            .filter(|(_, exchange)| matches!(exchange, InputExchange::Gather))
            .map(|(producer, _)| *producer)
            .collect()
    }

    /// Whether operator `producer`'s blocks are a gathered input that every partition of
    /// a reader reads ([`Self::shared_inputs`]).
    pub(super) fn read_by_many(&self, producer: OperatorId) -> bool {
        (0..self.graph.operators.len()).any(|reader| self.shared_inputs(reader).contains(&producer))
    }

    /// The readers of block `id` are done with it: it leaves the store (and its worker),
    /// unless its task cannot be run again alike (`Operator::runs_again_unlike`) and the
    /// run has workers, whose death may make a reader run again: such a block stays in the
    /// store (spillable, no longer counted as its operator's) until the query ends, for
    /// that reader to read. (In threads mode nothing but the test hook loses a block.)
    pub(super) fn release(&self, st: &mut RunState, id: BlockId) {
        let Some(block) = st.blocks.get(&id) else {
            return;
        };
        if !st.released.insert(id) {
            return;
        }
        let (op, bytes, task) = (block.operator, block.bytes, block.task);
        let rows = if bytes > 0 { block.rows as u64 } else { 0 };
        let t = &mut st.tasks[task];
        t.held_rows = t.held_rows.saturating_sub(rows);
        if !(self.graph.operators[op].runs_again_unlike.is_some() && self.worker_slot().is_some()) {
            self.store.remove(id);
        }
        let os = &mut st.operators[op];
        os.held_bytes = os.held_bytes.saturating_sub(bytes);
        os.held_rows = os.held_rows.saturating_sub(rows);
    }

    /// The counters of operator `op`.
    pub(super) fn stats(&self, op: OperatorId) -> &OperatorStats {
        self.metrics.operator(op)
    }

    /// Tasks that may run at once on `pool`: with a cluster attached, the slots its live
    /// workers announced (a worker that joins adds its own at once); else
    /// `flumen.cpu_slots` / `flumen.accelerator_slots`.
    pub(super) fn pool_slots(&self, pool: Pool) -> usize {
        let configured = match pool {
            Pool::Cpu => self.config.cpu_slots,
            Pool::Accelerator => self.config.accelerator_slots,
        };
        if self.config.cluster.trim().is_empty() {
            return configured;
        }
        self.worker_slot()
            .and_then(|slot| slot.try_current(pool))
            .map_or(configured, |workers| workers.live_slots().max(1))
    }

    /// The session's worker processes, when `flumen.workers = 'process'`.
    pub(super) fn worker_slot(&self) -> Option<&Arc<WorkerPoolSlot>> {
        self.workers.slot.as_ref()
    }

    /// A task's operator, partition and kind.
    pub(super) fn task_identity(&self, task: TaskId) -> (OperatorId, usize, TaskKind) {
        let st = self.state.lock().unwrap();
        let t = &st.tasks[task];
        (t.operator, t.partition, t.kind.clone())
    }

    /// The runtime CPU tasks (and background work) run on.
    pub(super) fn runtime(&self) -> &tokio::runtime::Handle {
        &self.handle
    }

    /// The flumen settings of this run.
    pub(super) fn config(&self) -> &FlumenConfig {
        &self.config
    }

    /// The context tasks run in (without task inputs).
    pub(super) fn base_context(&self) -> Arc<TaskContext> {
        Arc::clone(&self.base)
    }

    /// A fresh block id.
    pub(super) fn new_block_id(&self) -> BlockId {
        self.next_block.fetch_add(1, Ordering::Relaxed)
    }

    /// What the run recorded of block `id` (its lineage).
    pub(super) fn block(&self, id: BlockId) -> Option<Block> {
        self.state.lock().unwrap().blocks.get(&id).cloned()
    }

    /// The lock held while task `task` is recomputed (one recompute per task at a time).
    pub(super) fn recompute_lock(&self, task: TaskId) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(
            self.recompute_locks
                .lock()
                .unwrap()
                .entry(task)
                .or_default(),
        )
    }

    /// Read a block from the store; blocks restored by a recompute are read once.
    pub(super) fn take_from_store(&self, id: BlockId) -> Result<Option<RecordBatch>> {
        let batch = self.store.get(id)?;
        if batch.is_some() {
            let once = self.state.lock().unwrap().read_once.remove(&id);
            if once {
                self.store.remove(id);
            }
        }
        Ok(batch)
    }

    /// The output blocks of a task, with their lineage.
    pub(super) fn task_outputs(&self, task: TaskId) -> Vec<Block> {
        let st = self.state.lock().unwrap();
        st.tasks[task]
            .outputs
            .iter()
            .map(|id| st.blocks[id].clone())
            .collect()
    }

    /// Put a recomputed block back; it leaves the store once read.
    pub(super) fn restore(&self, block: &Block, batch: RecordBatch) -> Result<()> {
        let group = (block.operator, block.tag);
        self.store.put(block.id, batch, block.bytes.max(1), group)?;
        self.state.lock().unwrap().read_once.insert(block.id);
        Ok(())
    }

    /// One line per operator: tasks by status, blocks held, completion.
    pub fn describe(&self) -> String {
        let st = self.state.lock().unwrap();
        let mut out = format!(
            "running={:?} alone={:?} (waiting alone {}, in pieces {}) streaming={} (waiting {}) output_blocked={} stalled={} store={}B; ",
            st.running,
            st.running_alone,
            st.waiting_alone.len(),
            st.waiting_in_pieces.len(),
            st.streaming_running,
            st.streaming_waiting,
            st.output_blocked,
            self.stalled(&st),
            self.store.memory_bytes()
        );
        for op in &self.graph.operators {
            let os = &st.operators[op.id];
            let tasks: Vec<TaskStatus> = os
                .partitions
                .iter()
                .flat_map(|p| p.tasks.iter().map(|t| st.tasks[*t].status))
                .collect();
            let count = |s| tasks.iter().filter(|t| **t == s).count();
            out.push_str(&format!(
                "op{} {} {:?}: pending={} running={} (paused {}) done={} closed={:?} held={}B complete={} demanded={}; ",
                op.id,
                op.name,
                op.shape,
                count(TaskStatus::Pending),
                count(TaskStatus::Running),
                os.paused.len(),
                count(TaskStatus::Done),
                os.partitions.iter().map(|p| p.closed).collect::<Vec<_>>(),
                os.held_bytes,
                os.complete,
                os.demanded
            ));
        }
        out
    }
}

impl Drop for QueryRun {
    /// However the run ended (its answer read, an error, a cancel, a `LIMIT` that stopped
    /// reading), the blocks its tasks left in workers are dropped there, and its timeline
    /// (`flumen.timeline_file`) is written.
    fn drop(&mut self) {
        self.release_worker_blocks();
        if let Some(timeline) = &self.timeline
            && let Err(e) = timeline.write()
        {
            log::warn!("{e}");
        }
    }
}

/// Whether `graph` is a statement's (`SET`, `CREATE TABLE`, ...: one operator over an
/// `EmptyExec`), whose run writes no timeline, so the `SET` after a query does not replace
/// the query's timeline with nothing.
fn is_statement(graph: &OperatorGraph) -> bool {
    matches!(&graph.operators[..], [only] if only.fragment.downcast_ref::<EmptyExec>().is_some())
}

/// The operators whose blocks are read soon after they arrive: those feeding a per-block
/// operator, run sorts included ([`crate::plan::InputReading::reads_soon`]). Blocks of the others wait
/// for a reader that needs its whole input, and are written out first when memory is full.
fn read_soon(graph: &OperatorGraph) -> ReadSoon {
    ReadSoon::new(
        graph
            .consumer
            .iter()
            .map(|c| c.is_some_and(|c| graph.operators[c].input_reading().reads_soon()))
            .collect(),
    )
}
