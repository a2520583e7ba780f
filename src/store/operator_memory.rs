//! One memory budget for blocks and operator state: the DataFusion [`MemoryPool`] a run's
//! tasks allocate from (hash tables of joins and aggregates, sort buffers), sized to
//! `flumen.memory_budget` and shared with the run's [`BlockStore`].
//!
//! Operators share the budget much as DataFusion's `FairSpillPool` shares it: each spilling
//! operator (sort, aggregate) gets an equal part of what non-spilling ones left, and
//! non-spilling ones (a hash join's build side, a sort's merge buffers) take what they
//! need, first come first served. Unlike `FairSpillPool`, spilling operators together stay
//! under [`SPILLING_SHARE`] of the budget (a sort that filled the pool could otherwise not
//! get the few buffers its final merge needs), each always gets at least half an equal part
//! of that share, and nothing passes the budget. Whatever operators
//! hold, the block store does not keep in memory: a block put while they hold it spills,
//! and when an operator grows past what the blocks left free, blocks in memory are written
//! out ([`BlockStore::make_room`]) until blocks and operator state together fit the budget.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{
    MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};

use crate::config::ByteSize;
use crate::store::block_store::BlockStore;
use crate::store::memory_counters::MemoryCounters;

/// Least memory operators get, whatever the budget: a `TopK` or an ungrouped aggregate needs
/// a few batches, and blocks (which spill) are what a tiny budget is for.
pub const MIN_OPERATOR_BYTES: u64 = 8 << 20;

/// Share of the budget operators that can spill may hold together.
pub const SPILLING_SHARE: f64 = 0.75;

/// The memory pool of one run's operators (see the module doc).
#[derive(Debug)]
pub struct OperatorMemory {
    budget: u64,
    held: Mutex<Held>,
    store: Arc<BlockStore>,
    counters: Arc<MemoryCounters>,
}

/// Bytes operators hold, by whether they can spill.
#[derive(Debug, Default)]
struct Held {
    spilling_consumers: u64,
    spillable: u64,
    unspillable: u64,
    /// What each operator that cannot spill holds, by consumer id (named in errors).
    unspillable_by: HashMap<usize, (String, u64)>,
}

impl Held {
    fn total(&self) -> u64 {
        self.spillable + self.unspillable
    }

    fn add(&mut self, consumer: &MemoryConsumer, bytes: u64) {
        if consumer.can_spill() {
            self.spillable += bytes;
        } else {
            self.unspillable += bytes;
            let entry = self
                .unspillable_by
                .entry(consumer.id())
                .or_insert_with(|| (consumer.name().to_string(), 0));
            entry.1 += bytes;
        }
    }

    fn remove(&mut self, consumer: &MemoryConsumer, bytes: u64) {
        if consumer.can_spill() {
            self.spillable = self.spillable.saturating_sub(bytes);
        } else {
            self.unspillable = self.unspillable.saturating_sub(bytes);
            if let Some(entry) = self.unspillable_by.get_mut(&consumer.id()) {
                entry.1 = entry.1.saturating_sub(bytes);
                if entry.1 == 0 {
                    self.unspillable_by.remove(&consumer.id());
                }
            }
        }
    }

    /// The operators that cannot spill holding most, as `name (bytes)`.
    fn largest_unspillable(&self) -> String {
        let mut held: Vec<_> = self.unspillable_by.values().collect();
        held.sort_by_key(|(_, bytes)| std::cmp::Reverse(*bytes));
        let named: Vec<String> = held
            .iter()
            .take(3)
            .map(|(name, bytes)| format!("{name} {}", ByteSize(*bytes)))
            .collect();
        named.join(", ")
    }
}

impl OperatorMemory {
    /// A pool of `store`'s budget (at least [`MIN_OPERATOR_BYTES`]), making room in `store`
    /// as operators grow; what it does is counted in `counters`.
    pub fn new(store: Arc<BlockStore>, counters: Arc<MemoryCounters>) -> Self {
        let budget = store.budget().max(MIN_OPERATOR_BYTES);
        Self {
            budget,
            held: Mutex::new(Held::default()),
            store,
            counters,
        }
    }

    /// Bytes operators hold now.
    fn total(&self) -> u64 {
        self.held.lock().unwrap().total()
    }

    /// Tell the store what operators hold now, and spill blocks it no longer has room for.
    fn grown(&self) -> Result<()> {
        let held = self.total();
        let c = &self.counters;
        c.peak_operator_bytes.fetch_max(held, Ordering::Relaxed);
        self.store.set_operator_bytes(held);
        let (blocks, bytes) = self.store.make_room()?;
        c.blocks_evicted.fetch_add(blocks, Ordering::Relaxed);
        c.bytes_evicted.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }
}

impl fmt::Display for OperatorMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "flumen operator memory ({} of flumen.memory_budget {})",
            ByteSize(self.total()),
            ByteSize(self.budget)
        )
    }
}

impl MemoryPool for OperatorMemory {
    fn name(&self) -> &str {
        "flumen"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        if consumer.can_spill() {
            self.held.lock().unwrap().spilling_consumers += 1;
        }
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        if consumer.can_spill() {
            let mut held = self.held.lock().unwrap();
            held.spilling_consumers = held.spilling_consumers.saturating_sub(1);
        }
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.held
            .lock()
            .unwrap()
            .add(reservation.consumer(), additional as u64);
        if let Err(e) = self.grown() {
            log::warn!("{e}");
        }
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        let total = {
            let mut held = self.held.lock().unwrap();
            held.remove(reservation.consumer(), shrink as u64);
            held.total()
        };
        self.store.set_operator_bytes(total);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        let (refused, unspillable) = {
            let mut held = self.held.lock().unwrap();
            let additional = additional as u64;
            let available = if reservation.consumer().can_spill() {
                // An equal part of what operators that cannot spill left, but never less
                // than half an equal part of the spilling share: a sort's merge holds its
                // sorted data as memory that cannot spill, and would otherwise starve the
                // sort beside it of room for even one batch. The budget caps both.
                let spilling = (self.budget as f64 * SPILLING_SHARE) as u64;
                let consumers = held.spilling_consumers.max(1);
                let share = (spilling.saturating_sub(held.unspillable) / consumers)
                    .max(spilling / (2 * consumers));
                share
                    .saturating_sub(reservation.size() as u64)
                    .min(self.budget.saturating_sub(held.total()))
            } else {
                self.budget.saturating_sub(held.total())
            };
            if additional <= available {
                held.add(reservation.consumer(), additional);
                (None, String::new())
            } else {
                let unspillable = format!(
                    "{}: {}",
                    ByteSize(held.unspillable),
                    held.largest_unspillable()
                );
                (Some(available), unspillable)
            }
        };
        if let Some(available) = refused {
            self.counters.refusals.fetch_add(1, Ordering::Relaxed);
            return Err(DataFusionError::ResourcesExhausted(format!(
                "{} could not get {} more (it holds {}, {} available to it; operators that \
                 cannot spill hold {}): flumen.memory_budget is {}; operators that cannot spill, such as a hash \
                 join's build side, must fit one partition's input; raise flumen.memory_budget",
                reservation.consumer().name(),
                ByteSize(additional as u64),
                ByteSize(reservation.size() as u64),
                ByteSize(available),
                unspillable,
                ByteSize(self.budget)
            )));
        }
        self.grown()
    }

    fn reserved(&self) -> usize {
        self.total() as usize
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(usize::try_from(self.budget).unwrap_or(usize::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::block_store::tests::batch;

    #[test]
    fn operators_push_blocks_out_of_memory() {
        let store = Arc::new(BlockStore::new(100_000));
        let counters = Arc::new(MemoryCounters::default());
        let pool: Arc<dyn MemoryPool> = Arc::new(OperatorMemory::new(
            Arc::clone(&store),
            Arc::clone(&counters),
        ));
        for id in 0..8 {
            store.put(id, batch(1000), 10_000, (0, 0)).unwrap();
        }
        assert_eq!(store.memory_bytes(), 80_000);
        let reservation = MemoryConsumer::new("join").register(&pool);
        reservation.try_grow(50_000).unwrap();
        // Blocks and operator state together stay within the budget; every block still reads.
        assert!(store.memory_bytes() + 50_000 <= 100_000, "{store:?}");
        for id in 0..8 {
            assert_eq!(store.get(id).unwrap().unwrap().num_rows(), 1000);
        }
        // A block put now spills: operators hold half the budget.
        store.put(8, batch(1000), 10_000, (0, 0)).unwrap();
        assert!(store.memory_bytes() + 50_000 <= 100_000);
        // Past the budget (at least MIN_OPERATOR_BYTES) the operator is refused, with a
        // message naming the setting.
        let err = reservation
            .try_grow(MIN_OPERATOR_BYTES as usize)
            .unwrap_err()
            .to_string();
        assert!(err.contains("flumen.memory_budget"), "{err}");
        drop(reservation);
        assert_eq!(pool.reserved(), 0);
        let [peak, refusals, evicted, _] = counters.snapshot();
        assert_eq!((peak, refusals), (50_000, 1));
        assert!(evicted >= 3, "{evicted} blocks evicted");
    }
}
