//! `bench` on virtual ranks: every rank on one GPU (a `VirtualGroup`),
//! one world size after another. No NCCL rows: NCCL needs one GPU per rank.

use super::table::{column_names, describe, header};
use super::{config, fill_for, kernel_rows, sweep_rows, BenchArgs, Rows, Runner, What};
use crate::open_gpu;
use cudarc::driver::{CudaContext, CudaStream};
use p2p_allreduce::abi::Dtype;
use p2p_allreduce::measure::{self, Sample, Timing};
use p2p_allreduce::validate::{self, Bits, Mismatch};
use p2p_allreduce::{Error, Result, VirtualGroup};
use std::process::ExitCode;
use std::sync::Arc;

pub(super) fn run_virtual(args: &BenchArgs, sizes: &[usize]) -> Rows {
    let ctx = open_gpu("bench", args.device)?;
    // SAFETY: this command uses one stream, and every buffer is used on it
    // only: cudarc's cross-stream event tracking is not needed, and graph
    // capture must not record its events.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(|e| {
        eprintln!("bench: cannot create a stream: {e}");
        ExitCode::FAILURE
    })?;
    header(
        &describe(&ctx),
        "virtual ranks on one GPU, registered inputs",
        args,
        sizes,
    );
    println!("# NCCL rows: none for virtual ranks (NCCL needs one GPU per rank)");
    column_names();
    let max_count = sizes[sizes.len() - 1] / args.datatype.size();
    let fill_bits = fill_for(args, max_count);
    let mut rows = Vec::new();
    let mut failures = 0;
    // Every group is kept until the end, so the next one gets new memory.
    let mut kept = Vec::new();
    for w in args
        .world
        .iter()
        .flat_map(|&w| std::iter::repeat_n(w, args.groups as usize))
    {
        let r = match args.datatype {
            Dtype::F32 => VirtualRunner::<f32>::new(&ctx, &stream, w, args, sizes, &fill_bits),
            Dtype::F16 => {
                VirtualRunner::<half::f16>::new(&ctx, &stream, w, args, sizes, &fill_bits)
            }
            Dtype::Bf16 => {
                VirtualRunner::<half::bf16>::new(&ctx, &stream, w, args, sizes, &fill_bits)
            }
        };
        match r {
            Ok(mut runner) => {
                let (r, f) = sweep_rows(
                    runner.as_mut(),
                    args,
                    sizes,
                    &kernel_rows(args),
                    &fill_bits,
                    true,
                );
                rows.extend(r);
                failures += f;
                kept.push(runner);
            }
            Err(e) => {
                println!("# world {w}: cannot create the group: {e}");
                failures += sizes.len() * args.algo.len();
            }
        }
    }
    let title = format!(
        "p2p-allreduce {} allreduce latency, virtual ranks on one GPU",
        args.datatype.name()
    );
    Ok((rows, failures, title))
}

struct VirtualRunner<T: Bits> {
    group: VirtualGroup,
    stream: Arc<CudaStream>,
    fill: Vec<T>,
}

impl<T: Bits> VirtualRunner<T> {
    #[allow(clippy::new_ret_no_self)]
    fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        world: usize,
        args: &BenchArgs,
        sizes: &[usize],
        fill_bits: &[u32],
    ) -> Result<Box<dyn Runner>> {
        Ok(Box::new(VirtualRunner::<T> {
            group: VirtualGroup::new(ctx, world, config(args, sizes[sizes.len() - 1]))?,
            stream: stream.clone(),
            fill: validate::from_bits(fill_bits),
        }))
    }
}

impl<T: Bits> Runner for VirtualRunner<T> {
    fn world(&self) -> usize {
        self.group.world()
    }
    fn time(&mut self, count: usize, what: What, timing: Timing) -> Result<(Sample, &'static str)> {
        let What::Kernel(algo) = what else {
            return Err(Error::Config("NCCL does not run on virtual ranks".into()));
        };
        let s =
            measure::time_registered(&self.group, &self.stream, count, &self.fill, algo, timing)?;
        let name = s.algorithm.name();
        Ok((s, name))
    }
    fn wrong(
        &mut self,
        count: usize,
        what: What,
        want: &[u32],
    ) -> Result<(usize, Option<Mismatch>)> {
        let What::Kernel(algo) = what else {
            return Err(Error::Config("NCCL does not run on virtual ranks".into()));
        };
        let o = validate::check_registered_fill(
            &self.group,
            &self.stream,
            &self.fill[..count],
            want,
            algo,
        )?;
        Ok((o.wrong, o.first))
    }
    fn reset(&self) -> Result<()> {
        self.group.reset()
    }
}
