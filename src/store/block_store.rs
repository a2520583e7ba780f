//! The block store: the one place that knows where each block lives: in memory under the
//! memory budget, spilled to Arrow IPC files in a temp dir beyond it, or kept by the
//! worker process that made it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use datafusion::arrow::ipc::reader::FileReader;
use datafusion::arrow::ipc::writer::FileWriter;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use tempfile::TempDir;

use crate::config::ByteSize;
use crate::store::block::{BlockId, HeldBlock};

/// Bytes a block's rows take: only the slice of each buffer the rows reach, and for string
/// and binary views only the values they point at (a slice or a `take` of a view array
/// shares its parent's buffers, which `get_array_memory_size` would count whole).
pub fn block_bytes(batch: &RecordBatch) -> u64 {
    use datafusion::arrow::array::{Array, AsArray};
    use datafusion::arrow::datatypes::DataType;
    let mut total = 0u64;
    for column in batch.columns() {
        let views = match column.data_type() {
            DataType::Utf8View => Some(column.as_string_view().views().clone()),
            DataType::BinaryView => Some(column.as_binary_view().views().clone()),
            _ => None,
        };
        total += match views {
            Some(views) => {
                let long: u64 = views
                    .iter()
                    .map(|v| *v as u32)
                    .filter(|len| *len > 12)
                    .map(u64::from)
                    .sum();
                views.len() as u64 * 16 + long + column.len().div_ceil(8) as u64
            }
            None => column
                .to_data()
                .get_slice_memory_size()
                .unwrap_or_else(|_| column.get_array_memory_size()) as u64,
        };
    }
    total.max(1)
}

enum Stored {
    Memory(RecordBatch),
    Spilled(PathBuf),
    Held(Arc<dyn HeldBlock>),
}

struct Entry {
    data: Stored,
    bytes: u64,
}

/// Write `batch` to `path` in `dir` (made if missing). A reader is only given the path once
/// this returned, and `make_room` never writes one block twice at once (`Inner.evicting`), so
/// no rename step is needed (one cost 14% of a spilling sort's time in directory locks).
fn write_whole(
    dir: &std::path::Path,
    path: &std::path::Path,
    batch: &RecordBatch,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)?;
    let mut writer = FileWriter::try_new(BufWriter::new(File::create(path)?), batch.schema_ref())?;
    writer.write(batch)?;
    writer.finish()?;
    Ok(())
}

/// Times a spill is tried before its error reaches the query.
const SPILL_ATTEMPTS: u32 = 20;

/// Subdirectories spill files are spread over: one directory of tens of thousands of
/// short-lived files serializes every create and delete on its lock.
const SPILL_SUBDIRS: u64 = 64;

#[derive(Default)]
struct Inner {
    blocks: HashMap<BlockId, Entry>,
    memory_bytes: u64,
    /// Blocks `make_room` is writing out now: no other call picks them too.
    evicting: std::collections::HashSet<BlockId>,
}

/// Blocks of one query run, with a memory budget.
pub struct BlockStore {
    budget: u64,
    /// Bytes the run's operators hold (their state shares the budget:
    /// [`crate::store::operator_memory::OperatorMemory`]).
    operator_bytes: AtomicU64,
    /// Where the spill directory is made (`flumen.spill_dir`); `None`: the temp directory.
    spill_root: Option<PathBuf>,
    spill_dir: OnceLock<std::io::Result<TempDir>>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for BlockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStore")
            .field("budget", &self.budget)
            .field("memory_bytes", &self.memory_bytes())
            .field("operator_bytes", &self.operator_bytes())
            .finish()
    }
}

/// Where a block went when it was stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Kept in memory.
    Memory,
    /// Written to a spill file.
    Spilled,
}

impl BlockStore {
    /// An empty store holding at most `budget` bytes in memory.
    pub fn new(budget: u64) -> Self {
        Self {
            budget,
            operator_bytes: AtomicU64::new(0),
            spill_root: None,
            spill_dir: OnceLock::new(),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Put spill files in a directory made under `root` (else the system's temp directory).
    pub fn with_spill_root(mut self, root: Option<PathBuf>) -> Self {
        self.spill_root = root;
        self
    }

    /// The memory budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of blocks held in memory now.
    pub fn memory_bytes(&self) -> u64 {
        self.inner.lock().unwrap().memory_bytes
    }

    /// Bytes the run's operators hold now (they count against the same budget).
    pub fn operator_bytes(&self) -> u64 {
        self.operator_bytes.load(Ordering::Relaxed)
    }

    /// Record what the run's operators hold now.
    pub fn set_operator_bytes(&self, bytes: u64) {
        self.operator_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Write blocks from memory to spill files (the newest first: readers take the oldest
    /// first) until blocks and operator state together fit the budget again. Returns the
    /// blocks and bytes written out.
    pub fn make_room(&self) -> Result<(u64, u64)> {
        let mut written = (0, 0);
        loop {
            let victim = {
                let mut inner = self.inner.lock().unwrap();
                if inner.memory_bytes + self.operator_bytes() <= self.budget {
                    return Ok(written);
                }
                let victim = inner
                    .blocks
                    .iter()
                    .filter(|(id, _)| !inner.evicting.contains(id))
                    .filter_map(|(id, e)| match &e.data {
                        Stored::Memory(batch) => Some((*id, batch.clone())),
                        _ => None,
                    })
                    .max_by_key(|(id, _)| *id);
                if let Some((id, _)) = &victim {
                    inner.evicting.insert(*id);
                }
                victim
            };
            let Some((id, batch)) = victim else {
                return Ok(written);
            };
            let spilled = self.spill(id, &batch);
            let mut inner = self.inner.lock().unwrap();
            inner.evicting.remove(&id);
            let path = spilled?;
            let entry = match inner.blocks.get_mut(&id) {
                Some(entry) if matches!(entry.data, Stored::Memory(_)) => entry,
                // Released (or replaced) while it was written.
                _ => {
                    let _ = std::fs::remove_file(path);
                    continue;
                }
            };
            entry.data = Stored::Spilled(path);
            let bytes = entry.bytes;
            inner.memory_bytes -= bytes;
            written.0 += 1;
            written.1 += bytes;
        }
    }

    /// Store a block of `bytes` bytes; spills it when memory would exceed the budget.
    /// A block larger than the whole budget is an error naming `flumen.memory_budget`.
    pub fn put(&self, id: BlockId, batch: RecordBatch, bytes: u64) -> Result<Placement> {
        if bytes > self.budget {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "a block of {} rows needs {}, more than flumen.memory_budget ({}); \
                 raise flumen.memory_budget or lower flumen.target_block_rows",
                batch.num_rows(),
                ByteSize(bytes),
                ByteSize(self.budget)
            )));
        }
        {
            let mut inner = self.inner.lock().unwrap();
            if inner.memory_bytes + self.operator_bytes() + bytes <= self.budget {
                inner.memory_bytes += bytes;
                inner.blocks.insert(
                    id,
                    Entry {
                        data: Stored::Memory(batch),
                        bytes,
                    },
                );
                return Ok(Placement::Memory);
            }
        }
        let path = self.spill(id, &batch)?;
        let mut inner = self.inner.lock().unwrap();
        inner.blocks.insert(
            id,
            Entry {
                data: Stored::Spilled(path),
                bytes,
            },
        );
        Ok(Placement::Spilled)
    }

    fn spill(&self, id: BlockId, batch: &RecordBatch) -> Result<PathBuf> {
        let dir = self.spill_dir.get_or_init(|| {
            let builder = tempfile::Builder::new().prefix("flumen-spill-").clone();
            match &self.spill_root {
                Some(root) => std::fs::create_dir_all(root).and_then(|()| builder.tempdir_in(root)),
                None => builder.tempdir(),
            }
        });
        let dir = dir.as_ref().map_err(|e| {
            DataFusionError::Execution(format!("cannot create flumen spill directory: {e}"))
        })?;
        let subdir = dir.path().join(format!("{:02x}", id % SPILL_SUBDIRS));
        let path = subdir.join(format!("block-{id}.arrow"));
        let spill_error = |e: &dyn std::fmt::Display| {
            DataFusionError::Execution(format!(
                "cannot spill block {id} to {}: {e}",
                path.display()
            ))
        };
        // Someone may have deleted the directory under a running query (before the file was
        // made): write it again (a deletion in progress, which takes longer with the
        // subdirectories, races with the creation), for up to about 100 ms.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match write_whole(&subdir, &path, batch) {
                Ok(()) => break,
                Err(_) if attempts < SPILL_ATTEMPTS => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                Err(e) => return Err(spill_error(&e)),
            }
        }
        Ok(path)
    }

    /// Record that a worker process keeps block `id` (its bytes are the worker's memory,
    /// not the budget's).
    pub fn put_held(&self, id: BlockId, held: Arc<dyn HeldBlock>, bytes: u64) {
        let entry = Entry {
            data: Stored::Held(held),
            bytes,
        };
        self.inner.lock().unwrap().blocks.insert(id, entry);
    }

    /// Whether block `id` can be read without recomputing it: stored here, or held by a
    /// worker believed alive.
    pub fn is_available(&self, id: BlockId) -> bool {
        let inner = self.inner.lock().unwrap();
        match inner.blocks.get(&id).map(|e| &e.data) {
            None => false,
            Some(Stored::Held(held)) => held.holder_alive(),
            Some(_) => true,
        }
    }

    /// Take the handle of block `id` when a worker holds it (reading it from the worker
    /// consumes it there).
    pub fn take_held(&self, id: BlockId) -> Option<Arc<dyn HeldBlock>> {
        let mut inner = self.inner.lock().unwrap();
        if !matches!(
            inner.blocks.get(&id).map(|e| &e.data),
            Some(Stored::Held(_))
        ) {
            return None;
        }
        match inner.blocks.remove(&id).map(|e| e.data) {
            Some(Stored::Held(held)) => Some(held),
            _ => None,
        }
    }

    /// The handle of block `id` when a worker holds it, left in the store (a worker will
    /// fetch it directly; see [`Self::remove_held`]).
    pub fn peek_held(&self, id: BlockId) -> Option<Arc<dyn HeldBlock>> {
        match self.inner.lock().unwrap().blocks.get(&id).map(|e| &e.data) {
            Some(Stored::Held(held)) => Some(Arc::clone(held)),
            _ => None,
        }
    }

    /// Forget block `id` if `held` (from [`Self::peek_held`]) is still its handle; `false`
    /// when the block was meanwhile lost or re-homed.
    pub fn remove_held(&self, id: BlockId, held: &Arc<dyn HeldBlock>) -> bool {
        let mut inner = self.inner.lock().unwrap();
        let same = matches!(
            inner.blocks.get(&id).map(|e| &e.data),
            Some(Stored::Held(h)) if Arc::ptr_eq(h, held)
        );
        if same {
            inner.blocks.remove(&id);
        }
        same
    }

    /// Forget every block that the worker numbered `holder` ([`HeldBlock::holder_id`]) held
    /// (it died), returning their ids.
    pub fn take_held_by(&self, holder: u64) -> Vec<BlockId> {
        let mut inner = self.inner.lock().unwrap();
        let ids: Vec<BlockId> = inner
            .blocks
            .iter()
            .filter(|(_, e)| matches!(&e.data, Stored::Held(h) if h.holder_id() == holder))
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            inner.blocks.remove(id);
        }
        ids
    }

    /// The data of a block stored here (in memory or spilled), or `None` when it is not
    /// (released, lost, or held by a worker: see [`Self::take_held`]).
    pub fn get(&self, id: BlockId) -> Result<Option<RecordBatch>> {
        let path = {
            let inner = self.inner.lock().unwrap();
            match inner.blocks.get(&id).map(|e| &e.data) {
                None | Some(Stored::Held(_)) => return Ok(None),
                Some(Stored::Memory(b)) => return Ok(Some(b.clone())),
                Some(Stored::Spilled(p)) => p.clone(),
            }
        };
        let file = match File::open(&path) {
            Ok(file) => file,
            // A spill file deleted under the query is a lost block: lineage recomputes it.
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
        let reader = FileReader::try_new(BufReader::new(file), None).map_err(|e| {
            DataFusionError::Execution(format!(
                "spill file {} of block {id} is damaged: {e}",
                path.display()
            ))
        })?;
        let mut batches = reader.collect::<std::result::Result<Vec<_>, _>>()?;
        match batches.len() {
            1 => Ok(batches.pop()),
            n => Err(DataFusionError::Internal(format!(
                "spill file of block {id} holds {n} batches"
            ))),
        }
    }

    /// Remove a block (its readers are done with it, or it is replaced by a recomputed
    /// copy); a worker holding it is told to drop it. Returns its bytes.
    pub fn remove(&self, id: BlockId) -> u64 {
        let mut inner = self.inner.lock().unwrap();
        match inner.blocks.remove(&id) {
            None => 0,
            Some(entry) => {
                match entry.data {
                    Stored::Memory(_) => inner.memory_bytes -= entry.bytes,
                    Stored::Spilled(path) => {
                        let _ = std::fs::remove_file(path);
                    }
                    Stored::Held(held) => held.release(),
                }
                entry.bytes
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use std::sync::Arc;

    /// A batch of `n` rows of one Int64 column (tests of the store and its users).
    pub(crate) fn batch(n: i64) -> RecordBatch {
        RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from_iter_values(0..n)) as _)])
            .unwrap()
    }

    #[test]
    fn spills_beyond_budget_and_reads_back() {
        let store = BlockStore::new(1000);
        assert_eq!(store.put(1, batch(10), 600).unwrap(), Placement::Memory);
        assert_eq!(store.put(2, batch(20), 600).unwrap(), Placement::Spilled);
        assert_eq!(store.memory_bytes(), 600);
        assert_eq!(store.get(2).unwrap().unwrap(), batch(20));
        assert_eq!(store.remove(1), 600);
        assert_eq!(store.memory_bytes(), 0);
        assert!(store.get(1).unwrap().is_none());
    }

    /// Several threads making room at once never write the same block twice (two writers
    /// of one spill file left it damaged or deleted): every block reads back whole.
    #[test]
    fn concurrent_evictions_leave_every_block_readable() {
        let store = Arc::new(BlockStore::new(1 << 20));
        for id in 0..200 {
            store.put(id, batch(1000 + id as i64), 4000).unwrap();
        }
        store.set_operator_bytes(1 << 20);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || store.make_room().unwrap())
            })
            .collect();
        let evicted: u64 = threads.into_iter().map(|t| t.join().unwrap().0).sum();
        assert_eq!(evicted, 200);
        assert_eq!(store.memory_bytes(), 0);
        for id in 0..200 {
            assert_eq!(store.get(id).unwrap().unwrap(), batch(1000 + id as i64));
        }
    }

    #[test]
    fn a_block_larger_than_the_budget_is_an_error() {
        let store = BlockStore::new(100);
        let err = store.put(1, batch(10), 200).unwrap_err().to_string();
        assert!(err.contains("flumen.memory_budget"), "{err}");
    }
}
