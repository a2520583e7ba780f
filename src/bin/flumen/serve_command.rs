//! `flumen serve`: the Arrow Flight SQL server (see `flumen::serve`), and
//! `flumen serve --hash-password`, which makes a user file's lines.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use flumen::FlumenConfig;
use flumen::cluster::auth::Secret;
use flumen::cluster::tls::TlsIdentity;
use flumen::serve::credentials::{UserFile, default_token, hash_password};
use flumen::serve::policy::AccessPolicy;
use flumen::serve::{DEFAULT_LISTEN, ServeSettings};

use crate::demo_table;

/// `flumen serve`'s options.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (`host:port`; port 0 picks a free one). Anything but loopback
    /// needs TLS (--tls-cert, --tls-key).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: String,
    /// Users who log in with a password: `name:hash` lines, hashes from
    /// `flumen serve --hash-password` (a file readable by its owner only).
    #[arg(long, value_name = "FILE")]
    users: Option<PathBuf>,
    /// A token (64 hex digits) accepted as `authorization: Bearer TOKEN` (a file readable
    /// by its owner only). With neither --users nor --token-file the server makes one in
    /// its state directory on first start and says where.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Serve TLS with the certificate (chain) in this PEM file.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM, readable by its owner only).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Where the tables clients create are kept across restarts (default:
    /// STATE_DIR/catalog.json).
    #[arg(long, value_name = "FILE")]
    catalog: Option<PathBuf>,
    /// The server's state directory: its catalog file and generated token (default: the
    /// user's data directory, e.g. ~/.local/share/flumen).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Run tasks in N CPU worker processes (`flumen.workers = 'process'`).
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Bytes of blocks each query may keep in memory (`flumen.memory_budget`, e.g. `1GiB`;
    /// a client may `SET` its own).
    #[arg(long, value_name = "SIZE")]
    memory_budget: Option<flumen::ByteSize>,
    /// Let clients read and write files under DIR (repeatable; after `..` and symlinks
    /// are resolved). None by default: clients then touch no local file.
    #[arg(long, value_name = "DIR")]
    allow_path: Vec<PathBuf>,
    /// Let clients read and write locations starting with PREFIX, e.g. `s3://bucket/` or
    /// `https://data.example.com/` (repeatable). None by default. An `http(s)` host that is
    /// or resolves to a loopback, private or link-local address needs a prefix naming it.
    #[arg(long, value_name = "PREFIX")]
    allow_url: Vec<String>,
    /// Most queries one user runs at once (each holds up to the memory budget); a query
    /// beyond it is refused until one ends.
    #[arg(long, value_name = "N", default_value_t = flumen::serve::MAX_QUERIES_PER_USER)]
    max_queries_per_user: usize,
    /// A session token expires this many seconds after its login, however much it is used
    /// (the client logs in again).
    #[arg(long, value_name = "SECS", default_value_t = flumen::serve::credentials::TOKEN_LIFETIME.as_secs())]
    token_lifetime: u64,
    /// The operator's settings: `name = value` lines (`flumen.cpu_slots = 8`,
    /// `flumen.spill_dir = /srv/spill`, `datafusion.runtime.memory_limit = 8G`, ...),
    /// applied at startup. Operator settings are fixed by it (clients cannot `SET` them);
    /// client settings start from it.
    #[arg(long, value_name = "FILE")]
    settings: Option<PathBuf>,
    /// Do not register the demo `docs` table.
    #[arg(long)]
    no_demo: bool,
    /// Drop a dataset job none of whose consumers asked for a block for SECS seconds
    /// (its blocks are freed; a run it shared goes on without it).
    #[arg(long, value_name = "SECS", default_value_t = flumen::serve::datasets::JOB_IDLE_LIMIT.as_secs())]
    dataset_job_idle: u64,
    /// Read a password from standard input, print its hash (a user file's `HASH`), exit.
    #[arg(long, exclusive = true)]
    hash_password: bool,
}

/// Run `flumen serve` with `args`.
pub fn run(args: &ServeArgs) -> ExitCode {
    if args.hash_password {
        return print_password_hash();
    }
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("flumen serve: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flumen serve: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: &ServeArgs) -> Result<()> {
    let state_dir = args.state_dir.clone().unwrap_or_else(|| {
        dirs::data_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("flumen")
    });
    let mut settings = ServeSettings::new();
    settings.listen = args.listen.clone();
    settings.policy = AccessPolicy::new(&args.allow_path, &args.allow_url)?;
    settings.max_queries_per_user = args.max_queries_per_user.max(1);
    settings.token_lifetime = std::time::Duration::from_secs(args.token_lifetime.max(1));
    settings.dataset_job_idle = std::time::Duration::from_secs(args.dataset_job_idle.max(1));
    settings.users = args.users.as_deref().map(UserFile::from_file).transpose()?;
    settings.token = match &args.token_file {
        Some(path) => Some(Secret::from_file(path)?),
        None if settings.users.is_none() => {
            let path = state_dir.join("serve-token");
            let token = default_token(&path)?;
            eprintln!(
                "flumen serve: clients authenticate with the token in {} \
                 ('authorization: Bearer TOKEN')",
                path.display()
            );
            Some(token)
        }
        None => None,
    };
    settings.tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsIdentity::from_files(cert, key)?),
        _ => None,
    };
    settings.catalog_file = Some(
        args.catalog
            .clone()
            .unwrap_or_else(|| state_dir.join("catalog.json")),
    );
    let mut config = FlumenConfig::default();
    if let Some(n) = args.workers {
        config.workers = flumen::WorkerMode::Process;
        config.worker_processes = n.max(1);
    }
    if let Some(budget) = args.memory_budget {
        config.memory_budget = budget;
    }
    // `SHOW` and `information_schema` on, as clients' metadata browsers expect.
    let session_config = datafusion::prelude::SessionConfig::new().with_information_schema(true);
    // Path and URL tables are each client session's own (`serve::sessions`): read through
    // that session's object stores.
    let ctx = flumen::session_with_config(session_config, config);
    if let Some(path) = &args.settings {
        let applied = flumen::serve::settings_file::apply(&ctx, path).await?;
        log::info!("flumen serve: {applied} settings from {}", path.display());
    }
    if !args.no_demo {
        let table = Arc::new(demo_table::DemoTable::new(flumen::demo::DEFAULT_ROWS));
        ctx.register_table("docs", table)?;
    }
    flumen::serve::serve(ctx, settings).await
}

/// `--hash-password`: one line of stdin in, its Argon2id hash out.
fn print_password_hash() -> ExitCode {
    let mut password = String::new();
    let read = std::io::stdin().lock().read_line(&mut password);
    let password = password.trim_end_matches(['\n', '\r']);
    let hashed = match read {
        Ok(_) if password.is_empty() => Err(DataFusionError::Execution(
            "give the password on standard input (an empty password is refused)".into(),
        )),
        Ok(_) => hash_password(password),
        Err(e) => Err(DataFusionError::Execution(format!("reading stdin: {e}"))),
    };
    match hashed {
        Ok(hash) => {
            println!("{hash}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("flumen serve --hash-password: {e}");
            ExitCode::FAILURE
        }
    }
}
