//! Host conversions against the `half` crate.

use super::*;

fn all_16_bit_patterns() -> impl Iterator<Item = u16> {
    0..=u16::MAX
}

#[test]
fn f16_widening_matches_half_for_all_bit_patterns() {
    for h in all_16_bit_patterns() {
        let want = half::f16::from_bits(h).to_f32();
        for (what, got) in [
            ("f32_from_f16_bits", f32_from_f16_bits(h)),
            ("F16::to_f32", F16::to_f32(h as u32)),
            ("f16x2_to_f32 low", f16x2_to_f32(h as u32).0),
            (
                "f16x2_to_f32 high",
                f16x2_to_f32((h as u32) << 16 | 0x3c00).1,
            ),
        ] {
            if want.is_nan() {
                assert!(got.is_nan(), "{what}({h:#06x}) = {got:e}, want NaN");
            } else {
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{what}({h:#06x}) = {got:e}, want {want:e}"
                );
            }
        }
    }
}

#[test]
fn bf16_widening_matches_half_for_all_bit_patterns() {
    for h in all_16_bit_patterns() {
        let want = half::bf16::from_bits(h).to_f32();
        let got = Bf16::to_f32(h as u32);
        if want.is_nan() {
            assert!(got.is_nan(), "Bf16::to_f32({h:#06x}) = {got:e}, want NaN");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "Bf16::to_f32({h:#06x})");
        }
    }
}

/// Lane order inside a pack: element 2k in the low half of word k, for
/// widening and rounding alike.
#[test]
fn pack_lanes_are_in_memory_order() {
    for base in (0..=u16::MAX as u32).step_by(8) {
        let elems: Vec<u32> = (base..base + 8).collect();
        for dtype in [Dtype::F16, Dtype::Bf16] {
            let p = load_pack(&to_bytes(dtype, &elems), 0);
            let (lanes, one): ([f32; 8], fn(u32) -> f32) = match dtype {
                Dtype::F16 => (F16::unpack(p), F16::to_f32),
                _ => (Bf16::unpack(p), Bf16::to_f32),
            };
            for l in 0..8 {
                let want = one(elems[l]);
                assert!(
                    lanes[l].to_bits() == want.to_bits() || (lanes[l].is_nan() && want.is_nan()),
                    "{} unpack lane {l} of {elems:x?}: {:e}, want {want:e}",
                    dtype.name(),
                    lanes[l]
                );
            }
            // Round trip through pack: exact for every non-NaN element.
            let back = match dtype {
                Dtype::F16 => F16::pack(&lanes),
                _ => Bf16::pack(&lanes),
            };
            let mut img = vec![0u8; 16];
            store_pack(&mut img, 0, back);
            let got = from_bytes(dtype, &img);
            for l in 0..8 {
                assert!(
                    reference::same_value(dtype, got[l], elems[l]),
                    "{} pack(unpack) lane {l}: {:#06x}, want {:#06x}",
                    dtype.name(),
                    got[l],
                    elems[l]
                );
            }
        }
    }
    let f = [1.0f32, -2.0, 3.5, -0.0, 9.0, 9.0, 9.0, 9.0];
    let p = F32::pack(&f);
    assert_eq!(
        p,
        [
            f[0].to_bits(),
            f[1].to_bits(),
            f[2].to_bits(),
            f[3].to_bits()
        ]
    );
    assert_eq!(F32::unpack(p)[..4], f[..4]);
}

/// Compares the device crate's f32 -> f16/bf16 rounding with `half` for one
/// input. NaN only needs to stay NaN.
fn check_narrowing(x: f32) -> Result<(), String> {
    let checks: [(&str, u32, u32, bool); 6] = [
        (
            "f16_bits_from_f32",
            f16_bits_from_f32(x) as u32,
            half::f16::from_f32(x).to_bits() as u32,
            true,
        ),
        (
            "F16::from_f32",
            F16::from_f32(x),
            half::f16::from_f32(x).to_bits() as u32,
            true,
        ),
        (
            "f16x2_from_f32 high",
            f16x2_from_f32(1.0, x) >> 16,
            half::f16::from_f32(x).to_bits() as u32,
            true,
        ),
        (
            "bf16_bits_from_f32",
            bf16_bits_from_f32(x) as u32,
            half::bf16::from_f32(x).to_bits() as u32,
            false,
        ),
        (
            "Bf16::from_f32",
            Bf16::from_f32(x),
            half::bf16::from_f32(x).to_bits() as u32,
            false,
        ),
        (
            "bf16x2_from_f32 low",
            bf16x2_from_f32(x, 1.0) & 0xffff,
            half::bf16::from_f32(x).to_bits() as u32,
            false,
        ),
    ];
    for (what, got, want, is_f16) in checks {
        let dtype = if is_f16 { Dtype::F16 } else { Dtype::Bf16 };
        let ok = if x.is_nan() {
            reference::is_nan(dtype, got)
        } else {
            got == want
        };
        if !ok {
            return Err(format!(
                "{what}({:e} = {:#010x}) = {}, want {}",
                x,
                x.to_bits(),
                fmt_bits(dtype, got),
                fmt_bits(dtype, want)
            ));
        }
    }
    Ok(())
}

/// Every tie between two neighbouring values of each type, the f32 values
/// on either side of it, and the values themselves: all of round to
/// nearest even, at every binade, subnormals and the overflow edge included.
#[test]
fn narrowing_matches_half_at_every_tie() {
    for dtype in [Dtype::F16, Dtype::Bf16] {
        let widen = |h: u16| reference::widen(dtype, h as u32);
        let inf = widen(if dtype == Dtype::F16 { 0x7c00 } else { 0x7f80 });
        let mut checked = 0;
        for h in 0..=0x7fffu16 {
            let a = widen(h);
            if !a.is_finite() {
                continue;
            }
            // The next value up; past the largest finite one, the tie with
            // infinity sits where the next binade would begin.
            let b = widen(h + 1);
            let b = if b == inf { a + (a - widen(h - 1)) } else { b };
            let mid = ((a as f64 + b as f64) / 2.0) as f32;
            assert_eq!(
                mid as f64,
                (a as f64 + b as f64) / 2.0,
                "midpoint of {h:#06x} not exact in f32"
            );
            // Positive, so the bit neighbours are the value neighbours.
            let (below, above) = (
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            );
            for x in [a, mid, below, above] {
                for v in [x, -x] {
                    check_narrowing(v).unwrap();
                    checked += 1;
                }
            }
        }
        assert!(checked > 200_000, "{checked}");
    }
}

#[test]
fn narrowing_matches_half_on_edges_and_a_sweep_of_all_f32() {
    let edges = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffbf_ffff),
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        f32::from_bits(0x007f_ffff),
        65504.0,
        65519.996,
        65520.0,
        65536.0,
        2f32.powi(-24),
        2f32.powi(-25),
        f32::from_bits(2f32.powi(-25).to_bits() + 1),
        2f32.powi(-14),
        f32::from_bits(2f32.powi(-14).to_bits() - 1),
        3.389_531_4e38, // bf16::MAX
        3.395_313e38,   // bf16::MAX + half an ulp: the tie with infinity
    ];
    for x in edges {
        check_narrowing(x).unwrap();
    }
    // A stride coprime with 2^32 through every f32 bit pattern: ~1M values,
    // every exponent, many mantissas.
    let mut bits = 0u32;
    for _ in 0..(1u32 << 20) {
        check_narrowing(f32::from_bits(bits)).unwrap();
        bits = bits.wrapping_add(4099);
    }
}

proptest! {
    #![proptest_config(config(20_000))]

    #[test]
    fn narrowing_matches_half_for_random_f32(bits in any::<u32>()) {
        check_narrowing(f32::from_bits(bits)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn narrowing_matches_half_for_adversarial_f32(seed in any::<u64>()) {
        let mut s = seed;
        check_narrowing(values::adversarial_f32(&mut s)).map_err(TestCaseError::fail)?;
    }
}
