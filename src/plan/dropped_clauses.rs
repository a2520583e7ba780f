//! Clauses DataFusion 55 parses and then drops or refuses, rewritten in the statement's
//! syntax tree before it is planned ([`rewrite_dropped_clauses`]; flumen's shell, server
//! and Python module plan SQL through [`crate::session::logical_plan`], which calls it).
//!
//! - `GROUP BY a, b WITH ROLLUP` (MySQL), `WITH CUBE`, `WITH TOTALS` (ClickHouse) and
//!   Hive's `GROUP BY a, b GROUPING SETS ((a), (b))`: DataFusion planned a plain
//!   `GROUP BY a, b`, a wrong answer with no error (the subtotal and total rows were
//!   missing). They become `GROUP BY ROLLUP (a, b)`, `CUBE (a, b)`,
//!   `GROUPING SETS ((a, b), ())` and `GROUPING SETS ((a), (b))`; a position (`GROUP BY 1
//!   WITH ROLLUP`) is first replaced by the select item it names. `GROUP BY ALL` with a
//!   modifier is refused.
//! - `PREWHERE c` (ClickHouse's filter read before the other columns): dropped, so every
//!   row came back; it becomes part of the `WHERE`.
//! - `START WITH ... CONNECT BY ...` (Oracle's hierarchical query): dropped, so the whole
//!   table came back; it is refused, naming `WITH RECURSIVE`.
//! - `FETCH FIRST n ROWS ONLY` (the SQL standard's `LIMIT`, with `OFFSET m ROWS` before
//!   it): refused by DataFusion ("FETCH clause is not supported yet"); it becomes `LIMIT n`.
//!   `WITH TIES` and `PERCENT` are still refused.
//! - `ORDER BY ALL` (DuckDB's: every output column, left to right): outside DuckDB's
//!   dialect `ALL` was read as a column ("No field named all"); it becomes `ORDER BY 1, 2,
//!   ...` with its direction (a select's `*` is left to DataFusion's own), or is refused
//!   where the columns are not known before planning (`SELECT *` in a set operation).
//! - `LIMIT n BY k` (ClickHouse's n rows of each `k`): DataFusion planned `k` against no
//!   columns ("No field named k") before refusing it; it is refused naming `row_number()`.

use std::ops::ControlFlow;

use datafusion::error::{DataFusionError, Result};
use datafusion::sql::parser::{CopyToSource, Statement as DFStatement};
use datafusion::sql::sqlparser::ast::{
    BinaryOperator, Expr, Fetch, GroupByExpr, GroupByWithModifier, LimitClause, OrderBy,
    OrderByExpr, OrderByKind, Query, Select, SelectItem, SetExpr, Value, VisitMut, VisitorMut,
};

/// Rewrite `statement`'s clauses that DataFusion would drop or refuse (see the module's
/// documentation), in every query it holds (subqueries, views, `COPY`, `EXPLAIN`).
pub fn rewrite_dropped_clauses(statement: &mut DFStatement) -> Result<()> {
    let mut rewriter = ClauseRewriter;
    let flow = match statement {
        DFStatement::Statement(s) => s.visit(&mut rewriter),
        DFStatement::CopyTo(copy) => match &mut copy.source {
            CopyToSource::Query(query) => query.visit(&mut rewriter),
            CopyToSource::Relation(_) => ControlFlow::Continue(()),
        },
        DFStatement::Explain(explain) => return rewrite_dropped_clauses(&mut explain.statement),
        DFStatement::CreateExternalTable(_) | DFStatement::Reset(_) => ControlFlow::Continue(()),
    };
    match flow {
        ControlFlow::Break(e) => Err(e),
        ControlFlow::Continue(()) => Ok(()),
    }
}

/// The visitor: each query's `FETCH`, each of its selects' filters and `GROUP BY`.
struct ClauseRewriter;

impl VisitorMut for ClauseRewriter {
    type Break = DataFusionError;

    fn pre_visit_query(&mut self, query: &mut Query) -> ControlFlow<DataFusionError> {
        let limits = (fetch_as_limit(query))
            .and_then(|()| limit_by_refused(query))
            .and_then(|()| order_by_all(query));
        if let Err(e) = limits {
            return ControlFlow::Break(e);
        }
        match group_by_modifiers_in(&mut query.body) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => ControlFlow::Break(e),
        }
    }
}

/// `FETCH FIRST n ROWS ONLY` as `LIMIT n` (keeping an `OFFSET`); left as it is where
/// DataFusion's error is the right answer (`WITH TIES`, `PERCENT`, beside a `LIMIT`).
fn fetch_as_limit(query: &mut Query) -> Result<()> {
    let Some(Fetch {
        with_ties: false,
        percent: false,
        quantity,
    }) = &query.fetch
    else {
        return Ok(());
    };
    let rows = quantity
        .clone()
        .unwrap_or_else(|| Expr::value(Value::Number("1".into(), false)));
    match &mut query.limit_clause {
        None => {
            query.limit_clause = Some(LimitClause::LimitOffset {
                limit: Some(rows),
                offset: None,
                limit_by: vec![],
            })
        }
        Some(LimitClause::LimitOffset {
            limit: limit @ None,
            limit_by,
            ..
        }) if limit_by.is_empty() => *limit = Some(rows),
        Some(_) => return Ok(()),
    }
    query.fetch = None;
    Ok(())
}

/// `LIMIT n BY k` refused with an error naming it and what to write instead.
fn limit_by_refused(query: &Query) -> Result<()> {
    let Some(LimitClause::LimitOffset { limit_by, .. }) = &query.limit_clause else {
        return Ok(());
    };
    if limit_by.is_empty() {
        return Ok(());
    }
    let keys: Vec<String> = limit_by.iter().map(|k| k.to_string()).collect();
    let keys = keys.join(", ");
    Err(DataFusionError::NotImplemented(format!(
        "LIMIT n BY {keys} (n rows of each {keys}) is not supported: keep the rows whose \
         row_number() OVER (PARTITION BY {keys} ORDER BY ...) is at most n"
    )))
}

/// `ORDER BY ALL [ASC | DESC] [NULLS ...]` (an unquoted `all`, alone) as `ORDER BY 1, 2,
/// ..., n` over the query's n output columns, each with its direction.
fn order_by_all(query: &mut Query) -> Result<()> {
    let Some(OrderBy {
        kind: OrderByKind::Expressions(exprs),
        ..
    }) = &mut query.order_by
    else {
        return Ok(());
    };
    let [only] = &exprs[..] else {
        return Ok(());
    };
    let is_all = matches!(&only.expr, Expr::Identifier(ident)
        if ident.quote_style.is_none() && ident.value.eq_ignore_ascii_case("all"));
    if !is_all || only.with_fill.is_some() {
        return Ok(());
    }
    let options = only.options;
    let select_of_wildcard = matches!(&*query.body, SetExpr::Select(select)
        if select.projection.iter().any(is_wildcard));
    if select_of_wildcard {
        // DataFusion expands a select's `*` and orders by its columns itself.
        query.order_by.as_mut().expect("matched above").kind = OrderByKind::All(options);
        return Ok(());
    }
    let Some(width) = known_width(&query.body) else {
        return Err(DataFusionError::NotImplemented(
            "ORDER BY ALL over this query: its columns are known only once planned; order \
             by their positions (ORDER BY 1, 2)"
                .into(),
        ));
    };
    *exprs = (1..=width)
        .map(|position| OrderByExpr {
            expr: Expr::value(Value::Number(position.to_string(), false)),
            options,
            with_fill: None,
        })
        .collect();
    Ok(())
}

/// Whether a select item is `*` or `t.*`.
fn is_wildcard(item: &SelectItem) -> bool {
    matches!(
        item,
        SelectItem::Wildcard(_) | SelectItem::QualifiedWildcard(..)
    )
}

/// How many columns `body` outputs, where its syntax says: a select's items (without a
/// `*`), a `VALUES` row's, a set operation's left side's.
fn known_width(body: &SetExpr) -> Option<usize> {
    match body {
        SetExpr::Select(select) if !select.projection.iter().any(is_wildcard) => {
            Some(select.projection.len())
        }
        SetExpr::Values(values) => values.rows.first().map(|row| row.content.len()),
        SetExpr::SetOperation { left, .. } => known_width(left),
        SetExpr::Query(query) => known_width(&query.body),
        _ => None,
    }
}

/// The filters and `GROUP BY` modifiers of every select of `body` (both sides of a set
/// operation).
fn group_by_modifiers_in(body: &mut SetExpr) -> Result<()> {
    match body {
        SetExpr::Select(select) => {
            filters(select)?;
            group_by_modifiers(select)
        }
        SetExpr::SetOperation { left, right, .. } => {
            group_by_modifiers_in(left)?;
            group_by_modifiers_in(right)
        }
        _ => Ok(()),
    }
}

/// `select`'s `PREWHERE` as part of its `WHERE`; its `CONNECT BY` refused.
fn filters(select: &mut Select) -> Result<()> {
    if !select.connect_by.is_empty() {
        return Err(DataFusionError::NotImplemented(
            "START WITH ... CONNECT BY (a hierarchical query) is not supported: write it \
             with WITH RECURSIVE"
                .into(),
        ));
    }
    if let Some(prewhere) = select.prewhere.take() {
        select.selection = Some(match select.selection.take() {
            Some(selection) => Expr::BinaryOp {
                left: Box::new(Expr::Nested(Box::new(prewhere))),
                op: BinaryOperator::And,
                right: Box::new(Expr::Nested(Box::new(selection))),
            },
            None => prewhere,
        });
    }
    Ok(())
}

/// `select`'s `GROUP BY ... WITH ROLLUP | CUBE | TOTALS` or Hive's `GROUPING SETS`
/// modifier as the grouping-set expression DataFusion plans.
fn group_by_modifiers(select: &mut Select) -> Result<()> {
    let (exprs, modifiers) = match &select.group_by {
        GroupByExpr::Expressions(_, modifiers) if modifiers.is_empty() => return Ok(()),
        GroupByExpr::All(modifiers) if modifiers.is_empty() => return Ok(()),
        GroupByExpr::All(modifiers) => {
            return Err(DataFusionError::NotImplemented(format!(
                "GROUP BY ALL {}: name the columns (GROUP BY ROLLUP (a, b))",
                shown(modifiers)
            )));
        }
        GroupByExpr::Expressions(exprs, modifiers) => (exprs, modifiers),
    };
    let [modifier] = &modifiers[..] else {
        return Err(DataFusionError::NotImplemented(format!(
            "GROUP BY ... {}: one modifier at a time",
            shown(modifiers)
        )));
    };
    let columns = (exprs.iter())
        .map(|e| select_item_at(e, &select.projection))
        .collect::<Result<Vec<_>>>()?;
    let grouping = match modifier {
        GroupByWithModifier::Rollup => Expr::Rollup(columns.into_iter().map(|c| vec![c]).collect()),
        GroupByWithModifier::Cube => Expr::Cube(columns.into_iter().map(|c| vec![c]).collect()),
        GroupByWithModifier::Totals => Expr::GroupingSets(vec![columns, vec![]]),
        GroupByWithModifier::GroupingSets(sets) => {
            if !exprs.is_empty() && !matches!(sets, Expr::GroupingSets(_)) {
                return Err(DataFusionError::NotImplemented(format!(
                    "GROUP BY ... GROUPING SETS {sets}"
                )));
            }
            sets.clone()
        }
    };
    select.group_by = GroupByExpr::Expressions(vec![grouping], vec![]);
    Ok(())
}

/// The expression a `GROUP BY` item `expr` names: the select item at a position (`1`),
/// else itself.
fn select_item_at(expr: &Expr, projection: &[SelectItem]) -> Result<Expr> {
    let Expr::Value(value) = expr else {
        return Ok(expr.clone());
    };
    let Value::Number(text, _) = &value.value else {
        return Ok(expr.clone());
    };
    let item = text
        .parse::<usize>()
        .ok()
        .and_then(|position| projection.get(position.checked_sub(1)?));
    match item {
        Some(SelectItem::UnnamedExpr(e)) | Some(SelectItem::ExprWithAlias { expr: e, .. }) => {
            Ok(e.clone())
        }
        _ => Err(DataFusionError::Plan(format!(
            "GROUP BY {text}: there is no select item {text} to group by"
        ))),
    }
}

/// `modifiers` as written.
fn shown(modifiers: &[GroupByWithModifier]) -> String {
    let shown: Vec<String> = modifiers.iter().map(|m| m.to_string()).collect();
    shown.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::sql::parser::DFParser;

    fn rewritten(sql: &str) -> String {
        let mut statements = DFParser::parse_sql(sql).unwrap();
        let mut statement = statements.pop_front().unwrap();
        rewrite_dropped_clauses(&mut statement).unwrap();
        statement.to_string()
    }

    /// The error `rewrite_dropped_clauses` refuses `sql` with.
    fn refusal(sql: &str) -> String {
        let mut statement = DFParser::parse_sql(sql).unwrap().pop_front().unwrap();
        rewrite_dropped_clauses(&mut statement)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn group_by_modifiers_become_grouping_sets() {
        assert_eq!(
            rewritten("SELECT a, b, sum(c) FROM t GROUP BY a, b WITH ROLLUP"),
            "SELECT a, b, sum(c) FROM t GROUP BY ROLLUP (a, b)"
        );
        assert_eq!(
            rewritten("SELECT a, sum(c) AS s FROM t GROUP BY 1 WITH CUBE"),
            "SELECT a, sum(c) AS s FROM t GROUP BY CUBE (a)"
        );
        assert_eq!(
            rewritten("SELECT x FROM (SELECT a AS x FROM t GROUP BY a WITH TOTALS)"),
            "SELECT x FROM (SELECT a AS x FROM t GROUP BY GROUPING SETS ((a), ()))"
        );
    }

    #[test]
    fn prewhere_joins_the_where_and_connect_by_is_refused() {
        assert_eq!(
            rewritten("SELECT count(*) FROM t PREWHERE a > 5 WHERE b = 0 OR c"),
            "SELECT count(*) FROM t WHERE (a > 5) AND (b = 0 OR c)"
        );
        assert_eq!(
            rewritten("SELECT count(*) FROM t PREWHERE a > 5"),
            "SELECT count(*) FROM t WHERE a > 5"
        );
        let error = refusal("SELECT v FROM t START WITH v = 1 CONNECT BY PRIOR v = g");
        assert!(error.contains("WITH RECURSIVE"), "{error}");
    }

    #[test]
    fn fetch_first_becomes_a_limit() {
        assert_eq!(
            rewritten("SELECT a FROM t ORDER BY a OFFSET 2 ROWS FETCH FIRST 3 ROWS ONLY"),
            "SELECT a FROM t ORDER BY a LIMIT 3 OFFSET 2 ROWS"
        );
        assert_eq!(
            rewritten("SELECT a FROM t FETCH NEXT ROW ONLY"),
            "SELECT a FROM t LIMIT 1"
        );
        // Left for DataFusion to refuse.
        assert!(
            rewritten("SELECT a FROM t ORDER BY a FETCH FIRST 2 ROWS WITH TIES").contains("FETCH")
        );
    }

    #[test]
    fn order_by_all_becomes_the_output_positions() {
        assert_eq!(
            rewritten("SELECT k, v + 1 AS w FROM t ORDER BY ALL DESC"),
            "SELECT k, v + 1 AS w FROM t ORDER BY 1 DESC, 2 DESC"
        );
        assert_eq!(
            rewritten("SELECT a, b FROM t UNION SELECT c, d FROM u ORDER BY all"),
            "SELECT a, b FROM t UNION SELECT c, d FROM u ORDER BY 1, 2"
        );
        // A quoted "all" is a column of that name.
        assert!(rewritten(r#"SELECT "all" FROM t ORDER BY "all""#).ends_with(r#"BY "all""#));
        // DataFusion expands a select's `*` and orders by its columns itself.
        assert!(rewritten("SELECT * FROM t ORDER BY ALL").ends_with("ORDER BY ALL"));
        assert_eq!(
            rewritten("VALUES (1, 'b'), (2, 'a') ORDER BY ALL"),
            "VALUES (1, 'b'), (2, 'a') ORDER BY 1, 2"
        );
    }

    #[test]
    fn limit_by_and_an_unknown_width_are_refused_naming_them() {
        for (sql, named) in [
            ("SELECT k, v FROM t ORDER BY v LIMIT 2 BY k", "LIMIT n BY k"),
            (
                "SELECT * FROM t UNION SELECT * FROM u ORDER BY ALL",
                "ORDER BY ALL",
            ),
        ] {
            let error = refusal(sql);
            assert!(error.contains(named), "{sql}: {error}");
        }
    }

    #[test]
    fn what_cannot_be_rewritten_is_refused_naming_it() {
        let error = refusal("SELECT a FROM t GROUP BY 3 WITH ROLLUP");
        assert!(error.contains("no select item 3"), "{error}");
    }
}
