//! A run's task timeline (`flumen.timeline_file`): when each task ran, on which pool, for
//! which operator and partition, with the rows and blocks it wrote and the time it was
//! paused. The run writes it when it ends, as Chrome trace events (a JSON file that
//! Perfetto or `chrome://tracing` opens), one row of bars per lane of a pool: what Ray's
//! `ray timeline` gives for tasks, so a user can see where a query's time went (idle slots,
//! a slow stage, gaps between a model's tasks) without a profiler. Beside the bars, counter
//! tracks sampled every [`MEMORY_SAMPLE_INTERVAL`]: what held the memory budget (blocks in
//! memory, operators' reservations, the heap nobody reserved), the bytes spilled so far and
//! the process's resident memory: where a run's memory went, and when.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use datafusion::error::{DataFusionError, Result};
use serde_json::{Value, json};

use crate::exec::task_kind::TaskId;
use crate::plan::Pool;
use crate::plan::graph::OperatorId;
use crate::store::block_store::{BlockStore, MemorySample};

/// How often a timeline samples what holds memory.
pub(super) const MEMORY_SAMPLE_INTERVAL: Duration = Duration::from_millis(10);

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

/// What held memory at one moment of a run.
#[derive(Debug, Clone, Copy)]
pub(super) struct MemoryPoint {
    /// When, from the run's start.
    pub(super) at: Duration,
    /// The block store's figures then.
    pub(super) store: MemorySample,
    /// The process's resident memory then, where the system tells it.
    pub(super) resident: Option<u64>,
}

/// The spans of one run, written to `path` when the run ends.
#[derive(Debug)]
pub(super) struct Timeline {
    path: PathBuf,
    started: Instant,
    spans: Mutex<Vec<TaskSpan>>,
    /// Filled by a sampling thread until the timeline is dropped or the store is gone.
    memory: Arc<Mutex<Vec<MemoryPoint>>>,
    stop_sampling: Arc<AtomicBool>,
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.stop_sampling.store(true, Ordering::Relaxed);
    }
}

impl Timeline {
    /// A timeline of the run that started at `started`, to be written to `path`, sampling
    /// what holds `store`'s budget every [`MEMORY_SAMPLE_INTERVAL`] on a thread of its own.
    pub(super) fn new(path: PathBuf, started: Instant, store: &Arc<BlockStore>) -> Self {
        let memory = Arc::new(Mutex::new(vec![]));
        let stop_sampling = Arc::new(AtomicBool::new(false));
        let sampler = MemorySampler {
            store: Arc::downgrade(store),
            points: Arc::clone(&memory),
            stop: Arc::clone(&stop_sampling),
            started,
        };
        // Without the thread the timeline still has its tasks; only the counters are lost.
        let spawned = std::thread::Builder::new()
            .name("flumen-timeline".into())
            .spawn(move || sampler.run());
        if let Err(e) = spawned {
            log::warn!("flumen.timeline_file: no memory counters ({e})");
        }
        Self {
            path,
            started,
            spans: Mutex::new(vec![]),
            memory,
            stop_sampling,
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
        let memory = self.memory.lock().unwrap();
        let text = serde_json::to_string(&trace_events(&spans, &memory))
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

/// The thread behind a timeline's memory counters.
struct MemorySampler {
    store: Weak<BlockStore>,
    points: Arc<Mutex<Vec<MemoryPoint>>>,
    stop: Arc<AtomicBool>,
    started: Instant,
}

impl MemorySampler {
    /// Sample until told to stop or the run's store is gone.
    fn run(self) {
        while !self.stop.load(Ordering::Relaxed) {
            let Some(store) = self.store.upgrade() else {
                return;
            };
            let point = MemoryPoint {
                at: self.started.elapsed(),
                store: store.memory_sample(),
                resident: crate::store::counting_allocator::resident_bytes(),
            };
            drop(store);
            self.points.lock().unwrap().push(point);
            std::thread::sleep(MEMORY_SAMPLE_INTERVAL);
        }
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

/// Microseconds, as trace events count time.
fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Bytes as MiB, as the counter tracks show them.
fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// The counter events (`ph: C`) of one memory point: a stacked track of what held the
/// budget, one of the bytes spilled so far, one of the resident memory.
fn counter_events(point: &MemoryPoint) -> Vec<Value> {
    let ts = micros(point.at);
    let store = &point.store;
    let mut events = vec![
        json!({
            "name": "budget held (MiB)", "ph": "C", "pid": 1, "ts": ts,
            "args": {
                "blocks": mib(store.blocks),
                "operators": mib(store.operators),
                "unreserved heap": mib(store.unreserved),
            },
        }),
        json!({
            "name": "allocator's idle pages (MiB)", "ph": "C", "pid": 1, "ts": ts,
            "args": {"idle": mib(store.idle)},
        }),
        json!({
            "name": "spilled (MiB)", "ph": "C", "pid": 1, "ts": ts,
            "args": {"spilled": mib(store.spilled)},
        }),
    ];
    if let Some(resident) = point.resident {
        events.push(json!({
            "name": "resident (MiB)", "ph": "C", "pid": 1, "ts": ts,
            "args": {"resident": mib(resident)},
        }));
    }
    events
}

/// The Chrome trace document of `spans` and `memory`: a complete event (`ph: X`) per task,
/// in microseconds, a name for each lane, and the memory counters.
fn trace_events(spans: &[TaskSpan], memory: &[MemoryPoint]) -> Value {
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
    events.extend(memory.iter().flat_map(counter_events));
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
        let trace = trace_events(&spans, &[]);
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

    #[test]
    fn each_memory_point_gives_counters_in_mib() {
        let point = MemoryPoint {
            at: Duration::from_millis(5),
            store: MemorySample {
                blocks: 3 << 20,
                operators: 1 << 19,
                unreserved: 2 << 20,
                idle: 1 << 20,
                spilled: 10 << 20,
            },
            resident: Some(64 << 20),
        };
        let trace = trace_events(&[], &[point]);
        let counters: Vec<&Value> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "C")
            .collect();
        assert_eq!(counters.len(), 4);
        assert_eq!(counters[0]["ts"], 5000.0);
        assert_eq!(counters[0]["args"]["blocks"], 3.0);
        assert_eq!(counters[0]["args"]["operators"], 0.5);
        assert_eq!(counters[0]["args"]["unreserved heap"], 2.0);
        assert_eq!(counters[1]["args"]["idle"], 1.0);
        assert_eq!(counters[2]["args"]["spilled"], 10.0);
        assert_eq!(counters[3]["args"]["resident"], 64.0);
    }
}
