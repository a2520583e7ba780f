//! The driver's side of a join's bound from its build side ([`crate::plan::build_bounds`]):
//! the build producer's tasks sum up their keys (a worker's task is asked to, and sends
//! its summary with its end; a task in this process sums them up as its batches come out);
//! the scans that read the join's filter wait until the producer is complete, when the
//! summaries merged make the bound the run's bounds get (`false` for no row). Settled as
//! the scheduler notices the producer complete, under the run's lock.

use datafusion::arrow::datatypes::Schema;

use crate::cluster::sent_keys::{SentKeys, encode_keys};
use crate::exec::metrics::OperatorStats;
use crate::exec::run::QueryRun;
use crate::exec::state::{BuildBoundState, RowDrops, RunState};
use crate::exec::task_kind::TaskId;
use crate::plan::build_bounds::{BuildBound, DroppingBy, empty_build_side};
use crate::plan::build_keys::{KeySummary, KeySummer};
use crate::plan::graph::{OperatorId, TaskShape};
use crate::plan::task_bounds::MadeBound;

impl QueryRun {
    /// Whether every join whose filter `op`'s scans read has its build side settled (until
    /// then `op` starts no task).
    pub(super) fn build_bounds_settled(&self, st: &RunState, op: OperatorId) -> bool {
        (self.graph.build_bounds.iter().zip(&st.build_bounds)).all(|(bound, state)| {
            matches!(state, BuildBoundState::Settled { .. }) || !bound.readers.contains(&op)
        })
    }

    /// The filters whose bound from a build side the run holds and `op`'s scans read, by
    /// which of their splits drop the rows they reject.
    pub(super) fn build_bounds_made_for(&self, op: OperatorId) -> DroppingBy {
        let st = self.state.lock().unwrap();
        let mut dropping = DroppingBy::default();
        for (bound, state) in self.graph.build_bounds.iter().zip(&st.build_bounds) {
            let BuildBoundState::Settled { drops } = state else {
                continue;
            };
            if !bound.readers.contains(&op) || *drops == RowDrops::None {
                continue;
            }
            dropping.under_grouping.insert(bound.filter);
            if *drops == RowDrops::Everywhere {
                dropping.everywhere.insert(bound.filter);
            }
        }
        dropping
    }

    /// The join whose build keys the tasks of `op` sum up, and how many tasks `op` has, for
    /// which each task sizes the set of its keys (`0`, no set: `flumen.build_key_sets`
    /// off): the first join `op` is the build producer of; none where it is none's, or
    /// `flumen.build_key_bounds` is off.
    fn keys_summed_by(&self, op: OperatorId) -> Option<(&BuildBound, usize)> {
        if !self.config().build_key_bounds {
            return None;
        }
        let bound = self.key_bound_of(op)?;
        let producer = &self.graph.operators[op];
        let tasks = match producer.shape {
            TaskShape::Source => producer.splits.iter().sum(),
            TaskShape::BlockWise | TaskShape::Barrier => producer.partitions(),
        };
        let set_for = match self.config().build_key_sets {
            true => tasks.max(1),
            false => 0,
        };
        Some((bound, set_for))
    }

    /// The build keys a worker's task of `op` sums up, encoded for its request, and the
    /// task count its set is sized for ([`Self::keys_summed_by`]; none, `0`: no summary).
    pub(super) fn build_keys_sent(&self, op: OperatorId) -> (Vec<Vec<u8>>, usize) {
        let Some((bound, set_for)) = self.keys_summed_by(op) else {
            return (vec![], 0);
        };
        match encode_keys(&bound.build_keys) {
            Ok(keys) => (keys, set_for),
            Err(e) => {
                log::info!("operator {op}'s build keys are not summed up: {e}");
                (vec![], 0)
            }
        }
    }

    /// What sums up the keys of a task of `op` run in this process, as its batches
    /// (`schema`) come out ([`Self::keys_summed_by`]); `None` where none are summed up, or
    /// the keys cannot be (a key type without an order: its join goes without a bound).
    pub(super) fn key_summer(&self, op: OperatorId, schema: &Schema) -> Option<KeySummer> {
        let (bound, set_for) = self.keys_summed_by(op)?;
        KeySummer::new(bound.build_keys.clone(), schema, set_for)
            .inspect_err(|e| log::info!("operator {op}'s build keys are not summed up: {e}"))
            .ok()
    }

    /// The join whose keys a task of `op` sums up ([`Self::build_keys_sent`]).
    fn key_bound_of(&self, op: OperatorId) -> Option<&BuildBound> {
        (self.graph.build_bounds.iter())
            .find(|bound| bound.build_producer == op && !bound.build_keys.is_empty())
    }

    /// Keep the summary of its output's keys that task `task` made in this process.
    pub(super) fn keep_key_summary(&self, task: TaskId, summer: KeySummer, describe: &str) {
        match summer.finish() {
            Ok(summary) => self.state.lock().unwrap().tasks[task].build_keys = Some(summary),
            Err(e) => log::info!("{describe}: its build keys are not summed up: {e}"),
        }
    }

    /// Keep the summary of its output's keys that task `task`'s worker sent.
    pub(super) fn keep_build_keys(&self, task: TaskId, sent: &SentKeys, describe: &str) {
        match sent.summary() {
            Ok(summary) => self.state.lock().unwrap().tasks[task].build_keys = Some(summary),
            Err(e) => log::warn!("{describe}: the summary of its keys is left out: {e}"),
        }
    }

    /// Settle the build bounds whose build producer is now complete: their bound in the
    /// run's bounds (its tasks' summaries merged; `false` where its blocks hold no row);
    /// their scans may then start.
    pub(super) fn settle_build_bounds(&self, st: &mut RunState) {
        for (i, bound) in self.graph.build_bounds.iter().enumerate() {
            if st.build_bounds[i] != BuildBoundState::Waiting
                || !st.operators[bound.build_producer].complete
            {
                continue;
            }
            let sets = self.config().build_key_sets;
            let (value, drops) =
                match build_side_keys(st, bound, self.key_bound_of(bound.build_producer)) {
                    BuildSide::Empty => (Some(empty_build_side()), RowDrops::Everywhere),
                    BuildSide::Summed(mut summary) => {
                        if !sets {
                            summary.membership = None;
                        }
                        let drops = match (summary.listed(), summary.membership_used()) {
                            (true, _) if !sets => RowDrops::UnderGrouping,
                            (true, _) | (false, Some(_)) => RowDrops::Everywhere,
                            (false, None) => RowDrops::None,
                        };
                        match summary.bound(&bound.probe_keys, &bound.probe_schema) {
                            Ok(value) => (Some(value), drops),
                            Err(e) => {
                                log::info!("a join's bound from its build side is left out: {e}");
                                (None, RowDrops::None)
                            }
                        }
                    }
                    BuildSide::Unknown => (None, RowDrops::None),
                };
            if let Some(value) = value {
                let empty = value.as_ref() == empty_build_side().as_ref();
                self.bounds.add([MadeBound {
                    filter: bound.filter,
                    columns: bound.probe_keys.clone(),
                    value,
                }]);
                for reader in &bound.readers {
                    let stats = self.stats(*reader);
                    OperatorStats::add(&stats.bounds_from_build_sides, 1);
                    if empty {
                        OperatorStats::add(&stats.empty_build_sides, 1);
                    }
                }
            }
            st.build_bounds[i] = BuildBoundState::Settled { drops };
        }
    }
}

/// What a complete build producer's tasks tell of its keys.
enum BuildSide {
    /// Its blocks hold no row.
    Empty,
    /// Every task with rows sent a summary: here merged.
    Summed(KeySummary),
    /// Some task with rows sent none.
    Unknown,
}

/// What `bound`'s build producer's tasks tell of its keys, where they summed up those of
/// `summed` (the join whose keys its workers were asked for).
fn build_side_keys(st: &RunState, bound: &BuildBound, summed: Option<&BuildBound>) -> BuildSide {
    let rows_of = |outputs: &[crate::store::block::BlockId]| -> usize {
        outputs
            .iter()
            .filter_map(|id| st.blocks.get(id))
            .map(|b| b.rows)
            .sum()
    };
    let mut merged = KeySummary::new(bound.build_keys.len());
    let mut any_rows = false;
    let mut unknown = false;
    for task in st
        .tasks
        .iter()
        .filter(|t| t.operator == bound.build_producer)
    {
        // Every block it made, read and released or not (a join may have read some).
        if rows_of(&task.outputs) == 0 {
            continue;
        }
        any_rows = true;
        match &task.build_keys {
            Some(summary) if summed.is_some_and(|s| s.filter == bound.filter) => {
                merged.merge(summary.clone());
            }
            _ => unknown = true,
        }
    }
    match (any_rows, unknown) {
        (false, _) => BuildSide::Empty,
        (true, false) => BuildSide::Summed(merged),
        (true, true) => BuildSide::Unknown,
    }
}
