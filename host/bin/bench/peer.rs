//! `bench` on real ranks driven by one process: one GPU per rank of a
//! `PeerGroup` (`--gpus 0,1`), with NCCL rows from an `NcclGroup` when the
//! `nccl` feature is on and NCCL loads.

#[cfg(feature = "nccl")]
use super::table::print_nccl_library;
use super::table::{column_names, describe, header};
use super::{config, fill_for, kernel_rows, sweep_rows, BenchArgs, Rows, Runner, What};
#[cfg(feature = "nccl")]
use super::{NCCL, NCCL_SYMMETRIC};
use crate::open_gpu;
#[cfg(feature = "nccl")]
use cudarc::driver::DevicePtrMut;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use p2p_allreduce::abi::{Algorithm, Dtype};
#[cfg(feature = "nccl")]
use p2p_allreduce::driver;
use p2p_allreduce::error::Context as _;
use p2p_allreduce::measure::{self, Sample, Timing};
use p2p_allreduce::thresholds::{Backend, Mode};
use p2p_allreduce::validate::{self, Bits, Mismatch};
use p2p_allreduce::{AlgoChoice, Error, PeerGroup, RegisteredBuffers, Result};
use std::process::ExitCode;
use std::sync::Arc;

pub(super) fn run_peer(args: &BenchArgs, sizes: &[usize]) -> Rows {
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
    let max_count = sizes[sizes.len() - 1] / args.datatype.size();
    let nccl = nccl_for_peer(args, &streams, max_count * args.datatype.size());
    column_names();
    let fill_bits = fill_for(args, max_count);
    let mut whats = kernel_rows(args);
    if let Some((_, symmetric)) = &nccl {
        whats.push(What::Nccl);
        if *symmetric {
            whats.push(What::NcclSymmetric);
        }
        if args.algo.contains(&p2p_allreduce::AlgoChoice::Auto) {
            whats.push(What::AutoNccl);
        }
    }
    let nccl = nccl.map(|(n, _)| n);
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

/// NCCL communicators for the NCCL rows, and whether they have symmetric
/// windows of `bytes` per rank (the `nccl_symmetric` rows), or a printed
/// reason why none.
fn nccl_for_peer(
    args: &BenchArgs,
    streams: &[Arc<CudaStream>],
    bytes: usize,
) -> Option<(PeerNccl, bool)> {
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
            Ok(mut n) => {
                print_nccl_library();
                let symmetric = match p2p_allreduce::nccl::symmetric_support()
                    .map_err(|e| e.to_string())
                    .and_then(|()| n.enable_symmetric(bytes).map_err(|e| e.to_string()))
                {
                    Ok(_) => {
                        println!("# nccl_symmetric rows: the same allreduce between buffers from ncclMemAlloc registered as symmetric windows (inputs hold the same data)");
                        true
                    }
                    Err(e) => {
                        println!("# nccl_symmetric rows: none: {e}");
                        false
                    }
                };
                if args.algo.contains(&p2p_allreduce::AlgoChoice::Auto) {
                    println!("# auto+nccl rows: each size to whoever the group's table gives it (`p2p-allreduce info`): our Auto, NCCL, or NCCL on the symmetric windows");
                }
                Some((n, symmetric))
            }
            Err(e) => {
                println!("# NCCL rows: none: {e}");
                None
            }
        }
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = (streams, bytes);
        println!("# NCCL rows: none (built without the `nccl` cargo feature)");
        None
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
        #[cfg(feature = "nccl")]
        if let Some(sym) = nccl.as_ref().and_then(|n| n.symmetric()) {
            for (r, s) in streams.iter().enumerate() {
                if max_count > 0 && sym.bytes >= max_count * T::DTYPE.size() {
                    // SAFETY: the symmetric input holds `sym.bytes` >=
                    // max_count elements on rank r's device.
                    unsafe { driver::write_at(s.context(), sym.inputs[r], &fill)? };
                }
            }
        }
        Ok(Box::new(PeerRunner::<T> {
            group,
            streams,
            nccl,
            reg,
            outs,
        }))
    }

    /// What `what` runs for `count` elements: `AutoNccl` asks the group's
    /// table ([`PeerGroup::route`]); NCCL on symmetric windows only where
    /// there are some.
    fn step(&self, what: What, count: usize) -> Step {
        let symmetric = self.has_symmetric();
        let nccl = |b: Backend| {
            if b == Backend::NcclSymmetric && symmetric {
                Step::Nccl(Backend::NcclSymmetric)
            } else {
                Step::Nccl(Backend::Nccl)
            }
        };
        match what {
            What::Kernel(algo) => Step::Kernel(algo),
            What::Nccl => Step::Nccl(Backend::Nccl),
            What::NcclSymmetric => nccl(Backend::NcclSymmetric),
            What::AutoNccl => match self.group.route(count, T::DTYPE, Mode::Fastest) {
                Backend::Ours => Step::Kernel(AlgoChoice::Auto),
                b => nccl(b),
            },
        }
    }

    fn has_symmetric(&self) -> bool {
        #[cfg(feature = "nccl")]
        return self.nccl.as_ref().is_some_and(|n| n.symmetric().is_some());
        #[cfg(not(feature = "nccl"))]
        false
    }

    /// NCCL's pointers for `backend`: the symmetric windows for
    /// `NcclSymmetric`, else the registered inputs and the outputs.
    #[cfg(feature = "nccl")]
    fn ptrs(&mut self, backend: Backend) -> (Vec<u64>, Vec<u64>) {
        if backend == Backend::NcclSymmetric {
            if let Some(sym) = self.nccl.as_ref().and_then(|n| n.symmetric()) {
                return (sym.inputs, sym.outputs);
            }
        }
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

/// One row's work at one size.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    Kernel(AlgoChoice),
    /// `Nccl` or `NcclSymmetric`.
    Nccl(Backend),
}

#[cfg(feature = "nccl")]
fn nccl_name(b: Backend) -> &'static str {
    if b == Backend::NcclSymmetric {
        NCCL_SYMMETRIC
    } else {
        NCCL
    }
}

impl<T: Bits> Runner for PeerRunner<T> {
    fn world(&self) -> usize {
        self.group.world()
    }
    fn time(&mut self, count: usize, what: What, timing: Timing) -> Result<(Sample, &'static str)> {
        let mut used = Algorithm::OneStage;
        let step = self.step(what, count);
        let (group, streams, reg) = (&self.group, &self.streams, &self.reg);
        let times = match step {
            Step::Kernel(algo) => {
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
            Step::Nccl(backend) => {
                #[cfg(feature = "nccl")]
                {
                    let (ins, outs) = self.ptrs(backend);
                    let n = self
                        .nccl
                        .as_ref()
                        .ok_or_else(|| Error::Nccl("NCCL was not set up".into()))?;
                    let streams = &self.streams;
                    let t = measure::time_graphs(
                        streams,
                        timing,
                        // SAFETY: the registered buffers, outputs and
                        // symmetric windows hold max_count >= count
                        // elements and outlive the graphs.
                        || unsafe { n.allreduce_raw(streams, T::DTYPE, count, &ins, &outs) },
                        || Ok(()),
                        || sync_all(streams),
                    )?;
                    return Ok((Sample::from_times(used, t), nccl_name(backend)));
                }
                #[cfg(not(feature = "nccl"))]
                {
                    let _ = backend;
                    return Err(Error::Nccl("built without the `nccl` feature".into()));
                }
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
        match self.step(what, count) {
            Step::Kernel(algo) => {
                self.group.allreduce_registered(
                    &self.streams,
                    &self.reg,
                    count,
                    &mut fresh,
                    algo,
                )?;
                self.group.check(&self.streams)?;
            }
            Step::Nccl(backend) => {
                #[cfg(feature = "nccl")]
                {
                    let (ins, mut outs) = self.ptrs(backend);
                    let windows = backend == Backend::NcclSymmetric;
                    if windows {
                        for (r, s) in self.streams.iter().enumerate() {
                            // SAFETY: the window output holds >= count elements.
                            unsafe { driver::write_at(s.context(), outs[r], &poison[..count])? };
                        }
                    } else {
                        outs = fresh
                            .iter_mut()
                            .zip(&self.streams)
                            .map(|(o, s)| o.device_ptr_mut(s).0)
                            .collect();
                    }
                    let n = self
                        .nccl
                        .as_ref()
                        .ok_or_else(|| Error::Nccl("NCCL was not set up".into()))?;
                    // SAFETY: inputs and outputs hold >= count elements.
                    unsafe { n.allreduce_raw(&self.streams, T::DTYPE, count, &ins, &outs)? };
                    if windows {
                        for ((f, s), &o) in fresh.iter_mut().zip(&self.streams).zip(&outs) {
                            let dst = f.device_ptr_mut(s).0;
                            // SAFETY: both hold >= count elements on this
                            // rank's device; ordered after the allreduce
                            // on the same stream.
                            unsafe { driver::copy_dtod_async(s, dst, o, count * T::DTYPE.size())? };
                        }
                    }
                    sync_all(&self.streams)?;
                }
                #[cfg(not(feature = "nccl"))]
                {
                    let _ = backend;
                    return Err(Error::Nccl("built without the `nccl` feature".into()));
                }
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
