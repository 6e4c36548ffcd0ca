//! Numerics against the CPU reference: smoke, kernel images, the sweep,
//! random properties, cross-algorithm agreement and chunked messages.

use crate::fused::{norm_virtual, takes_push_ll, NormCase};
use crate::harness::*;

// ---------------------------------------------------------------------------
// Cases.

pub(crate) fn smoke(g: &Gpu) {
    let info = driver::device_info(&g.ctx).expect("device info");
    let m = driver::module_for_device(&g.ctx).expect("module");
    println!(
        "  device: {} (cc {}.{}), {} SMs; PTX used: {}",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        m.arch
    );
    let grp = group(g, 2);
    let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 + 1.0).collect();
    let b: Vec<f32> = (0..1000).map(|i| -(i as f32) * 0.25 + 3.0).collect();
    let ia = g.stream.clone_htod(&a).expect("htod");
    let ib = g.stream.clone_htod(&b).expect("htod");
    let mut outs = vec![poisoned::<f32>(g, 1000), poisoned::<f32>(g, 1000)];
    grp.allreduce(&g.stream, &[&ia, &ib], &mut outs, AlgoChoice::OneStage)
        .expect("allreduce");
    grp.check(&g.stream).expect("check");
    for o in &outs {
        let h = g.stream.clone_dtoh(o).expect("dtoh");
        for i in 0..1000 {
            assert_eq!(h[i].to_bits(), (a[i] + b[i]).to_bits(), "element {i}");
        }
    }
    println!(
        "  smoke: 2 virtual ranks x 1000 f32 summed correctly; out[3] = {}",
        g.stream.clone_dtoh(&outs[0]).expect("dtoh")[3]
    );
}

/// The embedded cubin is what a default group runs on this device where the
/// build has one for it (a refusal by the driver fails here, loudly), and a
/// group that asks for the PTX (JIT-compiled: tens of seconds) gives the
/// same bits: every algorithm at a few lengths, and the fused kernels.
pub(crate) fn kernel_images(g: &Gpu) {
    let m = driver::module_for_device(&g.ctx).expect("module");
    let info = driver::device_info(&g.ctx).expect("device info");
    let default_group = group(g, 2);
    let auto = driver::Kernels::for_context(&g.ctx, ImageChoice::Auto).expect("kernels");
    if m.runs_sass_on(info.compute_capability) {
        assert_eq!(
            auto.image(),
            &LoadedImage::Sass,
            "this build has a cubin for {} and the device is cc {:?}",
            m.arch,
            info.compute_capability
        );
    } else {
        assert!(matches!(auto.image(), LoadedImage::Ptx(_)));
    }
    println!("  default image: {}", auto.image());
    drop(default_group);
    drop(auto);
    let t0 = Instant::now();
    let fresh = driver::Kernels::load(&g.ctx, ImageChoice::Auto).expect("kernels");
    println!(
        "  {} loaded in {:.2} s",
        fresh.image(),
        t0.elapsed().as_secs_f64()
    );
    drop(fresh);
    let t0 = Instant::now();
    let jit = VirtualGroup::new(
        &g.ctx,
        3,
        Config {
            kernel_image: ImageChoice::Ptx,
            ..Config::with_max_bytes(256 << 10)
        },
    )
    .expect("VirtualGroup::new with the PTX");
    let ptx = driver::Kernels::for_context(&g.ctx, ImageChoice::Ptx).expect("kernels");
    assert_eq!(ptx.image(), &LoadedImage::Ptx(PtxBecause::Asked));
    println!("  PTX module loaded in {:.1} s", t0.elapsed().as_secs_f64());
    let mut n = 0;
    for dtype in Dtype::ALL {
        for algo in Algorithm::ALL {
            for (k, len) in [1usize, 4099, 65_537].into_iter().enumerate() {
                let spec = Spec {
                    dtype,
                    world: 3,
                    len,
                    algo,
                    registered: k == 1,
                    graph: false,
                    seed: 77 + n,
                };
                run_case(g, &jit, spec);
                n += 1;
            }
        }
    }
    for (dtype, hidden, rows) in [
        (Dtype::Bf16, 7168, 3),
        (Dtype::F32, 7, 5),
        (Dtype::F16, 4096, 2),
    ] {
        let c = NormCase {
            dtype,
            world: 3,
            rows,
            hidden,
            seed: 900 + n,
        };
        for algo in [AlgoChoice::OneStage, AlgoChoice::TwoStage, AlgoChoice::Auto] {
            match dtype {
                Dtype::F32 => norm_virtual::<f32>(g, &jit, &c, algo, false),
                Dtype::F16 => norm_virtual::<half::f16>(g, &jit, &c, algo, false),
                Dtype::Bf16 => norm_virtual::<half::bf16>(g, &jit, &c, algo, false),
            };
            n += 1;
        }
        if takes_push_ll(dtype, hidden) {
            match dtype {
                Dtype::F32 => norm_virtual::<f32>(g, &jit, &c, AlgoChoice::PushLl, true),
                Dtype::F16 => norm_virtual::<half::f16>(g, &jit, &c, AlgoChoice::PushLl, true),
                Dtype::Bf16 => norm_virtual::<half::bf16>(g, &jit, &c, AlgoChoice::PushLl, true),
            };
            n += 1;
        }
    }
    println!("  {n} cases bit-exact on the JIT-compiled PTX");
}

/// Lengths around every boundary: empty, sub-pack, pack multiples +-1, one
/// block's worth, many blocks.
const LENGTHS: &[usize] = &[
    0, 1, 3, 4, 7, 8, 9, 15, 17, 100, 511, 4096, 4099, 65_537, 262_147,
];

pub(crate) fn sweep(g: &Gpu) {
    let mut n = 0;
    for world in 1..=8 {
        let grp = group(g, world);
        for dtype in Dtype::ALL {
            for algo in Algorithm::ALL {
                for (k, &len) in LENGTHS.iter().enumerate() {
                    let seed = (world * 1000 + k) as u64;
                    run_case(
                        g,
                        &grp,
                        Spec {
                            dtype,
                            world,
                            len,
                            algo,
                            registered: k % 2 == 1,
                            graph: false,
                            seed,
                        },
                    );
                    n += 1;
                }
            }
        }
    }
    println!("  {n} sweep cases bit-exact");
}

/// A tiny deterministic generator for case parameters.
pub(crate) fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(crate) fn property(g: &Gpu) {
    let cases: usize = std::env::var("GPU_PROPERTY_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1200);
    let groups: Vec<VirtualGroup> = (1..=8).map(|w| group(g, w)).collect();
    let mut st = 0x5EED_u64;
    for c in 0..cases {
        let world = 1 + (next(&mut st) % 8) as usize;
        let dtype = Dtype::ALL[(next(&mut st) % 3) as usize];
        // Mostly small (the latency regime), sometimes up to ~1M elements.
        let len = match next(&mut st) % 10 {
            0..=5 => (next(&mut st) % 2048) as usize,
            6..=8 => (next(&mut st) % 70_000) as usize,
            _ => (next(&mut st) % 1_100_000) as usize,
        };
        let algo = Algorithm::ALL[(next(&mut st) % Algorithm::ALL.len() as u64) as usize];
        // Zero-copy inputs larger than the algorithm's landing zone are
        // refused with `ZoneTooSmall`: such cases run staged, chunked.
        let fits = groups[world - 1]
            .config()
            .zone_capacity(algo)
            .is_none_or(|cap| len * dtype.size() <= cap);
        let registered = next(&mut st) % 2 == 0 && fits;
        let graph = len > 0 && next(&mut st) % 4 == 0;
        run_case(
            g,
            &groups[world - 1],
            Spec {
                dtype,
                world,
                len,
                algo,
                registered,
                graph,
                seed: c as u64 + 77,
            },
        );
    }
    println!("  {cases} random property cases bit-exact (dtype x world 1..8 x len x algorithm x registered/staged x eager/graph)");
}

/// One-stage and two-stage give identical bits, and element i does not depend
/// on the message length (a prefix of the same data gives a prefix of the result).
pub(crate) fn cross_algorithm(g: &Gpu) {
    for world in [2usize, 3, 5, 8] {
        let grp = group(g, world);
        for dtype in Dtype::ALL {
            let len = 50_003;
            let inputs = values::adversarial_inputs(dtype, world, len, 99 + world as u64, true);
            let mut results = Vec::new();
            for algo in Algorithm::ALL {
                for take in [len, 4099, 13] {
                    let sub: Vec<Vec<u32>> = inputs.iter().map(|v| v[..take].to_vec()).collect();
                    let got = match dtype {
                        Dtype::F32 => reduce_raw::<f32>(g, &grp, &sub, algo),
                        Dtype::F16 => reduce_raw::<half::f16>(g, &grp, &sub, algo),
                        Dtype::Bf16 => reduce_raw::<half::bf16>(g, &grp, &sub, algo),
                    };
                    results.push((algo, take, got));
                }
            }
            let full = &results[0].2;
            for (algo, take, got) in &results {
                if let Some((i, a, b)) = reference::first_mismatch(dtype, got, &full[..*take]) {
                    panic!("{dtype:?} world {world}: {algo:?} with length {take} differs from one-stage full length at {i}: {a:#x} vs {b:#x}");
                }
            }
        }
    }
    println!("  one-stage == two-stage, and prefixes agree, for worlds 2,3,5,8 x all dtypes");
}

fn reduce_raw<T: Bits>(
    g: &Gpu,
    grp: &VirtualGroup,
    inputs: &[Vec<u32>],
    algo: Algorithm,
) -> Vec<u32> {
    let len = inputs[0].len();
    let ins: Vec<CudaSlice<T>> = inputs.iter().map(|b| upload::<T>(g, b)).collect();
    let refs: Vec<&CudaSlice<T>> = ins.iter().collect();
    let mut outs: Vec<CudaSlice<T>> = (0..inputs.len()).map(|_| poisoned::<T>(g, len)).collect();
    grp.allreduce(&g.stream, &refs, &mut outs, algo.into())
        .expect("allreduce");
    grp.check(&g.stream).expect("check");
    let first = download::<T>(g, &outs[0], len);
    for (r, o) in outs.iter().enumerate().skip(1) {
        assert_eq!(
            download::<T>(g, o, len),
            first,
            "rank {r} differs from rank 0"
        );
    }
    first
}

pub(crate) fn chunked(g: &Gpu) {
    // 64 KiB buffers, messages of several MiB: many chunks, odd tail.
    for world in [2usize, 3, 8] {
        let grp = VirtualGroup::new(
            &g.ctx,
            world,
            Config {
                max_bytes: 64 << 10,
                ..Config::default()
            },
        )
        .expect("group");
        for dtype in Dtype::ALL {
            for algo in Algorithm::ALL {
                run_case(
                    g,
                    &grp,
                    Spec {
                        dtype,
                        world,
                        len: 1_000_003,
                        algo,
                        registered: false,
                        graph: false,
                        seed: 3,
                    },
                );
            }
        }
        // Registered inputs larger than scratch: Auto runs one-stage (same
        // bits), an explicit two-stage is refused rather than changed.
        let reg = grp.alloc_registered::<f32>(300_001).expect("registered");
        let mut outs: Vec<CudaSlice<f32>> =
            (0..world).map(|_| poisoned::<f32>(g, 300_001)).collect();
        assert!(matches!(
            grp.allreduce_registered(&g.stream, &reg, 300_001, &mut outs, AlgoChoice::TwoStage),
            Err(Error::ScratchTooSmall { .. })
        ));
        let used = grp
            .allreduce_registered(&g.stream, &reg, 300_001, &mut outs, AlgoChoice::Auto)
            .expect("registered large");
        assert_eq!(used, Algorithm::OneStage);
        grp.check(&g.stream).expect("check");
    }
    let small = VirtualGroup::new(
        &g.ctx,
        2,
        Config {
            max_bytes: 4096,
            chunking: false,
            ..Config::default()
        },
    )
    .expect("group");
    let a = g.stream.clone_htod(&vec![1.0f32; 5000]).expect("htod");
    let mut outs = vec![poisoned::<f32>(g, 5000), poisoned::<f32>(g, 5000)];
    match small.allreduce(&g.stream, &[&a, &a], &mut outs, AlgoChoice::Auto) {
        Err(Error::MessageTooLarge {
            bytes: 20000,
            capacity: 4096,
        }) => {}
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    println!("  chunked messages bit-exact; chunking off refuses with MessageTooLarge");
}
