//! The rules that may hold an operator's next task back, one small value each, and the
//! list each execution mode asks in order (as Ray Data's backpressure policies, or
//! DataFusion's physical optimizer rules). [`QueryRun::pick_launches`] asks the list once
//! a slot is free for an operator with a task ready: the first rule that holds it back
//! says why it waits. The numbers behind each rule are plain functions of
//! [`super::policy`].
//!
//! | mode | rules, in order |
//! |---|---|
//! | `streaming` | [`PausedTasksFirst`], [`Backpressure`] |
//! | `static` | [`PausedTasksFirst`], [`StaticSlots`], [`Backpressure`] |
//! | `batch` | [`PausedTasksFirst`], [`OneOperatorAtATime`] |

use crate::exec::policy::ModePolicy;
use crate::exec::run::QueryRun;
use crate::exec::state::RunState;
use crate::plan::graph::Operator;

/// A rule that may hold an operator's next task back.
pub(super) trait LaunchRule: Sync {
    /// Whether `op` starts no new task now.
    fn holds_back(&self, run: &QueryRun, st: &RunState, op: &Operator) -> bool;

    /// Whether the time this rule holds an operator back counts as its backpressure
    /// (`backpressure_ns` in `EXPLAIN ANALYZE`).
    fn is_backpressure(&self) -> bool {
        false
    }
}

/// An operator whose running tasks paused (their reader fell behind) resumes them before
/// it starts another: a new task would only add to the output nobody reads yet.
pub(super) struct PausedTasksFirst;

impl LaunchRule for PausedTasksFirst {
    fn holds_back(&self, _: &QueryRun, st: &RunState, op: &Operator) -> bool {
        !st.operators[op.id].paused.is_empty()
    }
}

/// `flumen.mode = 'static'`: an operator runs at most its fixed share of its pool's slots
/// ([`super::policy::static_slots`]), as fixed pools of tasks per operator would. A gang
/// (whose tasks must all run at once) is not held to it.
pub(super) struct StaticSlots;

impl LaunchRule for StaticSlots {
    fn holds_back(&self, run: &QueryRun, st: &RunState, op: &Operator) -> bool {
        !op.gang && st.operators[op.id].running >= run.static_slots[op.id]
    }
}

/// `flumen.mode = 'batch'`: one operator runs at a time (stage by stage, as Spark or Ray
/// Data's bulk executor), so no backpressure is needed.
pub(super) struct OneOperatorAtATime;

impl LaunchRule for OneOperatorAtATime {
    fn holds_back(&self, _: &QueryRun, st: &RunState, op: &Operator) -> bool {
        st.operators
            .iter()
            .enumerate()
            .any(|(i, o)| i != op.id && o.running > 0)
    }
}

/// A producer waits while its reader's queue is full, its unread output is over its share
/// of the budget, or the store's memory is full ([`QueryRun::backpressured`]), so memory
/// follows the pipeline's slowest stage, not the table's size.
pub(super) struct Backpressure;

impl LaunchRule for Backpressure {
    fn holds_back(&self, run: &QueryRun, st: &RunState, op: &Operator) -> bool {
        run.backpressured(st, op.id)
    }

    fn is_backpressure(&self) -> bool {
        true
    }
}

/// `flumen.mode = 'streaming'` (the default): operators run at once, held back by their
/// readers.
const STREAMING: &[&dyn LaunchRule] = &[&PausedTasksFirst, &Backpressure];
/// `flumen.mode = 'static'`: as streaming, each operator within its fixed slots.
const STATIC: &[&dyn LaunchRule] = &[&PausedTasksFirst, &StaticSlots, &Backpressure];
/// `flumen.mode = 'batch'`: one operator at a time. (Its tasks never pause: the first rule
/// holds nothing back there, and is kept so every mode asks it.)
const BATCH: &[&dyn LaunchRule] = &[&PausedTasksFirst, &OneOperatorAtATime];

/// The rules `mode` asks, in order.
pub(super) fn launch_rules(mode: ModePolicy) -> &'static [&'static dyn LaunchRule] {
    if mode.one_operator_at_a_time() {
        BATCH
    } else if mode.fixed_slots() {
        STATIC
    } else {
        STREAMING
    }
}
