//! Ranks that disagree about a call (issue 31, item 2). Every flag and LL
//! word carries the call's tag, so a rank never takes a peer's words of
//! another call; the waits time out and the host, reading the words left
//! in its signal, reports `Error::CallMismatch` naming the peer and both
//! calls' tags, never wrong bits and never a plain `PeerTimeout`. Then the
//! group is poisoned until `reset()`, after which it is exact again.

use crate::harness::*;
use crate::processes::{ipc_allreduce, ipc_config};
use p2p_allreduce::call_tag::{CallDesc, TaggedCall};

/// The groups' peer timeout here (a mismatch is found at the timeout).
const TIMEOUT: Duration = Duration::from_millis(200);

fn cfg() -> Config {
    Config {
        timeout: TIMEOUT,
        ..Config::default()
    }
}

/// `got` must be a `CallMismatch` between two ranks with different tags.
fn expect_mismatch(what: &str, got: p2p_allreduce::Result<()>) -> (TaggedCall, TaggedCall) {
    match got {
        Err(
            ref e @ Error::CallMismatch {
                rank,
                peer,
                mine,
                theirs,
                ..
            },
        ) => {
            assert_ne!(rank, peer as usize, "{what}: {e}");
            assert_ne!(mine.tag, theirs.tag, "{what}: {e}");
            (mine, theirs)
        }
        other => panic!("{what}: expected CallMismatch, got {other:?}"),
    }
}

/// Fault injection (`launch_with_mismatched_ranks`): virtual ranks, worlds
/// 2 and 3, every algorithm eager and in a CUDA graph, the fused op on
/// every fused algorithm; a PeerGroup of two ranks on GPU 0, every
/// algorithm and the fused op.
pub(super) fn injected(g: &Gpu) {
    let count = 5000;
    let mut n = 0;
    for world in [2usize, 3] {
        let grp = VirtualGroup::new(&g.ctx, world, cfg()).expect("group");
        let odd = 1u32 << (world - 1);
        for algo in Algorithm::ALL {
            for graph in [false, true] {
                let what = format!(
                    "virtual w{world} {algo:?}{}",
                    if graph { " graph" } else { "" }
                );
                let mut kept = None;
                if graph {
                    let gr = capture(g, || {
                        grp.launch_with_mismatched_ranks(&g.stream, odd, Dtype::F32, algo, count)
                            .map(|()| algo)
                    });
                    gr.launch().expect("graph launch");
                    kept = Some(gr);
                } else {
                    grp.launch_with_mismatched_ranks(&g.stream, odd, Dtype::F32, algo, count)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                let (mine, theirs) = expect_mismatch(&what, grp.check(&g.stream));
                let call = CallDesc::plain(count, Dtype::F32, algo);
                assert!(
                    mine.call == Some(call) || theirs.call == Some(call),
                    "{what}: neither side named as {call}: {mine} / {theirs}"
                );
                if n == 0 {
                    println!("  e.g. {what}: this rank's {mine}, the peer's {theirs}");
                }
                drop(kept);
                assert!(
                    matches!(
                        grp.launch_with_mismatched_ranks(&g.stream, 0, Dtype::F32, algo, count),
                        Err(Error::Poisoned(_))
                    ),
                    "{what}: not poisoned"
                );
                grp.reset().expect("reset");
                run_case(
                    g,
                    &grp,
                    Spec {
                        dtype: Dtype::F32,
                        world,
                        len: 3001,
                        algo,
                        registered: false,
                        graph: false,
                        seed: 500 + n,
                    },
                );
                n += 1;
            }
        }
        for algo in [
            AlgoChoice::OneStage,
            AlgoChoice::TwoStage,
            AlgoChoice::PushLl,
        ] {
            let what = format!("virtual w{world} fused {algo:?}");
            grp.add_rmsnorm_with_mismatched_ranks(&g.stream, odd, Dtype::Bf16, algo, 3, 4096)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            expect_mismatch(&what, grp.check(&g.stream));
            grp.reset().expect("reset");
            n += 1;
        }
    }
    let (pg, streams) = peer_setup(std::slice::from_ref(&g.ctx), &[0, 0], cfg());
    for algo in Algorithm::ALL {
        let what = format!("PeerGroup [0, 0] {algo:?}");
        pg.launch_with_mismatched_ranks(&streams, 0b10, Dtype::Bf16, algo, count)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        expect_mismatch(&what, pg.check(&streams));
        pg.reset().expect("reset");
        n += 1;
    }
    for algo in [AlgoChoice::OneStage, AlgoChoice::PushLl] {
        let what = format!("PeerGroup [0, 0] fused {algo:?}");
        pg.add_rmsnorm_with_mismatched_ranks(&streams, 0b01, Dtype::F32, algo, 2, 4096)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        expect_mismatch(&what, pg.check(&streams));
        pg.reset().expect("reset");
        n += 1;
    }
    println!("  {n} injected mismatches (virtual w2, w3: every algorithm eager and in graphs, fused; PeerGroup on GPU 0) reported as CallMismatch");
}

/// A device buffer of `n` copies of `v`.
fn filled<T: cudarc::driver::DeviceRepr + Clone>(
    s: &Arc<CudaStream>,
    v: T,
    n: usize,
) -> Result<CudaSlice<T>, String> {
    s.clone_htod(&vec![v; n]).map_err(|e| e.to_string())
}

/// What rank `rank` of the two-process case `case` calls: rank 0 the
/// base call, rank 1 another count, dtype or algorithm.
fn process_call(case: usize, rank: usize) -> (usize, Dtype, Algorithm) {
    let other = rank == 1;
    match case {
        0 => (1000 + other as usize, Dtype::F32, Algorithm::PushLl),
        1 => (1000 + other as usize, Dtype::F32, Algorithm::OneStage),
        2 => (
            1000,
            if other { Dtype::Bf16 } else { Dtype::F32 },
            Algorithm::PushLl,
        ),
        3 => (
            1000,
            if other { Dtype::Bf16 } else { Dtype::F32 },
            Algorithm::TwoStage,
        ),
        4 => (
            1000,
            Dtype::F32,
            if other {
                Algorithm::OneStage
            } else {
                Algorithm::PushLl
            },
        ),
        _ => (
            1000,
            Dtype::F32,
            if other {
                Algorithm::Push
            } else {
                Algorithm::OneStage
            },
        ),
    }
}

const PROCESS_CASES: usize = 6;

fn names(case: usize) -> String {
    let (c0, d0, a0) = process_call(case, 0);
    let (c1, d1, a1) = process_call(case, 1);
    format!(
        "{c0} x {} {} against {c1} x {} {}",
        d0.name(),
        a0.name(),
        d1.name(),
        a1.name()
    )
}

/// One process of the two-process case (`P2P_IPC_MODE=mismatch`): real
/// calls that differ (no injection; the cases of [`process_call`], then
/// the fused op with one row more on rank 1, one-stage and push_ll), each
/// followed by the check, a reset and a bit-exact allreduce, with a
/// rendezvous round between steps.
pub(super) fn child(rank: usize) -> Result<String, String> {
    let env = |k: &str| std::env::var(k).map_err(|e| format!("{k}: {e}"));
    let gpu: usize = env("P2P_IPC_GPU")?.parse().map_err(|e| format!("{e}"))?;
    let dir = std::path::PathBuf::from(env("P2P_IPC_DIR")?);
    let ctx = driver::open_device(gpu).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let es = |e: Error| e.to_string();
    let ex = DirExchange::new(&dir, rank, 2, Duration::from_secs(60)).map_err(es)?;
    let group = ProcessGroup::new(&ctx, &ex, ipc_config(Duration::from_millis(500))).map_err(es)?;
    let mut lines = Vec::new();
    for case in 0..PROCESS_CASES {
        let (count, dtype, algo) = process_call(case, rank);
        let r = match dtype {
            Dtype::F32 => {
                let x = filled(&stream, 1.5f32, count)?;
                let mut y = filled(&stream, poison::<f32>(), count)?;
                group.allreduce(&stream, &x, &mut y, algo.into())
            }
            _ => {
                let x = filled(&stream, half::bf16::from_f32(1.5), count)?;
                let mut y = filled(&stream, poison::<half::bf16>(), count)?;
                group.allreduce(&stream, &x, &mut y, algo.into())
            }
        };
        let got = r.and_then(|_| group.check(&stream));
        match got {
            Err(Error::CallMismatch {
                peer, mine, theirs, ..
            }) if peer as usize == 1 - rank => {
                let want = CallDesc::plain(count, dtype, algo);
                if mine.call != Some(want) {
                    return Err(format!(
                        "{}: this rank's call named {mine}, want {want}",
                        names(case)
                    ));
                }
                lines.push(format!("{}: CallMismatch ({mine} / {theirs})", names(case)));
            }
            other => {
                return Err(format!(
                    "{}: expected CallMismatch naming {}, got {other:?}",
                    names(case),
                    1 - rank
                ))
            }
        }
        // Both ranks past their check before either resets, both reset
        // before either runs again.
        ex.all_gather(&[case as u8]).map_err(es)?;
        group.reset().map_err(es)?;
        ex.all_gather(&[case as u8]).map_err(es)?;
        // The same algorithm on both ranks: rank 0's.
        let agreed = process_call(case, 0).2;
        ipc_allreduce(&group, &stream, 1000, 90 + case as u64, agreed).map_err(es)?;
    }
    // The fused op, rank 1 with one row more.
    for algo in [Algorithm::OneStage, Algorithm::PushLl] {
        let (rows, hidden) = (2 + rank, 4096);
        let n = rows * hidden;
        let what = format!("fused 2 x 4096 against 3 x 4096 f32 {}", algo.name());
        let x = filled(&stream, 1.5f32, n)?;
        let mut res = filled(&stream, 0.25f32, n)?;
        let gamma = filled(&stream, 1.0f32, hidden)?;
        let mut out = filled(&stream, poison::<f32>(), n)?;
        let got = group
            .allreduce_add_rmsnorm(&stream, &x, &mut res, &gamma, 1e-6, &mut out, algo.into())
            .and_then(|_| group.check(&stream));
        match got {
            Err(Error::CallMismatch {
                peer, mine, theirs, ..
            }) if peer as usize == 1 - rank => {
                let want = CallDesc::fused(rows, hidden, Dtype::F32, algo);
                if mine.call != Some(want) {
                    return Err(format!(
                        "{what}: this rank's call named {mine}, want {want}"
                    ));
                }
                lines.push(format!("{what}: CallMismatch ({mine} / {theirs})"));
            }
            other => {
                return Err(format!(
                    "{what}: expected CallMismatch naming {}, got {other:?}",
                    1 - rank
                ))
            }
        }
        ex.all_gather(&[9]).map_err(es)?;
        group.reset().map_err(es)?;
        ex.all_gather(&[9]).map_err(es)?;
        ipc_allreduce(&group, &stream, 1000, 99, Algorithm::OneStage).map_err(es)?;
    }
    Ok(format!("rank {rank}: {}", lines.join("; ")))
}

/// Two processes on GPUs 0 and 1 (both on GPU 0 with one GPU), every case
/// of [`process_call`].
pub(super) fn processes(_g: &Gpu) {
    let n = driver::device_count().expect("device count");
    let dir = ipc_dir("mismatch");
    for text in run_ranks("mismatch", &[0, 1 % n], &dir, Duration::from_secs(120)) {
        println!("  {text}");
    }
}

/// The engines' disagreements (issue 43): token counts that differ at real
/// hidden sizes, a count off by 256, and the fused op with one row more.
/// Every one of them differs by a multiple of 256 elements, which the
/// 8-bit tag of issue 31 could not see (the shorter rank returned Ok, with
/// wrong bits for two_stage and push_two_stage).
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// `rows x hidden` of `dtype`, rank 0 with `rows`, rank 1 with one more.
    Plain {
        rows: usize,
        hidden: usize,
        dtype: Dtype,
    },
    /// A plain f32 call of `count` elements on rank 0, `count + 256` on 1.
    Plus256 { count: usize },
    /// The fused op, bf16, `rows x hidden` on rank 0, one row more on 1.
    Fused { rows: usize, hidden: usize },
}

const ENGINE_SHAPES: [Shape; 4] = [
    Shape::Plain {
        rows: 3,
        hidden: 7168,
        dtype: Dtype::Bf16,
    },
    Shape::Plain {
        rows: 1,
        hidden: 8192,
        dtype: Dtype::F16,
    },
    Shape::Plus256 { count: 1000 },
    Shape::Fused {
        rows: 3,
        hidden: 7168,
    },
];

/// The algorithms each shape runs: every one for a plain call, the fused
/// op's three for the fused one.
fn shape_algorithms(s: Shape) -> &'static [Algorithm] {
    match s {
        Shape::Fused { .. } => &[Algorithm::OneStage, Algorithm::TwoStage, Algorithm::PushLl],
        _ => &Algorithm::ALL,
    }
}

impl Shape {
    /// Rank `rank`'s call.
    fn call(self, rank: usize, algo: Algorithm) -> CallDesc {
        match self {
            Shape::Plain {
                rows,
                hidden,
                dtype,
            } => CallDesc::plain((rows + rank) * hidden, dtype, algo),
            Shape::Plus256 { count } => CallDesc::plain(count + 256 * rank, Dtype::F32, algo),
            Shape::Fused { rows, hidden } => {
                CallDesc::fused(rows + rank, hidden, Dtype::Bf16, algo)
            }
        }
    }
}

/// Runs rank `rank`'s call of `shape` with `algo` on `stream`, eagerly or
/// captured in a CUDA graph and launched once, and returns the check.
fn engine_call(
    group: &ProcessGroup,
    stream: &Arc<CudaStream>,
    shape: Shape,
    rank: usize,
    algo: Algorithm,
    graph: bool,
) -> Result<p2p_allreduce::Result<()>, String> {
    let call = shape.call(rank, algo);
    let n = call.count;
    // The inputs: values spread over many binades (not zeros), outputs
    // poisoned.
    let vals: Vec<f32> = (0..n)
        .map(|i| ((i % 97) as f32 - 48.0) * 0.37f32.powi((i % 13) as i32))
        .collect();
    let run = |f: &dyn Fn() -> p2p_allreduce::Result<Algorithm>| -> Result<p2p_allreduce::Result<()>, String> {
        if !graph {
            return Ok(f().map(|_| ()).and_then(|_| group.check(stream)));
        }
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| e.to_string())?;
        let r = f();
        let g = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| e.to_string())?;
        r.map_err(|e| format!("during capture: {e}"))?;
        let g = g.ok_or("empty graph")?;
        g.launch().map_err(|e| e.to_string())?;
        Ok(group.check(stream))
    };
    match (shape, call.dtype) {
        (Shape::Fused { hidden, .. }, _) => {
            let b = |v: &[f32]| {
                v.iter()
                    .map(|&x| half::bf16::from_f32(x))
                    .collect::<Vec<_>>()
            };
            let x = stream.clone_htod(&b(&vals)).map_err(|e| e.to_string())?;
            let res = stream.clone_htod(&b(&vals)).map_err(|e| e.to_string())?;
            let gamma = filled(stream, half::bf16::from_f32(1.0), hidden)?;
            let out = filled(stream, poison::<half::bf16>(), n)?;
            let (res, out) = (std::cell::RefCell::new(res), std::cell::RefCell::new(out));
            run(&|| {
                group.allreduce_add_rmsnorm(
                    stream,
                    &x,
                    &mut *res.borrow_mut(),
                    &gamma,
                    1e-6,
                    &mut *out.borrow_mut(),
                    algo.into(),
                )
            })
        }
        (_, Dtype::F32) => {
            let x = stream.clone_htod(&vals).map_err(|e| e.to_string())?;
            let y = std::cell::RefCell::new(filled(stream, poison::<f32>(), n)?);
            run(&|| group.allreduce(stream, &x, &mut *y.borrow_mut(), algo.into()))
        }
        (_, Dtype::F16) => {
            let v: Vec<half::f16> = vals.iter().map(|&x| half::f16::from_f32(x)).collect();
            let x = stream.clone_htod(&v).map_err(|e| e.to_string())?;
            let y = std::cell::RefCell::new(filled(stream, poison::<half::f16>(), n)?);
            run(&|| group.allreduce(stream, &x, &mut *y.borrow_mut(), algo.into()))
        }
        (_, Dtype::Bf16) => {
            let v: Vec<half::bf16> = vals.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let x = stream.clone_htod(&v).map_err(|e| e.to_string())?;
            let y = std::cell::RefCell::new(filled(stream, poison::<half::bf16>(), n)?);
            run(&|| group.allreduce(stream, &x, &mut *y.borrow_mut(), algo.into()))
        }
    }
}

/// One process of the engine-shapes case (`P2P_IPC_MODE=engine_mismatch`):
/// every shape of [`ENGINE_SHAPES`] x its algorithms x {eager, graph},
/// rank 1 with the larger call; each must be `CallMismatch` naming the
/// peer on both ranks (never Ok, never a plain timeout), then after a
/// reset an agreed allreduce is bit-exact.
pub(super) fn engine_child(rank: usize) -> Result<String, String> {
    let env = |k: &str| std::env::var(k).map_err(|e| format!("{k}: {e}"));
    let gpu: usize = env("P2P_IPC_GPU")?.parse().map_err(|e| format!("{e}"))?;
    let dir = std::path::PathBuf::from(env("P2P_IPC_DIR")?);
    let ctx = driver::open_device(gpu).map_err(|e| e.to_string())?;
    // Graph capture of staged calls on cudarc slices: no event tracking
    // (one stream per process).
    // SAFETY: this process uses one stream for every slice.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let es = |e: Error| e.to_string();
    let ex = DirExchange::new(&dir, rank, 2, Duration::from_secs(60)).map_err(es)?;
    let config = Config {
        max_bytes: 256 << 10,
        timeout: Duration::from_millis(300),
        ..Config::default()
    };
    let group = ProcessGroup::new(&ctx, &ex, config).map_err(es)?;
    let mut n = 0;
    let mut round = 0u8;
    for shape in ENGINE_SHAPES {
        for &algo in shape_algorithms(shape) {
            for graph in [false, true] {
                let what = format!(
                    "{} against {}{}",
                    shape.call(0, algo),
                    shape.call(1, algo),
                    if graph { " (graph)" } else { "" }
                );
                match engine_call(&group, &stream, shape, rank, algo, graph)? {
                    Err(Error::CallMismatch {
                        peer, mine, theirs, ..
                    }) if peer as usize == 1 - rank => {
                        let want = shape.call(rank, algo);
                        if mine.call != Some(want) || mine.tag != want.tag() {
                            return Err(format!(
                                "{what}: this rank's call named {mine}, want {want}"
                            ));
                        }
                        if theirs.tag != shape.call(1 - rank, algo).tag() {
                            return Err(format!(
                                "{what}: the peer's tag {theirs} is not its call's"
                            ));
                        }
                    }
                    other => {
                        return Err(format!(
                            "rank {rank}, {what}: expected CallMismatch naming {}, got {other:?}",
                            1 - rank
                        ))
                    }
                }
                round = round.wrapping_add(1);
                ex.all_gather(&[round]).map_err(es)?;
                group.reset().map_err(es)?;
                ex.all_gather(&[round]).map_err(es)?;
                ipc_allreduce(&group, &stream, 7168, 300 + n, algo).map_err(es)?;
                n += 1;
            }
        }
    }
    Ok(format!(
        "rank {rank}: {n} engine-shape disagreements (3x7168 vs 4x7168 bf16, 1x8192 vs 2x8192 f16, \
         1000 vs 1256 f32 on every algorithm; fused 3 vs 4 rows of 7168 on one_stage, two_stage, \
         push_ll; eager and graph) were CallMismatch on this rank, then exact after reset"
    ))
}

/// Two processes (GPU 0 and 1, or both on GPU 0), [`engine_child`].
pub(super) fn engine_processes(_g: &Gpu) {
    let n = driver::device_count().expect("device count");
    let dir = ipc_dir("engine-mismatch");
    for text in run_ranks(
        "engine_mismatch",
        &[0, 1 % n],
        &dir,
        Duration::from_secs(300),
    ) {
        println!("  {text}");
    }
}
