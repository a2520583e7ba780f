//! What a test does when it cannot run here: a missing tool (moto, deltalake, pyiceberg,
//! NVRTC) fails the test under CI and says `skipped: <why>` elsewhere; a missing CUDA device
//! is always a plain skip (no CI machine has one). Every skip is also appended to
//! `$FLUMEN_SKIP_LOG` when set, which is how `.ci/run` counts them.
//!
//! Also [`alone_in_a_process`], for a unit test that measures the whole process.

#![allow(dead_code)]

use std::io::Write;

/// True when a missing tool must fail its test: `CI` set (to anything but `false` or `0`),
/// or `FLUMEN_REQUIRE_TOOLS=1`.
pub fn tools_required() -> bool {
    let set = |name: &str| {
        std::env::var(name)
            .map(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
            .unwrap_or(false)
    };
    set("CI") || set("FLUMEN_REQUIRE_TOOLS")
}

/// A tool the test needs is missing: panics with `why` under CI (see [`tools_required`]),
/// otherwise says `skipped: <why>` and records the skip. The caller returns after it.
pub fn skip_missing_tool(why: &str) {
    if tools_required() {
        panic!("required test tool missing (CI=true or FLUMEN_REQUIRE_TOOLS=1): {why}");
    }
    record("tool", why);
}

/// The test needs a CUDA device and none answers: says `skipped: <why>` and records it.
pub fn skip_no_device(why: &str) {
    record("device", why);
}

/// Straight to the process's stderr, which the test harness does not capture (it captures
/// `println!`), and one line `KIND<TAB>WHY` in `$FLUMEN_SKIP_LOG`.
fn record(kind: &str, why: &str) {
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
    if let Some(log) = std::env::var_os("FLUMEN_SKIP_LOG") {
        let line = format!("{kind}\t{}\n", why.replace('\n', " "));
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = file.write_all(line.as_bytes());
        }
    }
}

/// For a unit test that measures the whole process (what it maps, its peak memory), which
/// other tests running on the harness's threads would disturb: `true` in a process of this
/// test binary started to run only `test` (by its full path), where the caller goes on with
/// its checks; `false` after such a process ran and passed (its output printed), where the
/// caller returns. Panics with that process's output when it failed.
pub fn alone_in_a_process(test: &str) -> bool {
    const ALONE: &str = "FLUMEN_TEST_ALONE";
    if std::env::var_os(ALONE).is_some_and(|t| t == test) {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ALONE, test)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{test} in a process of its own:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{text}");
    false
}
