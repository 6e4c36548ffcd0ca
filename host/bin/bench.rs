//! `p2p-allreduce bench`: latency and bandwidth over message sizes, in the
//! conventions of nccl-tests' `all_reduce_perf` (-b/-e/-f/-d/-n/-w, size
//! and count columns, algbw and busbw).
//!
//! Timing is [`measure::time_registered`]: CUDA events around replays of a
//! CUDA graph of `--per-graph` back-to-back allreduces on registered inputs,
//! median over `-n` replays. `#wrong` comes from running the same registered
//! allreduce once more on the same group and data, into poisoned outputs,
//! and comparing every rank with the CPU reference.

use crate::plot::{self, Series};
use crate::{
    fmt_bytes, gpu_count, open_gpu, parse_algo_arg, parse_dtype_arg, parse_size, parse_world_arg,
    progress, NOTHING_RAN,
};
use cudarc::driver::{CudaContext, CudaStream};
use p2p_allreduce::abi::{Dtype, PACK_BYTES};
use p2p_allreduce::measure::{self, Timing};
use p2p_allreduce::validate::{self, algo_name, Bits};
use p2p_allreduce::{driver, AlgoChoice, Config, VirtualGroup};
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
    /// World sizes (virtual ranks on one GPU), e.g. `2,4,8`.
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
    /// GPU to run on.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
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
    let ctx = match open_gpu("bench", args.device) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // SAFETY: this command uses one stream, and every buffer is used on it
    // only: cudarc's cross-stream event tracking is not needed, and graph
    // capture (in measure::time_registered) must not record its events.
    unsafe { ctx.disable_event_tracking() };
    let stream = match ctx.new_stream() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench: cannot create a stream: {e}");
            return ExitCode::FAILURE;
        }
    };
    header(&ctx, args, &sizes);
    let result = match args.datatype {
        Dtype::F32 => sweep::<f32>(&ctx, &stream, args, &sizes),
        Dtype::F16 => sweep::<half::f16>(&ctx, &stream, args, &sizes),
        Dtype::Bf16 => sweep::<half::bf16>(&ctx, &stream, args, &sizes),
    };
    let (rows, failures) = result;
    footer(&rows);
    let mut code = if failures > 0 || rows.iter().any(|r| r.wrong.unwrap_or(0) > 0) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    };
    if let Some(path) = &args.json {
        match serde_json::to_string_pretty(&rows) {
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
        let title = format!(
            "p2p-allreduce {} allreduce latency, virtual ranks on one GPU",
            args.datatype.name()
        );
        match plot::latency_svg(path, &title, &series(&rows)) {
            Ok(()) => println!("# plot written to {}", path.display()),
            Err(e) => {
                eprintln!("bench: cannot plot to {}: {e}", path.display());
                code = ExitCode::FAILURE;
            }
        }
    }
    code
}

fn header(ctx: &Arc<CudaContext>, args: &BenchArgs, sizes: &[usize]) {
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
    println!("# p2p-allreduce bench: {dev}, PTX {ptx}");
    println!(
        "# virtual ranks on one GPU, registered inputs; time = median of {} replays of a CUDA graph of {} allreduces ({} warm-up replays)",
        args.iters, args.per_graph, args.warmup_iters
    );
    println!(
        "# {} x {} sizes ({}..{}, x{}), worlds {:?}, algorithms {}",
        args.datatype.name(),
        sizes.len(),
        fmt_bytes(sizes[0] as u64),
        fmt_bytes(sizes[sizes.len() - 1] as u64),
        args.stepfactor,
        args.world,
        args.algo
            .iter()
            .map(|&a| algo_name(a))
            .collect::<Vec<_>>()
            .join(",")
    );
    if args.no_check {
        println!("# #wrong: not checked (--no-check)");
    } else {
        println!("# #wrong: each row's allreduce (same group, data and algorithm) run once more into poisoned outputs, all ranks compared with the CPU reference bit for bit");
    }
    let gpus = gpu_count();
    if cfg!(feature = "nccl") && gpus >= 2 {
        println!("# NCCL comparison: not implemented yet in this command");
    } else {
        println!(
            "# NCCL comparison: needs several GPUs (found {gpus}) and the `nccl` cargo feature ({}): not run",
            if cfg!(feature = "nccl") { "on" } else { "off" }
        );
    }
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
fn config(max_size: usize) -> Config {
    Config {
        max_bytes: max_size
            .next_multiple_of(4096)
            .max(PACK_BYTES * p2p_allreduce::abi::MAX_RANKS),
        ..Config::default()
    }
}

/// Runs every row; returns them and the number of rows that failed to run.
fn sweep<T: Bits>(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    args: &BenchArgs,
    sizes: &[usize],
) -> (Vec<Row>, usize) {
    let dtype = T::DTYPE;
    let max_count = sizes[sizes.len() - 1] / dtype.size();
    let pb = progress(
        (sizes.len() * args.world.len() * args.algo.len()) as u64,
        "bench",
    );
    pb.set_message("preparing data");
    let fill_bits = validate::bench_fill(dtype, max_count, FILL_SEED);
    let fill: Vec<T> = validate::from_bits(&fill_bits);
    let mut groups: Vec<(usize, VirtualGroup)> = Vec::new();
    let mut failures = 0;
    for &w in &args.world {
        match VirtualGroup::new(ctx, w, config(sizes[sizes.len() - 1])) {
            Ok(g) => groups.push((w, g)),
            Err(e) => {
                pb.suspend(|| println!("# world {w}: cannot create the group: {e}"));
                failures += sizes.len() * args.algo.len();
                pb.inc((sizes.len() * args.algo.len()) as u64);
            }
        }
    }
    let timing = Timing {
        per_graph: args.per_graph,
        warmup: args.warmup_iters,
        replays: args.iters,
    };
    let mut rows = Vec::new();
    for &size in sizes {
        let count = size / dtype.size();
        for (world, group) in &groups {
            let want = if args.no_check {
                None
            } else {
                pb.set_message(format!(
                    "reference for {} x {world}",
                    fmt_bytes(size as u64)
                ));
                Some(validate::reference_for_fill(
                    dtype,
                    &fill_bits[..count],
                    *world,
                ))
            };
            for &algo in &args.algo {
                pb.set_message(format!(
                    "{} world {world} {}",
                    fmt_bytes(size as u64),
                    algo_name(algo)
                ));
                let sample =
                    match measure::time_registered(group, stream, count, &fill, algo, timing) {
                        Ok(s) => s,
                        Err(e) => {
                            pb.suspend(|| {
                                println!("# {size} B world {world} {}: error: {e}", algo_name(algo))
                            });
                            failures += 1;
                            if let Err(e) = group.reset() {
                                pb.suspend(|| println!("# world {world}: reset failed: {e}"));
                            }
                            pb.inc(1);
                            continue;
                        }
                    };
                let wrong = match &want {
                    None => None,
                    Some(want) => {
                        match validate::check_registered_fill(
                            group,
                            stream,
                            &fill[..count],
                            want,
                            algo,
                        ) {
                            Ok(o) => {
                                if let Some(m) = &o.first {
                                    pb.suspend(|| {
                                        println!(
                                            "# {size} B world {world} {}: {} wrong; first: {m}",
                                            algo_name(algo),
                                            o.wrong
                                        )
                                    });
                                }
                                if o.used != sample.algorithm {
                                    pb.suspend(|| {
                                        println!(
                                            "# note: the check ran {} but the timed graph ran {}",
                                            o.used.name(),
                                            sample.algorithm.name()
                                        )
                                    });
                                }
                                Some(o.wrong)
                            }
                            Err(e) => {
                                pb.suspend(|| {
                                    println!(
                                        "# {size} B world {world} {}: check failed: {e}",
                                        algo_name(algo)
                                    )
                                });
                                failures += 1;
                                if let Err(e) = group.reset() {
                                    pb.suspend(|| println!("# world {world}: reset failed: {e}"));
                                }
                                None
                            }
                        }
                    }
                };
                let (algbw, busbw) = measure::bandwidths(size, *world, sample.median_us);
                let row = Row {
                    size,
                    count,
                    dtype: dtype.name(),
                    world: *world,
                    requested: algo_name(algo),
                    algorithm: sample.algorithm.name(),
                    time_us: sample.median_us,
                    min_us: sample.min_us,
                    max_us: sample.max_us,
                    algbw_gbps: algbw,
                    busbw_gbps: busbw,
                    wrong,
                };
                pb.suspend(|| print_row(&row));
                rows.push(row);
                pb.inc(1);
            }
        }
    }
    pb.finish_and_clear();
    (rows, failures)
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
