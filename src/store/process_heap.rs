//! The process's heap, as far as its allocator tells: the bytes allocated and live now, and a
//! way to hand pages freed back to the system.
//!
//! flumen counts what it knows of: blocks (the [`crate::store::block_store::BlockStore`]) and
//! the reservations of operators. A run also holds memory nobody reserves: a Parquet reader's
//! column chunks, a map task's pieces not yet cut into blocks, the writer's row group, hash
//! maps of the store itself, the allocator's rounding. On the shuffle bench's 2 GB sort at a
//! 200 MB budget these came to 0.4x the budget on top of it. A program whose allocator can
//! count its live bytes installs a [`HeapAllocator`] ([`install`]; the `flumen` binary does,
//! for jemalloc), and each run's store then keeps in memory only what the budget leaves
//! after that unreserved memory too. Without one, a run counts what it knows of, as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What an allocator holds, as of one reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeapUsage {
    /// Bytes allocated and not yet freed, in the whole process.
    pub live: u64,
    /// Bytes of resident pages the allocator keeps free for later allocations (what
    /// [`HeapAllocator::return_freed`] would hand back).
    pub idle: u64,
}

/// What flumen asks of the process's allocator.
pub trait HeapAllocator: Send + Sync {
    /// What the allocator holds now; `None` when it cannot tell.
    fn usage(&self) -> Option<HeapUsage>;
    /// Hand pages already freed back to the operating system (called when a run counting
    /// this heap sees more than an eighth of its budget idle, and as tasks of a run that
    /// does not count it finish, at most ten times a second).
    fn return_freed(&self);
}

static INSTALLED: OnceLock<&'static dyn HeapAllocator> = OnceLock::new();

/// Tell flumen about the process's allocator, once, before the first query. False when one
/// was installed already (the first stays).
pub fn install(allocator: &'static dyn HeapAllocator) -> bool {
    INSTALLED.set(allocator).is_ok()
}

/// The installed allocator, if a program installed one.
pub(crate) fn installed() -> Option<&'static dyn HeapAllocator> {
    INSTALLED.get().copied()
}

/// Least time between two reads of the allocator's count: jemalloc merges every arena's
/// statistics to answer (read at each block put, that took 6% of a sort's CPU time).
pub(crate) const READ_INTERVAL: Duration = Duration::from_millis(2);

/// The memory an allocator holds for a run: what its live bytes grew by since the run
/// began, and the idle pages it keeps now (the budget is about memory the process holds,
/// and it holds those until handed back; idle pages left by earlier runs count too, once,
/// before they are handed back). Read at most once per interval. A reading that finds more
/// than `idle_limit` bytes idle hands them back ([`HeapAllocator::return_freed`]): between
/// the purges at task ends, jemalloc kept 87 MiB of freed pages at the peak of a 200 MB
/// sort.
pub(crate) struct HeapGauge {
    allocator: &'static dyn HeapAllocator,
    /// Live bytes when the gauge was made.
    base: u64,
    interval: Duration,
    idle_limit: u64,
    /// When the last reading was made (`None`: none yet).
    last: Mutex<Option<Instant>>,
    /// The idle bytes that reading found.
    last_idle: AtomicU64,
    /// When pages were last handed back.
    last_hand_back: Mutex<Option<Instant>>,
    /// Least time between two hand-backs ([`HAND_BACK_INTERVAL`]).
    hand_back_interval: Duration,
    /// Hand-backs so far.
    hand_backs: AtomicU64,
}

/// Idle bytes worth a purge before a store writes blocks out to make room for them.
const IDLE_WORTH_HANDING_BACK: u64 = 1 << 20;

/// Least time between two such purges: under steady pressure every put would purge, and
/// every allocation after it fault in a zeroed page (TPC-H q21 spent 1.5 s more in the
/// kernel).
const HAND_BACK_INTERVAL: Duration = Duration::from_millis(100);

impl HeapGauge {
    /// A gauge of `allocator` from now, reading it at most once per `interval`; `None` when
    /// it does not count its live bytes.
    pub(crate) fn new(
        allocator: &'static dyn HeapAllocator,
        interval: Duration,
        idle_limit: u64,
    ) -> Option<Self> {
        let base = allocator.usage()?.live;
        Some(Self {
            allocator,
            base,
            interval,
            idle_limit,
            last: Mutex::new(None),
            last_idle: AtomicU64::new(0),
            last_hand_back: Mutex::new(None),
            hand_back_interval: HAND_BACK_INTERVAL,
            hand_backs: AtomicU64::new(0),
        })
    }

    /// Bytes the allocator holds for the run (live bytes beyond those when the gauge was
    /// made, and the idle pages it keeps) when a reading is due, `None` otherwise. The first
    /// is due at once: it hands back what earlier runs left idle.
    pub(crate) fn reading(&self) -> Option<u64> {
        {
            let mut last = self.last.lock().unwrap();
            if last.is_some_and(|at| at.elapsed() < self.interval) {
                return None;
            }
            *last = Some(Instant::now());
        }
        let mut usage = self.allocator.usage()?;
        if usage.idle > self.idle_limit && self.hand_back_due() {
            self.hand_back();
            usage = self.allocator.usage()?;
        }
        Some(self.held(usage))
    }

    /// Whether the last reading found idle pages worth handing back (at least 1 MiB) and
    /// none were handed back (by a reading or for a store) in the last
    /// [`HAND_BACK_INTERVAL`].
    pub(crate) fn holds_idle_pages(&self) -> bool {
        self.last_idle.load(Ordering::Relaxed) >= IDLE_WORTH_HANDING_BACK
            && self
                .last_hand_back
                .lock()
                .unwrap()
                .is_none_or(|at| at.elapsed() >= self.hand_back_interval)
    }

    /// Whether [`HAND_BACK_INTERVAL`] has passed since the last hand-back; when it has, now
    /// is noted as the last one. An allocator whose free pages stay resident after a purge
    /// (glibc's, fragmented) is then not asked again at every reading.
    fn hand_back_due(&self) -> bool {
        let mut last = self.last_hand_back.lock().unwrap();
        if last.is_some_and(|at| at.elapsed() < self.hand_back_interval) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// Hand the idle pages back and read again, due or not: for a store about to write
    /// blocks out to make room that those pages take (they count against the budget until
    /// handed back; purged at every task's end instead, each task's allocations faulted in
    /// fresh zeroed pages).
    pub(crate) fn reading_after_hand_back(&self) -> Option<u64> {
        let now = Instant::now();
        *self.last.lock().unwrap() = Some(now);
        *self.last_hand_back.lock().unwrap() = Some(now);
        self.hand_back();
        let usage = self.allocator.usage()?;
        Some(self.held(usage))
    }

    /// The idle bytes the last reading found.
    pub(crate) fn last_idle(&self) -> u64 {
        self.last_idle.load(Ordering::Relaxed)
    }

    /// Times the allocator was asked to hand its idle pages back.
    pub(crate) fn hand_backs(&self) -> u64 {
        self.hand_backs.load(Ordering::Relaxed)
    }

    fn hand_back(&self) {
        self.hand_backs.fetch_add(1, Ordering::Relaxed);
        self.allocator.return_freed();
    }

    /// What `usage` holds for the run; notes its idle bytes.
    fn held(&self, usage: HeapUsage) -> u64 {
        self.last_idle.store(usage.idle, Ordering::Relaxed);
        usage.live.saturating_sub(self.base) + usage.idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An allocator whose live and idle bytes a test sets; handing back zeroes the idle.
    #[derive(Default)]
    struct FakeAllocator {
        live: AtomicU64,
        idle: AtomicU64,
        purges: AtomicU64,
    }

    impl HeapAllocator for FakeAllocator {
        fn usage(&self) -> Option<HeapUsage> {
            let (live, idle) = (
                self.live.load(Ordering::SeqCst),
                self.idle.load(Ordering::SeqCst),
            );
            Some(HeapUsage { live, idle })
        }
        fn return_freed(&self) {
            self.idle.store(0, Ordering::SeqCst);
            self.purges.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The gauge counts live growth since it was made plus idle pages; idle pages over the
    /// limit are handed back at the next reading (those left by earlier runs at the first),
    /// and no reading is due before the interval has passed.
    #[test]
    fn counts_growth_and_idle_pages_and_hands_back_too_many() {
        let fake: &'static FakeAllocator = Box::leak(Box::default());
        fake.live.store(1_000, Ordering::SeqCst);
        fake.idle.store(5_000, Ordering::SeqCst);
        let mut gauge = HeapGauge::new(fake, Duration::ZERO, 100).unwrap();
        gauge.hand_back_interval = Duration::ZERO;
        assert_eq!(
            gauge.reading(),
            Some(0),
            "what earlier runs left idle is handed back"
        );
        assert_eq!(fake.purges.load(Ordering::SeqCst), 1);
        fake.live.store(1_300, Ordering::SeqCst);
        fake.idle.store(80, Ordering::SeqCst);
        assert_eq!(gauge.reading(), Some(380));
        assert_eq!(
            fake.purges.load(Ordering::SeqCst),
            1,
            "80 idle bytes are under the limit"
        );
        fake.idle.store(150, Ordering::SeqCst);
        assert_eq!(gauge.reading(), Some(300));
        assert_eq!(fake.purges.load(Ordering::SeqCst), 2);
        fake.live.store(500, Ordering::SeqCst);
        assert_eq!(
            gauge.reading(),
            Some(0),
            "live bytes under the base count as none"
        );

        let slow = HeapGauge::new(fake, Duration::from_secs(3600), u64::MAX).unwrap();
        fake.live.store(900, Ordering::SeqCst);
        assert_eq!(
            slow.reading(),
            Some(400),
            "the first reading is due at once"
        );
        fake.live.store(2_000, Ordering::SeqCst);
        assert_eq!(slow.reading(), None, "the next waits for the interval");
    }

    /// Hand-backs, at a reading over the limit or for a store about to spill, come at most
    /// once per interval; a store asks only when the last reading found 1 MiB idle or more.
    #[test]
    fn hands_back_at_most_once_per_interval() {
        let fake: &'static FakeAllocator = Box::leak(Box::default());
        fake.live.store(1_000, Ordering::SeqCst);
        let gauge = HeapGauge::new(fake, Duration::ZERO, 100).unwrap();
        fake.idle.store(500, Ordering::SeqCst);
        assert_eq!(gauge.reading(), Some(0), "over the limit: handed back");
        assert!(!gauge.holds_idle_pages(), "nothing idle after it");
        fake.idle.store(2 << 20, Ordering::SeqCst);
        assert_eq!(
            gauge.reading(),
            Some(2 << 20),
            "over the limit again, within the interval: kept"
        );
        assert_eq!(fake.purges.load(Ordering::SeqCst), 1);
        assert!(
            !gauge.holds_idle_pages(),
            "2 MiB idle, but handed back within the interval"
        );
        *gauge.last_hand_back.lock().unwrap() = Some(Instant::now() - HAND_BACK_INTERVAL);
        assert!(gauge.holds_idle_pages());
        assert_eq!(gauge.reading_after_hand_back(), Some(0));
        assert_eq!(fake.purges.load(Ordering::SeqCst), 2);
        assert_eq!(gauge.hand_backs(), 2);
        assert!(!gauge.holds_idle_pages());
    }
}
