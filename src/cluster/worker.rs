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
//! A worker serves one of the driver's pools ([`Pool`]): a CPU worker runs several
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
use tonic::{Request, Response, Status, Streaming};

use datafusion::physical_plan::repartition::RepartitionExec;

use crate::cluster::protocol::{RemoteBlockInfo, TaskRequest, WorkerStatus, decode_task};
use crate::plan::graph::Pool;
use crate::store::cutter::BlockCutter;

/// A job for an accelerator worker's model thread: a task body and where to answer.
type ModelJob = (
    Vec<u8>,
    SessionContext,
    tokio::sync::oneshot::Sender<Result<Vec<(usize, RecordBatch)>>>,
);

/// The Flight service of one worker process.
pub struct WorkerService {
    ctx: SessionContext,
    kind: Pool,
    blocks: Mutex<HashMap<String, RecordBatch>>,
    next_key: AtomicU64,
    tasks: AtomicU64,
    /// Accelerator workers: the one thread their tasks run on.
    model_thread: Option<std::sync::mpsc::Sender<ModelJob>>,
}

impl WorkerService {
    /// A worker whose tasks run in `ctx` (which must know the functions the plans call).
    pub fn new(ctx: SessionContext, kind: Pool) -> Self {
        let model_thread = (kind == Pool::Accelerator).then(start_model_thread);
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
            model_loads: crate::functions::accelerator::workers_loaded(),
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
    plan_blocks(plan, task_ctx, &request).await
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

/// Serve as a worker on `listen` (`host:port`; port 0 picks one), running tasks in `ctx`
/// (a flumen session: it must know every function the driver's plans call). Prints
/// `flumen worker listening on HOST:PORT` on standard output once it accepts connections,
/// which is how a driver that started it learns its address.
pub async fn serve(listen: &str, kind: Pool, ctx: SessionContext) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        DataFusionError::Execution(format!("worker cannot listen on {listen}: {e}"))
    })?;
    let address = listener.local_addr()?;
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
