//! The queries a server is running: each registered while its result streams, listed (with
//! its operators' progress) by the `flumen.queries` action, cancellable by id, and logged in
//! one line when it ends: user, SQL (secrets masked), rows, bytes, time, and how it ended.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::{ExecutionPlan, RecordBatchStream};
use futures::Stream;
use serde::{Deserialize, Serialize};

use super::credentials::Caller;

/// One running query, as the server's progress view shows it.
#[derive(Debug)]
pub struct RunningQuery {
    /// Its id (what `CancelQuery` and the progress view name it by).
    pub id: String,
    /// Who runs it.
    pub user: String,
    /// Its SQL, secrets masked.
    pub sql: String,
    started: Instant,
    rows: AtomicU64,
    bytes: AtomicU64,
    cancelled: AtomicBool,
    plan: Arc<dyn ExecutionPlan>,
}

/// What the progress view reports of one query (as JSON; the REPL's `\jobs` reads it back).
#[derive(Debug, Serialize, Deserialize)]
pub struct QueryProgress {
    /// The query's id.
    pub id: String,
    /// Who runs it.
    pub user: String,
    /// Its SQL, secrets masked.
    pub sql: String,
    /// Seconds since it started.
    pub seconds: f64,
    /// Rows sent to the client so far.
    pub rows_sent: u64,
    /// Bytes (Arrow buffers) sent so far.
    pub bytes_sent: u64,
    /// Each flumen operator: name, pool, rows and blocks done, tasks done and running.
    pub operators: Vec<String>,
}

/// The queries running on a server.
#[derive(Debug, Default)]
pub struct RunningQueries {
    by_id: Mutex<HashMap<String, Arc<RunningQuery>>>,
}

impl RunningQueries {
    /// Start streaming `plan`'s result for `caller` as query `id`; the query is listed until
    /// the stream ends or is dropped, then logged.
    pub fn start(
        self: &Arc<Self>,
        caller: &Caller,
        id: String,
        sql: &str,
        plan: Arc<dyn ExecutionPlan>,
        stream: SendableRecordBatchStream,
    ) -> SendableRecordBatchStream {
        let query = Arc::new(RunningQuery {
            id,
            user: caller.user.clone(),
            sql: loggable_sql(sql),
            started: Instant::now(),
            rows: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
            plan,
        });
        self.by_id
            .lock()
            .unwrap()
            .insert(query.id.clone(), Arc::clone(&query));
        Box::pin(TrackedStream {
            schema: stream.schema(),
            inner: stream,
            query,
            queries: Arc::clone(self),
            outcome: None,
        })
    }

    /// Cancel query `id` if `caller`'s user runs it; returns whether it was found.
    pub fn cancel(&self, caller: &Caller, id: &str) -> bool {
        let queries = self.by_id.lock().unwrap();
        match queries.get(id) {
            Some(query) if query.user == caller.user => {
                query.cancelled.store(true, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// User `user`'s running queries, oldest first (a user sees only its own).
    pub fn progress(&self, user: &str) -> Vec<QueryProgress> {
        let queries: Vec<_> = (self.by_id.lock().unwrap().values())
            .filter(|q| q.user == user)
            .cloned()
            .collect();
        let mut listed: Vec<_> = queries
            .iter()
            .map(|q| QueryProgress {
                id: q.id.clone(),
                user: q.user.clone(),
                sql: q.sql.clone(),
                seconds: q.started.elapsed().as_secs_f64(),
                rows_sent: q.rows.load(Ordering::Relaxed),
                bytes_sent: q.bytes.load(Ordering::Relaxed),
                operators: crate::exec::operator_progress(&q.plan),
            })
            .collect();
        listed.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        listed
    }

    /// How many queries user `user` runs.
    pub fn running_for(&self, user: &str) -> usize {
        (self.by_id.lock().unwrap().values())
            .filter(|q| q.user == user)
            .count()
    }

    /// How many queries are running.
    pub fn len(&self) -> usize {
        self.by_id.lock().unwrap().len()
    }

    /// Whether none is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A result stream that counts what it hands out and deregisters (and logs) its query when
/// it ends or is dropped (the client went away or cancelled).
struct TrackedStream {
    schema: SchemaRef,
    inner: SendableRecordBatchStream,
    query: Arc<RunningQuery>,
    queries: Arc<RunningQueries>,
    outcome: Option<String>,
}

impl Stream for TrackedStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.outcome.is_some() {
            return Poll::Ready(None);
        }
        if self.query.cancelled.load(Ordering::Relaxed) {
            self.outcome = Some("cancelled".into());
            return Poll::Ready(Some(Err(DataFusionError::Execution(format!(
                "query {} was cancelled",
                self.query.id
            )))));
        }
        let next = self.inner.as_mut().poll_next(cx);
        match &next {
            Poll::Ready(Some(Ok(batch))) => {
                self.query
                    .rows
                    .fetch_add(batch.num_rows() as u64, Ordering::Relaxed);
                self.query
                    .bytes
                    .fetch_add(batch.get_array_memory_size() as u64, Ordering::Relaxed);
            }
            Poll::Ready(Some(Err(e))) => self.outcome = Some(format!("error: {e}")),
            Poll::Ready(None) => self.outcome = Some("ok".into()),
            Poll::Pending => {}
        }
        next
    }
}

impl RecordBatchStream for TrackedStream {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}

impl Drop for TrackedStream {
    fn drop(&mut self) {
        self.queries.by_id.lock().unwrap().remove(&self.query.id);
        let outcome = self
            .outcome
            .clone()
            .unwrap_or_else(|| "closed by the client before its end".into());
        let q = &self.query;
        log::info!(
            "query {} user={} rows={} bytes={} time={:.3}s {outcome}: {}",
            q.id,
            q.user,
            q.rows.load(Ordering::Relaxed),
            q.bytes.load(Ordering::Relaxed),
            q.started.elapsed().as_secs_f64(),
            q.sql
        );
    }
}

/// Words in an option or setting name whose value is a secret.
const SECRET_WORDS: [&str; 6] = ["secret", "password", "token", "key", "credential", "sas"];

/// `sql` fit for a log line: the values of `OPTIONS` whose names look secret (`secret`,
/// `key`, `token`, ...) masked in `CREATE EXTERNAL TABLE` (whose options DataFusion's
/// printer leaves out altogether) and `COPY`, and long statements cut at 400 characters.
pub fn loggable_sql(sql: &str) -> String {
    use datafusion::sql::parser::{DFParser, Statement};
    use datafusion::sql::sqlparser::ast::Value;
    let mask = |options: &mut Vec<(String, Value)>| {
        for (name, value) in options.iter_mut() {
            let lower = name.to_lowercase();
            if SECRET_WORDS.iter().any(|w| lower.contains(w)) {
                *value = Value::SingleQuotedString("***".into());
            }
        }
    };
    let text = match DFParser::parse_sql(sql) {
        Ok(statements) if statements.len() == 1 => {
            let mut statement = statements.into_iter().next().expect("one statement");
            match &mut statement {
                Statement::CreateExternalTable(create) => {
                    mask(&mut create.options);
                    statement.to_string()
                }
                Statement::CopyTo(copy) => {
                    mask(&mut copy.options);
                    statement.to_string()
                }
                _ => sql.trim().to_string(),
            }
        }
        _ if SECRET_WORDS.iter().any(|w| sql.to_lowercase().contains(w)) => {
            "(a statement that did not parse and may hold a secret)".into()
        }
        _ => sql.trim().to_string(),
    };
    let text = mask_url_credentials(&text.split_whitespace().collect::<Vec<_>>().join(" "));
    match text.char_indices().nth(400) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// `text` with the user and password of every URL in it (`s3://KEY:SECRET@bucket/`,
/// `https://user:pass@host/`) replaced by `***`.
fn mask_url_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        // The authority ends at the path, a quote or a space.
        let end = after
            .find(|c: char| c == '/' || c == '\'' || c == '"' || c.is_whitespace())
            .unwrap_or(after.len());
        let authority = &after[..end];
        match authority.rfind('@') {
            Some(user_end) => {
                out.push_str("***");
                out.push_str(&authority[user_end..]);
            }
            None => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_options_are_masked_in_logs() {
        let sql = "CREATE EXTERNAL TABLE t STORED AS PARQUET LOCATION 's3://b/t/' \
                   OPTIONS ('aws.secret_access_key' 'hunter2', 'aws.region' 'eu-west-1')";
        let logged = loggable_sql(sql);
        assert!(!logged.contains("hunter2"), "{logged}");
        assert!(logged.contains("LOCATION 's3://b/t/'"), "{logged}");
        let copy = "COPY (SELECT 1) TO 's3://b/o.parquet' OPTIONS ('aws.session_token' 'abc123')";
        assert!(!loggable_sql(copy).contains("abc123"));
        assert!(!loggable_sql("CREATE EXTERNAL secret 'x").contains("'x"));
        assert_eq!(loggable_sql("SELECT  1\n + 1"), "SELECT 1 + 1");
        assert_eq!(loggable_sql(&"x".repeat(1000)).len(), 403);
        let url = "SELECT * FROM 's3://AKIAXYZ:hunter2@bucket/t.parquet' JOIN 'https://h/x.csv'";
        let logged = loggable_sql(url);
        assert!(
            !logged.contains("hunter2") && !logged.contains("AKIAXYZ"),
            "{logged}"
        );
        assert!(logged.contains("'s3://***@bucket/t.parquet'"), "{logged}");
        assert!(logged.contains("'https://h/x.csv'"), "{logged}");
    }

    #[test]
    fn a_user_sees_and_cancels_only_its_own_queries() {
        use datafusion::arrow::datatypes::Schema;
        use datafusion::physical_plan::EmptyRecordBatchStream;
        use datafusion::physical_plan::empty::EmptyExec;
        let running = Arc::new(RunningQueries::default());
        let schema = Arc::new(Schema::empty());
        let caller = |user: &str| Caller {
            user: user.into(),
            session: user.into(),
        };
        let mut streams = vec![];
        for (user, id) in [("ana", "q1"), ("bo", "q2")] {
            streams.push(running.start(
                &caller(user),
                id.into(),
                "SELECT * FROM 's3://KEY:SECRET@b/t.parquet'",
                Arc::new(EmptyExec::new(Arc::clone(&schema))),
                Box::pin(EmptyRecordBatchStream::new(Arc::clone(&schema))),
            ));
        }
        let anas = running.progress("ana");
        assert_eq!(anas.len(), 1);
        assert_eq!((anas[0].id.as_str(), anas[0].user.as_str()), ("q1", "ana"));
        assert!(!anas[0].sql.contains("SECRET"), "{}", anas[0].sql);
        assert!(!running.cancel(&caller("ana"), "q2"));
        assert!(running.cancel(&caller("bo"), "q2"));
        drop(streams);
        assert!(running.progress("ana").is_empty());
    }
}
