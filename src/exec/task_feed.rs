//! Feeding a worker's task its streamed input (a join's probe side) while it runs.
//!
//! In worker mode a join's task starts once its build side is complete
//! ([`crate::plan::graph::OperatorGraph::fed_inputs`]); its probe input's blocks are sent to
//! it as their producers announce them: held by a worker, as a ticket its worker fetches;
//! held here, inline. The blocks go in the order a reader of the complete input takes
//! ([`QueryRun::input_cursor`]: round by round over the producer's tasks), which depends
//! only on each producer task's output, so a retry, or a run again for lost blocks with the
//! input complete, reads the same blocks in the same order and cuts the same output.
//! A feed that waits for blocks counts as a streaming reader's wait (the scheduler's
//! liveness rule), and the blocks it sent are released when the task ends, as a barrier
//! task's inputs are.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use datafusion::error::{DataFusionError, Result};
use futures::StreamExt;
use futures::stream::BoxStream;

use crate::cluster::protocol::{InputTicket, TaskInput};
use crate::cluster::worker_handle::Fed;
use crate::exec::cursor::{Cursor, Next};
use crate::exec::run::QueryRun;
use crate::exec::task_kind::TaskId;
use crate::store::block::{BlockId, HeldBlock};

/// Blocks handed to one feed message at most: it stays small beside a task.
const BLOCKS_PER_FEED: usize = 64;

/// How long blocks gather before the next feed message (after the first, which goes at
/// once): a message is a round trip through both processes (~1 ms of CPU), and a probe
/// side of 739 blocks fed one or two at a time cost TPC-H-sized joins a third of their time.
const FEED_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// What one attempt of a fed task was sent (kept across the attempt's feed messages).
#[derive(Default)]
pub(super) struct FedLog {
    /// Every block fed, in order.
    pub(super) ids: Vec<BlockId>,
    /// Those its worker fetched by ticket, with where they were.
    pub(super) by_ticket: Vec<(BlockId, Arc<dyn HeldBlock>)>,
    /// Bytes of those.
    pub(super) bytes_by_ticket: u64,
    /// Bytes of the blocks sent inline.
    pub(super) bytes_via_driver: u64,
}

/// Where one feed stands between messages.
struct Feeding {
    run: Arc<QueryRun>,
    /// Each fed source: its in-memory source index, its cursor, whether it has ended, and
    /// the blocks taken from it not yet sent.
    sources: Vec<FedSource>,
    changes: tokio::sync::watch::Receiver<u64>,
    log: Arc<Mutex<FedLog>>,
    /// Counted among the run's waiting streaming readers.
    waiting: bool,
    /// When the last message went.
    last_sent: Option<Instant>,
}

/// One fed source of a task.
struct FedSource {
    source: usize,
    cursor: Cursor,
    ended: bool,
    pending: Vec<BlockId>,
}

impl Drop for Feeding {
    /// A feed dropped while it waits (its task ended early, or failed) no longer waits.
    fn drop(&mut self) {
        if self.waiting {
            self.run.state.lock().unwrap().streaming_waiting -= 1;
        }
    }
}

impl QueryRun {
    /// The feed of one attempt of task `task`: for each `(source, input)`, the blocks of
    /// stage input `input` to the task's in-memory source `source`, as they come; it ends
    /// when every fed input has. `log` starts afresh and records what was sent.
    pub(super) fn task_feed(
        self: &Arc<Self>,
        task: TaskId,
        fed: &[(usize, usize)],
        log: Arc<Mutex<FedLog>>,
    ) -> BoxStream<'static, Result<Fed>> {
        let (op_id, partition, _) = self.task_identity(task);
        *log.lock().unwrap() = FedLog::default();
        let sources = (fed.iter())
            .map(|&(source, input)| FedSource {
                source,
                cursor: self.input_cursor(op_id, input, partition, true),
                ended: false,
                pending: vec![],
            })
            .collect();
        let feeding = Feeding {
            run: Arc::clone(self),
            sources,
            changes: self.changes.subscribe(),
            log,
            waiting: false,
            last_sent: None,
        };
        futures::stream::unfold(feeding, |mut feeding| async move {
            let next = feeding.next_fed().await.transpose()?;
            Some((next, feeding))
        })
        .boxed()
    }
}

impl Feeding {
    /// The next message of the feed; `None` once every fed input has ended. The first
    /// blocks go at once (a limit above may need no more); later ones gather for up to
    /// [`FEED_EVERY`] or [`BLOCKS_PER_FEED`] blocks, as a message is a round trip.
    async fn next_fed(&mut self) -> Result<Option<Fed>> {
        loop {
            self.changes.borrow_and_update();
            let (ready, stalled, gather_for) = {
                let mut st = self.run.state.lock().unwrap();
                if std::mem::take(&mut self.waiting) {
                    st.streaming_waiting -= 1;
                }
                if let Some(e) = &st.error {
                    return Err(DataFusionError::Shared(Arc::clone(e)));
                }
                if st.cancelled {
                    return Ok(None);
                }
                for fed in &mut self.sources {
                    while !fed.ended && fed.pending.len() < BLOCKS_PER_FEED {
                        match st.next_block(&mut fed.cursor) {
                            Next::Block(id) => fed.pending.push(id),
                            Next::End => fed.ended = true,
                            Next::Wait => break,
                        }
                    }
                }
                let since = self.last_sent.map(|at| at.elapsed());
                let gather_for = since.and_then(|since| FEED_EVERY.checked_sub(since));
                let ready = self.sources.iter().position(|fed| {
                    !fed.pending.is_empty()
                        && (fed.ended
                            || fed.pending.len() >= BLOCKS_PER_FEED
                            || gather_for.is_none())
                });
                let pending = self.sources.iter().any(|fed| !fed.pending.is_empty());
                if !pending && self.sources.iter().all(|fed| fed.ended) {
                    return Ok(None);
                }
                let stalled = ready.is_none() && !pending && {
                    st.streaming_waiting += 1;
                    self.waiting = true;
                    self.run.stalled(&st)
                };
                (ready, stalled, gather_for.filter(|_| pending))
            };
            if stalled {
                // Every streaming reader waits and the slots are idle: the liveness rule.
                self.run.changed();
            }
            if let Some(i) = ready {
                let source = self.sources[i].source;
                let ids = std::mem::take(&mut self.sources[i].pending);
                self.last_sent = Some(Instant::now());
                return self.fed(source, ids).await.map(Some);
            }
            let changed = self.changes.changed();
            match gather_for {
                // Blocks wait to go with more: until the gathering time is up.
                Some(left) => {
                    let _ = tokio::time::timeout(left, changed).await;
                }
                None => {
                    if changed.await.is_err() {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// The message feeding blocks `ids` to source `source`: a ticket for each held by a
    /// live worker, the others inline (read here, recomputed if lost).
    async fn fed(&mut self, source: usize, ids: Vec<BlockId>) -> Result<Fed> {
        let mut fed = Fed {
            source,
            inputs: Vec::with_capacity(ids.len()),
            inline: vec![],
        };
        for id in ids {
            if let Some(held) = self.run.store.peek_held(id)
                && held.holder_alive()
            {
                let at = held.location();
                let bytes = self.run.block(id).map_or(0, |b| b.bytes);
                fed.inputs.push(TaskInput::Fetch(InputTicket {
                    address: at.address,
                    tls: at.tls,
                    key: at.key,
                    bytes,
                }));
                let mut log = self.log.lock().unwrap();
                log.bytes_by_ticket += bytes;
                log.by_ticket.push((id, held));
                log.ids.push(id);
                continue;
            }
            let batch = self.run.fetch(id).await?;
            fed.inputs.push(TaskInput::Inline(fed.inline.len()));
            let mut log = self.log.lock().unwrap();
            log.bytes_via_driver += batch.get_array_memory_size() as u64;
            log.ids.push(id);
            fed.inline.push(batch);
        }
        Ok(fed)
    }
}
