//! `p2p-allreduce hostlink`: how fast this GPU reads and writes pinned host
//! memory over its own PCIe link, with the kernels' own loads and stores.
//!
//! No machine here has a PCIe peer-to-peer pair, but every GPU has a PCIe
//! link to host memory: GPU reads of mapped host memory are non-posted
//! round trips, GPU writes are posted, the same asymmetry that decides
//! between pull and push algorithms on a PCIe box. The copy is the
//! one-stage kernel for one rank (16-byte loads and stores, grid-stride,
//! as many blocks as the size gives, up to 64), launched through the
//! kernel-provider interface on a mapped host buffer; times are medians of
//! CUDA-event timings over CUDA-graph replays.

use crate::{fmt_bytes, open_gpu, parse_size, NOTHING_RAN};
use p2p_allreduce::abi::{Algorithm, Dtype, LaunchArgs, RankTable, Signal};
use p2p_allreduce::driver::{DeviceAlloc, HostMapped, Kernels};
use p2p_allreduce::error::Context as _;
use p2p_allreduce::measure::{self, Timing};
use p2p_allreduce::plan::blocks_for;
use p2p_allreduce::ptx::{Entry, ImageChoice};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug, Clone)]
pub struct HostlinkArgs {
    /// The GPU.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Smallest transfer in bytes (16: one pack, for the latency).
    #[arg(short = 'b', long = "minbytes", default_value = "16", value_parser = parse_size)]
    pub minbytes: usize,
    /// Largest transfer in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    pub maxbytes: usize,
    /// Size factor from one row to the next.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    pub stepfactor: usize,
    /// Timed graph replays per row.
    #[arg(short = 'n', long = "iters", default_value_t = 25)]
    pub iters: usize,
    /// Threads per block.
    #[arg(long, default_value_t = 512)]
    pub threads: u32,
    /// Write the rows as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Where a copy reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    /// GPU loads from host memory into device memory (non-posted reads).
    HostRead,
    /// GPU stores from device memory into host memory (posted writes).
    HostWrite,
    /// Device memory to device memory: the baseline.
    Device,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::HostRead => "gpu reads host",
            Direction::HostWrite => "gpu writes host",
            Direction::Device => "device to device",
        }
    }
}

#[derive(serde::Serialize)]
struct HostRow {
    bytes: usize,
    direction: &'static str,
    blocks: u32,
    time_us: f64,
    gbps: f64,
}

fn fail(msg: String) -> ExitCode {
    eprintln!("hostlink: {msg}");
    ExitCode::FAILURE
}

pub fn run(args: &HostlinkArgs) -> ExitCode {
    if args.stepfactor < 2 || args.minbytes < 16 || args.minbytes > args.maxbytes {
        eprintln!("hostlink: use -b >= 16, -e >= -b, -f >= 2");
        return ExitCode::from(NOTHING_RAN);
    }
    let ctx = match open_gpu("hostlink", args.device) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match measure_all(&ctx, args) {
        Ok(rows) => {
            if let Some(path) = &args.json {
                let text = serde_json::to_string_pretty(&rows).unwrap_or_default();
                if let Err(e) = std::fs::write(path, text + "\n") {
                    return fail(format!("cannot write {}: {e}", path.display()));
                }
                println!("# rows written to {}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => fail(e.to_string()),
    }
}

fn measure_all(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    args: &HostlinkArgs,
) -> p2p_allreduce::Result<Vec<HostRow>> {
    let stream = ctx.new_stream().during("cuStreamCreate")?;
    let kernels = Kernels::for_context(ctx, ImageChoice::Auto)?;
    let max = args.maxbytes.next_multiple_of(16);
    let host = HostMapped::new(ctx, max)?;
    let dev_a = DeviceAlloc::zeroed(ctx, max)?;
    let dev_b = DeviceAlloc::zeroed(ctx, max)?;
    let signal = DeviceAlloc::zeroed(ctx, std::mem::size_of::<Signal>())?;
    let entry = Entry {
        op: p2p_allreduce::ptx::Op::Allreduce,
        algorithm: Algorithm::OneStage,
        dtype: Dtype::F32,
        world: 1,
        virtual_ranks: false,
    };
    println!(
        "# hostlink: GPU {} ({}), mapped pinned host memory, copies by the one-stage kernel \
         for one rank, {} threads per block, medians of {} CUDA-graph replays of 20 copies",
        args.device,
        p2p_allreduce::driver::device_info(ctx)?.name,
        args.threads,
        args.iters
    );
    println!(
        "{:>12} {:>18} {:>7} {:>10} {:>9}",
        "bytes", "direction", "blocks", "time(us)", "GB/s"
    );
    let mut rows = Vec::new();
    let mut sizes = Vec::new();
    let mut b = args.minbytes.next_multiple_of(16);
    while b <= max {
        sizes.push(b);
        b = b.saturating_mul(args.stepfactor);
    }
    for dir in [Direction::HostRead, Direction::HostWrite, Direction::Device] {
        let (src, dst) = match dir {
            Direction::HostRead => (host.device_ptr(), dev_a.ptr()),
            Direction::HostWrite => (dev_a.ptr(), host.device_ptr()),
            Direction::Device => (dev_a.ptr(), dev_b.ptr()),
        };
        let mut table = RankTable::default();
        table.inputs[0] = src;
        table.signals[0] = signal.ptr();
        let table = DeviceAlloc::from_value(ctx, &table)?;
        for &size in &sizes {
            let count = size / 4;
            let blocks = blocks_for(Algorithm::OneStage, Dtype::F32, count, 1, args.threads, 64);
            let mut la = LaunchArgs {
                table: table.ptr(),
                count: count as u64,
                ..Default::default()
            };
            la.outputs[0] = dst;
            la.signals[0] = signal.ptr();
            let timing = Timing {
                per_graph: 20,
                warmup: 3,
                replays: args.iters,
            };
            let times = measure::time_graphs(
                std::slice::from_ref(&stream),
                timing,
                // SAFETY: the table, signal and both buffers are live
                // allocations of this context holding `size` bytes (the
                // host buffer is mapped), and the stream is this context's.
                || unsafe { kernels.launch(&stream, entry, (blocks, 1), args.threads, &la) },
                || Ok(()),
                || stream.synchronize().during("cuStreamSynchronize"),
            )?;
            let s = measure::Sample::from_times(Algorithm::OneStage, times);
            let gbps = size as f64 / (s.median_us * 1e3);
            println!(
                "{:>12} {:>18} {:>7} {:>10.2} {:>9.2}",
                size,
                dir.name(),
                blocks,
                s.median_us,
                gbps
            );
            rows.push(HostRow {
                bytes: size,
                direction: dir.name(),
                blocks,
                time_us: s.median_us,
                gbps,
            });
        }
    }
    // One pack: the difference to the device-to-device copy is the extra
    // latency of one trip over the host link.
    let at = |d: Direction| {
        rows.iter()
            .find(|r| r.direction == d.name() && r.bytes == sizes[0])
            .map(|r| r.time_us)
    };
    if let (Some(r), Some(w), Some(d)) = (
        at(Direction::HostRead),
        at(Direction::HostWrite),
        at(Direction::Device),
    ) {
        println!(
            "# {}: host read adds {:.2} us, host write adds {:.2} us to a device copy \
             (read: a round trip the kernel waits for; write: posted, the kernel ends when \
             the store is performed)",
            fmt_bytes(sizes[0] as u64),
            r - d,
            w - d
        );
    }
    Ok(rows)
}
