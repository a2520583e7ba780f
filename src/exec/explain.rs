//! `OperatorExec`: one flumen operator as `EXPLAIN` shows it (pool, slots, task shape,
//! block size, and after a run its counters), with the operators feeding it below its
//! stage inputs. Display only; never executed.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{
    Count, CustomMetricValue, Gauge, Metric, MetricValue, MetricsSet, PruningMetrics, RatioMetrics,
    Time,
};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties,
};

use crate::cluster::plan_metrics::{PlanMetric, PlanMetricValue};
use crate::config::FlumenConfig;
use crate::exec::metrics::{OperatorStats, RunMetrics};
use crate::functions::accelerator::accelerator_function;
use crate::functions::accelerator_devices;
use crate::plan::graph::{Operator, OperatorGraph, OperatorId, Pool};
use crate::plan::stage_input::StageInputExec;
use datafusion::common::format::{MetricCategory, MetricType};

/// The `EXPLAIN` node of operator `id`, with those of the operators feeding it below its
/// stage inputs, showing the counters in `metrics`.
pub(crate) fn display_tree(
    graph: &OperatorGraph,
    id: OperatorId,
    config: &FlumenConfig,
    metrics: &RunMetrics,
) -> Arc<OperatorExec> {
    let op = &graph.operators[id];
    // The fragment's own nodes are shown (they hold DataFusion's counters of the run), with
    // each stage input showing its producer's tree below it.
    let _ = op.fragment.apply(|node| {
        if let Some(stage) = node.downcast_ref::<StageInputExec>() {
            stage.show_producer(display_tree(graph, stage.producer(), config, metrics));
            return Ok(TreeNodeRecursion::Jump);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    Arc::new(OperatorExec::new(
        op,
        config,
        Arc::clone(metrics.operator(id)),
    ))
}

/// One operator in `EXPLAIN` output: its pool, slots, task shape, block size, and after a
/// run (`EXPLAIN ANALYZE`) its counters. Display only; never executed.
#[derive(Debug)]
pub struct OperatorExec {
    id: usize,
    name: String,
    pool: Pool,
    shape: String,
    tasks_hint: usize,
    slots: usize,
    target_block_rows: usize,
    fragment: Arc<dyn ExecutionPlan>,
    stats: Arc<OperatorStats>,
    /// Accelerator functions the operator runs, with what each worker occupies.
    workers: Vec<String>,
    /// Producers of the join probe inputs the operator streams.
    streams: Vec<usize>,
    /// A run-sorting operator's bytes per run ([`Operator::run_bytes`]).
    run_bytes: Option<u64>,
}

/// `name(accelerators=A, cpu_threads=T)` for each accelerator function `op` calls.
fn accelerator_workers(op: &Operator, config: &FlumenConfig) -> Vec<String> {
    let mut options = datafusion::config::ConfigOptions::new();
    options.extensions.insert(config.clone());
    let mut found = vec![];
    for udf in op.accelerator_udfs() {
        let Some(func) = accelerator_function(&udf) else {
            continue;
        };
        let r = func.resources(&options);
        let text = format!(
            "{}(accelerators={}, cpu_threads={})",
            func.name(),
            r.accelerators,
            r.cpu_threads
        );
        if !found.contains(&text) {
            found.push(text);
        }
    }
    found
}

impl OperatorExec {
    /// The display node of `op`, showing the counters `stats`.
    fn new(op: &Operator, config: &FlumenConfig, stats: Arc<OperatorStats>) -> Self {
        Self {
            slots: match op.pool {
                Pool::Cpu => config.cpu_slots,
                Pool::Accelerator => accelerator_devices::accelerator_workers(config),
            },
            workers: match op.pool {
                Pool::Cpu => vec![],
                Pool::Accelerator => accelerator_workers(op, config),
            },
            target_block_rows: config.target_block_rows,
            id: op.id,
            name: op.name.clone(),
            pool: op.pool,
            shape: op.shape.to_string(),
            tasks_hint: op.splits.iter().sum(),
            fragment: Arc::clone(&op.fragment),
            stats,
            streams: op.streamed_producers().collect(),
            run_bytes: op.run_bytes,
        }
    }
}

impl DisplayAs for OperatorExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        match t {
            DisplayFormatType::TreeRender => write!(f, "pool={}", self.pool),
            _ => {
                write!(
                    f,
                    "FlumenOperator: id={}, name={}, pool={}, slots={}, target_block_rows={}, tasks={}",
                    self.id, self.name, self.pool, self.slots, self.target_block_rows, self.shape
                )?;
                if self.shape == "source" {
                    write!(f, ", splits={}", self.tasks_hint)?;
                }
                if let Some(bytes) = self.run_bytes {
                    write!(f, ", sorted_runs_of={bytes}B")?;
                }
                if !self.workers.is_empty() {
                    write!(f, ", workers=[{}]", self.workers.join(", "))?;
                }
                if !self.streams.is_empty() {
                    let ids: Vec<String> = self.streams.iter().map(|p| p.to_string()).collect();
                    write!(f, ", streams_probe_from=[{}]", ids.join(", "))?;
                }
                Ok(())
            }
        }
    }
}

impl ExecutionPlan for OperatorExec {
    fn name(&self) -> &str {
        "FlumenOperator"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.fragment.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.fragment]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn execute(
        &self,
        _partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        datafusion::common::internal_err!("FlumenOperator is shown by EXPLAIN, never executed")
    }

    fn metrics(&self) -> Option<MetricsSet> {
        let s = self.stats.snapshot();
        let mut set = MetricsSet::new();
        let count = |name: std::borrow::Cow<'static, str>, v: u64| {
            let c = Count::new();
            c.add(v as usize);
            Arc::new(Metric::new(MetricValue::Count { name, count: c }, None))
        };
        let time = |name: &'static str, ns: u64| {
            let t = Time::new();
            t.add_duration(std::time::Duration::from_nanos(ns));
            Arc::new(Metric::new(
                MetricValue::Time {
                    name: name.into(),
                    time: t,
                },
                None,
            ))
        };
        set.push(count("rows".into(), s.rows));
        set.push(count("blocks".into(), s.blocks));
        set.push(count("tasks".into(), s.tasks));
        set.push(time("busy", s.busy_ns));
        set.push(time("backpressure_wait", s.backpressure_ns));
        let bytes = |name: &'static str, n: u64| {
            let gauge = Gauge::new();
            gauge.set(n as usize);
            Arc::new(Metric::new(
                MetricValue::PeakMemoryUsage {
                    name: name.into(),
                    gauge,
                },
                None,
            ))
        };
        set.push(bytes("peak_bytes", s.peak_bytes));
        set.push(count("tasks_recomputed".into(), s.recomputed));
        set.push(count("blocks_spilled".into(), s.spilled));
        let mut sizes = self.stats.partition_sizes();
        if sizes.len() > 1 {
            sizes.sort_unstable();
            let total: u64 = sizes.iter().sum();
            let (largest, median) = (sizes[sizes.len() - 1], sizes[sizes.len() / 2]);
            set.push(count("output_partitions".into(), sizes.len() as u64));
            set.push(bytes("largest_partition", largest));
            set.push(bytes("median_partition", median));
            // How much of the output the largest partition has (1/partitions when even).
            let share = RatioMetrics::new();
            share.set_part(largest as usize);
            share.set_total(total as usize);
            set.push(Arc::new(Metric::new(
                MetricValue::Ratio {
                    name: "largest_partition_share".into(),
                    ratio_metrics: share,
                },
                None,
            )));
        }
        for (name, value) in self.stats.model_metrics() {
            set.push(Arc::new(Metric::new(
                MetricValue::Custom {
                    name: name.into(),
                    value: Arc::new(Setting(AtomicU64::new(value))),
                },
                None,
            )));
        }
        if s.retried_in_pieces > 0 {
            set.push(count(
                "tasks_retried_sorting_in_pieces".into(),
                s.retried_in_pieces,
            ));
        }
        if s.retried_alone > 0 {
            set.push(count("tasks_retried_alone".into(), s.retried_alone));
        }
        if s.merge_join_fallbacks > 0 {
            set.push(count("tasks_as_merge_join".into(), s.merge_join_fallbacks));
        }
        if s.partitions_sliced > 0 {
            set.push(count("partitions_sliced".into(), s.partitions_sliced));
            set.push(count("slice_tasks".into(), s.slices));
        }
        // DataFusion's counters of the plans its workers ran, under DataFusion's names.
        for PlanMetric {
            name,
            value,
            summary,
            category,
        } in self.stats.worker_plan_metrics.metrics()
        {
            let metric_type = match summary {
                true => MetricType::Summary,
                false => MetricType::Dev,
            };
            let metric = Metric::new(
                match value {
                    PlanMetricValue::Count(n) => {
                        let c = Count::new();
                        c.add(n as usize);
                        MetricValue::Count {
                            name: name.into(),
                            count: c,
                        }
                    }
                    PlanMetricValue::Pruning {
                        pruned,
                        matched,
                        fully_matched,
                    } => {
                        let pruning_metrics = PruningMetrics::new();
                        pruning_metrics.add_pruned(pruned as usize);
                        pruning_metrics.add_matched(matched as usize);
                        pruning_metrics.add_fully_matched(fully_matched as usize);
                        MetricValue::PruningMetrics {
                            name: name.into(),
                            pruning_metrics,
                        }
                    }
                },
                None,
            )
            .with_type(metric_type);
            let metric = match category.and_then(|c| c.parse::<MetricCategory>().ok()) {
                Some(category) => metric.with_category(category),
                None => metric,
            };
            set.push(Arc::new(metric));
        }
        if s.tasks_on_driver > 0 {
            set.push(count("tasks_on_driver".into(), s.tasks_on_driver));
            for (reason, n) in self.stats.on_driver() {
                set.push(count(format!("tasks_on_driver.{reason}").into(), n));
            }
        }
        // A join's bound from its build side, in either mode.
        if s.empty_build_sides > 0 {
            set.push(count("empty_build_sides".into(), s.empty_build_sides));
        }
        if s.bounds_from_build_sides > 0 {
            set.push(count(
                "bounds_from_build_sides".into(),
                s.bounds_from_build_sides,
            ));
        }
        if s.remote_tasks > 0 {
            set.push(count("remote_tasks".into(), s.remote_tasks));
            for (host, n) in self.stats.remote_tasks_by_host() {
                set.push(count(format!("remote_tasks.{host}").into(), n));
            }
            set.push(count("blocks_lost".into(), s.blocks_lost));
            set.push(count("tasks_retried".into(), s.tasks_retried));
            if s.tasks_pruned_at_launch > 0 {
                set.push(count(
                    "tasks_pruned_at_launch".into(),
                    s.tasks_pruned_at_launch,
                ));
            }
            set.push(count(
                "input_bytes_by_ticket".into(),
                s.input_bytes_by_ticket,
            ));
            set.push(count(
                "input_bytes_via_driver".into(),
                s.input_bytes_via_driver,
            ));
            set.push(count(
                "output_bytes_to_driver".into(),
                s.output_bytes_to_driver,
            ));
            set.push(count("output_bytes_carried".into(), s.output_bytes_carried));
        }
        Some(set)
    }
}

/// A figure shown as it is, not rounded to "2.05 K" as DataFusion shows counts: a choice a
/// model worker made (a batch size), which a reader compares with the setting.
#[derive(Debug)]
struct Setting(AtomicU64);

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{}", self.0.load(Ordering::Relaxed))
    }
}

impl CustomMetricValue for Setting {
    fn new_empty(&self) -> Arc<dyn CustomMetricValue> {
        Arc::new(Setting(AtomicU64::new(0)))
    }

    fn aggregate(&self, other: Arc<dyn CustomMetricValue + 'static>) {
        // Partitions of one operator made the same choice, or the latest one counts.
        self.0.store(other.as_usize() as u64, Ordering::Relaxed);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_usize(&self) -> usize {
        self.0.load(Ordering::Relaxed) as usize
    }

    fn is_eq(&self, other: &Arc<dyn CustomMetricValue>) -> bool {
        self.as_usize() == other.as_usize()
    }
}
