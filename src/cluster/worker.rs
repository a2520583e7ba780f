//! A flumen worker process (`flumen worker`): runs CPU tasks sent by a driver and keeps the
//! blocks they produce until the driver's consumers fetch them.
//!
//! It speaks Arrow Flight over gRPC on a TCP address (`host:port`, so workers can live on
//! other hosts), in TLS when it has an identity, which it must off loopback
//! ([`crate::cluster::tls`]). Every call must carry the driver's secret
//! ([`crate::cluster::auth`]):
//! - `handshake`: the secret in, a session token out (usable in place of the secret).
//! - action `run`: a task, as a [`TaskRequest`] header and a DataFusion physical plan encoded
//!   with `datafusion-proto`. The worker checks it against what it runs
//!   ([`crate::cluster::admission`]: flumen's node types, granted files, task settings),
//!   runs every output partition of the plan, cuts the output into blocks of at most
//!   `target_rows` rows, keeps them under the task's query, and answers with one
//!   [`RemoteBlockInfo`] per block (the output partition is the block's tag). A task that
//!   panics fails alone: the worker lives on (an accelerator worker restarts its model
//!   thread).
//! - `do_get` with a [`BlockTicket`] (query and random 128-bit key): the block as Arrow IPC;
//!   the worker then drops it, unless the ticket says `keep` (another worker fetching a
//!   task's input: [`TaskInput::Fetch`]). A ticket of another query finds nothing.
//! - action `release`: drop the listed blocks of a query, or all of them.
//! - action `ping`: liveness (the driver's heartbeat).
//! - action `status`: a [`WorkerStatus`] (tasks run, panics, models loaded, blocks held,
//!   functions known).
//!
//! A worker serves one of the driver's pools ([`Pool`]): a CPU worker runs several
//! tasks at once; an accelerator worker runs its tasks one at a time on one thread, which
//! loads each model once and keeps it.
//!
//! A worker holds no state the driver cannot rebuild: when it dies, the driver re-runs the
//! producer tasks of the blocks it held, from their lineage. It does not outlive its driver:
//! one started by a driver exits when the driver's end of its stdin closes, one started by
//! hand when its lease runs out ([`WorkerSettings`]).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use datafusion::prelude::SessionContext;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt, TryStreamExt};
use tonic::{Request, Response, Status, Streaming};

use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_plan::repartition::RepartitionExec;

use crate::cluster::admission::{admit_options, admit_plan};
use crate::cluster::auth::{RequireSecret, Secret};
use crate::cluster::protocol::{
    BlockTicket, INPUT_LOST, PROTOCOL_VERSION, ReleaseRequest, RemoteBlockInfo, TaskInput,
    TaskRequest, WorkerStatus, decode_task,
};
use crate::cluster::tls::{TlsIdentity, WorkerTrust, require_tls_off_loopback};
use crate::cluster::worker_pool::{Client, connect, get_block};
use crate::plan::graph::Pool;
use crate::store::cutter::BlockCutter;
use crate::store::cutter::bundle_pieces;

/// What a task body's run gives back: its blocks, or its error; a panic is an error whose
/// message says so.
type TaskBlocks = Result<Vec<(usize, RecordBatch)>>;

/// A job for an accelerator worker's model thread: a task body, its input blocks fetched
/// from other workers, and where to answer.
type ModelJob = (
    Vec<u8>,
    Vec<RecordBatch>,
    SessionContext,
    tokio::sync::oneshot::Sender<TaskBlocks>,
);

/// A block a worker keeps, and the query it belongs to.
struct KeptBlock {
    query: String,
    batch: RecordBatch,
}

/// The Flight service of one worker process.
pub struct WorkerService {
    ctx: SessionContext,
    kind: Pool,
    blocks: Mutex<HashMap<String, KeptBlock>>,
    tasks: AtomicU64,
    panics: AtomicU64,
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
    /// Queries whose blocks were all released (the query ended): blocks of their tasks
    /// still running when the release came are dropped as they finish. The most recent
    /// [`ENDED_QUERIES_KEPT`].
    ended: Mutex<std::collections::VecDeque<String>>,
    /// Clients of the other workers it fetches task inputs from.
    peers: Peers,
}

/// How many ended queries a worker remembers.
const ENDED_QUERIES_KEPT: usize = 4096;

impl WorkerService {
    /// A worker whose tasks run in `ctx` (which must know the functions the plans call),
    /// answering only callers that present `auth`'s secret; it fetches task inputs from
    /// other workers as `peers` says.
    fn new(ctx: SessionContext, kind: Pool, auth: RequireSecret, peers: Peers) -> Self {
        let model_thread = (kind == Pool::Accelerator).then(start_model_thread);
        let task_runtime = (kind == Pool::Cpu).then(|| {
            tokio::runtime::Builder::new_multi_thread()
                .thread_name("flumen-task")
                .enable_all()
                .build()
                .expect("the task runtime starts")
        });
        Self {
            task_runtime,
            ctx,
            kind,
            blocks: Mutex::new(HashMap::new()),
            tasks: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            model_thread,
            auth,
            last_call: Mutex::new(Instant::now()),
            ended: Mutex::default(),
            peers,
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
            protocol: PROTOCOL_VERSION,
            kind: self.kind,
            pid: std::process::id(),
            tasks: self.tasks.load(Ordering::Relaxed),
            task_panics: self.panics.load(Ordering::Relaxed),
            model_loads: crate::functions::accelerator::workers_loaded(),
            blocks_held: self.blocks.lock().unwrap().len(),
            functions,
        }
    }

    fn touch(&self) {
        *self.last_call.lock().unwrap() = Instant::now();
    }

    /// Decode and run a task; keep its blocks under the task's query.
    async fn run(&self, body: &[u8]) -> Result<Vec<RemoteBlockInfo>> {
        self.tasks.fetch_add(1, Ordering::Relaxed);
        let (request, _) = decode_task(body).map_err(DataFusionError::Execution)?;
        let fetched = match &request.inputs {
            Some(inputs) => self.peers.fetch_inputs(&request.query, inputs).await?,
            None => vec![],
        };
        let blocks = match &self.model_thread {
            Some(thread) => {
                let (reply, answer) = tokio::sync::oneshot::channel();
                thread
                    .send((body.to_vec(), fetched, self.ctx.clone(), reply))
                    .map_err(|_| DataFusionError::Execution("the model thread is gone".into()))?;
                answer.await.map_err(|_| {
                    DataFusionError::Execution("the model thread dropped a task".into())
                })?
            }
            None => {
                let (body, ctx) = (body.to_vec(), self.ctx.clone());
                let task = async move { run_guarded(&body, fetched, &ctx).await };
                match &self.task_runtime {
                    Some(runtime) => {
                        let handle = runtime.spawn(task);
                        // The driver gave up on the call (its query ended): stop the task.
                        let _abort = AbortOnDrop(handle.abort_handle());
                        handle.await.map_err(|e| {
                            DataFusionError::Execution(format!("the task did not finish: {e}"))
                        })?
                    }
                    None => task.await,
                }
            }
        };
        let blocks = blocks.inspect_err(|e| {
            if e.to_string().contains(PANICKED) {
                self.panics.fetch_add(1, Ordering::Relaxed);
            }
        })?;
        let mut kept = self.blocks.lock().unwrap();
        if self.ended.lock().unwrap().contains(&request.query) {
            return Err(DataFusionError::Execution(
                "the task's query has ended; its blocks were dropped".into(),
            ));
        }
        Ok(blocks
            .into_iter()
            .map(|(tag, batch)| {
                let key = random_key();
                let info = RemoteBlockInfo {
                    key: key.clone(),
                    tag,
                    rows: batch.num_rows(),
                    bytes: batch.get_array_memory_size() as u64,
                };
                kept.insert(
                    key,
                    KeptBlock {
                        query: request.query.clone(),
                        batch,
                    },
                );
                info
            })
            .collect())
    }

    /// Drop the listed blocks of a query, or all of its blocks when none is listed.
    fn release(&self, request: ReleaseRequest) -> usize {
        let mut blocks = self.blocks.lock().unwrap();
        let before = blocks.len();
        if request.keys.is_empty() {
            blocks.retain(|_, b| b.query != request.query);
            let mut ended = self.ended.lock().unwrap();
            ended.push_back(request.query);
            if ended.len() > ENDED_QUERIES_KEPT {
                ended.pop_front();
            }
        } else {
            for key in request.keys {
                if blocks.get(&key).is_some_and(|b| b.query == request.query) {
                    blocks.remove(&key);
                }
            }
        }
        before - blocks.len()
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

/// 128 random bits as hex: a block key nobody can guess.
fn random_key() -> String {
    Secret::random().to_hex()[..32].to_string()
}

/// The words a panicking task's error carries.
const PANICKED: &str = "task panicked";

/// Run a task body, turning a panic into the task's error (the worker lives on).
async fn run_guarded(body: &[u8], fetched: Vec<RecordBatch>, ctx: &SessionContext) -> TaskBlocks {
    match AssertUnwindSafe(run_task_body(body, fetched, ctx))
        .catch_unwind()
        .await
    {
        Ok(result) => result,
        Err(panic) => {
            let message = crate::panic_message(&*panic);
            log::warn!("flumen worker: {PANICKED}: {message}");
            Err(DataFusionError::Execution(format!(
                "{PANICKED} in worker {}: {message}",
                std::process::id()
            )))
        }
    }
}

/// Decode a task body under the driver's settings it carries, check it against what a
/// worker runs ([`crate::cluster::admission`]), put in the input blocks `fetched` from other
/// workers, and run it into blocks.
async fn run_task_body(body: &[u8], fetched: Vec<RecordBatch>, ctx: &SessionContext) -> TaskBlocks {
    let (request, plan) = decode_task(body).map_err(DataFusionError::Execution)?;
    admit_options(&request.options)?;
    let mut config = ctx.copied_config();
    for (key, value) in &request.options {
        config.options_mut().set(key, value)?;
    }
    // Decoded under the driver's settings: model calls read them from their expressions.
    let state = datafusion::execution::SessionStateBuilder::new_from_existing(ctx.state())
        .with_config(config)
        .build();
    let task_ctx = state.task_ctx();
    let plan = datafusion_proto::bytes::physical_plan_from_bytes(plan, &task_ctx)?;
    admit_plan(&plan, &request.grants)?;
    let plan = match &request.inputs {
        Some(inputs) => with_inputs(plan, inputs, fetched, request.target_rows)?,
        None => plan,
    };
    plan_blocks(plan, task_ctx, &request).await
}

/// Put a block-wise task's input blocks into its plan's one in-memory source: the inline
/// batches the source carries and the `fetched` ones, in the order `inputs` gives, cut as
/// the driver cuts a bundle ([`bundle_pieces`]).
fn with_inputs(
    plan: Arc<dyn ExecutionPlan>,
    inputs: &[TaskInput],
    fetched: Vec<RecordBatch>,
    target_rows: usize,
) -> Result<Arc<dyn ExecutionPlan>> {
    let mut fetched = fetched.into_iter();
    let mut sources = 0;
    let plan = plan
        .transform_up(|node| {
            let Some(memory) = node
                .downcast_ref::<DataSourceExec>()
                .and_then(|source| source.data_source().downcast_ref::<MemorySourceConfig>())
            else {
                return Ok(Transformed::no(node));
            };
            sources += 1;
            let inline: Vec<&RecordBatch> = memory.partitions().iter().flatten().collect();
            let mut bundle = Vec::with_capacity(inputs.len());
            for input in inputs {
                let block = match input {
                    TaskInput::Inline(i) => inline.get(*i).map(|b| (*b).clone()),
                    TaskInput::Fetch(_) => fetched.next(),
                };
                bundle.push(block.ok_or_else(|| {
                    DataFusionError::Execution(format!("task input {input:?} is missing"))
                })?);
            }
            let schema = node.schema();
            let pieces = bundle_pieces(&schema, bundle, target_rows)?;
            let source: Arc<dyn ExecutionPlan> =
                MemorySourceConfig::try_new_exec(&[pieces], schema, None)?;
            Ok(Transformed::yes(source))
        })?
        .data;
    if sources != 1 {
        return Err(DataFusionError::Execution(format!(
            "a task with input tickets must have one in-memory source, this one has {sources}"
        )));
    }
    Ok(plan)
}

/// The other workers a worker fetches task inputs from: one client per address, each
/// presenting the worker's own secret (the same for all workers of a driver) and, for
/// workers in TLS, checking their certificate against `trust`.
struct Peers {
    secret: Secret,
    trust: Option<WorkerTrust>,
    clients: tokio::sync::Mutex<HashMap<String, Client>>,
}

impl Peers {
    fn new(secret: Secret, trust: Option<WorkerTrust>) -> Self {
        Self {
            secret,
            trust,
            clients: Default::default(),
        }
    }

    /// A client of the worker at `address`.
    async fn client(&self, address: &str, tls: bool) -> Result<Client> {
        if let Some(client) = self.clients.lock().await.get(address) {
            return Ok(client.clone());
        }
        let trust = match (tls, &self.trust) {
            (false, _) => None,
            (true, Some(trust)) => Some(trust),
            (true, None) => {
                return Err(DataFusionError::Execution(
                    "this worker has no CA to check other workers' certificates (--tls-ca)".into(),
                ));
            }
        };
        let client = connect(address, trust, &self.secret).await?;
        self.clients
            .lock()
            .await
            .insert(address.to_string(), client.clone());
        Ok(client)
    }

    /// The [`TaskInput::Fetch`] blocks of `inputs`, in order, read from their holders
    /// (which keep them). A block that cannot be read fails the task with [`INPUT_LOST`].
    async fn fetch_inputs(&self, query: &str, inputs: &[TaskInput]) -> Result<Vec<RecordBatch>> {
        let fetches = inputs.iter().filter_map(|input| match input {
            TaskInput::Fetch(ticket) => Some(ticket),
            TaskInput::Inline(_) => None,
        });
        futures::future::try_join_all(fetches.map(|ticket| async move {
            let lost = |why: String| {
                DataFusionError::Execution(format!(
                    "{INPUT_LOST}: {} on worker {}: {why}",
                    ticket.key, ticket.address
                ))
            };
            let client = self
                .client(&ticket.address, ticket.tls)
                .await
                .map_err(|e| lost(e.to_string()))?;
            let wanted = BlockTicket {
                query: query.to_string(),
                key: ticket.key.clone(),
                keep: true,
            };
            get_block(&client, wanted)
                .await
                .map_err(|e| lost(e.to_string()))
        }))
        .await
    }
}

/// The thread an accelerator worker runs its tasks on, one at a time, so each model is
/// loaded once (accelerator UDFs keep their loaded state per thread). A task that panics
/// fails alone: the thread hands its queue to a fresh thread (whose models load anew, as
/// the panic may have left the old ones half-updated) and ends.
fn start_model_thread() -> std::sync::mpsc::Sender<ModelJob> {
    let (jobs, queue) = std::sync::mpsc::channel::<ModelJob>();
    spawn_model_thread(queue);
    jobs
}

fn spawn_model_thread(queue: std::sync::mpsc::Receiver<ModelJob>) {
    std::thread::Builder::new()
        .name("flumen-model".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime starts");
            while let Ok((body, fetched, ctx, reply)) = queue.recv() {
                let result = runtime.block_on(run_guarded(&body, fetched, &ctx));
                let panicked = matches!(&result, Err(e) if e.to_string().contains(PANICKED));
                let _ = reply.send(result);
                if panicked {
                    log::warn!("flumen worker: restarting the model thread after a panic");
                    drop(runtime);
                    spawn_model_thread(queue);
                    return;
                }
            }
        })
        .expect("the model thread starts");
}

/// Run `plan` and cut its output into blocks with the one [`BlockCutter`], as a local task
/// of the same partition would: when an exchange is on top (the operator's output split)
/// its input is split, coalesced and sliced by the cutter; otherwise each output partition
/// in turn is sliced. A worker and a driver recomputing a lost block run the same plan
/// through this, so block `i` of one run is block `i` of the other.
pub async fn plan_blocks(
    plan: Arc<dyn ExecutionPlan>,
    task_ctx: Arc<TaskContext>,
    request: &TaskRequest,
) -> Result<Vec<(usize, RecordBatch)>> {
    let partitions = request.partitions.max(1);
    let mut blocks = vec![];
    if let Some(exchange) = plan.downcast_ref::<RepartitionExec>()
        && exchange.input().output_partitioning().partition_count() == 1
    {
        let input = Arc::clone(exchange.input());
        let mut cutter = BlockCutter::new(
            input.schema(),
            Some(exchange.partitioning()),
            request.partition,
            partitions,
            request.target_rows,
        )?;
        let mut stream = input.execute(0, task_ctx)?;
        while let Some(batch) = stream.next().await {
            cutter.push(batch?, &mut blocks)?;
        }
        cutter.finish(&mut blocks)?;
        return Ok(blocks);
    }
    let outputs = plan.output_partitioning().partition_count();
    for p in 0..outputs {
        // One output partition: its blocks carry the task's partition, as a local task's.
        let tag = if outputs == 1 { request.partition } else { p };
        let mut cutter =
            BlockCutter::new(plan.schema(), None, tag, partitions, request.target_rows)?;
        let mut stream = plan.execute(p, Arc::clone(&task_ctx))?;
        while let Some(batch) = stream.next().await {
            cutter.push(batch?, &mut blocks)?;
        }
        cutter.finish(&mut blocks)?;
    }
    Ok(blocks)
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
                let infos = self
                    .run(&action.body)
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?;
                let body = serde_json::to_vec(&infos).expect("block infos serialize");
                Ok(Response::new(one(arrow_flight::Result {
                    body: body.into(),
                })))
            }
            "release" => {
                let request: ReleaseRequest = serde_json::from_slice(&action.body)
                    .map_err(|e| Status::invalid_argument(format!("bad release body: {e}")))?;
                let dropped = self.release(request);
                Ok(Response::new(one(arrow_flight::Result {
                    body: serde_json::to_vec(&dropped).unwrap().into(),
                })))
            }
            "ping" => Ok(Response::new(one(arrow_flight::Result {
                body: b"\"pong\"".to_vec().into(),
            }))),
            "status" => Ok(Response::new(one(arrow_flight::Result {
                body: serde_json::to_vec(&self.status())
                    .expect("status serializes")
                    .into(),
            }))),
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
        let block = {
            let mut blocks = self.blocks.lock().unwrap();
            // Only the query that owns a block may take it.
            match blocks.get(&ticket.key) {
                Some(b) if b.query == ticket.query && ticket.keep => Some(KeptBlock {
                    query: b.query.clone(),
                    batch: b.batch.clone(),
                }),
                Some(b) if b.query == ticket.query => blocks.remove(&ticket.key),
                _ => None,
            }
        }
        .ok_or_else(|| {
            Status::not_found(format!(
                "no block {:.32} of this query in this worker",
                ticket.key
            ))
        })?;
        let input: BoxStream<'static, std::result::Result<RecordBatch, FlightError>> =
            futures::stream::once(async move { Ok(block.batch) }).boxed();
        let stream = FlightDataEncoderBuilder::new()
            .with_max_flight_data_size(MAX_FLIGHT_DATA_BYTES)
            .build(input)
            .map_err(|e| Status::internal(e.to_string()));
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

/// Largest message a worker accepts or sends: a block-wise task carries its input blocks
/// inline (8,192 rows of web pages are ~10 MB, over tonic's 4 MiB default), so the bound is
/// set by what one task's input may hold, not by gRPC's default. Both ends set it.
pub const MAX_TASK_BYTES: usize = 1 << 30;

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
    let mut builder = tonic::transport::Server::builder();
    if let Some(identity) = &settings.tls {
        // This build links both of rustls's crypto providers (ring for us, aws-lc-rs for
        // the object-store clients), so the server side needs one named.
        let _ = rustls::crypto::ring::default_provider().install_default();
        builder = builder.tls_config(identity.server_config()).map_err(|e| {
            DataFusionError::Execution(format!("worker cannot use its TLS identity: {e}"))
        })?;
    }
    println!("flumen worker listening on {address}");
    use std::io::Write;
    std::io::stdout().flush()?;
    if settings.exit_when_stdin_closes {
        std::thread::spawn(|| {
            use std::io::Read;
            let mut sink = [0u8; 64];
            while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
            log::info!("flumen worker: the driver closed its pipe; exiting");
            std::process::exit(0);
        });
    }
    let peers = Peers::new(settings.secret.clone(), settings.peer_trust);
    let auth = RequireSecret::new(settings.secret);
    let service = Arc::new(WorkerService::new(ctx, kind, auth.clone(), peers));
    if let Some(lease) = settings.lease {
        let watched = Arc::clone(&service);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(lease / 4).await;
                if watched.last_call.lock().unwrap().elapsed() > lease {
                    log::warn!("flumen worker: no call from a driver for {lease:?}; exiting");
                    std::process::exit(0);
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
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await
        .map_err(|e| DataFusionError::Execution(format!("worker on {address} failed: {e}")))
}
