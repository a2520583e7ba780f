//! The `EXPLAIN ANALYZE` fact parser of the sqllogictest runner
//! (`tests/sqllogictests/metric_facts.rs`), on texts as DataFusion prints them.

use crate::metric_fact_parser::MetricFacts;

#[test]
fn sums_pruning_over_nodes_and_ignores_what_is_not_checked() {
    let text = "DataSourceExec: metrics=[output_rows=3, elapsed_compute=<slt:ignore>, \
        row_groups_pruned_statistics=4 total → 3 matched -> 1 fully matched, \
        limit_pruned_row_groups=2 total → 0 matched, pushdown_rows_pruned=5]\n\
        DataSourceExec: metrics=[row_groups_pruned_statistics=2 total → 2 matched, \
        spill_count=0]";
    let facts = MetricFacts::of(text);
    assert_eq!(facts.pruning()["row_groups_pruned_statistics"], [6, 5, 1]);
    assert_eq!(facts.pruning()["limit_pruned_row_groups"], [2, 0, 0]);
    assert_eq!(facts.counts()["pushdown_rows_pruned"], 5);
    assert_eq!(facts.spilled("DataSourceExec"), Some(false));
    let other = MetricFacts::of(
        "DataSourceExec: metrics=[row_groups_pruned_statistics=6 total → 5 matched -> 1 fully matched, \
         limit_pruned_row_groups=2 total → 1 matched, pushdown_rows_pruned=5, \
         spilled_bytes=1.2 K]",
    );
    let differences = facts.differences(&other);
    assert_eq!(differences.len(), 2, "{differences:?}");
}

#[test]
fn spills_by_node_kind_and_a_zero_size_is_no_spill() {
    let flumen = MetricFacts::of(
        "|   AggregateExec: mode=Single, gby=[a], metrics=[spill_count=0, spilled_bytes=0.0 B]\n\
         |     SortExec: expr=[a], metrics=[spill_count=2, spilled_bytes=1.2 KB]",
    );
    assert_eq!(flumen.spilled("AggregateExec mode=Single"), Some(false));
    assert_eq!(flumen.spilled("SortExec"), Some(true));
    let expected = MetricFacts::of(
        "01)AggregateExec: mode=Single,<slt:ignore>metrics=[<slt:ignore>spill_count=7,<slt:ignore>]\n\
         02)--AggregateExec: mode=Partial, metrics=[spilled_bytes=<slt:ignore> KB]",
    );
    assert_eq!(expected.spilled("AggregateExec mode=Single"), Some(true));
    // A value not checked (`<slt:ignore>`) states nothing.
    assert_eq!(expected.spilled("AggregateExec mode=Partial"), None);
    assert_eq!(expected.differences(&flumen).len(), 1);
    // A worker's counters show on its operator's line.
    let worker = MetricFacts::of("FlumenOperator: id=0, metrics=[spill_count=3]");
    assert!(expected.differences(&worker).is_empty());
}

#[test]
fn items_parted_at_commas_with_ignored_values_between() {
    let text = "Plan with Metrics\n<slt:ignore>SortMergeJoinExec: join_type=Inner, \
        metrics=[output_rows=2.00 K,<slt:ignore>spill_count=10, spilled_bytes=<slt:ignore>\n\
        03)----NestedLoopJoinExec: join_type=Inner, metrics=[output_rows=100.0 K, \
        <slt:ignore> spill_count=2, <slt:ignore>]";
    let facts = MetricFacts::of(text);
    assert_eq!(facts.spilled("SortMergeJoinExec"), Some(true));
    assert_eq!(facts.spilled("NestedLoopJoinExec"), Some(true));
}
