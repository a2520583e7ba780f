//! `ORDER BY random()` as a random shuffle: a seeded, reproducible permutation of the rows
//! done by an exchange, not by sorting on a random key.
//!
//! [`PlanRandomShuffles`] (a physical optimizer rule, after DataFusion's own) finds a full sort
//! whose first key is `random()` (no `LIMIT`: `ORDER BY random() LIMIT k` stays a top-k
//! sample) and puts in its place:
//!
//! ```text
//! ConcatPartitionsExec                      partitions 0, 1, ... one after the other
//!   RandomPermuteExec: seed=S               each partition permuted in memory
//!     RepartitionExec: Hash([row_hash], N)  random partition: the exchange's map tasks
//!       ProjectionExec: [..., row_hash(S, every column)]
//! ```
//!
//! A row's partition follows from `row_hash(S, row)`, a hash of its values, not from where
//! or when it was read, so a recomputed map task (lineage) sends every row where it went the
//! first time, and the same seed gives the same permutation in every run with the same number
//! of partitions (the exchange sizing's, shown in `EXPLAIN`). A partition puts its rows in the
//! hash's order (a canonical order, whatever order the blocks arrived in), then permutes them
//! with a generator seeded by `S` and the partition (Fisher–Yates): identical rows share a
//! hash, and the permutation still places them apart. The seed is `flumen.shuffle_seed`, or
//! drawn per query when it is unset.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::array::{Array, RecordBatch};
use datafusion::arrow::compute::interleave_record_batch;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryConsumer;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr, ScalarFunctionExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties,
};
use futures::TryStreamExt;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::config::FlumenConfig;
use crate::functions::row_hash::row_hash_of_columns;
use crate::plan::concat_partitions::ConcatPartitionsExec;
use crate::plan::only_child;

/// The column the shuffle's map side adds: `row_hash(seed, every column)`.
pub const SHUFFLE_KEY: &str = "__flumen_shuffle_key";

/// Physical optimizer rule: `ORDER BY random()` (a full sort) becomes a random shuffle.
#[derive(Debug, Default)]
pub struct PlanRandomShuffles;

impl PhysicalOptimizerRule for PlanRandomShuffles {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        options: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let seed = options
            .extensions
            .get::<FlumenConfig>()
            .and_then(|c| c.shuffle_seed.0);
        let partitions = options.execution.target_partitions.max(1);
        plan.transform_down(|node| {
            let sort_input = if let Some(merge) = node.downcast_ref::<SortPreservingMergeExec>()
                && merge.fetch().is_none()
                && orders_randomly(merge.expr().first().expr.as_ref())
            {
                // The merge's input is the per-partition sort (or a node keeping its order).
                match merge.input().downcast_ref::<SortExec>() {
                    Some(sort) if sort.fetch().is_none() => Some(Arc::clone(sort.input())),
                    _ => None,
                }
            } else if let Some(sort) = node.downcast_ref::<SortExec>()
                && sort.fetch().is_none()
                && !sort.preserve_partitioning()
                && orders_randomly(sort.expr().first().expr.as_ref())
            {
                Some(Arc::clone(sort.input()))
            } else {
                None
            };
            match sort_input {
                Some(input) => {
                    let seed = seed.unwrap_or_else(drawn_seed);
                    let shuffled = random_shuffle(input, seed, partitions, options)?;
                    Ok(Transformed::new(shuffled, true, TreeNodeRecursion::Jump))
                }
                None => Ok(Transformed::no(node)),
            }
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "plan_random_shuffles"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether a sort key is a call of the volatile `random()`.
fn orders_randomly(expr: &dyn PhysicalExpr) -> bool {
    expr.downcast_ref::<ScalarFunctionExpr>()
        .is_some_and(|f| f.name() == "random" && f.args().is_empty())
}

/// A fresh seed for a query that set none.
fn drawn_seed() -> u64 {
    let mut bytes = [0u8; 8];
    // No entropy: fall back to the clock, still a different permutation per query.
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        bytes = nanos.to_le_bytes();
    }
    u64::from_le_bytes(bytes)
}

/// `input`'s rows in a random order seeded by `seed`, through `partitions` shuffle partitions.
pub fn random_shuffle(
    input: Arc<dyn ExecutionPlan>,
    seed: u64,
    partitions: usize,
    options: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    let schema = input.schema();
    let columns: Vec<Arc<dyn PhysicalExpr>> = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| Arc::new(Column::new(f.name(), i)) as Arc<dyn PhysicalExpr>)
        .collect();
    let Some(key) = row_hash_of_columns(&schema, seed, &[], options)? else {
        return Err(DataFusionError::Plan(
            "ORDER BY random() over rows with no column that can be hashed".into(),
        ));
    };
    let mut projection: Vec<ProjectionExpr> = columns
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| ProjectionExpr::new(Arc::clone(c), f.name().clone()))
        .collect();
    projection.push(ProjectionExpr::new(key, SHUFFLE_KEY.to_string()));
    let keyed = Arc::new(ProjectionExec::try_new(projection, input)?);
    let key_column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(SHUFFLE_KEY, columns.len()));
    let exchange = Arc::new(RepartitionExec::try_new(
        keyed,
        Partitioning::Hash(vec![key_column], partitions),
    )?);
    let permuted = Arc::new(RandomPermuteExec::new(exchange, seed));
    Ok(Arc::new(ConcatPartitionsExec::new(permuted)))
}

/// Per partition: every row of the partition, put in the shuffle key's order and then
/// permuted by a generator seeded with the seed and the partition; the key column dropped.
/// Holds its partition in memory (the exchange sizing makes partitions fit the budget).
#[derive(Debug)]
pub struct RandomPermuteExec {
    input: Arc<dyn ExecutionPlan>,
    seed: u64,
    properties: Arc<PlanProperties>,
}

impl RandomPermuteExec {
    /// Permute each partition of `input` (whose last column is the shuffle key).
    pub fn new(input: Arc<dyn ExecutionPlan>, seed: u64) -> Self {
        let input_schema = input.schema();
        let kept: Vec<usize> = (0..input_schema.fields().len().saturating_sub(1)).collect();
        let schema = Arc::new(
            input_schema
                .project(&kept)
                .expect("projecting a schema onto its own columns"),
        );
        let partitions = input.output_partitioning().partition_count();
        let properties = PlanProperties::new(
            EquivalenceProperties::new(schema),
            Partitioning::UnknownPartitioning(partitions),
            EmissionType::Final,
            Boundedness::Bounded,
        );
        Self {
            input,
            seed,
            properties: Arc::new(properties),
        }
    }

    /// The shuffle's seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

impl DisplayAs for RandomPermuteExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "RandomPermuteExec: seed={}", self.seed)
    }
}

impl ExecutionPlan for RandomPermuteExec {
    fn name(&self) -> &str {
        "RandomPermuteExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = only_child(children, "RandomPermuteExec")?;
        Ok(Arc::new(Self::new(input, self.seed)))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, Arc::clone(&context))?;
        let schema = self.schema();
        let seed = self.seed;
        let batch_size = context.session_config().batch_size().max(1);
        let reservation = MemoryConsumer::new(format!("RandomPermuteExec[{partition}]"))
            .register(context.memory_pool());
        let permuted = futures::stream::once(async move {
            let mut batches = vec![];
            let mut keys = vec![];
            let mut input = input;
            while let Some(batch) = input.try_next().await? {
                reservation.try_grow(crate::store::rows_bytes(&batch) as usize)?;
                keys.push(shuffle_keys(&batch)?);
                batches.push(batch);
            }
            let order = permutation(&keys, seed, partition);
            let kept: Vec<usize> = (0..schema.fields().len()).collect();
            let batches = batches
                .iter()
                .map(|b| b.project(&kept))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let refs: Vec<&RecordBatch> = batches.iter().collect();
            let out = order
                .chunks(batch_size)
                .map(|rows| interleave_record_batch(&refs, rows).map_err(DataFusionError::from))
                .collect::<Result<Vec<_>>>()?;
            drop(reservation);
            Ok::<_, DataFusionError>(futures::stream::iter(out.into_iter().map(Ok)))
        })
        .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            permuted,
        )))
    }
}

/// The shuffle key column (the last) of `batch`.
fn shuffle_keys(batch: &RecordBatch) -> Result<Vec<u64>> {
    let last = batch.num_columns().checked_sub(1);
    let keys = last
        .and_then(|i| {
            batch
                .column(i)
                .as_any()
                .downcast_ref::<datafusion::arrow::array::UInt64Array>()
        })
        .ok_or_else(|| {
            DataFusionError::Internal(format!("RandomPermuteExec: no {SHUFFLE_KEY} column"))
        })?;
    Ok(keys.values().to_vec())
}

/// `(batch, row)` of every row, in key order and then permuted by a generator seeded with
/// `seed` and `partition`.
fn permutation(keys: &[Vec<u64>], seed: u64, partition: usize) -> Vec<(usize, usize)> {
    let mut rows: Vec<(u64, usize, usize)> = keys
        .iter()
        .enumerate()
        .flat_map(|(b, ks)| ks.iter().enumerate().map(move |(r, k)| (*k, b, r)))
        .collect();
    rows.sort_unstable_by_key(|(k, _, _)| *k);
    let mut order: Vec<(usize, usize)> = rows.into_iter().map(|(_, b, r)| (b, r)).collect();
    let stream_seed = seed ^ (partition as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    order.shuffle(&mut StdRng::seed_from_u64(stream_seed));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_permutation_fixed_by_seed_and_partition() {
        let keys = vec![
            (0..500u64).map(|i| i * 7919).collect::<Vec<_>>(),
            vec![3; 500],
        ];
        let a = permutation(&keys, 1, 0);
        let mut sorted = a.clone();
        sorted.sort();
        let all: Vec<(usize, usize)> = (0..2).flat_map(|b| (0..500).map(move |r| (b, r))).collect();
        assert_eq!(sorted, all, "not a permutation");
        assert_eq!(a, permutation(&keys, 1, 0));
        assert_ne!(a, permutation(&keys, 2, 0));
        assert_ne!(a, permutation(&keys, 1, 1));
        // The 500 rows sharing a key (identical rows) end up spread out, not in one run.
        let positions: Vec<usize> = a
            .iter()
            .enumerate()
            .filter(|(_, (b, _))| *b == 1)
            .map(|(i, _)| i)
            .collect();
        assert!(positions[0] < 50 && positions[499] > 950, "{positions:?}");
    }
}
