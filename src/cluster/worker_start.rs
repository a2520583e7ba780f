//! Where a pool's workers come from: worker processes this driver starts on its own host,
//! and running workers of a cluster it attaches to.
//!
//! A started worker gets a cleared environment (only [`WORKER_ENVIRONMENT`] passes: no cloud
//! credentials) and reads the driver's secret ([`crate::cluster::auth`]) from its stdin,
//! which the driver keeps open: when the driver dies, even by SIGKILL, the pipe closes and
//! the worker exits. Its first line of output is its address. Either way, a worker joins
//! only after it answered the driver's hello ([`crate::cluster::worker_client::introduce`]).

use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use datafusion::error::{DataFusionError, Result};

use crate::cluster::auth::{Secret, driver_secret};
use crate::cluster::membership::ClusterSettings;
use crate::cluster::tls::{WorkerTrust, local_tls};
use crate::cluster::worker_client::introduce;
use crate::cluster::worker_handle::{WorkerHandle, new_handle};
use crate::plan::graph::Pool;

/// How long a starting worker may take to print its address.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The environment variables a worker process gets from its driver; all others (cloud
/// credentials, tokens) stay behind.
pub const WORKER_ENVIRONMENT: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "XDG_CACHE_HOME",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_HOME",
    "CUDA_PATH",
    "NVIDIA_VISIBLE_DEVICES",
    "FLUMEN_MODEL_DIR",
    // Python workers (`python -m flumen worker`) find the packages their driver found.
    "PYTHONPATH",
];

/// The thread-pool sizes of numeric libraries (OpenMP, OpenBLAS, MKL, numexpr) that a
/// worker gets, unless the driver's environment sets them: each library starts a thread per
/// core by default, so N workers on a host would run N times the cores' threads, and
/// OpenBLAS's spinning threads made a numpy model in two workers on two cores 2.5x slower
/// than in one (Ray sets `OMP_NUM_THREADS` for its workers for the same reason).
pub const THREAD_POOL_VARIABLES: &[&str] = &[
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
];

/// Start one worker process of `program` on this host (speaking TLS with this driver's
/// own certificate when `tls`), the `slot`-th of the `pool_size` of its pool, and connect to
/// it. Its numeric libraries get the pool's share of the host's cores
/// ([`THREAD_POOL_VARIABLES`]); an accelerator worker is told its slot (`--device-slot`), so
/// the pool's workers take the host's GPUs in turn.
pub(crate) async fn spawn_worker(
    program: &WorkerProgram,
    tls: bool,
    kind: Pool,
    slot: usize,
    pool_size: usize,
) -> Result<Arc<WorkerHandle>> {
    let threads = (crate::config::available_cores() / pool_size.max(1)).max(1);
    let binary = &program.executable;
    let tls = tls.then(local_tls).transpose()?;
    let fail = |why: String| {
        DataFusionError::Execution(format!(
            "cannot start flumen worker {}: {why}",
            binary.display()
        ))
    };
    let mut command = std::process::Command::new(binary);
    command
        .args(&program.leading_args)
        .args([
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--pool",
            kind.as_str(),
            "--secret-stdin",
        ])
        .args(tls.is_some().then_some("--tls-stdin"))
        .args(match kind {
            Pool::Accelerator => vec!["--device-slot".to_string(), slot.to_string()],
            Pool::Cpu => vec![],
        })
        .env_clear()
        .envs(
            WORKER_ENVIRONMENT
                .iter()
                .filter_map(|name| Some((name, std::env::var_os(name)?))),
        )
        .envs(THREAD_POOL_VARIABLES.iter().map(|name| {
            let value = std::env::var_os(name).unwrap_or_else(|| threads.to_string().into());
            (name, value)
        }))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = command.spawn().map_err(|e| fail(e.to_string()))?;
    // The secret (and the TLS identity) go down the pipe; the pipe stays open while the
    // driver lives.
    let mut handed = format!("{}\n", driver_secret().to_hex());
    if let Some(tls) = tls {
        // Its identity, then the CA its peers' certificates chain to.
        handed.push_str(&tls.identity.to_text());
        handed.push_str(&tls.trust.to_text());
    }
    let sent = child
        .stdin
        .as_mut()
        .expect("piped stdin")
        .write_all(handed.as_bytes());
    if let Err(e) = sent {
        let _ = child.kill();
        let status = child.wait().ok();
        // A program that is not a worker may print something and exit before the secret
        // is written: say what it printed, as when it prints before taking the secret.
        let mut printed = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut printed);
        }
        return Err(fail(match printed.lines().next() {
            Some(first) => format!(
                "it printed {first:?} instead of its address, and did not take the secret on \
                 stdin ({e}; exit status {status:?})"
            ),
            None => format!("it did not take the secret on stdin ({e}; exit status {status:?})"),
        }));
    }
    let stdout = child.stdout.take().expect("piped stdout");
    // A thread reads its output: the first line is its address, the rest is drained so the
    // pipe never fills.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(stdout).lines();
        let _ = first_tx.send(lines.next().transpose());
        for _ in lines.map_while(|l| l.ok()) {}
    });
    let first = match tokio::time::timeout(START_TIMEOUT, first_rx).await {
        Ok(Ok(Ok(line))) => line,
        Ok(Ok(Err(e))) => return Err(fail(e.to_string())),
        Ok(Err(_)) => None,
        Err(_) => {
            let _ = child.kill();
            return Err(fail(format!(
                "it printed no address within {START_TIMEOUT:?}"
            )));
        }
    };
    let address = match first
        .as_deref()
        .and_then(|l| l.strip_prefix("flumen worker listening on "))
    {
        Some(address) => address.trim().to_string(),
        None => {
            let _ = child.kill();
            let status = child.wait().ok();
            return Err(fail(format!(
                "it printed {:?} instead of its address (exit status {status:?})",
                first.unwrap_or_default()
            )));
        }
    };
    let trust = tls.map(|tls| &tls.trust);
    let (client, announced) = match introduce(&address, trust, driver_secret()).await {
        Ok(introduced) => introduced,
        Err(DataFusionError::Execution(why)) | Err(DataFusionError::Configuration(why)) => {
            let _ = child.kill();
            return Err(fail(why));
        }
        Err(e) => {
            let _ = child.kill();
            return Err(fail(e.to_string()));
        }
    };
    Ok(new_handle(
        address,
        announced,
        kind,
        client,
        trust.is_some(),
        Some(child),
    ))
}

/// Attach to the running worker at `address` of `cluster`; `None` when it serves another
/// pool than `kind`.
pub(crate) async fn attach_worker(
    address: &str,
    cluster: &ClusterSettings,
    secret: &Secret,
    trust: Option<&WorkerTrust>,
    kind: Pool,
) -> Result<Option<Arc<WorkerHandle>>> {
    cluster.check_reachable(address)?;
    let (client, announced) = introduce(address, trust, secret).await?;
    if announced.kind != kind {
        return Ok(None);
    }
    Ok(Some(new_handle(
        address.to_string(),
        announced,
        kind,
        client,
        trust.is_some(),
        None,
    )))
}

/// Attach to every worker of `kind` the cluster lists now; an error naming what each
/// address said when none could be.
pub(crate) async fn attach_all(
    cluster: &ClusterSettings,
    secret: &Secret,
    trust: Option<&WorkerTrust>,
    kind: Pool,
) -> Result<Vec<Arc<WorkerHandle>>> {
    let addresses = cluster.spec.addresses().await?;
    let attempts = addresses.iter().map(|address| async move {
        let attached = tokio::time::timeout(
            START_TIMEOUT / 2,
            attach_worker(address, cluster, secret, trust, kind),
        )
        .await;
        match attached {
            Ok(result) => result,
            Err(_) => Err(DataFusionError::Execution(format!(
                "{address} did not answer within {:?}",
                START_TIMEOUT / 2
            ))),
        }
    });
    let results = futures::future::join_all(attempts).await;
    let mut attached = vec![];
    let mut reasons = vec![];
    for (address, result) in addresses.iter().zip(results) {
        match result {
            Ok(Some(worker)) => attached.push(worker),
            Ok(None) => {}
            Err(e) => {
                log::warn!("flumen worker {address} not attached: {e}");
                reasons.push(match e {
                    DataFusionError::Execution(why) | DataFusionError::Configuration(why) => why,
                    other => other.to_string(),
                });
            }
        }
    }
    if attached.is_empty() {
        return Err(DataFusionError::Execution(format!(
            "the cluster has no {} worker that answers ({} address(es) listed){}{}",
            kind.as_str(),
            addresses.len(),
            if reasons.is_empty() { "" } else { ": " },
            reasons.join("; ")
        )));
    }
    Ok(attached)
}

/// The program worker processes run: an executable and the arguments that come before
/// `worker` (`-m flumen` when the executable is Python: the Python package's workers).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerProgram {
    /// The executable.
    pub executable: PathBuf,
    /// Its arguments before `worker ...`.
    pub leading_args: Vec<String>,
}

/// The program to start workers from: `flumen.worker_binary` (run as
/// `<binary> -m <module>` when `flumen.worker_module` names a Python module), else
/// `FLUMEN_WORKER_BIN`, else this process's own executable when it is the `flumen` binary.
pub fn worker_program(configured: &str, module: &str) -> Result<WorkerProgram> {
    let leading_args = match module {
        "" => vec![],
        module => vec!["-m".to_string(), module.to_string()],
    };
    let executable = if !configured.is_empty() {
        PathBuf::from(configured)
    } else if let Some(path) = std::env::var_os("FLUMEN_WORKER_BIN") {
        PathBuf::from(path)
    } else {
        let exe = std::env::current_exe()?;
        if exe.file_stem().is_none_or(|n| n != "flumen") {
            return Err(DataFusionError::Configuration(
                "flumen.workers = 'process' needs the flumen binary to start workers from: \
                 set flumen.worker_binary or FLUMEN_WORKER_BIN"
                    .into(),
            ));
        }
        exe
    };
    Ok(WorkerProgram {
        executable,
        leading_args,
    })
}
