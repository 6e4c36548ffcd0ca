// Included into `kernels` by kernels.rs (see there why `include!`).
//
// The barrier sites: the signal pointer of a rank ([`pick`]), the named
// barrier between the blocks of every rank ([`block_barrier`],
// [`block_barrier_among`]) and the epochs a block commits and reads
// ([`commit_epoch`], [`read_epoch`]). Which barriers run, with which
// order, comes from [`crate::barrier`].

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
    let word = flag_word(epoch, a, rank);
    let mut failed = false;
    if tid >= first && tid - first < count && (tid as usize) < N {
        arrive_ordered(
            // SAFETY: `pick` returns peer `tid`'s signal (tid < N), and
            // block < MAX_BLOCKS, rank < N <= MAX_RANKS (caller contract).
            unsafe { flag(pick::<N>(signals, tid), kind, epoch, block, rank) },
            word,
            order,
        );
        // SAFETY: own signal, block < MAX_BLOCKS, tid < N <= MAX_RANKS.
        let own = unsafe { flag(own_sig, kind, epoch, block, tid) };
        if wait_ordered(own, word, timeout_ns, &mut GlobalTimer, order) == Wait::TimedOut {
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
                    tag_of(a, rank),
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
