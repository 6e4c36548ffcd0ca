//! The pairwise tree that sums a row's chunk partials in the fused
//! RMSNorm (docs/numerics.md), and the pieces of how the kernels spread it
//! over a block: pure functions, used by the kernels
//! (`kernels/norm/tree.rs`: `warp_tree`, `tree_sum`) and by the host's CPU model
//! of that decomposition (`tests/cpu_properties/norm.rs`).
//!
//! The tree: at stride s = 1, 2, 4, ..., partial k (a multiple of 2s) adds
//! partial k + s when k + s < n; the sum is partial 0's. Its order depends
//! on `n` only.
//!
//! The spread: partial k sits in lane k mod 32 of some warp, so strides
//! 1..16 stay inside a warp ("group" k / 32: shuffles, no barrier); the
//! group sums (at most [`MAX_GROUPS`]) go to warp 0, which runs strides
//! 1..16 over groups in each quarter of 32 groups, then combines the
//! quarters with strides of 32 and 64 groups ([`combine_quarters`]).

use crate::abi::NORM_MAX_CHUNKS;

/// Lanes of a warp: the width of a group of partials.
pub const WARP: u32 = 32;

/// Groups of 32 partials in the longest row.
pub const MAX_GROUPS: u32 = (NORM_MAX_CHUNKS as u32).div_ceil(WARP);

/// Warp 0 handles the groups in quarters of 32 (one per lane).
pub const QUARTERS: usize = 4;

const _: () = assert!(MAX_GROUPS <= QUARTERS as u32 * WARP);

/// Within a warp, at stride `s` (1..=16): whether the lane `lane` adds the
/// value held `s` lanes above it. Lane 0 holds an item whose index is a
/// multiple of 32, so `lane % (2s) == 0` is `k % (2s) == 0`, the tree's
/// rule. The tree adds item k + s only where it exists (k + s < n); a lane
/// whose item does not exist holds +0.0 instead, and adding +0.0 leaves
/// every partial (a sum of squares: +0.0, positive or +inf) as it was, bit
/// for bit (a NaN stays a NaN; its payload is free by the contract), so the
/// rule needs no bound and the order is the tree's.
#[inline(always)]
// `is_multiple_of` needs Rust 1.87; the host crate builds with 1.85.
#[allow(clippy::manual_is_multiple_of)]
pub const fn warp_adds(lane: u32, s: u32) -> bool {
    lane % (2 * s) == 0
}

/// The strides of 32 and 64 groups: `a[j]` is the tree sum of the groups
/// 32j .. 32j+31 (of `groups`); returns the sum of all `groups` in the
/// tree's order (quarter 0 adds quarter 1 at stride 32 groups, quarter 2
/// adds quarter 3, then quarter 0 adds quarter 2 at stride 64).
#[inline(always)]
pub fn combine_quarters(a: [f32; QUARTERS], groups: u32) -> f32 {
    let [mut q0, q1, mut q2, q3] = a;
    if WARP < groups {
        q0 += q1;
    }
    if 3 * WARP < groups {
        q2 += q3;
    }
    if 2 * WARP < groups {
        q0 += q2;
    }
    q0
}
