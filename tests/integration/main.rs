//! flumen's integration tests, one module per subject, linked into one test binary.
//!
//! Every test binary links the whole of DataFusion (~230 MB in a dev build), so one binary
//! for all of them keeps a clean `cargo test` within a small CI disk and saves a link per
//! file. Run one subject with `cargo test --test integration cluster::` (a module path is a
//! name filter). What must stay a binary of its own does: `embedding` (the GPU checks run it
//! alone), `counting_allocator` (its own global allocator), `sqllogictests` (its own
//! harness) and `kubernetes` (a feature of its own).

#[path = "../common/mod.rs"]
mod common;

/// The `fault_worker` example's fault functions, registered on the drivers of the fault tests.
#[path = "../../examples/fault_worker.rs"]
#[allow(dead_code)]
mod fault_worker;

/// The sqllogictest runner's `EXPLAIN ANALYZE` fact parser, tested by `metric_facts`.
#[path = "../sqllogictests/metric_facts.rs"]
#[allow(dead_code)]
mod metric_fact_parser;

mod aggregate_merges;
mod bad_inputs;
mod cli;
mod cluster;
#[cfg(feature = "delta")]
mod delta_writes;
mod executor;
mod explain;
#[cfg(feature = "delta")]
mod incremental;
mod lakehouse;
mod metric_facts;
mod model_cache;
mod out_of_core;
mod output;
mod output_crash;
mod python;
mod query_fuzz;
mod serve;
mod worker_answers;
mod worker_safety;
mod workers;
