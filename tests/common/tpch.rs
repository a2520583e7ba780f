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
    /// For each operator (but the root the output runs) that ran tasks on the driver: the
    /// query, the operator, and how many of its tasks.
    pub tasks_on_driver: Vec<String>,
    /// Tasks of every operator (roots included) that ran on the driver, by reason
    /// (`flumen::cluster::on_driver::OnDriver::reason`).
    pub on_driver_by_reason: std::collections::BTreeMap<&'static str, u64>,
    /// Per-partition operators (but the roots the output runs) over the 22 queries, and
    /// those whose every task ran in a worker.
    pub reduce_operators: usize,
    pub reduce_operators_on_workers: usize,
    /// Tasks recomputed or retried (a clean run has none: an input released while another
    /// task still needed it is lost, and recomputed).
    pub redone: u64,
    /// Source tasks that read nothing, their whole split ruled out by bounds at launch.
    pub pruned_at_launch: u64,
    /// Tasks counted on the host of the worker that ran them (`remote_tasks_by_host`).
    pub counted_on_hosts: u64,
    /// The worker hosts those operators' tasks ran on.
    pub reduce_hosts: std::collections::BTreeSet<String>,
    /// Bytes of blocks the driver fetched from the workers, and of the answers (both as
    /// `flumen::store::rows_bytes` counts them).
    pub driver_fetched_bytes: u64,
    pub result_bytes: u64,
}

impl Comparison {
    /// Check that every query gave vanilla's answer (each failure's line and answers shown).
    pub fn assert_answers_match(&self) {
        assert!(self.failures.is_empty(), "{}", self.failures.join("\n"));
    }

    /// Print the operators that ran tasks on the driver, and check that none did but the
    /// roots the output runs, that the driver fetched at most 1.1 times the answers' bytes,
    /// and that at least `at_least` per-partition operators ran (joins,
    /// final aggregates, sorts and windows go to the workers, `flumen::plan::partition_cut`;
    /// joins that emit build rows are planned partitioned there,
    /// `flumen::plan::partitioned_outer_joins`).
    pub fn assert_all_on_workers(&self, at_least: usize) {
        println!(
            "{} of {} per-partition operators ran all their tasks in workers; on the driver:\n{}",
            self.reduce_operators_on_workers,
            self.reduce_operators,
            self.tasks_on_driver.join("\n")
        );
        assert_eq!(self.redone, 0, "tasks recomputed or retried in a clean run");
        println!(
            "the driver fetched {} bytes of blocks for answers of {} bytes",
            self.driver_fetched_bytes, self.result_bytes
        );
        // The roots run on the workers too (`OperatorGraph::root_on_workers`; merges of
        // sorted partitions included): the driver fetches the answers, not each
        // partition's top rows or partial aggregates.
        assert!(
            self.driver_fetched_bytes as f64 <= 1.1 * self.result_bytes as f64,
            "the driver fetched {} bytes for answers of {}",
            self.driver_fetched_bytes,
            self.result_bytes
        );

        assert!(
            self.tasks_on_driver.is_empty() && self.reduce_operators >= at_least,
            "{} per-partition operators; tasks on the driver:\n{}",
            self.reduce_operators,
            self.tasks_on_driver.join("\n")
        );
    }
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
                    let on_driver = tasks_on_driver(&plan);
                    for (reason, n) in on_driver_by_reason(&plan) {
                        *out.on_driver_by_reason.entry(reason).or_default() += n;
                    }
                    let reduces = reduce_operators(&plan);
                    out.reduce_hosts.extend(reduce_hosts(&plan));
                    out.redone += tasks_redone(&plan);
                    out.pruned_at_launch += summed(&plan, |s| s.tasks_pruned_at_launch);
                    out.counted_on_hosts += counted_on_hosts(&plan);
                    out.driver_fetched_bytes += driver_fetched_bytes(&plan);
                    out.result_bytes += actual.iter().map(flumen::store::rows_bytes).sum::<u64>();
                    out.reduce_operators += reduces;
                    out.reduce_operators_on_workers += reduces - reduces_on_driver(&plan);
                    out.tasks_on_driver
                        .extend(on_driver.into_iter().map(|l| format!("q{q}: {l}")));
                }
                Err(e) => out.failures.push(format!("q{q}: {e}")),
            }
        }
    }
    out
}

/// The operators of a finished flumen plan (but a root the output runs) that ran tasks on
/// the driver, each as "NAME (operator ID): N of M tasks on the driver {REASON: N}".
pub fn tasks_on_driver(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> Vec<String> {
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return vec![];
    };
    let graph = exec.graph();
    let metrics = exec.run_metrics();
    (graph.operators.iter())
        .filter(|op| op.id != graph.root().id)
        .map(|op| (op, metrics.operator(op.id)))
        .filter(|(_, stats)| stats.snapshot().tasks_on_driver > 0)
        .map(|(op, stats)| {
            let s = stats.snapshot();
            format!(
                "{} (operator {}): {} of {} tasks on the driver {:?}",
                op.name,
                op.id,
                s.tasks_on_driver,
                s.tasks,
                stats.on_driver()
            )
        })
        .collect()
}

/// Tasks of a finished flumen plan (roots included) that ran on the driver, by reason.
fn on_driver_by_reason(
    plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>,
) -> std::collections::BTreeMap<&'static str, u64> {
    let mut by_reason = std::collections::BTreeMap::new();
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return by_reason;
    };
    for op in &exec.graph().operators {
        for (reason, n) in exec.run_metrics().operator(op.id).on_driver() {
            *by_reason.entry(reason).or_default() += n;
        }
    }
    by_reason
}

/// Bytes of blocks the driver of a finished flumen plan fetched from the workers.
fn driver_fetched_bytes(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> u64 {
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return 0;
    };
    (exec.graph().operators.iter())
        .map(|op| {
            exec.run_metrics()
                .operator(op.id)
                .snapshot()
                .output_bytes_to_driver
        })
        .sum()
}

/// Tasks of a finished flumen plan recomputed or retried.
fn tasks_redone(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> u64 {
    summed(plan, |s| s.recomputed + s.tasks_retried)
}

/// Tasks of a finished flumen plan counted on the host of the worker that ran them.
fn counted_on_hosts(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> u64 {
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return 0;
    };
    (exec.graph().operators.iter())
        .flat_map(|op| exec.run_metrics().operator(op.id).remote_tasks_by_host())
        .map(|(_, n)| n)
        .sum()
}

/// `count` of each operator's counters, summed over a finished flumen plan.
fn summed(
    plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>,
    count: impl Fn(&flumen::exec::StatsSnapshot) -> u64,
) -> u64 {
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return 0;
    };
    (exec.graph().operators.iter())
        .map(|op| count(&exec.run_metrics().operator(op.id).snapshot()))
        .sum()
}

/// How many per-partition operators (but a root the output runs) of a finished flumen plan
/// ran tasks on the driver.
fn reduces_on_driver(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> usize {
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return 0;
    };
    let graph = exec.graph();
    (graph.operators.iter())
        .filter(|op| op.shape == flumen::plan::TaskShape::Barrier && op.id != graph.root().id)
        .filter(|op| {
            exec.run_metrics()
                .operator(op.id)
                .snapshot()
                .tasks_on_driver
                > 0
        })
        .count()
}

/// How many per-partition operators (but a root the output runs) a flumen plan has.
pub fn reduce_operators(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> usize {
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return 0;
    };
    let graph = exec.graph();
    (graph.operators.iter())
        .filter(|op| op.shape == flumen::plan::TaskShape::Barrier && op.id != graph.root().id)
        .count()
}

/// The worker hosts the per-partition operators of a finished flumen plan ran tasks on.
pub fn reduce_hosts(plan: &Arc<dyn datafusion::physical_plan::ExecutionPlan>) -> Vec<String> {
    let Some(exec) = plan.downcast_ref::<flumen::exec::FlumenExec>() else {
        return vec![];
    };
    let graph = exec.graph();
    let metrics = exec.run_metrics();
    (graph.operators.iter())
        .filter(|op| op.shape == flumen::plan::TaskShape::Barrier)
        .flat_map(|op| metrics.operator(op.id).remote_tasks_by_host().into_keys())
        .collect()
}
