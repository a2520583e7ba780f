//! Queries over a table of Parquet files sorted by `id` (a log or event table, its files
//! appended in `id` order): `ORDER BY ... LIMIT` for the latest rows, the oldest rows and the
//! largest values of an unsorted column, and a `GROUP BY` of the sort key, in vanilla
//! DataFusion, flumen's threads mode and flumen with two worker processes, measured in the
//! same run.
//!
//! `cargo bench --bench topk [-- --rows 4000000 --files 4 --row-group 100000 --runs 5
//! --check]`
//!
//! Figures: per query and engine the median time of `--runs` runs (after one untimed run),
//! its ratio to vanilla's, the row groups flumen's scans read (`EXPLAIN ANALYZE`: those
//! their statistics and the TopK's bound left) and, with workers, the tasks that ran on the
//! driver. Every answer is checked against vanilla's.
//! Goals: flumen in threads mode at most 1.5x vanilla's time on every query, and the latest
//! rows read from at most half of the row groups (`plan::task_topk`: each split's task
//! keeps its own first rows, the last splits launched first, their bound pruning the splits
//! launched after them; the first wave, one split per CPU slot, is read whole). The `GROUP
//! BY id`: DataFusion keeps the files' order through its hash exchange so its aggregate
//! streams; flumen makes that exchange plain (`plan::plain_hash_exchanges`) so that it is
//! cut into tasks: goal, no task of it on the driver with workers.

#[path = "common/args.rs"]
mod args;
#[path = "common/verdict.rs"]
mod verdict;

use std::time::Instant;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::Result;
use datafusion::prelude::SessionContext;
use flumen::{FlumenConfig, WorkerMode};

/// The queries: a name and the SQL.
const QUERIES: [(&str, &str); 4] = [
    (
        "latest rows",
        "SELECT id, name FROM t WHERE k <> 3 ORDER BY id DESC LIMIT 10",
    ),
    (
        "oldest rows",
        "SELECT id, name FROM t WHERE k <> 3 ORDER BY id LIMIT 10",
    ),
    (
        "largest v",
        "SELECT id, v FROM t WHERE k <> 3 ORDER BY v DESC, id LIMIT 10",
    ),
    (
        "group by id",
        "SELECT count(*), sum(n), max(top) FROM (SELECT id, count(*) AS n, max(v) AS top \
         FROM t WHERE k <> 3 GROUP BY id)",
    ),
];

/// Runs `sql` in `ctx`: the answer as text.
async fn answer(ctx: &SessionContext, sql: &str) -> Result<String> {
    let batches = ctx.sql(sql).await?.collect().await?;
    Ok(pretty_format_batches(&batches)?.to_string())
}

/// Row groups the scans of `sql` read in `ctx`, from `EXPLAIN ANALYZE`: the `M` of each
/// `row_groups_pruned_statistics=N total → M matched` (on a scan in threads mode, on its
/// operator with workers), summed; `None` where no scan shows it.
async fn row_groups_read(ctx: &SessionContext, sql: &str) -> Result<Option<u64>> {
    let text = answer(ctx, &format!("EXPLAIN ANALYZE {sql}")).await?;
    let read: Vec<u64> = (text.lines())
        .filter(|line| line.contains("tasks=source") || line.contains("DataSourceExec"))
        .filter_map(|line| {
            let pruned = line.split("row_groups_pruned_statistics=").nth(1)?;
            let matched = pruned.split(" → ").nth(1)?.split(" matched").next()?;
            matched.parse::<u64>().ok()
        })
        .collect();
    Ok((!read.is_empty()).then(|| read.iter().sum()))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let number = |name: &str, default: u64| args::number(&args, name, default);
    let files = number("--files", 4).max(1);
    let rows = number("--rows", 4_000_000).max(files);
    let row_group = number("--row-group", 100_000).max(1);
    let runs = number("--runs", 5).max(1) as usize;
    let row_groups = files * (rows / files).div_ceil(row_group);
    println!(
        "topk: {rows} rows in {files} Parquet files sorted by id, row groups of {row_group} \
         rows ({row_groups} in all), median of {runs} runs"
    );

    let dir = tempfile::tempdir()?;
    let writer = SessionContext::new();
    for file in 0..files {
        let (first, last) = (file * rows / files, (file + 1) * rows / files - 1);
        writer
            .sql(&format!(
                "COPY (SELECT i AS id, i % 97 AS k, (i * 7919) % 1000003 AS v, \
                 concat('name-', CAST(i AS VARCHAR)) AS name \
                 FROM generate_series({first}, {last}) g(i) ORDER BY i) TO '{}' \
                 STORED AS PARQUET OPTIONS ('format.max_row_group_size' '{row_group}')",
                dir.path().join(format!("part-{file}.parquet")).display()
            ))
            .await?
            .collect()
            .await?;
    }
    let create = format!(
        "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION '{}/'",
        dir.path().display()
    );

    let mut workers_config = FlumenConfig::default();
    workers_config.workers = WorkerMode::Process;
    workers_config.worker_processes = 2;
    workers_config.worker_binary = std::env::var("FLUMEN_WORKER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_flumen").into())
        .into();
    let engines = [
        ("vanilla DataFusion", SessionContext::new()),
        ("flumen, threads", flumen::session(FlumenConfig::default())),
        ("flumen, 2 workers", flumen::session(workers_config)),
    ];
    for (_, ctx) in &engines {
        ctx.sql(&create).await?.collect().await?;
    }

    for (name, sql) in QUERIES {
        println!("\n{name}: {sql}");
        let reference = answer(&engines[0].1, sql).await?;
        let mut vanilla_seconds = None;
        for (engine, ctx) in &engines {
            // Untimed: the first run (worker processes start in the first query).
            if answer(ctx, sql).await? != reference {
                verdict::fail(format!("{engine}: {name}: another answer than vanilla's"));
                continue;
            }
            let mut seconds = vec![];
            for _ in 0..runs {
                let start = Instant::now();
                answer(ctx, sql).await?;
                seconds.push(start.elapsed().as_secs_f64());
            }
            let median = median(&mut seconds);
            let vanilla = *vanilla_seconds.get_or_insert(median);
            let read = match engine.starts_with("flumen") {
                true => match row_groups_read(ctx, sql).await? {
                    Some(read) => format!(", {read} of {row_groups} row groups read"),
                    None => ", row groups read not shown".into(),
                },
                false => String::new(),
            };
            println!(
                "  {engine:<20} {:>8.1} ms  {:>5.2}x vanilla{read}",
                median * 1000.0,
                median / vanilla
            );
            if *engine == "flumen, threads" {
                let met = median <= 1.5 * vanilla;
                println!(
                    "  goal: threads mode at most 1.5x vanilla: {}",
                    verdict::goal(&format!("{name}: threads at most 1.5x vanilla"), met)
                );
            }
            if *engine == "flumen, 2 workers" && name == "group by id" {
                let text = answer(ctx, &format!("EXPLAIN ANALYZE {sql}")).await?;
                let on_driver = tasks_on_driver(&text);
                println!(
                    "  goal: no task on the driver: {} ({on_driver} tasks there)",
                    verdict::goal("group by id: no task on the driver", on_driver == 0)
                );
            }
            if *engine != "vanilla DataFusion" && name == "latest rows" {
                match row_group_goal(ctx, sql, row_groups).await? {
                    Some(met) => println!(
                        "  goal: the latest rows from at most half of the row groups: {}",
                        verdict::goal(&format!("{engine}: latest rows read half"), met)
                    ),
                    None => verdict::not_measured(
                        &format!("{engine}: row groups read"),
                        "no scan shows them",
                    ),
                }
            }
        }
    }
    verdict::finish();
    Ok(())
}

/// The tasks an `EXPLAIN ANALYZE` says ran on the driver: each operator's
/// `tasks_on_driver=N`, summed.
fn tasks_on_driver(text: &str) -> u64 {
    (text.split("tasks_on_driver=").skip(1))
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Whether `sql` read at most half of `row_groups` in `ctx` (`None`: not shown).
async fn row_group_goal(ctx: &SessionContext, sql: &str, row_groups: u64) -> Result<Option<bool>> {
    Ok(row_groups_read(ctx, sql)
        .await?
        .map(|read| read * 2 <= row_groups))
}
