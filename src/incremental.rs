//! `flumen extract --incremental SOURCE FEATURES`: a Delta feature table kept in step with
//! its Delta source by embedding only what changed.
//!
//! Each run reads the source's newest version `v` and the last source version the feature
//! table took in, kept in the feature table's own log as a Delta application transaction
//! (`flumen-extract SOURCE`, version `v`): a rerun of a run that committed does nothing, and
//! one that did not redoes it whole. The first run computes the features of every row; a
//! later one reads the source's change data feed since that version (`table_changes`),
//! computes the features of the rows that were inserted or updated as the source holds them
//! at `v`, and removes the rows that are gone — in one Delta commit (a MERGE by key),
//! carrying the transaction. The features are those of the main job
//! ([`crate::feature_job::FEATURES`]).

use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{ArrayRef, BooleanArray, RecordBatch, new_null_array};
use datafusion::arrow::compute::concat_batches;
use datafusion::arrow::datatypes::{Field, Schema, SchemaRef};
use datafusion::catalog::MemTable;
use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::SessionContext;
use deltalake_core::DeltaTable;
use deltalake_core::delta_datafusion::DataFusionMixins;
use deltalake_core::kernel::Transaction;
use deltalake_core::kernel::transaction::CommitProperties;
use deltalake_core::protocol::SaveMode;
use deltalake_core::table::config::TablePropertiesExt;

use crate::io::DeltaVersion;
use crate::io::delta::{delta_table, has_delta_log, load_table};

/// The key column both tables share.
pub const KEY: &str = "id";

/// The column of the merge's source that marks a removed row.
const REMOVED: &str = "_flumen_removed";

/// What one incremental run did.
#[derive(Debug, Clone, PartialEq)]
pub struct IncrementalRun {
    /// The source version the feature table now holds.
    pub source_version: u64,
    /// The source version it held before (`None`: the first run).
    pub previous_version: Option<u64>,
    /// Rows whose features were computed (the model's rows).
    pub computed_rows: u64,
    /// Rows removed from the feature table.
    pub removed_rows: u64,
    /// Seconds the run took.
    pub seconds: f64,
}

/// Bring the Delta table at `features` up to the Delta table at `source` (which must have
/// its change data feed on).
pub async fn extract_incremental(
    ctx: &SessionContext,
    source: &str,
    features: &str,
) -> Result<IncrementalRun> {
    let started = Instant::now();
    let state = ctx.state();
    let failed = |e: &dyn std::fmt::Display| {
        DataFusionError::Execution(format!("flumen extract --incremental {features}: {e}"))
    };
    let source_table = load_table(&state, source).await?;
    let snapshot = source_table.snapshot().map_err(|e| failed(&e))?;
    if !snapshot.table_config().enable_change_data_feed() {
        return Err(DataFusionError::Plan(format!(
            "flumen extract --incremental: the source {source} has no change data feed (set \
             delta.enableChangeDataFeed = true on it)"
        )));
    }
    let version = snapshot.version();
    let app = format!("flumen-extract {source}");
    // A feature table that does not exist yet is made by the first run; one that cannot be
    // read is an error (never overwritten as if missing).
    let target = match has_delta_log(&state, features).await? {
        true => Some(load_table(&state, features).await?),
        false => None,
    };
    let previous = match &target {
        Some(table) => table
            .snapshot()
            .map_err(|e| failed(&e))?
            .transaction_version(table.log_store().as_ref(), &app)
            .await
            .map_err(|e| failed(&e))?
            .map(|v| v as u64),
        None => None,
    };
    let mut run = IncrementalRun {
        source_version: version,
        previous_version: previous,
        computed_rows: 0,
        removed_rows: 0,
        seconds: 0.0,
    };
    if previous == Some(version) {
        run.seconds = started.elapsed().as_secs_f64();
        return Ok(run);
    }
    let named = |what: &str| format!("__flumen_incremental_{what}_{}", std::process::id());
    let (source_name, changes_name) = (named("source"), named("changes"));
    ctx.register_table(
        &source_name,
        delta_table(&state, source, DeltaVersion::Version(version as i64)).await?,
    )?;
    let features_sql = crate::feature_job::FEATURES;
    let result = async {
        let commit = CommitProperties::default()
            .with_application_transaction(Transaction::new(&app, version as i64));
        match (previous, target) {
            (Some(from), Some(table)) => {
                let changes = format!(
                    "table_changes('{}', {}, {version})",
                    source.replace('\'', "''"),
                    from + 1
                );
                ctx.sql(&format!(
                    "CREATE VIEW {changes_name} AS SELECT DISTINCT {KEY} FROM {changes}"
                ))
                .await?;
                let computed = ctx
                    .sql(&format!(
                        "SELECT {features_sql} FROM {source_name} \
                         WHERE {KEY} IN (SELECT {KEY} FROM {changes_name})"
                    ))
                    .await?
                    .collect()
                    .await?;
                let removed = ctx
                    .sql(&format!(
                        "SELECT {KEY} FROM {changes_name} \
                         WHERE {KEY} NOT IN (SELECT {KEY} FROM {source_name})"
                    ))
                    .await?
                    .collect()
                    .await?;
                run.computed_rows = computed.iter().map(|b| b.num_rows() as u64).sum();
                run.removed_rows = removed.iter().map(|b| b.num_rows() as u64).sum();
                merge(table, computed, removed, commit)
                    .await
                    .map_err(|e| failed(&e))
            }
            (_, target) => {
                // The first run, or a feature table this job never wrote: every row.
                let computed = ctx
                    .sql(&format!("SELECT {features_sql} FROM {source_name}"))
                    .await?
                    .collect()
                    .await?;
                run.computed_rows = computed.iter().map(|b| b.num_rows() as u64).sum();
                let table = match target {
                    Some(table) => table,
                    None => crate::io::delta::builder(&state, features)?
                        .build()
                        .map_err(|e| failed(&e))?,
                };
                table
                    .write(computed)
                    .with_save_mode(SaveMode::Overwrite)
                    .with_commit_properties(commit)
                    .await
                    .map(|_| ())
                    .map_err(|e| failed(&e))
            }
        }
    }
    .await;
    let _ = ctx.deregister_table(&source_name);
    let _ = ctx.deregister_table(&changes_name);
    result?;
    run.seconds = started.elapsed().as_secs_f64();
    Ok(run)
}

/// Merge `computed` rows (upserted by key) and `removed` keys (deleted) into `table` in
/// one commit.
async fn merge(
    table: DeltaTable,
    computed: Vec<RecordBatch>,
    removed: Vec<RecordBatch>,
    commit: CommitProperties,
) -> Result<()> {
    if computed.is_empty() && removed.is_empty() {
        // Nothing changed but the version: commit the transaction alone (an empty write).
        table
            .write(vec![])
            .with_save_mode(SaveMode::Append)
            .with_commit_properties(commit)
            .await
            .map_err(|e| DataFusionError::Execution(e.to_string()))?;
        return Ok(());
    }
    let columns: SchemaRef = match computed.first() {
        Some(batch) => batch.schema(),
        None => Arc::new(table_arrow_schema(&table)?),
    };
    let schema = Arc::new(Schema::new(
        columns
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true))
            .chain([Field::new(
                REMOVED,
                datafusion::arrow::datatypes::DataType::Boolean,
                false,
            )])
            .collect::<Vec<_>>(),
    ));
    let mut batches = Vec::new();
    for batch in &computed {
        let mut arrays = batch.columns().to_vec();
        arrays.push(Arc::new(BooleanArray::from(vec![false; batch.num_rows()])));
        batches.push(RecordBatch::try_new(Arc::clone(&schema), arrays)?);
    }
    for batch in &removed {
        let rows = batch.num_rows();
        let arrays: Vec<ArrayRef> = (schema.fields().iter())
            .map(|field| match field.name().as_str() {
                KEY => Arc::clone(batch.column(0)),
                REMOVED => Arc::new(BooleanArray::from(vec![true; rows])) as ArrayRef,
                _ => new_null_array(field.data_type(), rows),
            })
            .collect();
        batches.push(RecordBatch::try_new(Arc::clone(&schema), arrays)?);
    }
    let source = concat_batches(&schema, &batches)?;
    let plain = SessionContext::new();
    let frame = plain.read_table(Arc::new(MemTable::try_new(
        Arc::clone(&schema),
        vec![vec![source]],
    )?))?;
    let names: Vec<String> = (columns.fields().iter())
        .map(|f| f.name().clone())
        .collect();
    let fail = |e: &dyn std::fmt::Display| DataFusionError::Execution(e.to_string());
    table
        .merge(frame, format!("target.{KEY} = source.{KEY}"))
        .with_source_alias("source")
        .with_target_alias("target")
        .with_commit_properties(commit)
        .when_matched_delete(|delete| delete.predicate(format!("source.{REMOVED}")))
        .map_err(|e| fail(&e))?
        .when_matched_update(|update| {
            (names.iter()).fold(update.predicate(format!("NOT source.{REMOVED}")), |u, n| {
                u.update(n.as_str(), format!("source.{n}"))
            })
        })
        .map_err(|e| fail(&e))?
        .when_not_matched_insert(|insert| {
            (names.iter()).fold(insert.predicate(format!("NOT source.{REMOVED}")), |i, n| {
                i.set(n.as_str(), format!("source.{n}"))
            })
        })
        .map_err(|e| fail(&e))?
        .await
        .map_err(|e| fail(&e))?;
    Ok(())
}

/// The Arrow schema of `table`'s newest version.
fn table_arrow_schema(table: &DeltaTable) -> Result<Schema> {
    let snapshot = table
        .snapshot()
        .map_err(|e| DataFusionError::Execution(e.to_string()))?;
    Ok(snapshot.snapshot().input_schema().as_ref().clone())
}
