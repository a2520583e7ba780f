//! The REPL connected to a `flumen serve` (`flumen --connect grpc://HOST:PORT`): statements
//! run on the server over Flight SQL and their results stream back block by block; `\jobs`
//! shows the server's running queries (with their operators' progress) and dataset jobs,
//! `\cancel ID` cancels one of the user's queries, `\d` lists the server's tables.
//!
//! Credentials never travel through argv or the environment: a token file (owner-only), or a
//! user name with the password typed at a prompt without echo (or read from an owner-only
//! file for scripts). The password is exchanged once, in the handshake, for a session token.

use std::path::{Path, PathBuf};

use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::sql::{Any, CommandGetTables, CommandStatementQuery, ProstMessageExt};
use arrow_flight::{Action, FlightDescriptor, FlightInfo, HandshakeRequest};
use base64::Engine;
use datafusion::arrow::array::{AsArray, RecordBatch};
use datafusion::arrow::datatypes::Schema;
use datafusion::error::{DataFusionError, Result};
use flumen::cluster::auth::{Secret, SendSecret};
use flumen::serve::datasets::DatasetReport;
use flumen::serve::flight_sql::{CANCEL_ACTION, DATASETS_ACTION, LIST_QUERIES_ACTION};
use flumen::serve::running::QueryProgress;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use prost::Message;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// How to reach and log in to a server (the REPL's `--connect` options).
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// `grpc://HOST:PORT` (plain, loopback servers) or `grpc+tls://HOST:PORT`.
    pub uri: String,
    /// The server's token (64 hex digits, an owner-only file).
    pub token_file: Option<PathBuf>,
    /// Log in as this user with a password.
    pub user: Option<String>,
    /// Read the password from this owner-only file instead of prompting.
    pub password_file: Option<PathBuf>,
    /// Trust only this CA (PEM) for `grpc+tls://` (default: the system's roots).
    pub tls_ca: Option<PathBuf>,
}

type AuthedClient = FlightServiceClient<InterceptedService<Channel, SendSecret>>;

/// A logged-in connection to a `flumen serve`.
pub struct RemoteSession {
    client: AuthedClient,
    /// Where it is connected, for messages.
    pub uri: String,
}

impl RemoteSession {
    /// Connect to `options.uri` and log in.
    pub async fn connect(options: &ConnectOptions) -> Result<Self> {
        let channel = channel(options).await?;
        let token = match (&options.token_file, &options.user) {
            (Some(file), None) => Secret::from_file(file)?,
            (None, Some(user)) => {
                let password = password(options.password_file.as_deref(), user)?;
                handshake(channel.clone(), user, &password).await?
            }
            _ => {
                return Err(DataFusionError::Plan(
                    "--connect needs --token-file FILE or --user NAME".into(),
                ));
            }
        };
        let mut client = FlightServiceClient::with_interceptor(channel, SendSecret::new(&token))
            .max_decoding_message_size(usize::MAX);
        // Check the credential now rather than at the first statement.
        client
            .list_actions(arrow_flight::Empty {})
            .await
            .map_err(|status| server_error(&options.uri, &status))?;
        Ok(Self {
            client,
            uri: options.uri.clone(),
        })
    }

    /// Run `sql` on the server; its result, block by block as the server sends them.
    pub async fn query(&mut self, sql: &str) -> Result<BoxStream<'static, Result<RecordBatch>>> {
        let command = CommandStatementQuery {
            query: sql.to_string(),
            transaction_id: None,
        };
        let info = self.flight_info(command.as_any()).await?;
        self.fetch(info)
    }

    /// The tables the server has, `catalog.schema.table`.
    pub async fn tables(&mut self) -> Result<Vec<String>> {
        let command = CommandGetTables {
            include_schema: false,
            ..Default::default()
        };
        let info = self.flight_info(command.as_any()).await?;
        let batches: Vec<RecordBatch> = self.fetch(info)?.try_collect().await?;
        let mut names = vec![];
        for batch in &batches {
            let column = |name: &str| batch.column_by_name(name).map(|c| c.as_string::<i32>());
            let (Some(catalogs), Some(schemas), Some(tables)) = (
                column("catalog_name"),
                column("db_schema_name"),
                column("table_name"),
            ) else {
                return Err(DataFusionError::Execution(
                    "the server's GetTables answer lacks its name columns".into(),
                ));
            };
            for row in 0..batch.num_rows() {
                if schemas.value(row) != "information_schema" {
                    names.push(format!(
                        "{}.{}.{}",
                        catalogs.value(row),
                        schemas.value(row),
                        tables.value(row)
                    ));
                }
            }
        }
        names.sort();
        Ok(names)
    }

    /// The columns of table `name` as the server plans it.
    pub async fn schema_of(&mut self, name: &str) -> Result<Schema> {
        let command = CommandStatementQuery {
            query: format!("SELECT * FROM {name} LIMIT 0"),
            transaction_id: None,
        };
        let info = self.flight_info(command.as_any()).await?;
        let schema = info
            .try_decode_schema()
            .map_err(|e| DataFusionError::Execution(format!("the server's schema: {e}")))?;
        Ok(schema)
    }

    /// The server's running queries and dataset jobs, as lines to print.
    pub async fn jobs(&mut self) -> Result<String> {
        let queries: Vec<QueryProgress> =
            serde_json::from_slice(&self.action(LIST_QUERIES_ACTION, "").await?)
                .map_err(|e| bad_answer(LIST_QUERIES_ACTION, e))?;
        let datasets: Vec<DatasetReport> =
            serde_json::from_slice(&self.action(DATASETS_ACTION, "").await?)
                .map_err(|e| bad_answer(DATASETS_ACTION, e))?;
        Ok(jobs_text(&queries, &datasets))
    }

    /// Cancel the running query `id` (one of this user's).
    pub async fn cancel(&mut self, id: &str) -> Result<()> {
        self.action(CANCEL_ACTION, id).await.map(|_| ())
    }

    async fn flight_info(&mut self, command: Any) -> Result<FlightInfo> {
        let descriptor = FlightDescriptor::new_cmd(command.encode_to_vec());
        self.client
            .get_flight_info(descriptor)
            .await
            .map(|r| r.into_inner())
            .map_err(|status| server_error(&self.uri, &status))
    }

    /// The batches of every endpoint of `info`, in order.
    fn fetch(&self, info: FlightInfo) -> Result<BoxStream<'static, Result<RecordBatch>>> {
        let mut tickets = vec![];
        for endpoint in info.endpoint {
            let ticket = endpoint.ticket.ok_or_else(|| {
                DataFusionError::Execution("the server answered an endpoint without ticket".into())
            })?;
            tickets.push(ticket);
        }
        let (client, uri) = (self.client.clone(), self.uri.clone());
        Ok(futures::stream::iter(tickets)
            .then(move |ticket| {
                let (mut client, uri) = (client.clone(), uri.clone());
                async move {
                    let response = client
                        .do_get(ticket)
                        .await
                        .map_err(|status| server_error(&uri, &status))?;
                    let data = response.into_inner().map_err(FlightError::from);
                    let uri_of_stream = uri.clone();
                    Ok::<_, DataFusionError>(
                        FlightRecordBatchStream::new_from_flight_data(data)
                            .map_err(move |e| flight_error(&uri_of_stream, e)),
                    )
                }
            })
            .try_flatten()
            .boxed())
    }

    async fn action(&mut self, name: &str, body: &str) -> Result<Vec<u8>> {
        let action = Action {
            r#type: name.to_string(),
            body: body.as_bytes().to_vec().into(),
        };
        let results: Vec<arrow_flight::Result> = self
            .client
            .do_action(action)
            .await
            .map_err(|status| server_error(&self.uri, &status))?
            .into_inner()
            .try_collect()
            .await
            .map_err(|status| server_error(&self.uri, &status))?;
        Ok(results.into_iter().flat_map(|r| r.body).collect())
    }
}

/// A channel to `options.uri`: plain for `grpc://`, TLS for `grpc+tls://`.
async fn channel(options: &ConnectOptions) -> Result<Channel> {
    let uri = &options.uri;
    let (scheme, address) = uri.split_once("://").unwrap_or(("grpc", uri.as_str()));
    let endpoint = match scheme {
        "grpc" | "grpc+tcp" => Endpoint::from_shared(format!("http://{address}")),
        "grpc+tls" => Endpoint::from_shared(format!("https://{address}")),
        other => {
            return Err(DataFusionError::Plan(format!(
                "--connect takes grpc://HOST:PORT or grpc+tls://HOST:PORT, not {other}://"
            )));
        }
    }
    .map_err(|e| DataFusionError::Plan(format!("--connect {uri}: {e}")))?;
    let endpoint = if scheme == "grpc+tls" {
        let tls = match &options.tls_ca {
            Some(ca) => flumen::cluster::tls::WorkerTrust::from_file(ca)?.client_config(),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        endpoint
            .tls_config(tls)
            .map_err(|e| DataFusionError::Plan(format!("--connect {uri}: TLS: {e}")))?
    } else {
        endpoint
    };
    endpoint
        .connect_timeout(std::time::Duration::from_secs(10))
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| {
            DataFusionError::Execution(format!(
                "cannot connect to {uri}: {}",
                flumen::error_chain(&e)
            ))
        })
}

/// The password of `user`: from `file` (owner-only), else typed at a prompt without echo.
fn password(file: Option<&Path>, user: &str) -> Result<String> {
    match file {
        Some(path) => {
            let text = flumen::cluster::auth::read_owner_only(path, "password file")?;
            Ok(text.lines().next().unwrap_or("").to_string())
        }
        None => rpassword::prompt_password(format!("password for {user}: ")).map_err(|e| {
            DataFusionError::Execution(format!(
                "cannot read the password from the terminal ({e}); give --password-file FILE"
            ))
        }),
    }
}

/// Exchange `user`'s password for a session token (Flight's handshake with basic auth).
async fn handshake(channel: Channel, user: &str, password: &str) -> Result<Secret> {
    let mut client = FlightServiceClient::new(channel);
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let mut request = tonic::Request::new(futures::stream::iter([HandshakeRequest::default()]));
    let header = format!("Basic {basic}")
        .parse()
        .map_err(|_| DataFusionError::Plan("a user name or password that is not text".into()))?;
    request.metadata_mut().insert("authorization", header);
    let response = client.handshake(request).await.map_err(|status| {
        DataFusionError::Execution(format!("login as {user}: {}", status.message()))
    })?;
    let bearer = response
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| {
            DataFusionError::Execution("the server's handshake answered no session token".into())
        })?;
    Secret::from_hex(bearer)
}

/// A server's error as the user should read it: its message, not the gRPC envelope.
fn server_error(uri: &str, status: &tonic::Status) -> DataFusionError {
    let message = if status.message().is_empty() {
        format!("{:?}", status.code())
    } else {
        status.message().to_string()
    };
    match status.code() {
        tonic::Code::Unavailable => {
            DataFusionError::Execution(format!("{uri} is unavailable: {message}"))
        }
        tonic::Code::Unauthenticated => {
            DataFusionError::Execution(format!("{uri} refused the credentials: {message}"))
        }
        _ => DataFusionError::Execution(message),
    }
}

fn flight_error(uri: &str, error: FlightError) -> DataFusionError {
    match error {
        FlightError::Tonic(status) => server_error(uri, &status),
        FlightError::Arrow(e) => DataFusionError::ArrowError(Box::new(e), None),
        other => DataFusionError::Execution(format!("reading the result from {uri}: {other}")),
    }
}

fn bad_answer(action: &str, e: serde_json::Error) -> DataFusionError {
    DataFusionError::Execution(format!("the server's answer to {action} is not JSON: {e}"))
}

/// `\jobs`' text: each query with its operators, each dataset with its jobs per epoch.
fn jobs_text(queries: &[QueryProgress], datasets: &[DatasetReport]) -> String {
    let mut lines = vec![];
    if queries.is_empty() {
        lines.push("no running queries".to_string());
    }
    for q in queries {
        lines.push(format!(
            "query {} ({}): {:.1} s, {} rows ({:.1} MB) sent",
            q.id,
            q.user,
            q.seconds,
            q.rows_sent,
            q.bytes_sent as f64 / 1e6
        ));
        lines.push(format!(
            "  {}",
            q.sql.split_whitespace().collect::<Vec<_>>().join(" ")
        ));
        lines.extend(q.operators.iter().map(|op| format!("    {op}")));
    }
    if datasets.is_empty() {
        lines.push("no datasets".to_string());
    }
    for d in datasets {
        let runs: Vec<String> = d
            .runs_per_epoch
            .iter()
            .map(|(epoch, runs)| format!("epoch {epoch}: {runs}"))
            .collect();
        lines.push(format!(
            "dataset {} (pipeline runs: {})",
            d.name,
            runs.join(", ")
        ));
        for job in &d.jobs {
            lines.push(format!(
                "  job {} (last asked {:.0} s ago)",
                job.job, job.idle_seconds
            ));
            for (epoch, consumers) in &job.acknowledged {
                let per_consumer: Vec<String> = consumers
                    .iter()
                    .map(|(c, (blocks, rows))| {
                        format!("consumer {c}: {blocks} blocks, {rows} rows")
                    })
                    .collect();
                let requeued = job.requeued.get(epoch).copied().unwrap_or(0);
                lines.push(format!(
                    "    epoch {epoch}: {}; {requeued} requeued",
                    per_consumer.join("; ")
                ));
            }
        }
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use flumen::serve::datasets::JobReport;

    #[test]
    fn jobs_text_lists_queries_with_operators_and_datasets_per_epoch() {
        let queries = vec![QueryProgress {
            id: "q1".into(),
            user: "ana".into(),
            sql: "SELECT *\n  FROM docs".into(),
            seconds: 2.0,
            rows_sent: 1000,
            bytes_sent: 2_500_000,
            operators: vec!["scan: 10 blocks".into()],
        }];
        let datasets = vec![DatasetReport {
            name: "train".into(),
            runs_per_epoch: [(0, 1)].into(),
            jobs: vec![JobReport {
                job: "j1".into(),
                acknowledged: [(0, [(0, (3, 300)), (1, (2, 200))].into())].into(),
                requeued: [(0, 1)].into(),
                idle_seconds: 4.0,
            }],
        }];
        let text = jobs_text(&queries, &datasets);
        assert_eq!(
            text,
            "query q1 (ana): 2.0 s, 1000 rows (2.5 MB) sent\n  SELECT * FROM docs\n    \
             scan: 10 blocks\ndataset train (pipeline runs: epoch 0: 1)\n  job j1 (last asked 4 s ago)\n    epoch 0: \
             consumer 0: 3 blocks, 300 rows; consumer 1: 2 blocks, 200 rows; 1 requeued"
        );
        assert_eq!(jobs_text(&[], &[]), "no running queries\nno datasets");
    }

    #[test]
    fn a_connect_uri_of_another_scheme_is_refused() {
        let options = ConnectOptions {
            uri: "http://127.0.0.1:1".into(),
            token_file: None,
            user: None,
            password_file: None,
            tls_ca: None,
        };
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let error = runtime.block_on(channel(&options)).unwrap_err().to_string();
        assert!(error.contains("grpc://HOST:PORT"), "{error}");
    }
}
