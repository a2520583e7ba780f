//! The blocks a worker keeps for its driver, each under the query that owns it, until the
//! driver fetches or releases them. Keys are 128 random bits: only a caller told a key by
//! the driver can name a block, and only with the owning query's token.
//!
//! Memory is bounded twice: a query's blocks in memory and the operators of its tasks
//! running here stay within its `flumen.memory_budget` (the task carries it; operators
//! that grow spill the query's blocks to make room), and all blocks within the worker's own
//! budget (`flumen worker --memory-budget`). A block that would pass either is appended to
//! its query's run file in the worker's spill directory (removed with the shelf; a file
//! goes with its last block, as the driver's [`SpillRuns`]) and is read back when the
//! driver fetches it, so a driver slower to fetch than its tasks are to cut costs the
//! worker disk, not memory (and not a file made and deleted per block: a query of 15,000
//! small spilled blocks spent a quarter of its workers' time in the file system).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};

use crate::cluster::auth::Secret;
use crate::cluster::protocol::{BlockTicket, ReleaseRequest};
use crate::store::spill_runs::{SpillGroup, SpillRun, SpillRuns};

/// How many ended queries a worker remembers.
const ENDED_QUERIES_KEPT: usize = 4096;

/// The name a worker's spill directory starts with, under the system's temporary directory.
const SPILL_DIR_PREFIX: &str = "flumen-worker-blocks-";

/// Remove the spill directories on this host whose worker is gone: for a driver that has
/// just reaped a worker process it started, which may have been killed before it could
/// remove its own. Returns how many.
pub(crate) fn remove_spills_of_ended_workers() -> usize {
    crate::store::owned_dir::sweep(&std::env::temp_dir(), SPILL_DIR_PREFIX)
}

/// Bytes a query's run file takes before its next spilled block starts another.
const RUN_CAP: u64 = 64 << 20;

/// Where a kept block's rows are.
#[derive(Clone)]
enum Rows {
    Memory(RecordBatch),
    /// `len` bytes at `offset` of a run file of the shelf's spill directory, appended to by
    /// the blocks of `group` (its query).
    Spilled {
        run: Arc<SpillRun>,
        offset: u64,
        len: u64,
        group: SpillGroup,
    },
}

/// A block a worker keeps, the query it belongs to, and its bytes in memory.
struct KeptBlock {
    query: String,
    rows: Rows,
    bytes: u64,
}

/// The kept blocks by key, and the bytes of those in memory (in all, and by query).
#[derive(Default)]
struct Kept {
    blocks: HashMap<String, KeptBlock>,
    in_memory: u64,
    in_memory_by_query: HashMap<String, u64>,
    /// Bytes the operators of each query's tasks here hold ([`BlockShelf::operators_grew`]).
    operators_by_query: HashMap<String, u64>,
    /// Blocks being written to spill files to make room for operators (one writer each).
    spilling: std::collections::HashSet<String>,
}

impl Kept {
    fn insert(&mut self, key: String, block: KeptBlock) {
        if matches!(block.rows, Rows::Memory(_)) {
            self.in_memory += block.bytes;
            *self
                .in_memory_by_query
                .entry(block.query.clone())
                .or_default() += block.bytes;
        }
        self.blocks.insert(key, block);
    }

    fn remove(&mut self, key: &str) -> Option<KeptBlock> {
        let block = self.blocks.remove(key)?;
        if matches!(block.rows, Rows::Memory(_)) {
            self.in_memory -= block.bytes;
            if let Some(bytes) = self.in_memory_by_query.get_mut(&block.query) {
                *bytes -= block.bytes;
                if *bytes == 0 {
                    self.in_memory_by_query.remove(&block.query);
                }
            }
        }
        Some(block)
    }
}

/// The most recent [`ENDED_QUERIES_KEPT`] ended queries: a set, looked up at every block
/// kept (a long-lived worker's list of thousands was walked per block, under the shelf's
/// lock), and their order, to forget the oldest.
#[derive(Default)]
struct EndedQueries {
    names: HashSet<String>,
    order: VecDeque<String>,
}

impl EndedQueries {
    /// `query` ended; the oldest is forgotten past [`ENDED_QUERIES_KEPT`].
    fn add(&mut self, query: &str) {
        if !self.names.insert(query.to_string()) {
            return;
        }
        self.order.push_back(query.to_string());
        if self.order.len() > ENDED_QUERIES_KEPT
            && let Some(oldest) = self.order.pop_front()
        {
            self.names.remove(&oldest);
        }
    }
}

/// A worker's kept blocks, by key.
pub(crate) struct BlockShelf {
    kept: Mutex<Kept>,
    /// Queries whose blocks were all released (the query ended): blocks their tasks still
    /// cut afterwards are refused. The most recent [`ENDED_QUERIES_KEPT`].
    ended: Mutex<EndedQueries>,
    /// Bytes of blocks the worker keeps in memory, all queries together.
    budget: u64,
    /// Where blocks over a budget go: run files in a directory made at the first, removed
    /// with the shelf, at the worker's exit, or (a killed worker) by the next one on the
    /// host ([`crate::store::owned_dir::OwnedDir`]).
    runs: SpillRuns,
    /// Each query's spill group (the runs its blocks append to), while it has blocks here.
    groups: Mutex<HashMap<String, SpillGroup>>,
    /// Numbers the groups.
    next_group: AtomicUsize,
    /// Blocks written to the spill directory so far.
    spilled: AtomicU64,
}

impl Default for BlockShelf {
    fn default() -> Self {
        Self::new(u64::MAX)
    }
}

impl BlockShelf {
    /// A shelf keeping at most `budget` bytes of blocks in memory.
    pub(crate) fn new(budget: u64) -> Self {
        Self {
            kept: Mutex::default(),
            ended: Mutex::default(),
            budget,
            runs: SpillRuns::with_prefix(None, SPILL_DIR_PREFIX),
            groups: Mutex::default(),
            next_group: AtomicUsize::new(0),
            spilled: AtomicU64::new(0),
        }
    }

    /// Keep `batch` for `query`, in memory while the query's blocks there stay within
    /// `query_budget` and the worker's within its budget, else in a spill file; its new
    /// key. Refused when the query has ended.
    pub(crate) fn keep(
        &self,
        query: &str,
        batch: RecordBatch,
        query_budget: u64,
    ) -> Result<String> {
        let key = random_key();
        let bytes = batch.get_array_memory_size() as u64;
        {
            let mut kept = self.kept.lock().unwrap();
            self.refuse_ended(query)?;
            let of_query = kept.in_memory_by_query.get(query).copied().unwrap_or(0)
                + kept.operators_by_query.get(query).copied().unwrap_or(0);
            if kept.in_memory + bytes <= self.budget && of_query + bytes <= query_budget {
                let rows = Rows::Memory(batch);
                let query = query.to_string();
                kept.insert(key.clone(), KeptBlock { query, rows, bytes });
                return Ok(key);
            }
        }
        let rows = self.spill(query, &batch)?;
        let mut kept = self.kept.lock().unwrap();
        if let Err(e) = self.refuse_ended(query) {
            // It ended while the block was written: its group was forgotten before.
            drop(kept);
            self.let_go(rows);
            self.forget(query);
            return Err(e);
        }
        let query = query.to_string();
        kept.insert(key.clone(), KeptBlock { query, rows, bytes });
        Ok(key)
    }

    fn refuse_ended(&self, query: &str) -> Result<()> {
        if self.ended.lock().unwrap().names.contains(query) {
            return Err(DataFusionError::Execution(
                "the task's query has ended; its blocks were dropped".into(),
            ));
        }
        Ok(())
    }

    /// Append `batch` to `query`'s run file; where it went.
    fn spill(&self, query: &str, batch: &RecordBatch) -> Result<Rows> {
        let group = *(self.groups.lock().unwrap())
            .entry(query.to_string())
            .or_insert_with(|| (self.next_group.fetch_add(1, Ordering::Relaxed), 0));
        let number = self.spilled.fetch_add(1, Ordering::Relaxed);
        let (run, spans) = (self.runs)
            .append(group, &[(number, batch.clone())], RUN_CAP, None)
            .map_err(|e| {
                DataFusionError::Execution(format!("the worker could not spill a block: {e}"))
            })?;
        let (offset, len) = spans[0];
        Ok(Rows::Spilled {
            run,
            offset,
            len,
            group,
        })
    }

    /// A block's rows are no longer kept: a run file goes with its last block, so a run
    /// still open for appending is closed once only its group holds it.
    fn let_go(&self, rows: Rows) {
        if let Rows::Spilled { run, group, .. } = rows
            && Arc::strong_count(&run) == 2
        {
            self.runs.close_if_open(group, &run);
        }
    }

    /// The block `ticket` names, if its query owns it: removed unless the ticket says keep.
    /// An error when its spill file cannot be read back.
    pub(crate) fn take(&self, ticket: &BlockTicket) -> Result<Option<RecordBatch>> {
        let (rows, taken) = {
            let mut kept = self.kept.lock().unwrap();
            let Some(block) = kept.blocks.get(&ticket.key) else {
                return Ok(None);
            };
            if block.query != ticket.query {
                return Ok(None);
            }
            match (&block.rows, ticket.keep) {
                (Rows::Memory(batch), true) => return Ok(Some(batch.clone())),
                (rows, true) => (rows.clone(), false),
                (_, false) => match kept.remove(&ticket.key).map(|b| b.rows) {
                    Some(Rows::Memory(batch)) => return Ok(Some(batch)),
                    Some(rows) => (rows, true),
                    None => return Ok(None),
                },
            }
        };
        let Rows::Spilled {
            run, offset, len, ..
        } = &rows
        else {
            unreachable!("a block in memory was returned above")
        };
        let read = run.read(0, *offset, *len).and_then(|batch| {
            batch.ok_or_else(|| DataFusionError::Execution("its spill file is gone".into()))
        });
        let batch = read.map_err(|e| {
            DataFusionError::Execution(format!(
                "the worker could not read back block {:.32}: {e}",
                ticket.key,
            ))
        });
        if taken {
            self.let_go(rows);
        }
        batch.map(Some)
    }

    /// Drop the listed blocks of a query, or all of them (the query ended) when none is
    /// listed; how many were dropped.
    pub(crate) fn release(&self, request: ReleaseRequest) -> usize {
        let mut dropped = vec![];
        let ended = request.keys.is_empty();
        {
            let mut kept = self.kept.lock().unwrap();
            let keys: Vec<String> = if ended {
                self.ended.lock().unwrap().add(&request.query);
                kept.blocks
                    .iter()
                    .filter(|(_, b)| b.query == request.query)
                    .map(|(key, _)| key.clone())
                    .collect()
            } else {
                request
                    .keys
                    .into_iter()
                    .filter(|key| {
                        kept.blocks
                            .get(key)
                            .is_some_and(|b| b.query == request.query)
                    })
                    .collect()
            };
            for key in keys {
                dropped.extend(kept.remove(&key));
            }
        }
        let count = dropped.len();
        for block in dropped {
            self.let_go(block.rows);
        }
        if ended {
            self.forget(&request.query);
        }
        count
    }

    /// Nothing more of `query` is kept: its run open for appending, if any, goes.
    fn forget(&self, query: &str) {
        if let Some(group) = self.groups.lock().unwrap().remove(query) {
            self.runs.close_open(group);
        }
    }

    /// The operators of `query`'s tasks here hold `bytes` more: the query's blocks in
    /// memory go to spill files, oldest key order aside, until blocks and operators fit
    /// `query_budget` again (or none is left in memory). An error when a block cannot be
    /// written.
    pub(crate) fn operators_grew(&self, query: &str, bytes: u64, query_budget: u64) -> Result<()> {
        let candidates: Vec<(String, RecordBatch)> = {
            let mut kept = self.kept.lock().unwrap();
            *kept
                .operators_by_query
                .entry(query.to_string())
                .or_default() += bytes;
            let operators = kept.operators_by_query[query];
            let blocks = kept.in_memory_by_query.get(query).copied().unwrap_or(0);
            let mut over = (operators + blocks).saturating_sub(query_budget);
            let mut candidates = vec![];
            for (key, block) in &kept.blocks {
                if over == 0 {
                    break;
                }
                if kept.spilling.contains(key) {
                    // Another task's growth is writing it out already.
                    over = over.saturating_sub(block.bytes);
                    continue;
                }
                if let (true, Rows::Memory(batch)) = (block.query == query, &block.rows) {
                    candidates.push((key.clone(), batch.clone()));
                    over = over.saturating_sub(block.bytes);
                }
            }
            for (key, _) in &candidates {
                kept.spilling.insert(key.clone());
            }
            candidates
        };
        let mut result = Ok(());
        for (key, batch) in candidates {
            let written = match &result {
                Ok(()) => self.spill(query, &batch),
                Err(_) => Err(DataFusionError::Execution("an earlier spill failed".into())),
            };
            let mut kept = self.kept.lock().unwrap();
            kept.spilling.remove(&key);
            let rows = match written {
                Ok(rows) => rows,
                Err(e) => {
                    if result.is_ok() {
                        result = Err(e);
                    }
                    continue;
                }
            };
            // Taken or released meanwhile: its file is not needed.
            let still_in_memory = kept
                .blocks
                .get(&key)
                .is_some_and(|b| matches!(b.rows, Rows::Memory(_)));
            if !still_in_memory {
                drop(kept);
                self.let_go(rows);
                continue;
            }
            let block = kept.remove(&key).expect("checked above");
            kept.insert(key, KeptBlock { rows, ..block });
        }
        if self.refuse_ended(query).is_err() {
            // It ended while its blocks were written: the spills opened its group again.
            self.forget(query);
        }
        result
    }

    /// The operators of `query`'s tasks here hold `bytes` fewer.
    pub(crate) fn operators_shrank(&self, query: &str, bytes: u64) {
        let mut kept = self.kept.lock().unwrap();
        if let Some(held) = kept.operators_by_query.get_mut(query) {
            *held = held.saturating_sub(bytes);
            if *held == 0 {
                kept.operators_by_query.remove(query);
            }
        }
    }

    /// Blocks kept now.
    pub(crate) fn len(&self) -> usize {
        self.kept.lock().unwrap().blocks.len()
    }

    /// Bytes of the blocks kept in memory now.
    pub(crate) fn bytes_in_memory(&self) -> u64 {
        self.kept.lock().unwrap().in_memory
    }

    /// Blocks written to the spill directory since the worker started.
    pub(crate) fn blocks_spilled(&self) -> u64 {
        self.spilled.load(Ordering::Relaxed)
    }
}

/// 128 random bits as hex: a block key nobody can guess.
pub(crate) fn random_key() -> String {
    Secret::random().to_hex()[..32].to_string()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::Int32Array;

    use super::*;

    fn batch() -> RecordBatch {
        RecordBatch::try_from_iter([("x", Arc::new(Int32Array::from(vec![1, 2])) as _)]).unwrap()
    }

    fn ticket(query: &str, key: &str, keep: bool) -> BlockTicket {
        BlockTicket {
            query: query.into(),
            key: key.into(),
            keep,
            compression: String::new(),
        }
    }

    #[test]
    fn only_the_owning_query_takes_or_releases_a_block() {
        let shelf = BlockShelf::default();
        let key = shelf.keep("a", batch(), u64::MAX).unwrap();
        assert_eq!(key.len(), 32);
        assert!(shelf.take(&ticket("b", &key, false)).unwrap().is_none());
        let release = |query: &str| ReleaseRequest {
            query: query.into(),
            keys: vec![key.clone()],
        };
        assert_eq!(shelf.release(release("b")), 0);
        assert!(
            shelf.take(&ticket("a", &key, true)).unwrap().is_some(),
            "kept"
        );
        assert_eq!(shelf.len(), 1);
        assert!(
            shelf.take(&ticket("a", &key, false)).unwrap().is_some(),
            "taken"
        );
        assert_eq!(shelf.len(), 0);
    }

    #[test]
    fn blocks_over_a_budget_go_to_disk_and_come_back_the_same() {
        let one = batch().get_array_memory_size() as u64;
        // The worker's budget holds three blocks, query a's one.
        let shelf = BlockShelf::new(3 * one);
        let a: Vec<String> = (0..3)
            .map(|_| shelf.keep("a", batch(), one).unwrap())
            .collect();
        assert_eq!(shelf.bytes_in_memory(), one, "query a: one block in memory");
        assert_eq!(shelf.blocks_spilled(), 2);
        let b: Vec<String> = (0..3)
            .map(|_| shelf.keep("b", batch(), u64::MAX).unwrap())
            .collect();
        assert_eq!(shelf.bytes_in_memory(), 3 * one, "the worker's budget");
        assert_eq!(shelf.blocks_spilled(), 3);
        let spill_dir = shelf.runs.dir().unwrap();
        // Run files, in the directory's subdirectories.
        let files = || {
            let subdirs = std::fs::read_dir(&spill_dir).unwrap().flatten();
            (subdirs.filter(|d| d.path().is_dir()))
                .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
                .filter(|e| e.path().extension().is_some_and(|x| x == "arrow"))
                .count()
        };
        assert_eq!(files(), 2, "one run file per query, not one file per block");
        for key in &a {
            let kept = shelf.take(&ticket("a", key, true)).unwrap().unwrap();
            assert_eq!(kept, batch(), "kept");
            assert_eq!(
                shelf.take(&ticket("a", key, false)).unwrap().unwrap(),
                batch()
            );
        }
        assert_eq!(files(), 1, "query a's files went with its blocks");
        let ended = ReleaseRequest {
            query: "b".into(),
            keys: vec![],
        };
        assert_eq!(shelf.release(ended), b.len());
        assert_eq!(files(), 0, "a released block's file goes");
        assert_eq!(shelf.bytes_in_memory(), 0);
        drop(shelf);
        assert!(
            !spill_dir.exists(),
            "the spill directory goes with the shelf"
        );
    }

    #[test]
    fn the_oldest_ended_query_is_forgotten_first() {
        let mut ended = EndedQueries::default();
        for n in 0..ENDED_QUERIES_KEPT + 2 {
            ended.add(&format!("q{n}"));
        }
        ended.add("q5");
        assert_eq!(ended.names.len(), ENDED_QUERIES_KEPT);
        assert_eq!(ended.order.len(), ENDED_QUERIES_KEPT);
        assert!(!ended.names.contains("q0") && !ended.names.contains("q1"));
        assert!(ended.names.contains("q2") && ended.names.contains("q5"));
        let last = format!("q{}", ENDED_QUERIES_KEPT + 1);
        assert!(ended.names.contains(&last));
    }

    #[test]
    fn an_ended_query_keeps_nothing_more() {
        let shelf = BlockShelf::default();
        shelf.keep("a", batch(), u64::MAX).unwrap();
        shelf.keep("b", batch(), u64::MAX).unwrap();
        let ended = ReleaseRequest {
            query: "a".into(),
            keys: vec![],
        };
        assert_eq!(shelf.release(ended), 1);
        let refused = shelf.keep("a", batch(), u64::MAX).unwrap_err().to_string();
        assert!(refused.contains("has ended"), "{refused}");
        assert_eq!(shelf.len(), 1, "query b's block stays");
    }

    #[test]
    fn operators_that_grow_spill_their_querys_blocks_to_stay_within_its_budget() {
        let shelf = BlockShelf::new(u64::MAX);
        let bytes = batch().get_array_memory_size() as u64;
        let budget = 4 * bytes;
        let keys: Vec<String> = (0..4)
            .map(|_| shelf.keep("q", batch(), budget).unwrap())
            .collect();
        let other = shelf.keep("other", batch(), budget).unwrap();
        assert_eq!(shelf.bytes_in_memory(), 5 * bytes);
        // Operators take two blocks' worth: two of q's blocks go to disk, not other's.
        shelf.operators_grew("q", 2 * bytes, budget).unwrap();
        assert_eq!(shelf.bytes_in_memory(), 3 * bytes);
        assert_eq!(shelf.blocks_spilled(), 2);
        // A new block of q does not fit beside them: it goes to disk too.
        let fifth = shelf.keep("q", batch(), budget).unwrap();
        assert_eq!(shelf.blocks_spilled(), 3);
        // Every block reads back the same, wherever it is.
        for key in keys.iter().chain([&fifth]) {
            let block = shelf.take(&ticket("q", key, true)).unwrap().unwrap();
            assert_eq!(block, batch());
        }
        assert!(
            shelf
                .take(&ticket("other", &other, true))
                .unwrap()
                .is_some()
        );
        // Operators done: the query's next block stays in memory again.
        shelf.operators_shrank("q", 2 * bytes);
        shelf.keep("q", batch(), budget).unwrap();
        assert_eq!(shelf.blocks_spilled(), 3);
    }
}
