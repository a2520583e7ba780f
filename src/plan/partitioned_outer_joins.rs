//! In worker mode, a hash join that emits its build side's unmatched (or matched) rows is
//! planned partitioned, so each of its partitions runs apart on a worker.
//!
//! DataFusion plans a join with a small build side `CollectLeft`: every partition reads the
//! whole build side, and a left, left semi, left anti, left mark or full join then emits the
//! build side's rows once, after every partition's probe, from matches the partitions share.
//! Such a join's partitions cannot run on separate workers (`plan::partition_cut`), so in
//! worker mode its whole operator ran on the driver. [`PartitionOuterJoins`] (after
//! DataFusion's `join_selection`, before its distribution rules) makes such a join
//! `Partitioned`: both inputs are hash partitioned on the join keys, and partition `p`'s
//! build rows are matched against partition `p`'s probe rows only, as Spark and Ballista
//! plan an outer join they do not broadcast.
//!
//! A null-aware anti join (`NOT IN`) stays `CollectLeft`: one NULL anywhere in its probe
//! side empties the whole answer, which no single partition can know.

use std::sync::Arc;

use datafusion::common::JoinType;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};

use crate::config::{FlumenConfig, WorkerMode};

/// Physical optimizer rule: in worker mode (`flumen.workers = process`), a `CollectLeft`
/// hash join that emits build-side rows once becomes `Partitioned`.
#[derive(Debug, Default)]
pub struct PartitionOuterJoins;

impl PhysicalOptimizerRule for PartitionOuterJoins {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let on_workers = (options.extensions.get::<FlumenConfig>())
            .is_some_and(|c| c.workers == WorkerMode::Process);
        let can_repartition =
            options.optimizer.repartition_joins && options.execution.target_partitions > 1;
        if !on_workers || !can_repartition {
            return Ok(plan);
        }
        plan.transform_up(|node| match node.downcast_ref::<HashJoinExec>() {
            Some(join)
                if join.partition_mode() == &PartitionMode::CollectLeft
                    && !join.null_aware
                    && emits_build_rows_once(*join.join_type()) =>
            {
                let partitioned = (join.builder())
                    .with_partition_mode(PartitionMode::Partitioned)
                    .reset_state()
                    .build_exec()?;
                Ok(Transformed::yes(partitioned))
            }
            _ => Ok(Transformed::no(node)),
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "partition_outer_joins"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether a join reading its whole build side in every partition emits build-side rows
/// (unmatched, or matched for semi and mark joins) once, after every partition's probe.
pub fn emits_build_rows_once(join_type: JoinType) -> bool {
    matches!(
        join_type,
        JoinType::Left
            | JoinType::LeftAnti
            | JoinType::LeftSemi
            | JoinType::LeftMark
            | JoinType::Full
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::{SessionConfig, SessionContext};

    /// DataFusion's physical plan of `sql` over a 2-row table `small` and a 6-row table
    /// `big`, then this rule's, with `flumen.workers = workers`; both as `EXPLAIN` shows them.
    async fn plans_of(workers: WorkerMode, sql: &str) -> (String, String) {
        let config = SessionConfig::new().with_target_partitions(4);
        let ctx = SessionContext::new_with_config(config);
        let tables = [
            ("small", "(1, 'a'), (NULL, 'b')"),
            (
                "big",
                "(1, 'a'), (2, 'b'), (3, 'c'), (4, 'd'), (5, 'e'), (NULL, 'f')",
            ),
        ];
        for (table, rows) in tables {
            let sql = format!("CREATE TABLE {table} AS VALUES {rows}");
            ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        }
        let df = ctx.sql(sql).await.unwrap();
        let plan = df.create_physical_plan().await.unwrap();
        let mut options = ConfigOptions::new();
        options.optimizer.repartition_joins = true;
        options.execution.target_partitions = 4;
        options.extensions.insert(FlumenConfig {
            workers,
            ..FlumenConfig::default()
        });
        let after = PartitionOuterJoins
            .optimize(Arc::clone(&plan), &options)
            .unwrap();
        let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(false).to_string();
        (show(&plan), show(&after))
    }

    #[tokio::test]
    async fn an_outer_join_is_partitioned_on_workers_only() {
        let sql = "SELECT * FROM small LEFT JOIN big ON small.column1 = big.column1";
        let (before, threads) = plans_of(WorkerMode::Threads, sql).await;
        assert!(
            before.contains("mode=CollectLeft, join_type=Left"),
            "{before}"
        );
        assert_eq!(before, threads);
        let (_, process) = plans_of(WorkerMode::Process, sql).await;
        assert!(
            process.contains("mode=Partitioned, join_type=Left"),
            "{process}"
        );
    }

    #[tokio::test]
    async fn an_inner_join_and_a_null_aware_anti_join_stay_collect_left() {
        let inner = "SELECT * FROM small JOIN big ON small.column1 = big.column1";
        let (before, after) = plans_of(WorkerMode::Process, inner).await;
        assert!(before.contains("mode=CollectLeft"), "{before}");
        assert_eq!(before, after);
        let not_in = "SELECT * FROM big WHERE column1 NOT IN (SELECT column1 FROM small)";
        let (before, after) = plans_of(WorkerMode::Process, not_in).await;
        assert!(before.contains("null_aware"), "{before}");
        assert_eq!(before, after);
    }
}
