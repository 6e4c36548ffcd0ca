//! The arguments of `p2p-allreduce bench`, named after nccl-tests'
//! `all_reduce_perf` options where it has them.

use crate::{parse_algo_arg, parse_dtype_arg, parse_size, parse_world_arg};
use p2p_allreduce::abi::Dtype;
use p2p_allreduce::AlgoChoice;
use std::path::PathBuf;

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
    #[arg(long, value_delimiter = ',', default_value = "one_stage,two_stage,push,push_ll,push_two_stage,push_islands,auto", value_parser = parse_algo_arg)]
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
    /// Virtual ranks: groups built per world one after another, each with
    /// its own allocations and every one timed (rows repeat per group). A
    /// run's timings depend on where its buffers land; comparing builds
    /// over several groups averages that out.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub groups: u32,
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
    /// The fused allreduce + residual add + RMSNorm instead: rows 1..512 x
    /// `--hidden` bf16, fused (one-stage, two-stage, auto) vs unfused vs
    /// the plain allreduce of the same bytes (validated by the GPU suite,
    /// not per row).
    #[arg(long)]
    pub fused: bool,
    /// Row length for `--fused`.
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// With `--fused`: also a `fused push_ll ctasK` row per listed cluster
    /// size K (`Config::fused_ctas`: 1, 2, 4 or 8 CTAs per row), e.g.
    /// `1,2,4,8`; the `fused push_ll` row is the default choice.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub fused_ctas: Vec<u32>,
}

impl BenchArgs {
    /// The options given that this mode does not take, as a usage message,
    /// or `None`: `--fused` sweeps rows of `--hidden` bf16 on virtual
    /// ranks or a `PeerGroup` (no sizes, element types, algorithm list,
    /// plot, processes, NCCL rows or per-row check), and the size sweep
    /// has no rows (`--hidden`, `--fused-ctas`). An option that would be
    /// ignored is refused, so no run silently measures something else
    /// than was asked for. Values equal to the defaults count as not given.
    pub fn unused_options(&self) -> Option<String> {
        let d = BenchArgs::default();
        if self.groups != d.groups && (self.fused || !self.gpus.is_empty() || self.procs) {
            return Some(
                "--groups applies only to the size sweep on virtual ranks (no --fused, --gpus or --procs): leave it out".into(),
            );
        }
        let checks = if self.fused {
            vec![
                (self.minbytes != d.minbytes, "-b/--minbytes"),
                (self.maxbytes != d.maxbytes, "-e/--maxbytes"),
                (self.stepfactor != d.stepfactor, "-f/--stepfactor"),
                (self.datatype != d.datatype, "-d/--datatype"),
                (self.algo != d.algo, "--algo"),
                (self.plot.is_some(), "--plot"),
                (self.procs, "--procs"),
                (self.no_nccl, "--no-nccl"),
                (self.no_check, "--no-check"),
            ]
        } else {
            vec![
                (self.hidden != d.hidden, "--hidden"),
                (!self.fused_ctas.is_empty(), "--fused-ctas"),
            ]
        };
        let given: Vec<&str> = checks
            .into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect();
        if given.is_empty() {
            None
        } else if self.fused {
            Some(format!(
                "{} do(es) not apply to --fused (rows 1..512 x --hidden bf16, fused vs unfused vs plain; validated by the GPU suite): leave them out",
                given.join(", ")
            ))
        } else {
            Some(format!(
                "{} appl(y/ies) only with --fused: add --fused or leave them out",
                given.join(", ")
            ))
        }
    }
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
            algo: vec![
                AlgoChoice::OneStage,
                AlgoChoice::TwoStage,
                AlgoChoice::Push,
                AlgoChoice::PushLl,
                AlgoChoice::PushTwoStage,
                AlgoChoice::PushIslands,
                AlgoChoice::Auto,
            ],
            json: None,
            plot: None,
            device: 0,
            groups: 1,
            gpus: Vec::new(),
            procs: false,
            max_blocks: None,
            threads: 512,
            no_nccl: false,
            no_check: false,
            fused: false,
            hidden: 7168,
            fused_ctas: Vec::new(),
        }
    }
}
