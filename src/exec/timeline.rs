//! A run's task timeline (`flumen.timeline_file`): when each task ran, on which pool, for
//! which operator and partition, with the rows and blocks it wrote and the time it was
//! paused. The run writes it when it ends, as Chrome trace events (a JSON file that
//! Perfetto or `chrome://tracing` opens), one row of bars per lane of a pool: what Ray's
//! `ray timeline` gives for tasks, so a user can see where a query's time went (idle slots,
//! a slow stage, gaps between a model's tasks) without a profiler.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use datafusion::error::{DataFusionError, Result};
use serde_json::{Value, json};

use crate::exec::lineage::TaskId;
use crate::plan::Pool;
use crate::plan::graph::OperatorId;

/// One task's execution.
#[derive(Debug, Clone)]
pub(super) struct TaskSpan {
    /// Its operator's id.
    pub(super) operator: OperatorId,
    /// Its operator's name (the fragment's top node).
    pub(super) name: String,
    /// The pool its operator runs on.
    pub(super) pool: Pool,
    /// Its task id and partition.
    pub(super) task: TaskId,
    pub(super) partition: usize,
    /// When it started and ended, from the run's start.
    pub(super) start: Duration,
    pub(super) end: Duration,
    /// Time it spent paused by backpressure (not holding a slot).
    pub(super) paused: Duration,
    /// Blocks and rows it wrote.
    pub(super) blocks: usize,
    pub(super) rows: u64,
    /// It ended without an error.
    pub(super) ok: bool,
}

/// The spans of one run, written to `path` when the run ends.
#[derive(Debug)]
pub(super) struct Timeline {
    path: PathBuf,
    started: Instant,
    spans: Mutex<Vec<TaskSpan>>,
}

impl Timeline {
    /// A timeline of the run that started at `started`, to be written to `path`.
    pub(super) fn new(path: PathBuf, started: Instant) -> Self {
        Self {
            path,
            started,
            spans: Mutex::new(vec![]),
        }
    }

    /// The time `at` as an offset from the run's start.
    pub(super) fn since_start(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.started)
    }

    /// Add a finished task.
    pub(super) fn record(&self, span: TaskSpan) {
        self.spans.lock().unwrap().push(span);
    }

    /// Write the spans so far as Chrome trace events: to a temporary file beside `path`,
    /// then renamed over it, so a reader never sees half a file.
    pub(super) fn write(&self) -> Result<()> {
        let spans = self.spans.lock().unwrap();
        let text = serde_json::to_string(&trace_events(&spans))
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        let mut partial = self.path.clone().into_os_string();
        partial.push(".partial");
        let failed = |e: std::io::Error| {
            DataFusionError::Execution(format!(
                "could not write flumen.timeline_file {}: {e}",
                self.path.display()
            ))
        };
        std::fs::write(&partial, text).map_err(failed)?;
        std::fs::rename(&partial, &self.path).map_err(failed)
    }
}

/// The lane of each span: per pool, the lowest lane free when it starts, so spans of one
/// lane never overlap (a trace viewer draws a lane as one row of bars).
fn lanes(spans: &[TaskSpan]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| (spans[i].start, spans[i].end));
    let mut busy_until: HashMap<Pool, Vec<Duration>> = HashMap::new();
    let mut lane = vec![0; spans.len()];
    for i in order {
        let span = &spans[i];
        let ends = busy_until.entry(span.pool).or_default();
        let free = ends.iter().position(|end| *end <= span.start);
        lane[i] = match free {
            Some(k) => {
                ends[k] = span.end;
                k
            }
            None => {
                ends.push(span.end);
                ends.len() - 1
            }
        };
    }
    lane
}

/// The pool's label in lane names.
fn pool_name(pool: Pool) -> &'static str {
    match pool {
        Pool::Cpu => "cpu",
        Pool::Accelerator => "accelerator",
    }
}

/// Lanes of the CPU pool are threads 1000.., of the accelerator pool 2000.. (one process).
fn thread_id(pool: Pool, lane: usize) -> usize {
    let base = match pool {
        Pool::Cpu => 1000,
        Pool::Accelerator => 2000,
    };
    base + lane
}

/// The Chrome trace document of `spans`: a complete event (`ph: X`) per task, in
/// microseconds, and a name for each lane.
fn trace_events(spans: &[TaskSpan]) -> Value {
    let lane = lanes(spans);
    let mut events = vec![json!({
        "name": "process_name", "ph": "M", "pid": 1,
        "args": {"name": "flumen run"},
    })];
    let mut named = std::collections::BTreeSet::new();
    for (span, &k) in spans.iter().zip(&lane) {
        let tid = thread_id(span.pool, k);
        if named.insert(tid) {
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                "args": {"name": format!("{} lane {k}", pool_name(span.pool))},
            }));
        }
        let micros = |d: Duration| d.as_secs_f64() * 1e6;
        events.push(json!({
            "name": format!("{} (op {})", span.name, span.operator),
            "cat": pool_name(span.pool),
            "ph": "X",
            "pid": 1,
            "tid": tid,
            "ts": micros(span.start),
            "dur": micros(span.end.saturating_sub(span.start)),
            "args": {
                "operator": span.operator,
                "task": span.task,
                "partition": span.partition,
                "rows": span.rows,
                "blocks": span.blocks,
                "paused_ms": span.paused.as_secs_f64() * 1e3,
                "ok": span.ok,
            },
        }));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(pool: Pool, start_ms: u64, end_ms: u64) -> TaskSpan {
        TaskSpan {
            operator: 0,
            name: "op".into(),
            pool,
            task: 0,
            partition: 0,
            start: Duration::from_millis(start_ms),
            end: Duration::from_millis(end_ms),
            paused: Duration::ZERO,
            blocks: 1,
            rows: 10,
            ok: true,
        }
    }

    #[test]
    fn overlapping_tasks_of_a_pool_get_separate_lanes_and_free_lanes_are_reused() {
        let spans = vec![
            span(Pool::Cpu, 0, 10),
            span(Pool::Cpu, 5, 20),
            span(Pool::Cpu, 10, 15),
            span(Pool::Accelerator, 0, 30),
            span(Pool::Cpu, 16, 18),
        ];
        // The third starts when the first ends: lane 0 again; the fifth finds lane 0 free
        // (ended at 15) before lane 1 (busy until 20).
        assert_eq!(lanes(&spans), vec![0, 1, 0, 0, 0]);
    }

    #[test]
    fn the_trace_has_one_complete_event_per_task_in_microseconds() {
        let spans = vec![span(Pool::Cpu, 1, 3), span(Pool::Accelerator, 2, 4)];
        let trace = trace_events(&spans);
        let events = trace["traceEvents"].as_array().unwrap();
        let tasks: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(tasks.len(), 2);
        assert_eq!(tasks[0]["ts"], 1000.0);
        assert_eq!(tasks[0]["dur"], 2000.0);
        assert_eq!(tasks[0]["tid"], 1000);
        assert_eq!(tasks[1]["tid"], 2000);
        assert_eq!(tasks[1]["cat"], "accelerator");
        let lanes_named = events.iter().filter(|e| e["name"] == "thread_name").count();
        assert_eq!(lanes_named, 2);
    }
}
