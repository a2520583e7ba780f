//! `table_changes` and `flumen extract --incremental` over a Delta table written and changed
//! by the Python `deltalake` writer (installed by `tests/install-test-tools.sh`), with the
//! real model: after each change the feature table equals a full recompute over the source
//! at that version, the model sees only the changed rows, and a run killed mid-way then
//! rerun leaves no duplicate.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use datafusion::arrow::array::{Array, AsArray, FixedSizeListArray, RecordBatch};
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Float32Type, Int64Type};
use datafusion::prelude::SessionContext;
use flumen::FlumenConfig;
use flumen::incremental::extract_incremental;

/// The `flumen` binary with its own cache directory under `dir` (so no model-output cache
/// from other runs: what a run computes, the model computes) and the installed model.
fn extract_command(dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_flumen"));
    command.env("XDG_CACHE_HOME", dir.join("cache-home")).env(
        "FLUMEN_MODEL_DIR",
        flumen::functions::embedding::model_files::model_dir(""),
    );
    command
}

/// The Python with the `deltalake` writer, or `None` (after reporting the skip).
fn writer_python() -> Option<String> {
    let python = std::env::var("FLUMEN_LAKEHOUSE_PYTHON").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-venv/bin/python").into()
    });
    let works = Command::new(&python)
        .args(["-c", "import deltalake"])
        .status()
        .is_ok_and(|s| s.success());
    if !works {
        common::skip_missing_tool(
            "the Python deltalake writer (target/test-venv: run tests/install-test-tools.sh)",
        );
        return None;
    }
    Some(python)
}

/// Run `tests/incremental/change_source.py` on the source at `path`; the version it left.
fn change_source(python: &str, path: &Path, args: &[&str]) -> u64 {
    let out = Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/incremental/change_source.py"
        ))
        .arg(path)
        .args(args)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "change_source.py {args:?} failed");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A feature table's rows by id: the other columns as text, and the embedding's bits.
type Features = BTreeMap<i64, (Vec<String>, Vec<u32>)>;

fn features_of(batches: &[RecordBatch]) -> Features {
    let mut rows = Features::new();
    for batch in batches {
        let ids = batch.column_by_name("id").unwrap();
        let ids = ids.as_primitive::<Int64Type>();
        // Delta has no fixed-size lists: the table's embeddings are lists.
        let embedding = batch.column_by_name("embedding").unwrap();
        let vector_at = |row: usize| match embedding.data_type() {
            DataType::FixedSizeList(..) => embedding
                .as_any()
                .downcast_ref::<FixedSizeListArray>()
                .unwrap()
                .value(row),
            DataType::LargeList(_) => embedding.as_list::<i64>().value(row),
            _ => embedding.as_list::<i32>().value(row),
        };
        let others: Vec<_> = ["topic", "chars", "words", "fingerprint"]
            .iter()
            .map(|name| cast(batch.column_by_name(name).unwrap(), &DataType::Utf8).unwrap())
            .collect();
        for row in 0..batch.num_rows() {
            let text = others
                .iter()
                .map(|c| c.as_string::<i32>().value(row).to_string())
                .collect();
            let vector = vector_at(row);
            let bits = vector
                .as_primitive::<Float32Type>()
                .values()
                .iter()
                .map(|f| f.to_bits());
            let previous = rows.insert(ids.value(row), (text, bits.collect()));
            assert!(previous.is_none(), "id {} twice", ids.value(row));
        }
    }
    rows
}

/// A session computing on the CPU, without the model-output cache (the model sees every
/// row it is given).
fn session() -> SessionContext {
    flumen::session(FlumenConfig::default())
}

/// The features of the source at its version `version`, computed whole.
async fn full_recompute(source: &Path, version: u64) -> Features {
    let ctx = session();
    common::collect(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE src STORED AS DELTATABLE LOCATION '{}' OPTIONS ('version' '{version}')",
            source.display()
        ),
    )
    .await;
    let sql = format!("SELECT {} FROM src", flumen::feature_job::FEATURES);
    features_of(&common::collect(&ctx, &sql).await)
}

/// The feature table's rows now.
async fn feature_table(features: &Path) -> Features {
    let ctx = session();
    common::collect(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE f STORED AS DELTATABLE LOCATION '{}'",
            features.display()
        ),
    )
    .await;
    features_of(&common::collect(&ctx, "SELECT * FROM f").await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feature_table_follows_its_source_computing_only_what_changed() {
    let Some(python) = writer_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("docs");
    let features = dir.path().join("features");
    let text = |p: &Path| p.display().to_string();
    assert_eq!(change_source(&python, &source, &["create", "400"]), 0);

    // The first run computes every row.
    let run = extract_incremental(&session(), &text(&source), &text(&features))
        .await
        .unwrap();
    assert_eq!((run.previous_version, run.source_version), (None, 0));
    assert_eq!((run.computed_rows, run.removed_rows), (400, 0));
    assert_eq!(
        feature_table(&features).await,
        full_recompute(&source, 0).await
    );

    // 50 updated, 20 deleted, 30 inserted (versions 1-3): the model sees 80 rows.
    assert_eq!(change_source(&python, &source, &["change", "400"]), 3);
    let ctx = session();
    let changes = common::collect(
        &ctx,
        &format!(
            "SELECT _change_type, count(*) AS n, min(_commit_version) AS first \
             FROM table_changes('{}', 1) GROUP BY _change_type ORDER BY _change_type",
            source.display()
        ),
    )
    .await;
    let shown = datafusion::arrow::util::pretty::pretty_format_batches(&changes)
        .unwrap()
        .to_string();
    for line in [
        "| delete           | 20 | 2     |",
        "| insert           | 30 | 3     |",
        "| update_postimage | 50 | 1     |",
        "| update_preimage  | 50 | 1     |",
    ] {
        assert!(shown.contains(line), "{shown}");
    }
    let run = extract_incremental(&session(), &text(&source), &text(&features))
        .await
        .unwrap();
    println!("after versions 1-3: {run:?}");
    assert_eq!((run.previous_version, run.source_version), (Some(0), 3));
    assert_eq!((run.computed_rows, run.removed_rows), (80, 20));
    let after = feature_table(&features).await;
    assert_eq!(after.len(), 410);
    assert_eq!(after, full_recompute(&source, 3).await);
    // One commit per run.
    let commits = std::fs::read_dir(features.join("_delta_log"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "json")
        })
        .count();
    assert_eq!(commits, 2);

    // Run again: nothing to do.
    let run = extract_incremental(&session(), &text(&source), &text(&features))
        .await
        .unwrap();
    assert_eq!((run.computed_rows, run.removed_rows), (0, 0));

    // A run of the binary killed mid-way, then rerun to its end: no duplicate, no loss.
    assert_eq!(change_source(&python, &source, &["touch", "300"]), 4);
    let mut seeded = common::Seeded(6701);
    for _ in 0..2 {
        let mut child = extract_command(dir.path())
            .args(["extract", "--incremental"])
            .args([&source, &features])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(200 + (seeded.next() * 1500.0) as u64));
        // SAFETY: signalling a child process this test started.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        child.wait().unwrap();
    }
    let out = extract_command(dir.path())
        .args(["extract", "--incremental"])
        .args([&source, &features])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("version 4"), "{said}");
    assert_eq!(
        feature_table(&features).await,
        full_recompute(&source, 4).await
    );

    // A source without a change feed is refused, saying why.
    let plain = dir.path().join("plain");
    change_source(&python, &plain, &["plain", "10"]);
    let err = common::try_collect(
        &session(),
        &format!("SELECT * FROM table_changes('{}', 0)", plain.display()),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("delta.enableChangeDataFeed"), "{err}");
    let err = extract_incremental(&session(), &text(&plain), &text(&dir.path().join("f2")))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("no change data feed"), "{err}");
}

/// `flumen extract --checkpoint` over a Parquet source (no change feed): runs of the binary
/// SIGKILLed mid-way, then one to its end, leave every id's features once, equal to a full
/// run; the runs after a kill compute only what the committed parts lack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpointed_extraction_killed_mid_way_resumes_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("docs.parquet");
    let output = dir.path().join("features");
    write_docs(&input, 900).await;
    let run = |kill_after: Option<u64>| {
        let child = extract_command(dir.path())
            .args(["extract", "--checkpoint", "--chunk-rows", "25"])
            .args([&input, &output])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if let Some(ms) = kill_after {
            std::thread::sleep(Duration::from_millis(ms));
            // SAFETY: signalling a child process this test started.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    let mut seeded = common::Seeded(6702);
    for _ in 0..2 {
        run(Some(400 + (seeded.next() * 1000.0) as u64));
    }
    let parts_after_kills = std::fs::read_dir(&output).map_or(0, |d| d.count());
    let (ok, said) = run(None);
    assert!(ok, "{said}");
    println!("after {parts_after_kills} parts from the killed runs: {said}");
    // The last run computed only what was missing.
    // "DIR: N rows were done, M computed now in P parts, S s"
    let number_after = |marker: &str| -> u64 {
        let rest = said.split(marker).nth(1).unwrap();
        rest.split(' ').next().unwrap().parse().unwrap()
    };
    let (done, computed) = (number_after(": "), number_after(", "));
    assert_eq!(done + computed, 900, "{said}");
    let read = session();
    common::collect(
        &read,
        &format!(
            "CREATE EXTERNAL TABLE parts STORED AS PARQUET LOCATION '{}/'",
            output.display()
        ),
    )
    .await;
    let got = features_of(&common::collect(&read, "SELECT * FROM parts").await);
    assert_eq!(got.len(), 900);
    common::collect(
        &read,
        &format!(
            "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
            input.display()
        ),
    )
    .await;
    let full = common::collect(
        &read,
        &format!("SELECT {} FROM docs", flumen::feature_job::FEATURES),
    )
    .await;
    assert_eq!(got, features_of(&full));
    // Done: a rerun computes nothing.
    let (ok, said) = run(None);
    assert!(
        ok && said.contains("900 rows were done, 0 computed"),
        "{said}"
    );
}

/// A flumen session whose tasks run in two worker processes.
fn worker_session() -> SessionContext {
    flumen::session(common::in_worker_processes(2))
}

/// `batches` as sorted text rows (values compared, not plans).
fn sorted_rows(batches: &[RecordBatch]) -> Vec<String> {
    let text = datafusion::arrow::util::pretty::pretty_format_batches(batches)
        .unwrap()
        .to_string();
    // Table lines start with "| "; the first is the header.
    let mut rows: Vec<String> = (text.lines().filter(|l| l.starts_with("| ")).skip(1))
        .map(String::from)
        .collect();
    rows.sort();
    rows
}

/// The same in worker mode: `table_changes` answers as vanilla DataFusion reading the change
/// feed through deltalake's own provider, and incremental and checkpointed extraction on
/// worker processes leave what a full recompute in threads mode gives, bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn change_feeds_and_extractions_on_worker_processes_answer_as_in_threads() {
    let Some(python) = writer_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("docs");
    let features = dir.path().join("features");
    let text = |p: &Path| p.display().to_string();
    change_source(&python, &source, &["create", "400"]);
    change_source(&python, &source, &["change", "400"]);

    // The change feed since version 1, by value, against vanilla DataFusion.
    let columns = "id, body, _change_type, _commit_version";
    let workers = worker_session();
    let ours = common::collect(
        &workers,
        &format!(
            "SELECT {columns} FROM table_changes('{}', 1)",
            source.display()
        ),
    )
    .await;
    let vanilla = SessionContext::new();
    let url = url::Url::from_directory_path(&source).unwrap();
    let table = deltalake_core::DeltaTableBuilder::from_url(url)
        .unwrap()
        .load()
        .await
        .unwrap();
    let feed = deltalake_core::delta_datafusion::cdf::scan::DeltaCdfTableProvider::try_new(
        table.scan_cdf().with_starting_version(1),
    )
    .unwrap();
    vanilla
        .register_table("changes", std::sync::Arc::new(feed))
        .unwrap();
    let theirs = vanilla
        .sql(&format!("SELECT {columns} FROM changes"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(sorted_rows(&ours), sorted_rows(&theirs));
    assert_eq!(sorted_rows(&ours).len(), 150);

    // Incremental extraction on the workers: v0's full run, then versions 1-3.
    let source_v0 = dir.path().join("docs-v0");
    change_source(&python, &source_v0, &["create", "400"]);
    let run = extract_incremental(&worker_session(), &text(&source_v0), &text(&features))
        .await
        .unwrap();
    assert_eq!(run.computed_rows, 400);
    change_source(&python, &source_v0, &["change", "400"]);
    let run = extract_incremental(&worker_session(), &text(&source_v0), &text(&features))
        .await
        .unwrap();
    assert_eq!((run.computed_rows, run.removed_rows), (80, 20));
    assert_eq!(
        feature_table(&features).await,
        full_recompute(&source_v0, 3).await
    );

    // A checkpointed extraction on the workers, in parts of 100 rows.
    let input = dir.path().join("docs.parquet");
    let parts = dir.path().join("parts");
    write_docs(&input, 300).await;
    let ctx = session();
    let run = flumen::checkpoint::extract_with_checkpoint(&worker_session(), &input, &parts, 100)
        .await
        .unwrap();
    assert_eq!((run.computed_rows, run.parts_written), (300, 3));
    common::collect(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE parts STORED AS PARQUET LOCATION '{}/'",
            parts.display()
        ),
    )
    .await;
    common::collect(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
            input.display()
        ),
    )
    .await;
    let full = common::collect(
        &ctx,
        &format!("SELECT {} FROM docs", flumen::feature_job::FEATURES),
    )
    .await;
    assert_eq!(
        features_of(&common::collect(&ctx, "SELECT * FROM parts").await),
        features_of(&full)
    );
}

/// `rows` documents (`id`, `topic`, `body`) as one Parquet file at `path`.
async fn write_docs(path: &Path, rows: u64) {
    common::collect(
        &session(),
        &format!(
            "COPY (SELECT value AS id, 'topic ' || (value % 5) AS topic, \
                   '<p>Document ' || value || ' about things.</p>' AS body \
                   FROM generate_series(0, {})) TO '{}'",
            rows - 1,
            path.display()
        ),
    )
    .await;
}
