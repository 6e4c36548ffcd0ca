//! `bench --procs`: one process per GPU, the ranks of a `ProcessGroup`
//! over CUDA IPC, with NCCL rows from an `NcclRank` per process when the
//! `nccl` feature is on and every rank can load NCCL.

#[cfg(feature = "nccl")]
use super::table::print_nccl_library;
use super::table::{column_names, describe, header};
#[cfg(feature = "nccl")]
use super::NCCL;
use super::{config, fill_for, kernel_rows, report, sweep_rows, BenchArgs, Runner, What};
use crate::procs;
use crate::procs::RankEnv;
use cudarc::driver::{CudaContext, CudaStream};
use p2p_allreduce::abi::{Algorithm, Dtype};
use p2p_allreduce::driver::DeviceAlloc;
#[cfg(feature = "nccl")]
use p2p_allreduce::error::Context as _;
use p2p_allreduce::measure::{self, Sample, Timing};
use p2p_allreduce::thresholds;
use p2p_allreduce::validate::{self, Bits, Mismatch};
use p2p_allreduce::{AlgoChoice, Error, ProcessGroup, Result};
use std::process::ExitCode;
use std::sync::Arc;

/// One rank of `bench --procs`. Rank 0 prints the table; every rank checks
/// its own result and the ranks add up their `#wrong` through the exchange.
pub(super) fn run_rank(args: &BenchArgs, sizes: &[usize], env: &RankEnv) -> ExitCode {
    let print = env.rank == 0;
    let procs::Joined {
        ctx,
        stream,
        exchange: ex,
        group,
    } = match procs::join("bench", env, config(args, sizes[sizes.len() - 1]), true) {
        Ok(j) => j,
        Err(code) => return code,
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
        if args.algo.contains(&AlgoChoice::Auto) {
            whats.push(What::AutoNccl);
        }
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
        Err(e) => {
            println!(
                "bench: rank {} on GPU {}: cannot prepare the inputs: {e}",
                env.rank, env.gpu
            );
            return ExitCode::FAILURE;
        }
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

impl<T: Bits> ProcRunner<'_, T> {
    /// What `what` runs here for `count` elements: `auto+nccl` by the
    /// group's table (the same answer on every rank); NCCL's symmetric
    /// windows are timed in one process (`--gpus`) only.
    fn resolve(&self, what: What, count: usize) -> Result<Step> {
        match what {
            What::Kernel(algo) => Ok(Step::Kernel(algo)),
            What::Nccl => Ok(Step::Nccl),
            What::AutoNccl => Ok(
                match self.group.route(count, T::DTYPE, thresholds::Mode::Fastest) {
                    thresholds::Backend::Ours => Step::Kernel(AlgoChoice::Auto),
                    _ => Step::Nccl,
                },
            ),
            What::NcclSymmetric => Err(Error::Nccl(
                "nccl_symmetric rows run with --gpus in one process, not --procs".into(),
            )),
        }
    }
}

/// One row's work at one size in this process.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    Kernel(AlgoChoice),
    Nccl,
}

impl<T: Bits> Runner for ProcRunner<'_, T> {
    fn world(&self) -> usize {
        self.group.world()
    }
    fn time(&mut self, count: usize, what: What, timing: Timing) -> Result<(Sample, &'static str)> {
        let what = self.resolve(what, count)?;
        let streams = [self.stream.clone()];
        let (i, o) = (self.input.ptr(), self.output.ptr());
        match what {
            Step::Kernel(algo) => {
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
            Step::Nccl => {
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
        let what = self.resolve(what, count)?;
        let poison = vec![validate::poison_bits(T::DTYPE); count.max(1)];
        let poison: Vec<T> = validate::from_bits(&poison);
        self.output.write(&poison)?;
        let (i, o) = (self.input.ptr(), self.output.ptr());
        match what {
            Step::Kernel(algo) => {
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
            Step::Nccl => {
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
