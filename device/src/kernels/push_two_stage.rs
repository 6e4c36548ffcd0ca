//! PushTwoStage: reduce-scatter and all-gather by posted writes into
//! landing zones; no rank reads peer memory.

use super::*;
use crate::abi::PushTwoStagePart;

/// One rank's part of a push two-stage collective
/// ([`Algorithm::PushTwoStage`]), run by every thread of every block:
/// 1. each peer p's partition of this rank's input (and this rank's tail)
///    into this rank's part of p's landing zone;
/// 2. `Start` (publishing); reduce this rank's partition in rank order
///    from its own input and its zone into its output and its part of
///    every peer's zone; reduce the tail the same way;
/// 3. `Mid` (publishing); copy every peer's reduced partition from this
///    rank's zone into its output.
///
/// Thread `g` of the grid handles packs `g, g + stride, ...` of each
/// partition (counted from the partition's start), on every rank, so block
/// b of a rank reads only what block b of its peers wrote, and per-block
/// barriers suffice.
///
/// # Safety
/// As for [`allreduce`], except that only this rank's input in the table is
/// read; `a.landing_part` is [`PushTwoStagePart::bytes`] of a layout whose
/// `half` is at least `ceil(ceil(a.count / lanes) / N)`, the same on every
/// rank; and every rank's signal allocation holds a zone of
/// `N * a.landing_part` bytes at `a.landing_offset` (a multiple of 16),
/// past the [`Signal`], used by no other algorithm.
#[inline(always)]
unsafe fn allreduce_push_two_stage<E: Element, const N: usize>(a: &LaunchArgs, rank: u32) {
    // SAFETY: the launch contract.
    let Some(PushStart {
        own_sig,
        own_in,
        block,
        nblocks,
        tid,
        nthreads,
        epoch,
    }) = (unsafe { push_start::<N>(a, rank, true) })
    else {
        return;
    };

    let lanes = E::LANES as u64;
    let s = split(a.count, lanes);
    let g = (block * nthreads + tid) as u64;
    let stride = (nblocks * nthreads) as u64;
    let layout = PushTwoStagePart::from_part_bytes(a.landing_part);
    // Bytes from a zone's start to source `src`'s part. One slot serves
    // every collective (see `barrier::barriers`).
    let part = |src: u64| src * a.landing_part;
    // This rank's part in rank p's zone. The staged loops below choose the
    // peer p at run time: its signal comes from the pointer table in
    // global memory (a run-time index into the kernel parameter, or into
    // an array of pointers, puts them in local memory).
    // SAFETY: `a.table` points to the group's RankTable (contract).
    let table = unsafe { &*(a.table as *const RankTable) };
    let mine = |p: usize| {
        // SAFETY: p < N <= MAX_RANKS; the table lives for the launch.
        let sig = unsafe { read_volatile(&table.signals[p]) };
        sig + a.landing_offset + part(rank as u64)
    };
    let bounds = |p: usize| partition(s.packs, N as u32, p as u32);
    let own_in_p = own_in as *const Pack;

    // Stage 1, the staged schedule: in step k = 1 .. N - 1 every rank
    // writes peer rank + k's partition (mod N) into that peer's zone, so
    // each step is a permutation: every rank sends to one peer and
    // receives from one (all-to-all writes at once congest a PCIe
    // switch).
    let mut k = 1;
    while k < N {
        let p = (rank as usize + k) % N;
        let (ps, pe) = bounds(p);
        let dst = (mine(p) + layout.scatter()) as *mut Pack;
        // SAFETY: packs ps .. pe of the input (pe <= s.packs) and
        // 0 .. pe - ps <= layout.half of p's scatter region (contract).
        unsafe { copy_range_keep(own_in_p.add(ps as usize), dst, 0, pe - ps, g, stride) };
        k += 1;
    }
    // SAFETY: the zones hold tail packs (contract).
    unsafe { send_tail::<E, N>(a, rank, own_in, s, layout.tail(), g, stride) };

    // SAFETY: the signals are the group's (contract), rank < N,
    // block < MAX_BLOCKS and blockDim.x >= N (checked by `push_start`), and
    // control flow is uniform across the block up to here. `Start`
    // publishes the writes above.
    let ok = unsafe {
        block_barrier::<N>(
            a,
            Algorithm::PushTwoStage,
            own_sig,
            rank,
            block,
            BarrierKind::Start,
            epoch,
        )
    };
    if !ok {
        return;
    }
    // SAFETY: own signal; every thread of the block, after the barrier.
    unsafe { commit_epoch(own_sig, block, nblocks, tid, nthreads, epoch) };

    // Stage 2: this rank's partition, in rank order, from its own input
    // and the peers' parts of its zone, into its output and its part of
    // every peer's zone.
    let zone = own_sig + a.landing_offset;
    let (rs, re) = partition(s.packs, N as u32, rank);
    let output = pick::<N>(&a.outputs, rank);
    let mut inputs = [core::ptr::null::<Pack>(); N];
    let mut r = 0;
    while r < N {
        inputs[r] = if r as u32 == rank {
            // SAFETY: rs <= s.packs: at most one past the input's packs.
            unsafe { own_in_p.add(rs as usize) }
        } else {
            (zone + part(r as u64) + layout.scatter()) as *const Pack
        };
        r += 1;
    }
    // SAFETY: rs <= s.packs: at most one past the output's packs.
    let out_r = unsafe { (output as *mut Pack).add(rs as usize) };
    // SAFETY: packs 0 .. re - rs <= layout.half of this input's partition,
    // of every peer's scatter region (filled before their published
    // arrival) and of the output from `rs` (contract).
    unsafe {
        reduce_range::<E, N, true>(&inputs, out_r, core::ptr::null_mut(), 0, re - rs, g, stride)
    };
    // Then, staged as in stage 1, into every peer's zone, read back from
    // the output (each thread reads the packs it wrote).
    let mut k = 1;
    while k < N {
        let dst = (mine((rank as usize + k) % N) + layout.gather()) as *mut Pack;
        // SAFETY: packs 0 .. re - rs of the output from `rs` and of the
        // peer's gather region (re - rs <= layout.half, contract).
        unsafe { copy_range_keep(out_r, dst, 0, re - rs, g, stride) };
        k += 1;
    }
    // The tail: every rank reduces it from its own input and the peers'
    // tail packs.
    // SAFETY: the peers' tail packs were filled before their published
    // `Start` arrivals; the output holds the message (contract).
    unsafe {
        reduce_landed_tail::<E, N>(a, rank, own_in, zone, output, s, layout.tail(), g, stride)
    };

    // SAFETY: as for `Start`; `Mid` publishes the gather writes above.
    let ok = unsafe {
        block_barrier::<N>(
            a,
            Algorithm::PushTwoStage,
            own_sig,
            rank,
            block,
            BarrierKind::Mid,
            epoch,
        )
    };
    if !ok {
        return;
    }

    // Stage 3: every peer's reduced partition from this rank's zone into
    // the output (local reads; the order only spreads the work).
    let mut p = 0;
    while p < N {
        if p as u32 != rank {
            let (ps, pe) = bounds(p);
            let src = (zone + part(p as u64) + layout.gather()) as *const Pack;
            // SAFETY: packs 0 .. pe - ps <= layout.half of peer p's gather
            // region (filled before its published arrival) and of the
            // output from `ps` (pe <= s.packs, contract).
            unsafe {
                copy_range(
                    src,
                    (output as *mut Pack).add(ps as usize),
                    0,
                    pe - ps,
                    g,
                    stride,
                )
            };
        }
        p += 1;
    }
}

push_entries! {
    allreduce_push_two_stage;
    allreduce_push_two_stage_f32_w1, allreduce_push_two_stage_f32_w1_virtual: F32, 1;
    allreduce_push_two_stage_f32_w2, allreduce_push_two_stage_f32_w2_virtual: F32, 2;
    allreduce_push_two_stage_f32_w3, allreduce_push_two_stage_f32_w3_virtual: F32, 3;
    allreduce_push_two_stage_f32_w4, allreduce_push_two_stage_f32_w4_virtual: F32, 4;
    allreduce_push_two_stage_f32_w5, allreduce_push_two_stage_f32_w5_virtual: F32, 5;
    allreduce_push_two_stage_f32_w6, allreduce_push_two_stage_f32_w6_virtual: F32, 6;
    allreduce_push_two_stage_f32_w7, allreduce_push_two_stage_f32_w7_virtual: F32, 7;
    allreduce_push_two_stage_f32_w8, allreduce_push_two_stage_f32_w8_virtual: F32, 8;
    allreduce_push_two_stage_f16_w1, allreduce_push_two_stage_f16_w1_virtual: F16, 1;
    allreduce_push_two_stage_f16_w2, allreduce_push_two_stage_f16_w2_virtual: F16, 2;
    allreduce_push_two_stage_f16_w3, allreduce_push_two_stage_f16_w3_virtual: F16, 3;
    allreduce_push_two_stage_f16_w4, allreduce_push_two_stage_f16_w4_virtual: F16, 4;
    allreduce_push_two_stage_f16_w5, allreduce_push_two_stage_f16_w5_virtual: F16, 5;
    allreduce_push_two_stage_f16_w6, allreduce_push_two_stage_f16_w6_virtual: F16, 6;
    allreduce_push_two_stage_f16_w7, allreduce_push_two_stage_f16_w7_virtual: F16, 7;
    allreduce_push_two_stage_f16_w8, allreduce_push_two_stage_f16_w8_virtual: F16, 8;
    allreduce_push_two_stage_bf16_w1, allreduce_push_two_stage_bf16_w1_virtual: Bf16, 1;
    allreduce_push_two_stage_bf16_w2, allreduce_push_two_stage_bf16_w2_virtual: Bf16, 2;
    allreduce_push_two_stage_bf16_w3, allreduce_push_two_stage_bf16_w3_virtual: Bf16, 3;
    allreduce_push_two_stage_bf16_w4, allreduce_push_two_stage_bf16_w4_virtual: Bf16, 4;
    allreduce_push_two_stage_bf16_w5, allreduce_push_two_stage_bf16_w5_virtual: Bf16, 5;
    allreduce_push_two_stage_bf16_w6, allreduce_push_two_stage_bf16_w6_virtual: Bf16, 6;
    allreduce_push_two_stage_bf16_w7, allreduce_push_two_stage_bf16_w7_virtual: Bf16, 7;
    allreduce_push_two_stage_bf16_w8, allreduce_push_two_stage_bf16_w8_virtual: Bf16, 8;
}
