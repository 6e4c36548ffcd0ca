//! The argument checks every group makes before any device work, each
//! turning a user's mistake into a typed error that says what to do.

use crate::abi::{Dtype, BUFFER_ALIGN, MAX_RANKS};
use crate::error::{Error, Result};

pub(crate) fn check_world(world: usize) -> Result<()> {
    if world == 0 || world > MAX_RANKS {
        return Err(Error::WorldSize(world));
    }
    Ok(())
}

pub(crate) fn check_count(what: &'static str, got: usize, world: usize) -> Result<()> {
    if got != world {
        return Err(Error::RankCount { what, got, world });
    }
    Ok(())
}

pub(crate) fn check_aligned(what: &'static str, rank: usize, ptr: u64) -> Result<()> {
    if ptr % BUFFER_ALIGN as u64 != 0 {
        return Err(Error::Misaligned {
            what,
            rank,
            ptr,
            align: BUFFER_ALIGN,
        });
    }
    Ok(())
}

/// The element count of a call from every rank's input and output length:
/// inputs must agree (`RankMismatch`), outputs must hold the count
/// (`BufferTooSmall`).
pub(crate) fn count_of(
    dtype: Dtype,
    inputs: impl Iterator<Item = usize>,
    outputs: impl Iterator<Item = usize>,
) -> Result<usize> {
    let mut count = None;
    for (r, len) in inputs.enumerate() {
        let c0 = *count.get_or_insert(len);
        if len != c0 {
            return Err(Error::RankMismatch {
                rank: r,
                dtype,
                count: len,
                dtype0: dtype,
                count0: c0,
            });
        }
    }
    let count = count.unwrap_or(0);
    for (r, len) in outputs.enumerate() {
        if len < count {
            return Err(Error::BufferTooSmall {
                what: "output",
                rank: r,
                len,
                need: count,
            });
        }
    }
    Ok(count)
}

/// Pointer array by rank from a list (the rest zero).
pub(crate) fn by_rank(ptrs: impl Iterator<Item = u64>) -> [u64; MAX_RANKS] {
    let mut a = [0u64; MAX_RANKS];
    for (slot, p) in a.iter_mut().zip(ptrs) {
        *slot = p;
    }
    a
}
