//! Where a running task's blocks go ([`TaskSink`]): to the store and the run's lineage the
//! first time the task runs ([`StoreSink`]), or back in place of lost blocks when it runs
//! again for them ([`RecomputeSink`]). Either runner ([`crate::exec::task_runner`]) hands
//! its blocks to either sink.
//!
//! A block made again (a worker's retry of the task, or a recomputation) is held to the
//! block recorded at its place in the task's output by one check, [`repeats`]: the same
//! rows, and where the recorded block has a digest (a worker's blocks) the same values.
//! A task whose output changes from run to run (`random()`) fails the query naming the
//! task, instead of handing a reader rows that do not belong with the ones it already has.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};

use crate::cluster::protocol::RemoteBlockInfo;
use crate::cluster::worker_handle::RemoteBlock;
use crate::exec::metrics::OperatorStats;
use crate::exec::run::QueryRun;
use crate::exec::task_kind::TaskId;
use crate::exec::task_spec::TaskSpec;
use crate::plan::graph::OperatorId;
use crate::store::block::{Block, BlockData, BlockId, HeldBlock, OutputPlace, OutputPlaces};
use crate::store::block_digest;

/// One block a task made, as its runner hands it over.
#[derive(Debug)]
pub(super) enum MadeBlock {
    /// Made in this process: its output partition, its rows (compacted) and their bytes.
    Local {
        /// Output partition.
        tag: usize,
        /// Its rows.
        batch: RecordBatch,
        /// Bytes they take.
        bytes: u64,
    },
    /// Made and kept by a worker process.
    Held(RemoteBlock),
    /// Made by a worker process and sent back with its task's reply: what the worker said
    /// of it (its digest), and its rows, kept in this process from now on.
    Carried {
        /// The worker's word on it (no ticket).
        info: RemoteBlockInfo,
        /// Its rows.
        batch: RecordBatch,
    },
}

impl MadeBlock {
    /// Its output partition.
    fn tag(&self) -> usize {
        match self {
            MadeBlock::Local { tag, .. } => *tag,
            MadeBlock::Held(held) => held.info.tag,
            MadeBlock::Carried { info, .. } => info.tag,
        }
    }

    /// `(rows, digest)` to hold against a recorded block's: a local block's digest is
    /// taken only where the recorded block has one (digests cost a pass over the rows).
    fn rows_and_digest(&self, recorded_digest: Option<u64>) -> (usize, Option<u64>) {
        match self {
            MadeBlock::Local { batch, .. } => (
                batch.num_rows(),
                recorded_digest.and_then(|_| block_digest::digest(batch)),
            ),
            MadeBlock::Held(held) => (held.info.rows, held.info.digest),
            MadeBlock::Carried { info, .. } => (info.rows, info.digest),
        }
    }

    /// Drop it (a worker's copy is released).
    fn release(self) {
        if let MadeBlock::Held(held) = self {
            held.release();
        }
    }
}

/// `Ok` when `again`, made at `place` of the task `describe` names, repeats the block
/// recorded there (`(rows, digest)`); else the query's error, naming the task and how the
/// block differs. The one determinism check of retries and recomputes.
fn repeats(
    describe: &str,
    place: OutputPlace,
    recorded: (usize, Option<u64>),
    again: (usize, Option<u64>),
) -> Result<()> {
    match block_digest::differs(recorded, again) {
        None => Ok(()),
        Some(how) => Err(DataFusionError::Execution(format!(
            "{describe}: its block {} of output partition {} came out again with {how}: the \
             task's output is not deterministic",
            place.nth, place.tag
        ))),
    }
}

/// Takes a running task's blocks, in the order it makes them.
pub(super) trait TaskSink: Send {
    /// Whether this is the task's first run: it records what it reads (so its inputs can
    /// be released) and pauses when it is ahead of its readers. A run again for lost blocks
    /// does neither.
    fn first_run(&self) -> bool;

    /// A new attempt of the task starts (a worker's retry): its blocks come from the first
    /// again.
    fn restart(&mut self);

    /// Take the task's next block.
    fn take(&mut self, block: MadeBlock) -> Result<()>;

    /// The blocks of one input batch have been taken: wake the run's readers.
    fn taken(&mut self) {}
}

/// A task's first run: each block goes to the store (or stays in its worker) and into the
/// run's lineage. A worker's retry repeats the blocks already taken, each output
/// partition's in the same order, but may interleave the partitions differently
/// ([`OutputPlace`]): a block is new when its partition has not had that many yet, and a
/// repeat must be the block taken at its place.
pub(super) struct StoreSink {
    run: Arc<QueryRun>,
    task: TaskId,
    operator: OperatorId,
    describe: String,
    /// Blocks put so far: the next one's `seq`.
    kept: usize,
    /// `(rows, digest)` of each block taken, by place.
    taken: HashMap<OutputPlace, (usize, Option<u64>)>,
    /// The current attempt's places.
    places: OutputPlaces,
}

impl StoreSink {
    /// The sink of `spec`'s first run.
    pub(super) fn new(run: &Arc<QueryRun>, spec: &TaskSpec) -> Self {
        Self {
            run: Arc::clone(run),
            task: spec.task,
            operator: spec.operator,
            describe: spec.describe.clone(),
            kept: 0,
            taken: HashMap::new(),
            places: OutputPlaces::default(),
        }
    }
}

impl TaskSink for StoreSink {
    fn first_run(&self) -> bool {
        true
    }

    fn restart(&mut self) {
        self.places = OutputPlaces::default();
    }

    fn take(&mut self, made: MadeBlock) -> Result<()> {
        let place = self.places.next(made.tag());
        if let Some(&recorded) = self.taken.get(&place) {
            let again = made.rows_and_digest(recorded.1);
            made.release();
            return repeats(&self.describe, place, recorded, again);
        }
        // Only a worker's task is tried again: a local task's blocks need no record.
        if !matches!(made, MadeBlock::Local { .. }) {
            self.taken.insert(place, made.rows_and_digest(None));
        }
        let (tag, rows, bytes, digest, data) = match made {
            MadeBlock::Local { tag, batch, bytes } => {
                (tag, batch.num_rows(), bytes, None, BlockData::Local(batch))
            }
            MadeBlock::Held(held) => (
                held.info.tag,
                held.info.rows,
                held.info.bytes,
                held.info.digest,
                BlockData::Held(Arc::new(held)),
            ),
            MadeBlock::Carried { info, batch } => {
                // The bytes its rows reach, as a fetched block's are counted.
                let stats = self.run.stats(self.operator);
                let bytes = crate::store::rows_bytes(&batch);
                OperatorStats::add(&stats.output_bytes_carried, bytes);
                (
                    info.tag,
                    info.rows,
                    info.bytes,
                    info.digest,
                    BlockData::Local(batch),
                )
            }
        };
        let block = Block {
            id: self.run.new_block_id(),
            operator: self.operator,
            task: self.task,
            seq: self.kept,
            tag,
            rows,
            bytes,
            digest,
        };
        self.kept += 1;
        self.run.put_block(block, data)
    }

    fn taken(&mut self) {
        self.run.changed();
    }
}

/// A task run again for blocks of it that were lost: each block made again whose recorded
/// block is wanted (the one a reader asked for, or one no longer held anywhere) must repeat
/// it ([`repeats`]) and takes its place (a worker's block is re-homed on the worker that
/// made it again, a local one goes back to the store to be read once); the others are
/// dropped.
pub(super) struct RecomputeSink {
    run: Arc<QueryRun>,
    describe: String,
    /// The task's recorded blocks, by place.
    recorded: HashMap<OutputPlace, Block>,
    /// The block a reader asked for, if any: its rows go back to that reader.
    asked: Option<BlockId>,
    /// The current attempt's places.
    places: OutputPlaces,
    /// The asked-for block's rows, once made here.
    asked_rows: Option<RecordBatch>,
    /// Whether a block made again differed from its recorded one.
    diverged: bool,
}

impl RecomputeSink {
    /// The sink of a run of `spec` again, for block `asked` (if a reader asked for one) and
    /// every block of the task no longer held.
    pub(super) fn new(run: &Arc<QueryRun>, spec: &TaskSpec, asked: Option<BlockId>) -> Self {
        Self {
            run: Arc::clone(run),
            describe: format!("recomputing {}", spec.describe),
            recorded: OutputPlaces::of(run.task_outputs(spec.task))
                .into_iter()
                .collect(),
            asked,
            places: OutputPlaces::default(),
            asked_rows: None,
            diverged: false,
        }
    }

    /// "recomputing task T (partition P) of flumen operator O (name)".
    pub(super) fn describe(&self) -> &str {
        &self.describe
    }

    /// Whether a block made again differed from its recorded one (the run's error said
    /// so): the task is not deterministic, and running it once more would not help.
    pub(super) fn diverged(&self) -> bool {
        self.diverged
    }

    /// Whether the run has put back every block it was run for (the asked-for block's rows
    /// when made here are in [`Self::asked_rows`]).
    pub(super) fn lost_ones_back(&self) -> bool {
        let lost = self.run.workers.lost_blocks.lock().unwrap();
        self.recorded.values().all(|b| !lost.contains(&b.id))
    }

    /// The asked-for block's rows, when this process made them again.
    pub(super) fn asked_rows(&mut self) -> Option<RecordBatch> {
        self.asked_rows.take()
    }

    /// Whether recorded block `block` is wanted back, made again as `made`: asked for,
    /// lost with its worker, or (made here) gone from the store, where a reader may still
    /// ask for it. A worker's copy of a block not lost would only be held until the query
    /// ends.
    fn wanted(&self, block: &Block, made: &MadeBlock) -> bool {
        Some(block.id) == self.asked
            || self
                .run
                .workers
                .lost_blocks
                .lock()
                .unwrap()
                .contains(&block.id)
            || (!matches!(made, MadeBlock::Held(_)) && !self.run.store.is_available(block.id))
    }
}

impl TaskSink for RecomputeSink {
    fn first_run(&self) -> bool {
        false
    }

    fn restart(&mut self) {
        self.places = OutputPlaces::default();
    }

    fn take(&mut self, made: MadeBlock) -> Result<()> {
        let place = self.places.next(made.tag());
        let Some(recorded) = self.recorded.get(&place).filter(|b| self.wanted(b, &made)) else {
            made.release();
            return Ok(());
        };
        let again = made.rows_and_digest(recorded.digest);
        if let Err(e) = repeats(
            &self.describe,
            place,
            (recorded.rows, recorded.digest),
            again,
        ) {
            made.release();
            self.diverged = true;
            return Err(e);
        }
        let recorded = recorded.clone();
        self.run
            .workers
            .lost_blocks
            .lock()
            .unwrap()
            .remove(&recorded.id);
        match made {
            MadeBlock::Local { batch, .. } | MadeBlock::Carried { batch, .. }
                if Some(recorded.id) == self.asked =>
            {
                self.asked_rows = Some(batch);
            }
            MadeBlock::Local { batch, .. } | MadeBlock::Carried { batch, .. } => {
                self.run.store.remove(recorded.id);
                self.run.restore(&recorded, batch)?;
            }
            MadeBlock::Held(held) => {
                self.run
                    .store
                    .put_held(recorded.id, Arc::new(held), recorded.bytes);
            }
        }
        Ok(())
    }
}
