//! The CPU backend: BERT forward over packed sequences, matrix products through the
//! `gemm-f32` crate (runtime-dispatched AVX2/AVX-512 kernels), the element-wise work in the
//! `flumen-row-kernels` crate beside this file (`row_kernels/`, dispatched the same way),
//! everything row-parallel on a rayon pool of exactly the threads the worker was granted.
//!
//! Sequences are packed back to back, so token-wise layers (projections, feed-forward, norms)
//! never compute on padding; only attention looks at sequence boundaries.
//!
//! [`CpuEncoder::emulating_bf16`] computes as a half-precision GPU path would (issue 69):
//! weights, embeddings and every stored activation rounded to bfloat16, products summed in
//! fp32 (as tensor cores accumulate), norms and softmax in fp32 over bf16 inputs. It is as
//! slow as fp32 or slower; it exists to measure bf16's numerics against fp32 without a GPU.

use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};
use gemm_common::Parallelism;
use rayon::prelude::*;

use super::bert::{BertWeights, LayerNorm, Linear, PackedBatch, SentenceEncoder};
use flumen_row_kernels::{layer_norm_row, round_all_to_bf16, softmax_in_place};

/// BERT sentence encoder on the CPU.
pub struct CpuEncoder {
    weights: Arc<BertWeights>,
    pool: rayon::ThreadPool,
    threads: usize,
    /// The forward pass's activations, kept from one pass to the next.
    scratch: Scratch,
    /// Round weights and activations to bfloat16 ([`CpuEncoder::emulating_bf16`]).
    bf16: bool,
}

/// `weights` as a bf16 path would hold them: embeddings and matrices rounded to bfloat16;
/// biases and norms stay fp32 (applied in fp32 epilogues).
fn bf16_weights(weights: &BertWeights) -> BertWeights {
    let mut rounded = weights.clone();
    round_all_to_bf16(&mut rounded.word_embeddings);
    round_all_to_bf16(&mut rounded.position_embeddings);
    round_all_to_bf16(&mut rounded.token_type_embedding);
    for layer in &mut rounded.layers {
        for linear in [
            &mut layer.qkv,
            &mut layer.attention_out,
            &mut layer.intermediate,
            &mut layer.output,
        ] {
            round_all_to_bf16(&mut linear.weight);
        }
    }
    rounded
}

/// A forward pass's activations (`[tokens, width]` each), kept by the encoder and reused by
/// every layer of every pass: allocated afresh, each pass's megabytes were page faults (with
/// jemalloc handing idle pages back between tasks: ~10% of the README's main job in `perf`).
/// They stay as large as the largest pass so far.
#[derive(Default)]
struct Scratch {
    /// The layer's input, then its output.
    x: Vec<f32>,
    qkv: Vec<f32>,
    context: Vec<f32>,
    attended: Vec<f32>,
    inner: Vec<f32>,
    out: Vec<f32>,
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
            scratch: Scratch::default(),
            bf16: false,
        })
    }

    /// An encoder that emulates a bfloat16 path (module docs): for checking its numerics
    /// against fp32 on a machine without a GPU.
    pub fn emulating_bf16(weights: &BertWeights, threads: usize) -> Result<Self> {
        let mut encoder = Self::new(Arc::new(bf16_weights(weights)), threads)?;
        encoder.bf16 = true;
        Ok(encoder)
    }

    /// Threads this encoder computes with.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn forward(&self, batch: &PackedBatch, scratch: &mut Scratch) -> Result<Vec<f32>> {
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

        let Scratch {
            x,
            qkv,
            context,
            attended,
            inner,
            out,
        } = scratch;
        x.clear();
        x.resize(tokens * h, 0.0);
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
        layer_norm_rows(x, None, &w.embedding_norm, cfg.layer_norm_eps, h);
        // A bf16 path stores each op's output in bf16 (`store` rounds; fp32: a no-op).
        let bf16 = self.bf16;
        let store = |values: &mut Vec<f32>| {
            if bf16 {
                round_all_to_bf16(values);
            }
        };
        store(x);

        for layer in &w.layers {
            linear(x, tokens, &layer.qkv, parallelism, qkv);
            store(qkv);
            attention(
                qkv,
                &offsets,
                &batch.lengths,
                (cfg.heads, cfg.head_dim()),
                bf16,
                context,
            );
            store(context);
            linear(context, tokens, &layer.attention_out, parallelism, attended);
            layer_norm_rows(
                attended,
                Some(x),
                &layer.attention_norm,
                cfg.layer_norm_eps,
                h,
            );
            store(attended);
            linear(attended, tokens, &layer.intermediate, parallelism, inner);
            gelu_in_place(inner);
            store(inner);
            linear(inner, tokens, &layer.output, parallelism, out);
            layer_norm_rows(
                out,
                Some(attended),
                &layer.output_norm,
                cfg.layer_norm_eps,
                h,
            );
            store(out);
            std::mem::swap(x, out);
        }
        Ok(mean_pool_normalize(x, &offsets, &batch.lengths, h))
    }
}

impl SentenceEncoder for CpuEncoder {
    fn encode(&mut self, batch: &PackedBatch) -> Result<Vec<f32>> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let encoded = self.pool.install(|| self.forward(batch, &mut scratch));
        self.scratch = scratch;
        encoded
    }

    fn device(&self) -> String {
        let emulated = if self.bf16 { " bf16 emulated" } else { "" };
        format!("cpu ({} threads){emulated}", self.threads)
    }

    fn bf16(&self) -> bool {
        self.bf16
    }
}

/// `out = x · weight + bias` for `rows` rows of `x`.
fn linear(x: &[f32], rows: usize, layer: &Linear, parallelism: Parallelism, out: &mut Vec<f32>) {
    let (k, n) = (layer.inputs, layer.outputs);
    debug_assert_eq!(x.len(), rows * k);
    out.clear();
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
            parallelism,
        );
    }
}

/// `dst = alpha·dst + beta·(lhs · rhs)` over f32 matrices given by shape and strides (row
/// stride `_rs`, column stride `_cs`, none negative): gemm-f32's kernel, with `dst` turned
/// column-major as its microkernels prefer (`dstᵀ = rhsᵀ · lhsᵀ`). The `gemm` crate's entry
/// point does the same and also builds the f64, f16 and complex kernels, which `embed` never
/// calls (~45 s of every clean build at their opt-level 3).
///
/// # Safety
/// Every matrix lies in memory its pointer may read (or, for `dst`, write) at every index
/// its shape and strides reach.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_cs: isize,
    dst_rs: isize,
    read_dst: bool,
    lhs: *const f32,
    lhs_cs: isize,
    lhs_rs: isize,
    rhs: *const f32,
    rhs_cs: isize,
    rhs_rs: isize,
    alpha: f32,
    beta: f32,
    parallelism: Parallelism,
) {
    debug_assert!(
        [dst_cs, dst_rs, lhs_cs, lhs_rs, rhs_cs, rhs_rs]
            .iter()
            .all(|&s| s >= 0)
    );
    // Column-major `dst` as is; row-major `dst` as its transpose, `dstᵀ = rhsᵀ · lhsᵀ`.
    let (m, n, dst_cs, dst_rs, lhs, lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs) = if dst_cs < dst_rs {
        (
            n, m, dst_rs, dst_cs, rhs, rhs_rs, rhs_cs, lhs, lhs_rs, lhs_cs,
        )
    } else {
        (
            m, n, dst_cs, dst_rs, lhs, lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs,
        )
    };
    let kernel = gemm_f32::gemm::f32::get_gemm_fn();
    // SAFETY: as the caller promised; the transposed call reads and writes the same elements.
    unsafe {
        kernel(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            read_dst,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            alpha,
            beta,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// A pointer shared by tasks that write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: only used where each task writes a region no other task touches.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

/// Multi-head self-attention of each sequence over itself. `qkv` holds `[q | k | v]` per
/// token (`3 * heads * head_dim` wide); `context` gets the context, `heads * head_dim` wide.
/// `bf16`: the softmax's weights are rounded to bfloat16 before they weigh V.
fn attention(
    qkv: &[f32],
    offsets: &[usize],
    lengths: &[usize],
    (heads, head_dim): (usize, usize),
    bf16: bool,
    context: &mut Vec<f32>,
) {
    let h = heads * head_dim;
    let stride = 3 * h;
    let tokens = qkv.len() / stride;
    context.clear();
    context.resize(tokens * h, 0.0);
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
                Parallelism::None,
            );
            for row in scores.chunks_exact_mut(len) {
                softmax_in_place(row);
            }
            if bf16 {
                round_all_to_bf16(&mut scores);
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
                Parallelism::None,
            );
        }
    });
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
    x.par_chunks_mut(4096)
        .for_each(flumen_row_kernels::gelu_in_place);
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
