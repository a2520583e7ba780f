//! The block store: the one place that knows where each block lives: in memory under the
//! memory budget, written out to spill runs beyond it ([`crate::store::spill_runs`]), or
//! kept by the worker process that made it.
//!
//! How much memory the run may hold, and what holds it besides blocks, is its budget's
//! business ([`crate::store::memory_budget`]); which blocks leave memory first when it is
//! full, the spill candidates' ([`crate::store::spill_candidates`]). The store puts the two
//! together: a block that does not fit writes out a run of its group's newest blocks, or,
//! for a block read soon, of blocks read late.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};

use crate::config::ByteSize;
use crate::store::block::{BlockId, HeldBlock};
use crate::store::memory_budget::MemoryBudget;
use crate::store::memory_counters::MemoryCounters;
use crate::store::process_heap::HeapAllocator;
pub use crate::store::spill_candidates::ReadSoon;
use crate::store::spill_candidates::SpillCandidates;
pub use crate::store::spill_runs::SpillGroup;
use crate::store::spill_runs::{Spans, SpillRun, SpillRuns};

/// Where a block's rows are.
enum Stored {
    Memory(RecordBatch),
    /// `len` bytes at `offset` of a run's file: one Arrow IPC stream.
    Spilled {
        run: Arc<SpillRun>,
        offset: u64,
        len: u64,
    },
    Held(Arc<dyn HeldBlock>),
}

struct Entry {
    data: Stored,
    bytes: u64,
    group: SpillGroup,
}

#[derive(Default)]
struct Inner {
    blocks: HashMap<BlockId, Entry>,
    memory_bytes: u64,
    /// The blocks in memory that no spill is writing out now.
    candidates: SpillCandidates,
}

impl Inner {
    /// Store `entry` as block `id`, replacing any entry it had.
    fn insert(&mut self, id: BlockId, entry: Entry) {
        if let Some(old) = self.blocks.remove(&id) {
            self.candidates.forget(old.group, id);
        }
        if matches!(entry.data, Stored::Memory(_)) {
            self.candidates.add(entry.group, id, entry.bytes);
        }
        self.blocks.insert(id, entry);
    }

    /// Remove block `id`'s entry (its bytes in memory are the caller's to uncount).
    fn remove(&mut self, id: BlockId) -> Option<Entry> {
        let entry = self.blocks.remove(&id)?;
        self.candidates.forget(entry.group, id);
        Some(entry)
    }

    /// Blocks of `group` in memory and not being written, newest first, while their bytes
    /// stay under `bytes` (at least one); no longer candidates until written or given back
    /// ([`Self::give_back`]). Each is written as an IPC stream of its own, so their schemas
    /// need not agree.
    fn take_run(&mut self, group: SpillGroup, bytes: u64) -> Vec<(BlockId, RecordBatch)> {
        let chosen = self.candidates.take_newest(group, bytes);
        chosen
            .into_iter()
            .filter_map(|id| match self.blocks.get(&id) {
                Some(Entry {
                    data: Stored::Memory(batch),
                    ..
                }) => Some((id, batch.clone())),
                _ => None,
            })
            .collect()
    }

    /// Blocks taken for a run that was not written: candidates again, those still in memory.
    fn give_back(&mut self, batches: &[(BlockId, RecordBatch)]) {
        for (id, _) in batches {
            if let Some(entry) = self.blocks.get(id)
                && matches!(entry.data, Stored::Memory(_))
            {
                let (group, bytes) = (entry.group, entry.bytes);
                self.candidates.add(group, *id, bytes);
            }
        }
    }

    /// Point the blocks written to `run` at their `(offset, len)` there; one released or
    /// replaced meanwhile is left alone. Returns the blocks and bytes that left memory.
    fn spilled(
        &mut self,
        run: &Arc<SpillRun>,
        blocks: &[(BlockId, RecordBatch)],
        spans: &[(u64, u64)],
    ) -> (u64, u64) {
        let mut moved = (0, 0);
        for ((id, _), &(offset, len)) in blocks.iter().zip(spans) {
            let Some(group) = self.blocks.get(id).map(|e| e.group) else {
                continue;
            };
            // A copy put again meanwhile (recomputed) holds the same rows: it goes too.
            self.candidates.forget(group, *id);
            if let Some(entry) = self.blocks.get_mut(id)
                && matches!(entry.data, Stored::Memory(_))
            {
                entry.data = Stored::Spilled {
                    run: Arc::clone(run),
                    offset,
                    len,
                };
                self.memory_bytes -= entry.bytes;
                moved.0 += 1;
                moved.1 += entry.bytes;
            }
        }
        moved
    }
}

/// What held a run's budget at one moment ([`BlockStore::memory_sample`]), in bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemorySample {
    /// Blocks in memory.
    pub(crate) blocks: u64,
    /// Operators' reservations.
    pub(crate) operators: u64,
    /// Heap nobody reserved, as the allocator was last read (0 when it is not counted).
    pub(crate) unreserved: u64,
    /// Of what the allocator held then, its idle pages (counted in `unreserved`).
    pub(crate) idle: u64,
    /// Written out to spill files since the run began.
    pub(crate) spilled: u64,
}

/// Blocks of one query run, with a memory budget.
pub struct BlockStore {
    /// How much the run may hold, and what holds it besides blocks.
    budget: MemoryBudget,
    /// The files blocks are written out to.
    runs: SpillRuns,
    /// Producers whose blocks are read soon: others' spill first.
    read_soon: ReadSoon,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for BlockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStore")
            .field("budget", &self.budget())
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
            budget: MemoryBudget::new(budget),
            runs: SpillRuns::default(),
            read_soon: ReadSoon::default(),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Count the memory `allocator` holds for the run against the budget too,
    /// and have it hand back its idle pages when they pass an eighth of the budget;
    /// `None`: only blocks and operators' reservations count.
    pub fn with_heap(mut self, allocator: Option<&'static dyn HeapAllocator>) -> Self {
        self.budget = self.budget.with_heap(allocator);
        self
    }

    /// Whether the store counts the allocator's heap: then its readings hand the idle pages
    /// back once they pass an eighth of the budget, and a task's end need not purge them.
    pub(crate) fn counts_heap(&self) -> bool {
        self.budget.counts_heap()
    }

    /// Put spill files in a directory made under `root` (else the system's temp directory).
    pub fn with_spill_root(mut self, root: Option<PathBuf>) -> Self {
        self.runs = SpillRuns::new(root);
        self
    }

    /// Write out blocks of producers not in `read_soon` first ([`ReadSoon`]).
    pub fn with_read_soon(mut self, read_soon: ReadSoon) -> Self {
        self.read_soon = read_soon;
        self
    }

    /// Count the spill files it writes, and the budget's peaks, in `counters` too.
    pub fn with_counters(mut self, counters: Arc<MemoryCounters>) -> Self {
        self.budget = self.budget.with_counters(counters);
        self
    }

    /// The memory budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget.bytes()
    }

    /// Bytes of blocks held in memory now.
    pub fn memory_bytes(&self) -> u64 {
        self.inner.lock().unwrap().memory_bytes
    }

    /// Bytes the run's operators hold now (they count against the same budget).
    pub fn operator_bytes(&self) -> u64 {
        self.budget.operator_bytes()
    }

    /// What holds the budget now, for a run's timeline (`flumen.timeline_file`): blocks in
    /// memory, operators' reservations, the heap nobody reserved as last read, and the bytes
    /// written out to spill files so far.
    pub(crate) fn memory_sample(&self) -> MemorySample {
        let (unreserved, idle) = self.budget.last_unreserved();
        MemorySample {
            blocks: self.memory_bytes(),
            operators: self.operator_bytes(),
            unreserved,
            idle,
            spilled: self.runs.written_bytes(),
        }
    }

    /// Record what the run's operators hold now.
    pub fn set_operator_bytes(&self, bytes: u64) {
        self.budget.set_operator_bytes(bytes);
    }

    /// Write blocks from memory to spill runs until blocks, operator state and the heap
    /// nobody reserved ([`MemoryBudget::held`]) together fit the budget again: each run
    /// takes the group with the most bytes in memory, its newest blocks first (readers take
    /// the oldest first), up to [`MemoryBudget::run_bytes`] or what must be freed. Returns
    /// the blocks and bytes written out.
    pub fn make_room(&self) -> Result<(u64, u64)> {
        let mut written = (0, 0);
        let mut readings = self.budget.readings();
        loop {
            let (group, batches) = {
                let mut inner = self.inner.lock().unwrap();
                let held = self.budget.held(inner.memory_bytes, readings.take());
                if self.budget.fits(held, inner.memory_bytes) {
                    return Ok(written);
                }
                if readings.may_hand_back() {
                    drop(inner);
                    readings.hand_back();
                    continue;
                }
                let Some(group) = inner.candidates.fullest_group(&self.read_soon) else {
                    return Ok(written);
                };
                let bytes = (held - self.budget()).max(self.budget.run_bytes());
                (group, inner.take_run(group, bytes))
            };
            let (mut inner, spill_run, spans) = self.write_run(group, &batches)?;
            let moved = inner.spilled(&spill_run, &batches, &spans);
            written.0 += moved.0;
            written.1 += moved.1;
        }
    }

    /// Store a block of `bytes` bytes of `group`. When memory (blocks, operator state and
    /// the heap nobody reserved) would exceed the budget it spills, in one run with the
    /// newest blocks of its group still in memory. A block larger than the whole budget is
    /// an error naming `flumen.memory_budget`.
    pub fn put(
        &self,
        id: BlockId,
        batch: RecordBatch,
        bytes: u64,
        group: SpillGroup,
    ) -> Result<Placement> {
        if bytes > self.budget() {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "a block of {} rows needs {}, more than flumen.memory_budget ({}); \
                 raise flumen.memory_budget or lower flumen.target_block_rows",
                batch.num_rows(),
                ByteSize(bytes),
                ByteSize(self.budget())
            )));
        }
        let mut readings = self.budget.readings();
        let companions = loop {
            let (late, batches) = {
                let mut inner = self.inner.lock().unwrap();
                let held = self.budget.held(inner.memory_bytes, readings.take()) + bytes;
                if self.budget.fits(held, inner.memory_bytes + bytes) {
                    inner.memory_bytes += bytes;
                    let data = Stored::Memory(batch);
                    inner.insert(id, Entry { data, bytes, group });
                    return Ok(Placement::Memory);
                }
                if readings.may_hand_back() {
                    drop(inner);
                    readings.hand_back();
                    continue;
                }
                // A block read soon makes room by writing out blocks read late.
                let late = match self.read_soon.contains(group.0) {
                    true => inner.candidates.fullest_read_late(&self.read_soon),
                    false => None,
                };
                match late {
                    Some(late) => {
                        let need = (held - self.budget()).max(self.budget.run_bytes());
                        (late, inner.take_run(late, need))
                    }
                    None => {
                        break match self.budget.run_bytes().saturating_sub(bytes) {
                            0 => vec![],
                            rest => inner.take_run(group, rest),
                        };
                    }
                }
            };
            let (mut inner, spill_run, spans) = self.write_run(late, &batches)?;
            inner.spilled(&spill_run, &batches, &spans);
        };
        let mut batches = companions;
        batches.push((id, batch));
        // The new block is not in the store yet: `spilled` passes it over.
        let (mut inner, run, spans) = self.write_run(group, &batches)?;
        inner.spilled(&run, &batches, &spans);
        let (offset, len) = spans[spans.len() - 1];
        let data = Stored::Spilled { run, offset, len };
        inner.insert(id, Entry { data, bytes, group });
        Ok(Placement::Spilled)
    }

    /// Append `batches` to `group`'s spill run ([`SpillRuns::append`]), then lock the store;
    /// on failure their blocks are no longer being evicted (they stay in memory) and the
    /// error is returned.
    fn write_run(
        &self,
        group: SpillGroup,
        batches: &[(BlockId, RecordBatch)],
    ) -> Result<(MutexGuard<'_, Inner>, Arc<SpillRun>, Spans)> {
        let spilled = self.runs.append(
            group,
            batches,
            self.budget.run_cap(),
            self.budget.counters(),
        );
        let mut inner = self.inner.lock().unwrap();
        match spilled {
            Ok((run, spans)) => Ok((inner, run, spans)),
            Err(e) => {
                inner.give_back(batches);
                Err(e)
            }
        }
    }

    /// Record that a worker process keeps block `id` (its bytes are the worker's memory,
    /// not the budget's).
    pub fn put_held(&self, id: BlockId, held: Arc<dyn HeldBlock>, bytes: u64) {
        let entry = Entry {
            data: Stored::Held(held),
            bytes,
            group: (usize::MAX, 0),
        };
        self.inner.lock().unwrap().insert(id, entry);
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
        match inner.remove(id).map(|e| e.data) {
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
            inner.remove(id);
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
            inner.remove(*id);
        }
        ids
    }

    /// The data of a block stored here (in memory or spilled), or `None` when it is not
    /// (released, lost, or held by a worker: see [`Self::take_held`]).
    pub fn get(&self, id: BlockId) -> Result<Option<RecordBatch>> {
        let (run, offset, len) = {
            let inner = self.inner.lock().unwrap();
            match inner.blocks.get(&id).map(|e| &e.data) {
                None | Some(Stored::Held(_)) => return Ok(None),
                Some(Stored::Memory(b)) => return Ok(Some(b.clone())),
                Some(Stored::Spilled { run, offset, len }) => (Arc::clone(run), *offset, *len),
            }
        };
        run.read(id, offset, len)
    }

    /// Remove a block (its readers are done with it, or it is replaced by a recomputed
    /// copy); a worker holding it is told to drop it. Returns its bytes.
    pub fn remove(&self, id: BlockId) -> u64 {
        let mut inner = self.inner.lock().unwrap();
        match inner.remove(id) {
            None => 0,
            Some(entry) => {
                match entry.data {
                    Stored::Memory(_) => inner.memory_bytes -= entry.bytes,
                    // The run's file goes with its last block (`SpillRun`'s drop); a run
                    // still open for its group is closed when only the group holds it.
                    Stored::Spilled { run, .. } => {
                        if Arc::strong_count(&run) == 2 {
                            self.runs.close_if_open(entry.group, &run);
                        }
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
    use crate::store::process_heap::{HeapGauge, HeapUsage};
    use datafusion::arrow::array::Int64Array;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A batch of `n` rows of one Int64 column (tests of the store and its users).
    pub(crate) fn batch(n: i64) -> RecordBatch {
        RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from_iter_values(0..n)) as _)])
            .unwrap()
    }

    #[test]
    fn spills_beyond_budget_and_reads_back() {
        let store = BlockStore::new(1000);
        assert_eq!(
            store.put(1, batch(10), 600, (0, 0)).unwrap(),
            Placement::Memory
        );
        assert_eq!(
            store.put(2, batch(20), 600, (0, 1)).unwrap(),
            Placement::Spilled
        );
        assert_eq!(store.memory_bytes(), 600);
        assert_eq!(store.get(2).unwrap().unwrap(), batch(20));
        assert_eq!(store.remove(1), 600);
        assert_eq!(store.memory_bytes(), 0);
        assert!(store.get(1).unwrap().is_none());
    }

    /// Whether block `id` is held in memory.
    fn in_memory(store: &BlockStore, id: BlockId) -> bool {
        let inner = store.inner.lock().unwrap();
        matches!(inner.blocks[&id].data, Stored::Memory(_))
    }

    /// A block read soon that finds memory full makes room by writing out blocks read late,
    /// and is written out itself only when none is left in memory; a block read late that
    /// finds memory full is written out; `make_room` writes out blocks read late first.
    #[test]
    fn blocks_read_late_are_written_out_first() {
        // Operator 1's blocks are read soon (a run sort's input), operator 0's late.
        let read_soon = ReadSoon::new(vec![false, true]);
        let store = BlockStore::new(1000).with_read_soon(read_soon.clone());
        // Block `id` of 400 bytes into `group`, where it was placed.
        let put = |id: BlockId, group| store.put(id, batch(id as i64), 400, group).unwrap();
        assert_eq!(put(1, (0, 0)), Placement::Memory);
        assert_eq!(put(2, (1, 0)), Placement::Memory);
        assert_eq!(put(3, (1, 1)), Placement::Memory);
        assert!(!in_memory(&store, 1) && in_memory(&store, 2) && in_memory(&store, 3));
        assert_eq!(store.memory_bytes(), 800);
        assert_eq!(store.get(1).unwrap().unwrap(), batch(1));
        assert_eq!(put(4, (1, 2)), Placement::Spilled);
        assert_eq!(put(5, (0, 1)), Placement::Spilled);
        assert!(in_memory(&store, 2) && in_memory(&store, 3));

        // The largest group is read soon; the block read late goes.
        let store = BlockStore::new(1000).with_read_soon(read_soon);
        store.put(6, batch(10), 200, (0, 0)).unwrap();
        store.put(7, batch(20), 350, (1, 0)).unwrap();
        store.put(8, batch(30), 350, (1, 0)).unwrap();
        store.set_operator_bytes(300);
        assert_eq!(store.make_room().unwrap(), (1, 200));
        assert!(!in_memory(&store, 6) && in_memory(&store, 7) && in_memory(&store, 8));
    }

    /// An allocator whose live bytes a test sets.
    struct FakeHeap(AtomicU64);

    impl HeapAllocator for FakeHeap {
        fn usage(&self) -> Option<HeapUsage> {
            let live = self.0.load(Ordering::Relaxed);
            Some(HeapUsage { live, idle: 0 })
        }
        fn return_freed(&self) {}
    }

    /// Heap that grew beyond the blocks and operators' reservations takes its share of the
    /// budget (up to three quarters of it): blocks that would fit the budget alone spill,
    /// and `make_room` writes blocks out when that heap grows later. Blocks the store holds
    /// are not counted twice.
    #[test]
    fn heap_nobody_reserved_counts_against_the_budget() {
        let heap: &'static FakeHeap = Box::leak(Box::new(FakeHeap(AtomicU64::new(50_000))));
        let mut store = BlockStore::new(1000);
        store.budget = MemoryBudget::new(1000).with_gauge(HeapGauge::new(
            heap,
            std::time::Duration::ZERO,
            u64::MAX,
        ));
        // The heap grew by the block itself: nothing unreserved.
        heap.0.store(50_400, Ordering::Relaxed);
        assert_eq!(
            store.put(1, batch(10), 400, (0, 0)).unwrap(),
            Placement::Memory
        );
        // 300 more bytes live than the store holds: 400 + 300 + 400 > 1000.
        heap.0.store(51_100, Ordering::Relaxed);
        assert_eq!(
            store.put(2, batch(10), 400, (0, 1)).unwrap(),
            Placement::Spilled
        );
        assert_eq!(store.memory_bytes(), 400);
        // Without the heap's count the same block stays in memory.
        let blind = BlockStore::new(1000);
        blind.put(1, batch(10), 400, (0, 0)).unwrap();
        assert_eq!(
            blind.put(2, batch(10), 400, (0, 0)).unwrap(),
            Placement::Memory
        );
        // The unreserved heap grows to 700: block 1 is written out.
        heap.0.store(50_000 + 400 + 700, Ordering::Relaxed);
        assert_eq!(store.make_room().unwrap(), (1, 400));
        assert_eq!(store.memory_bytes(), 0);
        // A reading that still holds blocks written out since is not set against the
        // store's memory again: the heap (held fixed here, as a reading made just before
        // the spills) sees 400 bytes of blocks in two groups, 300 reserved and 400 more
        // (1,100 in all); one group written out is enough (900), not both.
        heap.0.store(50_000, Ordering::Relaxed);
        let mut stale = BlockStore::new(1000);
        stale.budget = MemoryBudget::new(1000).with_gauge(HeapGauge::new(
            heap,
            std::time::Duration::ZERO,
            u64::MAX,
        ));
        stale.put(1, batch(10), 200, (0, 0)).unwrap();
        stale.put(2, batch(10), 200, (0, 1)).unwrap();
        stale.set_operator_bytes(300);
        heap.0.store(50_000 + 1_100, Ordering::Relaxed);
        assert_eq!(stale.make_room().unwrap(), (1, 200));
        assert_eq!(stale.memory_bytes(), 200);
        // However large it grows, a quarter of the budget stays for blocks.
        heap.0.store(10_000_000, Ordering::Relaxed);
        assert_eq!(
            store.put(3, batch(10), 250, (0, 2)).unwrap(),
            Placement::Memory
        );
        assert_eq!(
            store.put(4, batch(10), 1, (0, 3)).unwrap(),
            Placement::Spilled
        );
    }

    /// However much operators hold, blocks keep a sixteenth of the budget in memory: the
    /// last few are not written out one small spill file per block put. Past it a put
    /// spills, with its group's blocks in memory, and `make_room` stops at it.
    #[test]
    fn a_sixteenth_of_the_budget_stays_for_blocks() {
        let store = BlockStore::new(16_000);
        store.set_operator_bytes(16_000);
        assert_eq!(
            store.put(1, batch(10), 600, (0, 0)).unwrap(),
            Placement::Memory
        );
        assert_eq!(
            store.put(2, batch(20), 400, (0, 1)).unwrap(),
            Placement::Memory
        );
        assert_eq!(store.make_room().unwrap(), (0, 0));
        assert_eq!(store.memory_bytes(), 1_000);
        assert_eq!(
            store.put(3, batch(30), 1, (0, 0)).unwrap(),
            Placement::Spilled
        );
        assert!(!in_memory(&store, 1) && in_memory(&store, 2));
        assert_eq!(store.get(3).unwrap().unwrap(), batch(30));
        // Over the budget with more than the floor in memory: written out down to it.
        store.set_operator_bytes(0);
        store.put(4, batch(40), 15_000, (0, 2)).unwrap();
        store.set_operator_bytes(16_000);
        assert_eq!(store.make_room().unwrap(), (1, 15_000));
        assert!(in_memory(&store, 2));
    }

    /// The files under a store's spill directory.
    fn spill_files(store: &BlockStore) -> Vec<std::path::PathBuf> {
        let Some(dir) = store.runs.dir() else {
            return vec![];
        };
        let mut files = vec![];
        // Its subdirectories (beside them, the owner's lock file).
        for sub in std::fs::read_dir(dir).unwrap() {
            let sub = sub.unwrap().path();
            if !sub.is_dir() {
                continue;
            }
            for file in std::fs::read_dir(sub).unwrap() {
                files.push(file.unwrap().path());
            }
        }
        files
    }

    /// Blocks of one group spill together as one run (one file) that reads back block by
    /// block; the file goes with its last block; a run deleted under the store loses
    /// exactly its blocks.
    #[test]
    fn a_group_spills_as_one_run() {
        let store = BlockStore::new(10 << 20);
        for id in 0..6 {
            let group = (7, (id % 2) as usize);
            store
                .put(id, batch(100 + id as i64), 1 << 20, group)
                .unwrap();
        }
        // Operators take 9 MiB: 5 MiB of blocks must go, a run at a time from the fullest
        // group (the newest on a tie), each run at least what is left to free (and at least
        // `run_bytes`, 1.25 MiB): group 1 whole, then group 0's two newest.
        store.set_operator_bytes(9 << 20);
        let (blocks, _) = store.make_room().unwrap();
        assert_eq!(blocks, 5);
        assert_eq!(spill_files(&store).len(), 2);
        for id in 0..6 {
            assert_eq!(store.get(id).unwrap().unwrap(), batch(100 + id as i64));
        }
        // The oldest block of group 0 stayed in memory.
        assert_eq!(store.memory_bytes(), 1 << 20);
        assert!(matches!(
            store.inner.lock().unwrap().blocks[&0].data,
            Stored::Memory(_)
        ));
        // Group 1's run holds blocks 5, 3, 1: its file goes with the last of them.
        store.remove(5);
        store.remove(3);
        assert_eq!(spill_files(&store).len(), 2);
        assert_eq!(store.get(1).unwrap().unwrap(), batch(101));
        store.remove(1);
        assert_eq!(spill_files(&store).len(), 1);
        // Deleting a run's file loses its blocks only.
        for file in spill_files(&store) {
            std::fs::remove_file(file).unwrap();
        }
        assert!(store.get(4).unwrap().is_none());
        assert!(store.get(2).unwrap().is_none());
        assert_eq!(store.get(0).unwrap().unwrap(), batch(100));
    }

    /// With operators holding the whole budget every block put spills by itself, yet a
    /// group's blocks append to one file until it holds `run_cap` bytes; the file goes once
    /// all its blocks have been read.
    #[test]
    fn spills_of_a_group_append_to_one_file() {
        let store = BlockStore::new(8 << 20);
        store.set_operator_bytes(8 << 20);
        // `run_cap` is 4 MiB: blocks of ~0.6 MiB (counted), 8 per group, 2 groups.
        for id in 0..16 {
            let group = (3, id as usize % 2);
            let placed = store
                .put(id, batch(100 + id as i64), 600 << 10, group)
                .unwrap();
            assert_eq!(placed, Placement::Spilled);
        }
        assert_eq!(spill_files(&store).len(), 2, "one file per group");
        for id in 0..16 {
            assert_eq!(store.get(id).unwrap().unwrap(), batch(100 + id as i64));
        }
        for id in 0..16 {
            store.remove(id);
        }
        assert_eq!(
            spill_files(&store).len(),
            0,
            "files left: {:?}",
            spill_files(&store)
        );
    }

    /// Each block of a run is an IPC stream of its own: blocks of one group with different
    /// schemas share a run and read back each with its own.
    #[test]
    fn a_run_holds_blocks_of_different_schemas() {
        let store = BlockStore::new(8 << 20);
        let other = RecordBatch::try_from_iter([(
            "s",
            Arc::new(datafusion::arrow::array::StringArray::from(vec!["a", "bc"])) as _,
        )])
        .unwrap();
        store.put(1, batch(5), 1 << 20, (2, 0)).unwrap();
        store.put(2, other.clone(), 1 << 20, (2, 0)).unwrap();
        store.set_operator_bytes(8 << 20);
        assert_eq!(store.make_room().unwrap().0, 2);
        assert_eq!(spill_files(&store).len(), 1);
        assert_eq!(store.get(1).unwrap().unwrap(), batch(5));
        assert_eq!(store.get(2).unwrap().unwrap(), other);
    }

    /// A block put when memory is full spills in one run with the newest blocks of its
    /// group, not alone.
    #[test]
    fn a_block_that_does_not_fit_takes_its_group_with_it() {
        // `run_bytes` is 2 MiB: block 4 (1 MiB) takes group 0's newest block (2) with it.
        let store = BlockStore::new(16 << 20);
        for id in 0..4 {
            store
                .put(id, batch(10), 4 << 20, (1, id as usize % 2))
                .unwrap();
        }
        assert_eq!(
            store.put(4, batch(20), 1 << 20, (1, 0)).unwrap(),
            Placement::Spilled
        );
        assert_eq!(spill_files(&store).len(), 1);
        assert_eq!(store.memory_bytes(), 12 << 20);
        assert!(matches!(
            store.inner.lock().unwrap().blocks[&2].data,
            Stored::Spilled { .. }
        ));
        assert_eq!(store.get(4).unwrap().unwrap(), batch(20));
        assert_eq!(store.get(2).unwrap().unwrap(), batch(10));
    }

    /// Several threads making room at once never write the same block twice (two writers
    /// of one spill file left it damaged or deleted): every block reads back whole.
    #[test]
    fn concurrent_evictions_leave_every_block_readable() {
        let store = Arc::new(BlockStore::new(1 << 20));
        for id in 0..200 {
            store
                .put(id, batch(1000 + id as i64), 4000, (0, id as usize % 3))
                .unwrap();
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
        let err = store
            .put(1, batch(10), 200, (0, 0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("flumen.memory_budget"), "{err}");
    }

    /// Blocks whose spill failed stay in memory and are candidates for the next run again:
    /// a second `make_room` picks them again (and fails the same way), rather than finding
    /// nothing to write.
    #[test]
    fn blocks_of_a_failed_spill_are_candidates_again() {
        let dir = tempfile::tempdir().unwrap();
        let not_a_dir = dir.path().join("a-file");
        std::fs::write(&not_a_dir, b"x").unwrap();
        let store = BlockStore::new(1000).with_spill_root(Some(not_a_dir));
        store.put(1, batch(10), 300, (0, 0)).unwrap();
        store.set_operator_bytes(900);
        for attempt in 0..2 {
            assert!(
                store.make_room().is_err(),
                "attempt {attempt} found nothing to write"
            );
            assert_eq!(store.memory_bytes(), 300);
        }
        assert_eq!(store.get(1).unwrap().unwrap(), batch(10));
        store.set_operator_bytes(0);
        assert_eq!(store.make_room().unwrap(), (0, 0));
    }
}
