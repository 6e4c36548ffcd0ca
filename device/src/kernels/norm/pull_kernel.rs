// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// The fused one-stage and two-stage kernel body ([`allreduce_rmsnorm`]),
// which reads peers' buffers, and two-stage's first stage ([`sum_row`]: a
// row's rounded sums into the owner's scratch).

/// Rounded sums of row `row` into `dst` (two-stage, stage 1), by every
/// thread of the block.
///
/// # Safety
/// The row lies inside every input and `dst`.
#[inline(always)]
unsafe fn sum_row<E: Element, const N: usize>(
    inputs: &[u64; MAX_RANKS],
    dst: u64,
    row: u64,
    hidden: u64,
) {
    let tid = thread_idx_x() as u64;
    let nthreads = block_dim_x() as u64;
    if hidden % NORM_CHUNK as u64 == 0 {
        let lanes = E::LANES as u64;
        let mut inp = [core::ptr::null::<Pack>(); N];
        let mut r = 0;
        while r < N {
            inp[r] = inputs[r] as *const Pack;
            r += 1;
        }
        let (p0, p1) = (row * hidden / lanes, (row + 1) * hidden / lanes);
        // SAFETY: packs p0 .. p1 are the row's, inside every input and
        // `dst` (contract).
        unsafe {
            reduce_range::<E, N, true>(
                &inp,
                dst as *mut Pack,
                core::ptr::null_mut(),
                p0,
                p1,
                tid,
                nthreads,
            )
        };
    } else {
        // SAFETY: the row's elements are inside every input and `dst`.
        unsafe { reduce_tail::<E, N>(inputs, dst, row * hidden, hidden, tid, nthreads) };
    }
}

/// One rank's part of a fused collective, by every thread of every block;
/// block b takes rows b, b + nblocks, ... One-stage: every rank reduces and
/// normalises every row, reading every rank's input. Two-stage: rank r
/// reduces its partition of the rows into its scratch (rounded sums);
/// after `Mid` every rank normalises every row, its own partition from its
/// scratch and the others' from their owners' (block b reads the rows
/// block b wrote: the same row decomposition on every rank). Each rank
/// adds its own residual and uses its own gamma, so both algorithms give
/// the same bits for any residuals.
///
/// # Safety
/// As for the allreduce ([`super::pull`]), with `p` filled as
/// [`NormArgs`] says: `a.count == rows * hidden`; residual, residual out,
/// normed (`a.outputs`) of `a.count` elements and gamma of `hidden`
/// elements for this rank; two-stage scratch of `a.count` elements for
/// every rank.
#[inline(always)]
unsafe fn allreduce_rmsnorm<E: Element, const N: usize, const TWO_STAGE: bool>(
    p: &NormArgs,
    rank: u32,
) {
    let a = &p.base;
    if (a.absent_ranks >> rank) & 1 != 0 || rank as usize >= N {
        return;
    }
    let sh = norm_shared();
    let block = block_idx_x();
    let nblocks = grid_dim_x();
    let tid = thread_idx_x();
    let nthreads = block_dim_x();
    let own_sig = pick::<N>(&a.signals, rank);
    let (rows, hidden) = (p.rows, p.hidden);
    // The pointer table and the block's epoch first: the epoch heads the
    // longest chain (the Start barrier's round trips); the loads below
    // overlap them.
    // SAFETY: `a.table` points to a RankTable the host filled (contract).
    let t = unsafe { &*(a.table as *const RankTable) };
    let mut missing = false;
    let mut r = 0;
    while r < N {
        missing |= t.inputs[r] == 0;
        r += 1;
    }
    // SAFETY: own signal; the block index is below MAX_BLOCKS (block 0 past
    // it: such a launch is bad, and the value is never used).
    let prev = unsafe {
        read_epoch(
            own_sig,
            if (block as usize) < MAX_BLOCKS {
                block
            } else {
                0
            },
        )
    };
    let bad = nblocks as usize > MAX_BLOCKS
        || (nthreads as usize) < N
        || hidden as usize > NORM_MAX_HIDDEN
        || rows.checked_mul(hidden) != Some(a.count);
    let res_in = pick::<N>(&p.residual, rank);
    let res_out = pick::<N>(&p.residual_out, rank);
    let gamma = pick::<N>(&p.gamma, rank);
    let normed = pick::<N>(&a.outputs, rank);
    // Gamma and the first row's residual are this rank's own buffers: their
    // loads go out while the table and the epoch are read and before the
    // barriers are waited.
    // SAFETY: the buffers the launch contract gives (unless `bad`).
    let mut rr = unsafe {
        RegRows::<false>::prepare::<E>(
            !bad && (TWO_STAGE || N <= 4),
            None,
            res_in,
            gamma,
            block as u64,
            rows,
            hidden,
        )
    };
    let code = if bad {
        error_code::BAD_LAUNCH
    } else if missing {
        error_code::UNREGISTERED
    } else {
        error_code::NONE
    };
    if code != error_code::NONE {
        if tid == 0 {
            // SAFETY: `own_sig` is this rank's own signal (contract).
            unsafe { record_error(own_sig, a.host_error, code, rank, block, 0, 0, 0, 0) };
        }
        return;
    }
    let algo = if TWO_STAGE {
        Algorithm::TwoStage
    } else {
        Algorithm::OneStage
    };
    let epoch = next_epoch(prev);
    // SAFETY: (every barrier below) the group's signals, rank < N, block <
    // MAX_BLOCKS, blockDim.x >= N (checked), uniform control flow.
    if !unsafe { block_barrier::<N>(a, algo, own_sig, rank, block, BarrierKind::Start, epoch) } {
        return;
    }
    // SAFETY: own signal; every thread of the block, after the barrier.
    unsafe { commit_epoch(own_sig, block, nblocks, tid, nthreads, epoch) };

    if TWO_STAGE {
        // Stage 1: this rank's rows, rounded sums into its scratch.
        let (first, end) = partition(rows, N as u32, rank);
        let own_scratch = t.scratch[rank as usize];
        // The first row of the partition that block `block` takes.
        let mut row =
            first + (block as u64 + nblocks as u64 - first % nblocks as u64) % nblocks as u64;
        while row < end {
            // SAFETY: row < rows: inside every input and this rank's
            // scratch (count elements, contract).
            unsafe { sum_row::<E, N>(&t.inputs, own_scratch, row, hidden) };
            row += nblocks as u64;
        }
        // SAFETY: as for Start; Mid publishes the scratch rows.
        if !unsafe { block_barrier::<N>(a, algo, own_sig, rank, block, BarrierKind::Mid, epoch) } {
            return;
        }
    }
    // Every row: the sums reduced here (one-stage) or read from the row's
    // owner (two-stage), then this rank's residual add and RMSNorm.
    let b = BlockRows {
        res_in,
        res_out,
        gamma,
        normed,
        first: block as u64,
        step: nblocks as u64,
        rows,
        hidden,
        eps: p.eps,
    };
    // SAFETY (both arms): every row below `rows` is inside every buffer
    // (contract); `sh` is this block's shared array; hidden <=
    // NORM_MAX_HIDDEN (checked); `rr` prepared for row `block`.
    if TWO_STAGE {
        let mut sums = Scratch::<N>::new(&t.scratch, rows);
        unsafe { norm_rows::<E, _>(&mut sums, &mut rr, &b, sh) };
    } else {
        let mut sums = Pull::<N>::new(&t.inputs);
        unsafe { norm_rows::<E, _>(&mut sums, &mut rr, &b, sh) };
    }
    if !TWO_STAGE {
        // No rank returns (and lets its input be overwritten) while a peer
        // still reads it.
        // SAFETY: as for Start.
        unsafe { block_barrier::<N>(a, algo, own_sig, rank, block, BarrierKind::End, epoch) };
    }
}
