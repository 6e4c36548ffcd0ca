//! A host shared with other users (issue 48, item 4): a peer whose
//! records claim more than the allocation its CUDA IPC handle maps (a
//! staging buffer smaller than the settings say; a registered buffer or a
//! captured input that runs past its allocation) is refused on every rank,
//! with a typed error naming the rank and the sizes, before any kernel
//! could read through it; the GPU context survives (a later group on it
//! works, registered buffers included).
//!
//! The broken peer is forged with `ProcessGroup::new_forged` (the test
//! kit's hook): rank 1 publishes what a corrupted, foreign or planted
//! record would say. Rank 0 finds it (`PeerBufferTooSmall`), rank 1 hears
//! of it in the round after the mapping (`PeerSetupFailed`).

use crate::faults::fault_rounds;
use crate::harness::*;
use crate::processes::ipc_allreduce;
use p2p_allreduce::process_group::Forgery;

/// Large enough that an allocation of a fraction of it stays short of it
/// even where the driver rounds a mapping up to its 2 MiB granularity.
const MAX_BYTES: usize = 8 << 20;

fn cfg() -> Config {
    Config {
        max_bytes: MAX_BYTES,
        timeout: Duration::from_secs(10),
        ..Config::default()
    }
}

/// What each rank must get when rank 1 forged `what`: rank 0 the check's
/// own error about rank 1's `what`, rank 1 its peer's failure. Returns a
/// line for the log (the sizes the driver reported).
fn expect_refused<T: std::fmt::Debug>(
    rank: usize,
    step: &str,
    what: &str,
    got: p2p_allreduce::Result<T>,
) -> Result<String, String> {
    match (rank, got) {
        (
            0,
            Err(
                ref e @ Error::PeerBufferTooSmall {
                    rank: 0,
                    peer: 1,
                    what: w,
                    offset,
                    bytes,
                    mapped,
                },
            ),
        ) if w == what => {
            if offset.checked_add(bytes).is_some_and(|end| end <= mapped) {
                return Err(format!("{step}: refused although it fits: {e}"));
            }
            Ok(format!(
                "{step}: PeerBufferTooSmall ({what}: {bytes} bytes at offset {offset}, {mapped} mapped)"
            ))
        }
        (
            1,
            Err(Error::PeerSetupFailed {
                rank: 1,
                peer: 0,
                reason,
                ..
            }),
        ) if reason.contains(what) => Ok(format!("{step}: PeerSetupFailed naming rank 0")),
        (_, other) => Err(format!(
            "{step}: rank {rank} expected {} about {what}, got {other:?}",
            if rank == 0 {
                "PeerBufferTooSmall"
            } else {
                "PeerSetupFailed"
            }
        )),
    }
}

/// One registered (zero-copy) allreduce of `len` f32 at the start of a
/// fresh buffer of `len` f32, registered on `group`, checked bit-exact.
fn registered_round(
    ctx: &Arc<CudaContext>,
    group: &ProcessGroup,
    ex: &dyn Exchange,
    stream: &Arc<CudaStream>,
    len: usize,
    seed: u64,
) -> Result<(), String> {
    let es = |e: Error| e.to_string();
    let rank = group.rank();
    let reg = driver::DeviceAlloc::zeroed(ctx, len * 4).map_err(es)?;
    let out = driver::DeviceAlloc::zeroed(ctx, len * 4).map_err(es)?;
    // SAFETY: `reg` outlives the group's last use of it (the check below).
    unsafe { group.register_buffer(ex, reg.ptr(), len * 4) }.map_err(es)?;
    let inputs = values::adversarial_inputs(Dtype::F32, 2, len, seed, true);
    let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(Dtype::F32, &refs);
    reg.write(&inputs[rank]).map_err(es)?;
    out.write(&vec![poison::<f32>().to_bits(); len])
        .map_err(es)?;
    // Both inputs written before either rank reads them.
    ex.all_gather(b"written").map_err(es)?;
    // SAFETY: the input lies in `reg` (len f32), the output `out` holds
    // len f32; both live until the check below has waited for the stream.
    unsafe {
        group.allreduce_registered_raw(
            stream,
            Dtype::F32,
            len,
            reg.ptr(),
            out.ptr(),
            AlgoChoice::OneStage,
        )
    }
    .map_err(es)?;
    group.check(stream).map_err(es)?;
    let mut got = vec![0u32; len];
    out.read(&mut got).map_err(es)?;
    if let Some((i, a, b)) = reference::first_mismatch(Dtype::F32, &got, &want) {
        return Err(format!("registered: element {i}: got {a:#x} want {b:#x}"));
    }
    // Neither rank frees its buffer while the other may still read it.
    ex.all_gather(b"read").map_err(es)?;
    Ok(())
}

/// Allocation sizes (cuMemAlloc) whose mappings in the peer are compared
/// with what the driver reports for them.
const SIZES: [usize; 4] = [4096 + 16, 1 << 20, (3 << 20) + 123, 8 << 20];

/// What the checks rest on: each rank exports allocations of [`SIZES`],
/// maps the peer's, and reads the mappings' sizes as the checks do. A
/// mapping reported smaller than its allocation would refuse honest peers
/// (an error here); one reported larger (the driver's granularity) is
/// printed. Also times the size query the checks add per mapping.
fn mapping_sizes(ctx: &Arc<CudaContext>, ex: &DirExchange) -> Result<String, String> {
    let es = |e: Error| e.to_string();
    let mine: Vec<driver::DeviceAlloc> = SIZES
        .iter()
        .map(|&n| driver::DeviceAlloc::zeroed(ctx, n))
        .collect::<p2p_allreduce::Result<_>>()
        .map_err(es)?;
    let mut record = Vec::new();
    for a in &mine {
        record.extend_from_slice(&driver::ipc_export(ctx, a.ptr()).map_err(es)?);
    }
    let all = ex.all_gather(&record).map_err(es)?;
    let theirs = &all[1 - ex.rank()];
    let mut seen = Vec::new();
    let mut query = Duration::ZERO;
    for (k, &n) in SIZES.iter().enumerate() {
        let h: [u8; driver::IPC_HANDLE_BYTES] = theirs
            .get(k * driver::IPC_HANDLE_BYTES..(k + 1) * driver::IPC_HANDLE_BYTES)
            .and_then(|b| b.try_into().ok())
            .ok_or("the peer sent a short record")?;
        let m = driver::IpcMapping::open(ctx, &h).map_err(es)?;
        if (m.bytes() as usize) < n {
            return Err(format!(
                "a mapping of a {n}-byte allocation is reported as {} bytes: honest peers would be refused",
                m.bytes()
            ));
        }
        let t = Instant::now();
        for _ in 0..1000 {
            driver::address_range(ctx, m.ptr()).map_err(es)?;
        }
        query += t.elapsed();
        seen.push(format!("{n} -> {}", m.bytes()));
    }
    // Neither rank frees its allocations while the other has them mapped.
    ex.all_gather(b"unmapped").map_err(es)?;
    drop(mine);
    Ok(format!(
        "mapped sizes (allocated -> reported) {}; cuMemGetAddressRange {:.2} us per mapping",
        seen.join(", "),
        query.as_secs_f64() * 1e6 / (1000 * SIZES.len()) as f64
    ))
}

/// One rank of the two-process case (`P2P_IPC_MODE=shared_host`).
pub(super) fn child(rank: usize) -> Result<String, String> {
    let env = |k: &str| std::env::var(k).map_err(|e| format!("{k}: {e}"));
    let gpu: usize = env("P2P_IPC_GPU")?.parse().map_err(|e| format!("{e}"))?;
    let dir = std::path::PathBuf::from(env("P2P_IPC_DIR")?);
    let ctx = driver::open_device(gpu).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let es = |e: Error| e.to_string();
    let exchange = |step: &str| {
        DirExchange::new(&dir.join(step), rank, 2, Duration::from_secs(60)).map_err(es)
    };
    // Rank 1 forges `forgery`, rank 0 is honest.
    let form = |ex: &DirExchange, forgery: Forgery| {
        if rank == 1 {
            ProcessGroup::new_forged(&ctx, ex, cfg(), forgery)
        } else {
            ProcessGroup::new(&ctx, ex, cfg())
        }
    };
    let mut lines = vec![mapping_sizes(&ctx, &exchange("sizes")?)?];

    // 1. A staging allocation of 1 MiB behind a record that says 8 MiB:
    //    the group does not form, on either rank.
    let ex = exchange("staging")?;
    let got = form(
        &ex,
        Forgery {
            staging_bytes: Some(MAX_BYTES / 8),
            ..Forgery::default()
        },
    );
    lines.push(expect_refused(rank, "staging", "staging buffer", got)?);

    // 2. A registered buffer of 1 MiB whose record claims 64 MiB more:
    //    refused on both ranks; the group runs on, nothing registered.
    let ex = exchange("registered")?;
    let group = form(
        &ex,
        Forgery {
            record_bytes: 64 << 20,
            ..Forgery::default()
        },
    )
    .map_err(es)?;
    let reg = driver::DeviceAlloc::zeroed(&ctx, 1 << 20).map_err(es)?;
    // SAFETY: `reg` outlives the group.
    let got = unsafe { group.register_buffer(&ex, reg.ptr(), 1 << 20) };
    lines.push(expect_refused(
        rank,
        "registered",
        "registered buffer",
        got,
    )?);
    if group.is_registered(reg.ptr()) {
        return Err("registered: the refused buffer counts as registered".into());
    }
    ipc_allreduce(&group, &stream, 10_007, 71, Algorithm::OneStage).map_err(es)?;
    drop(group);

    // 3. A captured allreduce whose record puts its input 1 TiB past its
    //    allocation: register_captured refused on both ranks; the slot
    //    stays empty (a replay is `Unregistered`, nothing read through it).
    let ex = exchange("captured")?;
    let group = form(
        &ex,
        Forgery {
            record_offset: 1 << 40,
            ..Forgery::default()
        },
    )
    .map_err(es)?;
    let glen = 30_001usize;
    let gin = driver::DeviceAlloc::zeroed(&ctx, glen * 4).map_err(es)?;
    let gout = driver::DeviceAlloc::zeroed(&ctx, glen * 4).map_err(es)?;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| e.to_string())?;
    // SAFETY: `gin` and `gout` hold glen f32 and outlive the graph.
    let captured = unsafe {
        group.allreduce_in_graph(
            &stream,
            Dtype::F32,
            glen,
            gin.ptr(),
            gout.ptr(),
            AlgoChoice::OneStage,
        )
    };
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(|e| e.to_string())?
        .ok_or("empty graph")?;
    captured.map_err(es)?;
    let got = group.register_captured(&ex);
    lines.push(expect_refused(rank, "captured", "captured input", got)?);
    graph.launch().map_err(|e| e.to_string())?;
    match group.check(&stream) {
        Err(Error::Unregistered { .. }) => {}
        other => {
            return Err(format!(
                "captured: a replay after the refusal: expected Unregistered, got {other:?}"
            ))
        }
    }
    // Both past their check before either resets, both reset before
    // either runs again.
    ex.all_gather(b"checked").map_err(es)?;
    group.reset().map_err(es)?;
    ex.all_gather(b"reset").map_err(es)?;
    ipc_allreduce(&group, &stream, 10_007, 72, Algorithm::TwoStage).map_err(es)?;
    drop(graph);
    drop(group);

    // 4. The context survives: a later group of honest ranks runs every
    //    algorithm bit-exact, and registers and reads a buffer.
    let ex = exchange("later")?;
    let t = Instant::now();
    let group = ProcessGroup::new(&ctx, &ex, cfg()).map_err(es)?;
    let formed = t.elapsed();
    fault_rounds(&group, &stream)?;
    registered_round(&ctx, &group, &ex, &stream, 100_003, 73)?;
    lines.push(format!(
        "later group (formed in {:.1} ms): every algorithm and a registered buffer bit-exact",
        formed.as_secs_f64() * 1e3
    ));
    Ok(format!("rank {rank}: {}", lines.join("; ")))
}

/// Two processes on GPU 0 (`shared_host` mode), every forged case.
pub(super) fn processes(_g: &Gpu) {
    let dir = ipc_dir("shared-host");
    for text in run_ranks("shared_host", &[0, 0], &dir, Duration::from_secs(180)) {
        println!("  {text}");
    }
}
