//! What a run knows, under its one lock: every task and its outputs, each operator's
//! partitions and dispatch position, the blocks' lineage, and the pools' busy slots; and,
//! asked with a reader's [`Cursor`], which of an operator's blocks it reads next.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use datafusion::error::DataFusionError;
use tokio::task::AbortHandle;

use crate::exec::cursor::{BlockList, Cursor, Next, ReadOrder};
use crate::exec::task_kind::{TaskId, TaskKind};
use crate::plan::graph::{OperatorId, Pool};
use crate::plan::task_bounds::LaunchBounds;
use crate::store::block::{Block, BlockId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TaskStatus {
    Pending,
    Running,
    Done,
}

#[derive(Debug)]
pub(super) struct TaskRecord {
    pub(super) operator: OperatorId,
    pub(super) partition: usize,
    pub(super) kind: TaskKind,
    pub(super) status: TaskStatus,
    /// Its output blocks, in order.
    pub(super) outputs: BlockList,
    /// Input blocks read, released when the task ends.
    pub(super) consumed: Vec<BlockId>,
    /// Rows of this task's output blocks not yet released (read by every reader).
    pub(super) held_rows: u64,
    /// Time spent paused by in-task backpressure (not counted as busy).
    pub(super) paused_ns: u64,
    /// Resumed to keep the run live: runs to its end without pausing again.
    pub(super) unpausable: bool,
    /// When the task was launched (for the test hook's [`crate::exec::fault_hooks::BlockInfo::task_elapsed`]).
    pub(super) launched: Option<Instant>,
    /// A sort of this task was refused memory to concatenate its batches (DataFusion
    /// concatenates what it holds, to sort in place or into fewer runs of one key, and the
    /// copy grows its reservation by about a quarter: refused when the sort already holds
    /// its whole share of the budget). The task runs again at once, beside the others, with
    /// its sorts sorting and merging their batches as they are.
    pub(super) sorts_in_pieces: bool,
    /// Refused memory beside other tasks once: queued to run again alone.
    pub(super) retried_alone: bool,
    /// Refused memory even alone: runs (alone) with its hash joins as sort-merge joins
    /// ([`crate::plan::merge_join_fallback`]).
    pub(super) merge_join: bool,
    /// Whether its scan drops the rows its joins' complete dynamic filters reject, once its
    /// first run chose ([`crate::plan::stage_input::TaskInputs::scan_row_filter`]).
    pub(super) scan_row_filter: Arc<OnceLock<bool>>,
    /// The bounds of its operator's ended tasks it prunes by, as its first run found them
    /// ([`crate::plan::task_bounds`]): every run of it prunes by the same.
    pub(super) bounds_at_launch: Arc<OnceLock<LaunchBounds>>,
    /// Whether it has polled one of its input streams yet.
    pub(super) read_an_input: bool,
    /// Its readers of a collected (not streamed) input that wait for blocks now, when its
    /// operator streams its other inputs: a join collecting its build side.
    pub(super) build_waits: u32,
    /// The summary of its output's keys its worker sent, for a task of a join's build
    /// producer ([`crate::plan::build_keys`]).
    pub(super) build_keys: Option<crate::plan::build_keys::KeySummary>,
}

impl TaskRecord {
    pub(super) fn new(operator: OperatorId, partition: usize, kind: TaskKind) -> Self {
        Self {
            operator,
            partition,
            kind,
            status: TaskStatus::Pending,
            outputs: BlockList::default(),
            consumed: vec![],
            held_rows: 0,
            paused_ns: 0,
            unpausable: false,
            launched: None,
            sorts_in_pieces: false,
            retried_alone: false,
            merge_join: false,
            scan_row_filter: Arc::default(),
            bounds_at_launch: Arc::default(),
            read_an_input: false,
            build_waits: 0,
            build_keys: None,
        }
    }
}

/// A running task paused by in-task backpressure: it gave up its slot and waits for the
/// scheduler to hand one back.
#[derive(Debug)]
pub(super) struct PausedTask {
    pub(super) task: TaskId,
    pub(super) resume: tokio::sync::oneshot::Sender<()>,
    /// It gave its slot to a more downstream operator (not because its reader was behind):
    /// it may resume as soon as a slot is free and its output is under the pause threshold.
    pub(super) yielded: bool,
}

#[derive(Debug, Default)]
pub(super) struct PartitionState {
    /// Tasks of this partition, in output order.
    pub(super) tasks: Vec<TaskId>,
    /// No more tasks will be added.
    pub(super) closed: bool,
    /// Index in `tasks` of the first task not launched yet.
    pub(super) next_launch: usize,
    /// Where a block-wise operator's dispatch stands in its input.
    pub(super) input: Option<Cursor>,
    /// Blocks read from its input but not yet in a task: a run-sorting operator's run still
    /// short of its bytes, or a block-wise operator's bundle still short of its rows.
    pub(super) gathered: Vec<BlockId>,
    /// Their bytes (a run-sorting operator; a CPU block-wise operator's bundle).
    pub(super) gathered_bytes: u64,
    /// Their rows (a block-wise operator).
    pub(super) gathered_rows: usize,
}

#[derive(Debug, Default)]
pub(super) struct OperatorState {
    pub(super) partitions: Vec<PartitionState>,
    /// Every output block in the order produced.
    pub(super) log: BlockList,
    /// Bytes of unreleased output blocks in the store.
    pub(super) held_bytes: u64,
    /// Rows of unreleased output blocks in the store.
    pub(super) held_rows: u64,
    pub(super) running: usize,
    pub(super) complete: bool,
    /// Barrier operators: tasks created.
    pub(super) started: bool,
    /// Round-robin position for launching across partitions.
    pub(super) next_partition: usize,
    /// A task has asked for this operator's blocks (opens the gate of a streamed input).
    pub(super) demanded: bool,
    /// Running tasks paused because their output is too far ahead of its reader.
    pub(super) paused: Vec<PausedTask>,
    pub(super) backpressured_since: Option<Instant>,
}

impl OperatorState {
    pub(super) fn has_pending(&self) -> bool {
        self.partitions
            .iter()
            .any(|p| p.next_launch < p.tasks.len())
    }
}

#[derive(Debug, Default)]
pub(super) struct RunState {
    pub(super) operators: Vec<OperatorState>,
    pub(super) tasks: Vec<TaskRecord>,
    /// Every block produced, with its lineage.
    pub(super) blocks: HashMap<BlockId, Block>,
    /// Blocks their readers are done with.
    pub(super) released: HashSet<BlockId>,
    /// Restored blocks that are removed from the store once read.
    pub(super) read_once: HashSet<BlockId>,
    pub(super) error: Option<Arc<DataFusionError>>,
    pub(super) cancelled: bool,
    pub(super) running: [usize; 2],
    pub(super) aborts: Vec<AbortHandle>,
    /// Output partitions opened so far, and how many of them are still being read.
    pub(super) outputs_opened: usize,
    pub(super) outputs_open: usize,
    /// Accelerator workers this run may use now: grows towards `flumen.accelerator_slots`
    /// while accelerator tasks wait on busy workers.
    pub(super) accelerator_target: usize,
    /// Running tasks of streaming operators (they take no slot).
    pub(super) streaming_running: usize,
    /// Streaming tasks' block readers waiting for a block that is not there yet.
    pub(super) streaming_waiting: usize,
    /// The query's output readers waiting for a block while the root holds unread output
    /// (they wait for another of its tasks, by output order): only then may the liveness
    /// rule act for them.
    pub(super) output_blocked: usize,
    /// Tasks whose sort was refused memory to concatenate its batches, waiting for a slot to
    /// run again with their sorts in pieces (before any other task launches).
    pub(super) waiting_in_pieces: std::collections::VecDeque<TaskId>,
    /// Tasks refused memory while others ran, waiting to run again alone (see
    /// [`QueryRun::retry_alone`](super::run::QueryRun)).
    pub(super) waiting_alone: std::collections::VecDeque<TaskId>,
    /// The task running alone now: nothing else launches until it ends.
    pub(super) running_alone: Option<TaskId>,
    /// Tasks that have ended (done, failed or sent back to run again): a recompute refused
    /// memory tries again once one more has ended.
    pub(super) tasks_ended: u64,
    /// Where each of the graph's build bounds stands (its scans wait until settled)
    /// ([`crate::plan::graph::OperatorGraph::build_bounds`]).
    pub(super) build_bounds: Vec<BuildBoundState>,
}

/// Where a worker-mode join's build side stands for its probe side's scans
/// ([`crate::plan::build_bounds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum BuildBoundState {
    /// Its build producer is still running: the scans that read it wait.
    #[default]
    Waiting,
    /// Its build producer is complete: the scans start, from its bound where the run holds
    /// one (its tasks' summaries of their keys merged, or `false` for no row).
    Settled {
        /// Which of the scans' splits drop the rows the bound rejects.
        drops: RowDrops,
    },
}

/// Which splits of the scans reading a join's bound from its build side drop the rows it
/// rejects (the others use it to prune row groups only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowDrops {
    /// None: the bound is a range alone, which rarely rejects rows that the row groups'
    /// statistics did not (a choice: TPC-H q4 and q9 measured within noise either way).
    None,
    /// Those under a grouped aggregate: the bound lists the keys (or is `false`) and
    /// `flumen.build_key_sets` is off.
    UnderGrouping,
    /// Every one: the bound lists the keys or tests them against their set
    /// ([`crate::plan::key_membership`]), both cheap beside the exchange and the probe a
    /// row it rejects would cost.
    Everywhere,
}

pub(super) fn pool_index(pool: Pool) -> usize {
    match pool {
        Pool::Cpu => 0,
        Pool::Accelerator => 1,
    }
}

impl RunState {
    /// The next block `cursor` reads (and moves past), or whether to wait or stop.
    pub(super) fn next_block(&self, cursor: &mut Cursor) -> Next {
        let op = &self.operators[cursor.operator];
        match &cursor.order {
            ReadOrder::Arrival => match op.log.get(cursor.tag, cursor.log_index) {
                Some(id) => {
                    cursor.log_index += 1;
                    Next::Block(id)
                }
                None if op.complete => Next::End,
                None => Next::Wait,
            },
            ReadOrder::Interleaved { partitions } => loop {
                // `task_index` is the round: the round-th task of every partition. Its tasks
                // run at once, so they are read a block from each in turn (always in the
                // same order, waiting for a block rather than skipping ahead, so the order
                // depends only on each task's output); `part_index` is whose turn it is.
                let n = partitions.len();
                if cursor.round_out.len() != n {
                    cursor.round_out = vec![0; n];
                    cursor.round_done = vec![false; n];
                }
                if cursor.round_done.iter().all(|d| *d) {
                    let round = cursor.task_index + 1;
                    let ended = partitions.iter().all(|p| {
                        let ps = &op.partitions[*p];
                        ps.closed && ps.tasks.len() <= round
                    });
                    if ended {
                        return Next::End;
                    }
                    cursor.task_index = round;
                    cursor.part_index = 0;
                    cursor.round_out.iter_mut().for_each(|o| *o = 0);
                    cursor.round_done.iter_mut().for_each(|d| *d = false);
                    continue;
                }
                let i = cursor.part_index % n;
                if cursor.round_done[i] {
                    cursor.part_index = (i + 1) % n;
                    continue;
                }
                let ps = &op.partitions[partitions[i]];
                match ps.tasks.get(cursor.task_index) {
                    Some(task_id) => {
                        match self.next_in_task(*task_id, cursor.tag, &mut cursor.round_out[i]) {
                            Next::Block(id) => {
                                cursor.part_index = (i + 1) % n;
                                return Next::Block(id);
                            }
                            Next::End => cursor.round_done[i] = true,
                            Next::Wait => return Next::Wait,
                        }
                    }
                    None if ps.closed => cursor.round_done[i] = true,
                    None => return Next::Wait,
                }
            },
            ReadOrder::Task(task) => self.next_in_task(*task, cursor.tag, &mut cursor.out_index),
            ReadOrder::Tasks { partitions } => loop {
                let Some(p) = partitions.get(cursor.part_index) else {
                    return Next::End;
                };
                let ps = &op.partitions[*p];
                if let Some(task_id) = ps.tasks.get(cursor.task_index) {
                    match self.next_in_task(*task_id, cursor.tag, &mut cursor.out_index) {
                        Next::End => {
                            cursor.task_index += 1;
                            cursor.out_index = 0;
                        }
                        next => return next,
                    }
                } else if ps.closed {
                    cursor.part_index += 1;
                    cursor.task_index = 0;
                    cursor.out_index = 0;
                } else {
                    return Next::Wait;
                }
            },
        }
    }

    /// The next block (tagged `tag`, if given) of task `task_id` from position `out_index`;
    /// `End` once the task has finished and every block of it was read.
    fn next_in_task(&self, task_id: TaskId, tag: Option<usize>, out_index: &mut usize) -> Next {
        let task = &self.tasks[task_id];
        if let Some(id) = task.outputs.get(tag, *out_index) {
            *out_index += 1;
            return Next::Block(id);
        }
        if task.status == TaskStatus::Done {
            Next::End
        } else {
            Next::Wait
        }
    }
}
