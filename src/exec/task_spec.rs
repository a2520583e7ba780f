//! A task as a value: what it reads and runs ([`TaskSpec`]), and where it runs
//! ([`TaskPlace`]), decided once when it launches.
//!
//! In threads mode every task runs in process. In worker mode ([`QueryRun::place_task`]) a
//! task goes to a worker when a worker can run it: its plan is cut out (a source split, its
//! input blocks, or a whole partition of each stage input), encodes, and decodes as planned;
//! else it runs on the driver with its reason ([`OnDriver`]), counted and shown by
//! `EXPLAIN ANALYZE`. A task run again for lost blocks ([`QueryRun::spec_again`]) runs
//! where its first run did when that pool is still up. A runner
//! ([`crate::exec::task_runner`]) runs a spec into a sink ([`crate::exec::task_sink`]).

use std::sync::Arc;

use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::error::Result;

use crate::cluster::on_driver::OnDriver;
use crate::cluster::worker_pool::WorkerPool;
use crate::exec::plan_checks::{self, PlanCheck};
use crate::exec::run::QueryRun;
use crate::exec::task_kind::{TaskId, TaskKind};
use crate::exec::worker_plans::{PartitionInputs, admitted_on_workers, blocks_plan, source_plan};
use crate::plan::graph::OperatorId;

/// One task of a run: which it is, and where it runs.
#[derive(Debug)]
pub(super) struct TaskSpec {
    /// Its index in the run.
    pub task: TaskId,
    /// The operator it is a task of.
    pub operator: OperatorId,
    /// The operator's partition it produces.
    pub partition: usize,
    /// What it reads.
    pub kind: TaskKind,
    /// "task T (partition P) of flumen operator O (name)", for errors and logs.
    pub describe: String,
    /// Where it runs.
    pub place: TaskPlace,
}

/// Where a task runs.
#[derive(Debug)]
pub(super) enum TaskPlace {
    /// A worker of this pool runs the plan cut out for it. A per-partition task's input
    /// blocks (`inputs`, per stage input and partition read) are released when it succeeds.
    Worker {
        /// The pool of the task's operator (CPU or accelerator workers).
        pool: Arc<WorkerPool>,
        /// A per-partition task's input blocks.
        inputs: Option<PartitionInputs>,
        /// The check that the worker decodes its plan as planned, when one is still to be
        /// waited on: the task is sent at once, and its output counts once it passed.
        check: Option<PlanCheck>,
    },
    /// This process runs its fragment: in threads mode (`None`), or in worker mode for the
    /// reason given.
    InProcess(Option<OnDriver>),
}

impl QueryRun {
    /// Task `task` placed at `place`.
    pub(super) fn task_spec(&self, task: TaskId, place: TaskPlace) -> TaskSpec {
        let (operator, partition, kind) = self.task_identity(task);
        TaskSpec {
            task,
            operator,
            partition,
            kind,
            describe: format!(
                "task {task} (partition {partition}) of flumen operator {operator} ({})",
                self.graph.operators[operator].name
            ),
            place,
        }
    }

    /// Where task `task` of a worker-mode run goes, checked before any of its inputs is
    /// fetched: to a worker when its plan can be cut out, is one a worker runs, encodes and
    /// decodes as planned; else in process, with the reason. Starts its operator's pool if
    /// need be.
    pub(super) async fn place_task(self: &Arc<Self>, task: TaskId) -> Result<TaskSpec> {
        let in_process = |why| Ok(self.task_spec(task, TaskPlace::InProcess(Some(why))));
        let Some(slot) = self.worker_slot() else {
            return in_process(OnDriver::NotCut("the session has no worker pool".into()));
        };
        let (op_id, partition, kind) = self.task_identity(task);
        // A task running again with its sorts in pieces runs here, where that setting is
        // made (`QueryRun::task_context`).
        if self.state.lock().unwrap().tasks[task].sorts_in_pieces {
            return in_process(OnDriver::SortsInPieces);
        }
        let op = &self.graph.operators[op_id];
        // The plan it would run over empty inputs, to check that it encodes. A per-partition
        // task's input blocks are listed now: what it reads, released when it succeeds.
        let mut inputs = None;
        let runnable = match &kind {
            TaskKind::Source { split } => source_plan(
                op,
                partition,
                *split,
                &self.store_grants(),
                &self.build_bounds_made_for(op_id),
            ),
            TaskKind::Blocks { .. } => {
                let schema = self.graph.operators[op.inputs[0]].fragment.schema();
                let empty = MemorySourceConfig::try_new_exec(&[vec![]], schema, None)?;
                blocks_plan(op, empty)
            }
            TaskKind::Partition | TaskKind::Slice { .. } => {
                self.partition_runnable(task).map(|(plan, blocks)| {
                    inputs = Some(blocks);
                    plan
                })
            }
        };
        let runnable = match runnable {
            Ok(plan) => plan,
            Err(why) => return in_process(why),
        };
        let pool = slot
            .get_or_start(op.pool, self.pool_settings(op.pool)?)
            .await?;
        if let Err(why) = admitted_on_workers(&runnable) {
            return in_process(why);
        }
        // Whether it encodes, and decodes as planned: checked beside the task for the
        // first task of its operator and kind (release builds; every task in debug ones),
        // which the others of that kind wait on. A kind found wrong runs here at once. A
        // later task whose plan, inputs filled in, does not encode is handed back by its
        // worker runner, with the reason (`run_worker_task`).
        let spec = self.task_spec(task, TaskPlace::InProcess(None));
        let check = self.plan_check(&runnable, &pool, &spec);
        let check = match check.verdict_now() {
            None => Some(check),
            Some(verdict) => match plan_checks::as_result(verdict)? {
                Some(why) => return in_process(why),
                None => None,
            },
        };
        Ok(TaskSpec {
            place: TaskPlace::Worker {
                pool,
                inputs,
                check,
            },
            ..spec
        })
    }

    /// Where task `task` runs again for lost blocks of it: on a worker of its pool when it
    /// first ran on a worker and that pool is still up, else in process.
    pub(super) async fn spec_again(&self, task: TaskId) -> TaskSpec {
        let (op_id, _, _) = self.task_identity(task);
        let pool = match (self.ran_on_worker(task), self.worker_slot()) {
            (true, Some(slot)) => slot.current(self.graph.operators[op_id].pool).await,
            _ => None,
        };
        let place = match pool {
            Some(pool) => TaskPlace::Worker {
                pool,
                inputs: None,
                check: None,
            },
            None => TaskPlace::InProcess(None),
        };
        self.task_spec(task, place)
    }

    /// Whether task `task` ran on a worker (a run again in process then runs the plan its
    /// worker ran, to cut the same blocks).
    pub(super) fn ran_on_worker(&self, task: TaskId) -> bool {
        self.workers.ran_on_worker.lock().unwrap().contains(&task)
    }
}
