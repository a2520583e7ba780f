//! Parquet in → features → Parquet out, on flumen's streaming executor.
//!
//! With no arguments it generates a demo `docs` table (5,000 deterministic HTML documents,
//! `flumen::demo`) under `target/flumen-demo/`, computes per-document features with SQL —
//! among them a 384-wide sentence embedding of the cleaned text, `embed(clean_text(body))`,
//! with `clean_text` in CPU tasks and `embed` on the accelerator pool — writes them to
//! `target/flumen-demo/features.parquet`, then runs a semantic search over what it wrote.
//!
//! Needs the model: `cargo run --release --bin flumen -- install-model`.
//!
//! Run: `cargo run --release --example feature_extraction [-- INPUT.parquet OUTPUT.parquet]`
//! (`FLUMEN_DEMO_ROWS` sets the demo table's size.)

use std::path::PathBuf;
use std::time::Instant;

use datafusion::error::Result;
use datafusion::prelude::ParquetReadOptions;

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let demo_dir = PathBuf::from("target/flumen-demo");
    let (input, output) = match args.as_slice() {
        [i, o] => (PathBuf::from(i), PathBuf::from(o)),
        _ => {
            let input = demo_dir.join("docs-html.parquet");
            if !input.exists() {
                println!("generating demo table {}", input.display());
                let rows = std::env::var("FLUMEN_DEMO_ROWS")
                    .ok()
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(5_000);
                flumen::demo::write_docs(&input, rows)?;
            }
            (input, demo_dir.join("features.parquet"))
        }
    };

    let ctx = flumen::session(flumen::FlumenConfig::default());
    ctx.register_parquet(
        "docs",
        input.to_str().unwrap(),
        ParquetReadOptions::default(),
    )
    .await?;
    let started = Instant::now();
    let sql = format!(
        "COPY (SELECT id, topic, \
                 length(clean_text(body)) AS chars, \
                 array_length(string_to_array(clean_text(body), ' ')) AS words, \
                 md5(lower(clean_text(body))) AS fingerprint, \
                 embed(clean_text(body)) AS embedding \
               FROM docs) \
         TO '{}' STORED AS PARQUET",
        output.display()
    );
    let written = ctx.sql(&sql).await?.collect().await?;
    println!(
        "wrote {} rows of features to {} in {:.2}s",
        datafusion::arrow::util::pretty::pretty_format_batches(&written)?
            .to_string()
            .lines()
            .nth(3)
            .unwrap_or("")
            .trim_matches(|c| c == '|' || c == ' '),
        output.display(),
        started.elapsed().as_secs_f64()
    );
    ctx.register_parquet(
        "features",
        output.to_str().unwrap(),
        ParquetReadOptions::default(),
    )
    .await?;
    ctx.sql(
        "SELECT count(*) AS docs, round(avg(words), 1) AS avg_words, count(DISTINCT topic) AS topics \
         FROM features",
    )
    .await?
    .show()
    .await?;
    println!("documents closest to 'graphics cards and parallel hardware':");
    ctx.sql(
        "SELECT id, topic, round(cosine_similarity(embedding, embed('graphics cards and parallel hardware')), 3) AS score \
         FROM features ORDER BY score DESC, id LIMIT 5",
    )
    .await?
    .show()
    .await?;
    Ok(())
}
