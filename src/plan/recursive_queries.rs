//! A recursive query (`WITH RECURSIVE`) in a task. The cut keeps its subtree whole in one
//! task (`cut.rs`: it executes its recursive term once per pass).
//!
//! - It keeps state in its plan: the work table its recursive term reads, and the exchanges
//!   of its static term, each of whose partitions can be executed once. A task run again
//!   must not execute the same instance twice: every run executes a fresh copy
//!   ([`afresh`]).
//! - Its exchanges deliver rows in the order they come, so a run again would give its rows
//!   in other blocks: its operator is one whose tasks do not run again alike
//!   ([`holds_one`], `Operator::runs_again_unlike`), whose blocks a run with workers keeps
//!   until the query ends.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::error::Result;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::execution_plan::reset_plan_states;
use datafusion::physical_plan::recursive_query::RecursiveQueryExec;

/// Whether `fragment` runs a recursive query. Its exchanges (a static term read round-robin
/// from several partitions, the partitions of each pass coalesced) deliver rows in the
/// order they come, so a run again gives them in other blocks.
pub fn holds_one(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    fragment
        .exists(|plan| Ok(plan.downcast_ref::<RecursiveQueryExec>().is_some()))
        .unwrap_or(false)
}

/// `fragment` with each recursive query in it replaced by a copy whose nodes hold no state
/// from an earlier run; `fragment` itself when it has none.
pub fn afresh(fragment: &Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    Arc::clone(fragment)
        .transform_down(|plan| {
            if plan.downcast_ref::<RecursiveQueryExec>().is_none() {
                return Ok(Transformed::no(plan));
            }
            let fresh = reset_plan_states(plan)?;
            Ok(Transformed::new(fresh, true, TreeNodeRecursion::Jump))
        })
        .map(|t| t.data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{ArrayRef, Int64Array, RecordBatch};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::MemTable;
    use datafusion::prelude::SessionContext;
    use futures::TryStreamExt;

    /// The plan of a recursive query whose static term has an exchange: its filter over a
    /// table of two partitions reads them round-robin in three.
    async fn recursive_plan(ctx: &SessionContext) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false)]));
        let part = |values: Vec<i64>| {
            let column: ArrayRef = Arc::new(Int64Array::from(values));
            vec![RecordBatch::try_new(Arc::clone(&schema), vec![column]).unwrap()]
        };
        let table = MemTable::try_new(
            Arc::clone(&schema),
            vec![part(vec![1, 2, 40]), part(vec![3, 50])],
        )
        .unwrap();
        ctx.register_table("m", Arc::new(table)).unwrap();
        let sql = "WITH RECURSIVE t(n) AS (SELECT n FROM m WHERE n < 10 \
                   UNION ALL SELECT n + 1 FROM t WHERE n < 5) SELECT n FROM t";
        let df = ctx.sql(sql).await.unwrap();
        let plan = df.create_physical_plan().await.unwrap();
        let mut found = None;
        plan.apply(|node| {
            if node.downcast_ref::<RecursiveQueryExec>().is_some() {
                found = Some(Arc::clone(node));
                return Ok(TreeNodeRecursion::Stop);
            }
            Ok(TreeNodeRecursion::Continue)
        })
        .unwrap();
        found.expect("a RecursiveQueryExec")
    }

    async fn rows(plan: &Arc<dyn ExecutionPlan>, ctx: &SessionContext) -> usize {
        let stream = plan.execute(0, ctx.task_ctx()).unwrap();
        let batches: Vec<_> = stream.try_collect().await.unwrap();
        batches.iter().map(|b| b.num_rows()).sum()
    }

    #[tokio::test]
    async fn each_run_of_a_fresh_copy_gives_every_row() {
        let ctx = SessionContext::new_with_config(
            datafusion::prelude::SessionConfig::new().with_target_partitions(3),
        );
        let plan = recursive_plan(&ctx).await;
        // 1..=5, 2..=5 and 3..=5.
        assert_eq!(rows(&afresh(&plan).unwrap(), &ctx).await, 12);
        assert_eq!(rows(&afresh(&plan).unwrap(), &ctx).await, 12);
        assert!(!Arc::ptr_eq(&afresh(&plan).unwrap(), &plan));
    }
}
