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
//! See `docs/architecture.md` for how the modules fit together.

pub mod accelerator;
pub mod block_store;
pub mod config;
pub mod exec;
pub mod lineage;
pub mod operators;
pub mod planner;
pub mod pools;
pub mod scheduler;
pub mod split_source;
pub mod stage_input;
pub mod stats;

use std::sync::Arc;

use datafusion::execution::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};

pub use accelerator::{AcceleratorFunction, accelerator_udf};
pub use config::{ByteSize, ExecMode, FlumenConfig};
pub use lineage::{BlockDropper, BlockInfo};
pub use planner::FlumenQueryPlanner;

/// A DataFusion `SessionContext` whose queries run on flumen, with default DataFusion
/// settings and the given flumen settings.
pub fn session(config: FlumenConfig) -> SessionContext {
    session_with_config(SessionConfig::new(), config)
}

/// A flumen `SessionContext` built on the caller's DataFusion `SessionConfig`.
pub fn session_with_config(session_config: SessionConfig, config: FlumenConfig) -> SessionContext {
    SessionContext::new_with_state(
        SessionStateBuilder::new()
            .with_config(flumen_session_config(session_config, config))
            .with_default_features()
            .with_query_planner(Arc::new(FlumenQueryPlanner::default()))
            .build(),
    )
}

/// Add flumen's settings, worker pools and required DataFusion options to a session config.
pub fn flumen_session_config(session_config: SessionConfig, config: FlumenConfig) -> SessionConfig {
    let mut session_config = session_config
        .with_option_extension(config)
        .with_extension(Arc::new(pools::AcceleratorPool::default()));
    // Each source split must always read the same rows (lineage): no work stealing
    // between the partitions of a scan.
    session_config
        .options_mut()
        .execution
        .enable_file_stream_work_stealing = false;
    session_config
}

/// Turn an existing DataFusion `SessionContext` into a flumen one, keeping its catalogs,
/// tables, functions and settings.
pub fn into_flumen(ctx: &SessionContext, config: FlumenConfig) -> SessionContext {
    let state = ctx.state();
    let session_config = flumen_session_config(state.config().clone(), config);
    let state = SessionStateBuilder::new_from_existing(state)
        .with_config(session_config)
        .with_query_planner(Arc::new(FlumenQueryPlanner::default()))
        .build();
    SessionContext::new_with_state(state)
}
