//! Block streams: what a task's stage inputs and the query's output read, walking a
//! [`Cursor`] and waiting for blocks still to come; releasing blocks as they are read where
//! the reader is the last to need them.

use std::sync::Arc;

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{StreamExt, TryStreamExt};

use crate::exec::cursor::{Cursor, Next, ReadOrder};
use crate::exec::run::QueryRun;
use crate::exec::task_kind::{TaskId, TaskKind};
use crate::plan::graph::OperatorId;
use crate::plan::stage_input::{
    InputExchange, InputProvider, PartitionRuns, SortedRun, TaskInputs,
};
use crate::store::cutter::bundle_pieces;

impl QueryRun {
    /// The cursor through which partition `partition` of `op` reads its input `input`.
    /// `deterministic`: read task by task (used once the producer has finished).
    pub(super) fn input_cursor(
        &self,
        op_id: OperatorId,
        input: usize,
        partition: usize,
        deterministic: bool,
    ) -> Cursor {
        let op = &self.graph.operators[op_id];
        let producer = &self.graph.operators[op.inputs[input]];
        let all: Vec<usize> = (0..producer.partitions()).collect();
        let streamed = deterministic && op.streamed_inputs[input] && self.streams_inputs(op_id);
        let (order, tag) = match &op.input_exchanges[input] {
            InputExchange::Preserve => (
                ReadOrder::Tasks {
                    partitions: vec![partition],
                },
                None,
            ),
            InputExchange::Gather if streamed && all.len() > 1 => {
                (ReadOrder::Interleaved { partitions: all }, None)
            }
            InputExchange::Gather if all.len() == 1 || deterministic => {
                (ReadOrder::Tasks { partitions: all }, None)
            }
            InputExchange::Gather => (ReadOrder::Arrival, None),
            InputExchange::Split(_) if streamed => {
                (ReadOrder::Interleaved { partitions: all }, Some(partition))
            }
            InputExchange::Split(_) if deterministic => {
                (ReadOrder::Tasks { partitions: all }, Some(partition))
            }
            InputExchange::Split(_) => (ReadOrder::Arrival, Some(partition)),
        };
        Cursor::new(producer.id, order, tag)
    }

    /// The stream of blocks a cursor walks, waiting for blocks still to come.
    pub(super) fn block_stream(
        self: &Arc<Self>,
        cursor: Cursor,
        reader: Reader,
        schema: datafusion::arrow::datatypes::SchemaRef,
    ) -> SendableRecordBatchStream {
        let rx = self.changes.subscribe();
        let wait_for_complete =
            self.policy.waits_for_producers() && matches!(reader, Reader::Output);
        let state = (Arc::clone(self), cursor, rx, reader);
        let stream =
            futures::stream::unfold(state, move |(run, mut cursor, mut rx, reader)| async move {
                if cursor.failed {
                    return None;
                }
                let mut waiting = false;
                let mut waiting_blocked = false;
                loop {
                    rx.borrow_and_update();
                    let mut asked = false;
                    let mut stalled = false;
                    let next = {
                        let mut st = run.state.lock().unwrap();
                        // Woken while waiting: its wait is not a new one.
                        let rewaiting = std::mem::take(&mut waiting);
                        let was_blocked = std::mem::take(&mut waiting_blocked);
                        if was_blocked {
                            st.output_blocked -= 1;
                        } else if rewaiting && !matches!(reader, Reader::Output) {
                            st.streaming_waiting -= 1;
                            if let Reader::Task(task) = reader {
                                st.tasks[task].build_waits -= 1;
                            }
                        }
                        if let Reader::Task(task) | Reader::StreamingTask(task) = reader {
                            st.tasks[task].read_an_input = true;
                        }
                        if let Some(e) = &st.error {
                            let e = DataFusionError::Shared(Arc::clone(e));
                            drop(st);
                            cursor.failed = true;
                            return Some((Err(e), (run, cursor, rx, reader)));
                        }
                        if st.cancelled {
                            return None;
                        }
                        if !st.operators[cursor.operator].demanded {
                            // Opens the gate of a streamed input: wake the scheduler.
                            st.operators[cursor.operator].demanded = true;
                            asked = true;
                        }
                        let next = if wait_for_complete && !st.operators[cursor.operator].complete {
                            Next::Wait
                        } else {
                            st.next_block(&mut cursor)
                        };
                        match (&next, &reader) {
                            (Next::Block(id), Reader::Task(task) | Reader::StreamingTask(task)) => {
                                st.tasks[*task].consumed.push(*id)
                            }
                            (Next::Wait, Reader::Task(task) | Reader::StreamingTask(task))
                                if run.streams_inputs(st.tasks[*task].operator) =>
                            {
                                st.streaming_waiting += 1;
                                if let Reader::Task(builder) = reader {
                                    st.tasks[builder].build_waits += 1;
                                }
                                waiting = true;
                                // Only a wait that begins can bring on a stall: every
                                // other change that can runs the scheduler itself.
                                // (Checking on every wake-up would wake the other
                                // waiting readers, which would wake this one: a spin.)
                                stalled = !rewaiting && run.stalled(&st);
                            }
                            (Next::Wait, Reader::Output) => {
                                // Waiting while the root holds unread output: for a task
                                // of the root the scheduler may hold back, so the liveness
                                // rule may act (see `QueryRun::stalled`).
                                waiting = true;
                                if run.root_output_held(&st) {
                                    st.output_blocked += 1;
                                    waiting_blocked = true;
                                    stalled = !was_blocked && run.stalled(&st);
                                }
                            }
                            _ => {}
                        }
                        next
                    };
                    if asked || stalled {
                        // A waiting reader with idle pools may need the liveness rule.
                        run.changed();
                    }
                    match next {
                        Next::End => return None,
                        Next::Wait => {
                            let wait = std::time::Duration::from_secs(10);
                            match tokio::time::timeout(wait, rx.changed()).await {
                                Ok(Ok(())) => {}
                                Ok(Err(_)) => return None,
                                Err(_) => log::warn!(
                                    "flumen reader of operator {} ({:?}) waited 10s: {}",
                                    cursor.operator,
                                    cursor.order,
                                    run.describe()
                                ),
                            }
                        }
                        Next::Block(id) => {
                            let batch = run.fetch(id).await;
                            cursor.failed = batch.is_err();
                            if matches!(reader, Reader::Output | Reader::StreamingTask(_)) {
                                run.release(&mut run.state.lock().unwrap(), id);
                                run.changed();
                            }
                            return Some((batch, (run, cursor, rx, reader)));
                        }
                    }
                }
            });
        Box::pin(RecordBatchStreamAdapter::new(schema, stream))
    }

    /// Output partition `partition` of the query.
    pub fn output(self: &Arc<Self>, partition: usize) -> Result<SendableRecordBatchStream> {
        {
            let mut st = self.state.lock().unwrap();
            st.outputs_opened += 1;
            st.outputs_open += 1;
        }
        let root = self.graph.root();
        let stream = if self.root_runs_in_output() {
            let provider = Arc::new(OutputProvider {
                run: Arc::clone(self),
            });
            let inputs = TaskInputs {
                provider,
                split: 0,
                scan_row_filter: Arc::default(),
                dropping_by: Default::default(),
                batch_rows: self.input_batch_rows(root.id),
            };
            let reads_a_table = crate::plan::stage_input::reads_a_table(&root.fragment);
            // The output runs every partition of the root here: its joins report to one node.
            let context = self.task_context(inputs, false, false, reads_a_table);
            root.fragment.execute(partition, context)?
        } else {
            let order = ReadOrder::Tasks {
                partitions: vec![partition],
            };
            let cursor = Cursor::new(root.id, order, None);
            self.block_stream(cursor, Reader::Output, root.fragment.schema())
        };
        let timeout = self.config.query_timeout_secs;
        let deadline = (timeout > 0).then(|| {
            let at = self.started_at + std::time::Duration::from_secs(timeout);
            Box::pin(tokio::time::sleep_until(at.into()))
        });
        Ok(Box::pin(OutputStream {
            inner: stream,
            run: Arc::clone(self),
            deadline,
            timed_out: false,
        }))
    }

    /// An output stream was dropped. Once every output partition has been opened and
    /// dropped, the run is cancelled (a consumer that stops early, as `LIMIT` does).
    pub(super) fn output_closed(&self) {
        let mut st = self.state.lock().unwrap();
        st.outputs_open -= 1;
        let all_opened = st.outputs_opened >= self.graph.root().partitions();
        if st.outputs_open == 0 && all_opened {
            st.cancelled = true;
            for abort in st.aborts.drain(..) {
                abort.abort();
            }
            drop(st);
            self.notify();
        }
    }
}

/// Who reads a block stream.
#[derive(Debug, Clone, Copy)]
pub(super) enum Reader {
    /// A task: blocks are released when it finishes.
    Task(TaskId),
    /// A task reading a streamed (probe) input: blocks are released as they are read, so
    /// memory holds only what is in flight; lineage recomputes them if the task must run
    /// again.
    StreamingTask(TaskId),
    /// The same task being recomputed: nothing is recorded.
    Recompute,
    /// The query's output: blocks are released as they are read.
    Output,
}

/// Inputs of one scheduled task.
#[derive(Debug)]
pub(super) struct TaskProvider {
    pub(super) run: Arc<QueryRun>,
    pub(super) task: TaskId,
    pub(super) operator: OperatorId,
    pub(super) kind: TaskKind,
    pub(super) record: bool,
}

impl InputProvider for TaskProvider {
    fn open(&self, input: usize, partition: usize) -> Result<SendableRecordBatchStream> {
        let run = &self.run;
        let op = &run.graph.operators[self.operator];
        let producer = &run.graph.operators[*op.inputs.get(input).ok_or_else(|| {
            DataFusionError::Internal(format!("operator {} has no input {input}", op.id))
        })?];
        let schema = producer.fragment.schema();
        match &self.kind {
            TaskKind::Blocks { inputs } => {
                // A bundle of blocks reaches the fragment as one batch.
                let inputs = inputs.clone();
                let run = Arc::clone(run);
                let batch_schema = Arc::clone(&schema);
                let (target, cut) = (
                    run.graph.piece_rows(self.operator),
                    run.graph.piece_cut(self.operator),
                );
                let stream = futures::stream::once(async move {
                    let mut batches = Vec::with_capacity(inputs.len());
                    for id in inputs {
                        batches.push(run.fetch(id).await?);
                    }
                    // Hand the fragment the bundle in pieces of at most the target size.
                    let pieces: Vec<Result<RecordBatch>> =
                        bundle_pieces(&batch_schema, batches, target, cut)?
                            .into_iter()
                            .map(Ok)
                            .collect();
                    Ok::<_, DataFusionError>(futures::stream::iter(pieces))
                })
                .try_flatten()
                .boxed();
                Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
            }
            TaskKind::Slice {
                input: sliced,
                blocks,
            } if *sliced == input => {
                // Its slice of the input, block by block; released when the task ends.
                let blocks = blocks.clone();
                let run = Arc::clone(run);
                let stream = futures::stream::iter(blocks)
                    .then(move |id| run.fetch(id))
                    .boxed();
                Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
            }
            TaskKind::Partition | TaskKind::Slice { .. } => {
                let cursor = run.input_cursor(self.operator, input, partition, true);
                let reader = if !self.record {
                    Reader::Recompute
                } else if op.streamed_inputs[input] && run.streams_inputs(op.id) {
                    Reader::StreamingTask(self.task)
                } else {
                    Reader::Task(self.task)
                };
                Ok(run.block_stream(cursor, reader, schema))
            }
            TaskKind::Source { .. } => Err(DataFusionError::Internal(format!(
                "source task of operator {} has no stage inputs",
                op.id
            ))),
        }
    }

    fn open_runs(&self, input: usize, partition: usize) -> Result<Option<PartitionRuns>> {
        let run = &self.run;
        let op = &run.graph.operators[self.operator];
        let producer_id = op.inputs[input];
        // Only a whole partition of a producer that has finished, kept partition by
        // partition, comes as its tasks' runs.
        if !matches!(self.kind, TaskKind::Partition)
            || !matches!(op.input_exchanges[input], InputExchange::Preserve)
        {
            return Ok(None);
        }
        let tasks: Vec<(TaskId, u64)> = {
            let st = run.state.lock().unwrap();
            let producer = &st.operators[producer_id];
            if !producer.complete {
                return Ok(None);
            }
            // What a merge holds of each run at most: its largest block.
            (producer.partitions[partition].tasks.iter())
                .map(|t| {
                    let outputs = &st.tasks[*t].outputs;
                    let largest = outputs.iter().map(|id| st.blocks[id].bytes).max();
                    (*t, largest.unwrap_or(0))
                })
                .collect()
        };
        let schema = run.graph.operators[producer_id].fragment.schema();
        let reader = if self.record {
            Reader::Task(self.task)
        } else {
            Reader::Recompute
        };
        let runs = (tasks.into_iter())
            .map(|(task, largest_block_bytes)| {
                let cursor = Cursor::new(producer_id, ReadOrder::Task(task), None);
                SortedRun {
                    stream: run.block_stream(cursor, reader, Arc::clone(&schema)),
                    largest_block_bytes,
                }
            })
            .collect();
        Ok(Some(PartitionRuns {
            runs,
            merge_bytes: run.graph.sizing.partition_bytes,
        }))
    }
}

/// Inputs of the root fragment when the output's consumer runs it.
#[derive(Debug)]
pub(super) struct OutputProvider {
    run: Arc<QueryRun>,
}

impl InputProvider for OutputProvider {
    fn open(&self, input: usize, partition: usize) -> Result<SendableRecordBatchStream> {
        let run = &self.run;
        let root = run.graph.root();
        let producer = &run.graph.operators[root.inputs[input]];
        let cursor = run.input_cursor(root.id, input, partition, false);
        Ok(run.block_stream(cursor, Reader::Output, producer.fragment.schema()))
    }
}

/// The query's output stream; dropping every output stream cancels the run. Past
/// `flumen.query_timeout_secs` it ends with a timeout error.
pub(super) struct OutputStream {
    inner: SendableRecordBatchStream,
    run: Arc<QueryRun>,
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Ended early (the timeout, or a panic): nothing more comes.
    timed_out: bool,
}

impl futures::Stream for OutputStream {
    type Item = Result<RecordBatch>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::future::Future;
        if self.timed_out {
            return std::task::Poll::Ready(None);
        }
        if let Some(deadline) = self.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            self.timed_out = true;
            let secs = self.run.config.query_timeout_secs;
            return std::task::Poll::Ready(Some(Err(DataFusionError::Execution(format!(
                "the query ran past flumen.query_timeout_secs ({secs}s) and was cancelled"
            )))));
        }
        // A function that panics in the fragment the consumer runs fails the query, as it
        // would in a task, instead of unwinding into the caller.
        let inner = &mut self.inner;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll_next_unpin(cx))) {
            // The fragment the consumer runs refused memory as a task would: said alike.
            Ok(std::task::Poll::Ready(Some(Err(e)))) => {
                std::task::Poll::Ready(Some(Err(self.run.naming_the_budget(e))))
            }
            Ok(poll) => poll,
            Err(panic) => {
                self.timed_out = true;
                let message = crate::panic_message(&*panic);
                std::task::Poll::Ready(Some(Err(DataFusionError::Execution(format!(
                    "the query's output panicked: {message}"
                )))))
            }
        }
    }
}

impl datafusion::physical_plan::RecordBatchStream for OutputStream {
    fn schema(&self) -> datafusion::arrow::datatypes::SchemaRef {
        self.inner.schema()
    }
}

impl Drop for OutputStream {
    fn drop(&mut self) {
        self.run.output_closed();
    }
}
