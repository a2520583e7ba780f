//! Which running workers a driver attaches to (`flumen.cluster`, `flumen --cluster`).
//!
//! Workers on other hosts are long-lived node agents (`flumen worker --listen ADDR`, started
//! by hand, systemd or a pod); a driver attached to a cluster starts none itself. It finds
//! them from a [`ClusterSpec`], again every [`DISCOVER_EVERY`] while its pools live, so a
//! worker that starts (or comes back) later joins them. Every call carries the cluster's
//! secret, read from a file only its owner can read; off loopback the workers speak TLS,
//! and the driver checks their certificates against the cluster's CA.

use std::path::{Path, PathBuf};
use std::time::Duration;

use datafusion::error::{DataFusionError, Result};
use serde::Deserialize;

use crate::cluster::auth::Secret;
use crate::cluster::tls::WorkerTrust;
use crate::config::FlumenConfig;

/// How often an attached pool looks for workers that joined (or came back).
pub const DISCOVER_EVERY: Duration = Duration::from_secs(1);

/// Where a driver finds its workers (the value of `flumen.cluster`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterSpec {
    /// `host:port,host:port,...`: a fixed list.
    Addresses(Vec<String>),
    /// A TOML file (`workers = ["host:port", ...]`, optional `secret_file` and `ca`),
    /// re-read at every discovery, so a line added joins a worker.
    File(PathBuf),
    /// `k8s://NAMESPACE/LABEL-SELECTOR`: the pods the Kubernetes API lists.
    Kubernetes {
        /// The pods' namespace.
        namespace: String,
        /// The label selector that picks the worker pods.
        selector: String,
    },
}

impl ClusterSpec {
    /// Read a `flumen.cluster` value.
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        if let Some(rest) = text.strip_prefix("k8s://") {
            let (namespace, selector) = rest.split_once('/').unwrap_or((rest, ""));
            if namespace.is_empty() || selector.is_empty() {
                return Err(cluster_error(format!(
                    "'{text}' is not k8s://NAMESPACE/LABEL-SELECTOR"
                )));
            }
            return Ok(Self::Kubernetes {
                namespace: namespace.into(),
                selector: selector.into(),
            });
        }
        if text.ends_with(".toml") || Path::new(text).is_file() {
            return Ok(Self::File(PathBuf::from(text)));
        }
        let addresses: Vec<String> = text
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(String::from)
            .collect();
        if addresses.is_empty() {
            return Err(cluster_error("no worker address given".into()));
        }
        for address in &addresses {
            check_address(address)?;
        }
        Ok(Self::Addresses(addresses))
    }

    /// The workers' addresses now.
    pub async fn addresses(&self) -> Result<Vec<String>> {
        match self {
            Self::Addresses(list) => Ok(list.clone()),
            Self::File(path) => {
                let file = ClusterFile::read(path)?;
                for address in &file.workers {
                    check_address(address)?;
                }
                Ok(file.workers)
            }
            #[cfg(feature = "kubernetes")]
            Self::Kubernetes {
                namespace,
                selector,
            } => crate::cluster::kubernetes::worker_addresses(namespace, selector).await,
            #[cfg(not(feature = "kubernetes"))]
            Self::Kubernetes { namespace, .. } => Err(cluster_error(format!(
                "k8s://{namespace}/...: this flumen was built without its `kubernetes` \
                 feature; list the workers' addresses or a cluster file instead"
            ))),
        }
    }
}

/// A cluster file as written (`flumen --cluster workers.toml`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    /// `host:port` of each worker.
    #[serde(default)]
    workers: Vec<String>,
    /// The cluster's secret file (relative to the cluster file's folder).
    secret_file: Option<PathBuf>,
    /// The CA the workers' certificates chain to (relative to the cluster file's folder).
    ca: Option<PathBuf>,
}

impl ClusterFile {
    fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            cluster_error(format!("cannot read cluster file {}: {e}", path.display()))
        })?;
        let mut file: ClusterFile = toml::from_str(&text).map_err(|e| {
            cluster_error(format!("cluster file {}: {}", path.display(), e.message()))
        })?;
        let folder = path.parent().unwrap_or(Path::new("."));
        file.secret_file = file.secret_file.map(|p| folder.join(p));
        file.ca = file.ca.map(|p| folder.join(p));
        Ok(file)
    }
}

/// What a driver needs to attach to a cluster: where its workers are, and how to talk to
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSettings {
    /// Where the workers are.
    pub spec: ClusterSpec,
    /// The file holding the cluster's secret (`flumen.cluster_secret_file`).
    pub secret_file: PathBuf,
    /// The CA the workers' certificates chain to (`flumen.worker_ca`); `None`: plaintext,
    /// allowed to loopback addresses only.
    pub ca: Option<PathBuf>,
}

impl ClusterSettings {
    /// The cluster `config` names; `None` when `flumen.cluster` is empty (workers are
    /// processes this driver starts). A cluster file may name the secret file and CA the
    /// settings leave empty.
    pub fn from_config(config: &FlumenConfig) -> Result<Option<Self>> {
        if config.cluster.trim().is_empty() {
            return Ok(None);
        }
        let spec = ClusterSpec::parse(&config.cluster)?;
        let from_file = match &spec {
            ClusterSpec::File(path) => ClusterFile::read(path)?,
            _ => ClusterFile::default(),
        };
        let setting = |value: &str| (!value.trim().is_empty()).then(|| PathBuf::from(value.trim()));
        let secret_file = setting(&config.cluster_secret_file)
            .or(from_file.secret_file)
            .ok_or_else(|| {
                cluster_error(
                    "a cluster needs its secret: set flumen.cluster_secret_file to the file \
                     (64 hex digits, mode 0600) its workers were started with"
                        .into(),
                )
            })?;
        Ok(Some(Self {
            spec,
            secret_file,
            ca: setting(&config.worker_ca).or(from_file.ca),
        }))
    }

    /// The cluster's secret and the trust its workers' certificates are checked with.
    pub fn credentials(&self) -> Result<(Secret, Option<WorkerTrust>)> {
        let secret = Secret::from_file(&self.secret_file)?;
        let trust = self.ca.as_deref().map(WorkerTrust::from_file).transpose()?;
        Ok((secret, trust))
    }

    /// Check that a worker at `address` can be talked to safely: off loopback, only in TLS.
    pub fn check_reachable(&self, address: &str) -> Result<()> {
        if self.ca.is_none() && !is_loopback(address) {
            return Err(cluster_error(format!(
                "worker {address} is not on loopback, and workers off loopback speak TLS: set \
                 flumen.worker_ca to the CA their certificates chain to"
            )));
        }
        Ok(())
    }
}

/// The host part of a worker's `host:port`.
pub fn host_of(address: &str) -> String {
    address
        .rsplit_once(':')
        .map_or(address, |(host, _)| host)
        .to_string()
}

/// Whether `address` (`host:port`) names this host's loopback.
fn is_loopback(address: &str) -> bool {
    let host = host_of(address);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A worker address must be `host:port`.
fn check_address(address: &str) -> Result<()> {
    match address.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
            Ok(())
        }
        _ => Err(cluster_error(format!(
            "'{address}' is not a worker address (host:port)"
        ))),
    }
}

fn cluster_error(message: String) -> DataFusionError {
    DataFusionError::Configuration(format!("flumen.cluster: {message}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        assert_eq!(
            ClusterSpec::parse("10.0.0.2:7000, 10.0.0.3:7000").unwrap(),
            ClusterSpec::Addresses(vec!["10.0.0.2:7000".into(), "10.0.0.3:7000".into()])
        );
        assert_eq!(
            ClusterSpec::parse("k8s://ml/app=flumen-worker").unwrap(),
            ClusterSpec::Kubernetes {
                namespace: "ml".into(),
                selector: "app=flumen-worker".into()
            }
        );
        let bad = ClusterSpec::parse("10.0.0.2").unwrap_err().to_string();
        assert!(bad.contains("not a worker address"), "{bad}");
        let bad = ClusterSpec::parse("k8s://ml").unwrap_err().to_string();
        assert!(bad.contains("k8s://NAMESPACE/LABEL-SELECTOR"), "{bad}");
    }

    #[test]
    fn a_cluster_file_names_workers_secret_and_ca_relative_to_itself() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("workers.toml");
        std::fs::write(
            &path,
            "workers = [\"10.0.0.2:7000\"]\nsecret_file = \"cluster.secret\"\nca = \"ca.pem\"\n",
        )
        .unwrap();
        let config = FlumenConfig {
            cluster: path.display().to_string(),
            ..Default::default()
        };
        let settings = ClusterSettings::from_config(&config).unwrap().unwrap();
        assert_eq!(settings.secret_file, dir.path().join("cluster.secret"));
        assert_eq!(settings.ca, Some(dir.path().join("ca.pem")));
        assert_eq!(
            futures::executor::block_on(settings.spec.addresses()).unwrap(),
            vec!["10.0.0.2:7000"]
        );
        std::fs::write(&path, "workers = [\"x\"]\n").unwrap();
        let bad = futures::executor::block_on(settings.spec.addresses())
            .unwrap_err()
            .to_string();
        assert!(bad.contains("'x' is not a worker address"), "{bad}");
        std::fs::write(&path, "worker = []\n").unwrap();
        let bad = futures::executor::block_on(settings.spec.addresses())
            .unwrap_err()
            .to_string();
        assert!(bad.contains("unknown field"), "{bad}");
    }

    #[test]
    fn plaintext_goes_to_loopback_only_and_a_cluster_needs_its_secret() {
        let config = FlumenConfig {
            cluster: "10.0.0.2:7000".into(),
            ..Default::default()
        };
        let missing = ClusterSettings::from_config(&config)
            .unwrap_err()
            .to_string();
        assert!(missing.contains("flumen.cluster_secret_file"), "{missing}");
        let config = FlumenConfig {
            cluster_secret_file: "/tmp/s".into(),
            ..config
        };
        let settings = ClusterSettings::from_config(&config).unwrap().unwrap();
        let refused = settings.check_reachable("10.0.0.2:7000").unwrap_err();
        assert!(
            refused.to_string().contains("flumen.worker_ca"),
            "{refused}"
        );
        settings.check_reachable("127.0.0.1:7000").unwrap();
        settings.check_reachable("localhost:7000").unwrap();
        settings.check_reachable("[::1]:7000").unwrap();
    }
}
