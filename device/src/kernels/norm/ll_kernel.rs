// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// The fused push_ll kernel body ([`allreduce_rmsnorm_ll`]): every thread
// sends its packs of this rank's input as flag-in-data lines into every
// peer's LL zone, then each block normalises its rows from its own zone
// ([`ll_rows`]). No barrier and no flag: the data is the arrival.

/// One rank's part of a fused push_ll collective, by every thread of every
/// block: every thread sends its packs of this rank's input (all rows,
/// grid-stride) as flag-in-data lines into every peer's LL zone, as
/// push_ll does; then block b takes rows b, b + nblocks, ..., waiting for
/// each peer's packs of the row in its own zone and reducing them in rank
/// order with its own input, then adds its residual and normalises, as
/// one-stage does (the same arithmetic, so the same bits). No barrier and
/// no flag: the data is the arrival. A wait that times out leaves an error
/// record; the block leaves after that row.
///
/// # Safety
/// As for the push_ll allreduce ([`super::push_ll`]) and the fused
/// one-stage ([`allreduce_rmsnorm`]), with `p` filled as [`NormArgs`]
/// says: `a.count == rows * hidden`, the LL zone's parts hold
/// `ceil(a.count / lanes)` packs.
#[inline(always)]
unsafe fn allreduce_rmsnorm_ll<E: Element, const N: usize>(p: &NormArgs, rank: u32) {
    let a = &p.base;
    // Launched in thread-block clusters (sm_90+), the CTAs of a cluster
    // split each of the cluster's rows; else a block takes whole rows, by
    // code that computes no range.
    let (ctas, _) = cluster_shape();
    // Split rows: this thread has started, said before its first memory
    // access. Its wait comes before the first store into another CTA's
    // shared memory (`ClusterRow::combine`), so the arrival's round trip
    // overlaps the loads and the LL waits. Every exit before that wait
    // (an absent rank, a bad launch, an unregistered input, no rows) is
    // taken by every CTA of the cluster alike: they are one rank's, with
    // the same rows.
    #[cfg(target_feature = "sm_90")]
    if ctas > 1 {
        cluster_arrive_early();
    }
    // The table and epoch loads first: they head the longest chain (own
    // input, sends, the peers' waits); the work below overlaps them.
    // SAFETY: the launch contract.
    let Some(begun) = (unsafe { PushBegun::issue::<N>(a, rank, false) }) else {
        return;
    };
    // The shared arrays, declared once for both paths below.
    let (sh, words) = (norm_shared(), norm_cluster_words());
    // SAFETY: forwarded launch contract; `sh` and `words` are this block's.
    unsafe {
        if ctas > 1 {
            ll_rows::<E, N, true>(p, rank, begun, ctas, sh, words)
        } else {
            ll_rows::<E, N, false>(p, rank, begun, 1, sh, words)
        }
    }
}

/// [`allreduce_rmsnorm_ll`] after its first loads, for a launch in clusters
/// of `ctas` CTAs that split rows (`SPLIT`) or of whole rows (`ctas == 1`).
///
/// # Safety
/// As for [`allreduce_rmsnorm_ll`]; `begun` is this block's, `sh` and
/// `words` its shared arrays ([`norm_shared`], [`norm_cluster_words`]).
#[inline(always)]
unsafe fn ll_rows<E: Element, const N: usize, const SPLIT: bool>(
    p: &NormArgs,
    rank: u32,
    begun: PushBegun,
    ctas: u32,
    sh: SharedWords,
    words: SharedWords,
) {
    let a = &p.base;
    let (rows, hidden) = (p.rows, p.hidden);
    let res_in = pick::<N>(&p.residual, rank);
    let gamma = pick::<N>(&p.gamma, rank);
    // The cluster of this block (a cluster of other than a power of two
    // CTAs is refused below: the shifts are then unused).
    let shift = if SPLIT { ctas.trailing_zeros() } else { 0 };
    let cluster = block_idx_x() >> shift;
    // The first two packs this thread sends, issued before anything waits
    // for the epoch's load: the two round trips (epoch, input) overlap.
    let g = (begun.block * begun.nthreads + begun.tid) as u64;
    let stride = (begun.nblocks * begun.nthreads) as u64;
    // SAFETY: the own input (null, or `a.count` elements: whole packs on
    // the register path, the only one this kernel runs) and the table
    // (launch contract).
    let first = unsafe { super::push_ll::ll_first::<E, N>(a, begun.own_in, g, stride) };
    let begun = begun.epoch_after_loads();
    // Gamma and the first row's residual: in flight during the sends.
    // SAFETY: enabled only where `rows * hidden == count`, the size of the
    // buffers the launch contract gives.
    let mut rr = unsafe {
        RegRows::<SPLIT>::prepare::<E>(
            rows.checked_mul(hidden) == Some(a.count),
            Some(words),
            res_in,
            gamma,
            cluster as u64,
            rows,
            hidden,
        )
    };
    // This kernel has only the register path: the host launches it only
    // for shapes that take it (`abi::norm_reg_path`), and any other is a
    // bad launch, not a silent fallback.
    if !rr.on {
        if thread_idx_x() == 0 {
            let own_sig = pick::<N>(&a.signals, rank);
            // SAFETY: `own_sig` is this rank's own signal (contract).
            unsafe {
                record_error(
                    own_sig,
                    a.host_error,
                    error_code::BAD_LAUNCH,
                    rank,
                    block_idx_x(),
                    0,
                    0,
                    0,
                    0,
                )
            };
        }
        return;
    }
    let res_out = pick::<N>(&p.residual_out, rank);
    let normed = pick::<N>(&a.outputs, rank);
    let Some(PushStart {
        own_sig,
        own_in,
        block,
        nblocks,
        tid,
        nthreads,
        epoch,
    }) = begun.check(a)
    else {
        return;
    };
    // SAFETY: the launch contract (zone and input sizes); on the register
    // path rows are whole chunks, so `count` is a multiple of the lanes;
    // `first` holds packs g and g + stride where they exist.
    unsafe { super::push_ll::ll_send::<E, N, true>(a, rank, own_in, epoch, g, stride, first) };
    // Every thread of the block read the old epoch; commit the new one.
    sync_threads();
    // SAFETY: own signal; every thread of the block, after the bar.sync.
    unsafe { commit_epoch(own_sig, block, nblocks, tid, nthreads, epoch) };

    let mut sums = LlSums::<N> {
        own_in,
        zone: own_sig + a.landing_offset,
        landing_part: a.landing_part,
        epoch,
        tag: ll_highs(epoch, a, rank),
        call_tag: tag_of(a, rank),
        rank,
        count: a.count,
        timeout_ns: a.timeout_ns,
        own_sig,
        host_error: a.host_error,
        block,
        failed: false,
    };
    let b = BlockRows {
        res_in,
        res_out,
        gamma,
        normed,
        // The cluster's rows (a cluster of one without clusters); the
        // grid is whole clusters.
        first: cluster as u64,
        step: (nblocks >> shift) as u64,
        rows,
        hidden,
        eps: p.eps,
    };
    // SAFETY: every row below `rows` is inside every buffer and the zone's
    // parts (contract); `sh` is this block's shared array; `rr` is on
    // (checked) and prepared for row `cluster`.
    unsafe { reg_rows::<E, _, SPLIT>(&mut sums, &mut rr, &b, sh) };
}
