//! The driver's side of a worker-mode join's bound from its build side
//! ([`crate::plan::build_bounds`]): the build producer's tasks are asked for a summary of
//! their keys, which each worker sends with its task's end; the scans that read the join's
//! filter wait until the producer is complete, when the summaries merged make the bound
//! the run's bounds get (`false` for no row). Settled as the scheduler notices the producer
//! complete, under the run's lock.

use std::collections::HashSet;

use crate::cluster::sent_keys::{SentKeys, encode_keys};
use crate::exec::metrics::OperatorStats;
use crate::exec::run::QueryRun;
use crate::exec::state::{BuildBoundState, RowDrops, RunState};
use crate::exec::task_kind::TaskId;
use crate::plan::build_bounds::{BuildBound, empty_build_side};
use crate::plan::build_keys::KeySummary;
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

    /// The build keys a worker's task of `op` sums up, encoded for its request: those of the
    /// first join `op` is the build producer of (none where it is none's, or
    /// `flumen.build_key_bounds` is off); and how many tasks `op` has, for which the worker
    /// sizes the set of its keys (`0`, no set: `flumen.build_key_sets` off).
    pub(super) fn build_keys_sent(&self, op: OperatorId) -> (Vec<Vec<u8>>, usize) {
        if !self.config().build_key_bounds {
            return (vec![], 0);
        }
        let Some(bound) = self.key_bound_of(op) else {
            return (vec![], 0);
        };
        let keys = encode_keys(&bound.build_keys).unwrap_or_else(|e| {
            log::info!("operator {op}'s build keys are not summed up: {e}");
            vec![]
        });
        let producer = &self.graph.operators[op];
        let tasks = match producer.shape {
            TaskShape::Source => producer.splits.iter().sum(),
            TaskShape::BlockWise | TaskShape::Barrier => producer.partitions(),
        };
        let set_for = match self.config().build_key_sets {
            true => tasks.max(1),
            false => 0,
        };
        (keys, set_for)
    }

    /// The join whose keys a task of `op` sums up ([`Self::build_keys_sent`]).
    fn key_bound_of(&self, op: OperatorId) -> Option<&BuildBound> {
        (self.graph.build_bounds.iter())
            .find(|bound| bound.build_producer == op && !bound.build_keys.is_empty())
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

/// The join filters whose bound from a build side a scan's splits drop rows by
/// ([`QueryRun::build_bounds_made_for`]).
#[derive(Debug, Default, Clone)]
pub(super) struct DroppingBy {
    /// Those the splits under a grouped aggregate drop rows by.
    pub under_grouping: HashSet<u64>,
    /// Those every split drops rows by (among `under_grouping`).
    pub everywhere: HashSet<u64>,
}

impl DroppingBy {
    /// The filters a split drops rows by, where it is under a grouped aggregate or not.
    pub fn for_split(&self, under_grouping: bool) -> &HashSet<u64> {
        match under_grouping {
            true => &self.under_grouping,
            false => &self.everywhere,
        }
    }
}
