//! Plan shapes: flumen's operators in `EXPLAIN`, checked as insta snapshots.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use datafusion::arrow::array::{AsArray, Int64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::catalog::{Session, TableProvider};
use datafusion::datasource::{MemTable, TableType};
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionConfig;
use flumen::{FlumenConfig, WorkerMode};

async fn explain(sql: &str) -> String {
    explain_with(&[], sql).await
}

/// EXPLAIN of `sql` after the statements in `settings` (and the tables `t` and `d`).
async fn explain_with(settings: &[&str], sql: &str) -> String {
    let ctx = flumen::session_with_config(
        SessionConfig::new().with_target_partitions(2),
        FlumenConfig::default(),
    );
    for setup in [
        "SET flumen.cpu_slots = 2",
        "SET flumen.accelerator_slots = 1",
        "SET datafusion.explain.physical_plan_only = true",
        "CREATE TABLE t AS SELECT x AS id, x % 7 AS k FROM generate_series(1, 100) AS g(x)",
        "CREATE TABLE d AS VALUES (0, 'zero'), (1, 'one')",
    ]
    .iter()
    .chain(settings)
    {
        ctx.sql(setup).await.unwrap().collect().await.unwrap();
    }
    let batches = ctx
        .sql(&format!("EXPLAIN {sql}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    pretty_format_batches(&batches).unwrap().to_string()
}

#[tokio::test]
async fn explain_group_by_shows_operators_cut_at_the_hash_exchange() {
    insta::assert_snapshot!(explain("SELECT k, count(*) FROM t GROUP BY k").await);
}

#[tokio::test]
async fn explain_order_by_limit_shows_merge_of_sorted_runs() {
    insta::assert_snapshot!(explain("SELECT id FROM t ORDER BY id DESC LIMIT 3").await);
}

/// A partitioned join streams its probe input: `streams_probe_from` names the operator.
#[tokio::test]
async fn explain_partitioned_join_shows_the_streamed_probe_input() {
    insta::assert_snapshot!(
        explain_with(
            &[
                "SET datafusion.optimizer.hash_join_single_partition_threshold = 0",
                "SET datafusion.optimizer.hash_join_single_partition_threshold_rows = 0",
            ],
            "SELECT a.id, b.k FROM t a JOIN t b ON a.id = b.id WHERE a.k = 3"
        )
        .await
    );
}

#[tokio::test]
async fn explain_join_shows_the_collected_build_side() {
    insta::assert_snapshot!(
        explain("SELECT t.id, d.column2 FROM t JOIN d ON t.k = d.column1").await
    );
}

/// A join inside another join's probe side collects its build side: the operator that runs
/// both joins streams no input (before, it streamed the inner build's producer like a probe,
/// and a task could hold its slot waiting for blocks whose producer needed that slot).
#[tokio::test]
async fn explain_a_join_in_a_probe_side_collects_its_own_build_side() {
    insta::assert_snapshot!(
        explain("SELECT count(*) FROM t a JOIN t b ON a.id = b.id JOIN t c ON c.id = b.id + 1")
            .await
    );
}

/// `EXCEPT ALL` numbers each side's copies of a row in a window partitioned by the row, and
/// the anti join matches copy numbers too (flumen's `counted_set_operations`): the window's
/// sort and the join are operators of their own.
#[tokio::test]
async fn explain_except_all_numbers_the_copies_on_both_sides() {
    insta::assert_snapshot!(
        explain("SELECT k FROM t EXCEPT ALL SELECT k FROM t WHERE id > 50").await
    );
}

/// An uncorrelated scalar subquery is cut into operators of its own; the operator whose
/// filter reads its value (`SubqueryValuesExec`) takes it as a gathered input and waits
/// for it. Before, DataFusion's `ScalarSubqueryExec` kept the whole query one operator.
#[tokio::test]
async fn explain_scalar_subquery_gets_operators_of_its_own() {
    insta::assert_snapshot!(
        explain("SELECT k, count(*) FROM t WHERE id > (SELECT avg(id) FROM t) GROUP BY k").await
    );
}

/// EXPLAIN of `sql` over a 10-row Parquet table `docs(id, body)`, the temp dir's path
/// replaced by `TMP`.
async fn explain_over_docs(sql: &str) -> String {
    explain_over_docs_with(&[], sql).await
}

/// [`explain_over_docs`] after `settings` (`{dir}` in them: the test's temp dir).
async fn explain_over_docs_with(settings: &[&str], sql: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("docs.parquet");
    let ctx = flumen::session(FlumenConfig::default());
    ctx.sql(&format!(
        "COPY (SELECT x AS id, 'doc ' || x AS body FROM generate_series(1, 10) AS g(x)) TO '{}'",
        path.display()
    ))
    .await
    .unwrap()
    .collect()
    .await
    .unwrap();
    for setup in [
        "SET flumen.cpu_slots = 2".to_string(),
        "SET flumen.accelerator_slots = 1".to_string(),
        "SET flumen.device = 'cpu'".to_string(),
        "SET datafusion.explain.physical_plan_only = true".to_string(),
        format!(
            "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
            path.display()
        ),
    ]
    .into_iter()
    .chain((settings.iter()).map(|s| s.replace("{dir}", &dir.path().display().to_string())))
    {
        ctx.sql(&setup).await.unwrap().collect().await.unwrap();
    }
    let batches = ctx
        .sql(&format!("EXPLAIN {sql}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    // The plan text alone, with the temp dir's path (varying length) replaced.
    let dir_text = dir.path().display().to_string();
    let plan = batches[0].column(1).as_string::<i32>().value(0);
    plan.replace(dir_text.trim_start_matches('/'), "TMP")
}

/// `ORDER BY ... LIMIT` over a Parquet scan spread by a round-robin exchange: the scan's
/// source tasks run a copy of the TopK (with the filter between), each handing on its own
/// first rows; the TopK above reads the exchange directly (`plan::task_topk`).
#[tokio::test]
async fn explain_order_by_limit_over_parquet_keeps_each_splits_first_rows() {
    insta::assert_snapshot!(
        explain_over_docs("SELECT id FROM docs WHERE id <> 4 ORDER BY body DESC, id LIMIT 3").await
    );
}

/// `embed` over a Parquet scan: DataFusion would merge the call into the scan's projection;
/// flumen keeps it in an accelerator operator of its own, fed by the scan's source tasks.
/// (On the CPU the model tokenizes itself; on CUDA, or with `flumen.preprocess_on_cpu =
/// true`, the tokenizer `embed_tokens` runs in those source tasks: see `tests/embedding.rs`.)
#[tokio::test]
async fn explain_embed_over_parquet_gets_its_own_accelerator_operator() {
    insta::assert_snapshot!(explain_over_docs("SELECT id, embed(body) AS v FROM docs").await);
}

/// CPU work in and beside a model call (`clean_text`, `length`) runs below the accelerator
/// operators, in CPU tasks (`clean_text` in the scan's source tasks, `length` in a CPU
/// projection), and CPU work over model outputs (`cosine_similarity`) in a CPU operator above
/// them: each accelerator projection runs only `embed` and passes columns on. Two accelerator
/// operators, because DataFusion's common-subexpression pass computes
/// `embed(clean_text(body))` once in a projection of its own, below a round-robin
/// repartition; that repartition is cut as a pass-through CPU operator (id=2), which copies
/// blocks (left for the pipeline work).
#[tokio::test]
async fn explain_preprocessing_runs_in_cpu_tasks_below_the_model() {
    insta::assert_snapshot!(
        explain_over_docs(
            "SELECT id, embed(clean_text(body)) AS v, length(body) AS n, \
             cosine_similarity(embed(clean_text(body)), embed(body)) AS score FROM docs"
        )
        .await
    );
}

/// With the model-output cache, the CPU stage keys each row by the model's own argument
/// (`model_cache_key`, merged into the scan), looks it up (`model_cache_get`) and runs the
/// tokenizer only where it missed (`CASE WHEN ... IS NULL THEN embed_tokens(body)`); the
/// model operator computes the misses alone and fills them in (`model_cache_fill`).
#[tokio::test]
async fn explain_the_cache_lookup_runs_in_the_cpu_stage_before_the_tokenizer() {
    let plan = explain_over_docs_with(
        &[
            "SET flumen.model_cache = '{dir}/cache'",
            "SET flumen.preprocess_on_cpu = true",
        ],
        "SELECT id, embed(body) AS v FROM docs",
    )
    .await;
    // The model files' hash, which a new model version changes.
    let mut redacted = String::new();
    let mut rest = plan.as_str();
    while let Some(at) = rest.find(" files ") {
        redacted.push_str(&rest[..at + 7]);
        redacted.push_str("HASH");
        rest = &rest[(at + 7 + 64).min(rest.len())..];
    }
    redacted.push_str(rest);
    insta::assert_snapshot!(redacted);
}

/// A full sort out of core is a range sort: split by sampled ranges (their number shown),
/// one task sorts one range, the ranges concatenated in order.
#[tokio::test]
async fn explain_out_of_core_sort_shows_the_range_exchange() {
    insta::assert_snapshot!(
        explain_with(
            &[
                "CREATE TABLE big AS SELECT x AS id, x % 7 AS k FROM generate_series(1, 20000) AS g(x)",
                "SET flumen.memory_budget = '64KB'",
            ],
            "SELECT id, k FROM big ORDER BY k, id"
        )
        .await
    );
}

/// A range sort whose runs would be at least 1 MiB (half the budget over the ranges) sorts
/// each range in runs as its blocks arrive (a per-block operator) and merges them.
#[tokio::test]
async fn explain_range_sort_in_runs_shows_the_run_sorting_operator() {
    insta::assert_snapshot!(
        explain_with(
            &[
                "CREATE TABLE wide AS SELECT x AS id, x % 7 AS k FROM generate_series(1, 3000000) AS g(x)",
                "SET flumen.memory_budget = '32MB'",
            ],
            "SELECT id, k FROM wide ORDER BY k, id"
        )
        .await
    );
}

/// `shout(text)`: a model stand-in whose CPU step is `embed_tokens`, placed on an accelerator
/// or on the CPU as its `on_accelerator` says.
#[derive(Debug)]
struct Shout {
    on_accelerator: bool,
    signature: datafusion::logical_expr::Signature,
}

impl flumen::AcceleratorFunction for Shout {
    fn name(&self) -> &str {
        "shout"
    }
    fn signature(&self) -> &datafusion::logical_expr::Signature {
        &self.signature
    }
    fn return_type(
        &self,
        _: &[datafusion::arrow::datatypes::DataType],
    ) -> datafusion::error::Result<datafusion::arrow::datatypes::DataType> {
        Ok(datafusion::arrow::datatypes::DataType::Utf8)
    }
    fn load(
        &self,
        _: &datafusion::config::ConfigOptions,
    ) -> datafusion::error::Result<Box<dyn flumen::AcceleratorWorker>> {
        Ok(Box::new(ShoutWorker))
    }
    fn resources(&self, _: &datafusion::config::ConfigOptions) -> flumen::WorkerResources {
        flumen::WorkerResources {
            accelerators: usize::from(self.on_accelerator),
            cpu_threads: 1,
        }
    }
    fn cpu_step(&self) -> Option<std::sync::Arc<datafusion::logical_expr::ScalarUDF>> {
        Some(flumen::functions::embedding::tokenize_step::embed_tokens_udf())
    }
}

struct ShoutWorker;

impl flumen::AcceleratorWorker for ShoutWorker {
    fn process(
        &mut self,
        args: &[datafusion::arrow::array::ArrayRef],
        _: &datafusion::arrow::datatypes::DataType,
    ) -> datafusion::error::Result<datafusion::arrow::array::ArrayRef> {
        Ok(std::sync::Arc::clone(&args[0]))
    }
}

/// The accelerator projection's line of `EXPLAIN SELECT shout(t)` under
/// `flumen.preprocess_on_cpu = setting`, with the model on an accelerator or not.
async fn shout_plan(on_accelerator: bool, setting: &str) -> String {
    let ctx = flumen::session(FlumenConfig::default());
    ctx.register_udf(flumen::accelerator_udf(Shout {
        on_accelerator,
        signature: datafusion::logical_expr::Signature::string(
            1,
            datafusion::logical_expr::Volatility::Immutable,
        ),
    }));
    let mut batches = vec![];
    for sql in [
        format!("SET flumen.preprocess_on_cpu = {setting}"),
        "CREATE TABLE words AS VALUES ('a <b>bold</b> word')".to_string(),
        "EXPLAIN SELECT shout(column1) AS s FROM words".to_string(),
    ] {
        batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
    }
    let plan = pretty_format_batches(&batches).unwrap().to_string();
    plan.lines()
        .find(|l| l.contains("AcceleratorProjectionExec: expr="))
        .unwrap_or_else(|| panic!("no accelerator projection in\n{plan}"))
        .to_string()
}

/// `flumen.preprocess_on_cpu = auto` moves a model's CPU step below it exactly when the
/// model's workers occupy an accelerator; `true` always, `false` never.
#[tokio::test]
async fn a_cpu_step_is_split_off_for_models_on_an_accelerator() {
    let split =
        |line: &str| !line.contains("embed_tokens") && line.contains("shout(__flumen_cpu_0@");
    let whole = |line: &str| line.contains("shout(column1@0)");
    for (on_accelerator, setting, expect_split) in [
        (true, "auto", true),
        (false, "auto", false),
        (false, "true", true),
        (true, "false", false),
    ] {
        let line = shout_plan(on_accelerator, setting).await;
        let ok = if expect_split {
            split(&line)
        } else {
            whole(&line)
        };
        assert!(
            ok,
            "accelerator={on_accelerator}, preprocess_on_cpu={setting}: {line}"
        );
    }
}

/// A model over another model's output, with CPU work between them
/// (`model_b(post(model_a(x)))`): each model gets an accelerator operator of its own, and
/// the CPU work between them (here `array_to_string`) a CPU operator between the two, so
/// neither model's worker waits on the other or on CPU work.
#[tokio::test]
async fn explain_models_over_models_get_an_operator_each_with_cpu_work_between() {
    use flumen::functions::emulated_accelerator::EmulatedModel;
    let plan = {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docs.parquet");
        let ctx = flumen::session(FlumenConfig::default());
        for spec in ["model_a:0:256:4", "model_b:0:256:2"] {
            ctx.register_udf(flumen::accelerator_udf(
                EmulatedModel::from_spec(spec).unwrap(),
            ));
        }
        let mut batches = vec![];
        for sql in [
            format!(
                "COPY (SELECT x AS id, 'doc ' || x AS body FROM generate_series(1, 10) AS g(x)) \
                 TO '{}'",
                path.display()
            ),
            "SET flumen.cpu_slots = 2".into(),
            "SET flumen.accelerator_slots = 2".into(),
            "SET datafusion.explain.physical_plan_only = true".into(),
            format!(
                "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
                path.display()
            ),
            "EXPLAIN SELECT id, model_b(array_to_string(model_a(clean_text(body)), ',')) AS v \
             FROM docs"
                .into(),
        ] {
            batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        }
        let dir_text = dir.path().display().to_string();
        let plan = batches[0].column(1).as_string::<i32>().value(0);
        plan.replace(dir_text.trim_start_matches('/'), "TMP")
    };
    insta::assert_snapshot!(plan);
}

/// A model called in `WHERE` runs in an accelerator operator, as in a `SELECT` list: the
/// conditions that call no model filter first (in CPU tasks, so the model never sees the rows
/// they drop), the model's result is computed by an accelerator projection, the conditions
/// over it filter after, and the model's column is dropped.
#[tokio::test]
async fn explain_a_model_in_where_gets_an_accelerator_operator() {
    insta::assert_snapshot!(
        explain_over_docs("SELECT id FROM docs WHERE id > 3 AND embed(body)[1] > 0").await
    );
}

/// A memory table that counts how many times physical planning scanned it.
#[derive(Debug)]
struct ScanCountingTable {
    inner: MemTable,
    scans: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl TableProvider for ScanCountingTable {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }
    fn table_type(&self) -> TableType {
        TableType::Base
    }
    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        self.scans.fetch_add(1, Ordering::SeqCst);
        self.inner.scan(state, projection, filters, limit).await
    }
}

/// `EXPLAIN` plans its query once (DataFusion's `ExplainExec` keeps no plan: flumen used
/// to plan the query a second time for its operators), in threads mode and with worker
/// processes, and shows flumen's operators; the query then answers as vanilla DataFusion.
#[tokio::test]
async fn explain_plans_its_query_once_in_threads_and_in_workers() {
    let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![Arc::new(Int64Array::from_iter_values(0..1000))],
    )
    .unwrap();
    let sql = "SELECT a % 3 AS k, count(*) AS n FROM t WHERE a > 10 GROUP BY a % 3";
    let vanilla = crate::common::vanilla();
    let table = MemTable::try_new(Arc::clone(&schema), vec![vec![batch.clone()]]).unwrap();
    vanilla.register_table("t", Arc::new(table)).unwrap();
    for workers in [WorkerMode::Threads, WorkerMode::Process] {
        let mut config = FlumenConfig::default();
        config.workers = workers;
        config.worker_processes = 2;
        config.worker_binary = env!("CARGO_BIN_EXE_flumen").into();
        let ctx =
            flumen::session_with_config(SessionConfig::new().with_target_partitions(2), config);
        let scans = Arc::new(AtomicUsize::new(0));
        let table = ScanCountingTable {
            inner: MemTable::try_new(Arc::clone(&schema), vec![vec![batch.clone()]]).unwrap(),
            scans: Arc::clone(&scans),
        };
        ctx.register_table("t", Arc::new(table)).unwrap();
        // The EXPLAIN's text, and how many times its planning scanned `t`.
        let explain = async || {
            scans.store(0, Ordering::SeqCst);
            let batches = crate::common::collect(&ctx, &format!("EXPLAIN {sql}")).await;
            let text = pretty_format_batches(&batches).unwrap().to_string();
            (text, scans.load(Ordering::SeqCst))
        };
        let (explained, scanned) = explain().await;
        assert_eq!(scanned, 1, "{workers:?}: {explained}");
        assert!(
            explained.contains("logical_plan"),
            "{workers:?}: {explained}"
        );
        assert!(explained.contains("FlumenExec"), "{workers:?}: {explained}");
        // With `physical_plan_only`, only flumen's plan; still planned once.
        crate::common::collect(&ctx, "SET datafusion.explain.physical_plan_only = true").await;
        let (physical, scanned) = explain().await;
        assert_eq!(scanned, 1, "{workers:?}: {physical}");
        assert!(
            !physical.contains("logical_plan"),
            "{workers:?}: {physical}"
        );
        assert!(physical.contains("FlumenExec"), "{workers:?}: {physical}");
        crate::common::assert_same(&vanilla, &ctx, sql).await;
        let (_, plan) = crate::common::run_plan(&ctx, sql).await;
        let (remote, all) = crate::common::remote_and_all_tasks(&plan);
        let in_workers = workers == WorkerMode::Process;
        assert_eq!(
            remote > 0,
            in_workers,
            "{workers:?}: {remote} of {all} tasks remote"
        );
    }
}
