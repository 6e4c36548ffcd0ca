// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// The pairwise tree over a row's chunk partials, as docs/numerics.md
// defines it (the order is a function of the chunk count only): strides
// 1..16 by warp shuffles ([`warp_tree`]; [`group_sums_regs`] from
// registers), then the strides of 32 chunks and more over the group sums
// ([`groups_sum`], [`groups_total`]). Every way of running it adds the
// same partials in the same order, so the same bits.

/// Strides 1..16 of the pairwise tree inside one warp: lane `lane` holds
/// item `k` (of `n`; lane 0 holds a multiple of 32), or +0.0 where item k
/// does not exist (k >= n); at stride s, a lane that is a multiple of 2s
/// adds the lane s above it ([`warp_adds`]: an absent item adds +0.0, which
/// changes no partial). Lane 0 returns the sum of its 32 items in the
/// tree's order. Every lane of the warp must call it together.
#[inline(always)]
fn warp_tree(v: f32, lane: u32) -> f32 {
    let mut v = v;
    let mut s = 1u32;
    while s < 32 {
        let other = shfl_down(v, s);
        if warp_adds(lane, s) {
            v += other;
        }
        s *= 2;
    }
    v
}

/// The pairwise tree over the `chunks` partials in `sh`, as docs/numerics.md
/// defines it: at stride s = 1, 2, 4, ..., partial k (a multiple of 2s)
/// adds partial k + s when k + s < chunks; the result is partial 0's. The
/// order is a function of `chunks` only; the work is spread as follows.
/// Chunk k sits in lane k mod 32 of warp (k / 32) mod W (W warps), so the
/// strides 1..16 stay inside a group of 32 chunks in one warp: warp
/// shuffles, no barrier. Each group's sum goes into its first chunk's
/// word; warp 0 then runs the strides 32, 64, ... over the (at most 128)
/// groups: shuffles for 1..16 groups apart, then three adds in lane 0.
///
/// # Safety
/// `sh` holds `chunks <= NORM_MAX_CHUNKS` partials written before a
/// `bar.sync`; every thread of the block calls it (it contains
/// `bar.sync`); `blockDim.x` is a multiple of 32.
#[inline(always)]
unsafe fn tree_sum(sh: SharedWords, chunks: u32) -> f32 {
    let tid = thread_idx_x();
    let nthreads = block_dim_x();
    let lane = tid % WARP;
    // Strides 1..16: within each warp's group of 32 chunks, slot by slot.
    let slots = chunks.div_ceil(nthreads);
    let mut slot = 0;
    while slot < slots {
        let k = slot * nthreads + tid;
        // SAFETY: k < chunks is inside `sh`; others read nothing.
        let v = if k < chunks {
            unsafe { sh.load(k) }
        } else {
            0.0
        };
        let v = warp_tree(v, lane);
        if lane == 0 && k < chunks {
            // SAFETY: the group's first word, read above by this lane only.
            unsafe { sh.store(k, v) };
        }
        slot += 1;
    }
    // SAFETY: each group's sum is at its first chunk's word (above);
    // every thread of the block.
    unsafe { groups_sum(sh, chunks) }
}

/// The strides 1..16 of [`tree_sum`] from partials held in registers:
/// chunk `tid + j * blockDim.x` in `part[j]` (the slot [`tree_sum`] gives
/// it), so they need no shared memory and no `bar.sync` before them. Each
/// group's sum goes to its first chunk's word of `sh`; the caller's
/// barrier then orders them before [`groups_total`].
///
/// # Safety
/// `chunks <= REG_SLOTS * blockDim.x`; `sh` holds at least `chunks` words
/// that no thread of the block reads until that barrier (the caller
/// alternates halves between rows); every lane of the warp calls it
/// together; `blockDim.x` is a multiple of 32.
#[inline(always)]
unsafe fn group_sums_regs(part: [f32; REG_SLOTS], chunks: u32, sh: SharedWords) {
    let tid = thread_idx_x();
    let nthreads = block_dim_x();
    let lane = tid % WARP;
    let mut j = 0;
    while j < REG_SLOTS {
        // Slot j exists where any chunk of it does (no 64-bit division).
        if (j as u32) * nthreads < chunks {
            let k = j as u32 * nthreads + tid;
            let v = warp_tree(if k < chunks { part[j] } else { 0.0 }, lane);
            if lane == 0 && k < chunks {
                // SAFETY: word k < chunks of `sh`, written by this lane only.
                unsafe { sh.store(k, v) };
            }
        }
        j += 1;
    }
}

/// The strides of 32 chunks and more, and the result to every thread (the
/// two-pass path): after a `bar.sync`, every warp adds the group sums
/// itself ([`groups_total`]: the same adds on the same words, so the same
/// bits in every thread), with no second barrier; the caller's row ends
/// in a barrier before `sh` is written again.
///
/// # Safety
/// The group sums of `chunks` partials are in `sh` (written before this
/// call, by this block); every thread of the block calls it; no thread
/// writes `sh` again before a later barrier.
#[inline(always)]
unsafe fn groups_sum(sh: SharedWords, chunks: u32) -> f32 {
    sync_threads();
    // SAFETY: the group sums are in `sh`, before the barrier above.
    unsafe { groups_total(sh, chunks) }
}

/// The strides of 32 chunks and more, in the calling warp: it reads the
/// group sums of `chunks` partials (group g's at word 32 g) in quarters,
/// adds each quarter by [`warp_tree`] and the quarters by
/// [`combine_quarters`], and gives lane 0's total to every lane.
///
/// # Safety
/// The group sums are in `sh`, stored by this block before a barrier this
/// thread has passed, and no thread stores into them before a later
/// barrier that this thread reaches after this call; every lane of the
/// warp calls it together.
#[inline(always)]
unsafe fn groups_total(sh: SharedWords, chunks: u32) -> f32 {
    let lane = thread_idx_x() % WARP;
    let groups = chunks.div_ceil(WARP);
    let mut a = [0f32; QUARTERS];
    let mut j = 0;
    // Only the quarters that hold groups (one for rows of up to 1024
    // chunks): `combine_quarters` adds no other.
    while j < QUARTERS && WARP * (j as u32) < groups {
        let g = WARP * j as u32 + lane;
        // SAFETY: g < groups: word 32 g < chunks is inside `sh`.
        let v = if g < groups {
            unsafe { sh.load(WARP * g) }
        } else {
            0.0
        };
        a[j] = warp_tree(v, lane);
        j += 1;
    }
    // Strides of 32 and 64 groups (1024 and 2048 chunks), lane 0's.
    shfl_lane0(combine_quarters(a, groups))
}
