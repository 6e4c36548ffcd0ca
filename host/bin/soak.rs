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

/// Host RSS in bytes (`/proc/self/status`), 0 where unreadable, after
/// the allocator has returned its free memory to the system (glibc's
/// `malloc_trim`), so that what is compared is memory in use, not the heap
/// the checks' large temporary vectors left behind.
fn rss_bytes() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap pages; no pointer is
    // handed over and no other state is touched.
    unsafe {
        libc::malloc_trim(0);
    }
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Memory and handles at one moment.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
struct Snapshot {
    rss: u64,
    device_used: u64,
    device_allocs: i64,
    ipc_mappings: i64,
    host_pinned: i64,
    events: i64,
}

fn snapshot(ctx: &Arc<CudaContext>) -> Result<Snapshot> {
    let (free, total) = driver::mem_info(ctx)?;
    let h: Handles = driver::live_handles();
    Ok(Snapshot {
        rss: rss_bytes(),
        device_used: (total - free) as u64,
        device_allocs: h.device_allocs,
        ipc_mappings: h.ipc_mappings,
        host_pinned: h.host_pinned,
        events: h.events,
    })
}

impl Snapshot {
    fn handles(&self) -> (i64, i64, i64, i64) {
        (
            self.device_allocs,
            self.ipc_mappings,
            self.host_pinned,
            self.events,
        )
    }
}

/// What a configuration did.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct CfgResult {
    name: String,
    op: String,
    algorithm: String,
    bytes: usize,
    per_graph: usize,
    replays: u64,
    calls: u64,
    checked_calls: u64,
    checked_elements: u64,
    wrong: u64,
    first_mismatch: Option<String>,
    first_us: f64,
    last_us: f64,
    drift_pct: f64,
}

/// One rank's whole run.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct RankReport {
    rank: usize,
    configs: Vec<CfgResult>,
    before_group: Snapshot,
    first_pass: Snapshot,
    last_pass: Snapshot,
    after_drop: Snapshot,
    /// Handles when the run started (before the group).
    baseline: Snapshot,
    planned_s: f64,
    timed_s: f64,
    wall_s: f64,
}

/// The plan every rank follows: timed replays per pass, and which passes
/// check, per configuration.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Plan {
    per_pass: Vec<u64>,
    estimate_s: f64,
}

/// The work of a mode: graphs of every configuration and the checks.
trait Rig {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    fn stream(&self) -> &Arc<CudaStream>;
    /// Waits for the stream and reports the group's kernel errors.
    fn check_group(&self) -> Result<()>;
    /// Captures the graph of `cfg` (index `i`).
    fn build(&mut self, i: usize, cfg: &Cfg) -> Result<()>;
    fn graph(&self, i: usize) -> &CudaGraph;
    /// Writes fresh inputs (`seed`), poisons the outputs, replays graph
    /// `i` once, waits, and compares every call's outputs of this process's
    /// ranks with the oracle: (elements compared, wrong, first mismatch).
    fn check(&mut self, i: usize, cfg: &Cfg, seed: u64) -> Result<(u64, u64, Option<String>)>;
    /// Every rank's bytes (one rank: just these).
    fn agree(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Drops the graphs, buffers and group.
    fn teardown(&mut self);
}

fn soak(
    args: &SoakArgs,
    describe: &str,
    mode: Mode<'_>,
) -> Result<(Vec<RankReport>, Plan, String)> {
    let t_start = Instant::now();
    let cfgs = configs(args);
    let ctx = match &mode {
        Mode::Virtual(c) | Mode::Procs(c, _) => c.clone(),
    };
    // SAFETY: every buffer of the soak is used on its one stream only, so
    // cudarc's cross-stream tracking is not needed (graphs capture the
    // fused call's slices; its events cannot be waited for in a capture).
    unsafe { ctx.disable_event_tracking() };
    let baseline = snapshot(&ctx)?;
    let exchange = match &mode {
        Mode::Procs(_, ex) => Some(*ex),
        Mode::Virtual(_) => None,
    };
    let mut rig: Box<dyn Rig + '_> = match mode {
        Mode::Virtual(ctx) => Box::new(VirtualRig::new(ctx, args, &cfgs)?),
        Mode::Procs(ctx, ex) => Box::new(ProcRig::new(ctx, ex, args, &cfgs)?),
    };
    let lead = rig.rank() == 0;
    if lead {
        println!("soak: {describe}");
        println!(
            "soak: {} configurations (every algorithm at {}..{}, fused one_stage/two_stage/push_ll at {:?} rows of {HIDDEN}), f32 adversarial data, {} passes, {} checked replays per configuration, budget {:.0} s",
            cfgs.len(),
            fmt_bytes(args.minbytes as u64),
            fmt_bytes(args.maxbytes as u64),
            args.fused_rows,
            args.passes,
            args.checks,
            args.budget
        );
    }
    let before_group = baseline;
    // Build and calibrate: one checked replay, then `CAL_REPLAYS` timed ones.
    let mut results: Vec<CfgResult> = cfgs
        .iter()
        .map(|c| {
            let (op, algo, bytes) = match c.kind {
                Kind::Allreduce { algo, count } => ("allreduce", algo, count * 4),
                Kind::Fused { algo, rows } => ("fused", algo, rows * HIDDEN * 4),
            };
            CfgResult {
                name: c.name(),
                op: op.into(),
                algorithm: algo.name().into(),
                bytes,
                per_graph: c.per_graph,
                ..CfgResult::default()
            }
        })
        .collect();
    let ev = events(&ctx)?;
    let mut replay_ms = Vec::with_capacity(cfgs.len());
    let mut seed = 0x50a6_0000u64;
    for (i, c) in cfgs.iter().enumerate() {
        rig.build(i, c)?;
        seed += 1;
        record_check(&mut results[i], rig.check(i, c, seed)?, c);
        let (ms, _) = timed(&*rig, i, CAL_REPLAYS, &ev)?;
        results[i].replays += CAL_REPLAYS;
        results[i].calls += CAL_REPLAYS * c.per_graph as u64;
        replay_ms.push(ms / CAL_REPLAYS as f64);
    }
    // The plan: rank 0's, for every rank.
    let plan = make_plan(args, &cfgs, &replay_ms);
    let all = rig.agree(&serde_json::to_vec(&plan).unwrap_or_default())?;
    let plan: Plan = serde_json::from_slice(&all[0])
        .map_err(|e| p2p_allreduce::Error::Rendezvous(format!("rank 0's soak plan: {e}")))?;
    if lead {
        let (ar, fu) = planned_calls(&cfgs, &plan, args);
        println!(
            "soak: plan: {ar} allreduces (target {}), {fu} fused calls (target {}), timed passes about {:.0} s",
            args.allreduces, args.fused, plan.estimate_s
        );
    }
    let check_passes = check_passes(args.passes, args.checks);
    let pb = crate::progress(args.passes, "soak");
    let mut first_pass = Snapshot::default();
    let mut last_pass = Snapshot::default();
    let mut timed_s = 0.0;
    for p in 0..args.passes {
        for (i, c) in cfgs.iter().enumerate() {
            if check_passes.contains(&p) {
                seed += 1;
                record_check(&mut results[i], rig.check(i, c, seed)?, c);
            }
            let n = plan.per_pass[i];
            let (ms, per_replay_ms) = timed(&*rig, i, n, &ev)?;
            timed_s += ms / 1000.0;
            results[i].replays += n;
            results[i].calls += n * c.per_graph as u64;
            let us = per_replay_ms * 1000.0 / c.per_graph as f64;
            if p == 0 {
                results[i].first_us = us;
            }
            if p + 1 == args.passes {
                results[i].last_us = us;
            }
        }
        let s = snapshot(&ctx)?;
        if p == 0 {
            first_pass = s;
        }
        last_pass = s;
        pb.inc(1);
    }
    pb.finish_and_clear();
    for r in &mut results {
        r.drift_pct = (r.last_us / r.first_us - 1.0) * 100.0;
    }
    drop(ev);
    rig.teardown();
    let rank = rig.rank();
    drop(rig);
    let after_drop = snapshot(&ctx)?;
    let mine = RankReport {
        rank,
        configs: results,
        before_group,
        first_pass,
        last_pass,
        after_drop,
        baseline,
        planned_s: plan.estimate_s,
        timed_s,
        wall_s: t_start.elapsed().as_secs_f64(),
    };
    // Every rank's report (the exchange outlives the group).
    let reports = match exchange {
        Some(ex) => gather_reports(ex, &mine)?,
        None => vec![mine],
    };
    Ok((reports, plan, describe.to_string()))
}

/// Every rank's report, through the rank processes' exchange.
fn gather_reports(ex: &DirExchange, mine: &RankReport) -> Result<Vec<RankReport>> {
    let all = ex.all_gather(&serde_json::to_vec(mine).unwrap_or_default())?;
    all.iter()
        .map(|b| {
            serde_json::from_slice(b)
                .map_err(|e| p2p_allreduce::Error::Rendezvous(format!("a rank's soak report: {e}")))
        })
        .collect()
}

/// The events that time a batch in `SUB_BATCHES` parts.
type Events = Vec<cudarc::driver::CudaEvent>;

/// A timed batch is cut into this many parts; its time per replay is the
/// median part's (one slow part, e.g. a late first launch, does not move
/// it).
const SUB_BATCHES: usize = 3;

fn events(ctx: &Arc<CudaContext>) -> Result<Events> {
    (0..=SUB_BATCHES)
        .map(|_| {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .during("cuEventCreate")
        })
        .collect()
}

/// `n` back-to-back replays of graph `i`: (milliseconds in all, median
/// milliseconds per replay over the batch's parts).
fn timed(rig: &dyn Rig, i: usize, n: u64, ev: &Events) -> Result<(f64, f64)> {
    let s = rig.stream();
    let parts = (SUB_BATCHES as u64).min(n).max(1) as usize;
    ev[0].record(s).during("cuEventRecord")?;
    let mut sizes = Vec::with_capacity(parts);
    for k in 0..parts {
        let m = n / parts as u64 + u64::from((k as u64) < n % parts as u64);
        for _ in 0..m {
            rig.graph(i).launch().during("cuGraphLaunch")?;
        }
        ev[k + 1].record(s).during("cuEventRecord")?;
        sizes.push(m);
    }
    ev[parts].synchronize().during("cuEventSynchronize")?;
    let mut per = Vec::with_capacity(parts);
    let mut total = 0.0;
    for k in 0..parts {
        let ms = ev[k].elapsed_ms(&ev[k + 1]).during("cuEventElapsedTime")? as f64;
        total += ms;
        per.push(ms / sizes[k].max(1) as f64);
    }
    per.sort_by(f64::total_cmp);
    // A kernel error (a peer timeout) shows here, not as a time.
    rig.check_group()?;
    Ok((total, per[per.len() / 2]))
}

fn record_check(r: &mut CfgResult, (elements, wrong, first): (u64, u64, Option<String>), c: &Cfg) {
    r.replays += 1;
    r.calls += c.per_graph as u64;
    r.checked_calls += c.per_graph as u64;
    r.checked_elements += elements;
    r.wrong += wrong;
    if r.first_mismatch.is_none() {
        r.first_mismatch = first;
    }
}

/// The passes with a checked replay: the first, the last, and the others
/// spread between.
fn check_passes(passes: u64, checks: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..checks)
        .map(|k| k * (passes - 1) / (checks - 1).max(1))
        .collect();
    v.dedup();
    v
}

/// Timed replays per pass for every configuration (see the module docs).
fn make_plan(args: &SoakArgs, cfgs: &[Cfg], replay_ms: &[f64]) -> Plan {
    let passes = args.passes;
    let min_per_pass = |i: usize| ((MIN_BATCH_MS / replay_ms[i].max(1e-3)).ceil() as u64).max(1);
    let budget_ms = args.budget * 1000.0;
    let mut per_pass = vec![0u64; cfgs.len()];
    // Targets per class, equal shares.
    let classes = [(false, args.allreduces), (true, args.fused)];
    let class_cost = |fused: bool| -> f64 {
        let idx: Vec<usize> = (0..cfgs.len())
            .filter(|&i| cfgs[i].fused() == fused)
            .collect();
        let target = classes.iter().find(|c| c.0 == fused).map_or(0, |c| c.1);
        let each = target.div_ceil(idx.len().max(1) as u64);
        idx.iter()
            .map(|&i| each.div_ceil(cfgs[i].per_graph as u64) as f64 * replay_ms[i])
            .sum()
    };
    let total_cost = class_cost(false) + class_cost(true);
    for (fused, target) in classes {
        let idx: Vec<usize> = (0..cfgs.len())
            .filter(|&i| cfgs[i].fused() == fused)
            .collect();
        if idx.is_empty() {
            continue;
        }
        let each = target.div_ceil(idx.len() as u64);
        // This class's share of the budget.
        let share = if total_cost > budget_ms {
            budget_ms * class_cost(fused) / total_cost.max(1e-9)
        } else {
            f64::INFINITY
        };
        let fair = share / idx.len() as f64;
        let mut spare = 0.0;
        for &i in &idx {
            let want = each.div_ceil(cfgs[i].per_graph as u64);
            let afford = (fair / replay_ms[i]).floor() as u64;
            let replays = want.min(afford.max(passes));
            spare += fair - replays as f64 * replay_ms[i];
            per_pass[i] = replays.div_ceil(passes);
        }
        // Time left by the cheap ones goes to the costly ones still short.
        if spare.is_finite() && spare > 0.0 {
            for &i in &idx {
                let want = each.div_ceil(cfgs[i].per_graph as u64).div_ceil(passes);
                if per_pass[i] < want {
                    let more = ((spare / (replay_ms[i] * passes as f64)).floor() as u64)
                        .min(want - per_pass[i]);
                    per_pass[i] += more;
                    spare -= more as f64 * replay_ms[i] * passes as f64;
                }
            }
        }
    }
    for (i, p) in per_pass.iter_mut().enumerate() {
        *p = (*p).max(min_per_pass(i));
    }
    let estimate_s = per_pass
        .iter()
        .zip(replay_ms)
        .map(|(&n, &ms)| n as f64 * passes as f64 * ms)
        .sum::<f64>()
        / 1000.0;
    Plan {
        per_pass,
        estimate_s,
    }
}

/// Calls the plan runs: (allreduces, fused), with the calibration's and
/// the checks' replays.
fn planned_calls(cfgs: &[Cfg], plan: &Plan, args: &SoakArgs) -> (u64, u64) {
    let checks = check_passes(args.passes, args.checks).len() as u64;
    let mut t = (0, 0);
    for (c, &n) in cfgs.iter().zip(&plan.per_pass) {
        let calls = (n * args.passes + CAL_REPLAYS + 1 + checks) * c.per_graph as u64;
        if c.fused() {
            t.1 += calls;
        } else {
            t.0 += calls;
        }
    }
    t
}

/// Prints the table and the verdict (on the reporting rank) and returns
/// the exit code.
fn finish(args: &SoakArgs, r: Result<(Vec<RankReport>, Plan, String)>, print: bool) -> ExitCode {
    let (reports, _plan, describe) = match r {
        Ok(x) => x,
        Err(e) => {
            println!("soak: FAILED to run: {e}");
            return ExitCode::FAILURE;
        }
    };
    let verdict = Verdict::of(args, &reports);
    if !print {
        return verdict.code();
    }
    let lead = &reports[0];
    println!();
    println!(
        "{:<34} {:>6} {:>8} {:>11} {:>9} {:>6} {:>10} {:>10} {:>8}",
        "configuration",
        "graph",
        "replays",
        "calls",
        "checked",
        "wrong",
        "us first",
        "us last",
        "drift"
    );
    for (k, c) in lead.configs.iter().enumerate() {
        let wrong: u64 = reports.iter().map(|r| r.configs[k].wrong).sum();
        let flag = if c.drift_pct.abs() > args.drift_pct {
            " !"
        } else {
            ""
        };
        println!(
            "{:<34} {:>6} {:>8} {:>11} {:>9} {:>6} {:>10.2} {:>10.2} {:>+7.2}%{flag}",
            c.name,
            c.per_graph,
            c.replays,
            c.calls,
            c.checked_calls,
            wrong,
            c.first_us,
            c.last_us,
            c.drift_pct
        );
        for r in &reports {
            if let Some(m) = &r.configs[k].first_mismatch {
                println!("    rank {}: first wrong element: {m}", r.rank);
            }
        }
    }
    println!();
    for line in verdict.lines(args, &reports, &describe) {
        println!("{line}");
    }
    if let Some(path) = &args.json {
        let json = verdict.json(args, &reports, &describe);
        let text = serde_json::to_string_pretty(&json).unwrap_or_default();
        if path.as_os_str() == "-" {
            println!("{text}");
        } else if let Err(e) = std::fs::write(path, text + "\n") {
            println!("soak: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        } else {
            println!("soak: JSON summary written to {}", path.display());
        }
    }
    verdict.code()
}

/// The soak's findings against its requirements.
struct Verdict {
    allreduces: u64,
    fused: u64,
    checked: u64,
    checked_elements: u64,
    wrong: u64,
    /// (config, drift %) of the worst configuration.
    worst: (String, f64),
    first_us: f64,
    last_us: f64,
    rss_growth: i64,
    device_growth: i64,
    handles_grew: bool,
    handles_left: bool,
    failures: Vec<String>,
}

impl Verdict {
    fn of(args: &SoakArgs, reports: &[RankReport]) -> Verdict {
        let lead = &reports[0];
        let sum = |f: &dyn Fn(&CfgResult) -> u64, fused: bool| -> u64 {
            lead.configs
                .iter()
                .filter(|c| (c.op == "fused") == fused)
                .map(f)
                .sum()
        };
        let allreduces = sum(&|c| c.calls, false);
        let fused = sum(&|c| c.calls, true);
        let checked = sum(&|c| c.checked_calls, false) + sum(&|c| c.checked_calls, true);
        let checked_elements: u64 = reports
            .iter()
            .flat_map(|r| &r.configs)
            .map(|c| c.checked_elements)
            .sum();
        let wrong: u64 = reports
            .iter()
            .flat_map(|r| &r.configs)
            .map(|c| c.wrong)
            .sum();
        let worst = lead
            .configs
            .iter()
            .map(|c| (c.name.clone(), c.drift_pct))
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap_or_default();
        // The time of one call of every configuration, added up.
        let first_us: f64 = lead.configs.iter().map(|c| c.first_us).sum();
        let last_us: f64 = lead.configs.iter().map(|c| c.last_us).sum();
        let growth = |f: &dyn Fn(&Snapshot) -> u64| -> i64 {
            reports
                .iter()
                .map(|r| f(&r.last_pass) as i64 - f(&r.first_pass) as i64)
                .max()
                .unwrap_or(0)
        };
        let rss_growth = growth(&|s| s.rss);
        let device_growth = growth(&|s| s.device_used);
        let handles_grew = reports
            .iter()
            .any(|r| r.last_pass.handles() != r.first_pass.handles());
        let handles_left = reports
            .iter()
            .any(|r| r.after_drop.handles() != r.baseline.handles());
        let mut failures = Vec::new();
        if wrong > 0 {
            failures.push(format!("{wrong} wrong elements"));
        }
        if allreduces < args.allreduces {
            failures.push(format!(
                "{allreduces} allreduces, short of the target {}: raise --budget",
                args.allreduces
            ));
        }
        if fused < args.fused {
            failures.push(format!(
                "{fused} fused calls, short of the target {}: raise --budget",
                args.fused
            ));
        }
        for c in &lead.configs {
            if c.drift_pct.abs() > args.drift_pct {
                failures.push(format!(
                    "{}: per-call time {:+.2}% from the first pass to the last (tolerance {}%)",
                    c.name, c.drift_pct, args.drift_pct
                ));
            }
        }
        if rss_growth > (args.rss_mib << 20) as i64 {
            failures.push(format!(
                "host RSS grew by {} from the first pass to the last (tolerance {} MiB)",
                fmt_signed(rss_growth),
                args.rss_mib
            ));
        }
        if device_growth > (args.device_mib << 20) as i64 {
            failures.push(format!(
                "device memory in use grew by {} (tolerance {} MiB)",
                fmt_signed(device_growth),
                args.device_mib
            ));
        }
        if handles_grew {
            failures.push(
                "the driver layer's handle counts changed between the first and the last pass"
                    .into(),
            );
        }
        if handles_left {
            failures.push("handles left after the group was dropped (see the handles line)".into());
        }
        Verdict {
            allreduces,
            fused,
            checked,
            checked_elements,
            wrong,
            worst,
            first_us,
            last_us,
            rss_growth,
            device_growth,
            handles_grew,
            handles_left,
            failures,
        }
    }

    fn code(&self) -> ExitCode {
        if self.failures.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    fn lines(&self, args: &SoakArgs, reports: &[RankReport], describe: &str) -> Vec<String> {
        let lead = &reports[0];
        let reached = |n: u64, t: u64| if n >= t { "reached" } else { "NOT reached" };
        let mut v = vec![
            format!("soak: {describe}"),
            format!(
                "calls: {} allreduces (target {}: {}), {} fused (target {}: {}); {} calls checked against the CPU oracle ({} output elements of every rank compared, outputs poisoned first), {} wrong",
                self.allreduces,
                args.allreduces,
                reached(self.allreduces, args.allreduces),
                self.fused,
                args.fused,
                reached(self.fused, args.fused),
                self.checked,
                self.checked_elements,
                self.wrong
            ),
            format!(
                "time per call, first pass vs last pass (rank 0): one call of every configuration {:.2} vs {:.2} us ({:+.2}%); worst configuration {} {:+.2}% (tolerance {}%)",
                self.first_us,
                self.last_us,
                (self.last_us / self.first_us - 1.0) * 100.0,
                self.worst.0,
                self.worst.1,
                args.drift_pct
            ),
        ];
        for r in reports {
            let who = if reports.len() > 1 {
                format!("rank {} ", r.rank)
            } else {
                String::new()
            };
            v.push(format!(
                "{who}host RSS: {} before the group, {} after the first pass, {} after the last ({}; tolerance {} MiB), {} after the drop",
                fmt_bytes(r.before_group.rss),
                fmt_bytes(r.first_pass.rss),
                fmt_bytes(r.last_pass.rss),
                fmt_signed(r.last_pass.rss as i64 - r.first_pass.rss as i64),
                args.rss_mib,
                fmt_bytes(r.after_drop.rss)
            ));
            v.push(format!(
                "{who}device memory in use: {} before the group, {} after the first pass, {} after the last ({}; tolerance {} MiB), {} after the drop",
                fmt_bytes(r.before_group.device_used),
                fmt_bytes(r.first_pass.device_used),
                fmt_bytes(r.last_pass.device_used),
                fmt_signed(r.last_pass.device_used as i64 - r.first_pass.device_used as i64),
                args.device_mib,
                fmt_bytes(r.after_drop.device_used)
            ));
            let h = |s: &Snapshot| {
                format!(
                    "{} device allocations, {} IPC mappings, {} pinned, {} events",
                    s.device_allocs, s.ipc_mappings, s.host_pinned, s.events
                )
            };
            v.push(format!(
                "{who}handles (driver layer): {} before; {} after the first pass; {} after the last; {} after the drop",
                h(&r.baseline),
                h(&r.first_pass),
                h(&r.last_pass),
                h(&r.after_drop)
            ));
        }
        v.push(format!(
            "timed passes {:.1} s (planned {:.1} s); whole run {:.1} s",
            lead.timed_s, lead.planned_s, lead.wall_s
        ));
        let _ = (
            self.rss_growth,
            self.device_growth,
            self.handles_grew,
            self.handles_left,
        );
        if self.failures.is_empty() {
            v.push("soak: PASS".into());
        } else {
            v.push(format!("soak: FAIL: {}", self.failures.join("; ")));
        }
        v
    }

    fn json(&self, args: &SoakArgs, reports: &[RankReport], describe: &str) -> serde_json::Value {
        serde_json::json!({
            "describe": describe,
            "procs": args.procs,
            "passes": args.passes,
            "budget_s": args.budget,
            "allreduces": {"calls": self.allreduces, "target": args.allreduces},
            "fused": {"calls": self.fused, "target": args.fused},
            "checked_calls": self.checked,
            "checked_elements": self.checked_elements,
            "wrong": self.wrong,
            "time": {
                "first_us_all_configs": self.first_us,
                "last_us_all_configs": self.last_us,
                "worst_config": self.worst.0,
                "worst_drift_pct": self.worst.1,
                "tolerance_pct": args.drift_pct,
            },
            "tolerances": {"rss_mib": args.rss_mib, "device_mib": args.device_mib},
            "ranks": reports,
            "pass": self.failures.is_empty(),
            "failures": self.failures,
        })
    }
}

fn fmt_signed(b: i64) -> String {
    if b < 0 {
        format!("-{}", fmt_bytes(b.unsigned_abs()))
    } else {
        format!("+{}", fmt_bytes(b as u64))
    }
}

// ---------------------------------------------------------------------------
// Data and the oracle.

/// Every rank's inputs of one check (f32 bits).
fn inputs(cfg: &Cfg, world: usize, seed: u64) -> Vec<Vec<u32>> {
    values::adversarial_inputs(Dtype::F32, world, cfg.count(), seed, true)
}

/// The fused call's residuals and gammas of one check.
fn fused_extra(rows: usize, world: usize, seed: u64) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let res = values::adversarial_inputs(Dtype::F32, world, rows * HIDDEN, seed ^ 0x9e37, false);
    let gam = values::adversarial_inputs(Dtype::F32, world, HIDDEN, seed ^ 0x7f4a, false);
    (res, gam)
}

/// The oracle of `per_graph` fused calls in a row on rank `r` (the
/// residual updated in place by each): every call's normed rows, and the
/// residual after the last.
fn fused_want(
    x: &[Vec<u32>],
    res: &[u32],
    gam: &[u32],
    per_graph: usize,
) -> (Vec<Vec<u32>>, Vec<u32>) {
    let refs: Vec<&[u32]> = x.iter().map(|v| v.as_slice()).collect();
    let mut residual = res.to_vec();
    let mut normed = Vec::with_capacity(per_graph);
    for _ in 0..per_graph {
        let (r, n) = reference::add_rmsnorm_bits(Dtype::F32, &refs, &residual, gam, EPS);
        residual = r;
        normed.push(n);
    }
    (normed, residual)
}

/// Compares one rank's outputs (`got`: `per_graph` calls back to back)
/// with `want` (one per call), into (elements, wrong, first).
fn compare_calls(rank: usize, got: &[u32], want: &[&[u32]], acc: &mut (u64, u64, Option<String>)) {
    let n = want.first().map_or(0, |w| w.len());
    for (j, w) in want.iter().enumerate() {
        let g = &got[j * n..(j + 1) * n];
        let mut wrong = 0usize;
        let mut first = None;
        validate::compare_rank(Dtype::F32, rank, g, w, &mut wrong, &mut first);
        acc.0 += n as u64;
        acc.1 += wrong as u64;
        if acc.2.is_none() {
            acc.2 = first.map(|m| {
                format!(
                    "call {j} of the graph, element {}: got {} want {}",
                    m.index,
                    reference::fmt_bits(Dtype::F32, m.got),
                    reference::fmt_bits(Dtype::F32, m.want)
                )
            });
        }
    }
}

fn poison_words(n: usize) -> Vec<u32> {
    vec![validate::poison_bits(Dtype::F32); n]
}

// ---------------------------------------------------------------------------
// Virtual ranks.

struct VirtualRig {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    group: Option<VirtualGroup>,
    reg: Option<RegisteredBuffers<f32>>,
    /// Every rank's outputs, a graph's calls back to back.
    outs: Vec<DeviceAlloc>,
    residual: Vec<CudaSlice<f32>>,
    gamma: Vec<CudaSlice<f32>>,
    normed: Vec<CudaSlice<f32>>,
    graphs: Vec<CudaGraph>,
}

fn out_words(cfgs: &[Cfg]) -> usize {
    cfgs.iter()
        .map(|c| c.per_graph * c.count())
        .max()
        .unwrap_or(1)
}

impl VirtualRig {
    fn new(ctx: Arc<CudaContext>, args: &SoakArgs, cfgs: &[Cfg]) -> Result<Self> {
        let stream = ctx.new_stream().during("cuStreamCreate")?;
        let group = VirtualGroup::new(&ctx, args.world, soak_config(args))?;
        let max_count = cfgs.iter().map(Cfg::count).max().unwrap_or(1);
        let reg = group.alloc_registered::<f32>(max_count)?;
        let words = out_words(cfgs);
        let outs = (0..args.world)
            .map(|_| DeviceAlloc::zeroed(&ctx, words * 4))
            .collect::<Result<Vec<_>>>()?;
        let fused_count = args.fused_rows.iter().max().copied().unwrap_or(1) * HIDDEN;
        let slices = |n: usize| -> Result<Vec<CudaSlice<f32>>> {
            (0..args.world)
                .map(|_| stream.alloc_zeros::<f32>(n).during("cuMemAlloc"))
                .collect()
        };
        let residual = slices(fused_count)?;
        let gamma = slices(HIDDEN)?;
        let normed = slices(words.max(1))?;
        Ok(VirtualRig {
            ctx,
            stream,
            group: Some(group),
            reg: Some(reg),
            outs,
            residual,
            gamma,
            normed,
            graphs: Vec::new(),
        })
    }

    fn group(&self) -> &VirtualGroup {
        self.group.as_ref().expect("the group lives until teardown")
    }
    fn reg(&self) -> &RegisteredBuffers<f32> {
        self.reg.as_ref().expect("the buffers live until teardown")
    }
}

impl Rig for VirtualRig {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        self.outs.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn check_group(&self) -> Result<()> {
        self.group().check(&self.stream)
    }
    fn build(&mut self, i: usize, cfg: &Cfg) -> Result<()> {
        assert_eq!(i, self.graphs.len(), "graphs are built in order");
        let s = self.stream.clone();
        s.synchronize().during("cuStreamSynchronize")?;
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .during("cuStreamBeginCapture")?;
        let n = cfg.count();
        let mut r = Ok(());
        for j in 0..cfg.per_graph {
            r = match cfg.kind {
                Kind::Allreduce { algo, .. } => {
                    let o: Vec<u64> = self
                        .outs
                        .iter()
                        .map(|a| a.ptr() + (j * n * 4) as u64)
                        .collect();
                    // SAFETY: every output holds per_graph * n f32 (the
                    // largest of any configuration) and lives as long as
                    // the graphs (dropped first in `teardown`).
                    unsafe {
                        self.group
                            .as_ref()
                            .expect("group")
                            .allreduce_registered_raw(
                                &s,
                                self.reg.as_ref().expect("reg"),
                                n,
                                &o,
                                algo.into(),
                            )
                    }
                    .map(|_| ())
                }
                Kind::Fused { algo, rows } => {
                    let gv: Vec<_> = self.gamma.iter().map(|g| g.slice(0..HIDDEN)).collect();
                    let gr: Vec<&_> = gv.iter().collect();
                    let mut rv: Vec<_> = self
                        .residual
                        .iter_mut()
                        .map(|x| x.slice_mut(0..rows * HIDDEN))
                        .collect();
                    let mut ov: Vec<_> = self
                        .normed
                        .iter_mut()
                        .map(|x| x.slice_mut(j * n..(j + 1) * n))
                        .collect();
                    self.group
                        .as_ref()
                        .expect("group")
                        .allreduce_add_rmsnorm_registered(
                            &s,
                            self.reg.as_ref().expect("reg"),
                            n,
                            &mut rv,
                            &gr,
                            EPS,
                            &mut ov,
                            algo.into(),
                        )
                        .map(|_| ())
                }
            };
            if r.is_err() {
                break;
            }
        }
        let g = s.end_capture(sys::CUgraphInstantiate_flags(0));
        r?;
        let g = g
            .during("cuStreamEndCapture")?
            .ok_or_else(|| p2p_allreduce::Error::Config("captured graph is empty".into()))?;
        self.graphs.push(g);
        Ok(())
    }
    fn graph(&self, i: usize) -> &CudaGraph {
        &self.graphs[i]
    }
    fn check(&mut self, i: usize, cfg: &Cfg, seed: u64) -> Result<(u64, u64, Option<String>)> {
        let world = self.world();
        let n = cfg.count();
        let x = inputs(cfg, world, seed);
        self.stream.synchronize().during("cuStreamSynchronize")?;
        for (r, xr) in x.iter().enumerate() {
            // SAFETY: the registered buffer of rank r holds the largest
            // count; no kernel runs (the stream was waited for).
            unsafe { driver::write_at(&self.ctx, self.reg().ptr(r), xr)? };
        }
        let mut acc = (0u64, 0u64, None);
        match cfg.kind {
            Kind::Allreduce { .. } => {
                for o in &self.outs {
                    o.write(&poison_words(cfg.per_graph * n))?;
                }
                self.graphs[i].launch().during("cuGraphLaunch")?;
                self.group().check(&self.stream)?;
                let refs: Vec<&[u32]> = x.iter().map(|v| v.as_slice()).collect();
                let want = reference::allreduce_bits(Dtype::F32, &refs);
                let wants: Vec<&[u32]> = vec![want.as_slice(); cfg.per_graph];
                for (r, o) in self.outs.iter().enumerate() {
                    let mut got = vec![0u32; cfg.per_graph * n];
                    o.read(&mut got)?;
                    compare_calls(r, &got, &wants, &mut acc);
                }
            }
            Kind::Fused { rows, .. } => {
                let (res, gam) = fused_extra(rows, world, seed);
                let f = |b: &[u32]| b.iter().map(|&v| f32::from_bits(v)).collect::<Vec<f32>>();
                for r in 0..world {
                    let s = &self.stream;
                    s.memcpy_htod(&f(&res[r]), &mut self.residual[r].slice_mut(0..n))
                        .during("cuMemcpyHtoD")?;
                    s.memcpy_htod(&f(&gam[r]), &mut self.gamma[r])
                        .during("cuMemcpyHtoD")?;
                    s.memcpy_htod(
                        &f(&poison_words(cfg.per_graph * n)),
                        &mut self.normed[r].slice_mut(0..cfg.per_graph * n),
                    )
                    .during("cuMemcpyHtoD")?;
                }
                self.stream.synchronize().during("cuStreamSynchronize")?;
                self.graphs[i].launch().during("cuGraphLaunch")?;
                self.group().check(&self.stream)?;
                for r in 0..world {
                    let (normed, residual) = fused_want(&x, &res[r], &gam[r], cfg.per_graph);
                    let got_n: Vec<u32> = self
                        .stream
                        .clone_dtoh(&self.normed[r].slice(0..cfg.per_graph * n))
                        .during("cuMemcpyDtoH")?
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    let got_r: Vec<u32> = self
                        .stream
                        .clone_dtoh(&self.residual[r].slice(0..n))
                        .during("cuMemcpyDtoH")?
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    let wants: Vec<&[u32]> = normed.iter().map(|v| v.as_slice()).collect();
                    compare_calls(r, &got_n, &wants, &mut acc);
                    compare_calls(r, &got_r, &[residual.as_slice()], &mut acc);
                }
            }
        }
        Ok(acc)
    }
    fn agree(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![mine.to_vec()])
    }
    fn teardown(&mut self) {
        let _ = self.stream.synchronize();
        self.graphs.clear();
        self.reg = None;
        self.outs.clear();
        self.residual.clear();
        self.gamma.clear();
        self.normed.clear();
        self.group = None;
    }
}

// ---------------------------------------------------------------------------
// Real ranks, one process each.

struct ProcRig<'a> {
    ex: &'a DirExchange,
    stream: Arc<CudaStream>,
    group: Option<ProcessGroup>,
    /// This rank's registered input (the largest count).
    input: Option<DeviceAlloc>,
    out: Option<DeviceAlloc>,
    residual: Option<DeviceAlloc>,
    gamma: Option<DeviceAlloc>,
    graphs: Vec<CudaGraph>,
}

impl<'a> ProcRig<'a> {
    fn new(
        ctx: Arc<CudaContext>,
        ex: &'a DirExchange,
        args: &SoakArgs,
        cfgs: &[Cfg],
    ) -> Result<Self> {
        let stream = ctx.new_stream().during("cuStreamCreate")?;
        let group = ProcessGroup::new(&ctx, ex, soak_config(args))?;
        let max_count = cfgs.iter().map(Cfg::count).max().unwrap_or(1);
        let input = DeviceAlloc::zeroed(&ctx, max_count * 4)?;
        // SAFETY: `input` lives until `teardown`, which drops the group
        // (and its mappings of the peers' inputs) first.
        unsafe { group.register_buffer(ex, input.ptr(), max_count * 4)? };
        // The registered table for offset 0, made outside capture.
        let out = DeviceAlloc::zeroed(&ctx, out_words(cfgs) * 4)?;
        // SAFETY: input and out hold 16 f32.
        unsafe {
            group.allreduce_registered_raw(
                &stream,
                Dtype::F32,
                16,
                input.ptr(),
                out.ptr(),
                AlgoChoice::OneStage,
            )?
        };
        group.check(&stream)?;
        let fused_count = args.fused_rows.iter().max().copied().unwrap_or(1) * HIDDEN;
        let residual = DeviceAlloc::zeroed(&ctx, fused_count * 4)?;
        let gamma = DeviceAlloc::zeroed(&ctx, HIDDEN * 4)?;
        Ok(ProcRig {
            ex,
            stream,
            group: Some(group),
            input: Some(input),
            out: Some(out),
            residual: Some(residual),
            gamma: Some(gamma),
            graphs: Vec::new(),
        })
    }
    fn group(&self) -> &ProcessGroup {
        self.group.as_ref().expect("the group lives until teardown")
    }
    fn ptr(a: &Option<DeviceAlloc>) -> u64 {
        a.as_ref().map_or(0, DeviceAlloc::ptr)
    }
}

impl Rig for ProcRig<'_> {
    fn rank(&self) -> usize {
        self.ex.rank()
    }
    fn world(&self) -> usize {
        self.ex.world()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn check_group(&self) -> Result<()> {
        self.group().check(&self.stream)
    }
    fn build(&mut self, i: usize, cfg: &Cfg) -> Result<()> {
        assert_eq!(i, self.graphs.len(), "graphs are built in order");
        let s = self.stream.clone();
        s.synchronize().during("cuStreamSynchronize")?;
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .during("cuStreamBeginCapture")?;
        let n = cfg.count();
        let (input, out) = (Self::ptr(&self.input), Self::ptr(&self.out));
        let (residual, gamma) = (Self::ptr(&self.residual), Self::ptr(&self.gamma));
        let mut r = Ok(());
        for j in 0..cfg.per_graph {
            let o = out + (j * n * 4) as u64;
            // SAFETY: the input lies in the registered buffer (the largest
            // count); `out` holds per_graph * n f32 for any configuration,
            // the residual and gamma the largest rows; all live as long as
            // the graphs (dropped first in `teardown`).
            r = unsafe {
                match cfg.kind {
                    Kind::Allreduce { algo, .. } => self.group().allreduce_registered_raw(
                        &s,
                        Dtype::F32,
                        n,
                        input,
                        o,
                        algo.into(),
                    ),
                    Kind::Fused { algo, rows } => {
                        self.group().allreduce_add_rmsnorm_registered_raw(
                            &s,
                            Dtype::F32,
                            rows,
                            HIDDEN,
                            EPS,
                            [input, residual, gamma, o],
                            algo.into(),
                        )
                    }
                }
            }
            .map(|_| ());
            if r.is_err() {
                break;
            }
        }
        let g = s.end_capture(sys::CUgraphInstantiate_flags(0));
        r?;
        let g = g
            .during("cuStreamEndCapture")?
            .ok_or_else(|| p2p_allreduce::Error::Config("captured graph is empty".into()))?;
        self.graphs.push(g);
        Ok(())
    }
    fn graph(&self, i: usize) -> &CudaGraph {
        &self.graphs[i]
    }
    fn check(&mut self, i: usize, cfg: &Cfg, seed: u64) -> Result<(u64, u64, Option<String>)> {
        let (rank, world) = (self.rank(), self.world());
        let n = cfg.count();
        let x = inputs(cfg, world, seed);
        // This rank's kernels are done, so no peer reads its input any
        // more (pull algorithms end with a barrier; push ones read only
        // their own zones).
        self.stream.synchronize().during("cuStreamSynchronize")?;
        let input = self.input.as_ref().expect("input");
        input.write(&x[rank])?;
        let out = self.out.as_ref().expect("out");
        out.write(&poison_words(cfg.per_graph * n))?;
        let mut acc = (0u64, 0u64, None);
        match cfg.kind {
            Kind::Allreduce { .. } => {
                self.graphs[i].launch().during("cuGraphLaunch")?;
                self.group().check(&self.stream)?;
                let refs: Vec<&[u32]> = x.iter().map(|v| v.as_slice()).collect();
                let want = reference::allreduce_bits(Dtype::F32, &refs);
                let mut got = vec![0u32; cfg.per_graph * n];
                out.read(&mut got)?;
                compare_calls(rank, &got, &vec![want.as_slice(); cfg.per_graph], &mut acc);
            }
            Kind::Fused { rows, .. } => {
                let (res, gam) = fused_extra(rows, world, seed);
                let residual = self.residual.as_ref().expect("residual");
                residual.write(&res[rank])?;
                self.gamma.as_ref().expect("gamma").write(&gam[rank])?;
                self.graphs[i].launch().during("cuGraphLaunch")?;
                self.group().check(&self.stream)?;
                let (normed, want_res) = fused_want(&x, &res[rank], &gam[rank], cfg.per_graph);
                let mut got = vec![0u32; cfg.per_graph * n];
                out.read(&mut got)?;
                let wants: Vec<&[u32]> = normed.iter().map(|v| v.as_slice()).collect();
                compare_calls(rank, &got, &wants, &mut acc);
                let mut got_r = vec![0u32; n];
                residual.read(&mut got_r)?;
                compare_calls(rank, &got_r, &[want_res.as_slice()], &mut acc);
            }
        }
        Ok(acc)
    }
    fn agree(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.ex.all_gather(mine)
    }
    fn teardown(&mut self) {
        let _ = self.stream.synchronize();
        self.graphs.clear();
        self.group = None;
        self.input = None;
        self.out = None;
        self.residual = None;
        self.gamma = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_cover_every_algorithm_and_size() {
        let a = SoakArgs::default();
        let c = configs(&a);
        // 4K, 16K, 64K, 256K, 1M, 4M, 8M: 7 sizes x 6 algorithms; 3 x 3 fused.
        assert_eq!(c.iter().filter(|c| !c.fused()).count(), 42);
        assert_eq!(c.iter().filter(|c| c.fused()).count(), 9);
        for algo in Algorithm::ALL {
            let sizes: Vec<usize> = c
                .iter()
                .filter_map(|c| match c.kind {
                    Kind::Allreduce { algo: a, count } if a == algo => Some(count * 4),
                    _ => None,
                })
                .collect();
            assert_eq!(
                sizes,
                vec![
                    4 << 10,
                    16 << 10,
                    64 << 10,
                    256 << 10,
                    1 << 20,
                    4 << 20,
                    8 << 20
                ]
            );
        }
        let cfg = soak_config(&a);
        assert!(cfg.validate().is_ok());
        assert_eq!(cfg.push_ll_max_bytes, 8 << 20);
    }

    #[test]
    fn plans_meet_the_targets_where_the_budget_allows() {
        let a = SoakArgs::default();
        let c = configs(&a);
        // 300 us per replay of 100 small calls, ~30 us per large call.
        let ms: Vec<f64> = c
            .iter()
            .map(|c| c.per_graph as f64 * (0.003 + c.count() as f64 * 4.0 / 3.0e12 * 1e3))
            .collect();
        let p = make_plan(&a, &c, &ms);
        let (ar, fu) = planned_calls(&c, &p, &a);
        assert!(ar >= a.allreduces && fu >= a.fused, "{ar} {fu}");
        assert!(p.estimate_s < a.budget, "{}", p.estimate_s);
        // Every batch holds at least MIN_BATCH_MS of replays.
        for (i, &n) in p.per_pass.iter().enumerate() {
            assert!(n as f64 * ms[i] >= MIN_BATCH_MS - 1e-9);
        }
        // A budget too small: every configuration still runs every pass,
        // the costly ones get fewer calls, and the plan says so.
        let tight = SoakArgs {
            budget: 1.0,
            ..SoakArgs::default()
        };
        let slow: Vec<f64> = ms.iter().map(|m| m * 1000.0).collect();
        let p = make_plan(&tight, &c, &slow);
        let (ar, _) = planned_calls(&c, &p, &tight);
        assert!(ar < tight.allreduces);
        assert!(p.per_pass.iter().all(|&n| n >= 1));
    }

    #[test]
    fn checks_fall_on_the_first_and_last_pass() {
        assert_eq!(check_passes(10, 3), vec![0, 4, 9]);
        assert_eq!(check_passes(10, 2), vec![0, 9]);
        assert_eq!(check_passes(2, 2), vec![0, 1]);
    }

    #[test]
    fn fused_oracle_chains_the_residual() {
        let x = vec![
            vec![1.0f32.to_bits(); HIDDEN],
            vec![2.0f32.to_bits(); HIDDEN],
        ];
        let res = vec![0.5f32.to_bits(); HIDDEN];
        let gam = vec![1.0f32.to_bits(); HIDDEN];
        let (normed, last) = fused_want(&x, &res, &gam, 3);
        assert_eq!(normed.len(), 3);
        // 0.5 + 3 three times.
        assert_eq!(f32::from_bits(last[0]), 9.5);
        assert!(normed.iter().all(|n| n.len() == HIDDEN));
    }
}
