//! Small first blocks: the start of a run ramps block sizes up, so the first rows come out
//! after a few hundred rows of work, not a full block's.
//!
//! Two places hold a full block's work before anything moves: a source task's first batch
//! (the scan's batch size, through every CPU function of its fragment, projections pushed
//! into the scan included) and an accelerator operator's first bundle (coalesced to
//! `flumen.target_block_rows`). With `flumen.first_block_rows = R`, the first split of each
//! source partition reads batches of R rows (`SplitSourceExec`); its task's cutter emits
//! blocks of R, 2R, 4R, ... rows up to `flumen.model_piece_rows` and the rest of the split
//! at that size (`BlockCutter::with_ramp`): doubling on to the target made the model wait
//! for the CPU to finish each larger block (three gaps of 5, 13 and 26 ms at the start of
//! the pipeline bench); and an accelerator operator's k-th bundle of a partition gathers at
//! most `R << k` rows, of as many such blocks as are ready. All of it depends only on the
//! task's own rows (a split's rows are always the same), so a recomputed task cuts the same
//! blocks. Which plans ramp, and from how many rows, the plan decides once:
//! `crate::plan::model_batching`.

/// Rows of the `step`-th ramped piece (0-based) starting at `first_rows`, capped at `target`;
/// `first_rows == 0`: no ramp, always `target`.
pub fn ramp_rows(first_rows: usize, target: usize, step: usize) -> usize {
    if first_rows == 0 {
        return target;
    }
    let doubled = match u32::try_from(step).ok().and_then(|s| 1usize.checked_shl(s)) {
        Some(factor) => first_rows.saturating_mul(factor),
        None => usize::MAX,
    };
    doubled.min(target).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_double_up_to_the_target() {
        let rows: Vec<usize> = (0..8).map(|k| ramp_rows(256, 8192, k)).collect();
        assert_eq!(rows, vec![256, 512, 1024, 2048, 4096, 8192, 8192, 8192]);
        assert_eq!(ramp_rows(0, 8192, 0), 8192);
        assert_eq!(ramp_rows(256, 8192, 200), 8192);
        assert_eq!(ramp_rows(usize::MAX / 2, 8192, 3), 8192);
    }
}
