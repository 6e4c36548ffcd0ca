//! CUDA graphs: replays of virtual and peer groups, the graph's nodes and
//! cluster sizes, and capture with cudarc's event tracking on.

use crate::harness::*;

/// A captured graph replayed 1000 times, with new data before each replay,
/// gives the reference result every time (epochs advance on the device).
pub(crate) fn graph_replay(g: &Gpu) {
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

/// PeerGroup allreduces captured in CUDA graphs (one graph per rank's
/// stream), replayed with new data every replay: registered and staged.
pub(crate) fn peer_group_graphs(g: &Gpu) {
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

/// Number of nodes of a captured graph.
pub(crate) fn graph_nodes(graph: &cudarc::driver::CudaGraph) -> usize {
    let mut n = 0usize;
    // SAFETY: a live graph; a null node array asks for the count only.
    let r = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut n) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuGraphGetNodes");
    n
}

/// The cluster size (CTAs along x; 1 for a launch without clusters) of
/// every kernel node of a captured graph.
pub(crate) fn graph_cluster_sizes(graph: &cudarc::driver::CudaGraph) -> Vec<u32> {
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
pub(crate) fn capture_tracking_on(_g: &Gpu) {
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
