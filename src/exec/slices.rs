//! A hot partition cut into slices: a per-partition task of a hash join whose build side (a
//! skewed key's rows) is larger than its share of the budget, seen when its task is made
//! (the map side's blocks are all in: the partition's bytes are known), is replaced by
//! tasks that each build from a slice of the build side's blocks and probe with the whole
//! probe side ([`crate::plan::partition_slices`] says which fragments allow it). The slices
//! run beside each other and beside other tasks, where running the partition again alone
//! would leave every other slot idle; their outputs, one after the other, are the
//! partition's output.

use crate::exec::cursor::Next;
use crate::exec::metrics::OperatorStats;
use crate::exec::run::QueryRun;
use crate::exec::state::{RunState, TaskRecord, TaskStatus};
use crate::exec::task_kind::{TaskId, TaskKind};
use crate::plan::graph::OperatorId;
use crate::plan::partition_slices::sliced_build_input;
use crate::plan::stage_input::StageInputExec;
use crate::store::block::BlockId;

/// A slice's build side is at most this share of the budget over the CPU slots: a hash
/// table takes two to three times its input's bytes, and the slices run beside others.
const SLICE_SHARE_DIVISOR: u64 = 4;

impl QueryRun {
    /// Cut task `task` (a per-partition task not launched yet, of an operator whose
    /// fragment may be sliced on its stage input `input`) into slices of that input when its
    /// blocks hold more than `over` bytes; not while that input is still arriving.
    fn slice_partition(&self, st: &mut RunState, task: TaskId, input: usize, over: u64) {
        let (op_id, partition) = (st.tasks[task].operator, st.tasks[task].partition);
        // The build side's blocks, in the order the task reads them.
        let mut cursor = self.input_cursor(op_id, input, partition, true);
        let mut blocks: Vec<(BlockId, u64)> = vec![];
        loop {
            match st.next_block(&mut cursor) {
                Next::Block(id) => blocks.push((id, st.blocks[&id].bytes.max(1))),
                Next::End => break,
                Next::Wait => return,
            }
        }
        let total: u64 = blocks.iter().map(|(_, bytes)| bytes).sum();
        if total <= over {
            return;
        }
        let slices = cut_slices(&blocks, self.slice_bytes());
        if slices.len() < 2 {
            return;
        }
        let n = slices.len();
        let mut ids = Vec::with_capacity(n);
        for blocks in slices {
            ids.push(st.tasks.len());
            st.tasks.push(TaskRecord::new(
                op_id,
                partition,
                TaskKind::Slice { input, blocks },
            ));
        }
        let ps = &mut st.operators[op_id].partitions[partition];
        ps.tasks = ids;
        ps.next_launch = 0;
        // The task it replaces never runs again.
        st.tasks[task].status = TaskStatus::Done;
        st.tasks[task].consumed.clear();
        let stats = self.stats(op_id);
        OperatorStats::add(&stats.partitions_sliced, 1);
        OperatorStats::add(&stats.slices, n as u64);
        log::info!(
            "flumen: partition {partition} of operator {op_id} ({}) has a build side of {total} \
             bytes: it runs as {n} slices",
            self.graph.operators[op_id].name
        );
    }

    /// Most bytes of the build side one slice takes.
    fn slice_bytes(&self) -> u64 {
        let share = self.config.memory_budget.0
            / (SLICE_SHARE_DIVISOR * self.config.cpu_slots.max(1) as u64);
        share.max(1)
    }

    /// Cut, as their tasks are made, the partitions of per-partition operator `op_id` whose
    /// build side is known (its producers have finished) and larger than two slices: such a
    /// partition's hash table would take more than its share of the budget, and building it
    /// whole only to be refused memory would be time lost. (A smaller partition refused
    /// memory beside others runs again alone, as any task does.)
    pub(super) fn slice_hot_partitions(&self, st: &mut RunState, op_id: OperatorId) {
        let op = &self.graph.operators[op_id];
        // Partitions of a ganged operator wait for each other: each must stay one task.
        if !self.config.slice_hot_partitions || op.gang {
            return;
        }
        let Some(input) = sliced_build_input(&op.fragment).and_then(|leaf| {
            leaf.downcast_ref::<StageInputExec>()
                .map(StageInputExec::input_index)
        }) else {
            return;
        };
        let over = 2 * self.slice_bytes();
        for p in 0..st.operators[op_id].partitions.len() {
            if let [task] = st.operators[op_id].partitions[p].tasks[..]
                && matches!(st.tasks[task].kind, TaskKind::Partition)
            {
                self.slice_partition(st, task, input, over);
            }
        }
    }

    /// The input blocks to release now that slice `task` has finished: its own slice of the
    /// build side at once; what it read of the other inputs (which every slice of its
    /// partition reads) once the last slice has finished.
    pub(super) fn finished_slice_inputs(
        &self,
        st: &mut RunState,
        task: TaskId,
        own: &[BlockId],
    ) -> Vec<BlockId> {
        let mut release = own.to_vec();
        let (op_id, partition) = (st.tasks[task].operator, st.tasks[task].partition);
        let siblings = st.operators[op_id].partitions[partition].tasks.clone();
        if siblings
            .iter()
            .all(|t| st.tasks[*t].status == TaskStatus::Done)
        {
            for sibling in siblings {
                release.append(&mut st.tasks[sibling].consumed);
            }
        }
        release
    }
}

/// `blocks` (id, bytes) cut into consecutive slices of about equal bytes, each at most
/// `share` bytes unless one block alone is larger.
fn cut_slices(blocks: &[(BlockId, u64)], share: u64) -> Vec<Vec<BlockId>> {
    let total: u64 = blocks.iter().map(|(_, b)| b).sum();
    let n = total.div_ceil(share).clamp(1, blocks.len().max(1) as u64);
    let per_slice = total.div_ceil(n);
    let mut slices: Vec<Vec<BlockId>> = vec![];
    let mut bytes = 0;
    for (id, size) in blocks {
        match slices.last_mut() {
            Some(last) if bytes + size <= per_slice || last.is_empty() => last.push(*id),
            _ => {
                slices.push(vec![*id]);
                bytes = 0;
            }
        }
        bytes += size;
    }
    slices
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_consecutive_and_about_equal() {
        let blocks: Vec<(BlockId, u64)> = (0..10).map(|i| (i, 100)).collect();
        let slices = cut_slices(&blocks, 250);
        // 1,000 bytes, at most 250 a slice: whole blocks, consecutive, none over the share.
        assert_eq!(
            slices,
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7], vec![8, 9]]
        );
        // One slice's worth, or a single block larger than the share: no cut.
        assert_eq!(cut_slices(&blocks, 1_000).len(), 1);
        assert_eq!(cut_slices(&[(7, 5_000)], 100), vec![vec![7]]);
        // Every block in exactly one slice.
        let uneven: Vec<(BlockId, u64)> = (0..7).map(|i| (i, 10 + i * 40)).collect();
        let cut = cut_slices(&uneven, 150);
        assert_eq!(cut.concat(), (0..7).collect::<Vec<BlockId>>());
        assert!(cut.len() >= 2, "{cut:?}");
    }
}
