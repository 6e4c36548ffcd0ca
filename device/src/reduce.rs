//! The arithmetic and the work decomposition, free of any GPU intrinsic, so
//! the kernels and the host tests run the very same code.
//!
//! Determinism invariant: element i of the result is
//! `round(((x_0[i] + x_1[i]) + x_2[i]) + ... + x_{N-1}[i])` in f32, seeded
//! with rank 0's value (never +0.0, which would turn an all -0.0 sum into
//! +0.0). Fixed rank order gives identical bits on every rank, in both
//! algorithms, for every message length.

use crate::numeric::{Element, Pack};

/// Reduces one pack from each of `N` ranks, in rank order.
#[inline(always)]
pub fn reduce_pack<E: Element, const N: usize>(packs: &[Pack; N]) -> Pack {
    let mut acc = E::unpack(packs[0]);
    let mut r = 1;
    while r < N {
        let x = E::unpack(packs[r]);
        let mut l = 0;
        while l < 8 {
            acc[l] += x[l];
            l += 1;
        }
        r += 1;
    }
    E::pack(&acc)
}

/// [`reduce_pack`] for a world size known only at run time (host tests).
pub fn reduce_pack_dyn<E: Element>(packs: &[Pack]) -> Pack {
    assert!(!packs.is_empty(), "reduce needs at least one rank");
    let mut acc = E::unpack(packs[0]);
    for p in &packs[1..] {
        let x = E::unpack(*p);
        for l in 0..8 {
            acc[l] += x[l];
        }
    }
    E::pack(&acc)
}

/// Reduces one element (bits in the low bits) from each rank, in rank order.
#[inline(always)]
pub fn reduce_scalar<E: Element>(values: impl IntoIterator<Item = u32>) -> u32 {
    let mut it = values.into_iter();
    let mut acc = match it.next() {
        Some(v) => E::to_f32(v),
        None => return 0,
    };
    for v in it {
        acc += E::to_f32(v);
    }
    E::from_f32(acc)
}

/// A message of `count` elements splits into whole 16-byte packs and a tail
/// of fewer than one pack's worth of elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub packs: u64,
    pub tail: u64,
}

#[inline(always)]
pub const fn split(count: u64, lanes: u64) -> Split {
    Split {
        packs: count / lanes,
        tail: count % lanes,
    }
}

/// The contiguous pack range `[start, end)` that rank `part` owns in the
/// two-stage algorithm: near-equal partitions, the first `packs % world`
/// one pack longer. Every pack is in exactly one partition.
#[inline(always)]
pub const fn partition(packs: u64, world: u32, part: u32) -> (u64, u64) {
    let w = world as u64;
    let p = part as u64;
    let base = packs / w;
    let extra = packs % w;
    let start = p * base + if p < extra { p } else { extra };
    let len = base + if p < extra { 1 } else { 0 };
    (start, start + len)
}

/// Adds the lanes of `pack` onto an accumulator ([`Element::unpack`]
/// lanes): one rank's step of the rank-order sum, for sums split between
/// kernels' stages (push_islands carries the unrounded f32 partial of the
/// first island's ranks to the second island, which goes on adding).
#[inline(always)]
pub fn accumulate<E: Element>(acc: &mut [f32; 8], pack: Pack) {
    let x = E::unpack(pack);
    let mut l = 0;
    while l < 8 {
        acc[l] += x[l];
        l += 1;
    }
}

/// Packs of f32 bits that carry an accumulator of one pack of `E`
/// ([`partial_to_packs`]): 2 for 16-bit types, 1 for f32.
#[inline(always)]
pub const fn partial_packs<E: Element>() -> usize {
    E::LANES / 4
}

/// An unrounded accumulator as the bits of its f32 lanes, lanes 0..4 in
/// the first pack and 4..8 in the second ([`partial_from_packs`] inverts
/// it exactly, NaN payloads and signed zeros included).
#[inline(always)]
pub fn partial_to_packs(acc: &[f32; 8]) -> [Pack; 2] {
    let b = |l: usize| acc[l].to_bits();
    [[b(0), b(1), b(2), b(3)], [b(4), b(5), b(6), b(7)]]
}

/// The accumulator [`partial_to_packs`] sent.
#[inline(always)]
pub fn partial_from_packs(p: [Pack; 2]) -> [f32; 8] {
    let f = f32::from_bits;
    [
        f(p[0][0]),
        f(p[0][1]),
        f(p[0][2]),
        f(p[0][3]),
        f(p[1][0]),
        f(p[1][1]),
        f(p[1][2]),
        f(p[1][3]),
    ]
}
