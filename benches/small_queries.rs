//! What a small query costs when its tasks run in worker processes: the same stream of short
//! queries over a small Parquet table in vanilla DataFusion, in flumen's threads mode and in
//! flumen with two local worker processes (`flumen.workers = 'process'`), measured in the
//! same run.
//!
//! `cargo bench --bench small_queries [-- --rows 100000 --files 4 --queries 60 --runs 3
//! --worker-bundle-blocks 8 --check]`
//! (`--timed workers` times one engine alone, e.g. under `perf`: `vanilla`, `threads` or
//! `workers`, comma-separated; the ratios need all three; `FLUMEN_WORKER_BIN=PATH` starts
//! the workers from another build or a wrapper; `--worker-bundle-blocks` sets worker mode's
//! `flumen.worker_bundle_blocks`, 1 for a block a task)
//!
//! The table is `--files` Parquet files of `--rows / --files` rows (`id`, `k` of 97 values, `v`, `name`).
//! The queries cycle through four shapes with a constant that changes per query (nothing is
//! cached): a filtered `GROUP BY`, a `TopK`, a point lookup and a join of the table with a
//! filtered copy of itself. Each engine runs one query before timing (worker processes start
//! there), then `--runs` rounds of `--queries` queries, rounds interleaved across engines.
//! Figures: per engine the median round's time, queries per second, and the p50 and p99 of
//! every timed query; for worker mode the tasks its workers ran per query, the time above
//! threads mode per query and per worker task. Every answer is checked against vanilla's.
//! Goal: worker mode's mean query time is at most twice threads mode's (a query's tasks
//! cross a process boundary, but most of a small query's time should still be the query).

#[path = "common/args.rs"]
mod args;
#[path = "common/verdict.rs"]
mod verdict;

use std::time::Instant;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::Result;
use datafusion::prelude::SessionContext;
use flumen::cluster::WorkerPoolSlot;
use flumen::{FlumenConfig, WorkerMode};

/// The query shapes: `{c}` is a constant that changes per query, `{rows}` the table's rows.
const SHAPES: [(&str, &str); 4] = [
    (
        "group by",
        "SELECT k, count(*) AS n, sum(v) AS s FROM t WHERE id % 7 = {c} % 7 \
         GROUP BY k ORDER BY k",
    ),
    (
        "topk",
        "SELECT id, v FROM t WHERE k = {c} % 97 ORDER BY v DESC, id LIMIT 5",
    ),
    (
        "point",
        "SELECT id, k, v, name FROM t WHERE id = ({c} * 7919) % {rows}",
    ),
    (
        "join",
        "SELECT a.k, count(*) AS n FROM t a JOIN (SELECT k FROM t WHERE id % 1000 = {c}) b \
         ON a.k = b.k GROUP BY a.k ORDER BY a.k",
    ),
];

/// An engine the queries run in.
struct Engine {
    /// Its name in `--timed`.
    key: &'static str,
    name: &'static str,
    ctx: SessionContext,
    /// Every timed query's seconds, over all rounds.
    query_seconds: Vec<f64>,
    /// Each round's seconds.
    round_seconds: Vec<f64>,
}

/// Tasks the live worker processes of `ctx`'s session have run (0 in threads mode).
async fn worker_tasks(ctx: &SessionContext) -> u64 {
    match ctx.state().config().get_extension::<WorkerPoolSlot>() {
        Some(slot) => slot.tasks_in_workers().await,
        None => 0,
    }
}

/// Query `i` of the stream, and its shape's name.
fn query(i: usize, rows: u64) -> (&'static str, String) {
    let (name, sql) = SHAPES[i % SHAPES.len()];
    let sql = sql
        .replace("{c}", &(i / SHAPES.len() + 1).to_string())
        .replace("{rows}", &rows.to_string());
    (name, sql)
}

/// Runs `sql` in `ctx`: the answer as text.
async fn answer(ctx: &SessionContext, sql: &str) -> Result<String> {
    let batches = ctx.sql(sql).await?.collect().await?;
    Ok(pretty_format_batches(&batches)?.to_string())
}

/// The `p`th percentile (0–100) of `values` (nearest rank).
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let number = |name: &str, default: u64| args::number(&args, name, default);
    let files = number("--files", 4).max(1);
    let rows = number("--rows", 100_000).max(files);
    let queries = number("--queries", 60).max(1) as usize;
    let runs = number("--runs", 3).max(1) as usize;
    println!(
        "small queries: {rows} rows in {files} Parquet files, {runs} rounds of {queries} \
         queries ({} shapes in turn), worker_bundle_blocks={}",
        SHAPES.len(),
        number("--worker-bundle-blocks", 8)
    );

    let dir = tempfile::tempdir()?;
    let location = dir.path().join("t");
    std::fs::create_dir(&location)?;
    let writer = SessionContext::new();
    for file in 0..files {
        let (first, last) = (file * rows / files, (file + 1) * rows / files - 1);
        let path = location.join(format!("part-{file}.parquet"));
        writer
            .sql(&format!(
                "COPY (SELECT i AS id, i % 97 AS k, (i * 7919) % 1000 AS v, \
                 concat('name-', CAST(i AS VARCHAR)) AS name \
                 FROM generate_series({first}, {last}) g(i)) TO '{}' STORED AS PARQUET",
                path.display()
            ))
            .await?
            .collect()
            .await?;
    }
    let create = format!(
        "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION '{}/'",
        location.display()
    );

    let mut workers_config = FlumenConfig::default();
    workers_config.workers = WorkerMode::Process;
    workers_config.worker_processes = 2;
    workers_config.worker_bundle_blocks = number("--worker-bundle-blocks", 8) as usize;
    // `FLUMEN_WORKER_BIN` runs another build (or a wrapper) as the workers.
    workers_config.worker_binary = std::env::var("FLUMEN_WORKER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_flumen").into())
        .into();
    let mut engines = vec![
        ("vanilla", "vanilla DataFusion", SessionContext::new()),
        (
            "threads",
            "flumen, threads",
            flumen::session(FlumenConfig::default()),
        ),
        (
            "workers",
            "flumen, 2 worker processes",
            flumen::session(workers_config),
        ),
    ]
    .into_iter()
    .map(|(key, name, ctx)| Engine {
        key,
        name,
        ctx,
        query_seconds: vec![],
        round_seconds: vec![],
    })
    .collect::<Vec<_>>();
    for engine in &engines {
        engine.ctx.sql(&create).await?.collect().await?;
        // Not timed: the first query (worker processes start here).
        answer(&engine.ctx, &query(0, rows).1).await?;
    }

    let timed_engines = args::flag_value(&args, "--timed");
    let is_timed = |key: &str| {
        timed_engines
            .as_deref()
            .is_none_or(|only| only.split(',').any(|timed| timed == key))
    };
    let reference: Vec<String> = {
        let mut answers = vec![];
        for i in 0..queries {
            answers.push(answer(&engines[0].ctx, &query(i, rows).1).await?);
        }
        answers
    };
    let workers = engines.len() - 1;
    let tasks_before = worker_tasks(&engines[workers].ctx).await;
    for _ in 0..runs {
        for engine in &mut engines {
            if !is_timed(engine.key) {
                continue;
            }
            let round = Instant::now();
            for (i, expected) in reference.iter().enumerate() {
                let (shape, sql) = query(i, rows);
                let started = Instant::now();
                let got = answer(&engine.ctx, &sql).await?;
                engine.query_seconds.push(started.elapsed().as_secs_f64());
                if &got != expected {
                    verdict::fail(format!(
                        "{}, query {i} ({shape}): answered\n{got}\nvanilla\n{expected}",
                        engine.name
                    ));
                }
            }
            engine.round_seconds.push(round.elapsed().as_secs_f64());
        }
    }
    let timed = (runs * queries) as f64;
    let tasks_per_query = (worker_tasks(&engines[workers].ctx).await - tasks_before) as f64 / timed;

    println!(
        "{:<28} {:>9} {:>10} {:>9} {:>9} {:>9}",
        "engine", "round s", "queries/s", "mean ms", "p50 ms", "p99 ms"
    );
    for engine in &engines {
        if engine.round_seconds.is_empty() {
            continue;
        }
        let round = percentile(&engine.round_seconds, 50.0);
        println!(
            "{:<28} {round:>9.3} {:>10.1} {:>9.2} {:>9.2} {:>9.2}",
            engine.name,
            queries as f64 / round,
            mean(&engine.query_seconds) * 1e3,
            percentile(&engine.query_seconds, 50.0) * 1e3,
            percentile(&engine.query_seconds, 99.0) * 1e3,
        );
    }
    // Each shape's mean: the timed queries come round by round, query `i` of a round being
    // of shape `i % SHAPES.len()`.
    print!("{:<28}", "mean ms by shape");
    for (shape, _) in SHAPES {
        print!(" {shape:>9}");
    }
    println!();
    for engine in engines.iter().filter(|e| !e.query_seconds.is_empty()) {
        print!("{:<28}", engine.name);
        for shape in 0..SHAPES.len() {
            let of_shape: Vec<f64> = (engine.query_seconds.iter().enumerate())
                .filter(|(j, _)| (j % queries) % SHAPES.len() == shape)
                .map(|(_, seconds)| *seconds)
                .collect();
            print!(" {:>9.2}", mean(&of_shape) * 1e3);
        }
        println!();
    }
    if is_timed(engines[workers].key) && tasks_per_query < 1.0 {
        verdict::fail(format!(
            "worker mode ran {tasks_per_query:.2} tasks per query in its workers: the bench \
             would not measure worker tasks"
        ));
    }
    if engines.iter().any(|e| e.query_seconds.is_empty()) {
        verdict::not_measured(
            "worker mode within 2x threads mode per query",
            "--timed left an engine out",
        );
    } else {
        let threads = mean(&engines[1].query_seconds);
        let in_workers = mean(&engines[workers].query_seconds);
        println!(
            "worker mode: {tasks_per_query:.1} tasks per query in the workers; {:.2} ms per \
             query above threads mode, {:.3} ms per worker task",
            (in_workers - threads) * 1e3,
            (in_workers - threads) * 1e3 / tasks_per_query.max(1.0)
        );
        let ratio = in_workers / threads;
        let met = verdict::goal("worker mode within 2x threads mode per query", ratio <= 2.0);
        println!(
            "worker mode / threads mode, mean per query: {ratio:.2} (goal ≤ 2: {met}); \
             threads mode / vanilla: {:.2}",
            threads / mean(&engines[0].query_seconds)
        );
    }
    verdict::finish();
    Ok(())
}
