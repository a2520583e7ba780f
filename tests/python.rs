//! flumen's Python module (`python/`) under pytest (`python/tests`), run with the
//! interpreter of `target/test-venv`, into which `python/install.sh` (part of the README's
//! test command) builds it with maturin. Under CI a module that was not built fails here,
//! and so does a pytest skip other than a GPU test's without a device.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_python_module_passes_its_pytest_suite() {
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
        return;
    }
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
