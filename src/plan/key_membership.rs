//! Which keys a join's build side holds, as a Bloom filter ([`KeyMembership`]), and the test
//! of a probe row against it ([`KeysInSet`]).
//!
//! A build side of more than [`crate::plan::build_keys::MAX_LISTED_KEYS`] keys has only
//! its range in its bound, which drops no row of a key spread over its whole range (TPC-H
//! q3's 147,000 order keys among 1.5M): with worker processes every probe row was then
//! read, hash exchanged, sent and probed. Each task of the build producer also sets two
//! bits per key in a bit set ([`MembershipSummer`]); the driver takes the union of its
//! tasks' sets, and a probe scan keeps a row only where both of its key's bits are set.
//!
//! A key's bits come from DataFusion's hash of the join's key columns (the hash its join
//! matches by, so equal keys have equal bits), with a seed of our own, so that the bits
//! are not those a hash exchange partitions by. A set has a power of two of bits and the
//! bits of a key are the hash's low and high halves modulo it, so a set folds to half its
//! size by a union of its halves: a task makes its set large and folds it to the size its
//! keys need, and sets of two sizes merge at the smaller. A set never rules out a key it
//! was given (no false negative); it lets through a key it was not given with a chance of
//! about its density squared.
//!
//! A set of keys that every probe row holds (a left join's build side, a foreign key's
//! table) drops nothing and costs a hash a row, so each test counts what it keeps of its
//! first [`SAMPLE_ROWS`] rows and, where that is more than [`KEEPS_AT_MOST`], passes every
//! row after. The choice is the test's own (each task's plan has its own copy), and a
//! task run again reads its split as before, so it chooses the same.

use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{Array, ArrayRef, BooleanArray, BooleanBufferBuilder};
use datafusion::arrow::buffer::{BooleanBuffer, NullBuffer};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::ScalarValue;
use datafusion::common::hash_utils::{RandomState, create_hashes};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::ColumnarValue;
use datafusion::physical_plan::PhysicalExpr;

/// Seed of the hashes a key's bits come from (any fixed value, not the exchanges' seed).
const SEED: u64 = 0x6b65_7973_6574;

/// Most bits of a task's set (1 MiB): where it starts before folding.
pub const MAX_BITS: usize = 1 << 23;

/// Most bits of a set a task sends (256 KiB): the union of its producer's sets goes in the
/// plan of every probe split.
pub const MAX_SENT_BITS: usize = 1 << 21;

/// Rows a test keeps count of before it judges its worth.
pub const SAMPLE_ROWS: u64 = 16_384;

/// The share of its sample a test may keep and go on testing; it passes every row after a
/// sample of which it kept more (it then saved less than its hashes cost).
pub const KEEPS_AT_MOST: f64 = 0.875;

/// Fewest bits of a folded set (8 KiB).
pub const MIN_BITS: usize = 1 << 16;

/// Bits per key a task folds its set down to, counting every task of its producer as
/// holding as many keys as it does: a set of the whole build side at that many bits per
/// key is about 12% set, and lets ~1.5% of other keys through.
pub const BITS_PER_KEY: usize = 16;

/// The densest union of sets a bound still uses: above it more than a quarter of other
/// keys would pass.
pub const MAX_DENSITY: f64 = 0.5;

/// Keys a producer's tasks together hold past which a task stops making its set, as
/// counted in its own set times its producer's task count (each task taken to hold as
/// many): twice the most keys a union of [`MAX_SENT_BITS`] bits holds at [`MAX_DENSITY`]
/// (~1.45M; twice, as tasks may hold some keys alike). A denser union is never used, and
/// a set made for nothing cost a hash a build row (TPC-H q18's 1.5M order keys).
pub const MOST_SET_KEYS: f64 = 2.0 * MAX_SENT_BITS as f64 * std::f64::consts::LN_2 / 2.0;

/// Rows a task's set takes in between two counts of the keys it holds.
const ROWS_BETWEEN_COUNTS: usize = 1 << 16;

/// A set of keys' hashes: two bits per key in a power of two of bits.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct KeyMembership {
    /// The bits, 64 to a word; a power of two of words.
    words: Vec<u64>,
}

impl fmt::Debug for KeyMembership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KeyMembership({} bits, {:.3} set)",
            self.bits(),
            self.density()
        )
    }
}

impl KeyMembership {
    /// An empty set of `bits` bits (a power of two, at least 64).
    pub fn new(bits: usize) -> Self {
        assert!(bits.is_power_of_two() && bits >= 64, "{bits} bits");
        KeyMembership {
            words: vec![0; bits / 64],
        }
    }

    /// The set of no key, which merges with any other as that one ([`Self::union`]).
    pub fn empty() -> Self {
        KeyMembership::new(64)
    }

    /// Whether it holds no key.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }

    /// How many bits it has.
    pub fn bits(&self) -> usize {
        self.words.len() * 64
    }

    /// The share of its bits that are set.
    pub fn density(&self) -> f64 {
        let ones: u32 = self.words.iter().map(|w| w.count_ones()).sum();
        f64::from(ones) / self.bits() as f64
    }

    /// The two bits of a key of hash `hash`.
    fn positions(&self, hash: u64) -> [usize; 2] {
        let mask = self.bits() as u64 - 1;
        [(hash & mask) as usize, ((hash >> 32) & mask) as usize]
    }

    /// Add the keys of hashes `hashes`.
    pub fn insert(&mut self, hashes: impl IntoIterator<Item = u64>) {
        for hash in hashes {
            for bit in self.positions(hash) {
                self.words[bit / 64] |= 1 << (bit % 64);
            }
        }
    }

    /// Whether a key of hash `hash` may be in the set (`false`: it is not).
    pub fn may_hold(&self, hash: u64) -> bool {
        (self.positions(hash).into_iter()).all(|bit| self.words[bit / 64] & (1 << (bit % 64)) != 0)
    }

    /// The same set in `bits` bits (no more than it has): the union of its parts of that
    /// size.
    pub fn folded_to(mut self, bits: usize) -> Self {
        let words = (bits / 64).max(1);
        while self.words.len() > words {
            let half = self.words.len() / 2;
            let (low, high) = self.words.split_at_mut(half);
            for (l, h) in low.iter_mut().zip(high.iter()) {
                *l |= h;
            }
            self.words.truncate(half);
        }
        self
    }

    /// About how many keys it holds, from its density (each key setting two bits).
    pub fn keys_held(&self) -> f64 {
        let unset = (1.0 - self.density()).max(1.0 / self.bits() as f64);
        -(self.bits() as f64) / 2.0 * unset.ln()
    }

    /// The set a task sends: folded to [`BITS_PER_KEY`] bits for each key it holds, times
    /// `tasks` (its producer's tasks, each taken to hold as many), at least [`MIN_BITS`]
    /// and at most [`MAX_SENT_BITS`].
    pub fn folded_for(self, tasks: usize) -> Self {
        let wanted = self.keys_held() * tasks.max(1) as f64 * BITS_PER_KEY as f64;
        let bits = (wanted.ceil() as usize)
            .max(MIN_BITS)
            .next_power_of_two()
            .min(MAX_SENT_BITS)
            .min(self.bits());
        self.folded_to(bits)
    }

    /// The union of both sets, at the smaller one's size (an empty one left out).
    pub fn union(self, other: KeyMembership) -> Self {
        if other.is_empty() {
            return self;
        }
        if self.is_empty() {
            return other;
        }
        let (mut small, large) = match self.bits() <= other.bits() {
            true => (self, other),
            false => (other, self),
        };
        let large = large.folded_to(small.bits());
        for (s, l) in small.words.iter_mut().zip(large.words) {
            *s |= l;
        }
        small
    }

    /// Its bits as bytes (little endian words).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// The set of [`Self::to_bytes`]'s bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let words = bytes.len() / 8;
        if !bytes.len().is_multiple_of(8) || !words.is_power_of_two() {
            return Err(DataFusionError::Execution(format!(
                "a key set of {} bytes (not a power of two of 8-byte words)",
                bytes.len()
            )));
        }
        let words = (bytes.chunks_exact(8))
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        Ok(KeyMembership { words })
    }
}

/// The hashes of the keys `keys` (one array per key column, of equal length) into
/// `hashes`, and which rows have a key without NULL (`None`: all of them). Dictionary
/// columns are hashed as their values, so that a key hashes the same encoded or not.
pub fn key_hashes(keys: &[ArrayRef], hashes: &mut Vec<u64>) -> Result<Option<BooleanBuffer>> {
    let rows = keys.first().map_or(0, |k| k.len());
    let keys = (keys.iter())
        .map(|key| match key.data_type() {
            DataType::Dictionary(_, values) => Ok(cast(key, values)?),
            _ => Ok(Arc::clone(key)),
        })
        .collect::<Result<Vec<_>>>()?;
    hashes.clear();
    hashes.resize(rows, 0);
    create_hashes(&keys, &RandomState::with_seed(SEED), hashes)?;
    let nulls = (keys.iter()).fold(None, |all, key| {
        NullBuffer::union(all.as_ref(), key.logical_nulls().as_ref())
    });
    Ok(nulls
        .filter(|nulls| nulls.null_count() > 0)
        .map(|nulls| nulls.into_inner()))
}

/// A task's keys put in a [`KeyMembership`] as its blocks are made.
pub struct MembershipSummer {
    set: KeyMembership,
    hashes: Vec<u64>,
    /// Rows taken in since the keys it holds were last counted.
    rows_uncounted: usize,
}

impl Default for MembershipSummer {
    fn default() -> Self {
        MembershipSummer {
            set: KeyMembership::new(MAX_BITS),
            hashes: vec![],
            rows_uncounted: 0,
        }
    }
}

impl MembershipSummer {
    /// Whether the set, made for a producer of `tasks` tasks, is past use: the keys it
    /// holds, times `tasks`, are more than [`MOST_SET_KEYS`]. Counted once in
    /// `ROWS_BETWEEN_COUNTS` (65,536) rows taken in; `false` in between.
    pub fn past_use(&mut self, tasks: usize) -> bool {
        if self.rows_uncounted < ROWS_BETWEEN_COUNTS {
            return false;
        }
        self.rows_uncounted = 0;
        self.set.keys_held() * tasks.max(1) as f64 > MOST_SET_KEYS
    }

    /// Add the keys of one batch (`keys`: one array per key column); rows with a NULL key
    /// match nothing and are left out.
    pub fn observe(&mut self, keys: &[ArrayRef]) -> Result<()> {
        self.rows_uncounted += keys.first().map_or(0, |k| k.len());
        let valid = key_hashes(keys, &mut self.hashes)?;
        match valid {
            None => self.set.insert(self.hashes.iter().copied()),
            Some(valid) => self.set.insert(
                (self.hashes.iter().zip(valid.iter()))
                    .filter(|(_, v)| *v)
                    .map(|(h, _)| *h),
            ),
        }
        Ok(())
    }

    /// The set, folded for a producer of `tasks` tasks ([`KeyMembership::folded_for`]).
    pub fn finish(self, tasks: usize) -> KeyMembership {
        self.set.folded_for(tasks)
    }
}

/// `keys IN <a build side's key set>`: `true` where a row's keys may be in the set, `false`
/// where they are not or one is NULL (a probe row that cannot match); `true` for every row
/// once its sample showed it keeps most (see the module doc).
#[derive(Debug)]
pub struct KeysInSet {
    keys: Vec<Arc<dyn PhysicalExpr>>,
    set: Arc<KeyMembership>,
    /// What it kept of its first rows; a copy starts a sample of its own.
    sample: Mutex<Sample>,
}

/// What a [`KeysInSet`] kept of the rows it tested.
#[derive(Debug, Default, Clone, Copy)]
struct Sample {
    tested: u64,
    kept: u64,
    /// It kept more than [`KEEPS_AT_MOST`] of its first [`SAMPLE_ROWS`]: every row passes.
    given_up: bool,
}

impl Clone for KeysInSet {
    /// A copy with a sample of its own.
    fn clone(&self) -> Self {
        KeysInSet::new(self.keys.clone(), Arc::clone(&self.set))
    }
}

impl KeysInSet {
    /// The test of `keys` (the probe side's, in the build keys' order) against `set`.
    pub fn new(keys: Vec<Arc<dyn PhysicalExpr>>, set: Arc<KeyMembership>) -> Self {
        KeysInSet {
            keys,
            set,
            sample: Mutex::default(),
        }
    }

    /// Whether it passes every row, its sample having shown that it keeps most.
    pub fn given_up(&self) -> bool {
        self.sample.lock().unwrap().given_up
    }

    /// `expr` with each test of keys in it a copy of its own (a sample of its own), for a
    /// task's plan.
    pub fn each_its_own(expr: Arc<dyn PhysicalExpr>) -> Result<Arc<dyn PhysicalExpr>> {
        use datafusion::common::tree_node::{Transformed, TreeNode};
        let copied = expr.transform_up(|e| match e.downcast_ref::<KeysInSet>() {
            Some(test) => Ok(Transformed::yes(Arc::new(test.clone()) as _)),
            None => Ok(Transformed::no(e)),
        })?;
        Ok(copied.data)
    }

    /// The set it tests against.
    pub fn set(&self) -> &Arc<KeyMembership> {
        &self.set
    }
}

impl PartialEq for KeysInSet {
    fn eq(&self, other: &Self) -> bool {
        self.set == other.set
            && self.keys.len() == other.keys.len()
            && (self.keys.iter().zip(&other.keys)).all(|(a, b)| a.as_ref() == b.as_ref())
    }
}

impl Eq for KeysInSet {}

impl Hash for KeysInSet {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.keys.hash(state);
        self.set.bits().hash(state);
    }
}

impl fmt::Display for KeysInSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys: Vec<String> = self.keys.iter().map(|k| k.to_string()).collect();
        write!(
            f,
            "keys_in_set({}; {} bits)",
            keys.join(", "),
            self.set.bits()
        )
    }
}

impl PhysicalExpr for KeysInSet {
    fn data_type(&self, _input_schema: &Schema) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn nullable(&self, _input_schema: &Schema) -> Result<bool> {
        Ok(false)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        let mut sample = self.sample.lock().unwrap();
        if sample.given_up {
            return Ok(ColumnarValue::Scalar(ScalarValue::Boolean(Some(true))));
        }
        let keys = (self.keys.iter())
            .map(|key| key.evaluate(batch)?.into_array(batch.num_rows()))
            .collect::<Result<Vec<_>>>()?;
        let mut hashes = vec![];
        let valid = key_hashes(&keys, &mut hashes)?;
        let held = hashes.iter().map(|h| self.set.may_hold(*h));
        let mut kept = BooleanBufferBuilder::new(hashes.len());
        match valid {
            None => held.for_each(|h| kept.append(h)),
            Some(valid) => (held.zip(valid.iter())).for_each(|(h, v)| kept.append(h && v)),
        }
        let kept = BooleanArray::new(kept.finish(), None);
        if sample.tested < SAMPLE_ROWS {
            sample.tested += kept.len() as u64;
            sample.kept += kept.true_count() as u64;
            sample.given_up = sample.tested >= SAMPLE_ROWS
                && sample.kept as f64 > KEEPS_AT_MOST * sample.tested as f64;
        }
        Ok(ColumnarValue::Array(Arc::new(kept)))
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        self.keys.iter().collect()
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        Ok(Arc::new(KeysInSet::new(children, Arc::clone(&self.set))))
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{DictionaryArray, Int32Array, Int64Array, StringArray};
    use datafusion::arrow::datatypes::{Field, Int8Type};
    use datafusion::physical_expr::expressions::col;

    fn ints(values: Vec<Option<i64>>) -> ArrayRef {
        Arc::new(Int64Array::from(values))
    }

    /// A set of `keys` (one key column) as a task of a producer of `tasks` tasks sends it.
    fn set_of(keys: ArrayRef, tasks: usize) -> KeyMembership {
        let mut summer = MembershipSummer::default();
        summer.observe(&[keys]).unwrap();
        summer.finish(tasks)
    }

    #[test]
    fn every_key_put_in_is_held_and_few_others_pass() {
        let keys: Vec<i64> = (0..50_000).map(|i| i * 7).collect();
        let set = set_of(ints(keys.iter().map(|k| Some(*k)).collect()), 4);
        // 50,000 keys, 4 tasks like it, 16 bits a key: 3.2M bits, at most 2^21.
        assert_eq!(set.bits(), MAX_SENT_BITS);
        let mut hashes = vec![];
        key_hashes(
            &[ints(keys.iter().map(|k| Some(*k)).collect())],
            &mut hashes,
        )
        .unwrap();
        assert!(hashes.iter().all(|h| set.may_hold(*h)), "a false negative");
        let others: Vec<Option<i64>> = (0..100_000).map(|i| Some(i * 7 + 3)).collect();
        key_hashes(&[ints(others)], &mut hashes).unwrap();
        let passed = hashes.iter().filter(|h| set.may_hold(**h)).count();
        // One task's keys in a set sized for four (capped): ~4.7% set, ~0.2% of others pass.
        assert!(passed < 1_000, "{passed} of 100,000 other keys passed");
        // Folded to a sixteenth, still no false negative.
        let small = set.clone().folded_to(1 << 17);
        key_hashes(
            &[ints(keys.iter().map(|k| Some(*k)).collect())],
            &mut hashes,
        )
        .unwrap();
        assert!(hashes.iter().all(|h| small.may_hold(*h)));
        assert!(small.density() > set.density() * 8.0);
        assert_eq!(small.bits(), 1 << 17);
    }

    #[test]
    fn a_set_too_full_for_its_producer_is_past_use_once_its_keys_are_counted() {
        // 100,000 distinct keys a task: for 8 tasks like it, 800,000 keys (under ~1.45M);
        // for 16, 1.6M (over).
        let keys = ints((0..100_000).map(Some).collect());
        for (tasks, past_use) in [(8, false), (16, true)] {
            let mut summer = MembershipSummer::default();
            summer.observe(std::slice::from_ref(&keys)).unwrap();
            assert_eq!(summer.past_use(tasks), past_use, "{tasks} tasks");
        }
        // Counted only once in 65,536 rows: 60,000 are not counted yet, and the same 60,000
        // again are, but hold no more keys.
        let few = ints((0..60_000).map(Some).collect());
        let mut summer = MembershipSummer::default();
        summer.observe(std::slice::from_ref(&few)).unwrap();
        assert!(!summer.past_use(1_000), "counted before 65,536 rows");
        summer.observe(std::slice::from_ref(&few)).unwrap();
        assert!(summer.past_use(1_000), "60,000 keys for 1,000 tasks");
        assert!(!summer.past_use(1_000), "counted again at once");
    }

    #[test]
    fn sets_of_two_sizes_merge_at_the_smaller_and_hold_both() {
        let first = set_of(ints((0..1_000).map(Some).collect()), 1);
        let second = set_of(ints((5_000..200_000).map(Some).collect()), 1);
        assert_eq!(first.bits(), MIN_BITS);
        assert!(second.bits() > first.bits());
        let union = first.clone().union(second.clone());
        assert_eq!(union.bits(), MIN_BITS);
        assert_eq!(second.clone().union(first.clone()), union);
        let mut hashes = vec![];
        key_hashes(
            &[ints((0..1_000).chain(5_000..200_000).map(Some).collect())],
            &mut hashes,
        )
        .unwrap();
        assert!(hashes.iter().all(|h| union.may_hold(*h)));
        assert_eq!(KeyMembership::from_bytes(&union.to_bytes()).unwrap(), union);
        assert!(KeyMembership::from_bytes(&[0; 24]).is_err());
    }

    #[test]
    fn a_probe_row_passes_where_its_key_may_be_held_and_never_with_a_null() {
        let build = set_of(ints(vec![Some(3), None, Some(12), Some(7)]), 1);
        let probe = Schema::new(vec![Field::new("p", DataType::Int64, true)]);
        let test = KeysInSet::new(vec![col("p", &probe).unwrap()], Arc::new(build));
        let batch = RecordBatch::try_new(
            Arc::new(probe),
            vec![ints(vec![Some(3), Some(4), Some(7), None, Some(12)])],
        )
        .unwrap();
        let kept = test.evaluate(&batch).unwrap().into_array(5).unwrap();
        let kept = kept.as_any().downcast_ref::<BooleanArray>().unwrap();
        assert_eq!(kept.null_count(), 0);
        assert!(kept.value(0) && kept.value(2) && kept.value(4));
        assert!(!kept.value(3), "a NULL key passed");
        assert!(test.to_string().starts_with("keys_in_set(p@0; 65536 bits)"));
    }

    #[test]
    fn a_test_that_keeps_most_of_its_sample_passes_every_row_after_it() {
        let probe = Schema::new(vec![Field::new("p", DataType::Int64, true)]);
        let keys = vec![col("p", &probe).unwrap()];
        let batch_of = |from: i64| {
            let rows = (from..from + 8_192).map(Some).collect();
            RecordBatch::try_new(Arc::new(probe.clone()), vec![ints(rows)]).unwrap()
        };
        let passed = |test: &KeysInSet, batch: &RecordBatch| {
            let kept = test.evaluate(batch).unwrap().into_array(8_192).unwrap();
            kept.as_any()
                .downcast_ref::<BooleanArray>()
                .unwrap()
                .true_count()
        };
        // Every key of the first 16,384 rows is held (and a few others): given up after them.
        let held = Arc::new(set_of(ints((0..16_384).map(Some).collect()), 1));
        let most = KeysInSet::new(keys.clone(), Arc::clone(&held));
        assert_eq!(passed(&most, &batch_of(0)), 8_192);
        assert!(!most.given_up());
        assert_eq!(passed(&most, &batch_of(8_192)), 8_192);
        assert!(most.given_up());
        // Rows of keys it does not hold pass now.
        assert_eq!(passed(&most, &batch_of(1_000_000)), 8_192);
        // A copy judges afresh: those rows are dropped.
        let copy = KeysInSet::each_its_own(Arc::new(most.clone())).unwrap();
        let copy = copy.downcast_ref::<KeysInSet>().unwrap();
        assert!(!copy.given_up());
        assert!(passed(copy, &batch_of(1_000_000)) < 100);
        // A test that drops most of its sample goes on testing.
        let few = KeysInSet::new(keys, held);
        assert!(passed(&few, &batch_of(1_000_000)) < 100);
        assert!(passed(&few, &batch_of(2_000_000)) < 100);
        assert!(!few.given_up());
        assert_eq!(passed(&few, &batch_of(0)), 8_192);
    }

    #[test]
    fn two_key_columns_and_a_dictionary_hash_as_their_values() {
        let names: ArrayRef = Arc::new(StringArray::from(vec!["a", "b", "c"]));
        let days: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3]));
        let mut summer = MembershipSummer::default();
        summer
            .observe(&[Arc::clone(&names), Arc::clone(&days)])
            .unwrap();
        let set = summer.finish(1);
        let encoded: DictionaryArray<Int8Type> = vec!["c", "a", "b"].into_iter().collect();
        let mut hashes = vec![];
        let shuffled: ArrayRef = Arc::new(Int32Array::from(vec![3, 1, 1]));
        key_hashes(&[Arc::new(encoded), shuffled], &mut hashes).unwrap();
        // (c, 3) and (a, 1) were put in; (b, 1) was not.
        assert!(set.may_hold(hashes[0]) && set.may_hold(hashes[1]));
        assert!(!set.may_hold(hashes[2]));
    }
}
