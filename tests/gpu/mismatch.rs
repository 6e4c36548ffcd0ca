//! Ranks that disagree about a call (issue 31, item 2). Every flag and LL
//! word carries the call's tag, so a rank never takes a peer's words of
//! another call; the waits time out and the host, reading the words left
//! in its signal, reports `Error::CallMismatch` naming the peer and both
//! calls' tags, never wrong bits and never a plain `PeerTimeout`. Then the
//! group is poisoned until `reset()`, after which it is exact again.

use super::*;
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
