//! How many partitions a query's hash exchanges get: from the bytes flowing into them and
//! `flumen.memory_budget`, not from the core count, so that each reduce task's input (a
//! join's build side, an aggregate's groups) fits its share of the budget.
//!
//! The planner estimates the bytes entering each hash exchange and each full sort of
//! DataFusion's plan (from
//! the sources' statistics: Parquet footers, filter selectivity, projections). When the
//! largest would not fit in `target_partitions` partitions of
//! [`ExchangeSizing::partition_bytes`] each, the query is planned again with as many
//! partitions as it takes, and runs *out of core*: per-partition operators run in waves
//! of the CPU slots rather than all at once (so only the running partitions' state is in
//! memory), which is why the re-plan also turns off join dynamic filters (their partitions
//! wait for each other) and the operator graph streams no join probe input.

use std::fmt;
use std::sync::Arc;

use datafusion::arrow::datatypes::DataType;
use datafusion::common::tree_node::TreeNode;
use datafusion::config::ConfigOptions;
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, Partitioning, StatisticsArgs, StatisticsContext};

use crate::config::{ByteSize, FlumenConfig};

/// Whether a full sort over `input` can be range-partitioned out of core
/// ([`super::range_sort`]): its input is cheap to read twice (once for the sample): sources, filters, projections and round-robin repartitions,
/// no state and no other exchange.
pub fn can_range_sort(sort: &SortExec) -> bool {
    sort.fetch().is_none() && rereadable(sort.input())
}

fn rereadable(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let node_ok = plan
        .downcast_ref::<DataSourceExec>()
        .is_some_and(|s| s.fetch().is_none())
        || plan
            .downcast_ref::<FilterExec>()
            .is_some_and(|f| f.fetch().is_none())
        || plan.downcast_ref::<ProjectionExec>().is_some()
        || plan.downcast_ref::<CooperativeExec>().is_some()
        || plan
            .downcast_ref::<RepartitionExec>()
            .is_some_and(|r| matches!(r.partitioning(), Partitioning::RoundRobinBatch(_)));
    node_ok && plan.children().into_iter().all(rereadable)
}

/// Most partitions an exchange is given (beyond it a query runs with larger partitions).
pub const MAX_PARTITIONS: usize = 4096;

/// The number of partitions chosen for a query's hash exchanges, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExchangeSizing {
    /// Partitions every hash exchange of the plan has.
    pub partitions: usize,
    /// `datafusion.execution.target_partitions`: what DataFusion alone would use.
    pub default_partitions: usize,
    /// Estimated bytes entering the largest hash exchange or full sort.
    pub largest_exchange_bytes: u64,
    /// Bytes one reduce task's input may have: the budget split over the CPU slots that run
    /// at once, a quarter of that for the input (a hash table or sort buffer is larger
    /// than its input, and blocks share the budget).
    pub partition_bytes: u64,
    /// Whether the query runs out of core. In core, every partition of an operator runs at
    /// once, so the largest exchange must fit a quarter of the budget whole, however many
    /// partitions DataFusion gives it (a query can run out of core with DataFusion's
    /// partition count, in waves of the CPU slots).
    out_of_core: bool,
}

impl ExchangeSizing {
    /// Sizing for DataFusion's plan `plan` (made with `options`).
    pub fn choose(plan: &Arc<dyn ExecutionPlan>, options: &ConfigOptions) -> Self {
        let config = options
            .extensions
            .get::<FlumenConfig>()
            .cloned()
            .unwrap_or_default();
        let default_partitions = options.execution.target_partitions.max(1);
        let slots = config.cpu_slots.max(1) as u64;
        let partition_bytes = (config.memory_budget.0 / (4 * slots)).max(1);
        // In core all `default_partitions` partitions run at once, whatever the slots.
        let in_core_partition_bytes =
            (config.memory_budget.0 / (4 * slots.max(default_partitions as u64))).max(1);
        let mut largest = 0;
        let mut needed = 0;
        let mut needed_in_core = 0;
        // In core the operators of a pipeline run together: every join's build side is in
        // memory at once, so their exchanges count together (an aggregate's, below, alone).
        let mut build_bytes = 0;
        // A partitioned hash join's probe input streams through the join: only its build
        // side must fit a partition, so the exchange feeding its probe side does not count.
        // A final grouped aggregate holds its groups, not its input, and spills them when
        // refused memory. Partitioning its input (out of core) pays when that input fits in
        // memory, as blocks that never spill; a larger input would spill whole, where the
        // aggregate in core spills at most its groups: the exchange feeding it takes the
        // query out of core only when it fits the budget.
        let mut probe_exchanges = vec![];
        let mut aggregate_exchanges = vec![];
        let _ = plan.apply(|node| {
            if let Some(join) = node.downcast_ref::<HashJoinExec>()
                && *join.partition_mode() == PartitionMode::Partitioned
            {
                probe_exchanges.push(Arc::as_ptr(join.right()) as *const ());
            }
            if let Some(aggregate) = node.downcast_ref::<AggregateExec>()
                && *aggregate.mode() == AggregateMode::FinalPartitioned
                && !aggregate.group_expr().is_empty()
            {
                aggregate_exchanges.push(Arc::as_ptr(aggregate.input()) as *const ());
            }
            Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
        });
        let _ = plan.apply(|node| {
            let exchange = Arc::as_ptr(node) as *const ();
            if let Some(repartition) = node.downcast_ref::<RepartitionExec>()
                && matches!(repartition.partitioning(), Partitioning::Hash(..))
                && !probe_exchanges.contains(&exchange)
            {
                let bytes = estimated_bytes(repartition.input());
                largest = largest.max(bytes);
                needed = needed.max(bytes.div_ceil(partition_bytes));
                let in_core = if !aggregate_exchanges.contains(&exchange) {
                    build_bytes += bytes;
                    build_bytes
                } else if bytes <= config.memory_budget.0 {
                    bytes
                } else {
                    0
                };
                needed_in_core = needed_in_core.max(in_core.div_ceil(in_core_partition_bytes));
            }
            // A full sort. One that becomes a range sort (out of core) needs a range per
            // partition's share of bytes. Otherwise more partitions make more, smaller
            // sorted runs, as many as the merge above can read at once (a block of each)
            // in a quarter of the budget; beyond that each run's sort spills by itself.
            if let Some(sort) = node.downcast_ref::<SortExec>()
                && sort.fetch().is_none()
            {
                let bytes = estimated_bytes(sort.input());
                let ranges = bytes.div_ceil(partition_bytes);
                largest = largest.max(bytes);
                let sort_needs = if can_range_sort(sort) {
                    ranges
                } else {
                    let block_bytes = config.target_block_rows as u64 * row_width(sort.input());
                    let fan_in = (config.memory_budget.0 / 4 / (3 * block_bytes).max(1)).max(2);
                    ranges.min(fan_in)
                };
                needed = needed.max(sort_needs);
                needed_in_core = needed_in_core.max(sort_needs);
            }
            Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
        });
        let out_of_core = needed_in_core > default_partitions as u64;
        Self {
            partitions: match out_of_core {
                true => (needed as usize)
                    .clamp(default_partitions, MAX_PARTITIONS.max(default_partitions)),
                false => default_partitions,
            },
            default_partitions,
            largest_exchange_bytes: largest,
            partition_bytes,
            out_of_core,
        }
    }

    /// True when the query does not fit the budget with DataFusion's partitions all running
    /// at once: it is planned again with [`Self::partitions`] and runs out of core.
    pub fn out_of_core(&self) -> bool {
        self.out_of_core
    }

    /// This sizing made out of core whatever the estimates, with the largest exchange
    /// taken as at least `seen_bytes` (what a run refused memory in core had seen one
    /// operator produce): [`crate::exec::replan`].
    pub fn out_of_core_at_least(self, seen_bytes: u64) -> Self {
        let largest = self.largest_exchange_bytes.max(seen_bytes);
        let needed = largest.div_ceil(self.partition_bytes.max(1)) as usize;
        Self {
            partitions: needed.clamp(
                self.default_partitions,
                MAX_PARTITIONS.max(self.default_partitions),
            ),
            largest_exchange_bytes: largest,
            out_of_core: true,
            ..self
        }
    }

    /// Options for planning the query again out of core.
    pub fn apply(&self, options: &mut ConfigOptions) {
        options.execution.target_partitions = self.partitions;
        options.optimizer.enable_join_dynamic_filter_pushdown = false;
    }
}

impl Default for ExchangeSizing {
    fn default() -> Self {
        Self {
            partitions: 1,
            default_partitions: 1,
            largest_exchange_bytes: 0,
            partition_bytes: u64::MAX,
            out_of_core: false,
        }
    }
}

impl fmt::Display for ExchangeSizing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "exchange_partitions={} (out of core: ~{} into the largest exchange or sort, {} per partition)",
            self.partitions,
            ByteSize(self.largest_exchange_bytes),
            ByteSize(self.partition_bytes)
        )
    }
}

/// Estimated bytes of `plan`'s whole output, from DataFusion's statistics: their byte size
/// when known, else rows times the schema's row width (rows a `generate_series` or `range`
/// below will make, when DataFusion knows none: [`generated_rows`]), else the sum of its
/// inputs'.
pub fn estimated_bytes(plan: &Arc<dyn ExecutionPlan>) -> u64 {
    let stats = StatisticsContext::default().compute(plan.as_ref(), &StatisticsArgs::new());
    if let Ok(stats) = stats {
        if let Some(bytes) = stats.total_byte_size.get_value()
            && *bytes > 0
        {
            return *bytes as u64;
        }
        if let Some(rows) = stats.num_rows.get_value() {
            return *rows as u64 * row_width(plan);
        }
    }
    if let Some(rows) = generated_rows(plan) {
        return rows.saturating_mul(row_width(plan));
    }
    if let Some(bytes) = scanned_file_bytes(plan) {
        return bytes;
    }
    plan.children().into_iter().map(estimated_bytes).sum()
}

/// Bytes a file scan without statistics (CSV, JSON, Avro: DataFusion gives no row count)
/// reads, its projection's share of them: the files' (or their ranges') sizes times the
/// projected columns' share of a row's width. Text decodes to about as many Arrow bytes
/// as it has: without it a join of two 466 MB CSV files was planned in core and refused
/// memory, where the same data in Parquet (which has statistics) ran out of core.
pub fn scanned_file_bytes(plan: &Arc<dyn ExecutionPlan>) -> Option<u64> {
    use datafusion::datasource::physical_plan::FileScanConfig;
    use datafusion::datasource::source::DataSourceExec;
    let config = plan
        .downcast_ref::<DataSourceExec>()?
        .data_source()
        .downcast_ref::<FileScanConfig>()?;
    let files: u64 = (config.file_groups.iter())
        .flat_map(|group| group.iter())
        .map(|file| match &file.range {
            Some(range) => (range.end - range.start).max(0) as u64,
            None => file.object_meta.size,
        })
        .sum();
    let width = |schema: &datafusion::arrow::datatypes::Schema| -> u64 {
        schema
            .fields()
            .iter()
            .map(|f| field_width(f.data_type()))
            .sum::<u64>()
            .max(1)
    };
    let whole = width(config.file_schema());
    let projected = config
        .projected_schema()
        .map(|schema| width(&schema))
        .unwrap_or(whole)
        .min(whole);
    Some(files.saturating_mul(projected) / whole)
}

/// Nodes whose output has at most as many rows as their one input.
const ROWS_AT_MOST_INPUT: &[&str] = &[
    "ProjectionExec",
    "FilterExec",
    "RepartitionExec",
    "CoalesceBatchesExec",
    "CoalescePartitionsExec",
];

/// Rows the integer series generators of a `LazyMemoryExec` (`generate_series`, `range`)
/// at or below `plan` will make (through projections, filters and exchanges, an upper
/// bound), which DataFusion's statistics do not give: without them a join of two series
/// was planned in core whatever its size, and refused memory.
pub fn generated_rows(plan: &Arc<dyn ExecutionPlan>) -> Option<u64> {
    use datafusion::functions_table::generate_series::GenericSeriesState;
    use datafusion::physical_plan::memory::LazyMemoryExec;
    if let Some(lazy) = plan.downcast_ref::<LazyMemoryExec>() {
        let mut rows = 0u64;
        for generator in lazy.generators() {
            let generator = generator.read();
            let series = generator
                .as_any()
                .downcast_ref::<GenericSeriesState<i64>>()?;
            rows = rows.saturating_add(series_len(
                *series.start(),
                *series.end(),
                *series.step(),
                series.include_end(),
            ));
        }
        return Some(rows);
    }
    match plan.children().as_slice() {
        [child] if ROWS_AT_MOST_INPUT.contains(&plan.name()) => generated_rows(child),
        _ => None,
    }
}

/// Values from `start` towards `end` by `step` (`end` itself when `include_end`).
fn series_len(start: i64, end: i64, step: i64, include_end: bool) -> u64 {
    let (start, end, step) = (start as i128, end as i128, step as i128);
    let span = match step {
        0 => return 0,
        s if s > 0 => end - start,
        _ => start - end,
    };
    let step = step.abs();
    let len = match include_end {
        true if span >= 0 => span / step + 1,
        false if span > 0 => (span - 1) / step + 1,
        _ => 0,
    };
    u64::try_from(len).unwrap_or(u64::MAX)
}

/// Bytes of one row of `plan`'s schema: fixed widths, 32 for variable-width values.
pub fn row_width(plan: &Arc<dyn ExecutionPlan>) -> u64 {
    plan.schema()
        .fields()
        .iter()
        .map(|f| field_width(f.data_type()))
        .sum::<u64>()
        .max(1)
}

/// Bytes of one value of `data_type`: its fixed width, 32 for variable-width values.
fn field_width(data_type: &DataType) -> u64 {
    match data_type {
        DataType::FixedSizeBinary(n) => *n as u64,
        other => other.primitive_width().unwrap_or(32) as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_plans::{node_named, physical_plan};
    use datafusion::arrow::array::Int64Array;
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::arrow::record_batch::RecordBatch;
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::physical_plan::expressions::col;

    fn exchange_over(rows: i64) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from_iter_values(0..rows))],
        )
        .unwrap();
        let scan = MemorySourceConfig::try_new_exec(&[vec![batch]], schema.clone(), None).unwrap();
        let key = col("x", &schema).unwrap();
        Arc::new(RepartitionExec::try_new(scan, Partitioning::Hash(vec![key], 2)).unwrap())
    }

    fn options(budget: &str, slots: usize) -> ConfigOptions {
        options_with(budget, slots, 2)
    }

    fn options_with(budget: &str, slots: usize, target_partitions: usize) -> ConfigOptions {
        let mut options = ConfigOptions::new();
        options.execution.target_partitions = target_partitions;
        options.extensions.insert(FlumenConfig {
            memory_budget: budget.parse().unwrap(),
            cpu_slots: slots,
            ..FlumenConfig::default()
        });
        options
    }

    #[test]
    fn partitions_follow_bytes_over_budget() {
        let plan = exchange_over(1_000_000);
        // Small input, large budget: DataFusion's default.
        let sizing = ExchangeSizing::choose(&plan, &options("2GB", 2));
        assert!(!sizing.out_of_core(), "{sizing:?}");
        assert_eq!(sizing.partitions, 2);
        assert!(sizing.largest_exchange_bytes >= 8_000_000, "{sizing:?}");
        // 1 MB budget over 2 slots: 128 KB per partition.
        let sizing = ExchangeSizing::choose(&plan, &options("1MB", 2));
        assert!(sizing.out_of_core());
        assert_eq!(sizing.partition_bytes, (1 << 20) / 8);
        assert_eq!(
            sizing.partitions as u64,
            sizing
                .largest_exchange_bytes
                .div_ceil(sizing.partition_bytes)
        );
        assert!(
            sizing.to_string().contains("exchange_partitions="),
            "{sizing}"
        );
    }

    /// In core every partition runs at once: an exchange that needs no more partitions
    /// than DataFusion's default by the slots' share still runs out of core when it does
    /// not fit a quarter of the budget whole.
    #[test]
    fn in_core_partitions_all_run_at_once() {
        // 8 MB into the exchange, 30 MB budget, 2 slots: 3.75 MB per partition, 3 needed.
        let plan = exchange_over(1_000_000);
        let sizing = ExchangeSizing::choose(&plan, &options_with("30MB", 2, 4));
        assert_eq!(sizing.partitions, 4, "{sizing:?}");
        assert!(
            sizing.out_of_core(),
            "8 MB is over a quarter of 30 MB: {sizing:?}"
        );
        let sizing = ExchangeSizing::choose(&plan, &options_with("64MB", 2, 4));
        assert!(
            !sizing.out_of_core(),
            "8 MB fits a quarter of 64 MB: {sizing:?}"
        );
    }

    /// The exchange feeding a partitioned hash join's probe side does not decide the
    /// partitions: only the build side must fit.
    #[test]
    fn a_join_probe_side_does_not_count() {
        use datafusion::common::NullEquality;
        use datafusion::logical_expr::JoinType;
        let build = exchange_over(10_000);
        let probe = exchange_over(1_000_000);
        let on = vec![(
            col("x", &build.schema()).unwrap(),
            col("x", &probe.schema()).unwrap(),
        )];
        let join = |left: &Arc<dyn ExecutionPlan>, right: &Arc<dyn ExecutionPlan>| {
            let join = HashJoinExec::try_new(
                Arc::clone(left),
                Arc::clone(right),
                on.clone(),
                None,
                &JoinType::Inner,
                None,
                PartitionMode::Partitioned,
                NullEquality::NullEqualsNothing,
                false,
            )
            .unwrap();
            Arc::new(join) as Arc<dyn ExecutionPlan>
        };
        let sizing = ExchangeSizing::choose(&join(&build, &probe), &options("1MB", 2));
        assert!(!sizing.out_of_core(), "{sizing:?}");
        assert!(sizing.largest_exchange_bytes < 1_000_000, "{sizing:?}");
        // The large side as the build side: out of core.
        let sizing = ExchangeSizing::choose(&join(&probe, &build), &options("1MB", 2));
        assert!(sizing.out_of_core(), "{sizing:?}");
    }

    /// In core every join of a pipeline holds its build side at once: two builds that each
    /// fit a quarter of the budget but not together take the query out of core.
    #[test]
    fn in_core_build_sides_count_together() {
        use datafusion::common::NullEquality;
        use datafusion::logical_expr::JoinType;
        let join = |left: Arc<dyn ExecutionPlan>, right: Arc<dyn ExecutionPlan>| {
            let on = vec![(
                col("x", &left.schema()).unwrap(),
                col("x", &right.schema()).unwrap(),
            )];
            Arc::new(
                HashJoinExec::try_new(
                    left,
                    right,
                    on,
                    None,
                    &JoinType::LeftSemi,
                    None,
                    PartitionMode::Partitioned,
                    NullEquality::NullEqualsNothing,
                    false,
                )
                .unwrap(),
            ) as Arc<dyn ExecutionPlan>
        };
        // 4 MB builds; in core 30 MB over 4 partitions gives 1.875 MB each, 7.5 MB in all.
        let one = join(exchange_over(500_000), exchange_over(100));
        let sizing = ExchangeSizing::choose(&one, &options_with("30MB", 2, 4));
        assert!(!sizing.out_of_core(), "one 4 MB build fits: {sizing:?}");
        let two = join(
            exchange_over(500_000),
            join(exchange_over(500_000), exchange_over(100)),
        );
        let sizing = ExchangeSizing::choose(&two, &options_with("30MB", 2, 4));
        assert!(sizing.out_of_core(), "two 4 MB builds do not: {sizing:?}");
    }

    /// A final grouped aggregate's input exchange takes the query out of core when it fits
    /// the budget (its blocks stay in memory), not when it is larger (the aggregate spills
    /// its groups in core instead).
    #[tokio::test]
    async fn an_aggregate_input_larger_than_the_budget_stays_in_core() {
        use datafusion::datasource::MemTable;
        use datafusion::prelude::{SessionConfig, SessionContext};
        let ctx = SessionContext::new_with_config(SessionConfig::new().with_target_partitions(4));
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from_iter_values(0..1_000_000))],
        )
        .unwrap();
        let table = MemTable::try_new(schema, vec![vec![batch]]).unwrap();
        ctx.register_table("t", Arc::new(table)).unwrap();
        let plan = physical_plan(&ctx, "SELECT x, count(*) FROM t GROUP BY x").await;
        // ~8 MB into the aggregate's exchange.
        let sizing = ExchangeSizing::choose(&plan, &options_with("30MB", 2, 4));
        assert!(sizing.out_of_core(), "8 MB fits 30 MB: {sizing:?}");
        let sizing = ExchangeSizing::choose(&plan, &options_with("6MB", 2, 4));
        assert!(
            !sizing.out_of_core(),
            "8 MB is larger than 6 MB: {sizing:?}"
        );
        assert_eq!(sizing.partitions, 4, "{sizing:?}");
    }

    #[test]
    fn a_series_counts_its_values_both_ways_and_with_or_without_its_end() {
        assert_eq!(series_len(1, 10, 1, true), 10, "generate_series(1, 10)");
        assert_eq!(series_len(1, 10, 1, false), 9, "range(1, 10)");
        assert_eq!(series_len(0, 10, 3, true), 4, "0, 3, 6, 9");
        assert_eq!(series_len(0, 9, 3, true), 4, "0, 3, 6, 9");
        assert_eq!(series_len(0, 9, 3, false), 3, "0, 3, 6");
        assert_eq!(series_len(10, 1, -2, true), 5, "10, 8, 6, 4, 2");
        assert_eq!(series_len(1, 10, -1, true), 0, "the wrong way");
        assert_eq!(series_len(5, 5, 1, true), 1);
        assert_eq!(series_len(5, 5, 1, false), 0);
        assert_eq!(series_len(i64::MIN, i64::MAX, 1, true), u64::MAX);
    }

    #[tokio::test]
    async fn a_generated_series_gives_its_rows_through_a_projection() {
        let ctx = datafusion::prelude::SessionContext::new();
        let plan = physical_plan(
            &ctx,
            "SELECT value AS k, value * 2 AS v FROM generate_series(1, 1200000)",
        )
        .await;
        assert_eq!(generated_rows(&plan), Some(1_200_000));
        assert_eq!(estimated_bytes(&plan), 1_200_000 * 16, "two Int64 columns");
        let plan = physical_plan(&ctx, "SELECT count(*) FROM range(0, 1000)").await;
        assert_eq!(
            generated_rows(&plan),
            None,
            "an aggregate's rows are not its input's"
        );
    }

    #[tokio::test]
    async fn a_csv_scan_counts_its_files_bytes_for_its_projected_columns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.csv");
        let mut text = String::from("k,pad\n");
        for i in 0..10_000 {
            text.push_str(&format!("{i},{}\n", "a".repeat(100)));
        }
        std::fs::write(&path, &text).unwrap();
        let ctx = datafusion::prelude::SessionContext::new();
        let options = datafusion::prelude::CsvReadOptions::new();
        ctx.register_csv("t", path.to_str().unwrap(), options)
            .await
            .unwrap();
        let scan = |sql: &'static str| {
            let ctx = ctx.clone();
            async move {
                let plan = physical_plan(&ctx, sql).await;
                node_named(&plan, "DataSourceExec").unwrap()
            }
        };
        let file_bytes = text.len() as u64;
        // Both columns: the file's bytes (an Int64 is 8 bytes wide, a string 32).
        let both = scan("SELECT k, pad FROM t").await;
        assert_eq!(scanned_file_bytes(&both), Some(file_bytes));
        assert_eq!(
            estimated_bytes(&both),
            file_bytes,
            "DataFusion knows no rows"
        );
        // The key alone: 8 of the 40 bytes of a row.
        let key = scan("SELECT k FROM t").await;
        assert_eq!(scanned_file_bytes(&key), Some(file_bytes * 8 / 40));
    }
}
