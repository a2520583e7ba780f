//! A flumen worker process (`flumen worker`): runs CPU tasks sent by a driver and keeps the
//! blocks they produce until the driver's consumers fetch them.
//!
//! It speaks Arrow Flight over gRPC on a TCP address (`host:port`, so workers can live on
//! other hosts), in TLS when it has an identity, which it must off loopback
//! ([`crate::cluster::tls`]). Every call must carry the driver's secret
//! ([`crate::cluster::auth`]):
//! - `handshake`: the secret in, a session token out (usable in place of the secret).
//! - action `run`: a task, as a [`crate::cluster::protocol::TaskRequest`] header and a DataFusion physical plan encoded
//!   with `datafusion-proto`. The worker checks it against what it runs
//!   ([`crate::cluster::admission`]: flumen's node types, granted files, task settings),
//!   runs every output partition of the plan, cuts the output into blocks of at most
//!   `target_rows` rows ([`crate::cluster::worker_tasks`]) and keeps them under the task's
//!   query. Its reply is a stream of [`TaskEvent`]s: one per block as soon as it is cut (the
//!   output partition is the block's tag), progress while output flows, then `Done`. A task
//!   that panics fails alone: the worker lives on (an accelerator worker restarts its model
//!   thread).
//! - `do_get` with a [`BlockTicket`] (query and random 128-bit key): the block as Arrow IPC;
//!   the worker then drops it, unless the ticket says `keep` (another worker fetching a
//!   task's input: [`TaskInput::Fetch`]). A ticket of another query finds nothing.
//! - action `feed`: more input blocks for a running task that its request says is fed (a
//!   join's probe side, sent as its producers make it), or the feed's end
//!   ([`crate::cluster::protocol::FeedRequest`]); the reply says whether the task took them.
//! - action `release`: drop the listed blocks of a query, or all of them.
//! - action `ping`: liveness (the driver's heartbeat).
//! - action `status`: a [`WorkerStatus`] (tasks run, panics, models loaded, blocks held,
//!   functions known, runtimes whose shipped functions it unpacks).
//!
//! A worker serves one of the driver's pools ([`Pool`]): a CPU worker runs several
//! tasks at once; an accelerator worker runs its tasks one at a time on one thread, which
//! loads each model once and keeps it.
//!
//! A worker holds no state the driver cannot rebuild: when it dies, the driver re-runs the
//! producer tasks of the blocks it held, from their lineage. It does not outlive its driver:
//! one started by a driver exits when the driver's end of its stdin closes, one started by
//! hand when its lease runs out ([`WorkerSettings`]).

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::SessionContext;
use futures::{FutureExt, StreamExt, TryStreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::cluster::auth::{RequireSecret, Secret};
use crate::cluster::block_shelf::BlockShelf;
#[cfg(test)]
use crate::cluster::protocol::decode_event;
use crate::cluster::protocol::{
    BlockTicket, DeviceInfo, DriverHello, INPUT_LOST, InputTicket, MAX_TASK_BYTES, PROGRESS_EVERY,
    PROTOCOL_VERSION, ReleaseRequest, RemoteBlockInfo, TaskEvent, TaskInput, WorkerStatus,
    decode_task, exchange_compression, ticket_compression,
};
use crate::cluster::task_output::Produced;
use crate::cluster::tls::{TlsIdentity, WorkerTrust, require_tls_off_loopback};
use crate::cluster::worker_client::{Client, Failure, connect, get_block};
use crate::cluster::worker_memory::{TaskMemory, carried_task_limit};
use crate::cluster::worker_tasks::{
    FetchBlock, FetchedInputs, ModelJob, PANICKED, run_task, start_model_thread,
};
use crate::config::ExchangeCompression;
use crate::io::flight_data::{Dictionaries, flight_data};
use crate::plan::graph::Pool;

/// The first worker protocol whose workers check the driver's hello; older ones answer any
/// driver, which then refuses them on the protocol their status names.
const FIRST_PROTOCOL_CHECKING_DRIVERS: u32 = 4;

/// Refuse a driver whose hello (the body of its `status` call, when not empty) names another
/// worker protocol than `ours`.
fn check_driver(body: &[u8], ours: u32) -> std::result::Result<(), Status> {
    if body.is_empty() || ours < FIRST_PROTOCOL_CHECKING_DRIVERS {
        return Ok(());
    }
    let hello: DriverHello = serde_json::from_slice(body)
        .map_err(|e| Status::invalid_argument(format!("bad driver hello: {e}")))?;
    if hello.protocol != ours {
        log::warn!(
            "flumen worker: refused a driver of flumen {} (worker protocol {})",
            hello.version,
            hello.protocol
        );
        return Err(Status::failed_precondition(format!(
            "this worker (flumen {}) speaks worker protocol {ours}, the driver \
             (flumen {}) protocol {}: run the same flumen version on the driver and its workers",
            env!("CARGO_PKG_VERSION"),
            hello.version,
            hello.protocol
        )));
    }
    Ok(())
}

/// The Flight service of one worker process.
pub struct WorkerService {
    ctx: SessionContext,
    kind: Pool,
    /// The blocks its tasks left, until the driver fetches or releases them.
    shelf: Arc<BlockShelf>,
    tasks: AtomicU64,
    /// Tasks that panicked.
    panics: Arc<AtomicU64>,
    /// Accelerator workers: the one thread their tasks run on.
    model_thread: Option<std::sync::mpsc::Sender<ModelJob>>,
    /// CPU workers: the runtime their tasks run on, apart from the one serving calls, so a
    /// task that blocks its threads (a stuck function) leaves pings answered and the driver
    /// sees a live worker with a stuck task, which the task timeout handles.
    task_runtime: Option<tokio::runtime::Runtime>,
    /// Who may call (the secret, and the tokens the handshake issued).
    auth: RequireSecret,
    /// When a call last came (for the lease).
    last_call: Mutex<Instant>,
    /// Clients of the other workers it fetches task inputs from.
    peers: Arc<Peers>,
    /// Where its tasks' input blocks came from.
    input_reads: Arc<InputReads>,
    /// `release` calls it answered, and the blocks they named by key.
    releases: ReleaseCounts,
    /// The running tasks the driver feeds inputs to.
    feeds: Arc<Feeds>,
    /// Who it is and what it owns, as its status announces.
    identity: WorkerIdentity,
}

/// What a worker announces of itself besides its counters: fixed for its life.
#[derive(Debug, Clone)]
struct WorkerIdentity {
    /// Random, fresh at every start.
    id: String,
    /// Its host's name.
    host: String,
    /// Tasks it runs at once.
    slots: usize,
    /// Bytes of blocks it may keep.
    memory_budget: u64,
    /// The worker protocol it speaks.
    protocol: u32,
    /// The accelerators it computes on (probed once, at start).
    devices: Vec<DeviceInfo>,
}

impl WorkerIdentity {
    /// A fresh identity for a worker of `kind` run as `settings` say.
    fn new(kind: Pool, settings: &WorkerSettings) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            id: crate::cluster::block_shelf::random_key(),
            host: host_name(),
            slots: settings.slots.unwrap_or(match kind {
                Pool::Cpu => cores,
                Pool::Accelerator => 1,
            }),
            memory_budget: settings.memory_budget,
            protocol: settings.protocol,
            devices: devices(kind),
        }
    }
}

/// This host's name (`gethostname`), or `unknown`.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer outlives the call, which writes at most its length.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    match rc {
        0 => String::from_utf8_lossy(&buf[..end]).into_owned(),
        _ => "unknown".into(),
    }
}

/// The accelerators a worker of `kind` computes on: its CUDA devices (the one it is pinned
/// to, if it is), else its CPU.
fn devices(kind: Pool) -> Vec<DeviceInfo> {
    if kind != Pool::Accelerator {
        return vec![];
    }
    let cuda = crate::functions::accelerator_devices::visible_cuda_devices();
    if cuda == 0 {
        return vec![DeviceInfo {
            kind: "cpu".into(),
            index: 0,
        }];
    }
    // A worker pinned to one GPU (`--device`, `--device-slot`) owns that one only.
    let owned = match crate::functions::accelerator_devices::process_device(cuda) {
        Some(device) => device..device + 1,
        None => 0..cuda,
    };
    owned
        .map(|index| DeviceInfo {
            kind: "cuda".into(),
            index,
        })
        .collect()
}

/// The models installed where this worker looks for them: every complete model directory
/// beside the default one, and `FLUMEN_MODEL_DIR`'s.
fn installed_models() -> Vec<String> {
    use crate::functions::embedding::model_files::{check_model_dir, default_model_dir, model_dir};
    let mut dirs = vec![model_dir("")];
    if let Some(Ok(entries)) = default_model_dir().parent().map(std::fs::read_dir) {
        dirs.extend(entries.filter_map(|e| Some(e.ok()?.path())));
    }
    let mut models: Vec<String> = dirs
        .iter()
        .filter(|dir| check_model_dir(dir).is_ok())
        .filter_map(|dir| Some(dir.file_name()?.to_string_lossy().into_owned()))
        .collect();
    models.sort();
    models.dedup();
    models
}

impl WorkerService {
    /// A worker whose tasks run in `ctx` (which must know the functions the plans call),
    /// answering only callers that present `auth`'s secret; it fetches task inputs from
    /// other workers as `peers` says.
    fn new(
        ctx: SessionContext,
        kind: Pool,
        auth: RequireSecret,
        peers: Peers,
        identity: WorkerIdentity,
    ) -> Self {
        let model_thread = (kind == Pool::Accelerator).then(start_model_thread);
        let task_runtime = (kind == Pool::Cpu).then(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(identity.slots.max(1))
                .thread_name("flumen-task")
                .enable_all()
                .build()
                .expect("the task runtime starts")
        });
        Self {
            task_runtime,
            ctx,
            kind,
            shelf: Arc::new(BlockShelf::new(identity.memory_budget)),
            tasks: AtomicU64::new(0),
            panics: Arc::default(),
            input_reads: Arc::default(),
            releases: ReleaseCounts::default(),
            feeds: Arc::default(),
            model_thread,
            auth,
            last_call: Mutex::new(Instant::now()),
            peers: Arc::new(peers),
            identity,
        }
    }

    /// What this worker says of itself.
    pub fn status(&self) -> WorkerStatus {
        let state = self.ctx.state();
        let mut functions: Vec<String> = state.scalar_functions().keys().cloned().collect();
        functions.extend(state.aggregate_functions().keys().cloned());
        functions.extend(state.window_functions().keys().cloned());
        functions.sort();
        WorkerStatus {
            protocol: self.identity.protocol,
            version: env!("CARGO_PKG_VERSION").into(),
            id: self.identity.id.clone(),
            host: self.identity.host.clone(),
            slots: self.identity.slots,
            devices: self.identity.devices.clone(),
            memory_budget: self.identity.memory_budget,
            models: installed_models(),
            kind: self.kind,
            pid: std::process::id(),
            tasks: self.tasks.load(Ordering::Relaxed),
            task_panics: self.panics.load(Ordering::Relaxed),
            model_loads: crate::functions::accelerator::workers_loaded(),
            blocks_held: self.shelf.len(),
            block_bytes_in_memory: self.shelf.bytes_in_memory(),
            blocks_spilled: self.shelf.blocks_spilled(),
            inputs_held_here: self.input_reads.held_here.load(Ordering::Relaxed),
            inputs_from_peers: self.input_reads.from_peers.load(Ordering::Relaxed),
            input_bytes_from_peers: self.input_reads.bytes_from_peers.load(Ordering::Relaxed),
            release_calls: self.releases.calls.load(Ordering::Relaxed),
            released_by_key: self.releases.keys.load(Ordering::Relaxed),
            functions,
            runtimes: crate::cluster::shipped_functions::runtimes(),
        }
    }

    fn touch(&self) {
        *self.last_call.lock().unwrap() = Instant::now();
    }

    /// Decode a task, fetch its input blocks, and start it; its reply streams a
    /// [`TaskEvent`] per block as the task cuts it (the block kept under the task's query),
    /// progress, and its end. Dropping the reply stops a CPU task (the driver gave up).
    async fn run(&self, body: &[u8]) -> Result<FlightStream<arrow_flight::Result>> {
        self.tasks.fetch_add(1, Ordering::Relaxed);
        let (request, _) = decode_task(body).map_err(DataFusionError::Execution)?;
        let fetcher = InputFetcher {
            peers: Arc::clone(&self.peers),
            own: Arc::clone(&self.shelf),
            reads: Arc::clone(&self.input_reads),
            query: request.query.clone(),
            compression: exchange_compression(&request.options),
        };
        let (out, produced) = tokio::sync::mpsc::unbounded_channel();
        let mut feed = None;
        let stop = match (&self.model_thread, &self.task_runtime) {
            (Some(_), _) if !request.feed.is_empty() => {
                return Err(DataFusionError::Execution(
                    "an accelerator worker's task is not fed inputs while it runs".into(),
                ));
            }
            (Some(thread), _) => {
                // A model's bundle is small: fetched whole before the model thread takes it.
                let fetched = match &request.inputs {
                    Some(inputs) => fetcher.fetch_all(inputs).await?,
                    None => vec![],
                };
                thread
                    .send((body.to_vec(), fetched, self.ctx.clone(), out))
                    .map_err(|_| DataFusionError::Execution("the model thread is gone".into()))?;
                None
            }
            (None, Some(runtime)) => {
                let (body, ctx) = (body.to_vec(), self.ctx.clone());
                let memory = query_budget(&request.options).map(|budget| {
                    TaskMemory::new(
                        Arc::clone(&self.shelf),
                        &request.query,
                        budget,
                        self.identity.slots,
                        carried_task_limit(&request.options),
                    )
                });
                // Inputs that fit a quarter of the task's share are fetched at once, all
                // together (a round trip each, overlapped); larger ones as the plan reads
                // them, a few ahead.
                let inputs = request.inputs.as_deref().unwrap_or_default();
                let input_bytes: u64 = (inputs.iter())
                    .map(|input| match input {
                        TaskInput::Fetch(ticket) => ticket.bytes,
                        TaskInput::Inline(_) => 0,
                    })
                    .sum();
                let fetch_at_once = memory.as_ref().map_or(u64::MAX, |m| m.share / 4);
                // A fed task's fed sources are read as they come, whatever their size.
                let fetch_first = input_bytes <= fetch_at_once;
                let fetched = match (fetch_first, request.feed.is_empty()) {
                    (true, true) => FetchedInputs::Ready(fetcher.fetch_all(inputs).await?),
                    (first, _) => {
                        let ready = match first {
                            true => Some(fetcher.fetch_all(inputs).await?),
                            false => None,
                        };
                        let fetcher = Arc::new(fetcher);
                        let fetch: FetchBlock = Arc::new(move |ticket| {
                            let fetcher = Arc::clone(&fetcher);
                            async move { fetcher.fetch_one(&ticket).await }.boxed()
                        });
                        let (guard, fed) = self.feeds.open(&request);
                        feed = guard;
                        match ready {
                            Some(ready) => FetchedInputs::ReadyThenFed(ready, fetch, fed),
                            None => FetchedInputs::OnDemand(fetch, fed),
                        }
                    }
                };
                let handle = runtime.spawn(async move {
                    run_task(&body, fetched, memory, &ctx, &out).await;
                    // What the task freed goes back to the system (glibc's trim; jemalloc
                    // returns its pages on its own decay: a purge after every task sent
                    // the next tasks' allocations to fresh pages the kernel zeroes).
                    crate::store::freed_memory::return_freed_memory(false);
                });
                Some(AbortOnDrop(handle.abort_handle()))
            }
            (None, None) => unreachable!("a worker has a model thread or a task runtime"),
        };
        // The query's blocks stay within its budget here too (the rest spill).
        let query_budget = query_budget(&request.options).unwrap_or(u64::MAX);
        let reply = TaskReply {
            produced,
            shelf: Arc::clone(&self.shelf),
            panics: Arc::clone(&self.panics),
            query: request.query,
            query_budget,
            carry_left: request.carried_output_bytes,
            digests: self.kind == Pool::Cpu,
            blocks: 0,
            rows: 0,
            last_progress: Instant::now(),
            ended: false,
            _stop: stop,
            _feed: feed,
        };
        Ok(futures::stream::unfold(reply, |mut reply| async move {
            let event = reply.next_event().await?;
            Some((event, reply))
        })
        .boxed())
    }
}

/// A running task's reply: what it produces, turned into [`TaskEvent`]s as the driver
/// reads them.
struct TaskReply {
    produced: tokio::sync::mpsc::UnboundedReceiver<Produced>,
    shelf: Arc<BlockShelf>,
    panics: Arc<AtomicU64>,
    query: String,
    /// Bytes of the query's blocks this worker keeps in memory at most (its
    /// `flumen.memory_budget`).
    query_budget: u64,
    /// Bytes of output the reply may still carry ([`TaskEvent::Carried`]): a block that
    /// fits goes with it, and once one does not, every later block stays here.
    carry_left: u64,
    /// Whether its blocks carry a digest: a CPU task's do; a model's output differs in its
    /// last bits with how rows were batched, so a recomputed one is held to its row count.
    digests: bool,
    /// Blocks announced so far.
    blocks: usize,
    /// Output rows so far.
    rows: u64,
    /// When the last event went out.
    last_progress: Instant,
    /// The task's end has been told.
    ended: bool,
    /// Stops the task when the reply is dropped.
    _stop: Option<AbortOnDrop>,
    /// A fed task's feed, closed when the reply is dropped.
    _feed: Option<FeedOpen>,
}

impl TaskReply {
    /// The next event to send; `None` after the task's end was told.
    async fn next_event(&mut self) -> Option<std::result::Result<arrow_flight::Result, Status>> {
        if self.ended {
            return None;
        }
        loop {
            let mut carried = None;
            let event = match self.produced.recv().await {
                Some(Produced::Block(tag, batch)) => {
                    let (rows, bytes) = (batch.num_rows(), batch.get_array_memory_size() as u64);
                    let digest = self
                        .digests
                        .then(|| crate::store::block_digest::digest(&batch))
                        .flatten();
                    if self.carry_left > 0 && bytes <= self.carry_left {
                        self.carry_left -= bytes;
                        self.blocks += 1;
                        carried = Some(batch);
                        TaskEvent::Carried(RemoteBlockInfo {
                            key: String::new(),
                            tag,
                            rows,
                            bytes,
                            digest,
                        })
                    } else {
                        // Blocks come in order: none after this one is carried.
                        self.carry_left = 0;
                        match self.kept_event(batch, tag, rows, bytes, digest) {
                            Ok(event) => event,
                            Err(e) => return self.end_with(e),
                        }
                    }
                }
                Some(Produced::Rows(rows)) => {
                    self.rows = rows as u64;
                    if self.last_progress.elapsed() < PROGRESS_EVERY {
                        continue;
                    }
                    TaskEvent::Progress { rows: self.rows }
                }
                // Busy without output (a sort, an aggregate): progress all the same.
                Some(Produced::Advanced) => {
                    if self.last_progress.elapsed() < PROGRESS_EVERY {
                        continue;
                    }
                    TaskEvent::Progress { rows: self.rows }
                }
                // Also a sign of progress: a TopK or aggregate may send nothing else until
                // its input ends.
                Some(Produced::Bounds(bounds)) => TaskEvent::Bounds { bounds },
                Some(Produced::Finished(Ok(figures))) => {
                    self.ended = true;
                    TaskEvent::Done {
                        blocks: self.blocks,
                        metrics: figures.plan,
                        model: figures.model,
                        bounds: figures.bounds,
                        build_keys: figures.build_keys,
                    }
                }
                Some(Produced::Finished(Err(e))) => {
                    if e.to_string().contains(PANICKED) {
                        self.panics.fetch_add(1, Ordering::Relaxed);
                    }
                    return self.end_with(e.to_string());
                }
                None => return self.end_with("the task stopped before it finished".into()),
            };
            self.last_progress = Instant::now();
            return match crate::cluster::protocol::encode_event(&event, carried.as_ref()) {
                Ok(body) => Some(Ok(arrow_flight::Result { body: body.into() })),
                Err(e) => self.end_with(format!("a carried block could not be encoded: {e}")),
            };
        }
    }

    /// The event of a block kept on this worker's shelf under the task's query, or the
    /// shelf's refusal.
    fn kept_event(
        &mut self,
        batch: RecordBatch,
        tag: usize,
        rows: usize,
        bytes: u64,
        digest: Option<u64>,
    ) -> std::result::Result<TaskEvent, String> {
        let key =
            (self.shelf.keep(&self.query, batch, self.query_budget)).map_err(|e| e.to_string())?;
        self.blocks += 1;
        Ok(TaskEvent::Block(RemoteBlockInfo {
            key,
            tag,
            rows,
            bytes,
            digest,
        }))
    }

    /// End the reply with the task's error.
    fn end_with(
        &mut self,
        error: String,
    ) -> Option<std::result::Result<arrow_flight::Result, Status>> {
        self.ended = true;
        Some(Err(Status::internal(error)))
    }
}

impl Drop for WorkerService {
    fn drop(&mut self) {
        if let Some(runtime) = self.task_runtime.take() {
            // May be dropped on an async thread, where a blocking shutdown panics.
            runtime.shutdown_background();
        }
    }
}

/// Aborts a spawned task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The feeds of a worker's running tasks ([`crate::cluster::protocol::TaskRequest::feed`]):
/// by query and feed, where each fed source's blocks go.
#[derive(Default)]
struct Feeds(Mutex<HashMap<(String, String), HashMap<usize, FedSender>>>);

/// Where the blocks fed to one in-memory source of a running task go.
type FedSender = tokio::sync::mpsc::UnboundedSender<crate::cluster::worker_tasks::InputBlock>;

impl Feeds {
    /// Open the feed a task's request names (none when it names none): the receivers of
    /// its fed sources, and what closes the feed when the task's reply goes.
    fn open(
        self: &Arc<Self>,
        request: &crate::cluster::protocol::TaskRequest,
    ) -> (Option<FeedOpen>, crate::cluster::worker_tasks::FedSources) {
        let mut fed = crate::cluster::worker_tasks::FedSources::new();
        if request.feed.is_empty() {
            return (None, fed);
        }
        let mut senders = HashMap::new();
        for source in &request.fed_sources {
            let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
            senders.insert(*source, sender);
            fed.insert(*source, receiver);
        }
        let key = (request.query.clone(), request.feed.clone());
        self.0.lock().unwrap().insert(key.clone(), senders);
        let open = FeedOpen {
            feeds: Arc::clone(self),
            key,
        };
        (Some(open), fed)
    }

    /// Hand the blocks of a `feed` action to their source; at the feed's end close it.
    /// Whether the task was still there to take them.
    fn deliver(
        &self,
        request: &crate::cluster::protocol::FeedRequest,
        inline: Vec<RecordBatch>,
    ) -> std::result::Result<bool, Status> {
        use crate::cluster::worker_tasks::InputBlock;
        let mut inline: Vec<Option<RecordBatch>> = inline.into_iter().map(Some).collect();
        let key = (request.query.clone(), request.feed.clone());
        let mut feeds = self.0.lock().unwrap();
        let Some(sources) = feeds.get(&key) else {
            return Ok(false);
        };
        if !request.inputs.is_empty() {
            let Some(sender) = sources.get(&request.source) else {
                return Err(Status::invalid_argument(format!(
                    "the task is not fed source {}",
                    request.source
                )));
            };
            let mut blocks = Vec::with_capacity(request.inputs.len());
            for input in &request.inputs {
                blocks.push(match input {
                    TaskInput::Fetch(ticket) => InputBlock::Ticket(ticket.clone()),
                    TaskInput::Inline(i) => {
                        let batch = inline.get_mut(*i).and_then(Option::take);
                        InputBlock::Here(batch.ok_or_else(|| {
                            Status::invalid_argument(format!("fed block {i} is missing"))
                        })?)
                    }
                });
            }
            for block in blocks {
                // The task ended meanwhile (its limit met): it takes no more.
                if sender.send(block).is_err() {
                    return Ok(false);
                }
            }
        }
        if request.end {
            feeds.remove(&key);
        }
        Ok(true)
    }
}

/// A running task's open feed: closed (its sources ended, further feeds refused) when
/// dropped with the task's reply.
struct FeedOpen {
    feeds: Arc<Feeds>,
    key: (String, String),
}

impl Drop for FeedOpen {
    fn drop(&mut self) {
        self.feeds.0.lock().unwrap().remove(&self.key);
    }
}

/// The `release` calls a worker answered ([`WorkerStatus::release_calls`]).
#[derive(Debug, Default)]
struct ReleaseCounts {
    /// Calls answered.
    calls: AtomicU64,
    /// Block keys they named (a call naming none releases a whole query's).
    keys: AtomicU64,
}

/// Counts of where a worker's task inputs came from (its status reports them).
#[derive(Default)]
struct InputReads {
    /// Blocks read from its own shelf.
    held_here: AtomicU64,
    /// Blocks fetched from other workers.
    from_peers: AtomicU64,
    /// Bytes of those, as their tickets give them.
    bytes_from_peers: AtomicU64,
}

/// The other workers a worker fetches task inputs from: one client per address, each
/// presenting the worker's own secret (the same for all workers of a driver) and, for
/// workers in TLS, checking their certificate against `trust`.
struct Peers {
    secret: Secret,
    trust: Option<WorkerTrust>,
    /// One connection per address, made once: a task's inputs are fetched at once, and
    /// each fetch that found no client made its own connection (20,000 in one TPC-H query
    /// over 3-row blocks, until the connections failed with "h2 protocol error").
    clients: std::sync::Mutex<HashMap<String, Arc<tokio::sync::OnceCell<Client>>>>,
}

impl Peers {
    fn new(secret: Secret, trust: Option<WorkerTrust>) -> Self {
        Self {
            secret,
            trust,
            clients: Default::default(),
        }
    }

    /// A client of the worker at `address`: the first call connects while the others
    /// wait for it; after a failed connect, the next call tries again.
    async fn client(&self, address: &str, tls: bool) -> Result<Client> {
        let cell = Arc::clone(
            self.clients
                .lock()
                .unwrap()
                .entry(address.to_string())
                .or_default(),
        );
        cell.get_or_try_init(|| self.connect(address, tls))
            .await
            .cloned()
    }

    /// A new connection to the worker at `address`.
    async fn connect(&self, address: &str, tls: bool) -> Result<Client> {
        let trust = match (tls, &self.trust) {
            (false, _) => None,
            (true, Some(trust)) => Some(trust),
            (true, None) => {
                return Err(DataFusionError::Execution(
                    "this worker has no CA to check other workers' certificates (--tls-ca)".into(),
                ));
            }
        };
        connect(address, trust, &self.secret).await
    }
}

/// The query's `flumen.memory_budget`, from a task's `options`; `None` when the driver
/// sent none.
fn query_budget(options: &[(String, String)]) -> Option<u64> {
    let (_, budget) = options
        .iter()
        .find(|(key, _)| key == "flumen.memory_budget")?;
    Some(budget.parse::<crate::ByteSize>().ok()?.0)
}

/// How many input blocks one task fetches at a time: enough to keep a link busy with
/// small blocks, few enough that a task of thousands of inputs does not open thousands of
/// streams at once.
const FETCHES_AT_ONCE: usize = 32;

/// Reads a task's input blocks named by ticket, for one query: a block this worker holds
/// itself (keys are random, so a key found on its shelf is that block) from its shelf,
/// not over the network; the others from their holders, which keep them. A block that
/// cannot be read fails the task with [`INPUT_LOST`] (the driver recomputes it and sends
/// the task again).
struct InputFetcher {
    peers: Arc<Peers>,
    own: Arc<BlockShelf>,
    reads: Arc<InputReads>,
    query: String,
    /// How its peers off this machine are asked to send the blocks
    /// ([`BlockTicket::compression`]).
    compression: ExchangeCompression,
}

impl InputFetcher {
    /// The block `ticket` names; why not, and whether its holder is gone, when it cannot
    /// be read.
    async fn fetch(&self, ticket: &InputTicket) -> std::result::Result<RecordBatch, Lost> {
        let lost = |why: String, holder_gone: bool| Lost {
            message: format!("{} on worker {}: {why}", ticket.key, ticket.address),
            holder_gone,
        };
        let mut wanted = BlockTicket {
            query: self.query.clone(),
            key: ticket.key.clone(),
            keep: true,
            compression: String::new(),
        };
        if let Some(block) = (self.own.take(&wanted)).map_err(|e| lost(e.to_string(), false))? {
            self.reads.held_here.fetch_add(1, Ordering::Relaxed);
            return Ok(block);
        }
        // Only a block fetched from a peer is encoded, and compressed off this machine.
        wanted.compression = ticket_compression(self.compression, &ticket.address);
        self.reads.from_peers.fetch_add(1, Ordering::Relaxed);
        (self.reads.bytes_from_peers).fetch_add(ticket.bytes, Ordering::Relaxed);
        let client = self
            .peers
            .client(&ticket.address, ticket.tls)
            .await
            .map_err(|e| lost(e.to_string(), true))?;
        get_block(&client, wanted).await.map_err(|failure| {
            let gone = matches!(failure, Failure::Dead(_));
            lost(failure.to_string(), gone)
        })
    }

    /// The block `ticket` names; an [`INPUT_LOST`] error naming it when it cannot be read.
    async fn fetch_one(&self, ticket: &InputTicket) -> Result<RecordBatch> {
        (self.fetch(ticket).await)
            .map_err(|lost| DataFusionError::Execution(format!("{INPUT_LOST}: {}", lost.message)))
    }

    /// The block `ticket` names, as [`Self::fetch`], but not asked of a holder that
    /// another of the task's fetches found gone (it would fail the same way, perhaps
    /// only after a timeout).
    async fn fetch_unless_gone(
        &self,
        ticket: &InputTicket,
        gone: &Mutex<HashSet<String>>,
    ) -> std::result::Result<RecordBatch, Lost> {
        if gone.lock().unwrap().contains(&ticket.address) {
            return Err(Lost {
                message: format!(
                    "{} on worker {}: that worker did not answer",
                    ticket.key, ticket.address
                ),
                holder_gone: true,
            });
        }
        let fetched = self.fetch(ticket).await;
        if let Err(Lost {
            holder_gone: true, ..
        }) = &fetched
        {
            gone.lock().unwrap().insert(ticket.address.clone());
        }
        fetched
    }

    /// The [`TaskInput::Fetch`] blocks of `inputs`, in order, [`FETCHES_AT_ONCE`] at a
    /// time. When some cannot be read, the task fails with [`INPUT_LOST`] naming all of
    /// them (up to [`LOST_NAMED`]), so that the driver recomputes them all before it
    /// sends the task again, not one per attempt.
    async fn fetch_all(&self, inputs: &[TaskInput]) -> Result<Vec<RecordBatch>> {
        let gone = Mutex::new(HashSet::new());
        // The futures are made first: a stream that maps borrowed tickets would not be
        // `Send` for the Flight service's boxed future.
        let mut fetches = vec![];
        for input in inputs {
            if let TaskInput::Fetch(ticket) = input {
                fetches.push(self.fetch_unless_gone(ticket, &gone));
            }
        }
        let fetched: Vec<_> = futures::stream::iter(fetches)
            .buffered(FETCHES_AT_ONCE)
            .collect()
            .await;
        let mut batches = Vec::with_capacity(fetched.len());
        let mut lost = vec![];
        for result in fetched {
            match result {
                Ok(batch) => batches.push(batch),
                Err(why) => lost.push(why.message),
            }
        }
        match lost.len() {
            0 => Ok(batches),
            1 => Err(DataFusionError::Execution(format!(
                "{INPUT_LOST}: {}",
                lost[0]
            ))),
            n => {
                let more = n.saturating_sub(LOST_NAMED);
                lost.truncate(LOST_NAMED);
                let and_more = match more {
                    0 => String::new(),
                    more => format!("; and {more} more"),
                };
                Err(DataFusionError::Execution(format!(
                    "{INPUT_LOST}: {n} blocks: {}{and_more}",
                    lost.join("; ")
                )))
            }
        }
    }
}

/// Most lost input blocks one task's error names (it travels in a gRPC status, whose
/// headers are bounded); the driver finds the others at the next attempt.
const LOST_NAMED: usize = 16;

/// An input block a task could not read.
#[derive(Debug)]
struct Lost {
    /// The block's key, its holder and why.
    message: String,
    /// Whether its holder did not answer at all (not merely lacked the block).
    holder_gone: bool,
}

type FlightStream<T> = Pin<Box<dyn futures::Stream<Item = std::result::Result<T, Status>> + Send>>;

fn one<T: Send + 'static>(item: T) -> FlightStream<T> {
    futures::stream::once(async move { Ok(item) }).boxed()
}

#[tonic::async_trait]
impl FlightService for WorkerService {
    type HandshakeStream = FlightStream<HandshakeResponse>;
    type ListFlightsStream = FlightStream<FlightInfo>;
    type DoGetStream = FlightStream<FlightData>;
    type DoPutStream = FlightStream<PutResult>;
    type DoActionStream = FlightStream<arrow_flight::Result>;
    type ListActionsStream = FlightStream<ActionType>;
    type DoExchangeStream = FlightStream<FlightData>;

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> std::result::Result<Response<Self::DoActionStream>, Status> {
        self.touch();
        let action = request.into_inner();
        match action.r#type.as_str() {
            "run" => {
                let reply = self
                    .run(&action.body)
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?;
                Ok(Response::new(reply))
            }
            "release" => {
                let request: ReleaseRequest = serde_json::from_slice(&action.body)
                    .map_err(|e| Status::invalid_argument(format!("bad release body: {e}")))?;
                self.releases.calls.fetch_add(1, Ordering::Relaxed);
                (self.releases.keys).fetch_add(request.keys.len() as u64, Ordering::Relaxed);
                // Dropping spilled blocks deletes files: off the threads that serve calls.
                let shelf = Arc::clone(&self.shelf);
                let dropped = tokio::task::spawn_blocking(move || shelf.release(request))
                    .await
                    .map_err(|e| Status::internal(format!("releasing blocks: {e}")))?;
                Ok(Response::new(one(arrow_flight::Result {
                    body: serde_json::to_vec(&dropped).unwrap().into(),
                })))
            }
            "feed" => {
                let (request, inline) = crate::cluster::protocol::decode_feed(&action.body)
                    .map_err(Status::invalid_argument)?;
                let taken = self.feeds.deliver(&request, inline)?;
                Ok(Response::new(one(arrow_flight::Result {
                    body: serde_json::to_vec(&taken).unwrap().into(),
                })))
            }
            "ping" => Ok(Response::new(one(arrow_flight::Result {
                body: b"\"pong\"".to_vec().into(),
            }))),
            "status" => {
                check_driver(&action.body, self.identity.protocol)?;
                Ok(Response::new(one(arrow_flight::Result {
                    body: serde_json::to_vec(&self.status())
                        .expect("status serializes")
                        .into(),
                })))
            }
            other => Err(Status::unimplemented(format!("unknown action {other:.64}"))),
        }
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> std::result::Result<Response<Self::DoGetStream>, Status> {
        self.touch();
        let ticket: BlockTicket = serde_json::from_slice(&request.into_inner().ticket)
            .map_err(|e| Status::invalid_argument(format!("bad block ticket: {e}")))?;
        // Refused before the block is taken: a ticket this worker cannot serve leaves it.
        let compression = match ticket.compression.as_str() {
            "" => None,
            named => (named.parse::<ExchangeCompression>())
                .map_err(|e| Status::invalid_argument(e.to_string()))?
                .ipc(),
        };
        // Only the query that owns a block may take it. A spilled block is read from disk:
        // off the threads that serve calls, which must stay free to answer the driver's
        // heartbeat however many reads wait on a busy disk.
        let shelf = Arc::clone(&self.shelf);
        let taken = ticket.clone();
        let batch = tokio::task::spawn_blocking(move || shelf.take(&taken))
            .await
            .map_err(|e| Status::internal(format!("reading block: {e}")))?
            .map_err(|e| Status::internal(e.to_string()))?;
        let batch = batch.ok_or_else(|| {
            Status::not_found(format!(
                "no block {:.32} of this query in this worker",
                ticket.key
            ))
        })?;
        let schema = batch.schema();
        let input = futures::stream::once(async move { Ok(batch) });
        // Dictionary columns stay dictionaries and every type stays as it is: a block is the
        // same batch wherever it is read (hydrated, a `Dictionary(Int32, Utf8)` column came
        // back as `Utf8`; through arrow-flight's encoder a `LargeList` came back as garbage).
        let sent = flight_data(
            schema,
            input,
            Dictionaries::Keep,
            MAX_FLIGHT_DATA_BYTES,
            compression,
        );
        let stream = sent.map_err(|e| Status::internal(e.to_string()));
        Ok(Response::new(stream.boxed()))
    }

    async fn handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> std::result::Result<Response<Self::HandshakeStream>, Status> {
        // The interceptor let the call in; the payload must present the secret as well.
        let mut stream = request.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("an empty handshake"))?;
        if !self.auth.is_secret(&first.payload) {
            log::warn!("flumen worker refused a handshake with a wrong secret");
            return Err(Status::unauthenticated("handshake: wrong secret"));
        }
        let token = self.auth.issue_token();
        Ok(Response::new(one(HandshakeResponse {
            protocol_version: first.protocol_version,
            payload: token.to_hex().into_bytes().into(),
        })))
    }

    async fn list_flights(
        &self,
        _request: Request<Criteria>,
    ) -> std::result::Result<Response<Self::ListFlightsStream>, Status> {
        Err(Status::unimplemented("list_flights"))
    }

    async fn get_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        Err(Status::unimplemented("get_flight_info"))
    }

    async fn poll_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented("poll_flight_info"))
    }

    async fn get_schema(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<SchemaResult>, Status> {
        Err(Status::unimplemented("get_schema"))
    }

    async fn do_put(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> std::result::Result<Response<Self::DoPutStream>, Status> {
        Err(Status::unimplemented("do_put"))
    }

    async fn list_actions(
        &self,
        _request: Request<Empty>,
    ) -> std::result::Result<Response<Self::ListActionsStream>, Status> {
        Err(Status::unimplemented("list_actions"))
    }

    async fn do_exchange(
        &self,
        _request: Request<Streaming<FlightData>>,
    ) -> std::result::Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented("do_exchange"))
    }
}

/// End the worker process with `code`, its spill directories removed first
/// (`std::process::exit` runs no destructor).
fn exit_removing_spills(code: i32) -> ! {
    crate::store::owned_dir::remove_owned_dirs();
    std::process::exit(code)
}

/// Exit on SIGTERM (how Kubernetes and service managers stop a worker) and SIGINT, with
/// the spill directories removed, as the shell's convention numbers it: 128 + the signal.
fn exit_on_signals() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    for (kind, number) in [
        (SignalKind::terminate(), libc::SIGTERM),
        (SignalKind::interrupt(), libc::SIGINT),
    ] {
        let mut received = signal(kind)?;
        tokio::spawn(async move {
            if received.recv().await.is_some() {
                log::info!("flumen worker: signal {number}; exiting");
                exit_removing_spills(128 + number);
            }
        });
    }
    Ok(())
}

/// Largest piece a block is cut into on its way back (`do_get` streams a block in pieces).
const MAX_FLIGHT_DATA_BYTES: usize = 4 << 20;

/// How a worker process is run besides its address and pool.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// The secret every caller must present.
    pub secret: Secret,
    /// Exit when standard input closes: a worker a driver started gets the secret on a
    /// pipe the driver keeps open, so the driver's death (even SIGKILL) closes it.
    pub exit_when_stdin_closes: bool,
    /// Exit when no call came for this long (a worker not started by its driver).
    pub lease: Option<Duration>,
    /// Largest message it accepts or sends (default [`MAX_TASK_BYTES`]); a bigger one is
    /// refused with `OutOfRange` before it is decoded.
    pub max_message_bytes: usize,
    /// The certificate and key it serves TLS with; without one it serves plaintext, which
    /// it refuses on any address but loopback.
    pub tls: Option<TlsIdentity>,
    /// The CA other workers' certificates chain to, for fetching task inputs from those
    /// that speak TLS.
    pub peer_trust: Option<WorkerTrust>,
    /// Tasks it runs at once, as announced to the driver; `None`: one per core (a CPU
    /// worker) or one (an accelerator worker).
    pub slots: Option<usize>,
    /// Bytes of blocks it may keep, as announced.
    pub memory_budget: u64,
    /// The worker protocol it speaks: this build's [`PROTOCOL_VERSION`]; tests set another
    /// to stand for a worker of an older or newer flumen.
    pub protocol: u32,
}

impl WorkerSettings {
    /// A worker answering callers that present `secret`, with the default limits, that does
    /// not watch its stdin and has no lease.
    pub fn new(secret: Secret) -> Self {
        Self {
            secret,
            exit_when_stdin_closes: false,
            lease: None,
            max_message_bytes: MAX_TASK_BYTES,
            tls: None,
            peer_trust: None,
            slots: None,
            memory_budget: crate::ByteSize::default().0,
            protocol: PROTOCOL_VERSION,
        }
    }
}

/// Serve as a worker on `listen` (`host:port`; port 0 picks one), running tasks in `ctx`
/// (a flumen session: it must know every function the driver's plans call). Prints
/// `flumen worker listening on HOST:PORT` on standard output once it accepts connections,
/// which is how a driver that started it learns its address.
pub async fn serve(
    listen: &str,
    kind: Pool,
    ctx: SessionContext,
    settings: WorkerSettings,
) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        DataFusionError::Execution(format!("worker cannot listen on {listen}: {e}"))
    })?;
    let address = listener.local_addr()?;
    require_tls_off_loopback(&address, settings.tls.as_ref())?;
    let mut builder = crate::cluster::tls::server_builder(settings.tls.as_ref(), "worker")?;
    // Before the address is out: a driver may stop the worker as soon as it has it.
    exit_on_signals()?;
    println!("flumen worker listening on {address}");
    use std::io::Write;
    std::io::stdout().flush()?;
    if settings.exit_when_stdin_closes {
        std::thread::spawn(|| {
            use std::io::Read;
            let mut sink = [0u8; 64];
            while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
            log::info!("flumen worker: the driver closed its pipe; exiting");
            exit_removing_spills(0);
        });
    }
    let identity = WorkerIdentity::new(kind, &settings);
    let peers = Peers::new(settings.secret.clone(), settings.peer_trust);
    let auth = RequireSecret::new(settings.secret);
    let service = Arc::new(WorkerService::new(ctx, kind, auth.clone(), peers, identity));
    if let Some(lease) = settings.lease {
        let watched = Arc::clone(&service);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(lease / 4).await;
                if watched.last_call.lock().unwrap().elapsed() > lease {
                    log::warn!("flumen worker: no call from a driver for {lease:?}; exiting");
                    exit_removing_spills(0);
                }
            }
        });
    }
    let server = FlightServiceServer::from_arc(service)
        .max_decoding_message_size(settings.max_message_bytes)
        .max_encoding_message_size(settings.max_message_bytes);
    builder
        .add_service(tonic::service::interceptor::InterceptedService::new(
            server, auth,
        ))
        // No Nagle: small replies (a task's block info) would wait for a delayed ACK.
        .serve_with_incoming(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        )
        .await
        .map_err(|e| DataFusionError::Execution(format!("worker on {address} failed: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task's reply carries its first blocks while their bytes fit in its
    /// `carried_output_bytes`, in order: the first block that does not fit, and every
    /// later one however small, stay on the worker's shelf under a ticket.
    #[tokio::test]
    async fn a_reply_carries_its_first_blocks_while_their_bytes_fit() {
        use datafusion::arrow::array::Int64Array;
        let rows = |n: i64| {
            RecordBatch::try_from_iter([("v", Arc::new(Int64Array::from_iter_values(0..n)) as _)])
                .unwrap()
        };
        let (small, large) = (rows(10), rows(10_000));
        let small_bytes = small.get_array_memory_size() as u64;
        let (out, produced) = tokio::sync::mpsc::unbounded_channel();
        for batch in [&small, &small, &small, &large, &small] {
            out.send(Produced::Block(1, batch.clone())).unwrap();
        }
        out.send(Produced::Finished(Ok(Default::default())))
            .unwrap();
        let shelf = Arc::new(BlockShelf::new(1 << 30));
        let mut reply = TaskReply {
            produced,
            shelf: Arc::clone(&shelf),
            panics: Arc::default(),
            query: "q".into(),
            query_budget: u64::MAX,
            // Room for two small blocks and a little more.
            carry_left: 2 * small_bytes + 1,
            digests: true,
            blocks: 0,
            rows: 0,
            last_progress: Instant::now(),
            ended: false,
            _stop: None,
            _feed: None,
        };
        let mut kinds = vec![];
        while let Some(message) = reply.next_event().await {
            let (event, carried) = decode_event(&message.unwrap().body).unwrap();
            match event {
                TaskEvent::Carried(info) => {
                    let carried = carried.unwrap();
                    assert_eq!(carried, small);
                    assert_eq!((info.rows, info.key.as_str()), (10, ""));
                    assert_eq!(info.digest, crate::store::block_digest::digest(&small));
                    kinds.push("carried");
                }
                TaskEvent::Block(info) => {
                    assert!(!info.key.is_empty() && carried.is_none());
                    kinds.push("kept");
                }
                TaskEvent::Done { blocks, .. } => {
                    assert_eq!(blocks, 5);
                    kinds.push("done");
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(
            kinds,
            ["carried", "carried", "kept", "kept", "kept", "done"]
        );
        assert_eq!(shelf.len(), 3, "the kept blocks are on the shelf");
    }

    /// A task's inputs, some held here and some not to be had: the task fails naming every
    /// block it could not read (the driver recomputes them all before the next attempt),
    /// and does not ask again a holder found gone.
    #[tokio::test]
    async fn a_task_names_every_input_it_could_not_read() {
        let shelf = Arc::new(BlockShelf::new(1 << 20));
        let batch = RecordBatch::try_from_iter([(
            "v",
            Arc::new(datafusion::arrow::array::Int64Array::from(vec![1, 2, 3])) as _,
        )])
        .unwrap();
        let held = shelf.keep("q", batch, 1 << 20).unwrap();
        let fetcher = InputFetcher {
            peers: Arc::new(Peers::new(Secret::random(), None)),
            own: Arc::clone(&shelf),
            reads: Arc::default(),
            query: "q".into(),
            compression: ExchangeCompression::default(),
        };
        // Nothing listens on port 9 (discard) here: the holder is gone.
        let ticket = |key: &str| {
            TaskInput::Fetch(InputTicket {
                address: "127.0.0.1:9".into(),
                tls: false,
                key: key.into(),
                bytes: 0,
            })
        };
        let inputs = [
            ticket(&held),
            ticket("a1"),
            ticket(&held),
            ticket("b2"),
            ticket("c3"),
        ];
        let error = fetcher.fetch_all(&inputs).await.unwrap_err().to_string();
        assert!(
            error.contains(&format!("{INPUT_LOST}: 3 blocks: ")),
            "{error}"
        );
        for key in ["a1", "b2", "c3"] {
            assert!(
                error.contains(&format!("{key} on worker 127.0.0.1:9")),
                "{error}"
            );
        }
        assert!(!error.contains(&held), "{error}");
        let read = fetcher.fetch_all(&inputs[..1]).await.unwrap();
        assert_eq!(read[0].num_rows(), 3);
    }

    #[test]
    fn a_driver_of_another_protocol_is_refused_naming_both_versions() {
        assert!(check_driver(b"", PROTOCOL_VERSION).is_ok());
        let ours = serde_json::to_vec(&DriverHello::ours()).unwrap();
        assert!(check_driver(&ours, PROTOCOL_VERSION).is_ok());
        let old = serde_json::to_vec(&DriverHello {
            protocol: PROTOCOL_VERSION - 1,
            version: "0.0.9".into(),
        })
        .unwrap();
        let refused = check_driver(&old, PROTOCOL_VERSION).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        let message = refused.message();
        assert!(message.contains("flumen 0.0.9"), "{message}");
        assert!(
            message.contains(&format!("protocol {}", PROTOCOL_VERSION - 1)),
            "{message}"
        );
        assert!(check_driver(b"{not json", PROTOCOL_VERSION).is_err());
    }

    #[tokio::test]
    async fn a_tasks_fetches_from_one_holder_share_one_connection() {
        // A holder that accepts connections, counts them and keeps them open.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&accepted);
        tokio::spawn(async move {
            let mut open = vec![];
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                open.push(socket);
            }
        });
        let peers = Peers::new(Secret::random(), None);
        // As a task's fetches ask at once (`InputFetcher::fetch_all`).
        let clients = (0..64).map(|_| peers.client(&address, false));
        for client in futures::future::join_all(clients).await {
            client.unwrap();
        }
        peers.client(&address, false).await.unwrap();
        // The connections are made; give the accept loop time to take every one of them.
        let deadline = Instant::now() + Duration::from_secs(10);
        while accepted.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection per holder"
        );
    }
}
