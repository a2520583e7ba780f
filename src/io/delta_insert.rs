//! `INSERT INTO` a Delta table: flumen's own data sink over deltalake's `WriteBuilder`, for
//! two things deltalake's stock sink does not do:
//! - **idempotent inserts**: with `flumen.delta_app_id` and `flumen.delta_txn_version` set,
//!   the insert commits the Delta application transaction `(app id, version)` with its data,
//!   and an insert whose app already committed that version (or a later one) is skipped.
//!   A job that reruns a statement after a crash — not knowing whether its commit landed —
//!   thus adds its rows exactly once (as Spark's `txnAppId`/`txnVersion`).
//! - **no orphan files from a failed insert**: every data file the insert writes is recorded
//!   (a [`RecordingLogStore`] hands deltalake an object store that notes each path it
//!   writes); when the insert fails before its commit, those files are deleted. A driver
//!   killed mid-insert cannot clean up: its files are in no version (readers never see
//!   them) and Delta's VACUUM collects them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::streaming::StreamingTable;
use datafusion::datasource::provider_as_source;
use datafusion::datasource::sink::DataSink;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{LogicalPlan, LogicalPlanBuilder};
use datafusion::physical_plan::metrics::MetricsSet;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType};
use deltalake_core::DeltaTable;
use deltalake_core::kernel::Transaction;
use deltalake_core::kernel::Version;
use deltalake_core::kernel::transaction::{CommitProperties, TransactionError};
use deltalake_core::logstore::{CommitOrBytes, LogStore, LogStoreConfig, LogStoreRef};
use deltalake_core::operations::write::WriteBuilder;
use deltalake_core::protocol::SaveMode;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use uuid::Uuid;

/// The application transaction an insert commits: `(app id, version)`.
pub(crate) type AppTransaction = (String, i64);

/// The data sink of `INSERT INTO` (or `INSERT OVERWRITE`) a Delta table.
pub(crate) struct DeltaInsert {
    /// The table as loaded when the statement was planned (refreshed before writing).
    pub(crate) table: DeltaTable,
    /// Its location, for messages.
    pub(crate) location: String,
    /// Replace the table's rows instead of appending.
    pub(crate) overwrite: bool,
    /// The application transaction to commit with, if the session set one.
    pub(crate) txn: Option<AppTransaction>,
    /// The rows' schema.
    pub(crate) schema: SchemaRef,
}

impl std::fmt::Debug for DeltaInsert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeltaInsert")
            .field("location", &self.location)
            .field("overwrite", &self.overwrite)
            .field("txn", &self.txn)
            .finish()
    }
}

impl DisplayAs for DeltaInsert {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "DeltaInsert: {}", self.location)?;
        if let Some((app, version)) = &self.txn {
            write!(f, ", txn {app} v{version}")?;
        }
        Ok(())
    }
}

#[async_trait]
impl DataSink for DeltaInsert {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn metrics(&self) -> Option<MetricsSet> {
        None
    }

    async fn write_all(
        &self,
        data: SendableRecordBatchStream,
        _context: &Arc<TaskContext>,
    ) -> Result<u64> {
        let failed = |e: &dyn std::fmt::Display| {
            DataFusionError::Execution(format!("INSERT INTO Delta table {}: {e}", self.location))
        };
        let mut table = self.table.clone();
        table.update_state().await.map_err(|e| failed(&e))?;
        let snapshot = table.snapshot().map_err(|e| failed(&e))?;
        if let Some((app, version)) = &self.txn {
            let done = snapshot
                .transaction_version(table.log_store().as_ref(), app)
                .await
                .map_err(|e| failed(&e))?;
            if let Some(done) = done.filter(|done| done >= version) {
                log::info!(
                    "INSERT INTO Delta table {}: application {app} already committed version \
                     {done} (this insert is {version}); skipped",
                    self.location
                );
                return Ok(0);
            }
        }
        let written = Arc::new(Mutex::new(vec![]));
        let recording: LogStoreRef = Arc::new(RecordingLogStore {
            inner: table.log_store(),
            written: Arc::clone(&written),
        });
        let rows = Arc::new(AtomicU64::new(0));
        let input = one_shot_plan(data, Arc::clone(&self.schema), Arc::clone(&rows))?;
        let mut properties = CommitProperties::default();
        if let Some((app, version)) = &self.txn {
            properties = properties.with_application_transaction(Transaction::new(app, *version));
        }
        let mode = match self.overwrite {
            true => SaveMode::Overwrite,
            false => SaveMode::Append,
        };
        let write = WriteBuilder::new(recording, Some(snapshot.snapshot().clone()))
            .with_input_plan(input)
            .with_save_mode(mode)
            .with_commit_properties(properties)
            .await;
        match write {
            Ok(_) => Ok(rows.load(Ordering::Relaxed)),
            Err(e) => {
                let written = std::mem::take(&mut *written.lock().unwrap());
                let cleanup = self.clean_up(written).await;
                Err(failed(&format!("{e} ({cleanup})")))
            }
        }
    }
}

impl DeltaInsert {
    /// After a failed insert: delete the data files it wrote, unless its commit landed (a
    /// failure after it, e.g. writing a checkpoint, leaves them part of the table). Says
    /// what it did.
    async fn clean_up(&self, written: Vec<Path>) -> String {
        let data: Vec<Path> = written
            .into_iter()
            .filter(|p| !p.as_ref().starts_with("_delta_log"))
            .collect();
        if data.is_empty() {
            return "it wrote no data file".into();
        }
        let mut now = self.table.clone();
        if let Err(e) = now.update_state().await {
            return format!(
                "its {} data files are left for VACUUM: the table could not be read to check its \
                 commit: {e}",
                data.len()
            );
        }
        if self.commit_landed(&now, &data).await {
            return "its commit landed: its data files are part of the table".into();
        }
        let store = now.log_store().object_store(None);
        let mut deleted = 0;
        for path in &data {
            if store.delete(path).await.is_ok() {
                deleted += 1;
            }
        }
        format!(
            "{deleted} of the {} data files it wrote were deleted",
            data.len()
        )
    }

    /// Whether table `now` holds the insert: its transaction, or any of its `data` files.
    async fn commit_landed(&self, now: &DeltaTable, data: &[Path]) -> bool {
        let Ok(snapshot) = now.snapshot() else {
            return true;
        };
        if let Some((app, version)) = &self.txn {
            let done = snapshot
                .transaction_version(now.log_store().as_ref(), app)
                .await;
            if matches!(done, Ok(Some(done)) if done >= *version) {
                return true;
            }
        }
        let Ok(uris) = now.get_file_uris() else {
            return true;
        };
        // The table's files as object-store paths (percent-decoded, as the recorded ones).
        let files: Vec<String> = uris
            .map(|uri| {
                url::Url::parse(&uri)
                    .ok()
                    .and_then(|url| Path::from_url_path(url.path()).ok())
                    .map_or(uri, |path| path.to_string())
            })
            .collect();
        data.iter()
            .any(|path| files.iter().any(|file| file.ends_with(path.as_ref())))
    }
}

/// A logical plan that reads `data` once (the insert's input) as rows of `schema` (the
/// table's: DataFusion's sink has checked its NOT NULL columns), counting them in `rows`.
fn one_shot_plan(
    data: SendableRecordBatchStream,
    schema: SchemaRef,
    rows: Arc<AtomicU64>,
) -> Result<LogicalPlan> {
    let relabelled = Arc::clone(&schema);
    let counted = data.map(move |batch| {
        let batch = RecordBatch::try_new(Arc::clone(&relabelled), batch?.columns().to_vec())?;
        rows.fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
        Ok(batch)
    });
    let stream: SendableRecordBatchStream =
        Box::pin(RecordBatchStreamAdapter::new(Arc::clone(&schema), counted));
    let once = OneShot {
        schema: Arc::clone(&schema),
        stream: Mutex::new(Some(stream)),
    };
    let table = StreamingTable::try_new(schema, vec![Arc::new(once)])?;
    LogicalPlanBuilder::scan(
        "flumen_insert_input",
        provider_as_source(Arc::new(table)),
        None,
    )?
    .build()
}

/// A partition that yields one stream, once.
struct OneShot {
    schema: SchemaRef,
    stream: Mutex<Option<SendableRecordBatchStream>>,
}

impl std::fmt::Debug for OneShot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OneShot")
    }
}

impl PartitionStream for OneShot {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        match self.stream.lock().unwrap().take() {
            Some(stream) => stream,
            None => {
                let error = DataFusionError::Internal("the insert's input was read twice".into());
                Box::pin(RecordBatchStreamAdapter::new(
                    Arc::clone(&self.schema),
                    futures::stream::once(async move { Err(error) }),
                ))
            }
        }
    }
}

/// A Delta log store whose object stores note every path written through them (the data
/// files of an insert), so a failed insert can delete them.
struct RecordingLogStore {
    inner: LogStoreRef,
    written: Arc<Mutex<Vec<Path>>>,
}

impl RecordingLogStore {
    fn recording(&self, store: Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore> {
        Arc::new(RecordingStore {
            inner: store,
            written: Arc::clone(&self.written),
        })
    }
}

#[async_trait]
impl LogStore for RecordingLogStore {
    fn name(&self) -> String {
        self.inner.name()
    }

    async fn refresh(&self) -> deltalake_core::DeltaResult<()> {
        self.inner.refresh().await
    }

    async fn read_commit_entry(
        &self,
        version: Version,
    ) -> deltalake_core::DeltaResult<Option<Bytes>> {
        self.inner.read_commit_entry(version).await
    }

    async fn write_commit_entry(
        &self,
        version: Version,
        commit_or_bytes: CommitOrBytes,
        operation_id: Uuid,
    ) -> std::result::Result<(), TransactionError> {
        self.inner
            .write_commit_entry(version, commit_or_bytes, operation_id)
            .await
    }

    async fn abort_commit_entry(
        &self,
        version: Version,
        commit_or_bytes: CommitOrBytes,
        operation_id: Uuid,
    ) -> std::result::Result<(), TransactionError> {
        self.inner
            .abort_commit_entry(version, commit_or_bytes, operation_id)
            .await
    }

    async fn get_latest_version(
        &self,
        start_version: Version,
    ) -> deltalake_core::DeltaResult<Version> {
        self.inner.get_latest_version(start_version).await
    }

    fn object_store(&self, operation_id: Option<Uuid>) -> Arc<dyn ObjectStore> {
        self.recording(self.inner.object_store(operation_id))
    }

    fn root_object_store(&self, operation_id: Option<Uuid>) -> Arc<dyn ObjectStore> {
        self.recording(self.inner.root_object_store(operation_id))
    }

    fn config(&self) -> &LogStoreConfig {
        self.inner.config()
    }
}

/// An object store that notes each path written through it.
#[derive(Debug)]
struct RecordingStore {
    inner: Arc<dyn ObjectStore>,
    written: Arc<Mutex<Vec<Path>>>,
}

impl RecordingStore {
    fn note(&self, location: &Path) {
        self.written.lock().unwrap().push(location.clone());
    }
}

impl std::fmt::Display for RecordingStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recording({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for RecordingStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.note(location);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.note(location);
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.note(to);
        self.inner.copy_opts(from, to, options).await
    }
}
