//! The plan a worker process runs for one task: its operator's fragment with what the task
//! reads put in place of the stage inputs, and the operator's output exchange on top.
//!
//! - a source task: the fragment over its one source split ([`source_plan`]);
//! - a block-wise task: the fragment over its input blocks, as an in-memory scan
//!   ([`blocks_plan`]);
//! - a per-partition task (a join's partition, a final aggregate, a sort, a window): the
//!   fragment with each stage input an in-memory scan of the task's blocks of it
//!   ([`partition_plan`]).
//!
//! Each returns why not ([`OnDriver`]) where the task cannot be cut out this way; the
//! plan is then encoded for the pool's workers ([`encode_for_worker`]).

use std::sync::Arc;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::physical_plan::{FileScanConfig, FileScanConfigBuilder};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort_preserving_merge::SortPreservingMergeExec;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::cluster::admission::{admit_plan, reads_format, scanned_files, scanned_stores};
use crate::cluster::on_driver::OnDriver;
use crate::cluster::task_plan::{self};
use crate::cluster::worker_pool::WorkerPool;
use crate::io::object_stores::StoreGrants;
use crate::plan::accelerator_projection::AcceleratorProjectionExec;
use crate::plan::build_bounds::DroppingBy;
use crate::plan::graph::Operator;
use crate::plan::join_filter_rows::filters_on_output;
use crate::plan::key_membership::KeysInSet;
use crate::plan::merge_runs::MergeRunsExec;
use crate::plan::partition_cut::{Reads, child_reads, cuts_per_partition, union_input};
use crate::plan::split_source::SplitSourceExec;
use crate::plan::stage_input::StageInputExec;
use crate::store::block::BlockId;

/// The plan a worker runs for source split `split` of `partition` of `op`, or why there is
/// none. A split is put under a filter of the dynamic filters among `dropping_by` that it
/// reads (those for its place: under a grouped aggregate or not): those whose bound from a
/// join's build side the run holds ([`crate::plan::build_bounds`]), which the task's bounds
/// put beside each of them.
pub(super) fn source_plan(
    op: &Operator,
    partition: usize,
    split: usize,
    stores: &StoreGrants,
    dropping_by: &DroppingBy,
) -> Result<Arc<dyn ExecutionPlan>, OnDriver> {
    let mut found = None;
    let plan = Arc::clone(&op.fragment)
        .transform_up(|node| {
            if let Some(source) = node.downcast_ref::<SplitSourceExec>()
                && let Some(scan) = source.split_plan(partition, split)
            {
                if !workers_can_read(&scan, stores) {
                    found = Some(false);
                    return Ok(Transformed::no(node));
                }
                found = Some(true);
                let dropping_by = dropping_by.for_split(source.drops_join_filtered_rows());
                let rows = (!dropping_by.is_empty())
                    .then(|| filters_on_output(&scan, dropping_by))
                    .flatten()
                    .map(KeysInSet::each_its_own)
                    .transpose()?;
                return Ok(Transformed::yes(match rows {
                    Some(filter) => Arc::new(FilterExec::try_new(filter, scan)?),
                    None => scan,
                }));
            }
            Ok(Transformed::no(node))
        })
        .map_err(|e| OnDriver::NotCut(e.to_string()))?
        .data;
    match found {
        Some(true) => with_output_split(op, plan),
        Some(false) => Err(OnDriver::StoreNotGranted),
        None => match file_scans(&op.fragment) {
            0 => Err(OnDriver::DriverData),
            1 if split == 0 => partition_scan_plan(op, partition, stores),
            // Several scans, e.g. a `CollectLeft` join's build side read whole beside the
            // probe side's file group: cut as a per-partition fragment is.
            _ if split == 0 && cuts_per_partition(&op.fragment) => {
                partition_plan(op, partition, &[], stores).map_err(|why| match why {
                    OnDriver::PerPartition => OnDriver::ScanNotSplit,
                    other => other,
                })
            }
            _ => Err(OnDriver::ScanNotSplit),
        },
    }
}

/// The plan a worker runs for source task `partition` of `op` whose one file scan (of any
/// format) was not cut into splits: the fragment over that partition's file group alone,
/// as [`SplitSourceExec`] cuts a split.
fn partition_scan_plan(
    op: &Operator,
    partition: usize,
    stores: &StoreGrants,
) -> Result<Arc<dyn ExecutionPlan>, OnDriver> {
    let mut readable = true;
    let plan = Arc::clone(&op.fragment)
        .transform_up(|node| {
            let Some(config) = node
                .downcast_ref::<DataSourceExec>()
                .and_then(|s| s.data_source().downcast_ref::<FileScanConfig>())
            else {
                return Ok(Transformed::no(node));
            };
            let Some(group) = config.file_groups.get(partition) else {
                return Err(DataFusionError::Plan(format!(
                    "the scan has no file group {partition}"
                )));
            };
            // Parquet, CSV, JSON, Avro and Arrow files and streams go (what
            // datafusion-proto drops of CSV, JSON and Arrow-stream scans travels beside
            // them: `cluster::scan_formats`).
            let format = config.file_source().file_type();
            if !reads_format(format) {
                return Err(DataFusionError::NotImplemented(format!(
                    "{format} scans are not sent to workers"
                )));
            }
            let scan = DataSourceExec::from_data_source(
                FileScanConfigBuilder::from(config.clone())
                    .with_file_groups(vec![group.clone()])
                    .build(),
            );
            readable = workers_can_read(&(Arc::clone(&scan) as _), stores);
            Ok(Transformed::yes(scan as Arc<dyn ExecutionPlan>))
        })
        .map_err(|_| OnDriver::ScanNotSplit)?
        .data;
    if !readable {
        return Err(OnDriver::StoreNotGranted);
    }
    with_output_split(op, plan)
}

/// File scans (of any format) in `plan` above its stage inputs.
fn file_scans(plan: &Arc<dyn ExecutionPlan>) -> usize {
    if plan.downcast_ref::<StageInputExec>().is_some() {
        return 0;
    }
    let own = plan
        .downcast_ref::<DataSourceExec>()
        .is_some_and(|s| s.data_source().downcast_ref::<FileScanConfig>().is_some());
    usize::from(own) + plan.children().into_iter().map(file_scans).sum::<usize>()
}

/// The plan a worker runs for a block-wise task of `op` whose input blocks are `input` (an
/// in-memory scan), or why there is none (the fragment does not read exactly one stage
/// input, or reads it with a limit).
pub(super) fn blocks_plan(
    op: &Operator,
    input: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>, OnDriver> {
    let mut inputs = 0;
    // Top down: a stage input is replaced before the walk could reach the producer's
    // fragment below it (which is not this task's).
    let plan = Arc::clone(&op.fragment)
        .transform_down(|node| {
            if let Some(stage) = node.downcast_ref::<StageInputExec>() {
                if stage.fetch().is_some() {
                    return Err(DataFusionError::NotImplemented(
                        "a stage input with a limit".into(),
                    ));
                }
                inputs += 1;
                return Ok(Transformed::yes(Arc::clone(&input)));
            }
            // Workers run the model projection itself (the wrapper only guides planning).
            if let Some(accelerator) = node.downcast_ref::<AcceleratorProjectionExec>() {
                let projection = ProjectionExec::try_new(
                    accelerator.projection().expr().iter().cloned(),
                    Arc::clone(node.children()[0]),
                )?;
                return Ok(Transformed::yes(
                    Arc::new(projection) as Arc<dyn ExecutionPlan>
                ));
            }
            Ok(Transformed::no(node))
        })
        .map_err(|e| OnDriver::NotCut(e.to_string()))?
        .data;
    if inputs != 1 {
        return Err(OnDriver::NotCut(format!("{inputs} stage inputs")));
    }
    with_output_split(op, plan)
}

/// The plan a worker runs for per-partition task `partition` of `op` (a join's partition,
/// a final aggregate, a sort, a window partition): its fragment with stage input `i` read
/// from `sources[i]` (an in-memory scan of the task's blocks of that input) and a file
/// scan in it (a `CollectLeft` join's probe side) over the partition's own file group, or
/// why there is none. Also a source task whose fragment holds several scans (no stage
/// input: `sources` is empty). Only plain DataFusion fragments are cut: flumen's own merge
/// of sorted runs, a stage input with a limit (which streams), a scan of a format or store
/// workers do not read, and any other leaf stay on the driver.
pub(super) fn partition_plan(
    op: &Operator,
    partition: usize,
    sources: &[Arc<dyn ExecutionPlan>],
    stores: &StoreGrants,
) -> Result<Arc<dyn ExecutionPlan>, OnDriver> {
    if !cuts_per_partition(&op.fragment) {
        return Err(OnDriver::PerPartition);
    }
    let partitions = op.fragment.output_partitioning().partition_count();
    let cut = PartitionCut {
        partition,
        partitions,
        sources,
        stores,
    };
    let mut why = None;
    let plan = cut
        .rebuild(&op.fragment, Reads::OwnPartition, &mut why)
        .map_err(|e| OnDriver::NotCut(e.to_string()))?;
    match why {
        Some(why) => Err(why),
        None => with_output_split(op, plan),
    }
}

/// One partition of a per-partition fragment being cut out for a worker.
#[derive(Clone, Copy)]
struct PartitionCut<'a> {
    /// The partition cut out of the nodes on the line being rebuilt: the fragment's, or
    /// below a union, the partition of the union's input it reads.
    partition: usize,
    /// How many partitions the nodes on that line have.
    partitions: usize,
    /// The in-memory scan standing for each stage input.
    sources: &'a [Arc<dyn ExecutionPlan>],
    stores: &'a StoreGrants,
}

impl PartitionCut<'_> {
    /// `node`, read as `reads`, with its stage inputs replaced by their sources and its
    /// file scans on the fragment's line cut to the partition's file group (those read
    /// whole are kept); `why` says why a worker cannot run it (a scan of a format workers
    /// do not read, among others).
    fn rebuild(
        &self,
        node: &Arc<dyn ExecutionPlan>,
        reads: Reads,
        why: &mut Option<OnDriver>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if let Some(merge) = node.downcast_ref::<MergeRunsExec>() {
            // The runs of one range: each an in-memory scan in its order, merged.
            let source = (merge.input().downcast_ref::<StageInputExec>())
                .filter(|stage| stage.fetch().is_none() && reads == Reads::OwnPartition)
                .and_then(|stage| self.sources.get(stage.input_index()));
            let Some(source) = source else {
                why.get_or_insert(OnDriver::PerPartition);
                return Ok(Arc::clone(node));
            };
            let runs = declaring(source, vec![merge.ordering().clone()])?;
            return Ok(Arc::new(SortPreservingMergeExec::new(
                merge.ordering().clone(),
                runs,
            )));
        }
        if let Some(stage) = node.downcast_ref::<StageInputExec>() {
            return match (stage.fetch(), self.sources.get(stage.input_index())) {
                (None, Some(source)) => ordered_as(stage, source),
                _ => {
                    why.get_or_insert(OnDriver::PerPartition);
                    Ok(Arc::clone(node))
                }
            };
        }
        if let Some(config) = node
            .downcast_ref::<DataSourceExec>()
            .and_then(|s| s.data_source().downcast_ref::<FileScanConfig>())
        {
            if !reads_format(config.file_source().file_type()) {
                why.get_or_insert(OnDriver::PerPartition);
                return Ok(Arc::clone(node));
            }
            let scan = match reads {
                Reads::Whole => Arc::clone(node),
                Reads::OwnPartition => {
                    let Some(group) = config.file_groups.get(self.partition) else {
                        why.get_or_insert(OnDriver::PerPartition);
                        return Ok(Arc::clone(node));
                    };
                    DataSourceExec::from_data_source(
                        FileScanConfigBuilder::from(config.clone())
                            .with_file_groups(vec![group.clone()])
                            .build(),
                    ) as Arc<dyn ExecutionPlan>
                }
            };
            if !workers_can_read(&scan, self.stores) {
                why.get_or_insert(OnDriver::StoreNotGranted);
            }
            return Ok(scan);
        }
        if reads == Reads::OwnPartition
            && let Some(union) = node.downcast_ref::<UnionExec>()
        {
            // The one input the partition reads, at its own partition (DataFusion's union
            // coerces each input to its schema, so that input stands in for it).
            let Some((i, partition)) = union_input(union, self.partition) else {
                why.get_or_insert(OnDriver::PerPartition);
                return Ok(Arc::clone(node));
            };
            let input = &union.inputs()[i];
            let within = PartitionCut {
                partition,
                partitions: input.output_partitioning().partition_count(),
                ..*self
            };
            return within.rebuild(input, Reads::OwnPartition, why);
        }
        let children = node.children();
        if children.is_empty() {
            why.get_or_insert(OnDriver::PerPartition);
            return Ok(Arc::clone(node));
        }
        let mut rebuilt = Vec::with_capacity(children.len());
        for (i, child) in children.into_iter().enumerate() {
            let Some(below) = child_reads(node, i, reads, self.partitions) else {
                why.get_or_insert(OnDriver::PerPartition);
                return Ok(Arc::clone(node));
            };
            rebuilt.push(self.rebuild(child, below, why)?);
        }
        datafusion::physical_plan::execution_plan::replace_children_if_necessary(
            Arc::clone(node),
            rebuilt,
        )
    }
}

/// `source` (an in-memory scan of a stage input's blocks) declaring the order the stage
/// input declares: a partition's blocks come in the order a local task reads them, and a
/// window or merge above relies on it.
fn ordered_as(
    stage: &StageInputExec,
    source: &Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let orderings: Vec<_> = (stage.properties().eq_properties.oeq_class().iter())
        .cloned()
        .collect();
    declaring(source, orderings)
}

/// Whether `fragment` merges the sorted runs of stage input `input` (a `MergeRunsExec`
/// right over it).
pub(super) fn merges_runs_of(fragment: &Arc<dyn ExecutionPlan>, input: usize) -> bool {
    let mut merges = false;
    let _ = fragment.apply(|node| {
        if let Some(merge) = node.downcast_ref::<MergeRunsExec>()
            && let Some(stage) = merge.input().downcast_ref::<StageInputExec>()
        {
            merges |= stage.input_index() == input;
        }
        Ok(TreeNodeRecursion::Continue)
    });
    merges
}

/// `source` (an in-memory scan, or a union of them: one per partition of a merged input,
/// or per sorted run) with each scan declaring `orderings` (none: as it is).
fn declaring(
    source: &Arc<dyn ExecutionPlan>,
    orderings: Vec<datafusion::physical_expr::LexOrdering>,
) -> Result<Arc<dyn ExecutionPlan>> {
    if let Some(union) = source.downcast_ref::<UnionExec>() {
        let parts = (union.children().into_iter())
            .map(|part| declaring(part, orderings.clone()))
            .collect::<Result<Vec<_>>>()?;
        return UnionExec::try_new(parts);
    }
    let memory = source
        .downcast_ref::<DataSourceExec>()
        .and_then(|s| s.data_source().downcast_ref::<MemorySourceConfig>());
    match memory {
        Some(memory) if !orderings.is_empty() => Ok(DataSourceExec::from_data_source(
            memory.clone().try_with_sort_information(orderings)?,
        )),
        _ => Ok(Arc::clone(source)),
    }
}

/// `plan` (one output partition) with `op`'s output exchange on top.
fn with_output_split(
    op: &Operator,
    plan: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>, OnDriver> {
    let partitions = plan.output_partitioning().partition_count();
    if partitions != 1 {
        return Err(OnDriver::NotCut(format!("{partitions} output partitions")));
    }
    match &op.output_split {
        None => Ok(plan),
        Some(split) => RepartitionExec::try_new(plan, split.clone())
            .map(|r| Arc::new(r) as Arc<dyn ExecutionPlan>)
            .map_err(|e| OnDriver::NotCut(e.to_string())),
    }
}

/// Whether a worker can read what `scan` reads: local files (a path every host shares), or
/// a store the session can grant (S3 with credentials to pass on, [`StoreGrants`]). Other
/// remote tables are read by the driver.
fn workers_can_read(scan: &Arc<dyn ExecutionPlan>, stores: &StoreGrants) -> bool {
    scan.downcast_ref::<DataSourceExec>()
        .and_then(|s| s.data_source().downcast_ref::<FileScanConfig>())
        .is_some_and(|config| {
            let url = config.object_store_url.as_str();
            url.starts_with("file://") || stores.get(url).is_some()
        })
}

/// Encode a task plan for `pool`'s workers, or say why they could not run it (a node or
/// scan a worker refuses, a function they do not know, a node proto cannot encode).
pub(super) fn encode_for_worker(
    plan: &Arc<dyn ExecutionPlan>,
    pool: &WorkerPool,
) -> Result<Vec<u8>, OnDriver> {
    admitted_on_workers(plan)?;
    task_plan::encode(plan, Arc::clone(pool.functions()))
        .map_err(|e| OnDriver::Unencodable(e.to_string()))
}

/// `Ok` when a worker runs `plan`'s nodes, over the files and stores it scans
/// ([`admit_plan`], as the worker checks), else why it runs on the driver.
pub(super) fn admitted_on_workers(plan: &Arc<dyn ExecutionPlan>) -> Result<(), OnDriver> {
    admit_plan(plan, &scanned_files(plan), &scanned_stores(plan))
        .map_err(|e| OnDriver::Refused(e.to_string()))
}

/// A per-partition task's input blocks: for each of its stage inputs, the blocks it reads of
/// each producer partition it reads apart (one group, but for a merge of sorted partitions:
/// one per partition, each its own in-memory scan).
pub(super) type PartitionInputs = Vec<Vec<Vec<BlockId>>>;
