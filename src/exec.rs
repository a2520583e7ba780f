//! `FlumenExec`, the root `ExecutionPlan` the planner returns: executing it runs the
//! operator graph on flumen's scheduler. `OperatorExec` shows one operator in `EXPLAIN`.

use std::fmt;
use std::sync::{Arc, Mutex};

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{Count, Gauge, Metric, MetricValue, MetricsSet, Time};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties,
};

use datafusion::physical_plan::projection::ProjectionExec;

use crate::accelerator::accelerator_functions_in;
use crate::accelerator_projection::AcceleratorProjectionExec;
use crate::config::FlumenConfig;
use crate::operators::{Operator, OperatorGraph, Pool};
use crate::scheduler::QueryRun;
use crate::stats::OperatorStats;

/// Root of every physical plan flumen plans: runs its operator graph when executed.
#[derive(Debug)]
pub struct FlumenExec {
    graph: Arc<OperatorGraph>,
    config: FlumenConfig,
    display_root: Arc<dyn ExecutionPlan>,
    /// The run serving the current execution, and which partitions it has handed out.
    current: Mutex<Option<(Arc<QueryRun>, Vec<bool>)>>,
}

impl FlumenExec {
    /// Wrap an operator graph.
    pub fn new(graph: OperatorGraph, config: FlumenConfig) -> Self {
        let display_root: Arc<dyn ExecutionPlan> =
            Arc::new(OperatorExec::new(graph.root(), &config));
        Self {
            graph: Arc::new(graph),
            config,
            display_root,
            current: Mutex::new(None),
        }
    }

    /// The operator graph this plan runs.
    pub fn graph(&self) -> &Arc<OperatorGraph> {
        &self.graph
    }
}

impl DisplayAs for FlumenExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        match t {
            DisplayFormatType::TreeRender => write!(f, "mode={}", self.config.mode),
            _ => write!(
                f,
                "FlumenExec: mode={}, memory_budget={}, operators={}",
                self.config.mode,
                self.config.memory_budget,
                self.graph.operators.len()
            ),
        }
    }
}

impl ExecutionPlan for FlumenExec {
    fn name(&self) -> &str {
        "FlumenExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.graph.root().fragment.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.display_root]
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
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let partitions = self.graph.root().partitions();
        let mut current = self.current.lock().unwrap();
        let reuse = matches!(&*current, Some((_, opened)) if !opened[partition]);
        if !reuse {
            let run = QueryRun::start(Arc::clone(&self.graph), context)?;
            *current = Some((run, vec![false; partitions]));
        }
        let (run, opened) = current.as_mut().expect("a run was just set");
        opened[partition] = true;
        let run = Arc::clone(run);
        if opened.iter().all(|o| *o) {
            *current = None;
        }
        drop(current);
        run.output(partition)
    }

    fn metrics(&self) -> Option<MetricsSet> {
        let load = |counter: &std::sync::atomic::AtomicU64| {
            counter.load(std::sync::atomic::Ordering::Relaxed) as usize
        };
        let count = |name: &'static str, value: usize| {
            let c = Count::new();
            c.add(value);
            Arc::new(Metric::new(
                MetricValue::Count {
                    name: name.into(),
                    count: c,
                },
                None,
            ))
        };
        let mut set = MetricsSet::new();
        let passes = load(&self.graph.scheduler_passes);
        if passes > 0 {
            set.push(count("scheduler_passes", passes));
        }
        let restarted = load(&self.graph.workers_restarted);
        if restarted > 0 {
            set.push(count("workers_restarted", restarted));
        }
        Some(set)
    }
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
}

/// `name(accelerators=A, cpu_threads=T)` for each accelerator function `plan` calls.
fn accelerator_workers(plan: &Arc<dyn ExecutionPlan>, config: &FlumenConfig) -> Vec<String> {
    let mut options = datafusion::config::ConfigOptions::new();
    options.extensions.insert(config.clone());
    let mut found = vec![];
    let mut stack = vec![Arc::clone(plan)];
    while let Some(node) = stack.pop() {
        let projection = node
            .downcast_ref::<AcceleratorProjectionExec>()
            .map(|p| p.projection())
            .or_else(|| node.downcast_ref::<ProjectionExec>());
        if let Some(projection) = projection {
            for expr in projection.expr() {
                for func in accelerator_functions_in(&expr.expr) {
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
            }
        }
        stack.extend(node.children().into_iter().cloned());
    }
    found
}

impl OperatorExec {
    /// The display node of `op`.
    pub fn new(op: &Operator, config: &FlumenConfig) -> Self {
        Self {
            slots: match op.pool {
                Pool::Cpu => config.cpu_slots,
                Pool::Accelerator => config.accelerator_slots,
            },
            workers: match op.pool {
                Pool::Cpu => vec![],
                Pool::Accelerator => accelerator_workers(&op.fragment, config),
            },
            target_block_rows: config.target_block_rows,
            id: op.id,
            name: op.name.clone(),
            pool: op.pool,
            shape: op.shape.to_string(),
            tasks_hint: op.splits.iter().sum(),
            fragment: Arc::clone(&op.fragment),
            stats: Arc::clone(&op.stats),
            streams: op.streamed_producers().collect(),
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
        let count = |name: &'static str, v: u64| {
            let c = Count::new();
            c.add(v as usize);
            Arc::new(Metric::new(
                MetricValue::Count {
                    name: name.into(),
                    count: c,
                },
                None,
            ))
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
        set.push(count("rows", s.rows));
        set.push(count("blocks", s.blocks));
        set.push(count("tasks", s.tasks));
        set.push(time("busy", s.busy_ns));
        set.push(time("backpressure_wait", s.backpressure_ns));
        let peak = Gauge::new();
        peak.set(s.peak_bytes as usize);
        set.push(Arc::new(Metric::new(
            MetricValue::PeakMemoryUsage {
                name: "peak_bytes".into(),
                gauge: peak,
            },
            None,
        )));
        set.push(count("tasks_recomputed", s.recomputed));
        set.push(count("blocks_spilled", s.spilled));
        if s.remote_tasks > 0 {
            set.push(count("remote_tasks", s.remote_tasks));
            set.push(count("blocks_lost", s.blocks_lost));
            set.push(count("tasks_retried", s.tasks_retried));
        }
        Some(set)
    }
}
