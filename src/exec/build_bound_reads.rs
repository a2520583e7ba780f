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
use crate::exec::state::{BuildBoundState, RunState};
use crate::exec::task_kind::TaskId;
use crate::plan::build_bounds::{BuildBound, empty_build_side};
use crate::plan::build_keys::KeySummary;
use crate::plan::graph::OperatorId;
use crate::plan::task_bounds::MadeBound;

impl QueryRun {
    /// Whether every join whose filter `op`'s scans read has its build side settled (until
    /// then `op` starts no task).
    pub(super) fn build_bounds_settled(&self, st: &RunState, op: OperatorId) -> bool {
        (self.graph.build_bounds.iter().zip(&st.build_bounds)).all(|(bound, state)| {
            matches!(state, BuildBoundState::Settled { .. }) || !bound.readers.contains(&op)
        })
    }

    /// The filters whose bound from a build side the run holds and `op`'s scans read: where
    /// a grouped aggregate reads such a scan, a worker's split drops the rows they reject.
    pub(super) fn build_bounds_made_for(&self, op: OperatorId) -> HashSet<u64> {
        let st = self.state.lock().unwrap();
        (self.graph.build_bounds.iter().zip(&st.build_bounds))
            .filter(|(bound, state)| {
                **state == BuildBoundState::Settled { drops_rows: true }
                    && bound.readers.contains(&op)
            })
            .map(|(bound, _)| bound.filter)
            .collect()
    }

    /// The build keys a worker's task of `op` sums up, encoded for its request: those of the
    /// first join `op` is the build producer of (none where it is none's, or
    /// `flumen.build_key_bounds` is off).
    pub(super) fn build_keys_sent(&self, op: OperatorId) -> Vec<Vec<u8>> {
        if !self.config().build_key_bounds {
            return vec![];
        }
        let Some(bound) = self.key_bound_of(op) else {
            return vec![];
        };
        encode_keys(&bound.build_keys).unwrap_or_else(|e| {
            log::info!("operator {op}'s build keys are not summed up: {e}");
            vec![]
        })
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
            let (value, drops_rows) =
                match build_side_keys(st, bound, self.key_bound_of(bound.build_producer)) {
                    BuildSide::Empty => (Some(empty_build_side()), true),
                    BuildSide::Summed(summary) => {
                        match summary.bound(&bound.probe_keys, &bound.probe_schema) {
                            Ok(value) => (Some(value), summary.listed()),
                            Err(e) => {
                                log::info!("a join's bound from its build side is left out: {e}");
                                (None, false)
                            }
                        }
                    }
                    BuildSide::Unknown => (None, false),
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
            st.build_bounds[i] = BuildBoundState::Settled { drops_rows };
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
