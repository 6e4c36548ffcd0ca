//! Adversarial test data, shared by the CPU and GPU tests.
//!
//! Values are chosen so that the order of additions is observable: many
//! binades of both signs, exact cancellation partners, tiny values next to
//! large ones, ties of the final rounding, signed zeros, subnormals of the
//! element type, and (optionally) infinities and NaN. Everything comes from
//! a small deterministic PRNG, so a seed reproduces a case exactly on any
//! machine, without depending on `proptest`.

use super::narrow;
use crate::abi::Dtype;

/// One step of the splitmix64 generator: advances `state`, returns 64
/// well-mixed bits. Any `u64` is a valid state.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in `0..n` (`n > 0`).
pub fn below(state: &mut u64, n: u64) -> u64 {
    // Multiply-shift: bias is at most n / 2^64, irrelevant for tests.
    ((splitmix64(state) as u128 * n as u128) >> 64) as u64
}

/// Uniform in `lo..=hi`.
pub fn range_i32(state: &mut u64, lo: i32, hi: i32) -> i32 {
    lo + below(state, (hi - lo) as u64 + 1) as i32
}

/// True with probability `p`.
pub fn chance(state: &mut u64, p: f64) -> bool {
    ((splitmix64(state) >> 11) as f64) * (1.0 / (1u64 << 53) as f64) < p
}

/// How often non-finite values appear, per generated value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Specials {
    /// Probability of `+inf` or `-inf`.
    pub inf: f64,
    /// Probability of a NaN (random payload and sign).
    pub nan: f64,
}

impl Specials {
    /// No infinity and no NaN; moreover magnitudes are capped so that a
    /// sum of up to 8 values stays finite in every type.
    pub const NONE: Specials = Specials { inf: 0.0, nan: 0.0 };
    /// Rare infinities and rarer NaN: a NaN poisons its element, so a
    /// high rate would hide the order effects of the other values.
    pub const DEFAULT: Specials = Specials {
        inf: 0.01,
        nan: 0.004,
    };
    fn any(self) -> bool {
        self.inf > 0.0 || self.nan > 0.0
    }
}

/// The bit layout of an element type.
#[derive(Clone, Copy, Debug)]
pub struct Format {
    pub bits: u32,
    pub mant_bits: u32,
    pub bias: i32,
}

impl Format {
    pub const fn of(dtype: Dtype) -> Format {
        match dtype {
            Dtype::F32 => Format {
                bits: 32,
                mant_bits: 23,
                bias: 127,
            },
            Dtype::F16 => Format {
                bits: 16,
                mant_bits: 10,
                bias: 15,
            },
            Dtype::Bf16 => Format {
                bits: 16,
                mant_bits: 7,
                bias: 127,
            },
        }
    }
    pub fn sign_bit(self) -> u32 {
        1 << (self.bits - 1)
    }
    fn exp_field_max(self) -> u32 {
        (1 << (self.bits - 1 - self.mant_bits)) - 1
    }
    /// Exponent of the smallest normal number.
    pub fn min_exp(self) -> i32 {
        1 - self.bias
    }
    /// Exponent of the largest finite number.
    pub fn max_exp(self) -> i32 {
        self.exp_field_max() as i32 - 1 - self.bias
    }
    /// Largest exponent for which any sum of 8 values stays finite, so
    /// data without specials also has finite results: 8 values below
    /// `2^(e+1)` sum to less than `2^(e+4)`, one binade below the
    /// overflow threshold, so rounded partial sums cannot reach it.
    pub fn finite_sum_max_exp(self) -> i32 {
        self.max_exp() - 4
    }
    fn make(self, negative: bool, exp_field: u32, mant: u32) -> u32 {
        let s = if negative { self.sign_bit() } else { 0 };
        s | (exp_field << self.mant_bits) | (mant & ((1 << self.mant_bits) - 1))
    }
    /// A normal number `±1.m * 2^exp`, negative with probability
    /// `neg_prob`, `exp` uniform in `lo..=hi`, with a random mantissa of
    /// this type's width (so it is exactly representable).
    fn normal(self, state: &mut u64, neg_prob: f64, lo: i32, hi: i32) -> u32 {
        let negative = chance(state, neg_prob);
        let exp = range_i32(state, lo, hi);
        let field = (exp + self.bias) as u32;
        debug_assert!(field >= 1 && field < self.exp_field_max());
        self.make(negative, field, splitmix64(state) as u32)
    }
    /// A subnormal with a random nonzero mantissa.
    fn subnormal(self, state: &mut u64, neg_prob: f64) -> u32 {
        let negative = chance(state, neg_prob);
        let m = 1 + below(state, (1 << self.mant_bits) - 1) as u32;
        self.make(negative, 0, m)
    }
    fn infinity(self, negative: bool) -> u32 {
        self.make(negative, self.exp_field_max(), 0)
    }
    fn nan(self, state: &mut u64) -> u32 {
        let m = 1 + below(state, (1 << self.mant_bits) - 1) as u32;
        self.make(chance(state, 0.5), self.exp_field_max(), m)
    }
    fn zero(self, negative: bool) -> u32 {
        self.make(negative, 0, 0)
    }
}

fn max_exp_for(fmt: Format, specials: Specials) -> i32 {
    if specials.any() {
        fmt.max_exp()
    } else {
        fmt.finite_sum_max_exp()
    }
}

/// One adversarial element of `dtype` (bits in the low bits).
pub fn adversarial_value(dtype: Dtype, state: &mut u64, specials: Specials) -> u32 {
    let fmt = Format::of(dtype);
    let neg = chance(state, 0.5);
    let u = (splitmix64(state) >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    if u < specials.nan {
        return fmt.nan(state);
    }
    if u < specials.nan + specials.inf {
        return fmt.infinity(neg);
    }
    let hi = max_exp_for(fmt, specials);
    match below(state, 100) {
        // Anywhere in the normal range of the type.
        0..=44 => fmt.normal(state, 0.5, fmt.min_exp(), hi),
        // Moderate magnitudes, where real data lives.
        45..=69 => fmt.normal(state, 0.5, -12, 12.min(hi)),
        70..=79 => fmt.subnormal(state, 0.5),
        80..=87 => fmt.zero(neg),
        // Extremes of the finite range.
        88..=91 => fmt.normal(state, 0.5, fmt.min_exp(), fmt.min_exp()),
        92..=93 => fmt.make(neg, 0, 1),
        94..=95 => fmt.make(neg, (hi + fmt.bias) as u32, u32::MAX),
        // Small integers: exact sums, common in real tensors.
        _ => narrow(dtype, range_i32(state, -8, 8) as f32),
    }
}

/// An adversarial `f32` with [`Specials::DEFAULT`] (rare inf and NaN).
pub fn adversarial_f32(state: &mut u64) -> f32 {
    f32::from_bits(adversarial_value(Dtype::F32, state, Specials::DEFAULT))
}

/// An adversarial `f32` with the given rate of non-finite values.
pub fn adversarial_f32_with(state: &mut u64, specials: Specials) -> f32 {
    f32::from_bits(adversarial_value(Dtype::F32, state, specials))
}

/// `world` ranks of `len` adversarial elements each (bits in the low
/// bits of each `u32`). `specials == false` means no inf/NaN in the
/// inputs and finite results (see [`Specials::NONE`]).
///
/// Element columns are generated one after the other from one stream,
/// so the data for a length is a prefix of the data for a longer length
/// with the same seed (tests of length independence rely on it).
pub fn adversarial_inputs(
    dtype: Dtype,
    world: usize,
    len: usize,
    seed: u64,
    specials: bool,
) -> Vec<Vec<u32>> {
    let s = if specials {
        Specials::DEFAULT
    } else {
        Specials::NONE
    };
    adversarial_inputs_with(dtype, world, len, seed, s)
}

/// [`adversarial_inputs`] with an explicit rate of non-finite values.
pub fn adversarial_inputs_with(
    dtype: Dtype,
    world: usize,
    len: usize,
    seed: u64,
    specials: Specials,
) -> Vec<Vec<u32>> {
    assert!(world >= 1, "adversarial_inputs needs at least one rank");
    let mut state = seed ^ 0x5eed_0fa1_12ed_00ce;
    let mut ranks = vec![Vec::with_capacity(len); world];
    let mut column = vec![0u32; world];
    for _ in 0..len {
        adversarial_column(dtype, &mut state, specials, &mut column);
        for (rank, &v) in ranks.iter_mut().zip(&column) {
            rank.push(v);
        }
    }
    ranks
}

/// Fills one element's values for every rank with one of several
/// patterns that make the order of additions visible.
pub fn adversarial_column(dtype: Dtype, state: &mut u64, specials: Specials, out: &mut [u32]) {
    let fmt = Format::of(dtype);
    let world = out.len();
    let hi = max_exp_for(fmt, specials);
    let pick = below(state, 100);
    match pick {
        // Independent values.
        0..=34 => {
            for v in out.iter_mut() {
                *v = adversarial_value(dtype, state, specials);
            }
        }
        // Cancellation: x and -x at two ranks and a value too small to
        // survive being added to x at a third; the result is that small
        // value only if it is added after the cancellation.
        35..=59 => cancellation(fmt, state, hi, out),
        // A tie of the final rounding: x plus half an ulp of x (in the
        // element type), plus maybe a tiny value that breaks the tie
        // only if it is not absorbed first.
        60..=69 => {
            let ex = range_i32(state, fmt.min_exp() + fmt.mant_bits as i32 + 2, hi.min(20));
            let x = fmt.normal(state, 0.5, ex, ex);
            let half_ulp = 2f32.powi(ex - fmt.mant_bits as i32 - 1);
            let sign = if chance(state, 0.5) { 1.0 } else { -1.0 };
            let half = narrow(dtype, sign * half_ulp);
            for v in out.iter_mut() {
                *v = fmt.zero(chance(state, 0.5));
            }
            let a = below(state, world as u64) as usize;
            out[a] = x;
            if world > 1 {
                let b = (a + 1 + below(state, world as u64 - 1) as usize) % world;
                out[b] = half;
            }
            if world > 2 && chance(state, 0.5) {
                let c = below(state, world as u64) as usize;
                if out[c] & !fmt.sign_bit() == 0 {
                    // Absorbed by x in f32, but not by the half ulp.
                    let te_hi = ex - 26;
                    out[c] = if te_hi >= fmt.min_exp() {
                        fmt.normal(state, 0.5, fmt.min_exp().max(te_hi - 30), te_hi)
                    } else {
                        fmt.subnormal(state, 0.5)
                    };
                }
            }
        }
        // Signed zeros, half the time all negative.
        70..=77 => {
            let all_neg = chance(state, 0.5);
            for v in out.iter_mut() {
                *v = fmt.zero(all_neg || chance(state, 0.5));
            }
            if chance(state, 0.25) {
                let r = below(state, world as u64) as usize;
                out[r] = fmt.subnormal(state, 0.5);
            }
        }
        // Subnormals of the type, sometimes cancelling.
        78..=87 => {
            for v in out.iter_mut() {
                *v = fmt.subnormal(state, 0.5);
            }
            if world > 1 && chance(state, 0.5) {
                let a = below(state, world as u64) as usize;
                let b = (a + 1 + below(state, world as u64 - 1) as usize) % world;
                out[b] = out[a] ^ fmt.sign_bit();
            }
        }
        // Values of one large binade: partial sums may overflow when
        // specials are allowed, and get rounded differently otherwise.
        88..=93 => {
            for v in out.iter_mut() {
                *v = fmt.normal(state, 0.3, hi - 1, hi);
            }
        }
        // Non-finite values among finite ones.
        _ => {
            for v in out.iter_mut() {
                *v = adversarial_value(dtype, state, specials);
            }
            if specials.any() {
                let r = below(state, world as u64) as usize;
                out[r] = match below(state, 4) {
                    0 => fmt.infinity(false),
                    1 => fmt.infinity(true),
                    2 => fmt.nan(state),
                    _ => {
                        // inf and -inf at two ranks: NaN whatever the order.
                        if world > 1 {
                            let b = (r + 1) % world;
                            out[b] = fmt.infinity(true);
                        }
                        fmt.infinity(false)
                    }
                };
            }
        }
    }
}

fn cancellation(fmt: Format, state: &mut u64, hi: i32, out: &mut [u32]) {
    let world = out.len();
    // Spread between x and the small value: more than the 24 bits of the
    // f32 accumulator, so x + small rounds back to x.
    let small_exp_max = hi - 26;
    let lo_x = (fmt.min_exp() + 26).max(-40).min(hi);
    let ex = range_i32(state, lo_x, hi);
    let x = fmt.normal(state, 0.5, ex, ex);
    let small = {
        let max_small = (ex - 26).min(small_exp_max);
        let lo = (max_small - 40).max(fmt.min_exp());
        if max_small < fmt.min_exp() || chance(state, 0.1) {
            fmt.subnormal(state, 0.5)
        } else {
            fmt.normal(state, 0.5, lo, max_small)
        }
    };
    for v in out.iter_mut() {
        *v = if chance(state, 0.5) {
            fmt.zero(chance(state, 0.5))
        } else {
            small
        };
    }
    let a = below(state, world as u64) as usize;
    out[a] = x;
    if world > 1 {
        let b = (a + 1 + below(state, world as u64 - 1) as usize) % world;
        out[b] = x ^ fmt.sign_bit();
    }
}
