//! The keys of a join's build side, summed up where its blocks are made: each key's least
//! and greatest value and, for a few, their list, and a set of them all
//! ([`crate::plan::key_membership`]) ([`KeySummary`]); the summaries of its tasks merged
//! give the bound its probe side's scans start from ([`crate::plan::build_bounds`]).
//!
//! A worker summarizes the output of a build producer's task as it cuts its blocks and
//! sends the summary with the task's end ([`crate::cluster::sent_keys`]), so the driver
//! only merges a few values per task: reading the build blocks on the driver to make the
//! bound cost more than the bound saved (`docs/benchmarks.md`).

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::arrow::array::Array;
use datafusion::arrow::datatypes::{Field, Schema};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::ScalarValue;
use datafusion::error::Result;
use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use datafusion::logical_expr::{Accumulator, EmitTo, Operator as BinaryOp};
use datafusion::physical_expr::expressions::{BinaryExpr, in_list, lit};
use datafusion::physical_plan::PhysicalExpr;
use datafusion::physical_plan::aggregates::group_values::{GroupValues, new_group_values};
use datafusion::physical_plan::aggregates::order::GroupOrdering;

use crate::plan::key_membership::{KeyMembership, KeysInSet, MAX_DENSITY, MembershipSummer};

/// Most distinct values of a key listed in its bound (`key IN (...)`); a key with more has
/// its range only.
pub const MAX_LISTED_KEYS: usize = 4096;

/// What is known of one key's values (NULLs left out: they match nothing).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRange {
    /// The least value; `None` before any.
    pub min: Option<ScalarValue>,
    /// The greatest value; `None` before any.
    pub max: Option<ScalarValue>,
    /// Every distinct value while there are at most [`MAX_LISTED_KEYS`]; `None` beyond.
    pub values: Option<HashSet<ScalarValue>>,
}

impl Default for KeyRange {
    fn default() -> Self {
        KeyRange {
            min: None,
            max: None,
            values: Some(HashSet::new()),
        }
    }
}

impl KeyRange {
    /// Widen the range to take `min` and `max` in (NULLs count as none).
    fn widen(&mut self, min: Option<ScalarValue>, max: Option<ScalarValue>) {
        // The smaller (`smaller`) or the larger of two values, a missing or NULL one left out.
        let pick = |a: Option<ScalarValue>, b: Option<ScalarValue>, smaller: bool| match (a, b) {
            (Some(a), Some(b)) if !a.is_null() && !b.is_null() => {
                let keep_a = a.partial_cmp(&b).is_some_and(|o| o.is_le() == smaller);
                Some(if keep_a { a } else { b })
            }
            (a, b) => [a, b].into_iter().flatten().find(|v| !v.is_null()),
        };
        self.min = pick(self.min.take(), min, true);
        self.max = pick(self.max.take(), max, false);
    }

    /// Take `other` in: the range of both, and the list of both while short enough.
    fn merge(&mut self, other: KeyRange) {
        self.widen(other.min, other.max);
        self.values = match (self.values.take(), other.values) {
            (Some(mut a), Some(b)) => {
                a.extend(b);
                (a.len() <= MAX_LISTED_KEYS).then_some(a)
            }
            _ => None,
        };
    }
}

/// What is known of a build side's keys: one [`KeyRange`] per join key, in the join's order,
/// and the set of the keys together.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KeySummary {
    /// Each key's range and list.
    pub keys: Vec<KeyRange>,
    /// The set of the rows' keys (rows with a NULL key left out); `None`: not known.
    pub membership: Option<KeyMembership>,
}

impl KeySummary {
    /// An empty summary of `keys` keys (no row seen).
    pub fn new(keys: usize) -> Self {
        KeySummary {
            keys: vec![KeyRange::default(); keys],
            membership: Some(KeyMembership::empty()),
        }
    }

    /// Take another task's summary of the same keys in.
    pub fn merge(&mut self, other: KeySummary) {
        for (mine, theirs) in self.keys.iter_mut().zip(other.keys) {
            mine.merge(theirs);
        }
        self.membership = match (self.membership.take(), other.membership) {
            (Some(mine), Some(theirs)) => Some(mine.union(theirs)),
            _ => None,
        };
    }

    /// The set of keys its bound tests probe rows against: where no key is listed (a list
    /// is exact) and the set is sparse enough to rule out most other keys.
    pub fn membership_used(&self) -> Option<&KeyMembership> {
        (self.membership.as_ref()).filter(|set| !self.listed() && set.density() <= MAX_DENSITY)
    }

    /// Whether some key's values are listed (at most [`MAX_LISTED_KEYS`]): its bound is
    /// then selective (one value: its range is that value).
    pub fn listed(&self) -> bool {
        self.keys.iter().any(|k| k.values.is_some())
    }

    /// The bound a probe row must meet to match a build row so summed up, on `probe_keys`
    /// (the join's probe-side keys, in the order of the summary's, reading `probe_schema`):
    /// each key between its least and greatest value, and in its list where it has one,
    /// the keys in their set where it is used ([`Self::membership_used`]); `false` when no
    /// build row has a key without NULL.
    pub fn bound(
        &self,
        probe_keys: &[Arc<dyn PhysicalExpr>],
        probe_schema: &Schema,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let mut terms: Vec<Arc<dyn PhysicalExpr>> = vec![];
        for (range, probe_key) in self.keys.iter().zip(probe_keys) {
            let (Some(min), Some(max)) = (&range.min, &range.max) else {
                return Ok(lit(false));
            };
            // The join's keys have one type on both sides; a probe key of another would
            // compare wrongly.
            let probe_type = probe_key.data_type(probe_schema)?;
            if min.data_type() != probe_type {
                return Err(datafusion::error::DataFusionError::Plan(format!(
                    "a build key of type {} against a probe key of type {probe_type}",
                    min.data_type()
                )));
            }
            let compare = |op, value: &ScalarValue| -> Arc<dyn PhysicalExpr> {
                Arc::new(BinaryExpr::new(
                    Arc::clone(probe_key),
                    op,
                    lit(value.clone()),
                ))
            };
            terms.push(compare(BinaryOp::GtEq, min));
            terms.push(compare(BinaryOp::LtEq, max));
            // One value: the range says it all.
            if let Some(listed) = range.values.as_ref().filter(|v| v.len() > 1) {
                let mut list: Vec<ScalarValue> = listed.iter().cloned().collect();
                list.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
                let list = list.into_iter().map(lit).collect();
                terms.push(in_list(Arc::clone(probe_key), list, &false, probe_schema)?);
            }
        }
        if let Some(set) = self.membership_used() {
            let set = Arc::new(set.clone());
            terms.push(Arc::new(KeysInSet::new(probe_keys.to_vec(), set)));
        }
        Ok((terms.into_iter())
            .reduce(|a, b| Arc::new(BinaryExpr::new(a, BinaryOp::And, b)) as _)
            .unwrap_or_else(|| lit(true)))
    }
}

/// A task's keys summed up as its blocks are made (on its worker): each key's least and
/// greatest value by DataFusion's `min` and `max`, and its distinct values by the hash
/// aggregate's group table, both a batch at a time, until there are more than
/// [`MAX_LISTED_KEYS`], and the keys' set; [`KeySummer::finish`] gives the [`KeySummary`].
pub struct KeySummer {
    /// The keys, over the task's output columns.
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    /// Per key, what has been counted in.
    keys: Vec<KeySums>,
    /// The set of the keys and how many tasks its producer has (its size is made for
    /// them all); `None`: no set is made.
    membership: Option<(MembershipSummer, usize)>,
}

/// One key's sums in a [`KeySummer`].
struct KeySums {
    min: MinAccumulator,
    max: MaxAccumulator,
    /// Its distinct values (and NULL) while few enough.
    listed: Option<Box<dyn GroupValues>>,
}

impl KeySummer {
    /// A summer of `exprs` (one per key), which read batches of `schema`, making their set
    /// for a producer of `set_for_tasks` tasks (`0`: no set).
    pub fn new(
        exprs: Vec<Arc<dyn PhysicalExpr>>,
        schema: &Schema,
        set_for_tasks: usize,
    ) -> Result<Self> {
        let keys = (exprs.iter())
            .map(|expr| {
                let data_type = expr.data_type(schema)?;
                let field = Field::new("key", data_type.clone(), true);
                let listed =
                    new_group_values(Arc::new(Schema::new(vec![field])), &GroupOrdering::None)?;
                Ok(KeySums {
                    min: MinAccumulator::try_new(&data_type)?,
                    max: MaxAccumulator::try_new(&data_type)?,
                    listed: Some(listed),
                })
            })
            .collect::<Result<_>>()?;
        let membership = (set_for_tasks > 0).then(|| (MembershipSummer::default(), set_for_tasks));
        Ok(KeySummer {
            exprs,
            keys,
            membership,
        })
    }

    /// Count the keys of `batch` in.
    pub fn observe(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let mut groups = vec![];
        let mut columns = Vec::with_capacity(self.exprs.len());
        for (expr, KeySums { min, max, listed }) in self.exprs.iter().zip(&mut self.keys) {
            let values = expr.evaluate(batch)?.into_array(batch.num_rows())?;
            columns.push(Arc::clone(&values));
            min.update_batch(std::slice::from_ref(&values))?;
            max.update_batch(std::slice::from_ref(&values))?;
            if let Some(table) = listed {
                table.intern(std::slice::from_ref(&values), &mut groups)?;
                // A NULL is a group of its own there, and matches nothing.
                if table.len() > MAX_LISTED_KEYS + 1 {
                    *listed = None;
                }
            }
        }
        if let Some((set, tasks)) = &mut self.membership {
            set.observe(&columns)?;
            // Too many keys for a set its join would use: no set (nor its cost) then.
            if set.past_use(*tasks) {
                self.membership = None;
            }
        }
        Ok(())
    }

    /// What the batches counted in tell of the keys.
    pub fn finish(self) -> Result<KeySummary> {
        let mut keys = Vec::with_capacity(self.keys.len());
        let membership = (self.membership).map(|(set, tasks)| set.finish(tasks));
        for KeySums {
            mut min,
            mut max,
            listed,
        } in self.keys
        {
            let values = match listed {
                Some(mut table) => {
                    let mut distinct = HashSet::with_capacity(table.len());
                    for column in table.emit(EmitTo::All)? {
                        for row in (0..column.len()).filter(|row| column.is_valid(*row)) {
                            distinct.insert(ScalarValue::try_from_array(&column, row)?);
                        }
                    }
                    (distinct.len() <= MAX_LISTED_KEYS).then_some(distinct)
                }
                None => None,
            };
            let mut range = KeyRange {
                values,
                ..KeyRange::default()
            };
            range.widen(Some(min.evaluate()?), Some(max.evaluate()?));
            keys.push(range);
        }
        Ok(KeySummary { keys, membership })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::{BooleanArray, Int64Array, StringArray};
    use datafusion::arrow::datatypes::DataType;
    use datafusion::physical_expr::expressions::col;

    /// The summary of `batches`' keys `keys` (one task's output).
    fn summed(keys: &[Arc<dyn PhysicalExpr>], batches: &[RecordBatch]) -> KeySummary {
        let mut summer = KeySummer::new(keys.to_vec(), &batches[0].schema(), 1).unwrap();
        for batch in batches {
            summer.observe(batch).unwrap();
        }
        summer.finish().unwrap()
    }

    fn ints(schema: &Schema, v: Vec<Option<i64>>) -> RecordBatch {
        RecordBatch::try_new(
            Arc::new(schema.clone()),
            vec![Arc::new(Int64Array::from(v))],
        )
        .unwrap()
    }

    /// Which rows of `batch` `bound` keeps (a NULL answer keeps none).
    fn kept(bound: &Arc<dyn PhysicalExpr>, batch: &RecordBatch) -> Vec<bool> {
        let passed = bound.evaluate(batch).unwrap();
        let passed = passed.into_array(batch.num_rows()).unwrap();
        let passed = passed.as_any().downcast_ref::<BooleanArray>().unwrap();
        (0..batch.num_rows())
            .map(|i| passed.is_valid(i) && passed.value(i))
            .collect()
    }

    #[test]
    fn two_tasks_summaries_merged_bound_the_probe_key_by_range_and_list() {
        let build = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        let probe = Schema::new(vec![Field::new("p", DataType::Int64, true)]);
        let keys = [col("k", &build).unwrap()];
        let mut first = summed(&keys, &[ints(&build, vec![Some(7), None, Some(3)])]);
        let second = summed(
            &keys,
            &[ints(&build, vec![Some(7)]), ints(&build, vec![Some(12)])],
        );
        first.merge(second);
        let bound = first.bound(&[col("p", &probe).unwrap()], &probe).unwrap();
        assert_eq!(
            bound.to_string(),
            "p@0 >= 3 AND p@0 <= 12 AND p@0 IN (SET) ([3, 7, 12])"
        );
        // 3, 7 and 12 pass; 4 (in the range, not the list), 2 and NULL do not.
        let probe_rows = ints(
            &probe,
            vec![Some(3), Some(4), Some(7), Some(2), Some(12), None],
        );
        assert_eq!(
            kept(&bound, &probe_rows),
            vec![true, false, true, false, true, false]
        );
    }

    #[test]
    fn no_key_passes_nothing_and_many_keys_give_their_range_and_set() {
        let build = Schema::new(vec![Field::new("s", DataType::Utf8, true)]);
        let probe = Schema::new(vec![Field::new("p", DataType::Utf8, true)]);
        let keys = [col("s", &build).unwrap()];
        let probe_keys = [col("p", &probe).unwrap()];
        let strings = |v: Vec<Option<String>>| {
            RecordBatch::try_new(
                Arc::new(build.clone()),
                vec![Arc::new(StringArray::from(v))],
            )
            .unwrap()
        };
        let nulls = summed(&keys, &[strings(vec![None, None])]);
        assert_eq!(nulls.keys[0].values, Some(HashSet::new()));
        assert_eq!(
            nulls.bound(&probe_keys, &probe).unwrap().to_string(),
            "false"
        );
        let nothing = KeySummary::new(1);
        assert_eq!(
            nothing.bound(&probe_keys, &probe).unwrap().to_string(),
            "false"
        );
        // Half the keys in each of two tasks: each lists its own, merged they are too many.
        let half = MAX_LISTED_KEYS / 2 + 1;
        let named =
            |range: std::ops::Range<usize>| range.map(|i| Some(format!("k{i:05}"))).collect();
        let mut first = summed(&keys, &[strings(named(0..half))]);
        let second = summed(&keys, &[strings(named(half..2 * half))]);
        assert!(first.keys[0].values.is_some() && second.keys[0].values.is_some());
        first.merge(second);
        let bound = first.bound(&probe_keys, &probe).unwrap();
        // Too many to list: their range, and the test of their set (each task's made for a
        // producer of one task: 2,049 keys at 16 bits each, the least size, 65,536 bits).
        assert_eq!(
            bound.to_string(),
            format!(
                "p@0 >= k00000 AND p@0 <= k{:05} AND keys_in_set(p@0; 65536 bits)",
                2 * half - 1
            )
        );
        // In the range and the set, out of the range, in the range but not put in.
        let probe_rows = RecordBatch::try_new(
            Arc::new(probe.clone()),
            vec![Arc::new(StringArray::from(vec![
                "k00007", "k99999", "k00007x",
            ]))],
        )
        .unwrap();
        assert_eq!(kept(&bound, &probe_rows), vec![true, false, false]);
        // With no set (a worker that made none), the range alone.
        first.membership = None;
        assert_eq!(
            first.bound(&probe_keys, &probe).unwrap().to_string(),
            format!("p@0 >= k00000 AND p@0 <= k{:05}", 2 * half - 1)
        );
    }

    #[test]
    fn a_task_with_too_many_keys_for_a_set_sends_none_and_its_join_uses_none() {
        let build = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        let keys = [col("k", &build).unwrap()];
        let rows = ints(&build, (0..100_000).map(Some).collect());
        // 100,000 keys a task: a set for 4 tasks, none for 32 (3.2M keys in all).
        let summary_for = |tasks| {
            let mut summer = KeySummer::new(keys.to_vec(), &build, tasks).unwrap();
            summer.observe(&rows).unwrap();
            summer.finish().unwrap()
        };
        let mut few = summary_for(4);
        assert!(few.membership_used().is_some());
        let many = summary_for(32);
        assert_eq!(many.membership, None);
        assert_eq!(many.keys[0].max, Some(ScalarValue::Int64(Some(99_999))));
        // One task without a set: the merged summary has none (a part of the keys' set
        // would rule out the others').
        few.merge(many);
        assert_eq!(few.membership, None);
    }

    #[test]
    fn an_empty_task_merged_in_changes_nothing() {
        let build = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        let keys = [col("k", &build).unwrap()];
        let mut seen = summed(&keys, &[ints(&build, vec![Some(5), Some(9)])]);
        let before = seen.clone();
        seen.merge(KeySummary::new(1));
        assert_eq!(seen, before);
        let mut empty = KeySummary::new(1);
        empty.merge(before.clone());
        assert_eq!(empty, before);
    }

    #[test]
    fn a_task_lists_few_keys_over_many_rows_and_gives_up_past_the_limit() {
        let build = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        let keys = [col("k", &build).unwrap()];
        // 40,000 rows in 5 blocks, 3,000 distinct keys (and NULLs): all listed.
        let block = |b: i64| {
            ints(
                &build,
                (0..8_000)
                    .map(|i| (i % 7 != 0).then_some((b * 8_000 + i) % 3_000))
                    .collect(),
            )
        };
        let few = summed(&keys, &(0..5).map(block).collect::<Vec<_>>());
        let listed = few.keys[0].values.as_ref().unwrap();
        assert_eq!(listed.len(), 3_000);
        assert_eq!(few.keys[0].min, Some(ScalarValue::Int64(Some(0))));
        assert_eq!(few.keys[0].max, Some(ScalarValue::Int64(Some(2_999))));
        assert!(few.listed());
        // One more distinct key than the limit: the range only.
        let many = summed(
            &keys,
            &[ints(
                &build,
                (0..=MAX_LISTED_KEYS as i64).map(Some).collect(),
            )],
        );
        assert_eq!(many.keys[0].values, None);
        assert!(!many.listed());
        assert_eq!(
            many.keys[0].max,
            Some(ScalarValue::Int64(Some(MAX_LISTED_KEYS as i64)))
        );
    }
}
