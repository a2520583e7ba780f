//! Per-operator progress lines while a query runs in a terminal, in the spirit of Ray Data's
//! per-operator bars: rows and blocks done, tasks done (of the total, for sources) and
//! running, the pool, and time held back by backpressure. Shown only after the query has run
//! for a second, and only when standard error is a terminal.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use datafusion::physical_plan::ExecutionPlan;
use flumen::exec::progress::{find_flumen_exec, hosts_line, operator_line};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How long a query runs before its progress lines appear.
const SHOW_AFTER: Duration = Duration::from_secs(1);
const REFRESH: Duration = Duration::from_millis(200);

/// Progress lines of one running query; they are cleared when dropped.
pub struct Progress {
    task: tokio::task::JoinHandle<()>,
    lines: Arc<Mutex<Lines>>,
}

#[derive(Default)]
struct Lines {
    bars: Vec<ProgressBar>,
    done: bool,
}

impl Progress {
    /// Start showing progress for `plan` if it holds flumen operators.
    pub fn start(plan: &Arc<dyn ExecutionPlan>) -> Option<Self> {
        let exec = find_flumen_exec(plan)?;
        let (graph, metrics) = (Arc::clone(exec.graph()), Arc::clone(exec.run_metrics()));
        let lines = Arc::new(Mutex::new(Lines::default()));
        let shared = Arc::clone(&lines);
        let task = tokio::spawn(async move {
            tokio::time::sleep(SHOW_AFTER).await;
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template("{spinner} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
            {
                let mut lines = shared.lock().unwrap();
                if lines.done {
                    return;
                }
                lines.bars = graph
                    .operators
                    .iter()
                    .map(|_| multi.add(ProgressBar::new_spinner().with_style(style.clone())))
                    .collect();
            }
            let mut workers_bar: Option<ProgressBar> = None;
            loop {
                {
                    let mut lines = shared.lock().unwrap();
                    if lines.done {
                        return;
                    }
                    for (op, line) in graph.operators.iter().zip(&lines.bars) {
                        line.set_message(operator_line(op, &metrics.operator(op.id).snapshot()));
                        line.tick();
                    }
                    // Tasks ran in workers: one more line, per host.
                    if let Some(text) = hosts_line(&metrics) {
                        let line = workers_bar.get_or_insert_with(|| {
                            let line =
                                multi.add(ProgressBar::new_spinner().with_style(style.clone()));
                            lines.bars.push(line.clone());
                            line
                        });
                        line.set_message(text);
                        line.tick();
                    }
                }
                tokio::time::sleep(REFRESH).await;
            }
        });
        Some(Self { task, lines })
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        let mut lines = self.lines.lock().unwrap();
        lines.done = true;
        for bar in &lines.bars {
            bar.finish_and_clear();
        }
        self.task.abort();
    }
}
