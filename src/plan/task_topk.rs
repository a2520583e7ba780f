//! A TopK's input cut down where it is made: each task of the operator that feeds a TopK
//! keeps only the rows that can still be among its first ones.
//!
//! DataFusion plans `ORDER BY x LIMIT n` over several partitions as a merge with a fetch
//! over a TopK per partition (`SortExec` with `fetch` and `preserve_partitioning`), often
//! above an exchange that spreads a scan's rows. Cut there, the TopK is an operator of its
//! own that reads every row its input operator makes: with worker processes it waits for
//! its input complete (where a worker runs it), so the whole table crossed the exchange and
//! its bound pruned nothing (40,000 of 40,000 rows read in
//! `worker_answers::aggregate_bounds_prune_the_scan_tasks_after_them`).
//!
//! [`keeping_top_rows`] puts a copy of the TopK on top of its input operator's fragment:
//! each task (one split of a scan, one block) hands on its own first `n` rows at most, and
//! its bound, the TopK's dynamic filter (shared with the TopK above, which the scans
//! read), prunes the splits launched after it ([`crate::plan::task_bounds`]). The first
//! `n` rows of all the tasks' together are among the rows they hand on, so the merge above
//! gives the same rows. That holds for the merge's order and fetch only, so only a TopK
//! whose merge takes no more rows in the same order gets one ([`topk_over`]). The filters
//! and projections between the TopK and its exchange run in the input operator too, below
//! the copy; the TopK above reads the exchange directly.
//!
//! A TopK straight over a Parquet scan (no exchange between: a scan of as many file groups
//! as partitions) ran in the scan's own operator, one task per partition reading all its
//! rows, however large. Where the files are sorted by the TopK's first key the other way
//! (`ORDER BY ts DESC LIMIT 10` over files sorted by `ts`: the latest rows) and the scan's
//! splits outnumber its partitions, the copy goes to a source operator of its own, cut
//! into splits launched last first ([`wants_last_first`]), and the TopK reads its
//! partitions' blocks. `benches/topk.rs`, 4 million rows: 380–400 ms to 80–90 ms in threads
//! mode (vanilla DataFusion 360 ms), 463 ms to 290 ms with workers.

use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::physical_plan::{FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::{DataSource, DataSourceExec};
use datafusion::error::Result;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalSortExpr};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, replace_children_if_necessary,
};
use datafusion::physical_plan::{Partitioning, PlanProperties, SortOrderPushdownResult};

use crate::functions::accelerator::calls_accelerator_udf;

/// Where a merge reads a TopK's partitions: the TopK, the filters and projections between
/// it and what is below (top first), and that.
pub(crate) struct TopkOver<'a> {
    /// The TopK (`SortExec` with a fetch, each partition apart).
    pub topk: &'a SortExec,
    /// The TopK as a plan node.
    pub node: &'a Arc<dyn ExecutionPlan>,
    /// The filters and projections between the TopK and `below`, top first.
    pub between: Vec<Arc<dyn ExecutionPlan>>,
    /// What they read.
    pub below: Below<'a>,
}

/// What is below a TopK and the filters and projections it reads ([`TopkOver`]).
pub(crate) enum Below<'a> {
    /// A round-robin exchange.
    Exchange(&'a RepartitionExec),
    /// A Parquet scan, which the TopK's operator runs one task per partition of.
    Scan(&'a Arc<dyn ExecutionPlan>),
}

/// The TopK under `plan` where `plan` is a merge with a fetch of the TopK's partitions in
/// the TopK's order, taking no more rows than the TopK keeps, and the TopK reads a
/// round-robin exchange or a Parquet scan (through filters and projections, which its input
/// operator can run as well: a round-robin exchange reads no column).
pub(crate) fn topk_over(plan: &Arc<dyn ExecutionPlan>) -> Option<TopkOver<'_>> {
    let merge = plan.downcast_ref::<SortPreservingMergeExec>()?;
    let topk = merge.input().downcast_ref::<SortExec>()?;
    let takes_no_more = (merge.fetch()).is_some_and(|wanted| topk.fetch() >= Some(wanted));
    if !takes_no_more || !topk.preserve_partitioning() || merge.expr() != topk.expr() {
        return None;
    }
    let mut between = vec![];
    let mut node = topk.input();
    loop {
        if let Some(exchange) = node.downcast_ref::<RepartitionExec>() {
            let round_robin = matches!(exchange.partitioning(), Partitioning::RoundRobinBatch(_));
            return (round_robin && !exchange.preserve_order()).then_some(TopkOver {
                topk,
                node: merge.input(),
                between,
                below: Below::Exchange(exchange),
            });
        }
        if is_parquet_scan(node) {
            return Some(TopkOver {
                topk,
                node: merge.input(),
                between,
                below: Below::Scan(node),
            });
        }
        // Not a model's projection: it runs on the accelerator pool, in an operator of its own.
        let cpu_projection = node
            .downcast_ref::<ProjectionExec>()
            .is_some_and(|projection| {
                !(projection.expr().iter()).any(|e| calls_accelerator_udf(&e.expr))
            });
        let row_local = cpu_projection
            || node
                .downcast_ref::<FilterExec>()
                .is_some_and(|filter| filter.fetch().is_none());
        if !row_local {
            return None;
        }
        between.push(Arc::clone(node));
        node = node.children()[0];
    }
}

/// `order` (over the columns `between`'s top gives) over the columns of what `between` reads
/// (top first): through filters, and projections of plain columns; `None` where a key is
/// computed (DataFusion's filters do not pass a sort down: it goes to what is below them).
fn order_below(
    order: &[PhysicalSortExpr],
    between: &[Arc<dyn ExecutionPlan>],
) -> Option<Vec<PhysicalSortExpr>> {
    let mut order = order.to_vec();
    for node in between {
        let input = node.children()[0].schema();
        // Where each output column comes from in the node's input.
        let from: Vec<usize> = if let Some(filter) = node.downcast_ref::<FilterExec>() {
            match filter.projection() {
                Some(projection) => projection.to_vec(),
                None => (0..input.fields().len()).collect(),
            }
        } else {
            let projection = node.downcast_ref::<ProjectionExec>()?;
            (projection.expr().iter())
                .map(|e| e.expr.downcast_ref::<Column>().map(|c| c.index()))
                .collect::<Option<_>>()?
        };
        for key in &mut order {
            let column = key.expr.downcast_ref::<Column>()?;
            let index = *from.get(column.index())?;
            key.expr = Arc::new(Column::new(input.field(index).name(), index));
        }
    }
    Some(order)
}

/// Whether the TopK of `found` wants its scan's rows last first: the scan is sorted by the
/// TopK's first key the other way (`ORDER BY ts DESC` over files sorted by `ts`), read
/// through filters and projections of plain columns. Its splits are then launched last first,
/// as the returned [`LastFirst`] tells
/// ([`crate::plan::split_source::SplitSourceExec::read_last_first`]).
pub(crate) fn wants_last_first(found: &TopkOver<'_>) -> Option<LastFirst> {
    let scan = match &found.below {
        Below::Scan(scan) => *scan,
        Below::Exchange(exchange) if is_parquet_scan(exchange.input()) => exchange.input(),
        Below::Exchange(_) => return None,
    };
    let order = order_below(found.topk.expr(), &found.between)?;
    let sorted = scan.output_ordering()?;
    let (first, sorted) = (&order[0], sorted.first());
    let reversed = first.expr.as_ref() == sorted.expr.as_ref()
        && first.options.descending != sorted.options.descending;
    reversed.then(|| LastFirst {
        column: (sorted.expr.downcast_ref::<Column>()).map(|column| column.name().to_string()),
        largest_first: first.options.descending,
    })
}

/// Which of a scan's splits hold a TopK's first rows: the scan is sorted by `column` the
/// other way from the TopK
/// ([`crate::plan::split_source::SplitSourceExec::read_last_first`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastFirst {
    /// The column the files are sorted by (a column of the table), if the sort key is one.
    pub column: Option<String>,
    /// Whether the TopK wants the largest values first (the files ascend); else the
    /// smallest.
    pub largest_first: bool,
}

impl LastFirst {
    /// `splits` (single-partition scans) in the order to read them: the largest maximum
    /// of the column first (or smallest minimum), then the later byte range; the list's
    /// order reversed where a split has no statistics of the column.
    pub(crate) fn order(&self, splits: Vec<Arc<dyn ExecutionPlan>>) -> Vec<Arc<dyn ExecutionPlan>> {
        let reversed: Vec<_> = splits.into_iter().rev().collect();
        let reaches: Option<Vec<(ScalarValue, i64)>> =
            reversed.iter().map(|split| self.reach(split)).collect();
        let Some(reaches) = reaches else {
            return reversed;
        };
        let mut keyed: Vec<_> = reaches.into_iter().zip(reversed).collect();
        // Stable: splits that tie keep the reversed list's order.
        keyed.sort_by(|((a, a_start), _), ((b, b_start), _)| {
            let by_value = a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal);
            let by_value = match self.largest_first {
                true => by_value.reverse(),
                false => by_value,
            };
            by_value.then(b_start.cmp(a_start))
        });
        keyed.into_iter().map(|(_, split)| split).collect()
    }

    /// How far `split` reaches in the order the TopK wants: the largest maximum (or the
    /// smallest minimum) of the column over its files, and its latest byte range's start.
    fn reach(&self, split: &Arc<dyn ExecutionPlan>) -> Option<(ScalarValue, i64)> {
        let column = self.column.as_ref()?;
        let config = (split.downcast_ref::<DataSourceExec>())?
            .data_source()
            .downcast_ref::<FileScanConfig>()?;
        let index = (config.file_source().table_schema().table_schema())
            .index_of(column)
            .ok()?;
        let mut reach: Option<(ScalarValue, i64)> = None;
        for file in config.file_groups.iter().flat_map(|g| g.iter()) {
            let statistics = file.statistics.as_ref()?.column_statistics.get(index)?;
            let value = match self.largest_first {
                true => statistics.max_value.get_value(),
                false => statistics.min_value.get_value(),
            }?;
            if value.is_null() {
                return None;
            }
            let start = file.range.as_ref().map_or(0, |range| range.start);
            let further =
                reach
                    .as_ref()
                    .is_none_or(|(so_far, _)| match value.partial_cmp(so_far) {
                        Some(std::cmp::Ordering::Greater) => self.largest_first,
                        Some(std::cmp::Ordering::Less) => !self.largest_first,
                        _ => false,
                    });
            reach = match reach {
                Some((so_far, so_far_start)) if !further => Some((so_far, so_far_start.max(start))),
                _ => Some((value.clone(), start)),
            };
        }
        reach
    }
}

/// Whether `node` is a Parquet scan without a fetch (one a split source can cut).
fn is_parquet_scan(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<DataSourceExec>().is_some_and(|scan| {
        scan.fetch().is_none()
            && (scan.data_source().downcast_ref::<FileScanConfig>())
                .is_some_and(|config| config.file_source().file_type() == "parquet")
    })
}

/// The properties of a stage input that reads the tasks' first rows in place of `input`
/// (what the TopK read): `input`'s, without any ordering (a task's rows are sorted by the
/// TopK, one task after another).
pub(crate) fn unordered(input: &Arc<dyn ExecutionPlan>) -> Arc<PlanProperties> {
    let mut properties = input.properties().as_ref().clone();
    properties.eq_properties = EquivalenceProperties::new(input.schema());
    Arc::new(properties)
}

/// A copy of `topk` over `between` (top first) over `input` (its exchange's input, cut):
/// the first rows of each of `input`'s tasks, with the TopK's own dynamic filter (the one
/// the scans below read).
///
/// With `sort_pushdown` (`datafusion.optimizer.enable_sort_pushdown`), a scan below that
/// can read its row groups in a better order for the TopK (DataFusion's inexact sort
/// pushdown: a file sorted by `ts` read last row group first for `ORDER BY ts DESC`) does
/// so, so that the task's own bound prunes the rest of its split.
pub(crate) fn keeping_top_rows(
    topk: &SortExec,
    between: &[Arc<dyn ExecutionPlan>],
    input: Arc<dyn ExecutionPlan>,
    sort_pushdown: bool,
) -> Result<Arc<dyn ExecutionPlan>> {
    let mut input = input;
    if sort_pushdown
        && let Some(order) = order_below(topk.expr(), between)
        && let SortOrderPushdownResult::Inexact { inner } = input.try_pushdown_sort(&order)?
    {
        input = inner;
    }
    for node in between.iter().rev() {
        input = replace_children_if_necessary(Arc::clone(node), vec![input])?;
    }
    let copy = SortExec::new(topk.expr().clone(), input)
        .with_preserve_partitioning(true)
        .with_fetch(topk.fetch());
    #[allow(deprecated)] // DataFusion's other way returns the filter as a plain expression.
    let copy = match topk.dynamic_filter_expr() {
        Some(filter) => copy.with_dynamic_filter_expr(filter)?,
        None => copy,
    };
    Ok(Arc::new(copy))
}

/// `plan` with each TopK that reads a Parquet scan through filters and projections of plain
/// columns reading that scan's row groups in its order, where DataFusion's inexact sort
/// pushdown can (as [`keeping_top_rows`] and DataFusion's own rule plan it) and the scan
/// declares no order of its own: what a worker does to the plan it decodes, whose scans
/// lost that read order on the wire.
pub(crate) fn topks_read_in_their_order(
    plan: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_down(|node| {
        let Some(topk) = node
            .downcast_ref::<SortExec>()
            .filter(|s| s.fetch().is_some())
        else {
            return Ok(Transformed::no(node));
        };
        let mut between = vec![];
        let mut below = topk.input();
        while !is_parquet_scan(below) {
            let passes = below.downcast_ref::<FilterExec>().is_some()
                || below.downcast_ref::<ProjectionExec>().is_some();
            if !passes || below.children().len() != 1 {
                return Ok(Transformed::no(node));
            }
            between.push(Arc::clone(below));
            below = below.children()[0];
        }
        // A scan that still declares its files' order was not given the hint (the pushdown
        // gives that order up): it keeps it.
        let Some(order) =
            order_below(topk.expr(), &between).filter(|_| below.output_ordering().is_none())
        else {
            return Ok(Transformed::no(node));
        };
        // The file source alone: the scan's own pushdown would also reorder its files, which
        // a task's plan must read as planned.
        let Some(config) = below
            .downcast_ref::<DataSourceExec>()
            .and_then(|scan| scan.data_source().downcast_ref::<FileScanConfig>())
        else {
            return Ok(Transformed::no(node));
        };
        let eq_properties = DataSource::eq_properties(config);
        let SortOrderPushdownResult::Inexact { inner } = config
            .file_source()
            .try_pushdown_sort(&order, &eq_properties)?
        else {
            return Ok(Transformed::no(node));
        };
        let config = FileScanConfigBuilder::from(config.clone())
            .with_source(inner)
            .build();
        let mut input: Arc<dyn ExecutionPlan> = DataSourceExec::from_data_source(config);
        for above in between.iter().rev() {
            input = replace_children_if_necessary(Arc::clone(above), vec![input])?;
        }
        let read = replace_children_if_necessary(Arc::clone(&node), vec![input])?;
        Ok(Transformed::new(read, true, TreeNodeRecursion::Jump))
    })
    .map(|t| t.data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::compute::SortOptions;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::physical_expr::expressions::lit;
    use datafusion::physical_plan::empty::EmptyExec;
    use datafusion::physical_plan::filter::FilterExecBuilder;

    fn key(name: &str, index: usize, descending: bool) -> PhysicalSortExpr {
        let options = SortOptions {
            descending,
            nulls_first: false,
        };
        PhysicalSortExpr::new(Arc::new(Column::new(name, index)), options)
    }

    /// A sort over a filter that keeps `(id, name)` of `(id, k, name)` sorts the filter's
    /// input by `id@0, name@2`; a computed key has no column below.
    #[test]
    fn a_sort_maps_through_a_filters_projection_and_stops_at_a_computed_key() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("k", DataType::Int64, false),
            Field::new("name", DataType::Utf8, false),
        ]));
        let scan: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(schema));
        let filter: Arc<dyn ExecutionPlan> = Arc::new(
            FilterExecBuilder::new(lit(true), Arc::clone(&scan))
                .apply_projection(Some(vec![0, 2]))
                .unwrap()
                .build()
                .unwrap(),
        );
        let order = [key("name", 1, true), key("id", 0, false)];
        let below = order_below(&order, &[Arc::clone(&filter)]).unwrap();
        let shown: Vec<String> = below.iter().map(|k| k.to_string()).collect();
        assert_eq!(shown, ["name@2 DESC NULLS LAST", "id@0 ASC NULLS LAST"]);
        let projection: Arc<dyn ExecutionPlan> = Arc::new(
            ProjectionExec::try_new(
                vec![(
                    Arc::new(datafusion::physical_expr::expressions::BinaryExpr::new(
                        Arc::new(Column::new("id", 0)),
                        datafusion::logical_expr::Operator::Plus,
                        lit(1i64),
                    )) as _,
                    "id1".to_string(),
                )],
                scan,
            )
            .unwrap(),
        );
        assert!(order_below(&[key("id1", 0, false)], &[projection]).is_none());
    }

    /// The splits a TopK wants first are found by the files' statistics of the sort
    /// column, whatever order the list holds them in (DataFusion's sort pushdown may have
    /// reversed it already), a file's later byte range before its earlier one; without
    /// statistics, the list reversed.
    #[test]
    fn the_last_splits_are_found_by_statistics() {
        use crate::plan::split_pruning::tests::{file_of, filtered_scan};
        use datafusion::datasource::listing::PartitionedFile;
        use datafusion::datasource::physical_plan::FileGroup;
        use datafusion::physical_expr::expressions::lit;
        let split = |file: PartitionedFile| {
            let config = FileScanConfigBuilder::from(filtered_scan(lit(true)))
                .with_file_groups(vec![FileGroup::new(vec![file])])
                .build();
            DataSourceExec::from_data_source(config) as Arc<dyn ExecutionPlan>
        };
        let ranged = |min, max, start| file_of("x", Some((min, max))).with_range(start, start + 10);
        // Files [10, 19], [0, 9], [30, 39] in two ranges, [20, 29]: as listed.
        let splits = || {
            vec![
                split(ranged(10, 19, 0)),
                split(ranged(0, 9, 0)),
                split(ranged(30, 39, 0)),
                split(ranged(30, 39, 10)),
                split(ranged(20, 29, 0)),
            ]
        };
        let as_read = |order: Vec<Arc<dyn ExecutionPlan>>| -> Vec<(i64, i64)> {
            (order.iter())
                .map(|split| {
                    let config = (split.downcast_ref::<DataSourceExec>().unwrap())
                        .data_source()
                        .downcast_ref::<FileScanConfig>()
                        .unwrap();
                    let file = &config.file_groups[0].files()[0];
                    let min = file.statistics.as_ref().unwrap().column_statistics[0]
                        .min_value
                        .get_value()
                        .cloned();
                    let min = match min {
                        Some(ScalarValue::Int64(Some(min))) => min,
                        other => panic!("{other:?}"),
                    };
                    (min, file.range.as_ref().unwrap().start)
                })
                .collect()
        };
        let largest = LastFirst {
            column: Some("a".into()),
            largest_first: true,
        };
        assert_eq!(
            as_read(largest.order(splits())),
            [(30, 10), (30, 0), (20, 0), (10, 0), (0, 0)]
        );
        let smallest = LastFirst {
            largest_first: false,
            ..largest.clone()
        };
        assert_eq!(
            as_read(smallest.order(splits())),
            [(0, 0), (10, 0), (20, 0), (30, 10), (30, 0)]
        );
        // Not a column with statistics: the list, reversed.
        let unknown = LastFirst {
            column: Some("b".into()),
            ..largest
        };
        assert_eq!(
            as_read(unknown.order(splits())),
            [(20, 0), (30, 10), (30, 0), (0, 0), (10, 0)]
        );
    }
}
