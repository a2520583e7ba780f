//! The block cutter: the one way a task's output becomes blocks, in local tasks, in worker
//! processes and when a lost block is recomputed, so that block `i` of a task is the same
//! whichever ran it.
//!
//! Output batches are split by output partition when the operator feeds an exchange (as
//! DataFusion's `RepartitionExec` would), each partition's rows coalesced to the target
//! size, smaller over many partitions ([`split_block_rows`]); a sliver per input batch
//! would keep every buffer of its input alive and make readers copy its strings again.
//! Otherwise batches are sliced to the target size.

use std::sync::Arc;

use datafusion::arrow::compute::BatchCoalescer;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;
use datafusion::physical_plan::Partitioning;
use datafusion::physical_plan::metrics::Time;
use datafusion::physical_plan::repartition::BatchPartitioner;
use serde::{Deserialize, Serialize};

use crate::store::ramp::ramp_rows;
use crate::store::range_split::RangeSplitter;

/// How a task's output is split over output partitions.
enum Splitter {
    /// A range split, in arrow's row format ([`RangeSplitter`]).
    Range(RangeSplitter),
    /// A hash or round-robin split, by DataFusion's partitioner.
    DataFusion(BatchPartitioner),
}

impl Splitter {
    fn try_new(
        split: &Partitioning,
        schema: &SchemaRef,
        partition: usize,
        partitions: usize,
    ) -> Result<Self> {
        Ok(match split {
            Partitioning::Range(ranges) => Splitter::Range(RangeSplitter::try_new(ranges, schema)?),
            _ => Splitter::DataFusion(BatchPartitioner::try_new(
                split.clone(),
                Time::new(),
                partition,
                partitions,
            )?),
        })
    }

    /// `batch`'s rows as `(output partition, rows)` pieces.
    fn pieces(&mut self, batch: RecordBatch) -> Result<Vec<(usize, RecordBatch)>> {
        match self {
            Splitter::Range(ranges) => ranges.split(&batch),
            Splitter::DataFusion(partitioner) => partitioner.partition_iter(batch)?.collect(),
        }
    }
}

/// Cuts one task's output into `(tag, block)` pairs of at most the target rows.
pub struct BlockCutter {
    /// The task's output schema.
    schema: SchemaRef,
    target: usize,
    /// The task's own partition: the tag of every block when there is no split.
    partition: usize,
    split: Option<(Splitter, Vec<BatchCoalescer>)>,
    /// A ramp of each output partition's first blocks ([`Self::with_ramp`]).
    ramp: Option<Ramp>,
}

/// The first blocks of each output partition, cut early at `first_rows`, twice that, ...
/// up to `last_rows`, or the usual block size (`crate::store::ramp`).
struct Ramp {
    first_rows: usize,
    /// Rows the ramp's blocks grow to, and every later block of the task is cut at.
    last_rows: usize,
    /// Blocks each output partition has emitted so far.
    emitted: Vec<usize>,
    /// Without a split: the one partition's partly filled block (small input batches are
    /// coalesced back up to the target once the ramp has passed).
    whole: Option<BatchCoalescer>,
}

impl BlockCutter {
    /// A cutter for a task of partition `partition` (of `partitions`) whose output has
    /// `schema`, split by `split` when given; blocks of at most `target_rows` rows.
    pub fn new(
        schema: SchemaRef,
        split: Option<&Partitioning>,
        partition: usize,
        partitions: usize,
        target_rows: usize,
    ) -> Result<Self> {
        let target = target_rows.max(1);
        let split = match split {
            Some(split) => {
                let partitioner = Splitter::try_new(split, &schema, partition, partitions)?;
                let block_rows = split_block_rows(split, target);
                let coalescers = (0..split.partition_count())
                    .map(|_| BatchCoalescer::new(Arc::clone(&schema), block_rows))
                    .collect();
                Some((partitioner, coalescers))
            }
            None => None,
        };
        Ok(Self {
            schema,
            target,
            partition,
            split,
            ramp: None,
        })
    }

    /// Cut each output partition's first blocks small: at `first_rows`, then twice as many
    /// each block, up to `last_rows` (0: the usual size), and every later block at that,
    /// coalescing smaller input batches (a run's first task, which reads small batches so
    /// that its first rows leave early); `first_rows` 0: no ramp.
    pub fn with_ramp(mut self, first_rows: usize, last_rows: usize) -> Self {
        if first_rows == 0 {
            return self;
        }
        let last_rows = match last_rows {
            0 => self.target,
            rows => rows.max(first_rows).min(self.target),
        };
        self.ramp = Some(match &self.split {
            Some((_, coalescers)) => Ramp {
                first_rows,
                last_rows,
                emitted: vec![0; coalescers.len()],
                whole: None,
            },
            None => Ramp {
                first_rows,
                last_rows,
                emitted: vec![0],
                whole: Some(BatchCoalescer::new(Arc::clone(&self.schema), self.target)),
            },
        });
        self
    }

    /// Cut `batch`, appending the blocks it completes to `out`.
    pub fn push(&mut self, batch: RecordBatch, out: &mut Vec<(usize, RecordBatch)>) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        match &mut self.split {
            Some((partitioner, coalescers)) => {
                for (tag, piece) in partitioner.pieces(batch)? {
                    let ramp = self
                        .ramp
                        .as_mut()
                        .map(|r| ((r.first_rows, r.last_rows), &mut r.emitted[tag]));
                    push_ramped(&mut coalescers[tag], piece, tag, ramp, out)?;
                }
            }
            None if self.ramp.is_some() => {
                let ramp = self.ramp.as_mut().expect("checked");
                let whole = ramp.whole.as_mut().expect("a ramp without a split has one");
                let emitted = Some(((ramp.first_rows, ramp.last_rows), &mut ramp.emitted[0]));
                push_ramped(whole, batch, self.partition, emitted, out)?;
            }
            None => {
                let mut offset = 0;
                while offset < batch.num_rows() {
                    let len = self.target.min(batch.num_rows() - offset);
                    out.push((self.partition, batch.slice(offset, len)));
                    offset += len;
                }
            }
        }
        Ok(())
    }

    /// The output has ended: append the partly filled blocks to `out`.
    pub fn finish(&mut self, out: &mut Vec<(usize, RecordBatch)>) -> Result<()> {
        if let Some((_, coalescers)) = &mut self.split {
            for (tag, coalescer) in coalescers.iter_mut().enumerate() {
                coalescer.finish_buffered_batch()?;
                while let Some(block) = coalescer.next_completed_batch() {
                    out.push((tag, block));
                }
            }
        }
        if let Some(whole) = self.ramp.as_mut().and_then(|r| r.whole.as_mut()) {
            whole.finish_buffered_batch()?;
            while let Some(block) = whole.next_completed_batch() {
                out.push((self.partition, block));
            }
        }
        Ok(())
    }
}

/// Push `piece` into one partition's `coalescer` and append the blocks it completes to
/// `out` as partition `tag`'s; with `ramp` (`(first_rows, last_rows)`, blocks emitted so
/// far), cut the partly filled block early once it holds its ramp step's rows.
fn push_ramped(
    coalescer: &mut BatchCoalescer,
    piece: RecordBatch,
    tag: usize,
    mut ramp: Option<((usize, usize), &mut usize)>,
    out: &mut Vec<(usize, RecordBatch)>,
) -> Result<()> {
    coalescer.push_batch(piece)?;
    if let Some(((first_rows, last_rows), emitted)) = &ramp
        && coalescer.get_buffered_rows() >= ramp_rows(*first_rows, *last_rows, **emitted)
    {
        coalescer.finish_buffered_batch()?;
    }
    while let Some(block) = coalescer.next_completed_batch() {
        if let Some((_, emitted)) = ramp.as_mut() {
            **emitted += 1;
        }
        out.push((tag, block));
    }
    Ok(())
}

/// Blocks' worth of rows a task splitting its output by hash or range holds in its partly
/// filled blocks together, whatever the number of partitions.
const SPLIT_BUFFER_BLOCKS: usize = 8;
/// Fewest rows a split's blocks are cut to (unless the target is smaller).
const MIN_SPLIT_BLOCK_ROWS: usize = 512;

/// Rows of one block of a split: a hash or range split scatters every batch over all its
/// partitions, each filling a block of its own, so with many partitions (out of core: one
/// per share of the budget) blocks are made smaller, keeping what a map task holds unflushed
/// to [`SPLIT_BUFFER_BLOCKS`] blocks of `target` rows. A round-robin split sends whole
/// batches and keeps the target.
fn split_block_rows(split: &Partitioning, target: usize) -> usize {
    match split {
        Partitioning::Hash(_, n) => (target * SPLIT_BUFFER_BLOCKS / (*n).max(1))
            .clamp(MIN_SPLIT_BLOCK_ROWS.min(target), target),
        Partitioning::Range(ranges) => (target * SPLIT_BUFFER_BLOCKS
            / ranges.partition_count().max(1))
        .clamp(MIN_SPLIT_BLOCK_ROWS.min(target), target),
        _ => target,
    }
}

/// How the input blocks a task's fragment reads are cut into the pieces (batches) it is
/// handed, the same wherever the task runs: a piece's rows and its boundaries decide the
/// fragment's output batches, and so the blocks a task writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum PieceCut {
    /// Every piece has the target rows but the last, as if the blocks were one batch; a
    /// piece that spans blocks is a copy of its rows. For a model's forward passes, which
    /// are best full.
    Exact,
    /// A block of at least half the target is handed as it is (sliced where it is larger
    /// than the target); only smaller blocks are gathered, up to the target, into one copy.
    /// For CPU operators: a join's probe side of full blocks is read without copying it
    /// (a hash exchange's blocks are full but for each map task's last, and an exact cut
    /// after that last one copied every piece that followed).
    #[default]
    KeepLargeBlocks,
}

/// `batch` in slices of at most `rows` rows, none of them a copy (`0`: whole). How a CPU
/// task hands its fragment an input block larger than the session's
/// `datafusion.execution.batch_size`, as DataFusion's own streams would hand it: blocks are
/// `flumen.target_block_rows` rows, and an operator that holds state per batch (an ordered
/// aggregate emits its finished groups once a batch) holds a block's worth otherwise.
pub fn batch_slices(batch: RecordBatch, rows: usize) -> Vec<RecordBatch> {
    let total = batch.num_rows();
    if rows == 0 || total <= rows {
        return vec![batch];
    }
    (0..total)
        .step_by(rows)
        .map(|at| batch.slice(at, rows.min(total - at)))
        .collect()
}

/// A bundle of input blocks as a task's fragment reads it, wherever the task runs: in
/// pieces of at most `target_rows` rows, cut as `cut` says. A piece within one block is a
/// slice of it; only a piece that spans blocks is copied. (Concatenating the whole bundle
/// first copied it, ~10 MB of text for a model's bundle, 2–3 ms before its first batch
/// could start.)
pub fn bundle_pieces(
    schema: &SchemaRef,
    blocks: Vec<RecordBatch>,
    target_rows: usize,
    cut: PieceCut,
) -> Result<Vec<RecordBatch>> {
    let mut cutter = PieceCutter::new(schema, target_rows, cut);
    let mut pieces = vec![];
    for block in blocks {
        pieces.extend(cutter.push(block)?);
    }
    pieces.extend(cutter.finish()?);
    Ok(pieces)
}

/// [`bundle_pieces`] one block at a time: a worker's task reads its input blocks as they
/// are fetched, cut into the same pieces.
#[derive(Debug)]
pub struct PieceCutter {
    schema: SchemaRef,
    target: usize,
    cut: PieceCut,
    /// Slices of the piece being made, and their rows.
    parts: Vec<RecordBatch>,
    rows: usize,
}

impl PieceCutter {
    /// A cutter into pieces of at most `target_rows` rows of `schema`, cut as `cut` says.
    pub fn new(schema: &SchemaRef, target_rows: usize, cut: PieceCut) -> Self {
        Self {
            schema: Arc::clone(schema),
            target: target_rows.max(1),
            cut,
            parts: vec![],
            rows: 0,
        }
    }

    /// The pieces `block` completes.
    pub fn push(&mut self, block: RecordBatch) -> Result<Vec<RecordBatch>> {
        match self.cut {
            PieceCut::Exact => self.push_exact(block),
            PieceCut::KeepLargeBlocks => self.push_keeping_large_blocks(block),
        }
    }

    /// [`PieceCut::Exact`]: fill the piece being made to the target, across blocks.
    fn push_exact(&mut self, block: RecordBatch) -> Result<Vec<RecordBatch>> {
        let mut pieces = vec![];
        let mut at = 0;
        while at < block.num_rows() {
            let take = (self.target - self.rows).min(block.num_rows() - at);
            self.parts.push(block.slice(at, take));
            (self.rows, at) = (self.rows + take, at + take);
            if self.rows == self.target {
                pieces.push(one_piece(&self.schema, std::mem::take(&mut self.parts))?);
                self.rows = 0;
            }
        }
        Ok(pieces)
    }

    /// [`PieceCut::KeepLargeBlocks`]: a large block ends the piece being made and is handed
    /// in slices of the target; a small one joins the piece being made, which is handed
    /// first if the block would take it past the target.
    fn push_keeping_large_blocks(&mut self, block: RecordBatch) -> Result<Vec<RecordBatch>> {
        let rows = block.num_rows();
        if rows == 0 {
            return Ok(vec![]);
        }
        let mut pieces = vec![];
        if rows * 2 >= self.target {
            pieces.extend(self.finish()?);
            let mut at = 0;
            while at < rows {
                let take = self.target.min(rows - at);
                pieces.push(block.slice(at, take));
                at += take;
            }
            return Ok(pieces);
        }
        if self.rows + rows > self.target {
            pieces.extend(self.finish()?);
        }
        self.parts.push(block);
        self.rows += rows;
        Ok(pieces)
    }

    /// The last, smaller piece, if rows are left.
    pub fn finish(&mut self) -> Result<Option<RecordBatch>> {
        if self.rows == 0 {
            return Ok(None);
        }
        self.rows = 0;
        one_piece(&self.schema, std::mem::take(&mut self.parts)).map(Some)
    }
}

/// The slices of one piece as one batch.
fn one_piece(schema: &SchemaRef, mut parts: Vec<RecordBatch>) -> Result<RecordBatch> {
    match parts.len() {
        1 => Ok(parts.pop().expect("one part")),
        _ => Ok(datafusion::arrow::compute::concat_batches(schema, &parts)?),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{Array, Int64Array};
    use datafusion::physical_plan::expressions::col;

    use super::*;

    fn batch(from: i64, n: i64) -> RecordBatch {
        RecordBatch::try_from_iter([(
            "x",
            Arc::new(Int64Array::from_iter_values(from..from + n)) as _,
        )])
        .unwrap()
    }

    /// Rows of each block of output partition `tag`, in order.
    fn tag_rows(blocks: &[(usize, RecordBatch)], tag: usize) -> Vec<usize> {
        blocks
            .iter()
            .filter(|(t, _)| *t == tag)
            .map(|(_, b)| b.num_rows())
            .collect()
    }

    /// The ids of `pieces`, in order.
    fn values(pieces: &[RecordBatch]) -> Vec<i64> {
        pieces
            .iter()
            .flat_map(|p| {
                let column = p.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                column.values().to_vec()
            })
            .collect()
    }

    fn rows(blocks: &[(usize, RecordBatch)]) -> Vec<usize> {
        blocks.iter().map(|(_, b)| b.num_rows()).collect()
    }

    #[test]
    fn a_bundle_is_cut_to_the_target_across_its_blocks() {
        let schema = batch(0, 1).schema();
        let blocks = vec![batch(0, 9), batch(9, 0), batch(9, 6)];
        let first = blocks[0].column(0).to_data().buffers()[0].as_ptr();
        let pieces = bundle_pieces(&schema, blocks, 4, PieceCut::Exact).unwrap();
        assert_eq!(
            pieces.iter().map(|b| b.num_rows()).collect::<Vec<_>>(),
            vec![4, 4, 4, 3]
        );
        let values = values(&pieces);
        assert_eq!(values, (0..15).collect::<Vec<_>>());
        // A piece within one block is a slice of it, not a copy.
        assert_eq!(pieces[0].column(0).to_data().buffers()[0].as_ptr(), first);
        assert!(
            bundle_pieces(&schema, vec![batch(0, 0)], 4, PieceCut::Exact)
                .unwrap()
                .is_empty()
        );
    }

    /// Each piece's rows, and whether it is a slice of a block's own buffer (not a copy).
    fn piece_rows_and_slices(pieces: &[RecordBatch], blocks: &[RecordBatch]) -> Vec<(usize, bool)> {
        let buffers: Vec<_> = blocks
            .iter()
            .map(|b| b.column(0).to_data().buffers()[0].clone())
            .collect();
        pieces
            .iter()
            .map(|p| {
                let at = p.column(0).to_data().buffers()[0].as_ptr();
                let sliced = buffers.iter().any(|b| {
                    let range = b.as_ptr() as usize..b.as_ptr() as usize + b.len();
                    range.contains(&(at as usize))
                });
                (p.num_rows(), sliced)
            })
            .collect()
    }

    #[test]
    fn keeping_large_blocks_copies_only_small_ones_and_never_passes_the_target() {
        let schema = batch(0, 1).schema();
        // A full block, a map task's last (small), full blocks, two small ones, one larger
        // than the target, and a last small one.
        let sizes = [8, 3, 8, 5, 2, 2, 11, 1];
        let mut blocks = vec![];
        let mut from = 0;
        for n in sizes {
            blocks.push(batch(from, n));
            from += n;
        }
        let pieces = bundle_pieces(&schema, blocks.clone(), 8, PieceCut::KeepLargeBlocks).unwrap();
        assert_eq!(
            piece_rows_and_slices(&pieces, &blocks),
            vec![
                (8, true), // the full block as it is
                (3, true), // a small block alone: the next is large
                (8, true),
                (5, true),  // at least half the target: kept
                (4, false), // two small blocks gathered into one copy
                (8, true),  // a larger block in slices of the target
                (3, true),
                (1, true),
            ]
        );
        let values = values(&pieces);
        assert_eq!(
            values,
            (0..from).collect::<Vec<_>>(),
            "every row once, in order"
        );
        // Small blocks are gathered up to the target, never past it.
        let small: Vec<_> = (0..7).map(|i| batch(i * 3, 3)).collect();
        let pieces = bundle_pieces(&schema, small, 8, PieceCut::KeepLargeBlocks).unwrap();
        assert_eq!(
            pieces.iter().map(|p| p.num_rows()).collect::<Vec<_>>(),
            vec![6, 6, 6, 3]
        );
        // Cut one block at a time, the pieces are the same.
        let mut cutter = PieceCutter::new(&schema, 8, PieceCut::KeepLargeBlocks);
        let mut one_at_a_time = vec![];
        for block in blocks {
            one_at_a_time.extend(cutter.push(block).unwrap());
        }
        one_at_a_time.extend(cutter.finish().unwrap());
        assert_eq!(
            one_at_a_time
                .iter()
                .map(|p| p.num_rows())
                .collect::<Vec<_>>(),
            vec![8, 3, 8, 5, 4, 8, 3, 1]
        );
    }

    #[test]
    fn without_a_split_batches_are_sliced_to_the_target() {
        let mut cutter = BlockCutter::new(batch(0, 1).schema(), None, 3, 4, 4).unwrap();
        let mut out = vec![];
        cutter.push(batch(0, 10), &mut out).unwrap();
        cutter.push(batch(10, 2), &mut out).unwrap();
        cutter.finish(&mut out).unwrap();
        assert_eq!(rows(&out), vec![4, 4, 2, 2]);
        assert!(out.iter().all(|(tag, _)| *tag == 3));
    }

    #[test]
    fn a_split_coalesces_each_partition_to_the_target() {
        let schema = batch(0, 1).schema();
        let split = Partitioning::Hash(vec![col("x", &schema).unwrap()], 2);
        let mut cutter = BlockCutter::new(Arc::clone(&schema), Some(&split), 0, 1, 8).unwrap();
        let mut out = vec![];
        for i in 0..10 {
            cutter.push(batch(i * 3, 3), &mut out).unwrap();
        }
        cutter.finish(&mut out).unwrap();
        let total: usize = rows(&out).iter().sum();
        assert_eq!(total, 30);
        for tag in 0..2 {
            let sizes = tag_rows(&out, tag);
            // Every block but each partition's last is full.
            assert!(
                sizes[..sizes.len() - 1].iter().all(|n| *n == 8),
                "{sizes:?}"
            );
        }
        // The same rows in the same order cut the same way again (lineage relies on it).
        let mut again = vec![];
        let mut cutter = BlockCutter::new(schema, Some(&split), 0, 1, 8).unwrap();
        for i in 0..10 {
            cutter.push(batch(i * 3, 3), &mut again).unwrap();
        }
        cutter.finish(&mut again).unwrap();
        assert_eq!(out, again);
        assert!(out.iter().all(|(_, b)| b.column(0).null_count() == 0));
    }

    #[test]
    fn a_split_over_many_partitions_cuts_smaller_blocks() {
        let schema = batch(0, 1).schema();
        let split = Partitioning::Hash(vec![col("x", &schema).unwrap()], 64);
        let mut cutter = BlockCutter::new(Arc::clone(&schema), Some(&split), 0, 1, 8192).unwrap();
        let mut out = vec![];
        cutter.push(batch(0, 200_000), &mut out).unwrap();
        // 8 blocks of 8192 rows over 64 partitions: blocks of 1024 rows.
        assert!(!out.is_empty());
        assert!(out.iter().all(|(_, b)| b.num_rows() == 1024));
        // Few partitions keep the target.
        assert_eq!(split_block_rows(&Partitioning::Hash(vec![], 4), 8192), 8192);
        assert_eq!(
            split_block_rows(&Partitioning::Hash(vec![], 4096), 8192),
            512
        );
        assert_eq!(
            split_block_rows(&Partitioning::RoundRobinBatch(64), 8192),
            8192
        );
    }

    #[test]
    fn a_ramped_split_cuts_each_partitions_first_blocks_small() {
        let schema = batch(0, 1).schema();
        let split = Partitioning::RoundRobinBatch(2);
        let cut = || {
            let mut cutter = BlockCutter::new(Arc::clone(&schema), Some(&split), 0, 1, 256)
                .unwrap()
                .with_ramp(16, 0);
            let mut out = vec![];
            for i in 0..40 {
                cutter.push(batch(i * 16, 16), &mut out).unwrap();
            }
            cutter.finish(&mut out).unwrap();
            out
        };
        let out = cut();
        assert_eq!(out.iter().map(|(_, b)| b.num_rows()).sum::<usize>(), 640);
        for tag in 0..2 {
            let sizes = tag_rows(&out, tag);
            // 16, 32, 64, 128, then blocks of the target (256) and what is left.
            assert_eq!(sizes[..4], [16, 32, 64, 128], "{sizes:?}");
            assert!(sizes.iter().all(|&rows| rows <= 256), "{sizes:?}");
        }
        // The same rows cut the same blocks (lineage).
        assert_eq!(out, cut());
    }

    #[test]
    fn a_ramped_task_without_a_split_coalesces_its_small_batches_up_to_the_target() {
        let schema = batch(0, 1).schema();
        let mut cutter = BlockCutter::new(Arc::clone(&schema), None, 1, 2, 256)
            .unwrap()
            .with_ramp(16, 0);
        let mut out = vec![];
        for i in 0..40 {
            cutter.push(batch(i * 16, 16), &mut out).unwrap();
        }
        cutter.finish(&mut out).unwrap();
        let sizes: Vec<usize> = out.iter().map(|(_, b)| b.num_rows()).collect();
        assert_eq!(sizes, vec![16, 32, 64, 128, 256, 144], "{sizes:?}");
        assert!(out.iter().all(|(tag, _)| *tag == 1));
    }

    #[test]
    fn a_ramp_with_a_last_size_cuts_the_rest_of_its_task_at_that_size() {
        let schema = batch(0, 1).schema();
        let mut cutter = BlockCutter::new(Arc::clone(&schema), None, 0, 1, 256)
            .unwrap()
            .with_ramp(16, 64);
        let mut out = vec![];
        for i in 0..20 {
            cutter.push(batch(i * 16, 16), &mut out).unwrap();
        }
        cutter.finish(&mut out).unwrap();
        let sizes: Vec<usize> = out.iter().map(|(_, b)| b.num_rows()).collect();
        // 16, 32, then the model's piece (64) until the task's 320 rows are cut.
        assert_eq!(sizes, vec![16, 32, 64, 64, 64, 64, 16], "{sizes:?}");
    }

    #[test]
    fn a_batch_larger_than_the_batch_size_is_handed_in_slices() {
        let rows =
            |slices: Vec<RecordBatch>| slices.iter().map(RecordBatch::num_rows).collect::<Vec<_>>();
        assert_eq!(rows(batch_slices(batch(0, 10), 4)), vec![4, 4, 2]);
        assert_eq!(rows(batch_slices(batch(0, 10), 10)), vec![10]);
        assert_eq!(rows(batch_slices(batch(0, 10), 0)), vec![10]);
        let last = batch_slices(batch(0, 10), 4).pop().unwrap();
        let values = last
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(values.values().to_vec(), vec![8, 9]);
    }
}
