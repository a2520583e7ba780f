//! A flumen worker with functions of your own, here some that misbehave on purpose, for
//! testing how a driver survives bad user code:
//! - `hang(x)` never returns (a stuck UDF: a deadlock, an endless retry loop);
//! - `hang_from(x, n)` returns `x` until a batch holds a value of at least `n`, then never
//!   returns (a task that gives some output, then sticks);
//! - `nap(x)` returns `x` after sleeping 400 ms per batch (a slow but steady task);
//! - `boom(x)` panics;
//! - `boom_model(text)`, an accelerator (model) function whose model panics on its first
//!   batch.
//!
//! A worker binary is any program that serves [`flumen::serve_worker`] with a session
//! that knows the functions the driver's plans call; the driver registers the same
//! functions in its own session (to plan) and starts this program as its workers
//! (`flumen --worker-binary target/debug/examples/fault_worker`, or
//! `FlumenConfig::worker_binary`). It takes the same arguments as `flumen worker`:
//!
//! ```text
//! fault_worker worker --listen 127.0.0.1:0 --pool cpu --secret-stdin
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, AsArray};
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::datatypes::Int64Type;
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::logical_expr::{ColumnarValue, Signature, Volatility, create_udf};
use datafusion::prelude::SessionContext;
use flumen::{AcceleratorFunction, AcceleratorWorker, FlumenConfig, accelerator_udf};

/// Register `hang`, `hang_from`, `nap`, `boom` and `boom_model` in `ctx`.
pub fn register_fault_functions(ctx: &SessionContext) {
    let hang = create_udf(
        "hang",
        vec![DataType::Int64],
        DataType::Int64,
        Volatility::Volatile,
        Arc::new(|_args: &[ColumnarValue]| -> Result<ColumnarValue> {
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }),
    );
    let boom = create_udf(
        "boom",
        vec![DataType::Int64],
        DataType::Int64,
        Volatility::Volatile,
        Arc::new(|_args: &[ColumnarValue]| -> Result<ColumnarValue> {
            panic!("boom: this function always panics")
        }),
    );
    let hang_from = create_udf(
        "hang_from",
        vec![DataType::Int64, DataType::Int64],
        DataType::Int64,
        Volatility::Volatile,
        Arc::new(|args: &[ColumnarValue]| -> Result<ColumnarValue> {
            let arrays = ColumnarValue::values_to_arrays(args)?;
            let values = arrays[0].as_primitive::<Int64Type>();
            let from = arrays[1].as_primitive::<Int64Type>();
            let reached = values.iter().zip(from.iter()).any(|(v, n)| v >= n);
            if reached {
                // Stuck for good, as a deadlocked function would be.
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            }
            Ok(ColumnarValue::Array(Arc::clone(&arrays[0])))
        }),
    );
    let nap = create_udf(
        "nap",
        vec![DataType::Int64],
        DataType::Int64,
        Volatility::Volatile,
        Arc::new(|args: &[ColumnarValue]| -> Result<ColumnarValue> {
            std::thread::sleep(std::time::Duration::from_millis(400));
            Ok(args[0].clone())
        }),
    );
    ctx.register_udf(hang);
    ctx.register_udf(hang_from);
    ctx.register_udf(nap);
    ctx.register_udf(boom);
    ctx.register_udf(accelerator_udf(BoomModel {
        signature: Signature::string(1, Volatility::Immutable),
    }));
}

/// A model whose every batch panics.
#[derive(Debug)]
struct BoomModel {
    signature: Signature,
}

impl AcceleratorFunction for BoomModel {
    fn name(&self) -> &str {
        "boom_model"
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(DataType::Float32)
    }
    fn load(&self, _config: &ConfigOptions) -> Result<Box<dyn AcceleratorWorker>> {
        Ok(Box::new(BoomWorker))
    }
}

struct BoomWorker;

impl AcceleratorWorker for BoomWorker {
    fn process(&mut self, _args: &[ArrayRef], _return_type: &DataType) -> Result<ArrayRef> {
        panic!("boom_model: the model panicked on its batch")
    }
}

/// The TLS identity, peers' CA, slots and lease `arg` names (as `flumen worker` takes them).
fn tls_and_limits(
    settings: &mut flumen::WorkerSettings,
    arg: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    use flumen::cluster::tls::{TlsIdentity, WorkerTrust};
    if let (Some(cert), Some(key)) = (arg("--tls-cert"), arg("--tls-key")) {
        settings.tls = Some(TlsIdentity::from_files(cert.as_ref(), key.as_ref())?);
    }
    if let Some(ca) = arg("--tls-ca") {
        settings.peer_trust = Some(WorkerTrust::from_file(ca.as_ref())?);
    }
    let number = |name: &str| -> Result<Option<u64>> {
        arg(name)
            .map(|n| {
                n.parse().map_err(|_| {
                    datafusion::error::DataFusionError::Configuration(format!("bad {name} {n}"))
                })
            })
            .transpose()
    };
    settings.slots = number("--slots")?.map(|n| n.max(1) as usize);
    settings.lease = number("--lease")?.map(std::time::Duration::from_secs);
    Ok(())
}

/// `fault_worker worker --listen ADDR --pool cpu|accelerator --secret-stdin|--secret-file F
/// [--tls-cert F --tls-key F] [--tls-ca F] [--slots N] [--lease SECS]`.
#[allow(dead_code)]
fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let listen = arg("--listen").unwrap_or_else(|| "127.0.0.1:0".into());
    let pool: flumen::plan::Pool = match arg("--pool").unwrap_or_else(|| "cpu".into()).parse() {
        Ok(pool) => pool,
        Err(e) => {
            eprintln!("fault_worker: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let secret_stdin = args.iter().any(|a| a == "--secret-stdin");
    let secret = match arg("--secret-file") {
        Some(file) => flumen::cluster::auth::Secret::from_file(file.as_ref()),
        None => flumen::cluster::auth::Secret::from_stdin(),
    };
    let secret = match secret {
        Ok(secret) => secret,
        Err(e) => {
            eprintln!("fault_worker: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut settings = flumen::WorkerSettings::new(secret);
    settings.exit_when_stdin_closes = secret_stdin;
    if let Err(e) = tls_and_limits(&mut settings, arg) {
        eprintln!("fault_worker: {e}");
        return std::process::ExitCode::FAILURE;
    }
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    let served = runtime.block_on(async {
        let ctx = flumen::session(FlumenConfig::default());
        register_fault_functions(&ctx);
        flumen::serve_worker(&listen, pool, ctx, settings).await
    });
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fault_worker: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
