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
//!
//! Which barriers run, and with which memory order, comes from the protocol
//! table in [`crate::barrier`] ([`barriers`](crate::barrier::barriers),
//! [`order`]); the kernels only place the barrier sites.

use crate::abi::{
    error_code, Algorithm, BarrierKind, ErrorRecord, LaunchArgs, RankTable, Signal, MAX_BLOCKS,
    MAX_RANKS,
};
use crate::barrier::{arrive_ordered, next_epoch, order, runs, wait_ordered, Order, Wait};
use crate::cuda::*;
use crate::numeric::{Bf16, Element, Pack, F16, F32};
use crate::reduce::{partition, reduce_pack, split};
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::AtomicU32;

/// The flag that `from` writes into the signal at `sig`.
///
/// # Safety
/// `sig` must be the address of a [`Signal`] that stays mapped for `'a`,
/// `block < MAX_BLOCKS` and `from < MAX_RANKS`, and the flag must be
/// accessed only atomically while the reference lives.
#[inline(always)]
unsafe fn flag<'a>(sig: u64, kind: BarrierKind, block: u32, from: u32) -> &'a AtomicU32 {
    // SAFETY: `sig` is a Signal (caller contract) and the offset stays inside
    // it because block < MAX_BLOCKS and from < MAX_RANKS; flags are 4-byte
    // aligned u32s, which AtomicU32 may alias.
    unsafe {
        &*((sig as usize + Signal::flag_offset(kind, block as usize, from as usize))
            as *const AtomicU32)
    }
}

/// Claims this rank's error record and fills it, then raises the host's
/// mailbox (`host_error`, mapped pinned host memory; 0 for none) so the host
/// can see that a record exists without synchronising with the device.
/// Only own memory is touched.
///
/// # Safety
/// `own_sig` must be the address of this rank's own [`Signal`], in this
/// GPU's memory (the claim is an atomic compare-and-swap); `host_error`
/// zero or a device-mapped `u32` of host memory.
#[inline(always)]
unsafe fn record_error(
    own_sig: u64,
    host_error: u64,
    code: u32,
    rank: u32,
    block: u32,
    peer: u32,
    epoch: u32,
    barrier: u32,
) {
    let rec = (own_sig as usize + Signal::ERROR_OFFSET) as *mut ErrorRecord;
    // SAFETY: `rec` is the error record inside this rank's own signal (caller
    // contract), aligned and in local GPU memory; only the thread that wins
    // the compare-and-swap writes the other fields.
    unsafe {
        if atomic_cas_u32(core::ptr::addr_of_mut!((*rec).code), 0, code) == 0 {
            write_volatile(core::ptr::addr_of_mut!((*rec).rank), rank);
            write_volatile(core::ptr::addr_of_mut!((*rec).block), block);
            write_volatile(core::ptr::addr_of_mut!((*rec).peer), peer);
            write_volatile(core::ptr::addr_of_mut!((*rec).epoch), epoch);
            write_volatile(core::ptr::addr_of_mut!((*rec).barrier), barrier);
            // The record is visible (system scope) before the mailbox says so.
            thread_fence_system();
            if host_error != 0 {
                write_volatile(host_error as *mut u32, code);
                thread_fence_system();
            }
        }
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

/// A named barrier between block `block` of every rank, with the memory
/// order the protocol table gives `kind` ([`order`]). Thread p < N does the
/// flag exchange with peer p; the rest of the block waits at bar.sync.
/// Returns false (in every thread) if any peer timed out; the error record
/// is written and the caller must leave the kernel.
///
/// `Start` needs no leading bar.sync (nothing was done yet) and `End` no
/// trailing one (the kernel ends; a timeout there is recorded all the same).
///
/// # Safety
/// `a.signals[..N]` must be the [`Signal`]s of the collective's ranks mapped
/// into this address space and `own_sig` this rank's own; `a.host_error`
/// zero or a device-mapped host `u32`; `N <= MAX_RANKS`,
/// `rank < N`, `block < MAX_BLOCKS`, `blockDim.x >= N`; and every thread of
/// the block must call it, with the same arguments (it contains bar.sync).
#[inline(always)]
unsafe fn block_barrier<const N: usize>(
    a: &LaunchArgs,
    algo: Algorithm,
    own_sig: u64,
    rank: u32,
    block: u32,
    kind: BarrierKind,
    epoch: u32,
) -> bool {
    let (signals, timeout_ns) = (&a.signals, a.timeout_ns);
    let order = order(algo, kind);
    if kind != BarrierKind::Start || order == Order::Publish {
        // Every read and write of this block so far happens before the
        // arrival (for `Publish`, the release of thread p then covers the
        // writes of every thread of the block).
        sync_threads();
    }
    let tid = thread_idx_x();
    let mut failed = false;
    if (tid as usize) < N {
        arrive_ordered(
            // SAFETY: `pick` returns peer `tid`'s signal (tid < N), and
            // block < MAX_BLOCKS, rank < N <= MAX_RANKS (caller contract).
            unsafe { flag(pick::<N>(signals, tid), kind, block, rank) },
            epoch,
            order,
        );
        // SAFETY: own signal, block < MAX_BLOCKS, tid < N <= MAX_RANKS.
        let own = unsafe { flag(own_sig, kind, block, tid) };
        if wait_ordered(own, epoch, timeout_ns, &mut GlobalTimer, order) == Wait::TimedOut {
            // SAFETY: `own_sig` is this rank's own signal (caller contract).
            unsafe {
                record_error(
                    own_sig,
                    a.host_error,
                    error_code::PEER_TIMEOUT,
                    rank,
                    block,
                    tid,
                    epoch,
                    kind as u32,
                )
            };
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

/// Reads element `idx` (bits in the low bits) of a buffer of `E`.
///
/// # Safety
/// `base` must point to a buffer of `E` elements, aligned for them and
/// valid for reads of element `idx`.
#[inline(always)]
unsafe fn ld_elem<E: Element>(base: u64, idx: u64) -> u32 {
    // SAFETY: element `idx` of the buffer is readable (caller contract).
    unsafe {
        if E::LANES == 4 {
            read_volatile((base as *const u32).add(idx as usize))
        } else {
            read_volatile((base as *const u16).add(idx as usize)) as u32
        }
    }
}

/// Writes element `idx` (bits in the low bits) of a buffer of `E`.
///
/// # Safety
/// `base` must point to a buffer of `E` elements, aligned for them and
/// valid for writes of element `idx`.
#[inline(always)]
unsafe fn st_elem<E: Element>(base: u64, idx: u64, bits: u32) {
    // SAFETY: element `idx` of the buffer is writable (caller contract).
    unsafe {
        if E::LANES == 4 {
            write_volatile((base as *mut u32).add(idx as usize), bits)
        } else {
            write_volatile((base as *mut u16).add(idx as usize), bits as u16)
        }
    }
}

/// Reduces the `tail` elements after the last whole pack (grid-stride over
/// the whole grid), in rank order, into `output`.
///
/// # Safety
/// `inputs[..N]` must be valid for reads, and `output` for writes, of
/// elements `first .. first + tail`, all aligned for `E`.
#[inline(always)]
unsafe fn reduce_tail<E: Element, const N: usize>(
    inputs: &[u64; MAX_RANKS],
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
        // SAFETY: first <= idx < first + tail, inside every input and the
        // output (caller contract).
        unsafe {
            let mut acc = E::to_f32(ld_elem::<E>(inputs[0], idx));
            let mut r = 1;
            while r < N {
                acc += E::to_f32(ld_elem::<E>(inputs[r], idx));
                r += 1;
            }
            st_elem::<E>(output, idx, E::from_f32(acc));
        }
        k += stride;
    }
}

/// Loads pack `i` of every rank's input (N independent loads in flight) and
/// reduces them in rank order.
///
/// # Safety
/// Every `inputs[r]` must be a 16-byte aligned global address valid for
/// reads of pack `i`.
#[inline(always)]
unsafe fn reduce_at<E: Element, const N: usize>(inputs: &[*const Pack; N], i: u64) -> Pack {
    let mut v = [[0u32; 4]; N];
    let mut r = 0;
    while r < N {
        // SAFETY: pack `i` of input r is readable (caller contract).
        v[r] = unsafe { ld_pack(inputs[r].add(i as usize)) };
        r += 1;
    }
    reduce_pack::<E, N>(&v)
}

/// A store that either stays in L2 for peers to read (`KEEP`: two-stage
/// scratch) or is marked evict-first (final results).
///
/// # Safety
/// `p` must be a 16-byte aligned global address valid for writes.
#[inline(always)]
unsafe fn store<const KEEP: bool>(p: *mut Pack, v: Pack) {
    // SAFETY: forwarded caller contract.
    unsafe {
        if KEEP {
            st_pack(p, v)
        } else {
            st_pack_streaming(p, v)
        }
    }
}

/// Reduces packs `first + g`, `first + g + stride`, ... below `end` into
/// `dst` (and `dst2` if not null). For N <= 4, two packs per iteration: 2N
/// loads in flight before the first add hide more memory latency than N.
/// Larger N already has 5..8 loads in flight, and unrolling would push the
/// register count past what 512-thread blocks can hold.
///
/// # Safety
/// Every `inputs[r]` must be valid for reads, and `dst` (and `dst2` unless
/// null) valid for writes, of packs `first .. end`; all of them 16-byte
/// aligned global addresses.
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
            // SAFETY: first <= i < i + stride < end: both packs are in
            // every input (caller contract).
            unsafe {
                v[r] = ld_pack(inputs[r].add(i as usize));
                w[r] = ld_pack(inputs[r].add((i + stride) as usize));
            }
            r += 1;
        }
        let a = reduce_pack::<E, N>(&v);
        let b = reduce_pack::<E, N>(&w);
        // SAFETY: both packs are below `end`, so inside `dst` and, when not
        // null, `dst2` (caller contract).
        unsafe {
            store::<KEEP>(dst.add(i as usize), a);
            store::<KEEP>(dst.add((i + stride) as usize), b);
            if !dst2.is_null() {
                st_pack_streaming(dst2.add(i as usize), a);
                st_pack_streaming(dst2.add((i + stride) as usize), b);
            }
        }
        i += 2 * stride;
    }
    while i < end {
        // SAFETY: first <= i < end: pack i is in every input, in `dst` and,
        // when not null, in `dst2` (caller contract).
        unsafe {
            let a = reduce_at::<E, N>(inputs, i);
            store::<KEEP>(dst.add(i as usize), a);
            if !dst2.is_null() {
                st_pack_streaming(dst2.add(i as usize), a);
            }
        }
        i += stride;
    }
}

/// Copies packs `first + g`, `first + g + stride`, ... below `end`, four
/// per iteration: a copy has no arithmetic to hide latency behind, so it
/// needs more loads in flight than the reductions.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of packs
/// `first .. end`, both 16-byte aligned global addresses.
#[inline(always)]
unsafe fn copy_range(src: *const Pack, dst: *mut Pack, first: u64, end: u64, g: u64, stride: u64) {
    let mut i = first + g;
    while i + 3 * stride < end {
        // SAFETY: first <= i < i + 3 * stride < end: all four packs are in
        // `src` and `dst` (caller contract).
        unsafe {
            let a = ld_pack(src.add(i as usize));
            let b = ld_pack(src.add((i + stride) as usize));
            let c = ld_pack(src.add((i + 2 * stride) as usize));
            let d = ld_pack(src.add((i + 3 * stride) as usize));
            st_pack_streaming(dst.add(i as usize), a);
            st_pack_streaming(dst.add((i + stride) as usize), b);
            st_pack_streaming(dst.add((i + 2 * stride) as usize), c);
            st_pack_streaming(dst.add((i + 3 * stride) as usize), d);
        }
        i += 4 * stride;
    }
    while i < end {
        // SAFETY: first <= i < end: pack i is in `src` and `dst` (caller
        // contract).
        unsafe { st_pack_streaming(dst.add(i as usize), ld_pack(src.add(i as usize))) };
        i += stride;
    }
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
                )
            };
        }
        return;
    }
    let output = pick::<N>(&a.outputs, rank);
    let out = output as *mut Pack;
    let epoch_ptr = (own_sig as usize + Signal::EPOCH_OFFSET + 4 * block as usize) as *mut u32;
    // SAFETY: `epoch[block]` of this rank's own signal; block < MAX_BLOCKS.
    let prev = unsafe { read_volatile(epoch_ptr) };
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
    if tid == 0 {
        // Every thread that needed the old value read it before the barrier.
        // SAFETY: as for the read of `epoch_ptr` above.
        unsafe { write_volatile(epoch_ptr, epoch) };
    }

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

/// One rank's part of a push collective ([`Algorithm::Push`]), run by every
/// thread of every block of the launch: write this rank's input into its
/// slot of every peer's landing zone, arrive and wait (publishing), then
/// reduce the landing zone (and this rank's own input) in rank order. No
/// rank reads peer memory, so there is no `End` barrier.
///
/// # Safety
/// As for [`allreduce`], except that only this rank's input in the table is
/// read; `a.landing_part` is a multiple of 16 and at least
/// `ceil(a.count / lanes) * 16`, the same on every rank; and every rank's
/// signal allocation holds a landing zone of `2 * N * a.landing_part`
/// bytes after the [`Signal`].
#[inline(always)]
unsafe fn allreduce_push<E: Element, const N: usize>(a: &LaunchArgs, rank: u32) {
    if (a.absent_ranks >> rank) & 1 != 0 || rank as usize >= N {
        return;
    }
    let block = block_idx_x();
    let nblocks = grid_dim_x();
    let tid = thread_idx_x();
    let nthreads = block_dim_x();
    let own_sig = pick::<N>(&a.signals, rank);
    // SAFETY: `a.table` points to a RankTable the host filled (contract).
    let own_in = unsafe { (*(a.table as *const RankTable)).inputs[rank as usize] };
    let code = if nblocks as usize > MAX_BLOCKS || (nthreads as usize) < N {
        error_code::BAD_LAUNCH
    } else if own_in == 0 {
        error_code::UNREGISTERED
    } else {
        error_code::NONE
    };
    if code != error_code::NONE {
        if tid == 0 {
            // SAFETY: `own_sig` is this rank's own signal (contract).
            unsafe { record_error(own_sig, a.host_error, code, rank, block, 0, 0, 0) };
        }
        return;
    }
    let epoch_ptr = (own_sig as usize + Signal::EPOCH_OFFSET + 4 * block as usize) as *mut u32;
    // SAFETY: `epoch[block]` of this rank's own signal; block < MAX_BLOCKS.
    let epoch = next_epoch(unsafe { read_volatile(epoch_ptr) });

    let lanes = E::LANES as u64;
    let s = split(a.count, lanes);
    let g = (block * nthreads + tid) as u64;
    let stride = (nblocks * nthreads) as u64;
    // Bytes from a landing zone's start to source `src`'s part of this
    // collective's slot (a layout that does not depend on the message).
    let part = |src: u64| ((epoch as u64 & 1) * N as u64 + src) * a.landing_part;

    // Phase 1: this rank's input into its part of every peer's zone.
    let mut dst = [0u64; MAX_RANKS];
    let mut p = 0;
    while p < N {
        dst[p] =
            pick::<N>(&a.signals, p as u32) + Signal::LANDING_OFFSET as u64 + part(rank as u64);
        p += 1;
    }
    let src = own_in as *const Pack;
    let mut i = g;
    while i < s.packs {
        // SAFETY: pack i < s.packs is inside this rank's input and inside
        // every peer's part, which holds `packs` packs (contract).
        unsafe {
            let v = ld_pack(src.add(i as usize));
            let mut p = 0;
            while p < N {
                if p as u32 != rank {
                    st_pack((dst[p] as *mut Pack).add(i as usize), v);
                }
                p += 1;
            }
        }
        i += stride;
    }
    let mut k = g;
    while k < s.tail {
        let idx = s.packs * lanes + k;
        // SAFETY: idx < a.count: inside the input, and inside every part
        // (which holds `packs * lanes >= a.count` elements).
        unsafe {
            let v = ld_elem::<E>(own_in, idx);
            let mut p = 0;
            while p < N {
                if p as u32 != rank {
                    st_elem::<E>(dst[p], idx, v);
                }
                p += 1;
            }
        }
        k += stride;
    }

    // SAFETY: the signals are the group's (contract), rank < N,
    // block < MAX_BLOCKS and blockDim.x >= N (checked above), and control
    // flow is uniform across the block up to here. `Start` publishes the
    // writes above (bar.sync, then a release arrival).
    let ok = unsafe {
        block_barrier::<N>(
            a,
            Algorithm::Push,
            own_sig,
            rank,
            block,
            BarrierKind::Start,
            epoch,
        )
    };
    if !ok {
        return;
    }
    if tid == 0 {
        // Every thread that needed the old value read it before the barrier.
        // SAFETY: as for the read of `epoch_ptr` above.
        unsafe { write_volatile(epoch_ptr, epoch) };
    }

    // Phase 2: reduce this rank's zone in rank order; its own part is its
    // input itself.
    let zone = own_sig + Signal::LANDING_OFFSET as u64;
    let mut from = [0u64; MAX_RANKS];
    let mut r = 0;
    while r < N {
        from[r] = if r as u32 == rank {
            own_in
        } else {
            zone + part(r as u64)
        };
        r += 1;
    }
    let mut inputs = [core::ptr::null::<Pack>(); N];
    let mut r = 0;
    while r < N {
        inputs[r] = from[r] as *const Pack;
        r += 1;
    }
    let output = pick::<N>(&a.outputs, rank);
    // SAFETY: packs [0, s.packs) and the tail are inside every part (filled
    // by the peers before their published arrival), the input and the
    // output, which hold `a.count` elements (contract).
    unsafe {
        reduce_range::<E, N, false>(
            &inputs,
            output as *mut Pack,
            core::ptr::null_mut(),
            0,
            s.packs,
            g,
            stride,
        );
        reduce_tail::<E, N>(&from, output, s.packs * lanes, s.tail, g, stride);
    }
}

macro_rules! push_entries {
    ($( $name:ident, $vname:ident: $E:ty, $N:literal; )*) => { $(
        /// A real-rank push entry: this rank is `a.rank`.
        ///
        /// # Safety
        /// Launched by the host under the launch contract of the module
        /// documentation, with `a` filled as `allreduce_push` requires.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: LaunchArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_push::<$E, $N>(&a, a.rank) }
        }
        /// A virtual-rank push entry: this rank is `blockIdx.y`.
        ///
        /// # Safety
        /// As for the real-rank entry, with `gridDim.y == N` and every
        /// block co-resident.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(a: LaunchArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_push::<$E, $N>(&a, block_idx_y()) }
        }
    )* };
}

push_entries! {
    allreduce_push_f32_w1, allreduce_push_f32_w1_virtual: F32, 1;
    allreduce_push_f32_w2, allreduce_push_f32_w2_virtual: F32, 2;
    allreduce_push_f32_w3, allreduce_push_f32_w3_virtual: F32, 3;
    allreduce_push_f32_w4, allreduce_push_f32_w4_virtual: F32, 4;
    allreduce_push_f32_w5, allreduce_push_f32_w5_virtual: F32, 5;
    allreduce_push_f32_w6, allreduce_push_f32_w6_virtual: F32, 6;
    allreduce_push_f32_w7, allreduce_push_f32_w7_virtual: F32, 7;
    allreduce_push_f32_w8, allreduce_push_f32_w8_virtual: F32, 8;
    allreduce_push_f16_w1, allreduce_push_f16_w1_virtual: F16, 1;
    allreduce_push_f16_w2, allreduce_push_f16_w2_virtual: F16, 2;
    allreduce_push_f16_w3, allreduce_push_f16_w3_virtual: F16, 3;
    allreduce_push_f16_w4, allreduce_push_f16_w4_virtual: F16, 4;
    allreduce_push_f16_w5, allreduce_push_f16_w5_virtual: F16, 5;
    allreduce_push_f16_w6, allreduce_push_f16_w6_virtual: F16, 6;
    allreduce_push_f16_w7, allreduce_push_f16_w7_virtual: F16, 7;
    allreduce_push_f16_w8, allreduce_push_f16_w8_virtual: F16, 8;
    allreduce_push_bf16_w1, allreduce_push_bf16_w1_virtual: Bf16, 1;
    allreduce_push_bf16_w2, allreduce_push_bf16_w2_virtual: Bf16, 2;
    allreduce_push_bf16_w3, allreduce_push_bf16_w3_virtual: Bf16, 3;
    allreduce_push_bf16_w4, allreduce_push_bf16_w4_virtual: Bf16, 4;
    allreduce_push_bf16_w5, allreduce_push_bf16_w5_virtual: Bf16, 5;
    allreduce_push_bf16_w6, allreduce_push_bf16_w6_virtual: Bf16, 6;
    allreduce_push_bf16_w7, allreduce_push_bf16_w7_virtual: Bf16, 7;
    allreduce_push_bf16_w8, allreduce_push_bf16_w8_virtual: Bf16, 8;
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
