//! Dynamic filters in plans flumen copies: a copy that runs beside the original gets filters
//! of its own, and one place rewrites the predicates that read them.
//!
//! DataFusion's `AggregateExec` (`min`/`max` without groups), TopK `SortExec` and
//! `HashJoinExec` produce dynamic filters that the scans below them read. A filter is shared
//! state: every node holding it sees every update. DataFusion runs a plan once, so that is
//! the point. flumen's cut runs an uncorrelated scalar subquery once per operator that reads
//! its value (TPC-H q22's, or `x > (SELECT max(w) FROM b)` read both by the scan's pruning
//! predicate and by the filter above it): with the copies sharing their filters, the first
//! copy's `max(w)` (98) made the second copy's scan skip every row with `w <= 98`, its
//! `max(w)` came out NULL, and the query failed for two different values.
//!
//! The same holds for the tasks of one operator, which all run partitions of one plan:
//! [`for_one_task`] gives each task's run its own bounds, so a run again repeats it.
//!
//! [`with_own_dynamic_filters`] gives a copy fresh filters where sharing changes an answer:
//! an aggregate's and a TopK's filter is a bound from the rows seen so far, so another copy's
//! bound drops rows equal to it that this copy still needs. A hash join's filter is
//! filled once from its whole build side, the same in every copy, so it is shared as it is.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::physical_plan::{
    FileScanConfig, FileScanConfigBuilder, FileSource, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, DynamicFilterPhysicalExpr, lit};
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::filter::{FilterExec, FilterExecBuilder};
use datafusion::physical_plan::joins::{CrossJoinExec, HashJoinExec, NestedLoopJoinExec};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties, PhysicalExpr};

use crate::plan::key_membership::KeysInSet;
use crate::plan::split_source::SplitSourceExec;

/// `plan` with the dynamic filters of its aggregates and TopK sorts replaced by fresh ones,
/// in those nodes and in every predicate below them that reads them: a copy of a plan that
/// can run beside the original (or another copy) without either pruning by the other's
/// bound.
pub fn with_own_dynamic_filters(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    renew_bounds(plan, false, &HashMap::new()).map(|renewed| renewed.plan)
}

/// The plan one task runs, and the bounds it makes.
#[derive(Debug)]
pub struct OneTask {
    /// The fragment with bounds of the task's own.
    pub plan: Arc<dyn ExecutionPlan>,
    /// The task's own filters: what the task's bounds are
    /// ([`crate::plan::task_bounds::BoundsMade::running`]).
    pub made: Vec<OwnFilter>,
}

/// A filter of a task's own, which its aggregate or TopK fills.
#[derive(Debug, Clone)]
pub struct OwnFilter {
    /// The expression id of the operator's filter it replaces.
    pub replaces: u64,
    /// The filter, on its producer's columns.
    pub filter: Arc<dyn PhysicalExpr>,
    /// Its producer's input schema, whose columns the filter reads.
    pub input: SchemaRef,
    /// Its producer's number in a walk of the task's plan from the root, parents first.
    pub node: Option<usize>,
}

impl OneTask {
    /// `(id of the filter replaced, the task's own filter)` of each of its own filters.
    pub fn filters(&self) -> Vec<crate::plan::task_bounds::TaskFilter> {
        (self.made.iter())
            .map(|own| (own.replaces, Arc::clone(&own.filter)))
            .collect()
    }
}

/// The plan one task of an operator runs: `fragment` with dynamic filters of its own for
/// its aggregates and TopK sorts, so that what the task makes depends on its input and on
/// `at_launch` alone, and its scans pruning by `at_launch` (the bounds the run's tasks had
/// made when this task's first run started, [`crate::plan::task_bounds`]) and by its own
/// bound. Shared by the operator's tasks, such a filter is a bound from whichever rows
/// any task has seen so far: a task's `TopK` kept fewer rows once another's bound was
/// tighter, and a task run again (for a lost block, or after refused memory) met its own
/// first run's bound, cut other blocks than the first time, or panicked (DataFusion's TopK
/// counts the partitions that finish).
///
/// Joins and repartitions are kept as they are, with what is below them: their partitions
/// share one build side or one input, so they must stay one node. A scan below a join that
/// read a bound renewed above it reads the old one, which no task fills any more; a bound
/// made below a join stays shared.
pub fn for_one_task(
    fragment: &Arc<dyn ExecutionPlan>,
    at_launch: &HashMap<u64, Arc<dyn PhysicalExpr>>,
) -> Result<OneTask> {
    let produces_bounds = fragment
        .exists(|node| Ok(renewable(node) && !node.dynamic_expressions_produced().is_empty()))
        .unwrap_or(false);
    if !produces_bounds && at_launch.is_empty() {
        return Ok(OneTask {
            plan: Arc::clone(fragment),
            made: vec![],
        });
    }
    renew_bounds(Arc::clone(fragment), true, at_launch)
}

/// The plan a worker runs for one task, as [`for_one_task`] does its fragment: a worker
/// runs a plan built and decoded for that task alone, so the nodes below its joins and
/// exchanges (its output split) are its own too, and get their own bounds.
pub fn for_worker_task(
    plan: &Arc<dyn ExecutionPlan>,
    at_launch: &HashMap<u64, Arc<dyn PhysicalExpr>>,
) -> Result<OneTask> {
    renew_bounds(Arc::clone(plan), false, at_launch)
}

/// Whether a hash join of `fragment` makes each of its partitions wait, once its build side
/// is in, until every partition of the node has reported its build side: a join of more
/// than one partition whose dynamic filter a node of its probe side reads (DataFusion's own
/// test, at `execute`). DataFusion makes the filter from all the build sides together
/// before any partition probes. A partition run where the others do not run (a worker-mode
/// task on the driver, the others on workers) waits for ever there.
pub fn joins_wait_for_every_partition(fragment: &Arc<dyn ExecutionPlan>) -> bool {
    fragment
        .exists(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                return Ok(false);
            };
            if node.output_partitioning().partition_count() < 2 {
                return Ok(false);
            }
            Ok((node.dynamic_expressions_produced().iter())
                .filter_map(|filter| filter.expression_id())
                .any(|id| reads_expression(join.right(), id)))
        })
        .unwrap_or(false)
}

/// Whether an expression of a node of `plan` is or holds the expression `id`.
fn reads_expression(plan: &Arc<dyn ExecutionPlan>, id: u64) -> bool {
    plan.exists(|node| {
        let mut found = false;
        node.apply_expressions(&mut |root| {
            root.apply(|expr| {
                found |= expr.expression_id() == Some(id);
                Ok(match found {
                    true => TreeNodeRecursion::Stop,
                    false => TreeNodeRecursion::Continue,
                })
            })
        })?;
        Ok(found)
    })
    .unwrap_or(false)
}

/// Whether `node` makes a bound [`renew_bounds`] renews: an aggregate's or a TopK's.
fn renewable(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<AggregateExec>().is_some() || node.downcast_ref::<SortExec>().is_some()
}

/// Whether `node`'s partitions share state, so that it must not be rebuilt for a task.
fn shared_by_partitions(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.downcast_ref::<HashJoinExec>().is_some()
        || node.downcast_ref::<NestedLoopJoinExec>().is_some()
        || node.downcast_ref::<CrossJoinExec>().is_some()
        || node.downcast_ref::<RepartitionExec>().is_some()
}

/// What a task's readers of dynamic filters read instead, by the expression id of the
/// filter: the task's own fresh filter where the task renews it, and the bound the task
/// starts from. A [`SplitSourceExec`] keeps them to apply to the one split a task reads.
#[derive(Debug, Clone, Default)]
pub struct BoundSwaps(HashMap<u64, Swap>);

#[derive(Debug, Clone)]
struct Swap {
    /// The fresh filter the task's producer fills.
    own: Option<Arc<dyn PhysicalExpr>>,
    /// A filter fixed at the bound the task starts from, on the producer's columns.
    from_start: Option<Arc<dyn PhysicalExpr>>,
}

impl BoundSwaps {
    /// `predicate` reading what the task reads in place of each filter: its own filter
    /// where it renews it (the old one where another operator's tasks fill it), and the
    /// bound it starts from, on `predicate`'s own columns.
    pub fn apply(
        &self,
        predicate: &Arc<dyn PhysicalExpr>,
    ) -> Result<Transformed<Arc<dyn PhysicalExpr>>> {
        Arc::clone(predicate).transform_down(|e| {
            let swap = (e.downcast_ref::<DynamicFilterPhysicalExpr>().is_some())
                .then(|| e.expression_id().and_then(|id| self.0.get(&id)))
                .flatten();
            let Some(swap) = swap else {
                return Ok(Transformed::no(e));
            };
            let children: Vec<_> = e.children().into_iter().cloned().collect();
            let own = match &swap.own {
                Some(fresh) => Arc::clone(fresh).with_new_children(children.clone())?,
                None => Arc::clone(&e),
            };
            let read = match &swap.from_start {
                Some(bound) => Arc::new(BinaryExpr::new(
                    Arc::clone(bound).with_new_children(children)?,
                    Operator::And,
                    own,
                )),
                None => own,
            };
            Ok(Transformed::new(read, true, TreeNodeRecursion::Jump))
        })
    }

    /// The bounds the task starts from of the filters among `ids` that `predicate` reads,
    /// each on the columns `predicate` reads it by, as their conjunction (plain
    /// expressions, no filter around them); `None` where it starts from none of them.
    pub fn starting_bounds(
        &self,
        predicate: &Arc<dyn PhysicalExpr>,
        ids: &HashSet<u64>,
    ) -> Result<Option<Arc<dyn PhysicalExpr>>> {
        let mut bounds = vec![];
        predicate.apply(|e| {
            if e.downcast_ref::<DynamicFilterPhysicalExpr>().is_none() {
                return Ok(TreeNodeRecursion::Continue);
            }
            let from_start = (e.expression_id())
                .filter(|id| ids.contains(id))
                .and_then(|id| self.0.get(&id))
                .and_then(|swap| swap.from_start.as_ref());
            if let Some(bound) = from_start {
                let children = e.children().into_iter().cloned().collect();
                let read = Arc::clone(bound).with_new_children(children)?;
                if let Some(fixed) = read.downcast_ref::<DynamicFilterPhysicalExpr>() {
                    bounds.push(fixed.current()?);
                }
            }
            // Its children are the columns it reads, not further filters.
            Ok(TreeNodeRecursion::Jump)
        })?;
        Ok(bounds
            .into_iter()
            .reduce(|a, b| Arc::new(BinaryExpr::new(a, Operator::And, b)) as Arc<dyn PhysicalExpr>))
    }

    /// `node` reading what the task reads (see [`BoundSwaps::apply`]).
    pub fn apply_to(&self, node: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
        map_predicates(node, &mut |predicate| self.apply(predicate)).map(|t| t.data)
    }
}

/// `bound` (a filter fixed at a bound a task starts from) with each test of a key set in it
/// a copy of the task's own (`KeysInSet::each_its_own`), so that what its sample chooses
/// depends on the task's rows alone, in a scan that filters rows by its predicate
/// (`pushdown_filters`) too; `bound` itself where it holds none.
fn with_own_key_tests(bound: &Arc<dyn PhysicalExpr>) -> Result<Arc<dyn PhysicalExpr>> {
    let Some(fixed) = bound.downcast_ref::<DynamicFilterPhysicalExpr>() else {
        return Ok(Arc::clone(bound));
    };
    let value = fixed.current()?;
    if !value.exists(|e| Ok(e.downcast_ref::<KeysInSet>().is_some()))? {
        return Ok(Arc::clone(bound));
    }
    let columns = fixed.children().into_iter().cloned().collect();
    let own = DynamicFilterPhysicalExpr::new(columns, lit(true));
    own.update(KeysInSet::each_its_own(value)?)?;
    Ok(Arc::new(own))
}

/// `plan` with fresh bounds for its aggregates and TopK sorts, and the predicates below
/// them rewired to read them and `at_launch`'s bound of the filter they replace (and of
/// filters other operators fill); with `keep_shared`, nodes whose partitions share state
/// (and all below them) are left as they are.
fn renew_bounds(
    plan: Arc<dyn ExecutionPlan>,
    keep_shared: bool,
    at_launch: &HashMap<u64, Arc<dyn PhysicalExpr>>,
) -> Result<OneTask> {
    // A producer sits above the scans that read its filter, so a walk from the top renews
    // it before meeting them.
    let mut swaps = BoundSwaps(
        (at_launch.iter())
            .map(|(id, bound)| {
                let swap = Swap {
                    own: None,
                    from_start: Some(with_own_key_tests(bound)?),
                };
                Ok((*id, swap))
            })
            .collect::<Result<_>>()?,
    );
    let mut made = vec![];
    let plan = plan
        .transform_down(|node| {
            if keep_shared && shared_by_partitions(&node) {
                return Ok(Transformed::new(node, false, TreeNodeRecursion::Jump));
            }
            if let Some(source) = node.downcast_ref::<SplitSourceExec>() {
                let source = source.with_bound_swaps(Arc::new(swaps.clone()));
                return Ok(Transformed::yes(Arc::new(source)));
            }
            let read = map_predicates(node, &mut |predicate| swaps.apply(predicate))?;
            let produced = read.data.dynamic_expressions_produced();
            if produced.is_empty() || !renewable(&read.data) {
                return Ok(read);
            }
            let [old] = produced.as_slice() else {
                return Ok(read);
            };
            // A fresh filter on the columns the old one reads (the node's own metrics stay
            // shared, so `EXPLAIN ANALYZE` still shows what every copy did).
            let children = old.children().into_iter().cloned().collect();
            let fresh = Arc::new(DynamicFilterPhysicalExpr::new(children, lit(true)));
            let renewed: Arc<dyn ExecutionPlan> = match (
                read.data.downcast_ref::<AggregateExec>(),
                read.data.downcast_ref::<SortExec>(),
            ) {
                (Some(aggregate), _) => Arc::new(
                    aggregate
                        .clone()
                        .with_dynamic_filter_expr(Arc::clone(&fresh))?,
                ),
                (_, Some(sort)) => {
                    Arc::new(sort.clone().with_dynamic_filter_expr(Arc::clone(&fresh))?)
                }
                _ => return Ok(read),
            };
            // The filter the node now produces (the one it was given).
            let fresh: Arc<dyn PhysicalExpr> =
                match renewed.dynamic_expressions_produced().as_slice() {
                    [produced] => Arc::clone(produced),
                    _ => fresh,
                };
            if let Some(id) = old.expression_id() {
                made.push(OwnFilter {
                    replaces: id,
                    filter: Arc::clone(&fresh),
                    input: renewed.children()[0].schema(),
                    node: None,
                });
                let swap = Swap {
                    own: Some(fresh),
                    from_start: at_launch.get(&id).cloned(),
                };
                swaps.0.insert(id, swap);
            }
            Ok(Transformed::yes(renewed))
        })?
        .data;
    // Number the producers as a worker walks the plan it decodes.
    let mut node_number = 0;
    plan.apply(|node| {
        for filter in node.dynamic_expressions_produced() {
            for own in made.iter_mut() {
                if own.filter.expression_id() == filter.expression_id() {
                    own.node = Some(node_number);
                }
            }
        }
        node_number += 1;
        Ok(TreeNodeRecursion::Continue)
    })?;
    Ok(OneTask { plan, made })
}

/// What [`map_predicates`] applies to a predicate.
pub(crate) type PredicateMap<'a> =
    dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<Transformed<Arc<dyn PhysicalExpr>>> + 'a;

/// `node` with `map` applied to its own predicates that can read a dynamic filter: a
/// `FilterExec`'s and a Parquet scan's. Other nodes come back as they are.
pub(crate) fn map_predicates(
    node: Arc<dyn ExecutionPlan>,
    map: &mut PredicateMap<'_>,
) -> Result<Transformed<Arc<dyn ExecutionPlan>>> {
    if let Some(filter) = node.downcast_ref::<FilterExec>() {
        let predicate = map(filter.predicate())?;
        if predicate.transformed {
            let rebuilt = FilterExecBuilder::from(filter)
                .with_predicate(predicate.data)
                .build()?;
            return Ok(Transformed::yes(Arc::new(rebuilt)));
        }
    }
    if let Some(config) = node
        .downcast_ref::<DataSourceExec>()
        .and_then(|scan| scan.data_source().downcast_ref::<FileScanConfig>())
        && let Some(parquet) = config.file_source().downcast_ref::<ParquetSource>()
        && let Some(predicate) = parquet.filter()
    {
        let predicate = map(&predicate)?;
        if predicate.transformed {
            let source = Arc::new(parquet.with_predicate(predicate.data));
            let config = FileScanConfigBuilder::from(config.clone())
                .with_source(source)
                .build();
            return Ok(Transformed::yes(DataSourceExec::from_data_source(config)));
        }
    }
    Ok(Transformed::no(node))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::prelude::{ParquetReadOptions, SessionContext};

    /// The ids of the dynamic filters `plan`'s nodes produce, and of those its scans and
    /// filters read.
    fn filter_ids(plan: &Arc<dyn ExecutionPlan>) -> (Vec<u64>, Vec<u64>) {
        let (mut produced, mut read) = (vec![], vec![]);
        let _ = plan.apply(|node| {
            produced.extend(
                node.dynamic_expressions_produced()
                    .iter()
                    .filter_map(|e| e.expression_id()),
            );
            let _ = map_predicates(Arc::clone(node), &mut |predicate| {
                let _ = predicate.apply(|e| {
                    if e.downcast_ref::<DynamicFilterPhysicalExpr>().is_some() {
                        read.extend(e.expression_id());
                    }
                    Ok(TreeNodeRecursion::Continue)
                });
                Ok(Transformed::no(Arc::clone(predicate)))
            });
            Ok(TreeNodeRecursion::Continue)
        });
        (produced, read)
    }

    /// DataFusion's plan of `sql` over `t(a)`, one Parquet file of 0..100.
    async fn plan_of(sql: &str) -> (tempfile::TempDir, Arc<dyn ExecutionPlan>) {
        plan_in_partitions(sql, num_cpus()).await
    }

    fn num_cpus() -> usize {
        datafusion::prelude::SessionConfig::new().target_partitions()
    }

    /// [`plan_of`] planned for `partitions` partitions.
    pub(crate) async fn plan_in_partitions(
        sql: &str,
        partitions: usize,
    ) -> (tempfile::TempDir, Arc<dyn ExecutionPlan>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.parquet");
        let batch = RecordBatch::try_from_iter([(
            "a",
            Arc::new(Int64Array::from_iter_values(0..100)) as _,
        )])
        .unwrap();
        let mut writer = datafusion::parquet::arrow::ArrowWriter::try_new(
            std::fs::File::create(&path).unwrap(),
            batch.schema(),
            None,
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        let ctx = SessionContext::new_with_config(
            datafusion::prelude::SessionConfig::new().with_target_partitions(partitions),
        );
        ctx.register_parquet("t", path.to_str().unwrap(), ParquetReadOptions::default())
            .await
            .unwrap();
        let plan = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        (dir, plan)
    }

    #[tokio::test]
    async fn a_join_whose_probe_scan_reads_its_filter_waits_for_every_partition() {
        // The probe side a union of two scans: a join of two partitions.
        let sql = "SELECT x.a FROM t x JOIN (SELECT a FROM t UNION ALL SELECT a FROM t) y \
                   ON x.a = y.a";
        let (_dir, join) = plan_in_partitions(sql, 2).await;
        assert!(
            joins_wait_for_every_partition(&join),
            "{}",
            datafusion::physical_plan::displayable(join.as_ref()).indent(true)
        );
        // One partition reports to itself; a plan without a join has nothing to wait for.
        let sql = "SELECT x.a FROM t x JOIN t y ON x.a = y.a";
        let (_dir, alone) = plan_in_partitions(sql, 2).await;
        assert!(!joins_wait_for_every_partition(&alone));
        let (_dir, no_join) = plan_in_partitions("SELECT a FROM t WHERE a > 3", 2).await;
        assert!(!joins_wait_for_every_partition(&no_join));
        // Without join filters the probe scan reads none.
        let (_dir, plan) = plan_of("SELECT a FROM t ORDER BY a DESC LIMIT 3").await;
        assert!(!joins_wait_for_every_partition(&plan));
    }

    #[tokio::test]
    async fn a_task_gets_its_own_topk_bound_in_its_sort_and_its_scan() {
        let (_dir, plan) = plan_of("SELECT a FROM t ORDER BY a DESC LIMIT 3").await;
        let (produced, read) = filter_ids(&plan);
        assert_eq!(produced.len(), 1, "the TopK makes a bound");
        assert_eq!(read, produced, "the scan prunes with it");
        let none = HashMap::new();
        let (first, second) = (
            for_one_task(&plan, &none).unwrap().plan,
            for_one_task(&plan, &none).unwrap().plan,
        );
        let ((first_made, first_read), (second_made, _)) =
            (filter_ids(&first), filter_ids(&second));
        assert_eq!(
            first_made, first_read,
            "the task's scan reads the task's own bound"
        );
        assert_ne!(first_made, produced);
        assert_ne!(first_made, second_made, "each task has its own");
        // The original plan is left as it was.
        assert_eq!(filter_ids(&plan), (produced.clone(), produced));
    }

    #[tokio::test]
    async fn a_plan_without_bounds_is_run_as_it_is() {
        let (_dir, plan) = plan_of("SELECT a, count(*) FROM t GROUP BY a").await;
        let one = for_one_task(&plan, &HashMap::new()).unwrap();
        assert!(Arc::ptr_eq(&one.plan, &plan));
        assert!(one.made.is_empty());
    }

    #[tokio::test]
    async fn a_task_prunes_by_the_bounds_at_its_launch_and_makes_its_own() {
        // A partial aggregate over its scan as flumen's cut leaves it (the scan's splits
        // are its partitions: no repartition between them).
        let (_dir, plan) = plan_in_partitions("SELECT min(a) FROM t WHERE a % 2 = 0", 2).await;
        let plan = plan
            .transform_up(|node| {
                Ok(match node.downcast_ref::<RepartitionExec>() {
                    Some(repartition) => Transformed::yes(Arc::clone(repartition.input())),
                    None => Transformed::no(node),
                })
            })
            .unwrap()
            .data;
        let (produced, _) = filter_ids(&plan);
        assert_eq!(
            produced.len(),
            1,
            "{}",
            datafusion::physical_plan::displayable(plan.as_ref()).indent(true)
        );
        // An earlier task ended with `a < 40`.
        let bounds = crate::plan::task_bounds::BoundsMade::default();
        let a = Arc::new(datafusion::physical_expr::expressions::Column::new("a", 0));
        let lt = |v: i64| -> Arc<dyn PhysicalExpr> {
            Arc::new(BinaryExpr::new(a.clone(), Operator::Lt, lit(v)))
        };
        bounds.add([crate::plan::task_bounds::MadeBound {
            filter: produced[0],
            columns: vec![a.clone()],
            value: lt(40),
        }]);
        let one = for_one_task(&plan, &bounds.at_launch()).unwrap();
        let scan = datafusion::physical_plan::displayable(one.plan.as_ref())
            .indent(true)
            .to_string();
        assert!(
            scan.contains("DynamicFilter [ a@0 < 40 ] AND DynamicFilter [ empty ]"),
            "{scan}"
        );
        // It runs: its own bound is the minimum of its rows, 0.
        let ctx = datafusion::prelude::SessionContext::new();
        let out = datafusion::physical_plan::collect(Arc::clone(&one.plan), ctx.task_ctx())
            .await
            .unwrap();
        assert_eq!(
            datafusion::arrow::util::pretty::pretty_format_batches(&out)
                .unwrap()
                .to_string()
                .lines()
                .nth(3),
            Some("| 0        |")
        );
        // While it runs, a task launched now starts from it; once it ends, from what it
        // ended with.
        let running = bounds.running(one.filters());
        assert_eq!(
            bounds.at_launch()[&produced[0]].to_string(),
            "DynamicFilter [ a@0 < 0 ]"
        );
        drop(running);
        assert_eq!(
            bounds.at_launch()[&produced[0]].to_string(),
            "DynamicFilter [ a@0 < 0 ]"
        );
    }

    #[tokio::test]
    async fn a_copied_max_gets_its_own_bound() {
        let (_dir, plan) = plan_of("SELECT max(a) FROM t WHERE a % 2 = 0").await;
        let (produced, read) = filter_ids(&plan);
        assert_eq!(
            (produced.len(), read.len()),
            (1, 1),
            "the aggregate's bound reaches the scan"
        );
        let copy = with_own_dynamic_filters(Arc::clone(&plan)).unwrap();
        let (made, read_in_copy) = filter_ids(&copy);
        assert_eq!(made, read_in_copy);
        assert_ne!(made, produced);
    }

    #[test]
    fn each_task_starts_from_a_bound_whose_key_set_tests_are_its_own() {
        use crate::plan::key_membership::KeyMembership;
        use datafusion::arrow::datatypes::{DataType, Field, Schema};
        use datafusion::physical_expr::expressions::col;
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        let key = col("k", &schema).unwrap();
        let test = KeysInSet::new(
            vec![Arc::clone(&key)],
            Arc::new(KeyMembership::new(1 << 16)),
        );
        let fixed = DynamicFilterPhysicalExpr::new(vec![Arc::clone(&key)], lit(true));
        fixed.update(Arc::new(test)).unwrap();
        let bound: Arc<dyn PhysicalExpr> = Arc::new(fixed);
        // The test inside a task's copy of the bound.
        let test_of = |copy: &Arc<dyn PhysicalExpr>| {
            let fixed = copy.downcast_ref::<DynamicFilterPhysicalExpr>().unwrap();
            fixed.current().unwrap()
        };
        let (first, second) = (
            with_own_key_tests(&bound).unwrap(),
            with_own_key_tests(&bound).unwrap(),
        );
        let tests = [test_of(&bound), test_of(&first), test_of(&second)];
        assert!(
            tests
                .iter()
                .all(|t| t.downcast_ref::<KeysInSet>().is_some())
        );
        assert_eq!(
            tests[1].as_ref(),
            tests[0].as_ref(),
            "the same set and keys"
        );
        assert!(!Arc::ptr_eq(&tests[1], &tests[0]) && !Arc::ptr_eq(&tests[1], &tests[2]));
        // A bound without a test is left as it is.
        let plain: Arc<dyn PhysicalExpr> =
            Arc::new(DynamicFilterPhysicalExpr::new(vec![key], lit(true)));
        assert!(Arc::ptr_eq(&with_own_key_tests(&plain).unwrap(), &plain));
    }
}
