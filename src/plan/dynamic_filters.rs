//! Dynamic filters in plans flumen copies: a copy that runs beside the original gets filters
//! of its own, and one place rewrites the predicates that read them.
//!
//! DataFusion's `AggregateExec` (`min`/`max` without groups), TopK `SortExec` and
//! `HashJoinExec` produce dynamic filters that the scans below them read. A filter is shared
//! state: every node holding it sees every update. DataFusion runs a plan once, so that is
//! the point. flumen's cut runs an uncorrelated scalar subquery once per operator that reads
//! its value (TPC-H q22's, or `x > (SELECT max(w) FROM b)` read both by the scan's pruning
//! predicate and by the filter above it): with the copies sharing their filters, the first
//! copy's `max(w)` (98) made the second copy's scan skip every row with `w <= 98`, its
//! `max(w)` came out NULL, and the query failed for two different values.
//!
//! The same holds for the tasks of one operator, which all run partitions of one plan:
//! [`for_one_task`] gives each task's run its own bounds, so a run again repeats it.
//!
//! [`with_own_dynamic_filters`] gives a copy fresh filters where sharing changes an answer:
//! an aggregate's and a TopK's filter is a bound from the rows seen so far, so another copy's
//! bound drops rows equal to it that this copy still needs. A hash join's filter is
//! filled once from its whole build side, the same in every copy, so it is shared as it is.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::physical_plan::{
    FileScanConfig, FileScanConfigBuilder, FileSource, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::physical_expr::expressions::{DynamicFilterPhysicalExpr, lit};
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::filter::{FilterExec, FilterExecBuilder};
use datafusion::physical_plan::joins::{CrossJoinExec, HashJoinExec, NestedLoopJoinExec};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};

/// `plan` with the dynamic filters of its aggregates and TopK sorts replaced by fresh ones,
/// in those nodes and in every predicate below them that reads them: a copy of a plan that
/// can run beside the original (or another copy) without either pruning by the other's
/// bound.
pub fn with_own_dynamic_filters(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    renew_bounds(plan, false)
}

/// The plan one task of an operator runs: `fragment` with dynamic filters of its own for
/// its aggregates and TopK sorts, so that what the task makes depends on its input alone.
/// Shared by the operator's tasks, such a filter is a bound from whichever rows any task
/// has seen so far: a task's `TopK` kept fewer rows once another's bound was tighter, and a
/// task run again (for a lost block, or after refused memory) met its own first run's
/// bound, cut other blocks than the first time, or panicked (DataFusion's TopK counts the
/// partitions that finish). Bounds made in a task therefore no longer prune other
/// operators' scans.
///
/// Joins and repartitions are kept as they are, with what is below them: their partitions
/// share one build side or one input, so they must stay one node. A scan below a join that
/// read a bound renewed above it reads the old one, which no task fills any more; a bound
/// made below a join stays shared.
pub fn for_one_task(fragment: &Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    let produces_bounds = fragment
        .exists(|node| Ok(renewable(node) && !node.dynamic_expressions_produced().is_empty()))
        .unwrap_or(false);
    if !produces_bounds {
        return Ok(Arc::clone(fragment));
    }
    renew_bounds(Arc::clone(fragment), true)
}

/// Whether `node` makes a bound [`renew_bounds`] renews: an aggregate's or a TopK's.
fn renewable(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<AggregateExec>().is_some() || node.downcast_ref::<SortExec>().is_some()
}

/// Whether `node`'s partitions share state, so that it must not be rebuilt for a task.
fn shared_by_partitions(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<HashJoinExec>().is_some()
        || node.downcast_ref::<NestedLoopJoinExec>().is_some()
        || node.downcast_ref::<CrossJoinExec>().is_some()
        || node.downcast_ref::<RepartitionExec>().is_some()
}

/// `plan` with fresh bounds for its aggregates and TopK sorts, and the predicates below
/// them rewired to read them; with `keep_shared`, nodes whose partitions share state (and
/// all below them) are left as they are.
fn renew_bounds(plan: Arc<dyn ExecutionPlan>, keep_shared: bool) -> Result<Arc<dyn ExecutionPlan>> {
    // Fresh filters by the expression id of the filter they replace. A producer sits above
    // the scans that read its filter, so a walk from the top renews it before meeting them.
    let mut fresh: HashMap<u64, Arc<dyn PhysicalExpr>> = HashMap::new();
    plan.transform_down(|node| {
        if keep_shared && shared_by_partitions(&node) {
            return Ok(Transformed::new(node, false, TreeNodeRecursion::Jump));
        }
        let read = map_predicates(node, &mut |predicate| {
            Arc::clone(predicate).transform_down(|e| {
                let renewed = (e.downcast_ref::<DynamicFilterPhysicalExpr>().is_some())
                    .then(|| e.expression_id().and_then(|id| fresh.get(&id)))
                    .flatten();
                match renewed {
                    // The fresh filter on this reader's own columns.
                    Some(filter) => {
                        let children = e.children().into_iter().cloned().collect();
                        Ok(Transformed::yes(
                            Arc::clone(filter).with_new_children(children)?,
                        ))
                    }
                    None => Ok(Transformed::no(e)),
                }
            })
        })?;
        let produced = read.data.dynamic_expressions_produced();
        if produced.is_empty() || !renewable(&read.data) {
            return Ok(read);
        }
        // A fresh filter on the columns the old one reads (the node's own metrics stay
        // shared, so `EXPLAIN ANALYZE` still shows what every copy did).
        let fresh_filter = |old: &Arc<dyn PhysicalExpr>| {
            let children = old.children().into_iter().cloned().collect();
            Arc::new(DynamicFilterPhysicalExpr::new(children, lit(true)))
        };
        let renewed: Arc<dyn ExecutionPlan> = match (
            read.data.downcast_ref::<AggregateExec>(),
            read.data.downcast_ref::<SortExec>(),
            produced.as_slice(),
        ) {
            (Some(aggregate), _, [old]) => Arc::new(
                aggregate
                    .clone()
                    .with_dynamic_filter_expr(fresh_filter(old))?,
            ),
            (_, Some(sort), [old]) => {
                Arc::new(sort.clone().with_dynamic_filter_expr(fresh_filter(old))?)
            }
            _ => return Ok(read),
        };
        for (old, new) in produced.iter().zip(renewed.dynamic_expressions_produced()) {
            if let Some(id) = old.expression_id() {
                fresh.insert(id, new);
            }
        }
        Ok(Transformed::yes(renewed))
    })
    .map(|t| t.data)
}

/// What [`map_predicates`] applies to a predicate.
pub(crate) type PredicateMap<'a> =
    dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<Transformed<Arc<dyn PhysicalExpr>>> + 'a;

/// `node` with `map` applied to its own predicates that can read a dynamic filter: a
/// `FilterExec`'s and a Parquet scan's. Other nodes come back as they are.
pub(crate) fn map_predicates(
    node: Arc<dyn ExecutionPlan>,
    map: &mut PredicateMap<'_>,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    if let Some(filter) = node.downcast_ref::<FilterExec>() {
        let predicate = map(filter.predicate())?;
        if predicate.transformed {
            let rebuilt = FilterExecBuilder::from(filter)
                .with_predicate(predicate.data)
                .build()?;
            return Ok(Transformed::yes(Arc::new(rebuilt)));
        }
    }
    if let Some(config) = node
        .downcast_ref::<DataSourceExec>()
        .and_then(|scan| scan.data_source().downcast_ref::<FileScanConfig>())
        && let Some(parquet) = config.file_source().downcast_ref::<ParquetSource>()
        && let Some(predicate) = parquet.filter()
    {
        let predicate = map(&predicate)?;
        if predicate.transformed {
            let source = Arc::new(parquet.with_predicate(predicate.data));
            let config = FileScanConfigBuilder::from(config.clone())
                .with_source(source)
                .build();
            return Ok(Transformed::yes(DataSourceExec::from_data_source(config)));
        }
    }
    Ok(Transformed::no(node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::prelude::{ParquetReadOptions, SessionContext};

    /// The ids of the dynamic filters `plan`'s nodes produce, and of those its scans and
    /// filters read.
    fn filter_ids(plan: &Arc<dyn ExecutionPlan>) -> (Vec<u64>, Vec<u64>) {
        let (mut produced, mut read) = (vec![], vec![]);
        let _ = plan.apply(|node| {
            produced.extend(
                node.dynamic_expressions_produced()
                    .iter()
                    .filter_map(|e| e.expression_id()),
            );
            let _ = map_predicates(Arc::clone(node), &mut |predicate| {
                let _ = predicate.apply(|e| {
                    if e.downcast_ref::<DynamicFilterPhysicalExpr>().is_some() {
                        read.extend(e.expression_id());
                    }
                    Ok(TreeNodeRecursion::Continue)
                });
                Ok(Transformed::no(Arc::clone(predicate)))
            });
            Ok(TreeNodeRecursion::Continue)
        });
        (produced, read)
    }

    /// DataFusion's plan of `sql` over `t(a)`, one Parquet file of 0..100.
    async fn plan_of(sql: &str) -> (tempfile::TempDir, Arc<dyn ExecutionPlan>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.parquet");
        let batch = RecordBatch::try_from_iter([(
            "a",
            Arc::new(Int64Array::from_iter_values(0..100)) as _,
        )])
        .unwrap();
        let mut writer = datafusion::parquet::arrow::ArrowWriter::try_new(
            std::fs::File::create(&path).unwrap(),
            batch.schema(),
            None,
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        let ctx = SessionContext::new();
        ctx.register_parquet("t", path.to_str().unwrap(), ParquetReadOptions::default())
            .await
            .unwrap();
        let plan = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        (dir, plan)
    }

    #[tokio::test]
    async fn a_task_gets_its_own_topk_bound_in_its_sort_and_its_scan() {
        let (_dir, plan) = plan_of("SELECT a FROM t ORDER BY a DESC LIMIT 3").await;
        let (produced, read) = filter_ids(&plan);
        assert_eq!(produced.len(), 1, "the TopK makes a bound");
        assert_eq!(read, produced, "the scan prunes with it");
        let (first, second) = (for_one_task(&plan).unwrap(), for_one_task(&plan).unwrap());
        let ((first_made, first_read), (second_made, _)) =
            (filter_ids(&first), filter_ids(&second));
        assert_eq!(
            first_made, first_read,
            "the task's scan reads the task's own bound"
        );
        assert_ne!(first_made, produced);
        assert_ne!(first_made, second_made, "each task has its own");
        // The original plan is left as it was.
        assert_eq!(filter_ids(&plan), (produced.clone(), produced));
    }

    #[tokio::test]
    async fn a_plan_without_bounds_is_run_as_it_is() {
        let (_dir, plan) = plan_of("SELECT a, count(*) FROM t GROUP BY a").await;
        assert!(Arc::ptr_eq(&for_one_task(&plan).unwrap(), &plan));
    }

    #[tokio::test]
    async fn a_copied_max_gets_its_own_bound() {
        let (_dir, plan) = plan_of("SELECT max(a) FROM t WHERE a % 2 = 0").await;
        let (produced, read) = filter_ids(&plan);
        assert_eq!(
            (produced.len(), read.len()),
            (1, 1),
            "the aggregate's bound reaches the scan"
        );
        let copy = with_own_dynamic_filters(Arc::clone(&plan)).unwrap();
        let (made, read_in_copy) = filter_ids(&copy);
        assert_eq!(made, read_in_copy);
        assert_ne!(made, produced);
    }
}
