//! A downstream crate embedding p2p-allreduce the way an inference engine
//! would: first as a kernel provider (PTX + ABI, no GPU needed), then through
//! the host API with a two-rank `PeerGroup` (only when a GPU is present).

use p2p_allreduce::abi::LaunchArgs;
use p2p_allreduce::cudarc::driver::{CudaSlice, CudaStream};
use p2p_allreduce::ptx::{self, Entry};
use p2p_allreduce::{driver, AlgoChoice, Algorithm, Config, Dtype, Error, PeerGroup};
use std::sync::Arc;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Elements per rank buffer.
const LEN: usize = 1024;
/// The sub-range reduced through views. Outputs must be 16-byte aligned, so
/// the start is a multiple of 4 f32s; the length (937) may be anything.
const SUB: std::ops::Range<usize> = 64..1001;

fn main() -> Res<()> {
    kernel_provider();

    // cudarc loads libcuda at run time (and panics without it): ask first.
    if !driver::driver_present() {
        println!("skipped: no CUDA driver (libcuda not found); the PTX part above needs none");
        return Ok(());
    }
    match driver::device_count() {
        Ok(n) if n > 0 => return host_api(n),
        // A driver without a usable GPU (cuInit: no device) is also a skip.
        Ok(_) => println!("skipped: CUDA driver present but no GPU"),
        Err(e) => println!("skipped: CUDA driver present but no usable GPU: {e}"),
    }
    Ok(())
}

/// Part 1: an engine with its own launcher only needs the PTX text, the
/// entry name and the layout of the single by-value parameter.
fn kernel_provider() {
    let module = ptx::module_for((9, 0)).expect("this build embeds PTX for sm_90");
    let entry = Entry {
        op: p2p_allreduce::ptx::Op::Allreduce,
        algorithm: Algorithm::OneStage,
        dtype: Dtype::Bf16,
        world: 8,
        virtual_ranks: false,
    };
    println!("built archs: {:?}", ptx::built_archs());
    // The PTX and the cubin are embedded compressed; `ptx()` and `cubin()`
    // decompress them on first use and keep them (`&'static`).
    let text: &'static str = module.ptx();
    println!(
        "module for cc 9.0: {} ({} bytes of PTX, {} embedded)",
        module.arch,
        text.len(),
        module.ptx_image().compressed_len()
    );
    if let Some(cubin) = module.cubin() {
        assert!(cubin.starts_with(b"\x7fELF"), "a cubin is an ELF image");
        println!("SASS for {}: {} bytes", module.arch, cubin.len());
    }
    assert!(text.contains(&format!(".entry {}(", entry.name())));
    // One family's entries alone (a smaller module for a launcher that
    // JIT-compiles): the entry is in it.
    let family = module.family_ptx(entry.family());
    assert!(family.contains(&format!(".entry {}(", entry.name())));
    println!("entry: {} (its family's PTX: {} bytes)", entry.name(), family.len());
    println!(
        "LaunchArgs: {} bytes, align {} (one by-value kernel parameter)",
        std::mem::size_of::<LaunchArgs>(),
        std::mem::align_of::<LaunchArgs>()
    );
}

/// Part 2: two ranks in one process, as a tensor-parallel engine runs them.
fn host_api(gpus: usize) -> Res<()> {
    let ctx0 = driver::open_device(0)?;
    let ctx1 = if gpus >= 2 {
        driver::open_device(1)?
    } else {
        ctx0.clone()
    };
    // Rank r lives on contexts[r]. Two GPUs without a P2P path are refused
    // (NoPeerAccess); then fall back to both ranks on GPU 0.
    let (group, contexts) = match PeerGroup::new(&[ctx0.clone(), ctx1.clone()], Config::default()) {
        Err(Error::NoPeerAccess { .. }) => {
            println!("no P2P between GPU 0 and 1: both ranks on GPU 0");
            let c = [ctx0.clone(), ctx0.clone()];
            (PeerGroup::new(&c, Config::default())?, c)
        }
        other => (other?, [ctx0, ctx1]),
    };
    println!("{group:?}");
    // One stream per rank, even when ranks share a GPU: the ranks wait for
    // each other inside the kernel, so they must be able to run concurrently
    // (one stream for both would deadlock; the group refuses it).
    let streams: Vec<Arc<CudaStream>> = contexts
        .iter()
        .map(|c| c.new_stream())
        .collect::<Result<_, _>>()?;

    // Exact data: small integers, so every partial sum is exact in f32 and
    // the GPU result equals the CPU sum bit for bit.
    let host: Vec<Vec<f32>> = (0..2)
        .map(|r| {
            (0..LEN)
                .map(|i| ((i * 7 + r * 13) % 101) as f32 - 50.0)
                .collect()
        })
        .collect();
    let upload = |r: usize| -> Res<CudaSlice<f32>> { Ok(streams[r].clone_htod(&host[r])?) };
    let inputs = [upload(0)?, upload(1)?];

    // (a) Views: reduce only SUB of larger buffers (e.g. one layer's slice
    // of a flat activation buffer). Inputs are staged, so any offset works.
    let mut outs = [
        streams[0].alloc_zeros::<f32>(LEN)?,
        streams[1].alloc_zeros::<f32>(LEN)?,
    ];
    {
        let (v0, v1) = (inputs[0].slice(SUB), inputs[1].slice(SUB));
        let [o0, o1] = &mut outs;
        let mut out_views = [o0.slice_mut(SUB), o1.slice_mut(SUB)];
        let algo = group.allreduce(&streams, &[&v0, &v1], &mut out_views, AlgoChoice::Auto)?;
        println!("(a) views {SUB:?}: {}", algo.name());
    }

    // (b) In place: each rank's buffer is input and output (safe, since the
    // input is staged before anyone writes).
    let mut bufs = [upload(0)?, upload(1)?];
    let algo = group.allreduce_in_place(&streams, &mut bufs, AlgoChoice::Auto)?;
    println!("(b) in place, {LEN} elements: {}", algo.name());

    // (c) Registered buffers: peers read them directly, no staging copy.
    // An engine would write its layer output here; we copy our inputs in.
    let reg = group.alloc_registered::<f32>(LEN)?;
    for (r, src) in inputs.iter().enumerate() {
        reg.copy_from(r, &streams[r], src)?; // ordered on rank r's stream
    }
    let mut reg_outs = [
        streams[0].alloc_zeros::<f32>(LEN)?,
        streams[1].alloc_zeros::<f32>(LEN)?,
    ];
    let algo = group.allreduce_registered(&streams, &reg, LEN, &mut reg_outs, AlgoChoice::Auto)?;
    println!("(c) registered, {LEN} elements: {}", algo.name());

    // Nothing above waited. check() synchronizes every rank's stream and
    // turns an error recorded by a kernel (a peer that never arrived within
    // the barrier timeout) into Error::PeerTimeout instead of a silent hang.
    group.check(&streams)?;

    // Verify against the CPU: rank-order sum (x0 + x1), seeded with rank 0.
    let want: Vec<f32> = (0..LEN).map(|i| host[0][i] + host[1][i]).collect();
    for r in 0..2 {
        let a = streams[r].clone_dtoh(&outs[r])?;
        let b = streams[r].clone_dtoh(&bufs[r])?;
        let c = streams[r].clone_dtoh(&reg_outs[r])?;
        for i in 0..LEN {
            // Outside SUB the view outputs must be untouched (still zero).
            let want_a = if SUB.contains(&i) { want[i] } else { 0.0 };
            for (what, got, w) in [
                ("views", a[i], want_a),
                ("in place", b[i], want[i]),
                ("registered", c[i], want[i]),
            ] {
                if got.to_bits() != w.to_bits() {
                    return Err(format!("{what}: rank {r} element {i}: got {got}, want {w}").into());
                }
            }
        }
    }
    println!("ok: all three results match the CPU sum bit for bit on both ranks");
    Ok(())
}
