//! `bench --fused`: the fused allreduce + residual add + RMSNorm against
//! the same work unfused (our allreduce, then our add + RMSNorm kernel on
//! each rank: the fused entry for one rank, whose "allreduce" is a copy)
//! and against the plain allreduce of the same bytes; rows x hidden bf16,
//! CUDA-graph medians. Real ranks with `--gpus`, else virtual ranks.

use super::table::describe;
use super::BenchArgs;
use crate::open_gpu;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use p2p_allreduce::error::Context as _;
use p2p_allreduce::measure::{self, Sample, Timing};
use p2p_allreduce::{AlgoChoice, Algorithm, Config, PeerGroup, Result, VirtualGroup};
use std::process::ExitCode;
use std::sync::Arc;

const EPS: f32 = 1e-6;

/// Rows of the sweep: decode batches and prefill chunks.
const ROWS: [usize; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

#[derive(serde::Serialize)]
struct FusedRow {
    rows: usize,
    hidden: usize,
    bytes: usize,
    world: usize,
    what: String,
    time_us: f64,
}

type Buf = CudaSlice<half::bf16>;

/// Every rank's buffers, one vector per role (disjoint borrows).
#[derive(Default)]
struct Bufs {
    x: Vec<Buf>,
    residual: Vec<Buf>,
    gamma: Vec<Buf>,
    normed: Vec<Buf>,
    tmp: Vec<Buf>,
}

impl Bufs {
    fn push(&mut self, s: &Arc<CudaStream>, count: usize, hidden: usize, seed: u32) -> Result<()> {
        let v = |n: usize, k: u32| -> Vec<half::bf16> {
            (0..n)
                .map(|i| {
                    let h = (i as u32).wrapping_mul(2654435761) ^ (seed * 3 + k);
                    half::bf16::from_f32((h % 1000) as f32 / 500.0 - 1.0)
                })
                .collect()
        };
        self.x.push(s.clone_htod(&v(count, 1)).during("upload")?);
        self.residual
            .push(s.clone_htod(&v(count, 2)).during("upload")?);
        self.gamma
            .push(s.clone_htod(&v(hidden, 3)).during("upload")?);
        self.normed.push(s.alloc_zeros(count).during("alloc")?);
        self.tmp.push(s.alloc_zeros(count).during("alloc")?);
        Ok(())
    }
}

pub(super) fn run_fused(args: &BenchArgs, hidden: usize) -> ExitCode {
    let real = args.gpus.len() >= 2;
    let mut ctxs: Vec<Arc<CudaContext>> = Vec::new();
    let devices: Vec<usize> = if real {
        args.gpus.clone()
    } else {
        vec![args.device]
    };
    for &d in &devices {
        if let Some(c) = ctxs.iter().find(|c| c.ordinal() == d) {
            ctxs.push(c.clone());
            continue;
        }
        let c = match open_gpu("bench", d) {
            Ok(c) => c,
            Err(code) => return code,
        };
        // SAFETY: each buffer is used on its rank's one stream only, and
        // graph capture must not record cudarc's events.
        unsafe { c.disable_event_tracking() };
        ctxs.push(c);
    }
    let worlds = if real {
        vec![ctxs.len()]
    } else {
        args.world.clone()
    };
    println!(
        "# p2p-allreduce bench --fused: {}; {}; bf16 rows x {hidden}; {}; time = median of {} replays of a CUDA graph of {} calls",
        ctxs.iter().map(describe).collect::<Vec<_>>().join("; "),
        if real {
            format!("real ranks (PeerGroup) on GPUs {:?}", args.gpus)
        } else {
            "virtual ranks on one GPU (unfused: the per-rank add + RMSNorm kernels run one after another on the one stream)".to_string()
        },
        match args.max_blocks {
            Some(b) => format!("at most {b} blocks per rank (--max-blocks)"),
            None => "blocks per rank capped by the link".to_string(),
        },
        args.iters,
        args.per_graph
    );
    println!(
        "# unfused = our allreduce (Auto) + our add + RMSNorm kernel per rank; allreduce = the plain allreduce (Auto) of the same bytes, allreduce push_ll the same with push_ll; zc = zero-copy (registered input, no staging copy), Auto"
    );
    println!(
        "{:>6} {:>10} {:>6} {:>18} {:>10}",
        "rows", "bytes", "world", "what", "time(us)"
    );
    let mut rows_out = Vec::new();
    for world in worlds {
        match measure_world(args, &ctxs, real, world, hidden) {
            Ok(mut r) => rows_out.append(&mut r),
            Err(e) => {
                eprintln!("bench --fused: world {world}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&rows_out).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("bench --fused: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("# rows written to {}", path.display());
    }
    ExitCode::SUCCESS
}

fn measure_world(
    args: &BenchArgs,
    ctxs: &[Arc<CudaContext>],
    real: bool,
    world: usize,
    hidden: usize,
) -> Result<Vec<FusedRow>> {
    let max_rows = ROWS[ROWS.len() - 1];
    // push_ll's zone holds up to 64 rows, so `fused push_ll` runs in one
    // launch through the decode range (rows 1..64); Auto's choice for the
    // allreduce rows is by size, as with the default zone.
    let cfg = Config {
        push_ll_max_bytes: (64 * hidden * 4).next_multiple_of(4096),
        threads_per_block: args.threads,
        max_blocks: args.max_blocks,
        ..Config::with_max_bytes((2 * max_rows * hidden * 2).next_multiple_of(1 << 20))
    };
    let timing = Timing {
        per_graph: args.per_graph,
        warmup: args.warmup_iters,
        replays: args.iters,
    };
    let streams: Vec<Arc<CudaStream>> = if real {
        ctxs.iter()
            .map(|c| c.new_stream().during("cuStreamCreate"))
            .collect::<Result<_>>()?
    } else {
        vec![ctxs[0].new_stream().during("cuStreamCreate")?]
    };
    // Every rank's buffers, on its rank's stream.
    let rank_stream = |r: usize| if real { &streams[r] } else { &streams[0] };
    let mut b = Bufs::default();
    for r in 0..world {
        b.push(rank_stream(r), max_rows * hidden, hidden, r as u32)?;
    }
    // The per-rank add + RMSNorm: the fused entry for one rank.
    let norm1: Vec<VirtualGroup> = (0..world)
        .map(|r| VirtualGroup::new(rank_stream(r).context(), 1, cfg.clone()))
        .collect::<Result<_>>()?;
    let peer = if real {
        Some(PeerGroup::new(ctxs, cfg.clone())?)
    } else {
        None
    };
    let virt = if real {
        None
    } else {
        Some(VirtualGroup::new(&ctxs[0], world, cfg.clone())?)
    };
    // Zero-copy inputs: every rank's x in a registered buffer of the group.
    let reg = match (&peer, &virt) {
        (Some(p), _) => p.alloc_registered::<half::bf16>(max_rows * hidden)?,
        (_, Some(v)) => v.alloc_registered::<half::bf16>(max_rows * hidden)?,
        _ => unreachable!("one group kind is set"),
    };
    for (r, x) in b.x.iter().enumerate() {
        reg.copy_from(r, rank_stream(r), x)?;
    }
    // A group per `--fused-ctas` size, for its `fused push_ll ctasK` row.
    let mut split: Vec<(String, Option<PeerGroup>, Option<VirtualGroup>)> = Vec::new();
    for &k in &args.fused_ctas {
        let c = Config {
            fused_ctas: Some(k),
            ..cfg.clone()
        };
        let name = format!("fused push_ll ctas{k}");
        split.push(if real {
            (name, Some(PeerGroup::new(ctxs, c)?), None)
        } else {
            (name, None, Some(VirtualGroup::new(&ctxs[0], world, c)?))
        });
    }
    let check = || -> Result<()> {
        for (_, p, v) in std::iter::once(("", &peer, &virt))
            .chain(split.iter().map(|(n, p, v)| (n.as_str(), p, v)))
        {
            match (p, v) {
                (Some(p), _) => p.check(&streams)?,
                (_, Some(v)) => v.check(&streams[0])?,
                _ => {}
            }
        }
        Ok(())
    };
    let mut whats: Vec<String> = ["fused one_stage", "fused two_stage", "fused push_ll"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    whats.extend(split.iter().map(|(n, _, _)| n.clone()));
    whats.extend(
        [
            "fused auto",
            "unfused",
            "allreduce",
            "allreduce push_ll",
            "fused zc",
            "allreduce zc",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let mut out = Vec::new();
    for rows in ROWS {
        let count = rows * hidden;
        for what in whats.iter().map(String::as_str) {
            let mut enqueue = || -> Result<()> {
                let Bufs {
                    x,
                    residual,
                    gamma,
                    normed,
                    tmp,
                } = &mut b;
                let xs: Vec<_> = x.iter().map(|v| v.slice(0..count)).collect();
                let xr: Vec<&_> = xs.iter().collect();
                let gs: Vec<_> = gamma.iter().map(|v| v.slice(0..hidden)).collect();
                let gr: Vec<&_> = gs.iter().collect();
                let algo = match what {
                    "fused one_stage" => AlgoChoice::OneStage,
                    "fused two_stage" => AlgoChoice::TwoStage,
                    w if w.starts_with("fused push_ll") => AlgoChoice::PushLl,
                    _ => AlgoChoice::Auto,
                };
                // The group of the row: a `--fused-ctas` one, or the main.
                let (peer, virt) = split
                    .iter()
                    .find(|(n, _, _)| n == what)
                    .map(|(_, p, v)| (p, v))
                    .unwrap_or((&peer, &virt));
                if what == "fused zc" {
                    let mut rs: Vec<_> =
                        residual.iter_mut().map(|v| v.slice_mut(0..count)).collect();
                    let mut os: Vec<_> = normed.iter_mut().map(|v| v.slice_mut(0..count)).collect();
                    match (&peer, &virt) {
                        (Some(p), _) => p.allreduce_add_rmsnorm_registered(
                            &streams, &reg, count, &mut rs, &gr, EPS, &mut os, algo,
                        )?,
                        (_, Some(v)) => v.allreduce_add_rmsnorm_registered(
                            &streams[0],
                            &reg,
                            count,
                            &mut rs,
                            &gr,
                            EPS,
                            &mut os,
                            algo,
                        )?,
                        _ => unreachable!("one group kind is set"),
                    };
                    return Ok(());
                }
                if what == "allreduce zc" {
                    let mut ts: Vec<_> = tmp.iter_mut().map(|v| v.slice_mut(0..count)).collect();
                    match (&peer, &virt) {
                        (Some(p), _) => {
                            p.allreduce_registered(&streams, &reg, count, &mut ts, algo)?
                        }
                        (_, Some(v)) => {
                            v.allreduce_registered(&streams[0], &reg, count, &mut ts, algo)?
                        }
                        _ => unreachable!("one group kind is set"),
                    };
                    return Ok(());
                }
                if what.starts_with("fused") {
                    let mut rs: Vec<_> =
                        residual.iter_mut().map(|v| v.slice_mut(0..count)).collect();
                    let mut os: Vec<_> = normed.iter_mut().map(|v| v.slice_mut(0..count)).collect();
                    let _: Algorithm = match (&peer, &virt) {
                        (Some(p), _) => p.allreduce_add_rmsnorm(
                            &streams, &xr, &mut rs, &gr, EPS, &mut os, algo,
                        )?,
                        (_, Some(v)) => v.allreduce_add_rmsnorm(
                            &streams[0],
                            &xr,
                            &mut rs,
                            &gr,
                            EPS,
                            &mut os,
                            algo,
                        )?,
                        _ => unreachable!("one group kind is set"),
                    };
                    return Ok(());
                }
                let mut ts: Vec<_> = tmp.iter_mut().map(|v| v.slice_mut(0..count)).collect();
                // The plain allreduce: Auto's choice, or push_ll (the fused
                // push_ll's own algorithm, staged the same way).
                let plain = if what == "allreduce push_ll" {
                    AlgoChoice::PushLl
                } else {
                    AlgoChoice::Auto
                };
                match (&peer, &virt) {
                    (Some(p), _) => p.allreduce(&streams, &xr, &mut ts, plain)?,
                    (_, Some(v)) => v.allreduce(&streams[0], &xr, &mut ts, plain)?,
                    _ => unreachable!("one group kind is set"),
                };
                drop(ts);
                if what == "unfused" {
                    for r in 0..world {
                        let t = tmp[r].slice(0..count);
                        let g = &gs[r];
                        norm1[r].allreduce_add_rmsnorm(
                            rank_stream(r),
                            &[&t],
                            &mut [residual[r].slice_mut(0..count)],
                            &[g],
                            EPS,
                            &mut [normed[r].slice_mut(0..count)],
                            AlgoChoice::OneStage,
                        )?;
                    }
                }
                Ok(())
            };
            let times = measure::time_graphs(&streams, timing, &mut enqueue, || Ok(()), check)?;
            let s = Sample::from_times(Algorithm::OneStage, times);
            println!(
                "{:>6} {:>10} {:>6} {:>18} {:>10.2}",
                rows,
                count * 2,
                world,
                what,
                s.median_us
            );
            out.push(FusedRow {
                rows,
                hidden,
                bytes: count * 2,
                world,
                what: what.to_string(),
                time_us: s.median_us,
            });
        }
    }
    for (r, n) in norm1.iter().enumerate() {
        n.check(rank_stream(r))?;
    }
    Ok(out)
}
