//! Lakehouse tables written by the ecosystem's own writers (the `deltalake` and `pyiceberg`
//! Python packages, run by `tests/lakehouse/make_tables.py`) and read by flumen, locally and
//! on a real S3-compatible server on loopback; Delta writes read back by `deltalake`.
//!
//! The writers come from `target/test-venv` (`bash tests/install-test-tools.sh`) or
//! `FLUMEN_LAKEHOUSE_PYTHON`. Without them these tests say they were skipped.

use crate::common;
use crate::common::s3_server;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use datafusion::arrow::util::display::array_value_to_string;
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::prelude::SessionContext;
use flumen::FlumenConfig;
use s3_server::S3Server;
use serde_json::Value;

/// The Python with the table writers (`FLUMEN_LAKEHOUSE_PYTHON`, else the one
/// `tests/install-test-tools.sh` installs), or `None` (the test is skipped).
fn writers_python() -> Option<String> {
    let python = std::env::var("FLUMEN_LAKEHOUSE_PYTHON").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-venv/bin/python").into()
    });
    Path::new(&python).exists().then_some(python)
}

/// Run the writers: tables under `root` (a directory or `s3://bucket/prefix`), and what the
/// writers' own readers read, from `expected.json` in `out`.
fn write_tables(python: &str, root: &str, out: &Path, s3_endpoint: Option<&str>) -> Value {
    let expected = out.join("expected.json");
    let mut command = Command::new(python);
    command
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/lakehouse/make_tables.py"
        ))
        .arg(root)
        .arg(&expected)
        .env("RUST_LOG", "error");
    if let Some(endpoint) = s3_endpoint {
        command.args(["--s3-endpoint", endpoint]);
    }
    let status = command.status().expect("run make_tables.py");
    assert!(status.success(), "make_tables.py failed");
    serde_json::from_slice(&std::fs::read(expected).unwrap()).unwrap()
}

/// Local tables, written once for all tests of this file.
fn local_tables() -> Option<&'static (PathBuf, Value)> {
    static TABLES: OnceLock<Option<(PathBuf, Value)>> = OnceLock::new();
    TABLES
        .get_or_init(|| {
            let python = writers_python()?;
            // Rewritten from scratch on each run; kept afterwards for inspection.
            let dir = PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/target/lakehouse-tables"
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let expected = write_tables(&python, dir.join("tables").to_str().unwrap(), &dir, None);
            Some((dir, expected))
        })
        .as_ref()
}

fn skipped() {
    common::skip_missing_tool(
        "no Python with deltalake and pyiceberg (run tests/install-test-tools.sh)",
    );
}

fn ctx() -> SessionContext {
    flumen::session(FlumenConfig::default())
}

async fn error(ctx: &SessionContext, sql: &str) -> String {
    match common::try_collect(ctx, sql).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{sql} should fail"),
    }
}

/// `count, sum(id), sum(score), max(body)` of a table, as the writers' summary lists them.
async fn summary(ctx: &SessionContext, table: &str) -> Vec<String> {
    common::first_row(
        ctx,
        &format!("SELECT count(*), sum(id), sum(score), max(body) FROM {table}"),
    )
    .await
}

/// `options` (an `OPTIONS (...)` clause or nothing) with `'key' 'value'` added.
fn with_option(options: &str, key: &str, value: &str) -> String {
    if options.is_empty() {
        format!("OPTIONS ('{key}' '{value}')")
    } else {
        options.replacen("OPTIONS (", &format!("OPTIONS ('{key}' '{value}', "), 1)
    }
}

fn expected_summary(entry: &Value) -> Vec<String> {
    vec![
        entry["count"].to_string(),
        entry["sum_id"].to_string(),
        format!("{:.1}", entry["sum_score"].as_f64().unwrap()),
        entry["max_body"].as_str().unwrap().to_string(),
    ]
}

/// Check every version of the Delta table `docs`, by number and by timestamp.
async fn check_delta_docs(ctx: &SessionContext, docs: &Value, options: &str) {
    let location = docs["location"].as_str().unwrap();
    let versions = docs["versions"].as_array().unwrap();
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE delta_docs STORED AS DELTATABLE LOCATION '{location}' {options}"
    ))
    .await
    .unwrap();
    let latest = versions.last().unwrap();
    assert_eq!(
        summary(ctx, "delta_docs").await,
        expected_summary(latest),
        "latest"
    );
    // Partition pruning on `topic` gives the partition's rows.
    assert_eq!(
        common::first_row(ctx, "SELECT count(*) FROM delta_docs WHERE topic = 'sport'").await,
        vec![latest["sport_count"].to_string()]
    );
    for entry in versions {
        let version = entry["version"].as_i64().unwrap();
        let name = format!("delta_docs_v{version}");
        let with_version = with_option(options, "version", &version.to_string());
        ctx.sql(&format!(
            "CREATE EXTERNAL TABLE {name} STORED AS DELTATABLE LOCATION '{location}' {with_version}"
        ))
        .await
        .unwrap();
        assert_eq!(
            summary(ctx, &name).await,
            expected_summary(entry),
            "version {version}"
        );
    }
    // Time travel by timestamp: 90 ms after version 1's commit reads version 1. Not its
    // commit time itself: a local log file's modification time, which the version is
    // resolved against, comes some ms after the commit's own timestamp (more on a loaded
    // machine). Not later than 100 ms: S3 keeps modification times to the second, and
    // version 2, committed 1.1 s after version 1, shows there at least 0.1 s after it.
    let v1 = &versions[1];
    let at = v1["timestamp_ms"].as_i64().unwrap() + 90;
    let with_timestamp = with_option(options, "timestamp", &at.to_string());
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE delta_docs_at STORED AS DELTATABLE LOCATION '{location}' {with_timestamp}"
    ))
    .await
    .unwrap();
    assert_eq!(summary(ctx, "delta_docs_at").await, expected_summary(v1));
}

/// Check the Iceberg tables: v2 (current and every snapshot) and v1.
async fn check_iceberg(ctx: &SessionContext, iceberg: &Value, options: &str) {
    let v2 = &iceberg["docs_v2"];
    let location = v2["location"].as_str().unwrap();
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE ice_v2 STORED AS ICEBERG LOCATION '{location}' {options}"
    ))
    .await
    .unwrap();
    assert_eq!(
        summary(ctx, "ice_v2").await,
        expected_summary(&v2["current"])
    );
    for (i, snapshot) in v2["snapshots"].as_array().unwrap().iter().enumerate() {
        let id = snapshot["snapshot_id"].as_i64().unwrap();
        let with_id = with_option(options, "snapshot_id", &id.to_string());
        let name = format!("ice_v2_s{i}");
        ctx.sql(&format!(
            "CREATE EXTERNAL TABLE {name} STORED AS ICEBERG LOCATION '{location}' {with_id}"
        ))
        .await
        .unwrap();
        assert_eq!(
            summary(ctx, &name).await,
            expected_summary(snapshot),
            "snapshot {i}"
        );
        assert_eq!(
            common::first_row(
                ctx,
                &format!("SELECT count(*) FROM {name} WHERE topic = 'sport'")
            )
            .await,
            vec![snapshot["sport_count"].to_string()]
        );
    }
    // A metadata file as the location reads that metadata's current snapshot.
    let metadata = v2["metadata"].as_str().unwrap();
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE ice_meta STORED AS ICEBERG LOCATION '{metadata}' {options}"
    ))
    .await
    .unwrap();
    assert_eq!(
        summary(ctx, "ice_meta").await,
        expected_summary(&v2["current"])
    );
    let v1 = &iceberg["docs_v1"];
    assert_eq!(v1["format_version"], 1);
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE ice_v1 STORED AS ICEBERG LOCATION '{}' {options}",
        v1["location"].as_str().unwrap()
    ))
    .await
    .unwrap();
    assert_eq!(
        summary(ctx, "ice_v1").await,
        expected_summary(&v1["current"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_tables_written_by_deltalake_read_back_identically() {
    let Some((_, expected)) = local_tables() else {
        return skipped();
    };
    let ctx = ctx();
    check_delta_docs(&ctx, &expected["delta"]["docs"], "").await;
    let plain = &expected["delta"]["plain"];
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE plain STORED AS DELTATABLE LOCATION '{}'",
        plain["location"].as_str().unwrap()
    ))
    .await
    .unwrap();
    assert_eq!(
        summary(&ctx, "plain").await,
        expected_summary(&plain["versions"][0])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iceberg_tables_written_by_pyiceberg_read_back_identically() {
    let Some((_, expected)) = local_tables() else {
        return skipped();
    };
    check_iceberg(&ctx(), &expected["iceberg"], "").await;
}

/// Tables whose schema grew a column (`lang`) after their first rows, one of them (Delta)
/// read from a checkpoint and the commits after it: every row, `lang` NULL where the
/// writer had none, as each package's own reader reads them; in threads mode and with the
/// scans in two worker processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evolved_schemas_and_a_delta_checkpoint_read_back_identically() {
    let Some((_, expected)) = local_tables() else {
        return skipped();
    };
    let log =
        Path::new(expected["delta"]["evolved"]["location"].as_str().unwrap()).join("_delta_log");
    let checkpoints = common::files_below(&log)
        .into_iter()
        .filter(|f| f.to_string_lossy().contains(".checkpoint."))
        .count();
    assert!(
        checkpoints > 0,
        "deltalake wrote no checkpoint in {}",
        log.display()
    );
    let workers = common::in_worker_processes(2);
    for (mode, config) in [("threads", FlumenConfig::default()), ("workers", workers)] {
        let ctx = flumen::session(config);
        for (name, format, entry) in [
            ("delta_evolved", "DELTATABLE", &expected["delta"]["evolved"]),
            ("ice_evolved", "ICEBERG", &expected["iceberg"]["evolved"]),
        ] {
            let location = entry["location"].as_str().unwrap();
            ctx.sql(&format!(
                "CREATE EXTERNAL TABLE {name} STORED AS {format} LOCATION '{location}'"
            ))
            .await
            .unwrap();
            let current = &entry["current"];
            assert_eq!(
                summary(&ctx, name).await,
                expected_summary(current),
                "{name} ({mode})"
            );
            // The filter keeps every row and makes the scan run (a bare count is answered
            // from the files' statistics).
            let sql = format!("SELECT count(lang) FROM {name} WHERE length(body) > 0");
            let (batches, plan) = common::run_plan(&ctx, &sql).await;
            let counted = common::rows(&batches, true);
            assert_eq!(
                counted
                    .iter()
                    .map(|r| r.trim_matches(['|', ' ']))
                    .collect::<Vec<_>>(),
                vec![current["lang_count"].to_string()],
                "{name} ({mode}): rows with the evolved column"
            );
            // Iceberg's scan goes to the workers. deltalake maps this Delta table's older
            // files onto its schema with an expression adapter, which datafusion-proto does
            // not encode: its task runs on the driver, saying so (`tasks_on_driver`).
            let (remote, _) = common::remote_and_all_tasks(&plan);
            match (mode, format) {
                ("workers", "ICEBERG") => assert!(remote > 0, "{name}: no scan ran in a worker"),
                ("workers", _) => {
                    let exec = plan.downcast_ref::<flumen::exec::FlumenExec>().unwrap();
                    let on_driver: u64 = common::operator_stats(exec)
                        .iter()
                        .map(|s| s.tasks_on_driver)
                        .sum();
                    assert!(on_driver > 0, "{name}: its scan ran nowhere?");
                }
                _ => assert_eq!(remote, 0),
            }
        }
    }
}

/// Delta and Iceberg scans are cut into flumen source splits (deterministic byte ranges), so
/// a lost block re-reads only its own files and row groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lakehouse_scans_are_cut_into_source_splits() {
    let Some((_, expected)) = local_tables() else {
        return skipped();
    };
    let ctx = ctx();
    ctx.sql("SET flumen.split_bytes = '1KB'").await.unwrap();
    for (format, location) in [
        ("DELTATABLE", &expected["delta"]["docs"]["location"]),
        ("ICEBERG", &expected["iceberg"]["docs_v2"]["location"]),
    ] {
        let name = format!("t_{}", format.to_lowercase());
        ctx.sql(&format!(
            "CREATE EXTERNAL TABLE {name} STORED AS {format} LOCATION '{}'",
            location.as_str().unwrap()
        ))
        .await
        .unwrap();
        let batches = ctx
            .sql(&format!("EXPLAIN SELECT id, body FROM {name}"))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let plan = pretty_format_batches(&batches).unwrap().to_string();
        let splits: usize = plan
            .split("splits=")
            .skip(1)
            .map(|s| {
                s.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
                    .parse::<usize>()
                    .unwrap()
            })
            .sum();
        assert!(plan.contains("tasks=source"), "{plan}");
        assert!(splits > 8, "{format}: only {splits} splits:\n{plan}");
        // Delta's per-file mapping node runs split by split (or block by block), never as one
        // task over the whole scan.
        if format == "DELTATABLE" {
            let lines: Vec<&str> = plan.lines().collect();
            let at = lines
                .iter()
                .position(|l| {
                    l.trim_start_matches([' ', '|'])
                        .starts_with("DeltaScanExec")
                })
                .expect("DeltaScanExec in the plan");
            let operator = lines[..at]
                .iter()
                .rev()
                .find(|l| l.contains("FlumenOperator:"))
                .unwrap();
            assert!(
                operator.contains("tasks=source, splits=") || operator.contains("tasks=per-block"),
                "{plan}"
            );
            assert!(!operator.contains("splits=1 "), "{plan}");
        }
    }
}

/// `INSERT INTO` a Delta table commits one new version that `deltalake` itself reads back;
/// a query that fails midway commits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_into_delta_commits_once_and_deltalake_reads_it() {
    let Some(python) = writers_python() else {
        return skipped();
    };
    let dir = tempfile::tempdir().unwrap();
    let location = dir.path().join("features");
    let location = location.to_str().unwrap();
    let ctx = ctx();
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE features (id BIGINT NOT NULL, label VARCHAR, v FLOAT[]) \
         STORED AS DELTATABLE LOCATION '{location}'"
    ))
    .await
    .unwrap();
    let inserted = common::first_row(
        &ctx,
        "INSERT INTO features SELECT x, 'row ' || x, [CAST(x AS FLOAT), 0.5] \
         FROM generate_series(1, 20000) AS t(x)",
    )
    .await;
    assert_eq!(inserted, vec!["20000"]);
    // A query that fails after some blocks were written commits nothing.
    let failed = error(
        &ctx,
        "INSERT INTO features SELECT x, 'bad ' || x, [CAST(10 / (x - 15000) AS FLOAT)] \
         FROM generate_series(1, 20000) AS t(x)",
    )
    .await;
    assert!(failed.contains("Divide by zero"), "{failed}");
    assert_eq!(
        common::first_row(
            &ctx,
            "SELECT count(*), sum(id), count(DISTINCT label) FROM features"
        )
        .await,
        vec!["20000", "200010000", "20000"]
    );
    // deltalake's own reader sees one committed version with every row once. The script
    // leaves with `os._exit` once it has printed, skipping the interpreter's teardown: in
    // one of many CI runs this reader aborted with "terminate called without an active
    // exception", a C++ abort of the kind native libraries' threads raise at teardown.
    let script = format!(
        "import os, deltalake, pyarrow.compute as pc\n\
         t = deltalake.DeltaTable('{location}')\n\
         a = t.to_pyarrow_table()\n\
         print(t.version(), a.num_rows, pc.sum(a['id']).as_py(), len(pc.unique(a['id'])), flush=True)\n\
         os._exit(0)"
    );
    let out = Command::new(&python)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "deltalake's reader failed ({}); it printed {:?}, stderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "1 20000 200010000 20000"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_lakehouse_locations_are_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let empty = empty.to_str().unwrap();
    let ctx = ctx();
    let e = error(
        &ctx,
        &format!("CREATE EXTERNAL TABLE d STORED AS DELTATABLE LOCATION '{empty}'"),
    )
    .await;
    assert!(
        e.contains(empty) && e.contains("not a Delta table") && e.contains("_delta_log"),
        "{e}"
    );
    let e = error(
        &ctx,
        &format!("CREATE EXTERNAL TABLE i STORED AS ICEBERG LOCATION '{empty}'"),
    )
    .await;
    assert!(
        e.contains(empty) && e.contains("not an Iceberg table"),
        "{e}"
    );
    // Metadata of an unknown format version.
    let table = dir.path().join("v9");
    std::fs::create_dir_all(table.join("metadata")).unwrap();
    std::fs::write(
        table.join("metadata/v1.metadata.json"),
        r#"{"format-version": 9, "location": "x"}"#,
    )
    .unwrap();
    let e = error(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE i9 STORED AS ICEBERG LOCATION '{}'",
            table.display()
        ),
    )
    .await;
    assert!(e.contains("format version 9"), "{e}");
    // A snapshot with a position-delete file (written here with Avro, as Spark would).
    let table = dir.path().join("with_deletes");
    write_table_with_delete_file(&table);
    let e = error(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE idel STORED AS ICEBERG LOCATION '{}'",
            table.display()
        ),
    )
    .await;
    assert!(
        e.contains("row-level delete files") && e.contains("deletes-0.parquet"),
        "{e}"
    );
    // Time travel to a version that does not exist (needs a table the writers made).
    let Some((_, expected)) = local_tables() else {
        return common::skip_missing_tool(
            "time travel to a missing version: no Python with deltalake and pyiceberg \
             (run tests/install-test-tools.sh)",
        );
    };
    let location = expected["delta"]["docs"]["location"].as_str().unwrap();
    let e = error(
        &ctx,
        &format!(
            "CREATE EXTERNAL TABLE d99 STORED AS DELTATABLE LOCATION '{location}' \
             OPTIONS ('version' '99')"
        ),
    )
    .await;
    assert!(e.contains(location) && e.contains("99"), "{e}");
}

/// The same tables, written by the same Python writers straight to a real S3-compatible
/// server on 127.0.0.1 and read by flumen through `s3://` locations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lakehouse_tables_on_a_loopback_s3_server() {
    let Some(python) = writers_python() else {
        return skipped();
    };
    let Some(server) = S3Server::start() else {
        common::skip_missing_tool("moto_server not found (run tests/install-test-tools.sh)");
        return;
    };
    server.create_bucket("lake");
    let out = tempfile::tempdir().unwrap();
    let expected = write_tables(
        &python,
        "s3://lake/tables",
        out.path(),
        Some(&server.endpoint),
    );
    let options = server.options();
    let ctx = ctx();
    check_delta_docs(&ctx, &expected["delta"]["docs"], &options).await;
    check_iceberg(&ctx, &expected["iceberg"], &options).await;
    // A bucket that does not exist is named in the error.
    let e = error(
        &ctx,
        &format!("CREATE EXTERNAL TABLE gone STORED AS DELTATABLE LOCATION 's3://no-such-bucket/t' {options}"),
    )
    .await;
    assert!(e.contains("no-such-bucket"), "{e}");
    // No credentials at all (none given, none in the environment): the error says so.
    let out = Command::new(env!("CARGO_BIN_EXE_flumen"))
        .args([
            "--no-demo",
            "-c",
            &format!(
                "CREATE EXTERNAL TABLE t STORED AS DELTATABLE LOCATION 's3://lake/tables/delta/docs' \
                 OPTIONS ('aws.endpoint' '{}', 'aws.region' 'us-east-1')",
                server.endpoint
            ),
        ])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_WEB_IDENTITY_TOKEN_FILE")
        .env_remove("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        .env_remove("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no AWS credentials were given for s3://lake/tables/delta/docs"),
        "{stderr}"
    );
}

/// A minimal Iceberg v2 table whose only snapshot has a delete manifest holding one
/// position-delete file.
fn write_table_with_delete_file(table: &Path) {
    use apache_avro::types::{Record, Value as Avro};
    use apache_avro::{Schema, Writer};
    let metadata = table.join("metadata");
    std::fs::create_dir_all(&metadata).unwrap();
    let manifest_schema = Schema::parse_str(
        r#"{"type": "record", "name": "manifest_entry", "fields": [
            {"name": "status", "type": "int"},
            {"name": "data_file", "type": {"type": "record", "name": "r2", "fields": [
                {"name": "content", "type": "int"},
                {"name": "file_path", "type": "string"},
                {"name": "file_format", "type": "string"},
                {"name": "record_count", "type": "long"},
                {"name": "file_size_in_bytes", "type": "long"}]}}]}"#,
    )
    .unwrap();
    let data_file = Avro::Record(vec![
        ("content".into(), Avro::Int(1)),
        (
            "file_path".into(),
            Avro::String(table.join("data/deletes-0.parquet").display().to_string()),
        ),
        ("file_format".into(), Avro::String("PARQUET".into())),
        ("record_count".into(), Avro::Long(3)),
        ("file_size_in_bytes".into(), Avro::Long(100)),
    ]);
    let mut entry = Record::new(&manifest_schema).unwrap();
    entry.put("status", Avro::Int(1));
    entry.put("data_file", data_file);
    let mut writer = Writer::new(&manifest_schema, Vec::new()).unwrap();
    writer.append_value(entry).unwrap();
    let manifest = metadata.join("deletes-m0.avro");
    std::fs::write(&manifest, writer.into_inner().unwrap()).unwrap();

    let list_schema = Schema::parse_str(
        r#"{"type": "record", "name": "manifest_file", "fields": [
            {"name": "manifest_path", "type": "string"},
            {"name": "manifest_length", "type": "long"},
            {"name": "partition_spec_id", "type": "int"},
            {"name": "content", "type": "int"}]}"#,
    )
    .unwrap();
    let mut item = Record::new(&list_schema).unwrap();
    item.put("manifest_path", manifest.display().to_string());
    item.put("manifest_length", 100i64);
    item.put("partition_spec_id", 0i32);
    item.put("content", 1i32);
    let mut writer = Writer::new(&list_schema, Vec::new()).unwrap();
    writer.append_value(item).unwrap();
    let list = metadata.join("snap-1.avro");
    std::fs::write(&list, writer.into_inner().unwrap()).unwrap();

    let json = serde_json::json!({
        "format-version": 2,
        "location": table.display().to_string(),
        "current-schema-id": 0,
        "schemas": [{"schema-id": 0, "type": "struct",
                     "fields": [{"id": 1, "name": "id", "type": "long", "required": true}]}],
        "current-snapshot-id": 1,
        "snapshots": [{"snapshot-id": 1, "timestamp-ms": 0,
                       "manifest-list": list.display().to_string()}],
    });
    std::fs::write(
        metadata.join("00001-x.metadata.json"),
        serde_json::to_vec(&json).unwrap(),
    )
    .unwrap();
}

/// `COPY ... TO` a directory `PARTITIONED BY` a column writes one Hive-style directory per
/// value whose files hold exactly that value's rows, as vanilla DataFusion's COPY does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_partitioned_by_a_column_matches_vanilla() {
    let dir = tempfile::tempdir().unwrap();
    let source = "SELECT x AS id, CASE x % 3 WHEN 0 THEN 'a' WHEN 1 THEN 'b' ELSE 'c' END AS part, \
                  x * 0.25 AS score FROM generate_series(1, 30000) AS t(x)";
    let check = "SELECT part, count(*), sum(id), sum(score) FROM out GROUP BY part ORDER BY part";
    let mut answers = vec![];
    for (name, ctx) in [("flumen", ctx()), ("vanilla", SessionContext::new())] {
        let out = dir.path().join(name);
        common::collect(
            &ctx,
            &format!(
                "COPY ({source}) TO '{}/' STORED AS PARQUET PARTITIONED BY (part)",
                out.display()
            ),
        )
        .await;
        for part in ["a", "b", "c"] {
            assert!(
                out.join(format!("part={part}")).is_dir(),
                "{name}: no part={part}"
            );
        }
        ctx.sql(&format!(
            "CREATE EXTERNAL TABLE out (id BIGINT, score DOUBLE, part VARCHAR) \
             STORED AS PARQUET PARTITIONED BY (part) LOCATION '{}/'",
            out.display()
        ))
        .await
        .unwrap();
        let batches = ctx.sql(check).await.unwrap().collect().await.unwrap();
        answers.push(pretty_format_batches(&batches).unwrap().to_string());
    }
    assert_eq!(answers[0], answers[1]);
    assert!(
        answers[0]
            .lines()
            .any(|l| l.starts_with("| a ") && l.contains(" 10000 ")),
        "{}",
        answers[0]
    );
}

/// Blocks of Delta and Iceberg scans lost mid-query are recomputed from their source splits
/// (the same files and row groups), and the answers stay what the writers' readers returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lakehouse_blocks_are_recomputed_from_their_splits() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some((_, expected)) = local_tables() else {
        return skipped();
    };
    // Lose every other block the scans (operator 0) produce, as if their worker died.
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&seen);
    let dropper = flumen::BlockDropper(Arc::new(move |b| {
        b.operator == 0 && counter.fetch_add(1, Ordering::Relaxed) % 2 == 1
    }));
    let config = flumen::flumen_session_config(
        datafusion::prelude::SessionConfig::new().with_target_partitions(2),
        FlumenConfig::default(),
    )
    .with_extension(Arc::new(dropper));
    let ctx = flumen::session_with_config(config, FlumenConfig::default());
    ctx.sql("SET flumen.split_bytes = '2KB'").await.unwrap();
    ctx.sql("SET flumen.target_block_rows = 100").await.unwrap();
    let delta = &expected["delta"]["docs"];
    let iceberg = &expected["iceberg"]["docs_v2"];
    for (format, location, answer) in [
        (
            "DELTATABLE",
            delta["location"].as_str().unwrap(),
            delta["versions"].as_array().unwrap().last().unwrap(),
        ),
        (
            "ICEBERG",
            iceberg["location"].as_str().unwrap(),
            &iceberg["current"],
        ),
    ] {
        let name = format!("lost_{}", format.to_lowercase());
        ctx.sql(&format!(
            "CREATE EXTERNAL TABLE {name} STORED AS {format} LOCATION '{location}'"
        ))
        .await
        .unwrap();
        let before = seen.load(Ordering::Relaxed);
        // Rows, not an aggregate: a small table's aggregate plans as one task over the scan.
        let batches = ctx
            .sql(&format!("SELECT id, score, body FROM {name}"))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let (mut count, mut sum_id, mut sum_score, mut max_body) =
            (0u64, 0i64, 0f64, String::new());
        for batch in &batches {
            for r in 0..batch.num_rows() {
                count += 1;
                sum_id += array_value_to_string(batch.column(0), r)
                    .unwrap()
                    .parse::<i64>()
                    .unwrap();
                sum_score += array_value_to_string(batch.column(1), r)
                    .unwrap()
                    .parse::<f64>()
                    .unwrap();
                max_body = max_body.max(array_value_to_string(batch.column(2), r).unwrap());
            }
        }
        let got = vec![
            count.to_string(),
            sum_id.to_string(),
            format!("{sum_score:.1}"),
            max_body,
        ];
        assert_eq!(got, expected_summary(answer), "{format}");
        let lost = (seen.load(Ordering::Relaxed) - before) / 2;
        assert!(lost >= 4, "{format}: only {lost} blocks were dropped");
    }
}
