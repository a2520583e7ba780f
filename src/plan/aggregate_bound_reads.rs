//! Scans read an aggregate's bound only where it is a bound of every aggregate.
//!
//! DataFusion 55 gives an aggregate without groups whose aggregates are `min`/`max` a
//! dynamic filter that its scans prune by: `x < min_so_far OR y > max_so_far`, one term per
//! aggregate. It leaves a term out while that aggregate has seen no value, and never has one
//! for a `min`/`max` of an expression (`max(y + 1)`). The filter then drops rows that could
//! still lower or raise the aggregate without a term: in `SELECT min(dt), min(ts) FROM a`,
//! a task that read only rows with a NULL `ts` (a file written before `ts` was added) made
//! `dt < '2023-12-09'`, and the tasks after it skipped the row groups that held the smallest
//! `ts`. (Vanilla DataFusion has the same fault, narrower: its partitions share one bound.)
//!
//! [`ReadOnlyWholeAggregateBounds`], a physical optimizer rule after DataFusion's filter
//! pushdown, takes the filter of an aggregate with more than one aggregate expression out of
//! the predicates that read it (it becomes `true` there). An aggregate of one `min` or `max`
//! keeps its filter: with no value seen its filter is `true`.

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::physical_expr::expressions::{DynamicFilterPhysicalExpr, lit};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};

use crate::plan::dynamic_filters::map_predicates;

/// The ids of the dynamic filters in `plan` made by aggregates of more than one aggregate
/// expression: filters that may leave an aggregate out.
fn partial_bounds(plan: &Arc<dyn ExecutionPlan>) -> Result<HashSet<u64>> {
    let mut ids = HashSet::new();
    plan.apply(|node| {
        if let Some(aggregate) = node.downcast_ref::<AggregateExec>()
            && aggregate.aggr_expr().len() > 1
        {
            let produced = node.dynamic_expressions_produced();
            ids.extend(produced.iter().filter_map(|filter| filter.expression_id()));
        }
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    })?;
    Ok(ids)
}

/// Physical optimizer rule: the filters of aggregates of several aggregate expressions read
/// as `true` by the scans and filters they were pushed into.
#[derive(Debug, Default)]
pub struct ReadOnlyWholeAggregateBounds;

impl PhysicalOptimizerRule for ReadOnlyWholeAggregateBounds {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let partial = partial_bounds(&plan)?;
        if partial.is_empty() {
            return Ok(plan);
        }
        let mut unread = |predicate: &Arc<dyn PhysicalExpr>| {
            Arc::clone(predicate).transform_up(|expr| {
                let is_partial = expr.downcast_ref::<DynamicFilterPhysicalExpr>().is_some()
                    && expr.expression_id().is_some_and(|id| partial.contains(&id));
                match is_partial {
                    true => Ok(Transformed::yes(lit(true))),
                    false => Ok(Transformed::no(expr)),
                }
            })
        };
        plan.transform_up(|node| map_predicates(node, &mut unread))
            .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "read_only_whole_aggregate_bounds"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::dynamic_filters::tests::plan_in_partitions;
    use datafusion::physical_plan::displayable;

    /// The scan line of `sql`'s plan in vanilla DataFusion (over `t(a)`, 0 to 99), before and
    /// after the rule.
    async fn scan_before_and_after(sql: &str) -> (String, String) {
        let (_dir, plan) = plan_in_partitions(sql, 2).await;
        let scan = |plan: &Arc<dyn ExecutionPlan>| {
            let shown = displayable(plan.as_ref()).indent(true).to_string();
            (shown.lines())
                .find(|l| l.contains("DataSourceExec"))
                .unwrap()
                .to_string()
        };
        let after = ReadOnlyWholeAggregateBounds
            .optimize(Arc::clone(&plan), &ConfigOptions::default())
            .unwrap();
        (scan(&plan), scan(&after))
    }

    /// (A filter keeps the answers from coming from the file's statistics.)
    #[tokio::test]
    async fn a_scan_reads_the_filter_of_one_min_but_not_of_two_aggregates() {
        let (before, after) = scan_before_and_after("SELECT min(a) FROM t WHERE a <> 5").await;
        assert!(before.contains("DynamicFilter"), "{before}");
        assert!(after.contains("DynamicFilter"), "{after}");
        let sql = "SELECT min(a), max(a) FROM t WHERE a <> 5";
        let (before, after) = scan_before_and_after(sql).await;
        assert!(before.contains("DynamicFilter"), "{before}");
        assert!(!after.contains("DynamicFilter"), "{after}");
    }
}
