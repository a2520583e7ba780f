//! The pruning DataFusion's Parquet scan does when it opens a file range, done while the
//! scan is cut into splits ([`StaticFilePruning`]), so no task is launched only to open a
//! range and find nothing in it; what it left out is counted as the scan would count it
//! ([`PrunedBeforeTasks`]).

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::common::ScalarValue;
use datafusion::common::pruning::PrunableStatistics;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::physical_plan::parquet::{
    ParquetAccessPlan, ParquetFileMetrics, RowGroupAccessPlanFilter,
    apply_file_schema_type_coercions,
};
use datafusion::datasource::physical_plan::{FileScanConfig, FileSource, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use datafusion::parquet::file::metadata::ParquetMetaData;
use datafusion::physical_expr::expressions::{DynamicFilterPhysicalExpr, lit};
use datafusion::physical_expr::simplifier::PhysicalExprSimplifier;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_expr_adapter::{
    DefaultPhysicalExprAdapterFactory, PhysicalExprAdapterFactory, replace_columns_with_literals,
};
use datafusion::physical_expr_common::physical_expr::snapshot_physical_expr;
use datafusion::physical_optimizer::pruning::{
    PruningPredicate, PruningPredicateBuilder, build_pruning_predicate,
};
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricType,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, PhysicalExpr};

use crate::plan::row_group_layout::{RowGroupLayout, byte_range};

/// Whether the task plan `plan` can be seen to put out nothing before it runs: it is a
/// chain of filters, projections, sorts (a TopK), repartitions and
/// grouped aggregates (none of which makes a row of no rows) over one Parquet scan, and
/// the bounds that scan starts from (its predicate's dynamic filters as they are now: a
/// task's launch bounds, fixed for every run of it), with its static predicate, rule out
/// every file of its split by the files' statistics, as the scan's opener would when it
/// opened them. Such a task need not be sent to a worker (a round trip of 1-2 ms to find
/// nothing: the splits after a TopK's first wave over sorted files).
pub(crate) fn nothing_to_read(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let mut node = plan;
    loop {
        let passes = node.downcast_ref::<FilterExec>().is_some()
            || node.downcast_ref::<ProjectionExec>().is_some()
            || node.downcast_ref::<SortExec>().is_some()
            || node.downcast_ref::<RepartitionExec>().is_some()
            || node
                .downcast_ref::<AggregateExec>()
                .is_some_and(|aggregate| {
                    let group_by = aggregate.group_expr();
                    !group_by.expr().is_empty() && !group_by.has_grouping_set()
                });
        if !passes {
            break;
        }
        let [child] = node.children()[..] else {
            return false;
        };
        node = child;
    }
    let Some(config) = (node.downcast_ref::<DataSourceExec>())
        .and_then(|scan| scan.data_source().downcast_ref::<FileScanConfig>())
    else {
        return false;
    };
    let Some(pruning) = StaticFilePruning::of_bounds_now(config) else {
        return false;
    };
    let files: Vec<&PartitionedFile> = config.file_groups.iter().flat_map(|g| g.iter()).collect();
    !files.is_empty()
        && pruning
            .files_pruned(&files)
            .into_iter()
            .all(|pruned| pruned)
}

/// The file pruning DataFusion's Parquet scan does when it opens a file range, done
/// while the scan is cut into splits: a range whose file statistics (the listing's,
/// `datafusion.execution.collect_statistics`) and partition values prove that the
/// scan's static predicate holds for none of its rows makes no split, so no task is
/// launched to open it and find it empty (a round trip each with worker processes:
/// a point lookup in 200 files sorted by its key was 200 tasks). Dynamic filters
/// count as `true` here: they are not filled in yet, and the same splits must come out
/// whenever the plan is cut.
pub(super) struct StaticFilePruning {
    /// The scan's predicate, its dynamic filters replaced by `true`.
    predicate: Arc<dyn PhysicalExpr>,
    /// The file columns the predicate reads, by their index in `file_schema`.
    predicate_columns: Vec<usize>,
    /// The schema of the files' columns, as DataFusion's file pruning reads them.
    file_schema: Arc<Schema>,
    /// The table's partition columns, whose values each file range carries.
    partition_columns: datafusion::arrow::datatypes::Fields,
    /// Where the scan prunes row groups by their statistics as DataFusion's opener does
    /// by default (`datafusion.execution.parquet.pruning`; no INT96 coercion, virtual
    /// columns or expression adapter of its own), the largest `IN` list it rewrites.
    row_groups: Option<usize>,
    /// The row groups' pruning predicates made so far.
    row_group_predicates: RowGroupPredicates,
}

impl StaticFilePruning {
    /// The pruning of a Parquet scan with a static predicate; `None` otherwise.
    pub(super) fn of(config: &FileScanConfig) -> Option<Self> {
        let source = config.file_source().downcast_ref::<ParquetSource>()?;
        let predicate = FileSource::filter(source)?
            .transform(|expr| {
                Ok(match expr.downcast_ref::<DynamicFilterPhysicalExpr>() {
                    Some(_) => Transformed::yes(lit(true)),
                    None => Transformed::no(expr),
                })
            })
            .ok()?
            .data;
        Self::with_predicate(config, source, predicate)
    }

    /// The pruning of a Parquet scan whose predicate reads dynamic filters, by the
    /// predicate as they are now; `None` for a scan without one (its static pruning was
    /// done when it was cut).
    fn of_bounds_now(config: &FileScanConfig) -> Option<Self> {
        let source = config.file_source().downcast_ref::<ParquetSource>()?;
        let predicate = FileSource::filter(source)?;
        let mut dynamic = false;
        let _ = predicate.apply(|expr| {
            dynamic |= expr.snapshot_generation() > 0;
            Ok(match dynamic {
                true => TreeNodeRecursion::Stop,
                false => TreeNodeRecursion::Continue,
            })
        });
        if !dynamic {
            return None;
        }
        let predicate = snapshot_physical_expr(predicate).ok()?;
        Self::with_predicate(config, source, predicate)
    }

    fn with_predicate(
        config: &FileScanConfig,
        source: &ParquetSource,
        predicate: Arc<dyn PhysicalExpr>,
    ) -> Option<Self> {
        let options = &source.table_parquet_options().global;
        let row_groups = (options.pruning
            && options.coerce_int96.is_none()
            && FileSource::table_schema(source)
                .virtual_columns()
                .is_empty()
            && config.expr_adapter_factory.is_none())
        .then(|| source.max_in_list_size());
        let file_schema = Arc::clone(config.file_schema());
        let mut predicate_columns: Vec<usize> = collect_columns(&predicate)
            .iter()
            .filter_map(|column| file_schema.index_of(column.name()).ok())
            .collect();
        predicate_columns.sort_unstable();
        Some(Self {
            predicate,
            predicate_columns,
            file_schema,
            partition_columns: config.table_partition_cols().clone(),
            row_groups,
            row_group_predicates: HashMap::new(),
        })
    }

    /// Whether the scan prunes row groups by their statistics (and so does its cut).
    pub(super) fn prunes_row_groups(&self) -> bool {
        self.row_groups.is_some()
    }

    /// The predicate for `range`: its partition columns replaced by the range's values,
    /// as DataFusion's scan does before it prunes (`None` where that fails).
    fn for_range(&self, range: &PartitionedFile) -> Option<Arc<dyn PhysicalExpr>> {
        let values: HashMap<String, ScalarValue> = self
            .partition_columns
            .iter()
            .zip(range.partition_values.iter())
            .map(|(field, value)| (field.name().clone(), value.clone()))
            .collect();
        match values.is_empty() {
            true => Some(Arc::clone(&self.predicate)),
            false => replace_columns_with_literals(Arc::clone(&self.predicate), &values).ok(),
        }
    }

    /// Which of `files` DataFusion's file pruning skips without reading them, as a
    /// `FilePruner` decides each alone: the predicate for their partition values checked
    /// against each file's statistics. One pruning predicate is built for each set of
    /// partition values and evaluated over the statistics of all its files at once (a
    /// `FilePruner` per file built the same predicate again for each: 20,000 times for a
    /// point lookup in 20,000 small files). Files are asked together only where their
    /// statistics of the predicate's columns are of the same types: a file written before
    /// a column's type changed, asked with the others, left them all unknown. A file
    /// without statistics is kept; where a set's evaluation fails, its files are asked one
    /// by one, and an error keeps the file.
    pub(super) fn files_pruned(&self, files: &[&PartitionedFile]) -> Vec<bool> {
        let mut pruned = vec![false; files.len()];
        let mut sets: HashMap<PruningSet<'_>, Vec<usize>> = HashMap::new();
        for (index, file) in files.iter().enumerate() {
            let Some(statistics) = file.statistics.as_ref().filter(|_| file.has_statistics())
            else {
                continue;
            };
            let types = (self.predicate_columns.iter())
                .filter_map(|&i| statistics.column_statistics.get(i))
                .flat_map(|c| [&c.min_value, &c.max_value])
                .map(|bound| bound.get_value().map(ScalarValue::data_type))
                .collect();
            let values = file.partition_values.as_slice();
            sets.entry((values, types)).or_default().push(index);
        }
        for members in sets.into_values() {
            let Some(predicate) = self.for_range(files[members[0]]) else {
                continue;
            };
            let Some(pruning) =
                build_pruning_predicate(predicate, &self.file_schema, &Count::new())
            else {
                continue;
            };
            let statistics = |of: &[usize]| {
                let each = of.iter().filter_map(|&i| files[i].statistics.clone());
                PrunableStatistics::new(each.collect(), Arc::clone(&self.file_schema))
            };
            match pruning.prune(&statistics(&members)) {
                Ok(may_match) => {
                    for (&i, may_match) in members.iter().zip(may_match) {
                        pruned[i] = !may_match;
                    }
                }
                Err(_) => {
                    for &i in &members {
                        pruned[i] = pruning.prune(&statistics(&[i])).is_ok_and(|m| m == [false]);
                    }
                }
            }
        }
        pruned
    }

    /// The ranges cut from `file` (`file_ranges`) a task must open, counting those left out
    /// in `pruned`; `file_pruned`: whether the file's statistics rule it out
    /// ([`Self::files_pruned`]). Every range of a file carries the file's statistics and
    /// partition values, so the file's verdict is each range's; inside a file they keep, a
    /// range whose every row group (by first-page offset, as DataFusion assigns them) the
    /// row groups' statistics rule out is left out too, asked once per file, where the
    /// footer was read.
    pub(super) fn keep(
        &mut self,
        file: &PartitionedFile,
        file_pruned: bool,
        file_ranges: Vec<PartitionedFile>,
        layout: &RowGroupLayout,
        pruned: &mut PrunedBeforeTasks,
    ) -> Vec<PartitionedFile> {
        if file_pruned {
            pruned.ranges += file_ranges.len();
            return vec![];
        }
        let ruled_out = (layout.footer(file).zip(layout.row_groups(file)))
            .and_then(|(footer, groups)| Some((self.row_groups_ruled_out(file, footer)?, groups)))
            .filter(|(out, _)| out.iter().any(|&o| o))
            .map(|(out, groups)| {
                let mut by_offset: Vec<(u64, bool)> =
                    groups.iter().map(|g| g.offset).zip(out).collect();
                by_offset.sort_unstable_by_key(|&(offset, _)| offset);
                by_offset
            });
        let Some(by_offset) = ruled_out else {
            return file_ranges;
        };
        let mut kept = Vec::with_capacity(file_ranges.len());
        for range in file_ranges {
            // The row groups whose first page lies in the range.
            let (start, end) = byte_range(&range);
            let from = by_offset.partition_point(|&(offset, _)| offset < start);
            let to = by_offset.partition_point(|&(offset, _)| offset < end);
            let inside = &by_offset[from..to];
            if !inside.is_empty() && inside.iter().all(|&(_, out)| out) {
                pruned.ranges_of_row_groups += 1;
                pruned.row_groups += inside.len();
            } else {
                kept.push(range);
            }
        }
        kept
    }

    /// Which row groups of `file` (its footer `footer`) DataFusion's scan skips by their
    /// statistics, as its opener decides it: the file's Arrow schema with the scan's type
    /// coercions, the predicate for the file adapted to that schema and simplified, then
    /// `RowGroupAccessPlanFilter::prune_by_statistics`. `None` where the scan does not
    /// prune row groups so, or anything fails (every row group is then kept).
    fn row_groups_ruled_out(
        &mut self,
        file: &PartitionedFile,
        footer: &Arc<ParquetMetaData>,
    ) -> Option<Vec<bool>> {
        let max_in_list_size = self.row_groups?;
        let mut options = ArrowReaderOptions::new();
        if let Some(schema) = file.arrow_schema.as_ref() {
            options = options.with_schema(Arc::clone(schema));
        }
        let reader = ArrowReaderMetadata::try_new(Arc::clone(footer), options).ok()?;
        let (physical, pruning) =
            self.row_group_predicate(file, reader.schema(), max_in_list_size)?;
        let groups = footer.row_groups();
        let mut filter = RowGroupAccessPlanFilter::new(ParquetAccessPlan::new_all(groups.len()));
        let scratch = ExecutionPlanMetricsSet::new();
        let counters = ParquetFileMetrics::new(0, file.object_meta.location.as_ref(), &scratch);
        filter.prune_by_statistics(
            &physical,
            reader.parquet_schema(),
            groups,
            &pruning,
            &counters,
        );
        let plan = filter.build();
        Some((0..groups.len()).map(|i| !plan.should_scan(i)).collect())
    }

    /// The row groups' pruning predicate for `file`, whose Arrow schema is `file_arrow`,
    /// and the schema it reads (with the scan's type coercions); `None` where it cannot be
    /// built or prunes nothing. Made once for each set of partition values and file schema
    /// ([`RowGroupPredicates`]): files written alike share it.
    fn row_group_predicate(
        &mut self,
        file: &PartitionedFile,
        file_arrow: &SchemaRef,
        max_in_list_size: usize,
    ) -> Option<(SchemaRef, Arc<PruningPredicate>)> {
        let key = (file.partition_values.clone(), Arc::clone(file_arrow));
        if let Some(made) = self.row_group_predicates.get(&key) {
            return made.clone();
        }
        let made = (|| {
            let predicate = self.for_range(file)?;
            let mut physical = Arc::clone(file_arrow);
            if let Some(coerced) = apply_file_schema_type_coercions(&self.file_schema, &physical) {
                physical = Arc::new(coerced);
            }
            let adapter = DefaultPhysicalExprAdapterFactory
                .create(Arc::clone(&self.file_schema), Arc::clone(&physical))
                .ok()?;
            let predicate = PhysicalExprSimplifier::new(&physical)
                .simplify(adapter.rewrite(predicate).ok()?)
                .ok()?;
            let pruning = PruningPredicateBuilder::new()
                .with_file_schema(Arc::clone(&physical))
                .with_max_in_list_size(max_in_list_size)
                .build(predicate)?;
            Some((physical, pruning))
        })();
        self.row_group_predicates.insert(key, made.clone());
        made
    }
}

/// The row groups' pruning predicates made so far, by partition values and file schema
/// (`None`: none can be made for them).
type RowGroupPredicates =
    HashMap<(Vec<ScalarValue>, SchemaRef), Option<(SchemaRef, Arc<PruningPredicate>)>>;

/// Files that can be asked together whether their statistics rule them out: the same
/// partition values, and statistics of the predicate's columns of the same types.
type PruningSet<'a> = (&'a [ScalarValue], Vec<Option<DataType>>);

/// What a scan's cut left out before any task ran, counted as DataFusion's scan would
/// have counted it had it opened those ranges, so `EXPLAIN ANALYZE` states the same
/// pruning as vanilla's.
#[derive(Debug, Default)]
pub(super) struct PrunedBeforeTasks {
    /// Ranges the file statistics rule out (`files_ranges_pruned_statistics`, pruned).
    ranges: usize,
    /// Ranges the file statistics leave but whose every row group the row groups'
    /// statistics rule out (`files_ranges_pruned_statistics`, matched).
    ranges_of_row_groups: usize,
    /// The row groups of those (`row_groups_pruned_statistics`, pruned).
    row_groups: usize,
}

impl PrunedBeforeTasks {
    /// Register the counts (only those above zero) in `metrics`.
    pub(super) fn count_in(&self, metrics: &ExecutionPlanMetricsSet) {
        let counter = |name: &'static str| {
            MetricBuilder::new(metrics)
                .with_type(MetricType::Summary)
                .pruning_metrics(name, 0)
        };
        if self.ranges + self.ranges_of_row_groups > 0 {
            let ranges = counter("files_ranges_pruned_statistics");
            ranges.add_pruned(self.ranges);
            ranges.add_matched(self.ranges_of_row_groups);
        }
        if self.row_groups > 0 {
            counter("row_groups_pruned_statistics").add_pruned(self.row_groups);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A Parquet scan of `a` (Int64) in files partitioned by `part` (Utf8), filtered by
    /// `predicate`.
    pub(crate) fn filtered_scan(predicate: Arc<dyn PhysicalExpr>) -> FileScanConfig {
        use datafusion::arrow::datatypes::{DataType, Field};
        use datafusion::datasource::table_schema::TableSchema;
        use datafusion::execution::object_store::ObjectStoreUrl;
        let files = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let part = Arc::new(Field::new("part", DataType::Utf8, false));
        let source = ParquetSource::new(
            TableSchema::builder(files)
                .with_table_partition_cols(vec![part])
                .build(),
        )
        .with_predicate(predicate);
        datafusion::datasource::physical_plan::FileScanConfigBuilder::new(
            ObjectStoreUrl::local_filesystem(),
            Arc::new(source),
        )
        .build()
    }

    /// A file of partition `part` whose `a` lies in `[min, max]` (no statistics: `None`).
    pub(crate) fn file_of(part: &str, range: Option<(i64, i64)>) -> PartitionedFile {
        use datafusion::common::stats::{ColumnStatistics, Precision, Statistics};
        let mut file = PartitionedFile::new("f.parquet", 1000)
            .with_partition_values(vec![ScalarValue::from(part)]);
        if let Some((min, max)) = range {
            let column = ColumnStatistics {
                min_value: Precision::Exact(ScalarValue::from(min)),
                max_value: Precision::Exact(ScalarValue::from(max)),
                null_count: Precision::Exact(0),
                ..ColumnStatistics::new_unknown()
            };
            file = file.with_statistics(Arc::new(Statistics {
                num_rows: Precision::Exact(10),
                total_byte_size: Precision::Absent,
                column_statistics: vec![column, ColumnStatistics::new_unknown()],
            }));
        }
        file
    }

    /// Whether `pruning` leaves out `file`, asked alone.
    fn prunes(pruning: &StaticFilePruning, file: &PartitionedFile) -> bool {
        pruning.files_pruned(&[file]) == [true]
    }

    #[test]
    fn a_range_its_statistics_rule_out_makes_no_split() {
        use datafusion::logical_expr::Operator;
        use datafusion::physical_expr::expressions::{BinaryExpr, Column};
        let a = || Arc::new(Column::new("a", 0)) as Arc<dyn PhysicalExpr>;
        let compare = |left: Arc<dyn PhysicalExpr>, op, right: Arc<dyn PhysicalExpr>| {
            Arc::new(BinaryExpr::new(left, op, right)) as Arc<dyn PhysicalExpr>
        };
        // a = 15
        let pruning =
            StaticFilePruning::of(&filtered_scan(compare(a(), Operator::Eq, lit(15i64)))).unwrap();
        assert!(prunes(&pruning, &file_of("x", Some((20, 30)))));
        assert!(prunes(&pruning, &file_of("x", Some((0, 14)))));
        assert!(!prunes(&pruning, &file_of("x", Some((10, 20)))));
        assert!(
            !prunes(&pruning, &file_of("x", None)),
            "no statistics: kept"
        );

        // part = 'x' AND a = 15: the partition column (not in the files) takes each range's
        // value, and the file column's statistics still prune.
        let part = Arc::new(Column::new("part", 1)) as Arc<dyn PhysicalExpr>;
        let both = compare(
            compare(part, Operator::Eq, lit("x")),
            Operator::And,
            compare(a(), Operator::Eq, lit(15i64)),
        );
        let pruning = StaticFilePruning::of(&filtered_scan(both)).unwrap();
        assert!(prunes(&pruning, &file_of("x", Some((20, 30)))));
        assert!(!prunes(&pruning, &file_of("x", Some((10, 20)))));

        // A join's dynamic filter counts as `true`, even once it would rule a range out:
        // the splits must be the same whenever the plan is cut.
        let dynamic = Arc::new(DynamicFilterPhysicalExpr::new(vec![a()], lit(true)));
        dynamic
            .update(compare(a(), Operator::Gt, lit(100i64)))
            .unwrap();
        let both = compare(
            compare(a(), Operator::GtEq, lit(10i64)),
            Operator::And,
            dynamic as Arc<dyn PhysicalExpr>,
        );
        let pruning = StaticFilePruning::of(&filtered_scan(both)).unwrap();
        assert!(!prunes(&pruning, &file_of("x", Some((10, 20)))));
        assert!(prunes(&pruning, &file_of("x", Some((0, 9)))));
    }

    #[test]
    fn files_asked_together_get_the_verdicts_they_get_alone() {
        use datafusion::common::stats::Precision;
        use datafusion::logical_expr::Operator;
        use datafusion::physical_expr::expressions::{BinaryExpr, Column};
        let compare = |left: Arc<dyn PhysicalExpr>, op, right: Arc<dyn PhysicalExpr>| {
            Arc::new(BinaryExpr::new(left, op, right)) as Arc<dyn PhysicalExpr>
        };
        // part = 'x' AND a = 15, over files of two partitions, one without statistics.
        let part = Arc::new(Column::new("part", 1)) as Arc<dyn PhysicalExpr>;
        let a = Arc::new(Column::new("a", 0)) as Arc<dyn PhysicalExpr>;
        let both = compare(
            compare(part, Operator::Eq, lit("x")),
            Operator::And,
            compare(a, Operator::Eq, lit(15i64)),
        );
        let pruning = StaticFilePruning::of(&filtered_scan(both)).unwrap();
        let files = [
            file_of("x", Some((20, 30))),
            file_of("y", Some((10, 20))),
            file_of("x", Some((10, 20))),
            file_of("x", None),
            file_of("y", Some((0, 9))),
            file_of("x", Some((0, 14))),
            file_of("x", Some((15, 15))),
        ];
        let all: Vec<&PartitionedFile> = files.iter().collect();
        let together = pruning.files_pruned(&all);
        // (`'y' = 'x'` is not simplified away here: the file's statistics decide.)
        assert_eq!(together, [true, false, false, false, true, true, false]);
        let alone: Vec<bool> = files.iter().map(|f| prunes(&pruning, f)).collect();
        assert_eq!(together, alone);

        // A file whose statistics are of another type (written before the column's type
        // changed) fails the evaluation of its set: its files are asked one by one, so
        // the others are still left out.
        let mut odd = file_of("x", Some((20, 30)));
        let mut statistics = (**odd.statistics.as_ref().unwrap()).clone();
        statistics.column_statistics[0].min_value = Precision::Exact(ScalarValue::from("20"));
        statistics.column_statistics[0].max_value = Precision::Exact(ScalarValue::from("30"));
        odd.statistics = Some(Arc::new(statistics));
        let with_odd = [&files[0], &odd, &files[2], &files[5]];
        let together = pruning.files_pruned(&with_odd);
        assert_eq!(together[0..1], [true]);
        assert_eq!(together[2..], [false, true]);
        let alone: Vec<bool> = with_odd.iter().map(|f| prunes(&pruning, f)).collect();
        assert_eq!(together, alone);
    }

    /// A task's split is ruled out at launch by the bounds its scan starts from, checked
    /// against the file statistics, only where nothing above the scan makes a row of no
    /// rows.
    #[test]
    fn a_split_its_bounds_rule_out_has_nothing_to_read() {
        use datafusion::datasource::physical_plan::FileScanConfigBuilder;
        use datafusion::logical_expr::Operator;
        use datafusion::physical_expr::expressions::{BinaryExpr, Column};
        use datafusion::physical_plan::aggregates::{AggregateMode, PhysicalGroupBy};

        let a: Arc<dyn PhysicalExpr> = Arc::new(Column::new("a", 0));
        let bound = Arc::new(DynamicFilterPhysicalExpr::new(
            vec![Arc::clone(&a)],
            lit(true),
        ));
        let scan_of = |files: Vec<PartitionedFile>, predicate: Arc<dyn PhysicalExpr>| {
            let config = FileScanConfigBuilder::from(filtered_scan(predicate))
                .with_file_groups(vec![files.into()])
                .build();
            DataSourceExec::from_data_source(config) as Arc<dyn ExecutionPlan>
        };
        let low = || vec![file_of("x", Some((0, 10))), file_of("y", Some((5, 20)))];
        let scan = scan_of(low(), Arc::clone(&bound) as _);
        assert!(!nothing_to_read(&scan), "an empty bound rules out nothing");
        let above_50 = BinaryExpr::new(Arc::clone(&a), Operator::Gt, lit(50i64));
        bound.update(Arc::new(above_50)).unwrap();
        assert!(nothing_to_read(&scan));
        let one_reaches = vec![file_of("x", Some((0, 10))), file_of("y", Some((40, 60)))];
        assert!(!nothing_to_read(&scan_of(
            one_reaches,
            Arc::clone(&bound) as _
        )));
        let unknown = vec![file_of("x", Some((0, 10))), file_of("y", None)];
        assert!(!nothing_to_read(&scan_of(unknown, Arc::clone(&bound) as _)));
        // A static predicate was checked when the scan was cut.
        let static_above_50 = Arc::new(BinaryExpr::new(Arc::clone(&a), Operator::Gt, lit(50i64)));
        assert!(!nothing_to_read(&scan_of(low(), static_above_50)));

        let filtered: Arc<dyn ExecutionPlan> =
            Arc::new(FilterExec::try_new(lit(true), Arc::clone(&scan)).unwrap());
        assert!(nothing_to_read(&filtered));
        // An aggregate without groups makes a row of no rows (`count(*)` = 0).
        let schema = scan.schema();
        let no_groups = AggregateExec::try_new(
            AggregateMode::Partial,
            PhysicalGroupBy::new_single(vec![]),
            vec![],
            vec![],
            Arc::clone(&scan),
            Arc::clone(&schema),
        )
        .unwrap();
        assert!(!nothing_to_read(&(Arc::new(no_groups) as _)));
        let by_a = AggregateExec::try_new(
            AggregateMode::Partial,
            PhysicalGroupBy::new_single(vec![(Arc::clone(&a), "a".into())]),
            vec![],
            vec![],
            Arc::clone(&scan),
            schema,
        )
        .unwrap();
        assert!(nothing_to_read(&(Arc::new(by_a) as _)));
    }
}
