//! How a worker runs one task: decode its plan under the driver's settings, admit it
//! ([`crate::cluster::admission`]), put in its input blocks, run it and cut its output into
//! blocks with the one [`BlockCutter`], handing each block out as soon as it is cut
//! ([`Produced`]). A panic is the task's error; the worker lives on. Accelerator tasks run
//! one at a time on the worker's model thread, which keeps each model loaded.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use datafusion::prelude::SessionContext;
use futures::{FutureExt, StreamExt};

use crate::cluster::admission::{admit_options, admit_plan};
use crate::cluster::plan_metrics::{TaskFigures, carried};
use crate::cluster::protocol::{InputTicket, TaskInput, TaskRequest, decode_task};
use crate::cluster::sent_keys::{SentKeys, decode_keys};
use crate::cluster::task_output::{Produced, ProducedSender};
use crate::cluster::worker_memory::{TASK_MEMORY_LIMIT, TaskMemory};
use crate::config::FlumenConfig;
use crate::plan::build_keys::KeySummer;
use crate::plan::model_cache_lookup::take_lookup_figures;
use crate::plan::stage_input::in_batches_of;
use crate::store::block_memory::compact;
use crate::store::cutter::{BlockCutter, PieceCut, PieceCutter, batch_slices, bundle_pieces};

/// A job for an accelerator worker's model thread: a task body, its input blocks fetched
/// from other workers, the session, and where its output goes.
pub(crate) type ModelJob = (Vec<u8>, Vec<RecordBatch>, SessionContext, ProducedSender);

/// Reads one input block a task names by ticket: from the worker's own shelf, else from
/// the worker holding it.
pub(crate) type FetchBlock = Arc<
    dyn Fn(InputTicket) -> futures::future::BoxFuture<'static, Result<RecordBatch>> + Send + Sync,
>;

/// A task's input blocks named by ticket.
pub(crate) enum FetchedInputs {
    /// All fetched before the task starts, in order (a model's bundle, or inputs small
    /// beside the task's share of the budget: fetched together, their round trips overlap).
    Ready(Vec<RecordBatch>),
    /// Fetched as the task's plan reads them, a few ahead: a CPU task holds what its
    /// operators keep and the blocks in flight, not its whole input (a join partition out
    /// of core, a merge of sorted runs). The [`FedSources`] go on reading the blocks the
    /// driver feeds them while the task runs.
    OnDemand(FetchBlock, FedSources),
    /// A fed task's first inputs, all fetched before it starts (small beside its share, as
    /// for [`Self::Ready`]); its [`FedSources`] then read what the driver feeds them, fetched
    /// as the plan reads them.
    ReadyThenFed(Vec<RecordBatch>, FetchBlock, FedSources),
}

/// The in-memory sources of a fed task ([`crate::cluster::protocol::TaskRequest::feed`]),
/// by index, each with the blocks the driver feeds it after its first ones; a source ends
/// when its sender is dropped (the feed's end).
pub(crate) type FedSources =
    std::collections::HashMap<usize, tokio::sync::mpsc::UnboundedReceiver<InputBlock>>;

/// Input blocks a task reading on demand fetches ahead of its plan, over all its in-memory
/// sources (at least one and at most three per source: a merge of many sorted runs holds
/// one block of each).
const BLOCKS_FETCHED_AHEAD: usize = 6;

/// Input blocks a fed source fetches ahead of its plan.
const FED_BLOCKS_FETCHED_AHEAD: usize = 16;

/// The words a panicking task's error carries.
pub(crate) const PANICKED: &str = "task panicked";

/// Run a task body to its end, handing out its blocks and then [`Produced::Finished`]; a
/// panic is the task's error (the worker lives on). Returns whether it panicked.
/// `operator_memory`: the pool its operators run under ([`TaskMemory`]), `None` for the
/// session's.
pub(crate) async fn run_task(
    body: &[u8],
    fetched: FetchedInputs,
    operator_memory: Option<TaskMemory>,
    ctx: &SessionContext,
    out: &ProducedSender,
) -> bool {
    let mut hand_out = |item| {
        // The caller gone (the driver gave up): the task's output has nowhere to go.
        let _ = out.send(item);
    };
    let result = AssertUnwindSafe(run_task_body(
        body,
        fetched,
        operator_memory,
        ctx,
        out,
        &mut hand_out,
    ))
    .catch_unwind()
    .await;
    let (result, panicked) = match result {
        Ok(result) => (result, false),
        Err(panic) => {
            let message = crate::panic_message(&*panic);
            log::warn!("flumen worker: {PANICKED}: {message}");
            let error = DataFusionError::Execution(format!(
                "{PANICKED} in worker {}: {message}",
                std::process::id()
            ));
            (Err(error), true)
        }
    };
    let _ = out.send(Produced::Finished(result));
    panicked
}

/// Decode a task body under the driver's settings it carries, check it against what a
/// worker runs, put in the input blocks `fetched` from other workers, and run it, watched
/// meanwhile ([`crate::cluster::task_watch`], telling `watched_to`).
async fn run_task_body(
    body: &[u8],
    fetched: FetchedInputs,
    operator_memory: Option<TaskMemory>,
    ctx: &SessionContext,
    watched_to: &ProducedSender,
    out: &mut (dyn FnMut(Produced) + Send),
) -> Result<TaskFigures> {
    let (request, plan) = decode_task(body).map_err(DataFusionError::Execution)?;
    admit_options(&request.options)?;
    let mut config = ctx.copied_config();
    // The task's memory limit is no setting of its config: it bounds its memory pool
    // (`operator_memory`).
    for (key, value) in (request.options.iter()).filter(|(key, _)| key != TASK_MEMORY_LIMIT) {
        config.options_mut().set(key, value)?;
    }
    if let Some(bytes) = operator_memory.as_ref().map(|memory| memory.share) {
        // A sort reserves memory for merging its spill files up front, and concatenates
        // what it holds below a threshold: both within a quarter of the task's share, as
        // on the driver, or it could never start under a small budget.
        let quarter = usize::try_from(bytes / 4).unwrap_or(usize::MAX);
        let execution = &mut config.options_mut().execution;
        execution.sort_spill_reservation_bytes =
            execution.sort_spill_reservation_bytes.min(quarter);
        execution.sort_in_place_threshold_bytes =
            execution.sort_in_place_threshold_bytes.min(quarter);
    }
    // Decoded under the driver's settings: model calls read them from their expressions.
    // The task's context is made from the session's runtime directly: a `SessionState`
    // built per task (three, with stores and a memory share) cost a worker about 2 ms of its
    // ~4 ms for a small task in a debug build. It holds none of the session's functions
    // (copying ~400 of them, each set to the task's settings, was a worker's largest cost
    // per task after decoding): the decode finds those its plan calls in the session, and a
    // plan running on a worker never looks one up by name (a scan of `information_schema`,
    // which does, cannot be encoded and runs on the driver).
    let runtime = with_granted_stores(ctx.runtime_env(), &request)?;
    let runtime = with_operator_memory(runtime, operator_memory)?;
    let task_ctx = Arc::new(TaskContext::new(
        None,
        ctx.session_id(),
        config,
        HashMap::new(),
        HashMap::new(),
        HashMap::new(),
        HashMap::new(),
        runtime,
    ));
    let plan = crate::cluster::task_plan::decode_calling(plan, &task_ctx, Some(ctx))?;
    let stores: Vec<String> = request.stores.iter().map(|g| g.url.clone()).collect();
    admit_plan(&plan, &request.grants, &stores)?;
    let plan = match &request.inputs {
        Some(_) => with_inputs(plan, &request, fetched)?,
        None => plan,
    };
    let watching = crate::cluster::task_watch::watch(&plan, watched_to);
    let build_keys = if request.build_keys.is_empty() {
        plan_blocks(Arc::clone(&plan), Arc::clone(&task_ctx), &request, out).await?;
        None
    } else {
        summed_keys(&plan, &task_ctx, &request, out).await?
    };
    drop(watching);
    let flumen = (task_ctx.session_config().options().extensions).get::<FlumenConfig>();
    Ok(TaskFigures {
        plan: carried(&plan),
        model: model_figures(&plan, flumen),
        bounds: crate::cluster::sent_bounds::made_in(&plan),
        build_keys,
    })
}

/// [`plan_blocks`] for a task of a join's build producer: each block's keys (those the
/// request names) are summed up as it is handed out ([`crate::plan::build_keys`]). The
/// summary is `None` where the keys could not be read or summed up (a key type without an
/// order): the task runs all the same, and its join goes without a bound.
async fn summed_keys(
    plan: &Arc<dyn ExecutionPlan>,
    task_ctx: &Arc<TaskContext>,
    request: &TaskRequest,
    out: &mut (dyn FnMut(Produced) + Send),
) -> Result<Option<SentKeys>> {
    let schema = plan.schema();
    let mut summer = decode_keys(&request.build_keys, &schema, task_ctx)
        .and_then(|keys| KeySummer::new(keys, &schema, request.build_key_set_tasks));
    let mut summing = |item: Produced| {
        let failed = match (&item, &mut summer) {
            (Produced::Block(_, block), Ok(summing)) => summing.observe(block).err(),
            _ => None,
        };
        if let Some(e) = failed {
            summer = Err(e);
        }
        out(item)
    };
    plan_blocks(
        Arc::clone(plan),
        Arc::clone(task_ctx),
        request,
        &mut summing,
    )
    .await?;
    let sent = summer
        .and_then(KeySummer::finish)
        .and_then(|summary| SentKeys::of(&summary));
    if let Err(e) = &sent {
        log::info!("a task's build keys are not summed up: {e}");
    }
    Ok(sent.ok())
}

/// The figures of the models and the model-output cache a task that ran `plan` used, as
/// the driver's threads count them: the models loaded on this thread and the cache's fills
/// here (an accelerator worker's one model thread runs one task at a time), and what the
/// plan's cache lookups read (`flumen`: the task's settings).
fn model_figures(
    plan: &Arc<dyn ExecutionPlan>,
    flumen: Option<&FlumenConfig>,
) -> Vec<(String, u64)> {
    let mut figures = crate::functions::accelerator::used_worker_metrics();
    figures.extend(crate::functions::model_cache::take_figures());
    if let Some(flumen) = flumen {
        figures.extend(take_lookup_figures(plan, flumen));
    }
    figures
}

/// `runtime` with the object stores the task names (and only those, besides local files)
/// in a registry of its own: the credentials a task carries serve that task alone.
fn with_granted_stores(runtime: Arc<RuntimeEnv>, request: &TaskRequest) -> Result<Arc<RuntimeEnv>> {
    use datafusion::execution::object_store::{DefaultObjectStoreRegistry, ObjectStoreRegistry};
    if request.stores.is_empty() {
        return Ok(runtime);
    }
    let registry = DefaultObjectStoreRegistry::new();
    for grant in &request.stores {
        let store = crate::io::object_stores::store_for_location(
            &grant.url,
            &grant.options,
            // The grant holds every setting the store needs; a worker's environment has no
            // credentials of its own.
            &crate::io::object_stores::CloudIdentity::Environment,
        )?;
        if let Some((url, store)) = store {
            registry.register_store(&url, store);
        }
    }
    RuntimeEnvBuilder::from_runtime_env(&runtime)
        .with_object_store_registry(Arc::new(registry))
        .build_arc()
}

/// `runtime` whose operators run under `memory`'s pool, as a runtime of its own;
/// `runtime` as it is for `None`.
fn with_operator_memory(
    runtime: Arc<RuntimeEnv>,
    memory: Option<TaskMemory>,
) -> Result<Arc<RuntimeEnv>> {
    let Some(memory) = memory else {
        return Ok(runtime);
    };
    RuntimeEnvBuilder::from_runtime_env(&runtime)
        .with_memory_pool(memory.pool)
        .build_arc()
}

/// Put a task's input blocks into its plan's in-memory sources: the inline batches each
/// source carries and the `fetched` ones, in the order `inputs` gives, each source taking
/// as many as `input_sources` says (all: one source), cut as the driver cuts a bundle
/// ([`bundle_pieces`]). The sources are taken in the order of the plan's leaves, as the
/// driver listed them.
fn with_inputs(
    plan: Arc<dyn ExecutionPlan>,
    request: &TaskRequest,
    fetched: FetchedInputs,
) -> Result<Arc<dyn ExecutionPlan>> {
    let inputs = request.inputs.as_deref().unwrap_or_default();
    let counts = match request.input_sources.as_slice() {
        [] => vec![inputs.len()],
        counts => counts.to_vec(),
    };
    if counts.iter().sum::<usize>() != inputs.len() {
        return Err(DataFusionError::Execution(format!(
            "a task's input sources take {} inputs, it has {}",
            counts.iter().sum::<usize>(),
            inputs.len()
        )));
    }
    let (ready, on_demand, mut fed) = match fetched {
        FetchedInputs::Ready(blocks) => (Some(blocks), None, FedSources::new()),
        FetchedInputs::OnDemand(fetch, fed) => (None, Some(fetch), fed),
        FetchedInputs::ReadyThenFed(blocks, fetch, fed) => (Some(blocks), Some(fetch), fed),
    };
    let prefetched = ready.is_some();
    let mut ready = ready.unwrap_or_default().into_iter();
    let mut remaining = inputs;
    let mut sources = 0;
    let plan = plan
        .transform_up(|node| {
            let Some(memory) = node
                .downcast_ref::<DataSourceExec>()
                .and_then(|source| source.data_source().downcast_ref::<MemorySourceConfig>())
            else {
                return Ok(Transformed::no(node));
            };
            let Some(&count) = counts.get(sources) else {
                return Err(DataFusionError::Execution(format!(
                    "a task with input tickets has more than its {} in-memory sources",
                    counts.len()
                )));
            };
            let more = fed.remove(&sources);
            sources += 1;
            let (own, rest) = remaining.split_at(count);
            remaining = rest;
            let inline: Vec<&RecordBatch> = memory.partitions().iter().flatten().collect();
            let mut blocks = Vec::with_capacity(own.len());
            for input in own {
                let block = match input {
                    TaskInput::Inline(i) => inline.get(*i).map(|b| InputBlock::Here((*b).clone())),
                    TaskInput::Fetch(_) if prefetched => ready.next().map(InputBlock::Here),
                    TaskInput::Fetch(ticket) => Some(InputBlock::Ticket(ticket.clone())),
                };
                blocks.push(block.ok_or_else(|| {
                    DataFusionError::Execution(format!("task input {input:?} is missing"))
                })?);
            }
            let schema = node.schema();
            // The order the driver's source declared (a partition's blocks, in order).
            let ordering = memory.sort_information().to_vec();
            let streams = more.is_some() || !prefetched;
            let source: Arc<dyn ExecutionPlan> = match on_demand.as_ref().filter(|_| streams) {
                Some(fetch) => {
                    // A fed source (a join's probe side) is read as it streams by: more of
                    // its blocks in flight keep its round trips from pacing the join.
                    let ahead = match more.is_some() {
                        true => FED_BLOCKS_FETCHED_AHEAD,
                        false => (BLOCKS_FETCHED_AHEAD / counts.len().max(1)).clamp(1, 3),
                    };
                    let blocks = Arc::new(OnDemandBlocks {
                        schema: Arc::clone(&schema),
                        blocks,
                        more: std::sync::Mutex::new(more),
                        fetch: Arc::clone(fetch),
                        target_rows: request.target_rows,
                        piece_cut: request.piece_cut,
                        batch_rows: request.input_batch_rows,
                        ahead,
                    });
                    Arc::new(StreamingTableExec::try_new(
                        schema,
                        vec![blocks],
                        None,
                        ordering,
                        false,
                        None,
                    )?)
                }
                None => {
                    let here = blocks.into_iter().map(|b| match b {
                        InputBlock::Here(batch) => batch,
                        InputBlock::Ticket(_) => unreachable!("every block was fetched"),
                    });
                    let pieces = bundle_pieces(
                        &schema,
                        here.collect(),
                        request.target_rows,
                        request.piece_cut,
                    )?;
                    let pieces = (pieces.into_iter())
                        .flat_map(|piece| batch_slices(piece, request.input_batch_rows))
                        .collect();
                    let source = MemorySourceConfig::try_new(&[pieces], schema, None)?
                        .try_with_sort_information(ordering)?;
                    DataSourceExec::from_data_source(source)
                }
            };
            Ok(Transformed::yes(source))
        })?
        .data;
    if sources != counts.len() {
        return Err(DataFusionError::Execution(format!(
            "a task with input tickets must have {} in-memory sources, this one has {sources}",
            counts.len()
        )));
    }
    if let Some(source) = fed.keys().next() {
        return Err(DataFusionError::Execution(format!(
            "a task is fed in-memory source {source}, of {sources} it has"
        )));
    }
    Ok(plan)
}

/// One input block of a task's in-memory source: carried in the request, or named by
/// ticket and fetched when read.
#[derive(Debug, Clone)]
pub(crate) enum InputBlock {
    /// The block itself.
    Here(RecordBatch),
    /// Where to fetch it.
    Ticket(InputTicket),
}

/// An in-memory source of a worker's task whose blocks are fetched as the plan reads them
/// (`ahead` ahead), cut into the pieces [`bundle_pieces`] makes: `blocks`, then, for a fed
/// source, those the driver feeds it (`more`) until the feed ends.
struct OnDemandBlocks {
    schema: datafusion::arrow::datatypes::SchemaRef,
    blocks: Vec<InputBlock>,
    more: std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<InputBlock>>>,
    fetch: FetchBlock,
    target_rows: usize,
    piece_cut: PieceCut,
    /// Most rows per batch handed on ([`TaskRequest::input_batch_rows`]).
    batch_rows: usize,
    ahead: usize,
}

impl std::fmt::Debug for OnDemandBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnDemandBlocks")
            .field("blocks", &self.blocks.len())
            .finish_non_exhaustive()
    }
}

impl PartitionStream for OnDemandBlocks {
    fn schema(&self) -> &datafusion::arrow::datatypes::SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let fetch = Arc::clone(&self.fetch);
        let more =
            match self.more.lock().unwrap().take() {
                Some(more) => futures::stream::unfold(more, |mut more| async move {
                    Some((more.recv().await?, more))
                })
                .boxed(),
                None => futures::stream::empty().boxed(),
            };
        let blocks = futures::stream::iter(self.blocks.clone())
            .chain(more)
            .map(move |block| match block {
                InputBlock::Here(batch) => futures::future::ready(Ok(batch)).boxed(),
                InputBlock::Ticket(ticket) => fetch(ticket),
            })
            .buffered(self.ahead);
        let cutter = PieceCutter::new(&self.schema, self.target_rows, self.piece_cut);
        let pieces = futures::stream::unfold(
            (blocks, cutter, std::collections::VecDeque::new(), false),
            |(mut blocks, mut cutter, mut ready, mut ended)| async move {
                loop {
                    if let Some(piece) = ready.pop_front() {
                        return Some((Ok(piece), (blocks, cutter, ready, ended)));
                    }
                    if ended {
                        return None;
                    }
                    match blocks.next().await {
                        Some(Ok(block)) => match cutter.push(block) {
                            Ok(pieces) => ready.extend(pieces),
                            Err(e) => return Some((Err(e), (blocks, cutter, ready, true))),
                        },
                        Some(Err(e)) => return Some((Err(e), (blocks, cutter, ready, true))),
                        None => {
                            ended = true;
                            match cutter.finish() {
                                Ok(last) => ready.extend(last),
                                Err(e) => return Some((Err(e), (blocks, cutter, ready, true))),
                            }
                        }
                    }
                }
            },
        );
        in_batches_of(
            Box::pin(RecordBatchStreamAdapter::new(
                Arc::clone(&self.schema),
                pieces,
            )),
            self.batch_rows,
        )
    }
}

/// The thread an accelerator worker runs its tasks on, one at a time, so each model is
/// loaded once (accelerator UDFs keep their loaded state per thread). A task that panics
/// fails alone: the thread hands its queue to a fresh thread (whose models load anew, as
/// the panic may have left the old ones half-updated) and ends.
pub(crate) fn start_model_thread() -> std::sync::mpsc::Sender<ModelJob> {
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
            while let Ok((body, fetched, ctx, out)) = queue.recv() {
                if out.is_closed() {
                    // The driver gave up on it while it waited its turn.
                    continue;
                }
                if runtime.block_on(run_task(
                    &body,
                    FetchedInputs::Ready(fetched),
                    None,
                    &ctx,
                    &out,
                )) {
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
/// of the same partition would, handing each block to `out` as it is cut: when an exchange
/// is on top (the operator's output split) its input is split, coalesced and sliced by the
/// cutter; otherwise each output partition in turn is sliced. A worker and a driver
/// recomputing a lost block run the same plan through this, so block `i` of one run is
/// block `i` of the other.
pub async fn plan_blocks(
    plan: Arc<dyn ExecutionPlan>,
    task_ctx: Arc<TaskContext>,
    request: &TaskRequest,
    out: &mut (dyn FnMut(Produced) + Send),
) -> Result<()> {
    let partitions = request.partitions.max(1);
    let mut rows = 0;
    if let Some(exchange) = plan.downcast_ref::<RepartitionExec>()
        && exchange.input().output_partitioning().partition_count() == 1
    {
        let input = Arc::clone(exchange.input());
        let cutter = BlockCutter::new(
            input.schema(),
            Some(exchange.partitioning()),
            request.partition,
            partitions,
            request.target_rows,
        )?
        .with_ramp(request.first_block_rows, request.ramp_block_rows);
        let stream = input.execute(0, task_ctx)?;
        return cut_stream(stream, cutter, &mut rows, out).await;
    }
    let outputs = plan.output_partitioning().partition_count();
    for p in 0..outputs {
        // One output partition: its blocks carry the task's partition, as a local task's.
        let tag = if outputs == 1 { request.partition } else { p };
        let cutter = BlockCutter::new(plan.schema(), None, tag, partitions, request.target_rows)?
            .with_ramp(request.first_block_rows, request.ramp_block_rows);
        let stream = plan.execute(p, Arc::clone(&task_ctx))?;
        cut_stream(stream, cutter, &mut rows, out).await?;
    }
    Ok(())
}

/// Cut `stream` with `cutter`, handing each block to `out` as it is cut and the output rows
/// so far (`rows`, counted on) after each batch.
async fn cut_stream(
    mut stream: SendableRecordBatchStream,
    mut cutter: BlockCutter,
    rows: &mut usize,
    out: &mut (dyn FnMut(Produced) + Send),
) -> Result<()> {
    let mut cut = vec![];
    let mut hand_out = |cut: &mut Vec<(usize, RecordBatch)>, rows: usize| {
        for (tag, block) in cut.drain(..) {
            out(Produced::Block(tag, compact(block).0));
        }
        out(Produced::Rows(rows));
    };
    while let Some(batch) = stream.next().await {
        let batch = batch?;
        *rows += batch.num_rows();
        cutter.push(batch, &mut cut)?;
        hand_out(&mut cut, *rows);
    }
    cutter.finish(&mut cut)?;
    hand_out(&mut cut, *rows);
    Ok(())
}

/// [`plan_blocks`], its blocks collected: `(tag, block)` in output order.
pub async fn collect_blocks(
    plan: Arc<dyn ExecutionPlan>,
    task_ctx: Arc<TaskContext>,
    request: &TaskRequest,
) -> Result<Vec<(usize, RecordBatch)>> {
    let mut blocks = vec![];
    let mut keep = |item| {
        if let Produced::Block(tag, block) = item {
            blocks.push((tag, block));
        }
    };
    plan_blocks(plan, task_ctx, request, &mut keep).await?;
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use datafusion::arrow::array::{AsArray, Int64Array};
    use datafusion::arrow::datatypes::{DataType, Field, Int64Type, Schema};
    use datafusion::physical_plan::collect;
    use datafusion::prelude::SessionContext;

    use super::*;

    fn ticket(key: &str) -> InputTicket {
        InputTicket {
            address: "127.0.0.1:1".into(),
            tls: false,
            key: key.into(),
            bytes: 0,
        }
    }

    /// A task over 5 blocks of 700 ids (one carried inline, four by ticket) reads the same
    /// rows in the same pieces whether its blocks were fetched before it started, as its
    /// plan read them, or fed to it while it ran; read on demand, no block is fetched
    /// before the plan runs.
    #[tokio::test]
    async fn inputs_read_on_demand_or_fed_come_in_the_pieces_fetched_ones_do() {
        let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
        let block = |i: i64| {
            let ids = Int64Array::from_iter_values(i * 700..(i + 1) * 700);
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(ids)]).unwrap()
        };
        let by_key: HashMap<String, RecordBatch> =
            (1..5).map(|i| (format!("k{i}"), block(i))).collect();
        let mut inputs = vec![TaskInput::Inline(0)];
        inputs.extend((1..5).map(|i| TaskInput::Fetch(ticket(&format!("k{i}")))));
        // Exact pieces: most of them span two blocks, the strictest case for the three
        // ways to agree on.
        let request = TaskRequest {
            target_rows: 1_000,
            piece_cut: PieceCut::Exact,
            inputs: Some(inputs.clone()),
            ..Default::default()
        };
        // Fed: the inline block and k1 at the start, the rest while it runs.
        let fed_request = TaskRequest {
            inputs: Some(inputs[..2].to_vec()),
            fed_sources: vec![0],
            ..request.clone()
        };
        let plan: Arc<dyn ExecutionPlan> = Arc::new(DataSourceExec::new(Arc::new(
            MemorySourceConfig::try_new(&[vec![block(0)]], Arc::clone(&schema), None).unwrap(),
        )));
        let fetched = Arc::new(Mutex::new(vec![]));
        let log = Arc::clone(&fetched);
        let fetch: FetchBlock = Arc::new(move |ticket: InputTicket| {
            log.lock().unwrap().push(ticket.key.clone());
            let batch = by_key[&ticket.key].clone();
            async move { Ok(batch) }.boxed()
        });
        let ready: Vec<RecordBatch> = (1..5).map(block).collect();
        let (feed, fed) = tokio::sync::mpsc::unbounded_channel();
        let mut feed = Some(feed);
        let task_ctx = SessionContext::new().task_ctx();
        let ways = [
            (&request, FetchedInputs::Ready(ready)),
            (
                &request,
                FetchedInputs::OnDemand(Arc::clone(&fetch), FedSources::new()),
            ),
            (
                &fed_request,
                FetchedInputs::OnDemand(fetch, FedSources::from([(0, fed)])),
            ),
        ];
        let mut runs = vec![];
        for (request, inputs) in ways {
            let on_demand = matches!(inputs, FetchedInputs::OnDemand(..));
            let plan = with_inputs(Arc::clone(&plan), request, inputs).unwrap();
            assert_eq!(plan.name() == "StreamingTableExec", on_demand);
            assert!(
                fetched.lock().unwrap().is_empty(),
                "fetched before the plan ran"
            );
            if !request.fed_sources.is_empty() {
                // Fed after the start: two by ticket, one carried; then the feed ends.
                let feed = feed.take().unwrap();
                for i in 2..4 {
                    let ticket = ticket(&format!("k{i}"));
                    feed.send(InputBlock::Ticket(ticket)).unwrap();
                }
                feed.send(InputBlock::Here(block(4))).unwrap();
            }
            let batches = collect(plan, Arc::clone(&task_ctx)).await.unwrap();
            let pieces: Vec<Vec<i64>> = batches
                .iter()
                .map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
                .collect();
            runs.push((pieces, std::mem::take(&mut *fetched.lock().unwrap())));
        }
        assert_eq!(runs[0].0, runs[1].0);
        assert_eq!(runs[0].0, runs[2].0);
        assert_eq!(
            runs[0].0.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![1_000, 1_000, 1_000, 500]
        );
        assert_eq!(runs[0].0.concat(), (0..3_500).collect::<Vec<i64>>());
        assert!(runs[0].1.is_empty());
        assert_eq!(runs[1].1, ["k1", "k2", "k3", "k4"]);
        assert_eq!(runs[2].1, ["k1", "k2", "k3"]);
    }

    /// A CPU task's plan is handed its input blocks in batches of at most the driver
    /// session's batch size (`input_batch_rows`), fetched before it starts or as it reads
    /// them, as DataFusion's own streams would hand them; `0` hands the pieces as cut.
    #[tokio::test]
    async fn input_blocks_are_handed_in_batches_of_the_sessions_batch_size() {
        let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
        let block_schema = Arc::clone(&schema);
        let block = move |i: i64| {
            let ids = Int64Array::from_iter_values(i * 700..(i + 1) * 700);
            RecordBatch::try_new(Arc::clone(&block_schema), vec![Arc::new(ids)]).unwrap()
        };
        let plan: Arc<dyn ExecutionPlan> = Arc::new(DataSourceExec::new(Arc::new(
            MemorySourceConfig::try_new(&[vec![]], Arc::clone(&schema), None).unwrap(),
        )));
        let fetched_block = block.clone();
        let fetch: FetchBlock = Arc::new(move |ticket: InputTicket| {
            let batch = fetched_block(ticket.key.parse().unwrap());
            async move { Ok(batch) }.boxed()
        });
        let task_ctx = SessionContext::new().task_ctx();
        for batch_rows in [0, 300] {
            let request = TaskRequest {
                target_rows: 8_192,
                input_batch_rows: batch_rows,
                inputs: Some(
                    (0..3)
                        .map(|i| TaskInput::Fetch(ticket(&i.to_string())))
                        .collect(),
                ),
                ..Default::default()
            };
            let ways = [
                FetchedInputs::Ready((0..3).map(&block).collect()),
                FetchedInputs::OnDemand(Arc::clone(&fetch), FedSources::new()),
            ];
            for inputs in ways {
                let plan = with_inputs(Arc::clone(&plan), &request, inputs).unwrap();
                let batches = collect(plan, Arc::clone(&task_ctx)).await.unwrap();
                let rows: Vec<usize> = batches.iter().map(RecordBatch::num_rows).collect();
                // Small blocks are gathered into one piece first (`PieceCut::KeepLargeBlocks`).
                let want = match batch_rows {
                    0 => vec![2_100],
                    _ => vec![300; 7],
                };
                assert_eq!(rows, want, "batch rows {batch_rows}");
                let ids: Vec<i64> = (batches.iter())
                    .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
                    .collect();
                assert_eq!(ids, (0..2_100).collect::<Vec<i64>>());
            }
        }
    }
}
