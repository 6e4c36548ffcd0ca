//! The GPU suite: every kernel against the CPU reference, bit for bit.
//!
//! A `harness = false` test so that, on a machine without a CUDA driver
//! (CI), every case is reported as SKIPPED with the reason, and the summary
//! line says so, instead of counting as passed. On a GPU machine every case
//! runs; any failure exits non-zero. `GPU_PROPERTY_CASES` sets the number of
//! random property cases (default 1200).

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use p2p_allreduce::abi::{self, Algorithm, BarrierKind, Dtype};
use p2p_allreduce::ptx::{ImageChoice, LoadedImage, PtxBecause};
use p2p_allreduce::reference::{self, values};
use p2p_allreduce::validate::{self, Bits};
use p2p_allreduce::{
    driver, AlgoChoice, Config, DirExchange, Error, Exchange, PeerGroup, ProcessGroup,
    RegisteredBuffers, VirtualGroup,
};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Case = (&'static str, fn(&Gpu));

struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

#[path = "gpu/comm.rs"]
mod comm;
#[path = "gpu/mismatch.rs"]
mod mismatch;
#[path = "gpu/shared_host.rs"]
mod shared_host;

fn main() {
    let cases: &[Case] = &[
        ("smoke_sm_ptx_loads_and_runs", smoke),
        ("kernel_images_sass_and_jit_ptx_agree", kernel_images),
        ("sweep_dtypes_worlds_lengths_algorithms", sweep),
        ("property_random_cases", property),
        (
            "one_stage_equals_two_stage_and_length_independent",
            cross_algorithm,
        ),
        ("graph_replay_1000", graph_replay),
        ("chunked_large_message", chunked),
        ("peer_timeout_is_reported", timeout),
        (
            "stale_flags_are_no_arrival_2_31_collectives_on",
            stale_flags,
        ),
        (
            "ranks_that_disagree_injected_every_group_kind",
            mismatch::injected,
        ),
        ("ranks_that_disagree_two_processes", mismatch::processes),
        (
            "ranks_that_disagree_at_engine_shapes_two_processes",
            mismatch::engine_processes,
        ),
        ("user_errors_are_typed", user_errors),
        ("api_safety_misuse_is_refused_or_ordered", api_safety),
        ("peer_group_real_rank_entries_every_gpu", peer_group),
        ("peer_group_graph_replays", peer_group_graphs),
        ("push_back_to_back_with_changing_grids", push_changing_grids),
        ("push_ll_reads_inputs_in_place", push_ll_direct_inputs),
        ("thresholds_file_moves_auto", thresholds_file),
        ("fused_add_rmsnorm_bit_exact", fused_add_rmsnorm),
        ("fused_registered_zero_copy", fused_registered),
        ("fused_push_ll_split_over_clusters", fused_push_ll_clusters),
        ("ipc_process_group_every_gpu", ipc_processes),
        ("killed_rank_process_times_out_and_recovers", killed_rank),
        (
            "peer_group_one_gpu_crossed_buffers_fused_in_place_and_faults",
            peer_one_gpu_issue31,
        ),
        (
            "fused_auto_zero_copy_beyond_scratch_every_group_kind",
            fused_auto_beyond_scratch,
        ),
        ("capture_with_cudarc_event_tracking_on", capture_tracking_on),
        ("process_group_across_hosts_is_refused", cross_host_refused),
        ("fault_matrix_killed_rank_processes", fault_matrix),
        (
            "shared_host_forged_peer_buffers_two_processes",
            shared_host::processes,
        ),
        #[cfg(feature = "nccl")]
        ("nccl_group_and_routing_world_1", nccl_routed),
        #[cfg(feature = "nccl")]
        (
            "nccl_table_bands_route_auto_and_symmetric_windows",
            nccl_table_routing,
        ),
        ("comm_from_devices_eager_graph_unserved", comm::threads),
    ];
    if let Ok(rank) = std::env::var("P2P_IPC_CHILD") {
        std::process::exit(ipc_child(rank.parse().expect("P2P_IPC_CHILD is a rank")));
    }
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected: Vec<&Case> = cases
        .iter()
        .filter(|(n, _)| filter.is_empty() || filter.iter().any(|f| n.contains(f.as_str())))
        .collect();

    let gpu = match open_gpu() {
        Ok(g) => g,
        Err(reason) => {
            for (name, _) in &selected {
                println!("test {name} ... SKIPPED ({reason})");
            }
            println!("\ngpu suite skipped: {reason}");
            println!("gpu: 0 passed, 0 failed, {} skipped", selected.len());
            return;
        }
    };
    let (mut passed, mut failed) = (0, 0);
    for (name, f) in &selected {
        let t0 = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| f(&gpu)));
        match r {
            Ok(()) => {
                passed += 1;
                println!("test {name} ... ok ({:.2} s)", t0.elapsed().as_secs_f64());
            }
            Err(e) => {
                failed += 1;
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
                println!("test {name} ... FAILED: {}", msg.unwrap_or_default());
            }
        }
    }
    println!("\ngpu: {passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}

fn open_gpu() -> Result<Gpu, String> {
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

fn poison<T: Bits>() -> T {
    T::from_bits32(validate::poison_bits(T::DTYPE))
}

#[derive(Clone, Copy, Debug)]
struct Spec {
    dtype: Dtype,
    world: usize,
    len: usize,
    algo: Algorithm,
    registered: bool,
    graph: bool,
    seed: u64,
}

/// Runs one allreduce as described and checks every rank against the reference.
fn run_case(g: &Gpu, group: &VirtualGroup, s: Spec) {
    match s.dtype {
        Dtype::F32 => run_typed::<f32>(g, group, s),
        Dtype::F16 => run_typed::<half::f16>(g, group, s),
        Dtype::Bf16 => run_typed::<half::bf16>(g, group, s),
    }
}

fn upload<T: Bits>(g: &Gpu, bits: &[u32]) -> CudaSlice<T> {
    let host: Vec<T> = bits.iter().map(|&b| T::from_bits32(b)).collect();
    if host.is_empty() {
        // cudarc cannot allocate zero elements; zero-length cases use the raw API.
        return g.stream.clone_htod(&[poison::<T>()]).expect("upload");
    }
    g.stream.clone_htod(&host).expect("upload")
}

fn poisoned<T: Bits>(g: &Gpu, len: usize) -> CudaSlice<T> {
    g.stream
        .clone_htod(&vec![poison::<T>(); len.max(1)])
        .expect("alloc output")
}

fn download<T: Bits>(g: &Gpu, s: &CudaSlice<T>, len: usize) -> Vec<u32> {
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

fn capture(
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

fn group(g: &Gpu, world: usize) -> VirtualGroup {
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

// ---------------------------------------------------------------------------
// Cases.

fn smoke(g: &Gpu) {
    let info = driver::device_info(&g.ctx).expect("device info");
    let m = driver::module_for_device(&g.ctx).expect("module");
    println!(
        "  device: {} (cc {}.{}), {} SMs; PTX used: {}",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        m.arch
    );
    let grp = group(g, 2);
    let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 + 1.0).collect();
    let b: Vec<f32> = (0..1000).map(|i| -(i as f32) * 0.25 + 3.0).collect();
    let ia = g.stream.clone_htod(&a).expect("htod");
    let ib = g.stream.clone_htod(&b).expect("htod");
    let mut outs = vec![poisoned::<f32>(g, 1000), poisoned::<f32>(g, 1000)];
    grp.allreduce(&g.stream, &[&ia, &ib], &mut outs, AlgoChoice::OneStage)
        .expect("allreduce");
    grp.check(&g.stream).expect("check");
    for o in &outs {
        let h = g.stream.clone_dtoh(o).expect("dtoh");
        for i in 0..1000 {
            assert_eq!(h[i].to_bits(), (a[i] + b[i]).to_bits(), "element {i}");
        }
    }
    println!(
        "  smoke: 2 virtual ranks x 1000 f32 summed correctly; out[3] = {}",
        g.stream.clone_dtoh(&outs[0]).expect("dtoh")[3]
    );
}

/// The embedded cubin is what a default group runs on this device where the
/// build has one for it (a refusal by the driver fails here, loudly), and a
/// group that asks for the PTX (JIT-compiled: tens of seconds) gives the
/// same bits: every algorithm at a few lengths, and the fused kernels.
fn kernel_images(g: &Gpu) {
    let m = driver::module_for_device(&g.ctx).expect("module");
    let info = driver::device_info(&g.ctx).expect("device info");
    let default_group = group(g, 2);
    let auto = driver::Kernels::for_context(&g.ctx, ImageChoice::Auto).expect("kernels");
    if m.runs_sass_on(info.compute_capability) {
        assert_eq!(
            auto.image(),
            &LoadedImage::Sass,
            "this build has a cubin for {} and the device is cc {:?}",
            m.arch,
            info.compute_capability
        );
    } else {
        assert!(matches!(auto.image(), LoadedImage::Ptx(_)));
    }
    println!("  default image: {}", auto.image());
    drop(default_group);
    drop(auto);
    let t0 = Instant::now();
    let fresh = driver::Kernels::load(&g.ctx, ImageChoice::Auto).expect("kernels");
    println!(
        "  {} loaded in {:.2} s",
        fresh.image(),
        t0.elapsed().as_secs_f64()
    );
    drop(fresh);
    let t0 = Instant::now();
    let jit = VirtualGroup::new(
        &g.ctx,
        3,
        Config {
            kernel_image: ImageChoice::Ptx,
            ..Config::with_max_bytes(256 << 10)
        },
    )
    .expect("VirtualGroup::new with the PTX");
    let ptx = driver::Kernels::for_context(&g.ctx, ImageChoice::Ptx).expect("kernels");
    assert_eq!(ptx.image(), &LoadedImage::Ptx(PtxBecause::Asked));
    println!("  PTX module loaded in {:.1} s", t0.elapsed().as_secs_f64());
    let mut n = 0;
    for dtype in Dtype::ALL {
        for algo in Algorithm::ALL {
            for (k, len) in [1usize, 4099, 65_537].into_iter().enumerate() {
                let spec = Spec {
                    dtype,
                    world: 3,
                    len,
                    algo,
                    registered: k == 1,
                    graph: false,
                    seed: 77 + n,
                };
                run_case(g, &jit, spec);
                n += 1;
            }
        }
    }
    for (dtype, hidden, rows) in [
        (Dtype::Bf16, 7168, 3),
        (Dtype::F32, 7, 5),
        (Dtype::F16, 4096, 2),
    ] {
        let c = NormCase {
            dtype,
            world: 3,
            rows,
            hidden,
            seed: 900 + n,
        };
        for algo in [AlgoChoice::OneStage, AlgoChoice::TwoStage, AlgoChoice::Auto] {
            match dtype {
                Dtype::F32 => norm_virtual::<f32>(g, &jit, &c, algo, false),
                Dtype::F16 => norm_virtual::<half::f16>(g, &jit, &c, algo, false),
                Dtype::Bf16 => norm_virtual::<half::bf16>(g, &jit, &c, algo, false),
            };
            n += 1;
        }
        if takes_push_ll(dtype, hidden) {
            match dtype {
                Dtype::F32 => norm_virtual::<f32>(g, &jit, &c, AlgoChoice::PushLl, true),
                Dtype::F16 => norm_virtual::<half::f16>(g, &jit, &c, AlgoChoice::PushLl, true),
                Dtype::Bf16 => norm_virtual::<half::bf16>(g, &jit, &c, AlgoChoice::PushLl, true),
            };
            n += 1;
        }
    }
    println!("  {n} cases bit-exact on the JIT-compiled PTX");
}

/// Lengths around every boundary: empty, sub-pack, pack multiples +-1, one
/// block's worth, many blocks.
const LENGTHS: &[usize] = &[
    0, 1, 3, 4, 7, 8, 9, 15, 17, 100, 511, 4096, 4099, 65_537, 262_147,
];

fn sweep(g: &Gpu) {
    let mut n = 0;
    for world in 1..=8 {
        let grp = group(g, world);
        for dtype in Dtype::ALL {
            for algo in Algorithm::ALL {
                for (k, &len) in LENGTHS.iter().enumerate() {
                    let seed = (world * 1000 + k) as u64;
                    run_case(
                        g,
                        &grp,
                        Spec {
                            dtype,
                            world,
                            len,
                            algo,
                            registered: k % 2 == 1,
                            graph: false,
                            seed,
                        },
                    );
                    n += 1;
                }
            }
        }
    }
    println!("  {n} sweep cases bit-exact");
}

/// A tiny deterministic generator for case parameters.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn property(g: &Gpu) {
    let cases: usize = std::env::var("GPU_PROPERTY_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1200);
    let groups: Vec<VirtualGroup> = (1..=8).map(|w| group(g, w)).collect();
    let mut st = 0x5EED_u64;
    for c in 0..cases {
        let world = 1 + (next(&mut st) % 8) as usize;
        let dtype = Dtype::ALL[(next(&mut st) % 3) as usize];
        // Mostly small (the latency regime), sometimes up to ~1M elements.
        let len = match next(&mut st) % 10 {
            0..=5 => (next(&mut st) % 2048) as usize,
            6..=8 => (next(&mut st) % 70_000) as usize,
            _ => (next(&mut st) % 1_100_000) as usize,
        };
        let algo = Algorithm::ALL[(next(&mut st) % Algorithm::ALL.len() as u64) as usize];
        // Zero-copy inputs larger than the algorithm's landing zone are
        // refused with `ZoneTooSmall`: such cases run staged, chunked.
        let fits = groups[world - 1]
            .config()
            .zone_capacity(algo)
            .is_none_or(|cap| len * dtype.size() <= cap);
        let registered = next(&mut st) % 2 == 0 && fits;
        let graph = len > 0 && next(&mut st) % 4 == 0;
        run_case(
            g,
            &groups[world - 1],
            Spec {
                dtype,
                world,
                len,
                algo,
                registered,
                graph,
                seed: c as u64 + 77,
            },
        );
    }
    println!("  {cases} random property cases bit-exact (dtype x world 1..8 x len x algorithm x registered/staged x eager/graph)");
}

/// One-stage and two-stage give identical bits, and element i does not depend
/// on the message length (a prefix of the same data gives a prefix of the result).
fn cross_algorithm(g: &Gpu) {
    for world in [2usize, 3, 5, 8] {
        let grp = group(g, world);
        for dtype in Dtype::ALL {
            let len = 50_003;
            let inputs = values::adversarial_inputs(dtype, world, len, 99 + world as u64, true);
            let mut results = Vec::new();
            for algo in Algorithm::ALL {
                for take in [len, 4099, 13] {
                    let sub: Vec<Vec<u32>> = inputs.iter().map(|v| v[..take].to_vec()).collect();
                    let got = match dtype {
                        Dtype::F32 => reduce_raw::<f32>(g, &grp, &sub, algo),
                        Dtype::F16 => reduce_raw::<half::f16>(g, &grp, &sub, algo),
                        Dtype::Bf16 => reduce_raw::<half::bf16>(g, &grp, &sub, algo),
                    };
                    results.push((algo, take, got));
                }
            }
            let full = &results[0].2;
            for (algo, take, got) in &results {
                if let Some((i, a, b)) = reference::first_mismatch(dtype, got, &full[..*take]) {
                    panic!("{dtype:?} world {world}: {algo:?} with length {take} differs from one-stage full length at {i}: {a:#x} vs {b:#x}");
                }
            }
        }
    }
    println!("  one-stage == two-stage, and prefixes agree, for worlds 2,3,5,8 x all dtypes");
}

fn reduce_raw<T: Bits>(
    g: &Gpu,
    grp: &VirtualGroup,
    inputs: &[Vec<u32>],
    algo: Algorithm,
) -> Vec<u32> {
    let len = inputs[0].len();
    let ins: Vec<CudaSlice<T>> = inputs.iter().map(|b| upload::<T>(g, b)).collect();
    let refs: Vec<&CudaSlice<T>> = ins.iter().collect();
    let mut outs: Vec<CudaSlice<T>> = (0..inputs.len()).map(|_| poisoned::<T>(g, len)).collect();
    grp.allreduce(&g.stream, &refs, &mut outs, algo.into())
        .expect("allreduce");
    grp.check(&g.stream).expect("check");
    let first = download::<T>(g, &outs[0], len);
    for (r, o) in outs.iter().enumerate().skip(1) {
        assert_eq!(
            download::<T>(g, o, len),
            first,
            "rank {r} differs from rank 0"
        );
    }
    first
}

/// A captured graph replayed 1000 times, with new data before each replay,
/// gives the reference result every time (epochs advance on the device).
fn graph_replay(g: &Gpu) {
    let world = 4;
    let grp = group(g, world);
    for algo in Algorithm::ALL {
        let len = 10_007;
        let reg = grp.alloc_registered::<f32>(len).expect("registered");
        let mut outs: Vec<CudaSlice<f32>> = (0..world).map(|_| poisoned::<f32>(g, len)).collect();
        let graph = capture(g, || {
            grp.allreduce_registered(&g.stream, &reg, len, &mut outs, algo.into())
        });
        for it in 0..1000u64 {
            let inputs =
                values::adversarial_inputs(Dtype::F32, world, len, 5000 + it, it % 10 == 0);
            for (r, bits) in inputs.iter().enumerate() {
                reg.copy_from(r, &g.stream, &upload::<f32>(g, bits))
                    .expect("copy");
            }
            for o in outs.iter_mut() {
                g.stream
                    .memcpy_htod(&vec![poison::<f32>(); len], o)
                    .expect("poison");
            }
            graph.launch().expect("replay");
            grp.check(&g.stream)
                .unwrap_or_else(|e| panic!("{algo:?} replay {it}: {e}"));
            let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference::allreduce_bits(Dtype::F32, &refs);
            for (r, o) in outs.iter().enumerate() {
                let got = download::<f32>(g, o, len);
                if let Some((i, a, b)) = reference::first_mismatch(Dtype::F32, &got, &want) {
                    panic!("{algo:?} replay {it} rank {r} element {i}: got {a:#x} want {b:#x}");
                }
            }
        }
    }
    println!("  1000 graph replays x 2 algorithms bit-exact");
}

fn chunked(g: &Gpu) {
    // 64 KiB buffers, messages of several MiB: many chunks, odd tail.
    for world in [2usize, 3, 8] {
        let grp = VirtualGroup::new(
            &g.ctx,
            world,
            Config {
                max_bytes: 64 << 10,
                ..Config::default()
            },
        )
        .expect("group");
        for dtype in Dtype::ALL {
            for algo in Algorithm::ALL {
                run_case(
                    g,
                    &grp,
                    Spec {
                        dtype,
                        world,
                        len: 1_000_003,
                        algo,
                        registered: false,
                        graph: false,
                        seed: 3,
                    },
                );
            }
        }
        // Registered inputs larger than scratch: Auto runs one-stage (same
        // bits), an explicit two-stage is refused rather than changed.
        let reg = grp.alloc_registered::<f32>(300_001).expect("registered");
        let mut outs: Vec<CudaSlice<f32>> =
            (0..world).map(|_| poisoned::<f32>(g, 300_001)).collect();
        assert!(matches!(
            grp.allreduce_registered(&g.stream, &reg, 300_001, &mut outs, AlgoChoice::TwoStage),
            Err(Error::ScratchTooSmall { .. })
        ));
        let used = grp
            .allreduce_registered(&g.stream, &reg, 300_001, &mut outs, AlgoChoice::Auto)
            .expect("registered large");
        assert_eq!(used, Algorithm::OneStage);
        grp.check(&g.stream).expect("check");
    }
    let small = VirtualGroup::new(
        &g.ctx,
        2,
        Config {
            max_bytes: 4096,
            chunking: false,
            ..Config::default()
        },
    )
    .expect("group");
    let a = g.stream.clone_htod(&vec![1.0f32; 5000]).expect("htod");
    let mut outs = vec![poisoned::<f32>(g, 5000), poisoned::<f32>(g, 5000)];
    match small.allreduce(&g.stream, &[&a, &a], &mut outs, AlgoChoice::Auto) {
        Err(Error::MessageTooLarge {
            bytes: 20000,
            capacity: 4096,
        }) => {}
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    println!("  chunked messages bit-exact; chunking off refuses with MessageTooLarge");
}

fn timeout(g: &Gpu) {
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
fn stale_flags(g: &Gpu) {
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

fn user_errors(g: &Gpu) {
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

/// The GPUs of this machine, one context each (GPU 0's is the suite's own).
fn all_gpus(g: &Gpu) -> Vec<Arc<CudaContext>> {
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
fn placements(n_gpus: usize) -> Vec<Vec<usize>> {
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

fn upload_on<T: Bits>(s: &Arc<CudaStream>, bits: &[u32]) -> CudaSlice<T> {
    let host: Vec<T> = if bits.is_empty() {
        vec![poison::<T>()]
    } else {
        bits.iter().map(|&b| T::from_bits32(b)).collect()
    };
    s.clone_htod(&host).expect("upload")
}

fn poisoned_on<T: Bits>(s: &Arc<CudaStream>, len: usize) -> CudaSlice<T> {
    s.clone_htod(&vec![poison::<T>(); len.max(1)])
        .expect("alloc output")
}

fn download_on<T: Bits>(s: &Arc<CudaStream>, o: &CudaSlice<T>, len: usize) -> Vec<u32> {
    let v = s.clone_dtoh(o).expect("download");
    v[..len].iter().map(|x| x.to_bits32()).collect()
}

/// Every rank's bits against the reference and against rank 0's bits.
fn assert_ranks(what: &str, dtype: Dtype, outs: &[Vec<u32>], want: &[u32]) {
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

fn peer_setup(
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

/// The misuses of the API-safety issue, each now an error or a correct
/// result: registered buffers of a dropped group, one group driven from
/// two streams without synchronisation, a chunked call's reported
/// algorithm, and errors seen without `check()`.
fn api_safety(g: &Gpu) {
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

fn peer_group(g: &Gpu) {
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

/// PeerGroup allreduces captured in CUDA graphs (one graph per rank's
/// stream), replayed with new data every replay: registered and staged.
fn peer_group_graphs(g: &Gpu) {
    let ctxs = all_gpus(g);
    let place: Vec<usize> = if ctxs.len() >= 2 {
        vec![0, 1]
    } else {
        vec![0, 0]
    };
    let (grp, streams) = peer_setup(
        &ctxs,
        &place,
        Config {
            max_bytes: 4 << 20,
            push_max_bytes: 1 << 20,
            ..Config::default()
        },
    );
    let world = place.len();
    let len = 200_003usize;
    let reg = grp.alloc_registered::<f32>(len).expect("registered");
    let mut staged_in: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
    let mut out_reg: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
    let mut out_staged: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
    let mut out_push: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
    for s in &streams {
        s.synchronize().expect("sync");
    }
    // Relaxed: ending (and instantiating) one capture while the other stream
    // still captures is refused in thread-local mode.
    for s in &streams {
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .expect("begin capture");
    }
    let in_refs: Vec<&CudaSlice<f32>> = staged_in.iter().collect();
    let captured = grp
        .allreduce_registered(&streams, &reg, len, &mut out_reg, AlgoChoice::OneStage)
        .and_then(|_| grp.allreduce(&streams, &in_refs, &mut out_staged, AlgoChoice::TwoStage))
        .and_then(|_| {
            grp.allreduce_registered(&streams, &reg, len, &mut out_push, AlgoChoice::Push)
        });
    let graphs: Vec<_> = streams
        .iter()
        .map(|s| {
            s.end_capture(sys::CUgraphInstantiate_flags(0))
                .expect("end capture")
                .expect("graph")
        })
        .collect();
    captured.expect("allreduces during capture");
    drop(in_refs);
    for it in 0..50u64 {
        let inputs = values::adversarial_inputs(Dtype::F32, world, len, 7000 + it, it % 4 == 0);
        let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
        let want = reference::allreduce_bits(Dtype::F32, &refs);
        for (r, s) in streams.iter().enumerate() {
            let host: Vec<f32> = inputs[r].iter().map(|&b| f32::from_bits(b)).collect();
            let tmp = s.clone_htod(&host).expect("htod");
            reg.copy_from(r, s, &tmp).expect("registered input");
            // The graph reads `staged_in[r]` itself: new data goes there.
            s.memcpy_htod(&host, &mut staged_in[r])
                .expect("staged input");
            s.memcpy_htod(&vec![poison::<f32>(); len], &mut out_reg[r])
                .expect("poison");
            s.memcpy_htod(&vec![poison::<f32>(); len], &mut out_staged[r])
                .expect("poison");
            s.memcpy_htod(&vec![poison::<f32>(); len], &mut out_push[r])
                .expect("poison");
            s.synchronize().expect("sync");
        }
        for gr in &graphs {
            gr.launch().expect("graph launch");
        }
        grp.check(&streams)
            .unwrap_or_else(|e| panic!("replay {it}: {e}"));
        for (name, outs) in [
            ("registered", &out_reg),
            ("staged", &out_staged),
            ("push", &out_push),
        ] {
            let got: Vec<Vec<u32>> = outs
                .iter()
                .zip(&streams)
                .map(|(o, s)| download_on(s, o, len))
                .collect();
            assert_ranks(
                &format!("graph replay {it} {name}"),
                Dtype::F32,
                &got,
                &want,
            );
        }
    }
    println!(
        "  PeerGroup on GPUs {place:?} ({:?}): graphs of a registered one-stage, a staged two-stage and a registered push allreduce, 50 replays with new data, bit-exact",
        grp.link()
    );
}

/// Push and push_ll collectives, interleaved, back to back on the streams
/// (no host sync between them) whose grids differ: a 1-block message
/// between chunked many-block ones. Every block must pick the same landing
/// slot in a collective, or a fast peer writes the slot a slower rank still
/// reads; and push's raw data must never pass for push_ll's lines.
fn push_changing_grids(g: &Gpu) {
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

/// Number of nodes of a captured graph.
fn graph_nodes(graph: &cudarc::driver::CudaGraph) -> usize {
    let mut n = 0usize;
    // SAFETY: a live graph; a null node array asks for the count only.
    let r = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut n) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuGraphGetNodes");
    n
}

/// The cluster size (CTAs along x; 1 for a launch without clusters) of
/// every kernel node of a captured graph.
fn graph_cluster_sizes(graph: &cudarc::driver::CudaGraph) -> Vec<u32> {
    let n = graph_nodes(graph);
    let mut nodes = vec![std::ptr::null_mut(); n];
    let mut got = n;
    // SAFETY: a live graph; `nodes` has room for `got` handles.
    let r = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), nodes.as_mut_ptr(), &mut got) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuGraphGetNodes");
    let mut sizes = Vec::new();
    for &node in &nodes[..got] {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the live graph; `t` is written.
        let r = unsafe { sys::cuGraphNodeGetType(node, &mut t) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuGraphNodeGetType");
        if t != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            continue;
        }
        // SAFETY: plain data, all zeros valid; written by the call.
        let mut v: sys::CUkernelNodeAttrValue = unsafe { std::mem::zeroed() };
        // SAFETY: a kernel node of the live graph; `v` is written.
        let r = unsafe {
            sys::cuGraphKernelNodeGetAttribute(
                node,
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                &mut v,
            )
        };
        assert_eq!(
            r,
            sys::CUresult::CUDA_SUCCESS,
            "cuGraphKernelNodeGetAttribute"
        );
        // SAFETY: the cluster-dimension member of the value just read.
        sizes.push(unsafe { v.clusterDim.x }.max(1));
    }
    sizes
}

/// Fused push_ll rows split over thread-block clusters (sm_90 and newer):
/// every cluster size `Config::fused_ctas` takes, every dtype, worlds 1, 2,
/// 3 and 8, rows that need several rows per cluster, and rows whose last
/// CTAs hold no chunk (hidden 8 over 8 CTAs; 7168 over 8: 7 used), each
/// bit-exact on every rank from a graph replay. The graph's kernel node
/// shows the cluster size that ran: the plan's on sm_90 and newer, 1
/// before (no clusters: one block per row).
fn fused_push_ll_clusters(g: &Gpu) {
    let major = g
        .ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .expect("compute capability");
    let mut cases = 0;
    for ctas in [1u32, 2, 4, 8] {
        for world in [1usize, 2, 3, 8] {
            let cfg = Config {
                fused_ctas: Some(ctas),
                ..Config::with_max_bytes(1 << 20)
            };
            let grp = VirtualGroup::new(&g.ctx, world, cfg).expect("group");
            for dtype in Dtype::ALL {
                for hidden in [8usize, 64, 1024, 4096, 7168, 8192] {
                    if !takes_push_ll(dtype, hidden) {
                        continue;
                    }
                    let row_counts: &[usize] = if world == 8 { &[1, 5] } else { &[1, 3, 17] };
                    for &rows in row_counts {
                        let c = NormCase {
                            dtype,
                            world,
                            rows,
                            hidden,
                            seed: 4000 + cases as u64 * 5,
                        };
                        let want = if major >= 9 { ctas } else { 1 };
                        match dtype {
                            Dtype::F32 => fused_cluster_case::<f32>(g, &grp, &c, want),
                            Dtype::F16 => fused_cluster_case::<half::f16>(g, &grp, &c, want),
                            Dtype::Bf16 => fused_cluster_case::<half::bf16>(g, &grp, &c, want),
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    println!("  {cases} fused push_ll cases over clusters of 1, 2, 4 and 8 CTAs (sm_{major}x: clusters {}) bit-exact on every rank", if major >= 9 { "on" } else { "off" });
    // A dead peer: every CTA of every cluster leaves after the row whose
    // wait timed out (none waits at a cluster barrier for one that left),
    // the timeout is reported, and after `reset` (which clears the landing
    // zones the failed call wrote) the next calls are bit-exact again.
    for ctas in [1u32, 8] {
        let cfg = Config {
            fused_ctas: Some(ctas),
            timeout: Duration::from_millis(20),
            ..Config::with_max_bytes(1 << 20)
        };
        let grp = VirtualGroup::new(&g.ctx, 2, cfg).expect("group");
        for rows in [1usize, 5] {
            let what = format!("dead peer, clusters of {ctas}, {rows} rows");
            let t0 = Instant::now();
            let used = grp
                .add_rmsnorm_with_absent_ranks(
                    &g.stream,
                    0b10,
                    Dtype::Bf16,
                    AlgoChoice::PushLl,
                    rows,
                    7168,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(used, Algorithm::PushLl, "{what}");
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{what}: took {:?}",
                t0.elapsed()
            );
            match grp.check(&g.stream) {
                Err(Error::PeerTimeout {
                    rank: 0, peer: 1, ..
                }) => {}
                other => panic!("{what}: expected PeerTimeout of rank 0 naming 1, got {other:?}"),
            }
            grp.reset().expect("reset");
            let want = if major >= 9 { ctas } else { 1 };
            for seed in [1u64, 2] {
                let c = NormCase {
                    dtype: Dtype::Bf16,
                    world: 2,
                    rows,
                    hidden: 7168,
                    seed: 7000 + seed + rows as u64,
                };
                fused_cluster_case::<half::bf16>(g, &grp, &c, want);
            }
        }
    }
    println!(
        "  a dead peer under clusters of 1 and 8 CTAs: reported, no hang, bit-exact after reset"
    );
}

/// One [`fused_push_ll_clusters`] case: the fused push_ll call captured,
/// its kernel node's cluster size checked against `ctas`, the graph
/// launched, every rank checked.
fn fused_cluster_case<T: Bits>(g: &Gpu, grp: &VirtualGroup, c: &NormCase, ctas: u32) {
    let count = c.rows * c.hidden;
    let (x, res, gam, want) = c.data();
    let what = format!(
        "fused push_ll {:?} world {} rows {} hidden {} in clusters of {ctas}",
        c.dtype, c.world, c.rows, c.hidden
    );
    let mut bufs = NormBufs::<T>::upload(g, c.world, count, (&x, &res, &gam));
    let graph = capture(g, || {
        bufs.call(grp, &g.stream, (count, c.hidden), false, AlgoChoice::PushLl)
    });
    // One kernel node per push_ll step (rows beyond the zone take several).
    let sizes = graph_cluster_sizes(&graph);
    assert!(
        !sizes.is_empty() && sizes.iter().all(|&k| k == ctas),
        "{what}: kernel nodes' cluster sizes {sizes:?}"
    );
    graph.launch().expect("graph launch");
    grp.check(&g.stream)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    bufs.check(g, &what, c.dtype, count, false, &want);
}

/// Staged push_ll reads each rank's input where it is (`own_inputs`, no
/// copy into the staging buffer) when the input is aligned and no other
/// rank's output overlaps it; otherwise the step is staged. Every variant
/// bit-exact on every rank: distinct buffers and in place (read in place),
/// a misaligned input and rank 1's output over rank 0's input (staged);
/// the fused call likewise (distinct: in place; normed over x, or over
/// another rank's x: staged). A captured graph shows which way each went:
/// the in-place calls have fewer nodes (no copy) than the staged ones.
fn push_ll_direct_inputs(g: &Gpu) {
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

/// Starts this test binary as rank `rank` of an IPC group in `mode`.
fn spawn_rank(
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
fn wait_rank(mut c: std::process::Child, deadline: Instant) -> (bool, String) {
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
fn run_ranks(mode: &str, gpus: &[usize], dir: &std::path::Path, timeout: Duration) -> Vec<String> {
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

fn ipc_dir(what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("p2p-ar-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// N processes, rank r on GPU `r % gpus` (across devices when there are two
/// or more GPUs; kernels of processes sharing a GPU time-slice, slowly but
/// correctly), open each other's IPC handles and allreduce.
fn ipc_processes(_g: &Gpu) {
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

/// The peer timeout of the killed-rank test.
const KILL_TIMEOUT: Duration = Duration::from_secs(2);

/// Two rank processes (GPUs 0 and 1 when there are two) run allreduces in a
/// loop; rank 1 is killed (SIGKILL) in the middle. The survivor must get
/// `PeerTimeout` naming rank 1 within the configured timeout, nothing may
/// hang, and after `reset()` the survivor forms a new group with a new
/// rank-1 process and gets bit-exact results again.
fn killed_rank(_g: &Gpu) {
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

fn ipc_config(timeout: Duration) -> Config {
    Config {
        max_bytes: 256 << 10,
        timeout,
        ..Config::default()
    }
}

/// One f32 allreduce of `len` elements on a ProcessGroup, checked against
/// the reference on this rank.
fn ipc_allreduce(
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

fn ipc_child(rank: usize) -> i32 {
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

/// NCCL (feature `nccl`), loaded without any link made by hand: across
/// every GPU when there are two or more (NCCL refuses two ranks on one
/// device; with one GPU only world 1, which still checks the wiring). Two
/// ranks' sums are a single addition, so NCCL's bits equal the reference's
/// then. Also `PeerGroup::allreduce_routed`'s hand-over above `nccl_above`.
#[cfg(feature = "nccl")]
fn nccl_routed(g: &Gpu) {
    use p2p_allreduce::nccl::{self, NcclGroup};
    use p2p_allreduce::Route;
    let (path, version) = nccl::library().expect("libnccl found without a hand-made link");
    println!("  NCCL {version} from {path}");
    let ctxs = all_gpus(g);
    let world = ctxs.len().min(2);
    let streams: Vec<Arc<CudaStream>> = ctxs[..world]
        .iter()
        .map(|c| c.new_stream().expect("stream"))
        .collect();
    let n = NcclGroup::new(&streams).expect("NCCL communicators");
    let len = 10_007;
    let bits = values::adversarial_inputs(Dtype::F32, world, len, 5, false);
    let refs: Vec<&[u32]> = bits.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(Dtype::F32, &refs);
    let inputs: Vec<CudaSlice<f32>> = bits
        .iter()
        .zip(&streams)
        .map(|(b, s)| upload_on::<f32>(s, b))
        .collect();
    let in_refs: Vec<&CudaSlice<f32>> = inputs.iter().collect();
    let mut outs: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
    n.allreduce(&streams, &in_refs, &mut outs)
        .expect("ncclAllReduce");
    let got: Vec<Vec<u32>> = outs
        .iter()
        .zip(&streams)
        .map(|(o, s)| download_on(s, o, len))
        .collect();
    assert_ranks(&format!("NCCL world {world}"), Dtype::F32, &got, &want);

    let rank_ctxs: Vec<Arc<CudaContext>> = ctxs[..world].to_vec();
    let mut grp = PeerGroup::new(
        &rank_ctxs,
        Config {
            nccl_above: Some(1024),
            ..Config::default()
        },
    )
    .expect("group");
    grp.enable_nccl(&streams).expect("enable_nccl");
    // Below nccl_above, Auto's own choice for this link (push over NVLink).
    let small = grp
        .config()
        .thresholds
        .choose(AlgoChoice::Auto, 400, world, grp.link());
    for (len, want_route) in [(10_007usize, Route::Nccl), (100, Route::Kernel(small))] {
        let mut outs: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
        let ins: Vec<CudaSlice<f32>> = bits
            .iter()
            .zip(&streams)
            .map(|(b, s)| upload_on::<f32>(s, &b[..len]))
            .collect();
        let in_refs: Vec<&CudaSlice<f32>> = ins.iter().collect();
        let route = grp
            .allreduce_routed(&streams, &in_refs, &mut outs, AlgoChoice::Auto)
            .expect("routed");
        grp.check(&streams).expect("check");
        assert_eq!(route, want_route, "len {len}");
        let got: Vec<Vec<u32>> = outs
            .iter()
            .zip(&streams)
            .map(|(o, s)| download_on(s, o, len))
            .collect();
        assert_ranks(
            &format!("routed len {len} via {route:?}"),
            Dtype::F32,
            &got,
            &want[..len],
        );
    }
    println!(
        "  NCCL world {world} (GPUs 0..{world}): allreduce equals the reference; Auto hands messages above nccl_above to NCCL, smaller ones to the kernels"
    );
}

/// Issue 44: a table that gives NCCL a size band makes
/// `PeerGroup::allreduce_routed` run NCCL there under `Auto` (and
/// `nccl_wins` say so) and the kernels elsewhere, while deterministic
/// routing keeps every size ours; NCCL's symmetric windows (NCCL >= 2.27)
/// sum two ranks as the reference does (one addition). Needs two GPUs
/// (NCCL refuses two ranks on one device).
#[cfg(feature = "nccl")]
fn nccl_table_routing(g: &Gpu) {
    use p2p_allreduce::nccl::{self, NcclGroup};
    use p2p_allreduce::thresholds::{Backend, Mode, WinnerBand};
    use p2p_allreduce::{Link, Route};
    let ctxs = all_gpus(g);
    if ctxs.len() < 2 {
        println!("  not run (this machine has 1 GPU: NCCL needs one GPU per rank)");
        return;
    }
    let world = 2;
    let streams: Vec<Arc<CudaStream>> = ctxs[..world]
        .iter()
        .map(|c| c.new_stream().expect("stream"))
        .collect();
    // NCCL wins 4 KiB < bytes <= 64 KiB, ours elsewhere, on every link.
    let mut config = Config::default();
    for link in [Link::SameDevice, Link::NvLink, Link::Pcie] {
        config
            .thresholds
            .set_winners(
                link,
                world,
                vec![
                    WinnerBand {
                        up_to: 4096,
                        winner: Backend::Ours,
                        margin: Some(0.5),
                    },
                    WinnerBand {
                        up_to: 64 << 10,
                        winner: Backend::Nccl,
                        margin: Some(0.25),
                    },
                    WinnerBand {
                        up_to: usize::MAX,
                        winner: Backend::Ours,
                        margin: Some(0.1),
                    },
                ],
            )
            .expect("winners");
    }
    let mut grp = PeerGroup::new(&ctxs[..world], config).expect("group");
    grp.enable_nccl(&streams).expect("enable_nccl");
    let len_max = 100_000;
    let bits = values::adversarial_inputs(Dtype::F32, world, len_max, 44, false);
    let refs: Vec<&[u32]> = bits.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(Dtype::F32, &refs);
    for (len, nccl_band) in [
        (1000usize, false),
        (1024, false),
        (1025, true),
        (16_384, true),
        (16_385, false),
        (len_max, false),
    ] {
        let bytes = len * 4;
        assert_eq!(grp.nccl_wins(len, Dtype::F32), nccl_band, "{bytes} B");
        assert_eq!(
            grp.route(len, Dtype::F32, Mode::Deterministic),
            Backend::Ours
        );
        let want_route = if nccl_band {
            Route::Nccl
        } else {
            Route::Kernel(
                grp.config()
                    .choose(AlgoChoice::Auto, bytes, world, grp.link()),
            )
        };
        let ins: Vec<CudaSlice<f32>> = bits
            .iter()
            .zip(&streams)
            .map(|(b, s)| upload_on::<f32>(s, &b[..len]))
            .collect();
        let in_refs: Vec<&CudaSlice<f32>> = ins.iter().collect();
        let mut outs: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
        let route = grp
            .allreduce_routed(&streams, &in_refs, &mut outs, AlgoChoice::Auto)
            .expect("routed");
        grp.check(&streams).expect("check");
        assert_eq!(route, want_route, "{bytes} B");
        // An explicit algorithm never goes to NCCL.
        let explicit = grp
            .allreduce_routed(&streams, &in_refs, &mut outs, AlgoChoice::OneStage)
            .expect("explicit");
        grp.check(&streams).expect("check");
        assert_eq!(explicit, Route::Kernel(Algorithm::OneStage), "{bytes} B");
        let got: Vec<Vec<u32>> = outs
            .iter()
            .zip(&streams)
            .map(|(o, s)| download_on(s, o, len))
            .collect();
        assert_ranks(
            &format!("routed {bytes} B via {route:?}"),
            Dtype::F32,
            &got,
            &want[..len],
        );
    }
    match nccl::symmetric_support() {
        Err(e) => println!("  symmetric windows: not run ({e})"),
        Ok(()) => {
            let len = 10_007;
            let mut n = NcclGroup::new(&streams).expect("NCCL communicators");
            let sym = n.enable_symmetric(len * 4).expect("symmetric windows");
            assert_eq!(n.symmetric().as_ref(), Some(&sym));
            for (r, s) in streams.iter().enumerate() {
                // SAFETY: the window input holds len f32 on rank r's device.
                unsafe { driver::write_at(s.context(), sym.inputs[r], &bits[r][..len]) }
                    .expect("write the window input");
            }
            // SAFETY: the windows hold len elements and outlive the call
            // (synchronised below).
            unsafe { n.allreduce_raw(&streams, Dtype::F32, len, &sym.inputs, &sym.outputs) }
                .expect("ncclAllReduce on the windows");
            let mut outs: Vec<CudaSlice<f32>> =
                streams.iter().map(|s| poisoned_on(s, len)).collect();
            for ((o, s), &w) in outs.iter_mut().zip(&streams).zip(&sym.outputs) {
                let dst = o.device_ptr_mut(s).0;
                // SAFETY: both hold len f32 on this rank's device, ordered
                // after the allreduce on the same stream.
                unsafe { driver::copy_dtod_async(s, dst, w, len * 4) }.expect("copy out");
            }
            let got: Vec<Vec<u32>> = outs
                .iter()
                .zip(&streams)
                .map(|(o, s)| download_on(s, o, len))
                .collect();
            assert_ranks("NCCL on symmetric windows", Dtype::F32, &got, &want[..len]);
            drop(n);
            println!("  symmetric windows: ncclMemAlloc + ncclCommWindowRegister, allreduce equals the reference, released on drop");
        }
    }
    println!(
        "  PeerGroup on GPUs 0,1 ({:?}): Auto hands the table's NCCL band to NCCL and the rest to the kernels; deterministic routing keeps every size ours",
        grp.link()
    );
}

// ---------------------------------------------------------------------------
// Thresholds files: a hand-made table changes what Auto runs.

/// Sets `P2P_ALLREDUCE_THRESHOLDS` for the life of the guard.
struct ThresholdsEnv;

impl ThresholdsEnv {
    fn set(value: &std::path::Path) -> Self {
        // The suite runs its cases one at a time on one thread.
        std::env::set_var(p2p_allreduce::thresholds::ENV_VAR, value);
        ThresholdsEnv
    }
}

impl Drop for ThresholdsEnv {
    fn drop(&mut self) {
        std::env::remove_var(p2p_allreduce::thresholds::ENV_VAR);
    }
}

fn thresholds_file(g: &Gpu) {
    use p2p_allreduce::thresholds::{FileBand, Origin, ThresholdsFile, TunedTable, FORMAT};
    let dir = std::env::temp_dir().join(format!("p2p-thresholds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("thresholds.json");
    let gpu = driver::device_info(&g.ctx).expect("device info").name;
    let gpus = driver::device_count().expect("device count");
    // World 3 on this GPU: push_ll up to 64 bytes, then push_two_stage
    // (the built-in table never pushes on one device).
    let file = ThresholdsFile {
        format: FORMAT.into(),
        tables: vec![TunedTable {
            gpu,
            gpus,
            links: vec![],
            link: "same".into(),
            world: 3,
            dtype: "f32".into(),
            measured: "gpu suite, hand-made".into(),
            bands: vec![
                FileBand {
                    up_to: Some(64),
                    algorithm: "push_ll".into(),
                    winner: None,
                    margin: None,
                },
                FileBand {
                    up_to: None,
                    algorithm: "push_two_stage".into(),
                    winner: None,
                    margin: None,
                },
            ],
        }],
    };
    std::fs::write(&path, file.to_json()).expect("write thresholds file");
    let _env = ThresholdsEnv::set(&path);
    let grp = VirtualGroup::new(&g.ctx, 3, Config::with_max_bytes(1 << 20)).expect("group");
    assert!(
        matches!(grp.config().thresholds.origin(), Origin::File { .. }),
        "{:?}",
        grp.config().thresholds.origin()
    );
    for (len, want) in [
        (16usize, Algorithm::PushLl),
        (100_003, Algorithm::PushTwoStage),
    ] {
        let inputs = values::adversarial_inputs(Dtype::F32, 3, len, 77 + len as u64, true);
        let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
        let expect = reference::allreduce_bits(Dtype::F32, &refs);
        let ins: Vec<CudaSlice<f32>> = inputs.iter().map(|b| upload::<f32>(g, b)).collect();
        let in_refs: Vec<&CudaSlice<f32>> = ins.iter().collect();
        let mut outs: Vec<CudaSlice<f32>> = (0..3).map(|_| poisoned::<f32>(g, len)).collect();
        let used = grp
            .allreduce(&g.stream, &in_refs, &mut outs, AlgoChoice::Auto)
            .expect("allreduce");
        assert_eq!(used, want, "len {len}");
        grp.check(&g.stream).expect("check");
        let got: Vec<Vec<u32>> = outs.iter().map(|o| download(g, o, len)).collect();
        assert_ranks(&format!("file table, len {len}"), Dtype::F32, &got, &expect);
    }
    // No entry for world 2: the built-in table.
    let two = VirtualGroup::new(&g.ctx, 2, Config::with_max_bytes(1 << 20)).expect("group");
    assert_eq!(two.config().thresholds.origin(), &Origin::BuiltIn);
    // A broken file, and a named file that does not exist: typed errors.
    std::fs::write(&path, "{ not json").expect("write");
    let r = VirtualGroup::new(&g.ctx, 3, Config::with_max_bytes(1 << 20));
    assert!(matches!(r, Err(Error::ThresholdsFile { .. })), "{r:?}");
    let _missing = ThresholdsEnv::set(&dir.join("missing.json"));
    let r = VirtualGroup::new(&g.ctx, 3, Config::with_max_bytes(1 << 20));
    assert!(matches!(r, Err(Error::ThresholdsFile { .. })), "{r:?}");
    // `none`: the built-in table, whatever the files say.
    let _none = ThresholdsEnv::set(std::path::Path::new("none"));
    let r = VirtualGroup::new(&g.ctx, 3, Config::with_max_bytes(1 << 20)).expect("group");
    assert_eq!(r.config().thresholds.origin(), &Origin::BuiltIn);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------
// Fused allreduce + residual add + RMSNorm: every rank's residual out and
// normed rows against the CPU oracle, bit for bit.

/// One fused case on any group kind: `rows x hidden`, this `world`, a
/// residual and a gamma per rank (all different), eps 1e-6.
struct NormCase {
    dtype: Dtype,
    world: usize,
    rows: usize,
    hidden: usize,
    seed: u64,
}

impl NormCase {
    /// (inputs, residuals, gammas, wanted (residual out, normed) per rank).
    #[allow(clippy::type_complexity)]
    fn data(
        &self,
    ) -> (
        Vec<Vec<u32>>,
        Vec<Vec<u32>>,
        Vec<Vec<u32>>,
        Vec<(Vec<u32>, Vec<u32>)>,
    ) {
        let count = self.rows * self.hidden;
        let x = values::adversarial_inputs(self.dtype, self.world, count, self.seed, true);
        let res = values::adversarial_inputs(self.dtype, self.world, count, self.seed + 1, false);
        let gam =
            values::adversarial_inputs(self.dtype, self.world, self.hidden, self.seed + 2, false);
        let refs: Vec<&[u32]> = x.iter().map(|v| v.as_slice()).collect();
        let want = (0..self.world)
            .map(|r| reference::add_rmsnorm_bits(self.dtype, &refs, &res[r], &gam[r], NORM_EPS))
            .collect();
        (x, res, gam, want)
    }
}

const NORM_EPS: f32 = 1e-6;

/// One fused case's device buffers on the suite's GPU: every rank's x,
/// residual and gamma uploaded, and its normed output poisoned.
struct NormBufs<T: Bits> {
    xs: Vec<CudaSlice<T>>,
    rs: Vec<CudaSlice<T>>,
    gs: Vec<CudaSlice<T>>,
    outs: Vec<CudaSlice<T>>,
}

impl<T: Bits> NormBufs<T> {
    /// `data`: (inputs, residuals, gammas) per rank, as [`NormCase::data`]
    /// gives them; `count` elements per output.
    #[allow(clippy::type_complexity)]
    fn upload(
        g: &Gpu,
        world: usize,
        count: usize,
        data: (&[Vec<u32>], &[Vec<u32>], &[Vec<u32>]),
    ) -> Self {
        let (x, res, gam) = data;
        NormBufs {
            xs: x.iter().map(|b| upload::<T>(g, b)).collect(),
            rs: res.iter().map(|b| upload::<T>(g, b)).collect(),
            gs: gam.iter().map(|b| upload::<T>(g, b)).collect(),
            outs: (0..world).map(|_| poisoned::<T>(g, count)).collect(),
        }
    }

    /// Every rank's residual out and normed rows (in `xs` when
    /// `in_place`, else in `outs`) against the oracle's `want`.
    fn check(
        &self,
        g: &Gpu,
        what: &str,
        dtype: Dtype,
        count: usize,
        in_place: bool,
        want: &[(Vec<u32>, Vec<u32>)],
    ) {
        for (r, want) in want.iter().enumerate() {
            let got_res = download(g, &self.rs[r], count);
            let normed_at = if in_place { &self.xs[r] } else { &self.outs[r] };
            let got_norm = download(g, normed_at, count);
            check_norm_rank(what, dtype, r, (&got_res, &got_norm), want);
        }
    }

    /// The fused call of `grp` on the first `count` elements of each
    /// rank's buffers (rows of `hidden`): the normed rows into `outs`, or
    /// over `xs` when `in_place`.
    fn call(
        &mut self,
        grp: &VirtualGroup,
        stream: &Arc<CudaStream>,
        (count, hidden): (usize, usize),
        in_place: bool,
        algo: AlgoChoice,
    ) -> p2p_allreduce::Result<Algorithm> {
        let gv: Vec<_> = self.gs.iter().map(|s| s.slice(0..hidden)).collect();
        let gr: Vec<&_> = gv.iter().collect();
        let mut rv: Vec<_> = self.rs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
        if in_place {
            let mut xv: Vec<_> = self.xs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
            grp.allreduce_add_rmsnorm_in_place(stream, &mut xv, &mut rv, &gr, NORM_EPS, algo)
        } else {
            let xv: Vec<_> = self.xs.iter().map(|s| s.slice(0..count)).collect();
            let xr: Vec<&_> = xv.iter().collect();
            let mut ov: Vec<_> = self
                .outs
                .iter_mut()
                .map(|s| s.slice_mut(0..count))
                .collect();
            grp.allreduce_add_rmsnorm(stream, &xr, &mut rv, &gr, NORM_EPS, &mut ov, algo)
        }
    }
}

fn check_norm_rank(
    what: &str,
    dtype: Dtype,
    r: usize,
    got: (&[u32], &[u32]),
    want: &(Vec<u32>, Vec<u32>),
) {
    if let Err(e) = norm_mismatch(what, dtype, r, got, want) {
        panic!("{e}");
    }
}

/// Rank `r`'s residual out and normed rows against the oracle's: the first
/// differing element, as an error.
fn norm_mismatch(
    what: &str,
    dtype: Dtype,
    r: usize,
    got: (&[u32], &[u32]),
    want: &(Vec<u32>, Vec<u32>),
) -> Result<(), String> {
    for (name, g, w) in [("residual out", got.0, &want.0), ("normed", got.1, &want.1)] {
        if let Some((i, gb, wb)) = reference::first_mismatch(dtype, g, w) {
            return Err(format!(
                "{what}: rank {r} {name} element {i}: got {}, want {}",
                reference::fmt_bits(dtype, gb),
                reference::fmt_bits(dtype, wb)
            ));
        }
    }
    Ok(())
}

fn norm_virtual<T: Bits>(
    g: &Gpu,
    grp: &VirtualGroup,
    c: &NormCase,
    algo: AlgoChoice,
    in_place: bool,
) -> Algorithm {
    let count = c.rows * c.hidden;
    let (x, res, gam, want) = c.data();
    let what = format!(
        "virtual {:?} world {} rows {} hidden {} {algo:?}{}",
        c.dtype,
        c.world,
        c.rows,
        c.hidden,
        if in_place { " in place" } else { "" }
    );
    let mut bufs = NormBufs::<T>::upload(g, c.world, count, (&x, &res, &gam));
    let used = bufs
        .call(grp, &g.stream, (count, c.hidden), in_place, algo)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    grp.check(&g.stream)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    bufs.check(g, &what, c.dtype, count, in_place, &want);
    used
}

/// Whether the fused push_ll kernel takes rows of `hidden` at the default
/// block size (its register path, `abi::norm_reg_path`).
fn takes_push_ll(dtype: Dtype, hidden: usize) -> bool {
    let threads = Config::default().threads_per_block as u64;
    abi::norm_reg_path(dtype.lanes(), hidden as u64, threads)
}

/// An explicit push_ll for rows off the register path: refused with
/// `NormPushLlShape` before any work (every residual and output left as
/// it was), and the group stays healthy.
fn push_ll_refused_virtual<T: Bits>(g: &Gpu, grp: &VirtualGroup, c: &NormCase) {
    let count = c.rows * c.hidden;
    let what = format!(
        "virtual {:?} world {} rows {} hidden {} PushLl",
        c.dtype, c.world, c.rows, c.hidden
    );
    let (x, res, gam, _) = c.data();
    let mut bufs = NormBufs::<T>::upload(g, c.world, count, (&x, &res, &gam));
    let r = bufs.call(grp, &g.stream, (count, c.hidden), false, AlgoChoice::PushLl);
    assert!(
        matches!(r, Err(Error::NormPushLlShape { hidden, .. }) if hidden == c.hidden),
        "{what}: {r:?}"
    );
    grp.check(&g.stream)
        .unwrap_or_else(|e| panic!("{what}: the refusal left the group unhealthy: {e}"));
    for (r, res) in res.iter().enumerate() {
        assert_eq!(
            &download(g, &bufs.rs[r], count),
            res,
            "{what}: residual {r} changed"
        );
        assert!(
            download(g, &bufs.outs[r], count)
                .iter()
                .all(|&b| b == poison::<T>().to_bits32()),
            "{what}: output {r} written"
        );
    }
}

fn fused_add_rmsnorm(g: &Gpu) {
    let mut cases = 0;
    let mut refused = 0;
    let mut rng = 0x5eed_u64;
    for world in [1usize, 2, 3, 8] {
        // Small buffers, so that larger calls run in row chunks.
        let grp =
            VirtualGroup::new(&g.ctx, world, Config::with_max_bytes(256 << 10)).expect("group");
        for dtype in Dtype::ALL {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let random_hidden = 1 + (rng >> 33) as usize % 3000;
            for hidden in [1usize, 7, 128, 4096, 5120, 7168, 8192, random_hidden] {
                let row_counts: &[usize] = if hidden <= 128 {
                    &[0, 1, 3, 300]
                } else if world == 8 {
                    &[1, 17]
                } else {
                    &[0, 1, 3, 64]
                };
                for &rows in row_counts {
                    for algo in [
                        AlgoChoice::OneStage,
                        AlgoChoice::TwoStage,
                        AlgoChoice::PushLl,
                        AlgoChoice::Auto,
                    ] {
                        let c = NormCase {
                            dtype,
                            world,
                            rows,
                            hidden,
                            seed: 1000 + cases as u64 * 7,
                        };
                        if algo == AlgoChoice::PushLl && !takes_push_ll(dtype, hidden) {
                            match dtype {
                                Dtype::F32 => push_ll_refused_virtual::<f32>(g, &grp, &c),
                                Dtype::F16 => push_ll_refused_virtual::<half::f16>(g, &grp, &c),
                                Dtype::Bf16 => push_ll_refused_virtual::<half::bf16>(g, &grp, &c),
                            }
                            refused += 1;
                            continue;
                        }
                        let in_place = cases % 5 == 0;
                        let used = match dtype {
                            Dtype::F32 => norm_virtual::<f32>(g, &grp, &c, algo, in_place),
                            Dtype::F16 => norm_virtual::<half::f16>(g, &grp, &c, algo, in_place),
                            Dtype::Bf16 => norm_virtual::<half::bf16>(g, &grp, &c, algo, in_place),
                        };
                        if let Some(a) = algo.explicit() {
                            assert_eq!(used, a);
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    // Typed refusals.
    let grp = VirtualGroup::new(&g.ctx, 2, Config::with_max_bytes(1 << 20)).expect("group");
    let x = upload::<f32>(g, &[0; 10]);
    let mut rs = vec![upload::<f32>(g, &[0; 10]), upload::<f32>(g, &[0; 10])];
    let gm = upload::<f32>(g, &[0; 4]);
    let mut os = vec![poisoned::<f32>(g, 10), poisoned::<f32>(g, 10)];
    for (hidden, eps, algo, what) in [
        (4usize, NORM_EPS, AlgoChoice::Auto, "10 elements, hidden 4"),
        (2, f32::NAN, AlgoChoice::Auto, "eps NaN"),
        (2, -1.0, AlgoChoice::Auto, "eps < 0"),
        (2, NORM_EPS, AlgoChoice::Push, "push"),
    ] {
        let gv = gm.slice(0..hidden);
        let r = grp.allreduce_add_rmsnorm(
            &g.stream,
            &[&x, &x],
            &mut rs,
            &[&gv, &gv],
            eps,
            &mut os,
            algo,
        );
        let ok = match algo {
            AlgoChoice::Push => matches!(r, Err(Error::NormAlgorithm(Algorithm::Push))),
            _ => matches!(r, Err(Error::NormShape(_))),
        };
        assert!(ok, "{what}: {r:?}");
    }
    grp.check(&g.stream)
        .expect("refusals leave the group healthy");

    // Real ranks: a PeerGroup on every placement (across GPUs when there
    // are two), bf16 hidden 7168, as in decoding.
    let ctxs = all_gpus(g);
    let mut peer_cases = 0;
    for place in placements(ctxs.len()) {
        let world = place.len();
        let (pg, streams) = peer_setup(&ctxs, &place, Config::with_max_bytes(1 << 20));
        for rows in [0usize, 1, 3, 64] {
            for algo in [
                AlgoChoice::OneStage,
                AlgoChoice::TwoStage,
                AlgoChoice::PushLl,
                AlgoChoice::Auto,
            ] {
                let c = NormCase {
                    dtype: Dtype::Bf16,
                    world,
                    rows,
                    hidden: 7168,
                    seed: 9000 + peer_cases as u64 * 3,
                };
                let count = rows * 7168;
                let (x, res, gam, want) = c.data();
                let what = format!("PeerGroup GPUs {place:?} rows {rows} {algo:?}");
                let xs: Vec<CudaSlice<half::bf16>> = x
                    .iter()
                    .zip(&streams)
                    .map(|(b, s)| upload_on(s, b))
                    .collect();
                let mut rs: Vec<CudaSlice<half::bf16>> = res
                    .iter()
                    .zip(&streams)
                    .map(|(b, s)| upload_on(s, b))
                    .collect();
                let gs: Vec<CudaSlice<half::bf16>> = gam
                    .iter()
                    .zip(&streams)
                    .map(|(b, s)| upload_on(s, b))
                    .collect();
                let mut outs: Vec<CudaSlice<half::bf16>> =
                    streams.iter().map(|s| poisoned_on(s, count)).collect();
                {
                    let xv: Vec<_> = xs.iter().map(|s| s.slice(0..count)).collect();
                    let xr: Vec<&_> = xv.iter().collect();
                    let gv: Vec<_> = gs.iter().map(|s| s.slice(0..7168)).collect();
                    let gr: Vec<&_> = gv.iter().collect();
                    let mut rv: Vec<_> = rs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
                    let mut ov: Vec<_> = outs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
                    pg.allreduce_add_rmsnorm(&streams, &xr, &mut rv, &gr, NORM_EPS, &mut ov, algo)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                pg.check(&streams).unwrap_or_else(|e| panic!("{what}: {e}"));
                for r in 0..world {
                    let got_res = download_on(&streams[r], &rs[r], count);
                    let got_norm = download_on(&streams[r], &outs[r], count);
                    check_norm_rank(&what, Dtype::Bf16, r, (&got_res, &got_norm), &want[r]);
                }
                peer_cases += 1;
            }
        }
    }
    assert!(refused > 0, "no push_ll refusal case ran");
    println!("  {cases} virtual-rank and {peer_cases} PeerGroup fused cases bit-exact (residual out and normed, every rank); {refused} push_ll calls off the register path refused untouched");
}

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

fn fused_registered(g: &Gpu) {
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

// ---------------------------------------------------------------------------
// Issue 31: bugs found by a downstream oracle, one host per group, and the
// fault matrix. Each case a few seconds.

/// A table whose `Auto` runs two-stage at every size, on every link, for
/// every world: where a zero-copy call's rows exceed the scratch, `Auto`
/// must then fall back to one-stage instead of refusing.
fn two_stage_everywhere() -> p2p_allreduce::Thresholds {
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
fn unix_ms() -> u128 {
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
fn peer_one_gpu_issue31(g: &Gpu) {
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

/// Item 5 (b): a zero-copy fused call under `Auto` whose rows (64 x 4096
/// f32 = 1 MiB) exceed the scratch (64 KiB), with a table that says
/// two-stage: it runs one-stage, bit-exact, on a VirtualGroup, a PeerGroup
/// (GPU 0 twice; across GPUs 0 and 1 where there are two) and a
/// ProcessGroup of two processes on GPU 0. An explicit two-stage is
/// refused (`ScratchTooSmall`, nothing written). Before the fix, `Auto`
/// returned `ScratchTooSmall`.
fn fused_auto_beyond_scratch(g: &Gpu) {
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
fn auto_fused_child(rank: usize) -> Result<String, String> {
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

/// Item 5 (c): graph capture under cudarc's defaults (a fresh context
/// object of GPU 0: event tracking on, several streams).
/// - `measure::time_registered` (failed with
///   `CUDA_ERROR_STREAM_CAPTURE_ISOLATION` before): times, results checked.
/// - A typed call whose output slices carry cudarc's events, captured:
///   `Error::CaptureInvalidated` (which says what to do), the capture ends
///   cleanly and the group stays healthy (if the driver lets the capture
///   go on instead, the call must have captured correctly: checked).
/// - The raw registered call captured: every replay bit-exact.
///
/// The ProcessGroup capture paths take raw pointers and run under the
/// defaults in every IPC case of this suite (their rank processes never
/// turn the tracking off).
fn capture_tracking_on(_g: &Gpu) {
    let ctx = driver::open_device(0).expect("GPU 0");
    assert!(ctx.is_event_tracking(), "a fresh context tracks events");
    let stream = ctx.new_stream().expect("stream");
    let _second = ctx.new_stream().expect("stream"); // several streams: tracking active
    assert!(ctx.is_managing_stream_synchronization());
    let grp = VirtualGroup::new(&ctx, 2, Config::with_max_bytes(1 << 20)).expect("group");
    let n = 8192usize;
    let fill: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.25 - 3.0).collect();
    let sample = p2p_allreduce::measure::time_registered(
        &grp,
        &stream,
        n,
        &fill,
        AlgoChoice::Auto,
        p2p_allreduce::measure::Timing {
            per_graph: 5,
            warmup: 1,
            replays: 3,
        },
    )
    .unwrap_or_else(|e| panic!("measure::time_registered under cudarc's defaults: {e}"));
    assert!(sample.median_us > 0.0);
    // A typed call inside a capture, outputs with events.
    let reg = grp.alloc_registered::<f32>(n).expect("registered");
    let inputs = values::adversarial_inputs(Dtype::F32, 2, n, 35_000, true);
    let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(Dtype::F32, &refs);
    for (r, b) in inputs.iter().enumerate() {
        reg.copy_from(r, &stream, &upload_on::<f32>(&stream, b))
            .expect("input");
    }
    let mut outs: Vec<CudaSlice<f32>> = (0..2).map(|_| poisoned_on::<f32>(&stream, n)).collect();
    stream.synchronize().expect("sync");
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    let r = grp.allreduce_registered(&stream, &reg, n, &mut outs, AlgoChoice::OneStage);
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    let typed = match (r, ended) {
        (Err(Error::CaptureInvalidated { cause }), ended) => {
            assert!(ended.is_err() || matches!(ended, Ok(None)), "an invalidated capture ended with a graph");
            println!("  typed call with tracked slices in a capture: CaptureInvalidated ({cause})");
            true
        }
        (Ok(_), Ok(Some(graph))) => {
            graph.launch().expect("launch");
            grp.check(&stream).expect("check");
            let got: Vec<Vec<u32>> = outs.iter().map(|o| download_on(&stream, o, n)).collect();
            assert_ranks("typed call captured with tracking on", Dtype::F32, &got, &want);
            println!("  typed call with tracked slices in a capture: the driver let it go on; replay bit-exact");
            false
        }
        (r, ended) => panic!(
            "typed call in a capture with tracking on: expected CaptureInvalidated or a working graph, got {r:?} / {:?}",
            ended.map(|g| g.is_some())
        ),
    };
    grp.check(&stream)
        .expect("the group is healthy after the refused capture");
    // Raw outputs: the capture works, every replay bit-exact.
    let raw: Vec<driver::DeviceAlloc> = (0..2)
        .map(|_| driver::DeviceAlloc::zeroed(&ctx, n * 4).expect("alloc"))
        .collect();
    let ptrs: Vec<u64> = raw.iter().map(|a| a.ptr()).collect();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    // SAFETY: both outputs hold n f32 and outlive the graph.
    let r = unsafe { grp.allreduce_registered_raw(&stream, &reg, n, &ptrs, AlgoChoice::OneStage) };
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .expect("end capture")
        .expect("a graph");
    r.expect("raw registered call in a capture with tracking on");
    for it in 0..3u64 {
        let inputs = values::adversarial_inputs(Dtype::F32, 2, n, 35_100 + it, true);
        let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
        let want = reference::allreduce_bits(Dtype::F32, &refs);
        for (r, b) in inputs.iter().enumerate() {
            reg.copy_from(r, &stream, &upload_on::<f32>(&stream, b))
                .expect("input");
        }
        stream.synchronize().expect("sync");
        for a in &raw {
            a.write(&vec![poison::<f32>().to_bits(); n])
                .expect("poison");
        }
        graph.launch().expect("launch");
        grp.check(&stream).expect("check");
        let got: Vec<Vec<u32>> = raw
            .iter()
            .map(|a| {
                let mut v = vec![0u32; n];
                a.read(&mut v).expect("read");
                v
            })
            .collect();
        assert_ranks(&format!("raw capture replay {it}"), Dtype::F32, &got, &want);
    }
    println!(
        "  cudarc defaults (tracking on): time_registered {:.2} us ({:?}); typed capture {}; raw capture: 3 replays bit-exact",
        sample.median_us,
        sample.algorithm,
        if typed { "refused, typed" } else { "worked" }
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
fn cross_host_refused(g: &Gpu) {
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
fn fault_rounds(group: &ProcessGroup, stream: &Arc<CudaStream>) -> Result<(), String> {
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
fn fault_child(rank: usize) -> Result<String, String> {
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
fn fault_matrix(_g: &Gpu) {
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
