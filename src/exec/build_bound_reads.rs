//! The driver's side of a worker-mode join's empty build side
//! ([`crate::plan::build_bounds`]): the scans that read the join's filter wait until its
//! build producer is complete; if that left no row, the run's bounds rule every probe row
//! out, and the probe splits launched after are not sent. Settled as the scheduler notices
//! the producer complete, under the run's lock.

use crate::exec::metrics::OperatorStats;
use crate::exec::run::QueryRun;
use crate::exec::state::{BuildBoundState, RunState};
use crate::plan::build_bounds::empty_build_side;
use crate::plan::graph::OperatorId;
use crate::plan::task_bounds::MadeBound;

impl QueryRun {
    /// Whether every join whose filter `op`'s scans read has its build side settled (until
    /// then `op` starts no task).
    pub(super) fn build_bounds_settled(&self, st: &RunState, op: OperatorId) -> bool {
        (self.graph.build_bounds.iter().zip(&st.build_bounds)).all(|(bound, state)| {
            *state == BuildBoundState::Settled || !bound.readers.contains(&op)
        })
    }

    /// Settle the build bounds whose build producer is now complete: `false` in the run's
    /// bounds where its blocks hold no row; their scans may then start.
    pub(super) fn settle_build_bounds(&self, st: &mut RunState) {
        for (i, bound) in self.graph.build_bounds.iter().enumerate() {
            if st.build_bounds[i] == BuildBoundState::Settled
                || !st.operators[bound.build_producer].complete
            {
                continue;
            }
            // Every block it made, read and released or not (a join may have read some).
            let rows: usize = (st.blocks.values())
                .filter(|b| b.operator == bound.build_producer)
                .map(|b| b.rows)
                .sum();
            if rows == 0 {
                self.bounds.add([MadeBound {
                    filter: bound.filter,
                    columns: bound.probe_keys.clone(),
                    value: empty_build_side(),
                }]);
                for reader in &bound.readers {
                    OperatorStats::add(&self.stats(*reader).empty_build_sides, 1);
                }
            }
            st.build_bounds[i] = BuildBoundState::Settled;
        }
    }
}
