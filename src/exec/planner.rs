//! `FlumenQueryPlanner`: DataFusion plans and optimizes as usual, then flumen cuts the
//! physical plan into operators and returns a [`FlumenExec`] that runs them.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::display::{PlanType, StringifiedPlan};
use datafusion::common::format::ExplainFormat;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::datasource::sink::DataSinkExec;
use datafusion::error::Result;
use datafusion::execution::SessionState;
use datafusion::execution::context::QueryPlanner;
use datafusion::logical_expr::{Explain, LogicalPlan, ToStringifiedPlan};
use datafusion::physical_plan::analyze::AnalyzeExec;
use datafusion::physical_plan::explain::ExplainExec;
use datafusion::physical_plan::{ExecutionPlan, displayable, replace_children_if_necessary};
use datafusion::physical_planner::{DefaultPhysicalPlanner, PhysicalPlanner};

use crate::cluster::WorkerPoolSlot;
use crate::cluster::worker_pool::PoolSettings;
use crate::config::{FlumenConfig, WorkerMode};
use crate::exec::flumen_exec::FlumenExec;
use crate::exec::replan::Replanner;
use crate::plan::exchange_sizing::{ExchangeSizing, row_width};
use crate::plan::graph::{OperatorGraph, Pool};
use crate::plan::range_sort::plan_range_sorts;
use crate::plan::row_group_layout::{LayoutCache, RowGroupLayout};
use crate::plan::row_group_samples::RowGroupSamplePlanner;
use crate::plan::sample_keys::SampleKeysPlanner;
use crate::plan::stage_input::StageInputExec;

/// The query planner of a flumen session.
#[derive(Debug, Default)]
pub struct FlumenQueryPlanner {}

/// DataFusion's physical planner, with flumen's logical nodes (`TABLESAMPLE`'s keys and
/// row groups).
fn physical_planner() -> DefaultPhysicalPlanner {
    DefaultPhysicalPlanner::with_extension_planners(vec![
        Arc::new(SampleKeysPlanner),
        Arc::new(RowGroupSamplePlanner),
    ])
}

fn flumen_config(session: &dyn Session) -> FlumenConfig {
    session
        .config_options()
        .extensions
        .get::<FlumenConfig>()
        .cloned()
        .unwrap_or_default()
}

/// Cut a DataFusion physical plan into operators and wrap it in a [`FlumenExec`];
/// `sizing`: how its hash exchanges were sized ([`sized_physical_plan`]). Out of core, its
/// full sorts become range-partitioned sorts first (which samples their keys now).
pub async fn to_flumen_plan(
    plan: Arc<dyn ExecutionPlan>,
    session: &dyn Session,
    sizing: ExchangeSizing,
) -> Result<Arc<FlumenExec>> {
    let plan = crate::io::output_commit::stage_file_sinks(plan)?;
    let plan = if sizing.out_of_core() {
        plan_range_sorts(plan, &sizing, session.task_ctx(), session.config_options()).await?
    } else {
        plan
    };
    let cache = session.config().get_extension::<LayoutCache>();
    let layout = RowGroupLayout::read(&plan, session.runtime_env(), cache.as_deref()).await;
    let mut graph = OperatorGraph::cut(plan, session.config_options(), &layout, sizing)?;
    // The root goes to the workers only if they run every node of it.
    graph.root_on_workers &= workers_run_every_node(&graph.root().fragment);
    Ok(Arc::new(FlumenExec::new(graph, flumen_config(session))))
}

/// [`to_flumen_plan`] for a query to run: an in-core plan also gets a [`Replanner`] that
/// plans `logical_plan` again out of core if its run is refused memory
/// ([`crate::exec::replan`]).
async fn to_runnable_plan(
    plan: Arc<dyn ExecutionPlan>,
    logical_plan: &LogicalPlan,
    session: &dyn Session,
    sizing: ExchangeSizing,
) -> Result<Arc<dyn ExecutionPlan>> {
    let replans = !sizing.out_of_core() && out_of_core_differs(&plan);
    let flumen = to_flumen_plan(plan, session, sizing).await?;
    let Some(state) = session.as_any().downcast_ref::<SessionState>() else {
        return Ok(flumen);
    };
    if !replans {
        return Ok(flumen);
    }
    let (logical_plan, state) = (Arc::new(logical_plan.clone()), Arc::new(state.clone()));
    let replanner = Replanner::new(move |seen_bytes| {
        let (logical_plan, state) = (Arc::clone(&logical_plan), Arc::clone(&state));
        Box::pin(async move {
            let planner = physical_planner();
            let (plan, sizing) =
                sized_physical_plan(&planner, &logical_plan, state.as_ref(), Some(seen_bytes))
                    .await?;
            to_flumen_plan(plan, state.as_ref(), sizing).await
        })
    });
    let flumen = Arc::into_inner(flumen).expect("a plan just made has one owner");
    Ok(Arc::new(flumen.with_replanner(replanner)))
}

/// Whether planning `plan` out of core would change it: only its hash exchanges (more
/// partitions, run in waves) and full sorts (range sorts) do. A plan with neither, refused
/// memory in core, would be refused again: it gets no replanner (and its query does not pay
/// for a copy of the session state).
fn out_of_core_differs(plan: &Arc<dyn ExecutionPlan>) -> bool {
    use datafusion::physical_plan::Partitioning;
    use datafusion::physical_plan::repartition::RepartitionExec;
    use datafusion::physical_plan::sorts::sort::SortExec;
    let mut differs = false;
    let _ = plan.apply(|node| {
        differs |= node
            .downcast_ref::<RepartitionExec>()
            .is_some_and(|r| matches!(r.partitioning(), Partitioning::Hash(..)))
            || node
                .downcast_ref::<SortExec>()
                .is_some_and(|sort| sort.fetch().is_none());
        Ok(match differs {
            true => TreeNodeRecursion::Stop,
            false => TreeNodeRecursion::Continue,
        })
    });
    differs
}

/// Whether a worker runs every node of `fragment` (its stage inputs become in-memory scans).
fn workers_run_every_node(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    let mut all = true;
    let _ = fragment.apply(|node| {
        if node.downcast_ref::<StageInputExec>().is_some() {
            return Ok(TreeNodeRecursion::Jump);
        }
        all &= crate::cluster::admission::sends_node(node.name());
        Ok(TreeNodeRecursion::Continue)
    });
    all
}

/// DataFusion's physical plan of `logical_plan`, with its hash exchanges sized to the data
/// and the memory budget: when the estimated bytes into an exchange need more partitions
/// than `target_partitions` gives, the plan is made again with as many (out of core).
/// `out_of_core_at_least`: plan it out of core whatever the estimates, its largest
/// exchange at least these bytes (a run refused memory in core saw them).
pub async fn sized_physical_plan(
    planner: &DefaultPhysicalPlanner,
    logical_plan: &LogicalPlan,
    session: &dyn Session,
    out_of_core_at_least: Option<u64>,
) -> Result<(Arc<dyn ExecutionPlan>, ExchangeSizing)> {
    // A cluster of more CPU slots than `target_partitions`: planned with one per slot.
    let widened = match cluster_partitions(session).await {
        Some(slots) => session
            .as_any()
            .downcast_ref::<SessionState>()
            .map(|state| {
                let mut state = state.clone();
                state.config_mut().options_mut().execution.target_partitions = slots;
                state
            }),
        None => None,
    };
    let session: &dyn Session = match &widened {
        Some(state) => state,
        None => session,
    };
    let plan = planner.create_physical_plan(logical_plan, session).await?;
    let mut sizing = ExchangeSizing::choose(&plan, session.config_options());
    if let Some(seen_bytes) = out_of_core_at_least {
        sizing = sizing.out_of_core_at_least(seen_bytes);
    }
    let row_group_rows = writer_row_group_rows(&plan, session.config_options());
    let split_small_files = splits_small_files(&plan, session.config_options());
    if !sizing.out_of_core() && row_group_rows.is_none() && !split_small_files {
        return Ok((plan, sizing));
    }
    let Some(state) = session.as_any().downcast_ref::<SessionState>() else {
        return Ok((plan, ExchangeSizing::default()));
    };
    let mut state = state.clone();
    let options = state.config_mut().options_mut();
    if sizing.out_of_core() {
        sizing.apply(options);
    }
    if let Some(rows) = row_group_rows {
        options.execution.parquet.max_row_group_size = rows;
    }
    if split_small_files {
        options.optimizer.repartition_file_min_size = 0;
    }
    let plan = planner.create_physical_plan(logical_plan, &state).await?;
    Ok((plan, sizing))
}

/// With a cluster attached (`flumen.cluster`, `flumen.cluster_partitions` on), the CPU slots
/// its live workers announced, when more than `target_partitions` (which DataFusion sets
/// from the driver's cores); `None` otherwise, or when the cluster cannot be reached (the run
/// then says why). Starts the session's CPU workers' pool when none is (as the run would).
async fn cluster_partitions(session: &dyn Session) -> Option<usize> {
    let config = flumen_config(session);
    if !config.cluster_partitions
        || config.workers != WorkerMode::Process
        || config.cluster.trim().is_empty()
    {
        return None;
    }
    let state = session.as_any().downcast_ref::<SessionState>()?;
    let slot = state.config().get_extension::<WorkerPoolSlot>()?;
    let pool = match slot.current(Pool::Cpu).await {
        Some(pool) => pool,
        None => {
            let settings = PoolSettings::of_config(&config, Pool::Cpu).ok()?;
            slot.get_or_start(Pool::Cpu, settings).await.ok()?
        }
    };
    let slots = pool.live_slots();
    (slots > session.config_options().execution.target_partitions).then_some(slots)
}

/// Whether `plan` calls a model and DataFusion left a Parquet scan in fewer partitions than
/// `target_partitions` (files under `repartition_file_min_size`, 10 MiB by default, are not
/// cut): there rows are dear (`clean_text`, tokenizing: 5,000 documents are a few MiB), and
/// a model reads a partition's splits one task after another, so it would wait on one CPU
/// task at a time. Planned again with every file cut into byte ranges, whose row groups'
/// pieces `SplitSourceExec` deals out over all partitions.
fn splits_small_files(plan: &Arc<dyn ExecutionPlan>, options: &ConfigOptions) -> bool {
    let partitions = options.execution.target_partitions;
    if !options.optimizer.repartition_file_scans
        || options.optimizer.repartition_file_min_size == 0
        || partitions < 2
        || !crate::plan::cut::has_accelerator_projection(plan)
    {
        return false;
    }
    let mut scans = vec![];
    crate::plan::cut::collect_parquet_scans(plan, &mut scans);
    scans.iter().any(|scan| scan.file_groups.len() < partitions)
}

/// Rows per Parquet row group for the plan's file writer when the session's default would
/// not fit [`WRITER_ROW_GROUP_SHARE`] of `flumen.memory_budget` (a writer holds whole row
/// groups before it flushes them, memory no operator can spill); `None` when it fits or
/// nothing is written. A `COPY ... OPTIONS ('format.max_row_group_size' ...)` still
/// decides for itself.
fn writer_row_group_rows(plan: &Arc<dyn ExecutionPlan>, options: &ConfigOptions) -> Option<usize> {
    let budget = options
        .extensions
        .get::<FlumenConfig>()
        .map(|c| c.memory_budget.0)
        .unwrap_or(u64::MAX);
    let mut rows = None;
    let _ = plan.apply(|node| {
        if let Some(sink) = node.downcast_ref::<DataSinkExec>() {
            let fit = (budget / WRITER_ROW_GROUP_SHARE / row_width(sink.input()))
                .max(MIN_ROW_GROUP_ROWS) as usize;
            if fit < options.execution.parquet.max_row_group_size {
                rows = Some(fit);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    rows
}

/// A row group takes at most this fraction of the budget (1/32): DataFusion's parallel
/// Parquet writer holds up to four at once (one being encoded, one finished and queued, one
/// being appended to the file, and that one's copy in the file's buffer), so the writer stays
/// within an eighth. With row groups of an eighth it held half the budget: a streaming
/// `COPY` of 2 GB under 200 MB (26 MB row groups) had 100 MB of writer reservations and the
/// heap nobody reserved at its cap, and spilled 0.5-1.7 GB of blocks it read straight back.
const WRITER_ROW_GROUP_SHARE: u64 = 32;

/// Fewest rows [`writer_row_group_rows`] makes a row group.
const MIN_ROW_GROUP_ROWS: u64 = 4096;

/// `EXPLAIN` of `e` with flumen's operators in place of DataFusion's final physical plan,
/// the query planned once. DataFusion's `ExplainExec` keeps no plan, so planning the
/// `Explain` and then its query again to show the operators planned the query twice
/// (~0.6 s more at 20,000 files). The rows are the ones DataFusion's `EXPLAIN` shows: the
/// final logical plan (unless `datafusion.explain.physical_plan_only`) and the physical
/// plan. `None` where DataFusion's own explain must run first: `VERBOSE` (it shows each
/// rule's plan), a format but the indented one, `datafusion.explain.logical_plan_only`,
/// flumen's operators not asked for (`flumen.explain_operators`), or a query whose
/// planning fails (DataFusion shows the error as a row).
async fn explain_planned_once(
    planner: &DefaultPhysicalPlanner,
    e: &Explain,
    session: &dyn Session,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let options = &session.config_options().explain;
    if e.verbose
        || e.explain_format != ExplainFormat::Indent
        || !e.logical_optimization_succeeded
        || options.logical_plan_only
        || !flumen_config(session).explain_operators
    {
        return Ok(None);
    }
    let Ok((inner, sizing)) = sized_physical_plan(planner, &e.plan, session, None).await else {
        return Ok(None);
    };
    let flumen = to_flumen_plan(inner, session, sizing).await?;
    let mut plans = vec![];
    if !options.physical_plan_only {
        plans.extend(e.stringified_plans.iter().cloned());
        plans.push(e.plan.to_stringified(PlanType::FinalLogicalPlan));
    }
    let text = displayable(flumen.as_ref()).indent(false).to_string();
    plans.push(StringifiedPlan::new(PlanType::FinalPhysicalPlan, text));
    let schema = Arc::clone(e.schema.inner());
    Ok(Some(Arc::new(ExplainExec::new(schema, plans, false))))
}

#[async_trait]
impl QueryPlanner for FlumenQueryPlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let planner = physical_planner();
        if let LogicalPlan::Explain(e) = logical_plan
            && let Some(plan) = explain_planned_once(&planner, e, session).await?
        {
            return Ok(plan);
        }
        let (plan, sizing) = sized_physical_plan(&planner, logical_plan, session, None).await?;
        if let Some(explain) = plan.downcast_ref::<ExplainExec>() {
            let LogicalPlan::Explain(e) = logical_plan else {
                return Ok(plan);
            };
            if !flumen_config(session).explain_operators {
                return Ok(plan);
            }
            let has_final = explain
                .stringified_plans()
                .iter()
                .any(|p| p.plan_type == PlanType::FinalPhysicalPlan);
            if !has_final {
                return Ok(plan);
            }
            // Show the operators in place of DataFusion's final physical plan.
            let (inner, sizing) = sized_physical_plan(&planner, &e.plan, session, None).await?;
            let flumen: Arc<dyn ExecutionPlan> = to_flumen_plan(inner, session, sizing).await?;
            let text = displayable(flumen.as_ref())
                .indent(explain.verbose())
                .to_string();
            let plans = explain
                .stringified_plans()
                .iter()
                .map(|p| {
                    if p.plan_type == PlanType::FinalPhysicalPlan {
                        StringifiedPlan::new(PlanType::FinalPhysicalPlan, text.clone())
                    } else {
                        p.clone()
                    }
                })
                .collect();
            return Ok(Arc::new(ExplainExec::new(
                explain.schema(),
                plans,
                explain.verbose(),
            )));
        }
        if let Some(analyze) = plan.downcast_ref::<AnalyzeExec>() {
            let input = Arc::clone(analyze.input());
            let flumen = match logical_plan {
                LogicalPlan::Analyze(a) => {
                    to_runnable_plan(input, &a.input, session, sizing).await?
                }
                _ => to_flumen_plan(input, session, sizing).await?,
            };
            return replace_children_if_necessary(plan, vec![flumen]);
        }
        to_runnable_plan(plan, logical_plan, session, sizing).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[tokio::test]
    async fn only_plans_with_hash_exchanges_or_full_sorts_are_planned_again() {
        let ctx = datafusion::prelude::SessionContext::new_with_config(
            datafusion::prelude::SessionConfig::new().with_target_partitions(2),
        );
        let plan = |sql: &'static str| {
            let ctx = ctx.clone();
            async move { ctx.sql(sql).await?.create_physical_plan().await }
        };
        let join = "SELECT count(*) FROM range(0, 100000) a JOIN range(0, 100000) b \
                    ON a.value = b.value";
        let sort = "SELECT value FROM range(0, 1000) ORDER BY value DESC";
        let top = "SELECT value FROM range(0, 1000) ORDER BY value DESC LIMIT 3";
        let scan = "SELECT value * 2 FROM range(0, 1000) WHERE value > 3";
        assert!(out_of_core_differs(&plan(join).await.unwrap()));
        assert!(out_of_core_differs(&plan(sort).await.unwrap()));
        assert!(!out_of_core_differs(&plan(top).await.unwrap()));
        assert!(!out_of_core_differs(&plan(scan).await.unwrap()));
    }
}
