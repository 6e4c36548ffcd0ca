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
//!
//! This module runs the command: the sweep over sizes and rows (on a
//! [`Runner`], one per way of running the ranks) and the report. `args`
//! holds the arguments, `table` prints the table, and `virtual_ranks`,
//! `peer` and `proc_ranks` are the three ways of running the ranks.

mod args;
mod fused;
mod peer;
mod proc_ranks;
mod table;
mod virtual_ranks;

use crate::plot::{self, Series};
use crate::procs::{self, RankEnv};
use crate::{fmt_bytes, progress, NOTHING_RAN};
pub use args::BenchArgs;
use p2p_allreduce::abi::PACK_BYTES;
use p2p_allreduce::measure::{self, Sample, Timing};
use p2p_allreduce::validate::{self, algo_name, Mismatch};
use p2p_allreduce::{AlgoChoice, Config, Result};
use peer::run_peer;
use proc_ranks::run_rank;
use serde::Serialize;
use std::process::ExitCode;
use table::{footer, print_row};
use virtual_ranks::run_virtual;

/// Seed of the benchmark data (any value; fixed so runs are comparable).
const FILL_SEED: u64 = 0x6265_6e63_6821;

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
    if let Some(msg) = args.unused_options() {
        return usage_error(&msg);
    }
    if args.fused {
        if args.hidden == 0 || args.hidden > p2p_allreduce::abi::NORM_MAX_HIDDEN {
            return usage_error(&format!(
                "--hidden must be in 1..={}",
                p2p_allreduce::abi::NORM_MAX_HIDDEN
            ));
        }
        return fused::run_fused(args, args.hidden);
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

/// The rows of `args` (real ranks with two or more `--gpus`, else virtual
/// ranks), for `tune`: an error if a row was wrong or nothing could run.
pub fn measure(args: &BenchArgs) -> Result<Vec<Row>, ExitCode> {
    let sizes = sizes(
        args.minbytes,
        args.maxbytes,
        args.stepfactor,
        args.datatype.size(),
    );
    if sizes.is_empty() {
        return Err(usage_error("no message size in the range"));
    }
    if let Err(e) = config(args, sizes[sizes.len() - 1]).validate() {
        return Err(usage_error(&e));
    }
    let (rows, failures, _) = if args.gpus.len() >= 2 {
        run_peer(args, &sizes)?
    } else {
        run_virtual(args, &sizes)?
    };
    if failures > 0 {
        eprintln!("{failures} row(s) failed or gave wrong results: nothing tuned");
        return Err(ExitCode::FAILURE);
    }
    Ok(rows)
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
        .filter(|r| r.requested != NCCL && ![NCCL, NCCL_SYMMETRIC].contains(&r.algorithm))
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

/// The name of the NCCL rows (as thresholds files name the backend).
pub const NCCL: &str = "nccl";
/// The name of the rows of NCCL on symmetric windows (NCCL >= 2.27).
pub const NCCL_SYMMETRIC: &str = "nccl_symmetric";
/// The name of the rows of `Auto` with NCCL: each size to whoever the
/// group's table gives it (ours, NCCL, NCCL on symmetric windows).
pub const AUTO_NCCL: &str = "auto+nccl";

/// What one row runs: one of our algorithms, NCCL (plain or on symmetric
/// windows), or Auto routing between them by the table.
#[derive(Clone, Copy, Debug, PartialEq)]
enum What {
    Kernel(AlgoChoice),
    Nccl,
    NcclSymmetric,
    AutoNccl,
}

impl What {
    fn name(self) -> &'static str {
        match self {
            What::Kernel(a) => algo_name(a),
            What::Nccl => NCCL,
            What::NcclSymmetric => NCCL_SYMMETRIC,
            What::AutoNccl => AUTO_NCCL,
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
            let too_large = match what {
                What::Kernel(AlgoChoice::Push) => size > PUSH_ROWS_MAX,
                What::Kernel(AlgoChoice::PushLl) => size > PUSH_LL_ROWS_MAX,
                _ => false,
            };
            if too_large {
                pb.inc(1);
                continue;
            }
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

/// Largest message of the push rows: push is the small-message algorithm,
/// and its landing zones take `2 * world` times this per rank.
pub(crate) const PUSH_ROWS_MAX: usize = 4 << 20;
/// Largest message of the push_ll rows (its landing zones take
/// `4 * world` times this per rank).
pub(crate) const PUSH_LL_ROWS_MAX: usize = 1 << 20;

/// Buffer capacity for the largest message, so no row is chunked and
/// two-stage is never replaced by one-stage for lack of scratch; landing
/// zones for push rows up to [`PUSH_ROWS_MAX`] (push_ll: [`PUSH_LL_ROWS_MAX`];
/// push_two_stage: every row).
fn config(args: &BenchArgs, max_size: usize) -> Config {
    Config {
        max_bytes: max_size
            .next_multiple_of(4096)
            .max(PACK_BYTES * p2p_allreduce::abi::MAX_RANKS),
        max_blocks: args.max_blocks,
        threads_per_block: args.threads,
        push_max_bytes: max_size.clamp(4096, PUSH_ROWS_MAX).next_multiple_of(4096),
        push_ll_max_bytes: max_size
            .clamp(4096, PUSH_LL_ROWS_MAX)
            .next_multiple_of(4096),
        // Every size: push_two_stage is a large-message algorithm (its zone
        // takes about 2 x the message per rank).
        push_two_stage_max_bytes: max_size.max(4096).next_multiple_of(4096),
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
    fn options_a_mode_does_not_take_are_refused() {
        use clap::Parser as _;
        let bench = |argv: &[&str]| {
            let cli = crate::Cli::try_parse_from(["p2p-allreduce", "bench"].iter().chain(argv))
                .expect("parses");
            let Some(crate::Command::Bench(b)) = cli.command else {
                panic!("not bench")
            };
            b
        };
        for ok in [
            &[][..],
            &["--fused"],
            &[
                "--fused",
                "--gpus",
                "0,1",
                "--fused-ctas",
                "1,8",
                "--max-blocks",
                "64",
            ],
            &["--fused", "--hidden", "4096", "--json", "f.json", "-n", "5"],
            &[
                "-b", "1M", "-d", "f32", "--algo", "push_ll", "--plot", "p.svg",
            ],
            // A default value given explicitly changes nothing.
            &["--fused", "-d", "bf16"],
            &["--groups", "4", "--world", "2,8"],
            &["--gpus", "0,1", "--groups", "1"],
        ] {
            assert_eq!(bench(ok).unused_options(), None, "{ok:?}");
        }
        for (bad, names) in [
            (&["--fused", "-d", "f32"][..], &["-d/--datatype"][..]),
            (
                &["--fused", "-b", "1M", "--algo", "push_ll", "--procs"],
                &["-b/--minbytes", "--algo", "--procs"],
            ),
            (
                &["--fused", "--plot", "p.svg", "--no-check"],
                &["--plot", "--no-check"],
            ),
            (&["--fused-ctas", "8"], &["--fused-ctas"]),
            (&["--hidden", "4096", "--world", "2"], &["--hidden"]),
            (&["--groups", "3", "--gpus", "0,1"], &["--groups"]),
            (&["--groups", "3", "--procs"], &["--groups"]),
            (&["--groups", "2", "--fused"], &["--groups"]),
        ] {
            let msg = bench(bad).unused_options().expect("refused");
            for n in names {
                assert!(msg.contains(n), "{bad:?}: {msg}");
            }
        }
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
