//! What a driver and its workers say to each other over Arrow Flight: the task header, the
//! pools a worker serves, what a worker reports of itself and of the blocks it keeps.
//! (The actions themselves are listed in [`super::worker`].)

use datafusion::arrow::record_batch::RecordBatch;
use serde::{Deserialize, Serialize};

use crate::config::ExchangeCompression;
use crate::plan::graph::Pool;

/// What a driver asks of a worker with a task, besides the plan.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TaskRequest {
    /// Most rows per output block.
    pub target_rows: usize,
    /// How the task cuts the input blocks it reads into pieces of at most `target_rows`
    /// rows, as the driver would.
    #[serde(default)]
    pub piece_cut: crate::store::cutter::PieceCut,
    /// Most rows per batch the task hands its plan from its input blocks (the driver
    /// session's batch size, for a CPU task: `crate::plan::stage_input::TaskInputs::
    /// batch_rows`); `0`: the pieces as they were cut.
    #[serde(default)]
    pub input_batch_rows: usize,
    /// Most bytes of the task's output that come back with its reply
    /// ([`TaskEvent::Carried`]: its first blocks, while their sum fits) instead of staying
    /// in the worker (`flumen.carried_output_bytes`); 0: every block stays.
    #[serde(default)]
    pub carried_output_bytes: u64,
    /// A run's first source task: its blocks ramp up from this many rows (its scan reads
    /// batches that small); 0: no ramp (`crate::store::ramp`).
    #[serde(default)]
    pub first_block_rows: usize,
    /// Rows a ramped task's blocks grow to and its later blocks are cut at (0: the target).
    #[serde(default)]
    pub ramp_block_rows: usize,
    /// The task's partition of its operator (the block cutter's output split starts where
    /// a local task's would).
    #[serde(default)]
    pub partition: usize,
    /// Partitions of the task's operator.
    #[serde(default)]
    pub partitions: usize,
    /// The driver's session settings the task runs under (`flumen.model_dir`,
    /// `flumen.device`, ...), as `(key, value)`.
    #[serde(default)]
    pub options: Vec<(String, String)>,
    /// The query the task belongs to (a random token): its blocks are kept under it, and
    /// only tickets of the same query fetch or release them.
    #[serde(default)]
    pub query: String,
    /// The local files (object-store paths) the task may scan; a scan of any other file is
    /// refused.
    #[serde(default)]
    pub grants: Vec<String>,
    /// Where a block-wise task's input blocks come from, in bundle order; `None`: they are
    /// all in the plan (its one in-memory source holds them). With `Some`, the plan's
    /// in-memory source holds only the [`TaskInput::Inline`] ones and the worker fetches
    /// the others from the workers that keep them.
    #[serde(default)]
    pub inputs: Option<Vec<TaskInput>>,
    /// How many of `inputs` each of the plan's in-memory sources takes, in the order of the
    /// plan's leaves: a per-partition task has one source per stage input (a join's build
    /// and probe sides). Empty: one source takes them all (a block-wise task).
    #[serde(default)]
    pub input_sources: Vec<usize>,
    /// The object stores (other than local files) the task reads, with what it takes to
    /// reach each (credentials included): only those its plan scans.
    #[serde(default)]
    pub stores: Vec<crate::io::object_stores::StoreGrant>,
    /// A join's build keys over the task plan's output columns
    /// ([`crate::cluster::sent_keys::encode_keys`]), for a task of a join's build producer:
    /// the worker sums up its output's keys and sends the summary with `Done`
    /// ([`crate::plan::build_keys`]). Empty: no summary.
    #[serde(default)]
    pub build_keys: Vec<Vec<u8>>,
    /// How many tasks the build producer has, for which the worker sizes the set of its
    /// keys ([`crate::plan::key_membership`]); `0`: no set (`flumen.build_key_sets` off).
    #[serde(default)]
    pub build_key_set_tasks: usize,
    /// A task fed inputs while it runs (a join's probe side, sent as its producers make
    /// it): the feed's name, random, which the driver's [`FeedRequest`]s carry. Empty: the
    /// task has all its inputs when it starts.
    #[serde(default)]
    pub feed: String,
    /// The in-memory sources (indices into [`Self::input_sources`]) that the feed adds
    /// blocks to after the ones `inputs` gives them; they end when the feed ends.
    #[serde(default)]
    pub fed_sources: Vec<usize>,
}

/// What action `feed` carries: more input blocks for in-memory source `source` of a
/// running task fed as [`TaskRequest::feed`] names, or the feed's end. Framed by
/// [`encode_feed`]: the [`TaskInput::Inline`] blocks travel after it as Arrow IPC.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FeedRequest {
    /// The task's query.
    pub query: String,
    /// The task's feed ([`TaskRequest::feed`]).
    pub feed: String,
    /// The fed source the blocks go to ([`TaskRequest::fed_sources`]).
    pub source: usize,
    /// The blocks, in order.
    pub inputs: Vec<TaskInput>,
    /// Every fed source of the task has had all its blocks.
    pub end: bool,
}

/// One input block of a block-wise task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TaskInput {
    /// The `i`th batch of the plan's in-memory source (a block the driver held).
    Inline(usize),
    /// A block another worker keeps, fetched from it directly (it keeps the block until
    /// the driver releases it, so a retried task fetches it again).
    Fetch(InputTicket),
}

/// Where a worker fetches an input block from: the holder's address and the block's key
/// (of the task's own query).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputTicket {
    /// The holding worker's `host:port`.
    pub address: String,
    /// Whether it speaks TLS (checked against the fetching worker's trusted CA).
    pub tls: bool,
    /// The block's key.
    pub key: String,
    /// Bytes of the block (for the metrics).
    pub bytes: u64,
}

/// The words a task's error starts with when an input block could not be fetched from
/// its holder (gone, or dead): the driver then recomputes that input and retries the task.
pub const INPUT_LOST: &str = "input block lost";

/// What `do_get` takes: a block's key and the query that owns it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BlockTicket {
    /// The owning query's token.
    pub query: String,
    /// The block's key.
    pub key: String,
    /// Leave the block with the worker after sending it (a worker fetching a task's input:
    /// the driver releases it once the task is done); otherwise the worker drops it.
    #[serde(default)]
    pub keep: bool,
    /// How the worker compresses the block it sends (`flumen.exchange_compression`:
    /// `lz4`, `zstd`; empty: not at all).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub compression: String,
}

/// The `flumen.exchange_compression` of a task's `options` (a worker fetching the task's
/// inputs asks for it); none when the driver sent none (an older driver) or one this
/// worker cannot read.
pub fn exchange_compression(options: &[(String, String)]) -> ExchangeCompression {
    (options.iter())
        .find(|(key, _)| key == "flumen.exchange_compression")
        .and_then(|(_, value)| value.parse().ok())
        .unwrap_or(ExchangeCompression::None)
}

/// `compression` as a [`BlockTicket::compression`] for a block held at `holder`
/// (`host:port`): none from a worker on a loopback address, whose bytes never leave this
/// machine (a local pool's workers), where compressing would only cost CPU.
pub fn ticket_compression(compression: ExchangeCompression, holder: &str) -> String {
    if compression == ExchangeCompression::None || on_loopback(holder) {
        return String::new();
    }
    compression.to_string()
}

/// Whether `address` (`host:port`, `[v6]:port` or a bare host) names this machine's
/// loopback interface.
fn on_loopback(address: &str) -> bool {
    if let Ok(socket) = address.parse::<std::net::SocketAddr>() {
        return socket.ip().is_loopback();
    }
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

/// What action `release` takes: blocks of `query` to drop (all of its blocks when `keys` is
/// empty).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReleaseRequest {
    /// The owning query's token.
    pub query: String,
    /// The blocks' keys; empty: every block of the query.
    #[serde(default)]
    pub keys: Vec<String>,
}

/// The version of what driver and worker say to each other; a driver refuses workers that
/// speak another (they would misread a task, e.g. ignore its input tickets). 2: task inputs
/// by ticket. 3: a task's reply is a stream of [`TaskEvent`]s. 4: a worker announces its
/// identity and resources, and checks the driver's version at the first `status`. 5: a
/// task's inputs may fill several in-memory sources ([`TaskRequest::input_sources`]). 6: a
/// task carries DataFusion's settings that functions read as they run (the time zone), which
/// a worker of 5 refuses. 7: a task may be fed inputs while it runs (action `feed`,
/// [`FeedRequest`]). 8: each message of a task's reply is framed (header length, the event,
/// then rows), and a small output block may come back in it ([`TaskEvent::Carried`]).
pub const PROTOCOL_VERSION: u32 = 8;

/// Largest message a worker accepts or sends: a block-wise task carries its input blocks
/// inline (8,192 rows of web pages are ~10 MB, over tonic's 4 MiB default), so the bound is
/// set by what one task's input may hold, not by gRPC's default. Both ends set it.
pub const MAX_TASK_BYTES: usize = 1 << 30;

/// What a driver says when it first asks a worker's `status` (the body of that action): the
/// worker refuses a driver of another protocol, naming both versions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DriverHello {
    /// The driver's [`PROTOCOL_VERSION`].
    pub protocol: u32,
    /// The driver's flumen version (for the message).
    pub version: String,
}

impl DriverHello {
    /// This build's hello.
    pub fn ours() -> Self {
        Self {
            protocol: PROTOCOL_VERSION,
            version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// An accelerator a worker owns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// `cuda` (a CUDA device), or `cpu` (models compute on the worker's CPU).
    pub kind: String,
    /// Its index among the worker's devices of that kind.
    pub index: usize,
}

/// What a worker says of itself (action `status`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// The [`PROTOCOL_VERSION`] it speaks (absent, 0, before versions were numbered).
    #[serde(default)]
    pub protocol: u32,
    /// Its flumen version.
    #[serde(default)]
    pub version: String,
    /// Who it is: random, fresh at every start (a restarted worker at the same address is a
    /// new worker; its predecessor's blocks are gone).
    #[serde(default)]
    pub id: String,
    /// The name of the host it runs on.
    #[serde(default)]
    pub host: String,
    /// The pool it serves.
    pub kind: Pool,
    /// Tasks it runs at once (its share of the pool).
    #[serde(default)]
    pub slots: usize,
    /// The accelerators it owns (accelerator workers).
    #[serde(default)]
    pub devices: Vec<DeviceInfo>,
    /// Bytes of blocks it may keep (its memory budget).
    #[serde(default)]
    pub memory_budget: u64,
    /// The models installed where it looks for them (directory names).
    #[serde(default)]
    pub models: Vec<String>,
    /// Its process id.
    pub pid: u32,
    /// Tasks it has run.
    pub tasks: u64,
    /// Tasks that panicked (each failed alone; the worker lived on).
    #[serde(default)]
    pub task_panics: u64,
    /// Accelerator workers (models) it has loaded: one per model while it lives.
    pub model_loads: u64,
    /// Blocks it holds now.
    pub blocks_held: usize,
    /// Bytes of the blocks it holds in memory now (the others are in its spill files).
    #[serde(default)]
    pub block_bytes_in_memory: u64,
    /// Blocks it has written to its spill files, over its memory budget or a query's.
    #[serde(default)]
    pub blocks_spilled: u64,
    /// Input blocks its tasks read from its own kept blocks (no copy, no network).
    #[serde(default)]
    pub inputs_held_here: u64,
    /// Input blocks its tasks fetched from other workers.
    #[serde(default)]
    pub inputs_from_peers: u64,
    /// Bytes of those (as the driver sized them on the tickets).
    #[serde(default)]
    pub input_bytes_from_peers: u64,
    /// `release` calls it answered (a driver gathers the blocks it lets go of into few).
    #[serde(default)]
    pub release_calls: u64,
    /// Blocks those calls named by key.
    #[serde(default)]
    pub released_by_key: u64,
    /// The functions its tasks may call (a driver sends only plans calling these).
    #[serde(default)]
    pub functions: Vec<String>,
    /// The runtimes whose shipped functions it unpacks (`python3.12` for a worker started
    /// as `python -m flumen worker`; [`crate::cluster::shipped_functions`]).
    #[serde(default)]
    pub runtimes: Vec<String>,
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
    /// Its rows' digest ([`crate::store::block_digest`]): a retry's or recomputation's block
    /// at its place must have the same.
    #[serde(default)]
    pub digest: Option<u64>,
}

/// One message of a worker's reply to the `run` action, as JSON; the reply is a stream of
/// them, so the driver learns of each block as soon as it is cut and sees the task advance.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum TaskEvent {
    /// An output block, kept by the worker under the task's query (blocks come in output
    /// order: the `n`th is the task's block `n`).
    Block(RemoteBlockInfo),
    /// An output block that comes with this message instead of staying in the worker (its
    /// `key` is empty): a small output, within the task's `flumen.carried_output_bytes`.
    /// It counts in the task's blocks and order as a [`TaskEvent::Block`] does.
    Carried(RemoteBlockInfo),
    /// The task is producing output (`rows` so far) without a whole block yet: it is not
    /// stuck. Sent at most once every [`PROGRESS_EVERY`].
    Progress {
        /// Output rows of the task so far.
        rows: u64,
    },
    /// Bounds the task's aggregates and TopK sorts tightened while it runs
    /// ([`crate::cluster::sent_bounds::BoundWatch`]), which the driver counts in the tasks
    /// it launches meanwhile.
    Bounds {
        /// Each bound as it is now.
        bounds: Vec<crate::cluster::sent_bounds::SentBound>,
    },
    /// The task finished; it left `blocks` blocks. A reply that ends without it (or an
    /// error) did not finish.
    Done {
        /// Blocks the task left, all already announced.
        blocks: usize,
        /// DataFusion's counters of the task's plan that the driver shows (pruning,
        /// spilling: [`crate::cluster::plan_metrics`]).
        #[serde(default)]
        metrics: Vec<crate::cluster::plan_metrics::PlanMetric>,
        /// The figures of the models and the model-output cache the task used
        /// ([`crate::cluster::plan_metrics::TaskFigures::model`]).
        #[serde(default)]
        model: Vec<(String, u64)>,
        /// The bounds its aggregates and TopK sorts made ([`crate::cluster::sent_bounds`]).
        #[serde(default)]
        bounds: Vec<crate::cluster::sent_bounds::SentBound>,
        /// The summary of its output's keys, when the request named build keys.
        #[serde(default)]
        build_keys: Option<crate::cluster::sent_keys::SentKeys>,
    },
}

/// How often at most a worker says a task is still producing.
pub const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

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

/// Split a `run` action's body into its header and encoded plan.
pub fn decode_task(body: &[u8]) -> std::result::Result<(TaskRequest, &[u8]), String> {
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

/// Frame a `feed` action: header length (4 bytes, little endian), the header as JSON, then
/// `inline` (the blocks its [`TaskInput::Inline`]s name) as one Arrow IPC stream.
pub fn encode_feed(
    request: &FeedRequest,
    inline: &[RecordBatch],
) -> datafusion::error::Result<Vec<u8>> {
    let header = serde_json::to_vec(request).expect("feed header serializes");
    framed(&header, inline)
}

/// Split a `feed` action's body into its header and inline blocks.
pub fn decode_feed(body: &[u8]) -> std::result::Result<(FeedRequest, Vec<RecordBatch>), String> {
    unframed(body, "feed")
}

/// Frame one message of a task's reply: as [`encode_feed`], the event as its header and
/// the rows of a [`TaskEvent::Carried`] block after it.
pub fn encode_event(
    event: &TaskEvent,
    carried: Option<&RecordBatch>,
) -> datafusion::error::Result<Vec<u8>> {
    let header = serde_json::to_vec(event).expect("task events serialize");
    framed(
        &header,
        carried.map(std::slice::from_ref).unwrap_or_default(),
    )
}

/// Split a message of a task's reply into its event and the rows it carries (a
/// [`TaskEvent::Carried`] block's: exactly one batch).
pub fn decode_event(body: &[u8]) -> std::result::Result<(TaskEvent, Option<RecordBatch>), String> {
    let (event, mut rows) = unframed::<TaskEvent>(body, "task event")?;
    match (&event, rows.len()) {
        (TaskEvent::Carried(_), 1) => Ok((event, rows.pop())),
        (TaskEvent::Carried(_), n) => Err(format!("a carried block came with {n} batches")),
        (_, 0) => Ok((event, None)),
        (_, n) => Err(format!("a task event came with {n} batches")),
    }
}

/// Header length (4 bytes, little endian), `header`, then `batches` as one Arrow IPC
/// stream (nothing when there are none).
fn framed(header: &[u8], batches: &[RecordBatch]) -> datafusion::error::Result<Vec<u8>> {
    let mut body = Vec::with_capacity(4 + header.len());
    body.extend_from_slice(&(header.len() as u32).to_le_bytes());
    body.extend_from_slice(header);
    if let Some(first) = batches.first() {
        let mut writer =
            datafusion::arrow::ipc::writer::StreamWriter::try_new(&mut body, &first.schema())?;
        for batch in batches {
            writer.write(batch)?;
        }
        writer.finish()?;
    }
    Ok(body)
}

/// The header and batches of a [`framed`] body; `what` names it in errors.
fn unframed<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> std::result::Result<(T, Vec<RecordBatch>), String> {
    let (len, rest) = body
        .split_first_chunk::<4>()
        .ok_or_else(|| format!("{what} body shorter than its header length"))?;
    let len = u32::from_le_bytes(*len) as usize;
    let header = (rest.get(..len)).ok_or_else(|| format!("{what} body shorter than its header"))?;
    let header = serde_json::from_slice(header).map_err(|e| format!("bad {what} header: {e}"))?;
    let ipc = &rest[len..];
    if ipc.is_empty() {
        return Ok((header, vec![]));
    }
    let reader = datafusion::arrow::ipc::reader::StreamReader::try_new(ipc, None)
        .map_err(|e| format!("bad {what} blocks: {e}"))?;
    let batches = reader
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| format!("bad {what} blocks: {e}"))?;
    Ok((header, batches))
}

/// The error a task raised in a worker (`message`: the `DataFusionError` as the worker
/// printed it), made again as the same kind of error, so a query fails in worker mode with
/// the words it fails with in threads mode (`Arrow error: Cast error: ...`, `Error during
/// planning: ...`). `None` for kinds the driver does not make again (its caller then names
/// the task and worker around the message).
pub fn error_from_worker(message: &str) -> Option<datafusion::error::DataFusionError> {
    use datafusion::arrow::error::ArrowError;
    use datafusion::error::DataFusionError;
    let arrow = |message: &str| -> Option<ArrowError> {
        let text = |prefix: &str| message.strip_prefix(prefix).map(str::to_string);
        if message == "Divide by zero error" {
            return Some(ArrowError::DivideByZero);
        }
        text("Cast error: ")
            .map(ArrowError::CastError)
            .or_else(|| text("Compute error: ").map(ArrowError::ComputeError))
            .or_else(|| text("Arithmetic overflow: ").map(ArrowError::ArithmeticOverflow))
            .or_else(|| text("Invalid argument error: ").map(ArrowError::InvalidArgumentError))
            .or_else(|| text("Parser error: ").map(ArrowError::ParseError))
            .or_else(|| text("Schema error: ").map(ArrowError::SchemaError))
            .or_else(|| text("Not yet implemented: ").map(ArrowError::NotYetImplemented))
    };
    let text = |prefix: &str| message.strip_prefix(prefix).map(str::to_string);
    if let Some(rest) = message.strip_prefix("Arrow error: ") {
        return arrow(rest).map(|e| DataFusionError::ArrowError(Box::new(e), None));
    }
    text("Error during planning: ")
        .map(DataFusionError::Plan)
        .or_else(|| text("Execution error: ").map(DataFusionError::Execution))
        .or_else(|| text("Resources exhausted: ").map(DataFusionError::ResourcesExhausted))
        .or_else(|| text("This feature is not implemented: ").map(DataFusionError::NotImplemented))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_error_is_made_again_with_its_own_words() {
        use datafusion::arrow::error::ArrowError;
        use datafusion::error::DataFusionError;
        for error in [
            DataFusionError::ArrowError(
                Box::new(ArrowError::CastError("Cannot cast string 'c'".into())),
                None,
            ),
            DataFusionError::ArrowError(Box::new(ArrowError::DivideByZero), None),
            DataFusionError::Plan("Tdigest max_size value".into()),
            DataFusionError::Execution("Cannot cast column 's'".into()),
            DataFusionError::ResourcesExhausted("Failed to allocate".into()),
        ] {
            let again = error_from_worker(&error.to_string()).unwrap();
            assert_eq!(again.to_string(), error.to_string());
        }
        assert!(error_from_worker("Internal error: x").is_none());
        assert!(error_from_worker("Arrow error: External error: x").is_none());
    }

    #[test]
    fn task_frames_round_trip_and_garbage_is_an_error() {
        let request = TaskRequest {
            target_rows: 7,
            partition: 1,
            partitions: 2,
            options: vec![("flumen.device".into(), "cpu".into())],
            ..Default::default()
        };
        let body = encode_task(&request, b"plan-bytes");
        let (request, plan) = decode_task(&body).unwrap();
        assert_eq!(request.target_rows, 7);
        assert_eq!((request.partition, request.partitions), (1, 2));
        assert_eq!(request.options[0].1, "cpu");
        assert_eq!(plan, b"plan-bytes");
        assert!(decode_task(b"\xff\xff\xff\xffxx").is_err());
        assert!(decode_task(b"\x02").is_err());
    }

    #[test]
    fn blocks_are_sent_compressed_only_off_this_machine() {
        let options = |value: &str| vec![("flumen.exchange_compression".into(), value.into())];
        assert_eq!(
            exchange_compression(&options("lz4")),
            ExchangeCompression::Lz4
        );
        assert_eq!(
            exchange_compression(&options("bogus")),
            ExchangeCompression::None
        );
        assert_eq!(exchange_compression(&[]), ExchangeCompression::None);
        let zstd = ExchangeCompression::Zstd;
        for holder in [
            "127.0.0.1:7000",
            "[::1]:7000",
            "localhost:7000",
            "127.3.2.1",
        ] {
            assert_eq!(ticket_compression(zstd, holder), "", "{holder}");
        }
        for holder in ["10.1.2.3:7000", "[fe80::1]:7000", "worker-3.cluster:7000"] {
            assert_eq!(ticket_compression(zstd, holder), "zstd", "{holder}");
        }
        assert_eq!(
            ticket_compression(ExchangeCompression::None, "10.1.2.3:7000"),
            ""
        );
    }

    #[test]
    fn feed_frames_carry_their_inline_blocks() {
        use datafusion::arrow::array::Int64Array;
        use datafusion::arrow::record_batch::RecordBatch;
        let batch = RecordBatch::try_from_iter([(
            "k",
            std::sync::Arc::new(Int64Array::from(vec![1, 2, 3])) as _,
        )])
        .unwrap();
        let request = FeedRequest {
            query: "q".into(),
            feed: "f".into(),
            source: 1,
            inputs: vec![TaskInput::Inline(0), TaskInput::Inline(1)],
            end: false,
        };
        let body = encode_feed(&request, &[batch.clone(), batch.slice(1, 2)]).unwrap();
        let (again, inline) = decode_feed(&body).unwrap();
        assert_eq!((again.source, again.inputs.len()), (1, 2));
        assert_eq!(inline, vec![batch.clone(), batch.slice(1, 2)]);
        let end = FeedRequest {
            end: true,
            ..request
        };
        let (again, inline) = decode_feed(&encode_feed(&end, &[]).unwrap()).unwrap();
        assert!(again.end && inline.is_empty());
        assert!(decode_feed(b"\x09\x00\x00\x00{}").is_err());
    }

    /// A carried block's rows travel in its event's message, and only a carried block's:
    /// an event with rows it should not have, or a carried block without them, is garbage.
    #[test]
    fn a_carried_block_comes_with_its_rows_and_no_other_event_has_any() {
        use datafusion::arrow::array::StringArray;
        use datafusion::arrow::record_batch::RecordBatch;
        let batch = RecordBatch::try_from_iter([(
            "s",
            std::sync::Arc::new(StringArray::from(vec!["a", "bb", "ccc", "dddd"])) as _,
        )])
        .unwrap();
        let info = RemoteBlockInfo {
            key: String::new(),
            tag: 3,
            rows: 2,
            bytes: 64,
            digest: Some(7),
        };
        // A slice travels as its own rows.
        let rows = batch.slice(1, 2);
        let body = encode_event(&TaskEvent::Carried(info.clone()), Some(&rows)).unwrap();
        let (event, carried) = decode_event(&body).unwrap();
        assert!(matches!(event, TaskEvent::Carried(i) if i.tag == 3 && i.digest == Some(7)));
        assert_eq!(carried, Some(rows.clone()));

        let body = encode_event(&TaskEvent::Block(info.clone()), None).unwrap();
        assert!(matches!(
            decode_event(&body).unwrap(),
            (TaskEvent::Block(_), None)
        ));
        let progress = TaskEvent::Progress { rows: 9 };
        let body = encode_event(&progress, None).unwrap();
        assert!(matches!(
            decode_event(&body).unwrap(),
            (TaskEvent::Progress { rows: 9 }, None)
        ));

        let no_rows = encode_event(&TaskEvent::Carried(info.clone()), None).unwrap();
        assert!(decode_event(&no_rows).unwrap_err().contains("0 batches"));
        let stray = encode_event(&TaskEvent::Block(info), Some(&rows)).unwrap();
        assert!(
            decode_event(&stray)
                .unwrap_err()
                .contains("came with 1 batches")
        );
        assert!(decode_event(b"\x02\x00").is_err());
    }
}
