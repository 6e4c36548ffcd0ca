//! `p2p-allreduce info --load-times`: how long the embedded kernels take to
//! load on one GPU (decompression, cuModuleLoadData of the cubin, JIT
//! compilation of the PTX per family), and the first call of a world-2 bf16
//! group that loads the PTX.

use crate::fmt_bytes;
use p2p_allreduce::driver::{self, Kernels};
use p2p_allreduce::ptx::{self, Family, ImageChoice, LoadedImage};
use p2p_allreduce::{AlgoChoice, Config, Dtype, VirtualGroup};
use std::error::Error;
use std::process::ExitCode;
use std::time::Instant;

pub fn run(gpu: usize, whole_ptx: bool) -> ExitCode {
    // The GPU part first: it times the first decompression of its images.
    let mut code = ExitCode::SUCCESS;
    if !driver::driver_present() {
        println!("no CUDA driver found (libcuda could not be loaded): decompression times only");
    } else {
        match measure(gpu, whole_ptx) {
            Ok(()) => {}
            Err(e) => {
                eprintln!("info --load-times: {e}");
                code = ExitCode::from(1);
            }
        }
    }
    decompression();
    code
}

/// Decompresses every embedded image not decompressed yet, timing each.
fn decompression() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "decompression of each embedded image not loaded above ({threads} hardware threads here):"
    );
    let mut images: Vec<(String, &'static ptx::Image)> = Vec::new();
    for m in ptx::MODULES {
        if images
            .iter()
            .all(|(n, _)| *n != format!("PTX {}", m.ptx_arch))
        {
            images.push((format!("PTX {}", m.ptx_arch), m.ptx_image()));
        }
        if let Some(c) = m.cubin_image() {
            images.push((format!("SASS {}", m.arch), c));
        }
    }
    for (name, image) in images {
        if image.is_decompressed() {
            continue;
        }
        let t = Instant::now();
        image.bytes();
        let took = ms(t);
        println!(
            "  {name:<12} {} -> {}: {took:.1} ms ({:.0} MB/s)",
            fmt_bytes(image.compressed_len() as u64),
            fmt_bytes(image.len() as u64),
            image.len() as f64 / 1e3 / took
        );
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn measure(gpu: usize, whole_ptx: bool) -> Result<(), Box<dyn Error>> {
    if std::env::var("CUDA_CACHE_DISABLE").as_deref() != Ok("1") {
        println!("note: CUDA_CACHE_DISABLE is not 1: the driver's JIT cache may answer the PTX loads below from disk");
    }
    let ctx = driver::open_device(gpu)?;
    let info = driver::device_info(&ctx)?;
    let cc = info.compute_capability;
    let m = driver::module_for_device(&ctx)?;
    println!(
        "GPU {gpu}: {} (cc {}.{}): module {} (PTX {})",
        info.name, cc.0, cc.1, m.arch, m.ptx_arch
    );

    // The cubin: decompression (the first in this process) and load.
    match m.cubin_image() {
        Some(image) if m.runs_sass_on(cc) => {
            let fresh = !image.is_decompressed();
            let t = Instant::now();
            m.cubin();
            let decompress = ms(t);
            let t = Instant::now();
            let k = Kernels::load(&ctx, ImageChoice::Auto)?;
            let load = ms(t);
            if k.image() != &LoadedImage::Sass {
                println!("SASS {}: not loaded: {}", m.arch, k.image());
            } else {
                println!(
                    "SASS {}: decompress {} -> {}: {decompress:.1} ms{}; cuModuleLoadData: {load:.1} ms; together {:.1} ms",
                    m.arch,
                    fmt_bytes(image.compressed_len() as u64),
                    fmt_bytes(image.len() as u64),
                    if fresh { "" } else { " (already decompressed)" },
                    decompress + load
                );
            }
        }
        Some(_) => println!(
            "SASS: none runs on cc {}.{} (it JIT-compiles the PTX)",
            cc.0, cc.1
        ),
        None => println!("SASS: this build embeds none (no ptxas at build time)"),
    }

    // The PTX: decompression, then one family's JIT compilation.
    let image = m.ptx_image();
    let t = Instant::now();
    m.ptx();
    println!(
        "PTX {}: decompress {} -> {}: {:.1} ms",
        m.ptx_arch,
        fmt_bytes(image.compressed_len() as u64),
        fmt_bytes(image.len() as u64),
        ms(t)
    );
    let family = Family {
        dtype: Dtype::Bf16,
        world: 2,
        virtual_ranks: true,
    };
    let k = Kernels::load(&ctx, ImageChoice::Ptx)?;
    let t = Instant::now();
    k.load_family(family)?;
    println!(
        "PTX {}: JIT of one family (bf16, world 2, virtual ranks: 9 entries, {} of PTX): {:.2} s",
        m.ptx_arch,
        fmt_bytes(m.family_ptx(family).len() as u64),
        ms(t) / 1e3
    );
    drop(k);

    first_call(&ctx)?;

    if whole_ptx {
        let t = Instant::now();
        Kernels::load_whole_ptx(&ctx)?;
        println!(
            "PTX {}: JIT of the whole module (all 432 entries, {}), as before per-family loading: {:.2} s",
            m.ptx_arch,
            fmt_bytes(image.len() as u64),
            ms(t) / 1e3
        );
    }
    Ok(())
}

/// A world-2 bf16 VirtualGroup that loads the PTX: its creation (which
/// JIT-compiles the group's three families) and its first allreduce, whose
/// result is checked bit for bit against the CPU sum.
fn first_call(
    ctx: &std::sync::Arc<p2p_allreduce::cudarc::driver::CudaContext>,
) -> Result<(), Box<dyn Error>> {
    use half::bf16;
    const N: usize = 65_536;
    let stream = ctx.new_stream()?;
    // Small integers: every sum is exact in bf16, so the bits are known.
    let a: Vec<bf16> = (0..N)
        .map(|i| bf16::from_f32(((i * 7) % 17) as f32 - 8.0))
        .collect();
    let b: Vec<bf16> = (0..N)
        .map(|i| bf16::from_f32(((i * 5) % 13) as f32 - 6.0))
        .collect();
    let ia = stream.clone_htod(&a)?;
    let ib = stream.clone_htod(&b)?;
    // Poisoned outputs (a NaN pattern), so a kernel that writes nothing fails.
    let poison = vec![bf16::from_bits(0x7fc1); N];
    let mut outs = vec![stream.clone_htod(&poison)?, stream.clone_htod(&poison)?];
    stream.synchronize()?;
    let t = Instant::now();
    let group = VirtualGroup::new(
        ctx,
        2,
        Config {
            kernel_image: ImageChoice::Ptx,
            ..Config::with_max_bytes(1 << 20)
        },
    )?;
    let created = ms(t);
    let t1 = Instant::now();
    let algo = group.allreduce(&stream, &[&ia, &ib], &mut outs, AlgoChoice::Auto)?;
    group.check(&stream)?;
    let call = ms(t1);
    let total = ms(t);
    for (r, o) in outs.iter().enumerate() {
        let got = stream.clone_dtoh(o)?;
        for i in 0..N {
            let want = bf16::from_f32(a[i].to_f32() + b[i].to_f32());
            if got[i].to_bits() != want.to_bits() {
                return Err(format!(
                    "first call on the PTX: rank {r} element {i}: got {} want {}",
                    got[i], want
                )
                .into());
            }
        }
    }
    println!(
        "world-2 bf16 VirtualGroup, ImageChoice::Ptx: VirtualGroup::new {:.2} s (JIT of its 3 families, one per dtype, concurrently), first allreduce ({}, {N} elements) {call:.1} ms; first call in all {:.2} s; bit-exact on both ranks",
        created / 1e3,
        algo.name(),
        total / 1e3
    );
    Ok(())
}
