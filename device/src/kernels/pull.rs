//! One-stage and two-stage: every rank reads its peers' inputs (and, for
//! two-stage, their scratch).

use super::*;

/// The algorithm of a kernel instance.
const fn algorithm(two_stage: bool) -> Algorithm {
    if two_stage {
        Algorithm::TwoStage
    } else {
        Algorithm::OneStage
    }
}

// The kernels have a site for `Mid` only between the two stages of the
// two-stage algorithm; a table that gave one-stage a `Mid` would not be
// honoured, so it does not build.
const _: () = assert!(!runs(Algorithm::OneStage, BarrierKind::Mid));

/// The barrier site `kind` of a kernel: runs [`block_barrier`] if the
/// protocol table ([`crate::barrier::barriers`]) has `kind` for this
/// algorithm, and does nothing otherwise (the table is constant, so the
/// test folds away). Returns false if the caller must leave the kernel.
///
/// # Safety
/// As for [`block_barrier`].
#[inline(always)]
unsafe fn barrier_site<const N: usize, const TWO_STAGE: bool>(
    a: &LaunchArgs,
    own_sig: u64,
    rank: u32,
    block: u32,
    kind: BarrierKind,
    epoch: u32,
) -> bool {
    if !runs(algorithm(TWO_STAGE), kind) {
        return true;
    }
    // SAFETY: forwarded caller contract.
    unsafe { block_barrier::<N>(a, algorithm(TWO_STAGE), own_sig, rank, block, kind, epoch) }
}

/// One rank's part of a collective, run by every thread of every block of
/// the launch.
///
/// # Safety
/// The launch contract of the module documentation holds, and `a` is what
/// the host filled in: `a.signals[..N]` are the group's [`Signal`]s mapped
/// into this address space; `a.table` points to a [`RankTable`] whose
/// non-null inputs hold `a.count` elements of `E` and whose scratch
/// pointers hold as many (two-stage), readable by this rank; the output of
/// `rank` is valid for writes of `a.count` elements; every buffer is
/// [`BUFFER_ALIGN`](crate::abi::BUFFER_ALIGN)-aligned; and every rank of
/// the collective runs the same `N`, `TWO_STAGE`, grid and `a.count`.
#[inline(always)]
unsafe fn allreduce<E: Element, const N: usize, const TWO_STAGE: bool>(a: &LaunchArgs, rank: u32) {
    if (a.absent_ranks >> rank) & 1 != 0 || rank as usize >= N {
        return;
    }
    let block = block_idx_x();
    let nblocks = grid_dim_x();
    let tid = thread_idx_x();
    let nthreads = block_dim_x();
    let own_sig = pick::<N>(&a.signals, rank);
    if nblocks as usize > MAX_BLOCKS || (nthreads as usize) < N {
        if tid == 0 {
            // SAFETY: `own_sig` is this rank's own signal (contract).
            unsafe {
                record_error(
                    own_sig,
                    a.host_error,
                    error_code::BAD_LAUNCH,
                    rank,
                    block,
                    0,
                    0,
                    0,
                    0,
                )
            };
        }
        return;
    }

    // Everything the data phase needs is loaded before the first barrier, so
    // its latency overlaps the flag exchange.
    // SAFETY: `a.table` points to a RankTable the host filled (contract).
    let t = unsafe { &*(a.table as *const RankTable) };
    let mut inputs = [core::ptr::null::<Pack>(); N];
    // A null input means a graph-captured table that was never registered.
    let mut missing = false;
    let mut r = 0;
    while r < N {
        inputs[r] = t.inputs[r] as *const Pack;
        r += 1;
    }
    // SAFETY: own signal, block < MAX_BLOCKS (checked above). Read before
    // the inputs are looked at, so the loads are in flight together.
    let prev = unsafe { read_epoch(own_sig, block) };
    let mut r = 0;
    while r < N {
        missing |= inputs[r].is_null();
        r += 1;
    }
    if missing {
        if tid == 0 {
            // SAFETY: `own_sig` is this rank's own signal (contract).
            unsafe {
                record_error(
                    own_sig,
                    a.host_error,
                    error_code::UNREGISTERED,
                    rank,
                    block,
                    0,
                    0,
                    0,
                    0,
                )
            };
        }
        return;
    }
    let output = pick::<N>(&a.outputs, rank);
    let out = output as *mut Pack;
    let epoch = next_epoch(prev);

    // SAFETY: (this and the later barrier sites) the signals are the
    // group's (contract), rank < N, block < MAX_BLOCKS and blockDim.x >= N
    // (checked above), and control flow is uniform across the block up to
    // each site.
    let ok =
        unsafe { barrier_site::<N, TWO_STAGE>(a, own_sig, rank, block, BarrierKind::Start, epoch) };
    if !ok {
        return;
    }
    // Every thread that needed the old value read it before the barrier.
    // SAFETY: own signal; every thread of the block, after the barrier.
    unsafe { commit_epoch(own_sig, block, nblocks, tid, nthreads, epoch) };

    let lanes = E::LANES as u64;
    let s = split(a.count, lanes);
    let g = (block * nthreads + tid) as u64;
    let stride = (nblocks * nthreads) as u64;

    if !TWO_STAGE {
        // SAFETY: packs [0, s.packs) and the tail after them are inside every
        // input and the output, which hold `a.count` elements (contract).
        unsafe {
            reduce_range::<E, N, false>(&inputs, out, core::ptr::null_mut(), 0, s.packs, g, stride);
            reduce_tail::<E, N>(&t.inputs, output, s.packs * lanes, s.tail, g, stride);
        }
    } else {
        // Stage 1 (reduce-scatter): own partition into own scratch, and
        // straight into own output, which saves re-reading it in stage 2.
        let (start, end) = partition(s.packs, N as u32, rank);
        let scratch = t.scratch[rank as usize] as *mut Pack;
        // SAFETY: the partition lies inside [0, s.packs), so inside every
        // input, this rank's scratch and its output; the tail too (contract).
        unsafe {
            reduce_range::<E, N, true>(&inputs, scratch, out, start, end, g, stride);
            reduce_tail::<E, N>(&t.inputs, output, s.packs * lanes, s.tail, g, stride);
        }
        // Block b of rank p wrote exactly the packs block b of this rank
        // reads below (same grid, same decomposition), so a per-block
        // barrier is enough.
        // SAFETY: as for the Start site.
        let ok = unsafe {
            barrier_site::<N, TWO_STAGE>(a, own_sig, rank, block, BarrierKind::Mid, epoch)
        };
        if !ok {
            return;
        }
        // Stage 2 (all-gather), starting at the next rank so that the ranks
        // spread their reads over different peers.
        let mut k = 1;
        while k < N {
            let p = (rank as usize + k) % N;
            let (ps, pe) = partition(s.packs, N as u32, p as u32);
            // SAFETY: peer p's partition lies inside its scratch and this
            // rank's output (contract).
            unsafe { copy_range(t.scratch[p] as *const Pack, out, ps, pe, g, stride) };
            k += 1;
        }
    }
    // One-stage: no rank may return (and let its input be overwritten) while
    // a peer still reads it. Two-stage runs no End (see `barrier::barriers`).
    // SAFETY: as for the Start site.
    unsafe { barrier_site::<N, TWO_STAGE>(a, own_sig, rank, block, BarrierKind::End, epoch) };
}

macro_rules! entries {
    ($( $name:ident, $vname:ident: $E:ty, $N:literal, $two:literal; )*) => { $(
        /// A real-rank entry: this rank is `a.rank`.
        ///
        /// # Safety
        /// Launched by the host under the launch contract of the module
        /// documentation, with `a` filled as `allreduce` requires.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: LaunchArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce::<$E, $N, $two>(&a, a.rank) }
        }
        /// A virtual-rank entry: this rank is `blockIdx.y`.
        ///
        /// # Safety
        /// As for the real-rank entry, with `gridDim.y == N` and every
        /// block co-resident.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(a: LaunchArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce::<$E, $N, $two>(&a, block_idx_y()) }
        }
    )* };
}

entries! {
    allreduce_one_stage_f32_w1, allreduce_one_stage_f32_w1_virtual: F32, 1, false;
    allreduce_one_stage_f32_w2, allreduce_one_stage_f32_w2_virtual: F32, 2, false;
    allreduce_one_stage_f32_w3, allreduce_one_stage_f32_w3_virtual: F32, 3, false;
    allreduce_one_stage_f32_w4, allreduce_one_stage_f32_w4_virtual: F32, 4, false;
    allreduce_one_stage_f32_w5, allreduce_one_stage_f32_w5_virtual: F32, 5, false;
    allreduce_one_stage_f32_w6, allreduce_one_stage_f32_w6_virtual: F32, 6, false;
    allreduce_one_stage_f32_w7, allreduce_one_stage_f32_w7_virtual: F32, 7, false;
    allreduce_one_stage_f32_w8, allreduce_one_stage_f32_w8_virtual: F32, 8, false;
    allreduce_one_stage_f16_w1, allreduce_one_stage_f16_w1_virtual: F16, 1, false;
    allreduce_one_stage_f16_w2, allreduce_one_stage_f16_w2_virtual: F16, 2, false;
    allreduce_one_stage_f16_w3, allreduce_one_stage_f16_w3_virtual: F16, 3, false;
    allreduce_one_stage_f16_w4, allreduce_one_stage_f16_w4_virtual: F16, 4, false;
    allreduce_one_stage_f16_w5, allreduce_one_stage_f16_w5_virtual: F16, 5, false;
    allreduce_one_stage_f16_w6, allreduce_one_stage_f16_w6_virtual: F16, 6, false;
    allreduce_one_stage_f16_w7, allreduce_one_stage_f16_w7_virtual: F16, 7, false;
    allreduce_one_stage_f16_w8, allreduce_one_stage_f16_w8_virtual: F16, 8, false;
    allreduce_one_stage_bf16_w1, allreduce_one_stage_bf16_w1_virtual: Bf16, 1, false;
    allreduce_one_stage_bf16_w2, allreduce_one_stage_bf16_w2_virtual: Bf16, 2, false;
    allreduce_one_stage_bf16_w3, allreduce_one_stage_bf16_w3_virtual: Bf16, 3, false;
    allreduce_one_stage_bf16_w4, allreduce_one_stage_bf16_w4_virtual: Bf16, 4, false;
    allreduce_one_stage_bf16_w5, allreduce_one_stage_bf16_w5_virtual: Bf16, 5, false;
    allreduce_one_stage_bf16_w6, allreduce_one_stage_bf16_w6_virtual: Bf16, 6, false;
    allreduce_one_stage_bf16_w7, allreduce_one_stage_bf16_w7_virtual: Bf16, 7, false;
    allreduce_one_stage_bf16_w8, allreduce_one_stage_bf16_w8_virtual: Bf16, 8, false;
    allreduce_two_stage_f32_w1, allreduce_two_stage_f32_w1_virtual: F32, 1, true;
    allreduce_two_stage_f32_w2, allreduce_two_stage_f32_w2_virtual: F32, 2, true;
    allreduce_two_stage_f32_w3, allreduce_two_stage_f32_w3_virtual: F32, 3, true;
    allreduce_two_stage_f32_w4, allreduce_two_stage_f32_w4_virtual: F32, 4, true;
    allreduce_two_stage_f32_w5, allreduce_two_stage_f32_w5_virtual: F32, 5, true;
    allreduce_two_stage_f32_w6, allreduce_two_stage_f32_w6_virtual: F32, 6, true;
    allreduce_two_stage_f32_w7, allreduce_two_stage_f32_w7_virtual: F32, 7, true;
    allreduce_two_stage_f32_w8, allreduce_two_stage_f32_w8_virtual: F32, 8, true;
    allreduce_two_stage_f16_w1, allreduce_two_stage_f16_w1_virtual: F16, 1, true;
    allreduce_two_stage_f16_w2, allreduce_two_stage_f16_w2_virtual: F16, 2, true;
    allreduce_two_stage_f16_w3, allreduce_two_stage_f16_w3_virtual: F16, 3, true;
    allreduce_two_stage_f16_w4, allreduce_two_stage_f16_w4_virtual: F16, 4, true;
    allreduce_two_stage_f16_w5, allreduce_two_stage_f16_w5_virtual: F16, 5, true;
    allreduce_two_stage_f16_w6, allreduce_two_stage_f16_w6_virtual: F16, 6, true;
    allreduce_two_stage_f16_w7, allreduce_two_stage_f16_w7_virtual: F16, 7, true;
    allreduce_two_stage_f16_w8, allreduce_two_stage_f16_w8_virtual: F16, 8, true;
    allreduce_two_stage_bf16_w1, allreduce_two_stage_bf16_w1_virtual: Bf16, 1, true;
    allreduce_two_stage_bf16_w2, allreduce_two_stage_bf16_w2_virtual: Bf16, 2, true;
    allreduce_two_stage_bf16_w3, allreduce_two_stage_bf16_w3_virtual: Bf16, 3, true;
    allreduce_two_stage_bf16_w4, allreduce_two_stage_bf16_w4_virtual: Bf16, 4, true;
    allreduce_two_stage_bf16_w5, allreduce_two_stage_bf16_w5_virtual: Bf16, 5, true;
    allreduce_two_stage_bf16_w6, allreduce_two_stage_bf16_w6_virtual: Bf16, 6, true;
    allreduce_two_stage_bf16_w7, allreduce_two_stage_bf16_w7_virtual: Bf16, 7, true;
    allreduce_two_stage_bf16_w8, allreduce_two_stage_bf16_w8_virtual: Bf16, 8, true;
}
