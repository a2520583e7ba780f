//! Execution: one run of an operator graph on flumen's streaming batch scheduler.
//!
//! - [`planner`]: the query planner that cuts DataFusion's plan and returns [`FlumenExec`].
//! - [`flumen_exec`]: [`FlumenExec`], the root node; executing it starts a [`run::QueryRun`].
//! - [`explain`]: how each operator shows in `EXPLAIN` (and its counters in `EXPLAIN ANALYZE`).
//! - [`metrics`]: per-operator and per-run counters ([`RunMetrics`]).
//! - The run, split by job: [`run`] (its state and life: start, schedule, task end,
//!   output), [`state`] (what the run knows of each task and operator), [`tasks`] (creating
//!   tasks as inputs arrive), [`cursor`] (walking an operator's output in order), [`policy`]
//!   (the mode and the scheduling rules, as plain functions), [`launch`] (slots,
//!   backpressure, pauses; [`launch_rules`]: what may hold an operator's next task back,
//!   per mode), [`task`] (running one task, its output cut into blocks),
//!   [`streams`] (block streams for tasks and the query's output).
//! - [`lineage`]: fetching a block, and recomputing it from its producer task when lost;
//!   [`task_kind`]: a task's id and what it reads (what lineage runs again);
//!   [`fault_hooks`]: the tests' hooks that drop blocks as a dead worker would, and fail a
//!   task's plan check.
//! - [`replan`]: an in-core run refused memory before its first output, planned again out
//!   of core.
//! - [`build_bound_reads`]: in worker mode, a join's probe-side scans held until its build
//!   side is complete, then started from the bound its tasks' key summaries make.
//! - [`slices`]: a join's hot partition, refused memory, cut into slices of its build side.
//! - [`remote_tasks`]: tasks run in worker processes, and recovering a dead worker's blocks;
//!   [`worker_plans`]: the plan a worker runs for one task; [`task_feed`]: a worker's join
//!   task fed its probe input as its producers make it.
//! - A task as a value: [`task_spec`] (what a task runs and where, decided once at launch),
//!   [`task_runner`] (its two runners: in process, on a worker), [`task_sink`] (where its
//!   blocks go: the store, or back in place of lost ones, with one determinism check).
//! - [`worker_run`]: what a run keeps of its worker processes (pools, lost blocks, token);
//!   [`plan_checks`]: the check that a worker decodes a task's plan as planned, run beside
//!   the task, its output held until the check passes.
//! - [`accelerator_threads`]: the in-process accelerator pool (threads that keep models).
//! - [`progress`]: a running query's progress in words (one line per operator).

pub(crate) mod accelerator_threads;
pub(crate) mod build_bound_reads;
pub(crate) mod cursor;
pub(crate) mod explain;
pub(crate) mod fault_hooks;
pub(crate) mod flumen_exec;
pub(crate) mod launch;
pub(crate) mod launch_rules;
pub(crate) mod lineage;
pub(crate) mod metrics;
pub(crate) mod plan_checks;
pub(crate) mod planner;
pub(crate) mod policy;
pub mod progress;
pub(crate) mod remote_tasks;
pub(crate) mod replan;
pub(crate) mod run;
pub(crate) mod slices;
pub(crate) mod state;
pub(crate) mod streams;
pub(crate) mod task;
pub(crate) mod task_feed;
pub(crate) mod task_kind;
pub(crate) mod task_runner;
pub(crate) mod task_sink;
pub(crate) mod task_spec;
pub(crate) mod tasks;
pub(crate) mod timeline;
pub(crate) mod worker_plans;
pub(crate) mod worker_run;

pub use crate::cluster::on_driver::{DriverTasks, OnDriver};
pub use accelerator_threads::AcceleratorPool;
pub use fault_hooks::{BlockDropper, BlockInfo, CheckedTask, PlanCheckFault};
pub use flumen_exec::FlumenExec;
pub use metrics::{OperatorStats, RunMetrics, StatsSnapshot};
pub use planner::FlumenQueryPlanner;
pub use progress::operator_progress;
