//! Incremental extraction and the model-output cache, measured against their baselines in
//! the same run (`docs/benchmarks.md` keeps the figures).
//!
//! ```text
//! cargo bench --bench incremental -- [--docs 20000] [--changed 0.05] [--python PATH]
//! ```
//!
//! - **Incremental**: a Delta source of `--docs` documents (written by the Python
//!   `deltalake` writer, `tests/incremental/change_source.py`, change data feed on); the
//!   first `flumen extract --incremental` run computes every row (the full run); then
//!   `--changed` of the rows are updated and as many inserted, and the incremental run is
//!   timed. Goal: its time ≤ 15% of the full run's, its model rows = changed + new.
//! - **Cache**: `SELECT id, embed(body)` over the same documents (a Parquet copy) without
//!   the cache (the baseline), then twice with an empty cache: the first run all misses
//!   (overhead goal ≤ 5% over the baseline), the second all hits (goal ≥ 20x faster than
//!   the first); the lookup's cost per hit against the model's cost per row.
//!
//! Both on the CPU (`flumen.device = 'cpu'`), the model from `flumen install-model`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use datafusion::error::Result;
use datafusion::prelude::SessionContext;
use flumen::FlumenConfig;

struct Args {
    docs: usize,
    changed: f64,
    python: String,
}

fn args() -> Args {
    let mut args = Args {
        docs: 20_000,
        changed: 0.05,
        python: concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-venv/bin/python").into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--docs" => args.docs = it.next().and_then(|v| v.parse().ok()).expect("--docs N"),
            "--changed" => {
                args.changed = it.next().and_then(|v| v.parse().ok()).expect("--changed F")
            }
            "--python" => args.python = it.next().expect("--python PATH"),
            _ => {}
        }
    }
    args
}

fn change_source(python: &str, path: &Path, args: &[&str]) {
    let status = Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/incremental/change_source.py"
        ))
        .arg(path)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run change_source.py (install the deltalake writer: tests/install-test-tools.sh)");
    assert!(status.success(), "change_source.py {args:?} failed");
}

/// A CPU session, with the model-output cache at `cache` ('' for none).
fn session(cache: &str) -> SessionContext {
    let mut config = FlumenConfig::default();
    config.device = flumen::config::Device::Cpu;
    config.model_cache = cache.to_string();
    flumen::session(config)
}

/// Seconds `sql` takes on `ctx` (its result collected).
async fn timed(ctx: &SessionContext, sql: &str) -> Result<f64> {
    let started = Instant::now();
    ctx.sql(sql).await?.collect().await?;
    Ok(started.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = args();
    let dir = tempfile::tempdir()?;
    let source = dir.path().join("docs");
    let features = dir.path().join("features");
    let text = |p: &Path| p.display().to_string();
    let changed = ((args.docs as f64) * args.changed).round() as usize;
    println!(
        "incremental: {} docs, {changed} updated and {changed} inserted",
        args.docs
    );
    change_source(&args.python, &source, &["create", &args.docs.to_string()]);
    let full =
        flumen::incremental::extract_incremental(&session(""), &text(&source), &text(&features))
            .await?;
    change_source(
        &args.python,
        &source,
        &["grow", &args.docs.to_string(), &changed.to_string()],
    );
    let step =
        flumen::incremental::extract_incremental(&session(""), &text(&source), &text(&features))
            .await?;
    let ratio = step.seconds / full.seconds;
    println!(
        "  full run: {} rows in {:.2} s; incremental run: {} rows computed, {} removed, in \
         {:.2} s: {:.1}% of the full run (goal ≤ 15%: {}); model rows = changed + new: {}",
        full.computed_rows,
        full.seconds,
        step.computed_rows,
        step.removed_rows,
        step.seconds,
        ratio * 100.0,
        if ratio <= 0.15 { "met" } else { "NOT met" },
        step.computed_rows == 2 * changed as u64
    );

    // The cache, over a Parquet copy of the same documents.
    let docs = dir.path().join("docs.parquet");
    let copy = session("");
    copy.sql(&format!(
        "CREATE EXTERNAL TABLE src STORED AS DELTATABLE LOCATION '{}'",
        text(&source)
    ))
    .await?;
    copy.sql(&format!("COPY (SELECT * FROM src) TO '{}'", text(&docs)))
        .await?
        .collect()
        .await?;
    let query = "SELECT id, embed(body) AS v FROM docs";
    let cache = dir.path().join("cache");
    let run = |cache: String| {
        let docs = docs.clone();
        async move {
            let ctx = session(&cache);
            ctx.sql(&format!(
                "CREATE EXTERNAL TABLE docs STORED AS PARQUET LOCATION '{}'",
                docs.display()
            ))
            .await?;
            timed(&ctx, query).await
        }
    };
    let rows = (args.docs + changed) as f64;
    let baseline = run(String::new()).await?;
    let cold = run(text(&cache)).await?;
    let warm = run(text(&cache)).await?;
    let overhead = cold / baseline - 1.0;
    let speedup = cold / warm;
    println!("cache: {} rows, `{query}`", rows as u64);
    println!(
        "  no cache {baseline:.2} s; empty cache (all misses) {cold:.2} s: overhead {:+.1}% \
         (goal ≤ 5%: {}); full cache (all hits) {warm:.3} s: {speedup:.1}x faster than the \
         first (goal ≥ 20x: {})",
        overhead * 100.0,
        if overhead <= 0.05 { "met" } else { "NOT met" },
        if speedup >= 20.0 { "met" } else { "NOT met" },
    );
    println!(
        "  per row: model {:.1} µs, cache hit {:.2} µs (the whole query's time per row)",
        baseline / rows * 1e6,
        warm / rows * 1e6
    );
    println!(
        "incremental docs={} incremental_ratio={ratio:.3} cache_overhead={overhead:.3} \
         cache_speedup={speedup:.1}",
        args.docs
    );
    Ok(())
}
