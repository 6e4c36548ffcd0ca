//! The `p2p-allreduce` command: `info` (placeholder until the CLI issue).
use p2p_allreduce::{driver, ptx};

fn main() {
    println!("p2p-allreduce {}", env!("CARGO_PKG_VERSION"));
    println!("kernels compiled by: {}", ptx::KERNEL_TOOLCHAIN);
    for m in ptx::MODULES {
        let regs: Vec<u32> = ptx::KERNEL_STATS
            .iter()
            .filter(|(a, _)| *a == m.arch)
            .map(|(_, k)| k.registers)
            .collect();
        println!(
            "  {}: {} bytes of PTX, max registers {:?}",
            m.arch,
            m.ptx.len(),
            regs.iter().max()
        );
    }
    if !driver::driver_present() {
        println!("no CUDA driver found (libcuda not loadable): GPU features unavailable");
        return;
    }
    match driver::device_count() {
        Ok(n) => {
            for i in 0..n {
                match driver::open_device(i)
                    .and_then(|c| Ok((driver::device_info(&c)?, driver::module_for_device(&c))))
                {
                    Ok((info, m)) => println!(
                        "GPU {i}: {} cc {}.{} {} SMs -> PTX {}",
                        info.name,
                        info.compute_capability.0,
                        info.compute_capability.1,
                        info.multiprocessors,
                        m.map(|m| m.arch).unwrap_or("none")
                    ),
                    Err(e) => println!("GPU {i}: {e}"),
                }
            }
        }
        Err(e) => println!("{e}"),
    }
}
