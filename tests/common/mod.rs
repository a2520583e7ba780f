//! Shared helpers for flumen's integration tests: generated Parquet data and comparison
//! of flumen's answers with vanilla DataFusion's.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use datafusion::arrow::array::{Float64Array, Int64Array, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};

pub mod format_tables;
pub mod hosts;
pub mod s3_server;
pub mod serve_process;
pub mod skip;
pub mod tpch;
#[allow(unused_imports)]
pub use skip::{skip_missing_tool, skip_no_device};

/// Write `files` Parquet files of `rows_per_file` rows each under `dir`, with small row
/// groups so a scan has many splits. Columns: id, k (group key 0..16), v (float), body (text).
pub fn write_events(dir: &Path, files: usize, rows_per_file: usize) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Float64, true),
        Field::new("body", DataType::Utf8, true),
    ]));
    std::fs::create_dir_all(dir).unwrap();
    for f in 0..files {
        let start = (f * rows_per_file) as i64;
        let ids: Vec<i64> = (start..start + rows_per_file as i64).collect();
        let k: Vec<i64> = ids.iter().map(|i| (i * 7919) % 16).collect();
        let v: Vec<Option<f64>> = ids
            .iter()
            .map(|i| {
                if i % 97 == 0 {
                    None
                } else {
                    Some(((i * 2654435761) % 1000) as f64 / 1000.0)
                }
            })
            .collect();
        let body: Vec<Option<String>> = ids
            .iter()
            .map(|i| {
                if i % 101 == 0 {
                    None
                } else {
                    Some(format!("document {i} about topic {}", i % 13))
                }
            })
            .collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(Int64Array::from(k)),
                Arc::new(Float64Array::from(v)),
                Arc::new(StringArray::from(body)),
            ],
        )
        .unwrap();
        let file = std::fs::File::create(dir.join(format!("part-{f}.parquet"))).unwrap();
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(5_000))
            .build();
        let mut writer = ArrowWriter::try_new(file, Arc::clone(&schema), Some(props)).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }
}

/// Register the test tables (`events` from Parquet in `dir`, `dim` in memory) in `ctx`.
pub async fn register_tables(ctx: &SessionContext, dir: &Path) {
    ctx.register_parquet(
        "events",
        dir.to_str().unwrap(),
        ParquetReadOptions::default(),
    )
    .await
    .unwrap();
    ctx.sql(
        "CREATE TABLE dim AS SELECT * FROM (VALUES (0, 'zero'), (1, 'one'), (2, 'two'), \
         (3, 'three'), (5, 'five'), (8, 'eight'), (13, 'thirteen')) AS d(k, name)",
    )
    .await
    .unwrap()
    .collect()
    .await
    .unwrap();
}

/// `files` event files of `rows_per_file` rows in a fresh temp dir, and a vanilla context
/// with the test tables registered over them (keep the dir while the tables are used).
pub async fn events_with_vanilla(
    files: usize,
    rows_per_file: usize,
) -> (tempfile::TempDir, SessionContext) {
    let dir = tempfile::tempdir().unwrap();
    write_events(dir.path(), files, rows_per_file);
    let v = vanilla();
    register_tables(&v, dir.path()).await;
    (dir, v)
}

/// A vanilla DataFusion context with two target partitions.
pub fn vanilla() -> SessionContext {
    SessionContext::new_with_config(SessionConfig::new().with_target_partitions(2))
}

/// A flumen context with two target partitions and the given `SET flumen.*` statements.
pub async fn flumen_ctx(settings: &[&str]) -> SessionContext {
    let ctx = flumen::session_with_config(
        SessionConfig::new().with_target_partitions(2),
        flumen::FlumenConfig::default(),
    );
    for s in settings {
        ctx.sql(s).await.unwrap().collect().await.unwrap();
    }
    ctx
}

/// flumen's default settings with tasks in `processes` worker processes of this build's
/// `flumen` binary (`flumen.workers = 'process'`).
pub fn in_worker_processes(processes: usize) -> flumen::FlumenConfig {
    let mut config = flumen::FlumenConfig::default();
    config.workers = flumen::WorkerMode::Process;
    config.worker_processes = processes;
    config.worker_binary = env!("CARGO_BIN_EXE_flumen").into();
    config
}

/// Run one statement and collect its result, or return its error (planning or execution).
pub async fn try_collect(
    ctx: &SessionContext,
    sql: &str,
) -> datafusion::error::Result<Vec<RecordBatch>> {
    ctx.sql(sql).await?.collect().await
}

/// The worker pool of `kind` that session `ctx` started (panics when it started none).
pub async fn worker_pool(
    ctx: &SessionContext,
    kind: flumen::plan::Pool,
) -> Arc<flumen::cluster::WorkerPool> {
    ctx.state()
        .config()
        .get_extension::<flumen::cluster::WorkerPoolSlot>()
        .unwrap()
        .current(kind)
        .await
        .expect("the session started its workers")
}

/// Run one statement that must succeed and collect its result.
pub async fn collect(ctx: &SessionContext, sql: &str) -> Vec<RecordBatch> {
    try_collect(ctx, sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Rows of a result as text lines, sorted unless `ordered`.
pub fn rows(batches: &[RecordBatch], ordered: bool) -> Vec<String> {
    let text = pretty_format_batches(batches).unwrap().to_string();
    let mut lines: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with('|'))
        .skip(1)
        .map(|l| l.to_string())
        .collect();
    if !ordered {
        lines.sort();
    }
    lines
}

/// Run `sql` on both contexts and assert the same rows (in order when it has ORDER BY).
pub async fn assert_same(vanilla: &SessionContext, flumen: &SessionContext, sql: &str) {
    let expected = vanilla.sql(sql).await.unwrap().collect().await.unwrap();
    let actual = flumen
        .sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .collect()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let ordered = sql.to_ascii_uppercase().contains("ORDER BY");
    let (e, a) = (rows(&expected, ordered), rows(&actual, ordered));
    assert!(!e.is_empty() || a.is_empty(), "{sql}");
    let same = e.len() == a.len() && e.iter().zip(&a).all(|(x, y)| same_row(x, y));
    if !same {
        assert_eq!(e, a, "flumen differs from DataFusion on: {sql}");
    }
}

/// Whether two results hold the same rows (in order when `ordered`), by [`same_row`].
pub fn same_rows(expected: &[RecordBatch], actual: &[RecordBatch], ordered: bool) -> bool {
    let (e, a) = (rows(expected, ordered), rows(actual, ordered));
    e.len() == a.len() && e.iter().zip(&a).all(|(x, y)| same_row(x, y))
}

/// Tasks of an executed flumen plan's run that ran in a worker, and all its tasks.
pub fn remote_and_all_tasks(plan: &Arc<dyn ExecutionPlan>) -> (u64, u64) {
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return (0, 0);
    };
    operator_stats(exec)
        .iter()
        .fold((0, 0), |(r, t), s| (r + s.remote_tasks, t + s.tasks))
}

/// The counters of each operator of an executed flumen plan whose own nodes (not its
/// producers', below its stage inputs) include one named `node` (`UnionExec`), with the
/// operator's text.
pub fn operators_holding(
    plan: &Arc<dyn ExecutionPlan>,
    node: &str,
) -> Vec<(flumen::exec::StatsSnapshot, String)> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    let exec = plan.downcast_ref::<flumen::exec::FlumenExec>().unwrap();
    let mut found = vec![];
    for op in &exec.graph().operators {
        let mut holds = false;
        let _ = op.fragment.apply(|n| {
            holds |= n.name() == node;
            Ok(match n.name() {
                "StageInputExec" => TreeNodeRecursion::Jump,
                _ => TreeNodeRecursion::Continue,
            })
        });
        if holds {
            let text = datafusion::physical_plan::displayable(op.fragment.as_ref())
                .indent(true)
                .to_string();
            found.push((exec.run_metrics().operator(op.id).snapshot(), text));
        }
    }
    found
}

/// Assert that exactly one operator of an executed flumen plan holds a node named `node`,
/// and that each of its tasks (two at least) ran on a worker; `what` names the query.
pub fn assert_one_operator_on_workers(plan: &Arc<dyn ExecutionPlan>, node: &str, what: &str) {
    let holding = operators_holding(plan, node);
    assert_eq!(holding.len(), 1, "{what}: one operator holds the {node}");
    for (stats, text) in &holding {
        assert!(
            stats.remote_tasks == stats.tasks && stats.tasks >= 2,
            "{what}: {} of the {node}'s {} tasks ran on a worker: {stats:?}\n{text}",
            stats.remote_tasks,
            stats.tasks
        );
    }
}

/// Two formatted rows agree: every cell is equal text, or both cells are floating-point numbers
/// within a relative 1e-9 of each other. A sum of doubles depends on the order its inputs were
/// added in, and flumen groups rows into blocks differently from DataFusion's partitions, so
/// `sum(v)` may differ in its last digits (308.48799999999994 against 308.488).
pub fn same_row(expected: &str, actual: &str) -> bool {
    let (e, a): (Vec<&str>, Vec<&str>) =
        (expected.split('|').collect(), actual.split('|').collect());
    e.len() == a.len() && e.iter().zip(&a).all(|(x, y)| same_cell(x.trim(), y.trim()))
}

fn same_cell(expected: &str, actual: &str) -> bool {
    if expected == actual {
        return true;
    }
    let is_float = |s: &str| s.contains(['.', 'e', 'E']);
    match (expected.parse::<f64>(), actual.parse::<f64>()) {
        (Ok(x), Ok(y)) if is_float(expected) || is_float(actual) => {
            x.is_finite()
                && y.is_finite()
                && (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1e-300)
        }
        _ => false,
    }
}

/// Queries covering scans, filters, aggregates, joins, sorts, windows, limits and unions.
pub const QUERIES: &[&str] = &[
    "SELECT count(*), round(sum(v), 6), min(id), max(id) FROM events",
    "SELECT k, count(*), round(avg(v), 9) FROM events GROUP BY k ORDER BY k",
    "SELECT id, v FROM events WHERE v > 0.98 ORDER BY id LIMIT 25",
    "SELECT id, body FROM events WHERE id % 1000 = 7",
    "SELECT e.k, d.name, count(*) AS n FROM events e JOIN dim d ON e.k = d.k GROUP BY e.k, d.name ORDER BY e.k",
    "SELECT id, round(sum(v) OVER (PARTITION BY k ORDER BY id), 9) AS s FROM events WHERE id < 600 ORDER BY id",
    "SELECT count(DISTINCT body) FROM events",
    "SELECT k FROM events WHERE id < 10 UNION ALL SELECT k FROM dim ORDER BY k",
    "SELECT * FROM events ORDER BY v DESC NULLS LAST, id LIMIT 5",
    "SELECT k, max(length(body)) FROM events WHERE body LIKE '%topic 3' GROUP BY k HAVING count(*) > 10 ORDER BY k",
    "SELECT d.name, x.n FROM dim d LEFT JOIN (SELECT k, count(*) AS n FROM events WHERE id < 100 GROUP BY k) x ON d.k = x.k ORDER BY d.name",
    "SELECT id FROM events WHERE k IN (SELECT k FROM dim WHERE name LIKE 't%') AND id < 200 ORDER BY id",
];

/// Run `sql` through flumen's physical plan directly, returning the batches and the plan.
pub async fn run_plan(
    ctx: &datafusion::prelude::SessionContext,
    sql: &str,
) -> (
    Vec<datafusion::arrow::record_batch::RecordBatch>,
    Arc<dyn ExecutionPlan>,
) {
    let df = ctx.sql(sql).await.unwrap();
    let plan = df.create_physical_plan().await.unwrap();
    let batches = datafusion::physical_plan::collect(Arc::clone(&plan), ctx.task_ctx())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    (batches, plan)
}

/// Seeded uniform numbers in [0, 1) (the crash tests' kill instants).
pub struct Seeded(pub u64);

impl Seeded {
    /// The next number.
    pub fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The first non-empty row of a statement's result, as strings.
pub async fn first_row(ctx: &SessionContext, sql: &str) -> Vec<String> {
    let batches = collect(ctx, sql).await;
    let batch = batches.iter().find(|b| b.num_rows() > 0).expect("one row");
    (0..batch.num_columns())
        .map(|c| {
            datafusion::arrow::util::display::array_value_to_string(batch.column(c), 0).unwrap()
        })
        .collect()
}

/// Wait for `child` to exit, killing it with SIGKILL as soon as `kill_now()` says so (it is
/// asked every millisecond); panics naming `what` when neither happens within 120 s.
pub fn kill_when(child: &mut std::process::Child, what: &str, mut kill_now: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return;
        }
        if kill_now() {
            // SAFETY: a signal to a process the test started.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            return;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(120),
            "{what} hung"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// `id -> embedding` from a `SELECT id, embed(..)` answer (a null embedding as empty).
pub fn embeddings_by_id(
    batches: &[datafusion::arrow::record_batch::RecordBatch],
) -> Vec<(i64, Vec<f32>)> {
    use datafusion::arrow::array::{Array, AsArray};
    use datafusion::arrow::datatypes::{Float32Type, Int64Type};
    let mut out = vec![];
    for batch in batches {
        let ids = batch.column(0).as_primitive::<Int64Type>();
        let vectors = batch.column(1).as_fixed_size_list();
        for row in 0..batch.num_rows() {
            let v = if vectors.is_null(row) {
                vec![]
            } else {
                vectors
                    .value(row)
                    .as_primitive::<Float32Type>()
                    .values()
                    .to_vec()
            };
            out.push((ids.value(row), v));
        }
    }
    out.sort_by_key(|(id, _)| *id);
    out
}

/// [`embeddings_by_id`] with each float as its bits, to compare vectors bit for bit.
pub fn embedding_bits_by_id(
    batches: &[datafusion::arrow::record_batch::RecordBatch],
) -> Vec<(i64, Vec<u32>)> {
    (embeddings_by_id(batches).into_iter())
        .map(|(id, v)| (id, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// Cosine similarity of two vectors (0 when either is all zeros).
#[allow(dead_code)]
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let (na, nb) = (norm(a), norm(b));
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    dot / (na * nb)
}

/// `sql` (an id and a vector per row) answers the same on both contexts: the same ids, and
/// each row's vectors at cosine ≥ 0.9999 (engines batch rows differently, so vectors differ
/// in their last digits, never more).
#[allow(dead_code)]
pub async fn assert_same_vectors(vanilla: &SessionContext, flumen: &SessionContext, sql: &str) {
    let expected = embeddings_by_id(&collect(vanilla, sql).await);
    let actual = embeddings_by_id(&collect(flumen, sql).await);
    let ids = |rows: &[(i64, Vec<f32>)]| rows.iter().map(|(id, _)| *id).collect::<Vec<_>>();
    assert_eq!(ids(&expected), ids(&actual), "{sql}: other ids");
    assert!(!expected.is_empty(), "{sql}: no rows to compare");
    for ((id, want), (_, got)) in expected.iter().zip(&actual) {
        // A NULL vector (of a NULL text) is empty here: both must be.
        assert_eq!(want.len(), got.len(), "{sql}: id {id}: vector lengths");
        if want.is_empty() {
            continue;
        }
        let similarity = cosine(want, got);
        assert!(
            similarity >= 0.9999,
            "{sql}: id {id}: cosine {similarity} between vanilla's vector and flumen's"
        );
    }
}

/// Every file below `dir`, hidden ones included (none when `dir` is missing).
pub fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut files = vec![];
    let Ok(entries) = std::fs::read_dir(dir) else {
        return files;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(files_below(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// The counters of an executed plan's first operator whose fragment holds a node named
/// `node` (a `HashJoinExec`, a `UnionExec`) after one of its workers was killed: printed,
/// then checked that the kill cost the operator something, that it ran no task on the
/// driver, and that each lost block ran again at most once.
pub fn assert_recovered_on_workers(plan: &Arc<dyn ExecutionPlan>, node: &str) {
    let exec = plan.downcast_ref::<flumen::exec::FlumenExec>().unwrap();
    let op = (exec.graph().operators.iter())
        .find(|op| {
            datafusion::physical_plan::displayable(op.fragment.as_ref())
                .indent(false)
                .to_string()
                .contains(node)
        })
        .unwrap_or_else(|| panic!("no operator holds a {node}"));
    let s = exec.run_metrics().operator(op.id).snapshot();
    println!("{} after the kill: {s:?}", op.name);
    assert_eq!(s.tasks_on_driver, 0, "{s:?}");
    assert!(
        s.blocks_lost > 0 || s.tasks_retried > 0,
        "the kill cost the {node} nothing: {s:?}"
    );
    assert!(s.recomputed <= s.blocks_lost, "{s:?}");
}

/// The counters of every operator of an executed plan's run.
pub fn operator_stats(exec: &flumen::exec::FlumenExec) -> Vec<flumen::exec::StatsSnapshot> {
    let metrics = exec.run_metrics();
    exec.graph()
        .operators
        .iter()
        .map(|op| metrics.operator(op.id).snapshot())
        .collect()
}

/// The first column of `batches`, an `Int64` id, in output order.
pub fn id_column(batches: &[RecordBatch]) -> Vec<i64> {
    use datafusion::arrow::array::AsArray;
    use datafusion::arrow::datatypes::Int64Type;
    batches
        .iter()
        .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
        .collect()
}
