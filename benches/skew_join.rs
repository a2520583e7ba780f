//! A join whose build side has one key hotter than the whole memory budget: flumen cutting
//! the hot partition into slices of its build side (the default) against flumen running it
//! again alone and then as a sort-merge join (`flumen.slice_hot_partitions = false`), and
//! against vanilla DataFusion with the same memory limit and with none, in the same run.
//! Then a full sort whose key has the same hot value: flumen spreading the hot value over
//! several ranges of its range sort (the default) against one range for it (the setting off).
//!
//! `cargo bench --bench skew_join [-- --hot-rows 20000000 --facts-rows 30000000
//! --hot-percent 30 --budget 64MB --runs 3 --dir target/skewbench --queries inner,left,sort
//! --analyze --set KEY=VALUE]`
//! (`--analyze`: flumen's `EXPLAIN ANALYZE` of each query, with and without slices)
//!
//! Tables (Parquet, generated once per size under `--dir`): `hot(k, v)` with `--hot-percent`
//! of its rows on `k = 0` and the rest on distinct even keys, and `facts(id, v)` with one row
//! per id, larger than `hot` so that DataFusion builds on `hot`. Each join query joins `hot`
//! to `facts`; every engine's answer is checked against vanilla's with no limit. The sort
//! reads `events(id, k, tag)`, as many rows as `hot` with the same share on one `k`, and
//! its output is streamed, not kept: checked sorted on `k`, with the row count and id sum of
//! vanilla's. Figures: the median time of `--runs` rounds
//! (engines interleaved within a round), the ratio to the unlimited vanilla run and of
//! flumen to flumen without slices, and each engine's largest RSS rise over the budget.

#[path = "common/args.rs"]
mod args;
use std::path::{Path, PathBuf};
use std::time::Instant;

use datafusion::arrow::array::AsArray;
use datafusion::arrow::datatypes::Int64Type;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use flumen::config::ByteSize;
use futures::TryStreamExt;

#[path = "common/rss.rs"]
mod rss;
#[path = "common/verdict.rs"]
mod verdict;
use rss::RssWatch;

/// Every engine allocates as the `flumen` binary does (jemalloc), so RSS figures compare.
#[path = "../src/bin/flumen/allocator.rs"]
mod allocator;

const QUERIES: [(&str, &str); 3] = [
    (
        "inner",
        "SELECT count(*), sum(h.v), sum(f.v) FROM hot h JOIN facts f ON h.k = f.id",
    ),
    (
        "left",
        "SELECT count(*), sum(h.v), sum(f.v) FROM hot h LEFT JOIN facts f ON h.k = f.id",
    ),
    ("sort", SORT_QUERY),
];

/// The full sort on a hot key; its answer is [`sorted_digest`]ed as it streams.
const SORT_QUERY: &str = "SELECT k, id, tag FROM events ORDER BY k";

/// The sort's output, read as it streams: its row count and id sum, and whether `k` (the
/// first column) never goes down. Rows tied on `k` may come in any order.
async fn sorted_digest(ctx: &SessionContext, sql: &str) -> Result<String> {
    let mut stream = ctx.sql(sql).await?.execute_stream().await?;
    let (mut rows, mut id_sum, mut last, mut sorted) = (0u64, 0i128, i64::MIN, true);
    while let Some(batch) = stream.try_next().await? {
        let k = batch.column(0).as_primitive::<Int64Type>();
        let id = batch.column(1).as_primitive::<Int64Type>();
        for (k, id) in k.values().iter().zip(id.values()) {
            sorted &= *k >= last;
            last = *k;
            id_sum += *id as i128;
        }
        rows += batch.num_rows() as u64;
    }
    Ok(format!("rows={rows} id_sum={id_sum} sorted={sorted}"))
}

/// What one engine did with one query, over the rounds.
#[derive(Default)]
struct Figures {
    seconds: Vec<f64>,
    rss_rise: u64,
    failure: Option<String>,
}

/// Write `hot`, `facts` and `events` under `dir` unless a table of the same size is there.
async fn generate(dir: &Path, hot_rows: u64, facts_rows: u64, hot_percent: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let ctx = SessionContext::new();
    let tables = [
        (
            "hot",
            format!(
                "SELECT CASE WHEN value % 100 < {hot_percent} THEN 0 ELSE value * 2 END AS k, \
                 value % 97 AS v FROM range(0, {hot_rows})"
            ),
        ),
        (
            "facts",
            format!("SELECT value AS id, (value * 31) % 1000 AS v FROM range(0, {facts_rows})"),
        ),
        (
            "events",
            format!(
                "SELECT value AS id, CASE WHEN value % 100 < {hot_percent} THEN 0 ELSE value \
                 END AS k, 'event-' || CAST(value * 7 AS VARCHAR) AS tag FROM range(0, \
                 {hot_rows})"
            ),
        ),
    ];
    for (name, select) in tables {
        let path = dir.join(format!("{name}.parquet"));
        if !path.exists() {
            let sql = format!("COPY ({select}) TO '{}'", path.display());
            ctx.sql(&sql).await?.collect().await?;
        }
    }
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    allocator::install();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args::flag_value(&args, name);
    let number = |name: &str, default: u64| arg(name).map_or(default, |s| s.parse().unwrap());
    let hot_rows = number("--hot-rows", 20_000_000);
    let facts_rows = number("--facts-rows", 30_000_000);
    let hot_percent = number("--hot-percent", 30);
    let runs = number("--runs", 3).max(1) as usize;
    let budget: ByteSize = arg("--budget").unwrap_or_else(|| "64MB".into()).parse()?;
    let dir = PathBuf::from(arg("--dir").unwrap_or_else(|| "target/skewbench".into()))
        .join(format!("{hot_rows}-{facts_rows}-{hot_percent}"));
    generate(&dir, hot_rows, facts_rows, hot_percent).await?;
    let cores = flumen::config::available_cores();
    println!(
        "hot: {hot_rows} rows, {hot_percent}% on one key ({} rows); facts: {facts_rows} \
         rows; budget {budget}; {cores} cores; {runs} rounds",
        hot_rows * hot_percent / 100
    );

    let config = || SessionConfig::new().with_target_partitions(cores);
    let limited = RuntimeEnvBuilder::new()
        .with_memory_limit(budget.0 as usize, 1.0)
        .build_arc()?;
    let mut flumen_config = flumen::FlumenConfig::default();
    flumen_config.memory_budget = budget;
    let sliced = flumen::session_with_config(config(), flumen_config.clone());
    flumen_config.slice_hot_partitions = false;
    let unsliced = flumen::session_with_config(config(), flumen_config);
    // `--set KEY=VALUE` (repeatable): a flumen setting for both flumen sessions, e.g.
    // `flumen.sort_runs=false`.
    for (flag, setting) in args.iter().zip(args.iter().skip(1)) {
        if flag != "--set" {
            continue;
        }
        let (key, value) = setting
            .split_once('=')
            .ok_or_else(|| DataFusionError::Plan(format!("--set {setting}: expected KEY=VALUE")))?;
        for ctx in [&sliced, &unsliced] {
            ctx.sql(&format!("SET {key} = '{value}'"))
                .await?
                .collect()
                .await?;
        }
    }
    let engines = [
        (
            "vanilla, no limit",
            SessionContext::new_with_config(config()),
        ),
        (
            "vanilla, budget as limit",
            SessionContext::new_with_config_rt(config(), limited),
        ),
        ("flumen, slice_hot_partitions off", unsliced),
        ("flumen", sliced),
    ];
    for (_, ctx) in &engines {
        for table in ["hot", "facts", "events"] {
            let path = dir.join(format!("{table}.parquet"));
            ctx.register_parquet(table, path.to_str().unwrap(), ParquetReadOptions::default())
                .await?;
        }
    }

    let chosen = arg("--queries").unwrap_or_else(|| "inner,left,sort".into());
    for (label, sql) in QUERIES {
        if !chosen.split(',').any(|q| q == label) {
            continue;
        }
        println!("\n## {label}: {sql}");
        let mut figures: Vec<Figures> = engines.iter().map(|_| Figures::default()).collect();
        let mut expected: Option<String> = None;
        for _ in 0..runs {
            for ((name, ctx), fig) in engines.iter().zip(&mut figures) {
                if fig.failure.is_some() {
                    continue;
                }
                flumen::HeapAllocator::return_freed(&allocator::Jemalloc);
                let rss = RssWatch::start();
                let started = Instant::now();
                let result = async {
                    if sql == SORT_QUERY {
                        sorted_digest(ctx, sql).await
                    } else {
                        let batches = ctx.sql(sql).await?.collect().await?;
                        Ok(pretty_format_batches(&batches)?.to_string())
                    }
                }
                .await;
                let seconds = started.elapsed().as_secs_f64();
                match result {
                    Ok(answer) => {
                        assert!(!answer.contains("sorted=false"), "{name}: not sorted");
                        match &expected {
                            None => expected = Some(answer),
                            Some(want) => assert_eq!(want, &answer, "{name}: {sql}"),
                        }
                        fig.seconds.push(seconds);
                        fig.rss_rise = fig.rss_rise.max(rss.rise());
                    }
                    Err(e) => {
                        let first_line = e.to_string().lines().next().unwrap_or("").to_string();
                        // Vanilla under the budget as its limit may fail (that is measured);
                        // the others must answer.
                        if *name != "vanilla, budget as limit" && fig.failure.is_none() {
                            verdict::fail(format!("{label} on {name}: {first_line}"));
                        }
                        fig.failure = Some(first_line);
                    }
                }
            }
        }
        if args.iter().any(|a| a == "--analyze") {
            for (name, ctx) in &engines[2..] {
                let plan = ctx
                    .sql(&format!("EXPLAIN ANALYZE {sql}"))
                    .await?
                    .collect()
                    .await?;
                println!("{name}:\n{}", pretty_format_batches(&plan)?);
            }
        }
        let baseline = median(&figures[0].seconds);
        let unsliced_time = figures[2]
            .seconds
            .first()
            .map(|_| median(&figures[2].seconds));
        println!("| engine | median s | runs (s) | vs vanilla no limit | RSS rise / budget |");
        println!("|---|---|---|---|---|");
        for ((name, _), fig) in engines.iter().zip(&figures) {
            if let Some(failure) = &fig.failure {
                let failure: String = failure.chars().take(110).collect();
                println!("| {name} | fails: {failure} | | | |");
                continue;
            }
            let runs: Vec<String> = fig.seconds.iter().map(|s| format!("{s:.2}")).collect();
            let time = median(&fig.seconds);
            println!(
                "| {name} | {time:.2} | {} | {:.2}x | {:.2}x |",
                runs.join(" / "),
                time / baseline,
                fig.rss_rise as f64 / budget.0 as f64
            );
        }
        if let (Some(unsliced), false) = (unsliced_time, figures[3].seconds.is_empty()) {
            let sliced = median(&figures[3].seconds);
            println!(
                "skew={label} flumen_s={sliced:.2} no_slices_s={unsliced:.2} \
                 speedup_from_slices_or_spread={:.2} vs_vanilla_no_limit={:.2}",
                unsliced / sliced,
                sliced / baseline
            );
        }
    }
    verdict::finish();
    Ok(())
}
