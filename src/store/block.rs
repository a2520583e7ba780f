//! A block: the unit of data between operators, one Arrow batch, and what the run records
//! of it (its producer task and place in that task's output, for lineage).

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;

/// Identifier of a block, unique within one query run.
pub type BlockId = u64;

/// One block a task produced.
#[derive(Debug, Clone)]
pub struct Block {
    /// Its id within the run.
    pub id: BlockId,
    /// The operator that produced it (its `crate::plan::OperatorId`: the store stands
    /// below the plan and names operators by their index alone, as it names tasks).
    pub operator: usize,
    /// The task that produced it (its index in the run).
    pub task: usize,
    /// Its position in that task's output. Another run of the task may interleave its
    /// output partitions differently: [`OutputPlace`] names the same rows in every run.
    pub seq: usize,
    /// The output partition it belongs to (its consumer's input partition).
    pub tag: usize,
    /// Rows in it.
    pub rows: usize,
    /// Bytes it takes where it lives (0 once lost).
    pub bytes: u64,
    /// Its rows' digest ([`crate::store::block_digest`]), when taken (a worker's blocks): a
    /// recomputation of it must give the same.
    pub digest: Option<u64>,
}

/// Where a block sits in its task's output, the same in every run of the task: its output
/// partition and its place among that partition's blocks. A task cuts each output partition
/// into blocks on its own, so a partition's blocks repeat from run to run; but which
/// partition's block comes next depends on the batches its input came in (a worker and this
/// process may read a split in batches of different sizes), so a block's `seq` in one run may
/// be another partition's block in the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OutputPlace {
    /// The output partition (the block's `tag`).
    pub tag: usize,
    /// How many blocks of that partition came before it in the task's output.
    pub nth: usize,
}

/// Counts a task's output blocks, taken in output order, into their [`OutputPlace`]s.
#[derive(Debug, Default)]
pub struct OutputPlaces(HashMap<usize, usize>);

impl OutputPlaces {
    /// The place of the task's next output block, one of partition `tag`.
    pub fn next(&mut self, tag: usize) -> OutputPlace {
        let count = self.0.entry(tag).or_default();
        let place = OutputPlace { tag, nth: *count };
        *count += 1;
        place
    }

    /// The places of `blocks`, all of one task (in any order), each with its block.
    pub fn of(mut blocks: Vec<Block>) -> Vec<(OutputPlace, Block)> {
        blocks.sort_by_key(|b| b.seq);
        let mut places = OutputPlaces::default();
        blocks
            .into_iter()
            .map(|b| (places.next(b.tag), b))
            .collect()
    }
}

/// A block's data as a task hands it over: here, or kept by the worker process that made it.
#[derive(Debug)]
pub enum BlockData {
    /// In this process.
    Local(RecordBatch),
    /// In a worker process.
    Held(Arc<dyn HeldBlock>),
}

/// The driver's handle on a block kept by a worker process (implemented by the cluster's
/// worker pool, so that the store needs to know nothing of workers).
#[async_trait::async_trait]
pub trait HeldBlock: Debug + Send + Sync {
    /// The process id of the worker that holds it (on its host).
    fn holder_pid(&self) -> u32;
    /// The driver's number for the worker that holds it (its attachment: unique across
    /// hosts and restarts).
    fn holder_id(&self) -> u64;
    /// Whether that worker is believed alive.
    fn holder_alive(&self) -> bool;
    /// Its data; `None` when it was lost with its worker. The worker then drops it.
    async fn fetch(&self) -> Result<Option<RecordBatch>>;
    /// Its data, left with its worker for its other readers (tasks there hold tickets for
    /// it); `None` when it was lost with its worker.
    async fn read(&self) -> Result<Option<RecordBatch>>;
    /// Tell the worker the block is no longer needed.
    fn release(&self);
    /// Where another worker can fetch it directly.
    fn location(&self) -> HeldAt;
}

/// Where a held block lives, for a worker to fetch it without the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldAt {
    /// The holding worker's `host:port`.
    pub address: String,
    /// Whether that worker speaks TLS.
    pub tls: bool,
    /// The block's key there.
    pub key: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(id: BlockId, seq: usize, tag: usize) -> Block {
        Block {
            id,
            operator: 0,
            task: 0,
            seq,
            tag,
            rows: 1,
            bytes: 1,
            digest: None,
        }
    }

    /// Two runs of a task that interleave its partitions differently give each block the
    /// same place: its partition's blocks counted in output order.
    #[test]
    fn places_do_not_depend_on_how_partitions_interleave() {
        let first = [
            block(10, 0, 5),
            block(11, 1, 0),
            block(12, 2, 5),
            block(13, 3, 0),
        ];
        let mut again = OutputPlaces::default();
        let second: Vec<OutputPlace> = [0, 0, 5, 5].map(|tag| again.next(tag)).to_vec();
        // Given out of order: placed by `seq`.
        let placed = OutputPlaces::of(vec![
            first[3].clone(),
            first[0].clone(),
            first[2].clone(),
            first[1].clone(),
        ]);
        let by_id: HashMap<BlockId, OutputPlace> =
            placed.iter().map(|(place, b)| (b.id, *place)).collect();
        assert_eq!(by_id[&10], OutputPlace { tag: 5, nth: 0 });
        assert_eq!(by_id[&12], OutputPlace { tag: 5, nth: 1 });
        assert_eq!(by_id[&11], second[0]);
        assert_eq!(by_id[&13], second[1]);
        assert_eq!(by_id[&10], second[2]);
        assert_eq!(by_id[&12], second[3]);
    }
}
