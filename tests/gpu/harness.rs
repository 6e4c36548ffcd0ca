//! Shared harness of the GPU suite: the device, typed upload/download
//! helpers, poisoned buffers, the reference check of every rank, graph
//! capture, groups on every GPU and rank processes (spawn, wait, collect).

pub(crate) use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
pub(crate) use p2p_allreduce::abi::{self, Algorithm, BarrierKind, Dtype};
pub(crate) use p2p_allreduce::ptx::{ImageChoice, LoadedImage, PtxBecause};
pub(crate) use p2p_allreduce::reference::{self, values};
pub(crate) use p2p_allreduce::validate::{self, Bits};
pub(crate) use p2p_allreduce::{
    driver, AlgoChoice, Config, DirExchange, Error, Exchange, PeerGroup, ProcessGroup,
    RegisteredBuffers, VirtualGroup,
};
pub(crate) use std::sync::Arc;
pub(crate) use std::time::{Duration, Instant};

pub(crate) struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
}

pub(crate) fn open_gpu() -> Result<Gpu, String> {
    if !driver::driver_present() {
        return Err(
            "no CUDA driver (libcuda not found); run scripts/gpu-check.sh on a GPU machine".into(),
        );
    }
    let n = driver::device_count().map_err(|e| e.to_string())?;
    if n == 0 {
        return Err("CUDA driver present but no GPU visible".into());
    }
    let ctx = driver::open_device(0).map_err(|e| e.to_string())?;
    // The suite captures CUDA graphs; cudarc's per-slice event tracking is
    // not needed with one stream per test.
    // SAFETY: no other stream uses these slices concurrently in this suite.
    unsafe { ctx.disable_event_tracking() };
    // Graph capture needs a stream other than the legacy default stream.
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    Ok(Gpu { ctx, stream })
}

// ---------------------------------------------------------------------------
// Typed helpers: element bits <-> T (the library's `validate::Bits`).

pub(crate) fn poison<T: Bits>() -> T {
    T::from_bits32(validate::poison_bits(T::DTYPE))
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Spec {
    pub(crate) dtype: Dtype,
    pub(crate) world: usize,
    pub(crate) len: usize,
    pub(crate) algo: Algorithm,
    pub(crate) registered: bool,
    pub(crate) graph: bool,
    pub(crate) seed: u64,
}

/// Runs one allreduce as described and checks every rank against the reference.
pub(crate) fn run_case(g: &Gpu, group: &VirtualGroup, s: Spec) {
    match s.dtype {
        Dtype::F32 => run_typed::<f32>(g, group, s),
        Dtype::F16 => run_typed::<half::f16>(g, group, s),
        Dtype::Bf16 => run_typed::<half::bf16>(g, group, s),
    }
}

pub(crate) fn upload<T: Bits>(g: &Gpu, bits: &[u32]) -> CudaSlice<T> {
    let host: Vec<T> = bits.iter().map(|&b| T::from_bits32(b)).collect();
    if host.is_empty() {
        // cudarc cannot allocate zero elements; zero-length cases use the raw API.
        return g.stream.clone_htod(&[poison::<T>()]).expect("upload");
    }
    g.stream.clone_htod(&host).expect("upload")
}

pub(crate) fn poisoned<T: Bits>(g: &Gpu, len: usize) -> CudaSlice<T> {
    g.stream
        .clone_htod(&vec![poison::<T>(); len.max(1)])
        .expect("alloc output")
}

pub(crate) fn download<T: Bits>(g: &Gpu, s: &CudaSlice<T>, len: usize) -> Vec<u32> {
    let v = g.stream.clone_dtoh(s).expect("download");
    v[..len].iter().map(|x| x.to_bits32()).collect()
}

fn run_typed<T: Bits>(g: &Gpu, group: &VirtualGroup, s: Spec) {
    let inputs = values::adversarial_inputs(s.dtype, s.world, s.len, s.seed, true);
    let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(s.dtype, &refs);
    let mut outputs: Vec<CudaSlice<T>> = (0..s.world).map(|_| poisoned::<T>(g, s.len)).collect();

    let used;
    // Captured graphs stay alive until the work they launched has been checked.
    let mut graphs = Vec::new();
    if s.registered {
        let reg = group
            .alloc_registered::<T>(s.len.max(1))
            .expect("alloc_registered");
        for (r, bits) in inputs.iter().enumerate() {
            if !bits.is_empty() {
                reg.copy_from(r, &g.stream, &upload::<T>(g, bits))
                    .expect("copy into registered");
            }
        }
        used = if s.graph {
            let graph = capture(g, || {
                group.allreduce_registered(&g.stream, &reg, s.len, &mut outputs, s.algo.into())
            });
            graph.launch().expect("graph launch");
            graphs.push(graph);
            s.algo
        } else {
            group
                .allreduce_registered(&g.stream, &reg, s.len, &mut outputs, s.algo.into())
                .expect("allreduce_registered")
        };
        group
            .check(&g.stream)
            .unwrap_or_else(|e| panic!("{s:?}: {e}"));
        drop(reg);
    } else {
        let ins: Vec<CudaSlice<T>> = inputs.iter().map(|b| upload::<T>(g, b)).collect();
        let in_refs: Vec<&CudaSlice<T>> = ins.iter().collect();
        if s.len == 0 {
            // Zero-length slices are not allocatable in cudarc; use the raw API.
            let outs: Vec<u64> = outputs
                .iter_mut()
                .map(|o| o.device_ptr_mut(&g.stream).0)
                .collect();
            let inp: Vec<u64> = ins.iter().map(|i| i.device_ptr(&g.stream).0).collect();
            // SAFETY: zero elements are read or written.
            used =
                unsafe { group.allreduce_raw(&g.stream, s.dtype, 0, &inp, &outs, s.algo.into()) }
                    .expect("allreduce_raw");
        } else if s.graph {
            let graph = capture(g, || {
                group.allreduce(&g.stream, &in_refs, &mut outputs, s.algo.into())
            });
            graph.launch().expect("graph launch");
            graphs.push(graph);
            used = s.algo;
        } else {
            used = group
                .allreduce(&g.stream, &in_refs, &mut outputs, s.algo.into())
                .expect("allreduce");
        }
        group
            .check(&g.stream)
            .unwrap_or_else(|e| panic!("{s:?}: {e}"));
    }
    assert_eq!(used, s.algo, "{s:?}: explicit algorithm not honoured");
    for (r, o) in outputs.iter().enumerate() {
        let got = download::<T>(g, o, s.len);
        if let Some((i, got_b, want_b)) = reference::first_mismatch(s.dtype, &got, &want) {
            let ins: Vec<String> = inputs.iter().map(|v| format!("{:#x}", v[i])).collect();
            panic!("{s:?}: rank {r} element {i}: got {got_b:#x}, want {want_b:#x}; inputs {ins:?}");
        }
    }
}

pub(crate) fn capture(
    g: &Gpu,
    f: impl FnOnce() -> p2p_allreduce::Result<Algorithm>,
) -> cudarc::driver::CudaGraph {
    g.stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    let r = f();
    let graph = g
        .stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .expect("end capture");
    r.expect("allreduce during capture");
    graph.expect("captured graph is not empty")
}

pub(crate) fn group(g: &Gpu, world: usize) -> VirtualGroup {
    VirtualGroup::new(
        &g.ctx,
        world,
        Config {
            max_bytes: 8 << 20,
            // Registered cases push up to the longest property case.
            push_max_bytes: 8 << 20,
            push_ll_max_bytes: 8 << 20,
            ..Config::default()
        },
    )
    .expect("VirtualGroup::new")
}

/// The GPUs of this machine, one context each (GPU 0's is the suite's own).
pub(crate) fn all_gpus(g: &Gpu) -> Vec<Arc<CudaContext>> {
    let n = driver::device_count().expect("device count");
    let mut v = vec![g.ctx.clone()];
    for i in 1..n {
        let c = driver::open_device(i).expect("open GPU");
        // SAFETY: as for GPU 0 in open_gpu: one stream per rank, no
        // cross-stream sharing of slices; graph capture must not record events.
        unsafe { c.disable_event_tracking() };
        v.push(c);
    }
    v
}

/// Where the real-rank cases put their ranks: rank r on GPU `r % gpus`
/// (distinct GPUs whenever there are enough), plus every rank on GPU 0.
pub(crate) fn placements(n_gpus: usize) -> Vec<Vec<usize>> {
    let mut v: Vec<Vec<usize>> = vec![vec![0], vec![0, 0], vec![0, 0, 0]];
    if n_gpus >= 2 {
        for world in 2..=n_gpus.min(8) {
            v.push((0..world).map(|r| r % n_gpus).collect());
        }
        // More ranks than GPUs: some share a device, the rest are peers.
        v.push((0..3).map(|r| r % n_gpus).collect());
    }
    v.dedup();
    v
}

pub(crate) fn upload_on<T: Bits>(s: &Arc<CudaStream>, bits: &[u32]) -> CudaSlice<T> {
    let host: Vec<T> = if bits.is_empty() {
        vec![poison::<T>()]
    } else {
        bits.iter().map(|&b| T::from_bits32(b)).collect()
    };
    s.clone_htod(&host).expect("upload")
}

pub(crate) fn poisoned_on<T: Bits>(s: &Arc<CudaStream>, len: usize) -> CudaSlice<T> {
    s.clone_htod(&vec![poison::<T>(); len.max(1)])
        .expect("alloc output")
}

pub(crate) fn download_on<T: Bits>(s: &Arc<CudaStream>, o: &CudaSlice<T>, len: usize) -> Vec<u32> {
    let v = s.clone_dtoh(o).expect("download");
    v[..len].iter().map(|x| x.to_bits32()).collect()
}

/// Every rank's bits against the reference and against rank 0's bits.
pub(crate) fn assert_ranks(what: &str, dtype: Dtype, outs: &[Vec<u32>], want: &[u32]) {
    for (r, got) in outs.iter().enumerate() {
        if let Some((i, a, b)) = reference::first_mismatch(dtype, got, want) {
            panic!("{what}: rank {r} element {i}: got {a:#x}, want {b:#x}");
        }
        if let Some(i) = got.iter().zip(&outs[0]).position(|(a, b)| a != b) {
            panic!(
                "{what}: rank {r} element {i} has other bits than rank 0: {:#x} vs {:#x}",
                got[i], outs[0][i]
            );
        }
    }
}

pub(crate) fn peer_setup(
    ctxs: &[Arc<CudaContext>],
    place: &[usize],
    cfg: Config,
) -> (PeerGroup, Vec<Arc<CudaStream>>) {
    let rank_ctxs: Vec<Arc<CudaContext>> = place.iter().map(|&d| ctxs[d].clone()).collect();
    let grp = PeerGroup::new(&rank_ctxs, cfg)
        .unwrap_or_else(|e| panic!("PeerGroup on GPUs {place:?}: {e}"));
    let streams = rank_ctxs
        .iter()
        .map(|c| c.new_stream().expect("stream"))
        .collect();
    (grp, streams)
}

/// Starts this test binary as rank `rank` of an IPC group in `mode`.
pub(crate) fn spawn_rank(
    mode: &str,
    rank: usize,
    world: usize,
    gpu: usize,
    dir: &std::path::Path,
) -> std::process::Child {
    let exe = std::env::current_exe().expect("current exe");
    std::process::Command::new(exe)
        .env("P2P_IPC_CHILD", rank.to_string())
        .env("P2P_IPC_MODE", mode)
        .env("P2P_IPC_WORLD", world.to_string())
        .env("P2P_IPC_GPU", gpu.to_string())
        .env("P2P_IPC_DIR", dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn rank process")
}

/// Waits at most until `deadline` (then kills it); returns whether it
/// succeeded and what it printed.
pub(crate) fn wait_rank(mut c: std::process::Child, deadline: Instant) -> (bool, String) {
    let status = loop {
        if let Some(st) = c.try_wait().expect("wait") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = c.wait_with_output().expect("output");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    match status {
        Some(st) if st.success() => (true, text),
        Some(st) => (false, format!("({st}) {text}")),
        None => (false, format!("(killed after the deadline) {text}")),
    }
}

/// Starts rank r of `mode` on GPU `gpus[r]` for every r, waits for all of
/// them until `timeout` from now, removes `dir`, and fails naming every
/// rank that failed; returns what each rank printed, in rank order.
pub(crate) fn run_ranks(
    mode: &str,
    gpus: &[usize],
    dir: &std::path::Path,
    timeout: Duration,
) -> Vec<String> {
    let world = gpus.len();
    let children: Vec<_> = gpus
        .iter()
        .enumerate()
        .map(|(r, &gpu)| spawn_rank(mode, r, world, gpu, dir))
        .collect();
    let deadline = Instant::now() + timeout;
    let mut texts = Vec::new();
    let mut failures = Vec::new();
    for (r, c) in children.into_iter().enumerate() {
        match wait_rank(c, deadline) {
            (true, text) => texts.push(text.trim().to_string()),
            (false, text) => failures.push(format!("rank {r}: {text}")),
        }
    }
    let _ = std::fs::remove_dir_all(dir);
    assert!(
        failures.is_empty(),
        "{mode}: ranks failed:\n{}",
        failures.join("\n")
    );
    texts
}

pub(crate) fn ipc_dir(what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("p2p-ar-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
