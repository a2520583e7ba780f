//! `TABLESAMPLE SYSTEM (p)` of a Parquet table: whole row groups, each kept with probability
//! `p`/100, and those not kept are never read.
//!
//! As BigQuery's and Snowflake's `SYSTEM` sample storage blocks, flumen's samples row
//! groups: a row group is kept when a hash of the seed, its file's path within the table
//! and its index in the file falls below `p`/100 of the 64-bit range ([`row_group_kept`]). The scan reads the
//! others through a `ParquetAccessPlan` that skips them, so a 1% sample reads about 1% of
//! the table; the split cutter makes no task for a range whose row groups are all skipped.
//! The rows come in blocks (a row group of a million rows is kept or dropped whole): for a
//! sample of rows independent of each other, `BERNOULLI` reads everything.
//!
//! The choice is the row group's own, so filters commute with it: the node lets filters
//! pass below it (row groups are still pruned by a `WHERE`), and columns (it reads only
//! what the query does).

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::DFSchemaRef;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::datasource::physical_plan::parquet::{ParquetAccessPlan, RowGroupAccess};
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore,
};
use datafusion::parquet::file::metadata::PageIndexPolicy;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_planner::{ExtensionPlanner, PhysicalPlanner};
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectMeta;

use crate::plan::sample_keys::mix;

/// Footers read at once.
const FOOTERS_AT_ONCE: usize = 32;

/// The logical node: its input (a Parquet listing table's scan) with only the sampled row
/// groups read.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd)]
pub struct RowGroupSampleNode {
    input: LogicalPlan,
    seed: u64,
    /// A row group is kept when its key is below this.
    threshold: u64,
    /// The table's roots: a file is named by its path within them
    /// ([`path_in_table`]).
    roots: Vec<String>,
}

impl RowGroupSampleNode {
    /// Row groups of `input` (a scan of the table at `roots`) kept when their key is below
    /// `threshold`, drawn with `seed`.
    pub fn new(input: LogicalPlan, seed: u64, threshold: u64, roots: Vec<String>) -> Self {
        Self {
            input,
            seed,
            threshold,
            roots,
        }
    }

    /// The node as a logical plan.
    pub fn into_plan(self) -> LogicalPlan {
        LogicalPlan::Extension(Extension {
            node: Arc::new(self),
        })
    }
}

impl UserDefinedLogicalNodeCore for RowGroupSampleNode {
    fn name(&self) -> &str {
        "RowGroupSample"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        self.input.schema()
    }

    fn expressions(&self) -> Vec<Expr> {
        vec![]
    }

    fn prevent_predicate_push_down_columns(&self) -> HashSet<String> {
        // Whether a row group is kept does not depend on its rows: filters commute.
        HashSet::new()
    }

    fn necessary_children_exprs(&self, output_columns: &[usize]) -> Option<Vec<Vec<usize>>> {
        // The same columns as its input: it reads only those the query does.
        Some(vec![output_columns.to_vec()])
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let share = self.threshold as f64 / 2f64.powi(64) * 100.0;
        write!(f, "RowGroupSample: seed={}, share={share:.4}%", self.seed)
    }

    fn with_exprs_and_inputs(
        &self,
        _exprs: Vec<Expr>,
        mut inputs: Vec<LogicalPlan>,
    ) -> Result<Self> {
        let input = inputs.pop().filter(|_| inputs.is_empty()).ok_or_else(|| {
            DataFusionError::Internal("RowGroupSample takes exactly one input".into())
        })?;
        Ok(Self::new(
            input,
            self.seed,
            self.threshold,
            self.roots.clone(),
        ))
    }
}

/// Plans a [`RowGroupSampleNode`] as its input's plan whose Parquet scan skips the row
/// groups not sampled (the footers are read here, through the session's cache).
#[derive(Debug, Default)]
pub struct RowGroupSamplePlanner;

#[async_trait]
impl ExtensionPlanner for RowGroupSamplePlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        session: &dyn Session,
        _planning: &PhysicalPlanningContext,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(sample) = node.as_any().downcast_ref::<RowGroupSampleNode>() else {
            return Ok(None);
        };
        let [input] = physical_inputs else {
            return Err(DataFusionError::Internal(
                "RowGroupSample takes exactly one input".into(),
            ));
        };
        let mut scan = None;
        input.apply(|node| {
            if let Some(config) = parquet_scan(node) {
                scan = Some((Arc::clone(node), config.clone()));
                return Ok(TreeNodeRecursion::Stop);
            }
            Ok(TreeNodeRecursion::Continue)
        })?;
        let Some((original, config)) = scan else {
            return Err(DataFusionError::Internal(
                "TABLESAMPLE SYSTEM's input has no Parquet scan".into(),
            ));
        };
        let sampled = sampled_scan(&config, sample, session).await?;
        let plan = Arc::clone(input).transform_up(|node| {
            Ok(match Arc::ptr_eq(&node, &original) {
                true => Transformed::yes(Arc::clone(&sampled)),
                false => Transformed::no(node),
            })
        })?;
        Ok(Some(plan.data))
    }
}

/// The file scan config of `plan`, a Parquet scan.
fn parquet_scan(plan: &Arc<dyn ExecutionPlan>) -> Option<&FileScanConfig> {
    let config = (plan.downcast_ref::<DataSourceExec>())?
        .data_source()
        .downcast_ref::<FileScanConfig>()?;
    (config.file_source().file_type() == "parquet").then_some(config)
}

/// The scan of `config` reading only the row groups `sample` keeps.
async fn sampled_scan(
    config: &FileScanConfig,
    sample: &RowGroupSampleNode,
    session: &dyn Session,
) -> Result<Arc<dyn ExecutionPlan>> {
    let runtime = session.runtime_env();
    let store = runtime.object_store(&config.object_store_url)?;
    let footers = runtime.cache_manager.get_file_metadata_cache();
    let files: Vec<ObjectMeta> = (config.file_groups.iter())
        .flat_map(|g| g.iter().map(|f| f.object_meta.clone()))
        .collect();
    let counts: Vec<usize> = futures::stream::iter(files.into_iter().map(|file| {
        let (store, footers) = (Arc::clone(&store), Arc::clone(&footers));
        async move {
            let metadata = DFParquetMetadata::new(store.as_ref(), &file)
                .with_file_metadata_cache(Some(footers))
                .with_page_index_policy(Some(PageIndexPolicy::Skip))
                .fetch_metadata()
                .await
                .map_err(|e| {
                    DataFusionError::Plan(format!(
                        "TABLESAMPLE SYSTEM: cannot read the footer of {}: {e}",
                        file.location
                    ))
                })?;
            Ok::<_, DataFusionError>(metadata.num_row_groups())
        }
    }))
    .buffered(FOOTERS_AT_ONCE)
    .try_collect()
    .await?;
    let mut counts = counts.into_iter();
    let groups = (config.file_groups.iter())
        .map(|group| {
            let files = group.iter().map(|file| {
                let row_groups = counts.next().unwrap_or(0);
                let path = path_in_table(file.object_meta.location.as_ref(), &sample.roots);
                let access = (0..row_groups)
                    .map(
                        |i| match row_group_kept(sample.seed, path, i, sample.threshold) {
                            true => RowGroupAccess::Scan,
                            false => RowGroupAccess::Skip,
                        },
                    )
                    .collect();
                let mut file = file.clone().with_extension(ParquetAccessPlan::new(access));
                // A file's rows are no longer its row count: no aggregate answered from it.
                file.statistics =
                    (file.statistics.take()).map(|s| Arc::new(s.as_ref().clone().to_inexact()));
                file
            });
            FileGroup::new(files.collect())
        })
        .collect();
    let config = FileScanConfigBuilder::from(config.clone())
        .with_file_groups(groups)
        .with_statistics(config.statistics().to_inexact())
        .build();
    Ok(DataSourceExec::from_data_source(config))
}

/// Whether row group `row_group` of the file at `path` (its path within its table,
/// [`path_in_table`]) is in the sample drawn with `seed` that keeps keys below
/// `threshold`.
pub fn row_group_kept(seed: u64, path: &str, row_group: usize, threshold: u64) -> bool {
    mix(seed ^ mix(path_hash(path) ^ mix(row_group as u64))) < threshold
}

/// FNV-1a of `path`'s bytes: the same in every process, build and version.
fn path_hash(path: &str) -> u64 {
    path.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Where the file at `path` (as `input_file_name()` states it) lies in the table of
/// `roots`: its path under the root that holds it, or its name where a root is the file
/// itself (a one-file table) or none holds it. What a sample hashes of a file, so the
/// table's own place does not change the rows kept.
pub fn path_in_table<'a>(path: &'a str, roots: &[String]) -> &'a str {
    let name = || path.rsplit('/').next().unwrap_or(path);
    for root in roots {
        if root.is_empty() {
            return path;
        }
        if path == root {
            return name();
        }
        if let Some(rest) = path.strip_prefix(root.as_str())
            && let Some(rest) = rest.strip_prefix('/')
        {
            return rest;
        }
    }
    name()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn about_the_share_of_row_groups_is_kept_and_the_same_each_time() {
        let threshold = (0.25 * 2f64.powi(64)) as u64;
        let kept = (0..10_000)
            .filter(|&i| row_group_kept(7, "data/part-0.parquet", i, threshold))
            .count();
        // 2,500 expected; a binomial's standard deviation is ~43.
        assert!((2_350..2_650).contains(&kept), "{kept}");
        let again = (0..10_000)
            .filter(|&i| row_group_kept(7, "data/part-0.parquet", i, threshold))
            .count();
        assert_eq!(kept, again);
        let other_file = (0..10_000)
            .filter(|&i| {
                row_group_kept(7, "data/part-0.parquet", i, threshold)
                    != row_group_kept(7, "data/part-1.parquet", i, threshold)
            })
            .count();
        assert!(
            other_file > 3_000,
            "another file keeps other row groups: {other_file}"
        );
    }

    #[test]
    fn the_path_hash_is_fnv_1a() {
        assert_eq!(path_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(path_hash("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
