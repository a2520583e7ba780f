//! DataFusion's own counters of a task plan run in a worker (row groups, pages and file
//! ranges pruned, rows a pushed-down filter dropped, spills), carried back to the driver.
//!
//! A task run on the driver's threads runs the operator's own plan nodes, which keep
//! DataFusion's counters for `EXPLAIN ANALYZE`. A worker runs a decoded copy, whose
//! counters would die with the task: the worker sends [`PlanMetric`]s with the task's end
//! ([`crate::cluster::protocol::TaskEvent::Done`]) and the driver sums them per operator,
//! which `EXPLAIN ANALYZE` shows on the operator's line under DataFusion's names.
//!
//! The models and the model-output cache a task used count on the worker's threads too
//! (batch sizes, cache hits, bytes read): they travel beside these as [`TaskFigures::model`].

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::common::format::MetricType;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::MetricValue;
use serde::{Deserialize, Serialize};

/// What a worker's task reports when it finishes, besides its blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskFigures {
    /// DataFusion's counters of its plan ([`carried`]).
    pub plan: Vec<PlanMetric>,
    /// The figures of the models it ran and of the model-output cache it used, by name, as
    /// a task on the driver's threads reports them
    /// ([`OperatorStats::observe_model_metrics`](crate::exec::metrics::OperatorStats::observe_model_metrics)).
    pub model: Vec<(String, u64)>,
    /// The bounds its aggregates and TopK sorts made ([`crate::cluster::sent_bounds`]).
    pub bounds: Vec<crate::cluster::sent_bounds::SentBound>,
    /// The summary of its output's keys, for a task of a join's build producer
    /// ([`crate::cluster::sent_keys`]).
    pub build_keys: Option<crate::cluster::sent_keys::SentKeys>,
}

/// One counter of a worker's run of a task plan, summed over its nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanMetric {
    /// DataFusion's name for it (`row_groups_pruned_statistics`, `spill_count`, ...).
    pub name: String,
    /// Its value.
    pub value: PlanMetricValue,
    /// Whether DataFusion counts it a summary metric (shown at `analyze_level = summary`),
    /// not a developer's one.
    #[serde(default)]
    pub summary: bool,
    /// Its category as DataFusion names it (`rows`, `bytes`, ...), which
    /// `datafusion.explain.analyze_categories` filters on; `None`: none declared.
    #[serde(default)]
    pub category: Option<String>,
}

/// A carried counter's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PlanMetricValue {
    /// A plain count.
    Count(u64),
    /// Items pruned, matched (not pruned), and fully matched, as DataFusion's pruning
    /// counters hold them.
    Pruning {
        /// Items pruned.
        pruned: u64,
        /// Items matched.
        matched: u64,
        /// Items fully matched.
        fully_matched: u64,
    },
}

impl PlanMetricValue {
    /// `self` plus `other` (of the same kind; a count meeting a pruning counter keeps
    /// `self`).
    fn plus(self, other: PlanMetricValue) -> PlanMetricValue {
        match (self, other) {
            (PlanMetricValue::Count(a), PlanMetricValue::Count(b)) => PlanMetricValue::Count(a + b),
            (
                PlanMetricValue::Pruning {
                    pruned,
                    matched,
                    fully_matched,
                },
                PlanMetricValue::Pruning {
                    pruned: p,
                    matched: m,
                    fully_matched: f,
                },
            ) => PlanMetricValue::Pruning {
                pruned: pruned + p,
                matched: matched + m,
                fully_matched: fully_matched + f,
            },
            (kept, _) => kept,
        }
    }
}

/// Plain counts carried besides every pruning counter and the spill counters: rows a
/// pushed-down filter or the page index dropped or kept.
const CARRIED_COUNTS: &[&str] = &[
    "pushdown_rows_pruned",
    "pushdown_rows_matched",
    "page_index_pages_skipped_by_fully_matched",
];

/// The counters of `plan`'s nodes that a worker carries back, summed by name.
pub fn carried(plan: &Arc<dyn ExecutionPlan>) -> Vec<PlanMetric> {
    let sums = CarriedSums::default();
    collect(plan, &sums);
    sums.metrics()
}

fn collect(plan: &Arc<dyn ExecutionPlan>, sums: &CarriedSums) {
    if let Some(metrics) = plan.metrics() {
        for metric in metrics.iter() {
            let carried = match metric.value() {
                MetricValue::PruningMetrics {
                    name,
                    pruning_metrics,
                } => Some((
                    name.to_string(),
                    PlanMetricValue::Pruning {
                        pruned: pruning_metrics.pruned() as u64,
                        matched: pruning_metrics.matched() as u64,
                        fully_matched: pruning_metrics.fully_matched() as u64,
                    },
                )),
                MetricValue::SpillCount(c) => Some(("spill_count".into(), count(c.value()))),
                MetricValue::SpilledBytes(c) => Some(("spilled_bytes".into(), count(c.value()))),
                MetricValue::SpilledRows(c) => Some(("spilled_rows".into(), count(c.value()))),
                MetricValue::Count { name, count: c }
                    if CARRIED_COUNTS.contains(&name.as_ref()) =>
                {
                    Some((name.to_string(), count(c.value())))
                }
                _ => None,
            };
            if let Some((name, value)) = carried {
                sums.add(vec![PlanMetric {
                    name,
                    value,
                    summary: metric.metric_type() == MetricType::Summary,
                    category: metric.metric_category().map(|c| c.to_string()),
                }]);
            }
        }
    }
    for child in plan.children() {
        collect(child, sums);
    }
}

fn count(value: usize) -> PlanMetricValue {
    PlanMetricValue::Count(value as u64)
}

/// Counters carried from an operator's worker tasks, summed by name (with whether each
/// is a summary metric).
#[derive(Debug, Default)]
pub struct CarriedSums(std::sync::Mutex<BTreeMap<String, PlanMetric>>);

impl CarriedSums {
    /// Add one task's counters.
    pub fn add(&self, metrics: Vec<PlanMetric>) {
        let mut sums = self.0.lock().unwrap();
        for metric in metrics {
            match sums.get_mut(&metric.name) {
                Some(sum) => sum.value = sum.value.plus(metric.value),
                None => {
                    sums.insert(metric.name.clone(), metric);
                }
            }
        }
    }

    /// The sums so far.
    pub fn metrics(&self) -> Vec<PlanMetric> {
        self.0.lock().unwrap().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_by_name_and_kind() {
        let sums = CarriedSums::default();
        let pruning = |pruned, matched| PlanMetricValue::Pruning {
            pruned,
            matched,
            fully_matched: 0,
        };
        let metric = |name: &str, value| PlanMetric {
            name: name.into(),
            value,
            summary: true,
            category: Some("rows".into()),
        };
        sums.add(vec![
            metric("row_groups_pruned_statistics", pruning(1, 3)),
            metric("spill_count", PlanMetricValue::Count(2)),
        ]);
        sums.add(vec![metric("row_groups_pruned_statistics", pruning(2, 0))]);
        let sums = sums.metrics();
        assert_eq!(sums[0].name, "row_groups_pruned_statistics");
        assert_eq!(sums[0].value, pruning(3, 3));
        assert_eq!(sums[1].value, PlanMetricValue::Count(2));
    }
}
