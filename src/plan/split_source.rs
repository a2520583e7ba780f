//! `SplitSourceExec`: a Parquet scan cut into deterministic source splits.
//!
//! Each partition's file group is cut into byte ranges of about `flumen.split_bytes`; a
//! source task reads one range (the row groups whose first page starts inside it, as
//! DataFusion assigns them). Where the files' footers could be read before cutting
//! ([`RowGroupLayout`]), ranges fall on row group boundaries, so no split comes out empty;
//! in plans that call a model, splits also hold at most `flumen.model_split_rows` rows and
//! `flumen.model_split_bytes` of uncompressed data ([`ModelSplitLimit`]), and
//! a row group larger than a split (in bytes or rows) is cut into pieces of consecutive
//! rows, each read through a Parquet row selection (DataFusion's `ParquetAccessPlan`), so
//! a row group of a million rows is not one task. Otherwise they are plain byte ranges. The same split always reads the same rows, which
//! is what lineage recompute relies on. The first split of each partition reads small
//! batches (`flumen.first_block_rows`), so the first rows leave after little work; its task's
//! cutter coalesces them back up to full blocks (`crate::store::ramp`).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

use datafusion::arrow::array::Array;
use datafusion::arrow::datatypes::Schema;
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::datasource::physical_plan::parquet::{
    ParquetAccessPlan, ParquetFileMetrics, RowGroupAccess, RowGroupAccessPlanFilter,
    apply_file_schema_type_coercions,
};
use datafusion::datasource::physical_plan::{
    FileGroup, FileScanConfig, FileScanConfigBuilder, FileSource, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use datafusion::parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, RowSelection, RowSelector,
};
use datafusion::parquet::file::metadata::ParquetMetaData;
use datafusion::physical_expr::expressions::{DynamicFilterPhysicalExpr, lit};
use datafusion::physical_expr::simplifier::PhysicalExprSimplifier;
use datafusion::physical_expr_adapter::{
    DefaultPhysicalExprAdapterFactory, PhysicalExprAdapterFactory, replace_columns_with_literals,
};
use datafusion::physical_optimizer::pruning::{FilePruner, PruningPredicateBuilder};
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricType, MetricsSet,
};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PhysicalExpr, PlanProperties,
};
use futures::StreamExt;

use crate::plan::join_filter_rows;
use crate::plan::stage_input::TaskInputs;

/// Where the row groups of a plan's Parquet files start, their compressed sizes, and the
/// footers themselves (for their column statistics).
#[derive(Debug, Default, Clone)]
pub struct RowGroupLayout {
    /// Each file's row groups and footer, by file location.
    files: HashMap<String, FileLayout>,
}

/// Where one row group lies in its file, and how big it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowGroupSpan {
    /// Offset of its first page (DataFusion assigns a row group to the byte range holding it).
    offset: u64,
    /// Compressed bytes.
    bytes: u64,
    /// Rows.
    rows: u64,
    /// Uncompressed bytes of every column's data: what its rows weigh once decoded.
    data_bytes: u64,
}

/// What a split of a plan with a model may hold beyond its compressed bytes: rows there
/// cost far more CPU than their bytes say (`clean_text`, tokenizing), and a long row more
/// than a short one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelSplitLimit {
    /// Most rows (0: no limit, and the limit below is unused).
    pub rows: u64,
    /// Most uncompressed bytes, by the footers' sizes (0: rows alone): a row group of
    /// rows ten times as wide gives splits of a tenth of the rows.
    pub data_bytes: u64,
}

impl ModelSplitLimit {
    /// No limit beyond the compressed bytes (plans without a model).
    pub const NONE: Self = Self {
        rows: 0,
        data_bytes: 0,
    };

    /// Most rows of `group` a split holds (`u64::MAX`: no limit).
    fn rows_of(&self, group: &RowGroupSpan) -> u64 {
        if self.rows == 0 {
            return u64::MAX;
        }
        if self.data_bytes == 0 || group.data_bytes == 0 {
            return self.rows;
        }
        let fit = (self.data_bytes as u128 * group.rows as u128 / group.data_bytes as u128) as u64;
        self.rows.min(fit.max(1))
    }
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
    fn footer(&self, file: &PartitionedFile) -> Option<&Arc<ParquetMetaData>> {
        self.files
            .get(file.object_meta.location.as_ref())
            .map(|f| &f.metadata)
    }

    fn row_groups(&self, file: &PartitionedFile) -> Option<&Vec<RowGroupSpan>> {
        self.files
            .get(file.object_meta.location.as_ref())
            .map(|f| &f.row_groups)
    }

    /// Rows and data bytes of the row groups the range `file` reads, where its footer was
    /// read.
    fn weight(&self, file: &PartitionedFile) -> Option<(u64, u64)> {
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

/// Whether split `split` of the [`SplitSourceExec`] `fragment` reads (if any) is one of its
/// partitions' first splits, which read small batches so their task's blocks ramp up.
pub fn split_ramps(fragment: &Arc<dyn ExecutionPlan>, split: usize) -> bool {
    match fragment.downcast_ref::<SplitSourceExec>() {
        Some(scan) => split < scan.ramped_splits,
        None => fragment
            .children()
            .into_iter()
            .any(|child| split_ramps(child, split)),
    }
}

/// A Parquet scan whose partitions are read split by split.
#[derive(Debug)]
pub struct SplitSourceExec {
    original: Arc<dyn ExecutionPlan>,
    /// `splits[partition][split]`: a one-partition scan of that byte range.
    splits: Vec<Vec<Arc<dyn ExecutionPlan>>>,
    /// How many first splits of each partition read small batches.
    ramped_splits: usize,
    /// Drops the rows its joins' finished dynamic filters reject
    /// ([`crate::plan::join_filter_rows`]): set where a grouped aggregate reads the scan.
    drops_join_filtered_rows: bool,
    /// Its own counters, beside the scans' shared ones: `join_filter_dropped_rows`, made
    /// when a task first drops rows.
    metrics: ExecutionPlanMetricsSet,
    dropped_rows: OnceLock<Count>,
}

impl SplitSourceExec {
    /// Cut the scan `original` (whose data source is `config`) into splits of about
    /// `split_bytes` and at most what `limit` allows where the footers are known; the first `ramped_splits` splits of each partition (one per CPU slot, so
    /// every slot's first task starts small) read batches of `first_rows` rows (0: the
    /// session's, and no split ramps).
    pub fn try_new(
        original: Arc<dyn ExecutionPlan>,
        config: &FileScanConfig,
        split_bytes: u64,
        limit: ModelSplitLimit,
        layout: &RowGroupLayout,
        first_rows: usize,
        ramped_splits: usize,
    ) -> Result<Self> {
        let limit = ModelSplitLimit {
            rows: shared_split_rows(
                limit.rows,
                scan_rows(config, layout),
                first_rows,
                ramped_splits,
            ),
            ..limit
        };
        let ramped_splits = if first_rows > 0 { ramped_splits } else { 0 };
        let split_bytes = split_bytes.max(1);
        let pruning = StaticFilePruning::of(config);
        let mut pruned = PrunedBeforeTasks::default();
        let mut ranges: Vec<Vec<PartitionedFile>> = vec![];
        for group in config.file_groups.iter() {
            let mut kept = vec![];
            for file in group.iter() {
                let (file_ranges, groups) = match layout.row_groups(file) {
                    Some(groups) => (row_group_ranges(file, groups, split_bytes, limit), groups),
                    None => (byte_ranges(file, split_bytes), &vec![]),
                };
                let Some(pruning) = pruning.as_ref() else {
                    kept.extend(file_ranges);
                    continue;
                };
                // Every range of a file carries the file's statistics and partition values:
                // the file's verdict is each range's.
                if pruning.prunes(file) {
                    pruned.ranges += file_ranges.len();
                    continue;
                }
                // Row groups the scan would skip by their statistics, by first-page offset:
                // asked once per file, and only where some row group is ruled out.
                let ruled_out = layout
                    .footer(file)
                    .and_then(|footer| pruning.row_groups_ruled_out(file, footer))
                    .filter(|out| out.iter().any(|&o| o))
                    .map(|out| {
                        let mut by_offset: Vec<(u64, bool)> =
                            groups.iter().map(|g| g.offset).zip(out).collect();
                        by_offset.sort_unstable_by_key(|&(offset, _)| offset);
                        by_offset
                    });
                let Some(by_offset) = ruled_out else {
                    kept.extend(file_ranges);
                    continue;
                };
                for range in file_ranges {
                    // The row groups whose first page lies in the range.
                    let (start, end) = byte_range(&range);
                    let from = by_offset.partition_point(|&(offset, _)| offset < start);
                    let to = by_offset.partition_point(|&(offset, _)| offset < end);
                    let inside = &by_offset[from..to];
                    if !inside.is_empty() && inside.iter().all(|&(_, out)| out) {
                        pruned.ranges_of_row_groups += 1;
                        pruned.row_groups += inside.len();
                    } else {
                        kept.push(range);
                    }
                }
            }
            ranges.push(kept);
        }
        let metrics = ExecutionPlanMetricsSet::new();
        pruned.count_in(&metrics);
        let ranges = if partitions_are_free(&original, config) {
            deal_out(ranges)
        } else {
            ranges
        };
        // Each split's scan is the original's with its file ranges: cloned from a copy
        // without the file groups (cloning the original copied every file's entry and
        // statistics into each split: 12,000 splits of 200 files took a sixth of the
        // driver's CPU).
        let template = FileScanConfigBuilder::from(config.clone())
            .with_file_groups(vec![])
            .build();
        let mut splits = vec![];
        for partition_ranges in ranges {
            let mut scans: Vec<Arc<dyn ExecutionPlan>> = vec![];
            let packs =
                pack_small_ranges(partition_ranges, split_bytes, limit, layout, ramped_splits);
            for pack in packs {
                let mut cfg = FileScanConfigBuilder::from(template.clone())
                    .with_file_groups(vec![FileGroup::new(pack)]);
                // The partition's first splits read small batches: their first rows
                // leave the scan (and any projection pushed into it) early.
                if scans.len() < ramped_splits {
                    cfg = cfg.with_batch_size(Some(first_rows));
                }
                let cfg = cfg.build();
                scans.push(DataSourceExec::from_data_source(cfg));
            }
            // A partition left with no split (its ranges pruned, or no row group starting
            // in them) has no task: its operator's partition closes empty.
            splits.push(scans);
        }
        Ok(Self {
            original,
            splits,
            ramped_splits,
            drops_join_filtered_rows: false,
            metrics,
            dropped_rows: OnceLock::new(),
        })
    }

    /// The same scan, dropping (`drops`) the rows its joins' finished dynamic filters
    /// reject before a grouped aggregate above it in its fragment sees them
    /// ([`crate::plan::join_filter_rows`]).
    pub fn dropping_join_filtered_rows(mut self, drops: bool) -> Self {
        self.drops_join_filtered_rows = drops;
        self
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

/// The file pruning DataFusion's Parquet scan does when it opens a file range, done
/// while the scan is cut into splits: a range whose file statistics (the listing's,
/// `datafusion.execution.collect_statistics`) and partition values prove that the
/// scan's static predicate holds for none of its rows makes no split, so no task is
/// launched to open it and find it empty (a round trip each with worker processes:
/// a point lookup in 200 files sorted by its key was 200 tasks). Dynamic filters
/// count as `true` here: they are not filled in yet, and the same splits must come out
/// whenever the plan is cut.
struct StaticFilePruning {
    /// The scan's predicate, its dynamic filters replaced by `true`.
    predicate: Arc<dyn PhysicalExpr>,
    /// The schema of the files' columns, as DataFusion's file pruning reads them.
    file_schema: Arc<Schema>,
    /// The table's partition columns, whose values each file range carries.
    partition_columns: datafusion::arrow::datatypes::Fields,
    /// Where the scan prunes row groups by their statistics as DataFusion's opener does
    /// by default (`datafusion.execution.parquet.pruning`; no INT96 coercion, virtual
    /// columns or expression adapter of its own), the largest `IN` list it rewrites.
    row_groups: Option<usize>,
}

impl StaticFilePruning {
    /// The pruning of a Parquet scan with a static predicate; `None` otherwise.
    fn of(config: &FileScanConfig) -> Option<Self> {
        let source = config.file_source().downcast_ref::<ParquetSource>()?;
        let predicate = FileSource::filter(source)?
            .transform(|expr| {
                Ok(match expr.downcast_ref::<DynamicFilterPhysicalExpr>() {
                    Some(_) => Transformed::yes(lit(true)),
                    None => Transformed::no(expr),
                })
            })
            .ok()?
            .data;
        let options = &source.table_parquet_options().global;
        let row_groups = (options.pruning
            && options.coerce_int96.is_none()
            && FileSource::table_schema(source)
                .virtual_columns()
                .is_empty()
            && config.expr_adapter_factory.is_none())
        .then(|| source.max_in_list_size());
        Some(Self {
            predicate,
            file_schema: Arc::clone(config.file_schema()),
            partition_columns: config.table_partition_cols().clone(),
            row_groups,
        })
    }

    /// The predicate for `range`: its partition columns replaced by the range's values,
    /// as DataFusion's scan does before it prunes (`None` where that fails).
    fn for_range(&self, range: &PartitionedFile) -> Option<Arc<dyn PhysicalExpr>> {
        let values: HashMap<String, ScalarValue> = self
            .partition_columns
            .iter()
            .zip(range.partition_values.iter())
            .map(|(field, value)| (field.name().clone(), value.clone()))
            .collect();
        match values.is_empty() {
            true => Some(Arc::clone(&self.predicate)),
            false => replace_columns_with_literals(Arc::clone(&self.predicate), &values).ok(),
        }
    }

    /// Whether DataFusion's file pruning skips `range` without reading it: the predicate
    /// for the range checked against the file's statistics (`FilePruner`). Any error
    /// keeps the range.
    fn prunes(&self, range: &PartitionedFile) -> bool {
        let Some(predicate) = self.for_range(range) else {
            return false;
        };
        let Some(mut pruner) =
            FilePruner::try_new(predicate, &self.file_schema, range, Count::new())
        else {
            return false;
        };
        pruner.should_prune().unwrap_or(false)
    }

    /// Which row groups of `file` (its footer `footer`) DataFusion's scan skips by their
    /// statistics, as its opener decides it: the file's Arrow schema with the scan's type
    /// coercions, the predicate for the file adapted to that schema and simplified, then
    /// `RowGroupAccessPlanFilter::prune_by_statistics`. `None` where the scan does not
    /// prune row groups so, or anything fails (every row group is then kept).
    fn row_groups_ruled_out(
        &self,
        file: &PartitionedFile,
        footer: &Arc<ParquetMetaData>,
    ) -> Option<Vec<bool>> {
        let max_in_list_size = self.row_groups?;
        let predicate = self.for_range(file)?;
        let mut options = ArrowReaderOptions::new();
        if let Some(schema) = file.arrow_schema.as_ref() {
            options = options.with_schema(Arc::clone(schema));
        }
        let reader = ArrowReaderMetadata::try_new(Arc::clone(footer), options).ok()?;
        let mut physical = Arc::clone(reader.schema());
        if let Some(coerced) = apply_file_schema_type_coercions(&self.file_schema, &physical) {
            physical = Arc::new(coerced);
        }
        let adapter = DefaultPhysicalExprAdapterFactory
            .create(Arc::clone(&self.file_schema), Arc::clone(&physical))
            .ok()?;
        let predicate = PhysicalExprSimplifier::new(&physical)
            .simplify(adapter.rewrite(predicate).ok()?)
            .ok()?;
        let pruning = PruningPredicateBuilder::new()
            .with_file_schema(Arc::clone(&physical))
            .with_max_in_list_size(max_in_list_size)
            .build(predicate)?;
        let groups = footer.row_groups();
        let mut filter = RowGroupAccessPlanFilter::new(ParquetAccessPlan::new_all(groups.len()));
        let scratch = ExecutionPlanMetricsSet::new();
        let counters = ParquetFileMetrics::new(0, file.object_meta.location.as_ref(), &scratch);
        filter.prune_by_statistics(
            &physical,
            reader.parquet_schema(),
            groups,
            &pruning,
            &counters,
        );
        let plan = filter.build();
        Some((0..groups.len()).map(|i| !plan.should_scan(i)).collect())
    }
}

/// What a scan's cut left out before any task ran, counted as DataFusion's scan would
/// have counted it had it opened those ranges, so `EXPLAIN ANALYZE` states the same
/// pruning as vanilla's.
#[derive(Debug, Default)]
struct PrunedBeforeTasks {
    /// Ranges the file statistics rule out (`files_ranges_pruned_statistics`, pruned).
    ranges: usize,
    /// Ranges the file statistics leave but whose every row group the row groups'
    /// statistics rule out (`files_ranges_pruned_statistics`, matched).
    ranges_of_row_groups: usize,
    /// The row groups of those (`row_groups_pruned_statistics`, pruned).
    row_groups: usize,
}

impl PrunedBeforeTasks {
    /// Register the counts (only those above zero) in `metrics`.
    fn count_in(&self, metrics: &ExecutionPlanMetricsSet) {
        let counter = |name: &'static str| {
            MetricBuilder::new(metrics)
                .with_type(MetricType::Summary)
                .pruning_metrics(name, 0)
        };
        if self.ranges + self.ranges_of_row_groups > 0 {
            let ranges = counter("files_ranges_pruned_statistics");
            ranges.add_pruned(self.ranges);
            ranges.add_matched(self.ranges_of_row_groups);
        }
        if self.row_groups > 0 {
            counter("row_groups_pruned_statistics").add_pruned(self.row_groups);
        }
    }
}

/// Whether the scan `original` (of `config`) leaves free which partition reads which
/// rows: it promises no order and no partitioning, so a split may move to another partition
/// (as DataFusion's own scans steal files across partitions).
fn partitions_are_free(original: &Arc<dyn ExecutionPlan>, config: &FileScanConfig) -> bool {
    let properties = original.properties();
    config.output_ordering.is_empty()
        && !config.preserve_order
        && properties.output_ordering().is_none()
        && matches!(
            properties.output_partitioning(),
            Partitioning::UnknownPartitioning(_)
        )
}

/// The splits of every partition dealt out again over all partitions, so that each holds
/// as many as the others, give or take one. A few large row groups (a writer's default
/// of a million rows) fall into a few partitions' byte ranges; their pieces in one
/// partition are read one after another by whoever reads that partition in order, while
/// the other partitions stand empty: a model then waits on one split's CPU task at a time.
/// The deal takes the first split of each partition, then the second of each, and so on,
/// and hands them out in turn: partitions that already hold equal numbers keep theirs.
fn deal_out(ranges: Vec<Vec<PartitionedFile>>) -> Vec<Vec<PartitionedFile>> {
    let partitions = ranges.len();
    let mut queues: Vec<std::collections::VecDeque<PartitionedFile>> =
        ranges.into_iter().map(Into::into).collect();
    let mut dealt = vec![vec![]; partitions];
    let mut next = 0;
    while queues.iter().any(|q| !q.is_empty()) {
        for queue in &mut queues {
            if let Some(split) = queue.pop_front() {
                dealt[next % partitions].push(split);
                next += 1;
            }
        }
    }
    dealt
}

/// One partition's ranges (in reading order) as splits: consecutive small ranges packed
/// into one split of several, up to `split_bytes` of them and what `limit` allows, as
/// DataFusion's own partitions read many small files in turn. A table of 2,000 files of a
/// few KB was 2,000 tasks (with worker processes, a round trip each: a `GROUP BY` over it
/// took 1.4 s against 0.3 s in threads mode). The first `single` ranges (the ramped
/// splits, which read small batches) stay one a split, as does a range read through an
/// access plan of its own (a row group's piece), and under a row limit a range whose rows
/// the footers do not give.
fn pack_small_ranges(
    ranges: Vec<PartitionedFile>,
    split_bytes: u64,
    limit: ModelSplitLimit,
    layout: &RowGroupLayout,
    single: usize,
) -> Vec<Vec<PartitionedFile>> {
    let (rows_cap, data_cap) = match (limit.rows, limit.data_bytes) {
        (0, _) => (u64::MAX, u64::MAX),
        (rows, 0) => (rows, u64::MAX),
        (rows, data) => (rows, data),
    };
    let mut packs: Vec<Vec<PartitionedFile>> = vec![];
    // The open pack's bytes, rows and data bytes; `None` when the last split is closed.
    let mut open: Option<(u64, u64, u64)> = None;
    for (index, range) in ranges.into_iter().enumerate() {
        let (start, end) = byte_range(&range);
        let bytes = end.saturating_sub(start);
        // Rows and data bytes of the range, by its row groups: needed only under a row
        // limit.
        let weight = match limit.rows {
            0 => Some((0, 0)),
            _ => layout.weight(&range),
        };
        let packable = index >= single
            && !range.extensions.contains::<ParquetAccessPlan>()
            && bytes < split_bytes;
        match (packable, weight, open.as_mut()) {
            (true, Some((rows, data)), Some((b, r, d)))
                if *b + bytes <= split_bytes && *r + rows <= rows_cap && *d + data <= data_cap =>
            {
                (*b, *r, *d) = (*b + bytes, *r + rows, *d + data);
                packs.last_mut().expect("an open pack").push(range);
            }
            (true, Some((rows, data)), _) => {
                open = Some((bytes, rows, data));
                packs.push(vec![range]);
            }
            _ => {
                open = None;
                packs.push(vec![range]);
            }
        }
    }
    packs
}

/// Under a row limit (a plan with a model, where rows are dear), the limit lowered so that
/// the scan's `rows` (when its footers are known) make at least one split per CPU slot
/// (`slots`), but no split under `first_rows`: 2,000 documents in one row group were one
/// task, which cleaned and tokenized them one by one while a GPU waited (0.55x
/// sentence-transformers' rate on an H200).
fn shared_split_rows(split_rows: u64, rows: Option<u64>, first_rows: usize, slots: usize) -> u64 {
    match rows {
        Some(rows) if split_rows > 0 && slots > 1 => {
            let share = rows.div_ceil(slots as u64).max(first_rows.max(1) as u64);
            split_rows.min(share)
        }
        _ => split_rows,
    }
}

/// The bytes of its file that `file` reads: its range, else the whole file.
fn byte_range(file: &PartitionedFile) -> (u64, u64) {
    match &file.range {
        Some(r) => (r.start as u64, r.end as u64),
        None => (0, file.object_meta.size),
    }
}

/// Rows of the scan `config` by its footers; `None` when a file's footer is not known.
fn scan_rows(config: &FileScanConfig, layout: &RowGroupLayout) -> Option<u64> {
    let mut rows = 0;
    for file in config.file_groups.iter().flat_map(|g| g.iter()) {
        rows += layout.weight(file)?.0;
    }
    Some(rows)
}

/// Fewest rows of a piece of a row group cut for its bytes (DataFusion's batch size): smaller
/// pieces would cost more in per-task work and page decoding than they share out. A row
/// limit (`split_rows`) cuts finer.
const MIN_PIECE_ROWS: u64 = 8192;

/// Cut one file (or its assigned range) at row group boundaries into ranges holding about
/// `split_bytes` of row groups each and at most what `limit` allows; then (only under a row
/// limit) a row group larger than these limits is cut into pieces of consecutive rows, each
/// a range holding only that row group and a row selection of the piece's rows.
fn row_group_ranges(
    file: &PartitionedFile,
    groups: &[RowGroupSpan],
    split_bytes: u64,
    limit: ModelSplitLimit,
) -> Vec<PartitionedFile> {
    let (start, end) = byte_range(file);
    let (rows_cap, data_cap) = match (limit.rows, limit.data_bytes) {
        (0, _) => (u64::MAX, u64::MAX),
        (rows, 0) => (rows, u64::MAX),
        (rows, data) => (rows, data),
    };
    let split_bytes = split_bytes.max(1);
    // Row groups in the range, with their index in the file.
    let mut inside: Vec<(usize, RowGroupSpan)> = groups
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, g)| g.offset >= start && g.offset < end)
        .collect();
    inside.sort_unstable_by_key(|(_, g)| g.offset);
    // Where the range of the k-th row group in it ends: at the next one's start.
    let range_end = |k: usize| inside.get(k + 1).map_or(end, |(_, g)| g.offset);
    let piece = |from: u64, to: u64, selection: Option<ParquetAccessPlan>| {
        let mut piece = file.clone();
        piece.range = Some(datafusion::datasource::listing::FileRange {
            start: from as i64,
            end: to as i64,
        });
        if let Some(plan) = selection {
            piece = piece.with_extension(plan);
        }
        piece
    };
    // Pieces of one row group need a row selection, which a file read through an access
    // plan of its own cannot take.
    let can_select = !file.extensions.contains::<ParquetAccessPlan>();
    let mut out = vec![];
    // The whole row groups gathered for the next range: its start, bytes, rows and data.
    let mut open: Option<u64> = None;
    let (mut bytes, mut rows, mut data) = (0u64, 0u64, 0u64);
    for (k, (index, group)) in inside.iter().enumerate() {
        // Only under a row limit: a piece is read through a row selection, and without a
        // page index (DataFusion loads one only for a pruning predicate) each piece reads
        // its whole row group's column chunks, which costs more than it shares out where
        // rows are cheap (TPC-H's 1M-row row groups would be read ~10 times over).
        let pieces = if limit.rows == 0 {
            1
        } else {
            (group.bytes.div_ceil(split_bytes))
                .min(group.rows.div_ceil(MIN_PIECE_ROWS))
                .max(group.rows.div_ceil(limit.rows_of(group)))
                .min(group.rows)
        };
        if pieces > 1 && can_select {
            if let Some(from) = open.take() {
                out.push(piece(from, group.offset, None));
            }
            let per_piece = group.rows.div_ceil(pieces);
            let mut first = 0;
            while first < group.rows {
                let last = (first + per_piece).min(group.rows);
                let plan = rows_of_row_group(groups.len(), *index, group.rows, first, last);
                let from = if out.is_empty() { start } else { group.offset };
                out.push(piece(from, range_end(k), Some(plan)));
                first = last;
            }
            (bytes, rows, data) = (0, 0, 0);
            continue;
        }
        let from = *open.get_or_insert(if out.is_empty() { start } else { group.offset });
        bytes += group.bytes;
        rows += group.rows;
        data += group.data_bytes;
        let next_overflows = inside.get(k + 1).is_some_and(|(_, next)| {
            rows + next.rows > rows_cap || data + next.data_bytes > data_cap || bytes >= split_bytes
        });
        if next_overflows || k + 1 == inside.len() {
            out.push(piece(from, range_end(k), None));
            open = None;
            (bytes, rows, data) = (0, 0, 0);
        }
    }
    // A range no row group starts in reads nothing: it makes no split (a partition left
    // with none reads an empty scan), so dealing splits out counts only real ones.
    out
}

/// An access plan reading rows `first..last` of row group `index` (of `rows` rows) of a
/// file of `row_groups` row groups, and nothing else.
fn rows_of_row_group(
    row_groups: usize,
    index: usize,
    rows: u64,
    first: u64,
    last: u64,
) -> ParquetAccessPlan {
    let mut selectors = vec![];
    if first > 0 {
        selectors.push(RowSelector::skip(first as usize));
    }
    selectors.push(RowSelector::select((last - first) as usize));
    if last < rows {
        selectors.push(RowSelector::skip((rows - last) as usize));
    }
    let mut plan = ParquetAccessPlan::new_none(row_groups);
    plan.set(
        index,
        RowGroupAccess::Selection(RowSelection::from(selectors)),
    );
    plan
}

/// Cut one file (or its assigned range) into ranges of at most `split_bytes`.
fn byte_ranges(file: &PartitionedFile, split_bytes: u64) -> Vec<PartitionedFile> {
    let (start, end) = byte_range(file);
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
            if self.drops_join_filtered_rows {
                write!(f, ", drops_join_filtered_rows=true")?;
            }
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
        let inputs = context.session_config().get_extension::<TaskInputs>();
        let split = inputs.as_ref().map(|t| t.split).unwrap_or(0);
        let scan = self
            .splits
            .get(partition)
            .and_then(|s| s.get(split))
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "SplitSourceExec has no split {split} of partition {partition}"
                ))
            })?;
        // Rows its joins' finished dynamic filters reject are dropped as they are read;
        // the task's first run decides whether, and a recompute follows it.
        let mut filter = None;
        let filters_rows = self.drops_join_filtered_rows
            && inputs.as_ref().is_some_and(|inputs| {
                *inputs.scan_row_filter.get_or_init(|| {
                    filter = join_filter_rows::complete_join_filter(scan);
                    filter.is_some()
                })
            });
        let filter = match filters_rows {
            true => filter.or_else(|| join_filter_rows::complete_join_filter(scan)),
            false => None,
        };
        let stream = scan.execute(0, context)?;
        Ok(match filter {
            Some(filter) => {
                let dropped = self.dropped_rows.get_or_init(|| {
                    MetricBuilder::new(&self.metrics).global_counter("join_filter_dropped_rows")
                });
                join_filter_rows::drop_rejected_rows(stream, filter, dropped.clone())
            }
            None => stream,
        })
    }

    fn metrics(&self) -> Option<MetricsSet> {
        // The splits' scans share one Parquet source and so one set of counters: count
        // each counter once, not once per split.
        let mut set = self.metrics.clone_inner();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn file(size: u64) -> PartitionedFile {
        PartitionedFile::new("f.parquet", size)
    }

    /// A limit of `rows` rows alone.
    fn rows(rows: u64) -> ModelSplitLimit {
        ModelSplitLimit {
            rows,
            data_bytes: 0,
        }
    }

    fn spans(groups: &[(u64, u64)]) -> Vec<RowGroupSpan> {
        let mut offset = 4;
        groups
            .iter()
            .map(|&(bytes, rows)| {
                let span = RowGroupSpan {
                    offset,
                    bytes,
                    rows,
                    data_bytes: 0,
                };
                offset += bytes;
                span
            })
            .collect()
    }

    /// Each piece as (range start, range end, rows it reads of each row group: `None` for
    /// whole row groups).
    /// A piece: its byte range, and (row group, rows read) of a row selection.
    type Piece = (i64, i64, Option<Vec<(usize, usize)>>);

    fn layout(pieces: &[PartitionedFile]) -> Vec<Piece> {
        pieces
            .iter()
            .map(|p| {
                let range = p.range.clone().unwrap();
                let selected = p.extension::<ParquetAccessPlan>().map(|plan| {
                    plan.inner()
                        .iter()
                        .enumerate()
                        .filter_map(|(i, access)| match access {
                            RowGroupAccess::Selection(s) => Some((i, s.row_count())),
                            RowGroupAccess::Scan => Some((i, usize::MAX)),
                            RowGroupAccess::Skip => None,
                        })
                        .collect()
                });
                (range.start, range.end, selected)
            })
            .collect()
    }

    #[test]
    fn whole_row_groups_are_gathered_up_to_the_byte_size() {
        let groups = spans(&[(100, 10), (100, 10), (100, 10)]);
        let pieces = row_group_ranges(&file(400), &groups, 150, ModelSplitLimit::NONE);
        assert_eq!(
            layout(&pieces),
            vec![(0, 204, None), (204, 400, None)],
            "two groups reach 150 bytes; the third is a range of its own"
        );
    }

    #[test]
    fn a_row_group_over_the_byte_size_is_read_in_row_selections() {
        // One row group of 100,000 rows and 1,000 bytes, splits of 300 bytes: four pieces
        // of 25,000 rows, together every row once.
        let groups = spans(&[(50, 10), (1000, 100_000), (50, 10)]);
        let pieces = row_group_ranges(&file(1200), &groups, 300, rows(1 << 30));
        let layout = layout(&pieces);
        assert_eq!(layout[0], (0, 54, None));
        for piece in &layout[1..5] {
            assert_eq!((piece.0, piece.1), (54, 1054));
            assert_eq!(piece.2, Some(vec![(1, 25_000)]));
        }
        assert_eq!(layout[5], (1054, 1200, None));
        assert_eq!(layout.len(), 6);
        // The selections are consecutive: rows 0..25,000, 25,000..50,000, ...
        let plan = pieces[2].extension::<ParquetAccessPlan>().unwrap();
        let RowGroupAccess::Selection(selection) = &plan.inner()[1] else {
            panic!("a selection")
        };
        let selectors: Vec<_> = selection.iter().map(|s| (s.skip, s.row_count)).collect();
        assert_eq!(
            selectors,
            vec![(true, 25_000), (false, 25_000), (true, 50_000)]
        );
        // Cut for bytes, a piece holds at least a batch of rows: a 10,000-row group over
        // the size is cut in two, not in four.
        let groups = spans(&[(1000, 10_000)]);
        assert_eq!(
            row_group_ranges(&file(1100), &groups, 300, rows(1 << 30)).len(),
            2
        );
        // Without a row limit (plans without a model), row groups stay whole.
        assert_eq!(
            row_group_ranges(&file(1100), &groups, 300, ModelSplitLimit::NONE).len(),
            1
        );
        // A byte range no row group starts in (the tail of a small file cut in byte
        // ranges) makes no split at all.
        let tail = file(1100).with_range(500, 1100);
        assert!(row_group_ranges(&tail, &groups, 300, rows(1 << 30)).is_empty());
    }

    #[test]
    fn a_row_limit_cuts_by_rows_too() {
        // Small row groups gathered up to 2,500 rows; a 6,000-row one cut in three.
        let groups = spans(&[(10, 1000), (10, 1000), (10, 1000), (10, 6000)]);
        let layout = layout(&row_group_ranges(&file(100), &groups, 1 << 20, rows(2500)));
        assert_eq!(layout[0], (0, 24, None), "two groups: 2,000 rows");
        assert_eq!(layout[1], (24, 34, None));
        assert_eq!(layout.len(), 5);
        for piece in &layout[2..] {
            assert_eq!(piece.2, Some(vec![(3, 2000)]));
        }
    }

    #[test]
    fn wide_rows_make_splits_of_fewer_rows() {
        // Three row groups of 1,000 rows: narrow (1 MB of data), then ten times as wide.
        // Under 8,192 rows and 2 MB of data a split: the narrow ones gather two by two...
        let mut groups = spans(&[(10, 1000), (10, 1000), (10, 1000), (10, 1000)]);
        for (group, data) in groups.iter_mut().zip([1, 1, 10, 10]) {
            group.data_bytes = data << 20;
        }
        let limit = ModelSplitLimit {
            rows: 8192,
            data_bytes: 2 << 20,
        };
        let layout = layout(&row_group_ranges(&file(100), &groups, 1 << 20, limit));
        assert_eq!(layout[0], (0, 24, None), "the two narrow groups: 2 MB");
        // ...and each wide one is cut into five pieces of 200 rows (2 MB each).
        assert_eq!(layout.len(), 11, "{layout:?}");
        for piece in &layout[1..6] {
            assert_eq!(piece.2, Some(vec![(2, 200)]));
        }
        for piece in &layout[6..] {
            assert_eq!(piece.2, Some(vec![(3, 200)]));
        }
        // Without a row limit (plans without a model) the data bytes change nothing.
        let unlimited = ModelSplitLimit {
            rows: 0,
            data_bytes: 2 << 20,
        };
        assert_eq!(
            row_group_ranges(&file(100), &groups, 1 << 20, unlimited).len(),
            1
        );
    }

    #[test]
    fn a_row_limit_shares_a_small_scan_out_over_the_slots() {
        // 5,000 rows, 16 slots: 313 rows a split; never under the first block's 256 rows.
        assert_eq!(shared_split_rows(8192, Some(5000), 256, 16), 313);
        assert_eq!(shared_split_rows(8192, Some(1000), 256, 16), 256);
        // A large scan keeps its limit; no limit, one slot or unknown rows change nothing.
        assert_eq!(shared_split_rows(8192, Some(10_000_000), 256, 16), 8192);
        assert_eq!(shared_split_rows(0, Some(5000), 256, 16), 0);
        assert_eq!(shared_split_rows(8192, Some(5000), 256, 1), 8192);
        assert_eq!(shared_split_rows(8192, None, 256, 16), 8192);
    }

    #[test]
    fn a_file_with_an_access_plan_of_its_own_keeps_whole_row_groups() {
        let groups = spans(&[(1000, 1000)]);
        let own = file(1100).with_extension(ParquetAccessPlan::new_all(1));
        let pieces = row_group_ranges(&own, &groups, 100, rows(1 << 30));
        assert_eq!(pieces.len(), 1);
        assert_eq!(
            pieces[0].extension::<ParquetAccessPlan>(),
            Some(&ParquetAccessPlan::new_all(1))
        );
    }

    /// A Parquet scan of `a` (Int64) in files partitioned by `part` (Utf8), filtered by
    /// `predicate`.
    fn filtered_scan(predicate: Arc<dyn PhysicalExpr>) -> FileScanConfig {
        use datafusion::arrow::datatypes::{DataType, Field};
        use datafusion::datasource::table_schema::TableSchema;
        use datafusion::execution::object_store::ObjectStoreUrl;
        let files = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let part = Arc::new(Field::new("part", DataType::Utf8, false));
        let source = ParquetSource::new(
            TableSchema::builder(files)
                .with_table_partition_cols(vec![part])
                .build(),
        )
        .with_predicate(predicate);
        FileScanConfigBuilder::new(ObjectStoreUrl::local_filesystem(), Arc::new(source)).build()
    }

    /// A file of partition `part` whose `a` lies in `[min, max]` (no statistics: `None`).
    fn file_of(part: &str, range: Option<(i64, i64)>) -> PartitionedFile {
        use datafusion::common::stats::{ColumnStatistics, Precision, Statistics};
        let mut file = file(1000).with_partition_values(vec![ScalarValue::from(part)]);
        if let Some((min, max)) = range {
            let column = ColumnStatistics {
                min_value: Precision::Exact(ScalarValue::from(min)),
                max_value: Precision::Exact(ScalarValue::from(max)),
                null_count: Precision::Exact(0),
                ..ColumnStatistics::new_unknown()
            };
            file = file.with_statistics(Arc::new(Statistics {
                num_rows: Precision::Exact(10),
                total_byte_size: Precision::Absent,
                column_statistics: vec![column, ColumnStatistics::new_unknown()],
            }));
        }
        file
    }

    #[test]
    fn a_range_its_statistics_rule_out_makes_no_split() {
        use datafusion::logical_expr::Operator;
        use datafusion::physical_expr::expressions::{BinaryExpr, Column};
        let a = || Arc::new(Column::new("a", 0)) as Arc<dyn PhysicalExpr>;
        let compare = |left: Arc<dyn PhysicalExpr>, op, right: Arc<dyn PhysicalExpr>| {
            Arc::new(BinaryExpr::new(left, op, right)) as Arc<dyn PhysicalExpr>
        };
        // a = 15
        let pruning =
            StaticFilePruning::of(&filtered_scan(compare(a(), Operator::Eq, lit(15i64)))).unwrap();
        assert!(pruning.prunes(&file_of("x", Some((20, 30)))));
        assert!(pruning.prunes(&file_of("x", Some((0, 14)))));
        assert!(!pruning.prunes(&file_of("x", Some((10, 20)))));
        assert!(!pruning.prunes(&file_of("x", None)), "no statistics: kept");

        // part = 'x' AND a = 15: the partition column (not in the files) takes each range's
        // value, and the file column's statistics still prune.
        let part = Arc::new(Column::new("part", 1)) as Arc<dyn PhysicalExpr>;
        let both = compare(
            compare(part, Operator::Eq, lit("x")),
            Operator::And,
            compare(a(), Operator::Eq, lit(15i64)),
        );
        let pruning = StaticFilePruning::of(&filtered_scan(both)).unwrap();
        assert!(pruning.prunes(&file_of("x", Some((20, 30)))));
        assert!(!pruning.prunes(&file_of("x", Some((10, 20)))));

        // A join's dynamic filter counts as `true`, even once it would rule a range out:
        // the splits must be the same whenever the plan is cut.
        let dynamic = Arc::new(DynamicFilterPhysicalExpr::new(vec![a()], lit(true)));
        dynamic
            .update(compare(a(), Operator::Gt, lit(100i64)))
            .unwrap();
        let both = compare(
            compare(a(), Operator::GtEq, lit(10i64)),
            Operator::And,
            dynamic as Arc<dyn PhysicalExpr>,
        );
        let pruning = StaticFilePruning::of(&filtered_scan(both)).unwrap();
        assert!(!pruning.prunes(&file_of("x", Some((10, 20)))));
        assert!(pruning.prunes(&file_of("x", Some((0, 9)))));
    }

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

    #[test]
    fn small_ranges_are_packed_into_splits_of_several() {
        let small = |name: &str, size: u64| PartitionedFile::new(name, size);
        let sizes = |packs: &[Vec<PartitionedFile>]| -> Vec<Vec<u64>> {
            packs
                .iter()
                .map(|p| p.iter().map(|f| f.object_meta.size).collect())
                .collect()
        };
        let none = RowGroupLayout::default();
        let ranges = vec![
            small("a", 10),
            small("b", 40),
            small("c", 50),
            small("d", 30),
            small("e", 200),
            small("f", 20),
            small("g", 20).with_extension(ParquetAccessPlan::new_all(1)),
            small("h", 5),
        ];
        let packed = |single| {
            let packs =
                pack_small_ranges(ranges.clone(), 100, ModelSplitLimit::NONE, &none, single);
            sizes(&packs)
        };
        // Splits of 100 bytes, no ramp: 10 + 40 + 50 fill one; 30 starts the next; the
        // 200-byte file stands alone; so does the piece read through an access plan.
        let alone = |size| vec![size];
        assert_eq!(
            packed(0),
            vec![
                vec![10, 40, 50],
                alone(30),
                alone(200),
                alone(20),
                alone(20),
                alone(5)
            ]
        );
        // The first two (ramped) splits read one range each.
        assert_eq!(
            packed(2),
            [
                alone(10),
                alone(40),
                vec![50, 30],
                alone(200),
                alone(20),
                alone(20),
                alone(5)
            ]
        );
        // Under a row limit, ranges whose rows no footer gives are not packed.
        assert_eq!(
            pack_small_ranges(ranges, 100, rows(1000), &none, 0).len(),
            8
        );
    }

    /// Partitions as the byte ranges (start) of their splits.
    fn starts(partitions: &[Vec<PartitionedFile>]) -> Vec<Vec<i64>> {
        partitions
            .iter()
            .map(|p| p.iter().map(|f| f.range.clone().unwrap().start).collect())
            .collect()
    }

    fn ranged(starts: &[i64]) -> Vec<PartitionedFile> {
        starts
            .iter()
            .map(|&s| file(1000).with_range(s, s + 1))
            .collect()
    }

    #[test]
    fn splits_crowded_into_few_partitions_are_dealt_out_over_all() {
        // Two large row groups, cut in 4 pieces each, fell into partitions 0 and 2 of 4.
        let crowded = vec![
            ranged(&[0, 1, 2, 3]),
            vec![],
            ranged(&[10, 11, 12, 13]),
            vec![],
        ];
        assert_eq!(
            starts(&deal_out(crowded)),
            vec![vec![0, 2], vec![10, 12], vec![1, 3], vec![11, 13]]
        );
        // Partitions holding as many splits as each other keep theirs, in order.
        let even = vec![ranged(&[0, 1]), ranged(&[10, 11]), ranged(&[20, 21])];
        assert_eq!(starts(&deal_out(even.clone())), starts(&even));
        // Fewer splits than partitions: one each, the rest stay empty.
        let few = vec![ranged(&[0, 1, 2]), vec![], vec![], vec![], vec![]];
        assert_eq!(
            starts(&deal_out(few)),
            vec![vec![0], vec![1], vec![2], vec![], vec![]]
        );
    }
}
