//! Sorts above grouping sets that keep every key.
//!
//! DataFusion 55 carries a filter's constants through an aggregate of grouping sets
//! (`ROLLUP`, `CUBE`, `GROUPING SETS`): after `WHERE g = 'red' ... GROUP BY ROLLUP (g, h)`
//! it takes `g` as constant, though the rolled-up rows hold NULL there. Its sorting rule then
//! drops `g` from the sort that `ORDER BY g, h` needs (a sort by a constant orders nothing),
//! and the rolled-up rows come out wherever `h` puts them: a wrong order, and with a `LIMIT`
//! wrong rows. (PostgreSQL had the same bug until version 18.)
//!
//! Two physical optimizer rules around DataFusion's own:
//! - [`HideGroupingSetConstants`], first, puts a [`NoConstantsExec`] above each aggregate
//!   that reads rows into grouping sets (its partial or single mode). The node passes its
//!   input on and states no constants, no equivalences and no ordering, so the rules after
//!   it see the grouping columns as the variables they are.
//! - [`RemoveNoConstantsNodes`], last, takes those nodes out again: the sorts the rules in
//!   between placed keep their keys, and the plan that runs has no node DataFusion's own
//!   planner would not make.
//!
//! The cut has its own guard for the same fault at its exchanges (`cut.rs`,
//! `exchange_properties`).

use std::fmt;
use std::sync::Arc;

use datafusion::common::Statistics;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::filter_pushdown::{
    ChildPushdownResult, FilterDescription, FilterPushdownPhase, FilterPushdownPropagation,
};
use datafusion::physical_plan::projection::{ProjectionExec, make_with_child};
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};

use crate::plan::only_child;

/// Whether `plan` is an aggregate that reads rows into grouping sets, some of which leave a
/// group column out (NULL there): one in partial or single mode, not the final one that
/// merges partial groups.
fn reads_rows_into_grouping_sets(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<AggregateExec>().is_some_and(|agg| {
        !matches!(
            agg.mode(),
            AggregateMode::Final | AggregateMode::FinalPartitioned
        ) && agg.group_expr().groups().iter().flatten().any(|null| *null)
    })
}

/// Physical optimizer rule, first: a [`NoConstantsExec`] above each aggregate that reads
/// rows into grouping sets.
#[derive(Debug, Default)]
pub struct HideGroupingSetConstants;

impl PhysicalOptimizerRule for HideGroupingSetConstants {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            if !reads_rows_into_grouping_sets(&node) {
                return Ok(Transformed::no(node));
            }
            Ok(Transformed::yes(Arc::new(NoConstantsExec::new(node))))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "hide_grouping_set_constants"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Physical optimizer rule, last: every [`NoConstantsExec`] replaced by its input.
#[derive(Debug, Default)]
pub struct RemoveNoConstantsNodes;

impl PhysicalOptimizerRule for RemoveNoConstantsNodes {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| match node.downcast_ref::<NoConstantsExec>() {
            Some(hidden) => Ok(Transformed::yes(Arc::clone(&hidden.input))),
            None => Ok(Transformed::no(node)),
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "remove_no_constants_nodes"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Passes its input on, stating nothing about it but its partitioning (no constants, no
/// equivalences, no ordering), or ([`NoConstantsExec::keeping_order`]) its orderings
/// alone. Lives only between the rules that put it in ([`HideGroupingSetConstants`],
/// [`HideOuterJoinConstants`](crate::plan::outer_join_constants::HideOuterJoinConstants))
/// and [`RemoveNoConstantsNodes`].
#[derive(Debug)]
pub struct NoConstantsExec {
    input: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
    keeps_order: bool,
}

impl NoConstantsExec {
    /// `input`, its constants, equivalences and ordering hidden.
    pub fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        let equivalences = EquivalenceProperties::new(input.schema());
        Self::stating(input, equivalences, false)
    }

    /// `input`, its constants and equivalences hidden, its orderings stated (DataFusion
    /// keeps a constant as a class of equal expressions holding a literal).
    pub fn keeping_order(input: Arc<dyn ExecutionPlan>) -> Self {
        let stated = input.equivalence_properties();
        let orderings = (stated.oeq_class().iter()).map(|ordering| ordering.iter().cloned());
        let equivalences = EquivalenceProperties::new_with_orderings(input.schema(), orderings);
        Self::stating(input, equivalences, true)
    }

    fn stating(
        input: Arc<dyn ExecutionPlan>,
        equivalences: EquivalenceProperties,
        keeps_order: bool,
    ) -> Self {
        let properties = PlanProperties::new(
            equivalences,
            input.output_partitioning().clone(),
            input.pipeline_behavior(),
            input.boundedness(),
        );
        Self {
            input,
            properties: Arc::new(properties),
            keeps_order,
        }
    }

    /// This node over another input, hiding what it hid.
    fn over(&self, input: Arc<dyn ExecutionPlan>) -> Self {
        match self.keeps_order {
            true => Self::keeping_order(input),
            false => Self::new(input),
        }
    }
}

impl DisplayAs for NoConstantsExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "NoConstantsExec")
    }
}

impl ExecutionPlan for NoConstantsExec {
    fn name(&self) -> &str {
        "NoConstantsExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![self.keeps_order]
    }

    // Over an outer join's side, it passes its input on where the join reads it: the join
    // alone decides whether more partitions pay (DataFusion's distribution rule would
    // otherwise put a round-robin exchange under this node that the plan without it lacks).
    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![!self.keeps_order]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(
            self.over(only_child(children, "NoConstantsExec")?),
        ))
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        // The input's rows pass unchanged: its statistics are this node's.
        Ok((input_stats.first().cloned())
            .unwrap_or_else(|| Arc::new(Statistics::new_unknown(&self.schema()))))
    }

    fn repartitioned(
        &self,
        target_partitions: usize,
        config: &ConfigOptions,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        Ok((self.input.repartitioned(target_partitions, config)?)
            .map(|input| Arc::new(self.over(input)) as Arc<dyn ExecutionPlan>))
    }

    // DataFusion's distribution rule still asks this older call (whether a round-robin
    // exchange over a small input pays).
    #[allow(deprecated)]
    fn partition_statistics(&self, partition: Option<usize>) -> Result<Arc<Statistics>> {
        self.input.partition_statistics(partition)
    }

    fn try_swapping_with_projection(
        &self,
        projection: &ProjectionExec,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        // A projection that narrows the rows goes below, as DataFusion's own pass-through
        // nodes do. (Handing it to the input's own swap was wrong: that swap takes the
        // projection's input to be the input itself, and a `CoalescePartitionsExec` below
        // repeated itself without end.)
        if projection.expr().len() >= projection.input().schema().fields().len() {
            return Ok(None);
        }
        let input = make_with_child(projection, &self.input)?;
        Ok(Some(Arc::new(self.over(input))))
    }

    fn gather_filters_for_pushdown(
        &self,
        _phase: FilterPushdownPhase,
        parent_filters: Vec<Arc<dyn PhysicalExpr>>,
        _config: &ConfigOptions,
    ) -> Result<FilterDescription> {
        FilterDescription::from_children(parent_filters, &self.children())
    }

    fn handle_child_pushdown_result(
        &self,
        _phase: FilterPushdownPhase,
        child_pushdown_result: ChildPushdownResult,
        _config: &ConfigOptions,
    ) -> Result<FilterPushdownPropagation<Arc<dyn ExecutionPlan>>> {
        Ok(FilterPushdownPropagation::if_all(child_pushdown_result))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        self.input.execute(partition, context)
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::{SessionConfig, SessionContext};

    /// `WHERE id % 3 = 1 ... GROUPING SETS ((k), (k, id % 3), ())`: `id % 3` is 1 or NULL.
    const QUERY: &str = "SELECT k, id % 3 AS m, count(*) AS n FROM t WHERE id % 3 = 1 \
                         GROUP BY GROUPING SETS ((k), (k, id % 3), ()) ORDER BY k, m DESC";

    /// A flumen session (or a vanilla one) with the table `t`.
    async fn session(flumen_rules: bool) -> SessionContext {
        let config = SessionConfig::new().with_target_partitions(2);
        let ctx = match flumen_rules {
            true => {
                let flumen = crate::FlumenConfig::default();
                let config = crate::flumen_session_config(config, flumen.clone());
                crate::session_with_config(config, flumen)
            }
            false => SessionContext::new_with_config(config),
        };
        ctx.sql("CREATE TABLE t AS SELECT value AS id, value % 2 AS k FROM generate_series(1, 12)")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        ctx
    }

    /// The plan's `SortExec` lines, and the query's rows.
    async fn sort_keys_and_rows(ctx: &SessionContext) -> (String, String) {
        let df = ctx.sql(QUERY).await.unwrap();
        let plan = df.clone().create_physical_plan().await.unwrap();
        let shown = displayable(plan.as_ref()).indent(true).to_string();
        let sorts = (shown.lines())
            .filter(|l| l.contains("SortExec:"))
            .map(str::trim)
            .collect::<Vec<_>>()
            .join("\n");
        assert!(!shown.contains("NoConstantsExec"), "{shown}");
        let rows = pretty_format_batches(&df.collect().await.unwrap())
            .unwrap()
            .to_string();
        (sorts, rows)
    }

    #[tokio::test]
    async fn a_sort_above_grouping_sets_keeps_a_key_the_filter_fixed() {
        let (sorts, rows) = sort_keys_and_rows(&session(true).await).await;
        assert!(sorts.contains("m@1 DESC"), "{sorts}");
        // NULLS FIRST for DESC: the rolled-up row of each `k` before its row with m = 1.
        let expected = "\
+---+---+---+
| k | m | n |
+---+---+---+
| 0 |   | 2 |
| 0 | 1 | 2 |
| 1 |   | 2 |
| 1 | 1 | 2 |
|   |   | 4 |
+---+---+---+";
        assert_eq!(rows, expected);
        // DataFusion alone drops `m` from the sort.
        let (sorts, _) = sort_keys_and_rows(&session(false).await).await;
        assert!(!sorts.contains("m@1"), "{sorts}");
    }
}
