//! Progress of a running query in words: one line per flumen operator (rows and blocks
//! done, tasks done of the total for sources, running, pool, time held back by
//! backpressure) and one for the workers' hosts. The REPL draws them under a running query;
//! `flumen serve` lists them for its running queries.

use std::sync::Arc;

use datafusion::physical_plan::ExecutionPlan;

use super::{FlumenExec, RunMetrics, StatsSnapshot};
use crate::plan::{Operator, TaskShape};

/// The first `FlumenExec` in `plan`.
pub fn find_flumen_exec(plan: &Arc<dyn ExecutionPlan>) -> Option<&FlumenExec> {
    if let Some(exec) = plan.downcast_ref::<FlumenExec>() {
        return Some(exec);
    }
    plan.children().into_iter().find_map(find_flumen_exec)
}

/// The progress line of every operator of `plan`'s flumen run (none for a plan without).
pub fn operator_progress(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let Some(exec) = find_flumen_exec(plan) else {
        return vec![];
    };
    let metrics = exec.run_metrics();
    let mut lines: Vec<String> = exec
        .graph()
        .operators
        .iter()
        .map(|op| operator_line(op, &metrics.operator(op.id).snapshot()))
        .collect();
    lines.extend(hosts_line(metrics));
    lines
}

/// One operator's progress line.
pub fn operator_line(op: &Operator, s: &StatsSnapshot) -> String {
    let tasks = if op.shape == TaskShape::Source {
        format!("{}/{}", s.tasks, op.splits.iter().sum::<usize>())
    } else {
        s.tasks.to_string()
    };
    format!(
        "op{} {:<26} [{}] rows={} blocks={} tasks={} running={} backpressure={:.1}s",
        op.id,
        op.name,
        op.pool,
        s.rows,
        s.blocks,
        tasks,
        s.running,
        s.backpressure_ns as f64 / 1e9
    )
}

/// The workers' line: tasks run on each host, and workers lost, joined and rejoined;
/// `None` before a task ran in a worker.
pub fn hosts_line(metrics: &RunMetrics) -> Option<String> {
    let hosts = metrics.tasks_by_host();
    if hosts.is_empty() {
        return None;
    }
    let per_host: Vec<String> = hosts
        .iter()
        .map(|(host, tasks)| format!("{host}: {tasks}"))
        .collect();
    let [lost, joined, rejoined] = metrics.membership();
    Some(format!(
        "workers  tasks by host [{}] lost={lost} joined={joined} rejoined={rejoined}",
        per_host.join(", ")
    ))
}
