//! The streaming batch scheduler: one run of an operator graph.
//!
//! The run's state (under one lock) holds the ready tasks of every operator and the free
//! slots of each pool. Whenever something changes (a block is produced or released, a task
//! ends, an input is asked for) the thread that changed it schedules: it creates the tasks
//! that became ready and launches as many as slots allow, picking the most downstream
//! operator first so blocks drain, and holding back an operator whose unconsumed output is
//! over its share of the memory budget (backpressure). If nothing can make progress, it
//! launches the most downstream ready task anyway, so a run can never stall with idle pools.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::arrow::compute::{BatchCoalescer, concat_batches};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlanProperties;
use datafusion::physical_plan::metrics::Time;
use datafusion::physical_plan::repartition::BatchPartitioner;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{FutureExt, StreamExt, TryStreamExt};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::block_store::{BlockId, BlockStore, Placement, block_bytes};
use crate::config::{ExecMode, FlumenConfig, WorkerMode};
use crate::lineage::{BlockDropper, BlockInfo, BlockMeta, TaskId, TaskKind};
use crate::operators::{OperatorGraph, OperatorId, Pool, TaskShape};
use crate::pools::AcceleratorPool;
use crate::stage_input::{InputExchange, InputProvider, TaskInputs};
use crate::stats::OperatorStats;
use crate::worker::WorkerKind;
use crate::worker_pool::{RemoteBlock, WorkerPoolSlot};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TaskStatus {
    Pending,
    Running,
    Done,
}

#[derive(Debug)]
struct TaskRecord {
    operator: OperatorId,
    partition: usize,
    kind: TaskKind,
    status: TaskStatus,
    outputs: Vec<BlockId>,
    /// Input blocks read, released when the task ends.
    consumed: Vec<BlockId>,
    /// Rows of this task's output blocks not yet released (read by every reader).
    held_rows: u64,
    /// Time spent paused by in-task backpressure (not counted as busy).
    paused_ns: u64,
    /// Resumed to keep the run live: runs to its end without pausing again.
    unpausable: bool,
    /// When the task was launched (for the test hook's [`BlockInfo::task_elapsed`]).
    launched: Option<Instant>,
}

impl TaskRecord {
    fn new(operator: OperatorId, partition: usize, kind: TaskKind) -> Self {
        Self {
            operator,
            partition,
            kind,
            status: TaskStatus::Pending,
            outputs: vec![],
            consumed: vec![],
            held_rows: 0,
            paused_ns: 0,
            unpausable: false,
            launched: None,
        }
    }
}

/// A running task paused by in-task backpressure: it gave up its slot and waits for the
/// scheduler to hand one back.
#[derive(Debug)]
struct PausedTask {
    task: TaskId,
    resume: tokio::sync::oneshot::Sender<()>,
}

#[derive(Debug, Default)]
struct PartitionState {
    /// Tasks of this partition, in output order.
    tasks: Vec<TaskId>,
    /// No more tasks will be added.
    closed: bool,
    /// Index in `tasks` of the first task not launched yet.
    next_launch: usize,
    /// Where a block-wise operator's dispatch stands in its input.
    input: Option<Cursor>,
}

#[derive(Debug, Default)]
struct OperatorState {
    partitions: Vec<PartitionState>,
    /// Every output block in the order produced.
    log: Vec<BlockId>,
    /// Bytes of unreleased output blocks in the store.
    held_bytes: u64,
    /// Rows of unreleased output blocks in the store.
    held_rows: u64,
    running: usize,
    complete: bool,
    /// Barrier operators: tasks created.
    started: bool,
    /// Round-robin position for launching across partitions.
    next_partition: usize,
    /// A task has asked for this operator's blocks (opens the gate of a streamed input).
    demanded: bool,
    /// Running tasks paused because their output is too far ahead of its reader.
    paused: Vec<PausedTask>,
    backpressured_since: Option<Instant>,
}

impl OperatorState {
    fn has_pending(&self) -> bool {
        self.partitions
            .iter()
            .any(|p| p.next_launch < p.tasks.len())
    }
}

/// In which order a reader walks an operator's output.
#[derive(Debug, Clone)]
enum ReadOrder {
    /// Task by task through these partitions, each task's blocks in sequence.
    Tasks { partitions: Vec<usize> },
    /// The first task of each of these partitions, then the second of each, and so on:
    /// the order the scheduler launches them in, so a streaming reader waits least.
    Interleaved { partitions: Vec<usize> },
    /// In the order blocks were produced.
    Arrival,
}

/// A reader's position in one operator's output.
#[derive(Debug, Clone)]
struct Cursor {
    operator: OperatorId,
    order: ReadOrder,
    /// Only blocks with this tag (split outputs).
    tag: Option<usize>,
    part_index: usize,
    task_index: usize,
    out_index: usize,
    log_index: usize,
    /// `Interleaved`: position in each task of the current round, and which have ended.
    round_out: Vec<usize>,
    round_done: Vec<bool>,
    /// The stream reading through this cursor returned an error and ends.
    failed: bool,
}

enum Next {
    Block(BlockId),
    Wait,
    End,
}

#[derive(Debug, Default)]
struct RunState {
    operators: Vec<OperatorState>,
    tasks: Vec<TaskRecord>,
    blocks: HashMap<BlockId, BlockMeta>,
    /// Restored blocks that are removed from the store once read.
    read_once: HashSet<BlockId>,
    error: Option<Arc<DataFusionError>>,
    cancelled: bool,
    running: [usize; 2],
    aborts: Vec<AbortHandle>,
    /// Output partitions opened so far, and how many of them are still being read.
    outputs_opened: usize,
    outputs_open: usize,
    /// Accelerator workers this run may use now: grows towards `flumen.accelerator_slots`
    /// while accelerator tasks wait on busy workers.
    accelerator_target: usize,
    /// Running tasks of streaming operators (they take no slot).
    streaming_running: usize,
    /// Streaming tasks' block readers waiting for a block that is not there yet.
    streaming_waiting: usize,
}

fn pool_index(pool: Pool) -> usize {
    match pool {
        Pool::Cpu => 0,
        Pool::Accelerator => 1,
    }
}

/// One execution of an operator graph.
#[derive(Debug)]
pub struct QueryRun {
    pub(crate) graph: Arc<OperatorGraph>,
    pub(crate) store: BlockStore,
    config: FlumenConfig,
    base: Arc<TaskContext>,
    state: Mutex<RunState>,
    changes: watch::Sender<u64>,
    accelerators: Arc<AcceleratorPool>,
    dropper: Option<Arc<BlockDropper>>,
    handle: tokio::runtime::Handle,
    next_block: AtomicU64,
    recompute_locks: Mutex<HashMap<TaskId, Arc<tokio::sync::Mutex<()>>>>,
    /// `flumen.mode = 'static'`: the most tasks each operator may run at once.
    static_slots: Vec<usize>,
    /// `flumen.workers = 'process'`: the session's worker processes.
    workers: Option<Arc<WorkerPoolSlot>>,
    /// Blocks that live in a worker process, by id.
    pub(crate) remote_blocks: Mutex<HashMap<BlockId, RemoteBlock>>,
    /// Tasks that ran in a worker process (their blocks are recomputed from the same plan).
    pub(crate) remote_tasks: Mutex<HashSet<TaskId>>,
    /// Blocks lost with their worker and not yet recomputed.
    pub(crate) lost_blocks: Mutex<HashSet<BlockId>>,
    /// Worker processes (by pid) whose death this run has handled.
    pub(crate) dead_workers: Mutex<HashSet<u32>>,
    /// Each worker pool's restart count when this run first used it, and the latest seen.
    pub(crate) worker_restarts: Mutex<HashMap<WorkerKind, (u64, u64)>>,
}

/// Where a running task's output blocks go: the store, or (recomputing) back to the caller
/// as `(seq, tag, batch)`.
struct TaskOutput<'a> {
    run: &'a Arc<QueryRun>,
    task: TaskId,
    op_id: OperatorId,
    partition: usize,
    capture: bool,
    /// Blocks emitted so far (the next block's position in the task's output).
    seq: usize,
    captured: Vec<(usize, usize, RecordBatch)>,
}

impl TaskOutput<'_> {
    /// One output block for output partition `tag`.
    fn emit(&mut self, tag: usize, block: RecordBatch) -> Result<()> {
        if block.num_rows() == 0 {
            return Ok(());
        }
        if self.capture {
            self.captured.push((self.seq, tag, block));
        } else {
            let bytes = block_bytes(&block);
            self.run.put_block(
                self.task,
                self.op_id,
                self.partition,
                self.seq,
                tag,
                block,
                bytes,
            )?;
        }
        self.seq += 1;
        Ok(())
    }
}

/// The fixed slots of each operator under `flumen.mode = 'static'`: the CPU slots split
/// evenly over the CPU operators that run tasks (an operator run by the output's consumer
/// counts, since its work takes a core too), at least one each; every accelerator operator
/// may use every accelerator worker.
fn static_slots(graph: &OperatorGraph, config: &FlumenConfig) -> Vec<usize> {
    let cpu_operators = graph
        .operators
        .iter()
        .filter(|op| op.pool == Pool::Cpu)
        .count();
    let per_operator = (config.cpu_slots / cpu_operators.max(1)).max(1);
    graph
        .operators
        .iter()
        .map(|op| match op.pool {
            Pool::Cpu => per_operator,
            Pool::Accelerator => config.accelerator_slots,
        })
        .collect()
}

impl QueryRun {
    /// Start running `graph`: creates the source tasks and launches the first of them.
    pub fn start(graph: Arc<OperatorGraph>, base: Arc<TaskContext>) -> Result<Arc<Self>> {
        let config = base
            .session_config()
            .options()
            .extensions
            .get::<FlumenConfig>()
            .cloned()
            .unwrap_or_default();
        if config.cpu_slots == 0 || config.accelerator_slots == 0 {
            return Err(DataFusionError::Configuration(
                "flumen.cpu_slots and flumen.accelerator_slots must be at least 1".into(),
            ));
        }
        let accelerators = base
            .session_config()
            .get_extension::<AcceleratorPool>()
            .unwrap_or_default();
        let min_accel = config
            .accelerator_min_slots
            .clamp(1, config.accelerator_slots);
        accelerators.configure(min_accel, Duration::from_secs(config.accelerator_idle_secs));
        let accelerator_target = if config.mode == ExecMode::Static {
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
        let static_slots = static_slots(&graph, &config);
        let workers = (config.workers == WorkerMode::Process).then(|| {
            base.session_config()
                .get_extension::<WorkerPoolSlot>()
                .unwrap_or_default()
        });
        let run = Arc::new(Self {
            static_slots,
            store: BlockStore::new(config.memory_budget.0),
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
            workers,
            remote_blocks: Mutex::new(HashMap::new()),
            remote_tasks: Mutex::new(HashSet::new()),
            lost_blocks: Mutex::new(HashSet::new()),
            dead_workers: Mutex::new(HashSet::new()),
            worker_restarts: Mutex::new(HashMap::new()),
        });
        run.schedule();
        Ok(run)
    }

    /// Wake every reader waiting on the run (they re-check what they wait for).
    fn notify(&self) {
        self.changes.send_modify(|v| *v += 1);
    }

    /// Something the scheduler decides on changed (a block produced or released, a task
    /// ended, an input asked for): schedule at once on this thread, then wake the readers
    /// (they may wait for what changed, or for tasks created, partitions closed or
    /// operators completed just now).
    /// Scheduling where the change happens costs no thread switch, where a scheduler loop
    /// of its own would be woken (and would wake a runtime thread to launch) per block.
    pub(crate) fn changed(self: &Arc<Self>) {
        self.schedule();
        self.notify();
    }

    /// True when the root operator is run by the consumer of the output (its fragment is
    /// stateful); otherwise the consumer reads the root operator's blocks.
    fn root_runs_in_output(&self) -> bool {
        self.graph.root().shape == TaskShape::Barrier
    }

    /// Create ready tasks and launch (or resume) what slots and memory allow.
    fn schedule(self: &Arc<Self>) {
        self.graph
            .scheduler_passes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut launches = vec![];
        {
            let mut st = self.state.lock().unwrap();
            if st.error.is_some() || st.cancelled {
                return;
            }
            self.create_tasks(&mut st);
            self.pick_launches(&mut st, &mut launches);
        }
        for task in launches {
            self.launch(task);
        }
    }

    fn create_tasks(&self, st: &mut RunState) {
        let root = self.graph.root().id;
        for op in &self.graph.operators {
            if op.id == root && self.root_runs_in_output() {
                continue;
            }
            match op.shape {
                TaskShape::Source => {}
                TaskShape::Barrier => {
                    let ready = self.streams_inputs(op.id)
                        || op.inputs.iter().all(|i| st.operators[*i].complete);
                    if ready && !st.operators[op.id].started {
                        for p in 0..op.partitions() {
                            let id = st.tasks.len();
                            st.tasks
                                .push(TaskRecord::new(op.id, p, TaskKind::Partition));
                            let ps = &mut st.operators[op.id].partitions[p];
                            ps.tasks.push(id);
                            ps.closed = true;
                        }
                        st.operators[op.id].started = true;
                    }
                }
                TaskShape::BlockWise => self.create_block_tasks(st, op.id),
            }
            self.update_complete(st, op.id);
        }
        self.skip_unasked(st);
    }

    /// True when `op`'s tasks start at once and stream a join's probe input; they then run
    /// beside the pool's slots (like the output's reader), paced by the blocks they get.
    /// `flumen.mode = 'batch'` keeps every per-partition operator a barrier.
    fn streams_inputs(&self, op: OperatorId) -> bool {
        self.config.mode != ExecMode::Batch && self.graph.streams_inputs(op)
    }

    /// Whether `op` may start: every streamed input it feeds has been asked for.
    fn gate_open(&self, st: &RunState, op: OperatorId) -> bool {
        self.config.mode == ExecMode::Batch
            || self.graph.gates[op]
                .iter()
                .all(|g| st.operators[*g].demanded)
    }

    /// A join that finished without asking for its probe input (its build side was empty)
    /// never needs the operators feeding it: they count as complete without running.
    fn skip_unasked(&self, st: &mut RunState) {
        for op in &self.graph.operators {
            if st.operators[op.id].complete {
                continue;
            }
            let skipped = self.graph.gates[op.id].iter().any(|g| {
                !st.operators[*g].demanded
                    && self.graph.consumer[*g].is_some_and(|c| st.operators[c].complete)
            });
            if skipped {
                st.operators[op.id].complete = true;
            }
        }
    }

    fn create_block_tasks(&self, st: &mut RunState, op_id: OperatorId) {
        let op = &self.graph.operators[op_id];
        let producer = op.inputs[0];
        if self.config.mode == ExecMode::Batch && !st.operators[producer].complete {
            return;
        }
        let bundle_rows = match op.pool {
            Pool::Accelerator => self.config.target_block_rows.max(1),
            Pool::Cpu => 1,
        };
        for p in 0..op.partitions() {
            if st.operators[op_id].partitions[p].closed {
                continue;
            }
            let mut cursor = st.operators[op_id].partitions[p]
                .input
                .take()
                .unwrap_or_else(|| self.input_cursor(op_id, 0, p, false));
            loop {
                // Gather a bundle on a copy of the cursor; commit it once it may run.
                let mut probe = cursor.clone();
                let mut inputs = vec![];
                let mut rows = 0;
                let mut ended = false;
                while rows < bundle_rows {
                    match Self::next_block(st, &mut probe) {
                        Next::Block(id) => {
                            rows += st.blocks[&id].rows;
                            inputs.push(id);
                        }
                        Next::Wait => break,
                        Next::End => {
                            ended = true;
                            break;
                        }
                    }
                }
                if inputs.is_empty() {
                    if ended {
                        st.operators[op_id].partitions[p].closed = true;
                    }
                    break;
                }
                // A partial bundle waits for more rows while its producer has work left.
                let producer_idle =
                    st.operators[producer].running == 0 && !st.operators[producer].has_pending();
                if rows < bundle_rows && !ended && !producer_idle {
                    break;
                }
                cursor = probe;
                let id = st.tasks.len();
                st.tasks
                    .push(TaskRecord::new(op_id, p, TaskKind::Blocks { inputs }));
                st.operators[op_id].partitions[p].tasks.push(id);
                if ended {
                    st.operators[op_id].partitions[p].closed = true;
                    break;
                }
            }
            st.operators[op_id].partitions[p].input = Some(cursor);
        }
    }

    /// The cursor through which partition `partition` of `op` reads its input `input`.
    /// `deterministic`: read task by task (used once the producer has finished).
    fn input_cursor(
        &self,
        op_id: OperatorId,
        input: usize,
        partition: usize,
        deterministic: bool,
    ) -> Cursor {
        let op = &self.graph.operators[op_id];
        let producer = &self.graph.operators[op.inputs[input]];
        let all: Vec<usize> = (0..producer.partitions()).collect();
        let streamed = deterministic && op.streamed_inputs[input] && self.streams_inputs(op_id);
        let (order, tag) = match &op.input_exchanges[input] {
            InputExchange::Preserve => (
                ReadOrder::Tasks {
                    partitions: vec![partition],
                },
                None,
            ),
            InputExchange::Gather if streamed && all.len() > 1 => {
                (ReadOrder::Interleaved { partitions: all }, None)
            }
            InputExchange::Gather if all.len() == 1 || deterministic => {
                (ReadOrder::Tasks { partitions: all }, None)
            }
            InputExchange::Gather => (ReadOrder::Arrival, None),
            InputExchange::Split(_) if streamed => {
                (ReadOrder::Interleaved { partitions: all }, Some(partition))
            }
            InputExchange::Split(_) if deterministic => {
                (ReadOrder::Tasks { partitions: all }, Some(partition))
            }
            InputExchange::Split(_) => (ReadOrder::Arrival, Some(partition)),
        };
        Cursor {
            operator: producer.id,
            order,
            tag,
            part_index: 0,
            task_index: 0,
            out_index: 0,
            log_index: 0,
            round_out: vec![],
            round_done: vec![],
            failed: false,
        }
    }

    fn next_block(st: &RunState, cursor: &mut Cursor) -> Next {
        let op = &st.operators[cursor.operator];
        match &cursor.order {
            ReadOrder::Arrival => loop {
                if cursor.log_index < op.log.len() {
                    let id = op.log[cursor.log_index];
                    cursor.log_index += 1;
                    if cursor.tag.is_none_or(|t| st.blocks[&id].tag == t) {
                        return Next::Block(id);
                    }
                } else if op.complete {
                    return Next::End;
                } else {
                    return Next::Wait;
                }
            },
            ReadOrder::Interleaved { partitions } => loop {
                // `task_index` is the round: the round-th task of every partition. Its tasks
                // run at once, so they are read a block from each in turn (always in the
                // same order, waiting for a block rather than skipping ahead, so the order
                // depends only on each task's output); `part_index` is whose turn it is.
                let n = partitions.len();
                if cursor.round_out.len() != n {
                    cursor.round_out = vec![0; n];
                    cursor.round_done = vec![false; n];
                }
                if cursor.round_done.iter().all(|d| *d) {
                    let round = cursor.task_index + 1;
                    let ended = partitions.iter().all(|p| {
                        let ps = &op.partitions[*p];
                        ps.closed && ps.tasks.len() <= round
                    });
                    if ended {
                        return Next::End;
                    }
                    cursor.task_index = round;
                    cursor.part_index = 0;
                    cursor.round_out.iter_mut().for_each(|o| *o = 0);
                    cursor.round_done.iter_mut().for_each(|d| *d = false);
                    continue;
                }
                let i = cursor.part_index % n;
                if cursor.round_done[i] {
                    cursor.part_index = (i + 1) % n;
                    continue;
                }
                let ps = &op.partitions[partitions[i]];
                match ps.tasks.get(cursor.task_index) {
                    Some(task_id) => {
                        match Self::next_in_task(st, *task_id, cursor.tag, &mut cursor.round_out[i])
                        {
                            Next::Block(id) => {
                                cursor.part_index = (i + 1) % n;
                                return Next::Block(id);
                            }
                            Next::End => cursor.round_done[i] = true,
                            Next::Wait => return Next::Wait,
                        }
                    }
                    None if ps.closed => cursor.round_done[i] = true,
                    None => return Next::Wait,
                }
            },
            ReadOrder::Tasks { partitions } => loop {
                let Some(p) = partitions.get(cursor.part_index) else {
                    return Next::End;
                };
                let ps = &op.partitions[*p];
                if let Some(task_id) = ps.tasks.get(cursor.task_index) {
                    match Self::next_in_task(st, *task_id, cursor.tag, &mut cursor.out_index) {
                        Next::End => {
                            cursor.task_index += 1;
                            cursor.out_index = 0;
                        }
                        next => return next,
                    }
                } else if ps.closed {
                    cursor.part_index += 1;
                    cursor.task_index = 0;
                    cursor.out_index = 0;
                } else {
                    return Next::Wait;
                }
            },
        }
    }

    /// The next block (tagged `tag`, if given) of task `task_id` from position `out_index`;
    /// `End` once the task has finished and every block of it was read.
    fn next_in_task(
        st: &RunState,
        task_id: TaskId,
        tag: Option<usize>,
        out_index: &mut usize,
    ) -> Next {
        let task = &st.tasks[task_id];
        while let Some(id) = task.outputs.get(*out_index) {
            *out_index += 1;
            if tag.is_none_or(|t| st.blocks[id].tag == t) {
                return Next::Block(*id);
            }
        }
        if task.status == TaskStatus::Done {
            Next::End
        } else {
            Next::Wait
        }
    }

    fn update_complete(&self, st: &mut RunState, op_id: OperatorId) {
        let os = &st.operators[op_id];
        if os.complete || !os.started && self.graph.operators[op_id].shape != TaskShape::BlockWise {
            return;
        }
        let done = os.partitions.iter().all(|p| {
            p.closed
                && p.tasks
                    .iter()
                    .all(|t| st.tasks[*t].status == TaskStatus::Done)
        });
        if done {
            st.operators[op_id].complete = true;
        }
    }

    /// Operators in launch preference order: most downstream first; a paused task whose
    /// readers caught up resumes before its operator starts another.
    fn pick_launches(&self, st: &mut RunState, launches: &mut Vec<TaskId>) {
        let mut slots = [self.config.cpu_slots, st.accelerator_target];
        let budget = self.store.budget();
        let share = budget / self.graph.operators.len().max(1) as u64;
        let batch = self.config.mode == ExecMode::Batch;
        let now = Instant::now();
        for op in &self.graph.operators {
            if self.streams_inputs(op.id)
                && st.operators[op.id].has_pending()
                && self.gate_open(st, op.id)
            {
                self.take_pending(st, op.id, usize::MAX, launches);
            }
        }
        loop {
            let mut launched = false;
            for op in self.graph.operators.iter().rev() {
                let os = &st.operators[op.id];
                let resumable = self.resumable(st, op.id);
                if !os.has_pending() && resumable.is_none() || !self.gate_open(st, op.id) {
                    continue;
                }
                let pool = pool_index(op.pool);
                let gang = op.gang;
                if op.pool == Pool::Accelerator
                    && st.running[pool] >= slots[pool]
                    && slots[pool] < self.config.accelerator_slots
                {
                    // Tasks wait and every worker is busy: grow the pool by one.
                    slots[pool] += 1;
                    st.accelerator_target = slots[pool];
                    self.accelerators.ensure_workers(slots[pool]);
                }
                if st.running[pool] >= slots[pool] && !(gang && st.running[pool] == 0) {
                    continue;
                }
                if let Some(index) = resumable {
                    self.resume(st, op.id, index, false);
                    launched = true;
                    break;
                }
                if !st.operators[op.id].paused.is_empty() {
                    // Its paused tasks resume before it starts another.
                    continue;
                }
                if self.config.mode == ExecMode::Static
                    && !gang
                    && st.operators[op.id].running >= self.static_slots[op.id]
                {
                    continue;
                }
                if batch {
                    let others_running = st
                        .operators
                        .iter()
                        .enumerate()
                        .any(|(i, o)| i != op.id && o.running > 0);
                    if others_running {
                        continue;
                    }
                } else if self.backpressured(st, op.id, share) {
                    st.operators[op.id].backpressured_since.get_or_insert(now);
                    continue;
                }
                self.end_backpressure(st, op.id, now);
                let n = if gang { usize::MAX } else { 1 };
                self.take_pending(st, op.id, n, launches);
                launched = true;
                break;
            }
            if !launched {
                break;
            }
        }
        // Liveness: never leave every pool idle while a task is ready and nothing else can
        // make progress: no streaming task runs, or every one waits for blocks that no
        // running task will produce. (A streaming task busy with blocks it has will release
        // them, or come to wait, and so reach this rule again.)
        let stalled = self.stalled(st);
        if stalled
            && let Some(op) = self
                .graph
                .operators
                .iter()
                .rev()
                .find(|op| !st.operators[op.id].paused.is_empty())
        {
            // A paused task first: it was started before any pending one, so readers
            // (which read in launch order) are likelier to wait on it.
            self.resume(st, op.id, 0, true);
        } else if stalled
            && let Some(op) = self
                .graph
                .operators
                .iter()
                .rev()
                .find(|op| st.operators[op.id].has_pending() && self.gate_open(st, op.id))
        {
            self.end_backpressure(st, op.id, now);
            let n = if op.gang { usize::MAX } else { 1 };
            self.take_pending(st, op.id, n, launches);
        }
    }

    /// Whether no task can make progress by itself: no slot runs a task, and every
    /// streaming task waits for blocks.
    fn stalled(&self, st: &RunState) -> bool {
        st.running.iter().sum::<usize>() == 0 && st.streaming_waiting >= st.streaming_running
    }

    /// Index in `op`'s paused tasks of one whose readers caught up (its unread output fell
    /// to half the pause threshold), if any.
    fn resumable(&self, st: &RunState, op_id: OperatorId) -> Option<usize> {
        let paused = &st.operators[op_id].paused;
        if paused.is_empty() {
            return None;
        }
        let resume_rows = self.pause_rows(op_id)? / 2;
        paused
            .iter()
            .position(|p| st.tasks[p.task].held_rows <= resume_rows)
    }

    /// Hand a slot back to paused task `index` of `op`. `for_liveness`: it was resumed
    /// because nothing else could make progress, so it runs to its end without pausing.
    fn resume(&self, st: &mut RunState, op_id: OperatorId, index: usize, for_liveness: bool) {
        let paused = st.operators[op_id].paused.remove(index);
        st.running[pool_index(self.graph.operators[op_id].pool)] += 1;
        if for_liveness {
            st.tasks[paused.task].unpausable = true;
        }
        // A task aborted while paused dropped its receiver; its slot is freed when it ends.
        let _ = paused.resume.send(());
    }

    /// Unread rows of its own output at which a running task of `op` pauses (in-task
    /// backpressure), or `None` when its tasks never pause: only CPU tasks in streaming
    /// mode whose output is read as it comes (by a per-block operator, a streamed join
    /// input or the query's reader) do. Half of the output queue's bound, so the tasks of
    /// one operator together stay near it however large a split is.
    fn pause_rows(&self, op_id: OperatorId) -> Option<u64> {
        let op = &self.graph.operators[op_id];
        if self.config.mode != ExecMode::Streaming
            || op.pool != Pool::Cpu
            || self.streams_inputs(op_id)
        {
            return None;
        }
        let limit = self.output_queue_limit(op_id)?;
        Some((limit / 2).max(self.config.target_block_rows.max(1) as u64))
    }

    /// In-task backpressure, as Ray Data's streaming generators pause: a task whose unread
    /// output reached `pause_rows` ([`Self::pause_rows`] of its operator) gives its slot
    /// back and waits until the scheduler resumes it (its readers caught up and a slot is
    /// free), so a split of a million rows does not pile up in the store ahead of a slower
    /// reader.
    async fn pause_while_ahead(self: &Arc<Self>, task: TaskId, pause_rows: u64) {
        let resumed = {
            let mut st = self.state.lock().unwrap();
            let t = &st.tasks[task];
            let op_id = t.operator;
            if t.unpausable || t.held_rows < pause_rows || st.error.is_some() || st.cancelled {
                return;
            }
            let (resume, resumed) = tokio::sync::oneshot::channel();
            st.running[pool_index(Pool::Cpu)] -= 1;
            st.operators[op_id].paused.push(PausedTask { task, resume });
            resumed
        };
        let since = Instant::now();
        // Its slot is free: another task may run in it.
        self.changed();
        let resumed = resumed.await;
        let waited = since.elapsed().as_nanos() as u64;
        let mut st = self.state.lock().unwrap();
        if resumed.is_err() {
            // Not resumed by the scheduler (the run is ending): take the slot back so
            // `task_finished` frees it.
            st.running[pool_index(Pool::Cpu)] += 1;
        }
        st.tasks[task].paused_ns += waited;
        let op = &self.graph.operators[st.tasks[task].operator];
        OperatorStats::add(&op.stats.backpressure_ns, waited);
    }

    fn end_backpressure(&self, st: &mut RunState, op_id: OperatorId, now: Instant) {
        if let Some(since) = st.operators[op_id].backpressured_since.take() {
            OperatorStats::add(
                &self.graph.operators[op_id].stats.backpressure_ns,
                (now - since).as_nanos() as u64,
            );
        }
    }

    /// An operator is held back while its unconsumed output is over its share of the
    /// budget, or the store's memory is full, or its consumer (a per-block operator, or the
    /// query's reader for the root) already has enough input queued to stay busy
    /// ([`queue_limit_rows`]), so memory follows the pipeline's slowest stage, not the
    /// table's size. Operators feeding a per-partition
    /// operator (an all-to-all exchange) are never held back: their blocks spill instead.
    fn backpressured(&self, st: &RunState, op_id: OperatorId, share: u64) -> bool {
        let consumer = self.graph.consumer[op_id].map(|c| &self.graph.operators[c]);
        let feeds_barrier =
            consumer.is_some_and(|c| c.shape == TaskShape::Barrier && c.id != self.graph.root().id);
        if feeds_barrier && !self.feeds_streamed_input(op_id) {
            return false;
        }
        let queue_full = self
            .output_queue_limit(op_id)
            .is_some_and(|limit| st.operators[op_id].held_rows >= limit);
        queue_full
            || st.operators[op_id].held_bytes >= share
            || self.store.memory_bytes() >= self.store.budget()
    }

    /// Whether `op`'s output is a streamed input of its consumer: released as it is read,
    /// so its queue can be bounded.
    fn feeds_streamed_input(&self, op_id: OperatorId) -> bool {
        self.graph.consumer[op_id].is_some_and(|c| {
            self.streams_inputs(c)
                && self.graph.operators[c]
                    .streamed_producers()
                    .any(|p| p == op_id)
        })
    }

    /// The most rows of unread output `op` may queue when its reader consumes blocks as
    /// they come: a per-block consumer, a streamed join input, or the query's reader
    /// ([`Self::queue_limit_rows`]). `None` when its output is read whole by an exchange.
    fn output_queue_limit(&self, op_id: OperatorId) -> Option<u64> {
        let producer_pool = self.graph.operators[op_id].pool;
        match self.graph.consumer[op_id].map(|c| &self.graph.operators[c]) {
            Some(c) if c.shape == TaskShape::BlockWise || self.feeds_streamed_input(op_id) => {
                Some(self.queue_limit_rows(c.pool, producer_pool))
            }
            Some(_) => None,
            // The root's blocks wait for the query's reader, which reads like one CPU slot.
            None if !self.root_runs_in_output() => {
                Some(self.queue_limit_rows(Pool::Cpu, producer_pool))
            }
            None => None,
        }
    }

    /// Rows of unconsumed input that keep a per-block consumer on `consumer` busy while its
    /// producer on `producer` refills the queue: two bundles of `flumen.target_block_rows`
    /// for each slot of either pool (every consumer slot has its next bundle waiting, and
    /// every producer slot may have a task in flight whose blocks land in the queue).
    fn queue_limit_rows(&self, consumer: Pool, producer: Pool) -> u64 {
        let slots = |pool| match pool {
            Pool::Cpu => self.config.cpu_slots,
            Pool::Accelerator => self.config.accelerator_slots,
        };
        let bundles = 2 * (slots(consumer) + slots(producer));
        (bundles * self.config.target_block_rows.max(1)) as u64
    }

    fn take_pending(
        &self,
        st: &mut RunState,
        op_id: OperatorId,
        mut n: usize,
        launches: &mut Vec<TaskId>,
    ) {
        let pool = pool_index(self.graph.operators[op_id].pool);
        let takes_slot = !self.streams_inputs(op_id);
        let partitions = st.operators[op_id].partitions.len();
        let mut idle_rounds = 0;
        while n > 0 && idle_rounds < partitions {
            let p = st.operators[op_id].next_partition % partitions;
            st.operators[op_id].next_partition = (p + 1) % partitions;
            let ps = &mut st.operators[op_id].partitions[p];
            if ps.next_launch < ps.tasks.len() {
                let task = ps.tasks[ps.next_launch];
                ps.next_launch += 1;
                st.tasks[task].status = TaskStatus::Running;
                st.tasks[task].launched = Some(Instant::now());
                st.operators[op_id].running += 1;
                if takes_slot {
                    st.running[pool] += 1;
                } else {
                    st.streaming_running += 1;
                }
                OperatorStats::add(&self.graph.operators[op_id].stats.running, 1);
                launches.push(task);
                n -= 1;
                idle_rounds = 0;
            } else {
                idle_rounds += 1;
            }
        }
    }

    fn launch(self: &Arc<Self>, task: TaskId) {
        let op_id = self.state.lock().unwrap().tasks[task].operator;
        let run = Arc::clone(self);
        let future = async move {
            let started = Instant::now();
            let result = std::panic::AssertUnwindSafe(run.run_task(task))
                .catch_unwind()
                .await;
            let result = match result {
                Ok(r) => r,
                Err(panic) => Err(run.panic_error(task, panic)),
            };
            run.task_finished(task, result, started);
        };
        match self.graph.operators[op_id].pool {
            Pool::Cpu => {
                let handle = self.handle.spawn(future);
                self.state
                    .lock()
                    .unwrap()
                    .aborts
                    .push(handle.abort_handle());
            }
            Pool::Accelerator => self.accelerators.submit(Box::new(move || future.boxed())),
        }
    }

    /// Run a task: in a worker process when the session has them and the task can go there,
    /// else here.
    async fn run_task(self: &Arc<Self>, task: TaskId) -> Result<()> {
        if self.workers.is_some() && self.execute_remote(task).await? {
            return Ok(());
        }
        self.execute_task(task, false).await.map(|_| ())
    }

    /// The session's worker processes, when `flumen.workers = 'process'`.
    pub(crate) fn worker_slot(&self) -> Option<&Arc<WorkerPoolSlot>> {
        self.workers.as_ref()
    }

    /// A task's operator, partition and kind.
    pub(crate) fn task_identity(&self, task: TaskId) -> (OperatorId, usize, TaskKind) {
        let st = self.state.lock().unwrap();
        let t = &st.tasks[task];
        (t.operator, t.partition, t.kind.clone())
    }

    /// The runtime CPU tasks (and background work) run on.
    pub(crate) fn runtime(&self) -> &tokio::runtime::Handle {
        &self.handle
    }

    /// The flumen settings of this run.
    pub(crate) fn config(&self) -> &FlumenConfig {
        &self.config
    }

    /// The context tasks run in (without task inputs).
    pub(crate) fn base_context(&self) -> Arc<TaskContext> {
        Arc::clone(&self.base)
    }

    pub(crate) fn new_block_id(&self) -> BlockId {
        self.next_block.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether the test hook drops this block, made by `task`, as it is produced.
    pub(crate) fn drops_block(
        &self,
        task: TaskId,
        op_id: OperatorId,
        partition: usize,
        seq: usize,
        rows: usize,
        worker_pid: Option<u32>,
    ) -> bool {
        let op = &self.graph.operators[op_id];
        self.dropper.as_ref().is_some_and(|d| {
            let (task_index, task_elapsed) = {
                let st = self.state.lock().unwrap();
                let record = &st.tasks[task];
                let index = st.operators[op_id].partitions[partition]
                    .tasks
                    .iter()
                    .position(|t| *t == task)
                    .unwrap_or(usize::MAX);
                let elapsed = record.launched.map_or(Duration::ZERO, |at| {
                    at.elapsed()
                        .saturating_sub(Duration::from_nanos(record.paused_ns))
                });
                (index, elapsed)
            };
            (d.0)(&BlockInfo {
                operator: op_id,
                operator_name: op.name.clone(),
                partition,
                seq,
                rows,
                worker_pid,
                task_index,
                task_elapsed,
            })
        })
    }

    fn panic_error(&self, task: TaskId, panic: Box<dyn std::any::Any + Send>) -> DataFusionError {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        let (op, partition) = {
            let st = self.state.lock().unwrap();
            (st.tasks[task].operator, st.tasks[task].partition)
        };
        DataFusionError::Execution(format!(
            "task {task} (partition {partition}) of flumen operator {op} ({}) panicked: {message}",
            self.graph.operators[op].name
        ))
    }

    fn task_finished(self: &Arc<Self>, task: TaskId, result: Result<()>, started: Instant) {
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
        op.stats.running.fetch_sub(1, Ordering::Relaxed);
        let busy = started.elapsed().as_nanos() as u64;
        OperatorStats::add(
            &op.stats.busy_ns,
            busy.saturating_sub(st.tasks[task].paused_ns),
        );
        match result {
            Ok(()) => {
                OperatorStats::add(&op.stats.tasks, 1);
                st.tasks[task].status = TaskStatus::Done;
                let mut consumed = std::mem::take(&mut st.tasks[task].consumed);
                if let TaskKind::Blocks { inputs } = &st.tasks[task].kind {
                    consumed.extend(inputs.iter().copied());
                }
                for id in consumed {
                    self.release(&mut st, id);
                }
                self.update_complete(&mut st, op_id);
            }
            Err(e) => {
                if st.error.is_none() {
                    st.error = Some(Arc::new(e));
                }
                for abort in st.aborts.drain(..) {
                    abort.abort();
                }
            }
        }
        drop(st);
        self.changed();
    }

    fn release(&self, st: &mut RunState, id: BlockId) {
        let Some(meta) = st.blocks.get_mut(&id) else {
            return;
        };
        if meta.released {
            return;
        }
        meta.released = true;
        let (op, bytes, task) = (meta.operator, meta.bytes, meta.task);
        let rows = if bytes > 0 { meta.rows as u64 } else { 0 };
        let t = &mut st.tasks[task];
        t.held_rows = t.held_rows.saturating_sub(rows);
        self.store.remove(id);
        self.forget_remote(id);
        let os = &mut st.operators[op];
        os.held_bytes = os.held_bytes.saturating_sub(bytes);
        os.held_rows = os.held_rows.saturating_sub(rows);
    }

    /// Run a task's fragment. Outputs go to the store, or with `capture` (recompute) are
    /// returned as `(seq, tag, batch)`.
    pub(crate) async fn execute_task(
        self: &Arc<Self>,
        task: TaskId,
        capture: bool,
    ) -> Result<Vec<(usize, usize, RecordBatch)>> {
        let (op_id, partition, kind) = {
            let st = self.state.lock().unwrap();
            if st.cancelled {
                return Err(DataFusionError::Execution("query cancelled".into()));
            }
            let t = &st.tasks[task];
            (t.operator, t.partition, t.kind.clone())
        };
        let op = &self.graph.operators[op_id];
        let split = match kind {
            TaskKind::Source { split } => split,
            _ => 0,
        };
        let provider = Arc::new(TaskProvider {
            run: Arc::clone(self),
            task,
            operator: op_id,
            kind,
            record: !capture,
        });
        let context = self.task_context(TaskInputs { provider, split });
        let mut stream = op.fragment.execute(partition, context)?;
        let mut partitioner = match &op.output_split {
            Some(p) => Some(BatchPartitioner::try_new(
                p.clone(),
                Time::new(),
                partition,
                op.fragment.output_partitioning().partition_count(),
            )?),
            None => None,
        };
        let target = self.config.target_block_rows.max(1);
        // A split output goes through one coalescer per output partition, as in
        // DataFusion's RepartitionExec: blocks of `target` rows instead of a sliver per
        // input batch, and string views compacted (a taken slice would otherwise keep
        // every buffer of its input alive and make readers copy its strings again).
        let mut coalescers: Vec<BatchCoalescer> = match &op.output_split {
            Some(split) => (0..split.partition_count())
                .map(|_| BatchCoalescer::new(op.fragment.schema(), target))
                .collect(),
            None => vec![],
        };
        // Recomputing (capture) never pauses: its output goes to the caller, not the store.
        let pause_rows = if capture {
            None
        } else {
            self.pause_rows(op_id)
        };
        let mut out = TaskOutput {
            run: self,
            task,
            op_id,
            partition,
            capture,
            seq: 0,
            captured: vec![],
        };
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            if batch.num_rows() == 0 {
                continue;
            }
            let produced = out.seq;
            match &mut partitioner {
                Some(split) => {
                    for piece in split.partition_iter(batch)? {
                        let (tag, piece) = piece?;
                        let coalescer = &mut coalescers[tag];
                        coalescer.push_batch(piece)?;
                        while let Some(block) = coalescer.next_completed_batch() {
                            out.emit(tag, block)?;
                        }
                    }
                }
                None => {
                    let mut offset = 0;
                    while offset < batch.num_rows() {
                        let len = target.min(batch.num_rows() - offset);
                        out.emit(partition, batch.slice(offset, len))?;
                        offset += len;
                    }
                }
            }
            if !capture && out.seq > produced {
                self.changed();
                if let Some(rows) = pause_rows {
                    self.pause_while_ahead(task, rows).await;
                }
            }
        }
        let produced = out.seq;
        for (tag, coalescer) in coalescers.iter_mut().enumerate() {
            coalescer.finish_buffered_batch()?;
            while let Some(block) = coalescer.next_completed_batch() {
                out.emit(tag, block)?;
            }
        }
        if !capture && out.seq > produced {
            self.changed();
        }
        Ok(out.captured)
    }

    #[allow(clippy::too_many_arguments)]
    fn put_block(
        &self,
        task: TaskId,
        op_id: OperatorId,
        partition: usize,
        seq: usize,
        tag: usize,
        block: RecordBatch,
        bytes: u64,
    ) -> Result<()> {
        let op = &self.graph.operators[op_id];
        let id = self.new_block_id();
        let rows = block.num_rows();
        let dropped = self.drops_block(task, op_id, partition, seq, rows, None);
        let held = if dropped {
            0
        } else {
            if self.store.put(id, block, bytes)? == Placement::Spilled {
                OperatorStats::add(&op.stats.spilled, 1);
            }
            bytes
        };
        self.record_block(id, task, op_id, partition, seq, tag, rows, held);
        Ok(())
    }

    /// Count a produced block and record its lineage; `held`: bytes it keeps (0 if lost).
    /// The caller calls [`Self::changed`] once it has recorded a batch's blocks.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record_block(
        &self,
        id: BlockId,
        task: TaskId,
        op_id: OperatorId,
        _partition: usize,
        seq: usize,
        tag: usize,
        rows: usize,
        held: u64,
    ) {
        let op = &self.graph.operators[op_id];
        self.graph.observe_store(self.store.memory_bytes());
        OperatorStats::add(&op.stats.rows, rows as u64);
        OperatorStats::add(&op.stats.bytes, held);
        OperatorStats::add(&op.stats.blocks, 1);
        {
            let mut st = self.state.lock().unwrap();
            st.blocks.insert(
                id,
                BlockMeta {
                    operator: op_id,
                    task,
                    seq,
                    tag,
                    rows,
                    bytes: held,
                    released: false,
                },
            );
            st.tasks[task].outputs.push(id);
            if held > 0 {
                st.tasks[task].held_rows += rows as u64;
            }
            let os = &mut st.operators[op_id];
            os.log.push(id);
            os.held_bytes += held;
            if held > 0 {
                os.held_rows += rows as u64;
            }
            op.stats.observe_held(os.held_bytes);
        }
    }

    fn task_context(&self, inputs: TaskInputs) -> Arc<TaskContext> {
        let base = &self.base;
        let config = base
            .session_config()
            .clone()
            .with_extension(Arc::new(inputs));
        Arc::new(TaskContext::new(
            base.task_id(),
            base.session_id(),
            config,
            base.scalar_functions().clone(),
            base.higher_order_functions().clone(),
            base.aggregate_functions().clone(),
            base.window_functions().clone(),
            base.runtime_env(),
        ))
    }

    /// The stream of blocks a cursor walks, waiting for blocks still to come.
    fn block_stream(
        self: &Arc<Self>,
        cursor: Cursor,
        reader: Reader,
        schema: datafusion::arrow::datatypes::SchemaRef,
    ) -> SendableRecordBatchStream {
        let rx = self.changes.subscribe();
        let wait_for_complete =
            self.config.mode == ExecMode::Batch && matches!(reader, Reader::Output);
        let state = (Arc::clone(self), cursor, rx, reader);
        let stream =
            futures::stream::unfold(state, move |(run, mut cursor, mut rx, reader)| async move {
                if cursor.failed {
                    return None;
                }
                let mut waiting = false;
                loop {
                    rx.borrow_and_update();
                    let mut asked = false;
                    let mut stalled = false;
                    let next = {
                        let mut st = run.state.lock().unwrap();
                        // Woken while waiting: its wait is not a new one.
                        let rewaiting = std::mem::take(&mut waiting);
                        if rewaiting {
                            st.streaming_waiting -= 1;
                        }
                        if let Some(e) = &st.error {
                            let e = DataFusionError::Shared(Arc::clone(e));
                            drop(st);
                            cursor.failed = true;
                            return Some((Err(e), (run, cursor, rx, reader)));
                        }
                        if st.cancelled {
                            return None;
                        }
                        if !st.operators[cursor.operator].demanded {
                            // Opens the gate of a streamed input: wake the scheduler.
                            st.operators[cursor.operator].demanded = true;
                            asked = true;
                        }
                        let next = if wait_for_complete && !st.operators[cursor.operator].complete {
                            Next::Wait
                        } else {
                            Self::next_block(&st, &mut cursor)
                        };
                        match (&next, &reader) {
                            (Next::Block(id), Reader::Task(task) | Reader::StreamingTask(task)) => {
                                st.tasks[*task].consumed.push(*id)
                            }
                            (Next::Wait, Reader::Task(task) | Reader::StreamingTask(task))
                                if run.streams_inputs(st.tasks[*task].operator) =>
                            {
                                st.streaming_waiting += 1;
                                waiting = true;
                                // Only a wait that begins can bring on a stall: every
                                // other change that can runs the scheduler itself.
                                // (Checking on every wake-up would wake the other
                                // waiting readers, which would wake this one: a spin.)
                                stalled = !rewaiting && run.stalled(&st);
                            }
                            _ => {}
                        }
                        next
                    };
                    if asked || stalled {
                        // A waiting reader with idle pools may need the liveness rule.
                        run.changed();
                    }
                    match next {
                        Next::End => return None,
                        Next::Wait => {
                            let wait = std::time::Duration::from_secs(10);
                            match tokio::time::timeout(wait, rx.changed()).await {
                                Ok(Ok(())) => {}
                                Ok(Err(_)) => return None,
                                Err(_) => log::warn!(
                                    "flumen reader of operator {} ({:?}) waited 10s: {}",
                                    cursor.operator,
                                    cursor.order,
                                    run.describe()
                                ),
                            }
                        }
                        Next::Block(id) => {
                            let batch = run.fetch(id).await;
                            cursor.failed = batch.is_err();
                            if matches!(reader, Reader::Output | Reader::StreamingTask(_)) {
                                run.release(&mut run.state.lock().unwrap(), id);
                                run.changed();
                            }
                            return Some((batch, (run, cursor, rx, reader)));
                        }
                    }
                }
            });
        Box::pin(RecordBatchStreamAdapter::new(schema, stream))
    }

    /// Output partition `partition` of the query.
    pub fn output(self: &Arc<Self>, partition: usize) -> Result<SendableRecordBatchStream> {
        {
            let mut st = self.state.lock().unwrap();
            st.outputs_opened += 1;
            st.outputs_open += 1;
        }
        let root = self.graph.root();
        let stream = if self.root_runs_in_output() {
            let provider = Arc::new(OutputProvider {
                run: Arc::clone(self),
            });
            let context = self.task_context(TaskInputs { provider, split: 0 });
            root.fragment.execute(partition, context)?
        } else {
            let cursor = Cursor {
                operator: root.id,
                order: ReadOrder::Tasks {
                    partitions: vec![partition],
                },
                tag: None,
                part_index: 0,
                task_index: 0,
                out_index: 0,
                log_index: 0,
                round_out: vec![],
                round_done: vec![],
                failed: false,
            };
            self.block_stream(cursor, Reader::Output, root.fragment.schema())
        };
        Ok(Box::pin(OutputStream {
            inner: stream,
            run: Arc::clone(self),
        }))
    }

    /// An output stream was dropped. Once every output partition has been opened and
    /// dropped, the run is cancelled (a consumer that stops early, as `LIMIT` does).
    fn output_closed(&self) {
        let mut st = self.state.lock().unwrap();
        st.outputs_open -= 1;
        let all_opened = st.outputs_opened >= self.graph.root().partitions();
        if st.outputs_open == 0 && all_opened {
            st.cancelled = true;
            for abort in st.aborts.drain(..) {
                abort.abort();
            }
            drop(st);
            self.notify();
        }
    }

    pub(crate) fn block_meta(&self, id: BlockId) -> Option<BlockMeta> {
        self.state.lock().unwrap().blocks.get(&id).cloned()
    }

    pub(crate) fn recompute_lock(&self, task: TaskId) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(
            self.recompute_locks
                .lock()
                .unwrap()
                .entry(task)
                .or_default(),
        )
    }

    /// Read a block from the store; blocks restored by a recompute are read once.
    pub(crate) fn take_from_store(&self, id: BlockId) -> Result<Option<RecordBatch>> {
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
    pub(crate) fn task_outputs(&self, task: TaskId) -> Vec<(BlockId, BlockMeta)> {
        let st = self.state.lock().unwrap();
        st.tasks[task]
            .outputs
            .iter()
            .map(|id| (*id, st.blocks[id].clone()))
            .collect()
    }

    /// Put a recomputed block back; it leaves the store once read.
    pub(crate) fn restore(&self, id: BlockId, batch: RecordBatch, bytes: u64) -> Result<()> {
        self.store.put(id, batch, bytes.max(1))?;
        self.state.lock().unwrap().read_once.insert(id);
        Ok(())
    }

    /// One line per operator: tasks by status, blocks held, completion.
    pub fn describe(&self) -> String {
        let st = self.state.lock().unwrap();
        let mut out = format!(
            "running={:?} store={}B; ",
            st.running,
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
                "op{} {} {:?}: pending={} running={} done={} closed={:?} held={}B complete={}; ",
                op.id,
                op.name,
                op.shape,
                count(TaskStatus::Pending),
                count(TaskStatus::Running),
                count(TaskStatus::Done),
                os.partitions.iter().map(|p| p.closed).collect::<Vec<_>>(),
                os.held_bytes,
                os.complete
            ));
        }
        out
    }
}

/// Who reads a block stream.
#[derive(Debug, Clone, Copy)]
enum Reader {
    /// A task: blocks are released when it finishes.
    Task(TaskId),
    /// A task reading a streamed (probe) input: blocks are released as they are read, so
    /// memory holds only what is in flight; lineage recomputes them if the task must run
    /// again.
    StreamingTask(TaskId),
    /// The same task being recomputed: nothing is recorded.
    Recompute,
    /// The query's output: blocks are released as they are read.
    Output,
}

/// Inputs of one scheduled task.
#[derive(Debug)]
struct TaskProvider {
    run: Arc<QueryRun>,
    task: TaskId,
    operator: OperatorId,
    kind: TaskKind,
    record: bool,
}

impl InputProvider for TaskProvider {
    fn open(&self, input: usize, partition: usize) -> Result<SendableRecordBatchStream> {
        let run = &self.run;
        let op = &run.graph.operators[self.operator];
        let producer = &run.graph.operators[*op.inputs.get(input).ok_or_else(|| {
            DataFusionError::Internal(format!("operator {} has no input {input}", op.id))
        })?];
        let schema = producer.fragment.schema();
        match &self.kind {
            TaskKind::Blocks { inputs } => {
                // A bundle of blocks reaches the fragment as one batch.
                let inputs = inputs.clone();
                let run = Arc::clone(run);
                let batch_schema = Arc::clone(&schema);
                let target = run.config.target_block_rows.max(1);
                let stream = futures::stream::once(async move {
                    let mut batches = Vec::with_capacity(inputs.len());
                    for id in inputs {
                        batches.push(run.fetch(id).await?);
                    }
                    let batch = if batches.len() == 1 {
                        batches.pop().unwrap()
                    } else {
                        concat_batches(&batch_schema, &batches)?
                    };
                    // Hand the fragment batches of at most the target size.
                    let pieces: Vec<Result<RecordBatch>> = (0..batch.num_rows())
                        .step_by(target)
                        .map(|at| Ok(batch.slice(at, target.min(batch.num_rows() - at))))
                        .collect();
                    Ok::<_, DataFusionError>(futures::stream::iter(pieces))
                })
                .try_flatten()
                .boxed();
                Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
            }
            TaskKind::Partition => {
                let cursor = run.input_cursor(self.operator, input, partition, true);
                let reader = if !self.record {
                    Reader::Recompute
                } else if op.streamed_inputs[input] && run.streams_inputs(op.id) {
                    Reader::StreamingTask(self.task)
                } else {
                    Reader::Task(self.task)
                };
                Ok(run.block_stream(cursor, reader, schema))
            }
            TaskKind::Source { .. } => Err(DataFusionError::Internal(format!(
                "source task of operator {} has no stage inputs",
                op.id
            ))),
        }
    }
}

/// Inputs of the root fragment when the output's consumer runs it.
#[derive(Debug)]
struct OutputProvider {
    run: Arc<QueryRun>,
}

impl InputProvider for OutputProvider {
    fn open(&self, input: usize, partition: usize) -> Result<SendableRecordBatchStream> {
        let run = &self.run;
        let root = run.graph.root();
        let producer = &run.graph.operators[root.inputs[input]];
        let cursor = run.input_cursor(root.id, input, partition, false);
        Ok(run.block_stream(cursor, Reader::Output, producer.fragment.schema()))
    }
}

/// The query's output stream; dropping every output stream cancels the run.
struct OutputStream {
    inner: SendableRecordBatchStream,
    run: Arc<QueryRun>,
}

impl futures::Stream for OutputStream {
    type Item = Result<RecordBatch>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.inner.poll_next_unpin(cx)
    }
}

impl datafusion::physical_plan::RecordBatchStream for OutputStream {
    fn schema(&self) -> datafusion::arrow::datatypes::SchemaRef {
        self.inner.schema()
    }
}

impl Drop for OutputStream {
    fn drop(&mut self) {
        self.run.output_closed();
    }
}
