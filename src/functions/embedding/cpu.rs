//! The CPU backend: BERT forward over packed sequences, matrix products through the `gemm`
//! crate (runtime-dispatched AVX2/AVX-512 kernels), the element-wise work in `row_kernels`
//! (dispatched the same way), everything row-parallel on a rayon pool of exactly the threads
//! the worker was granted.
//!
//! Sequences are packed back to back, so token-wise layers (projections, feed-forward, norms)
//! never compute on padding; only attention looks at sequence boundaries.

use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use gemm::{Parallelism, gemm};
use rayon::prelude::*;

use super::bert::{BertWeights, LayerNorm, Linear, PackedBatch, SentenceEncoder};
use super::row_kernels::{self, layer_norm_row, softmax_in_place};

/// BERT sentence encoder on the CPU.
pub struct CpuEncoder {
    weights: Arc<BertWeights>,
    pool: rayon::ThreadPool,
    threads: usize,
}

impl CpuEncoder {
    /// An encoder that computes with `threads` threads.
    pub fn new(weights: Arc<BertWeights>, threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("flumen-embed-cpu-{i}"))
            .build()
            .map_err(|e| DataFusionError::Execution(format!("embed CPU thread pool: {e}")))?;
        Ok(Self {
            weights,
            pool,
            threads,
        })
    }

    /// Threads this encoder computes with.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn forward(&self, batch: &PackedBatch) -> Result<Vec<f32>> {
        let w = &self.weights;
        let cfg = &w.config;
        let h = cfg.hidden;
        let tokens = batch.ids.len();
        if tokens == 0 {
            return Ok(vec![]);
        }
        let offsets = batch.offsets();
        let parallelism = if self.threads > 1 {
            Parallelism::Rayon(self.threads)
        } else {
            Parallelism::None
        };

        let mut x = vec![0f32; tokens * h];
        for (&start, &len) in offsets.iter().zip(&batch.lengths) {
            if len > cfg.max_positions {
                return Err(DataFusionError::Execution(format!(
                    "embed(): sequence of {len} tokens exceeds the model's {} positions",
                    cfg.max_positions
                )));
            }
            for pos in 0..len {
                let id = batch.ids[start + pos] as usize;
                if id >= cfg.vocab {
                    return Err(DataFusionError::Execution(format!(
                        "embed(): token id {id} outside the model's vocabulary of {}",
                        cfg.vocab
                    )));
                }
                let row = &mut x[(start + pos) * h..(start + pos + 1) * h];
                let word = &w.word_embeddings[id * h..(id + 1) * h];
                let position = &w.position_embeddings[pos * h..(pos + 1) * h];
                for i in 0..h {
                    row[i] = word[i] + position[i] + w.token_type_embedding[i];
                }
            }
        }
        layer_norm_rows(&mut x, None, &w.embedding_norm, cfg.layer_norm_eps, h);

        for layer in &w.layers {
            let qkv = linear(&x, tokens, &layer.qkv, parallelism);
            let context = attention(&qkv, &offsets, &batch.lengths, cfg.heads, cfg.head_dim());
            let mut attended = linear(&context, tokens, &layer.attention_out, parallelism);
            layer_norm_rows(
                &mut attended,
                Some(&x),
                &layer.attention_norm,
                cfg.layer_norm_eps,
                h,
            );
            let mut inner = linear(&attended, tokens, &layer.intermediate, parallelism);
            gelu_in_place(&mut inner);
            let mut out = linear(&inner, tokens, &layer.output, parallelism);
            layer_norm_rows(
                &mut out,
                Some(&attended),
                &layer.output_norm,
                cfg.layer_norm_eps,
                h,
            );
            x = out;
        }
        Ok(mean_pool_normalize(&x, &offsets, &batch.lengths, h))
    }
}

impl SentenceEncoder for CpuEncoder {
    fn encode(&mut self, batch: &PackedBatch) -> Result<Vec<f32>> {
        self.pool.install(|| self.forward(batch))
    }

    fn device(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }
}

/// `x · weight + bias` for `rows` rows of `x`.
fn linear(x: &[f32], rows: usize, layer: &Linear, parallelism: Parallelism) -> Vec<f32> {
    let (k, n) = (layer.inputs, layer.outputs);
    debug_assert_eq!(x.len(), rows * k);
    let mut out = Vec::with_capacity(rows * n);
    for _ in 0..rows {
        out.extend_from_slice(&layer.bias);
    }
    // SAFETY: every matrix is row-major and exactly as large as its shape says.
    unsafe {
        gemm(
            rows,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            true,
            x.as_ptr(),
            1,
            k as isize,
            layer.weight.as_ptr(),
            1,
            n as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    out
}

/// A pointer shared by tasks that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: only used where each task writes a region no other task touches.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

/// Multi-head self-attention of each sequence over itself. `qkv` holds `[q | k | v]` per
/// token (`3 * heads * head_dim` wide); returns the context, `heads * head_dim` wide.
fn attention(
    qkv: &[f32],
    offsets: &[usize],
    lengths: &[usize],
    heads: usize,
    head_dim: usize,
) -> Vec<f32> {
    let h = heads * head_dim;
    let stride = 3 * h;
    let tokens = qkv.len() / stride;
    let mut context = vec![0f32; tokens * h];
    let out = SharedMut(context.as_mut_ptr());
    let scale = 1.0 / (head_dim as f32).sqrt();
    (0..offsets.len() * heads).into_par_iter().for_each(|task| {
        // Capture the whole `SharedMut` (it is `Send`), not its raw pointer field.
        #[allow(clippy::redundant_locals)]
        let out = out;
        let (seq, head) = (task / heads, task % heads);
        let (start, len) = (offsets[seq], lengths[seq]);
        let q = qkv[start * stride + head * head_dim..].as_ptr();
        let k = qkv[start * stride + h + head * head_dim..].as_ptr();
        let v = qkv[start * stride + 2 * h + head * head_dim..].as_ptr();
        let mut scores = vec![0f32; len * len];
        // SAFETY: q, k, v rows lie inside `qkv`; this task alone writes rows
        // start..start+len, columns head*head_dim.. of `context`.
        unsafe {
            // scores = scale · Q Kᵀ
            gemm(
                len,
                len,
                head_dim,
                scores.as_mut_ptr(),
                1,
                len as isize,
                false,
                q,
                1,
                stride as isize,
                k,
                stride as isize,
                1,
                0.0,
                scale,
                false,
                false,
                false,
                Parallelism::None,
            );
            for row in scores.chunks_exact_mut(len) {
                softmax_in_place(row);
            }
            // context = softmax(scores) V
            gemm(
                len,
                head_dim,
                len,
                out.0.add(start * h + head * head_dim),
                1,
                h as isize,
                false,
                scores.as_ptr(),
                1,
                len as isize,
                v,
                1,
                stride as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                Parallelism::None,
            );
        }
    });
    context
}

/// `x = LayerNorm(x + residual)` row by row.
fn layer_norm_rows(
    x: &mut [f32],
    residual: Option<&[f32]>,
    norm: &LayerNorm,
    eps: f32,
    width: usize,
) {
    x.par_chunks_mut(width).enumerate().for_each(|(r, row)| {
        let residual = residual.map(|residual| &residual[r * width..(r + 1) * width]);
        layer_norm_row(row, residual, &norm.gamma, &norm.beta, eps);
    });
}

/// BERT's exact (erf) GELU, in place, in parallel pieces.
fn gelu_in_place(x: &mut [f32]) {
    x.par_chunks_mut(4096).for_each(row_kernels::gelu_in_place);
}

/// Mean over each sequence's tokens, then L2 normalisation (as sentence-transformers'
/// Pooling + Normalize modules).
fn mean_pool_normalize(x: &[f32], offsets: &[usize], lengths: &[usize], h: usize) -> Vec<f32> {
    let mut out = vec![0f32; offsets.len() * h];
    for (s, (&start, &len)) in offsets.iter().zip(lengths).enumerate() {
        let pooled = &mut out[s * h..(s + 1) * h];
        for t in start..start + len {
            for (p, v) in pooled.iter_mut().zip(&x[t * h..(t + 1) * h]) {
                *p += v;
            }
        }
        let inv_len = 1.0 / len.max(1) as f32;
        pooled.iter_mut().for_each(|p| *p *= inv_len);
        let norm = pooled.iter().map(|p| p * p).sum::<f32>().sqrt().max(1e-12);
        pooled.iter_mut().for_each(|p| *p /= norm);
    }
    out
}
