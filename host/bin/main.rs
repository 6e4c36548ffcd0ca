//! The `p2p-allreduce` command.
//!
//! - `info`: the embedded PTX (per architecture: size, registers, spills),
//!   the driver, every GPU and the peer links between them.
//! - `check`: a bit-exact validation sweep against the CPU reference.
//! - `bench`: latency and bandwidth in the conventions of nccl-tests'
//!   `all_reduce_perf`.
//! - `tune`: measures every algorithm on this machine and writes the
//!   thresholds file `Auto` reads.
//! - `hostlink`: GPU reads vs writes of pinned host memory over the GPU's
//!   own PCIe link.
//! - `soak`: a million graph-replayed allreduces and a hundred thousand
//!   fused calls, checked, with memory, handles and time per call watched.
//!
//! Without a subcommand: `info`, then (when a GPU is present) a quick check
//! and a short benchmark.
//!
//! Exit codes: 0 success; 1 a check or benchmark found wrong results or
//! failed; 2 nothing could be run (no GPU, bad arguments).

mod bench;
mod check;
mod hostlink;
mod info;
mod load_times;
mod plot;
mod procs;
mod soak;
mod tune;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use p2p_allreduce::abi::Dtype;
use p2p_allreduce::{driver, validate, AlgoChoice};
use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    name = "p2p-allreduce",
    version,
    about = "Deterministic GPU allreduce kernels: build info, validation and benchmarks",
    long_about = "Deterministic GPU allreduce kernels: build info, validation and benchmarks.\n\n\
                  Without a subcommand: `info`, then, if a GPU is present, `check --quick` and a \
                  short `bench` (worlds 2,4,8, 4K..1M bytes, bf16)."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Crate version, embedded PTX (registers/spills per kernel), driver,
    /// GPUs and the peer-access matrix. Works without a GPU.
    Info(info::InfoArgs),
    /// Validation sweep (dtypes x worlds x lengths x algorithms), bit-exact
    /// against the CPU reference. Exit 1 on any mismatch, 2 if nothing ran.
    Check(check::CheckArgs),
    /// Latency/bandwidth sweep over message sizes, like nccl-tests'
    /// all_reduce_perf, on virtual ranks of one GPU or on real ranks
    /// (--gpus, --procs).
    Bench(bench::BenchArgs),
    /// Times every algorithm x size x world on this machine (real ranks
    /// with --gpus, else virtual ranks) and writes the thresholds file
    /// that Auto loads (P2P_ALLREDUCE_THRESHOLDS, else
    /// ~/.config/p2p-allreduce/thresholds.json).
    Tune(tune::TuneArgs),
    /// GPU reads vs writes of mapped pinned host memory (the GPU's own
    /// PCIe link): bandwidth by size and one-pack latency.
    Hostlink(hostlink::HostlinkArgs),
    /// Reliability soak: 10^6 graph-replayed allreduces (every algorithm,
    /// 4 KiB..8 MiB) and 10^5 fused calls on virtual ranks or rank
    /// processes (--procs --gpus 0,0), results checked against the CPU
    /// oracle, host RSS, device memory and handles required flat, time per
    /// call stable from the first pass to the last. Exit 1 on any failure.
    Soak(soak::SoakArgs),
}

fn main() -> ExitCode {
    // Rust ignores SIGPIPE, so printing into a closed pipe (`info | head`)
    // would panic; the default action ends the process quietly instead.
    #[cfg(unix)]
    // SAFETY: sets a signal disposition before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Info(a)) => info::run(&a),
        Some(Command::Check(a)) => check::run(&a),
        Some(Command::Bench(a)) => bench::run(&a),
        Some(Command::Tune(a)) => tune::run(&a),
        Some(Command::Hostlink(a)) => hostlink::run(&a),
        Some(Command::Soak(a)) => soak::run(&a),
        None => default_run(),
    }
}

/// `info`; then, with a GPU, a quick check and a short benchmark.
fn default_run() -> ExitCode {
    let code = info::run(&info::InfoArgs::default());
    if gpu_count() == 0 {
        return code;
    }
    println!();
    println!("== check --quick ==");
    let check = check::run(&check::CheckArgs {
        quick: true,
        ..check::CheckArgs::default()
    });
    println!();
    println!("== bench --world 2,4,8 -b 4K -e 1M -d bf16 ==");
    let bench = bench::run(&bench::BenchArgs {
        minbytes: 4 << 10,
        maxbytes: 1 << 20,
        world: vec![2, 4, 8],
        ..bench::BenchArgs::default()
    });
    if check != ExitCode::SUCCESS {
        return check;
    }
    bench
}

/// Number of GPUs, 0 without a driver.
fn gpu_count() -> usize {
    if !driver::driver_present() {
        return 0;
    }
    driver::device_count().unwrap_or(0)
}

/// Exit code when nothing could be run.
const NOTHING_RAN: u8 = 2;

/// Opens GPU `ordinal`, or says why not. `what` names the command.
fn open_gpu(what: &str, ordinal: usize) -> Result<Arc<cudarc::driver::CudaContext>, ExitCode> {
    let fail = |msg: String| {
        eprintln!("{what}: {msg}");
        Err(ExitCode::from(NOTHING_RAN))
    };
    if !driver::driver_present() {
        return fail(format!("nothing to do: {}", p2p_allreduce::Error::NoDriver));
    }
    match driver::device_count() {
        Ok(0) => return fail("nothing to do: the CUDA driver sees no GPU".into()),
        Ok(n) if ordinal >= n => {
            return fail(format!(
                "GPU {ordinal} does not exist ({n} GPU(s): 0..{})",
                n - 1
            ))
        }
        Ok(_) => {}
        Err(e) => return fail(e.to_string()),
    }
    let ctx = match driver::open_device(ordinal) {
        Ok(c) => c,
        Err(e) => return fail(format!("GPU {ordinal}: {e}")),
    };
    // Say it now rather than at the first group: no PTX for this GPU.
    if let Err(e) = driver::module_for_device(&ctx) {
        return fail(format!("GPU {ordinal}: {e}"));
    }
    Ok(ctx)
}

/// A progress bar on stderr, or a hidden one when stderr is not a terminal.
fn progress(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} {msg} ({elapsed})")
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    pb.set_style(style);
    pb.set_prefix(what.to_string());
    pb
}

/// "4.0 KiB", "64.0 MiB", "512 B".
fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Parses a byte count as nccl-tests does: `4096`, `4K`, `64M`, `1G` (powers
/// of 1024; `KB`, `KiB`, `B` suffixes are accepted too).
fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (num, mult) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 1usize << 10),
        Some('m') => (&body[..body.len() - 1], 1 << 20),
        Some('g') => (&body[..body.len() - 1], 1 << 30),
        Some('t') => (&body[..body.len() - 1], 1 << 40),
        _ => (body, 1),
    };
    let num = num.trim();
    if let Ok(n) = num.parse::<usize>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| format!("`{t}` is too large"));
    }
    match num.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 && x * (mult as f64) < usize::MAX as f64 => {
            Ok((x * mult as f64) as usize)
        }
        _ => Err(format!(
            "`{t}` is not a size: use bytes, or a number with K, M or G (e.g. 4K, 64M)"
        )),
    }
}

fn parse_dtype_arg(s: &str) -> Result<Dtype, String> {
    validate::parse_dtype(s).ok_or_else(|| format!("`{s}` is not a dtype: use f32, f16 or bf16"))
}

fn parse_algo_arg(s: &str) -> Result<AlgoChoice, String> {
    validate::parse_algo(s).ok_or_else(|| {
        format!("`{s}` is not an algorithm: use one_stage, two_stage, push, push_ll or auto")
    })
}

fn parse_world_arg(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=p2p_allreduce::abi::MAX_RANKS).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a world size: use 1..={}",
            p2p_allreduce::abi::MAX_RANKS
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sizes_parse_like_nccl_tests() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2KiB"), Ok(2048));
        assert_eq!(parse_size("512B"), Ok(512));
        assert_eq!(parse_size("1.5K"), Ok(1536));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1K").is_err());
    }

    #[test]
    fn bytes_format() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(4096), "4.0 KiB");
        assert_eq!(fmt_bytes(143_771 << 20), "140.4 GiB");
    }

    #[test]
    fn bench_defaults_follow_nccl_tests() {
        let cli = Cli::try_parse_from(["p2p-allreduce", "bench"]).expect("parses");
        let Some(Command::Bench(b)) = cli.command else {
            panic!("not bench")
        };
        assert_eq!(
            (b.minbytes, b.maxbytes, b.stepfactor),
            (4 << 10, 64 << 20, 2)
        );
        assert_eq!((b.iters, b.warmup_iters), (25, 3));
        assert_eq!(b.datatype, Dtype::Bf16);
        assert_eq!(b.world, vec![8]);
        assert_eq!(b.algo.len(), 7);
        assert_eq!(b, bench::BenchArgs::default(), "clap defaults = Default");
        let cli = Cli::try_parse_from([
            "p2p-allreduce",
            "bench",
            "-b",
            "8K",
            "-e",
            "1M",
            "-f",
            "4",
            "-d",
            "f16",
            "-n",
            "5",
            "-w",
            "1",
            "--world",
            "2,4",
            "--algo",
            "auto",
        ])
        .expect("parses");
        let Some(Command::Bench(b)) = cli.command else {
            panic!("not bench")
        };
        assert_eq!(
            (b.minbytes, b.maxbytes, b.stepfactor),
            (8 << 10, 1 << 20, 4)
        );
        assert_eq!((b.iters, b.warmup_iters), (5, 1));
        assert_eq!(b.datatype, Dtype::F16);
        assert_eq!(b.world, vec![2, 4]);
        assert_eq!(b.algo, vec![AlgoChoice::Auto]);
        assert!(Cli::try_parse_from(["p2p-allreduce", "bench", "--world", "9"]).is_err());
        assert!(Cli::try_parse_from(["p2p-allreduce", "bench", "-d", "int8"]).is_err());
    }

    #[test]
    fn soak_defaults_and_lists_parse() {
        let cli = Cli::try_parse_from(["p2p-allreduce", "soak"]).expect("parses");
        let Some(Command::Soak(s)) = cli.command else {
            panic!("not soak")
        };
        assert_eq!(s, soak::SoakArgs::default(), "clap defaults = Default");
        assert_eq!((s.allreduces, s.fused), (1_000_000, 100_000));
        let cli = Cli::try_parse_from([
            "p2p-allreduce",
            "soak",
            "--procs",
            "--gpus",
            "0,0",
            "--budget",
            "60",
            "-e",
            "1M",
            "--json",
            "-",
        ])
        .expect("parses");
        let Some(Command::Soak(s)) = cli.command else {
            panic!("not soak")
        };
        assert!(s.procs);
        assert_eq!(s.gpus, vec![0, 0]);
        assert_eq!((s.budget, s.maxbytes), (60.0, 1 << 20));
        assert!(Cli::try_parse_from(["p2p-allreduce", "soak", "--passes", "1"]).is_err());
    }

    #[test]
    fn check_lists_parse() {
        let cli = Cli::try_parse_from([
            "p2p-allreduce",
            "check",
            "--gpus",
            "0,1",
            "--world",
            "2",
            "--quick",
        ])
        .expect("parses");
        let Some(Command::Check(c)) = cli.command else {
            panic!("not check")
        };
        assert_eq!(c.gpus, vec![0, 1]);
        assert_eq!(c.world, vec![2]);
        assert!(c.quick);
        let cli = Cli::try_parse_from(["p2p-allreduce", "check", "--world", "2", "4", "8"])
            .expect("space-separated worlds");
        let Some(Command::Check(c)) = cli.command else {
            panic!("not check")
        };
        assert_eq!(c.world, vec![2, 4, 8]);
    }
}
