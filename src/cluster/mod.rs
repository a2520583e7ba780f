//! Worker processes (`flumen.workers = 'process'`).
//!
//! - [`auth`]: the driver's secret that every call to a worker must carry.
//! - [`admission`]: what a worker agrees to run (plan nodes, granted files, settings).
//! - [`tls`]: encryption of the worker protocol (required off loopback).
//! - [`protocol`]: what driver and worker say to each other (task requests, block info).
//! - [`task_plan`]: a task's plan on the wire (datafusion-proto plus what it drops) and the
//!   driver's check that a worker decodes the plan that was planned.
//! - [`worker`]: the worker process: an Arrow Flight server that runs task plans.
//! - [`worker_command`]: `flumen worker`'s options and start-up, shared with the Python
//!   package's `python -m flumen worker`.
//! - [`shipped_functions`]: functions of another runtime (Python) that travel inside the
//!   task plans that call them.
//! - [`worker_tasks`]: how a worker runs one task and hands out its blocks as it cuts them.
//! - [`worker_memory`]: a worker task's operators, within its query's budget beside its
//!   blocks.
//! - [`block_shelf`]: the blocks a worker keeps, each under the query that owns it.
//! - [`worker_pool`]: the driver's side: starting (or attaching to), watching and replacing
//!   workers, placing tasks on them and fetching blocks from them.
//! - [`membership`]: which running workers a driver attached to a cluster uses
//!   (`flumen.cluster`).
//! - `kubernetes`: finding worker pods through the Kubernetes API (cargo feature
//!   `kubernetes`, on by default).

pub mod admission;
pub mod auth;
pub(crate) mod block_shelf;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
pub mod membership;
pub mod protocol;
pub mod shipped_functions;
pub mod task_plan;
pub mod tls;
pub(crate) mod worker;
pub mod worker_command;
pub(crate) mod worker_memory;
pub(crate) mod worker_pool;
pub(crate) mod worker_tasks;

pub use worker::{WorkerSettings, serve};
pub use worker_pool::{WorkerPool, WorkerPoolSlot};
