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
//! [`OrderedRoundRobins`] (after DataFusion's rules) replaces such an exchange with its input
//! where a node above relies on the order it passes on: a node that requires its input
//! sorted (a sort-preserving merge, a window, an aggregate over sorted groups), reached
//! through nodes that keep their input's order (a filter, a projection); not a partial
//! aggregate, whose rows add up the same in any order, unless its own order is used. An
//! exchange whose order nothing uses stays: it spreads a one-partition input (an in-memory
//! table, a sorted file's partial aggregate) over N partitions for the nodes above. Nothing is lost in parallel work where one is taken out:
//! the nodes above it that run row by row join the scan's own tasks, one per split, which
//! flumen reads back in the file's order.

use std::sync::Arc;

use datafusion::common::tree_node::Transformed;
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::sanity_checker::SanityCheckPlan;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, Partitioning, replace_children_if_necessary,
};

/// Physical optimizer rule: a round-robin exchange over one sorted partition, whose order a
/// node above relies on, is removed.
#[derive(Debug, Default)]
pub struct OrderedRoundRobins;

impl PhysicalOptimizerRule for OrderedRoundRobins {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        // The root's order is the answer's where it is one sorted partition.
        let answer_ordered =
            plan.output_partitioning().partition_count() == 1 && plan.output_ordering().is_some();
        let rewritten = without_ordered_round_robins(plan, answer_ordered)?;
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

/// `node` with the round-robin exchanges of one sorted partition taken out wherever the
/// order they pass on is relied upon; `order_used` says whether `node`'s own output order is.
fn without_ordered_round_robins(
    node: Arc<dyn ExecutionPlan>,
    order_used: bool,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    if order_used && let Some(input) = ordered_round_robin_input(&node) {
        let input = without_ordered_round_robins(input, true)?.data;
        return Ok(Transformed::yes(input));
    }
    let required = node.required_input_ordering();
    let maintained = node.maintains_input_order();
    // A partial aggregate over sorted groups gives the same partial rows, split differently,
    // in any input order (the final aggregate adds them up): its input's order is used only
    // where its own output's is.
    let partial = (node.downcast_ref::<AggregateExec>())
        .is_some_and(|aggregate| *aggregate.mode() == AggregateMode::Partial);
    let mut changed = false;
    let mut children = Vec::new();
    for (index, child) in node.children().into_iter().enumerate() {
        let required = required.get(index).is_some_and(Option::is_some);
        let maintained = maintained.get(index).copied().unwrap_or(false);
        let child_order_used = if partial {
            order_used && required
        } else {
            required || (order_used && maintained)
        };
        let child = without_ordered_round_robins(Arc::clone(child), child_order_used)?;
        changed |= child.transformed;
        children.push(child.data);
    }
    if !changed {
        return Ok(Transformed::no(node));
    }
    Ok(Transformed::yes(replace_children_if_necessary(
        node, children,
    )?))
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

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::ScalarValue;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::datasource::source::DataSourceExec;
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_expr::expressions::{BinaryExpr, Literal};
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
    use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
    use datafusion::physical_plan::displayable;
    use datafusion::physical_plan::filter::FilterExec;
    use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;

    /// One partition of an Int64 column `x`, declared sorted by it, and that ordering.
    fn sorted_source() -> (Arc<dyn ExecutionPlan>, LexOrdering) {
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
        let ordering =
            LexOrdering::new([PhysicalSortExpr::new_default(col("x", &schema).unwrap())]).unwrap();
        let memory = MemorySourceConfig::try_new(&[vec![]], schema, None)
            .unwrap()
            .try_with_sort_information(vec![ordering.clone()])
            .unwrap();
        (DataSourceExec::from_data_source(memory), ordering)
    }

    /// `x > 1` over a round-robin exchange of `input` into 4 partitions.
    fn filter_over_round_robin(input: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
        let spread = RepartitionExec::try_new(input, Partitioning::RoundRobinBatch(4)).unwrap();
        let predicate = Arc::new(BinaryExpr::new(
            col("x", &spread.schema()).unwrap(),
            Operator::Gt,
            Arc::new(Literal::new(ScalarValue::Int64(Some(1)))),
        ));
        Arc::new(FilterExec::try_new(predicate, Arc::new(spread)).unwrap())
    }

    fn optimized(plan: Arc<dyn ExecutionPlan>) -> String {
        let plan = OrderedRoundRobins
            .optimize(plan, &ConfigOptions::default())
            .unwrap();
        displayable(plan.as_ref()).indent(false).to_string()
    }

    #[test]
    fn an_exchange_whose_order_a_merge_uses_is_taken_out() {
        let (source, ordering) = sorted_source();
        let merged = Arc::new(SortPreservingMergeExec::new(
            ordering,
            filter_over_round_robin(source),
        ));
        let plan = optimized(merged);
        assert!(!plan.contains("RepartitionExec"), "{plan}");
        assert!(plan.contains("FilterExec"), "{plan}");
    }

    #[test]
    fn an_exchange_whose_order_nothing_uses_stays() {
        let (source, _) = sorted_source();
        let gathered = Arc::new(CoalescePartitionsExec::new(filter_over_round_robin(source)));
        let plan = optimized(gathered);
        assert!(plan.contains("RoundRobinBatch(4)"), "{plan}");
    }
}
