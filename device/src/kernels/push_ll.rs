//! PushLl: push whose arrival signal travels with the data. Every rank
//! writes its input, as flag-in-data lines ([`crate::ll`]), into its part of
//! every peer's LL landing zone, then polls its own zone until each pack of
//! every peer carries this collective's epoch and reduces in rank order.
//! No flag, no fence, no barrier between ranks.

use super::*;
use crate::ll::{self, Lines, PackSlot, LL_PACK_BYTES};

/// One pack of a landing zone in GPU memory.
pub(super) struct GpuSlot(pub(super) u64);

impl PackSlot for GpuSlot {
    #[inline(always)]
    fn load(&self) -> Lines {
        let p = self.0 as *const [u64; 2];
        // SAFETY: a `GpuSlot` is only made for a pack inside a landing zone
        // (32-byte aligned: the zone and its parts are multiples of 32).
        unsafe { [ld_volatile_line(p), ld_volatile_line(p.add(1))] }
    }
    #[inline(always)]
    fn store(&self, lines: Lines) {
        let p = self.0 as *mut [u64; 2];
        // SAFETY: as for `load`.
        unsafe {
            st_volatile_line(p, lines[0]);
            st_volatile_line(p.add(1), lines[1]);
        }
    }
}

/// Pack `i` of an `E` buffer of `count` elements: whole if it lies inside,
/// else its elements below `count` with zero bits after them.
///
/// # Safety
/// `base` must be a 16-byte aligned global address valid for reads of
/// elements `0 .. count`, and `i < ceil(count / lanes)`.
#[inline(always)]
pub(super) unsafe fn ld_pack_upto<E: Element>(base: u64, i: u64, count: u64) -> Pack {
    let lanes = E::LANES as u64;
    if (i + 1) * lanes <= count {
        // SAFETY: the whole pack is inside the buffer (caller contract).
        return unsafe { ld_pack((base as *const Pack).add(i as usize)) };
    }
    let mut p = [0u32; 4];
    let mut k = 0;
    while k < lanes && i * lanes + k < count {
        // SAFETY: element i * lanes + k < count is inside the buffer.
        let v = unsafe { ld_elem::<E>(base, i * lanes + k) };
        if E::LANES == 4 {
            p[k as usize] = v;
        } else {
            p[(k / 2) as usize] |= v << (16 * (k % 2));
        }
        k += 1;
    }
    p
}

/// Stores pack `i` of an `E` buffer of `count` elements: whole if it lies
/// inside, else only its elements below `count`.
///
/// # Safety
/// `base` must be a 16-byte aligned global address valid for writes of
/// elements `0 .. count`, and `i < ceil(count / lanes)`.
#[inline(always)]
unsafe fn st_pack_upto<E: Element>(base: u64, i: u64, count: u64, p: Pack) {
    let lanes = E::LANES as u64;
    if (i + 1) * lanes <= count {
        // SAFETY: the whole pack is inside the buffer (caller contract).
        unsafe { st_pack_streaming((base as *mut Pack).add(i as usize), p) };
        return;
    }
    let mut k = 0;
    while k < lanes && i * lanes + k < count {
        let v = if E::LANES == 4 {
            p[k as usize]
        } else {
            (p[(k / 2) as usize] >> (16 * (k % 2))) & 0xffff
        };
        // SAFETY: element i * lanes + k < count is inside the buffer.
        unsafe { st_elem::<E>(base, i * lanes + k, v) };
        k += 1;
    }
}

/// Packs `g` and `g + stride` of this rank's input (`a.count` elements,
/// whole packs: the fused push_ll's register path), for
/// [`ll_send`], loaded without looking at the epoch, so a kernel can
/// issue them before it waits for the epoch's load. A pack that does not
/// exist (past the input, or a null `own_in`, which the epoch check then
/// reports as `UNREGISTERED`) is read at `a.table` instead, the group's
/// pointer table (read-only while kernels run, 16-byte aligned), and its
/// value goes unused.
///
/// # Safety
/// `own_in` is null or holds `a.count` elements, a multiple of `E::LANES`;
/// `a.table` points to the group's `RankTable` (the launch contract).
#[inline(always)]
pub(super) unsafe fn ll_first<E: Element, const N: usize>(
    a: &LaunchArgs,
    own_in: u64,
    g: u64,
    stride: u64,
) -> (Pack, Pack) {
    if N == 1 {
        return ([0; 4], [0; 4]);
    }
    let packs = a.count / E::LANES as u64;
    let at = |i: u64| {
        if own_in != 0 && i < packs {
            own_in + i * crate::abi::PACK_BYTES as u64
        } else {
            a.table
        }
    };
    // SAFETY: each address is a whole pack of the input or the table's
    // first 16 bytes (above; contract).
    unsafe {
        (
            ld_pack(at(g) as *const Pack),
            ld_pack(at(g + stride) as *const Pack),
        )
    }
}

/// Sends packs `g, g + stride, ...` of this rank's input (`a.count`
/// elements; the last pack zero-padded) as flag-in-data lines of `epoch`
/// into this rank's part of every peer's LL zone (slot by the epoch's
/// parity, [`ll::slot`]), starting from `first`: packs `g` and `g +
/// stride`, loaded by the caller ([`ld_own_two`], or [`ll_first`] before
/// the epoch was waited for), so the first loads go out before the
/// destinations are computed. Then two packs per iteration, both loaded
/// before either is stored (a store between them would hold the second
/// load back a round trip).
///
/// # Safety
/// As for [`allreduce_push_ll`]: `own_in` holds `a.count` elements, and
/// every rank's signal allocation holds an LL zone whose parts hold
/// `ceil(a.count / lanes)` LL packs; `first` holds packs `g` and `g +
/// stride` of `own_in` where they exist.
#[inline(always)]
pub(super) unsafe fn ll_send<E: Element, const N: usize, const WHOLE: bool>(
    a: &LaunchArgs,
    rank: u32,
    own_in: u64,
    epoch: u32,
    g: u64,
    stride: u64,
    first: (Pack, Pack),
) {
    if N == 1 {
        return;
    }
    // An empty plain call still sends one (all-padding) pack, so that every
    // rank hears from every peer under the call's tag ([`exchanged_packs`]).
    let packs = if WHOLE {
        a.count.div_ceil(E::LANES as u64)
    } else {
        exchanged_packs::<E>(a.count)
    };
    let mut i = g;
    if i >= packs {
        return;
    }
    let (mut a1, mut a2) = first;
    let tag = ll_highs(epoch, a, rank);
    let part = ll::slot(epoch, N as u64, rank as u64, a.landing_part);
    let mut dst = [0u64; MAX_RANKS];
    let mut p = 0;
    while p < N {
        dst[p] = pick::<N>(&a.signals, p as u32) + a.landing_offset + part;
        p += 1;
    }
    loop {
        let i2 = i + stride;
        // Inside every peer's part, which holds `packs` LL packs
        // (contract).
        send_lines::<N>(&dst, rank, i, ll::encode(a1, tag));
        if i2 < packs {
            send_lines::<N>(&dst, rank, i2, ll::encode(a2, tag));
        }
        i += 2 * stride;
        if i >= packs {
            return;
        }
        // SAFETY: i, i + stride (where below packs = ceil(count / lanes)):
        // inside this rank's input (count elements, contract).
        (a1, a2) = unsafe { ld_own_two::<E, WHOLE>(own_in, i, stride, packs, a.count) };
    }
}

/// Packs `i` and, when it is below `packs`, `i + stride` of this rank's
/// input (zeros for the second otherwise), both loads issued before
/// either is used.
///
/// # Safety
/// As for [`ld_own`], for `i < packs` and `i + stride` where it is below
/// `packs = ceil(count / lanes)`.
#[inline(always)]
unsafe fn ld_own_two<E: Element, const WHOLE: bool>(
    own_in: u64,
    i: u64,
    stride: u64,
    packs: u64,
    count: u64,
) -> (Pack, Pack) {
    let i2 = i + stride;
    // SAFETY: forwarded caller contract.
    unsafe {
        let a1 = ld_own::<E, WHOLE>(own_in, i, count);
        let a2 = if i2 < packs {
            ld_own::<E, WHOLE>(own_in, i2, count)
        } else {
            [0; 4]
        };
        (a1, a2)
    }
}

/// Pack `i` of this rank's input: whole when `WHOLE` (`count` a multiple of
/// the lanes: no partial-pack code, which the compiler would otherwise
/// predicate into the straight path, a compare per lane), else by
/// [`ld_pack_upto`].
///
/// # Safety
/// As for [`ld_pack_upto`]; `WHOLE` only when pack `i` lies wholly inside
/// the `count` elements (every pack does when `count` is a multiple of
/// `E::LANES`).
#[inline(always)]
pub(super) unsafe fn ld_own<E: Element, const WHOLE: bool>(base: u64, i: u64, count: u64) -> Pack {
    // SAFETY: forwarded caller contract.
    unsafe {
        if WHOLE {
            ld_pack((base as *const Pack).add(i as usize))
        } else {
            ld_pack_upto::<E>(base, i, count)
        }
    }
}

/// LL packs a plain push_ll launch of `count` elements exchanges:
/// `ceil(count / lanes)`, and one for an empty call (all padding: nothing
/// is loaded or stored for it), so that no rank finishes a call without a
/// pack from every peer carrying the call's tag. A rank whose call is
/// empty while a peer's is not then times out on the peer's pack of
/// another tag (`CallMismatch`) instead of returning with no word at all.
#[inline(always)]
pub(super) fn exchanged_packs<E: Element>(count: u64) -> u64 {
    let packs = count.div_ceil(E::LANES as u64);
    if packs == 0 {
        1
    } else {
        packs
    }
}

/// Stores the lines of pack `i` into every peer's part (`dst[p]`).
#[inline(always)]
fn send_lines<const N: usize>(dst: &[u64; MAX_RANKS], rank: u32, i: u64, lines: ll::Lines) {
    let mut p = 0;
    while p < N {
        if p as u32 != rank {
            GpuSlot(dst[p] + i * LL_PACK_BYTES as u64).store(lines);
        }
        p += 1;
    }
}

/// One rank's part of a PushLl collective ([`Algorithm::PushLl`]), run by
/// every thread of every block of the launch. Thread `g` of the grid owns
/// packs `g, g + stride, ...`: it sends them to every peer, then waits for
/// the same packs of every peer in its own zone and reduces them, in rank
/// order, with its own input (read in place). A pack past the last whole
/// one travels zero-padded and is stored element by element.
///
/// # Safety
/// As for [`allreduce`], except that only this rank's input in the table is
/// read; `a.landing_part` is a multiple of 32 and at least
/// `exchanged_packs(a.count) * 32`, the same on every rank; and every rank's
/// signal allocation holds an LL landing zone of `2 * N * a.landing_part`
/// bytes at `a.landing_offset` (a multiple of 32), past the [`Signal`],
/// used by no other algorithm.
#[inline(always)]
unsafe fn allreduce_push_ll<E: Element, const N: usize>(a: &LaunchArgs, rank: u32) {
    // SAFETY: the launch contract.
    let Some(PushStart {
        own_sig,
        own_in,
        block,
        nblocks,
        tid,
        nthreads,
        epoch,
    }) = (unsafe { push_start::<N>(a, rank, false) })
    else {
        return;
    };

    let packs = exchanged_packs::<E>(a.count);
    let g = (block * nthreads + tid) as u64;
    let stride = (nblocks * nthreads) as u64;
    let part = |src: u64| ll::slot(epoch, N as u64, src, a.landing_part);

    // Phase 1: this rank's packs into its part of every peer's zone (with
    // no peer, none), the first two loaded before the destinations are
    // computed: the loads follow the table's answer at once.
    if N > 1 && g < packs {
        // SAFETY: g, g + stride (where below packs = ceil(count / lanes)):
        // inside this rank's input (count elements, contract).
        let first = unsafe { ld_own_two::<E, false>(own_in, g, stride, packs, a.count) };
        // SAFETY: the launch contract; `first` holds packs g and g + stride.
        unsafe { ll_send::<E, N, false>(a, rank, own_in, epoch, g, stride, first) };
    }

    // Every thread of the block read the old epoch; commit the new one.
    sync_threads();
    // SAFETY: own signal; every thread of the block, after every thread
    // read the old value (the bar.sync above).
    unsafe { commit_epoch(own_sig, block, nblocks, tid, nthreads, epoch) };

    // Phase 2: wait for each peer's packs in this rank's zone, in rank
    // order, and reduce them with this rank's own input.
    let zone = own_sig + a.landing_offset;
    let tag = ll_highs(epoch, a, rank);
    let output = pick::<N>(&a.outputs, rank);
    let mut i = g;
    while i < packs {
        // Rank order, seeded with rank 0's values (as `reduce_pack`), each
        // source added as soon as it is there: no array of N packs, which
        // a loop with an early exit would leave in local memory.
        let mut acc = [0f32; 8];
        let mut r = 0;
        while r < N {
            let pk = if r as u32 == rank {
                // SAFETY: as in phase 1.
                unsafe { ld_pack_upto::<E>(own_in, i, a.count) }
            } else {
                let slot = GpuSlot(zone + part(r as u64) + i * LL_PACK_BYTES as u64);
                match ll::wait_pack(&slot, tag, a.timeout_ns, &mut GlobalTimer) {
                    Some(pk) => pk,
                    None => {
                        // The data is the arrival: report it as the Start
                        // barrier's, the one every algorithm begins with.
                        // SAFETY: `own_sig` is this rank's own signal.
                        unsafe {
                            record_error(
                                own_sig,
                                a.host_error,
                                error_code::PEER_TIMEOUT,
                                rank,
                                block,
                                r as u32,
                                epoch,
                                BarrierKind::Start as u32,
                                tag_of(a, rank),
                            )
                        };
                        return;
                    }
                }
            };
            let x = E::unpack(pk);
            let mut l = 0;
            while l < 8 {
                acc[l] = if r == 0 { x[l] } else { acc[l] + x[l] };
                l += 1;
            }
            r += 1;
        }
        // SAFETY: i < packs: inside the output, which holds `a.count`
        // elements (contract).
        unsafe { st_pack_upto::<E>(output, i, a.count, E::pack(&acc)) };
        i += stride;
    }
}

push_entries! {
    allreduce_push_ll;
    allreduce_push_ll_f32_w1, allreduce_push_ll_f32_w1_virtual: F32, 1;
    allreduce_push_ll_f32_w2, allreduce_push_ll_f32_w2_virtual: F32, 2;
    allreduce_push_ll_f32_w3, allreduce_push_ll_f32_w3_virtual: F32, 3;
    allreduce_push_ll_f32_w4, allreduce_push_ll_f32_w4_virtual: F32, 4;
    allreduce_push_ll_f32_w5, allreduce_push_ll_f32_w5_virtual: F32, 5;
    allreduce_push_ll_f32_w6, allreduce_push_ll_f32_w6_virtual: F32, 6;
    allreduce_push_ll_f32_w7, allreduce_push_ll_f32_w7_virtual: F32, 7;
    allreduce_push_ll_f32_w8, allreduce_push_ll_f32_w8_virtual: F32, 8;
    allreduce_push_ll_f16_w1, allreduce_push_ll_f16_w1_virtual: F16, 1;
    allreduce_push_ll_f16_w2, allreduce_push_ll_f16_w2_virtual: F16, 2;
    allreduce_push_ll_f16_w3, allreduce_push_ll_f16_w3_virtual: F16, 3;
    allreduce_push_ll_f16_w4, allreduce_push_ll_f16_w4_virtual: F16, 4;
    allreduce_push_ll_f16_w5, allreduce_push_ll_f16_w5_virtual: F16, 5;
    allreduce_push_ll_f16_w6, allreduce_push_ll_f16_w6_virtual: F16, 6;
    allreduce_push_ll_f16_w7, allreduce_push_ll_f16_w7_virtual: F16, 7;
    allreduce_push_ll_f16_w8, allreduce_push_ll_f16_w8_virtual: F16, 8;
    allreduce_push_ll_bf16_w1, allreduce_push_ll_bf16_w1_virtual: Bf16, 1;
    allreduce_push_ll_bf16_w2, allreduce_push_ll_bf16_w2_virtual: Bf16, 2;
    allreduce_push_ll_bf16_w3, allreduce_push_ll_bf16_w3_virtual: Bf16, 3;
    allreduce_push_ll_bf16_w4, allreduce_push_ll_bf16_w4_virtual: Bf16, 4;
    allreduce_push_ll_bf16_w5, allreduce_push_ll_bf16_w5_virtual: Bf16, 5;
    allreduce_push_ll_bf16_w6, allreduce_push_ll_bf16_w6_virtual: Bf16, 6;
    allreduce_push_ll_bf16_w7, allreduce_push_ll_bf16_w7_virtual: Bf16, 7;
    allreduce_push_ll_bf16_w8, allreduce_push_ll_bf16_w8_virtual: Bf16, 8;
}
