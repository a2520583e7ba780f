//! Window nodes in a task plan: what datafusion-proto 55 drops of their calls, and what a
//! task plan does about it ([`super::task_plan`] asks this module).
//!
//! - **A window function's `IGNORE NULLS`** (`lag(x) IGNORE NULLS`, `first_value(x) IGNORE
//!   NULLS`): proto writes `false` for every window function's call (it does for window
//!   aggregates' own), so a worker counted the nulls. Set again in the node's encoding.
//! - **A reversed call.** Where two windows of a query sort their rows in opposite orders,
//!   DataFusion runs one of them over the other's order, reversed: `lag` over `id ASC` as
//!   `lag` over `id DESC` with its offset negated. Proto drops the reversal, so a worker ran
//!   `lag` over `id DESC`, which is `lead` over `id ASC`. A reversed `lag` is sent as the
//!   `lead` it amounts to (and `lead` as `lag`); `first_value` and `last_value` read no
//!   reversal (the swap to the other is in their name); any other reversed call (`nth_value`)
//!   is refused, so its task runs on the driver.
//! - **A window aggregate's `FILTER (WHERE ..)`** is dropped, and **a frame's causality** is
//!   recomputed from its bounds: both refused.

use std::sync::Arc;

use datafusion::logical_expr::WindowFrame;
use datafusion::physical_expr::window::{
    PlainAggregateWindowExpr, SlidingAggregateWindowExpr, StandardWindowExpr, WindowExpr,
};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::windows::{BoundedWindowAggExec, WindowAggExec, WindowUDFExpr};
use datafusion_proto::protobuf;
use datafusion_proto::protobuf::physical_plan_node::PhysicalPlanType;
use datafusion_proto::protobuf::physical_window_expr_node::WindowFunction;

/// The window expressions of `node`, if it is a window node.
fn window_exprs(node: &Arc<dyn ExecutionPlan>) -> Option<&[Arc<dyn WindowExpr>]> {
    (node
        .downcast_ref::<WindowAggExec>()
        .map(|w| w.window_expr()))
    .or_else(|| {
        node.downcast_ref::<BoundedWindowAggExec>()
            .map(|w| w.window_expr())
    })
}

/// A window function's call (not a window aggregate's) and the two flags proto drops.
#[derive(Debug, Clone, PartialEq, Eq)]
struct WindowCall {
    /// The function's name (`lag`, `row_number`, ...).
    function: String,
    /// It runs over its window's order reversed.
    reversed: bool,
    /// `IGNORE NULLS`.
    ignore_nulls: bool,
}

impl WindowCall {
    /// The call in `expr`, if `expr` calls a window function.
    fn of(expr: &Arc<dyn WindowExpr>) -> Option<Self> {
        let standard = expr.as_any().downcast_ref::<StandardWindowExpr>()?;
        let call = standard
            .get_standard_func_expr()
            .as_any()
            .downcast_ref::<WindowUDFExpr>()?;
        // DataFusion 55 exports no accessor of the two flags; the derived `Debug` of
        // `WindowUDFExpr` ends with them: `.., is_reversed: B, ignore_nulls: B }`.
        let debug = format!("{call:?}");
        let flags = &debug[debug.rfind("is_reversed: ")?..];
        Some(Self {
            function: call.fun().name().to_string(),
            reversed: flags.starts_with("is_reversed: true"),
            ignore_nulls: flags.ends_with("ignore_nulls: true }"),
        })
    }

    /// The function a worker runs unreversed to the same effect, or `None` when there is
    /// none.
    fn as_sent(&self) -> Option<&str> {
        match (self.reversed, self.function.as_str()) {
            (false, function) => Some(function),
            // The shift's offset negated: the other shift.
            (true, "lag") => Some("lead"),
            (true, "lead") => Some("lag"),
            // Their evaluators do not read the flag.
            (true, function @ ("first_value" | "last_value")) => Some(function),
            (true, _) => None,
        }
    }
}

/// Why datafusion-proto would decode window node `node` to another computation, if it
/// would and a task plan cannot carry it: a window aggregate's `FILTER (WHERE ..)` is
/// dropped (the worker summed every row: `window.slt:6092`), a frame's causality is
/// recomputed from its bounds (`RANGE BETWEEN 1 PRECEDING AND 1 PRECEDING` planned not
/// causal decodes causal), and a reversed call other than those [`WindowCall::as_sent`]
/// knows loses its reversal.
pub(super) fn lossy_window(node: &Arc<dyn ExecutionPlan>) -> Option<&'static str> {
    for expr in window_exprs(node)? {
        // DataFusion 55 exports no accessor of the filter (`AggregateWindowExpr` is private);
        // the derived `Debug` of these two types ends with it.
        let any = expr.as_any();
        let aggregate = any.downcast_ref::<PlainAggregateWindowExpr>().is_some()
            || any.downcast_ref::<SlidingAggregateWindowExpr>().is_some();
        let filtered = aggregate && !format!("{expr:?}").ends_with("filter: None }");
        if filtered {
            return Some("datafusion-proto drops a window aggregate's FILTER");
        }
        let frame = expr.get_window_frame();
        let decoded = WindowFrame::new_bounds(
            frame.units,
            frame.start_bound.clone(),
            frame.end_bound.clone(),
        );
        if decoded.is_causal() != frame.is_causal() {
            return Some("datafusion-proto recomputes a window frame's causality");
        }
        if WindowCall::of(expr).is_some_and(|call| call.as_sent().is_none()) {
            return Some("datafusion-proto drops a window function's reversal");
        }
    }
    None
}

/// Put back into `proto` (the encoding of `node`) what proto dropped of its window
/// functions' calls: each call's `IGNORE NULLS`, and a reversed call as the function it
/// amounts to unreversed. Nothing for a node that is not a window node.
pub(super) fn carry_window_calls(
    node: &Arc<dyn ExecutionPlan>,
    proto: &mut protobuf::PhysicalPlanNode,
) {
    let (Some(exprs), Some(PhysicalPlanType::Window(window))) =
        (window_exprs(node), proto.physical_plan_type.as_mut())
    else {
        return;
    };
    for (expr, sent) in exprs.iter().zip(window.window_expr.iter_mut()) {
        let Some(call) = WindowCall::of(expr) else {
            continue;
        };
        sent.ignore_nulls = call.ignore_nulls;
        if let Some(function) = call.as_sent()
            && function != call.function
        {
            sent.window_function = Some(WindowFunction::UserDefinedWindowFunction(
                function.to_string(),
            ));
        }
    }
}

/// What the round-trip check compares of `node`'s window calls beyond the plan's text: for
/// each call, the function it runs unreversed and whether it ignores nulls (a line each).
pub(super) fn describe_window_calls(node: &Arc<dyn ExecutionPlan>) -> String {
    let mut text = String::new();
    for expr in window_exprs(node).unwrap_or_default() {
        if let Some(call) = WindowCall::of(expr) {
            text.push_str(&format!(
                "window call {}: runs {} ignore_nulls={}\n",
                expr.name(),
                call.as_sent().unwrap_or("a reversed call"),
                call.ignore_nulls
            ));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::task_plan::{WorkerFunctions, check_round_trip, decode, encode};
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    use datafusion::physical_plan::collect;
    use datafusion::prelude::SessionContext;

    /// A table of ids 0..40 in 4 groups, `v` null but every third row.
    async fn context() -> SessionContext {
        let ctx = SessionContext::new();
        ctx.sql(
            "CREATE TABLE t AS SELECT value AS id, value % 4 AS g, \
             CASE WHEN value % 3 = 0 THEN value END AS v FROM range(0, 40)",
        )
        .await
        .unwrap();
        ctx
    }

    /// The window calls of `plan`'s window nodes, as the check describes them.
    fn calls(plan: &Arc<dyn ExecutionPlan>) -> String {
        let mut text = String::new();
        let _ = plan.apply(|node| {
            text.push_str(&describe_window_calls(node));
            Ok(TreeNodeRecursion::Continue)
        });
        text
    }

    /// A query's rows, run as planned and as a worker decodes its plan: the same, and the
    /// calls it describes are the expected ones.
    async fn same_after_the_trip(ctx: &SessionContext, sql: &str, expected_calls: &[&str]) {
        let plan = ctx.sql(sql).await.unwrap();
        let plan = plan.create_physical_plan().await.unwrap();
        let described = calls(&plan);
        for call in expected_calls {
            assert!(
                described.contains(call),
                "{sql}: {call} not in\n{described}"
            );
        }
        let bytes = encode(&plan, WorkerFunctions::of(ctx)).unwrap();
        check_round_trip(&plan, &bytes, &ctx.task_ctx()).unwrap_or_else(|e| panic!("{e:?}"));
        let decoded = decode(&bytes, &ctx.task_ctx()).unwrap();
        let planned = collect(plan, ctx.task_ctx()).await.unwrap();
        let worker = collect(decoded, ctx.task_ctx()).await.unwrap();
        let (planned, worker) = (
            pretty_format_batches(&planned).unwrap().to_string(),
            pretty_format_batches(&worker).unwrap().to_string(),
        );
        assert_eq!(planned, worker, "{sql}");
    }

    /// `IGNORE NULLS` and reversed `lag`/`lead`/`first_value` compute on a worker what they
    /// compute here (proto dropped both: the worker counted nulls, and ran a reversed `lag`
    /// as `lead`).
    #[tokio::test]
    async fn ignore_nulls_and_reversed_calls_survive_the_trip() {
        let ctx = context().await;
        same_after_the_trip(
            &ctx,
            "SELECT id, lag(v) IGNORE NULLS OVER (PARTITION BY g ORDER BY id) AS l, \
             first_value(v) IGNORE NULLS OVER (PARTITION BY g ORDER BY id) AS f \
             FROM t ORDER BY id",
            &[
                "runs lag ignore_nulls=true",
                "runs first_value ignore_nulls=true",
            ],
        )
        .await;
        // The second window sorts the other way: DataFusion reverses one of the two.
        same_after_the_trip(
            &ctx,
            "SELECT id, row_number() OVER (PARTITION BY g ORDER BY id DESC) AS rn, \
             lag(id) OVER (PARTITION BY g ORDER BY id) AS l, \
             lead(v, 2) IGNORE NULLS OVER (PARTITION BY g ORDER BY id) AS ld, \
             first_value(v) IGNORE NULLS OVER (PARTITION BY g ORDER BY id) AS f \
             FROM t ORDER BY id",
            &["runs lead ignore_nulls=false", "runs lag ignore_nulls=true"],
        )
        .await;
    }

    /// A reversed `nth_value` (its position negated, which proto cannot say) is refused, so
    /// its task runs on the driver.
    #[tokio::test]
    async fn a_reversed_nth_value_is_refused() {
        let ctx = &context().await;
        let sql = "SELECT id, row_number() OVER (PARTITION BY g ORDER BY id DESC) AS rn, \
                   nth_value(id, 2) OVER (PARTITION BY g ORDER BY id) AS n FROM t";
        let plan = ctx.sql(sql).await.unwrap();
        let plan = plan.create_physical_plan().await.unwrap();
        assert!(
            calls(&plan).contains("runs a reversed call"),
            "{}",
            calls(&plan)
        );
        let err = encode(&plan, WorkerFunctions::of(ctx)).unwrap_err();
        assert!(
            err.to_string()
                .contains("datafusion-proto drops a window function's reversal"),
            "{err}"
        );
    }
}
