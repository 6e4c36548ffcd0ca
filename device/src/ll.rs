//! The flag-in-data ("low-latency", LL) protocol of [`Algorithm::PushLl`],
//! written once and generic over the memory words and the clock, so the
//! kernels use it on GPU memory and the loom model (tests/loom_ll.rs) runs
//! the very same code on loom atomics.
//!
//! A 16-byte pack of data travels as [`LINES_PER_PACK`] lines of two 8-byte
//! words; each word is `data | high << 32`: four data bytes and the epoch
//! of the collective that wrote them, with one byte of the writer's 32-bit
//! call tag XORed into the epoch's top byte (word `i` of a pack carries
//! byte `i`, `abi::ll_highs`), so a pack of another call never passes. A reader polls the words of a pack
//! until every one carries the awaited epoch, and then has the data: an
//! aligned 8-byte access is single-copy atomic (a vector access is modelled
//! by PTX as independent accesses of its elements, which is why the epoch
//! is repeated in every word rather than stored once per line), so a word
//! that shows the epoch shows the data stored with it. No flag, no fence,
//! no second trip: one posted write per line, polled locally by the owner.
//!
//! Nothing rewrites data as a sentinel, so every bit pattern (signed zeros,
//! NaN payloads) travels unchanged.
//!
//! Why equality on the epoch is enough, with two slots by epoch parity
//! ([`slot`]): the slot a collective `e` reads was last written by the
//! collective `e - 2` (or earlier, or never: zeroed memory, and epochs are
//! never 0). A peer writes collective `e + 2`'s data into it only after its
//! collective `e + 1` read this rank's `e + 1` data, which this rank writes
//! only in a kernel that starts after its kernel `e` (every read of the
//! slot) completed. So while this rank reads slot `e % 2` for collective
//! `e`, each word holds `e` or an older epoch, and a word with epoch `e`
//! holds collective `e`'s data. The layout of the zone is fixed for the
//! group (`LaunchArgs::landing_part` bytes per source) whatever the message
//! size, and the LL zone is not shared with push's zone: raw data left there
//! by a push collective could look like a word of a later epoch.
//!
//! [`Algorithm::PushLl`]: crate::abi::Algorithm::PushLl

use crate::barrier::{Clock, POLLS_PER_CLOCK_READ};
use crate::numeric::Pack;

/// Lines of two 8-byte words per 16-byte pack of data.
pub const LINES_PER_PACK: usize = 2;
/// Bytes of landing zone one pack of data takes.
pub const LL_PACK_BYTES: usize = LINES_PER_PACK * 16;

/// A pack as it travels: `[line][word]`.
pub type Lines = [[u64; 2]; LINES_PER_PACK];

/// The high halves of a pack's four words (word `i` = element `i`): what a
/// writer stores and a reader awaits, `abi::ll_highs` of the collective's
/// epoch and call tag.
pub type Highs = [u32; 4];

/// The same high half in every word: a pack of collective `epoch` under
/// the call tag 0 (the loom model and tests).
#[inline(always)]
pub const fn untagged(epoch: u32) -> Highs {
    [epoch; 4]
}

/// The word that carries data word `data` under high half `high`.
#[inline(always)]
pub const fn word(data: u32, high: u32) -> u64 {
    data as u64 | (high as u64) << 32
}

/// A pack as lines whose words carry the high halves `h`.
#[inline(always)]
pub const fn encode(p: Pack, h: Highs) -> Lines {
    [
        [word(p[0], h[0]), word(p[1], h[1])],
        [word(p[2], h[2]), word(p[3], h[3])],
    ]
}

/// The high halves of the words of `l` (word `i` = element `i`).
#[inline(always)]
pub const fn highs(l: &Lines) -> Highs {
    [
        (l[0][0] >> 32) as u32,
        (l[0][1] >> 32) as u32,
        (l[1][0] >> 32) as u32,
        (l[1][1] >> 32) as u32,
    ]
}

/// The pack carried by `l`, if every word of it carries its high half of
/// `h`.
#[inline(always)]
pub const fn decode(l: &Lines, h: Highs) -> Option<Pack> {
    // 32-bit compares of the high words (a 64-bit compare of the shifted
    // word costs two instructions each).
    const fn hi(w: u64) -> u32 {
        (w >> 32) as u32
    }
    if hi(l[0][0]) == h[0] && hi(l[0][1]) == h[1] && hi(l[1][0]) == h[2] && hi(l[1][1]) == h[3] {
        Some([
            l[0][0] as u32,
            l[0][1] as u32,
            l[1][0] as u32,
            l[1][1] as u32,
        ])
    } else {
        None
    }
}

/// Bytes from the start of a rank's LL zone to source `src`'s part of
/// collective `epoch`'s slot: `[slot 0..2][source 0..world][part]`.
#[inline(always)]
pub const fn slot(epoch: u32, world: u64, src: u64, part_bytes: u64) -> u64 {
    ((epoch as u64 & 1) * world + src) * part_bytes
}

/// Where one pack of a landing zone lives, as the kernels and the model see
/// it: loads and stores of its lines, each word relaxed (volatile) and
/// single-copy atomic, the words of a line possibly in either order.
pub trait PackSlot {
    fn load(&self) -> Lines;
    fn store(&self, lines: Lines);
}

/// Polls `slot` until it holds a pack whose words carry the high halves
/// `epoch` (the collective's epoch under the call's tag,
/// `abi::ll_highs`), or until `timeout_ns` passes (0: waits forever).
/// `None`: timed out.
#[inline(always)]
pub fn wait_pack<S: PackSlot + ?Sized, C: Clock>(
    slot: &S,
    epoch: Highs,
    timeout_ns: u64,
    clock: &mut C,
) -> Option<Pack> {
    if let Some(p) = decode(&slot.load(), epoch) {
        return Some(p);
    }
    let t0 = if timeout_ns != 0 { clock.now_ns() } else { 0 };
    let mut polls: u32 = 0;
    loop {
        if let Some(p) = decode(&slot.load(), epoch) {
            return Some(p);
        }
        clock.relax();
        polls = polls.wrapping_add(1);
        if timeout_ns != 0 && polls & (POLLS_PER_CLOCK_READ - 1) == 0 {
            let now = clock.now_ns();
            if now.wrapping_sub(t0) > timeout_ns {
                // One last look, so data racing with the deadline wins.
                return decode(&slot.load(), epoch);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_every_bit_pattern_and_reject_other_epochs() {
        for p in [
            [0u32, 0x8000_0000, 0x7fc0_0001, 0xffff_ffff],
            [0x8000_8000, 0x7e01_ffc1, 1, 2],
        ] {
            for e in [1u32, 2, 0x7fff_ffff, u32::MAX] {
                let h = untagged(e);
                let l = encode(p, h);
                assert_eq!(decode(&l, h), Some(p));
                assert_eq!(highs(&l), h);
                assert_eq!(decode(&l, untagged(e.wrapping_add(2))), None);
                let mut torn = l;
                torn[1][0] = word(p[2], e.wrapping_sub(2));
                assert_eq!(decode(&torn, h), None);
                // Each word is held to its own high half: another call's
                // tag byte in any one word fails the pack.
                let tagged = [e, e ^ 0x0100_0000, e ^ 0x8000_0000, e];
                let l = encode(p, tagged);
                assert_eq!(decode(&l, tagged), Some(p));
                assert_eq!(decode(&l, h), None);
                for w in 0..4 {
                    let mut other = tagged;
                    other[w] ^= 0x0200_0000;
                    assert_eq!(decode(&l, other), None);
                }
            }
        }
        assert_eq!(decode(&[[0; 2]; 2], untagged(1)), None);
        assert_eq!(slot(3, 4, 2, 64), (4 + 2) * 64);
        assert_eq!(slot(4, 4, 2, 64), 2 * 64);
    }
}
