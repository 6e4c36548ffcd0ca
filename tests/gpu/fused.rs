//! Fused allreduce + residual add + RMSNorm: the cases, their buffers and
//! oracle checks, and push_ll split over clusters.

use crate::graphs::graph_cluster_sizes;
use crate::harness::*;

/// Fused push_ll rows split over thread-block clusters (sm_90 and newer):
/// every cluster size `Config::fused_ctas` takes, every dtype, worlds 1, 2,
/// 3 and 8, rows that need several rows per cluster, and rows whose last
/// CTAs hold no chunk (hidden 8 over 8 CTAs; 7168 over 8: 7 used), each
/// bit-exact on every rank from a graph replay. The graph's kernel node
/// shows the cluster size that ran: the plan's on sm_90 and newer, 1
/// before (no clusters: one block per row).
pub(crate) fn fused_push_ll_clusters(g: &Gpu) {
    let major = g
        .ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .expect("compute capability");
    let mut cases = 0;
    for ctas in [1u32, 2, 4, 8] {
        for world in [1usize, 2, 3, 8] {
            let cfg = Config {
                fused_ctas: Some(ctas),
                ..Config::with_max_bytes(1 << 20)
            };
            let grp = VirtualGroup::new(&g.ctx, world, cfg).expect("group");
            for dtype in Dtype::ALL {
                for hidden in [8usize, 64, 1024, 4096, 7168, 8192] {
                    if !takes_push_ll(dtype, hidden) {
                        continue;
                    }
                    let row_counts: &[usize] = if world == 8 { &[1, 5] } else { &[1, 3, 17] };
                    for &rows in row_counts {
                        let c = NormCase {
                            dtype,
                            world,
                            rows,
                            hidden,
                            seed: 4000 + cases as u64 * 5,
                        };
                        let want = if major >= 9 { ctas } else { 1 };
                        match dtype {
                            Dtype::F32 => fused_cluster_case::<f32>(g, &grp, &c, want),
                            Dtype::F16 => fused_cluster_case::<half::f16>(g, &grp, &c, want),
                            Dtype::Bf16 => fused_cluster_case::<half::bf16>(g, &grp, &c, want),
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    println!("  {cases} fused push_ll cases over clusters of 1, 2, 4 and 8 CTAs (sm_{major}x: clusters {}) bit-exact on every rank", if major >= 9 { "on" } else { "off" });
    // A dead peer: every CTA of every cluster leaves after the row whose
    // wait timed out (none waits at a cluster barrier for one that left),
    // the timeout is reported, and after `reset` (which clears the landing
    // zones the failed call wrote) the next calls are bit-exact again.
    for ctas in [1u32, 8] {
        let cfg = Config {
            fused_ctas: Some(ctas),
            timeout: Duration::from_millis(20),
            ..Config::with_max_bytes(1 << 20)
        };
        let grp = VirtualGroup::new(&g.ctx, 2, cfg).expect("group");
        for rows in [1usize, 5] {
            let what = format!("dead peer, clusters of {ctas}, {rows} rows");
            let t0 = Instant::now();
            let used = grp
                .add_rmsnorm_with_absent_ranks(
                    &g.stream,
                    0b10,
                    Dtype::Bf16,
                    AlgoChoice::PushLl,
                    rows,
                    7168,
                )
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(used, Algorithm::PushLl, "{what}");
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{what}: took {:?}",
                t0.elapsed()
            );
            match grp.check(&g.stream) {
                Err(Error::PeerTimeout {
                    rank: 0, peer: 1, ..
                }) => {}
                other => panic!("{what}: expected PeerTimeout of rank 0 naming 1, got {other:?}"),
            }
            grp.reset().expect("reset");
            let want = if major >= 9 { ctas } else { 1 };
            for seed in [1u64, 2] {
                let c = NormCase {
                    dtype: Dtype::Bf16,
                    world: 2,
                    rows,
                    hidden: 7168,
                    seed: 7000 + seed + rows as u64,
                };
                fused_cluster_case::<half::bf16>(g, &grp, &c, want);
            }
        }
    }
    println!(
        "  a dead peer under clusters of 1 and 8 CTAs: reported, no hang, bit-exact after reset"
    );
}

/// One [`fused_push_ll_clusters`] case: the fused push_ll call captured,
/// its kernel node's cluster size checked against `ctas`, the graph
/// launched, every rank checked.
fn fused_cluster_case<T: Bits>(g: &Gpu, grp: &VirtualGroup, c: &NormCase, ctas: u32) {
    let count = c.rows * c.hidden;
    let (x, res, gam, want) = c.data();
    let what = format!(
        "fused push_ll {:?} world {} rows {} hidden {} in clusters of {ctas}",
        c.dtype, c.world, c.rows, c.hidden
    );
    let mut bufs = NormBufs::<T>::upload(g, c.world, count, (&x, &res, &gam));
    let graph = capture(g, || {
        bufs.call(grp, &g.stream, (count, c.hidden), false, AlgoChoice::PushLl)
    });
    // One kernel node per push_ll step (rows beyond the zone take several).
    let sizes = graph_cluster_sizes(&graph);
    assert!(
        !sizes.is_empty() && sizes.iter().all(|&k| k == ctas),
        "{what}: kernel nodes' cluster sizes {sizes:?}"
    );
    graph.launch().expect("graph launch");
    grp.check(&g.stream)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    bufs.check(g, &what, c.dtype, count, false, &want);
}

// ---------------------------------------------------------------------------
// Fused allreduce + residual add + RMSNorm: every rank's residual out and
// normed rows against the CPU oracle, bit for bit.

/// One fused case on any group kind: `rows x hidden`, this `world`, a
/// residual and a gamma per rank (all different), eps 1e-6.
pub(crate) struct NormCase {
    pub(crate) dtype: Dtype,
    pub(crate) world: usize,
    pub(crate) rows: usize,
    pub(crate) hidden: usize,
    pub(crate) seed: u64,
}

impl NormCase {
    /// (inputs, residuals, gammas, wanted (residual out, normed) per rank).
    #[allow(clippy::type_complexity)]
    pub(crate) fn data(
        &self,
    ) -> (
        Vec<Vec<u32>>,
        Vec<Vec<u32>>,
        Vec<Vec<u32>>,
        Vec<(Vec<u32>, Vec<u32>)>,
    ) {
        let count = self.rows * self.hidden;
        let x = values::adversarial_inputs(self.dtype, self.world, count, self.seed, true);
        let res = values::adversarial_inputs(self.dtype, self.world, count, self.seed + 1, false);
        let gam =
            values::adversarial_inputs(self.dtype, self.world, self.hidden, self.seed + 2, false);
        let refs: Vec<&[u32]> = x.iter().map(|v| v.as_slice()).collect();
        let want = (0..self.world)
            .map(|r| reference::add_rmsnorm_bits(self.dtype, &refs, &res[r], &gam[r], NORM_EPS))
            .collect();
        (x, res, gam, want)
    }
}

pub(crate) const NORM_EPS: f32 = 1e-6;

/// One fused case's device buffers on the suite's GPU: every rank's x,
/// residual and gamma uploaded, and its normed output poisoned.
pub(crate) struct NormBufs<T: Bits> {
    pub(crate) xs: Vec<CudaSlice<T>>,
    pub(crate) rs: Vec<CudaSlice<T>>,
    pub(crate) gs: Vec<CudaSlice<T>>,
    pub(crate) outs: Vec<CudaSlice<T>>,
}

impl<T: Bits> NormBufs<T> {
    /// `data`: (inputs, residuals, gammas) per rank, as [`NormCase::data`]
    /// gives them; `count` elements per output.
    #[allow(clippy::type_complexity)]
    pub(crate) fn upload(
        g: &Gpu,
        world: usize,
        count: usize,
        data: (&[Vec<u32>], &[Vec<u32>], &[Vec<u32>]),
    ) -> Self {
        let (x, res, gam) = data;
        NormBufs {
            xs: x.iter().map(|b| upload::<T>(g, b)).collect(),
            rs: res.iter().map(|b| upload::<T>(g, b)).collect(),
            gs: gam.iter().map(|b| upload::<T>(g, b)).collect(),
            outs: (0..world).map(|_| poisoned::<T>(g, count)).collect(),
        }
    }

    /// Every rank's residual out and normed rows (in `xs` when
    /// `in_place`, else in `outs`) against the oracle's `want`.
    pub(crate) fn check(
        &self,
        g: &Gpu,
        what: &str,
        dtype: Dtype,
        count: usize,
        in_place: bool,
        want: &[(Vec<u32>, Vec<u32>)],
    ) {
        for (r, want) in want.iter().enumerate() {
            let got_res = download(g, &self.rs[r], count);
            let normed_at = if in_place { &self.xs[r] } else { &self.outs[r] };
            let got_norm = download(g, normed_at, count);
            check_norm_rank(what, dtype, r, (&got_res, &got_norm), want);
        }
    }

    /// The fused call of `grp` on the first `count` elements of each
    /// rank's buffers (rows of `hidden`): the normed rows into `outs`, or
    /// over `xs` when `in_place`.
    pub(crate) fn call(
        &mut self,
        grp: &VirtualGroup,
        stream: &Arc<CudaStream>,
        (count, hidden): (usize, usize),
        in_place: bool,
        algo: AlgoChoice,
    ) -> p2p_allreduce::Result<Algorithm> {
        let gv: Vec<_> = self.gs.iter().map(|s| s.slice(0..hidden)).collect();
        let gr: Vec<&_> = gv.iter().collect();
        let mut rv: Vec<_> = self.rs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
        if in_place {
            let mut xv: Vec<_> = self.xs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
            grp.allreduce_add_rmsnorm_in_place(stream, &mut xv, &mut rv, &gr, NORM_EPS, algo)
        } else {
            let xv: Vec<_> = self.xs.iter().map(|s| s.slice(0..count)).collect();
            let xr: Vec<&_> = xv.iter().collect();
            let mut ov: Vec<_> = self
                .outs
                .iter_mut()
                .map(|s| s.slice_mut(0..count))
                .collect();
            grp.allreduce_add_rmsnorm(stream, &xr, &mut rv, &gr, NORM_EPS, &mut ov, algo)
        }
    }
}

pub(crate) fn check_norm_rank(
    what: &str,
    dtype: Dtype,
    r: usize,
    got: (&[u32], &[u32]),
    want: &(Vec<u32>, Vec<u32>),
) {
    if let Err(e) = norm_mismatch(what, dtype, r, got, want) {
        panic!("{e}");
    }
}

/// Rank `r`'s residual out and normed rows against the oracle's: the first
/// differing element, as an error.
pub(crate) fn norm_mismatch(
    what: &str,
    dtype: Dtype,
    r: usize,
    got: (&[u32], &[u32]),
    want: &(Vec<u32>, Vec<u32>),
) -> Result<(), String> {
    for (name, g, w) in [("residual out", got.0, &want.0), ("normed", got.1, &want.1)] {
        if let Some((i, gb, wb)) = reference::first_mismatch(dtype, g, w) {
            return Err(format!(
                "{what}: rank {r} {name} element {i}: got {}, want {}",
                reference::fmt_bits(dtype, gb),
                reference::fmt_bits(dtype, wb)
            ));
        }
    }
    Ok(())
}

pub(crate) fn norm_virtual<T: Bits>(
    g: &Gpu,
    grp: &VirtualGroup,
    c: &NormCase,
    algo: AlgoChoice,
    in_place: bool,
) -> Algorithm {
    let count = c.rows * c.hidden;
    let (x, res, gam, want) = c.data();
    let what = format!(
        "virtual {:?} world {} rows {} hidden {} {algo:?}{}",
        c.dtype,
        c.world,
        c.rows,
        c.hidden,
        if in_place { " in place" } else { "" }
    );
    let mut bufs = NormBufs::<T>::upload(g, c.world, count, (&x, &res, &gam));
    let used = bufs
        .call(grp, &g.stream, (count, c.hidden), in_place, algo)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    grp.check(&g.stream)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    bufs.check(g, &what, c.dtype, count, in_place, &want);
    used
}

/// Whether the fused push_ll kernel takes rows of `hidden` at the default
/// block size (its register path, `abi::norm_reg_path`).
pub(crate) fn takes_push_ll(dtype: Dtype, hidden: usize) -> bool {
    let threads = Config::default().threads_per_block as u64;
    abi::norm_reg_path(dtype.lanes(), hidden as u64, threads)
}

/// An explicit push_ll for rows off the register path: refused with
/// `NormPushLlShape` before any work (every residual and output left as
/// it was), and the group stays healthy.
fn push_ll_refused_virtual<T: Bits>(g: &Gpu, grp: &VirtualGroup, c: &NormCase) {
    let count = c.rows * c.hidden;
    let what = format!(
        "virtual {:?} world {} rows {} hidden {} PushLl",
        c.dtype, c.world, c.rows, c.hidden
    );
    let (x, res, gam, _) = c.data();
    let mut bufs = NormBufs::<T>::upload(g, c.world, count, (&x, &res, &gam));
    let r = bufs.call(grp, &g.stream, (count, c.hidden), false, AlgoChoice::PushLl);
    assert!(
        matches!(r, Err(Error::NormPushLlShape { hidden, .. }) if hidden == c.hidden),
        "{what}: {r:?}"
    );
    grp.check(&g.stream)
        .unwrap_or_else(|e| panic!("{what}: the refusal left the group unhealthy: {e}"));
    for (r, res) in res.iter().enumerate() {
        assert_eq!(
            &download(g, &bufs.rs[r], count),
            res,
            "{what}: residual {r} changed"
        );
        assert!(
            download(g, &bufs.outs[r], count)
                .iter()
                .all(|&b| b == poison::<T>().to_bits32()),
            "{what}: output {r} written"
        );
    }
}

pub(crate) fn fused_add_rmsnorm(g: &Gpu) {
    let mut cases = 0;
    let mut refused = 0;
    let mut rng = 0x5eed_u64;
    for world in [1usize, 2, 3, 8] {
        // Small buffers, so that larger calls run in row chunks.
        let grp =
            VirtualGroup::new(&g.ctx, world, Config::with_max_bytes(256 << 10)).expect("group");
        for dtype in Dtype::ALL {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let random_hidden = 1 + (rng >> 33) as usize % 3000;
            for hidden in [1usize, 7, 128, 4096, 5120, 7168, 8192, random_hidden] {
                let row_counts: &[usize] = if hidden <= 128 {
                    &[0, 1, 3, 300]
                } else if world == 8 {
                    &[1, 17]
                } else {
                    &[0, 1, 3, 64]
                };
                for &rows in row_counts {
                    for algo in [
                        AlgoChoice::OneStage,
                        AlgoChoice::TwoStage,
                        AlgoChoice::PushLl,
                        AlgoChoice::Auto,
                    ] {
                        let c = NormCase {
                            dtype,
                            world,
                            rows,
                            hidden,
                            seed: 1000 + cases as u64 * 7,
                        };
                        if algo == AlgoChoice::PushLl && !takes_push_ll(dtype, hidden) {
                            match dtype {
                                Dtype::F32 => push_ll_refused_virtual::<f32>(g, &grp, &c),
                                Dtype::F16 => push_ll_refused_virtual::<half::f16>(g, &grp, &c),
                                Dtype::Bf16 => push_ll_refused_virtual::<half::bf16>(g, &grp, &c),
                            }
                            refused += 1;
                            continue;
                        }
                        let in_place = cases % 5 == 0;
                        let used = match dtype {
                            Dtype::F32 => norm_virtual::<f32>(g, &grp, &c, algo, in_place),
                            Dtype::F16 => norm_virtual::<half::f16>(g, &grp, &c, algo, in_place),
                            Dtype::Bf16 => norm_virtual::<half::bf16>(g, &grp, &c, algo, in_place),
                        };
                        if let Some(a) = algo.explicit() {
                            assert_eq!(used, a);
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    // Typed refusals.
    let grp = VirtualGroup::new(&g.ctx, 2, Config::with_max_bytes(1 << 20)).expect("group");
    let x = upload::<f32>(g, &[0; 10]);
    let mut rs = vec![upload::<f32>(g, &[0; 10]), upload::<f32>(g, &[0; 10])];
    let gm = upload::<f32>(g, &[0; 4]);
    let mut os = vec![poisoned::<f32>(g, 10), poisoned::<f32>(g, 10)];
    for (hidden, eps, algo, what) in [
        (4usize, NORM_EPS, AlgoChoice::Auto, "10 elements, hidden 4"),
        (2, f32::NAN, AlgoChoice::Auto, "eps NaN"),
        (2, -1.0, AlgoChoice::Auto, "eps < 0"),
        (2, NORM_EPS, AlgoChoice::Push, "push"),
    ] {
        let gv = gm.slice(0..hidden);
        let r = grp.allreduce_add_rmsnorm(
            &g.stream,
            &[&x, &x],
            &mut rs,
            &[&gv, &gv],
            eps,
            &mut os,
            algo,
        );
        let ok = match algo {
            AlgoChoice::Push => matches!(r, Err(Error::NormAlgorithm(Algorithm::Push))),
            _ => matches!(r, Err(Error::NormShape(_))),
        };
        assert!(ok, "{what}: {r:?}");
    }
    grp.check(&g.stream)
        .expect("refusals leave the group healthy");

    // Real ranks: a PeerGroup on every placement (across GPUs when there
    // are two), bf16 hidden 7168, as in decoding.
    let ctxs = all_gpus(g);
    let mut peer_cases = 0;
    for place in placements(ctxs.len()) {
        let world = place.len();
        let (pg, streams) = peer_setup(&ctxs, &place, Config::with_max_bytes(1 << 20));
        for rows in [0usize, 1, 3, 64] {
            for algo in [
                AlgoChoice::OneStage,
                AlgoChoice::TwoStage,
                AlgoChoice::PushLl,
                AlgoChoice::Auto,
            ] {
                let c = NormCase {
                    dtype: Dtype::Bf16,
                    world,
                    rows,
                    hidden: 7168,
                    seed: 9000 + peer_cases as u64 * 3,
                };
                let count = rows * 7168;
                let (x, res, gam, want) = c.data();
                let what = format!("PeerGroup GPUs {place:?} rows {rows} {algo:?}");
                let xs: Vec<CudaSlice<half::bf16>> = x
                    .iter()
                    .zip(&streams)
                    .map(|(b, s)| upload_on(s, b))
                    .collect();
                let mut rs: Vec<CudaSlice<half::bf16>> = res
                    .iter()
                    .zip(&streams)
                    .map(|(b, s)| upload_on(s, b))
                    .collect();
                let gs: Vec<CudaSlice<half::bf16>> = gam
                    .iter()
                    .zip(&streams)
                    .map(|(b, s)| upload_on(s, b))
                    .collect();
                let mut outs: Vec<CudaSlice<half::bf16>> =
                    streams.iter().map(|s| poisoned_on(s, count)).collect();
                {
                    let xv: Vec<_> = xs.iter().map(|s| s.slice(0..count)).collect();
                    let xr: Vec<&_> = xv.iter().collect();
                    let gv: Vec<_> = gs.iter().map(|s| s.slice(0..7168)).collect();
                    let gr: Vec<&_> = gv.iter().collect();
                    let mut rv: Vec<_> = rs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
                    let mut ov: Vec<_> = outs.iter_mut().map(|s| s.slice_mut(0..count)).collect();
                    pg.allreduce_add_rmsnorm(&streams, &xr, &mut rv, &gr, NORM_EPS, &mut ov, algo)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                pg.check(&streams).unwrap_or_else(|e| panic!("{what}: {e}"));
                for r in 0..world {
                    let got_res = download_on(&streams[r], &rs[r], count);
                    let got_norm = download_on(&streams[r], &outs[r], count);
                    check_norm_rank(&what, Dtype::Bf16, r, (&got_res, &got_norm), &want[r]);
                }
                peer_cases += 1;
            }
        }
    }
    assert!(refused > 0, "no push_ll refusal case ran");
    println!("  {cases} virtual-rank and {peer_cases} PeerGroup fused cases bit-exact (residual out and normed, every rank); {refused} push_ll calls off the register path refused untouched");
}
