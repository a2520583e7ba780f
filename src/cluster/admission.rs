//! What a worker agrees to run: the plan nodes flumen sends, file scans of the paths the task
//! grants, and the settings a task needs. Anything else is refused with an error that names
//! it, before a single row is read.
//!
//! The driver applies the same rules before it sends a task ([`admit_plan`]): a plan a worker
//! would refuse runs on the driver instead.

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;

/// Plan nodes (by `ExecutionPlan::name`) a worker runs: the scans, the relational operators
/// of a fragment, and the exchange on top. No sink, no `EXPLAIN`/`ANALYZE`, no recursive or
/// streaming-table node, no extension node.
const ALLOWED_NODES: &[&str] = &[
    "DataSourceExec",
    "ProjectionExec",
    "FilterExec",
    "RepartitionExec",
    "CoalesceBatchesExec",
    "CoalescePartitionsExec",
    "CooperativeExec",
    "AggregateExec",
    "HashJoinExec",
    "NestedLoopJoinExec",
    "CrossJoinExec",
    "SortMergeJoinExec",
    "SymmetricHashJoinExec",
    "SortExec",
    "SortExec(TopK)",
    "PartialSortExec",
    "SortPreservingMergeExec",
    "LocalLimitExec",
    "GlobalLimitExec",
    "UnionExec",
    "InterleaveExec",
    "EmptyExec",
    "PlaceholderRowExec",
    "WindowAggExec",
    "BoundedWindowAggExec",
    "UnnestExec",
    // Reads its input ahead into a bounded buffer (DataFusion puts it under a sort pushed
    // into a scan).
    "BufferExec",
    // A fragment that reads scalar subqueries' values from its gathered inputs: the driver's
    // `SubqueryValuesExec` is sent as DataFusion's `ScalarSubqueryExec`.
    "SubqueryValuesExec",
    "ScalarSubqueryExec",
    // A window's per-partition TopK (`enable_window_topn`), sent as a flumen node
    // (`cluster::topk_nodes`).
    "PartitionedTopKExec",
    // `TABLESAMPLE`'s keys for a relation that is not a Parquet table (`plan::sample_keys`,
    // sent as a flumen node).
    "SampleKeysExec",
];

/// File formats a worker scans.
const ALLOWED_FORMATS: &[&str] = &["parquet", "csv", "json", "arrow", "arrow_stream", "avro"];

/// The settings a task may carry to a worker (all else is the worker's own).
pub const WORKER_OPTIONS: &[&str] = &[
    "flumen.device",
    "flumen.model_dir",
    "flumen.embed_batch_size",
    "flumen.embed_batch_tokens",
    "flumen.embed_precision",
    "flumen.embed_passes_in_flight",
    "flumen.target_block_rows",
    "flumen.memory_budget",
    // How the task's worker asks its peers to send the blocks it fetches.
    "flumen.exchange_compression",
    // Where the worker reads and writes the model-output cache (a driver holds the
    // cluster secret: as trusted as the operator).
    "flumen.model_cache",
    "flumen.model_cache_max_bytes",
    // DataFusion's settings that functions read as they run, not only as they are planned:
    // a worker at its own defaults answered `to_unixtime('2024-01-01 03:00:00')` in UTC
    // where the session said Asia/Tokyo.
    "datafusion.execution.time_zone",
    "datafusion.execution.enable_ansi_mode",
    // A task's share of its session's own memory limit, in bytes (`worker_memory`).
    "flumen.task_memory_limit",
];

/// The object stores other than local files that `plan` scans (their URLs).
pub fn scanned_stores(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let mut stores = vec![];
    visit(plan, &mut |node| {
        if let Some(config) = file_scan(node) {
            let url = config
                .object_store_url
                .as_str()
                .trim_end_matches('/')
                .to_string();
            if url != "file:" && !stores.contains(&url) {
                stores.push(url);
            }
        }
    });
    stores
}

/// The files `plan` scans, as object-store paths (what a task's grant lists).
pub fn scanned_files(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let mut files = vec![];
    visit(plan, &mut |node| {
        if let Some(config) = file_scan(node) {
            for group in &config.file_groups {
                for file in group.files() {
                    files.push(file.object_meta.location.to_string());
                }
            }
        }
    });
    files
}

/// Check every node of `plan` against the allowlist, every file it scans against `grants`
/// and every object store it reads against `stores` (URLs; local files are always
/// allowed); the first refusal is the error.
pub fn admit_plan(
    plan: &Arc<dyn ExecutionPlan>,
    grants: &[String],
    stores: &[String],
) -> Result<()> {
    let granted: HashSet<&str> = grants.iter().map(String::as_str).collect();
    let mut refusal = None;
    visit(plan, &mut |node| {
        if refusal.is_none() {
            refusal = admit_node(node, &granted, stores).err();
        }
    });
    match refusal {
        Some(why) => Err(DataFusionError::Execution(format!(
            "flumen worker refuses the task: {why}"
        ))),
        None => Ok(()),
    }
}

/// Check the settings a task carries.
pub fn admit_options(options: &[(String, String)]) -> Result<()> {
    match options
        .iter()
        .find(|(key, _)| !WORKER_OPTIONS.contains(&key.as_str()))
    {
        Some((key, _)) => Err(DataFusionError::Execution(format!(
            "flumen worker refuses the task: setting {key} is not one a task may carry (only {})",
            WORKER_OPTIONS.join(", ")
        ))),
        None => Ok(()),
    }
}

/// Whether workers scan files of `format` (a `FileSource::file_type`).
pub fn reads_format(format: &str) -> bool {
    ALLOWED_FORMATS.contains(&format)
}

/// Whether a plan node named `name` is one flumen sends a worker (a scan's files and store
/// are checked per task).
pub fn sends_node(name: &str) -> bool {
    ALLOWED_NODES.contains(&name)
}

fn admit_node(
    node: &Arc<dyn ExecutionPlan>,
    granted: &HashSet<&str>,
    stores: &[String],
) -> Result<(), String> {
    let name = node.name();
    if !ALLOWED_NODES.contains(&name) {
        return Err(format!("plan node {name} is not one flumen sends"));
    }
    let Some(source) = node.downcast_ref::<DataSourceExec>() else {
        return Ok(());
    };
    if source
        .data_source()
        .downcast_ref::<MemorySourceConfig>()
        .is_some()
    {
        return Ok(());
    }
    let Some(config) = file_scan(node) else {
        return Err("a data source other than a file scan or task input".into());
    };
    let format = config.file_source().file_type();
    if !reads_format(format) {
        return Err(format!("{format} scans are not run by workers"));
    }
    let store = config.object_store_url.as_str();
    if store != "file:///"
        && !stores
            .iter()
            .any(|s| s.trim_end_matches('/') == store.trim_end_matches('/'))
    {
        return Err(format!(
            "a scan of {store}, a store the task does not grant (workers read local files \
             and the stores their task names)"
        ));
    }
    for group in &config.file_groups {
        for file in group.files() {
            let path = file.object_meta.location.as_ref();
            if !granted.contains(path) {
                return Err(format!("a scan of /{path}, which the task does not grant"));
            }
        }
    }
    Ok(())
}

fn file_scan(node: &Arc<dyn ExecutionPlan>) -> Option<&FileScanConfig> {
    node.downcast_ref::<DataSourceExec>()?
        .data_source()
        .downcast_ref::<FileScanConfig>()
}

fn visit(plan: &Arc<dyn ExecutionPlan>, f: &mut impl FnMut(&Arc<dyn ExecutionPlan>)) {
    f(plan);
    for child in plan.children() {
        visit(child, f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_plans::physical_plan;
    use datafusion::prelude::*;

    #[tokio::test]
    async fn scans_need_a_grant_and_sinks_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("t.csv");
        std::fs::write(&csv, "a,b\n1,2\n").unwrap();
        let ctx = SessionContext::new();
        ctx.register_csv("t", csv.to_str().unwrap(), CsvReadOptions::new())
            .await
            .unwrap();
        let plan = physical_plan(&ctx, "SELECT a + b FROM t WHERE a > 0").await;
        let files = scanned_files(&plan);
        assert_eq!(files.len(), 1);
        admit_plan(&plan, &files, &[]).unwrap();
        let err = admit_plan(&plan, &[], &[]).unwrap_err().to_string();
        assert!(err.contains("does not grant"), "{err}");
        let out = dir.path().join("out.csv");
        let copy = format!("COPY t TO '{}' STORED AS CSV", out.display());
        let sink = physical_plan(&ctx, &copy).await;
        let err = admit_plan(&sink, &files, &[]).unwrap_err().to_string();
        assert!(err.contains("DataSinkExec"), "{err}");
        let explain = physical_plan(&ctx, "EXPLAIN SELECT 1").await;
        assert!(admit_plan(&explain, &[], &[]).is_err());
    }

    #[test]
    fn only_task_settings_pass() {
        admit_options(&[("flumen.device".into(), "cpu".into())]).unwrap();
        let err = admit_options(&[("flumen.worker_binary".into(), "/bin/sh".into())])
            .unwrap_err()
            .to_string();
        assert!(err.contains("flumen.worker_binary"), "{err}");
    }
}
