//! What the scheduler costs per block: one query cut into ever more blocks, flumen's time per
//! block above vanilla DataFusion's time for the same query, measured in the same run.
//!
//! `cargo bench --bench scheduler [-- --rows 200000 --block-rows 200,50,20 --runs 3
//! --workers 2 --check]`
//!
//! The query hashes `--rows` generated numbers and counts the few hashes that start with
//! `000`: a source of one partition that DataFusion deals round-robin over the partitions,
//! then a filter and an aggregate, so flumen's source blocks are read by every partition's
//! tasks out of one log of blocks. Each `--block-rows` sets `flumen.target_block_rows`, so
//! the same rows come in `rows / block-rows` blocks. Figures: the median of `--runs` runs
//! per size, the blocks the source made, and the scheduler's cost per block: (flumen − vanilla)
//! / blocks. Goal: that cost at the most blocks (10,000 by default) is at most twice the cost
//! at the fewest (1,000): a scheduler whose work per block grows with the blocks before it
//! is quadratic. Before the dispatch of block-wise tasks read each block once, the ratio was
//! 2.7 (debug build: 203 µs per block at 1,000 blocks, 555 at 10,000; 100,000 rows in 5-row
//! blocks took 26 s where 30-row blocks took 2 s); after, 1.2. Every answer is checked against vanilla's. `--check` exits non-zero on a miss.
//! In a release build a block cost ~55 µs until tasks stopped copying the session's
//! function maps into their contexts (2026-12-07), ~10–25 µs after.
//!
//! `--workers N` measures the same sizes again with the tasks in `N` local worker processes
//! (`FLUMEN_WORKER_BIN=PATH` runs another build as the workers), and prints worker mode's cost
//! per block beside threads mode's, with their ratio at each size: what a block costs when it
//! is made in one process, kept there, and read by a task in another. The same goal holds
//! for worker mode's costs. (A debug build checks every worker task's plan round trip, a
//! release build each operator's first: use a release build for worker mode's figures.)

#[path = "common/args.rs"]
mod args;
#[path = "common/verdict.rs"]
mod verdict;

use std::time::Instant;

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::Result;
use datafusion::prelude::SessionContext;
use flumen::FlumenConfig;
use flumen::exec::FlumenExec;

/// The query: `{rows}` is replaced by `--rows`.
const SQL: &str = "SELECT count(*) AS hits, min(h) AS first FROM \
     (SELECT md5(CAST(i AS VARCHAR)) AS h FROM generate_series(1, {rows}) t(i)) \
     WHERE h LIKE '000%'";

/// One run: seconds, the answer as text, and the source's output blocks (flumen).
async fn run(ctx: &SessionContext, sql: &str) -> Result<(f64, String, u64)> {
    let started = Instant::now();
    let plan = ctx.sql(sql).await?.create_physical_plan().await?;
    let batches = datafusion::physical_plan::collect(plan.clone(), ctx.task_ctx()).await?;
    let seconds = started.elapsed().as_secs_f64();
    // The source's blocks: the operator that made the most.
    let blocks = plan.downcast_ref::<FlumenExec>().map_or(0, |exec| {
        let metrics = exec.run_metrics();
        (exec.graph().operators.iter())
            .map(|op| metrics.operator(op.id).snapshot().blocks)
            .max()
            .unwrap_or(0)
    });
    Ok((
        seconds,
        pretty_format_batches(&batches)?.to_string(),
        blocks,
    ))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let rows: u64 = args::flag_value(&args, "--rows").map_or(200_000, |v| v.parse().unwrap());
    let runs: usize = args::flag_value(&args, "--runs").map_or(3, |v| v.parse().unwrap());
    let sizes: Vec<usize> = args::flag_value(&args, "--block-rows")
        .unwrap_or_else(|| "200,50,20".into())
        .split(',')
        .map(|v| v.parse().unwrap())
        .collect();
    let sql = SQL.replace("{rows}", &rows.to_string());
    println!("scheduler cost per block: {rows} rows, median of {runs} runs");

    let vanilla = SessionContext::new();
    let mut vanilla_times = vec![];
    let mut reference = String::new();
    for _ in 0..runs {
        let (seconds, answer, _) = run(&vanilla, &sql).await?;
        vanilla_times.push(seconds);
        reference = answer;
    }
    let vanilla_seconds = median(vanilla_times);
    println!("vanilla DataFusion: {vanilla_seconds:.3} s");

    let workers: usize = args::flag_value(&args, "--workers").map_or(0, |v| v.parse().unwrap());
    let mut modes = vec![("threads", FlumenConfig::default())];
    if workers > 0 {
        let mut config = FlumenConfig::default();
        config.workers = flumen::WorkerMode::Process;
        config.worker_processes = workers;
        // `FLUMEN_WORKER_BIN` runs another build (or a wrapper) as the workers.
        config.worker_binary = std::env::var("FLUMEN_WORKER_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_flumen").into())
            .into();
        modes.push(("workers", config));
    }
    // Per mode: (blocks, µs per block above vanilla) per size, in the order of `sizes`.
    let mut costs: Vec<Vec<(u64, f64)>> = vec![];
    for (mode, base) in &modes {
        let mut mode_costs = vec![];
        for &block_rows in &sizes {
            let mut config = base.clone();
            config.target_block_rows = block_rows;
            let ctx = flumen::session(config);
            let (mut times, mut blocks) = (vec![], 0);
            for _ in 0..runs {
                let (seconds, answer, made) = run(&ctx, &sql).await?;
                if answer != reference {
                    verdict::fail(format!(
                        "{mode}, {block_rows}-row blocks: flumen answered\n{answer}\n\
                         vanilla\n{reference}"
                    ));
                }
                times.push(seconds);
                blocks = made;
            }
            let seconds = median(times);
            let per_block_us = (seconds - vanilla_seconds).max(0.0) * 1e6 / blocks.max(1) as f64;
            println!(
                "flumen {mode:<7}, {block_rows:>6}-row blocks: {seconds:>7.3} s, {blocks:>7} \
                 source blocks, {per_block_us:>7.1} µs per block above vanilla ({:.1}× vanilla)",
                seconds / vanilla_seconds
            );
            mode_costs.push((blocks, per_block_us));
        }
        let mut sorted = mode_costs.clone();
        sorted.sort_by_key(|(blocks, _)| *blocks);
        if let (Some((few, few_cost)), Some((many, many_cost))) = (sorted.first(), sorted.last()) {
            let ratio = many_cost / few_cost.max(1.0);
            let met = verdict::goal("cost per block stays flat", ratio <= 2.0);
            println!(
                "{mode}: cost per block at {many} blocks / at {few} blocks: {ratio:.2} \
                 (goal ≤ 2: {met})"
            );
        }
        costs.push(mode_costs);
    }
    if let [threads, workers] = costs.as_slice() {
        for (block_rows, ((blocks, t), (_, w))) in sizes.iter().zip(threads.iter().zip(workers)) {
            println!(
                "{block_rows:>6}-row blocks ({blocks} blocks): workers {w:.1} µs per block, \
                 threads {t:.1}: {:.2}× threads",
                w / t.max(1.0)
            );
        }
    }
    verdict::finish();
    Ok(())
}
