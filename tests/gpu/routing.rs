//! Routing: the thresholds file that moves `Auto`, and the NCCL group's
//! routing and table bands (feature `nccl`).

use crate::harness::*;

/// NCCL (feature `nccl`), loaded without any link made by hand: across
/// every GPU when there are two or more (NCCL refuses two ranks on one
/// device; with one GPU only world 1, which still checks the wiring). Two
/// ranks' sums are a single addition, so NCCL's bits equal the reference's
/// then. Also `PeerGroup::allreduce_routed`'s hand-over above `nccl_above`.
#[cfg(feature = "nccl")]
pub(crate) fn nccl_routed(g: &Gpu) {
    use p2p_allreduce::nccl::{self, NcclGroup};
    use p2p_allreduce::Route;
    let (path, version) = nccl::library().expect("libnccl found without a hand-made link");
    println!("  NCCL {version} from {path}");
    let ctxs = all_gpus(g);
    let world = ctxs.len().min(2);
    let streams: Vec<Arc<CudaStream>> = ctxs[..world]
        .iter()
        .map(|c| c.new_stream().expect("stream"))
        .collect();
    let n = NcclGroup::new(&streams).expect("NCCL communicators");
    let len = 10_007;
    let bits = values::adversarial_inputs(Dtype::F32, world, len, 5, false);
    let refs: Vec<&[u32]> = bits.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(Dtype::F32, &refs);
    let inputs: Vec<CudaSlice<f32>> = bits
        .iter()
        .zip(&streams)
        .map(|(b, s)| upload_on::<f32>(s, b))
        .collect();
    let in_refs: Vec<&CudaSlice<f32>> = inputs.iter().collect();
    let mut outs: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
    n.allreduce(&streams, &in_refs, &mut outs)
        .expect("ncclAllReduce");
    let got: Vec<Vec<u32>> = outs
        .iter()
        .zip(&streams)
        .map(|(o, s)| download_on(s, o, len))
        .collect();
    assert_ranks(&format!("NCCL world {world}"), Dtype::F32, &got, &want);

    let rank_ctxs: Vec<Arc<CudaContext>> = ctxs[..world].to_vec();
    let mut grp = PeerGroup::new(
        &rank_ctxs,
        Config {
            nccl_above: Some(1024),
            ..Config::default()
        },
    )
    .expect("group");
    grp.enable_nccl(&streams).expect("enable_nccl");
    // Below nccl_above, Auto's own choice for this link (push over NVLink).
    let small = grp
        .config()
        .thresholds
        .choose(AlgoChoice::Auto, 400, world, grp.link());
    for (len, want_route) in [(10_007usize, Route::Nccl), (100, Route::Kernel(small))] {
        let mut outs: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
        let ins: Vec<CudaSlice<f32>> = bits
            .iter()
            .zip(&streams)
            .map(|(b, s)| upload_on::<f32>(s, &b[..len]))
            .collect();
        let in_refs: Vec<&CudaSlice<f32>> = ins.iter().collect();
        let route = grp
            .allreduce_routed(&streams, &in_refs, &mut outs, AlgoChoice::Auto)
            .expect("routed");
        grp.check(&streams).expect("check");
        assert_eq!(route, want_route, "len {len}");
        let got: Vec<Vec<u32>> = outs
            .iter()
            .zip(&streams)
            .map(|(o, s)| download_on(s, o, len))
            .collect();
        assert_ranks(
            &format!("routed len {len} via {route:?}"),
            Dtype::F32,
            &got,
            &want[..len],
        );
    }
    println!(
        "  NCCL world {world} (GPUs 0..{world}): allreduce equals the reference; Auto hands messages above nccl_above to NCCL, smaller ones to the kernels"
    );
}

/// Issue 44: a table that gives NCCL a size band makes
/// `PeerGroup::allreduce_routed` run NCCL there under `Auto` (and
/// `nccl_wins` say so) and the kernels elsewhere, while deterministic
/// routing keeps every size ours; NCCL's symmetric windows (NCCL >= 2.27)
/// sum two ranks as the reference does (one addition). Needs two GPUs
/// (NCCL refuses two ranks on one device).
#[cfg(feature = "nccl")]
pub(crate) fn nccl_table_routing(g: &Gpu) {
    use p2p_allreduce::nccl::{self, NcclGroup};
    use p2p_allreduce::thresholds::{Backend, Mode, WinnerBand};
    use p2p_allreduce::{Link, Route};
    let ctxs = all_gpus(g);
    if ctxs.len() < 2 {
        println!("  not run (this machine has 1 GPU: NCCL needs one GPU per rank)");
        return;
    }
    let world = 2;
    let streams: Vec<Arc<CudaStream>> = ctxs[..world]
        .iter()
        .map(|c| c.new_stream().expect("stream"))
        .collect();
    // NCCL wins 4 KiB < bytes <= 64 KiB, ours elsewhere, on every link.
    let mut config = Config::default();
    for link in [Link::SameDevice, Link::NvLink, Link::Pcie] {
        config
            .thresholds
            .set_winners(
                link,
                world,
                vec![
                    WinnerBand {
                        up_to: 4096,
                        winner: Backend::Ours,
                        margin: Some(0.5),
                    },
                    WinnerBand {
                        up_to: 64 << 10,
                        winner: Backend::Nccl,
                        margin: Some(0.25),
                    },
                    WinnerBand {
                        up_to: usize::MAX,
                        winner: Backend::Ours,
                        margin: Some(0.1),
                    },
                ],
            )
            .expect("winners");
    }
    let mut grp = PeerGroup::new(&ctxs[..world], config).expect("group");
    grp.enable_nccl(&streams).expect("enable_nccl");
    let len_max = 100_000;
    let bits = values::adversarial_inputs(Dtype::F32, world, len_max, 44, false);
    let refs: Vec<&[u32]> = bits.iter().map(|v| v.as_slice()).collect();
    let want = reference::allreduce_bits(Dtype::F32, &refs);
    for (len, nccl_band) in [
        (1000usize, false),
        (1024, false),
        (1025, true),
        (16_384, true),
        (16_385, false),
        (len_max, false),
    ] {
        let bytes = len * 4;
        assert_eq!(grp.nccl_wins(len, Dtype::F32), nccl_band, "{bytes} B");
        assert_eq!(
            grp.route(len, Dtype::F32, Mode::Deterministic),
            Backend::Ours
        );
        let want_route = if nccl_band {
            Route::Nccl
        } else {
            Route::Kernel(
                grp.config()
                    .choose(AlgoChoice::Auto, bytes, world, grp.link()),
            )
        };
        let ins: Vec<CudaSlice<f32>> = bits
            .iter()
            .zip(&streams)
            .map(|(b, s)| upload_on::<f32>(s, &b[..len]))
            .collect();
        let in_refs: Vec<&CudaSlice<f32>> = ins.iter().collect();
        let mut outs: Vec<CudaSlice<f32>> = streams.iter().map(|s| poisoned_on(s, len)).collect();
        let route = grp
            .allreduce_routed(&streams, &in_refs, &mut outs, AlgoChoice::Auto)
            .expect("routed");
        grp.check(&streams).expect("check");
        assert_eq!(route, want_route, "{bytes} B");
        // An explicit algorithm never goes to NCCL.
        let explicit = grp
            .allreduce_routed(&streams, &in_refs, &mut outs, AlgoChoice::OneStage)
            .expect("explicit");
        grp.check(&streams).expect("check");
        assert_eq!(explicit, Route::Kernel(Algorithm::OneStage), "{bytes} B");
        let got: Vec<Vec<u32>> = outs
            .iter()
            .zip(&streams)
            .map(|(o, s)| download_on(s, o, len))
            .collect();
        assert_ranks(
            &format!("routed {bytes} B via {route:?}"),
            Dtype::F32,
            &got,
            &want[..len],
        );
    }
    match nccl::symmetric_support() {
        Err(e) => println!("  symmetric windows: not run ({e})"),
        Ok(()) => {
            let len = 10_007;
            let mut n = NcclGroup::new(&streams).expect("NCCL communicators");
            let sym = n.enable_symmetric(len * 4).expect("symmetric windows");
            assert_eq!(n.symmetric().as_ref(), Some(&sym));
            for (r, s) in streams.iter().enumerate() {
                // SAFETY: the window input holds len f32 on rank r's device.
                unsafe { driver::write_at(s.context(), sym.inputs[r], &bits[r][..len]) }
                    .expect("write the window input");
            }
            // SAFETY: the windows hold len elements and outlive the call
            // (synchronised below).
            unsafe { n.allreduce_raw(&streams, Dtype::F32, len, &sym.inputs, &sym.outputs) }
                .expect("ncclAllReduce on the windows");
            let mut outs: Vec<CudaSlice<f32>> =
                streams.iter().map(|s| poisoned_on(s, len)).collect();
            for ((o, s), &w) in outs.iter_mut().zip(&streams).zip(&sym.outputs) {
                let dst = o.device_ptr_mut(s).0;
                // SAFETY: both hold len f32 on this rank's device, ordered
                // after the allreduce on the same stream.
                unsafe { driver::copy_dtod_async(s, dst, w, len * 4) }.expect("copy out");
            }
            let got: Vec<Vec<u32>> = outs
                .iter()
                .zip(&streams)
                .map(|(o, s)| download_on(s, o, len))
                .collect();
            assert_ranks("NCCL on symmetric windows", Dtype::F32, &got, &want[..len]);
            drop(n);
            println!("  symmetric windows: ncclMemAlloc + ncclCommWindowRegister, allreduce equals the reference, released on drop");
        }
    }
    println!(
        "  PeerGroup on GPUs 0,1 ({:?}): Auto hands the table's NCCL band to NCCL and the rest to the kernels; deterministic routing keeps every size ours",
        grp.link()
    );
}

// ---------------------------------------------------------------------------
// Thresholds files: a hand-made table changes what Auto runs.

/// Sets `P2P_ALLREDUCE_THRESHOLDS` for the life of the guard.
struct ThresholdsEnv;

impl ThresholdsEnv {
    fn set(value: &std::path::Path) -> Self {
        // The suite runs its cases one at a time on one thread.
        std::env::set_var(p2p_allreduce::thresholds::ENV_VAR, value);
        ThresholdsEnv
    }
}

impl Drop for ThresholdsEnv {
    fn drop(&mut self) {
        std::env::remove_var(p2p_allreduce::thresholds::ENV_VAR);
    }
}

pub(crate) fn thresholds_file(g: &Gpu) {
    use p2p_allreduce::thresholds::{FileBand, Origin, ThresholdsFile, TunedTable, FORMAT};
    let dir = std::env::temp_dir().join(format!("p2p-thresholds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("thresholds.json");
    let gpu = driver::device_info(&g.ctx).expect("device info").name;
    let gpus = driver::device_count().expect("device count");
    // World 3 on this GPU: push_ll up to 64 bytes, then push_two_stage
    // (the built-in table never pushes on one device).
    let file = ThresholdsFile {
        format: FORMAT.into(),
        tables: vec![TunedTable {
            gpu,
            gpus,
            links: vec![],
            link: "same".into(),
            world: 3,
            dtype: "f32".into(),
            measured: "gpu suite, hand-made".into(),
            bands: vec![
                FileBand {
                    up_to: Some(64),
                    algorithm: "push_ll".into(),
                    winner: None,
                    margin: None,
                },
                FileBand {
                    up_to: None,
                    algorithm: "push_two_stage".into(),
                    winner: None,
                    margin: None,
                },
            ],
        }],
    };
    std::fs::write(&path, file.to_json()).expect("write thresholds file");
    let _env = ThresholdsEnv::set(&path);
    let grp = VirtualGroup::new(&g.ctx, 3, Config::with_max_bytes(1 << 20)).expect("group");
    assert!(
        matches!(grp.config().thresholds.origin(), Origin::File { .. }),
        "{:?}",
        grp.config().thresholds.origin()
    );
    for (len, want) in [
        (16usize, Algorithm::PushLl),
        (100_003, Algorithm::PushTwoStage),
    ] {
        let inputs = values::adversarial_inputs(Dtype::F32, 3, len, 77 + len as u64, true);
        let refs: Vec<&[u32]> = inputs.iter().map(|v| v.as_slice()).collect();
        let expect = reference::allreduce_bits(Dtype::F32, &refs);
        let ins: Vec<CudaSlice<f32>> = inputs.iter().map(|b| upload::<f32>(g, b)).collect();
        let in_refs: Vec<&CudaSlice<f32>> = ins.iter().collect();
        let mut outs: Vec<CudaSlice<f32>> = (0..3).map(|_| poisoned::<f32>(g, len)).collect();
        let used = grp
            .allreduce(&g.stream, &in_refs, &mut outs, AlgoChoice::Auto)
            .expect("allreduce");
        assert_eq!(used, want, "len {len}");
        grp.check(&g.stream).expect("check");
        let got: Vec<Vec<u32>> = outs.iter().map(|o| download(g, o, len)).collect();
        assert_ranks(&format!("file table, len {len}"), Dtype::F32, &got, &expect);
    }
    // No entry for world 2: the built-in table.
    let two = VirtualGroup::new(&g.ctx, 2, Config::with_max_bytes(1 << 20)).expect("group");
    assert_eq!(two.config().thresholds.origin(), &Origin::BuiltIn);
    // A broken file, and a named file that does not exist: typed errors.
    std::fs::write(&path, "{ not json").expect("write");
    let r = VirtualGroup::new(&g.ctx, 3, Config::with_max_bytes(1 << 20));
    assert!(matches!(r, Err(Error::ThresholdsFile { .. })), "{r:?}");
    let _missing = ThresholdsEnv::set(&dir.join("missing.json"));
    let r = VirtualGroup::new(&g.ctx, 3, Config::with_max_bytes(1 << 20));
    assert!(matches!(r, Err(Error::ThresholdsFile { .. })), "{r:?}");
    // `none`: the built-in table, whatever the files say.
    let _none = ThresholdsEnv::set(std::path::Path::new("none"));
    let r = VirtualGroup::new(&g.ctx, 3, Config::with_max_bytes(1 << 20)).expect("group");
    assert_eq!(r.config().thresholds.origin(), &Origin::BuiltIn);
    let _ = std::fs::remove_dir_all(&dir);
}
