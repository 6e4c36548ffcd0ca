//! Element types and their exact conversions to and from the f32 accumulator.
//!
//! On the GPU the conversions are single `cvt` instructions. On the host the
//! same functions are implemented with integer arithmetic (round to nearest,
//! ties to even), so the pure reduction code in [`crate::reduce`] can be
//! tested on machines without a GPU. Upcasts are exact in both places.

use crate::abi::Dtype;

/// Sixteen bytes: the unit every thread loads and stores.
pub type Pack = [u32; 4];

/// An element type the kernels reduce. Accumulators are always `[f32; 8]`;
/// types with 4 lanes per pack use the first four.
pub trait Element: Copy + 'static {
    const DTYPE: Dtype;
    /// Elements per 16-byte pack.
    const LANES: usize;
    /// Widen the lanes of a pack to f32 (exact).
    fn unpack(p: Pack) -> [f32; 8];
    /// Round the first `LANES` accumulators to this type and pack them.
    fn pack(acc: &[f32; 8]) -> Pack;
    /// Widen one element (its bits in the low bits of `bits`) to f32.
    fn to_f32(bits: u32) -> f32;
    /// Round one f32 to this type; the result's bits are in the low bits.
    fn from_f32(x: f32) -> u32;
}

#[derive(Clone, Copy, Debug)]
pub struct F32;
#[derive(Clone, Copy, Debug)]
pub struct F16;
#[derive(Clone, Copy, Debug)]
pub struct Bf16;

impl Element for F32 {
    const DTYPE: Dtype = Dtype::F32;
    const LANES: usize = 4;
    #[inline(always)]
    fn unpack(p: Pack) -> [f32; 8] {
        let f = f32::from_bits;
        [f(p[0]), f(p[1]), f(p[2]), f(p[3]), 0.0, 0.0, 0.0, 0.0]
    }
    #[inline(always)]
    fn pack(a: &[f32; 8]) -> Pack {
        [
            a[0].to_bits(),
            a[1].to_bits(),
            a[2].to_bits(),
            a[3].to_bits(),
        ]
    }
    #[inline(always)]
    fn to_f32(bits: u32) -> f32 {
        f32::from_bits(bits)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> u32 {
        x.to_bits()
    }
}

impl Element for Bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    const LANES: usize = 8;
    #[inline(always)]
    fn unpack(p: Pack) -> [f32; 8] {
        // bf16 is the top half of an f32: widening is a shift.
        let lo = |w: u32| f32::from_bits(w << 16);
        let hi = |w: u32| f32::from_bits(w & 0xffff_0000);
        [
            lo(p[0]),
            hi(p[0]),
            lo(p[1]),
            hi(p[1]),
            lo(p[2]),
            hi(p[2]),
            lo(p[3]),
            hi(p[3]),
        ]
    }
    #[inline(always)]
    fn pack(a: &[f32; 8]) -> Pack {
        [
            bf16x2_from_f32(a[0], a[1]),
            bf16x2_from_f32(a[2], a[3]),
            bf16x2_from_f32(a[4], a[5]),
            bf16x2_from_f32(a[6], a[7]),
        ]
    }
    #[inline(always)]
    fn to_f32(bits: u32) -> f32 {
        f32::from_bits(bits << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> u32 {
        bf16x2_from_f32(x, 0.0) & 0xffff
    }
}

impl Element for F16 {
    const DTYPE: Dtype = Dtype::F16;
    const LANES: usize = 8;
    #[inline(always)]
    fn unpack(p: Pack) -> [f32; 8] {
        let (a, b) = f16x2_to_f32(p[0]);
        let (c, d) = f16x2_to_f32(p[1]);
        let (e, f) = f16x2_to_f32(p[2]);
        let (g, h) = f16x2_to_f32(p[3]);
        [a, b, c, d, e, f, g, h]
    }
    #[inline(always)]
    fn pack(a: &[f32; 8]) -> Pack {
        [
            f16x2_from_f32(a[0], a[1]),
            f16x2_from_f32(a[2], a[3]),
            f16x2_from_f32(a[4], a[5]),
            f16x2_from_f32(a[6], a[7]),
        ]
    }
    #[inline(always)]
    fn to_f32(bits: u32) -> f32 {
        f16x2_to_f32(bits & 0xffff).0
    }
    #[inline(always)]
    fn from_f32(x: f32) -> u32 {
        f16x2_from_f32(x, 0.0) & 0xffff
    }
}

// ---------------------------------------------------------------------------
// GPU: one instruction each.

/// Packs round(lo) into bits 0..16 and round(hi) into bits 16..32.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn bf16x2_from_f32(lo: f32, hi: f32) -> u32 {
    let r: u32;
    // SAFETY: pure register arithmetic; cvt.rn.bf16x2.f32 exists on sm_80+,
    // the oldest architecture we build for. The first source goes to the
    // upper half.
    unsafe {
        core::arch::asm!("cvt.rn.bf16x2.f32 {r}, {hi}, {lo};",
            r = out(reg32) r, hi = in(reg32) hi, lo = in(reg32) lo,
            options(pure, nomem, nostack));
    }
    r
}

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn f16x2_from_f32(lo: f32, hi: f32) -> u32 {
    let r: u32;
    // SAFETY: pure register arithmetic (sm_80+); the first source goes to
    // the upper half.
    unsafe {
        core::arch::asm!("cvt.rn.f16x2.f32 {r}, {hi}, {lo};",
            r = out(reg32) r, hi = in(reg32) hi, lo = in(reg32) lo,
            options(pure, nomem, nostack));
    }
    r
}

/// Widens the two halves of `w` (low half first).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn f16x2_to_f32(w: u32) -> (f32, f32) {
    let lo: f32;
    let hi: f32;
    // SAFETY: pure register arithmetic; cvt.f32.f16 is exact.
    unsafe {
        core::arch::asm!(
            "{{ .reg .b16 l, h;",
            "mov.b32 {{l, h}}, {w};",
            "cvt.f32.f16 {lo}, l;",
            "cvt.f32.f16 {hi}, h; }}",
            w = in(reg32) w, lo = out(reg32) lo, hi = out(reg32) hi,
            options(pure, nomem, nostack));
    }
    (lo, hi)
}

// ---------------------------------------------------------------------------
// Host: the same conversions in integer arithmetic.

#[cfg(not(target_arch = "nvptx64"))]
#[inline]
pub fn bf16x2_from_f32(lo: f32, hi: f32) -> u32 {
    bf16_bits_from_f32(lo) as u32 | (bf16_bits_from_f32(hi) as u32) << 16
}

#[cfg(not(target_arch = "nvptx64"))]
#[inline]
pub fn f16x2_from_f32(lo: f32, hi: f32) -> u32 {
    f16_bits_from_f32(lo) as u32 | (f16_bits_from_f32(hi) as u32) << 16
}

#[cfg(not(target_arch = "nvptx64"))]
#[inline]
pub fn f16x2_to_f32(w: u32) -> (f32, f32) {
    (
        f32_from_f16_bits(w as u16),
        f32_from_f16_bits((w >> 16) as u16),
    )
}

/// f32 -> bf16, round to nearest even; NaN stays NaN (quieted).
#[cfg(not(target_arch = "nvptx64"))]
pub fn bf16_bits_from_f32(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x0040) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// f32 -> f16 (IEEE binary16), round to nearest even, with subnormals,
/// overflow to infinity, and NaN kept NaN (quieted).
#[cfg(not(target_arch = "nvptx64"))]
pub fn f16_bits_from_f32(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x007f_ffff;
    if exp == 0xff {
        return if man == 0 {
            sign | 0x7c00
        } else {
            sign | 0x7e00 | (man >> 13) as u16
        };
    }
    // Round the integer `q + rem / 2^shift` to nearest even.
    let round = |q: u32, rem: u32, shift: u32| -> u32 {
        let half = 1u32 << (shift - 1);
        if rem > half || (rem == half && q & 1 == 1) {
            q + 1
        } else {
            q
        }
    };
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // Result is subnormal (or zero): value / 2^-24 = m >> (14 - e).
        let shift = (14 - e) as u32;
        if shift > 24 {
            return sign;
        }
        let m = man | 0x0080_0000;
        let q = round(m >> shift, m & ((1 << shift) - 1), shift);
        return sign | q as u16;
    }
    let q = ((e as u32) << 10) | (man >> 13);
    // A carry out of the mantissa moves into the exponent, up to infinity.
    sign | round(q, man & 0x1fff, 13) as u16
}

/// f16 -> f32, exact.
#[cfg(not(target_arch = "nvptx64"))]
pub fn f32_from_f16_bits(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x03ff) as u32;
    let bits = match exp {
        0 => {
            // Subnormal or zero: man * 2^-24, exact in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return f32::from_bits(v.to_bits() | sign);
        }
        0x1f => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}
