//! An in-core run refused memory is planned again out of core.
//!
//! The planner runs a query in core when its estimates say the largest exchange fits the
//! budget ([`crate::plan::exchange_sizing`]). Estimates are a hint: a source without
//! statistics (`unnest`, a table function), a filter more selective on paper than in the
//! data, or a join that multiplies rows can make a join's build side far larger than its
//! estimate. In core, a join's partitions stream their inputs and build all at once, and a
//! streamed input is released as it is read, so a partition refused memory cannot run again
//! by itself.
//!
//! Out of core, every per-partition task waits for its inputs, whose bytes are then known:
//! a partition larger than its share is cut into slices, one refused memory runs again
//! alone and then with sort-merge joins (which spill). So when an in-core run is refused
//! memory before the query's reader has had a single batch, the query is planned again out
//! of core, sized from the larger of its estimates and the bytes the failed run had seen
//! any operator produce, and its output comes from the new run. A statement that writes
//! files loses nothing: the failed run's staged files are deleted ([`crate::io::output_commit`])
//! and the new run stages and commits its own. Once a batch has left, a refusal is the
//! query's error, as before.

use std::sync::{Arc, Mutex};

use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::future::BoxFuture;
use futures::{StreamExt, stream};
use tokio::sync::OnceCell;

use crate::exec::metrics::RunMetrics;

/// Plans the query again out of core, given the most bytes one operator of the failed run
/// had produced (a floor for the largest exchange's input). `P` is the plan it makes (a
/// [`crate::exec::flumen_exec::FlumenExec`]): this module needs only that it executes.
pub struct Replanner<P>(Arc<dyn Fn(u64) -> BoxFuture<'static, Result<Arc<P>>> + Send + Sync>);

impl<P> Clone for Replanner<P> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<P> Replanner<P> {
    /// A replanner calling `plan`.
    pub fn new(
        plan: impl Fn(u64) -> BoxFuture<'static, Result<Arc<P>>> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(plan))
    }

    /// The query planned out of core, its largest exchange at least `seen_bytes`.
    pub async fn plan(&self, seen_bytes: u64) -> Result<Arc<P>> {
        (self.0)(seen_bytes).await
    }
}

impl<P> std::fmt::Debug for Replanner<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Replanner")
    }
}

/// The output partitions of one execution of an in-core plan: whether any has handed its
/// reader a batch, and the out-of-core plan they all read from once one was refused.
pub(super) struct OutputWatch<P> {
    replanner: Replanner<P>,
    /// Where the plan being run keeps the new plan, for `EXPLAIN ANALYZE` and later runs.
    replanned: Arc<std::sync::OnceLock<Arc<P>>>,
    /// The failed run's counters (the bytes its operators produced).
    metrics: Arc<RunMetrics>,
    context: Arc<TaskContext>,
    state: Mutex<WatchState>,
    /// The new plan, made once by the first partition refused.
    new_plan: OnceCell<Arc<P>>,
}

#[derive(Debug)]
struct WatchState {
    /// A batch reached the query's reader: the run can no longer start again.
    yielded: bool,
    /// Output partitions of the in-core plan whose stream ended before a restart.
    ended: Vec<bool>,
    /// Once restarted: which in-core streams had ended then, and the one refused (which
    /// reads their share of the new plan).
    restart: Option<(Vec<bool>, usize)>,
    /// The refusal that restarted the run (shown when the new plan cannot be made).
    refusal: Option<String>,
}

impl<P: ExecutionPlan + 'static> OutputWatch<P> {
    /// A watch over the `partitions` output partitions of one execution of a plan.
    pub(super) fn new(
        replanner: Replanner<P>,
        replanned: Arc<std::sync::OnceLock<Arc<P>>>,
        metrics: Arc<RunMetrics>,
        context: Arc<TaskContext>,
        partitions: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            replanner,
            replanned,
            metrics,
            context,
            state: Mutex::new(WatchState {
                yielded: false,
                ended: vec![false; partitions],
                restart: None,
                refusal: None,
            }),
            new_plan: OnceCell::new(),
        })
    }

    /// Output partition `partition` of the execution: `first` (the in-core run's), or its
    /// share of the new plan's once the run was refused memory.
    pub(super) fn watch(
        self: Arc<Self>,
        partition: usize,
        first: SendableRecordBatchStream,
    ) -> SendableRecordBatchStream {
        let schema = first.schema();
        let start = match self.state.lock().unwrap().restart.is_some() {
            true => Phase::Restart,
            false => Phase::InCore(first),
        };
        let items = stream::unfold((self, start), move |(watch, phase)| async move {
            let mut phase = phase;
            loop {
                match phase {
                    Phase::Done => return None,
                    Phase::New(mut inner) => {
                        let item = inner.next().await?;
                        return Some((item, (watch, Phase::New(inner))));
                    }
                    Phase::Restart => match watch.share(partition).await {
                        Ok(inner) => phase = Phase::New(inner),
                        Err(e) => return Some((Err(e), (watch, Phase::Done))),
                    },
                    Phase::InCore(mut inner) => {
                        let item = inner.next().await;
                        match watch.after_in_core(partition, &item) {
                            Step::Pass => {
                                let next = match item {
                                    Some(Ok(_)) => Phase::InCore(inner),
                                    _ => Phase::Done,
                                };
                                return Some((item?, (watch, next)));
                            }
                            Step::Restart => {
                                // The failed run's stream goes first: its run can end.
                                drop(inner);
                                phase = Phase::Restart;
                            }
                        }
                    }
                }
            }
        });
        Box::pin(RecordBatchStreamAdapter::new(schema, items))
    }

    /// What the in-core stream of `partition` does with its next `item`: pass it on, or
    /// read the new plan instead (the run restarted, or this refusal restarts it).
    fn after_in_core(
        &self,
        partition: usize,
        item: &Option<Result<datafusion::arrow::record_batch::RecordBatch>>,
    ) -> Step {
        let mut state = self.state.lock().unwrap();
        if state.restart.is_some() {
            // Restarted by another partition: what this one had is the failed run's.
            return Step::Restart;
        }
        match item {
            Some(Ok(_)) => {
                state.yielded = true;
                Step::Pass
            }
            None => {
                state.ended[partition] = true;
                Step::Pass
            }
            Some(Err(e)) if !state.yielded && is_refusal(e) => {
                state.refusal = Some(e.find_root().to_string());
                state.restart = Some((state.ended.clone(), partition));
                log::info!(
                    "flumen: the query was refused memory in core before any output; it \
                     runs again out of core: {}",
                    e.find_root()
                );
                Step::Restart
            }
            Some(Err(_)) => Step::Pass,
        }
    }

    /// The new plan's streams that in-core partition `partition` reads, merged.
    async fn share(&self, partition: usize) -> Result<SendableRecordBatchStream> {
        let plan = self
            .new_plan
            .get_or_try_init(|| async {
                let seen = self.metrics.most_bytes_produced();
                let plan = self.replanner.plan(seen).await.map_err(|e| {
                    let refusal = self.state.lock().unwrap().refusal.clone();
                    DataFusionError::Context(
                        format!(
                            "planning out of core after an in-core run was refused memory ({})",
                            refusal.unwrap_or_default()
                        ),
                        Box::new(e),
                    )
                })?;
                let _ = self.replanned.set(Arc::clone(&plan));
                Ok::<_, DataFusionError>(plan)
            })
            .await?;
        let count = plan.properties().partitioning.partition_count();
        let readers = {
            let state = self.state.lock().unwrap();
            let (ended, refused) = state.restart.as_ref().expect("restarted");
            share_of(partition, count, ended, *refused)
        };
        let schema = plan.schema();
        let mut streams = Vec::with_capacity(readers.len());
        for j in readers {
            streams.push(plan.execute(j, Arc::clone(&self.context))?);
        }
        let merged = stream::select_all(streams);
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, merged)))
    }
}

/// The output partitions of a new plan of `count` that in-core stream `reader` reads: they
/// go round the in-core streams, and those of a stream that had ended (its reader gone) go
/// to the one `refused`.
fn share_of(reader: usize, count: usize, ended: &[bool], refused: usize) -> Vec<usize> {
    let readers = ended.len().max(1);
    let owner = |j: usize| match ended.get(j % readers) {
        Some(true) => refused,
        _ => j % readers,
    };
    (0..count).filter(|j| owner(*j) == reader).collect()
}

/// Where one output partition's stream is.
enum Phase {
    /// Reading the in-core run.
    InCore(SendableRecordBatchStream),
    /// Its share of the out-of-core plan is to be opened.
    Restart,
    /// Reading its share of the out-of-core plan.
    New(SendableRecordBatchStream),
    /// Ended.
    Done,
}

/// What an in-core stream does with an item.
enum Step {
    Pass,
    Restart,
}

/// Whether `error` is a refusal of memory (in this process or a worker).
fn is_refusal(error: &DataFusionError) -> bool {
    matches!(error.find_root(), DataFusionError::ResourcesExhausted(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_new_partition_has_one_reader_and_ended_streams_hand_theirs_on() {
        let ended = [false, true, false];
        let shares: Vec<Vec<usize>> = (0..3).map(|r| share_of(r, 7, &ended, 2)).collect();
        assert_eq!(shares, vec![vec![0, 3, 6], vec![], vec![1, 2, 4, 5]]);
        // Fewer new partitions than readers: some read none.
        assert_eq!(share_of(1, 1, &[false, false], 0), Vec::<usize>::new());
        assert_eq!(share_of(0, 1, &[false, false], 0), vec![0]);
    }
}
