//! The embedded-heap bench's runs, whatever the program's allocator: TPC-H queries under a
//! memory budget with that heap counted against the budget (a `flumen::CountingAllocator`
//! installed) and not (`flumen.budget_counts_heap = false`: what such a program got before
//! the counting wrapper), in one process, taking turns. `benches/embedded_heap.rs` (the
//! system's allocator) and `benches/embedded_heap_mimalloc.rs` each install their own.
//!
//! `[-- --sf 10 --runs 2 --budget 1GB --queries 7,9,18,21]`
//!
//! Each run starts once the allocator has handed back the pages earlier runs freed, and
//! reports how far it raised the process's RSS (high-water mark, reset before the run,
//! less the RSS at its start). Both settings must give the same rows. The last line is
//! machine-readable.

#[path = "args.rs"]
mod args;
#[path = "rss.rs"]
mod rss;
#[path = "tpch_tables.rs"]
mod tpch_tables;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use datafusion::error::Result;
use datafusion::physical_plan::collect;
use datafusion::prelude::{SessionConfig, SessionContext};
use flumen::HeapAllocator;
use flumen::exec::FlumenExec;
use rss::RssWatch;
use tpch_tables::{generate, query_statements, register, slt_dir};

/// One run: wall seconds, RSS rise, rows of the last statement, most unreserved heap seen.
struct Run {
    seconds: f64,
    rss_rise: u64,
    rows: usize,
    unreserved: u64,
}

async fn run(
    allocator: &dyn HeapAllocator,
    ctx: &SessionContext,
    statements: &[String],
) -> Result<Run> {
    allocator.return_freed();
    let rss = RssWatch::start();
    let started = Instant::now();
    let (mut rows, mut unreserved) = (0, 0);
    for sql in statements {
        let plan = ctx.sql(sql).await?.create_physical_plan().await?;
        let batches = collect(Arc::clone(&plan), ctx.task_ctx()).await?;
        rows = batches.iter().map(|b| b.num_rows()).sum();
        if let Some(exec) = plan.downcast_ref::<FlumenExec>() {
            let memory = &exec.run_metrics().memory;
            unreserved = unreserved.max(
                memory
                    .peak_unreserved_bytes
                    .load(std::sync::atomic::Ordering::Relaxed),
            );
        }
    }
    Ok(Run {
        seconds: started.elapsed().as_secs_f64(),
        rss_rise: rss.rise(),
        rows,
        unreserved,
    })
}

fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// The bench, with `allocator` (the program's global allocator, counted) installed;
/// `allocator_name` says which it is.
pub async fn main_with(allocator: &'static dyn HeapAllocator, allocator_name: &str) -> Result<()> {
    flumen::install_heap_allocator(allocator);
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args::flag_value(&args, name);
    let sf: f64 = arg("--sf").map(|s| s.parse().unwrap()).unwrap_or(10.0);
    let runs: usize = arg("--runs").map(|s| s.parse().unwrap()).unwrap_or(2);
    let budget: flumen::ByteSize = arg("--budget").unwrap_or_else(|| "1GB".into()).parse()?;
    let queries: Vec<usize> = arg("--queries")
        .map(|s| s.split(',').map(|q| q.trim().parse().unwrap()).collect())
        .unwrap_or_else(|| vec![7, 9, 18, 21]);
    let dir = PathBuf::from(format!("target/tpch-sf{sf}"));
    generate(&dir, sf)?;
    let slt = slt_dir();

    let cores = flumen::config::available_cores();
    let session = |counts_heap: bool| {
        let mut config = flumen::FlumenConfig::default();
        config.memory_budget = budget;
        config.budget_counts_heap = counts_heap;
        flumen::session_with_config(SessionConfig::new().with_target_partitions(cores), config)
    };
    let (counted, uncounted) = (session(true), session(false));
    register(&counted, &dir).await?;
    register(&uncounted, &dir).await?;

    println!(
        "TPC-H sf={sf}, {cores} cores, budget={budget}, best of {runs}; allocator: \
         {allocator_name}, counted by flumen::CountingAllocator"
    );
    println!(
        "{:>4} {:>13} {:>11} {:>15} {:>13} {:>17}",
        "q", "uncounted_s", "counted_s", "uncounted_rss+", "counted_rss+", "counted_unreserved"
    );
    let (mut max_uncounted, mut max_counted) = (0u64, 0u64);
    for n in queries {
        let statements = query_statements(&slt, n);
        let mut best = [f64::MAX; 2];
        let mut rise = [0u64; 2];
        let mut rows = [None; 2];
        let mut unreserved = 0;
        for i in 0..runs {
            // Taking turns going first (ABBA), so that neither always inherits the other's
            // allocator state.
            let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
            for which in order {
                let ctx = [&uncounted, &counted][which];
                let r = run(allocator, ctx, &statements).await?;
                best[which] = best[which].min(r.seconds);
                rise[which] = rise[which].max(r.rss_rise);
                if which == 1 {
                    unreserved = unreserved.max(r.unreserved);
                }
                if *rows[which].get_or_insert(r.rows) != r.rows {
                    panic!("q{n}: {} rows, then {}", rows[which].unwrap(), r.rows);
                }
            }
        }
        assert_eq!(rows[0], rows[1], "q{n}: both settings give the same rows");
        max_uncounted = max_uncounted.max(rise[0]);
        max_counted = max_counted.max(rise[1]);
        println!(
            "{:>4} {:>13.3} {:>11.3} {:>15} {:>13} {:>17}",
            n,
            best[0],
            best[1],
            mib(rise[0]),
            mib(rise[1]),
            mib(unreserved)
        );
    }
    println!(
        "SUMMARY allocator={} budget={} max_rss_rise_uncounted={max_uncounted} max_rss_rise_counted={max_counted} \
         uncounted_over_budget={:.2} counted_over_budget={:.2}",
        allocator_name.split_whitespace().next().unwrap_or("?"),
        budget.0,
        max_uncounted as f64 / budget.0 as f64,
        max_counted as f64 / budget.0 as f64
    );
    Ok(())
}
