//! Sorts above an outer join whose NULL-padded side was filtered to a constant.
//!
//! DataFusion 55 carries each side's constants through a join of any kind
//! (`EquivalenceGroup::join`): after `t AS (SELECT k, count(*) AS n FROM a WHERE k = 7
//! GROUP BY k)`, `t t1 FULL JOIN t t2 ON t1.k = t2.k + 1` states `t1.k` constant 7, though
//! the rows only `t2` has hold NULL there. Its sorting rule then drops `t1.k` from the sort
//! that `ORDER BY t1.k DESC, ...` needs, and the NULL row came out last: a wrong order, and
//! under a `LIMIT` wrong rows (found by the random queries, seed 126008's query 116).
//!
//! [`HideOuterJoinConstants`], right after DataFusion's join selection, puts a
//! [`NoConstantsExec`] that keeps its input's order (`NoConstantsExec::keeping_order`)
//! over each side of a join that the join pads with NULLs (the right side of a `LEFT` join,
//! the left of a `RIGHT` join, both of a `FULL` join), so the rules after it see no
//! constant there. [`RemoveNoConstantsNodes`](crate::plan::grouping_set_constants::RemoveNoConstantsNodes)
//! takes the nodes out again, last.

use std::sync::Arc;

use datafusion::common::JoinType;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::joins::{HashJoinExec, NestedLoopJoinExec, SortMergeJoinExec};
use datafusion::physical_plan::{ExecutionPlan, replace_children_if_necessary};

use crate::plan::grouping_set_constants::NoConstantsExec;

/// Physical optimizer rule, after join selection: a [`NoConstantsExec`] keeping order over
/// each side an outer join pads with NULLs.
#[derive(Debug, Default)]
pub struct HideOuterJoinConstants;

impl PhysicalOptimizerRule for HideOuterJoinConstants {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(join_type) = join_type(&node) else {
                return Ok(Transformed::no(node));
            };
            let (left, right) = padded_sides(join_type);
            if !left && !right {
                return Ok(Transformed::no(node));
            }
            let children = (node.children().into_iter().zip([left, right]))
                .map(|(child, padded)| match padded {
                    true if child.downcast_ref::<NoConstantsExec>().is_none() => {
                        Arc::new(NoConstantsExec::keeping_order(Arc::clone(child))) as _
                    }
                    _ => Arc::clone(child),
                })
                .collect();
            Ok(Transformed::yes(replace_children_if_necessary(
                node, children,
            )?))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "hide_outer_join_constants"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The join type of a two-input join node.
fn join_type(node: &Arc<dyn ExecutionPlan>) -> Option<JoinType> {
    if let Some(join) = node.downcast_ref::<HashJoinExec>() {
        return Some(*join.join_type());
    }
    if let Some(join) = node.downcast_ref::<NestedLoopJoinExec>() {
        return Some(*join.join_type());
    }
    node.downcast_ref::<SortMergeJoinExec>()
        .map(|join| join.join_type())
}

/// Whether a join of `join_type` pads its left and its right input's columns with NULLs.
fn padded_sides(join_type: JoinType) -> (bool, bool) {
    match join_type {
        JoinType::Left => (false, true),
        JoinType::Right => (true, false),
        JoinType::Full => (true, true),
        _ => (false, false),
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::prelude::{SessionConfig, SessionContext};

    /// The query of the module's documentation over 1,000 rows (`k` 0..9): one row `t` per
    /// side, unmatched.
    const QUERY: &str = "SELECT * FROM (WITH t AS (SELECT k, count(*) AS n FROM a WHERE k = 7 \
                         GROUP BY k) SELECT t1.k AS c0, t1.n AS c1, t2.n AS c2 FROM t t1 FULL \
                         JOIN t t2 ON t1.k = t2.k + 1) q ORDER BY 1 DESC, 2, 3";

    async fn answer(ctx: &SessionContext) -> String {
        ctx.sql("CREATE TABLE a AS SELECT value % 10 AS k FROM range(1000)")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let batches = ctx.sql(QUERY).await.unwrap().collect().await.unwrap();
        pretty_format_batches(&batches).unwrap().to_string()
    }

    #[tokio::test]
    async fn a_full_joins_null_row_sorts_first_descending() {
        let config = SessionConfig::new().with_target_partitions(4);
        let flumen = crate::FlumenConfig::default();
        let ctx = crate::session_with_config(
            crate::flumen_session_config(config, flumen.clone()),
            flumen,
        );
        let lines: Vec<String> = answer(&ctx).await.lines().map(str::to_string).collect();
        // DESC puts NULL first: the row only t2 has, then t1's.
        assert_eq!(lines[3], "|    |     | 100 |", "{lines:#?}");
        assert_eq!(lines[4], "| 7  | 100 |     |", "{lines:#?}");
    }
}
