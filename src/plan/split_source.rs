//! `SplitSourceExec`: a Parquet scan cut into deterministic source splits.
//!
//! Each partition's file group is cut into byte ranges of about `flumen.split_bytes`; a
//! source task reads one range (the row groups whose first page starts inside it, as
//! DataFusion assigns them). Where the files' footers could be read before cutting
//! ([`RowGroupLayout`]), ranges fall on row group boundaries, so no split comes out empty;
//! otherwise they are plain byte ranges. The same split always reads the same rows, which
//! is what lineage recompute relies on. The first split of each partition reads small
//! batches (`flumen.first_block_rows`), so the first rows leave after little work; its task's
//! cutter coalesces them back up to full blocks (`crate::store::ramp`).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::Array;
use datafusion::arrow::datatypes::Schema;
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use datafusion::parquet::file::metadata::ParquetMetaData;
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::metrics::MetricsSet;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties,
};
use futures::StreamExt;

use crate::plan::stage_input::TaskInputs;

/// Where the row groups of a plan's Parquet files start, their compressed sizes, and the
/// footers themselves (for their column statistics).
#[derive(Debug, Default, Clone)]
pub struct RowGroupLayout {
    /// Each file's row groups and footer, by file location.
    files: HashMap<String, FileLayout>,
}

/// One Parquet file's row groups.
#[derive(Debug, Clone)]
struct FileLayout {
    /// `(first page offset, compressed bytes)` of each row group.
    row_groups: Vec<(u64, u64)>,
    /// The file's footer.
    metadata: Arc<ParquetMetaData>,
}

impl RowGroupLayout {
    /// Read the footers of every Parquet file scanned by `plan` (through DataFusion's file
    /// metadata cache, so the scans that follow find them there). A file whose footer
    /// cannot be read is left out: its splits are plain byte ranges.
    pub async fn read(plan: &Arc<dyn ExecutionPlan>, runtime: &RuntimeEnv) -> Self {
        let mut files = vec![];
        collect_parquet_files(plan, &mut files);
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
                    let row_groups = metadata
                        .row_groups()
                        .iter()
                        .map(|rg| {
                            let col = rg.column(0);
                            let start = col
                                .dictionary_page_offset()
                                .unwrap_or_else(|| col.data_page_offset());
                            (start.max(0) as u64, rg.compressed_size().max(0) as u64)
                        })
                        .collect();
                    let file = FileLayout {
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

    fn row_groups(&self, file: &PartitionedFile) -> Option<&Vec<(u64, u64)>> {
        self.files
            .get(file.object_meta.location.as_ref())
            .map(|f| &f.row_groups)
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
            if !out
                .iter()
                .any(|(_, m)| m.location == file.object_meta.location)
            {
                out.push((config.object_store_url.clone(), file.object_meta.clone()));
            }
        }
    }
    for child in plan.children() {
        collect_parquet_files(child, out);
    }
}

/// Whether `fragment` reads a [`SplitSourceExec`] (whose first splits read small batches).
pub fn reads_splits(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    fragment.downcast_ref::<SplitSourceExec>().is_some()
        || fragment.children().into_iter().any(reads_splits)
}

/// A Parquet scan whose partitions are read split by split.
#[derive(Debug)]
pub struct SplitSourceExec {
    original: Arc<dyn ExecutionPlan>,
    /// `splits[partition][split]`: a one-partition scan of that byte range.
    splits: Vec<Vec<Arc<dyn ExecutionPlan>>>,
}

impl SplitSourceExec {
    /// Cut the scan `original` (whose data source is `config`) into splits; the first
    /// split of each partition reads batches of `first_rows` rows (0: the session's).
    pub fn try_new(
        original: Arc<dyn ExecutionPlan>,
        config: &FileScanConfig,
        split_bytes: u64,
        layout: &RowGroupLayout,
        first_rows: usize,
    ) -> Result<Self> {
        let split_bytes = split_bytes.max(1);
        let mut splits = vec![];
        for group in &config.file_groups {
            let mut scans: Vec<Arc<dyn ExecutionPlan>> = vec![];
            for file in group.iter() {
                let ranges = match layout.row_groups(file) {
                    Some(groups) => row_group_ranges(file, groups, split_bytes),
                    None => byte_ranges(file, split_bytes),
                };
                for range_file in ranges {
                    let mut cfg = FileScanConfigBuilder::from(config.clone())
                        .with_file_groups(vec![FileGroup::new(vec![range_file])]);
                    // The partition's first split reads small batches: its first rows
                    // leave the scan (and any projection pushed into it) early.
                    if scans.is_empty() && first_rows > 0 {
                        cfg = cfg.with_batch_size(Some(first_rows));
                    }
                    let cfg = cfg.build();
                    scans.push(DataSourceExec::from_data_source(cfg));
                }
            }
            if scans.is_empty() {
                let cfg = FileScanConfigBuilder::from(config.clone())
                    .with_file_groups(vec![FileGroup::new(vec![])])
                    .build();
                scans.push(DataSourceExec::from_data_source(cfg));
            }
            splits.push(scans);
        }
        Ok(Self { original, splits })
    }

    /// The one-partition scan of split `split` of `partition`.
    pub fn split_plan(&self, partition: usize, split: usize) -> Option<Arc<dyn ExecutionPlan>> {
        self.splits.get(partition)?.get(split).cloned()
    }

    /// Number of splits of each partition.
    pub fn splits_per_partition(&self) -> Vec<usize> {
        self.splits.iter().map(|s| s.len()).collect()
    }
}

/// Cut one file (or its assigned range) at row group boundaries into ranges holding about
/// `split_bytes` of row groups each (a row group larger than that is a range of its own).
fn row_group_ranges(
    file: &PartitionedFile,
    groups: &[(u64, u64)],
    split_bytes: u64,
) -> Vec<PartitionedFile> {
    let (start, end) = match &file.range {
        Some(r) => (r.start as u64, r.end as u64),
        None => (0, file.object_meta.size),
    };
    let mut starts: Vec<(u64, u64)> = groups
        .iter()
        .copied()
        .filter(|(offset, _)| *offset >= start && *offset < end)
        .collect();
    starts.sort_unstable();
    let mut bounds = vec![start];
    let mut gathered = 0;
    for (i, (_, bytes)) in starts.iter().enumerate() {
        gathered += bytes;
        if gathered >= split_bytes && i + 1 < starts.len() {
            bounds.push(starts[i + 1].0);
            gathered = 0;
        }
    }
    bounds.push(end);
    bounds
        .windows(2)
        .map(|w| {
            let mut piece = file.clone();
            piece.range = Some(datafusion::datasource::listing::FileRange {
                start: w[0] as i64,
                end: w[1] as i64,
            });
            piece
        })
        .collect()
}

/// Cut one file (or its assigned range) into ranges of at most `split_bytes`.
fn byte_ranges(file: &PartitionedFile, split_bytes: u64) -> Vec<PartitionedFile> {
    let (start, end) = match &file.range {
        Some(r) => (r.start as u64, r.end as u64),
        None => (0, file.object_meta.size),
    };
    if end <= start || end - start <= split_bytes {
        return vec![file.clone()];
    }
    let mut out = vec![];
    let mut at = start;
    while at < end {
        let stop = (at + split_bytes).min(end);
        let mut piece = file.clone();
        piece.range = Some(datafusion::datasource::listing::FileRange {
            start: at as i64,
            end: stop as i64,
        });
        out.push(piece);
        at = stop;
    }
    out
}

impl DisplayAs for SplitSourceExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        self.original.fmt_as(t, f)?;
        if !matches!(t, DisplayFormatType::TreeRender) {
            let total: usize = self.splits.iter().map(|s| s.len()).sum();
            write!(f, ", flumen_splits={total}")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for SplitSourceExec {
    fn name(&self) -> &str {
        "SplitSourceExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.original.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        self.original.apply_expressions(f)
    }

    fn replace_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn with_new_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let split = context
            .session_config()
            .get_extension::<TaskInputs>()
            .map(|t| t.split)
            .unwrap_or(0);
        let scan = self
            .splits
            .get(partition)
            .and_then(|s| s.get(split))
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "SplitSourceExec has no split {split} of partition {partition}"
                ))
            })?;
        scan.execute(0, context)
    }

    fn metrics(&self) -> Option<MetricsSet> {
        // The splits' scans share one Parquet source and so one set of counters: count
        // each counter once, not once per split.
        let mut set = MetricsSet::new();
        let mut seen = std::collections::HashSet::new();
        for scan in self.splits.iter().flatten() {
            if let Some(m) = scan.metrics() {
                for metric in m.iter() {
                    if seen.insert(Arc::as_ptr(metric)) {
                        set.push(Arc::clone(metric));
                    }
                }
            }
        }
        Some(set)
    }
}
