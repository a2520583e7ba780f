//! The Kubernetes manifests users apply (`docs/kubernetes/`). No cluster is available here,
//! so this checks what can be checked without one: every document parses as the typed
//! Kubernetes object its `kind` names and loses no field doing so (a misspelt field would
//! be dropped), the worker and driver pods run `flumen` with options it has, the CPU
//! worker's pod spec (a snapshot), and where the driver dials a ready worker pod.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, Pod, PodSpec, PodStatus, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde_json::Value;

const FLUMEN: &str = env!("CARGO_BIN_EXE_flumen");

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// The YAML documents of `file`, as JSON values.
fn documents(file: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(file).unwrap();
    text.split("\n---\n")
        .filter(|doc| {
            doc.lines()
                .any(|l| !l.trim().is_empty() && !l.starts_with('#'))
        })
        .map(|doc| {
            serde_saphyr::from_str::<Value>(doc)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        })
        .collect()
}

/// `doc` read as `T` and written back: the same JSON, or the field it lost.
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value, file: &Path) -> T {
    let object: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{}: {} does not parse: {e}", file.display(), doc["kind"]));
    let back = serde_json::to_value(&object).unwrap();
    assert_eq!(
        &back,
        doc,
        "{}: {} changed on a round trip through its type (a field it does not have?)",
        file.display(),
        doc["kind"]
    );
    object
}

/// Every pod spec of the manifests, by the name of the object holding it.
fn pod_specs() -> Vec<(String, PodSpec)> {
    let mut specs = vec![];
    for file in manifests() {
        for doc in documents(&file) {
            let name = doc["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            match doc["kind"].as_str().unwrap() {
                "Namespace" => drop(typed::<Namespace>(&doc, &file)),
                "Secret" => drop(typed::<Secret>(&doc, &file)),
                "Service" => drop(typed::<Service>(&doc, &file)),
                "ServiceAccount" => drop(typed::<ServiceAccount>(&doc, &file)),
                "Role" => drop(typed::<Role>(&doc, &file)),
                "RoleBinding" => drop(typed::<RoleBinding>(&doc, &file)),
                "ConfigMap" => drop(typed::<ConfigMap>(&doc, &file)),
                "Deployment" => {
                    let d: Deployment = typed(&doc, &file);
                    specs.push((name, d.spec.unwrap().template.spec.unwrap()));
                }
                "DaemonSet" => {
                    let d: DaemonSet = typed(&doc, &file);
                    specs.push((name, d.spec.unwrap().template.spec.unwrap()));
                }
                "Job" => {
                    let j: Job = typed(&doc, &file);
                    specs.push((name, j.spec.unwrap().template.spec.unwrap()));
                }
                other => panic!("{}: no check for kind {other}", file.display()),
            }
        }
    }
    specs
}

/// The options `flumen [subcommand] --help` lists.
fn options_of(subcommand: Option<&str>) -> String {
    let out = std::process::Command::new(FLUMEN)
        .args(subcommand)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_manifest_parses_as_its_kind_and_pods_use_real_options() {
    let specs = pod_specs();
    assert_eq!(
        specs.len(),
        4,
        "cpu workers, gpu workers (nodes of one GPU, of four), the driver job"
    );
    let (worker_help, driver_help) = (options_of(Some("worker")), options_of(None));
    let flumen_containers = specs.iter().flat_map(|(name, spec)| {
        let containers: Vec<_> = spec
            .containers
            .iter()
            .filter(|c| c.command.as_deref() == Some(&["flumen".to_string()]))
            .map(move |c| (name, spec, c))
            .collect();
        assert!(!containers.is_empty(), "{name}: no flumen container");
        containers
    });
    for (name, spec, container) in flumen_containers {
        let args = container.args.clone().unwrap_or_default();
        let help = if args.first().map(String::as_str) == Some("worker") {
            &worker_help
        } else {
            &driver_help
        };
        for option in args.iter().filter(|a| a.starts_with("--")) {
            let option = option.split('=').next().unwrap();
            assert!(
                help.contains(&format!("{option} ")) || help.contains(&format!("{option}\n")),
                "{name}: flumen has no option {option}"
            );
        }
        if args.first().map(String::as_str) == Some("worker") {
            assert_eq!(spec.subdomain.as_deref(), Some("flumen-workers"), "{name}");
            assert!(
                args.iter().any(|a| a.starts_with("--tls-cert=")),
                "{name}: no TLS"
            );
            assert!(
                args.iter().any(|a| a.starts_with("--secret-file=")),
                "{name}: no secret"
            );
        }
    }
}

#[test]
fn the_cpu_worker_pod_and_its_address() {
    let (_, spec) = pod_specs()
        .into_iter()
        .find(|(name, _)| name == "flumen-cpu-worker")
        .unwrap();
    insta::assert_snapshot!(
        "cpu_worker_pod_spec",
        serde_json::to_string_pretty(&spec).unwrap()
    );
    let pod = Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("flumen-cpu-worker-7c9f-x2k4p".into()),
            namespace: Some("flumen".into()),
            ..Default::default()
        },
        spec: Some(spec),
        status: Some(
            serde_json::from_value::<PodStatus>(serde_json::json!({
                "phase": "Running", "podIP": "10.8.1.5",
                "conditions": [{"type": "Ready", "status": "True"}]
            }))
            .unwrap(),
        ),
    };
    assert_eq!(
        flumen::cluster::kubernetes::pod_addresses(&pod),
        ["flumen-cpu-worker-7c9f-x2k4p.flumen-workers.flumen.svc:7100"]
    );
}

/// A four-GPU node's pod asks for all four GPUs, one per worker container, and the driver
/// dials each container's worker: four addresses, each on its own port.
#[test]
fn a_four_gpu_pod_asks_for_every_gpu_and_is_four_workers() {
    let (_, spec) = pod_specs()
        .into_iter()
        .find(|(name, _)| name == "flumen-gpu-worker-4")
        .unwrap();
    let gpus: u32 = spec
        .containers
        .iter()
        .filter_map(|c| c.resources.as_ref()?.limits.as_ref()?.get("nvidia.com/gpu"))
        .map(|q| q.0.parse::<u32>().unwrap())
        .sum();
    assert_eq!(gpus, 4);
    let pod = Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("flumen-gpu-worker-4-x7".into()),
            namespace: Some("flumen".into()),
            ..Default::default()
        },
        spec: Some(spec.clone()),
        status: Some(
            serde_json::from_value::<PodStatus>(serde_json::json!({
                "phase": "Running", "podIP": "10.8.2.9",
                "conditions": [{"type": "Ready", "status": "True"}]
            }))
            .unwrap(),
        ),
    };
    let addresses = flumen::cluster::kubernetes::pod_addresses(&pod);
    assert_eq!(
        addresses,
        (7100..7104)
            .map(|port| format!("flumen-gpu-worker-4-x7.flumen-workers.flumen.svc:{port}"))
            .collect::<Vec<_>>()
    );
    // Each worker listens where its port says.
    for container in &spec.containers {
        let port = container.ports.as_ref().unwrap()[0].container_port;
        let args = container.args.as_ref().unwrap();
        assert!(
            args.contains(&format!("--listen=0.0.0.0:{port}")),
            "{}: {args:?}",
            container.name
        );
    }
}
