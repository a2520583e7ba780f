//! Merging a partition's sorted runs in levels, as an external merge sort does, when a
//! block of every run would not fit the memory one merge may hold at once.
//!
//! A hot range of a range sort can be cut into many runs ([`crate::plan::merge_runs`]).
//! Merging them all at once holds the largest block of each; when those pass the share of
//! the budget the partition was planned for, the runs are merged in groups that fit it,
//! each group into one sorted run written to a spill file (DataFusion's IPC spill files,
//! under the session's temp directory, with its spill compression), and the level's runs
//! are merged again, until they fit one merge. No row is sorted twice: each level reads
//! and writes the range once. Intermediate runs are written in batches of a 64th of the
//! share, so a later level merges 32 or more of them at once (one level is enough for up to
//! 32 times the share of the producer's largest blocks); what their readers hold is
//! reserved from the run's memory pool. The runs are the task's own: a task that
//! fails starts again from its input blocks.

use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;
use datafusion::execution::memory_pool::MemoryReservation;
use datafusion::execution::{SendableRecordBatchStream, SpillFile, TaskContext};
use datafusion::physical_expr::LexOrdering;
use datafusion::physical_plan::EmptyRecordBatchStream;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, MetricBuilder, SpillMetrics,
};
use datafusion::physical_plan::sorts::streaming_merge::StreamingMergeBuilder;
use datafusion::physical_plan::spill::SpillManager;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{StreamExt, TryStreamExt};

use crate::plan::stage_input::SortedRun;

/// An intermediate run's batches are at most this share of the merge's memory, so a
/// level merges at least `INTERMEDIATE_BATCH_SHARE / 2` of them (each holds two batches).
const INTERMEDIATE_BATCH_SHARE: u64 = 64;

/// A run to merge: one of the producer's, or one a level wrote.
enum Run {
    /// A producer task's sorted blocks.
    Blocks(SortedRun),
    /// A run merged from others, in a spill file.
    Written {
        file: Arc<dyn SpillFile>,
        largest_batch_bytes: u64,
    },
}

impl Run {
    /// What a merge holds of this run at most: its largest block, or for a written run
    /// the batch the merge is on and the one being read.
    fn held_bytes(&self) -> u64 {
        match self {
            Run::Blocks(run) => run.largest_block_bytes,
            Run::Written {
                largest_batch_bytes,
                ..
            } => 2 * largest_batch_bytes,
        }
    }
}

/// Merges one partition's sorted runs, in as many levels as its memory needs.
pub(crate) struct LevelMerge {
    schema: SchemaRef,
    ordering: LexOrdering,
    batch_size: usize,
    merge_bytes: u64,
    spill: SpillManager,
    /// The final merge's output rows and time (the node's metrics for `partition`).
    output_metrics: BaselineMetrics,
    /// The final merge's own buffers.
    reservation: MemoryReservation,
    /// Levels merged before the final merge.
    levels: Count,
    /// Runs the levels wrote.
    runs_written: Count,
}

impl LevelMerge {
    /// A merge of partition `partition`'s runs by `ordering`, holding about `merge_bytes`,
    /// counting into `metrics` (`merge_levels`, `runs_written` and the spill counts).
    pub(crate) fn new(
        schema: SchemaRef,
        ordering: LexOrdering,
        merge_bytes: u64,
        context: &TaskContext,
        metrics: &ExecutionPlanMetricsSet,
        partition: usize,
        reservation: MemoryReservation,
    ) -> Self {
        let spill = SpillManager::new(
            context.runtime_env(),
            SpillMetrics::new(metrics, partition),
            Arc::clone(&schema),
        )
        .with_compression_type(context.session_config().spill_compression());
        Self {
            schema,
            ordering,
            batch_size: context.session_config().batch_size(),
            merge_bytes,
            spill,
            output_metrics: BaselineMetrics::new(metrics, partition),
            reservation,
            levels: MetricBuilder::new(metrics).counter("merge_levels", partition),
            runs_written: MetricBuilder::new(metrics).counter("runs_written", partition),
        }
    }

    /// The runs' rows, sorted: merged at once when a block of each fits, else in levels
    /// first (the first poll of the stream merges the levels).
    pub(crate) fn merge(self, runs: Vec<SortedRun>) -> SendableRecordBatchStream {
        let schema = Arc::clone(&self.schema);
        let runs = runs.into_iter().map(Run::Blocks).collect();
        let merged = futures::stream::once(self.merge_levels(runs)).try_flatten();
        Box::pin(RecordBatchStreamAdapter::new(schema, merged))
    }

    async fn merge_levels(self, mut runs: Vec<Run>) -> Result<SendableRecordBatchStream> {
        loop {
            let held: u64 = runs.iter().map(Run::held_bytes).sum();
            // Two runs are merged whatever they hold: no level makes them fewer.
            if held <= self.merge_bytes || runs.len() <= 2 {
                return self.final_merge(runs);
            }
            self.levels.add(1);
            let mut next = Vec::new();
            for mut group in groups(runs, Run::held_bytes, self.merge_bytes) {
                next.push(match group.len() {
                    1 => group.pop().expect("a group of one"),
                    _ => self.write_run(group).await?,
                });
            }
            runs = next;
        }
    }

    /// The runs as streams, with what their readers hold reserved while they are read.
    fn open(&self, runs: Vec<Run>) -> Result<(Vec<SendableRecordBatchStream>, MemoryReservation)> {
        let readers = self.reservation.new_empty();
        let mut streams = Vec::with_capacity(runs.len());
        for run in runs {
            streams.push(match run {
                Run::Blocks(run) => run.stream,
                Run::Written {
                    file,
                    largest_batch_bytes,
                } => {
                    readers.grow(2 * largest_batch_bytes as usize);
                    self.spill
                        .read_spill_as_stream_unbuffered(file, Some(largest_batch_bytes as usize))?
                }
            });
        }
        Ok((streams, readers))
    }

    fn merge_streams(
        &self,
        streams: Vec<SendableRecordBatchStream>,
        metrics: BaselineMetrics,
        reservation: MemoryReservation,
    ) -> Result<SendableRecordBatchStream> {
        if streams.is_empty() {
            return Ok(Box::pin(EmptyRecordBatchStream::new(Arc::clone(
                &self.schema,
            ))));
        }
        StreamingMergeBuilder::new()
            .with_streams(streams)
            .with_schema(Arc::clone(&self.schema))
            .with_expressions(&self.ordering)
            .with_metrics(metrics)
            .with_batch_size(self.batch_size)
            .with_reservation(reservation)
            .build()
    }

    /// Merge `group` into one run written to a spill file, in batches of at most a
    /// 64th of the merge's memory.
    async fn write_run(&self, group: Vec<Run>) -> Result<Run> {
        let (streams, readers) = self.open(group)?;
        // Not the node's output: the rows pass through it again in the final merge.
        let level_metrics = BaselineMetrics::new(&ExecutionPlanMetricsSet::new(), 0);
        let mut merged =
            self.merge_streams(streams, level_metrics, self.reservation.new_empty())?;
        let mut file = self.spill.create_in_progress_file("flumen merge level")?;
        let most = (self.merge_bytes / INTERMEDIATE_BATCH_SHARE).max(1);
        let mut largest_batch_bytes = 0;
        while let Some(batch) = merged.next().await {
            for piece in pieces(&batch?, most) {
                largest_batch_bytes = largest_batch_bytes.max(file.append_batch(&piece)? as u64);
            }
        }
        drop(readers);
        self.runs_written.add(1);
        match file.finish()? {
            Some(file) => Ok(Run::Written {
                file,
                largest_batch_bytes,
            }),
            // No rows: an empty run.
            None => Ok(Run::Blocks(SortedRun {
                stream: Box::pin(EmptyRecordBatchStream::new(Arc::clone(&self.schema))),
                largest_block_bytes: 0,
            })),
        }
    }

    /// The last merge, streamed out as the node's output.
    fn final_merge(&self, runs: Vec<Run>) -> Result<SendableRecordBatchStream> {
        let (streams, readers) = self.open(runs)?;
        let merged = self.merge_streams(
            streams,
            self.output_metrics.clone(),
            self.reservation.new_empty(),
        )?;
        // The readers' reservation lives as long as the stream.
        let held = merged.map(move |batch| {
            let _ = &readers;
            batch
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            held,
        )))
    }
}

/// Consecutive `items` in groups whose `held` bytes together fit `merge_bytes`, with at
/// least two a group (so every level leaves fewer runs).
fn groups<T>(items: Vec<T>, held: impl Fn(&T) -> u64, merge_bytes: u64) -> Vec<Vec<T>> {
    let mut groups: Vec<Vec<T>> = Vec::new();
    let mut group_bytes = 0;
    for item in items {
        let bytes = held(&item);
        match groups.last_mut() {
            Some(group) if group.len() < 2 || group_bytes + bytes <= merge_bytes => {
                group_bytes += bytes;
                group.push(item);
            }
            _ => {
                group_bytes = bytes;
                groups.push(vec![item]);
            }
        }
    }
    groups
}

/// `batch` cut into slices of at most `most` bytes each (at least one row a slice).
fn pieces(batch: &RecordBatch, most: u64) -> Vec<RecordBatch> {
    let bytes = batch.get_array_memory_size() as u64;
    let rows = batch.num_rows();
    let count = (bytes.div_ceil(most) as usize).clamp(1, rows.max(1));
    let per_piece = rows.div_ceil(count).max(1);
    (0..rows)
        .step_by(per_piece)
        .map(|start| batch.slice(start, per_piece.min(rows - start)))
        .collect()
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{AsArray, Int64Array};
    use datafusion::arrow::datatypes::{DataType, Field, Int64Type, Schema};
    use datafusion::execution::memory_pool::{GreedyMemoryPool, MemoryConsumer, MemoryPool};
    use datafusion::execution::runtime_env::RuntimeEnvBuilder;
    use datafusion::physical_expr::PhysicalSortExpr;
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_plan::memory::MemoryStream;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]))
    }

    /// `count` runs of `batches` sorted batches of `rows` random keys each.
    fn runs(count: usize, batches: usize, rows: usize) -> (Vec<SortedRun>, Vec<i64>) {
        let mut rng = StdRng::seed_from_u64(7);
        let mut all = Vec::new();
        let runs = (0..count)
            .map(|_| {
                let mut keys: Vec<i64> = (0..batches * rows).map(|_| rng.random()).collect();
                keys.sort_unstable();
                all.extend_from_slice(&keys);
                let blocks: Vec<RecordBatch> = keys
                    .chunks(rows)
                    .map(|c| {
                        RecordBatch::try_new(schema(), vec![Arc::new(Int64Array::from(c.to_vec()))])
                            .unwrap()
                    })
                    .collect();
                let largest = blocks
                    .iter()
                    .map(|b| b.get_array_memory_size() as u64)
                    .max()
                    .unwrap();
                let stream = MemoryStream::try_new(blocks, schema(), None).unwrap();
                SortedRun {
                    stream: Box::pin(stream),
                    largest_block_bytes: largest,
                }
            })
            .collect();
        all.sort_unstable();
        (runs, all)
    }

    async fn merged(
        runs: Vec<SortedRun>,
        merge_bytes: u64,
    ) -> (Vec<i64>, ExecutionPlanMetricsSet, Arc<dyn MemoryPool>) {
        let pool: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(64 << 20));
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::clone(&pool))
            .build_arc()
            .unwrap();
        let context = TaskContext::default().with_runtime(runtime);
        let metrics = ExecutionPlanMetricsSet::new();
        let ordering =
            LexOrdering::new([PhysicalSortExpr::new_default(col("k", &schema()).unwrap())])
                .unwrap();
        let reservation = MemoryConsumer::new("test merge").register(&pool);
        let merge = LevelMerge::new(
            schema(),
            ordering,
            merge_bytes,
            &context,
            &metrics,
            0,
            reservation,
        );
        let batches: Vec<RecordBatch> = merge.merge(runs).try_collect().await.unwrap();
        let keys = batches
            .iter()
            .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
            .collect();
        (keys, metrics, pool)
    }

    fn count(metrics: &ExecutionPlanMetricsSet, name: &str) -> usize {
        metrics
            .clone_inner()
            .sum_by_name(name)
            .map_or(0, |m| m.as_usize())
    }

    #[tokio::test]
    async fn runs_that_fit_one_merge_are_merged_at_once() {
        let (runs, expected) = runs(6, 3, 1000);
        let (keys, metrics, pool) = merged(runs, 1 << 20).await;
        assert_eq!(keys, expected);
        assert_eq!(count(&metrics, "merge_levels"), 0);
        assert_eq!(count(&metrics, "runs_written"), 0);
        assert_eq!(pool.reserved(), 0);
    }

    /// 120 runs of 4 KB blocks with a merge of three blocks: three runs to a group, so the
    /// first level writes 40 runs, in batches of a 64th of the merge; 40 of them, holding
    /// two batches each, do not fit one merge either: a second level, then the final merge.
    #[tokio::test]
    async fn runs_that_do_not_fit_one_merge_are_merged_in_levels() {
        let (runs, expected) = runs(120, 4, 500);
        let block = runs[0].largest_block_bytes;
        let (keys, metrics, pool) = merged(runs, 3 * block).await;
        assert_eq!(keys.len(), expected.len());
        assert!(keys == expected, "rows differ or are out of order");
        assert!(
            count(&metrics, "merge_levels") >= 2,
            "{}",
            metrics.clone_inner()
        );
        assert!(
            count(&metrics, "runs_written") >= 40,
            "{}",
            metrics.clone_inner()
        );
        // 120 runs make 40 full groups of three: the first level alone writes every row.
        let written = metrics.clone_inner().spilled_rows().unwrap_or(0);
        assert!(written >= expected.len(), "{written} rows written");
        // What the levels' readers reserved is given back.
        assert_eq!(pool.reserved(), 0);
    }

    #[test]
    fn groups_fit_the_merge_and_hold_two_runs_at_least() {
        let sizes = [4, 4, 4, 9, 1, 10, 10, 3, 3, 3, 3];
        let grouped = groups(sizes.to_vec(), |b| *b, 12);
        assert_eq!(
            grouped,
            vec![vec![4, 4, 4], vec![9, 1], vec![10, 10], vec![3, 3, 3, 3]]
        );
        // One run left over makes a group of its own.
        assert_eq!(groups(vec![8, 8, 8], |b| *b, 12), vec![vec![8, 8], vec![8]]);
    }

    #[test]
    fn pieces_cover_the_batch_in_slices_of_at_most_the_given_bytes() {
        let batch = RecordBatch::try_new(
            schema(),
            vec![Arc::new(Int64Array::from_iter_values(0..10_000))],
        )
        .unwrap();
        let most = 8_000;
        let pieces = pieces(&batch, most);
        assert!(pieces.len() >= 10, "{}", pieces.len());
        let keys: Vec<i64> = pieces
            .iter()
            .inspect(|p| assert!(p.num_rows() * 8 <= most as usize))
            .flat_map(|p| p.column(0).as_primitive::<Int64Type>().values().to_vec())
            .collect();
        assert_eq!(keys, (0..10_000).collect::<Vec<_>>());
    }
}
