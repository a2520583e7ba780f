//! `table_changes('path_or_table', start_version [, end_version])`: the rows a Delta table's
//! commits changed, from its change data feed (Databricks' function, name and columns):
//! every column of the table, then `_change_type` (`insert`, `delete`, `update_preimage`,
//! `update_postimage`), `_commit_version` and `_commit_timestamp`. Read by deltalake's CDF
//! scan; a table without `delta.enableChangeDataFeed` is an error saying so.

use std::sync::Arc;

use datafusion::catalog::{Session, TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::common::ScalarValue;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionState;
use datafusion::logical_expr::Expr;
use deltalake_core::DeltaTable;
use deltalake_core::delta_datafusion::cdf::scan::DeltaCdfTableProvider;
use deltalake_core::kernel::Version;
use deltalake_core::table::config::TablePropertiesExt;

use super::delta::{DeltaTableProvider, load_table};
use super::planning_reads::read_while_planning;

/// The `table_changes` table function.
#[derive(Debug, Default)]
pub struct TableChanges;

impl TableFunctionImpl for TableChanges {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let usage = "table_changes('path_or_table', start_version [, end_version])";
        let exprs = args.exprs();
        if !(2..=3).contains(&exprs.len()) {
            return Err(DataFusionError::Plan(format!(
                "{usage}: takes 2 or 3 arguments, got {}",
                exprs.len()
            )));
        }
        let source = match &exprs[0] {
            Expr::Literal(ScalarValue::Utf8(Some(s)) | ScalarValue::LargeUtf8(Some(s)), _) => {
                s.clone()
            }
            other => {
                return Err(DataFusionError::Plan(format!(
                    "{usage}: the first argument must be a quoted path or table name, got {other}"
                )));
            }
        };
        let version = |expr: &Expr, what: &str| match expr {
            Expr::Literal(value, _) => value
                .cast_to(&datafusion::arrow::datatypes::DataType::Int64)
                .ok()
                .and_then(|v| match v {
                    ScalarValue::Int64(Some(v)) if v >= 0 => Some(v as u64),
                    _ => None,
                })
                .ok_or_else(|| {
                    DataFusionError::Plan(format!("{usage}: {what} must be a version ≥ 0"))
                }),
            other => Err(DataFusionError::Plan(format!(
                "{usage}: {what} must be a number, got {other}"
            ))),
        };
        let start = version(&exprs[1], "start_version")?;
        let end = exprs
            .get(2)
            .map(|e| version(e, "end_version"))
            .transpose()?;
        let session = args.session();
        // A table function is planned synchronously; the log is read on a thread of its own.
        let (table, location) =
            read_while_planning(&format!("table_changes('{source}')"), || async {
                let location = location_of(session, &source).await?;
                let table = load_table(session, &location).await?;
                Ok::<_, DataFusionError>((table, location))
            })?;
        changes(table, &location, start, end)
    }
}

/// The Delta location `source` names: a table of the session that is a Delta table, or a
/// path or URL.
async fn location_of(session: &dyn Session, source: &str) -> Result<String> {
    let is_name = source
        .chars()
        .all(|c| c.is_alphanumeric() || c == '_' || c == '.');
    if let Some(state) = session.as_any().downcast_ref::<SessionState>()
        && is_name
    {
        let reference = datafusion::common::TableReference::from(source);
        let schema = state.schema_for_ref(reference.clone())?;
        if let Some(provider) = schema.table(reference.table()).await? {
            return match provider.downcast_ref::<DeltaTableProvider>() {
                Some(delta) => Ok(delta.location().to_string()),
                None => Err(DataFusionError::Plan(format!(
                    "table_changes('{source}'): {source} is not a Delta table"
                ))),
            };
        }
    }
    Ok(source.to_string())
}

/// The change feed of `table` (at `location`) from version `start` to `end` (default: the
/// newest).
fn changes(
    table: DeltaTable,
    location: &str,
    start: u64,
    end: Option<u64>,
) -> Result<Arc<dyn TableProvider>> {
    let failed = |e: &dyn std::fmt::Display| {
        DataFusionError::Plan(format!("table_changes('{location}'): {e}"))
    };
    let snapshot = table.snapshot().map_err(|e| failed(&e))?;
    if !snapshot.table_config().enable_change_data_feed() {
        return Err(DataFusionError::Plan(format!(
            "table_changes('{location}'): the table has no change data feed (its property \
             delta.enableChangeDataFeed is not true; set it when the table is created, or \
             with ALTER TABLE ... SET TBLPROPERTIES in Spark or deltalake's alter_table)"
        )));
    }
    let newest = snapshot.version();
    let end = end.unwrap_or(newest);
    if start > end || end > newest {
        return Err(DataFusionError::Plan(format!(
            "table_changes('{location}', {start}, {end}): the table's versions go up to \
             {newest}, and the start must not pass the end"
        )));
    }
    let builder = table
        .scan_cdf()
        .with_starting_version(start as Version)
        .with_ending_version(end as Version);
    let provider = DeltaCdfTableProvider::try_new(builder).map_err(|e| failed(&e))?;
    Ok(Arc::new(provider))
}
