//! The rig of virtual ranks ([`VirtualRig`]): every rank on one GPU, in one
//! process.

use super::*;

pub(super) struct VirtualRig {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    group: Option<VirtualGroup>,
    reg: Option<RegisteredBuffers<f32>>,
    /// Every rank's outputs, a graph's calls back to back.
    outs: Vec<DeviceAlloc>,
    residual: Vec<CudaSlice<f32>>,
    gamma: Vec<CudaSlice<f32>>,
    normed: Vec<CudaSlice<f32>>,
    graphs: Vec<CudaGraph>,
}

pub(super) fn out_words(cfgs: &[Cfg]) -> usize {
    cfgs.iter()
        .map(|c| c.per_graph * c.count())
        .max()
        .unwrap_or(1)
}

impl VirtualRig {
    pub(super) fn new(ctx: Arc<CudaContext>, args: &SoakArgs, cfgs: &[Cfg]) -> Result<Self> {
        let stream = ctx.new_stream().during("cuStreamCreate")?;
        let group = VirtualGroup::new(&ctx, args.world, soak_config(args))?;
        let max_count = cfgs.iter().map(Cfg::count).max().unwrap_or(1);
        let reg = group.alloc_registered::<f32>(max_count)?;
        let words = out_words(cfgs);
        let outs = (0..args.world)
            .map(|_| DeviceAlloc::zeroed(&ctx, words * 4))
            .collect::<Result<Vec<_>>>()?;
        let fused_count = args.fused_rows.iter().max().copied().unwrap_or(1) * HIDDEN;
        let slices = |n: usize| -> Result<Vec<CudaSlice<f32>>> {
            (0..args.world)
                .map(|_| stream.alloc_zeros::<f32>(n).during("cuMemAlloc"))
                .collect()
        };
        let residual = slices(fused_count)?;
        let gamma = slices(HIDDEN)?;
        let normed = slices(words.max(1))?;
        Ok(VirtualRig {
            ctx,
            stream,
            group: Some(group),
            reg: Some(reg),
            outs,
            residual,
            gamma,
            normed,
            graphs: Vec::new(),
        })
    }

    fn group(&self) -> &VirtualGroup {
        self.group.as_ref().expect("the group lives until teardown")
    }
    fn reg(&self) -> &RegisteredBuffers<f32> {
        self.reg.as_ref().expect("the buffers live until teardown")
    }
}

impl Rig for VirtualRig {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        self.outs.len()
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
        let g = capture_calls(&s, cfg.per_graph, |j| {
            match cfg.kind {
                Kind::Allreduce { algo, .. } => {
                    let o: Vec<u64> = self
                        .outs
                        .iter()
                        .map(|a| a.ptr() + (j * n * 4) as u64)
                        .collect();
                    // SAFETY: every output holds per_graph * n f32 (the
                    // largest of any configuration) and lives as long as
                    // the graphs (dropped first in `teardown`).
                    unsafe {
                        self.group
                            .as_ref()
                            .expect("group")
                            .allreduce_registered_raw(
                                &s,
                                self.reg.as_ref().expect("reg"),
                                n,
                                &o,
                                algo.into(),
                            )
                    }
                    .map(|_| ())
                }
                Kind::Fused { algo, rows } => {
                    let gv: Vec<_> = self.gamma.iter().map(|g| g.slice(0..HIDDEN)).collect();
                    let gr: Vec<&_> = gv.iter().collect();
                    let mut rv: Vec<_> = self
                        .residual
                        .iter_mut()
                        .map(|x| x.slice_mut(0..rows * HIDDEN))
                        .collect();
                    let mut ov: Vec<_> = self
                        .normed
                        .iter_mut()
                        .map(|x| x.slice_mut(j * n..(j + 1) * n))
                        .collect();
                    self.group
                        .as_ref()
                        .expect("group")
                        .allreduce_add_rmsnorm_registered(
                            &s,
                            self.reg.as_ref().expect("reg"),
                            n,
                            &mut rv,
                            &gr,
                            EPS,
                            &mut ov,
                            algo.into(),
                        )
                        .map(|_| ())
                }
            }
        })?;
        self.graphs.push(g);
        Ok(())
    }
    fn graph(&self, i: usize) -> &CudaGraph {
        &self.graphs[i]
    }
    fn check(&mut self, i: usize, cfg: &Cfg, seed: u64) -> Result<(u64, u64, Option<String>)> {
        let world = self.world();
        let n = cfg.count();
        let x = inputs(cfg, world, seed);
        self.stream.synchronize().during("cuStreamSynchronize")?;
        for (r, xr) in x.iter().enumerate() {
            // SAFETY: the registered buffer of rank r holds the largest
            // count; no kernel runs (the stream was waited for).
            unsafe { driver::write_at(&self.ctx, self.reg().ptr(r), xr)? };
        }
        let mut acc = (0u64, 0u64, None);
        match cfg.kind {
            Kind::Allreduce { .. } => {
                for o in &self.outs {
                    o.write(&poison_words(cfg.per_graph * n))?;
                }
                self.graphs[i].launch().during("cuGraphLaunch")?;
                self.group().check(&self.stream)?;
                let refs: Vec<&[u32]> = x.iter().map(|v| v.as_slice()).collect();
                let want = reference::allreduce_bits(Dtype::F32, &refs);
                let wants: Vec<&[u32]> = vec![want.as_slice(); cfg.per_graph];
                for (r, o) in self.outs.iter().enumerate() {
                    let mut got = vec![0u32; cfg.per_graph * n];
                    o.read(&mut got)?;
                    compare_calls(r, &got, &wants, &mut acc);
                }
            }
            Kind::Fused { rows, .. } => {
                let (res, gam) = fused_extra(rows, world, seed);
                let f = |b: &[u32]| b.iter().map(|&v| f32::from_bits(v)).collect::<Vec<f32>>();
                for r in 0..world {
                    let s = &self.stream;
                    s.memcpy_htod(&f(&res[r]), &mut self.residual[r].slice_mut(0..n))
                        .during("cuMemcpyHtoD")?;
                    s.memcpy_htod(&f(&gam[r]), &mut self.gamma[r])
                        .during("cuMemcpyHtoD")?;
                    s.memcpy_htod(
                        &f(&poison_words(cfg.per_graph * n)),
                        &mut self.normed[r].slice_mut(0..cfg.per_graph * n),
                    )
                    .during("cuMemcpyHtoD")?;
                }
                self.stream.synchronize().during("cuStreamSynchronize")?;
                self.graphs[i].launch().during("cuGraphLaunch")?;
                self.group().check(&self.stream)?;
                for r in 0..world {
                    let (normed, residual) = fused_want(&x, &res[r], &gam[r], cfg.per_graph);
                    let got_n: Vec<u32> = self
                        .stream
                        .clone_dtoh(&self.normed[r].slice(0..cfg.per_graph * n))
                        .during("cuMemcpyDtoH")?
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    let got_r: Vec<u32> = self
                        .stream
                        .clone_dtoh(&self.residual[r].slice(0..n))
                        .during("cuMemcpyDtoH")?
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    let wants: Vec<&[u32]> = normed.iter().map(|v| v.as_slice()).collect();
                    compare_calls(r, &got_n, &wants, &mut acc);
                    compare_calls(r, &got_r, &[residual.as_slice()], &mut acc);
                }
            }
        }
        Ok(acc)
    }
    fn agree(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![mine.to_vec()])
    }
    fn teardown(&mut self) {
        let _ = self.stream.synchronize();
        self.graphs.clear();
        self.reg = None;
        self.outs.clear();
        self.residual.clear();
        self.gamma.clear();
        self.normed.clear();
        self.group = None;
    }
}
