//! The operator graph: a physical plan cut into operators (see [`super::cut`] for how),
//! what each operator's tasks process, on which pool, and who feeds whom.

use std::fmt;
use std::sync::Arc;

use datafusion::logical_expr::ScalarUDF;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, Partitioning};
use serde::{Deserialize, Serialize};

use crate::config::WorkerMode;
use crate::functions::accelerator::accelerator_udfs_in;
use crate::plan::accelerator_projection::AcceleratorProjectionExec;
use crate::plan::exchange_sizing::ExchangeSizing;
use crate::plan::model_batching::ModelBatching;
use crate::plan::stage_input::{InputExchange, StageInputExec};
use crate::store::cutter::PieceCut;

pub use crate::plan::OperatorId;

/// The pool whose slots an operator's tasks occupy, in threads of this process or in
/// worker processes (a worker process serves one pool: `flumen worker --pool cpu|accelerator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Pool {
    /// General CPU work (scans, filters, joins, aggregates); a CPU worker process runs
    /// several tasks at once on its threads.
    #[default]
    Cpu,
    /// Workers that keep a model loaded (accelerator UDFs): one task at a time on one
    /// thread that loads each model once and keeps it (an actor, as in Ray Data's actor
    /// pools).
    Accelerator,
}

impl Pool {
    /// Its name (`flumen worker --pool` takes it).
    pub fn as_str(self) -> &'static str {
        match self {
            Pool::Cpu => "cpu",
            Pool::Accelerator => "accelerator",
        }
    }
}

impl std::str::FromStr for Pool {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Pool::Cpu),
            "accelerator" => Ok(Pool::Accelerator),
            other => Err(format!("a pool is 'cpu' or 'accelerator', not '{other}'")),
        }
    }
}

impl fmt::Display for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one task of an operator processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskShape {
    /// No block inputs: one task per source split of each partition.
    Source,
    /// One block input and row-local nodes only: one task per input block (or bundle).
    BlockWise,
    /// Stateful nodes (final aggregates, joins, sorts...): one task per output partition,
    /// started once every input operator has finished, or at once when the operator
    /// streams a join's probe input ([`Operator::streamed_inputs`]).
    Barrier,
}

impl fmt::Display for TaskShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TaskShape::Source => "source",
            TaskShape::BlockWise => "per-block",
            TaskShape::Barrier => "per-partition",
        })
    }
}

/// How an operator's tasks read their producers' blocks, which decides how those producers
/// are held back and which of their blocks stay in memory longest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputReading {
    /// No producer (a source).
    None,
    /// A task per block or bundle, started as blocks arrive: the producer's unread output
    /// is a queue, bounded by backpressure.
    AsTheyCome,
    /// A task per run of about [`Operator::run_bytes`] of one partition's blocks, started as
    /// a run fills (an out-of-core range sort's run sorts): read soon, but like an exchange
    /// it needs its producer's blocks of every partition at once.
    InRuns,
    /// A task per partition, over its whole input (an exchange's reduce side, a join, a
    /// final aggregate; or streamed, [`Operator::streamed_inputs`]).
    Whole,
}

impl InputReading {
    /// Its producers' blocks are read soon after they are made (by a task that starts as
    /// they arrive): when memory is full, the others' are written out first.
    pub fn reads_soon(self) -> bool {
        matches!(self, InputReading::AsTheyCome | InputReading::InRuns)
    }

    /// It needs its producer's blocks of every partition at once (a producer feeding it
    /// is never held back: its blocks spill instead).
    pub fn needs_every_partition(self) -> bool {
        matches!(self, InputReading::InRuns | InputReading::Whole)
    }
}

/// One flumen operator (stage).
#[derive(Debug)]
pub struct Operator {
    /// Its index in the graph; producers have smaller ids than their consumer.
    pub id: OperatorId,
    /// Short label: the fragment's root node.
    pub name: String,
    /// Pool its tasks run on.
    pub pool: Pool,
    /// What a task processes.
    pub shape: TaskShape,
    /// The DataFusion sub-plan a task executes, with `StageInputExec` leaves.
    pub fragment: Arc<dyn ExecutionPlan>,
    /// Producer operator of each `StageInputExec` leaf, by its `input` index.
    pub inputs: Vec<OperatorId>,
    /// How each input is read (same order as `inputs`).
    pub input_exchanges: Vec<InputExchange>,
    /// Inputs on the probe side of a join in the fragment (same order as `inputs`). The
    /// operator's tasks start with the query and read these blocks as they arrive, and the
    /// operators feeding such an input start only when a task first asks for its blocks,
    /// which a join does once its build side is in: as under DataFusion's own executor,
    /// the probe side's scans then run with the join's dynamic filter filled in.
    pub streamed_inputs: Vec<bool>,
    /// Split applied to this operator's output blocks (the map side of a hash/round-robin
    /// exchange); `None` tags each block with its task's partition.
    pub output_split: Option<Partitioning>,
    /// Number of source splits of each partition (Source operators; 1 when not split).
    pub splits: Vec<usize>,
    /// All partitions' tasks must run at once: the fragment holds stateful nodes, and
    /// DataFusion's joins coordinate across partitions (shared build side, dynamic filters).
    pub gang: bool,
    /// The fragment holds state across batches (sorts, final aggregates, joins, windows):
    /// its tasks hold operator memory while they run.
    pub stateful: bool,
    /// A run-sorting operator (the background merge of an out-of-core range sort's map
    /// outputs): per-block, each task sorts a bundle of about this many bytes of one
    /// partition's blocks as they arrive, one sorted run, which a
    /// [`crate::plan::merge_runs::MergeRunsExec`] above merges with the partition's others.
    pub run_bytes: Option<u64>,
    /// Why a task of it run alone again would not repeat its first run, if it would not.
    /// With workers its blocks are kept until the query ends, so a reader run again reads
    /// them; losing one fails the query by name.
    pub runs_again_unlike: Option<RunsAgainUnlike>,
}

/// Why an operator's task run alone again would not repeat its first run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunsAgainUnlike {
    /// Its partitions share a `CollectLeft` join's matches and emit the build side's rows
    /// from whichever finishes last
    /// ([`crate::plan::partition_cut::shares_build_matches_across_partitions`]).
    SharedBuildSide,
    /// It runs a recursive query, whose exchanges deliver rows in the order they come
    /// ([`crate::plan::recursive_queries`]); each run executes a fresh copy of it.
    RecursiveQuery,
}

impl fmt::Display for RunsAgainUnlike {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::SharedBuildSide => {
                "its partitions share a join's build side, whose rows the last of them to \
                 finish emits"
            }
            Self::RecursiveQuery => {
                "it runs a recursive query, whose rows come in the order its exchanges \
                 deliver them"
            }
        })
    }
}

impl Operator {
    /// How its tasks read their producers' blocks.
    pub fn input_reading(&self) -> InputReading {
        match (self.shape, self.run_bytes) {
            (TaskShape::Source, _) => InputReading::None,
            (TaskShape::BlockWise, None) => InputReading::AsTheyCome,
            (TaskShape::BlockWise, Some(_)) => InputReading::InRuns,
            (TaskShape::Barrier, _) => InputReading::Whole,
        }
    }

    /// Producers of the inputs this operator streams (see [`Operator::streamed_inputs`]).
    pub fn streamed_producers(&self) -> impl Iterator<Item = OperatorId> + '_ {
        self.inputs
            .iter()
            .zip(&self.streamed_inputs)
            .filter(|(_, streamed)| **streamed)
            .map(|(producer, _)| *producer)
    }

    /// Number of partitions the fragment produces.
    pub fn partitions(&self) -> usize {
        self.fragment.output_partitioning().partition_count()
    }

    /// The accelerator UDFs this operator's own projections call (not those of the
    /// operators feeding it), each once.
    pub fn accelerator_udfs(&self) -> Vec<ScalarUDF> {
        let mut found: Vec<ScalarUDF> = vec![];
        let mut stack = vec![Arc::clone(&self.fragment)];
        while let Some(node) = stack.pop() {
            let projection = node
                .downcast_ref::<AcceleratorProjectionExec>()
                .map(|p| p.projection())
                .or_else(|| node.downcast_ref::<ProjectionExec>());
            for expr in projection.iter().flat_map(|p| p.expr()) {
                for udf in accelerator_udfs_in(&expr.expr) {
                    if !found.contains(&udf) {
                        found.push(udf);
                    }
                }
            }
            if node.downcast_ref::<StageInputExec>().is_none() {
                stack.extend(node.children().into_iter().cloned());
            }
        }
        found
    }
}

/// A physical plan cut into operators. The last operator is the root.
#[derive(Debug)]
pub struct OperatorGraph {
    /// Operators, producers before consumers.
    pub operators: Vec<Operator>,
    /// The consumer of each operator (`None` for the root).
    pub consumer: Vec<Option<OperatorId>>,
    /// For each operator, the streamed inputs it feeds (directly or through other
    /// operators), by their producer: it may start only once each has been asked for.
    pub gates: Vec<Vec<OperatorId>>,
    /// The partitions chosen for the plan's hash exchanges (out of core when more than
    /// DataFusion's default).
    pub sizing: ExchangeSizing,
    /// How the plan feeds its models: the first-block ramp, pieces and bundles
    /// ([`ModelBatching`]).
    pub batching: ModelBatching,
    /// How many of a partition's blocks a CPU operator's per-block task takes
    /// ([`CpuBundles`]).
    pub cpu_bundles: CpuBundles,
    /// With worker processes: the root's tasks run on the workers like any other
    /// operator's, and the query's reader fetches only their output (the result), instead
    /// of the root running in the reader on the driver over all of its inputs. Set for a
    /// per-partition root a worker can run that does not stream its inputs (a final
    /// aggregate over gathered partials, a merge of sorted partitions with a limit; not a
    /// `LIMIT` that stops its input), of nodes the workers run (the planner checks that:
    /// `exec::planner`), that does more than merge its inputs: a root whose output is all
    /// of its input (a merge of sorted partitions without a limit,
    /// [`crate::plan::partition_cut::only_merges_inputs`]) runs in the reader, which fetches
    /// each input block once instead of a worker fetching them all and the reader its
    /// output.
    pub root_on_workers: bool,
    /// With worker processes: the joins whose probe-side scans wait for their build side
    /// to be complete, and start from the bound its keys make ([`crate::plan::build_bounds`]).
    pub build_bounds: Vec<crate::plan::build_bounds::BuildBound>,
    /// With worker processes: for each operator, the stage inputs its tasks are *fed* on a
    /// worker (a join's probe side, read whole partition by partition): a task starts once
    /// its other inputs are complete, and the driver sends it this input's blocks as its
    /// producers make them (`crate::exec::task_feed`). Empty in threads mode.
    pub fed_inputs: Vec<Vec<bool>>,
}

impl OperatorGraph {
    /// Rows per piece a per-block task of `op` hands its fragment, and so the most rows of
    /// each block it writes: the target block size, but for a model's per-block operator
    /// [`ModelBatching::model_piece_rows`].
    pub fn piece_rows(&self, op: OperatorId) -> usize {
        let operator = &self.operators[op];
        match (operator.pool, operator.shape) {
            (Pool::Accelerator, TaskShape::BlockWise) => self.batching.model_piece_rows(),
            _ => self.batching.block_rows,
        }
    }

    /// How a task of `op` cuts the input blocks it reads into pieces: exactly to
    /// [`Self::piece_rows`] for a model's per-block operator (its forward passes are best
    /// full), large blocks kept as they are for the rest (no copy of a join's probe side).
    pub fn piece_cut(&self, op: OperatorId) -> PieceCut {
        let operator = &self.operators[op];
        match (operator.pool, operator.shape) {
            (Pool::Accelerator, TaskShape::BlockWise) => PieceCut::Exact,
            _ => PieceCut::KeepLargeBlocks,
        }
    }

    /// Most rows of the `bundles_so_far`-th bundle (0-based) a per-block task of `op` gathers
    /// of a partition's blocks: a model's ramp up to the target
    /// ([`ModelBatching::model_bundle_rows`]); a CPU operator's [`CpuBundles::rows`].
    pub fn bundle_rows(&self, op: OperatorId, bundles_so_far: usize) -> usize {
        match self.operators[op].pool {
            Pool::Accelerator => self.batching.model_bundle_rows(bundles_so_far),
            Pool::Cpu => self.cpu_bundles.rows,
        }
    }

    /// Most bytes a per-block task of `op` gathers of a partition's blocks (a model's
    /// bundles are bounded by rows alone).
    pub fn bundle_bytes(&self, op: OperatorId) -> u64 {
        match self.operators[op].pool {
            Pool::Accelerator => u64::MAX,
            Pool::Cpu => self.cpu_bundles.bytes,
        }
    }

    /// The root operator, whose output is the query's output.
    pub fn root(&self) -> &Operator {
        self.operators.last().expect("a graph has a root")
    }

    /// True when `op`'s tasks stream a join's probe input (see [`Operator::streamed_inputs`]).
    pub fn streams_inputs(&self, op: OperatorId) -> bool {
        self.operators[op].streamed_inputs.iter().any(|s| *s)
    }

    /// Whether `op`'s stage input `input` is fed to its tasks on workers
    /// ([`Self::fed_inputs`]).
    pub fn fed(&self, op: OperatorId, input: usize) -> bool {
        self.fed_inputs
            .get(op)
            .and_then(|fed| fed.get(input))
            .is_some_and(|f| *f)
    }
}

/// How many of a partition's blocks a CPU operator's per-block task takes (a filter, a
/// projection or a partial aggregate after an exchange). In threads mode a task costs
/// ~0.05 ms, so each block is a task of its own and the next operator starts on it at once.
/// A worker process's task is a round trip between two processes (~1 ms of the two cores:
/// `benches/small_queries.rs`), more than its work on one block of 8,192 rows, so there a
/// task takes every block its partition has gathered, up to `flumen.worker_bundle_blocks`
/// blocks' rows and [`WORKER_BUNDLE_BYTES`]; a bundle short of them waits while an earlier
/// task of its partition is still to end and its producer runs (the scheduler's rule:
/// `crate::exec::tasks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuBundles {
    /// Most rows a task gathers (1: a block a task).
    pub rows: usize,
    /// Most bytes a task gathers.
    pub bytes: u64,
    /// Whether a bundle short of its rows waits for more blocks (see above).
    pub waits_for_more: bool,
}

/// Bytes a worker process's per-block task gathers at most (its inputs are in the worker's
/// memory at once).
pub const WORKER_BUNDLE_BYTES: u64 = 32 << 20;

impl CpuBundles {
    /// The bundles of a run in `mode`, with blocks of `block_rows` rows, a worker's task
    /// taking up to `worker_blocks` of them.
    pub fn for_mode(mode: WorkerMode, block_rows: usize, worker_blocks: usize) -> Self {
        match mode {
            WorkerMode::Process if worker_blocks > 1 => Self {
                rows: block_rows.saturating_mul(worker_blocks),
                bytes: WORKER_BUNDLE_BYTES,
                waits_for_more: true,
            },
            WorkerMode::Process | WorkerMode::Threads => Self {
                rows: 1,
                bytes: u64::MAX,
                waits_for_more: false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_cpu_tasks_gather_blocks_and_threads_take_one() {
        let threads = CpuBundles::for_mode(WorkerMode::Threads, 8192, 8);
        assert_eq!((threads.rows, threads.waits_for_more), (1, false));
        let workers = CpuBundles::for_mode(WorkerMode::Process, 8192, 8);
        assert_eq!((workers.rows, workers.bytes), (65_536, WORKER_BUNDLE_BYTES));
        assert!(workers.waits_for_more);
        let one = CpuBundles::for_mode(WorkerMode::Process, 8192, 1);
        assert_eq!(one, threads);
    }
}
