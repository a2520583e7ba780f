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
//! [`with_own_dynamic_filters`] gives a copy fresh filters where sharing changes an answer:
//! an aggregate's and a TopK's filter is a bound from the rows seen so far, so another copy's
//! bound drops rows equal to it that this copy still needs. A hash join's filter is
//! filled once from its whole build side, the same in every copy, so it is shared as it is.

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::physical_plan::{
    FileScanConfig, FileScanConfigBuilder, FileSource, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::physical_expr::expressions::{DynamicFilterPhysicalExpr, lit};
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::filter::{FilterExec, FilterExecBuilder};
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};

/// `plan` with the dynamic filters of its aggregates and TopK sorts replaced by fresh ones,
/// in those nodes and in every predicate below them that reads them: a copy of a plan that
/// can run beside the original (or another copy) without either pruning by the other's
/// bound.
pub fn with_own_dynamic_filters(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    // Fresh filters by the expression id of the filter they replace. A producer sits above
    // the scans that read its filter, so a walk from the top renews it before meeting them.
    let mut fresh: HashMap<u64, Arc<dyn PhysicalExpr>> = HashMap::new();
    plan.transform_down(|node| {
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
        if produced.is_empty() {
            return Ok(read);
        }
        let renewed: Arc<dyn ExecutionPlan> =
            if let Some(aggregate) = read.data.downcast_ref::<AggregateExec>() {
                let own = produced.iter().map(|filter| {
                    let children = filter.children().into_iter().cloned().collect();
                    Arc::new(DynamicFilterPhysicalExpr::new(children, lit(true)))
                });
                let mut aggregate = aggregate.clone();
                for filter in own {
                    aggregate = aggregate.with_dynamic_filter_expr(filter)?;
                }
                Arc::new(aggregate)
            } else if read.data.downcast_ref::<SortExec>().is_some() {
                // DataFusion's own reset, for running a plan again, makes a new TopK filter.
                Arc::clone(&read.data).reset_state()?
            } else {
                return Ok(read);
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

/// `node` with `map` applied to its own predicates that can read a dynamic filter: a
/// `FilterExec`'s and a Parquet scan's. Other nodes come back as they are.
pub(crate) fn map_predicates(
    node: Arc<dyn ExecutionPlan>,
    map: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<Transformed<Arc<dyn PhysicalExpr>>>,
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
