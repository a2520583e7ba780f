//! What a block's rows hold in memory: [`compact`] gives a block that holds only the bytes
//! its rows reach, and those bytes, which the block store counts against the budget.
//!
//! A block cut from a larger batch shares that batch's buffers: a slice, one output
//! partition's piece of an exchange's map side (DataFusion's partitioner takes the whole
//! input batch in partition order and slices it), a `substr` of a view column. Held in the
//! store it keeps the whole parent alive while counting as its own rows: the few rows each
//! map task leaves in each range at its end pinned whole input batches, and a 2 GB sort
//! under a 200 MB budget held 1.7x the budget in live heap. Arrow IPC would also send a
//! view column's parent buffers whole.

use std::sync::Arc;

use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, GenericByteViewArray, MutableArrayData, OffsetSizeTrait, make_array,
};
use datafusion::arrow::buffer::ScalarBuffer;
use datafusion::arrow::datatypes::{ByteViewType, DataType};
use datafusion::arrow::record_batch::RecordBatch;

/// Bytes `column`'s rows reach: only the slice of each buffer the rows reach, for string
/// and binary views only the values they point at, and for lists and maps only the child
/// rows their offsets span (Arrow's `get_slice_memory_size` counts a list slice's whole
/// child: one row of `array_agg` cut from a batch of many groups counted them all).
fn reached_bytes(column: &ArrayRef) -> u64 {
    let nulls = column.nulls().map_or(0, |_| column.len().div_ceil(8)) as u64;
    match column.data_type() {
        DataType::Utf8View | DataType::BinaryView => {
            let views = match column.data_type() {
                DataType::Utf8View => column.as_string_view().views().clone(),
                _ => column.as_binary_view().views().clone(),
            };
            let long: u64 = views
                .iter()
                .map(|v| *v as u32)
                .filter(|len| *len > 12)
                .map(u64::from)
                .sum();
            views.len() as u64 * 16 + long + column.len().div_ceil(8) as u64
        }
        DataType::List(_) => nulls + list_reached_bytes::<i32>(column),
        DataType::LargeList(_) => nulls + list_reached_bytes::<i64>(column),
        DataType::Map(_, _) => {
            let map = column.as_map();
            let offsets = map.value_offsets();
            let (start, end) = (offsets[0] as usize, offsets[map.len()] as usize);
            let entries: ArrayRef = Arc::new(map.entries().slice(start, end - start));
            offsets.len() as u64 * 4 + nulls + reached_bytes(&entries)
        }
        // A struct's slice slices its fields, which may be lists themselves.
        DataType::Struct(_) => {
            let fields = column.as_struct().columns().iter().map(reached_bytes);
            nulls + fields.sum::<u64>()
        }
        _ => column
            .to_data()
            .get_slice_memory_size()
            .unwrap_or_else(|_| column.get_array_memory_size()) as u64,
    }
}

/// Bytes a list column's offsets and the child rows they span reach (its nulls apart).
fn list_reached_bytes<O: OffsetSizeTrait>(column: &ArrayRef) -> u64 {
    let list = column.as_list::<O>();
    let offsets = list.value_offsets();
    let (start, end) = (offsets[0].as_usize(), offsets[list.len()].as_usize());
    let child = list.values().slice(start, end - start);
    size_of_val(offsets) as u64 + reached_bytes(&child)
}

/// Bytes `batch`'s rows reach (what Arrow IPC sends of it, near enough): unlike
/// `get_array_memory_size`, a column sharing a larger buffer (a slice, a batch decoded
/// from one IPC message, whose columns all point into its body) counts only its rows.
pub fn rows_bytes(batch: &RecordBatch) -> u64 {
    batch.columns().iter().map(reached_bytes).sum()
}

/// Bytes beyond its rows' that a column may share before [`compact`] copies it: below it,
/// the copy would save less than it costs.
const SHARED_SLACK_BYTES: u64 = 16 << 10;

/// `batch` with every column that holds over twice the bytes its rows reach (and at least
/// [`SHARED_SLACK_BYTES`] more) copied into buffers of its own, so that what the block
/// store counts is what it holds (`batch` itself when no column does), and the bytes its
/// rows reach (at least 1), measured on the way.
pub fn compact(batch: RecordBatch) -> (RecordBatch, u64) {
    let mut changed = false;
    let mut bytes = 0;
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .map(|column| {
            let held = column.get_array_memory_size() as u64;
            let reached = reached_bytes(column);
            bytes += reached;
            if held > 2 * reached && held - reached > SHARED_SLACK_BYTES {
                changed = true;
                copied(column)
            } else {
                Arc::clone(column)
            }
        })
        .collect();
    let bytes = bytes.max(1);
    if !changed {
        return (batch, bytes);
    }
    let compacted = RecordBatch::try_new(batch.schema(), columns).unwrap_or(batch);
    (compacted, bytes)
}

/// `array` with its views in a buffer of their own. Arrow's `gc` keeps the views buffer it
/// was given where no row reaches a data buffer (every value inline, 12 bytes or less), with
/// all its capacity: 10 rows of a TopK, coalesced in a buffer made for 8,192, held 128 KB.
/// Views already in a buffer their size (as `gc` makes where a row reaches a data buffer)
/// are kept.
fn own_views<T: ByteViewType + ?Sized>(array: GenericByteViewArray<T>) -> GenericByteViewArray<T> {
    // A buffer's allocation is rounded up to 64 bytes.
    let needed = (array.len() * size_of::<u128>()).next_multiple_of(64);
    if array.views().inner().capacity() <= needed {
        return array;
    }
    let views: ScalarBuffer<u128> = array.views().iter().copied().collect();
    let (_, buffers, nulls) = array.into_parts();
    // The same views over the same buffers: as valid as they were.
    unsafe { GenericByteViewArray::new_unchecked(views, buffers, nulls) }
}

/// `column`'s rows in buffers of their own.
fn copied(column: &ArrayRef) -> ArrayRef {
    match column.data_type() {
        DataType::Utf8View => Arc::new(own_views(column.as_string_view().gc())),
        DataType::BinaryView => Arc::new(own_views(column.as_binary_view().gc())),
        _ => {
            let data = column.to_data();
            let mut copy = MutableArrayData::new(vec![&data], false, data.len());
            match copy.try_extend(0, 0, data.len()) {
                Ok(()) => make_array(copy.freeze()),
                // Offsets that overflow cannot come from copying one array's own rows.
                Err(_) => Arc::clone(column),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{
        FixedSizeBinaryArray, Int32Array, ListArray, StringViewArray, StructArray,
    };
    use datafusion::arrow::datatypes::Int64Type;
    use datafusion::arrow::datatypes::{Field, Schema};
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_plan::Partitioning;
    use datafusion::physical_plan::metrics::Time;
    use datafusion::physical_plan::repartition::BatchPartitioner;

    /// Bytes `batch`'s rows reach.
    fn block_bytes(batch: &RecordBatch) -> u64 {
        batch
            .columns()
            .iter()
            .map(reached_bytes)
            .sum::<u64>()
            .max(1)
    }

    fn records(rows: usize) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int32, false),
            Field::new("payload", DataType::FixedSizeBinary(90), false),
        ]));
        let payload: Vec<[u8; 90]> = (0..rows).map(|i| [(i % 251) as u8; 90]).collect();
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int32Array::from_iter_values(0..rows as i32)),
                Arc::new(FixedSizeBinaryArray::try_from_iter(payload.iter()).unwrap()),
            ],
        )
        .unwrap()
    }

    #[test]
    fn a_sliced_view_column_keeps_only_its_own_bytes() {
        let long: Vec<String> = (0..1000).map(|i| format!("{i:0>100}")).collect();
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int32, false),
            Field::new("s", DataType::Utf8View, false),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int32Array::from_iter_values(0..1000)),
                Arc::new(StringViewArray::from_iter_values(&long)),
            ],
        )
        .unwrap();
        let slice = batch.slice(10, 5);
        let before = slice.get_array_memory_size();
        let (compact, _) = compact(slice.clone());
        assert_eq!(compact, slice);
        assert!(
            compact.get_array_memory_size() * 10 < before,
            "{} bytes after, {before} before",
            compact.get_array_memory_size()
        );
        assert_eq!(compact.column(1).len(), 5);
    }

    #[test]
    fn a_sliced_list_column_counts_and_keeps_only_its_own_values() {
        // One group's `array_agg` cut from a batch of 1,000 groups of 100 values each.
        let lists = ListArray::from_iter_primitive::<Int64Type, _, _>(
            (0..1000).map(|g| Some((0..100).map(move |i| Some(g * 100 + i)))),
        );
        let schema = Arc::new(Schema::new(vec![Field::new(
            "v",
            lists.data_type().clone(),
            true,
        )]));
        let batch = RecordBatch::try_new(schema, vec![Arc::new(lists)]).unwrap();
        let row = batch.slice(500, 1);
        let bytes = block_bytes(&row);
        assert!(bytes < 1000, "one row of 100 values counts {bytes} bytes");
        let (kept, counted) = compact(row.clone());
        assert_eq!(kept, row);
        assert_eq!(counted, bytes);
        assert!(
            kept.get_array_memory_size() < 4096,
            "it holds {} bytes",
            kept.get_array_memory_size()
        );
        // A list of structs of lists, as an ordered `array_agg`'s partial state is.
        let nested = StructArray::from(vec![(
            Arc::new(Field::new(
                "l",
                batch.schema().field(0).data_type().clone(),
                true,
            )),
            Arc::clone(batch.column(0)),
        )]);
        let nested: ArrayRef = Arc::new(nested);
        let sliced = nested.slice(10, 2);
        assert!(reached_bytes(&sliced) < 2000, "{}", reached_bytes(&sliced));
    }

    #[test]
    fn an_exchange_piece_keeps_only_its_own_rows() {
        // The map side of a 64-way exchange: each piece is a slice of one `take` of the
        // whole batch, so every piece held the batch's 64 pieces' bytes.
        let batch = records(8192);
        let mut partitioner = BatchPartitioner::try_new(
            Partitioning::Hash(vec![col("k", &batch.schema()).unwrap()], 64),
            Time::new(),
            0,
            1,
        )
        .unwrap();
        let mut rows = 0;
        for piece in partitioner.partition_iter(batch.clone()).unwrap() {
            let (_, piece) = piece.unwrap();
            let held_before = piece.get_array_memory_size() as u64;
            let (compacted, bytes) = compact(piece.clone());
            assert_eq!(compacted, piece);
            assert_eq!(
                bytes,
                block_bytes(&compacted),
                "the bytes it counts are the copy's"
            );
            let held = compacted.get_array_memory_size() as u64;
            assert!(
                held <= 2 * block_bytes(&compacted) + SHARED_SLACK_BYTES,
                "a {}-row piece holds {held} bytes for {} of its own",
                piece.num_rows(),
                block_bytes(&compacted)
            );
            assert!(
                held * 10 < held_before,
                "{held} bytes, {held_before} before"
            );
            rows += piece.num_rows();
        }
        assert_eq!(rows, 8192);
    }

    #[test]
    fn a_block_that_is_most_of_its_batch_is_not_copied() {
        let batch = records(8192);
        let most = batch.slice(1000, 6000);
        let (kept, _) = compact(most.clone());
        for (a, b) in kept.columns().iter().zip(most.columns()) {
            assert!(Arc::ptr_eq(a, b), "shares its batch's buffers");
        }
        // A small block of a small batch is not worth copying either.
        let sliver = records(100).slice(3, 2);
        let (kept, _) = compact(sliver.clone());
        for (a, b) in kept.columns().iter().zip(sliver.columns()) {
            assert!(
                Arc::ptr_eq(a, b),
                "a 100-row batch's sliver is kept as it is"
            );
        }
        // A sliver of a large batch is.
        let sliver = batch.slice(100, 10);
        let (kept, _) = compact(sliver.clone());
        assert_eq!(kept, sliver);
        assert!(kept.get_array_memory_size() < 4096);
    }

    /// Ten short strings in a views buffer made for 8,192 (a coalescer's output): the
    /// block holds ten views' bytes, not the buffer's capacity.
    #[test]
    fn inline_strings_in_a_large_views_buffer_are_copied_out() {
        use datafusion::arrow::array::StringViewBuilder;
        let mut builder = StringViewBuilder::with_capacity(8192);
        for i in 0..10 {
            builder.append_value(format!("name-{i}"));
        }
        let names: ArrayRef = Arc::new(builder.finish());
        assert!(names.get_array_memory_size() > 100_000);
        let schema = Arc::new(Schema::new(vec![Field::new(
            "name",
            DataType::Utf8View,
            false,
        )]));
        let batch = RecordBatch::try_new(schema, vec![Arc::clone(&names)]).unwrap();
        let (compacted, bytes) = compact(batch);
        assert_eq!(bytes, 10 * 16 + 2);
        let held = compacted.get_array_memory_size();
        assert!(held < 1_000, "{held} bytes held for 10 inline strings");
        assert_eq!(compacted.column(0).as_ref(), names.as_ref());
    }

    #[test]
    fn views_already_in_a_buffer_their_size_are_not_copied_again() {
        let long: Vec<String> = (0..100)
            .map(|i| format!("a value longer than inline {i}"))
            .collect();
        let names = StringViewArray::from_iter_values(long.iter())
            .slice(10, 20)
            .gc();
        let before = names.views().inner().as_ptr();
        let kept = own_views(names);
        assert_eq!(kept.views().inner().as_ptr(), before);
        assert_eq!(kept.len(), 20);
        assert_eq!(kept.value(0), long[10]);
    }
}
