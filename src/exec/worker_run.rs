//! What one run keeps of its worker processes (`flumen.workers = 'process'`): the session's
//! pools, which tasks ran on a worker, the blocks lost with a worker and the workers whose
//! death the run has handled, the run's token on the workers, and the pools' counts when
//! the run began. In threads mode it holds no pool and stays empty.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use crate::cluster::worker_pool::{PoolSettings, WorkerPoolSlot};
use crate::exec::plan_checks::PlanCheck;
use crate::exec::task_kind::TaskId;
use crate::plan::graph::{OperatorId, Pool};
use crate::store::block::BlockId;

/// A run's side of its worker processes.
#[derive(Debug)]
pub(super) struct WorkerRun {
    /// The session's worker processes; `None` in threads mode.
    pub slot: Option<Arc<WorkerPoolSlot>>,
    /// Tasks that ran on a worker (run again, they run the plan their worker ran).
    pub ran_on_worker: Mutex<HashSet<TaskId>>,
    /// Per operator and task kind (source or not), the check that a worker decodes its
    /// task plan as planned, under way or done: a release build checks one task of each,
    /// which the others wait on; a debug build every task (`QueryRun::plan_check`).
    pub plan_checks: Mutex<HashMap<(OperatorId, bool), PlanCheck>>,
    /// Blocks lost with their worker and not yet made again.
    pub lost_blocks: Mutex<HashSet<BlockId>>,
    /// Workers (by [`crate::store::block::HeldBlock::holder_id`]) whose death this run has
    /// handled.
    pub dead_workers: Mutex<HashSet<u64>>,
    /// A random token naming this run to workers: the blocks its tasks leave there are kept
    /// under it, and released by it when the run ends.
    pub query_token: String,
    /// Each pool's restart count when this run first used it, and the latest seen.
    pub restarts: Mutex<HashMap<Pool, (u64, u64)>>,
    /// Each pool's `[lost, joined, rejoined]` counts when this run first used it.
    pub membership_seen: Mutex<HashMap<Pool, [u64; 3]>>,
    /// Where each pool's workers come from, as this run's settings say (made once).
    pub pool_settings: Mutex<HashMap<Pool, PoolSettings>>,
    /// The settings every task request carries (`admission::WORKER_OPTIONS` at this run's
    /// values), made at the first request: a run's settings do not change, and listing
    /// every setting as text per task was a share of the driver's time for small tasks.
    pub task_options: OnceLock<Vec<(String, String)>>,
}

impl WorkerRun {
    /// A run's side of `slot`'s workers (none in threads mode).
    pub fn new(slot: Option<Arc<WorkerPoolSlot>>) -> Self {
        Self {
            slot,
            ran_on_worker: Mutex::default(),
            plan_checks: Mutex::default(),
            lost_blocks: Mutex::default(),
            dead_workers: Mutex::default(),
            query_token: crate::cluster::auth::Secret::random().to_hex(),
            restarts: Mutex::default(),
            membership_seen: Mutex::default(),
            pool_settings: Mutex::default(),
            task_options: OnceLock::new(),
        }
    }

    /// Whether the run has worker processes.
    pub fn in_use(&self) -> bool {
        self.slot.is_some()
    }
}
