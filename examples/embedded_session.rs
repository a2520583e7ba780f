//! A DataFusion program switched to flumen by changing one line.
//!
//! Run: `cargo run --example embedded_session`

use datafusion::error::Result;

/// Optional: the system's allocator, counted, so that flumen's memory budget also covers
/// the heap no operator reserved (the `flumen` binary does this with jemalloc).
#[global_allocator]
static ALLOCATOR: flumen::CountingAllocator<std::alloc::System> =
    flumen::CountingAllocator::new(std::alloc::System);

#[tokio::main]
async fn main() -> Result<()> {
    flumen::install_heap_allocator(&ALLOCATOR);
    // Before: let ctx = datafusion::prelude::SessionContext::new();
    let ctx = flumen::session(flumen::FlumenConfig::default());

    ctx.sql("CREATE TABLE sales AS SELECT x AS id, x % 10 AS store, x * 0.5 AS amount FROM generate_series(1, 100000) AS t(x)")
        .await?
        .collect()
        .await?;
    ctx.sql("SELECT store, count(*) AS orders, sum(amount) AS revenue FROM sales GROUP BY store ORDER BY store")
        .await?
        .show()
        .await?;
    // The plan is DataFusion's, cut into flumen operators.
    ctx.sql("EXPLAIN SELECT store, sum(amount) FROM sales GROUP BY store")
        .await?
        .show()
        .await?;
    Ok(())
}
