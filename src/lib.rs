//! flumen: DataFusion with a streaming batch executor.
//!
//! A query is planned and optimized by DataFusion, then cut into operators (stages) whose
//! tasks each process one block (or one partition) at a time. flumen's scheduler runs the
//! tasks on a CPU pool and an accelerator pool under a memory budget with backpressure;
//! every block records its lineage so a lost block is recomputed.
//!
//! ```no_run
//! # async fn demo() -> datafusion::error::Result<()> {
//! let ctx = flumen::session(flumen::FlumenConfig::default());
//! ctx.sql("SELECT 1").await?.show().await?;
//! # Ok(()) }
//! ```
//!
//! # Module organization
//!
//! In the order a block meets them (`docs/architecture.md` walks one through):
//! - [`session`]: flumen sessions (constructors, function and table-format registration).
//! - [`plan`]: DataFusion's physical plan cut into an operator graph.
//! - [`exec`]: one run of the graph: task creation, scheduling policy, task execution,
//!   block streams, lineage recompute, remote tasks, the in-process accelerator pool.
//! - [`store`]: blocks, where each lives (memory, spill, worker), the block cutter.
//! - [`cluster`]: worker processes, their protocol and the driver's pools of them.
//! - [`io`]: object stores, output commit, Delta Lake and Iceberg tables.
//! - [`functions`]: SQL functions: accelerator UDFs, `embed`, text and vector helpers.
//! - [`serve`]: `flumen serve`, the Arrow Flight SQL server.
//! - [`config`]: the `flumen.*` settings; [`demo`] and [`feature_job`]: the demo table and
//!   the main job; `checkpoint` and `incremental`: resumable and incremental extraction.
//!
//! # Cargo features
//!
//! An embedder compiles only the parts it uses (all three are on by default):
//! - `delta`: Delta Lake tables (`STORED AS DELTATABLE`, `INSERT INTO`, `table_changes`) and
//!   `incremental` (a Delta feature table kept in step with its source).
//! - `kubernetes`: worker pods found through the Kubernetes API.
//! - `cli`: the `flumen` binary (REPL, progress bars, jemalloc).

#![warn(missing_docs)]

pub mod checkpoint;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod exec;
pub mod feature_job;
pub mod functions;
#[cfg(feature = "delta")]
pub mod incremental;
pub mod io;
pub mod plan;
pub mod serve;
pub mod session;
pub mod store;

pub use cluster::{WorkerSettings, serve as serve_worker};
pub use config::{
    ByteSize, Device, EmbedPrecision, ExecMode, FlumenConfig, PreprocessOnCpu, WorkerBinary,
    WorkerMode,
};
pub use exec::{
    BlockDropper, BlockInfo, CheckedTask, FlumenExec, FlumenQueryPlanner, PlanCheckFault,
};
pub use functions::accelerator::{
    AcceleratorFunction, AcceleratorWorker, PendingOutput, WorkerResources, accelerator_udf,
};
pub use session::{
    flumen_session_config, into_flumen, logical_plan, register_functions, register_table_factories,
    reset_flumen_setting, reset_flumen_variable, session, session_with_config, sql, user_statement,
};
pub use store::counting_allocator::CountingAllocator;
pub use store::process_heap::{HeapAllocator, HeapUsage, install as install_heap_allocator};

/// `error` and its sources, joined by `: ` (tonic's transport errors keep the cause, a
/// refused certificate say, in their sources).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        // DataFusion's errors often print their cause already: say it once.
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(&format!(": {cause_text}"));
        }
        source = cause.source();
    }
    text
}

/// The message a panic carried (`panic!("...")` with a literal or a formatted string).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
