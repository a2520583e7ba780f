//! `StageInputExec`: the leaf of an operator's fragment that reads another operator's blocks.
//!
//! A task's inputs reach it through the `TaskContext`: the scheduler puts a [`TaskInputs`]
//! in the task's session config, and `StageInputExec::execute` asks it for the stream of
//! the blocks this task was given (one block, a bundle, or a whole partition).

use std::fmt;
use std::sync::{Arc, OnceLock};

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::coop::make_cooperative;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PhysicalExpr, PlanProperties,
};
use futures::StreamExt;

use crate::plan::OperatorId;
use crate::plan::build_bounds::DroppingBy;
use crate::store::cutter::batch_slices;

/// How a consumer reads its producer's blocks.
#[derive(Debug, Clone)]
pub enum InputExchange {
    /// Partition `p` reads the producer's partition `p`, in order.
    Preserve,
    /// One partition reading every partition of the producer (`CoalescePartitionsExec`).
    Gather,
    /// The producer split its output by this partitioning (hash, round robin, range);
    /// partition `q` reads the blocks tagged `q`.
    Split(Partitioning),
}

impl fmt::Display for InputExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InputExchange::Preserve => f.write_str("preserve"),
            InputExchange::Gather => f.write_str("gather"),
            // Split points can be many and long: their number says enough here.
            InputExchange::Split(Partitioning::Range(ranges)) => write!(
                f,
                "Range([{}], {} ranges from sampled split points)",
                ranges.ordering(),
                ranges.partition_count()
            ),
            InputExchange::Split(p) => write!(f, "{p}"),
        }
    }
}

/// Supplies the block streams of one task's stage inputs.
pub trait InputProvider: Send + Sync + fmt::Debug {
    /// The blocks of stage input `input` for partition `partition` of the fragment.
    fn open(&self, input: usize, partition: usize) -> Result<SendableRecordBatchStream>;

    /// The same blocks as one stream per producer task (each a sorted run, for
    /// [`crate::plan::merge_runs::MergeRunsExec`]), when the producer has finished; `None`
    /// otherwise (read them with [`InputProvider::open`]).
    fn open_runs(&self, _input: usize, _partition: usize) -> Result<Option<PartitionRuns>> {
        Ok(None)
    }
}

/// One sorted run of a partition: a producer task's output blocks, in order.
pub struct SortedRun {
    /// The run's blocks, read in order.
    pub stream: SendableRecordBatchStream,
    /// Bytes of its largest block: what a merge holds of it at most.
    pub largest_block_bytes: u64,
}

/// A partition's sorted runs, and the memory a merge of them may hold at once.
pub struct PartitionRuns {
    /// The runs, in the order their tasks were made.
    pub runs: Vec<SortedRun>,
    /// The share of the budget one partition's task was planned for
    /// ([`crate::plan::exchange_sizing::ExchangeSizing::partition_bytes`]): when a block of
    /// every run would not fit it, the runs are merged in levels.
    pub merge_bytes: u64,
}

impl fmt::Debug for PartitionRuns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartitionRuns")
            .field("runs", &self.runs.len())
            .field("merge_bytes", &self.merge_bytes)
            .finish()
    }
}

/// What the scheduler hands one task, through its `TaskContext`'s session config.
#[derive(Debug)]
pub struct TaskInputs {
    /// Streams of the stage inputs.
    pub provider: Arc<dyn InputProvider>,
    /// Which split of its partition a source task reads.
    pub split: usize,
    /// Whether the task's scan drops the rows its joins' complete dynamic filters reject
    /// ([`crate::plan::join_filter_rows`]): set when it first opens it, kept with the
    /// task so a recompute reads its split the same way and cuts the same blocks.
    pub scan_row_filter: Arc<OnceLock<bool>>,
    /// The join filters whose bound from a build side (settled before a reader's task
    /// launches, the same for every run of it) the task's scan splits drop rows by
    /// ([`crate::plan::build_bounds`]).
    pub dropping_by: DroppingBy,
    /// Most rows per batch the fragment is handed from its stage inputs: the session's
    /// `datafusion.execution.batch_size` for a CPU task (a larger block is handed in
    /// slices, [`in_batches_of`]); `0` hands the pieces as they were cut (a model's task,
    /// whose pieces are `flumen.model_piece_rows`).
    pub batch_rows: usize,
}

/// `stream` with each batch of more than `rows` rows handed in slices of at most `rows`
/// ([`batch_slices`], no copy); `0`: as it is.
pub fn in_batches_of(stream: SendableRecordBatchStream, rows: usize) -> SendableRecordBatchStream {
    if rows == 0 {
        return stream;
    }
    let schema = stream.schema();
    let sliced = stream.flat_map(move |batch| {
        futures::stream::iter(match batch {
            Ok(batch) => batch_slices(batch, rows).into_iter().map(Ok).collect(),
            Err(e) => vec![Err(e)],
        })
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, sliced))
}

/// Leaf that reads the blocks of a producer operator.
#[derive(Debug, Clone)]
pub struct StageInputExec {
    producer: OperatorId,
    input: usize,
    exchange: InputExchange,
    properties: Arc<PlanProperties>,
    fetch: Option<usize>,
    /// The producer's `EXPLAIN` node, shown below this one (never executed from here): set
    /// once by the executing node, which owns the counters it shows; shared by clones.
    producer_display: Arc<OnceLock<Arc<dyn ExecutionPlan>>>,
    /// Shown until then.
    placeholder: Arc<dyn ExecutionPlan>,
}

impl StageInputExec {
    /// A stage input with the given plan properties (those of the node it replaces).
    pub fn new(
        producer: OperatorId,
        exchange: InputExchange,
        properties: Arc<PlanProperties>,
        fetch: Option<usize>,
    ) -> Self {
        let placeholder = Arc::new(EmptyExec::new(Arc::clone(
            properties.eq_properties.schema(),
        )));
        Self {
            producer,
            input: 0,
            exchange,
            properties,
            fetch,
            producer_display: Arc::default(),
            placeholder,
        }
    }

    /// Show `display` (the producer operator's `EXPLAIN` node) below this node, unless
    /// one is shown already.
    pub fn show_producer(&self, display: Arc<dyn ExecutionPlan>) {
        let _ = self.producer_display.set(display);
    }

    /// The same node reading stage input number `input` of its task.
    pub fn with_input_index(&self, input: usize) -> Self {
        Self {
            input,
            ..self.clone()
        }
    }

    /// Which of its task's stage inputs this reads.
    pub fn input_index(&self) -> usize {
        self.input
    }

    /// The operator whose blocks this reads.
    pub fn producer(&self) -> OperatorId {
        self.producer
    }

    /// How the blocks are read.
    pub fn exchange(&self) -> &InputExchange {
        &self.exchange
    }

    /// Row limit over everything read (from a `CoalescePartitionsExec` with a fetch).
    pub fn fetch(&self) -> Option<usize> {
        self.fetch
    }
}

impl DisplayAs for StageInputExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        match t {
            DisplayFormatType::TreeRender => write!(f, "operator={}", self.producer),
            _ => {
                write!(
                    f,
                    "StageInputExec: operator={}, exchange={}",
                    self.producer, self.exchange
                )?;
                if let Some(fetch) = self.fetch {
                    write!(f, ", fetch={fetch}")?;
                }
                Ok(())
            }
        }
    }
}

impl ExecutionPlan for StageInputExec {
    fn name(&self) -> &str {
        "StageInputExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![self.producer_display.get().unwrap_or(&self.placeholder)]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let mut node = self.as_ref().clone();
        if let Some(child) = children.into_iter().next() {
            node.producer_display = Arc::new(OnceLock::from(child));
        }
        Ok(Arc::new(node))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(
                datafusion::physical_plan::execution_plan::ChildrenPropertiesMode::Recompute,
            ),
        )
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let inputs = task_inputs(&context, self.producer)?;
        let stream = in_batches_of(
            inputs.provider.open(self.input, partition)?,
            inputs.batch_rows,
        );
        // Blocks in memory are always ready: without tokio's budget a consumer that loops
        // over its input inside one poll (an aggregate) would hold its thread to the end,
        // deaf to cancellation.
        let stream = make_cooperative(stream);
        match self.fetch {
            None => Ok(stream),
            Some(limit) => Ok(limit_stream(stream, limit)),
        }
    }
}

impl StageInputExec {
    /// Partition `partition`'s blocks as one stream per producer task (its sorted runs,
    /// when the producer's tasks each sort a bundle), for a merge above; `None` when they
    /// must be read as one stream ([`InputProvider::open_runs`]).
    pub fn execute_runs(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<Option<PartitionRuns>> {
        if self.fetch.is_some() {
            return Ok(None);
        }
        let inputs = task_inputs(&context, self.producer)?;
        let runs = inputs.provider.open_runs(self.input, partition)?;
        Ok(runs.map(|runs| PartitionRuns {
            runs: (runs.runs.into_iter())
                .map(|run| SortedRun {
                    stream: make_cooperative(in_batches_of(run.stream, inputs.batch_rows)),
                    largest_block_bytes: run.largest_block_bytes,
                })
                .collect(),
            merge_bytes: runs.merge_bytes,
        }))
    }
}

/// The stage inputs of the task executing `context`.
fn task_inputs(context: &TaskContext, producer: OperatorId) -> Result<Arc<TaskInputs>> {
    context
        .session_config()
        .get_extension::<TaskInputs>()
        .ok_or_else(|| {
            DataFusionError::Internal(format!(
                "StageInputExec for operator {producer} executed outside a flumen task"
            ))
        })
}

/// Stop a stream once `limit` rows have passed.
fn limit_stream(stream: SendableRecordBatchStream, limit: usize) -> SendableRecordBatchStream {
    let schema = stream.schema();
    let limited = stream
        .scan(limit, |left, batch| {
            let out = match batch {
                Err(e) => Some(Err(e)),
                Ok(_) if *left == 0 => None,
                Ok(b) => {
                    let take = b.num_rows().min(*left);
                    *left -= take;
                    Some(Ok(b.slice(0, take)))
                }
            };
            futures::future::ready(out)
        })
        .boxed();
    Box::pin(RecordBatchStreamAdapter::new(schema, limited))
}

/// Whether `fragment` scans a table: a leaf other than a stage input, whose task's context
/// then carries the session's functions (`QueryRun::task_context`). A stage input's child
/// only shows its producer in `EXPLAIN` (a placeholder until then): it is not looked into.
pub(crate) fn reads_a_table(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    let mut reads = false;
    let walked = fragment.apply(|node| {
        if node.downcast_ref::<StageInputExec>().is_some() {
            return Ok(TreeNodeRecursion::Jump);
        }
        reads = node.children().is_empty();
        Ok(match reads {
            true => TreeNodeRecursion::Stop,
            false => TreeNodeRecursion::Continue,
        })
    });
    reads || walked.is_err()
}

#[cfg(test)]
mod tests {
    use super::*;

    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_plan::placeholder_row::PlaceholderRowExec;
    use datafusion::physical_plan::union::UnionExec;

    #[test]
    fn only_a_fragment_with_a_leaf_other_than_a_stage_input_reads_a_table() {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let memory: Arc<dyn ExecutionPlan> =
            MemorySourceConfig::try_new_exec(&[vec![]], Arc::clone(&schema), None).unwrap();
        let stage_input = || -> Arc<dyn ExecutionPlan> {
            Arc::new(StageInputExec::new(
                0,
                InputExchange::Gather,
                Arc::clone(memory.properties()),
                None,
            ))
        };
        // Blocks of other operators only: no table, no functions to copy.
        assert!(!reads_a_table(&stage_input()));
        assert!(!reads_a_table(
            &UnionExec::try_new(vec![stage_input(), stage_input()]).unwrap()
        ));
        // A scan (here of memory: VALUES, information_schema), alone or beside a stage input.
        assert!(reads_a_table(&memory));
        assert!(reads_a_table(
            &UnionExec::try_new(vec![stage_input(), Arc::clone(&memory)]).unwrap()
        ));
        // A one-row placeholder (`SELECT now()`) is a leaf too.
        assert!(reads_a_table(
            &(Arc::new(PlaceholderRowExec::new(schema)) as _)
        ));
    }
}
