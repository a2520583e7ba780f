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
//! whose merge takes no more rows in the same order gets one ([`topk_over_exchange`]). The
//! filters and projections between the TopK and its exchange run in the input operator
//! too, below the copy; the TopK above reads the exchange directly.

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::{ExecutionPlan, replace_children_if_necessary};
use datafusion::physical_plan::{Partitioning, SortOrderPushdownResult};

use crate::functions::accelerator::calls_accelerator_udf;

/// Where a merge reads a TopK's partitions: the TopK, the filters and projections between
/// it and the exchange below it (top first), and that exchange.
pub(crate) struct TopkOverExchange<'a> {
    /// The TopK (`SortExec` with a fetch, each partition apart).
    pub topk: &'a SortExec,
    /// The filters and projections between the TopK and the exchange, top first.
    pub between: Vec<Arc<dyn ExecutionPlan>>,
    /// The round-robin exchange.
    pub exchange: &'a RepartitionExec,
}

/// The TopK under `plan` where `plan` is a merge with a fetch of the TopK's partitions in
/// the TopK's order, taking no more rows than the TopK keeps, and the TopK reads a
/// round-robin exchange (through filters and projections, which its input operator can run
/// as well: a round-robin exchange reads no column).
pub(crate) fn topk_over_exchange(plan: &Arc<dyn ExecutionPlan>) -> Option<TopkOverExchange<'_>> {
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
            return (round_robin && !exchange.preserve_order()).then_some(TopkOverExchange {
                topk,
                between,
                exchange,
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
    // DataFusion's filters do not pass a sort down, but keep their input's columns: the
    // sort goes to what is below them.
    let only_filters = (between.iter()).all(|node| node.downcast_ref::<FilterExec>().is_some());
    let mut input = input;
    if sort_pushdown
        && only_filters
        && let SortOrderPushdownResult::Inexact { inner } = input.try_pushdown_sort(topk.expr())?
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
