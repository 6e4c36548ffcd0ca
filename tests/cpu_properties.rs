//! Property tests of the kernels' pure pieces against the CPU oracle. No GPU.
//!
//! The kernel model below is assembled only from the device crate's pure
//! functions (`reduce_pack`, `reduce_scalar`, `split`, `partition`, the
//! `Element` conversions), fed with rank data laid out byte for byte as in
//! GPU memory, and walked with the kernels' grid-stride decomposition. One
//! case generator ([`case`]) is swept over dtype x algorithm x world x length
//! x launch grid; every case is checked against `p2p_allreduce::reference`,
//! which is written independently of the device crate.

use std::fmt;

use p2p_allreduce::abi::{island_split, Algorithm, Dtype, MAX_BLOCKS, MAX_RANKS, PACK_BYTES};
use p2p_allreduce::device::numeric::{
    bf16_bits_from_f32, bf16x2_from_f32, f16_bits_from_f32, f16x2_from_f32, f16x2_to_f32,
    f32_from_f16_bits, Bf16, Element, Pack, F16, F32,
};
use p2p_allreduce::device::reduce::{
    accumulate, partial_from_packs, partial_to_packs, partition, reduce_pack, reduce_pack_dyn,
    reduce_scalar, split,
};
use p2p_allreduce::ll;
use p2p_allreduce::reference::{self, as_slices, fmt_bits, values};
use proptest::prelude::*;
use proptest::sample::select;

// ---------------------------------------------------------------------------
// Cases

/// One allreduce to model: what is reduced, by how many ranks, with which
/// algorithm, and on which launch grid.
#[derive(Clone, Debug)]
struct Case {
    dtype: Dtype,
    algo: Algorithm,
    world: usize,
    len: usize,
    seed: u64,
    specials: bool,
    grid: Grid,
}

/// The part of the launch shape that decides which thread touches which
/// pack: `blocks` x `threads` threads per rank, grid-stride loops.
#[derive(Clone, Copy, Debug)]
struct Grid {
    blocks: usize,
    threads: usize,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} world={} len={} seed={:#x} specials={} grid={}x{}",
            self.dtype.name(),
            self.algo.name(),
            self.world,
            self.len,
            self.seed,
            self.specials,
            self.grid.blocks,
            self.grid.threads
        )
    }
}

impl Case {
    fn inputs(&self) -> Vec<Vec<u32>> {
        values::adversarial_inputs(self.dtype, self.world, self.len, self.seed, self.specials)
    }
}

/// Lengths around every boundary the decomposition has: empty, shorter
/// than one pack, whole packs plus or minus one element, and a spread of
/// sizes that give partitions of unequal length.
fn small_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0usize..=40,
        3 => (1usize..800, -1isize..=1).prop_map(|(k, d)| (k as isize * 8 + d) as usize),
        2 => (1usize..400).prop_map(|k| 2 * k + 1),
        2 => 0usize..20_000,
    ]
}

/// About a million elements, odd and not a multiple of any pack width.
fn large_len() -> impl Strategy<Value = usize> {
    (0usize..64).prop_map(|k| (1 << 20) - 64 + 2 * k + 1)
}

fn grid() -> impl Strategy<Value = Grid> {
    // Whole warps, as every real launch uses; the blocks range covers the
    // signal layout's limit.
    (
        1usize..=MAX_BLOCKS,
        select(vec![32usize, 64, 128, 256, 512, 1024]),
    )
        .prop_map(|(blocks, threads)| Grid { blocks, threads })
}

/// The one case generator every model property is swept with.
fn case(len: impl Strategy<Value = usize>) -> impl Strategy<Value = Case> {
    (
        select(Dtype::ALL.to_vec()),
        select(Algorithm::ALL.to_vec()),
        1usize..=MAX_RANKS,
        len,
        any::<u64>(),
        prop::bool::weighted(0.7),
        grid(),
    )
        .prop_map(|(dtype, algo, world, len, seed, specials, grid)| Case {
            dtype,
            algo,
            world,
            len,
            seed,
            specials,
            grid,
        })
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // The case's own seed reproduces it; no regression files in the tree.
        failure_persistence: None,
        max_shrink_iters: 200,
        ..ProptestConfig::default()
    }
}

/// For cases of a million elements: shrinking would rerun them hundreds of
/// times, and the failure message already names the case and element.
fn config_no_shrink(cases: u32) -> ProptestConfig {
    ProptestConfig {
        max_shrink_iters: 0,
        ..config(cases)
    }
}

// ---------------------------------------------------------------------------
// GPU memory images

/// Rank data as the bytes a GPU buffer holds: elements little-endian, one
/// after the other (for 16-bit types, element 2k in the low half of word k).
fn to_bytes(dtype: Dtype, elems: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(elems.len() * dtype.size());
    for &e in elems {
        match dtype.size() {
            4 => out.extend_from_slice(&e.to_le_bytes()),
            _ => out.extend_from_slice(&(e as u16).to_le_bytes()),
        }
    }
    out
}

fn from_bytes(dtype: Dtype, bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match c.len() {
            4 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            _ => u16::from_le_bytes([c[0], c[1]]) as u32,
        })
        .collect()
}

/// Pack `i` as a 16-byte vector load sees it: four little-endian words.
fn load_pack(buf: &[u8], i: u64) -> Pack {
    let b = &buf[i as usize * PACK_BYTES..][..PACK_BYTES];
    core::array::from_fn(|k| {
        u32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]])
    })
}

fn store_pack(buf: &mut [u8], i: u64, p: Pack) {
    let b = &mut buf[i as usize * PACK_BYTES..][..PACK_BYTES];
    for (k, w) in p.iter().enumerate() {
        b[4 * k..4 * k + 4].copy_from_slice(&w.to_le_bytes());
    }
}

fn load_elem<E: Element>(buf: &[u8], idx: u64) -> u32 {
    let s = E::DTYPE.size();
    from_bytes(E::DTYPE, &buf[idx as usize * s..][..s])[0]
}

fn store_elem<E: Element>(buf: &mut [u8], idx: u64, bits: u32) {
    let s = E::DTYPE.size();
    buf[idx as usize * s..][..s].copy_from_slice(&to_bytes(E::DTYPE, &[bits]));
}

// ---------------------------------------------------------------------------
// The kernel model

/// `reduce_pack` with the world size as a constant, as the kernels call it,
/// cross-checked against the run-time-world variant.
fn reduce_packs<E: Element>(packs: &[Pack]) -> Pack {
    fn fixed<E: Element, const N: usize>(packs: &[Pack]) -> Pack {
        reduce_pack::<E, N>(packs.try_into().expect("world size"))
    }
    let p = match packs.len() {
        1 => fixed::<E, 1>(packs),
        2 => fixed::<E, 2>(packs),
        3 => fixed::<E, 3>(packs),
        4 => fixed::<E, 4>(packs),
        5 => fixed::<E, 5>(packs),
        6 => fixed::<E, 6>(packs),
        7 => fixed::<E, 7>(packs),
        8 => fixed::<E, 8>(packs),
        n => panic!("world {n} is outside 1..=8"),
    };
    let d = reduce_pack_dyn::<E>(packs);
    // Same values lane by lane; NaN payloads may differ, because an optimised
    // build is free to swap the operands of an addition (the contract is
    // payload-free too).
    let (pw, dw) = (E::unpack(p), E::unpack(d));
    let same = pw
        .iter()
        .zip(dw.iter())
        .take(E::LANES)
        .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
    assert!(
        same,
        "reduce_pack and reduce_pack_dyn differ on {packs:x?}: {p:x?} vs {d:x?}"
    );
    p
}

/// Order in which a partition owner adds its peers' packs. The kernels must
/// use `RankOrder`; `Rotated` is the two-stage order of other custom
/// allreduce implementations, kept to prove the checks catch it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum AddOrder {
    RankOrder,
    Rotated,
}

/// Runs one allreduce on memory images of the ranks' inputs and returns
/// every rank's output image.
fn model<E: Element>(
    algo: Algorithm,
    grid: Grid,
    inputs: &[Vec<u8>],
    order: AddOrder,
) -> Vec<Vec<u8>> {
    let n = inputs.len();
    let lanes = E::LANES as u64;
    let bytes = inputs[0].len();
    let count = (bytes / E::DTYPE.size()) as u64;
    let s = split(count, lanes);
    assert_eq!(
        s.packs * lanes + s.tail,
        count,
        "split({count}, {lanes}) = {s:?}"
    );
    assert!(s.tail < lanes, "split({count}, {lanes}) = {s:?}");
    let stride = (grid.blocks * grid.threads) as u64;
    let reduce_at = |i: u64, owner: usize| -> Pack {
        let mut v: Vec<Pack> = inputs.iter().map(|x| load_pack(x, i)).collect();
        if order == AddOrder::Rotated {
            v.rotate_left(owner);
        }
        reduce_packs::<E>(&v)
    };
    // The scalar tail: thread g < tail of the grid reduces element g of it.
    let tail = |out: &mut [u8]| {
        for g in 0..stride.min(s.tail) {
            let idx = s.packs * lanes + g;
            let v = reduce_scalar::<E>(inputs.iter().map(|x| load_elem::<E>(x, idx)));
            store_elem::<E>(out, idx, v);
        }
    };
    // Every output byte starts as garbage that no valid result has, so a
    // pack nobody wrote shows up as a mismatch.
    let fresh = || vec![0xa5u8; bytes];
    let mut outputs = Vec::with_capacity(n);
    match algo {
        Algorithm::OneStage | Algorithm::Push => {
            // Every rank runs the same arithmetic on the same inputs, the
            // rank enters nowhere: compute rank 0's output once. (Push
            // moves the inputs into landing zones first; the values and the
            // per-pack reduction are one-stage's.)
            let mut out = fresh();
            for g in 0..stride {
                let mut i = g;
                while i < s.packs {
                    store_pack(&mut out, i, reduce_at(i, 0));
                    i += stride;
                }
            }
            tail(&mut out);
            outputs = vec![out; n];
        }
        Algorithm::PushLl => {
            // Thread g owns packs g, g + stride, ...: each travels as
            // flag-in-data lines (the last one zero-padded past `count`),
            // is decoded by the receiver, reduced in rank order, and only
            // its elements below `count` are stored.
            // Epoch 7 under a call tag whose four bytes differ.
            let epoch = p2p_allreduce::abi::ll_highs(
                7,
                &p2p_allreduce::abi::LaunchArgs {
                    call_tag: 0x1234_5678,
                    ..Default::default()
                },
                0,
            );
            let packs = count.div_ceil(lanes);
            let mut out = fresh();
            for g in 0..stride {
                let mut i = g;
                while i < packs {
                    let v: Vec<Pack> = inputs
                        .iter()
                        .map(|x| {
                            let mut p = [0u32; 4];
                            for k in 0..lanes.min(count - i * lanes) {
                                let bits = load_elem::<E>(x, i * lanes + k);
                                if lanes == 4 {
                                    p[k as usize] = bits;
                                } else {
                                    p[(k / 2) as usize] |= bits << (16 * (k % 2));
                                }
                            }
                            ll::decode(&ll::encode(p, epoch), epoch).expect("same epoch")
                        })
                        .collect();
                    let r = reduce_packs::<E>(&v);
                    for k in 0..lanes.min(count - i * lanes) {
                        let bits = if lanes == 4 {
                            r[k as usize]
                        } else {
                            (r[(k / 2) as usize] >> (16 * (k % 2))) & 0xffff
                        };
                        store_elem::<E>(&mut out, i * lanes + k, bits);
                    }
                    i += stride;
                }
            }
            outputs = vec![out; n];
        }
        Algorithm::PushTwoStage => {
            // The kernel's data movement: landing parts [owner][source]
            // with a scatter region (the source's share of the owner's
            // partition), a gather region (the source's reduced partition)
            // and a tail pack, each entry remembering the block that wrote
            // it: the Start and Mid barriers are per block, so a reader's
            // block must be the writer's. Regions hold ceil(packs / n)
            // packs, the layout's minimum (`PushTwoStagePart`).
            let half = s.packs.div_ceil(n as u64) as usize;
            type Region = Vec<Option<(Pack, usize)>>;
            let mut scatter: Vec<Vec<Region>> = vec![vec![vec![None; half]; n]; n];
            let mut gather: Vec<Vec<Region>> = vec![vec![vec![None; half]; n]; n];
            let mut tails: Vec<Vec<Vec<Option<u32>>>> =
                vec![vec![vec![None; lanes as usize]; n]; n];
            let block_of = |g: u64| g as usize / grid.threads;
            // Stage 1: each peer's partition into its zone, and the tail.
            for (rank, x) in inputs.iter().enumerate() {
                for k in 1..n {
                    let p = (rank + k) % n;
                    let (ps, pe) = partition(s.packs, n as u32, p as u32);
                    for g in 0..stride {
                        let mut j = g;
                        while ps + j < pe {
                            let cell = &mut scatter[p][rank][j as usize];
                            assert!(cell.is_none(), "scatter pack {j} written twice");
                            *cell = Some((load_pack(x, ps + j), block_of(g)));
                            j += stride;
                        }
                    }
                    for g in 0..stride.min(s.tail) {
                        tails[p][rank][g as usize] = Some(load_elem::<E>(x, s.packs * lanes + g));
                    }
                }
            }
            // Stage 2 (after Start): own partition from own input and zone.
            outputs = vec![fresh(); n];
            for (rank, out) in outputs.iter_mut().enumerate() {
                let (rs, re) = partition(s.packs, n as u32, rank as u32);
                for g in 0..stride {
                    let mut j = g;
                    while rs + j < re {
                        let mut v: Vec<Pack> = (0..n)
                            .map(|src| {
                                if src == rank {
                                    return load_pack(&inputs[rank], rs + j);
                                }
                                let (pk, wb) = scatter[rank][src][j as usize]
                                    .expect("every scatter pack written before Start");
                                assert_eq!(wb, block_of(g), "Start is per block");
                                pk
                            })
                            .collect();
                        if order == AddOrder::Rotated {
                            v.rotate_left(rank);
                        }
                        let r = reduce_packs::<E>(&v);
                        store_pack(out, rs + j, r);
                        for (p, zone) in gather.iter_mut().enumerate() {
                            if p != rank {
                                zone[rank][j as usize] = Some((r, block_of(g)));
                            }
                        }
                        j += stride;
                    }
                }
                for g in 0..stride.min(s.tail) {
                    let idx = s.packs * lanes + g;
                    let v = reduce_scalar::<E>((0..n).map(|src| {
                        if src == rank {
                            load_elem::<E>(&inputs[rank], idx)
                        } else {
                            tails[rank][src][g as usize].expect("tail written before Start")
                        }
                    }));
                    store_elem::<E>(out, idx, v);
                }
            }
            // Stage 3 (after Mid): the peers' partitions from own zone.
            for (rank, out) in outputs.iter_mut().enumerate() {
                for k in 1..n {
                    let p = (rank + k) % n;
                    let (ps, pe) = partition(s.packs, n as u32, p as u32);
                    for g in 0..stride {
                        let mut j = g;
                        while ps + j < pe {
                            let (v, wb) = gather[rank][p][j as usize]
                                .expect("every gather pack written before Mid");
                            assert_eq!(wb, block_of(g), "Mid is per block");
                            store_pack(out, ps + j, v);
                            j += stride;
                        }
                    }
                }
            }
        }
        Algorithm::PushIslands => {
            outputs = model_push_islands::<E>(grid, inputs, order);
        }
        Algorithm::TwoStage => {
            // Stage 1: every rank reduces its own partition into scratch
            // and its output, remembering which block wrote each pack.
            let mut scratch = vec![fresh(); n];
            let mut writer = vec![vec![usize::MAX; s.packs as usize]; n];
            for rank in 0..n {
                let mut out = fresh();
                let (start, end) = partition(s.packs, n as u32, rank as u32);
                for g in 0..stride {
                    let mut i = start + g;
                    while i < end {
                        let v = reduce_at(i, rank);
                        store_pack(&mut scratch[rank], i, v);
                        store_pack(&mut out, i, v);
                        assert_eq!(
                            writer[rank][i as usize],
                            usize::MAX,
                            "pack {i} written twice"
                        );
                        writer[rank][i as usize] = g as usize / grid.threads;
                        i += stride;
                    }
                }
                tail(&mut out);
                outputs.push(out);
            }
            // Stage 2: every rank copies the other partitions from their
            // owners' scratch. The mid barrier is per block, so the block
            // reading a pack must be the block that wrote it.
            for (rank, out) in outputs.iter_mut().enumerate() {
                for k in 1..n {
                    let p = (rank + k) % n;
                    let (start, end) = partition(s.packs, n as u32, p as u32);
                    for g in 0..stride {
                        let mut i = start + g;
                        while i < end {
                            let block = g as usize / grid.threads;
                            assert_eq!(
                                writer[p][i as usize], block,
                                "rank {rank} block {block} reads pack {i} of rank {p}'s scratch, \
                                 written by block {}: the per-block mid barrier would not order it",
                                writer[p][i as usize]
                            );
                            store_pack(out, i, load_pack(&scratch[p], i));
                            i += stride;
                        }
                    }
                }
            }
        }
    }
    outputs
}

/// The data movement of push_islands (device/src/kernels/push_islands.rs),
/// step by step: landing parts `[zone owner][source]` with scatter and
/// gather regions, what crossed into each rank's zone from its
/// counterpart (an unrounded f32 partial into island B, a result into
/// island A), and tail packs, each entry remembering the block that wrote
/// it (every barrier is per block, so a reader's block must be the
/// writer's). `AddOrder::Rotated` stands for the hierarchical order other
/// implementations use: island B sums its own ranks first and adds that
/// to island A's partial, which the contract forbids.
fn model_push_islands<E: Element>(grid: Grid, inputs: &[Vec<u8>], order: AddOrder) -> Vec<Vec<u8>> {
    let n = inputs.len();
    let h = island_split(n);
    let lanes = E::LANES as u64;
    let bytes = inputs[0].len();
    let s = split((bytes / E::DTYPE.size()) as u64, lanes);
    let stride = (grid.blocks * grid.threads) as u64;
    let block_of = |g: u64| g as usize / grid.threads;
    let bounds = |q: usize| partition(s.packs, h as u32, q as u32);
    let island = |r: usize| if r < h { (0, h) } else { (h, n - h) };
    let half = s.packs.div_ceil(h as u64) as usize;
    type Region = Vec<Option<(Pack, usize)>>;
    let mut scatter: Vec<Vec<Region>> = vec![vec![vec![None; half]; n]; n];
    let mut gather: Vec<Vec<Region>> = vec![vec![vec![None; half]; n]; n];
    // What crossed into each rank's zone: f32-bit packs and the writer's block.
    type Crossed = Option<([Pack; 2], usize)>;
    let mut cross: Vec<Vec<Crossed>> = vec![vec![None; half]; n];
    let mut tails: Vec<Vec<Vec<Option<u32>>>> = vec![vec![vec![None; lanes as usize]; n]; n];
    let mut outputs = vec![vec![0xa5u8; bytes]; n];
    // Step 1: island peers' partitions into their zones; tails everywhere.
    for (rank, x) in inputs.iter().enumerate() {
        let (first, size) = island(rank);
        for k in 1..size {
            let q = (rank - first + k) % size;
            if q >= h {
                continue;
            }
            let (ps, pe) = bounds(q);
            for g in 0..stride {
                let mut j = g;
                while ps + j < pe {
                    let cell = &mut scatter[first + q][rank][j as usize];
                    assert!(cell.is_none(), "scatter pack {j} written twice");
                    *cell = Some((load_pack(x, ps + j), block_of(g)));
                    j += stride;
                }
            }
        }
        for (p, zone) in tails.iter_mut().enumerate() {
            if p != rank {
                for g in 0..stride.min(s.tail) {
                    zone[rank][g as usize] = Some(load_elem::<E>(x, s.packs * lanes + g));
                }
            }
        }
    }
    // After Start: the tail, by every rank.
    for (rank, out) in outputs.iter_mut().enumerate() {
        for g in 0..stride.min(s.tail) {
            let idx = s.packs * lanes + g;
            let v = reduce_scalar::<E>((0..n).map(|src| {
                if src == rank {
                    load_elem::<E>(&inputs[rank], idx)
                } else {
                    tails[rank][src][g as usize].expect("tail written before Start")
                }
            }));
            store_elem::<E>(out, idx, v);
        }
    }
    if n == 1 {
        for i in 0..s.packs {
            store_pack(
                &mut outputs[0],
                i,
                reduce_packs::<E>(&[load_pack(&inputs[0], i)]),
            );
        }
        return outputs;
    }
    // A pack of island peer `src`'s share, as rank `rank` reads it.
    let landed = |scatter: &[Vec<Region>], rank: usize, src: usize, start: u64, j: u64, g: u64| {
        if src == rank {
            return load_pack(&inputs[rank], start + j);
        }
        let (pk, wb) = scatter[rank][src][j as usize].expect("scatter written before Start");
        assert_eq!(wb, block_of(g), "Start is per block");
        pk
    };
    // Step 2 (A): partition i over ranks 0..h, unrounded, across.
    for rank in 0..h {
        let (rs, re) = bounds(rank);
        for g in 0..stride {
            let mut j = g;
            while rs + j < re {
                let mut acc = E::unpack(landed(&scatter, rank, 0, rs, j, g));
                for src in 1..h {
                    accumulate::<E>(&mut acc, landed(&scatter, rank, src, rs, j, g));
                }
                cross[rank + h][j as usize] = Some((partial_to_packs(&acc), block_of(g)));
                j += stride;
            }
        }
    }
    // After Mid, step 3 (B owners): on from the partial over ranks h..n.
    for rank in h..2 * h {
        let i = rank - h;
        let (rs, re) = bounds(i);
        for g in 0..stride {
            let mut j = g;
            while rs + j < re {
                let (w, wb) = cross[rank][j as usize].expect("partial written before Mid");
                assert_eq!(wb, block_of(g), "Mid is per block");
                let mut acc = partial_from_packs(w);
                let mine: Vec<Pack> = (h..n)
                    .map(|src| landed(&scatter, rank, src, rs, j, g))
                    .collect();
                match order {
                    AddOrder::RankOrder => {
                        for p in &mine {
                            accumulate::<E>(&mut acc, *p);
                        }
                    }
                    AddOrder::Rotated => {
                        let mut island_sum = E::unpack(mine[0]);
                        for p in &mine[1..] {
                            accumulate::<E>(&mut island_sum, *p);
                        }
                        for (a, b) in acc.iter_mut().zip(island_sum) {
                            *a += b;
                        }
                    }
                }
                let sum = E::pack(&acc);
                store_pack(&mut outputs[rank], rs + j, sum);
                cross[i][j as usize] = Some(([sum, [0; 4]], block_of(g)));
                for (q, zone) in gather.iter_mut().enumerate().skip(h) {
                    if q != rank {
                        zone[rank][j as usize] = Some((sum, block_of(g)));
                    }
                }
                j += stride;
            }
        }
    }
    // After Back, step 4: B copies the other partitions; A takes its own
    // from across and relays it within A.
    for (rank, out) in outputs.iter_mut().enumerate() {
        if rank >= h {
            for q in (0..h).filter(|&q| h + q != rank) {
                let (ps, pe) = bounds(q);
                for g in 0..stride {
                    let mut j = g;
                    while ps + j < pe {
                        let (v, wb) = gather[rank][h + q][j as usize].expect("gather before Back");
                        assert_eq!(wb, block_of(g), "Back is per block");
                        store_pack(out, ps + j, v);
                        j += stride;
                    }
                }
            }
            continue;
        }
        let (rs, re) = bounds(rank);
        for g in 0..stride {
            let mut j = g;
            while rs + j < re {
                let (w, wb) = cross[rank][j as usize].expect("result written before Back");
                assert_eq!(wb, block_of(g), "Back is per block");
                store_pack(out, rs + j, w[0]);
                for (p, zone) in gather.iter_mut().enumerate().take(h) {
                    if p != rank {
                        zone[rank][j as usize] = Some((w[0], block_of(g)));
                    }
                }
                j += stride;
            }
        }
    }
    // After Relay (island A): the partitions its peers relayed.
    for (rank, out) in outputs.iter_mut().enumerate().take(h) {
        for q in (0..h).filter(|&q| q != rank) {
            let (ps, pe) = bounds(q);
            for g in 0..stride {
                let mut j = g;
                while ps + j < pe {
                    let (v, wb) = gather[rank][q][j as usize].expect("relayed before Relay");
                    assert_eq!(wb, block_of(g), "Relay is per block");
                    store_pack(out, ps + j, v);
                    j += stride;
                }
            }
        }
    }
    outputs
}

/// [`model`] on element bits, dispatched on the dtype; every rank's result.
fn run_model(case: &Case, inputs: &[Vec<u32>], algo: Algorithm, order: AddOrder) -> Vec<Vec<u32>> {
    let images: Vec<Vec<u8>> = inputs.iter().map(|x| to_bytes(case.dtype, x)).collect();
    let outs = match case.dtype {
        Dtype::F32 => model::<F32>(algo, case.grid, &images, order),
        Dtype::F16 => model::<F16>(algo, case.grid, &images, order),
        Dtype::Bf16 => model::<Bf16>(algo, case.grid, &images, order),
    };
    outs.iter().map(|o| from_bytes(case.dtype, o)).collect()
}

/// Checks `got` against the oracle; the failure names the case, the
/// element, both values, every rank's input and the f64 sum.
fn check_oracle(
    case: &Case,
    what: &str,
    inputs: &[Vec<u32>],
    got: &[u32],
) -> Result<(), TestCaseError> {
    let want = reference::allreduce_bits(case.dtype, &as_slices(inputs));
    prop_assert_eq!(got.len(), want.len(), "{}: {}: result length", case, what);
    if let Some((i, g, w)) = reference::first_mismatch(case.dtype, got, &want) {
        let column: Vec<String> = inputs.iter().map(|x| fmt_bits(case.dtype, x[i])).collect();
        return Err(TestCaseError::fail(format!(
            "{case}: {what}: element {i}: got {}, want {}; inputs by rank {column:?}, f64 sum {:e}",
            fmt_bits(case.dtype, g),
            fmt_bits(case.dtype, w),
            reference::element_sum_f64(case.dtype, &as_slices(inputs), i),
        )));
    }
    Ok(())
}

/// Every rank must hold the same bits (exactly: same code, same inputs).
fn check_ranks_identical(case: &Case, outs: &[Vec<u32>]) -> Result<(), TestCaseError> {
    for (r, o) in outs.iter().enumerate().skip(1) {
        if let Some(i) = (0..o.len()).find(|&i| o[i] != outs[0][i]) {
            return Err(TestCaseError::fail(format!(
                "{case}: rank {r} element {i} is {} but rank 0 has {}",
                fmt_bits(case.dtype, o[i]),
                fmt_bits(case.dtype, outs[0][i])
            )));
        }
    }
    Ok(())
}

fn check_model(case: &Case) -> Result<(), TestCaseError> {
    let inputs = case.inputs();
    let outs = run_model(case, &inputs, case.algo, AddOrder::RankOrder);
    check_ranks_identical(case, &outs)?;
    check_oracle(case, "rank 0", &inputs, &outs[0])
}

fn check_algorithms_agree(case: &Case) -> Result<(), TestCaseError> {
    let inputs = case.inputs();
    let one = run_model(case, &inputs, Algorithm::OneStage, AddOrder::RankOrder);
    let two = run_model(case, &inputs, Algorithm::TwoStage, AddOrder::RankOrder);
    for (r, (a, b)) in one.iter().zip(&two).enumerate() {
        if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
            return Err(TestCaseError::fail(format!(
                "{case}: rank {r} element {i}: one-stage {} but two-stage {}",
                fmt_bits(case.dtype, a[i]),
                fmt_bits(case.dtype, b[i])
            )));
        }
    }
    check_oracle(case, "one-stage", &inputs, &one[0])
}

// ---------------------------------------------------------------------------
// Model properties

proptest! {
    #![proptest_config(config(320))]

    /// Both algorithms, every world size and length: the model equals the
    /// oracle bit for bit on every rank.
    #[test]
    fn kernel_model_matches_oracle(case in case(small_len())) {
        check_model(&case)?;
    }

    /// One-stage and two-stage give identical bits (the case's own algorithm
    /// is not used: both are run).
    #[test]
    fn one_stage_equals_two_stage(case in case(small_len())) {
        check_algorithms_agree(&case)?;
    }

    /// Element i's result is the same whatever the message length, and
    /// whichever algorithm each length would be dispatched to.
    #[test]
    fn result_does_not_depend_on_length(
        case in case(small_len()),
        cut in 0.0f64..=1.0,
        prefix_algo in select(Algorithm::ALL.to_vec()),
    ) {
        let inputs = case.inputs();
        let prefix_len = (case.len as f64 * cut) as usize;
        let prefix: Vec<Vec<u32>> = inputs.iter().map(|x| x[..prefix_len].to_vec()).collect();
        let full = run_model(&case, &inputs, case.algo, AddOrder::RankOrder);
        let short = run_model(&case, &prefix, prefix_algo, AddOrder::RankOrder);
        // Same value (NaN matches any NaN, as the contract says): in an
        // optimised build the pack and tail paths may pick different NaN
        // payloads.
        for i in 0..prefix_len {
            prop_assert!(
                reference::same_value(case.dtype, short[0][i], full[0][i]),
                "{}: element {} is {} at length {} ({}) but {} at length {}",
                case, i, fmt_bits(case.dtype, short[0][i]), prefix_len, prefix_algo.name(),
                fmt_bits(case.dtype, full[0][i]), case.len
            );
        }
    }
}

proptest! {
    // Each case is ~1M elements on up to 8 ranks: a few are enough to cover
    // long grid-stride loops and large partitions.
    #![proptest_config(config_no_shrink(3))]

    #[test]
    fn kernel_model_matches_oracle_large(case in case(large_len())) {
        check_algorithms_agree(&case)?;
    }
}

/// The checks above can fail: the rank-rotated two-stage order of other
/// implementations is caught on every dtype (in both two-stage algorithms),
/// so is the island-sums-first order of other hierarchical ones
/// (push_islands), and so is one corrupted element.
#[test]
fn rotated_two_stage_order_is_detected() {
    for (dtype, algo) in Dtype::ALL.into_iter().flat_map(|d| {
        [
            (d, Algorithm::TwoStage),
            (d, Algorithm::PushTwoStage),
            (d, Algorithm::PushIslands),
        ]
    }) {
        let case = Case {
            dtype,
            algo,
            world: 4,
            len: 4096 + 3,
            seed: 1,
            specials: false,
            grid: Grid {
                blocks: 2,
                threads: 64,
            },
        };
        let inputs = case.inputs();
        let outs = run_model(&case, &inputs, case.algo, AddOrder::Rotated);
        let verdict = check_oracle(&case, "rotated", &inputs, &outs[0]);
        assert!(verdict.is_err(), "{case}: rotated order went unnoticed");
        let good = run_model(&case, &inputs, case.algo, AddOrder::RankOrder);
        assert!(
            check_oracle(&case, "rank order", &inputs, &good[0]).is_ok(),
            "{case}"
        );
        let mut broken = good[0].clone();
        let last = broken.len() - 1;
        broken[last] = if reference::is_nan(dtype, good[0][last]) {
            0
        } else {
            good[0][last] ^ 1
        };
        assert!(
            check_oracle(&case, "corrupted", &inputs, &broken).is_err(),
            "{case}"
        );
    }
}

// ---------------------------------------------------------------------------
// Work decomposition

/// The partition invariants for one (packs, world).
fn check_partition(packs: u64, world: u32) -> Result<(), String> {
    let mut expected_start = 0;
    let (lo, hi) = (packs / world as u64, packs.div_ceil(world as u64));
    for p in 0..world {
        let (s, e) = partition(packs, world, p);
        let ctx = || format!("partition({packs}, {world}, {p}) = ({s}, {e})");
        if s != expected_start {
            return Err(format!(
                "{}: does not start where part {} ended ({expected_start})",
                ctx(),
                p as i64 - 1
            ));
        }
        if e < s || e - s < lo || e - s > hi {
            return Err(format!(
                "{}: length {} outside [{lo}, {hi}]",
                ctx(),
                e.wrapping_sub(s)
            ));
        }
        expected_start = e;
    }
    if expected_start != packs {
        return Err(format!(
            "partitions of {packs} packs for world {world} end at {expected_start}"
        ));
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(4000))]

    #[test]
    fn partitions_tile_the_packs(packs in 0u64..=10_000_000, world in 1u32..=MAX_RANKS as u32) {
        check_partition(packs, world).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn split_is_packs_plus_short_tail(count in any::<u64>(), lanes in select(vec![4u64, 8])) {
        let s = split(count, lanes);
        prop_assert!(s.tail < lanes, "split({}, {}) = {:?}", count, lanes, s);
        prop_assert_eq!(s.packs as u128 * lanes as u128 + s.tail as u128, count as u128,
            "split({}, {}) = {:?}", count, lanes, s);
    }
}

/// Exhaustive for small sizes, with an explicit coverage count per pack.
#[test]
fn partitions_cover_every_pack_once_exhaustive() {
    for world in 1..=MAX_RANKS as u32 {
        for packs in 0..=600u64 {
            check_partition(packs, world).unwrap();
            let mut seen = vec![0u8; packs as usize];
            for p in 0..world {
                let (s, e) = partition(packs, world, p);
                for i in s..e {
                    seen[i as usize] += 1;
                }
            }
            let bad = seen.iter().position(|&c| c != 1);
            assert_eq!(
                bad, None,
                "world {world} packs {packs}: pack covered {seen:?}"
            );
        }
    }
    // Sizes near the top of the range the property test samples.
    for world in 1..=MAX_RANKS as u32 {
        for packs in [9_999_993, 9_999_999, 10_000_000, u32::MAX as u64 + 7] {
            check_partition(packs, world).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------
// Host conversions against the `half` crate

fn all_16_bit_patterns() -> impl Iterator<Item = u16> {
    0..=u16::MAX
}

#[test]
fn f16_widening_matches_half_for_all_bit_patterns() {
    for h in all_16_bit_patterns() {
        let want = half::f16::from_bits(h).to_f32();
        for (what, got) in [
            ("f32_from_f16_bits", f32_from_f16_bits(h)),
            ("F16::to_f32", F16::to_f32(h as u32)),
            ("f16x2_to_f32 low", f16x2_to_f32(h as u32).0),
            (
                "f16x2_to_f32 high",
                f16x2_to_f32((h as u32) << 16 | 0x3c00).1,
            ),
        ] {
            if want.is_nan() {
                assert!(got.is_nan(), "{what}({h:#06x}) = {got:e}, want NaN");
            } else {
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{what}({h:#06x}) = {got:e}, want {want:e}"
                );
            }
        }
    }
}

#[test]
fn bf16_widening_matches_half_for_all_bit_patterns() {
    for h in all_16_bit_patterns() {
        let want = half::bf16::from_bits(h).to_f32();
        let got = Bf16::to_f32(h as u32);
        if want.is_nan() {
            assert!(got.is_nan(), "Bf16::to_f32({h:#06x}) = {got:e}, want NaN");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "Bf16::to_f32({h:#06x})");
        }
    }
}

/// Lane order inside a pack: element 2k in the low half of word k, for
/// widening and rounding alike.
#[test]
fn pack_lanes_are_in_memory_order() {
    for base in (0..=u16::MAX as u32).step_by(8) {
        let elems: Vec<u32> = (base..base + 8).collect();
        for dtype in [Dtype::F16, Dtype::Bf16] {
            let p = load_pack(&to_bytes(dtype, &elems), 0);
            let (lanes, one): ([f32; 8], fn(u32) -> f32) = match dtype {
                Dtype::F16 => (F16::unpack(p), F16::to_f32),
                _ => (Bf16::unpack(p), Bf16::to_f32),
            };
            for l in 0..8 {
                let want = one(elems[l]);
                assert!(
                    lanes[l].to_bits() == want.to_bits() || (lanes[l].is_nan() && want.is_nan()),
                    "{} unpack lane {l} of {elems:x?}: {:e}, want {want:e}",
                    dtype.name(),
                    lanes[l]
                );
            }
            // Round trip through pack: exact for every non-NaN element.
            let back = match dtype {
                Dtype::F16 => F16::pack(&lanes),
                _ => Bf16::pack(&lanes),
            };
            let mut img = vec![0u8; 16];
            store_pack(&mut img, 0, back);
            let got = from_bytes(dtype, &img);
            for l in 0..8 {
                assert!(
                    reference::same_value(dtype, got[l], elems[l]),
                    "{} pack(unpack) lane {l}: {:#06x}, want {:#06x}",
                    dtype.name(),
                    got[l],
                    elems[l]
                );
            }
        }
    }
    let f = [1.0f32, -2.0, 3.5, -0.0, 9.0, 9.0, 9.0, 9.0];
    let p = F32::pack(&f);
    assert_eq!(
        p,
        [
            f[0].to_bits(),
            f[1].to_bits(),
            f[2].to_bits(),
            f[3].to_bits()
        ]
    );
    assert_eq!(F32::unpack(p)[..4], f[..4]);
}

/// Compares the device crate's f32 -> f16/bf16 rounding with `half` for one
/// input. NaN only needs to stay NaN.
fn check_narrowing(x: f32) -> Result<(), String> {
    let checks: [(&str, u32, u32, bool); 6] = [
        (
            "f16_bits_from_f32",
            f16_bits_from_f32(x) as u32,
            half::f16::from_f32(x).to_bits() as u32,
            true,
        ),
        (
            "F16::from_f32",
            F16::from_f32(x),
            half::f16::from_f32(x).to_bits() as u32,
            true,
        ),
        (
            "f16x2_from_f32 high",
            f16x2_from_f32(1.0, x) >> 16,
            half::f16::from_f32(x).to_bits() as u32,
            true,
        ),
        (
            "bf16_bits_from_f32",
            bf16_bits_from_f32(x) as u32,
            half::bf16::from_f32(x).to_bits() as u32,
            false,
        ),
        (
            "Bf16::from_f32",
            Bf16::from_f32(x),
            half::bf16::from_f32(x).to_bits() as u32,
            false,
        ),
        (
            "bf16x2_from_f32 low",
            bf16x2_from_f32(x, 1.0) & 0xffff,
            half::bf16::from_f32(x).to_bits() as u32,
            false,
        ),
    ];
    for (what, got, want, is_f16) in checks {
        let dtype = if is_f16 { Dtype::F16 } else { Dtype::Bf16 };
        let ok = if x.is_nan() {
            reference::is_nan(dtype, got)
        } else {
            got == want
        };
        if !ok {
            return Err(format!(
                "{what}({:e} = {:#010x}) = {}, want {}",
                x,
                x.to_bits(),
                fmt_bits(dtype, got),
                fmt_bits(dtype, want)
            ));
        }
    }
    Ok(())
}

/// Every tie between two neighbouring values of each type, the f32 values
/// on either side of it, and the values themselves: all of round to
/// nearest even, at every binade, subnormals and the overflow edge included.
#[test]
fn narrowing_matches_half_at_every_tie() {
    for dtype in [Dtype::F16, Dtype::Bf16] {
        let widen = |h: u16| reference::widen(dtype, h as u32);
        let inf = widen(if dtype == Dtype::F16 { 0x7c00 } else { 0x7f80 });
        let mut checked = 0;
        for h in 0..=0x7fffu16 {
            let a = widen(h);
            if !a.is_finite() {
                continue;
            }
            // The next value up; past the largest finite one, the tie with
            // infinity sits where the next binade would begin.
            let b = widen(h + 1);
            let b = if b == inf { a + (a - widen(h - 1)) } else { b };
            let mid = ((a as f64 + b as f64) / 2.0) as f32;
            assert_eq!(
                mid as f64,
                (a as f64 + b as f64) / 2.0,
                "midpoint of {h:#06x} not exact in f32"
            );
            // Positive, so the bit neighbours are the value neighbours.
            let (below, above) = (
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            );
            for x in [a, mid, below, above] {
                for v in [x, -x] {
                    check_narrowing(v).unwrap();
                    checked += 1;
                }
            }
        }
        assert!(checked > 200_000, "{checked}");
    }
}

#[test]
fn narrowing_matches_half_on_edges_and_a_sweep_of_all_f32() {
    let edges = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffbf_ffff),
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        f32::from_bits(0x007f_ffff),
        65504.0,
        65519.996,
        65520.0,
        65536.0,
        2f32.powi(-24),
        2f32.powi(-25),
        f32::from_bits(2f32.powi(-25).to_bits() + 1),
        2f32.powi(-14),
        f32::from_bits(2f32.powi(-14).to_bits() - 1),
        3.389_531_4e38, // bf16::MAX
        3.395_313e38,   // bf16::MAX + half an ulp: the tie with infinity
    ];
    for x in edges {
        check_narrowing(x).unwrap();
    }
    // A stride coprime with 2^32 through every f32 bit pattern: ~1M values,
    // every exponent, many mantissas.
    let mut bits = 0u32;
    for _ in 0..(1u32 << 20) {
        check_narrowing(f32::from_bits(bits)).unwrap();
        bits = bits.wrapping_add(4099);
    }
}

proptest! {
    #![proptest_config(config(20_000))]

    #[test]
    fn narrowing_matches_half_for_random_f32(bits in any::<u32>()) {
        check_narrowing(f32::from_bits(bits)).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn narrowing_matches_half_for_adversarial_f32(seed in any::<u64>()) {
        let mut s = seed;
        check_narrowing(values::adversarial_f32(&mut s)).map_err(TestCaseError::fail)?;
    }
}

// ---------------------------------------------------------------------------
// The fused RMSNorm's decomposition: the sum of squares as the kernels
// spread it over a block (`kernels/norm/tree.rs`: chunk k in thread k mod
// nthreads, `tree_sum` with warp shuffles and a quarter stage in warp 0),
// modelled step by step from the device crate's pure pieces
// (`norm_tree::{warp_adds, combine_quarters}`, the `Element` conversions),
// against the tree's definition and against the CPU oracle.

use p2p_allreduce::abi::{NORM_CHUNK, NORM_MAX_CHUNKS};
use p2p_allreduce::device::norm_tree::{self, combine_quarters, warp_adds, QUARTERS};

/// The warp's width, as the model's `u64` indices.
const WARP: u64 = norm_tree::WARP as u64;

/// `warp_tree` of one warp: `v[l]` is lane l's item, +0.0 where the item
/// does not exist (as the kernels load it); at each stride (in the order of
/// `strides`) a lane reads the value `s` lanes above it as `shfl.down` does
/// (its own value when that lane is past the warp), then adds it if
/// `warp_adds` says so. Lane 0's value is returned.
fn model_warp_tree(v: &mut [f32; 32], strides: &[u64]) -> f32 {
    for &s in strides {
        let before = *v;
        for l in 0..32u64 {
            let other = if l + s < WARP {
                before[(l + s) as usize]
            } else {
                before[l as usize]
            };
            if warp_adds(l as u32, s as u32) {
                v[l as usize] += other;
            }
        }
    }
    v[0]
}

/// `tree_sum` over the partials `parts` with `nthreads` threads.
fn model_tree_sum(parts: &[f32], nthreads: u64) -> f32 {
    model_tree_sum_with(parts, nthreads, &STRIDES, combine_quarters)
}

/// The strides of `warp_tree`, in its order.
const STRIDES: [u64; 5] = [1, 2, 4, 8, 16];

/// [`model_tree_sum`] with the warp's stride order and the quarter stage
/// as parameters (the tests' mutants replace them).
fn model_tree_sum_with(
    parts: &[f32],
    nthreads: u64,
    strides: &[u64],
    combine: fn([f32; QUARTERS], u32) -> f32,
) -> f32 {
    let chunks = parts.len() as u64;
    let mut sh = parts.to_vec();
    for slot in 0..chunks.div_ceil(nthreads) {
        for w in 0..nthreads / WARP {
            let mut v = [0f32; 32];
            let mut ks = [0u64; 32];
            for l in 0..32u64 {
                let k = slot * nthreads + w * WARP + l;
                ks[l as usize] = k;
                v[l as usize] = if k < chunks { sh[k as usize] } else { 0.0 };
            }
            let first = model_warp_tree(&mut v, strides);
            if ks[0] < chunks {
                sh[ks[0] as usize] = first;
            }
        }
    }
    let groups = chunks.div_ceil(WARP);
    let mut a = [0f32; QUARTERS];
    for (j, q) in a.iter_mut().enumerate() {
        let mut v = [0f32; 32];
        for l in 0..32u64 {
            let g = WARP * j as u64 + l;
            v[l as usize] = if g < groups {
                sh[(WARP * g) as usize]
            } else {
                0.0
            };
        }
        *q = model_warp_tree(&mut v, strides);
    }
    combine(a, groups as u32)
}

/// The tree by its recursive reading (written here, not from the device
/// crate): with P the smallest power of two >= n, the last stride P/2
/// adds the tree of [P/2, n) onto the tree of [0, P/2).
fn tree_by_halves(parts: &[f32]) -> f32 {
    match parts.len() {
        0 => 0.0,
        1 => parts[0],
        n => {
            let half = n.next_power_of_two() / 2;
            tree_by_halves(&parts[..half]) + tree_by_halves(&parts[half..])
        }
    }
}

/// Non-negative partials (sums of squares) over many binades.
fn partials(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let e = (x % 60) as i32 - 30;
            (1.0 + (x >> 40) as f32 / (1u64 << 24) as f32) * 2f32.powi(e)
        })
        .collect()
}

/// Threads per block the kernels accept: multiples of 32 up to 1024.
fn block_threads() -> impl Strategy<Value = u64> {
    (1u64..=32).prop_map(|w| w * WARP)
}

/// One row of the fused operation as a block computes it: residual add
/// per element (`E` conversions), squares per chunk in column order, the
/// modelled `tree_sum`, `inv`, the normed row.
fn model_norm_row<E: Element>(
    sum: &[u32],
    res: &[u32],
    gamma: &[u32],
    eps: f32,
    nthreads: u64,
) -> (Vec<u32>, Vec<u32>) {
    let hidden = gamma.len();
    let res_out: Vec<u32> = (0..hidden)
        .map(|j| E::from_f32(E::to_f32(sum[j]) + E::to_f32(res[j])))
        .collect();
    let q: Vec<f32> = res_out.iter().map(|&b| E::to_f32(b)).collect();
    let parts: Vec<f32> = q
        .chunks(NORM_CHUNK)
        .map(|c| c.iter().skip(1).fold(c[0] * c[0], |acc, v| acc + v * v))
        .collect();
    let total = model_tree_sum(&parts, nthreads);
    let inv = 1.0 / (total / hidden as f32 + eps).sqrt();
    let normed = (0..hidden)
        .map(|j| E::from_f32((q[j] * inv) * E::to_f32(gamma[j])))
        .collect();
    (res_out, normed)
}

fn check_fused_model(
    dtype: Dtype,
    world: usize,
    rows: usize,
    hidden: usize,
    nthreads: u64,
    seed: u64,
) -> Result<(), TestCaseError> {
    let count = rows * hidden;
    let x = values::adversarial_inputs(dtype, world, count, seed, false);
    let res = values::adversarial_inputs(dtype, 1, count, seed + 1, false).remove(0);
    let gamma = values::adversarial_inputs(dtype, 1, hidden, seed + 2, false).remove(0);
    let eps = 1e-6f32;
    let refs = as_slices(&x);
    let sum = reference::allreduce_bits(dtype, &refs);
    let (want_res, want_norm) = reference::add_rmsnorm_bits(dtype, &refs, &res, &gamma, eps);
    let (mut got_res, mut got_norm) = (Vec::new(), Vec::new());
    for row in 0..rows {
        let at = row * hidden..(row + 1) * hidden;
        let (r, n) = match dtype {
            Dtype::F32 => model_norm_row::<F32>(&sum[at.clone()], &res[at], &gamma, eps, nthreads),
            Dtype::F16 => model_norm_row::<F16>(&sum[at.clone()], &res[at], &gamma, eps, nthreads),
            Dtype::Bf16 => {
                model_norm_row::<Bf16>(&sum[at.clone()], &res[at], &gamma, eps, nthreads)
            }
        };
        got_res.extend(r);
        got_norm.extend(n);
    }
    let what = format!(
        "{} world={world} rows={rows} hidden={hidden} threads={nthreads} seed={seed:#x}",
        dtype.name()
    );
    for (name, got, want) in [
        ("residual out", &got_res, &want_res),
        ("normed", &got_norm, &want_norm),
    ] {
        if let Some((i, g, w)) = reference::first_mismatch(dtype, got, want) {
            return Err(TestCaseError::fail(format!(
                "{what}: {name} element {i}: model {} oracle {}",
                fmt_bits(dtype, g),
                fmt_bits(dtype, w)
            )));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(400))]

    /// The block's spread of the tree gives the tree's sum, bit for bit,
    /// for every row length the kernels take and every block size.
    #[test]
    fn tree_sum_model_is_the_pairwise_tree(chunks in 1usize..=NORM_MAX_CHUNKS, nthreads in block_threads(), seed in any::<u64>()) {
        let parts = partials(chunks, seed);
        let model = model_tree_sum(&parts, nthreads);
        let halves = tree_by_halves(&parts);
        prop_assert_eq!(model.to_bits(), halves.to_bits(), "chunks {} threads {}", chunks, nthreads);
    }

    /// Whole fused rows from the modelled decomposition equal the oracle.
    #[test]
    fn fused_model_matches_oracle(
        dtype in select(Dtype::ALL.to_vec()),
        world in 1usize..=MAX_RANKS,
        rows in 0usize..=4,
        hidden in prop_oneof![select(vec![1usize, 7, 8, 128, 4096, 5120, 7168, 8192]), 1usize..=NORM_MAX_CHUNKS * NORM_CHUNK],
        nthreads in block_threads(),
        seed in any::<u64>(),
    ) {
        check_fused_model(dtype, world, rows, hidden, nthreads, seed)?;
    }
}

/// Every row length at the block size the library launches (512) and at
/// one warp, exhaustively: the tree spread is right for all of them.
#[test]
fn tree_sum_model_every_length() {
    for chunks in 1..=NORM_MAX_CHUNKS {
        let parts = partials(chunks, chunks as u64);
        for nthreads in [32, 512] {
            assert_eq!(
                model_tree_sum(&parts, nthreads).to_bits(),
                tree_by_halves(&parts).to_bits(),
                "chunks {chunks} threads {nthreads}"
            );
        }
    }
}

/// [`model_tree_sum`] split over a cluster of `ctas` CTAs as the fused
/// push_ll splits a row (`kernels/norm/reg_rows.rs`, `ClusterRow`): CTA c reduces
/// chunks `[c * range, (c + 1) * range)` (`range` from
/// `abi::norm_split_range`, possibly none) with `nthreads` threads, then
/// one warp adds the CTAs' partials (lane c holds CTA c's, +0.0 past the
/// CTAs that hold chunks). `range_of` gives the range (the test's mutant
/// replaces it).
fn model_split_tree_sum(
    parts: &[f32],
    ctas: u64,
    nthreads: u64,
    range_of: fn(u64, u64) -> u64,
) -> f32 {
    let chunks = parts.len() as u64;
    let range = range_of(chunks, ctas);
    let mut v = [0f32; 32];
    for c in 0..ctas {
        let first = (c * range).min(chunks);
        let last = ((c + 1) * range).min(chunks);
        if first < last {
            v[c as usize] = model_tree_sum(&parts[first as usize..last as usize], nthreads);
        }
    }
    model_warp_tree(&mut v, &STRIDES)
}

/// Every row length, split over every cluster size the host launches
/// (with the block the plan gives a CTA's range, and one warp), is the
/// tree's sum bit for bit; an even split (ranges of `ceil(n / ctas)`, not a
/// power of two) is not, for some lengths: the model can fail.
#[test]
fn split_tree_sum_is_the_pairwise_tree() {
    use p2p_allreduce::abi::{norm_split_range, NORM_MAX_CTAS};
    let range_of: fn(u64, u64) -> u64 =
        |chunks, ctas| norm_split_range(chunks as u32, ctas as u32) as u64;
    let mut ctas = 1u64;
    while ctas <= NORM_MAX_CTAS as u64 {
        for chunks in 1..=NORM_MAX_CHUNKS {
            let parts = partials(chunks, 3 * chunks as u64 + ctas);
            let want = tree_by_halves(&parts).to_bits();
            let local = range_of(chunks as u64, ctas).min(chunks as u64);
            let plan_threads = local.div_ceil(2).div_ceil(WARP) * WARP;
            for nthreads in [WARP, plan_threads.clamp(WARP, 1024)] {
                let got = model_split_tree_sum(&parts, ctas, nthreads, range_of);
                assert_eq!(
                    got.to_bits(),
                    want,
                    "chunks {chunks} ctas {ctas} threads {nthreads}"
                );
            }
        }
        ctas *= 2;
    }
    let even: fn(u64, u64) -> u64 = |chunks, ctas| chunks.div_ceil(ctas);
    let caught = (1..=NORM_MAX_CHUNKS).step_by(13).any(|chunks| {
        let parts = partials(chunks, 5 + chunks as u64);
        model_split_tree_sum(&parts, 8, 512, even).to_bits() != tree_by_halves(&parts).to_bits()
    });
    assert!(caught, "an even (unaligned) split went unnoticed");
}

/// The model can fail: a warp that runs its strides from 16 down, or
/// quarters added one after the other, change the sum for some lengths.
#[test]
fn tree_sum_model_detects_wrong_spreads() {
    type Combine = fn([f32; QUARTERS], u32) -> f32;
    let sequential: Combine = |a, groups| {
        let mut t = a[0];
        for (j, q) in a.iter().enumerate().skip(1) {
            if norm_tree::WARP * (j as u32) < groups {
                t += q;
            }
        }
        t
    };
    let mutants: [(&str, &[u64], Combine); 2] = [
        ("strides from 16 down", &[16, 8, 4, 2, 1], combine_quarters),
        ("sequential quarters", &STRIDES, sequential),
    ];
    for (name, strides, combine) in mutants {
        let caught = (1..=NORM_MAX_CHUNKS).step_by(37).any(|chunks| {
            let parts = partials(chunks, 11 + chunks as u64);
            model_tree_sum_with(&parts, 512, strides, combine).to_bits()
                != tree_by_halves(&parts).to_bits()
        });
        assert!(caught, "the {name} mutant went unnoticed");
    }
}

// ---------------------------------------------------------------------------
// Routing between our kernels and NCCL (issue 44): a pure function of the
// table, the size, the element type and the mode.

mod routing {
    use p2p_allreduce::abi::{Algorithm, Dtype};
    use p2p_allreduce::thresholds::{
        file_bands, route, Backend, FileBand, Mode, Thresholds, ThresholdsFile, Timed, TunedTable,
        FORMAT, FORMAT_V1, NCCL_MUST_WIN_BY,
    };
    use p2p_allreduce::Link;
    use proptest::prelude::*;
    use proptest::sample::select;
    use std::path::Path;

    const GPU: &str = "NVIDIA RTX PRO 6000";

    /// A sweep as `tune` measures it: distinct sizes (whole f32 elements),
    /// ours always timed, NCCL and its symmetric kernels sometimes absent.
    fn sweep() -> impl Strategy<Value = Vec<Timed>> {
        prop::collection::btree_map(
            1usize..(1 << 24),
            (
                select(Algorithm::ALL.to_vec()),
                1.0f64..100.0,
                prop::option::weighted(0.8, 1.0f64..100.0),
                prop::option::weighted(0.5, 1.0f64..100.0),
            ),
            1..24,
        )
        .prop_map(|m| {
            m.into_iter()
                .map(|(k, (algorithm, ours, nccl, sym))| Timed {
                    size: k * 4,
                    algorithm,
                    ours_us: ours,
                    nccl_us: nccl,
                    nccl_symmetric_us: sym,
                })
                .collect()
        })
    }

    fn table_of(bands: Vec<FileBand>, format: &str, link: Link, world: usize) -> Thresholds {
        let file = ThresholdsFile {
            format: format.into(),
            tables: vec![TunedTable {
                gpu: GPU.into(),
                gpus: 8,
                links: vec![],
                link: p2p_allreduce::thresholds::link_label(link).into(),
                world,
                dtype: "bf16".into(),
                measured: "property test".into(),
                bands,
            }],
        };
        // Through the file's text, as a group reads it.
        let parsed = ThresholdsFile::parse(&file.to_json()).expect("tune's bands parse");
        Thresholds::default()
            .with_file_entry(&parsed, Path::new("t.json"), GPU, 8, link, world)
            .expect("valid")
            .expect("an entry for this machine")
    }

    fn time_of(t: &Timed, b: Backend) -> Option<f64> {
        match b {
            Backend::Ours => Some(t.ours_us),
            Backend::Nccl => t.nccl_us,
            Backend::NcclSymmetric => t.nccl_symmetric_us,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// At every measured size and element type, routing picks a
        /// measured backend that no other measured backend beat by more
        /// than the noise allowance, gives NCCL a size only where NCCL
        /// was faster than ours, and in deterministic mode always ours.
        #[test]
        fn routing_never_picks_a_backend_the_table_measured_slower(
            timed in sweep(),
            link in select(vec![Link::NvLink, Link::Pcie, Link::SameDevice]),
            world in 2usize..=8,
        ) {
            let t = table_of(file_bands(&timed).expect("bands"), FORMAT, link, world);
            for m in &timed {
                for dtype in Dtype::ALL {
                    if m.size % dtype.size() != 0 {
                        continue;
                    }
                    let count = m.size / dtype.size();
                    let b = route(&t, link, world, count, dtype, Mode::Fastest);
                    let tb = time_of(m, b);
                    prop_assert!(tb.is_some(), "{b:?} was not measured at {} B", m.size);
                    let tb = tb.unwrap_or(f64::MAX);
                    for other in Backend::ALL {
                        if let Some(to) = time_of(m, other) {
                            prop_assert!(
                                tb <= to * (1.0 + NCCL_MUST_WIN_BY) * (1.0 + 1e-12),
                                "{b:?} ({tb} us) picked at {} B, {other:?} took {to} us", m.size
                            );
                        }
                    }
                    if b.is_nccl() {
                        prop_assert!(tb < m.ours_us, "{b:?} {tb} us vs ours {} us", m.ours_us);
                    }
                    prop_assert_eq!(route(&t, link, world, count, dtype, Mode::Deterministic), Backend::Ours);
                    // Our algorithm there is the one measured there.
                    prop_assert_eq!(t.choose(p2p_allreduce::AlgoChoice::Auto, m.size, world, link), m.algorithm);
                }
            }
        }

        /// Every size, measured or not, up to usize::MAX, falls in exactly
        /// one band: the first whose limit holds it, the same for our
        /// algorithm and the winner; sizes between two measured sizes go
        /// where the larger one went.
        #[test]
        fn every_size_is_covered_by_one_band(
            timed in sweep(),
            probes in prop::collection::vec(any::<usize>(), 16),
            world in 2usize..=8,
        ) {
            let link = Link::Pcie;
            let t = table_of(file_bands(&timed).expect("bands"), FORMAT, link, world);
            let winners = t.winners(link, world);
            prop_assert_eq!(winners.last().map(|w| w.up_to), Some(usize::MAX));
            prop_assert!(winners.windows(2).all(|w| w[0].up_to < w[1].up_to));
            let merged = t.merged(link, world);
            prop_assert_eq!(merged.last().map(|m| m.0), Some(usize::MAX));
            let mut sorted = timed.clone();
            sorted.sort_by_key(|m| m.size);
            for bytes in probes.into_iter().chain([0, 1, usize::MAX]) {
                let holders: Vec<_> = merged
                    .iter()
                    .enumerate()
                    .filter(|(i, m)| bytes <= m.0 && (*i == 0 || bytes > merged[i - 1].0))
                    .collect();
                prop_assert_eq!(holders.len(), 1, "{} B", bytes);
                let (_, (_, algo, w)) = holders[0];
                prop_assert_eq!(t.winner(bytes, world, link), w.winner);
                prop_assert_eq!(t.choose(p2p_allreduce::AlgoChoice::Auto, bytes, world, link), *algo);
                // The next measured size at or above it decides (the last
                // measured size's band reaches beyond).
                let decider = sorted.iter().find(|m| m.size >= bytes).unwrap_or(&sorted[sorted.len() - 1]);
                prop_assert_eq!(w.winner, decider.winner().0, "{} B", bytes);
            }
        }

        /// Files of format 1 (our algorithm per band, no winner) load as
        /// they did: the same bands, every size ours.
        #[test]
        fn format_1_files_still_load(
            limits in prop::collection::btree_set(1u64..(1 << 40), 0..6),
            algos in prop::collection::vec(select(Algorithm::ALL.to_vec()), 7),
            probes in prop::collection::vec(any::<usize>(), 8),
        ) {
            let mut bands: Vec<FileBand> = limits
                .iter()
                .zip(&algos)
                .map(|(&u, a)| FileBand { up_to: Some(u), algorithm: a.name().into(), winner: None, margin: None })
                .collect();
            bands.push(FileBand { up_to: None, algorithm: algos[6].name().into(), winner: None, margin: None });
            let t = table_of(bands.clone(), FORMAT_V1, Link::NvLink, 4);
            prop_assert_eq!(t.bands(Link::NvLink, 4).len(), bands.len());
            for (b, f) in t.bands(Link::NvLink, 4).iter().zip(&bands) {
                prop_assert_eq!(b.algorithm.name(), f.algorithm.as_str());
                prop_assert_eq!(b.up_to as u64, f.up_to.unwrap_or(u64::MAX).min(usize::MAX as u64));
            }
            for bytes in probes {
                prop_assert_eq!(t.winner(bytes, 4, Link::NvLink), Backend::Ours);
                prop_assert_eq!(route(&t, Link::NvLink, 4, bytes, Dtype::F16, Mode::Fastest), Backend::Ours);
            }
        }
    }
}
