//! Hash exchanges that keep their input's order, swapped for plain ones, so that flumen can
//! cut them into tasks.
//!
//! Over sorted files (a Parquet file that declares its sort order, as `COPY ... ORDER BY`
//! writes), DataFusion 55 keeps the order through a hash `RepartitionExec`
//! (`preserve_order=true`) wherever that lets the node above stream: an aggregate grouped by
//! the sort key, a window partitioned by it. Each output partition of such an exchange
//! merges the sorted streams of every input partition at once. flumen's exchanges are
//! tasks: a consumer partition's blocks come from many producer tasks, one after another,
//! so `plan/cut.rs` does not cut an order-keeping exchange, and its whole subtree stayed in
//! the consumer's fragment. With workers, that fragment is not one a worker task is cut
//! from, so a `GROUP BY` of a sorted table's sort key ran entirely on the driver
//! (`tasks_on_driver.not_cut`); in threads mode it ran as one task per partition over the
//! whole input, beside the budget.
//!
//! [`PlainHashExchanges`] (after DataFusion's rules) replaces each with the plain hash
//! exchange and rebuilds the nodes above it: an aggregate then groups by hash, as
//! DataFusion plans unsorted data, and a node whose input order is no longer met (a window,
//! a merge of sorted partitions, an aggregate with `ORDER BY` in its arguments) gets a sort
//! of each partition below it, as DataFusion's `EnforceSorting` would add. With
//! `datafusion.optimizer.prefer_existing_sort = true` (the user prefers merges to sorts)
//! the plan is left as DataFusion made it, and so is an exchange over an unbounded input or
//! one a limit above reads as it streams (the kept order lets `... ORDER BY key LIMIT n`
//! stop after a few groups).

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::sanity_checker::SanityCheckPlan;
use datafusion::physical_plan::execution_plan::EmissionType;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};

/// Physical optimizer rule: an order-keeping hash `RepartitionExec` becomes a plain one,
/// with per-partition sorts added above it where a node still needs its input sorted (but
/// for those the module doc says it leaves alone).
#[derive(Debug, Default)]
pub struct PlainHashExchanges;

impl PhysicalOptimizerRule for PlainHashExchanges {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if options.optimizer.prefer_existing_sort || !has_order_keeping_exchange(&plan)? {
            return Ok(plan);
        }
        let plain = made_plain(plan, false)?.data;
        // The sorts above are added by this rule's own reading of each node's needs: the
        // check DataFusion runs last says whether the plan still holds together.
        SanityCheckPlan::new().optimize(plain, options)
    }

    fn name(&self) -> &str {
        "plain_hash_exchanges"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `node` with the order-keeping exchanges below it made plain, but those a limit above
/// reads as they stream (`limit_streams_here`): there the kept order lets the query stop
/// early (`SELECT DISTINCT id ... ORDER BY id LIMIT 5` over 4 million sorted ids: 0.03-0.06 s
/// kept, 2.3-5.6 s made plain, in threads mode).
fn made_plain(
    node: Arc<dyn ExecutionPlan>,
    limit_streams_here: bool,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    // A node that emits only once its input is done (a sort, a hash aggregate) reads all
    // of it whatever the limit above; a limit (or a node with a fetch) starts one.
    let limit_streams_below = match node.pipeline_behavior() {
        EmissionType::Final => false,
        _ => limit_streams_here || node.fetch().is_some(),
    };
    let mut changed = false;
    let mut inputs = Vec::with_capacity(node.children().len());
    for input in node.children() {
        let input = made_plain(Arc::clone(input), limit_streams_below)?;
        changed |= input.transformed;
        inputs.push(input.data);
    }
    let node = match changed {
        true => replace_children_if_necessary(node, inputs)?,
        false => node,
    };
    if let Some(exchange) = order_keeping_exchange(&node)
        && !limit_streams_here
    {
        let plain = RepartitionExec::try_new(
            Arc::clone(exchange.input()),
            exchange.partitioning().clone(),
        )?;
        return Ok(Transformed::yes(Arc::new(plain)));
    }
    match changed {
        true => Ok(Transformed::yes(inputs_sorted_as_required(node)?.data)),
        false => Ok(Transformed::no(node)),
    }
}

/// `node` as an order-keeping hash exchange over a bounded input, if it is one. Over an
/// unbounded input (a stream) the order is what lets the plan run at all: a sort there
/// would never end.
fn order_keeping_exchange(node: &Arc<dyn ExecutionPlan>) -> Option<&RepartitionExec> {
    node.downcast_ref::<RepartitionExec>().filter(|exchange| {
        exchange.preserve_order()
            && matches!(exchange.partitioning(), Partitioning::Hash(..))
            && !exchange.input().boundedness().is_unbounded()
    })
}

/// Whether `plan` holds an order-keeping hash exchange (most plans do not: they are left
/// untouched).
fn has_order_keeping_exchange(plan: &Arc<dyn ExecutionPlan>) -> Result<bool> {
    plan.exists(|node| Ok(order_keeping_exchange(node).is_some()))
}

/// `node` with a sort of each partition put over every input whose order no longer meets
/// what `node` requires of it.
fn inputs_sorted_as_required(
    node: Arc<dyn ExecutionPlan>,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    let required = node.required_input_ordering();
    let mut inputs = Vec::with_capacity(required.len());
    let mut sorted_any = false;
    for (input, requirement) in node.children().into_iter().zip(required) {
        let Some(requirement) = requirement else {
            inputs.push(Arc::clone(input));
            continue;
        };
        let requirement = requirement.into_single();
        let properties = input.equivalence_properties();
        if properties.ordering_satisfy_requirement(requirement.clone())? {
            inputs.push(Arc::clone(input));
            continue;
        }
        // Keys the input holds constant need no sorting.
        let keys = (requirement.into_iter())
            .filter(|key| properties.is_expr_constant(&key.expr).is_none())
            .map(PhysicalSortExpr::from);
        let Some(ordering) = LexOrdering::new(keys) else {
            inputs.push(Arc::clone(input));
            continue;
        };
        let several = input.output_partitioning().partition_count() > 1;
        let sort = SortExec::new(ordering, Arc::clone(input)).with_preserve_partitioning(several);
        inputs.push(Arc::new(sort));
        sorted_any = true;
    }
    if !sorted_any {
        return Ok(Transformed::no(node));
    }
    Ok(Transformed::yes(replace_children_if_necessary(
        node, inputs,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::SessionContext;

    /// A context whose `t` is one Parquet file sorted by `k` (it says so in its footer),
    /// read in 4 partitions, each a range of its row groups (and so each sorted).
    async fn sorted_table(dir: &std::path::Path) -> SessionContext {
        let mut config = datafusion::prelude::SessionConfig::new().with_target_partitions(4);
        config.options_mut().optimizer.repartition_file_min_size = 0;
        let ctx = SessionContext::new_with_config(config);
        let path = dir.join("t.parquet");
        let sql = format!(
            "COPY (SELECT value / 100 AS k, value AS v FROM generate_series(0, 9999) \
             ORDER BY k, v) TO '{}' STORED AS PARQUET OPTIONS (max_row_group_size 1000)",
            path.display()
        );
        ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        let create = format!(
            "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION '{}'",
            path.display()
        );
        ctx.sql(&create).await.unwrap().collect().await.unwrap();
        ctx
    }

    /// `sql`'s plan in `ctx`, as DataFusion makes it and with its exchanges made plain.
    async fn plan_and_plain(
        ctx: &SessionContext,
        sql: &str,
    ) -> (Arc<dyn ExecutionPlan>, Arc<dyn ExecutionPlan>) {
        let plan = ctx.sql(sql).await.unwrap();
        let plan = plan.create_physical_plan().await.unwrap();
        let options = ctx.state().config_options().clone();
        let plain = PlainHashExchanges.optimize(Arc::clone(&plan), &options);
        (plan, plain.unwrap())
    }

    /// `sql`'s two plans ([`plan_and_plain`]) as text.
    async fn plans(ctx: &SessionContext, sql: &str) -> (String, String) {
        let (plan, plain) = plan_and_plain(ctx, sql).await;
        let show = |p: &Arc<dyn ExecutionPlan>| displayable(p.as_ref()).indent(false).to_string();
        (show(&plan), show(&plain))
    }

    #[tokio::test]
    async fn a_grouped_aggregate_over_a_sorted_table_gets_a_plain_exchange() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = sorted_table(dir.path()).await;
        let (before, after) = plans(&ctx, "SELECT k, count(*) FROM t GROUP BY k").await;
        assert!(before.contains("preserve_order=true"), "{before}");
        assert!(!after.contains("preserve_order=true"), "{after}");
        // The final aggregate groups by hash now; no sort was needed.
        assert!(!after.contains("SortExec"), "{after}");
        let last = after
            .lines()
            .find(|l| l.contains("FinalPartitioned"))
            .unwrap();
        assert!(!last.contains("ordering_mode=Sorted"), "{after}");
    }

    /// Runs `plan` in `ctx` and prints its rows, in the order they came.
    async fn rows(ctx: &SessionContext, plan: Arc<dyn ExecutionPlan>) -> String {
        let batches = datafusion::physical_plan::collect(plan, ctx.task_ctx())
            .await
            .unwrap();
        datafusion::arrow::util::pretty::pretty_format_batches(&batches)
            .unwrap()
            .to_string()
    }

    #[tokio::test]
    async fn an_order_the_exchange_kept_is_made_again_by_a_sort() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = sorted_table(dir.path()).await;
        let sql = "SELECT k, count(*), sum(v) FROM t GROUP BY k ORDER BY k";
        let (before, after) = plans(&ctx, sql).await;
        assert!(before.contains("preserve_order=true"), "{before}");
        assert!(!before.contains("SortExec"), "{before}");
        assert!(!after.contains("preserve_order=true"), "{after}");
        // The merge of sorted partitions above needs each partition sorted by `k`.
        let sort = after.lines().find(|l| l.contains("SortExec")).unwrap_or("");
        assert!(sort.contains("expr=[k@0 ASC NULLS LAST]"), "{after}");
        assert!(sort.contains("preserve_partitioning=[true]"), "{after}");
        // Both plans give the same rows in the same order.
        let (plan, plain) = plan_and_plain(&ctx, sql).await;
        let (want, got) = (rows(&ctx, plan).await, rows(&ctx, plain).await);
        assert_eq!(got, want);
        assert_eq!(want.lines().count(), 100 + 4, "{want}");
    }

    #[tokio::test]
    async fn a_limit_reading_the_groups_as_they_stream_keeps_the_order() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = sorted_table(dir.path()).await;
        // The first 5 groups in key order: the kept order stops the scan early.
        let sql = "SELECT k, count(*) FROM t GROUP BY k ORDER BY k LIMIT 5";
        let (before, after) = plans(&ctx, sql).await;
        assert!(before.contains("preserve_order=true"), "{before}");
        assert_eq!(before, after);
        // The 5 largest groups need every group first: the exchange is made plain.
        let sql = "SELECT k, count(*) FROM t GROUP BY k ORDER BY count(*) DESC, k LIMIT 5";
        let (before, after) = plans(&ctx, sql).await;
        assert!(before.contains("preserve_order=true"), "{before}");
        assert!(!after.contains("preserve_order=true"), "{after}");
    }

    #[tokio::test]
    async fn prefer_existing_sort_keeps_the_merge() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = sorted_table(dir.path()).await;
        ctx.sql("SET datafusion.optimizer.prefer_existing_sort = true")
            .await
            .unwrap();
        let (before, after) = plans(&ctx, "SELECT k, count(*) FROM t GROUP BY k").await;
        assert_eq!(before, after);
    }
}
