//! Reading an operator's output in a fixed order: a [`Cursor`] walks its blocks task by
//! task, interleaved round by round, or in arrival order, optionally only those of one
//! output partition (tag). The run's state says, for a cursor, which block comes next, or
//! to wait, or that the output has ended ([`crate::exec::state::RunState::next_block`]).

use std::collections::HashMap;

use crate::exec::task_kind::TaskId;
use crate::plan::graph::OperatorId;
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
    /// Position among the current task's blocks (those tagged `tag`, if given).
    pub(super) out_index: usize,
    /// Position among the operator's blocks in arrival order (those tagged `tag`, if given).
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

/// Blocks in the order they were made (a task's outputs, an operator's log), with each
/// tag's blocks listed apart: a cursor of one output partition steps through its own
/// blocks, not past every other partition's (with hundreds of partitions that walk was
/// most of the driver's time).
#[derive(Debug, Default)]
pub(super) struct BlockList {
    all: Vec<BlockId>,
    by_tag: HashMap<usize, Vec<BlockId>>,
}

impl BlockList {
    /// Append block `id`, tagged `tag`.
    pub(super) fn push(&mut self, id: BlockId, tag: usize) {
        self.all.push(id);
        self.by_tag.entry(tag).or_default().push(id);
    }

    /// The `index`-th block, of those tagged `tag` if given.
    pub(super) fn get(&self, tag: Option<usize>, index: usize) -> Option<BlockId> {
        match tag {
            None => self.all.get(index).copied(),
            Some(tag) => self.by_tag.get(&tag)?.get(index).copied(),
        }
    }
}

impl std::ops::Deref for BlockList {
    type Target = [BlockId];

    /// Every block, in order.
    fn deref(&self) -> &[BlockId] {
        &self.all
    }
}

/// What a cursor reads next ([`crate::exec::state::RunState::next_block`]).
pub(super) enum Next {
    /// This block.
    Block(BlockId),
    /// Nothing yet: the next block is still to be made.
    Wait,
    /// The output has ended for this cursor.
    End,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_list_walks_one_tag_or_all_in_order() {
        let mut list = BlockList::default();
        for (id, tag) in [(10, 0), (11, 1), (12, 0), (13, 2), (14, 1)] {
            list.push(id, tag);
        }
        let walk = |tag| (0..).map_while(|i| list.get(tag, i)).collect::<Vec<_>>();
        assert_eq!(walk(None), [10, 11, 12, 13, 14]);
        assert_eq!(walk(Some(0)), [10, 12]);
        assert_eq!(walk(Some(1)), [11, 14]);
        assert_eq!(walk(Some(3)), Vec::<BlockId>::new());
        assert_eq!(*list, [10, 11, 12, 13, 14]);
    }
}
