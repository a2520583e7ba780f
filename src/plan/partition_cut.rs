//! Which per-partition fragments a worker can run one partition of, over in-memory scans of
//! that partition's blocks: decided from the fragment alone, so planning (whether a join
//! streams its probe input, `plan::cut`) and the scheduler (where a task runs,
//! `exec::remote_tasks`) agree.

use std::sync::Arc;

use datafusion::common::JoinType;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode,
};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::union::InterleaveExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::plan::concat_partitions::ConcatPartitionsExec;
use crate::plan::merge_runs::MergeRunsExec;
use crate::plan::random_shuffle::RandomPermuteExec;
use crate::plan::split_source::SplitSourceExec;
use crate::plan::stage_input::{InputExchange, StageInputExec};

/// Whether one partition of `fragment` can run apart from the others on a worker: it holds
/// only nodes a worker runs over in-memory sources, and partition `p` reads partition `p`
/// of each stage input and file scan (or all of a gathered input).
pub fn cuts_per_partition(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    let mut foreign = false;
    let _ = fragment.apply(|node| {
        if node.downcast_ref::<StageInputExec>().is_some() {
            return Ok(TreeNodeRecursion::Jump);
        }
        foreign |= stays_on_driver(node);
        Ok(TreeNodeRecursion::Continue)
    });
    let partitions = fragment.output_partitioning().partition_count();
    !foreign && reads_its_own_partition(fragment, partitions, partitions)
}

/// Whether partition `p` of a fragment of `partitions` partitions reads partition `p` of
/// each of its stage inputs and file scans, or all of a gathered input: what a task's
/// in-memory sources (the blocks of its own partition) and a scan cut to its own file group
/// can stand for. `node` has `partitions` partitions on the fragment's own line; below a
/// node of one partition (a `CollectLeft` join's build side) everything must be read
/// whole. A merge of several partitions (`SortPreservingMergeExec`, a union) is not:
/// partition 0 of it reads every partition of its input.
fn reads_its_own_partition(
    node: &Arc<dyn ExecutionPlan>,
    partitions: usize,
    fragment_partitions: usize,
) -> bool {
    let count = node.output_partitioning().partition_count();
    let on_line = partitions == fragment_partitions && count == partitions;
    if let Some(stage) = node.downcast_ref::<StageInputExec>() {
        // An in-memory scan states the input's orderings, not its constants (a column a
        // filter below fixed), which a window or sort above may rely on.
        let states_all = stage.properties().eq_properties.constants().is_empty();
        return states_all && (on_line || matches!(stage.exchange(), InputExchange::Gather));
    }
    if let Some(source) = node.downcast_ref::<DataSourceExec>() {
        // A Parquet scan is cut to the partition's file group; other sources stay.
        let parquet = (source.data_source().downcast_ref::<FileScanConfig>())
            .is_some_and(|config| config.file_source().file_type() == "parquet");
        // On the fragment's line it is cut to the partition's file group; below a node of
        // one partition it is read whole.
        return parquet && (on_line || (partitions == 1 && count == 1));
    }
    if count != partitions || node.children().is_empty() {
        return false;
    }
    // A join that emits its build side's unmatched rows (left, anti, semi, full) does so
    // once over all its partitions, which share what they matched: its partitions cannot
    // run apart.
    if count > 1 && shares_build_matches(node) {
        return false;
    }
    (node.children().into_iter().enumerate()).all(|(i, child)| {
        let child_count = child.output_partitioning().partition_count();
        let below = match child_count == partitions {
            true => partitions,
            // Read whole by every partition: a join's build side.
            false if child_count == 1 && i == 0 && builds_whole_left(node) => 1,
            false => return false,
        };
        reads_its_own_partition(child, below, fragment_partitions)
    })
}

/// Whether `node` is a join whose partitions all read its whole left (build) input.
fn builds_whole_left(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<HashJoinExec>()
        .is_some_and(|j| j.partition_mode() == &PartitionMode::CollectLeft)
        || node.downcast_ref::<NestedLoopJoinExec>().is_some()
        || node.downcast_ref::<CrossJoinExec>().is_some()
}

/// Whether `node` is a join reading its whole build side in every partition that emits the
/// build side's unmatched (or matched) rows once, after all partitions' probes.
fn shares_build_matches(node: &Arc<dyn ExecutionPlan>) -> bool {
    let join_type = match (
        node.downcast_ref::<HashJoinExec>(),
        node.downcast_ref::<NestedLoopJoinExec>(),
    ) {
        (Some(join), _) if join.partition_mode() == &PartitionMode::CollectLeft => {
            *join.join_type()
        }
        (_, Some(join)) => *join.join_type(),
        _ => return false,
    };
    matches!(
        join_type,
        JoinType::Left
            | JoinType::LeftAnti
            | JoinType::LeftSemi
            | JoinType::LeftMark
            | JoinType::Full
    )
}

/// Whether `node` keeps its fragment on the driver: one of flumen's own plan nodes (workers
/// do not decode them) or a node that cannot stand over in-memory sources.
fn stays_on_driver(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<MergeRunsExec>().is_some()
        || node.downcast_ref::<ConcatPartitionsExec>().is_some()
        || node.downcast_ref::<RandomPermuteExec>().is_some()
        || node.downcast_ref::<SplitSourceExec>().is_some()
        // Its children must share a hash partitioning, which in-memory sources do not state.
        || node.downcast_ref::<InterleaveExec>().is_some()
        // Its partition `p` reads every partition of its input.
        || node.downcast_ref::<RepartitionExec>().is_some()
}
