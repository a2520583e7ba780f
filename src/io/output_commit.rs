//! Exactly-once file output: `COPY ... TO`, `write_parquet`/`write_csv`/`write_json` and
//! `INSERT INTO` a listing table write their files under a hidden staging name, and the
//! driver commits them once, after the last block was written.
//!
//! [`stage_file_sinks`] rebuilds every Parquet, CSV and JSON sink of a plan so that it writes
//! below a staging location, and wraps it in a [`StagedSink`]:
//! - a single output file `dir/out.parquet` is written as `dir/.out.parquet.flumen-staging-ID`
//!   and renamed over `dir/out.parquet` at commit;
//! - a directory output `dir/` (with or without `PARTITIONED BY`) is written below
//!   `dir/.flumen-staging-ID/`, and each file is moved to the same relative path below `dir/`
//!   at commit. DataFusion's listing tables skip that hidden subdirectory, so readers never
//!   see a half-written output.
//!
//! Committing a directory moves several files, which no file system does at once, so the
//! commit is a decision recorded first and carried out after:
//! 1. every file is staged; 2. the marker `_flumen_commit` is written in the staging
//!    directory (the decision); 3. the files are renamed into place; 4. the staging
//!    directory (marker included) is removed.
//!
//! A driver killed at any instant leaves a staging directory behind; the next statement
//! that writes to the same place first recovers it ([`recover_output`]): with the marker, the
//! commit is finished (the rest of the files are moved); without it, what was staged is
//! deleted, once the process that staged it is gone. A staging name carries its writer:
//! host, process id and process start time ([`staging_id`]): a writer on this host is gone
//! when no process has that id and start time (a reused pid is not it); one on another host
//! (storage shared across hosts) counts as gone a day after its last write. Recovery never
//! follows a symbolic link: a staging directory that is one, or holds one, is left as it is
//! (a planted `.flumen-staging-*` link would otherwise have its target's files deleted or
//! moved), and a staged file that is one is removed as a link.
//!
//! On a local file system (`flumen.output_fsync`, on by default) the staged files and their
//! directory are flushed to disk before the commit's renames, and the target directory
//! after them: a power loss after the statement returned loses no committed row. So after recovery the output is the
//! old one or the whole new one, and rerunning a statement that did not commit writes every
//! row once. (Readers that list the directory between the crash and the recovery of a
//! commit that was half-way through step 3 see part of the new files; a table format, such
//! as Delta, is what makes a multi-file commit atomic for every reader.)
//!
//! A statement that fails (a task error, a memory budget) or is cancelled (its future
//! dropped: Ctrl-C, a dropped stream) deletes what it staged, and leaves existing files as
//! they were; one cancelled during step 3 finishes its commit instead. Lost blocks are recomputed upstream of the
//! sink, which runs once on the driver, so every row reaches the staged files exactly once;
//! the commit is that sink's alone (the one committer, as Spark's output commit coordinator
//! lets only the first attempt of a task commit).

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::file_format::csv::CsvSink;
use datafusion::datasource::file_format::json::JsonSink;
use datafusion::datasource::listing::ListingTableUrl;
use datafusion::datasource::physical_plan::parquet::ParquetSink;
use datafusion::datasource::physical_plan::{FileOutputMode, FileSink, FileSinkConfig};
use datafusion::datasource::sink::{DataSink, DataSinkExec};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::parquet::file::metadata::SortingColumn;
use datafusion::physical_expr::LexRequirement;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::metrics::MetricsSet;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan};
use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

/// Where a staged sink's files go when it commits.
#[derive(Debug, Clone)]
enum Target {
    /// One file: the staged file is renamed to this path.
    File { staged: Path, target: Path },
    /// A directory: everything below `staged` moves to the same place below `target`.
    Directory { staged: Path, target: Path },
}

/// A file sink that writes to a staging location and commits once (see the module docs).
#[derive(Debug)]
pub struct StagedSink {
    inner: Arc<dyn DataSink>,
    config: FileSinkConfig,
    target: Target,
}

/// The file whose presence in a staging directory records the decision to commit it.
pub const COMMIT_MARKER: &str = "_flumen_commit";

/// The name prefix of a directory output's staging directories.
const STAGING_PREFIX: &str = ".flumen-staging-";

impl StagedSink {
    /// Staged files become visible: rename them into place (a directory: marker first, see
    /// the module docs). `fsync` (a local file system only): the staged files and
    /// directories reach the disk before the renames, the target directory after them.
    async fn commit(&self, store: &Arc<dyn ObjectStore>, local: bool, fsync: bool) -> Result<()> {
        let fsync = fsync && local;
        match &self.target {
            Target::File { staged, target } => {
                if fsync {
                    sync_path(staged)?;
                }
                store.rename(staged, target).await?;
                if fsync {
                    sync_parent(target)?;
                }
            }
            Target::Directory { staged, target } => {
                if fsync {
                    sync_tree(staged)?;
                }
                let marker = staged.clone().join(COMMIT_MARKER);
                store.put(&marker, Vec::new().into()).await?;
                if fsync {
                    sync_path(&marker)?;
                    sync_path(staged)?;
                }
                finish_commit(store, staged, target, local).await?;
                if fsync {
                    sync_tree_dirs(target)?;
                }
            }
        }
        Ok(())
    }

    /// Where it stages its files.
    fn staged(&self) -> &Path {
        match &self.target {
            Target::File { staged, .. } | Target::Directory { staged, .. } => staged,
        }
    }

    /// Whether it writes to the local file system.
    fn is_local(&self) -> bool {
        self.config.object_store_url.as_str() == "file:///"
    }
}

/// Move every staged file but the marker to the same place below `target`, then remove the
/// staging directory. Idempotent: a file already moved is skipped, so a recovery can finish
/// what a killed driver began.
async fn finish_commit(
    store: &Arc<dyn ObjectStore>,
    staged: &Path,
    target: &Path,
    local: bool,
) -> Result<()> {
    let files: Vec<_> = store.list(Some(staged)).try_collect().await?;
    for file in files {
        let Some(relative) = file.location.prefix_match(staged) else {
            continue;
        };
        let relative: Vec<_> = relative.collect();
        if relative.len() == 1 && relative[0].as_ref() == COMMIT_MARKER {
            continue;
        }
        let mut to = target.clone();
        for part in relative {
            to = to.join(part);
        }
        match store.rename(&file.location, &to).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    delete_staged(store, staged, local).await;
    Ok(())
}

/// Delete everything below `staged` (the marker last, so a half-deleted directory that was
/// committed still reads as committed), and the emptied directories of a local file system.
async fn delete_staged(store: &Arc<dyn ObjectStore>, staged: &Path, local: bool) {
    let marker = staged.clone().join(COMMIT_MARKER);
    if let Ok(files) = store.list(Some(staged)).try_collect::<Vec<_>>().await {
        for file in files.iter().filter(|f| f.location != marker) {
            let _ = store.delete(&file.location).await;
        }
    }
    let _ = store.delete(&marker).await;
    if local {
        let _ = std::fs::remove_dir_all(format!("/{staged}"));
    }
}

/// A failed or cancelled statement: delete what it staged (best effort; the error is what
/// matters) unless it had decided to commit, in which case the commit is finished.
async fn abort_staged(store: &Arc<dyn ObjectStore>, target: &Target, local: bool) {
    match target {
        Target::File { staged, .. } => {
            let _ = store.delete(staged).await;
        }
        Target::Directory { staged, target } => {
            let marker = staged.clone().join(COMMIT_MARKER);
            if store.head(&marker).await.is_ok() {
                let _ = finish_commit(store, staged, target, local).await;
            } else {
                delete_staged(store, staged, local).await;
            }
        }
    }
}

/// Whether the process that made staging id `id` ([`staging_id`]: host, pid, start time)
/// may still be writing it: one on this host while a process has its pid and start time;
/// one on another host, or of an id that does not say, for a day after the last write.
fn writer_may_be_alive(id: &str, modified: chrono::DateTime<chrono::Utc>) -> bool {
    let parts: Vec<&str> = id.split('-').collect();
    if let [host, pid, started, ..] = parts.as_slice()
        && *host == this_host()
        && let (Ok(pid), Ok(started)) = (
            u32::from_str_radix(pid, 16),
            u64::from_str_radix(started, 16),
        )
    {
        return process_start(pid) == Some(started);
    }
    chrono::Utc::now() - modified < chrono::Duration::days(1)
}

/// This host, as staging ids name it: a hash of its host name, in hex.
fn this_host() -> &'static str {
    static HOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        use std::hash::{Hash, Hasher};
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .or_else(|_| std::fs::read_to_string("/etc/hostname"))
            .unwrap_or_default();
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        name.trim().hash(&mut hasher);
        format!("{:x}", hasher.finish() & 0xffff_ffff)
    })
}

/// When process `pid` of this host started (clock ticks since boot, `/proc/PID/stat`'s
/// 22nd field); `None` when no such process runs.
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Whether local object-store path `path` is, or holds below it, a symbolic link.
fn holds_link(path: &Path) -> bool {
    fn walk(path: &std::path::Path) -> bool {
        let Ok(meta) = std::fs::symlink_metadata(path) else {
            return false;
        };
        if meta.file_type().is_symlink() {
            return true;
        }
        meta.is_dir()
            && std::fs::read_dir(path)
                .map(|entries| entries.flatten().any(|e| walk(&e.path())))
                .unwrap_or(false)
    }
    walk(std::path::Path::new(&format!("/{path}")))
}

/// Check that a local staging location takes new files, before anything is written there:
/// create its directory and a probe file, then remove the probe. The local object store
/// retries for ever when creating a file says "not found" in a directory that exists
/// (`/proc` does that), so without this check a `COPY` there would spin instead of failing.
fn probe_local_staging(target: &Target) -> std::io::Result<()> {
    let probe = match target {
        Target::File { staged, .. } => std::path::PathBuf::from(format!("/{staged}#probe")),
        Target::Directory { staged, .. } => std::path::PathBuf::from(format!("/{staged}/#probe")),
    };
    if let Some(dir) = probe.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", dir.display())))?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| {
            let dir = probe.parent().unwrap_or(&probe);
            std::io::Error::new(
                e.kind(),
                format!("{} takes no new file: {e}", dir.display()),
            )
        })?;
    std::fs::remove_file(&probe)
}

/// Flush local object-store path `path` (a file or a directory) to disk.
fn sync_path(path: &Path) -> Result<()> {
    let local = format!("/{path}");
    std::fs::File::open(&local)
        .and_then(|f| f.sync_all())
        .map_err(|e| DataFusionError::Execution(format!("flushing {local} to disk: {e}")))
}

/// Flush the directory holding local object-store path `path`.
fn sync_parent(path: &Path) -> Result<()> {
    let parts: Vec<_> = path.parts().collect();
    sync_path(&Path::from_iter(
        parts[..parts.len().saturating_sub(1)].iter().cloned(),
    ))
}

/// Flush every file and directory below local path `path`, and `path` itself.
fn sync_tree(path: &Path) -> Result<()> {
    sync_below(path, true)
}

/// Flush every directory below local path `path` (its files were flushed where they were
/// staged), and `path` itself.
fn sync_tree_dirs(path: &Path) -> Result<()> {
    sync_below(path, false)
}

fn sync_below(path: &Path, files: bool) -> Result<()> {
    fn walk(dir: &std::path::Path, files: bool) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)?.flatten() {
            let kind = entry.file_type()?;
            if kind.is_dir() {
                walk(&entry.path(), files)?;
            } else if files && kind.is_file() {
                std::fs::File::open(entry.path())?.sync_all()?;
            }
        }
        std::fs::File::open(dir)?.sync_all()
    }
    let local = format!("/{path}");
    walk(std::path::Path::new(&local), files)
        .map_err(|e| DataFusionError::Execution(format!("flushing {local} to disk: {e}")))
}

/// Recover what crashed statements left in the output location `target` (a directory, or
/// the directory of a single output file named `file_name`): finish every commit that was
/// decided (its marker written), delete every staging location whose writer is gone.
/// Returns how many commits were finished and how many staging locations deleted.
pub async fn recover_output(
    store: &Arc<dyn ObjectStore>,
    target: &Path,
    file_name: Option<&str>,
    local: bool,
) -> Result<(usize, usize)> {
    let (mut finished, mut deleted) = (0, 0);
    let listing = match store.list_with_delimiter(Some(target)).await {
        Ok(listing) => listing,
        Err(object_store::Error::NotFound { .. }) => return Ok((0, 0)),
        Err(e) => return Err(e.into()),
    };
    if let Some(name) = file_name {
        // Staged single files: `.NAME.flumen-staging-ID` beside the target.
        let prefix = format!(".{name}.flumen-staging-");
        for file in listing.objects {
            let Some(id) = file
                .location
                .filename()
                .and_then(|f| f.strip_prefix(&prefix))
            else {
                continue;
            };
            if !writer_may_be_alive(id, file.last_modified) {
                // A link is removed as a link: the local store's delete never follows one.
                let _ = store.delete(&file.location).await;
                deleted += 1;
            }
        }
        return Ok((finished, deleted));
    }
    for dir in listing.common_prefixes {
        let Some(id) = dir.filename().and_then(|f| f.strip_prefix(STAGING_PREFIX)) else {
            continue;
        };
        if local && holds_link(&dir) {
            log::warn!(
                "output {target}: staging directory {dir} is or holds a symbolic link; left \
                 as it is (recovery never follows links)"
            );
            continue;
        }
        let marker = dir.clone().join(COMMIT_MARKER);
        match store.head(&marker).await {
            Ok(_) => {
                finish_commit(store, &dir, target, local).await?;
                finished += 1;
            }
            Err(_) => {
                let newest = store
                    .list(Some(&dir))
                    .try_collect::<Vec<_>>()
                    .await
                    .ok()
                    .and_then(|files| files.iter().map(|f| f.last_modified).max())
                    .unwrap_or_else(chrono::Utc::now);
                if !writer_may_be_alive(id, newest) {
                    delete_staged(store, &dir, local).await;
                    deleted += 1;
                }
            }
        }
    }
    if finished + deleted > 0 {
        log::warn!(
            "recovered output {target}: finished {finished} interrupted commit(s), deleted \
             {deleted} abandoned staging location(s)"
        );
    }
    Ok((finished, deleted))
}

/// How much room the file system holding `path` (a local object-store path) has, said so
/// that a full disk reads as one: DataFusion's writers report a failed write, a full disk
/// included, as a bare "error finalizing writes". (Measured after the failure: the failed
/// file may already be gone, so "nearly full" counts.)
fn disk_space(path: &Path) -> Option<String> {
    let mut dir = std::path::PathBuf::from(format!("/{path}"));
    while !dir.exists() {
        dir = dir.parent()?.to_path_buf();
    }
    let c_path = std::ffi::CString::new(dir.to_str()?).ok()?;
    // SAFETY: statvfs fills the struct it is given from a NUL-terminated path.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stats) } != 0 {
        return None;
    }
    let free = stats.f_bavail as u64 * stats.f_frsize as u64;
    let total = stats.f_blocks as u64 * stats.f_frsize as u64;
    let full = if free < (1 << 20) || free * 100 < total * 5 {
        " (nearly full: No space left on device is the likely cause)"
    } else {
        ""
    };
    Some(format!(
        "the file system holding {} has {free} bytes free of {total}{full}",
        dir.display()
    ))
}

/// Aborts a statement's staging when its write is dropped before it ended (a cancelled
/// query), on the runtime it ran on.
struct AbortOnDrop {
    store: Arc<dyn ObjectStore>,
    target: Target,
    local: bool,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, target, local) = (Arc::clone(&self.store), self.target.clone(), self.local);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                abort_staged(&store, &target, local).await;
                // A file write in flight when the statement was dropped runs on a blocking
                // thread that cannot be cancelled, and may land after the first sweep.
                for wait_ms in [50, 250, 1000, 3000] {
                    tokio::time::sleep(std::time::Duration::from_millis(wait_ms)).await;
                    abort_staged(&store, &target, local).await;
                }
            });
        }
    }
}

impl DisplayAs for StagedSink {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        self.inner.fmt_as(t, f)
    }
}

#[async_trait]
impl DataSink for StagedSink {
    fn metrics(&self) -> Option<MetricsSet> {
        self.inner.metrics()
    }

    fn schema(&self) -> &SchemaRef {
        self.inner.schema()
    }

    async fn write_all(
        &self,
        data: SendableRecordBatchStream,
        context: &Arc<TaskContext>,
    ) -> Result<u64> {
        let store = context
            .runtime_env()
            .object_store(&self.config.object_store_url)?;
        let local = self.is_local();
        // What earlier statements left here when their driver was killed.
        match &self.target {
            Target::File { target, .. } => {
                let parts: Vec<_> = target.parts().collect();
                let parent =
                    Path::from_iter(parts[..parts.len().saturating_sub(1)].iter().cloned());
                recover_output(&store, &parent, target.filename(), local).await?;
            }
            Target::Directory { target, .. } => {
                recover_output(&store, target, None, local).await?;
            }
        }
        let mut guard = AbortOnDrop {
            store: Arc::clone(&store),
            target: self.target.clone(),
            local,
            armed: true,
        };
        let probed = match local {
            true => probe_local_staging(&self.target),
            false => Ok(()),
        };
        if let Err(e) = probed {
            abort_staged(&store, &self.target, local).await;
            guard.armed = false;
            return Err(DataFusionError::Execution(format!(
                "cannot write the output to {}: {e}",
                self.config.original_url
            )));
        }
        let fsync = (context.session_config().options().extensions)
            .get::<crate::FlumenConfig>()
            .is_none_or(|config| config.output_fsync);
        let result = match self.inner.write_all(data, context).await {
            Ok(rows) => match self.commit(&store, local, fsync).await {
                Ok(()) => Ok(rows),
                Err(e) => {
                    abort_staged(&store, &self.target, local).await;
                    Err(DataFusionError::Execution(format!(
                        "committing the output to {}: {e}",
                        self.config.original_url
                    )))
                }
            },
            Err(e) => {
                // Before the abort frees what was staged.
                let staged = self.staged();
                // Only where DataFusion lost the cause (its writers' own errors are dropped
                // when a file fails to finish: a full disk reads as "finalizing writes").
                let lost_cause = e.to_string().contains("finalizing writes");
                let space = (local && lost_cause).then(|| disk_space(staged)).flatten();
                abort_staged(&store, &self.target, local).await;
                match space {
                    Some(space) => Err(DataFusionError::Execution(format!(
                        "writing the output to {} failed; {space}: {e}",
                        self.config.original_url
                    ))),
                    None => Err(e),
                }
            }
        };
        guard.armed = false;
        result
    }
}

/// A name no other statement uses, naming its writer: `HOST-PID-START-NANOS-N` (this
/// host's hash, the process id and start time, hex; the time now; a counter).
fn staging_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let pid = std::process::id();
    format!(
        "{}-{pid:x}-{:x}-{nanos:x}-{}",
        this_host(),
        process_start(pid).unwrap_or_default(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// `config` writing below a staging location instead, and where the files go at commit.
fn staged_config(config: &FileSinkConfig) -> Result<Option<(FileSinkConfig, Target)>> {
    let [base] = config.table_paths.as_slice() else {
        return Ok(None);
    };
    let single =
        config.table_partition_cols.is_empty() && config.file_output_mode.single_file_output(base);
    let target = base.prefix().clone();
    let id = staging_id();
    let (url, target, mode) = if single {
        let parts: Vec<_> = target.parts().collect();
        let Some((name, parent)) = parts.split_last() else {
            return Ok(None);
        };
        let staged = Path::from_iter(parent.iter().cloned())
            .join(format!(".{}.flumen-staging-{id}", name.as_ref()));
        let url = format!("{}{staged}", config.object_store_url.as_str());
        (
            url,
            Target::File { staged, target },
            FileOutputMode::SingleFile,
        )
    } else {
        let staged = target.clone().join(format!("{STAGING_PREFIX}{id}"));
        let url = format!("{}{staged}/", config.object_store_url.as_str());
        (
            url,
            Target::Directory { staged, target },
            FileOutputMode::Directory,
        )
    };
    let mut staged_config = config.clone();
    staged_config.table_paths = vec![ListingTableUrl::parse(&url)?];
    staged_config.file_output_mode = mode;
    Ok(Some((staged_config, target)))
}

/// The Parquet `sorting_columns` DataFusion records for a sink whose input is sorted by
/// `order` (simple columns only, as positions in the written schema), so files written
/// through staging keep the ordering readers infer from them.
fn sorting_columns(
    order: &Option<LexRequirement>,
    config: &FileSinkConfig,
) -> Option<Vec<SortingColumn>> {
    let order = order.as_ref()?;
    let partition_cols: Vec<&str> = if config.keep_partition_by_columns {
        vec![]
    } else {
        config
            .table_partition_cols
            .iter()
            .map(|(name, _)| name.as_str())
            .collect()
    };
    let written: Vec<&str> = config
        .output_schema
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .filter(|name| !partition_cols.contains(name))
        .collect();
    let mut columns = vec![];
    for requirement in order.iter() {
        let column = requirement.expr.downcast_ref::<Column>()?;
        let Some(at) = written.iter().position(|name| *name == column.name()) else {
            continue;
        };
        let options = requirement.options.unwrap_or_default();
        columns.push(SortingColumn {
            column_idx: at as i32,
            descending: options.descending,
            nulls_first: options.nulls_first,
        });
    }
    (!columns.is_empty()).then_some(columns)
}

/// Rebuild a Parquet, CSV or JSON sink to write through a staging location; `None` for
/// other sinks (they write as they always did).
fn stage_sink(
    sink: &dyn DataSink,
    order: &Option<LexRequirement>,
) -> Result<Option<Arc<dyn DataSink>>> {
    let any = sink as &dyn Any;
    let (parquet, csv, json) = (
        any.downcast_ref::<ParquetSink>(),
        any.downcast_ref::<CsvSink>(),
        any.downcast_ref::<JsonSink>(),
    );
    let config = match (parquet, csv, json) {
        (Some(s), _, _) => s.config(),
        (_, Some(s), _) => s.config(),
        (_, _, Some(s)) => s.config(),
        _ => return Ok(None),
    };
    let Some((staged, target)) = staged_config(config)? else {
        return Ok(None);
    };
    let inner: Arc<dyn DataSink> = match (parquet, csv, json) {
        (Some(s), _, _) => Arc::new(
            ParquetSink::new(staged, s.parquet_options().clone())
                .with_sorting_columns(sorting_columns(order, config)),
        ),
        (_, Some(s), _) => Arc::new(CsvSink::new(staged, s.writer_options().clone())),
        (_, _, Some(s)) => Arc::new(JsonSink::new(staged, s.writer_options().clone())),
        _ => return Ok(None),
    };
    Ok(Some(Arc::new(StagedSink {
        inner,
        config: config.clone(),
        target,
    })))
}

/// Make every file sink in `plan` write through a staging location and commit once.
pub fn stage_file_sinks(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    plan.transform_up(|node| {
        let Some(exec) = node.downcast_ref::<DataSinkExec>() else {
            return Ok(Transformed::no(node));
        };
        if (exec.sink() as &dyn Any).is::<StagedSink>() {
            return Ok(Transformed::no(node));
        }
        match stage_sink(exec.sink(), exec.sort_order())? {
            Some(sink) => Ok(Transformed::yes(Arc::new(DataSinkExec::new(
                Arc::clone(exec.input()),
                sink,
                exec.sort_order().clone(),
            )) as Arc<dyn ExecutionPlan>)),
            None => Ok(Transformed::no(node)),
        }
    })
    .map(|t| t.data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::Schema;
    use datafusion::datasource::physical_plan::FileGroup;
    use datafusion::execution::object_store::ObjectStoreUrl;
    use datafusion::logical_expr::dml::InsertOp;

    fn config(url: &str, partitioned: bool) -> FileSinkConfig {
        FileSinkConfig {
            original_url: url.into(),
            object_store_url: ObjectStoreUrl::local_filesystem(),
            file_group: FileGroup::new(vec![]),
            table_paths: vec![ListingTableUrl::parse(url).unwrap()],
            output_schema: Arc::new(Schema::empty()),
            table_partition_cols: if partitioned {
                vec![("k".into(), datafusion::arrow::datatypes::DataType::Int64)]
            } else {
                vec![]
            },
            insert_op: InsertOp::Append,
            keep_partition_by_columns: false,
            file_extension: "parquet".into(),
            file_output_mode: Default::default(),
        }
    }

    #[test]
    fn a_single_file_is_staged_beside_it_and_a_directory_below_it() {
        let (staged, target) = staged_config(&config("/tmp/x/out.parquet", false))
            .unwrap()
            .unwrap();
        let Target::File {
            staged: file,
            target: to,
        } = target
        else {
            panic!("not a single file");
        };
        assert_eq!(to.as_ref(), "tmp/x/out.parquet");
        assert!(
            file.as_ref()
                .starts_with("tmp/x/.out.parquet.flumen-staging-"),
            "{file}"
        );
        assert_eq!(staged.table_paths[0].prefix(), &file);
        for partitioned in [false, true] {
            let (staged, target) = staged_config(&config("/tmp/x/dir/", partitioned))
                .unwrap()
                .unwrap();
            let Target::Directory {
                staged: dir,
                target: to,
            } = target
            else {
                panic!("not a directory");
            };
            assert_eq!(to.as_ref(), "tmp/x/dir");
            assert!(
                dir.as_ref().starts_with("tmp/x/dir/.flumen-staging-"),
                "{dir}"
            );
            assert!(staged.table_paths[0].is_collection());
        }
    }

    #[test]
    fn a_staging_id_names_its_writer_by_host_pid_and_start_time() {
        let now = chrono::Utc::now();
        let ours = staging_id();
        assert!(writer_may_be_alive(&ours, now), "{ours}");
        // This host, this pid, another start time: a reused pid is not the writer.
        let parts: Vec<&str> = ours.split('-').collect();
        let reused = format!(
            "{}-{}-{:x}-0-0",
            parts[0],
            parts[1],
            process_start(std::process::id()).unwrap() + 1
        );
        assert!(!writer_may_be_alive(&reused, now));
        // Another host: judged by age alone.
        let elsewhere = format!("ffffffffff-{}-{}-0-0", parts[1], parts[2]);
        assert!(writer_may_be_alive(&elsewhere, now));
        assert!(!writer_may_be_alive(
            &elsewhere,
            now - chrono::Duration::days(2)
        ));
    }
}
