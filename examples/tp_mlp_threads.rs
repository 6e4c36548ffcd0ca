//! A tensor-parallel MLP block over `p2p_allreduce::comm::Comm`, one thread
//! per rank in one process: pegainfer's shape (cudarc 0.19,
//! `Comm::from_devices`, `all_reduce_in_place` on each rank's thread, then
//! the add + RMSNorm, here fused into the allreduce).
//!
//! ```text
//! cargo run --release --example tp_mlp_threads -- [--world 2] [--gpu 0]
//! ```
//!
//! `--world N` ranks (default 2); `--gpu G` puts every rank on GPU G (each
//! on its own stream), else rank r runs on GPU r mod the GPU count. Every
//! rank's results are checked bit for bit against the CPU reference; a
//! difference exits 1. Without a CUDA driver or GPU it says why and exits 0.

#[path = "tp_mlp/mod.rs"]
mod tp_mlp;

use half::bf16;
use p2p_allreduce::comm::{Comm, ReduceOp};
use p2p_allreduce::driver;
use tp_mlp::{Block, Expected, EPS, HIDDEN, ROWS};

fn main() {
    if let Some(why) = tp_mlp::why_skip() {
        println!("tp_mlp_threads: SKIPPED ({why}); nothing was run");
        return;
    }
    let world = tp_mlp::arg_usize("--world", 2);
    let gpus = driver::device_count().expect("device count");
    let gpu_of = |r: usize| match tp_mlp::arg("--gpu") {
        Some(g) => g.parse::<usize>().expect("--gpu takes a device number"),
        None => r % gpus,
    };
    if let Err(e) = run(world, gpu_of) {
        eprintln!("tp_mlp_threads: FAILED: {e}");
        std::process::exit(1);
    }
}

fn run(world: usize, gpu_of: impl Fn(usize) -> usize) -> Result<(), String> {
    let block = Block::new();
    let partials: Vec<Vec<bf16>> = (0..world).map(|r| block.partial(r, world)).collect();
    let want = tp_mlp::expected(&block, &partials);

    // One stream per rank (ranks on one GPU share its context).
    let mut contexts = std::collections::HashMap::new();
    let mut streams = Vec::new();
    for r in 0..world {
        let g = gpu_of(r);
        let ctx = match contexts.get(&g) {
            Some(c) => std::sync::Arc::clone(c),
            None => {
                let c = driver::open_device(g).map_err(|e| e.to_string())?;
                contexts.insert(g, c.clone());
                c
            }
        };
        streams.push(ctx.new_stream().map_err(|e| e.to_string())?);
    }
    let devices: Vec<usize> = (0..world).map(&gpu_of).collect();
    let comms = Comm::from_devices(streams).map_err(|e| e.to_string())?;

    // One thread per rank, as the engine runs its workers.
    let outcomes: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(&partials)
            .map(|(comm, partial)| {
                let (block, want) = (&block, &want);
                s.spawn(move || rank(&comm, block, partial, want))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank's thread panicked".into()))
            })
            .collect()
    });
    for o in &outcomes {
        o.clone()?;
    }
    println!(
        "tp_mlp_threads: {world} ranks on GPUs {devices:?}: all_reduce_in_place and \
         all_reduce_add_rms_norm of {ROWS} x {HIDDEN} bf16 match the CPU reference bit for bit on every rank"
    );
    Ok(())
}

/// One rank's thread: its partial of the down projection, then the
/// allreduce (alone, then fused with the residual add and RMSNorm).
fn rank(comm: &Comm, block: &Block, partial: &[bf16], want: &Expected) -> Result<(), String> {
    let r = comm.rank();
    let s = comm.stream();
    let e = |e: p2p_allreduce::Error| format!("rank {r}: {e}");
    let d = |e: p2p_allreduce::cudarc::driver::DriverError| format!("rank {r}: {e}");

    // 1. pegainfer's call as it is: allreduce in place, the engine's own
    //    norm after it.
    let mut y = s.clone_htod(partial).map_err(d)?;
    comm.all_reduce_in_place(&mut y, &ReduceOp::Sum)
        .map_err(e)?;
    comm.check().map_err(e)?;
    tp_mlp::check(
        r,
        "all_reduce_in_place",
        &s.clone_dtoh(&y).map_err(d)?,
        &want.sum,
    )?;

    // 2. The fused call: allreduce + residual add + RMSNorm in one kernel.
    let y = s.clone_htod(partial).map_err(d)?;
    let mut residual = s.clone_htod(&block.residual).map_err(d)?;
    let gamma = s.clone_htod(&block.gamma).map_err(d)?;
    let mut normed = s.alloc_zeros::<bf16>(ROWS * HIDDEN).map_err(d)?;
    comm.all_reduce_add_rms_norm(&y, &mut residual, &gamma, EPS, &mut normed)
        .map_err(e)?;
    comm.check().map_err(e)?;
    tp_mlp::check(
        r,
        "residual (sum + residual)",
        &s.clone_dtoh(&residual).map_err(d)?,
        &want.residual_out,
    )?;
    tp_mlp::check(
        r,
        "RMSNorm output",
        &s.clone_dtoh(&normed).map_err(d)?,
        &want.normed,
    )?;
    Ok(())
}
