//! `FlumenExec`, the root `ExecutionPlan` the planner returns: executing it runs the
//! operator graph on flumen's scheduler. It owns the run's counters ([`RunMetrics`]) and
//! shows each operator in `EXPLAIN` through an [`crate::exec::explain::OperatorExec`].

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{Count, Metric, MetricValue, MetricsSet};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties,
};

use crate::config::FlumenConfig;
use crate::exec::explain::display_tree;
use crate::exec::metrics::RunMetrics;
use crate::exec::replan::{OutputWatch, Replanner};
use crate::exec::run::QueryRun;
use crate::plan::graph::OperatorGraph;

/// Root of every physical plan flumen plans: runs its operator graph when executed.
#[derive(Debug)]
pub struct FlumenExec {
    graph: Arc<OperatorGraph>,
    config: FlumenConfig,
    /// Counters of every run of this plan.
    metrics: Arc<RunMetrics>,
    /// The root operator's `EXPLAIN` node (the operators below it hang from its stage inputs).
    display_root: Arc<dyn ExecutionPlan>,
    /// The run serving the current execution, which partitions it has handed out, and
    /// the watch that restarts it out of core if it is refused memory.
    current: Mutex<Option<Execution>>,
    /// Plans the query again out of core (an in-core plan only: [`crate::exec::replan`]).
    replanner: Option<Replanner<FlumenExec>>,
    /// The out-of-core plan made after a run of this one was refused memory: it serves
    /// the rest of that execution, every later one, and what `EXPLAIN ANALYZE` shows.
    replanned: Arc<OnceLock<Arc<FlumenExec>>>,
}

/// One execution of a [`FlumenExec`], shared by its output partitions.
struct Execution {
    run: Arc<QueryRun>,
    opened: Vec<bool>,
    watch: Option<Arc<OutputWatch<FlumenExec>>>,
}

impl fmt::Debug for Execution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Execution")
            .field("opened", &self.opened)
            .finish_non_exhaustive()
    }
}

impl FlumenExec {
    /// Wrap an operator graph.
    pub fn new(graph: OperatorGraph, config: FlumenConfig) -> Self {
        let metrics = Arc::new(RunMetrics::new(graph.operators.len()));
        let display_root = display_tree(&graph, graph.root().id, &config, &metrics);
        Self {
            graph: Arc::new(graph),
            config,
            metrics,
            display_root,
            current: Mutex::new(None),
            replanner: None,
            replanned: Arc::default(),
        }
    }

    /// The plan with `replanner`, which plans the query again out of core when a run is
    /// refused memory before its first output.
    pub fn with_replanner(mut self, replanner: Replanner<FlumenExec>) -> Self {
        self.replanner = Some(replanner);
        self
    }

    /// The operator graph this plan runs (the out-of-core plan's once it replaced it).
    pub fn graph(&self) -> &Arc<OperatorGraph> {
        match self.replanned.get() {
            Some(plan) => plan.graph(),
            None => &self.graph,
        }
    }

    /// The counters of this plan's runs (the out-of-core plan's once it replaced it).
    pub fn run_metrics(&self) -> &Arc<RunMetrics> {
        match self.replanned.get() {
            Some(plan) => plan.run_metrics(),
            None => &self.metrics,
        }
    }

    /// Whether a run of this plan was refused memory in core and the query was planned
    /// again out of core.
    pub fn replanned_out_of_core(&self) -> bool {
        self.replanned.get().is_some()
    }
}

impl DisplayAs for FlumenExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        if let Some(plan) = self.replanned.get() {
            plan.fmt_as(t, f)?;
            return write!(f, ", replanned out of core (refused memory in core)");
        }
        match t {
            DisplayFormatType::TreeRender => write!(f, "mode={}", self.config.mode),
            _ => {
                write!(
                    f,
                    "FlumenExec: mode={}, memory_budget={}, operators={}",
                    self.config.mode,
                    self.config.memory_budget,
                    self.graph.operators.len()
                )?;
                if self.graph.sizing.out_of_core() {
                    write!(f, ", {}", self.graph.sizing)?;
                }
                Ok(())
            }
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
        match self.replanned.get() {
            Some(plan) => plan.children(),
            None => vec![&self.display_root],
        }
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
        let reuse = matches!(&*current, Some(e) if !e.opened[partition]);
        if !reuse {
            if let Some(plan) = self.replanned.get() {
                // A run of this plan was refused memory in core: the query runs out of core.
                drop(current);
                return plan.execute(partition, context);
            }
            let run = QueryRun::start(
                Arc::clone(&self.graph),
                Arc::clone(&self.metrics),
                Arc::clone(&context),
            )?;
            let watch = self.replanner.as_ref().map(|replanner| {
                OutputWatch::new(
                    replanner.clone(),
                    Arc::clone(&self.replanned),
                    Arc::clone(&self.metrics),
                    Arc::clone(&context),
                    partitions,
                )
            });
            *current = Some(Execution {
                run,
                opened: vec![false; partitions],
                watch,
            });
        }
        let execution = current.as_mut().expect("a run was just set");
        execution.opened[partition] = true;
        let run = Arc::clone(&execution.run);
        let watch = execution.watch.clone();
        if execution.opened.iter().all(|o| *o) {
            *current = None;
        }
        drop(current);
        let output = run.output(partition)?;
        Ok(match watch {
            Some(watch) => watch.watch(partition, output),
            None => output,
        })
    }

    fn metrics(&self) -> Option<MetricsSet> {
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
        if let Some(plan) = self.replanned.get() {
            let mut set = plan.metrics().unwrap_or_default();
            set.push(count("runs_replanned_out_of_core", 1));
            return Some(set);
        }
        let mut set = MetricsSet::new();
        let passes = self.metrics.scheduler_passes() as usize;
        if passes > 0 {
            set.push(count("scheduler_passes", passes));
        }
        let restarted = self.metrics.workers_restarted() as usize;
        if restarted > 0 {
            set.push(count("workers_restarted", restarted));
        }
        let names = [
            "peak_operator_bytes",
            "operator_spill_requests",
            "blocks_evicted",
            "bytes_evicted",
        ];
        for (name, n) in names.into_iter().zip(self.metrics.memory.snapshot()) {
            if n > 0 {
                set.push(count(name, n as usize));
            }
        }
        let spill_files = self.metrics.memory.spill_files.load(Ordering::Relaxed);
        if spill_files > 0 {
            set.push(count("spill_files", spill_files as usize));
        }
        let unreserved = self
            .metrics
            .memory
            .peak_unreserved_bytes
            .load(Ordering::Relaxed);
        if unreserved > 0 {
            set.push(count("peak_unreserved_bytes", unreserved as usize));
        }
        let hand_backs = self.metrics.memory.heap_hand_backs.load(Ordering::Relaxed);
        if hand_backs > 0 {
            set.push(count("heap_hand_backs", hand_backs as usize));
        }
        let names = ["workers_lost", "workers_joined", "workers_rejoined"];
        for (name, n) in names.into_iter().zip(self.metrics.membership()) {
            if n > 0 {
                set.push(count(name, n as usize));
            }
        }
        // One metric per host (a label would be summed away in the plan's display).
        for (host, tasks) in self.metrics.tasks_by_host() {
            let c = Count::new();
            c.add(tasks as usize);
            set.push(Arc::new(Metric::new(
                MetricValue::Count {
                    name: format!("tasks_on_{host}").into(),
                    count: c,
                },
                None,
            )));
        }
        Some(set)
    }
}
