//! Finding workers through the Kubernetes API (`flumen.cluster =
//! 'k8s://NAMESPACE/LABEL-SELECTOR'`): the driver lists the pods the selector picks (with
//! the in-cluster service account, or the user's kubeconfig outside a cluster) and attaches
//! to every ready one. A pod with a `subdomain` (a headless Service) is dialled by its DNS
//! name, `HOSTNAME.SUBDOMAIN.NAMESPACE.svc`, which a wildcard certificate covers; one
//! without, by its IP. The port is the container port named [`PORT_NAME`], else
//! [`DEFAULT_PORT`]. Manifests to apply: `docs/kubernetes/`.

use datafusion::error::{DataFusionError, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

/// The name of a worker container's port.
pub const PORT_NAME: &str = "flumen";

/// The port a worker pod listens on when its container names none.
pub const DEFAULT_PORT: u16 = 7100;

/// `host:port` of every ready worker pod in `namespace` matching `selector`.
pub async fn worker_addresses(namespace: &str, selector: &str) -> Result<Vec<String>> {
    let failed = |what: &str, e: kube::Error| {
        DataFusionError::Execution(format!(
            "flumen.cluster k8s://{namespace}/{selector}: {what}: {e}"
        ))
    };
    let client = client()
        .await
        .map_err(|e| failed("no Kubernetes API (in-cluster account or kubeconfig)", e))?;
    let pods: Api<Pod> = Api::namespaced(client, namespace);
    let list = pods
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(|e| failed("cannot list the worker pods", e))?;
    Ok(list.items.iter().filter_map(pod_address).collect())
}

/// One client per process (it keeps its connections).
async fn client() -> std::result::Result<kube::Client, kube::Error> {
    static CLIENT: tokio::sync::OnceCell<kube::Client> = tokio::sync::OnceCell::const_new();
    // Both of rustls's crypto providers are linked in: name one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    CLIENT
        .get_or_try_init(kube::Client::try_default)
        .await
        .cloned()
}

/// Where the worker of a running, ready `pod` listens; `None` for any other pod.
pub fn pod_address(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if status.phase.as_deref() != Some("Running") || !ready {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    let port = spec
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(PORT_NAME))
        .and_then(|p| u16::try_from(p.container_port).ok())
        .unwrap_or(DEFAULT_PORT);
    let host = match &spec.subdomain {
        Some(subdomain) => {
            let name = spec.hostname.as_ref().or(pod.metadata.name.as_ref())?;
            let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
            format!("{name}.{subdomain}.{namespace}.svc")
        }
        None => status.pod_ip.clone()?,
    };
    Some(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn ready_pods_are_dialled_by_dns_name_or_ip_and_others_skipped() {
        let ready = serde_json::json!({
            "phase": "Running", "podIP": "10.4.0.7",
            "conditions": [{"type": "Ready", "status": "True"}]
        });
        let named = pod(serde_json::json!({
            "metadata": {"name": "cpu-7d9-x2", "namespace": "ml"},
            "spec": {"subdomain": "flumen-workers", "containers": [
                {"name": "worker", "ports": [{"name": "flumen", "containerPort": 7300}]}]},
            "status": ready
        }));
        assert_eq!(
            pod_address(&named).as_deref(),
            Some("cpu-7d9-x2.flumen-workers.ml.svc:7300")
        );
        let by_ip = pod(serde_json::json!({
            "metadata": {"name": "w"},
            "spec": {"containers": [{"name": "worker"}]},
            "status": ready
        }));
        assert_eq!(pod_address(&by_ip).as_deref(), Some("10.4.0.7:7100"));
        let starting = pod(serde_json::json!({
            "metadata": {"name": "w"},
            "spec": {"containers": [{"name": "worker"}]},
            "status": {"phase": "Running", "podIP": "10.4.0.8",
                       "conditions": [{"type": "Ready", "status": "False"}]}
        }));
        assert_eq!(pod_address(&starting), None);
    }
}
