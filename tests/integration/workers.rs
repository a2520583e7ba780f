//! Worker processes (`flumen.workers = 'process'`): real `flumen worker` processes started by
//! the session, tasks sent as datafusion-proto plans, blocks fetched over Arrow Flight, and
//! workers killed with SIGKILL mid-query. Every answer is compared with vanilla DataFusion's.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    QUERIES, assert_same, events_with_vanilla, register_tables, rows, run_plan, vanilla,
    write_events,
};
use datafusion::prelude::{SessionConfig, SessionContext};
use flumen::exec::FlumenExec;
use flumen::plan::Pool;
use flumen::{BlockDropper, FlumenConfig};

const FLUMEN: &str = env!("CARGO_BIN_EXE_flumen");

fn session(config: FlumenConfig, dropper: Option<BlockDropper>) -> SessionContext {
    let mut session_config = flumen::flumen_session_config(
        SessionConfig::new().with_target_partitions(2),
        config.clone(),
    );
    if let Some(dropper) = dropper {
        session_config = session_config.with_extension(Arc::new(dropper));
    }
    flumen::session_with_config(session_config, config)
}

async fn pool_of(ctx: &SessionContext) -> Arc<flumen::cluster::WorkerPool> {
    common::worker_pool(ctx, Pool::Cpu).await
}

/// `SET flumen.carried_output_bytes = 0` in `ctx`: the blocks the driver reads (the
/// answer) stay in the workers, as larger ones would, for a test whose kill must find
/// them there (small ones come back with their task's reply, and a worker's death then
/// costs none of them: `a_worker_killed_after_its_answers_came_back_costs_nothing`).
async fn keep_answers_in_workers(ctx: &SessionContext) {
    ctx.sql("SET flumen.carried_output_bytes = 0")
        .await
        .unwrap();
}

/// What a [`signal_at_block`] dropper saw: the worker it signalled, and how many blocks
/// each worker made for each operator (so a test can bound what a kill may cost).
#[derive(Debug, Default)]
struct Signalled {
    pid: Option<u32>,
    made: std::collections::HashMap<(u32, usize), u64>,
}

impl Signalled {
    /// Blocks of operator `op` made by the signalled worker (0 when none was signalled).
    fn made_by_signalled(&self, op: usize) -> u64 {
        self.pid
            .and_then(|pid| self.made.get(&(pid, op)).copied())
            .unwrap_or(0)
    }
}

/// A dropper that sends `signal` to the worker holding the `n`-th block made in a worker
/// (counting only blocks of operators whose name contains `operator`, when given), once;
/// it records that worker's pid and counts every worker's blocks per operator.
fn signal_at_block(
    n: usize,
    signal: i32,
    operator: Option<&'static str>,
) -> (BlockDropper, Arc<Mutex<Signalled>>) {
    let seen = AtomicUsize::new(0);
    let signalled = Arc::new(Mutex::new(Signalled::default()));
    let signalled_in = Arc::clone(&signalled);
    let dropper = BlockDropper(Arc::new(move |b| {
        let Some(pid) = b.worker_pid else {
            return false;
        };
        let mut state = signalled_in.lock().unwrap();
        *state.made.entry((pid, b.operator)).or_default() += 1;
        if operator.is_none_or(|name| b.operator_name.contains(name))
            && seen.fetch_add(1, Ordering::Relaxed) == n
        {
            // SAFETY: a signal to a worker process this test's session started.
            unsafe { libc::kill(pid as i32, signal) };
            state.pid = Some(pid);
        }
        false
    }));
    (dropper, signalled)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_workers_answer_like_vanilla() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let f = session(common::in_worker_processes(2), None);
    f.sql("SET flumen.split_bytes = '64KB'").await.unwrap();
    // Small splits under the GROUP BY below too, so many tasks go to the workers.
    f.sql("SET flumen.aggregate_split_bytes = '64KB'")
        .await
        .unwrap();
    register_tables(&f, dir.path()).await;
    for sql in QUERIES {
        assert_same(&v, &f, sql).await;
    }
    // Blocks of several MB, which Flight sends in pieces: the wide rows leave the workers
    // whole and are only measured after the join on the driver.
    assert_same(
        &v,
        &f,
        "SELECT d.name, count(*), sum(length(e.big)) FROM \
         (SELECT k, repeat(body, 200) AS big FROM events) e JOIN dim d ON e.k = d.k \
         GROUP BY d.name",
    )
    .await;
    let (_, plan) = run_plan(&f, "SELECT k, count(*) FROM events GROUP BY k").await;
    let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
    let remote = metrics.operator(0).snapshot().remote_tasks;
    assert!(remote > 4, "only {remote} tasks ran in workers");
    let pool = pool_of(&f).await;
    let workers = pool.workers().await;
    assert_eq!(workers.len(), 2);
    assert!(workers.iter().all(|w| w.address.starts_with("127.0.0.1:")));
}

/// A small query's blocks come back to the driver with their tasks' replies
/// (`flumen.carried_output_bytes`): the driver fetches none of them from a worker. With
/// the setting at 0 the same blocks stay in the workers, and the driver fetches the ones
/// it reads. The answers are vanilla's either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_outputs_come_back_with_their_tasks_replies() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let f = session(common::in_worker_processes(2), None);
    register_tables(&f, dir.path()).await;
    let sql = "SELECT k, count(*), round(avg(v), 9) FROM events GROUP BY k ORDER BY k";
    // Over the plan's operators: output bytes carried back, output bytes the driver
    // fetched from workers, and tasks run in workers.
    let figures = |plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>| {
        let exec = plan.downcast_ref::<FlumenExec>().unwrap();
        let stats = common::operator_stats(exec);
        stats.iter().fold((0, 0, 0), |(c, d, r), s| {
            (
                c + s.output_bytes_carried,
                d + s.output_bytes_to_driver,
                r + s.remote_tasks,
            )
        })
    };
    let expected = common::collect(&v, sql).await;
    for (setting, carries) in [(None, true), (Some("0"), false), (Some("64KiB"), true)] {
        if let Some(bytes) = setting {
            let set = format!("SET flumen.carried_output_bytes = '{bytes}'");
            f.sql(&set).await.unwrap();
        }
        let (batches, plan) = run_plan(&f, sql).await;
        assert!(common::same_rows(&expected, &batches, true), "{setting:?}");
        let (carried, fetched, remote) = figures(&plan);
        assert!(remote >= 3, "{remote} tasks in workers");
        match carries {
            true => assert!(
                carried > 0 && fetched == 0,
                "{setting:?}: {carried} bytes carried, {fetched} fetched by the driver"
            ),
            false => assert!(
                carried == 0 && fetched > 0,
                "{setting:?}: {carried} bytes carried, {fetched} fetched by the driver"
            ),
        }
    }
}

/// A worker SIGKILLed once its tasks' answer blocks came back with their replies (batch
/// mode: every source block is made before any is read) costs no block: the blocks the
/// driver reads are in its own store, so nothing is lost or recomputed, and the answer is
/// vanilla's. (`a_worker_killed_mid_query_costs_only_its_blocks` is the same kill with
/// the blocks left in the workers.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_answers_came_back_costs_nothing() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let victim = Arc::new(Mutex::new(None::<u32>));
    let (victim_in, seen) = (Arc::clone(&victim), AtomicUsize::new(0));
    let dropper = BlockDropper(Arc::new(move |b| {
        // The second block the driver keeps (a worker made it; none holds it) once the
        // victim is named.
        let victim = *victim_in.lock().unwrap();
        if let Some(pid) = victim
            && b.worker_pid.is_none()
            && seen.fetch_add(1, Ordering::Relaxed) == 1
        {
            // SAFETY: a signal to a worker process this test's session started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        false
    }));
    let f = session(common::in_worker_processes(2), Some(dropper));
    f.sql("SET flumen.mode = 'batch'").await.unwrap();
    f.sql("SET flumen.split_bytes = '64KB'").await.unwrap();
    f.sql("SET flumen.target_block_rows = 2000").await.unwrap();
    register_tables(&f, dir.path()).await;
    // The workers start with the first query.
    common::assert_same(&v, &f, "SELECT k, max(id) FROM events GROUP BY k").await;
    let pool = pool_of(&f).await;
    let pid = pool.workers().await[0].pid;
    *victim.lock().unwrap() = Some(pid);
    let sql = "SELECT id, body FROM events WHERE id % 7 = 1";
    let (batches, plan) = run_plan(&f, sql).await;
    let expected = common::collect(&v, sql).await;
    assert_eq!(rows(&expected, false), rows(&batches, false));
    let exec = plan.downcast_ref::<FlumenExec>().unwrap();
    for s in common::operator_stats(exec) {
        assert!(s.output_bytes_carried > 0 || s.remote_tasks == 0, "{s:?}");
        assert_eq!((s.blocks_lost, s.recomputed), (0, 0), "{s:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool
        .workers()
        .await
        .iter()
        .any(|w| w.pid == pid && w.is_alive())
    {
        assert!(Instant::now() < deadline, "worker {pid} was not killed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Kill (SIGKILL) the worker holding the second block made in a worker; in batch
/// mode every source block is made before any is read, so the worker's blocks are lost and
/// must be recomputed from lineage, and only those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_query_costs_only_its_blocks() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let armed = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(Mutex::new(Signalled::default()));
    let seen = Arc::new(AtomicUsize::new(0));
    let (armed_in, killed_in, seen_in) =
        (Arc::clone(&armed), Arc::clone(&killed), Arc::clone(&seen));
    let dropper = BlockDropper(Arc::new(move |b| {
        let Some(pid) = b.worker_pid else {
            return false;
        };
        let mut state = killed_in.lock().unwrap();
        *state.made.entry((pid, b.operator)).or_default() += 1;
        if armed_in.load(Ordering::Relaxed) && seen_in.fetch_add(1, Ordering::Relaxed) == 1 {
            // SAFETY: sending a signal to a child process we started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            state.pid = Some(pid);
            armed_in.store(false, Ordering::Relaxed);
        }
        false
    }));
    // A heartbeat timeout other than the default: every worker, the replacement too,
    // must be given it.
    let mut config = common::in_worker_processes(2);
    config.heartbeat_timeout_secs = 3;
    let f = session(config, Some(dropper));
    f.sql("SET flumen.mode = 'batch'").await.unwrap();
    f.sql("SET flumen.split_bytes = '64KB'").await.unwrap();
    f.sql("SET flumen.aggregate_split_bytes = '64KB'")
        .await
        .unwrap();
    f.sql("SET flumen.target_block_rows = 2000").await.unwrap();
    keep_answers_in_workers(&f).await;
    register_tables(&f, dir.path()).await;
    for sql in [
        "SELECT k, count(*), round(sum(v), 6) FROM events GROUP BY k ORDER BY k",
        "SELECT id, body FROM events WHERE id % 7 = 1",
        "SELECT k, max(id), count(*) FROM events WHERE body LIKE '%7%' GROUP BY k ORDER BY k",
    ] {
        seen.store(0, Ordering::Relaxed);
        *killed.lock().unwrap() = Signalled::default();
        armed.store(true, Ordering::Relaxed);
        let started = Instant::now();
        let (batches, plan) = run_plan(&f, sql).await;
        let elapsed = started.elapsed();
        let expected = v.sql(sql).await.unwrap().collect().await.unwrap();
        let ordered = sql.contains("ORDER BY");
        assert_eq!(rows(&expected, ordered), rows(&batches, ordered), "{sql}");
        let pid = killed.lock().unwrap().pid.unwrap_or_else(|| {
            panic!(
                "{sql}: no worker was killed ({} blocks made in workers)",
                seen.load(Ordering::Relaxed)
            )
        });
        let graph = plan.downcast_ref::<FlumenExec>().unwrap().graph();
        let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
        let scan = graph
            .operators
            .iter()
            .find(|op| metrics.operator(op.id).snapshot().blocks_lost > 0)
            .unwrap_or_else(|| panic!("{sql}: no block was lost with worker {pid}"));
        let s = metrics.operator(scan.id).snapshot();
        assert!(s.recomputed > 0, "{sql}: nothing recomputed");
        // Only the dead worker's blocks were lost, and each lost block's task re-ran at
        // most once.
        let on_killed = killed.lock().unwrap().made_by_signalled(scan.id);
        assert!(
            s.recomputed <= s.blocks_lost && s.blocks_lost <= on_killed,
            "{sql}: recomputed {} lost {} of {}; the killed worker made {on_killed}",
            s.recomputed,
            s.blocks_lost,
            s.blocks
        );
        for op in graph.operators.iter().filter(|op| op.id != scan.id) {
            assert_eq!(
                metrics.operator(op.id).snapshot().recomputed,
                0,
                "{sql}: {}",
                op.name
            );
        }
        assert!(elapsed < Duration::from_secs(60), "{sql} took {elapsed:?}");
    }
    // A later query starts a replacement for each dead worker, in the background (tasks
    // go on on the live ones meanwhile): the pool is whole again soon after.
    common::assert_same(&v, &f, "SELECT count(*) FROM events").await;
    let pool = pool_of(&f).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !pool.workers().await.iter().all(|w| w.is_alive()) {
        assert!(
            Instant::now() < deadline,
            "a dead worker was not replaced in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pool.restarted() >= 1, "no worker was restarted");
    for worker in pool.workers().await {
        assert_eq!(
            worker.ping_timeout(),
            Duration::from_secs(3),
            "worker {} does not have the session's heartbeat timeout",
            worker.address
        );
    }
}

/// A lost block whose recomputation gives other values (a map task calling `random()`) fails
/// the query naming the operator, where a row count alone saw the same block: readers may
/// already hold rows of the first run. The block's digest, taken on the worker that cut it,
/// is what the recomputed rows are held to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_block_of_random_values_fails_the_query_as_not_deterministic() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let armed = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(AtomicUsize::new(0));
    let (armed_in, seen_in) = (Arc::clone(&armed), Arc::clone(&seen));
    let dropper = BlockDropper(Arc::new(move |b| {
        let Some(pid) = b.worker_pid else {
            return false;
        };
        if armed_in.load(Ordering::Relaxed) && seen_in.fetch_add(1, Ordering::Relaxed) == 1 {
            // SAFETY: sending a signal to a child process we started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            armed_in.store(false, Ordering::Relaxed);
        }
        false
    }));
    let f = session(common::in_worker_processes(2), Some(dropper));
    f.sql("SET flumen.mode = 'batch'").await.unwrap();
    f.sql("SET flumen.split_bytes = '64KB'").await.unwrap();
    f.sql("SET flumen.target_block_rows = 2000").await.unwrap();
    keep_answers_in_workers(&f).await;
    register_tables(&f, dir.path()).await;
    let sql = "SELECT id, random() AS r FROM events WHERE id % 7 = 1";
    armed.store(true, Ordering::Relaxed);
    let err = common::try_collect(&f, sql)
        .await
        .expect_err("a recomputed block of random values was taken for the lost one")
        .to_string();
    println!("{sql}: {err}");
    assert!(!armed.load(Ordering::Relaxed), "no worker was killed");
    assert!(err.contains("not deterministic"), "{err}");
    assert!(err.contains("other values"), "{err}");
    // The same kill under a deterministic query costs nothing but the recompute.
    seen.store(0, Ordering::Relaxed);
    armed.store(true, Ordering::Relaxed);
    common::assert_same(
        &v,
        &f,
        "SELECT id, id * 2 AS r FROM events WHERE id % 7 = 1",
    )
    .await;
    assert!(!armed.load(Ordering::Relaxed), "no worker was killed");
}

/// A `TABLESAMPLE` keeps the same rows when a worker holding sampled blocks is killed: its
/// rows are keyed by their place in their file (a Parquet table; `SYSTEM`: its row groups
/// by theirs) or by their place in the block and their values (a subquery), so the recompute keeps what the first run kept, and
/// a threads-mode run with the same seed keeps the same rows. (A sample drawn by `random()`
/// fails such a query as not deterministic, above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_sample_keeps_the_same_rows() {
    let (dir, _) = events_with_vanilla(3, 20_000).await;
    let threads = common::flumen_ctx(&[]).await;
    register_tables(&threads, dir.path()).await;
    // The first block a worker makes after arming kills it.
    let armed = Arc::new(AtomicBool::new(false));
    let killed = Arc::new(Mutex::new(None::<u32>));
    let dropper = {
        let (armed, killed) = (Arc::clone(&armed), Arc::clone(&killed));
        BlockDropper(Arc::new(move |b| {
            if let Some(pid) = b.worker_pid
                && armed.swap(false, Ordering::Relaxed)
            {
                // SAFETY: a signal to a worker process this test's session started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                *killed.lock().unwrap() = Some(pid);
            }
            false
        }))
    };
    let f = session(common::in_worker_processes(2), Some(dropper));
    for set in [
        "SET flumen.mode = 'batch'",
        "SET flumen.split_bytes = '64KB'",
        "SET flumen.target_block_rows = 2000",
    ] {
        f.sql(set).await.unwrap();
    }
    keep_answers_in_workers(&f).await;
    register_tables(&f, dir.path()).await;
    for sql in [
        "SELECT * FROM events TABLESAMPLE (10) REPEATABLE (3)",
        "SELECT id, k FROM events TABLESAMPLE (500 ROWS) REPEATABLE (3)",
        "SELECT id, v FROM events TABLESAMPLE SYSTEM (50) REPEATABLE (3)",
        "SELECT * FROM (SELECT * FROM events WHERE id % 7 = 1) TABLESAMPLE (20) REPEATABLE (3)",
    ] {
        let unkilled = rows(&common::collect(&f, sql).await, false);
        *killed.lock().unwrap() = None;
        armed.store(true, Ordering::Relaxed);
        let (batches, plan) = run_plan(&f, sql).await;
        armed.store(false, Ordering::Relaxed);
        let exec = plan.downcast_ref::<FlumenExec>().expect("a flumen plan");
        let lost: u64 = (common::operator_stats(exec).iter())
            .map(|s| s.blocks_lost + s.tasks_retried)
            .sum();
        assert!(
            killed.lock().unwrap().is_some(),
            "{sql}: no worker was killed: {:?}; on the driver by design {:?}, fallbacks {:?}",
            common::operator_stats(exec),
            on_driver_by_design(&f),
            f.state()
                .config()
                .get_extension::<flumen::cluster::WorkerPoolSlot>()
                .map(|slot| slot.tasks_on_driver().fallbacks())
        );
        assert!(lost > 0, "{sql}: the kill cost nothing");
        let after_kill = rows(&batches, false);
        assert!(
            (1..60_000).contains(&after_kill.len()),
            "{sql}: {} rows",
            after_kill.len()
        );
        assert_eq!(
            after_kill, unkilled,
            "{sql}: other rows after a worker was killed"
        );
        if !sql.contains("WHERE") {
            // A Parquet table's sample is the same in threads mode (the subquery's depends
            // on how rows are cut into blocks, which batch mode does otherwise).
            let in_threads = rows(&common::collect(&threads, sql).await, false);
            assert_eq!(
                after_kill, in_threads,
                "{sql}: threads mode kept other rows"
            );
        }
        println!(
            "{sql}: {} rows, the same after a kill ({lost} blocks lost or tasks retried)",
            after_kill.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_cannot_start_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    write_events(dir.path(), 1, 5_000);
    for (binary, expected) in [
        (
            "/nonexistent/flumen",
            &["cannot start flumen worker /nonexistent/flumen"][..],
        ),
        // A program that prints something else than a worker's address. It may also have
        // exited before the driver wrote the secret to its stdin (a broken pipe): either
        // way the error names the program and why it is not a worker.
        (
            "/bin/echo",
            &["instead of its address", "did not take the secret on stdin"][..],
        ),
    ] {
        let mut config = common::in_worker_processes(1);
        config.worker_binary = binary.into();
        let f = session(config, None);
        register_tables(&f, dir.path()).await;
        let started = Instant::now();
        f.sql("SET flumen.split_bytes = '16KB'").await.unwrap();
        let err = common::try_collect(&f, "SELECT id, v FROM events WHERE v > 0.5")
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("flumen worker {binary}")), "{err}");
        assert!(expected.iter().any(|e| err.contains(e)), "{err}");
        assert!(started.elapsed() < Duration::from_secs(30));
    }
}

/// Seeded chaos: 20 queries (scans, filters, aggregates, joins, sorts, the real `embed` model
/// in accelerator workers, an emulated model UDF on the driver's accelerator pool) run in
/// streaming mode while a killer SIGKILLs a random worker of either pool every 100–400 ms;
/// every answer equals vanilla DataFusion's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_random_worker_kills_never_change_an_answer() {
    let _ = env_logger::builder()
        .is_test(true)
        .format_timestamp_millis()
        .try_init();
    let (dir, v) = events_with_vanilla(4, 25_000).await;
    // Two accelerator workers, and more retries than the default: a task can land on
    // worker after worker that the killer picks next.
    let mut config = common::in_worker_processes(2);
    config.accelerator_slots = 2;
    config.max_task_retries = 8;
    let f = session(config, None);
    f.sql("SET flumen.split_bytes = '32KB'").await.unwrap();
    f.sql("SET flumen.target_block_rows = 1000").await.unwrap();
    register_tables(&f, dir.path()).await;
    // A model UDF (an emulated device, 0.2 ms per 256 rows), the same in both engines.
    let device = Arc::new(flumen::functions::emulated_accelerator::EmulatedDevice::default());
    for ctx in [&v, &f] {
        ctx.register_udf(flumen::accelerator_udf(
            flumen::functions::emulated_accelerator::EmulatedModel::new(
                "model",
                Duration::from_micros(200),
                256,
                4,
                Arc::clone(&device),
            ),
        ));
    }
    flumen::register_functions(&v);
    f.sql("SET flumen.device = 'cpu'").await.unwrap();
    // Start both pools (CPU and accelerator workers), then the killer.
    assert_same(&v, &f, QUERIES[0]).await;
    // Whole vectors, compared by cosine (`assert_same_vectors`).
    let embed_sql = "SELECT id, embed(body) AS e FROM events WHERE id % 997 = 5";
    common::assert_same_vectors(&v, &f, embed_sql).await;
    let pool = pool_of(&f).await;
    let model_pool = common::worker_pool(&f, Pool::Accelerator).await;
    let stop = Arc::new(AtomicBool::new(false));
    let kills = Arc::new(AtomicUsize::new(0));
    let model_kills = Arc::new(AtomicUsize::new(0));
    let killer = {
        let (pool, model_pool, stop, kills, model_kills) = (
            Arc::clone(&pool),
            Arc::clone(&model_pool),
            Arc::clone(&stop),
            Arc::clone(&kills),
            Arc::clone(&model_kills),
        );
        tokio::spawn(async move {
            let mut seed: u64 = 0x5eed_f1a5;
            let mut next = move || {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                seed >> 33
            };
            let mut last_model_kill = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(100 + next() % 300)).await;
                let mut workers = pool.workers().await;
                // An accelerator worker at most every 2 s: a replacement needs about a
                // second to start and load the model, and killing it sooner every time
                // would only measure the retry limit.
                if last_model_kill.elapsed() > Duration::from_secs(2) {
                    workers.extend(model_pool.workers().await);
                }
                let alive: Vec<_> = workers.iter().filter(|w| w.is_alive()).collect();
                if let Some(w) = alive.get(next() as usize % alive.len().max(1)) {
                    if w.kind() == Pool::Accelerator {
                        last_model_kill = Instant::now();
                        model_kills.fetch_add(1, Ordering::Relaxed);
                    }
                    // SAFETY: a signal to a worker process this test's session started.
                    unsafe { libc::kill(w.pid as i32, libc::SIGKILL) };
                    kills.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    let extra = [
        "SELECT id, model(body) AS m FROM events WHERE id % 97 = 5",
        embed_sql,
        "SELECT k % 4 AS g, count(*), round(sum(v), 6) FROM events WHERE v < 0.7 GROUP BY g ORDER BY g",
        "SELECT id, v FROM events WHERE id % 501 = 3",
        "SELECT count(DISTINCT k), max(body) FROM events",
        "SELECT k, min(v), max(v) FROM events WHERE body LIKE '%9%' GROUP BY k ORDER BY k",
    ];
    // The model queries first, then the shared set and the extra ones, 20 in all.
    let queries: Vec<&str> = extra[..2]
        .iter()
        .chain(QUERIES.iter())
        .chain(extra[2..].iter())
        .cycle()
        .take(20)
        .copied()
        .collect();
    let started = Instant::now();
    // A hang is a failure, not a stalled CI run.
    tokio::time::timeout(Duration::from_secs(300), async {
        for sql in &queries {
            if *sql == embed_sql {
                common::assert_same_vectors(&v, &f, sql).await;
            } else {
                assert_same(&v, &f, sql).await;
            }
        }
    })
    .await
    .expect("the chaos queries hung");
    stop.store(true, Ordering::Relaxed);
    killer.await.unwrap();
    let elapsed = started.elapsed();
    // With the killer stopped, one query of each pool: both replace what was killed.
    assert_same(&v, &f, QUERIES[1]).await;
    common::assert_same_vectors(&v, &f, embed_sql).await;
    let (kills, model_kills) = (
        kills.load(Ordering::Relaxed),
        model_kills.load(Ordering::Relaxed),
    );
    println!(
        "chaos: 20 queries in {:.1} s with {kills} workers killed ({model_kills} accelerator), \
         {} CPU and {} accelerator workers restarted",
        elapsed.as_secs_f64(),
        pool.restarted(),
        model_pool.restarted()
    );
    assert!(kills >= 3, "only {kills} kills");
    assert!(model_kills >= 1, "no accelerator worker was killed");
    assert!(
        pool.restarted() >= 1 && model_pool.restarted() >= 1,
        "killed workers were not replaced: {} CPU, {} accelerator restarts",
        pool.restarted(),
        model_pool.restarted()
    );
    assert!(elapsed < Duration::from_secs(240));
}

/// `COPY ... TO` while a worker holding some of its input is killed: the written file holds
/// every row exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_to_with_a_killed_worker_writes_every_row_once() {
    let dir = tempfile::tempdir().unwrap();
    write_events(dir.path(), 3, 20_000);
    let (dropper, killed) = signal_at_block(10, libc::SIGKILL, None);
    let f = session(common::in_worker_processes(2), Some(dropper));
    f.sql("SET flumen.split_bytes = '32KB'").await.unwrap();
    f.sql("SET flumen.target_block_rows = 1000").await.unwrap();
    register_tables(&f, dir.path()).await;
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("copy-out.parquet");
    f.sql(&format!(
        "COPY (SELECT id, k, v, body FROM events WHERE v >= 0) TO '{}'",
        out.display()
    ))
    .await
    .unwrap()
    .collect()
    .await
    .unwrap();
    assert!(killed.lock().unwrap().pid.is_some(), "no worker was killed");
    // One committed file, no staging leftovers.
    let names: Vec<String> = std::fs::read_dir(out_dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, ["copy-out.parquet"]);
    let check = SessionContext::new();
    check
        .register_parquet("written", out.to_str().unwrap(), Default::default())
        .await
        .unwrap();
    let v = vanilla();
    register_tables(&v, dir.path()).await;
    let expected = v
        .sql("SELECT count(*) AS n, count(DISTINCT id) AS ids, sum(id) AS s FROM events WHERE v >= 0")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let written = check
        .sql("SELECT count(*) AS n, count(DISTINCT id) AS ids, sum(id) AS s FROM written")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(rows(&expected, true), rows(&written, true));
}

/// A worker asked to listen on a port that is taken says so and exits.
#[test]
fn a_worker_on_a_port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let mut worker = std::process::Command::new(FLUMEN)
        .args(["worker", "--listen", &address, "--secret-stdin"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let secret = flumen::cluster::auth::Secret::random().to_hex();
    use std::io::Write;
    writeln!(worker.stdin.as_mut().unwrap(), "{secret}").unwrap();
    let out = worker.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {address}")),
        "{stderr}"
    );
}

/// A "worker" that announces an address but answers with garbage bytes: the query fails with
/// an error naming the worker when the pool starts, without hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_answering_garbage_fails_the_query_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    write_events(dir.path(), 1, 5_000);
    let script = dir.path().join("garbage-worker.py");
    std::fs::write(
        &script,
        "#!/usr/bin/env python3\n\
         import socket, sys\n\
         s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8)\n\
         print('flumen worker listening on 127.0.0.1:%d' % s.getsockname()[1], flush=True)\n\
         while True:\n\
         \x20   c, _ = s.accept()\n\
         \x20   try:\n\
         \x20       c.sendall(b'\\x00garbage, not HTTP/2\\xff' * 64); c.close()\n\
         \x20   except OSError:\n\
         \x20       pass\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut config = common::in_worker_processes(1);
    config.worker_binary = script.display().to_string().into();
    config.max_task_retries = 2;
    let f = session(config, None);
    f.sql("SET flumen.split_bytes = '16KB'").await.unwrap();
    register_tables(&f, dir.path()).await;
    let started = Instant::now();
    let err = common::try_collect(&f, "SELECT id, v FROM events WHERE v > 0.5")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not answer as a flumen worker"), "{err}");
    assert!(err.contains("127.0.0.1:"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}: {err}",
        started.elapsed()
    );
    println!("garbage worker: {err}");
}

/// The accelerator (model) operator of a plan's graph.
fn accelerator_operator(graph: &flumen::plan::OperatorGraph) -> &flumen::plan::Operator {
    graph
        .operators
        .iter()
        .find(|op| op.name.contains("Accelerator"))
        .expect("an accelerator operator")
}

/// A small events table (2 files of 300 rows) and a vanilla session with flumen's
/// functions over it: the embedding tests' reference.
async fn embedding_events() -> (tempfile::TempDir, SessionContext) {
    let dir = tempfile::tempdir().unwrap();
    write_events(dir.path(), 2, 300);
    let v = vanilla();
    flumen::register_functions(&v);
    register_tables(&v, dir.path()).await;
    (dir, v)
}

/// Vectors equal to within `1e-4`, id by id.
fn assert_same_embeddings(got: &[(i64, Vec<f32>)], expected: &[(i64, Vec<f32>)]) {
    assert_eq!(got.len(), expected.len());
    for ((id, a), (id2, b)) in got.iter().zip(expected) {
        assert_eq!(id, id2);
        assert_eq!(a.len(), b.len(), "id {id}");
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "id {id}: vectors differ by {worst}");
    }
}

/// A model task's input blocks go from the CPU workers that made them straight to the
/// accelerator worker (tickets the driver hands out): the driver carries none of their
/// bytes. Then the CPU worker holding some of them is killed before they are read (batch
/// mode makes every source block first): those inputs are recomputed from lineage and the
/// vectors are still vanilla's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_inputs_go_worker_to_worker_and_a_lost_holder_is_recomputed() {
    let (dir, v) = embedding_events().await;
    let sql = "SELECT id, embed(body) AS e FROM events";
    let expected = common::embeddings_by_id(&v.sql(sql).await.unwrap().collect().await.unwrap());
    let settings = [
        "SET flumen.mode = 'batch'",
        "SET flumen.device = 'cpu'",
        "SET flumen.target_block_rows = 50",
    ];
    let input_bytes = |plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>| {
        let exec = plan.downcast_ref::<FlumenExec>().unwrap();
        let s = exec
            .run_metrics()
            .operator(accelerator_operator(exec.graph()).id)
            .snapshot();
        (
            s.input_bytes_by_ticket,
            s.input_bytes_via_driver,
            s.remote_tasks,
        )
    };
    // A process-mode session (with `dropper`) running `sql`: it, the rows, the plan and
    // when the run started.
    let run_in = |dropper: Option<BlockDropper>| {
        let dir = dir.path().to_path_buf();
        async move {
            let f = session(common::in_worker_processes(2), dropper);
            for set in settings {
                f.sql(set).await.unwrap();
            }
            register_tables(&f, &dir).await;
            let started = Instant::now();
            let (batches, plan) = run_plan(&f, sql).await;
            (f, batches, plan, started)
        }
    };

    let (f, batches, plan, started) = run_in(None).await;
    let (by_ticket, via_driver, tasks) = input_bytes(&plan);
    println!(
        "clean run: {tasks} model tasks, input bytes worker to worker {by_ticket}, \
         through the driver {via_driver}, {:?}",
        started.elapsed()
    );
    assert_same_embeddings(&common::embeddings_by_id(&batches), &expected);
    assert!(
        tasks >= 12 && by_ticket > 0,
        "{tasks} tasks, {by_ticket} bytes by ticket"
    );
    assert_eq!(via_driver, 0, "the driver carried input bytes");
    // A per-block operator after the model (a partial count): its task plan is cut at its
    // own stage input, not at the model's input below it.
    let counted = "SELECT count(e) FROM (SELECT embed(body) AS e FROM events)";
    assert_same(&v, &f, counted).await;

    // The third block made in a CPU worker: its holder dies before any model task runs.
    let (dropper, killed) = signal_at_block(2, libc::SIGKILL, None);
    let (_f, batches, plan, started) = run_in(Some(dropper)).await;
    let (by_ticket, via_driver, tasks) = input_bytes(&plan);
    let pid = killed
        .lock()
        .unwrap()
        .pid
        .expect("no CPU worker was killed");
    let exec = plan.downcast_ref::<FlumenExec>().unwrap();
    let lost: u64 = (0..exec.graph().operators.len())
        .map(|op| exec.run_metrics().operator(op).snapshot().blocks_lost)
        .sum();
    println!(
        "holder {pid} killed: {tasks} model tasks, input bytes worker to worker {by_ticket}, \
         through the driver {via_driver} (recomputed inputs), {lost} blocks lost, {:?}",
        started.elapsed()
    );
    assert_same_embeddings(&common::embeddings_by_id(&batches), &expected);
    assert!(lost > 0, "the kill cost nothing");
    assert!(by_ticket > 0, "no input went worker to worker");
}

/// SIGKILL an accelerator worker (a process running the real `embed` model) after it made
/// its sixth block: the tasks it was running are retried on the other one, the blocks it
/// held are recomputed from lineage, a replacement process loads the model again, and every
/// vector equals the one vanilla DataFusion computes with the same UDF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accelerator_worker_killed_mid_embedding_costs_only_its_blocks() {
    let (dir, v) = embedding_events().await;
    let (dropper, killed) = signal_at_block(5, libc::SIGKILL, Some("Accelerator"));
    let mut config = common::in_worker_processes(1);
    config.accelerator_slots = 2;
    let f = session(config, Some(dropper));
    for set in [
        "SET flumen.mode = 'batch'",
        "SET flumen.device = 'cpu'",
        "SET flumen.target_block_rows = 50",
    ] {
        f.sql(set).await.unwrap();
    }
    register_tables(&f, dir.path()).await;
    let sql = "SELECT id, embed(body) AS e FROM events";
    let started = Instant::now();
    let (batches, plan) = run_plan(&f, sql).await;
    let elapsed = started.elapsed();
    let expected = common::embeddings_by_id(&v.sql(sql).await.unwrap().collect().await.unwrap());
    assert_same_embeddings(&common::embeddings_by_id(&batches), &expected);
    let pid = killed
        .lock()
        .unwrap()
        .pid
        .expect("no accelerator worker was killed");
    let graph = plan.downcast_ref::<FlumenExec>().unwrap().graph();
    let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
    let model = accelerator_operator(graph);
    let s = metrics.operator(model.id).snapshot();
    println!(
        "killed accelerator worker {pid}: {} tasks in workers, {} blocks lost, {} recomputed, \
         {} retried, {elapsed:?}",
        s.remote_tasks, s.blocks_lost, s.recomputed, s.tasks_retried
    );
    assert!(
        s.remote_tasks >= 12,
        "{} model tasks ran in workers",
        s.remote_tasks
    );
    assert!(s.blocks_lost > 0 && s.recomputed > 0, "{s:?}");
    // Only the killed worker's blocks were lost, and each re-ran at most once.
    let on_killed = killed.lock().unwrap().made_by_signalled(model.id);
    assert!(
        s.blocks_lost <= on_killed && s.recomputed <= s.blocks_lost,
        "{s:?}: the killed worker made {on_killed} of the {} blocks",
        s.blocks
    );
    // Upstream, only the inputs of the lost blocks' tasks were read again (they were
    // released once those tasks ran), never the whole scan.
    for op in graph.operators.iter().filter(|op| op.id != model.id) {
        let up = metrics.operator(op.id).snapshot();
        assert!(up.recomputed < up.blocks.max(1), "{}: {up:?}", op.name);
    }
    // Run again: both accelerator workers (one a replacement) take tasks, and each process
    // loaded the model exactly once, however many tasks it ran.
    let pool = common::worker_pool(&f, Pool::Accelerator).await;
    f.sql("SET flumen.mode = 'streaming'").await.unwrap();
    let again = common::embeddings_by_id(&common::collect(&f, sql).await);
    assert_eq!(again.len(), expected.len());
    assert!(pool.restarted() >= 1, "the killed worker was not replaced");
    for worker in pool.workers().await {
        let status = worker.status().await.unwrap();
        assert_ne!(status.pid, pid);
        assert_eq!(status.kind, Pool::Accelerator);
        assert!(status.tasks > 0, "{status:?}");
        assert_eq!(status.model_loads, 1, "{status:?}");
    }
    assert!(elapsed < Duration::from_secs(120), "took {elapsed:?}");
}

/// A worker that hangs (SIGSTOP: alive, connected, silent) misses its heartbeat, is killed
/// and replaced; the task it held is retried elsewhere and its blocks are recomputed, so the
/// query still answers like vanilla DataFusion, within seconds rather than never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_worker_misses_its_heartbeat_and_is_replaced() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let (dropper, stopped) = signal_at_block(3, libc::SIGSTOP, None);
    let f = session(common::in_worker_processes(2), Some(dropper));
    f.sql("SET flumen.split_bytes = '64KB'").await.unwrap();
    f.sql("SET flumen.aggregate_split_bytes = '64KB'")
        .await
        .unwrap();
    f.sql("SET flumen.target_block_rows = 2000").await.unwrap();
    register_tables(&f, dir.path()).await;
    let sql = "SELECT k, count(*), round(sum(v), 6) FROM events GROUP BY k ORDER BY k";
    let started = Instant::now();
    let (batches, plan) = tokio::time::timeout(Duration::from_secs(60), run_plan(&f, sql))
        .await
        .expect("the query hung with its worker");
    let elapsed = started.elapsed();
    let expected = v.sql(sql).await.unwrap().collect().await.unwrap();
    assert_eq!(rows(&expected, true), rows(&batches, true));
    let pid = stopped.lock().unwrap().pid.expect("no worker was stopped");
    let graph = plan.downcast_ref::<FlumenExec>().unwrap().graph();
    let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
    let lost: u64 = graph
        .operators
        .iter()
        .map(|op| {
            metrics.operator(op.id).snapshot().blocks_lost
                + metrics.operator(op.id).snapshot().tasks_retried
        })
        .sum();
    println!("stopped worker {pid}: query took {elapsed:?}, {lost} blocks lost or tasks retried");
    assert!(lost > 0, "nothing was lost with the hung worker");
    let pool = pool_of(&f).await;
    // The replacement starts in the background once the worker is found hung: the query's
    // retries may finish first (1 run in ~12 checked before its start was complete).
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.restarted() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pool.restarted() >= 1, "the hung worker was not replaced");
    let workers = pool.workers().await;
    assert!(workers.iter().all(|w| w.pid != pid && w.is_alive()));
    // The hung process was killed, not left stopped.
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z")),
        "worker {pid} still runs"
    );
}

/// Kill the worker holding map outputs of a hash exchange (the blocks a `GROUP BY`'s first
/// stage split by key for the reduce tasks) in streaming mode: the reduce side finds them
/// lost, and only their map tasks run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_an_exchange_loses_only_its_map_outputs() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let (dropper, killed) = signal_at_block(12, libc::SIGKILL, None);
    let f = session(common::in_worker_processes(2), Some(dropper));
    f.sql("SET flumen.split_bytes = '32KB'").await.unwrap();
    f.sql("SET flumen.target_block_rows = 1000").await.unwrap();
    register_tables(&f, dir.path()).await;
    let sql = "SELECT k, count(DISTINCT id), max(body) FROM events WHERE v < 0.9 GROUP BY k";
    let (batches, plan) = run_plan(&f, sql).await;
    let expected = v.sql(sql).await.unwrap().collect().await.unwrap();
    assert_eq!(rows(&expected, false), rows(&batches, false));
    assert!(killed.lock().unwrap().pid.is_some(), "no worker was killed");
    let graph = plan.downcast_ref::<FlumenExec>().unwrap().graph();
    let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
    let map = graph
        .operators
        .iter()
        .find(|op| op.output_split.is_some())
        .expect("a map side that splits its output by key");
    let s = metrics.operator(map.id).snapshot();
    println!("exchange map side {}: {s:?}", map.name);
    assert!(
        s.blocks_lost > 0 || s.tasks_retried > 0,
        "the kill cost the exchange nothing: {s:?}"
    );
    // Only the killed worker's map outputs were lost, and each re-ran at most once.
    let on_killed = killed.lock().unwrap().made_by_signalled(map.id);
    assert!(
        s.recomputed <= s.blocks_lost && s.blocks_lost <= on_killed,
        "{s:?}: the killed worker made {on_killed} of the {} blocks",
        s.blocks
    );
}

/// The default local pool is one CPU worker (a task per core). Killed mid-query, it takes
/// every block it held with it and no worker is left to retry on: the pool starts a
/// replacement, the tasks wait for it, the lost blocks are made again there, and the answer
/// is vanilla's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_pools_only_worker_killed_mid_query_is_replaced() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let (dropper, killed) = signal_at_block(12, libc::SIGKILL, None);
    let default_processes = FlumenConfig::default().worker_processes;
    assert_eq!(default_processes, 1, "the local pool's default size");
    let f = session(
        common::in_worker_processes(default_processes),
        Some(dropper),
    );
    f.sql("SET flumen.split_bytes = '32KB'").await.unwrap();
    f.sql("SET flumen.target_block_rows = 1000").await.unwrap();
    register_tables(&f, dir.path()).await;
    let sql = "SELECT k, count(DISTINCT id), max(body) FROM events WHERE v < 0.9 GROUP BY k";
    let (batches, plan) = tokio::time::timeout(Duration::from_secs(120), run_plan(&f, sql))
        .await
        .expect("the query hung with its only worker dead");
    let expected = v.sql(sql).await.unwrap().collect().await.unwrap();
    assert_eq!(rows(&expected, false), rows(&batches, false));
    let pid = killed.lock().unwrap().pid.expect("no worker was killed");
    let graph = plan.downcast_ref::<FlumenExec>().unwrap().graph();
    let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
    let (lost, retried) = (graph.operators.iter())
        .map(|op| metrics.operator(op.id).snapshot())
        .fold((0, 0), |(l, r), s| (l + s.blocks_lost, r + s.tasks_retried));
    println!("killed the only worker {pid}: {lost} blocks lost, {retried} tasks retried");
    assert!(
        lost + retried > 0,
        "the kill cost nothing: {lost} lost, {retried} retried"
    );
    let pool = pool_of(&f).await;
    assert!(pool.restarted() >= 1, "the only worker was not replaced");
    let workers = pool.workers().await;
    assert_eq!(workers.len(), 1);
    assert!(workers.iter().all(|w| w.pid != pid && w.is_alive()));
}

/// Rows of one block at the default `flumen.target_block_rows`.
const DEFAULT_BLOCK_ROWS: usize = 8192;

/// The demo documents' pages kept beside an embedding of their title (the first 32
/// characters of their text, "Document N about TOPIC ..."), over one default-sized block (8,192 web
/// pages, ~10 MB: a task request well over gRPC's 4 MiB default message size) in an
/// accelerator worker process on `device`; every vector is compared with the same model run
/// in this process on the CPU. (Titles, not whole pages, keep the CPU model's work in a debug
/// build to about a minute a side; the block sent to the worker is the same size.)
async fn embed_in_a_worker_matches_the_cpu_reference(device: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("docs.parquet");
    flumen::demo::write_docs(&path, DEFAULT_BLOCK_ROWS).unwrap();
    let register = format!(
        "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
        path.display()
    );
    // Short texts, each row's own ("Document 8191 "): what is checked is the block's path
    // through the worker, not the model's work per row, which made this (with 32 characters
    // a row) the suite's slowest test.
    let sql = "SELECT id, embed(substr(clean_text(body), 1, 14)) AS v, body FROM docs";
    // The reference: every 16th doc, computed in this process (all 8,192 cost the debug
    // build's CPU model as long again as the worker's run, for no stronger check: a row
    // given another row's vector shows among 512 samples spread over the block).
    let reference = common::flumen_ctx(&["SET flumen.device = 'cpu'", &register]).await;
    let sampled = format!("{sql} WHERE id % 16 = 0");
    let expected = common::embeddings_by_id(&common::collect(&reference, &sampled).await);
    assert_eq!(expected.len(), DEFAULT_BLOCK_ROWS / 16);

    let mut config = common::in_worker_processes(1);
    config.accelerator_slots = 1;
    let biggest_block = Arc::new(AtomicUsize::new(0));
    let biggest_in = Arc::clone(&biggest_block);
    // The model's tasks run one input block each and give back one block of the same rows.
    let dropper = BlockDropper(Arc::new(move |b| {
        if b.operator_name.contains("Accelerator") && b.worker_pid.is_some() {
            biggest_in.fetch_max(b.rows, Ordering::Relaxed);
        }
        false
    }));
    let f = session(config, Some(dropper));
    for set in [
        format!("SET flumen.device = '{device}'"),
        "SET flumen.split_bytes = '1GB'".into(),
        // One whole block, not the run's ramp of small first blocks, given back whole (not
        // in pieces of `model_piece_rows`).
        "SET flumen.first_block_rows = 0".into(),
        "SET flumen.model_piece_rows = 0".into(),
        register,
    ] {
        f.sql(&set).await.unwrap().collect().await.unwrap();
    }
    let (batches, plan) = tokio::time::timeout(Duration::from_secs(600), run_plan(&f, sql))
        .await
        .expect("embedding one block in a worker hung");
    assert_eq!(
        biggest_block.load(Ordering::Relaxed),
        DEFAULT_BLOCK_ROWS,
        "the model did not get a default-sized block in one worker task"
    );
    let graph = plan.downcast_ref::<FlumenExec>().unwrap().graph();
    let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
    let model = accelerator_operator(graph);
    assert!(
        metrics.operator(model.id).snapshot().remote_tasks >= 1,
        "the model ran in no worker"
    );
    let got: BTreeMap<i64, Vec<f32>> = common::embeddings_by_id(&batches).into_iter().collect();
    assert_eq!(got.len(), DEFAULT_BLOCK_ROWS, "rows lost or repeated");
    let mut worst = 1.0f32;
    for (id, b) in &expected {
        let a = &got[id];
        assert_eq!(a.len(), 384, "id {id}");
        let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let norms = a.iter().map(|x| x * x).sum::<f32>().sqrt()
            * b.iter().map(|x| x * x).sum::<f32>().sqrt();
        let cosine = dot / norms;
        assert!(
            cosine >= 0.9999,
            "{device}: id {id}: cosine {cosine} with the CPU reference"
        );
        worst = worst.min(cosine);
    }
    println!(
        "{device} worker: {} vectors, lowest cosine of {} with the CPU reference {worst:.6}",
        got.len(),
        expected.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embed_in_a_cpu_worker_at_the_default_block_size_matches_the_cpu_reference() {
    embed_in_a_worker_matches_the_cpu_reference("cpu").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embed_in_a_cuda_worker_at_the_default_block_size_matches_the_cpu_reference() {
    if let Err(why) = flumen::functions::embedding::cuda_driver::probe_device_count() {
        return common::skip_no_device(&why.to_string());
    }
    embed_in_a_worker_matches_the_cpu_reference("cuda").await;
}

/// `flumen.embed_precision` reaches the model's worker process: `bf16` there gives the
/// vectors `bf16` gives in this process (the same emulated rounding), not fp32's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embed_precision_reaches_the_model_worker_process() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("docs.parquet");
    flumen::demo::write_docs(&path, 64).unwrap();
    let register = format!(
        "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
        path.display()
    );
    let sql = "SELECT id, embed(substr(clean_text(body), 1, 200)) AS v FROM docs";
    let in_process = |precision: &'static str| {
        let register = register.clone();
        async move {
            let set = format!("SET flumen.embed_precision = '{precision}'");
            let ctx = common::flumen_ctx(&["SET flumen.device = 'cpu'", &set, &register]).await;
            common::embeddings_by_id(&common::collect(&ctx, sql).await)
        }
    };
    let (bf16_here, fp32_here) = (in_process("bf16").await, in_process("fp32").await);

    let mut config = common::in_worker_processes(1);
    config.accelerator_slots = 1;
    let f = session(config, None);
    for set in [
        "SET flumen.device = 'cpu'",
        "SET flumen.embed_precision = 'bf16'",
        &register,
    ] {
        f.sql(set).await.unwrap().collect().await.unwrap();
    }
    let (batches, plan) = run_plan(&f, sql).await;
    let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
    let model = accelerator_operator(plan.downcast_ref::<FlumenExec>().unwrap().graph());
    assert!(
        metrics.operator(model.id).snapshot().remote_tasks >= 1,
        "the model ran in no worker"
    );
    let in_worker = common::embeddings_by_id(&batches);
    assert_eq!(in_worker.len(), 64);
    let cosine = |a: &[f32], b: &[f32]| -> f64 {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        dot / (norm(a) * norm(b))
    };
    let (mut worst_bf16, mut differ_fp32) = (1.0f64, 0);
    for (((id, got), (id2, bf16)), (_, fp32)) in in_worker.iter().zip(&bf16_here).zip(&fp32_here) {
        assert_eq!(id, id2);
        worst_bf16 = worst_bf16.min(cosine(got, bf16));
        differ_fp32 += usize::from(got != fp32);
    }
    println!(
        "bf16 in a worker process: lowest cosine with bf16 here {worst_bf16:.7}, {differ_fp32} \
         of 64 vectors differ from fp32's"
    );
    assert!(
        worst_bf16 >= 0.99999,
        "bf16 in the worker at cosine {worst_bf16} of bf16 here"
    );
    assert!(
        differ_fp32 > 32,
        "the worker computed in fp32: {differ_fp32} of 64 differ"
    );
    // `flumen.embed_passes_in_flight` travels with it: a value the worker refuses fails
    // the query with the worker's reason (kept at the default, the worker would answer).
    f.sql("SET flumen.embed_passes_in_flight = 3")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let refused = match f.sql(sql).await {
        Ok(frame) => frame.collect().await.map(|_| ()),
        Err(e) => Err(e),
    };
    let refused = refused
        .expect_err("3 passes in flight accepted")
        .to_string();
    assert!(
        refused.contains("flumen.embed_passes_in_flight must be 1 or 2, got 3"),
        "{refused}"
    );
}

/// A driver's accelerator worker processes are told their place in the pool
/// (`--device-slot 0`, `1`, ...), so on a host with several GPUs each takes its own
/// (device slot modulo the visible devices).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accelerator_workers_are_started_with_their_device_slots() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("docs.parquet");
    flumen::demo::write_docs(&path, 8).unwrap();
    let mut config = common::in_worker_processes(1);
    config.accelerator_slots = 2;
    let f = session(config, None);
    for set in [
        "SET flumen.device = 'cpu'".to_string(),
        format!(
            "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
            path.display()
        ),
    ] {
        f.sql(&set).await.unwrap().collect().await.unwrap();
    }
    let out = common::collect(&f, "SELECT embed(substr(body, 1, 20)) FROM docs").await;
    assert_eq!(out.iter().map(|b| b.num_rows()).sum::<usize>(), 8);
    // The command lines of the session's workers (other tests' run beside them).
    let pools = f
        .state()
        .config()
        .get_extension::<flumen::cluster::WorkerPoolSlot>()
        .expect("the session's worker pools");
    let mut slots = vec![];
    for pool in pools.started().await {
        for worker in pool.workers().await {
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", worker.pid)).unwrap();
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let slot = args
                .iter()
                .position(|a| a == "--device-slot")
                .map(|i| args[i + 1].clone());
            match pool.kind() {
                flumen::plan::Pool::Accelerator => {
                    slots.push(slot.expect("an accelerator worker's slot"))
                }
                flumen::plan::Pool::Cpu => {
                    assert_eq!(slot, None, "a CPU worker was given a device slot")
                }
            }
        }
    }
    slots.sort();
    assert_eq!(slots, ["0", "1"], "the accelerator workers' device slots");
}

/// An out-of-core join (a 1 MB budget: its exchange gets many partitions, map outputs spill)
/// with a worker SIGKILLed during the map stage: the map blocks it held are recomputed from
/// lineage, and the answer is vanilla DataFusion's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_in_an_out_of_core_map_stage() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let (dropper, killed) = signal_at_block(15, libc::SIGKILL, None);
    let f = session(common::in_worker_processes(2), Some(dropper));
    for set in [
        "SET flumen.memory_budget = '1MB'",
        "SET flumen.split_bytes = '64KB'",
        "SET flumen.target_block_rows = 1000",
        // A partitioned join (both sides through the exchange), as on large tables.
        "SET datafusion.optimizer.hash_join_single_partition_threshold = 0",
        "SET datafusion.optimizer.hash_join_single_partition_threshold_rows = 0",
    ] {
        f.sql(set).await.unwrap();
    }
    register_tables(&f, dir.path()).await;
    let sql = "SELECT count(*), round(sum(a.v * b.v), 6), max(b.body) \
               FROM events a JOIN events b ON a.id = b.id";
    let expected = v.sql(sql).await.unwrap().collect().await.unwrap();
    let (batches, plan) = run_plan(&f, sql).await;
    assert_eq!(rows(&expected, false), rows(&batches, false), "{sql}");
    let exec = plan.downcast_ref::<FlumenExec>().unwrap();
    let sizing = exec.graph().sizing;
    assert!(sizing.out_of_core(), "not out of core: {sizing:?}");
    let state = killed.lock().unwrap();
    assert!(state.pid.is_some(), "no worker was killed");
    let stats = common::operator_stats(exec);
    let lost: u64 = stats.iter().map(|s| s.blocks_lost).sum();
    let remote: u64 = stats.iter().map(|s| s.remote_tasks).sum();
    assert!(remote > 0, "no map task ran in a worker");
    assert!(lost > 0, "the killed worker held no block");
    println!("{sizing}; worker killed in the map stage: {lost} blocks lost, {remote} remote tasks");
}

/// Rows of the table [`write_sorted_table`] writes: ~50 MB in memory, so under a 48 MB
/// budget a sort of it is planned as ranges sorted in runs of ~1.7 MB (at least 1 MiB, below
/// which ranges are sorted whole).
const SORTED_ROWS: u64 = 1_000_000;

/// `sorted(id, v, tag)`: `SORTED_ROWS` rows in row groups of 64k (a task reads whole row
/// groups), written by `v` and registered in it and in `f`; its path.
async fn write_sorted_table(
    dir: &std::path::Path,
    v: &SessionContext,
    f: &SessionContext,
) -> String {
    let path = format!("{}/sorted.parquet", dir.display());
    common::collect(
        v,
        &format!(
            "COPY (SELECT value AS id, (value * 31) % 1000 AS v, \
             'tag-' || lpad(CAST((value * 13) % 100003 AS VARCHAR), 8, '0') || '-padding' AS tag \
             FROM range(0, {SORTED_ROWS})) TO '{path}' \
             OPTIONS ('format.max_row_group_size' '65536')"
        ),
    )
    .await;
    for ctx in [v, f] {
        ctx.register_parquet("sorted", &path, Default::default())
            .await
            .unwrap();
    }
    path
}

/// The flumen run of an executed `plan`, checked to have been planned out of core.
fn ran_out_of_core(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> &FlumenExec {
    let exec = plan.downcast_ref::<FlumenExec>().unwrap();
    let sizing = exec.graph().sizing;
    assert!(sizing.out_of_core(), "not out of core: {sizing:?}");
    exec
}

/// The out-of-core range sort's push-based merge on worker processes: the runs (each a
/// block-wise sort over one range's blocks) are sorted in workers while the map side still
/// runs, and each range's reduce merges its runs in a worker too. When a merge makes its
/// first block, the worker that sorted the most runs is SIGKILLed: the runs it held for the
/// ranges not yet merged are lost, and each is sorted again from its input blocks (released
/// when the run ended, so recomputed from the map tasks that made them); a merge it was
/// running, or reading a run from, runs again on the other. The rows come out in vanilla
/// DataFusion's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_the_merge_of_sorted_runs() {
    let dir = tempfile::tempdir().unwrap();
    let v = vanilla();
    // Blocks each worker made for the run-sorting operator, and the worker killed.
    let runs_by_worker = Arc::new(Mutex::new(std::collections::HashMap::<u32, u64>::new()));
    let killed = Arc::new(Mutex::new(None::<u32>));
    let (runs_in, killed_in) = (Arc::clone(&runs_by_worker), Arc::clone(&killed));
    let dropper = BlockDropper(Arc::new(move |b| {
        if b.operator_name == "SortExec"
            && let Some(pid) = b.worker_pid
        {
            *runs_in.lock().unwrap().entry(pid).or_default() += 1;
        }
        let mut killed = killed_in.lock().unwrap();
        // The per-partition merge (and the projection above it, in the same task): its
        // first block made in a worker is the first merged.
        if b.worker_pid.is_some() && b.operator_name == "ProjectionExec" && killed.is_none() {
            let runs = runs_in.lock().unwrap();
            if let Some((&pid, _)) = runs.iter().max_by_key(|(_, blocks)| **blocks) {
                // SAFETY: a signal to a worker process this test's session started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                *killed = Some(pid);
            }
        }
        false
    }));
    let f = session(common::in_worker_processes(2), Some(dropper));
    for set in [
        "SET flumen.memory_budget = '48MB'",
        "SET flumen.cpu_slots = 2",
    ] {
        f.sql(set).await.unwrap();
    }
    write_sorted_table(dir.path(), &v, &f).await;
    let sql = "SELECT id FROM sorted ORDER BY tag DESC, v, id";
    let expected = common::collect(&v, sql).await;
    let (batches, plan) = run_plan(&f, sql).await;
    let (got, want) = (common::id_column(&batches), common::id_column(&expected));
    if got != want {
        let first = got.iter().zip(&want).position(|(g, w)| g != w);
        let mut sorted = got.clone();
        sorted.sort_unstable();
        sorted.dedup();
        panic!(
            "the order differs from DataFusion's: {} rows ({} distinct) for {}, first \
             difference at row {first:?}",
            got.len(),
            sorted.len(),
            want.len()
        );
    }
    let exec = ran_out_of_core(&plan);
    let graph = exec.graph();
    let runs = graph
        .operators
        .iter()
        .find(|op| op.run_bytes.is_some())
        .expect("no run-sorting operator in the plan");
    let stats = common::operator_stats(exec);
    let pid = killed.lock().unwrap().expect("no worker was killed");
    let on_killed = runs_by_worker.lock().unwrap()[&pid];
    let s = &stats[runs.id];
    assert!(s.remote_tasks > 0, "no run was sorted in a worker: {s:?}");
    assert!(s.blocks_lost > 0, "the kill lost no run's block: {s:?}");
    assert!(s.recomputed > 0, "no lost run was sorted again: {s:?}");
    // Only the killed worker's runs were lost.
    assert!(
        s.blocks_lost <= on_killed,
        "{s:?}: the killed worker made {on_killed} of the runs' {} blocks",
        s.blocks
    );
    println!(
        "{} runs ({} in workers); the killed worker made {on_killed} of their {} blocks: {} lost, \
         {} recomputed",
        s.tasks, s.remote_tasks, s.blocks, s.blocks_lost, s.recomputed
    );
}

/// `ORDER BY random()` with a seed on worker processes, out of core (16 MB): the map side
/// (each split's rows sent to random partitions) runs in workers, each partition is permuted
/// in the driver. A second run of the same seed SIGKILLs a worker during the map side: its
/// map outputs are lost and recomputed, and the output is still the first run's order, row
/// for row (a permutation of the table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_a_random_shuffle_leaves_its_seeded_order() {
    let dir = tempfile::tempdir().unwrap();
    let v = vanilla();
    let armed = Arc::new(AtomicBool::new(false));
    let (dropper, killed) = {
        // Only the map side runs in workers.
        let (dropper, killed) = signal_at_block(10, libc::SIGKILL, None);
        let armed = Arc::clone(&armed);
        let inner = dropper.0;
        let gated = BlockDropper(Arc::new(move |b| armed.load(Ordering::Relaxed) && inner(b)));
        (gated, killed)
    };
    let f = session(common::in_worker_processes(2), Some(dropper));
    for set in [
        "SET flumen.memory_budget = '16MB'",
        "SET flumen.cpu_slots = 2",
        "SET flumen.shuffle_seed = 7",
    ] {
        f.sql(set).await.unwrap();
    }
    write_sorted_table(dir.path(), &v, &f).await;
    let sql = "SELECT id FROM sorted ORDER BY random()";
    let (first, _) = run_plan(&f, sql).await;
    let first = common::id_column(&first);
    let mut sorted = first.clone();
    sorted.sort_unstable();
    assert!(
        sorted.iter().copied().eq(0..SORTED_ROWS as i64),
        "not a permutation of the ids"
    );

    armed.store(true, Ordering::Relaxed);
    let (again, plan) = run_plan(&f, sql).await;
    let again = common::id_column(&again);
    let exec = ran_out_of_core(&plan);
    let graph = exec.graph();
    let state = killed.lock().unwrap();
    assert!(state.pid.is_some(), "no worker was killed");
    let map = graph
        .operators
        .iter()
        .find(|op| op.output_split.is_some())
        .expect("no map side in the plan");
    let s = common::operator_stats(exec)[map.id];
    assert!(s.remote_tasks > 0, "no map task ran in a worker: {s:?}");
    assert!(
        s.blocks_lost > 0 || s.tasks_retried > 0,
        "the kill cost the map side nothing: {s:?}"
    );
    let same_place = first.iter().zip(&again).filter(|(a, b)| a == b).count();
    assert!(
        again == first,
        "seed 7 gave another order after a worker was killed: {} rows, {same_place} in the \
         first run's places",
        again.len()
    );
    println!(
        "random shuffle, worker killed in the map stage: {} map blocks lost, {} recomputed, {} \
         tasks retried",
        s.blocks_lost, s.recomputed, s.tasks_retried
    );
}

/// Tasks of `ctx`'s session that ran on the driver by design so far, per reason.
fn on_driver_by_design(ctx: &SessionContext) -> std::collections::BTreeMap<&'static str, u64> {
    ctx.state()
        .config()
        .get_extension::<flumen::cluster::WorkerPoolSlot>()
        .map(|slot| slot.tasks_on_driver().by_design())
        .unwrap_or_default()
}

/// Joins, final aggregates, windows and sorts run their per-partition tasks on the workers:
/// each fetches its partition of every input from the workers holding it (a join's build
/// and probe sides both), and the driver runs none of them. Every answer is vanilla's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_partition_tasks_run_on_the_workers() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let f = session(common::in_worker_processes(2), None);
    f.sql("SET flumen.split_bytes = '64KB'").await.unwrap();
    register_tables(&f, dir.path()).await;
    let queries = [
        "SELECT a.k, count(*), round(sum(b.v), 6) FROM events a JOIN events b ON a.id = b.id \
         GROUP BY a.k",
        "SELECT e.k, d.name, count(*) AS n FROM events e JOIN dim d ON e.k = d.k \
         GROUP BY e.k, d.name",
        "SELECT k, count(DISTINCT body), max(v) FROM events GROUP BY k",
        "SELECT k, id, rank() OVER (PARTITION BY k ORDER BY v DESC, id) AS r FROM events \
         WHERE v < 0.02 ORDER BY k, id",
        "SELECT count(*) FROM (SELECT k, id FROM events a WHERE EXISTS \
         (SELECT 1 FROM events b WHERE b.id = a.id + 1 AND b.k = a.k))",
    ];
    let mut reduce_operators = 0;
    for sql in queries {
        let before = on_driver_by_design(&f);
        assert_same(&v, &f, sql).await;
        let (_, plan) = run_plan(&f, sql).await;
        let exec = plan.downcast_ref::<FlumenExec>().unwrap();
        let graph = exec.graph();
        let metrics = exec.run_metrics();
        let after = on_driver_by_design(&f);
        let grew = |reason| {
            after.get(reason).copied().unwrap_or(0) > before.get(reason).copied().unwrap_or(0)
        };
        assert!(
            !grew("per_partition") && !grew("out_of_core"),
            "{sql}: per-partition tasks ran on the driver: {before:?} -> {after:?}"
        );
        // Every per-partition operator (but the root the output runs) ran on the workers,
        // reading its inputs from them by ticket.
        let reduces: Vec<_> = (graph.operators.iter())
            .filter(|op| op.shape == flumen::plan::TaskShape::Barrier && op.id != graph.root().id)
            .map(|op| (op, metrics.operator(op.id).snapshot()))
            .collect();
        println!("{sql}: {} per-partition operators", reduces.len());
        reduce_operators += reduces.len();
        for (op, s) in reduces {
            assert!(
                s.tasks > 0 && s.remote_tasks == s.tasks && s.tasks_on_driver == 0,
                "{sql}: operator {} ({}) ran {} of {} tasks on the workers",
                op.id,
                op.name,
                s.remote_tasks,
                s.tasks
            );
            assert!(
                s.input_bytes_by_ticket > 0,
                "{sql}: {} fetched nothing by ticket: {s:?}",
                op.name
            );
        }
    }
    assert!(
        reduce_operators >= 4,
        "{reduce_operators} per-partition operators"
    );
}

/// A `CollectLeft` join of 16 partitions on 2 workers: its partitions run in
/// waves, each task reading the whole gathered build side itself. The build blocks stay until
/// the last partition is done: before, the first task to finish released them, and every
/// later partition lost its build input and had it recomputed (`imdb.slt`, 15 tasks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_side_every_partition_reads_stays_until_the_last_is_done() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let config = common::in_worker_processes(2);
    let session_config = flumen::flumen_session_config(
        SessionConfig::new().with_target_partitions(16),
        config.clone(),
    );
    let f = flumen::session_with_config(session_config, config);
    f.sql("SET flumen.split_bytes = '64KB'").await.unwrap();
    register_tables(&f, dir.path()).await;
    let sql = "SELECT e.k, count(*), round(sum(e.v * d.n), 6) FROM events e \
               JOIN (SELECT k, count(*) AS n FROM events WHERE v < 0.5 GROUP BY k) d \
               ON e.k = d.k GROUP BY e.k";
    // Each run races the release against the later waves' fetches: several runs.
    for _ in 0..4 {
        assert_same(&v, &f, sql).await;
        let (_, plan) = run_plan(&f, sql).await;
        let exec = plan.downcast_ref::<FlumenExec>().unwrap();
        let join = (exec.graph().operators.iter())
            .find(|op| {
                let text = datafusion::physical_plan::displayable(op.fragment.as_ref());
                (text.indent(false).to_string()).contains("HashJoinExec: mode=CollectLeft")
            })
            .expect("a CollectLeft join operator");
        assert!(join.partitions() > 8, "{} partitions", join.partitions());
        for op in &exec.graph().operators {
            let s = exec.run_metrics().operator(op.id).snapshot();
            assert_eq!(
                (s.blocks_lost, s.recomputed, s.tasks_retried),
                (0, 0, 0),
                "operator {} ({}) lost, recomputed or retried work in a clean run",
                op.id,
                op.name
            );
        }
        let s = exec.run_metrics().operator(join.id).snapshot();
        assert_eq!(s.remote_tasks, s.tasks, "{s:?}");
    }
}

/// A worker SIGKILLed once it holds a join's output blocks: the join's lost partitions run
/// again on the other worker (their build and probe inputs fetched again), and the answer
/// is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_holding_a_joins_output_reruns_only_its_partitions() {
    // The join's operator has a partial aggregate over it on top.
    killed_holding_the_output_of(
        "AggregateExec",
        "HashJoinExec",
        "SELECT a.k, count(*), round(sum(b.v), 6), max(a.body) FROM events a \
         JOIN events b ON a.id = b.id WHERE b.v < 0.8 GROUP BY a.k",
    )
    .await;
}

/// A worker SIGKILLed once it holds a union's output blocks (a union of two final
/// aggregates, each partition one partition of one of them): the lost partitions run again
/// on the other worker, each reading only its own input's partition, and the answer is
/// unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_holding_a_unions_output_reruns_only_its_partitions() {
    killed_holding_the_output_of(
        "UnionExec",
        "UnionExec",
        "SELECT g, n, s FROM (SELECT k AS g, count(*) AS n, round(sum(v), 6) AS s \
         FROM events GROUP BY k UNION ALL SELECT id % 5 + 100, count(*), max(v) \
         FROM events WHERE v < 0.5 GROUP BY id % 5) ORDER BY g, n",
    )
    .await;
}

/// Run `sql` over events in two workers (batch mode), SIGKILLing the worker that holds the
/// first block of the operator named `operator`; the answer must equal vanilla
/// DataFusion's (in any order), and the operator holding `node` must have recovered on the
/// workers ([`common::assert_recovered_on_workers`]).
async fn killed_holding_the_output_of(operator: &'static str, node: &str, sql: &str) {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let armed = Arc::new(AtomicBool::new(false));
    let armed_in = Arc::clone(&armed);
    let killed = Arc::new(Mutex::new(None::<u32>));
    let killed_in = Arc::clone(&killed);
    let dropper = BlockDropper(Arc::new(move |b| {
        if let Some(pid) = b.worker_pid
            && b.operator_name == operator
            && armed_in.swap(false, Ordering::Relaxed)
        {
            // SAFETY: a signal to a worker process this test's session started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            *killed_in.lock().unwrap() = Some(pid);
        }
        false
    }));
    let f = session(common::in_worker_processes(2), Some(dropper));
    f.sql("SET flumen.split_bytes = '64KB'").await.unwrap();
    f.sql("SET flumen.mode = 'batch'").await.unwrap();
    keep_answers_in_workers(&f).await;
    register_tables(&f, dir.path()).await;
    armed.store(true, Ordering::Relaxed);
    let (batches, plan) = run_plan(&f, sql).await;
    let expected = v.sql(sql).await.unwrap().collect().await.unwrap();
    assert_eq!(rows(&expected, false), rows(&batches, false));
    assert!(killed.lock().unwrap().is_some(), "no worker was killed");
    common::assert_recovered_on_workers(&plan, node);
}

/// A join under a limit runs on a worker fed its probe side (`exec::task_feed`); a worker
/// SIGKILLed while it runs loses the blocks it held (probe blocks already fed by ticket, or
/// the join's own task, which starts again on the other worker with its feed from the
/// first block): every row of the join still comes once, as vanilla's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_under_a_fed_join_leaves_the_answer_whole() {
    let (dir, v) = events_with_vanilla(3, 20_000).await;
    let sql = "SELECT e.id, e.v, d.name FROM events e JOIN dim d ON e.k = d.k LIMIT 100000000";
    for n in [3, 12] {
        let (dropper, killed) = signal_at_block(n, libc::SIGKILL, None);
        let f = session(common::in_worker_processes(2), Some(dropper));
        for setting in [
            "SET flumen.split_bytes = '64KB'",
            "SET flumen.target_block_rows = 2000",
            "SET datafusion.optimizer.hash_join_single_partition_threshold = 0",
            "SET datafusion.optimizer.hash_join_single_partition_threshold_rows = 0",
        ] {
            f.sql(setting).await.unwrap();
        }
        register_tables(&f, dir.path()).await;
        let expected = rows(&common::collect(&v, sql).await, false);
        let (got, plan) = run_plan(&f, sql).await;
        assert_eq!(expected, rows(&got, false), "{sql} (kill at block {n})");
        let graph = plan.downcast_ref::<FlumenExec>().unwrap().graph();
        assert!(
            graph.fed_inputs.iter().flatten().any(|fed| *fed),
            "{sql}: no join is fed"
        );
        assert!(killed.lock().unwrap().pid.is_some(), "no worker was killed");
        let metrics = plan.downcast_ref::<FlumenExec>().unwrap().run_metrics();
        let lost: u64 = (graph.operators.iter())
            .map(|op| metrics.operator(op.id).snapshot().blocks_lost)
            .sum();
        eprintln!("{sql} (kill at block {n}): {lost} blocks lost");
        assert!(lost > 0, "the kill cost no block");
    }
}
