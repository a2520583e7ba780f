//! `flumen serve` as its users meet it: the real binary on loopback, the ADBC Flight SQL
//! driver from Python (`tests/serve/adbc_client.py`, installed by
//! `tests/install-test-tools.sh`), and arrow-flight's Rust Flight SQL client for what no
//! polite client sends (garbage, huge and unknown tickets, calls without a token).

use crate::common;
use crate::common::s3_server;

use common::serve_process::ServeProcess;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use arrow_flight::Ticket;
use arrow_flight::sql::client::FlightSqlServiceClient;
use arrow_flight::sql::{ProstMessageExt, TicketStatementQuery};
use datafusion::arrow::array::AsArray;
use datafusion::arrow::datatypes::{DataType, Int64Type};
use flumen::cluster::auth::Secret;
use futures::TryStreamExt;
use prost::Message;
use serde_json::Value;
use tonic::transport::{Channel, Endpoint};

const USER: &str = "ana";
const PASSWORD: &str = "correct horse battery staple";

/// A `flumen serve` process on loopback with a test's files; killed when dropped.
struct Server {
    process: ServeProcess,
    address: String,
}

/// What a server's files are: users, token, state directory.
struct ServerFiles {
    users: PathBuf,
    token_file: PathBuf,
    token: Secret,
    state: PathBuf,
}

impl ServerFiles {
    fn new(dir: &Path) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let owner_only = |path: &Path, text: String| {
            std::fs::write(path, text).unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
        };
        let users = dir.join("users");
        let hash = flumen::serve::credentials::hash_password(PASSWORD).unwrap();
        owner_only(&users, format!("{USER}:{hash}\n"));
        let token = Secret::random();
        let token_file = dir.join("token");
        owner_only(&token_file, token.to_hex());
        Self {
            users,
            token_file,
            token,
            state: dir.join("state"),
        }
    }
}

impl Server {
    fn start(files: &ServerFiles, extra: &[&str]) -> Self {
        std::fs::create_dir_all(&files.state).unwrap();
        let mut args: Vec<std::ffi::OsString> = vec!["--users".into(), files.users.clone().into()];
        args.extend(["--token-file".into(), files.token_file.clone().into()]);
        args.extend(["--state-dir".into(), files.state.clone().into()]);
        args.extend(extra.iter().map(Into::into));
        let process = ServeProcess::start(args, &files.state.with_extension("log"));
        Self {
            address: process.address.clone(),
            process,
        }
    }

    fn uri(&self) -> String {
        format!("grpc://{}", self.address)
    }

    /// The TLS address by name (the certificate names `localhost`).
    fn tls_uri(&self) -> String {
        let port = self.address.rsplit(':').next().unwrap();
        format!("grpc+tls://localhost:{port}")
    }

    fn log(&self) -> String {
        self.process.log_text()
    }

    /// Whether the process still runs.
    fn is_running(&mut self) -> bool {
        self.process.child.try_wait().unwrap().is_none()
    }

    /// A Rust Flight SQL client presenting the server's token.
    async fn client(&self, files: &ServerFiles) -> FlightSqlServiceClient<Channel> {
        self.process.client(&files.token.to_hex()).await
    }
}

/// The Python with the ADBC Flight SQL driver, or `None` (after reporting the skip).
fn adbc_python() -> Option<String> {
    let python = concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-venv/bin/python");
    let works = Command::new(python)
        .args(["-c", "import adbc_driver_flightsql.dbapi, pyarrow.flight"])
        .status()
        .is_ok_and(|s| s.success());
    if !works {
        common::skip_missing_tool(
            "the ADBC Flight SQL driver (adbc-driver-flightsql in target/test-venv: run \
             tests/install-test-tools.sh)",
        );
        return None;
    }
    Some(python.to_string())
}

/// Run scenario `scenario` of the Python client against `server`; its JSON answer.
fn adbc(
    python: &str,
    server: &Server,
    files: &ServerFiles,
    scenario: &str,
    args: &[&str],
) -> Value {
    adbc_at(python, server, &server.uri(), files, scenario, args)
}

/// [`adbc`] at `uri`.
fn adbc_at(
    python: &str,
    server: &Server,
    uri: &str,
    files: &ServerFiles,
    scenario: &str,
    args: &[&str],
) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/serve/adbc_client.py");
    let mut child = Command::new(python)
        .arg(script)
        .arg(scenario)
        .arg(uri)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let secrets =
        serde_json::json!({"user": USER, "password": PASSWORD, "token": files.token.to_hex()});
    writeln!(child.stdin.take().unwrap(), "{secrets}").unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "adbc_client.py {scenario} failed:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

#[test]
fn an_adbc_client_authenticates_queries_with_embed_and_binds_parameters() {
    let Some(python) = adbc_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &[]);
    let seen = adbc(&python, &server, &files, "basics", &[]);

    assert_eq!(seen["ids"], serde_json::json!([0, 1, 2]));
    assert_eq!(seen["dims"], serde_json::json!([384, 384, 384]));
    for norm in seen["norms"].as_array().unwrap() {
        assert!((norm.as_f64().unwrap() - 1.0).abs() < 1e-3, "{seen}");
    }
    assert_eq!(seen["prepared_count"], 100);
    assert_eq!(seen["prepared_row"], serde_json::json!(["hi!", 42]));
    assert_eq!(seen["vendor"], "flumen");
    assert!(
        seen["tables"].as_array().unwrap().contains(&"docs".into()),
        "{seen}"
    );
    let text = |key: &str| seen[key].as_str().unwrap_or_default().to_string();
    assert!(text("sql_error").contains("SELEC"), "{seen}");
    assert!(text("missing_table").contains("nowhere"), "{seen}");
    assert!(text("wrong_password").contains("UNAUTHENTICATED"), "{seen}");
    assert!(text("wrong_token").contains("UNAUTHENTICATED"), "{seen}");
    assert_eq!(seen["token_answer"], 42);

    // One log line per query, naming the user; no secret in the log.
    let log = server.log();
    assert!(log.contains("user=ana rows=3"), "{log}");
    assert!(
        !log.contains(PASSWORD) && !log.contains(&files.token.to_hex()),
        "{log}"
    );
    assert!(log.contains("failed: wrong credentials"), "{log}");
}

#[test]
fn the_python_example_runs_against_a_server() {
    let Some(python) = adbc_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &[]);
    let out = Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/flight_sql_client.py"
        ))
        .arg(server.uri())
        .arg(&files.token_file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("4 rows"), "{stdout}");
    assert!(stdout.contains("vectors (4, 384) float32"), "{stdout}");
}

#[test]
fn a_table_a_client_creates_survives_a_server_restart() {
    let Some(python) = adbc_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let csv = data.join("kept.csv");
    std::fs::write(&csv, "a,b\n1,x\n2,y\n39,z\n").unwrap();
    let allow = ["--allow-path", data.to_str().unwrap()];
    let server = Server::start(&files, &allow);
    let created = adbc(
        &python,
        &server,
        &files,
        "create_table",
        &[csv.to_str().unwrap()],
    );
    assert_eq!(created["sum"], 42);
    drop(server);

    let server = Server::start(&files, &allow);
    let read = adbc(&python, &server, &files, "read_kept", &[]);
    assert_eq!(read["sum"], 42, "{}", server.log());
    // The client dropped it: a third server does not know it.
    drop(server);
    let catalog = std::fs::read_to_string(files.state.join("catalog.json")).unwrap();
    assert!(!catalog.contains("kept.csv"), "{catalog}");
}

#[test]
fn two_clients_at_once_keep_their_own_settings() {
    let Some(python) = adbc_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &[]);
    let seen = adbc(&python, &server, &files, "two_clients", &[]);
    assert_eq!(seen["a"]["batch_size"], "1000", "{seen}");
    assert_eq!(seen["b"]["batch_size"], "3000", "{seen}");
    let docs = flumen::demo::DEFAULT_ROWS as u64 * 20;
    assert_eq!(seen["a"]["rows"], docs);
    assert_eq!(seen["b"]["rows"], docs);
}

#[test]
fn a_client_cancels_a_long_query_and_the_server_lets_it_go() {
    let Some(python) = adbc_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &[]);
    let seen = adbc(&python, &server, &files, "cancel", &[]);
    assert!(
        seen["error"]
            .as_str()
            .is_some_and(|e| e.to_lowercase().contains("cancel")),
        "{seen}"
    );
    assert!(
        seen["seconds_until_cancelled"].as_f64().unwrap() < 10.0,
        "{seen}"
    );
    assert_eq!(seen["running_after"], 0, "{seen}\n{}", server.log());
    assert_eq!(seen["next_query"], 1);
    assert!(seen["next_query_seconds"].as_f64().unwrap() < 5.0, "{seen}");
}

#[tokio::test]
async fn bad_input_gets_clear_errors_and_the_server_stays_up() {
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let mut server = Server::start(&files, &[]);

    // Garbage on the port.
    {
        let mut socket = std::net::TcpStream::connect(&server.address).unwrap();
        socket.write_all(&[0xde; 4096]).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let _ = socket.read(&mut [0u8; 1024]);
    }

    // No token, a wrong token.
    let channel = Endpoint::from_shared(format!("http://{}", server.address))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut anonymous = FlightSqlServiceClient::new(channel);
    let err = anonymous
        .execute("SELECT 1".into(), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no token"), "{err}");
    anonymous.set_token(Secret::random().to_hex());
    let err = anonymous
        .execute("SELECT 1".into(), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("wrong token"), "{err}");

    let mut client = server.client(&files).await;
    // A ticket that was never issued, one of the wrong size, and one too large to accept.
    let unknown = TicketStatementQuery {
        statement_handle: vec![1u8; 16].into(),
    };
    let err = client
        .do_get(Ticket::new(unknown.as_any().encode_to_vec()))
        .await
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("unknown statement handle"),
        "{err}"
    );
    let odd = TicketStatementQuery {
        statement_handle: vec![1u8; 1 << 20].into(),
    };
    let err = client
        .do_get(Ticket::new(odd.as_any().encode_to_vec()))
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("handle is 16 bytes"), "{err}");
    let err = client
        .do_get(Ticket::new(vec![7u8; 32 << 20]))
        .await
        .err()
        .unwrap();
    let text = err.to_string();
    assert!(
        text.contains("message") || text.contains("larger"),
        "{text}"
    );

    // A dataset ticket for a job that does not exist.
    let unknown_job = flumen::serve::datasets::DatasetTicket {
        job: "no-such-job".into(),
        consumer: 0,
        epoch: 0,
    };
    let err = client
        .do_get(Ticket::new(flumen::serve::datasets::encode_ticket(
            &unknown_job,
        )))
        .await
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("unknown dataset job no-such-job"),
        "{err}"
    );

    // A real job's ticket with a consumer or an epoch it does not have, and a job of no
    // consumers.
    let create =
        |request: Value| arrow_flight::Action::new("flumen.create_dataset", request.to_string());
    let answers: Vec<_> = client
        .do_action(create(serde_json::json!({
            "name": "small", "sql": "SELECT value FROM generate_series(1, 10)",
            "epochs": 1, "consumers": 2
        })))
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let created: Value = serde_json::from_slice(&answers[0].body).unwrap();
    let job = created["job"].as_str().unwrap().to_string();
    for (consumer, epoch) in [(2, 0), (0, 1)] {
        let beyond = flumen::serve::datasets::DatasetTicket {
            job: job.clone(),
            consumer,
            epoch,
        };
        let err = client
            .do_get(Ticket::new(flumen::serve::datasets::encode_ticket(&beyond)))
            .await
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("has consumers 0..2 and epochs 0..1"),
            "{err}"
        );
    }
    let err = client
        .do_action(create(serde_json::json!({
            "name": "none", "sql": "SELECT 1", "epochs": 1, "consumers": 0
        })))
        .await
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("at least one epoch and one consumer"),
        "{err}"
    );

    // SQL errors and an unknown action.
    let err = client.execute("SELEC 1".into(), None).await.unwrap_err();
    assert!(err.to_string().contains("SELEC"), "{err}");
    let err = client
        .execute("SELECT * FROM 'no/such/file.parquet'".into(), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no/such/file.parquet"), "{err}");
    let err = client
        .do_action(arrow_flight::Action::new("shell", "rm -rf /"))
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("no action 'shell'"), "{err}");

    // Still up and answering.
    assert!(server.is_running());
    let info = client
        .execute("SELECT 6 * 7 AS answer".into(), None)
        .await
        .unwrap();
    let ticket = info.endpoint[0].ticket.clone().unwrap();
    let batches: Vec<_> = client
        .do_get(ticket)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(
        batches[0].column(0).as_primitive::<Int64Type>().value(0),
        42
    );
}

#[test]
fn a_server_off_loopback_without_tls_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let out = Command::new(env!("CARGO_BIN_EXE_flumen"))
        .args(["serve", "--listen", "0.0.0.0:0", "--token-file"])
        .arg(&files.token_file)
        .arg("--state-dir")
        .arg(&files.state)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("must use TLS"), "{stderr}");
}

/// The rows the first operator of the one running query has produced and the rows the
/// server has sent, from its progress view (the `flumen.queries` action).
async fn rows_produced(client: &mut FlightSqlServiceClient<Channel>) -> (u64, u64) {
    let answers: Vec<_> = client
        .do_action(arrow_flight::Action::new("flumen.queries", ""))
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let queries: Value = serde_json::from_slice(&answers[0].body).unwrap();
    let first = queries[0]["operators"][0]
        .as_str()
        .unwrap_or_else(|| panic!("{queries}"));
    let rows = first
        .split("rows=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    (
        rows.parse().unwrap(),
        queries[0]["rows_sent"].as_u64().unwrap(),
    )
}

#[tokio::test]
async fn a_slow_reader_holds_the_query_back_instead_of_filling_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &["--memory-budget", "64MiB"]);
    let mut client = server.client(&files).await;
    // 10M rows of ~108 bytes: about 1 GB of result.
    let rows: i64 = 10_000_000;
    let info = client
        .execute(
            format!("SELECT value AS id, repeat('x', 100) AS pad FROM generate_series(1, {rows})"),
            None,
        )
        .await
        .unwrap();
    let ticket = info.endpoint[0].ticket.clone().unwrap();
    let mut stream = client.do_get(ticket).await.unwrap();
    let pid = server.process.child.id();
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .unwrap()
            .to_string();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    };
    let mut received = 0i64;
    let mut bytes = 0u64;
    let mut peak = 0u64;
    let mut early = 0u64;
    let mut produced_while_slow = None;
    let started = Instant::now();
    while let Some(batch) = stream.try_next().await.unwrap() {
        received += batch.num_rows() as i64;
        bytes += batch.get_array_memory_size() as u64;
        // Read slowly for the first 3 seconds, then at full speed.
        if started.elapsed() < Duration::from_secs(3) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            early = early.max(rss());
        } else if produced_while_slow.is_none() {
            produced_while_slow = Some(rows_produced(&mut client).await);
        }
        if received % (1 << 20) < batch.num_rows() as i64 {
            peak = peak.max(rss());
        }
    }
    peak = peak.max(rss());
    assert_eq!(received, rows);
    // After 3 s of slow reading the query had produced little more than was read: it was
    // held back, not run ahead into memory or spill files.
    let (produced, sent) = produced_while_slow.unwrap();
    println!("after 3 s of slow reading: {produced} rows produced, {sent} sent");
    assert!(
        produced < sent + 300_000,
        "the query ran ahead of its reader: {produced} rows produced, {sent} sent"
    );
    println!(
        "result {:.0} MB; server RSS while reading slowly {:.0} MB, peak {:.0} MB",
        bytes as f64 / 1e6,
        early as f64 / 1e6,
        peak as f64 / 1e6
    );
    assert!(bytes > 900_000_000, "{bytes}");
    // The server held a small part of the result at any time.
    assert!(
        peak < 600_000_000,
        "server RSS {peak} while streaming {bytes} bytes"
    );
}

#[tokio::test]
async fn tls_clients_trusting_the_ca_get_answers_and_plaintext_ones_do_not() {
    use flumen::cluster::tls::ClusterCa;
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let ca = ClusterCa::new("serve test CA").unwrap();
    let identity = ca.issue(&["localhost".into(), "127.0.0.1".into()]).unwrap();
    let (cert, key, ca_file) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("ca.pem"),
    );
    identity.write_files(&cert, &key).unwrap();
    std::fs::write(&ca_file, ca.trust().ca_pem()).unwrap();
    let server = Server::start(
        &files,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );

    let _ = rustls::crypto::ring::default_provider().install_default();
    let channel = Endpoint::from_shared(format!("https://{}", server.address))
        .unwrap()
        .tls_config(ca.trust().client_config().domain_name("localhost"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = FlightSqlServiceClient::new(channel);
    client.handshake(USER, PASSWORD).await.unwrap();
    let info = client.execute("SELECT 7 AS n".into(), None).await.unwrap();
    let batches: Vec<_> = client
        .do_get(info.endpoint[0].ticket.clone().unwrap())
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(batches[0].column(0).as_primitive::<Int64Type>().value(0), 7);

    // A plaintext client gets nothing.
    let plaintext = Endpoint::from_shared(format!("http://{}", server.address))
        .unwrap()
        .connect()
        .await;
    if let Ok(channel) = plaintext {
        let mut client = FlightSqlServiceClient::new(channel);
        assert!(client.handshake(USER, PASSWORD).await.is_err());
    }

    let Some(python) = adbc_python() else { return };
    let seen = adbc_at(
        &python,
        &server,
        &server.tls_uri(),
        &files,
        "tls",
        &[ca_file.to_str().unwrap()],
    );
    assert_eq!(seen["docs"], flumen::demo::DEFAULT_ROWS as u64);
}

#[test]
fn two_trainers_read_every_row_once_per_epoch_and_a_second_job_shares_the_run() {
    let Some(python) = adbc_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &[]);
    let seen = adbc(&python, &server, &files, "trainers", &[]);
    assert_eq!(seen["shared"], true, "{seen}");
    for epoch in seen["epochs"].as_array().unwrap() {
        assert_eq!(epoch["exactly_once"], true, "{seen}");
        assert_eq!(epoch["other_exactly_once"], true, "{seen}");
        assert_eq!(epoch["shuffled"], true, "{seen}");
        // First come, first served: the trainer that sleeps gets fewer blocks.
        let (fast, slow) = (
            epoch["fast_blocks"].as_u64().unwrap(),
            epoch["slow_blocks"].as_u64().unwrap(),
        );
        assert_eq!(fast + slow, 100, "{seen}");
        assert!(fast > slow, "{seen}");
    }
    // Two jobs on one dataset: one run of its pipeline per epoch.
    let runs = &seen["report"][0]["runs_per_epoch"];
    assert_eq!(runs["0"], 1, "{seen}");
    assert_eq!(runs["1"], 1, "{seen}");
    println!("trainers: {seen}");
}

#[test]
fn a_killed_trainers_unacknowledged_block_reaches_the_other() {
    let Some(python) = adbc_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &[]);
    let seen = adbc(&python, &server, &files, "killed_consumer", &[]);
    assert_eq!(seen["exactly_once"], true, "{seen}\n{}", server.log());
    assert_eq!(seen["held_block_reached_the_other"], true, "{seen}");
    assert!(
        server.log().contains("did not acknowledge"),
        "{}",
        server.log()
    );
}

/// `flumen --connect` (the REPL on a server) running `args`: its exit status, stdout and
/// stderr.
fn repl_on(server: &Server, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_flumen"))
        .args(["--connect", &server.uri(), "--quiet"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_repl_connected_to_a_server_runs_sql_shows_its_jobs_and_cancels_one() {
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &["--memory-budget", "64MiB"]);
    let token = files.token_file.to_str().unwrap();

    // A long query another client holds open, reading nothing after its first batch.
    let mut client = server.client(&files).await;
    let info = client
        .execute(
            "SELECT value AS id, repeat('x', 100) AS pad FROM generate_series(1, 10000000)".into(),
            None,
        )
        .await
        .unwrap();
    let mut held = client
        .do_get(info.endpoint[0].ticket.clone().unwrap())
        .await
        .unwrap();
    held.try_next().await.unwrap().unwrap();

    // `\jobs` shows it with its operators' progress.
    let (ok, jobs, stderr) = repl_on(&server, &["--token-file", token, "-c", "\\jobs"]);
    assert!(ok, "{stderr}");
    let first = jobs.lines().next().unwrap_or_default();
    let id = first
        .strip_prefix("query ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no running query in \\jobs:\n{jobs}"));
    assert!(jobs.contains("generate_series(1, 10000000)"), "{jobs}");
    assert!(
        jobs.contains("rows="),
        "no operator progress in \\jobs:\n{jobs}"
    );
    assert!(jobs.contains("no datasets"), "{jobs}");

    // `\cancel ID` ends it for its reader; the server lists no query afterwards.
    let (ok, said, stderr) = repl_on(
        &server,
        &["--token-file", token, "-c", &format!("\\cancel {id}")],
    );
    assert!(ok, "{stderr}");
    assert!(said.contains(&format!("cancelled {id}")), "{said}");
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match held.try_next().await {
                Ok(Some(_)) => continue,
                Ok(None) => return "ended".to_string(),
                Err(e) => return e.to_string(),
            }
        }
    })
    .await
    .expect("the cancelled query's stream went on for 20 s");
    assert!(ended.to_lowercase().contains("cancel"), "{ended}");
    let (_, jobs, _) = repl_on(&server, &["--token-file", token, "-c", "\\jobs"]);
    assert!(jobs.starts_with("no running queries"), "{jobs}");

    // A user logs in with a password from a file; statements run on the server, a bad one
    // says what is wrong and the next still runs; `\d` lists the server's tables.
    let password_file = dir.path().join("password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&password_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let login = [
        "--user",
        USER,
        "--password-file",
        password_file.to_str().unwrap(),
    ];
    let (ok, out, stderr) = repl_on(
        &server,
        &[
            &login[..],
            &[
                "--format",
                "csv",
                "-c",
                "SELECT count(*) AS n FROM docs",
                "-c",
                "SELECT nosuch FROM docs",
                "-c",
                "SELECT sum(value) AS s FROM generate_series(1, 100)",
                "-c",
                "\\d",
            ],
        ]
        .concat(),
    );
    assert!(!ok, "a failed statement makes the exit status a failure");
    assert!(out.contains("n\n100000\n"), "{out}");
    assert!(out.contains("s\n5050\n"), "{out}");
    assert!(out.contains("datafusion.public.docs"), "{out}");
    assert_eq!(
        stderr.matches("No field named nosuch").count(),
        1,
        "{stderr}"
    );

    // A wrong password, a token file others can read, a server that is not there: clear
    // errors, no session.
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "not the password\n").unwrap();
    std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (ok, _, stderr) = repl_on(
        &server,
        &[
            "--user",
            USER,
            "--password-file",
            wrong.to_str().unwrap(),
            "-c",
            "SELECT 1",
        ],
    );
    assert!(!ok);
    assert!(
        stderr.contains("wrong user name, password or token"),
        "{stderr}"
    );
    std::fs::set_permissions(&files.token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, _, stderr) = repl_on(&server, &["--token-file", token, "-c", "SELECT 1"]);
    assert!(!ok);
    assert!(stderr.contains("chmod 600"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_flumen"))
        .args([
            "--connect",
            "grpc://127.0.0.1:1",
            "--token-file",
            token,
            "-c",
            "SELECT 1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot connect to grpc://127.0.0.1:1"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every block of `ticket` (hex) read through to its epoch's end: the ids of column `id`.
async fn read_epoch(client: &mut FlightSqlServiceClient<Channel>, ticket: &str) -> Vec<i64> {
    let mut ids = vec![];
    loop {
        let batches: Vec<_> = client
            .do_get(Ticket::new(hex::decode(ticket).unwrap()))
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        if rows == 0 {
            return ids;
        }
        for batch in batches {
            let column = batch
                .column_by_name("id")
                .unwrap()
                .as_primitive::<Int64Type>();
            ids.extend(column.values().iter().copied());
        }
    }
}

#[tokio::test]
async fn an_abandoned_job_is_dropped_and_stops_holding_back_the_run_it_shared() {
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &["--dataset-job-idle", "2"]);
    let mut client = server.client(&files).await;
    let create = async |client: &mut FlightSqlServiceClient<Channel>| -> Value {
        let request = serde_json::json!({
            "name": "shared", "sql": "SELECT value AS id FROM generate_series(1, 100000)",
            "epochs": 1, "consumers": 1, "batch_rows": 1000
        });
        let answers: Vec<_> = client
            .do_action(arrow_flight::Action::new(
                "flumen.create_dataset",
                request.to_string(),
            ))
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        serde_json::from_slice(&answers[0].body).unwrap()
    };
    let reading = create(&mut client).await;
    let abandoned = create(&mut client).await;
    assert_eq!(abandoned["shared"], true, "{abandoned}");
    // The second job's trainer never comes: 100 blocks, its queue holds 8.
    let started = Instant::now();
    let ticket = reading["tickets"][0]["ticket"]
        .as_str()
        .unwrap()
        .to_string();
    let mut ids = tokio::time::timeout(Duration::from_secs(60), read_epoch(&mut client, &ticket))
        .await
        .expect("the shared run stayed held back by the job nobody reads");
    let took = started.elapsed();
    ids.sort_unstable();
    assert_eq!(ids, (1..=100_000).collect::<Vec<i64>>());
    println!("one epoch with an abandoned sharer: {took:?}");
    // Its ticket now names a dropped job; once the reader is idle too, no dataset is left.
    let ticket = abandoned["tickets"][0]["ticket"].as_str().unwrap();
    let err = client
        .do_get(Ticket::new(hex::decode(ticket).unwrap()))
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("unknown dataset job"), "{err}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let answers: Vec<_> = client
        .do_action(arrow_flight::Action::new("flumen.datasets", ""))
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let datasets: Value = serde_json::from_slice(&answers[0].body).unwrap();
    assert_eq!(datasets, serde_json::json!([]));
    assert!(server.log().contains("dropped"), "{}", server.log());
}

/// A Flight SQL query's batches.
async fn query_batches(
    client: &mut FlightSqlServiceClient<Channel>,
    sql: &str,
) -> Vec<datafusion::arrow::record_batch::RecordBatch> {
    let info = client.execute(sql.into(), None).await.unwrap();
    let stream = client
        .do_get(info.endpoint[0].ticket.clone().unwrap())
        .await
        .unwrap();
    stream.try_collect().await.unwrap()
}

/// What a server answered to `sql` is what `vanilla` answers.
async fn assert_served_like(
    vanilla: &datafusion::prelude::SessionContext,
    sql: &str,
    served: &[datafusion::arrow::record_batch::RecordBatch],
) {
    let expected = common::collect(vanilla, sql).await;
    assert!(
        common::same_rows(&expected, served, true),
        "{sql}: served {:?}, vanilla {:?}",
        common::rows(served, true),
        common::rows(&expected, true)
    );
}

#[tokio::test]
async fn a_server_with_workers_runs_four_clients_queries_in_them_and_answers_like_datafusion() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("events");
    common::write_events(&data, 3, 20_000);
    let files = ServerFiles::new(dir.path());
    let allow = data.to_str().unwrap();
    let server = Server::start(
        &files,
        &["--workers", "2", "--no-demo", "--allow-path", allow],
    );
    let mut client = server.client(&files).await;
    let table = format!(
        "CREATE EXTERNAL TABLE events STORED AS PARQUET LOCATION '{}/'",
        data.display()
    );
    query_batches(&mut client, &table).await;
    let vanilla = common::vanilla();
    common::register_tables(&vanilla, &data).await;
    for sql in [
        "SELECT count(*), sum(id) FROM events WHERE id % 7 = 3",
        "SELECT k, count(*) AS n, max(id), min(body) FROM events GROUP BY k ORDER BY k",
    ] {
        let served = query_batches(&mut client, sql).await;
        assert_served_like(&vanilla, sql, &served).await;
    }
    // A `LargeList` column reaches the client as a `LargeList` (arrow-flight's encoder sent
    // it as a `List`), its values as DataFusion's; a dictionary column as its values. The
    // schema the server announced is the one the stream has.
    let sql = "SELECT id, arrow_cast(make_array(id, id + 1), 'LargeList(Int64)') AS ll, \
               arrow_cast(CAST(k AS VARCHAR), 'Dictionary(Int32, Utf8)') AS d \
               FROM events WHERE id % 4999 = 1 ORDER BY id";
    let info = client.execute(sql.into(), None).await.unwrap();
    let announced = info.clone().try_decode_schema().unwrap();
    let stream = client.do_get(info.endpoint[0].ticket.clone().unwrap());
    let served: Vec<_> = stream.await.unwrap().try_collect().await.unwrap();
    assert_served_like(&vanilla, sql, &served).await;
    let expected = common::collect(&vanilla, sql).await;
    assert_eq!(
        served[0].schema().fields()[..2],
        expected[0].schema().fields()[..2]
    );
    assert_eq!(served[0].schema().field(2).data_type(), &DataType::Utf8);
    assert_eq!(announced.fields(), served[0].schema().fields());
    // Four clients at once, each its own query and answer.
    let queries = [
        "SELECT count(*) FROM events WHERE id % 3 = 0",
        "SELECT k, sum(id) FROM events GROUP BY k ORDER BY k",
        "SELECT id, body FROM events WHERE id % 4999 = 1 ORDER BY id",
        "SELECT max(v), min(v), count(DISTINCT k) FROM events WHERE body LIKE '%7%'",
    ];
    let mut running = vec![];
    for sql in queries {
        let mut client = server.client(&files).await;
        running.push(tokio::spawn(async move {
            (sql, query_batches(&mut client, sql).await)
        }));
    }
    for handle in running {
        let (sql, served) = handle.await.unwrap();
        assert_served_like(&vanilla, sql, &served).await;
    }
    // The scans ran in the server's worker processes, and nothing fell back to the driver.
    let plan = query_batches(
        &mut client,
        "EXPLAIN ANALYZE SELECT k, count(*) FROM events WHERE id > 10 GROUP BY k",
    )
    .await;
    let text = datafusion::arrow::util::pretty::pretty_format_batches(&plan)
        .unwrap()
        .to_string();
    let remote: u64 = text
        .split("remote_tasks=")
        .skip(1)
        .filter_map(|rest| rest.split([',', ']']).next()?.parse::<u64>().ok())
        .sum();
    assert!(remote >= 3, "{remote} tasks ran in workers:\n{text}");
    for line in text.lines().filter(|l| l.contains("tasks_on_driver.")) {
        for reason in line.split("tasks_on_driver.").skip(1) {
            assert!(
                reason.starts_with("per_partition") || reason.starts_with("out_of_core"),
                "a task fell back to the driver: {reason}\n{text}"
            );
        }
    }
}

/// `flumen.create_dataset` with `body`: the answer (JSON), or the error's text.
async fn create_dataset(
    client: &mut FlightSqlServiceClient<Channel>,
    body: &Value,
) -> Result<Value, String> {
    let action = arrow_flight::Action::new("flumen.create_dataset", body.to_string());
    let answers: Vec<_> = match client.do_action(action).await {
        Ok(stream) => stream.try_collect().await.map_err(|e| e.to_string())?,
        Err(e) => return Err(e.to_string()),
    };
    Ok(serde_json::from_slice(&answers[0].body).unwrap())
}

/// A client of `server` without a token yet (it logs in, or is refused).
async fn anonymous(server: &Server) -> FlightSqlServiceClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{}", server.address))
        .unwrap()
        .connect()
        .await
        .unwrap();
    FlightSqlServiceClient::new(channel)
}

/// A client's statement refused by the server's policy: the error, checked to be a refusal
/// (`PERMISSION_DENIED`) that names `names`.
async fn assert_refused(client: &mut FlightSqlServiceClient<Channel>, sql: &str, names: &str) {
    let err = client
        .execute(sql.to_string(), None)
        .await
        .expect_err(sql)
        .to_string();
    println!("{sql}\n  -> {err}");
    assert!(err.contains("flumen serve refuses"), "{sql}: {err}");
    assert!(
        err.contains("PermissionDenied") || err.contains("permission"),
        "{sql}: {err}"
    );
    assert!(err.contains(names), "{sql}: {err}");
}

/// A hostile client, logged in: every way to reach a file or URL the operator did not allow
/// (a table's `LOCATION`, a path table, a symlink inside the allowed directory, `..`, `COPY`
/// outside it, the cloud's metadata service) and every operator setting (`SET`, `RESET`)
/// is refused, naming what was refused; what the operator allowed still works, and another
/// client's query (a second session) goes on the whole time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_client_is_refused_what_the_operator_did_not_allow() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let data = dir.path().join("data");
    common::write_events(&data.join("events"), 1, 2_000);
    // A link inside the allowed directory to the users file outside it.
    symlink(&files.users, data.join("users.csv")).unwrap();
    // The operator fixes a slot count in its settings file, and a client setting's default.
    let settings = dir.path().join("settings");
    std::fs::write(
        &settings,
        "flumen.cpu_slots = 3  # the operator's\ndatafusion.execution.batch_size = 1234\n",
    )
    .unwrap();
    let server = Server::start(
        &files,
        &[
            "--no-demo",
            "--allow-path",
            data.to_str().unwrap(),
            "--settings",
            settings.to_str().unwrap(),
        ],
    );
    let mut hostile = server.client(&files).await;
    let mut other = server.client(&files).await;
    let long = "SELECT count(*) FROM generate_series(1, 30000000) AS t(x) WHERE x % 7 = 1";
    let other_query = tokio::spawn(async move { query_batches(&mut other, long).await });

    let users = files.users.display().to_string();
    let token = files.token_file.display().to_string();
    let data_dir = data.display().to_string();
    let outside = dir.path().join("stolen.csv").display().to_string();
    let attacks = [
        ("CREATE EXTERNAL TABLE p STORED AS CSV LOCATION '/etc/passwd'".to_string(), "/etc/passwd".to_string()),
        (format!("CREATE EXTERNAL TABLE u STORED AS CSV LOCATION '{users}'"), users.clone()),
        (format!("SELECT * FROM '{token}'"), token.clone()),
        (format!("SELECT * FROM 'file://{users}'"), users.clone()),
        (format!("SELECT * FROM '{data_dir}/users.csv'"), "users.csv".to_string()),
        (format!("SELECT * FROM '{data_dir}/../token'"), "../token".to_string()),
        (format!("COPY (SELECT 1 AS a) TO '{outside}'"), outside.clone()),
        (
            "CREATE EXTERNAL TABLE m STORED AS CSV LOCATION 'http://169.254.169.254/latest/meta-data/'"
                .to_string(),
            "169.254.169.254".to_string(),
        ),
        (
            "SELECT * FROM 'http://169.254.169.254/latest/user-data.csv'".to_string(),
            "169.254.169.254".to_string(),
        ),
        ("SELECT * FROM 's3://someone-elses-bucket/t.parquet'".to_string(), "s3://someone-elses-bucket".to_string()),
        // Table functions read what they name as the statement is planned.
        (format!("SELECT * FROM read_csv('{token}')"), token.clone()),
        (format!("SELECT * FROM read_json(['{data_dir}/events/', '{users}'])"), users.clone()),
        (format!("SELECT * FROM parquet_metadata('{data_dir}/../token')"), "../token".to_string()),
        (format!("SELECT * FROM table_changes('{users}', 0)"), users.clone()),
        ("SELECT * FROM glob('/etc/*')".to_string(), "/etc".to_string()),
        (
            format!("SELECT * FROM (SELECT 1) t, read_csv('{data_dir}/' || '../token')"),
            "must be a quoted string".to_string(),
        ),
        (
            format!("CREATE VIEW v AS SELECT * FROM read_csv('{data_dir}/users.csv')"),
            "users.csv".to_string(),
        ),
    ];
    for (sql, names) in &attacks {
        assert_refused(&mut hostile, sql, names).await;
    }
    assert!(
        !Path::new(&outside).exists(),
        "COPY wrote outside the allowed directory"
    );
    let mut settings: Vec<&str> = flumen::serve::policy::OPERATOR_SETTINGS
        .iter()
        .map(|(name, _)| *name)
        .collect();
    settings.extend([
        "datafusion.runtime.memory_limit",
        "datafusion.runtime.temp_directory",
    ]);
    for name in settings {
        assert_refused(&mut hostile, &format!("SET {name} = '1'"), name).await;
        assert_refused(&mut hostile, &format!("RESET {name}"), name).await;
    }
    let slots = query_batches(
        &mut hostile,
        "SELECT value FROM information_schema.df_settings \
         WHERE name = 'datafusion.execution.batch_size'",
    )
    .await;
    let shown = datafusion::arrow::util::pretty::pretty_format_batches(&slots)
        .unwrap()
        .to_string();
    assert!(shown.contains("| 1234 "), "{shown}");
    assert_refused(&mut hostile, "SET flumen.cpu_slots = 64", "--settings FILE").await;
    // A dataset job runs a query under the same policy.
    let body = serde_json::json!({
        "name": "stolen", "sql": format!("SELECT * FROM '{users}'"), "epochs": 1, "consumers": 1
    });
    let err = create_dataset(&mut hostile, &body)
        .await
        .expect_err("a dataset job over the users file was created");
    assert!(err.contains("flumen serve refuses"), "{err}");

    // Dataset jobs are their creator's: another user neither lists nor reads one, even
    // with its ticket; a job's size is capped.
    let body = serde_json::json!({"name": "mine", "sql": "SELECT 1 AS a"});
    let created = create_dataset(&mut hostile, &body).await.unwrap();
    let ticket = hex::decode(created["tickets"][0]["ticket"].as_str().unwrap()).unwrap();
    let mut ana = anonymous(&server).await;
    ana.handshake(USER, PASSWORD).await.unwrap();
    let err = ana
        .do_get(Ticket::new(ticket.clone()))
        .await
        .map(|_| ())
        .expect_err("another user's ticket was served")
        .to_string();
    assert!(err.contains("unknown dataset job"), "{err}");
    let listed = ana
        .do_action(arrow_flight::Action::new("flumen.datasets", ""))
        .await
        .unwrap()
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    assert_eq!(
        &listed[0].body[..],
        b"[]",
        "another user's datasets were listed"
    );
    let err = ana
        .do_action(arrow_flight::Action::new(
            "flumen.renew_dataset_lease",
            hex::encode(&ticket),
        ))
        .await
        .expect_err("another user's lease was renewed")
        .to_string();
    assert!(err.contains("unknown dataset job"), "{err}");
    for (body, says) in [
        (
            serde_json::json!({"name": "e", "sql": "SELECT 1", "epochs": 10000, "consumers": 2}),
            "tickets",
        ),
        (
            serde_json::json!({"name": "c", "sql": "SELECT 1", "consumers": 1000000}),
            "tickets",
        ),
    ] {
        let err = create_dataset(&mut hostile, &body)
            .await
            .expect_err("an oversized dataset job was created");
        assert!(err.contains(says), "{err}");
    }
    // The creator reads its own job.
    let own: Vec<_> = hostile
        .do_get(Ticket::new(ticket))
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(own.iter().map(|b| b.num_rows()).sum::<usize>(), 1);

    // What the operator allowed works: a table in the data directory, a COPY into it, a
    // client setting.
    query_batches(
        &mut hostile,
        &format!("CREATE EXTERNAL TABLE events STORED AS PARQUET LOCATION '{data_dir}/events/'"),
    )
    .await;
    query_batches(
        &mut hostile,
        &format!("COPY (SELECT id FROM events) TO '{data_dir}/out.parquet'"),
    )
    .await;
    query_batches(&mut hostile, "SET flumen.target_block_rows = 1000").await;
    // And a table function over the allowed directory.
    let rows = query_batches(
        &mut hostile,
        &format!(
            "SELECT count(*) AS n FROM read_parquet('{data_dir}/events/') \
             UNION ALL SELECT sum(row_group_num_rows) FROM parquet_metadata('{data_dir}/out.parquet') \
             WHERE column_id = 0"
        ),
    )
    .await;
    let counts = datafusion::arrow::util::pretty::pretty_format_batches(&rows)
        .unwrap()
        .to_string();
    assert_eq!(counts.matches("| 2000 |").count(), 2, "{counts}");
    // A client setting goes back to its default with `RESET` (DataFusion 55 knows only its
    // own namespace there), and is set again for the reads below.
    let block_rows = "SELECT value FROM information_schema.df_settings \
                      WHERE name = 'flumen.target_block_rows'";
    let value = |batches: &[datafusion::arrow::record_batch::RecordBatch]| {
        (batches[0].column(0).as_string::<i32>().value(0)).to_string()
    };
    assert_eq!(
        value(&query_batches(&mut hostile, block_rows).await),
        "1000"
    );
    query_batches(&mut hostile, "RESET flumen.target_block_rows").await;
    let default = flumen::FlumenConfig::default().target_block_rows;
    assert_eq!(
        value(&query_batches(&mut hostile, block_rows).await),
        default.to_string()
    );
    query_batches(&mut hostile, "SET flumen.target_block_rows = 1000").await;
    let read = query_batches(
        &mut hostile,
        &format!("SELECT count(*) FROM '{data_dir}/out.parquet'"),
    )
    .await;
    assert_eq!(
        read[0].column(0).as_primitive::<Int64Type>().value(0),
        2_000
    );
    // A path it may read where there is no file says so, through the session's store.
    let missing = format!("{data_dir}/missing.parquet");
    let err = hostile
        .execute(format!("SELECT * FROM '{missing}'"), None)
        .await
        .expect_err("a missing file")
        .to_string();
    assert!(
        err.contains(&format!(
            "cannot read '{missing}' as a table: no file found there"
        )),
        "{err}"
    );

    // The other client's query went on, and gives its answer.
    let answer = other_query.await.unwrap();
    assert_eq!(
        answer[0].column(0).as_primitive::<Int64Type>().value(0),
        30_000_000 / 7 + 1
    );
    let mut server = server;
    assert!(server.is_running());
    let log = server.log();
    assert!(log.contains("clients may touch directories: "), "{log}");
}

/// `VmHWM` (peak resident set) of process `pid`, from `/proc`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// Milliseconds of each of `n` short queries, sorted.
async fn query_latencies(client: &mut FlightSqlServiceClient<Channel>, n: usize) -> Vec<f64> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let batches = query_batches(client, "SELECT 6 * 7 AS answer").await;
        assert_eq!(
            batches[0].column(0).as_primitive::<Int64Type>().value(0),
            42
        );
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    times
}

/// A flood of wrong-password handshakes (bounded: 32 tasks on loopback, 12 attempts each)
/// while a logged-in client keeps querying: every attempt fails, nearly all refused before
/// a password check (the address and the user back off after three failures, the checks
/// are rationed), the logged-in client's every query is answered, and the server's peak RSS
/// (from `/proc`) grows by less than a few checks' memory. The latencies before and during
/// are printed; `benches/serve.rs` is where they are judged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_flood_is_refused_cheaply_while_a_logged_in_client_keeps_querying() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &["--no-demo"]);
    let pid = server.process.child.id();
    let mut client = server.client(&files).await;
    let before = query_latencies(&mut client, 40).await;
    let peak_before = peak_rss(pid);
    let (checked, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut flood = vec![];
    for _ in 0..32 {
        let address = server.address.clone();
        let (checked, refused) = (Arc::clone(&checked), Arc::clone(&refused));
        flood.push(tokio::spawn(async move {
            let channel = Endpoint::from_shared(format!("http://{address}"))
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut attacker = FlightSqlServiceClient::new(channel);
            for _ in 0..12 {
                let err = attacker
                    .handshake(USER, "not the password")
                    .await
                    .expect_err("a wrong password logged in")
                    .to_string();
                if err.contains("try again") {
                    refused.fetch_add(1, Ordering::Relaxed);
                } else {
                    assert!(err.contains("wrong user name, password or token"), "{err}");
                    checked.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let during = query_latencies(&mut client, 40).await;
    for attacker in flood {
        attacker.await.unwrap();
    }
    let (checked, refused) = (
        checked.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
    let growth = peak_rss(pid).saturating_sub(peak_before);
    let p = |t: &[f64], q: f64| t[((t.len() - 1) as f64 * q) as usize];
    println!(
        "flood of {} handshakes: {checked} checked, {refused} refused unchecked; peak RSS +{} MB; \
         query p50/p99 {:.1}/{:.1} ms before, {:.1}/{:.1} ms during",
        checked + refused,
        growth >> 20,
        p(&before, 0.5),
        p(&before, 0.99),
        p(&during, 0.5),
        p(&during, 0.99)
    );
    assert_eq!(checked + refused, 32 * 12);
    assert!(
        checked <= 100,
        "{checked} password checks ran for a flood from one address"
    );
    // Each check takes ~19 MiB while it runs; at most a core's worth at once.
    assert!(growth < 256 << 20, "peak RSS grew {} MB", growth >> 20);
    // The right password from the flooding address waits out the backoff, saying so.
    let err = anonymous(&server)
        .await
        .handshake(USER, PASSWORD)
        .await
        .expect_err("the flooding address logged in at once")
        .to_string();
    assert!(
        err.contains("too many failed handshakes; try again in"),
        "{err}"
    );
    // The logged-in client goes on.
    assert_eq!(query_latencies(&mut client, 5).await.len(), 5);
}

/// `--max-queries-per-user 1`: while a user's query streams (its reader holds it back), the
/// same user's next query is refused with a clear error; another user's runs; once the
/// first ends, the user's next query runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_runs_at_most_its_queries_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(&files, &["--no-demo", "--max-queries-per-user", "1"]);
    let mut client = server.client(&files).await;
    let long = "SELECT value FROM generate_series(1, 100000000)";
    let info = client.execute(long.into(), None).await.unwrap();
    let mut first = client
        .do_get(info.endpoint[0].ticket.clone().unwrap())
        .await
        .unwrap();
    // One batch read: the query runs, held back by its reader.
    first.try_next().await.unwrap().unwrap();
    let info = client.execute("SELECT 6 * 7".into(), None).await.unwrap();
    let err = client
        .do_get(info.endpoint[0].ticket.clone().unwrap())
        .await
        .map(|_| ())
        .expect_err("a second query of the same user ran")
        .to_string();
    assert!(err.contains("the most this user may run at once"), "{err}");
    // Another user is not held back by this one.
    let mut ana = anonymous(&server).await;
    ana.handshake(USER, PASSWORD).await.unwrap();
    assert_eq!(query_latencies(&mut ana, 1).await.len(), 1);
    // The first query ended (dropped by its reader): the user runs again.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = client.execute("SELECT 6 * 7".into(), None).await.unwrap();
        match client
            .do_get(info.endpoint[0].ticket.clone().unwrap())
            .await
        {
            Ok(stream) => {
                let batches: Vec<_> = stream.try_collect().await.unwrap();
                assert_eq!(
                    batches[0].column(0).as_primitive::<Int64Type>().value(0),
                    42
                );
                break;
            }
            Err(e) if Instant::now() < deadline => {
                assert!(e.to_string().contains("at once"), "{e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the user's query slot never came back: {e}"),
        }
    }
}

/// The rows of `sql`'s one-number answer.
async fn count_of(client: &mut FlightSqlServiceClient<Channel>, sql: &str) -> i64 {
    query_batches(client, sql).await[0]
        .column(0)
        .as_primitive::<Int64Type>()
        .value(0)
}

/// Two users point the same bucket name at two S3 servers (real moto servers on loopback,
/// each allowed to its user in the users file) and query it at once: each reads its own
/// server's rows with its own keys. A user may not aim at the other's endpoint, and a user
/// with no credentials of its own gets none from the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_users_read_the_same_bucket_name_through_their_own_endpoints_at_once() {
    let (Some(a), Some(b)) = (s3_server::S3Server::start(), s3_server::S3Server::start()) else {
        common::skip_missing_tool("moto_server not found (run tests/install-test-tools.sh)");
        return;
    };
    // The same bucket and key on both servers; 100 rows on one, 200 on the other.
    let writer = flumen::session(flumen::FlumenConfig::default());
    for (server, rows) in [(&a, 100), (&b, 200)] {
        server.create_bucket("lake");
        let sql = format!(
            "COPY (SELECT value AS id FROM generate_series(1, {rows})) \
             TO 's3://lake/t/part-0.parquet' {}",
            server.options()
        );
        flumen::io::register_for_statement(&writer, &sql).unwrap();
        writer.sql(&sql).await.unwrap().collect().await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let hash = flumen::serve::credentials::hash_password(PASSWORD).unwrap();
    std::fs::write(
        &files.users,
        format!(
            "ana:{hash} allow-url={}/\nben:{hash} allow-url={}/\ncy:{hash}\n",
            a.endpoint, b.endpoint
        ),
    )
    .unwrap();
    let server = Server::start(&files, &["--no-demo", "--allow-url", "s3://lake/"]);
    let mut users = Vec::new();
    for (name, s3) in [("ana", &a), ("ben", &b)] {
        let mut client = anonymous(&server).await;
        client.handshake(name, PASSWORD).await.unwrap();
        query_batches(
            &mut client,
            &format!(
                "CREATE EXTERNAL TABLE {name}_t STORED AS PARQUET LOCATION 's3://lake/t/' {}",
                s3.options()
            ),
        )
        .await;
        users.push(client);
    }
    let mut ben = users.pop().unwrap();
    let mut ana = users.pop().unwrap();
    // At once, several times: each user's bucket is its own server's.
    let by_url = "SELECT count(*) FROM 's3://lake/t/part-0.parquet'";
    let ana_reads = tokio::spawn(async move {
        let mut counts = Vec::new();
        for _ in 0..5 {
            counts.push(count_of(&mut ana, by_url).await);
        }
        (ana, counts)
    });
    let mut ben_counts = Vec::new();
    for _ in 0..5 {
        ben_counts.push(count_of(&mut ben, by_url).await);
    }
    let (mut ana, ana_counts) = ana_reads.await.unwrap();
    assert_eq!(ana_counts, vec![100; 5]);
    assert_eq!(ben_counts, vec![200; 5]);
    // Ana may not aim at Ben's server (an internal address her grant does not name).
    assert_refused(
        &mut ana,
        &format!(
            "CREATE EXTERNAL TABLE stolen STORED AS PARQUET LOCATION 's3://lake/t/' {}",
            b.options()
        ),
        &b.endpoint,
    )
    .await;
    // A user without credentials of its own gets none from the server's environment, nor
    // through options that reach for the server's identity.
    let mut cy = anonymous(&server).await;
    cy.handshake("cy", PASSWORD).await.unwrap();
    let err = cy
        .execute(by_url.to_string(), None)
        .await
        .expect_err("a user without credentials read the bucket")
        .to_string();
    assert!(
        err.contains("no credentials for s3://lake") && err.contains("user cy"),
        "{err}"
    );
    let err = cy
        .execute(
            "CREATE EXTERNAL TABLE c STORED AS PARQUET LOCATION 's3://lake/t/' \
             OPTIONS ('aws.container_credentials_relative_uri' '/v2/credentials')"
                .to_string(),
            None,
        )
        .await
        .expect_err("a user reached for the server's container credentials")
        .to_string();
    assert!(err.contains("server's own cloud identity"), "{err}");
    assert_eq!(count_of(&mut ana, by_url).await, 100);
}

/// Fifty clients at once, each grouping a million rows and streaming a million-row result:
/// every answer is right, and the server's peak RSS grows by at most the memory budget
/// (`--memory-budget 64MB`, what blocks may hold) plus a per-client overhead of 2 MiB (a few
/// batches in flight per stream, a session). Results stream under backpressure: buffered,
/// the results alone would be 400 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_at_once_stay_within_the_budget() {
    use std::sync::Arc;
    const CLIENTS: usize = 50;
    let dir = tempfile::tempdir().unwrap();
    let files = ServerFiles::new(dir.path());
    let server = Server::start(
        &files,
        &[
            "--no-demo",
            "--memory-budget",
            "64MB",
            // The static token's holders are one user: let all fifty run.
            "--max-queries-per-user",
            "64",
        ],
    );
    let pid = server.process.child.id();
    let mut warm = server.client(&files).await;
    let grouped =
        "SELECT value % 1000 AS k, count(*) AS n FROM generate_series(1, 1000000) GROUP BY k";
    let streamed = "SELECT value FROM generate_series(1, 1000000)";
    query_batches(&mut warm, grouped).await;
    query_batches(&mut warm, streamed).await;
    let idle = peak_rss(pid);
    let started = Instant::now();
    let start_line = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let mut client = server.client(&files).await;
        let start_line = Arc::clone(&start_line);
        clients.push(tokio::spawn(async move {
            start_line.wait().await;
            let groups: usize = query_batches(&mut client, grouped)
                .await
                .iter()
                .map(|b| b.num_rows())
                .sum();
            let mut rows = 0;
            let mut sum = 0i64;
            for batch in query_batches(&mut client, streamed).await {
                rows += batch.num_rows();
                sum += batch
                    .column(0)
                    .as_primitive::<Int64Type>()
                    .values()
                    .iter()
                    .sum::<i64>();
            }
            (groups, rows, sum)
        }));
    }
    for client in clients {
        assert_eq!(
            client.await.unwrap(),
            (1000, 1_000_000, 1_000_000 * 1_000_001 / 2)
        );
    }
    let grown = peak_rss(pid).saturating_sub(idle);
    let bound = (64 << 20) + CLIENTS as u64 * (2 << 20);
    println!(
        "{CLIENTS} clients: {:.1} s; server peak RSS {} MiB at idle, +{} MiB with {CLIENTS} \
         clients (bound {} MiB)",
        started.elapsed().as_secs_f64(),
        idle >> 20,
        grown >> 20,
        bound >> 20
    );
    assert!(grown <= bound, "peak RSS grew {grown} bytes, over {bound}");
}
