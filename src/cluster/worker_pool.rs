//! The driver's pool of worker processes (`SET flumen.workers = 'process'`).
//!
//! The pool starts `flumen.worker_processes` processes of the `flumen` binary
//! (`flumen worker --listen 127.0.0.1:0`), learns each one's address from its first line of
//! output, and talks to it over Arrow Flight (see [`crate::cluster::worker`]). Workers are addressed
//! by `host:port` only, so nothing here assumes they share the driver's machine, except
//! starting them.
//!
//! A session has two pools: CPU workers and accelerator workers (`--pool accelerator`, which
//! load each model once and keep it), see [`Pool`].
//!
//! Workers start with a cleared environment (only [`WORKER_ENVIRONMENT`] passes: no cloud
//! credentials) and read the driver's secret ([`crate::cluster::auth`]) from their stdin,
//! which the driver keeps open: when the driver dies, even by SIGKILL, the pipe closes and
//! they exit. Every call carries the secret.
//!
//! A worker that stops answering is marked dead: a killed process breaks its connections at
//! once, and a hung one misses its heartbeat (a `ping` every [`HEARTBEAT_EVERY`], answered
//! within [`WorkerTimeouts::heartbeat`]) and is killed. Calls in flight to a dead worker end at once
//! and their tasks are retried elsewhere; its blocks count as lost and are recomputed from
//! lineage by whoever needs them, and a replacement process is started in the background.
//! A task's reply streams its blocks as the worker cuts them, so consumers start on the first
//! block while the task still runs. A task that shows no progress (no block, no rows of
//! output) for `flumen.task_timeout_secs` marks its worker suspect: it is killed and the
//! task retried on another one.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, Ticket};
use datafusion::arrow::compute::concat_batches;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use futures::{StreamExt, TryStreamExt};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::cluster::auth::{Secret, SendSecret, driver_secret};
use crate::cluster::membership::{ClusterSettings, DISCOVER_EVERY, host_of};
use crate::cluster::protocol::{
    BlockTicket, DriverHello, PROTOCOL_VERSION, ReleaseRequest, RemoteBlockInfo, TaskEvent,
    TaskRequest, WorkerStatus, encode_task,
};
use crate::cluster::task_plan::WorkerFunctions;
use crate::cluster::tls::{WorkerTrust, local_tls};
use crate::cluster::worker::MAX_TASK_BYTES;
use crate::exec::on_driver::DriverTasks;
use crate::exec::plan_metrics::PlanMetric;
use crate::plan::graph::Pool;
use crate::store::block::{HeldAt, HeldBlock};

/// How long a starting worker may take to print its address.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// How often the driver pings each worker.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);

/// The environment variables a worker process gets from its driver; all others (cloud
/// credentials, tokens) stay behind.
pub const WORKER_ENVIRONMENT: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "XDG_CACHE_HOME",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_HOME",
    "CUDA_PATH",
    "NVIDIA_VISIBLE_DEVICES",
    "FLUMEN_MODEL_DIR",
    // Python workers (`python -m flumen worker`) find the packages their driver found.
    "PYTHONPATH",
];

/// How the driver watches its workers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerTimeouts {
    /// How long a ping may go unanswered before the worker counts as hung (and is killed):
    /// `flumen.heartbeat_timeout_secs`.
    pub heartbeat: Duration,
    /// How long one attempt of a task may go without a sign of progress (a block, or rows
    /// of output) before its worker is suspect (killed, the task retried elsewhere):
    /// `flumen.task_timeout_secs`; `None`: no limit.
    pub task: Option<Duration>,
}

impl Default for WorkerTimeouts {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_secs(2),
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
        /// ([`local_tls`]).
        tls: bool,
    },
    /// Workers already running on a cluster's hosts (`flumen.cluster`): those of the pool's
    /// kind join it as they are found, and a lost one rejoins when it answers again.
    Cluster(ClusterSettings),
}

/// A Flight client of one worker that presents the driver's secret on every call.
pub type Client = FlightServiceClient<InterceptedService<Channel, SendSecret>>;

/// A block that lives in a worker process.
#[derive(Debug, Clone)]
pub struct RemoteBlock {
    /// The worker that holds it.
    pub worker: Arc<WorkerHandle>,
    /// What the worker said about it.
    pub info: RemoteBlockInfo,
    /// The query that owns it (its ticket names it).
    pub query: String,
}

/// One worker this driver started or attached to. A worker that is lost and later
/// answers again gets a new handle: what came through the old one (blocks, task replies)
/// is never counted again.
#[derive(Debug)]
pub struct WorkerHandle {
    /// Its `host:port`.
    pub address: String,
    /// Its process id (for tests that kill it).
    pub pid: u32,
    /// What it announced when it joined (identity, resources, functions).
    pub announced: WorkerStatus,
    /// This handle's number, unique in this driver: the fence between a worker's
    /// attachments (a partitioned worker that comes back is attached anew).
    pub serial: u64,
    /// Tasks this driver is running on it now.
    running: AtomicUsize,
    kind: Pool,
    /// It speaks TLS.
    tls: bool,
    client: Client,
    /// `true` while the driver believes it alive; calls in flight watch it.
    alive: tokio::sync::watch::Sender<bool>,
    /// A replacement for this (dead) worker is being started.
    replacing: std::sync::atomic::AtomicBool,
    /// Its loss has been counted in its pool's [`MembershipCounts`].
    counted_lost: std::sync::atomic::AtomicBool,
    /// Its address is no longer in the cluster's list: it gets no new task (blocks it holds
    /// are still read from it, and released as ever).
    left: std::sync::atomic::AtomicBool,
    /// The runtime its background calls run on (the one it was started from).
    runtime: tokio::runtime::Handle,
    child: Mutex<Option<std::process::Child>>,
    /// Why the driver stopped it, when it did so itself (a stuck task).
    death: Mutex<Option<String>>,
}

impl WorkerHandle {
    /// The pool it serves.
    pub fn kind(&self) -> Pool {
        self.kind
    }

    /// Whether the driver still believes the worker is alive.
    pub fn is_alive(&self) -> bool {
        *self.alive.borrow()
    }

    /// Whether its address left the cluster's list (it then gets no new task).
    pub fn has_left(&self) -> bool {
        self.left.load(Ordering::Relaxed)
    }

    /// Tasks it runs at once (as it announced, at least 1).
    pub fn slots(&self) -> usize {
        self.announced.slots.max(1)
    }

    /// Tasks this driver is running on it now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Count a task as running on it until the guard drops.
    fn busy(self: &Arc<Self>) -> Busy {
        self.running.fetch_add(1, Ordering::Relaxed);
        Busy(Arc::clone(self))
    }

    /// Resolves once the worker is marked dead.
    async fn died(&self) {
        let mut alive = self.alive.subscribe();
        let _ = alive.wait_for(|alive| !alive).await;
    }

    /// A call to this worker that ends with [`Failure::Dead`] as soon as the worker is marked
    /// dead (a missed heartbeat), instead of waiting on a hung process.
    async fn call<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        tokio::select! {
            result = call => result,
            _ = self.died() => Err(Failure::Dead(self.death())),
        }
    }

    /// What the worker says of itself (tasks run, models loaded, blocks held).
    pub async fn status(&self) -> Result<WorkerStatus> {
        self.call(read_status(&self.client)).await.map_err(|e| {
            DataFusionError::Execution(format!("status of worker {}: {e}", self.address))
        })
    }

    /// Send action `name` and read its one reply as JSON.
    async fn action<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        body: Vec<u8>,
    ) -> Result<T, Failure> {
        action_on(&self.client, name, body).await
    }

    /// One heartbeat: whether the worker answered a ping within `timeout`.
    async fn ping(&self, timeout: Duration) -> bool {
        let mut client = self.client.clone();
        let action = Action {
            r#type: "ping".into(),
            body: Default::default(),
        };
        let call = async {
            let reply = client.do_action(action).await.ok()?;
            reply.into_inner().try_collect::<Vec<_>>().await.ok()
        };
        matches!(tokio::time::timeout(timeout, call).await, Ok(Some(_)))
    }

    /// Whether its process has exited (only known for processes this driver started; a
    /// cluster worker's only by the driver's taking it for dead).
    fn process_exited(&self) -> bool {
        match self.child.lock().unwrap().as_mut() {
            Some(child) => !matches!(child.try_wait(), Ok(None)),
            None => !self.is_alive(),
        }
    }

    /// A failure, reclassified as the worker's death when its process is gone (a killed
    /// process can break a call in ways gRPC reports as an internal error). A worker the
    /// driver stopped on purpose (a stuck task) dies of that reason, whichever way the
    /// broken call reported it: a call on it can see its connection reset before it sees
    /// the worker marked dead.
    fn classify(&self, failure: Failure) -> Failure {
        if let Failure::Driver(_) = failure {
            return failure;
        }
        if !self.is_alive()
            && let Some(reason) = self.death.lock().unwrap().clone()
        {
            return Failure::Dead(reason);
        }
        match failure {
            Failure::Dead(_) => failure,
            other if self.process_exited() => Failure::Dead(other.to_string()),
            other => other,
        }
    }

    /// Why the driver took the worker for dead.
    fn death(&self) -> String {
        self.death.lock().unwrap().clone().unwrap_or_else(|| {
            format!(
                "worker {} (pid {}) stopped answering",
                self.address, self.pid
            )
        })
    }

    /// Stop the worker for `reason` (told to the calls still running on it).
    fn stop_because(&self, reason: String) {
        self.death.lock().unwrap().get_or_insert(reason);
        self.mark_dead();
    }

    fn mark_dead(&self) {
        if self.alive.send_replace(false) {
            log::warn!("flumen worker {} (pid {}) died", self.address, self.pid);
        }
        self.kill_child();
    }

    /// Take the worker down on purpose (its pool is dropped with its session): no warning.
    fn shut_down(&self) {
        self.alive.send_replace(false);
        self.kill_child();
    }

    /// Kill the worker's process, if this driver started it.
    fn kill_child(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            // Reap it off this thread.
            std::thread::spawn(move || child.wait());
        }
    }

    /// Run a task (`plan`, encoded with datafusion-proto), handing each block it leaves
    /// here to `on_block` as soon as the worker announces it; returns the counters of its
    /// plan the worker carried back.
    /// With a `deadline`, a task that goes that long without a sign of progress (a block,
    /// or rows of output) fails as [`Failure::Stuck`].
    async fn run(
        &self,
        plan: &[u8],
        request: &TaskRequest,
        deadline: Option<Duration>,
        on_block: &mut (dyn FnMut(RemoteBlockInfo) -> Result<()> + Send),
    ) -> Result<Vec<PlanMetric>, Failure> {
        let stuck = || {
            let limit = deadline.unwrap_or_default().as_secs();
            Failure::Stuck(format!(
                "a task made no progress for flumen.task_timeout_secs ({limit}s) on worker {} \
                 (pid {}), which was stopped",
                self.address, self.pid
            ))
        };
        let run = async {
            let action = Action {
                r#type: "run".into(),
                body: encode_task(request, plan).into(),
            };
            let mut client = self.client.clone();
            let mut events = within(deadline, client.do_action(action), stuck)
                .await??
                .into_inner();
            loop {
                let Some(event) = within(deadline, events.next(), stuck).await? else {
                    return Err(Failure::Garbage(
                        "the reply ended before the task did".into(),
                    ));
                };
                let event: TaskEvent = serde_json::from_slice(&event?.body)
                    .map_err(|e| Failure::Garbage(format!("bad task event: {e}")))?;
                match event {
                    TaskEvent::Block(info) => on_block(info).map_err(Failure::Driver)?,
                    TaskEvent::Progress { .. } => {}
                    TaskEvent::Done { metrics, .. } => return Ok(metrics),
                }
            }
        };
        self.call(run).await
    }

    /// Fetch (and thereby remove) a block of query `query`.
    async fn fetch(&self, query: &str, key: &str) -> Result<RecordBatch, Failure> {
        let ticket = BlockTicket {
            query: query.into(),
            key: key.into(),
            keep: false,
        };
        self.call(get_block(&self.client, ticket)).await
    }

    /// Drop blocks of `query` the driver no longer needs, all of them when `keys` is empty
    /// (best effort).
    async fn release(&self, query: &str, keys: Vec<String>) {
        let request = ReleaseRequest {
            query: query.into(),
            keys,
        };
        let _ = self
            .call(self.action::<usize>("release", serde_json::to_vec(&request).unwrap()))
            .await;
    }
}

/// A task counted as running on a worker (for placement) while it lives.
struct Busy(Arc<WorkerHandle>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Send action `name` to the worker behind `client` and read its one reply as JSON.
async fn action_on<T: serde::de::DeserializeOwned>(
    client: &Client,
    name: &str,
    body: Vec<u8>,
) -> Result<T, Failure> {
    let mut client = client.clone();
    let action = Action {
        r#type: name.into(),
        body: body.into(),
    };
    let reply = client.do_action(action).await.map_err(Failure::from)?;
    let results: Vec<arrow_flight::Result> = reply
        .into_inner()
        .try_collect()
        .await
        .map_err(Failure::from)?;
    let first = results
        .first()
        .ok_or_else(|| Failure::Garbage(format!("empty reply to {name}")))?;
    serde_json::from_slice(&first.body)
        .map_err(|e| Failure::Garbage(format!("bad reply to {name}: {e}")))
}

/// The status of the worker behind `client`, asked with this driver's hello (a worker of
/// another protocol refuses it, naming both versions).
async fn read_status(client: &Client) -> Result<WorkerStatus, Failure> {
    let hello = serde_json::to_vec(&DriverHello::ours()).expect("hello serializes");
    action_on(client, "status", hello).await
}

impl Drop for WorkerHandle {
    /// A handle nobody holds any more (a pool that failed half-way through its start, a
    /// replaced worker) takes its process down with it.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.get_mut().unwrap().take() {
            let _ = child.kill();
            std::thread::spawn(move || child.wait());
        }
    }
}

/// `wait`'s output, or `stuck()` when a `deadline` passes first.
async fn within<T>(
    deadline: Option<Duration>,
    wait: impl std::future::Future<Output = T>,
    stuck: impl Fn() -> Failure,
) -> Result<T, Failure> {
    match deadline {
        Some(limit) => tokio::time::timeout(limit, wait).await.map_err(|_| stuck()),
        None => Ok(wait.await),
    }
}

/// Why a call to a worker failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The worker is gone (connection refused or broken): its blocks are lost.
    Dead(String),
    /// The worker answered with an error (the task itself failed).
    Task(String),
    /// The worker answered with bytes that make no sense.
    Garbage(String),
    /// The task ran past its deadline: the worker is suspect (killed, the task retried).
    Stuck(String),
    /// The driver could not take what the worker sent (e.g. its query was cancelled).
    Driver(DataFusionError),
    /// The worker refused the driver's credential (another cluster's secret).
    Refused(String),
}

impl From<tonic::Status> for Failure {
    fn from(status: tonic::Status) -> Self {
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
                Failure::Dead(status.to_string())
            }
            tonic::Code::Unauthenticated => Failure::Refused(status.message().to_string()),
            _ => Failure::Task(status.message().to_string()),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Dead(e) => write!(f, "worker died: {e}"),
            Failure::Task(e) => write!(f, "{e}"),
            Failure::Garbage(e) => write!(f, "worker sent garbage: {e}"),
            Failure::Stuck(e) => write!(f, "{e}"),
            Failure::Driver(e) => write!(f, "{e}"),
            Failure::Refused(e) => write!(f, "refused: {e}"),
        }
    }
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

    /// Ping every live worker at once; one that does not answer in time (hung, its process
    /// gone, its host cut off) is marked dead, and killed when this driver started it.
    async fn heartbeat(&self) {
        let workers = self.workers().await;
        let timeout = self.settings.timeouts.heartbeat;
        let pings = workers.iter().filter(|w| w.is_alive()).map(|w| async move {
            if !w.ping(timeout).await && w.is_alive() {
                log::warn!(
                    "flumen worker {} (pid {}) missed its heartbeat",
                    w.address,
                    w.pid
                );
                w.mark_dead();
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
            } else if !worker.counted_lost.swap(true, Ordering::Relaxed) {
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
            if worker.left.swap(leaving, Ordering::Relaxed) != leaving {
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
                        if !worker.is_alive() && !worker.replacing.swap(true, Ordering::Relaxed) {
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
                self.workers.lock().await[slot] = worker;
                self.restarted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                log::warn!("{e}");
                *self.last_start_error.lock().unwrap() = Some(e.to_string());
                // Let the next pick try again.
                if let Some(dead) = self.workers.lock().await.get(slot) {
                    dead.replacing.store(false, Ordering::Relaxed);
                }
            }
        }
    }

    /// Run a task on some worker (`prefer`: the host holding most of its inputs, see
    /// [`Self::pick`]), retrying on another one when a worker dies under it or the task
    /// makes no progress for the task timeout there (at most `max_retries` times).
    /// Each block is handed to `on_block` as `(n, block)` as soon as its worker announces
    /// it, `n` counting from 0 in each attempt (a retry hands out the same blocks again, each
    /// output partition's in the same order: the caller keeps the first of each). Returns the
    /// retries it took and the address of the worker it ran on. `describe` names the task in
    /// errors.
    pub async fn run_task(
        self: &Arc<Self>,
        plan: &[u8],
        request: &TaskRequest,
        max_retries: usize,
        describe: &str,
        prefer: Option<&str>,
        on_block: &mut (dyn FnMut(usize, RemoteBlock) -> Result<()> + Send),
    ) -> Result<TaskRan> {
        let mut attempt = 0;
        loop {
            let worker = self.pick(prefer).await?;
            let _busy = worker.busy();
            let mut seq = 0;
            let mut hand_out = |info| {
                let block = RemoteBlock {
                    worker: Arc::clone(&worker),
                    info,
                    query: request.query.clone(),
                };
                seq += 1;
                on_block(seq - 1, block)
            };
            let deadline = self.settings.timeouts.task;
            let attempt_result = worker.run(plan, request, deadline, &mut hand_out).await;
            match attempt_result.map_err(|f| worker.classify(f)) {
                Ok(metrics) => {
                    return Ok(TaskRan {
                        retries: attempt,
                        worker: worker.address.clone(),
                        metrics,
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

    /// Fetch a remote block; `None` when its worker is gone (the block is lost).
    pub async fn fetch(block: &RemoteBlock) -> Result<Option<RecordBatch>> {
        if !block.worker.is_alive() {
            return Ok(None);
        }
        match block
            .worker
            .fetch(&block.query, &block.info.key)
            .await
            .map_err(|f| block.worker.classify(f))
        {
            Ok(batch) => Ok(Some(batch)),
            Err(Failure::Dead(_)) => {
                block.worker.mark_dead();
                Ok(None)
            }
            Err(e) => Err(DataFusionError::Execution(format!(
                "fetching block {} from worker {}: {e}",
                block.info.key, block.worker.address
            ))),
        }
    }

    /// Tell a block's worker it may drop it (in the background).
    pub fn release(block: RemoteBlock) {
        if block.worker.is_alive() {
            let runtime = block.worker.runtime.clone();
            runtime.spawn(async move {
                let keys = vec![block.info.key.clone()];
                block.worker.release(&block.query, keys).await
            });
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

/// The thread-pool sizes of numeric libraries (OpenMP, OpenBLAS, MKL, numexpr) that a
/// worker gets, unless the driver's environment sets them: each library starts a thread per
/// core by default, so N workers on a host would run N times the cores' threads, and
/// OpenBLAS's spinning threads made a numpy model in two workers on two cores 2.5x slower
/// than in one (Ray sets `OMP_NUM_THREADS` for its workers for the same reason).
pub const THREAD_POOL_VARIABLES: &[&str] = &[
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
];

/// Start one worker process of `program` on this host (speaking TLS with this driver's
/// own certificate when `tls`), the `slot`-th of the `pool_size` of its pool, and connect to
/// it. Its numeric libraries get the pool's share of the host's cores
/// ([`THREAD_POOL_VARIABLES`]); an accelerator worker is told its slot (`--device-slot`), so
/// the pool's workers take the host's GPUs in turn.
async fn spawn_worker(
    program: &WorkerProgram,
    tls: bool,
    kind: Pool,
    slot: usize,
    pool_size: usize,
) -> Result<Arc<WorkerHandle>> {
    let threads = (crate::config::available_cores() / pool_size.max(1)).max(1);
    let binary = &program.executable;
    let tls = tls.then(local_tls).transpose()?;
    let fail = |why: String| {
        DataFusionError::Execution(format!(
            "cannot start flumen worker {}: {why}",
            binary.display()
        ))
    };
    let mut command = std::process::Command::new(binary);
    command
        .args(&program.leading_args)
        .args([
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--pool",
            kind.as_str(),
            "--secret-stdin",
        ])
        .args(tls.is_some().then_some("--tls-stdin"))
        .args(match kind {
            Pool::Accelerator => vec!["--device-slot".to_string(), slot.to_string()],
            Pool::Cpu => vec![],
        })
        .env_clear()
        .envs(
            WORKER_ENVIRONMENT
                .iter()
                .filter_map(|name| Some((name, std::env::var_os(name)?))),
        )
        .envs(THREAD_POOL_VARIABLES.iter().map(|name| {
            let value = std::env::var_os(name).unwrap_or_else(|| threads.to_string().into());
            (name, value)
        }))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = command.spawn().map_err(|e| fail(e.to_string()))?;
    // The secret (and the TLS identity) go down the pipe; the pipe stays open while the
    // driver lives.
    let mut handed = format!("{}\n", driver_secret().to_hex());
    if let Some(tls) = tls {
        // Its identity, then the CA its peers' certificates chain to.
        handed.push_str(&tls.identity.to_text());
        handed.push_str(&tls.trust.to_text());
    }
    let sent = child
        .stdin
        .as_mut()
        .expect("piped stdin")
        .write_all(handed.as_bytes());
    if let Err(e) = sent {
        let _ = child.kill();
        let status = child.wait().ok();
        // A program that is not a worker may print something and exit before the secret
        // is written: say what it printed, as when it prints before taking the secret.
        let mut printed = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut printed);
        }
        return Err(fail(match printed.lines().next() {
            Some(first) => format!(
                "it printed {first:?} instead of its address, and did not take the secret on \
                 stdin ({e}; exit status {status:?})"
            ),
            None => format!("it did not take the secret on stdin ({e}; exit status {status:?})"),
        }));
    }
    let stdout = child.stdout.take().expect("piped stdout");
    // A thread reads its output: the first line is its address, the rest is drained so the
    // pipe never fills.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(stdout).lines();
        let _ = first_tx.send(lines.next().transpose());
        for _ in lines.map_while(|l| l.ok()) {}
    });
    let first = match tokio::time::timeout(START_TIMEOUT, first_rx).await {
        Ok(Ok(Ok(line))) => line,
        Ok(Ok(Err(e))) => return Err(fail(e.to_string())),
        Ok(Err(_)) => None,
        Err(_) => {
            let _ = child.kill();
            return Err(fail(format!(
                "it printed no address within {START_TIMEOUT:?}"
            )));
        }
    };
    let address = match first
        .as_deref()
        .and_then(|l| l.strip_prefix("flumen worker listening on "))
    {
        Some(address) => address.trim().to_string(),
        None => {
            let _ = child.kill();
            let status = child.wait().ok();
            return Err(fail(format!(
                "it printed {:?} instead of its address (exit status {status:?})",
                first.unwrap_or_default()
            )));
        }
    };
    let trust = tls.map(|tls| &tls.trust);
    let (client, announced) = match introduce(&address, trust, driver_secret()).await {
        Ok(introduced) => introduced,
        Err(DataFusionError::Execution(why)) | Err(DataFusionError::Configuration(why)) => {
            let _ = child.kill();
            return Err(fail(why));
        }
        Err(e) => {
            let _ = child.kill();
            return Err(fail(e.to_string()));
        }
    };
    Ok(new_handle(
        address,
        announced,
        kind,
        client,
        trust.is_some(),
        Some(child),
    ))
}

/// Connect to the worker at `address` and read its status with this driver's hello: a
/// program that does not answer as a flumen worker, or a worker of another protocol, is
/// refused here.
async fn introduce(
    address: &str,
    trust: Option<&WorkerTrust>,
    secret: &Secret,
) -> Result<(Client, WorkerStatus)> {
    let client = connect(address, trust, secret).await?;
    let status = read_status(&client).await.map_err(|e| {
        DataFusionError::Execution(match e {
            Failure::Refused(why) => format!(
                "worker {address} refused this driver ({why}): the secret in \
                 flumen.cluster_secret_file is not the one the worker was started with"
            ),
            Failure::Task(why) if why.contains("worker protocol") => why,
            other => format!("{address} does not answer as a flumen worker: {other}"),
        })
    })?;
    if status.protocol != PROTOCOL_VERSION {
        return Err(DataFusionError::Execution(format!(
            "worker {address} (flumen {}) speaks worker protocol {}, this driver (flumen {}) \
             protocol {PROTOCOL_VERSION}: run the same flumen version on the driver and its \
             workers",
            if status.version.is_empty() {
                "of an older version"
            } else {
                &status.version
            },
            status.protocol,
            env!("CARGO_PKG_VERSION"),
        )));
    }
    Ok((client, status))
}

/// The handle of a worker that answered, numbered anew.
fn new_handle(
    address: String,
    announced: WorkerStatus,
    kind: Pool,
    client: Client,
    tls: bool,
    child: Option<std::process::Child>,
) -> Arc<WorkerHandle> {
    static SERIAL: AtomicU64 = AtomicU64::new(1);
    Arc::new(WorkerHandle {
        address,
        pid: announced.pid,
        announced,
        serial: SERIAL.fetch_add(1, Ordering::Relaxed),
        running: AtomicUsize::new(0),
        counted_lost: false.into(),
        left: false.into(),
        kind,
        tls,
        client,
        alive: tokio::sync::watch::Sender::new(true),
        replacing: false.into(),
        runtime: tokio::runtime::Handle::current(),
        child: Mutex::new(child),
        death: Mutex::new(None),
    })
}

/// Attach to the running worker at `address` of `cluster`; `None` when it serves another
/// pool than `kind`.
async fn attach_worker(
    address: &str,
    cluster: &ClusterSettings,
    secret: &Secret,
    trust: Option<&WorkerTrust>,
    kind: Pool,
) -> Result<Option<Arc<WorkerHandle>>> {
    cluster.check_reachable(address)?;
    let (client, announced) = introduce(address, trust, secret).await?;
    if announced.kind != kind {
        return Ok(None);
    }
    Ok(Some(new_handle(
        address.to_string(),
        announced,
        kind,
        client,
        trust.is_some(),
        None,
    )))
}

/// Attach to every worker of `kind` the cluster lists now; an error naming what each
/// address said when none could be.
async fn attach_all(
    cluster: &ClusterSettings,
    secret: &Secret,
    trust: Option<&WorkerTrust>,
    kind: Pool,
) -> Result<Vec<Arc<WorkerHandle>>> {
    let addresses = cluster.spec.addresses().await?;
    let attempts = addresses.iter().map(|address| async move {
        let attached = tokio::time::timeout(
            START_TIMEOUT / 2,
            attach_worker(address, cluster, secret, trust, kind),
        )
        .await;
        match attached {
            Ok(result) => result,
            Err(_) => Err(DataFusionError::Execution(format!(
                "{address} did not answer within {:?}",
                START_TIMEOUT / 2
            ))),
        }
    });
    let results = futures::future::join_all(attempts).await;
    let mut attached = vec![];
    let mut reasons = vec![];
    for (address, result) in addresses.iter().zip(results) {
        match result {
            Ok(Some(worker)) => attached.push(worker),
            Ok(None) => {}
            Err(e) => {
                log::warn!("flumen worker {address} not attached: {e}");
                reasons.push(match e {
                    DataFusionError::Execution(why) | DataFusionError::Configuration(why) => why,
                    other => other.to_string(),
                });
            }
        }
    }
    if attached.is_empty() {
        return Err(DataFusionError::Execution(format!(
            "the cluster has no {} worker that answers ({} address(es) listed){}{}",
            kind.as_str(),
            addresses.len(),
            if reasons.is_empty() { "" } else { ": " },
            reasons.join("; ")
        )));
    }
    Ok(attached)
}

/// A Flight client of the worker at `address` (`host:port`) that presents `secret` on
/// every call; in TLS, checking the worker's certificate against `trust`, when given.
pub async fn connect(
    address: &str,
    trust: Option<&WorkerTrust>,
    secret: &Secret,
) -> Result<Client> {
    let scheme = if trust.is_some() { "https" } else { "http" };
    let mut endpoint = Channel::from_shared(format!("{scheme}://{address}"))
        .map_err(|e| DataFusionError::Execution(format!("bad worker address {address}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        // A peer that stops answering (a frozen process, a cut link) fails the calls on
        // it within seconds instead of holding them until the task timeout.
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    if let Some(trust) = trust {
        endpoint = endpoint.tls_config(trust.client_config()).map_err(|e| {
            DataFusionError::Execution(format!("cannot use TLS with {address}: {e}"))
        })?;
    }
    let channel = endpoint.connect().await.map_err(|e| {
        DataFusionError::Execution(format!(
            "cannot connect to {address}: {}",
            crate::error_chain(&e)
        ))
    })?;
    Ok(
        FlightServiceClient::with_interceptor(channel, SendSecret::new(secret))
            .max_decoding_message_size(MAX_TASK_BYTES)
            .max_encoding_message_size(MAX_TASK_BYTES),
    )
}

/// Read the block `ticket` names from the worker behind `client` (`do_get`).
pub(crate) async fn get_block(
    client: &Client,
    ticket: BlockTicket,
) -> Result<RecordBatch, Failure> {
    let mut client = client.clone();
    let key = ticket.key.clone();
    let ticket = Ticket {
        ticket: serde_json::to_vec(&ticket).unwrap().into(),
    };
    let reply = client.do_get(ticket).await.map_err(Failure::from)?;
    let stream = FlightRecordBatchStream::new_from_flight_data(
        reply
            .into_inner()
            .map_err(arrow_flight::error::FlightError::from),
    );
    let batches: Vec<RecordBatch> = stream.try_collect().await.map_err(|e| {
        // A stream cut by the worker's death reads as a transport error.
        match e {
            arrow_flight::error::FlightError::Tonic(status) => Failure::from(*status),
            other => Failure::Garbage(other.to_string()),
        }
    })?;
    // Flight cuts a block larger than its message size into several batches.
    match batches.len() {
        0 => Err(Failure::Garbage(format!("block {key} came without rows"))),
        1 => Ok(batches.into_iter().next().unwrap()),
        _ => concat_batches(&batches[0].schema(), &batches)
            .map_err(|e| Failure::Garbage(format!("block {key}: {e}"))),
    }
}

/// The program worker processes run: an executable and the arguments that come before
/// `worker` (`-m flumen` when the executable is Python: the Python package's workers).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerProgram {
    /// The executable.
    pub executable: PathBuf,
    /// Its arguments before `worker ...`.
    pub leading_args: Vec<String>,
}

/// The program to start workers from: `flumen.worker_binary` (run as
/// `<binary> -m <module>` when `flumen.worker_module` names a Python module), else
/// `FLUMEN_WORKER_BIN`, else this process's own executable when it is the `flumen` binary.
pub fn worker_program(configured: &str, module: &str) -> Result<WorkerProgram> {
    let leading_args = match module {
        "" => vec![],
        module => vec!["-m".to_string(), module.to_string()],
    };
    let executable = if !configured.is_empty() {
        PathBuf::from(configured)
    } else if let Some(path) = std::env::var_os("FLUMEN_WORKER_BIN") {
        PathBuf::from(path)
    } else {
        let exe = std::env::current_exe()?;
        if exe.file_stem().is_none_or(|n| n != "flumen") {
            return Err(DataFusionError::Configuration(
                "flumen.workers = 'process' needs the flumen binary to start workers from: \
                 set flumen.worker_binary or FLUMEN_WORKER_BIN"
                    .into(),
            ));
        }
        exe
    };
    Ok(WorkerProgram {
        executable,
        leading_args,
    })
}

/// How a task ran on a pool's worker.
#[derive(Debug)]
pub struct TaskRan {
    /// Attempts retried on another worker after theirs died or stuck.
    pub retries: usize,
    /// The address of the worker that ran it.
    pub worker: String,
    /// DataFusion's counters of its plan, carried back.
    pub metrics: Vec<PlanMetric>,
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
}

#[async_trait::async_trait]
impl HeldBlock for RemoteBlock {
    fn holder_pid(&self) -> u32 {
        self.worker.pid
    }

    fn holder_id(&self) -> u64 {
        self.worker.serial
    }

    fn holder_alive(&self) -> bool {
        self.worker.is_alive()
    }

    async fn fetch(&self) -> Result<Option<RecordBatch>> {
        WorkerPool::fetch(self).await
    }

    fn release(&self) {
        WorkerPool::release(self.clone());
    }

    fn location(&self) -> HeldAt {
        HeldAt {
            address: self.worker.address.clone(),
            tls: self.worker.tls,
            key: self.info.key.clone(),
        }
    }
}
