//! Round-robin exchanges over one sorted stream, taken out, so the order holds.
//!
//! DataFusion 55 puts a `RepartitionExec: RoundRobinBatch(N)` over a scan of one partition
//! to run the nodes above it on N partitions, and takes each output partition to keep the
//! scan's order (`maintains_input_order` holds for a repartition of one input partition):
//! above a filter of a sorted Parquet file, `ORDER BY` the sort key became a merge of the N
//! partitions with no sort. flumen's exchange is tasks: the scan is cut into splits, read
//! by several tasks at once, and a partition's blocks come in the order the tasks end, not
//! the file's. `SELECT id FROM t WHERE id % 97 = 1 ORDER BY id` over a file sorted by `id`,
//! cut into 10 splits, answered `... 9992, 2038, 2135, ...`.
//!
//! [`OrderedRoundRobins`] (after DataFusion's rules) replaces each round-robin exchange of
//! one sorted input partition with its input. Nothing is lost in parallel work: the nodes
//! above it that run row by row (a filter, a projection, a partial aggregate) join the scan's
//! own tasks, one per split, which flumen reads back in the file's order.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::sanity_checker::SanityCheckPlan;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};

/// Physical optimizer rule: a round-robin exchange over one sorted partition is removed.
#[derive(Debug, Default)]
pub struct OrderedRoundRobins;

impl PhysicalOptimizerRule for OrderedRoundRobins {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let rewritten = plan.transform_up(|node| {
            Ok(match ordered_round_robin_input(&node) {
                Some(input) => Transformed::yes(input),
                None => Transformed::no(node),
            })
        })?;
        if !rewritten.transformed {
            return Ok(rewritten.data);
        }
        SanityCheckPlan::new().optimize(rewritten.data, options)
    }

    fn name(&self) -> &str {
        "ordered_round_robins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The input of `node` where it is a round-robin exchange of one sorted partition.
fn ordered_round_robin_input(node: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    let repartition = node.downcast_ref::<RepartitionExec>()?;
    let input = repartition.input();
    let over_one_sorted = matches!(repartition.partitioning(), Partitioning::RoundRobinBatch(_))
        && input.output_partitioning().partition_count() == 1
        && input.output_ordering().is_some();
    over_one_sorted.then(|| Arc::clone(input))
}
