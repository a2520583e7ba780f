//! What serving costs: one query's result read from `flumen serve` by a Flight SQL client,
//! against the same query run in the process (no transport) and through the REPL to
//! /dev/null (CSV), all in the same run.
//!
//! `cargo bench --bench serve [-- --rows 2000000 --runs 3]`
//!
//! Data: a generated Parquet table under `target/serve-bench/` (`id`, `k`, `body` of ~100
//! bytes). Query: `SELECT id, k, body FROM t WHERE k < 12` (3/4 of the rows). Each mode runs
//! `--runs` times, interleaved; the table gives the median and [min–max] of rows/s, MB/s
//! (Arrow buffer bytes of the result) and the time to the first batch. Also a dataset job
//! over the same query (`flumen.create_dataset`, blocks of 8,192 rows, one per `DoGet`)
//! read by one and by two consumers at once (the time to the first block counts from the
//! job's creation).
//!
//! Then many users at once: a short query (`SELECT count(*) FROM t WHERE id = N`) from 1, 10
//! and 50 clients at once (`--clients`), `--short-queries` each: queries/s and p50/p99
//! latency; and the same with a handshake flood beside them (16 connections sending wrong
//! passwords as fast as they are answered). Goal: p99 under the flood ≤ 2x p99 without it.
//! The server's peak RSS (`/proc`) is printed after each step.

#[path = "../tests/common/serve_process.rs"]
mod serve_process;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use arrow_flight::sql::client::FlightSqlServiceClient;
use datafusion::error::Result;
use datafusion::physical_plan::execute_stream;
use flumen::FlumenConfig;
use futures::{StreamExt, TryStreamExt};
use serve_process::ServeProcess;

const QUERY: &str = "SELECT id, k, body FROM t WHERE k < 12";

struct Args {
    rows: usize,
    runs: usize,
    clients: Vec<usize>,
    short_queries: usize,
}

fn args() -> Args {
    let mut args = Args {
        rows: 2_000_000,
        runs: 3,
        clients: vec![1, 10, 50],
        short_queries: 40,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rows" => args.rows = it.next().and_then(|v| v.parse().ok()).unwrap_or(args.rows),
            "--runs" => args.runs = it.next().and_then(|v| v.parse().ok()).unwrap_or(args.runs),
            "--clients" => {
                if let Some(list) = it.next() {
                    args.clients = list.split(',').filter_map(|n| n.parse().ok()).collect();
                }
            }
            "--short-queries" => {
                args.short_queries =
                    (it.next().and_then(|v| v.parse().ok())).unwrap_or(args.short_queries)
            }
            _ => {}
        }
    }
    args
}

/// One measured read of the result.
#[derive(Clone, Copy)]
struct Sample {
    seconds: f64,
    rows: usize,
    bytes: usize,
    first_batch: Option<f64>,
}

async fn write_table(path: &Path, rows: usize) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    std::fs::create_dir_all(path.parent().unwrap())?;
    let ctx = flumen::session(FlumenConfig::default());
    let sql = format!(
        "COPY (SELECT value AS id, value % 16 AS k, \
         concat('document ', value, ' ', repeat('lorem ipsum ', 7)) AS body \
         FROM generate_series(1, {rows})) TO '{}'",
        path.display()
    );
    ctx.sql(&sql).await?.collect().await?;
    Ok(())
}

fn table_ddl(path: &Path) -> String {
    format!(
        "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION '{}'",
        path.display()
    )
}

async fn in_process(path: &Path) -> Result<Sample> {
    let ctx = flumen::session(FlumenConfig::default());
    ctx.sql(&table_ddl(path)).await?;
    let started = Instant::now();
    let plan = ctx.sql(QUERY).await?.create_physical_plan().await?;
    let mut stream = execute_stream(plan, ctx.task_ctx())?;
    let (mut rows, mut bytes) = (0, 0);
    let mut first_batch = None;
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        first_batch.get_or_insert(started.elapsed().as_secs_f64());
        rows += batch.num_rows();
        bytes += batch.get_array_memory_size();
    }
    Ok(Sample {
        seconds: started.elapsed().as_secs_f64(),
        rows,
        bytes,
        first_batch,
    })
}

fn repl(path: &Path, rows: usize, bytes: usize) -> Sample {
    let started = Instant::now();
    let status = Command::new(env!("CARGO_BIN_EXE_flumen"))
        .args(["--no-demo", "--quiet", "--format", "csv", "-c"])
        .arg(table_ddl(path))
        .arg("-c")
        .arg(QUERY)
        .stdout(Stdio::null())
        .status()
        .expect("flumen runs");
    assert!(status.success(), "the REPL failed");
    Sample {
        seconds: started.elapsed().as_secs_f64(),
        rows,
        bytes,
        first_batch: None,
    }
}

async fn flight(client: &mut FlightSqlServiceClient<tonic::transport::Channel>) -> Sample {
    let started = Instant::now();
    let info = client
        .execute(QUERY.into(), None)
        .await
        .expect("query planned");
    let ticket = info.endpoint[0].ticket.clone().expect("a ticket");
    let mut stream = client.do_get(ticket).await.expect("DoGet");
    let (mut rows, mut bytes) = (0, 0);
    let mut first_batch = None;
    while let Some(batch) = stream.try_next().await.expect("a batch") {
        first_batch.get_or_insert(started.elapsed().as_secs_f64());
        rows += batch.num_rows();
        bytes += batch.get_array_memory_size();
    }
    Sample {
        seconds: started.elapsed().as_secs_f64(),
        rows,
        bytes,
        first_batch,
    }
}

/// A dataset job over the query (its own name, so no sharing) read by `consumers` trainers
/// at once, one block per `DoGet` until each gets an empty one.
async fn dataset_job(
    client: &FlightSqlServiceClient<tonic::transport::Channel>,
    consumers: u32,
    run: usize,
) -> Sample {
    let started = Instant::now();
    let request = serde_json::json!({
        "name": format!("bench-{consumers}-{run}"),
        "sql": QUERY,
        "consumers": consumers,
        "batch_rows": 8192,
    });
    let answers: Vec<_> = client
        .clone()
        .do_action(arrow_flight::Action::new(
            "flumen.create_dataset",
            request.to_string(),
        ))
        .await
        .expect("dataset job created")
        .try_collect()
        .await
        .expect("an answer");
    let created: serde_json::Value = serde_json::from_slice(&answers[0].body).unwrap();
    let mut readers = vec![];
    for entry in created["tickets"].as_array().unwrap() {
        let ticket =
            arrow_flight::Ticket::new(hex::decode(entry["ticket"].as_str().unwrap()).unwrap());
        let mut client = client.clone();
        readers.push(tokio::spawn(async move {
            let (mut rows, mut first) = (0usize, None);
            loop {
                let batches: Vec<_> = client
                    .do_get(ticket.clone())
                    .await
                    .expect("DoGet")
                    .try_collect()
                    .await
                    .expect("a block");
                let got: usize = batches.iter().map(|b| b.num_rows()).sum();
                if got == 0 {
                    return (rows, first);
                }
                first.get_or_insert(started.elapsed().as_secs_f64());
                rows += got;
            }
        }));
    }
    let (mut rows, mut first_batch) = (0, None::<f64>);
    for reader in readers {
        let (r, first) = reader.await.unwrap();
        rows += r;
        if let Some(f) = first {
            first_batch = Some(first_batch.map_or(f, |g| g.min(f)));
        }
    }
    Sample {
        seconds: started.elapsed().as_secs_f64(),
        rows,
        bytes: 0,
        first_batch,
    }
}

/// `flumen serve` on loopback with a token, a user (for the flood's wrong passwords), the
/// table in its catalog file and its directory allowed.
fn start_server(dir: &Path, table: &Path) -> (ServeProcess, String) {
    use std::os::unix::fs::PermissionsExt;
    let owner_only = |path: &Path, text: &str| {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    let token = flumen::cluster::auth::Secret::random().to_hex();
    let token_file = dir.join("token");
    owner_only(&token_file, &token);
    let users = dir.join("users");
    let hash = flumen::serve::credentials::hash_password("the password").unwrap();
    owner_only(&users, &format!("ana:{hash}\n"));
    // The table, as a client would have created it (replayed from the catalog file).
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let catalog = serde_json::json!({"tables": [{"name": "t", "sql": table_ddl(table)}]});
    std::fs::write(state.join("catalog.json"), catalog.to_string()).unwrap();
    let args: Vec<std::ffi::OsString> = vec![
        "--no-demo".into(),
        "--token-file".into(),
        token_file.into(),
        "--users".into(),
        users.into(),
        "--state-dir".into(),
        state.into(),
        "--allow-path".into(),
        table.parent().unwrap().into(),
        "--max-queries-per-user".into(),
        "64".into(),
    ];
    (ServeProcess::start(args, &dir.join("serve.log")), token)
}

/// Short queries from `clients` clients at once, `per_client` each, with or without a
/// handshake flood beside them: (queries/s, p50 ms, p99 ms, flood attempts).
async fn many_clients(
    server: &ServeProcess,
    token: &str,
    clients: usize,
    per_client: usize,
    flood: bool,
) -> (f64, f64, f64, usize) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let mut connected = Vec::with_capacity(clients);
    for _ in 0..clients {
        connected.push(server.client(token).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let attempts = Arc::new(AtomicUsize::new(0));
    let mut flooders = vec![];
    if flood {
        for _ in 0..16 {
            let (address, stop, attempts) = (
                server.address.clone(),
                Arc::clone(&stop),
                Arc::clone(&attempts),
            );
            flooders.push(tokio::spawn(async move {
                let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
                    .unwrap()
                    .connect()
                    .await
                    .unwrap();
                let mut attacker = FlightSqlServiceClient::new(channel);
                while !stop.load(Ordering::Relaxed) {
                    assert!(attacker.handshake("ana", "wrong").await.is_err());
                    attempts.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
    }
    let started = Instant::now();
    let mut tasks = vec![];
    for (n, mut client) in connected.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(per_client);
            for q in 0..per_client {
                let sql = format!(
                    "SELECT count(*) FROM t WHERE id = {}",
                    n * per_client + q + 1
                );
                let at = Instant::now();
                let info = client.execute(sql, None).await.expect("planned");
                let ticket = info.endpoint[0].ticket.clone().expect("a ticket");
                let batches: Vec<_> = client
                    .do_get(ticket)
                    .await
                    .expect("DoGet")
                    .try_collect()
                    .await
                    .expect("answered");
                assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 1);
                latencies.push(at.elapsed().as_secs_f64() * 1e3);
            }
            latencies
        }));
    }
    let mut latencies = vec![];
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for flooder in flooders {
        flooder.await.unwrap();
    }
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    (
        latencies.len() as f64 / seconds,
        at(0.5),
        at(0.99),
        attempts.load(Ordering::Relaxed),
    )
}

/// The peak resident set of process `pid` (`VmHWM`), in MB.
fn peak_rss_mb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    (status.lines())
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb >> 10)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn summary(name: &str, samples: &[Sample]) -> (f64, String) {
    let mut rates: Vec<f64> = samples.iter().map(|s| s.rows as f64 / s.seconds).collect();
    let mut mbs: Vec<f64> = samples
        .iter()
        .map(|s| s.bytes as f64 / 1e6 / s.seconds)
        .collect();
    let (lo, hi) = (
        rates.iter().cloned().fold(f64::MAX, f64::min),
        rates.iter().cloned().fold(0.0, f64::max),
    );
    let rate = median(&mut rates);
    let mb = median(&mut mbs);
    let mut firsts: Vec<f64> = samples.iter().filter_map(|s| s.first_batch).collect();
    let first = if firsts.is_empty() {
        "-".to_string()
    } else {
        format!("{:.1} ms", median(&mut firsts) * 1e3)
    };
    (
        rate,
        format!("| {name:<28} | {rate:>12.0} [{lo:.0}–{hi:.0}] | {mb:>8.1} | {first:>10} |"),
    )
}

fn main() -> Result<()> {
    let args = args();
    let runtime = tokio::runtime::Runtime::new()?;
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/serve-bench"));
    let table = dir.join(format!("t-{}.parquet", args.rows));
    runtime.block_on(write_table(&table, args.rows))?;
    let server_dir = tempfile::tempdir()?;
    let (server, token) = start_server(server_dir.path(), &table);
    let mut client = runtime.block_on(server.client(&token));
    // Warm the page cache and both processes once.
    let warm = runtime.block_on(in_process(&table))?;
    runtime.block_on(flight(&mut client));
    let (mut local, mut remote, mut shell) = (vec![], vec![], vec![]);
    let (mut one, mut two) = (vec![], vec![]);
    for run in 0..args.runs {
        local.push(runtime.block_on(in_process(&table))?);
        remote.push(runtime.block_on(flight(&mut client)));
        shell.push(repl(&table, warm.rows, warm.bytes));
        one.push(runtime.block_on(dataset_job(&client, 1, run)));
        two.push(runtime.block_on(dataset_job(&client, 2, run)));
    }
    for s in one.iter_mut().chain(two.iter_mut()) {
        assert_eq!(
            s.rows, warm.rows,
            "a dataset job delivered another row count"
        );
        s.bytes = warm.bytes;
    }
    for s in &mut remote {
        assert_eq!(s.rows, warm.rows, "Flight SQL returned another row count");
        // Batches decoded from IPC share their message's buffers, which each column's
        // memory size counts again: the result's bytes are the in-process ones.
        s.bytes = warm.bytes;
    }
    println!(
        "serve bench: {} rows in the table, {} in the result ({:.0} MB of Arrow buffers), {} runs",
        args.rows,
        warm.rows,
        warm.bytes as f64 / 1e6,
        args.runs
    );
    println!(
        "| mode                         | rows/s median [min–max]  |     MB/s | first batch |"
    );
    println!("|---|---|---|---|");
    let (local_rate, line) = summary("in process (no transport)", &local);
    println!("{line}");
    let (remote_rate, line) = summary("Flight SQL (Rust client)", &remote);
    println!("{line}");
    let (shell_rate, line) = summary("REPL, CSV to /dev/null", &shell);
    println!("{line}");
    let (one_rate, line) = summary("dataset job, 1 consumer", &one);
    println!("{line}");
    let (two_rate, line) = summary("dataset job, 2 consumers", &two);
    println!("{line}");
    println!(
        "dataset job / REPL: {:.2} (1 consumer), {:.2} (2 consumers)",
        one_rate / shell_rate,
        two_rate / shell_rate
    );
    println!(
        "Flight SQL / in process: {:.2}; Flight SQL / REPL: {:.2}",
        remote_rate / local_rate,
        remote_rate / shell_rate
    );

    println!(
        "\nmany users: `SELECT count(*) FROM t WHERE id = N`, {} per client",
        args.short_queries
    );
    println!(
        "| clients | flood | queries/s | p50 ms | p99 ms | flood attempts | server peak RSS MB |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut met = true;
    for &clients in &args.clients {
        let mut p99 = [0.0; 2];
        for (i, flood) in [false, true].into_iter().enumerate() {
            let (rate, p50, q99, attempts) = runtime.block_on(many_clients(
                &server,
                &token,
                clients,
                args.short_queries,
                flood,
            ));
            p99[i] = q99;
            println!(
                "| {clients} | {} | {rate:.0} | {p50:.1} | {q99:.1} | {attempts} | {} |",
                if flood { "yes" } else { "no" },
                peak_rss_mb(server.child.id())
            );
        }
        let ratio = p99[1] / p99[0];
        met &= ratio <= 2.0;
        println!("  {clients} clients: p99 under the flood / without: {ratio:.2}");
    }
    println!(
        "goal p99 under a handshake flood <= 2x p99 without it: {}",
        if met { "met" } else { "not met" }
    );
    Ok(())
}
