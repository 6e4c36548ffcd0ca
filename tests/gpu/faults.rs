//! Faults: peer timeouts, stale flags, a killed rank process, a process
//! group across hosts, and the fault matrix.

use crate::fused::{norm_mismatch, NormCase, NORM_EPS};
use crate::harness::*;
use crate::one_gpu::unix_ms;
use crate::processes::ipc_allreduce;

pub(crate) fn timeout(g: &Gpu) {
    let world = 4;
    let grp = VirtualGroup::new(
        &g.ctx,
        world,
        Config {
            timeout: Duration::from_millis(50),
            ..Config::default()
        },
    )
    .expect("group");
    let t0 = Instant::now();
    grp.launch_with_absent_ranks(&g.stream, 1 << 2, Dtype::F32, Algorithm::OneStage, 100_000)
        .expect("launch");
    let waited = t0.elapsed();
    match grp.check(&g.stream) {
        Err(Error::PeerTimeout {
            peer: 2,
            barrier: BarrierKind::Start,
            rank,
            ..
        }) => {
            assert_ne!(rank, 2, "the absent rank cannot report");
            println!(
                "  rank {rank} reported peer 2 missing after {:.1} ms (timeout 50 ms)",
                waited.as_secs_f64() * 1e3
            );
        }
        other => panic!("expected PeerTimeout naming peer 2, got {other:?}"),
    }
    assert!(waited < Duration::from_secs(5), "timeout took {waited:?}");
    // Poisoned until reset.
    let a = g.stream.clone_htod(&vec![1.0f32; 64]).expect("htod");
    let mut outs: Vec<CudaSlice<f32>> = (0..world).map(|_| poisoned::<f32>(g, 64)).collect();
    let refs = vec![&a; world];
    assert!(matches!(
        grp.allreduce(&g.stream, &refs, &mut outs, AlgoChoice::Auto),
        Err(Error::Poisoned(_))
    ));
    grp.reset().expect("reset");
    grp.allreduce(&g.stream, &refs, &mut outs, AlgoChoice::Auto)
        .expect("after reset");
    grp.check(&g.stream).expect("check after reset");
    assert_eq!(
        g.stream.clone_dtoh(&outs[1]).expect("dtoh"),
        vec![4.0f32; 64]
    );
    // Fault injection works for every dtype and algorithm, on virtual ranks
    // and on a PeerGroup (across GPUs when there are two).
    let v3 = VirtualGroup::new(
        &g.ctx,
        3,
        Config {
            timeout: Duration::from_millis(20),
            ..Config::default()
        },
    )
    .expect("group");
    let ctxs = all_gpus(g);
    let place: Vec<usize> = if ctxs.len() >= 2 {
        vec![0, 1]
    } else {
        vec![0, 0]
    };
    let (pg, streams) = peer_setup(
        &ctxs,
        &place,
        Config {
            timeout: Duration::from_millis(20),
            ..Config::default()
        },
    );
    for dtype in Dtype::ALL {
        for algo in Algorithm::ALL {
            v3.launch_with_absent_ranks(&g.stream, 0b010, dtype, algo, 5000)
                .expect("launch");
            match v3.check(&g.stream) {
                Err(Error::PeerTimeout { peer: 1, .. }) => {}
                other => panic!(
                    "virtual {dtype:?} {algo:?}: expected PeerTimeout naming 1, got {other:?}"
                ),
            }
            v3.reset().expect("reset");
            // The landing zones are clear: the next collective of the same
            // epochs sees no line or slot the failed one left.
            run_case(
                g,
                &v3,
                Spec {
                    dtype,
                    world: 3,
                    len: 5000,
                    algo,
                    registered: false,
                    graph: false,
                    seed: 77,
                },
            );
            pg.launch_with_absent_ranks(&streams, 0b10, dtype, algo, 5000)
                .expect("launch");
            match pg.check(&streams) {
                Err(Error::PeerTimeout { rank: 0, peer: 1, .. }) => {}
                other => panic!("PeerGroup {place:?} {dtype:?} {algo:?}: expected PeerTimeout naming 1, got {other:?}"),
            }
            pg.reset().expect("reset");
        }
    }
    println!("  fault injection: every dtype x algorithm on virtual ranks and a PeerGroup on GPUs {place:?} reports the absent peer");
    // Timeout 0 means wait forever and must not fire on a healthy collective.
    let forever = VirtualGroup::new(
        &g.ctx,
        2,
        Config {
            timeout: Duration::ZERO,
            ..Config::default()
        },
    )
    .expect("group");
    run_case(
        g,
        &forever,
        Spec {
            dtype: Dtype::Bf16,
            world: 2,
            len: 999,
            algo: Algorithm::TwoStage,
            registered: false,
            graph: false,
            seed: 1,
        },
    );
}

/// A flag written once and then left untouched while 2^31 + 10 other
/// collectives pass (push_ll calls, or launches of fewer blocks) must not
/// pass for an arrival: the waits compared epochs in order, and a flag that
/// old read as one from the future, so a dead peer went unnoticed and its
/// data unread. Every algorithm and the fused one-stage, virtual ranks.
pub(crate) fn stale_flags(g: &Gpu) {
    let world = 3;
    let grp = VirtualGroup::new(
        &g.ctx,
        world,
        Config {
            timeout: Duration::from_millis(50),
            ..Config::default()
        },
    )
    .expect("group");
    let stale = (1u32 << 31) + 10;
    for algo in Algorithm::ALL {
        // Writes the flags of the blocks this size runs.
        let spec = |seed| Spec {
            dtype: Dtype::F32,
            world,
            len: 5000,
            algo,
            registered: false,
            graph: false,
            seed,
        };
        run_case(g, &grp, spec(91));
        grp.advance_epochs(stale).expect("advance epochs");
        grp.launch_with_absent_ranks(&g.stream, 0b010, Dtype::F32, algo, 5000)
            .expect("launch");
        match grp.check(&g.stream) {
            Err(Error::PeerTimeout { peer: 1, .. }) => {}
            other => panic!("{algo:?}: flags {stale} collectives old; expected PeerTimeout naming 1, got {other:?}"),
        }
        grp.reset().expect("reset");
        run_case(g, &grp, spec(92));
    }
    grp.add_rmsnorm_with_absent_ranks(&g.stream, 0, Dtype::F32, AlgoChoice::OneStage, 2, 4096)
        .expect("fused, nobody absent");
    grp.check(&g.stream).expect("fused, nobody absent");
    grp.advance_epochs(stale).expect("advance epochs");
    grp.add_rmsnorm_with_absent_ranks(&g.stream, 0b010, Dtype::F32, AlgoChoice::OneStage, 2, 4096)
        .expect("fused launch");
    match grp.check(&g.stream) {
        Err(Error::PeerTimeout { peer: 1, .. }) => {}
        other => panic!("fused one-stage: flags {stale} collectives old; expected PeerTimeout naming 1, got {other:?}"),
    }
    grp.reset().expect("reset");
    println!("  flags {stale} collectives old are no arrival: every algorithm and the fused one-stage report the absent peer");
}

/// The peer timeout of the killed-rank test.
pub(crate) const KILL_TIMEOUT: Duration = Duration::from_secs(2);

/// Two rank processes (GPUs 0 and 1 when there are two) run allreduces in a
/// loop; rank 1 is killed (SIGKILL) in the middle. The survivor must get
/// `PeerTimeout` naming rank 1 within the configured timeout, nothing may
/// hang, and after `reset()` the survivor forms a new group with a new
/// rank-1 process and gets bit-exact results again.
pub(crate) fn killed_rank(_g: &Gpu) {
    let n = driver::device_count().expect("device count");
    let gpus = [0, 1 % n];
    let dir = ipc_dir("kill");
    std::fs::create_dir_all(&dir).expect("dir");
    let survivor = spawn_rank("survivor", 0, 2, gpus[0], &dir);
    let mut victim = spawn_rank("victim", 1, 2, gpus[1], &dir.join("first"));
    let marker = dir.join("first").join("victim-running");
    let t0 = Instant::now();
    while !marker.exists() {
        if let Ok(Some(st)) = victim.try_wait() {
            let (_, text) = wait_rank(victim, Instant::now());
            panic!("the victim ended before it was killed ({st}): {text}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the victim never started its loop"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(50));
    victim.kill().expect("kill rank 1");
    let killed_at = Instant::now();
    let _ = victim.wait();
    let rejoin = spawn_rank("rejoin", 1, 2, gpus[1], &dir.join("second"));
    let deadline = Instant::now() + Duration::from_secs(120);
    let (ok0, text0) = wait_rank(survivor, deadline);
    let (ok1, text1) = wait_rank(rejoin, deadline);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(ok0, "survivor failed: {text0}\nnew rank 1: {text1}");
    assert!(ok1, "new rank 1 failed: {text1}\nsurvivor: {text0}");
    println!("  GPUs {gpus:?}: {}", text0.trim());
    println!(
        "  (rank 1 killed {:.2} s into the run; the whole test ended {:.2} s after the kill)",
        (killed_at - t0).as_secs_f64(),
        killed_at.elapsed().as_secs_f64()
    );
}

/// An exchange of one real rank (rank 0 of 2) whose rank 1 is forged from
/// rank 0's identity record, as if it ran on `host` (boot id `boot`).
struct OtherHost {
    host: &'static str,
    boot: &'static str,
    rounds: std::cell::Cell<usize>,
}

impl Exchange for OtherHost {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        2
    }
    fn all_gather(&self, mine: &[u8]) -> p2p_allreduce::Result<Vec<Vec<u8>>> {
        self.rounds.set(self.rounds.get() + 1);
        let text = String::from_utf8_lossy(mine);
        let peer: String = text
            .lines()
            .map(|l| match l.split_once('=') {
                Some(("rank", _)) => "rank=1".to_string(),
                Some(("pid", p)) => format!("pid={}", p.parse::<u64>().unwrap_or(0) + 1),
                Some(("host", _)) => format!("host={}", self.host),
                Some(("boot", _)) => format!("boot={}", self.boot),
                _ => l.to_string(),
            })
            .map(|l| l + "\n")
            .collect();
        Ok(vec![mine.to_vec(), peer.into_bytes()])
    }
}

/// Item 3: a ProcessGroup whose rank 1 reports another host is refused
/// with `CrossHost` in the first round of the rendezvous: no buffer
/// allocated, no IPC handle opened (the driver layer's counts unchanged),
/// no second round.
pub(crate) fn cross_host_refused(g: &Gpu) {
    let before = driver::live_handles();
    let ex = OtherHost {
        host: "another-host",
        boot: "ffffffff-0000-0000-0000-000000000000",
        rounds: std::cell::Cell::new(0),
    };
    match ProcessGroup::new(&g.ctx, &ex, Config::with_max_bytes(1 << 20)) {
        Err(Error::CrossHost {
            rank: 0,
            peer: 1,
            ref peer_host,
            ..
        }) if peer_host.starts_with("another-host") => {
            let msg = ProcessGroup::new(&g.ctx, &ex, Config::with_max_bytes(1 << 20))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(msg.contains("NCCL"), "{msg}");
            println!("  {msg}");
        }
        other => panic!("expected CrossHost naming rank 1 on another-host, got {other:?}"),
    }
    assert_eq!(
        ex.rounds.get(),
        2,
        "one round per attempt: refused in the identity round"
    );
    assert_eq!(
        driver::live_handles(),
        before,
        "nothing allocated or opened"
    );
}

// --- Fault matrix (item 6): a rank process killed during the rendezvous,
// a graph replay, a fused call and buffer registration.

/// The peer timeout of the fault matrix's groups, and the rendezvous's.
const FAULT_TIMEOUT: Duration = Duration::from_secs(2);

const FAULT_RENDEZVOUS: Duration = Duration::from_secs(20);

/// An exchange that pauses (for good) before its `at`-th round, after
/// leaving `marker`: where the fault matrix kills the process.
struct PauseBefore<'a> {
    inner: &'a DirExchange,
    at: usize,
    calls: std::cell::Cell<usize>,
    marker: std::path::PathBuf,
}

impl Exchange for PauseBefore<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_gather(&self, mine: &[u8]) -> p2p_allreduce::Result<Vec<Vec<u8>>> {
        let n = self.calls.get() + 1;
        self.calls.set(n);
        if n == self.at {
            let _ = std::fs::write(&self.marker, b"");
            std::thread::sleep(Duration::from_secs(120));
        }
        self.inner.all_gather(mine)
    }
}

fn fault_config() -> Config {
    Config {
        max_bytes: 256 << 10,
        timeout: FAULT_TIMEOUT,
        ..Config::default()
    }
}

/// Every algorithm once, bit-exact, on a (new) group: the "works
/// afterwards" half of each fault case.
pub(crate) fn fault_rounds(group: &ProcessGroup, stream: &Arc<CudaStream>) -> Result<(), String> {
    for (k, algo) in Algorithm::ALL.into_iter().enumerate() {
        ipc_allreduce(group, stream, 10_007, 60 + k as u64, algo)
            .map_err(|e| format!("{algo:?}: {e}"))?;
    }
    Ok(())
}

/// One rank process of the fault matrix: `P2P_FAULT_CASE` (rendezvous,
/// replay, fused, register) and `P2P_FAULT_ROLE` (survivor, victim,
/// rejoin). The survivor prints its error and when it came
/// (`error_at_ms=`), forms a new group in the same directory with the
/// rejoining rank and checks every algorithm bit-exact.
pub(crate) fn fault_child(rank: usize) -> Result<String, String> {
    let env = |k: &str| std::env::var(k).map_err(|e| format!("{k}: {e}"));
    let case = env("P2P_FAULT_CASE")?;
    let role = env("P2P_FAULT_ROLE")?;
    let gpu: usize = env("P2P_IPC_GPU")?.parse().map_err(|e| format!("{e}"))?;
    let dir = std::path::PathBuf::from(env("P2P_IPC_DIR")?);
    let ctx = driver::open_device(gpu).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let es = |e: Error| e.to_string();
    let exchange = || DirExchange::new(&dir, rank, 2, FAULT_RENDEZVOUS).map_err(es);
    let victim_at = match case.as_str() {
        "rendezvous" => 2, // after the identity round, before the IPC records
        "register" => 4,   // the group's three rounds, then register_buffer's
        _ => 0,
    };
    let marker = dir.join("victim-running");
    let len = 10_007usize;
    let buf = driver::DeviceAlloc::zeroed(&ctx, len * 4).map_err(es)?;
    let out = driver::DeviceAlloc::zeroed(&ctx, len * 4).map_err(es)?;
    if role == "victim" {
        let ex = exchange()?;
        let pausing = PauseBefore {
            inner: &ex,
            at: victim_at,
            calls: std::cell::Cell::new(0),
            marker: marker.clone(),
        };
        let group = ProcessGroup::new(&ctx, &pausing, fault_config()).map_err(es)?;
        match case.as_str() {
            // SAFETY: `buf` outlives the group.
            "register" => unsafe { group.register_buffer(&pausing, buf.ptr(), len * 4) }
                .map(|_| ())
                .map_err(es)?,
            "replay" | "fused" => {
                let t0 = Instant::now();
                let mut run = fault_work(&case, &group, &pausing, &stream, &buf, &out)?;
                for i in 0..u64::MAX {
                    run(i).map_err(|f| f.to_string())?;
                    if i == 20 {
                        std::fs::write(&marker, b"").map_err(|e| e.to_string())?;
                    }
                    if t0.elapsed() > Duration::from_secs(120) {
                        break;
                    }
                }
            }
            _ => {}
        }
        return Err("the victim was never killed".into());
    }
    if role == "rejoin" {
        let ex = exchange()?;
        let group = ProcessGroup::new(&ctx, &ex, fault_config()).map_err(es)?;
        fault_rounds(&group, &stream)?;
        return Ok("rejoined: every algorithm bit-exact".into());
    }
    // The survivor.
    let ex = exchange()?;
    let t0 = Instant::now();
    let (err, done) = 'failed: {
        let group = match ProcessGroup::new(&ctx, &ex, fault_config()) {
            Ok(g) => g,
            Err(e) => break 'failed (e, 0),
        };
        if case == "register" {
            // SAFETY: `buf` outlives the group.
            match unsafe { group.register_buffer(&ex, buf.ptr(), len * 4) } {
                Ok(_) => return Err("registration succeeded without the killed peer".into()),
                Err(e) => break 'failed (e, 0),
            }
        }
        let mut run = fault_work(&case, &group, &ex, &stream, &buf, &out)?;
        let mut done = 0u64;
        loop {
            match run(done) {
                Ok(()) => done += 1,
                Err(Fail::Wrong(e)) => return Err(format!("call {done}: {e}")),
                Err(Fail::Typed(e)) => {
                    drop(run);
                    // Kernel errors poison the group until reset.
                    if !matches!(group.poll(), Err(Error::Poisoned(_))) {
                        return Err(format!("after {e}: the group is not poisoned"));
                    }
                    group.reset().map_err(|e| format!("reset: {e}"))?;
                    break 'failed (e, done);
                }
            }
            if t0.elapsed() > Duration::from_secs(120) {
                return Err(format!(
                    "no error after {done} calls: the peer's death was not noticed"
                ));
            }
        }
    };
    let at = unix_ms();
    let name = format!("{err:?}");
    let name = name
        .split([' ', '(', '{'])
        .next()
        .unwrap_or_default()
        .to_string();
    // A new group in the same directory (this rank's old records removed
    // by the new exchange first; the dead rank's are not taken).
    let ex2 = exchange()?;
    std::fs::write(dir.join("survivor-second"), b"").map_err(|e| e.to_string())?;
    let group =
        ProcessGroup::new(&ctx, &ex2, fault_config()).map_err(|e| format!("the new group: {e}"))?;
    fault_rounds(&group, &stream)?;
    Ok(format!(
        "case={case} error_at_ms={at} error={name} calls_before={done} message={err}; a new group in the same \
         directory: every algorithm bit-exact"
    ))
}

/// How one call of the fault matrix's repeated work failed: a typed error
/// of the library, or anything else (wrong bits, a failed copy).
enum Fail {
    Typed(Error),
    Wrong(String),
}

impl std::fmt::Display for Fail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fail::Typed(e) => write!(f, "{e}"),
            Fail::Wrong(e) => f.write_str(e),
        }
    }
}

/// The repeated work of the replay and fused cases, one call per `i`,
/// as a closure.
#[allow(clippy::type_complexity)]
fn fault_work<'a>(
    case: &str,
    group: &'a ProcessGroup,
    ex: &'a dyn Exchange,
    stream: &'a Arc<CudaStream>,
    buf: &'a driver::DeviceAlloc,
    out: &'a driver::DeviceAlloc,
) -> Result<Box<dyn FnMut(u64) -> Result<(), Fail> + 'a>, String> {
    let wrong = |e: &dyn std::fmt::Display| Fail::Wrong(e.to_string());
    let len = buf.bytes() / 4;
    let rank = group.rank();
    match case {
        "replay" => {
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| e.to_string())?;
            // SAFETY: `buf` and `out` hold len f32 and outlive the graph.
            let captured = unsafe {
                group.allreduce_in_graph(
                    stream,
                    Dtype::F32,
                    len,
                    buf.ptr(),
                    out.ptr(),
                    AlgoChoice::OneStage,
                )
            };
            let graph = stream
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .map_err(|e| e.to_string())?
                .ok_or("empty graph")?;
            captured.map_err(|e| e.to_string())?;
            group.register_captured(ex).map_err(|e| e.to_string())?;
            let inputs = values::adversarial_inputs(Dtype::F32, 2, len, 36_000, true);
            let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference::allreduce_bits(Dtype::F32, &refs);
            buf.write(&inputs[rank]).map_err(|e| e.to_string())?;
            Ok(Box::new(move |i| {
                if i % 10 == 0 {
                    out.write(&vec![poison::<f32>().to_bits(); len])
                        .map_err(|e| wrong(&e))?;
                }
                graph.launch().map_err(|e| wrong(&e))?;
                group.check(stream).map_err(Fail::Typed)?;
                if i % 10 == 0 {
                    let mut got = vec![0u32; len];
                    out.read(&mut got).map_err(|e| wrong(&e))?;
                    if let Some((k, a, b)) = reference::first_mismatch(Dtype::F32, &got, &want) {
                        return Err(Fail::Wrong(format!(
                            "replay {i}: element {k}: got {a:#x} want {b:#x}"
                        )));
                    }
                }
                Ok(())
            }))
        }
        "fused" => {
            let c = NormCase {
                dtype: Dtype::F32,
                world: 2,
                rows: 2,
                hidden: 4096,
                seed: 37_000,
            };
            let count = c.rows * c.hidden;
            let (x, res, gam, want) = c.data();
            let f = |b: &[u32]| b.iter().map(|&v| f32::from_bits(v)).collect::<Vec<f32>>();
            let xin = stream.clone_htod(&f(&x[rank])).map_err(|e| e.to_string())?;
            let gin = stream
                .clone_htod(&f(&gam[rank]))
                .map_err(|e| e.to_string())?;
            let res_r = f(&res[rank]);
            let want_r = want[rank].clone();
            Ok(Box::new(move |i| {
                let mut rin = stream.clone_htod(&res_r).map_err(|e| wrong(&e))?;
                let mut o = stream
                    .clone_htod(&vec![poison::<f32>(); count])
                    .map_err(|e| wrong(&e))?;
                let algo = if i % 2 == 0 {
                    AlgoChoice::OneStage
                } else {
                    AlgoChoice::PushLl
                };
                group
                    .allreduce_add_rmsnorm(stream, &xin, &mut rin, &gin, NORM_EPS, &mut o, algo)
                    .map_err(Fail::Typed)?;
                group.check(stream).map_err(Fail::Typed)?;
                let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                let got_res = bits(stream.clone_dtoh(&rin).map_err(|e| wrong(&e))?);
                let got_norm = bits(stream.clone_dtoh(&o).map_err(|e| wrong(&e))?);
                norm_mismatch(
                    &format!("fused call {i}"),
                    Dtype::F32,
                    rank,
                    (&got_res, &got_norm),
                    &want_r,
                )
                .map_err(Fail::Wrong)
            }))
        }
        other => Err(format!("no repeated work for case {other}")),
    }
}

/// Item 6: for each case, a survivor (rank 0) and a victim (rank 1) on
/// GPUs 0 and 1 (both on GPU 0 with one GPU); the victim is killed
/// (SIGKILL) where the case says. The survivor must get a typed error
/// within its timeout plus one second of the kill (the peer timeout for
/// kernel waits; the rendezvous's own detection for exchange rounds), and
/// then form a new group, in the same rendezvous directory, with a new rank
/// 1 (every algorithm bit-exact). The directory cases (stale records of an
/// earlier run, a corrupt record, a record of another build) fail before
/// any CUDA call and are CPU tests (host/exchange.rs, host/ipc.rs).
pub(crate) fn fault_matrix(_g: &Gpu) {
    let n = driver::device_count().expect("device count");
    let gpus = [0, 1 % n];
    let mut rows = Vec::new();
    for (case, expect, limit) in [
        ("rendezvous", "PeerExited", FAULT_RENDEZVOUS),
        ("register", "PeerExited", FAULT_RENDEZVOUS),
        ("replay", "PeerTimeout", FAULT_TIMEOUT),
        ("fused", "PeerTimeout", FAULT_TIMEOUT),
    ] {
        let dir = ipc_dir(&format!("fault-{case}"));
        std::fs::create_dir_all(&dir).expect("dir");
        let spawn = |role: &str, rank: usize| {
            let exe = std::env::current_exe().expect("current exe");
            std::process::Command::new(exe)
                .env("P2P_IPC_CHILD", rank.to_string())
                .env("P2P_IPC_MODE", "fault")
                .env("P2P_FAULT_CASE", case)
                .env("P2P_FAULT_ROLE", role)
                .env("P2P_IPC_WORLD", "2")
                .env("P2P_IPC_GPU", gpus[rank].to_string())
                .env("P2P_IPC_DIR", &dir)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn rank process")
        };
        let survivor = spawn("survivor", 0);
        let mut victim = spawn("victim", 1);
        let t0 = Instant::now();
        while !dir.join("victim-running").exists() {
            if let Ok(Some(st)) = victim.try_wait() {
                let (_, text) = wait_rank(victim, Instant::now());
                panic!("{case}: the victim ended before it was killed ({st}): {text}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "{case}: the victim never got there"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // Replay and fused: a few more calls run; rendezvous and register:
        // the victim is paused inside the exchange, and the survivor has
        // surely read its records of the earlier rounds by then.
        std::thread::sleep(Duration::from_millis(
            if case == "replay" || case == "fused" {
                30
            } else {
                200
            },
        ));
        victim.kill().expect("SIGKILL rank 1");
        let killed_at = unix_ms();
        let _ = victim.wait();
        // The new rank 1 starts once the survivor has its new exchange.
        while !dir.join("survivor-second").exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(180),
                "{case}: the survivor never reached its new group"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let rejoin = spawn("rejoin", 1);
        let deadline = Instant::now() + Duration::from_secs(120);
        let (ok0, text0) = wait_rank(survivor, deadline);
        let (ok1, text1) = wait_rank(rejoin, deadline);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(ok0, "{case}: survivor failed: {text0}\nnew rank 1: {text1}");
        assert!(ok1, "{case}: new rank 1 failed: {text1}\nsurvivor: {text0}");
        let field = |k: &str| {
            text0
                .split_whitespace()
                .find_map(|w| w.strip_prefix(k))
                .unwrap_or_else(|| panic!("{case}: survivor printed no {k}: {text0}"))
                .to_string()
        };
        let error_at: u128 = field("error_at_ms=").parse().expect("ms");
        let error = field("error=");
        assert!(
            text0.contains(expect),
            "{case}: expected {expect}, survivor says: {text0}"
        );
        let after = error_at.saturating_sub(killed_at);
        assert!(
            after <= limit.as_millis() + 1000,
            "{case}: the typed error came {after} ms after the kill (limit {limit:?} + 1 s)"
        );
        println!("  {case}: {}", text0.trim());
        rows.push(format!(
            "{case}: {error} {after} ms after the kill (limit {:?} + 1 s)",
            limit
        ));
    }
    println!("  fault matrix on GPUs {gpus:?}: {}", rows.join("; "));
}
