// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// The register path of a block's rows ([`RegRows`]): a thread's chunks of
// a row stay in registers from the residual add to the normed values,
// with the slot and pack loops spelled out as literals
// (`for_slot_packs!`) so the `[slot][pack]` arrays stay in registers;
// optionally split over a thread-block cluster ([`ClusterRow`], sm_90 and
// newer), whose CTAs add their partials in the tree's order. Same
// arithmetic and tree as [`norm_row`], so the same bits.

/// Runs `$body` for each (slot `j`, pack `m`) of this thread's chunks on
/// the register path, with `k` the chunk (`tid + j * blockDim.x`, a `u32`),
/// where the chunk exists and has that pack, in order: slot 0's packs, then
/// slot 1's. The indices are literals, so `[slot][pack]` arrays stay in
/// registers: a loop the compiler leaves rolled (the LL waits make bodies
/// large) would index them at run time, in local memory.
macro_rules! for_slot_packs {
    ($E:ty, $chunks:expr, |$j:ident, $m:ident, $k:ident| $body:block) => {{
        for_slot_packs!(@one $E, 0, 0, $chunks, $j, $m, $k, $body);
        for_slot_packs!(@one $E, 0, 1, $chunks, $j, $m, $k, $body);
        for_slot_packs!(@one $E, 1, 0, $chunks, $j, $m, $k, $body);
        for_slot_packs!(@one $E, 1, 1, $chunks, $j, $m, $k, $body);
    }};
    (@one $E:ty, $jv:literal, $mv:literal, $chunks:expr,
     $j:ident, $m:ident, $k:ident, $body:block) => {{
        let $j: usize = $jv;
        let $m: usize = $mv;
        let $k: u32 = thread_idx_x() + $jv * block_dim_x();
        // Both bounds but `$k < $chunks` are constants: the code of a slot
        // or pack the type does not have is not emitted.
        if $j < reg_slots::<$E>() && $m < chunk_packs::<$E>() && $k < $chunks {
            $body
        }
    }};
}

/// Chunks a thread holds in registers on the register path ([`RegRows`]),
/// at most: chunks `tid` and `tid + blockDim.x`.
const REG_SLOTS: usize = 2;

/// Chunks a thread holds on the register path for `E`
/// ([`crate::abi::norm_reg_slots`]).
const fn reg_slots<E: Element>() -> usize {
    crate::abi::norm_reg_slots(E::LANES)
}

/// Packs of one chunk of `E`.
const fn chunk_packs<E: Element>() -> usize {
    NORM_CHUNK / E::LANES
}

/// Packs of one chunk at most (f32: 8 elements in two packs).
const MAX_CHUNK_PACKS: usize = 2;

// `for_slot_packs!` spells out slots 0..2 and packs 0..2.
const _: () = assert!(NORM_CHUNK / 4 == MAX_CHUNK_PACKS && MAX_CHUNK_PACKS == 2 && REG_SLOTS == 2);

/// Words of `sh` per row on the register path: rows alternate between two
/// halves, so a row's group sums never overwrite words a slower thread
/// still reads for the row before (no `bar.sync` at the end of a row).
const REG_HALF_WORDS: usize = REG_SLOTS * 1024;

const _: () = assert!(2 * REG_HALF_WORDS <= crate::abi::NORM_MAX_CHUNKS);

/// A thread's packs of one row on the register path: `[slot][pack]`.
type Slots = [[Pack; MAX_CHUNK_PACKS]; REG_SLOTS];

/// Loads this thread's packs of a row of `buf` whose first pack is `base`
/// (row 0 for gamma): chunk `tid + j * blockDim.x` into slot `j`, where it
/// is below `chunks`.
///
/// # Safety
/// `buf` holds packs `base .. base + chunks * packs per chunk` (whole
/// packs: the row is whole chunks).
#[inline(always)]
unsafe fn load_slots<E: Element>(buf: u64, base: u32, chunks: u32) -> Slots {
    let per_chunk = chunk_packs::<E>() as u32;
    let mut out = [[[0u32; 4]; MAX_CHUNK_PACKS]; REG_SLOTS];
    for_slot_packs!(E, chunks, |j, m, k| {
        // SAFETY: pack base + k * per_chunk + m lies inside the row (k <
        // chunks; caller contract).
        out[j][m] = unsafe {
            ld_pack((buf as *const Pack).add((base + k * per_chunk + m as u32) as usize))
        };
    });
    out
}

/// The register path of a block's rows, taken when every chunk is whole
/// and a thread holds at most [`REG_SLOTS`] of them
/// ([`crate::abi::norm_reg_path`]): gamma
/// is prefetched into L1 once per launch (a thread's chunks are the same in
/// every row) and loaded while the tree runs, each row's residual is
/// loaded a row ahead (the first before the barriers or the sends), and
/// the residual out stays in registers from the add to the normed values:
/// no second pass through memory. Indices are 32-bit (every pack index of
/// the launch fits: checked in [`RegRows::prepare`]). Same arithmetic as
/// [`norm_row`], so the same bits; the GPU suite covers both paths (hidden
/// above `REG_SLOTS * 8 * blockDim.x` or not a multiple of 8 takes
/// [`norm_row`]).
///
/// Split over a thread-block cluster ([`RegRows::prepare`] with `split`,
/// launched with clusters), each CTA takes the aligned power-of-two range
/// of a row's chunks that [`crate::abi::norm_split_range`] gives it, and
/// the CTAs add their ranges' partials through distributed shared memory
/// ([`ClusterRow`]): the same tree, so the same bits, with the row's bytes
/// spread over `ctas` SMs. `SPLIT` is false for launches that take whole
/// rows: their code then computes no range (first pack 0, every chunk).
struct RegRows<const SPLIT: bool> {
    on: bool,
    gamma: u64,
    /// This CTA's chunks of a row (all of them without a split; possibly
    /// none for the last CTAs of a cluster).
    chunks: u32,
    /// This CTA's first pack inside a row (its first chunk's).
    first_pack: u32,
    /// Packs of a row.
    row_packs: u32,
    /// The next row's residual packs.
    res: Slots,
    /// Which half of `sh` the next row uses.
    half: usize,
    /// The cluster's exchange (inactive without a split).
    cluster: ClusterRow,
}

/// The CTAs of a cluster that split each row ([`RegRows`]): every CTA
/// reduces its range's squares, then every CTA adds the `used` CTAs'
/// partials in the tree's order. Inactive (`ctas == 1`) without a split,
/// and always before sm_90.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_feature = "sm_90"), allow(dead_code))]
struct ClusterRow {
    /// CTAs of the cluster.
    ctas: u32,
    /// This CTA's rank in the cluster.
    cta: u32,
    /// CTAs that hold chunks of a row: `ceil(chunks / range)`.
    used: u32,
    /// This CTA's [`crate::abi::NORM_CLUSTER_WORDS`] exchange words (`None`
    /// without a split).
    words: Option<SharedWords>,
    /// Whether this thread has waited at the cluster barrier since its
    /// arrival at the kernel's start ([`cluster_arrive_early`], in
    /// [`allreduce_rmsnorm_ll`]): that wait comes before the first store
    /// into another CTA's shared memory, in the first row's
    /// [`ClusterRow::combine`].
    started: bool,
}

impl ClusterRow {
    fn active(&self) -> bool {
        self.ctas > 1
    }

    /// The row's total and whether any CTA's wait failed, from this CTA's
    /// group sums of its range in `sh` (`chunks` partials, stored before the
    /// block's barrier that gave `failed`, the block's vote): warp 0 adds
    /// them ([`groups_total`]) and its lane c stores the CTA's partial and
    /// vote into CTA c's words of parity `half`, slot of this CTA; a
    /// cluster barrier; then each warp reads, in its own CTA's words, the
    /// `used` CTAs' pairs, adds the partials by [`warp_tree`] (lane c holds
    /// CTA c's; an absent one adds +0.0, which changes no partial, as in
    /// the tree) and ORs the votes.
    ///
    /// Every store into a CTA's words is issued after a cluster barrier
    /// wait that shows every CTA of the cluster started (the first row's:
    /// the wait that completes the kernel's first arrival, issued here,
    /// after the row's loads and LL waits, so it overlaps them; later rows':
    /// the previous row's barrier) and before a cluster barrier that the
    /// CTA stored into then passes, so no CTA reads another's shared memory
    /// and none needs to wait for the others before it exits: every CTA
    /// runs the same rows, so its last row's barrier comes after the last
    /// store into its words. The words of a parity are stored again two
    /// rows later, after the next row's barrier, which no CTA passes before
    /// every CTA has read these. Each thread's arrivals and waits alternate:
    /// the kernel's arrival, this wait, then one arrival and one wait per
    /// row ([`cluster_sync`]); a cluster whose CTAs leave before any row
    /// (they all do: their exits are uniform over the cluster) leaves its
    /// arrival unwaited, which the barrier allows (a wait counts only
    /// threads that have not exited).
    ///
    /// # Safety
    /// Active; every thread of every CTA of the cluster calls it, for the
    /// same rows in the same order, after [`cluster_arrive_early`] at the
    /// kernel's start; `sh` as for [`groups_total`].
    #[inline(always)]
    unsafe fn combine(
        &mut self,
        sh: SharedWords,
        chunks: u32,
        failed: bool,
        half: usize,
    ) -> (f32, bool) {
        #[cfg(target_feature = "sm_90")]
        {
            let Some(words) = self.words else {
                // Active only with a split, which gives the words.
                trap()
            };
            let parity = (half * crate::abi::NORM_MAX_CTAS * 2) as u32;
            let tid = thread_idx_x();
            if !self.started {
                // Every CTA of the cluster has started (arrived) before any
                // store into its shared memory below.
                cluster_wait();
                self.started = true;
            }
            if tid < WARP {
                // SAFETY: forwarded (`sh`); warp 0, converged.
                let local = unsafe { groups_total(sh, chunks) };
                if tid < self.ctas {
                    // SAFETY: words parity + 2 cta, + 1 < NORM_CLUSTER_WORDS
                    // (cta < ctas <= NORM_MAX_CTAS); CTA `tid` < ctas has
                    // started (the wait above or an earlier row's barrier)
                    // and is alive until the barrier below, and no CTA
                    // reads this parity's words between the last barrier
                    // and it (above).
                    unsafe {
                        words.store2_cluster(
                            parity + 2 * self.cta,
                            tid,
                            local,
                            if failed { 1.0 } else { 0.0 },
                        )
                    };
                }
            }
            cluster_sync();
            let lane = tid % WARP;
            let (v, f) = if lane < self.used {
                // SAFETY: CTA `lane` < used <= ctas stored both words
                // before the barrier above; none stores them again before
                // the next row's barrier.
                unsafe { words.load2(parity + 2 * lane) }
            } else {
                (0.0, 0.0)
            };
            let total = shfl_lane0(warp_tree(v, lane));
            (total, warp_any(f != 0.0))
        }
        #[cfg(not(target_feature = "sm_90"))]
        {
            // Never active before sm_90 (`cluster_shape` is (1, 0)).
            let _ = (sh, chunks, failed, half);
            trap()
        }
    }
}

impl<const SPLIT: bool> RegRows<SPLIT> {
    /// This CTA's first pack inside a row: 0 without a split (a constant,
    /// so whole-row code adds nothing).
    #[inline(always)]
    fn first_pack(&self) -> u32 {
        if SPLIT {
            self.first_pack
        } else {
            0
        }
    }

    /// Decides the path (off unless `enabled`, the shape takes it
    /// ([`crate::abi::norm_reg_path_split`]) and every pack index of the
    /// launch fits 32 bits) and, on it, prefetches gamma and issues the
    /// loads of the block's first row's residual (`first_row < rows`).
    /// `split` (with `SPLIT`): a row is split over the CTAs of this block's
    /// cluster (`words`: the cluster exchange, [`norm_cluster_words`]);
    /// else each block takes whole rows, clusters or not.
    ///
    /// # Safety
    /// With `enabled`: `res_in` holds `rows * hidden` elements and `gamma`
    /// holds `hidden` (the launch contract).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn prepare<E: Element>(
        enabled: bool,
        split: Option<SharedWords>,
        res_in: u64,
        gamma: u64,
        first_row: u64,
        rows: u64,
        hidden: u64,
    ) -> Self {
        let lanes = E::LANES as u64;
        let (ctas, cta) = match split {
            Some(_) if SPLIT => cluster_shape(),
            _ => (1, 0),
        };
        // A cluster of a power of two CTAs, at most NORM_MAX_CTAS, and a
        // row of at most NORM_MAX_HIDDEN (else `on` is false and the
        // values below unused): shifts, no division, ahead of the loads.
        let shape_ok = if SPLIT {
            crate::abi::norm_reg_path_split(E::LANES, hidden, block_dim_x() as u64, ctas)
        } else {
            crate::abi::norm_reg_path(E::LANES, hidden, block_dim_x() as u64)
        };
        let on = enabled
            && shape_ok
            && rows
                .checked_mul(hidden / lanes)
                .is_some_and(|p| p <= u32::MAX as u64);
        let all = (hidden / NORM_CHUNK as u64) as u32;
        let (range, first, chunks) = if SPLIT {
            let range = crate::abi::norm_split_range(all, ctas);
            let first = (cta << range.trailing_zeros()).min(all);
            (range, first, (all - first).min(range))
        } else {
            (1, 0, all)
        };
        let per_chunk = chunk_packs::<E>() as u32;
        let mut rr = RegRows {
            on,
            gamma,
            chunks,
            first_pack: first as u32 * per_chunk,
            row_packs: (hidden / lanes) as u32,
            res: [[[0u32; 4]; MAX_CHUNK_PACKS]; REG_SLOTS],
            half: 0,
            cluster: ClusterRow {
                ctas,
                cta,
                used: if SPLIT {
                    (all + range - 1) >> range.trailing_zeros()
                } else {
                    1
                },
                words: if SPLIT { split } else { None },
                started: false,
            },
        };
        if on {
            for_slot_packs!(E, chunks, |_j, m, k| {
                // SAFETY: pack first_pack + k * per_chunk + m of gamma's
                // `hidden` elements (k < chunks of this CTA's range;
                // contract).
                unsafe {
                    prefetch_l1(
                        (gamma as *const Pack)
                            .add((rr.first_pack() + k * per_chunk + m as u32) as usize),
                    )
                };
            });
            if first_row < rows {
                // SAFETY: row `first_row` < rows of the residual (contract);
                // its first pack index fits (`on`).
                rr.res = unsafe {
                    load_slots::<E>(
                        res_in,
                        first_row as u32 * rr.row_packs + rr.first_pack(),
                        chunks,
                    )
                };
            }
        }
        rr
    }

    /// Row `row` of `b` (its residual loaded by the call before, or by
    /// [`RegRows::prepare`]), then the loads of row `next` when it is below
    /// `b.rows`.
    ///
    /// # Safety
    /// As for [`norm_row`], with `self.on`; `sh` holds `2 *
    /// REG_HALF_WORDS` words.
    #[inline(always)]
    unsafe fn row<E: Element, S: RowSums>(
        &mut self,
        sums: &mut S,
        b: &BlockRows,
        row: u64,
        next: u64,
        sh: SharedWords,
    ) -> bool {
        let per_chunk = chunk_packs::<E>() as u32;
        let chunks = self.chunks;
        // Every pack index of the launch fits 32 bits (`on`). This CTA's
        // first pack of the row.
        let base = row as u32 * self.row_packs + self.first_pack();
        let mut q = [[[0u32; 4]; MAX_CHUNK_PACKS]; REG_SLOTS];
        let mut part = [0f32; REG_SLOTS];
        // A CTA of a cluster whose range is empty waits for nothing.
        if S::pairs(per_chunk as u64) && (!SPLIT || chunks > 0) {
            // Every sum first: no store between the loads (or the waits),
            // so they are all in flight together. A thread's two places:
            // (slot 0, pack 0) and, 16-bit, (slot 1, pack 0), f32, (slot 0,
            // pack 1).
            let (j1, m1) = if reg_slots::<E>() == 2 {
                (1, 0)
            } else {
                (0, 1)
            };
            let k0 = thread_idx_x();
            let k1 = k0 + j1 as u32 * block_dim_x();
            // A place this thread does not hold asks for this CTA's first
            // pack of the row (or its first place's) instead; its sums go
            // unused.
            let a = base + if k0 < chunks { k0 * per_chunk } else { 0 };
            let bp = if k1 < chunks {
                base + k1 * per_chunk + m1 as u32
            } else {
                a
            };
            // SAFETY: both packs lie inside the row (clamped above; caller
            // contract).
            (q[0][0], q[j1][m1]) = unsafe { sums.pack2::<E>(a as u64, bp as u64) };
            for_slot_packs!(E, chunks, |j, m, k| {
                (q[j][m], part[j]) = add_pack::<E>(q[j][m], self.res[j][m], part[j], m == 0);
                let pi = base + k * per_chunk + m as u32;
                // SAFETY: as above; `res_out` holds the row.
                unsafe { st_pack((b.res_out as *mut Pack).add(pi as usize), q[j][m]) };
            });
        } else {
            // A pack at a time (sources whose loads for two chunks would
            // not fit the registers): its store holds the next loads back.
            for_slot_packs!(E, chunks, |j, m, k| {
                let pi = base + k * per_chunk + m as u32;
                // SAFETY: the pack lies inside the row (caller contract).
                let s = unsafe { sums.pack::<E>(pi as u64) };
                (q[j][m], part[j]) = add_pack::<E>(s, self.res[j][m], part[j], m == 0);
                // SAFETY: as above; `res_out` holds the row.
                unsafe { st_pack((b.res_out as *mut Pack).add(pi as usize), q[j][m]) };
            });
        }
        // Gamma (an L1 hit after the prefetch) and the next row's residual:
        // in flight while the tree runs.
        // SAFETY: gamma holds `hidden` elements (contract).
        let gamma = unsafe { load_slots::<E>(self.gamma, self.first_pack(), chunks) };
        if next < b.rows {
            // SAFETY: row `next` of the residual (next < rows, contract).
            self.res = unsafe {
                load_slots::<E>(
                    b.res_in,
                    next as u32 * self.row_packs + self.first_pack(),
                    chunks,
                )
            };
        }
        // This row's half of `sh`: last read two rows ago, before the
        // previous row's barrier.
        let shh = sh.offset((self.half * REG_HALF_WORDS) as u32);
        // SAFETY: chunks <= REG_SLOTS * blockDim.x (`on`); the half is free
        // (above).
        unsafe { group_sums_regs(part, chunks, shh) };
        // This barrier orders the group sums before they are read, and is
        // the block's vote on failed waits where they can fail.
        let failed = if S::CAN_FAIL {
            sync_threads_or(sums.failed())
        } else {
            sync_threads();
            false
        };
        // Split: the CTAs' partials (the strides of the range size and up)
        // and their votes; else this block's.
        let (total, leave) = if SPLIT && self.cluster.active() {
            // SAFETY: active; every thread of the cluster's CTAs takes the
            // same rows (the cluster's), in order; the group sums are in
            // `shh`, before the barrier above.
            unsafe { self.cluster.combine(shh, chunks, failed, self.half) }
        } else {
            // Warp 0 adds the group sums and writes the total to word 0;
            // after a second barrier every thread reads it. (Every warp
            // adding them itself, with no second barrier, measured slower
            // for blocks of 14 warps: docs/benchmarks.md.) Word 0 is group
            // 0's, read only by warp 0 before it is written.
            if thread_idx_x() < WARP {
                // SAFETY: the group sums are in `shh`, before the barrier
                // above; warp 0, converged.
                let t = unsafe { groups_total(shh, chunks) };
                if thread_idx_x() == 0 {
                    // SAFETY: word 0 of this row's half.
                    unsafe { shh.store(0, t) };
                }
            }
            sync_threads();
            // SAFETY: word 0, final after the bar.sync; no thread writes
            // this half again before the next row's barriers.
            (unsafe { shh.load(0) }, failed)
        };
        self.half ^= 1;
        let inv = 1.0 / sqrt_rn(total / b.hidden as f32 + b.eps);
        for_slot_packs!(E, chunks, |j, m, k| {
            let pi = base + k * per_chunk + m as u32;
            // SAFETY: as above; `normed` holds the row.
            unsafe {
                st_pack_streaming(
                    (b.normed as *mut Pack).add(pi as usize),
                    normed_pack::<E>(q[j][m], gamma[j][m], inv),
                )
            };
        });
        leave
    }
}
