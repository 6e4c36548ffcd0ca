//! The call tag: 32 bits of a collective's *whole* call (element count,
//! dtype, algorithm, and for the fused op rows and hidden size) that every
//! flag and LL word of the collective carries ([`crate::abi::flag_word`],
//! [`crate::abi::ll_highs`]). Ranks whose calls differ never take each
//! other's words; where a wait then times out, the words left there tell
//! the host that the peer made another call ([`crate::error::Error::CallMismatch`]).
//!
//! Layout of the tag (`t`):
//! - bits 0..2: the dtype (its index in [`Dtype::ALL`]);
//! - bits 2..5: the algorithm (its index in [`Algorithm::ALL`]);
//! - bit 5: the fused op (rows x hidden) against a plain allreduce;
//! - bits 6..32: `h = (count + X * hidden) mod P`, with the prime
//!   [`P`] `= 2^26 - 5` and [`X`] (`hidden = 0` for a plain call).
//!
//! **Which calls collide (closed form).** Two calls get the same tag
//! exactly when their dtype, algorithm and kind (plain or fused) agree and
//! `(count - count') + X * (hidden - hidden') ≡ 0 (mod P)`. So:
//! - two plain calls collide only when their counts differ by a nonzero
//!   multiple of `P` = 67,108,859 elements (at least 128 MiB of bf16);
//! - two fused calls of one hidden size collide only when their row counts
//!   differ by a multiple of `P` (`P` is prime and larger than any hidden
//!   size), and two of equal product (`rows * hidden = rows' * hidden'`)
//!   only when `P` divides `hidden - hidden'`, i.e. never for hidden sizes
//!   below `P`;
//! - another dtype, another algorithm, or fused against plain: never.
//!
//! Hence none of the disagreements an engine makes collides (the tests
//! below try each whole): counts `k * h` against `k' * h` for every hidden
//! size `h` below `P` and every `k != k'` whose difference is below `P` (the
//! difference `(k - k') * h` is a multiple of the prime `P` only if one
//! factor is); counts off by 1..P; equal products of rows x hidden; a dtype
//! changed with the count. A chunked message carries the tag of the whole
//! call in every chunk, so ranks that differ only in the number of chunks
//! or in the last chunk differ in the first chunk already.
//!
//! Nothing about it costs the kernels more than the flag algorithms'
//! 64-bit flags (`epoch | tag << 32`, one store and one poll as before) and
//! push_ll comparing each of a pack's four words against its own expected
//! high half (docs/benchmarks.md).

use crate::abi::{Algorithm, Dtype};
use std::fmt;

/// The modulus of the count field: the largest prime below 2^26.
pub const P: u64 = (1 << 26) - 5;
/// The factor of `hidden` in the count field (any nonzero residue works
/// for the promises above; this one is odd and far from `P`'s neighbours).
pub const X: u64 = 65_537;

// The fields fit their bits.
const _: () = assert!(Dtype::ALL.len() <= 4 && Algorithm::ALL.len() <= 8 && P < 1 << 26);

/// A collective's call as its tag summarises it: the whole call's
/// elements (every chunk of a chunked message carries the same tag),
/// dtype and algorithm; `rows` and `hidden` for the fused op
/// (`count = rows * hidden`), `0` for a plain allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallDesc {
    pub count: usize,
    pub dtype: Dtype,
    pub algorithm: Algorithm,
    pub rows: usize,
    pub hidden: usize,
}

impl CallDesc {
    pub fn plain(count: usize, dtype: Dtype, algorithm: Algorithm) -> Self {
        CallDesc {
            count,
            dtype,
            algorithm,
            rows: 0,
            hidden: 0,
        }
    }

    pub fn fused(rows: usize, hidden: usize, dtype: Dtype, algorithm: Algorithm) -> Self {
        CallDesc {
            count: rows.saturating_mul(hidden),
            dtype,
            algorithm,
            rows,
            hidden,
        }
    }

    /// The 32-bit tag (`LaunchArgs::call_tag`; layout in the module docs).
    pub fn tag(&self) -> u32 {
        let index = |i: Option<usize>| i.unwrap_or(0) as u32;
        let dt = index(Dtype::ALL.iter().position(|&d| d == self.dtype));
        let al = index(Algorithm::ALL.iter().position(|&a| a == self.algorithm));
        let fused = u32::from(self.hidden != 0);
        let h = (self.count as u64 % P + X * (self.hidden as u64 % P)) % P;
        dt | al << 2 | fused << 5 | (h as u32) << 6
    }
}

impl fmt::Display for CallDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.hidden != 0 {
            write!(
                f,
                "fused {} x {} {} {}",
                self.rows,
                self.hidden,
                self.dtype.name(),
                self.algorithm.name()
            )
        } else {
            write!(
                f,
                "{} x {} {}",
                self.count,
                self.dtype.name(),
                self.algorithm.name()
            )
        }
    }
}

/// One side of a [`crate::error::Error::CallMismatch`]: the tag the
/// rank's words carried, and the last call this process launched with
/// that tag, where it made one recently (a rank of another process, or a
/// tag flipped by fault injection, has none here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaggedCall {
    pub tag: u32,
    pub call: Option<CallDesc>,
}

impl fmt::Display for TaggedCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.call {
            Some(c) => write!(f, "{c} (tag {:#010x})", self.tag),
            None => write!(
                f,
                "tag {:#010x} (not a recent call of this process)",
                self.tag
            ),
        }
    }
}

/// The last calls launched, for naming both sides of a mismatch: a
/// direct-mapped table of [`TagBook::SLOTS`] entries indexed by a hash of
/// the tag (a later call whose tag hashes alike replaces an earlier one).
/// Written at every launch, read only on the error path.
pub(crate) struct TagBook(std::sync::Mutex<Vec<Option<(u32, CallDesc)>>>);

impl TagBook {
    const SLOTS: usize = 256;

    pub(crate) fn new() -> Self {
        TagBook(std::sync::Mutex::new(vec![None; Self::SLOTS]))
    }
    fn slot(tag: u32) -> usize {
        // Fibonacci hashing: the top bits of the product.
        (tag.wrapping_mul(0x9e37_79b1) >> 24) as usize % Self::SLOTS
    }
    /// Notes `c` as the last call with its tag, and returns the tag.
    pub(crate) fn note(&self, c: CallDesc) -> u32 {
        let tag = c.tag();
        let mut b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        b[Self::slot(tag)] = Some((tag, c));
        tag
    }
    pub(crate) fn named(&self, tag: u32) -> TaggedCall {
        let b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        TaggedCall {
            tag,
            call: b[Self::slot(tag)]
                .filter(|(t, _)| *t == tag)
                .map(|(_, c)| c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p_is_the_largest_prime_below_2_pow_26() {
        let prime = |n: u64| n > 1 && (2..).take_while(|d| d * d <= n).all(|d| n % d != 0);
        assert!(prime(P));
        assert!(((P + 1)..(1 << 26)).all(|n| !prime(n)));
        const { assert!(X % P != 0) };
    }

    #[test]
    fn fields_land_in_their_bits() {
        let c = CallDesc::plain(5, Dtype::ALL[2], Algorithm::ALL[5]);
        assert_eq!(c.tag(), 2 | 5 << 2 | 5 << 6);
        let f = CallDesc::fused(3, 7, Dtype::ALL[0], Algorithm::ALL[1]);
        assert_eq!(f.tag(), 1 << 2 | 1 << 5 | (((21 + X * 7) % P) as u32) << 6);
        // The count field wraps at P: the one way two plain calls collide.
        let a = CallDesc::plain(1000, Dtype::F32, Algorithm::OneStage);
        let b = CallDesc::plain(1000 + P as usize, Dtype::F32, Algorithm::OneStage);
        assert_eq!(a.tag(), b.tag());
    }

    #[test]
    fn the_book_names_the_last_call_of_a_tag() {
        let b = TagBook::new();
        let c = CallDesc::plain(1000, Dtype::F32, Algorithm::PushLl);
        assert_eq!(b.named(c.tag()).call, None);
        b.note(c);
        assert_eq!(b.named(c.tag()).call, Some(c));
        assert!(b
            .named(c.tag())
            .to_string()
            .starts_with("1000 x f32 push_ll"));
        // A tag of the same slot that is not the noted one names no call.
        let other = (0..u32::MAX)
            .map(|t| t.wrapping_add(c.tag()))
            .find(|&t| t != c.tag() && TagBook::slot(t) == TagBook::slot(c.tag()))
            .unwrap();
        assert_eq!(b.named(other).call, None);
    }
}
