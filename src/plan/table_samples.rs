//! `TABLESAMPLE`: a random sample of a table's rows, the same rows for the same seed.
//!
//! DataFusion 55 parses `t TABLESAMPLE ...` (and `(SELECT ...) TABLESAMPLE ...`) and then
//! drops the clause: the whole table came back. [`TableSamples`] (a relation planner, so it sees the clause before it is lost)
//! plans it:
//!
//! - `TABLESAMPLE BERNOULLI (p)`, `TABLESAMPLE (p PERCENT)`: each row is kept with
//!   probability `p`/100, independently of the others.
//! - `TABLESAMPLE SYSTEM (p)` (or `BLOCK`) of a Parquet table: whole row groups, each kept
//!   with probability `p`/100, and the others are not read
//!   ([`crate::plan::row_group_samples`]), as BigQuery and Snowflake sample storage blocks.
//!   Of any other relation: row by row, as `BERNOULLI`.
//! - `TABLESAMPLE (n ROWS)`: `n` rows (all of them if the table has fewer), each set of `n`
//!   rows as likely as any other.
//! - `REPEATABLE (s)` (or `SEED (s)`): the seed. Without one, a seed is drawn for the query.
//!
//! A row is kept when its *key*, a 64-bit hash, falls below `p`/100 of the range; `n ROWS`
//! keeps the `n` smallest keys. What the key hashes decides what "the same rows" means:
//!
//! - **A Parquet table** (a listing table, `read_parquet(...)`): the seed, the file's path
//!   within the table ([`crate::plan::row_group_samples::path_in_table`]) and the row's
//!   index in its file (DataFusion's `input_file_name()` and `file_row_index()`, read by
//!   the scan). The table's own place is not hashed: a table copied or mounted elsewhere
//!   (another checkout, a bucket) keeps the same rows. The same seed keeps the same rows
//!   whatever the query reads of them, however the files are cut into splits (a model query's smaller
//!   splits too), in threads and in worker mode, and when a lost block is recomputed. And
//!   since the key is the row's own, the sample commutes with filters: a `WHERE` may still
//!   prune row groups below it.
//! - **Any other relation** (a memory table, CSV, a view): the seed, the row's position in
//!   its stream and a hash of its values ([`crate::plan::sample_keys`]). The same block
//!   keys the same way in every run of its task, so a recompute keeps the same rows; the
//!   same seed keeps the same rows for the same plan and settings.

use datafusion::common::{DFSchema, ScalarValue};
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::ListingTable;
use datafusion::datasource::source_as_provider;
use datafusion::error::{DataFusionError, Result};
use datafusion::functions::expr_fn::{starts_with, substr, substr_index};
use datafusion::logical_expr::conditional_expressions::CaseBuilder;
use datafusion::logical_expr::planner::{
    ContextProvider, PlannedRelation, RelationPlanner, RelationPlannerContext, RelationPlanning,
};
use datafusion::logical_expr::{Expr, LogicalPlan, LogicalPlanBuilder, col, lit};
use datafusion::sql::sqlparser::ast::{
    TableFactor, TableSample, TableSampleKind, TableSampleMethod, TableSampleUnit, Value,
};

use crate::functions::row_hash::ROW_HASH;
use crate::plan::row_group_samples::RowGroupSampleNode;
use crate::plan::sample_keys::{SAMPLE_KEY, SampleKeysNode};

/// How much of the relation a sample keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Amount {
    /// Each row with this probability (0 to 1).
    Share(f64),
    /// This many rows.
    Rows(u64),
}

/// A `TABLESAMPLE` clause, read.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    amount: Amount,
    seed: u64,
    /// `SYSTEM` or `BLOCK`: whole row groups of a Parquet table.
    by_row_groups: bool,
}

/// The relation planner that plans `TABLESAMPLE` (registered on every flumen session).
#[derive(Debug, Default)]
pub struct TableSamples;

impl RelationPlanner for TableSamples {
    fn plan_relation(
        &self,
        mut relation: TableFactor,
        context: &mut dyn RelationPlannerContext,
    ) -> Result<RelationPlanning> {
        let (TableFactor::Table { sample, alias, .. } | TableFactor::Derived { sample, alias, .. }) =
            &mut relation
        else {
            return Ok(RelationPlanning::Original(Box::new(relation)));
        };
        let Some(clause) = sample.take() else {
            return Ok(RelationPlanning::Original(Box::new(relation)));
        };
        let clause = match clause {
            TableSampleKind::BeforeTableAlias(s) | TableSampleKind::AfterTableAlias(s) => *s,
        };
        let alias = alias.take();
        let sample = read_clause(&clause, context)?;
        let plan = context.plan(relation)?;
        let plan = sampled(plan, sample, context.context_provider())?;
        Ok(RelationPlanning::Planned(Box::new(PlannedRelation::new(
            plan, alias,
        ))))
    }
}

/// What `clause` asks for, or an error naming what flumen does not sample by.
fn read_clause(clause: &TableSample, context: &mut dyn RelationPlannerContext) -> Result<Sample> {
    let refuse = |what: &str| {
        Err(DataFusionError::NotImplemented(format!(
            "TABLESAMPLE {what} is not supported: sample a share of the rows \
             (TABLESAMPLE BERNOULLI (10)) or a number of them (TABLESAMPLE (100 ROWS))"
        )))
    };
    if clause.bucket.is_some() {
        return refuse("by bucket (BUCKET x OUT OF y)");
    }
    if clause.offset.is_some() {
        return refuse("with an OFFSET");
    }
    let Some(quantity) = &clause.quantity else {
        return refuse("without an amount");
    };
    let value = context.sql_to_expr(quantity.value.clone(), &DFSchema::empty())?;
    let number = match &value {
        Expr::Literal(v, _) if !v.is_null() => v
            .cast_to(&datafusion::arrow::datatypes::DataType::Float64)
            .ok(),
        _ => None,
    };
    let Some(ScalarValue::Float64(Some(number))) = number else {
        return Err(DataFusionError::Plan(format!(
            "TABLESAMPLE's amount must be a number, got {value}"
        )));
    };
    let amount = match quantity.unit {
        Some(TableSampleUnit::Rows) => {
            if number < 0.0 || number.fract() != 0.0 {
                return Err(DataFusionError::Plan(format!(
                    "TABLESAMPLE ({number} ROWS): the number of rows must be a whole number, \
                     0 or more"
                )));
            }
            Amount::Rows(number as u64)
        }
        Some(TableSampleUnit::Percent) | None => {
            if !(0.0..=100.0).contains(&number) {
                return Err(DataFusionError::Plan(format!(
                    "TABLESAMPLE ({number} PERCENT): the share must be between 0 and 100"
                )));
            }
            Amount::Share(number / 100.0)
        }
    };
    let seed = match &clause.seed {
        None => rand::random(),
        Some(seed) => read_seed(&seed.value.value)?,
    };
    let by_row_groups = matches!(
        clause.name,
        Some(TableSampleMethod::System | TableSampleMethod::Block)
    );
    Ok(Sample {
        amount,
        seed,
        by_row_groups,
    })
}

/// The seed of `REPEATABLE (s)`: an integer (a negative one as its two's complement).
fn read_seed(value: &Value) -> Result<u64> {
    let text = match value {
        Value::Number(text, _) => text.to_string(),
        other => other.to_string(),
    };
    text.parse::<u64>()
        .or_else(|_| text.parse::<i64>().map(|s| s as u64))
        .map_err(|_| {
            DataFusionError::Plan(format!(
                "TABLESAMPLE ... REPEATABLE ({text}): the seed must be an integer"
            ))
        })
}

/// `plan` sampled as `sample` asks.
fn sampled(
    plan: LogicalPlan,
    sample: Sample,
    functions: &dyn ContextProvider,
) -> Result<LogicalPlan> {
    if let (true, Amount::Share(share)) = (sample.by_row_groups, sample.amount)
        && share < 1.0
        && let Some(roots) = parquet_table_roots(&plan)
    {
        let threshold = key_threshold(share);
        return Ok(RowGroupSampleNode::new(plan, sample.seed, threshold, roots).into_plan());
    }
    let columns: Vec<Expr> = plan
        .schema()
        .columns()
        .into_iter()
        .map(Expr::Column)
        .collect();
    let (keyed, key, appended) = match parquet_row_key(&plan, sample.seed, functions)? {
        Some(key) => (plan, key, false),
        None => (
            SampleKeysNode::try_new(plan, sample.seed)?.into_plan(),
            col(SAMPLE_KEY),
            true,
        ),
    };
    let builder = LogicalPlanBuilder::from(keyed);
    let builder = match sample.amount {
        Amount::Share(share) if share >= 1.0 => builder,
        Amount::Share(share) => builder.filter(key.lt(lit(key_threshold(share))))?,
        Amount::Rows(rows) => builder
            .sort(vec![key.sort(true, false)])?
            .limit(0, Some(usize::try_from(rows).unwrap_or(usize::MAX)))?,
    };
    match appended {
        true => builder.project(columns)?.build(),
        false => builder.build(),
    }
}

/// The key below which a row is kept with probability `share` (0 to 1): keys are uniform
/// over the 64-bit range.
fn key_threshold(share: f64) -> u64 {
    // The float-to-integer cast saturates: a share of 1 would give u64::MAX.
    (share * 2f64.powi(64)) as u64
}

/// The roots of the table `plan` scans (each `LOCATION`'s path in its store, as
/// `input_file_name()` states a file's), where it is a Parquet listing table
/// (`read_parquet(...)` too); `None` for any other plan.
fn parquet_table_roots(plan: &LogicalPlan) -> Option<Vec<String>> {
    let LogicalPlan::TableScan(scan) = plan else {
        return None;
    };
    let provider = source_as_provider(&scan.source).ok()?;
    let table = provider.downcast_ref::<ListingTable>()?;
    table.options().format.downcast_ref::<ParquetFormat>()?;
    Some(
        (table.table_paths().iter())
            .map(|url| url.prefix().as_ref().to_string())
            .collect(),
    )
}

/// [`crate::plan::row_group_samples::path_in_table`] as an expression over `path`, a
/// file's path.
fn path_in_table_expr(path: Expr, roots: &[String]) -> Expr {
    let name = substr_index(path.clone(), lit("/"), lit(-1i64));
    if roots.iter().any(String::is_empty) {
        return path;
    }
    let mut case: Option<CaseBuilder> = None;
    for root in roots {
        let under = format!("{root}/");
        // substr counts characters from 1.
        let after = (under.chars().count() + 1) as i64;
        let (is_root, is_under) = (
            path.clone().eq(lit(root.as_str())),
            starts_with(path.clone(), lit(under)),
        );
        let rest = substr(path.clone(), lit(after));
        let mut builder = match case {
            None => datafusion::logical_expr::when(is_root, name.clone()),
            Some(mut case) => case.when(is_root, name.clone()),
        };
        case = Some(builder.when(is_under, rest));
    }
    match case {
        Some(mut case) => case.otherwise(name.clone()).unwrap_or(name),
        None => name,
    }
}

/// `row_hash(seed, <the file's path in the table>, file_row_index())` where `plan` is a
/// scan of a Parquet listing table (the row's own place, read by the scan); `None`
/// otherwise.
fn parquet_row_key(
    plan: &LogicalPlan,
    seed: u64,
    functions: &dyn ContextProvider,
) -> Result<Option<Expr>> {
    let Some(roots) = parquet_table_roots(plan) else {
        return Ok(None);
    };
    let function = |name: &str| {
        functions.get_function_meta(name).ok_or_else(|| {
            DataFusionError::Internal(format!("TABLESAMPLE needs the function {name}"))
        })
    };
    let (hash, file, row) = (
        function(ROW_HASH)?,
        function("input_file_name")?,
        function("file_row_index")?,
    );
    Ok(Some(hash.call(vec![
        lit(seed),
        path_in_table_expr(file.call(vec![]), &roots),
        row.call(vec![]),
    ])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::row_group_samples::path_in_table;

    #[test]
    fn a_share_keeps_keys_below_that_share_of_the_range() {
        assert_eq!(key_threshold(0.0), 0);
        assert_eq!(key_threshold(0.5), 1 << 63);
        assert_eq!(key_threshold(1.0), u64::MAX);
    }

    #[test]
    fn a_file_is_named_by_its_path_within_its_table() {
        let roots = ["data/t".to_string(), "other/u.parquet".to_string()];
        assert_eq!(
            path_in_table("data/t/part-0.parquet", &roots),
            "part-0.parquet"
        );
        assert_eq!(
            path_in_table("data/t/k=1/a.parquet", &roots),
            "k=1/a.parquet"
        );
        assert_eq!(path_in_table("other/u.parquet", &roots), "u.parquet");
        // A root is a whole directory name: `data/t` does not hold `data/t2/...`.
        assert_eq!(path_in_table("data/t2/a.parquet", &roots), "a.parquet");
        assert_eq!(path_in_table("x.parquet", &[String::new()]), "x.parquet");
    }

    #[test]
    fn seeds_are_integers_negative_ones_included() {
        let number = |s: &str| Value::Number(s.into(), false);
        assert_eq!(read_seed(&number("42")).unwrap(), 42);
        assert_eq!(read_seed(&number("-1")).unwrap(), u64::MAX);
        let error = read_seed(&number("1.5")).unwrap_err().to_string();
        assert!(error.contains("REPEATABLE (1.5)"), "{error}");
    }
}
