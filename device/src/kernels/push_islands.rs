//! PushIslands: push two-stage over two islands of ranks (e.g. the GPUs
//! behind two PCIe switches), under the rank-order contract: only the
//! first island's unrounded f32 partials and the reduced partitions cross
//! between the islands.

use super::*;
use crate::abi::{island_split, PushTwoStagePart};
use crate::reduce::{accumulate, partial_from_packs, partial_packs, partial_to_packs};

/// One rank's part of a push-islands collective
/// ([`Algorithm::PushIslands`]), run by every thread of every block.
/// Island A is ranks `0..h`, island B ranks `h..N` (`h =`
/// [`island_split`]`(N)`); a rank's island index `i` is its rank minus its
/// island's first rank. The message's packs are cut into `h` partitions;
/// partition `i` is owned by A's rank `i` and by B's rank `h + i`, its
/// counterpart (B's ranks from `h + h` on, when N is odd, own none).
/// 1. Each rank writes every partition its island peers own into their
///    landing zones (part = this rank), staged one peer per step, and its
///    tail elements into every rank's zone;
/// 2. `Start`; every rank reduces the tail from its own input and its
///    zone; A's rank `i` adds partition `i` of ranks `0..h` in rank order
///    in f32 and writes the unrounded sums (f32 bits) into its
///    counterpart's zone (in the part of this rank: scatter and gather
///    regions together);
/// 3. `Mid`; B's rank `h + i` goes on from those sums, adding partition
///    `i` of ranks `h..N` in rank order, rounds once, and writes the
///    result into its output, into its counterpart's zone and into its
///    island peers' zones (gather regions);
/// 4. `Back`; B's ranks copy the other partitions from their zones and
///    are done; A's rank `i` copies partition `i` from its zone into its
///    output and into its island peers' zones (gather regions);
/// 5. `Relay`, among A's ranks; A's ranks copy the other partitions.
///
/// Thread `g` of the grid handles packs `g, g + stride, ...` of each
/// partition (counted from the partition's start) on every rank, so block
/// b of a rank reads only what block b of its peers wrote, and per-block
/// barriers suffice.
///
/// # Safety
/// As for [`allreduce`], except that only this rank's input in the table is
/// read; `a.landing_part` is [`PushTwoStagePart::bytes`] of a layout whose
/// `half` is at least `ceil(ceil(a.count / lanes) / h)`, the same on every
/// rank; and every rank's signal allocation holds a zone of
/// `N * a.landing_part` bytes at `a.landing_offset` (a multiple of 16),
/// past the [`Signal`], used by no other algorithm.
#[inline(always)]
unsafe fn allreduce_push_islands<E: Element, const N: usize>(a: &LaunchArgs, rank: u32) {
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

    let h = island_split(N);
    let lanes = E::LANES as u64;
    let wide = partial_packs::<E>();
    let s = split(a.count, lanes);
    let g = (block * nthreads + tid) as u64;
    let stride = (nblocks * nthreads) as u64;
    let layout = PushTwoStagePart::from_part_bytes(a.landing_part);
    // Bytes from a zone's start to source `src`'s part.
    let part = |src: usize| src as u64 * a.landing_part;
    // Rank p's zone. The staged loops choose p at run time: its signal
    // comes from the pointer table in global memory (a run-time index into
    // the kernel parameter puts it in local memory).
    // SAFETY: `a.table` points to the group's RankTable (contract).
    let table = unsafe { &*(a.table as *const RankTable) };
    let zone_of = |p: usize| {
        // SAFETY: every caller passes a rank, p < N <= MAX_RANKS (the
        // compiler cannot see it through the island arithmetic, and an
        // index check would pull in a panic the PTX cannot link); the
        // table lives for the launch.
        let sig = unsafe { read_volatile(table.signals.as_ptr().add(p)) };
        sig + a.landing_offset
    };
    let zone = own_sig + a.landing_offset;
    let r = rank as usize;
    let in_a = r < h;
    let first = if in_a { 0 } else { h };
    let size = if in_a { h } else { N - h };
    let idx = r - first;
    let owns = idx < h;
    // Meaningful when N > 1 and `owns`.
    let counterpart = if in_a { r + h } else { r - h };
    let bounds = |q: usize| partition(s.packs, h as u32, q as u32);
    let own_in_p = own_in as *const Pack;
    let output = pick::<N>(&a.outputs, rank);
    let out_p = output as *mut Pack;

    // Step 1: the island peers' partitions into their zones, staged: in
    // step k every rank writes to island index i + k (mod island size).
    let mut k = 1;
    while k < size {
        let q = (idx + k) % size;
        if q < h {
            let (ps, pe) = bounds(q);
            let dst = (zone_of(first + q) + part(r) + layout.scatter()) as *mut Pack;
            // SAFETY: packs ps .. pe of the input (pe <= s.packs) and
            // 0 .. pe - ps <= layout.half of the peer's scatter region.
            unsafe { copy_range_keep(own_in_p.add(ps as usize), dst, 0, pe - ps, g, stride) };
        }
        k += 1;
    }
    // SAFETY: the zones hold tail packs (contract).
    unsafe { send_tail::<E, N>(a, rank, own_in, s, layout.tail(), g, stride) };

    // SAFETY (every barrier below): the signals are the group's (contract),
    // rank < N, block < MAX_BLOCKS and blockDim.x >= N (checked by
    // `push_start`), and control flow is uniform across the block (every
    // branch depends on the rank and N only).
    let ok = unsafe {
        block_barrier::<N>(
            a,
            Algorithm::PushIslands,
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

    // The tail, by every rank, from its input and the peers' tail packs.
    // SAFETY: the peers' tail packs were filled before their published
    // `Start` arrivals; the output holds the message (contract).
    unsafe {
        reduce_landed_tail::<E, N>(a, rank, own_in, zone, output, s, layout.tail(), g, stride)
    };

    if N == 1 {
        // One island of one rank: the whole message is its partition, and
        // the rounded sum of one rank is the result.
        let inputs = [own_in_p; N];
        // SAFETY: packs 0 .. s.packs of the input and the output.
        unsafe {
            reduce_range::<E, N, false>(
                &inputs,
                out_p,
                core::ptr::null_mut(),
                0,
                s.packs,
                g,
                stride,
            )
        };
        return;
    }

    // Step 2 (A): partition i over ranks 0..h, unrounded, into the
    // counterpart's zone.
    let (rs, re) = if owns { bounds(idx) } else { (0, 0) };
    let len = re - rs;
    if in_a {
        let mut inputs = [core::ptr::null::<Pack>(); N];
        let mut q = 0;
        while q < h {
            inputs[q] = if q == r {
                // SAFETY: rs <= s.packs: at most one past the input's packs.
                unsafe { own_in_p.add(rs as usize) }
            } else {
                (zone + part(q) + layout.scatter()) as *const Pack
            };
            q += 1;
        }
        let cross = (zone_of(counterpart) + part(r) + layout.scatter()) as *mut Pack;
        let mut j = g;
        while j < len {
            // SAFETY: pack j < len <= layout.half of this input's partition
            // and of every island peer's scatter region (filled before its
            // published arrival); `wide * j + 1 < 2 * layout.half`, inside
            // the counterpart's scatter and gather regions, contiguous.
            unsafe {
                let mut v = [[0u32; 4]; N];
                let mut q = 0;
                while q < h {
                    v[q] = ld_pack(inputs[q].add(j as usize));
                    q += 1;
                }
                let mut acc = E::unpack(v[0]);
                let mut q = 1;
                while q < h {
                    accumulate::<E>(&mut acc, v[q]);
                    q += 1;
                }
                let w = partial_to_packs(&acc);
                st_pack(cross.add(wide * j as usize), w[0]);
                if wide == 2 {
                    st_pack(cross.add(wide * j as usize + 1), w[1]);
                }
            }
            j += stride;
        }
    }

    // SAFETY: as for `Start`; `Mid` publishes the partial sums.
    let ok = unsafe {
        block_barrier::<N>(
            a,
            Algorithm::PushIslands,
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

    // Step 3 (B owners): on from the partial sums over ranks h..N, rounded
    // once, into the output and the counterpart's zone; then, staged, into
    // the island peers' zones.
    // SAFETY: rs <= s.packs: at most one past the output's packs.
    let out_r = unsafe { out_p.add(rs as usize) };
    if !in_a && owns {
        let mut inputs = [core::ptr::null::<Pack>(); N];
        let mut q = h;
        while q < N {
            inputs[q - h] = if q == r {
                // SAFETY: rs <= s.packs: at most one past the input's packs.
                unsafe { own_in_p.add(rs as usize) }
            } else {
                (zone + part(q) + layout.scatter()) as *const Pack
            };
            q += 1;
        }
        let partial = (zone + part(counterpart) + layout.scatter()) as *const Pack;
        let back = (zone_of(counterpart) + part(r) + layout.scatter()) as *mut Pack;
        let mut j = g;
        while j < len {
            // SAFETY: as in step 2, for this rank's zone (the partials,
            // filled before the counterpart's published arrival at `Mid`)
            // and island B's scatter regions; pack j of the output's
            // partition and of the counterpart's region.
            unsafe {
                let mut v = [[0u32; 4]; N];
                let mut q = 0;
                while q < N - h {
                    v[q] = ld_pack(inputs[q].add(j as usize));
                    q += 1;
                }
                let w0 = ld_pack(partial.add(wide * j as usize));
                let w1 = if wide == 2 {
                    ld_pack(partial.add(wide * j as usize + 1))
                } else {
                    [0; 4]
                };
                let mut acc = partial_from_packs([w0, w1]);
                let mut q = 0;
                while q < N - h {
                    accumulate::<E>(&mut acc, v[q]);
                    q += 1;
                }
                let sum = E::pack(&acc);
                st_pack(out_r.add(j as usize), sum);
                st_pack(back.add(j as usize), sum);
            }
            j += stride;
        }
        let mut k = 1;
        while k < size {
            let dst = (zone_of(first + (idx + k) % size) + part(r) + layout.gather()) as *mut Pack;
            // SAFETY: packs 0 .. len of the output from `rs` (each thread
            // reads the packs it wrote) and of the peer's gather region.
            unsafe { copy_range_keep(out_r, dst, 0, len, g, stride) };
            k += 1;
        }
    }

    // SAFETY: as for `Start`; `Back` publishes step 3's writes.
    let ok = unsafe {
        block_barrier::<N>(
            a,
            Algorithm::PushIslands,
            own_sig,
            rank,
            block,
            BarrierKind::Back,
            epoch,
        )
    };
    if !ok {
        return;
    }

    if !in_a {
        // Step 4 (B): the other partitions, from the island's owners.
        let mut q = 0;
        while q < h {
            if q != idx {
                let (ps, pe) = bounds(q);
                let src = (zone + part(h + q) + layout.gather()) as *const Pack;
                // SAFETY: packs 0 .. pe - ps <= layout.half of the owner's
                // gather region (filled before its published `Back`) and
                // of the output from `ps` (pe <= s.packs).
                unsafe { copy_range(src, out_p.add(ps as usize), 0, pe - ps, g, stride) };
            }
            q += 1;
        }
        return;
    }

    // Step 4 (A): the reduced partition i, from this rank's zone into its
    // output and, staged, into its island peers' zones.
    let result = (zone + part(counterpart) + layout.scatter()) as *const Pack;
    // SAFETY: packs 0 .. len of the counterpart's result (filled before its
    // published `Back`) and of the output from `rs`.
    unsafe { copy_range(result, out_r, 0, len, g, stride) };
    let mut k = 1;
    while k < h {
        let dst = (zone_of((idx + k) % h) + part(r) + layout.gather()) as *mut Pack;
        // SAFETY: packs 0 .. len of the result and of the peer's gather
        // region.
        unsafe { copy_range_keep(result, dst, 0, len, g, stride) };
        k += 1;
    }
    if h == 1 {
        return;
    }

    // SAFETY: as for `Start`, among A's ranks 0..h, all of which run this
    // (h <= N); `Relay` publishes the relayed partitions.
    let ok = unsafe {
        block_barrier_among::<N>(
            a,
            Algorithm::PushIslands,
            own_sig,
            rank,
            block,
            BarrierKind::Relay,
            epoch,
            0,
            h as u32,
        )
    };
    if !ok {
        return;
    }

    // Step 5 (A): the other partitions, relayed by the island's owners.
    let mut q = 0;
    while q < h {
        if q != idx {
            let (ps, pe) = bounds(q);
            let src = (zone + part(q) + layout.gather()) as *const Pack;
            // SAFETY: packs 0 .. pe - ps <= layout.half of the owner's
            // gather region (filled before its published `Relay`) and of
            // the output from `ps`.
            unsafe { copy_range(src, out_p.add(ps as usize), 0, pe - ps, g, stride) };
        }
        q += 1;
    }
}

push_entries! {
    allreduce_push_islands;
    allreduce_push_islands_f32_w1, allreduce_push_islands_f32_w1_virtual: F32, 1;
    allreduce_push_islands_f32_w2, allreduce_push_islands_f32_w2_virtual: F32, 2;
    allreduce_push_islands_f32_w3, allreduce_push_islands_f32_w3_virtual: F32, 3;
    allreduce_push_islands_f32_w4, allreduce_push_islands_f32_w4_virtual: F32, 4;
    allreduce_push_islands_f32_w5, allreduce_push_islands_f32_w5_virtual: F32, 5;
    allreduce_push_islands_f32_w6, allreduce_push_islands_f32_w6_virtual: F32, 6;
    allreduce_push_islands_f32_w7, allreduce_push_islands_f32_w7_virtual: F32, 7;
    allreduce_push_islands_f32_w8, allreduce_push_islands_f32_w8_virtual: F32, 8;
    allreduce_push_islands_f16_w1, allreduce_push_islands_f16_w1_virtual: F16, 1;
    allreduce_push_islands_f16_w2, allreduce_push_islands_f16_w2_virtual: F16, 2;
    allreduce_push_islands_f16_w3, allreduce_push_islands_f16_w3_virtual: F16, 3;
    allreduce_push_islands_f16_w4, allreduce_push_islands_f16_w4_virtual: F16, 4;
    allreduce_push_islands_f16_w5, allreduce_push_islands_f16_w5_virtual: F16, 5;
    allreduce_push_islands_f16_w6, allreduce_push_islands_f16_w6_virtual: F16, 6;
    allreduce_push_islands_f16_w7, allreduce_push_islands_f16_w7_virtual: F16, 7;
    allreduce_push_islands_f16_w8, allreduce_push_islands_f16_w8_virtual: F16, 8;
    allreduce_push_islands_bf16_w1, allreduce_push_islands_bf16_w1_virtual: Bf16, 1;
    allreduce_push_islands_bf16_w2, allreduce_push_islands_bf16_w2_virtual: Bf16, 2;
    allreduce_push_islands_bf16_w3, allreduce_push_islands_bf16_w3_virtual: Bf16, 3;
    allreduce_push_islands_bf16_w4, allreduce_push_islands_bf16_w4_virtual: Bf16, 4;
    allreduce_push_islands_bf16_w5, allreduce_push_islands_bf16_w5_virtual: Bf16, 5;
    allreduce_push_islands_bf16_w6, allreduce_push_islands_bf16_w6_virtual: Bf16, 6;
    allreduce_push_islands_bf16_w7, allreduce_push_islands_bf16_w7_virtual: Bf16, 7;
    allreduce_push_islands_bf16_w8, allreduce_push_islands_bf16_w8_virtual: Bf16, 8;
}
