//! Bad input gives a clear error naming the problem and leaves nothing behind: model
//! directories with a wrong or absurd `config.json` or corrupt weights, a truncated Parquet
//! file, a spill directory deleted under a running query, a `COPY` onto a full disk or to a
//! place that takes no files, and a text over 2 GiB through `clean_text`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::skip;

const FLUMEN: &str = env!("CARGO_BIN_EXE_flumen");

/// The installed model's directory, or `None` (a skip, or a failure under CI).
fn installed_model() -> Option<PathBuf> {
    let dir = flumen::functions::embedding::model_files::model_dir("");
    if dir.join("model.safetensors").exists() {
        Some(dir)
    } else {
        skip::skip_missing_tool("the embedding model (run `flumen install-model`)");
        None
    }
}

/// A copy of the model directory whose `config.json` is edited by `edit` and whose weights
/// are `weights` (a link to the real ones when `None`).
fn damaged_model(
    real: &Path,
    edit: impl Fn(&mut serde_json::Value),
    weights: Option<Vec<u8>>,
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(real.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::os::unix::fs::symlink(
        real.join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    match weights {
        Some(bytes) => std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap(),
        None => std::os::unix::fs::symlink(
            real.join("model.safetensors"),
            dir.path().join("model.safetensors"),
        )
        .unwrap(),
    }
    dir
}

/// `embed` with `flumen.model_dir` set to `dir`: the error, then a good query in the same
/// session (the session keeps working).
async fn embed_error(dir: &Path) -> String {
    let ctx = common::flumen_ctx(&[&format!("SET flumen.model_dir = '{}'", dir.display())]).await;
    let err = common::try_collect(&ctx, "SELECT embed('a sentence') AS v")
        .await
        .unwrap_err()
        .to_string();
    let ok = common::collect(&ctx, "SELECT 1 + 1 AS two").await;
    assert_eq!(ok[0].num_rows(), 1);
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_model_directories_are_clear_errors() {
    let Some(real) = installed_model() else {
        return;
    };
    let other_width = damaged_model(&real, |c| c["hidden_size"] = 768.into(), None);
    let err = embed_error(other_width.path()).await;
    println!("hidden_size 768: {err}");
    assert!(err.contains("model.safetensors"), "{err}");

    let absurd = damaged_model(
        &real,
        |c| c["num_hidden_layers"] = 1_000_000_000_000u64.into(),
        None,
    );
    let err = embed_error(absurd.path()).await;
    println!("absurd layer count: {err}");
    assert!(err.contains("num_hidden_layers = 1000000000000"), "{err}");

    let real_bytes = std::fs::read(real.join("model.safetensors")).unwrap();
    let truncated = damaged_model(
        &real,
        |_| {},
        Some(real_bytes[..real_bytes.len() / 3].to_vec()),
    );
    let err = embed_error(truncated.path()).await;
    println!("truncated weights: {err}");
    assert!(err.contains("model.safetensors"), "{err}");

    let garbage = damaged_model(
        &real,
        |_| {},
        Some(b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk".to_vec()),
    );
    let err = embed_error(garbage.path()).await;
    println!("garbage weights: {err}");
    assert!(err.contains("not a valid safetensors file"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_parquet_file_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    common::write_events(dir.path(), 1, 20_000);
    let file = dir.path().join("part-0.parquet");
    let bytes = std::fs::read(&file).unwrap();
    let bad = dir.path().join("truncated.parquet");
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).unwrap();
    let ctx = common::flumen_ctx(&[]).await.enable_url_table();
    let err = common::try_collect(&ctx, &format!("SELECT count(*) FROM '{}'", bad.display()))
        .await
        .unwrap_err()
        .to_string();
    println!("truncated Parquet: {err}");
    assert!(err.to_lowercase().contains("parquet"), "{err}");
    // The good file still reads in the same session.
    let ok = common::collect(&ctx, &format!("SELECT count(*) FROM '{}'", file.display())).await;
    assert_eq!(ok[0].num_rows(), 1);
}

/// A query that spills, in a child `flumen` whose TMPDIR is ours; a watcher deletes its spill
/// directory as soon as it appears. The spilled blocks are lost, recomputed from lineage, and
/// the answer is right.
#[test]
fn a_spill_directory_deleted_mid_query_costs_a_recompute_not_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input");
    common::write_events(&input, 4, 50_000);
    let tmp = dir.path().join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let sql = format!(
        "SET flumen.mode = 'batch'; SET flumen.memory_budget = '2MB'; \
         SET flumen.target_block_rows = 2000; \
         SELECT count(*) AS n, count(DISTINCT a.id) AS ids, sum(length(b.body)) AS chars \
         FROM '{dir}/' a JOIN '{dir}/' b ON a.id = b.id",
        dir = input.display()
    );
    let mut child = Command::new(FLUMEN)
        .args(["--no-demo", "--quiet", "--format", "csv", "-c", &sql])
        .env("TMPDIR", &tmp)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut deleted = 0;
    while child.try_wait().unwrap().is_none() {
        for entry in std::fs::read_dir(&tmp).unwrap().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with("flumen-spill-")
                && std::fs::remove_dir_all(entry.path()).is_ok()
            {
                deleted += 1;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the query hung"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("spill dirs deleted: {deleted}; stdout: {stdout}; stderr: {stderr:.600}");
    assert!(out.status.success(), "{stderr}");
    assert!(
        deleted > 0,
        "the query never spilled: the test tests nothing"
    );
    let expected_chars: usize = (0..200_000usize)
        .filter(|i| i % 101 != 0)
        .map(|i| format!("document {i} about topic {}", i % 13).len())
        .sum();
    assert!(
        stdout.contains(&format!("200000,200000,{expected_chars}")),
        "{stdout}"
    );
}

/// `COPY` to a place that takes no new files, `/proc` (whose directory exists but where
/// creating a file says "not found"): an error naming the place, in threads mode and with
/// worker processes, and the session goes on. It used to spin for ever: the local store
/// retried the file's creation after making its (existing) directory again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_to_a_place_that_takes_no_files_is_an_error_not_a_hang() {
    for (mode, config) in [
        ("threads", flumen::FlumenConfig::default()),
        ("workers", common::in_worker_processes(1)),
    ] {
        let ctx = flumen::session_with_config(
            flumen::flumen_session_config(
                datafusion::prelude::SessionConfig::new().with_target_partitions(2),
                config.clone(),
            ),
            config,
        );
        for (target, place) in [
            ("/proc/flumen-no-file.parquet", "/proc takes no new file"),
            ("/proc/", "/proc/.flumen-staging-"),
        ] {
            let copy = format!("COPY (SELECT 1 AS x) TO '{target}' STORED AS PARQUET");
            let ran =
                tokio::time::timeout(Duration::from_secs(60), common::try_collect(&ctx, &copy));
            let err = ran
                .await
                .unwrap_or_else(|_| panic!("{mode}: {copy} still running after 60 s"))
                .expect_err(&copy)
                .to_string();
            println!("{mode}, {target}: {err}");
            assert!(
                err.contains(&format!("cannot write the output to {target}")),
                "{err}"
            );
            assert!(err.contains(place), "{err}");
        }
        let rows = common::collect(&ctx, "SELECT 42 AS answer").await;
        assert_eq!(rows[0].num_rows(), 1, "{mode}: the session goes on");
    }
}

/// `COPY` onto a full disk (a 4 MiB tmpfs): an error naming the problem, no staging left,
/// and the output written there before still whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_onto_a_full_disk_fails_cleanly_and_keeps_the_old_output() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input");
    common::write_events(&input, 2, 50_000);
    let disk = dir.path().join("small-disk");
    std::fs::create_dir_all(&disk).unwrap();
    let mounted = Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            "size=4m",
            "tmpfs",
            disk.to_str().unwrap(),
        ])
        .status();
    if !mounted.is_ok_and(|s| s.success()) {
        skip::skip_missing_tool("a tmpfs mount (needs root)");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(disk.clone());
    let ctx = common::flumen_ctx(&[]).await.enable_url_table();
    let out = disk.join("out");
    let small = format!(
        "COPY (SELECT id, v FROM '{}/' WHERE id < 1000) TO '{}/' STORED AS PARQUET",
        input.display(),
        out.display()
    );
    common::collect(&ctx, &small).await;
    let before: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let big = format!(
        "COPY (SELECT id, body, repeat(body, 20) AS padding FROM '{}/') TO '{}/' \
         STORED AS CSV",
        input.display(),
        out.display()
    );
    let err = common::try_collect(&ctx, &big)
        .await
        .unwrap_err()
        .to_string();
    println!("full disk: {err}");
    assert!(err.contains("bytes free of 4194304"), "{err}");
    assert!(err.contains(out.to_str().unwrap()), "{err}");
    // Give a cancelled writer's cleanup a moment, then: only the old files.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(after, before, "the failed COPY left files behind");
    let rows = common::collect(
        &ctx,
        &format!("SELECT count(*) AS n FROM '{}/'", out.display()),
    )
    .await;
    let n = rows[0]
        .column(0)
        .as_any()
        .downcast_ref::<datafusion::arrow::array::Int64Array>()
        .unwrap()
        .value(0);
    assert_eq!(n, 1000);
}

/// A text over 2 GiB through `clean_text` (whose result is Utf8, 32-bit offsets): a clear
/// error naming the limit, no output file or staging left by the `COPY` it fed, and the
/// session answers the next query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_over_2_gib_through_clean_text_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let ctx = flumen::session(flumen::FlumenConfig::default()).enable_url_table();
    let bytes: i64 = (1 << 31) + 64;
    let sql = format!(
        "COPY (SELECT clean_text(repeat(s, n)) AS t FROM \
         (VALUES (arrow_cast('a', 'LargeUtf8'), {bytes})) AS v(s, n)) \
         TO '{}/' STORED AS PARQUET",
        out.display()
    );
    let started = Instant::now();
    let err = common::try_collect(&ctx, &sql)
        .await
        .unwrap_err()
        .to_string();
    println!(
        "clean_text of {bytes} bytes: {:?}: {err}",
        started.elapsed()
    );
    assert!(
        err.contains("clean_text: a text of 2147483712 bytes"),
        "{err}"
    );
    assert!(err.contains("2 GiB"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&out)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "the failed COPY left {left:?}");
    let batches = common::collect(&ctx, "SELECT clean_text('<b>fine</b> &amp; well')").await;
    let text = datafusion::arrow::util::pretty::pretty_format_batches(&batches)
        .unwrap()
        .to_string();
    assert!(text.contains("fine & well"), "{text}");
}
