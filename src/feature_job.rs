//! The main job, shared by `flumen extract` and `examples/feature_extraction.rs`: Parquet
//! in → per-document features (among them a 384-wide sentence embedding of the cleaned
//! text, `embed(clean_text(body))`, `clean_text` in CPU tasks and `embed` on the
//! accelerator pool) → Parquet out, then a semantic search over what it wrote.

use std::path::{Path, PathBuf};
use std::time::Instant;

use datafusion::error::{DataFusionError, Result};
use datafusion::prelude::{ParquetReadOptions, SessionContext};

/// The features the job computes per document of a table with `id`, `topic` and `body`
/// (a `SELECT` list).
pub const FEATURES: &str = "id, topic, \
     length(clean_text(body)) AS chars, \
     array_length(string_to_array(clean_text(body), ' ')) AS words, \
     md5(lower(clean_text(body))) AS fingerprint, \
     embed(clean_text(body)) AS embedding";

/// Where the job works when given no paths.
pub const DEMO_DIR: &str = "target/flumen-demo";

/// Rows of the generated demo table (`FLUMEN_DEMO_ROWS` overrides it).
pub const DEMO_ROWS: usize = 5_000;

/// The input and output of the job: the given paths, or the demo table under
/// [`DEMO_DIR`] (generated on first use) and `features.parquet` beside it.
pub fn job_paths(paths: Option<(PathBuf, PathBuf)>) -> Result<(PathBuf, PathBuf)> {
    if let Some(paths) = paths {
        return Ok(paths);
    }
    let dir = PathBuf::from(DEMO_DIR);
    let input = dir.join("docs-html.parquet");
    if !input.exists() {
        println!("generating demo table {}", input.display());
        let rows = std::env::var("FLUMEN_DEMO_ROWS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(DEMO_ROWS);
        crate::demo::write_docs(&input, rows)?;
    }
    Ok((input, dir.join("features.parquet")))
}

/// Run the job on `ctx` over `input` (a Parquet table with `id`, `topic`, `body`), writing
/// the features to `output`, and print what it wrote and the closest documents to a query.
pub async fn run_feature_extraction(
    ctx: &SessionContext,
    input: &Path,
    output: &Path,
) -> Result<()> {
    let path = |p: &Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or_else(|| DataFusionError::Plan(format!("path {} is not UTF-8", p.display())))
    };
    ctx.register_parquet("docs", path(input)?, ParquetReadOptions::default())
        .await?;
    let started = Instant::now();
    let sql = format!(
        "COPY (SELECT {FEATURES} FROM docs) TO '{}' STORED AS PARQUET",
        path(output)?.replace('\'', "''")
    );
    let written = ctx.sql(&sql).await?.collect().await?;
    let rows: u64 = written
        .iter()
        .filter_map(|b| {
            b.column(0)
                .as_any()
                .downcast_ref::<datafusion::arrow::array::UInt64Array>()
                .map(|a| a.iter().flatten().sum::<u64>())
        })
        .sum();
    println!(
        "wrote {rows} rows of features to {} in {:.2}s",
        output.display(),
        started.elapsed().as_secs_f64()
    );
    ctx.register_parquet("features", path(output)?, ParquetReadOptions::default())
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
