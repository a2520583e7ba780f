//! Cutting DataFusion's optimized physical plan into flumen operators.
//!
//! An operator is a fragment of the physical plan whose leaves are either real sources or
//! [`StageInputExec`]s reading the blocks of another operator. Cuts are made at exchanges
//! (`RepartitionExec`, `CoalescePartitionsExec`, `SortPreservingMergeExec`) and around every
//! projection that calls an accelerator UDF; that projection becomes an operator of its own
//! on the accelerator pool. Scalar subqueries become operators of their own, read by the
//! operators that use their values ([`SubqueryValuesExec`]). With worker processes, a sink's
//! input is an operator of its own (the sink writes on the driver, its input on the workers).

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::sink::DataSinkExec;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::logical_expr::physical_planning_context::ScalarSubqueryResults;
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::Distribution;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::expressions::Column;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode,
};
use datafusion::physical_plan::limit::{GlobalLimitExec, LocalLimitExec};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::recursive_query::RecursiveQueryExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::scalar_subquery::{ScalarSubqueryExec, ScalarSubqueryLink};
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::unnest::UnnestExec;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, Partitioning, PlanProperties,
    replace_children_if_necessary,
};

use crate::config::{FeedJoins, FlumenConfig, WorkerMode};
use crate::functions::accelerator::calls_accelerator_udf;
use crate::plan::accelerator_projection::AcceleratorProjectionExec;
use crate::plan::concat_partitions::ConcatPartitionsExec;
use crate::plan::dynamic_filters::with_own_dynamic_filters;
use crate::plan::exchange_sizing::ExchangeSizing;
use crate::plan::graph::{
    CpuBundles, Operator, OperatorGraph, OperatorId, Pool, RunsAgainUnlike, TaskShape,
};
use crate::plan::merge_runs::MergeRunsExec;
use crate::plan::model_batching::ModelBatching;
use crate::plan::partition_cut::{
    cuts_per_partition, only_merges_inputs, shares_build_matches_across_partitions,
};
use crate::plan::range_sort::sort_run_bytes;
use crate::plan::recursive_queries;
use crate::plan::row_group_layout::RowGroupLayout;
use crate::plan::sample_keys::SampleKeysExec;
use crate::plan::split_source::{ModelSplitLimit, SplitSourceExec};
use crate::plan::stage_input::{InputExchange, StageInputExec};
use crate::plan::subquery_values::{SubqueryValuesExec, reads_values_of};
use crate::plan::task_topk::{
    Below, TopkOver, keeping_top_rows, topk_over, unordered, wants_last_first,
};

impl OperatorGraph {
    /// Cut `plan` into operators; `layout` places its Parquet scans' splits on row group
    /// boundaries; `sizing` is how its hash exchanges were sized (out of core or not).
    pub(crate) fn cut(
        plan: Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
        layout: &RowGroupLayout,
        sizing: ExchangeSizing,
    ) -> Result<Self> {
        let config = options
            .extensions
            .get::<FlumenConfig>()
            .cloned()
            .unwrap_or_default();
        let batching = ModelBatching::for_plan(&plan, options, &config);
        let mut cutter = Cutter {
            operators: vec![],
            config,
            batching,
            layout,
            out_of_core: sizing.out_of_core(),
            sort_pushdown: options.optimizer.enable_sort_pushdown,
            scalar_subqueries: vec![],
        };
        let root = cutter.rewrite(plan)?;
        // A root that only passes its producer's blocks on (an accelerator projection at the
        // top of the plan) needs no operator of its own: the producer is the root.
        let pass_through = root.downcast_ref::<StageInputExec>().is_some_and(|si| {
            matches!(si.exchange(), InputExchange::Preserve)
                && si.fetch().is_none()
                && si.producer() + 1 == cutter.operators.len()
        });
        if !pass_through {
            let id = cutter.add_operator(root, Pool::Cpu, None)?;
            cutter.root_streams_its_probes(id);
        }
        let mut consumer = vec![None; cutter.operators.len()];
        for op in &cutter.operators {
            for input in &op.inputs {
                consumer[*input] = Some(op.id);
            }
        }
        let fed_inputs: Vec<Vec<bool>> = match cutter.config.workers {
            WorkerMode::Process if !cutter.out_of_core => {
                let all = cutter.config.feed_joins_on_workers == FeedJoins::All;
                fed_where_read_as_made(&mut cutter.operators, &consumer, all)
            }
            _ => vec![],
        };
        let gates = gates(&cutter.operators, &fed_inputs);
        let root = cutter.operators.last().expect("a root");
        let root_on_workers = cutter.config.workers == WorkerMode::Process
            && !cutter.out_of_core
            && root.shape == TaskShape::Barrier
            && !root.streamed_inputs.iter().any(|s| *s)
            && cuts_per_partition(&root.fragment)
            && !only_merges_inputs(&root.fragment)
            && !limit_stops_early(root, &cutter.operators);
        let cpu_bundles = CpuBundles::for_mode(
            cutter.config.workers,
            cutter.config.block_rows(),
            cutter.config.worker_bundle_blocks,
        );
        let build_bounds = crate::plan::build_bounds::build_bounds(&cutter.operators);
        Ok(Self {
            operators: cutter.operators,
            consumer,
            gates,
            sizing,
            batching,
            cpu_bundles,
            root_on_workers,
            fed_inputs,
            build_bounds,
        })
    }
}

/// Whether `plan` has a model UDF projection (an accelerator operator to be).
pub(crate) fn has_accelerator_projection(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<AcceleratorProjectionExec>().is_some()
        || plan.children().into_iter().any(has_accelerator_projection)
}

struct Cutter<'a> {
    operators: Vec<Operator>,
    config: FlumenConfig,
    /// How the plan feeds its models: its scans' split limit and first splits.
    batching: ModelBatching,
    layout: &'a RowGroupLayout,
    /// The plan runs out of core ([`ExchangeSizing::out_of_core`]): per-partition operators
    /// run in waves of the slots (no gang unless a node needs it), none streams a probe
    /// input (its partitions would all run at once).
    out_of_core: bool,
    /// DataFusion may reorder a scan's row groups for a sort above it
    /// (`datafusion.optimizer.enable_sort_pushdown`).
    sort_pushdown: bool,
    /// The scalar subqueries of the `ScalarSubqueryExec`s met so far: each operator whose
    /// fragment reads one's values gets them from operators of its own
    /// ([`SubqueryValuesExec`]).
    scalar_subqueries: Vec<ScalarSubqueries>,
}

/// The subqueries of one `ScalarSubqueryExec`: their uncut plans, and the container their
/// values go to, which the main plan's expressions read.
struct ScalarSubqueries {
    results: ScalarSubqueryResults,
    links: Vec<ScalarSubqueryLink>,
}

impl Cutter<'_> {
    /// Rewrite `plan` for the current fragment, turning every subtree below a cut into an
    /// operator of its own and putting a `StageInputExec` in its place.
    fn rewrite(&mut self, plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
        // Recursive queries re-execute their children: keep such subtrees together.
        if plan.downcast_ref::<RecursiveQueryExec>().is_some() {
            return Ok(plan);
        }
        // Scalar subqueries become operators of their own, which the operators reading
        // their values wait for (`add_operator`); the node itself only passes its input on.
        if let Some(subqueries) = plan.downcast_ref::<ScalarSubqueryExec>() {
            self.scalar_subqueries.push(ScalarSubqueries {
                results: subqueries.results().clone(),
                links: subqueries.subqueries().to_vec(),
            });
            return self.rewrite(Arc::clone(subqueries.input()));
        }
        if let Some(repartition) = plan.downcast_ref::<RepartitionExec>()
            && !repartition.preserve_order()
            && !matches!(
                repartition.partitioning(),
                Partitioning::UnknownPartitioning(_)
            )
        {
            let properties = exchange_properties(repartition.input(), plan.properties());
            let child = self.rewrite(Arc::clone(repartition.input()))?;
            let split = repartition.partitioning().clone();
            let producer = self.add_operator(child, Pool::Cpu, Some(split.clone()))?;
            return Ok(Arc::new(StageInputExec::new(
                producer,
                InputExchange::Split(split),
                properties,
                None,
            )));
        }
        if let Some(coalesce) = plan.downcast_ref::<CoalescePartitionsExec>() {
            let properties = exchange_properties(coalesce.input(), plan.properties());
            let child = self.rewrite(Arc::clone(coalesce.input()))?;
            let producer = self.add_operator(child, Pool::Cpu, None)?;
            return Ok(Arc::new(StageInputExec::new(
                producer,
                InputExchange::Gather,
                properties,
                coalesce.fetch(),
            )));
        }
        // A TopK's input operator keeps each task's first rows only (`plan::task_topk`).
        if let Some(found) = topk_over(&plan)
            && let Some(topk) = self.topk_over_task_topks(&found)?
        {
            return replace_children_if_necessary(plan, vec![topk]);
        }
        // A merge of sorted partitions, or the ordered concatenation of a random shuffle's
        // partitions, stays in the consumer, reading each producer partition in order.
        let merged_input = plan
            .downcast_ref::<SortPreservingMergeExec>()
            .map(|m| m.input())
            .or_else(|| {
                plan.downcast_ref::<ConcatPartitionsExec>()
                    .map(|c| c.input())
            });
        if let Some(input) = merged_input {
            let stage_input = self.operator_below(Arc::clone(input))?;
            return replace_children_if_necessary(plan, vec![stage_input]);
        }
        // A range sort's runs: the sort below becomes a per-block operator sorting bundles
        // of each range's blocks as they arrive; the merge stays in the consumer.
        if let Some(merge) = plan.downcast_ref::<MergeRunsExec>()
            && let Some(sort) = merge.input().downcast_ref::<SortExec>()
            && sort.preserve_partitioning()
            && sort.fetch().is_none()
        {
            let sort_fragment = self.rewrite(Arc::clone(merge.input()))?;
            let runs = self.add_operator(sort_fragment, Pool::Cpu, None)?;
            let op = &mut self.operators[runs];
            if op.inputs.len() == 1 && op.shape == TaskShape::Barrier {
                op.shape = TaskShape::BlockWise;
                op.gang = false;
                op.streamed_inputs = vec![false];
                let ranges = op.partitions();
                op.run_bytes = Some(sort_run_bytes(self.config.memory_budget.0, ranges));
            }
            // A partition's blocks are its runs one after the other: sorted only run by run.
            let mut properties = merge.input().properties().as_ref().clone();
            properties.eq_properties = EquivalenceProperties::new(merge.input().schema());
            let stage_input: Arc<dyn ExecutionPlan> = Arc::new(StageInputExec::new(
                runs,
                InputExchange::Preserve,
                Arc::new(properties),
                None,
            ));
            return replace_children_if_necessary(plan, vec![stage_input]);
        }
        // A sink writes and commits on the driver: with worker processes its input is an
        // operator of its own, so that the scan it writes (one partition, no exchange to cut
        // at) reads on the workers instead of with the sink.
        if let Some(sink) = plan.downcast_ref::<DataSinkExec>()
            && self.config.workers == WorkerMode::Process
            && sink.input().downcast_ref::<StageInputExec>().is_none()
        {
            let properties = Arc::clone(sink.input().properties());
            let child = self.rewrite(Arc::clone(sink.input()))?;
            // An exchange under the sink is a stage input already.
            let input = match child.downcast_ref::<StageInputExec>() {
                Some(_) => child,
                None => self.operator_over(child, properties)?,
            };
            return replace_children_if_necessary(plan, vec![input]);
        }
        let accelerator_projection = plan
            .downcast_ref::<AcceleratorProjectionExec>()
            .map(|p| p.projection())
            .or_else(|| plan.downcast_ref::<ProjectionExec>())
            .filter(|p| p.expr().iter().any(|e| calls_accelerator_udf(&e.expr)));
        if let Some(projection) = accelerator_projection {
            let stage_input = self.operator_below(Arc::clone(projection.input()))?;
            let fragment = replace_children_if_necessary(Arc::clone(&plan), vec![stage_input])?;
            let accelerator = self.add_operator(fragment, Pool::Accelerator, None)?;
            return Ok(Arc::new(StageInputExec::new(
                accelerator,
                InputExchange::Preserve,
                Arc::clone(plan.properties()),
                None,
            )));
        }
        let children = plan
            .children()
            .into_iter()
            .map(|c| self.rewrite(Arc::clone(c)))
            .collect::<Result<Vec<_>>>()?;
        if children.is_empty() {
            return Ok(plan);
        }
        replace_children_if_necessary(plan, children)
    }

    /// The TopK of `found`, cut, as an operator of its own over an operator whose tasks
    /// each keep their own first rows ([`keeping_top_rows`]), and the stage input that reads
    /// its partitions in its place; `None` where the TopK reads a scan of no more splits than
    /// partitions (its own tasks read it as well).
    fn topk_over_task_topks(
        &mut self,
        found: &TopkOver<'_>,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let TopkOver {
            topk,
            node,
            between,
            below,
        } = found;
        let (producer, exchange) = match below {
            Below::Exchange(exchange) => {
                let child = self.rewrite(Arc::clone(exchange.input()))?;
                let fragment = keeping_top_rows(topk, between, child, self.sort_pushdown)?;
                let split = exchange.partitioning().clone();
                let producer =
                    self.add_operator_with(fragment, Pool::Cpu, Some(split.clone()), true)?;
                (producer, InputExchange::Split(split))
            }
            // Only where the scan's splits hold the TopK's rows last (`ORDER BY ts DESC`
            // over files sorted by `ts`): launched first, they prune the rest. Otherwise the
            // second operator costs more than the splits' own bounds save (`largest v` in
            // `benches/topk.rs`, with workers: 90 ms before, 120 ms with it).
            Below::Scan(_) if wants_last_first(found).is_none() => return Ok(None),
            Below::Scan(scan) => {
                let fragment =
                    keeping_top_rows(topk, between, Arc::clone(scan), self.sort_pushdown)?;
                let partitions = fragment.output_partitioning().partition_count();
                let (_, splits) = split_sources(
                    Arc::clone(&fragment),
                    self.config.split_bytes.0,
                    self.batching.split_limit(),
                    self.layout,
                    (self.batching.first_block_rows, self.batching.ramped_splits),
                )?;
                if splits.iter().sum::<usize>() <= partitions {
                    return Ok(None);
                }
                let producer = self.add_operator_with(fragment, Pool::Cpu, None, true)?;
                (producer, InputExchange::Preserve)
            }
        };
        if let Some(last_first) = wants_last_first(found) {
            let op = &mut self.operators[producer];
            let mut splits = None;
            op.fragment = Arc::clone(&op.fragment)
                .transform_up(|node| {
                    let Some(split) = node.downcast_ref::<SplitSourceExec>() else {
                        return Ok(Transformed::no(node));
                    };
                    let reordered = split.read_last_first(&last_first);
                    splits = Some(reordered.splits_per_partition());
                    Ok(Transformed::yes(Arc::new(reordered) as _))
                })?
                .data;
            if let Some(splits) = splits {
                op.splits = splits;
            }
        }
        // The stage input stands for what the TopK read, in no order.
        let stage_input: Arc<dyn ExecutionPlan> = Arc::new(StageInputExec::new(
            producer,
            exchange,
            unordered(topk.input()),
            None,
        ));
        let merged = exchange_properties(node, node.properties());
        let topk = replace_children_if_necessary(Arc::clone(node), vec![stage_input])?;
        self.operator_over(topk, merged).map(Some)
    }

    /// `input`, cut, as a CPU operator of its own, and the stage input that reads its
    /// partitions in order in its place.
    fn operator_below(&mut self, input: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
        let properties = exchange_properties(&input, input.properties());
        let child = self.rewrite(input)?;
        self.operator_over(child, properties)
    }

    /// `fragment` (cut already) as a CPU operator of its own, and the stage input of
    /// `properties` (the uncut input's) that reads its partitions in order in its place.
    fn operator_over(
        &mut self,
        fragment: Arc<dyn ExecutionPlan>,
        properties: Arc<PlanProperties>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let producer = self.add_operator(fragment, Pool::Cpu, None)?;
        Ok(Arc::new(StageInputExec::new(
            producer,
            InputExchange::Preserve,
            properties,
            None,
        )))
    }

    /// A root of per-partition tasks runs in the query's output stream, on the driver,
    /// even with worker processes: its joins stream their probe inputs as in threads mode
    /// (they start once the build side is in, its dynamic filter filled).
    fn root_streams_its_probes(&mut self, root: OperatorId) {
        let op = &mut self.operators[root];
        if self.config.workers != WorkerMode::Process
            || op.shape != TaskShape::Barrier
            || self.out_of_core
        {
            return;
        }
        let mut probes = vec![];
        collect_probe_producers(&op.fragment, false, &mut probes);
        for (producer, streamed) in op.inputs.iter().zip(op.streamed_inputs.iter_mut()) {
            *streamed |= probes.contains(producer);
        }
    }

    fn add_operator(
        &mut self,
        fragment: Arc<dyn ExecutionPlan>,
        pool: Pool,
        output_split: Option<Partitioning>,
    ) -> Result<OperatorId> {
        self.add_operator_with(fragment, pool, output_split, false)
    }

    /// [`Self::add_operator`]; with `keeps_top_rows`, `fragment`'s root is a TopK that may
    /// run on any piece of its input ([`keeping_top_rows`]), and counts as row-local.
    fn add_operator_with(
        &mut self,
        fragment: Arc<dyn ExecutionPlan>,
        pool: Pool,
        output_split: Option<Partitioning>,
        keeps_top_rows: bool,
    ) -> Result<OperatorId> {
        let top_rows = keeps_top_rows.then(|| Arc::clone(&fragment));
        let fragment = self.with_subquery_values(fragment)?;
        // (producer, exchange, fetch) of every stage input leaf.
        let mut stage_inputs = vec![];
        let mut other_leaves = 0;
        let mut all_row_local = true;
        let mut row_local_but_for_limits = true;
        let mut row_local_but_for_topk = true;
        let mut stack = vec![Arc::clone(&fragment)];
        while let Some(node) = stack.pop() {
            if let Some(si) = node.downcast_ref::<StageInputExec>() {
                stage_inputs.push((si.producer(), si.exchange().clone(), si.fetch()));
                continue;
            }
            if node.children().is_empty() {
                other_leaves += 1;
            }
            let row_local =
                is_row_local(&node) || top_rows.as_ref().is_some_and(|top| Arc::ptr_eq(top, &node));
            all_row_local &= row_local;
            row_local_but_for_limits &= row_local || is_limit(&node);
            row_local_but_for_topk &= row_local || is_limit(&node) || is_topk(&node);
            stack.extend(node.children().into_iter().cloned());
        }
        // Stage inputs are numbered in the order their producers were created.
        stage_inputs.sort_by_key(|(producer, _, _)| *producer);
        let fragment = number_stage_inputs(fragment)?;
        let single_unlimited_input = stage_inputs.len() == 1 && stage_inputs[0].2.is_none();
        let shape = if stage_inputs.is_empty() {
            TaskShape::Source
        } else if single_unlimited_input && other_leaves == 0 && all_row_local {
            TaskShape::BlockWise
        } else {
            TaskShape::Barrier
        };
        let (fragment, splits) = if shape == TaskShape::Source && all_row_local {
            let split_bytes = if groups_span_splits(&fragment, self.layout) {
                self.config
                    .aggregate_split_bytes
                    .0
                    .max(self.config.split_bytes.0)
            } else {
                self.config.split_bytes.0
            };
            split_sources(
                fragment,
                split_bytes,
                self.batching.split_limit(),
                self.layout,
                (self.batching.first_block_rows, self.batching.ramped_splits),
            )?
        } else {
            let n = fragment.output_partitioning().partition_count();
            (fragment, vec![1; n])
        };
        let mut streamed_producers = vec![];
        if shape == TaskShape::Barrier && !self.out_of_core {
            // A join streams its probe input: in threads mode its task reads the blocks as
            // they come; with worker processes a worker's task is fed them by the driver
            // as they are announced (`fed_on_workers`), and one the driver runs reads them.
            // (With `flumen.feed_joins_on_workers = false` a join a worker can run is a
            // barrier, as in Spark or Ballista: its task starts once both sides are complete.)
            // (`fed_where_read_as_made` keeps a worker's join streaming only where its
            // own output is read as it comes.)
            if self.config.workers != WorkerMode::Process
                || self.config.feed_joins_on_workers != FeedJoins::Off
                || !cuts_per_partition(&fragment)
            {
                collect_probe_producers(&fragment, false, &mut streamed_producers);
            }
            // A limit over one input (`LIMIT 10`, a filter with a fetch) streams it too:
            // it starts at once and ends when it has its rows, not after its whole input.
            if stage_inputs.len() == 1 && other_leaves == 0 && row_local_but_for_limits {
                streamed_producers.push(stage_inputs[0].0);
            }
            // So does a TopK in threads mode: it holds its rows whatever it reads, starts
            // at once, and its bound prunes the splits its input reads after it was made
            // (`plan::task_bounds`). With workers it reads its input complete, where a
            // worker runs it, rather than have every row fetched to the driver.
            if stage_inputs.len() == 1
                && other_leaves == 0
                && row_local_but_for_topk
                && self.config.workers != WorkerMode::Process
                && !streamed_producers.contains(&stage_inputs[0].0)
            {
                streamed_producers.push(stage_inputs[0].0);
            }
        }
        let gang = if self.out_of_core {
            partitions_wait_for_each_other(&fragment)
        } else {
            shape == TaskShape::Barrier || !all_row_local
        };
        let id = self.operators.len();
        let runs_again_unlike = if shares_build_matches_across_partitions(&fragment) {
            Some(RunsAgainUnlike::SharedBuildSide)
        } else if recursive_queries::holds_one(&fragment) {
            Some(RunsAgainUnlike::RecursiveQuery)
        } else {
            None
        };
        let mut named = &fragment;
        while let Some(values) = named.downcast_ref::<SubqueryValuesExec>() {
            named = values.input();
        }
        let name = named.name().to_string();
        self.operators.push(Operator {
            id,
            name,
            pool,
            shape,
            fragment,
            inputs: stage_inputs.iter().map(|(p, _, _)| *p).collect(),
            streamed_inputs: stage_inputs
                .iter()
                .map(|(p, _, _)| streamed_producers.contains(p))
                .collect(),
            input_exchanges: stage_inputs.into_iter().map(|(_, e, _)| e).collect(),
            output_split,
            splits,
            gang,
            stateful: !all_row_local,
            run_bytes: None,
            runs_again_unlike,
        });
        Ok(id)
    }
}

impl Cutter<'_> {
    /// `fragment`, wrapped in a [`SubqueryValuesExec`] for each `ScalarSubqueryExec` whose
    /// values it reads, over gathered stage inputs of that node's subqueries, cut here into
    /// operators of their own (once per fragment that reads them).
    fn with_subquery_values(
        &mut self,
        mut fragment: Arc<dyn ExecutionPlan>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        for i in 0..self.scalar_subqueries.len() {
            let results = self.scalar_subqueries[i].results.clone();
            if !fragment_reads_values_of(&fragment, &results) {
                continue;
            }
            let mut inputs = vec![];
            for link in self.scalar_subqueries[i].links.clone() {
                inputs.push(ScalarSubqueryLink {
                    plan: self.subquery_input(link.plan)?,
                    index: link.index,
                });
            }
            fragment = Arc::new(SubqueryValuesExec::new(fragment, inputs, results));
        }
        Ok(fragment)
    }

    /// A gathered stage input of the operators `plan` is cut into. It states no more than
    /// its schema (a one-row aggregate's columns are constants, which a worker's in-memory
    /// scan of the block would not state).
    fn subquery_input(&mut self, plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
        // Each reader's copy runs apart, so it must not prune by another copy's bounds.
        let plan = with_own_dynamic_filters(plan)?;
        let plan: Arc<dyn ExecutionPlan> = if plan.output_partitioning().partition_count() > 1 {
            Arc::new(CoalescePartitionsExec::new(plan))
        } else {
            plan
        };
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(plan.schema()),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        let cut = self.rewrite(plan)?;
        let producer = match cut.downcast_ref::<StageInputExec>() {
            Some(si) if matches!(si.exchange(), InputExchange::Gather) && si.fetch().is_none() => {
                si.producer()
            }
            _ => self.add_operator(cut, Pool::Cpu, None)?,
        };
        Ok(Arc::new(StageInputExec::new(
            producer,
            InputExchange::Gather,
            properties,
            None,
        )))
    }
}

/// Whether a node of `fragment` (not of the operators feeding it) reads a scalar subquery
/// value from `results`.
fn fragment_reads_values_of(
    fragment: &Arc<dyn ExecutionPlan>,
    results: &ScalarSubqueryResults,
) -> bool {
    let mut reads = false;
    let _ = fragment.apply(|node| {
        if node.downcast_ref::<StageInputExec>().is_some() {
            return Ok(TreeNodeRecursion::Jump);
        }
        reads |= reads_values_of(node, results);
        Ok(if reads {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    reads
}

/// True when executing one partition of `fragment` waits for its other partitions: a
/// repartition kept inside it (its outputs are fed together), or a hash join sharing a
/// dynamic filter (each partition waits for every build side).
fn partitions_wait_for_each_other(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    let mut waits = false;
    let _ = fragment.apply(|node| {
        waits |= node.downcast_ref::<RepartitionExec>().is_some()
            || node
                .downcast_ref::<HashJoinExec>()
                .is_some_and(|join| !join.dynamic_expressions_produced().is_empty());
        Ok(if waits {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    waits
}

/// Producers of the stage inputs on the probe side of a join: the right input of a hash
/// join (partitioned or collect-left), nested loop join or cross join, which DataFusion
/// reads only once the left (build) side has been collected. The build side of a join
/// inside a probe side is collected too, not streamed: a task streaming it would hold its
/// slot waiting for a producer that may need that slot (with 2 slots, a three-way join
/// over 100-row blocks hung for good).
fn collect_probe_producers(
    plan: &Arc<dyn ExecutionPlan>,
    under_probe: bool,
    out: &mut Vec<OperatorId>,
) {
    if let Some(si) = plan.downcast_ref::<StageInputExec>() {
        if under_probe {
            out.push(si.producer());
        }
        return;
    }
    let builds_left = plan.downcast_ref::<HashJoinExec>().is_some_and(|j| {
        matches!(
            j.partition_mode(),
            PartitionMode::Partitioned | PartitionMode::CollectLeft
        )
    }) || plan.downcast_ref::<NestedLoopJoinExec>().is_some()
        || plan.downcast_ref::<CrossJoinExec>().is_some();
    for (i, child) in plan.children().into_iter().enumerate() {
        let probe = match (builds_left, i) {
            (true, 0) => false,
            (true, _) => true,
            (false, _) => under_probe,
        };
        collect_probe_producers(child, probe, out);
    }
}

/// Which stage inputs of `op` its tasks are fed on a worker (see
/// [`OperatorGraph::fed_inputs`]): a CPU per-partition operator a worker can run whose
/// streamed input is a join's probe side, split or gathered (a merge's sorted partitions
/// are read whole, each apart, once complete).
fn fed_on_workers(op: &Operator) -> Vec<bool> {
    let mut fed = vec![false; op.inputs.len()];
    if op.shape != TaskShape::Barrier
        || op.pool != Pool::Cpu
        || !op.streamed_inputs.iter().any(|s| *s)
        || !cuts_per_partition(&op.fragment)
    {
        return fed;
    }
    let mut probes = vec![];
    collect_probe_producers(&op.fragment, false, &mut probes);
    for (input, producer) in op.inputs.iter().enumerate() {
        fed[input] = op.streamed_inputs[input]
            && probes.contains(producer)
            && matches!(
                op.input_exchanges[input],
                InputExchange::Split(_) | InputExchange::Gather
            );
    }
    fed
}

/// With worker processes, which stage inputs of each operator are fed to its tasks on
/// workers ([`OperatorGraph::fed_inputs`]): the probe inputs of a join a worker runs whose
/// own output is read as it is made (a streamed input of its consumer: a `LIMIT` above it,
/// a join on the driver, or a join fed in turn), so that the rows flow up the line and a
/// limit ends the query early. Every other join a worker runs is a barrier again (its probe
/// inputs not streamed): fed with nothing reading its output early, a join's task gains
/// nothing and shares the CPU with its probe side's scans, which on one host of 2 cores
/// cost a three-table join 20-30% (`docs/benchmarks.md`). The root keeps its streams (it
/// runs in the query's reader). Producers come before consumers, so each operator is
/// decided after its consumer. `all` (`flumen.feed_joins_on_workers = 'all'`): every join
/// a worker runs is fed.
fn fed_where_read_as_made(
    operators: &mut [Operator],
    consumer: &[Option<OperatorId>],
    all: bool,
) -> Vec<Vec<bool>> {
    let mut fed: Vec<Vec<bool>> = (operators.iter())
        .map(|op| vec![false; op.inputs.len()])
        .collect();
    let root = operators.len().saturating_sub(1);
    for id in (0..root).rev() {
        let read_as_made = consumer[id].is_some_and(|c| {
            let reader = &operators[c];
            (reader.inputs.iter().zip(&reader.streamed_inputs)).any(|(p, s)| *p == id && *s)
        });
        let op = &mut operators[id];
        if op.shape != TaskShape::Barrier || !cuts_per_partition(&op.fragment) {
            continue;
        }
        let candidates = fed_on_workers(op);
        let mut probes = vec![];
        collect_probe_producers(&op.fragment, false, &mut probes);
        for (input, producer) in op.inputs.iter().enumerate() {
            if (read_as_made || all) && candidates[input] {
                fed[id][input] = true;
            } else if probes.contains(producer) {
                op.streamed_inputs[input] = false;
            }
        }
    }
    fed
}

/// For each operator, the producers of the streamed inputs it feeds (see
/// Whether `root` (a query's root operator) keeps only its first rows (a limit, or a merge
/// with a fetch, with no node between that emits only at its end) of producers that emit
/// their rows as they make them (an aggregate over input sorted by its keys, a scan): the
/// reader on the driver ends the query once it has them, where a worker's task waits for
/// every input block first (`SELECT id, count(*) ... GROUP BY id ORDER BY id LIMIT 5` over
/// 4M sorted ids with workers: 2.1-2.4 s on a worker, 0.03 s in the reader). A top-k over
/// each partition's top rows (TPC-H q3: its producers emit only at their end) still goes to
/// the workers.
fn limit_stops_early(root: &Operator, operators: &[Operator]) -> bool {
    fn limited(node: &Arc<dyn ExecutionPlan>) -> bool {
        if node.downcast_ref::<StageInputExec>().is_some()
            || node.pipeline_behavior() == EmissionType::Final
        {
            return false;
        }
        node.fetch().is_some() || node.children().into_iter().any(limited)
    }
    let streaming = |producer: &OperatorId| {
        operators[*producer].fragment.pipeline_behavior() != EmissionType::Final
    };
    limited(&root.fragment) && root.inputs.iter().all(streaming)
}

/// [`OperatorGraph::gates`]): every operator upstream of a streamed input waits for it,
/// but for an input fed to workers (`fed`): its producers run beside the join's build side,
/// as a barrier join's did, and the join's task is fed what they made so far when it starts.
fn gates(operators: &[Operator], fed: &[Vec<bool>]) -> Vec<Vec<OperatorId>> {
    let mut gates = vec![vec![]; operators.len()];
    for op in operators {
        for (input, (producer, streamed)) in op.inputs.iter().zip(&op.streamed_inputs).enumerate() {
            if !streamed || fed.get(op.id).is_some_and(|fed| fed[input]) {
                continue;
            }
            let mut stack = vec![*producer];
            while let Some(upstream) = stack.pop() {
                gates[upstream].push(*producer);
                stack.extend(operators[upstream].inputs.iter().copied());
            }
        }
    }
    gates
}

/// Give every `StageInputExec` of a fragment its input index: the rank of its producer.
fn number_stage_inputs(fragment: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    let mut producers = vec![];
    collect_producers(&fragment, &mut producers);
    producers.sort();
    renumber(fragment, &producers)
}

fn collect_producers(plan: &Arc<dyn ExecutionPlan>, out: &mut Vec<OperatorId>) {
    if let Some(si) = plan.downcast_ref::<StageInputExec>() {
        out.push(si.producer());
        return;
    }
    for child in plan.children() {
        collect_producers(child, out);
    }
}

fn renumber(
    plan: Arc<dyn ExecutionPlan>,
    producers: &[OperatorId],
) -> Result<Arc<dyn ExecutionPlan>> {
    if let Some(si) = plan.downcast_ref::<StageInputExec>() {
        let index = producers
            .iter()
            .position(|p| *p == si.producer())
            .expect("producer was collected");
        return Ok(Arc::new(si.with_input_index(index)));
    }
    let children = plan.children();
    if children.is_empty() {
        return Ok(plan);
    }
    let children = children
        .into_iter()
        .map(|c| renumber(Arc::clone(c), producers))
        .collect::<Result<Vec<_>>>()?;
    replace_children_if_necessary(plan, children)
}

/// Nodes that process each batch independently of the others, so a task may run them over
/// one block (or one source split) and the union of the outputs is the same answer.
fn is_row_local(node: &Arc<dyn ExecutionPlan>) -> bool {
    if node.downcast_ref::<ProjectionExec>().is_some()
        || node.downcast_ref::<AcceleratorProjectionExec>().is_some()
        || node.downcast_ref::<CooperativeExec>().is_some()
        || node.downcast_ref::<UnnestExec>().is_some()
        // Keys by position in the block and the row's values: a block's rows get the
        // same keys in every run of its task.
        || node.downcast_ref::<SampleKeysExec>().is_some()
    {
        return true;
    }
    if node.downcast_ref::<FilterExec>().is_some() {
        return node.fetch().is_none();
    }
    if let Some(agg) = node.downcast_ref::<AggregateExec>() {
        // An empty grouping set (`ROLLUP`, `CUBE`, `GROUPING SETS (..., ())`) makes a
        // partial aggregate emit its grand-total row even over no rows: it must run once per
        // partition, not once per block that reaches it (no block, no task, no row).
        let emits_on_empty_input = (agg.group_expr().groups().iter())
            .any(|nulls| !nulls.is_empty() && nulls.iter().all(|is_null| *is_null));
        return *agg.mode() == AggregateMode::Partial
            && agg.limit_options().is_none()
            && !emits_on_empty_input;
    }
    if let Some(source) = node.downcast_ref::<DataSourceExec>() {
        return source.fetch().is_none();
    }
    // Delta Lake's scan maps each batch by the file it came from; it needs one stream per file
    // only for deletion vectors or row indexes, and then asks for a single input partition.
    if node.name() == "DeltaScanExec" {
        return node.fetch().is_none()
            && node
                .input_distribution_requirements()
                .into_per_child()
                .iter()
                .all(|d| matches!(d, Distribution::UnspecifiedDistribution));
    }
    node.downcast_ref::<SplitSourceExec>().is_some()
}

/// Nodes that keep the first rows of their input and would be row-local but for that: a
/// limit, or a row-local node with a fetch.
/// The properties a stage input over `input` declares (`properties`: those of the node it
/// replaces), without what DataFusion wrongly carries through an aggregate of grouping sets
/// (`ROLLUP`, `CUBE`, `GROUPING SETS`): its input's constants stay constants of the group
/// columns, though the rolled-up rows hold NULL there. Under `WHERE g = 'red' ... GROUP BY
/// ROLLUP (g, ...)` the final aggregate took its input as sorted by `g` and, its blocks
/// coming from several tasks, ended the grand total's group at each change of `g`: two
/// grand-total rows, 145 and 207, for one of 352.
fn exchange_properties(
    input: &Arc<dyn ExecutionPlan>,
    properties: &Arc<PlanProperties>,
) -> Arc<PlanProperties> {
    let grouping_sets = input
        .exists(|node| {
            Ok(node
                .downcast_ref::<AggregateExec>()
                .is_some_and(|aggregate| aggregate.group_expr().has_grouping_set()))
        })
        .unwrap_or(true);
    if !grouping_sets {
        return Arc::clone(properties);
    }
    let mut properties = properties.as_ref().clone();
    properties.eq_properties =
        EquivalenceProperties::new(properties.eq_properties.schema().clone());
    Arc::new(properties)
}

fn is_limit(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<GlobalLimitExec>().is_some()
        || node.downcast_ref::<LocalLimitExec>().is_some()
        || node.downcast_ref::<FilterExec>().is_some()
}

/// Whether `node` is a TopK: a sort that holds its `fetch` rows, whatever it reads.
fn is_topk(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<SortExec>()
        .is_some_and(|sort| sort.fetch().is_some())
}

/// Whether `plan` holds a partial aggregate with GROUP BY whose groups may recur in every
/// split of its scan. Such an aggregate's output grows with the groups each task sees, not
/// with the rows it reads, so its scan reads larger splits. It does not apply where the scan
/// is clustered by one of the group columns (its row groups hold disjoint ranges of it, as
/// `l_orderkey` in TPC-H's lineitem): there each group lies in one split anyway.
fn groups_span_splits(plan: &Arc<dyn ExecutionPlan>, layout: &RowGroupLayout) -> bool {
    let Some(columns) = partial_aggregate_group_columns(plan) else {
        return false;
    };
    let mut scans = vec![];
    collect_parquet_scans(plan, &mut scans);
    let [scan] = scans.as_slice() else {
        return true;
    };
    !columns.iter().any(|c| layout.clustered_by(scan, c))
}

/// The plain-column group keys of the first partial aggregate with GROUP BY in `plan`
/// (empty where none of its keys is a plain column), or `None` where it has none. Matched
/// to the scan's columns by name: a projection between them that renames columns can
/// mislead it, which costs only the choice of split size.
fn partial_aggregate_group_columns(plan: &Arc<dyn ExecutionPlan>) -> Option<Vec<String>> {
    if let Some(columns) = plan
        .downcast_ref::<AggregateExec>()
        .and_then(partial_group_columns)
    {
        return Some(columns);
    }
    plan.children()
        .into_iter()
        .find_map(partial_aggregate_group_columns)
}

/// The plain-column group keys of `agg` where it is a partial aggregate with GROUP BY
/// (empty where none of its keys is a plain column); `None` otherwise.
pub(crate) fn partial_group_columns(agg: &AggregateExec) -> Option<Vec<String>> {
    if *agg.mode() != AggregateMode::Partial || agg.group_expr().expr().is_empty() {
        return None;
    }
    let columns = agg
        .group_expr()
        .expr()
        .iter()
        .filter_map(|(expr, _)| expr.downcast_ref::<Column>().map(|c| c.name().to_string()))
        .collect();
    Some(columns)
}

/// The file scan configurations of the Parquet scans in `plan`.
pub(crate) fn collect_parquet_scans<'a>(
    plan: &'a Arc<dyn ExecutionPlan>,
    out: &mut Vec<&'a FileScanConfig>,
) {
    if let Some(source) = plan.downcast_ref::<DataSourceExec>()
        && let Some(config) = source.data_source().downcast_ref::<FileScanConfig>()
        && config.file_source().file_type() == "parquet"
    {
        out.push(config);
    }
    for child in plan.children() {
        collect_parquet_scans(child, out);
    }
}

/// Replace a Parquet scan by a [`SplitSourceExec`] whose tasks read `split_bytes`-sized
/// byte ranges (row groups whose midpoint falls in the range). A scan with a declared
/// ordering keeps it: a partition's splits are consecutive ranges in file order, and its
/// readers take a partition's blocks task after task.
/// Only a fragment with exactly one scan is split.
fn split_sources(
    fragment: Arc<dyn ExecutionPlan>,
    split_bytes: u64,
    limit: ModelSplitLimit,
    layout: &RowGroupLayout,
    ramp: (usize, usize),
) -> Result<(Arc<dyn ExecutionPlan>, Vec<usize>)> {
    let partitions = fragment.output_partitioning().partition_count();
    let mut splits = vec![1; partitions];
    if count_scans(&fragment) != 1 {
        return Ok((fragment, splits));
    }
    let scan = ScanSplitting {
        split_bytes,
        limit,
        layout,
        ramp,
    };
    let rewritten = replace_scan(fragment, &scan, false, &mut splits)?;
    Ok((rewritten, splits))
}

fn count_scans(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let own = usize::from(plan.downcast_ref::<DataSourceExec>().is_some());
    own + plan.children().into_iter().map(count_scans).sum::<usize>()
}

/// How [`replace_scan`] cuts a scan into splits.
struct ScanSplitting<'a> {
    split_bytes: u64,
    limit: ModelSplitLimit,
    layout: &'a RowGroupLayout,
    /// Batch rows of the first splits, and how many first splits of a partition.
    ramp: (usize, usize),
}

/// `plan` with its Parquet scan replaced by a [`SplitSourceExec`]; `below_grouping`: a
/// grouped aggregate of the fragment is above `plan` (the split source then drops the rows
/// its joins' finished filters reject, [`crate::plan::join_filter_rows`]).
fn replace_scan(
    plan: Arc<dyn ExecutionPlan>,
    scan: &ScanSplitting,
    below_grouping: bool,
    splits: &mut Vec<usize>,
) -> Result<Arc<dyn ExecutionPlan>> {
    if let Some(source) = plan.downcast_ref::<DataSourceExec>() {
        if let Some(config) = source.data_source().downcast_ref::<FileScanConfig>()
            && config.file_source().file_type() == "parquet"
            && config.file_groups.len() == splits.len()
        {
            let split = SplitSourceExec::try_new(
                Arc::clone(&plan),
                config,
                scan.split_bytes,
                scan.limit,
                scan.layout,
                scan.ramp.0,
                scan.ramp.1,
            )?
            .dropping_join_filtered_rows(below_grouping);
            *splits = split.splits_per_partition();
            return Ok(Arc::new(split));
        }
        return Ok(plan);
    }
    let children = plan.children();
    if children.is_empty() {
        return Ok(plan);
    }
    let below_grouping = below_grouping
        || plan
            .downcast_ref::<AggregateExec>()
            .is_some_and(|aggregate| !aggregate.group_expr().expr().is_empty());
    let children = children
        .into_iter()
        .map(|c| replace_scan(Arc::clone(c), scan, below_grouping, splits))
        .collect::<Result<Vec<_>>>()?;
    replace_children_if_necessary(plan, children)
}
