//! Fused calls on registered (zero-copy) buffers, and `Auto` beyond the
//! scratch on every group kind (in-process and rank processes).

use crate::fused::{check_norm_rank, norm_mismatch, takes_push_ll, NormCase, NORM_EPS};
use crate::harness::*;
use crate::one_gpu::two_stage_everywhere;

// ---------------------------------------------------------------------------
// Fused allreduce + residual add + RMSNorm with zero-copy input: registered
// buffers of VirtualGroup and PeerGroup, eager and graph-captured.

/// Rank `r`'s `(residual, normed)` of a fused call on one group kind, for
/// the zero-copy cases: uploads `c`'s data (inputs into `reg`, on `streams[r]`),
/// runs `call`, and returns the algorithm that ran and each rank's
/// downloaded (residual out, normed), or the call's error with every
/// residual and output checked untouched.
#[allow(clippy::type_complexity)]
fn run_fused_registered<T: Bits>(
    streams: &[Arc<CudaStream>],
    reg: &RegisteredBuffers<T>,
    c: &NormCase,
    call: &mut dyn FnMut(
        &mut [CudaSlice<T>],
        &[CudaSlice<T>],
        &mut [CudaSlice<T>],
    ) -> p2p_allreduce::Result<Algorithm>,
) -> p2p_allreduce::Result<(Algorithm, Vec<(Vec<u32>, Vec<u32>)>)> {
    let count = c.rows * c.hidden;
    let (x, res, gam, _) = c.data();
    let s = |r: usize| &streams[r % streams.len()];
    for (r, xr) in x.iter().enumerate() {
        let src = upload_on::<T>(s(r), xr);
        reg.copy_from(r, s(r), &src.slice(0..count))
            .expect("registered input");
    }
    let mut rs: Vec<CudaSlice<T>> = res
        .iter()
        .enumerate()
        .map(|(r, b)| upload_on(s(r), b))
        .collect();
    let gs: Vec<CudaSlice<T>> = gam
        .iter()
        .enumerate()
        .map(|(r, b)| upload_on(s(r), b))
        .collect();
    let mut outs: Vec<CudaSlice<T>> = (0..c.world).map(|r| poisoned_on(s(r), count)).collect();
    let r = call(&mut rs, &gs, &mut outs);
    let got = (0..c.world)
        .map(|r| {
            (
                download_on(s(r), &rs[r], count),
                download_on(s(r), &outs[r], count),
            )
        })
        .collect::<Vec<_>>();
    match r {
        Ok(a) => Ok((a, got)),
        Err(e) => {
            for (r, (res_got, out_got)) in got.iter().enumerate() {
                assert_eq!(res_got, &res[r], "refused call changed residual {r}: {e}");
                assert!(
                    out_got.iter().all(|&b| b == poison::<T>().to_bits32()),
                    "refused call wrote output {r}: {e}"
                );
            }
            Err(e)
        }
    }
}

/// One VirtualGroup zero-copy fused case: bit-exact against the oracle on
/// every rank, or the refusal `refusal` says to expect (typed, with nothing
/// written).
fn fused_registered_virtual<T: Bits>(
    g: &Gpu,
    grp: &VirtualGroup,
    reg: &RegisteredBuffers<T>,
    c: &NormCase,
    algo: AlgoChoice,
    refusal: Option<fn(&Error) -> bool>,
) {
    let count = c.rows * c.hidden;
    let what = format!(
        "registered virtual {:?} world {} rows {} hidden {} {algo:?}",
        c.dtype, c.world, c.rows, c.hidden
    );
    let streams = std::slice::from_ref(&g.stream);
    let r = run_fused_registered::<T>(streams, reg, c, &mut |rs, gs, outs| {
        let gv: Vec<_> = gs.iter().map(|s| s.slice(0..c.hidden)).collect();
        let gr: Vec<&_> = gv.iter().collect();
        let mut rv: Vec<_> = rs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
        let mut ov: Vec<_> = outs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
        let r = grp.allreduce_add_rmsnorm_registered(
            &g.stream, reg, count, &mut rv, &gr, NORM_EPS, &mut ov, algo,
        );
        grp.check(&g.stream)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        r
    });
    match (r, refusal) {
        (Err(e), Some(expected)) => assert!(expected(&e), "{what}: unexpected refusal {e:?}"),
        (Err(e), None) => panic!("{what}: {e}"),
        (Ok(_), Some(_)) => panic!("{what}: ran, but should have been refused"),
        (Ok((used, got)), None) => {
            if let Some(a) = algo.explicit() {
                assert_eq!(used, a, "{what}");
            }
            let (_, _, _, want) = c.data();
            for (r, (res, norm)) in got.iter().enumerate() {
                check_norm_rank(&what, c.dtype, r, (res, norm), &want[r]);
            }
        }
    }
}

pub(crate) fn fused_registered(g: &Gpu) {
    let mut cases = 0;
    let cfg = Config {
        max_bytes: 2 << 20,
        push_ll_max_bytes: 2 << 20,
        ..Config::default()
    };
    let shapes = [
        (0usize, 7168usize),
        (1, 7168),
        (3, 7),
        (64, 4096),
        (300, 128),
        (2, 5120),
    ];
    let algos = [
        AlgoChoice::OneStage,
        AlgoChoice::TwoStage,
        AlgoChoice::PushLl,
        AlgoChoice::Auto,
    ];
    for world in [1usize, 2, 3, 8] {
        let grp = VirtualGroup::new(&g.ctx, world, cfg.clone()).expect("group");
        for dtype in Dtype::ALL {
            let cap = 64 * 4096;
            macro_rules! each {
                ($T:ty) => {{
                    let reg = grp.alloc_registered::<$T>(cap).expect("registered");
                    for &(rows, hidden) in &shapes {
                        for algo in algos {
                            let c = NormCase {
                                dtype,
                                world,
                                rows,
                                hidden,
                                seed: 20_000 + cases as u64 * 5,
                            };
                            let refusal: Option<fn(&Error) -> bool> =
                                if algo == AlgoChoice::PushLl && !takes_push_ll(dtype, hidden) {
                                    Some(|e| matches!(e, Error::NormPushLlShape { .. }))
                                } else {
                                    None
                                };
                            fused_registered_virtual::<$T>(g, &grp, &reg, &c, algo, refusal);
                            cases += 1;
                        }
                    }
                }};
            }
            match dtype {
                Dtype::F32 => each!(f32),
                Dtype::F16 => each!(half::f16),
                Dtype::Bf16 => each!(half::bf16),
            }
        }
    }
    // Typed refusals, nothing written: rows past the registered buffer,
    // a buffer of another group, rows past the scratch (explicit
    // two-stage) or the push_ll zone (explicit push_ll); Auto runs them.
    let small = Config {
        max_bytes: 64 << 10,
        push_ll_max_bytes: 64 << 10,
        ..Config::default()
    };
    let grp = VirtualGroup::new(&g.ctx, 2, small).expect("group");
    let other = VirtualGroup::new(&g.ctx, 2, cfg.clone()).expect("group");
    let reg = grp
        .alloc_registered::<half::bf16>(16 * 7168)
        .expect("registered");
    let foreign = other
        .alloc_registered::<half::bf16>(16 * 7168)
        .expect("registered");
    let big = |rows| NormCase {
        dtype: Dtype::Bf16,
        world: 2,
        rows,
        hidden: 7168,
        seed: 31,
    };
    type Refusal = Option<fn(&Error) -> bool>;
    let refusals: [(usize, AlgoChoice, Refusal); 4] = [
        (
            8,
            AlgoChoice::TwoStage,
            Some(|e| matches!(e, Error::ScratchTooSmall { .. })),
        ),
        (
            8,
            AlgoChoice::PushLl,
            Some(|e| matches!(e, Error::ZoneTooSmall { .. })),
        ),
        (8, AlgoChoice::Auto, None),
        (8, AlgoChoice::OneStage, None),
    ];
    for (rows, algo, refusal) in refusals {
        fused_registered_virtual::<half::bf16>(g, &grp, &reg, &big(rows), algo, refusal);
        cases += 1;
    }
    let too_many = |e: &Error| {
        matches!(
            e,
            Error::BufferTooSmall {
                what: "registered buffer",
                ..
            }
        )
    };
    let r = run_fused_registered::<half::bf16>(
        std::slice::from_ref(&g.stream),
        &foreign,
        &big(1),
        &mut |rs, gs, outs| {
            let gr: Vec<&_> = gs.iter().collect();
            grp.allreduce_add_rmsnorm_registered(
                &g.stream,
                &foreign,
                7168,
                rs,
                &gr,
                NORM_EPS,
                outs,
                AlgoChoice::Auto,
            )
        },
    );
    assert!(
        matches!(r, Err(Error::ForeignRegistered)),
        "foreign: {:?}",
        r.err()
    );
    let c17 = big(17);
    let mut rs: Vec<CudaSlice<half::bf16>> = (0..2).map(|_| poisoned(g, 17 * 7168)).collect();
    let gs: Vec<CudaSlice<half::bf16>> = (0..2).map(|_| poisoned(g, 7168)).collect();
    let gr: Vec<&_> = gs.iter().collect();
    let mut outs: Vec<CudaSlice<half::bf16>> = (0..2).map(|_| poisoned(g, 17 * 7168)).collect();
    let r = grp.allreduce_add_rmsnorm_registered(
        &g.stream,
        &reg,
        c17.rows * c17.hidden,
        &mut rs,
        &gr,
        NORM_EPS,
        &mut outs,
        AlgoChoice::Auto,
    );
    assert!(
        r.as_ref().is_err_and(too_many),
        "past the registered buffer: {r:?}"
    );
    grp.check(&g.stream)
        .expect("refusals leave the group healthy");

    // Captured once, replayed with new data in the registered buffers and
    // new residuals: every replay bit-exact (virtual ranks).
    let grp = VirtualGroup::new(&g.ctx, 2, cfg.clone()).expect("group");
    let (rows, hidden) = (3usize, 7168usize);
    let count = rows * hidden;
    let reg = grp
        .alloc_registered::<half::bf16>(count)
        .expect("registered");
    let mut rs: Vec<CudaSlice<half::bf16>> = (0..2).map(|_| poisoned(g, count)).collect();
    let mut gs: Vec<CudaSlice<half::bf16>> = (0..2).map(|_| poisoned(g, hidden)).collect();
    let mut outs: Vec<CudaSlice<half::bf16>> = (0..2).map(|_| poisoned(g, count)).collect();
    g.stream.synchronize().expect("sync");
    let graph = {
        let gr: Vec<&_> = gs.iter().collect();
        capture(g, || {
            grp.allreduce_add_rmsnorm_registered(
                &g.stream,
                &reg,
                count,
                &mut rs,
                &gr,
                NORM_EPS,
                &mut outs,
                AlgoChoice::Auto,
            )
        })
    };
    for it in 0..5u64 {
        let c = NormCase {
            dtype: Dtype::Bf16,
            world: 2,
            rows,
            hidden,
            seed: 40_000 + it,
        };
        let (x, res, gam, want) = c.data();
        for r in 0..2 {
            let src = upload::<half::bf16>(g, &x[r]);
            reg.copy_from(r, &g.stream, &src).expect("input");
            let host = |b: &[u32]| {
                b.iter()
                    .map(|&v| half::bf16::from_bits(v as u16))
                    .collect::<Vec<_>>()
            };
            g.stream
                .memcpy_htod(&host(&res[r]), &mut rs[r])
                .expect("residual");
            g.stream
                .memcpy_htod(&host(&gam[r]), &mut gs[r])
                .expect("gamma");
            g.stream
                .memcpy_htod(&vec![poison::<half::bf16>(); count], &mut outs[r])
                .expect("poison");
        }
        graph.launch().expect("graph launch");
        grp.check(&g.stream)
            .unwrap_or_else(|e| panic!("virtual fused graph replay {it}: {e}"));
        for r in 0..2 {
            let got = (download(g, &rs[r], count), download(g, &outs[r], count));
            check_norm_rank(
                &format!("virtual fused graph replay {it}"),
                Dtype::Bf16,
                r,
                (&got.0, &got.1),
                &want[r],
            );
        }
        cases += 1;
    }

    // Real ranks: a PeerGroup on every placement (across GPUs when there
    // are two), bf16 rows of 7168 and f32 rows of 7 (the tail path).
    let ctxs = all_gpus(g);
    let mut peer_cases = 0;
    for place in placements(ctxs.len()) {
        let world = place.len();
        let (pg, streams) = peer_setup(&ctxs, &place, cfg.clone());
        let reg16 = pg
            .alloc_registered::<half::bf16>(64 * 7168)
            .expect("registered");
        let reg32 = pg.alloc_registered::<f32>(64 * 7168).expect("registered");
        for (dtype, rows, hidden) in [
            (Dtype::Bf16, 1usize, 7168usize),
            (Dtype::Bf16, 64, 7168),
            (Dtype::Bf16, 0, 7168),
            (Dtype::F32, 3, 7),
        ] {
            for algo in algos {
                let c = NormCase {
                    dtype,
                    world,
                    rows,
                    hidden,
                    seed: 50_000 + peer_cases as u64 * 3,
                };
                let count = rows * hidden;
                let what = format!("registered PeerGroup GPUs {place:?} {dtype:?} rows {rows} hidden {hidden} {algo:?}");
                let refused = algo == AlgoChoice::PushLl && !takes_push_ll(dtype, hidden);
                macro_rules! go {
                    ($T:ty, $reg:expr) => {{
                        run_fused_registered::<$T>(&streams, $reg, &c, &mut |rs, gs, outs| {
                            let gv: Vec<_> = gs.iter().map(|s| s.slice(0..hidden)).collect();
                            let gr: Vec<&_> = gv.iter().collect();
                            let mut rv: Vec<_> =
                                rs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
                            let mut ov: Vec<_> =
                                outs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
                            let r = pg.allreduce_add_rmsnorm_registered(
                                &streams, $reg, count, &mut rv, &gr, NORM_EPS, &mut ov, algo,
                            );
                            pg.check(&streams).unwrap_or_else(|e| panic!("{what}: {e}"));
                            r
                        })
                    }};
                }
                let r = match dtype {
                    Dtype::F32 => go!(f32, &reg32),
                    _ => go!(half::bf16, &reg16),
                };
                match r {
                    Err(Error::NormPushLlShape { .. }) if refused => {}
                    Err(e) => panic!("{what}: {e}"),
                    Ok(_) if refused => panic!("{what}: ran, but should have been refused"),
                    Ok((used, got)) => {
                        if let Some(a) = algo.explicit() {
                            assert_eq!(used, a, "{what}");
                        }
                        let (_, _, _, want) = c.data();
                        for (r, (res, norm)) in got.iter().enumerate() {
                            check_norm_rank(&what, dtype, r, (res, norm), &want[r]);
                        }
                    }
                }
                peer_cases += 1;
            }
        }
    }
    println!("  {cases} virtual-rank zero-copy fused cases (bit-exact, typed refusals untouched, 5 graph replays) and {peer_cases} PeerGroup ones");
}

/// Item 5 (b): a zero-copy fused call under `Auto` whose rows (64 x 4096
/// f32 = 1 MiB) exceed the scratch (64 KiB), with a table that says
/// two-stage: it runs one-stage, bit-exact, on a VirtualGroup, a PeerGroup
/// (GPU 0 twice; across GPUs 0 and 1 where there are two) and a
/// ProcessGroup of two processes on GPU 0. An explicit two-stage is
/// refused (`ScratchTooSmall`, nothing written). Before the fix, `Auto`
/// returned `ScratchTooSmall`.
pub(crate) fn fused_auto_beyond_scratch(g: &Gpu) {
    let cfg = fused_auto_config();
    let c = NormCase {
        dtype: Dtype::F32,
        world: 2,
        rows: 64,
        hidden: 4096,
        seed: 34_000,
    };
    let count = c.rows * c.hidden;
    let (_, _, _, want) = c.data();
    // Virtual ranks.
    let grp = VirtualGroup::new(&g.ctx, 2, cfg.clone()).expect("group");
    let reg = grp.alloc_registered::<f32>(count).expect("registered");
    for algo in [AlgoChoice::Auto, AlgoChoice::TwoStage] {
        let r = run_fused_registered::<f32>(
            std::slice::from_ref(&g.stream),
            &reg,
            &c,
            &mut |rs, gs, outs| {
                let gr: Vec<&_> = gs.iter().collect();
                let r = grp.allreduce_add_rmsnorm_registered(
                    &g.stream, &reg, count, rs, &gr, NORM_EPS, outs, algo,
                );
                grp.check(&g.stream).expect("check");
                r
            },
        );
        fused_auto_outcome("VirtualGroup", algo, r, &want);
    }
    // Real ranks: GPU 0 twice, and across GPUs where there are two.
    let ctxs = all_gpus(g);
    let mut places = vec![vec![0usize, 0]];
    if ctxs.len() >= 2 {
        places.push(vec![0, 1]);
    }
    for place in &places {
        let (pg, streams) = peer_setup(&ctxs, place, cfg.clone());
        let reg = pg.alloc_registered::<f32>(count).expect("registered");
        for algo in [AlgoChoice::Auto, AlgoChoice::TwoStage] {
            let r = run_fused_registered::<f32>(&streams, &reg, &c, &mut |rs, gs, outs| {
                let gr: Vec<&_> = gs.iter().collect();
                let r = pg.allreduce_add_rmsnorm_registered(
                    &streams, &reg, count, rs, &gr, NORM_EPS, outs, algo,
                );
                pg.check(&streams).expect("check");
                r
            });
            fused_auto_outcome(&format!("PeerGroup {place:?}"), algo, r, &want);
        }
    }
    // Two processes on GPU 0.
    let dir = ipc_dir("auto-fused");
    let texts = run_ranks("auto_fused", &[0, 0], &dir, Duration::from_secs(120));
    for (r, text) in texts.iter().enumerate() {
        println!("  ProcessGroup rank {r}: {text}");
    }
    println!(
        "  64 x 4096 f32 zero-copy, 64 KiB scratch, table says two-stage: Auto ran one-stage bit-exact on \
         VirtualGroup, PeerGroup {places:?} and a ProcessGroup of two processes on GPU 0; explicit \
         two-stage refused (ScratchTooSmall, nothing written)"
    );
}

fn fused_auto_config() -> Config {
    Config {
        max_bytes: 64 << 10,
        push_ll_max_bytes: 64 << 10,
        thresholds: two_stage_everywhere(),
        ..Config::default()
    }
}

/// A zero-copy fused case's outcome: the algorithm that ran and every
/// rank's (residual out, normed rows), or the refusal.
type FusedOutcome = p2p_allreduce::Result<(Algorithm, Vec<(Vec<u32>, Vec<u32>)>)>;

/// What `fused_auto_beyond_scratch` expects of `algo`: Auto runs one-stage
/// and every rank is bit-exact; two-stage is refused.
fn fused_auto_outcome(
    what: &str,
    algo: AlgoChoice,
    r: FusedOutcome,
    want: &[(Vec<u32>, Vec<u32>)],
) {
    match (algo, r) {
        (AlgoChoice::Auto, Ok((used, got))) => {
            assert_eq!(used, Algorithm::OneStage, "{what}: Auto");
            for (r, (res, norm)) in got.iter().enumerate() {
                check_norm_rank(
                    &format!("{what} Auto"),
                    Dtype::F32,
                    r,
                    (res, norm),
                    &want[r],
                );
            }
        }
        (AlgoChoice::Auto, Err(e)) => panic!("{what}: Auto refused a zero-copy fused call: {e}"),
        (_, Err(Error::ScratchTooSmall { .. })) => {}
        (a, other) => panic!(
            "{what}: {a:?}: expected ScratchTooSmall, got {:?}",
            other.map(|x| x.0)
        ),
    }
}

/// The ProcessGroup side of `fused_auto_beyond_scratch` (two processes).
pub(crate) fn auto_fused_child(rank: usize) -> Result<String, String> {
    let env = |k: &str| std::env::var(k).map_err(|e| format!("{k}: {e}"));
    let gpu: usize = env("P2P_IPC_GPU")?.parse().map_err(|e| format!("{e}"))?;
    let dir = std::path::PathBuf::from(env("P2P_IPC_DIR")?);
    let ctx = driver::open_device(gpu).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let ex = DirExchange::new(&dir, rank, 2, Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let group = ProcessGroup::new(&ctx, &ex, fused_auto_config()).map_err(|e| e.to_string())?;
    let c = NormCase {
        dtype: Dtype::F32,
        world: 2,
        rows: 64,
        hidden: 4096,
        seed: 34_000,
    };
    let count = c.rows * c.hidden;
    let (x, res, gam, want) = c.data();
    let e = |e: Error| e.to_string();
    let reg = driver::DeviceAlloc::zeroed(&ctx, count * 4).map_err(e)?;
    // SAFETY: `reg` outlives the group's use of it.
    unsafe { group.register_buffer(&ex, reg.ptr(), count * 4) }.map_err(e)?;
    reg.write(&x[rank]).map_err(e)?;
    let fres = driver::DeviceAlloc::zeroed(&ctx, count * 4).map_err(e)?;
    let fgam = driver::DeviceAlloc::zeroed(&ctx, c.hidden * 4).map_err(e)?;
    let fout = driver::DeviceAlloc::zeroed(&ctx, count * 4).map_err(e)?;
    let mut lines = Vec::new();
    for algo in [AlgoChoice::Auto, AlgoChoice::TwoStage] {
        fres.write(&res[rank]).map_err(e)?;
        fgam.write(&gam[rank]).map_err(e)?;
        fout.write(&vec![poison::<f32>().to_bits(); count])
            .map_err(e)?;
        // SAFETY: the input lies in `reg`; the others hold count / hidden
        // f32 and live until the check below.
        let r = unsafe {
            group.allreduce_add_rmsnorm_registered_raw(
                &stream,
                Dtype::F32,
                c.rows,
                c.hidden,
                NORM_EPS,
                [reg.ptr(), fres.ptr(), fgam.ptr(), fout.ptr()],
                algo,
            )
        };
        group.check(&stream).map_err(e)?;
        let mut got_res = vec![0u32; count];
        let mut got_norm = vec![0u32; count];
        fres.read(&mut got_res).map_err(e)?;
        fout.read(&mut got_norm).map_err(e)?;
        match (algo, r) {
            (AlgoChoice::Auto, Ok(Algorithm::OneStage)) => {
                norm_mismatch(
                    "ProcessGroup Auto",
                    Dtype::F32,
                    rank,
                    (&got_res, &got_norm),
                    &want[rank],
                )?;
                lines.push("Auto ran one-stage, bit-exact".to_string());
            }
            (AlgoChoice::Auto, other) => {
                return Err(format!("Auto: expected Ok(OneStage), got {other:?}"))
            }
            (_, Err(Error::ScratchTooSmall { .. })) => {
                if got_res != res[rank] || got_norm.iter().any(|&b| b != poison::<f32>().to_bits())
                {
                    return Err("the refused two-stage wrote its outputs".into());
                }
                lines.push("two-stage refused (ScratchTooSmall), nothing written".to_string());
            }
            (a, other) => return Err(format!("{a:?}: expected ScratchTooSmall, got {other:?}")),
        }
    }
    Ok(lines.join("; "))
}
