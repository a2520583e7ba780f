//! Rows dropped as a scan reads them by its joins' finished dynamic filters.
//!
//! DataFusion pushes each hash join's *dynamic filter* (the build side's keys, filled in
//! once the build is in) into the Parquet scans of its probe side, through a grouped
//! aggregate on the join key too. With `datafusion.execution.parquet.pushdown_filters` off
//! (its default), a scan uses it only to skip row groups by their statistics, which a key
//! spread over every row group never allows. flumen starts a join's probe-side scans when
//! the join asks for their blocks, after its build side is in, so the filter is usually
//! complete when a scan task opens.
//!
//! Where a grouped aggregate reads the scan (the cut marks such split sources), a task that
//! finds every dynamic filter of its scan complete evaluates them on each batch it reads
//! and keeps the rows they pass: the aggregate never groups rows the join would drop
//! (TPC-H q17 at SF10: all 60M lineitem rows aggregated into 2M groups for a join that
//! keeps 61K of them; now 0.1%, 4.8 → 1.8 s). The filter is dear (a partitioned join's is
//! `CASE hash(key) % n WHEN i THEN <bounds> AND <lookup in partition i's table>`,
//! evaluated branch by branch, before the scan's own `WHERE`), so a scan feeding the join
//! directly does not use it: there it cost more than the exchange and probe it saved
//! (q3, q4, q8, q19 1.3–1.5x slower, dropping 90–99.9% of the rows). And after its first
//! [`SAMPLE_ROWS`] rows a task that kept more than one row in [`KEEPS_AT_MOST`] stops
//! filtering.
//!
//! Where a task starts from a bound made from a join's build side
//! ([`crate::plan::build_bounds`]: range, list, set), a threads-mode split drops rows by
//! that bound instead ([`bounds_on_output`]), before the exchange too where a list or a set
//! makes it selective: it is cheap (TPC-H q7 0.23 → 0.13 s), and given up only past 7/8 of
//! its sample kept.
//!
//! A filter still filling (a build side not in, or a `TopK`'s running bound) is not used,
//! and the choice is the task's: a recompute reads the split as the first run did, so it
//! cuts the same blocks (`TaskInputs::scan_row_filter`). The scan's own predicate is left
//! as it is: DataFusion's row filter for the whole predicate evaluated a query's other
//! filters twice (a `LIKE` on `o_comment` in q13).

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use datafusion::arrow::array::AsArray;
use datafusion::arrow::compute::filter_record_batch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::physical_plan::{FileScanConfig, FileSource, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream};
use datafusion::physical_expr::expressions::DynamicFilterPhysicalExpr;
use datafusion::physical_expr::split_conjunction;
use datafusion::physical_expr::utils::{conjunction, reassign_expr_columns};
use datafusion::physical_plan::metrics::Count;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};
use futures::{FutureExt, Stream};

use crate::plan::dynamic_filters::BoundSwaps;
use crate::plan::key_membership::KeysInSet;

/// Rows a task filters before it judges the filter's worth.
pub const SAMPLE_ROWS: u64 = 16_384;

/// A filter keeping more than one row in this many of its sample is given up.
pub const KEEPS_AT_MOST: u64 = 16;

/// The rows a scan task keeps of what it reads: those its joins' complete dynamic filters
/// pass, judged only on the rows that pass the scan's own cheap conjuncts first.
#[derive(Debug, Clone)]
pub struct JoinRowFilter {
    /// The conjunction of the scan's complete dynamic filters, over its output columns.
    pub dynamic: Arc<dyn PhysicalExpr>,
    /// The conjunction of the scan's own conjuncts that are cheap to evaluate (columns,
    /// literals, comparisons, arithmetic, casts, `IN` lists: no function, no `LIKE`), over
    /// its output columns. A `FilterExec` above applies them anyway (the scan's predicate
    /// is a pushed copy, used for pruning), so dropping the rows they reject first is
    /// safe, and the dear dynamic filter then sees only what survives them: TPC-H q20's
    /// lineitem scan evaluated its join's filter on 6M rows where its date range keeps
    /// 0.9M.
    pub cheap_first: Option<Arc<dyn PhysicalExpr>>,
    /// The share of its first [`SAMPLE_ROWS`] rows past which it is given up: one in
    /// [`KEEPS_AT_MOST`] for DataFusion's dear filter; for a bound from a build side
    /// ([`bounds_on_output`]), cheap, the share past which a set's test gives up
    /// ([`crate::plan::key_membership::KEEPS_AT_MOST`]): TPC-H q13's `orders` scan tested
    /// every row against the keys of all customers, which keep them all.
    pub keeps_at_most: f64,
}

/// `scan`'s Parquet source and its predicate, where the scan uses the predicate for pruning
/// only (not the session's `pushdown_filters`): the rows it rejects still come out.
fn predicate_for_pruning(
    scan: &Arc<dyn ExecutionPlan>,
) -> Option<(&ParquetSource, Arc<dyn PhysicalExpr>)> {
    let config = scan
        .downcast_ref::<DataSourceExec>()?
        .data_source()
        .downcast_ref::<FileScanConfig>()?;
    let source = config.file_source().downcast_ref::<ParquetSource>()?;
    if source.table_parquet_options().global.pushdown_filters {
        return None;
    }
    let predicate = FileSource::filter(source)?;
    Some((source, predicate))
}

/// The filter [`drop_rejected_rows`] applies for `scan`: when `scan` is a Parquet scan
/// whose predicate holds at least one dynamic filter and every one of them is complete
/// (will never change again); `None` otherwise, or when a filter reads a column the scan
/// does not output, or the scan already filters rows with its predicate (the session's
/// `pushdown_filters`).
pub fn complete_join_filter(scan: &Arc<dyn ExecutionPlan>) -> Option<JoinRowFilter> {
    let (source, predicate) = predicate_for_pruning(scan)?;
    let mut filters = vec![];
    let mut all_complete = true;
    let _ = predicate.apply(|expr| {
        if let Some(filter) = expr.downcast_ref::<DynamicFilterPhysicalExpr>() {
            // Ready at once when complete; otherwise it would wait for its join.
            all_complete &= filter.wait_complete().now_or_never().is_some();
            filters.push(filter.current());
            // Its children are the columns it reads, not further filters.
            return Ok(TreeNodeRecursion::Jump);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if filters.is_empty() || !all_complete {
        return None;
    }
    let filter = conjunction(filters.into_iter().collect::<Result<Vec<_>>>().ok()?);
    // The predicate reads the table's columns; the scan's batches hold its projection.
    let dynamic = on_scan_output(scan, source, filter)?;
    Some(JoinRowFilter {
        dynamic,
        cheap_first: cheap_conjuncts(scan, source, &predicate),
        keeps_at_most: 1.0 / KEEPS_AT_MOST as f64,
    })
}

/// The filter a threads-mode split of `scan` drops rows by where its task starts from a
/// bound made from a join's build side ([`crate::plan::build_bounds`]) for filters among
/// `ids`: those bounds (`swaps`: what the task reads in place of the filters), on the
/// scan's output columns, after the scan predicate's cheap conjuncts. Not DataFusion's
/// own filter of the join, dear where the join is partitioned: the bound rejects what that
/// filter rejects, but for a set's rare false positives. Each test of a key set in it is
/// the task's own. `None` where the scan reads none of them, or filters rows with its
/// predicate already (`pushdown_filters`).
pub fn bounds_on_output(
    scan: &Arc<dyn ExecutionPlan>,
    swaps: &BoundSwaps,
    ids: &HashSet<u64>,
) -> Result<Option<JoinRowFilter>> {
    let Some((source, predicate)) = predicate_for_pruning(scan) else {
        return Ok(None);
    };
    let Some(bounds) = swaps.starting_bounds(&predicate, ids)? else {
        return Ok(None);
    };
    let Some(dynamic) = on_scan_output(scan, source, bounds) else {
        return Ok(None);
    };
    Ok(Some(JoinRowFilter {
        dynamic: KeysInSet::each_its_own(dynamic)?,
        cheap_first: cheap_conjuncts(scan, source, &predicate),
        keeps_at_most: crate::plan::key_membership::KEEPS_AT_MOST,
    }))
}

/// The conjunction of `predicate`'s conjuncts that are cheap to evaluate
/// ([`JoinRowFilter::cheap_first`]), on `scan`'s output columns (`source`: its Parquet
/// source); `None` where there is none.
fn cheap_conjuncts(
    scan: &Arc<dyn ExecutionPlan>,
    source: &ParquetSource,
    predicate: &Arc<dyn PhysicalExpr>,
) -> Option<Arc<dyn PhysicalExpr>> {
    let cheap: Vec<_> = split_conjunction(predicate)
        .into_iter()
        .filter(|conjunct| is_cheap(conjunct))
        .filter_map(|conjunct| on_scan_output(scan, source, Arc::clone(conjunct)))
        .collect();
    (!cheap.is_empty()).then(|| conjunction(cheap))
}

/// `expr`, which reads the table's columns, on the columns of `scan`'s batches (its
/// projection; `source`: its Parquet source).
fn on_scan_output(
    scan: &Arc<dyn ExecutionPlan>,
    source: &ParquetSource,
    expr: Arc<dyn PhysicalExpr>,
) -> Option<Arc<dyn PhysicalExpr>> {
    match FileSource::projection(source) {
        Some(projection) => projection.project_expr(&expr).ok(),
        None => reassign_expr_columns(expr, &scan.schema()).ok(),
    }
}

/// The conjunction of the dynamic filters among `ids` that the Parquet scan `scan`'s
/// predicate reads, on the scan's output columns, after the predicate's cheap conjuncts
/// ([`JoinRowFilter::cheap_first`]: DataFusion's `AND` then tests the filters only on the
/// rows those keep, where they keep at most a fifth): what a worker's split of a scan that
/// drops join-filtered rows filters by, where its run starts from a bound made from a
/// join's build side ([`crate::plan::build_bounds`]; the task's bounds then put that
/// bound beside each filter). `None` where it reads none of them, or the scan filters rows
/// with its predicate already (`pushdown_filters`).
pub fn filters_on_output(
    scan: &Arc<dyn ExecutionPlan>,
    ids: &HashSet<u64>,
) -> Option<Arc<dyn PhysicalExpr>> {
    let (source, predicate) = predicate_for_pruning(scan)?;
    let mut filters = vec![];
    let _ = predicate.apply(|expr| {
        if expr.downcast_ref::<DynamicFilterPhysicalExpr>().is_some() {
            if expr.expression_id().is_some_and(|id| ids.contains(&id)) {
                filters.push(Arc::clone(expr));
            }
            return Ok(TreeNodeRecursion::Jump);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    if filters.is_empty() {
        return None;
    }
    let dynamic = on_scan_output(scan, source, conjunction(filters))?;
    Some(match cheap_conjuncts(scan, source, &predicate) {
        Some(cheap) => conjunction([cheap, dynamic]),
        None => dynamic,
    })
}

/// Whether `expr` is cheap to evaluate on every row: columns, literals, comparisons,
/// boolean logic, arithmetic, casts, null tests and `IN` lists only (no dynamic filter).
fn is_cheap(expr: &Arc<dyn PhysicalExpr>) -> bool {
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{
        BinaryExpr, CastExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, Literal, NotExpr,
        TryCastExpr,
    };
    let mut cheap = true;
    let _ = expr.apply(|e| {
        let plain = e.downcast_ref::<Column>().is_some()
            || e.downcast_ref::<Literal>().is_some()
            || e.downcast_ref::<CastExpr>().is_some()
            || e.downcast_ref::<TryCastExpr>().is_some()
            || e.downcast_ref::<IsNullExpr>().is_some()
            || e.downcast_ref::<IsNotNullExpr>().is_some()
            || e.downcast_ref::<NotExpr>().is_some()
            || e.downcast_ref::<InListExpr>().is_some();
        let cheap_binary = e.downcast_ref::<BinaryExpr>().is_some_and(|b| {
            matches!(
                b.op(),
                Operator::Eq
                    | Operator::NotEq
                    | Operator::Lt
                    | Operator::LtEq
                    | Operator::Gt
                    | Operator::GtEq
                    | Operator::And
                    | Operator::Or
                    | Operator::Plus
                    | Operator::Minus
                    | Operator::Multiply
                    | Operator::Divide
                    | Operator::Modulo
            )
        });
        cheap &= plain || cheap_binary;
        Ok(match cheap {
            true => TreeNodeRecursion::Continue,
            false => TreeNodeRecursion::Stop,
        })
    });
    cheap
}

/// `stream` (a scan's batches) with the rows `filter` rejects dropped, unless its first
/// [`SAMPLE_ROWS`] rows show it keeps more than one in [`KEEPS_AT_MOST`].
/// `dropped` counts the rows dropped.
pub fn drop_rejected_rows(
    stream: SendableRecordBatchStream,
    filter: JoinRowFilter,
    dropped: Count,
) -> SendableRecordBatchStream {
    Box::pin(JoinFilterStream {
        inner: stream,
        filter: Some(filter),
        seen: 0,
        kept: 0,
        dropped,
    })
}

/// A scan's stream, filtered by its joins' finished dynamic filters.
struct JoinFilterStream {
    inner: SendableRecordBatchStream,
    /// `None` once it kept too many rows of its sample.
    filter: Option<JoinRowFilter>,
    /// Rows the dynamic filter evaluated so far.
    seen: u64,
    /// Rows of those it kept.
    kept: u64,
    /// Rows dropped (`EXPLAIN ANALYZE`'s `join_filter_dropped_rows`).
    dropped: Count,
}

impl JoinFilterStream {
    /// `batch` with the rows the filter rejects dropped; the filter is given up once its
    /// sample is in and it kept too many.
    fn apply(&mut self, batch: RecordBatch) -> Result<RecordBatch> {
        let Some(filter) = &self.filter else {
            return Ok(batch);
        };
        let read = batch.num_rows();
        let batch = match &filter.cheap_first {
            Some(cheap) => {
                let mask = cheap.evaluate(&batch)?.into_array(read)?;
                filter_record_batch(&batch, mask.as_boolean())?
            }
            None => batch,
        };
        let mask = filter
            .dynamic
            .evaluate(&batch)?
            .into_array(batch.num_rows())?;
        let kept = filter_record_batch(&batch, mask.as_boolean())?;
        self.seen += batch.num_rows() as u64;
        self.kept += kept.num_rows() as u64;
        self.dropped.add(read - kept.num_rows());
        if self.seen >= SAMPLE_ROWS && self.kept as f64 > filter.keeps_at_most * self.seen as f64 {
            self.filter = None;
        }
        Ok(kept)
    }
}

impl Stream for JoinFilterStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            match self.inner.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(batch))) => match self.apply(batch) {
                    // A batch whose every row was dropped is not handed on.
                    Ok(kept) if kept.num_rows() == 0 => continue,
                    result => return Poll::Ready(Some(result)),
                },
                other => return other,
            }
        }
    }
}

impl RecordBatchStream for JoinFilterStream {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::logical_expr::Operator;
    use datafusion::physical_expr::expressions::{binary, col, lit};
    use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
    use futures::TryStreamExt;

    /// Batches of 4,096 ids from 0 up to `rows`, through `id % modulus = 0`.
    async fn kept_ids(rows: i64, modulus: i64) -> Vec<i64> {
        kept_ids_below(rows, modulus, None).await
    }

    /// [`kept_ids`], the ids at or over `below` dropped first when given.
    async fn kept_ids_below(rows: i64, modulus: i64, below: Option<i64>) -> Vec<i64> {
        let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
        let batches: Vec<Result<RecordBatch>> = (0..rows)
            .step_by(4096)
            .map(|start| {
                let ids = Int64Array::from_iter_values(start..(start + 4096).min(rows));
                Ok(RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![Arc::new(ids)],
                )?)
            })
            .collect();
        let stream = Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&schema),
            futures::stream::iter(batches),
        ));
        let id = col("id", &schema).unwrap();
        let rem = binary(id, Operator::Modulo, lit(modulus), &schema).unwrap();
        let filter = binary(rem, Operator::Eq, lit(0i64), &schema).unwrap();
        let cheap_first = below.map(|below| {
            let id = col("id", &schema).unwrap();
            binary(id, Operator::Lt, lit(below), &schema).unwrap()
        });
        let filter = JoinRowFilter {
            dynamic: filter,
            cheap_first,
            keeps_at_most: 1.0 / KEEPS_AT_MOST as f64,
        };
        let out: Vec<RecordBatch> = drop_rejected_rows(stream, filter, Count::new())
            .try_collect()
            .await
            .unwrap();
        assert!(
            out.iter().all(|b| b.num_rows() > 0),
            "an empty batch was handed on"
        );
        out.iter()
            .flat_map(|b| {
                let ids = b
                    .column(0)
                    .as_primitive::<datafusion::arrow::datatypes::Int64Type>();
                (0..ids.len()).map(|i| ids.value(i)).collect::<Vec<_>>()
            })
            .collect()
    }

    #[tokio::test]
    async fn a_filter_that_drops_nearly_every_row_filters_to_the_end() {
        let ids = kept_ids(100_000, 100).await;
        assert_eq!(ids, (0..100_000).step_by(100).collect::<Vec<i64>>());
    }

    #[tokio::test]
    async fn a_filter_that_keeps_many_rows_is_given_up_after_its_sample() {
        // Keeps one row in 4: past the sample (four batches of 4,096), every row passes.
        let ids = kept_ids(100_000, 4).await;
        let sampled = SAMPLE_ROWS as i64;
        let mut expected: Vec<i64> = (0..sampled).step_by(4).collect();
        expected.extend(sampled..100_000);
        assert_eq!(ids, expected);
    }

    #[tokio::test]
    async fn cheap_conjuncts_go_first_and_the_filter_is_judged_on_what_they_keep() {
        // The cheap `id < 50000` drops half; the dynamic filter keeps one in 100 of the rest.
        let ids = kept_ids_below(100_000, 100, Some(50_000)).await;
        assert_eq!(ids, (0..50_000).step_by(100).collect::<Vec<i64>>());
        // Keeping one in 4 of the survivors, the filter (the cheap one too) is given up.
        let ids = kept_ids_below(100_000, 4, Some(50_000)).await;
        let sampled = SAMPLE_ROWS as i64;
        let mut expected: Vec<i64> = (0..sampled).step_by(4).collect();
        expected.extend(sampled..100_000);
        assert_eq!(ids, expected);
        assert!(is_cheap(&lit(1i64)));
    }
}
