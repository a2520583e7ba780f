//! The statements a server holds between calls: a query planned by `GetFlightInfo` until
//! its `DoGet` redeems the ticket, and prepared statements (with their bound parameters)
//! until the client closes them. A handle is 16 random bytes and is honoured only for the
//! session that made it; anything else is "unknown".

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::ParamValues;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::DataFrame;
use tonic::Status;

use super::credentials::Caller;

/// A ticket not redeemed within this long is forgotten.
const TICKET_LIFETIME: Duration = Duration::from_secs(600);
/// Most tickets one session may hold unredeemed.
pub const MAX_TICKETS_PER_SESSION: usize = 256;
/// Most prepared statements one session may hold open.
pub const MAX_PREPARED_PER_SESSION: usize = 1024;
/// A prepared statement unused (not executed, bound or described) this long is closed.
pub const PREPARED_IDLE_LIMIT: Duration = Duration::from_secs(3600);
/// The length of a handle.
const HANDLE_BYTES: usize = 16;

/// A statement held for a ticket.
pub struct PlannedQuery {
    /// The statement as the client sent it (for the log).
    pub sql: String,
    /// What redeeming the ticket returns.
    pub result: TicketResult,
}

/// What a ticket returns.
pub enum TicketResult {
    /// A query to run, planned on the client's session as it was then.
    Plan(DataFrame),
    /// The result of a statement that already ran (DDL, `SET`, `COPY`, `INSERT`).
    Done(SchemaRef, Vec<RecordBatch>),
}

/// A prepared statement.
#[derive(Clone)]
pub struct Prepared {
    /// The statement as the client sent it (for the log).
    pub sql: String,
    /// Its plan, with `$1`, `$2`... placeholders.
    pub plan: LogicalPlan,
    /// The parameters last bound (`DoPut`), if any.
    pub params: Option<ParamValues>,
}

struct Owned<T> {
    session: String,
    /// When it was made (a ticket) or last used (a prepared statement).
    made: Instant,
    item: T,
}

/// The tickets and prepared statements of a server.
pub struct Statements {
    tickets: Mutex<HashMap<Vec<u8>, Owned<PlannedQuery>>>,
    prepared: Mutex<HashMap<Vec<u8>, Owned<Prepared>>>,
    /// A prepared statement unused this long is closed.
    prepared_idle: Duration,
}

impl Default for Statements {
    fn default() -> Self {
        Self::new(PREPARED_IDLE_LIMIT)
    }
}

fn new_handle() -> Vec<u8> {
    uuid::Uuid::new_v4().as_bytes().to_vec()
}

fn unknown(what: &str) -> Status {
    Status::not_found(format!(
        "unknown {what} handle: it was never issued to this session, was already used, \
         closed, or expired"
    ))
}

fn check_handle(handle: &[u8], what: &str) -> Result<(), Status> {
    if handle.len() != HANDLE_BYTES {
        return Err(Status::invalid_argument(format!(
            "a {what} handle is {HANDLE_BYTES} bytes, this one {}",
            handle.len()
        )));
    }
    Ok(())
}

impl Statements {
    /// No statements; prepared ones unused for `prepared_idle` are closed.
    pub fn new(prepared_idle: Duration) -> Self {
        Self {
            tickets: Mutex::default(),
            prepared: Mutex::default(),
            prepared_idle,
        }
    }

    /// Hold `query` for `caller`; returns its ticket handle. A session holding
    /// [`MAX_TICKETS_PER_SESSION`] unredeemed tickets is refused another.
    pub fn add_ticket(&self, caller: &Caller, query: PlannedQuery) -> Result<Vec<u8>, Status> {
        let handle = new_handle();
        let mut tickets = self.tickets.lock().unwrap();
        tickets.retain(|_, t| t.made.elapsed() < TICKET_LIFETIME);
        let held = tickets
            .values()
            .filter(|t| t.session == caller.session)
            .count();
        if held >= MAX_TICKETS_PER_SESSION {
            return Err(Status::resource_exhausted(format!(
                "this session holds {held} unredeemed tickets, the most allowed: read them \
                 (DoGet) before asking for more"
            )));
        }
        tickets.insert(
            handle.clone(),
            Owned {
                session: caller.session.clone(),
                made: Instant::now(),
                item: query,
            },
        );
        Ok(handle)
    }

    /// Redeem a ticket (once).
    pub fn take_ticket(&self, caller: &Caller, handle: &[u8]) -> Result<PlannedQuery, Status> {
        check_handle(handle, "statement")?;
        let mut tickets = self.tickets.lock().unwrap();
        match tickets.get(handle) {
            Some(t) if t.session == caller.session => {}
            _ => return Err(unknown("statement")),
        }
        Ok(tickets.remove(handle).expect("present").item)
    }

    /// Hold a prepared statement for `caller`; returns its handle.
    pub fn add_prepared(&self, caller: &Caller, prepared: Prepared) -> Result<Vec<u8>, Status> {
        let handle = new_handle();
        let mut all = self.prepared.lock().unwrap();
        all.retain(|_, p| p.made.elapsed() < self.prepared_idle);
        let open = all.values().filter(|p| p.session == caller.session).count();
        if open >= MAX_PREPARED_PER_SESSION {
            return Err(Status::resource_exhausted(format!(
                "this session holds {open} prepared statements, the most allowed: close some"
            )));
        }
        all.insert(
            handle.clone(),
            Owned {
                session: caller.session.clone(),
                made: Instant::now(),
                item: prepared,
            },
        );
        Ok(handle)
    }

    /// A copy of prepared statement `handle` (a use: its idle time starts again).
    pub fn prepared(&self, caller: &Caller, handle: &[u8]) -> Result<Prepared, Status> {
        check_handle(handle, "prepared statement")?;
        match self.prepared.lock().unwrap().get_mut(handle) {
            Some(p) if p.session == caller.session && p.made.elapsed() < self.prepared_idle => {
                p.made = Instant::now();
                Ok(p.item.clone())
            }
            _ => Err(unknown("prepared statement")),
        }
    }

    /// Bind `params` to prepared statement `handle`.
    pub fn bind(&self, caller: &Caller, handle: &[u8], params: ParamValues) -> Result<(), Status> {
        check_handle(handle, "prepared statement")?;
        match self.prepared.lock().unwrap().get_mut(handle) {
            Some(p) if p.session == caller.session && p.made.elapsed() < self.prepared_idle => {
                p.made = Instant::now();
                p.item.params = Some(params);
                Ok(())
            }
            _ => Err(unknown("prepared statement")),
        }
    }

    /// Close prepared statement `handle`.
    pub fn close(&self, caller: &Caller, handle: &[u8]) -> Result<(), Status> {
        check_handle(handle, "prepared statement")?;
        let mut all = self.prepared.lock().unwrap();
        match all.get(handle) {
            Some(p) if p.session == caller.session => {
                all.remove(handle);
                Ok(())
            }
            _ => Err(unknown("prepared statement")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_handle_serves_only_its_session_and_a_ticket_only_once() {
        let ctx = datafusion::prelude::SessionContext::new();
        let statements = Statements::default();
        let caller = |s: &str| Caller {
            user: "u".into(),
            session: s.into(),
        };
        let frame = ctx.sql("SELECT 1").await.unwrap();
        let handle = statements
            .add_ticket(
                &caller("a"),
                PlannedQuery {
                    sql: "SELECT 1".into(),
                    result: TicketResult::Plan(frame),
                },
            )
            .unwrap();
        assert_eq!(
            statements
                .take_ticket(&caller("b"), &handle)
                .err()
                .unwrap()
                .code(),
            tonic::Code::NotFound
        );
        assert!(statements.take_ticket(&caller("a"), &handle).is_ok());
        assert!(statements.take_ticket(&caller("a"), &handle).is_err());
        let huge = vec![7u8; 1 << 20];
        let err = statements.take_ticket(&caller("a"), &huge).err().unwrap();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);

        let plan = ctx.state().create_logical_plan("SELECT $1").await.unwrap();
        let prepared = Prepared {
            sql: "SELECT ?".into(),
            plan,
            params: None,
        };
        let handle = statements.add_prepared(&caller("a"), prepared).unwrap();
        assert!(statements.prepared(&caller("b"), &handle).is_err());
        statements
            .bind(
                &caller("a"),
                &handle,
                vec![datafusion::scalar::ScalarValue::from(5)].into(),
            )
            .unwrap();
        assert!(
            statements
                .prepared(&caller("a"), &handle)
                .unwrap()
                .params
                .is_some()
        );
        assert!(statements.close(&caller("b"), &handle).is_err());
        statements.close(&caller("a"), &handle).unwrap();
        assert!(statements.prepared(&caller("a"), &handle).is_err());
    }

    #[tokio::test]
    async fn idle_prepared_statements_close_and_tickets_are_capped_per_session() {
        let ctx = datafusion::prelude::SessionContext::new();
        // Touched every 250 ms, `kept` stays under a 1 s idle limit unless one sleep
        // overshoots by 750 ms (a 100 ms limit touched every 40 ms failed once on a busy
        // machine); `idle`, never touched, is past it after 1.25 s whatever the load.
        let statements = Statements::new(Duration::from_secs(1));
        let caller = |s: &str| Caller {
            user: "u".into(),
            session: s.into(),
        };
        let plan = ctx.state().create_logical_plan("SELECT 1").await.unwrap();
        let prepared = |sql: &str| Prepared {
            sql: sql.into(),
            plan: plan.clone(),
            params: None,
        };
        let kept = statements
            .add_prepared(&caller("a"), prepared("kept"))
            .unwrap();
        let idle = statements
            .add_prepared(&caller("a"), prepared("idle"))
            .unwrap();
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(250));
            assert!(statements.prepared(&caller("a"), &kept).is_ok());
        }
        assert_eq!(
            statements
                .prepared(&caller("a"), &idle)
                .err()
                .unwrap()
                .code(),
            tonic::Code::NotFound
        );
        for n in 0..MAX_TICKETS_PER_SESSION {
            let frame = ctx.sql("SELECT 1").await.unwrap();
            let query = PlannedQuery {
                sql: format!("{n}"),
                result: TicketResult::Plan(frame),
            };
            statements.add_ticket(&caller("a"), query).unwrap();
        }
        let frame = ctx.sql("SELECT 1").await.unwrap();
        let query = |frame| PlannedQuery {
            sql: "one more".into(),
            result: TicketResult::Plan(frame),
        };
        let err = statements
            .add_ticket(&caller("a"), query(frame))
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        // Another session is not held back by this one.
        let frame = ctx.sql("SELECT 1").await.unwrap();
        assert!(statements.add_ticket(&caller("b"), query(frame)).is_ok());
    }
}
