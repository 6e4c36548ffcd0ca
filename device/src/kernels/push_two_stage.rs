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
    let esize = 16 / lanes;
    let s = split(a.count, lanes);
    let g = (block * nthreads + tid) as u64;
    let stride = (nblocks * nthreads) as u64;
    let layout = PushTwoStagePart::from_part_bytes(a.landing_part);
    // Bytes from a zone's start to source `src`'s part. One slot serves
    // every collective (see `barrier::barriers`).
    let part = |src: u64| src * a.landing_part;
    // This rank's part in rank p's zone, and partition p, computed where
    // used. Every loop over peers is innermost, with constant bounds, so it
    // unrolls, p is a constant and the signal pointer is read from the
    // kernel parameter. (An outer loop over peers, or a rotated order
    // p = rank + k mod N, made p a run-time value: the pointers then went
    // through local memory, with the whole kernel parameter.)
    let mine = |p: usize| pick::<N>(&a.signals, p as u32) + a.landing_offset + part(rank as u64);
    let bounds = |p: usize| partition(s.packs, N as u32, p as u32);
    // The longest partition: the loops over all partitions run j over
    // 0 .. longest, pack j of each partition counted from its start.
    let longest = s.packs.div_ceil(N as u64);
    let own_in_p = own_in as *const Pack;

    // Stage 1: pack j of each peer p's partition of this input into p's
    // zone (N - 1 independent loads in flight per iteration).
    let mut j = g;
    while j < longest {
        let mut p = 0;
        while p < N {
            let (ps, pe) = bounds(p);
            if p as u32 != rank && ps + j < pe {
                // SAFETY: ps + j < pe <= s.packs: inside the input;
                // j < longest <= layout.half: inside p's scatter region
                // (contract).
                unsafe {
                    let v = ld_pack(own_in_p.add((ps + j) as usize));
                    st_pack(
                        ((mine(p) + layout.scatter()) as *mut Pack).add(j as usize),
                        v,
                    );
                }
            }
            p += 1;
        }
        j += stride;
    }
    let mut t = g;
    while t < s.tail {
        // SAFETY: the tail element is inside the input; the tail pack of
        // every part holds `lanes > s.tail` elements.
        unsafe {
            let v = ld_elem::<E>(own_in, s.packs * lanes + t);
            let mut p = 0;
            while p < N {
                if p as u32 != rank {
                    st_elem::<E>(mine(p) + layout.tail(), t, v);
                }
                p += 1;
            }
        }
        t += stride;
    }

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
    let mut j = g;
    while rs + j < re {
        // SAFETY: j < re - rs <= layout.half: inside this input's partition,
        // every peer's scatter region (filled before their published
        // arrival), the output from `rs` and every peer's gather region
        // (contract).
        unsafe {
            let v = reduce_at::<E, N>(&inputs, j);
            st_pack_streaming(out_r.add(j as usize), v);
            let mut p = 0;
            while p < N {
                if p as u32 != rank {
                    st_pack(
                        ((mine(p) + layout.gather()) as *mut Pack).add(j as usize),
                        v,
                    );
                }
                p += 1;
            }
        }
        j += stride;
    }
    // The tail: every rank reduces it from its own input and the peers'
    // tail packs. `reduce_tail` indexes from the message start, so each
    // peer's tail pack is addressed as if it sat at the tail's position.
    let tail_at = s.packs * lanes;
    let mut from = [0u64; MAX_RANKS];
    let mut r = 0;
    while r < N {
        from[r] = if r as u32 == rank {
            own_in
        } else {
            (zone + part(r as u64) + layout.tail()).wrapping_sub(tail_at * esize)
        };
        r += 1;
    }
    // SAFETY: elements tail_at .. tail_at + tail of `from[r]` are the
    // peer's tail pack (filled before its published arrival) or this
    // input's tail; the output holds them (contract).
    unsafe { reduce_tail::<E, N>(&from, output, tail_at, s.tail, g, stride) };

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

    // Stage 3: pack j of every peer's reduced partition from this rank's
    // zone into the output.
    let mut j = g;
    while j < longest {
        let mut p = 0;
        while p < N {
            let (ps, pe) = bounds(p);
            if p as u32 != rank && ps + j < pe {
                // SAFETY: j < pe - ps <= layout.half: inside peer p's
                // gather region (filled before its published arrival) and,
                // at ps + j < s.packs, the output.
                unsafe {
                    let src = (zone + part(p as u64) + layout.gather()) as *const Pack;
                    let v = ld_pack(src.add(j as usize));
                    st_pack_streaming((output as *mut Pack).add((ps + j) as usize), v);
                }
            }
            p += 1;
        }
        j += stride;
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
