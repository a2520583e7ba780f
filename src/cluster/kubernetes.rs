//! Finding workers through the Kubernetes API (`flumen.cluster =
//! 'k8s://NAMESPACE/LABEL-SELECTOR'`): the driver lists the pods the selector picks (with
//! the in-cluster service account, or the user's kubeconfig outside a cluster) and attaches
//! to every ready one. A pod with a `subdomain` (a headless Service) is dialled by its DNS
//! name, `HOSTNAME.SUBDOMAIN.NAMESPACE.svc`, which a wildcard certificate covers; one
//! without, by its IP. The port is the container port named [`PORT_NAME`], else
//! [`DEFAULT_PORT`]; a pod with several workers (one container per GPU of its node) names
//! each one's port `flumen-...` (e.g. `flumen-gpu3`), and each is a worker. Manifests to
//! apply: `docs/kubernetes/`.

use datafusion::error::{DataFusionError, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

/// The name of a worker container's port; `flumen-...` names one of several in a pod.
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
    Ok(list.items.iter().flat_map(pod_addresses).collect())
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

/// Where the workers of a running, ready `pod` listen: each container port named `flumen`
/// or `flumen-...`, else the pod's [`DEFAULT_PORT`]; none for any other pod.
pub fn pod_addresses(pod: &Pod) -> Vec<String> {
    worker_endpoints(pod).unwrap_or_default()
}

fn worker_endpoints(pod: &Pod) -> Option<Vec<String>> {
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
    let mut ports: Vec<u16> = spec
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .filter(|p| {
            p.name.as_deref().is_some_and(|name| {
                name == PORT_NAME
                    || name
                        .strip_prefix(PORT_NAME)
                        .is_some_and(|rest| rest.starts_with('-'))
            })
        })
        .filter_map(|p| u16::try_from(p.container_port).ok())
        .collect();
    if ports.is_empty() {
        ports.push(DEFAULT_PORT);
    }
    let host = match &spec.subdomain {
        Some(subdomain) => {
            let name = spec.hostname.as_ref().or(pod.metadata.name.as_ref())?;
            let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
            format!("{name}.{subdomain}.{namespace}.svc")
        }
        None => status.pod_ip.clone()?,
    };
    Some(ports.iter().map(|port| format!("{host}:{port}")).collect())
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
            pod_addresses(&named),
            ["cpu-7d9-x2.flumen-workers.ml.svc:7300"]
        );
        let by_ip = pod(serde_json::json!({
            "metadata": {"name": "w"},
            "spec": {"containers": [{"name": "worker"}]},
            "status": ready
        }));
        assert_eq!(pod_addresses(&by_ip), ["10.4.0.7:7100"]);
        let starting = pod(serde_json::json!({
            "metadata": {"name": "w"},
            "spec": {"containers": [{"name": "worker"}]},
            "status": {"phase": "Running", "podIP": "10.4.0.8",
                       "conditions": [{"type": "Ready", "status": "False"}]}
        }));
        assert!(pod_addresses(&starting).is_empty());
        // A GPU node's pod: a worker container per GPU, each port named flumen-...; other
        // ports (metrics) are not workers.
        let gpus = pod(serde_json::json!({
            "metadata": {"name": "gpu-x"},
            "spec": {"containers": [
                {"name": "gpu0", "ports": [{"name": "flumen-gpu0", "containerPort": 7100}]},
                {"name": "gpu1", "ports": [{"name": "flumen-gpu1", "containerPort": 7101},
                                           {"name": "metrics", "containerPort": 9100}]},
                {"name": "sidecar", "ports": [{"name": "flumenx", "containerPort": 9200}]}]},
            "status": ready
        }));
        assert_eq!(pod_addresses(&gpus), ["10.4.0.7:7100", "10.4.0.7:7101"]);
    }
}
