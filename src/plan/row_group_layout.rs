//! The row groups of a plan's Parquet files, read from their footers before a scan is cut
//! into splits: where each row group starts in its file, its compressed and uncompressed
//! sizes and rows ([`RowGroupLayout`]), so splits fall on row group boundaries and a range's
//! rows are known without opening it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::array::Array;
use datafusion::arrow::datatypes::Schema;
use datafusion::common::ScalarValue;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::datasource::source::DataSourceExec;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use datafusion::parquet::file::metadata::ParquetMetaData;
use datafusion::physical_plan::ExecutionPlan;
use futures::StreamExt;

/// Where the row groups of a plan's Parquet files start, their compressed sizes, and the
/// footers themselves (for their column statistics).
#[derive(Debug, Default, Clone)]
pub struct RowGroupLayout {
    /// Each file's row groups and footer, by file location.
    files: HashMap<String, FileLayout>,
}

/// Where one row group lies in its file, and how big it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RowGroupSpan {
    /// Offset of its first page (DataFusion assigns a row group to the byte range holding it).
    pub(super) offset: u64,
    /// Compressed bytes.
    pub(super) bytes: u64,
    /// Rows.
    pub(super) rows: u64,
    /// Uncompressed bytes of every column's data: what its rows weigh once decoded.
    pub(super) data_bytes: u64,
}

/// One Parquet file's row groups.
#[derive(Debug, Clone)]
struct FileLayout {
    /// Each row group, in file order.
    row_groups: Vec<RowGroupSpan>,
    /// The rows and data bytes of the row groups, summed in offset order.
    sums: WeightSums,
    /// The file's footer.
    metadata: Arc<ParquetMetaData>,
}

/// The rows and data bytes of a file's row groups summed in the order of their offsets, so
/// what a byte range holds is two binary searches, not a walk over every row group (a pack
/// of ranges asks it once per range: 12,000 ranges of one file).
#[derive(Debug, Clone, Default)]
struct WeightSums {
    /// The row groups' first-page offsets, ascending.
    offsets: Vec<u64>,
    /// Rows and data bytes of the row groups before each offset (one more than `offsets`).
    before: Vec<(u64, u64)>,
}

impl WeightSums {
    fn new(groups: &[RowGroupSpan]) -> Self {
        let mut sorted: Vec<&RowGroupSpan> = groups.iter().collect();
        sorted.sort_unstable_by_key(|g| g.offset);
        let mut before = Vec::with_capacity(sorted.len() + 1);
        let (mut rows, mut data) = (0, 0);
        before.push((rows, data));
        for g in &sorted {
            (rows, data) = (rows + g.rows, data + g.data_bytes);
            before.push((rows, data));
        }
        Self {
            offsets: sorted.iter().map(|g| g.offset).collect(),
            before,
        }
    }

    /// Rows and data bytes of the row groups whose first page lies in `[start, end)` (the
    /// ones DataFusion reads for that range).
    fn within(&self, start: u64, end: u64) -> (u64, u64) {
        let from = self.offsets.partition_point(|&o| o < start);
        let to = self.offsets.partition_point(|&o| o < end).max(from);
        let (a, b) = (self.before[from], self.before[to]);
        (b.0 - a.0, b.1 - a.1)
    }
}

impl RowGroupLayout {
    /// Read the footers of every Parquet file scanned by `plan` (through DataFusion's file
    /// metadata cache, so the scans that follow find them there). A file whose footer
    /// cannot be read is left out: its splits are plain byte ranges.
    pub async fn read(plan: &Arc<dyn ExecutionPlan>, runtime: &RuntimeEnv) -> Self {
        let mut files = vec![];
        collect_parquet_files(plan, &mut HashSet::new(), &mut files);
        let cache = runtime.cache_manager.get_file_metadata_cache();
        let fetched: Vec<(String, FileLayout)> = futures::stream::iter(files)
            .map(|(url, meta)| {
                let cache = Arc::clone(&cache);
                async move {
                    let store = runtime.object_store(&url).ok()?;
                    let metadata = DFParquetMetadata::new(store.as_ref(), &meta)
                        .with_file_metadata_cache(Some(cache))
                        .fetch_metadata()
                        .await
                        .ok()?;
                    let row_groups: Vec<RowGroupSpan> = metadata
                        .row_groups()
                        .iter()
                        .map(|rg| {
                            let col = rg.column(0);
                            let start = col
                                .dictionary_page_offset()
                                .unwrap_or_else(|| col.data_page_offset());
                            RowGroupSpan {
                                offset: start.max(0) as u64,
                                bytes: rg.compressed_size().max(0) as u64,
                                rows: rg.num_rows().max(0) as u64,
                                data_bytes: rg.total_byte_size().max(0) as u64,
                            }
                        })
                        .collect();
                    let file = FileLayout {
                        sums: WeightSums::new(&row_groups),
                        row_groups,
                        metadata,
                    };
                    Some((meta.location.to_string(), file))
                }
            })
            .buffer_unordered(16)
            .filter_map(|f| async move { f })
            .collect()
            .await;
        Self {
            files: fetched.into_iter().collect(),
        }
    }

    /// The footer of `file`, where it was read.
    pub(super) fn footer(&self, file: &PartitionedFile) -> Option<&Arc<ParquetMetaData>> {
        self.files
            .get(file.object_meta.location.as_ref())
            .map(|f| &f.metadata)
    }

    /// The row groups of `file`, in file order, where its footer was read.
    pub(super) fn row_groups(&self, file: &PartitionedFile) -> Option<&Vec<RowGroupSpan>> {
        self.files
            .get(file.object_meta.location.as_ref())
            .map(|f| &f.row_groups)
    }

    /// Rows and data bytes of the row groups the range `file` reads, where its footer was
    /// read.
    pub(super) fn weight(&self, file: &PartitionedFile) -> Option<(u64, u64)> {
        let (start, end) = byte_range(file);
        self.files
            .get(file.object_meta.location.as_ref())
            .map(|f| f.sums.within(start, end))
    }

    /// Whether the scan `config` is clustered by `column`: ordered by their minimum, the row
    /// groups of all its files hold disjoint `[min, max]` ranges of it (touching ends
    /// allowed), so each value lies in one row group, or two. False when any footer or
    /// statistic is missing, or the column holds nulls.
    pub fn clustered_by(&self, config: &FileScanConfig, column: &str) -> bool {
        let mut ranges: Vec<(ScalarValue, ScalarValue)> = vec![];
        let mut seen = std::collections::HashSet::new();
        for file in config.file_groups.iter().flat_map(|g| g.iter()) {
            let location = file.object_meta.location.as_ref();
            if !seen.insert(location) {
                continue;
            }
            let Some(layout) = self.files.get(location) else {
                return false;
            };
            match row_group_ranges_of(&layout.metadata, config.file_schema(), column) {
                Some(file_ranges) => ranges.extend(file_ranges),
                None => return false,
            }
        }
        if ranges.len() < 2 {
            return false;
        }
        ranges.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
        ranges.windows(2).all(|w| {
            matches!(
                w[0].1.partial_cmp(&w[1].0),
                Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
            )
        })
    }
}

/// `(min, max)` of `column` in each row group of one file, from its footer's statistics;
/// `None` where a statistic is missing or the column holds a null.
fn row_group_ranges_of(
    metadata: &ParquetMetaData,
    schema: &Schema,
    column: &str,
) -> Option<Vec<(ScalarValue, ScalarValue)>> {
    let converter =
        StatisticsConverter::try_new(column, schema, metadata.file_metadata().schema_descr())
            .ok()?;
    let groups = metadata.row_groups();
    let mins = converter.row_group_mins(groups).ok()?;
    let maxes = converter.row_group_maxes(groups).ok()?;
    let nulls = converter.row_group_null_counts(groups).ok()?;
    (0..groups.len())
        .map(|i| {
            if mins.is_null(i) || maxes.is_null(i) || nulls.is_null(i) || nulls.value(i) > 0 {
                return None;
            }
            let min = ScalarValue::try_from_array(&mins, i).ok()?;
            let max = ScalarValue::try_from_array(&maxes, i).ok()?;
            Some((min, max))
        })
        .collect()
}

/// Every distinct Parquet file scanned by `plan`, with the store it lives in.
fn collect_parquet_files(
    plan: &Arc<dyn ExecutionPlan>,
    seen: &mut HashSet<object_store::path::Path>,
    out: &mut Vec<(
        datafusion::execution::object_store::ObjectStoreUrl,
        object_store::ObjectMeta,
    )>,
) {
    if let Some(source) = plan.downcast_ref::<DataSourceExec>()
        && let Some(config) = source.data_source().downcast_ref::<FileScanConfig>()
        && config.file_source().file_type() == "parquet"
    {
        for file in config.file_groups.iter().flat_map(|g| g.iter()) {
            if seen.insert(file.object_meta.location.clone()) {
                out.push((config.object_store_url.clone(), file.object_meta.clone()));
            }
        }
    }
    for child in plan.children() {
        collect_parquet_files(child, seen, out);
    }
}

/// The bytes of its file that `file` reads: its range, else the whole file.
pub(super) fn byte_range(file: &PartitionedFile) -> (u64, u64) {
    match &file.range {
        Some(r) => (r.start as u64, r.end as u64),
        None => (0, file.object_meta.size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranges_weight_sums_the_row_groups_starting_in_it_in_any_footer_order() {
        // Row groups listed out of offset order (a writer may): 10 at 4, 20 at 104, ...
        let mut groups: Vec<RowGroupSpan> = (0..40u64)
            .map(|i| RowGroupSpan {
                offset: 4 + 100 * i,
                bytes: 100,
                rows: 10 * (i + 1),
                data_bytes: 1000 + i,
            })
            .collect();
        groups.reverse();
        groups.swap(3, 17);
        let sums = WeightSums::new(&groups);
        let walked = |start: u64, end: u64| {
            (groups.iter())
                .filter(|g| g.offset >= start && g.offset < end)
                .fold((0, 0), |(r, d), g| (r + g.rows, d + g.data_bytes))
        };
        for (start, end) in [
            (0, 4),
            (0, 5),
            (4, 104),
            (5, 104),
            (5, 105),
            (0, 4004),
            (3000, 3000),
            (3000, 2000),
            (3904, 9999),
        ] {
            assert_eq!(
                sums.within(start, end),
                walked(start, end),
                "[{start}, {end})"
            );
        }
        assert_eq!(sums.within(0, u64::MAX), (8200, 40_780));
        assert_eq!(WeightSums::new(&[]).within(0, 100), (0, 0));
    }
}
