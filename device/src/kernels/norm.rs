//! Fused allreduce + residual add + RMSNorm (`allreduce_rmsnorm_*`): the
//! one-stage and two-stage pull algorithms and push_ll (flag-in-data
//! lines, no barrier), by whole rows, with the exact operation order of
//! docs/numerics.md.

use super::*;
use crate::abi::{NormArgs, NORM_CHUNK, NORM_MAX_HIDDEN};
use crate::ll::{Lines, PackSlot};
use crate::norm_tree::{combine_quarters, warp_adds, QUARTERS, WARP};

/// Where a fused row's rounded sums come from: reduced from every rank's
/// input ([`Pull`], one-stage), loaded where the row's owner left them
/// ([`Scratch`], two-stage), or reduced from flag-in-data lines in this
/// rank's LL zone ([`LlSums`], push_ll). A type per case, so each kernel
/// holds only the code (and registers) of its own.
trait RowSums {
    /// Whether a wait can fail ([`RowSums::failed`]): the block then votes
    /// after every row.
    const CAN_FAIL: bool = false;
    /// Whether pass 1 takes two chunks per iteration, for chunks of
    /// `per_chunk` packs: more loads in flight, more registers.
    fn pairs(per_chunk: u64) -> bool;
    /// Called before row `row`: a source that depends on the row picks it.
    fn for_row(&mut self, _row: u64) {}
    /// Whether a wait of this thread failed (recorded); the block leaves
    /// after the row when any thread's did.
    fn failed(&self) -> bool {
        false
    }
    /// The rounded sums of pack `pi` of the message.
    ///
    /// # Safety
    /// Pack `pi` lies inside the message (whole rows of whole chunks).
    unsafe fn pack<E: Element>(&mut self, pi: u64) -> Pack;
    /// The rounded sum of element `idx` of the message, widened to f32.
    ///
    /// # Safety
    /// `idx` lies inside the message.
    unsafe fn elem<E: Element>(&mut self, idx: u64) -> f32;
    /// The rounded sums of packs `a` and `b`: a thread's two places of a
    /// row on the register path, asked for together so that a source can
    /// have both in flight at once. A place the thread does not hold is
    /// asked for as a present pack (the caller clamps it) and its result
    /// ignored: no branch and no zeroed registers for absent places.
    ///
    /// # Safety
    /// As for [`RowSums::pack`], for each pack.
    #[inline(always)]
    unsafe fn pack2<E: Element>(&mut self, a: u64, b: u64) -> (Pack, Pack) {
        // SAFETY: forwarded caller contract.
        unsafe { (self.pack::<E>(a), self.pack::<E>(b)) }
    }
}

/// One-stage: every rank's input, reduced in rank order.
/// `inputs` stays where it is (the pointer table in global memory) for
/// the element path: a copy in registers cost 24 more of them (f32, 8
/// ranks, sm_80: 147).
struct Pull<'a, const N: usize> {
    inp: [*const Pack; N],
    inputs: &'a [u64; MAX_RANKS],
}

impl<'a, const N: usize> Pull<'a, N> {
    fn new(inputs: &'a [u64; MAX_RANKS]) -> Self {
        Pull {
            inp: [core::ptr::null::<Pack>(); N],
            inputs,
        }
    }
}

impl<const N: usize> RowSums for Pull<'_, N> {
    #[inline(always)]
    fn pairs(_: u64) -> bool {
        // 2 x 2 packs of N ranks fit 128 registers up to 4 ranks (2 x 1
        // packs of 7 and 8 ranks took up to 152 on sm_90).
        N <= 4
    }
    #[inline(always)]
    fn for_row(&mut self, _row: u64) {
        // The pointers into registers once per row (not once per launch:
        // held through the tree and the second pass they cost registers
        // the loads need, f32 w5 on sm_80: 137).
        let mut r = 0;
        while r < N {
            self.inp[r] = self.inputs[r] as *const Pack;
            r += 1;
        }
    }
    #[inline(always)]
    unsafe fn pack<E: Element>(&mut self, pi: u64) -> Pack {
        // SAFETY: pack `pi` of every input is readable (caller contract).
        unsafe { reduce_at::<E, N>(&self.inp, pi) }
    }
    #[inline(always)]
    unsafe fn elem<E: Element>(&mut self, idx: u64) -> f32 {
        // SAFETY: element idx of every input is readable (caller contract).
        unsafe {
            let mut s = E::to_f32(ld_elem::<E>(self.inputs[0], idx));
            let mut r = 1;
            while r < N {
                s += E::to_f32(ld_elem::<E>(self.inputs[r], idx));
                r += 1;
            }
            E::to_f32(E::from_f32(s))
        }
    }
}

/// Two-stage: the rounded sums the row's owner stored in its scratch
/// (`cur`, picked by [`RowSums::for_row`]).
struct Scratch<'a, const N: usize> {
    scratch: &'a [u64; MAX_RANKS],
    rows: u64,
    cur: u64,
}

impl<'a, const N: usize> Scratch<'a, N> {
    fn new(scratch: &'a [u64; MAX_RANKS], rows: u64) -> Self {
        Scratch {
            scratch,
            rows,
            cur: 0,
        }
    }
}

impl<const N: usize> RowSums for Scratch<'_, N> {
    #[inline(always)]
    fn pairs(_: u64) -> bool {
        true
    }
    #[inline(always)]
    fn for_row(&mut self, row: u64) {
        // The owner of `row`: partitions are contiguous and ordered.
        let mut owner = 0usize;
        let mut q = 1;
        while q < N {
            if row >= partition(self.rows, N as u32, q as u32).0 {
                owner = q;
            }
            q += 1;
        }
        self.cur = self.scratch[owner];
    }
    #[inline(always)]
    unsafe fn pack<E: Element>(&mut self, pi: u64) -> Pack {
        // SAFETY: pack `pi` of the owner's scratch (caller contract).
        unsafe { ld_pack((self.cur as *const Pack).add(pi as usize)) }
    }
    #[inline(always)]
    unsafe fn elem<E: Element>(&mut self, idx: u64) -> f32 {
        // SAFETY: element `idx` of the owner's scratch (caller contract).
        E::to_f32(unsafe { ld_elem::<E>(self.cur, idx) })
    }
}

/// push_ll: this rank's own input, and each peer's packs waited for in this
/// rank's LL zone (the slot of `epoch`), in rank order. A wait that times
/// out records the error, counts as zeros and sets `failed`; the caller
/// leaves once the block agrees (`bar.sync` with a predicate).
struct LlSums<const N: usize> {
    own_in: u64,
    /// This rank's LL zone.
    zone: u64,
    landing_part: u64,
    epoch: u32,
    rank: u32,
    /// `count` of the launch: the last pack is zero-padded past it.
    count: u64,
    timeout_ns: u64,
    own_sig: u64,
    host_error: u64,
    block: u32,
    failed: bool,
}

/// Runs `$body` for `$r` = 0, 1, ... below `$n` (at most
/// [`MAX_RANKS`]) as literals: arrays indexed by `$r` stay in registers
/// even where the body is too large for the compiler to unroll a loop
/// (the LL waits), which would index them at run time, in local memory.
macro_rules! for_ranks {
    ($n:expr, |$r:ident| $body:block) => {{
        for_ranks!(@one $n, $r, $body, 0);
        for_ranks!(@one $n, $r, $body, 1);
        for_ranks!(@one $n, $r, $body, 2);
        for_ranks!(@one $n, $r, $body, 3);
        for_ranks!(@one $n, $r, $body, 4);
        for_ranks!(@one $n, $r, $body, 5);
        for_ranks!(@one $n, $r, $body, 6);
        for_ranks!(@one $n, $r, $body, 7);
    }};
    (@one $n:expr, $r:ident, $body:block, $v:literal) => {{
        let $r: usize = $v;
        if $r < $n {
            $body
        }
    }};
}

const _: () = assert!(MAX_RANKS == 8, "for_ranks! spells out ranks 0..8");

/// Ranks up to which [`LlSums::pack2`] has every source's lines of both
/// packs in flight together (`2 * (N - 1)` lines of 32 bytes in registers;
/// more ranks wait pack by pack, as [`LlSums::pack`]: 3 ranks took up to
/// 146 registers on sm_90, over the 128 of a 512-thread block).
const LL_PAIRS_MAX_RANKS: usize = 2;

impl<const N: usize> LlSums<N> {
    /// Where source `r`'s lines of pack `pi` land in this rank's zone.
    #[inline(always)]
    fn slot(&self, r: usize, pi: u64) -> super::push_ll::GpuSlot {
        let part = crate::ll::slot(self.epoch, N as u64, r as u64, self.landing_part);
        super::push_ll::GpuSlot(self.zone + part + pi * crate::ll::LL_PACK_BYTES as u64)
    }

    /// Source `r`'s (a peer's) pack `pi`: from `look`, a first load of its
    /// lines, when that carries this collective's epoch, else waited for.
    /// A wait that times out records the error, counts as zeros and sets
    /// `failed`.
    #[inline(always)]
    fn finish(&mut self, r: usize, pi: u64, look: Lines) -> Pack {
        if let Some(p) = crate::ll::decode(&look, self.epoch) {
            return p;
        }
        let slot = self.slot(r, pi);
        match crate::ll::wait_pack(&slot, self.epoch, self.timeout_ns, &mut GlobalTimer) {
            Some(p) => p,
            None => {
                if !self.failed {
                    // The data is the arrival: reported as the Start
                    // barrier's, as push_ll does.
                    // SAFETY: `own_sig` is this rank's own signal.
                    unsafe {
                        record_error(
                            self.own_sig,
                            self.host_error,
                            error_code::PEER_TIMEOUT,
                            self.rank,
                            self.block,
                            r as u32,
                            self.epoch,
                            BarrierKind::Start as u32,
                        )
                    };
                }
                self.failed = true;
                [0; 4]
            }
        }
    }

    /// Pack `pi` of source `r`; `WHOLE`: the pack lies wholly inside the
    /// message.
    ///
    /// # Safety
    /// `pi < ceil(count / lanes)` (WHOLE: `(pi + 1) * lanes <= count`); the
    /// zone is this rank's (contract).
    #[inline(always)]
    unsafe fn source<E: Element, const WHOLE: bool>(&mut self, r: usize, pi: u64) -> Pack {
        if r as u32 == self.rank {
            // SAFETY: pack `pi` of this rank's input (caller contract; with
            // WHOLE, the pack lies inside the message).
            return unsafe { super::push_ll::ld_own::<E, WHOLE>(self.own_in, pi, self.count) };
        }
        let look = self.slot(r, pi).load();
        self.finish(r, pi, look)
    }
}

impl<const N: usize> RowSums for LlSums<N> {
    const CAN_FAIL: bool = true;
    #[inline(always)]
    fn failed(&self) -> bool {
        self.failed
    }
    #[inline(always)]
    fn pairs(per_chunk: u64) -> bool {
        // `pack2` looks at both packs of every source at once up to
        // LL_PAIRS_MAX_RANKS ranks, for 16-bit types (f32, two packs per
        // chunk, took 134 registers on sm_80 with 2 ranks); the others
        // wait pack by pack.
        N <= LL_PAIRS_MAX_RANKS && per_chunk == 1
    }
    #[inline(always)]
    unsafe fn pack<E: Element>(&mut self, pi: u64) -> Pack {
        // Rank order, seeded with rank 0's values, each source added as it
        // arrives (no array of N packs).
        let mut acc = [0f32; 8];
        let mut r = 0;
        while r < N {
            // SAFETY: forwarded caller contract: `pack` is only called for
            // whole packs (rows of whole chunks).
            let x = E::unpack(unsafe { self.source::<E, true>(r, pi) });
            let mut l = 0;
            while l < 8 {
                acc[l] = if r == 0 { x[l] } else { acc[l] + x[l] };
                l += 1;
            }
            r += 1;
        }
        E::pack(&acc)
    }
    #[inline(always)]
    unsafe fn pack2<E: Element>(&mut self, a: u64, b: u64) -> (Pack, Pack) {
        if N > LL_PAIRS_MAX_RANKS {
            // SAFETY: forwarded caller contract.
            return unsafe { (self.pack::<E>(a), self.pack::<E>(b)) };
        }
        // First looks: this rank's two packs and every peer's lines of
        // both, all loads in flight before any is waited for; then the
        // waits (their order changes no value), then the sums in rank
        // order, seeded with rank 0's values. Peer `q` is rank `q` below
        // this rank and `q + 1` from it on: no branch on the rank, and
        // arrays indexed by literals only (registers).
        let peer_rank = |q: usize, rank: u32| q + (q as u32 >= rank) as usize;
        // Every address before any load: the loads then go out together.
        let mut at = [[0u64; 2]; MAX_RANKS];
        for_ranks!(N - 1, |q| {
            let r = peer_rank(q, self.rank);
            at[q] = [self.slot(r, a).0, self.slot(r, b).0];
        });
        let own_at = [
            self.own_in + a * size_of::<Pack>() as u64,
            self.own_in + b * size_of::<Pack>() as u64,
        ];
        let mut look = [[[[0u64; 2]; 2]; 2]; MAX_RANKS];
        let mut own = [[0u32; 4]; 2];
        // A branch that is always taken (an input is never at address 0):
        // the block boundary keeps ptxas from moving the first pack's
        // flag tests (and a stall on them) ahead of the other loads.
        if own_at[0] != 0 {
            for_ranks!(N - 1, |q| {
                look[q] = [
                    super::push_ll::GpuSlot(at[q][0]).load(),
                    super::push_ll::GpuSlot(at[q][1]).load(),
                ];
            });
            // SAFETY: packs `a`, `b` of this rank's input, whole (the
            // caller contract: rows of whole chunks).
            own = unsafe {
                [
                    ld_pack(own_at[0] as *const Pack),
                    ld_pack(own_at[1] as *const Pack),
                ]
            };
        }
        let mut peer = [[[0u32; 4]; 2]; MAX_RANKS];
        for_ranks!(N - 1, |q| {
            let r = peer_rank(q, self.rank);
            peer[q] = [self.finish(r, a, look[q][0]), self.finish(r, b, look[q][1])];
        });
        let mut acc = [[0f32; 8]; 2];
        for_ranks!(N, |r| {
            let mut x = own;
            for_ranks!(N - 1, |q| {
                if peer_rank(q, self.rank) == r {
                    x = peer[q];
                }
            });
            let (xa, xb) = (E::unpack(x[0]), E::unpack(x[1]));
            let mut l = 0;
            while l < 8 {
                acc[0][l] = if r == 0 { xa[l] } else { acc[0][l] + xa[l] };
                acc[1][l] = if r == 0 { xb[l] } else { acc[1][l] + xb[l] };
                l += 1;
            }
        });
        (E::pack(&acc[0]), E::pack(&acc[1]))
    }
    #[inline(always)]
    unsafe fn elem<E: Element>(&mut self, idx: u64) -> f32 {
        let lanes = E::LANES as u64;
        let (pi, k) = (idx / lanes, idx % lanes);
        let mut s = 0f32;
        let mut r = 0;
        while r < N {
            // SAFETY: forwarded caller contract (pi < ceil(count / lanes)).
            let p = unsafe { self.source::<E, false>(r, pi) };
            // Words chosen by comparisons: a run-time index into the pack
            // would put it in local memory.
            let w = if E::LANES == 4 { k } else { k / 2 };
            let word = if w == 0 {
                p[0]
            } else if w == 1 {
                p[1]
            } else if w == 2 {
                p[2]
            } else {
                p[3]
            };
            let bits = if E::LANES == 4 {
                word
            } else {
                (word >> (16 * (k % 2))) & 0xffff
            };
            let x = E::to_f32(bits);
            s = if r == 0 { x } else { s + x };
            r += 1;
        }
        E::to_f32(E::from_f32(s))
    }
}

/// Residual add of one pack: returns the `residual_out` pack and its
/// squares added in lane order onto `acc` (`first`: the chunk's first
/// pack). The caller stores the pack.
#[inline(always)]
fn add_pack<E: Element>(sum: Pack, res: Pack, acc: f32, first: bool) -> (Pack, f32) {
    let (sum, res) = (E::unpack(sum), E::unpack(res));
    let mut ro = [0f32; 8];
    let mut l = 0;
    while l < E::LANES {
        ro[l] = sum[l] + res[l];
        l += 1;
    }
    let rop = E::pack(&ro);
    let q = E::unpack(rop);
    let mut acc = acc;
    let mut l = 0;
    while l < E::LANES {
        let sq = q[l] * q[l];
        acc = if first && l == 0 { sq } else { acc + sq };
        l += 1;
    }
    (rop, acc)
}

/// One pack of the normed row: `(residual_out * inv) * gamma`, lane by lane.
#[inline(always)]
fn normed_pack<E: Element>(q: Pack, g: Pack, inv: f32) -> Pack {
    let (q, g) = (E::unpack(q), E::unpack(g));
    let mut n = [0f32; 8];
    let mut l = 0;
    while l < E::LANES {
        n[l] = (q[l] * inv) * g[l];
        l += 1;
    }
    E::pack(&n)
}

/// Row `row` of the fused operation, by every thread of the block: the
/// rounded sums (from `sums`, [`RowSums`]), the residual add, the sum of squares (chunk partials in shared memory `sh`,
/// then the pairwise tree), and the normed row into `res_out` and `normed`.
///
/// # Safety
/// Every pointer is valid for the row's elements (the sums' sources,
/// `res_in`, `res_out`, `normed`; `gamma` for `hidden`); `sh` is the
/// block's shared array of at least `ceil(hidden / 8)` words; `hidden <=
/// NORM_MAX_HIDDEN`; every thread of the block calls it (it contains
/// `bar.sync`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn norm_row<E: Element, S: RowSums>(
    sums: &mut S,
    res_in: u64,
    res_out: u64,
    gamma: u64,
    normed: u64,
    row: u64,
    hidden: u64,
    eps: f32,
    sh: SharedWords,
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
    let res_p = res_in as *const Pack;
    // Pass 1: sums, residual add, squares of each chunk in column order.
    let mut k = tid;
    // Two chunks per iteration where the registers allow (one pack per
    // chunk, or few ranks): both chunks' loads are in flight before the
    // first add, one remote round trip instead of two.
    if packed && S::pairs(per_chunk) {
        while k + nthreads < chunks {
            let (ka, kb) = (k, k + nthreads);
            let mut acc_a = 0f32;
            let mut acc_b = 0f32;
            let mut m = 0;
            while m < per_chunk {
                let pa = (base + ka * CH) / lanes + m;
                let pb = (base + kb * CH) / lanes + m;
                // SAFETY: packs pa, pb lie inside the row of every buffer.
                // The residuals first: their loads are then in flight while
                // the sums arrive (push_ll: while the lines are waited for).
                unsafe {
                    let (ra, rb) = (
                        ld_pack(res_p.add(pa as usize)),
                        ld_pack(res_p.add(pb as usize)),
                    );
                    let (sa, sb) = (sums.pack::<E>(pa), sums.pack::<E>(pb));
                    let (qa, qb);
                    (qa, acc_a) = add_pack::<E>(sa, ra, acc_a, m == 0);
                    (qb, acc_b) = add_pack::<E>(sb, rb, acc_b, m == 0);
                    st_pack((res_out as *mut Pack).add(pa as usize), qa);
                    st_pack((res_out as *mut Pack).add(pb as usize), qb);
                }
                m += 1;
            }
            // SAFETY: ka < kb < chunks <= NORM_MAX_CHUNKS words of `sh`.
            unsafe {
                sh.store(ka as u32, acc_a);
                sh.store(kb as u32, acc_b);
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
                // The residual first, as above.
                unsafe {
                    let r = ld_pack(res_p.add(pi as usize));
                    let s = sums.pack::<E>(pi);
                    let q;
                    (q, acc) = add_pack::<E>(s, r, acc, m == 0);
                    st_pack((res_out as *mut Pack).add(pi as usize), q);
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
                    let sum = sums.elem::<E>(idx);
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
        unsafe { sh.store(k as u32, acc) };
        k += nthreads;
    }
    sync_threads();
    // SAFETY: `sh` holds the `chunks` partials; every thread of the block.
    let total = unsafe { tree_sum(sh, chunks as u32) };
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
                    let qp = ld_pack((res_out as *const Pack).add(pi as usize));
                    let gp = ld_pack((gamma as *const Pack).add((c0 / lanes + m) as usize));
                    st_pack_streaming(
                        (normed as *mut Pack).add(pi as usize),
                        normed_pack::<E>(qp, gp, inv),
                    );
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

/// Strides 1..16 of the pairwise tree inside one warp: lane `lane` holds
/// item `k` (of `n`; lane 0 holds a multiple of 32), or +0.0 where item k
/// does not exist (k >= n); at stride s, a lane that is a multiple of 2s
/// adds the lane s above it ([`warp_adds`]: an absent item adds +0.0, which
/// changes no partial). Lane 0 returns the sum of its 32 items in the
/// tree's order. Every lane of the warp must call it together.
#[inline(always)]
fn warp_tree(v: f32, lane: u32) -> f32 {
    let mut v = v;
    let mut s = 1u32;
    while s < 32 {
        let other = shfl_down(v, s);
        if warp_adds(lane, s) {
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
unsafe fn tree_sum(sh: SharedWords, chunks: u32) -> f32 {
    let tid = thread_idx_x();
    let nthreads = block_dim_x();
    let lane = tid % WARP;
    // Strides 1..16: within each warp's group of 32 chunks, slot by slot.
    let slots = chunks.div_ceil(nthreads);
    let mut slot = 0;
    while slot < slots {
        let k = slot * nthreads + tid;
        // SAFETY: k < chunks is inside `sh`; others read nothing.
        let v = if k < chunks {
            unsafe { sh.load(k) }
        } else {
            0.0
        };
        let v = warp_tree(v, lane);
        if lane == 0 && k < chunks {
            // SAFETY: the group's first word, read above by this lane only.
            unsafe { sh.store(k, v) };
        }
        slot += 1;
    }
    // SAFETY: each group's sum is at its first chunk's word (above);
    // every thread of the block.
    unsafe { groups_sum(sh, chunks) }
}

/// The strides 1..16 of [`tree_sum`] from partials held in registers:
/// chunk `tid + j * blockDim.x` in `part[j]` (the slot [`tree_sum`] gives
/// it), so they need no shared memory and no `bar.sync` before them. Each
/// group's sum goes to its first chunk's word of `sh`; the caller's
/// barrier then orders them before [`groups_total`].
///
/// # Safety
/// `chunks <= REG_SLOTS * blockDim.x`; `sh` holds at least `chunks` words
/// that no thread of the block reads until that barrier (the caller
/// alternates halves between rows); every lane of the warp calls it
/// together; `blockDim.x` is a multiple of 32.
#[inline(always)]
unsafe fn group_sums_regs(part: [f32; REG_SLOTS], chunks: u32, sh: SharedWords) {
    let tid = thread_idx_x();
    let nthreads = block_dim_x();
    let lane = tid % WARP;
    let mut j = 0;
    while j < REG_SLOTS {
        // Slot j exists where any chunk of it does (no 64-bit division).
        if (j as u32) * nthreads < chunks {
            let k = j as u32 * nthreads + tid;
            let v = warp_tree(if k < chunks { part[j] } else { 0.0 }, lane);
            if lane == 0 && k < chunks {
                // SAFETY: word k < chunks of `sh`, written by this lane only.
                unsafe { sh.store(k, v) };
            }
        }
        j += 1;
    }
}

/// The strides of 32 chunks and more, and the result to every thread (the
/// two-pass path): after a `bar.sync`, every warp adds the group sums
/// itself ([`groups_total`]: the same adds on the same words, so the same
/// bits in every thread), with no second barrier; the caller's row ends
/// in a barrier before `sh` is written again.
///
/// # Safety
/// The group sums of `chunks` partials are in `sh` (written before this
/// call, by this block); every thread of the block calls it; no thread
/// writes `sh` again before a later barrier.
#[inline(always)]
unsafe fn groups_sum(sh: SharedWords, chunks: u32) -> f32 {
    sync_threads();
    // SAFETY: the group sums are in `sh`, before the barrier above.
    unsafe { groups_total(sh, chunks) }
}

/// The strides of 32 chunks and more, in the calling warp: it reads the
/// group sums of `chunks` partials (group g's at word 32 g) in quarters,
/// adds each quarter by [`warp_tree`] and the quarters by
/// [`combine_quarters`], and gives lane 0's total to every lane.
///
/// # Safety
/// The group sums are in `sh`, stored by this block before a barrier this
/// thread has passed, and no thread stores into them before a later
/// barrier that this thread reaches after this call; every lane of the
/// warp calls it together.
#[inline(always)]
unsafe fn groups_total(sh: SharedWords, chunks: u32) -> f32 {
    let lane = thread_idx_x() % WARP;
    let groups = chunks.div_ceil(WARP);
    let mut a = [0f32; QUARTERS];
    let mut j = 0;
    // Only the quarters that hold groups (one for rows of up to 1024
    // chunks): `combine_quarters` adds no other.
    while j < QUARTERS && WARP * (j as u32) < groups {
        let g = WARP * j as u32 + lane;
        // SAFETY: g < groups: word 32 g < chunks is inside `sh`.
        let v = if g < groups {
            unsafe { sh.load(WARP * g) }
        } else {
            0.0
        };
        a[j] = warp_tree(v, lane);
        j += 1;
    }
    // Strides of 32 and 64 groups (1024 and 2048 chunks), lane 0's.
    shfl_lane0(combine_quarters(a, groups))
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
            unsafe { record_error(own_sig, a.host_error, code, rank, block, 0, 0, 0) };
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

macro_rules! ll_norm_entries {
    ($( $name:ident, $vname:ident: $E:ty, $N:literal; )*) => { $(
        /// A real-rank fused push_ll entry: this rank is `p.base.rank`.
        ///
        /// # Safety
        /// Launched by the host under the launch contract of the module
        /// documentation, with `p` filled as `allreduce_rmsnorm_ll`
        /// requires.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: NormArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_rmsnorm_ll::<$E, $N>(&p, p.base.rank) }
        }
        /// A virtual-rank fused push_ll entry: this rank is `blockIdx.y`.
        ///
        /// # Safety
        /// As for the real-rank entry, with `gridDim.y == N` and every
        /// block co-resident.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(p: NormArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_rmsnorm_ll::<$E, $N>(&p, block_idx_y()) }
        }
    )* };
}

ll_norm_entries! {
    allreduce_rmsnorm_push_ll_f32_w1, allreduce_rmsnorm_push_ll_f32_w1_virtual: F32, 1;
    allreduce_rmsnorm_push_ll_f32_w2, allreduce_rmsnorm_push_ll_f32_w2_virtual: F32, 2;
    allreduce_rmsnorm_push_ll_f32_w3, allreduce_rmsnorm_push_ll_f32_w3_virtual: F32, 3;
    allreduce_rmsnorm_push_ll_f32_w4, allreduce_rmsnorm_push_ll_f32_w4_virtual: F32, 4;
    allreduce_rmsnorm_push_ll_f32_w5, allreduce_rmsnorm_push_ll_f32_w5_virtual: F32, 5;
    allreduce_rmsnorm_push_ll_f32_w6, allreduce_rmsnorm_push_ll_f32_w6_virtual: F32, 6;
    allreduce_rmsnorm_push_ll_f32_w7, allreduce_rmsnorm_push_ll_f32_w7_virtual: F32, 7;
    allreduce_rmsnorm_push_ll_f32_w8, allreduce_rmsnorm_push_ll_f32_w8_virtual: F32, 8;
    allreduce_rmsnorm_push_ll_f16_w1, allreduce_rmsnorm_push_ll_f16_w1_virtual: F16, 1;
    allreduce_rmsnorm_push_ll_f16_w2, allreduce_rmsnorm_push_ll_f16_w2_virtual: F16, 2;
    allreduce_rmsnorm_push_ll_f16_w3, allreduce_rmsnorm_push_ll_f16_w3_virtual: F16, 3;
    allreduce_rmsnorm_push_ll_f16_w4, allreduce_rmsnorm_push_ll_f16_w4_virtual: F16, 4;
    allreduce_rmsnorm_push_ll_f16_w5, allreduce_rmsnorm_push_ll_f16_w5_virtual: F16, 5;
    allreduce_rmsnorm_push_ll_f16_w6, allreduce_rmsnorm_push_ll_f16_w6_virtual: F16, 6;
    allreduce_rmsnorm_push_ll_f16_w7, allreduce_rmsnorm_push_ll_f16_w7_virtual: F16, 7;
    allreduce_rmsnorm_push_ll_f16_w8, allreduce_rmsnorm_push_ll_f16_w8_virtual: F16, 8;
    allreduce_rmsnorm_push_ll_bf16_w1, allreduce_rmsnorm_push_ll_bf16_w1_virtual: Bf16, 1;
    allreduce_rmsnorm_push_ll_bf16_w2, allreduce_rmsnorm_push_ll_bf16_w2_virtual: Bf16, 2;
    allreduce_rmsnorm_push_ll_bf16_w3, allreduce_rmsnorm_push_ll_bf16_w3_virtual: Bf16, 3;
    allreduce_rmsnorm_push_ll_bf16_w4, allreduce_rmsnorm_push_ll_bf16_w4_virtual: Bf16, 4;
    allreduce_rmsnorm_push_ll_bf16_w5, allreduce_rmsnorm_push_ll_bf16_w5_virtual: Bf16, 5;
    allreduce_rmsnorm_push_ll_bf16_w6, allreduce_rmsnorm_push_ll_bf16_w6_virtual: Bf16, 6;
    allreduce_rmsnorm_push_ll_bf16_w7, allreduce_rmsnorm_push_ll_bf16_w7_virtual: Bf16, 7;
    allreduce_rmsnorm_push_ll_bf16_w8, allreduce_rmsnorm_push_ll_bf16_w8_virtual: Bf16, 8;
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
