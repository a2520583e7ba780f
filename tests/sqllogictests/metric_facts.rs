//! The facts an `EXPLAIN ANALYZE` text states about pruning and spilling, summed over its
//! nodes, so that flumen's run of a query can be held to vanilla DataFusion's.
//!
//! DataFusion's upstream `.slt` files check row groups, pages, file ranges and limits pruned
//! (and, through them, whether a TopK's or a join's dynamic filter reached the scan), rows
//! a pushed-down filter dropped, and whether an operator spilled, by printing one plan's
//! metrics. flumen's plan text is its own (operators, splits), so its records are compared
//! by these facts: each pruning counter's totals, each exact row count, and whether each
//! kind of node spilled (by its name and mode: `AggregateExec mode=Partial`). A counter a
//! worker carried back shows on its flumen operator's line; a node kind missing from
//! flumen's text is judged by its operators' lines.

use std::collections::BTreeMap;

/// Pruning counters, shown `N total → M matched[ -> K fully matched]`: compared as sums.
const PRUNING: &[&str] = &[
    "files_ranges_pruned_statistics",
    "row_groups_pruned_statistics",
    "row_groups_pruned_bloom_filter",
    "page_index_pages_pruned",
    "page_index_rows_pruned",
    "limit_pruned_row_groups",
];

/// Plain counters of rows a scan's filter or index dropped or kept: compared as sums.
const COUNTS: &[&str] = &[
    "pushdown_rows_pruned",
    "pushdown_rows_matched",
    "page_index_pages_skipped_by_fully_matched",
];

/// Counters that say a node spilled: compared as "spilled or not".
const SPILLS: &[&str] = &["spill_count", "spilled_rows", "spilled_bytes"];

/// What a plan text states about pruning and spilling.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct MetricFacts {
    /// Per pruning counter: total, matched, fully matched (summed over nodes).
    pruning: BTreeMap<String, [u64; 3]>,
    /// Per plain counter, its sum.
    counts: BTreeMap<String, u64>,
    /// Per kind of node (name and mode) showing a spill counter with a number: whether
    /// one of them spilled (a counter above 0).
    spilled: BTreeMap<String, bool>,
}

/// Where a worker's carried counters show: its flumen operator's line.
const OPERATOR_LINE: &str = "FlumenOperator";

impl MetricFacts {
    /// The facts of `text` (an `EXPLAIN ANALYZE` output, or its expected text in a `.slt`
    /// file, where `<slt:ignore>` stands for values not checked).
    pub fn of(text: &str) -> Self {
        let mut facts = MetricFacts::default();
        for line in text.lines() {
            let node = node_kind(line);
            for metrics in metric_lists(line) {
                // Items part at commas: `<slt:ignore>` may stand between two with no space.
                for item in metrics.split(',') {
                    let Some((name, value)) = item.split_once('=') else {
                        continue;
                    };
                    let name = name.trim().trim_start_matches("<slt:ignore>").trim();
                    facts.add(&node, name, value.trim());
                }
            }
        }
        facts
    }

    /// Per pruning counter: total, matched, fully matched.
    pub fn pruning(&self) -> &BTreeMap<String, [u64; 3]> {
        &self.pruning
    }

    /// Per plain counter, its sum.
    pub fn counts(&self) -> &BTreeMap<String, u64> {
        &self.counts
    }

    /// Whether a node of kind `node` (`AggregateExec mode=Partial`) spilled; `None` when
    /// none shows a spill counter.
    pub fn spilled(&self, node: &str) -> Option<bool> {
        self.spilled.get(node).copied()
    }

    /// Whether there is anything to compare.
    pub fn is_empty(&self) -> bool {
        self.pruning.is_empty() && self.counts.is_empty() && self.spilled.is_empty()
    }

    /// The facts `self` states that `other` states otherwise (or not at all), in words;
    /// empty when `other` agrees with every one. Facts only `other` states are not
    /// compared: a text of expectations leaves out what it does not check.
    pub fn differences(&self, other: &MetricFacts) -> Vec<String> {
        let mut out = vec![];
        for (name, expected) in &self.pruning {
            let actual = other.pruning.get(name);
            if actual != Some(expected) {
                out.push(format!(
                    "{name}: expected {}, got {}",
                    show(expected),
                    actual.map_or("none".into(), show)
                ));
            }
        }
        for (name, expected) in &self.counts {
            let actual = other.counts.get(name);
            if actual != Some(expected) {
                out.push(format!("{name}: expected {expected}, got {actual:?}"));
            }
        }
        for (node, expected) in &self.spilled {
            let actual = other
                .spilled
                .get(node)
                .or(other.spilled.get(OPERATOR_LINE))
                .copied()
                .unwrap_or(false);
            if actual != *expected {
                out.push(format!("{node} spilled: expected {expected}, got {actual}"));
            }
        }
        out
    }

    fn add(&mut self, node: &str, name: &str, value: &str) {
        if !value.starts_with(|c: char| c.is_ascii_digit()) {
            return;
        }
        if PRUNING.contains(&name) {
            if let Some(counts) = pruning_counts(value) {
                let sum = self.pruning.entry(name.into()).or_default();
                for (s, c) in sum.iter_mut().zip(counts) {
                    *s += c;
                }
            }
        } else if COUNTS.contains(&name) {
            if let Ok(n) = value.parse::<u64>() {
                *self.counts.entry(name.into()).or_default() += n;
            }
        } else if SPILLS.contains(&name) {
            // Counts and sizes print rounded ("2.05 K", "0.0 B"): only whether the number
            // is above 0 matters.
            let number: String = value
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            let spilled = number.parse::<f64>().is_ok_and(|n| n > 0.0);
            *self.spilled.entry(node.to_string()).or_default() |= spilled;
        }
    }
}

fn show(counts: &[u64; 3]) -> String {
    format!(
        "{} total → {} matched -> {} fully matched",
        counts[0], counts[1], counts[2]
    )
}

/// The kind of node a plan line shows: its name, and its mode where it has one
/// (`AggregateExec mode=Partial`); flumen's operator lines are [`OPERATOR_LINE`].
fn node_kind(line: &str) -> String {
    let start = line
        .trim_start_matches(|c: char| {
            c == '|' || c == '-' || c.is_whitespace() || c.is_ascii_digit() || c == ')'
        })
        .trim_start_matches("<slt:ignore>");
    let name = start.split(':').next().unwrap_or_default().trim();
    match start.split_once("mode=") {
        Some((_, rest)) if !name.starts_with(OPERATOR_LINE) => {
            let mode: String = rest.chars().take_while(|c| c.is_alphanumeric()).collect();
            format!("{name} mode={mode}")
        }
        _ => name.to_string(),
    }
}

/// The inside of every `metrics=[...]` in `text`.
fn metric_lists(text: &str) -> Vec<&str> {
    let mut lists = vec![];
    let mut rest = text;
    while let Some(start) = rest.find("metrics=[") {
        let after = &rest[start + "metrics=[".len()..];
        let end = after.find(']').unwrap_or(after.len());
        lists.push(&after[..end]);
        rest = &after[end..];
    }
    lists
}

/// `N total → M matched[ -> K fully matched]` as `[N, M, K]`.
fn pruning_counts(value: &str) -> Option<[u64; 3]> {
    let number = |s: &str| s.split_whitespace().next()?.parse::<u64>().ok();
    let (total, rest) = value.split_once(" total → ")?;
    let (matched, fully) = match rest.split_once(" -> ") {
        Some((m, f)) => (m, number(f)?),
        None => (rest, 0),
    };
    Some([number(total)?, number(matched)?, fully])
}
