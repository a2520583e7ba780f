//! `flumen worker`'s command line and what it runs: shared by the `flumen` binary and the
//! Python package's `python -m flumen worker`, whose workers can also run the Python
//! functions drivers ship with their tasks ([`crate::cluster::shipped_functions`]).

use std::path::PathBuf;

use clap::Parser;
use datafusion::error::{DataFusionError, Result};

use crate::FlumenConfig;
use crate::cluster::WorkerSettings;
use crate::cluster::auth::Secret;
use crate::cluster::tls::{TlsIdentity, WorkerTrust};
use crate::plan::Pool;

/// `flumen worker ARGS` parsed on its own (`python -m flumen worker ARGS`).
#[derive(Parser, Debug)]
#[command(
    name = "flumen worker",
    about = "Serve as a worker process for a flumen driver"
)]
pub struct WorkerCommand {
    /// The options.
    #[command(flatten)]
    pub args: WorkerArgs,
}

/// `flumen worker`'s options.
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// Address to listen on (`host:port`; port 0 picks a free one). Any address but
    /// loopback needs TLS (--tls-cert and --tls-key).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// The driver's pool it serves: `cpu` (several tasks at once) or `accelerator`
    /// (one task at a time on one thread that keeps its models loaded).
    #[arg(long, default_value = "cpu")]
    pool: Pool,
    /// Read the driver's secret (64 hex digits) from the first line of stdin, and exit
    /// when stdin closes (how a driver starts its workers).
    #[arg(long, conflicts_with = "secret_file")]
    secret_stdin: bool,
    /// Read the driver's secret from FILE (mode 0600: a file others can read is
    /// refused).
    #[arg(long, value_name = "FILE")]
    secret_file: Option<PathBuf>,
    /// Serve TLS with the certificate (chain) in this PEM file.
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_key",
        conflicts_with = "tls_stdin"
    )]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert, a PEM file readable by its owner only (mode 0600).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The CA (PEM file) other workers' certificates chain to: this worker checks them
    /// when it fetches a task's input blocks from them over TLS.
    #[arg(long, value_name = "FILE", conflicts_with = "tls_stdin")]
    tls_ca: Option<PathBuf>,
    /// Read a TLS certificate and key, then the CA of its peers (PEM, each ended by a
    /// blank line) from stdin after the secret (how a driver with `flumen.worker_tls` on
    /// starts its workers).
    #[arg(long, requires = "secret_stdin")]
    tls_stdin: bool,
    /// Exit after SECS seconds without a call from a driver (for workers a driver did
    /// not start; its heartbeat calls every half second).
    #[arg(long, value_name = "SECS")]
    lease: Option<u64>,
    /// Largest message accepted or sent, in bytes (default 1 GiB: a task carries its
    /// input blocks).
    #[arg(long, value_name = "BYTES")]
    max_message_bytes: Option<usize>,
    /// Tasks it runs at once, as it announces to drivers (default: one per core for a CPU
    /// worker, one for an accelerator worker).
    #[arg(long, value_name = "N")]
    slots: Option<usize>,
    /// Bytes of blocks it keeps in memory, all queries together, as it announces (e.g.
    /// `4GiB`; default 2GiB); the rest go to its spill files until read.
    #[arg(long, value_name = "SIZE")]
    memory_budget: Option<crate::ByteSize>,
    /// Also serve an emulated accelerator model, `NAME:SERVICE_MS:BATCH_ROWS:DIMS`: each
    /// batch occupies this worker's emulated device for SERVICE_MS (benchmarks and
    /// capacity tests without GPUs; the driver registers the same model). Repeatable.
    #[arg(long, value_name = "SPEC")]
    emulated_model: Vec<String>,
    /// Speak worker protocol N instead of this build's (tests: a worker of an older or
    /// newer flumen, which drivers must refuse clearly).
    #[arg(long, value_name = "N", hide = true)]
    speak_protocol: Option<u32>,
    /// Refuse the functions drivers ship inside task plans (Python models and functions,
    /// run by `python -m flumen worker`): run flumen's own functions only.
    #[arg(long)]
    no_shipped_functions: bool,
    /// The GPU its models compute on, `cuda:N` (an accelerator worker per GPU of a host:
    /// start one with each N). Default: the device the fewest of its workers use.
    #[arg(long, value_name = "cuda:N", value_parser = parse_device, conflicts_with = "device_slot")]
    device: Option<usize>,
    /// It is the I-th accelerator worker its driver started on this host: its models compute
    /// on device I modulo the visible devices (how a driver spreads its pool over the GPUs).
    #[arg(long, value_name = "I")]
    device_slot: Option<usize>,
}

fn parse_device(text: &str) -> std::result::Result<usize, String> {
    crate::functions::accelerator_devices::parse_cuda_device(text)
}

/// The secret, TLS identity and limits `args` ask for (read from stdin or files).
fn worker_settings(args: &WorkerArgs) -> Result<WorkerSettings> {
    let secret = match (args.secret_stdin, &args.secret_file) {
        (true, _) => Secret::from_stdin()?,
        (false, Some(path)) => Secret::from_file(path)?,
        (false, None) => {
            return Err(DataFusionError::Execution(
                "no secret: a worker answers only callers that present its driver's secret \
                 (--secret-stdin, or --secret-file FILE)"
                    .into(),
            ));
        }
    };
    let mut settings = WorkerSettings::new(secret);
    settings.tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsIdentity::from_files(cert, key)?),
        _ if args.tls_stdin => Some(TlsIdentity::read_from(&mut std::io::stdin().lock())?),
        _ => None,
    };
    settings.peer_trust = match &args.tls_ca {
        Some(ca) => Some(WorkerTrust::from_file(ca)?),
        None if args.tls_stdin => Some(WorkerTrust::read_from(&mut std::io::stdin().lock())?),
        None => None,
    };
    settings.exit_when_stdin_closes = args.secret_stdin;
    settings.lease = args.lease.map(std::time::Duration::from_secs);
    if let Some(bytes) = args.max_message_bytes {
        settings.max_message_bytes = bytes;
    }
    settings.slots = args.slots.map(|n| n.max(1));
    if let Some(budget) = args.memory_budget {
        settings.memory_budget = budget.0;
    }
    if let Some(protocol) = args.speak_protocol {
        settings.protocol = protocol;
    }
    Ok(settings)
}

/// Serve as a worker as `args` say, until killed, the driver goes away or the lease runs
/// out: read the secret and TLS identity, start a runtime and a flumen session, serve.
pub fn run(args: &WorkerArgs) -> Result<()> {
    use crate::functions::accelerator_devices::{DevicePin, check_device, pin_process};
    match (args.device, args.device_slot) {
        (Some(device), _) => {
            check_device(device)?;
            pin_process(DevicePin::Device(device))?
        }
        (None, Some(slot)) => pin_process(DevicePin::Slot(slot))?,
        (None, None) => {}
    }
    let settings = worker_settings(args)?;
    if args.no_shipped_functions {
        crate::cluster::shipped_functions::refuse_all();
    }
    let runtime = tokio::runtime::Runtime::new()
        .map_err(|e| DataFusionError::Execution(format!("cannot start the runtime: {e}")))?;
    runtime.block_on(async {
        let ctx = crate::session(FlumenConfig::default());
        for spec in &args.emulated_model {
            let model = crate::functions::emulated_accelerator::EmulatedModel::from_spec(spec)?;
            ctx.register_udf(crate::accelerator_udf(model));
        }
        crate::cluster::serve(&args.listen, args.pool, ctx, settings).await
    })
}

impl WorkerCommand {
    /// Parse `argv` (its first item the program's name).
    pub fn parse_args(argv: &[String]) -> std::result::Result<Self, clap::Error> {
        Self::try_parse_from(argv)
    }
}

/// Log warnings (or what `RUST_LOG` asks for) to stderr, without the target; a second call
/// does nothing.
pub fn init_logging() {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_target(false)
        .try_init();
}
