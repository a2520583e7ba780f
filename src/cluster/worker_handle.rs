//! The driver's handle of one worker ([`WorkerHandle`]): its calls (tasks, blocks,
//! releases, pings) that end at once when the worker is marked dead, its liveness, the
//! tasks it runs now, and the blocks it holds for the driver ([`RemoteBlock`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_flight::Action;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use futures::{StreamExt, TryStreamExt};

use crate::cluster::plan_metrics::TaskFigures;
use crate::cluster::protocol::{
    BlockTicket, FeedRequest, ReleaseRequest, RemoteBlockInfo, TaskEvent, TaskInput, TaskRequest,
    WorkerStatus, decode_event, encode_feed, encode_task,
};
use crate::cluster::sent_bounds::SentBound;
use crate::cluster::worker_client::{Client, Failure, action_on, get_block, read_status};
use crate::plan::graph::Pool;
use crate::store::block::{HeldAt, HeldBlock};

/// A block that lives in a worker process.
#[derive(Debug, Clone)]
pub struct RemoteBlock {
    /// The worker that holds it.
    pub worker: Arc<WorkerHandle>,
    /// What the worker said about it.
    pub info: RemoteBlockInfo,
    /// The query that owns it (its ticket names it).
    pub query: String,
    /// How its worker is asked to send it ([`BlockTicket::compression`]).
    pub compression: String,
}

/// A block a worker's task made, as the driver hears of it.
#[derive(Debug)]
pub enum WorkerBlock {
    /// It stays in the worker.
    Held(RemoteBlock),
    /// It came back with the task's reply ([`TaskEvent::Carried`]): what the worker said
    /// of it, and its rows.
    Carried(RemoteBlockInfo, RecordBatch),
}

/// Blocks a driver feeds one in-memory source of a running task at once
/// ([`TaskRequest::feed`]).
pub struct Fed {
    /// The source ([`TaskRequest::fed_sources`]).
    pub source: usize,
    /// The blocks, in order: tickets, or [`TaskInput::Inline`] indices into `inline`.
    pub inputs: Vec<TaskInput>,
    /// The blocks that travel with the message.
    pub inline: Vec<RecordBatch>,
}

/// What a fed task is fed: for each attempt, a fresh stream of [`Fed`] messages from its
/// first block on, which ends once every fed source has all its blocks.
pub type TaskFeed<'a> =
    &'a (dyn Fn() -> futures::stream::BoxStream<'static, Result<Fed>> + Send + Sync);

/// How long a worker has to answer a ping before it counts as dead, by default
/// (`flumen.heartbeat_timeout_secs`' default; a pool gives its workers its own,
/// [`WorkerHandle::set_ping_timeout`]).
pub(crate) const DEFAULT_PING_TIMEOUT: Duration = Duration::from_secs(2);

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
    /// Its loss has been counted in its pool's [`crate::cluster::worker_pool::MembershipCounts`].
    counted_lost: std::sync::atomic::AtomicBool,
    /// Its address is no longer in the cluster's list: it gets no new task (blocks it holds
    /// are still read from it, and released as ever).
    left: std::sync::atomic::AtomicBool,
    /// The runtime its background calls run on (the one it was started from).
    runtime: tokio::runtime::Handle,
    child: Mutex<Option<std::process::Child>>,
    /// Why the driver stopped it, when it did so itself (a stuck task).
    death: Mutex<Option<String>>,
    /// How long, in milliseconds, it has to answer a ping after a call to it broke before
    /// it counts as dead: its pool's heartbeat timeout.
    ping_timeout_ms: AtomicU64,
    /// Heartbeats it has missed since it last answered one.
    missed_heartbeats: std::sync::atomic::AtomicU32,
    /// Blocks the driver let go of that the worker has not been told of yet
    /// ([`Self::release_later`]).
    releases: Mutex<PendingReleases>,
}

/// The keys of blocks a worker may drop, gathered while a `release` call is on its way: one
/// call carries all that came in meanwhile. With a call per block, TPC-H SF1 q21 (~1,780
/// blocks, ~940 of them let go of as its last join ends) took 25-43 ms for its last stage
/// (817 rows) beside those calls, and 2-4 ms with them gathered.
#[derive(Debug, Default)]
struct PendingReleases {
    /// Keys per query, in the order they were let go.
    keys: BTreeMap<String, Vec<String>>,
    /// A call is being made (its task sends what gathers until none is left).
    sending: bool,
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

    /// Give it its pool's heartbeat timeout: how long it has to answer a ping after a
    /// call to it broke before it counts as dead.
    pub(crate) fn set_ping_timeout(&self, timeout: Duration) {
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        self.ping_timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// How long it has to answer a ping after a call to it broke: its pool's heartbeat
    /// timeout (`flumen.heartbeat_timeout_secs`).
    pub fn ping_timeout(&self) -> Duration {
        Duration::from_millis(self.ping_timeout_ms.load(Ordering::Relaxed))
    }

    /// Count a heartbeat it `answered` or missed; returns how many it has missed in a row.
    pub(crate) fn count_heartbeat(&self, answered: bool) -> u32 {
        match answered {
            true => {
                self.missed_heartbeats.store(0, Ordering::Relaxed);
                0
            }
            false => self.missed_heartbeats.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }

    /// Whether its address left the cluster's list (it then gets no new task).
    pub fn has_left(&self) -> bool {
        self.left.load(Ordering::Relaxed)
    }

    /// Tasks it runs at once (as it announced, at least 1).
    pub fn slots(&self) -> usize {
        self.announced.slots.max(1)
    }

    /// Count its loss once: `true` the first time it is asked after the worker died.
    pub(crate) fn count_loss_once(&self) -> bool {
        !self.is_alive() && !self.counted_lost.swap(true, Ordering::Relaxed)
    }

    /// Mark whether its address left the cluster's list; `true` when that changed.
    pub(crate) fn set_left(&self, leaving: bool) -> bool {
        self.left.swap(leaving, Ordering::Relaxed) != leaving
    }

    /// Claim the start of its replacement (it is dead): `true` for the one caller that may
    /// start it, until [`Self::replacement_failed`].
    pub(crate) fn claim_replacement(&self) -> bool {
        !self.is_alive() && !self.replacing.swap(true, Ordering::Relaxed)
    }

    /// Its replacement failed to start: the next claim may try again.
    pub(crate) fn replacement_failed(&self) {
        self.replacing.store(false, Ordering::Relaxed);
    }

    /// Tasks this driver is running on it now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Count a task as running on it until the guard drops.
    pub(crate) fn busy(self: &Arc<Self>) -> Busy {
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
    pub(crate) async fn ping(&self, timeout: Duration) -> bool {
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
    pub(crate) fn classify(&self, failure: Failure) -> Failure {
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
    pub(crate) fn stop_because(&self, reason: String) {
        self.death.lock().unwrap().get_or_insert(reason);
        self.mark_dead();
    }

    pub(crate) fn mark_dead(&self) {
        if self.alive.send_replace(false) {
            log::warn!("flumen worker {} (pid {}) died", self.address, self.pid);
        }
        self.kill_child();
    }

    /// Take the worker down on purpose (its pool is dropped with its session): no warning.
    /// A process this driver started is let go ([`let_go`]): it removes its spill
    /// directory as it exits.
    pub(crate) fn shut_down(&self) {
        self.alive.send_replace(false);
        let_go(self.child.lock().unwrap().take());
    }

    /// Kill the worker's process, if this driver started it.
    fn kill_child(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            // Reap it off this thread.
            std::thread::spawn(move || reap(child));
        }
    }

    /// Run a task (`plan`, encoded with datafusion-proto), handing each block it leaves
    /// here to `on_block` as soon as the worker announces it, and the bounds it tightens
    /// meanwhile to `on_bounds`; returns the counters of its plan the worker carried back.
    /// With a `deadline`, a task that goes that long without a sign of progress (a block,
    /// rows of output, its plan's work or bounds: [`crate::cluster::task_watch`]) fails as
    /// [`Failure::Stuck`].
    pub(crate) async fn run(
        &self,
        plan: &[u8],
        request: &TaskRequest,
        deadline: Option<Duration>,
        on_block: &mut (dyn FnMut(RemoteBlockInfo, Option<RecordBatch>) -> Result<()> + Send),
        on_bounds: &mut (dyn FnMut(Vec<SentBound>) + Send),
        feed: Option<TaskFeed<'_>>,
    ) -> Result<TaskFigures, Failure> {
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
            // Fed from now on (the worker opened the feed before it answered). While the
            // feed is open the task may wait on its producers, so the deadline waits too.
            let mut feeding = feed.map(|make| Box::pin(self.send_feed(request, make())));
            loop {
                let event = match feeding.as_mut() {
                    Some(sending) => tokio::select! {
                        sent = sending => {
                            // The feed is over (its end sent, or the task took no more).
                            sent?;
                            feeding = None;
                            continue;
                        }
                        event = events.next() => event,
                    },
                    None => within(deadline, events.next(), stuck).await?,
                };
                let Some(event) = event else {
                    return Err(Failure::Garbage(
                        "the reply ended before the task did".into(),
                    ));
                };
                let (event, carried) = decode_event(&event?.body).map_err(Failure::Garbage)?;
                match event {
                    TaskEvent::Block(info) => on_block(info, None).map_err(Failure::Driver)?,
                    TaskEvent::Carried(info) => {
                        on_block(info, carried).map_err(Failure::Driver)?;
                    }
                    TaskEvent::Progress { .. } => {}
                    TaskEvent::Bounds { bounds } => on_bounds(bounds),
                    TaskEvent::Done {
                        metrics,
                        model,
                        bounds,
                        build_keys,
                        ..
                    } => {
                        return Ok(TaskFigures {
                            plan: metrics,
                            model,
                            bounds,
                            build_keys,
                        });
                    }
                }
            }
        };
        self.call(run).await
    }

    /// Send a running task what `fed` feeds it, a message at a time, then the feed's end;
    /// stops early when the task takes no more (it ended, its limit met).
    async fn send_feed(
        &self,
        request: &TaskRequest,
        mut fed: futures::stream::BoxStream<'static, Result<Fed>>,
    ) -> Result<(), Failure> {
        let mut message = FeedRequest {
            query: request.query.clone(),
            feed: request.feed.clone(),
            ..Default::default()
        };
        while let Some(next) = fed.next().await {
            let next = next.map_err(Failure::Driver)?;
            message.source = next.source;
            message.inputs = next.inputs;
            let body = encode_feed(&message, &next.inline).map_err(Failure::Driver)?;
            if !self.action::<bool>("feed", body).await? {
                return Ok(());
            }
        }
        message.inputs.clear();
        message.end = true;
        let body = encode_feed(&message, &[]).map_err(Failure::Driver)?;
        self.action::<bool>("feed", body).await?;
        Ok(())
    }

    /// Fetch a block of query `query`, removing it from the worker unless `keep`.
    async fn fetch(
        &self,
        query: &str,
        key: &str,
        compression: &str,
        keep: bool,
    ) -> Result<RecordBatch, Failure> {
        let ticket = BlockTicket {
            query: query.into(),
            key: key.into(),
            keep,
            compression: compression.into(),
        };
        self.call(get_block(&self.client, ticket)).await
    }

    /// Tell the worker, in the background, that it may drop block `key` of `query`: with the
    /// other blocks let go of until a call is free ([`PendingReleases`]).
    fn release_later(self: &Arc<Self>, query: &str, key: String) {
        let start = {
            let mut pending = self.releases.lock().unwrap();
            match pending.keys.get_mut(query) {
                Some(keys) => keys.push(key),
                None => drop(pending.keys.insert(query.to_string(), vec![key])),
            }
            !std::mem::replace(&mut pending.sending, true)
        };
        if start {
            let worker = Arc::clone(self);
            self.runtime.spawn(async move {
                loop {
                    let gathered = {
                        let mut pending = worker.releases.lock().unwrap();
                        if pending.keys.is_empty() {
                            pending.sending = false;
                            return;
                        }
                        std::mem::take(&mut pending.keys)
                    };
                    for (query, keys) in gathered {
                        // Never empty: an empty list would drop all of the query's blocks.
                        if !keys.is_empty() {
                            worker.release(&query, keys).await;
                        }
                    }
                }
            });
        }
    }

    /// Drop blocks of `query` the driver no longer needs, all of them when `keys` is empty
    /// (best effort).
    pub(crate) async fn release(&self, query: &str, keys: Vec<String>) {
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
pub(crate) struct Busy(Arc<WorkerHandle>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for WorkerHandle {
    /// A handle nobody holds any more (a pool that failed half-way through its start, a
    /// replaced worker) takes its process down with it.
    fn drop(&mut self) {
        let_go(self.child.get_mut().unwrap().take());
    }
}

/// How long a worker this driver let go may take to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// Wait for a worker process this driver killed, then remove the spill directory it could
/// not remove itself (a killed worker's is otherwise left until the next worker on the host
/// spills).
fn reap(mut child: std::process::Child) {
    let _ = child.wait();
    let removed = crate::cluster::block_shelf::remove_spills_of_ended_workers();
    if removed > 0 {
        log::info!(
            "removed {removed} spill directories of ended workers after worker pid {} was killed",
            child.id()
        );
    }
}

/// Let a worker process this driver started go: its stdin closes, so it exits by itself as
/// it would when the driver dies, its spill directory removed first; one still running
/// after [`EXIT_GRACE`] is killed, and its directory removed for it ([`reap`]). A SIGKILL
/// at once, as before, left the directory of every worker that had spilled in the temp
/// directory for good.
fn let_go(child: Option<std::process::Child>) {
    let Some(mut child) = child else {
        return;
    };
    drop(child.stdin.take());
    std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + EXIT_GRACE;
        while std::time::Instant::now() < deadline {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        reap(child);
    });
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

/// The handle of a worker that answered, numbered anew.
pub(crate) fn new_handle(
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
        ping_timeout_ms: AtomicU64::new(DEFAULT_PING_TIMEOUT.as_millis() as u64),
        missed_heartbeats: 0.into(),
        releases: Mutex::new(PendingReleases::default()),
    })
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

    /// The block; `None` when its worker is gone (the block is lost).
    async fn fetch(&self) -> Result<Option<RecordBatch>> {
        self.fetch_keeping(false).await
    }

    /// The block, left with its worker; `None` when its worker is gone.
    async fn read(&self) -> Result<Option<RecordBatch>> {
        self.fetch_keeping(true).await
    }

    /// Tell its worker it may drop it (in the background).
    fn release(&self) {
        if self.worker.is_alive() {
            (self.worker).release_later(&self.query, self.info.key.clone());
        }
    }

    fn location(&self) -> HeldAt {
        HeldAt {
            address: self.worker.address.clone(),
            tls: self.worker.tls,
            key: self.info.key.clone(),
        }
    }
}

impl RemoteBlock {
    /// The block, removed from its worker unless `keep`; `None` when its worker is gone
    /// (the block is lost).
    async fn fetch_keeping(&self, keep: bool) -> Result<Option<RecordBatch>> {
        if !self.worker.is_alive() {
            return Ok(None);
        }
        match (self.worker)
            .fetch(&self.query, &self.info.key, &self.compression, keep)
            .await
            .map_err(|f| self.worker.classify(f))
        {
            Ok(batch) => Ok(Some(batch)),
            Err(Failure::Dead(_)) => {
                self.worker.mark_dead();
                Ok(None)
            }
            // A killed worker's socket closes a moment before its process counts as exited,
            // and gRPC may report the broken call as an internal error: a worker that does
            // not answer a ping now is dead, and the block lost (recomputed), not an error.
            Err(Failure::Task(_) | Failure::Garbage(_))
                if !self.worker.ping(self.worker.ping_timeout()).await =>
            {
                self.worker.mark_dead();
                Ok(None)
            }
            Err(e) => Err(DataFusionError::Execution(format!(
                "fetching block {} from worker {}: {e}",
                self.info.key, self.worker.address
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::auth::Secret;

    /// A worker's handle over `client`, and one block it holds.
    fn worker_and_block(address: String, client: Client) -> (Arc<WorkerHandle>, RemoteBlock) {
        let worker = new_handle(
            address,
            WorkerStatus::default(),
            Pool::Cpu,
            client,
            false,
            None,
        );
        let block = RemoteBlock {
            worker: Arc::clone(&worker),
            info: RemoteBlockInfo {
                key: "k".into(),
                tag: 0,
                rows: 1,
                bytes: 8,
                digest: None,
            },
            query: "q".into(),
            compression: String::new(),
        };
        (worker, block)
    }

    #[tokio::test]
    async fn a_block_whose_holder_broke_the_call_and_is_gone_is_lost_not_an_error() {
        // A holder that resets the block's stream and then is gone, as a worker killed
        // mid-fetch can look before its process counts as exited.
        let (address, holder) = crate::cluster::worker_client::peer_resetting_one_call().await;
        let client = crate::cluster::worker_client::connect(&address, None, &Secret::random())
            .await
            .unwrap();
        let (worker, block) = worker_and_block(address, client);
        let fetched = block.fetch().await;
        holder.await.unwrap();
        assert!(
            matches!(fetched, Ok(None)),
            "the block is lost, to be recomputed: {fetched:?}"
        );
        assert!(!worker.is_alive(), "its holder counts as dead");
    }

    /// One slow heartbeat does not make a worker hung: misses count in a row, and an
    /// answer starts the count again.
    #[tokio::test]
    async fn missed_heartbeats_count_in_a_row() {
        use crate::cluster::worker_pool::MISSED_HEARTBEATS;
        let channel = tonic::transport::Channel::from_static("http://127.0.0.1:9").connect_lazy();
        let secret = crate::cluster::auth::SendSecret::new(&Secret::random());
        let client = arrow_flight::flight_service_client::FlightServiceClient::with_interceptor(
            channel, secret,
        );
        let (worker, _) = worker_and_block("127.0.0.1:9".into(), client);
        assert_eq!(worker.count_heartbeat(false), 1);
        assert_eq!(worker.count_heartbeat(true), 0);
        for missed in 1..=MISSED_HEARTBEATS {
            assert_eq!(worker.count_heartbeat(false), missed);
        }
    }

    #[tokio::test]
    async fn a_holder_that_broke_the_call_has_its_pools_heartbeat_timeout_to_answer_a_ping() {
        // A holder that resets the block's stream, then takes the ping's stream and never
        // answers it (hung): it counts as dead once its pool's heartbeat timeout (here
        // 100 ms) has passed, not the default's 2 s.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let holder = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            let mut connection = h2::server::handshake(socket).await.unwrap();
            let (_fetch, mut respond) = connection.accept().await.unwrap().unwrap();
            respond.send_reset(h2::Reason::PROTOCOL_ERROR);
            // The ping: taken, never answered, until the test is done.
            let _ping = connection.accept().await;
            let _ = tokio::time::timeout(Duration::from_secs(10), async {
                tokio::select! {
                    _ = connection.accept() => {}
                    _ = done_rx => {}
                }
            })
            .await;
        });
        let client = crate::cluster::worker_client::connect(&address, None, &Secret::random())
            .await
            .unwrap();
        let (worker, block) = worker_and_block(address, client);
        assert_eq!(worker.ping_timeout(), DEFAULT_PING_TIMEOUT);
        worker.set_ping_timeout(Duration::from_millis(100));
        let started = std::time::Instant::now();
        let fetched = block.fetch().await;
        let waited = started.elapsed();
        let _ = done_tx.send(());
        holder.await.unwrap();
        assert!(
            matches!(fetched, Ok(None)),
            "the block is lost: {fetched:?}"
        );
        assert!(!worker.is_alive(), "its hung holder counts as dead");
        assert!(
            waited < DEFAULT_PING_TIMEOUT,
            "the ping waited {waited:?}: the pool's 100 ms, not the default {DEFAULT_PING_TIMEOUT:?}"
        );
    }
}
