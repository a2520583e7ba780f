//! Reading an operator's output in a fixed order: a [`Cursor`] walks its blocks task by
//! task, interleaved round by round, or in arrival order, optionally only those of one
//! output partition (tag), and says when to wait and when the output has ended.

use crate::exec::lineage::TaskId;
use crate::exec::run::QueryRun;
use crate::exec::state::{RunState, TaskStatus};
use crate::plan::graph::OperatorId;
use crate::plan::stage_input::InputExchange;
use crate::store::block::BlockId;

/// In which order a reader walks an operator's output.
#[derive(Debug, Clone)]
pub(super) enum ReadOrder {
    /// Task by task through these partitions, each task's blocks in sequence.
    Tasks { partitions: Vec<usize> },
    /// The first task of each of these partitions, then the second of each, and so on:
    /// the order the scheduler launches them in, so a streaming reader waits least.
    Interleaved { partitions: Vec<usize> },
    /// In the order blocks were produced.
    Arrival,
    /// The blocks of this one task, in sequence (one sorted run of a run-sorting operator).
    Task(TaskId),
}

/// A reader's position in one operator's output.
#[derive(Debug, Clone)]
pub(super) struct Cursor {
    pub(super) operator: OperatorId,
    pub(super) order: ReadOrder,
    /// Only blocks with this tag (split outputs).
    pub(super) tag: Option<usize>,
    pub(super) part_index: usize,
    pub(super) task_index: usize,
    pub(super) out_index: usize,
    pub(super) log_index: usize,
    /// `Interleaved`: position in each task of the current round, and which have ended.
    pub(super) round_out: Vec<usize>,
    pub(super) round_done: Vec<bool>,
    /// The stream reading through this cursor returned an error and ends.
    pub(super) failed: bool,
}

impl Cursor {
    /// A cursor at the start of `operator`'s output, walking it in `order`, only the
    /// blocks tagged `tag` if given.
    pub(super) fn new(operator: OperatorId, order: ReadOrder, tag: Option<usize>) -> Self {
        Self {
            operator,
            order,
            tag,
            part_index: 0,
            task_index: 0,
            out_index: 0,
            log_index: 0,
            round_out: vec![],
            round_done: vec![],
            failed: false,
        }
    }
}

pub(super) enum Next {
    Block(BlockId),
    Wait,
    End,
}

impl QueryRun {
    /// The cursor through which partition `partition` of `op` reads its input `input`.
    /// `deterministic`: read task by task (used once the producer has finished).
    pub(super) fn input_cursor(
        &self,
        op_id: OperatorId,
        input: usize,
        partition: usize,
        deterministic: bool,
    ) -> Cursor {
        let op = &self.graph.operators[op_id];
        let producer = &self.graph.operators[op.inputs[input]];
        let all: Vec<usize> = (0..producer.partitions()).collect();
        let streamed = deterministic && op.streamed_inputs[input] && self.streams_inputs(op_id);
        let (order, tag) = match &op.input_exchanges[input] {
            InputExchange::Preserve => (
                ReadOrder::Tasks {
                    partitions: vec![partition],
                },
                None,
            ),
            InputExchange::Gather if streamed && all.len() > 1 => {
                (ReadOrder::Interleaved { partitions: all }, None)
            }
            InputExchange::Gather if all.len() == 1 || deterministic => {
                (ReadOrder::Tasks { partitions: all }, None)
            }
            InputExchange::Gather => (ReadOrder::Arrival, None),
            InputExchange::Split(_) if streamed => {
                (ReadOrder::Interleaved { partitions: all }, Some(partition))
            }
            InputExchange::Split(_) if deterministic => {
                (ReadOrder::Tasks { partitions: all }, Some(partition))
            }
            InputExchange::Split(_) => (ReadOrder::Arrival, Some(partition)),
        };
        Cursor::new(producer.id, order, tag)
    }

    pub(super) fn next_block(st: &RunState, cursor: &mut Cursor) -> Next {
        let op = &st.operators[cursor.operator];
        match &cursor.order {
            ReadOrder::Arrival => loop {
                if cursor.log_index < op.log.len() {
                    let id = op.log[cursor.log_index];
                    cursor.log_index += 1;
                    if cursor.tag.is_none_or(|t| st.blocks[&id].tag == t) {
                        return Next::Block(id);
                    }
                } else if op.complete {
                    return Next::End;
                } else {
                    return Next::Wait;
                }
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
                        match Self::next_in_task(st, *task_id, cursor.tag, &mut cursor.round_out[i])
                        {
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
            ReadOrder::Task(task) => {
                Self::next_in_task(st, *task, cursor.tag, &mut cursor.out_index)
            }
            ReadOrder::Tasks { partitions } => loop {
                let Some(p) = partitions.get(cursor.part_index) else {
                    return Next::End;
                };
                let ps = &op.partitions[*p];
                if let Some(task_id) = ps.tasks.get(cursor.task_index) {
                    match Self::next_in_task(st, *task_id, cursor.tag, &mut cursor.out_index) {
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
    pub(super) fn next_in_task(
        st: &RunState,
        task_id: TaskId,
        tag: Option<usize>,
        out_index: &mut usize,
    ) -> Next {
        let task = &st.tasks[task_id];
        while let Some(id) = task.outputs.get(*out_index) {
            *out_index += 1;
            if tag.is_none_or(|t| st.blocks[id].tag == t) {
                return Next::Block(*id);
            }
        }
        if task.status == TaskStatus::Done {
            Next::End
        } else {
            Next::Wait
        }
    }
}
