//! Parquet in → features → Parquet out, on flumen's streaming executor, embedded in a
//! program of your own (the same job as `flumen extract`).
//!
//! With no arguments it generates a demo `docs` table (5,000 deterministic HTML documents,
//! `flumen::demo`) under `target/flumen-demo/`, computes per-document features with SQL —
//! among them a 384-wide sentence embedding of the cleaned text, `embed(clean_text(body))`,
//! with `clean_text` in CPU tasks and `embed` on the accelerator pool — writes them to
//! `target/flumen-demo/features.parquet`, then runs a semantic search over what it wrote.
//!
//! Needs the model: `flumen install-model`.
//!
//! Run: `cargo run --release --example feature_extraction [-- INPUT.parquet OUTPUT.parquet]`
//! (`FLUMEN_DEMO_ROWS` sets the demo table's size.)

use std::path::PathBuf;

use datafusion::error::Result;
use flumen::feature_job::{job_paths, run_feature_extraction};

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let paths = match args.as_slice() {
        [i, o] => Some((PathBuf::from(i), PathBuf::from(o))),
        _ => None,
    };
    let (input, output) = job_paths(paths)?;
    let ctx = flumen::session(flumen::FlumenConfig::default());
    run_feature_extraction(&ctx, &input, &output).await
}
