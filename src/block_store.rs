//! The block store: every block between two operators lives here, in memory under the
//! memory budget, spilled to Arrow IPC files in a temp dir beyond it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use datafusion::arrow::ipc::reader::FileReader;
use datafusion::arrow::ipc::writer::FileWriter;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use tempfile::TempDir;

use crate::config::ByteSize;

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

/// Identifier of a block, unique within one query run.
pub type BlockId = u64;

enum Stored {
    Memory(RecordBatch),
    Spilled(PathBuf),
}

struct Entry {
    data: Stored,
    bytes: u64,
}

#[derive(Default)]
struct Inner {
    blocks: HashMap<BlockId, Entry>,
    memory_bytes: u64,
    peak_memory_bytes: u64,
    spilled_blocks: u64,
}

/// Blocks of one query run, with a memory budget.
pub struct BlockStore {
    budget: u64,
    spill_dir: OnceLock<std::io::Result<TempDir>>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for BlockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStore")
            .field("budget", &self.budget)
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
            spill_dir: OnceLock::new(),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The memory budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of blocks held in memory now.
    pub fn memory_bytes(&self) -> u64 {
        self.inner.lock().unwrap().memory_bytes
    }

    /// Most bytes held in memory at once.
    pub fn peak_memory_bytes(&self) -> u64 {
        self.inner.lock().unwrap().peak_memory_bytes
    }

    /// Blocks written to spill files.
    pub fn spilled_blocks(&self) -> u64 {
        self.inner.lock().unwrap().spilled_blocks
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
            if inner.memory_bytes + bytes <= self.budget {
                inner.memory_bytes += bytes;
                inner.peak_memory_bytes = inner.peak_memory_bytes.max(inner.memory_bytes);
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
        inner.spilled_blocks += 1;
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
        let dir = self
            .spill_dir
            .get_or_init(|| tempfile::Builder::new().prefix("flumen-spill-").tempdir());
        let dir = dir.as_ref().map_err(|e| {
            DataFusionError::Execution(format!("cannot create flumen spill directory: {e}"))
        })?;
        let path = dir.path().join(format!("block-{id}.arrow"));
        let file = BufWriter::new(File::create(&path)?);
        let mut writer = FileWriter::try_new(file, batch.schema_ref())?;
        writer.write(batch)?;
        writer.finish()?;
        Ok(path)
    }

    /// The block's data, or `None` when it is not in the store (lost or released).
    pub fn get(&self, id: BlockId) -> Result<Option<RecordBatch>> {
        let path = {
            let inner = self.inner.lock().unwrap();
            match inner.blocks.get(&id) {
                None => return Ok(None),
                Some(Entry {
                    data: Stored::Memory(b),
                    ..
                }) => return Ok(Some(b.clone())),
                Some(Entry {
                    data: Stored::Spilled(p),
                    ..
                }) => p.clone(),
            }
        };
        let reader = FileReader::try_new(BufReader::new(File::open(&path)?), None)?;
        let mut batches = reader.collect::<std::result::Result<Vec<_>, _>>()?;
        match batches.len() {
            1 => Ok(batches.pop()),
            n => Err(DataFusionError::Internal(format!(
                "spill file of block {id} holds {n} batches"
            ))),
        }
    }

    /// True when the block is in the store.
    pub fn contains(&self, id: BlockId) -> bool {
        self.inner.lock().unwrap().blocks.contains_key(&id)
    }

    /// Remove a block (consumed, or dropped to simulate its loss). Returns its bytes.
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
                }
                entry.bytes
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use std::sync::Arc;

    fn batch(n: i64) -> RecordBatch {
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
        assert_eq!(store.peak_memory_bytes(), 600);
    }

    #[test]
    fn a_block_larger_than_the_budget_is_an_error() {
        let store = BlockStore::new(100);
        let err = store.put(1, batch(10), 200).unwrap_err().to_string();
        assert!(err.contains("flumen.memory_budget"), "{err}");
    }
}
