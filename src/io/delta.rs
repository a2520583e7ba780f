//! Delta Lake tables through the `deltalake` crate (its DataFusion integration).
//!
//! Reads: deltalake plans the scan (log replay, partition pruning and file skipping from the
//! log's statistics) as a `DeltaScanExec` over an ordinary DataFusion Parquet scan; flumen's
//! planner cuts that Parquet scan into byte-range source splits like any other (see
//! `operators::is_row_local`), so a lost block re-reads the same files and row groups.
//!
//! Writes: `INSERT INTO` a Delta table runs flumen's [`DeltaInsert`] sink over deltalake's
//! writer: it writes the new data files, then commits them in one Delta transaction once
//! every input block is written. A failure before that commit leaves the table unchanged and
//! deletes the files it wrote; with `flumen.delta_app_id` and `flumen.delta_txn_version` the
//! commit carries an application transaction, so a rerun of an insert that already
//! committed is skipped (see [`crate::io::delta_insert`]).

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::{Schema, SchemaRef};
use datafusion::catalog::{Session, TableProvider, TableProviderFactory};
use datafusion::datasource::listing::ListingTableUrl;
use datafusion::datasource::sink::DataSinkExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionState;
use datafusion::logical_expr::dml::InsertOp;
use datafusion::logical_expr::{CreateExternalTable, Expr, TableProviderFilterPushDown, TableType};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;
use deltalake_core::kernel::StructType;
use deltalake_core::kernel::engine::arrow_conversion::TryIntoKernel;
use deltalake_core::logstore::{
    LogStore, LogStoreFactory, ObjectStoreRef, StorageConfig, default_logstore,
};
use deltalake_core::{DeltaTable, DeltaTableBuilder};
use url::Url;

use crate::config::FlumenConfig;
use crate::io::delta_insert::{AppTransaction, DeltaInsert};
use crate::io::lakehouse_options::{self, time_travel, timestamp_option};
use crate::io::object_stores;

/// Which version of a Delta table to read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeltaVersion {
    /// The newest committed version.
    #[default]
    Latest,
    /// This version number.
    Version(i64),
    /// The newest version committed at or before this time (RFC 3339 text).
    AsOf(String),
}

/// `CREATE EXTERNAL TABLE t STORED AS DELTATABLE LOCATION '...'`.
///
/// OPTIONS: `'version' 'N'` or `'timestamp' '2026-01-01T00:00:00Z'` (time travel), plus
/// `aws.*`/`gcp.*`/`azure.*` store settings. A statement that names columns over a location
/// without a Delta log creates an empty Delta table with those columns (and its
/// `PARTITIONED BY` columns), ready for `INSERT INTO`.
#[derive(Debug, Default)]
pub struct DeltaTableFactory;

#[async_trait]
impl TableProviderFactory for DeltaTableFactory {
    async fn create(
        &self,
        state: &dyn Session,
        cmd: &CreateExternalTable,
    ) -> Result<Arc<dyn TableProvider>> {
        let (location, options) = lakehouse_options::prepare(state, cmd)?;
        let table = format!("Delta table {location}");
        let version = match time_travel(cmd, &table, ["version", "timestamp"])? {
            Some(("version", v)) => DeltaVersion::Version(v.parse().map_err(|_| {
                DataFusionError::Plan(format!("{table}: version '{v}' is not a number"))
            })?),
            Some((_, at)) => DeltaVersion::AsOf(at.to_string()),
            None => DeltaVersion::Latest,
        };
        let columns = cmd.schema.as_arrow();
        let open = async {
            if !columns.fields().is_empty() && !has_delta_log(state, location).await? {
                if version != DeltaVersion::Latest {
                    return Err(DataFusionError::Plan(format!(
                        "Delta table {location} does not exist yet: it has no version to travel to"
                    )));
                }
                create_delta_table(state, location, columns, &cmd.table_partition_cols).await?;
            }
            delta_table(state, location, version).await
        };
        open.await
            .map_err(|e| object_stores::with_credentials_hint(e, location, &options))
    }
}

/// The table URL of `location` (a local path or a URL), ending in `/`. Unlike deltalake's
/// `ensure_table_uri`, it creates no directory, so a mistyped path is reported, not created.
fn table_url(location: &str) -> Result<Url> {
    let bad = |why: &dyn std::fmt::Display| {
        DataFusionError::Plan(format!("{location} is not a Delta table location: {why}"))
    };
    let mut url = match Url::parse(location) {
        Ok(url) if url.scheme().len() > 1 && url.scheme() != "file" => url,
        Ok(url) if url.scheme() == "file" => url,
        _ => {
            let path = std::path::absolute(location).map_err(|e| bad(&e))?;
            Url::from_directory_path(path).map_err(|_| bad(&"not an absolute path"))?
        }
    };
    if !url.path().ends_with('/') {
        let path = format!("{}/", url.path());
        url.set_path(&path);
    }
    Ok(url)
}

/// Log stores for the object stores flumen registers itself (`s3://`, `gs://`, `az://`...):
/// deltalake's default log store, whose commits are a put-if-absent of the next log entry,
/// which S3, GCS and Azure all provide. Registered once per process; a scheme that already
/// has a factory (e.g. from deltalake's own cloud crates) keeps it.
fn register_cloud_log_stores() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let registry = deltalake_core::logstore::logstore_factories();
        for scheme in ["s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss"] {
            let url = Url::parse(&format!("{scheme}://")).expect("scheme URL");
            registry
                .entry(url)
                .or_insert_with(|| Arc::new(ConditionalPutLogStores));
        }
    });
}

/// Makes deltalake's default (put-if-absent) log store for a table.
struct ConditionalPutLogStores;

impl LogStoreFactory for ConditionalPutLogStores {
    fn with_options(
        &self,
        prefixed_store: ObjectStoreRef,
        root_store: ObjectStoreRef,
        location: &Url,
        options: &StorageConfig,
    ) -> deltalake_core::DeltaResult<Arc<dyn LogStore>> {
        Ok(default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}

/// A builder for the table at `location` that reads through the session's object store
/// (so stores registered from `aws.*` options or by the embedding program are used).
pub(crate) fn builder(state: &dyn Session, location: &str) -> Result<DeltaTableBuilder> {
    register_cloud_log_stores();
    let url = table_url(location)?;
    let builder = DeltaTableBuilder::from_url(url.clone())
        .map_err(|e| DataFusionError::Plan(format!("Delta table {location}: {e}")))?;
    if url.scheme() == "file" {
        return Ok(builder);
    }
    let listing = ListingTableUrl::parse(url.as_str())?;
    let store = state.runtime_env().object_store(listing.object_store())?;
    Ok(builder.with_storage_backend(store, url))
}

/// Whether `location` holds a `_delta_log` with at least one entry.
pub(crate) async fn has_delta_log(state: &dyn Session, location: &str) -> Result<bool> {
    use futures::StreamExt;
    let dir = format!(
        "{}/_delta_log/",
        table_url(location)?.as_str().trim_end_matches('/')
    );
    let listing = ListingTableUrl::parse(&dir)?;
    let store = state.runtime_env().object_store(listing.object_store())?;
    let mut entries = store.list(Some(listing.prefix()));
    match entries.next().await {
        None => Ok(false),
        Some(Ok(_)) => Ok(true),
        Some(Err(e)) => Err(DataFusionError::Plan(format!(
            "cannot list the Delta log of {location}: {e}"
        ))),
    }
}

/// The Delta table at `location`, newest version, as deltalake loads it.
pub(crate) async fn load_table(state: &dyn Session, location: &str) -> Result<DeltaTable> {
    if !has_delta_log(state, location).await? {
        return Err(DataFusionError::Plan(format!(
            "{location} is not a Delta table: it has no _delta_log"
        )));
    }
    builder(state, location)?
        .load()
        .await
        .map_err(|e| DataFusionError::Plan(format!("Delta table {location}: {e}")))
}

/// Create an empty Delta table at `location` with `schema`'s columns.
pub async fn create_delta_table(
    state: &dyn Session,
    location: &str,
    schema: &Schema,
    partition_columns: &[String],
) -> Result<()> {
    let fail = |e: &dyn std::fmt::Display| {
        DataFusionError::Plan(format!("cannot create Delta table {location}: {e}"))
    };
    let kernel: StructType = schema.try_into_kernel().map_err(|e| fail(&e))?;
    let table = builder(state, location)?.build().map_err(|e| fail(&e))?;
    table
        .create()
        .with_columns(kernel.fields().cloned())
        .with_partition_columns(partition_columns.iter().cloned())
        .await
        .map_err(|e| fail(&e))?;
    Ok(())
}

/// The Delta table at `location`, at `version`, as a table provider that scans through
/// flumen's splits and accepts `INSERT INTO`. The location's object store must be registered
/// in the session (local paths always are).
pub async fn delta_table(
    state: &dyn Session,
    location: &str,
    version: DeltaVersion,
) -> Result<Arc<dyn TableProvider>> {
    Ok(Arc::new(
        DeltaTableProvider::open(state, location, version).await?,
    ))
}

/// A Delta table as a DataFusion table. A pinned version (number or timestamp) always reads
/// that version; `Latest` reads the newest version committed when each query starts, so a
/// query after an `INSERT INTO` sees the inserted rows.
#[derive(Debug)]
pub struct DeltaTableProvider {
    location: String,
    version: DeltaVersion,
    /// The loaded table; refreshed to the newest version before each query when `Latest`.
    table: tokio::sync::Mutex<DeltaTable>,
    /// deltalake's provider for the version loaded at creation: schema and filter pushdown.
    initial: Arc<dyn TableProvider>,
}

impl DeltaTableProvider {
    /// Where the table is.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Load the table at `location` at `version`.
    pub async fn open(state: &dyn Session, location: &str, version: DeltaVersion) -> Result<Self> {
        if !has_delta_log(state, location).await? {
            return Err(DataFusionError::Plan(format!(
                "{location} is not a Delta table: it has no _delta_log"
            )));
        }
        let mut builder = builder(state, location)?;
        match &version {
            DeltaVersion::Latest => {}
            DeltaVersion::Version(v) => {
                let v = u64::try_from(*v).map_err(|_| {
                    DataFusionError::Plan(format!(
                        "Delta table {location}: version {v} is negative"
                    ))
                })?;
                builder = builder.with_version(v);
            }
            DeltaVersion::AsOf(at) => {
                let millis = timestamp_option(&format!("Delta table {location}"), at)?;
                let at = chrono::DateTime::from_timestamp_millis(millis).ok_or_else(|| {
                    DataFusionError::Plan(format!("Delta table {location}: bad timestamp {at}"))
                })?;
                builder = builder.with_timestamp(at);
            }
        }
        let table = builder.load().await.map_err(|e| {
            DataFusionError::Plan(format!(
                "cannot open Delta table {location} at {version:?}: {e}"
            ))
        })?;
        let initial = provider_of(&table, state).await?;
        Ok(Self {
            location: location.to_string(),
            version,
            table: tokio::sync::Mutex::new(table),
            initial,
        })
    }

    /// deltalake's provider for the version this query reads.
    async fn for_query(&self, state: &dyn Session) -> Result<Arc<dyn TableProvider>> {
        let mut table = self.table.lock().await;
        if self.version == DeltaVersion::Latest {
            table.update_state().await.map_err(|e| {
                DataFusionError::Plan(format!("cannot refresh Delta table {}: {e}", self.location))
            })?;
        }
        let provider = provider_of(&table, state).await?;
        if provider.schema() != self.initial.schema() {
            return Err(DataFusionError::Plan(format!(
                "the schema of Delta table {} changed since it was registered; register it again",
                self.location
            )));
        }
        Ok(provider)
    }
}

/// deltalake's table provider for the loaded version of `table`, configured from `state`.
async fn provider_of(table: &DeltaTable, state: &dyn Session) -> Result<Arc<dyn TableProvider>> {
    let provider = table.table_provider();
    let provider = match state.as_any().downcast_ref::<SessionState>() {
        Some(session) => provider.with_session(Arc::new(session.clone())),
        None => provider,
    };
    Ok(Arc::new(provider.build().await?))
}

#[async_trait]
impl TableProvider for DeltaTableProvider {
    fn schema(&self) -> SchemaRef {
        self.initial.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.for_query(state)
            .await?
            .scan(state, projection, filters, limit)
            .await
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        self.initial.supports_filters_pushdown(filters)
    }

    async fn insert_into(
        &self,
        state: &dyn Session,
        input: Arc<dyn ExecutionPlan>,
        insert_op: InsertOp,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if self.version != DeltaVersion::Latest {
            return Err(DataFusionError::Plan(format!(
                "Delta table {} is registered at {:?}: only its latest version takes INSERT INTO",
                self.location, self.version
            )));
        }
        // Checks that the table's schema did not change since it was registered.
        self.for_query(state).await?;
        let overwrite = match insert_op {
            InsertOp::Append => false,
            InsertOp::Overwrite => true,
            InsertOp::Replace => {
                return Err(DataFusionError::Plan(format!(
                    "Delta table {}: INSERT OR REPLACE is not supported (use INSERT INTO or \
                     INSERT OVERWRITE)",
                    self.location
                )));
            }
        };
        let sink = DeltaInsert {
            table: self.table.lock().await.clone(),
            location: self.location.clone(),
            overwrite,
            txn: app_transaction(state)?,
            schema: self.schema(),
        };
        Ok(Arc::new(DataSinkExec::new(input, Arc::new(sink), None)))
    }
}

/// The prefix of a session's Delta app ids, a session-config extension: `flumen serve` gives
/// each client session its user's name, so that the app id a user sets
/// (`flumen.delta_app_id`) is `USER/APP` in the table's log and one user can never set
/// another's (a maximal version there would silently skip the victim's inserts).
#[derive(Debug, Clone)]
pub struct DeltaAppNamespace(pub String);

/// The application transaction the session set for Delta inserts
/// (`flumen.delta_app_id` with `flumen.delta_txn_version`, under the session's
/// [`DeltaAppNamespace`]), if any.
fn app_transaction(state: &dyn Session) -> Result<Option<AppTransaction>> {
    let Some(config) = state.config_options().extensions.get::<FlumenConfig>() else {
        return Ok(None);
    };
    match (config.delta_app_id.as_str(), config.delta_txn_version) {
        ("", None) => Ok(None),
        ("", Some(_)) => Err(DataFusionError::Plan(
            "flumen.delta_txn_version is set but flumen.delta_app_id is not: an idempotent \
             Delta insert needs both"
                .into(),
        )),
        (_, None) => Err(DataFusionError::Plan(
            "flumen.delta_app_id is set but flumen.delta_txn_version is not: an idempotent \
             Delta insert needs both"
                .into(),
        )),
        (app, Some(version)) => {
            let version = i64::try_from(version).map_err(|_| {
                DataFusionError::Plan(format!("flumen.delta_txn_version {version} is too large"))
            })?;
            let app = match state.config().get_extension::<DeltaAppNamespace>() {
                Some(namespace) => format!("{}/{app}", namespace.0),
                None => app.to_string(),
            };
            Ok(Some((app, version)))
        }
    }
}

/// Register the Delta table at `location` as `name` in `ctx` (the embedded form of
/// `CREATE EXTERNAL TABLE name STORED AS DELTATABLE LOCATION '...'`). Remote locations need
/// their object store registered first, e.g. with [`object_stores::register_for_location`].
pub async fn register_delta_table(
    ctx: &SessionContext,
    name: &str,
    location: &str,
    version: DeltaVersion,
) -> Result<()> {
    let state = ctx.state();
    let table = delta_table(&state, location, version).await?;
    ctx.register_table(name, table)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_sessions_app_ids_are_under_its_namespace() {
        let ctx = crate::session(crate::FlumenConfig::default());
        ctx.sql("SET flumen.delta_app_id = 'nightly'")
            .await
            .unwrap();
        ctx.sql("SET flumen.delta_txn_version = 7").await.unwrap();
        let state = ctx.state();
        assert_eq!(
            app_transaction(&state).unwrap(),
            Some(("nightly".to_string(), 7))
        );
        let config =
            (state.config().clone()).with_extension(Arc::new(DeltaAppNamespace("ana".into())));
        let namespaced = datafusion::execution::SessionStateBuilder::new_from_existing(state)
            .with_config(config)
            .build();
        assert_eq!(
            app_transaction(&namespaced).unwrap(),
            Some(("ana/nightly".to_string(), 7))
        );
    }
}
