//! A tensor-parallel MLP block over `p2p_allreduce::comm::Comm`, one
//! process per rank with the id shared through a file: mistral.rs's shape
//! (rank 0 makes the id and writes its bytes to a file, the other ranks
//! read them, `Comm::from_rank` in each process, the allreduce as a
//! `SumAllReduce` would make it).
//!
//! ```text
//! cargo run --release --example tp_mlp_processes -- [--world 2] [--gpu 0]
//! ```
//!
//! Run like this it is the launcher: it starts `--world N` ranks (default
//! 2) as processes of itself, `--rank r --world N --id-file F [--gpu G]`
//! each, and fails if any rank fails. `--gpu G` puts every rank on GPU G,
//! else rank r runs on GPU r mod the GPU count. Every rank checks its
//! results bit for bit against the CPU reference. Without a CUDA driver or
//! GPU it says why and exits 0.

#[path = "tp_mlp/mod.rs"]
mod tp_mlp;

use half::bf16;
use p2p_allreduce::comm::{Comm, Id, ReduceOp};
use p2p_allreduce::cudarc::driver::sys;
use p2p_allreduce::driver;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tp_mlp::{Block, EPS, HIDDEN, ROWS};

fn main() {
    if let Some(why) = tp_mlp::why_skip() {
        println!("tp_mlp_processes: SKIPPED ({why}); nothing was run");
        return;
    }
    let world = tp_mlp::arg_usize("--world", 2);
    let result = match tp_mlp::arg("--rank") {
        None => launch(world),
        Some(r) => {
            let rank: usize = r.parse().expect("--rank takes a number");
            let file = PathBuf::from(tp_mlp::arg("--id-file").expect("a rank needs --id-file"));
            run_rank(rank, world, &file)
        }
    };
    if let Err(e) = result {
        eprintln!("tp_mlp_processes: FAILED: {e}");
        std::process::exit(1);
    }
}

/// Starts the ranks and waits for them.
fn launch(world: usize) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let file = std::env::temp_dir().join(format!("p2p-allreduce-tp-mlp-{}.id", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let children: Vec<_> = (0..world)
        .map(|r| {
            let mut c = std::process::Command::new(&exe);
            c.args(["--rank", &r.to_string(), "--world", &world.to_string()]);
            c.arg("--id-file").arg(&file);
            if let Some(g) = tp_mlp::arg("--gpu") {
                c.args(["--gpu", &g]);
            }
            c.spawn().map_err(|e| format!("starting rank {r}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let mut failed = Vec::new();
    for (r, mut c) in children.into_iter().enumerate() {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {r} exited with {s}")),
            Err(e) => failed.push(format!("rank {r}: {e}")),
        }
    }
    // The rendezvous directory rank 0's id named, then the id file.
    if let Ok(b) = std::fs::read(&file) {
        if let Ok(bytes) = <[u8; 128]>::try_from(b) {
            if let Ok(dir) = Id::from_bytes(bytes).dir() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
    let _ = std::fs::remove_file(&file);
    if !failed.is_empty() {
        return Err(failed.join("; "));
    }
    println!("tp_mlp_processes: all {world} ranks matched the CPU reference bit for bit");
    Ok(())
}

/// Rank 0 makes the id and writes it (atomically); the others wait for
/// the file, as mistral.rs does with its NCCL id.
fn share_id(rank: usize, file: &Path) -> Result<Id, String> {
    if rank == 0 {
        let id = Id::new().map_err(|e| e.to_string())?;
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, id.to_bytes()).map_err(|e| e.to_string())?;
        std::fs::rename(&tmp, file).map_err(|e| e.to_string())?;
        return Ok(id);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(b) = std::fs::read(file) {
            let bytes: [u8; 128] = b.try_into().map_err(|b: Vec<u8>| {
                format!("{} holds {} bytes, not 128", file.display(), b.len())
            })?;
            return Ok(Id::from_bytes(bytes));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "rank 0 wrote no id to {} within 60 s",
                file.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_rank(rank: usize, world: usize, file: &Path) -> Result<(), String> {
    let gpus = driver::device_count().map_err(|e| e.to_string())?;
    let gpu = match tp_mlp::arg("--gpu") {
        Some(g) => g
            .parse()
            .map_err(|_| format!("--gpu {g:?} is not a number"))?,
        None => rank % gpus,
    };
    let e = |e: p2p_allreduce::Error| format!("rank {rank}: {e}");
    let d = |e: p2p_allreduce::cudarc::driver::DriverError| format!("rank {rank}: {e}");
    let ctx = driver::open_device(gpu).map_err(e)?;
    // Step 3 captures a CUDA graph: with cudarc's event tracking on, using
    // a slice inside a capture waits for an event recorded before it,
    // which CUDA refuses (the library says so: Error::CaptureInvalidated).
    // SAFETY: this process uses one stream for all its work, so nothing
    // needs cudarc's cross-stream events.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(d)?;
    let id = share_id(rank, file)?;
    let comm = Comm::from_rank(stream.clone(), rank, world, id).map_err(e)?;

    // This rank's share of the block: its columns of W_up, its rows of
    // W_down, a partial of the output.
    let block = Block::new();
    let partials: Vec<Vec<bf16>> = (0..world).map(|r| block.partial(r, world)).collect();
    let want = tp_mlp::expected(&block, &partials);
    let s = &stream;

    // 1. SumAllReduce's call: all_reduce into a fresh buffer.
    let y = s.clone_htod(&partials[rank]).map_err(d)?;
    let mut sum = s.alloc_zeros::<bf16>(ROWS * HIDDEN).map_err(d)?;
    comm.all_reduce(&y, &mut sum, &ReduceOp::Sum).map_err(e)?;
    comm.check().map_err(e)?;
    tp_mlp::check(
        rank,
        "all_reduce",
        &s.clone_dtoh(&sum).map_err(d)?,
        &want.sum,
    )?;

    // 2. The fused call: allreduce + residual add + RMSNorm in one kernel.
    let mut residual = s.clone_htod(&block.residual).map_err(d)?;
    let gamma = s.clone_htod(&block.gamma).map_err(d)?;
    let mut normed = s.alloc_zeros::<bf16>(ROWS * HIDDEN).map_err(d)?;
    comm.all_reduce_add_rms_norm(&y, &mut residual, &gamma, EPS, &mut normed)
        .map_err(e)?;
    comm.check().map_err(e)?;
    tp_mlp::check(
        rank,
        "residual (sum + residual)",
        &s.clone_dtoh(&residual).map_err(d)?,
        &want.residual_out,
    )?;
    tp_mlp::check(
        rank,
        "RMSNorm output",
        &s.clone_dtoh(&normed).map_err(d)?,
        &want.normed,
    )?;

    // 3. The fused call captured in a CUDA graph (the engines capture their
    //    decode steps) and replayed: calls are staged, so each replay reads
    //    what the captured buffers hold when it runs.
    let mut res_g = s.clone_htod(&block.residual).map_err(d)?;
    let mut normed_g = s.alloc_zeros::<bf16>(ROWS * HIDDEN).map_err(d)?;
    s.synchronize().map_err(d)?;
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(d)?;
    let captured = comm.all_reduce_add_rms_norm(&y, &mut res_g, &gamma, EPS, &mut normed_g);
    let graph = s
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(d)?
        .ok_or_else(|| format!("rank {rank}: the capture made no graph"))?;
    captured.map_err(e)?;
    for replay in 0..3 {
        // The residual is updated in place: each replay starts from it.
        s.memcpy_htod(&block.residual, &mut res_g).map_err(d)?;
        s.memset_zeros(&mut normed_g).map_err(d)?;
        graph.launch().map_err(d)?;
        comm.check().map_err(e)?;
        let what = format!("graph replay {replay}");
        tp_mlp::check(
            rank,
            &what,
            &s.clone_dtoh(&res_g).map_err(d)?,
            &want.residual_out,
        )?;
        tp_mlp::check(
            rank,
            &what,
            &s.clone_dtoh(&normed_g).map_err(d)?,
            &want.normed,
        )?;
    }
    println!("tp_mlp_processes: rank {rank} of {world} on GPU {gpu}: all_reduce, all_reduce_add_rms_norm and its CUDA graph (3 replays) of {ROWS} x {HIDDEN} bf16 match the CPU reference bit for bit");
    Ok(())
}
