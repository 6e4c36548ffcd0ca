// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// A block's share of a fused launch ([`BlockRows`]) and the loops over its
// rows: one loop per path (register path [`reg_rows`], two-pass
// [`two_pass_rows`]), each ending after the same row in every thread
// (and, split over a cluster, every CTA) once any wait failed.

/// A block's share of a fused launch: this rank's buffers (`rows * hidden`
/// elements each, but `gamma`: `hidden`), and the rows `first, first +
/// step, ...` below `rows`.
#[derive(Clone, Copy)]
struct BlockRows {
    res_in: u64,
    res_out: u64,
    gamma: u64,
    normed: u64,
    first: u64,
    step: u64,
    rows: u64,
    hidden: u64,
    eps: f32,
}

/// The block's rows ([`BlockRows`]), each from `sums`
/// ([`RowSums::for_row`] first), on the register path when `rr` is on,
/// else by [`norm_row`]: one loop per path, so the fallback never holds the
/// register path's values.
///
/// # Safety
/// As for [`norm_row`], for every row below `rows`; `rr` was prepared for
/// this block's first row.
#[inline(always)]
unsafe fn norm_rows<E: Element, S: RowSums>(
    sums: &mut S,
    rr: &mut RegRows<false>,
    b: &BlockRows,
    sh: SharedWords,
) {
    // SAFETY (both arms): forwarded caller contract.
    unsafe {
        if rr.on {
            reg_rows::<E, S, false>(sums, rr, b, sh)
        } else {
            two_pass_rows::<E, S>(sums, b, sh)
        }
    }
}

/// The block's rows on the register path ([`RegRows::row`]). A source that
/// can fail ends the loop after a row where any thread's wait failed (a
/// `bar.red.or` vote; split over a cluster, any thread's of any CTA, so
/// every CTA of the cluster leaves after the same row).
///
/// # Safety
/// As for [`norm_rows`], with `rr.on`.
#[inline(always)]
unsafe fn reg_rows<E: Element, S: RowSums, const SPLIT: bool>(
    sums: &mut S,
    rr: &mut RegRows<SPLIT>,
    b: &BlockRows,
    sh: SharedWords,
) {
    let mut row = b.first;
    while row < b.rows {
        let next = row + b.step;
        sums.for_row(row);
        // SAFETY: forwarded caller contract; `sh` holds NORM_MAX_CHUNKS
        // = 2 * REG_HALF_WORDS words.
        if unsafe { rr.row::<E, S>(sums, b, row, next, sh) } {
            break;
        }
        row = next;
    }
}

/// The block's rows by [`norm_row`] (any shape), with the same vote as
/// [`reg_rows`].
///
/// # Safety
/// As for [`norm_rows`].
#[inline(always)]
unsafe fn two_pass_rows<E: Element, S: RowSums>(sums: &mut S, b: &BlockRows, sh: SharedWords) {
    let mut row = b.first;
    while row < b.rows {
        sums.for_row(row);
        // SAFETY: forwarded caller contract.
        unsafe {
            norm_row::<E, S>(
                sums, b.res_in, b.res_out, b.gamma, b.normed, row, b.hidden, b.eps, sh,
            )
        };
        if S::CAN_FAIL && sync_threads_or(sums.failed()) {
            return;
        }
        row += b.step;
    }
}
