//! Creating tasks as their inputs become ready: one per source split (at start), one per
//! output partition of a per-partition operator (once its inputs are complete, or at once
//! when it streams a join's probe input), one per bundle of input blocks of a per-block
//! operator (as the blocks arrive).

use crate::exec::cursor::{Cursor, Next};
use crate::exec::run::QueryRun;
use crate::exec::state::{RunState, TaskRecord, TaskStatus};
use crate::exec::task_kind::TaskKind;
use crate::plan::graph::{OperatorId, Pool, TaskShape};
use crate::store::block::BlockId;

impl QueryRun {
    pub(super) fn create_tasks(&self, st: &mut RunState) {
        let root = self.graph.root().id;
        for op in &self.graph.operators {
            if op.id == root && self.root_runs_in_output() {
                continue;
            }
            match op.shape {
                TaskShape::Source => {}
                TaskShape::Barrier => {
                    // A task fed its streamed input on a worker starts once the others
                    // (its build side) are complete.
                    let fed = |input: usize| self.fed_on_workers(op.id, input);
                    let ready = match self.streams_inputs(op.id) && !self.fed_inputs(op.id) {
                        true => true,
                        false => (op.inputs.iter().enumerate())
                            .all(|(input, i)| fed(input) || st.operators[*i].complete),
                    };
                    if ready && !st.operators[op.id].started {
                        for p in 0..op.partitions() {
                            let id = st.tasks.len();
                            st.tasks
                                .push(TaskRecord::new(op.id, p, TaskKind::Partition));
                            let ps = &mut st.operators[op.id].partitions[p];
                            ps.tasks.push(id);
                            ps.closed = true;
                        }
                        st.operators[op.id].started = true;
                        self.slice_hot_partitions(st, op.id);
                    }
                }
                TaskShape::BlockWise => self.create_block_tasks(st, op.id),
            }
            self.update_complete(st, op.id);
        }
        self.skip_unasked(st);
        self.skip_unread(st);
    }

    /// True when `op`'s tasks start at once and stream a join's probe input; they then run
    /// beside the pool's slots (like the output's reader), paced by the blocks they get.
    /// `flumen.mode = 'batch'` keeps every per-partition operator a barrier.
    pub(super) fn streams_inputs(&self, op: OperatorId) -> bool {
        self.policy.streams_join_inputs() && self.graph.streams_inputs(op)
    }

    /// Whether stage input `input` of `op` is fed to its tasks on workers as its producers
    /// make it ([`crate::plan::graph::OperatorGraph::fed_inputs`]): in worker mode, where
    /// joins stream their probe inputs.
    pub(super) fn fed_on_workers(&self, op: OperatorId, input: usize) -> bool {
        self.streams_inputs(op) && self.graph.fed(op, input)
    }

    /// Whether any stage input of `op` is fed to its tasks on workers.
    pub(super) fn fed_inputs(&self, op: OperatorId) -> bool {
        (0..self.graph.operators[op].inputs.len()).any(|input| self.fed_on_workers(op, input))
    }

    /// Whether `op` may start: every streamed input it feeds has been asked for.
    /// In worker mode it also waits until the build side of each join whose filter its scans
    /// read is complete ([`crate::plan::build_bounds`]).
    pub(super) fn gate_open(&self, st: &RunState, op: OperatorId) -> bool {
        let asked = !self.policy.streams_join_inputs()
            || self.graph.gates[op]
                .iter()
                .all(|g| st.operators[*g].demanded);
        asked && self.build_bounds_settled(st, op)
    }

    /// A join that finished without asking for its probe input (its build side was empty)
    /// never needs the operators feeding it: they count as complete without running.
    pub(super) fn skip_unasked(&self, st: &mut RunState) {
        for op in &self.graph.operators {
            if st.operators[op.id].complete {
                continue;
            }
            let skipped = self.graph.gates[op.id].iter().any(|g| {
                !st.operators[*g].demanded
                    && self.graph.consumer[*g].is_some_and(|c| st.operators[c].complete)
            });
            if skipped {
                st.operators[op.id].complete = true;
            }
        }
    }

    pub(super) fn create_block_tasks(&self, st: &mut RunState, op_id: OperatorId) {
        let op = &self.graph.operators[op_id];
        let producer = op.inputs[0];
        if self.policy.waits_for_producers() && !st.operators[producer].complete {
            return;
        }
        if let Some(run_bytes) = op.run_bytes {
            return self.create_run_tasks(st, op_id, run_bytes);
        }
        // Each block is read once: a bundle short of its rows waits in the partition's
        // state, and the cursor stays past the blocks of other partitions it skipped. (Read
        // again on every scheduling pass, a split input's blocks of the other partitions made
        // the pass cost the whole backlog: 100,000 rows in 5-row blocks took 26 s.)
        for p in 0..op.partitions() {
            if st.operators[op_id].partitions[p].closed {
                continue;
            }
            let mut cursor = self.take_dispatch_cursor(st, op_id, p);
            let ps = &mut st.operators[op_id].partitions[p];
            let (mut gathered, mut rows) = (std::mem::take(&mut ps.gathered), ps.gathered_rows);
            let mut bytes = ps.gathered_bytes;
            loop {
                // A model's bundles ramp up to the target: the first rows leave it early.
                let bundle_rows = self
                    .graph
                    .bundle_rows(op_id, st.operators[op_id].partitions[p].tasks.len());
                let bundle_bytes = self.graph.bundle_bytes(op_id);
                let mut ended = false;
                while rows < bundle_rows && bytes < bundle_bytes {
                    match st.next_block(&mut cursor) {
                        Next::Block(id) => {
                            rows += st.blocks[&id].rows;
                            bytes += st.blocks[&id].bytes;
                            gathered.push(id);
                        }
                        Next::Wait => break,
                        Next::End => {
                            ended = true;
                            break;
                        }
                    }
                }
                if gathered.is_empty() {
                    if ended {
                        st.operators[op_id].partitions[p].closed = true;
                    }
                    break;
                }
                // A partial bundle waits for more rows while its producer has work left,
                // unless this is a model's operator that would otherwise sit idle (none of
                // its tasks running or waiting) and the rows make at least one of the model's
                // pieces: the model then gets the same calls as from a full bundle, now,
                // instead of waiting for rows the CPU slots are still making (a bundle of
                // long documents took them ~0.5 s while the device waited).
                let producer_idle =
                    st.operators[producer].running == 0 && !st.operators[producer].has_pending();
                let own = &st.operators[op_id];
                let starving = op.pool == Pool::Accelerator
                    && own.running == 0
                    && !own.has_pending()
                    && rows >= self.graph.piece_rows(op_id);
                // A CPU bundle short of its rows goes as soon as its partition has no task
                // still to end (the first at once, then what gathered while one ran), or
                // its producer runs nothing (ended, or held back by memory: the blocks
                // waiting here may be what holds it back).
                let cpu_goes = op.pool == Pool::Cpu
                    && (!self.graph.cpu_bundles.waits_for_more
                        || st.operators[producer].running == 0
                        || !Self::partition_busy(st, op_id, p));
                let full = rows >= bundle_rows || bytes >= bundle_bytes;
                if !full && !ended && !producer_idle && !starving && !cpu_goes {
                    break;
                }
                Self::push_block_task(st, op_id, p, std::mem::take(&mut gathered));
                rows = 0;
                bytes = 0;
                if ended {
                    st.operators[op_id].partitions[p].closed = true;
                    break;
                }
            }
            let ps = &mut st.operators[op_id].partitions[p];
            ps.gathered = gathered;
            ps.gathered_rows = rows;
            ps.gathered_bytes = bytes;
            ps.input = Some(cursor);
        }
    }

    /// Whether partition `p` of `op_id` has a task still to end. Its tasks launch in order
    /// and mostly end so: its last task tells.
    fn partition_busy(st: &RunState, op_id: OperatorId, p: usize) -> bool {
        st.operators[op_id].partitions[p]
            .tasks
            .last()
            .is_some_and(|t| st.tasks[*t].status != TaskStatus::Done)
    }

    /// Tasks of run-sorting operator `op_id` ([`crate::plan::Operator::run_bytes`]): each partition's
    /// blocks are gathered as they arrive, and every `run_bytes` of them make a task (a
    /// sorted run); what is left when the producer has finished makes the last. The gathered
    /// blocks wait in the partition's state, so each block is looked at once.
    fn create_run_tasks(&self, st: &mut RunState, op_id: OperatorId, run_bytes: u64) {
        for p in 0..self.graph.operators[op_id].partitions() {
            if st.operators[op_id].partitions[p].closed {
                continue;
            }
            let mut cursor = self.take_dispatch_cursor(st, op_id, p);
            let ps = &mut st.operators[op_id].partitions[p];
            let (mut gathered, mut bytes) = (std::mem::take(&mut ps.gathered), ps.gathered_bytes);
            loop {
                let next = st.next_block(&mut cursor);
                let ended = matches!(next, Next::End);
                if let Next::Block(id) = next {
                    gathered.push(id);
                    bytes += st.blocks[&id].bytes;
                }
                if !gathered.is_empty() && (bytes >= run_bytes || ended) {
                    bytes = 0;
                    Self::push_block_task(st, op_id, p, std::mem::take(&mut gathered));
                }
                if ended {
                    st.operators[op_id].partitions[p].closed = true;
                }
                if !matches!(next, Next::Block(_)) {
                    break;
                }
            }
            let ps = &mut st.operators[op_id].partitions[p];
            ps.gathered = gathered;
            ps.gathered_bytes = bytes;
            ps.input = Some(cursor);
        }
    }

    /// A task of per-block operator `op_id` over `inputs`, last of partition `p`'s.
    fn push_block_task(st: &mut RunState, op_id: OperatorId, p: usize, inputs: Vec<BlockId>) {
        let id = st.tasks.len();
        st.tasks
            .push(TaskRecord::new(op_id, p, TaskKind::Blocks { inputs }));
        st.operators[op_id].partitions[p].tasks.push(id);
    }

    /// Where per-block operator `op_id`'s dispatch stands in partition `p`'s input (taken
    /// out of its state, to be put back): at the start for its first tasks.
    fn take_dispatch_cursor(&self, st: &mut RunState, op_id: OperatorId, p: usize) -> Cursor {
        st.operators[op_id].partitions[p]
            .input
            .take()
            .unwrap_or_else(|| self.input_cursor(op_id, 0, p, false))
    }

    /// An operator whose reader finished before reading all of it (a `LIMIT` that has its
    /// rows) launches nothing more: its pending tasks are dropped and it counts as complete,
    /// and so, in turn, do the operators feeding only it. Running tasks end on their own;
    /// their blocks are never read.
    pub(super) fn skip_unread(&self, st: &mut RunState) {
        // Consumers come after their producers: one pass from the root down suffices.
        for op in self.graph.operators.iter().rev() {
            let Some(consumer) = self.graph.consumer[op.id] else {
                continue;
            };
            if st.operators[op.id].complete || !st.operators[consumer].complete {
                continue;
            }
            for p in &mut st.operators[op.id].partitions {
                p.closed = true;
                p.next_launch = p.tasks.len();
            }
            st.operators[op.id].started = true;
            st.operators[op.id].complete = true;
        }
    }

    pub(super) fn update_complete(&self, st: &mut RunState, op_id: OperatorId) {
        let os = &st.operators[op_id];
        if os.complete || !os.started && self.graph.operators[op_id].shape != TaskShape::BlockWise {
            return;
        }
        let done = os.partitions.iter().all(|p| {
            p.closed
                && p.tasks
                    .iter()
                    .all(|t| st.tasks[*t].status == TaskStatus::Done)
        });
        if done {
            st.operators[op_id].complete = true;
        }
    }
}
