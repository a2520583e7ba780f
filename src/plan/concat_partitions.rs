//! `ConcatPartitionsExec`: its input's partitions one after the other, as one partition.
//!
//! The output node of a random shuffle (partitions in order, each already permuted) and of a
//! range-partitioned sort (ranges in key order, each sorted, so the concatenation is sorted).
//! The cut keeps it in the consumer operator, reading each producer partition in turn, like a
//! `SortPreservingMergeExec` but with only one partition read at a time.

use std::fmt;
use std::sync::Arc;

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{LexOrdering, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties,
};
use futures::{StreamExt, TryStreamExt};

use crate::plan::only_child;

/// Its input's partitions, one after the other, as one partition (partition 0's rows, then
/// partition 1's...); ordered by `ordering` when each partition is sorted by it and the
/// partitions are consecutive ranges of it.
#[derive(Debug)]
pub struct ConcatPartitionsExec {
    input: Arc<dyn ExecutionPlan>,
    ordering: Option<LexOrdering>,
    properties: Arc<PlanProperties>,
}

impl ConcatPartitionsExec {
    /// Concatenate `input`'s partitions in order (no output ordering).
    pub fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        Self::with_ordering(input, None)
    }

    /// Concatenate `input`'s partitions, each sorted by `ordering` and holding consecutive
    /// ranges of it: the output is sorted by `ordering`.
    pub fn ordered(input: Arc<dyn ExecutionPlan>, ordering: LexOrdering) -> Self {
        Self::with_ordering(input, Some(ordering))
    }

    fn with_ordering(input: Arc<dyn ExecutionPlan>, ordering: Option<LexOrdering>) -> Self {
        // What holds of every input row holds of the output (a filter's `k = 1`, equal
        // columns): a window above that partitions by `k` relies on it. Orderings and
        // per-partition constants do not carry over, but for the ordering of the ranges.
        let mut eq_properties = input.equivalence_properties().clone();
        eq_properties.clear_orderings();
        eq_properties.clear_per_partition_constants();
        if let Some(ordering) = &ordering {
            eq_properties.add_ordering(ordering.iter().cloned());
        }
        let properties = PlanProperties::new(
            eq_properties,
            Partitioning::UnknownPartitioning(1),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Self {
            input,
            ordering,
            properties: Arc::new(properties),
        }
    }

    /// The node whose partitions are concatenated.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for ConcatPartitionsExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "ConcatPartitionsExec: partitions={}",
            self.input.output_partitioning().partition_count()
        )?;
        if let Some(ordering) = &self.ordering {
            write!(f, ", ordered by [{ordering}]")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for ConcatPartitionsExec {
    fn name(&self) -> &str {
        "ConcatPartitionsExec"
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
        vec![self.ordering.is_some()]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = only_child(children, "ConcatPartitionsExec")?;
        Ok(Arc::new(Self::with_ordering(input, self.ordering.clone())))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        if partition != 0 {
            return Err(DataFusionError::Internal(format!(
                "ConcatPartitionsExec has one partition, asked for {partition}"
            )));
        }
        let input = Arc::clone(&self.input);
        let count = input.output_partitioning().partition_count();
        let streams = futures::stream::iter(0..count)
            .map(move |p| input.execute(p, Arc::clone(&context)))
            .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            streams,
        )))
    }
}
