//! An out-of-core full sort as a range-partitioned sort: sample the keys for range
//! boundaries, split the rows by range (the map side of an exchange, through the block
//! store), sort each range in a task of its own, and read the ranges in key order.
//!
//! DataFusion sorts each input partition and merges the sorted partitions: every partition's
//! merge is in memory at once, and the final merge reads all of them together. When a query
//! runs out of core ([`ExchangeSizing`](super::exchange_sizing::ExchangeSizing)),
//! [`plan_range_sorts`] puts this in place of `SortPreservingMergeExec(SortExec)`:
//!
//! ```text
//! ConcatPartitionsExec: ordered       ranges one after the other: a sorted stream
//!   MergeRunsExec (per partition)     one task merges one range's sorted runs
//!     SortExec (per partition)        tasks sort bundles of a range's blocks as they arrive
//!       RepartitionExec: Range(keys, split points)   map tasks tag rows by range
//!         <sort input>
//! ```
//!
//! As in Exoshuffle's push-based shuffle, a range is sorted in the background while the map
//! side still runs: the cut makes the `SortExec` a per-block operator whose tasks each sort a
//! bundle of a range's blocks as soon as it holds half the budget over the ranges (one
//! sorted run, made while the ranges' blocks together still fit in memory), and the reduce
//! task only merges the runs, holding one block of each. With `flumen.sort_runs = false`,
//! or runs under 1 MiB (a small budget over many ranges), the `MergeRunsExec` is left out
//! and one task sorts each range whole once the map side has finished.
//!
//! The split points are quantiles of a sample of the sort keys, drawn before the query runs
//! by reading the sort's input with only the key columns (a scan reads just those columns),
//! so only sorts over an input that is cheap to read again are planned this way: scans,
//! filters, projections ([`can_range_sort`], which the sizing of exchanges also reads). The split points are fixed in the plan, so a
//! recomputed map task (lineage) tags every row as the first run did.
//!
//! A **hot key**, one key value holding the share of two ranges or more of the sample, would
//! make one range (one task) of all its rows. When `flumen.slice_hot_partitions` is on, such
//! a key is spread over as many ranges as its share: the exchange's ordering gets a last key,
//! `row_hash(seed, every column but the keys)` on a hot key's rows (0 on others, which are
//! not hashed), and the hot key's split points cut the hash's range into equal parts (the
//! hash is uniform, so no sample of it is needed). Rows equal on the sort's keys may come in
//! any order, so each range is still sorted by the sort's keys alone and the ranges in order
//! are the sorted rows. The hash is of a row's values, so a recomputed map task sends every
//! row where it went before; rows equal in every column share a hash and stay in one range.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, UInt32Array};
use datafusion::arrow::compute::take_arrays;
use datafusion::arrow::datatypes::Schema;
use datafusion::arrow::row::{OwnedRow, RowConverter, SortField};
use datafusion::common::SplitPoint;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::execution::TaskContext;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{CaseExpr, Column, binary, lit};
use datafusion::physical_expr::{LexOrdering, PhysicalExpr, PhysicalSortExpr, RangePartitioning};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::projection_pushdown::ProjectionPushdown;
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, Partitioning, replace_children_if_necessary,
};
use datafusion::scalar::ScalarValue;
use futures::TryStreamExt;
use futures::future::BoxFuture;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::config::FlumenConfig;
use crate::functions::row_hash::row_hash_of_columns;
use crate::plan::concat_partitions::ConcatPartitionsExec;
use crate::plan::exchange_sizing::{
    ExchangeSizing, MAX_PARTITIONS, can_range_sort, estimated_bytes,
};
use crate::plan::merge_runs::MergeRunsExec;

/// Sampled keys per range: enough that a range's share of the rows is within a few
/// percent of the mean.
const SAMPLES_PER_RANGE: usize = 100;
/// Most keys kept in the sample, whatever the number of ranges.
const MAX_SAMPLES: usize = 200_000;
/// The sample's generator seed: the same input gives the same split points in every run.
const SAMPLE_SEED: u64 = 0x5EED_5A3F;
/// The seed of the row hash that spreads a hot key's rows over several ranges.
const HOT_KEY_HASH_SEED: u64 = 0x407_5EED;
/// A key value is hot when the sample holds at least this many ranges' share of it.
const HOT_KEY_RANGES: f64 = 2.0;

/// `plan` with each `SortPreservingMergeExec(SortExec)` full sort whose input
/// [`can_range_sort`] made a range-partitioned sort, with a range per
/// [`ExchangeSizing::partition_bytes`] of its estimated input; the split points are sampled
/// now, by reading the sorts' keys with `context`.
pub async fn plan_range_sorts(
    plan: Arc<dyn ExecutionPlan>,
    sizing: &ExchangeSizing,
    context: Arc<TaskContext>,
    options: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    rewrite(plan, sizing.partition_bytes, context, options).await
}

fn rewrite<'a>(
    plan: Arc<dyn ExecutionPlan>,
    range_bytes: u64,
    context: Arc<TaskContext>,
    options: &'a ConfigOptions,
) -> BoxFuture<'a, Result<Arc<dyn ExecutionPlan>>> {
    Box::pin(async move {
        if let Some(merge) = plan.downcast_ref::<SortPreservingMergeExec>()
            && merge.fetch().is_none()
            && let Some((projections, sort)) = sort_below(merge.input())
            && sort.preserve_partitioning()
            && can_range_sort(sort)
        {
            let ranges = estimated_bytes(sort.input())
                .div_ceil(range_bytes.max(1))
                .clamp(2, MAX_PARTITIONS as u64) as usize;
            let Some(mut sorted) = range_partitioned_sort(
                Arc::clone(sort.input()),
                sort.expr().clone(),
                ranges,
                context,
                options,
            )
            .await?
            else {
                return Ok(plan);
            };
            for projection in projections.into_iter().rev() {
                sorted = replace_children_if_necessary(Arc::clone(projection), vec![sorted])?;
            }
            return Ok(Arc::new(ConcatPartitionsExec::ordered(
                sorted,
                merge.expr().clone(),
            )));
        }
        let mut children = vec![];
        for child in plan.children() {
            children.push(
                rewrite(
                    Arc::clone(child),
                    range_bytes,
                    Arc::clone(&context),
                    options,
                )
                .await?,
            );
        }
        if children.is_empty() {
            return Ok(plan);
        }
        replace_children_if_necessary(plan, children)
    })
}

/// The sort of `input` by `ordering` as about `ranges` sorted ranges, one per partition,
/// its split points sampled now (a hot key spread over several ranges when
/// [`hot_key_spread`] says so); `None` when the input has no rows.
async fn range_partitioned_sort(
    input: Arc<dyn ExecutionPlan>,
    ordering: LexOrdering,
    ranges: usize,
    context: Arc<TaskContext>,
    options: &ConfigOptions,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    // Columns that are sort keys are equal on every row of a hot key: they are not hashed.
    let key_columns: Vec<usize> = ordering
        .iter()
        .filter_map(|key| key.expr.downcast_ref::<Column>().map(Column::index))
        .collect();
    let spread = hot_key_spread(options);
    let row_hash = match spread {
        Some(_) => row_hash_of_columns(&input.schema(), HOT_KEY_HASH_SEED, &key_columns, options)?,
        None => None,
    };
    let split = sample_split_points(
        &input,
        &ordering,
        ranges,
        spread.filter(|_| row_hash.is_some()),
        context,
        options,
    )
    .await?;
    if split.points.is_empty() {
        return Ok(None);
    }
    let range_ordering = match row_hash {
        Some(hash) if !split.hot_keys.is_empty() => {
            let hash = only_on_hot_keys(hash, &ordering, &split.hot_keys, &input.schema())?;
            let mut keys = ordering.clone();
            keys.push(PhysicalSortExpr::new_default(hash));
            keys
        }
        _ => ordering.clone(),
    };
    let sorted = range_sorted(input, ordering.clone(), range_ordering, split.points)?;
    // Sorted in runs as the ranges' blocks arrive, then merged, where runs are worth a task.
    let ranges = sorted.output_partitioning().partition_count();
    let runs = options
        .extensions
        .get::<FlumenConfig>()
        .is_some_and(|config| {
            config.sort_runs && sort_run_bytes(config.memory_budget.0, ranges) >= MIN_RUN_BYTES
        });
    if runs {
        return Ok(Some(Arc::new(MergeRunsExec::new(sorted, ordering))));
    }
    Ok(Some(sorted))
}

/// Fewest bytes of a sorted run: smaller runs, each a task, cost more than sorting the
/// ranges whole (a sort of 20M rows under 64 MB, 82 ranges: 2,180 runs of 400 KB, 5.0 s
/// against 4.8 s whole; at least 1 MiB by taking more memory: 5.5 s).
const MIN_RUN_BYTES: u64 = 1 << 20;

/// Bytes of one sorted run of a range sort of `ranges` ranges under `budget`: runs form
/// while every range's blocks together fit half the budget, so a range's blocks are sorted
/// before memory is full and they would be written out.
pub(crate) fn sort_run_bytes(budget: u64, ranges: usize) -> u64 {
    (budget / (2 * ranges.max(1) as u64)).max(1)
}

/// `CASE WHEN <the keys are one of hot_keys> THEN hash ELSE 0 END`: rows of other keys are
/// not hashed (their split points end with hash 0). Keys compare as `IS NOT DISTINCT FROM`,
/// so a hot NULL is spread too.
fn only_on_hot_keys(
    hash: Arc<dyn PhysicalExpr>,
    ordering: &LexOrdering,
    hot_keys: &[Vec<ScalarValue>],
    schema: &Schema,
) -> Result<Arc<dyn PhysicalExpr>> {
    let mut any_hot: Option<Arc<dyn PhysicalExpr>> = None;
    for values in hot_keys {
        let mut all_equal: Option<Arc<dyn PhysicalExpr>> = None;
        for (key, value) in ordering.iter().zip(values) {
            let equal = binary(
                Arc::clone(&key.expr),
                Operator::IsNotDistinctFrom,
                lit(value.clone()),
                schema,
            )?;
            all_equal = Some(match all_equal {
                None => equal,
                Some(before) => binary(before, Operator::And, equal, schema)?,
            });
        }
        let all_equal = all_equal.expect("a sort has keys");
        any_hot = Some(match any_hot {
            None => all_equal,
            Some(before) => binary(before, Operator::Or, all_equal, schema)?,
        });
    }
    let any_hot = any_hot.expect("a hot key");
    Ok(Arc::new(CaseExpr::try_new(
        None,
        vec![(any_hot, hash)],
        Some(lit(ScalarValue::UInt64(Some(0)))),
    )?))
}

/// Which sort keys are spread over several ranges, and over how many.
#[derive(Debug, Clone, Copy)]
struct HotKeySpread {
    /// A key is spread when it holds more than this share of the rows: one CPU slot's share
    /// of the work, which as one range would be the sort's longest task while the other
    /// slots finish the rest.
    least_share: f64,
    /// Most ranges one key is spread over: enough for every slot to take a part of it.
    /// More, each range a task and each task's blocks smaller, cost more than they gained
    /// (a range of one key sorts fast).
    most_ranges: u64,
}

/// Ranges a hot key is spread over, at most, per CPU slot.
const HOT_KEY_RANGES_PER_SLOT: u64 = 2;

/// How hot keys are spread under `options`: never when `flumen.slice_hot_partitions` is off
/// or there is one CPU slot; with no flumen settings (tests of this module), any key over
/// two ranges' share, into as many ranges as its share.
fn hot_key_spread(options: &ConfigOptions) -> Option<HotKeySpread> {
    match options.extensions.get::<FlumenConfig>() {
        None => Some(HotKeySpread {
            least_share: 0.0,
            most_ranges: u64::MAX,
        }),
        Some(config) if config.slice_hot_partitions && config.cpu_slots > 1 => Some(HotKeySpread {
            least_share: 1.0 / config.cpu_slots as f64,
            most_ranges: HOT_KEY_RANGES_PER_SLOT * config.cpu_slots as u64,
        }),
        Some(_) => None,
    }
}

/// The per-partition sort below a merge, through the projections DataFusion may put
/// between them (which keep each partition's order): `(projections top down, sort)`.
fn sort_below(plan: &Arc<dyn ExecutionPlan>) -> Option<(Vec<&Arc<dyn ExecutionPlan>>, &SortExec)> {
    let mut projections = vec![];
    let mut node = plan;
    while node.downcast_ref::<ProjectionExec>().is_some() {
        projections.push(node);
        node = node.children()[0];
    }
    node.downcast_ref::<SortExec>()
        .map(|sort| (projections, sort))
}

/// Each partition of the sort of `input` by `ordering`, split by `range_ordering` (the
/// sort's keys, perhaps with a row hash after them) at `points`: partition `i` holds range
/// `i`, sorted.
fn range_sorted(
    input: Arc<dyn ExecutionPlan>,
    ordering: LexOrdering,
    range_ordering: LexOrdering,
    points: Vec<SplitPoint>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let ranges = RangePartitioning::try_new(range_ordering, points)?;
    let exchange = Arc::new(RepartitionExec::try_new(
        input,
        Partitioning::Range(ranges),
    )?);
    Ok(Arc::new(
        SortExec::new(ordering, exchange).with_preserve_partitioning(true),
    ))
}

/// The split points of a range sort, as sampled.
struct SampledSplit {
    /// Boundaries between adjacent ranges, in order.
    points: Vec<SplitPoint>,
    /// The keys spread over several ranges (each point then ends with a row hash value
    /// after the sort's keys); none when no key was.
    hot_keys: Vec<Vec<ScalarValue>>,
}

/// Split points for `ranges` ranges of `input`'s rows by `ordering`: quantiles of a uniform
/// sample (reservoir, fixed seed) of the keys. Fewer when keys repeat (split points are
/// distinct), unless a hot key is cut by a row hash as `spread` says; none when the input has
/// no rows.
async fn sample_split_points(
    input: &Arc<dyn ExecutionPlan>,
    ordering: &LexOrdering,
    ranges: usize,
    spread: Option<HotKeySpread>,
    context: Arc<TaskContext>,
    options: &ConfigOptions,
) -> Result<SampledSplit> {
    let key_exprs = ordering
        .iter()
        .enumerate()
        .map(|(i, key)| ProjectionExpr::new(Arc::clone(&key.expr), format!("__flumen_key{i}")));
    let keys: Arc<dyn ExecutionPlan> =
        Arc::new(ProjectionExec::try_new(key_exprs, Arc::clone(input))?);
    // Read only the key columns where the scan can, one partition after the other, with
    // no round-robin exchange between: run whole, the out-of-core plan's hundreds of
    // partitions each fetched a row group of keys at once (a 1.9 GiB sort at 50 MB held
    // 173 MB of Parquet column chunks), and the sample depended on their interleaving.
    let keys = ProjectionPushdown::new().optimize(keys, options)?;
    let keys = Arc::clone(&keys)
        .transform_up(|node| match node.downcast_ref::<RepartitionExec>() {
            Some(exchange)
                if matches!(exchange.partitioning(), Partitioning::RoundRobinBatch(_)) =>
            {
                Ok(Transformed::yes(Arc::clone(exchange.input())))
            }
            _ => Ok(Transformed::no(node)),
        })?
        .data;
    let fields = ordering
        .iter()
        .zip(keys.schema().fields())
        .map(|(key, field)| SortField::new_with_options(field.data_type().clone(), key.options))
        .collect();
    let converter = RowConverter::new(fields)?;
    let capacity = (ranges * SAMPLES_PER_RANGE).min(MAX_SAMPLES);
    let mut sample = Reservoir::new(capacity);
    for partition in 0..keys.output_partitioning().partition_count() {
        let mut stream = keys.execute(partition, Arc::clone(&context))?;
        while let Some(batch) = stream.try_next().await? {
            let picks = sample.pick(batch.num_rows());
            if picks.is_empty() {
                continue;
            }
            let rows = UInt32Array::from_iter_values(picks.iter().map(|(row, _)| *row as u32));
            let picked: Vec<ArrayRef> = take_arrays(batch.columns(), &rows, None)?;
            let converted = converter.convert_columns(&picked)?;
            for (i, (_, slot)) in picks.iter().enumerate() {
                sample.place(*slot, converted.row(i).owned());
            }
        }
    }
    let mut rows = sample.rows;
    rows.sort_unstable();
    let (chosen, hot_rows) = choose_split_points(&rows, ranges, spread);
    let by_row_hash = !hot_rows.is_empty();
    let values_of = |picked: &[usize]| -> Result<Vec<Vec<ScalarValue>>> {
        let columns = converter.convert_rows(picked.iter().map(|&at| rows[at].row()))?;
        (0..picked.len())
            .map(|i| {
                columns
                    .iter()
                    .map(|c| ScalarValue::try_from_array(c, i))
                    .collect()
            })
            .collect()
    };
    let chosen_rows: Vec<usize> = chosen.iter().map(|at| at.row).collect();
    let points = values_of(&chosen_rows)?
        .into_iter()
        .zip(&chosen)
        .map(|(mut values, at)| {
            if by_row_hash {
                values.push(ScalarValue::UInt64(Some(at.hash)));
            }
            SplitPoint::new(values)
        })
        .collect();
    Ok(SampledSplit {
        points,
        hot_keys: values_of(&hot_rows)?,
    })
}

/// A split point chosen from the sorted sample: the keys of sampled row `row`, then (when
/// hot keys are spread) a row hash value `hash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SplitAt {
    row: usize,
    hash: u64,
}

/// Split points for `ranges` ranges of the sorted sample `rows`, and the first row of each
/// hot key spread (when there is one, every point's `hash` counts): each quantile's row,
/// distinct; with
/// `spread`, a run of equal rows holding [`HOT_KEY_RANGES`] ranges' share or more, and more
/// than its least share of the rows, is cut
/// instead into as many ranges as its share, at equal steps of the hash, and closed by a
/// point at the next key.
fn choose_split_points(
    rows: &[OwnedRow],
    ranges: usize,
    spread: Option<HotKeySpread>,
) -> (Vec<SplitAt>, Vec<usize>) {
    let n = rows.len();
    let share = n as f64 / ranges.max(1) as f64;
    let mut points: Vec<SplitAt> = vec![];
    let mut hot_starts = vec![];
    let push = |points: &mut Vec<SplitAt>, at: SplitAt| {
        let after_last = points
            .last()
            .is_none_or(|last| (rows[last.row].row(), last.hash) < (rows[at.row].row(), at.hash));
        if after_last {
            points.push(at);
        }
    };
    let mut quantile = 1;
    let mut start = 0;
    while start < n {
        let end = start + rows[start..].partition_point(|row| row <= &rows[start]);
        let rows_of_key = (end - start) as f64;
        let hot = spread.filter(|spread| {
            rows_of_key > spread.least_share * n as f64 && rows_of_key >= HOT_KEY_RANGES * share
        });
        if let Some(spread) = hot {
            hot_starts.push(start);
            let parts = ((rows_of_key / share).round() as u64).min(spread.most_ranges);
            if start > 0 {
                push(
                    &mut points,
                    SplitAt {
                        row: start,
                        hash: 0,
                    },
                );
            }
            for part in 1..parts {
                let hash = part * (u64::MAX / parts);
                push(&mut points, SplitAt { row: start, hash });
            }
            if end < n {
                push(&mut points, SplitAt { row: end, hash: 0 });
            }
        } else if quantile < ranges && quantile * n / ranges < end {
            push(
                &mut points,
                SplitAt {
                    row: start,
                    hash: 0,
                },
            );
        }
        while quantile < ranges && quantile * n / ranges < end {
            quantile += 1;
        }
        start = end;
    }
    (points, hot_starts)
}

/// A uniform sample of at most `capacity` rows of a stream (Algorithm R).
struct Reservoir {
    capacity: usize,
    seen: u64,
    rng: StdRng,
    rows: Vec<OwnedRow>,
}

impl Reservoir {
    fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            seen: 0,
            rng: StdRng::seed_from_u64(SAMPLE_SEED),
            rows: vec![],
        }
    }

    /// The rows of the next batch (of `rows` rows) that enter the sample, each with the
    /// slot it replaces (`None`: appended); to be [`Self::place`]d in this order.
    fn pick(&mut self, rows: usize) -> Vec<(usize, Option<usize>)> {
        let mut picks = vec![];
        for row in 0..rows {
            // Every row is kept until the sample is full.
            if self.seen < self.capacity as u64 {
                picks.push((row, None));
            } else {
                let at = self.rng.random_range(0..=self.seen);
                if at < self.capacity as u64 {
                    picks.push((row, Some(at as usize)));
                }
            }
            self.seen += 1;
        }
        picks
    }

    fn place(&mut self, slot: Option<usize>, row: OwnedRow) {
        match slot {
            None => self.rows.push(row),
            Some(at) => self.rows[at] = row,
        }
    }
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{Int64Array, RecordBatch};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::expressions::col;
    use datafusion::prelude::SessionContext;

    use super::*;

    /// `(x, id)` rows: `x` from `values`, `id` the row's index; in `partitions` partitions.
    fn values_plan(values: Vec<i64>, partitions: usize) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Int64, false),
            Field::new("id", DataType::Int64, false),
        ]));
        let per = values.len().div_ceil(partitions).max(1);
        let batches: Vec<Vec<RecordBatch>> = values
            .chunks(per)
            .enumerate()
            .map(|(chunk, c)| {
                let first = (chunk * per) as i64;
                vec![
                    RecordBatch::try_new(
                        Arc::clone(&schema),
                        vec![
                            Arc::new(Int64Array::from(c.to_vec())),
                            Arc::new(Int64Array::from_iter_values(first..first + c.len() as i64)),
                        ],
                    )
                    .unwrap(),
                ]
            })
            .collect();
        MemorySourceConfig::try_new_exec(&batches, schema, None).unwrap()
    }

    fn ordering(plan: &Arc<dyn ExecutionPlan>) -> LexOrdering {
        LexOrdering::new([PhysicalSortExpr::new_default(
            col("x", &plan.schema()).unwrap(),
        )])
        .unwrap()
    }

    async fn sampled(
        values: Vec<i64>,
        ranges: usize,
        spread: Option<HotKeySpread>,
    ) -> SampledSplit {
        let plan = values_plan(values, 3);
        let ctx = SessionContext::new();
        sample_split_points(
            &plan,
            &ordering(&plan),
            ranges,
            spread,
            ctx.task_ctx(),
            ctx.state().config_options(),
        )
        .await
        .unwrap()
    }

    /// The first key of each split point.
    fn keys(split: &SampledSplit) -> Vec<i64> {
        split
            .points
            .iter()
            .map(|p| match &p.values()[0] {
                ScalarValue::Int64(Some(v)) => *v,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    async fn points(values: Vec<i64>, ranges: usize) -> Vec<i64> {
        let split = sampled(values, ranges, None).await;
        assert!(split.hot_keys.is_empty());
        keys(&split)
    }

    /// Spread any key over two ranges' share, over as many ranges as its share.
    fn any_hot_key() -> Option<HotKeySpread> {
        Some(HotKeySpread {
            least_share: 0.0,
            most_ranges: u64::MAX,
        })
    }

    /// Spread as flumen does with `cpu_slots` CPU slots.
    fn slots(cpu_slots: u64) -> HotKeySpread {
        HotKeySpread {
            least_share: 1.0 / cpu_slots as f64,
            most_ranges: HOT_KEY_RANGES_PER_SLOT * cpu_slots,
        }
    }

    /// Each partition's first `columns` columns (`Int64`) as rows, in the order the
    /// partition returns them.
    async fn partition_rows(plan: &Arc<dyn ExecutionPlan>, columns: usize) -> Vec<Vec<Vec<i64>>> {
        let ctx = SessionContext::new();
        let mut out = vec![];
        for partition in 0..plan.output_partitioning().partition_count() {
            let batches: Vec<RecordBatch> = plan
                .execute(partition, ctx.task_ctx())
                .unwrap()
                .try_collect()
                .await
                .unwrap();
            out.push(
                batches
                    .iter()
                    .flat_map(|b| {
                        let arrays: Vec<&Int64Array> = (0..columns)
                            .map(|c| b.column(c).as_any().downcast_ref::<Int64Array>().unwrap())
                            .collect();
                        (0..b.num_rows()).map(move |row| {
                            arrays.iter().map(|a| a.value(row)).collect::<Vec<i64>>()
                        })
                    })
                    .collect(),
            );
        }
        out
    }

    /// Each partition's `(x, id)` rows, in the order the partition returns them.
    async fn partitions(plan: &Arc<dyn ExecutionPlan>) -> Vec<Vec<(i64, i64)>> {
        partition_rows(plan, 2)
            .await
            .into_iter()
            .map(|rows| rows.into_iter().map(|r| (r[0], r[1])).collect())
            .collect()
    }

    #[tokio::test]
    async fn split_points_are_quantiles_of_the_keys() {
        // 100k distinct keys in a scrambled order, 4 ranges: about 25k, 50k, 75k.
        let values: Vec<i64> = (0..100_000i64).map(|i| (i * 7_919) % 100_000).collect();
        let points = points(values, 4).await;
        assert_eq!(points.len(), 3, "{points:?}");
        for (point, quantile) in points.iter().zip([25_000, 50_000, 75_000]) {
            assert!((point - quantile).abs() < 5_000, "{points:?}");
        }
        assert!(points.windows(2).all(|w| w[0] < w[1]));
    }

    #[tokio::test]
    async fn repeated_keys_give_fewer_distinct_split_points() {
        // 90% of the rows share one key: the split points around it collapse to one.
        let values: Vec<i64> = (0..50_000i64)
            .map(|i| if i % 10 == 0 { i } else { 7 })
            .collect();
        let split = points(values, 8).await;
        assert!(split.len() < 7, "{split:?}");
        assert!(split.windows(2).all(|w| w[0] < w[1]), "{split:?}");
        assert!(split.contains(&7), "{split:?}");
        assert!(points(vec![], 4).await.is_empty());
    }

    /// The range sort of `values` in about `ranges` ranges, planned as the rewrite plans it
    /// (hot keys spread): each partition's rows.
    async fn range_sorted_partitions(values: Vec<i64>, ranges: usize) -> Vec<Vec<(i64, i64)>> {
        let input = values_plan(values, 4);
        let order = ordering(&input);
        let ctx = SessionContext::new();
        let plan = range_partitioned_sort(
            input,
            order,
            ranges,
            ctx.task_ctx(),
            ctx.state().config_options(),
        )
        .await
        .unwrap()
        .expect("rows to sort");
        partitions(&plan).await
    }

    /// The partitions one after the other give every row, in the order of `x`.
    fn assert_sorted_permutation(parts: &[Vec<(i64, i64)>], values: &[i64]) {
        let got: Vec<(i64, i64)> = parts.concat();
        assert!(got.windows(2).all(|w| w[0].0 <= w[1].0), "not sorted by x");
        let mut rows = got.clone();
        rows.sort();
        let mut expected: Vec<(i64, i64)> = values.iter().copied().zip(0..).collect();
        expected.sort();
        assert_eq!(rows, expected);
    }

    #[tokio::test]
    async fn a_range_sorted_plan_returns_the_rows_sorted() {
        let values: Vec<i64> = (0..20_000i64).map(|i| (i * 7_919) % 20_011).collect();
        let parts = range_sorted_partitions(values.clone(), 4).await;
        assert_eq!(parts.len(), 4);
        assert_sorted_permutation(&parts, &values);
    }

    /// 40% of 50k rows share one `x` in the middle of the others: with 10 ranges the key holds 4 ranges' share, and is
    /// cut by the row hash into 4 ranges of about equal rows; the ranges in order are still
    /// the rows sorted by `x`. Without spreading, its rows make one range.
    #[tokio::test]
    async fn a_hot_key_is_spread_over_ranges_by_a_row_hash() {
        const HOT: i64 = 70_001;
        let values: Vec<i64> = (0..50_000i64)
            .map(|i| if i % 5 < 2 { HOT } else { i * 3 })
            .collect();
        let hot_rows = values.iter().filter(|&&x| x == HOT).count();

        let split = sampled(values.clone(), 10, any_hot_key()).await;
        assert_eq!(split.hot_keys, vec![vec![ScalarValue::Int64(Some(HOT))]]);
        let at_hot: Vec<&SplitPoint> = split
            .points
            .iter()
            .filter(|p| p.values()[0] == ScalarValue::Int64(Some(HOT)))
            .collect();
        assert_eq!(at_hot.len(), 4, "{:?}", split.points);

        let parts = range_sorted_partitions(values.clone(), 10).await;
        assert_sorted_permutation(&parts, &values);
        let hot_per_range: Vec<usize> = parts
            .iter()
            .map(|rows| rows.iter().filter(|(x, _)| *x == HOT).count())
            .filter(|&n| n > 0)
            .collect();
        assert_eq!(hot_per_range.len(), 4, "{hot_per_range:?}");
        for n in &hot_per_range {
            let share = *n as f64 / hot_rows as f64;
            assert!((0.2..0.3).contains(&share), "{hot_per_range:?}");
        }
        let largest = parts.iter().map(Vec::len).max().unwrap();
        assert!(largest < values.len() / 6, "largest range {largest} rows");

        let unspread = sampled(values.clone(), 10, None).await;
        assert!(unspread.hot_keys.is_empty());
        assert_eq!(keys(&unspread).iter().filter(|&&x| x == HOT).count(), 1);
        // 40% of the rows is less than one of two CPU slots' share: not spread either.
        let unspread = sampled(values, 10, Some(slots(2))).await;
        assert!(unspread.hot_keys.is_empty());
        assert_eq!(keys(&unspread).iter().filter(|&&x| x == HOT).count(), 1);
    }

    /// A sort whose only column is its key leaves nothing to hash: the hot key's rows stay
    /// in one range, and the sort is still whole and in order.
    #[tokio::test]
    async fn identical_hot_rows_stay_in_one_range() {
        let plan = values_plan(
            (0..20_000i64)
                .map(|i| if i % 2 == 0 { 7 } else { i })
                .collect(),
            2,
        );
        // Drop the id column: every hot row is then identical.
        let x_only: Arc<dyn ExecutionPlan> = Arc::new(
            ProjectionExec::try_new(
                [ProjectionExpr::new(
                    col("x", &plan.schema()).unwrap(),
                    "x".to_string(),
                )],
                plan,
            )
            .unwrap(),
        );
        let order = ordering(&x_only);
        let ctx = SessionContext::new();
        let sorted = range_partitioned_sort(
            x_only,
            order,
            8,
            ctx.task_ctx(),
            ctx.state().config_options(),
        )
        .await
        .unwrap()
        .unwrap();
        let mut hot_ranges = 0;
        let mut all = vec![];
        for rows in partition_rows(&sorted, 1).await {
            let xs: Vec<i64> = rows.into_iter().map(|r| r[0]).collect();
            hot_ranges += usize::from(xs.contains(&7));
            all.extend(xs);
        }
        assert_eq!(hot_ranges, 1);
        assert_eq!(all.len(), 20_000);
        assert!(all.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_hot_run_is_closed_by_a_point_at_the_next_key() {
        let converter = RowConverter::new(vec![SortField::new(DataType::Int64)]).unwrap();
        let sorted: Vec<i64> = (0..10)
            .chain(std::iter::repeat_n(50, 60))
            .chain(100..130)
            .collect();
        let column: ArrayRef = Arc::new(Int64Array::from(sorted.clone()));
        let rows = converter.convert_columns(&[column]).unwrap();
        let rows: Vec<OwnedRow> = rows.iter().map(|r| r.owned()).collect();
        let (points, hot) = choose_split_points(&rows, 10, any_hot_key());
        assert_eq!(hot, vec![10]);
        let described: Vec<(i64, u64)> = points.iter().map(|p| (sorted[p.row], p.hash)).collect();
        // 60 of 100 rows: 6 ranges' share, cut at five hash steps; then 100 closes it.
        let step = u64::MAX / 6;
        assert_eq!(
            described,
            vec![
                (50, 0),
                (50, step),
                (50, 2 * step),
                (50, 3 * step),
                (50, 4 * step),
                (50, 5 * step),
                (100, 0),
                (110, 0),
                (120, 0),
            ]
        );
        // With 2 CPU slots, the key is spread over 4 ranges at most.
        let (points, _) = choose_split_points(&rows, 10, Some(slots(2)));
        let at_hot = points.iter().filter(|p| sorted[p.row] == 50).count();
        assert_eq!(at_hot, 4, "{points:?}");
        // 60% is not more than a slot's share with 1 slot: not spread.
        assert!(choose_split_points(&rows, 10, Some(slots(1))).1.is_empty());
        let (points, hot) = choose_split_points(&rows, 10, None);
        assert!(hot.is_empty());
        let keys: Vec<i64> = points.iter().map(|p| sorted[p.row]).collect();
        assert_eq!(keys, vec![50, 100, 110, 120]);
    }
}
