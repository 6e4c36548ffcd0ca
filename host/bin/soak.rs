//! `p2p-allreduce soak`: many graph replays of every algorithm at sizes
//! 4 KiB..8 MiB and of the fused allreduce + residual add + RMSNorm, on
//! virtual ranks or on real ranks (`--procs`, e.g. two processes on GPU 0
//! with `--gpus 0,0`), with:
//! - results checked against the CPU oracle on a sample of replays (every
//!   call of a checked replay: outputs poisoned first, fresh adversarial
//!   f32 data spread over many binades each time);
//! - host RSS (`/proc/self/status` VmRSS, after `malloc_trim`) and device memory in use
//!   (`cuMemGetInfo`) after the first and the last pass, required flat;
//! - the driver layer's handle counts (device allocations, IPC mappings,
//!   pinned host memory, events) required unchanged from the first pass
//!   to the last and back to where they were once the group is dropped;
//! - the per-call time of every configuration in the first pass against
//!   the last pass (the median of three parts of each pass's batch),
//!   required within a tolerance (2 %).
//!
//! The run is planned from a calibration (one checked and two timed
//! replays of every graph): every configuration gets an equal share of the
//! target calls unless the time budget cannot hold them, when the costly
//! ones get an equal share of the time instead; the summary says whether
//! the targets were reached. Every timed batch holds at least 20 ms of
//! replays, so a pass's times are not launch noise.
//!
//! This file holds the command (arguments, the modes, the configurations);
//! `passes` the run, `plan` its plan, `report` the verdict and summary,
//! `data` the inputs and the oracle, `virtual_rig` and `proc_rig` the two
//! ways of running the ranks, `tests` the unit tests.

mod data;
mod passes;
mod plan;
mod proc_rig;
mod report;
#[cfg(test)]
mod tests;
mod virtual_rig;

use crate::procs::{self, RankEnv};
use crate::{fmt_bytes, open_gpu, parse_size, NOTHING_RAN};
use cudarc::driver::{sys, CudaContext, CudaGraph, CudaSlice, CudaStream};
use p2p_allreduce::abi::{Algorithm, Dtype};
use p2p_allreduce::driver::{self, DeviceAlloc, Handles};
use p2p_allreduce::error::Context as _;
use p2p_allreduce::reference::{self, values};
use p2p_allreduce::validate;
use p2p_allreduce::{
    AlgoChoice, Config, DirExchange, Exchange, ProcessGroup, RegisteredBuffers, Result,
    VirtualGroup,
};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use data::*;
use passes::*;
use plan::*;
use proc_rig::*;
use report::*;
use virtual_rig::*;

#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct SoakArgs {
    /// GPUs. Without --procs: virtual ranks on the first (default GPU 0).
    /// With --procs: one rank process per entry (`0,0`: two processes on
    /// GPU 0).
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<usize>,
    /// One process per entry of --gpus: a ProcessGroup over CUDA IPC.
    #[arg(long)]
    pub procs: bool,
    /// Virtual ranks (without --procs).
    #[arg(long, default_value_t = 2, value_parser = crate::parse_world_arg)]
    pub world: usize,
    /// Allreduces to run, spread over every algorithm and size.
    #[arg(long, default_value_t = 1_000_000)]
    pub allreduces: u64,
    /// Fused allreduce + residual add + RMSNorm calls to run.
    #[arg(long, default_value_t = 100_000)]
    pub fused: u64,
    /// Smallest message (bytes: 4K, 64K, ...); sizes go up by 4x.
    #[arg(short = 'b', long, default_value = "4K", value_parser = parse_size)]
    pub minbytes: usize,
    /// Largest message (always included).
    #[arg(short = 'e', long, default_value = "8M", value_parser = parse_size)]
    pub maxbytes: usize,
    /// Rows of the fused calls (f32 rows of 4096).
    #[arg(long, value_delimiter = ',', default_value = "1,16,128")]
    pub fused_rows: Vec<usize>,
    /// Seconds the timed passes may take. Where the targets do not fit,
    /// the costly configurations get fewer calls and the run fails its
    /// target (raise it, or lower --allreduces / --fused).
    #[arg(long, default_value_t = 200.0)]
    pub budget: f64,
    /// Passes over every configuration; the first and the last are
    /// compared (10: the first and the last tenth).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(2..))]
    pub passes: u64,
    /// Checked replays per configuration, spread over the passes (the
    /// first and the last pass among them).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(2..))]
    pub checks: u64,
    /// Largest change of a configuration's per-call time from the first
    /// pass to the last, in percent.
    #[arg(long, default_value_t = 2.0)]
    pub drift_pct: f64,
    /// Largest growth of host RSS from the first pass to the last, MiB.
    #[arg(long, default_value_t = 8)]
    pub rss_mib: u64,
    /// Largest growth of device memory in use from the first pass to the
    /// last, MiB (the driver allocates in 2 MiB pages).
    #[arg(long, default_value_t = 4)]
    pub device_mib: u64,
    /// Also write the summary as JSON to this file (`-`: standard output).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

impl Default for SoakArgs {
    fn default() -> Self {
        SoakArgs {
            gpus: Vec::new(),
            procs: false,
            world: 2,
            allreduces: 1_000_000,
            fused: 100_000,
            minbytes: 4 << 10,
            maxbytes: 8 << 20,
            fused_rows: vec![1, 16, 128],
            budget: 200.0,
            passes: 10,
            checks: 3,
            drift_pct: 2.0,
            rss_mib: 8,
            device_mib: 4,
            json: None,
        }
    }
}

/// Elements of one fused row.
const HIDDEN: usize = 4096;
const EPS: f32 = 1e-6;
/// Least GPU time of one timed batch.
const MIN_BATCH_MS: f64 = 20.0;
/// Timed replays of every graph in the calibration (after one checked).
const CAL_REPLAYS: u64 = 2;

/// How long `--procs` ranks may run before they are killed.
fn procs_deadline(args: &SoakArgs) -> Duration {
    Duration::from_secs_f64(args.budget * 3.0 + 900.0)
}

pub fn run(args: &SoakArgs) -> ExitCode {
    if let Err(e) = check_args(args) {
        eprintln!("soak: {e}");
        return ExitCode::from(NOTHING_RAN);
    }
    if args.procs {
        return match RankEnv::get() {
            Some(env) => run_rank(args, &env),
            None => {
                let gpus = procs::gpus_or_all(&args.gpus);
                if gpus.len() < 2 {
                    eprintln!(
                        "soak: --procs needs two or more ranks: list them, e.g. --gpus 0,0 (two processes on GPU 0)"
                    );
                    return ExitCode::from(NOTHING_RAN);
                }
                procs::run_ranks("soak", &gpus, procs_deadline(args))
            }
        };
    }
    let ordinal = args.gpus.first().copied().unwrap_or(0);
    let ctx = match open_gpu("soak", ordinal) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let describe = format!(
        "virtual ranks (VirtualGroup), world {}, GPU {ordinal} ({})",
        args.world,
        device_name(&ctx)
    );
    let r = soak(args, &describe, Mode::Virtual(ctx));
    finish(args, r, true)
}

fn check_args(args: &SoakArgs) -> std::result::Result<(), String> {
    if args.minbytes < 16 || args.minbytes > args.maxbytes || args.maxbytes % 16 != 0 {
        return Err(format!(
            "sizes {}..{}: use 16 bytes or more, the smallest first, the largest a multiple of 16",
            args.minbytes, args.maxbytes
        ));
    }
    if args.fused_rows.is_empty() || args.fused_rows.contains(&0) {
        return Err("--fused-rows: give one or more row counts of 1 or more".into());
    }
    if !(args.budget > 0.0 && args.budget.is_finite()) {
        return Err(format!("--budget {}: give seconds > 0", args.budget));
    }
    if args.checks > args.passes {
        return Err(format!(
            "--checks {} is more than --passes {}",
            args.checks, args.passes
        ));
    }
    Ok(())
}

fn device_name(ctx: &Arc<CudaContext>) -> String {
    driver::device_info(ctx).map_or_else(|_| "unknown GPU".into(), |i| i.name)
}

/// One rank process of `soak --procs`.
fn run_rank(args: &SoakArgs, env: &RankEnv) -> ExitCode {
    let ctx = match open_gpu("soak", env.gpu) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let ex = match env.exchange() {
        Ok(e) => e,
        Err(e) => {
            println!("soak: rank {}: cannot join the rendezvous: {e}", env.rank);
            return ExitCode::FAILURE;
        }
    };
    let describe = format!(
        "real ranks, one process per GPU entry (ProcessGroup over CUDA IPC), {} processes on GPUs {:?} ({})",
        env.world,
        procs::gpus_or_all(&args.gpus),
        device_name(&ctx)
    );
    let r = soak(args, &describe, Mode::Procs(ctx, &ex));
    finish(args, r, env.rank == 0)
}

enum Mode<'a> {
    Virtual(Arc<CudaContext>),
    Procs(Arc<CudaContext>, &'a DirExchange),
}

/// What one configuration runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Allreduce { algo: Algorithm, count: usize },
    Fused { algo: Algorithm, rows: usize },
}

#[derive(Clone, Debug)]
struct Cfg {
    kind: Kind,
    /// Calls captured in the configuration's graph.
    per_graph: usize,
}

impl Cfg {
    fn name(&self) -> String {
        match self.kind {
            Kind::Allreduce { algo, count } => {
                format!("allreduce {} {}", algo.name(), fmt_bytes(count as u64 * 4))
            }
            Kind::Fused { algo, rows } => format!("fused {} {rows}x{HIDDEN}", algo.name()),
        }
    }
    fn count(&self) -> usize {
        match self.kind {
            Kind::Allreduce { count, .. } => count,
            Kind::Fused { rows, .. } => rows * HIDDEN,
        }
    }
    fn fused(&self) -> bool {
        matches!(self.kind, Kind::Fused { .. })
    }
}

/// The configurations of a run: every algorithm at every size, and the
/// three fused algorithms at every row count.
fn configs(args: &SoakArgs) -> Vec<Cfg> {
    let mut sizes = Vec::new();
    let mut b = args.minbytes;
    while b < args.maxbytes {
        sizes.push(b);
        b = b.saturating_mul(4);
    }
    sizes.push(args.maxbytes);
    let mut v = Vec::new();
    for &bytes in &sizes {
        for algo in Algorithm::ALL {
            v.push(Cfg {
                kind: Kind::Allreduce {
                    algo,
                    count: bytes / 4,
                },
                per_graph: if bytes <= 64 << 10 {
                    100
                } else if bytes <= 1 << 20 {
                    20
                } else {
                    5
                },
            });
        }
    }
    for &rows in &args.fused_rows {
        for algo in [Algorithm::OneStage, Algorithm::TwoStage, Algorithm::PushLl] {
            v.push(Cfg {
                kind: Kind::Fused { algo, rows },
                per_graph: if rows <= 4 {
                    50
                } else if rows <= 32 {
                    20
                } else {
                    5
                },
            });
        }
    }
    v
}

/// The group's settings: every zero-copy call fits (scratch and every
/// landing zone hold the largest message and the largest fused rows).
fn soak_config(args: &SoakArgs) -> Config {
    let fused_max = args.fused_rows.iter().max().copied().unwrap_or(1) * HIDDEN * 4;
    let cap = args.maxbytes.max(fused_max).next_multiple_of(16);
    Config {
        max_bytes: cap,
        push_max_bytes: cap,
        push_ll_max_bytes: cap,
        push_two_stage_max_bytes: cap,
        ..Config::default()
    }
}
