//! A partitioned hash join's task rewritten as a sort-merge join, for a partition whose build
//! side does not fit the memory budget even when its task runs alone (a join key hot enough
//! that its rows alone are larger than the budget).
//!
//! DataFusion's hash join cannot spill its build side; its sort and its sort-merge join can.
//! [`as_sort_merge_join`] replaces every `HashJoinExec` in `Partitioned` mode of a task's
//! fragment by `SortMergeJoinExec` over both inputs sorted on the join keys: the sorts spill
//! sorted runs through DataFusion's disk manager, and the merge join spills the buffered rows
//! of one key. The join's inputs (the fragment's stage inputs) are unchanged, so the task
//! reads the same blocks; only its operator state leaves memory. The sorts also order rows on
//! every other orderable column after the keys, so that a recomputed task (lineage) emits its
//! rows in the same order whatever its spills were.

use std::sync::Arc;

use datafusion::arrow::compute::SortOptions;
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::error::Result;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{LexOrdering, PhysicalExprRef, PhysicalSortExpr};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode, SortMergeJoinExec};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;

/// `fragment` with its partitioned hash joins as sort-merge joins, or `None` when it has
/// none that can be (a null-aware anti join or a join with a fetch keeps its hash join).
pub fn as_sort_merge_join(
    fragment: &Arc<dyn ExecutionPlan>,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let rewritten = Arc::clone(fragment).transform_up(|node| {
        let Some(join) = node.downcast_ref::<HashJoinExec>() else {
            return Ok(Transformed::no(node));
        };
        if *join.partition_mode() != PartitionMode::Partitioned
            || join.null_aware
            || join.fetch().is_some()
        {
            return Ok(Transformed::no(node));
        }
        Ok(Transformed::yes(merge_join(join)?))
    })?;
    Ok(rewritten.transformed.then_some(rewritten.data))
}

/// `join` as a sort-merge join over its inputs sorted on the keys, with its projection.
fn merge_join(join: &HashJoinExec) -> Result<Arc<dyn ExecutionPlan>> {
    let on = join.on().to_vec();
    let left_keys: Vec<_> = on.iter().map(|(l, _)| Arc::clone(l)).collect();
    let right_keys: Vec<_> = on.iter().map(|(_, r)| Arc::clone(r)).collect();
    let left = sorted_on(join.left(), &left_keys);
    let right = sorted_on(join.right(), &right_keys);
    let merged: Arc<dyn ExecutionPlan> = Arc::new(SortMergeJoinExec::try_new(
        left,
        right,
        on,
        join.filter().cloned(),
        *join.join_type(),
        vec![SortOptions::default(); left_keys.len()],
        join.null_equality(),
    )?);
    let Some(projection) = &join.projection else {
        return Ok(merged);
    };
    let schema = merged.schema();
    let columns = projection.iter().map(|&i| {
        let name = schema.field(i).name().clone();
        (Arc::new(Column::new(&name, i)) as PhysicalExprRef, name)
    });
    Ok(Arc::new(ProjectionExec::try_new(columns, merged)?))
}

/// `input`, each partition sorted on `keys`, then on its other orderable columns.
fn sorted_on(input: &Arc<dyn ExecutionPlan>, keys: &[PhysicalExprRef]) -> Arc<dyn ExecutionPlan> {
    let schema = input.schema();
    let ties = schema
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, field)| {
            RowConverter::supports_fields(&[SortField::new(field.data_type().clone())])
        })
        .map(|(i, field)| Arc::new(Column::new(field.name(), i)) as PhysicalExprRef);
    let exprs = keys
        .iter()
        .cloned()
        .chain(ties)
        .map(|expr| PhysicalSortExpr::new(expr, SortOptions::default()));
    let ordering = LexOrdering::new(exprs).expect("a join has at least one key");
    Arc::new(SortExec::new(ordering, Arc::clone(input)).with_preserve_partitioning(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_plans::physical_plan;
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::physical_plan::collect;
    use datafusion::prelude::SessionContext;

    /// Every join type of a partitioned hash join gives the same rows as a merge join.
    #[tokio::test]
    async fn merge_join_answers_like_the_hash_join() {
        let ctx = SessionContext::new();
        ctx.sql("SET datafusion.optimizer.hash_join_single_partition_threshold = 0")
            .await
            .unwrap();
        ctx.sql("SET datafusion.optimizer.hash_join_single_partition_threshold_rows = 0")
            .await
            .unwrap();
        for (name, rows) in [
            ("a", "(1, 'x'), (2, 'y'), (2, 'z'), (NULL, 'n'), (5, 'q')"),
            ("b", "(2, 10), (2, 20), (3, 30), (NULL, 40), (5, 50)"),
        ] {
            let sql = format!("CREATE TABLE {name} AS VALUES {rows}");
            ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        }
        let queries = [
            "SELECT * FROM a JOIN b ON a.column1 = b.column1",
            "SELECT a.column2, b.column2 FROM a LEFT JOIN b ON a.column1 = b.column1",
            "SELECT * FROM a RIGHT JOIN b ON a.column1 = b.column1",
            "SELECT * FROM a FULL JOIN b ON a.column1 = b.column1 AND b.column2 > 10",
            "SELECT * FROM a WHERE EXISTS (SELECT 1 FROM b WHERE b.column1 = a.column1)",
            "SELECT * FROM a WHERE NOT EXISTS (SELECT 1 FROM b WHERE b.column1 = a.column1)",
        ];
        for sql in queries {
            let plan = physical_plan(&ctx, sql).await;
            let merged = as_sort_merge_join(&plan)
                .unwrap()
                .unwrap_or_else(|| panic!("no partitioned hash join in {sql}"));
            let sorted = |batches: Vec<datafusion::arrow::record_batch::RecordBatch>| {
                let text = pretty_format_batches(&batches).unwrap().to_string();
                let mut lines: Vec<_> = text.lines().map(str::to_owned).collect();
                lines.sort();
                lines
            };
            let hash = sorted(collect(plan, ctx.task_ctx()).await.unwrap());
            let merge = sorted(collect(merged, ctx.task_ctx()).await.unwrap());
            assert_eq!(hash, merge, "{sql}");
        }
    }
}
