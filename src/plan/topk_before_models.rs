//! A TopK (`ORDER BY ... LIMIT n`) taken before the models of the projection below it.
//!
//! DataFusion plans `SELECT id, embed(body) FROM docs ORDER BY id LIMIT 3` as a sort with
//! a fetch of 3 over the projection that calls the model: the model ran over every row of
//! the table (100,000 documents) for 3 to be kept. Where the sort's keys read no model
//! output, [`topk_before_models`] puts the sort below the projection: the sort keeps its `n`
//! rows first, and the model runs on those only (on at most `n` per partition, before the
//! merge keeps `n`).
//!
//! A key that reads a column the projection computes is rewritten to compute it from the
//! projection's input (`ORDER BY length(body)` through `length(body) AS l`). A sort is left
//! where it is when a key would then call a model (`ORDER BY v[1]` for `v = embed(body)`: the
//! model must see every row, as [`crate::plan::accelerator_projection`] plans it) or a
//! volatile function (`random()` would be drawn twice, for the sort and for the output),
//! and a sort without a fetch is left too (it sees every row either way).

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::error::Result;
use datafusion::physical_expr::projection::update_expr;
use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
use datafusion::physical_expr_common::physical_expr::is_volatile;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;

use crate::functions::accelerator::calls_accelerator_udf;

/// `plan` with every sort that has a fetch, over a projection calling a model, put below
/// that projection where its keys allow (see the module docs).
pub fn topk_before_models(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_down(|node| {
        let Some(sort) = node.downcast_ref::<SortExec>() else {
            return Ok(Transformed::no(node));
        };
        Ok(match sort_below_projection(sort)? {
            Some(swapped) => Transformed::yes(swapped),
            None => Transformed::no(node),
        })
    })
    .map(|t| t.data)
}

/// `projection(sort(projection's input))` for `sort(projection(...))`, where `sort` has a
/// fetch, the projection calls a model and every key read through the projection calls no
/// model and nothing volatile; `None` otherwise.
fn sort_below_projection(sort: &SortExec) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    if sort.fetch().is_none() {
        return Ok(None);
    }
    let Some(projection) = sort.input().downcast_ref::<ProjectionExec>() else {
        return Ok(None);
    };
    if !(projection.expr().iter()).any(|e| calls_accelerator_udf(&e.expr)) {
        return Ok(None);
    }
    let mut keys = Vec::with_capacity(sort.expr().len());
    for key in sort.expr().iter() {
        let Some(expr) = update_expr(&key.expr, projection.expr(), true)? else {
            return Ok(None);
        };
        if calls_accelerator_udf(&expr) || is_volatile(&expr) {
            return Ok(None);
        }
        keys.push(PhysicalSortExpr::new(expr, key.options));
    }
    let Some(keys) = LexOrdering::new(keys) else {
        return Ok(None);
    };
    let sorted = SortExec::new(keys, Arc::clone(projection.input()))
        .with_fetch(sort.fetch())
        .with_preserve_partitioning(sort.preserve_partitioning());
    let above = ProjectionExec::try_new(projection.expr().to_vec(), Arc::new(sorted))?;
    Ok(Some(Arc::new(above)))
}

#[cfg(test)]
mod tests {
    use super::*;

    use datafusion::arrow::array::{Int64Array, StringArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::SessionContext;

    use crate::functions::accelerator::accelerator_udf;
    use crate::functions::emulated_accelerator::EmulatedModel;

    /// The physical plan DataFusion makes for `sql` over `docs(id, body)` with the model `m`,
    /// before any optimizer rule, and the same after [`topk_before_models`], as text.
    async fn before_and_after(sql: &str) -> (String, String) {
        let ctx = SessionContext::new();
        ctx.register_udf(accelerator_udf(
            EmulatedModel::from_spec("m:0:4:8").unwrap(),
        ));
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("body", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(vec![3, 1, 2])),
                Arc::new(StringArray::from(vec!["c", "a", "b"])),
            ],
        )
        .unwrap();
        let table = datafusion::datasource::MemTable::try_new(schema, vec![vec![batch]]).unwrap();
        ctx.register_table("docs", Arc::new(table)).unwrap();
        let state = ctx.state();
        let logical = state
            .optimize(&ctx.sql(sql).await.unwrap().into_unoptimized_plan())
            .unwrap();
        let planner = datafusion::physical_planner::DefaultPhysicalPlanner::default();
        let physical = datafusion::physical_planner::PhysicalPlanner::create_physical_plan(
            &planner, &logical, &state,
        )
        .await
        .unwrap();
        let text =
            |plan: &Arc<dyn ExecutionPlan>| displayable(plan.as_ref()).indent(false).to_string();
        let after = topk_before_models(Arc::clone(&physical)).unwrap();
        (text(&physical), text(&after))
    }

    /// Whether the plan's text shows the sort above the projection calling the model `m`.
    fn sort_above_model(plan: &str) -> bool {
        let line_of = |what: &str| plan.lines().position(|line| line.contains(what)).unwrap();
        line_of("SortExec") < line_of(" m(body@")
    }

    #[tokio::test]
    async fn a_topk_over_a_model_is_taken_first() {
        let (before, after) =
            before_and_after("SELECT id, m(body) AS v FROM docs ORDER BY id DESC LIMIT 2").await;
        assert!(sort_above_model(&before), "{before}");
        assert!(!sort_above_model(&after), "{after}");
        assert!(after.contains("TopK(fetch=2)"), "{after}");
        // A key through a computed column is computed from the input.
        let (_, after) = before_and_after(
            "SELECT length(body) AS l, m(body) AS v FROM docs ORDER BY l, id LIMIT 2",
        )
        .await;
        assert!(!sort_above_model(&after), "{after}");
        assert!(
            after.contains("TopK(fetch=2), expr=[character_length(body@1) ASC NULLS LAST"),
            "{after}"
        );
    }

    #[tokio::test]
    async fn a_sort_that_must_see_every_row_stays() {
        for sql in [
            // The key reads the model's output.
            "SELECT id, m(body) AS v FROM docs ORDER BY v[1] LIMIT 2",
            // A volatile key would be drawn again.
            "SELECT id, m(body) AS v, random() AS r FROM docs ORDER BY r LIMIT 2",
            // No fetch: every row is sorted either way.
            "SELECT id, m(body) AS v FROM docs ORDER BY id",
            // No model: DataFusion's plan as it is.
            "SELECT id, upper(body) AS u FROM docs ORDER BY id LIMIT 2",
        ] {
            let (before, after) = before_and_after(sql).await;
            assert_eq!(before, after, "{sql}");
        }
    }
}
