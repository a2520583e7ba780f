//! Delta inserts that hold under failure: an insert that fails deletes the data files it
//! wrote; an insert with an application transaction (`flumen.delta_app_id` +
//! `flumen.delta_txn_version`) is applied once however often it is rerun; and a real
//! `flumen` driver killed with SIGKILL at seeded instants of an `INSERT INTO` (and at the
//! instant its commit appears) leaves the table at its old version or the whole new one,
//! never a part, and a rerun of the same statement leaves every row exactly once.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::prelude::SessionContext;
use deltalake_core::kernel::StructType;
use deltalake_core::kernel::engine::arrow_conversion::TryIntoKernel;
use deltalake_core::table::config::TableProperty;
use flumen::FlumenConfig;
use flumen::io::DeltaVersion;

const FLUMEN: &str = env!("CARGO_BIN_EXE_flumen");

/// Create an empty Delta table `(id, k, v, body)` at `location`, writing data files of
/// about `target_file_size` bytes.
async fn create_table(location: &Path, target_file_size: u64) {
    let schema = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Float64, true),
        Field::new("body", DataType::Utf8, true),
    ]);
    let kernel: StructType = (&schema).try_into_kernel().unwrap();
    std::fs::create_dir_all(location).unwrap();
    let url = url::Url::from_directory_path(location).unwrap();
    let table = deltalake_core::DeltaTableBuilder::from_url(url)
        .unwrap()
        .build()
        .unwrap();
    table
        .create()
        .with_columns(kernel.fields().cloned())
        .with_configuration_property(
            TableProperty::TargetFileSize,
            Some(target_file_size.to_string()),
        )
        .await
        .unwrap();
}

/// A session with the Delta table at `location` registered as `t`.
async fn session_with(location: &Path) -> SessionContext {
    let ctx = flumen::session(FlumenConfig::default());
    flumen::io::register_delta_table(&ctx, "t", location.to_str().unwrap(), DeltaVersion::Latest)
        .await
        .unwrap();
    ctx
}

/// `count(*), count(DISTINCT id)` of the table at `location`, as a fresh reader sees it.
async fn rows_and_ids(location: &Path) -> (usize, usize) {
    let ctx = session_with(location).await;
    let got = common::first_row(&ctx, "SELECT count(*), count(DISTINCT id) FROM t").await;
    (got[0].parse().unwrap(), got[1].parse().unwrap())
}

/// The Parquet data files below `location` (not the log).
fn data_files(location: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() && !path.ends_with("_delta_log") {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                out.push(path);
            }
        }
    }
    let mut files = vec![];
    walk(location, &mut files);
    files.sort();
    files
}

/// An insert that fails after it wrote data files deletes them: the table keeps its rows
/// and its directory holds exactly the files it held before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_insert_leaves_no_data_file_behind() {
    let dir = tempfile::tempdir().unwrap();
    let location = dir.path().join("t");
    create_table(&location, 64 << 10).await;
    let ctx = session_with(&location).await;
    let good = "INSERT INTO t SELECT x, x % 16, x / 3.0, 'document ' || x \
                FROM generate_series(1, 50000) AS s(x)";
    assert_eq!(common::first_row(&ctx, good).await, vec!["50000"]);
    let before = data_files(&location);
    assert!(before.len() > 1, "small target files: {}", before.len());
    // Fails at row 45,000 (a NULL id, checked as rows reach the sink), after the writer has
    // written files for the rows before it (hashes: they do not compress away).
    let bad = "INSERT INTO t SELECT CASE WHEN x < 45000 THEN x END, x % 16, x / 3.0, \
               md5(CAST(x AS VARCHAR)) || md5(CAST(-x AS VARCHAR)) \
               FROM generate_series(1, 50000) AS s(x)";
    let err = common::try_collect(&ctx, bad)
        .await
        .unwrap_err()
        .to_string();
    println!("failed insert: {err}");
    assert!(
        err.contains("non-nullable") || err.contains("null"),
        "{err}"
    );
    assert!(err.contains("data files it wrote were deleted"), "{err}");
    assert_eq!(data_files(&location), before, "orphan data files were left");
    assert_eq!(rows_and_ids(&location).await, (50_000, 50_000));
}

/// With an application transaction set, an insert commits once: the same statement run
/// again (a job's retry) adds nothing, a new version of the app inserts again, and a
/// half-set transaction is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_with_an_app_transaction_is_applied_once() {
    let dir = tempfile::tempdir().unwrap();
    let location = dir.path().join("t");
    create_table(&location, 8 << 20).await;
    let ctx = session_with(&location).await;
    let insert = "INSERT INTO t SELECT x, x % 16, x / 3.0, 'document ' || x \
                  FROM generate_series(1, 1000) AS s(x)";
    ctx.sql("SET flumen.delta_app_id = 'nightly-embed'")
        .await
        .unwrap();
    ctx.sql("SET flumen.delta_txn_version = 7").await.unwrap();
    assert_eq!(common::first_row(&ctx, insert).await, vec!["1000"]);
    assert_eq!(
        common::first_row(&ctx, insert).await,
        vec!["0"],
        "a rerun of version 7"
    );
    assert_eq!(rows_and_ids(&location).await, (1000, 1000));
    // A fresh session (another driver) rerunning version 7 is skipped as well.
    let other = session_with(&location).await;
    other
        .sql("SET flumen.delta_app_id = 'nightly-embed'")
        .await
        .unwrap();
    other.sql("SET flumen.delta_txn_version = 7").await.unwrap();
    assert_eq!(common::first_row(&other, insert).await, vec!["0"]);
    ctx.sql("SET flumen.delta_txn_version = 8").await.unwrap();
    assert_eq!(
        common::first_row(&ctx, insert).await,
        vec!["1000"],
        "version 8 inserts"
    );
    assert_eq!(rows_and_ids(&location).await, (2000, 1000));
    // The transaction is in the log, as Delta's readers see it.
    let log =
        std::fs::read_to_string(location.join("_delta_log/00000000000000000002.json")).unwrap();
    assert!(
        log.contains(r#""txn":{"appId":"nightly-embed","version":8"#),
        "{log}"
    );

    let half = session_with(&location).await;
    half.sql("SET flumen.delta_txn_version = 9").await.unwrap();
    let err = common::try_collect(&half, insert)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("flumen.delta_app_id is not"), "{err}");
    assert_eq!(rows_and_ids(&location).await, (2000, 1000));
}

/// The `flumen` command running the statements of a job that inserts `input` into the
/// table at `location` as version 1 of application `crash-test`.
fn flumen_insert(location: &Path, input: &Path) -> std::process::Child {
    Command::new(FLUMEN)
        .args([
            "--no-demo",
            "--quiet",
            "-c",
            &format!(
                "CREATE EXTERNAL TABLE t STORED AS DELTATABLE LOCATION '{}'",
                location.display()
            ),
            "-c",
            "SET flumen.delta_app_id = 'crash-test'",
            "-c",
            "SET flumen.delta_txn_version = 1",
            "-c",
            &format!(
                "INSERT INTO t SELECT id, k, v, body FROM '{}/'",
                input.display()
            ),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Copy directory `from` to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_insert_killed_at_any_instant_is_old_or_whole_and_a_rerun_adds_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input");
    common::write_events(&input, 4, 200_000);
    let new_rows = 800_000;
    // The table before the job: version 0 (empty) and version 1 (1,000 older rows).
    let template = dir.path().join("template");
    create_table(&template, 1 << 20).await;
    let ctx = session_with(&template).await;
    let base = "INSERT INTO t SELECT -x, 0, 0.0, 'older' FROM generate_series(1, 1000) AS s(x)";
    assert_eq!(common::first_row(&ctx, base).await, vec!["1000"]);
    let old = (1000, 1000);
    let whole = (1000 + new_rows, 1000 + new_rows);
    let commit = "_delta_log/00000000000000000002.json";

    // Clean runs: how long the job takes (the shortest of three, so that the seeded
    // instants fall inside a job rather than after it).
    let mut took = Duration::MAX;
    for clean_run in 0..3 {
        let clean = dir.path().join(format!("clean-{clean_run}"));
        copy_dir(&template, &clean);
        let started = Instant::now();
        let out = flumen_insert(&clean, &input).wait_with_output().unwrap();
        took = took.min(started.elapsed());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(rows_and_ids(&clean).await, whole);
        println!(
            "clean job: {:?}, {} data files",
            started.elapsed(),
            data_files(&clean).len()
        );
    }
    let mut seeded = common::Seeded(20);
    let mut matrix = vec![];
    for run in 0..16 {
        let table = dir.path().join(format!("t-{run}"));
        copy_dir(&template, &table);
        let mut child = flumen_insert(&table, &input);
        let started = Instant::now();
        // 12 kills at seeded instants over the whole job, 4 as its commit appears.
        let at_commit = run >= 12;
        let instant = took.mul_f64(0.05 + 0.95 * seeded.next());
        common::kill_when(&mut child, "the job", || {
            if at_commit {
                table.join(commit).exists()
            } else {
                started.elapsed() >= instant
            }
        });
        let status = child.wait().unwrap();
        let killed_after = started.elapsed();
        let seen = rows_and_ids(&table).await;
        let state = match seen {
            s if s == old => "old",
            s if s == whole => "whole new",
            (n, d) => panic!("run {run}: a partial table after the kill: {n} rows, {d} ids"),
        };
        let files_after_kill = data_files(&table).len();
        // The job's retry: the same statements, the same transaction.
        let rerun = flumen_insert(&table, &input).wait_with_output().unwrap();
        assert!(
            rerun.status.success(),
            "{}",
            String::from_utf8_lossy(&rerun.stderr)
        );
        assert_eq!(
            rows_and_ids(&table).await,
            whole,
            "run {run}: after the rerun every row must be there exactly once"
        );
        matrix.push(format!(
            "| {run} | {} | {killed_after:.2?} | {} | {state} | {files_after_kill} | every row once |",
            if at_commit { "commit appears" } else { "seeded" },
            if status.success() { "finished first" } else { "SIGKILL" },
        ));
    }
    println!(
        "| run | instant | killed after | driver | table after the kill | data files | after the rerun |"
    );
    println!("|---|---|---|---|---|---|---|");
    for line in &matrix {
        println!("{line}");
    }
}
