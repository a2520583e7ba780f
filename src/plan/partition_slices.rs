//! Which per-partition tasks can be cut into slices: a hot partition of a hash join (a skewed
//! key's build side larger than a task's share of the budget) split over several tasks, each
//! building its hash table from a slice of the build side's blocks and probing it with the
//! whole probe side (Spark's skew join, the other side replicated to every slice).
//!
//! A slice is one task of the same fragment, run over part of one input: the union of the
//! slices' outputs is the task's output exactly when every output row depends on one build
//! row and the probe side as a whole. That holds for joins that emit build rows, matched or
//! not (inner, left, left semi, left anti, left mark: DataFusion's hash join builds its left
//! input), and not for those that emit unmatched probe rows (right, full, right semi/anti/
//! mark): a probe row without a match in one slice may match in another. Above the join the
//! fragment must be row by row (projections, filters without a limit, partial aggregates, whose states a
//! final aggregate downstream merges), and between the join and its build input too, so the
//! build input is what the slices cut. [`sliced_build_input`] says which leaf that is.

use std::sync::Arc;

use datafusion::common::JoinType;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::plan::stage_input::StageInputExec;

/// The leaf under the build side of `fragment`'s hash join when the fragment's tasks may be
/// cut into slices of that leaf's rows (see the module docs), else `None`. The fragment must
/// declare no output order (the slices' outputs follow one another).
pub fn sliced_build_input(fragment: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    if fragment.output_ordering().is_some() {
        return None;
    }
    let mut node = Arc::clone(fragment);
    // Down the row-by-row nodes above the join.
    loop {
        if let Some(join) = node.downcast_ref::<HashJoinExec>() {
            if !splits_on_build_side(join) {
                return None;
            }
            return row_by_row_leaf(join.left());
        }
        if !is_row_by_row(&node) && !is_partial_aggregate(&node) {
            return None;
        }
        let [child] = node.children()[..] else {
            return None;
        };
        node = Arc::clone(child);
    }
}

/// A join whose build side may be cut: partitioned (each task builds its own table), no
/// limit, not the null-aware anti join of `NOT IN`, and of a type that emits build rows.
fn splits_on_build_side(join: &HashJoinExec) -> bool {
    *join.partition_mode() == PartitionMode::Partitioned
        && join.fetch().is_none()
        && !join.null_aware
        && matches!(
            join.join_type(),
            JoinType::Inner
                | JoinType::Left
                | JoinType::LeftSemi
                | JoinType::LeftAnti
                | JoinType::LeftMark
        )
}

/// The leaf (a stage input, in a task's fragment) below a chain of row-by-row nodes, or `None` when something else is on the way.
fn row_by_row_leaf(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    let mut node = Arc::clone(plan);
    loop {
        let children = node.children();
        // A stage input shows its producer as its child; it is the leaf of a task.
        if children.is_empty() || node.downcast_ref::<StageInputExec>().is_some() {
            return Some(node);
        }
        let [child] = children[..] else {
            return None;
        };
        if !is_row_by_row(&node) {
            return None;
        }
        node = Arc::clone(child);
    }
}

/// A node whose output for a set of rows is the union of its outputs for any split of them.
fn is_row_by_row(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<ProjectionExec>().is_some()
        || node
            .downcast_ref::<FilterExec>()
            .is_some_and(|f| f.fetch().is_none())
}

/// A partial aggregate: its states for a split of its rows merge downstream into the same
/// answer.
fn is_partial_aggregate(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<AggregateExec>()
        .is_some_and(|a| matches!(a.mode(), AggregateMode::Partial) && a.limit_options().is_none())
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::common::tree_node::{Transformed, TreeNode};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_plan::collect;
    use datafusion::prelude::SessionContext;

    /// `plan` with its hash joins in `Partitioned` mode (with one partition DataFusion plans
    /// `CollectLeft`, the same join over one partition).
    fn partitioned(plan: Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
        plan.transform_up(|node| match node.downcast_ref::<HashJoinExec>() {
            Some(join) => {
                let join = join
                    .builder()
                    .with_partition_mode(PartitionMode::Partitioned)
                    .build()?;
                Ok(Transformed::yes(Arc::new(join) as Arc<dyn ExecutionPlan>))
            }
            None => Ok(Transformed::no(node)),
        })
        .unwrap()
        .data
    }

    /// The physical plan of `sql`, its hash joins partitioned.
    async fn partitioned_plan(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
        let plan = ctx.sql(sql).await.unwrap().create_physical_plan().await;
        partitioned(plan.unwrap())
    }

    /// Hash joins over two tables `a` (build, left) and `b` (probe), one partition each.
    async fn context() -> SessionContext {
        let ctx = SessionContext::new();
        for setting in [
            "SET datafusion.optimizer.join_reordering = false",
            "SET datafusion.execution.target_partitions = 1",
        ] {
            ctx.sql(setting).await.unwrap();
        }
        for (name, rows) in [
            (
                "a",
                "(1, 'x'), (2, 'y'), (2, 'z'), (NULL, 'n'), (5, 'q'), (7, 'r'), (2, 's')",
            ),
            (
                "b",
                "(2, 10), (2, 20), (3, 30), (NULL, 40), (5, 50), (9, 90)",
            ),
        ] {
            let sql = format!("CREATE TABLE {name} AS VALUES {rows}");
            ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        }
        ctx
    }

    fn sorted_lines(batches: &[RecordBatch]) -> Vec<String> {
        let text = pretty_format_batches(batches).unwrap().to_string();
        let mut lines: Vec<_> = text
            .lines()
            .filter(|l| l.starts_with("| "))
            .map(str::to_owned)
            .collect();
        lines.sort();
        lines
    }

    /// `plan` with the rows of its leaf `leaf` (a memory scan) replaced by `rows` of them.
    fn with_leaf_rows(
        plan: &Arc<dyn ExecutionPlan>,
        leaf: &Arc<dyn ExecutionPlan>,
        rows: std::ops::Range<usize>,
        all: &[RecordBatch],
    ) -> Arc<dyn ExecutionPlan> {
        let merged =
            datafusion::arrow::compute::concat_batches(&all[0].schema(), all.iter()).unwrap();
        let part = merged.slice(rows.start, rows.end - rows.start);
        let replaced = Arc::clone(plan)
            .transform_up(|node| {
                if Arc::ptr_eq(&node, leaf) {
                    let scan = MemorySourceConfig::try_new_exec(
                        &[vec![part.clone()]],
                        part.schema(),
                        None,
                    )
                    .unwrap();
                    return Ok(Transformed::yes(scan as Arc<dyn ExecutionPlan>));
                }
                Ok(Transformed::no(node))
            })
            .unwrap();
        assert!(replaced.transformed, "leaf not found");
        replaced.data
    }

    /// For every join the rule accepts, the slices' outputs together are the whole task's
    /// output, however the build rows are cut; the joins it refuses are those where they
    /// would not be.
    #[tokio::test]
    async fn slices_of_the_build_side_give_the_whole_answer_where_accepted() {
        let ctx = context().await;
        let accepted = [
            "SELECT * FROM a JOIN b ON a.column1 = b.column1",
            "SELECT a.column2, b.column2 FROM a LEFT JOIN b ON a.column1 = b.column1",
            "SELECT * FROM a WHERE EXISTS (SELECT 1 FROM b WHERE b.column1 = a.column1)",
            "SELECT * FROM a WHERE NOT EXISTS (SELECT 1 FROM b WHERE b.column1 = a.column1)",
            "SELECT a.column2 FROM a JOIN b ON a.column1 = b.column1 WHERE b.column2 > 10",
        ];
        let refused = [
            "SELECT * FROM a RIGHT JOIN b ON a.column1 = b.column1",
            "SELECT * FROM a FULL JOIN b ON a.column1 = b.column1",
            "SELECT * FROM a JOIN b ON a.column1 = b.column1 ORDER BY a.column2",
            "SELECT a.column1, count(*) FROM a JOIN b ON a.column1 = b.column1 GROUP BY a.column1",
            "SELECT * FROM a JOIN b ON a.column1 = b.column1 LIMIT 2",
        ];
        let a_rows = ctx.table("a").await.unwrap().collect().await.unwrap();
        let n: usize = a_rows.iter().map(|b| b.num_rows()).sum();
        for sql in accepted {
            let plan = partitioned_plan(&ctx, sql).await;
            let leaf = sliced_build_input(&plan).unwrap_or_else(|| {
                panic!(
                    "refused: {sql}\n{}",
                    datafusion::physical_plan::displayable(plan.as_ref()).indent(true)
                )
            });
            let whole = sorted_lines(&collect(Arc::clone(&plan), ctx.task_ctx()).await.unwrap());
            for cut in 1..n {
                let mut slices = vec![];
                for rows in [0..cut, cut..n] {
                    let sliced = with_leaf_rows(&plan, &leaf, rows, &a_rows);
                    slices.extend(collect(sliced, ctx.task_ctx()).await.unwrap());
                }
                assert_eq!(whole, sorted_lines(&slices), "{sql}, cut at row {cut}");
            }
        }
        for sql in refused {
            let plan = partitioned_plan(&ctx, sql).await;
            assert!(sliced_build_input(&plan).is_none(), "accepted: {sql}");
        }
    }
}
