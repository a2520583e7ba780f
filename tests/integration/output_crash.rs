//! Output that survives a crash at any instant: a real `flumen` driver writing
//! `COPY ... TO` a partitioned directory is killed with SIGKILL at seeded instants (and at
//! the instant its commit marker appears); after recovery the output is the old state (none)
//! or the whole new one, never a part, with the clean run's rows (every column compared),
//! and a rerun of a statement that did not commit writes every row exactly once. A kill
//! that lands after the statement finished does not count: that run is tried again with an
//! earlier instant. A cancelled in-process `COPY` leaves no staging behind.

use crate::common;

use std::path::Path;

use common::files_below;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::prelude::{ParquetReadOptions, SessionContext};
use object_store::ObjectStore;
use object_store::local::LocalFileSystem;

const FLUMEN: &str = env!("CARGO_BIN_EXE_flumen");

fn copy_sql(input: &Path, output: &Path) -> String {
    format!(
        "COPY (SELECT id, k, v, body FROM '{}/') TO '{}/' STORED AS PARQUET PARTITIONED BY (k)",
        input.display(),
        output.display()
    )
}

fn flumen_copy(input: &Path, output: &Path) -> std::process::Child {
    Command::new(FLUMEN)
        .args(["--no-demo", "--quiet", "-c", &copy_sql(input, output)])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn is_staging(path: &Path) -> bool {
    path.components()
        .any(|c| c.as_os_str().to_string_lossy().contains("flumen-staging"))
}

/// Rows and distinct ids of the visible Parquet files below `dir` (0 when there are none).
async fn visible_rows(dir: &Path) -> (usize, usize) {
    let visible = files_below(dir)
        .into_iter()
        .filter(|f| !is_staging(f) && f.extension().is_some_and(|e| e == "parquet"))
        .count();
    if visible == 0 {
        return (0, 0);
    }
    let ctx = SessionContext::new();
    ctx.register_parquet("o", dir.to_str().unwrap(), ParquetReadOptions::default())
        .await
        .unwrap();
    let batches = ctx
        .sql("SELECT count(*), count(DISTINCT id) FROM o")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let column = |i: usize| {
        batches[0]
            .column(i)
            .as_any()
            .downcast_ref::<datafusion::arrow::array::Int64Array>()
            .unwrap()
            .value(0) as usize
    };
    (column(0), column(1))
}

/// Whether the visible rows below `dir` are exactly those below `reference` (every column
/// of every row, whatever the files), both read as partitioned Parquet directories.
async fn same_contents(dir: &Path, reference: &Path) -> bool {
    let ctx = SessionContext::new();
    // `k` is the directories' partition column (`k=3/...`).
    let options = ParquetReadOptions::default().table_partition_cols(vec![(
        "k".to_string(),
        datafusion::arrow::datatypes::DataType::Int64,
    )]);
    for (name, path) in [("o", dir), ("r", reference)] {
        ctx.register_parquet(name, path.to_str().unwrap(), options.clone())
            .await
            .unwrap();
    }
    let rows_only_in = |a: &str, b: &str| {
        format!(
            "SELECT count(*) FROM (SELECT id, k, v, body FROM {a} \
             EXCEPT ALL SELECT id, k, v, body FROM {b})"
        )
    };
    for sql in [rows_only_in("o", "r"), rows_only_in("r", "o")] {
        let batches = ctx.sql(&sql).await.unwrap().collect().await.unwrap();
        let extra = batches[0]
            .column(0)
            .as_any()
            .downcast_ref::<datafusion::arrow::array::Int64Array>()
            .unwrap()
            .value(0);
        if extra != 0 {
            return false;
        }
    }
    true
}

async fn recover(dir: &Path) -> (usize, usize) {
    let store: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new());
    let target = object_store::path::Path::from_absolute_path(dir).unwrap();
    flumen::io::output_commit::recover_output(&store, &target, None, true)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_killed_at_any_instant_leaves_the_old_output_or_the_whole_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input");
    common::write_events(&input, 4, 50_000);
    let rows = 200_000;

    // A clean run: how long a COPY takes, and what it writes.
    let clean = dir.path().join("clean");
    let started = Instant::now();
    assert!(flumen_copy(&input, &clean).wait().unwrap().success());
    let took = started.elapsed();
    assert_eq!(visible_rows(&clean).await, (rows, rows));
    println!("clean COPY: {took:?}, {} files", files_below(&clean).len());

    let mut seeded = common::Seeded(19);
    let mut matrix = vec![];
    for run in 0..16 {
        let out = dir.path().join(format!("out-{run}"));
        // 12 kills at seeded instants over the whole statement, 4 at the commit decision.
        let at_marker = run >= 12;
        let mut instant = took.mul_f64(0.05 + 1.1 * seeded.next());
        // The kill must land while the statement writes: when the statement finished
        // first (the instant fell after its end), it runs again with an earlier instant.
        let mut attempts = 0;
        let killed_after = loop {
            attempts += 1;
            let _ = std::fs::remove_dir_all(&out);
            let mut child = flumen_copy(&input, &out);
            let started = Instant::now();
            common::kill_when(&mut child, "COPY", || {
                if at_marker {
                    files_below(&out)
                        .iter()
                        .any(|f| f.ends_with(flumen::io::output_commit::COMMIT_MARKER))
                } else {
                    started.elapsed() >= instant
                }
            });
            let status = child.wait().unwrap();
            if !status.success() {
                break started.elapsed();
            }
            assert!(
                attempts < 8,
                "run {run}: the statement finished before every kill, 8 times"
            );
            instant = instant.mul_f64(0.6);
        };
        let staged_files = files_below(&out).iter().filter(|f| is_staging(f)).count();
        let (finished, deleted) = recover(&out).await;
        assert!(
            files_below(&out).iter().all(|f| !is_staging(f)),
            "run {run}: staging left after recovery"
        );
        let (seen, distinct) = visible_rows(&out).await;
        let state = match (seen, distinct) {
            (0, 0) => "old (none)",
            (n, d) if n == rows && d == rows => "whole new",
            _ => panic!("run {run}: a partial output after recovery: {seen} rows, {distinct} ids"),
        };
        if seen > 0 {
            assert!(
                same_contents(&out, &clean).await,
                "run {run}: the recovered output's rows are not the clean run's"
            );
        }
        let rerun = if seen == 0 {
            assert!(flumen_copy(&input, &out).wait().unwrap().success());
            assert!(
                same_contents(&out, &clean).await,
                "run {run}: the rerun's rows are not the clean run's"
            );
            "rerun: the clean run's rows, each once"
        } else {
            "no rerun needed"
        };
        matrix.push(format!(
            "| {run} | {} | {killed_after:.2?} | {attempts} | {staged_files} | {finished}/{deleted} | {state} | {rerun} |",
            if at_marker { "commit marker" } else { "seeded" },
        ));
    }
    println!(
        "| run | instant | killed after | attempts (to land mid-write) | staged files left | commits finished/staging deleted | state after recovery | rerun |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for line in &matrix {
        println!("{line}");
    }
}

/// A `COPY` cancelled in process (its future dropped mid-write) deletes what it staged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_copy_leaves_no_staging() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input");
    common::write_events(&input, 4, 50_000);
    let out = dir.path().join("out");
    let ctx = flumen::session(flumen::FlumenConfig::default()).enable_url_table();
    let sql = copy_sql(&input, &out);
    let copy = tokio::spawn(async move { ctx.sql(&sql).await?.collect().await });
    let started = Instant::now();
    while !files_below(&out).iter().any(|f| is_staging(f)) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "nothing staged"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    copy.abort();
    let _ = copy.await;
    let cancelled = Instant::now();
    while files_below(&out).iter().any(|f| is_staging(f)) {
        assert!(
            cancelled.elapsed() < Duration::from_secs(10),
            "staging left after the cancel: {:?}",
            files_below(&out)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (seen, distinct) = visible_rows(&out).await;
    assert!(
        seen == 0 || (seen == 200_000 && distinct == 200_000),
        "{seen} rows visible after a cancel"
    );
}

/// Planted links where staging lives: a `.flumen-staging-*` directory that is a link to a
/// directory elsewhere (with a commit marker, and without), one that holds a link, and a
/// staged single file that is a link to a file elsewhere. Recovery (run by the next `COPY`
/// to the same place) follows none of them: every target file survives with its bytes, none
/// is moved into the output, the links stay as they are (an operator's to look at), and the
/// `COPY` writes its rows as usual; in threads mode and with worker processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_staging_links_are_never_followed() {
    for config in [
        flumen::FlumenConfig::default(),
        common::in_worker_processes(2),
    ] {
        planted_links_survive_a_copy(config).await;
    }
}

/// The planted links of [`planted_staging_links_are_never_followed`], and two `COPY`s in a
/// session of `config` (threads, or worker processes).
async fn planted_links_survive_a_copy(config: flumen::FlumenConfig) {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::create_dir_all(victim.join("sub")).unwrap();
    for name in ["a.parquet", "sub/b.parquet", "_flumen_commit"] {
        std::fs::write(victim.join(name), format!("precious {name}")).unwrap();
    }
    let lone = dir.path().join("lone.parquet");
    std::fs::write(&lone, "precious lone").unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    // Ids of a dead writer on this host's format and of no known writer: both would be
    // recovered at once were they not links.
    symlink(&victim, out.join(".flumen-staging-0-1-2-3-4")).unwrap();
    symlink(victim.join("sub"), out.join(".flumen-staging-dead")).unwrap();
    std::fs::create_dir(out.join(".flumen-staging-holder")).unwrap();
    symlink(&victim, out.join(".flumen-staging-holder/inside")).unwrap();
    symlink(&lone, out.join(".one.parquet.flumen-staging-0-1-2-3-4")).unwrap();

    // A Parquet input, so that in worker mode the scan's tasks run on the workers.
    let input = dir.path().join("input");
    common::write_events(&input, 1, 3);
    let ctx = flumen::session(config).enable_url_table();
    let copy = |to: String| {
        let (ctx, input) = (ctx.clone(), input.clone());
        async move {
            ctx.sql(&format!(
                "COPY (SELECT id FROM '{}/') TO '{to}' STORED AS PARQUET",
                input.display()
            ))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap()
        }
    };
    copy(format!("{}/", out.display())).await;
    copy(format!("{}/one.parquet", out.display())).await;

    for name in ["a.parquet", "sub/b.parquet", "_flumen_commit"] {
        assert_eq!(
            std::fs::read_to_string(victim.join(name)).unwrap(),
            format!("precious {name}"),
            "{name} behind a planted link was touched"
        );
    }
    assert_eq!(std::fs::read_to_string(&lone).unwrap(), "precious lone");
    // Nothing of the victim's was moved into the output.
    assert!(!out.join("a.parquet").exists() && !out.join("sub").exists());
    // The links planted as staging directories are left as they are.
    for link in [".flumen-staging-0-1-2-3-4", ".flumen-staging-dead"] {
        let meta = std::fs::symlink_metadata(out.join(link)).unwrap();
        assert!(meta.file_type().is_symlink(), "{link}");
    }
    let ctx = SessionContext::new().enable_url_table();
    for written in [
        format!("{}/", out.display()),
        format!("{}/one.parquet", out.display()),
    ] {
        let rows = ctx
            .sql(&format!("SELECT count(*) FROM '{written}'"))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let count = rows[0].column(0).as_any();
        let count = count
            .downcast_ref::<datafusion::arrow::array::Int64Array>()
            .unwrap();
        // The directory holds both statements' files.
        assert!(count.value(0) >= 3, "{written}: {} rows", count.value(0));
    }
}
