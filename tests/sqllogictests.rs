//! sqllogictest runner: flumen's own `sql/*.slt` files (those [`ALSO_VANILLA`] names also
//! through vanilla DataFusion, whose answers they must give too), then every test file that
//! `datafusion-sqllogictest` 55.2.0 ships, each run through a flumen session (and through
//! vanilla DataFusion with `FLUMEN_SLT_VANILLA=run`), record by record.
//!
//! The upstream files are laid out as in DataFusion's repository under
//! `target/slt-upstream/` with the data they read: arrow-testing and parquet-testing files
//! from `../shared/fixtures/datafusion-testing/`, DataFusion's own `core/tests/data` files
//! from `tests/data/datafusion-core/` (plus a few the runner writes), and the TPC-H `.tbl`
//! files of `tpch/tpch.slt` generated with tpchgen at scale factor 0.1.
//!
//! A record counts against flumen when vanilla DataFusion passes it and flumen fails it.
//! Rules that keep the suite honest:
//! - Records vanilla DataFusion fails here are pinned record by record in
//!   [`VANILLA_FAILURES_FILE`], and those are the records a file's check leaves out. By
//!   default vanilla DataFusion is not run again (its version is pinned, so its run would
//!   repeat the pins, at a quarter of the suite's time); `FLUMEN_SLT_VANILLA=run` runs it
//!   and fails the suite on any change (one more, one fewer, a file not run): run so after
//!   changing DataFusion's version or the data the files read.
//! - Known flumen failures are keyed by (file, record location, error prefix) in
//!   [`KNOWN_FAILURES`]; any other error fails, and an entry that no longer fails is stale
//!   and fails too.
//! - A file that runs past its time limit fails (no retry).
//! - No `.slt` file found (in `sql/` or upstream) fails.
//!
//! `FLUMEN_SLT=ours` runs only `sql/`, `FLUMEN_SLT=upstream` only the upstream files;
//! `FLUMEN_SLT_FILES=a.slt,b.slt` runs only the named
//! upstream files; `FLUMEN_SLT=full` prints every failing record and never fails;
//! `FLUMEN_SLT_SHOW_FALLBACKS=1` prints each file's listed fallbacks to the driver too;
//! `FLUMEN_SLT_BATCH_SIZE=N` starts every engine's session of an upstream file with
//! `datafusion.execution.batch_size = N`, TPC-H's apart, and accepts a query's rows in any
//! order (with `FLUMEN_SLT=full`: a search for answers that depend on how rows are cut into
//! batches; pinned outcomes assume the default). `FLUMEN_SLT_BLOCK_ROWS=N` and
//! `FLUMEN_SLT_MEMORY_BUDGET=SIZE` do the same for flumen's sessions' `target_block_rows`
//! and `memory_budget` (a search for answers that depend on how flumen cuts blocks and
//! when it spills). `FLUMEN_SLT_FILE_TIMEOUT=SECS` sets every upstream file's time limit
//! (a search with tiny blocks runs slowly: a limit that tells a slow file from a hang).
//! `FLUMEN_SLT_SET=flumen.NAME=VALUE,...` sets any of flumen's settings in its sessions (a
//! search under another mode, exchange or join feeding; rows then pass in any order too).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_sqllogictest::{
    DataFusion, TestContext, df_value_validator, read_dir_recursive, setup_scratch_dir,
    value_normalizer,
};
use flumen::FlumenConfig;
use futures::{FutureExt, StreamExt};
use indicatif::ProgressBar;
use sqllogictest::{QueryExpect, Record, parse_file, strict_column_validator};

#[path = "sqllogictests/metric_facts.rs"]
#[allow(dead_code)]
mod metric_facts;
use metric_facts::MetricFacts;

/// A flumen failure that is known: the failing record's location (as sqllogictest prints
/// it: `test_files/FILE:LINE`, include chain joined by " at "), the start of the error
/// message, and why. Each is a gap to close, listed in `docs/sqllogictest.md`.
struct KnownFailure {
    record: &'static str,
    error_prefix: &'static str,
    why: &'static str,
}

impl KnownFailure {
    /// Whether record `at` failing with `message` is this known failure: its record, and
    /// its message's start.
    fn matches(&self, at: &str, message: &str) -> bool {
        self.record == at && message.starts_with(self.error_prefix)
    }

    /// The upstream file (relative to `test_files/`) the record is in.
    fn file(&self) -> &'static str {
        // A record of an included file names the file that included it after " at ".
        let record = self.record.rsplit(" at ").next().unwrap_or_default();
        let path = record.split(' ').next().unwrap_or_default();
        let path = path.rsplit_once(':').map_or(path, |(p, _)| p);
        path.strip_prefix("test_files/").unwrap_or(path)
    }
}

const EXPLAIN_ANALYZE: &str = "an EXPLAIN ANALYZE record whose expected text states no \
     pruning or spill fact (it checks DataFusion's own operators, their row and batch counts \
     or its plan shape, which flumen's operator tree shows otherwise); records that state \
     such facts are held to them instead (MetricFacts)";

/// An `EXPLAIN ANALYZE` record whose text differs (see [`EXPLAIN_ANALYZE`]).
const fn explain_analyze(record: &'static str) -> KnownFailure {
    KnownFailure {
        record,
        error_prefix: "query result mismatch:",
        why: EXPLAIN_ANALYZE,
    }
}

const PLAIN_HASH_EXCHANGES: &str = "EXPLAIN shows a plain hash exchange (and a sort of each \
     partition where a node above needs the order again) where DataFusion keeps a sorted \
     input's order through the exchange: flumen cuts exchanges into tasks and cannot cut one \
     that keeps an order (flumen::plan::plain_hash_exchanges); the answers are the same";

/// An `EXPLAIN` record whose plan differs by [`PLAIN_HASH_EXCHANGES`].
const fn plain_hash_exchange(record: &'static str) -> KnownFailure {
    KnownFailure {
        record,
        error_prefix: "query result mismatch:",
        why: PLAIN_HASH_EXCHANGES,
    }
}

const ORDERED_ROUND_ROBINS: &str = "EXPLAIN shows no round-robin exchange over a sorted \
     partition whose order a node above relies on (a merge, a window, an ordered aggregate): \
     flumen cuts the exchange into tasks whose blocks come in the order the tasks end, so it \
     takes the exchange out (flumen::plan::ordered_round_robins) and the nodes over it run in \
     the scan's tasks; the answers are the same";

/// An `EXPLAIN` record whose plan differs by [`ORDERED_ROUND_ROBINS`].
const fn ordered_round_robin(record: &'static str) -> KnownFailure {
    KnownFailure {
        record,
        error_prefix: "query result mismatch:",
        why: ORDERED_ROUND_ROBINS,
    }
}

/// Known flumen failures, each one record.
const KNOWN_FAILURES: &[KnownFailure] = &[
    explain_analyze("test_files/aggregate_memory_spill.slt:214"),
    explain_analyze("test_files/explain_analyze.slt:21"),
    explain_analyze("test_files/explain_analyze.slt:58"),
    explain_analyze("test_files/explain_analyze.slt:80"),
    explain_analyze("test_files/explain_analyze.slt:109"),
    explain_analyze("test_files/explain_analyze.slt:121"),
    explain_analyze("test_files/explain_analyze.slt:145"),
    explain_analyze("test_files/explain_analyze.slt:156"),
    explain_analyze("test_files/explain_analyze.slt:167"),
    explain_analyze("test_files/explain_analyze.slt:229"),
    explain_analyze("test_files/explain_analyze.slt:290"),
    explain_analyze("test_files/explain_analyze.slt:331"),
    explain_analyze("test_files/explain_analyze.slt:352"),
    explain_analyze("test_files/explain_analyze.slt:374"),
    explain_analyze("test_files/explain_analyze.slt:548"),
    explain_analyze("test_files/explain_analyze.slt:557"),
    explain_analyze("test_files/explain_analyze.slt:566"),
    explain_analyze("test_files/explain_analyze.slt:575"),
    explain_analyze("test_files/explain_analyze.slt:586"),
    explain_analyze("test_files/explain_analyze.slt:595"),
    explain_analyze("test_files/explain_analyze.slt:605"),
    explain_analyze("test_files/explain_analyze.slt:618"),
    explain_analyze("test_files/explain_analyze.slt:627"),
    explain_analyze("test_files/explain_analyze.slt:652"),
    explain_analyze("test_files/explain_analyze.slt:680"),
    explain_analyze("test_files/joins.slt:5172"),
    explain_analyze("test_files/ordered_aggregate_spill.slt:213"),
    explain_analyze("test_files/parquet_max_row_group_bytes.slt:127"),
    explain_analyze("test_files/parquet_max_row_group_bytes.slt:148"),
    explain_analyze("test_files/parquet_max_row_group_bytes.slt:169"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:107"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:112"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:118"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:123"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:131"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:140"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:145"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:347"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:352"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:457"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:462"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:538"),
    explain_analyze("test_files/parquet_nested_schema_pruning.slt:543"),
    explain_analyze("test_files/push_down_filter_regression.slt:232"),
    explain_analyze("test_files/push_down_filter_regression.slt:319"),
    explain_analyze("test_files/push_down_filter_regression.slt:329"),
    explain_analyze("test_files/push_down_filter_regression.slt:339"),
    explain_analyze("test_files/push_down_filter_regression.slt:349"),
    explain_analyze("test_files/push_down_filter_regression.slt:383"),
    explain_analyze("test_files/push_down_filter_regression.slt:419"),
    explain_analyze("test_files/push_down_filter_regression.slt:451"),
    explain_analyze("test_files/range_partitioning.slt:1873"),
    ordered_round_robin("test_files/explain_tree.slt:1328"),
    ordered_round_robin("test_files/explain_tree.slt:1363"),
    ordered_round_robin("test_files/explain_tree.slt:1398"),
    ordered_round_robin("test_files/explain_tree.slt:1467"),
    ordered_round_robin("test_files/explain_tree.slt:1505"),
    ordered_round_robin("test_files/explain_tree.slt:1548"),
    ordered_round_robin("test_files/filter_without_sort_exec.slt:30"),
    ordered_round_robin("test_files/filter_without_sort_exec.slt:46"),
    ordered_round_robin("test_files/filter_without_sort_exec.slt:62"),
    ordered_round_robin("test_files/filter_without_sort_exec.slt:94"),
    ordered_round_robin("test_files/filter_without_sort_exec.slt:134"),
    ordered_round_robin("test_files/filter_without_sort_exec.slt:180"),
    ordered_round_robin("test_files/group_by.slt:4263"),
    ordered_round_robin("test_files/group_by.slt:4362"),
    ordered_round_robin("test_files/join_disable_repartition_joins.slt:41"),
    ordered_round_robin("test_files/join_disable_repartition_joins.slt:77"),
    ordered_round_robin("test_files/monotonic_projection_test.slt:34"),
    ordered_round_robin("test_files/monotonic_projection_test.slt:52"),
    ordered_round_robin("test_files/monotonic_projection_test.slt:73"),
    ordered_round_robin("test_files/order.slt:882"),
    ordered_round_robin("test_files/order.slt:897"),
    ordered_round_robin("test_files/order.slt:912"),
    ordered_round_robin("test_files/order.slt:927"),
    ordered_round_robin("test_files/order.slt:1402"),
    ordered_round_robin("test_files/order.slt:1472"),
    ordered_round_robin("test_files/select.slt:1426"),
    ordered_round_robin("test_files/select.slt:1460"),
    ordered_round_robin("test_files/select.slt:1480"),
    ordered_round_robin("test_files/select.slt:1500"),
    ordered_round_robin("test_files/select.slt:1520"),
    ordered_round_robin("test_files/select.slt:1587"),
    ordered_round_robin("test_files/window.slt:3333"),
    plain_hash_exchange("test_files/agg_func_substitute.slt:36"),
    plain_hash_exchange("test_files/agg_func_substitute.slt:54"),
    plain_hash_exchange("test_files/agg_func_substitute.slt:71"),
    plain_hash_exchange("test_files/group_by.slt:3962"),
    plain_hash_exchange("test_files/group_by.slt:4001"),
    plain_hash_exchange("test_files/preserve_file_partitioning.slt:279"),
    plain_hash_exchange("test_files/preserve_file_partitioning.slt:340"),
    plain_hash_exchange("test_files/repartition_subset_satisfaction.slt:149"),
    plain_hash_exchange("test_files/repartition_subset_satisfaction.slt:326"),
    plain_hash_exchange("test_files/unnest.slt:974"),
    KnownFailure {
        record: "test_files/ddl.slt:593",
        error_prefix: "statement is expected to fail with error:",
        why: "flumen registers STORED AS DELTATABLE, so the statement fails for the missing \
              credentials of s3://bucket, not for an unknown format",
    },
    KnownFailure {
        record: "test_files/array/array_transform.slt:292",
        error_prefix: "query result mismatch:",
        why: "EXPLAIN shows `unsliced_lists(..)` under a cast to a fixed-size list: flumen's \
              rule that makes such casts read sliced lists right (arrow-cast 59 reads their \
              values from the start; flumen::plan::fixed_size_list_casts)",
    },
    KnownFailure {
        record: "test_files/explain.slt:303",
        error_prefix: "query result mismatch:",
        why: "EXPLAIN VERBOSE lists flumen's optimizer rules among DataFusion's (a physical \
              one, and the logical `unsliced_list_casts`)",
    },
    KnownFailure {
        record: "test_files/explain.slt:346",
        error_prefix: "query result mismatch:",
        why: "EXPLAIN VERBOSE lists flumen's optimizer rules among DataFusion's (a physical \
              one, and the logical `unsliced_list_casts`)",
    },
    KnownFailure {
        record: "test_files/information_schema.slt:206",
        error_prefix: "query result mismatch:",
        why: "SHOW ALL lists flumen's settings too",
    },
    KnownFailure {
        record: "test_files/information_schema.slt:907",
        error_prefix: "query result mismatch:",
        why: "information_schema.routines lists flumen's table function table_changes (a \
              Delta table's change data feed) beside generate_series and range",
    },
    KnownFailure {
        record: "test_files/information_schema.slt:366",
        error_prefix: "query result mismatch:",
        why: "SHOW ALL VERBOSE lists flumen's settings too",
    },
    KnownFailure {
        record: "test_files/set_variable.slt:591",
        error_prefix: "query result mismatch:",
        why: "SHOW datafusion.runtime.memory_limit reads the runtime its task runs in: under \
              flumen that runtime's pool is flumen.memory_budget (operators share it with \
              blocks), so it shows 2.0 GB where DataFusion's default pool shows 'unlimited'",
    },
];

/// The records vanilla DataFusion fails here, one location per line (as sqllogictest
/// prints it), and `FILE: not run` for a file DataFusion's runner declines; any change
/// fails the suite. Each run writes what it found to `target/slt-upstream/
/// vanilla-failures.found`, to copy over this file when the crate or the data changed.
const VANILLA_FAILURES_FILE: &str = "tests/sqllogictests/vanilla_failures.txt";

/// The pinned vanilla failures: record locations, and files not run.
fn pinned_vanilla_failures(root: &Path) -> Result<(BTreeSet<String>, BTreeSet<String>), String> {
    let path = root.join(VANILLA_FAILURES_FILE);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let (mut records, mut not_run) = (BTreeSet::new(), BTreeSet::new());
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        match line.strip_suffix(": not run") {
            Some(file) => not_run.insert(file.to_string()),
            None => records.insert(line.to_string()),
        };
    }
    Ok((records, not_run))
}

/// The upstream file (relative to `test_files/`) of a record location as sqllogictest
/// prints it (`test_files/FILE:LINE`, with " at " and its includes after).
fn file_of(record: &str) -> String {
    let path = record.split(' ').next().unwrap_or_default();
    let path = path.rsplit_once(':').map_or(path, |(p, _)| p);
    path.strip_prefix("test_files/").unwrap_or(path).to_string()
}

/// Vanilla DataFusion's outcomes as pinned ([`VANILLA_FAILURES_FILE`]): its failing
/// records and the files its runner declines. What an upstream file is checked against
/// unless `FLUMEN_SLT_VANILLA=run` runs vanilla DataFusion too.
struct VanillaPins {
    records: BTreeSet<String>,
    not_run: BTreeSet<String>,
}

impl VanillaPins {
    /// Vanilla's run of `name` as pinned: its failing records, or not run.
    fn run_of(&self, name: &str) -> FileRun {
        let errors = (self.records.iter())
            .filter(|record| file_of(record) == name)
            .map(|record| (record.clone(), format!("pinned in {VANILLA_FAILURES_FILE}")))
            .collect();
        FileRun {
            errors,
            not_run: self.not_run.contains(name),
            ..FileRun::default()
        }
    }
}

/// Upstream files checked side by side: one file's run is mostly one thread's work (SQL
/// planning and small plans), so two keep both of CI's cores busy.
const FILES_AT_ONCE: usize = 2;
/// Longest an upstream file may run before it counts as failed (a hang is a failure).
const FILE_TIMEOUT: Duration = Duration::from_secs(120);
/// `tpch/tpch.slt` runs the 22 queries three times over scale factor 0.1.
const TPCH_TIMEOUT: Duration = Duration::from_secs(900);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    Vanilla,
    Flumen,
    /// Flumen with its tasks in two local worker processes (`flumen.workers = 'process'`).
    FlumenWorkers,
}

/// Records whose outcome in worker processes differs from threads mode, each with why
/// (an entry that no longer differs is stale and fails the suite).
const KNOWN_WORKER_DIFFERENCES: &[KnownFailure] = &[
    KnownFailure {
        record: "test_files/dynamic_filter_pushdown_config.slt:98",
        error_prefix: "metric facts differ: page_index_pages_skipped_by_fully_matched",
        why: "a worker reads a descending TopK's row groups in file order: \
              datafusion-proto 55 drops the scan's `reverse_row_groups` hint (and DataFusion \
              gives no public way to set it again), so the page index skips another page; \
              the rows are the same",
    },
    KnownFailure {
        record: "test_files/push_down_filter_parquet.slt:881",
        error_prefix: "metric facts differ: files_ranges_pruned_statistics: expected 2 total",
        why: "worker mode runs the `EXISTS` as a join on the set of build keys its probe side \
              matches (`plan::semi_joins_by_key_set`), which reads the build side's file a \
              second time: 3 file ranges pruned by statistics instead of 2; the rows are the \
              same",
    },
];

/// Tasks of an upstream file that fall back to the driver in worker mode
/// (`flumen::exec::OnDriver`: any reason but the driver's tasks by design): the file (`*`:
/// any file), the reason's name, the start of its detail, and why. Any other fallback fails
/// the suite; an entry that no longer falls back is stale and fails too.
struct KnownFallback {
    file: &'static str,
    reason: &'static str,
    detail_prefix: &'static str,
    why: &'static str,
}

const KNOWN_DRIVER_FALLBACKS: &[KnownFallback] = &[
    KnownFallback {
        file: "spark/aggregate/collect.slt",
        reason: "unencodable",
        detail_prefix: "This feature is not implemented: workers have no function collect_",
        why: "the file registers Spark's `collect_list` and `collect_set` in the driver's \
              session only: the final aggregates calling them run there, and say so",
    },
    KnownFallback {
        file: "spark/aggregate/avg.slt",
        reason: "unencodable",
        detail_prefix: "This feature is not implemented: workers have another function avg",
        why: "the file registers Spark's `avg` under the built-in's name in the driver's \
              session only: a worker's `avg` would misread its state (it panicked), so the \
              tasks calling it run on the driver, and say so",
    },
    KnownFallback {
        file: "spark/aggregate/try_sum.slt",
        reason: "unencodable",
        detail_prefix: "This feature is not implemented: workers have no function try_sum",
        why: "the file registers Spark's `try_sum` in the driver's session only: the final \
              aggregates calling it run there, and say so",
    },
    KnownFallback {
        file: "range_partitioning.slt",
        reason: "scan_not_split",
        detail_prefix: "",
        why: "source fragments of several scans of the harness's range-partitioned table that \
              no per-partition cut splits read on the driver (8 tasks). Parquet, CSV, JSON, \
              Avro and Arrow scans go to the workers (what datafusion-proto 55 drops of CSV, \
              JSON and Arrow-stream scans travels beside them: `flumen::cluster::scan_formats`)",
    },
    KnownFallback {
        file: "parquet_filter_pushdown.slt",
        reason: "scan_not_split",
        detail_prefix: "",
        why: "a source fragment of several scans that no per-partition cut splits (1 task)",
    },
    KnownFallback {
        file: "async_udf.slt",
        reason: "undecodable",
        detail_prefix: "Internal error: PhysicalExpr Column references column '__async_fn_0'",
        why: "an aggregate over an async UDF's column: datafusion-proto 55 decodes the \
              aggregate against its input without the async function's column",
    },
    KnownFallback {
        file: "window.slt",
        reason: "unencodable",
        detail_prefix: "This feature is not implemented: datafusion-proto drops a window \
                        aggregate's FILTER",
        why: "`SUM(c2) FILTER (WHERE ..) OVER (..)`: datafusion-proto 55 does not encode a \
              window aggregate's filter, so a worker would aggregate every row (task_plan \
              refuses it before sending; it summed every row before it did)",
    },
    KnownFallback {
        file: "pg_compat/pg_compat_window.slt",
        reason: "unencodable",
        detail_prefix: "This feature is not implemented: datafusion-proto recomputes a window \
                        frame's causality",
        why: "`RANGE BETWEEN 1 PRECEDING AND 1 PRECEDING` is planned not causal and decodes \
              causal (task_plan refuses it before sending)",
    },
    KnownFallback {
        file: "grouping.slt",
        reason: "unencodable",
        detail_prefix: "This feature is not implemented: datafusion-proto drops an aggregate's \
                        empty grouping set",
        why: "`GROUPING SETS (())`: datafusion-proto 55 writes the one empty set as none \
              (task_plan refuses it before sending)",
    },
    KnownFallback {
        file: "parquet_filter_pushdown.slt",
        reason: "not_cut",
        detail_prefix: "2 output partitions",
        why: "a source fragment whose scan keeps its file partitioning: one file group cut \
              out still leaves a node above it with several partitions",
    },
    KnownFallback {
        file: "window.slt",
        reason: "unencodable",
        detail_prefix: "This feature is not implemented: datafusion-proto drops a window \
                        function's reversal",
        why: "an `nth_value` DataFusion runs reversed (beside a window sorted the other way): \
              its position is negated, which datafusion-proto 55 cannot say \
              (cluster::window_calls refuses it; its CSV scan reads on the workers)",
    },
    KnownFallback {
        file: "window.slt",
        reason: "unencodable",
        detail_prefix: "This feature is not implemented: datafusion-proto recomputes a window \
                        frame's causality",
        why: "a window frame whose causality DataFusion set otherwise than its bounds say: \
              datafusion-proto 55 rebuilds the frame from its bounds (cluster::window_calls \
              refuses it; its CSV scan reads on the workers)",
    },
    KnownFallback {
        file: "set_variable.slt",
        reason: "sorts_in_pieces",
        detail_prefix: "",
        why: "a sort refused memory under the file's small memory limit runs again with its \
              sorts in pieces, a setting of the driver's task context",
    },
];

/// What one run of a file gave.
#[derive(Debug, Default)]
struct FileRun {
    /// Error message (first line) by record location.
    errors: BTreeMap<String, String>,
    /// Tasks its worker processes ran ([`Engine::FlumenWorkers`]).
    worker_tasks: u64,
    /// Tasks that fell back to the driver instead ([`Engine::FlumenWorkers`]), per
    /// (reason, detail).
    fallbacks: BTreeMap<(&'static str, String), u64>,
    /// Tasks the driver ran by design ([`Engine::FlumenWorkers`]).
    driver_tasks: u64,
    /// DataFusion's runner declined the file (a feature not built).
    not_run: bool,
    /// Ran past its time limit.
    timed_out: Option<Duration>,
}

async fn run_file(path: &Path, relative: &Path, engine: Engine) -> FileRun {
    let limit = if let Ok(secs) = std::env::var("FLUMEN_SLT_FILE_TIMEOUT") {
        let secs = secs
            .parse()
            .unwrap_or_else(|e| panic!("FLUMEN_SLT_FILE_TIMEOUT={secs}: {e}"));
        Duration::from_secs(secs)
    } else if relative.starts_with("tpch") {
        TPCH_TIMEOUT
    } else {
        FILE_TIMEOUT
    };
    match tokio::time::timeout(limit, run_file_inner(path, relative, engine)).await {
        Ok(run) => run,
        Err(_) => FileRun {
            timed_out: Some(limit),
            ..FileRun::default()
        },
    }
}

async fn run_file_inner(path: &Path, relative: &Path, engine: Engine) -> FileRun {
    let Some(test_ctx) = TestContext::try_new_for_test_file(relative).await else {
        return FileRun {
            not_run: true,
            ..FileRun::default()
        };
    };
    if let Ok(rows) = std::env::var("FLUMEN_SLT_BATCH_SIZE")
        && !relative.starts_with("tpch")
    {
        // Small batches spread a file's few rows over every partition: partial aggregates
        // then meet in final ones, and blocks cross workers in many pieces. (Not the TPC-H
        // file: its 600,000 lineitems are many batches already.)
        let state = test_ctx.session_ctx().state_ref();
        let mut state = state.write();
        let options = state.config_mut().options_mut();
        if let Err(e) = options.set("datafusion.execution.batch_size", &rows) {
            panic!("FLUMEN_SLT_BATCH_SIZE={rows}: {e}");
        }
    }
    let ctx: SessionContext = match engine {
        Engine::Vanilla => test_ctx.session_ctx().clone(),
        Engine::Flumen | Engine::FlumenWorkers => {
            let mut config = FlumenConfig::default();
            // DataFusion's files assert DataFusion's own EXPLAIN text.
            config.explain_operators = false;
            if let Ok(rows) = std::env::var("FLUMEN_SLT_BLOCK_ROWS") {
                config.target_block_rows = rows
                    .parse()
                    .unwrap_or_else(|e| panic!("FLUMEN_SLT_BLOCK_ROWS={rows}: {e}"));
            }
            if let Ok(size) = std::env::var("FLUMEN_SLT_MEMORY_BUDGET") {
                config.memory_budget = size
                    .parse()
                    .unwrap_or_else(|e| panic!("FLUMEN_SLT_MEMORY_BUDGET={size}: {e}"));
            }
            if let Ok(settings) = std::env::var("FLUMEN_SLT_SET") {
                for setting in settings.split(',').filter(|s| !s.trim().is_empty()) {
                    let (name, value) = setting.split_once('=').unwrap_or_else(|| {
                        panic!("FLUMEN_SLT_SET: '{setting}' is not flumen.NAME=VALUE")
                    });
                    use datafusion::config::ExtensionOptions;
                    config
                        .set(name.trim().trim_start_matches("flumen."), value.trim())
                        .unwrap_or_else(|e| panic!("FLUMEN_SLT_SET: {setting}: {e}"));
                }
            }
            if engine == Engine::FlumenWorkers {
                config.workers = flumen::WorkerMode::Process;
                // Two, not the default one: every exchange then sends blocks from one
                // worker process to another, as between hosts.
                config.worker_processes = 2;
                config.worker_binary = env!("CARGO_BIN_EXE_flumen").into();
            }
            flumen::into_flumen(test_ctx.session_ctx(), config)
        }
    };
    if let Err(e) = setup_scratch_dir(relative) {
        let mut run = FileRun::default();
        run.errors
            .insert("scratch dir".into(), format!("scratch dir: {e}"));
        return run;
    }
    let by_facts = engine != Engine::Vanilla;
    let errors = run_records(ctx.clone(), path, relative, true, by_facts).await;
    let slot = ctx
        .state()
        .config()
        .get_extension::<flumen::cluster::WorkerPoolSlot>();
    let (fallbacks, driver_tasks) = slot.map_or_else(Default::default, |slot| {
        let on_driver = slot.tasks_on_driver();
        (on_driver.fallbacks(), on_driver.by_design().values().sum())
    });
    FileRun {
        errors,
        worker_tasks: worker_tasks(&ctx).await,
        fallbacks,
        driver_tasks,
        ..FileRun::default()
    }
}

/// Tasks the live worker processes of `ctx`'s session ran (0 in threads mode).
async fn worker_tasks(ctx: &SessionContext) -> u64 {
    match ctx
        .state()
        .config()
        .get_extension::<flumen::cluster::WorkerPoolSlot>()
    {
        Some(slot) => slot.tasks_in_workers().await,
        None => 0,
    }
}

/// A record's location as one line: `file:line`, then ` at file:line` per include.
/// `errors` in the order of their records in the file (the keys sort as text: `:109`
/// before `:17`), each record's threads-mode error before its worker-mode one.
fn in_line_order(errors: &BTreeMap<String, String>) -> Vec<(&String, &String)> {
    let line = |at: &str| -> u64 {
        let after = at.rsplit_once(".slt:").map_or("", |(_, rest)| rest);
        let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap_or(u64::MAX)
    };
    let mut ordered: Vec<_> = errors.iter().collect();
    ordered.sort_by_key(|(at, _)| (line(at), at.len()));
    ordered
}

fn location_key(loc: &impl std::fmt::Display) -> String {
    loc.to_string().replace('\n', " ")
}

/// Run every record of `path` on `ctx` with DataFusion's own sqllogictest engine; returns
/// the errors by record location. `check_config`: also fail when the file leaves settings
/// changed (keyed `settings left changed`). `by_facts`: an `EXPLAIN ANALYZE` record whose
/// text differs passes when the run states the pruning and spilling facts its expected
/// text states ([`MetricFacts`]); it fails with `metric facts differ:` when one differs, and
/// with `query result mismatch:` when the expected text states none.
async fn run_records(
    ctx: SessionContext,
    path: &Path,
    relative: &Path,
    check_config: bool,
    by_facts: bool,
) -> BTreeMap<String, String> {
    let config_changes = Arc::new(Mutex::new(Vec::new()));
    let relative_owned = relative.to_path_buf();
    let changes = Arc::clone(&config_changes);
    let session = ctx.clone();
    let mut runner = sqllogictest::Runner::new(move || {
        let ctx = ctx.clone();
        let relative = relative_owned.clone();
        let changes = Arc::clone(&changes);
        async move {
            let engine = DataFusion::new(ctx, relative, ProgressBar::hidden());
            Ok(if check_config {
                engine.with_config_change_errors(changes)
            } else {
                engine
            })
        }
    });
    runner.add_label("Datafusion");
    runner.with_column_validator(strict_column_validator);
    runner.with_normalizer(value_normalizer);
    runner.with_validator(validate_in_layout);
    let mut errors = BTreeMap::new();
    let records = match parse_file(path) {
        Ok(r) => r,
        Err(e) => {
            errors.insert("parse".into(), format!("parse: {e}"));
            return errors;
        }
    };
    for record in records {
        if let Record::Halt { .. } = record {
            break;
        }
        let analyze = match &record {
            Record::Query {
                sql,
                expected: QueryExpect::Results { results, .. },
                ..
            } if by_facts && is_explain_analyze(sql) => {
                Some((sql.clone(), MetricFacts::of(&results.join("\n"))))
            }
            _ => None,
        };
        if let Err(e) = runner.run_async(record).await {
            let message = e.kind().to_string();
            let message = match analyze {
                Some((sql, expected))
                    if !expected.is_empty() && message.starts_with("query result mismatch") =>
                {
                    match facts_differ(&session, &sql, &expected).await {
                        None => continue,
                        Some(why) => why,
                    }
                }
                _ => message,
            };
            errors.insert(location_key(&e.location()), message);
        }
    }
    runner.shutdown_async().await;
    let changed = config_changes.lock().unwrap();
    if !changed.is_empty() {
        errors.insert("settings left changed".into(), changed.join("; "));
    }
    errors
}

/// Whether `sql` is an `EXPLAIN ANALYZE` statement.
fn is_explain_analyze(sql: &str) -> bool {
    let words: Vec<String> = sql
        .split_whitespace()
        .take(2)
        .map(str::to_lowercase)
        .collect();
    words == ["explain", "analyze"]
}

/// Run `sql` (an `EXPLAIN ANALYZE`) on `ctx` again and compare the facts its text states
/// with `expected`: `None` when they agree, else the error to record.
async fn facts_differ(ctx: &SessionContext, sql: &str, expected: &MetricFacts) -> Option<String> {
    let batches = match ctx.sql(sql).await {
        Ok(frame) => frame.collect().await,
        Err(e) => Err(e),
    };
    let batches = match batches {
        Ok(batches) => batches,
        Err(e) => return Some(format!("metric facts differ: the query failed: {e}")),
    };
    let text = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
        .map(|t| t.to_string())
        .unwrap_or_default();
    let differences = expected.differences(&MetricFacts::of(&text));
    (!differences.is_empty()).then(|| format!("metric facts differ: {}", differences.join("; ")))
}

/// Where the upstream layout lives (`target/slt-upstream`, absolute, without its leading
/// `/`, as object-store paths print it); set once by [`prepare_upstream`].
static LAYOUT_ROOT: OnceLock<String> = OnceLock::new();

/// DataFusion's validator, after writing the layout's root as `WORKSPACE_ROOT` in actual
/// results: DataFusion's engine only recognises its own checkout's root (the registry's
/// source directory here), so plans that print file paths would differ by the root alone.
fn validate_in_layout(
    normalizer: sqllogictest::Normalizer,
    actual: &[Vec<String>],
    expected: &[String],
) -> bool {
    let actual: Vec<Vec<String>> = match LAYOUT_ROOT.get() {
        Some(root) => actual
            .iter()
            .map(|row| {
                row.iter()
                    .map(|v| v.replace(root.as_str(), "WORKSPACE_ROOT"))
                    .collect()
            })
            .collect(),
        None => actual.to_vec(),
    };
    if df_value_validator(normalizer, &actual, expected) {
        return true;
    }
    // Another batch size, block size or budget puts the rows of a query without `ORDER BY`
    // in another order: there, the same rows in any order pass.
    [
        "FLUMEN_SLT_BATCH_SIZE",
        "FLUMEN_SLT_BLOCK_ROWS",
        "FLUMEN_SLT_MEMORY_BUDGET",
        "FLUMEN_SLT_SET",
    ]
    .iter()
    .any(|name| std::env::var_os(name).is_some())
        && {
            let mut actual = actual;
            actual.sort_by_key(|row| row.join(" "));
            let mut expected = expected.to_vec();
            expected.sort();
            df_value_validator(normalizer, &actual, &expected)
        }
}

fn upstream_crate() -> Option<PathBuf> {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    let src = cargo_home.join("registry").join("src");
    std::fs::read_dir(src)
        .ok()?
        .flatten()
        .map(|d| d.path().join("datafusion-sqllogictest-55.2.0"))
        .find(|p| p.join("test_files").is_dir())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// Lay out DataFusion's repository as the upstream files expect it under `work`, and return
/// the directory to run them from (`work/datafusion/sqllogictest`).
fn prepare_upstream(root: &Path, work: &Path) -> Result<PathBuf, String> {
    let fail = |what: &str, e: &dyn std::fmt::Display| format!("{what}: {e}");
    let sqllogictest = work.join("datafusion").join("sqllogictest");
    if !sqllogictest.join("test_files").is_dir() {
        let source = upstream_crate().ok_or("datafusion-sqllogictest 55.2.0 sources not found")?;
        copy_dir(&source, &sqllogictest).map_err(|e| fail("copy the upstream files", &e))?;
    }
    // arrow-testing and parquet-testing files, from the shared fixtures.
    let fixtures = root.join("../shared/fixtures/datafusion-testing");
    for repo in ["testing", "parquet-testing"] {
        let from = fixtures.join(repo);
        if !from.is_dir() {
            return Err(format!(
                "{} not found: the upstream files read their data from it",
                from.display()
            ));
        }
        if !work.join(repo).is_dir() {
            copy_dir(&from, &work.join(repo)).map_err(|e| fail("copy the fixtures", &e))?;
        }
    }
    // DataFusion's own core/tests/data files: the ones stored here, and the ones written.
    let core = work.join("datafusion/core/tests/data");
    copy_dir(&root.join("tests/data/datafusion-core"), &core)
        .map_err(|e| fail("copy tests/data/datafusion-core", &e))?;
    std::fs::create_dir_all(core.join("partitioned_csv")).map_err(|e| fail("mkdir", &e))?;
    for partition in 0..4 {
        let rows: String = (0..=10)
            .map(|i| format!("{partition},{i},{}\n", i % 2 == 0))
            .collect();
        std::fs::write(
            core.join(format!("partitioned_csv/partition-{partition}.csv")),
            rows,
        )
        .map_err(|e| fail("write partitioned_csv", &e))?;
    }
    let first_last: Vec<String> = std::iter::once("c1,c2,c3".to_string())
        .chain((1..=10).map(|i| format!("{i},{},{}", 10 - i, i - 1)))
        .collect();
    std::fs::write(core.join("convert_first_last.csv"), first_last.join("\n"))
        .map_err(|e| fail("write convert_first_last.csv", &e))?;
    write_tpch_tables(&sqllogictest.join("test_files/tpch/data"))
        .map_err(|e| fail("generate the TPC-H tables", &e))?;
    let root = work.canonicalize().map_err(|e| fail("canonicalize", &e))?;
    let _ = LAYOUT_ROOT.set(
        root.display()
            .to_string()
            .trim_start_matches('/')
            .to_string(),
    );
    Ok(sqllogictest)
}

/// The eight TPC-H tables at scale factor 0.1 as dbgen's `.tbl` text (tpchgen writes the
/// same rows), once.
fn write_tpch_tables(dir: &Path) -> std::io::Result<()> {
    use tpchgen::generators::*;
    const SF: f64 = 0.1;
    if dir.join(".complete").exists() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    fn write<T: std::fmt::Display>(
        dir: &Path,
        name: &str,
        rows: impl Iterator<Item = T>,
    ) -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(dir.join(name))?);
        for row in rows {
            writeln!(out, "{row}")?;
        }
        out.flush()
    }
    write(dir, "nation.tbl", NationGenerator::new(SF, 1, 1).iter())?;
    write(dir, "region.tbl", RegionGenerator::new(SF, 1, 1).iter())?;
    write(dir, "part.tbl", PartGenerator::new(SF, 1, 1).iter())?;
    write(dir, "supplier.tbl", SupplierGenerator::new(SF, 1, 1).iter())?;
    write(dir, "partsupp.tbl", PartSuppGenerator::new(SF, 1, 1).iter())?;
    write(dir, "customer.tbl", CustomerGenerator::new(SF, 1, 1).iter())?;
    write(dir, "orders.tbl", OrderGenerator::new(SF, 1, 1).iter())?;
    write(dir, "lineitem.tbl", LineItemGenerator::new(SF, 1, 1).iter())?;
    std::fs::write(dir.join(".complete"), b"")
}

/// Files of `sql/` whose expected results must be vanilla DataFusion's answers too (by name
/// prefix): out-of-core plans, cut scalar subqueries and worker processes change how flumen
/// runs a query, not what it answers.
const ALSO_VANILLA: &[&str] = &[
    "out_of_core",
    "scalar_subqueries",
    "sorted_tables",
    "windows_and_types",
];

/// flumen's own files, on a flumen session with default settings and 4 partitions, then on
/// one whose tasks run in two worker processes (each file's line says how many ran there).
async fn run_ours(root: &Path) -> Result<(usize, usize), String> {
    let dir = root.join("sql");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "slt"))
        .collect();
    if files.is_empty() {
        return Err(format!("no .slt file in {}", dir.display()));
    }
    files.sort();
    let (mut passed, mut failed) = (0, 0);
    for path in files {
        let relative = PathBuf::from(path.file_name().unwrap());
        let ctx = flumen::session_with_config(
            SessionConfig::new().with_target_partitions(4),
            FlumenConfig::default(),
        );
        let mut errors = run_our_records(ctx, &path, &relative).await;
        // The same file with the tasks in two worker processes: the same answers.
        let mut config = FlumenConfig::default();
        config.workers = flumen::WorkerMode::Process;
        config.worker_processes = 2;
        config.worker_binary = env!("CARGO_BIN_EXE_flumen").into();
        let workers =
            flumen::session_with_config(SessionConfig::new().with_target_partitions(4), config);
        let worker_errors = run_our_records(workers.clone(), &path, &relative).await;
        let in_workers = worker_tasks(&workers).await;
        errors.extend(
            worker_errors
                .into_iter()
                .map(|(at, e)| (format!("{at} (in worker processes)"), e)),
        );
        let name = relative.to_string_lossy();
        if ALSO_VANILLA.iter().any(|prefix| name.starts_with(prefix)) {
            // Their expected results must be vanilla DataFusion's answers too: the same file
            // through a plain session (flumen's settings accepted and ignored).
            let vanilla = SessionContext::new_with_config(
                SessionConfig::new()
                    .with_target_partitions(4)
                    .with_option_extension(FlumenConfig::default()),
            );
            let vanilla_errors = run_our_records(vanilla, &path, &relative).await;
            errors.extend(
                vanilla_errors
                    .into_iter()
                    .map(|(at, e)| (format!("{at} (vanilla DataFusion)"), e)),
            );
        }
        if errors.is_empty() {
            println!(
                "flumen sql/{}: ok ({in_workers} tasks in worker processes)",
                relative.display()
            );
            passed += 1;
        } else {
            println!(
                "flumen sql/{}: FAILED ({} records)",
                relative.display(),
                errors.len()
            );
            for (at, e) in in_line_order(&errors).into_iter().take(5) {
                println!("  {at}: {e}");
            }
            failed += 1;
        }
    }
    Ok((passed, failed))
}

/// Longest one engine may take over one of flumen's own files (all of them, every engine,
/// take ~80 s together): past it, the file fails as hung instead of holding CI until its
/// limit.
const OUR_FILE_TIMEOUT: Duration = Duration::from_secs(300);

/// [`run_records`] over one of flumen's own files, failed when it runs past
/// [`OUR_FILE_TIMEOUT`].
async fn run_our_records(
    ctx: SessionContext,
    path: &Path,
    relative: &Path,
) -> BTreeMap<String, String> {
    let run = run_records(ctx, path, relative, false, false);
    match tokio::time::timeout(OUR_FILE_TIMEOUT, run).await {
        Ok(errors) => errors,
        Err(_) => BTreeMap::from([(
            path.display().to_string(),
            format!("ran past {OUR_FILE_TIMEOUT:?} (a query that never ends?)"),
        )]),
    }
}

/// Tallies of the upstream run.
#[derive(Default)]
struct Tally {
    files_passed: usize,
    files_failed: usize,
    records_checked: usize,
    known_seen: BTreeSet<usize>,
    /// Vanilla's failing records per file, as found.
    vanilla_failures: BTreeMap<String, u32>,
    /// Their locations, and the files DataFusion's runner declined.
    vanilla_records: BTreeSet<String>,
    vanilla_not_run: BTreeSet<String>,
    problems: Vec<String>,
    /// Files also run with worker processes, the tasks those ran, and the records whose
    /// outcome there differed from threads mode (known ones apart).
    worker_files: usize,
    worker_tasks: u64,
    worker_differences: usize,
    known_worker_seen: BTreeSet<usize>,
    /// `EXPLAIN` records whose worker-mode plan differs by design only
    /// ([`partitioned_by_design`]).
    partitioned_explains: usize,
    /// `EXPLAIN` records whose plans differ only in a memory table's byte statistic
    /// ([`memory_table_bytes_only`]).
    memory_bytes_explains: usize,
    /// Tasks the driver ran by design in worker runs; fallbacks not in
    /// [`KNOWN_DRIVER_FALLBACKS`]; the entries of that list seen.
    driver_tasks: u64,
    unknown_fallbacks: usize,
    known_fallbacks_seen: BTreeSet<usize>,
    /// Seconds spent running files, summed over files: vanilla DataFusion, flumen in
    /// threads mode, flumen with worker processes (where CI's time goes).
    seconds: [f64; 3],
    /// What the checks of one file said, printed when the file is done, so that files run
    /// side by side ([`FILES_AT_ONCE`]) print whole and in order.
    output: String,
}

impl Tally {
    /// Folds the tally of one file into this one and prints what that file's checks said.
    fn absorb(&mut self, file: Tally) {
        print!("{}", file.output);
        self.files_passed += file.files_passed;
        self.files_failed += file.files_failed;
        self.records_checked += file.records_checked;
        self.known_seen.extend(file.known_seen);
        self.vanilla_failures.extend(file.vanilla_failures);
        self.vanilla_records.extend(file.vanilla_records);
        self.vanilla_not_run.extend(file.vanilla_not_run);
        self.problems.extend(file.problems);
        self.worker_files += file.worker_files;
        self.worker_tasks += file.worker_tasks;
        self.worker_differences += file.worker_differences;
        self.known_worker_seen.extend(file.known_worker_seen);
        self.partitioned_explains += file.partitioned_explains;
        self.memory_bytes_explains += file.memory_bytes_explains;
        self.driver_tasks += file.driver_tasks;
        self.unknown_fallbacks += file.unknown_fallbacks;
        self.known_fallbacks_seen.extend(file.known_fallbacks_seen);
        for (sum, seconds) in self.seconds.iter_mut().zip(file.seconds) {
            *sum += seconds;
        }
    }
}

/// A line into `$tally`'s output (see [`Tally::output`]).
macro_rules! say {
    ($tally:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($tally.output, $($arg)*);
    }};
}

/// The kind of a record's error (its text up to the first colon), or `"ok"`: what threads
/// and worker runs must agree on (a result mismatch's text shows the differing output,
/// which `EXPLAIN ANALYZE` records fill with each run's own counters).
fn outcome(errors: &BTreeMap<String, String>, at: &str) -> String {
    errors.get(at).map_or("ok".into(), |e| {
        e.split(':').next().unwrap_or_default().to_string()
    })
}

/// Whether a worker run's failure `message` is an `EXPLAIN` record whose plan differs from
/// threads mode's only in a memory table's `bytes:` statistic. A table made by `CREATE TABLE
/// AS` from rows a worker read holds batches decoded from IPC, whose columns share one
/// message body: `get_array_memory_size`, which the statistic sums, counts that body once
/// per column (1,424 bytes where threads mode's batch says 512). The rows are the same, and
/// DataFusion's memory reservations count a shared buffer once.
fn memory_table_bytes_only(message: &str) -> bool {
    let explain = (message.lines())
        .find_map(|l| l.trim().strip_prefix("[SQL]"))
        .is_some_and(|sql| {
            let sql = sql.trim_start().to_ascii_lowercase();
            sql.starts_with("explain") && !sql.starts_with("explain analyze")
        });
    // A changed line with its number in `bytes: N` taken out.
    let changed = |sign: char| -> Vec<String> {
        (message.lines())
            .filter_map(|l| l.trim_start().strip_prefix(sign))
            .map(|l| {
                let at = l.find("bytes: ").map_or(l.len(), |i| i + "bytes: ".len());
                let digits = l[at..].chars().take_while(char::is_ascii_digit).count();
                format!("{}N{}", &l[..at], &l[at + digits..])
                    .split_whitespace()
                    .collect()
            })
            .collect()
    };
    let (removed, added) = (changed('-'), changed('+'));
    explain
        && message.contains("format: memory")
        && !removed.is_empty()
        && removed == added
        && removed.iter().all(|l| l.contains("bytes:N"))
}

/// Whether a worker run's failure `message` is an `EXPLAIN` record whose plan differs from
/// threads mode's by design: worker mode plans a hash join that emits its build side's rows
/// (left, semi, anti, mark, full) `Partitioned` where threads mode has it `CollectLeft`
/// (`flumen::plan::partitioned_outer_joins`), so its partitions run apart on the workers, or
/// a semi or anti join as a join on the set of build keys its probe side matches
/// (`flumen::plan::semi_joins_by_key_set`, whose key columns are named `__flumen_semi_key_N`).
fn partitioned_by_design(message: &str) -> bool {
    let explain = (message.lines())
        .find_map(|l| l.trim().strip_prefix("[SQL]"))
        .is_some_and(|sql| {
            let words: Vec<String> = (sql.split_whitespace().take(2))
                .map(str::to_ascii_lowercase)
                .collect();
            words.first().is_some_and(|w| w == "explain")
                && words.get(1).is_none_or(|w| w != "analyze")
        });
    let joins = ["Left", "LeftSemi", "LeftAnti", "LeftMark", "Full"];
    let changed = |sign: char, mode: &str| {
        (message.lines())
            .filter_map(|l| l.trim_start().strip_prefix(sign))
            .any(|l| {
                joins
                    .iter()
                    .any(|j| l.contains(&format!("HashJoinExec: mode={mode}, join_type={j},")))
            })
    };
    let by_key_set = (message.lines())
        .filter_map(|l| l.trim_start().strip_prefix('+'))
        .any(|l| l.contains("HashJoinExec: mode=CollectLeft") && l.contains("__flumen_semi_key_"));
    explain && changed('-', "CollectLeft") && (changed('+', "Partitioned") || by_key_set)
}

/// Run one upstream file with worker processes and fold into `tally` every record whose
/// outcome differs from the threads run `threads` (records vanilla fails apart).
async fn check_workers(
    path: &Path,
    relative: &Path,
    full: bool,
    vanilla: &FileRun,
    threads: &FileRun,
    tally: &mut Tally,
) {
    let name = relative.display().to_string();
    let started = Instant::now();
    let workers = run_file(path, relative, Engine::FlumenWorkers).await;
    tally.seconds[2] += started.elapsed().as_secs_f64();
    tally.worker_files += 1;
    tally.worker_tasks += workers.worker_tasks;
    if let Some(limit) = workers.timed_out {
        tally.worker_differences += 1;
        say!(
            tally,
            "upstream {name} in workers: FAILED: ran past {limit:?} (a hang fails)"
        );
        return;
    }
    let mut differences = vec![];
    let records: BTreeSet<&String> = threads.errors.keys().chain(workers.errors.keys()).collect();
    for at in records {
        if vanilla.errors.contains_key(at) {
            continue;
        }
        let (in_threads, in_workers) = (outcome(&threads.errors, at), outcome(&workers.errors, at));
        if in_threads == in_workers {
            continue;
        }
        let message = workers.errors.get(at).or(threads.errors.get(at));
        if in_threads == "ok" && message.is_some_and(|m| partitioned_by_design(m)) {
            tally.partitioned_explains += 1;
            continue;
        }
        if in_threads == "ok" && message.is_some_and(|m| memory_table_bytes_only(m)) {
            tally.memory_bytes_explains += 1;
            continue;
        }
        let known = KNOWN_WORKER_DIFFERENCES
            .iter()
            .position(|k| k.file() == name && message.is_some_and(|m| k.matches(at, m)));
        match known {
            Some(i) => {
                tally.known_worker_seen.insert(i);
            }
            None => differences.push(format!(
                "record {at}: threads {in_threads}, workers {in_workers}: {}",
                message
                    .map(|m| m
                        .lines()
                        .take(if full { 12 } else { 1 })
                        .collect::<Vec<_>>())
                    .unwrap_or_default()
                    .join("\n    ")
            )),
        }
    }
    tally.driver_tasks += workers.driver_tasks;
    for ((reason, detail), tasks) in &workers.fallbacks {
        let known = KNOWN_DRIVER_FALLBACKS.iter().position(|k| {
            (k.file == name || k.file == "*")
                && k.reason == *reason
                && detail.starts_with(k.detail_prefix)
        });
        match known {
            Some(i) => {
                tally.known_fallbacks_seen.insert(i);
                if std::env::var_os("FLUMEN_SLT_SHOW_FALLBACKS").is_some() {
                    say!(
                        tally,
                        "upstream {name} in workers: {tasks} tasks on the driver, listed: \
                         {reason}: {detail}"
                    );
                }
            }
            None => {
                tally.unknown_fallbacks += 1;
                say!(
                    tally,
                    "upstream {name} in workers: FAILED: {tasks} tasks fell back to the driver: \
                     {reason}: {detail}"
                );
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    if differences.is_empty() {
        say!(
            tally,
            "upstream {name} in workers: same as threads ({elapsed:.1}s, {} tasks in workers, \
             {} on the driver by design)",
            workers.worker_tasks,
            workers.driver_tasks
        );
    } else {
        tally.worker_differences += differences.len();
        say!(
            tally,
            "upstream {name} in workers: FAILED: {} records differ from threads mode",
            differences.len()
        );
        for difference in differences.iter().take(if full { usize::MAX } else { 5 }) {
            say!(tally, "  {difference}");
        }
    }
}

async fn run_upstream(root: &Path, full: bool) -> Result<(usize, usize), String> {
    let work = root.join("target").join("slt-upstream");
    let dir = prepare_upstream(root, &work)?;
    std::env::set_current_dir(&dir).map_err(|e| e.to_string())?;
    let subset = std::env::var("FLUMEN_SLT_FILES").ok();
    let files: Vec<PathBuf> = if let Some(list) = &subset {
        list.split(',').map(PathBuf::from).collect()
    } else {
        let mut all: Vec<PathBuf> = read_dir_recursive("test_files")
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "slt"))
            .filter_map(|p| p.strip_prefix("test_files").ok().map(Path::to_path_buf))
            .collect();
        all.sort();
        all
    };
    if files.is_empty() {
        return Err("no upstream .slt file found".into());
    }
    // Every file a second time with its tasks in worker processes, unless
    // FLUMEN_SLT_WORKERS=0 (a quicker local run; CI runs both).
    let workers = std::env::var("FLUMEN_SLT_WORKERS").map_or(true, |v| v != "0");
    // Vanilla DataFusion's outcomes: pinned (the default: DataFusion's version is pinned
    // too, so its run would only repeat the file), or run again and checked against the
    // pins (`FLUMEN_SLT_VANILLA=run`: after a change of DataFusion or of the data).
    let run_vanilla = std::env::var("FLUMEN_SLT_VANILLA").is_ok_and(|v| v == "run");
    let pins = if run_vanilla {
        None
    } else {
        let (records, not_run) = pinned_vanilla_failures(root)?;
        Some(Arc::new(VanillaPins { records, not_run }))
    };
    let mut tally = Tally::default();
    // The longest file (the TPC-H queries, over a minute) first, so that it does not run
    // alone at the end; then the files in name order, each printed once those before it are.
    let mut order = files.clone();
    order.sort_by_key(|f| !f.starts_with("tpch"));
    let mut runs = futures::stream::iter(order.into_iter().enumerate())
        .map(|(i, relative)| {
            let pins = pins.clone();
            tokio::spawn(async move {
                let mut file = Tally::default();
                let check =
                    check_upstream_file(&relative, full, workers, pins.as_deref(), &mut file);
                // A panic fails its file, and the other files still run and report.
                if let Err(panic) = std::panic::AssertUnwindSafe(check).catch_unwind().await {
                    let message = panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| panic.downcast_ref::<&str>().copied())
                        .unwrap_or("(no message)");
                    file.files_failed += 1;
                    say!(
                        file,
                        "upstream {}: FAILED: panicked: {message}",
                        relative.display()
                    );
                }
                (i, file)
            })
        })
        .buffer_unordered(FILES_AT_ONCE);
    let (mut done, mut printed) = (BTreeMap::new(), 0);
    while let Some(run) = runs.next().await {
        let (i, file) = run.map_err(|e| format!("an upstream file's check panicked: {e}"))?;
        done.insert(i, file);
        while let Some(file) = done.remove(&printed) {
            tally.absorb(file);
            printed += 1;
        }
    }
    for (i, known) in KNOWN_WORKER_DIFFERENCES.iter().enumerate() {
        if workers && ran_file(&files, known.file()) && !tally.known_worker_seen.contains(&i) {
            tally.problems.push(format!(
                "stale KNOWN_WORKER_DIFFERENCES entry: {} ({}) no longer differs; it was known \
                 because: {}",
                known.record, known.error_prefix, known.why
            ));
        }
    }
    for (i, known) in KNOWN_DRIVER_FALLBACKS.iter().enumerate() {
        let ran = known.file == "*" || ran_file(&files, known.file);
        if workers && ran && !tally.known_fallbacks_seen.contains(&i) {
            tally.problems.push(format!(
                "stale KNOWN_DRIVER_FALLBACKS entry: {} ({}: {}) no longer falls back; it was \
                 known because: {}",
                known.file, known.reason, known.detail_prefix, known.why
            ));
        }
    }
    if workers {
        println!(
            "upstream sqllogictest files in worker processes: {} run, {} tasks ran in workers, \
             {} on the driver by design, {} unlisted fallbacks to the driver ({} listed), {} \
             records differ from threads mode, {} known; {} EXPLAIN records show an outer or \
             semi join planned partitioned or by key set, by design; {} differ only in a memory table's byte \
             statistic",
            tally.worker_files,
            tally.worker_tasks,
            tally.driver_tasks,
            tally.unknown_fallbacks,
            tally.known_fallbacks_seen.len(),
            tally.worker_differences,
            tally.known_worker_seen.len(),
            tally.partitioned_explains,
            tally.memory_bytes_explains
        );
        if tally.unknown_fallbacks > 0 {
            tally.problems.push(format!(
                "{} (file, reason) pairs of tasks fell back to the driver and are not in \
                 KNOWN_DRIVER_FALLBACKS",
                tally.unknown_fallbacks
            ));
        }
        if tally.worker_differences > 0 {
            tally.problems.push(format!(
                "{} records differ between worker processes and threads mode",
                tally.worker_differences
            ));
        }
    }
    let ran: BTreeSet<String> = files.iter().map(|f| f.display().to_string()).collect();
    // Vanilla's failures against the pinned list, record by record (for the files that ran).
    let (pinned, pinned_not_run) = pinned_vanilla_failures(root)?;
    let found_file = work.join("vanilla-failures.found");
    let found_text: String = tally
        .vanilla_not_run
        .iter()
        .map(|f| format!("{f}: not run\n"))
        .chain(tally.vanilla_records.iter().map(|r| format!("{r}\n")))
        .collect();
    let _ = std::fs::write(&found_file, found_text);
    let mut changed = vec![];
    for record in pinned.iter().filter(|r| ran.contains(&file_of(r))) {
        if !tally.vanilla_records.contains(record) {
            changed.push(format!("vanilla DataFusion no longer fails {record}"));
        }
    }
    for record in tally.vanilla_records.difference(&pinned) {
        changed.push(format!(
            "vanilla DataFusion fails {record}, which is not pinned"
        ));
    }
    for file in pinned_not_run.iter().filter(|f| ran.contains(*f)) {
        if !tally.vanilla_not_run.contains(file) {
            changed.push(format!("{file} runs now; it was pinned as not run"));
        }
    }
    for file in tally.vanilla_not_run.difference(&pinned_not_run) {
        changed.push(format!(
            "{file} is not run by DataFusion's runner, and not pinned so"
        ));
    }
    if !changed.is_empty() {
        for change in changed.iter().take(if full { usize::MAX } else { 10 }) {
            println!("  {change}");
        }
        tally.problems.push(format!(
            "{} changes to vanilla DataFusion's failures against {VANILLA_FAILURES_FILE} \
             (what this run found is in {})",
            changed.len(),
            found_file.display()
        ));
    }
    // Known failures that no longer fail.
    for (i, known) in KNOWN_FAILURES.iter().enumerate() {
        if ran.contains(known.file()) && !tally.known_seen.contains(&i) {
            tally.problems.push(format!(
                "stale KNOWN_FAILURES entry: {} ({}) no longer fails that way; it was known \
                 because: {}",
                known.record, known.error_prefix, known.why
            ));
        }
    }
    let vanilla_records: u32 = tally
        .vanilla_failures
        .values()
        .filter(|n| **n != u32::MAX)
        .sum();
    println!(
        "upstream sqllogictest files: {} run; flumen: {} passed, {} failed; {} records checked \
         (those vanilla DataFusion passes), {} known failures; vanilla DataFusion fails {} \
         records in {} files ({})",
        files.len(),
        tally.files_passed,
        tally.files_failed,
        tally.records_checked,
        tally.known_seen.len(),
        vanilla_records,
        tally.vanilla_failures.len(),
        if run_vanilla {
            "run here, and as pinned"
        } else {
            "as pinned; FLUMEN_SLT_VANILLA=run runs it and checks the pins"
        },
    );
    let [vanilla_s, threads_s, workers_s] = tally.seconds;
    println!(
        "upstream sqllogictest files' run time, summed over files ({FILES_AT_ONCE} at once): \
         vanilla DataFusion {vanilla_s:.0} s (0 when pinned), flumen in threads {threads_s:.0} s, flumen with \
         worker processes {workers_s:.0} s"
    );
    for problem in &tally.problems {
        println!("FAILED: {problem}");
    }
    let failed = tally.files_failed + tally.problems.len();
    Ok((tally.files_passed, failed))
}

/// Whether `file` (relative to `test_files/`) is among the files run.
fn ran_file(files: &[PathBuf], file: &str) -> bool {
    files.iter().any(|f| f.as_os_str() == file)
}

/// Run one upstream file on both engines (and flumen with worker processes when `workers`)
/// and fold the outcome into `tally`.
async fn check_upstream_file(
    relative: &Path,
    full: bool,
    workers: bool,
    pins: Option<&VanillaPins>,
    tally: &mut Tally,
) {
    let name = relative.display().to_string();
    let path = Path::new("test_files").join(relative);
    let started = Instant::now();
    let vanilla = match pins {
        Some(pins) => pins.run_of(&name),
        None => run_file(&path, relative, Engine::Vanilla).await,
    };
    tally.seconds[0] += started.elapsed().as_secs_f64();
    if vanilla.not_run {
        tally.vanilla_failures.insert(name.clone(), u32::MAX);
        tally.vanilla_not_run.insert(name.clone());
        say!(tally, "upstream {name}: not run by DataFusion's runner");
        return;
    }
    if let Some(limit) = vanilla.timed_out {
        tally
            .problems
            .push(format!("{name}: vanilla DataFusion ran past {limit:?}"));
        return;
    }
    if !vanilla.errors.is_empty() {
        tally
            .vanilla_failures
            .insert(name.clone(), vanilla.errors.len() as u32);
        tally.vanilla_records.extend(vanilla.errors.keys().cloned());
        if full {
            for (at, message) in &vanilla.errors {
                let first = message.lines().next().unwrap_or_default();
                say!(tally, "  vanilla fails {at}: {first}");
            }
        }
    }
    let threads_started = Instant::now();
    let flumen = run_file(&path, relative, Engine::Flumen).await;
    tally.seconds[1] += threads_started.elapsed().as_secs_f64();
    if let Some(limit) = flumen.timed_out {
        tally.files_failed += 1;
        say!(
            tally,
            "upstream {name}: FAILED under flumen: ran past {limit:?} (a hang fails)"
        );
        return;
    }
    if flumen.not_run {
        // Only with the pins (a vanilla run says so first): the runner declines a file
        // the pins say it runs, a change the pins' check reports.
        tally.vanilla_not_run.insert(name.clone());
        say!(tally, "upstream {name}: not run by DataFusion's runner");
        return;
    }
    if workers {
        check_workers(&path, relative, full, &vanilla, &flumen, tally).await;
    }
    let mut new_failures = vec![];
    let mut known_here = 0;
    for (at, message) in &flumen.errors {
        if vanilla.errors.contains_key(at) {
            continue;
        }
        let known = KNOWN_FAILURES
            .iter()
            .position(|k| k.file() == name && k.matches(at, message));
        match known {
            Some(i) => {
                tally.known_seen.insert(i);
                known_here += 1;
            }
            None => new_failures.push((at, message)),
        }
    }
    // Records compared: those vanilla passed (the file's errors are per record).
    tally.records_checked += count_records(&path).saturating_sub(vanilla.errors.len());
    let elapsed = started.elapsed().as_secs_f64();
    if new_failures.is_empty() {
        tally.files_passed += 1;
        say!(
            tally,
            "upstream {name}: ok ({elapsed:.1}s: vanilla {:.1}, threads {:.1}, workers {:.1}{}{})",
            tally.seconds[0],
            tally.seconds[1],
            tally.seconds[2],
            if vanilla.errors.is_empty() {
                String::new()
            } else {
                format!(", {} records vanilla fails too", vanilla.errors.len())
            },
            if known_here > 0 {
                format!(", {known_here} known failures")
            } else {
                String::new()
            }
        );
    } else {
        tally.files_failed += 1;
        say!(
            tally,
            "upstream {name}: FAILED under flumen ({} records)",
            new_failures.len()
        );
        for (at, message) in new_failures.iter().take(if full { usize::MAX } else { 5 }) {
            let first = message.lines().next().unwrap_or_default();
            say!(tally, "  record {at}: {first}");
            if full {
                let prefix: String = first.chars().take(60).collect();
                say!(tally, "    entry: (\"{name}\", \"{at}\", {prefix:?})");
            }
            if full {
                for line in message.lines().skip(1).take(8) {
                    say!(tally, "    {line}");
                }
            }
        }
    }
}

/// Statements and queries in a file (with its includes).
fn count_records(path: &Path) -> usize {
    parse_file::<datafusion_sqllogictest::DFColumnType>(path)
        .map(|records| {
            records
                .iter()
                .filter(|r| matches!(r, Record::Statement { .. } | Record::Query { .. }))
                .count()
        })
        .unwrap_or(0)
}

fn main() -> ExitCode {
    // Upstream files open `s3://` tables with no credentials (ddl.slt): never let an S3
    // client ask the EC2 instance metadata address from a test run.
    // SAFETY: set before any other thread exists.
    unsafe { std::env::set_var("AWS_EC2_METADATA_DISABLED", "true") };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // avro.slt's tables are copied from arrow-testing, found by this variable (the fixtures'
    // copy that `prepare_upstream` lays out).
    // SAFETY: as above.
    unsafe {
        std::env::set_var(
            "ARROW_TEST_DATA",
            root.join("target/slt-upstream/testing/data"),
        )
    };
    // flumen logs stalls (a reader or the scheduler waiting 10 s) as warnings.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("flumen=warn"))
        .init();
    let mode = std::env::var("FLUMEN_SLT").unwrap_or_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let result = runtime.block_on(async {
        let (mut passed, mut failed) = match mode.as_str() {
            "upstream" => (0, 0),
            _ => run_ours(&root).await?,
        };
        if mode != "ours" {
            let (p, f) = run_upstream(&root, mode == "full").await?;
            passed += p;
            failed += f;
        }
        Ok::<_, String>((passed, failed))
    });
    match result {
        Ok((passed, failed)) => {
            println!("sqllogictests: {passed} passed, {failed} failed");
            if failed == 0 || mode == "full" {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            println!("sqllogictests: {e}");
            ExitCode::FAILURE
        }
    }
}
