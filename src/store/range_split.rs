//! Splitting a batch by range: each row goes to the range its sort keys fall in.
//!
//! DataFusion's `BatchPartitioner` routes a range split row by row through `ScalarValue`s
//! (each row's keys copied out and compared with every split point it passes): 17% of a
//! 20M-row range sort's CPU time under 64 MB went there. This one converts each batch's
//! keys to arrow's row format once, with the split points converted the same way, and
//! finds each row's range by a binary search over byte strings. Rows compare as the row
//! format orders them: as arrow's sort orders them, which is the order the ranges are
//! sorted in (a range sort's split points are also chosen in that order), and a row equal
//! to a split point goes to the range that starts there, as DataFusion routes it. The search
//! compares each row's first eight bytes as one integer first and reads further bytes only
//! on a tie (a normalized-key prefix): comparing whole byte strings was 11% of a 20M-row
//! range sort's CPU time.

use datafusion::arrow::array::{ArrayRef, UInt32Array};
use datafusion::arrow::compute::take_record_batch;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::row::{OwnedRow, RowConverter, SortField};
use datafusion::common::ScalarValue;
use datafusion::error::Result;
use datafusion::physical_expr::RangePartitioning;

/// Routes rows to the ranges of one [`RangePartitioning`].
pub struct RangeSplitter {
    partitioning: RangePartitioning,
    converter: RowConverter,
    /// The split points in row format, in order.
    points: Vec<OwnedRow>,
    /// Each split point's [`prefix`].
    prefixes: Vec<u64>,
    /// Row indices per range, reused across batches.
    indices: Vec<Vec<u32>>,
}

impl RangeSplitter {
    /// A splitter for `partitioning`'s ranges over batches of `schema`-typed key values.
    pub fn try_new(
        partitioning: &RangePartitioning,
        schema: &datafusion::arrow::datatypes::Schema,
    ) -> Result<Self> {
        let fields = partitioning
            .ordering()
            .iter()
            .map(|key| {
                Ok(SortField::new_with_options(
                    key.expr.data_type(schema)?,
                    key.options,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let converter = RowConverter::new(fields)?;
        let keys = partitioning.ordering().len();
        let columns = (0..keys)
            .map(|k| {
                ScalarValue::iter_to_array(
                    partitioning
                        .split_points()
                        .iter()
                        .map(|point| point.values()[k].clone()),
                )
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        let points = converter
            .convert_columns(&columns)?
            .iter()
            .map(|point| point.owned())
            .collect::<Vec<_>>();
        let prefixes = points.iter().map(|p| prefix(p.row().as_ref())).collect();
        Ok(Self {
            partitioning: partitioning.clone(),
            converter,
            points,
            prefixes,
            indices: vec![vec![]; partitioning.partition_count()],
        })
    }

    /// `batch`'s rows by range: `(range, its rows in input order)` for each range with rows.
    pub fn split(&mut self, batch: &RecordBatch) -> Result<Vec<(usize, RecordBatch)>> {
        let keys = self
            .partitioning
            .ordering()
            .iter()
            .map(|key| key.expr.evaluate(batch)?.into_array(batch.num_rows()))
            .collect::<Result<Vec<_>>>()?;
        let rows = self.converter.convert_columns(&keys)?;
        self.indices.iter_mut().for_each(Vec::clear);
        for (i, row) in rows.iter().enumerate() {
            let range = range_of(&self.prefixes, |j| self.points[j].row(), row.as_ref());
            self.indices[range].push(i as u32);
        }
        let mut pieces = vec![];
        for (range, indices) in self.indices.iter_mut().enumerate() {
            if indices.is_empty() {
                continue;
            }
            let taken = UInt32Array::from(std::mem::take(indices));
            pieces.push((range, take_record_batch(batch, &taken)?));
        }
        Ok(pieces)
    }
}

/// A row's first eight bytes as a big-endian integer, zero-padded: two rows whose prefixes
/// differ compare as their prefixes do (row bytes compare lexicographically, and a shorter
/// row that ends inside the prefix is smaller than any longer row it starts); equal
/// prefixes say nothing and the bytes decide.
fn prefix(bytes: &[u8]) -> u64 {
    let mut first = [0u8; 8];
    let n = bytes.len().min(8);
    first[..n].copy_from_slice(&bytes[..n]);
    u64::from_be_bytes(first)
}

/// The number of split points at or below `row` (its range), given the points' prefixes
/// and a way to their bytes, both in order: a binary search on prefixes that reads a
/// point's bytes only when its prefix equals the row's.
fn range_of<P: AsRef<[u8]>>(prefixes: &[u64], point: impl Fn(usize) -> P, row: &[u8]) -> usize {
    let row_prefix = prefix(row);
    let (mut low, mut high) = (0, prefixes.len());
    while low < high {
        let mid = low + (high - low) / 2;
        let at_or_below = match prefixes[mid].cmp(&row_prefix) {
            std::cmp::Ordering::Equal => point(mid).as_ref() <= row,
            order => order.is_lt(),
        };
        if at_or_below {
            low = mid + 1;
        } else {
            high = mid;
        }
    }
    low
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{Float64Array, Int64Array, StringArray};
    use datafusion::arrow::compute::SortOptions;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::SplitPoint;
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
    use datafusion::physical_plan::Partitioning;
    use datafusion::physical_plan::metrics::Time;
    use datafusion::physical_plan::repartition::BatchPartitioner;
    use std::sync::Arc;

    use super::*;

    /// Each row's range, by the splitter's pieces (the `id` column says which row).
    fn ranges_of(pieces: &[(usize, RecordBatch)], rows: usize) -> Vec<usize> {
        let mut ranges = vec![usize::MAX; rows];
        for (range, piece) in pieces {
            let ids = piece
                .column(3)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            for id in ids.values() {
                ranges[*id as usize] = *range;
            }
        }
        ranges
    }

    /// Rows with nulls and repeats on two keys (a string descending with nulls first, a
    /// float ascending with nulls last) go to the same ranges as DataFusion's partitioner
    /// sends them, each range's rows in input order.
    /// Prefixes that differ order two byte strings as the strings order (short strings,
    /// zero bytes, shared beginnings), and the search finds what a search over the whole
    /// strings finds.
    #[test]
    fn prefixes_order_byte_strings_as_their_bytes_do() {
        let mut state = 7u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as usize
        };
        let strings: Vec<Vec<u8>> = (0..400)
            .map(|_| {
                let len = next() % 12;
                // Few distinct bytes, zeros among them: many shared beginnings and ties.
                (0..len).map(|_| [0u8, 1, 255][next() % 3]).collect()
            })
            .collect();
        for a in &strings {
            for b in &strings {
                let (pa, pb) = (prefix(a), prefix(b));
                if pa != pb {
                    assert_eq!(pa.cmp(&pb), a.cmp(b), "{a:?} vs {b:?}");
                }
            }
        }
        let mut points = strings[..40].to_vec();
        points.sort();
        let prefixes: Vec<u64> = points.iter().map(|p| prefix(p)).collect();
        for row in &strings {
            assert_eq!(
                range_of(&prefixes, |j| &points[j], row),
                points.partition_point(|p| p <= row),
                "{row:?}"
            );
        }
    }

    #[test]
    fn rows_go_where_datafusion_routes_them() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("s", DataType::Utf8, true),
            Field::new("f", DataType::Float64, true),
            Field::new("pad", DataType::Utf8, false),
            Field::new("id", DataType::Int64, false),
        ]));
        let n = 5_000;
        let s: Vec<Option<String>> = (0..n)
            .map(|i| (i % 17 != 0).then(|| format!("k{:02}", (i * 7) % 23)))
            .collect();
        let f: Vec<Option<f64>> = (0..n)
            .map(|i| (i % 13 != 0).then(|| ((i * 31) % 11) as f64 - 5.0))
            .collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringArray::from(s)),
                Arc::new(Float64Array::from(f)),
                Arc::new(StringArray::from_iter_values(
                    (0..n).map(|i| format!("p{i}")),
                )),
                Arc::new(Int64Array::from_iter_values(0..n as i64)),
            ],
        )
        .unwrap();
        let ordering = LexOrdering::new([
            PhysicalSortExpr::new(
                col("s", &schema).unwrap(),
                SortOptions {
                    descending: true,
                    nulls_first: true,
                },
            ),
            PhysicalSortExpr::new(
                col("f", &schema).unwrap(),
                SortOptions {
                    descending: false,
                    nulls_first: false,
                },
            ),
        ])
        .unwrap();
        let point = |s: Option<&str>, f: Option<f64>| {
            SplitPoint::new(vec![
                ScalarValue::Utf8(s.map(str::to_string)),
                ScalarValue::Float64(f),
            ])
        };
        let points = vec![
            point(None, Some(0.0)),
            point(Some("k20"), None),
            point(Some("k15"), Some(-2.0)),
            point(Some("k15"), Some(3.0)),
            point(Some("k07"), Some(0.0)),
            point(Some("k01"), None),
        ];
        let partitioning = RangePartitioning::try_new(ordering, points).unwrap();

        let mut ours = RangeSplitter::try_new(&partitioning, &schema).unwrap();
        let our_pieces = ours.split(&batch).unwrap();
        let mut theirs =
            BatchPartitioner::try_new(Partitioning::Range(partitioning.clone()), Time::new(), 0, 1)
                .unwrap();
        let their_pieces: Vec<(usize, RecordBatch)> = theirs
            .partition_iter(batch.clone())
            .unwrap()
            .collect::<Result<_>>()
            .unwrap();
        let expected = ranges_of(&their_pieces, n);
        assert!(expected.iter().all(|r| *r < 7));
        assert_eq!(ranges_of(&our_pieces, n), expected);
        // Every range has rows here, in input order within the range.
        assert_eq!(our_pieces.len(), 7);
        for (_, piece) in &our_pieces {
            let ids = piece
                .column(3)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            assert!(ids.values().windows(2).all(|w| w[0] < w[1]));
        }
    }
}
