//! One segment of the model-output cache: the outputs one task computed, as a file that is
//! whole or ignored.
//!
//! A segment holds an Arrow IPC stream of one batch (`key`: the 32-byte BLAKE3 key of an
//! input row, `value`: the model's output for it), then the BLAKE3 hash of those bytes, then
//! [`MAGIC`]. It is written under a temporary name, synced, and renamed into place, so a
//! writer killed half-way leaves a temporary file readers skip; a segment whose hash does
//! not match its bytes (a torn or corrupted file) is refused when read, never returned.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::arrow::array::{ArrayRef, FixedSizeBinaryArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::ipc::reader::StreamReader;
use datafusion::arrow::ipc::writer::StreamWriter;
use datafusion::error::{DataFusionError, Result};

/// The last 8 bytes of every segment.
const MAGIC: &[u8; 8] = b"FLMCACHE";

/// A segment file's extension.
pub const EXTENSION: &str = "fmc";

/// A segment's entries, read whole.
#[derive(Debug)]
pub struct Segment {
    /// One key per entry.
    pub keys: FixedSizeBinaryArray,
    /// One model output per entry, in the order of `keys`.
    pub values: ArrayRef,
    /// The file's size.
    pub bytes: u64,
}

/// Write `keys` and their `values` as a new segment in `dir`; returns its path and size.
pub fn write(dir: &Path, keys: &[[u8; 32]], values: &ArrayRef) -> Result<(PathBuf, u64)> {
    let bytes = encode(keys, values)?;
    let name = unique_name();
    let temporary = dir.join(format!(".tmp-{name}"));
    let path = dir.join(format!("{name}.{EXTENSION}"));
    let io = |e: std::io::Error| {
        DataFusionError::Execution(format!("model cache: cannot write {}: {e}", path.display()))
    };
    let mut file = std::fs::File::create(&temporary).map_err(io)?;
    file.write_all(&bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    std::fs::rename(&temporary, &path).map_err(io)?;
    Ok((path, bytes.len() as u64))
}

/// A segment's bytes: the IPC stream of `keys` and `values`, its hash, the magic.
pub fn encode(keys: &[[u8; 32]], values: &ArrayRef) -> Result<Vec<u8>> {
    let keys = FixedSizeBinaryArray::try_from_iter(keys.iter())?;
    let schema = Arc::new(Schema::new(vec![
        Field::new("key", DataType::FixedSizeBinary(32), false),
        Field::new("value", values.data_type().clone(), true),
    ]));
    let batch = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(keys), values.clone()])?;
    let mut bytes = Vec::new();
    {
        let mut writer = StreamWriter::try_new(&mut bytes, &schema)?;
        writer.write(&batch)?;
        writer.finish()?;
    }
    let hash = blake3::hash(&bytes);
    bytes.extend_from_slice(hash.as_bytes());
    bytes.extend_from_slice(MAGIC);
    Ok(bytes)
}

/// Read the segment at `path`: `Err` naming the file when it is torn or corrupted (its
/// hash does not match) or unreadable.
pub fn read(path: &Path) -> Result<Segment> {
    let bytes = std::fs::read(path).map_err(|e| {
        DataFusionError::Execution(format!("model cache segment {}: {e}", path.display()))
    })?;
    decode(&bytes, &path.display().to_string())
}

/// The segment in `bytes` (`name` for errors): `Err` when it is torn or corrupted.
pub fn decode(bytes: &[u8], name: &str) -> Result<Segment> {
    let bad =
        |why: String| DataFusionError::Execution(format!("model cache segment {name}: {why}"));
    let Some(body_len) = bytes.len().checked_sub(32 + MAGIC.len()) else {
        return Err(bad("too short to be a segment".into()));
    };
    let (body, trailer) = bytes.split_at(body_len);
    if &trailer[32..] != MAGIC {
        return Err(bad("no segment trailer (torn or not a segment)".into()));
    }
    if blake3::hash(body).as_bytes() != &trailer[..32] {
        return Err(bad(
            "its checksum does not match its bytes (corrupted)".into()
        ));
    }
    let mut reader = StreamReader::try_new(body, None).map_err(|e| bad(e.to_string()))?;
    let batch = reader
        .next()
        .ok_or_else(|| bad("no entries".into()))?
        .map_err(|e| bad(e.to_string()))?;
    let keys = batch
        .column(0)
        .as_any()
        .downcast_ref::<FixedSizeBinaryArray>()
        .filter(|k| k.value_length() == 32)
        .ok_or_else(|| bad("its keys are not 32-byte keys".into()))?
        .clone();
    Ok(Segment {
        keys,
        values: Arc::clone(batch.column(1)),
        bytes: bytes.len() as u64,
    })
}

/// A name no other writer (thread, process, host) picks: host, process, time, a counter.
pub fn unique_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "seg-{}-{}-{nanos}-{}",
        &blake3::hash(host.trim().as_bytes()).to_hex()[..8],
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Float32Array;

    #[test]
    fn a_segment_reads_back_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let values: ArrayRef = Arc::new(Float32Array::from(vec![1.5, -2.0]));
        let (path, bytes) = write(dir.path(), &[[1; 32], [2; 32]], &values).unwrap();
        let segment = read(&path).unwrap();
        assert_eq!(segment.keys.value(1), [2; 32]);
        assert_eq!(&segment.values, &values);
        assert_eq!(segment.bytes, bytes);
        // One flipped bit in the body, or a torn tail: refused, naming the file.
        let mut damaged = std::fs::read(&path).unwrap();
        damaged[40] ^= 1;
        std::fs::write(&path, &damaged).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("checksum") && err.contains(".fmc"), "{err}");
        std::fs::write(&path, &damaged[..damaged.len() - 3]).unwrap();
        assert!(read(&path).unwrap_err().to_string().contains("torn"));
    }
}
