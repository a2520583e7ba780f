//! Which per-partition fragments a worker can run one partition of, over in-memory scans of
//! that partition's blocks: decided from the fragment alone, so planning (whether a join
//! streams its probe input, `plan::cut`) and the scheduler (where a task runs,
//! `exec::remote_tasks`) agree.

use std::sync::Arc;

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode,
};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::union::{InterleaveExec, UnionExec};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::plan::concat_partitions::ConcatPartitionsExec;
use crate::plan::partitioned_outer_joins::emits_build_rows_once;
use crate::plan::random_shuffle::RandomPermuteExec;
use crate::plan::split_source::SplitSourceExec;
use crate::plan::stage_input::{InputExchange, StageInputExec};
use crate::plan::subquery_values::SubqueryValuesExec;

/// Whether `fragment` only brings its stage inputs' rows together, every row out as it came
/// in: merges of sorted partitions and coalesces of partitions, without a limit, over stage
/// inputs. Its output is all of its input, so a worker running it as a query's root would
/// fetch every input block from its peers only for the driver to fetch all of it again: the
/// reader on the driver runs such a root ([`crate::plan::graph::OperatorGraph::root_on_workers`]).
pub fn only_merges_inputs(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    let node = fragment;
    if node.downcast_ref::<StageInputExec>().is_some() {
        return true;
    }
    let merges = node
        .downcast_ref::<SortPreservingMergeExec>()
        .is_some_and(|merge| merge.fetch().is_none())
        || node
            .downcast_ref::<CoalescePartitionsExec>()
            .is_some_and(|coalesce| coalesce.fetch().is_none());
    merges && node.children().into_iter().all(only_merges_inputs)
}

/// How a node of a per-partition fragment is read by the fragment's partition `p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// Its partition `p`: it is on the fragment's line (as many partitions as the
    /// fragment); its stage inputs stand for partition `p`'s blocks, its file scans are
    /// cut to file group `p`.
    OwnPartition,
    /// All of it, by every partition (a `CollectLeft` join's build side): its scans are
    /// read whole, its stage inputs must be gathered ones, or order-preserving ones under a
    /// merge of sorted partitions (each partition becomes an in-memory scan of its own).
    Whole,
}

/// Whether one partition of `fragment` can run apart from the others on a worker: it holds
/// only nodes a worker runs over in-memory sources, and partition `p` reads partition `p`
/// of each stage input and file scan on its line (under a union: the partition of the one
/// union input it maps to, [`union_input`]), and the whole of its build sides.
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
    !foreign && reads_apart(fragment, Reads::OwnPartition, partitions)
}

/// How partition `p` reads child `i` of `node`, itself read as `reads` in a fragment of
/// `partitions` partitions; `None` when partition `p` cannot be cut out (a merge of
/// partitions on the line: partition 0 of it reads every partition of its input), or it
/// is not read alike by every partition (a union's inputs: [`union_input`]).
pub fn child_reads(
    node: &Arc<dyn ExecutionPlan>,
    i: usize,
    reads: Reads,
    partitions: usize,
) -> Option<Reads> {
    if reads == Reads::Whole {
        return Some(Reads::Whole);
    }
    let child = *node.children().get(i)?;
    let child_count = child.output_partitioning().partition_count();
    if child_count == partitions {
        Some(Reads::OwnPartition)
    } else if child_count == 1 && i == 0 && builds_whole_left(node) {
        Some(Reads::Whole)
    } else if partitions == 1 && child_count > 1 && merges_sorted_partitions(node) {
        // A merge of sorted partitions, the fragment's one partition: it reads every
        // partition of its input, each apart (a worker gets one in-memory scan per partition).
        Some(Reads::Whole)
    } else if child_count == 1 && i > 0 && node.downcast_ref::<SubqueryValuesExec>().is_some() {
        // A scalar subquery's value: every partition reads all of it.
        Some(Reads::Whole)
    } else {
        None
    }
}

/// The input of `union` that its partition `partition` reads, and that input's partition
/// it reads: a union's partitions are its inputs' partitions, input after input.
pub fn union_input(union: &UnionExec, partition: usize) -> Option<(usize, usize)> {
    let mut partition = partition;
    for (i, input) in union.inputs().iter().enumerate() {
        let count = input.output_partitioning().partition_count();
        if partition < count {
            return Some((i, partition));
        }
        partition -= count;
    }
    None
}

/// How partition `partition` of a per-partition fragment reads one of its stage inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputRead {
    /// The input's partition of this index (under a union, not the fragment's partition).
    Partition(usize),
    /// All of it (a gathered build side, or the sorted partitions a merge reads).
    Whole,
}

/// The stage inputs partition `partition` of `fragment` (one [`cuts_per_partition`] cuts)
/// reads, in the order of the leaves of the plan cut for it, each with how it is read: a
/// union's partition reads one of its inputs, so the stage inputs below the others are not
/// read at all.
pub fn inputs_read(fragment: &Arc<dyn ExecutionPlan>, partition: usize) -> Vec<(usize, InputRead)> {
    fn walk(
        node: &Arc<dyn ExecutionPlan>,
        reads: Reads,
        (partition, partitions): (usize, usize),
        out: &mut Vec<(usize, InputRead)>,
    ) {
        if let Some(stage) = node.downcast_ref::<StageInputExec>() {
            out.push(match reads {
                Reads::OwnPartition => (stage.input_index(), InputRead::Partition(partition)),
                Reads::Whole => (stage.input_index(), InputRead::Whole),
            });
            return;
        }
        if reads == Reads::OwnPartition
            && let Some(union) = node.downcast_ref::<UnionExec>()
        {
            if let Some((i, part)) = union_input(union, partition) {
                let input = &union.inputs()[i];
                let count = input.output_partitioning().partition_count();
                walk(input, Reads::OwnPartition, (part, count), out);
            }
            return;
        }
        for (i, child) in node.children().into_iter().enumerate() {
            if let Some(below) = child_reads(node, i, reads, partitions) {
                walk(child, below, (partition, partitions), out);
            }
        }
    }
    let partitions = fragment.output_partitioning().partition_count();
    let mut out = vec![];
    walk(
        fragment,
        Reads::OwnPartition,
        (partition, partitions),
        &mut out,
    );
    out
}

/// Whether `node`, read as `reads` in a fragment of `partitions` partitions, can stand
/// over in-memory sources of one partition's blocks (see [`Reads`]).
fn reads_apart(node: &Arc<dyn ExecutionPlan>, reads: Reads, partitions: usize) -> bool {
    let count = node.output_partitioning().partition_count();
    let on_line = reads == Reads::OwnPartition && count == partitions;
    if let Some(stage) = node.downcast_ref::<StageInputExec>() {
        // An in-memory scan states the input's orderings, not its constants (a column a
        // filter below fixed), which a window or sort above may rely on.
        // (A literal is constant anywhere.)
        let states_all = (stage.properties().eq_properties.constants().iter())
            .all(|constant| collect_columns(&constant.expr).is_empty());
        let read_whole = reads == Reads::Whole
            && matches!(
                stage.exchange(),
                InputExchange::Gather | InputExchange::Preserve
            );
        return states_all && (on_line || read_whole);
    }
    if let Some(source) = node.downcast_ref::<DataSourceExec>() {
        // A file scan, cut to the partition's file group or read whole (one of a format
        // workers do not read keeps its task on the driver: `exec::worker_plans`); other
        // sources stay.
        let file = (source.data_source().downcast_ref::<FileScanConfig>()).is_some();
        return file && (on_line || reads == Reads::Whole);
    }
    if node.children().is_empty() || (reads == Reads::OwnPartition && count != partitions) {
        return false;
    }
    // A union's partition is one partition of one of its inputs: each input is a line of
    // its own, of its own partitions.
    if reads == Reads::OwnPartition
        && let Some(union) = node.downcast_ref::<UnionExec>()
    {
        return (union.inputs().iter()).all(|input| {
            let count = input.output_partitioning().partition_count();
            reads_apart(input, Reads::OwnPartition, count)
        });
    }
    // A join that emits its build side's unmatched rows (left, anti, semi, full) does so
    // once over all its partitions, which share what they matched: its partitions cannot
    // run apart.
    if reads == Reads::OwnPartition && count > 1 && shares_build_matches(node) {
        return false;
    }
    (0..node.children().len()).all(|i| {
        child_reads(node, i, reads, partitions)
            .is_some_and(|below| reads_apart(node.children()[i], below, partitions))
    })
}

/// Whether `node` merges its input's sorted partitions into one.
fn merges_sorted_partitions(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<SortPreservingMergeExec>().is_some()
}

/// Whether `node` is a join whose partitions all read its whole left (build) input.
fn builds_whole_left(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<HashJoinExec>()
        .is_some_and(|j| j.partition_mode() == &PartitionMode::CollectLeft)
        || node.downcast_ref::<NestedLoopJoinExec>().is_some()
        || node.downcast_ref::<CrossJoinExec>().is_some()
}

/// Whether a node of `fragment` (not of the operators feeding it) is a join whose partitions
/// share the matches of one build side, which the last one to finish emits: running one of
/// its partitions alone again does not repeat what it made.
pub fn shares_build_matches_across_partitions(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    fragment
        .exists(|node| {
            Ok(shares_build_matches(node) && node.output_partitioning().partition_count() > 1)
        })
        .unwrap_or(false)
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
    emits_build_rows_once(join_type)
}

/// Whether `node` keeps its fragment on the driver: one of flumen's own plan nodes (workers
/// do not decode them; a `MergeRunsExec` goes as DataFusion's merge of its runs, each an
/// in-memory scan: `exec::remote_tasks`) or a node that cannot stand over in-memory
/// sources.
fn stays_on_driver(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<ConcatPartitionsExec>().is_some()
        || node.downcast_ref::<RandomPermuteExec>().is_some()
        || node.downcast_ref::<SplitSourceExec>().is_some()
        // Its children must share a hash partitioning, which in-memory sources do not state.
        || node.downcast_ref::<InterleaveExec>().is_some()
        // Its partition `p` reads every partition of its input.
        || node.downcast_ref::<RepartitionExec>().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::common::JoinType;
    use datafusion::common::NullEquality;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_plan::Partitioning;
    use datafusion::physical_plan::projection::ProjectionExec;
    use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;

    /// A stage input of `partitions` partitions over one Int64 column `x`, read as
    /// `exchange`.
    fn stage(partitions: usize, exchange: InputExchange) -> Arc<dyn ExecutionPlan> {
        stage_input(0, partitions, exchange)
    }

    /// Stage input `index`, as [`stage`].
    fn stage_input(
        index: usize,
        partitions: usize,
        exchange: InputExchange,
    ) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
        let memory =
            MemorySourceConfig::try_new_exec(&vec![vec![]; partitions], schema, None).unwrap();
        let properties = Arc::clone(memory.properties());
        Arc::new(StageInputExec::new(index, exchange, properties, None).with_input_index(index))
    }

    fn hash(partitions: usize) -> InputExchange {
        let schema = Schema::new(vec![Field::new("x", DataType::Int64, true)]);
        InputExchange::Split(Partitioning::Hash(
            vec![col("x", &schema).unwrap()],
            partitions,
        ))
    }

    fn join(
        left: Arc<dyn ExecutionPlan>,
        right: Arc<dyn ExecutionPlan>,
        kind: JoinType,
    ) -> Arc<dyn ExecutionPlan> {
        let on = vec![(
            col("x", &left.schema()).unwrap(),
            col("x", &right.schema()).unwrap(),
        )];
        let join = HashJoinExec::try_new(
            left,
            right,
            on,
            None,
            &kind,
            None,
            PartitionMode::CollectLeft,
            NullEquality::NullEqualsNothing,
            false,
        )
        .unwrap();
        Arc::new(join)
    }

    #[test]
    fn a_row_local_node_over_its_own_partition_is_cut() {
        let input = stage(2, hash(2));
        let x = col("x", &input.schema()).unwrap();
        let projection = ProjectionExec::try_new(vec![(x, "x".to_string())], input).unwrap();
        assert!(cuts_per_partition(&(Arc::new(projection) as _)));
    }

    #[test]
    fn a_merge_reads_each_sorted_partition_apart_and_nothing_else() {
        let merge = |input: Arc<dyn ExecutionPlan>| -> Arc<dyn ExecutionPlan> {
            let x = col("x", &input.schema()).unwrap();
            let ordering = [datafusion::physical_expr::PhysicalSortExpr::new_default(x)].into();
            Arc::new(SortPreservingMergeExec::new(ordering, input))
        };
        // Partition 0 of the merge reads both partitions of its input, each its own scan.
        assert!(cuts_per_partition(&merge(stage(
            2,
            InputExchange::Preserve
        ))));
        // A hash split's partitions read whole would not be the producer's sorted runs.
        assert!(!cuts_per_partition(&merge(stage(2, hash(2)))));
    }

    #[test]
    fn a_collect_left_join_is_cut_unless_it_emits_build_rows_once() {
        let build = || stage(1, InputExchange::Gather);
        let probe = || stage(2, hash(2));
        assert!(cuts_per_partition(&join(build(), probe(), JoinType::Inner)));
        assert!(cuts_per_partition(&join(
            build(),
            probe(),
            JoinType::RightSemi
        )));
        for kind in [
            JoinType::Left,
            JoinType::LeftSemi,
            JoinType::LeftAnti,
            JoinType::Full,
        ] {
            assert!(
                !cuts_per_partition(&join(build(), probe(), kind)),
                "{kind} shares its build side's matches"
            );
        }
        // A build side read by one partition of a split input is not the whole input.
        assert!(!cuts_per_partition(&join(
            stage(1, hash(1)),
            probe(),
            JoinType::Inner
        )));
    }

    #[test]
    fn a_union_partition_reads_one_partition_of_one_input() {
        let union =
            UnionExec::try_new(vec![stage_input(0, 2, hash(2)), stage_input(1, 3, hash(3))])
                .unwrap();
        assert!(cuts_per_partition(&union));
        assert_eq!(inputs_read(&union, 1), vec![(0, InputRead::Partition(1))]);
        assert_eq!(inputs_read(&union, 4), vec![(1, InputRead::Partition(2))]);
        // An input that cannot be cut keeps the whole union on the driver.
        let merged = Arc::new(SortPreservingMergeExec::new(
            [datafusion::physical_expr::PhysicalSortExpr::new_default(
                col("x", &union.schema()).unwrap(),
            )]
            .into(),
            stage_input(1, 3, hash(3)),
        ));
        let with_merge = UnionExec::try_new(vec![stage_input(0, 2, hash(2)), merged]).unwrap();
        assert!(!cuts_per_partition(&with_merge));
    }

    #[test]
    fn a_root_that_only_merges_its_inputs_is_told_apart_from_one_that_reduces_them() {
        let input = stage(2, InputExchange::Preserve);
        let x = col("x", &input.schema()).unwrap();
        let ordering: datafusion::physical_expr::LexOrdering =
            [datafusion::physical_expr::PhysicalSortExpr::new_default(
                Arc::clone(&x),
            )]
            .into();
        let merge = SortPreservingMergeExec::new(ordering.clone(), Arc::clone(&input));
        assert!(only_merges_inputs(&(Arc::new(merge.clone()) as _)));
        let coalesce = CoalescePartitionsExec::new(Arc::clone(&input));
        assert!(only_merges_inputs(&(Arc::new(coalesce.clone()) as _)));
        // A limit keeps only some rows: the driver would fetch more than the answer.
        assert!(!only_merges_inputs(
            &ExecutionPlan::with_fetch(&merge, Some(3)).unwrap()
        ));
        assert!(!only_merges_inputs(
            &ExecutionPlan::with_fetch(&coalesce, Some(3)).unwrap()
        ));
        // Anything computed above the merge (here a projection) is work, not a merge.
        let projection = ProjectionExec::try_new(
            vec![(x, "x".to_string())],
            Arc::new(SortPreservingMergeExec::new(ordering, input)) as _,
        )
        .unwrap();
        assert!(!only_merges_inputs(&(Arc::new(projection) as _)));
    }
}
