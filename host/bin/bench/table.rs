//! The console output of `bench`, in the layout of nccl-tests: the header
//! that says what runs and how it is timed, the column names, one line per
//! row, and the footer.

use super::{BenchArgs, Row};
use crate::fmt_bytes;
use cudarc::driver::CudaContext;
use p2p_allreduce::driver;
use p2p_allreduce::validate::algo_name;
use std::sync::Arc;

/// "GPU 0 NVIDIA H200 (cc 9.0, 132 SMs), SASS sm_90".
pub(super) fn describe(ctx: &Arc<CudaContext>) -> String {
    let dev = match driver::device_info(ctx) {
        Ok(i) => format!(
            "GPU {} {} (cc {}.{}, {} SMs)",
            i.ordinal, i.name, i.compute_capability.0, i.compute_capability.1, i.multiprocessors
        ),
        Err(e) => format!("GPU {} ({e})", ctx.ordinal()),
    };
    let image = match (
        driver::module_for_device(ctx),
        driver::compute_capability(ctx),
    ) {
        (Ok(m), Ok(cc)) => m.describe_on(cc),
        _ => "no kernels".to_string(),
    };
    format!("{dev}, {image}")
}

pub(super) fn header(devices: &str, mode: &str, args: &BenchArgs, sizes: &[usize]) {
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
    if args.algo.contains(&p2p_allreduce::AlgoChoice::Push) {
        println!(
            "# push rows up to {} (landing zones of 2 x world x that per rank)",
            fmt_bytes(super::PUSH_ROWS_MAX as u64)
        );
    }
    if args.algo.contains(&p2p_allreduce::AlgoChoice::PushLl) {
        println!(
            "# push_ll rows up to {} (landing zones of 4 x world x that per rank)",
            fmt_bytes(super::PUSH_LL_ROWS_MAX as u64)
        );
    }
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

pub(super) fn column_names() {
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

pub(super) fn print_row(r: &Row) {
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

pub(super) fn footer(rows: &[Row]) {
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

/// The line that says which NCCL the NCCL rows use.
#[cfg(feature = "nccl")]
pub(super) fn print_nccl_library() {
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
