//! Spill runs: the files a query run's blocks are written to beyond its memory budget.
//!
//! Each [`SpillGroup`] (a producer's output for one consumer partition) appends its
//! written-out blocks to one open file until it holds the store's run cap, the blocks
//! written together in one write, so a reduce task reads its partition from a few large
//! files rather than one small file per map output (Exoshuffle's merge of pushed map
//! outputs). Each block is an Arrow IPC stream of its own at a known offset, so blocks of
//! one run need not share a schema. A run's file is deleted when its last block lets go of
//! it; a file deleted under the query reads as a lost block, which lineage recomputes.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use datafusion::arrow::ipc::reader::StreamReader;
use datafusion::arrow::ipc::writer::StreamWriter;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};

use crate::store::block::BlockId;
use crate::store::memory_counters::MemoryCounters;
use crate::store::owned_dir::OwnedDir;

/// Blocks spilled together: a producer operator's output for one consumer partition
/// `(operator, partition)`, which one reader reads together.
pub type SpillGroup = (usize, usize);

/// One spill file and the blocks in it; the file is deleted when the last block that
/// shares this handle leaves the store (and no reader or writer still holds it).
#[derive(Debug)]
pub(crate) struct SpillRun {
    path: PathBuf,
}

/// A group's run still open for appending.
struct OpenRun {
    run: Arc<SpillRun>,
    file: File,
    /// Bytes written to it.
    len: u64,
}

/// Each spilled block's `(offset, len)` in its run file.
pub(crate) type Spans = Vec<(u64, u64)>;

/// Where one group appends its spilled blocks (`None`: no run open).
type RunSlot = Arc<Mutex<Option<OpenRun>>>;

impl Drop for SpillRun {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A writer that counts the bytes through it.
struct Counting<W> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Append `batches` to `open`'s file, each as an Arrow IPC stream of its own, streamed
/// through a buffer (a run may be a large part of the budget: no copy of it is held);
/// returns each one's offset and length in the file.
fn append(
    open: &mut OpenRun,
    batches: &[(BlockId, RecordBatch)],
) -> std::result::Result<Spans, String> {
    // A buffer the size of what is written, up to 1 MiB: a worker spills one small block
    // at a time.
    let bytes: usize = batches.iter().map(|(_, b)| b.get_array_memory_size()).sum();
    let mut out = Counting {
        inner: BufWriter::with_capacity((bytes + 4096).min(1 << 20), &mut open.file),
        written: 0,
    };
    let mut spans = vec![];
    for (_, batch) in batches {
        let start = out.written;
        let mut writer =
            StreamWriter::try_new(&mut out, batch.schema_ref()).map_err(|e| e.to_string())?;
        writer.write(batch).map_err(|e| e.to_string())?;
        writer.finish().map_err(|e| e.to_string())?;
        drop(writer);
        spans.push((open.len + start, out.written - start));
    }
    out.flush().map_err(|e| e.to_string())?;
    let written = out.written;
    drop(out);
    open.len += written;
    Ok(spans)
}

/// Times a spill is tried before its error reaches the query.
const SPILL_ATTEMPTS: u32 = 20;

/// Subdirectories spill files are spread over: one directory of tens of thousands of
/// short-lived files serializes every create and delete on its lock.
const SPILL_SUBDIRS: u64 = 64;

/// The spill files of one query run, in a directory of their own made at the first spill
/// (removed with it), and the run each group appends to now.
#[derive(Debug)]
pub(crate) struct SpillRuns {
    /// Where the directory is made (`flumen.spill_dir`); `None`: the temp directory.
    root: Option<PathBuf>,
    /// What the directory's name starts with ([`OwnedDir`] sweeps those of ended owners).
    prefix: &'static str,
    /// Made at the first spill; removed with this value, or after a crash by the next
    /// process that makes one beside it ([`OwnedDir`]). A failed making is not kept: the
    /// next spill tries again (the directory may have been deleted while it was made).
    dir: Mutex<Option<OwnedDir>>,
    /// Each group's open run.
    open: Mutex<HashMap<SpillGroup, RunSlot>>,
    /// Numbers the files.
    next: AtomicU64,
    /// Bytes written to spill files so far.
    written: AtomicU64,
}

impl std::fmt::Debug for OpenRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenRun")
            .field("path", &self.run.path)
            .field("len", &self.len)
            .finish()
    }
}

/// What a run's spill directory's name starts with.
const SPILL_DIR_PREFIX: &str = "flumen-spill-";

impl Default for SpillRuns {
    /// No file yet; the directory, named `flumen-spill-…`, is made in the temp directory.
    fn default() -> Self {
        Self::with_prefix(None, SPILL_DIR_PREFIX)
    }
}

impl SpillRuns {
    /// No file yet; the directory is made under `root` (else the system's temp directory).
    pub(crate) fn new(root: Option<PathBuf>) -> Self {
        Self::with_prefix(root, SPILL_DIR_PREFIX)
    }

    /// As [`Self::new`], the directory's name starting with `prefix`.
    pub(crate) fn with_prefix(root: Option<PathBuf>, prefix: &'static str) -> Self {
        Self {
            root,
            prefix,
            dir: Mutex::default(),
            open: Mutex::default(),
            next: AtomicU64::new(0),
            written: AtomicU64::new(0),
        }
    }

    /// Bytes written to spill files so far.
    pub(crate) fn written_bytes(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Append `batches` to `group`'s open run in one write (a new run when there is none,
    /// it holds `cap` bytes already, or its file was deleted under the query); returns the
    /// run and each batch's `(offset, len)` in it. New files count in `counters`.
    pub(crate) fn append(
        &self,
        group: SpillGroup,
        batches: &[(BlockId, RecordBatch)],
        cap: u64,
        counters: Option<&MemoryCounters>,
    ) -> Result<(Arc<SpillRun>, Spans)> {
        let slot = Arc::clone(self.open.lock().unwrap().entry(group).or_default());
        let mut slot = slot.lock().unwrap();
        if slot
            .as_ref()
            .is_some_and(|open| open.len >= cap || !open.run.path.exists())
        {
            *slot = None;
        }
        // Someone may have deleted the directory under a running query (before the file was
        // made): make it again (a deletion in progress, which takes longer with the
        // subdirectories, races with the creation), for up to about 100 ms. A failed write
        // abandons its run (its end may hold part of this one); the next try opens another.
        let mut attempts = 0;
        loop {
            attempts += 1;
            let appended = match slot.take() {
                Some(open) => Ok(open),
                None => self.open_run(counters),
            }
            .and_then(|mut open| Ok((append(&mut open, batches)?, open)));
            match appended {
                Ok((spans, open)) => {
                    let bytes: u64 = spans.iter().map(|&(_, len)| len).sum();
                    self.written.fetch_add(bytes, Ordering::Relaxed);
                    let run = Arc::clone(&open.run);
                    *slot = Some(open);
                    return Ok((run, spans));
                }
                Err(e) if attempts >= SPILL_ATTEMPTS => {
                    return Err(DataFusionError::Execution(format!(
                        "cannot spill {} block(s) (first {}) of partition {} of operator {}: {e}",
                        batches.len(),
                        batches[0].0,
                        group.1,
                        group.0
                    )));
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
            }
        }
    }

    /// The spill directory's path, made now if no spill made it yet.
    fn dir_path(&self) -> std::result::Result<PathBuf, String> {
        let mut dir = self.dir.lock().unwrap();
        if dir.is_none() {
            let made = OwnedDir::create(self.root.as_deref(), self.prefix)
                .map_err(|e| format!("cannot create flumen spill directory: {e}"))?;
            *dir = Some(made);
        }
        Ok(dir.as_ref().expect("made above").path().to_path_buf())
    }

    /// A new, empty run file (counted in `counters`).
    fn open_run(&self, counters: Option<&MemoryCounters>) -> std::result::Result<OpenRun, String> {
        let dir = self.dir_path()?;
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        let subdir = dir.join(format!("{:02x}", number % SPILL_SUBDIRS));
        let path = subdir.join(format!("run-{number}.arrow"));
        let file = std::fs::create_dir_all(&subdir)
            .and_then(|()| File::create(&path))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if let Some(counters) = counters {
            counters.spill_files.fetch_add(1, Ordering::Relaxed);
        }
        Ok(OpenRun {
            run: Arc::new(SpillRun { path }),
            file,
            len: 0,
        })
    }

    /// Close `group`'s open run if it is `run` (its blocks are all gone), unless a spill is
    /// writing to it now.
    pub(crate) fn close_if_open(&self, group: SpillGroup, run: &Arc<SpillRun>) {
        let Some(slot) = self.open.lock().unwrap().get(&group).cloned() else {
            return;
        };
        if let Ok(mut slot) = slot.try_lock()
            && slot
                .as_ref()
                .is_some_and(|open| Arc::ptr_eq(&open.run, run))
        {
            *slot = None;
        }
    }

    /// Close `group`'s open run, if any (nothing more will be appended to it): its file
    /// goes with the last of its blocks.
    pub(crate) fn close_open(&self, group: SpillGroup) {
        if let Some(slot) = self.open.lock().unwrap().remove(&group) {
            *slot.lock().unwrap() = None;
        }
    }

    /// The directory, once a spill made it.
    #[cfg(test)]
    pub(crate) fn dir(&self) -> Option<PathBuf> {
        self.dir
            .lock()
            .unwrap()
            .as_ref()
            .map(|dir| dir.path().to_path_buf())
    }
}

impl SpillRun {
    /// Block `id`, the `len` bytes at `offset` of this run's file; `None` when the file is
    /// gone (deleted under the query: the block is lost and recomputed).
    pub(crate) fn read(&self, id: BlockId, offset: u64, len: u64) -> Result<Option<RecordBatch>> {
        let path = &self.path;
        let mut file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                log::warn!(
                    "spill file {} of block {id} is gone; the block is recomputed",
                    path.display()
                );
                return Ok(None);
            }
            Err(e) => {
                return Err(DataFusionError::Execution(format!(
                    "cannot read spill file {} of block {id}: {e}",
                    path.display()
                )));
            }
        };
        let damaged = |e: &dyn std::fmt::Display| {
            DataFusionError::Execution(format!(
                "spill file {} of block {id} is damaged: {e}",
                path.display()
            ))
        };
        file.seek(SeekFrom::Start(offset))
            .map_err(|e| damaged(&e))?;
        let stream = BufReader::new(file.take(len));
        let mut reader = StreamReader::try_new(stream, None).map_err(|e| damaged(&e))?;
        match reader.next() {
            Some(batch) => Ok(Some(batch.map_err(|e| damaged(&e))?)),
            None => Err(damaged(&format!("no batch at offset {offset}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_directory_is_named_by_its_prefix() {
        let root = tempfile::tempdir().unwrap();
        for (runs, prefix) in [
            (SpillRuns::new(Some(root.path().into())), "flumen-spill-"),
            (
                SpillRuns::with_prefix(Some(root.path().into()), "flumen-worker-blocks-"),
                "flumen-worker-blocks-",
            ),
        ] {
            let batch = RecordBatch::try_from_iter([(
                "x",
                Arc::new(datafusion::arrow::array::Int32Array::from(vec![1])) as _,
            )])
            .unwrap();
            runs.append((0, 0), &[(0, batch)], 1 << 20, None).unwrap();
            let name = runs.dir().unwrap().file_name().unwrap().to_owned();
            assert!(name.to_str().unwrap().starts_with(prefix), "{name:?}");
        }
        assert_eq!(SpillRuns::default().prefix, "flumen-spill-");
    }
    use datafusion::arrow::array::Int64Array;

    fn one_column(n: i64) -> RecordBatch {
        RecordBatch::try_from_iter([(
            "v",
            Arc::new(Int64Array::from_iter_values(0..n)) as datafusion::arrow::array::ArrayRef,
        )])
        .unwrap()
    }

    /// A spill directory that could not be made (its parent was in the way, as when a
    /// cleaner deletes it while it is made) is made by the next spill: the failure is not
    /// kept for the rest of the query.
    #[test]
    fn a_failed_making_of_the_spill_directory_is_tried_again() {
        let parent = tempfile::tempdir().unwrap();
        let root = parent.path().join("spill");
        std::fs::write(&root, b"not a directory").unwrap();
        let runs = SpillRuns::new(Some(root.clone()));
        let blocks = [(1, one_column(10))];
        let err = runs.append((0, 0), &blocks, 1 << 20, None).unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot create flumen spill directory"),
            "{err}"
        );
        assert!(runs.dir().is_none());

        std::fs::remove_file(&root).unwrap();
        let (run, spans) = runs.append((0, 0), &blocks, 1 << 20, None).unwrap();
        let (offset, len) = spans[0];
        let back = run.read(1, offset, len).unwrap().unwrap();
        assert_eq!(back, blocks[0].1);
        assert!(runs.dir().unwrap().starts_with(&root));
    }
}
