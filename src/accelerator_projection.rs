//! Keeping model calls in a projection of their own.
//!
//! DataFusion's `ProjectionPushdown` merges projections into the nodes below them, Parquet
//! scans included: `SELECT embed(body) FROM docs` would evaluate the model inside the scan's
//! source tasks, on the CPU pool. [`KeepAcceleratorProjections`], the first physical optimizer
//! rule of a flumen session, wraps every `ProjectionExec` that calls an accelerator UDF in an
//! [`AcceleratorProjectionExec`], which no DataFusion rule merges or moves, so the planner can
//! cut it out as an accelerator operator.

use std::fmt;
use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties,
};

use crate::accelerator::calls_accelerator_udf;

/// A `ProjectionExec` that calls an accelerator UDF, held where the query put it.
#[derive(Debug, Clone)]
pub struct AcceleratorProjectionExec {
    projection: Arc<ProjectionExec>,
}

impl AcceleratorProjectionExec {
    /// Wrap a projection.
    pub fn new(projection: Arc<ProjectionExec>) -> Self {
        Self { projection }
    }

    /// The projection it holds.
    pub fn projection(&self) -> &ProjectionExec {
        &self.projection
    }
}

impl DisplayAs for AcceleratorProjectionExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "Accelerator")?;
        self.projection.fmt_as(t, f)
    }
}

impl ExecutionPlan for AcceleratorProjectionExec {
    fn name(&self) -> &str {
        "AcceleratorProjectionExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.projection.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![self.projection.input()]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        self.projection.apply_expressions(f)
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        self.projection.maintains_input_order()
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        self.projection.benefits_from_input_partitioning()
    }

    fn supports_limit_pushdown(&self) -> bool {
        self.projection.supports_limit_pushdown()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let rebuilt = Arc::clone(&self.projection).replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )?;
        let projection = rebuilt
            .downcast_ref::<ProjectionExec>()
            .cloned()
            .ok_or_else(|| {
                DataFusionError::Internal("ProjectionExec rebuilt as another node".into())
            })?;
        Ok(Arc::new(Self::new(Arc::new(projection))))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        self.projection.execute(partition, context)
    }
}

/// Physical optimizer rule: wrap projections that call accelerator UDFs (see module docs).
#[derive(Debug, Default)]
pub struct KeepAcceleratorProjections;

impl PhysicalOptimizerRule for KeepAcceleratorProjections {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            if let Some(projection) = node.downcast_ref::<ProjectionExec>()
                && projection
                    .expr()
                    .iter()
                    .any(|e| calls_accelerator_udf(&e.expr))
            {
                let wrapped = AcceleratorProjectionExec::new(Arc::new(projection.clone()));
                return Ok(Transformed::yes(Arc::new(wrapped) as Arc<dyn ExecutionPlan>));
            }
            Ok(Transformed::no(node))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "keep_accelerator_projections"
    }

    fn schema_check(&self) -> bool {
        true
    }
}
