//! The rig of real ranks ([`ProcRig`]): one process per rank, over CUDA
//! IPC, the ranks agreeing through the exchange directory.

use super::*;

pub(super) struct ProcRig<'a> {
    ex: &'a DirExchange,
    stream: Arc<CudaStream>,
    group: Option<ProcessGroup>,
    /// This rank's registered input (the largest count).
    input: Option<DeviceAlloc>,
    out: Option<DeviceAlloc>,
    residual: Option<DeviceAlloc>,
    gamma: Option<DeviceAlloc>,
    graphs: Vec<CudaGraph>,
}

impl<'a> ProcRig<'a> {
    pub(super) fn new(
        ctx: Arc<CudaContext>,
        ex: &'a DirExchange,
        args: &SoakArgs,
        cfgs: &[Cfg],
    ) -> Result<Self> {
        let stream = ctx.new_stream().during("cuStreamCreate")?;
        let group = ProcessGroup::new(&ctx, ex, soak_config(args))?;
        let max_count = cfgs.iter().map(Cfg::count).max().unwrap_or(1);
        let input = DeviceAlloc::zeroed(&ctx, max_count * 4)?;
        // SAFETY: `input` lives until `teardown`, which drops the group
        // (and its mappings of the peers' inputs) first.
        unsafe { group.register_buffer(ex, input.ptr(), max_count * 4)? };
        // The registered table for offset 0, made outside capture.
        let out = DeviceAlloc::zeroed(&ctx, out_words(cfgs) * 4)?;
        // SAFETY: input and out hold 16 f32.
        unsafe {
            group.allreduce_registered_raw(
                &stream,
                Dtype::F32,
                16,
                input.ptr(),
                out.ptr(),
                AlgoChoice::OneStage,
            )?
        };
        group.check(&stream)?;
        let fused_count = args.fused_rows.iter().max().copied().unwrap_or(1) * HIDDEN;
        let residual = DeviceAlloc::zeroed(&ctx, fused_count * 4)?;
        let gamma = DeviceAlloc::zeroed(&ctx, HIDDEN * 4)?;
        Ok(ProcRig {
            ex,
            stream,
            group: Some(group),
            input: Some(input),
            out: Some(out),
            residual: Some(residual),
            gamma: Some(gamma),
            graphs: Vec::new(),
        })
    }
    fn group(&self) -> &ProcessGroup {
        self.group.as_ref().expect("the group lives until teardown")
    }
    fn ptr(a: &Option<DeviceAlloc>) -> u64 {
        a.as_ref().map_or(0, DeviceAlloc::ptr)
    }
}

impl Rig for ProcRig<'_> {
    fn rank(&self) -> usize {
        self.ex.rank()
    }
    fn world(&self) -> usize {
        self.ex.world()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn check_group(&self) -> Result<()> {
        self.group().check(&self.stream)
    }
    fn build(&mut self, i: usize, cfg: &Cfg) -> Result<()> {
        assert_eq!(i, self.graphs.len(), "graphs are built in order");
        let s = self.stream.clone();
        let n = cfg.count();
        let (input, out) = (Self::ptr(&self.input), Self::ptr(&self.out));
        let (residual, gamma) = (Self::ptr(&self.residual), Self::ptr(&self.gamma));
        let g = capture_calls(&s, cfg.per_graph, |j| {
            let o = out + (j * n * 4) as u64;
            // SAFETY: the input lies in the registered buffer (the largest
            // count); `out` holds per_graph * n f32 for any configuration,
            // the residual and gamma the largest rows; all live as long as
            // the graphs (dropped first in `teardown`).
            unsafe {
                match cfg.kind {
                    Kind::Allreduce { algo, .. } => self.group().allreduce_registered_raw(
                        &s,
                        Dtype::F32,
                        n,
                        input,
                        o,
                        algo.into(),
                    ),
                    Kind::Fused { algo, rows } => {
                        self.group().allreduce_add_rmsnorm_registered_raw(
                            &s,
                            Dtype::F32,
                            rows,
                            HIDDEN,
                            EPS,
                            [input, residual, gamma, o],
                            algo.into(),
                        )
                    }
                }
            }
            .map(|_| ())
        })?;
        self.graphs.push(g);
        Ok(())
    }
    fn graph(&self, i: usize) -> &CudaGraph {
        &self.graphs[i]
    }
    fn check(&mut self, i: usize, cfg: &Cfg, seed: u64) -> Result<(u64, u64, Option<String>)> {
        let (rank, world) = (self.rank(), self.world());
        let n = cfg.count();
        let x = inputs(cfg, world, seed);
        // This rank's kernels are done, so no peer reads its input any
        // more (pull algorithms end with a barrier; push ones read only
        // their own zones).
        self.stream.synchronize().during("cuStreamSynchronize")?;
        let input = self.input.as_ref().expect("input");
        input.write(&x[rank])?;
        let out = self.out.as_ref().expect("out");
        out.write(&poison_words(cfg.per_graph * n))?;
        let mut acc = (0u64, 0u64, None);
        match cfg.kind {
            Kind::Allreduce { .. } => {
                self.graphs[i].launch().during("cuGraphLaunch")?;
                self.group().check(&self.stream)?;
                let refs: Vec<&[u32]> = x.iter().map(|v| v.as_slice()).collect();
                let want = reference::allreduce_bits(Dtype::F32, &refs);
                let mut got = vec![0u32; cfg.per_graph * n];
                out.read(&mut got)?;
                compare_calls(rank, &got, &vec![want.as_slice(); cfg.per_graph], &mut acc);
            }
            Kind::Fused { rows, .. } => {
                let (res, gam) = fused_extra(rows, world, seed);
                let residual = self.residual.as_ref().expect("residual");
                residual.write(&res[rank])?;
                self.gamma.as_ref().expect("gamma").write(&gam[rank])?;
                self.graphs[i].launch().during("cuGraphLaunch")?;
                self.group().check(&self.stream)?;
                let (normed, want_res) = fused_want(&x, &res[rank], &gam[rank], cfg.per_graph);
                let mut got = vec![0u32; cfg.per_graph * n];
                out.read(&mut got)?;
                let wants: Vec<&[u32]> = normed.iter().map(|v| v.as_slice()).collect();
                compare_calls(rank, &got, &wants, &mut acc);
                let mut got_r = vec![0u32; n];
                residual.read(&mut got_r)?;
                compare_calls(rank, &got_r, &[want_res.as_slice()], &mut acc);
            }
        }
        Ok(acc)
    }
    fn agree(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.ex.all_gather(mine)
    }
    fn teardown(&mut self) {
        let _ = self.stream.synchronize();
        self.graphs.clear();
        self.group = None;
        self.input = None;
        self.out = None;
        self.residual = None;
        self.gamma = None;
    }
}
