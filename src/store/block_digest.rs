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

use datafusion::arrow::array::{Array, ArrayRef};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::hash_utils::{RandomState, create_hashes};
use twox_hash::XxHash3_64;

/// Seed of the row hashes (any fixed value: driver and workers run the same build).
const SEED: u64 = 0x666c_756d_656e;

/// The digest of `batch`'s rows; `None` for a column type DataFusion cannot hash.
///
/// Column by column, in order: a fixed-width column without nulls by its values' bytes
/// (XXH3 over the rows' slice of its buffer: ~10x faster than hashing row by row, and most
/// columns of a join's or an exchange's blocks are such), any other by its rows' hashes
/// folded in order. A dictionary-encoded column is read as its values, so that it digests
/// as the same column unencoded.
pub fn digest(batch: &RecordBatch) -> Option<u64> {
    let state = RandomState::with_seed(SEED);
    let mut hashes = vec![];
    let mut folded = batch.num_rows() as u64;
    for column in batch.columns() {
        let unpacked;
        let column = match column.data_type() {
            DataType::Dictionary(_, values) => {
                unpacked = cast(column, values).ok()?;
                &unpacked
            }
            _ => column,
        };
        let column_digest = match fixed_width_digest(column) {
            Some(digest) => digest,
            None => {
                hashes.clear();
                hashes.resize(column.len(), 0);
                create_hashes(std::slice::from_ref(column), &state, &mut hashes).ok()?;
                fold(column.len() as u64, &hashes)
            }
        };
        folded = fold(folded, &[column_digest]);
    }
    Some(folded)
}

/// XXH3 of the bytes of `column`'s rows where it is a fixed-width column without nulls (the
/// slice of its values buffer its rows reach, wherever the array starts in it); `None`
/// otherwise.
fn fixed_width_digest(column: &ArrayRef) -> Option<u64> {
    if column.null_count() > 0 {
        return None;
    }
    let width = column.data_type().primitive_width()?;
    let data = column.to_data();
    let buffer = data.buffers().first()?;
    let (start, end) = (data.offset() * width, (data.offset() + data.len()) * width);
    let bytes = buffer.as_slice().get(start..end)?;
    Some(XxHash3_64::oneshot_with_seed(SEED, bytes))
}

/// `hashes` folded into `acc` in order: the same values in another order fold to another
/// value.
fn fold(acc: u64, hashes: &[u64]) -> u64 {
    hashes.iter().fold(acc, |acc, h| {
        (acc.rotate_left(27) ^ h).wrapping_mul(0x0000_0100_0000_01b3)
    })
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
    fn fixed_width_columns_digest_by_their_rows_alone() {
        use datafusion::arrow::array::{Decimal128Array, Int32Array};
        let decimals = |values: Vec<i128>| -> ArrayRef {
            Arc::new(
                Decimal128Array::from(values)
                    .with_precision_and_scale(15, 2)
                    .unwrap(),
            )
        };
        let wide = RecordBatch::try_from_iter([
            (
                "id",
                Arc::new(Int64Array::from(vec![9, 1, 2, 3, 9])) as ArrayRef,
            ),
            ("price", decimals(vec![7, 10, 20, 30, 7])),
        ])
        .unwrap();
        let compact = RecordBatch::try_from_iter([
            ("id", Arc::new(Int64Array::from(vec![1, 2, 3])) as ArrayRef),
            ("price", decimals(vec![10, 20, 30])),
        ])
        .unwrap();
        assert_eq!(
            digest(&wide.slice(1, 3)),
            digest(&compact),
            "a slice at an offset"
        );
        let other = RecordBatch::try_from_iter([
            ("id", Arc::new(Int64Array::from(vec![1, 2, 3])) as ArrayRef),
            ("price", decimals(vec![10, 20, 31])),
        ])
        .unwrap();
        assert_ne!(digest(&other), digest(&compact));
        // Columns swapped are other rows.
        let swapped = RecordBatch::try_from_iter([
            ("a", Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef),
            ("b", Arc::new(Int64Array::from(vec![3, 4])) as ArrayRef),
        ])
        .unwrap();
        let unswapped = RecordBatch::try_from_iter([
            ("a", Arc::new(Int64Array::from(vec![3, 4])) as ArrayRef),
            ("b", Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef),
        ])
        .unwrap();
        assert_ne!(digest(&swapped), digest(&unswapped));
        // Nulls: what a null slot holds underneath does not count.
        let with_nulls = |values: Vec<i64>| {
            let ids = Int64Array::new(values.into(), Some(vec![true, false, true].into()));
            RecordBatch::try_from_iter([("id", Arc::new(ids) as ArrayRef)]).unwrap()
        };
        assert_eq!(
            digest(&with_nulls(vec![1, 5, 3])),
            digest(&with_nulls(vec![1, 6, 3]))
        );
        assert_ne!(
            digest(&with_nulls(vec![1, 5, 3])),
            digest(&with_nulls(vec![1, 5, 4]))
        );
        // A dictionary of numbers digests as its values.
        let keys: DictionaryArray<Int32Type> = DictionaryArray::new(
            Int32Array::from(vec![1, 0, 1]),
            Arc::new(Int64Array::from(vec![7, 8])),
        );
        let as_dictionary =
            RecordBatch::try_from_iter([("id", Arc::new(keys) as ArrayRef)]).unwrap();
        let plain = RecordBatch::try_from_iter([(
            "id",
            Arc::new(Int64Array::from(vec![8, 7, 8])) as ArrayRef,
        )])
        .unwrap();
        assert_eq!(digest(&as_dictionary), digest(&plain));
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
