//! `p2p-allreduce check`: a bit-exact validation sweep.

use crate::procs::{self, RankEnv};
use crate::{open_gpu, parse_algo_arg, parse_dtype_arg, parse_world_arg, progress, NOTHING_RAN};
use cudarc::driver::{CudaContext, CudaStream};
use indicatif::ProgressBar;
use p2p_allreduce::abi::{Dtype, MAX_RANKS};
use p2p_allreduce::validate::{self, Case, Outcome};
use p2p_allreduce::{AlgoChoice, Config, Error, Exchange as _, PeerGroup, VirtualGroup};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct CheckArgs {
    /// GPUs to use, e.g. `0,1,2,3`. One GPU (or none given: GPU 0): virtual
    /// ranks on it. Several: one real rank per listed GPU (a PeerGroup; world
    /// w uses the first w). A GPU may repeat (`0,0`) to run the real-rank
    /// kernels with several ranks on one GPU.
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<usize>,
    /// World sizes, e.g. `2,4,8` or `2 4 8`. Default: 1..8 with virtual
    /// ranks (quick: 2,3,8); 2..number of listed GPUs with real ranks.
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = parse_world_arg)]
    pub world: Vec<usize>,
    /// A short sweep: fewer lengths (and worlds, unless given).
    #[arg(long)]
    pub quick: bool,
    /// Element types [default: f32,f16,bf16].
    #[arg(long, value_delimiter = ',', value_parser = parse_dtype_arg)]
    pub dtype: Vec<Dtype>,
    /// Algorithms [default: one_stage,two_stage,push,push_ll,push_two_stage,push_islands,auto].
    #[arg(long, value_delimiter = ',', value_parser = parse_algo_arg)]
    pub algo: Vec<AlgoChoice>,
    /// Print every case, not only failures.
    #[arg(long, short)]
    pub verbose: bool,
    /// One process per GPU (the GPUs of `--gpus`, else every GPU), as
    /// serving engines run: a ProcessGroup over CUDA IPC; world = number of
    /// processes.
    #[arg(long)]
    pub procs: bool,
}

/// Tally of a sweep.
#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
    skipped: usize,
}

pub fn run(args: &CheckArgs) -> ExitCode {
    if args.procs {
        return match RankEnv::get() {
            Some(env) => run_rank(args, &env),
            None => {
                let gpus = procs::gpus_or_all(&args.gpus);
                if gpus.is_empty() {
                    eprintln!("check: nothing to do: no GPU found for --procs");
                    return ExitCode::from(NOTHING_RAN);
                }
                procs::run_ranks("check", &gpus, PROCS_DEADLINE)
            }
        };
    }
    let (dtypes, algos, lengths) = selection(args);
    let real_ranks = args.gpus.len() >= 2;
    let worlds: Vec<usize> = if !args.world.is_empty() {
        args.world.clone()
    } else if real_ranks {
        (2..=args.gpus.len().min(MAX_RANKS)).collect()
    } else if args.quick {
        vec![2, 3, 8]
    } else {
        (1..=MAX_RANKS).collect()
    };

    let mut tally = Tally::default();
    if real_ranks {
        let mut ctxs: Vec<Arc<CudaContext>> = Vec::new();
        for &g in &args.gpus {
            // A repeated GPU shares one context (ranks on one device).
            if let Some(c) = ctxs.iter().find(|c| c.ordinal() == g) {
                ctxs.push(c.clone());
                continue;
            }
            match open_gpu("check", g) {
                Ok(c) => ctxs.push(c),
                Err(code) => return code,
            }
        }
        println!(
            "check: real ranks (PeerGroup, one process) on GPUs {:?}; worlds {worlds:?}; {} lengths; staged and registered inputs",
            args.gpus,
            lengths.len()
        );
        sweep_peer(&ctxs, &worlds, &dtypes, &algos, lengths, args, &mut tally);
    } else {
        let ordinal = args.gpus.first().copied().unwrap_or(0);
        let ctx = match open_gpu("check", ordinal) {
            Ok(c) => c,
            Err(code) => return code,
        };
        println!(
            "check: virtual ranks (VirtualGroup) on GPU {ordinal}; worlds {worlds:?}; {} lengths; staged and registered inputs",
            lengths.len()
        );
        sweep_virtual(&ctx, &worlds, &dtypes, &algos, lengths, args, &mut tally);
    }
    tally.finish("check")
}

/// How long a `--procs` check may run before its ranks are killed.
const PROCS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(900);

/// The dtypes, algorithms and lengths the arguments select.
fn selection(args: &CheckArgs) -> (Vec<Dtype>, Vec<AlgoChoice>, &'static [usize]) {
    let dtypes = if args.dtype.is_empty() {
        Dtype::ALL.to_vec()
    } else {
        args.dtype.clone()
    };
    let algos = if args.algo.is_empty() {
        vec![
            AlgoChoice::OneStage,
            AlgoChoice::TwoStage,
            AlgoChoice::Push,
            AlgoChoice::PushLl,
            AlgoChoice::PushTwoStage,
            AlgoChoice::PushIslands,
            AlgoChoice::Auto,
        ]
    } else {
        args.algo.clone()
    };
    let lengths = if args.quick {
        validate::QUICK_LENGTHS
    } else {
        validate::LENGTHS
    };
    (dtypes, algos, lengths)
}

impl Tally {
    /// Prints the summary line (`what: N passed, M failed[, K skipped]`)
    /// and turns the tally into the exit code.
    fn finish(&self, what: &str) -> ExitCode {
        if self.skipped > 0 {
            println!(
                "{what}: {} passed, {} failed, {} skipped",
                self.passed, self.failed, self.skipped
            );
        } else {
            println!("{what}: {} passed, {} failed", self.passed, self.failed);
        }
        if self.failed > 0 {
            ExitCode::FAILURE
        } else if self.passed == 0 {
            ExitCode::from(NOTHING_RAN)
        } else {
            ExitCode::SUCCESS
        }
    }
}

/// One rank of `check --procs`: forms the ProcessGroup with the other rank
/// processes and runs the sweep for world = number of processes. After a
/// failed case every rank resets and meets the others before the next one.
fn run_rank(args: &CheckArgs, env: &RankEnv) -> ExitCode {
    let (dtypes, algos, lengths) = selection(args);
    let procs::Joined {
        stream,
        exchange: ex,
        group,
        ..
    } = match procs::join("check", env, config_for(lengths, None), false) {
        Ok(j) => j,
        Err(code) => return code,
    };
    if env.rank == 0 {
        println!(
            "check: one process per GPU (ProcessGroup over CUDA IPC), world {}, link {:?}; {} lengths; staged inputs",
            env.world,
            group.link(),
            lengths.len()
        );
        if !args.world.is_empty() && args.world != [env.world] {
            println!(
                "check: note: --world is ignored with --procs (world = number of processes = {})",
                env.world
            );
        }
    }
    let cases = validate::sweep(&dtypes, &[env.world], lengths, &algos, false, false);
    let pb = progress(cases.len() as u64, "check");
    let mut tally = Tally::default();
    let before = (0, 0);
    for case in &cases {
        pb.set_message(format!("{case}"));
        let r = validate::run_process(&group, &ex, &stream, case);
        let failed_case = r.is_err();
        record(&pb, &mut tally, case, r, args.verbose);
        if failed_case {
            // Every rank saw this case fail (the status exchange in
            // run_process): all reset, then meet before the next case.
            if let Err(e) = group
                .reset()
                .and_then(|()| ex.all_gather(b"reset").map(|_| ()))
            {
                pb.suspend(|| println!("  rank {}: reset failed: {e}", env.rank));
                break;
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    summary_line(
        &pb,
        &format!(
            "rank {} of {} processes, {:?}",
            env.rank,
            env.world,
            group.link()
        ),
        env.world,
        before,
        &tally,
        cases.len(),
    );
    tally.finish(&format!("check (rank {})", env.rank))
}

/// Records one case's result; prints failures (and everything with -v).
fn record(
    pb: &ProgressBar,
    tally: &mut Tally,
    case: &Case,
    r: Result<Outcome, Error>,
    verbose: bool,
) {
    match r {
        Ok(o) if o.passed() => {
            tally.passed += 1;
            if verbose {
                pb.suspend(|| println!("  ok      {case} (ran {})", o.used.name()));
            }
        }
        Ok(o) => {
            tally.failed += 1;
            let first = o.first.map(|m| m.to_string()).unwrap_or_default();
            pb.suspend(|| {
                println!(
                    "  FAILED  {case} (ran {}): {} wrong elements; first: {first}",
                    o.used.name(),
                    o.wrong
                )
            });
        }
        Err(e) => {
            tally.failed += 1;
            pb.suspend(|| println!("  FAILED  {case}: {e}"));
        }
    }
}

fn sweep_virtual(
    ctx: &Arc<CudaContext>,
    worlds: &[usize],
    dtypes: &[Dtype],
    algos: &[AlgoChoice],
    lengths: &[usize],
    args: &CheckArgs,
    tally: &mut Tally,
) {
    let cases = validate::sweep(dtypes, worlds, lengths, algos, true, false);
    let pb = progress(cases.len() as u64, "check");
    let stream = match ctx.new_stream() {
        Ok(s) => s,
        Err(e) => {
            println!("  cannot create a stream: {e}");
            tally.failed += cases.len();
            return;
        }
    };
    for &world in worlds {
        let before = (tally.passed, tally.failed);
        let world_cases: Vec<&Case> = cases.iter().filter(|c| c.world == world).collect();
        let g = match VirtualGroup::new(ctx, world, config_for(lengths, None)) {
            Ok(g) => g,
            Err(e) => {
                skip_world(&pb, tally, world, &world_cases, "create the group", &e);
                continue;
            }
        };
        run_cases(
            &pb,
            tally,
            world,
            &world_cases,
            args.verbose,
            |case| validate::run_virtual(&g, &stream, case),
            || g.reset(),
        );
        summary_line(&pb, "virtual", world, before, tally, world_cases.len());
    }
    pb.finish_and_clear();
}

fn sweep_peer(
    ctxs: &[Arc<CudaContext>],
    worlds: &[usize],
    dtypes: &[Dtype],
    algos: &[AlgoChoice],
    lengths: &[usize],
    args: &CheckArgs,
    tally: &mut Tally,
) {
    let cases = validate::sweep(dtypes, worlds, lengths, algos, true, false);
    let pb = progress(cases.len() as u64, "check");
    for &world in worlds {
        let before = (tally.passed, tally.failed);
        let world_cases: Vec<&Case> = cases.iter().filter(|c| c.world == world).collect();
        if world > ctxs.len() {
            pb.suspend(|| {
                println!(
                    "  world {world}: skipped: only {} GPU(s) listed in --gpus",
                    ctxs.len()
                )
            });
            tally.skipped += world_cases.len();
            pb.inc(world_cases.len() as u64);
            continue;
        }
        let ranks = &ctxs[..world];
        // Ranks sharing a GPU must all be resident at once: fewer blocks each.
        let shared =
            (1..world).any(|i| ranks[..i].iter().any(|c| c.ordinal() == ranks[i].ordinal()));
        let group = match PeerGroup::new(ranks, config_for(lengths, shared.then_some(4))) {
            Ok(g) => g,
            Err(e @ Error::NoPeerAccess { .. }) => {
                pb.suspend(|| println!("  world {world}: skipped: {e}"));
                tally.skipped += world_cases.len();
                pb.inc(world_cases.len() as u64);
                continue;
            }
            Err(e) => {
                skip_world(&pb, tally, world, &world_cases, "create the group", &e);
                continue;
            }
        };
        let streams: Result<Vec<Arc<CudaStream>>, _> =
            ranks.iter().map(|c| c.new_stream()).collect();
        let streams = match streams {
            Ok(s) => s,
            Err(e) => {
                skip_world(&pb, tally, world, &world_cases, "create streams", &e);
                continue;
            }
        };
        run_cases(
            &pb,
            tally,
            world,
            &world_cases,
            args.verbose,
            |case| validate::run_peer(&group, &streams, case),
            || group.reset(),
        );
        let link = format!("real ranks, {:?}", group.link());
        summary_line(&pb, &link, world, before, tally, world_cases.len());
    }
    pb.finish_and_clear();
}

/// Buffers big enough for the longest case of the sweep without chunking
/// (chunking has its own cases in the GPU test suite).
/// Counts every case of a world that cannot be set up as failed.
fn skip_world(
    pb: &ProgressBar,
    tally: &mut Tally,
    world: usize,
    cases: &[&Case],
    what: &str,
    e: &dyn std::fmt::Display,
) {
    pb.suspend(|| println!("  world {world}: cannot {what}: {e}"));
    tally.failed += cases.len();
    pb.inc(cases.len() as u64);
}

/// Runs and records the cases of one world; a kernel error poisons the
/// group, so it is reset before the next case.
fn run_cases(
    pb: &ProgressBar,
    tally: &mut Tally,
    world: usize,
    cases: &[&Case],
    verbose: bool,
    mut run: impl FnMut(&Case) -> Result<Outcome, Error>,
    reset: impl Fn() -> Result<(), Error>,
) {
    for case in cases.iter().copied() {
        pb.set_message(format!("{case}"));
        let r = run(case);
        let kernel_error = r.is_err();
        record(pb, tally, case, r, verbose);
        if kernel_error {
            if let Err(e) = reset() {
                pb.suspend(|| println!("  world {world}: reset failed: {e}"));
            }
        }
        pb.inc(1);
    }
}

fn config_for(lengths: &[usize], max_blocks: Option<u32>) -> Config {
    let longest = lengths.iter().copied().max().unwrap_or(0) * 4;
    Config {
        max_bytes: longest.next_multiple_of(1 << 20).max(1 << 20),
        // Registered push cases up to the longest length fit the landing zones.
        push_max_bytes: longest.next_multiple_of(1 << 20).max(1 << 20),
        push_ll_max_bytes: longest.next_multiple_of(1 << 20).max(1 << 20),
        push_two_stage_max_bytes: longest.next_multiple_of(1 << 20).max(1 << 20),
        max_blocks,
        ..Config::default()
    }
}

fn summary_line(
    pb: &ProgressBar,
    what: &str,
    world: usize,
    before: (usize, usize),
    tally: &Tally,
    cases: usize,
) {
    let passed = tally.passed - before.0;
    let failed = tally.failed - before.1;
    pb.suspend(|| {
        println!(
            "  {what}, world {world}: {passed}/{cases} bit-exact{}",
            if failed > 0 {
                format!(", {failed} FAILED")
            } else {
                String::new()
            }
        )
    });
}
