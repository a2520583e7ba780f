//! `SplitSourceExec`: a Parquet scan cut into deterministic source splits.
//!
//! Each partition's file group is cut into byte ranges of at most `flumen.split_bytes`;
//! a source task reads one range (the row groups whose midpoint falls inside it). The same
//! split always reads the same rows, which is what lineage recompute relies on.

use std::fmt;
use std::sync::Arc;

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::execution_plan::ReplaceChildrenOptions;
use datafusion::physical_plan::metrics::MetricsSet;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties,
};

use crate::stage_input::TaskInputs;

/// A Parquet scan whose partitions are read split by split.
#[derive(Debug)]
pub struct SplitSourceExec {
    original: Arc<dyn ExecutionPlan>,
    /// `splits[partition][split]`: a one-partition scan of that byte range.
    splits: Vec<Vec<Arc<dyn ExecutionPlan>>>,
}

impl SplitSourceExec {
    /// Cut the scan `original` (whose data source is `config`) into splits.
    pub fn try_new(
        original: Arc<dyn ExecutionPlan>,
        config: &FileScanConfig,
        split_bytes: u64,
    ) -> Result<Self> {
        let split_bytes = split_bytes.max(1);
        let mut splits = vec![];
        for group in &config.file_groups {
            let mut scans: Vec<Arc<dyn ExecutionPlan>> = vec![];
            for file in group.iter() {
                for range_file in byte_ranges(file, split_bytes) {
                    let cfg = FileScanConfigBuilder::from(config.clone())
                        .with_file_groups(vec![FileGroup::new(vec![range_file])])
                        .build();
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
