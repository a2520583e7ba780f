//! flumen's Python module (`python/`) under pytest (`python/tests`), run with the
//! interpreter of `target/test-venv`, into which `python/install.sh` (part of the README's
//! test command) builds it with maturin. Under CI a module that was not built fails here,
//! and so does a pytest skip other than a GPU test's without a device.

use crate::common;
use crate::common::hosts;

use std::path::Path;
use std::process::Command;

use hosts::{Role, TestNet};

/// The interpreter `python/install.sh` builds the module into, when flumen and pytest
/// import there; `None` after saying `skipped: ...` (failing under CI).
fn test_python() -> Option<std::path::PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = repo.join("target/test-venv/bin/python");
    let importable = Command::new(&python)
        .args(["-c", "import flumen, pytest"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !importable {
        common::skip_missing_tool(&format!(
            "flumen's Python module or pytest is not in {} (run `bash python/install.sh`)",
            python.display()
        ));
        return None;
    }
    Some(python)
}

#[test]
fn the_python_module_passes_its_pytest_suite() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Some(python) = test_python() else {
        return;
    };
    let out = Command::new(&python)
        .args([
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "python/tests",
        ])
        .current_dir(repo)
        .output()
        .expect("pytest runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "pytest failed:\n{stdout}");
    // pytest's skips (`-rs`: `SKIPPED [1] file:line: why`) count as this suite's: a GPU
    // test without a device is a plain skip; anything else is a missing tool.
    for line in stdout.lines().filter(|l| l.starts_with("SKIPPED")) {
        let why = format!("python/tests: {line}");
        if line.contains("CUDA") {
            common::skip_no_device(&why);
        } else {
            common::skip_missing_tool(&why);
        }
    }
}

/// `flumen.Session(cluster=...)` from Python against two namespace hosts, each running a CPU
/// and an accelerator worker started as `python -m flumen worker` (TLS, the cluster's
/// secret file): the driver's Python model and function ship to them and run there (the
/// pids they report are the hosts' workers'), and the answer equals calling them locally.
#[test]
fn a_python_session_runs_its_model_and_function_on_python_workers_of_two_hosts() {
    let Some(python) = test_python() else {
        return;
    };
    let mut net = match TestNet::new(2) {
        Ok(net) => net,
        Err(why) => {
            common::skip_missing_tool(&why);
            return;
        }
    };
    // `<python> -m flumen worker ...`, as the hosts' start-up would run it.
    let launcher = net.dir.path().join("flumen-python");
    std::fs::write(
        &launcher,
        format!("#!/bin/sh\nexec '{}' -m flumen \"$@\"\n", python.display()),
    )
    .unwrap();
    std::fs::set_permissions(
        &launcher,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut addresses = vec![];
    for host in ["h1", "h2"] {
        net.start_worker(host, Role::Cpu, &launcher, 2);
        net.start_worker(host, Role::Accelerator, &launcher, 1);
        addresses.push(net.address(host, Role::Cpu));
        addresses.push(net.address(host, Role::Accelerator));
    }
    let cluster_file = net.write_cluster_file(&addresses);
    let workdir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/drive_cluster.py");
    let out = Command::new("ip")
        .args(["netns", "exec", &net.host("driver").netns])
        .arg(&python)
        .arg(&script)
        .arg(&cluster_file)
        .arg(workdir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the Python driver failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    println!("{report}");
    assert_eq!(report["rows"], 12_000);
    assert_eq!(report["ids_in_order"], true);
    assert_eq!(report["lengths_equal"], true);
    let workers: Vec<u64> = ["h1", "h2"]
        .iter()
        .flat_map(|h| net.host(h).worker_pids())
        .map(u64::from)
        .collect();
    for key in ["model_pids", "function_pids"] {
        let pids: Vec<u64> = (report[key].as_array().unwrap().iter())
            .map(|p| p.as_u64().unwrap())
            .collect();
        assert!(
            !pids.is_empty() && pids.iter().all(|p| workers.contains(p)),
            "{key} {pids:?} are not all the hosts' workers {workers:?}"
        );
    }
}
