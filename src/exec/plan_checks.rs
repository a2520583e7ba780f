//! The check that a worker decodes a task's plan as it was planned
//! ([`task_plan::check_round_trip`]), run beside the task instead of before it.
//!
//! The check (an encode, a decode and two plan texts) cost about 0.6 ms of a small query's
//! 6–7 ms when the driver ran it before sending the task. Now the task is sent at once and
//! the check runs on a blocking thread meanwhile; what the task hands back (its blocks, the
//! bounds it tightens) is held by a [`Gate`] until the check has passed. A check that fails
//! stops the task on its worker, its held output is dropped, and the task runs on the driver
//! with the reason, as before. A release build checks the first task of each operator and
//! kind, and every later task of that kind waits on the same [`PlanCheck`]; a debug build
//! checks every task.

use std::sync::Arc;

use datafusion::error::DataFusionError;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use tokio::sync::watch;

use crate::cluster::on_driver::OnDriver;
use crate::cluster::task_plan::{self, RoundTrip, WorkerFunctions};

/// A check's outcome: `Ok(None)` passed; `Ok(Some(why))` the task runs on the driver;
/// `Err(message)` the task's error (a plan that decodes to another one, in a debug build).
pub(super) type Verdict = std::result::Result<Option<OnDriver>, String>;

/// A round-trip check under way or done, shared by the tasks that wait on it.
#[derive(Debug, Clone)]
pub(super) struct PlanCheck(watch::Receiver<Option<Verdict>>);

impl PlanCheck {
    /// Start checking `plan` (a task's plan over empty inputs) on a blocking thread of the
    /// current runtime. `describe` names the task in a debug build's error.
    pub fn start(
        plan: Arc<dyn ExecutionPlan>,
        functions: Arc<WorkerFunctions>,
        ctx: Arc<TaskContext>,
        describe: String,
    ) -> Self {
        let (tell, verdict) = watch::channel(None);
        tokio::task::spawn_blocking(move || {
            let _ = tell.send(Some(check(&plan, functions, &ctx, &describe)));
        });
        Self(verdict)
    }

    /// A check that fails with `why` after `delay` (the tests' [`PlanCheckFault`]).
    ///
    /// [`PlanCheckFault`]: crate::exec::fault_hooks::PlanCheckFault
    pub fn failing_after(delay: std::time::Duration, why: OnDriver) -> Self {
        let (tell, verdict) = watch::channel(None);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tell.send(Some(Ok(Some(why))));
        });
        Self(verdict)
    }

    /// The verdict, if it is in.
    pub fn verdict_now(&self) -> Option<Verdict> {
        self.0.borrow().clone()
    }

    /// Whether the check is in and passed.
    pub fn passed_now(&self) -> bool {
        matches!(*self.0.borrow(), Some(Ok(None)))
    }

    /// The verdict, once it is in.
    pub async fn verdict(&self) -> Verdict {
        let mut verdict = self.0.clone();
        match verdict.wait_for(Option::is_some).await {
            Ok(verdict) => verdict.clone().unwrap_or(Ok(None)),
            Err(_) => Err("the check of a task's plan ended without a verdict".into()),
        }
    }

    /// Resolves only when the check failed (pending for ever once it passed): what a
    /// running task races against, so a plan found wrong stops at once.
    pub async fn failed(&self) {
        if matches!(self.verdict().await, Ok(None)) {
            std::future::pending::<()>().await;
        }
    }
}

/// The verdict on `plan`: it is encoded frozen ([`task_plan::with_outside_filters_frozen`]),
/// as a join may tighten a filter made outside it between an encoding and the comparison,
/// which would then see two values of it. A plan that does not encode or decode runs on the
/// driver. A plan that decodes to another plan is the task's error in debug builds, so tests
/// fail on it; a release build runs the task on the driver and warns.
fn check(
    plan: &Arc<dyn ExecutionPlan>,
    functions: Arc<WorkerFunctions>,
    ctx: &TaskContext,
    describe: &str,
) -> Verdict {
    let frozen = task_plan::with_outside_filters_frozen(plan).map_err(|e| e.to_string())?;
    let bytes = match task_plan::encode(&frozen, functions) {
        Ok(bytes) => bytes,
        Err(e) => return Ok(Some(OnDriver::Unencodable(e.to_string()))),
    };
    match task_plan::check_round_trip(&frozen, &bytes, ctx) {
        Ok(()) => Ok(None),
        Err(RoundTrip::Undecodable(e)) => Ok(Some(OnDriver::Undecodable(e.to_string()))),
        Err(RoundTrip::Differs(e)) if cfg!(debug_assertions) => {
            Err(e.context(describe.to_string()).to_string())
        }
        Err(RoundTrip::Differs(e)) => {
            log::warn!("{describe} runs on the driver: {e}");
            Ok(Some(OnDriver::DecodesDifferently(e.to_string())))
        }
    }
}

/// A verdict as the task's result: `Err` for a check that failed the task.
pub(super) fn as_result(verdict: Verdict) -> datafusion::error::Result<Option<OnDriver>> {
    verdict.map_err(DataFusionError::Execution)
}

/// What a task hands back while its plan's check runs: held, in order, until it passes.
#[derive(Debug)]
pub(super) struct Gate<T> {
    /// The check still awaited; `None` once it passed (or when there is none).
    check: Option<PlanCheck>,
    held: Vec<T>,
}

impl<T> Gate<T> {
    /// A gate that holds items until `check` passes (none: it lets everything through).
    pub fn new(check: Option<PlanCheck>) -> Self {
        Self {
            check,
            held: vec![],
        }
    }

    /// `item` arrived: what may go on now, in order (the held items first), or nothing
    /// while the check runs (or failed).
    pub fn admit(&mut self, item: T) -> Vec<T> {
        self.held.push(item);
        if self.check.as_ref().is_some_and(|check| !check.passed_now()) {
            return vec![];
        }
        self.check = None;
        std::mem::take(&mut self.held)
    }

    /// Everything held, once the check passed.
    pub fn opened(&mut self) -> Vec<T> {
        self.check = None;
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::datasource::memory::MemorySourceConfig;
    use datafusion::prelude::SessionContext;

    fn checked_plan() -> (Arc<dyn ExecutionPlan>, Arc<TaskContext>) {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let plan = MemorySourceConfig::try_new_exec(&[vec![]], schema, None).unwrap();
        (plan, SessionContext::new().task_ctx())
    }

    #[tokio::test]
    async fn a_gate_holds_what_comes_until_its_check_passes_then_lets_all_through_in_order() {
        let (plan, ctx) = checked_plan();
        let (tell, verdict) = watch::channel(None);
        let mut gate = Gate::new(Some(PlanCheck(verdict)));
        assert!(gate.admit(1).is_empty());
        assert!(gate.admit(2).is_empty());
        tell.send(Some(Ok(None))).unwrap();
        assert_eq!(gate.admit(3), vec![1, 2, 3]);
        assert_eq!(gate.admit(4), vec![4]);
        // A real check of a plan that round-trips passes.
        let check = PlanCheck::start(plan, Arc::default(), ctx, "task 0".into());
        assert_eq!(check.verdict().await, Ok(None));
        assert!(check.passed_now());
    }

    #[tokio::test]
    async fn a_failed_check_keeps_the_gate_shut_and_ends_the_race() {
        let (tell, verdict) = watch::channel(None);
        let check = PlanCheck(verdict);
        let mut gate = Gate::new(Some(check.clone()));
        let why = OnDriver::Undecodable("no such node".into());
        tell.send(Some(Ok(Some(why.clone())))).unwrap();
        assert!(gate.admit("block").is_empty());
        assert!(!check.passed_now());
        // `failed` resolves for a failed check ...
        tokio::time::timeout(std::time::Duration::from_secs(5), check.failed())
            .await
            .expect("a failed check ends the race");
        assert_eq!(check.verdict().await, Ok(Some(why)));
        // ... and never for a passed one.
        let (tell, verdict) = watch::channel(None);
        tell.send(Some(Ok(None))).unwrap();
        let passed = PlanCheck(verdict);
        let raced =
            tokio::time::timeout(std::time::Duration::from_millis(50), passed.failed()).await;
        assert!(raced.is_err(), "a passed check never ends the race");
        // A check whose thread ended without a verdict fails the task.
        let (tell, verdict) = watch::channel(None);
        drop(tell);
        assert!(PlanCheck(verdict).verdict().await.is_err());
    }
}
