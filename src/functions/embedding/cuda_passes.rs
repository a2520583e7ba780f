//! Two forward passes in flight on a CUDA stream: a pass's token layout packed into one
//! pinned buffer and uploaded with one asynchronous copy, its vectors copied back into
//! another, and an event that says when they are there.
//!
//! A worker that waited for each pass left the device idle while it collected the vectors,
//! packed the next pass's tokens and queued its ~50 launches. With a [`PassSlot`] per pass
//! (two, used in turn) the next pass is queued behind the running one and the device goes
//! from one to the next; a slot's pinned memory is written again only after its event says
//! the pass that used it is done.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, DeviceRepr, PinnedHostSlice, sys::CUevent_flags};
use datafusion::error::Result;

use super::bert::PackedBatch;
use super::cuda_driver::cuda_error;

/// Passes a CUDA encoder keeps queued on its stream at once: the one computing and the next.
pub const PASS_SLOTS: usize = 2;

/// Where each part of a pass's token layout sits in its one buffer: each token's id,
/// position and sequence, each sequence's first token and length, then (for the tiled
/// attention kernel) each query tile's first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenLayout {
    /// Tokens in the pass.
    pub tokens: usize,
    /// Sequences in the pass.
    pub seqs: usize,
    /// The longest sequence's tokens.
    pub max_len: usize,
    /// Query tiles of `tile` tokens (each sequence's tokens, a tile at a time), where the
    /// head width has a tiled attention kernel.
    pub tiles: Option<usize>,
}

impl TokenLayout {
    /// The layout of `batch`, with query tiles of `tile` tokens where `Some`.
    pub fn of(batch: &PackedBatch, tile: Option<usize>) -> Self {
        Self {
            tokens: batch.ids.len(),
            seqs: batch.lengths.len(),
            max_len: batch.lengths.iter().copied().max().unwrap_or(1),
            tiles: tile.map(|tile| batch.lengths.iter().map(|l| l.div_ceil(tile)).sum()),
        }
    }

    /// Values in the buffer.
    pub fn len(&self) -> usize {
        3 * self.tokens + 2 * self.seqs + self.tiles.unwrap_or(0)
    }

    /// Whether the pass holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// Each part's range in the buffer: ids, positions, token sequence, sequence start,
    /// sequence length, tile firsts (empty without tiles).
    pub fn parts(&self) -> [std::ops::Range<usize>; 6] {
        let (t, s) = (self.tokens, self.seqs);
        let mut start = 0;
        [t, t, t, s, s, self.tiles.unwrap_or(0)].map(|n| {
            start += n;
            start - n..start
        })
    }

    /// Write `batch`'s layout (this layout's, with query tiles of `tile` tokens) into `out`
    /// (at least [`len`](Self::len) values).
    pub fn write(&self, batch: &PackedBatch, tile: Option<usize>, out: &mut [u32]) {
        let [ids, positions, token_seq, seq_start, seq_len, firsts] = self.parts();
        out[ids].copy_from_slice(&batch.ids);
        let (mut token, mut tile_index) = (0, firsts.start);
        for (s, &len) in batch.lengths.iter().enumerate() {
            out[seq_start.start + s] = token as u32;
            out[seq_len.start + s] = len as u32;
            for p in 0..len {
                out[positions.start + token + p] = p as u32;
                out[token_seq.start + token + p] = s as u32;
            }
            if let Some(tile) = tile {
                for q in (0..len).step_by(tile) {
                    out[tile_index] = (token + q) as u32;
                    tile_index += 1;
                }
            }
            token += len;
        }
        debug_assert_eq!(tile_index, firsts.end);
    }
}

/// The pinned memory of one pass in flight, and the event recorded on the stream after its
/// vectors' copy.
pub struct PassSlot {
    /// The token layout going up.
    pub layout: Option<PinnedHostSlice<u32>>,
    /// The vectors coming back.
    pub vectors: Option<PinnedHostSlice<f32>>,
    /// Recorded after the vectors' copy: once it is reached, the slot's memory is free.
    pub done: CudaEvent,
    /// The pass in the slot whose vectors were not collected: its number and its values.
    pub pending: Option<(u64, usize)>,
}

impl PassSlot {
    /// An empty slot in `ctx` (its buffers grow with the passes).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        // A blocking wait: the worker thread sleeps while the device computes instead of
        // spinning on a core the CPU pool's tokenizers could use.
        let done = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| cuda_error("creating an event", e))?;
        Ok(Self {
            layout: None,
            vectors: None,
            done,
            pending: None,
        })
    }

    /// Wait until the stream has passed the slot's last pass (at once if it has, or if none
    /// was queued), so its pinned memory may be written.
    pub fn wait(&self) -> Result<()> {
        self.done
            .synchronize()
            .map_err(|e| cuda_error("waiting for a pass", e))
    }
}

/// `buffer`, grown to hold at least `n` values (a power of two, so a few sizes serve).
pub fn pinned_at_least<'a, T: DeviceRepr>(
    ctx: &Arc<CudaContext>,
    buffer: &'a mut Option<PinnedHostSlice<T>>,
    n: usize,
) -> Result<&'a mut PinnedHostSlice<T>> {
    if buffer.as_ref().is_none_or(|b| b.len() < n) {
        *buffer = None;
        // SAFETY: every value read from it is written first (by the host or by a copy).
        let grown = unsafe { ctx.alloc_pinned_with_flags::<T>(n.max(1).next_power_of_two(), 0) }
            .map_err(|e| cuda_error("pinned buffer", e))?;
        *buffer = Some(grown);
    }
    Ok(buffer.as_mut().expect("allocated above"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout's parts follow one another and hold what the kernels read: positions
    /// restart with each sequence, tiles start every `tile` tokens of a sequence.
    #[test]
    fn a_pass_layout_holds_each_part_in_its_range() {
        let batch = PackedBatch::new([&[5, 6, 7][..], &[8][..], &[9, 10, 11, 12, 13][..]]);
        let layout = TokenLayout::of(&batch, Some(2));
        assert_eq!(
            layout,
            TokenLayout {
                tokens: 9,
                seqs: 3,
                max_len: 5,
                tiles: Some(2 + 1 + 3),
            }
        );
        let mut out = vec![u32::MAX; layout.len()];
        layout.write(&batch, Some(2), &mut out);
        let [ids, positions, token_seq, seq_start, seq_len, firsts] = layout.parts();
        assert_eq!(firsts.end, out.len());
        assert_eq!(out[ids], [5, 6, 7, 8, 9, 10, 11, 12, 13]);
        assert_eq!(out[positions], [0, 1, 2, 0, 0, 1, 2, 3, 4]);
        assert_eq!(out[token_seq], [0, 0, 0, 1, 2, 2, 2, 2, 2]);
        assert_eq!(out[seq_start], [0, 3, 4]);
        assert_eq!(out[seq_len], [3, 1, 5]);
        assert_eq!(out[firsts], [0, 2, 3, 4, 6, 8]);

        // Without a tiled kernel the tiles' part is empty.
        let plain = TokenLayout::of(&batch, None);
        assert_eq!(plain.len(), 3 * 9 + 2 * 3);
        let mut out = vec![u32::MAX; plain.len()];
        plain.write(&batch, None, &mut out);
        assert!(plain.parts()[5].is_empty() && !out.contains(&u32::MAX));
    }
}
