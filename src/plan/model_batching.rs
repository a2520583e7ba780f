//! How a plan that calls a model feeds it its rows, decided once when the plan is cut: the
//! first-block ramp (small first blocks so that the first rows leave the model early:
//! `crate::store::ramp`), how many rows the model gets at once, and how small its scans'
//! splits are. One value on the operator graph ([`crate::plan::OperatorGraph::batching`]);
//! the planner, the scheduler, the task loops and the workers' task requests ask it instead
//! of each reading `flumen.*` settings and looking for models in the plan.
//!
//! The device's own batching (passes queued ahead, token buckets) belongs to the model's
//! worker: `crate::functions::embedding::pass_queue`.

use std::sync::Arc;

use datafusion::config::ConfigOptions;
use datafusion::physical_plan::ExecutionPlan;

use crate::config::FlumenConfig;
use crate::functions::accelerator::{AcceleratorFunction, accelerator_functions_in};
use crate::plan::accelerator_projection::AcceleratorProjectionExec;
use crate::plan::split_source::{ModelSplitLimit, split_ramps};
use crate::store::ramp::ramp_rows;

/// How a plan's rows reach its models (see the module doc). A plan without a model has no
/// ramp and no split limit; its model operators' piece size is moot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelBatching {
    /// Rows of a run's first blocks, which then double (0: no ramp). `flumen.first_block_rows`
    /// in plans with a model, at most `flumen.cpu_model_first_block_rows` where every model
    /// computes on CPU threads; 0 in plans without one.
    pub first_block_rows: usize,
    /// Rows a ramped task's blocks grow to, and its later blocks are cut at, and the most
    /// rows a model's per-block operator hands the model at once: `flumen.model_piece_rows`
    /// (0: the target block size). A model then gets each piece the CPU makes of the first
    /// splits as soon as it is made, not the next doubled block.
    pub piece_rows: usize,
    /// Rows of a full block (`flumen.target_block_rows`), where bundles' ramp ends.
    pub block_rows: usize,
    /// How many first splits of each source partition read small batches: one per CPU slot,
    /// so that every slot's first task starts small.
    pub ramped_splits: usize,
    /// The most rows and data bytes a source split reads where the plan ramps.
    split_limit: ModelSplitLimit,
}

impl ModelBatching {
    /// How `plan`, under the session's `config`, feeds its models. Small first blocks pay
    /// only where a model waits for them: elsewhere a first split read in small batches
    /// costs every operator above it per batch (TPC-H SF1: geomean 1.43x vanilla, q13 9x,
    /// with row groups of a million rows as first splits). A model that computes on CPU
    /// threads takes tens of milliseconds a row (MiniLM: ~25 ms a document on two cores),
    /// so its ramp starts lower.
    pub(crate) fn for_plan(
        plan: &Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
        config: &FlumenConfig,
    ) -> Self {
        let models = models_in(plan);
        let first_block_rows = if models.is_empty() {
            0
        } else if models
            .iter()
            .all(|model| model.resources(options).accelerators == 0)
        {
            config
                .first_block_rows
                .min(config.cpu_model_first_block_rows)
        } else {
            config.first_block_rows
        };
        Self {
            first_block_rows,
            piece_rows: config.model_piece_rows,
            block_rows: config.block_rows(),
            ramped_splits: config.cpu_slots.max(1),
            split_limit: ModelSplitLimit {
                rows: config.model_split_rows as u64,
                data_bytes: config.model_split_bytes.0,
            },
        }
    }

    /// Whether the plan's first blocks ramp up (it has a model and the ramp is on).
    pub fn ramps(&self) -> bool {
        self.first_block_rows > 0
    }

    /// The most a source split reads: rows cost far more than their bytes say before a
    /// model (`clean_text`, tokenizing), so splits by bytes alone would be too few to share
    /// the CPU slots out. No limit where the plan does not ramp.
    pub(crate) fn split_limit(&self) -> ModelSplitLimit {
        match self.ramps() {
            true => self.split_limit,
            false => ModelSplitLimit::NONE,
        }
    }

    /// Rows a model's per-block operator hands the model at once, and so the most rows of
    /// each block it writes: [`Self::piece_rows`], at most the target block size (other
    /// operators' tasks cut blocks of the target: [`crate::plan::OperatorGraph::piece_rows`]).
    pub fn model_piece_rows(&self) -> usize {
        match self.piece_rows {
            0 => self.block_rows,
            piece => piece.min(self.block_rows),
        }
    }

    /// Most rows of the `bundles_so_far`-th bundle (0-based) a model's per-block task
    /// gathers of a partition's blocks: they ramp from `first_block_rows` up to the target,
    /// so that the first rows leave the model early.
    pub fn model_bundle_rows(&self, bundles_so_far: usize) -> usize {
        ramp_rows(self.first_block_rows, self.block_rows, bundles_so_far)
    }

    /// Rows the blocks of a task running `fragment` ramp up from: `first_block_rows` for a
    /// source task whose `split` is one of its partition's first splits (they read batches
    /// that small), else 0 (no ramp). `None`: not a source task.
    pub fn first_rows_of_task(
        &self,
        fragment: &Arc<dyn ExecutionPlan>,
        split: Option<usize>,
    ) -> usize {
        match split {
            Some(split) if split_ramps(fragment, split) => self.first_block_rows,
            _ => 0,
        }
    }
}

/// The models the accelerator projections of `plan` call.
fn models_in(plan: &Arc<dyn ExecutionPlan>) -> Vec<Arc<dyn AcceleratorFunction>> {
    let mut found = vec![];
    if let Some(projection) = plan.downcast_ref::<AcceleratorProjectionExec>() {
        for expr in projection.projection().expr() {
            found.extend(accelerator_functions_in(&expr.expr));
        }
    }
    for child in plan.children() {
        found.extend(models_in(child));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::Schema;
    use datafusion::physical_plan::empty::EmptyExec;

    /// A plan without a model.
    fn plain_plan() -> Arc<dyn ExecutionPlan> {
        Arc::new(EmptyExec::new(Arc::new(Schema::empty())))
    }

    /// The batching of a plan with a model on an accelerator under these settings.
    fn with_model(first_block_rows: usize, piece_rows: usize) -> ModelBatching {
        let config = FlumenConfig {
            first_block_rows,
            model_piece_rows: piece_rows,
            target_block_rows: 8192,
            ..FlumenConfig::default()
        };
        ModelBatching {
            first_block_rows,
            ..ModelBatching::for_plan(&plain_plan(), &ConfigOptions::new(), &config)
        }
    }

    #[test]
    fn a_plan_without_a_model_neither_ramps_nor_limits_its_splits() {
        let config = FlumenConfig {
            first_block_rows: 32,
            ..FlumenConfig::default()
        };
        let plan = plain_plan();
        let plain = ModelBatching::for_plan(&plan, &ConfigOptions::new(), &config);
        assert!(!plain.ramps());
        assert_eq!(plain.split_limit(), ModelSplitLimit::NONE);
        assert_eq!(plain.model_bundle_rows(0), config.block_rows());
        assert_eq!(plain.first_rows_of_task(&plan, Some(0)), 0);
    }

    #[test]
    fn a_models_bundles_ramp_up_to_the_target() {
        let b = with_model(256, 1024);
        assert!(b.ramps());
        let rows: Vec<usize> = (0..7).map(|k| b.model_bundle_rows(k)).collect();
        assert_eq!(rows, vec![256, 512, 1024, 2048, 4096, 8192, 8192]);
        assert_ne!(b.split_limit(), ModelSplitLimit::NONE);
    }

    #[test]
    fn a_model_takes_pieces_of_at_most_a_block() {
        assert_eq!(with_model(32, 1024).model_piece_rows(), 1024);
        assert_eq!(with_model(32, 100_000).model_piece_rows(), 8192);
        // 0: the target block size.
        assert_eq!(with_model(32, 0).model_piece_rows(), 8192);
    }
}
