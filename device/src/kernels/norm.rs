//! Fused allreduce + residual add + RMSNorm (`allreduce_rmsnorm_*`): the
//! one-stage and two-stage pull algorithms, by whole rows, with the exact
//! operation order of docs/numerics.md.

use super::*;
use crate::abi::{NormArgs, NORM_CHUNK, NORM_MAX_HIDDEN};
use crate::norm_tree::{combine_quarters, warp_adds, QUARTERS, WARP};

/// The rounded sums of pack `pi` (whole chunks only): the reduction of
/// every rank's input in rank order, or (`FROM`) loaded from `from`, where
/// the owner of the row left them (two-stage). A constant, so each kernel
/// holds only the code (and registers) of its own case.
///
/// # Safety
/// Pack `pi` of every input (or of `from`) is readable.
#[inline(always)]
unsafe fn sums_at<E: Element, const N: usize, const FROM: bool>(
    inp: &[*const Pack; N],
    from: u64,
    pi: u64,
) -> Pack {
    // SAFETY: forwarded caller contract.
    unsafe {
        if FROM {
            ld_pack((from as *const Pack).add(pi as usize))
        } else {
            reduce_at::<E, N>(inp, pi)
        }
    }
}

/// Residual add of one pack: stores `residual_out` and returns its squares
/// added in lane order onto `acc` (`first`: the chunk's first pack).
///
/// # Safety
/// Pack `pi` of `res_out` is writable.
#[inline(always)]
unsafe fn add_pack<E: Element>(
    sum: Pack,
    res: Pack,
    res_out: u64,
    pi: u64,
    acc: f32,
    first: bool,
) -> f32 {
    let (sum, res) = (E::unpack(sum), E::unpack(res));
    let mut ro = [0f32; 8];
    let mut l = 0;
    while l < E::LANES {
        ro[l] = sum[l] + res[l];
        l += 1;
    }
    let rop = E::pack(&ro);
    // SAFETY: forwarded caller contract.
    unsafe { st_pack((res_out as *mut Pack).add(pi as usize), rop) };
    let q = E::unpack(rop);
    let mut acc = acc;
    let mut l = 0;
    while l < E::LANES {
        let sq = q[l] * q[l];
        acc = if first && l == 0 { sq } else { acc + sq };
        l += 1;
    }
    acc
}

/// Row `row` of the fused operation, by every thread of the block: the
/// rounded sums (reduced from `inputs`, or with `FROM` loaded from `from`), the
/// residual add, the sum of squares (chunk partials in shared memory `sh`,
/// then the pairwise tree), and the normed row into `res_out` and `normed`.
///
/// # Safety
/// Every pointer is valid for the row's elements (the inputs or `from`,
/// `res_in`, `res_out`, `normed`; `gamma` for `hidden`); `sh` is the
/// block's shared array of at least `ceil(hidden / 8)` words; `hidden <=
/// NORM_MAX_HIDDEN`; every thread of the block calls it (it contains
/// `bar.sync`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn norm_row<E: Element, const N: usize, const FROM: bool>(
    inputs: &[u64; MAX_RANKS],
    from: u64,
    res_in: u64,
    res_out: u64,
    gamma: u64,
    normed: u64,
    row: u64,
    hidden: u64,
    eps: f32,
    sh: *mut f32,
) {
    let tid = thread_idx_x() as u64;
    let nthreads = block_dim_x() as u64;
    const CH: u64 = NORM_CHUNK as u64;
    let chunks = hidden.div_ceil(CH);
    let base = row * hidden;
    // Whole 16-byte packs when every chunk is whole: rows then start at
    // multiples of 8 elements, so packs stay aligned.
    let packed = hidden % CH == 0;
    let lanes = E::LANES as u64;
    let per_chunk = CH / lanes;
    let mut inp = [core::ptr::null::<Pack>(); N];
    let mut r = 0;
    while r < N {
        inp[r] = inputs[r] as *const Pack;
        r += 1;
    }
    let res_p = res_in as *const Pack;
    // Pass 1: sums, residual add, squares of each chunk in column order.
    let mut k = tid;
    // Two chunks per iteration where the registers allow (one pack per
    // chunk, or few ranks): both chunks' loads are in flight before the
    // first add, one remote round trip instead of two.
    if packed && (per_chunk == 1 || N <= 4) {
        while k + nthreads < chunks {
            let (ka, kb) = (k, k + nthreads);
            let mut acc_a = 0f32;
            let mut acc_b = 0f32;
            let mut m = 0;
            while m < per_chunk {
                let pa = (base + ka * CH) / lanes + m;
                let pb = (base + kb * CH) / lanes + m;
                // SAFETY: packs pa, pb lie inside the row of every buffer.
                unsafe {
                    let (sa, sb) = (
                        sums_at::<E, N, FROM>(&inp, from, pa),
                        sums_at::<E, N, FROM>(&inp, from, pb),
                    );
                    let (ra, rb) = (
                        ld_pack(res_p.add(pa as usize)),
                        ld_pack(res_p.add(pb as usize)),
                    );
                    acc_a = add_pack::<E>(sa, ra, res_out, pa, acc_a, m == 0);
                    acc_b = add_pack::<E>(sb, rb, res_out, pb, acc_b, m == 0);
                }
                m += 1;
            }
            // SAFETY: ka < kb < chunks <= NORM_MAX_CHUNKS words of `sh`.
            unsafe {
                write_volatile(sh.add(ka as usize), acc_a);
                write_volatile(sh.add(kb as usize), acc_b);
            }
            k += 2 * nthreads;
        }
    }
    while k < chunks {
        let c0 = k * CH;
        let mut acc = 0f32;
        if packed {
            let mut m = 0;
            while m < per_chunk {
                let pi = (base + c0) / lanes + m;
                // SAFETY: pack pi lies inside the row of every buffer.
                unsafe {
                    let s = sums_at::<E, N, FROM>(&inp, from, pi);
                    let r = ld_pack(res_p.add(pi as usize));
                    acc = add_pack::<E>(s, r, res_out, pi, acc, m == 0);
                }
                m += 1;
            }
        } else {
            let c1 = if c0 + CH < hidden { c0 + CH } else { hidden };
            let mut c = c0;
            while c < c1 {
                let idx = base + c;
                // SAFETY: idx is inside the row of every buffer (contract).
                let q = unsafe {
                    let sum = if FROM {
                        E::to_f32(ld_elem::<E>(from, idx))
                    } else {
                        let mut s = E::to_f32(ld_elem::<E>(inputs[0], idx));
                        let mut r = 1;
                        while r < N {
                            s += E::to_f32(ld_elem::<E>(inputs[r], idx));
                            r += 1;
                        }
                        E::to_f32(E::from_f32(s))
                    };
                    let ro = E::from_f32(sum + E::to_f32(ld_elem::<E>(res_in, idx)));
                    st_elem::<E>(res_out, idx, ro);
                    E::to_f32(ro)
                };
                let sq = q * q;
                acc = if c == c0 { sq } else { acc + sq };
                c += 1;
            }
        }
        // SAFETY: k < chunks <= NORM_MAX_CHUNKS words of `sh`.
        unsafe { write_volatile(sh.add(k as usize), acc) };
        k += nthreads;
    }
    sync_threads();
    // SAFETY: `sh` holds the `chunks` partials; every thread of the block.
    let total = unsafe { tree_sum(sh, chunks) };
    let inv = 1.0 / sqrt_rn(total / hidden as f32 + eps);
    // Pass 2: the normed row, from the residual out this thread wrote.
    let mut k = tid;
    while k < chunks {
        let c0 = k * CH;
        if packed {
            let mut m = 0;
            while m < per_chunk {
                let pi = (base + c0) / lanes + m;
                // SAFETY: as in pass 1; gamma pack c0 / lanes + m < hidden /
                // lanes.
                unsafe {
                    let q = E::unpack(ld_pack((res_out as *const Pack).add(pi as usize)));
                    let g = E::unpack(ld_pack(
                        (gamma as *const Pack).add((c0 / lanes + m) as usize),
                    ));
                    let mut n = [0f32; 8];
                    let mut l = 0;
                    while l < E::LANES {
                        n[l] = (q[l] * inv) * g[l];
                        l += 1;
                    }
                    st_pack_streaming((normed as *mut Pack).add(pi as usize), E::pack(&n));
                }
                m += 1;
            }
        } else {
            let mut c = c0;
            while c < c0 + CH && c < hidden {
                let idx = base + c;
                // SAFETY: as in pass 1; gamma holds `hidden` elements.
                unsafe {
                    let q = E::to_f32(ld_elem::<E>(res_out, idx));
                    let g = E::to_f32(ld_elem::<E>(gamma, c));
                    st_elem::<E>(normed, idx, E::from_f32((q * inv) * g));
                }
                c += 1;
            }
        }
        k += nthreads;
    }
    // The next row reuses `sh`.
    sync_threads();
}

/// Strides 1..16 of the pairwise tree inside one warp: lane `lane` holds
/// item `k` (of `n`; lane 0 holds a multiple of 32); at stride s, a lane
/// that is a multiple of 2s adds the lane s above it when item k + s
/// exists. Lane 0 returns the sum of its 32 items in the tree's order.
/// Every lane of the warp must call it together.
#[inline(always)]
fn warp_tree(v: f32, lane: u64, k: u64, n: u64) -> f32 {
    let mut v = v;
    let mut s = 1u64;
    while s < 32 {
        let other = shfl_down(v, s as u32);
        if warp_adds(lane, k, n, s) {
            v += other;
        }
        s *= 2;
    }
    v
}

/// The pairwise tree over the `chunks` partials in `sh`, as docs/numerics.md
/// defines it: at stride s = 1, 2, 4, ..., partial k (a multiple of 2s)
/// adds partial k + s when k + s < chunks; the result is partial 0's. The
/// order is a function of `chunks` only; the work is spread as follows.
/// Chunk k sits in lane k mod 32 of warp (k / 32) mod W (W warps), so the
/// strides 1..16 stay inside a group of 32 chunks in one warp: warp
/// shuffles, no barrier. Each group's sum goes into its first chunk's
/// word; warp 0 then runs the strides 32, 64, ... over the (at most 128)
/// groups: shuffles for 1..16 groups apart, then three adds in lane 0.
///
/// # Safety
/// `sh` holds `chunks <= NORM_MAX_CHUNKS` partials written before a
/// `bar.sync`; every thread of the block calls it (it contains
/// `bar.sync`); `blockDim.x` is a multiple of 32.
#[inline(always)]
unsafe fn tree_sum(sh: *mut f32, chunks: u64) -> f32 {
    let tid = thread_idx_x() as u64;
    let nthreads = block_dim_x() as u64;
    let lane = tid % WARP;
    // Strides 1..16: within each warp's group of 32 chunks, slot by slot.
    let slots = chunks.div_ceil(nthreads);
    let mut slot = 0;
    while slot < slots {
        let k = slot * nthreads + tid;
        // SAFETY: k < chunks is inside `sh`; others read nothing.
        let v = if k < chunks {
            unsafe { read_volatile(sh.add(k as usize)) }
        } else {
            0.0
        };
        let v = warp_tree(v, lane, k, chunks);
        if lane == 0 && k < chunks {
            // SAFETY: the group's first word, read above by this lane only.
            unsafe { write_volatile(sh.add(k as usize), v) };
        }
        slot += 1;
    }
    sync_threads();
    // Strides of 32 chunks and more: groups g = 32 j + lane (j = 0..4) in
    // warp 0, whose sums sit at word 32 g.
    let groups = chunks.div_ceil(WARP);
    if tid < 32 {
        let mut a = [0f32; QUARTERS];
        let mut j = 0;
        while j < QUARTERS {
            let g = WARP * j as u64 + lane;
            // SAFETY: g < groups: word 32 g < chunks is inside `sh`.
            let v = if g < groups {
                unsafe { read_volatile(sh.add((WARP * g) as usize)) }
            } else {
                0.0
            };
            a[j] = warp_tree(v, lane, g, groups);
            j += 1;
        }
        if lane == 0 {
            // Strides of 32 and 64 groups (1024 and 2048 chunks).
            let total = combine_quarters(a, groups);
            // SAFETY: word 0 of `sh`.
            unsafe { write_volatile(sh, total) };
        }
    }
    sync_threads();
    // SAFETY: word 0, final after the bar.sync.
    unsafe { read_volatile(sh) }
}

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
    let bad = nblocks as usize > MAX_BLOCKS
        || (nthreads as usize) < N
        || hidden as usize > NORM_MAX_HIDDEN
        || rows.checked_mul(hidden) != Some(a.count);
    // SAFETY: `a.table` points to a RankTable the host filled (contract).
    let t = unsafe { &*(a.table as *const RankTable) };
    let mut missing = false;
    let mut r = 0;
    while r < N {
        missing |= t.inputs[r] == 0;
        r += 1;
    }
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
            unsafe { record_error(own_sig, a.host_error, code, rank, block, 0, 0, 0) };
        }
        return;
    }
    let algo = if TWO_STAGE {
        Algorithm::TwoStage
    } else {
        Algorithm::OneStage
    };
    let epoch_ptr = (own_sig as usize + Signal::EPOCH_OFFSET + 4 * block as usize) as *mut u32;
    // SAFETY: `epoch[block]` of this rank's own signal; block < MAX_BLOCKS.
    let epoch = next_epoch(unsafe { read_volatile(epoch_ptr) });
    // SAFETY: (every barrier below) the group's signals, rank < N, block <
    // MAX_BLOCKS, blockDim.x >= N (checked), uniform control flow.
    if !unsafe { block_barrier::<N>(a, algo, own_sig, rank, block, BarrierKind::Start, epoch) } {
        return;
    }
    // SAFETY: own signal; every thread of the block, after the barrier.
    unsafe { commit_epoch(own_sig, block, nblocks, tid, nthreads, epoch) };

    let res_in = pick::<N>(&p.residual, rank);
    let res_out = pick::<N>(&p.residual_out, rank);
    let gamma = pick::<N>(&p.gamma, rank);
    let normed = pick::<N>(&a.outputs, rank);
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
    let mut row = block as u64;
    while row < rows {
        let from = if TWO_STAGE {
            // The owner of `row`: partitions are contiguous and ordered.
            let mut owner = 0usize;
            let mut q = 1;
            while q < N {
                if row >= partition(rows, N as u32, q as u32).0 {
                    owner = q;
                }
                q += 1;
            }
            t.scratch[owner]
        } else {
            0
        };
        // SAFETY: row < rows: inside every buffer (contract); `sh` is this
        // block's shared array; hidden <= NORM_MAX_HIDDEN (checked).
        unsafe {
            norm_row::<E, N, TWO_STAGE>(
                &t.inputs, from, res_in, res_out, gamma, normed, row, hidden, p.eps, sh,
            )
        };
        row += nblocks as u64;
    }
    if !TWO_STAGE {
        // No rank returns (and lets its input be overwritten) while a peer
        // still reads it.
        // SAFETY: as for Start.
        unsafe { block_barrier::<N>(a, algo, own_sig, rank, block, BarrierKind::End, epoch) };
    }
}

macro_rules! norm_entries {
    ($( $name:ident, $vname:ident: $E:ty, $N:literal, $two:literal; )*) => { $(
        /// A real-rank fused entry: this rank is `p.base.rank`.
        ///
        /// # Safety
        /// Launched by the host under the launch contract of the module
        /// documentation, with `p` filled as `allreduce_rmsnorm` requires.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: NormArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_rmsnorm::<$E, $N, $two>(&p, p.base.rank) }
        }
        /// A virtual-rank fused entry: this rank is `blockIdx.y`.
        ///
        /// # Safety
        /// As for the real-rank entry, with `gridDim.y == N` and every
        /// block co-resident.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(p: NormArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_rmsnorm::<$E, $N, $two>(&p, block_idx_y()) }
        }
    )* };
}

norm_entries! {
    allreduce_rmsnorm_one_stage_f32_w1, allreduce_rmsnorm_one_stage_f32_w1_virtual: F32, 1, false;
    allreduce_rmsnorm_one_stage_f32_w2, allreduce_rmsnorm_one_stage_f32_w2_virtual: F32, 2, false;
    allreduce_rmsnorm_one_stage_f32_w3, allreduce_rmsnorm_one_stage_f32_w3_virtual: F32, 3, false;
    allreduce_rmsnorm_one_stage_f32_w4, allreduce_rmsnorm_one_stage_f32_w4_virtual: F32, 4, false;
    allreduce_rmsnorm_one_stage_f32_w5, allreduce_rmsnorm_one_stage_f32_w5_virtual: F32, 5, false;
    allreduce_rmsnorm_one_stage_f32_w6, allreduce_rmsnorm_one_stage_f32_w6_virtual: F32, 6, false;
    allreduce_rmsnorm_one_stage_f32_w7, allreduce_rmsnorm_one_stage_f32_w7_virtual: F32, 7, false;
    allreduce_rmsnorm_one_stage_f32_w8, allreduce_rmsnorm_one_stage_f32_w8_virtual: F32, 8, false;
    allreduce_rmsnorm_one_stage_f16_w1, allreduce_rmsnorm_one_stage_f16_w1_virtual: F16, 1, false;
    allreduce_rmsnorm_one_stage_f16_w2, allreduce_rmsnorm_one_stage_f16_w2_virtual: F16, 2, false;
    allreduce_rmsnorm_one_stage_f16_w3, allreduce_rmsnorm_one_stage_f16_w3_virtual: F16, 3, false;
    allreduce_rmsnorm_one_stage_f16_w4, allreduce_rmsnorm_one_stage_f16_w4_virtual: F16, 4, false;
    allreduce_rmsnorm_one_stage_f16_w5, allreduce_rmsnorm_one_stage_f16_w5_virtual: F16, 5, false;
    allreduce_rmsnorm_one_stage_f16_w6, allreduce_rmsnorm_one_stage_f16_w6_virtual: F16, 6, false;
    allreduce_rmsnorm_one_stage_f16_w7, allreduce_rmsnorm_one_stage_f16_w7_virtual: F16, 7, false;
    allreduce_rmsnorm_one_stage_f16_w8, allreduce_rmsnorm_one_stage_f16_w8_virtual: F16, 8, false;
    allreduce_rmsnorm_one_stage_bf16_w1, allreduce_rmsnorm_one_stage_bf16_w1_virtual: Bf16, 1, false;
    allreduce_rmsnorm_one_stage_bf16_w2, allreduce_rmsnorm_one_stage_bf16_w2_virtual: Bf16, 2, false;
    allreduce_rmsnorm_one_stage_bf16_w3, allreduce_rmsnorm_one_stage_bf16_w3_virtual: Bf16, 3, false;
    allreduce_rmsnorm_one_stage_bf16_w4, allreduce_rmsnorm_one_stage_bf16_w4_virtual: Bf16, 4, false;
    allreduce_rmsnorm_one_stage_bf16_w5, allreduce_rmsnorm_one_stage_bf16_w5_virtual: Bf16, 5, false;
    allreduce_rmsnorm_one_stage_bf16_w6, allreduce_rmsnorm_one_stage_bf16_w6_virtual: Bf16, 6, false;
    allreduce_rmsnorm_one_stage_bf16_w7, allreduce_rmsnorm_one_stage_bf16_w7_virtual: Bf16, 7, false;
    allreduce_rmsnorm_one_stage_bf16_w8, allreduce_rmsnorm_one_stage_bf16_w8_virtual: Bf16, 8, false;
    allreduce_rmsnorm_two_stage_f32_w1, allreduce_rmsnorm_two_stage_f32_w1_virtual: F32, 1, true;
    allreduce_rmsnorm_two_stage_f32_w2, allreduce_rmsnorm_two_stage_f32_w2_virtual: F32, 2, true;
    allreduce_rmsnorm_two_stage_f32_w3, allreduce_rmsnorm_two_stage_f32_w3_virtual: F32, 3, true;
    allreduce_rmsnorm_two_stage_f32_w4, allreduce_rmsnorm_two_stage_f32_w4_virtual: F32, 4, true;
    allreduce_rmsnorm_two_stage_f32_w5, allreduce_rmsnorm_two_stage_f32_w5_virtual: F32, 5, true;
    allreduce_rmsnorm_two_stage_f32_w6, allreduce_rmsnorm_two_stage_f32_w6_virtual: F32, 6, true;
    allreduce_rmsnorm_two_stage_f32_w7, allreduce_rmsnorm_two_stage_f32_w7_virtual: F32, 7, true;
    allreduce_rmsnorm_two_stage_f32_w8, allreduce_rmsnorm_two_stage_f32_w8_virtual: F32, 8, true;
    allreduce_rmsnorm_two_stage_f16_w1, allreduce_rmsnorm_two_stage_f16_w1_virtual: F16, 1, true;
    allreduce_rmsnorm_two_stage_f16_w2, allreduce_rmsnorm_two_stage_f16_w2_virtual: F16, 2, true;
    allreduce_rmsnorm_two_stage_f16_w3, allreduce_rmsnorm_two_stage_f16_w3_virtual: F16, 3, true;
    allreduce_rmsnorm_two_stage_f16_w4, allreduce_rmsnorm_two_stage_f16_w4_virtual: F16, 4, true;
    allreduce_rmsnorm_two_stage_f16_w5, allreduce_rmsnorm_two_stage_f16_w5_virtual: F16, 5, true;
    allreduce_rmsnorm_two_stage_f16_w6, allreduce_rmsnorm_two_stage_f16_w6_virtual: F16, 6, true;
    allreduce_rmsnorm_two_stage_f16_w7, allreduce_rmsnorm_two_stage_f16_w7_virtual: F16, 7, true;
    allreduce_rmsnorm_two_stage_f16_w8, allreduce_rmsnorm_two_stage_f16_w8_virtual: F16, 8, true;
    allreduce_rmsnorm_two_stage_bf16_w1, allreduce_rmsnorm_two_stage_bf16_w1_virtual: Bf16, 1, true;
    allreduce_rmsnorm_two_stage_bf16_w2, allreduce_rmsnorm_two_stage_bf16_w2_virtual: Bf16, 2, true;
    allreduce_rmsnorm_two_stage_bf16_w3, allreduce_rmsnorm_two_stage_bf16_w3_virtual: Bf16, 3, true;
    allreduce_rmsnorm_two_stage_bf16_w4, allreduce_rmsnorm_two_stage_bf16_w4_virtual: Bf16, 4, true;
    allreduce_rmsnorm_two_stage_bf16_w5, allreduce_rmsnorm_two_stage_bf16_w5_virtual: Bf16, 5, true;
    allreduce_rmsnorm_two_stage_bf16_w6, allreduce_rmsnorm_two_stage_bf16_w6_virtual: Bf16, 6, true;
    allreduce_rmsnorm_two_stage_bf16_w7, allreduce_rmsnorm_two_stage_bf16_w7_virtual: Bf16, 7, true;
    allreduce_rmsnorm_two_stage_bf16_w8, allreduce_rmsnorm_two_stage_bf16_w8_virtual: Bf16, 8, true;
}
