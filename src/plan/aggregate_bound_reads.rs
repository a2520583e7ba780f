//! Scans read an aggregate's bound only where it is a bound of every aggregate.
//!
//! DataFusion 55 gives an aggregate without groups whose aggregates are `min`/`max` a
//! dynamic filter that its scans prune by: `x < min_so_far OR y > max_so_far`, one term per
//! aggregate. It leaves a term out while that aggregate has seen no value, and never has one
//! for a `min`/`max` of an expression (`max(y + 1)`). The filter then drops rows that could
//! still lower or raise the aggregate without a term: in `SELECT min(dt), min(ts) FROM a`,
//! a task that read only rows with a NULL `ts` (a file written before `ts` was added) made
//! `dt < '2023-12-09'`, and the tasks after it skipped the row groups that held the smallest
//! `ts`. (Vanilla DataFusion has the same fault, narrower: its partitions share one bound.)
//!
//! [`ReadOnlyWholeAggregateBounds`], a physical optimizer rule after DataFusion's filter
//! pushdown, changes how the scans and filters below an aggregate of more than one
//! aggregate expression read its filter:
//! - where every aggregate is a `min` or `max` of a column, they read it through
//!   [`CompleteBounds`]: each bound in it counts only when it has every aggregate's term, and
//!   reads as `true` while one is missing;
//! - otherwise (a `min`/`max` of an expression, which never gets a term) the filter reads as
//!   `true`.
//!
//! An aggregate of one `min` or `max` keeps its filter as it is: with no value seen its
//! filter is `true`.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::{ColumnarValue, Operator};
use datafusion::physical_expr::expressions::{
    BinaryExpr, Column, DynamicFilterPhysicalExpr, Literal, lit,
};
use datafusion::physical_expr::{conjunction, split_conjunction};
use datafusion::physical_expr_common::physical_expr::snapshot_physical_expr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};

use crate::plan::dynamic_filters::map_predicates;

/// A reader's view of the dynamic filter of an aggregate of several `min`/`max` of columns:
/// the filter (in a task, the bounds the task starts from and its own, ANDed) with each
/// bound in it that leaves out an aggregate's term read as `true`.
#[derive(Debug, Eq)]
pub struct CompleteBounds {
    /// What is read: the filter, or what a task reads in its place.
    bounds: Arc<dyn PhysicalExpr>,
    /// Each aggregate's column on the reader's side, whose term is `column < value` for a
    /// `min` and `column > value` for a `max` (`terms_of[i]`).
    columns: Vec<Arc<dyn PhysicalExpr>>,
    /// Each aggregate's comparison, in the order of `columns`.
    terms_of: Vec<Operator>,
}

impl CompleteBounds {
    /// `bounds` read as complete bounds of aggregates on `columns` with comparisons
    /// `terms_of` (`<` for a `min`, `>` for a `max`).
    pub fn new(
        bounds: Arc<dyn PhysicalExpr>,
        columns: Vec<Arc<dyn PhysicalExpr>>,
        terms_of: Vec<Operator>,
    ) -> Result<Self> {
        if columns.len() != terms_of.len()
            || !terms_of
                .iter()
                .all(|op| matches!(op, Operator::Lt | Operator::Gt))
        {
            return Err(DataFusionError::Internal(format!(
                "complete bounds of {} columns with comparisons {terms_of:?}",
                columns.len()
            )));
        }
        Ok(Self {
            bounds,
            columns,
            terms_of,
        })
    }

    /// Each aggregate's comparison: `<` for a `min`, `>` for a `max`.
    pub fn terms_of(&self) -> &[Operator] {
        &self.terms_of
    }

    /// What is read now: the bounds at their current values, less those missing a term.
    fn now(&self) -> Result<Arc<dyn PhysicalExpr>> {
        let value = snapshot_physical_expr(Arc::clone(&self.bounds))?;
        let whole = split_conjunction(&value)
            .into_iter()
            .filter(|bound| self.has_every_term(bound))
            .cloned();
        Ok(conjunction(whole))
    }

    /// Whether `bound` compares each aggregate's column to a literal the way its term does.
    fn has_every_term(&self, bound: &Arc<dyn PhysicalExpr>) -> bool {
        let mut terms = vec![];
        let _ = bound.apply(|e| {
            if let Some(cmp) = e.downcast_ref::<BinaryExpr>()
                && cmp.right().downcast_ref::<Literal>().is_some()
            {
                terms.push((Arc::clone(cmp.left()), *cmp.op()));
            }
            Ok(TreeNodeRecursion::Continue)
        });
        (self.columns.iter().zip(&self.terms_of))
            .all(|(column, op)| terms.iter().any(|(c, o)| c == column && o == op))
    }
}

impl PartialEq for CompleteBounds {
    fn eq(&self, other: &Self) -> bool {
        self.bounds.as_ref() == other.bounds.as_ref()
            && self.terms_of == other.terms_of
            && (self.columns.iter().zip(&other.columns)).all(|(a, b)| a.as_ref() == b.as_ref())
            && self.columns.len() == other.columns.len()
    }
}

impl Hash for CompleteBounds {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.bounds.hash(state);
        self.columns.hash(state);
        self.terms_of.hash(state);
    }
}

impl fmt::Display for CompleteBounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "complete_bounds({})", self.bounds)
    }
}

impl PhysicalExpr for CompleteBounds {
    fn data_type(&self, _input_schema: &Schema) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn nullable(&self, _input_schema: &Schema) -> Result<bool> {
        Ok(true)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        self.now()?.evaluate(batch)
    }

    /// The bounds, then the aggregates' columns (so that a rewrite of the reader's columns
    /// reaches both).
    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        std::iter::once(&self.bounds).chain(&self.columns).collect()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let Some((bounds, columns)) = children.split_first() else {
            return Err(DataFusionError::Internal(
                "complete bounds with no child".into(),
            ));
        };
        Ok(Arc::new(Self::new(
            Arc::clone(bounds),
            columns.to_vec(),
            self.terms_of.clone(),
        )?))
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "complete_bounds(")?;
        self.bounds.fmt_sql(f)?;
        write!(f, ")")
    }

    /// The bounds read now: what pruning and a worker's copy see.
    fn snapshot(&self) -> Result<Option<Arc<dyn PhysicalExpr>>> {
        self.now().map(Some)
    }
}

/// How the readers of an aggregate's filter read it ([`ReadOnlyWholeAggregateBounds`]).
enum Reading {
    /// Through [`CompleteBounds`], with each aggregate's comparison.
    Complete(Vec<Operator>),
    /// As `true`.
    Not,
}

/// How the readers of each filter made by an aggregate of more than one aggregate
/// expression in `plan` read it, by the filter's id.
fn readings(plan: &Arc<dyn ExecutionPlan>) -> Result<HashMap<u64, Reading>> {
    let mut readings = HashMap::new();
    plan.apply(|node| {
        if let Some(aggregate) = node.downcast_ref::<AggregateExec>()
            && aggregate.aggr_expr().len() > 1
        {
            // Every aggregate a `min`/`max` of a column: each has a term once it has a value.
            let terms_of: Option<Vec<Operator>> = (aggregate.aggr_expr().iter())
                .map(|aggregate| {
                    let of_column = matches!(aggregate.expressions().as_slice(), [arg] if arg.downcast_ref::<Column>().is_some());
                    let name = aggregate.fun().name();
                    match (of_column, name) {
                        (true, n) if n.eq_ignore_ascii_case("min") => Some(Operator::Lt),
                        (true, n) if n.eq_ignore_ascii_case("max") => Some(Operator::Gt),
                        _ => None,
                    }
                })
                .collect();
            for filter in node.dynamic_expressions_produced() {
                if let Some(id) = filter.expression_id() {
                    let reading = match &terms_of {
                        Some(terms_of) => Reading::Complete(terms_of.clone()),
                        None => Reading::Not,
                    };
                    readings.insert(id, reading);
                }
            }
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    Ok(readings)
}

/// `predicate` reading each filter of `readings` as it says.
fn read_by(
    predicate: &Arc<dyn PhysicalExpr>,
    readings: &HashMap<u64, Reading>,
) -> Result<Transformed<Arc<dyn PhysicalExpr>>> {
    Arc::clone(predicate).transform_down(|expr| {
        if expr.downcast_ref::<CompleteBounds>().is_some() {
            return Ok(Transformed::new(expr, false, TreeNodeRecursion::Jump));
        }
        let reading = (expr.downcast_ref::<DynamicFilterPhysicalExpr>().is_some())
            .then(|| expr.expression_id().and_then(|id| readings.get(&id)))
            .flatten();
        let read: Arc<dyn PhysicalExpr> = match reading {
            None => return Ok(Transformed::no(expr)),
            Some(Reading::Not) => lit(true),
            Some(Reading::Complete(terms_of)) => {
                let columns = expr.children().into_iter().cloned().collect::<Vec<_>>();
                match columns.len() == terms_of.len() {
                    true => Arc::new(CompleteBounds::new(expr, columns, terms_of.clone())?),
                    false => lit(true),
                }
            }
        };
        Ok(Transformed::new(read, true, TreeNodeRecursion::Jump))
    })
}

/// Physical optimizer rule: the filters of aggregates of several aggregate expressions are
/// read whole or not at all by the scans and filters they were pushed into (see the module
/// doc).
#[derive(Debug, Default)]
pub struct ReadOnlyWholeAggregateBounds;

impl PhysicalOptimizerRule for ReadOnlyWholeAggregateBounds {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let readings = readings(&plan)?;
        if readings.is_empty() {
            return Ok(plan);
        }
        plan.transform_up(|node| map_predicates(node, &mut |p| read_by(p, &readings)))
            .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "read_only_whole_aggregate_bounds"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::dynamic_filters::tests::plan_in_partitions;
    use datafusion::physical_plan::displayable;

    /// The scan line of `sql`'s plan in vanilla DataFusion (over `t(a)`, 0 to 99), before and
    /// after the rule.
    async fn scan_before_and_after(sql: &str) -> (String, String) {
        let (_dir, plan) = plan_in_partitions(sql, 2).await;
        let scan = |plan: &Arc<dyn ExecutionPlan>| {
            let shown = displayable(plan.as_ref()).indent(true).to_string();
            (shown.lines())
                .find(|l| l.contains("DataSourceExec"))
                .unwrap()
                .to_string()
        };
        let after = ReadOnlyWholeAggregateBounds
            .optimize(Arc::clone(&plan), &ConfigOptions::default())
            .unwrap();
        (scan(&plan), scan(&after))
    }

    /// (A filter keeps the answers from coming from the file's statistics.)
    #[tokio::test]
    async fn a_scan_reads_whole_bounds_of_several_aggregates_and_none_of_an_expression() {
        let (before, after) = scan_before_and_after("SELECT min(a) FROM t WHERE a <> 5").await;
        assert!(before.contains("DynamicFilter"), "{before}");
        assert!(after.contains("DynamicFilter") && !after.contains("complete_bounds"));
        let sql = "SELECT min(a), max(a) FROM t WHERE a <> 5";
        let (before, after) = scan_before_and_after(sql).await;
        assert!(before.contains("DynamicFilter"), "{before}");
        assert!(after.contains("complete_bounds(DynamicFilter"), "{after}");
        let sql = "SELECT min(a + 1), max(a) FROM t WHERE a <> 5";
        let (before, after) = scan_before_and_after(sql).await;
        assert!(before.contains("DynamicFilter"), "{before}");
        assert!(!after.contains("DynamicFilter"), "{after}");
    }

    fn column(name: &str, index: usize) -> Arc<dyn PhysicalExpr> {
        Arc::new(Column::new(name, index))
    }

    fn cmp(c: Arc<dyn PhysicalExpr>, op: Operator, v: i64) -> Arc<dyn PhysicalExpr> {
        Arc::new(BinaryExpr::new(c, op, lit(v)))
    }

    fn join(
        a: Arc<dyn PhysicalExpr>,
        op: Operator,
        b: Arc<dyn PhysicalExpr>,
    ) -> Arc<dyn PhysicalExpr> {
        Arc::new(BinaryExpr::new(a, op, b))
    }

    #[test]
    fn a_bound_missing_an_aggregates_term_reads_as_true() {
        let (x, y) = (column("x", 0), column("y", 1));
        let filter = Arc::new(DynamicFilterPhysicalExpr::new(
            vec![Arc::clone(&x), Arc::clone(&y)],
            lit(true),
        ));
        let read = CompleteBounds::new(
            Arc::clone(&filter) as Arc<dyn PhysicalExpr>,
            vec![Arc::clone(&x), Arc::clone(&y)],
            vec![Operator::Lt, Operator::Gt],
        )
        .unwrap();
        let now = || read.snapshot().unwrap().unwrap().to_string();
        assert_eq!(now(), "true");
        // `min(x)` has a value, `max(y)` none yet: rows that could raise `max(y)` are kept.
        filter.update(cmp(Arc::clone(&x), Operator::Lt, 5)).unwrap();
        assert_eq!(now(), "true");
        let whole = join(
            cmp(Arc::clone(&x), Operator::Lt, 5),
            Operator::Or,
            cmp(Arc::clone(&y), Operator::Gt, 9),
        );
        filter.update(Arc::clone(&whole)).unwrap();
        assert_eq!(now(), "x@0 < 5 OR y@1 > 9");
        // A task's bounds from its start ANDed with its own: each read on its own.
        let partial = cmp(Arc::clone(&x), Operator::Lt, 3);
        let task = CompleteBounds::new(
            join(partial, Operator::And, whole),
            vec![x, y],
            vec![Operator::Lt, Operator::Gt],
        )
        .unwrap();
        assert_eq!(
            task.snapshot().unwrap().unwrap().to_string(),
            "x@0 < 5 OR y@1 > 9"
        );
    }
}
