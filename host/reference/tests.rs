//! Unit tests of the CPU oracle.

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
        let count =
            |p: &dyn Fn(f32, u32) -> bool| xs.iter().zip(&all).filter(|(x, b)| p(**x, **b)).count();
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

#[test]
fn add_rmsnorm_follows_the_documented_order() {
    // Two ranks, two rows of hidden 3, eps 0.5.
    let x0 = f32s(&[1.0, 2.0, 3.0, -1.0, 0.5, 4.0]);
    let x1 = f32s(&[3.0, 4.0, -1.0, 1.0, 0.5, 0.0]);
    let residual = f32s(&[0.0, 1.0, 1.0, 2.0, 0.0, -4.0]);
    let gamma = f32s(&[1.0, 2.0, 0.5]);
    let (ro, normed) = add_rmsnorm_bits(Dtype::F32, &[&x0[..], &x1[..]], &residual, &gamma, 0.5);
    let ro: Vec<f32> = ro.iter().map(|&b| f32::from_bits(b)).collect();
    assert_eq!(ro, vec![4.0, 7.0, 3.0, 2.0, 1.0, 0.0]);
    // Row 0: ss = 16 + 49 + 9 = 74; inv = 1 / sqrt(74 / 3 + 0.5).
    let inv = 1.0f32 / (74.0f32 / 3.0 + 0.5).sqrt();
    assert_eq!(f32::from_bits(normed[1]), (7.0 * inv) * 2.0);
    // Row 1: ss = 4 + 1 + 0 = 5.
    let inv = 1.0f32 / (5.0f32 / 3.0 + 0.5).sqrt();
    assert_eq!(f32::from_bits(normed[3]), 2.0 * inv);
    assert_eq!(normed[5], 0);
}

#[test]
fn add_rmsnorm_sum_of_squares_is_a_tree_of_chunks() {
    // 17 chunks of 8 ones, but chunk 0 holds one huge value: a sequential
    // sum over all elements absorbs the ones that the tree keeps.
    let hidden = 17 * RMS_CHUNK;
    let mut row = vec![1.0f32; hidden];
    row[0] = 4096.0; // square 2^24: adding 1.0 to it is lost, adding 8.0 is not
    let x = f32s(&row);
    let zeros = vec![0u32; hidden];
    let gamma = f32s(&vec![1.0; hidden]);
    let (_, normed) = add_rmsnorm_bits(Dtype::F32, &[&x[..]], &zeros, &gamma, 0.0);
    let sequential = row.iter().fold(0.0f32, |a, &v| a + v * v);
    let parts: Vec<f32> = row
        .chunks(RMS_CHUNK)
        .map(|c| c.iter().skip(1).fold(c[0] * c[0], |a, &v| a + v * v))
        .collect();
    let mut tree = parts.clone();
    let mut s = 1;
    while s < tree.len() {
        let mut k = 0;
        while k + s < tree.len() {
            tree[k] += tree[k + s];
            k += 2 * s;
        }
        s *= 2;
    }
    assert_ne!(
        sequential, tree[0],
        "the data must tell the two orders apart"
    );
    let inv = 1.0f32 / (tree[0] / hidden as f32).sqrt();
    assert_eq!(f32::from_bits(normed[1]), inv);
}
