//! `p2p-allreduce bench`: latency and bandwidth over message sizes, in the
//! conventions of nccl-tests' `all_reduce_perf` (-b/-e/-f/-d/-n/-w, size
//! and count columns, algbw and busbw).
//!
//! Three ways to run the ranks: virtual ranks on one GPU (default), one
//! process driving several GPUs (`--gpus 0,1`, a `PeerGroup`), and one
//! process per GPU (`--procs`, a `ProcessGroup` over CUDA IPC). With real
//! ranks and the `nccl` feature, NCCL rows are timed in the same run.
//!
//! Timing is [`measure::time_graphs`]: CUDA events around replays of a CUDA
//! graph (one per rank's stream) of `--per-graph` back-to-back allreduces on
//! zero-copy inputs, median over `-n` replays. `#wrong` comes from running
//! the same allreduce once more on the same group and data, into poisoned
//! outputs, and comparing every rank with the CPU reference bit for bit.

use crate::plot::{self, Series};
use crate::procs::{self, RankEnv};
use crate::{
    fmt_bytes, open_gpu, parse_algo_arg, parse_dtype_arg, parse_size, parse_world_arg, progress,
    NOTHING_RAN,
};
#[cfg(feature = "nccl")]
use cudarc::driver::DevicePtrMut;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use p2p_allreduce::abi::{Algorithm, Dtype, PACK_BYTES};
use p2p_allreduce::driver::DeviceAlloc;
use p2p_allreduce::error::Context as _;
use p2p_allreduce::measure::{self, Sample, Timing};
use p2p_allreduce::validate::{self, algo_name, Bits, Mismatch};
use p2p_allreduce::{
    driver, AlgoChoice, Config, Error, PeerGroup, ProcessGroup, RegisteredBuffers, Result,
    VirtualGroup,
};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Seed of the benchmark data (any value; fixed so runs are comparable).
const FILL_SEED: u64 = 0x6265_6e63_6821;

#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct BenchArgs {
    /// Smallest message in bytes (4096, 4K, 1M, ...).
    #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = parse_size)]
    pub minbytes: usize,
    /// Largest message in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    pub maxbytes: usize,
    /// Multiply the size by this factor from one row to the next.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub stepfactor: usize,
    /// Element type: f32, f16 or bf16.
    #[arg(short = 'd', long = "datatype", default_value = "bf16", value_parser = parse_dtype_arg)]
    pub datatype: Dtype,
    /// Timed graph replays per row (the median is reported).
    #[arg(short = 'n', long = "iters", default_value_t = 25)]
    pub iters: usize,
    /// Untimed graph replays before timing.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 3)]
    pub warmup_iters: usize,
    /// Allreduces captured back to back in each graph replay.
    #[arg(long, default_value_t = 20)]
    pub per_graph: usize,
    /// World sizes of virtual ranks on one GPU, e.g. `2,4,8`; with `--gpus`
    /// (several) or `--procs` the world is the number of GPUs listed.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "8", value_parser = parse_world_arg)]
    pub world: Vec<usize>,
    /// Algorithms; `auto` reports the one it picked (e.g. auto->one_stage).
    #[arg(long, value_delimiter = ',', default_value = "one_stage,two_stage,auto", value_parser = parse_algo_arg)]
    pub algo: Vec<AlgoChoice>,
    /// Write the rows as a JSON array to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Plot latency vs size (log-log, one line per algorithm x world) to this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// GPU to run virtual ranks on.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Real ranks, one per listed GPU, e.g. `0,1`: one process drives them
    /// all (a PeerGroup), or with `--procs` one process per GPU.
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<usize>,
    /// One process per GPU (those of `--gpus`, else every GPU): a
    /// ProcessGroup over CUDA IPC, graphs registered after capture.
    #[arg(long)]
    pub procs: bool,
    /// Blocks per rank at most (1..=64); default: chosen by the link.
    #[arg(long)]
    pub max_blocks: Option<u32>,
    /// Threads per block (a multiple of 32, 32..=1024).
    #[arg(long, default_value_t = 512)]
    pub threads: u32,
    /// Leave out the NCCL rows on real ranks.
    #[arg(long)]
    pub no_nccl: bool,
    /// Skip validating each row against the CPU reference (#wrong shows N/A).
    #[arg(long)]
    pub no_check: bool,
}

impl Default for BenchArgs {
    fn default() -> Self {
        BenchArgs {
            minbytes: 4 << 10,
            maxbytes: 64 << 20,
            stepfactor: 2,
            datatype: Dtype::Bf16,
            iters: 25,
            warmup_iters: 3,
            per_graph: 20,
            world: vec![8],
            algo: vec![AlgoChoice::OneStage, AlgoChoice::TwoStage, AlgoChoice::Auto],
            json: None,
            plot: None,
            device: 0,
            gpus: Vec::new(),
            procs: false,
            max_blocks: None,
            threads: 512,
            no_nccl: false,
            no_check: false,
        }
    }
}

/// One row of the table (and of `--json`).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Message size in bytes (per rank).
    pub size: usize,
    /// Elements per rank.
    pub count: usize,
    #[serde(rename = "type")]
    pub dtype: &'static str,
    pub world: usize,
    /// What was asked for: one_stage, two_stage or auto.
    pub requested: &'static str,
    /// What ran.
    pub algorithm: &'static str,
    /// Median microseconds per allreduce.
    pub time_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// Wrong elements over all ranks; null when not checked.
    pub wrong: Option<usize>,
}

/// Message sizes of the sweep: `min`, `min*f`, ... up to `max`, each a whole
/// number of elements of `elem` bytes.
pub fn sizes(min: usize, max: usize, step: usize, elem: usize) -> Vec<usize> {
    let mut v: Vec<usize> = Vec::new();
    let mut b = min.max(elem);
    while b <= max {
        let s = b / elem * elem;
        if v.last() != Some(&s) {
            v.push(s);
        }
        match b.checked_mul(step) {
            Some(n) if n > b => b = n,
            _ => break,
        }
    }
    v
}

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("bench: {msg}");
    ExitCode::from(NOTHING_RAN)
}

pub fn run(args: &BenchArgs) -> ExitCode {
    if args.stepfactor < 2 {
        return usage_error("-f/--stepfactor must be at least 2");
    }
    if args.iters == 0 || args.per_graph == 0 {
        return usage_error("-n/--iters and --per-graph must be at least 1");
    }
    if args.algo.is_empty() || args.world.is_empty() {
        return usage_error("give at least one --algo and one --world");
    }
    let sizes = sizes(
        args.minbytes,
        args.maxbytes,
        args.stepfactor,
        args.datatype.size(),
    );
    if sizes.is_empty() {
        return usage_error(&format!(
            "no message size between -b {} and -e {} bytes",
            args.minbytes, args.maxbytes
        ));
    }
    if let Err(e) = config(args, sizes[sizes.len() - 1]).validate() {
        return usage_error(&e);
    }
    if args.procs {
        if let Some(env) = RankEnv::get() {
            return run_rank(args, &sizes, &env);
        }
        let gpus = procs::gpus_or_all(&args.gpus);
        if gpus.len() < 2 {
            return usage_error("--procs needs at least two GPUs (list them with --gpus)");
        }
        return procs::run_ranks("bench", &gpus, PROCS_DEADLINE);
    }
    let rows = if args.gpus.len() >= 2 {
        run_peer(args, &sizes)
    } else {
        run_virtual(args, &sizes)
    };
    match rows {
        Ok((rows, failures, title)) => report(args, &rows, failures, &title),
        Err(code) => code,
    }
}

/// How long a `--procs` benchmark may run before its ranks are killed.
const PROCS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(1200);

/// Rows, failed rows and the plot title, or the exit code of a run that
/// could not start.
type Rows = Result<(Vec<Row>, usize, String), ExitCode>;

/// Prints the footer, writes `--json` and `--plot`, and turns the rows into
/// the exit code: failure if a row failed to run or any of our rows had a
/// wrong element (NCCL rows are reported but do not fail the run: NCCL's
/// summation order is not the contract's).
fn report(args: &BenchArgs, rows: &[Row], failures: usize, title: &str) -> ExitCode {
    footer(rows);
    let ours_wrong = rows
        .iter()
        .filter(|r| r.requested != NCCL)
        .any(|r| r.wrong.unwrap_or(0) > 0);
    let mut code = if failures > 0 || ours_wrong {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    };
    if let Some(path) = &args.json {
        match serde_json::to_string_pretty(rows) {
            Ok(s) => match std::fs::write(path, s + "\n") {
                Ok(()) => println!("# rows written to {}", path.display()),
                Err(e) => {
                    eprintln!("bench: cannot write {}: {e}", path.display());
                    code = ExitCode::FAILURE;
                }
            },
            Err(e) => {
                eprintln!("bench: cannot serialize the rows: {e}");
                code = ExitCode::FAILURE;
            }
        }
    }
    if let Some(path) = &args.plot {
        match plot::latency_svg(path, title, &series(rows)) {
            Ok(()) => println!("# plot written to {}", path.display()),
            Err(e) => {
                eprintln!("bench: cannot plot to {}: {e}", path.display());
                code = ExitCode::FAILURE;
            }
        }
    }
    code
}

/// The name of the NCCL rows.
const NCCL: &str = "nccl";

/// What one row runs: one of our algorithms, or NCCL.
#[derive(Clone, Copy, Debug, PartialEq)]
enum What {
    Kernel(AlgoChoice),
    Nccl,
}

impl What {
    fn name(self) -> &'static str {
        match self {
            What::Kernel(a) => algo_name(a),
            What::Nccl => NCCL,
        }
    }
}

/// One way of running the ranks, over registered (zero-copy) inputs that
/// hold the benchmark fill on every rank.
trait Runner {
    fn world(&self) -> usize;
    /// Times `count` elements with `what`; returns the sample and the name
    /// of what ran.
    fn time(&mut self, count: usize, what: What, timing: Timing) -> Result<(Sample, &'static str)>;
    /// Runs the same allreduce once more into poisoned outputs; returns the
    /// wrong elements over all ranks (against `want`, and rank 0's bits).
    fn wrong(
        &mut self,
        count: usize,
        what: What,
        want: &[u32],
    ) -> Result<(usize, Option<Mismatch>)>;
    fn reset(&self) -> Result<()>;
}

/// Runs every row of the sweep on `runner`; only `print` ranks print.
fn sweep_rows(
    runner: &mut dyn Runner,
    args: &BenchArgs,
    sizes: &[usize],
    whats: &[What],
    fill_bits: &[u32],
    print: bool,
) -> (Vec<Row>, usize) {
    let dtype = args.datatype;
    let world = runner.world();
    let pb = if print {
        progress((sizes.len() * whats.len()) as u64, "bench")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let say = |s: String| {
        if print {
            pb.suspend(|| println!("{s}"))
        }
    };
    let timing = Timing {
        per_graph: args.per_graph,
        warmup: args.warmup_iters,
        replays: args.iters,
    };
    let mut rows = Vec::new();
    let mut failures = 0;
    for &size in sizes {
        let count = size / dtype.size();
        let want = (!args.no_check)
            .then(|| validate::reference_for_fill(dtype, &fill_bits[..count], world));
        for &what in whats {
            pb.set_message(format!(
                "{} world {world} {}",
                fmt_bytes(size as u64),
                what.name()
            ));
            let (sample, ran) = match runner.time(count, what, timing) {
                Ok(s) => s,
                Err(e) => {
                    say(format!(
                        "# {size} B world {world} {}: error: {e}",
                        what.name()
                    ));
                    failures += 1;
                    if let Err(e) = runner.reset() {
                        say(format!("# world {world}: reset failed: {e}"));
                    }
                    pb.inc(1);
                    continue;
                }
            };
            let wrong = match &want {
                None => None,
                Some(want) => match runner.wrong(count, what, want) {
                    Ok((wrong, first)) => {
                        if let Some(m) = first {
                            say(format!(
                                "# {size} B world {world} {}: {wrong} wrong; first: {m}",
                                what.name()
                            ));
                        }
                        Some(wrong)
                    }
                    Err(e) => {
                        say(format!(
                            "# {size} B world {world} {}: check failed: {e}",
                            what.name()
                        ));
                        failures += 1;
                        if let Err(e) = runner.reset() {
                            say(format!("# world {world}: reset failed: {e}"));
                        }
                        None
                    }
                },
            };
            let (algbw, busbw) = measure::bandwidths(size, world, sample.median_us);
            let row = Row {
                size,
                count,
                dtype: dtype.name(),
                world,
                requested: what.name(),
                algorithm: ran,
                time_us: sample.median_us,
                min_us: sample.min_us,
                max_us: sample.max_us,
                algbw_gbps: algbw,
                busbw_gbps: busbw,
                wrong,
            };
            if print {
                pb.suspend(|| print_row(&row));
            }
            rows.push(row);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    (rows, failures)
}

fn kernel_rows(args: &BenchArgs) -> Vec<What> {
    args.algo.iter().map(|&a| What::Kernel(a)).collect()
}

fn fill_for(args: &BenchArgs, max_count: usize) -> Vec<u32> {
    validate::bench_fill(args.datatype, max_count, FILL_SEED)
}

// --- virtual ranks ---------------------------------------------------------

fn run_virtual(args: &BenchArgs, sizes: &[usize]) -> Rows {
    let ctx = open_gpu("bench", args.device)?;
    // SAFETY: this command uses one stream, and every buffer is used on it
    // only: cudarc's cross-stream event tracking is not needed, and graph
    // capture must not record its events.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(|e| {
        eprintln!("bench: cannot create a stream: {e}");
        ExitCode::FAILURE
    })?;
    header(
        &describe(&ctx),
        "virtual ranks on one GPU, registered inputs",
        args,
        sizes,
    );
    println!("# NCCL rows: none for virtual ranks (NCCL needs one GPU per rank)");
    column_names();
    let max_count = sizes[sizes.len() - 1] / args.datatype.size();
    let fill_bits = fill_for(args, max_count);
    let mut rows = Vec::new();
    let mut failures = 0;
    for &w in &args.world {
        let r = match args.datatype {
            Dtype::F32 => VirtualRunner::<f32>::new(&ctx, &stream, w, args, sizes, &fill_bits),
            Dtype::F16 => {
                VirtualRunner::<half::f16>::new(&ctx, &stream, w, args, sizes, &fill_bits)
            }
            Dtype::Bf16 => {
                VirtualRunner::<half::bf16>::new(&ctx, &stream, w, args, sizes, &fill_bits)
            }
        };
        match r {
            Ok(mut runner) => {
                let (r, f) = sweep_rows(
                    runner.as_mut(),
                    args,
                    sizes,
                    &kernel_rows(args),
                    &fill_bits,
                    true,
                );
                rows.extend(r);
                failures += f;
            }
            Err(e) => {
                println!("# world {w}: cannot create the group: {e}");
                failures += sizes.len() * args.algo.len();
            }
        }
    }
    let title = format!(
        "p2p-allreduce {} allreduce latency, virtual ranks on one GPU",
        args.datatype.name()
    );
    Ok((rows, failures, title))
}

struct VirtualRunner<T: Bits> {
    group: VirtualGroup,
    stream: Arc<CudaStream>,
    fill: Vec<T>,
}

impl<T: Bits> VirtualRunner<T> {
    #[allow(clippy::new_ret_no_self)]
    fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        world: usize,
        args: &BenchArgs,
        sizes: &[usize],
        fill_bits: &[u32],
    ) -> Result<Box<dyn Runner>> {
        Ok(Box::new(VirtualRunner::<T> {
            group: VirtualGroup::new(ctx, world, config(args, sizes[sizes.len() - 1]))?,
            stream: stream.clone(),
            fill: validate::from_bits(fill_bits),
        }))
    }
}

impl<T: Bits> Runner for VirtualRunner<T> {
    fn world(&self) -> usize {
        self.group.world()
    }
    fn time(&mut self, count: usize, what: What, timing: Timing) -> Result<(Sample, &'static str)> {
        let What::Kernel(algo) = what else {
            return Err(Error::Config("NCCL does not run on virtual ranks".into()));
        };
        let s =
            measure::time_registered(&self.group, &self.stream, count, &self.fill, algo, timing)?;
        let name = s.algorithm.name();
        Ok((s, name))
    }
    fn wrong(
        &mut self,
        count: usize,
        what: What,
        want: &[u32],
    ) -> Result<(usize, Option<Mismatch>)> {
        let What::Kernel(algo) = what else {
            return Err(Error::Config("NCCL does not run on virtual ranks".into()));
        };
        let o = validate::check_registered_fill(
            &self.group,
            &self.stream,
            &self.fill[..count],
            want,
            algo,
        )?;
        Ok((o.wrong, o.first))
    }
    fn reset(&self) -> Result<()> {
        self.group.reset()
    }
}

// --- real ranks, one process (PeerGroup) -------------------------------------

fn run_peer(args: &BenchArgs, sizes: &[usize]) -> Rows {
    let mut ctxs: Vec<Arc<CudaContext>> = Vec::new();
    for &g in &args.gpus {
        if let Some(c) = ctxs.iter().find(|c| c.ordinal() == g) {
            ctxs.push(c.clone());
            continue;
        }
        let c = open_gpu("bench", g)?;
        // SAFETY: every buffer of this command is used on its rank's one
        // stream only, and graph capture must not record cudarc's events.
        unsafe { c.disable_event_tracking() };
        ctxs.push(c);
    }
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        eprintln!("bench: cannot {what}: {e}");
        ExitCode::FAILURE
    };
    let streams = ctxs
        .iter()
        .map(|c| c.new_stream())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| fail("create streams", &e))?;
    let group = PeerGroup::new(&ctxs, config(args, sizes[sizes.len() - 1]))
        .map_err(|e| fail("create the PeerGroup", &e))?;
    let link = group.link();
    header(
        &ctxs.iter().map(describe).collect::<Vec<_>>().join("; "),
        &format!(
            "real ranks, one process (PeerGroup) on GPUs {:?}, link {link:?}, registered inputs",
            args.gpus
        ),
        args,
        sizes,
    );
    let nccl = nccl_for_peer(args, &streams);
    column_names();
    let max_count = sizes[sizes.len() - 1] / args.datatype.size();
    let fill_bits = fill_for(args, max_count);
    let mut whats = kernel_rows(args);
    if nccl.is_some() {
        whats.push(What::Nccl);
    }
    let runner = match args.datatype {
        Dtype::F32 => PeerRunner::<f32>::new(group, streams, nccl, max_count, &fill_bits),
        Dtype::F16 => PeerRunner::<half::f16>::new(group, streams, nccl, max_count, &fill_bits),
        Dtype::Bf16 => PeerRunner::<half::bf16>::new(group, streams, nccl, max_count, &fill_bits),
    };
    let mut runner = runner.map_err(|e| fail("prepare the inputs", &e))?;
    let (rows, failures) = sweep_rows(runner.as_mut(), args, sizes, &whats, &fill_bits, true);
    let title = format!(
        "p2p-allreduce {} allreduce latency, {} GPUs ({link:?}), one process",
        args.datatype.name(),
        args.gpus.len()
    );
    Ok((rows, failures, title))
}

#[cfg(feature = "nccl")]
type PeerNccl = p2p_allreduce::nccl::NcclGroup;
#[cfg(not(feature = "nccl"))]
type PeerNccl = std::convert::Infallible;

/// NCCL communicators for the NCCL rows, or a printed reason why none.
fn nccl_for_peer(args: &BenchArgs, streams: &[Arc<CudaStream>]) -> Option<PeerNccl> {
    if args.no_nccl {
        println!("# NCCL rows: left out (--no-nccl)");
        return None;
    }
    #[cfg(feature = "nccl")]
    {
        let distinct = streams.iter().enumerate().all(|(i, s)| {
            streams[..i]
                .iter()
                .all(|p| p.context().ordinal() != s.context().ordinal())
        });
        if !distinct {
            println!("# NCCL rows: none (NCCL needs one GPU per rank; a GPU is listed twice)");
            return None;
        }
        match p2p_allreduce::nccl::NcclGroup::new(streams) {
            Ok(n) => {
                print_nccl_library();
                Some(n)
            }
            Err(e) => {
                println!("# NCCL rows: none: {e}");
                None
            }
        }
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = streams;
        println!("# NCCL rows: none (built without the `nccl` cargo feature)");
        None
    }
}

#[cfg(feature = "nccl")]
fn print_nccl_library() {
    match p2p_allreduce::nccl::library() {
        Ok((path, v)) => println!(
            "# NCCL rows: NCCL {}.{}.{} from {path}, timed the same way (its bits are not the contract's: #wrong is reported, not failed)",
            v / 10000,
            v / 100 % 100,
            v % 100
        ),
        Err(e) => println!("# NCCL: {e}"),
    }
}

struct PeerRunner<T: Bits> {
    group: PeerGroup,
    streams: Vec<Arc<CudaStream>>,
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    nccl: Option<PeerNccl>,
    reg: RegisteredBuffers<T>,
    outs: Vec<CudaSlice<T>>,
}

impl<T: Bits> PeerRunner<T> {
    #[allow(clippy::new_ret_no_self)]
    fn new(
        group: PeerGroup,
        streams: Vec<Arc<CudaStream>>,
        nccl: Option<PeerNccl>,
        max_count: usize,
        fill_bits: &[u32],
    ) -> Result<Box<dyn Runner>> {
        let reg = group.alloc_registered::<T>(max_count.max(1))?;
        let fill: Vec<T> = validate::from_bits(fill_bits);
        let mut outs = Vec::new();
        for (r, s) in streams.iter().enumerate() {
            if max_count > 0 {
                let src = s.clone_htod(&fill).during("cuMemcpyHtoD (bench input)")?;
                reg.copy_from(r, s, &src)?;
                s.synchronize().during("cuStreamSynchronize")?;
            }
            outs.push(
                s.alloc_zeros::<T>(max_count.max(1))
                    .during("cuMemAlloc (bench output)")?,
            );
        }
        Ok(Box::new(PeerRunner::<T> {
            group,
            streams,
            nccl,
            reg,
            outs,
        }))
    }

    #[cfg(feature = "nccl")]
    fn ptrs(&mut self) -> (Vec<u64>, Vec<u64>) {
        let ins = (0..self.streams.len()).map(|r| self.reg.ptr(r)).collect();
        let outs = self
            .outs
            .iter_mut()
            .zip(&self.streams)
            .map(|(o, s)| o.device_ptr_mut(s).0)
            .collect();
        (ins, outs)
    }
}

impl<T: Bits> Runner for PeerRunner<T> {
    fn world(&self) -> usize {
        self.group.world()
    }
    fn time(&mut self, count: usize, what: What, timing: Timing) -> Result<(Sample, &'static str)> {
        let mut used = Algorithm::OneStage;
        let (group, streams, reg) = (&self.group, &self.streams, &self.reg);
        let times = match what {
            What::Kernel(algo) => {
                let outs = &mut self.outs;
                measure::time_graphs(
                    streams,
                    timing,
                    || {
                        used = group.allreduce_registered(streams, reg, count, outs, algo)?;
                        Ok(())
                    },
                    || Ok(()),
                    || group.check(streams),
                )?
            }
            What::Nccl => {
                #[cfg(feature = "nccl")]
                {
                    let (ins, outs) = self.ptrs();
                    let n = self
                        .nccl
                        .as_ref()
                        .ok_or_else(|| Error::Nccl("NCCL was not set up".into()))?;
                    let streams = &self.streams;
                    let t = measure::time_graphs(
                        streams,
                        timing,
                        // SAFETY: the registered buffers and outputs hold
                        // max_count >= count elements and outlive the graphs.
                        || unsafe { n.allreduce_raw(streams, T::DTYPE, count, &ins, &outs) },
                        || Ok(()),
                        || sync_all(streams),
                    )?;
                    return Ok((Sample::from_times(used, t), NCCL));
                }
                #[cfg(not(feature = "nccl"))]
                return Err(Error::Nccl("built without the `nccl` feature".into()));
            }
        };
        let s = Sample::from_times(used, times);
        Ok((s, used.name()))
    }
    fn wrong(
        &mut self,
        count: usize,
        what: What,
        want: &[u32],
    ) -> Result<(usize, Option<Mismatch>)> {
        let poison = vec![T::from_bits32(validate::poison_bits(T::DTYPE)); count.max(1)];
        let mut fresh = self
            .streams
            .iter()
            .map(|s| {
                s.clone_htod(&poison)
                    .during("cuMemcpyHtoD (poisoned output)")
            })
            .collect::<Result<Vec<_>>>()?;
        match what {
            What::Kernel(algo) => {
                self.group.allreduce_registered(
                    &self.streams,
                    &self.reg,
                    count,
                    &mut fresh,
                    algo,
                )?;
                self.group.check(&self.streams)?;
            }
            What::Nccl => {
                #[cfg(feature = "nccl")]
                {
                    let (ins, _) = self.ptrs();
                    let outs: Vec<u64> = fresh
                        .iter_mut()
                        .zip(&self.streams)
                        .map(|(o, s)| o.device_ptr_mut(s).0)
                        .collect();
                    let n = self
                        .nccl
                        .as_ref()
                        .ok_or_else(|| Error::Nccl("NCCL was not set up".into()))?;
                    // SAFETY: inputs and fresh outputs hold >= count elements.
                    unsafe { n.allreduce_raw(&self.streams, T::DTYPE, count, &ins, &outs)? };
                    sync_all(&self.streams)?;
                }
                #[cfg(not(feature = "nccl"))]
                return Err(Error::Nccl("built without the `nccl` feature".into()));
            }
        }
        let got = fresh
            .iter()
            .zip(&self.streams)
            .map(|(o, s)| {
                s.clone_dtoh(o)
                    .during("cuMemcpyDtoH (output)")
                    .map(|v| validate::to_bits(&v[..count]))
            })
            .collect::<Result<Vec<_>>>()?;
        let (mut wrong, mut first) = (0, None);
        for (r, g) in got.iter().enumerate() {
            validate::compare_rank(T::DTYPE, r, g, want, &mut wrong, &mut first);
            validate::compare_identical(T::DTYPE, r, g, &got[0], &mut wrong, &mut first);
        }
        Ok((wrong, first))
    }
    fn reset(&self) -> Result<()> {
        self.group.reset()
    }
}

#[cfg(feature = "nccl")]
fn sync_all(streams: &[Arc<CudaStream>]) -> Result<()> {
    for s in streams {
        s.synchronize().during("cuStreamSynchronize")?;
    }
    Ok(())
}

// --- real ranks, one process per GPU (ProcessGroup) -------------------------

/// One rank of `bench --procs`. Rank 0 prints the table; every rank checks
/// its own result and the ranks add up their `#wrong` through the exchange.
fn run_rank(args: &BenchArgs, sizes: &[usize], env: &RankEnv) -> ExitCode {
    let print = env.rank == 0;
    let ctx = match open_gpu("bench", env.gpu) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // SAFETY: every buffer is used on this rank's one stream only, and graph
    // capture must not record cudarc's events.
    unsafe { ctx.disable_event_tracking() };
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        println!(
            "bench: rank {} on GPU {}: cannot {what}: {e}",
            env.rank, env.gpu
        );
        ExitCode::FAILURE
    };
    let stream = match ctx.new_stream() {
        Ok(s) => s,
        Err(e) => return fail("create a stream", &e),
    };
    let ex = match env.exchange() {
        Ok(x) => x,
        Err(e) => return fail("join the rendezvous", &e),
    };
    let group = match ProcessGroup::new(&ctx, &ex, config(args, sizes[sizes.len() - 1])) {
        Ok(g) => g,
        Err(e) => return fail("form the ProcessGroup", &e),
    };
    if print {
        header(
            &describe(&ctx),
            &format!(
                "real ranks, one process per GPU (ProcessGroup over CUDA IPC), {} processes, link {:?}, zero-copy graphs registered after capture",
                env.world,
                group.link()
            ),
            args,
            sizes,
        );
    }
    let nccl = nccl_for_rank(args, &ctx, &ex, print);
    if print {
        column_names();
    }
    let max_count = sizes[sizes.len() - 1] / args.datatype.size();
    let fill_bits = fill_for(args, max_count);
    let mut whats = kernel_rows(args);
    if nccl.is_some() {
        whats.push(What::Nccl);
    }
    let runner = match args.datatype {
        Dtype::F32 => ProcRunner::<f32>::new(group, &ex, stream, nccl, max_count, &fill_bits),
        Dtype::F16 => ProcRunner::<half::f16>::new(group, &ex, stream, nccl, max_count, &fill_bits),
        Dtype::Bf16 => {
            ProcRunner::<half::bf16>::new(group, &ex, stream, nccl, max_count, &fill_bits)
        }
    };
    let mut runner = match runner {
        Ok(r) => r,
        Err(e) => return fail("prepare the inputs", &e),
    };
    let (rows, failures) = sweep_rows(runner.as_mut(), args, sizes, &whats, &fill_bits, print);
    if !print {
        if failures > 0 {
            println!("bench: rank {}: {failures} rows failed", env.rank);
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    let title = format!(
        "p2p-allreduce {} allreduce latency, {} GPUs, one process per GPU",
        args.datatype.name(),
        env.world
    );
    report(args, &rows, failures, &title)
}

#[cfg(feature = "nccl")]
type RankNccl = p2p_allreduce::nccl::NcclRank;
#[cfg(not(feature = "nccl"))]
type RankNccl = std::convert::Infallible;

/// This rank's NCCL communicator for the NCCL rows. Every rank reaches the
/// same decision (same arguments, same build); a failure to create it is
/// reported and leaves the rows out.
fn nccl_for_rank(
    args: &BenchArgs,
    ctx: &Arc<CudaContext>,
    ex: &dyn p2p_allreduce::Exchange,
    print: bool,
) -> Option<RankNccl> {
    if args.no_nccl {
        if print {
            println!("# NCCL rows: left out (--no-nccl)");
        }
        return None;
    }
    #[cfg(feature = "nccl")]
    {
        // Agree first that every rank can load NCCL, so no rank waits in
        // ncclCommInitRank for one that cannot.
        let ok = p2p_allreduce::nccl::nccl_present();
        let all = ex.all_gather(&[u8::from(ok)]).ok()?;
        if all.iter().any(|b| b.first() != Some(&1)) {
            if print {
                println!(
                    "# NCCL rows: none: {}",
                    p2p_allreduce::nccl::library()
                        .err()
                        .map_or("another rank cannot load libnccl".into(), |e| e.to_string())
                );
            }
            return None;
        }
        match p2p_allreduce::nccl::NcclRank::new(ctx, ex) {
            Ok(n) => {
                if print {
                    print_nccl_library();
                }
                Some(n)
            }
            Err(e) => {
                if print {
                    println!("# NCCL rows: none: {e}");
                }
                None
            }
        }
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = (ctx, ex);
        if print {
            println!("# NCCL rows: none (built without the `nccl` cargo feature)");
        }
        None
    }
}

struct ProcRunner<'a, T: Bits> {
    group: ProcessGroup,
    ex: &'a dyn p2p_allreduce::Exchange,
    stream: Arc<CudaStream>,
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    nccl: Option<RankNccl>,
    input: DeviceAlloc,
    output: DeviceAlloc,
    _t: std::marker::PhantomData<T>,
}

impl<'a, T: Bits> ProcRunner<'a, T> {
    #[allow(clippy::new_ret_no_self)]
    fn new(
        group: ProcessGroup,
        ex: &'a dyn p2p_allreduce::Exchange,
        stream: Arc<CudaStream>,
        nccl: Option<RankNccl>,
        max_count: usize,
        fill_bits: &[u32],
    ) -> Result<Box<dyn Runner + 'a>> {
        let ctx = stream.context().clone();
        let bytes = max_count.max(1) * T::DTYPE.size();
        let input = DeviceAlloc::zeroed(&ctx, bytes)?;
        let fill: Vec<T> = validate::from_bits(fill_bits);
        input.write(&fill)?;
        let output = DeviceAlloc::zeroed(&ctx, bytes)?;
        Ok(Box::new(ProcRunner::<T> {
            group,
            ex,
            stream,
            nccl,
            input,
            output,
            _t: std::marker::PhantomData,
        }))
    }
}

impl<T: Bits> Runner for ProcRunner<'_, T> {
    fn world(&self) -> usize {
        self.group.world()
    }
    fn time(&mut self, count: usize, what: What, timing: Timing) -> Result<(Sample, &'static str)> {
        let streams = [self.stream.clone()];
        let (i, o) = (self.input.ptr(), self.output.ptr());
        match what {
            What::Kernel(algo) => {
                let mut used = Algorithm::OneStage;
                let g = &self.group;
                let s = &self.stream;
                let times = measure::time_graphs(
                    &streams,
                    timing,
                    || {
                        // SAFETY: input and output hold max_count >= count
                        // elements, come from cuMemAlloc and outlive the graph.
                        used = unsafe { g.allreduce_in_graph(s, T::DTYPE, count, i, o, algo)? };
                        Ok(())
                    },
                    || g.register_captured(self.ex).map(|_| ()),
                    || g.check(s),
                )?;
                Ok((Sample::from_times(used, times), used.name()))
            }
            What::Nccl => {
                #[cfg(feature = "nccl")]
                {
                    let n = self
                        .nccl
                        .as_ref()
                        .ok_or_else(|| Error::Nccl("NCCL was not set up".into()))?;
                    let s = &self.stream;
                    let times = measure::time_graphs(
                        &streams,
                        timing,
                        // SAFETY: as above.
                        || unsafe { n.allreduce_raw(s, T::DTYPE, count, i, o) },
                        || Ok(()),
                        || s.synchronize().during("cuStreamSynchronize"),
                    )?;
                    Ok((Sample::from_times(Algorithm::OneStage, times), NCCL))
                }
                #[cfg(not(feature = "nccl"))]
                Err(Error::Nccl("built without the `nccl` feature".into()))
            }
        }
    }
    fn wrong(
        &mut self,
        count: usize,
        what: What,
        want: &[u32],
    ) -> Result<(usize, Option<Mismatch>)> {
        let poison = vec![validate::poison_bits(T::DTYPE); count.max(1)];
        let poison: Vec<T> = validate::from_bits(&poison);
        self.output.write(&poison)?;
        let (i, o) = (self.input.ptr(), self.output.ptr());
        match what {
            What::Kernel(algo) => {
                // The timed path once more: a graph of one zero-copy allreduce.
                let s = &self.stream;
                let g = &self.group;
                measure::time_graphs(
                    std::slice::from_ref(s),
                    Timing {
                        per_graph: 1,
                        warmup: 0,
                        replays: 1,
                    },
                    // SAFETY: as in `time`.
                    || unsafe {
                        g.allreduce_in_graph(s, T::DTYPE, count, i, o, algo)
                            .map(|_| ())
                    },
                    || g.register_captured(self.ex).map(|_| ()),
                    || g.check(s),
                )?;
            }
            What::Nccl => {
                #[cfg(feature = "nccl")]
                {
                    let n = self
                        .nccl
                        .as_ref()
                        .ok_or_else(|| Error::Nccl("NCCL was not set up".into()))?;
                    // SAFETY: as in `time`.
                    unsafe { n.allreduce_raw(&self.stream, T::DTYPE, count, i, o)? };
                    self.stream.synchronize().during("cuStreamSynchronize")?;
                }
                #[cfg(not(feature = "nccl"))]
                return Err(Error::Nccl("built without the `nccl` feature".into()));
            }
        }
        let mut got: Vec<T> = validate::from_bits(&vec![0u32; count]);
        self.output.read(&mut got)?;
        let got = validate::to_bits(&got);
        let (mut wrong, mut first) = (0, None);
        validate::compare_rank(
            T::DTYPE,
            self.group.rank(),
            &got,
            want,
            &mut wrong,
            &mut first,
        );
        // Every rank's count and bits, added up / compared through the exchange.
        let mut mine = (wrong as u64).to_le_bytes().to_vec();
        mine.extend_from_slice(&validate::bits_hash(&got).to_le_bytes());
        let all = self.ex.all_gather(&mine)?;
        let mut total = 0usize;
        for b in &all {
            total += u64::from_le_bytes(b[..8].try_into().unwrap_or_default()) as usize;
            if b[8..] != all[0][8..] {
                total += 1;
            }
        }
        Ok((total, first))
    }
    fn reset(&self) -> Result<()> {
        self.group.reset()
    }
}

/// "GPU 0 NVIDIA H200 (cc 9.0, 132 SMs), PTX sm_90".
fn describe(ctx: &Arc<CudaContext>) -> String {
    let dev = match driver::device_info(ctx) {
        Ok(i) => format!(
            "GPU {} {} (cc {}.{}, {} SMs)",
            i.ordinal, i.name, i.compute_capability.0, i.compute_capability.1, i.multiprocessors
        ),
        Err(e) => format!("GPU {} ({e})", ctx.ordinal()),
    };
    let ptx = driver::module_for_device(ctx)
        .map(|m| m.arch)
        .unwrap_or("?");
    format!("{dev}, PTX {ptx}")
}

fn header(devices: &str, mode: &str, args: &BenchArgs, sizes: &[usize]) {
    println!("# p2p-allreduce bench: {devices}");
    println!(
        "# {mode}; time = median of {} replays of a CUDA graph of {} allreduces ({} warm-up replays); blocks per rank: {}, {} threads each",
        args.iters,
        args.per_graph,
        args.warmup_iters,
        args.max_blocks
            .map_or("chosen by the link".to_string(), |b| format!("at most {b}")),
        args.threads
    );
    println!(
        "# {} x {} sizes ({}..{}, x{}), algorithms {}",
        args.datatype.name(),
        sizes.len(),
        fmt_bytes(sizes[0] as u64),
        fmt_bytes(sizes[sizes.len() - 1] as u64),
        args.stepfactor,
        args.algo
            .iter()
            .map(|&a| algo_name(a))
            .collect::<Vec<_>>()
            .join(",")
    );
    if args.no_check {
        println!("# #wrong: not checked (--no-check)");
    } else {
        println!("# #wrong: each row's allreduce (same group, data and algorithm) run once more into poisoned outputs, all ranks compared with the CPU reference and with each other bit for bit");
    }
}

fn column_names() {
    println!("#");
    println!(
        "# {:>10} {:>12} {:>6} {:>6} {:>16} {:>10} {:>9} {:>9} {:>7}",
        "size", "count", "type", "world", "algorithm", "time", "algbw", "busbw", "#wrong"
    );
    let units = format!(
        "# {:>10} {:>12} {:>6} {:>6} {:>16} {:>10} {:>9} {:>9}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)"
    );
    println!("{}", units.trim_end());
}

fn print_row(r: &Row) {
    let algo = if r.requested == r.algorithm {
        r.algorithm.to_string()
    } else {
        format!("{}->{}", r.requested, r.algorithm)
    };
    let wrong = r.wrong.map_or("N/A".to_string(), |w| w.to_string());
    println!(
        "  {:>10} {:>12} {:>6} {:>6} {:>16} {:>10.2} {:>9.2} {:>9.2} {:>7}",
        r.size, r.count, r.dtype, r.world, algo, r.time_us, r.algbw_gbps, r.busbw_gbps, wrong
    );
}

fn footer(rows: &[Row]) {
    let wrong: usize = rows.iter().filter_map(|r| r.wrong).sum();
    let checked = rows.iter().any(|r| r.wrong.is_some());
    if checked {
        println!(
            "# Out of bounds values : {wrong} {}",
            if wrong == 0 { "OK" } else { "FAILED" }
        );
    }
    if !rows.is_empty() {
        let avg = rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64;
        println!("# Avg bus bandwidth    : {avg:.3} GB/s");
    }
}

/// Buffer capacity for the largest message, so no row is chunked and
/// two-stage is never replaced by one-stage for lack of scratch.
fn config(args: &BenchArgs, max_size: usize) -> Config {
    Config {
        max_bytes: max_size
            .next_multiple_of(4096)
            .max(PACK_BYTES * p2p_allreduce::abi::MAX_RANKS),
        max_blocks: args.max_blocks,
        threads_per_block: args.threads,
        ..Config::default()
    }
}

/// One plot line per (requested algorithm, world), in row order.
fn series(rows: &[Row]) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for r in rows {
        let label = format!("{} N={}", r.requested, r.world);
        let point = (r.size as f64, r.time_us);
        match out.iter_mut().find(|s| s.label == label) {
            Some(s) => s.points.push(point),
            None => out.push(Series {
                label,
                points: vec![point],
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_step_like_nccl_tests() {
        assert_eq!(
            sizes(4096, 65536, 2, 2),
            vec![4096, 8192, 16384, 32768, 65536]
        );
        assert_eq!(sizes(4096, 65536, 4, 4), vec![4096, 16384, 65536]);
        // Sizes are whole elements; a size below one element becomes one element.
        assert_eq!(sizes(1, 8, 2, 4), vec![4, 8]);
        assert_eq!(sizes(6, 6, 2, 4), vec![4]);
        assert!(sizes(8192, 4096, 2, 2).is_empty());
        assert_eq!(sizes(4 << 10, 64 << 20, 2, 2).len(), 15);
    }

    #[test]
    fn default_args_match_the_cli_defaults() {
        use clap::Parser as _;
        let cli = crate::Cli::try_parse_from(["p2p-allreduce", "bench"]).expect("parses");
        let Some(crate::Command::Bench(b)) = cli.command else {
            panic!("not bench")
        };
        assert_eq!(b, BenchArgs::default());
    }

    #[test]
    fn series_group_by_algorithm_and_world() {
        let row = |size, world, requested| Row {
            size,
            count: size / 2,
            dtype: "bf16",
            world,
            requested,
            algorithm: "one_stage",
            time_us: 1.0,
            min_us: 1.0,
            max_us: 1.0,
            algbw_gbps: 0.0,
            busbw_gbps: 0.0,
            wrong: Some(0),
        };
        let rows = vec![
            row(4096, 2, "auto"),
            row(4096, 8, "auto"),
            row(8192, 2, "auto"),
            row(8192, 2, "one_stage"),
        ];
        let s = series(&rows);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].label, "auto N=2");
        assert_eq!(s[0].points, vec![(4096.0, 1.0), (8192.0, 1.0)]);
        let json = serde_json::to_string(&rows[0]).expect("json");
        assert!(
            json.contains("\"type\":\"bf16\"") && json.contains("\"wrong\":0"),
            "{json}"
        );
    }
}
