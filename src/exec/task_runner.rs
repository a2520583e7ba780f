//! The two runners of a [`TaskSpec`]: [`InProcess`] (this process's threads) and
//! [`OnWorker`] (a worker process of the task's pool). Both hand the task's blocks to a
//! [`TaskSink`] as they are made, whether the task runs for the first time or again for
//! lost blocks.

use std::sync::Arc;

use async_trait::async_trait;
use datafusion::error::Result;

use crate::cluster::on_driver::OnDriver;
use crate::cluster::worker_handle::WorkerBlock;
use crate::cluster::worker_pool::WorkerPool;
use crate::exec::run::QueryRun;
use crate::exec::task_sink::{MadeBlock, TaskSink};
use crate::exec::task_spec::TaskSpec;
use crate::plan::model_cache_lookup::take_lookup_figures;

/// Runs a task's spec, handing its blocks to a sink.
#[async_trait]
pub(super) trait TaskRunner: Send + Sync {
    /// Run `spec`'s task of `run`, each block to `sink` as it is made. `Ok(Some(why))`: the
    /// runner could not take the task after all and made nothing (a worker's plan with its
    /// inputs filled in did not encode); the caller runs it in process.
    async fn run(
        &self,
        run: &Arc<QueryRun>,
        spec: &TaskSpec,
        sink: &mut dyn TaskSink,
    ) -> Result<Option<OnDriver>>;
}

/// This process runs the task: its operator's fragment reading its inputs from the run
/// ([`QueryRun::execute_task`]), or, for a task run again that first ran on a worker, the
/// plan its worker ran, which cuts the same blocks.
pub(super) struct InProcess;

#[async_trait]
impl TaskRunner for InProcess {
    async fn run(
        &self,
        run: &Arc<QueryRun>,
        spec: &TaskSpec,
        sink: &mut dyn TaskSink,
    ) -> Result<Option<OnDriver>> {
        if !sink.first_run()
            && run.ran_on_worker(spec.task)
            && let Some(blocks) = run.worker_plan_here(spec.task).await?
        {
            for (tag, batch) in blocks {
                let bytes = batch.get_array_memory_size() as u64;
                sink.take(MadeBlock::Local { tag, batch, bytes })?;
            }
            sink.taken();
        } else {
            run.execute_task(spec, sink).await?;
        }
        // What its model-cache lookups read (a worker's task sends its own).
        let fragment = &run.graph.operators[spec.operator].fragment;
        let read = take_lookup_figures(fragment, run.config());
        run.stats(spec.operator).observe_model_metrics(read);
        Ok(None)
    }
}

/// A worker of `pool` runs the task ([`QueryRun::run_worker_task`]): its input blocks held
/// by workers are fetched by that worker from them, and its blocks stay in it. A worker's
/// retry of the task starts the sink's places again.
pub(super) struct OnWorker(pub Arc<WorkerPool>);

#[async_trait]
impl TaskRunner for OnWorker {
    async fn run(
        &self,
        run: &Arc<QueryRun>,
        spec: &TaskSpec,
        sink: &mut dyn TaskSink,
    ) -> Result<Option<OnDriver>> {
        let mut on_block = |seq: usize, block: WorkerBlock| {
            // A worker's attempt numbers its blocks from 0: a retry starts counting again.
            if seq == 0 {
                sink.restart();
            }
            sink.take(match block {
                WorkerBlock::Held(held) => MadeBlock::Held(held),
                WorkerBlock::Carried(info, batch) => MadeBlock::Carried { info, batch },
            })?;
            sink.taken();
            Ok(())
        };
        run.run_worker_task(&self.0, spec, &mut on_block).await
    }
}
