//! Worker processes (`flumen.workers = 'process'`).
//!
//! - [`auth`]: the driver's secret that every call to a worker must carry.
//! - [`admission`]: what a worker agrees to run (plan nodes, granted files, settings).
//! - [`tls`]: encryption of the worker protocol (required off loopback).
//! - [`protocol`]: what driver and worker say to each other (task requests, block info).
//! - [`task_plan`]: a task's plan on the wire (datafusion-proto plus what it drops) and the
//!   driver's check that a worker decodes the plan that was planned.
//! - [`cast_fields`]: a cast to a field of its own (a union's nullable columns), which proto
//!   drops, carried whole.
//! - [`bound_reads`]: a scan's read of an aggregate's complete bounds, flumen's own
//!   expression, carried whole.
//! - [`key_sets`]: a test of probe keys against a build side's key set, flumen's own
//!   expression, carried whole.
//! - [`topk_nodes`]: DataFusion's per-partition TopK, which proto cannot encode, carried as
//!   a flumen node.
//! - [`window_calls`]: what proto drops of a window function's call (`IGNORE NULLS`, a
//!   reversed call), carried or refused.
//! - [`worker`]: the worker process: an Arrow Flight server that runs task plans.
//! - [`worker_command`]: `flumen worker`'s options and start-up, shared with the Python
//!   package's `python -m flumen worker`.
//! - [`shipped_functions`]: functions of another runtime (Python) that travel inside the
//!   task plans that call them.
//! - [`worker_tasks`]: how a worker runs one task and hands out its blocks as it cuts them.
//! - [`task_output`]: what a running worker task hands out, in order.
//! - [`task_watch`]: what a worker's running tasks tell besides their blocks (tightened
//!   bounds, work without output), looked at from a thread of their own.
//! - [`sent_bounds`]: the bounds a worker's task made, carried to the driver as they
//!   tighten and at its end.
//! - [`sent_keys`]: a join's build keys sent with a task of its build producer, and the
//!   summary of its output's keys sent back.
//! - [`worker_memory`]: a worker task's operators, within its query's budget beside its
//!   blocks.
//! - [`block_shelf`]: the blocks a worker keeps, each under the query that owns it.
//! - [`worker_client`]: the driver's Flight client of one worker: connecting with the
//!   secret, the hello that refuses a non-worker or another protocol, why a call failed.
//! - [`worker_handle`]: the driver's handle of one worker (its calls, liveness, running
//!   tasks) and the blocks it holds for the driver.
//! - [`worker_start`]: where a pool's workers come from: processes started on this host,
//!   or running workers of a cluster attached to.
//! - [`worker_pool`]: the driver's pool of workers: watching and replacing them, placing
//!   tasks on them, retrying a task whose worker died or stuck.
//! - [`on_driver`]: why a worker-mode task ran on the driver, counted per reason.
//! - [`plan_metrics`]: DataFusion's counters of a worker's task plan, carried back.
//! - [`membership`]: which running workers a driver attached to a cluster uses
//!   (`flumen.cluster`).
//! - `kubernetes`: finding worker pods through the Kubernetes API (cargo feature
//!   `kubernetes`, on by default).

pub mod admission;
pub mod auth;
pub(crate) mod block_shelf;
pub(crate) mod bound_reads;
pub(crate) mod cast_fields;
pub(crate) mod key_sets;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
pub mod membership;
pub mod on_driver;
pub mod plan_metrics;
pub mod protocol;
pub(crate) mod scan_formats;
pub mod sent_bounds;
pub mod sent_keys;
pub mod shipped_functions;
pub(crate) mod task_output;
pub mod task_plan;
pub(crate) mod task_watch;
pub mod tls;
pub(crate) mod topk_nodes;
pub(crate) mod window_calls;
pub(crate) mod worker;
pub(crate) mod worker_client;
pub mod worker_command;
pub(crate) mod worker_handle;
pub(crate) mod worker_memory;
pub(crate) mod worker_pool;
pub(crate) mod worker_start;
pub(crate) mod worker_tasks;

pub use worker::{WorkerSettings, serve};
pub use worker_pool::{WorkerPool, WorkerPoolSlot};
