//! CPU reference allreduce: the oracle every kernel result is checked against.
//!
//! # The determinism contract
//!
//! For inputs `x_0 .. x_{N-1}` from `N` ranks, element `i` of the result is
//!
//! ```text
//! out[i] = round_to_T( ((x_0[i] + x_1[i]) + x_2[i]) + ... + x_{N-1}[i] )
//! ```
//!
//! - the sum is taken in `f32`, strictly in rank order `0, 1, .., N-1`;
//! - the accumulator starts as rank 0's value, not `+0.0` (`+0.0 + -0.0` is
//!   `+0.0`, so a `+0.0` seed would turn an all `-0.0` sum into `+0.0`);
//! - `f16` and `bf16` inputs are widened exactly to `f32`, and the final sum
//!   is rounded once to the element type, to nearest with ties to even
//!   (overflow goes to infinity). Rounding each partial sum in `f32` first and
//!   then once more to `T` is part of the contract, double rounding included;
//! - no flush of subnormals to zero, in inputs, partial sums or the result.
//!
//! Two results agree when their bits are equal, except that any NaN matches
//! any NaN (payload and sign of a NaN are not part of the contract). See
//! [`same_value`] and [`first_mismatch`].
//!
//! This module is written independently of the kernel crate: conversions come
//! from the `half` crate and additions are plain host `f32` additions, so a bug
//! in `device::numeric` or `device::reduce` cannot hide in both places.
//!
//! Element values travel as raw bits (`u32` for `f32`, `u16` for the 16-bit
//! types, or every type's bits in the low bits of a `u32` for the
//! dtype-generic entry points) so that NaN payloads and signed zeros reach the
//! oracle untouched.
//!
//! The functions here are test oracles, not a user path: malformed arguments
//! (no ranks, ranks of different lengths, 16-bit elements with stray high
//! bits) are test bugs and panic with a message saying which.

use crate::abi::Dtype;
use half::{bf16, f16};

/// Widens one element (bits in the low bits of `bits`) exactly to `f32`.
pub fn widen(dtype: Dtype, bits: u32) -> f32 {
    match dtype {
        Dtype::F32 => f32::from_bits(bits),
        Dtype::F16 => f16::from_bits(bits as u16).to_f32(),
        Dtype::Bf16 => bf16::from_bits(bits as u16).to_f32(),
    }
}

/// Rounds an `f32` to the element type (nearest, ties to even); the result's
/// bits are in the low bits.
pub fn narrow(dtype: Dtype, x: f32) -> u32 {
    match dtype {
        Dtype::F32 => x.to_bits(),
        Dtype::F16 => f16::from_f32(x).to_bits() as u32,
        Dtype::Bf16 => bf16::from_f32(x).to_bits() as u32,
    }
}

/// Whether the bits are a NaN of the element type.
pub fn is_nan(dtype: Dtype, bits: u32) -> bool {
    match dtype {
        Dtype::F32 => bits & 0x7fff_ffff > 0x7f80_0000,
        Dtype::F16 => bits & 0x7fff > 0x7c00,
        Dtype::Bf16 => bits & 0x7fff > 0x7f80,
    }
}

/// Bits equal, or both NaN.
pub fn same_value(dtype: Dtype, a_bits: u32, b_bits: u32) -> bool {
    a_bits == b_bits || (is_nan(dtype, a_bits) && is_nan(dtype, b_bits))
}

/// The first index where `got` and `want` differ in the sense of
/// [`same_value`], as `(index, got_bits, want_bits)`.
///
/// Panics if the lengths differ: a result of the wrong length is a failure
/// the caller should report as such, not as an element mismatch.
pub fn first_mismatch(dtype: Dtype, got: &[u32], want: &[u32]) -> Option<(usize, u32, u32)> {
    assert_eq!(
        got.len(),
        want.len(),
        "first_mismatch({}): result has {} elements, expected {}",
        dtype.name(),
        got.len(),
        want.len()
    );
    got.iter()
        .zip(want)
        .position(|(&g, &w)| !same_value(dtype, g, w))
        .map(|i| (i, got[i], want[i]))
}

/// Formats one element as `0x.... (value)` for assertion messages.
pub fn fmt_bits(dtype: Dtype, bits: u32) -> String {
    match dtype {
        Dtype::F32 => format!("{bits:#010x} ({:e})", widen(dtype, bits)),
        _ => format!("{bits:#06x} ({:e})", widen(dtype, bits)),
    }
}

/// Reduces one element's values from every rank, in rank order, per the
/// contract. Panics on an empty slice.
pub fn reduce_element(dtype: Dtype, values: &[u32]) -> u32 {
    let (first, rest) = values
        .split_first()
        .expect("reference allreduce needs at least one rank");
    let mut acc = widen(dtype, *first);
    for &v in rest {
        acc += widen(dtype, v);
    }
    narrow(dtype, acc)
}

/// Panics unless there is at least one rank and all ranks have one length;
/// returns that length.
fn check_shape<T>(what: &str, inputs: &[&[T]]) -> usize {
    assert!(
        !inputs.is_empty(),
        "{what}: reference allreduce needs at least one rank, got 0"
    );
    let len = inputs[0].len();
    for (r, x) in inputs.iter().enumerate() {
        assert_eq!(
            x.len(),
            len,
            "{what}: rank {r} has {} elements but rank 0 has {len}",
            x.len()
        );
    }
    len
}

/// Allreduce of `f32` inputs given as bits. Panics on zero ranks or ranks of
/// different lengths.
pub fn allreduce_f32(inputs: &[&[u32]]) -> Vec<u32> {
    let len = check_shape("allreduce_f32", inputs);
    (0..len)
        .map(|i| {
            let mut acc = f32::from_bits(inputs[0][i]);
            for x in &inputs[1..] {
                acc += f32::from_bits(x[i]);
            }
            acc.to_bits()
        })
        .collect()
}

/// Allreduce of `f16` inputs given as bits. Panics on zero ranks or ranks of
/// different lengths.
pub fn allreduce_f16(inputs: &[&[u16]]) -> Vec<u16> {
    let len = check_shape("allreduce_f16", inputs);
    (0..len)
        .map(|i| {
            let mut acc = f16::from_bits(inputs[0][i]).to_f32();
            for x in &inputs[1..] {
                acc += f16::from_bits(x[i]).to_f32();
            }
            f16::from_f32(acc).to_bits()
        })
        .collect()
}

/// Allreduce of `bf16` inputs given as bits. Panics on zero ranks or ranks of
/// different lengths.
pub fn allreduce_bf16(inputs: &[&[u16]]) -> Vec<u16> {
    let len = check_shape("allreduce_bf16", inputs);
    (0..len)
        .map(|i| {
            let mut acc = bf16::from_bits(inputs[0][i]).to_f32();
            for x in &inputs[1..] {
                acc += bf16::from_bits(x[i]).to_f32();
            }
            bf16::from_f32(acc).to_bits()
        })
        .collect()
}

/// Dtype-generic allreduce: every element's bits in the low bits of a `u32`.
///
/// Panics on zero ranks, ranks of different lengths, or (16-bit types) an
/// element with any of its high 16 bits set, which would mean the caller
/// packed its data wrongly.
pub fn allreduce_bits(dtype: Dtype, inputs: &[&[u32]]) -> Vec<u32> {
    check_shape("allreduce_bits", inputs);
    match dtype {
        Dtype::F32 => allreduce_f32(inputs),
        Dtype::F16 | Dtype::Bf16 => {
            let narrow_inputs: Vec<Vec<u16>> = inputs
                .iter()
                .enumerate()
                .map(|(r, x)| {
                    x.iter()
                        .enumerate()
                        .map(|(i, &b)| {
                            assert!(
                                b >> 16 == 0,
                                "allreduce_bits({}): rank {r} element {i} is {b:#x}, \
                                 which has bits above the 16-bit element",
                                dtype.name()
                            );
                            b as u16
                        })
                        .collect()
                })
                .collect();
            let refs: Vec<&[u16]> = narrow_inputs.iter().map(Vec::as_slice).collect();
            let out = if dtype == Dtype::F16 {
                allreduce_f16(&refs)
            } else {
                allreduce_bf16(&refs)
            };
            out.into_iter().map(u32::from).collect()
        }
    }
}

/// Elements per chunk of the sum of squares (docs/numerics.md; the same
/// number as the kernels' `abi::NORM_CHUNK`, written here on its own).
pub const RMS_CHUNK: usize = 8;

/// The fused allreduce + residual add + RMSNorm of one rank, as
/// docs/numerics.md defines it: `(residual_out, normed)` for inputs of
/// `rows x hidden` elements (`hidden = gamma.len()`), this rank's
/// `residual` and `gamma`, and `eps`:
///
/// - `sum` = [`allreduce_bits`] (rank-order f32 sum, rounded to the type);
/// - `residual_out = round(f32(sum) + f32(residual))`;
/// - per row, `q_j = f32(residual_out_j)`; chunks of [`RMS_CHUNK`] columns,
///   each `((q_0^2 + q_1^2) + ...)` in column order (squares and sums
///   rounded to f32); then the chunk sums in a pairwise tree: at stride
///   `s = 1, 2, 4, ...`, chunk `k` (a multiple of `2s`) adds chunk `k + s`
///   when it exists; `ss` is chunk 0's;
/// - `inv = 1 / sqrt(ss / hidden + eps)` (each operation correctly rounded
///   in f32);
/// - `normed_j = round((q_j * inv) * f32(gamma_j))`.
///
/// Panics as [`allreduce_bits`] does, or if the inputs are not whole rows.
pub fn add_rmsnorm_bits(
    dtype: Dtype,
    inputs: &[&[u32]],
    residual: &[u32],
    gamma: &[u32],
    eps: f32,
) -> (Vec<u32>, Vec<u32>) {
    let sum = allreduce_bits(dtype, inputs);
    let hidden = gamma.len();
    if hidden == 0 {
        assert!(sum.is_empty(), "add_rmsnorm_bits: rows of hidden size 0");
        return (Vec::new(), Vec::new());
    }
    assert_eq!(
        sum.len() % hidden,
        0,
        "add_rmsnorm_bits: {} elements are not whole rows of {hidden}",
        sum.len()
    );
    assert!(
        residual.len() >= sum.len(),
        "add_rmsnorm_bits: residual too short"
    );
    let mut res_out = Vec::with_capacity(sum.len());
    let mut normed = Vec::with_capacity(sum.len());
    for row in 0..sum.len() / hidden {
        let base = row * hidden;
        let q: Vec<f32> = (0..hidden)
            .map(|j| {
                let ro = narrow(
                    dtype,
                    widen(dtype, sum[base + j]) + widen(dtype, residual[base + j]),
                );
                res_out.push(ro);
                widen(dtype, ro)
            })
            .collect();
        let mut parts: Vec<f32> = q
            .chunks(RMS_CHUNK)
            .map(|c| {
                let mut acc = c[0] * c[0];
                for &v in &c[1..] {
                    acc += v * v;
                }
                acc
            })
            .collect();
        let n = parts.len();
        let mut s = 1;
        while s < n {
            let mut k = 0;
            while k + s < n {
                parts[k] += parts[k + s];
                k += 2 * s;
            }
            s *= 2;
        }
        let inv = 1.0f32 / (parts[0] / hidden as f32 + eps).sqrt();
        for (j, &v) in q.iter().enumerate() {
            normed.push(narrow(dtype, (v * inv) * widen(dtype, gamma[j])));
        }
    }
    (res_out, normed)
}

/// The sum of one element's values in `f64`, for error reports and accuracy
/// measurements. Compensated (Neumaier) summation in rank order, so it is
/// exact whenever the true sum fits in about 100 significant bits, which
/// covers every sum of a few `f16`/`bf16` values and `f32` values spread over
/// fewer than ~70 binades. Infinities and NaN give the plain IEEE `f64` sum.
pub fn sum_f64(dtype: Dtype, values: &[u32]) -> f64 {
    let xs = values.iter().map(|&b| widen(dtype, b) as f64);
    if values.iter().any(|&b| !widen(dtype, b).is_finite()) {
        return xs.sum();
    }
    let mut sum = 0.0f64;
    let mut comp = 0.0f64;
    for x in xs {
        let t = sum + x;
        // The low-order bits lost by `sum + x`, from whichever operand is
        // smaller in magnitude.
        comp += if sum.abs() >= x.abs() {
            (sum - t) + x
        } else {
            (x - t) + sum
        };
        sum = t;
    }
    sum + comp
}

/// [`sum_f64`] of element `index` across all ranks.
pub fn element_sum_f64(dtype: Dtype, inputs: &[&[u32]], index: usize) -> f64 {
    let column: Vec<u32> = inputs.iter().map(|x| x[index]).collect();
    sum_f64(dtype, &column)
}

/// Borrows per-rank vectors as the slices the oracle takes.
pub fn as_slices<T>(ranks: &[Vec<T>]) -> Vec<&[T]> {
    ranks.iter().map(Vec::as_slice).collect()
}

/// Adversarial input generators (feature `testkit`): see the module docs.
#[cfg(feature = "testkit")]
pub mod values;

#[cfg(test)]
mod tests;
