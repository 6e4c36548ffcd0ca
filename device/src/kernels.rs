//! The allreduce entry points.
//!
//! Every entry takes one [`LaunchArgs`] by value. Names follow
//! `allreduce_{one_stage|two_stage}_{f32|f16|bf16}_w{N}[_virtual]`; the
//! host's entry table builds the same names from the same parts.
//!
//! Launch contract (checked by the host, and by the kernel where a wrong
//! value would corrupt memory): `gridDim.x <= MAX_BLOCKS` blocks per rank,
//! `blockDim.x >= N`, the same grid on every rank of a collective, and for
//! `_virtual` entries `gridDim.y == N` with all blocks co-resident.

use crate::abi::{
    error_code, BarrierKind, ErrorRecord, LaunchArgs, RankTable, Signal, MAX_BLOCKS, MAX_RANKS,
};
use crate::barrier::{arrive_ordered, next_epoch, wait_ordered, Order, Wait};
use crate::cuda::*;
use crate::numeric::{Bf16, Element, Pack, F16, F32};
use crate::reduce::{partition, reduce_pack, split};
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::AtomicU32;

/// The flag that `from` writes into the signal at `sig`.
#[inline(always)]
unsafe fn flag<'a>(sig: u64, kind: BarrierKind, block: u32, from: u32) -> &'a AtomicU32 {
    // SAFETY: `sig` is a Signal of this collective (host contract) and the
    // offset stays inside it because block < MAX_BLOCKS and from < N.
    &*((sig as usize + Signal::flag_offset(kind, block as usize, from as usize))
        as *const AtomicU32)
}

/// Claims this rank's error record and fills it. Only own memory is touched.
#[inline(always)]
unsafe fn record_error(
    own_sig: u64,
    code: u32,
    rank: u32,
    block: u32,
    peer: u32,
    epoch: u32,
    barrier: u32,
) {
    let rec = (own_sig as usize + Signal::ERROR_OFFSET) as *mut ErrorRecord;
    if atomic_cas_u32(core::ptr::addr_of_mut!((*rec).code), 0, code) == 0 {
        write_volatile(core::ptr::addr_of_mut!((*rec).rank), rank);
        write_volatile(core::ptr::addr_of_mut!((*rec).block), block);
        write_volatile(core::ptr::addr_of_mut!((*rec).peer), peer);
        write_volatile(core::ptr::addr_of_mut!((*rec).epoch), epoch);
        write_volatile(core::ptr::addr_of_mut!((*rec).barrier), barrier);
        thread_fence_system();
    }
}

/// The signal pointer of rank `r`, selected with constant indices only so
/// the by-value parameter is read in place instead of being copied to
/// local memory.
#[inline(always)]
fn pick<const N: usize>(ptrs: &[u64; MAX_RANKS], r: u32) -> u64 {
    let mut o = ptrs[0];
    let mut i = 1;
    while i < N {
        if r as usize == i {
            o = ptrs[i];
        }
        i += 1;
    }
    o
}

/// A named barrier between block `block` of every rank. Thread p < N does
/// the flag exchange with peer p; the rest of the block waits at bar.sync.
/// Returns false (in every thread) if any peer timed out; the error record
/// is written and the caller must leave the kernel.
///
/// `Start` needs no leading bar.sync (nothing was done yet) and `End` no
/// trailing one (the kernel ends; a timeout there is recorded all the same).
#[inline(always)]
unsafe fn block_barrier<const N: usize>(
    signals: &[u64; MAX_RANKS],
    own_sig: u64,
    rank: u32,
    block: u32,
    kind: BarrierKind,
    epoch: u32,
    timeout_ns: u64,
) -> bool {
    let order = match kind {
        BarrierKind::Mid => Order::Publish,
        BarrierKind::Start | BarrierKind::End => Order::ArrivalOnly,
    };
    if kind != BarrierKind::Start {
        // Every read and write of this block so far happens before the arrival.
        sync_threads();
    }
    let tid = thread_idx_x();
    let mut failed = false;
    if (tid as usize) < N {
        arrive_ordered(
            flag(pick::<N>(signals, tid), kind, block, rank),
            epoch,
            order,
        );
        let own = flag(own_sig, kind, block, tid);
        if wait_ordered(own, epoch, timeout_ns, &mut GlobalTimer, order) == Wait::TimedOut {
            record_error(
                own_sig,
                error_code::PEER_TIMEOUT,
                rank,
                block,
                tid,
                epoch,
                kind as u32,
            );
            failed = true;
        }
    }
    if kind == BarrierKind::End {
        return !failed;
    }
    // With `Publish`, the acquire of the waiting threads followed by bar.sync
    // orders every later read of peer memory after the peers' releases.
    !sync_threads_or(failed)
}

/// Reads element `idx` (bits in the low bits) of a buffer of `E`.
#[inline(always)]
unsafe fn ld_elem<E: Element>(base: u64, idx: u64) -> u32 {
    if E::LANES == 4 {
        read_volatile((base as *const u32).add(idx as usize))
    } else {
        read_volatile((base as *const u16).add(idx as usize)) as u32
    }
}

#[inline(always)]
unsafe fn st_elem<E: Element>(base: u64, idx: u64, bits: u32) {
    if E::LANES == 4 {
        write_volatile((base as *mut u32).add(idx as usize), bits)
    } else {
        write_volatile((base as *mut u16).add(idx as usize), bits as u16)
    }
}

/// Reduces the `tail` elements after the last whole pack (grid-stride over
/// the whole grid), in rank order, into `output`.
#[inline(always)]
unsafe fn reduce_tail<E: Element, const N: usize>(
    t: &RankTable,
    output: u64,
    first: u64,
    tail: u64,
    g: u64,
    stride: u64,
) {
    // Grid-stride, so any launch shape covers the (at most 7) tail elements.
    let mut k = g;
    while k < tail {
        let idx = first + k;
        let mut acc = E::to_f32(ld_elem::<E>(t.inputs[0], idx));
        let mut r = 1;
        while r < N {
            acc += E::to_f32(ld_elem::<E>(t.inputs[r], idx));
            r += 1;
        }
        st_elem::<E>(output, idx, E::from_f32(acc));
        k += stride;
    }
}

/// Loads pack `i` of every rank's input (N independent loads in flight) and
/// reduces them in rank order.
#[inline(always)]
unsafe fn reduce_at<E: Element, const N: usize>(inputs: &[*const Pack; N], i: u64) -> Pack {
    let mut v = [[0u32; 4]; N];
    let mut r = 0;
    while r < N {
        v[r] = ld_pack(inputs[r].add(i as usize));
        r += 1;
    }
    reduce_pack::<E, N>(&v)
}

/// Reduces packs `first + g`, `first + g + stride`, ... below `end` into
/// `dst` (and `dst2` if not null). For N <= 4, two packs per iteration: 2N
/// loads in flight before the first add hide more memory latency than N.
/// Larger N already has 5..8 loads in flight, and unrolling would push the
/// register count past what 512-thread blocks can hold.
/// A store that either stays in L2 for peers to read (`KEEP`: two-stage
/// scratch) or is marked evict-first (final results).
#[inline(always)]
unsafe fn store<const KEEP: bool>(p: *mut Pack, v: Pack) {
    if KEEP {
        st_pack(p, v)
    } else {
        st_pack_streaming(p, v)
    }
}

#[inline(always)]
unsafe fn reduce_range<E: Element, const N: usize, const KEEP: bool>(
    inputs: &[*const Pack; N],
    dst: *mut Pack,
    dst2: *mut Pack,
    first: u64,
    end: u64,
    g: u64,
    stride: u64,
) {
    let mut i = first + g;
    while N <= 4 && i + stride < end {
        let mut v = [[0u32; 4]; N];
        let mut w = [[0u32; 4]; N];
        let mut r = 0;
        while r < N {
            v[r] = ld_pack(inputs[r].add(i as usize));
            w[r] = ld_pack(inputs[r].add((i + stride) as usize));
            r += 1;
        }
        let a = reduce_pack::<E, N>(&v);
        let b = reduce_pack::<E, N>(&w);
        store::<KEEP>(dst.add(i as usize), a);
        store::<KEEP>(dst.add((i + stride) as usize), b);
        if !dst2.is_null() {
            st_pack_streaming(dst2.add(i as usize), a);
            st_pack_streaming(dst2.add((i + stride) as usize), b);
        }
        i += 2 * stride;
    }
    while i < end {
        let a = reduce_at::<E, N>(inputs, i);
        store::<KEEP>(dst.add(i as usize), a);
        if !dst2.is_null() {
            st_pack_streaming(dst2.add(i as usize), a);
        }
        i += stride;
    }
}

/// Copies packs `first + g`, `first + g + stride`, ... below `end`, four
/// per iteration: a copy has no arithmetic to hide latency behind, so it
/// needs more loads in flight than the reductions.
#[inline(always)]
unsafe fn copy_range(src: *const Pack, dst: *mut Pack, first: u64, end: u64, g: u64, stride: u64) {
    let mut i = first + g;
    while i + 3 * stride < end {
        let a = ld_pack(src.add(i as usize));
        let b = ld_pack(src.add((i + stride) as usize));
        let c = ld_pack(src.add((i + 2 * stride) as usize));
        let d = ld_pack(src.add((i + 3 * stride) as usize));
        st_pack_streaming(dst.add(i as usize), a);
        st_pack_streaming(dst.add((i + stride) as usize), b);
        st_pack_streaming(dst.add((i + 2 * stride) as usize), c);
        st_pack_streaming(dst.add((i + 3 * stride) as usize), d);
        i += 4 * stride;
    }
    while i < end {
        st_pack_streaming(dst.add(i as usize), ld_pack(src.add(i as usize)));
        i += stride;
    }
}

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
            record_error(own_sig, error_code::BAD_LAUNCH, rank, block, 0, 0, 0);
        }
        return;
    }

    // Everything the data phase needs is loaded before the first barrier, so
    // its latency overlaps the flag exchange.
    let t = &*(a.table as *const RankTable);
    let mut inputs = [core::ptr::null::<Pack>(); N];
    // A null input means a graph-captured table that was never registered.
    let mut missing = false;
    let mut r = 0;
    while r < N {
        inputs[r] = t.inputs[r] as *const Pack;
        missing |= inputs[r].is_null();
        r += 1;
    }
    if missing {
        if tid == 0 {
            record_error(own_sig, error_code::UNREGISTERED, rank, block, 0, 0, 0);
        }
        return;
    }
    let output = pick::<N>(&a.outputs, rank);
    let out = output as *mut Pack;
    let epoch_ptr = (own_sig as usize + Signal::EPOCH_OFFSET + 4 * block as usize) as *mut u32;
    let epoch = next_epoch(read_volatile(epoch_ptr));

    if !block_barrier::<N>(
        &a.signals,
        own_sig,
        rank,
        block,
        BarrierKind::Start,
        epoch,
        a.timeout_ns,
    ) {
        return;
    }
    if tid == 0 {
        // Every thread that needed the old value read it before the barrier.
        write_volatile(epoch_ptr, epoch);
    }

    let lanes = E::LANES as u64;
    let s = split(a.count, lanes);
    let g = (block * nthreads + tid) as u64;
    let stride = (nblocks * nthreads) as u64;

    if !TWO_STAGE {
        reduce_range::<E, N, false>(&inputs, out, core::ptr::null_mut(), 0, s.packs, g, stride);
        reduce_tail::<E, N>(t, output, s.packs * lanes, s.tail, g, stride);
        // No rank may return (and let its input be overwritten) while a peer
        // still reads it.
        block_barrier::<N>(
            &a.signals,
            own_sig,
            rank,
            block,
            BarrierKind::End,
            epoch,
            a.timeout_ns,
        );
    } else {
        // Stage 1 (reduce-scatter): own partition into own scratch, and
        // straight into own output, which saves re-reading it in stage 2.
        let (start, end) = partition(s.packs, N as u32, rank);
        let scratch = t.scratch[rank as usize] as *mut Pack;
        reduce_range::<E, N, true>(&inputs, scratch, out, start, end, g, stride);
        reduce_tail::<E, N>(t, output, s.packs * lanes, s.tail, g, stride);
        // Block b of rank p wrote exactly the packs block b of this rank
        // reads below (same grid, same decomposition), so a per-block
        // barrier is enough.
        if !block_barrier::<N>(
            &a.signals,
            own_sig,
            rank,
            block,
            BarrierKind::Mid,
            epoch,
            a.timeout_ns,
        ) {
            return;
        }
        // Stage 2 (all-gather), starting at the next rank so that the ranks
        // spread their reads over different peers.
        let mut k = 1;
        while k < N {
            let p = (rank as usize + k) % N;
            let (ps, pe) = partition(s.packs, N as u32, p as u32);
            copy_range(t.scratch[p] as *const Pack, out, ps, pe, g, stride);
            k += 1;
        }
        // No end barrier. Every peer finished reading this rank's input
        // before it arrived at Mid. This rank's scratch is next written in
        // stage 1 of the next collective, after its Start barrier, and a peer
        // arrives there only when its kernel for this collective (all of its
        // blocks, all of their stage-2 reads) has completed: kernels on one
        // stream run in order.
    }
}

macro_rules! entries {
    ($( $name:ident, $vname:ident: $E:ty, $N:literal, $two:literal; )*) => { $(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: LaunchArgs) {
            allreduce::<$E, $N, $two>(&a, a.rank)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(a: LaunchArgs) {
            allreduce::<$E, $N, $two>(&a, block_idx_y())
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
