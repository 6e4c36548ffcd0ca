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
mod tests {
    use super::values::*;
    use super::*;

    const NEG_ZERO_BITS: [(Dtype, u32); 3] = [
        (Dtype::F32, 0x8000_0000),
        (Dtype::F16, 0x8000),
        (Dtype::Bf16, 0x8000),
    ];

    fn f32s(xs: &[f32]) -> Vec<u32> {
        xs.iter().map(|x| x.to_bits()).collect()
    }

    /// Reduces single-element ranks given as one column.
    fn column(dtype: Dtype, col: &[u32]) -> u32 {
        let ranks: Vec<Vec<u32>> = col.iter().map(|&b| vec![b]).collect();
        allreduce_bits(dtype, &as_slices(&ranks))[0]
    }

    fn f16b(x: f32) -> u32 {
        f16::from_f32(x).to_bits() as u32
    }

    fn bf16b(x: f32) -> u32 {
        bf16::from_f32(x).to_bits() as u32
    }

    #[test]
    fn all_negative_zero_stays_negative_zero() {
        for (dtype, nz) in NEG_ZERO_BITS {
            for world in 1..=8 {
                let col = vec![nz; world];
                assert_eq!(column(dtype, &col), nz, "{} world {world}", dtype.name());
            }
            // One +0.0 anywhere makes the sum +0.0.
            for pos in 0..4 {
                let mut col = vec![nz; 4];
                col[pos] = 0;
                assert_eq!(column(dtype, &col), 0, "{} +0 at rank {pos}", dtype.name());
            }
        }
    }

    #[test]
    fn infinities_of_opposite_sign_give_nan() {
        let inf = f32::INFINITY;
        let got = column(Dtype::F32, &f32s(&[inf, 1.0, -inf]));
        assert!(is_nan(Dtype::F32, got), "got {got:#x}");
        let got = column(Dtype::F16, &[0x7c00, 0xfc00]);
        assert!(is_nan(Dtype::F16, got), "got {got:#x}");
        let got = column(Dtype::Bf16, &[0xff80, 0x3f80, 0x7f80]);
        assert!(is_nan(Dtype::Bf16, got), "got {got:#x}");
        // Same-sign infinities stay infinite, and finite values do not matter.
        assert_eq!(
            column(Dtype::F32, &f32s(&[-inf, 1e38, -inf])),
            (-inf).to_bits()
        );
        assert_eq!(column(Dtype::Bf16, &[0x7f80, 0xff7f]), 0x7f80);
    }

    #[test]
    fn nan_propagates_from_any_rank() {
        for (dtype, nan) in [
            (Dtype::F32, 0x7fc0_0001),
            (Dtype::F16, 0x7e01),
            (Dtype::Bf16, 0xffc1),
        ] {
            for pos in 0..5 {
                let mut col = vec![narrow(dtype, 1.5); 5];
                col[pos] = nan;
                let got = column(dtype, &col);
                assert!(
                    is_nan(dtype, got),
                    "{} NaN at {pos}: got {got:#x}",
                    dtype.name()
                );
            }
        }
    }

    #[test]
    fn addition_order_is_rank_order() {
        let f = |xs: &[f32]| f32::from_bits(column(Dtype::F32, &f32s(xs)));
        assert_eq!(f(&[1e20, 1.0, -1e20]), 0.0);
        assert_eq!(f(&[1e20, -1e20, 1.0]), 1.0);
        assert_eq!(f(&[1.0, 1e20, -1e20]), 0.0);
        // f16: 2^15 absorbs 2^-24 in f32 (39 binades apart).
        let (big, tiny) = (f16b(32768.0), 0x0001);
        assert_eq!(column(Dtype::F16, &[big, tiny, big | 0x8000]), 0);
        assert_eq!(column(Dtype::F16, &[big, big | 0x8000, tiny]), tiny);
        // bf16 has the f32 exponent range.
        let (big, one) = (bf16b(2f32.powi(100)), bf16b(1.0));
        assert_eq!(column(Dtype::Bf16, &[big, one, big | 0x8000]), 0);
        assert_eq!(column(Dtype::Bf16, &[big, big | 0x8000, one]), one);
    }

    #[test]
    fn subnormals_are_not_flushed() {
        // f32: smallest subnormals add exactly.
        assert_eq!(column(Dtype::F32, &[1, 1, 1]), 3);
        assert_eq!(column(Dtype::F32, &[0x8000_0001, 0]), 0x8000_0001);
        // A normal minus a subnormal: a subnormal result.
        let got = column(Dtype::F32, &[f32::MIN_POSITIVE.to_bits(), 0x8000_0001]);
        assert_eq!(got, 0x007f_ffff);
        // The 16-bit types: subnormal inputs widen exactly, and the sum is
        // rounded back to a subnormal of the type.
        assert_eq!(column(Dtype::F16, &[0x0001, 0x0001]), 0x0002);
        assert_eq!(column(Dtype::F16, &[0x0400, 0x8001]), 0x03ff);
        assert_eq!(column(Dtype::Bf16, &[0x0001, 0x0001]), 0x0002);
        assert_eq!(column(Dtype::Bf16, &[0x0080, 0x8001]), 0x007f);
        // World 1 is the identity on subnormals.
        assert_eq!(column(Dtype::Bf16, &[0x8005]), 0x8005);
    }

    #[test]
    fn final_rounding_is_nearest_even() {
        // bf16: ulp(1) = 2^-7, so 1 + 2^-8 is a tie.
        let h = bf16b(2f32.powi(-8));
        assert_eq!(
            column(Dtype::Bf16, &[0x3f80, h]),
            0x3f80,
            "tie down to even"
        );
        assert_eq!(column(Dtype::Bf16, &[0x3f81, h]), 0x3f82, "tie up to even");
        assert_eq!(
            column(Dtype::Bf16, &[0x3f81, h | 0x8000]),
            0x3f80,
            "negative half ulp"
        );
        // f16: ulp(1) = 2^-10.
        let h = f16b(2f32.powi(-11));
        assert_eq!(column(Dtype::F16, &[0x3c00, h]), 0x3c00);
        assert_eq!(column(Dtype::F16, &[0x3c01, h]), 0x3c02);
        // Just above the tie rounds up.
        let h2 = f16b(2f32.powi(-11) + 2f32.powi(-20));
        assert_eq!(column(Dtype::F16, &[0x3c00, h2]), 0x3c01);
        // The f32 accumulator rounds first: 1 + 2^-8 + 2^-30 is an exact tie
        // in f32 (2^-30 is absorbed), so it rounds to even, although the
        // exact sum is above the tie. Double rounding is part of the contract.
        let tiny = bf16b(2f32.powi(-30));
        assert_eq!(
            column(Dtype::Bf16, &[0x3f80, bf16b(2f32.powi(-8)), tiny]),
            0x3f80
        );
        assert_eq!(
            column(Dtype::Bf16, &[tiny, 0x3f80, bf16b(2f32.powi(-8))]),
            0x3f80
        );
        // f32 itself: 2^24 + 1 is a tie between 2^24 and 2^24 + 2.
        let f = |xs: &[f32]| f32::from_bits(column(Dtype::F32, &f32s(xs)));
        assert_eq!(f(&[16_777_216.0, 1.0]), 16_777_216.0);
        assert_eq!(f(&[16_777_218.0, 1.0]), 16_777_220.0);
    }

    #[test]
    fn f16_overflows_to_infinity() {
        let max = 0x7bff; // 65504
        assert_eq!(column(Dtype::F16, &[f16b(60000.0), f16b(60000.0)]), 0x7c00);
        assert_eq!(
            column(Dtype::F16, &[f16b(-60000.0), f16b(-60000.0)]),
            0xfc00
        );
        // 65504 + 8 = 65512 rounds down; 65504 + 16 = 65520 is the tie
        // between 65504 (odd mantissa) and 65536, so it goes to infinity.
        assert_eq!(column(Dtype::F16, &[max, f16b(8.0)]), max);
        assert_eq!(column(Dtype::F16, &[max, f16b(16.0)]), 0x7c00);
        // Overflow of a partial sum is undone by a later subtraction: the
        // accumulator is f32, which does not overflow here.
        assert_eq!(column(Dtype::F16, &[max, max, max | 0x8000]), max);
        // bf16 near f32's limit.
        assert_eq!(column(Dtype::Bf16, &[0x7f7f, 0x7f7f]), 0x7f80);
    }

    #[test]
    fn world_one_is_identity() {
        for dtype in Dtype::ALL {
            let data = adversarial_inputs(dtype, 1, 2000, 7, true);
            let got = allreduce_bits(dtype, &as_slices(&data));
            assert_eq!(
                first_mismatch(dtype, &got, &data[0]),
                None,
                "{}",
                dtype.name()
            );
        }
    }

    #[test]
    fn typed_entries_agree_with_generic_entry() {
        let data = adversarial_inputs(Dtype::F16, 3, 500, 3, true);
        let narrow_data: Vec<Vec<u16>> = data
            .iter()
            .map(|r| r.iter().map(|&b| b as u16).collect())
            .collect();
        let typed: Vec<u32> = allreduce_f16(&as_slices(&narrow_data))
            .into_iter()
            .map(u32::from)
            .collect();
        assert_eq!(typed, allreduce_bits(Dtype::F16, &as_slices(&data)));
        let typed: Vec<u32> = allreduce_bf16(&as_slices(&narrow_data))
            .into_iter()
            .map(u32::from)
            .collect();
        assert_eq!(typed, allreduce_bits(Dtype::Bf16, &as_slices(&data)));
    }

    #[test]
    #[should_panic(expected = "at least one rank")]
    fn zero_ranks_panics() {
        allreduce_bits(Dtype::F32, &[]);
    }

    #[test]
    #[should_panic(expected = "rank 1 has 3 elements but rank 0 has 2")]
    fn ragged_ranks_panic() {
        allreduce_bits(Dtype::Bf16, &[&[0, 0], &[0, 0, 0]]);
    }

    #[test]
    #[should_panic(expected = "bits above the 16-bit element")]
    fn high_bits_in_16_bit_element_panic() {
        allreduce_bits(Dtype::F16, &[&[0x1_3c00]]);
    }

    #[test]
    fn comparison_treats_all_nans_alike_and_zeros_apart() {
        assert!(same_value(Dtype::F32, 0x7fc0_0000, 0xffc0_1234));
        assert!(same_value(Dtype::F16, 0x7e00, 0xfc01));
        assert!(!same_value(Dtype::F16, 0x7c00, 0x7e00), "inf is not NaN");
        assert!(!same_value(Dtype::Bf16, 0x8000, 0x0000), "-0 is not +0");
        assert!(!same_value(Dtype::Bf16, 0x7f80, 0x7f81));
        let want = [1, 0x7fc0_0000, 3, 4];
        assert_eq!(
            first_mismatch(Dtype::F32, &[1, 0x7f80_0001, 3, 4], &want),
            None
        );
        assert_eq!(
            first_mismatch(Dtype::F32, &[1, 0x7fc0_0000, 3, 5], &want),
            Some((3, 5, 4))
        );
    }

    #[test]
    fn sum_f64_is_exact_where_f32_is_not() {
        let col = f32s(&[1e20, 1.0, -1e20]);
        assert_eq!(sum_f64(Dtype::F32, &col), 1.0);
        let col = f32s(&[1.0, 2f32.powi(-60), -1.0]);
        assert_eq!(sum_f64(Dtype::F32, &col), 2f64.powi(-60));
        assert!(sum_f64(Dtype::F32, &f32s(&[f32::INFINITY, -f32::INFINITY])).is_nan());
        assert_eq!(sum_f64(Dtype::F16, &[0x3c00, 0x3c00]), 2.0);
    }

    #[test]
    fn generator_is_deterministic_and_prefix_stable() {
        for dtype in Dtype::ALL {
            let a = adversarial_inputs(dtype, 5, 1000, 42, true);
            let b = adversarial_inputs(dtype, 5, 1000, 42, true);
            let short = adversarial_inputs(dtype, 5, 300, 42, true);
            let other = adversarial_inputs(dtype, 5, 1000, 43, true);
            assert_eq!(a, b);
            assert_ne!(a, other, "seed must matter");
            for r in 0..5 {
                assert_eq!(short[r][..], a[r][..300], "{} rank {r}", dtype.name());
            }
        }
    }

    #[test]
    fn generator_without_specials_gives_finite_inputs_and_sums() {
        for dtype in Dtype::ALL {
            for world in [1, 2, 3, 8] {
                let data = adversarial_inputs(dtype, world, 20_000, world as u64, false);
                for (r, rank) in data.iter().enumerate() {
                    for (i, &b) in rank.iter().enumerate() {
                        assert!(
                            widen(dtype, b).is_finite(),
                            "{} rank {r} element {i}: {}",
                            dtype.name(),
                            fmt_bits(dtype, b)
                        );
                    }
                }
                let out = allreduce_bits(dtype, &as_slices(&data));
                for (i, &b) in out.iter().enumerate() {
                    assert!(
                        widen(dtype, b).is_finite(),
                        "{} world {world} element {i}: sum {} of {:?}",
                        dtype.name(),
                        fmt_bits(dtype, b),
                        data.iter()
                            .map(|r| fmt_bits(dtype, r[i]))
                            .collect::<Vec<_>>()
                    );
                }
            }
        }
    }

    /// The data must contain every class of value the contract talks about.
    #[test]
    fn generator_covers_the_adversarial_classes() {
        for dtype in Dtype::ALL {
            let fmt = Format::of(dtype);
            let data = adversarial_inputs(dtype, 4, 20_000, 1, true);
            let all: Vec<u32> = data.concat();
            let xs: Vec<f32> = all.iter().map(|&b| widen(dtype, b)).collect();
            let count = |p: &dyn Fn(f32, u32) -> bool| {
                xs.iter().zip(&all).filter(|(x, b)| p(**x, **b)).count()
            };
            let name = dtype.name();
            assert!(count(&|x, _| x.is_nan()) > 0, "{name}: no NaN");
            assert!(count(&|x, _| x == f32::INFINITY) > 0, "{name}: no +inf");
            assert!(count(&|x, _| x == f32::NEG_INFINITY) > 0, "{name}: no -inf");
            assert!(
                count(&|x, _| x == 0.0 && x.is_sign_negative()) > 0,
                "{name}: no -0"
            );
            assert!(
                count(&|x, _| x == 0.0 && x.is_sign_positive()) > 0,
                "{name}: no +0"
            );
            let sub = |x: f32, b: u32| {
                x != 0.0 && (b >> fmt.mant_bits) & ((1 << (fmt.bits - 1 - fmt.mant_bits)) - 1) == 0
            };
            assert!(count(&sub) > 100, "{name}: too few subnormals of the type");
            assert!(
                count(&|x, _| x < 0.0) > 1000,
                "{name}: too few negative values"
            );
            // Magnitudes across the whole exponent range of the type.
            let exps: Vec<i32> = xs
                .iter()
                .filter(|x| x.is_finite() && **x != 0.0)
                .map(|x| x.abs().log2().floor() as i32)
                .collect();
            let (lo, hi) = (*exps.iter().min().unwrap(), *exps.iter().max().unwrap());
            assert!(
                lo <= fmt.min_exp() - fmt.mant_bits as i32 + 1,
                "{name}: smallest exponent {lo}"
            );
            assert!(hi >= fmt.max_exp() - 1, "{name}: largest exponent {hi}");
            // Exact cancellation partners in one column.
            let pairs = (0..data[0].len())
                .filter(|&i| {
                    (0..4).any(|a| {
                        (0..4).any(|b| {
                            a != b
                                && data[a][i] == data[b][i] ^ fmt.sign_bit()
                                && !widen(dtype, data[a][i]).is_nan()
                                && widen(dtype, data[a][i]) != 0.0
                        })
                    })
                })
                .count();
            assert!(pairs > 1000, "{name}: only {pairs} columns with x and -x");
        }
    }

    /// The data must make addition order observable, for every type: a sum
    /// in reverse rank order must differ from the contract on a good share
    /// of the elements (otherwise a kernel with the wrong order could pass).
    #[test]
    fn generated_data_makes_order_observable() {
        for dtype in Dtype::ALL {
            for specials in [false, true] {
                let world = 4;
                let data = adversarial_inputs(dtype, world, 10_000, 9, specials);
                let want = allreduce_bits(dtype, &as_slices(&data));
                let differ = (0..want.len())
                    .filter(|&i| {
                        let mut acc = widen(dtype, data[world - 1][i]);
                        for r in (0..world - 1).rev() {
                            acc += widen(dtype, data[r][i]);
                        }
                        !same_value(dtype, narrow(dtype, acc), want[i])
                    })
                    .count();
                assert!(
                    differ > 500,
                    "{} specials={specials}: reverse order differs in only {differ} of 10000",
                    dtype.name()
                );
            }
        }
    }

    #[test]
    fn adversarial_f32_covers_wide_exponents() {
        let mut s = 11;
        let xs: Vec<f32> = (0..50_000).map(|_| adversarial_f32(&mut s)).collect();
        assert!(xs.iter().any(|x| x.is_nan()));
        assert!(xs.iter().any(|x| x.is_infinite()));
        assert!(xs.iter().any(|x| x.is_subnormal()));
        assert!(xs.iter().any(|x| x.is_finite() && x.abs() > 1e38));
        assert!(xs.iter().any(|x| x.is_normal() && x.abs() < 1e-37));
        let mut s = 11;
        let finite = (0..50_000).all(|_| adversarial_f32_with(&mut s, Specials::NONE).is_finite());
        assert!(finite);
    }
}
