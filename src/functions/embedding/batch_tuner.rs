//! How many tokens `embed` packs into one forward pass, chosen from measured throughput.
//!
//! The best pass size depends on the device and the texts: on a CPU a pass whose activations
//! (`tokens × 1536` floats in the feed-forward layer) leave the cache slows down, on a GPU
//! small passes leave the device idle. [`BatchTuner`] climbs over a few token budgets
//! ([`CPU_TOKEN_BUDGETS`] on a CPU, [`ACCELERATOR_TOKEN_BUDGETS`] on a GPU): it keeps one, now
//! and then tries a neighbour for a few passes, and moves there when the neighbour's tokens
//! per second are better by [`MIN_GAIN`].
//!
//! A block's sequences are run shortest first, so consecutive passes get ever longer
//! sequences and slower tokens. A trial plans passes in the order current, trial, trial,
//! current (and again), so that drift counts against the trial as often as for it, and
//! compares the throughput of neighbouring passes only. A pass is placed in that order when
//! its budget is asked for, and measured when it is done: a worker that keeps the next pass
//! in flight while the last one computes asks before it measures.

use std::time::Duration;

/// The token budgets a tuner on a CPU chooses among: a pass holds at most this many tokens
/// (or one sequence, if longer). Passes of 1-2k tokens keep a MiniLM pass's activations in
/// a core's caches.
pub const CPU_TOKEN_BUDGETS: [usize; 5] = [512, 1024, 2048, 4096, 8192];

/// The token budgets a tuner on an accelerator chooses among. A GPU is busy only with large
/// passes: on an H200, passes of 8,192 tokens of 170-token documents left it at 0.55x the
/// rate of sentence-transformers' batches of 256 documents (about 43k tokens). A pass's
/// activations take about 18 KB a token (2.4 GB at the top).
pub const ACCELERATOR_TOKEN_BUDGETS: [usize; 6] = [4096, 8192, 16384, 32768, 65536, 131072];

/// Every budget either tuner may choose (for checks of what `EXPLAIN ANALYZE` reports).
pub fn all_token_budgets() -> impl Iterator<Item = usize> {
    CPU_TOKEN_BUDGETS
        .into_iter()
        .chain(ACCELERATOR_TOKEN_BUDGETS)
}

/// A neighbour is taken when its throughput beats the current budget's by this factor.
pub const MIN_GAIN: f64 = 1.03;

/// Passes at the current budget between two trials.
const STEADY_PASSES: u32 = 12;

/// Measured pairs (current, trial) that decide a trial.
const TRIAL_PAIRS: usize = 4;

/// Chooses the token budget of `embed`'s next forward pass from the throughput of earlier
/// ones.
#[derive(Debug, Clone)]
pub struct BatchTuner {
    /// The budgets it chooses among, smallest first.
    budgets: &'static [usize],
    /// Index of the budget in use.
    current: usize,
    /// Passes at the current budget since the last trial ended.
    steady: u32,
    /// Whether the next trial tries the larger neighbour.
    up_next: bool,
    /// The trial under way, if any.
    trial: Option<Trial>,
    /// Trials that moved the budget, and trials in all (for `EXPLAIN ANALYZE`).
    moves: u64,
    trials: u64,
}

/// A neighbouring budget being compared with the current one.
#[derive(Debug, Clone)]
struct Trial {
    /// Index of the budget tried.
    index: usize,
    /// Passes planned so far in this trial (the schedule's position).
    step: usize,
    /// Throughput (tokens/s) of the last pass measured at the current budget and at the
    /// trial's, each waiting for a partner at the other.
    current_rate: Option<f64>,
    trial_rate: Option<f64>,
    /// ln(trial throughput / current throughput) of each completed pair.
    log_ratios: Vec<f64>,
}

impl Trial {
    /// Whether pass `step` of the trial runs the trial budget: current, trial, trial, current.
    fn runs_trial(step: usize) -> bool {
        matches!(step % 4, 1 | 2)
    }
}

impl BatchTuner {
    /// A tuner for a model on a CPU: starts at 2,048 tokens a pass.
    pub fn for_cpu() -> Self {
        Self::over(&CPU_TOKEN_BUDGETS, 2)
    }

    /// A tuner for a model on an accelerator: starts at 32,768 tokens a pass.
    pub fn for_accelerator() -> Self {
        Self::over(&ACCELERATOR_TOKEN_BUDGETS, 3)
    }

    fn over(budgets: &'static [usize], start: usize) -> Self {
        Self {
            budgets,
            current: start,
            steady: 0,
            up_next: true,
            trial: None,
            moves: 0,
            trials: 0,
        }
    }

    /// The token budget the tuner has settled on.
    pub fn chosen(&self) -> usize {
        self.budgets[self.current]
    }

    /// Trials run so far, and how many of them moved the budget.
    pub fn trials(&self) -> (u64, u64) {
        (self.trials, self.moves)
    }

    /// The token budget of the next pass, which takes its place in a trial's schedule: its
    /// measure comes later, through [`record`](Self::record), in the order the passes were
    /// planned (other passes may be planned in between).
    pub fn next_budget(&mut self) -> usize {
        match &mut self.trial {
            Some(trial) => {
                let on_trial = Trial::runs_trial(trial.step);
                trial.step += 1;
                if on_trial {
                    self.budgets[trial.index]
                } else {
                    self.budgets[self.current]
                }
            }
            None => self.budgets[self.current],
        }
    }

    /// Record a pass run at `budget` (as [`next_budget`](Self::next_budget) gave it) that
    /// computed `tokens` tokens in `elapsed`. A pass far from full (a block's last) says
    /// little about its budget and is not counted, nor is one at a budget the tuner has
    /// since left.
    pub fn record(&mut self, budget: usize, tokens: usize, elapsed: Duration) {
        if tokens * 4 < budget * 3 {
            return;
        }
        let throughput = tokens as f64 / elapsed.as_secs_f64().max(1e-9);
        let current = self.budgets[self.current];
        let Some(trial) = self.trial.as_mut() else {
            if budget == current {
                self.steady += 1;
                if self.steady >= STEADY_PASSES {
                    self.start_trial();
                }
            }
            return;
        };
        if budget == self.budgets[trial.index] {
            trial.trial_rate = Some(throughput);
        } else if budget == current {
            trial.current_rate = Some(throughput);
        } else {
            return;
        }
        if let (Some(trial_rate), Some(current_rate)) = (trial.trial_rate, trial.current_rate) {
            trial.log_ratios.push((trial_rate / current_rate).ln());
            (trial.trial_rate, trial.current_rate) = (None, None);
        }
        if trial.log_ratios.len() >= TRIAL_PAIRS {
            self.end_trial();
        }
    }

    /// Try the next neighbour (alternately larger and smaller; at an end, the one there is).
    fn start_trial(&mut self) {
        let last = self.budgets.len() - 1;
        let up = (self.up_next && self.current < last) || self.current == 0;
        let index = if up {
            self.current + 1
        } else {
            self.current - 1
        };
        self.trial = Some(Trial {
            index,
            step: 0,
            current_rate: None,
            trial_rate: None,
            log_ratios: vec![],
        });
        self.trials += 1;
    }

    /// Move to the trial's budget when it was faster by [`MIN_GAIN`]; either way, go on in a
    /// direction that has not just lost.
    fn end_trial(&mut self) {
        let Some(trial) = self.trial.take() else {
            return;
        };
        let mean = trial.log_ratios.iter().sum::<f64>() / trial.log_ratios.len() as f64;
        let went_up = trial.index > self.current;
        if mean > MIN_GAIN.ln() {
            self.current = trial.index;
            self.moves += 1;
            // Keep climbing the way that paid.
            self.up_next = went_up;
        } else {
            self.up_next = !went_up;
        }
        self.steady = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed a tuner passes whose speed follows `tokens_per_s(budget)`, drifting slower and
    /// faster again (as a block sorted by length gets longer sequences), `in_flight` passes
    /// planned before the oldest is measured (2: as a worker that keeps the next pass on the
    /// device while the last computes).
    fn run_with(
        mut tuner: BatchTuner,
        tokens_per_s: impl Fn(usize) -> f64,
        passes: usize,
        in_flight: usize,
    ) -> BatchTuner {
        let mut planned = std::collections::VecDeque::new();
        for pass in 0..passes {
            planned.push_back(tuner.next_budget());
            if planned.len() < in_flight {
                continue;
            }
            let budget = planned.pop_front().unwrap();
            // Up for 20 passes, down for 20: drift without a jump (a jump inside a pair can
            // outweigh a 3% difference whichever way the passes are planned).
            let drift = 1.0 + (20 - ((pass % 40) as i64 - 20).abs()) as f64 * 0.004;
            let secs = budget as f64 / tokens_per_s(budget) * drift;
            tuner.record(budget, budget, Duration::from_secs_f64(secs));
        }
        tuner
    }

    /// [`run_with`] with one pass in flight and with two: the tuner must choose the same.
    fn run(tuner: BatchTuner, tokens_per_s: impl Fn(usize) -> f64, passes: usize) -> BatchTuner {
        let lagged = run_with(tuner.clone(), &tokens_per_s, passes, 2);
        let tuner = run_with(tuner, &tokens_per_s, passes, 1);
        assert_eq!(
            (lagged.chosen(), lagged.trials().1 > 0),
            (tuner.chosen(), tuner.trials().1 > 0),
            "two passes in flight: {lagged:?}, one: {tuner:?}"
        );
        tuner
    }

    #[test]
    fn settles_on_the_fastest_budget() {
        // Fastest at 1024 tokens (cache-bound CPU), 20% slower either side per step.
        let cpu = |b: usize| {
            let steps = ((b as f64).log2() - 10.0).abs();
            10_000.0 / (1.0 + 0.2 * steps)
        };
        let tuner = run(BatchTuner::for_cpu(), cpu, 400);
        assert_eq!(tuner.chosen(), 1024, "{tuner:?}");
        // Faster the larger (a GPU): climbs to the top of either tuner's budgets.
        let gpu = |b: usize| b as f64 * 100.0;
        assert_eq!(run(BatchTuner::for_cpu(), gpu, 400).chosen(), 8192);
        assert_eq!(
            run(BatchTuner::for_accelerator(), gpu, 400).chosen(),
            131072
        );
        // A GPU fastest at 16k tokens a pass: an accelerator's tuner comes down to it.
        let peaked = |b: usize| {
            let steps = ((b as f64).log2() - 14.0).abs();
            1e6 / (1.0 + 0.2 * steps)
        };
        let tuner = run(BatchTuner::for_accelerator(), peaked, 400);
        assert_eq!(tuner.chosen(), 16384, "{tuner:?}");
    }

    #[test]
    fn a_flat_curve_does_not_move() {
        let tuner = run(BatchTuner::for_cpu(), |_| 5_000.0, 400);
        assert_eq!(tuner.chosen(), 2048);
        let (trials, moves) = tuner.trials();
        assert!(trials > 5 && moves == 0, "trials {trials}, moves {moves}");
    }

    #[test]
    fn partial_passes_are_not_counted() {
        let mut tuner = BatchTuner::for_cpu();
        for _ in 0..100 {
            tuner.record(2048, 100, Duration::from_millis(1));
        }
        assert_eq!(tuner.trials(), (0, 0));
    }
}
