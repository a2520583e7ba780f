//! The element-wise work of flumen's CPU BERT forward (`flumen::functions::embedding::cpu`)
//! — the attention softmax, GELU, layer norm, and bfloat16 rounding — as loops that
//! vectorize, compiled twice on x86-64 (for the portable baseline the crate is built for, and
//! for AVX-512) with the AVX-512 copy picked at run time where the CPU has it.
//!
//! Built for the baseline alone, these loops ran 4 lanes wide, and a row's maximum and sum
//! one element at a time (a float sum in order cannot be reordered by the compiler): the
//! softmax was 21% of a long document's forward time, beside 61% in matrix products. Here
//! reductions keep [`LANES`] partial results, so they vectorize too.
//!
//! A crate of its own so that every build optimizes it (the root `Cargo.toml` sets its
//! opt-level, as it does gemm-f32's): unoptimized, these loops took 60% of the CPU model's
//! time in test builds, which run the real model over thousands of texts. So no kernel that
//! loops is `#[inline]`: an inline function is compiled in the crate that calls it, at that
//! crate's opt-level. A call per row (softmax, layer norm) or per 4,096 values (GELU) costs
//! nothing beside the row's work.
//!
//! The model load's two loops (reading a tensor's bytes, transposing a weight matrix) are
//! here for the same reason: every process that embeds pays them once.

#![warn(missing_docs)]

/// Partial results a reduction keeps: one AVX-512 register of `f32`.
const LANES: usize = 16;

/// Runs `$body` compiled for AVX-512 when this CPU has it, else as built.
macro_rules! with_widest_vectors {
    ($name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty $body:block) => {
        #[inline(always)]
        fn portable($($arg: $ty),*) -> $ret $body

        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") && !portable_only() {
            #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")]
            unsafe fn $name($($arg: $ty),*) -> $ret {
                portable($($arg),*)
            }
            // SAFETY: the CPU has the features the copy was compiled for.
            return unsafe { $name($($arg),*) };
        }
        return portable($($arg),*);
    };
}

/// Whether this thread's tests asked for the portable copies.
#[cfg(test)]
fn portable_only() -> bool {
    tests::PORTABLE_ONLY.with(|flag| flag.get())
}

#[cfg(not(test))]
#[inline(always)]
fn portable_only() -> bool {
    false
}

/// A row of attention scores made probabilities: `e^(x - max) / Σ e^(x - max)`.
pub fn softmax_in_place(row: &mut [f32]) {
    with_widest_vectors!(softmax_avx512(row: &mut [f32]) -> () {
        let max = max_of(row);
        let mut sums = [0f32; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            for (value, sum) in chunk.iter_mut().zip(&mut sums) {
                *value = exp_nonpositive(*value - max);
                *sum += *value;
            }
        }
        let mut sum = 0f32;
        for value in chunks.into_remainder() {
            *value = exp_nonpositive(*value - max);
            sum += *value;
        }
        let inv = 1.0 / (sum + sums.iter().sum::<f32>());
        for value in row.iter_mut() {
            *value *= inv;
        }
    });
}

/// BERT's exact (erf) GELU over `values`, in place.
pub fn gelu_in_place(values: &mut [f32]) {
    with_widest_vectors!(gelu_avx512(values: &mut [f32]) -> () {
        for v in values.iter_mut() {
            *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
        }
    });
}

/// `row = LayerNorm(row + residual) · gamma + beta` for one token's row.
pub fn layer_norm_row(
    row: &mut [f32],
    residual: Option<&[f32]>,
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) {
    with_widest_vectors!(layer_norm_avx512(
        row: &mut [f32],
        residual: Option<&[f32]>,
        gamma: &[f32],
        beta: &[f32],
        eps: f32
    ) -> () {
        if let Some(residual) = residual {
            for (v, add) in row.iter_mut().zip(residual) {
                *v += add;
            }
        }
        let width = row.len() as f32;
        let mean = sum_of(row, |v| v) / width;
        let var = sum_of(row, |v| (v - mean) * (v - mean)) / width;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, g), b) in row.iter_mut().zip(gamma).zip(beta) {
            *v = (*v - mean) * inv * g + b;
        }
    });
}

/// The largest value of `row` (−∞ when empty), kept in [`LANES`] partial maxima.
#[inline(always)]
fn max_of(row: &[f32]) -> f32 {
    let mut maxima = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in maxima.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    rest.iter()
        .chain(&maxima)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// `Σ f(v)` over `row`, kept in [`LANES`] partial sums.
#[inline(always)]
fn sum_of(row: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut sums = [0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (s, &v) in sums.iter_mut().zip(chunk) {
            *s += f(v);
        }
    }
    rest.iter().map(|&v| f(v)).sum::<f32>() + sums.iter().sum::<f32>()
}

/// e^x for x ≤ 0 (a softmax input less its row's maximum), branch-free so that a loop over
/// it vectorizes, where libm's `expf` is a call per element: x = n·ln 2 + r with
/// |r| ≤ ln 2 / 2, e^r by Cephes' degree-6 polynomial (relative error below 2e-7), 2^n put
/// straight into the exponent bits. Below -87, where e^x is under f32's smallest normal
/// number, it gives e^-87.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    // 1.5 · 2^23: a sum with it in [2^23, 2^24) has no fraction bits, so adding it rounds to
    // the nearest integer, which its low mantissa bits then hold (an `as i32` would not
    // vectorize: Rust's cast saturates, one element at a time).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 0.0);
    let rounded = x * std::f32::consts::LOG2_E + ROUND;
    let nf = rounded - ROUND;
    // n in [-126, 0], as the difference of the two sums' bits (two's complement).
    let n = rounded.to_bits().wrapping_sub(ROUND.to_bits());
    let r = x - nf * 0.693_359_4 + nf * 2.121_944_4e-4;
    let mut p = 1.987_569_2e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    e_r * f32::from_bits(n.wrapping_add(127) << 23)
}

/// erf as a rational function on [-4, 4] (beyond that it is ±1 in f32); absolute error
/// below 1e-7. Branch-free, so loops over it vectorize.
#[inline(always)]
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

/// `x` rounded to the nearest bfloat16 (ties to even), as an f32: the top 16 bits kept.
#[inline(always)]
pub fn round_to_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(rounded)
}

/// Every value of `values` rounded to bfloat16.
pub fn round_all_to_bf16(values: &mut [f32]) {
    for v in values.iter_mut() {
        *v = round_to_bf16(*v);
    }
}

/// Little-endian `f32` bytes (a safetensors tensor's data) as values; a trailing partial
/// value is dropped. Here rather than at the model's load so that test builds run it
/// optimized: unoptimized, this loop and [`transpose`] were most of a model load there
/// (about 1 s of every process that loads the model).
pub fn f32s_from_le_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A row-major `[rows, cols]` matrix as its row-major `[cols, rows]` transpose.
pub fn transpose(matrix: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(matrix.len(), rows * cols, "a {rows} x {cols} matrix");
    let mut out = vec![0.0; matrix.len()];
    for (r, row) in matrix.chunks_exact(cols.max(1)).enumerate() {
        for (c, &value) in row.iter().enumerate() {
            out[c * rows + r] = value;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        /// Set by [`on_both_copies`] to run the kernels as built for the baseline.
        pub(super) static PORTABLE_ONLY: Cell<bool> = const { Cell::new(false) };
    }

    /// Runs `check` with the widest copies this CPU has, then with the portable ones.
    fn on_both_copies(check: impl Fn()) {
        check();
        PORTABLE_ONLY.with(|flag| flag.set(true));
        check();
        PORTABLE_ONLY.with(|flag| flag.set(false));
    }

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

    /// Every length around the lane width, against the textbook formula in f64.
    #[test]
    fn softmax_matches_the_formula_at_every_length() {
        on_both_copies(|| {
            for len in 1..=70 {
                let row: Vec<f32> = (0..len)
                    .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7)
                    .collect();
                let max = row
                    .iter()
                    .copied()
                    .fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
                let total: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
                let mut got = row.clone();
                softmax_in_place(&mut got);
                for (&g, &v) in got.iter().zip(&row) {
                    let want = (v as f64 - max).exp() / total;
                    assert!((g as f64 - want).abs() < 1e-6, "len {len}: {g} vs {want}");
                }
            }
        });
    }

    #[test]
    fn layer_norm_matches_the_formula() {
        on_both_copies(|| {
            for width in [1, 15, 16, 17, 384] {
                let row: Vec<f32> = (0..width).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
                let residual: Vec<f32> = (0..width).map(|i| i as f32 * 0.01).collect();
                let gamma: Vec<f32> = (0..width).map(|i| 1.0 + i as f32 * 0.001).collect();
                let beta: Vec<f32> = (0..width).map(|i| i as f32 * -0.002).collect();
                let mut got = row.clone();
                layer_norm_row(&mut got, Some(&residual), &gamma, &beta, 1e-12);
                let x: Vec<f64> = row
                    .iter()
                    .zip(&residual)
                    .map(|(a, b)| (a + b) as f64)
                    .collect();
                let mean = x.iter().sum::<f64>() / width as f64;
                let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / width as f64;
                for i in 0..width {
                    let want =
                        (x[i] - mean) / (var + 1e-12).sqrt() * gamma[i] as f64 + beta[i] as f64;
                    assert!((got[i] as f64 - want).abs() < 1e-4, "width {width}, {i}");
                }
            }
        });
    }

    #[test]
    fn gelu_matches_the_formula() {
        on_both_copies(|| {
            let mut values: Vec<f32> = (-500..500).map(|i| i as f32 / 50.0).collect();
            let inputs = values.clone();
            gelu_in_place(&mut values);
            for (&g, &x) in values.iter().zip(&inputs) {
                let want = 0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2));
                assert!(
                    (g as f64 - want).abs() < 1e-6,
                    "gelu({x}) = {g}, want {want}"
                );
            }
        });
    }

    #[test]
    fn rounding_to_bf16_keeps_eight_bits_of_mantissa_ties_to_even() {
        assert_eq!(round_to_bf16(1.0), 1.0);
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even one, 1.
        assert_eq!(round_to_bf16(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: to the even, 1 + 2^-6.
        assert_eq!(
            round_to_bf16(1.0 + 3.0 * 2f32.powi(-8)),
            1.0 + 2f32.powi(-6)
        );
        assert_eq!(round_to_bf16(1.0 + 2f32.powi(-7)), 1.0 + 2f32.powi(-7));
        assert_eq!(round_to_bf16(-3.3), -3.296875);
        assert!(round_to_bf16(f32::NAN).is_nan());
        assert_eq!(round_to_bf16(f32::INFINITY), f32::INFINITY);
        let x = 0.123_456_79_f32;
        assert!((round_to_bf16(x) - x).abs() <= x * 2f32.powi(-8));
        let mut all = [1.0 + 2f32.powi(-8), -3.3];
        round_all_to_bf16(&mut all);
        assert_eq!(all, [1.0, -3.296875]);
    }

    #[test]
    fn tensor_bytes_are_read_little_endian_and_matrices_transposed() {
        let values = [1.5f32, -0.0, f32::MAX, 3.25e-8];
        let mut bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes.push(0xAB);
        let read = f32s_from_le_bytes(&bytes);
        assert_eq!(
            read.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            values.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3),
            vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
        );
        assert_eq!(transpose(&[], 0, 3), Vec::<f32>::new());
    }
}
