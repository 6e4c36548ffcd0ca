//! The allreduce entry points.
//!
//! Every entry takes one [`LaunchArgs`] by value. Names follow
//! `allreduce_{one_stage|two_stage|push|push_ll|push_two_stage|push_islands}_{f32|f16|bf16}_w{N}[_virtual]`; the
//! host's entry table builds the same names from the same parts.
//!
//! Launch contract (checked by the host, and by the kernel where a wrong
//! value would corrupt memory): `gridDim.x <= MAX_BLOCKS` blocks per rank,
//! `blockDim.x >= N`, the same grid on every rank of a collective, and for
//! `_virtual` entries `gridDim.y == N` with all blocks co-resident. A push
//! kernel reads its own input at `own_inputs[rank]` where that is not 0
//! (the host sets it for push_ll only), else at the table's entry.
//!
//! Files: this one holds what every algorithm shares (flags, the barrier,
//! error records, element and pack loops); `pull.rs` the one-stage and
//! two-stage entries, which read peers' buffers; `push.rs` the push entries,
//! which write into peers' landing zones; `push_ll.rs` the push entries whose
//! data carries its own arrival signal; `push_two_stage.rs` reduce-scatter
//! and all-gather by writes into landing zones; `push_islands.rs` the same
//! over two islands of ranks, with f32 partials crossing between them;
//! `norm.rs` the fused
//! allreduce + residual add + RMSNorm (`allreduce_rmsnorm_*`).
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
    // SAFETY: forwarded contract; ranks 0..N are every rank.
    unsafe { block_barrier_among::<N>(a, algo, own_sig, rank, block, kind, epoch, 0, N as u32) }
}

/// [`block_barrier`] between block `block` of ranks `first .. first +
/// count` only (push_islands' `Relay`, among the first island): thread p
/// of that range does the flag exchange with peer p.
///
/// # Safety
/// As for [`block_barrier`], with `first + count <= N` and `rank` in the
/// range; every rank of the range must call it (and no other rank need).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block_barrier_among<const N: usize>(
    a: &LaunchArgs,
    algo: Algorithm,
    own_sig: u64,
    rank: u32,
    block: u32,
    kind: BarrierKind,
    epoch: u32,
    first: u32,
    count: u32,
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
    if tid >= first && tid - first < count && (tid as usize) < N {
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

/// Commits this collective's epoch: the counter of block `block` and the
/// counters of the blocks this launch does not run (`block + k * nblocks`),
/// so that every block's counter stays equal to the number of collectives
/// the group ran (zeroed memory: all equal). Push picks its landing slot by
/// the epoch's parity, which must then be the same in every block of a
/// collective whatever grids earlier collectives used; otherwise a block
/// could take the slot a differently numbered block of the previous
/// collective is still reading. The block's threads share the stores (one
/// each, mostly): a single thread issuing 64 volatile stores cost ~1 us.
///
/// # Safety
/// `own_sig` is this rank's own [`Signal`]; called by every thread of the
/// block (`tid`, `nthreads`), after every thread read the old value.
#[inline(always)]
unsafe fn commit_epoch(
    own_sig: u64,
    block: u32,
    nblocks: u32,
    tid: u32,
    nthreads: u32,
    epoch: u32,
) {
    let mut b = block as usize + tid as usize * nblocks as usize;
    while b < MAX_BLOCKS {
        // SAFETY: `epoch[b]` of this rank's own signal, b < MAX_BLOCKS; no
        // other block of this launch writes it (each writes its own residue
        // class modulo `nblocks`), no other thread of this block either, and
        // none reads it but block `b`, which is this one when b < nblocks.
        unsafe {
            write_volatile(
                (own_sig as usize + Signal::EPOCH_OFFSET + 4 * b) as *mut u32,
                epoch,
            )
        };
        b += nthreads as usize * nblocks as usize;
    }
}

/// The epoch block `block` of this rank last committed (`epoch[block]` of
/// its own signal); the next collective's is [`next_epoch`] of it.
///
/// # Safety
/// `own_sig` is this rank's own [`Signal`] and `block < MAX_BLOCKS`.
#[inline(always)]
unsafe fn read_epoch(own_sig: u64, block: u32) -> u32 {
    let p = (own_sig as usize + Signal::EPOCH_OFFSET + 4 * block as usize) as *const u32;
    // SAFETY: `epoch[block]` of this rank's own signal (caller contract).
    unsafe { read_volatile(p) }
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
/// needs more loads in flight than the reductions. Stores are evict-first
/// (final results).
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of packs
/// `first .. end`, both 16-byte aligned global addresses.
#[inline(always)]
unsafe fn copy_range(src: *const Pack, dst: *mut Pack, first: u64, end: u64, g: u64, stride: u64) {
    // SAFETY: forwarded caller contract.
    unsafe { copy_range_as::<false>(src, dst, first, end, g, stride) }
}

/// [`copy_range`] with plain stores, for data a peer reads next (landing
/// zones).
///
/// # Safety
/// As for [`copy_range`].
#[inline(always)]
unsafe fn copy_range_keep(
    src: *const Pack,
    dst: *mut Pack,
    first: u64,
    end: u64,
    g: u64,
    stride: u64,
) {
    // SAFETY: forwarded caller contract.
    unsafe { copy_range_as::<true>(src, dst, first, end, g, stride) }
}

/// The loop of [`copy_range`], storing with [`store`]`::<KEEP>`.
///
/// # Safety
/// As for [`copy_range`].
#[inline(always)]
unsafe fn copy_range_as<const KEEP: bool>(
    src: *const Pack,
    dst: *mut Pack,
    first: u64,
    end: u64,
    g: u64,
    stride: u64,
) {
    let mut i = first + g;
    while i + 3 * stride < end {
        // SAFETY: first <= i < i + 3 * stride < end: all four packs are in
        // `src` and `dst` (caller contract).
        unsafe {
            let a = ld_pack(src.add(i as usize));
            let b = ld_pack(src.add((i + stride) as usize));
            let c = ld_pack(src.add((i + 2 * stride) as usize));
            let d = ld_pack(src.add((i + 3 * stride) as usize));
            store::<KEEP>(dst.add(i as usize), a);
            store::<KEEP>(dst.add((i + stride) as usize), b);
            store::<KEEP>(dst.add((i + 2 * stride) as usize), c);
            store::<KEEP>(dst.add((i + 3 * stride) as usize), d);
        }
        i += 4 * stride;
    }
    while i < end {
        // SAFETY: first <= i < end: pack i is in `src` and `dst` (caller
        // contract).
        unsafe { store::<KEEP>(dst.add(i as usize), ld_pack(src.add(i as usize))) };
        i += stride;
    }
}

/// push_two_stage and push_islands (one slot, parts of `a.landing_part`
/// bytes, the tail pack `tail` bytes into a part): this rank's `s.tail`
/// elements after its last whole pack into the tail pack of its part of
/// every peer's zone, grid-stride.
///
/// # Safety
/// `own_in` holds the message; `a.table` points to the group's
/// [`RankTable`], whose signals each hold such a zone at
/// `a.landing_offset`, with a tail pack of at least `s.tail` elements.
#[inline(always)]
unsafe fn send_tail<E: Element, const N: usize>(
    a: &LaunchArgs,
    rank: u32,
    own_in: u64,
    s: crate::reduce::Split,
    tail: u64,
    g: u64,
    stride: u64,
) {
    // SAFETY: `a.table` points to the group's RankTable (contract).
    let table = unsafe { &*(a.table as *const RankTable) };
    let mut t = g;
    while t < s.tail {
        // SAFETY: the tail element is inside the input; the tail pack of
        // every part holds `lanes > s.tail` elements.
        unsafe {
            let v = ld_elem::<E>(own_in, s.packs * E::LANES as u64 + t);
            let mut p = 0;
            while p < N {
                if p as u32 != rank {
                    let sig = read_volatile(&table.signals[p]);
                    let at = sig + a.landing_offset + rank as u64 * a.landing_part + tail;
                    st_elem::<E>(at, t, v);
                }
                p += 1;
            }
        }
        t += stride;
    }
}

/// The tail [`send_tail`] sent, after the arrivals that publish it:
/// reduced in rank order from this rank's input and the peers' tail packs
/// in its own zone (`zone`), into `output`.
///
/// # Safety
/// As for [`send_tail`], with `zone` this rank's zone, every peer's tail
/// pack filled before its published arrival, and `output` holding the
/// message.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn reduce_landed_tail<E: Element, const N: usize>(
    a: &LaunchArgs,
    rank: u32,
    own_in: u64,
    zone: u64,
    output: u64,
    s: crate::reduce::Split,
    tail: u64,
    g: u64,
    stride: u64,
) {
    let tail_at = s.packs * E::LANES as u64;
    let esize = 16 / E::LANES as u64;
    // `reduce_tail` indexes from the message start, so each peer's tail
    // pack is addressed as if it sat at the tail's position.
    let mut from = [0u64; MAX_RANKS];
    let mut r = 0;
    while r < N {
        from[r] = if r as u32 == rank {
            own_in
        } else {
            (zone + r as u64 * a.landing_part + tail).wrapping_sub(tail_at * esize)
        };
        r += 1;
    }
    // SAFETY: elements tail_at .. tail_at + tail of `from[r]` are the
    // peer's tail pack or this input's tail; the output holds them
    // (contract).
    unsafe { reduce_tail::<E, N>(&from, output, tail_at, s.tail, g, stride) };
}

/// What a push-family kernel has once [`push_start`] passed.
struct PushStart {
    own_sig: u64,
    /// This rank's input (never null).
    own_in: u64,
    block: u32,
    nblocks: u32,
    tid: u32,
    nthreads: u32,
    /// This collective's epoch for this block, not yet committed.
    epoch: u32,
}

/// The common start of the push kernels (push, push_ll, push_two_stage),
/// which read only their own input: `None` for an absent rank or one past
/// `N`, and after recording `BAD_LAUNCH` (more than [`MAX_BLOCKS`] blocks,
/// or, where the kernel runs barriers, fewer threads than ranks) or
/// `UNREGISTERED` (a null own input); otherwise the block's next epoch.
/// [`PushBegun::issue`] then [`PushBegun::check`].
///
/// # Safety
/// `a.signals[..N]` are the group's signals and `a.table` points to the
/// group's [`RankTable`] (the launch contract).
#[inline(always)]
unsafe fn push_start<const N: usize>(
    a: &LaunchArgs,
    rank: u32,
    barriers: bool,
) -> Option<PushStart> {
    // SAFETY: forwarded caller contract.
    unsafe { PushBegun::issue::<N>(a, rank, barriers) }?.check(a)
}

/// [`push_start`] in two steps: the two loads every push kernel starts
/// with (its own input from the pointer table, unless the launch gives it
/// in `LaunchArgs::own_inputs`, and its block's epoch) are
/// issued by [`PushBegun::issue`] and looked at by [`PushBegun::check`],
/// so a kernel can put independent work (the fused kernel's residual and
/// gamma loads) between them, while the loads, the head of its longest
/// chain of round trips (table, own input, the sends), are in flight.
struct PushBegun {
    own_sig: u64,
    /// This rank's input: the launch's `own_inputs` entry, else the
    /// table's (null: unregistered).
    own_in: u64,
    /// The block's last committed epoch (read at block 0 when `bad`).
    prev: u32,
    /// The launch is malformed (`BAD_LAUNCH`).
    bad: bool,
    rank: u32,
    block: u32,
    nblocks: u32,
    tid: u32,
    nthreads: u32,
}

impl PushBegun {
    /// `None` for an absent rank or one past `N`; otherwise both loads
    /// issued, nothing recorded yet.
    ///
    /// # Safety
    /// As for [`push_start`].
    #[inline(always)]
    unsafe fn issue<const N: usize>(a: &LaunchArgs, rank: u32, barriers: bool) -> Option<Self> {
        if (a.absent_ranks >> rank) & 1 != 0 || rank as usize >= N {
            return None;
        }
        let block = block_idx_x();
        let nblocks = grid_dim_x();
        let nthreads = block_dim_x();
        let own_sig = pick::<N>(&a.signals, rank);
        let bad = nblocks as usize > MAX_BLOCKS || (barriers && (nthreads as usize) < N);
        // This launch's own input where the host gave it (no table load
        // before the first input load), else the table's entry.
        let direct = pick::<N>(&a.own_inputs, rank);
        let own_in = if direct != 0 {
            direct
        } else {
            // SAFETY: `a.table` points to a RankTable the host filled
            // (contract). A plain load (a volatile one goes past L1 at
            // system scope, and measured slower).
            unsafe { (*(a.table as *const RankTable)).inputs[rank as usize] }
        };
        // SAFETY: own signal; the block index is below MAX_BLOCKS (block 0
        // when the launch is bad, whose value is never used).
        let prev = unsafe { read_epoch(own_sig, if bad { 0 } else { block }) };
        Some(PushBegun {
            own_sig,
            own_in,
            prev,
            bad,
            rank,
            block,
            nblocks,
            tid: thread_idx_x(),
            nthreads,
        })
    }

    /// The same, with the epoch's load first waited for at
    /// [`PushBegun::check`], after the loads issued between `issue` and
    /// this call ([`ordered_u32`]), not at once after `issue`.
    #[inline(always)]
    fn epoch_after_loads(self) -> Self {
        PushBegun {
            prev: ordered_u32(self.prev),
            ..self
        }
    }

    /// Records `BAD_LAUNCH` or `UNREGISTERED` and returns `None`, or the
    /// block's next epoch.
    #[inline(always)]
    fn check(self, a: &LaunchArgs) -> Option<PushStart> {
        let code = if self.bad {
            error_code::BAD_LAUNCH
        } else if self.own_in == 0 {
            error_code::UNREGISTERED
        } else {
            let epoch = next_epoch(self.prev);
            return Some(PushStart {
                own_sig: self.own_sig,
                own_in: self.own_in,
                block: self.block,
                nblocks: self.nblocks,
                tid: self.tid,
                nthreads: self.nthreads,
                epoch,
            });
        };
        if self.tid == 0 {
            // SAFETY: `own_sig` is this rank's own signal (contract).
            unsafe {
                record_error(
                    self.own_sig,
                    a.host_error,
                    code,
                    self.rank,
                    self.block,
                    0,
                    0,
                    0,
                )
            };
        }
        None
    }
}

/// The real-rank and virtual-rank entries of a push-family kernel `$f`,
/// one pair per (element type, world) line.
macro_rules! push_entries {
    ($f:ident; $( $name:ident, $vname:ident: $E:ty, $N:literal; )*) => { $(
        /// A real-rank entry: this rank is `a.rank`.
        ///
        /// # Safety
        /// Launched by the host under the launch contract of the module
        /// documentation, with `a` filled as the kernel function requires.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: LaunchArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { $f::<$E, $N>(&a, a.rank) }
        }
        /// A virtual-rank entry: this rank is `blockIdx.y`.
        ///
        /// # Safety
        /// As for the real-rank entry, with `gridDim.y == N` and every
        /// block co-resident.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(a: LaunchArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { $f::<$E, $N>(&a, block_idx_y()) }
        }
    )* };
}

mod norm;
mod pull;
mod push;
mod push_islands;
mod push_ll;
mod push_two_stage;
