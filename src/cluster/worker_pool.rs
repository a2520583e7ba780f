//! The driver's pool of workers (`SET flumen.workers = 'process'`): the workers of one kind
//! a session runs its tasks on, watched, replaced, and chosen for each task.
//!
//! The pool starts `flumen.worker_processes` processes of the `flumen` binary on this host,
//! or attaches to the running workers of a cluster (`flumen.cluster`): both in
//! [`crate::cluster::worker_start`]. It talks to each over Arrow Flight through a
//! [`WorkerHandle`] (see [`crate::cluster::worker`] for the other end). Workers are addressed
//! by `host:port` only, so nothing here assumes they share the driver's machine, except
//! starting them.
//!
//! A session has two pools: CPU workers and accelerator workers (`--pool accelerator`, which
//! load each model once and keep it), see [`Pool`].
//!
//! A worker that stops answering is marked dead: a killed process breaks its connections at
//! once, and a hung one misses its heartbeats (a `ping` every [`HEARTBEAT_EVERY`], answered
//! within [`WorkerTimeouts::heartbeat`], [`MISSED_HEARTBEATS`] missed in a row) and is
//! killed. Calls in flight to a dead worker end
//! at once and their tasks are retried elsewhere; its blocks count as lost and are
//! recomputed from lineage by whoever needs them, and a replacement process is started in
//! the background. A task's reply streams its blocks as the worker cuts them, so consumers
//! start on the first block while the task still runs. A task that shows no progress (no
//! block, no rows of output) for `flumen.task_timeout_secs` marks its worker suspect: it is
//! killed and the task retried on another one.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use datafusion::error::{DataFusionError, Result};

use crate::cluster::auth::Secret;
use crate::cluster::membership::{ClusterSettings, DISCOVER_EVERY, host_of};
use crate::cluster::on_driver::DriverTasks;
use crate::cluster::plan_metrics::TaskFigures;
use crate::cluster::protocol::{TaskRequest, exchange_compression, ticket_compression};
use crate::cluster::sent_bounds::SentBound;
use crate::cluster::task_plan::WorkerFunctions;
use crate::cluster::tls::WorkerTrust;
use crate::cluster::worker_client::Failure;
use crate::cluster::worker_handle::{DEFAULT_PING_TIMEOUT, RemoteBlock, WorkerBlock, WorkerHandle};
use crate::cluster::worker_start::{
    START_TIMEOUT, WorkerProgram, attach_all, attach_worker, spawn_worker, worker_program,
};
use crate::config::FlumenConfig;
use crate::functions::accelerator_devices;
use crate::plan::graph::Pool;

/// How often the driver pings each worker.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);

/// Heartbeats a worker must miss in a row to count as hung. Under load a healthy worker's
/// ping takes seconds now and then: on 2 cores shared by a driver and six workers, pings
/// took 0.3–1.7 s, and one in a few hundred 2 s, and a worker killed for that one cost the
/// query its blocks, or, when its pool's workers went too, the query.
pub const MISSED_HEARTBEATS: u32 = 2;
const _: () = assert!(
    MISSED_HEARTBEATS > 1,
    "one slow heartbeat would kill a worker"
);

/// How the driver watches its workers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerTimeouts {
    /// How long a ping may go unanswered before it counts as missed
    /// (`flumen.heartbeat_timeout_secs`); a worker that misses [`MISSED_HEARTBEATS`] in a
    /// row counts as hung (and is killed).
    pub heartbeat: Duration,
    /// How long one attempt of a task may go without a sign of progress (a block, rows of
    /// output, its plan's work) before its worker is suspect (killed, the task retried elsewhere):
    /// `flumen.task_timeout_secs`; `None`: no limit.
    pub task: Option<Duration>,
}

impl Default for WorkerTimeouts {
    fn default() -> Self {
        Self {
            heartbeat: DEFAULT_PING_TIMEOUT,
            task: Some(Duration::from_secs(600)),
        }
    }
}

/// Where a pool's workers come from and how they are watched; a pool whose settings
/// changed is started anew.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSettings {
    /// How they are watched.
    pub timeouts: WorkerTimeouts,
    /// Where they come from.
    pub placement: Placement,
}

impl PoolSettings {
    /// Where the workers of `pool` come from, and how they are watched, as `config` says:
    /// the cluster `flumen.cluster` names, else processes started on this host.
    pub fn of_config(config: &FlumenConfig, pool: Pool) -> Result<Self> {
        let placement = match ClusterSettings::from_config(config)? {
            Some(cluster) => Placement::Cluster(cluster),
            None => Placement::Local {
                program: worker_program(&config.worker_binary.0, &config.worker_module.0)?,
                size: match pool {
                    Pool::Cpu => config.worker_processes,
                    Pool::Accelerator => accelerator_devices::accelerator_workers(config),
                },
                tls: config.worker_tls,
            },
        };
        let timeouts = WorkerTimeouts {
            heartbeat: Duration::from_secs(config.heartbeat_timeout_secs.max(1)),
            task: (config.task_timeout_secs > 0)
                .then(|| Duration::from_secs(config.task_timeout_secs)),
        };
        Ok(Self {
            timeouts,
            placement,
        })
    }
}

/// Where a pool's workers come from.
#[derive(Debug, Clone, PartialEq)]
pub enum Placement {
    /// Processes this driver starts on its own host (and replaces when they die).
    Local {
        /// The program they run.
        program: WorkerProgram,
        /// How many workers (at least 1).
        size: usize,
        /// Talk to them in TLS (`flumen.worker_tls`), with this driver's own certificate
        /// ([`crate::cluster::tls::local_tls`]).
        tls: bool,
    },
    /// Workers already running on a cluster's hosts (`flumen.cluster`): those of the pool's
    /// kind join it as they are found, and a lost one rejoins when it answers again.
    Cluster(ClusterSettings),
}

/// The workers of one session serving one of its pools: processes it started, or the
/// workers of the cluster it is attached to.
#[derive(Debug)]
pub struct WorkerPool {
    settings: PoolSettings,
    kind: Pool,
    /// The functions every worker can call (from their status when the pool started).
    functions: Arc<WorkerFunctions>,
    workers: tokio::sync::Mutex<Vec<Arc<WorkerHandle>>>,
    next: AtomicUsize,
    restarted: AtomicU64,
    /// Workers lost (heartbeat missed, connection broken) and workers that joined after
    /// the start or rejoined after a loss.
    membership: MembershipCounts,
    last_start_error: Mutex<Option<String>>,
    /// The secret and CA a cluster's workers are called with (a local pool uses this
    /// driver's own).
    credentials: Option<(Secret, Option<WorkerTrust>)>,
    /// Cluster addresses whose worker serves the other pool (probed again now and then).
    not_mine: Mutex<HashSet<String>>,
    /// Slots of the live workers when last counted.
    live_slots: AtomicUsize,
    /// The runtime background work (replacement starts) runs on: the one the pool started
    /// on, which the session's queries drive (an accelerator thread's runtime is not).
    runtime: tokio::runtime::Handle,
}

/// How a pool's membership changed since it started.
#[derive(Debug, Default)]
pub struct MembershipCounts {
    /// Workers taken for lost (their blocks recomputed elsewhere).
    pub lost: AtomicU64,
    /// Workers that joined after the pool started.
    pub joined: AtomicU64,
    /// Lost workers (same address) that answered again and were attached anew.
    pub rejoined: AtomicU64,
    /// Workers whose address was taken out of the cluster's list (they get no new task).
    pub left: AtomicU64,
}

/// Where a task run on a worker hands what its worker announces, and what it is fed while
/// it runs ([`WorkerPool::run_task`]).
pub struct TaskOutput<'a> {
    /// Each block, as `(n, block)` as soon as its worker announces it, `n` counting from 0
    /// in each attempt (a retry hands out the same blocks again, each output partition's in
    /// the same order: the caller keeps the first of each).
    pub on_block: &'a mut (dyn FnMut(usize, WorkerBlock) -> Result<()> + Send),
    /// The bounds it tightens while it runs, from any attempt.
    pub on_bounds: &'a mut (dyn FnMut(Vec<SentBound>) + Send),
    /// A fed task's feed, made afresh for each attempt; `None`: it is fed nothing.
    pub feed: Option<super::worker_handle::TaskFeed<'a>>,
}

impl WorkerPool {
    /// Start (or attach to) the workers of `kind` as `settings` say, and their heartbeat.
    /// When a local worker fails to start, those that did are stopped.
    pub async fn start(mut settings: PoolSettings, kind: Pool) -> Result<Arc<Self>> {
        let (started, credentials) = match &mut settings.placement {
            Placement::Local { program, size, tls } => {
                *size = (*size).max(1);
                // Dropping the handles of those that started stops them
                // (`WorkerHandle::drop`).
                let started = futures::future::try_join_all(
                    (0..*size).map(|slot| spawn_worker(program, *tls, kind, slot, *size)),
                )
                .await?;
                (started, None)
            }
            Placement::Cluster(cluster) => {
                let (secret, trust) = cluster.credentials()?;
                let started = attach_all(cluster, &secret, trust.as_ref(), kind).await?;
                (started, Some((secret, trust)))
            }
        };
        for worker in &started {
            worker.set_ping_timeout(settings.timeouts.heartbeat);
        }
        let mut functions = WorkerFunctions {
            names: started[0].announced.functions.iter().cloned().collect(),
            runtimes: started[0].announced.runtimes.iter().cloned().collect(),
        };
        for worker in &started[1..] {
            (functions.names).retain(|f| worker.announced.functions.contains(f));
            (functions.runtimes).retain(|r| worker.announced.runtimes.contains(r));
        }
        let pool = Arc::new(Self {
            settings,
            kind,
            functions: Arc::new(functions),
            live_slots: AtomicUsize::new(started.iter().map(|w| w.slots()).sum()),
            workers: tokio::sync::Mutex::new(started),
            next: AtomicUsize::new(0),
            restarted: AtomicU64::new(0),
            membership: MembershipCounts::default(),
            last_start_error: Mutex::new(None),
            credentials,
            not_mine: Mutex::new(HashSet::new()),
            runtime: tokio::runtime::Handle::current(),
        });
        let heartbeat = Arc::downgrade(&pool);
        pool.runtime.spawn(async move {
            loop {
                tokio::time::sleep(HEARTBEAT_EVERY).await;
                let Some(pool) = heartbeat.upgrade() else {
                    return;
                };
                pool.heartbeat().await;
            }
        });
        if pool.credentials.is_some() {
            // Apart from the heartbeat: a look may wait on an address that does not answer.
            let discovery = Arc::downgrade(&pool);
            pool.runtime.spawn(async move {
                for look in 1u64.. {
                    tokio::time::sleep(DISCOVER_EVERY).await;
                    let Some(pool) = discovery.upgrade() else {
                        return;
                    };
                    pool.discover(look).await;
                }
            });
        }
        Ok(pool)
    }

    /// Ping every live worker at once; one that has not answered in time
    /// [`MISSED_HEARTBEATS`] times in a row (hung, its process gone, its host cut off) is
    /// marked dead, and killed when this driver started it.
    async fn heartbeat(&self) {
        let workers = self.workers().await;
        let timeout = self.settings.timeouts.heartbeat;
        let pings = workers.iter().filter(|w| w.is_alive()).map(|w| async move {
            let answered = w.ping(timeout).await;
            let missed = w.count_heartbeat(answered);
            if missed > 0 && w.is_alive() {
                log::warn!(
                    "flumen worker {} (pid {}) missed its heartbeat ({missed} of \
                     {MISSED_HEARTBEATS} in a row)",
                    w.address,
                    w.pid
                );
                if missed >= MISSED_HEARTBEATS {
                    w.mark_dead();
                }
            }
        });
        futures::future::join_all(pings).await;
        let mut live = 0;
        for worker in &workers {
            if worker.is_alive() {
                // A member that left the cluster's list is alive, not lost: it only gets
                // no slot.
                if !worker.has_left() {
                    live += worker.slots();
                }
            } else if worker.count_loss_once() {
                self.membership.lost.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.live_slots.store(live, Ordering::Relaxed);
    }

    /// Look for cluster workers that are not in the pool (new, or back after a loss) and
    /// attach those of its kind. `look` counts the looks: addresses known to serve the
    /// other pool are probed again every tenth.
    async fn discover(&self, look: u64) {
        let (Placement::Cluster(cluster), Some((secret, trust))) =
            (&self.settings.placement, &self.credentials)
        else {
            return;
        };
        let addresses = match cluster.spec.addresses().await {
            Ok(addresses) => addresses,
            Err(e) => {
                log::warn!("{e}");
                return;
            }
        };
        let members = self.workers().await;
        // A member no longer listed leaves: no new task goes to it. Listed again, it is
        // back.
        let listed: HashSet<&String> = addresses.iter().collect();
        for worker in members.iter().filter(|w| w.is_alive()) {
            let leaving = !listed.contains(&worker.address);
            if worker.set_left(leaving) {
                if leaving {
                    self.membership.left.fetch_add(1, Ordering::Relaxed);
                }
                log::warn!(
                    "flumen worker {} {} the cluster's list: it {} tasks of the {} pool",
                    worker.address,
                    if leaving { "left" } else { "is back in" },
                    if leaving { "gets no more" } else { "gets" },
                    self.kind.as_str()
                );
            }
        }
        let present: HashSet<String> = members
            .iter()
            .filter(|w| w.is_alive())
            .map(|w| w.address.clone())
            .collect();
        let recheck = look.is_multiple_of(10);
        let candidates: Vec<String> = {
            let not_mine = self.not_mine.lock().unwrap();
            addresses
                .into_iter()
                .filter(|a| !present.contains(a) && (recheck || !not_mine.contains(a)))
                .collect()
        };
        let attempts = candidates.iter().map(|address| async move {
            let attached = tokio::time::timeout(
                DISCOVER_EVERY * 2,
                attach_worker(address, cluster, secret, trust.as_ref(), self.kind),
            )
            .await;
            (address, attached)
        });
        for (address, attached) in futures::future::join_all(attempts).await {
            match attached {
                Ok(Ok(Some(worker))) => self.admit(worker).await,
                Ok(Ok(None)) => {
                    self.not_mine.lock().unwrap().insert(address.clone());
                }
                Ok(Err(e)) => log::debug!("flumen worker {address} not attached: {e}"),
                Err(_) => log::debug!("flumen worker {address} did not answer in time"),
            }
        }
    }

    /// Add a newly attached worker: in place of a lost one at its address (it rejoined),
    /// else as a new member; either way it gets tasks at once.
    async fn admit(&self, worker: Arc<WorkerHandle>) {
        worker.set_ping_timeout(self.settings.timeouts.heartbeat);
        let mut workers = self.workers.lock().await;
        let lost_here = workers
            .iter()
            .position(|w| w.address == worker.address && !w.is_alive());
        let counter = match lost_here {
            Some(_) => &self.membership.rejoined,
            None => &self.membership.joined,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        log::warn!(
            "flumen worker {} (host {}, id {}) {} the {} pool",
            worker.address,
            worker.announced.host,
            worker.announced.id,
            if lost_here.is_some() {
                "rejoined"
            } else {
                "joined"
            },
            self.kind.as_str()
        );
        self.live_slots.fetch_add(worker.slots(), Ordering::Relaxed);
        match lost_here {
            Some(slot) => workers[slot] = worker,
            None => workers.push(worker),
        }
    }

    /// The pool its workers serve.
    pub fn kind(&self) -> Pool {
        self.kind
    }

    /// The functions its workers can call.
    pub fn functions(&self) -> &Arc<WorkerFunctions> {
        &self.functions
    }

    /// Tasks its live workers run at once, together (as they announced; counted at each
    /// heartbeat and when one joins).
    pub fn live_slots(&self) -> usize {
        self.live_slots.load(Ordering::Relaxed)
    }

    /// How its membership changed since it started.
    pub fn membership(&self) -> &MembershipCounts {
        &self.membership
    }

    /// Drop every block of query `query` in every live worker (the query ended).
    pub async fn release_query(&self, query: &str) {
        let workers = self.workers().await;
        let releases = workers
            .iter()
            .filter(|w| w.is_alive())
            .map(|w| w.release(query, vec![]));
        futures::future::join_all(releases).await;
    }

    /// The workers alive now.
    pub async fn workers(&self) -> Vec<Arc<WorkerHandle>> {
        self.workers.lock().await.clone()
    }

    /// How many replacement workers were started after a worker died.
    pub fn restarted(&self) -> u64 {
        self.restarted.load(Ordering::Relaxed)
    }

    /// The live worker a task goes to: one on host `prefer` (where most of its input bytes
    /// are) while one there has a free slot, else the least loaded (running tasks per slot; ties
    /// round robin). A dead local worker gets a replacement started in the background, so
    /// tasks go on on the live ones meanwhile; only when none is alive does this wait (for
    /// a replacement, or a cluster worker to come back).
    async fn pick(self: &Arc<Self>, prefer: Option<&str>) -> Result<Arc<WorkerHandle>> {
        let deadline = tokio::time::Instant::now() + START_TIMEOUT * 2;
        loop {
            {
                let workers = self.workers.lock().await;
                if matches!(self.settings.placement, Placement::Local { .. }) {
                    for (slot, worker) in workers.iter().enumerate() {
                        if worker.claim_replacement() {
                            let pool = Arc::clone(self);
                            self.runtime.spawn(async move { pool.replace(slot).await });
                        }
                    }
                }
                let alive: Vec<&Arc<WorkerHandle>> = workers
                    .iter()
                    .filter(|w| w.is_alive() && !w.has_left())
                    .collect();
                if let Some(preferred) = alive.iter().find(|w| {
                    prefer.is_some_and(|host| host_of(&w.address) == host)
                        && w.running() < w.slots()
                }) {
                    return Ok(Arc::clone(preferred));
                }
                if !alive.is_empty() {
                    let start = self.next.fetch_add(1, Ordering::Relaxed) % alive.len();
                    let least_loaded = (0..alive.len())
                        .map(|i| alive[(start + i) % alive.len()])
                        .min_by(|a, b| {
                            // running/slots compared without division.
                            (a.running() * b.slots()).cmp(&(b.running() * a.slots()))
                        })
                        .expect("one is alive");
                    return Ok(Arc::clone(least_loaded));
                }
            }
            if tokio::time::Instant::now() > deadline {
                let why = self.last_start_error.lock().unwrap().clone();
                return Err(DataFusionError::Execution(format!(
                    "no flumen worker of the {} pool is alive and none could be started or \
                     came back: {}",
                    self.kind.as_str(),
                    why.unwrap_or_else(|| "none answered in time".into())
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Start a replacement for the dead local worker in `slot`.
    async fn replace(&self, slot: usize) {
        let Placement::Local { program, tls, size } = &self.settings.placement else {
            return;
        };
        match spawn_worker(program, *tls, self.kind, slot, *size).await {
            Ok(worker) => {
                worker.set_ping_timeout(self.settings.timeouts.heartbeat);
                self.workers.lock().await[slot] = worker;
                self.restarted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                log::warn!("{e}");
                *self.last_start_error.lock().unwrap() = Some(e.to_string());
                // Let the next pick try again.
                if let Some(dead) = self.workers.lock().await.get(slot) {
                    dead.replacement_failed();
                }
            }
        }
    }

    /// Run a task on some worker (`prefer`: the host holding most of its inputs, see
    /// [`Self::pick`]), retrying on another one when a worker dies under it or the task
    /// makes no progress for the task timeout there (at most `max_retries` times).
    /// Its blocks and bounds go to `output` as they come; a fed task is fed each attempt
    /// afresh by `feed`. Returns the retries it took and the address of the worker it ran
    /// on. `describe` names the task in errors.
    pub async fn run_task(
        self: &Arc<Self>,
        plan: &[u8],
        request: &TaskRequest,
        max_retries: usize,
        describe: &str,
        prefer: Option<&str>,
        output: TaskOutput<'_>,
    ) -> Result<TaskRan> {
        let TaskOutput {
            on_block,
            on_bounds,
            feed,
        } = output;
        let compression = exchange_compression(&request.options);
        let mut attempt = 0;
        loop {
            let worker = self.pick(prefer).await?;
            let _busy = worker.busy();
            let sent_as = ticket_compression(compression, &worker.address);
            let mut seq = 0;
            let mut hand_out = |info, carried| {
                let block = match carried {
                    Some(rows) => WorkerBlock::Carried(info, rows),
                    None => WorkerBlock::Held(RemoteBlock {
                        worker: Arc::clone(&worker),
                        info,
                        query: request.query.clone(),
                        compression: sent_as.clone(),
                    }),
                };
                seq += 1;
                on_block(seq - 1, block)
            };
            let deadline = self.settings.timeouts.task;
            let attempt_result =
                (worker.run(plan, request, deadline, &mut hand_out, on_bounds, feed)).await;
            match attempt_result.map_err(|f| worker.classify(f)) {
                Ok(figures) => {
                    return Ok(TaskRan {
                        retries: attempt,
                        worker: worker.address.clone(),
                        figures,
                    });
                }
                Err(Failure::Driver(e)) => return Err(e),
                Err(Failure::Stuck(e)) if attempt < max_retries => {
                    worker.stop_because(e.clone());
                    attempt += 1;
                    log::warn!("{describe}: {e}; retry {attempt} of {max_retries}");
                }
                Err(Failure::Dead(e)) if attempt < max_retries => {
                    worker.mark_dead();
                    attempt += 1;
                    log::warn!("{describe}: {e}; retry {attempt} of {max_retries}");
                }
                // The call's stream broke (seen under lost blocks, the worker alive): the
                // task is tried again; a worker that no longer answers a ping is dead.
                Err(e) if e.broke_the_call() && attempt < max_retries => {
                    if !worker.ping(worker.ping_timeout()).await {
                        worker.mark_dead();
                    }
                    attempt += 1;
                    log::warn!("{describe}: {e}; retry {attempt} of {max_retries}");
                }
                Err(e) => {
                    match &e {
                        Failure::Stuck(why) => worker.stop_because(why.clone()),
                        Failure::Dead(_) => worker.mark_dead(),
                        _ => {}
                    }
                    let at = format!(
                        "{describe} failed on worker {} after {attempt} retries",
                        worker.address
                    );
                    // The task's own error (bad data, a bad cast) in its own words, as a
                    // local run gives it; where it ran goes to the log.
                    if let Failure::Task(message) = &e
                        && let Some(error) = super::protocol::error_from_worker(message)
                    {
                        log::info!("{at}: {message}");
                        return Err(error);
                    }
                    return Err(DataFusionError::Execution(format!("{at}: {e}")));
                }
            }
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        if let Ok(workers) = self.workers.try_lock() {
            for worker in workers.iter() {
                worker.shut_down();
            }
        }
    }
}

/// How a task ran on a pool's worker.
#[derive(Debug)]
pub struct TaskRan {
    /// Attempts retried on another worker after theirs died or stuck.
    pub retries: usize,
    /// The address of the worker that ran it.
    pub worker: String,
    /// DataFusion's counters of its plan and its models' figures, carried back.
    pub figures: TaskFigures,
}

/// Where a session keeps its worker pools, CPU and accelerator (each started on the first
/// query that needs it).
#[derive(Debug, Default)]
pub struct WorkerPoolSlot {
    cpu: tokio::sync::Mutex<Option<Arc<WorkerPool>>>,
    accelerator: tokio::sync::Mutex<Option<Arc<WorkerPool>>>,
    /// The session's tasks that ran on the driver instead, per reason.
    on_driver: DriverTasks,
}

impl WorkerPoolSlot {
    /// The session's worker-mode tasks that ran on the driver, per reason.
    pub fn tasks_on_driver(&self) -> &DriverTasks {
        &self.on_driver
    }

    fn slot(&self, kind: Pool) -> &tokio::sync::Mutex<Option<Arc<WorkerPool>>> {
        match kind {
            Pool::Cpu => &self.cpu,
            Pool::Accelerator => &self.accelerator,
        }
    }

    /// The session's pool of `kind`, started as `settings` say when there is none (or its
    /// settings changed).
    pub async fn get_or_start(
        &self,
        kind: Pool,
        mut settings: PoolSettings,
    ) -> Result<Arc<WorkerPool>> {
        if let Placement::Local { size, .. } = &mut settings.placement {
            *size = (*size).max(1);
        }
        let mut slot = self.slot(kind).lock().await;
        if let Some(pool) = slot.as_ref()
            && pool.settings == settings
        {
            return Ok(Arc::clone(pool));
        }
        let pool = WorkerPool::start(settings, kind).await?;
        *slot = Some(Arc::clone(&pool));
        Ok(pool)
    }

    /// The pool of `kind`, if one was started.
    pub async fn current(&self, kind: Pool) -> Option<Arc<WorkerPool>> {
        self.slot(kind).lock().await.clone()
    }

    /// The pool of `kind`, if one was started and no one is starting one right now (for
    /// callers that cannot wait).
    pub fn try_current(&self, kind: Pool) -> Option<Arc<WorkerPool>> {
        self.slot(kind).try_lock().ok()?.clone()
    }

    /// The pools started so far.
    pub async fn started(&self) -> Vec<Arc<WorkerPool>> {
        let mut pools = vec![];
        for kind in [Pool::Cpu, Pool::Accelerator] {
            pools.extend(self.current(kind).await);
        }
        pools
    }

    /// Tasks the live workers of the pools started so far have run, as they report (a
    /// worker that does not answer counts none).
    pub async fn tasks_in_workers(&self) -> u64 {
        let mut tasks = 0;
        for pool in self.started().await {
            for worker in pool.workers().await {
                if worker.is_alive()
                    && let Ok(status) = worker.status().await
                {
                    tasks += status.tasks;
                }
            }
        }
        tasks
    }
}
