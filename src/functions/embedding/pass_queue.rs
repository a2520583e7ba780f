//! The forward passes of an embed worker's pieces, queued on its encoder in order.
//!
//! A model operator hands its worker one piece of rows at a time (`flumen.model_piece_rows`,
//! 1,024 by default: one or two GPU passes of short sentences) and, where the worker queues
//! ([`AcceleratorWorker::start`](crate::functions::accelerator::AcceleratorWorker::start)),
//! the next piece before it waits for the last. [`PassQueue`] cuts each piece's sequences,
//! shortest first, into passes and keeps up to `in_flight` of them started on the encoder,
//! oldest piece first: while the operator hands one piece's vectors on, the device already
//! computes the next piece's first pass. Each finished pass's vectors go to its piece's
//! rows; a piece is collected once all its passes are back.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

use datafusion::error::{DataFusionError, Result};

use super::Batching;
use super::bert::{PackedBatch, SentenceEncoder, StartedPass};

/// A piece's token sequences: `ids[j]` goes to row `present[j]` of `rows` (the other rows
/// are nulls, left zero).
#[derive(Debug, Clone, Default)]
pub struct PieceTokens {
    /// Rows in the piece.
    pub rows: usize,
    /// The row of each sequence.
    pub present: Vec<usize>,
    /// Each sequence's token ids.
    pub ids: Vec<Vec<u32>>,
}

/// A piece whose vectors are not all collected.
struct Piece {
    id: u64,
    tokens: PieceTokens,
    /// Its sequences, shortest first.
    order: Vec<usize>,
    /// Where in `order` its next pass starts.
    next: usize,
    /// Passes of it started and not finished.
    in_flight: usize,
    /// `[rows, width]` row-major, filled as its passes finish (zeros for nulls).
    out: Vec<f32>,
    /// Its caller no longer wants it: its unstarted passes are skipped, its finished ones
    /// dropped.
    abandoned: bool,
}

impl Piece {
    fn started_all(&self) -> bool {
        self.next >= self.order.len()
    }

    fn done(&self) -> bool {
        self.started_all() && self.in_flight == 0
    }
}

/// A pass started on the encoder and not finished.
struct PassInFlight {
    piece: u64,
    started: StartedPass,
    /// Its sequences: a range of its piece's `order`.
    chunk: Range<usize>,
    tokens: usize,
    /// The token budget it was cut at (None: cut by sentences).
    budget: Option<usize>,
    began: Instant,
}

/// An encoder, how its passes are cut, and the pieces and passes queued on it.
pub(super) struct PassQueue {
    encoder: Box<dyn SentenceEncoder>,
    batching: Batching,
    /// Most passes started and unfinished (at least 1).
    in_flight_limit: usize,
    /// Vectors' width.
    width: usize,
    pieces: VecDeque<Piece>,
    passes: VecDeque<PassInFlight>,
    next_id: u64,
    /// When the last finished pass's vectors came back: the device moved on from there.
    last_back: Instant,
}

impl PassQueue {
    /// A queue on `encoder`, cutting passes by `batching`, keeping up to `in_flight` started;
    /// vectors `width` wide.
    pub(super) fn new(
        encoder: Box<dyn SentenceEncoder>,
        batching: Batching,
        in_flight: usize,
        width: usize,
    ) -> Self {
        Self {
            encoder,
            batching,
            in_flight_limit: in_flight.max(1),
            width,
            pieces: VecDeque::new(),
            passes: VecDeque::new(),
            next_id: 0,
            last_back: Instant::now(),
        }
    }

    /// The encoder.
    pub(super) fn encoder(&self) -> &dyn SentenceEncoder {
        self.encoder.as_ref()
    }

    /// How passes are cut (the tuner's choice, for `EXPLAIN ANALYZE`).
    pub(super) fn batching(&self) -> &Batching {
        &self.batching
    }

    /// Most passes it keeps started.
    pub(super) fn in_flight_limit(&self) -> usize {
        self.in_flight_limit
    }

    /// Queue a piece and start what passes fit; the id [`collect`](Self::collect) takes.
    pub(super) fn start(&mut self, tokens: PieceTokens) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let mut order: Vec<usize> = (0..tokens.ids.len()).collect();
        // Similar lengths together: attention work per pass stays even.
        order.sort_by_key(|&j| tokens.ids[j].len());
        self.pieces.push_back(Piece {
            id,
            out: vec![0f32; tokens.rows * self.width],
            tokens,
            order,
            next: 0,
            in_flight: 0,
            abandoned: false,
        });
        self.pump()?;
        Ok(id)
    }

    /// The vectors of piece `id`, `[rows, width]` row-major, once all its passes are back
    /// (finishing earlier pieces' passes on the way, and starting later ones').
    pub(super) fn collect(&mut self, id: u64) -> Result<Vec<f32>> {
        loop {
            let Some(at) = self.pieces.iter().position(|p| p.id == id) else {
                return Err(DataFusionError::Execution(
                    "embed(): this piece was dropped when an earlier pass failed".into(),
                ));
            };
            if self.pieces[at].done() {
                let piece = self.pieces.remove(at).expect("found above");
                return Ok(piece.out);
            }
            self.pump()?;
            self.finish_oldest()?;
        }
    }

    /// Piece `id` is not wanted (its caller went away): no more of its passes start, and
    /// it leaves the queue once its started ones are back.
    pub(super) fn abandon(&mut self, id: u64) {
        if let Some(piece) = self.pieces.iter_mut().find(|p| p.id == id) {
            piece.abandoned = true;
        }
        self.pieces.retain(|p| !(p.abandoned && p.in_flight == 0));
    }

    /// Start passes, oldest piece first, while fewer than the limit are in flight.
    fn pump(&mut self) -> Result<()> {
        while self.passes.len() < self.in_flight_limit {
            let Some(piece) = self
                .pieces
                .iter_mut()
                .find(|p| !p.abandoned && !p.started_all())
            else {
                return Ok(());
            };
            let start = piece.next;
            let budget = self.batching.token_budget();
            let ids = &piece.tokens.ids;
            let (end, tokens) = match (&self.batching, budget) {
                (Batching::Sentences(n), _) => {
                    let end = (start + n).min(piece.order.len());
                    let tokens = piece.order[start..end].iter().map(|&j| ids[j].len()).sum();
                    (end, tokens)
                }
                (_, budget) => pass_end(&piece.order, ids, start, budget.unwrap_or(usize::MAX)),
            };
            let batch = PackedBatch::new(piece.order[start..end].iter().map(|&j| &ids[j][..]));
            piece.next = end;
            piece.in_flight += 1;
            let id = piece.id;
            let began = Instant::now();
            let started = match self.encoder.start(&batch) {
                Ok(started) => started,
                Err(e) => return Err(self.fail(e)),
            };
            self.passes.push_back(PassInFlight {
                piece: id,
                started,
                chunk: start..end,
                tokens,
                budget,
                began,
            });
        }
        Ok(())
    }

    /// Wait for the oldest pass in flight and put its vectors in its piece's rows.
    fn finish_oldest(&mut self) -> Result<()> {
        let Some(pass) = self.passes.pop_front() else {
            return Err(DataFusionError::Internal(
                "embed(): a piece waits with no pass in flight".into(),
            ));
        };
        let vectors = match self.encoder.finish(pass.started) {
            Ok(vectors) => vectors,
            Err(e) => return Err(self.fail(e)),
        };
        let back = Instant::now();
        // The device ran this pass from its start or from the previous pass's end,
        // whichever came later.
        let ran = back - pass.began.max(self.last_back);
        self.last_back = back;
        if let (Batching::Adaptive(tuner), Some(budget)) = (&mut self.batching, pass.budget) {
            tuner.record(budget, pass.tokens, ran);
        }
        let Some(piece) = self.pieces.iter_mut().find(|p| p.id == pass.piece) else {
            return Ok(());
        };
        piece.in_flight -= 1;
        if !piece.abandoned {
            let width = self.width;
            if vectors.len() != pass.chunk.len() * width {
                let e = DataFusionError::Internal(format!(
                    "embed(): {} values back for {} sequences of {width}",
                    vectors.len(),
                    pass.chunk.len()
                ));
                return Err(self.fail(e));
            }
            for (k, &j) in piece.order[pass.chunk].iter().enumerate() {
                let row = piece.tokens.present[j];
                piece.out[row * width..(row + 1) * width]
                    .copy_from_slice(&vectors[k * width..(k + 1) * width]);
            }
        }
        self.pieces.retain(|p| !(p.abandoned && p.in_flight == 0));
        Ok(())
    }

    /// After a failed pass: drop every piece and pass (their callers get an error), and
    /// return `e`.
    fn fail(&mut self, e: DataFusionError) -> DataFusionError {
        self.pieces.clear();
        self.passes.clear();
        e
    }
}

/// Where the pass starting at `order[start]` ends so it holds at most `budget` tokens (at
/// least one sequence), and the tokens it holds.
fn pass_end(order: &[usize], ids: &[Vec<u32>], start: usize, budget: usize) -> (usize, usize) {
    let mut end = start;
    let mut tokens = 0;
    while end < order.len() {
        let len = ids[order[end]].len();
        if end > start && tokens + len > budget {
            break;
        }
        tokens += len;
        end += 1;
    }
    (end, tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::functions::embedding::batch_tuner::BatchTuner;
    use std::sync::{Arc, Mutex};

    /// What a [`Deferred`] encoder saw: passes started, most unfinished at once.
    #[derive(Default)]
    struct Seen {
        started: u64,
        most_unfinished: usize,
    }

    /// An encoder that, like a GPU's, computes a pass only when it is finished: each
    /// sequence's vector is `[its length, its first id]`. It checks passes finish in the
    /// order they started.
    #[derive(Default)]
    struct Deferred {
        queued: VecDeque<(u64, PackedBatch)>,
        seen: Arc<Mutex<Seen>>,
        /// Fail the pass with this number when it starts (dropping what was queued, as a
        /// lost device would).
        fail_at: Option<u64>,
    }

    impl SentenceEncoder for Deferred {
        fn encode(&mut self, batch: &PackedBatch) -> Result<Vec<f32>> {
            let pass = self.start(batch)?;
            self.finish(pass)
        }
        fn start(&mut self, batch: &PackedBatch) -> Result<StartedPass> {
            let mut seen = self.seen.lock().unwrap();
            if self.fail_at == Some(seen.started) {
                self.fail_at = None;
                self.queued.clear();
                return Err(DataFusionError::Execution("device lost".into()));
            }
            self.queued.push_back((seen.started, batch.clone()));
            seen.most_unfinished = seen.most_unfinished.max(self.queued.len());
            seen.started += 1;
            Ok(StartedPass::OnDevice {
                slot: 0,
                number: seen.started - 1,
            })
        }
        fn finish(&mut self, pass: StartedPass) -> Result<Vec<f32>> {
            let StartedPass::OnDevice { number, .. } = pass else {
                panic!("not queued");
            };
            let (queued, batch) = self.queued.pop_front().unwrap();
            assert_eq!(queued, number, "finished out of order");
            Ok(batch
                .lengths
                .iter()
                .zip(batch.offsets())
                .flat_map(|(&len, at)| [len as f32, batch.ids[at] as f32])
                .collect())
        }
        fn device(&self) -> String {
            "deferred".into()
        }
        fn passes_in_flight(&self) -> usize {
            2
        }
    }

    /// A piece of `n` sequences (first ids from `first`) in rows `2k`, odd rows null.
    fn piece(n: u32, first: u32) -> PieceTokens {
        let ids: Vec<Vec<u32>> = (0..n)
            .map(|i| (0..(1 + (i * 7) % 13)).map(|t| first + i + t).collect())
            .collect();
        PieceTokens {
            rows: 2 * ids.len(),
            present: (0..ids.len()).map(|k| 2 * k).collect(),
            ids,
        }
    }

    /// Each row holds its own sequence's vector, nulls stay zero.
    fn check(tokens: &PieceTokens, out: &[f32]) {
        for (k, seq) in tokens.ids.iter().enumerate() {
            let row = tokens.present[k];
            assert_eq!(
                out[2 * row..2 * row + 2],
                [seq.len() as f32, seq[0] as f32],
                "row {row}"
            );
            assert_eq!(out[2 * row + 2..2 * row + 4], [0.0, 0.0], "null row");
        }
    }

    /// A queue on a [`Deferred`] encoder, and what the encoder sees.
    fn queue(batching: Batching, in_flight: usize) -> (PassQueue, Arc<Mutex<Seen>>) {
        let encoder = Deferred::default();
        let seen = Arc::clone(&encoder.seen);
        (
            PassQueue::new(Box::new(encoder), batching, in_flight, 2),
            seen,
        )
    }

    /// One piece at a time, with one or two passes in flight, by tokens or by sentences:
    /// every row gets its own sequence's vector and no more passes are ever unfinished than
    /// the limit.
    #[test]
    fn a_piece_s_vectors_land_in_its_rows() {
        for (in_flight, batching) in [
            (2, Batching::Tokens(20)),
            (2, Batching::Sentences(3)),
            (1, Batching::Tokens(20)),
            (2, Batching::Adaptive(BatchTuner::for_cpu())),
        ] {
            let (mut queue, seen) = queue(batching, in_flight);
            let tokens = piece(40, 1000);
            let id = queue.start(tokens.clone()).unwrap();
            let out = queue.collect(id).unwrap();
            check(&tokens, &out);
            let seen = seen.lock().unwrap();
            let expected = if seen.started > 1 { in_flight } else { 1 };
            assert_eq!(seen.most_unfinished, expected, "{:?}", queue.batching);
            assert!(queue.pieces.is_empty() && queue.passes.is_empty());
        }
    }

    /// The next piece queued before the last is collected (as the model's operator queues
    /// it): its first pass starts while the last piece's are still out, so the device has
    /// it when the last piece's vectors are handed on; each piece gets its own vectors.
    #[test]
    fn the_next_piece_starts_before_the_last_is_collected() {
        let (mut queue, seen) = queue(Batching::Tokens(400), 2);
        // One pass each: without queueing ahead, one pass would be in flight at a time.
        let (a, b, c) = (piece(20, 1000), piece(20, 2000), piece(20, 3000));
        let first = queue.start(a.clone()).unwrap();
        let second = queue.start(b.clone()).unwrap();
        assert_eq!(
            queue.passes.len(),
            2,
            "the second piece's pass did not start"
        );
        check(&a, &queue.collect(first).unwrap());
        let third = queue.start(c.clone()).unwrap();
        assert_eq!(queue.passes.len(), 2);
        check(&b, &queue.collect(second).unwrap());
        check(&c, &queue.collect(third).unwrap());
        assert_eq!(seen.lock().unwrap().most_unfinished, 2);
        assert!(queue.pieces.is_empty() && queue.passes.is_empty());
    }

    /// A piece whose caller went away starts no more passes and leaves once its started
    /// ones are back; a failed pass fails every piece queued, and the queue goes on after.
    #[test]
    fn abandoned_and_failed_pieces_leave_the_queue() {
        let (mut queue, seen) = queue(Batching::Tokens(20), 2);
        let gone = queue.start(piece(40, 1000)).unwrap();
        queue.abandon(gone);
        assert_eq!(queue.pieces.len(), 1, "its passes in flight keep it");
        let kept = piece(10, 5000);
        let id = queue.start(kept.clone()).unwrap();
        check(&kept, &queue.collect(id).unwrap());
        assert!(queue.pieces.is_empty() && queue.passes.is_empty());
        // Its two passes in flight, then the kept piece's five (lengths 1-5, 8-9, 10, 11,
        // 12 in passes of at most 20 tokens).
        let started = seen.lock().unwrap().started;
        assert_eq!(started, 2 + 5, "the abandoned piece ran on");

        let encoder = Deferred {
            fail_at: Some(3),
            ..Default::default()
        };
        let mut queue = PassQueue::new(Box::new(encoder), Batching::Tokens(20), 2, 2);
        let first = queue.start(piece(40, 1000)).unwrap();
        let err = queue.collect(first).unwrap_err().to_string();
        assert!(err.contains("device lost"), "{err}");
        assert!(queue.pieces.is_empty() && queue.passes.is_empty());
        let again = piece(10, 7000);
        let id = queue.start(again.clone()).unwrap();
        check(&again, &queue.collect(id).unwrap());
    }
}
