//! Plan shapes: flumen's operators in `EXPLAIN`, checked as insta snapshots.

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::prelude::SessionConfig;
use flumen::FlumenConfig;

async fn explain(sql: &str) -> String {
    let ctx = flumen::session_with_config(
        SessionConfig::new().with_target_partitions(2),
        FlumenConfig::default(),
    );
    for setup in [
        "SET flumen.cpu_slots = 2",
        "SET flumen.accelerator_slots = 1",
        "SET datafusion.explain.physical_plan_only = true",
        "CREATE TABLE t AS SELECT x AS id, x % 7 AS k FROM generate_series(1, 100) AS g(x)",
        "CREATE TABLE d AS VALUES (0, 'zero'), (1, 'one')",
    ] {
        ctx.sql(setup).await.unwrap().collect().await.unwrap();
    }
    let batches = ctx
        .sql(&format!("EXPLAIN {sql}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    pretty_format_batches(&batches).unwrap().to_string()
}

#[tokio::test]
async fn explain_group_by_shows_operators_cut_at_the_hash_exchange() {
    insta::assert_snapshot!(explain("SELECT k, count(*) FROM t GROUP BY k").await);
}

#[tokio::test]
async fn explain_order_by_limit_shows_merge_of_sorted_runs() {
    insta::assert_snapshot!(explain("SELECT id FROM t ORDER BY id DESC LIMIT 3").await);
}

#[tokio::test]
async fn explain_join_shows_the_collected_build_side() {
    insta::assert_snapshot!(
        explain("SELECT t.id, d.column2 FROM t JOIN d ON t.k = d.column1").await
    );
}
