//! The call tag: 8 bits of a collective's call (element count, dtype,
//! algorithm, and for the fused op rows and hidden size) that every flag
//! and LL word of the collective carries in its epoch's top byte
//! ([`crate::abi::tagged`]). Ranks whose calls differ never take each
//! other's words; where a wait then times out, the words left there tell
//! the host that the peer made another call ([`crate::error::Error::CallMismatch`]).
//!
//! The tag is linear in the fields modulo 256 with odd factors, so a plain
//! call's count off by 1..=255, another dtype, another algorithm, or the
//! fused op against the plain one always change it; other disagreements
//! change it 255 times in 256. Nothing about it costs the kernels more
//! than the XOR of a kernel parameter (docs/benchmarks.md).

use crate::abi::{Algorithm, Dtype};
use std::fmt;

/// A collective's call as its tag summarises it: one launch's elements
/// (one chunk of a chunked message), dtype and algorithm; `rows` and
/// `hidden` for the fused op (`count = rows * hidden`), `0` for a plain
/// allreduce.
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
            count: rows * hidden,
            dtype,
            algorithm,
            rows,
            hidden,
        }
    }

    /// The 8-bit tag (`LaunchArgs::call_tag`).
    pub fn tag(&self) -> u32 {
        let index = |i: Option<usize>| i.unwrap_or(0) as u64;
        let dt = index(Dtype::ALL.iter().position(|&d| d == self.dtype));
        let al = index(Algorithm::ALL.iter().position(|&a| a == self.algorithm));
        let fused = u64::from(self.hidden != 0);
        let t = (self.count as u64)
            .wrapping_mul(0x9d)
            .wrapping_add(dt * 0x3b)
            .wrapping_add(al * 0x65)
            .wrapping_add(fused * 0xc5)
            .wrapping_add((self.rows as u64).wrapping_mul(0x4b))
            .wrapping_add((self.hidden as u64).wrapping_mul(0x2f));
        (t & 0xff) as u32
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
/// that tag, where it launched one (a rank of another process, or a tag
/// flipped by fault injection, has none here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaggedCall {
    pub tag: u8,
    pub call: Option<CallDesc>,
}

impl fmt::Display for TaggedCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.call {
            Some(c) => write!(f, "{c} (tag {:#04x})", self.tag),
            None => write!(
                f,
                "tag {:#04x} (a call this process did not make)",
                self.tag
            ),
        }
    }
}

/// The last call launched with each tag, for naming both sides of a
/// mismatch. Written at every launch, read only on the error path.
pub(crate) struct TagBook(std::sync::Mutex<Vec<Option<CallDesc>>>);

impl TagBook {
    pub(crate) fn new() -> Self {
        TagBook(std::sync::Mutex::new(vec![None; 256]))
    }
    /// Notes `c` as the last call with its tag, and returns the tag.
    pub(crate) fn note(&self, c: CallDesc) -> u32 {
        let tag = c.tag();
        let mut b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        b[tag as usize] = Some(c);
        tag
    }
    pub(crate) fn named(&self, tag: u8) -> TaggedCall {
        let b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        TaggedCall {
            tag,
            call: b[tag as usize],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disagreements_the_tag_promises_to_see_change_it() {
        for algorithm in Algorithm::ALL {
            for dtype in Dtype::ALL {
                for count in [1usize, 7, 1000, 4096, 70_001, 1 << 20] {
                    let c = CallDesc::plain(count, dtype, algorithm);
                    assert!(c.tag() < 256);
                    for d in 1..=255usize {
                        let other = CallDesc::plain(count + d, dtype, algorithm);
                        assert_ne!(c.tag(), other.tag(), "{c} vs {other}");
                    }
                    for d2 in Dtype::ALL.into_iter().filter(|&d2| d2 != dtype) {
                        assert_ne!(c.tag(), CallDesc::plain(count, d2, algorithm).tag());
                    }
                    for a2 in Algorithm::ALL.into_iter().filter(|&a2| a2 != algorithm) {
                        assert_ne!(c.tag(), CallDesc::plain(count, dtype, a2).tag());
                    }
                }
                for (rows, hidden) in [(1usize, 7168usize), (3, 4096), (64, 1024), (5, 1000)] {
                    let f = CallDesc::fused(rows, hidden, dtype, algorithm);
                    let plain = CallDesc::plain(rows * hidden, dtype, algorithm);
                    assert_ne!(f.tag(), plain.tag(), "{f} vs {plain}");
                    let more = CallDesc::fused(rows + 1, hidden, dtype, algorithm);
                    assert_ne!(f.tag(), more.tag(), "{f} vs {more}");
                }
            }
        }
    }

    #[test]
    fn the_book_names_the_last_call_of_a_tag() {
        let b = TagBook::new();
        let c = CallDesc::plain(1000, Dtype::F32, Algorithm::PushLl);
        assert_eq!(b.named(c.tag() as u8).call, None);
        b.note(c);
        assert_eq!(b.named(c.tag() as u8).call, Some(c));
        assert!(b
            .named(c.tag() as u8)
            .to_string()
            .starts_with("1000 x f32 push_ll"));
    }
}
