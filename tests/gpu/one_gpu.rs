//! A peer group on one GPU (issue 31): crossed buffers, fused in place and
//! faults.

use crate::fused::{check_norm_rank, takes_push_ll, NormCase, NORM_EPS};
use crate::harness::*;

// ---------------------------------------------------------------------------
// Issue 31: bugs found by a downstream oracle, one host per group, and the
// fault matrix. Each case a few seconds.

/// A table whose `Auto` runs two-stage at every size, on every link, for
/// every world: where a zero-copy call's rows exceed the scratch, `Auto`
/// must then fall back to one-stage instead of refusing.
pub(crate) fn two_stage_everywhere() -> p2p_allreduce::Thresholds {
    let mut t = p2p_allreduce::Thresholds::default();
    for link in [
        p2p_allreduce::Link::SameDevice,
        p2p_allreduce::Link::NvLink,
        p2p_allreduce::Link::Pcie,
    ] {
        for world in 1..=abi::MAX_RANKS {
            t.set_bands(
                link,
                world,
                vec![p2p_allreduce::thresholds::Band {
                    up_to: usize::MAX,
                    algorithm: Algorithm::TwoStage,
                }],
            )
            .expect("bands");
        }
    }
    t
}

/// Milliseconds since the epoch (the rank processes and the suite share
/// the host's clock).
pub(crate) fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// Item 5 (a), (d): a PeerGroup of two ranks on GPU 0.
/// - Staged `allreduce_raw` where rank 0's output is rank 1's input and the
///   other way round (allowed: staged inputs are copied first), chunked,
///   every algorithm and Auto: bit-exact. push_ll read an input in place
///   that the other member's output overwrote (`direct_input` looked only
///   at the launching member's ranks): wrong bits before the fix.
/// - The fused call in place (new on PeerGroup): bit-exact, every algorithm.
/// - Fused fault injection (new on PeerGroup): `PeerTimeout` naming the
///   absent rank, `Poisoned` after, and a good call after `reset`.
/// - `RegisteredBuffers::copy_from` with a bad rank: `RankOutOfRange`.
pub(crate) fn peer_one_gpu_issue31(g: &Gpu) {
    let timeout = Duration::from_millis(800);
    let cfg = Config {
        max_bytes: 256 << 10,
        push_max_bytes: 256 << 10,
        push_ll_max_bytes: 256 << 10,
        push_two_stage_max_bytes: 256 << 10,
        timeout,
        ..Config::default()
    };
    let ctxs = [g.ctx.clone(), g.ctx.clone()];
    let pg = PeerGroup::new(&ctxs, cfg).expect("PeerGroup on GPU 0 twice");
    let streams: Vec<Arc<CudaStream>> = (0..2)
        .map(|_| g.ctx.new_stream().expect("stream"))
        .collect();
    let len = 100_006usize;
    let mut choices: Vec<AlgoChoice> = Algorithm::ALL.iter().map(|&a| a.into()).collect();
    choices.push(AlgoChoice::Auto);
    let mut crossed = 0;
    for (k, &algo) in choices.iter().enumerate() {
        for rep in 0..3u64 {
            let seed = 31_000 + k as u64 * 10 + rep;
            let inputs = values::adversarial_inputs(Dtype::F32, 2, len, seed, true);
            let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference::allreduce_bits(Dtype::F32, &refs);
            let bufs: Vec<CudaSlice<f32>> = inputs
                .iter()
                .zip(&streams)
                .map(|(b, s)| upload_on::<f32>(s, b))
                .collect();
            for s in &streams {
                s.synchronize().expect("sync");
            }
            let p: Vec<u64> = bufs
                .iter()
                .zip(&streams)
                .map(|(b, s)| b.device_ptr(s).0)
                .collect();
            // SAFETY: both buffers hold `len` f32 and live until checked;
            // each is one rank's input and the other rank's output.
            let used =
                unsafe { pg.allreduce_raw(&streams, Dtype::F32, len, &p, &[p[1], p[0]], algo) }
                    .unwrap_or_else(|e| panic!("crossed {algo:?}: {e}"));
            pg.check(&streams)
                .unwrap_or_else(|e| panic!("crossed {algo:?}: {e}"));
            if let Some(a) = algo.explicit() {
                assert_eq!(used, a);
            }
            // Rank 0's output is buffer 1, rank 1's is buffer 0.
            let got = vec![
                download_on::<f32>(&streams[1], &bufs[1], len),
                download_on::<f32>(&streams[0], &bufs[0], len),
            ];
            assert_ranks(
                &format!("PeerGroup [0, 0] crossed buffers {algo:?} (ran {used:?}) seed {seed}"),
                Dtype::F32,
                &got,
                &want,
            );
            crossed += 1;
        }
    }
    // The fused call in place, every algorithm (push_ll where the rows
    // take its register path).
    let mut fused = 0;
    for (dtype, rows, hidden) in [
        (Dtype::F32, 5usize, 4096usize),
        (Dtype::Bf16, 3, 7168),
        (Dtype::F32, 3, 7),
    ] {
        for algo in [
            AlgoChoice::OneStage,
            AlgoChoice::TwoStage,
            AlgoChoice::PushLl,
            AlgoChoice::Auto,
        ] {
            if algo == AlgoChoice::PushLl && !takes_push_ll(dtype, hidden) {
                continue;
            }
            let c = NormCase {
                dtype,
                world: 2,
                rows,
                hidden,
                seed: 32_000 + fused as u64 * 3,
            };
            match dtype {
                Dtype::F32 => peer_fused_in_place::<f32>(&pg, &streams, &c, algo),
                _ => peer_fused_in_place::<half::bf16>(&pg, &streams, &c, algo),
            }
            fused += 1;
        }
    }
    // Fused fault injection: rank 1 absent.
    for algo in [AlgoChoice::OneStage, AlgoChoice::PushLl] {
        let t = Instant::now();
        let used = pg
            .add_rmsnorm_with_absent_ranks(&streams, 0b10, Dtype::F32, algo, 2, 4096)
            .unwrap_or_else(|e| panic!("fused fault injection {algo:?}: {e}"));
        if let Some(a) = algo.explicit() {
            assert_eq!(used, a);
        }
        match pg.check(&streams) {
            Err(Error::PeerTimeout { rank: 0, peer: 1, .. }) => {}
            other => panic!("fused fault injection {algo:?}: expected PeerTimeout of rank 0 naming 1, got {other:?}"),
        }
        assert!(
            t.elapsed() < timeout + Duration::from_secs(1),
            "{:?}",
            t.elapsed()
        );
        assert!(
            matches!(pg.poll(), Err(Error::Poisoned(_))),
            "poisoned after the fault"
        );
        pg.reset().expect("reset");
        let c = NormCase {
            dtype: Dtype::F32,
            world: 2,
            rows: 2,
            hidden: 4096,
            seed: 33_000,
        };
        peer_fused_in_place::<f32>(&pg, &streams, &c, algo);
    }
    // copy_from with a rank the buffers do not have: typed, no panic.
    let reg = pg.alloc_registered::<f32>(16).expect("registered");
    let src = upload_on::<f32>(&streams[0], &[1.0f32.to_bits(); 16]);
    match reg.copy_from(2, &streams[0], &src) {
        Err(Error::RankOutOfRange { rank: 2, ranks: 2 }) => {}
        other => panic!("copy_from rank 2 of 2: expected RankOutOfRange, got {other:?}"),
    }
    println!(
        "  PeerGroup on GPU 0 twice: {crossed} crossed-buffer allreduces (every algorithm and Auto, \
         {len} f32, 2 chunks) bit-exact; {fused} fused calls in place bit-exact; fused fault injection \
         (one-stage, push_ll): PeerTimeout naming rank 1, Poisoned, reset, bit-exact again; copy_from \
         rank 2: RankOutOfRange"
    );
}

/// One in-place fused call of a PeerGroup (one stream per rank), every
/// rank's residual out and normed rows (over x) against the oracle.
fn peer_fused_in_place<T: Bits>(
    pg: &PeerGroup,
    streams: &[Arc<CudaStream>],
    c: &NormCase,
    algo: AlgoChoice,
) {
    let count = c.rows * c.hidden;
    let (x, res, gam, want) = c.data();
    let what = format!(
        "PeerGroup fused in place {:?} rows {} hidden {} {algo:?}",
        c.dtype, c.rows, c.hidden
    );
    let mut xs: Vec<CudaSlice<T>> = x
        .iter()
        .zip(streams)
        .map(|(b, s)| upload_on(s, b))
        .collect();
    let mut rs: Vec<CudaSlice<T>> = res
        .iter()
        .zip(streams)
        .map(|(b, s)| upload_on(s, b))
        .collect();
    let gs: Vec<CudaSlice<T>> = gam
        .iter()
        .zip(streams)
        .map(|(b, s)| upload_on(s, b))
        .collect();
    for s in streams {
        s.synchronize().expect("sync");
    }
    let gr: Vec<&CudaSlice<T>> = gs.iter().collect();
    let used = pg
        .allreduce_add_rmsnorm_in_place(streams, &mut xs, &mut rs, &gr, NORM_EPS, algo)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    pg.check(streams).unwrap_or_else(|e| panic!("{what}: {e}"));
    if let Some(a) = algo.explicit() {
        assert_eq!(used, a, "{what}");
    }
    for r in 0..c.world {
        let got = (
            download_on(&streams[r], &rs[r], count),
            download_on(&streams[r], &xs[r], count),
        );
        check_norm_rank(&what, c.dtype, r, (&got.0, &got.1), &want[r]);
    }
}
