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
//!   SortExec (per partition)          one task sorts one range, which fits its share
//!     RepartitionExec: Range(keys, split points)   map tasks tag rows by range
//!       <sort input>
//! ```
//!
//! The split points are quantiles of a sample of the sort keys, drawn before the query runs
//! by reading the sort's input with only the key columns (a scan reads just those columns),
//! so only sorts over an input that is cheap to read again are planned this way: scans,
//! filters, projections ([`can_range_sort`]). The split points are fixed in the plan, so a
//! recomputed map task (lineage) tags every row as the first run did.

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, UInt32Array};
use datafusion::arrow::compute::take_arrays;
use datafusion::arrow::row::{OwnedRow, RowConverter, SortField};
use datafusion::common::SplitPoint;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::config::ConfigOptions;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_expr::{LexOrdering, RangePartitioning};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::projection_pushdown::ProjectionPushdown;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::filter::FilterExec;
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

use crate::plan::concat_partitions::ConcatPartitionsExec;
use crate::plan::exchange_sizing::{ExchangeSizing, MAX_PARTITIONS, estimated_bytes};

/// Sampled keys per range: enough that a range's share of the rows is within a few
/// percent of the mean.
const SAMPLES_PER_RANGE: usize = 100;
/// Most keys kept in the sample, whatever the number of ranges.
const MAX_SAMPLES: usize = 200_000;
/// The sample's generator seed: the same input gives the same split points in every run.
const SAMPLE_SEED: u64 = 0x5EED_5A3F;

/// Whether a full sort over `input` can be range-partitioned: its input is cheap to read
/// twice (once for the sample): sources, filters, projections and round-robin repartitions,
/// no state and no other exchange.
pub fn can_range_sort(sort: &SortExec) -> bool {
    sort.fetch().is_none() && rereadable(sort.input())
}

fn rereadable(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let node_ok = plan
        .downcast_ref::<DataSourceExec>()
        .is_some_and(|s| s.fetch().is_none())
        || plan
            .downcast_ref::<FilterExec>()
            .is_some_and(|f| f.fetch().is_none())
        || plan.downcast_ref::<ProjectionExec>().is_some()
        || plan.downcast_ref::<CooperativeExec>().is_some()
        || plan
            .downcast_ref::<RepartitionExec>()
            .is_some_and(|r| matches!(r.partitioning(), Partitioning::RoundRobinBatch(_)));
    node_ok && plan.children().into_iter().all(rereadable)
}

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
            let ordering = sort.expr().clone();
            let points =
                sample_split_points(sort.input(), &ordering, ranges, context, options).await?;
            if points.is_empty() {
                return Ok(plan);
            }
            let mut sorted = range_sorted(Arc::clone(sort.input()), ordering, points)?;
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

/// Each partition of the range-partitioned sort of `input` by `ordering`, split at
/// `points`: partition `i` holds range `i`, sorted.
fn range_sorted(
    input: Arc<dyn ExecutionPlan>,
    ordering: LexOrdering,
    points: Vec<SplitPoint>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let ranges = RangePartitioning::try_new(ordering.clone(), points)?;
    let exchange = Arc::new(RepartitionExec::try_new(
        input,
        Partitioning::Range(ranges),
    )?);
    Ok(Arc::new(
        SortExec::new(ordering, exchange).with_preserve_partitioning(true),
    ))
}

/// Split points for `ranges` ranges of `input`'s rows by `ordering`: quantiles of a uniform
/// sample (reservoir, fixed seed) of the keys. Fewer when keys repeat (split points are
/// distinct); none when the input has no rows.
async fn sample_split_points(
    input: &Arc<dyn ExecutionPlan>,
    ordering: &LexOrdering,
    ranges: usize,
    context: Arc<TaskContext>,
    options: &ConfigOptions,
) -> Result<Vec<SplitPoint>> {
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
    if rows.is_empty() {
        return Ok(vec![]);
    }
    rows.sort_unstable();
    let mut chosen: Vec<&OwnedRow> = vec![];
    for i in 1..ranges {
        let row = &rows[i * rows.len() / ranges];
        if chosen.last().is_none_or(|last| *last < row) {
            chosen.push(row);
        }
    }
    let columns = converter.convert_rows(chosen.iter().map(|r| r.row()))?;
    (0..chosen.len())
        .map(|i| {
            columns
                .iter()
                .map(|c| ScalarValue::try_from_array(c, i))
                .collect::<Result<Vec<_>>>()
                .map(SplitPoint::new)
        })
        .collect()
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
    use datafusion::physical_expr::PhysicalSortExpr;
    use datafusion::physical_expr::expressions::col;
    use datafusion::prelude::SessionContext;

    use super::*;

    fn values_plan(values: Vec<i64>, partitions: usize) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
        let per = values.len().div_ceil(partitions).max(1);
        let batches: Vec<Vec<RecordBatch>> = values
            .chunks(per)
            .map(|c| {
                vec![
                    RecordBatch::try_new(
                        Arc::clone(&schema),
                        vec![Arc::new(Int64Array::from(c.to_vec()))],
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

    async fn points(values: Vec<i64>, ranges: usize) -> Vec<i64> {
        let plan = values_plan(values, 3);
        let ctx = SessionContext::new();
        sample_split_points(
            &plan,
            &ordering(&plan),
            ranges,
            ctx.task_ctx(),
            ctx.state().config_options(),
        )
        .await
        .unwrap()
        .iter()
        .map(|p| match &p.values()[0] {
            ScalarValue::Int64(Some(v)) => *v,
            other => panic!("{other:?}"),
        })
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

    #[tokio::test]
    async fn a_range_sorted_plan_returns_the_rows_sorted() {
        let values: Vec<i64> = (0..20_000i64).map(|i| (i * 7_919) % 20_011).collect();
        let input = values_plan(values.clone(), 4);
        let order = ordering(&input);
        let ctx = SessionContext::new();
        let points = sample_split_points(
            &input,
            &order,
            4,
            ctx.task_ctx(),
            ctx.state().config_options(),
        )
        .await
        .unwrap();
        let plan = Arc::new(ConcatPartitionsExec::ordered(
            range_sorted(input, order.clone(), points).unwrap(),
            order,
        ));
        let batches = datafusion::physical_plan::collect(plan, ctx.task_ctx())
            .await
            .unwrap();
        let got: Vec<i64> = batches
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .unwrap()
                    .values()
                    .to_vec()
            })
            .collect();
        let mut expected = values;
        expected.sort();
        assert_eq!(got, expected);
    }
}
