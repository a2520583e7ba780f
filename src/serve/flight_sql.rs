//! The Arrow Flight SQL service of `flumen serve`: statements, prepared statements with
//! parameters, updates (`COPY`, `INSERT`, DDL, `SET`), catalog metadata, `SqlInfo`,
//! cancellation, and flumen's own actions (`flumen.queries`, `flumen.cancel`).
//!
//! A query is planned by `GetFlightInfo` (DDL and `SET` take effect there, as in
//! DataFusion's `SessionContext::sql`) and runs when its ticket is redeemed by `DoGet`. Its
//! result streams block by block as flumen's scheduler produces it: gRPC's flow control
//! stops pulling batches from the query while the client does not read, so a slow reader
//! holds the query back instead of the server buffering its result.

use std::pin::Pin;
use std::sync::Arc;

use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::sql::metadata::{SqlInfoData, SqlInfoDataBuilder};
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionCancelQueryRequest, ActionCancelQueryResult, ActionClosePreparedStatementRequest,
    ActionCreatePreparedStatementRequest, ActionCreatePreparedStatementResult, Any,
    CommandGetCatalogs, CommandGetDbSchemas, CommandGetSqlInfo, CommandGetTableTypes,
    CommandGetTables, CommandPreparedStatementQuery, CommandPreparedStatementUpdate,
    CommandStatementQuery, CommandStatementUpdate, DoPutPreparedStatementResult, ProstMessageExt,
    SqlInfo, TicketStatementQuery,
};
use arrow_flight::{
    Action, ActionType, CancelFlightInfoRequest, CancelFlightInfoResult, CancelStatus,
    FlightDescriptor, FlightEndpoint, FlightInfo, HandshakeRequest, HandshakeResponse, IpcMessage,
    SchemaAsIpc, Ticket,
};
use datafusion::arrow::array::{AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::ipc::writer::IpcWriteOptions;
use datafusion::common::ParamValues;
use datafusion::error::DataFusionError;
use datafusion::execution::SendableRecordBatchStream;
use datafusion::logical_expr::{DdlStatement, LogicalPlan, Statement};
use datafusion::physical_plan::execute_stream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::prelude::{DataFrame, SessionContext};
use datafusion::scalar::ScalarValue;
use futures::{Stream, StreamExt, TryStreamExt};
use prost::Message;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status, Streaming};

use super::catalog_file::CatalogFile;
use super::credentials::{Authenticator, Caller, Credential};
use super::datasets::{DatasetRequest, DatasetTicket, Datasets};
use super::grants::Grants;
use super::handshake_limits::{HandshakeLimits, Refusal, TARPIT};
use super::policy::Refused;
use super::running::RunningQueries;
use super::sessions::Sessions;
use super::statements::{PlannedQuery, Prepared, Statements, TicketResult};
use crate::io::flight_data::{Dictionaries, flight_data, sent_schema};

/// The custom action that lists the running queries (JSON, one object per query).
pub const LIST_QUERIES_ACTION: &str = "flumen.queries";
/// The custom action that cancels a running query by id (the body: the id).
pub const CANCEL_ACTION: &str = "flumen.cancel";
/// The custom action that creates a dataset job (JSON body, see [`super::datasets`]).
pub const CREATE_DATASET_ACTION: &str = "flumen.create_dataset";
/// The custom action that reports the datasets: runs per epoch, blocks per consumer (JSON).
pub const DATASETS_ACTION: &str = "flumen.datasets";
/// The custom action that renews the lease of the block a consumer holds (body: the ticket's
/// hex, as `flumen.create_dataset` answered it).
pub const RENEW_LEASE_ACTION: &str = "flumen.renew_dataset_lease";

type FlightDataStream =
    Pin<Box<dyn Stream<Item = Result<arrow_flight::FlightData, Status>> + Send>>;

/// flumen's Flight SQL service.
pub struct FlumenFlightSql {
    queries: tokio::runtime::Handle,
    datasets: Datasets,
    sessions: Sessions,
    statements: Statements,
    running: Arc<RunningQueries>,
    catalog: Option<Arc<CatalogFile>>,
    auth: Authenticator,
    sql_info: SqlInfoData,
    /// How many password checks run at once, and who backs off after failures.
    handshakes: HandshakeLimits,
}

impl FlumenFlightSql {
    /// Serve `base`'s tables, running queries on the runtime of `queries`; clients'
    /// sessions copy its settings. Tables created by clients are kept in `catalog` when
    /// given.
    pub fn new(
        queries: tokio::runtime::Handle,
        base: SessionContext,
        auth: Authenticator,
        catalog: Option<Arc<CatalogFile>>,
    ) -> datafusion::error::Result<Self> {
        Ok(Self {
            queries,
            datasets: Datasets::default(),
            sessions: Sessions::new(base),
            statements: Statements::default(),
            running: Arc::default(),
            catalog,
            auth,
            sql_info: server_info()?,
            handshakes: HandshakeLimits::default(),
        })
    }

    /// Let each user touch and run what `grants` allow it (by default: no path, no URL,
    /// [`super::MAX_QUERIES_PER_USER`] queries at once).
    pub fn with_grants(mut self, grants: Grants) -> Self {
        self.sessions.set_grants(grants);
        self
    }

    /// Plan a client's `sql` on `ctx`, refused unless the policy allows every location it
    /// names and every setting it changes: every statement a client runs (ad hoc, prepared,
    /// a dataset job's) is planned here. A path table is checked before planning, which
    /// reads its file; the object stores of allowed URLs are registered before planning.
    async fn plan_sql(
        &self,
        caller: &Caller,
        ctx: &SessionContext,
        sql: &str,
    ) -> Result<LogicalPlan, Status> {
        let policy = self.sessions.access(&caller.user).policy;
        policy
            .check_before_planning(ctx, sql)
            .map_err(planning_error)?;
        crate::io::register_for_statement(ctx, sql).map_err(planning_error)?;
        let plan = match crate::session::logical_plan(&ctx.state(), sql).await {
            Ok(plan) => plan,
            // A path it may read that could not be read as a table says why (through this
            // session's stores, which the policy bounds).
            Err(e) => {
                let e = crate::io::url_tables::explain_table_error(ctx, sql, e).await;
                return Err(planning_error(e));
            }
        };
        policy.check_plan(&plan).map_err(planning_error)?;
        // `RESET flumen.<name>`, once the policy let it through (an operator setting it
        // refuses), is done here: DataFusion 55 would refuse to run it.
        if let LogicalPlan::Statement(Statement::ResetVariable(reset)) = &plan
            && reset.variable.starts_with("flumen.")
        {
            let done = crate::reset_flumen_variable(ctx, &reset.variable);
            return Ok(done.map_err(planning_error)?.logical_plan().clone());
        }
        Ok(plan)
    }

    /// Drop dataset jobs none of whose consumers asked for a block for `limit`.
    pub fn with_dataset_job_idle(mut self, limit: std::time::Duration) -> Self {
        self.datasets = Datasets::new(limit);
        self
    }

    /// The queries running now.
    pub fn running(&self) -> &Arc<RunningQueries> {
        &self.running
    }

    /// Plan `sql` on `ctx` (DDL and `SET` take effect now).
    async fn plan_statement(
        &self,
        caller: &Caller,
        ctx: &SessionContext,
        sql: &str,
    ) -> Result<DataFrame, Status> {
        let plan = self.plan_sql(caller, ctx, sql).await?;
        self.run_ddl(ctx, sql, plan).await
    }

    /// Start `plan` for `caller` and hold it for a ticket, which the returned `FlightInfo`
    /// carries. A query runs when the ticket is redeemed; anything else (DDL, `SET`, `COPY`,
    /// `INSERT`) runs to its end now, as a client that never reads its (empty or one-row)
    /// result still expects it done.
    async fn ticket_for(
        &self,
        caller: &Caller,
        ctx: &SessionContext,
        sql: String,
        plan: LogicalPlan,
        descriptor: FlightDescriptor,
    ) -> Result<FlightInfo, Status> {
        let is_query = !matches!(
            plan,
            LogicalPlan::Ddl(_)
                | LogicalPlan::Statement(_)
                | LogicalPlan::Dml(_)
                | LogicalPlan::Copy(_)
        );
        let frame = self.run_ddl(ctx, &sql, plan).await?;
        let schema: SchemaRef = Arc::new(frame.schema().as_arrow().clone());
        let result = if is_query {
            TicketResult::Plan(frame)
        } else {
            let id = uuid::Uuid::new_v4().simple().to_string();
            let batches: Vec<RecordBatch> = self
                .run(caller, id, &sql, frame)
                .await?
                .try_collect()
                .await
                .map_err(execution_error)?;
            TicketResult::Done(Arc::clone(&schema), batches)
        };
        let handle = self
            .statements
            .add_ticket(caller, PlannedQuery { sql, result })?;
        let ticket = TicketStatementQuery {
            statement_handle: handle.into(),
        };
        // The schema the stream will have (`flight_stream`), not the plan's own.
        Ok(FlightInfo::new()
            .try_with_schema(&sent_schema(&schema, RESULT_DICTIONARIES))
            .map_err(arrow_status)?
            .with_endpoint(
                FlightEndpoint::new().with_ticket(Ticket::new(ticket.as_any().encode_to_vec())),
            )
            .with_descriptor(descriptor))
    }

    /// A prepared statement and its plan with the parameters bound.
    fn bound_plan(
        &self,
        caller: &Caller,
        handle: &[u8],
    ) -> Result<(Prepared, LogicalPlan), Status> {
        let prepared = self.statements.prepared(caller, handle)?;
        let mut plan = prepared.plan.clone();
        if let Some(params) = &prepared.params {
            plan = plan
                .with_param_values(params.clone())
                .map_err(planning_error)?;
        }
        Ok((prepared, plan))
    }

    /// `ctx.execute_logical_plan(plan)`, recording a created or dropped table.
    async fn run_ddl(
        &self,
        ctx: &SessionContext,
        sql: &str,
        plan: LogicalPlan,
    ) -> Result<DataFrame, Status> {
        // `plan` came through `plan_sql`, which checked it against the policy (a prepared
        // statement's when it was prepared: its parameters bind values, not locations).
        let change = catalog_change(&plan);
        let frame = ctx
            .execute_logical_plan(plan)
            .await
            .map_err(planning_error)?;
        if let (Some(catalog), Some(change)) = (&self.catalog, change) {
            let recorded = match change {
                CatalogChange::Created(name) => catalog.record_create(&name, sql),
                CatalogChange::Dropped(name) => catalog.record_drop(&name),
            };
            recorded.map_err(|e| Status::internal(format!("the table changed but {e}")))?;
        }
        Ok(frame)
    }

    /// Run `frame` for `caller`, listed as query `id` while it streams. The query runs on
    /// the server's query runtime, not on the one that serves calls (a CPU-bound query
    /// would otherwise keep new connections and cancellations waiting); one batch at a time
    /// crosses over, so a client that stops reading stops the query.
    async fn run(
        &self,
        caller: &Caller,
        id: String,
        sql: &str,
        frame: DataFrame,
    ) -> Result<SendableRecordBatchStream, Status> {
        // Each query holds up to the memory budget: the user's memory is bounded by this
        // times the budget.
        let running = self.running.running_for(&caller.user);
        if running >= self.sessions.access(&caller.user).max_queries {
            return Err(Status::resource_exhausted(format!(
                "{} runs {running} queries already, the most this user may run at once \
                 (flumen serve --max-queries-per-user, or max-queries in the users file): \
                 wait for one to end",
                caller.user
            )));
        }
        let started = self.queries.spawn(async move {
            let task_ctx = Arc::new(frame.task_ctx());
            let plan = frame.create_physical_plan().await.map_err(planning_error)?;
            let stream = execute_stream(Arc::clone(&plan), task_ctx).map_err(execution_error)?;
            Ok::<_, Status>((plan, stream))
        });
        let (plan, mut stream) = started
            .await
            .map_err(|e| Status::internal(format!("the query's planning failed: {e}")))??;
        let schema = stream.schema();
        let (sender, receiver) = tokio::sync::mpsc::channel(1);
        self.queries.spawn(async move {
            while let Some(batch) = stream.next().await {
                if sender.send(batch).await.is_err() {
                    // The client went away: dropping the stream cancels the query.
                    return;
                }
            }
        });
        let received = RecordBatchStreamAdapter::new(
            schema,
            tokio_stream::wrappers::ReceiverStream::new(receiver),
        );
        Ok(self
            .running
            .start(caller, id, sql, plan, Box::pin(received)))
    }

    /// Run an update to its end: the rows it reports (`count` of `COPY`/`INSERT`), else
    /// the rows it returned, counted as they stream by (a `SELECT` sent as an update is
    /// not held in memory).
    async fn run_update(
        &self,
        caller: &Caller,
        sql: &str,
        frame: DataFrame,
    ) -> Result<i64, Status> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let mut stream = self.run(caller, id, sql, frame).await?;
        let (mut rows, mut kept) = (0usize, vec![]);
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(execution_error)?;
            rows += batch.num_rows();
            // Only a one-row answer can be a `count`.
            if rows <= 1 {
                kept.push(batch);
            }
        }
        Ok(match rows {
            0 | 1 => affected_rows(&kept),
            _ => rows as i64,
        })
    }

    fn metadata_info(
        &self,
        command: impl ProstMessageExt,
        schema: &Schema,
        descriptor: FlightDescriptor,
    ) -> Result<Response<FlightInfo>, Status> {
        let ticket = Ticket::new(command.as_any().encode_to_vec());
        let info = FlightInfo::new()
            .try_with_schema(schema)
            .map_err(|e| Status::internal(e.to_string()))?
            .with_endpoint(FlightEndpoint::new().with_ticket(ticket))
            .with_descriptor(descriptor);
        Ok(Response::new(info))
    }

    fn cancel_by_ticket(&self, caller: &Caller, info: &FlightInfo) -> bool {
        let mut found = false;
        for endpoint in &info.endpoint {
            let Some(ticket) = &endpoint.ticket else {
                continue;
            };
            let Ok(any) = Any::decode(&*ticket.ticket) else {
                continue;
            };
            if let Ok(Some(t)) = any.unpack::<TicketStatementQuery>() {
                found |= self
                    .running
                    .cancel(caller, &hex::encode(&t.statement_handle));
            }
        }
        found
    }
}

/// The dataset ticket whose Flight ticket bytes `hex_body` holds in hex.
fn dataset_ticket_of_hex(hex_body: &[u8]) -> Result<DatasetTicket, Status> {
    let bytes = hex::decode(String::from_utf8_lossy(hex_body).trim())
        .map_err(|e| Status::invalid_argument(format!("not a ticket's hex: {e}")))?;
    let any =
        Any::decode(&*bytes).map_err(|e| Status::invalid_argument(format!("not a ticket: {e}")))?;
    super::datasets::decode_ticket(&any)
        .unwrap_or_else(|| Err(Status::invalid_argument("not a dataset ticket")))
}

/// A table created or dropped by a statement.
enum CatalogChange {
    Created(String),
    Dropped(String),
}

fn catalog_change(plan: &LogicalPlan) -> Option<CatalogChange> {
    match plan {
        LogicalPlan::Ddl(DdlStatement::CreateExternalTable(create)) => {
            Some(CatalogChange::Created(create.name.to_string()))
        }
        LogicalPlan::Ddl(DdlStatement::DropTable(drop)) => {
            Some(CatalogChange::Dropped(drop.name.to_string()))
        }
        _ => None,
    }
}

/// What the server tells `GetSqlInfo`.
fn server_info() -> datafusion::error::Result<SqlInfoData> {
    let mut info = SqlInfoDataBuilder::new();
    info.append(SqlInfo::FlightSqlServerName, "flumen");
    info.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
    info.append(SqlInfo::FlightSqlServerArrowVersion, "1.3");
    info.append(SqlInfo::FlightSqlServerReadOnly, false);
    info.append(SqlInfo::FlightSqlServerSql, true);
    info.append(SqlInfo::FlightSqlServerSubstrait, false);
    info.append(SqlInfo::FlightSqlServerTransaction, 0i32);
    info.append(SqlInfo::FlightSqlServerCancel, true);
    info.append(SqlInfo::SqlDdlCatalog, false);
    info.append(SqlInfo::SqlDdlSchema, true);
    info.append(SqlInfo::SqlDdlTable, true);
    info.append(SqlInfo::SqlIdentifierQuoteChar, "\"");
    info.build()
        .map_err(|e| DataFusionError::Internal(format!("server info: {e}")))
}

fn planning_error(e: DataFusionError) -> Status {
    let message = crate::error_chain(&e);
    match e.find_root() {
        DataFusionError::External(inner) if inner.is::<Refused>() => {
            Status::permission_denied(message)
        }
        DataFusionError::ResourcesExhausted(_) => Status::resource_exhausted(message),
        DataFusionError::NotImplemented(_) => Status::unimplemented(message),
        _ => Status::invalid_argument(message),
    }
}

fn execution_error(e: DataFusionError) -> Status {
    let message = crate::error_chain(&e);
    match e.find_root() {
        DataFusionError::ResourcesExhausted(_) => Status::resource_exhausted(message),
        _ => Status::internal(message),
    }
}

fn caller_of<T>(request: &Request<T>) -> Result<Caller, Status> {
    request
        .extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("flumen serve: the call carried no session"))
}

/// A result's dictionary columns reach clients as their values (not every client reads
/// dictionaries); the schemas announced for it say so too.
const RESULT_DICTIONARIES: Dictionaries = Dictionaries::Hydrate;

/// Most bytes of one Flight message's body a result is cut to (arrow-flight's own default:
/// gRPC's 4 MiB limit with room for the message's header).
const MAX_MESSAGE_BYTES: usize = 2 << 20;

/// `stream` as Flight data (its schema first, then one message per batch, large batches
/// split to fit gRPC's message size).
fn flight_stream(stream: SendableRecordBatchStream) -> FlightDataStream {
    let schema = stream.schema();
    let batches = stream.map_err(|e| FlightError::ExternalError(Box::new(e)));
    let encoded = flight_data(
        schema,
        batches,
        RESULT_DICTIONARIES,
        MAX_MESSAGE_BYTES,
        None,
    )
    .map_err(Status::from);
    Box::pin(encoded)
}

/// Batches already in memory as Flight data (the schema first, also when there are none).
fn batches_stream(schema: SchemaRef, batches: Vec<RecordBatch>) -> FlightDataStream {
    let stream = futures::stream::iter(batches.into_iter().map(Ok));
    let encoded = flight_data(schema, stream, RESULT_DICTIONARIES, MAX_MESSAGE_BYTES, None)
        .map_err(Status::from);
    Box::pin(encoded)
}

/// One metadata batch as Flight data.
fn batch_stream(batch: RecordBatch) -> FlightDataStream {
    batches_stream(batch.schema(), vec![batch])
}

/// Every (catalog, schema name, schema) of `ctx`, of catalog `wanted` only when given.
fn schemas_of(
    ctx: &SessionContext,
    wanted: Option<&String>,
) -> Vec<(String, String, Arc<dyn datafusion::catalog::SchemaProvider>)> {
    let mut found = vec![];
    for catalog_name in ctx.catalog_names() {
        if wanted.is_some_and(|c| *c != catalog_name) {
            continue;
        }
        let Some(catalog) = ctx.catalog(&catalog_name) else {
            continue;
        };
        for schema_name in catalog.schema_names() {
            if let Some(schema) = catalog.schema(&schema_name) {
                found.push((catalog_name.clone(), schema_name, schema));
            }
        }
    }
    found
}

fn arrow_status(e: datafusion::arrow::error::ArrowError) -> Status {
    Status::internal(e.to_string())
}

fn schema_bytes(schema: &Schema) -> Result<bytes::Bytes, Status> {
    let options = IpcWriteOptions::default();
    let IpcMessage(bytes) = SchemaAsIpc::new(schema, &options)
        .try_into()
        .map_err(arrow_status)?;
    Ok(bytes)
}

/// The rows an update changed: the `count` column of `COPY`/`INSERT`'s one-row answer,
/// else the rows returned.
fn affected_rows(batches: &[RecordBatch]) -> i64 {
    let single_count = batches.iter().map(|b| b.num_rows()).sum::<usize>() == 1
        && batches
            .iter()
            .find(|b| b.num_rows() == 1)
            .is_some_and(|b| b.num_columns() == 1 && b.schema().field(0).name() == "count");
    if single_count {
        let batch = batches.iter().find(|b| b.num_rows() == 1).expect("one row");
        if let Some(counts) = batch
            .column(0)
            .as_primitive_opt::<datafusion::arrow::datatypes::UInt64Type>()
        {
            return counts.value(0) as i64;
        }
    }
    batches.iter().map(|b| b.num_rows() as i64).sum()
}

/// `sql` with each `?` placeholder (ADBC's and JDBC's) numbered `$1`, `$2`, ... as
/// DataFusion wants them; `?` inside strings and comments is left alone.
pub fn number_placeholders(sql: &str) -> Result<String, Status> {
    use datafusion::sql::sqlparser::dialect::GenericDialect;
    use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};
    let tokens = Tokenizer::new(&GenericDialect {}, sql)
        .tokenize()
        .map_err(|e| Status::invalid_argument(format!("cannot read the statement: {e}")))?;
    let mut next = 0;
    let mut out = String::with_capacity(sql.len());
    for token in tokens {
        match token {
            Token::Placeholder(p) if p == "?" => {
                next += 1;
                out.push_str(&format!("${next}"));
            }
            other => out.push_str(&other.to_string()),
        }
    }
    Ok(out)
}

/// The parameters of `plan`, `$1`, `$2`, ... in order, typed where DataFusion could tell.
fn parameter_schema(plan: &LogicalPlan) -> Result<Schema, Status> {
    let types = plan.get_parameter_types().map_err(planning_error)?;
    let mut named: Vec<(usize, String, DataType)> = types
        .into_iter()
        .map(|(name, data_type)| {
            let position = name
                .trim_start_matches('$')
                .parse::<usize>()
                .unwrap_or(usize::MAX);
            (position, name, data_type.unwrap_or(DataType::Null))
        })
        .collect();
    named.sort();
    Ok(Schema::new(
        named
            .into_iter()
            .map(|(_, name, t)| Field::new(name, t, true))
            .collect::<Vec<_>>(),
    ))
}

/// The first row of the parameter batches a client bound, as positional values.
async fn read_parameters(stream: PeekableFlightDataStream) -> Result<ParamValues, Status> {
    let batches: Vec<RecordBatch> =
        FlightRecordBatchStream::new_from_flight_data(stream.map_err(FlightError::from))
            .try_collect()
            .await
            .map_err(Status::from)?;
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let Some(batch) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Ok(ParamValues::List(vec![]));
    };
    if rows > 1 {
        return Err(Status::invalid_argument(format!(
            "bind one row of parameters to a query (got {rows}): run it once per row"
        )));
    }
    let values = batch
        .columns()
        .iter()
        .map(|column| ScalarValue::try_from_array(column.as_ref(), 0))
        .collect::<datafusion::error::Result<Vec<_>>>()
        .map_err(planning_error)?;
    Ok(values.into())
}

#[tonic::async_trait]
impl FlightSqlService for FlumenFlightSql {
    type FlightService = FlumenFlightSql;

    async fn do_handshake(
        &self,
        request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<
        Response<Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>>,
        Status,
    > {
        let peer = request
            .remote_addr()
            .map_or_else(|| "an unknown peer".to_string(), |a| a.to_string());
        let credential = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(Credential::parse);
        let Some(credential) = credential else {
            log::warn!("flumen serve: a handshake from {peer} carried no credentials");
            return Err(Status::unauthenticated(
                "flumen serve: the handshake needs 'authorization: Basic ...' (user and \
                 password) or the server's token as 'Bearer ...'",
            ));
        };
        // A password check is rationed: at most so many at once, and none for an address or
        // user backing off after failures.
        let address = request.remote_addr().map(|a| a.ip());
        let user = match &credential {
            Credential::Basic { user, .. } => Some(user.clone()),
            Credential::Bearer(_) => None,
        };
        let permit = match self.handshakes.admit(address, user.as_deref()).await {
            Ok(permit) => permit,
            Err(refusal) => {
                log::debug!("flumen serve: a handshake from {peer} refused: {refusal}");
                // A caller backing off waits for its refusal (a timer, no thread): a client
                // retrying in a loop then costs a few calls a second, not as many as the
                // server can answer.
                if let Refusal::BackingOff(left) = refusal {
                    tokio::time::sleep(left.min(TARPIT)).await;
                }
                return Err(Status::resource_exhausted(refusal.to_string()));
            }
        };
        let auth = self.auth.clone();
        let checked = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            auth.handshake(&credential)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        let Some((token, caller, expired)) = checked else {
            self.handshakes.failed(address, user.as_deref());
            log::warn!("flumen serve: a handshake from {peer} failed: wrong credentials");
            return Err(Status::unauthenticated(
                "flumen serve: wrong user name, password or token",
            ));
        };
        self.handshakes.succeeded(address, user.as_deref());
        self.sessions.forget(&expired);
        log::info!("flumen serve: {} connected from {peer}", caller.user);
        let bearer = format!("Bearer {}", token.to_hex());
        let answer = HandshakeResponse {
            protocol_version: 0,
            payload: token.to_hex().into_bytes().into(),
        };
        let mut response: Response<
            Pin<Box<dyn Stream<Item = Result<HandshakeResponse, Status>> + Send>>,
        > = Response::new(Box::pin(futures::stream::iter([Ok(answer)])));
        let value: MetadataValue<_> = bearer
            .parse()
            .map_err(|_| Status::internal("token header"))?;
        response.metadata_mut().insert("authorization", value);
        Ok(response)
    }

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let caller = caller_of(&request)?;
        let ctx = self.sessions.context(&caller);
        let plan = self.plan_sql(&caller, &ctx, &query.query).await?;
        let info = self
            .ticket_for(&caller, &ctx, query.query, plan, request.into_inner())
            .await?;
        Ok(Response::new(info))
    }

    async fn get_flight_info_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let caller = caller_of(&request)?;
        let (prepared, plan) = self.bound_plan(&caller, &query.prepared_statement_handle)?;
        let ctx = self.sessions.context(&caller);
        let info = self
            .ticket_for(&caller, &ctx, prepared.sql, plan, request.into_inner())
            .await?;
        Ok(Response::new(info))
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder().schema();
        self.metadata_info(query, &schema, request.into_inner())
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        self.metadata_info(query, &schema, request.into_inner())
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        self.metadata_info(query, &schema, request.into_inner())
    }

    async fn get_flight_info_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder().schema();
        self.metadata_info(query, &schema, request.into_inner())
    }

    async fn get_flight_info_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let schema = self.sql_info.schema();
        self.metadata_info(query, &schema, request.into_inner())
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let caller = caller_of(&request)?;
        let planned = self
            .statements
            .take_ticket(&caller, &ticket.statement_handle)?;
        match planned.result {
            TicketResult::Plan(frame) => {
                let id = hex::encode(&ticket.statement_handle);
                let stream = self.run(&caller, id, &planned.sql, frame).await?;
                Ok(Response::new(flight_stream(stream)))
            }
            TicketResult::Done(schema, batches) => {
                Ok(Response::new(batches_stream(schema, batches)))
            }
        }
    }

    async fn do_get_prepared_statement(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let caller = caller_of(&request)?;
        let (prepared, plan) = self.bound_plan(&caller, &query.prepared_statement_handle)?;
        let ctx = self.sessions.context(&caller);
        let frame = self.run_ddl(&ctx, &prepared.sql, plan).await?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let stream = self.run(&caller, id, &prepared.sql, frame).await?;
        Ok(Response::new(flight_stream(stream)))
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let caller = caller_of(&request)?;
        let ctx = self.sessions.context(&caller);
        let mut builder = query.into_builder();
        let mut names = ctx.catalog_names();
        names.sort();
        for name in names {
            builder.append(name);
        }
        Ok(Response::new(batch_stream(
            builder.build().map_err(Status::from)?,
        )))
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let caller = caller_of(&request)?;
        let ctx = self.sessions.context(&caller);
        let schemas = schemas_of(&ctx, query.catalog.as_ref());
        let mut builder = query.into_builder();
        for (catalog_name, schema_name, _) in schemas {
            builder.append(catalog_name, schema_name);
        }
        Ok(Response::new(batch_stream(
            builder.build().map_err(Status::from)?,
        )))
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let caller = caller_of(&request)?;
        let ctx = self.sessions.context(&caller);
        let schemas = schemas_of(&ctx, query.catalog.as_ref());
        let mut builder = query.into_builder();
        for (catalog_name, schema_name, schema) in schemas {
            let mut tables = schema.table_names();
            tables.sort();
            for table_name in tables {
                let Ok(Some(table)) = schema.table(&table_name).await else {
                    continue;
                };
                let table_type = match table.table_type() {
                    datafusion::datasource::TableType::View => "VIEW",
                    datafusion::datasource::TableType::Temporary => "TEMPORARY",
                    datafusion::datasource::TableType::Base => "TABLE",
                };
                builder
                    .append(
                        &catalog_name,
                        &schema_name,
                        &table_name,
                        table_type,
                        table.schema().as_ref(),
                    )
                    .map_err(Status::from)?;
            }
        }
        Ok(Response::new(batch_stream(
            builder.build().map_err(Status::from)?,
        )))
    }

    async fn do_get_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        caller_of(&request)?;
        let mut builder = query.into_builder();
        for table_type in ["TABLE", "VIEW", "TEMPORARY"] {
            builder.append(table_type);
        }
        Ok(Response::new(batch_stream(
            builder.build().map_err(Status::from)?,
        )))
    }

    async fn do_get_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<Ticket>,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        caller_of(&request)?;
        let batch = query
            .into_builder(&self.sql_info)
            .build()
            .map_err(Status::from)?;
        Ok(Response::new(batch_stream(batch)))
    }

    async fn do_put_statement_update(
        &self,
        ticket: CommandStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let caller = caller_of(&request)?;
        let ctx = self.sessions.context(&caller);
        let frame = self.plan_statement(&caller, &ctx, &ticket.query).await?;
        self.run_update(&caller, &ticket.query, frame).await
    }

    async fn do_put_prepared_statement_query(
        &self,
        query: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<DoPutPreparedStatementResult, Status> {
        let caller = caller_of(&request)?;
        let params = read_parameters(request.into_inner()).await?;
        self.statements
            .bind(&caller, &query.prepared_statement_handle, params)?;
        Ok(DoPutPreparedStatementResult {
            prepared_statement_handle: Some(query.prepared_statement_handle),
        })
    }

    async fn do_put_prepared_statement_update(
        &self,
        query: CommandPreparedStatementUpdate,
        request: Request<PeekableFlightDataStream>,
    ) -> Result<i64, Status> {
        let caller = caller_of(&request)?;
        let params = read_parameters(request.into_inner()).await?;
        if !matches!(&params, ParamValues::List(values) if values.is_empty()) {
            self.statements
                .bind(&caller, &query.prepared_statement_handle, params)?;
        }
        let (prepared, plan) = self.bound_plan(&caller, &query.prepared_statement_handle)?;
        let ctx = self.sessions.context(&caller);
        let frame = self.run_ddl(&ctx, &prepared.sql, plan).await?;
        self.run_update(&caller, &prepared.sql, frame).await
    }

    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        request: Request<Action>,
    ) -> Result<ActionCreatePreparedStatementResult, Status> {
        let caller = caller_of(&request)?;
        let ctx = self.sessions.context(&caller);
        let numbered = number_placeholders(&query.query)?;
        let plan = self.plan_sql(&caller, &ctx, &numbered).await?;
        let dataset_schema =
            schema_bytes(&sent_schema(plan.schema().as_arrow(), RESULT_DICTIONARIES))?;
        let parameter_schema = schema_bytes(&parameter_schema(&plan)?)?;
        let handle = self.statements.add_prepared(
            &caller,
            Prepared {
                sql: query.query,
                plan,
                params: None,
            },
        )?;
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: handle.into(),
            dataset_schema,
            parameter_schema,
        })
    }

    async fn do_action_close_prepared_statement(
        &self,
        query: ActionClosePreparedStatementRequest,
        request: Request<Action>,
    ) -> Result<(), Status> {
        let caller = caller_of(&request)?;
        self.statements
            .close(&caller, &query.prepared_statement_handle)
    }

    async fn do_action_cancel_query(
        &self,
        query: ActionCancelQueryRequest,
        request: Request<Action>,
    ) -> Result<ActionCancelQueryResult, Status> {
        // `ActionCancelQueryResult.CancelResult.CANCEL_RESULT_CANCELLED` (arrow-flight does
        // not export the enum).
        const CANCELLED: i32 = 1;
        let caller = caller_of(&request)?;
        let info = FlightInfo::decode(&*query.info)
            .map_err(|e| Status::invalid_argument(format!("not a FlightInfo: {e}")))?;
        if !self.cancel_by_ticket(&caller, &info) {
            return Err(Status::not_found(
                "no running query of yours has that ticket",
            ));
        }
        Ok(ActionCancelQueryResult { result: CANCELLED })
    }

    async fn list_custom_actions(&self) -> Option<Vec<Result<ActionType, Status>>> {
        Some(vec![
            Ok(ActionType {
                r#type: LIST_QUERIES_ACTION.into(),
                description: "The running queries with their operators' progress (JSON)".into(),
            }),
            Ok(ActionType {
                r#type: CANCEL_ACTION.into(),
                description: "Cancel one of your running queries by id (the body)".into(),
            }),
            Ok(ActionType {
                r#type: CREATE_DATASET_ACTION.into(),
                description: "Create a dataset job over a query for trainers to read (JSON: \
                              name, sql, epochs, consumers, batch_rows, shuffle_seed, \
                              shuffle_buffer); answers its tickets"
                    .into(),
            }),
            Ok(ActionType {
                r#type: DATASETS_ACTION.into(),
                description: "Your datasets: pipeline runs per epoch, blocks per consumer (JSON)"
                    .into(),
            }),
            Ok(ActionType {
                r#type: RENEW_LEASE_ACTION.into(),
                description: "Keep the block a consumer holds for another lease while it works \
                              on it (body: the consumer's ticket, hex)"
                    .into(),
            }),
            Ok(ActionType {
                r#type: "CancelFlightInfo".into(),
                description: "Cancel the query of a FlightInfo".into(),
            }),
        ])
    }

    async fn do_action_fallback(
        &self,
        request: Request<Action>,
    ) -> Result<Response<<Self as FlightService>::DoActionStream>, Status> {
        let caller = caller_of(&request)?;
        let action = request.into_inner();
        let body: bytes::Bytes = match action.r#type.as_str() {
            LIST_QUERIES_ACTION => serde_json::to_vec(&self.running.progress(&caller.user))
                .map_err(|e| Status::internal(e.to_string()))?
                .into(),
            CANCEL_ACTION => {
                let id = String::from_utf8_lossy(&action.body).trim().to_string();
                if !self.running.cancel(&caller, &id) {
                    return Err(Status::not_found(format!(
                        "no running query of yours has id {id}"
                    )));
                }
                bytes::Bytes::from_static(b"cancelled")
            }
            CREATE_DATASET_ACTION => {
                let request: DatasetRequest = serde_json::from_slice(&action.body)
                    .map_err(|e| Status::invalid_argument(format!("not a dataset request: {e}")))?;
                let ctx = self.sessions.context(&caller);
                // Checked as any statement; a job runs a query, nothing else.
                let plan = self.plan_sql(&caller, &ctx, &request.sql).await?;
                if matches!(
                    plan,
                    LogicalPlan::Ddl(_)
                        | LogicalPlan::Statement(_)
                        | LogicalPlan::Dml(_)
                        | LogicalPlan::Copy(_)
                ) {
                    return Err(Status::invalid_argument(
                        "a dataset job's SQL must be a query (no DDL, SET, INSERT or COPY)",
                    ));
                }
                let created = self.datasets.create_job(&caller.user, &ctx, request)?;
                log::info!(
                    "dataset job {} created by {} (shared: {})",
                    created.job,
                    caller.user,
                    created.shared
                );
                serde_json::to_vec(&created)
                    .map_err(|e| Status::internal(e.to_string()))?
                    .into()
            }
            RENEW_LEASE_ACTION => {
                let ticket = dataset_ticket_of_hex(&action.body)?;
                match self.datasets.renew(&caller.user, &ticket)? {
                    true => bytes::Bytes::from_static(b"renewed"),
                    false => bytes::Bytes::from_static(b"not held"),
                }
            }
            DATASETS_ACTION => serde_json::to_vec(&self.datasets.report(&caller.user))
                .map_err(|e| Status::internal(e.to_string()))?
                .into(),
            "CancelFlightInfo" => {
                let request = CancelFlightInfoRequest::decode(&*action.body).map_err(|e| {
                    Status::invalid_argument(format!("not a CancelFlightInfoRequest: {e}"))
                })?;
                let info = request.info.unwrap_or_default();
                let status = if self.cancel_by_ticket(&caller, &info) {
                    CancelStatus::Cancelled
                } else {
                    CancelStatus::NotCancellable
                };
                CancelFlightInfoResult {
                    status: status as i32,
                }
                .encode_to_vec()
                .into()
            }
            other => {
                return Err(Status::unimplemented(format!(
                    "flumen serve has no action '{other}'; ListActions names them"
                )));
            }
        };
        let result = arrow_flight::Result { body };
        Ok(Response::new(Box::pin(futures::stream::iter([Ok(result)]))))
    }

    async fn do_get_fallback(
        &self,
        request: Request<Ticket>,
        message: Any,
    ) -> Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let caller = caller_of(&request)?;
        let Some(ticket) = super::datasets::decode_ticket(&message) else {
            return Err(Status::invalid_argument(format!(
                "flumen serve does not know tickets of type {}",
                message.type_url
            )));
        };
        let (schema, block) = self
            .datasets
            .next_block(&self.queries, &caller.user, &ticket?)
            .await?;
        Ok(Response::new(batches_stream(
            schema,
            block.into_iter().collect(),
        )))
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_marks_become_numbered_placeholders() {
        let sql = "SELECT '?' AS q, a FROM t WHERE a = ? AND b > ? -- ?\n";
        assert_eq!(
            number_placeholders(sql).unwrap(),
            "SELECT '?' AS q, a FROM t WHERE a = $1 AND b > $2 -- ?\n"
        );
    }

    #[test]
    fn updates_report_the_count_column() {
        use datafusion::arrow::array::UInt64Array;
        let schema = Arc::new(Schema::new(vec![Field::new(
            "count",
            DataType::UInt64,
            false,
        )]));
        let batch =
            RecordBatch::try_new(schema, vec![Arc::new(UInt64Array::from(vec![42]))]).unwrap();
        assert_eq!(affected_rows(&[batch]), 42);
        assert_eq!(affected_rows(&[]), 0);
    }
}
