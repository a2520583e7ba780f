//! A flumen worker process (`flumen worker`): runs CPU tasks sent by a driver and keeps the
//! blocks they produce until the driver's consumers fetch them.
//!
//! It speaks Arrow Flight over gRPC on a TCP address (`host:port`, so workers can live on
//! other hosts):
//! - action `run`: a task, as a [`TaskRequest`] header and a DataFusion physical plan encoded
//!   with `datafusion-proto`. The worker runs every output partition of the plan, cuts the
//!   output into blocks of at most `target_rows` rows, keeps them, and answers with one
//!   [`RemoteBlockInfo`] per block (the output partition is the block's tag).
//! - `do_get` with a block's key as the ticket: the block as Arrow IPC; the worker then drops it.
//! - action `release`: drop the listed blocks (the driver no longer needs them).
//! - action `ping`: liveness (the driver's heartbeat).
//! - action `status`: a [`WorkerStatus`] (tasks run, models loaded, blocks held).
//!
//! A worker serves one of the driver's pools ([`WorkerKind`]): a CPU worker runs several
//! tasks at once; an accelerator worker runs its tasks one at a time on one thread, which
//! loads each model once and keeps it.
//!
//! A worker holds no state the driver cannot rebuild: when it dies, the driver re-runs the
//! producer tasks of the blocks it held, from their lineage.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status, Streaming};

/// What a driver asks of a worker with a task, besides the plan.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TaskRequest {
    /// Most rows per output block.
    pub target_rows: usize,
    /// The driver's session settings the task runs under (`flumen.model_dir`,
    /// `flumen.device`, ...), as `(key, value)`.
    #[serde(default)]
    pub options: Vec<(String, String)>,
}

/// Which of the driver's pools a worker process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum WorkerKind {
    /// CPU tasks, several at once on the worker's threads.
    #[default]
    Cpu,
    /// Accelerator tasks, one at a time on one thread that loads each model once and keeps
    /// it for every later task (an actor, as in Ray Data's actor pools).
    Accelerator,
}

impl WorkerKind {
    /// The name `flumen worker --pool` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerKind::Cpu => "cpu",
            WorkerKind::Accelerator => "accelerator",
        }
    }
}

impl std::str::FromStr for WorkerKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(WorkerKind::Cpu),
            "accelerator" => Ok(WorkerKind::Accelerator),
            other => Err(format!(
                "a worker pool is 'cpu' or 'accelerator', not '{other}'"
            )),
        }
    }
}

/// What a worker says of itself (action `status`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// The pool it serves.
    pub kind: WorkerKind,
    /// Its process id.
    pub pid: u32,
    /// Tasks it has run.
    pub tasks: u64,
    /// Accelerator workers (models) it has loaded: one per model while it lives.
    pub model_loads: u64,
    /// Blocks it holds now.
    pub blocks_held: usize,
}

/// A block a task left in a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteBlockInfo {
    /// The ticket that fetches it.
    pub key: String,
    /// Output partition of the task's plan that produced it.
    pub tag: usize,
    /// Rows in the block.
    pub rows: usize,
    /// Bytes of its arrays in memory.
    pub bytes: u64,
}

/// Frame a task for the `run` action: header length (4 bytes, little endian), the header
/// as JSON, then the encoded plan.
pub fn encode_task(request: &TaskRequest, plan: &[u8]) -> Vec<u8> {
    let header = serde_json::to_vec(request).expect("task header serializes");
    let mut body = Vec::with_capacity(4 + header.len() + plan.len());
    body.extend_from_slice(&(header.len() as u32).to_le_bytes());
    body.extend_from_slice(&header);
    body.extend_from_slice(plan);
    body
}

fn decode_task(body: &[u8]) -> std::result::Result<(TaskRequest, &[u8]), String> {
    let len = body
        .get(..4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize)
        .ok_or("task body shorter than its header length")?;
    let header = body
        .get(4..4 + len)
        .ok_or("task body shorter than its header")?;
    let request = serde_json::from_slice(header).map_err(|e| format!("bad task header: {e}"))?;
    Ok((request, &body[4 + len..]))
}

/// A job for an accelerator worker's model thread: a task body and where to answer.
type ModelJob = (
    Vec<u8>,
    SessionContext,
    tokio::sync::oneshot::Sender<Result<Vec<(usize, RecordBatch)>>>,
);

/// The Flight service of one worker process.
pub struct WorkerService {
    ctx: SessionContext,
    kind: WorkerKind,
    blocks: Mutex<HashMap<String, RecordBatch>>,
    next_key: AtomicU64,
    tasks: AtomicU64,
    /// Accelerator workers: the one thread their tasks run on.
    model_thread: Option<std::sync::mpsc::Sender<ModelJob>>,
}

impl WorkerService {
    /// A worker whose tasks run in `ctx` (which must know the functions the plans call).
    pub fn new(ctx: SessionContext, kind: WorkerKind) -> Self {
        let model_thread = (kind == WorkerKind::Accelerator).then(start_model_thread);
        Self {
            ctx,
            kind,
            blocks: Mutex::new(HashMap::new()),
            next_key: AtomicU64::new(0),
            tasks: AtomicU64::new(0),
            model_thread,
        }
    }

    /// What this worker says of itself.
    pub fn status(&self) -> WorkerStatus {
        WorkerStatus {
            kind: self.kind,
            pid: std::process::id(),
            tasks: self.tasks.load(Ordering::Relaxed),
            model_loads: crate::accelerator::workers_loaded(),
            blocks_held: self.blocks.lock().unwrap().len(),
        }
    }

    /// Decode and run a task; keep its blocks.
    async fn run(&self, body: &[u8]) -> Result<Vec<RemoteBlockInfo>> {
        self.tasks.fetch_add(1, Ordering::Relaxed);
        let blocks = match &self.model_thread {
            Some(thread) => {
                let (reply, answer) = tokio::sync::oneshot::channel();
                thread
                    .send((body.to_vec(), self.ctx.clone(), reply))
                    .map_err(|_| DataFusionError::Execution("the model thread is gone".into()))?;
                answer.await.map_err(|_| {
                    DataFusionError::Execution("the model thread dropped a task".into())
                })??
            }
            None => run_task_body(body, &self.ctx).await?,
        };
        let mut kept = self.blocks.lock().unwrap();
        Ok(blocks
            .into_iter()
            .map(|(tag, block)| {
                let key = format!(
                    "{}-{}",
                    std::process::id(),
                    self.next_key.fetch_add(1, Ordering::Relaxed)
                );
                let info = RemoteBlockInfo {
                    key: key.clone(),
                    tag,
                    rows: block.num_rows(),
                    bytes: block.get_array_memory_size() as u64,
                };
                kept.insert(key, block);
                info
            })
            .collect())
    }
}

/// Decode a task body under the driver's settings it carries and run it into blocks.
async fn run_task_body(body: &[u8], ctx: &SessionContext) -> Result<Vec<(usize, RecordBatch)>> {
    let (request, plan) = decode_task(body).map_err(DataFusionError::Execution)?;
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
    plan_blocks(plan, task_ctx, request.target_rows).await
}

/// The thread an accelerator worker runs its tasks on, one at a time, so each model is
/// loaded once (accelerator UDFs keep their loaded state per thread).
fn start_model_thread() -> std::sync::mpsc::Sender<ModelJob> {
    let (jobs, queue) = std::sync::mpsc::channel::<ModelJob>();
    std::thread::Builder::new()
        .name("flumen-model".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime starts");
            for (body, ctx, reply) in queue {
                let result = runtime.block_on(run_task_body(&body, &ctx));
                let _ = reply.send(result);
            }
        })
        .expect("the model thread starts");
    jobs
}

/// Run every output partition of `plan` (at once: an exchange on top fills them together)
/// and cut the output into blocks of at most `target_rows` rows, tagged with their output
/// partition, in a fixed order: partition by partition, batch by batch. A worker and a
/// driver recomputing a lost block run the same plan through this, so block `i` of one run
/// is block `i` of the other.
pub async fn plan_blocks(
    plan: Arc<dyn ExecutionPlan>,
    task_ctx: Arc<TaskContext>,
    target_rows: usize,
) -> Result<Vec<(usize, RecordBatch)>> {
    let partitions = plan.output_partitioning().partition_count();
    let outputs = futures::future::try_join_all((0..partitions).map(|p| {
        let stream = plan.execute(p, Arc::clone(&task_ctx));
        async move {
            let batches: Vec<RecordBatch> = stream?.try_collect().await?;
            Ok::<_, DataFusionError>((p, batches))
        }
    }))
    .await?;
    let target = target_rows.max(1);
    let mut blocks = vec![];
    for (tag, batches) in outputs {
        for batch in batches {
            let mut offset = 0;
            while offset < batch.num_rows() {
                let len = target.min(batch.num_rows() - offset);
                blocks.push((tag, batch.slice(offset, len)));
                offset += len;
            }
        }
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
                let keys: Vec<String> = serde_json::from_slice(&action.body)
                    .map_err(|e| Status::invalid_argument(format!("bad release body: {e}")))?;
                let mut blocks = self.blocks.lock().unwrap();
                for key in keys {
                    blocks.remove(&key);
                }
                Ok(Response::new(one(arrow_flight::Result::default())))
            }
            "ping" => Ok(Response::new(one(arrow_flight::Result {
                body: b"pong".to_vec().into(),
            }))),
            "status" => Ok(Response::new(one(arrow_flight::Result {
                body: serde_json::to_vec(&self.status())
                    .expect("status serializes")
                    .into(),
            }))),
            other => Err(Status::unimplemented(format!("unknown action {other}"))),
        }
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> std::result::Result<Response<Self::DoGetStream>, Status> {
        let key = String::from_utf8_lossy(&request.into_inner().ticket).to_string();
        let block = self
            .blocks
            .lock()
            .unwrap()
            .remove(&key)
            .ok_or_else(|| Status::not_found(format!("no block {key} in this worker")))?;
        let input: BoxStream<'static, std::result::Result<RecordBatch, FlightError>> =
            futures::stream::once(async move { Ok(block) }).boxed();
        let stream = FlightDataEncoderBuilder::new()
            .build(input)
            .map_err(|e| Status::internal(e.to_string()));
        Ok(Response::new(stream.boxed()))
    }

    async fn handshake(
        &self,
        _request: Request<Streaming<HandshakeRequest>>,
    ) -> std::result::Result<Response<Self::HandshakeStream>, Status> {
        Err(Status::unimplemented("handshake"))
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

/// Largest message a worker accepts or sends: a task carries its input block inline (8,192
/// rows of web pages are ~10 MB, over tonic's 4 MiB default), so the bound is set by what one
/// block may hold, not by gRPC's default.
pub const MAX_TASK_BYTES: usize = 1 << 30;

/// Serve as a worker on `listen` (`host:port`; port 0 picks one). Prints
/// `flumen worker listening on HOST:PORT` on standard output once it accepts connections,
/// which is how a driver that started it learns its address.
pub async fn serve(listen: &str, kind: WorkerKind) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        DataFusionError::Execution(format!("worker cannot listen on {listen}: {e}"))
    })?;
    let address = listener.local_addr()?;
    let ctx = crate::session(crate::FlumenConfig::default());
    println!("flumen worker listening on {address}");
    use std::io::Write;
    std::io::stdout().flush()?;
    tonic::transport::Server::builder()
        .add_service(
            FlightServiceServer::new(WorkerService::new(ctx, kind))
                .max_decoding_message_size(MAX_TASK_BYTES)
                .max_encoding_message_size(MAX_TASK_BYTES),
        )
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await
        .map_err(|e| DataFusionError::Execution(format!("worker on {address} failed: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_frames_round_trip_and_garbage_is_an_error() {
        let request = TaskRequest {
            target_rows: 7,
            options: vec![("flumen.device".into(), "cpu".into())],
        };
        let body = encode_task(&request, b"plan-bytes");
        let (request, plan) = decode_task(&body).unwrap();
        assert_eq!(request.target_rows, 7);
        assert_eq!(request.options[0].1, "cpu");
        assert_eq!(plan, b"plan-bytes");
        assert!(decode_task(b"\xff\xff\xff\xffxx").is_err());
        assert!(decode_task(b"\x02").is_err());
    }
}
