//! Tasks run in worker processes (`SET flumen.workers = 'process'`).
//!
//! A task's work is cut out as an ordinary DataFusion plan, encoded by
//! [`crate::cluster::task_plan`] (datafusion-proto plus what it drops), checked to decode as
//! it was planned, and sent to a worker of the session's pool for its operator: CPU operators to the CPU
//! workers, accelerator operators (model UDFs) to the accelerator workers, which keep their
//! models loaded. What the plan reads:
//! - a source task: its operator's fragment over its one source split;
//! - a block-wise task: the fragment over its input blocks, as an in-memory scan: the
//!   blocks a worker holds travel as tickets its worker fetches, the driver's inline;
//! - a per-partition task (a join's partition, a final aggregate, a sort, a window): the
//!   fragment with each stage input an in-memory scan of the task's blocks of it, the same
//!   way ([`crate::exec::worker_plans`]).
//!
//! The operator's output exchange goes on top, so a worker splits its output by partition
//! as a local task would. The worker keeps the blocks and announces each as soon as it is
//! cut; the driver records where each lives at once (consumers start while the task runs)
//! and fetches it over Arrow Flight when a consumer reads it. A block whose worker died is
//! recomputed from its lineage by building the same plan again (for a block-wise task, from
//! its input blocks, themselves recomputed if needed) and running it through the same block
//! cutter ([`crate::cluster::worker_tasks::plan_blocks`]), so the recomputed block is the
//! lost one. A retried task's blocks repeat the first attempt's: the driver keeps the first
//! of each. Tasks that cannot be cut out this way (fragments without a source split, a
//! per-partition task over more than its memory share, plans calling a function workers do
//! not have) run on the driver's threads and say why ([`OnDriver`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::config::ExtensionOptions;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::union::UnionExec;

use crate::cluster::admission::{WORKER_OPTIONS, scanned_files, scanned_stores};
use crate::cluster::membership::host_of;
use crate::cluster::on_driver::OnDriver;
use crate::cluster::protocol::{INPUT_LOST, InputTicket, TaskInput, TaskRequest};
use crate::cluster::sent_bounds::{self, HeardBounds, SentBound};
use crate::cluster::sent_keys::SentKeys;
use crate::cluster::task_plan;
use crate::cluster::worker_handle::{TaskFeed, WorkerBlock};
use crate::cluster::worker_memory::task_memory_limit;
use crate::cluster::worker_pool::{PoolSettings, TaskOutput, TaskRan, WorkerPool};
use crate::cluster::worker_tasks::collect_blocks;
use crate::exec::cursor::{Cursor, Next, ReadOrder};
use crate::exec::fault_hooks::{CheckedTask, PlanCheckFault};
use crate::exec::metrics::OperatorStats;
use crate::exec::plan_checks::{self, Gate, PlanCheck};
use crate::exec::run::QueryRun;
use crate::exec::task_feed::FedLog;
use crate::exec::task_kind::{TaskId, TaskKind};
use crate::exec::task_runner::{OnWorker, TaskRunner};
use crate::exec::task_sink::StoreSink;
use crate::exec::task_spec::{TaskPlace, TaskSpec};
use crate::exec::worker_plans::{
    PartitionInputs, blocks_plan, encode_for_worker, merges_runs_of, partition_plan, source_plan,
};
use crate::io::object_stores::StoreGrants;
use crate::plan::graph::{OperatorId, Pool};
use crate::plan::partition_cut::{InputRead, inputs_read};
use crate::plan::split_pruning::nothing_to_read;
use crate::plan::stage_input::InputExchange;
use crate::store::block::{BlockId, HeldBlock};
use crate::store::cutter::bundle_pieces;

/// A task ready to send: its header, its encoded plan, the host it would rather run on,
/// and what it is fed while it runs.
struct Outgoing<'a> {
    request: &'a TaskRequest,
    plan: &'a [u8],
    prefer: Option<&'a str>,
    feed: Option<TaskFeed<'a>>,
}

/// A task as a worker runs it.
struct WorkerTask {
    plan: Arc<dyn ExecutionPlan>,
    /// Where its input blocks come from; `None`: all in the plan.
    inputs: Option<Vec<TaskInput>>,
    /// How many of `inputs` each in-memory source takes ([`TaskRequest::input_sources`]).
    input_sources: Vec<usize>,
    /// The in-memory sources fed while it runs, each with the stage input that feeds it
    /// ([`crate::exec::task_feed`]).
    fed: Vec<(usize, usize)>,
    /// The input blocks it fetches from the workers holding them.
    by_ticket: Vec<(BlockId, Arc<dyn HeldBlock>)>,
    /// Bytes of those.
    bytes_by_ticket: u64,
    /// Bytes of the inputs in the plan.
    bytes_via_driver: u64,
    /// The host holding most of its input bytes (of the holders' addresses, the part
    /// before the port).
    prefer: Option<String>,
}

impl WorkerTask {
    /// A task whose plan holds all it reads.
    fn whole(plan: Arc<dyn ExecutionPlan>) -> Self {
        Self {
            plan,
            inputs: None,
            input_sources: vec![],
            fed: vec![],
            by_ticket: vec![],
            bytes_by_ticket: 0,
            bytes_via_driver: 0,
            prefer: None,
        }
    }
}

impl QueryRun {
    /// Place task `task` of a worker-mode run ([`QueryRun::place_task`]) and, when it goes
    /// to a worker, run it there into the store. `Ok(Some(spec))`: it runs in process, and
    /// `spec` says why.
    pub(super) async fn run_placed(self: &Arc<Self>, task: TaskId) -> Result<Option<TaskSpec>> {
        // Talk to workers from the query's runtime: the gRPC channels, heartbeats and
        // replacement starts live on the runtime they were made on, and an accelerator
        // thread's runtime only runs while that thread has a task.
        if tokio::runtime::Handle::current().id() != self.runtime().id() {
            let run = Arc::clone(self);
            return self
                .runtime()
                .spawn(async move { run.run_placed_here(task).await })
                .await
                .map_err(|e| DataFusionError::Execution(format!("task {task}: {e}")))?;
        }
        self.run_placed_here(task).await
    }

    async fn run_placed_here(self: &Arc<Self>, task: TaskId) -> Result<Option<TaskSpec>> {
        let spec = self.place_task(task).await?;
        let TaskPlace::Worker { pool, inputs, .. } = &spec.place else {
            return Ok(Some(spec));
        };
        // Recorded before its first block: a block lost while the task still runs is
        // recomputed from the same plan. A worker reads the split with no rows dropped by
        // `plan::join_filter_rows`; should the task be recomputed here, it reads it so too.
        self.workers.ran_on_worker.lock().unwrap().insert(task);
        // A per-partition task's inputs are released when it succeeds, as a local task's
        // are once read.
        if let Some(inputs) = inputs {
            self.state.lock().unwrap().tasks[task].consumed = inputs.concat().concat();
        }
        let _ = self.state.lock().unwrap().tasks[task]
            .scan_row_filter
            .set(false);
        let mut sink = StoreSink::new(self, &spec);
        let runner = OnWorker(Arc::clone(pool));
        if let Some(why) = runner.run(self, &spec, &mut sink).await? {
            self.workers.ran_on_worker.lock().unwrap().remove(&task);
            // It reads its inputs here instead, and records them as it reads them.
            self.state.lock().unwrap().tasks[task].consumed.clear();
            return Ok(Some(TaskSpec {
                place: TaskPlace::InProcess(Some(why)),
                ..spec
            }));
        }
        OperatorStats::add(&self.stats(spec.operator).remote_tasks, 1);
        Ok(None)
    }

    /// Whether per-partition task `task` can run on a worker: the plan it would run (over
    /// empty inputs, to check that it encodes) and its input blocks per stage input, or why
    /// it runs here. It runs here when it was refused memory before (alone on the driver,
    /// then as a sort-merge join), when an input is still being produced or streams, or
    /// when its fragment is not one [`partition_plan`](crate::exec::worker_plans::partition_plan) cuts. However large its inputs, a
    /// worker reads them as its plan does, a few blocks ahead, and its operators spill to
    /// the worker's disk beyond their share of the budget.
    pub(super) fn partition_runnable(
        &self,
        task: TaskId,
    ) -> Result<(Arc<dyn ExecutionPlan>, PartitionInputs), OnDriver> {
        let (op_id, partition, retried) = {
            let st = self.state.lock().unwrap();
            let t = &st.tasks[task];
            (t.operator, t.partition, t.retried_alone || t.merge_join)
        };
        if retried {
            return Err(OnDriver::OutOfCore);
        }
        let op = &self.graph.operators[op_id];
        let empty = (op.inputs.iter())
            .map(|producer| {
                let schema = self.graph.operators[*producer].fragment.schema();
                MemorySourceConfig::try_new_exec(&[vec![]], schema, None)
                    .map(|source| source as Arc<dyn ExecutionPlan>)
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| OnDriver::NotCut(e.to_string()))?;
        let plan = partition_plan(op, partition, &empty, &self.store_grants())?;
        let (inputs, _) = self
            .partition_input_blocks(task, true)
            .ok_or(OnDriver::PerPartition)?;
        Ok((plan, inputs))
    }

    /// The blocks per-partition task `task` reads of each of its stage inputs, in the order
    /// a local task reads them (a slice: its own blocks of the input it cuts), and the
    /// inputs it is to be fed instead (`feeding`: an input fed to workers that is still
    /// being produced, [`crate::exec::task_feed`]; its blocks are then left empty). `None`
    /// while another input is still being produced, or when the task streams an input its
    /// worker is not fed. Each input counts as asked for.
    fn partition_input_blocks(
        &self,
        task: TaskId,
        feeding: bool,
    ) -> Option<(PartitionInputs, Vec<usize>)> {
        let (op_id, partition, kind) = self.task_identity(task);
        let (mut inputs, fed) = self.whole_partition_input_blocks(op_id, partition, feeding)?;
        if let TaskKind::Slice { input, blocks } = kind {
            *inputs.get_mut(input)? = vec![blocks];
        }
        Some((inputs, fed))
    }

    /// The blocks partition `partition` of `op_id` reads of each of its stage inputs, and
    /// those it is fed, as [`Self::partition_input_blocks`] says.
    fn whole_partition_input_blocks(
        &self,
        op_id: OperatorId,
        partition: usize,
        feeding: bool,
    ) -> Option<(PartitionInputs, Vec<usize>)> {
        let op = &self.graph.operators[op_id];
        let streams = self.streams_inputs(op_id);
        let mut st = self.state.lock().unwrap();
        // Asking for an input opens the gate of a streamed one: only once all are complete,
        // but for an input fed as it comes.
        let fed: Vec<usize> = (op.inputs.iter().enumerate())
            .filter(|(input, producer)| {
                feeding && self.fed_on_workers(op_id, *input) && !st.operators[**producer].complete
            })
            .map(|(input, _)| input)
            .collect();
        let ready = (op.inputs.iter().enumerate()).all(|(input, producer)| {
            let fed_to_worker = self.fed_on_workers(op_id, input);
            (fed.contains(&input) || st.operators[*producer].complete)
                && !(streams && op.streamed_inputs[input] && !fed_to_worker)
        });
        if !ready {
            return None;
        }
        // A stage input the partition does not read (below another input of a union) is
        // one empty group, read by nothing.
        let mut inputs = vec![vec![vec![]]; op.inputs.len()];
        for (input, read) in inputs_read(&op.fragment, partition) {
            let producer = op.inputs[input];
            st.operators[producer].demanded = true;
            let part = match read {
                InputRead::Partition(part) => part,
                InputRead::Whole => 0,
            };
            if merges_runs_of(&op.fragment, input)
                && matches!(op.input_exchanges[input], InputExchange::Preserve)
            {
                // One group per sorted run (a producer task's blocks), merged by the worker
                // as the driver's `MergeRunsExec` would: only when a block of each run fits
                // the partition's share (else the runs merge in levels, here).
                let mut runs = vec![];
                let mut held_at_once = 0;
                for task in st.operators[producer].partitions[part].tasks.clone() {
                    let mut cursor = Cursor::new(producer, ReadOrder::Task(task), None);
                    let (mut blocks, mut largest) = (vec![], 0);
                    loop {
                        match st.next_block(&mut cursor) {
                            Next::Block(id) => {
                                largest = largest.max(st.blocks[&id].bytes);
                                blocks.push(id);
                            }
                            Next::End => break,
                            Next::Wait => return None,
                        }
                    }
                    held_at_once += largest;
                    runs.push(blocks);
                }
                if held_at_once > self.graph.sizing.partition_bytes {
                    return None;
                }
                if runs.is_empty() {
                    runs.push(vec![]);
                }
                inputs[input] = runs;
                continue;
            }
            if fed.contains(&input) {
                // Its blocks come through the feed.
                inputs[input] = vec![vec![]];
                continue;
            }
            let mut groups = vec![];
            for part in self.partitions_read_apart(op_id, input, read) {
                let mut cursor = self.input_cursor(op_id, input, part, true);
                let mut blocks = vec![];
                loop {
                    match st.next_block(&mut cursor) {
                        Next::Block(id) => blocks.push(id),
                        Next::End => break,
                        Next::Wait => return None,
                    }
                }
                groups.push(blocks);
            }
            inputs[input] = groups;
        }
        Some((inputs, fed))
    }

    /// The partitions of stage input `input` of `op_id` read as `read`, each apart: every
    /// partition of an order-preserving input read whole (the sorted partitions a merge
    /// reads), else the one read (a gathered input's cursor reads all of it as one).
    fn partitions_read_apart(
        &self,
        op_id: OperatorId,
        input: usize,
        read: InputRead,
    ) -> Vec<usize> {
        let op = &self.graph.operators[op_id];
        let producer = self.graph.operators[op.inputs[input]].partitions();
        match read {
            InputRead::Whole if matches!(op.input_exchanges[input], InputExchange::Preserve) => {
                (0..producer).collect()
            }
            InputRead::Whole => vec![0],
            InputRead::Partition(part) => vec![part],
        }
    }

    /// The check that a worker of `pool` decodes `plan` as it was planned
    /// ([`PlanCheck`]), started now or, in a release build, the one of the first task of
    /// the same operator and kind (a source task or not): its other tasks' plans differ in
    /// their file ranges and in-memory inputs alone, and the check (a decode and two plan
    /// texts) cost an eighth of the driver's CPU per task. A debug build checks every task.
    pub(super) fn plan_check(
        &self,
        plan: &Arc<dyn ExecutionPlan>,
        pool: &WorkerPool,
        spec: &TaskSpec,
    ) -> PlanCheck {
        let describe = spec.describe.as_str();
        let shape = (spec.operator, matches!(spec.kind, TaskKind::Source { .. }));
        let start = || {
            let functions = Arc::clone(pool.functions());
            PlanCheck::start(
                Arc::clone(plan),
                functions,
                self.base_context(),
                describe.into(),
            )
        };
        if let Some(delay) = self.injected_check_fault(spec.operator, spec.partition) {
            let why = format!("{describe}: a check failed by the test's PlanCheckFault");
            return PlanCheck::failing_after(delay, OnDriver::DecodesDifferently(why));
        }
        if cfg!(debug_assertions) {
            return start();
        }
        let mut checks = self.workers.plan_checks.lock().unwrap();
        checks.entry(shape).or_insert_with(start).clone()
    }

    /// When the session's [`PlanCheckFault`] fails the check of the task of `op_id` for
    /// `partition`, after how long.
    ///
    /// [`PlanCheckFault`]: crate::exec::fault_hooks::PlanCheckFault
    fn injected_check_fault(&self, op_id: OperatorId, partition: usize) -> Option<Duration> {
        let fault = self
            .base
            .session_config()
            .get_extension::<PlanCheckFault>()?;
        (fault.0)(&CheckedTask {
            operator: op_id,
            operator_name: self.graph.operators[op_id].name.clone(),
            partition,
        })
    }

    /// Run `task` on a worker of `pool`: its input blocks that live in other workers are
    /// fetched by that worker straight from them; those that live here go in the request.
    /// When a worker cannot fetch an input (its holder died), that input is recomputed
    /// from lineage and the task sent again (at most `flumen.max_task_retries` times).
    /// Blocks go to `on_block` as [`WorkerPool::run_task`] hands them out, once the check
    /// that the worker decodes the task's plan as planned has passed (until then they are
    /// held: [`Gate`]). `Some(why)`: the task has no plan a worker can run (a check that
    /// fails stops the task on its worker and drops what it handed back).
    pub(super) async fn run_worker_task(
        self: &Arc<Self>,
        pool: &Arc<WorkerPool>,
        spec: &TaskSpec,
        on_block: &mut (dyn FnMut(usize, WorkerBlock) -> Result<()> + Send),
    ) -> Result<Option<OnDriver>> {
        let (task, op_id, partition) = (spec.task, spec.operator, spec.partition);
        let describe = spec.describe.as_str();
        // Inputs read here stay here across attempts (reading consumed them).
        let mut read_here = HashMap::new();
        // Attempts that lost inputs: those that found none lost before count against
        // `flumen.max_task_retries`; each that found new ones made progress (it recomputes
        // them), up to `LOST_INPUT_ATTEMPTS`.
        let mut lost = LostInputs::default();
        let check = match &spec.place {
            TaskPlace::Worker { check, .. } => check.clone(),
            TaskPlace::InProcess(_) => None,
        };
        // Blocks of every attempt, held until the check passed.
        let mut blocks = Gate::new(check.clone());
        loop {
            let work = match self.worker_task(task, &mut read_here).await? {
                Ok(work) => work,
                Err(why) => return Ok(Some(why)),
            };
            // A fed task's feed hands it blocks as they are made, which a run on the
            // driver after a failed check could not read again: it waits for the check.
            if let Some(pending) = check.as_ref().filter(|_| !work.fed.is_empty())
                && let Some(why) = plan_checks::as_result(pending.verdict().await)?
            {
                return Ok(Some(why));
            }
            // Its own bounds, and those it starts from, as on the driver's threads; its own
            // as the worker tells them count in the launches while it runs.
            let one_task = self.with_task_bounds(task, &work.plan, true)?;
            // Its bounds rule out its whole split: the worker would open nothing.
            if matches!(spec.kind, TaskKind::Source { .. }) && nothing_to_read(&one_task.plan) {
                OperatorStats::add(&self.stats(op_id).tasks_pruned_at_launch, 1);
                return Ok(None);
            }
            let heard = HeardBounds::new(&one_task.made);
            let _running = self.bounds.running(heard.filters());
            let context = self.base_context();
            let mut on_bounds = |sent: Vec<SentBound>| {
                if let Err(e) = heard.hear(&sent, &context) {
                    log::warn!("{describe}: bounds it sent while running are left out: {e}");
                }
            };
            // Bounds it tightens count, as its blocks, once the check passed.
            let mut bounds = Gate::new(check.clone());
            let bytes = match encode_for_worker(&one_task.plan, pool) {
                Ok(bytes) => bytes,
                Err(why) => return Ok(Some(why)),
            };
            let mut request = self.task_request(op_id, partition, &one_task.plan);
            // The session's own memory limit, which bounds its tasks on the driver, bounds
            // its tasks on the workers together: each gets its share of the cluster's slots.
            request
                .options
                .extend(task_memory_limit(&self.base, pool.live_slots()));
            request.first_block_rows = self.first_block_rows_of(task);
            request.inputs = work.inputs;
            request.input_sources = work.input_sources;
            let fed_log = Arc::new(std::sync::Mutex::new(FedLog::default()));
            let make_feed = {
                let (run, fed, log) = (Arc::clone(self), work.fed.clone(), Arc::clone(&fed_log));
                move || run.task_feed(task, &fed, Arc::clone(&log))
            };
            let feed: Option<TaskFeed<'_>> = match work.fed.is_empty() {
                true => None,
                false => {
                    request.feed = crate::cluster::block_shelf::random_key();
                    request.fed_sources = work.fed.iter().map(|(source, _)| *source).collect();
                    Some(&make_feed)
                }
            };
            let outgoing = Outgoing {
                request: &request,
                plan: &bytes,
                prefer: work.prefer.as_deref(),
                feed,
            };
            let mut gated_block = |seq, block| {
                (blocks.admit((seq, block)).into_iter()).try_for_each(|(seq, b)| on_block(seq, b))
            };
            let mut gated_bounds = |sent| bounds.admit(sent).into_iter().for_each(&mut on_bounds);
            let running = self.run_on_pool(
                pool,
                outgoing,
                describe,
                &mut gated_block,
                &mut gated_bounds,
            );
            let ran = match &check {
                // A plan found wrong stops its task at once.
                Some(pending) => tokio::select! {
                    ran = running => Some(ran),
                    () = pending.failed() => None,
                },
                None => Some(running.await),
            };
            if let Some(pending) = &check
                && let Some(why) = plan_checks::as_result(pending.verdict().await)?
            {
                // What it handed back is dropped (blocks it holds go when the query ends),
                // and it counts as a task on the driver alone.
                return Ok(Some(why));
            }
            let ran = ran.ok_or_else(|| {
                DataFusionError::Internal(format!("{describe} stopped for a check that passed"))
            })?;
            bounds.opened().into_iter().for_each(&mut on_bounds);
            (blocks.opened().into_iter()).try_for_each(|(seq, b)| on_block(seq, b))?;
            let fed = std::mem::take(&mut *fed_log.lock().unwrap());
            match ran {
                Ok(ran) => {
                    let (bounds, build_keys) = self.count_worker_run(op_id, ran);
                    match sent_bounds::received(&bounds, &one_task.made, &self.base_context()) {
                        Ok(made) => self.bounds.add(made),
                        Err(e) => log::warn!("{describe}: its bounds are left out: {e}"),
                    }
                    if let Some(sent) = build_keys {
                        self.keep_build_keys(task, &sent, describe);
                    }
                    let stats = self.stats(op_id);
                    let by_ticket = work.bytes_by_ticket + fed.bytes_by_ticket;
                    OperatorStats::add(&stats.input_bytes_by_ticket, by_ticket);
                    let via_driver = work.bytes_via_driver + fed.bytes_via_driver;
                    OperatorStats::add(&stats.input_bytes_via_driver, via_driver);
                    if matches!(
                        &spec.place,
                        TaskPlace::Worker {
                            inputs: Some(_),
                            ..
                        }
                    ) {
                        // A first run's fed blocks are released when it ends, as the rest.
                        self.state.lock().unwrap().tasks[task]
                            .consumed
                            .extend(fed.ids);
                    }
                    return Ok(None);
                }
                Err(e)
                    if e.to_string().contains(INPUT_LOST)
                        && lost.another_attempt(
                            &e.to_string(),
                            (work.by_ticket.iter().chain(&fed.by_ticket))
                                .map(|(_, held)| held.location().key),
                            self.config().max_task_retries,
                        ) =>
                {
                    log::warn!("{describe}: {e}; recomputing the input and retrying");
                    self.inputs_lost(&work.by_ticket, &e.to_string());
                    self.inputs_lost(&fed.by_ticket, &e.to_string());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// `task` as a worker runs it, or why a worker cannot (the outer error is the task's).
    /// The input blocks of a block-wise or per-partition task held by live workers become
    /// tickets the worker fetches; the others are read here (recomputed if lost; kept in
    /// `read_here` for a later attempt) and put in the plan's in-memory sources, one per
    /// stage input.
    async fn worker_task(
        self: &Arc<Self>,
        task: TaskId,
        read_here: &mut HashMap<BlockId, RecordBatch>,
    ) -> Result<Result<WorkerTask, OnDriver>> {
        let (op_id, partition, kind) = self.task_identity(task);
        let op = &self.graph.operators[op_id];
        let partitioned = matches!(kind, TaskKind::Partition | TaskKind::Slice { .. });
        // Each stage input's blocks, and the order the worker fills their sources in.
        let (groups, order, fed_inputs) = match kind {
            TaskKind::Blocks { inputs } => (vec![vec![inputs]], vec![0], vec![]),
            TaskKind::Partition | TaskKind::Slice { .. } => {
                match self.partition_input_blocks(task, true) {
                    Some((groups, fed)) => {
                        let order = inputs_read(&op.fragment, partition);
                        (
                            groups,
                            order.into_iter().map(|(input, _)| input).collect(),
                            fed,
                        )
                    }
                    None => return Ok(Err(OnDriver::PerPartition)),
                }
            }
            _ => return Ok(self.task_plan(task).await?.map(WorkerTask::whole)),
        };
        let mut fed = vec![];
        let (mut by_ticket, mut bytes_by_ticket, mut bytes_via_driver) = (vec![], 0, 0);
        let mut bytes_by_host: HashMap<String, u64> = HashMap::new();
        let mut sources = vec![];
        let mut counts = Vec::with_capacity(order.len());
        let mut memory: Vec<Option<Arc<dyn ExecutionPlan>>> = vec![None; groups.len()];
        for input in order {
            let Some(parts) = groups.get(input) else {
                return Ok(Err(OnDriver::NotCut(format!("no stage input {input}"))));
            };
            let schema = self.graph.operators[op.inputs[input]].fragment.schema();
            if fed_inputs.contains(&input) {
                // Its one source's blocks all come through the feed.
                fed.push((counts.len(), input));
            }
            let mut part_sources = Vec::with_capacity(parts.len());
            for ids in parts {
                let mut inline = vec![];
                for &id in ids {
                    if !read_here.contains_key(&id)
                        && let Some(held) = self.store.peek_held(id)
                        && held.holder_alive()
                    {
                        let at = held.location();
                        let bytes = self.block(id).map_or(0, |b| b.bytes);
                        bytes_by_ticket += bytes;
                        *bytes_by_host.entry(host_of(&at.address)).or_default() += bytes;
                        sources.push(TaskInput::Fetch(InputTicket {
                            address: at.address,
                            tls: at.tls,
                            key: at.key,
                            bytes,
                        }));
                        by_ticket.push((id, held));
                        continue;
                    }
                    let batch = match read_here.get(&id) {
                        Some(batch) => batch.clone(),
                        None => {
                            let batch = self.fetch(id).await?;
                            read_here.insert(id, batch.clone());
                            batch
                        }
                    };
                    bytes_via_driver += batch.get_array_memory_size() as u64;
                    sources.push(TaskInput::Inline(inline.len()));
                    inline.push(batch);
                }
                counts.push(ids.len());
                let source =
                    MemorySourceConfig::try_new_exec(&[inline], Arc::clone(&schema), None)?;
                part_sources.push(source as Arc<dyn ExecutionPlan>);
            }
            memory[input] = Some(UnionExec::try_new(part_sources)?);
        }
        let memory = (memory.into_iter().enumerate())
            .map(|(input, source)| match source {
                Some(source) => Ok(source),
                None => {
                    let schema = self.graph.operators[op.inputs[input]].fragment.schema();
                    Ok(MemorySourceConfig::try_new_exec(&[vec![]], schema, None)? as _)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let (plan, input_sources) = match partitioned {
            false => (blocks_plan(op, Arc::clone(&memory[0])), vec![]),
            true => (
                partition_plan(op, partition, &memory, &self.store_grants()),
                counts,
            ),
        };
        let plan = match plan {
            Ok(plan) => plan,
            Err(why) => return Ok(Err(why)),
        };
        let prefer = bytes_by_host
            .into_iter()
            .max_by(|(host_a, a), (host_b, b)| a.cmp(b).then_with(|| host_b.cmp(host_a)))
            .map(|(host, _)| host);
        // A union's partition of an input under which no stage input lies (a scan beside
        // one) reads none: its plan has no in-memory source, and an empty list of them would
        // read as a block-wise task's one source.
        let reads_none = partitioned && input_sources.is_empty();
        Ok(Ok(WorkerTask {
            plan,
            inputs: (!reads_none).then_some(sources),
            input_sources,
            fed,
            by_ticket,
            bytes_by_ticket,
            bytes_via_driver,
            prefer,
        }))
    }

    /// A worker could not fetch some of `by_ticket` (the error names them): they count as
    /// lost, and a holder that died has all its blocks recovered.
    fn inputs_lost(self: &Arc<Self>, by_ticket: &[(BlockId, Arc<dyn HeldBlock>)], error: &str) {
        for (id, held) in by_ticket {
            if !error.contains(&held.location().key) || !self.store.remove_held(*id, held) {
                continue;
            }
            self.workers.lost_blocks.lock().unwrap().insert(*id);
            if let Some(block) = self.block(*id) {
                OperatorStats::add(&self.stats(block.operator).blocks_lost, 1);
            }
            if !held.holder_alive() {
                self.recover_worker(held.holder_id());
            }
        }
    }

    /// The plan a worker runs for `task` (a block-wise task's inputs are fetched, recomputed
    /// if they were lost), or why it has no such plan.
    async fn task_plan(
        self: &Arc<Self>,
        task: TaskId,
    ) -> Result<Result<Arc<dyn ExecutionPlan>, OnDriver>> {
        let (op_id, partition, kind) = self.task_identity(task);
        let op = &self.graph.operators[op_id];
        match kind {
            TaskKind::Source { split } => {
                let dropping_by = self.build_bounds_made_for(op_id);
                Ok(source_plan(
                    op,
                    partition,
                    split,
                    &self.store_grants(),
                    &dropping_by,
                ))
            }
            TaskKind::Blocks { inputs } => {
                let schema = self.graph.operators[op.inputs[0]].fragment.schema();
                // The fragment sees the bundle as a local task does.
                let pieces = self.fetch_pieces(op_id, &schema, inputs).await?;
                let input = MemorySourceConfig::try_new_exec(&[pieces], schema, None)?;
                Ok(blocks_plan(op, input))
            }
            TaskKind::Partition | TaskKind::Slice { .. } => {
                let Some((groups, _)) = self.partition_input_blocks(task, false) else {
                    return Ok(Err(OnDriver::PerPartition));
                };
                // Each input as the worker's source held it: in pieces of the target size.
                let mut sources: Vec<Arc<dyn ExecutionPlan>> = Vec::with_capacity(groups.len());
                for (input, parts) in groups.into_iter().enumerate() {
                    let schema = self.graph.operators[op.inputs[input]].fragment.schema();
                    let mut part_sources = Vec::with_capacity(parts.len());
                    for ids in parts {
                        let pieces = self.fetch_pieces(op_id, &schema, ids).await?;
                        let source =
                            MemorySourceConfig::try_new_exec(&[pieces], Arc::clone(&schema), None)?;
                        part_sources.push(source as Arc<dyn ExecutionPlan>);
                    }
                    sources.push(UnionExec::try_new(part_sources)?);
                }
                Ok(partition_plan(
                    op,
                    partition,
                    &sources,
                    &self.store_grants(),
                ))
            }
        }
    }

    /// Blocks `ids` of an input of `op_id`'s task with `schema`, fetched (recomputed if
    /// lost) and cut into the pieces its fragment reads, as the task's worker would cut
    /// them ([`bundle_pieces`]).
    async fn fetch_pieces(
        self: &Arc<Self>,
        op_id: OperatorId,
        schema: &SchemaRef,
        ids: Vec<BlockId>,
    ) -> Result<Vec<RecordBatch>> {
        let mut batches = Vec::with_capacity(ids.len());
        for id in ids {
            batches.push(self.fetch(id).await?);
        }
        let (rows, cut) = (self.graph.piece_rows(op_id), self.graph.piece_cut(op_id));
        bundle_pieces(schema, batches, rows, cut)
    }

    /// Fetch block `id` from the worker that holds it; `None` when no worker holds it or
    /// it was lost with its worker. The first loss seen from a worker starts the recovery
    /// of everything it held ([`Self::recover_worker`]).
    ///
    /// A block of a gathered input that several partitions of its reader read (a join's
    /// build side) is read and left where it is: taking it would pull it from under the
    /// tickets of the reader's tasks on the workers, failing them with lost inputs.
    pub(super) async fn fetch_held(self: &Arc<Self>, id: BlockId) -> Result<Option<RecordBatch>> {
        let shared = self
            .block(id)
            .is_some_and(|b| self.read_by_many(b.operator));
        let held = match shared {
            true => self.store.peek_held(id),
            false => self.store.take_held(id),
        };
        let Some(held) = held else {
            return Ok(None);
        };
        let fetched = match shared {
            // Released meanwhile (its readers were done as this one looked it up), or not
            // to be had from a live worker: made again from its lineage by the caller.
            true => match held.read().await {
                Ok(Some(batch)) => Some(batch),
                Ok(None) => {
                    self.store.remove_held(id, &held);
                    None
                }
                Err(e) => {
                    log::info!("block {id}: {e}; recomputing it");
                    self.store.remove_held(id, &held);
                    return Ok(None);
                }
            },
            false => held.fetch().await?,
        };
        if let (Some(batch), Some(block)) = (&fetched, self.block(id)) {
            // The bytes its rows reach: a batch decoded from IPC shares one message body
            // among its columns, which `get_array_memory_size` counts once per column.
            let bytes = crate::store::rows_bytes(batch);
            OperatorStats::add(&self.stats(block.operator).output_bytes_to_driver, bytes);
        }
        if fetched.is_none() {
            self.workers.lost_blocks.lock().unwrap().insert(id);
            if let Some(block) = self.block(id) {
                OperatorStats::add(&self.stats(block.operator).blocks_lost, 1);
            }
            self.recover_worker(held.holder_id());
        }
        Ok(fetched)
    }

    /// A worker died: every block it still held is lost. Re-run their producer tasks at once,
    /// in parallel on the live workers, instead of one by one when each is read.
    fn recover_worker(self: &Arc<Self>, holder: u64) {
        if !self.workers.dead_workers.lock().unwrap().insert(holder) {
            return;
        }
        let lost = self.store.take_held_by(holder);
        let mut tasks = HashSet::new();
        {
            let mut lost_set = self.workers.lost_blocks.lock().unwrap();
            for id in lost {
                if let Some(block) = self.block(id) {
                    OperatorStats::add(&self.stats(block.operator).blocks_lost, 1);
                    tasks.insert(block.task);
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
                if let Err(e) = run.run_again(task, None, true).await {
                    log::warn!(
                        "re-running task {task} on a worker failed ({e}); readers recompute here"
                    );
                }
            });
        }
    }

    /// The rows a task's blocks ramp up from ([`ModelBatching::first_rows_of_task`]).
    fn first_block_rows_of(&self, task: TaskId) -> usize {
        let (op_id, _, kind) = self.task_identity(task);
        let fragment = &self.graph.operators[op_id].fragment;
        self.graph
            .batching
            .first_rows_of_task(fragment, kind.source_split())
    }

    /// The header of a task of partition `partition` of operator `op_id` running `plan`:
    /// how to cut its blocks, the settings it runs under, its query, and the files it may
    /// read (those `plan` scans).
    fn task_request(
        &self,
        op_id: OperatorId,
        partition: usize,
        plan: &Arc<dyn ExecutionPlan>,
    ) -> TaskRequest {
        let config = self.config();
        let (build_keys, build_key_set_tasks) = self.build_keys_sent(op_id);
        TaskRequest {
            target_rows: self.graph.piece_rows(op_id),
            piece_cut: self.graph.piece_cut(op_id),
            input_batch_rows: self.input_batch_rows(op_id),
            carried_output_bytes: match self.output_read_on_driver(op_id) {
                true => config.carried_output_bytes.0,
                false => 0,
            },
            first_block_rows: 0,
            ramp_block_rows: self.graph.batching.piece_rows,
            partition,
            partitions: self.graph.operators[op_id].partitions(),
            options: self
                .workers
                .task_options
                .get_or_init(|| {
                    config
                        .entries()
                        .into_iter()
                        .filter_map(|entry| Some((entry.key, entry.value?)))
                        // DataFusion's own settings a function reads as it runs (the
                        // session's time zone: `to_unixtime` of a string), at this
                        // session's values.
                        .chain(
                            (self.base.session_config().options().entries().into_iter())
                                .filter(|entry| entry.key.starts_with("datafusion."))
                                .filter_map(|entry| Some((entry.key, entry.value?))),
                        )
                        .filter(|(key, _)| WORKER_OPTIONS.contains(&key.as_str()))
                        .collect()
                })
                .clone(),
            query: self.workers.query_token.clone(),
            grants: scanned_files(plan),
            inputs: None,
            input_sources: vec![],
            feed: String::new(),
            fed_sources: vec![],
            stores: {
                let granted = self.store_grants();
                scanned_stores(plan)
                    .iter()
                    .filter_map(|url| granted.get(url))
                    .collect()
            },
            build_keys,
            build_key_set_tasks,
        }
    }

    /// Whether the driver reads `op`'s output blocks itself: the root's (the query's
    /// answer) where the output reads the root's blocks, else its inputs' (the root's
    /// fragment runs in the output). Those blocks may come back with their task's reply
    /// (`flumen.carried_output_bytes`); the others stay in the workers, which send them to
    /// their readers directly, so the driver is no hub between workers.
    fn output_read_on_driver(&self, op: OperatorId) -> bool {
        let root = self.graph.root();
        match self.root_runs_in_output() {
            true => root.inputs.contains(&op),
            false => op == root.id,
        }
    }

    /// The object stores this session can give its workers.
    pub(super) fn store_grants(&self) -> Arc<StoreGrants> {
        self.base_context()
            .session_config()
            .get_extension::<StoreGrants>()
            .unwrap_or_default()
    }

    /// Where the workers of `pool` come from, and how they are watched, as this run's
    /// settings say: the cluster `flumen.cluster` names, else processes started here. Made
    /// once per run and pool (a cluster file is read to make them), not per task.
    pub(super) fn pool_settings(&self, pool: Pool) -> Result<PoolSettings> {
        if let Some(settings) = self.workers.pool_settings.lock().unwrap().get(&pool) {
            return Ok(settings.clone());
        }
        let settings = PoolSettings::of_config(self.config(), pool)?;
        self.workers
            .pool_settings
            .lock()
            .unwrap()
            .insert(pool, settings.clone());
        Ok(settings)
    }

    /// Drop every block this run left in a worker (the run ended, however it ended).
    pub(super) fn release_worker_blocks(&self) {
        let Some(slot) = self.worker_slot() else {
            return;
        };
        let slot = Arc::clone(slot);
        let query = self.workers.query_token.clone();
        self.runtime().spawn(async move {
            for pool in slot.started().await {
                pool.release_query(&query).await;
            }
        });
    }

    /// Run `task` on `pool`, noting the pool's restarts (a run that ended is counted by
    /// [`Self::count_worker_run`] once its plan's check passed).
    async fn run_on_pool(
        &self,
        pool: &Arc<WorkerPool>,
        task: Outgoing<'_>,
        describe: &str,
        on_block: &mut (dyn FnMut(usize, WorkerBlock) -> Result<()> + Send),
        on_bounds: &mut (dyn FnMut(Vec<SentBound>) + Send),
    ) -> Result<TaskRan> {
        let config = self.config();
        let retries = config.max_task_retries;
        let ran = pool
            .run_task(
                task.plan,
                task.request,
                retries,
                describe,
                task.prefer,
                TaskOutput {
                    on_block,
                    on_bounds,
                    feed: task.feed,
                },
            )
            .await;
        self.note_restarts(pool);
        ran
    }

    /// Count a task of `op_id` that ran on a worker (its retries, the host it ran on, its
    /// plan's and models' figures): the bounds and build keys it sent back.
    fn count_worker_run(
        &self,
        op_id: OperatorId,
        ran: TaskRan,
    ) -> (Vec<SentBound>, Option<SentKeys>) {
        let stats = self.stats(op_id);
        OperatorStats::add(&stats.tasks_retried, ran.retries as u64);
        stats.worker_plan_metrics.add(ran.figures.plan);
        stats.observe_model_metrics(ran.figures.model);
        stats.count_remote_on(&host_of(&ran.worker));
        self.metrics.count_task_on(&host_of(&ran.worker));
        (ran.figures.bounds, ran.figures.build_keys)
    }

    /// Count the pools' worker restarts since this run first used them into the graph's
    /// `workers_restarted` (shown by `EXPLAIN ANALYZE`).
    fn note_restarts(&self, pool: &WorkerPool) {
        let now = pool.restarted();
        let mut seen = self.workers.restarts.lock().unwrap();
        let (_, latest) = seen.entry(pool.kind()).or_insert((now, now));
        *latest = now;
        let total: u64 = seen.values().map(|(start, latest)| latest - start).sum();
        self.metrics.observe_workers_restarted(total);
        let counts = pool.membership();
        let now = [&counts.lost, &counts.joined, &counts.rejoined]
            .map(|count| count.load(std::sync::atomic::Ordering::Relaxed));
        let mut seen = self.workers.membership_seen.lock().unwrap();
        let start = *seen.entry(pool.kind()).or_insert(now);
        drop(seen);
        self.metrics
            .observe_membership([0, 1, 2].map(|i| now[i].saturating_sub(start[i])));
    }

    /// The blocks of task `task`, which ran on a worker, made here by the plan its worker
    /// ran: `(tag, block)` in output order. `None` when it has no such plan.
    pub(super) async fn worker_plan_here(
        self: &Arc<Self>,
        task: TaskId,
    ) -> Result<Option<Vec<(usize, RecordBatch)>>> {
        let Ok(plan) = self.task_plan(task).await? else {
            return Ok(None);
        };
        let plan = self.with_task_bounds(task, &plan, true)?.plan;
        let (op_id, partition, _) = self.task_identity(task);
        let plan = self.as_a_worker_decodes(op_id, plan).await;
        let mut request = self.task_request(op_id, partition, &plan);
        request.first_block_rows = self.first_block_rows_of(task);
        Ok(Some(
            collect_blocks(plan, self.base_context(), &request).await?,
        ))
    }

    /// `plan` of operator `op_id` as a worker decodes it. What the plan's encoding does not
    /// carry, a worker's run did not have: DataFusion reads a scan's row groups in reverse for a
    /// descending sort above it, a worker in file order. A task recomputed here must cut the
    /// blocks its worker cut, so it runs the plan the worker ran. The plan as it is where it
    /// cannot be encoded (it then never ran in a worker).
    async fn as_a_worker_decodes(
        &self,
        op_id: OperatorId,
        plan: Arc<dyn ExecutionPlan>,
    ) -> Arc<dyn ExecutionPlan> {
        let pool = match self.worker_slot() {
            Some(slot) => slot.current(self.graph.operators[op_id].pool).await,
            None => None,
        };
        let Some(pool) = pool else {
            return plan;
        };
        let describe = format!("recomputing a task of flumen operator {op_id}");
        let Ok(bytes) = encode_for_worker(&plan, &pool) else {
            return plan;
        };
        match task_plan::decode(&bytes, &self.base_context()) {
            Ok(decoded) => decoded,
            Err(e) => {
                log::warn!("{describe}: its plan does not decode here ({e}); running it as built");
                plan
            }
        }
    }
}

/// Most attempts of one worker task that lose inputs: each that finds blocks lost that no
/// earlier one did is progress (they are recomputed before the next), but a task cannot be
/// retried without end.
const LOST_INPUT_ATTEMPTS: usize = 64;

/// The input losses of one worker task's attempts.
#[derive(Debug, Default)]
struct LostInputs {
    /// The keys of the blocks found lost so far.
    keys: HashSet<String>,
    /// Attempts that found no block lost that an earlier one had not.
    without_progress: usize,
    /// Attempts that lost inputs.
    attempts: usize,
}

impl LostInputs {
    /// Whether the task may run again after an attempt that failed with `error` (an
    /// [`INPUT_LOST`] error naming the keys of its lost blocks) over the blocks `keys`:
    /// while attempts find blocks lost that none did before, up to [`LOST_INPUT_ATTEMPTS`],
    /// and `retries` attempts that find none.
    fn another_attempt(
        &mut self,
        error: &str,
        keys: impl Iterator<Item = String>,
        retries: usize,
    ) -> bool {
        let mut found_new = false;
        for key in keys {
            if error.contains(&key) && self.keys.insert(key) {
                found_new = true;
            }
        }
        self.attempts += 1;
        if !found_new {
            self.without_progress += 1;
        }
        self.without_progress <= retries && self.attempts <= LOST_INPUT_ATTEMPTS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(names: &[&str]) -> impl Iterator<Item = String> {
        names
            .iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>()
            .into_iter()
    }

    #[test]
    fn attempts_that_find_new_lost_inputs_go_on_and_the_others_are_counted() {
        let mut lost = LostInputs::default();
        let inputs = ["k1", "k2", "k3", "k4", "k5", "k6"];
        // Each attempt finds one more input lost (a live worker's lost blocks were named
        // one at a time): more attempts than 2 retries, all progress.
        for key in inputs {
            let error = format!("{INPUT_LOST}: {key} on worker w: no block");
            assert!(lost.another_attempt(&error, keys(&inputs), 2), "{key}");
        }
        // Attempts that find only blocks lost before: 2 more, then no more.
        let again = format!("{INPUT_LOST}: k1 on worker w: no block");
        assert!(lost.another_attempt(&again, keys(&inputs), 2));
        assert!(lost.another_attempt(&again, keys(&inputs), 2));
        assert!(!lost.another_attempt(&again, keys(&inputs), 2));
    }

    #[test]
    fn attempts_that_lose_inputs_end_even_while_each_finds_new_ones() {
        let mut lost = LostInputs::default();
        let names: Vec<String> = (0..LOST_INPUT_ATTEMPTS + 1)
            .map(|i| format!("key{i:03}"))
            .collect();
        let allowed = (names.iter())
            .take_while(|key| {
                let error = format!("{INPUT_LOST}: {key} on worker w: no block");
                lost.another_attempt(&error, names.clone().into_iter(), 4)
            })
            .count();
        assert_eq!(allowed, LOST_INPUT_ATTEMPTS);
    }
}
