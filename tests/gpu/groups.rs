//! Peer groups and the API's guards: user errors, misuse, real rank entries
//! on every GPU, push with changing grids and push_ll's in-place inputs.

use crate::fused::{NormBufs, NormCase};
use crate::graphs::graph_nodes;
use crate::harness::*;

pub(crate) fn user_errors(g: &Gpu) {
    assert!(matches!(
        VirtualGroup::new(&g.ctx, 0, Config::default()),
        Err(Error::WorldSize(0))
    ));
    assert!(matches!(
        VirtualGroup::new(&g.ctx, 9, Config::default()),
        Err(Error::WorldSize(9))
    ));
    assert!(matches!(
        VirtualGroup::new(
            &g.ctx,
            2,
            Config {
                max_blocks: Some(65),
                ..Config::default()
            }
        ),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        VirtualGroup::new(
            &g.ctx,
            2,
            Config {
                threads_per_block: 100,
                ..Config::default()
            }
        ),
        Err(Error::Config(_))
    ));
    let grp = group(g, 2);
    let a = g.stream.clone_htod(&vec![1.0f32; 100]).expect("htod");
    let short = g.stream.clone_htod(&vec![1.0f32; 99]).expect("htod");
    let mut outs = vec![poisoned::<f32>(g, 100), poisoned::<f32>(g, 100)];
    assert!(matches!(
        grp.allreduce(&g.stream, &[&a], &mut outs, AlgoChoice::Auto),
        Err(Error::RankCount {
            what: "inputs",
            got: 1,
            world: 2
        })
    ));
    assert!(matches!(
        grp.allreduce(&g.stream, &[&a, &short], &mut outs, AlgoChoice::Auto),
        Err(Error::RankMismatch { rank: 1, .. })
    ));
    let mut small = vec![poisoned::<f32>(g, 100), poisoned::<f32>(g, 50)];
    assert!(matches!(
        grp.allreduce(&g.stream, &[&a, &a], &mut small, AlgoChoice::Auto),
        Err(Error::BufferTooSmall {
            what: "output",
            rank: 1,
            ..
        })
    ));
    // A misaligned output pointer (4 bytes into an allocation).
    let base = poisoned::<f32>(g, 101);
    let p = base.device_ptr(&g.stream).0;
    let inp = a.device_ptr(&g.stream).0;
    // SAFETY: the call is refused before any device work is issued.
    let r = unsafe {
        grp.allreduce_raw(
            &g.stream,
            Dtype::F32,
            100,
            &[inp, inp],
            &[p + 4, p],
            AlgoChoice::Auto,
        )
    };
    assert!(
        matches!(
            r,
            Err(Error::Misaligned {
                what: "output",
                rank: 0,
                ..
            })
        ),
        "{r:?}"
    );
    let reg = grp.alloc_registered::<f32>(10).expect("registered");
    assert!(matches!(
        grp.allreduce_registered(&g.stream, &reg, 11, &mut outs, AlgoChoice::Auto),
        Err(Error::BufferTooSmall {
            what: "registered buffer",
            ..
        })
    ));
    // Registered buffers are accepted only by the group that made them: a
    // second group (or one made after the first was dropped) refuses them.
    let other = group(g, 2);
    assert!(matches!(
        other.allreduce_registered(&g.stream, &reg, 10, &mut outs, AlgoChoice::Auto),
        Err(Error::ForeignRegistered)
    ));
    // An explicit two-stage that does not fit the scratch is refused, not
    // silently run as one-stage; Auto runs one-stage (same bits).
    let tiny = VirtualGroup::new(
        &g.ctx,
        2,
        Config {
            max_bytes: 256,
            ..Config::default()
        },
    )
    .expect("group");
    let reg_big = tiny.alloc_registered::<f32>(100).expect("registered");
    assert!(matches!(
        tiny.allreduce_registered(&g.stream, &reg_big, 100, &mut outs, AlgoChoice::TwoStage),
        Err(Error::ScratchTooSmall {
            bytes: 400,
            capacity: 256
        })
    ));
    assert_eq!(
        tiny.allreduce_registered(&g.stream, &reg_big, 100, &mut outs, AlgoChoice::Auto)
            .expect("auto"),
        Algorithm::OneStage
    );
    tiny.check(&g.stream).expect("check");
    // Two ranks of a PeerGroup on one stream would wait for each other
    // forever (until the timeout): refused at once.
    let pg = PeerGroup::new(&[g.ctx.clone(), g.ctx.clone()], Config::default()).expect("group");
    let same = vec![g.stream.clone(), g.stream.clone()];
    assert!(matches!(
        pg.allreduce(&same, &[&a, &a], &mut outs, AlgoChoice::Auto),
        Err(Error::SharedStream { a: 0, b: 1 })
    ));
    // Messages are displayed with advice; print one of each kind we provoked.
    println!("  e.g.: {}", Error::WorldSize(9));
}

/// The misuses of the API-safety issue, each now an error or a correct
/// result: registered buffers of a dropped group, one group driven from
/// two streams without synchronisation, a chunked call's reported
/// algorithm, and errors seen without `check()`.
pub(crate) fn api_safety(g: &Gpu) {
    // 1. Registered buffers outlive their group: a new group refuses them
    //    (before, the call returned Ok and wrote freed memory).
    let first = group(g, 2);
    let reg = first.alloc_registered::<f32>(1000).expect("registered");
    drop(first);
    let second = group(g, 2);
    let mut outs: Vec<CudaSlice<f32>> = (0..2).map(|_| poisoned::<f32>(g, 1000)).collect();
    assert!(matches!(
        second.allreduce_registered(&g.stream, &reg, 1000, &mut outs, AlgoChoice::Auto),
        Err(Error::ForeignRegistered)
    ));
    drop(reg);

    // 2. One group, two streams, no synchronisation between the calls: the
    //    group orders each call after the previous one (it shares staging
    //    and flags), so every result is exact.
    let s2 = g.ctx.new_stream().expect("stream");
    let world = 4;
    let grp = group(g, world);
    let len = 1_000_000;
    let mut runs = Vec::new();
    for k in 0..6u64 {
        let stream = if k % 2 == 0 { &g.stream } else { &s2 };
        let inputs = values::adversarial_inputs(Dtype::F32, world, len, 300 + k, true);
        let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
        let want = reference::allreduce_bits(Dtype::F32, &refs);
        let ins: Vec<CudaSlice<f32>> = inputs.iter().map(|b| upload_on::<f32>(stream, b)).collect();
        let mut outs: Vec<CudaSlice<f32>> = (0..world)
            .map(|_| poisoned_on::<f32>(stream, len))
            .collect();
        let in_refs: Vec<&CudaSlice<f32>> = ins.iter().collect();
        grp.allreduce(stream, &in_refs, &mut outs, AlgoChoice::Auto)
            .expect("allreduce");
        runs.push((stream.clone(), ins, outs, want));
    }
    for (k, (stream, _ins, outs, want)) in runs.iter().enumerate() {
        grp.check(stream).expect("check");
        let got: Vec<Vec<u32>> = outs.iter().map(|o| download_on(stream, o, len)).collect();
        assert_ranks(&format!("two streams, call {k}"), Dtype::F32, &got, want);
    }

    // 3. A chunked call reports the algorithm of the whole call: every
    //    chunk runs the one chosen from the message size.
    let small = VirtualGroup::new(
        &g.ctx,
        2,
        Config {
            max_bytes: 64 << 10,
            ..Config::default()
        },
    )
    .expect("group");
    let a = g.stream.clone_htod(&vec![1.0f32; 300_000]).expect("htod");
    let mut outs = vec![poisoned::<f32>(g, 300_000), poisoned::<f32>(g, 300_000)];
    let used = small
        .allreduce(&g.stream, &[&a, &a], &mut outs, AlgoChoice::Auto)
        .expect("chunked");
    assert_eq!(
        used,
        small.config().thresholds.choose(
            AlgoChoice::Auto,
            1_200_000,
            2,
            p2p_allreduce::Link::SameDevice
        )
    );
    small.check(&g.stream).expect("check");

    // 4. Errors without check(): after a peer timeout, poll() reports it
    //    from host memory and the next call fails instead of returning Ok.
    let t = VirtualGroup::new(
        &g.ctx,
        2,
        Config {
            timeout: Duration::from_millis(20),
            ..Config::default()
        },
    )
    .expect("group");
    t.poll().expect("healthy group polls Ok");
    t.launch_with_absent_ranks(&g.stream, 0b10, Dtype::Bf16, Algorithm::TwoStage, 1000)
        .expect("launch");
    assert!(
        matches!(t.poll(), Err(Error::PeerTimeout { peer: 1, .. })),
        "poll after a timeout"
    );
    let mut outs = vec![poisoned::<f32>(g, 100), poisoned::<f32>(g, 100)];
    let b = g.stream.clone_htod(&vec![1.0f32; 100]).expect("htod");
    assert!(matches!(
        t.allreduce(&g.stream, &[&b, &b], &mut outs, AlgoChoice::Auto),
        Err(Error::Poisoned(_))
    ));
    t.reset().expect("reset");
    t.poll().expect("Ok after reset");
    t.allreduce(&g.stream, &[&b, &b], &mut outs, AlgoChoice::Auto)
        .expect("after reset");
    t.check(&g.stream).expect("check");
    assert_eq!(
        g.stream.clone_dtoh(&outs[0]).expect("dtoh"),
        vec![2.0f32; 100]
    );

    // Views and in place through the typed API.
    let big = g.stream.clone_htod(&vec![3.0f32; 1000]).expect("htod");
    let mut bufs = vec![
        g.stream.clone_htod(&vec![1.0f32; 1000]).expect("htod"),
        g.stream.clone_htod(&vec![2.0f32; 1000]).expect("htod"),
    ];
    {
        let v = big.slice(100..356);
        let (l, r) = bufs.split_at_mut(1);
        let mut outs = [l[0].slice_mut(0..256), r[0].slice_mut(512..768)];
        second
            .allreduce(&g.stream, &[&v, &v], &mut outs, AlgoChoice::OneStage)
            .expect("views");
    }
    second
        .allreduce_in_place(&g.stream, &mut bufs, AlgoChoice::TwoStage)
        .expect("in place");
    second.check(&g.stream).expect("check");
    let b0 = g.stream.clone_dtoh(&bufs[0]).expect("dtoh");
    // Elements 0..256 of rank 0 were 6 (3 + 3) before the in-place sum with
    // rank 1's 2s; the rest were 1 + 2.
    assert_eq!(b0[0], 8.0);
    assert_eq!(b0[300], 3.0);
    assert_eq!(b0[600], 7.0);
    println!("  foreign registered buffers refused; two streams ordered (6 calls exact); chunked call reports its one algorithm; poll() and the next call see a timeout without check(); views and in place");
}

pub(crate) fn peer_group(g: &Gpu) {
    // Real-rank entries: one launch per rank, each on its own stream, on
    // every placement this machine allows (distinct GPUs when there are two
    // or more). Staged, registered, empty and in-place calls, both algorithms.
    let ctxs = all_gpus(g);
    let mut cross = 0;
    for place in placements(ctxs.len()) {
        let world = place.len();
        let (grp, streams) = peer_setup(
            &ctxs,
            &place,
            Config {
                max_bytes: 1 << 20,
                ..Config::default()
            },
        );
        let distinct = place.iter().any(|&d| d != place[0]);
        if distinct {
            cross += 1;
            assert_ne!(
                grp.link(),
                p2p_allreduce::Link::SameDevice,
                "GPUs {place:?}: a group across devices must see their link"
            );
        }
        for dtype in Dtype::ALL {
            for algo in Algorithm::ALL {
                for (k, len) in [0usize, 5, 40_003, 600_001].into_iter().enumerate() {
                    let seed = (world * 100 + k) as u64 * 8 + dtype as u64 * 2 + algo as u64;
                    let what = format!("PeerGroup GPUs {place:?} {dtype:?} {algo:?} len {len}");
                    match dtype {
                        Dtype::F32 => {
                            peer_case::<f32>(&grp, &streams, dtype, algo, len, seed, &what)
                        }
                        Dtype::F16 => {
                            peer_case::<half::f16>(&grp, &streams, dtype, algo, len, seed, &what)
                        }
                        Dtype::Bf16 => {
                            peer_case::<half::bf16>(&grp, &streams, dtype, algo, len, seed, &what)
                        }
                    }
                }
            }
        }
        println!(
            "  PeerGroup on GPUs {place:?} ({:?}): staged, registered, empty and in-place calls bit-exact and identical on every rank",
            grp.link()
        );
    }
    if ctxs.len() < 2 {
        println!("  cross-device placements: not run (this machine has 1 GPU)");
    } else {
        assert!(cross > 0);
    }
}

/// Staged, registered and in-place allreduces of one shape on a PeerGroup.
fn peer_case<T: Bits>(
    grp: &PeerGroup,
    streams: &[Arc<CudaStream>],
    dtype: Dtype,
    algo: Algorithm,
    len: usize,
    seed: u64,
    what: &str,
) {
    let world = streams.len();
    let inputs = values::adversarial_inputs(dtype, world, len, seed, true);
    let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(dtype, &refs);
    let ins: Vec<CudaSlice<T>> = inputs
        .iter()
        .zip(streams)
        .map(|(b, s)| upload_on::<T>(s, b))
        .collect();
    let read = |outs: &[CudaSlice<T>]| -> Vec<Vec<u32>> {
        outs.iter()
            .zip(streams)
            .map(|(o, s)| download_on(s, o, len))
            .collect()
    };
    // Staged (the typed call), or the raw call for an empty message.
    let mut outs: Vec<CudaSlice<T>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
    if len == 0 {
        let o: Vec<u64> = outs
            .iter_mut()
            .zip(streams)
            .map(|(o, s)| o.device_ptr_mut(s).0)
            .collect();
        let i: Vec<u64> = ins
            .iter()
            .zip(streams)
            .map(|(x, s)| x.device_ptr(s).0)
            .collect();
        // SAFETY: zero elements are read or written.
        let used = unsafe { grp.allreduce_raw(streams, dtype, 0, &i, &o, algo.into()) }
            .unwrap_or_else(|e| panic!("{what} raw: {e}"));
        assert_eq!(used, algo);
    } else {
        let in_refs: Vec<&CudaSlice<T>> = ins.iter().collect();
        let used = grp
            .allreduce(streams, &in_refs, &mut outs, algo.into())
            .unwrap_or_else(|e| panic!("{what} staged: {e}"));
        assert_eq!(used, algo, "{what}: explicit algorithm not honoured");
    }
    grp.check(streams)
        .unwrap_or_else(|e| panic!("{what} staged: {e}"));
    assert_ranks(&format!("{what} staged"), dtype, &read(&outs), &want);

    // Registered (zero-copy) inputs.
    let reg = grp
        .alloc_registered::<T>(len.max(1))
        .expect("alloc_registered");
    if len > 0 {
        for (r, s) in streams.iter().enumerate() {
            reg.copy_from(r, s, &ins[r]).expect("copy into registered");
        }
    }
    let mut outs: Vec<CudaSlice<T>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
    // Registered calls are not chunked: a two-stage larger than the scratch
    // is refused (Auto would run one-stage), so it runs one-stage here.
    let bytes = len * dtype.size();
    let fits = match algo {
        Algorithm::TwoStage => bytes <= grp.config().max_bytes,
        zoned => grp
            .config()
            .zone_capacity(zoned)
            .is_none_or(|cap| bytes <= cap),
    };
    if !fits {
        let r = grp.allreduce_registered(streams, &reg, len, &mut outs, algo.into());
        assert!(
            matches!(
                r,
                Err(Error::ScratchTooSmall { .. }) | Err(Error::ZoneTooSmall { .. })
            ),
            "{what}: expected a refusal, got {r:?}"
        );
    }
    let algo = if fits { algo } else { Algorithm::OneStage };
    let used = grp
        .allreduce_registered(streams, &reg, len, &mut outs, algo.into())
        .unwrap_or_else(|e| panic!("{what} registered: {e}"));
    assert_eq!(used, algo);
    grp.check(streams)
        .unwrap_or_else(|e| panic!("{what} registered: {e}"));
    assert_ranks(&format!("{what} registered"), dtype, &read(&outs), &want);

    // In place: the output is the input (staged, so peers read the copy).
    if len > 0 {
        let mut inplace: Vec<CudaSlice<T>> = inputs
            .iter()
            .zip(streams)
            .map(|(b, s)| upload_on::<T>(s, b))
            .collect();
        let p: Vec<u64> = inplace
            .iter_mut()
            .zip(streams)
            .map(|(o, s)| o.device_ptr_mut(s).0)
            .collect();
        // SAFETY: each buffer holds `len` elements and lives until the check below.
        unsafe { grp.allreduce_raw(streams, dtype, len, &p, &p, algo.into()) }
            .unwrap_or_else(|e| panic!("{what} in place: {e}"));
        grp.check(streams)
            .unwrap_or_else(|e| panic!("{what} in place: {e}"));
        assert_ranks(&format!("{what} in place"), dtype, &read(&inplace), &want);
    }
}

/// Push and push_ll collectives, interleaved, back to back on the streams
/// (no host sync between them) whose grids differ: a 1-block message
/// between chunked many-block ones. Every block must pick the same landing
/// slot in a collective, or a fast peer writes the slot a slower rank still
/// reads; and push's raw data must never pass for push_ll's lines.
pub(crate) fn push_changing_grids(g: &Gpu) {
    let ctxs = all_gpus(g);
    let place: Vec<usize> = if ctxs.len() >= 2 {
        vec![0, 1]
    } else {
        vec![0, 0]
    };
    let (grp, streams) = peer_setup(&ctxs, &place, Config::with_max_bytes(1 << 20));
    let world = place.len();
    let mut runs = Vec::new();
    for it in 0..24u64 {
        let len = if it % 3 == 0 {
            300_003
        } else {
            1000 + it as usize
        };
        let inputs = values::adversarial_inputs(Dtype::F32, world, len, 4000 + it, true);
        let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
        let want = reference::allreduce_bits(Dtype::F32, &refs);
        let ins: Vec<CudaSlice<f32>> = inputs
            .iter()
            .zip(&streams)
            .map(|(b, s)| upload_on::<f32>(s, b))
            .collect();
        let mut outs: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
        let in_refs: Vec<&CudaSlice<f32>> = ins.iter().collect();
        let algo = if it % 2 == 0 {
            Algorithm::Push
        } else {
            Algorithm::PushLl
        };
        let used = grp
            .allreduce(&streams, &in_refs, &mut outs, algo.into())
            .expect("push");
        assert_eq!(used, algo);
        runs.push((len, ins, outs, want));
    }
    grp.check(&streams).expect("check");
    for (k, (len, _ins, outs, want)) in runs.iter().enumerate() {
        let got: Vec<Vec<u32>> = outs
            .iter()
            .zip(&streams)
            .map(|(o, s)| download_on(s, o, *len))
            .collect();
        assert_ranks(
            &format!("push/push_ll call {k} (len {len})"),
            Dtype::F32,
            &got,
            want,
        );
    }
    println!(
        "  PeerGroup on GPUs {place:?}: 24 push and push_ll calls back to back, 1-block and chunked many-block grids interleaved, bit-exact"
    );
}

/// Staged push_ll reads each rank's input where it is (`own_inputs`, no
/// copy into the staging buffer) when the input is aligned and no other
/// rank's output overlaps it; otherwise the step is staged. Every variant
/// bit-exact on every rank: distinct buffers and in place (read in place),
/// a misaligned input and rank 1's output over rank 0's input (staged);
/// the fused call likewise (distinct: in place; normed over x, or over
/// another rank's x: staged). A captured graph shows which way each went:
/// the in-place calls have fewer nodes (no copy) than the staged ones.
pub(crate) fn push_ll_direct_inputs(g: &Gpu) {
    for (dtype, world, len) in [
        (Dtype::Bf16, 2, 7168),
        (Dtype::Bf16, 3, 5003),
        (Dtype::F32, 2, 4099),
        (Dtype::F16, 2, 1),
    ] {
        match dtype {
            Dtype::F32 => push_ll_direct_case::<f32>(g, dtype, world, len),
            Dtype::F16 => push_ll_direct_case::<half::f16>(g, dtype, world, len),
            Dtype::Bf16 => push_ll_direct_case::<half::bf16>(g, dtype, world, len),
        }
    }
    push_ll_direct_fused::<half::bf16>(g);
}

fn push_ll_direct_case<T: Bits>(g: &Gpu, dtype: Dtype, world: usize, len: usize) {
    let grp = group(g, world);
    let inputs = values::adversarial_inputs(dtype, world, len, 0x5eed + len as u64, true);
    let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(dtype, &refs);
    let size = dtype.size() as u64;
    // Each variant: (name, element offset of the inputs in their buffers,
    // outputs in place, rank 1's output over rank 0's input, expect a copy).
    for (name, shift, in_place, cross, copies) in [
        ("distinct", 0usize, false, false, false),
        ("in place", 0, true, false, false),
        ("misaligned input", 1, false, false, true),
        ("rank 1's output over rank 0's input", 0, false, true, true),
    ] {
        let what = format!("{dtype:?} world {world} len {len} push_ll {name}");
        // Inputs at element `shift` of buffers with room for it.
        let mut bufs: Vec<CudaSlice<T>> = inputs
            .iter()
            .map(|b| {
                let mut v = vec![poison::<T>(); shift];
                v.extend(b.iter().map(|&x| T::from_bits32(x)));
                g.stream.clone_htod(&v).expect("upload")
            })
            .collect();
        let mut outs: Vec<CudaSlice<T>> = (0..world).map(|_| poisoned::<T>(g, len)).collect();
        let inp: Vec<u64> = bufs
            .iter()
            .map(|b| b.device_ptr(&g.stream).0 + shift as u64 * size)
            .collect();
        let mut out: Vec<u64> = outs
            .iter_mut()
            .map(|o| o.device_ptr_mut(&g.stream).0)
            .collect();
        if in_place {
            out.copy_from_slice(&inp);
        }
        if cross {
            out[1] = inp[0];
        }
        let call = || {
            // SAFETY: every input holds `len` elements after its shift and
            // every output `len` (the buffers above, alive until checked).
            unsafe { grp.allreduce_raw(&g.stream, dtype, len, &inp, &out, AlgoChoice::PushLl) }
        };
        let graph = capture(g, call);
        let nodes = graph_nodes(&graph);
        // Fresh inputs (an in-place or crossed run overwrote some), then
        // the graph once.
        for (b, bits) in bufs.iter_mut().zip(&inputs) {
            let mut v = vec![poison::<T>(); shift];
            v.extend(bits.iter().map(|&x| T::from_bits32(x)));
            g.stream.memcpy_htod(&v, b).expect("refill");
        }
        graph.launch().expect("graph launch");
        grp.check(&g.stream)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        for r in 0..world {
            let got = if in_place || (cross && r == 1) {
                let all = download::<T>(g, &bufs[if cross { 0 } else { r }], shift + len);
                all[shift..].to_vec()
            } else {
                download::<T>(g, &outs[r], len)
            };
            if let Some((i, got_b, want_b)) = reference::first_mismatch(dtype, &got, &want) {
                panic!("{what}: rank {r} element {i}: got {got_b:#x}, want {want_b:#x}");
            }
        }
        println!("  {what}: bit-exact, graph of {nodes} nodes");
        if copies {
            assert!(nodes > 1, "{what}: staged, but the graph has no copy node");
        } else {
            assert_eq!(
                nodes, 1,
                "{what}: read in place, but the graph has a copy node"
            );
        }
    }
}

fn push_ll_direct_fused<T: Bits>(g: &Gpu) {
    let c = NormCase {
        dtype: T::DTYPE,
        world: 2,
        rows: 3,
        hidden: 7168,
        seed: 77,
    };
    let grp = group(g, c.world);
    let count = c.rows * c.hidden;
    let (x, res, gam, want) = c.data();
    // (name, normed over x, expect a copy). (Another rank's x as a normed
    // output is only reachable through raw pointers, which VirtualGroup's
    // fused calls do not take; the host checks it all the same.)
    for (name, over_x, copies) in [("distinct", false, false), ("normed over x", true, true)] {
        let what = format!("fused push_ll {name}");
        let mut bufs = NormBufs::<T>::upload(g, c.world, count, (&x, &res, &gam));
        let graph = capture(g, || {
            bufs.call(
                &grp,
                &g.stream,
                (count, c.hidden),
                over_x,
                AlgoChoice::PushLl,
            )
        });
        let nodes = graph_nodes(&graph);
        graph.launch().expect("graph launch");
        grp.check(&g.stream)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        bufs.check(g, &what, c.dtype, count, over_x, &want);
        println!("  {what}: bit-exact, graph of {nodes} nodes");
        if copies {
            assert!(nodes > 1, "{what}: staged, but the graph has no copy node");
        } else {
            assert_eq!(
                nodes, 1,
                "{what}: read in place, but the graph has a copy node"
            );
        }
    }
}
