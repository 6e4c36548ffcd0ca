// Included into `kernels` by kernels.rs (see there why `include!`).
//
// The common start of the push kernels (push, push_ll, push_two_stage),
// which read only their own input ([`push_start`] gives a [`PushStart`]):
// an absent rank leaves, a bad launch or a null own input is recorded,
// else the block's next epoch; then [`PushBegun::issue`] and
// [`PushBegun::check`].

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
                    0,
                )
            };
        }
        None
    }
}
