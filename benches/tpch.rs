//! TPC-H through vanilla DataFusion and through flumen, in the same run.
//!
//! `cargo bench --bench tpch [-- --sf 1 --runs 2 --mode streaming --queries 5,18 --analyze --only flumen --split-bytes 16MB --aggregate-split-bytes 64MB --budget 1GB --workers 1 --set flumen.NAME=VALUE]`
//!
//! Generates the TPC-H tables as Parquet with tpchgen (no downloads) under
//! `target/tpch-sf<SF>/`, then runs the 22 queries (their text is read from the TPC-H files
//! shipped with `datafusion-sqllogictest`) on both engines, best of `--runs`, and prints each
//! query's time and the ratio flumen/vanilla. Every run of every query compares flumen's
//! whole answer with vanilla DataFusion's (rows sorted, floats to a relative 1e-9, everything
//! else exactly) and stops at the first difference. The last line is machine-readable.
//!
//! `--budget B` runs both engines under a memory limit, as a user would set one: flumen's
//! `memory_budget`, vanilla DataFusion's `RuntimeEnv` memory limit (its spilling operators
//! spill, the others fail). Each query then also shows how far each engine's run raised the
//! process's RSS (high-water mark, reset before each run, less the RSS the run started with,
//! once the allocator has handed back the pages earlier runs freed), and a query an engine
//! fails is reported, not fatal. Both engines allocate through the `flumen` binary's
//! jemalloc, installed as flumen's heap count, as the binary runs.

#[path = "common/args.rs"]
mod args;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;
use datafusion::physical_plan::collect;
use datafusion::prelude::{SessionConfig, SessionContext};
use flumen::exec::FlumenExec;

#[path = "common/answers.rs"]
mod answers;
#[path = "common/rss.rs"]
mod rss;
#[path = "common/tpch_tables.rs"]
mod tpch_tables;
#[path = "common/verdict.rs"]
mod verdict;
use answers::assert_same_answer;
use rss::RssWatch;
use tpch_tables::{generate, query_statements, register, slt_dir};

/// Both engines allocate through the `flumen` binary's allocator (jemalloc), installed as
/// flumen's heap count, so flumen runs as the binary runs it: its budget covers the heap
/// nobody reserved. (Until 2026-11-27 both used mimalloc with no heap count: flumen then
/// counted only blocks and reservations, and a run could reuse pages an earlier one left,
/// so its RSS rise understated a fresh process's: q18 rose 1.8 GiB alone, 0.5 GiB in the
/// full sequence.)
#[path = "../src/bin/flumen/allocator.rs"]
mod allocator;
use flumen::HeapAllocator;

/// CPU seconds this process has used (user + system), for `--cpu`.
fn cpu_seconds() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Run a query's statements; returns (seconds, the last result, peak block-store bytes when
/// it ran on flumen).
async fn run(ctx: &SessionContext, statements: &[String]) -> Result<(f64, Vec<RecordBatch>, u64)> {
    let started = Instant::now();
    let cpu_started = cpu_seconds();
    let mut last = vec![];
    let mut peak = 0;
    for sql in statements {
        let df = ctx.sql(sql).await?;
        let plan = df.create_physical_plan().await?;
        last = collect(Arc::clone(&plan), ctx.task_ctx()).await?;
        if let Some(f) = plan.downcast_ref::<FlumenExec>() {
            peak = peak.max(f.run_metrics().peak_store_bytes());
        }
    }
    let wall = started.elapsed().as_secs_f64();
    if std::env::var_os("TPCH_CPU").is_some() {
        eprintln!(
            "  wall {wall:.3} s, cpu {:.3} s",
            cpu_seconds() - cpu_started
        );
    }
    Ok((wall, last, peak))
}

/// An RSS watch started once the allocator has handed back the pages earlier runs freed:
/// a run then cannot hide its peak in pages an earlier one left resident.
fn watch_from_live_heap() -> RssWatch {
    allocator::Jemalloc.return_freed();
    RssWatch::start()
}

/// One engine's runs of one query: best time, peak RSS rise, or the error that stopped it.
#[derive(Default)]
struct Outcome {
    best: Option<f64>,
    peak_rss: u64,
    error: Option<String>,
}

impl Outcome {
    /// Record a run (`rss` started with it); its answer when it completed.
    fn record(
        &mut self,
        result: Result<(f64, Vec<RecordBatch>, u64)>,
        rss: &RssWatch,
        peak_store: &mut u64,
    ) -> Option<Vec<RecordBatch>> {
        self.peak_rss = self.peak_rss.max(rss.rise());
        match result {
            Ok((seconds, answer, peak)) => {
                self.best = Some(self.best.map_or(seconds, |b| b.min(seconds)));
                *peak_store = (*peak_store).max(peak);
                Some(answer)
            }
            Err(e) => {
                self.error = Some(e.to_string());
                None
            }
        }
    }

    fn cell(&self) -> String {
        match (self.best, &self.error) {
            (_, Some(_)) => "failed".into(),
            (Some(s), None) => format!("{s:.3}"),
            (None, None) => "-".into(),
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    allocator::install();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args::flag_value(&args, name);
    let sf: f64 = arg("--sf").map(|s| s.parse().unwrap()).unwrap_or(1.0);
    let runs: usize = arg("--runs").map(|s| s.parse().unwrap()).unwrap_or(2);
    let mode = arg("--mode").unwrap_or_else(|| "streaming".into());
    let analyze = args.iter().any(|a| a == "--analyze");
    let only = arg("--only");
    // `--queries 5,18`: only these (for profiling one query; the summary line counts them).
    let queries: Vec<usize> = arg("--queries")
        .map(|s| s.split(',').map(|q| q.trim().parse().unwrap()).collect())
        .unwrap_or_else(|| (1..=22).collect());
    let dir = PathBuf::from(format!("target/tpch-sf{sf}"));
    generate(&dir, sf)?;
    let slt = slt_dir();

    let cores = flumen::config::available_cores();
    let config = || SessionConfig::new().with_target_partitions(cores);
    let budget_arg: Option<flumen::ByteSize> = arg("--budget").map(|b| b.parse()).transpose()?;
    let vanilla = match budget_arg {
        Some(limit) => SessionContext::new_with_config_rt(
            config(),
            datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
                .with_memory_limit(limit.0 as usize, 1.0)
                .build_arc()?,
        ),
        None => SessionContext::new_with_config(config()),
    };
    // Checks flumen's answer where vanilla fails under `--budget`.
    let unlimited = SessionContext::new_with_config(config());
    let mut flumen_config = flumen::FlumenConfig::default();
    flumen_config.mode = mode.parse()?;
    if let Some(bytes) = arg("--split-bytes") {
        flumen_config.split_bytes = bytes.parse()?;
    }
    if let Some(bytes) = arg("--aggregate-split-bytes") {
        flumen_config.aggregate_split_bytes = bytes.parse()?;
    }
    if let Some(limit) = budget_arg {
        flumen_config.memory_budget = limit;
    }
    // `--workers N`: flumen's tasks run in N local worker processes (`flumen.workers =
    // 'process'`; `FLUMEN_WORKER_BIN` runs another build as the workers). The RSS columns
    // then count this process only, not the workers that hold the blocks.
    let workers: Option<usize> = arg("--workers").map(|n| n.parse().unwrap());
    if let Some(n) = workers {
        flumen_config.workers = flumen::WorkerMode::Process;
        flumen_config.worker_processes = n.max(1);
        flumen_config.worker_binary = std::env::var("FLUMEN_WORKER_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_flumen").into())
            .into();
    }
    // `--set flumen.NAME=VALUE`: any other flumen setting, as `SET` would make it.
    if let Some(setting) = arg("--set") {
        let (name, value) = setting.split_once('=').expect("--set flumen.NAME=VALUE");
        let name = name.strip_prefix("flumen.").unwrap_or(name);
        datafusion::config::ExtensionOptions::set(&mut flumen_config, name, value)?;
    }
    let mut tasks_in = match workers {
        Some(n) => format!("{n} worker process(es)"),
        None => "threads".into(),
    };
    if let Some(setting) = arg("--set") {
        tasks_in = format!("{tasks_in}, {setting}");
    }
    let budget = flumen_config.memory_budget;
    let flumen = flumen::session_with_config(config(), flumen_config);
    register(&vanilla, &dir).await?;
    register(&unlimited, &dir).await?;
    register(&flumen, &dir).await?;

    println!(
        "TPC-H sf={sf}, {cores} cores, best of {runs}, flumen mode={mode}, budget={budget}, tasks in {tasks_in}"
    );
    println!(
        "{:>4} {:>10} {:>10} {:>7} {:>12} {:>12} {:>12}",
        "q", "vanilla_s", "flumen_s", "ratio", "vanilla_rss+", "flumen_rss+", "peak_store"
    );
    let mut ratios = vec![];
    let mut flumen_failed = vec![];
    let mut vanilla_failed = vec![];
    let mut flumen_peak_rss = 0;
    for n in queries {
        let statements = query_statements(&slt, n);
        let mut v = Outcome::default();
        let mut f = Outcome::default();
        let mut peak = 0;
        let mut unused = 0;
        // `--only vanilla|flumen` (for a profiler): the other engine does not run.
        let run_vanilla = only.as_deref() != Some("flumen");
        let run_flumen = only.as_deref() != Some("vanilla");
        for i in 0..runs {
            // The engines take turns going first (ABBA), so neither always runs right
            // after the other (caches, allocator state) and any order effect cancels out.
            let flumen_first = i % 2 == 1;
            let mut answer_f = None;
            if run_flumen && flumen_first && f.error.is_none() {
                let rss = watch_from_live_heap();
                answer_f = f.record(run(&flumen, &statements).await, &rss, &mut peak);
            }
            let answer_v = if run_vanilla && v.error.is_none() {
                let rss = watch_from_live_heap();
                v.record(run(&vanilla, &statements).await, &rss, &mut unused)
            } else {
                None
            };
            if run_flumen && !flumen_first && f.error.is_none() {
                let rss = watch_from_live_heap();
                answer_f = f.record(run(&flumen, &statements).await, &rss, &mut peak);
            }
            if let (Some(answer_v), Some(answer_f)) = (&answer_v, &answer_f) {
                assert_same_answer(n, answer_v, answer_f)?;
            } else if let (None, Some(answer_f), true) = (&answer_v, &answer_f, run_vanilla) {
                // Vanilla failed under the limit: flumen's answer is checked against vanilla
                // with no limit (untimed).
                let (_, answer_v, _) = run(&unlimited, &statements).await?;
                assert_same_answer(n, &answer_v, answer_f)?;
                println!("     q{n}: flumen's answer equals vanilla's with no memory limit");
            }
        }
        if analyze {
            // `--analyze`: both engines' EXPLAIN ANALYZE of the query's last statement.
            let last = statements.last().expect("a query has a statement");
            for (engine, ctx) in [("vanilla", &vanilla), ("flumen", &flumen)] {
                let explained = ctx
                    .sql(&format!("EXPLAIN ANALYZE {last}"))
                    .await?
                    .collect()
                    .await?;
                let text = datafusion::arrow::util::pretty::pretty_format_batches(&explained)?;
                println!("--- q{n} {engine}\n{text}");
            }
        }
        let ratio = match (f.best, v.best) {
            (Some(tf), Some(tv)) if f.error.is_none() && v.error.is_none() => {
                ratios.push(tf / tv);
                format!("{:.2}", tf / tv)
            }
            _ => "-".into(),
        };
        let rss_cell = |o: &Outcome, ran: bool| {
            if ran {
                flumen::ByteSize(o.peak_rss).to_string()
            } else {
                "-".into()
            }
        };
        println!(
            "{n:>4} {:>10} {:>10} {:>7} {:>12} {:>12} {:>12}",
            v.cell(),
            f.cell(),
            ratio,
            rss_cell(&v, run_vanilla),
            rss_cell(&f, run_flumen),
            flumen::ByteSize(peak).to_string()
        );
        if let Some(e) = &v.error {
            println!(
                "     vanilla q{n}: {}",
                e.chars().take(160).collect::<String>()
            );
            vanilla_failed.push(n);
            // Under a memory limit vanilla may fail (flumen's answer is then checked against
            // vanilla with none); with no limit its failure leaves nothing to compare.
            if budget_arg.is_none() {
                verdict::fail(format!("vanilla DataFusion failed q{n}"));
            }
        }
        if let Some(e) = &f.error {
            println!(
                "     flumen q{n}: {}",
                e.chars().take(160).collect::<String>()
            );
            flumen_failed.push(n);
            verdict::fail(format!("flumen failed q{n}"));
        }
        if !run_vanilla || !run_flumen {
            verdict::not_measured(&format!("q{n}'s answer"), "--only ran one engine");
        }
        if run_flumen {
            flumen_peak_rss = flumen_peak_rss.max(f.peak_rss);
        }
        assert!(peak <= budget.0, "q{n}: block store peak over the budget");
    }
    println!(
        "failed: flumen {flumen_failed:?}, vanilla {vanilla_failed:?}; flumen peak RSS rise {} = {:.2}x the budget",
        flumen::ByteSize(flumen_peak_rss),
        flumen_peak_rss as f64 / budget.0 as f64
    );
    let max = ratios.iter().cloned().fold(0.0, f64::max);
    let geomean = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
    println!(
        "tpch queries={} max_ratio={max:.2} geomean_ratio={geomean:.2}",
        ratios.len()
    );
    // The goals docs/benchmarks.md tracks: flumen's RSS rise within 1.25x its budget, and
    // every query vanilla completes within 1.2x of vanilla's time.
    let rss_ratio = flumen_peak_rss as f64 / budget.0 as f64;
    let rss_goal = if workers.is_some() {
        verdict::not_measured(
            "flumen's RSS rise",
            "--workers: the workers hold the blocks",
        );
        "not measured"
    } else {
        verdict::goal("flumen RSS rise ≤ 1.25x the budget", rss_ratio <= 1.25)
    };
    let slow = ratios.iter().filter(|r| **r > 1.2).count();
    let time_goal = verdict::goal(
        "every query within 1.2x of vanilla",
        slow == 0 && !ratios.is_empty(),
    );
    println!(
        "goals: RSS rise {rss_ratio:.2}x ≤ 1.25x: {rss_goal}; {} of {} within 1.2x: {time_goal}",
        ratios.len() - slow,
        ratios.len()
    );
    verdict::finish();
    Ok(())
}
