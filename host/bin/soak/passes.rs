//! The soak run itself ([`soak`]): calibration, the planned passes of
//! timed batches and checked replays over a [`Rig`] (the work of a mode),
//! the host and device snapshots after the first and the last pass, and
//! the per-rank report ([`RankReport`]) gathered from every rank.

use super::*;

/// Host RSS in bytes (`/proc/self/status`), 0 where unreadable, after
/// the allocator has returned its free memory to the system (glibc's
/// `malloc_trim`), so that what is compared is memory in use, not the heap
/// the checks' large temporary vectors left behind.
pub(super) fn rss_bytes() -> u64 {
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
pub(super) struct Snapshot {
    pub(super) rss: u64,
    pub(super) device_used: u64,
    pub(super) device_allocs: i64,
    pub(super) ipc_mappings: i64,
    pub(super) host_pinned: i64,
    pub(super) events: i64,
}

pub(super) fn snapshot(ctx: &Arc<CudaContext>) -> Result<Snapshot> {
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
    pub(super) fn handles(&self) -> (i64, i64, i64, i64) {
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
pub(super) struct CfgResult {
    pub(super) name: String,
    pub(super) op: String,
    pub(super) algorithm: String,
    pub(super) bytes: usize,
    pub(super) per_graph: usize,
    pub(super) replays: u64,
    pub(super) calls: u64,
    pub(super) checked_calls: u64,
    pub(super) checked_elements: u64,
    pub(super) wrong: u64,
    pub(super) first_mismatch: Option<String>,
    pub(super) first_us: f64,
    pub(super) last_us: f64,
    pub(super) drift_pct: f64,
}

/// One rank's whole run.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct RankReport {
    pub(super) rank: usize,
    pub(super) configs: Vec<CfgResult>,
    pub(super) before_group: Snapshot,
    pub(super) first_pass: Snapshot,
    pub(super) last_pass: Snapshot,
    pub(super) after_drop: Snapshot,
    /// Handles when the run started (before the group).
    pub(super) baseline: Snapshot,
    pub(super) planned_s: f64,
    pub(super) timed_s: f64,
    pub(super) wall_s: f64,
}

/// The work of a mode: graphs of every configuration and the checks.
pub(super) trait Rig {
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

/// One CUDA graph of `calls` calls captured on `s` (after it is idle):
/// `call(j)` for each j, stopping at the first error. The capture is
/// ended in every case; a call's error is reported before the capture's.
pub(super) fn capture_calls(
    s: &Arc<CudaStream>,
    calls: usize,
    mut call: impl FnMut(usize) -> Result<()>,
) -> Result<CudaGraph> {
    s.synchronize().during("cuStreamSynchronize")?;
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .during("cuStreamBeginCapture")?;
    let r = (0..calls).try_for_each(&mut call);
    let g = s.end_capture(sys::CUgraphInstantiate_flags(0));
    r?;
    g.during("cuStreamEndCapture")?
        .ok_or_else(|| p2p_allreduce::Error::Config("captured graph is empty".into()))
}

pub(super) fn soak(
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
pub(super) fn gather_reports(ex: &DirExchange, mine: &RankReport) -> Result<Vec<RankReport>> {
    let all = ex.all_gather(&serde_json::to_vec(mine).unwrap_or_default())?;
    all.iter()
        .map(|b| {
            serde_json::from_slice(b)
                .map_err(|e| p2p_allreduce::Error::Rendezvous(format!("a rank's soak report: {e}")))
        })
        .collect()
}

/// The events that time a batch in `SUB_BATCHES` parts.
pub(super) type Events = Vec<cudarc::driver::CudaEvent>;

/// A timed batch is cut into this many parts; its time per replay is the
/// median part's (one slow part, e.g. a late first launch, does not move
/// it).
pub(super) const SUB_BATCHES: usize = 3;

pub(super) fn events(ctx: &Arc<CudaContext>) -> Result<Events> {
    (0..=SUB_BATCHES)
        .map(|_| {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .during("cuEventCreate")
        })
        .collect()
}

/// `n` back-to-back replays of graph `i`: (milliseconds in all, median
/// milliseconds per replay over the batch's parts).
pub(super) fn timed(rig: &dyn Rig, i: usize, n: u64, ev: &Events) -> Result<(f64, f64)> {
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

pub(super) fn record_check(
    r: &mut CfgResult,
    (elements, wrong, first): (u64, u64, Option<String>),
    c: &Cfg,
) {
    r.replays += 1;
    r.calls += c.per_graph as u64;
    r.checked_calls += c.per_graph as u64;
    r.checked_elements += elements;
    r.wrong += wrong;
    if r.first_mismatch.is_none() {
        r.first_mismatch = first;
    }
}
