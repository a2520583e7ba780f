//! Helpers for unit tests that look at the physical plans DataFusion makes.

use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;

/// The physical plan `ctx` makes of `sql` (panics on an error: a test's query is valid).
pub(crate) async fn physical_plan(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
    let frame = ctx.sql(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
    frame
        .create_physical_plan()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The last node named `name` in `plan`, top down (the one nearest the leaves on its
/// line), if any.
pub(crate) fn node_named(
    plan: &Arc<dyn ExecutionPlan>,
    name: &str,
) -> Option<Arc<dyn ExecutionPlan>> {
    let mut found = None;
    let _ = plan.apply(|node| {
        if node.name() == name {
            found = Some(Arc::clone(node));
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}
