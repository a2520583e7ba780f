//! Parquet in → features → Parquet out, on flumen's streaming executor.
//!
//! With no arguments it generates a demo `docs` table (10,000 deterministic text rows) under
//! `target/flumen-demo/`, computes per-document features with SQL — among them a 384-wide
//! sentence embedding, `embed(body)`, on the accelerator pool — writes them to
//! `target/flumen-demo/features.parquet`, then runs a semantic search over what it wrote.
//!
//! Needs the model: `cargo run --release --bin flumen -- install-model`.
//!
//! Run: `cargo run --release --example feature_extraction [-- INPUT.parquet OUTPUT.parquet]`
//! (`FLUMEN_DEMO_ROWS` sets the demo table's size.)

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use datafusion::arrow::array::{Int64Array, StringArray};
use datafusion::arrow::datatypes::{DataType, Field, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::Result;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::prelude::ParquetReadOptions;

const TOPICS: &[&str] = &[
    "rivers",
    "databases",
    "gpus",
    "compilers",
    "weather",
    "music",
    "chess",
    "bread",
];

/// Write the demo `docs` table: id and a body of a few sentences.
fn write_demo_docs(path: &Path, rows: i64) -> Result<()> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("body", DataType::Utf8, false),
    ]));
    std::fs::create_dir_all(path.parent().unwrap())?;
    let mut writer = ArrowWriter::try_new(std::fs::File::create(path)?, Arc::clone(&schema), None)?;
    for start in (0..rows).step_by(10_000) {
        let ids: Vec<i64> = (start..(start + 10_000).min(rows)).collect();
        let bodies: Vec<String> = ids
            .iter()
            .map(|i| {
                let topic = TOPICS[(*i as usize * 31) % TOPICS.len()];
                let repeat = 1 + (i % 5) as usize;
                format!(
                    "Document {i} is about {topic}. {}",
                    format!("It discusses {topic} at length, point {i}. ").repeat(repeat)
                )
            })
            .collect();
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(StringArray::from(bodies)),
            ],
        )?;
        writer.write(&batch)?;
    }
    writer.close()?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let demo_dir = PathBuf::from("target/flumen-demo");
    let (input, output) = match args.as_slice() {
        [i, o] => (PathBuf::from(i), PathBuf::from(o)),
        _ => {
            let input = demo_dir.join("docs.parquet");
            if !input.exists() {
                println!("generating demo table {}", input.display());
                let rows = std::env::var("FLUMEN_DEMO_ROWS")
                    .ok()
                    .and_then(|r| r.parse().ok())
                    .unwrap_or(10_000);
                write_demo_docs(&input, rows)?;
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
        "COPY (SELECT id, \
                 length(body) AS chars, \
                 array_length(string_to_array(body, ' ')) AS words, \
                 md5(lower(body)) AS fingerprint, \
                 regexp_like(body, 'gpus|compilers') AS technical, \
                 embed(body) AS embedding \
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
        "SELECT count(*) AS docs, avg(words) AS avg_words, sum(CAST(technical AS INT)) AS technical \
         FROM features",
    )
    .await?
    .show()
    .await?;
    println!("documents closest to 'graphics cards and parallel hardware':");
    ctx.sql(
        "SELECT id, round(cosine_similarity(embedding, embed('graphics cards and parallel hardware')), 3) AS score \
         FROM features ORDER BY score DESC, id LIMIT 5",
    )
    .await?
    .show()
    .await?;
    Ok(())
}
