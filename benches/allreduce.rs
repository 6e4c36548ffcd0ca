//! GPU benchmark of the kernels (virtual ranks on one GPU), in the shape of
//! the kernels issue: bf16, one launch per allreduce with all N ranks in it,
//! at most 16 blocks of 512 threads per rank, registered inputs, median over
//! CUDA-graph replays of 20 back-to-back allreduces, timed by CUDA events.
//!
//! `cargo bench --bench allreduce` prints a markdown table (and writes it to
//! `$BENCH_OUT` if set). Without a GPU it prints why it skipped.

use p2p_allreduce::abi::Algorithm;
use p2p_allreduce::measure::{time_registered, Timing};
use p2p_allreduce::{driver, AlgoChoice, Config, VirtualGroup};
use std::fmt::Write as _;

const SIZES: &[(usize, &str)] = &[
    (4 << 10, "4 KiB"),
    (32 << 10, "32 KiB"),
    (256 << 10, "256 KiB"),
    (1 << 20, "1 MiB"),
    (8 << 20, "8 MiB"),
    (64 << 20, "64 MiB"),
];
const WORLDS: &[usize] = &[2, 4, 8];
/// Reference CUDA C++ (vLLM/SGLang family) times on the same setup, us,
/// from the kernels issue: [size][one-stage N=2,4,8, two-stage N=2,4,8].
const REFERENCE_US: [[f64; 6]; 6] = [
    [3.05, 3.06, 3.38, 4.16, 4.69, 5.59],
    [3.16, 3.57, 4.18, 4.50, 5.38, 6.37],
    [3.88, 4.69, 7.55, 5.06, 5.94, 8.33],
    [5.64, 6.80, 13.09, 7.54, 7.53, 9.35],
    [26.5, 50.1, 70.1, 37.6, 44.9, 52.8],
    [297.0, 355.0, 508.0, 379.0, 310.0, 347.0],
];
const PER_GRAPH: usize = 20;
const WARMUP: usize = 3;
const REPLAYS: usize = 25;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if !driver::driver_present() || driver::device_count().unwrap_or(0) == 0 {
        println!("allreduce bench: skipped: no CUDA driver or GPU on this machine");
        return;
    }
    let ctx = driver::open_device(0).expect("open device 0");
    // SAFETY: one stream; no cross-stream slice use.
    unsafe { ctx.disable_event_tracking() };
    // Graph capture needs a stream other than the legacy default stream.
    let stream = ctx.new_stream().expect("stream");
    let info = driver::device_info(&ctx).expect("device info");
    let mut table = String::new();
    let _ = writeln!(
        table,
        "Device: {} (cc {}.{}, {} SMs), PTX {}. bf16, virtual ranks, registered inputs, <=16 blocks x 512 threads per rank, \
         median of {REPLAYS} graph replays of {PER_GRAPH} allreduces, us per allreduce (reference in parentheses).\n",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        driver::module_for_device(&ctx).map(|m| m.arch).unwrap_or("?")
    );
    table.push_str("| bytes | 1-stage N=2 | N=4 | N=8 | 2-stage N=2 | N=4 | N=8 |\n|---|---|---|---|---|---|---|\n");
    let mut results = vec![[0f64; 6]; SIZES.len()];
    for (wi, &world) in WORLDS.iter().enumerate() {
        let cfg = Config {
            max_bytes: 64 << 20,
            max_blocks: Some(16),
            threads_per_block: 512,
            ..Config::default()
        };
        let group = VirtualGroup::new(&ctx, world, cfg).expect("group");
        for (si, &(bytes, _)) in SIZES.iter().enumerate() {
            let len = bytes / 2;
            let data: Vec<half::bf16> = (0..len)
                .map(|i| half::bf16::from_f32(((i % 251) as f32) * 0.01 - 1.0))
                .collect();
            for (ai, algo) in Algorithm::ALL.into_iter().enumerate() {
                let timing = Timing {
                    per_graph: PER_GRAPH,
                    warmup: WARMUP,
                    replays: REPLAYS,
                };
                let s =
                    time_registered(&group, &stream, len, &data, AlgoChoice::from(algo), timing)
                        .expect("timing");
                assert_eq!(s.algorithm, algo);
                results[si][ai * 3 + wi] = s.median_us;
            }
        }
    }
    for (si, &(_, name)) in SIZES.iter().enumerate() {
        let _ = write!(table, "| {name} |");
        for c in 0..6 {
            let ours = results[si][c];
            let reference = REFERENCE_US[si][c];
            let mark = if ours <= reference { "" } else { " **slower**" };
            let _ = write!(table, " {ours:.2} ({reference}){mark} |");
        }
        table.push('\n');
    }
    println!("{table}");
    if let Ok(path) = std::env::var("BENCH_OUT") {
        std::fs::write(&path, &table).expect("write BENCH_OUT");
    }
}
