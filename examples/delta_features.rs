//! Delta table of documents in → embeddings → Delta table of (id, vector) out.
//!
//! With no arguments it first writes the demo documents (`flumen::demo`, 2,000 HTML documents)
//! into a Delta table under `target/flumen-demo/delta/docs` (one `INSERT INTO`, one commit),
//! then reads that table, embeds each document's cleaned text on the accelerator pool and
//! appends `(id, v)` to the Delta table `target/flumen-demo/delta/features` in one commit.
//! Each run appends one version (so `rows` grows by the table's size per run).
//!
//! Needs the model: `cargo run --release --bin flumen -- install-model`.
//!
//! Run: `cargo run --release --example delta_features [-- DOCS_TABLE FEATURES_TABLE]`
//! (the documents table needs `id` and `body` columns; `s3://` locations work with the
//! `AWS_*` environment variables, as in the REPL).

use std::path::PathBuf;
use std::time::Instant;

use datafusion::error::Result;

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ctx = flumen::session(flumen::FlumenConfig::default());
    let (docs, features) = match args.as_slice() {
        [docs, features] => (docs.clone(), features.clone()),
        _ => {
            let dir = std::path::absolute(PathBuf::from("target/flumen-demo/delta"))?;
            let docs = dir.join("docs");
            if !docs.join("_delta_log").exists() {
                let parquet = dir.join("docs-source.parquet");
                println!(
                    "writing demo documents into the Delta table {}",
                    docs.display()
                );
                flumen::demo::write_docs(&parquet, 2_000)?;
                ctx.register_parquet("demo", parquet.to_str().unwrap(), Default::default())
                    .await?;
                ctx.sql(&format!(
                    "CREATE EXTERNAL TABLE new_docs (id BIGINT NOT NULL, topic VARCHAR, body VARCHAR) \
                     STORED AS DELTATABLE LOCATION '{}'",
                    docs.display()
                ))
                .await?;
                ctx.sql("INSERT INTO new_docs SELECT id, topic, body FROM demo")
                    .await?
                    .collect()
                    .await?;
            }
            let docs = docs.to_str().unwrap().to_string();
            let features = dir.join("features").to_str().unwrap().to_string();
            (docs, features)
        }
    };
    for location in [&docs, &features] {
        flumen::io::register_for_location(&ctx, location, &[])?;
    }
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE docs STORED AS DELTATABLE LOCATION '{docs}'"
    ))
    .await?;
    // Created empty on the first run; later runs append a version.
    ctx.sql(&format!(
        "CREATE EXTERNAL TABLE features (id BIGINT NOT NULL, v FLOAT[]) \
         STORED AS DELTATABLE LOCATION '{features}'"
    ))
    .await?;
    let started = Instant::now();
    let written = ctx
        .sql("INSERT INTO features SELECT id, embed(clean_text(body)) FROM docs")
        .await?
        .collect()
        .await?;
    let rows = datafusion::arrow::util::pretty::pretty_format_batches(&written)?.to_string();
    println!(
        "embedded and committed {} rows to {features} in {:.2}s",
        rows.lines()
            .nth(3)
            .unwrap_or("")
            .trim_matches(|c| c == '|' || c == ' '),
        started.elapsed().as_secs_f64()
    );
    ctx.sql(
        "SELECT count(*) AS rows, count(DISTINCT id) AS ids, min(array_length(v)) AS dims \
         FROM features",
    )
    .await?
    .show()
    .await?;
    Ok(())
}
