//! `MergeRunsExec`: each partition of its input is several sorted runs; it merges them.
//!
//! The reduce side of an out-of-core range sort whose map outputs were sorted into runs in
//! the background ([`crate::plan::range_sort`], Exoshuffle's push-based merge): the cut makes
//! the `SortExec` below it a per-block operator whose every task sorts one bundle of a
//! range's blocks as they arrive (one sorted run), and keeps this node in the consumer, where
//! its stage input hands it one stream per run ([`StageInputExec::execute_runs`]). A range
//! then never has to be sorted whole in one task: the reduce holds one block of each run.
//! When a block of each run would not fit the task's share of the budget at once (a hot
//! range cut into many runs), the runs are merged in levels first
//! ([`crate::plan::merge_levels`]; `merge_levels` and `runs_written` in `EXPLAIN ANALYZE`).
//! Outside a flumen task each input partition is one run, passed through.

use std::fmt;
use std::sync::Arc;

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::memory_pool::MemoryConsumer;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, LexOrdering, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricBuilder, MetricsSet};
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};

use crate::plan::merge_levels::LevelMerge;
use crate::plan::only_child;
use crate::plan::stage_input::{PartitionRuns, SortedRun, StageInputExec};

/// Each partition of `input` merged from its sorted runs by `ordering`: the output's
/// partition `p` holds partition `p`'s rows, sorted.
#[derive(Debug)]
pub struct MergeRunsExec {
    input: Arc<dyn ExecutionPlan>,
    ordering: LexOrdering,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl MergeRunsExec {
    /// Merge the sorted runs of each partition of `input` (each run sorted by `ordering`).
    pub fn new(input: Arc<dyn ExecutionPlan>, ordering: LexOrdering) -> Self {
        let properties = PlanProperties::new(
            EquivalenceProperties::new_with_orderings(input.schema(), [ordering.clone()]),
            input.output_partitioning().clone(),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Self {
            input,
            ordering,
            properties: Arc::new(properties),
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// The node whose partitions' runs are merged.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// The order each run is sorted in, and the output's.
    pub fn ordering(&self) -> &LexOrdering {
        &self.ordering
    }
}

impl DisplayAs for MergeRunsExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "MergeRunsExec: sorted runs of each partition merged by [{}]",
            self.ordering
        )
    }
}

impl ExecutionPlan for MergeRunsExec {
    fn name(&self) -> &str {
        "MergeRunsExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        for key in self.ordering.iter() {
            if f(&key.expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = only_child(children, "MergeRunsExec")?;
        Ok(Arc::new(Self::new(input, self.ordering.clone())))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let runs = match self.input.downcast_ref::<StageInputExec>() {
            Some(stage_input) => stage_input.execute_runs(partition, Arc::clone(&context))?,
            // Not a flumen task's input: each partition of the input is one sorted run.
            None => Some(PartitionRuns {
                runs: vec![SortedRun {
                    stream: self.input.execute(partition, Arc::clone(&context))?,
                    largest_block_bytes: 0,
                }],
                merge_bytes: u64::MAX,
            }),
        };
        let Some(runs) = runs else {
            // The runs do not come apart (not a whole partition of a finished producer, or
            // a limit): sort them together, spilling as any sort does.
            MetricBuilder::new(&self.metrics)
                .counter("partitions_sorted_whole", partition)
                .add(1);
            let sort = SortExec::new(self.ordering.clone(), Arc::clone(&self.input))
                .with_preserve_partitioning(true);
            return sort.execute(partition, context);
        };
        MetricBuilder::new(&self.metrics)
            .counter("runs_merged", partition)
            .add(runs.runs.len());
        let reservation = MemoryConsumer::new(format!("MergeRunsExec[{partition}]"))
            .register(context.memory_pool());
        let merge = LevelMerge::new(
            self.schema(),
            self.ordering.clone(),
            runs.merge_bytes,
            &context,
            &self.metrics,
            partition,
            reservation,
        );
        Ok(merge.merge(runs.runs))
    }
}
