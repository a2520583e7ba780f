//! Exactly-once output: `COPY ... TO`, `write_parquet` and `INSERT INTO` a listing table
//! write under a hidden staging name and commit once; a statement that fails leaves neither
//! partial files nor staging leftovers, and what was there before is kept.

use crate::common;

use std::path::Path;

use common::{collect, flumen_ctx, register_tables, try_collect, vanilla, write_events};
use datafusion::arrow::util::display::array_value_to_string;
use datafusion::dataframe::DataFrameWriteOptions;

/// Every file and directory below `dir`, relative, sorted.
fn tree(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            out.push(path.strip_prefix(root).unwrap().display().to_string());
            if path.is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = vec![];
    walk(dir, dir, &mut out);
    out.sort();
    out
}

fn no_staging_left(dir: &Path) {
    let left: Vec<String> = tree(dir)
        .into_iter()
        .filter(|p| p.contains("flumen-staging"))
        .collect();
    assert!(left.is_empty(), "staging leftovers: {left:?}");
}

/// A one-row answer as `a|b|c`.
async fn count(ctx: &datafusion::prelude::SessionContext, sql: &str) -> String {
    let batches = collect(ctx, sql).await;
    let batch = &batches[0];
    (0..batch.num_columns())
        .map(|c| array_value_to_string(batch.column(c), 0).unwrap())
        .collect::<Vec<_>>()
        .join("|")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_copy_keeps_the_old_file_and_leaves_nothing_staged() {
    let data = tempfile::tempdir().unwrap();
    write_events(data.path(), 2, 10_000);
    let f = flumen_ctx(&["SET flumen.target_block_rows = 500"])
        .await
        .enable_url_table();
    register_tables(&f, data.path()).await;
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("out.parquet");
    collect(
        &f,
        &format!(
            "COPY (SELECT id, k FROM events WHERE k = 3) TO '{}'",
            file.display()
        ),
    )
    .await;
    assert_eq!(tree(out.path()), ["out.parquet"]);
    let before = count(
        &f,
        &format!("SELECT count(*), sum(id) FROM '{}'", file.display()),
    )
    .await;
    // Fails with a division by zero at id 15000, after most blocks were written.
    let err = try_collect(
        &f,
        &format!(
            "COPY (SELECT id, 10 / (id - 15000) AS x FROM events) TO '{}'",
            file.display()
        ),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("Divide by zero"), "{err}");
    assert_eq!(
        tree(out.path()),
        ["out.parquet"],
        "a partial file or a leftover"
    );
    let after = count(
        &f,
        &format!("SELECT count(*), sum(id) FROM '{}'", file.display()),
    )
    .await;
    assert_eq!(before, after, "the failed COPY changed the file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directory_outputs_commit_every_file_and_match_vanilla() {
    let data = tempfile::tempdir().unwrap();
    write_events(data.path(), 2, 10_000);
    let v = vanilla().enable_url_table();
    register_tables(&v, data.path()).await;
    let f = flumen_ctx(&["SET flumen.target_block_rows = 700"]).await;
    register_tables(&f, data.path()).await;
    let out = tempfile::tempdir().unwrap();
    let parts = out.path().join("parts");
    collect(
        &f,
        &format!(
            "COPY (SELECT id, v, k % 3 AS g FROM events) TO '{}/' STORED AS PARQUET PARTITIONED BY (g)",
            parts.display()
        ),
    )
    .await;
    no_staging_left(out.path());
    let dirs: Vec<String> = tree(&parts)
        .into_iter()
        .filter(|p| !p.contains('/'))
        .collect();
    assert_eq!(dirs, ["g=0", "g=1", "g=2"]);
    let written = count(
        &v,
        &format!(
            "SELECT count(*), count(DISTINCT id), sum(id) FROM '{}/'",
            parts.display()
        ),
    )
    .await;
    assert_eq!(written, "20000|20000|199990000");
    // write_parquet (DataFrame API) goes through the same commit.
    let csv_dir = out.path().join("frame");
    f.sql("SELECT id, body FROM events WHERE id % 10 = 1")
        .await
        .unwrap()
        .write_parquet(
            &format!("{}/", csv_dir.display()),
            DataFrameWriteOptions::new(),
            None,
        )
        .await
        .unwrap();
    no_staging_left(out.path());
    assert_eq!(
        count(
            &v,
            &format!("SELECT count(*) FROM '{}/'", csv_dir.display())
        )
        .await,
        "2000"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_insert_into_a_listing_table_adds_no_rows() {
    let data = tempfile::tempdir().unwrap();
    write_events(data.path(), 2, 10_000);
    let f = flumen_ctx(&["SET flumen.target_block_rows = 500"]).await;
    register_tables(&f, data.path()).await;
    let table = tempfile::tempdir().unwrap();
    collect(
        &f,
        &format!(
            "CREATE EXTERNAL TABLE t (id BIGINT, x BIGINT) STORED AS PARQUET LOCATION '{}/'",
            table.path().display()
        ),
    )
    .await;
    collect(&f, "INSERT INTO t SELECT id, k FROM events WHERE id < 5000").await;
    assert_eq!(
        count(&f, "SELECT count(*), sum(id) FROM t").await,
        "5000|12497500"
    );
    let files = tree(table.path());
    let err = try_collect(&f, "INSERT INTO t SELECT id, 10 / (id - 15000) FROM events")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("Divide by zero"), "{err}");
    assert_eq!(tree(table.path()), files, "the failed INSERT left files");
    assert_eq!(
        count(&f, "SELECT count(*), sum(id) FROM t").await,
        "5000|12497500"
    );
    collect(
        &f,
        "INSERT INTO t SELECT id, k FROM events WHERE id >= 19000",
    )
    .await;
    assert_eq!(count(&f, "SELECT count(*) FROM t").await, "6000");
    no_staging_left(table.path());
}
