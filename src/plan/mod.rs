//! Planning: DataFusion's optimized physical plan cut into flumen operators.
//!
//! - [`graph`]: the operator graph (operators, pools, task shapes, who feeds whom).
//! - [`cut`]: the cutting algorithm that turns a DataFusion plan into that graph.
//! - [`exchange_sizing`]: how many partitions hash exchanges get, from bytes and budget.
//! - [`split_source`]: source scans cut into splits (one task each).
//! - [`row_group_layout`]: the row groups of a plan's Parquet files, read from their footers
//!   before its scans are cut.
//! - [`split_pruning`]: the file and row group pruning a scan would do, done as it is cut.
//! - [`model_batching`]: how a plan with a model feeds it: the first-block ramp, pieces and
//!   bundles, and its scans' smaller splits.
//! - [`dynamic_filters`]: a copied plan's own dynamic filters, and the predicates that read
//!   them.
//! - [`join_filter_rows`]: a scan drops the rows its joins' finished dynamic filters reject.
//! - [`build_bounds`]: in worker mode, the scans of a join's probe side wait for its build
//!   side, and start from a bound of its keys (nothing to read if it came out empty).
//! - [`build_keys`]: a build side's keys summed up (range and list) where its blocks are made.
//! - [`key_membership`]: the set of a build side's keys (a Bloom filter) and the test of a
//!   probe row against it.
//! - [`stage_input`]: the leaf through which a fragment reads its producer's blocks.
//! - [`accelerator_projection`]: model UDF projections kept apart as accelerator operators.
//! - [`model_cache_lookup`]: the model-output cache's lookup planned into the CPU stage
//!   before a model, and its fill around the model call.
//! - [`queued_model_calls`]: an accelerator projection's stream, which queues the next piece
//!   on the device before it waits for the current one.
//! - [`random_shuffle`]: `ORDER BY random()` planned as a seeded random shuffle.
//! - [`range_sort`]: an out-of-core full sort planned as sampled ranges, each sorted in a task.
//! - [`concat_partitions`]: partitions read one after the other (the output of both).
//! - [`merge_runs`]: a range's runs, sorted in the background as its blocks arrived, merged.
//! - [`merge_join_fallback`]: a hash join's task redone as a spilling sort-merge join.
//! - [`partition_cut`]: which per-partition fragments a worker runs one partition of.
//! - [`partitioned_outer_joins`]: in worker mode, outer and semi hash joins planned
//!   partitioned, so their partitions run apart.
//! - [`semi_joins_by_key_set`]: in worker mode, a semi or anti join with a small build side
//!   run as a join on the set of build keys its probe side matches.
//! - [`outer_join_constants`]: the constants of an outer join's NULL-padded side hidden from
//!   DataFusion's rules, so its sorts keep their keys.
//! - [`ordered_round_robins`]: round-robin exchanges over one sorted stream taken out, so
//!   its order holds.
//! - [`plain_hash_exchanges`]: hash exchanges that keep a sorted input's order made plain,
//!   so they are cut into tasks.
//! - [`partition_slices`]: which hash join tasks can be cut into slices of their build side.
//! - [`counted_set_operations`]: `INTERSECT ALL` and `EXCEPT ALL` that count copies
//!   (DataFusion 55 plans them as a plain semi and anti join).
//! - [`fixed_size_list_casts`]: casts of lists to fixed-size lists that read sliced lists
//!   right (arrow-cast 59 reads them from the start of their values).
//! - [`aggregate_bound_reads`]: scans read an aggregate's bound only where it bounds every
//!   aggregate (DataFusion leaves out those with no value yet).
//! - [`grouping_set_constants`]: sorts above grouping sets that keep every key (DataFusion
//!   takes a filter's constant through them).
//! - [`recursive_queries`]: a recursive query copied afresh for each run of its task.
//! - [`task_topk`]: the operator feeding a TopK keeps each task's first rows only.
//! - [`topk_before_models`]: a TopK over a projection that calls models taken first, so
//!   the models run on the rows it keeps only.
//! - [`subquery_values`]: a fragment that reads scalar subqueries' values from their own
//!   operators.
//! - [`dropped_clauses`]: clauses DataFusion 55 parses and drops or refuses (`GROUP BY ...
//!   WITH ROLLUP`, `FETCH FIRST n ROWS ONLY`), rewritten in the syntax tree.
//! - [`table_samples`]: `TABLESAMPLE` planned (DataFusion 55 parses it and drops it).
//! - [`sample_keys`]: a reproducible random key per row, for samples of relations that are
//!   not Parquet files.
//! - [`row_group_samples`]: `TABLESAMPLE SYSTEM` of a Parquet table: whole row groups, the
//!   others not read.

pub(crate) mod accelerator_projection;
pub mod aggregate_bound_reads;
pub mod build_bounds;
pub mod build_keys;
pub mod concat_partitions;
pub mod counted_set_operations;
pub(crate) mod cut;
pub mod dropped_clauses;
pub mod dynamic_filters;
pub mod exchange_sizing;
pub mod fixed_size_list_casts;
pub(crate) mod graph;
pub mod grouping_set_constants;
pub(crate) mod join_filter_rows;
pub mod key_membership;
pub mod merge_join_fallback;
mod merge_levels;
pub mod merge_runs;
pub mod model_batching;
pub(crate) mod model_cache_lookup;
pub mod ordered_round_robins;
pub mod outer_join_constants;
pub mod partition_cut;
pub mod partition_slices;
pub mod partitioned_outer_joins;
pub mod plain_hash_exchanges;
pub(crate) mod queued_model_calls;
pub mod random_shuffle;
pub mod range_sort;
pub(crate) mod recursive_queries;
pub(crate) mod row_group_layout;
pub mod row_group_samples;
pub mod sample_keys;
pub mod semi_joins_by_key_set;
pub(crate) mod split_pruning;
pub(crate) mod split_source;
pub(crate) mod stage_input;
pub mod subquery_values;
pub mod table_samples;
pub mod task_bounds;
pub(crate) mod task_topk;
#[cfg(test)]
pub(crate) mod test_plans;
pub mod topk_before_models;

pub use graph::{InputReading, Operator, OperatorGraph, Pool, TaskShape};
pub use model_batching::ModelBatching;
pub use split_source::SplitSourceExec;

use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;

/// Index of an operator inside its [`OperatorGraph`] (defined here, not in [`graph`], so
/// that the leaves a graph's fragments read through ([`stage_input`]) name their producer
/// without importing the graph that holds them).
pub type OperatorId = usize;

/// The one child a single-input node of flumen's own is rebuilt with.
pub(crate) fn only_child(
    children: Vec<Arc<dyn ExecutionPlan>>,
    node: &str,
) -> Result<Arc<dyn ExecutionPlan>> {
    children
        .into_iter()
        .next()
        .ok_or_else(|| DataFusionError::Internal(format!("{node} needs one child")))
}
