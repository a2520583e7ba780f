//! The model-output cache (`flumen.model_cache = 'DIR'`): a deterministic model's output for
//! an input it has seen before is read back instead of computed again.
//!
//! - **Keys.** A function that declares itself deterministic
//!   ([`AcceleratorFunction::cache_identity`]: its name, a hash of its weight files, every
//!   setting that changes its outputs) has a directory of its own, named by the identity's
//!   BLAKE3 hash; a row's key is the BLAKE3 hash of the identity and the row's arguments
//!   (arrow's row format of the arrays the model gets). A changed weight file or setting is
//!   another directory: an old vector is never returned for it.
//! - **Lookups** happen in the CPU stage that feeds the model, before its CPU step (the
//!   tokenizer): the planner ([`crate::plan::model_cache_lookup`]) computes each row's key
//!   and looks it up there ([`functions`]: `model_cache_key`, `model_cache_get`), the step
//!   runs for the misses only, and the model operator computes the misses alone
//!   (`model_cache_fill`). A block whose every row hit loads no model and touches no device.
//! - **Writes.** The model task that computed misses writes them as one [`segment`] in the
//!   function's directory, on whatever host it ran; segments are whole or ignored (write,
//!   sync, rename; a checksum checked on read), so writers never corrupt each other and a
//!   killed writer leaves nothing that reads back wrong.
//! - **Size.** After a write, the oldest segments (by modification time) go while the
//!   cache is larger than `flumen.model_cache_max_bytes`.
//! - **Figures.** `EXPLAIN ANALYZE` shows them (`model_cache_*`) where they happen, on a
//!   driver's threads or in a worker: bytes read and damaged segments with the CPU operator
//!   that looked up ([`take_read_figures`]), hits, misses and bytes written with the model's
//!   ([`take_figures`]). `flumen cache stats|clear` reads or empties a cache.
//!
//! [`AcceleratorFunction::cache_identity`]: crate::functions::accelerator::AcceleratorFunction::cache_identity

pub mod functions;
pub mod place;
pub mod segment;

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, FixedSizeBinaryArray, StructArray, new_null_array,
};
use datafusion::arrow::compute::interleave;
use datafusion::arrow::datatypes::{DataType, Field, Fields};
use datafusion::arrow::row::{RowConverter, SortField};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};

use crate::config::FlumenConfig;
#[cfg(doc)]
use crate::functions::accelerator::AcceleratorFunction;
use place::Place;
use segment::Segment;

/// Where the REPL and `flumen extract` keep the cache unless told otherwise:
/// `~/.cache/flumen/model-cache`.
pub fn default_dir() -> PathBuf {
    crate::config::cache_dir().join("model-cache")
}

/// The file in a function's directory that says, in words, whose outputs it holds.
pub(crate) const IDENTITY_FILE: &str = "IDENTITY";

/// The cache of one function's outputs under one identity, as this process knows it.
#[derive(Debug)]
struct Shard {
    place: Place,
    state: Mutex<ShardState>,
    /// Bytes of segments read since [`take_read_figures`] last took them. Lookups run in
    /// CPU tasks on any thread, so they are counted here, per shard, and taken by the task
    /// whose plan names the shard when it ends.
    bytes_read: AtomicU64,
    /// Damaged segments found since [`take_read_figures`] last took them.
    corrupt_segments: AtomicU64,
}

/// The segments a shard has read, and where each key's output is.
#[derive(Debug, Default)]
struct ShardState {
    seen: HashSet<String>,
    segments: Vec<Arc<Segment>>,
    index: HashMap<[u8; 32], (usize, usize)>,
    /// Bytes this process wrote since the cache's size was last held to its limit.
    written_since_evict: u64,
}

/// Every shard this process opened, by root and identity.
static SHARDS: Mutex<Option<HashMap<String, Arc<Shard>>>> = Mutex::new(None);

thread_local! {
    /// This thread's cache figures since [`take_figures`] last read them (the model
    /// operator's: hits and misses it filled, bytes it wrote).
    static FIGURES: RefCell<Figures> = RefCell::new(Figures::default());
}

/// What the cache did for the model calls of one thread.
#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    hits: u64,
    misses: u64,
    bytes_written: u64,
}

/// This thread's cache figures since the last call (the model operator's: rows it filled
/// from the cache, rows it computed, bytes it wrote), by name; none when the cache filled
/// nothing.
pub fn take_figures() -> Vec<(String, u64)> {
    let f = FIGURES.with(|f| std::mem::take(&mut *f.borrow_mut()));
    if f.hits + f.misses == 0 {
        return vec![];
    }
    vec![
        ("model_cache_hits".into(), f.hits),
        ("model_cache_misses".into(), f.misses),
        ("model_cache_bytes_written".into(), f.bytes_written),
    ]
}

/// What the lookups of the caches of `identities` (under the cache place `root`, the
/// session's `flumen.model_cache`) read in this process since the last call, by name: the
/// figures of a CPU task whose plan looks these identities up, taken when it ends (tasks
/// of one shard running at once share them: their sum over a query is the query's). None
/// when the lookups read nothing.
pub fn take_read_figures(identities: &[String], root: &str) -> Vec<(String, u64)> {
    let (mut bytes_read, mut corrupt_segments) = (0, 0);
    let shards = SHARDS.lock().unwrap();
    for identity in identities {
        if let Some(shard) = shards
            .as_ref()
            .and_then(|s| s.get(&shard_key(root, identity)))
        {
            bytes_read += shard.bytes_read.swap(0, Ordering::Relaxed);
            corrupt_segments += shard.corrupt_segments.swap(0, Ordering::Relaxed);
        }
    }
    if bytes_read + corrupt_segments == 0 {
        return vec![];
    }
    vec![
        ("model_cache_bytes_read".into(), bytes_read),
        ("model_cache_corrupt_segments".into(), corrupt_segments),
    ]
}

/// The name of a function's directory under a cache place: its identity's hash, in hex.
fn shard_name(identity: &str) -> String {
    blake3::Hash::from_bytes(identity_hash(identity)).to_hex()[..32].to_string()
}

/// Where [`SHARDS`] keeps the shard of `identity` under the cache place `root`.
fn shard_key(root: &str, identity: &str) -> String {
    format!("{}\n{}", root.trim(), shard_name(identity))
}

fn count(update: impl FnOnce(&mut Figures)) {
    FIGURES.with(|f| update(&mut f.borrow_mut()));
}

/// The hash of a function's [`cache_identity`](AcceleratorFunction::cache_identity): its
/// shard's name, and part of every key.
pub fn identity_hash(identity: &str) -> [u8; 32] {
    *blake3::hash(identity.as_bytes()).as_bytes()
}

/// Each row's key under the identity hashed as `identity`: the BLAKE3 hash of the identity
/// and the row's arguments (in arrow's row format).
pub fn row_keys(identity: &[u8; 32], args: &[ArrayRef], rows: usize) -> Result<Vec<[u8; 32]>> {
    if args.is_empty() {
        return Ok(vec![*blake3::hash(identity).as_bytes(); rows]);
    }
    let fields = args
        .iter()
        .map(|a| SortField::new(a.data_type().clone()))
        .collect();
    let converted = RowConverter::new(fields)?.convert_columns(args)?;
    Ok((0..rows)
        .map(|row| {
            let mut hasher = blake3::Hasher::new();
            hasher.update(identity);
            hasher.update(converted.row(row).as_ref());
            *hasher.finalize().as_bytes()
        })
        .collect())
}

/// The type of a lookup's result for a model returning `value`: per row whether the cache
/// had it (`found`, so that a cached null is a hit) and the cached output (`value`).
pub fn hits_type(value: &DataType) -> DataType {
    DataType::Struct(hit_fields(value))
}

fn hit_fields(value: &DataType) -> Fields {
    Fields::from(vec![
        Field::new("found", DataType::Boolean, false),
        Field::new("value", value.clone(), true),
    ])
}

/// A lookup's result ([`hits_type`]) taken apart: whether each row was found, and the
/// cached outputs.
pub fn split_hits(hits: &ArrayRef) -> Result<(BooleanArray, ArrayRef)> {
    let hits = hits
        .as_any()
        .downcast_ref::<StructArray>()
        .filter(|h| h.num_columns() == 2)
        .ok_or_else(|| DataFusionError::Internal("cache hits of another type".into()))?;
    let found = hits
        .column(0)
        .as_any()
        .downcast_ref::<BooleanArray>()
        .ok_or_else(|| DataFusionError::Internal("cache hits of another type".into()))?;
    Ok((found.clone(), Arc::clone(hits.column(1))))
}

/// The rows a lookup's result says missed, in order.
pub fn miss_rows(hits: &ArrayRef) -> Result<Vec<u32>> {
    let (found, _) = split_hits(hits)?;
    Ok((0..found.len() as u32)
        .filter(|&row| !found.value(row as usize))
        .collect())
}

/// The cached outputs of a lookup's result `hits`, with the misses' rows taken from
/// `computed` (one row per miss, in order).
pub fn merge_misses(hits: &ArrayRef, computed: &ArrayRef) -> Result<ArrayRef> {
    let (found, values) = split_hits(hits)?;
    let mut next_miss = 0;
    let indices: Vec<(usize, usize)> = (0..found.len())
        .map(|row| match found.value(row) {
            true => (0, row),
            false => {
                next_miss += 1;
                (1, next_miss - 1)
            }
        })
        .collect();
    Ok(interleave(&[values.as_ref(), computed.as_ref()], &indices)?)
}

/// The cache one call of a model uses: its shard and identity.
#[derive(Debug)]
pub struct CachedCall {
    shard: Arc<Shard>,
    identity: [u8; 32],
    max_bytes: u64,
    root: String,
}

/// Where each row of a call's output comes from.
#[derive(Debug)]
pub struct Lookup {
    /// Per row: the segment and entry holding its output, or `None` (a miss).
    hits: Vec<Option<(Arc<Segment>, usize)>>,
}

impl Lookup {
    /// A lookup of `rows` rows that found none.
    pub fn nothing_found(rows: usize) -> Self {
        Self {
            hits: vec![None; rows],
        }
    }

    /// What the lookup found ([`hits_type`] of `data_type`): per row whether the cache had
    /// it, and its cached output (null where it missed).
    pub fn hits(&self, data_type: &DataType) -> Result<ArrayRef> {
        let nothing = new_null_array(data_type, 1);
        let mut sources: Vec<&dyn Array> = vec![nothing.as_ref()];
        let mut source_of: HashMap<*const Segment, usize> = HashMap::new();
        let indices: Vec<(usize, usize)> = (self.hits.iter())
            .map(|hit| match hit {
                Some((segment, entry)) => {
                    let source = *source_of.entry(Arc::as_ptr(segment)).or_insert_with(|| {
                        sources.push(segment.values.as_ref());
                        sources.len() - 1
                    });
                    (source, *entry)
                }
                None => (0, 0),
            })
            .collect();
        let values = interleave(&sources, &indices)?;
        let found: BooleanArray = self.hits.iter().map(|h| Some(h.is_some())).collect();
        let hits =
            StructArray::try_new(hit_fields(data_type), vec![Arc::new(found), values], None)?;
        Ok(Arc::new(hits))
    }
}

impl CachedCall {
    /// The cache of the function whose [`cache_identity`] is `identity`, under `config`:
    /// `None` when `flumen.model_cache` is empty.
    ///
    /// [`cache_identity`]: AcceleratorFunction::cache_identity
    pub fn open_identity(identity: &str, config: &ConfigOptions) -> Result<Option<Self>> {
        let Some(flumen) = config.extensions.get::<FlumenConfig>() else {
            return Ok(None);
        };
        if flumen.model_cache.trim().is_empty() {
            return Ok(None);
        }
        let root = flumen.model_cache.trim().to_string();
        let mut described = false;
        let shard = {
            let mut shards = SHARDS.lock().unwrap();
            let shards = shards.get_or_insert_with(HashMap::new);
            let key = shard_key(&root, identity);
            match shards.get(&key) {
                Some(shard) => Arc::clone(shard),
                None => {
                    let shard = Arc::new(Shard::new(Place::open(&root, &shard_name(identity))?));
                    shards.insert(key, Arc::clone(&shard));
                    // Words for `flumen cache stats`, written outside the lock below.
                    described = true;
                    shard
                }
            }
        };
        if described {
            shard.place.describe(identity);
        }
        Ok(Some(Self {
            shard,
            identity: identity_hash(identity),
            max_bytes: flumen.model_cache_max_bytes.0,
            root,
        }))
    }

    /// Each row's key: the identity and the row's arguments, hashed.
    pub fn keys(&self, args: &[ArrayRef], rows: usize) -> Result<Vec<[u8; 32]>> {
        row_keys(&self.identity, args, rows)
    }

    /// Where each key's output is; segments other writers added since the last look are
    /// read first when a key misses (a directory listing, or one LIST request on an
    /// object store, per call with a miss: other hosts' outputs are found at once). Hits
    /// and misses are counted where the misses are computed ([`Self::fill`]).
    pub fn lookup(&self, keys: &[[u8; 32]]) -> Lookup {
        let mut state = self.shard.state.lock().unwrap();
        let find = |state: &ShardState, key: &[u8; 32]| {
            (state.index.get(key)).map(|&(s, e)| (Arc::clone(&state.segments[s]), e))
        };
        let mut hits: Vec<_> = keys.iter().map(|k| find(&state, k)).collect();
        if hits.iter().any(Option::is_none) {
            self.shard.refresh(&mut state);
            for (hit, key) in hits.iter_mut().zip(keys) {
                if hit.is_none() {
                    *hit = find(&state, key);
                }
            }
        }
        Lookup { hits }
    }

    /// The model's output for rows whose lookup found `hits` ([`hits_type`]) and whose
    /// keys are `keys`: the hits, and `computed` (one row per miss, in
    /// order) for the misses, which are written to the cache. Counts the hits and misses.
    pub fn fill(&self, hits: &ArrayRef, keys: &ArrayRef, computed: &ArrayRef) -> Result<ArrayRef> {
        let misses = miss_rows(hits)?;
        if computed.len() != misses.len() {
            return Err(DataFusionError::Internal(format!(
                "{} outputs computed for {} cache misses",
                computed.len(),
                misses.len()
            )));
        }
        count(|f| {
            f.hits += (hits.len() - misses.len()) as u64;
            f.misses += misses.len() as u64;
        });
        if !misses.is_empty() {
            let keys = keys
                .as_any()
                .downcast_ref::<FixedSizeBinaryArray>()
                .ok_or_else(|| DataFusionError::Internal("cache keys of another type".into()))?;
            let miss_keys: Vec<[u8; 32]> = (misses.iter())
                .map(|&row| keys.value(row as usize).try_into().expect("32-byte keys"))
                .collect();
            if let Err(e) = self.store(&miss_keys, computed) {
                // The answer stands; only the cache lost these outputs.
                log::warn!("{e}");
            }
        }
        merge_misses(hits, computed)
    }

    /// Keep `values` (one per key) as a new segment, then hold the cache to its size.
    pub fn store(&self, keys: &[[u8; 32]], values: &ArrayRef) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let (name, bytes) = self.shard.place.write(keys, values)?;
        count(|f| f.bytes_written += bytes);
        let evict_now = {
            // What this process wrote it knows: no need to read it back.
            let mut state = self.shard.state.lock().unwrap();
            state.seen.insert(name);
            state.add(Segment {
                keys: FixedSizeBinaryArray::try_from_iter(keys.iter())?,
                values: Arc::clone(values),
                bytes,
            });
            // The size is held after every 1/16 of the limit written, not after each write
            // (each check lists the whole cache).
            state.written_since_evict += bytes;
            let due = state.written_since_evict >= (self.max_bytes / 16).max(1);
            if due {
                state.written_since_evict = 0;
            }
            due
        };
        if self.max_bytes > 0 && evict_now {
            match &self.shard.place {
                Place::Local(_) => evict(Path::new(&self.root), self.max_bytes),
                Place::Remote { .. } => evict_place(&self.shard.place, self.max_bytes),
            }
        }
        Ok(())
    }
}

impl Shard {
    /// A shard at `place` this process has read nothing of yet.
    fn new(place: Place) -> Self {
        Self {
            place,
            state: Mutex::default(),
            bytes_read: AtomicU64::new(0),
            corrupt_segments: AtomicU64::new(0),
        }
    }

    /// Read the segments of the directory this process has not seen; a damaged one is
    /// counted, logged and removed (its outputs are computed again), never returned.
    fn refresh(&self, state: &mut ShardState) {
        for listed in self.place.list() {
            if !state.seen.insert(listed.name.clone()) {
                continue;
            }
            match self.place.read(&listed.name) {
                Ok(read) => {
                    self.bytes_read.fetch_add(read.bytes, Ordering::Relaxed);
                    state.add(read);
                }
                Err(e) => {
                    log::warn!("{e}: removed, its outputs will be computed again");
                    self.corrupt_segments.fetch_add(1, Ordering::Relaxed);
                    self.place.remove(&listed.name);
                }
            }
        }
    }
}

impl ShardState {
    fn add(&mut self, read: Segment) {
        let at = self.segments.len();
        for entry in 0..read.keys.len() {
            let key: [u8; 32] = read.keys.value(entry).try_into().expect("32-byte keys");
            self.index.entry(key).or_insert((at, entry));
        }
        self.segments.push(Arc::new(read));
    }
}

/// The segments under a cache root: (modified, bytes, path), oldest first.
fn segments_under(root: &Path) -> Vec<(std::time::SystemTime, u64, PathBuf)> {
    let mut found = Vec::new();
    let Ok(dirs) = std::fs::read_dir(root) else {
        return found;
    };
    for dir in dirs.flatten() {
        let Ok(files) = std::fs::read_dir(dir.path()) else {
            continue;
        };
        for file in files.flatten() {
            let path = file.path();
            if path.extension().is_some_and(|e| e == segment::EXTENSION)
                && let Ok(meta) = file.metadata()
            {
                let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                found.push((modified, meta.len(), path));
            }
        }
    }
    found.sort();
    found
}

/// Remove the oldest segments under `root` while they hold more than `max_bytes`.
fn evict(root: &Path, max_bytes: u64) {
    let segments = segments_under(root);
    let mut total: u64 = segments.iter().map(|(_, bytes, _)| bytes).sum();
    for (_, bytes, path) in segments {
        if total <= max_bytes {
            break;
        }
        if std::fs::remove_file(&path).is_ok() {
            total -= bytes;
        }
    }
}

/// Remove the oldest segments of `place` while they hold more than `max_bytes`.
fn evict_place(place: &Place, max_bytes: u64) {
    let mut listed = place.list();
    listed.sort_by_key(|l| l.modified);
    let mut total: u64 = listed.iter().map(|l| l.bytes).sum();
    for segment in listed {
        if total <= max_bytes {
            break;
        }
        place.remove(&segment.name);
        total -= segment.bytes;
    }
}

/// What a cache directory holds for one function identity.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardStats {
    /// The identity, in words.
    pub identity: String,
    /// Its segments.
    pub segments: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// What the cache at `root` holds, per function identity.
pub fn stats(root: &Path) -> Result<Vec<ShardStats>> {
    let dirs = std::fs::read_dir(root)
        .map_err(|e| DataFusionError::Execution(format!("model cache {}: {e}", root.display())))?;
    let mut all = Vec::new();
    for dir in dirs
        .flatten()
        .filter(|d| d.path().join(IDENTITY_FILE).exists())
    {
        let identity = std::fs::read_to_string(dir.path().join(IDENTITY_FILE)).unwrap_or_default();
        let segments: Vec<_> = segments_under(root)
            .into_iter()
            .filter(|(_, _, p)| p.parent() == Some(dir.path().as_path()))
            .collect();
        all.push(ShardStats {
            identity: identity.trim().to_string(),
            segments: segments.len(),
            bytes: segments.iter().map(|(_, b, _)| b).sum(),
        });
    }
    all.sort_by(|a, b| a.identity.cmp(&b.identity));
    Ok(all)
}

/// Empty the cache at `root`: its segments, temporary files and identity files, and the
/// directories they leave empty (nothing else in `root` is touched). Returns the bytes freed.
pub fn clear(root: &Path) -> Result<u64> {
    let mut freed = 0;
    let dirs = std::fs::read_dir(root)
        .map_err(|e| DataFusionError::Execution(format!("model cache {}: {e}", root.display())))?;
    for dir in dirs
        .flatten()
        .filter(|d| d.path().join(IDENTITY_FILE).exists())
    {
        for file in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = file.path();
            let name = file.file_name().to_string_lossy().to_string();
            let ours = path.extension().is_some_and(|e| e == segment::EXTENSION)
                || name.starts_with(".tmp-seg-")
                || name == IDENTITY_FILE;
            if ours {
                freed += file.metadata().map(|m| m.len()).unwrap_or(0);
                let _ = std::fs::remove_file(&path);
            }
        }
        let _ = std::fs::remove_dir(dir.path());
    }
    Ok(freed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::Float32Array;

    /// A call on a local shard in `dir` of the cache at `root`.
    fn local_call(dir: PathBuf, root: &Path, identity: [u8; 32], max_bytes: u64) -> CachedCall {
        CachedCall {
            shard: Arc::new(Shard::new(Place::Local(dir))),
            identity,
            max_bytes,
            root: root.display().to_string(),
        }
    }

    #[test]
    fn hits_and_computed_misses_merge_in_row_order() {
        let dir = tempfile::tempdir().unwrap();
        let call = local_call(dir.path().to_path_buf(), dir.path(), [7; 32], 0);
        let args: Vec<ArrayRef> = vec![Arc::new(Float32Array::from(vec![1.0, 2.0, 3.0]))];
        let keys = call.keys(&args, 3).unwrap();
        assert_ne!(keys[0], keys[1]);
        // Rows 0 and 2 computed before.
        let before: ArrayRef = Arc::new(Float32Array::from(vec![10.0, 30.0]));
        call.store(&[keys[0], keys[2]], &before).unwrap();
        let hits = call.lookup(&keys).hits(&DataType::Float32).unwrap();
        assert_eq!(miss_rows(&hits).unwrap(), vec![1]);
        let key_array: ArrayRef =
            Arc::new(FixedSizeBinaryArray::try_from_iter(keys.iter()).unwrap());
        let computed: ArrayRef = Arc::new(Float32Array::from(vec![20.0]));
        let merged = call.fill(&hits, &key_array, &computed).unwrap();
        let expected: ArrayRef = Arc::new(Float32Array::from(vec![10.0, 20.0, 30.0]));
        assert_eq!(&merged, &expected);
        // The miss was written: every row hits now.
        let again = call.lookup(&keys).hits(&DataType::Float32).unwrap();
        assert!(miss_rows(&again).unwrap().is_empty());
        let empty: ArrayRef = Arc::new(Float32Array::from(Vec::<f32>::new()));
        assert_eq!(&merge_misses(&again, &empty).unwrap(), &expected);
    }

    #[test]
    fn a_cached_null_is_a_hit() {
        let dir = tempfile::tempdir().unwrap();
        let call = local_call(dir.path().to_path_buf(), dir.path(), [9; 32], 0);
        let args: Vec<ArrayRef> = vec![Arc::new(Float32Array::from(vec![None, Some(1.0)]))];
        let keys = call.keys(&args, 2).unwrap();
        let first = call.lookup(&keys).hits(&DataType::Float32).unwrap();
        assert_eq!(miss_rows(&first).unwrap(), vec![0, 1]);
        let key_array: ArrayRef =
            Arc::new(FixedSizeBinaryArray::try_from_iter(keys.iter()).unwrap());
        // The model's output for a null input is null: kept like any other output.
        let computed: ArrayRef = Arc::new(Float32Array::from(vec![None, Some(2.0)]));
        call.fill(&first, &key_array, &computed).unwrap();
        let again = call.lookup(&keys).hits(&DataType::Float32).unwrap();
        assert!(
            miss_rows(&again).unwrap().is_empty(),
            "a cached null missed"
        );
        let empty: ArrayRef = Arc::new(Float32Array::from(Vec::<f32>::new()));
        assert_eq!(&merge_misses(&again, &empty).unwrap(), &computed);
    }

    #[test]
    fn the_cache_is_held_to_its_size_oldest_segments_first() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("model");
        std::fs::create_dir_all(&dir).unwrap();
        let values: ArrayRef = Arc::new(Float32Array::from(vec![1.0; 256]));
        let keys: Vec<[u8; 32]> = (0..256u32)
            .map(|i| *blake3::hash(&i.to_le_bytes()).as_bytes())
            .collect();
        let one = segment::encode(&keys, &values).unwrap().len() as u64;
        // Room for two segments and a half.
        let call = local_call(dir.clone(), root.path(), [7; 32], one * 5 / 2);
        let mut first = None;
        for _ in 0..6 {
            call.store(&keys, &values).unwrap();
            first.get_or_insert_with(|| segments_under(root.path())[0].2.clone());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let left = segments_under(root.path());
        let total: u64 = left.iter().map(|(_, bytes, _)| bytes).sum();
        assert!(total <= one * 5 / 2 && !left.is_empty(), "{left:?}");
        assert!(!first.unwrap().exists(), "the oldest segment was kept");
    }
}
