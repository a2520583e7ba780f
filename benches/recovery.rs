//! What a worker's death costs: one query over worker processes without failure, then with
//! one worker killed (SIGKILL) when half of the query's source blocks exist, compared with
//! the time of the work that was lost.
//!
//! `cargo bench --bench recovery [-- --rows 2000000 --workers 2]`, or with `--model` the
//! embedding query (`cargo bench --bench recovery -- --model --rows 2000`).
//!
//! Data: the demo `docs` table (`flumen::demo`, HTML documents) as Parquet under
//! `target/recovery-bench/`. Query: per-topic word counts of `clean_text(body)`, whose source
//! tasks (decode + clean) are the bulk of the work and run in the workers; with `--model`,
//! per-topic sums of `embed(clean_text(body))`, whose model tasks run in the accelerator
//! workers (each loads the model once; the killed one is an accelerator worker, and its
//! replacement loads the model again).
//! The allowance is computed from the clean run's own per-task times (from the block hook:
//! each task is known by its partition and place in it, the same in both runs) for the
//! operator whose worker is killed (the source, or the model): the clean times of the tasks
//! whose blocks lived on the killed worker when it died, plus one longest clean task for each
//! task that was running there and had to be retried, plus 1 s to start a replacement.
//! Goal: killed − clean ≤ allowance; a miss exits with status 1. The last line is
//! machine-readable.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use datafusion::error::Result;
use datafusion::physical_plan::collect;
use datafusion::prelude::{ParquetReadOptions, SessionConfig};
use flumen::exec::FlumenExec;
use flumen::exec::StatsSnapshot;
use flumen::{BlockDropper, FlumenConfig, WorkerMode};

const SQL: &str = "SELECT topic, count(*) AS docs, \
     sum(array_length(string_to_array(clean_text(body), ' '))) AS words \
     FROM docs GROUP BY topic ORDER BY topic";

const MODEL_SQL: &str = "SELECT topic, count(*) AS docs, \
     round(sum(array_element(embed(clean_text(body)), 1)), 2) AS e1 \
     FROM docs GROUP BY topic ORDER BY topic";

struct Run {
    seconds: f64,
    answer: String,
    source: StatsSnapshot,
    /// Each task of the watched operator (by partition and place in it): its time.
    task_seconds: HashMap<(usize, usize), f64>,
    /// Tasks of the watched operator whose blocks were on the killed worker at the kill.
    on_killed: HashSet<(usize, usize)>,
}

/// What the block hook saw of the watched operator's blocks.
#[derive(Default)]
struct Seen {
    /// (partition, task index) -> longest time its task had run when one of its blocks came.
    task_seconds: HashMap<(usize, usize), f64>,
    /// (worker pid, partition, task index) of every block made in a worker before the kill.
    made_in: HashSet<(u32, usize, usize)>,
    killed_pid: Option<u32>,
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn run(
    data: &str,
    workers: usize,
    model: bool,
    kill_at: Option<usize>,
    killed: &Arc<Mutex<Option<Instant>>>,
) -> Result<Run> {
    let mut config = FlumenConfig::default();
    config.workers = WorkerMode::Process;
    config.worker_processes = workers;
    if model {
        config.accelerator_slots = workers;
        config.device = flumen::Device::Cpu;
        config.target_block_rows = 128;
    }
    config.split_bytes = flumen::ByteSize(1 << 20);
    let seen = Arc::new(AtomicUsize::new(0));
    let fired = Arc::new(AtomicBool::new(false));
    let armed = Arc::new(AtomicBool::new(false));
    let (seen_in, fired_in, killed_in, armed_in) = (
        Arc::clone(&seen),
        Arc::clone(&fired),
        Arc::clone(killed),
        Arc::clone(&armed),
    );
    let watched = Arc::new(Mutex::new(Seen::default()));
    let watched_in = Arc::clone(&watched);
    let dropper = BlockDropper(Arc::new(move |b| {
        if !armed_in.load(Ordering::Relaxed) || b.operator_name.contains("Accelerator") != model {
            return false;
        }
        let task = (b.partition, b.task_index);
        let mut w = watched_in.lock().unwrap();
        let t = w.task_seconds.entry(task).or_default();
        *t = t.max(b.task_elapsed.as_secs_f64());
        if let Some(pid) = b.worker_pid
            && !fired_in.load(Ordering::Relaxed)
        {
            w.made_in.insert((pid, task.0, task.1));
        }
        if let (Some(at), Some(pid)) = (kill_at, b.worker_pid)
            && seen_in.fetch_add(1, Ordering::Relaxed) == at
            && !fired_in.swap(true, Ordering::Relaxed)
        {
            // SAFETY: a signal to a worker process this session started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            w.killed_pid = Some(pid);
            *killed_in.lock().unwrap() = Some(Instant::now());
        }
        false
    }));
    let session_config = flumen::flumen_session_config(SessionConfig::new(), config.clone())
        .with_extension(Arc::new(dropper));
    let ctx = flumen::session_with_config(session_config, config);
    ctx.register_parquet("docs", data, ParquetReadOptions::default())
        .await?;
    // Start the workers before timing (a cold start is not recovery).
    ctx.sql("SELECT count(*) FROM docs WHERE id < 0")
        .await?
        .collect()
        .await?;
    ctx.sql("SELECT min(body) FROM docs WHERE id = 1")
        .await?
        .collect()
        .await?;
    if model {
        // Load the model in every accelerator worker before timing.
        ctx.sql("SELECT embed(body) FROM docs WHERE id < 64")
            .await?
            .collect()
            .await?;
    }
    let sql = if model { MODEL_SQL } else { SQL };
    let plan = ctx.sql(sql).await?.create_physical_plan().await?;
    armed.store(true, Ordering::Relaxed);
    let started = Instant::now();
    let batches = collect(Arc::clone(&plan), ctx.task_ctx()).await?;
    let seconds = started.elapsed().as_secs_f64();
    let graph = plan.downcast_ref::<FlumenExec>().unwrap().graph();
    let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
    let source = graph
        .operators
        .iter()
        .filter(|op| !model || op.name.contains("Accelerator"))
        .map(|op| metrics.operator(op.id).snapshot())
        .max_by_key(|s| s.remote_tasks)
        .unwrap();
    let w = std::mem::take(&mut *watched.lock().unwrap());
    let on_killed = w
        .made_in
        .iter()
        .filter(|(pid, _, _)| Some(*pid) == w.killed_pid)
        .map(|(_, p, i)| (*p, *i))
        .collect();
    Ok(Run {
        seconds,
        answer: datafusion::arrow::util::pretty::pretty_format_batches(&batches)?.to_string(),
        source,
        task_seconds: w.task_seconds,
        on_killed,
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    let rows = arg("--rows", 400_000);
    let workers = arg("--workers", 2);
    let model = std::env::args().any(|a| a == "--model");
    if std::env::var_os("FLUMEN_WORKER_BIN").is_none() {
        // `cargo bench` builds the binary beside the bench in the same profile directory.
        let exe = std::env::current_exe()?;
        let bin = exe
            .parent()
            .and_then(|deps| deps.parent())
            .map(|dir| dir.join("flumen"))
            .filter(|p| p.exists())
            .expect("the flumen binary next to the bench (cargo build --release --bin flumen)");
        // SAFETY: set before any thread of ours reads the environment.
        unsafe { std::env::set_var("FLUMEN_WORKER_BIN", bin) };
    }
    let dir = PathBuf::from("target/recovery-bench");
    let data = dir.join(format!("docs-{rows}.parquet"));
    if !data.exists() {
        std::fs::create_dir_all(&dir)?;
        println!("writing {rows} demo documents to {}", data.display());
        flumen::demo::write_docs(&data, rows)?;
    }
    let data = std::path::absolute(&data)?.display().to_string();
    let no_kill = Arc::new(Mutex::new(None));
    let clean = run(&data, workers, model, None, &no_kill).await?;
    let blocks = clean.source.blocks as usize;
    let killed_at = Arc::new(Mutex::new(None));
    let killed = run(&data, workers, model, Some(blocks / 2), &killed_at).await?;
    assert_eq!(
        clean.answer, killed.answer,
        "the killed run changed the answer"
    );
    assert!(killed_at.lock().unwrap().is_some(), "no worker was killed");
    let task_s = clean.source.busy_ns as f64 / 1e9 / clean.source.tasks.max(1) as f64;
    // The allowance, from the clean run's times of the same tasks.
    let missing: Vec<_> = killed
        .on_killed
        .iter()
        .filter(|t| !clean.task_seconds.contains_key(t))
        .collect();
    assert!(
        missing.is_empty(),
        "tasks of the killed run not seen in the clean run: {missing:?}"
    );
    // Only the work that had to be redone counts: the tasks recomputed (at the mean clean
    // time of the tasks whose blocks the killed worker held) and the attempts retried (at
    // the longest clean task), spread over the slots left (the workers still alive).
    let on_killed_s: f64 = killed.on_killed.iter().map(|t| clean.task_seconds[t]).sum();
    let mean_on_killed = on_killed_s / killed.on_killed.len().max(1) as f64;
    let longest = clean.task_seconds.values().copied().fold(0.0, f64::max);
    let slots_left = workers.saturating_sub(1).max(1) as f64;
    let lost_work = killed.source.recomputed as f64 * mean_on_killed / slots_left;
    let retried_work = killed.source.tasks_retried as f64 * longest / slots_left;
    const REPLACEMENT_S: f64 = 1.0;
    let allowance = lost_work + retried_work + REPLACEMENT_S;
    let overhead = killed.seconds - clean.seconds;
    println!(
        "rows {rows}, {workers} workers, {} {} tasks, mean {:.3} s, longest {longest:.3} s, \
         {} blocks",
        clean.source.tasks,
        if model { "model" } else { "source" },
        task_s,
        blocks
    );
    println!("clean run:  {:.2} s", clean.seconds);
    println!(
        "killed run: {:.2} s (one worker SIGKILLed at block {} of {blocks}): {} tasks had \
         blocks on it, {} blocks lost, {} tasks recomputed, {} tasks retried",
        killed.seconds,
        blocks / 2,
        killed.on_killed.len(),
        killed.source.blocks_lost,
        killed.source.recomputed,
        killed.source.tasks_retried
    );
    println!(
        "recovery overhead {overhead:.2} s vs allowance {allowance:.2} s = recomputed tasks \
         {lost_work:.2} s + retried {retried_work:.2} s (clean times, over {slots_left} slots \
         left) + replacement {REPLACEMENT_S:.0} s"
    );
    let within = overhead <= allowance;
    println!(
        "recovery query={} clean_s={:.2} killed_s={:.2} allowance_s={allowance:.2} \
         overhead_s={overhead:.2} within_goal={}",
        if model { "model" } else { "words" },
        clean.seconds,
        killed.seconds,
        if within { "yes" } else { "no" }
    );
    if !within {
        eprintln!("recovery goal missed: overhead {overhead:.2} s > allowance {allowance:.2} s");
        std::process::exit(1);
    }
    Ok(())
}
