//! The allreduce kernels' model, assembled from the device crate's pure
//! pieces, against the oracle: every algorithm, every rank identical.

use super::*;

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
