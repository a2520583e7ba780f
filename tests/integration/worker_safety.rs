//! Workers that cannot be abused, cannot hang a query and leak nothing: a hostile client
//! against a real `flumen worker` process, stuck and panicking functions in real worker
//! processes (the `fault_worker` example binary), a driver killed with SIGKILL, and the
//! blocks a query leaves in workers after it ends in every way.

use crate::common;

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, HandshakeRequest, Ticket};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{CsvReadOptions, SessionConfig, SessionContext};
use flumen::cluster::auth::Secret;
use flumen::cluster::protocol::{
    BlockTicket, INPUT_LOST, InputTicket, ReleaseRequest, RemoteBlockInfo, TaskEvent, TaskInput,
    TaskRequest, WorkerStatus, decode_event, encode_task,
};
use flumen::plan::Pool;
use flumen::{FlumenConfig, WorkerMode};
use futures::{StreamExt, TryStreamExt};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use crate::fault_worker;

const FLUMEN: &str = env!("CARGO_BIN_EXE_flumen");

/// The `fault_worker` example (built by `cargo test` with the examples).
fn fault_worker_binary() -> String {
    let path = std::path::Path::new(FLUMEN)
        .parent()
        .unwrap()
        .join("examples/fault_worker");
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds the examples",
        path.display()
    );
    path.display().to_string()
}

/// A `flumen worker` process this test started with `secret` on its stdin.
struct WorkerProcess {
    child: Child,
    address: String,
}

impl WorkerProcess {
    fn start(secret: &Secret, extra: &[&str]) -> Self {
        let mut child = Command::new(FLUMEN)
            .args(["worker", "--listen", "127.0.0.1:0", "--secret-stdin"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        writeln!(child.stdin.as_mut().unwrap(), "{}", secret.to_hex()).unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line
            .trim()
            .strip_prefix("flumen worker listening on ")
            .unwrap_or_else(|| panic!("not an address: {line:?}"))
            .to_string();
        Self { child, address }
    }

    fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn client(address: &str) -> FlightServiceClient<Channel> {
    let channel = Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    FlightServiceClient::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX)
}

fn with_credential<T>(message: T, credential: Option<&str>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(credential) = credential {
        request
            .metadata_mut()
            .insert("authorization", credential.parse().unwrap());
    }
    request
}

/// Action `name` with `body`, presenting `credential`; the first reply's body.
async fn action(
    address: &str,
    credential: Option<&str>,
    name: &str,
    body: Vec<u8>,
) -> Result<Vec<u8>, Status> {
    let action = Action {
        r#type: name.into(),
        body: body.into(),
    };
    let reply = client(address)
        .await
        .do_action(with_credential(action, credential))
        .await?;
    let results: Vec<arrow_flight::Result> = reply.into_inner().try_collect().await?;
    Ok(results
        .into_iter()
        .next()
        .map(|r| r.body.to_vec())
        .unwrap_or_default())
}

/// Action `run` of task `body`, presenting `credential`: the blocks its streamed reply
/// announced, in order; the reply must end with `Done` naming as many.
async fn run_blocks(
    address: &str,
    credential: &str,
    body: Vec<u8>,
) -> Result<Vec<RemoteBlockInfo>, Status> {
    let action = Action {
        r#type: "run".into(),
        body: body.into(),
    };
    let reply = client(address)
        .await
        .do_action(with_credential(action, Some(credential)))
        .await?;
    let events: Vec<arrow_flight::Result> = reply.into_inner().try_collect().await?;
    let mut blocks = vec![];
    for event in events {
        // A request that names no `carried_output_bytes` leaves every block in the worker.
        match decode_event(&event.body).unwrap() {
            (TaskEvent::Block(info), None) => blocks.push(info),
            (TaskEvent::Carried(info), _) => panic!("a block came back carried: {info:?}"),
            (TaskEvent::Progress { .. } | TaskEvent::Bounds { .. }, _) => {}
            (TaskEvent::Done { blocks: done, .. }, _) => {
                assert_eq!(done, blocks.len(), "Done names the blocks announced");
                return Ok(blocks);
            }
            (event, rows) => panic!("unexpected {event:?} with {rows:?}"),
        }
    }
    panic!("the reply ended without Done");
}

/// Action `release` of `keys` of `query`: the worker's answer (blocks dropped).
async fn release(address: &str, credential: &str, query: &str, keys: Vec<String>) -> Vec<u8> {
    let request = ReleaseRequest {
        query: query.into(),
        keys,
    };
    let body = serde_json::to_vec(&request).unwrap();
    action(address, Some(credential), "release", body)
        .await
        .unwrap()
}

fn bearer(secret: &Secret) -> String {
    format!("Bearer {}", secret.to_hex())
}

async fn status(address: &str, secret: &Secret) -> WorkerStatus {
    let body = action(address, Some(&bearer(secret)), "status", vec![])
        .await
        .expect("the worker answers its driver");
    serde_json::from_slice(&body).unwrap()
}

/// Check that `result` is a refusal with `code` and `words`, and note it in `table`.
fn refused(
    table: &mut Vec<(String, String)>,
    what: &str,
    result: Result<Vec<u8>, Status>,
    code: Code,
    words: &str,
) {
    let status = result.expect_err(what);
    assert_eq!(status.code(), code, "{what}: {status}");
    assert!(status.message().contains(words), "{what}: {status}");
    table.push((
        what.to_string(),
        format!("{:?}: {:.110}", status.code(), status.message()),
    ));
}

async fn physical(ctx: &SessionContext, sql: &str) -> Arc<dyn ExecutionPlan> {
    ctx.sql(sql)
        .await
        .unwrap()
        .create_physical_plan()
        .await
        .unwrap()
}

fn task_body(plan: &Arc<dyn ExecutionPlan>, request: TaskRequest) -> Vec<u8> {
    let bytes = datafusion_proto::bytes::physical_plan_to_bytes(Arc::clone(plan)).unwrap();
    encode_task(&request, &bytes)
}

fn request(query: &str, grants: Vec<String>) -> TaskRequest {
    TaskRequest {
        target_rows: 8192,
        first_block_rows: 0,
        ramp_block_rows: 0,
        partition: 0,
        partitions: 1,
        options: vec![],
        query: query.into(),
        grants,
        inputs: None,
        input_sources: vec![],
        stores: vec![],
        build_keys: vec![],
        feed: String::new(),
        fed_sources: vec![],
        ..TaskRequest::default()
    }
}

/// An Avro scan with no schema, as protobuf: a plan no driver makes, which the worker's
/// decoder refuses. (Before flumen built DataFusion with Avro this body made the decoder
/// panic; panics in a task are `a_panicking_function_fails_its_query_and_kills_no_worker`'s.)
fn scan_without_schema_body() -> Vec<u8> {
    use datafusion_proto::protobuf::{
        AvroScanExecNode, FileScanExecConf, PhysicalPlanNode, physical_plan_node,
    };
    use prost::Message;
    let node = PhysicalPlanNode {
        physical_plan_type: Some(physical_plan_node::PhysicalPlanType::AvroScan(
            AvroScanExecNode {
                base_conf: Some(FileScanExecConf::default()),
            },
        )),
    };
    encode_task(&request("q", vec![]), &node.encode_to_vec())
}

/// One hostile call after another against one worker: each is refused with the code and
/// words expected, the worker stays up and keeps answering its driver, and nothing is
/// written. Prints the table of inputs and answers for the closing note.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_client_is_refused_and_the_worker_stays_up() {
    let secret = Secret::random();
    let mut worker = WorkerProcess::start(&secret, &["--max-message-bytes", "16777216"]);
    let address = worker.address.clone();
    let good = bearer(&secret);
    let dir = tempfile::tempdir().unwrap();
    let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(1));
    let csv = dir.path().join("granted.csv");
    std::fs::write(&csv, "a,b\n1,2\n3,4\n").unwrap();
    ctx.register_csv("granted", csv.to_str().unwrap(), CsvReadOptions::new())
        .await
        .unwrap();
    ctx.register_csv(
        "passwd",
        "/etc/passwd",
        CsvReadOptions::new()
            .has_header(false)
            .delimiter(b':')
            .file_extension(""),
    )
    .await
    .unwrap();
    let granted = physical(&ctx, "SELECT a + b AS s FROM granted").await;
    let granted_files = flumen::cluster::admission::scanned_files(&granted);
    let sink_path = dir.path().join("written.csv");
    let sink = physical(
        &ctx,
        &format!(
            "COPY (SELECT a FROM granted) TO '{}' STORED AS CSV",
            sink_path.display()
        ),
    )
    .await;
    let passwd = physical(&ctx, "SELECT * FROM passwd").await;

    let mut table: Vec<(String, String)> = vec![];

    // No credential, a wrong one, a malformed one.
    let r = action(&address, None, "status", vec![]).await;
    refused(
        &mut table,
        "no secret",
        r,
        Code::Unauthenticated,
        "no credential",
    );
    let wrong = bearer(&Secret::random());
    let r = action(&address, Some(&wrong), "run", vec![]).await;
    refused(
        &mut table,
        "wrong secret",
        r,
        Code::Unauthenticated,
        "wrong credential",
    );
    let r = action(&address, Some("Bearer not-hex"), "status", vec![]).await;
    refused(
        &mut table,
        "malformed secret",
        r,
        Code::Unauthenticated,
        "wrong credential",
    );
    // do_get and release are guarded too.
    let ticket = Ticket {
        ticket: b"{}".to_vec().into(),
    };
    let r = client(&address)
        .await
        .do_get(with_credential(ticket, None))
        .await
        .map(|_| vec![]);
    refused(
        &mut table,
        "do_get without secret",
        r,
        Code::Unauthenticated,
        "no credential",
    );
    // A handshake: the interceptor wants the secret, the payload must present it as well.
    let handshake = |payload: Vec<u8>| HandshakeRequest {
        protocol_version: 0,
        payload: payload.into(),
    };
    let r = client(&address)
        .await
        .handshake(with_credential(
            futures::stream::iter([handshake(b"guess".to_vec())]),
            Some(&good),
        ))
        .await
        .map(|_| vec![]);
    refused(
        &mut table,
        "handshake, wrong payload",
        r,
        Code::Unauthenticated,
        "wrong secret",
    );
    let mut tokens = client(&address)
        .await
        .handshake(with_credential(
            futures::stream::iter([handshake(secret.to_hex().into_bytes())]),
            Some(&good),
        ))
        .await
        .unwrap()
        .into_inner();
    let token = tokens.message().await.unwrap().unwrap().payload;
    let token = format!("Bearer {}", String::from_utf8(token.to_vec()).unwrap());
    let body = action(&address, Some(&token), "status", vec![])
        .await
        .unwrap();
    assert!(serde_json::from_slice::<WorkerStatus>(&body).is_ok());
    table.push((
        "handshake with the secret".into(),
        "a session token that works".into(),
    ));

    // With the secret: what a worker was not built to run.
    let body = task_body(&sink, request("q", granted_files.clone()));
    let r = action(&address, Some(&good), "run", body).await;
    refused(
        &mut table,
        "sink node (COPY TO)",
        r,
        Code::Internal,
        "DataSinkExec",
    );
    let body = task_body(&passwd, request("q", vec![]));
    let r = action(&address, Some(&good), "run", body).await;
    refused(
        &mut table,
        "scan of /etc/passwd",
        r,
        Code::Internal,
        "does not grant",
    );
    let body = task_body(&passwd, request("q", granted_files.clone()));
    let r = action(&address, Some(&good), "run", body).await;
    refused(
        &mut table,
        "/etc/passwd with another file granted",
        r,
        Code::Internal,
        "/etc/passwd, which the task does not grant",
    );
    let r = action(&address, Some(&good), "run", scan_without_schema_body()).await;
    refused(
        &mut table,
        "Avro scan without a schema",
        r,
        Code::Internal,
        "FileScanExecConf is missing required field 'schema'",
    );
    let mut options = request("q", granted_files.clone());
    options.options = vec![("flumen.worker_binary".into(), "/bin/sh".into())];
    let r = action(&address, Some(&good), "run", task_body(&granted, options)).await;
    refused(
        &mut table,
        "setting outside the task's",
        r,
        Code::Internal,
        "flumen.worker_binary",
    );
    let r = action(
        &address,
        Some(&good),
        "run",
        b"\xff\xff\xff\x7fgarbage".to_vec(),
    )
    .await;
    refused(
        &mut table,
        "garbage task body",
        r,
        Code::Internal,
        "task body",
    );
    let mut plan_garbage = encode_task(&request("q", vec![]), b"");
    plan_garbage.extend_from_slice(b"\x0a\xff\xff\xff\xff\x0f not protobuf");
    let r = action(&address, Some(&good), "run", plan_garbage).await;
    refused(&mut table, "garbage plan bytes", r, Code::Internal, "");
    let r = action(&address, Some(&good), "shutdown", vec![]).await;
    refused(
        &mut table,
        "unknown action",
        r,
        Code::Unimplemented,
        "unknown action",
    );
    let r = action(&address, Some(&good), "run", vec![7u8; 17 << 20]).await;
    refused(
        &mut table,
        "oversized message (17 MiB > 16 MiB)",
        r,
        Code::OutOfRange,
        "",
    );

    // Another query's blocks: a real task of query A leaves a block; B cannot take or drop it.
    let body = task_body(&granted, request("query-a", granted_files.clone()));
    let infos = run_blocks(&address, &good, body).await.unwrap();
    assert_eq!(infos.len(), 1);
    let key = infos[0].key.clone();
    assert_eq!(key.len(), 32, "a 128-bit key");
    let ticket_compressed = |query: &str, compression: &str| Ticket {
        ticket: serde_json::to_vec(&BlockTicket {
            query: query.into(),
            key: key.clone(),
            keep: false,
            compression: compression.into(),
        })
        .unwrap()
        .into(),
    };
    let ticket_of = |query: &str| ticket_compressed(query, "");
    let r = client(&address)
        .await
        .do_get(with_credential(ticket_of("query-b"), Some(&good)))
        .await
        .map(|_| vec![]);
    refused(
        &mut table,
        "another query's block ticket",
        r,
        Code::NotFound,
        "no block",
    );
    // A compression the worker does not know is refused before the block is taken.
    let r = client(&address)
        .await
        .do_get(with_credential(
            ticket_compressed("query-a", "gzip"),
            Some(&good),
        ))
        .await
        .map(|_| vec![]);
    refused(
        &mut table,
        "a block ticket asking for an unknown compression",
        r,
        Code::InvalidArgument,
        "flumen.exchange_compression",
    );
    let dropped = release(&address, &good, "query-b", vec![key.clone()]).await;
    assert_eq!(dropped, b"0", "query B released nothing of query A's");
    table.push(("another query's release".into(), "0 blocks dropped".into()));
    assert_eq!(status(&address, &secret).await.blocks_held, 1);

    // A block-wise task whose input is that block, by ticket (held by this worker, which
    // reads it from its own shelf): it runs, and the holder keeps the block until it is
    // released. A ticket naming
    // a worker that is gone fails the task with INPUT_LOST (the driver recomputes that
    // input), and the worker lives on.
    let empty = MemorySourceConfig::try_new_exec(&[vec![]], granted.schema(), None).unwrap();
    let empty: Arc<dyn ExecutionPlan> = empty;
    let ticket_to = |address: &str, key: &str| {
        TaskInput::Fetch(InputTicket {
            address: address.into(),
            tls: false,
            key: key.into(),
            bytes: 0,
        })
    };
    let mut fetching = request("query-a", vec![]);
    fetching.inputs = Some(vec![ticket_to(&address, &key)]);
    let infos = run_blocks(&address, &good, task_body(&empty, fetching))
        .await
        .unwrap();
    assert_eq!(infos.iter().map(|i| i.rows).sum::<usize>(), 2);
    assert_eq!(
        status(&address, &secret).await.blocks_held,
        2,
        "the input was kept"
    );
    assert_eq!(
        status(&address, &secret).await.inputs_held_here,
        1,
        "the worker read the block it holds from its own shelf"
    );
    let keys = infos.into_iter().map(|i| i.key).collect();
    release(&address, &good, "query-a", keys).await;
    // A block of the gone worker: its key is not on this worker's shelf.
    let mut dead_holder = request("query-a", vec![]);
    dead_holder.inputs = Some(vec![ticket_to("127.0.0.1:1", &"0".repeat(32))]);
    let r = action(&address, Some(&good), "run", task_body(&empty, dead_holder)).await;
    refused(
        &mut table,
        "a task input ticket naming a worker that is gone",
        r,
        Code::Internal,
        INPUT_LOST,
    );
    assert_eq!(status(&address, &secret).await.blocks_held, 1);

    let batches: Vec<_> = arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
        client(&address)
            .await
            .do_get(with_credential(ticket_of("query-a"), Some(&good)))
            .await
            .unwrap()
            .into_inner()
            .map_err(arrow_flight::error::FlightError::from),
    )
    .try_collect()
    .await
    .unwrap();
    assert_eq!(batches.iter().map(|b| b.num_rows()).sum::<usize>(), 2);

    // Feeds: only with the secret, well framed, and only to a running task of the same
    // query and feed (none runs now: nothing is taken).
    let feed = |query: &str| {
        let request = flumen::cluster::protocol::FeedRequest {
            query: query.into(),
            feed: "f".into(),
            source: 0,
            inputs: vec![ticket_to(&address, &key)],
            end: true,
        };
        flumen::cluster::protocol::encode_feed(&request, &[]).unwrap()
    };
    let r = action(&address, None, "feed", feed("query-a")).await;
    refused(
        &mut table,
        "feed without secret",
        r,
        Code::Unauthenticated,
        "no credential",
    );
    let r = action(
        &address,
        Some(&good),
        "feed",
        b"\x10\x00\x00\x00{}".to_vec(),
    )
    .await;
    refused(&mut table, "garbage feed", r, Code::InvalidArgument, "feed");
    let taken = action(&address, Some(&good), "feed", feed("query-b"))
        .await
        .unwrap();
    assert_eq!(
        taken, b"false",
        "a feed no running task opened is not taken"
    );
    table.push(("a feed of no running task".into(), "not taken".into()));

    // Raw bytes on the port: the connection is dropped, the worker lives on.
    let mut raw = std::net::TcpStream::connect(&address).unwrap();
    let _ = raw.write_all(b"\x00\xffGET / HTTP/1.0\r\n\r\nnot gRPC at all");
    drop(raw);
    table.push((
        "garbage bytes on the socket".into(),
        "connection dropped".into(),
    ));

    assert!(worker.is_running(), "the worker died");
    let after = status(&address, &secret).await;
    assert_eq!(after.blocks_held, 0);
    assert!(
        !sink_path.exists(),
        "a refused sink wrote {}",
        sink_path.display()
    );
    println!("| hostile input | answer |\n|---|---|");
    for (what, answer) in &table {
        println!("| {what} | {answer} |");
    }
}

#[test]
fn a_worker_without_a_secret_or_with_an_open_secret_file_does_not_start() {
    let out = Command::new(FLUMEN)
        .args(["worker", "--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no secret"), "{stderr}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret");
    std::fs::write(&file, Secret::random().to_hex()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(FLUMEN)
        .args(["worker", "--secret-file", file.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("readable by other users"), "{stderr}");
}

/// `--device cuda:N` names a GPU of this host: one past the visible devices (cuda:0 on a
/// machine without one) is refused at start, saying what the host has; a device that is
/// not `cuda:N` is refused by the option's parser.
#[test]
fn a_worker_given_a_gpu_the_host_lacks_does_not_start() {
    let visible = flumen::functions::accelerator_devices::visible_cuda_devices();
    let out = Command::new(FLUMEN)
        .args(["worker", "--pool", "accelerator", "--secret-stdin"])
        .args(["--device", &format!("cuda:{visible}")])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("--device cuda:{visible}: this host has")),
        "{stderr}"
    );
    let out = Command::new(FLUMEN)
        .args(["worker", "--device", "gpu1", "--secret-stdin"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("cuda:N"), "{stderr}");
}

/// A worker started by hand with a lease exits once no driver calls it.
#[test]
fn a_worker_whose_lease_runs_out_exits() {
    let secret = Secret::random();
    let mut worker = WorkerProcess::start(&secret, &["--lease", "2"]);
    let started = Instant::now();
    while worker.is_running() {
        assert!(started.elapsed() < Duration::from_secs(10), "still running");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(started.elapsed() >= Duration::from_secs(2));
}

/// A worker stopped with SIGTERM (how Kubernetes and service managers stop one) or SIGINT
/// exits at once, as the shell numbers a signal's exit (128 + the signal), through the exit
/// that removes its spill directory first.
#[test]
fn a_worker_exits_on_sigterm_and_sigint() {
    let secret = Secret::random();
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut worker = WorkerProcess::start(&secret, &[]);
        // SAFETY: a signal to the worker process this test started.
        unsafe { libc::kill(worker.child.id() as i32, signal) };
        let sent = Instant::now();
        let status = loop {
            if let Some(status) = worker.child.try_wait().unwrap() {
                break status;
            }
            assert!(sent.elapsed() < Duration::from_secs(5), "still running");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(
            status.code(),
            Some(128 + signal),
            "signal {signal}: {status}"
        );
    }
}

fn process_session(mut config: FlumenConfig, binary: &str) -> SessionContext {
    config.workers = WorkerMode::Process;
    config.worker_binary = binary.into();
    let ctx = flumen::session_with_config(
        flumen::flumen_session_config(
            SessionConfig::new().with_target_partitions(2),
            config.clone(),
        ),
        config,
    );
    fault_worker::register_fault_functions(&ctx);
    ctx
}

async fn pids(pool: &flumen::cluster::WorkerPool) -> Vec<u32> {
    let mut pids: Vec<u32> = pool.workers().await.iter().map(|w| w.pid).collect();
    pids.sort();
    pids
}

/// The error `sql` fails with, and how long it took to fail.
async fn timed_error(ctx: &SessionContext, sql: &str) -> (String, Duration) {
    let started = Instant::now();
    let err = common::try_collect(ctx, sql).await.unwrap_err().to_string();
    (err, started.elapsed())
}

/// A function that never returns, inside a live worker that answers its heartbeats: the
/// task runs past `flumen.task_timeout_secs`, its worker is stopped and the task retried
/// once, then the query fails with an error naming the timeout, within the bound; the next
/// query runs on the replacements. `flumen.query_timeout_secs` ends a query the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_function_times_out_and_the_next_query_succeeds() {
    let (dir, vanilla) = common::events_with_vanilla(2, 5_000).await;
    let mut config = FlumenConfig::default();
    config.worker_processes = 2;
    config.task_timeout_secs = 2;
    config.max_task_retries = 1;
    let f = process_session(config, &fault_worker_binary());
    common::register_tables(&f, dir.path()).await;
    let (err, took) = timed_error(&f, "SELECT hang(id) FROM events").await;
    println!("stuck task: failed after {took:?}: {err}");
    assert!(err.contains("flumen.task_timeout_secs (2s)"), "{err}");
    assert!(err.contains("after 1 retries"), "{err}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    let sql = "SELECT k, count(*), sum(v) FROM events GROUP BY k ORDER BY k";
    common::assert_same(&vanilla, &f, sql).await;

    f.sql("SET flumen.task_timeout_secs = 0").await.unwrap();
    f.sql("SET flumen.query_timeout_secs = 3").await.unwrap();
    let (err, took) = timed_error(&f, "SELECT hang(id) FROM events").await;
    println!("query timeout: failed after {took:?}: {err}");
    assert!(err.contains("flumen.query_timeout_secs (3s)"), "{err}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
}

/// A worker's blocks reach the driver as they are cut, not when the task ends: the first
/// rows of a task that then sticks for good reach the client (without streaming they would
/// wait out the 10-minute task timeout), and a slow task that keeps producing runs well past
/// `flumen.task_timeout_secs` without being stopped (the timeout counts from its last sign
/// of progress).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_output_streams_block_by_block() {
    let (dir, _vanilla) = common::events_with_vanilla(1, 50_000).await;
    let mut config = FlumenConfig::default();
    config.worker_processes = 2;
    config.target_block_rows = 1_000;
    let f = process_session(config, &fault_worker_binary());
    common::register_tables(&f, dir.path()).await;
    // The scan's first batch (ids 0..8191) passes; the second sticks forever.
    let started = Instant::now();
    let mut stream = f
        .sql("SELECT hang_from(id, 8192) AS x FROM events")
        .await
        .unwrap()
        .execute_stream()
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(60), stream.next())
        .await
        .expect("no rows within 60 s: the task's first blocks did not stream")
        .expect("a batch")
        .unwrap();
    println!(
        "first {} rows of a task that sticks after its first batch: {:?}",
        first.num_rows(),
        started.elapsed()
    );
    assert!(first.num_rows() > 0);
    drop(stream);
    let cpu = common::worker_pool(&f, Pool::Cpu).await;
    let mut tasks = 0;
    for worker in cpu.workers().await {
        tasks += worker.status().await.unwrap().tasks;
    }
    assert!(tasks >= 1, "the task ran in a worker process");

    // 7 batches of 400 ms each (about 2.8 s of task) under a 2 s progress timeout.
    f.sql("SET flumen.task_timeout_secs = 2").await.unwrap();
    let started = Instant::now();
    let rows = common::collect(&f, "SELECT nap(id) AS x FROM events").await;
    println!(
        "a steady 7-batch task under a 2 s timeout: {:?}",
        started.elapsed()
    );
    assert_eq!(rows.iter().map(|b| b.num_rows()).sum::<usize>(), 50_000);
    assert_eq!(cpu.restarted(), 0, "a steady task's worker was stopped");

    // The same batches into an aggregate in the same task, which puts out nothing until its
    // input ends: the worker tells that the task's plan advances, so it is not stopped
    // either (before, it was, on every retry, and the query failed).
    let started = Instant::now();
    let sql = "SELECT count(x) AS n, sum(x) AS s FROM (SELECT nap(id) AS x FROM events)";
    let sums = common::collect(&f, sql).await;
    println!(
        "an aggregate of 7 batches under a 2 s timeout: {:?}",
        started.elapsed()
    );
    let answer = datafusion::arrow::util::pretty::pretty_format_batches(&sums)
        .unwrap()
        .to_string();
    assert!(answer.contains("| 50000 | 1249975000 |"), "{answer}");
    assert_eq!(cpu.restarted(), 0, "a busy aggregate's worker was stopped");
}

/// A panicking function in a CPU worker and in an accelerator worker's model: one clear
/// error, no worker killed or replaced (same pids), the accelerator worker's model thread
/// restarted (a second run gets the same clean error), and the next query succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_function_fails_its_query_and_kills_no_worker() {
    let (dir, vanilla) = common::events_with_vanilla(2, 5_000).await;
    let mut config = FlumenConfig::default();
    config.worker_processes = 2;
    let f = process_session(config, &fault_worker_binary());
    common::register_tables(&f, dir.path()).await;
    let sql = "SELECT k, count(*) FROM events GROUP BY k ORDER BY k";
    common::collect(&f, sql).await;
    let cpu = common::worker_pool(&f, Pool::Cpu).await;
    let cpu_pids = pids(&cpu).await;
    let err = common::try_collect(&f, "SELECT boom(id) FROM events")
        .await
        .unwrap_err()
        .to_string();
    println!("panicking CPU function: {err}");
    assert!(err.contains("task panicked"), "{err}");
    assert!(err.contains("boom: this function always panics"), "{err}");
    assert_eq!(pids(&cpu).await, cpu_pids, "a CPU worker was replaced");
    assert_eq!(cpu.restarted(), 0);
    common::assert_same(&vanilla, &f, sql).await;

    for round in 0..2 {
        let err = common::try_collect(&f, "SELECT boom_model(body) FROM events WHERE id < 100")
            .await
            .unwrap_err()
            .to_string();
        println!("panicking model, round {round}: {err}");
        assert!(err.contains("task panicked"), "{err}");
        assert!(err.contains("boom_model: the model panicked"), "{err}");
    }
    let accelerator = common::worker_pool(&f, Pool::Accelerator).await;
    assert_eq!(
        accelerator.restarted(),
        0,
        "the accelerator worker was replaced"
    );
    let worker = &accelerator.workers().await[0];
    let status = worker.status().await.unwrap();
    assert!(status.task_panics >= 2, "{status:?}");
    assert_eq!(pids(&cpu).await, cpu_pids);
    common::assert_same(&vanilla, &f, sql).await;
}

/// Blocks the workers of `ctx`'s CPU pool hold now.
async fn held_blocks(ctx: &SessionContext) -> usize {
    let mut held = 0;
    for worker in common::worker_pool(ctx, Pool::Cpu).await.workers().await {
        held += worker.status().await.unwrap().blocks_held;
    }
    held
}

/// Blocks the workers of `ctx`'s CPU pool have written to their spill directories.
async fn spilled_blocks(ctx: &SessionContext) -> usize {
    let mut spilled = 0;
    for worker in common::worker_pool(ctx, Pool::Cpu).await.workers().await {
        spilled += worker.status().await.unwrap().blocks_spilled as usize;
    }
    spilled
}

/// Wait until every worker of `ctx`'s CPU pool holds no block (at most 10 s).
async fn held_blocks_drain(ctx: &SessionContext, what: &str) {
    let started = Instant::now();
    loop {
        let held = held_blocks(ctx).await;
        if held == 0 {
            println!(
                "{what}: workers hold 0 blocks after {:?}",
                started.elapsed()
            );
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what}: workers still hold {held} blocks"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every block a query leaves in workers is dropped when it ends: read to the end, failed,
/// cancelled after its first batch, stopped by a `LIMIT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_hold_no_block_after_a_query_ends_in_any_way() {
    let (dir, _vanilla) = common::events_with_vanilla(4, 20_000).await;
    let mut config = FlumenConfig::default();
    config.worker_processes = 2;
    config.target_block_rows = 1_000;
    config.split_bytes = flumen::ByteSize(64 << 10);
    let f = process_session(config, &fault_worker_binary());
    common::register_tables(&f, dir.path()).await;

    let rows = common::collect(&f, "SELECT id, v FROM events WHERE v > 0.1").await;
    assert!(rows.iter().map(|b| b.num_rows()).sum::<usize>() > 50_000);
    held_blocks_drain(&f, "success").await;

    let err = common::try_collect(
        &f,
        "SELECT boom(c) FROM (SELECT k, count(*) AS c FROM events GROUP BY k)",
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("panicked"), "{err}");
    held_blocks_drain(&f, "error").await;

    let mut stream = f
        .sql("SELECT id, body FROM events")
        .await
        .unwrap()
        .execute_stream()
        .await
        .unwrap();
    use futures::StreamExt;
    assert!(stream.next().await.unwrap().is_ok());
    // Tasks run ahead of the reader: blocks wait in the workers.
    let held = held_blocks(&f).await;
    println!("cancel: workers hold {held} blocks after the first batch");
    assert!(held > 0, "nothing was held: the cancel case tests nothing");
    drop(stream);
    held_blocks_drain(&f, "cancel").await;

    let limited = common::collect(&f, "SELECT id, body FROM events WHERE v > 0.2 LIMIT 3").await;
    assert_eq!(limited.iter().map(|b| b.num_rows()).sum::<usize>(), 3);
    held_blocks_drain(&f, "LIMIT").await;
}

/// A shuffle cancelled while blocks were spilled to disk (the join runs out of core on the
/// workers, whose shelves spill the query's blocks beside its operators; a task that runs
/// on the driver spills there) and the workers hold map outputs: the spill files are
/// deleted and the workers drop every block (a spilled block's file goes with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shuffle_cancelled_with_spill_files_and_worker_blocks_leaves_neither() {
    let (dir, _vanilla) = common::events_with_vanilla(4, 40_000).await;
    let spill = tempfile::tempdir().unwrap();
    let mut config = FlumenConfig::default();
    config.worker_processes = 2;
    config.target_block_rows = 1_000;
    config.split_bytes = flumen::ByteSize(64 << 10);
    config.memory_budget = flumen::ByteSize(1 << 20);
    config.spill_dir = spill.path().display().to_string();
    let f = process_session(config, &fault_worker_binary());
    common::register_tables(&f, dir.path()).await;
    let spill_files = || {
        common::files_below(spill.path())
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "arrow"))
            .count()
    };
    let query = {
        let f = f.clone();
        tokio::spawn(async move {
            common::try_collect(
                &f,
                "SELECT count(*), sum(a.v * b.v), max(b.body) FROM events a \
                 JOIN events b ON a.id = b.id",
            )
            .await
        })
    };
    // Cancel once both are there: spill files on the driver, blocks in the workers.
    let started = Instant::now();
    let (mut files, mut held) = (0, 0);
    while !query.is_finished() && started.elapsed() < Duration::from_secs(60) {
        files = spill_files();
        let started_pool = f
            .state()
            .config()
            .get_extension::<flumen::cluster::WorkerPoolSlot>()
            .unwrap()
            .current(Pool::Cpu)
            .await;
        let worker_spills = match started_pool {
            Some(_) => {
                held = held_blocks(&f).await;
                spilled_blocks(&f).await
            }
            None => 0,
        };
        if files + worker_spills > 0 && held > 0 {
            files += worker_spills;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        files > 0 && held > 0,
        "the query {} before blocks spilled ({files} files) while workers held blocks \
         ({held}): the cancel tests nothing",
        if query.is_finished() {
            "finished"
        } else {
            "ran 60 s"
        }
    );
    query.abort();
    let _ = query.await;
    println!("cancelled with {files} blocks spilled and {held} blocks in workers");
    held_blocks_drain(&f, "a cancelled shuffle").await;
    let started = Instant::now();
    while spill_files() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} spill files left 10 s after the cancel",
            spill_files()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `SET flumen.worker_binary` (and `worker_module`) is refused (it would run any program
/// at the next query), and the refusal names the setting (DataFusion hands the field an
/// empty key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_binary_is_not_settable() {
    let f = process_session(FlumenConfig::default(), FLUMEN);
    for (setting, value) in [("worker_binary", "/bin/sh"), ("worker_module", "os")] {
        let err = f
            .sql(&format!("SET flumen.{setting} = '{value}'"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("startup option"), "{err}");
        assert!(err.contains(&format!("flumen.{setting} ")), "{err}");
    }
}

/// What a worker's environment and command line hold: no credential of its driver's, no
/// secret.
fn assert_worker_holds_no_secret(pid: u32) {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ).replace('\0', "\n");
    assert!(!environ.contains("flumen-test-credential"), "{environ}");
    assert!(!environ.contains("AWS_SECRET_ACCESS_KEY"), "{environ}");
    assert!(environ.contains("PATH="), "{environ}");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(cmdline.contains("--secret-stdin"), "{cmdline}");
    let looks_secret = |word: &str| word.len() >= 64 && word.chars().all(|c| c.is_ascii_hexdigit());
    assert!(
        !cmdline.split_whitespace().any(looks_secret)
            && !environ.split(['\n', '=']).any(looks_secret),
        "a secret in argv or the environment"
    );
}

/// The pids of processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|entry| entry.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| {
            // After the state comes the parent's pid.
            stat_after_name(*pid)
                .and_then(|rest| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                == Some(parent)
        })
        .collect()
}

/// Whether process `pid` runs `flumen worker` (its second argument is `worker`).
fn is_worker(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|cmdline| cmdline.split(|b| *b == 0).nth(1) == Some(b"worker"))
}

/// `/proc/PID/stat` after the command name in parentheses (state first); `None` when the
/// process is gone.
fn stat_after_name(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(')')?.1.trim_start().to_string())
}

fn alive(pid: u32) -> bool {
    // A zombie has exited; only its parent's reaping is left.
    stat_after_name(pid).is_some_and(|rest| !rest.starts_with('Z'))
}

/// A driver (the `flumen` REPL) killed with SIGKILL while its workers run: no worker is
/// left within 5 s. Its workers got none of its credentials (`AWS_SECRET_ACCESS_KEY` is in
/// the driver's environment) and no secret on their command line.
#[test]
fn workers_exit_within_5s_of_their_driver_being_killed() {
    let dir = tempfile::tempdir().unwrap();
    common::write_events(dir.path(), 1, 10_000);
    // A query that keeps the workers busy for a while (a 100M-pair nested loop join).
    let table = format!("'{}/part-0.parquet'", dir.path().display());
    let sql = format!("SELECT count(*) FROM {table} a, {table} b WHERE a.v < b.v + a.id * 0.0");
    let mut driver = Command::new(FLUMEN)
        .args(["--workers", "2", "--no-demo", "--quiet", "-c", &sql])
        .env("AWS_SECRET_ACCESS_KEY", "flumen-test-credential")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let workers = loop {
        // Only children that are workers already: one just forked, not yet exec'd, still
        // holds the driver's environment (this test failed once reading it then).
        let workers: Vec<u32> = (children_of(driver.id()).into_iter())
            .filter(|pid| is_worker(*pid))
            .collect();
        if workers.len() >= 2 {
            break workers;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the driver started no workers"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    for pid in &workers {
        assert_worker_holds_no_secret(*pid);
    }
    assert!(
        driver.try_wait().unwrap().is_none(),
        "the query ended before the driver could be killed"
    );
    // SAFETY: a signal to the driver process this test started.
    unsafe { libc::kill(driver.id() as i32, libc::SIGKILL) };
    driver.wait().unwrap();
    let killed = Instant::now();
    while workers.iter().any(|pid| alive(*pid)) {
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "workers {workers:?} outlived their driver by 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "{} workers gone {:?} after their driver's SIGKILL",
        workers.len(),
        killed.elapsed()
    );
}

/// A pool whose second worker fails to start stops the first one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_fails_half_way_stops_what_it_started() {
    let (dir, _vanilla) = common::events_with_vanilla(1, 5_000).await;
    let script = dir.path().join("half-worker.sh");
    let first = dir.path().join("first");
    let pidfile = dir.path().join("pid");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nif mkdir '{first}' 2>/dev/null; then echo $$ > '{pid}'; exec '{FLUMEN}' \"$@\"; \
             else echo 'not a worker'; fi\n",
            first = first.display(),
            pid = pidfile.display(),
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut config = FlumenConfig::default();
    config.worker_processes = 2;
    let f = process_session(config, script.to_str().unwrap());
    common::register_tables(&f, dir.path()).await;
    let err = common::try_collect(&f, "SELECT count(*) FROM events WHERE v > 0.5")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("instead of its address"), "{err}");
    // The first script writes its pid just after it claims `first`; the second one may
    // fail the start before that write lands.
    let started = Instant::now();
    let pid: u32 = loop {
        match std::fs::read_to_string(&pidfile).map(|text| text.trim().parse()) {
            Ok(Ok(pid)) => break pid,
            _ => assert!(
                started.elapsed() < Duration::from_secs(5),
                "the first worker never wrote its pid"
            ),
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let started = Instant::now();
    while alive(pid) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the worker that started ({pid}) was left running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run `openssl` with `args` in `dir` (a real user's tool for certificates).
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`NAME-ca.pem`) and a worker certificate it signed for `localhost` and 127.0.0.1
/// (`NAME.pem`, key `NAME.key` in mode 0600), made with openssl as an operator would.
fn make_certificates(dir: &std::path::Path, name: &str) {
    let (ca_key, ca_pem) = (format!("{name}-ca.key"), format!("{name}-ca.pem"));
    let (key, csr, pem) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
    );
    let (ext, subject) = (format!("{name}.ext"), format!("/CN={name} CA"));
    #[rustfmt::skip]
    openssl(dir, &["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-noenc", "-keyout", &ca_key, "-out", &ca_pem, "-days", "2", "-subj", &subject]);
    #[rustfmt::skip]
    openssl(dir, &["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc",
        "-keyout", &key, "-out", &csr, "-subj", "/CN=flumen worker"]);
    std::fs::write(
        dir.join(&ext),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    #[rustfmt::skip]
    openssl(dir, &["x509", "-req", "-in", &csr, "-CA", &ca_pem, "-CAkey", &ca_key,
        "-CAcreateserial", "-out", &pem, "-days", "2", "-extfile", &ext]);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join(&key), std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A secret in a file of mode 0600 under `dir`.
fn secret_file(dir: &std::path::Path, secret: &Secret) -> String {
    let path = dir.join("secret");
    std::fs::write(&path, secret.to_hex()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path.display().to_string()
}

/// A `status` call through `endpoint`, presenting `secret`: the reply's body, or the error.
async fn status_through(
    endpoint: tonic::transport::Endpoint,
    secret: &Secret,
) -> Result<Vec<u8>, String> {
    let channel = endpoint
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| flumen::error_chain(&e))?;
    let action = Action {
        r#type: "status".into(),
        body: vec![].into(),
    };
    let reply = FlightServiceClient::new(channel)
        .do_action(with_credential(action, Some(&bearer(secret))))
        .await
        .map_err(|e| e.to_string())?;
    let results: Vec<arrow_flight::Result> = reply
        .into_inner()
        .try_collect()
        .await
        .map_err(|e| e.to_string())?;
    results
        .into_iter()
        .next()
        .map(|r| r.body.to_vec())
        .ok_or_else(|| "an empty reply".to_string())
}

/// A TLS client of `address` that trusts `ca_pem`, expecting the worker's certificate to
/// name `domain` (by default the address's host).
async fn tls_status(
    address: &str,
    ca_pem: &str,
    domain: Option<&str>,
    secret: &Secret,
) -> Result<WorkerStatus, String> {
    let mut tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca_pem));
    if let Some(domain) = domain {
        tls = tls.domain_name(domain);
    }
    let endpoint = Channel::from_shared(format!("https://{address}"))
        .unwrap()
        .tls_config(tls)
        .unwrap();
    let body = status_through(endpoint, secret).await?;
    Ok(serde_json::from_slice(&body).unwrap())
}

/// A plaintext `status` call: what a client that does not speak TLS gets.
async fn plaintext_status(address: &str, secret: &Secret) -> Result<Vec<u8>, String> {
    status_through(
        Channel::from_shared(format!("http://{address}")).unwrap(),
        secret,
    )
    .await
}

/// A worker started by hand with an operator's certificate (made by openssl): it will not
/// listen off loopback without TLS, nor read a key others can read; it serves TLS clients
/// that trust its CA and dial a name its certificate holds, and nothing else (a plaintext
/// client, a client trusting another CA, a client expecting another host name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_worker_serves_only_clients_that_check_its_certificate() {
    let dir = tempfile::tempdir().unwrap();
    make_certificates(dir.path(), "worker");
    make_certificates(dir.path(), "other");
    let secret = Secret::random();
    let secret_path = secret_file(dir.path(), &secret);
    let path = |name: &str| dir.path().join(name).display().to_string();
    let start = |listen: &str, tls: bool| {
        let mut command = Command::new(FLUMEN);
        command
            .args(["worker", "--listen", listen, "--secret-file", &secret_path])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if tls {
            command.args([
                "--tls-cert",
                &path("worker.pem"),
                "--tls-key",
                &path("worker.key"),
            ]);
        }
        command.spawn().unwrap()
    };

    // Plaintext off loopback: refused before it listens.
    let out = start("0.0.0.0:0", false).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("must use TLS"), "{stderr}");
    println!("plaintext on 0.0.0.0: {}", stderr.trim());

    // A key others can read: refused.
    use std::os::unix::fs::PermissionsExt;
    let key = dir.path().join("worker.key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = start("127.0.0.1:0", true).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("TLS key") && stderr.contains("readable by other users"),
        "{stderr}"
    );
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();

    // With TLS on every address (0.0.0.0 too), dialled on loopback.
    let mut child = start("0.0.0.0:0", true);
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // Killed when the test ends, pass or fail.
    let mut worker = WorkerProcess {
        child,
        address: line.trim().to_string(),
    };
    let port = worker.address.rsplit(':').next().unwrap().to_string();
    let address = format!("127.0.0.1:{port}");
    let ca = std::fs::read_to_string(dir.path().join("worker-ca.pem")).unwrap();
    let other_ca = std::fs::read_to_string(dir.path().join("other-ca.pem")).unwrap();

    let status = tls_status(&address, &ca, None, &secret)
        .await
        .expect("a client trusting the CA");
    assert_eq!(status.tasks, 0);
    let by_name = tls_status(&format!("localhost:{port}"), &ca, None, &secret).await;
    assert!(by_name.is_ok(), "{by_name:?}");
    let mut table = vec![];
    let plain = plaintext_status(&address, &secret).await;
    table.push(("plaintext client", format!("{plain:?}")));
    assert!(plain.is_err(), "a plaintext client was answered: {plain:?}");
    let wrong_ca = tls_status(&address, &other_ca, None, &secret).await;
    table.push(("client trusting another CA", format!("{wrong_ca:?}")));
    assert!(
        wrong_ca
            .as_ref()
            .is_err_and(|e| e.contains("UnknownIssuer")),
        "{wrong_ca:?}"
    );
    let wrong_name = tls_status(&address, &ca, Some("elsewhere.example"), &secret).await;
    table.push(("client dialling another name", format!("{wrong_name:?}")));
    assert!(
        wrong_name
            .as_ref()
            .is_err_and(|e| e.contains("not valid for name")),
        "{wrong_name:?}"
    );
    let no_secret = tls_status(&address, &ca, None, &Secret::random()).await;
    table.push(("TLS client with a wrong secret", format!("{no_secret:?}")));
    assert!(
        no_secret
            .as_ref()
            .is_err_and(|e| e.contains("Unauthenticated") || e.contains("secret")),
        "{no_secret:?}"
    );
    for (what, answer) in &table {
        println!("| {what} | {answer:.160} |");
    }
    assert!(worker.is_running(), "the worker stays up");
    // Still serving after all that.
    assert!(tls_status(&address, &ca, None, &secret).await.is_ok());
}

/// `flumen.worker_tls`: the session's own workers speak TLS with a certificate made for this
/// driver (handed over on stdin); queries give the same rows, and a plaintext client of the
/// same workers gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_in_tls_gives_the_same_rows_and_refuses_plaintext() {
    let (dir, vanilla) = common::events_with_vanilla(2, 5_000).await;
    let mut config = FlumenConfig::default();
    config.worker_processes = 2;
    config.worker_tls = true;
    let f = process_session(config, FLUMEN);
    common::register_tables(&f, dir.path()).await;
    let sql = "SELECT k, count(*), sum(v) FROM events WHERE v % 3 <> 0 GROUP BY k ORDER BY k";
    common::assert_same(&vanilla, &f, sql).await;
    let cpu = common::worker_pool(&f, Pool::Cpu).await;
    assert!(cpu.workers().await.len() == 2);
    let ca = flumen::cluster::tls::local_tls().unwrap().trust.ca_pem();
    let secret = flumen::cluster::auth::driver_secret();
    for worker in cpu.workers().await {
        assert_worker_holds_no_secret(worker.pid);
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", worker.pid)).unwrap();
        assert!(String::from_utf8_lossy(&cmdline).contains("--tls-stdin"));
        let plain = plaintext_status(&worker.address, secret).await;
        assert!(
            plain.is_err(),
            "worker {} answered plaintext: {plain:?}",
            worker.address
        );
        let status = tls_status(&worker.address, ca, None, secret).await.unwrap();
        assert!(status.tasks > 0, "{status:?}");
    }
}

/// A driver attached to a worker of another flumen (a `flumen worker` process speaking an
/// older or a newer worker protocol) fails the query at once with an error naming both
/// protocols and what to do: the older worker (protocol 3 checked no driver's hello) is
/// refused by the driver, the newer one refuses the driver. A session then answers with a
/// worker of its own protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_of_another_protocol_is_a_clear_error_on_the_driver() {
    use flumen::cluster::protocol::PROTOCOL_VERSION;
    let (dir, vanilla) = common::events_with_vanilla(2, 2_000).await;
    let secret = Secret::random();
    secret_file(dir.path(), &secret);
    let cluster_file = dir.path().join("cluster.toml");
    let write_cluster_file = |address: &str| {
        let text = format!("workers = [\"{address}\"]\nsecret_file = \"secret\"\n");
        std::fs::write(&cluster_file, text).unwrap();
    };
    // A session attached to the workers the cluster file names, with the test tables.
    let attached_session = || async {
        let mut config = FlumenConfig::default();
        config.workers = WorkerMode::Process;
        config.cluster = cluster_file.display().to_string();
        let f = flumen::session(config);
        common::register_tables(&f, dir.path()).await;
        f
    };
    let sql = "SELECT k, count(*) FROM events GROUP BY k ORDER BY k";
    for other in [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1] {
        let worker = WorkerProcess::start(&secret, &["--speak-protocol", &other.to_string()]);
        write_cluster_file(&worker.address);
        let f = attached_session().await;
        let started = Instant::now();
        let err = common::try_collect(&f, sql).await.unwrap_err().to_string();
        println!(
            "a worker of protocol {other}: {:?}: {err}",
            started.elapsed()
        );
        assert!(
            err.contains(&format!("protocol {other}"))
                && err.contains(&format!("protocol {PROTOCOL_VERSION}")),
            "{err}"
        );
        assert!(err.contains("run the same flumen version"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(30));
        drop(worker);
    }
    // The cluster file now names a worker of this build: the next query answers.
    let worker = WorkerProcess::start(&secret, &[]);
    write_cluster_file(&worker.address);
    common::assert_same(&vanilla, &attached_session().await, sql).await;
}
