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

use std::fmt;
use std::sync::{Arc, OnceLock};

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::{ParquetAccessPlan, RowGroupAccess};
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::parquet::arrow::arrow_reader::{RowSelection, RowSelector};
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PhysicalExpr, PlanProperties,
};

use crate::plan::dynamic_filters::BoundSwaps;
use crate::plan::join_filter_rows;
use crate::plan::row_group_layout::{RowGroupLayout, RowGroupSpan, byte_range};
use crate::plan::split_pruning::{PrunedBeforeTasks, StaticFilePruning};
use crate::plan::stage_input::TaskInputs;
use crate::plan::task_topk::LastFirst;

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
    splits: Arc<Vec<Vec<Arc<dyn ExecutionPlan>>>>,
    /// How many first splits of each partition read small batches.
    ramped_splits: usize,
    /// Drops the rows its joins' finished dynamic filters reject
    /// ([`crate::plan::join_filter_rows`]): set where a grouped aggregate reads the scan.
    drops_join_filtered_rows: bool,
    /// Its own counters, beside the scans' shared ones: `join_filter_dropped_rows`, made
    /// when a task first drops rows.
    metrics: ExecutionPlanMetricsSet,
    dropped_rows: Arc<OnceLock<Count>>,
    /// What one task's split reads in place of the dynamic filters of its predicate
    /// ([`BoundSwaps`]): set in a task's copy.
    bound_swaps: Option<Arc<BoundSwaps>>,
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
        let mut pruning = StaticFilePruning::of(config);
        let mut pruned = PrunedBeforeTasks::default();
        // Each file's verdict by its statistics, in the order the groups list them.
        let mut files_pruned = match pruning.as_ref() {
            Some(pruning) => {
                let files: Vec<&PartitionedFile> =
                    config.file_groups.iter().flat_map(|g| g.iter()).collect();
                pruning.files_pruned(&files)
            }
            None => vec![],
        }
        .into_iter();
        let mut ranges: Vec<Vec<PartitionedFile>> = vec![];
        for group in config.file_groups.iter() {
            let mut kept = vec![];
            for file in group.iter() {
                let file_ranges = match layout.row_groups(file) {
                    Some(groups) => {
                        let ranges = row_group_ranges(file, groups, split_bytes, limit);
                        without_skipped_ranges(ranges, groups)
                    }
                    None => byte_ranges(file, split_bytes),
                };
                match pruning.as_mut() {
                    Some(pruning) => {
                        let file_pruned = files_pruned.next().unwrap_or(false);
                        kept.extend(pruning.keep(
                            file,
                            file_pruned,
                            file_ranges,
                            layout,
                            &mut pruned,
                        ))
                    }
                    None => kept.extend(file_ranges),
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
            splits: Arc::new(splits),
            ramped_splits,
            drops_join_filtered_rows: false,
            metrics,
            dropped_rows: Arc::default(),
            bound_swaps: None,
        })
    }

    /// The same scan, dropping (`drops`) the rows its joins' finished dynamic filters
    /// reject before a grouped aggregate above it in its fragment sees them
    /// ([`crate::plan::join_filter_rows`]).
    pub fn dropping_join_filtered_rows(mut self, drops: bool) -> Self {
        self.drops_join_filtered_rows = drops;
        self
    }

    /// Whether it drops the rows its joins' finished dynamic filters reject
    /// ([`Self::dropping_join_filtered_rows`]).
    pub fn drops_join_filtered_rows(&self) -> bool {
        self.drops_join_filtered_rows
    }

    /// A task's copy, whose split reads what `swaps` puts in place of the dynamic filters
    /// of its predicate (the task's own bounds, and those it starts from).
    pub fn with_bound_swaps(&self, swaps: Arc<BoundSwaps>) -> Self {
        Self {
            original: Arc::clone(&self.original),
            splits: Arc::clone(&self.splits),
            ramped_splits: self.ramped_splits,
            drops_join_filtered_rows: self.drops_join_filtered_rows,
            metrics: self.metrics.clone(),
            dropped_rows: Arc::clone(&self.dropped_rows),
            bound_swaps: Some(swaps),
        }
    }

    /// The one-partition scan of split `split` of `partition` (reading a task's bounds in
    /// a task's copy).
    pub fn split_plan(&self, partition: usize, split: usize) -> Option<Arc<dyn ExecutionPlan>> {
        let scan = self.splits.get(partition)?.get(split)?;
        match &self.bound_swaps {
            Some(swaps) => swaps.apply_to(Arc::clone(scan)).ok(),
            None => Some(Arc::clone(scan)),
        }
    }

    /// Number of splits of each partition.
    pub fn splits_per_partition(&self) -> Vec<usize> {
        self.splits.iter().map(|s| s.len()).collect()
    }

    /// The same scan with its splits read last first: for a TopK in the reverse of the
    /// files' order (`ORDER BY ts DESC` over files sorted by `ts`), whose first splits then
    /// make the bound that prunes the rest. "Last" is by the files' statistics of the sort
    /// column (`by`), a file's later byte ranges after its earlier ones: the list's order
    /// cannot tell, as DataFusion's sort pushdown may already have reversed each group's
    /// files. Without statistics for every split, the list's order reversed. Where the scan
    /// promises no partitioning, all its splits, last first, are dealt out over the
    /// partitions in turn (the first of each partition are the last of the table);
    /// otherwise each partition's are put in that order. Only for a reader that needs no
    /// order of its partitions' rows.
    pub fn read_last_first(&self, by: &LastFirst) -> Self {
        let splits: Vec<Vec<_>> = match self.original.properties().output_partitioning() {
            Partitioning::UnknownPartitioning(_) if !self.splits.is_empty() => {
                let partitions = self.splits.len();
                let mut dealt = vec![vec![]; partitions];
                let last_first = by.order(self.splits.iter().flatten().cloned().collect());
                for (i, split) in last_first.into_iter().enumerate() {
                    dealt[i % partitions].push(split);
                }
                dealt
            }
            _ => (self.splits.iter())
                .map(|partition| by.order(partition.clone()))
                .collect(),
        };
        Self {
            original: Arc::clone(&self.original),
            splits: Arc::new(splits),
            ramped_splits: self.ramped_splits,
            drops_join_filtered_rows: self.drops_join_filtered_rows,
            metrics: self.metrics.clone(),
            dropped_rows: Arc::clone(&self.dropped_rows),
            bound_swaps: self.bound_swaps.clone(),
        }
    }
}

/// `ranges` without those whose every row group their file's access plan skips (a
/// `TABLESAMPLE SYSTEM`'s row groups not sampled, [`crate::plan::row_group_samples`]): a
/// task would open such a range and read nothing. `groups`: the file's row groups.
fn without_skipped_ranges(
    ranges: Vec<PartitionedFile>,
    groups: &[RowGroupSpan],
) -> Vec<PartitionedFile> {
    ranges
        .into_iter()
        .filter(|range| {
            let Some(access) = range.extensions.get::<ParquetAccessPlan>() else {
                return true;
            };
            let (start, end) = byte_range(range);
            let mut inside = (groups.iter().enumerate())
                .filter(|(_, g)| g.offset >= start && g.offset < end)
                .map(|(i, _)| i)
                .peekable();
            inside.peek().is_none() || inside.any(|i| access.should_scan(i))
        })
        .collect()
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
    // The file's own access plan (a `TABLESAMPLE SYSTEM`'s row groups), if any.
    let own = file.extensions.get::<ParquetAccessPlan>();
    // Row groups in the range that the file's own plan does not skip, with their index in
    // the file (a skipped one is read by none: the range before it covers its bytes).
    let mut inside: Vec<(usize, RowGroupSpan)> = groups
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, g)| g.offset >= start && g.offset < end)
        .filter(|(index, _)| own.is_none_or(|plan| plan.should_scan(*index)))
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
    // Pieces of one row group need a row selection: a row group the file's own plan reads
    // whole can take one (the piece's plan reads that row group alone), one it reads
    // through a selection of its own cannot.
    let can_select = |index: usize| {
        own.is_none_or(|plan| matches!(plan.inner().get(index), Some(RowGroupAccess::Scan)))
    };
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
        if pieces > 1 && can_select(*index) {
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
        // Rows the bounds from its joins' build sides reject (settled before the task
        // launched, the same for every run of it) are dropped as they are read.
        let from_build_sides = match (&self.bound_swaps, &inputs) {
            (Some(swaps), Some(inputs)) => {
                let ids = inputs.dropping_by.for_split(self.drops_join_filtered_rows);
                match ids.is_empty() {
                    true => None,
                    false => join_filter_rows::bounds_on_output(scan, swaps, ids)?,
                }
            }
            _ => None,
        };
        // Else, under a grouped aggregate, those its joins' finished dynamic filters
        // reject; the task's first run decides whether, and a recompute follows it.
        let mut filter = None;
        let filters_rows = from_build_sides.is_none()
            && self.drops_join_filtered_rows
            && inputs.as_ref().is_some_and(|inputs| {
                *inputs.scan_row_filter.get_or_init(|| {
                    filter = join_filter_rows::complete_join_filter(scan);
                    filter.is_some()
                })
            });
        let filter = match filters_rows {
            true => filter.or_else(|| join_filter_rows::complete_join_filter(scan)),
            false => from_build_sides,
        };
        let swapped;
        let scan = match &self.bound_swaps {
            Some(swaps) => {
                swapped = swaps.apply_to(Arc::clone(scan))?;
                &swapped
            }
            None => scan,
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
    fn a_file_with_a_row_selection_of_its_own_keeps_whole_row_groups() {
        let groups = spans(&[(1000, 1000)]);
        let selection = RowSelection::from(vec![RowSelector::select(10)]);
        let mut plan = ParquetAccessPlan::new_all(1);
        plan.set(0, RowGroupAccess::Selection(selection));
        let own = file(1100).with_extension(plan.clone());
        let pieces = row_group_ranges(&own, &groups, 100, rows(1 << 30));
        assert_eq!(pieces.len(), 1);
        assert_eq!(pieces[0].extension::<ParquetAccessPlan>(), Some(&plan));
    }

    /// A sampled file (`TABLESAMPLE SYSTEM`: its own plan skips row group 0 and reads row
    /// group 1 whole) under a model's row limit: row group 1 is cut into pieces, row group
    /// 0 into none.
    #[test]
    fn a_sampled_files_kept_row_groups_are_cut_into_pieces() {
        let groups = spans(&[(1000, 100_000), (1000, 100_000)]);
        let mut sampled = ParquetAccessPlan::new_all(2);
        sampled.skip(0);
        let own = file(2100).with_extension(sampled);
        let pieces = row_group_ranges(&own, &groups, 300, rows(1 << 30));
        assert_eq!(pieces.len(), 4, "{pieces:?}");
        for piece in &pieces {
            let plan = piece.extension::<ParquetAccessPlan>().unwrap();
            assert!(!plan.should_scan(0) && plan.should_scan(1), "{plan:?}");
        }
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
