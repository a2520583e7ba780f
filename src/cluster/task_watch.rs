//! What a worker's running tasks tell the driver besides their blocks, looked at from a
//! thread of its own: the bounds their aggregates and TopK sorts tightened
//! ([`Produced::Bounds`], every [`BOUNDS_EVERY`]), and whether their plans still do work
//! ([`Produced::Advanced`], every [`PROGRESS_EVERY`]).
//!
//! A sort or an aggregate puts out nothing until its input ends, and a plan busy on the CPU
//! need not yield to its runtime until then. So the looking is done by a thread that is not
//! the task's: before it, a task of a sort that outlasted `flumen.task_timeout_secs` without
//! output got its worker stopped as stuck, however busy it was, on every retry.

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::ExecutionPlan;

use crate::cluster::protocol::PROGRESS_EVERY;
use crate::cluster::sent_bounds::BoundWatch;
use crate::cluster::task_output::{Produced, ProducedSender};

/// How often a task with an aggregate or TopK sort is looked at for tightened bounds.
pub const BOUNDS_EVERY: Duration = Duration::from_millis(10);

/// One running task, as the watching thread sees it.
struct Watched {
    /// Its number among the watched, for [`Watching`] to take it out.
    key: u64,
    plan: Arc<dyn ExecutionPlan>,
    bounds: BoundWatch,
    /// Its operators' work at the last look ([`work_done`]).
    work: usize,
    /// When its work was last looked at.
    looked: Instant,
    to: ProducedSender,
}

impl Watched {
    /// Hand on what changed: tightened bounds, and (every [`PROGRESS_EVERY`]) whether
    /// the plan did work.
    fn look(&mut self, now: Instant) {
        let bounds = self.bounds.tightened();
        if !bounds.is_empty() {
            let _ = self.to.send(Produced::Bounds(bounds));
        }
        if now.duration_since(self.looked) >= PROGRESS_EVERY {
            self.looked = now;
            let work = work_done(&self.plan);
            if work != self.work {
                self.work = work;
                let _ = self.to.send(Produced::Advanced);
            }
        }
    }
}

/// The tasks watched, and a way to wake the thread when the first comes.
#[derive(Default)]
struct Registry {
    tasks: Mutex<(u64, Vec<Watched>)>,
    arrived: Condvar,
}

/// The process's registry, its thread started with it.
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<&'static Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry: &'static Registry = Box::leak(Box::default());
        std::thread::Builder::new()
            .name("flumen-task-watch".into())
            .spawn(move || watch_forever(registry))
            .expect("the task watching thread starts");
        registry
    })
}

fn watch_forever(registry: &Registry) {
    loop {
        let mut tasks = registry.tasks.lock().unwrap();
        while tasks.1.is_empty() {
            tasks = registry.arrived.wait(tasks).unwrap();
        }
        let now = Instant::now();
        for task in tasks.1.iter_mut() {
            task.look(now);
        }
        let every = match tasks.1.iter().any(|task| !task.bounds.is_empty()) {
            true => BOUNDS_EVERY,
            false => PROGRESS_EVERY / 4,
        };
        drop(tasks);
        std::thread::sleep(every);
    }
}

/// A task watched until this is dropped.
pub struct Watching {
    key: u64,
}

impl Drop for Watching {
    fn drop(&mut self) {
        let mut tasks = registry().tasks.lock().unwrap();
        tasks.1.retain(|task| task.key != self.key);
    }
}

/// Watch the running task of `plan`, telling `to`, until the guard is dropped.
pub fn watch(plan: &Arc<dyn ExecutionPlan>, to: &ProducedSender) -> Watching {
    let registry = registry();
    let mut tasks = registry.tasks.lock().unwrap();
    let key = tasks.0;
    tasks.0 += 1;
    tasks.1.push(Watched {
        key,
        plan: Arc::clone(plan),
        bounds: BoundWatch::new(plan),
        work: work_done(plan),
        looked: Instant::now(),
        to: to.clone(),
    });
    registry.arrived.notify_one();
    Watching { key }
}

/// A figure of the work `plan`'s operators have done so far: all their counters and
/// timers (DataFusion's metrics) summed. It changes while any of them works: rows put out,
/// but also rows taken in and held (a filter coalesces its output, a sort holds all of it),
/// compute time, bytes spilled.
fn work_done(plan: &Arc<dyn ExecutionPlan>) -> usize {
    let mut work = 0usize;
    let _ = plan.apply(|node| {
        for metric in node.metrics().iter().flat_map(|m| m.iter()) {
            work = work.wrapping_add(metric.value().as_usize());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    work
}

#[cfg(test)]
mod tests {
    use datafusion::arrow::array::{AsArray, Int64Array};
    use datafusion::arrow::compute::SortOptions;
    use datafusion::arrow::datatypes::{DataType, Field, Int64Type, Schema};
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::physical_expr::expressions::{col, lit};
    use datafusion::physical_expr::{LexOrdering, PhysicalSortExpr};
    use datafusion::physical_plan::filter::FilterExec;
    use datafusion::physical_plan::sorts::sort::SortExec;
    use datafusion::prelude::SessionContext;

    use super::*;
    use crate::cluster::protocol::TaskRequest;
    use crate::cluster::sent_bounds::tests::fed_input;
    use crate::cluster::worker_tasks::plan_blocks;

    /// A sort puts out nothing until its input ends; meanwhile its watched task tells
    /// that its plan advances (its operators' counters changed), so its worker is not taken
    /// for stuck; held with no new input, it tells nothing.
    #[tokio::test]
    async fn a_sort_that_puts_out_nothing_yet_tells_that_it_advances() {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let (feed, input) = fed_input(&schema);
        let filter = Arc::new(FilterExec::try_new(lit(true), input).unwrap());
        let order = LexOrdering::new([PhysicalSortExpr::new(
            col("a", &schema).unwrap(),
            SortOptions::default(),
        )])
        .unwrap();
        let sort: Arc<dyn ExecutionPlan> = Arc::new(SortExec::new(order, filter));
        let (told, mut heard) = tokio::sync::mpsc::unbounded_channel();
        let watching = watch(&sort, &told);
        let task_ctx = SessionContext::new().task_ctx();
        let run = tokio::spawn(async move {
            let mut out = |produced| {
                let _ = told.send(produced);
            };
            plan_blocks(sort, task_ctx, &TaskRequest::default(), &mut out).await
        });
        let batch = |values: Vec<i64>| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![Arc::new(Int64Array::from(values))],
            )
            .unwrap()
        };
        let wait = PROGRESS_EVERY * 3;
        feed.unbounded_send(Ok(batch(vec![3, 1, 2]))).unwrap();
        let first = tokio::time::timeout(wait, heard.recv()).await;
        assert!(
            matches!(first, Ok(Some(Produced::Advanced))),
            "no sign of progress: {first:?}"
        );
        let none = tokio::time::timeout(wait, heard.recv()).await;
        assert!(none.is_err(), "told without advancing: {none:?}");
        drop(feed);
        run.await.unwrap().unwrap();
        drop(watching);
        let mut sorted = vec![];
        while let Ok(produced) = heard.try_recv() {
            if let Produced::Block(_, block) = produced {
                sorted.extend(
                    block
                        .column(0)
                        .as_primitive::<Int64Type>()
                        .values()
                        .to_vec(),
                );
            }
        }
        assert_eq!(sorted, [1, 2, 3]);
    }
}
