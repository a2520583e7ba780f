//! How a bench ends: it exits non-zero when an answer differs from its reference or an
//! engine that must run failed (always), and, with `--check`, when a goal it prints was
//! missed or could not be measured (a skipped part counts as missed). The bench reports
//! each as it finds it ([`fail`], [`goal`], [`not_measured`]) and calls [`finish`] last.

#![allow(dead_code)]

use std::sync::Mutex;

/// What the run found so far: failures (answers, engines) and misses (goals, parts not
/// measured).
static FOUND: Mutex<(Vec<String>, Vec<String>)> = Mutex::new((Vec::new(), Vec::new()));

/// An answer differed or an engine failed: the run fails.
pub fn fail(what: impl Into<String>) {
    let what = what.into();
    println!("FAILED: {what}");
    FOUND.lock().unwrap().0.push(what);
}

/// Goal `name` was met or not; returns the word to print (`met` / `NOT met`).
pub fn goal(name: &str, met: bool) -> &'static str {
    if met {
        return "met";
    }
    FOUND.lock().unwrap().1.push(name.to_string());
    "NOT met"
}

/// A part the goals need was not measured (`why`): a miss under `--check`.
pub fn not_measured(what: &str, why: &str) {
    println!("not measured: {what}: {why}");
    FOUND
        .lock()
        .unwrap()
        .1
        .push(format!("{what} (not measured: {why})"));
}

/// Whether `--check` is among the process's arguments.
pub fn checking() -> bool {
    std::env::args().any(|a| a == "--check")
}

/// Print the outcome and end the run: exit status 1 on a failure, or on a miss under
/// `--check`.
pub fn finish() {
    let (failures, misses) = std::mem::take(&mut *FOUND.lock().unwrap());
    if !misses.is_empty() {
        println!("goals missed: {}", misses.join("; "));
    }
    if !failures.is_empty() {
        println!("bench FAILED: {}", failures.join("; "));
        std::process::exit(1);
    }
    if checking() && !misses.is_empty() {
        println!("bench FAILED under --check: a goal was missed");
        std::process::exit(1);
    }
    println!(
        "bench finished: every answer checked{}",
        if checking() { ", every goal met" } else { "" }
    );
}
