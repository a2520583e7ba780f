//! What a test does when it cannot run here: a missing tool (moto, deltalake, pyiceberg,
//! NVRTC) fails the test under CI and says `skipped: <why>` elsewhere; a missing CUDA device
//! is always a plain skip (no CI machine has one). Every skip is also appended to
//! `$FLUMEN_SKIP_LOG` when set, which is how `.ci/run` counts them.

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
