//! `INTERSECT ALL` and `EXCEPT ALL` that count copies, as SQL says they do. DataFusion 55
//! plans them as a semi and an anti join (apache/datafusion issue 12955), so a row that
//! appears m times on the left and n times on the right comes back m times (`INTERSECT ALL`,
//! where SQL says min(m, n)) or not at all (`EXCEPT ALL`, where SQL says max(m - n, 0)):
//! `VALUES (1), (1), (2) EXCEPT ALL VALUES (1)` answers `2` instead of `1, 2`.
//!
//! [`CountedSetOperations`], an analyzer rule, numbers the copies of each row on both sides
//! (`row_number() OVER (PARTITION BY` every compared value`)`) and adds the copy number to
//! the join's keys: the k-th copy on the left matches only the k-th copy on the right, so a
//! semi join keeps min(m, n) copies and an anti join max(m - n, 0). NULLs still match NULLs
//! (the join keeps DataFusion's null equality, and a window partition holds every NULL).
//!
//! The joins it rewrites are those only `LogicalPlanBuilder`'s set operations build before
//! the optimizer runs: a semi or anti join with NULLs equal, no filter, and one key per
//! column pairing the sides position by position. The left side of `INTERSECT` and `EXCEPT`
//! without `ALL` is a `DISTINCT` (each row at most once, where the join is already right),
//! and is left as it is.

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TransformedResult};
use datafusion::common::{Column, NullEquality, Result};
use datafusion::config::ConfigOptions;
use datafusion::functions_window::expr_fn::row_number;
use datafusion::logical_expr::{
    Expr, ExprFunctionExt, Join, JoinType, LogicalPlan, LogicalPlanBuilder,
};
use datafusion::optimizer::AnalyzerRule;

/// The name of the copy number a rewritten join's left side carries; a join whose left
/// side has it was rewritten already.
const LEFT_COPY: &str = "__flumen_left_copy";
/// The name of the copy number on a rewritten join's right side.
const RIGHT_COPY: &str = "__flumen_right_copy";

/// The analyzer rule that makes `INTERSECT ALL` and `EXCEPT ALL` count copies (see the
/// module's documentation).
#[derive(Debug, Default)]
pub struct CountedSetOperations;

impl AnalyzerRule for CountedSetOperations {
    fn analyze(&self, plan: LogicalPlan, _config: &ConfigOptions) -> Result<LogicalPlan> {
        plan.transform_up_with_subqueries(count_copies).data()
    }

    fn name(&self) -> &str {
        "counted_set_operations"
    }
}

/// `plan` with copies counted when it is the join of an `INTERSECT ALL` or `EXCEPT ALL`.
fn count_copies(plan: LogicalPlan) -> Result<Transformed<LogicalPlan>> {
    let LogicalPlan::Join(join) = &plan else {
        return Ok(Transformed::no(plan));
    };
    if !is_set_operation_all(join) {
        return Ok(Transformed::no(plan));
    }
    let (left_keys, right_keys): (Vec<Expr>, Vec<Expr>) = join.on.iter().cloned().unzip();
    let left = numbered(Arc::clone(&join.left), left_keys, LEFT_COPY)?;
    let right = numbered(Arc::clone(&join.right), right_keys, RIGHT_COPY)?;
    let mut on = join.on.clone();
    on.push((
        Expr::Column(Column::from_name(LEFT_COPY)),
        Expr::Column(Column::from_name(RIGHT_COPY)),
    ));
    let counted = Join::try_new(
        Arc::new(left),
        Arc::new(right),
        on,
        None,
        join.join_type,
        join.join_constraint,
        NullEquality::NullEqualsNull,
        false,
    )?;
    // The join's own columns, as before: the copy number goes.
    let columns = join.left.schema().columns().into_iter().map(Expr::Column);
    let plan = LogicalPlanBuilder::from(LogicalPlan::Join(counted))
        .project(columns)?
        .build()?;
    Ok(Transformed::yes(plan))
}

/// Whether `join` is what `LogicalPlanBuilder` builds for `INTERSECT ALL` or `EXCEPT ALL`
/// and not rewritten yet.
fn is_set_operation_all(join: &Join) -> bool {
    let left = join.left.schema().fields();
    let right = join.right.schema().fields();
    matches!(join.join_type, JoinType::LeftSemi | JoinType::LeftAnti)
        && join.null_equality == NullEquality::NullEqualsNull
        && join.filter.is_none()
        && !matches!(join.left.as_ref(), LogicalPlan::Distinct(_))
        && left.len() == right.len()
        && join.on.len() == left.len()
        && !left.iter().any(|field| field.name() == LEFT_COPY)
        && join.on.iter().zip(left.iter().zip(right.iter())).all(
            |((l, r), (left_field, right_field))| {
                names_column(l, left_field.name()) && names_column(r, right_field.name())
            },
        )
}

/// Whether `key` is the column `name`, perhaps cast (type coercion casts one side's key to
/// the other's type).
fn names_column(key: &Expr, name: &str) -> bool {
    match key {
        Expr::Column(column) => column.name == name,
        Expr::Cast(cast) => names_column(&cast.expr, name),
        Expr::TryCast(cast) => names_column(&cast.expr, name),
        _ => false,
    }
}

/// `input`'s columns and `copy`: which copy of its row (among those of equal `keys`) a row
/// is, from 1.
fn numbered(input: Arc<LogicalPlan>, keys: Vec<Expr>, copy: &str) -> Result<LogicalPlan> {
    let columns: Vec<Expr> = input
        .schema()
        .columns()
        .into_iter()
        .map(Expr::Column)
        .collect();
    let copy_number = row_number().partition_by(keys).build()?;
    let windowed = LogicalPlanBuilder::window_plan(input.as_ref().clone(), vec![copy_number])?;
    let copy_column = windowed
        .schema()
        .columns()
        .pop()
        .expect("a window plan has the window's column last");
    LogicalPlanBuilder::from(windowed)
        .project(
            columns
                .into_iter()
                .chain([Expr::Column(copy_column).alias(copy)]),
        )?
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{Array, AsArray, RecordBatch};
    use datafusion::arrow::datatypes::Int64Type;
    use datafusion::prelude::SessionContext;
    use std::collections::BTreeMap;

    /// Copies of each value (`None` for NULL) in the first column of `batches`.
    fn counts(batches: &[RecordBatch]) -> BTreeMap<Option<i64>, usize> {
        let mut counts = BTreeMap::new();
        for batch in batches {
            let column = batch.column(0).as_primitive::<Int64Type>();
            for row in 0..column.len() {
                let value = column.is_valid(row).then(|| column.value(row));
                *counts.entry(value).or_default() += 1;
            }
        }
        counts
    }

    /// `values` as SQL `VALUES` rows (`NULL` for `None`).
    fn values_sql(values: &[Option<i64>]) -> String {
        let rows: Vec<String> = values
            .iter()
            .map(|v| v.map_or("(CAST(NULL AS BIGINT))".into(), |v| format!("({v})")))
            .collect();
        format!("SELECT * FROM (VALUES {}) AS s(x)", rows.join(", "))
    }

    async fn run(ctx: &SessionContext, sql: &str) -> BTreeMap<Option<i64>, usize> {
        counts(&ctx.sql(sql).await.unwrap().collect().await.unwrap())
    }

    /// Over random multisets of small values and NULLs, every value comes back as many
    /// times as SQL says: min(m, n) from `INTERSECT ALL`, max(m - n, 0) from `EXCEPT ALL`.
    #[tokio::test]
    async fn copies_are_counted_as_sql_says() {
        let ctx = crate::session(crate::FlumenConfig::default());
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |below: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % below
        };
        for round in 0..12 {
            let mut side = |len: u64| -> Vec<Option<i64>> {
                (0..1 + next(len))
                    .map(|_| match next(6) {
                        0 => None,
                        v => Some(v as i64),
                    })
                    .collect()
            };
            let (left, right) = (side(20), side(20));
            let count = |values: &[Option<i64>]| {
                let mut counts = BTreeMap::<Option<i64>, usize>::new();
                for v in values {
                    *counts.entry(*v).or_default() += 1;
                }
                counts
            };
            let (m, n) = (count(&left), count(&right));
            let intersect: BTreeMap<_, _> = m
                .iter()
                .filter_map(|(v, &m)| Some((*v, m.min(*n.get(v)?))))
                .collect();
            let except: BTreeMap<_, _> = m
                .iter()
                .map(|(v, &m)| (*v, m.saturating_sub(n.get(v).copied().unwrap_or(0))))
                .filter(|(_, copies)| *copies > 0)
                .collect();
            let (l, r) = (values_sql(&left), values_sql(&right));
            let got = run(&ctx, &format!("{l} INTERSECT ALL {r}")).await;
            assert_eq!(
                got, intersect,
                "round {round}: {left:?} INTERSECT ALL {right:?}"
            );
            let got = run(&ctx, &format!("{l} EXCEPT ALL {r}")).await;
            assert_eq!(got, except, "round {round}: {left:?} EXCEPT ALL {right:?}");
        }
    }

    /// The joins that are not a set operation's keep their plan: a semi join written as one,
    /// and `INTERSECT` without `ALL` (its left side is a `DISTINCT`). A plan analyzed twice
    /// counts copies once.
    #[tokio::test]
    async fn only_set_operations_with_all_are_rewritten() {
        let ctx = crate::session(crate::FlumenConfig::default());
        let analyzed = |sql: &'static str| {
            let ctx = ctx.clone();
            async move {
                let plan = ctx.state().create_logical_plan(sql).await.unwrap();
                let plan = ctx
                    .state()
                    .analyzer()
                    .execute_and_check(plan, ctx.state().config_options(), |_, _| {})
                    .unwrap();
                plan.display_indent().to_string()
            }
        };
        for untouched in [
            "SELECT * FROM (VALUES (1)) a(x) LEFT SEMI JOIN (VALUES (1)) b(y) ON a.x = b.y",
            "SELECT * FROM (VALUES (1)) a(x) WHERE x IN (SELECT 1)",
            "SELECT * FROM (VALUES (1)) a(x) INTERSECT SELECT 1",
            "SELECT * FROM (VALUES (1)) a(x) EXCEPT SELECT 1",
        ] {
            let plan = analyzed(untouched).await;
            assert!(
                !plan.contains(LEFT_COPY),
                "{untouched} was rewritten:\n{plan}"
            );
        }
        let sql = "SELECT * FROM (VALUES (1)) a(x) EXCEPT ALL SELECT 1";
        let once = analyzed(sql).await;
        assert_eq!(once.matches("WindowAggr").count(), 2, "{once}");
        let plan = ctx.state().create_logical_plan(sql).await.unwrap();
        let rule = CountedSetOperations;
        let options = ConfigOptions::default();
        let twice = rule
            .analyze(rule.analyze(plan, &options).unwrap(), &options)
            .unwrap();
        assert_eq!(
            twice
                .display_indent()
                .to_string()
                .matches("WindowAggr")
                .count(),
            2
        );
    }

    /// Why this module exists: once DataFusion counts copies itself, this fails and the rule
    /// can go.
    #[tokio::test]
    async fn datafusions_own_except_all_keeps_no_copy_of_a_row_the_right_side_has() {
        let vanilla = SessionContext::new();
        let sql = "SELECT * FROM (VALUES (1), (1), (2)) s(x) EXCEPT ALL SELECT 1";
        assert_eq!(
            run(&vanilla, sql).await,
            BTreeMap::from([(Some(2), 1)]),
            "DataFusion's EXCEPT ALL now counts copies: flumen's counted_set_operations can go"
        );
    }
}
