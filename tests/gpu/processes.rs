//! Rank processes: the IPC process group on every GPU, and the child side
//! (`ipc_child`, dispatched from `main` on `P2P_IPC_CHILD`).

use crate::faults::{fault_child, KILL_TIMEOUT};
use crate::fused::{norm_mismatch, takes_push_ll, NormCase, NORM_EPS};
use crate::fused_registered::auto_fused_child;
use crate::harness::*;
use crate::{mismatch, shared_host};

/// N processes, rank r on GPU `r % gpus` (across devices when there are two
/// or more GPUs; kernels of processes sharing a GPU time-slice, slowly but
/// correctly), open each other's IPC handles and allreduce.
pub(crate) fn ipc_processes(_g: &Gpu) {
    let n = driver::device_count().expect("device count");
    for world in [2usize, 3] {
        let dir = ipc_dir(&format!("ipc-{world}"));
        let gpus: Vec<usize> = (0..world).map(|r| r % n).collect();
        let t0 = Instant::now();
        let texts = run_ranks("sweep", &gpus, &dir, Duration::from_secs(180));
        for (r, text) in texts.iter().enumerate() {
            println!("  world {world} rank {r} (GPU {}): {text}", gpus[r]);
        }
        println!(
            "  {world} processes on GPUs {gpus:?} completed allreduces over CUDA IPC in {:.2} s",
            t0.elapsed().as_secs_f64()
        );
    }
    if n < 2 {
        println!("  cross-device IPC: not run (this machine has 1 GPU)");
    }
}

pub(crate) fn ipc_config(timeout: Duration) -> Config {
    Config {
        max_bytes: 256 << 10,
        timeout,
        ..Config::default()
    }
}

/// One f32 allreduce of `len` elements on a ProcessGroup, checked against
/// the reference on this rank.
pub(crate) fn ipc_allreduce(
    group: &ProcessGroup,
    stream: &Arc<CudaStream>,
    len: usize,
    seed: u64,
    algo: Algorithm,
) -> Result<(), Error> {
    let (rank, world) = (group.rank(), group.world());
    let inputs = values::adversarial_inputs(Dtype::F32, world, len, seed, true);
    let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(Dtype::F32, &refs);
    let mine: Vec<f32> = inputs[rank].iter().map(|&b| f32::from_bits(b)).collect();
    let input = stream.clone_htod(&mine).expect("htod");
    let mut output = stream
        .clone_htod(&vec![poison::<f32>(); len])
        .expect("htod");
    group.allreduce(stream, &input, &mut output, algo.into())?;
    group.check(stream)?;
    let got: Vec<u32> = stream
        .clone_dtoh(&output)
        .expect("dtoh")
        .iter()
        .map(|x| x.to_bits())
        .collect();
    if let Some((i, a, b)) = reference::first_mismatch(Dtype::F32, &got, &want) {
        panic!("{algo:?} len {len}: element {i}: got {a:#x} want {b:#x}");
    }
    Ok(())
}

/// The killed-rank test's rank processes (see [`killed_rank`]).
fn kill_child(rank: usize, mode: &str) -> Result<String, String> {
    let env = |k: &str| std::env::var(k).map_err(|e| format!("{k}: {e}"));
    let gpu: usize = env("P2P_IPC_GPU")?.parse().map_err(|e| format!("{e}"))?;
    let dir = std::path::PathBuf::from(env("P2P_IPC_DIR")?);
    let ctx = driver::open_device(gpu).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let join = |dir: &std::path::Path| -> Result<ProcessGroup, String> {
        let ex =
            DirExchange::new(dir, rank, 2, Duration::from_secs(60)).map_err(|e| e.to_string())?;
        ProcessGroup::new(&ctx, &ex, ipc_config(KILL_TIMEOUT)).map_err(|e| e.to_string())
    };
    let rounds = |group: &ProcessGroup| -> Result<(), String> {
        for (k, len) in [1usize, 1000, 100_003].into_iter().enumerate() {
            for algo in Algorithm::ALL {
                ipc_allreduce(group, &stream, len, 50 + k as u64, algo)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    };
    match mode {
        "victim" => {
            let group = join(&dir)?;
            let t0 = Instant::now();
            for i in 0u64.. {
                ipc_allreduce(&group, &stream, 10_000, i, Algorithm::ALL[(i % 2) as usize])
                    .map_err(|e| e.to_string())?;
                if i == 20 {
                    std::fs::write(dir.join("victim-running"), b"").map_err(|e| e.to_string())?;
                }
                if t0.elapsed() > Duration::from_secs(120) {
                    break;
                }
            }
            Err("the victim was never killed".into())
        }
        "survivor" => {
            let group = join(&dir.join("first"))?;
            let t0 = Instant::now();
            let mut done = 0u64;
            let (err, took) = loop {
                let t = Instant::now();
                match ipc_allreduce(
                    &group,
                    &stream,
                    10_000,
                    done,
                    Algorithm::ALL[(done % 2) as usize],
                ) {
                    Ok(()) => done += 1,
                    Err(e) => break (e, t.elapsed()),
                }
                if t0.elapsed() > Duration::from_secs(120) {
                    return Err(format!(
                        "no error after {done} allreduces: the peer's death was not noticed"
                    ));
                }
            };
            let peer = match err {
                Error::PeerTimeout { peer, .. } => peer,
                other => return Err(format!("expected PeerTimeout, got {other}")),
            };
            if peer != 1 {
                return Err(format!(
                    "PeerTimeout names peer {peer}, not the killed rank 1"
                ));
            }
            if took > KILL_TIMEOUT + Duration::from_secs(2) {
                return Err(format!(
                    "the failing call took {took:?} with a {KILL_TIMEOUT:?} timeout"
                ));
            }
            // Poisoned until reset; reset works without the dead peer.
            match ipc_allreduce(&group, &stream, 10, 1, Algorithm::OneStage) {
                Err(Error::Poisoned(_)) => {}
                other => {
                    return Err(format!(
                        "after the timeout: expected Poisoned, got {other:?}"
                    ))
                }
            }
            group.reset().map_err(|e| format!("reset: {e}"))?;
            drop(group);
            let group = join(&dir.join("second"))?;
            rounds(&group)?;
            Ok(format!(
                "{done} allreduces, then rank 1 was killed: PeerTimeout naming peer 1 after {:.2} s \
                 (timeout {:?}); reset, new group with a new rank 1: 6 allreduces bit-exact",
                took.as_secs_f64(),
                KILL_TIMEOUT
            ))
        }
        "rejoin" => {
            let group = join(&dir)?;
            rounds(&group)?;
            Ok("joined the new group; 6 allreduces bit-exact".into())
        }
        other => Err(format!("unknown mode {other}")),
    }
}

pub(crate) fn ipc_child(rank: usize) -> i32 {
    let mode = std::env::var("P2P_IPC_MODE").unwrap_or_else(|_| "sweep".into());
    if matches!(
        mode.as_str(),
        "fault" | "auto_fused" | "mismatch" | "engine_mismatch" | "shared_host"
    ) {
        let r = match mode.as_str() {
            "fault" => fault_child(rank),
            "mismatch" => mismatch::child(rank),
            "engine_mismatch" => mismatch::engine_child(rank),
            "shared_host" => shared_host::child(rank),
            _ => auto_fused_child(rank),
        };
        return match r {
            Ok(msg) => {
                println!("{msg}");
                0
            }
            Err(e) => {
                println!("rank {rank} ({mode}): {e}");
                1
            }
        };
    }
    if mode != "sweep" {
        return match kill_child(rank, &mode) {
            Ok(msg) => {
                println!("{msg}");
                0
            }
            Err(e) => {
                println!("rank {rank} ({mode}): {e}");
                1
            }
        };
    }
    let run = || -> Result<String, String> {
        let world: usize = std::env::var("P2P_IPC_WORLD")
            .map_err(|e| e.to_string())?
            .parse()
            .map_err(|e| format!("{e}"))?;
        let dir =
            std::path::PathBuf::from(std::env::var("P2P_IPC_DIR").map_err(|e| e.to_string())?);
        let gpu: usize = std::env::var("P2P_IPC_GPU")
            .map_err(|e| e.to_string())?
            .parse()
            .map_err(|e| format!("{e}"))?;
        let ctx = driver::open_device(gpu).map_err(|e| e.to_string())?;
        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
        let ex = DirExchange::new(&dir, rank, world, Duration::from_secs(60))
            .map_err(|e| e.to_string())?;
        let group = ProcessGroup::new(&ctx, &ex, ipc_config(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        let mut done = 0;
        for algo in Algorithm::ALL {
            for len in [1usize, 1000, 100_003] {
                let inputs =
                    values::adversarial_inputs(Dtype::F32, world, len, len as u64 + 7, true);
                let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
                let want = reference::allreduce_bits(Dtype::F32, &refs);
                let mine: Vec<f32> = inputs[rank].iter().map(|&b| f32::from_bits(b)).collect();
                let input = stream.clone_htod(&mine).map_err(|e| e.to_string())?;
                let mut output = stream
                    .clone_htod(&vec![poison::<f32>(); len])
                    .map_err(|e| e.to_string())?;
                group
                    .allreduce(&stream, &input, &mut output, algo.into())
                    .map_err(|e| e.to_string())?;
                group.check(&stream).map_err(|e| e.to_string())?;
                let got: Vec<u32> = stream
                    .clone_dtoh(&output)
                    .map_err(|e| e.to_string())?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                if let Some((i, a, b)) = reference::first_mismatch(Dtype::F32, &got, &want) {
                    return Err(format!(
                        "{algo:?} len {len}: element {i}: got {a:#x} want {b:#x}"
                    ));
                }
                done += 1;
            }
        }
        // Checked calls: agreeing ranks go through, a rank with another
        // length is refused on every rank before any kernel runs.
        let ones = stream
            .clone_htod(&vec![1.0f32; 64])
            .map_err(|e| e.to_string())?;
        let mut out = stream
            .clone_htod(&vec![poison::<f32>(); 64])
            .map_err(|e| e.to_string())?;
        group
            .allreduce_checked(&ex, &stream, &ones, &mut out, AlgoChoice::Auto)
            .map_err(|e| e.to_string())?;
        group.check(&stream).map_err(|e| e.to_string())?;
        let got = stream.clone_dtoh(&out).map_err(|e| e.to_string())?;
        if got != vec![world as f32; 64] {
            return Err(format!("checked allreduce gave {:?}", &got[..4]));
        }
        let len = if rank == 0 { 63 } else { 64 };
        let short = stream
            .clone_htod(&vec![1.0f32; len])
            .map_err(|e| e.to_string())?;
        match group.allreduce_checked(&ex, &stream, &short, &mut out, AlgoChoice::Auto) {
            Err(Error::RankMismatch { .. }) => {}
            other => {
                return Err(format!(
                    "mismatched lengths: expected RankMismatch, got {other:?}"
                ))
            }
        }
        // Zero-copy allreduces captured in a CUDA graph: launching before
        // registration is a typed error; after register_captured every replay
        // is bit-exact with new inputs.
        let glen = 30_001usize;
        let gin = driver::DeviceAlloc::zeroed(&ctx, glen * 4).map_err(|e| e.to_string())?;
        let gout1 = driver::DeviceAlloc::zeroed(&ctx, glen * 4).map_err(|e| e.to_string())?;
        let gout2 = driver::DeviceAlloc::zeroed(&ctx, glen * 4).map_err(|e| e.to_string())?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| e.to_string())?;
        // SAFETY: the three buffers outlive the graph and hold glen f32.
        let captured = unsafe {
            group
                .allreduce_in_graph(
                    &stream,
                    Dtype::F32,
                    glen,
                    gin.ptr(),
                    gout1.ptr(),
                    AlgoChoice::OneStage,
                )
                .and_then(|_| {
                    group.allreduce_in_graph(
                        &stream,
                        Dtype::F32,
                        glen,
                        gin.ptr(),
                        gout2.ptr(),
                        AlgoChoice::TwoStage,
                    )
                })
        };
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| e.to_string())?;
        captured.map_err(|e| e.to_string())?;
        let graph = graph.ok_or("empty graph")?;
        graph.launch().map_err(|e| e.to_string())?;
        match group.check(&stream) {
            Err(Error::Unregistered { .. }) => {}
            other => {
                return Err(format!(
                    "graph before registration: expected Unregistered, got {other:?}"
                ))
            }
        }
        group.reset().map_err(|e| e.to_string())?;
        let n = group.register_captured(&ex).map_err(|e| e.to_string())?;
        if n != 2 {
            return Err(format!("registered {n} captured allreduces, expected 2"));
        }
        for it in 0..20u64 {
            let inputs = values::adversarial_inputs(Dtype::F32, world, glen, 900 + it, it % 3 == 0);
            let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference::allreduce_bits(Dtype::F32, &refs);
            gin.write(&inputs[rank]).map_err(|e| e.to_string())?;
            gout1
                .write(&vec![poison::<f32>().to_bits(); glen])
                .map_err(|e| e.to_string())?;
            gout2
                .write(&vec![poison::<f32>().to_bits(); glen])
                .map_err(|e| e.to_string())?;
            // No host-side barrier around the replay: Start orders reads
            // after every rank's write, and once this rank's graph has
            // completed (End / Mid passed) no peer still reads its input.
            graph.launch().map_err(|e| e.to_string())?;
            group
                .check(&stream)
                .map_err(|e| format!("replay {it}: {e}"))?;
            for o in [&gout1, &gout2] {
                let mut got = vec![0u32; glen];
                o.read(&mut got).map_err(|e| e.to_string())?;
                if let Some((i, a, b)) = reference::first_mismatch(Dtype::F32, &got, &want) {
                    return Err(format!(
                        "graph replay {it}: element {i}: got {a:#x} want {b:#x}"
                    ));
                }
            }
        }
        // Registered (eager, zero-copy) buffers: every rank registers one
        // buffer; allreduces at two offsets and with every algorithm read
        // the peers' buffers where they are. A pointer outside it and a
        // message running past it are typed errors.
        let rlen = 2 * glen + 4096;
        let reg = driver::DeviceAlloc::zeroed(&ctx, rlen * 4).map_err(|e| e.to_string())?;
        // SAFETY: `reg` outlives the group's use of it (dropped after the
        // last allreduce below has been checked).
        unsafe { group.register_buffer(&ex, reg.ptr(), rlen * 4) }.map_err(|e| e.to_string())?;
        let mut registered = 0;
        for (k, &at) in [0usize, 4096].iter().enumerate() {
            for (j, algo) in Algorithm::ALL.into_iter().enumerate() {
                let seed = 2000 + (k * 10 + j) as u64;
                let inputs = values::adversarial_inputs(Dtype::F32, world, glen, seed, j % 2 == 0);
                let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
                let want = reference::allreduce_bits(Dtype::F32, &refs);
                // SAFETY: `at + glen` f32 lie inside `reg` (rlen elements).
                unsafe { driver::write_at(&ctx, reg.ptr() + (at * 4) as u64, &inputs[rank]) }
                    .map_err(|e| e.to_string())?;
                gout1
                    .write(&vec![poison::<f32>().to_bits(); glen])
                    .map_err(|e| e.to_string())?;
                // SAFETY: input inside `reg`, output `gout1` of glen f32; both
                // live until the check below has waited for the stream.
                unsafe {
                    group.allreduce_registered_raw(
                        &stream,
                        Dtype::F32,
                        glen,
                        reg.ptr() + (at * 4) as u64,
                        gout1.ptr(),
                        algo.into(),
                    )
                }
                .map_err(|e| format!("registered {algo:?} at {at}: {e}"))?;
                group
                    .check(&stream)
                    .map_err(|e| format!("registered {algo:?} at {at}: {e}"))?;
                let mut got = vec![0u32; glen];
                gout1.read(&mut got).map_err(|e| e.to_string())?;
                if let Some((i, a, b)) = reference::first_mismatch(Dtype::F32, &got, &want) {
                    return Err(format!(
                        "registered {algo:?} at {at}: element {i}: got {a:#x} want {b:#x}"
                    ));
                }
                registered += 1;
            }
        }
        // SAFETY: the pointers are live (gin, reg); the calls are refused
        // before any work is enqueued.
        match unsafe {
            group.allreduce_registered_raw(
                &stream,
                Dtype::F32,
                16,
                gin.ptr(),
                gout1.ptr(),
                AlgoChoice::Auto,
            )
        } {
            Err(Error::NotRegistered { .. }) => {}
            other => {
                return Err(format!(
                    "unregistered input: expected NotRegistered, got {other:?}"
                ))
            }
        }
        // SAFETY: as above.
        match unsafe {
            group.allreduce_registered_raw(
                &stream,
                Dtype::F32,
                glen,
                reg.ptr() + ((rlen - 16) * 4) as u64,
                gout1.ptr(),
                AlgoChoice::Auto,
            )
        } {
            Err(Error::BufferTooSmall { .. }) => {}
            other => {
                return Err(format!(
                    "past the registered buffer: expected BufferTooSmall, got {other:?}"
                ))
            }
        }
        // The fused allreduce + residual add + RMSNorm on this rank: every
        // rank's residual out and normed rows against the oracle.
        let mut fused = 0;
        for (k, &(rows, hidden)) in [
            (0usize, 7168usize),
            (1, 7168),
            (3, 7),
            (64, 4096),
            (300, 128),
        ]
        .iter()
        .enumerate()
        {
            for (j, algo) in [
                AlgoChoice::OneStage,
                AlgoChoice::TwoStage,
                AlgoChoice::PushLl,
                AlgoChoice::Auto,
            ]
            .into_iter()
            .enumerate()
            {
                let c = NormCase {
                    dtype: Dtype::F32,
                    world,
                    rows,
                    hidden,
                    seed: 3000 + (k * 10 + j) as u64,
                };
                let (x, res, gam, want) = c.data();
                let f = |b: &[u32]| b.iter().map(|&v| f32::from_bits(v)).collect::<Vec<f32>>();
                let count = rows * hidden;
                let xin = stream.clone_htod(&f(&x[rank])).map_err(|e| e.to_string())?;
                let mut rin = stream
                    .clone_htod(&f(&res[rank]))
                    .map_err(|e| e.to_string())?;
                let gin = stream
                    .clone_htod(&f(&gam[rank]))
                    .map_err(|e| e.to_string())?;
                let mut out = stream
                    .clone_htod(&vec![poison::<f32>(); count])
                    .map_err(|e| e.to_string())?;
                let what = format!("fused rows {rows} hidden {hidden} {algo:?}");
                let r = group
                    .allreduce_add_rmsnorm(&stream, &xin, &mut rin, &gin, NORM_EPS, &mut out, algo);
                if algo == AlgoChoice::PushLl && !takes_push_ll(Dtype::F32, hidden) {
                    match r {
                        Err(Error::NormPushLlShape { .. }) => continue,
                        other => {
                            return Err(format!("{what}: expected NormPushLlShape, got {other:?}"))
                        }
                    }
                }
                r.map_err(|e| format!("{what}: {e}"))?;
                group.check(&stream).map_err(|e| format!("{what}: {e}"))?;
                let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                let got_res = bits(stream.clone_dtoh(&rin).map_err(|e| e.to_string())?);
                let got_norm = bits(stream.clone_dtoh(&out).map_err(|e| e.to_string())?);
                norm_mismatch(&what, Dtype::F32, rank, (&got_res, &got_norm), &want[rank])?;
                fused += 1;
            }
        }
        // Fused with zero-copy input: from the registered buffer, and
        // captured in a graph (registered after capture, new data per replay).
        let f32s = |b: &[u32]| b.iter().map(|&v| f32::from_bits(v)).collect::<Vec<f32>>();
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let mut fused_zero_copy = 0;
        for (k, &(rows, hidden)) in [(1usize, 7168usize), (3, 7), (5, 4096)].iter().enumerate() {
            for (j, algo) in [
                AlgoChoice::OneStage,
                AlgoChoice::TwoStage,
                AlgoChoice::PushLl,
            ]
            .into_iter()
            .enumerate()
            {
                let c = NormCase {
                    dtype: Dtype::F32,
                    world,
                    rows,
                    hidden,
                    seed: 4000 + (k * 10 + j) as u64,
                };
                let (x, res, gam, want) = c.data();
                let count = rows * hidden;
                // SAFETY: count <= rlen f32 inside `reg`.
                unsafe { driver::write_at(&ctx, reg.ptr(), &x[rank]) }
                    .map_err(|e| e.to_string())?;
                let rin = stream
                    .clone_htod(&f32s(&res[rank]))
                    .map_err(|e| e.to_string())?;
                let gin = stream
                    .clone_htod(&f32s(&gam[rank]))
                    .map_err(|e| e.to_string())?;
                let out = stream
                    .clone_htod(&vec![poison::<f32>(); count])
                    .map_err(|e| e.to_string())?;
                let what = format!("registered fused rows {rows} hidden {hidden} {algo:?}");
                let refused = algo == AlgoChoice::PushLl && !takes_push_ll(Dtype::F32, hidden);
                {
                    let (rp, _g1) = rin.device_ptr(&stream);
                    let (gp, _g2) = gin.device_ptr(&stream);
                    let (op, _g3) = out.device_ptr(&stream);
                    // SAFETY: input inside `reg`; residual, gamma and output
                    // live slices of count / hidden f32, checked below after
                    // the stream is done.
                    let r = unsafe {
                        group.allreduce_add_rmsnorm_registered_raw(
                            &stream,
                            Dtype::F32,
                            rows,
                            hidden,
                            NORM_EPS,
                            [reg.ptr(), rp, gp, op],
                            algo,
                        )
                    };
                    match r {
                        Err(Error::NormPushLlShape { .. }) if refused => continue,
                        _ if refused => {
                            return Err(format!("{what}: expected NormPushLlShape, got {r:?}"))
                        }
                        r => r.map_err(|e| format!("{what}: {e}"))?,
                    };
                }
                group.check(&stream).map_err(|e| format!("{what}: {e}"))?;
                let got_res = bits(stream.clone_dtoh(&rin).map_err(|e| e.to_string())?);
                let got_norm = bits(stream.clone_dtoh(&out).map_err(|e| e.to_string())?);
                norm_mismatch(&what, Dtype::F32, rank, (&got_res, &got_norm), &want[rank])?;
                fused_zero_copy += 1;
            }
        }
        {
            let (rows, hidden) = (3usize, 7168usize);
            let count = rows * hidden;
            let fres = driver::DeviceAlloc::zeroed(&ctx, count * 4).map_err(|e| e.to_string())?;
            let fgam = driver::DeviceAlloc::zeroed(&ctx, hidden * 4).map_err(|e| e.to_string())?;
            let fout = driver::DeviceAlloc::zeroed(&ctx, count * 4).map_err(|e| e.to_string())?;
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| e.to_string())?;
            // SAFETY: gin (glen >= count f32), fres, fgam and fout outlive
            // the graph.
            let captured = unsafe {
                group.allreduce_add_rmsnorm_in_graph(
                    &stream,
                    Dtype::F32,
                    rows,
                    hidden,
                    NORM_EPS,
                    [gin.ptr(), fres.ptr(), fgam.ptr(), fout.ptr()],
                    AlgoChoice::Auto,
                )
            };
            let graph = stream
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .map_err(|e| e.to_string())?;
            captured.map_err(|e| format!("fused in graph: {e}"))?;
            let graph = graph.ok_or("empty graph")?;
            group.register_captured(&ex).map_err(|e| e.to_string())?;
            for it in 0..3u64 {
                let c = NormCase {
                    dtype: Dtype::F32,
                    world,
                    rows,
                    hidden,
                    seed: 5000 + it,
                };
                let (x, res, gam, want) = c.data();
                gin.write(&x[rank]).map_err(|e| e.to_string())?;
                fres.write(&res[rank]).map_err(|e| e.to_string())?;
                fgam.write(&gam[rank]).map_err(|e| e.to_string())?;
                fout.write(&vec![poison::<f32>().to_bits(); count])
                    .map_err(|e| e.to_string())?;
                graph.launch().map_err(|e| e.to_string())?;
                group
                    .check(&stream)
                    .map_err(|e| format!("fused graph replay {it}: {e}"))?;
                let mut got_res = vec![0u32; count];
                let mut got_norm = vec![0u32; count];
                fres.read(&mut got_res).map_err(|e| e.to_string())?;
                fout.read(&mut got_norm).map_err(|e| e.to_string())?;
                norm_mismatch(
                    &format!("fused graph replay {it}"),
                    Dtype::F32,
                    rank,
                    (&got_res, &got_norm),
                    &want[rank],
                )?;
                fused_zero_copy += 1;
            }
        }
        Ok(format!(
            "link {:?}: {done} allreduces bit-exact (one-stage and two-stage, chunked up to 100003 f32); \
             checked mode accepts agreeing ranks and refuses a length mismatch; \
             graph-captured zero-copy allreduces: Unregistered before register_captured, 20 replays bit-exact after; \
             {registered} registered (eager zero-copy) allreduces bit-exact, unregistered and overlong inputs refused; \
             {fused} fused allreduce + residual add + RMSNorm calls bit-exact (staged), {fused_zero_copy} zero-copy \
             (registered, and 3 replays of a captured one)",
            group.link()
        ))
    };
    match run() {
        Ok(msg) => {
            println!("{msg}");
            0
        }
        Err(e) => {
            println!("rank {rank}: {e}");
            1
        }
    }
}
