//! In worker mode, a semi or anti join with a small build side probes its large side where
//! that side is made, as threads mode does, instead of hash exchanging it first.
//!
//! DataFusion plans `EXISTS`, `IN` and `NOT EXISTS` with a small outer side as a
//! `CollectLeft` left semi (anti) hash join: every partition of the probe side `R` probes
//! the whole build side `L`, and `L`'s matched (unmatched) rows are emitted once, after
//! every partition's probe, from matches the partitions share. Workers share nothing
//! between partitions, so [`PartitionOuterJoins`](super::partitioned_outer_joins) plans
//! such a join `Partitioned`: `R`, the large side, crossed a hash exchange (TPC-H q4: 3.8M
//! lineitem rows, 145 ms for the join's operators against 73 ms in threads mode).
//!
//! [`SemiJoinsByKeySet`] rewrites a join without a filter beyond its keys as a join on the
//! set of `L`'s keys that `R` holds:
//!
//! ```text
//! L ⋉ R  =  DISTINCT(k(R ⋉ k(L))) ⋊ L        (semi: kept where its key is in the set)
//! L ▷ R  =  DISTINCT(k(R ⋉ k(L))) ⋫ L        (anti: kept where its key is not)
//! ```
//!
//! Each partition of `R` probes `L`'s keys (a `CollectLeft` right semi join: per partition,
//! on a worker, where `R` is scanned), the keys it matched (at most `L`'s, once each after a
//! partial aggregate) are exchanged instead of `R`'s rows, and `L` is read a second time and
//! probes that set (a right semi or right anti join, per partition of `L`). A row of `L`
//! with a NULL key matches no key either way, so `NOT EXISTS` keeps it and `EXISTS` drops
//! it, as before; a null-aware anti join (`NOT IN`) is not rewritten.
//!
//! `L` is computed twice, so the rewrite applies only where that costs a scan (files or
//! memory under filters, projections and exchanges: over a join or an aggregate the second
//! read cost more than the exchange saved) and gives the same rows each time
//! ([`same_rows_each_time`]: no volatile function, no model, no limit). `flumen.semi_joins_by_key_set = false` leaves such
//! joins to `PartitionOuterJoins`.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{JoinType, NullEquality};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::logical_expr::Volatility;
use datafusion::logical_expr::utils::AggregateOrderSensitivity;
use datafusion::physical_expr::ScalarFunctionExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::scalar_subquery::ScalarSubqueryExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::execution_plan::reset_plan_states;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{
    HashJoinExec, HashJoinExecBuilder, NestedLoopJoinExec, PartitionMode,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};

use crate::config::{FlumenConfig, WorkerMode};
use crate::functions::accelerator::calls_accelerator_udf;

/// Physical optimizer rule: in worker mode, a `CollectLeft` left semi or anti hash join
/// with no filter beyond its keys, over a build side that gives the same rows each time,
/// becomes a join on the set of build keys its probe side matches. Runs after DataFusion's
/// join selection, before [`PartitionOuterJoins`](super::partitioned_outer_joins).
#[derive(Debug, Default)]
pub struct SemiJoinsByKeySet;

impl PhysicalOptimizerRule for SemiJoinsByKeySet {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let wanted = (options.extensions.get::<FlumenConfig>())
            .is_some_and(|c| c.workers == WorkerMode::Process && c.semi_joins_by_key_set);
        if !wanted {
            return Ok(plan);
        }
        plan.transform_up(|node| match node.downcast_ref::<HashJoinExec>() {
            Some(join) => Ok(match by_key_set(join)? {
                Some(rewritten) => Transformed::yes(rewritten),
                None => Transformed::no(node),
            }),
            None => Ok(Transformed::no(node)),
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "semi_joins_by_key_set"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `join` as a join on the set of its build keys that its probe side matches, or `None`
/// where it is not a join this rule rewrites.
fn by_key_set(join: &HashJoinExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let by_set = match join.join_type() {
        JoinType::LeftSemi => JoinType::RightSemi,
        JoinType::LeftAnti => JoinType::RightAnti,
        _ => return Ok(None),
    };
    if join.partition_mode() != &PartitionMode::CollectLeft
        || join.null_aware
        || join.filter().is_some()
        || join.on().is_empty()
    {
        return Ok(None);
    }
    let (build, probe) = (join.left(), join.right());
    let (build_schema, probe_schema) = (build.schema(), probe.schema());
    for (b, p) in join.on() {
        if b.data_type(&build_schema)? != p.data_type(&probe_schema)? {
            return Ok(None);
        }
    }
    if !read_again_cheaply(build) || !same_rows_each_time(build) {
        return Ok(None);
    }
    let names: Vec<String> = (0..join.on().len())
        .map(|i| format!("__flumen_semi_key_{i}"))
        .collect();
    let key_columns = || -> Vec<Arc<dyn PhysicalExpr>> {
        (names.iter().enumerate())
            .map(|(i, name)| Arc::new(Column::new(name, i)) as Arc<dyn PhysicalExpr>)
            .collect()
    };
    let named = |exprs: Vec<Arc<dyn PhysicalExpr>>| -> Vec<(Arc<dyn PhysicalExpr>, String)> {
        exprs.into_iter().zip(names.iter().cloned()).collect()
    };
    let null_equality: NullEquality = join.null_equality();
    // The build side's keys, which every partition of the probe side reads whole.
    let build_keys = ProjectionExec::try_new(
        named(join.on().iter().map(|(b, _)| Arc::clone(b)).collect()),
        Arc::clone(build),
    )?;
    let matched = HashJoinExecBuilder::new(
        Arc::new(build_keys),
        Arc::clone(probe),
        (key_columns().into_iter())
            .zip(join.on().iter().map(|(_, p)| Arc::clone(p)))
            .collect(),
        JoinType::RightSemi,
    )
    .with_partition_mode(PartitionMode::CollectLeft)
    .with_null_equality(null_equality)
    .build_exec()?;
    // The keys the probe side matched, once each.
    let matched_keys: Arc<dyn ExecutionPlan> = Arc::new(ProjectionExec::try_new(
        named(join.on().iter().map(|(_, p)| Arc::clone(p)).collect()),
        matched,
    )?);
    let keys_schema = matched_keys.schema();
    let group_by = || PhysicalGroupBy::new_single(named(key_columns()));
    let partial: Arc<dyn ExecutionPlan> = Arc::new(AggregateExec::try_new(
        AggregateMode::Partial,
        group_by(),
        vec![],
        vec![],
        matched_keys,
        Arc::clone(&keys_schema),
    )?);
    let key_set = Arc::new(AggregateExec::try_new(
        AggregateMode::FinalPartitioned,
        group_by(),
        vec![],
        vec![],
        partial,
        keys_schema,
    )?);
    // The build side again, each of its rows kept or dropped by the set.
    let build_again = reset_plan_states(Arc::clone(build))?;
    let rewritten = HashJoinExecBuilder::new(
        key_set,
        build_again,
        (key_columns().into_iter())
            .zip(join.on().iter().map(|(b, _)| Arc::clone(b)))
            .collect(),
        by_set,
    )
    .with_partition_mode(PartitionMode::CollectLeft)
    .with_null_equality(null_equality)
    .with_projection_ref(join.projection.clone())
    .with_fetch(join.fetch())
    .build_exec()?;
    Ok(Some(rewritten))
}

/// Whether reading `plan` a second time costs a scan: it is files or memory under filters,
/// projections and exchanges. Over a join or an aggregate, the second read costs more than
/// the exchange it saves.
fn read_again_cheaply(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let mut cheap = true;
    let _ = plan.apply(|node| {
        cheap = matches!(
            node.name(),
            "DataSourceExec"
                | "FilterExec"
                | "ProjectionExec"
                | "CoalesceBatchesExec"
                | "CoalescePartitionsExec"
                | "RepartitionExec"
        );
        Ok(match cheap {
            true => TreeNodeRecursion::Continue,
            false => TreeNodeRecursion::Stop,
        })
    });
    cheap
}

/// Whether `plan` gives the same rows each time it runs (in any order): made only of scans,
/// filters, projections, joins, unions, exchanges, full sorts and aggregates whose result
/// does not depend on their input's order, calling no volatile function, no model and no
/// scalar subquery (TPC-H q22's customers, filtered by a subquery's average, computed it a
/// second time: 1.60-1.67x vanilla by key set against 1.44-1.48x partitioned, one worker,
/// SF1). A limit (which rows it keeps), a window, a model or a node this does not know
/// make it `false`.
pub fn same_rows_each_time(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let mut same = true;
    let _ = plan.apply(|node| {
        same = node_same_each_time(node.as_ref());
        Ok(match same {
            true => TreeNodeRecursion::Continue,
            false => TreeNodeRecursion::Stop,
        })
    });
    same
}

/// Whether one node (its children aside) gives the same rows for the same input rows.
fn node_same_each_time(node: &dyn ExecutionPlan) -> bool {
    // A node that stops at a count of rows keeps whichever come first.
    if node.fetch().is_some() {
        return false;
    }
    if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
        return all_deterministic(projection.expr().iter().map(|e| &e.expr));
    }
    if let Some(filter) = node.downcast_ref::<FilterExec>() {
        return deterministic(filter.predicate());
    }
    if let Some(join) = node.downcast_ref::<HashJoinExec>() {
        return all_deterministic(join.on().iter().flat_map(|(l, r)| [l, r]))
            && join.filter().is_none_or(|f| deterministic(f.expression()));
    }
    if let Some(join) = node.downcast_ref::<NestedLoopJoinExec>() {
        return join.filter().is_none_or(|f| deterministic(f.expression()));
    }
    if let Some(aggregate) = node.downcast_ref::<AggregateExec>() {
        let groups = aggregate.group_expr().expr().iter().map(|(e, _)| e);
        return aggregate.limit_options().is_none()
            && all_deterministic(groups)
            && aggregate.aggr_expr().iter().all(|a| {
                a.fun().order_sensitivity() == AggregateOrderSensitivity::Insensitive
                    && a.expressions().iter().all(deterministic)
            });
    }
    matches!(
        node.name(),
        "DataSourceExec"
            | "CoalesceBatchesExec"
            | "CoalescePartitionsExec"
            | "RepartitionExec"
            | "UnionExec"
            | "InterleaveExec"
            | "CrossJoinExec"
            | "EmptyExec"
            | "PlaceholderRowExec"
            | "SortExec"
            | "SortPreservingMergeExec"
    )
}

/// Whether every one of `exprs` is [`deterministic`].
fn all_deterministic<'a>(exprs: impl IntoIterator<Item = &'a Arc<dyn PhysicalExpr>>) -> bool {
    exprs.into_iter().all(deterministic)
}

/// Whether `expr` gives the same value for the same row, computed on its own: no volatile
/// function, no model, no scalar subquery (a plan of its own, run again with each copy).
fn deterministic(expr: &Arc<dyn PhysicalExpr>) -> bool {
    let mut same = !calls_accelerator_udf(expr);
    let _ = expr.apply(|e| {
        if let Some(call) = e.downcast_ref::<ScalarFunctionExpr>() {
            same &= call.fun().signature().volatility != Volatility::Volatile;
        }
        same &= !e.is::<ScalarSubqueryExpr>();
        Ok(match same {
            true => TreeNodeRecursion::Continue,
            false => TreeNodeRecursion::Stop,
        })
    });
    same
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_plans::physical_plan;
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::{SessionConfig, SessionContext};

    /// DataFusion's physical plan of `sql` over a 3-row table `small` and a 1,000-row table
    /// `big`, and that plan after this rule with `flumen.workers = workers` and
    /// `flumen.semi_joins_by_key_set = by_key_set`, as `EXPLAIN` shows them.
    async fn plans_with(workers: WorkerMode, by_key_set: bool, sql: &str) -> (String, String) {
        let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
        for table in [
            "CREATE TABLE small AS VALUES (1, 'a'), (NULL, 'b'), (7, 'c')",
            "CREATE TABLE big AS SELECT CASE WHEN value % 100 = 0 THEN NULL ELSE value % 5 END \
             AS column1, CAST(value AS VARCHAR) AS column2 FROM generate_series(1, 1000)",
        ] {
            ctx.sql(table).await.unwrap().collect().await.unwrap();
        }
        let plan = physical_plan(&ctx, sql).await;
        let mut options = ConfigOptions::new();
        options.extensions.insert(FlumenConfig {
            workers,
            semi_joins_by_key_set: by_key_set,
            ..FlumenConfig::default()
        });
        let after = SemiJoinsByKeySet
            .optimize(Arc::clone(&plan), &options)
            .unwrap();
        let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(false).to_string();
        (show(&plan), show(&after))
    }

    /// [`plans_with`] the rule on.
    async fn plans_of(workers: WorkerMode, sql: &str) -> (String, String) {
        plans_with(workers, true, sql).await
    }

    const EXISTS: &str =
        "SELECT * FROM small WHERE EXISTS (SELECT 1 FROM big WHERE big.column1 = small.column1)";

    #[tokio::test]
    async fn exists_and_not_exists_become_joins_on_the_matched_key_set_on_workers_only() {
        let (before, threads) = plans_of(WorkerMode::Threads, EXISTS).await;
        assert!(
            before.contains("mode=CollectLeft, join_type=LeftSemi"),
            "{before}"
        );
        assert_eq!(before, threads);
        let (_, process) = plans_of(WorkerMode::Process, EXISTS).await;
        // The small side's keys probed by the big side where it is, the matched keys made
        // distinct, and the small side probing them.
        let lines: Vec<&str> = process.lines().map(str::trim).collect();
        assert!(lines[0].starts_with("HashJoinExec: mode=CollectLeft, join_type=RightSemi"));
        assert!(
            lines[1].starts_with("AggregateExec: mode=FinalPartitioned"),
            "{process}"
        );
        assert!(
            lines[2].starts_with("AggregateExec: mode=Partial"),
            "{process}"
        );
        assert!(lines[4].starts_with("HashJoinExec: mode=CollectLeft, join_type=RightSemi"));
        assert!(!process.contains("LeftSemi"), "{process}");
        let not_exists = EXISTS.replace("WHERE EXISTS", "WHERE NOT EXISTS");
        let (before, process) = plans_of(WorkerMode::Process, &not_exists).await;
        assert!(before.contains("join_type=LeftAnti"), "{before}");
        assert!(process.starts_with("HashJoinExec: mode=CollectLeft, join_type=RightAnti"));
        // With the setting off, the plan is DataFusion's.
        let (before, off) = plans_with(WorkerMode::Process, false, EXISTS).await;
        assert_eq!(before, off);
    }

    #[tokio::test]
    async fn joins_it_cannot_answer_by_key_set_keep_their_plan() {
        for sql in [
            // A condition beyond the keys.
            "SELECT * FROM small WHERE EXISTS (SELECT 1 FROM big WHERE big.column1 = small.column1 \
             AND big.column2 < small.column2)",
            // NOT IN: one NULL in the subquery empties the answer.
            "SELECT * FROM small WHERE column1 NOT IN (SELECT column1 FROM big)",
            // A small side that may give other rows a second time.
            "SELECT * FROM (SELECT column1 + CAST(random() * 2 AS BIGINT) AS k FROM small) s \
             WHERE EXISTS (SELECT 1 FROM big WHERE big.column1 = s.k)",
            "SELECT * FROM (SELECT * FROM small LIMIT 2) s \
             WHERE EXISTS (SELECT 1 FROM big WHERE big.column1 = s.column1)",
            // A small side that costs more than a scan to read again.
            "SELECT * FROM (SELECT column1, count(*) AS n FROM small GROUP BY column1) s \
             WHERE EXISTS (SELECT 1 FROM big WHERE big.column1 = s.column1)",
            // A small side filtered by a scalar subquery, a plan computed again with it.
            "SELECT * FROM small WHERE column1 < (SELECT avg(column1) FROM big) \
             AND EXISTS (SELECT 1 FROM big WHERE big.column1 = small.column1)",
            // An inner join emits nothing once per build row.
            "SELECT * FROM small JOIN big ON small.column1 = big.column1",
        ] {
            let (before, after) = plans_of(WorkerMode::Process, sql).await;
            assert!(before.contains("mode=CollectLeft"), "{sql}: {before}");
            assert_eq!(before, after, "{sql}");
        }
    }

    #[tokio::test]
    async fn a_volatile_function_or_an_order_sensitive_aggregate_makes_a_plan_differ_each_time() {
        let ctx = SessionContext::new();
        ctx.sql("CREATE TABLE t AS VALUES (1, 'a'), (2, 'b')")
            .await
            .unwrap();
        for (sql, same) in [
            ("SELECT column1 + 1 AS k FROM t WHERE column2 <> 'c'", true),
            ("SELECT column2, sum(column1) FROM t GROUP BY column2", true),
            ("SELECT column1 FROM t ORDER BY column1", true),
            ("SELECT random() AS r FROM t", false),
            (
                "SELECT column2, first_value(column1) FROM t GROUP BY column2",
                false,
            ),
            ("SELECT column1 FROM t ORDER BY column1 LIMIT 1", false),
            ("SELECT row_number() OVER () FROM t", false),
        ] {
            let plan = physical_plan(&ctx, sql).await;
            assert_eq!(same_rows_each_time(&plan), same, "{sql}");
        }
    }
}
