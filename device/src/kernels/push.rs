//! Push: every rank writes its input into its peers' landing zones and
//! reduces its own locally.

use super::*;

/// One rank's part of a push collective ([`Algorithm::Push`]), run by every
/// thread of every block of the launch: write this rank's input into its
/// slot of every peer's landing zone, arrive and wait (publishing), then
/// reduce the landing zone (and this rank's own input) in rank order. No
/// rank reads peer memory, so there is no `End` barrier.
///
/// # Safety
/// As for [`allreduce`], except that only this rank's input in the table is
/// read; `a.landing_part` is a multiple of 16 and at least
/// `ceil(a.count / lanes) * 16`, the same on every rank; and every rank's
/// signal allocation holds a landing zone of `2 * N * a.landing_part`
/// bytes at `a.landing_offset`, past the [`Signal`].
#[inline(always)]
unsafe fn allreduce_push<E: Element, const N: usize>(a: &LaunchArgs, rank: u32) {
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
    // Bytes from a landing zone's start to source `src`'s part of this
    // collective's slot (a layout that does not depend on the message).
    let part = |src: u64| ((epoch as u64 & 1) * N as u64 + src) * a.landing_part;

    // Phase 1: this rank's input into its part of every peer's zone.
    let mut dst = [0u64; MAX_RANKS];
    let mut p = 0;
    while p < N {
        dst[p] = pick::<N>(&a.signals, p as u32) + a.landing_offset + part(rank as u64);
        p += 1;
    }
    let src = own_in as *const Pack;
    let mut i = g;
    while i < s.packs {
        // SAFETY: pack i < s.packs is inside this rank's input and inside
        // every peer's part, which holds `packs` packs (contract).
        unsafe {
            let v = ld_pack(src.add(i as usize));
            let mut p = 0;
            while p < N {
                if p as u32 != rank {
                    st_pack((dst[p] as *mut Pack).add(i as usize), v);
                }
                p += 1;
            }
        }
        i += stride;
    }
    let mut k = g;
    while k < s.tail {
        let idx = s.packs * lanes + k;
        // SAFETY: idx < a.count: inside the input, and inside every part
        // (which holds `packs * lanes >= a.count` elements).
        unsafe {
            let v = ld_elem::<E>(own_in, idx);
            let mut p = 0;
            while p < N {
                if p as u32 != rank {
                    st_elem::<E>(dst[p], idx, v);
                }
                p += 1;
            }
        }
        k += stride;
    }

    // SAFETY: the signals are the group's (contract), rank < N,
    // block < MAX_BLOCKS and blockDim.x >= N (checked above), and control
    // flow is uniform across the block up to here. `Start` publishes the
    // writes above (bar.sync, then a release arrival).
    let ok = unsafe {
        block_barrier::<N>(
            a,
            Algorithm::Push,
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
    // Every thread that needed the old value read it before the barrier.
    // SAFETY: own signal; every thread of the block, after the barrier.
    unsafe { commit_epoch(own_sig, block, nblocks, tid, nthreads, epoch) };

    // Phase 2: reduce this rank's zone in rank order; its own part is its
    // input itself.
    let zone = own_sig + a.landing_offset;
    let mut from = [0u64; MAX_RANKS];
    let mut r = 0;
    while r < N {
        from[r] = if r as u32 == rank {
            own_in
        } else {
            zone + part(r as u64)
        };
        r += 1;
    }
    let mut inputs = [core::ptr::null::<Pack>(); N];
    let mut r = 0;
    while r < N {
        inputs[r] = from[r] as *const Pack;
        r += 1;
    }
    let output = pick::<N>(&a.outputs, rank);
    // SAFETY: packs [0, s.packs) and the tail are inside every part (filled
    // by the peers before their published arrival), the input and the
    // output, which hold `a.count` elements (contract).
    unsafe {
        reduce_range::<E, N, false>(
            &inputs,
            output as *mut Pack,
            core::ptr::null_mut(),
            0,
            s.packs,
            g,
            stride,
        );
        reduce_tail::<E, N>(&from, output, s.packs * lanes, s.tail, g, stride);
    }
}

push_entries! {
    allreduce_push;
    allreduce_push_f32_w1, allreduce_push_f32_w1_virtual: F32, 1;
    allreduce_push_f32_w2, allreduce_push_f32_w2_virtual: F32, 2;
    allreduce_push_f32_w3, allreduce_push_f32_w3_virtual: F32, 3;
    allreduce_push_f32_w4, allreduce_push_f32_w4_virtual: F32, 4;
    allreduce_push_f32_w5, allreduce_push_f32_w5_virtual: F32, 5;
    allreduce_push_f32_w6, allreduce_push_f32_w6_virtual: F32, 6;
    allreduce_push_f32_w7, allreduce_push_f32_w7_virtual: F32, 7;
    allreduce_push_f32_w8, allreduce_push_f32_w8_virtual: F32, 8;
    allreduce_push_f16_w1, allreduce_push_f16_w1_virtual: F16, 1;
    allreduce_push_f16_w2, allreduce_push_f16_w2_virtual: F16, 2;
    allreduce_push_f16_w3, allreduce_push_f16_w3_virtual: F16, 3;
    allreduce_push_f16_w4, allreduce_push_f16_w4_virtual: F16, 4;
    allreduce_push_f16_w5, allreduce_push_f16_w5_virtual: F16, 5;
    allreduce_push_f16_w6, allreduce_push_f16_w6_virtual: F16, 6;
    allreduce_push_f16_w7, allreduce_push_f16_w7_virtual: F16, 7;
    allreduce_push_f16_w8, allreduce_push_f16_w8_virtual: F16, 8;
    allreduce_push_bf16_w1, allreduce_push_bf16_w1_virtual: Bf16, 1;
    allreduce_push_bf16_w2, allreduce_push_bf16_w2_virtual: Bf16, 2;
    allreduce_push_bf16_w3, allreduce_push_bf16_w3_virtual: Bf16, 3;
    allreduce_push_bf16_w4, allreduce_push_bf16_w4_virtual: Bf16, 4;
    allreduce_push_bf16_w5, allreduce_push_bf16_w5_virtual: Bf16, 5;
    allreduce_push_bf16_w6, allreduce_push_bf16_w6_virtual: Bf16, 6;
    allreduce_push_bf16_w7, allreduce_push_bf16_w7_virtual: Bf16, 7;
    allreduce_push_bf16_w8, allreduce_push_bf16_w8_virtual: Bf16, 8;
}
