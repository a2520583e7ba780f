//! A block's digest: a hash of its rows' values, in order, the same wherever and however
//! the rows are laid out (sliced, compacted, dictionary-encoded or not). A recomputed block
//! must have its original's digest: a task whose output changes from run to run (`random()`,
//! `now()`) cannot stand in for the rows a reader may already have seen.
//!
//! Taken where a block can be lost and recomputed without the query failing: on the CPU
//! worker that cut it (a worker dies; its blocks are recomputed elsewhere). A block kept in
//! the driver's memory is lost only with the driver; a spilled one, and a model's output
//! (whose floats differ in their last bits with how its rows were batched into forward
//! passes), are still checked by their row count.

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::hash_utils::{RandomState, create_hashes};

/// Seed of the row hashes (any fixed value: driver and workers run the same build).
const SEED: u64 = 0x666c_756d_656e;

/// The digest of `batch`'s rows; `None` for a column type DataFusion cannot hash.
pub fn digest(batch: &RecordBatch) -> Option<u64> {
    let state = RandomState::with_seed(SEED);
    let mut hashes = vec![0u64; batch.num_rows()];
    create_hashes(batch.columns(), &state, &mut hashes).ok()?;
    // Folded in order: the same rows in another order are another block.
    let folded = hashes.iter().fold(batch.num_rows() as u64, |acc, h| {
        (acc.rotate_left(27) ^ h).wrapping_mul(0x0000_0100_0000_01b3)
    });
    Some(folded)
}

/// How a block made again, `(rows, digest)`, differs from the one recorded at its place;
/// `None` when it does not (a digest missing on either side compares the rows' count only).
pub fn differs(recorded: (usize, Option<u64>), again: (usize, Option<u64>)) -> Option<String> {
    if recorded.0 != again.0 {
        return Some(format!("{} rows, not {}", again.0, recorded.0));
    }
    match (recorded.1, again.1) {
        (Some(was), Some(is)) if was != is => Some(format!(
            "the same {} rows with other values (digest {is:016x}, not {was:016x})",
            again.0
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{ArrayRef, DictionaryArray, Int64Array, StringArray};
    use datafusion::arrow::datatypes::Int32Type;

    use super::*;

    fn batch(ids: Vec<i64>, names: ArrayRef) -> RecordBatch {
        RecordBatch::try_from_iter([
            ("id", Arc::new(Int64Array::from(ids)) as ArrayRef),
            ("name", names),
        ])
        .unwrap()
    }

    #[test]
    fn the_same_rows_give_the_same_digest_however_they_are_laid_out() {
        let names: ArrayRef = Arc::new(StringArray::from(vec!["a", "b", "a"]));
        let plain = batch(vec![1, 2, 3], names);
        // The same rows as a slice of a larger batch.
        let wider = batch(
            vec![0, 1, 2, 3],
            Arc::new(StringArray::from(vec!["z", "a", "b", "a"])),
        );
        assert_eq!(digest(&plain), digest(&wider.slice(1, 3)));
        let dictionary: DictionaryArray<Int32Type> = vec!["a", "b", "a"].into_iter().collect();
        let as_dictionary = batch(vec![1, 2, 3], Arc::new(dictionary));
        assert_eq!(digest(&plain), digest(&as_dictionary), "dictionary-encoded");
    }

    #[test]
    fn other_values_or_another_order_give_another_digest() {
        let names = || -> ArrayRef { Arc::new(StringArray::from(vec!["a", "b", "a"])) };
        let plain = digest(&batch(vec![1, 2, 3], names())).unwrap();
        assert_ne!(plain, digest(&batch(vec![1, 2, 4], names())).unwrap());
        assert_ne!(plain, digest(&batch(vec![3, 2, 1], names())).unwrap());
        let swapped: ArrayRef = Arc::new(StringArray::from(vec!["b", "a", "a"]));
        assert_ne!(plain, digest(&batch(vec![1, 2, 3], swapped)).unwrap());
        assert_ne!(
            plain,
            digest(&batch(
                vec![1, 2],
                Arc::new(StringArray::from(vec!["a", "b"]))
            ))
            .unwrap()
        );
    }
}
