//! Launching tasks into free slots: most downstream operator first, producers held back
//! while their unread output is over its share (backpressure), running tasks paused while
//! their reader is behind, and the liveness rule that keeps a run from stalling.

use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;

use crate::exec::launch_rules::launch_rules;
use crate::exec::metrics::OperatorStats;
use crate::exec::policy;
use crate::exec::run::QueryRun;
use crate::exec::state::{PausedTask, RunState, TaskStatus, pool_index};
use crate::exec::task_kind::TaskId;
use crate::plan::graph::{InputReading, OperatorId, Pool};

impl QueryRun {
    /// Pick the tasks to launch now, marking them running: first the retries of tasks
    /// refused memory, then every operator that streams its inputs, then one task at a time
    /// to the most downstream operator that has a free slot and that no launch rule of the
    /// mode holds back ([`launch_rules`]), and last, if nothing else can make progress, one
    /// task regardless (liveness).
    pub(super) fn pick_launches(&self, st: &mut RunState, launches: &mut Vec<TaskId>) {
        if self.launch_memory_retries(st, launches) == Retries::HoldTheRest {
            return;
        }
        self.launch_streaming_operators(st, launches);
        self.launch_downstream_first(st, launches);
        self.launch_for_liveness(st, launches);
    }

    /// The slots of each pool usable now: the CPU pool's, and the accelerator pool's
    /// current target (it grows while every accelerator is busy and tasks wait).
    fn slots_now(&self, st: &RunState) -> [usize; 2] {
        [
            self.pool_slots(Pool::Cpu),
            st.accelerator_target
                .min(self.pool_slots(Pool::Accelerator))
                .max(1),
        ]
    }

    /// Tasks refused memory run again before anything else: one whose sort was refused
    /// runs again with its sorts in pieces as soon as its pool has a slot; one refused
    /// again runs alone, once every slot is empty, and nothing launches while it waits or
    /// runs.
    fn launch_memory_retries(&self, st: &mut RunState, launches: &mut Vec<TaskId>) -> Retries {
        if st.running_alone.is_some() {
            return Retries::HoldTheRest;
        }
        while let Some(&task) = st.waiting_in_pieces.front() {
            let pool = pool_index(self.graph.operators[st.tasks[task].operator].pool);
            if st.running[pool] >= self.slots_now(st)[pool] {
                return Retries::HoldTheRest;
            }
            st.waiting_in_pieces.pop_front();
            self.mark_running(st, task);
            launches.push(task);
        }
        let Some(&task) = st.waiting_alone.front() else {
            return Retries::None;
        };
        if st.running.iter().sum::<usize>() == 0 {
            st.waiting_alone.pop_front();
            self.mark_running(st, task);
            st.running_alone = Some(task);
            launches.push(task);
        }
        Retries::HoldTheRest
    }

    /// Operators that stream their inputs (a join reading its probe side as it comes) run
    /// beside the pools' slots: every ready task of one whose inputs were asked for starts.
    fn launch_streaming_operators(&self, st: &mut RunState, launches: &mut Vec<TaskId>) {
        for op in &self.graph.operators {
            if self.streams_inputs(op.id)
                && st.operators[op.id].has_pending()
                && self.gate_open(st, op.id)
            {
                self.take_pending(st, op.id, usize::MAX, launches);
            }
        }
    }

    /// Fill the free slots, a task at a time, each to the most downstream operator with a
    /// task ready (or a paused task whose reader caught up) whose pool has a slot and that
    /// no launch rule holds back. A gang's tasks all start at once, in an empty pool.
    fn launch_downstream_first(&self, st: &mut RunState, launches: &mut Vec<TaskId>) {
        let mut slots = self.slots_now(st);
        let rules = launch_rules(self.policy);
        let now = Instant::now();
        'fill: loop {
            for op in self.graph.operators.iter().rev() {
                let resumable = self.resumable(st, op.id);
                if !st.operators[op.id].has_pending() && resumable.is_none()
                    || !self.gate_open(st, op.id)
                {
                    continue;
                }
                let pool = pool_index(op.pool);
                if op.pool == Pool::Accelerator {
                    self.grow_accelerators(st, &mut slots[pool]);
                }
                if st.running[pool] >= slots[pool] && !(op.gang && st.running[pool] == 0) {
                    continue;
                }
                if let Some(index) = resumable {
                    self.resume(st, op.id, index, false);
                    continue 'fill;
                }
                if let Some(rule) = rules.iter().find(|r| r.holds_back(self, st, op)) {
                    if rule.is_backpressure() {
                        st.operators[op.id].backpressured_since.get_or_insert(now);
                    }
                    continue;
                }
                self.end_backpressure(st, op.id, now);
                let n = if op.gang { usize::MAX } else { 1 };
                self.take_pending(st, op.id, n, launches);
                continue 'fill;
            }
            break;
        }
    }

    /// Tasks wait for the accelerator pool: grow it by one worker if every one is busy.
    fn grow_accelerators(&self, st: &mut RunState, slots: &mut usize) {
        let pool = pool_index(Pool::Accelerator);
        let grown =
            policy::grow_accelerators(st.running[pool], *slots, self.pool_slots(Pool::Accelerator));
        if grown > *slots {
            *slots = grown;
            st.accelerator_target = grown;
            self.accelerators.ensure_workers(grown);
        }
    }

    /// Liveness: never leave every pool idle while a task is ready and nothing else can
    /// make progress: no streaming task runs, or every one waits for blocks that no
    /// running task will produce. (A streaming task busy with blocks it has will release
    /// them, or come to wait, and so reach this rule again.) A paused task resumes first:
    /// it was started before any pending one, so readers (which read in launch order) are
    /// likelier to wait on it. Otherwise the most downstream ready task starts, whatever
    /// the launch rules say.
    fn launch_for_liveness(&self, st: &mut RunState, launches: &mut Vec<TaskId>) {
        if !self.stalled(st) {
            return;
        }
        let operators = || self.graph.operators.iter().rev();
        if let Some(op) = operators().find(|op| !st.operators[op.id].paused.is_empty()) {
            self.resume(st, op.id, 0, true);
        } else if let Some(op) =
            operators().find(|op| st.operators[op.id].has_pending() && self.gate_open(st, op.id))
        {
            self.end_backpressure(st, op.id, Instant::now());
            let n = if op.gang { usize::MAX } else { 1 };
            self.take_pending(st, op.id, n, launches);
        }
    }

    /// Whether no task can make progress by itself: no slot runs a task, every streaming
    /// task waits for blocks, and the query's reader is not about to read the root's
    /// unread output (it would free the root's paused tasks: a slow client holds the
    /// query back instead of the liveness rule running it to its end).
    pub(super) fn stalled(&self, st: &RunState) -> bool {
        let reader_will_read = self.root_output_held(st) && st.output_blocked == 0;
        let in_slots = st.running.iter().sum();
        // A task in a slot moves by itself: no need to look for uncounted waits.
        let shared_build = match in_slots {
            0 => self.waiting_on_a_shared_build(st),
            _ => 0,
        };
        policy::stalled(
            in_slots,
            st.streaming_waiting + shared_build,
            st.streaming_running,
        ) && !reader_will_read
    }

    /// Streaming tasks that wait on another task's build side: the tasks of an operator run
    /// one plan, whose `CollectLeft` hash join collects its build side once, in the first
    /// task that asks, while the others wait for it without reading any input. So while a
    /// task of an operator waits for build blocks, its running tasks that have read no
    /// input yet wait too (uncounted, they kept a query over 100-row blocks from ever
    /// counting as stalled: TPC-H Q16 hung).
    fn waiting_on_a_shared_build(&self, st: &RunState) -> usize {
        let mut waiting = 0;
        for op in &self.graph.operators {
            if st.operators[op.id].running == 0 || !self.streams_inputs(op.id) {
                continue;
            }
            let running = || {
                (st.operators[op.id].partitions.iter())
                    .flat_map(|p| &p.tasks)
                    .map(|t| &st.tasks[*t])
                    .filter(|t| t.status == TaskStatus::Running)
            };
            if running().any(|t| t.build_waits > 0) {
                waiting += running().filter(|t| !t.read_an_input).count();
            }
        }
        waiting
    }

    /// Whether the root operator (run in tasks) holds output the query's reader has not read.
    pub(super) fn root_output_held(&self, st: &RunState) -> bool {
        !self.root_runs_in_output() && st.operators[self.graph.root().id].held_rows > 0
    }

    /// Index in `op`'s paused tasks of one whose readers caught up (its unread output fell
    /// to half the pause threshold), if any.
    pub(super) fn resumable(&self, st: &RunState, op_id: OperatorId) -> Option<usize> {
        let paused = &st.operators[op_id].paused;
        if paused.is_empty() {
            return None;
        }
        let pause_rows = self.pause_rows(op_id)?;
        let resume_rows = policy::resume_rows(pause_rows);
        paused.iter().position(|p| {
            let held = st.tasks[p.task].held_rows;
            held <= resume_rows || p.yielded && held < pause_rows
        })
    }

    /// Whether a more downstream CPU operator has a task ready to start and no CPU slot to
    /// start it in: a running CPU task of `op_id` then gives its slot up at its next batch
    /// (downstream first, at batch boundaries as well as at launch), so work near the output
    /// is not stuck behind a long split upstream.
    pub(super) fn downstream_waits_for_a_slot(&self, st: &RunState, op_id: OperatorId) -> bool {
        let cpu = pool_index(Pool::Cpu);
        if st.running[cpu] < self.pool_slots(Pool::Cpu) || st.running_alone.is_some() {
            return false;
        }
        let rules = launch_rules(self.policy);
        self.graph.operators[op_id + 1..].iter().any(|op| {
            op.pool == Pool::Cpu
                && !op.gang
                && st.operators[op.id].has_pending()
                && self.gate_open(st, op.id)
                && !rules.iter().any(|rule| rule.holds_back(self, st, op))
        })
    }

    /// Hand a slot back to paused task `index` of `op`. `for_liveness`: it was resumed
    /// because nothing else could make progress, so it runs to its end without pausing.
    pub(super) fn resume(
        &self,
        st: &mut RunState,
        op_id: OperatorId,
        index: usize,
        for_liveness: bool,
    ) {
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
    pub(super) fn pause_rows(&self, op_id: OperatorId) -> Option<u64> {
        let op = &self.graph.operators[op_id];
        if !self.policy.pauses_tasks() || op.pool != Pool::Cpu || self.streams_inputs(op_id) {
            return None;
        }
        // Out of core, a paused task would keep its operator state (a sort's merge buffers)
        // while the slot it gave back starts another: its output spills instead.
        if self.graph.sizing.out_of_core() && op.stateful {
            return None;
        }
        let limit = self.output_queue_limit(op_id)?;
        Some(policy::pause_rows(limit, self.config.block_rows()))
    }

    /// In-task backpressure, as Ray Data's streaming generators pause: a task whose unread
    /// output reached `pause_rows` ([`Self::pause_rows`] of its operator) gives its slot
    /// back and waits until the scheduler resumes it (its readers caught up and a slot is
    /// free), so a split of a million rows does not pile up in the store ahead of a slower
    /// reader. A task also gives its slot up while a more downstream operator waits for one
    /// ([`Self::downstream_waits_for_a_slot`]), and resumes when a slot is free again.
    pub(super) async fn pause_while_ahead(self: &Arc<Self>, task: TaskId, pause_rows: u64) {
        let resumed = {
            let mut st = self.state.lock().unwrap();
            let t = &st.tasks[task];
            let op_id = t.operator;
            // A task running alone (refused memory beside others) never pauses: nothing
            // launches while it runs, its own resume included, so it would wait forever.
            let alone = st.running_alone == Some(task);
            if t.unpausable || alone || st.error.is_some() || st.cancelled {
                return;
            }
            let yielded = t.held_rows < pause_rows;
            if yielded && !self.downstream_waits_for_a_slot(&st, op_id) {
                return;
            }
            let (resume, resumed) = tokio::sync::oneshot::channel();
            st.running[pool_index(Pool::Cpu)] -= 1;
            st.operators[op_id].paused.push(PausedTask {
                task,
                resume,
                yielded,
            });
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
        OperatorStats::add(&self.stats(st.tasks[task].operator).backpressure_ns, waited);
    }

    /// `op` is no longer held back: count the time it was.
    pub(super) fn end_backpressure(&self, st: &mut RunState, op_id: OperatorId, now: Instant) {
        if let Some(since) = st.operators[op_id].backpressured_since.take() {
            OperatorStats::add(
                &self.stats(op_id).backpressure_ns,
                (now - since).as_nanos() as u64,
            );
        }
    }

    /// An operator is held back while its unconsumed output is over its share of the
    /// budget, or the store's memory is full, or its consumer (a per-block operator, or the
    /// query's reader for the root) already has enough input queued to stay busy
    /// ([`Self::queue_limit_rows`]), so memory follows the pipeline's slowest stage, not the
    /// table's size. Operators feeding a per-partition
    /// operator (an all-to-all exchange) are never held back: their blocks spill instead.
    pub(super) fn backpressured(&self, st: &RunState, op_id: OperatorId) -> bool {
        let share = self.store.budget() / self.graph.operators.len().max(1) as u64;
        let consumer = self.graph.consumer[op_id].map(|c| &self.graph.operators[c]);
        let os = &st.operators[op_id];
        policy::held_back(&policy::ProducerLoad {
            // An exchange, or a run-sorting consumer (it gathers a run of each partition
            // before it starts): either needs its producer's blocks of every partition.
            feeds_exchange: consumer.is_some_and(|c| {
                c.input_reading().needs_every_partition() && c.id != self.graph.root().id
            }),
            feeds_streamed_input: self.feeds_streamed_input(op_id),
            queue_limit: self.output_queue_limit(op_id),
            held_rows: os.held_rows,
            held_bytes: os.held_bytes,
            share,
            store_bytes: self.store.memory_bytes(),
            budget: self.store.budget(),
        })
    }

    /// Whether `op`'s output is a streamed input of its consumer: released as it is read,
    /// so its queue can be bounded. An input fed to workers is not: its blocks are held
    /// until the task they were fed to ends, as a barrier's inputs are.
    pub(super) fn feeds_streamed_input(&self, op_id: OperatorId) -> bool {
        self.graph.consumer[op_id].is_some_and(|c| {
            let consumer = &self.graph.operators[c];
            self.streams_inputs(c)
                && (consumer.inputs.iter().zip(&consumer.streamed_inputs))
                    .enumerate()
                    .any(|(input, (p, streamed))| {
                        *p == op_id && *streamed && !self.fed_on_workers(c, input)
                    })
        })
    }

    /// The most rows of unread output `op` may queue when its reader consumes blocks as
    /// they come: a per-block consumer, a streamed join input, or the query's reader
    /// ([`Self::queue_limit_rows`]). `None` when its output is read whole by an exchange.
    pub(super) fn output_queue_limit(&self, op_id: OperatorId) -> Option<u64> {
        let producer_pool = self.graph.operators[op_id].pool;
        match self.graph.consumer[op_id].map(|c| &self.graph.operators[c]) {
            Some(c)
                if c.input_reading() == InputReading::AsTheyCome
                    || self.feeds_streamed_input(op_id) =>
            {
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
    /// producer on `producer` refills the queue: a bundle of `flumen.target_block_rows`
    /// for each slot of either pool (every consumer slot has its next bundle waiting, and
    /// every producer slot may have a task in flight whose blocks land in the queue).
    pub(super) fn queue_limit_rows(&self, consumer: Pool, producer: Pool) -> u64 {
        policy::queue_limit_rows(
            self.pool_slots(consumer),
            self.pool_slots(producer),
            self.config.block_rows(),
        )
    }

    /// Mark up to `n` pending tasks of `op` running, round-robin over its partitions, and
    /// add them to `launches`.
    pub(super) fn take_pending(
        &self,
        st: &mut RunState,
        op_id: OperatorId,
        mut n: usize,
        launches: &mut Vec<TaskId>,
    ) {
        let partitions = st.operators[op_id].partitions.len();
        let mut idle_rounds = 0;
        while n > 0 && idle_rounds < partitions {
            let p = st.operators[op_id].next_partition % partitions;
            st.operators[op_id].next_partition = (p + 1) % partitions;
            let ps = &mut st.operators[op_id].partitions[p];
            if ps.next_launch < ps.tasks.len() {
                let task = ps.tasks[ps.next_launch];
                ps.next_launch += 1;
                self.mark_running(st, task);
                launches.push(task);
                n -= 1;
                idle_rounds = 0;
            } else {
                idle_rounds += 1;
            }
        }
    }

    /// Count task `task` running: in its pool's slots, or beside them when its operator
    /// streams its inputs.
    fn mark_running(&self, st: &mut RunState, task: TaskId) {
        let op_id = st.tasks[task].operator;
        st.tasks[task].status = TaskStatus::Running;
        st.tasks[task].launched = Some(Instant::now());
        st.operators[op_id].running += 1;
        if self.streams_inputs(op_id) {
            st.streaming_running += 1;
        } else {
            st.running[pool_index(self.graph.operators[op_id].pool)] += 1;
        }
        OperatorStats::add(&self.stats(op_id).running, 1);
    }

    pub(super) fn launch(self: &Arc<Self>, task: TaskId) {
        let op_id = self.state.lock().unwrap().tasks[task].operator;
        let run = Arc::clone(self);
        let on_accelerator = self.graph.operators[op_id].pool == Pool::Accelerator;
        let future = async move {
            let started = Instant::now();
            let result = std::panic::AssertUnwindSafe(run.run_task(task))
                .catch_unwind()
                .await;
            let result = match result {
                Ok(r) => r,
                Err(panic) => Err(run.panic_error(task, panic)),
            };
            if on_accelerator {
                // The models loaded on this worker thread say how they ran (batch sizes
                // chosen), and the model-output cache what it read, before the task counts
                // as finished and the query may end.
                let mut figures = crate::functions::accelerator::used_worker_metrics();
                figures.extend(crate::functions::model_cache::take_figures());
                run.stats(op_id).observe_model_metrics(figures);
            }
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
}

/// Whether the retries of tasks refused memory let other tasks launch now.
#[derive(Debug, PartialEq, Eq)]
enum Retries {
    /// None waits: other tasks may launch.
    None,
    /// One runs alone, waits to, or waits for its pool's slot: nothing else launches.
    HoldTheRest,
}
