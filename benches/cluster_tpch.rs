//! SQL at scale on a cluster: TPC-H on 1, 2 and 3 hosts, each host (the driver's too) a
//! Linux network namespace capped at the same CPU share by a cgroup v1 CPU quota, so N hosts
//! have N times one host's CPU on this shared machine and scaling is measurable (needs root
//! and cgroup v1; says `not measured` elsewhere).
//!
//! ```text
//! cargo bench --bench cluster_tpch -- [--sf 1] [--hosts 1,2,3] [--cores 0.5] [--slots 2]
//!     [--partitions 6] [--queries 3,5] [--runs 1] [--no-peer] [--kill-query 9]
//!     [--tasks-query] [--check] [--no-build-key-bounds] [--no-build-key-sets]
//!     [--feed-joins true|all|false]
//!     [--exchange-compression none|lz4|zstd] [--rate 200mbit]
//! ```
//!
//! Data: the TPC-H tables as one Parquet file each under `target/tpch-sf<SF>/` (shared by
//! the tpch bench), read by every host through the same path. Each host runs one CPU
//! worker (`--slots` slots); the driver runs in this process, in a namespace and a CPU
//! group of its own. Every query's answer is checked against vanilla DataFusion's (run
//! here first, unconstrained); a difference or a failure ends the bench non-zero.
//!
//! Printed per query and host count: seconds (best of `--runs`), and on the most hosts the
//! driver's CPU seconds against the workers', the bytes the driver fetched against the
//! result's, and the tasks of non-final operators that ran on the driver, with reasons.
//! Goals: geomean speedup on N hosts ≥ 0.8·N; driver CPU ≤ 10% of the workers'; bytes the
//! driver fetched ≤ 1.1 × the result's; no task of a non-final operator on the driver.
//! Per host count: the workers' CPU over the queries and the share of their quota it used.
//! `--exchange-compression` runs flumen's queries again on each cluster with
//! `flumen.exchange_compression` at that value (`none`: blocks as they are): time ratio,
//! bytes every host sent out of its link, workers' CPU, against the runs at the default
//! (`lz4`). `--rate` caps every host's link
//! (`tc tbf`).
//!
//! The peer: datafusion-distributed 4 (`common/peer_distributed.rs`), one worker per host in
//! the same namespaces and CPU groups (this bench's own binary, `--peer-worker ADDR`), its
//! coordinator in the driver's, a static worker list; each query's time against flumen's
//! (goal: flumen's geomean at least equal on the most hosts). Then `--kill-query` on the
//! most hosts, on each engine, with every process of the last host SIGKILLed at 40% of its
//! clean time: flumen must complete with the same answer; the peer's outcome is reported.
//! `--tasks-query` measures the driver's scheduling cost instead: a scan of TPC-H SF 0.1
//! `lineitem` written as 200 files in row groups of 50 rows, one task per row group (about
//! 12,000), in µs of the driver's CPU per task, on the most hosts.

#[path = "common/answers.rs"]
mod answers;
#[path = "common/args.rs"]
mod args;
#[path = "../tests/common/hosts.rs"]
mod hosts;
#[path = "common/peer_distributed.rs"]
mod peer_distributed;
#[path = "common/tpch_tables.rs"]
mod tpch_tables;
#[path = "common/verdict.rs"]
mod verdict;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::physical_plan::collect;
use datafusion::prelude::{SessionConfig, SessionContext};
use flumen::exec::FlumenExec;
use flumen::{FlumenConfig, WorkerMode};
use hosts::{Role, TestNet, driver_runtime};

const FLUMEN: &str = env!("CARGO_BIN_EXE_flumen");

/// Command-line settings.
#[derive(Debug, Clone)]
struct Args {
    sf: f64,
    hosts: Vec<usize>,
    cores: f64,
    slots: usize,
    partitions: usize,
    queries: Vec<usize>,
    runs: usize,
    tasks_query: bool,
    /// Run the peer (datafusion-distributed) on the same hosts too.
    peer: bool,
    /// The query run again on the most hosts with one host killed mid-query.
    kill_query: usize,
    /// `--exchange-compression none|lz4|zstd`: flumen's queries run again on each cluster
    /// with `flumen.exchange_compression` at this value, against the runs at the default.
    compression: Option<String>,
    /// `--rate R` (a `tc` rate: `1gbit`, `500mbit`): every host's link, the driver's too,
    /// sends at most this much.
    rate: Option<String>,
}

fn parse_args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let value = |name: &str| args::flag_value(&argv, name);
    let list = |text: String| -> Vec<usize> {
        text.split(',')
            .map(|n| n.trim().parse().expect("a list of numbers"))
            .collect()
    };
    Args {
        sf: value("--sf").map_or(1.0, |v| v.parse().expect("--sf X")),
        hosts: value("--hosts").map_or(vec![1, 2, 3], list),
        cores: value("--cores").map_or(0.5, |v| v.parse().expect("--cores X")),
        slots: value("--slots").map_or(2, |v| v.parse().expect("--slots N")),
        partitions: value("--partitions").map_or(6, |v| v.parse().expect("--partitions N")),
        queries: value("--queries").map_or((1..=22).collect(), list),
        runs: value("--runs").map_or(1, |v| v.parse().expect("--runs N")),
        tasks_query: argv.iter().any(|a| a == "--tasks-query"),
        peer: !argv.iter().any(|a| a == "--no-peer"),
        kill_query: value("--kill-query").map_or(9, |v| v.parse().expect("--kill-query N")),
        compression: value("--exchange-compression"),
        rate: value("--rate"),
    }
}

/// What one query's run measured.
#[derive(Debug, Default, Clone)]
struct QueryRun {
    seconds: f64,
    driver_cpu: f64,
    workers_cpu: f64,
    /// Bytes of blocks the driver fetched from workers (the bytes their rows reach,
    /// `flumen::store::rows_bytes`).
    fetched_by_driver: u64,
    /// Bytes of the answer, measured alike.
    result_bytes: u64,
    /// Bytes every host (the driver too) sent out of its link during the query.
    wire_bytes: u64,
    /// Tasks of every operator, and of those in worker processes.
    tasks: u64,
    remote_tasks: u64,
    /// Tasks of operators other than the final one that ran on the driver, by reason.
    on_driver: BTreeMap<String, u64>,
    answer: Vec<RecordBatch>,
}

/// Hosts `h1..hN` with one CPU worker each (`slots` slots), every host and the driver at
/// `cores` CPUs; returns the network and its cluster file.
fn cluster(hosts: usize, args: &Args) -> Result<(TestNet, PathBuf), String> {
    let mut net = TestNet::new(hosts)?;
    net.limit_cpu(args.cores)?;
    if let Some(rate) = &args.rate {
        for host in &net.hosts {
            net.limit_bandwidth(&host.name, rate);
        }
    }
    let mut addresses = vec![];
    for i in 1..=hosts {
        let host = format!("h{i}");
        net.start_worker(&host, Role::Cpu, FLUMEN.as_ref(), args.slots);
        addresses.push(net.address(&host, Role::Cpu));
    }
    let file = net.write_cluster_file(&addresses);
    Ok((net, file))
}

/// CPU seconds of the driver and of all worker hosts so far.
fn cpu_now(net: &TestNet) -> (f64, f64) {
    let driver = net.cpu_seconds("driver").unwrap_or(0.0);
    let workers = (net.hosts.iter())
        .filter(|h| h.name != "driver")
        .map(|h| net.cpu_seconds(&h.name).unwrap_or(0.0))
        .sum();
    (driver, workers)
}

/// Bytes every host of `net` (the driver too) has sent out of its link so far.
fn sent_now(net: &TestNet) -> u64 {
    net.hosts.iter().map(|h| net.tx_bytes(&h.name)).sum()
}

/// A flumen session in worker mode on the cluster in `cluster_file`.
fn cluster_session(cluster_file: &Path, partitions: usize) -> SessionContext {
    let mut config = FlumenConfig::default();
    config.workers = WorkerMode::Process;
    config.cluster = cluster_file.display().to_string();
    // `--no-build-key-bounds`: joins' probe scans start from no bound of their build keys
    // (`flumen.build_key_bounds = false`), the baseline of those bounds.
    config.build_key_bounds = !std::env::args().any(|a| a == "--no-build-key-bounds");
    // `--no-build-key-sets`: no set of a build side's keys, rows dropped by a list only and
    // under grouped aggregates only (`flumen.build_key_sets = false`), the sets' baseline.
    config.build_key_sets = !std::env::args().any(|a| a == "--no-build-key-sets");
    // `--feed-joins all`: every join a worker runs is fed its probe side as it is made
    // (`flumen.feed_joins_on_workers`); `false`: every one a barrier.
    let args: Vec<String> = std::env::args().collect();
    if let Some(value) =
        (args.iter().position(|a| a == "--feed-joins")).and_then(|i| args.get(i + 1))
    {
        config.feed_joins_on_workers = value.parse().expect("--feed-joins true|all|false");
    }
    let session = SessionConfig::new().with_target_partitions(partitions);
    flumen::session_with_config(
        flumen::flumen_session_config(session, config.clone()),
        config,
    )
}

/// Run `statements` on `ctx` and measure the last one's plan (see [`QueryRun`]).
async fn run_query(
    ctx: &SessionContext,
    net: &TestNet,
    statements: &[String],
) -> datafusion::error::Result<QueryRun> {
    let (driver_before, workers_before) = cpu_now(net);
    let sent_before = sent_now(net);
    let started = Instant::now();
    let mut out = QueryRun::default();
    for sql in statements {
        let plan = ctx.sql(sql).await?.create_physical_plan().await?;
        out.answer = collect(Arc::clone(&plan), ctx.task_ctx()).await?;
        let Some(exec) = plan.downcast_ref::<FlumenExec>() else {
            continue;
        };
        let root = exec.graph().root().id;
        for op in &exec.graph().operators {
            let stats = exec.run_metrics().operator(op.id);
            let s = stats.snapshot();
            out.fetched_by_driver += s.output_bytes_to_driver;
            out.tasks += s.tasks;
            out.remote_tasks += s.remote_tasks;
            if op.id != root {
                for (reason, n) in stats.on_driver() {
                    *out.on_driver.entry(reason.to_string()).or_default() += n;
                }
            }
        }
    }
    out.seconds = started.elapsed().as_secs_f64();
    let (driver_after, workers_after) = cpu_now(net);
    out.driver_cpu = driver_after - driver_before;
    out.workers_cpu = workers_after - workers_before;
    out.wire_bytes = sent_now(net) - sent_before;
    out.result_bytes = out.answer.iter().map(flumen::store::rows_bytes).sum();
    Ok(out)
}

/// Each query's best run (by seconds), or why it failed.
type Runs = BTreeMap<usize, Result<QueryRun, String>>;

/// What one host count measured: flumen's runs and the peer's (empty with `--no-peer`).
#[derive(Default)]
struct HostRuns {
    flumen: Runs,
    peer: Runs,
    /// flumen's runs with `--exchange-compression` (empty without it).
    compressed: Runs,
}

/// Port of each host's peer worker.
const PEER_PORT: u16 = 7300;

/// Start the peer's worker on every host of `net`; returns their addresses.
fn start_peer(net: &mut TestNet, hosts: usize) -> Vec<String> {
    let program = std::env::current_exe().unwrap();
    (1..=hosts)
        .map(|i| {
            let host = format!("h{i}");
            let address = format!("{}:{PEER_PORT}", net.host(&host).ip);
            let args = ["--peer-worker", address.as_str()];
            net.start_program(&host, &program, &args, "peer worker listening");
            address
        })
        .collect()
}

/// Run every query of `args` on `ctx`, best of `args.runs` each.
async fn run_queries(ctx: &SessionContext, net: &TestNet, args: &Args) -> Runs {
    let slt = tpch_tables::slt_dir();
    let mut runs = Runs::new();
    for &q in &args.queries {
        let statements = tpch_tables::query_statements(&slt, q);
        let mut best: Option<Result<QueryRun, String>> = None;
        for _ in 0..args.runs {
            let run = run_query(ctx, net, &statements).await;
            let run = run.map_err(|e| e.to_string());
            let better = match (&best, &run) {
                (Some(Ok(b)), Ok(r)) => r.seconds < b.seconds,
                (Some(Err(_)), _) => false,
                _ => true,
            };
            if better {
                best = Some(run);
            }
        }
        runs.insert(q, best.unwrap());
    }
    runs
}

/// Register the tables under `data` in `ctx` and run a first query, so the session has
/// attached its workers before a query is measured.
async fn ready(ctx: &SessionContext, data: &Path) {
    tpch_tables::register(ctx, data).await.unwrap();
    ctx.sql("SELECT count(*) FROM nation")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
}

/// Run the queries on a fresh cluster of `hosts` hosts: flumen's workers, then the peer's.
fn run_on(hosts: usize, args: &Args, data: &Path) -> Result<HostRuns, String> {
    let (mut net, file) = cluster(hosts, args)?;
    let peer = args.peer.then(|| start_peer(&mut net, hosts));
    let net = Arc::new(net);
    let in_net = Arc::clone(&net);
    let (args, data) = (args.clone(), data.to_path_buf());
    Ok(net.in_driver(move || {
        driver_runtime().block_on(async move {
            let mut out = HostRuns::default();
            let ctx = cluster_session(&file, args.partitions);
            ready(&ctx, &data).await;
            out.flumen = run_queries(&ctx, &in_net, &args).await;
            if let Some(compression) = &args.compression {
                let set = format!("SET flumen.exchange_compression = '{compression}'");
                ctx.sql(&set).await.unwrap().collect().await.unwrap();
                out.compressed = run_queries(&ctx, &in_net, &args).await;
                let unset = format!("SET flumen.exchange_compression = '{}'", base_compression());
                ctx.sql(&unset).await.unwrap().collect().await.unwrap();
            }
            if let Some(addresses) = peer {
                let ctx = peer_distributed::coordinator(&addresses, args.partitions);
                tpch_tables::register(&ctx, &data).await.unwrap();
                out.peer = run_queries(&ctx, &in_net, &args).await;
            }
            out
        })
    }))
}

/// Run `--kill-query` once on a fresh cluster of `hosts` hosts, on flumen or the peer, with
/// every process of the last host SIGKILLed after `kill_at`: its answer, or why it failed.
fn run_with_kill(
    hosts: usize,
    args: &Args,
    data: &Path,
    peer: bool,
    kill_at: std::time::Duration,
) -> Result<Result<QueryRun, String>, String> {
    let (mut net, file) = cluster(hosts, args)?;
    let addresses = peer.then(|| start_peer(&mut net, hosts));
    let net = Arc::new(net);
    let (in_net, fault_net) = (Arc::clone(&net), Arc::clone(&net));
    let (args, data) = (args.clone(), data.to_path_buf());
    let statements = tpch_tables::query_statements(&tpch_tables::slt_dir(), args.kill_query);
    Ok(net.in_driver(move || {
        driver_runtime().block_on(async move {
            let ctx = match &addresses {
                Some(addresses) => peer_distributed::coordinator(addresses, args.partitions),
                None => cluster_session(&file, args.partitions),
            };
            ready(&ctx, &data).await;
            std::thread::spawn(move || {
                std::thread::sleep(kill_at);
                fault_net.kill_host_now(&format!("h{hosts}"));
            });
            run_query(&ctx, &in_net, &statements)
                .await
                .map_err(|e| e.to_string())
        })
    }))
}

/// Vanilla DataFusion's answers (in this process, unconstrained).
fn vanilla_answers(args: &Args, data: &Path) -> BTreeMap<usize, Vec<RecordBatch>> {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let ctx = SessionContext::new();
        tpch_tables::register(&ctx, data).await.unwrap();
        let slt = tpch_tables::slt_dir();
        let mut answers = BTreeMap::new();
        for &q in &args.queries {
            let mut last = vec![];
            for sql in tpch_tables::query_statements(&slt, q) {
                last = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
            }
            answers.insert(q, last);
        }
        answers
    })
}

fn geomean(values: &[f64]) -> f64 {
    (values.iter().map(|v| v.ln()).sum::<f64>() / values.len().max(1) as f64).exp()
}

/// The driver's CPU per task over a scan of about 12,000 tasks (one per row group) on
/// `hosts` hosts; prints the figures.
fn scheduling_cost(hosts: usize, args: &Args) -> Result<(), String> {
    // 200 files a table, so each task reads a small footer (one file of 12,000 row groups
    // made every task parse megabytes of metadata: 44 ms of a worker's CPU per task).
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tpch-sf0.1-p200-rg50");
    tpch_tables::generate_parts(&dir, 0.1, 200, 50).map_err(|e| e.to_string())?;
    let (net, file) = cluster(hosts, args)?;
    let net = Arc::new(net);
    let in_net = Arc::clone(&net);
    let partitions = args.partitions;
    let run = net.in_driver(move || {
        driver_runtime().block_on(async move {
            let ctx = cluster_session(&file, partitions);
            ready(&ctx, &dir).await;
            let sql = "SET flumen.split_bytes = '1KB'".to_string();
            ctx.sql(&sql).await.unwrap().collect().await.unwrap();
            let query = "SELECT l_orderkey, l_linenumber FROM lineitem WHERE l_quantity > 49.5";
            run_query(&ctx, &in_net, &[query.to_string()]).await
        })
    });
    let run = run.map_err(|e| e.to_string())?;
    let per_task_us = run.driver_cpu * 1e6 / run.tasks.max(1) as f64;
    println!(
        "scheduling on {hosts} hosts: {} tasks ({} on workers) in {:.2} s; driver CPU {:.2} s \
         = {per_task_us:.0} µs per task launched and finished; workers' CPU {:.2} s (goal: \
         ≥ 10,000 tasks: {})",
        run.tasks,
        run.remote_tasks,
        run.seconds,
        run.driver_cpu,
        run.workers_cpu,
        verdict::goal("≥ 10,000 tasks in one query", run.tasks >= 10_000)
    );
    Ok(())
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if let Some(address) = args::flag_value(&argv, "--peer-worker") {
        peer_distributed::serve_worker(address.parse().expect("--peer-worker HOST:PORT"));
    }
    let args = parse_args();
    if args.tasks_query {
        let most = *args.hosts.iter().max().unwrap();
        if let Err(why) = scheduling_cost(most, &args) {
            verdict::not_measured("scheduling cost", &why);
        }
        verdict::finish();
        return;
    }
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("target/tpch-sf{}", args.sf));
    tpch_tables::generate(&data, args.sf).unwrap();
    println!(
        "cluster TPC-H SF {}: hosts {:?}, each host and the driver at {} CPU (cgroup quota), \
         one worker of {} slots per host, {} partitions, best of {}",
        args.sf, args.hosts, args.cores, args.slots, args.partitions, args.runs
    );
    let started = Instant::now();
    let vanilla = vanilla_answers(&args, &data);
    println!(
        "vanilla answers in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut by_hosts: BTreeMap<usize, HostRuns> = BTreeMap::new();
    for &hosts in &args.hosts {
        match run_on(hosts, &args, &data) {
            Ok(runs) => {
                for (q, run) in &runs.flumen {
                    if let Some(why) = wrong(*q, &vanilla[q], run) {
                        verdict::fail(format!("flumen q{q} on {hosts} hosts: {why}"));
                    }
                }
                for (q, run) in &runs.compressed {
                    if let Some(why) = wrong(*q, &vanilla[q], run) {
                        verdict::fail(format!("flumen q{q} on {hosts} hosts, compressed: {why}"));
                    }
                }
                for (q, run) in &runs.peer {
                    // The peer's failures are reported, not the bench's.
                    if let Some(why) = wrong(*q, &vanilla[q], run) {
                        println!("peer q{q} on {hosts} hosts: {why}");
                    }
                }
                by_hosts.insert(hosts, runs);
            }
            Err(why) => {
                verdict::not_measured(&format!("{hosts} host(s)"), &why);
                verdict::finish();
                return;
            }
        }
    }
    report(&args, &by_hosts);
    let most = *args.hosts.iter().max().unwrap();
    if most > 1 {
        host_killed(most, &args, &data, &by_hosts[&most], &vanilla);
    }
    verdict::finish();
}

/// Why `run` is not vanilla's answer `expected` to query `q` (it failed, or differs).
fn wrong(q: usize, expected: &[RecordBatch], run: &Result<QueryRun, String>) -> Option<String> {
    let run = match run {
        Ok(run) => run,
        Err(e) => return Some(format!("failed: {e}")),
    };
    let same = std::panic::catch_unwind(AssertUnwindSafe(|| {
        answers::assert_same_answer(q, expected, &run.answer)
    }));
    match same {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(panic) => Some(panic.downcast_ref::<String>().cloned().unwrap_or_default()),
    }
}

/// `--kill-query` on `hosts` hosts with the last host killed at 40% of each engine's clean
/// time: flumen must answer as vanilla does; the peer's outcome is printed.
fn host_killed(
    hosts: usize,
    args: &Args,
    data: &Path,
    clean: &HostRuns,
    vanilla: &BTreeMap<usize, Vec<RecordBatch>>,
) {
    let q = args.kill_query;
    let Some(expected) = vanilla.get(&q) else {
        verdict::not_measured("a host killed", &format!("q{q} is not among --queries"));
        return;
    };
    let engines = [
        ("flumen", false, &clean.flumen),
        ("peer", true, &clean.peer),
    ];
    for (engine, peer, runs) in engines {
        let Some(Ok(clean)) = runs.get(&q) else {
            if engine == "flumen" || args.peer {
                println!("{engine}: no clean run of q{q} to time the kill by");
            }
            continue;
        };
        let kill_at = std::time::Duration::from_secs_f64(clean.seconds * 0.4);
        let run = match run_with_kill(hosts, args, data, peer, kill_at) {
            Ok(run) => run,
            Err(why) => {
                verdict::not_measured("a host killed", &why);
                return;
            }
        };
        let outcome = match (&run, wrong(q, expected, &run)) {
            (_, Some(why)) => why,
            (Ok(r), None) => format!("completed in {:.2} s, same answer", r.seconds),
            (Err(e), None) => e.clone(),
        };
        println!(
            "{engine}, q{q} on {hosts} hosts, h{hosts} SIGKILLed at {:.2} s (clean {:.2} s): \
             {outcome}",
            kill_at.as_secs_f64(),
            clean.seconds
        );
        if engine == "flumen" {
            let completed = run.is_ok() && wrong(q, expected, &run).is_none();
            println!(
                "flumen completes with a host killed mid-query: {}",
                verdict::goal("flumen completes with a host killed", completed)
            );
        }
    }
}

/// Print the per-query table and the goals.
fn report(args: &Args, by_hosts: &BTreeMap<usize, HostRuns>) {
    let counts: Vec<usize> = by_hosts.keys().copied().collect();
    let (one, most) = (counts[0], *counts.last().unwrap());
    let seconds = |n: usize, q: usize| {
        (by_hosts[&n].flumen.get(&q)).and_then(|r| r.as_ref().ok().map(|r| r.seconds))
    };
    let mut header = "q".to_string();
    for n in &counts {
        header.push_str(&format!(" | {n} host(s) s"));
    }
    for n in counts.iter().skip(1) {
        header.push_str(&format!(" | speedup {n}"));
    }
    header.push_str(&format!(
        " | driver/workers CPU ({most}) | fetched/result ({most}) | driver tasks ({most})"
    ));
    println!("{header}");
    let mut speedups: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let (mut driver_cpu, mut workers_cpu, mut fetched, mut result) = (0.0, 0.0, 0u64, 0u64);
    let mut on_driver: BTreeMap<String, u64> = BTreeMap::new();
    for &q in &args.queries {
        let mut line = format!("{q}");
        for &n in &counts {
            match seconds(n, q) {
                Some(s) => line.push_str(&format!(" | {s:.3}")),
                None => line.push_str(" | failed"),
            }
        }
        for &n in counts.iter().skip(1) {
            match (seconds(one, q), seconds(n, q)) {
                (Some(base), Some(s)) => {
                    speedups.entry(n).or_default().push(base / s);
                    line.push_str(&format!(" | {:.2}x", base / s));
                }
                _ => line.push_str(" | -"),
            }
        }
        if let Some(Ok(run)) = by_hosts[&most].flumen.get(&q) {
            driver_cpu += run.driver_cpu;
            workers_cpu += run.workers_cpu;
            fetched += run.fetched_by_driver;
            result += run.result_bytes;
            for (reason, n) in &run.on_driver {
                *on_driver.entry(reason.clone()).or_default() += n;
            }
            let cpu = run.driver_cpu / run.workers_cpu.max(1e-9);
            let bytes = run.fetched_by_driver as f64 / run.result_bytes.max(1) as f64;
            line.push_str(&format!(
                " | {:.2}/{:.2} s = {:.0}% | {} / {} B = {bytes:.1}x | {:?}",
                run.driver_cpu,
                run.workers_cpu,
                100.0 * cpu,
                run.fetched_by_driver,
                run.result_bytes,
                run.on_driver
            ));
        }
        println!("{line}");
    }
    for (&n, values) in &speedups {
        let mean = geomean(values);
        let goal = 0.8 * (n as f64 / one as f64);
        println!(
            "geomean speedup on {n} hosts over {one}: {mean:.2}x over {} queries (goal ≥ \
             {goal:.1}x: {})",
            values.len(),
            verdict::goal(&format!("speedup on {n} hosts ≥ 0.8·N"), mean >= goal)
        );
    }
    report_cpu_use(args, by_hosts);
    if let Some(compression) = &args.compression {
        report_compression(args, compression, by_hosts);
    }
    let cpu_share = driver_cpu / workers_cpu.max(1e-9);
    println!(
        "driver CPU on {most} hosts: {driver_cpu:.2} s against the workers' {workers_cpu:.2} s \
         = {:.1}% (goal ≤ 10%: {})",
        100.0 * cpu_share,
        verdict::goal("driver CPU ≤ 10% of the workers'", cpu_share <= 0.10)
    );
    let byte_share = fetched as f64 / result.max(1) as f64;
    println!(
        "bytes the driver fetched on {most} hosts: {fetched} against the answers' {result} = \
         {byte_share:.2}x (goal ≤ 1.1x: {})",
        verdict::goal("driver bytes ≤ 1.1 × the result's", byte_share <= 1.1)
    );
    let driver_tasks: u64 = on_driver.values().sum();
    println!(
        "tasks of non-final operators on the driver on {most} hosts: {driver_tasks} \
         {on_driver:?} (goal 0: {})",
        verdict::goal("0 non-final tasks on the driver", driver_tasks == 0)
    );
    if args.peer {
        report_peer(args, by_hosts);
    }
}

/// Print, per host count, the workers' CPU seconds over the queries every count answered,
/// and the share of their quota (hosts × cores × wall time) it used: a speedup short of N
/// is either more work (CPU grew with the hosts: exchanges over the network) or idle
/// quota (waves of tasks waiting on their slowest one).
fn report_cpu_use(args: &Args, by_hosts: &BTreeMap<usize, HostRuns>) {
    let answered = |q: &usize| {
        by_hosts
            .values()
            .all(|r| matches!(r.flumen.get(q), Some(Ok(_))))
    };
    let queries: Vec<usize> = args.queries.iter().copied().filter(answered).collect();
    let one = *by_hosts.keys().next().unwrap();
    let mut base_cpu = None;
    for (&n, runs) in by_hosts {
        let (mut cpu, mut wall) = (0.0, 0.0);
        for q in &queries {
            if let Some(Ok(run)) = runs.flumen.get(q) {
                cpu += run.workers_cpu;
                wall += run.seconds;
            }
        }
        let quota = n as f64 * args.cores * wall;
        let base = *base_cpu.get_or_insert(cpu);
        println!(
            "workers' CPU on {n} host(s): {cpu:.2} s ({:.2}x {one} host's), {:.0}% of their \
             quota ({n} × {} CPU × {wall:.2} s) over {} queries",
            cpu / f64::max(base, 1e-9),
            100.0 * cpu / quota.max(1e-9),
            args.cores,
            queries.len()
        );
    }
}

/// The `flumen.exchange_compression` the bench's main runs use: the session's default.
fn base_compression() -> String {
    FlumenConfig::default().exchange_compression.to_string()
}

/// Print, per host count, flumen's time, bytes on the wire and workers' CPU with blocks
/// sent with `--exchange-compression` against the same queries at the default, on the same
/// cluster.
fn report_compression(args: &Args, compression: &str, by_hosts: &BTreeMap<usize, HostRuns>) {
    let base = base_compression();
    println!(
        "exchange compression {compression} against {base}{}: per host count, geomean time \
         ratio, bytes the hosts sent, workers' CPU",
        args.rate
            .as_ref()
            .map(|r| format!(", links at {r}"))
            .unwrap_or_default()
    );
    for (n, runs) in by_hosts {
        let (mut ratios, mut wire, mut cpu) = (vec![], [0u64; 2], [0.0f64; 2]);
        for q in &args.queries {
            if let (Some(Ok(plain)), Some(Ok(packed))) =
                (runs.flumen.get(q), runs.compressed.get(q))
            {
                ratios.push(packed.seconds / plain.seconds);
                wire[0] += plain.wire_bytes;
                wire[1] += packed.wire_bytes;
                cpu[0] += plain.workers_cpu;
                cpu[1] += packed.workers_cpu;
            }
        }
        println!(
            "{n} host(s): {compression}/{base} time {:.2} over {} queries; sent {:.1} MB against \
             {:.1} MB ({:.2}x); workers' CPU {:.2} s against {:.2} s",
            geomean(&ratios),
            ratios.len(),
            wire[1] as f64 / 1e6,
            wire[0] as f64 / 1e6,
            wire[1] as f64 / (wire[0] as f64).max(1.0),
            cpu[1],
            cpu[0]
        );
    }
}

/// Print each query's time on the peer against flumen's, per host count, and the goal.
fn report_peer(args: &Args, by_hosts: &BTreeMap<usize, HostRuns>) {
    let mut header = "q".to_string();
    for n in by_hosts.keys() {
        header.push_str(&format!(" | {n}h flumen s | {n}h peer s | flumen/peer"));
    }
    println!("{header}");
    let mut ratios: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let ok = |runs: &Runs, q: usize| {
        runs.get(&q)
            .and_then(|r| r.as_ref().ok().map(|r| r.seconds))
    };
    for &q in &args.queries {
        let mut line = format!("{q}");
        for (n, runs) in by_hosts {
            let (f, p) = (ok(&runs.flumen, q), ok(&runs.peer, q));
            let show = |s: Option<f64>| s.map_or("failed".to_string(), |s| format!("{s:.3}"));
            line.push_str(&format!(" | {} | {}", show(f), show(p)));
            match (f, p) {
                (Some(f), Some(p)) => {
                    ratios.entry(*n).or_default().push(f / p);
                    line.push_str(&format!(" | {:.2}", f / p));
                }
                _ => line.push_str(" | -"),
            }
        }
        println!("{line}");
    }
    let most = *by_hosts.keys().last().unwrap();
    for (n, runs) in by_hosts {
        let (mut coordinator, mut workers) = (0.0, 0.0);
        for run in runs.peer.values().flatten() {
            coordinator += run.driver_cpu;
            workers += run.workers_cpu;
        }
        println!("peer CPU on {n} hosts: coordinator {coordinator:.2} s, workers {workers:.2} s");
    }
    for (n, values) in &ratios {
        let mean = geomean(values);
        let verdict = if *n == most {
            let goal = verdict::goal(
                "flumen's geomean ≤ the peer's on the most hosts",
                mean <= 1.0,
            );
            format!(" (goal ≤ 1.0: {goal})")
        } else {
            String::new()
        };
        println!(
            "flumen/peer time on {n} hosts: geomean {mean:.2} over {} queries both answered{verdict}",
            values.len()
        );
    }
}
