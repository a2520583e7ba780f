//! TPC-H in tests: the tables as multi-file Parquet (the benches' generator) and the 22
//! queries run on flumen and on vanilla DataFusion, answers compared by value.

#[path = "../../benches/common/tpch_tables.rs"]
#[allow(dead_code)]
pub mod tables;

use std::sync::Arc;

use datafusion::prelude::SessionContext;

/// What running the 22 queries on flumen gave, against vanilla DataFusion.
#[derive(Debug, Default)]
pub struct Comparison {
    /// A line (and the two answers) for each query flumen failed or answered differently.
    pub failures: Vec<String>,
    /// Tasks of flumen's runs that ran in a worker, and all their tasks.
    pub remote_tasks: u64,
    pub tasks: u64,
}

/// Run every statement of the 22 TPC-H queries on `vanilla` and `flumen` (both with the
/// tables registered) and compare each answer.
pub async fn compare_queries(vanilla: &SessionContext, flumen: &SessionContext) -> Comparison {
    let slt = tables::slt_dir();
    let mut out = Comparison::default();
    for q in 1..=22 {
        for sql in tables::query_statements(&slt, q) {
            let expected = vanilla.sql(&sql).await.unwrap().collect().await.unwrap();
            let plan = match flumen.sql(&sql).await {
                Ok(df) => df.create_physical_plan().await,
                Err(e) => Err(e),
            };
            let result = match plan {
                Ok(plan) => {
                    datafusion::physical_plan::collect(Arc::clone(&plan), flumen.task_ctx())
                        .await
                        .map(|batches| (plan, batches))
                }
                Err(e) => Err(e),
            };
            match result {
                Ok((plan, actual)) => {
                    let ordered = sql.to_ascii_uppercase().contains("ORDER BY");
                    if !super::same_rows(&expected, &actual, ordered) {
                        out.failures.push(format!(
                            "q{q}: a different answer\nvanilla: {:?}\nflumen: {:?}",
                            super::rows(&expected, ordered),
                            super::rows(&actual, ordered)
                        ));
                    }
                    let (remote, tasks) = super::remote_and_all_tasks(&plan);
                    out.remote_tasks += remote;
                    out.tasks += tasks;
                }
                Err(e) => out.failures.push(format!("q{q}: {e}")),
            }
        }
    }
    out
}
