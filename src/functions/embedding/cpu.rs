//! The CPU backend: BERT forward over packed sequences, matrix products through the `gemm`
//! crate (runtime-dispatched AVX2/AVX-512 kernels), everything else row-parallel on a rayon
//! pool of exactly the threads the worker was granted.
//!
//! Sequences are packed back to back, so token-wise layers (projections, feed-forward, norms)
//! never compute on padding; only attention looks at sequence boundaries.

use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use gemm::{Parallelism, gemm};
use rayon::prelude::*;

use super::bert::{BertWeights, LayerNorm, Linear, PackedBatch, SentenceEncoder};

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

fn softmax_in_place(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for value in row.iter_mut() {
        *value = exp_nonpositive(*value - max);
    }
    let sum: f32 = row.iter().sum();
    let inv = 1.0 / sum;
    for value in row.iter_mut() {
        *value *= inv;
    }
}

/// e^x for x ≤ 0 (a softmax input less its row's maximum), branch-free so that a loop over
/// it vectorizes, where libm's `expf` is a call per element (8% of a long document's forward
/// time): x = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by Cephes' degree-6 polynomial (relative
/// error below 2e-7), 2^n put straight into the exponent bits. Below -87, where e^x is
/// under f32's smallest normal number, it gives e^-87.
#[inline]
pub fn exp_nonpositive(x: f32) -> f32 {
    let x = x.clamp(-87.0, 0.0);
    // Round to nearest by truncation, for a value ≤ 0.
    let n = (x * std::f32::consts::LOG2_E - 0.5) as i32;
    let nf = n as f32;
    let r = x - nf * 0.693_359_4 + nf * 2.121_944_4e-4;
    let mut p = 1.987_569_2e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    e_r * f32::from_bits(((n + 127) as u32) << 23)
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
        if let Some(residual) = residual {
            for (v, add) in row.iter_mut().zip(&residual[r * width..(r + 1) * width]) {
                *v += add;
            }
        }
        let mean = row.iter().sum::<f32>() / width as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / width as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, g), b) in row.iter_mut().zip(&norm.gamma).zip(&norm.beta) {
            *v = (*v - mean) * inv * g + b;
        }
    });
}

/// BERT's exact (erf) GELU, in place.
fn gelu_in_place(x: &mut [f32]) {
    x.par_chunks_mut(4096).for_each(|chunk| {
        for v in chunk {
            *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
        }
    });
}

/// erf as a rational function on [-4, 4] (beyond that it is ±1 in f32); absolute error
/// below 1e-7. Branch-free, so loops over it vectorize.
#[inline]
pub fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_3e-10_f32;
    p = p * x2 + 2.770_681_4e-8;
    p = p * x2 - 2.101_024e-6;
    p = p * x2 - 5.692_506_4e-5;
    p = p * x2 - 7.349_906_3e-4;
    p = p * x2 - 2.954_6e-3;
    p = p * x2 - 1.609_603_3e-2;
    let mut q = -1.456_607_2e-5_f32;
    q = q * x2 - 2.133_740_6e-4;
    q = q * x2 - 1.682_827e-3;
    q = q * x2 - 7.373_329e-3;
    q = q * x2 - 1.426_474e-2;
    x * p / q
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_libm() {
        let worst = (-6000..6000)
            .map(|i| i as f32 / 1000.0)
            .map(|x| (erf(x) - libm::erff(x)).abs())
            .fold(0.0, f32::max);
        assert!(worst < 5e-7, "max |erf - libm::erff| = {worst}");
    }

    #[test]
    fn exp_matches_libm_below_zero() {
        let worst = (0..=870_000)
            .map(|i| -(i as f32) / 10_000.0)
            .map(|x| ((exp_nonpositive(x) - x.exp()) / x.exp()).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-6, "max relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1000.0) < 1e-37);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut row = vec![1.0, 2.0, 3.0, 1000.0];
        softmax_in_place(&mut row);
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(row[3] > 0.999);
    }
}
