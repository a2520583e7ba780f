//! Why a task of a worker-mode query (`flumen.workers = 'process'`) ran on the driver.
//!
//! Each task that does not go to a worker says why, once, as an [`OnDriver`]: the
//! operator's counters show the count per reason in `EXPLAIN ANALYZE`
//! (`tasks_on_driver`, `tasks_on_driver.REASON`), and the session's [`DriverTasks`] keeps
//! every fallback with its detail, so a test can assert that nothing fell back unseen. Some reasons are the design of today ([`OnDriver::by_design`]); the others are
//! fallbacks, each a gap.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Why one task ran on the driver instead of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnDriver {
    /// A per-partition task workers do not run yet: a merge of a range's sorted runs, a
    /// task streaming its input (a limit, a window over the whole range-sorted table), or
    /// one whose fragment reads more than its stage inputs. Joins (a hot partition's slices
    /// too), final aggregates, sorts and windows over complete inputs go to the workers.
    PerPartition,
    /// A per-partition task that runs again after it was refused memory (on a worker or
    /// here): the driver runs it alone, then with sort-merge joins, under its whole budget.
    OutOfCore,
    /// Its source is data in the driver's memory, or no data at all (an in-memory table,
    /// `VALUES`, a one-row placeholder): no file to hand a worker.
    DriverData,
    /// Its source is a file scan not cut into source splits that a worker task cannot be
    /// cut from either: a format workers do not read, or several scans that no
    /// per-partition cut splits. An unsplit scan of Parquet, CSV, JSON, Avro or Arrow files
    /// goes to a worker one partition at a time.
    ScanNotSplit,
    /// It reads an object store whose credentials the session cannot hand to workers.
    StoreNotGranted,
    /// It runs again with its sorts in pieces (after a sort was refused memory), a setting
    /// of the driver's own task context.
    SortsInPieces,
    /// Its fragment is not one a worker task is cut from (a stage input with a limit, not
    /// exactly one stage input, more than one output partition).
    NotCut(String),
    /// A worker would refuse its plan (a node or scan workers do not run).
    Refused(String),
    /// datafusion-proto could not encode its plan.
    Unencodable(String),
    /// Its encoded plan does not decode.
    Undecodable(String),
    /// Its plan decodes to another plan (release builds; a debug build fails the task).
    DecodesDifferently(String),
}

impl OnDriver {
    /// The reason's short name, as `EXPLAIN ANALYZE` and tests key it.
    pub fn name(&self) -> &'static str {
        match self {
            OnDriver::PerPartition => "per_partition",
            OnDriver::OutOfCore => "out_of_core",
            OnDriver::DriverData => "driver_data",
            OnDriver::ScanNotSplit => "scan_not_split",
            OnDriver::StoreNotGranted => "store_not_granted",
            OnDriver::SortsInPieces => "sorts_in_pieces",
            OnDriver::NotCut(_) => "not_cut",
            OnDriver::Refused(_) => "refused",
            OnDriver::Unencodable(_) => "unencodable",
            OnDriver::Undecodable(_) => "undecodable",
            OnDriver::DecodesDifferently(_) => "decodes_differently",
        }
    }

    /// What exactly stopped it (the error's first line), where there is more to say than
    /// the name.
    pub fn detail(&self) -> &str {
        match self {
            OnDriver::NotCut(d)
            | OnDriver::Refused(d)
            | OnDriver::Unencodable(d)
            | OnDriver::Undecodable(d)
            | OnDriver::DecodesDifferently(d) => d.lines().next().unwrap_or_default(),
            _ => "",
        }
    }

    /// Whether the driver runs such tasks by design today (per-partition tasks, data that
    /// lives in the driver), not because something could not be sent.
    pub fn by_design(&self) -> bool {
        matches!(
            self,
            OnDriver::PerPartition | OnDriver::OutOfCore | OnDriver::DriverData
        )
    }
}

impl std::fmt::Display for OnDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.detail() {
            "" => f.write_str(self.name()),
            detail => write!(f, "{}: {detail}", self.name()),
        }
    }
}

/// A session's tasks that ran on the driver in worker mode, over every query of the
/// session: by design, count per reason; fallbacks, count per reason and detail.
#[derive(Debug, Default)]
pub struct DriverTasks {
    by_design: Mutex<BTreeMap<&'static str, u64>>,
    fallbacks: Mutex<BTreeMap<(&'static str, String), u64>>,
}

impl DriverTasks {
    /// Count one task that ran on the driver for `reason`.
    pub fn count(&self, reason: &OnDriver) {
        if reason.by_design() {
            *self
                .by_design
                .lock()
                .unwrap()
                .entry(reason.name())
                .or_default() += 1;
            return;
        }
        let key = (reason.name(), reason.detail().to_string());
        *self.fallbacks.lock().unwrap().entry(key).or_default() += 1;
    }

    /// Tasks the driver ran by design so far, per reason name.
    pub fn by_design(&self) -> BTreeMap<&'static str, u64> {
        self.by_design.lock().unwrap().clone()
    }

    /// Tasks that fell back to the driver so far, per (reason name, detail).
    pub fn fallbacks(&self) -> BTreeMap<(&'static str, String), u64> {
        self.fallbacks.lock().unwrap().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_reason_and_first_line_of_detail() {
        let tasks = DriverTasks::default();
        tasks.count(&OnDriver::PerPartition);
        tasks.count(&OnDriver::PerPartition);
        tasks.count(&OnDriver::Unencodable("no codec for X\nat line 3".into()));
        assert_eq!(tasks.by_design()["per_partition"], 2);
        let fallbacks = tasks.fallbacks();
        assert_eq!(fallbacks.len(), 1);
        assert_eq!(fallbacks[&("unencodable", "no codec for X".to_string())], 1);
        assert!(OnDriver::PerPartition.by_design());
        assert!(!OnDriver::ScanNotSplit.by_design());
        assert_eq!(
            OnDriver::Refused("a CSV scan".into()).to_string(),
            "refused: a CSV scan"
        );
    }
}
