//! `SubqueryValuesExec`: an operator's fragment that reads uncorrelated scalar subqueries'
//! values from their own operators.
//!
//! DataFusion plans `x > (SELECT avg(y) FROM t)` as a `ScalarSubqueryExec` whose children
//! are the main plan and the subquery plans: it runs the subqueries first and puts their
//! values in a shared container that the `ScalarSubqueryExpr`s of the main plan read. Kept
//! whole, that node made its whole subtree one operator (TPC-H q11, q15 and q22 ran as one
//! task). The cut instead makes each subquery plan operators of its own, drops the
//! `ScalarSubqueryExec`, and wraps every operator fragment that reads the container in this
//! node, whose extra children are gathered stage inputs of those subquery operators: the
//! operator waits for them like for any input, and before its input runs, this node reads
//! each one's single row and sets the value in the container.
//!
//! On a worker, the task plan carries this node as DataFusion's own `ScalarSubqueryExec`
//! over the in-memory blocks ([`SubqueryValuesExec::as_scalar_subquery`]): datafusion-proto
//! decodes it with a fresh container shared by the decoded expressions.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::physical_planning_context::ScalarSubqueryResults;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::scalar_subquery::ScalarSubqueryExpr;
use datafusion::physical_plan::scalar_subquery::{ScalarSubqueryExec, ScalarSubqueryLink};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::TryStreamExt;
use tokio::sync::OnceCell;

/// Its input's partitions, unchanged, once the values of the scalar subqueries its input
/// reads are in `results` (read from `subqueries`, each a plan of one partition yielding
/// at most one row of one column).
#[derive(Debug)]
pub struct SubqueryValuesExec {
    input: Arc<dyn ExecutionPlan>,
    /// Each subquery's plan (a stage input, or the in-memory blocks standing for it) and its
    /// slot in `results`.
    subqueries: Vec<ScalarSubqueryLink>,
    results: ScalarSubqueryResults,
    /// Whether the values were set (once per node: its partitions share it, as they share
    /// one read of a gathered input).
    values_set: Arc<OnceCell<std::result::Result<(), Arc<DataFusionError>>>>,
}

impl SubqueryValuesExec {
    /// `input`, run once `subqueries` have set their values in `results`.
    pub fn new(
        input: Arc<dyn ExecutionPlan>,
        subqueries: Vec<ScalarSubqueryLink>,
        results: ScalarSubqueryResults,
    ) -> Self {
        Self {
            input,
            subqueries,
            results,
            values_set: Arc::default(),
        }
    }

    /// The plan whose partitions it passes on.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// This node as DataFusion's `ScalarSubqueryExec` (what a worker decodes and runs).
    pub fn as_scalar_subquery(&self) -> Arc<dyn ExecutionPlan> {
        Arc::new(ScalarSubqueryExec::new(
            Arc::clone(&self.input),
            self.subqueries.clone(),
            self.results.clone(),
        ))
    }

    /// Read each subquery's value and put it in the container, unless an earlier reader
    /// put it there (the same value: a different one is an error, a subquery that gave two
    /// answers).
    async fn set_values(
        subqueries: Vec<ScalarSubqueryLink>,
        results: ScalarSubqueryResults,
        context: Arc<TaskContext>,
    ) -> Result<()> {
        for subquery in subqueries {
            let schema = subquery.plan.schema();
            let batches: Vec<RecordBatch> =
                datafusion::physical_plan::execute_stream(subquery.plan, Arc::clone(&context))?
                    .try_collect()
                    .await?;
            let value = single_value(&batches, schema.field(0).data_type())?;
            // Readers in other operators set it too, perhaps at the same moment: the first
            // one's value stays, and each later one must be the same.
            if results.get(subquery.index).is_none()
                && results.set(subquery.index, value.clone()).is_ok()
            {
                continue;
            }
            match results.get(subquery.index) {
                None => {
                    return Err(DataFusionError::Internal(format!(
                        "scalar subquery {} has no value, though setting it failed",
                        subquery.index.as_usize()
                    )));
                }
                Some(set) if set == value => {}
                Some(set) => {
                    return Err(DataFusionError::Execution(format!(
                        "scalar subquery {} gave two values, {set} and {value}: a subquery \
                         run twice must give the same answer",
                        subquery.index.as_usize()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// The one value of a scalar subquery's output: NULL for no row, an error for more than
/// one (as DataFusion's `ScalarSubqueryExec`).
fn single_value(
    batches: &[RecordBatch],
    data_type: &datafusion::arrow::datatypes::DataType,
) -> Result<ScalarValue> {
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    match rows {
        0 => ScalarValue::try_from(data_type),
        1 => {
            let batch = batches.iter().find(|b| b.num_rows() == 1).expect("one row");
            ScalarValue::try_from_array(batch.column(0), 0)
        }
        _ => Err(DataFusionError::Execution(
            "Scalar subquery returned more than one row".into(),
        )),
    }
}

/// Whether `plan`'s own expressions (not those of its children) read a scalar subquery
/// value from `results`.
pub(crate) fn reads_values_of(
    plan: &Arc<dyn ExecutionPlan>,
    results: &ScalarSubqueryResults,
) -> bool {
    let mut reads = false;
    let _ = plan.apply_expressions(&mut |expr: &Arc<dyn PhysicalExpr>| {
        expr.apply(|e| {
            if let Some(subquery) = e.downcast_ref::<ScalarSubqueryExpr>()
                && subquery.results() == results
            {
                reads = true;
                return Ok(TreeNodeRecursion::Stop);
            }
            Ok(TreeNodeRecursion::Continue)
        })
    });
    reads
}

impl DisplayAs for SubqueryValuesExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "SubqueryValuesExec: subqueries={}",
            self.subqueries.len()
        )
    }
}

impl ExecutionPlan for SubqueryValuesExec {
    fn name(&self) -> &str {
        "SubqueryValuesExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        std::iter::once(&self.input)
            .chain(self.subqueries.iter().map(|s| &s.plan))
            .collect()
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        std::iter::once(true)
            .chain(self.subqueries.iter().map(|_| false))
            .collect()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 + self.subqueries.len() {
            return Err(DataFusionError::Internal(format!(
                "SubqueryValuesExec needs {} children, got {}",
                1 + self.subqueries.len(),
                children.len()
            )));
        }
        let mut children = children.into_iter();
        let input = children.next().expect("checked");
        let subqueries: Vec<ScalarSubqueryLink> = (self.subqueries.iter().zip(children))
            .map(|(link, plan)| ScalarSubqueryLink {
                plan,
                index: link.index,
            })
            .collect();
        let same_subqueries = (self.subqueries.iter().zip(&subqueries))
            .all(|(old, new)| Arc::ptr_eq(&old.plan, &new.plan));
        let mut node = Self::new(input, subqueries, self.results.clone());
        // Over the same subquery inputs (a task's copy of its fragment, with bounds of its
        // own below), one read of them serves both.
        if same_subqueries {
            node.values_set = Arc::clone(&self.values_set);
        }
        Ok(Arc::new(node))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let (subqueries, results) = (self.subqueries.clone(), self.results.clone());
        let values_set = Arc::clone(&self.values_set);
        let input = Arc::clone(&self.input);
        let stream = futures::stream::once(async move {
            let set = values_set
                .get_or_init(|| async {
                    Self::set_values(subqueries, results, Arc::clone(&context))
                        .await
                        .map_err(Arc::new)
                })
                .await;
            if let Err(e) = set {
                return Err(DataFusionError::Shared(Arc::clone(e)));
            }
            input.execute(partition, context)
        })
        .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            stream,
        )))
    }
}
