//! Running what a user types: SQL statements through the flumen session (in this process,
//! or on a `flumen serve` the REPL is connected to), and the backslash meta commands (`\d`,
//! `\d NAME`, `\?`, `\timing`, `\format`, `\maxrows`, `\maxwidth`, `\jobs`, `\cancel`, `\q`).

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_plan::execute_stream;
use datafusion::prelude::SessionContext;
use futures::StreamExt;
use futures::stream::BoxStream;

use crate::output::{self, Format};
use crate::peak_rss::PeakRss;
use crate::progress::Progress;
use crate::remote::RemoteSession;

/// Where statements run.
pub enum Session {
    /// In this process, on flumen's executor.
    Local(SessionContext),
    /// On a `flumen serve` over Flight SQL (`flumen --connect`).
    Remote(RemoteSession),
}

/// What a meta command asks of the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Flow {
    /// Go on reading input.
    Continue,
    /// Leave the shell.
    Quit,
}

/// The session and the output settings of one `flumen` process.
pub struct Shell {
    /// Where every statement runs.
    pub session: Session,
    /// How results are printed.
    pub format: Format,
    /// Most rows printed per result (`None`: all).
    pub maxrows: Option<usize>,
    /// Most characters printed per cell in the table format (`None`: all).
    pub maxwidth: Option<usize>,
    /// Print a timing line (rows, seconds, this process's peak resident memory) after each
    /// statement.
    pub timing: bool,
    /// Ctrl-C cancels the running query and keeps the shell (the interactive REPL); else
    /// it ends the process as usual.
    pub cancel_on_ctrl_c: bool,
}

const HELP: &str = "\
SQL statements end with ';' and may span lines. Meta commands:
  \\d              list tables
  \\d NAME         show a table's columns
  \\timing         turn the timing line on or off
  \\format [NAME]  show or set the output format: table, csv, json, ndjson
  \\maxrows [N]    show or set the most rows printed (0: all)
  \\maxwidth [N]   show or set the most characters of a table cell (0: all)
  \\?              this help
  \\q              quit (or Ctrl-D); Ctrl-C cancels a running query";

impl Shell {
    /// Run one statement (SQL, or a meta command when it starts with `\`), printing its
    /// result to standard output. Ctrl-C cancels a running query.
    pub async fn run(&mut self, statement: &str) -> Result<Flow> {
        let statement = statement.trim();
        if let Some(meta) = statement.strip_prefix('\\') {
            return self.meta(meta).await;
        }
        if !self.cancel_on_ctrl_c {
            return self.run_sql(statement).await.map(|_| Flow::Continue);
        }
        tokio::select! {
            result = self.run_sql(statement) => result.map(|_| Flow::Continue),
            _ = tokio::signal::ctrl_c() => Err(DataFusionError::Execution(
                "query cancelled (Ctrl-C)".into(),
            )),
        }
    }

    async fn run_sql(&mut self, sql: &str) -> Result<()> {
        let started = Instant::now();
        let peak_rss = matches!(self.session, Session::Local(_)).then(PeakRss::start);
        let (mut stream, _progress) = match &mut self.session {
            Session::Local(ctx) => local_result(ctx, sql).await?,
            Session::Remote(server) => (server.query(sql).await?, None),
        };
        let mut kept = vec![];
        let mut kept_rows = 0;
        let mut total_rows = 0;
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            total_rows += batch.num_rows();
            let room = self.maxrows.map_or(usize::MAX, |m| m - kept_rows.min(m));
            if room > 0 && batch.num_rows() > 0 {
                let take = room.min(batch.num_rows());
                kept.push(batch.slice(0, take));
                kept_rows += take;
            } else if kept.is_empty() {
                kept.push(batch.slice(0, 0));
            }
        }
        drop(_progress);
        let mut out = std::io::stdout().lock();
        output::print(&mut out, self.format, &kept, total_rows, self.maxwidth)?;
        out.flush()?;
        if self.timing {
            // The peak of this process only: a server's or a worker's memory is not here.
            let peak = peak_rss
                .and_then(|p| p.bytes())
                .map_or(String::new(), |bytes| {
                    format!(", peak RSS {:.1} MiB", bytes as f64 / (1 << 20) as f64)
                });
            eprintln!(
                "{total_rows} row{} in {:.3} s{peak}",
                if total_rows == 1 { "" } else { "s" },
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    async fn meta(&mut self, command: &str) -> Result<Flow> {
        let mut words = command.split_whitespace();
        let name = words.next().unwrap_or("");
        let arg = words.next();
        match (name, arg) {
            ("q" | "quit", _) => return Ok(Flow::Quit),
            ("?" | "h" | "help", _) => println!("{HELP}"),
            ("d", None) => self.list_tables().await?,
            ("d", Some(table)) => {
                let schema = match &mut self.session {
                    Session::Local(ctx) => ctx.table(table).await?.schema().as_arrow().clone(),
                    Session::Remote(server) => server.schema_of(table).await?,
                };
                println!("{}", describe_schema(&schema));
            }
            ("jobs", _) => println!("{}", self.remote("jobs")?.jobs().await?),
            ("cancel", Some(id)) => {
                self.remote("cancel")?.cancel(id).await?;
                println!("cancelled {id}");
            }
            ("timing", _) => {
                self.timing = !self.timing;
                println!("timing is {}", if self.timing { "on" } else { "off" });
            }
            ("format", None) => println!("format is {}", self.format.name()),
            ("format", Some(f)) => {
                self.format = f.parse().map_err(DataFusionError::Plan)?;
                println!("format is {}", self.format.name());
            }
            ("maxrows", None) => println!("maxrows is {}", limit_name(self.maxrows)),
            ("maxrows", Some(n)) => self.maxrows = limit("maxrows", n)?,
            ("maxwidth", None) => println!("maxwidth is {}", limit_name(self.maxwidth)),
            ("maxwidth", Some(n)) => self.maxwidth = limit("maxwidth", n)?,
            _ => {
                return Err(DataFusionError::Plan(format!(
                    "unknown command \\{command}; \\? lists the commands"
                )));
            }
        }
        Ok(Flow::Continue)
    }

    /// The server this shell is connected to, or an error saying `\command` needs one.
    fn remote(&mut self, command: &str) -> Result<&mut RemoteSession> {
        match &mut self.session {
            Session::Remote(server) => Ok(server),
            Session::Local(_) => Err(DataFusionError::Plan(format!(
                "\\{command} is about a server's queries: start the REPL with \
                 --connect grpc://HOST:PORT"
            ))),
        }
    }

    async fn list_tables(&mut self) -> Result<()> {
        let rows = match &mut self.session {
            Session::Local(ctx) => local_tables(ctx),
            Session::Remote(server) => server.tables().await?,
        };
        if rows.is_empty() {
            println!("no tables");
        }
        for row in rows {
            println!("{row}");
        }
        Ok(())
    }
}

/// A `\maxrows` or `\maxwidth` argument: a number, 0 for no limit.
fn limit(command: &str, n: &str) -> Result<Option<usize>> {
    let n: usize = n.parse().map_err(|_| {
        DataFusionError::Plan(format!(
            "\\{command} takes a number (0: no limit), got '{n}'"
        ))
    })?;
    Ok((n > 0).then_some(n))
}

/// How a limit is shown: its number, or `unlimited`.
fn limit_name(limit: Option<usize>) -> String {
    limit.map_or("unlimited".to_string(), |m| m.to_string())
}

/// Plan and start `sql` in this process: its result stream, and the progress lines shown
/// while it runs (when standard error is a terminal).
async fn local_result(
    ctx: &SessionContext,
    sql: &str,
) -> Result<(BoxStream<'static, Result<RecordBatch>>, Option<Progress>)> {
    let df = flumen::user_statement(ctx, sql).await?;
    let plan = df.create_physical_plan().await?;
    let progress = if std::io::stderr().is_terminal() {
        Progress::start(&plan)
    } else {
        None
    };
    let stream = execute_stream(Arc::clone(&plan), ctx.task_ctx())?;
    Ok((stream.boxed(), progress))
}

/// The tables of `ctx`, `catalog.schema.table`, without `information_schema`.
fn local_tables(ctx: &SessionContext) -> Vec<String> {
    let mut rows = vec![];
    for catalog_name in ctx.catalog_names() {
        let Some(catalog) = ctx.catalog(&catalog_name) else {
            continue;
        };
        for schema_name in catalog.schema_names() {
            if schema_name == "information_schema" {
                continue;
            }
            let Some(schema) = catalog.schema(&schema_name) else {
                continue;
            };
            let mut tables = schema.table_names();
            tables.sort();
            for table in tables {
                rows.push(format!("{catalog_name}.{schema_name}.{table}"));
            }
        }
    }
    rows
}

/// A table's columns, one per line: name, type, nullability.
fn describe_schema(schema: &datafusion::arrow::datatypes::Schema) -> String {
    let width = schema
        .fields()
        .iter()
        .map(|f| f.name().len())
        .max()
        .unwrap_or(0);
    schema
        .fields()
        .iter()
        .map(|f| {
            format!(
                "{:<width$}  {}{}",
                f.name(),
                f.data_type(),
                if f.is_nullable() { "" } else { " NOT NULL" }
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
