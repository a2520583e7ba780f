//! A partitioned hash join's bound from its build side, for the scans of its probe side.
//!
//! DataFusion's hash join fills a dynamic filter from its build side (its keys' range and,
//! for a few keys, a lookup in them) that the Parquet scans of its probe side prune by, and
//! starts those scans only once its build is in. With worker processes a join is a barrier
//! (its task starts once both inputs are complete), so its probe side's scans ran beside
//! its build side and the filter was filled on the worker that ran the join, after every
//! probe row had been read and exchanged: TPC-H q17 aggregated all of `lineitem` by
//! `l_partkey` for a join that keeps 0.1% of it, and a join that could match nothing read
//! its whole probe table. In threads mode the filter was there in time, but a partitioned
//! join's is `CASE hash(key) % n WHEN i THEN ...`, too dear to drop rows by before the
//! exchange (`crate::plan::join_filter_rows`): TPC-H q7 exchanged and probed every row.
//!
//! So a source operator whose scans read such a join's filter (a [`BuildBound`]'s readers)
//! waits until the join's build producer is complete (measured on TPC-H SF1 with workers:
//! 1.005x the time without the wait; threads mode waited for the join's build anyway).
//! Each task of the build producer sums up its output's keys where it runs, on its worker
//! or in its thread (their range, and their list while short:
//! [`crate::plan::build_keys`]; and, where too many to list, their set:
//! [`crate::plan::key_membership`]); once all are in, the driver merges them into the
//! bound and adds it to the run's bounds under the filter's id (`false` where the build
//! side has no row: [`empty_build_side`]). Every probe split launched after starts from
//! it, for every run of it (`crate::plan::task_bounds`): it prunes its row groups by it (in
//! worker mode a split whose files it rules out is not sent: `tasks_pruned_at_launch`)
//! and, where a list or a set makes it selective, drops the rows it rejects before they
//! are exchanged ([`DroppingBy`]; `flumen.build_key_sets` off, only a split under a
//! grouped aggregate drops rows, by a list). A task that made no summary (a key without an
//! order) leaves the join without a bound but for an empty build side. Making the bound on
//! the driver from the build blocks cost more than it saved (`docs/benchmarks.md`, "a
//! join's bound from its build side tried").

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::NullEquality;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_expr::expressions::{DynamicFilterPhysicalExpr, lit};
use datafusion::physical_plan::joins::HashJoinExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};

use crate::plan::graph::{Operator, OperatorId, TaskShape};
use crate::plan::stage_input::StageInputExec;

/// The bound of an empty build side: no probe row can match.
pub fn empty_build_side() -> Arc<dyn PhysicalExpr> {
    lit(false)
}

/// A hash join whose build side is another operator's output and whose dynamic filter the
/// scans of other (source) operators read.
#[derive(Debug, Clone)]
pub struct BuildBound {
    /// The expression id of the join's dynamic filter.
    pub filter: u64,
    /// The join's build-side keys, on its build producer's output columns; empty where
    /// the join's build input does not read them as its producer puts them out (no bound
    /// then but for an empty build side).
    pub build_keys: Vec<Arc<dyn PhysicalExpr>>,
    /// The join's probe-side keys: the columns the filter reads.
    pub probe_keys: Vec<Arc<dyn PhysicalExpr>>,
    /// The schema of the join's probe side, which the probe keys read.
    pub probe_schema: SchemaRef,
    /// The operator whose blocks are the join's build side.
    pub build_producer: OperatorId,
    /// The source operators whose scans read the filter: they wait for the build side.
    pub readers: Vec<OperatorId>,
}

/// The joins of `operators` whose probe side's scans wait for their build side (see the
/// module doc): a hash join in a per-partition operator whose build side is
/// a stage input, whose keys never match NULLs, and whose filter a source operator's scan
/// reads.
pub fn build_bounds(operators: &[Operator]) -> Vec<BuildBound> {
    // The filters each source operator's scans read, walked once per operator.
    let sources: Vec<(OperatorId, HashSet<u64>)> = (operators.iter())
        .filter(|op| op.shape == TaskShape::Source)
        .map(|op| (op.id, filters_read(&op.fragment)))
        .collect();
    let mut found = vec![];
    for op in operators.iter().filter(|op| op.shape == TaskShape::Barrier) {
        let _ = op.fragment.apply(|node| {
            if let Some(bound) = join_bound(node, &sources, operators) {
                found.push(bound);
            }
            Ok(TreeNodeRecursion::Continue)
        });
    }
    found
}

/// `node`'s bound, when it is a hash join as [`build_bounds`] takes (`sources`: each source
/// operator with the filters its scans read).
fn join_bound(
    node: &Arc<dyn ExecutionPlan>,
    sources: &[(OperatorId, HashSet<u64>)],
    operators: &[Operator],
) -> Option<BuildBound> {
    let join = node.downcast_ref::<HashJoinExec>()?;
    if join.null_equality() != NullEquality::NullEqualsNothing {
        return None;
    }
    let build = join.left().downcast_ref::<StageInputExec>()?;
    let produced = node.dynamic_expressions_produced();
    let [filter] = produced.as_slice() else {
        return None;
    };
    let filter = filter.expression_id()?;
    let readers: Vec<_> = (sources.iter())
        .filter(|(_, read)| read.contains(&filter))
        .map(|(id, _)| *id)
        .collect();
    if readers.is_empty() {
        return None;
    }
    // The build keys read the join's build input; the producer's blocks must hold the same
    // columns at the same places for a worker to read them there.
    let produced = operators.get(build.producer())?.fragment.schema();
    let same_columns = (produced.fields().len() == build.schema().fields().len())
        && (produced.fields().iter().zip(build.schema().fields()))
            .all(|(a, b)| a.data_type() == b.data_type());
    Some(BuildBound {
        filter,
        build_keys: match same_columns {
            true => join.on().iter().map(|(l, _)| Arc::clone(l)).collect(),
            false => vec![],
        },
        probe_keys: join.on().iter().map(|(_, r)| Arc::clone(r)).collect(),
        probe_schema: join.right().schema(),
        build_producer: build.producer(),
        readers,
    })
}

/// The expression ids of the dynamic filters the nodes of `plan` read.
fn filters_read(plan: &Arc<dyn ExecutionPlan>) -> HashSet<u64> {
    let mut ids = HashSet::new();
    let _ = plan.apply(|node| {
        node.apply_expressions(&mut |expr| {
            expr.apply(|e| {
                if e.downcast_ref::<DynamicFilterPhysicalExpr>().is_some()
                    && let Some(id) = e.expression_id()
                {
                    ids.insert(id);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })?;
        Ok(TreeNodeRecursion::Continue)
    });
    ids
}

/// The join filters whose bound from a build side a scan's splits drop rows by (the run's
/// `build_bounds_made_for`): in worker mode a `FilterExec` over the split's scan, in
/// threads mode the split source itself (`crate::plan::split_source::SplitSourceExec`).
#[derive(Debug, Default, Clone)]
pub struct DroppingBy {
    /// Those the splits under a grouped aggregate drop rows by.
    pub under_grouping: HashSet<u64>,
    /// Those every split drops rows by (among `under_grouping`).
    pub everywhere: HashSet<u64>,
}

impl DroppingBy {
    /// The filters a split drops rows by, where it is under a grouped aggregate or not.
    pub fn for_split(&self, under_grouping: bool) -> &HashSet<u64> {
        match under_grouping {
            true => &self.under_grouping,
            false => &self.everywhere,
        }
    }
}
