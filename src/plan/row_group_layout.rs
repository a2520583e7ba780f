//! The row groups of a plan's Parquet files, read from their footers before a scan is cut
//! into splits: where each row group starts in its file, its compressed and uncompressed
//! sizes and rows ([`RowGroupLayout`]), so splits fall on row group boundaries and a range's
//! rows are known without opening it. What a file's footer says of its row groups is kept
//! between a session's queries ([`LayoutCache`]), so a query over files it has seen reads
//! a footer only where it prunes that file's row groups.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::Array;
use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::execution::cache::lru_queue::LruQueue;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use datafusion::parquet::file::metadata::{PageIndexPolicy, ParquetMetaData};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::aggregates::AggregateExec;
use futures::StreamExt;
use object_store::ObjectMeta;

use crate::plan::split_pruning::StaticFilePruning;

/// Where the row groups of a plan's Parquet files start and their compressed sizes, and the
/// footers of the files whose row groups the plan's scans prune.
#[derive(Debug, Default, Clone)]
pub struct RowGroupLayout {
    /// Each file's row groups, by file location.
    files: HashMap<String, Arc<FileLayout>>,
    /// The footers read for this plan, by file location: those of the files whose row
    /// groups a scan's predicate may rule out.
    footers: HashMap<String, Arc<ParquetMetaData>>,
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

/// The `(min, max)` of a column in each row group of a file (`None`: a statistic is
/// missing or the column holds a null).
type ColumnRanges = Option<Arc<Vec<(ScalarValue, ScalarValue)>>>;

/// What one Parquet file's footer says of its row groups.
#[derive(Debug)]
struct FileLayout {
    /// Each row group, in file order.
    row_groups: Vec<RowGroupSpan>,
    /// The rows and data bytes of the row groups, summed in offset order.
    sums: WeightSums,
    /// The ranges of the columns asked of it so far (a GROUP BY's keys), by column name
    /// and the type the table gives it.
    column_ranges: Mutex<HashMap<(String, DataType), ColumnRanges>>,
}

impl FileLayout {
    /// The layout `footer` gives.
    fn of(footer: &ParquetMetaData) -> Self {
        let row_groups: Vec<RowGroupSpan> = footer
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
        Self {
            sums: WeightSums::new(&row_groups),
            row_groups,
            column_ranges: Mutex::new(HashMap::new()),
        }
    }

    /// The ranges of `column` (of type `data_type`) where they were asked before.
    fn column_ranges(&self, column: &str, data_type: &DataType) -> Option<ColumnRanges> {
        let known = self.column_ranges.lock().unwrap_or_else(|e| e.into_inner());
        known.get(&(column.to_string(), data_type.clone())).cloned()
    }

    /// Keep the ranges of `column` read from `footer` (as the table `schema` types it).
    fn learn_column_ranges(&self, column: &str, schema: &Schema, footer: &ParquetMetaData) {
        let Ok(field) = schema.field_with_name(column) else {
            return;
        };
        let ranges = row_group_ranges_of(footer, schema, column).map(Arc::new);
        let mut known = self.column_ranges.lock().unwrap_or_else(|e| e.into_inner());
        known.insert((column.to_string(), field.data_type().clone()), ranges);
    }

    /// About how many bytes it holds.
    fn weight(&self) -> usize {
        let known = self.column_ranges.lock().unwrap_or_else(|e| e.into_inner());
        let ranges: usize = known
            .values()
            .map(|r| r.as_ref().map_or(0, |r| r.len() * 96) + 64)
            .sum();
        128 + self.row_groups.len() * (size_of::<RowGroupSpan>() + 24) + ranges
    }
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

/// The row group layouts of the Parquet files a session's queries scanned, by store and
/// location, each valid while its file keeps the size, modification time and ETag it was
/// read at. Without it every query read every footer again before it cut its scans, from
/// DataFusion's file metadata cache, whose default 50 MB held fewer than 20,000 small
/// files' footers: read in the same order each time, an LRU cache never hit (a point
/// lookup spent 1.5-4.6 s of 2.5-5.6 s there). A layout weighs a few dozen bytes per row
/// group; past its limit ([`LayoutCache::LIMIT_BYTES`] by default) the layouts used least
/// recently go first. Installed in a flumen session's config
/// (`SessionConfig::with_extension`).
pub struct LayoutCache {
    /// The layouts, and the bytes they weigh.
    state: Mutex<CacheState>,
    /// The most bytes of layouts it holds.
    limit_bytes: usize,
}

/// A [`LayoutCache`]'s layouts, least recently used first, and their weight.
struct CacheState {
    /// Each file's layout, the object it was read from and the bytes it was counted at,
    /// by store and location.
    layouts: LruQueue<String, (ObjectMeta, Arc<FileLayout>, usize)>,
    /// About how many bytes `layouts` weighs.
    bytes: usize,
}

/// What an entry of a [`CacheState`] weighs besides its layout and its key's text (held
/// twice: in the map and in the recency list's node): the node's shared allocation, the
/// map's slot and the object's fields.
const ENTRY_OVERHEAD_BYTES: usize = 256;

impl Default for LayoutCache {
    fn default() -> Self {
        Self::with_limit(Self::LIMIT_BYTES)
    }
}

impl std::fmt::Debug for LayoutCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("LayoutCache")
            .field("files", &state.layouts.len())
            .field("bytes", &state.bytes)
            .field("limit_bytes", &self.limit_bytes)
            .finish()
    }
}

impl LayoutCache {
    /// The most bytes of layouts a session's cache holds (64 MiB: about 100,000 files of
    /// one row group each, at ~600 bytes a file with its key and entry).
    pub const LIMIT_BYTES: usize = 64 << 20;

    /// An empty cache that holds at most `limit_bytes` of layouts.
    pub fn with_limit(limit_bytes: usize) -> Self {
        let state = CacheState {
            layouts: LruQueue::new(),
            bytes: 0,
        };
        Self {
            state: Mutex::new(state),
            limit_bytes,
        }
    }

    /// The layout of `file` in `store`, if it was read while the file was as it is now
    /// (which makes it the most recently used).
    fn get(&self, store: &ObjectStoreUrl, file: &ObjectMeta) -> Option<Arc<FileLayout>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (read_from, layout, _) = state.layouts.get(&cache_key(store, file))?;
        let same = read_from.size == file.size
            && read_from.last_modified == file.last_modified
            && read_from.e_tag == file.e_tag;
        same.then(|| Arc::clone(layout))
    }

    /// Keep `layout`, read from `file` in `store`, as the most recently used; the least
    /// recently used layouts go until it fits. A layout heavier than the whole limit is
    /// not kept.
    fn put(&self, store: &ObjectStoreUrl, file: &ObjectMeta, layout: &Arc<FileLayout>) {
        let key = cache_key(store, file);
        let weight =
            layout.weight() + 2 * key.len() + file.location.as_ref().len() + ENTRY_OVERHEAD_BYTES;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, counted)) = state.layouts.remove(&key) {
            state.bytes = state.bytes.saturating_sub(counted);
        }
        if weight > self.limit_bytes {
            return;
        }
        while state.bytes + weight > self.limit_bytes {
            let Some((_, (_, _, counted))) = state.layouts.pop() else {
                break;
            };
            state.bytes = state.bytes.saturating_sub(counted);
        }
        state.bytes += weight;
        state
            .layouts
            .put(key, (file.clone(), Arc::clone(layout), weight));
    }

    /// How many files' layouts it holds.
    pub fn len(&self) -> usize {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.layouts.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// About how many bytes its layouts weigh (at most its limit).
    pub fn bytes(&self) -> usize {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.bytes
    }
}

/// A file's key in a [`LayoutCache`]: its store and location.
fn cache_key(store: &ObjectStoreUrl, file: &ObjectMeta) -> String {
    format!("{}{}", store.as_str(), file.location)
}

/// One Parquet file a plan scans, and what the plan needs of its footer.
struct PlannedFile {
    /// The store it lives in.
    store: ObjectStoreUrl,
    /// The file as the listing saw it.
    meta: ObjectMeta,
    /// Whether a scan may prune its row groups where it holds several: its footer is then
    /// kept in the layout.
    footer_if_several: bool,
    /// Whether a scan may prune its row group where it holds one: where the file has no
    /// statistics of its own (with them, the file's verdict was that row group's).
    footer_if_one: bool,
    /// The GROUP BY columns whose row group ranges the cut may ask, with the table schema
    /// that types them.
    columns: Vec<(String, Arc<Schema>)>,
}

impl RowGroupLayout {
    /// Read the row groups of every Parquet file scanned by `plan`: from `cache` where it
    /// holds the file as it is now, else from its footer (through DataFusion's file
    /// metadata cache, so the scans that follow find it there), kept in `cache`. The
    /// footers of files whose row groups a scan may prune are read in any case: its
    /// predicate does not rule the whole file out by the listing's statistics, and the file
    /// holds several row groups, or one but no statistics of its own (a file's statistics
    /// are its one row group's, so their verdict is that row group's). A file whose footer cannot be read is left out: its splits
    /// are plain byte ranges.
    pub async fn read(
        plan: &Arc<dyn ExecutionPlan>,
        runtime: &RuntimeEnv,
        cache: Option<&LayoutCache>,
    ) -> Self {
        let planned = planned_files(plan);
        let mut files = HashMap::new();
        let mut to_read = vec![];
        for file in planned {
            let cached = cache.and_then(|c| c.get(&file.store, &file.meta));
            let location = file.meta.location.to_string();
            match cached {
                Some(layout) if !needs_footer(&file, &layout) => {
                    files.insert(location, layout);
                }
                cached => to_read.push((file, cached)),
            }
        }
        let runtime_cache = runtime.cache_manager.get_file_metadata_cache();
        let fetched: Vec<(String, Arc<FileLayout>, Option<Arc<ParquetMetaData>>)> =
            futures::stream::iter(to_read)
                .map(|(file, cached)| {
                    let runtime_cache = Arc::clone(&runtime_cache);
                    async move {
                        let store = runtime.object_store(&file.store).ok()?;
                        let footer = DFParquetMetadata::new(store.as_ref(), &file.meta)
                            .with_file_metadata_cache(Some(runtime_cache))
                            .with_page_index_policy(Some(PageIndexPolicy::Skip))
                            .fetch_metadata()
                            .await
                            .ok()?;
                        let learns = cached.is_none()
                            || file
                                .columns
                                .iter()
                                .any(|(c, s)| !layout_knows(&cached, c, s));
                        let layout = match cached {
                            Some(layout) => layout,
                            None => Arc::new(FileLayout::of(&footer)),
                        };
                        for (column, schema) in &file.columns {
                            layout.learn_column_ranges(column, schema, &footer);
                        }
                        if let Some(cache) = cache.filter(|_| learns) {
                            cache.put(&file.store, &file.meta, &layout);
                        }
                        let keeps = file.keeps_footer(&layout).then_some(footer);
                        Some((file.meta.location.to_string(), layout, keeps))
                    }
                })
                .buffer_unordered(16)
                .filter_map(|f| async move { f })
                .collect()
                .await;
        let mut footers = HashMap::new();
        for (location, layout, footer) in fetched {
            if let Some(footer) = footer {
                footers.insert(location.clone(), footer);
            }
            files.insert(location, layout);
        }
        Self { files, footers }
    }

    /// The footer of `file`, where it was read because a scan may prune its row groups.
    pub(super) fn footer(&self, file: &PartitionedFile) -> Option<&Arc<ParquetMetaData>> {
        self.footers.get(file.object_meta.location.as_ref())
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
        let Ok(field) = config.file_schema().field_with_name(column) else {
            return false;
        };
        let mut ranges: Vec<(ScalarValue, ScalarValue)> = vec![];
        let mut seen = HashSet::new();
        for file in config.file_groups.iter().flat_map(|g| g.iter()) {
            let location = file.object_meta.location.as_ref();
            if !seen.insert(location) {
                continue;
            }
            let Some(layout) = self.files.get(location) else {
                return false;
            };
            match layout.column_ranges(column, field.data_type()).flatten() {
                Some(file_ranges) => ranges.extend(file_ranges.iter().cloned()),
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

impl PlannedFile {
    /// Whether the layout keeps the footer of this file, whose row groups are `layout`.
    fn keeps_footer(&self, layout: &FileLayout) -> bool {
        match layout.row_groups.len() {
            0 => false,
            1 => self.footer_if_one,
            _ => self.footer_if_several,
        }
    }
}

/// Whether the footer of `file`, whose layout `layout` was read before, must be read
/// again: a scan may prune its row groups, or the cut may ask a column's ranges not yet
/// known.
fn needs_footer(file: &PlannedFile, layout: &Arc<FileLayout>) -> bool {
    let cached = Some(Arc::clone(layout));
    file.keeps_footer(layout)
        || (file.columns.iter()).any(|(column, schema)| !layout_knows(&cached, column, schema))
}

/// Whether `layout` (where there is one) knows the ranges of `column`, or has none to know
/// (`schema`, the table's, lacks it).
fn layout_knows(layout: &Option<Arc<FileLayout>>, column: &str, schema: &Schema) -> bool {
    match (layout, schema.field_with_name(column)) {
        (_, Err(_)) => true,
        (None, Ok(_)) => false,
        (Some(layout), Ok(field)) => layout.column_ranges(column, field.data_type()).is_some(),
    }
}

/// Every distinct Parquet file scanned by `plan`, with what the plan needs of its footer.
fn planned_files(plan: &Arc<dyn ExecutionPlan>) -> Vec<PlannedFile> {
    let group_columns = partial_group_columns(plan);
    let mut scans = vec![];
    crate::plan::cut::collect_parquet_scans(plan, &mut scans);
    let mut by_location: HashMap<object_store::path::Path, usize> = HashMap::new();
    let mut planned: Vec<PlannedFile> = vec![];
    for config in scans {
        let files: Vec<&PartitionedFile> =
            config.file_groups.iter().flat_map(|g| g.iter()).collect();
        // Files the scan's predicate leaves to its row groups.
        let kept_by_files = StaticFilePruning::of(config)
            .filter(|pruning| pruning.prunes_row_groups())
            .map(|pruning| pruning.files_pruned(&files));
        let schema = Arc::clone(config.file_schema());
        for (index, file) in files.iter().enumerate() {
            let left_to_row_groups = kept_by_files.as_ref().is_some_and(|pruned| !pruned[index]);
            let location = &file.object_meta.location;
            let at = *by_location.entry(location.clone()).or_insert_with(|| {
                planned.push(PlannedFile {
                    store: config.object_store_url.clone(),
                    meta: file.object_meta.clone(),
                    footer_if_several: false,
                    footer_if_one: false,
                    columns: vec![],
                });
                planned.len() - 1
            });
            let entry = &mut planned[at];
            entry.footer_if_several |= left_to_row_groups;
            entry.footer_if_one |= left_to_row_groups && !file.has_statistics();
            for column in &group_columns {
                if !entry
                    .columns
                    .iter()
                    .any(|(c, s)| c == column && *s == schema)
                {
                    entry.columns.push((column.clone(), Arc::clone(&schema)));
                }
            }
        }
    }
    planned
}

/// The plain-column keys of every partial aggregate with GROUP BY in `plan`.
fn partial_group_columns(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let mut columns: Vec<String> = vec![];
    let _ = plan.apply(|node| {
        if let Some(agg) = node.downcast_ref::<AggregateExec>() {
            for column in crate::plan::cut::partial_group_columns(agg).unwrap_or_default() {
                if !columns.contains(&column) {
                    columns.push(column);
                }
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    columns
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

    /// Write `rows` rows of one Int64 column `a` to `path`, in row groups of `group_rows`.
    fn write_file(path: &std::path::Path, rows: i64, group_rows: usize) {
        use datafusion::arrow::array::{ArrayRef, Int64Array};
        use datafusion::arrow::record_batch::RecordBatch;
        use datafusion::parquet::arrow::ArrowWriter;
        use datafusion::parquet::file::properties::WriterProperties;
        let column: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows));
        let batch = RecordBatch::try_from_iter([("a", column)]).unwrap();
        let properties = WriterProperties::builder()
            .set_max_row_group_row_count(Some(group_rows))
            .build();
        let file = std::fs::File::create(path).unwrap();
        let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(properties)).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }

    /// The layout of `sql` over the table `t` of the files in `dir` (column `a` given, not
    /// inferred; the listing's statistics collected where `statistics`), read through
    /// `cache` in a session of its own.
    async fn layout_of_query(
        dir: &std::path::Path,
        cache: &LayoutCache,
        sql: &str,
        statistics: bool,
    ) -> RowGroupLayout {
        use datafusion::prelude::{SessionConfig, SessionContext};
        let config =
            SessionConfig::new().set_bool("datafusion.execution.collect_statistics", statistics);
        let ctx = SessionContext::new_with_config(config);
        let create = format!(
            "CREATE EXTERNAL TABLE t (a BIGINT) STORED AS PARQUET LOCATION '{}/'",
            dir.display()
        );
        ctx.sql(&create).await.unwrap();
        let plan = ctx.sql(sql).await.unwrap();
        let plan = plan.create_physical_plan().await.unwrap();
        RowGroupLayout::read(&plan, &ctx.runtime_env(), Some(cache)).await
    }

    /// [`layout_of_query`] of `SELECT * FROM t`, without statistics.
    async fn layout_of(dir: &std::path::Path, cache: &LayoutCache) -> RowGroupLayout {
        layout_of_query(dir, cache, "SELECT * FROM t", false).await
    }

    /// The row groups the layout holds of its one file (`None`: it holds no file).
    fn groups_of_one_file(layout: &RowGroupLayout) -> Option<usize> {
        assert!(layout.files.len() <= 1, "{layout:?}");
        layout.files.values().next().map(|f| f.row_groups.len())
    }

    #[tokio::test]
    async fn a_file_seen_before_is_cut_without_its_footer_until_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.parquet");
        write_file(&path, 3000, 1000);
        let cache = LayoutCache::default();
        let first = layout_of(dir.path(), &cache).await;
        assert_eq!(groups_of_one_file(&first), Some(3));
        assert_eq!(cache.len(), 1);

        // The footer made unreadable, the file's size and modification time kept: a new
        // session (an empty metadata cache of DataFusion's) still has its row groups.
        let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        let end = bytes.len();
        bytes[end - 4..].copy_from_slice(b"XXXX");
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::options().write(true).open(&path).unwrap();
        file.set_modified(modified).unwrap();
        drop(file);
        let seen = layout_of(dir.path(), &cache).await;
        assert_eq!(groups_of_one_file(&seen), Some(3), "read from the cache");
        // Without the cache, the footer is read: and cannot be.
        let unread = layout_of(dir.path(), &LayoutCache::default()).await;
        assert_eq!(
            groups_of_one_file(&unread),
            None,
            "the footer is unreadable"
        );

        // Written again (another size): its new footer is read.
        write_file(&path, 5000, 1000);
        let rewritten = layout_of(dir.path(), &cache).await;
        assert_eq!(
            groups_of_one_file(&rewritten),
            Some(5),
            "read again once changed"
        );
        assert_eq!(cache.len(), 1);
    }

    #[tokio::test]
    async fn footers_are_kept_only_where_a_scan_may_prune_row_groups() {
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| dir.path().join(name);
        write_file(&path("three_groups.parquet"), 3000, 1000); // a in 0..3000
        write_file(&path("ruled_out.parquet"), 1000, 5000); // a in 0..1000
        write_file(&path("one_group.parquet"), 2000, 5000); // a in 0..2000
        let kept = |layout: &RowGroupLayout| {
            let mut names: Vec<String> = (layout.footers.keys())
                .map(|k| k.rsplit('/').next().unwrap().to_string())
                .collect();
            names.sort();
            names
        };
        let cache = LayoutCache::default();
        let sql = "SELECT * FROM t WHERE a >= 1500";
        // The file's statistics rule `ruled_out` out, and are `one_group`'s one row group's.
        let layout = layout_of_query(dir.path(), &cache, sql, true).await;
        assert_eq!(kept(&layout), ["three_groups.parquet"]);
        assert_eq!(layout.files.len(), 3);
        // Again, from the cache: the same footers.
        let layout = layout_of_query(dir.path(), &cache, sql, true).await;
        assert_eq!(kept(&layout), ["three_groups.parquet"]);
        // Without the listing's statistics every file is left to its row groups.
        let layout = layout_of_query(dir.path(), &cache, sql, false).await;
        let all = [
            "one_group.parquet",
            "ruled_out.parquet",
            "three_groups.parquet",
        ];
        assert_eq!(kept(&layout), all);
        // No predicate: no footer.
        let layout = layout_of_query(dir.path(), &cache, "SELECT * FROM t", true).await;
        assert!(kept(&layout).is_empty());
    }

    /// A file of the local store named `name` (1,000 bytes), as a listing sees it.
    fn listed(name: &str) -> ObjectMeta {
        ObjectMeta {
            location: format!("t/{name}").into(),
            last_modified: chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
            size: 1000,
            e_tag: None,
            version: None,
        }
    }

    /// The layout of a file of no row group.
    fn empty_layout() -> Arc<FileLayout> {
        Arc::new(FileLayout {
            row_groups: vec![],
            sums: WeightSums::new(&[]),
            column_ranges: Mutex::new(HashMap::new()),
        })
    }

    #[test]
    fn a_full_cache_lets_the_least_recently_used_layouts_go() {
        let store = ObjectStoreUrl::local_filesystem();
        let files: Vec<ObjectMeta> = (1..=4).map(|i| listed(&format!("f{i}.parquet"))).collect();
        let layout = empty_layout();
        let one = {
            let probe = LayoutCache::default();
            probe.put(&store, &files[0], &layout);
            probe.bytes()
        };
        let cache = LayoutCache::with_limit(3 * one);
        for file in &files[..3] {
            cache.put(&store, file, &layout);
        }
        assert_eq!((cache.len(), cache.bytes()), (3, 3 * one));
        // f1 read again: f2 is now the least recently used, and goes for f4.
        assert!(cache.get(&store, &files[0]).is_some());
        cache.put(&store, &files[3], &layout);
        let held = |cache: &LayoutCache| -> Vec<bool> {
            files
                .iter()
                .map(|f| cache.get(&store, f).is_some())
                .collect()
        };
        assert_eq!(held(&cache), [true, false, true, true]);
        assert_eq!((cache.len(), cache.bytes()), (3, 3 * one));
        // A layout heavier than the whole limit is not kept, and costs no other.
        let tiny = LayoutCache::with_limit(one - 1);
        tiny.put(&store, &files[0], &layout);
        assert_eq!((tiny.len(), tiny.bytes()), (0, 0));
    }

    #[test]
    fn a_layout_kept_again_is_counted_once() {
        let store = ObjectStoreUrl::local_filesystem();
        let file = listed("f.parquet");
        let layout = empty_layout();
        let cache = LayoutCache::default();
        cache.put(&store, &file, &layout);
        let once = cache.state.lock().unwrap().bytes;
        for _ in 0..10 {
            cache.put(&store, &file, &layout);
        }
        assert_eq!(cache.state.lock().unwrap().bytes, once);
        assert_eq!(cache.len(), 1);
        assert!(cache.get(&store, &file).is_some());
        let changed = ObjectMeta { size: 1001, ..file };
        assert!(
            cache.get(&store, &changed).is_none(),
            "another size is another file"
        );
    }
}
