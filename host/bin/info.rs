//! `p2p-allreduce info`: what this build embeds and what the machine has.

use crate::fmt_bytes;
use p2p_allreduce::driver::{self, DeviceInfo};
use p2p_allreduce::nccl;
use p2p_allreduce::ptx::{self, Entry, KernelStats};
use p2p_allreduce::thresholds::{self, Origin};
use p2p_allreduce::{topology, Link};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct InfoArgs {
    /// List registers and spills of every kernel entry (one line per entry,
    /// one column per architecture).
    #[arg(long)]
    pub kernels: bool,
    /// Measure on GPU `--gpu` how long the kernels take to load: the
    /// cubin's decompression and cuModuleLoadData, the PTX's decompression,
    /// one family's JIT compilation, and the first call of a world-2 bf16
    /// VirtualGroup that loads the PTX (ImageChoice::Ptx). Run in a fresh
    /// process with CUDA_CACHE_DISABLE=1, or the driver's JIT cache answers.
    #[arg(long)]
    pub load_times: bool,
    /// With --load-times: also JIT-compile the whole PTX (all 432 entries)
    /// as one module, as releases before per-family loading did (about a
    /// minute on an H200).
    #[arg(long, requires = "load_times")]
    pub whole_ptx: bool,
    /// The GPU --load-times measures on.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
}

pub fn run(args: &InfoArgs) -> ExitCode {
    println!("p2p-allreduce {}", env!("CARGO_PKG_VERSION"));
    println!("kernel toolchain: {}", ptx::KERNEL_TOOLCHAIN);
    if args.load_times {
        return crate::load_times::run(args.gpu, args.whole_ptx);
    }
    print_ptx(args.kernels);
    println!();
    print_gpus();
    print_nccl();
    ExitCode::SUCCESS
}

fn stats_of(arch: &str) -> Vec<&'static KernelStats> {
    ptx::KERNEL_STATS
        .iter()
        .filter(|(a, _)| *a == arch)
        .map(|(_, k)| k)
        .collect()
}

/// "1.2 MiB / 13.8 MiB": embedded (compressed) / decompressed.
fn sizes(image: &ptx::Image) -> String {
    format!(
        "{} / {}",
        fmt_bytes(image.compressed_len() as u64),
        fmt_bytes(image.len() as u64)
    )
}

/// Devices people run, by compute capability, for the table of what each
/// one loads.
const DEVICES: &[((u32, u32), &str)] = &[
    ((8, 0), "A100"),
    ((8, 6), "A10, RTX 3090"),
    ((8, 9), "L40S, RTX 4090"),
    ((9, 0), "H100, H200, GH200"),
    ((10, 0), "B200, GB200"),
    ((10, 3), "B300, GB300"),
    ((11, 0), "Jetson Thor (CUDA 13)"),
    ((12, 0), "RTX PRO 6000, RTX 5090"),
    ((12, 1), "GB10 (DGX Spark)"),
    ((13, 0), "a future architecture"),
];

fn print_ptx(list_kernels: bool) {
    match ptx::PTXAS_USED {
        Some(path) => println!(
            "register/spill numbers: from `ptxas -v` at build time ({path}, {})",
            ptx::PTXAS_VERSION.unwrap_or("version unknown")
        ),
        None => println!(
            "register/spill numbers: none: ptxas was not available at build time, so the PTX was \
             not assembled here and no SASS is embedded (the driver JIT-compiles the PTX on first use)"
        ),
    }
    let entries = Entry::all().len();
    println!(
        "embedded kernels: {} architectures, {} entries each, {} (embedded / decompressed once, when first loaded)",
        ptx::MODULES.len(),
        entries,
        ptx::IMAGE_COMPRESSION
    );
    println!(
        "  {:<8} {:>5} {:>21} {:>8} {:>13} {:>12} {:>12}",
        "arch", "cc", "SASS", "PTX", "registers", "spill st/ld", "stack frame"
    );
    let mut embedded = 0u64;
    let mut decompressed = 0u64;
    for m in ptx::MODULES {
        let stats = stats_of(m.arch);
        let (regs, spill, stack) = if stats.is_empty() {
            ("-".to_string(), "-".to_string(), "-".to_string())
        } else {
            let min = stats.iter().map(|k| k.registers).min().unwrap_or(0);
            let max = stats.iter().map(|k| k.registers).max().unwrap_or(0);
            let st: u64 = stats.iter().map(|k| u64::from(k.spill_store_bytes)).sum();
            let ld: u64 = stats.iter().map(|k| u64::from(k.spill_load_bytes)).sum();
            let frame = stats.iter().map(|k| k.stack_frame_bytes).max().unwrap_or(0);
            (
                format!("{min}..{max}"),
                format!("{st}/{ld} B"),
                format!("max {frame} B"),
            )
        };
        if let Some(c) = m.cubin_image() {
            embedded += c.compressed_len() as u64;
            decompressed += c.len() as u64;
        }
        println!(
            "  {:<8} {:>5} {:>21} {:>8} {:>13} {:>12} {:>12}",
            m.arch,
            format!("{}.{}", m.compute_capability.0, m.compute_capability.1),
            m.cubin_image().map_or("-".to_string(), sizes),
            m.ptx_arch,
            regs,
            spill,
            stack
        );
    }
    println!(
        "  {:<8} {:>5} {:>21} {:>8}",
        "PTX", "cc", "(embedded / loaded)", "entries"
    );
    for arch in ptx::built_ptx_archs() {
        let Some(m) = ptx::MODULES
            .iter()
            .find(|m| m.arch == arch || m.ptx_arch == arch)
        else {
            continue;
        };
        let image = m.ptx_image();
        embedded += image.compressed_len() as u64;
        decompressed += image.len() as u64;
        let cc = arch.trim_start_matches("sm_");
        println!(
            "  {:<8} {:>5} {:>21} {:>8}",
            arch,
            format!("{}.{}", &cc[..cc.len() - 1], &cc[cc.len() - 1..]),
            sizes(image),
            m.entry_names().count()
        );
    }
    println!(
        "  all images: {} embedded, {} decompressed",
        fmt_bytes(embedded),
        fmt_bytes(decompressed)
    );
    println!("what a device loads (Config::kernel_image = Auto):");
    for &(cc, names) in DEVICES {
        let what = match ptx::module_for(cc) {
            None => {
                "nothing: no embedded architecture at or below it (groups fail with NoPtxForDevice)"
                    .to_string()
            }
            Some(m) if m.runs_sass_on(cc) => format!("SASS {} (no JIT)", m.arch),
            Some(m) => format!(
                "PTX {}, JIT-compiled one family (9 entries) at a time as groups need them",
                m.ptx_arch
            ),
        };
        println!(
            "  cc {:>4} {:<24} {what}",
            format!("{}.{}", cc.0, cc.1),
            names
        );
    }
    println!("  (build for fewer architectures with P2P_ALLREDUCE_ARCHS, e.g. P2P_ALLREDUCE_ARCHS=sm_90)");
    if list_kernels {
        print_kernel_table();
    } else if ptx::PTXAS_USED.is_some() {
        println!("  (`info --kernels` lists every entry)");
    }
}

fn print_kernel_table() {
    let archs: Vec<&str> = ptx::MODULES.iter().map(|m| m.arch).collect();
    println!();
    print!("  {:<40}", "entry (registers / spill st+ld bytes)");
    for a in &archs {
        print!(" {a:>10}");
    }
    println!();
    for e in Entry::all() {
        let name = e.name();
        print!("  {name:<40}");
        for a in &archs {
            let cell = match ptx::kernel_stats(a, &name) {
                Some(k) => format!(
                    "{}/{}",
                    k.registers,
                    k.spill_store_bytes + k.spill_load_bytes
                ),
                None => "-".into(),
            };
            print!(" {cell:>10}");
        }
        println!();
    }
}

fn print_gpus() {
    if !driver::driver_present() {
        println!("driver: no CUDA driver found (libcuda could not be loaded): GPU commands (check, bench) are unavailable here; the PTX above is usable on any machine");
        return;
    }
    let version = match driver::driver_version() {
        Ok((major, minor)) => format!(", CUDA {major}.{minor}"),
        Err(_) => String::new(),
    };
    let n = match driver::device_count() {
        Ok(n) => n,
        Err(e) => {
            println!("driver: present{version}, but: {e}");
            return;
        }
    };
    println!("driver: present{version}, {n} GPU(s)");
    if n == 0 {
        println!("  no GPU visible (check CUDA_VISIBLE_DEVICES and the driver)");
        return;
    }
    let mut opened = Vec::new();
    for i in 0..n {
        match driver::open_device(i).and_then(|c| Ok((driver::device_info(&c)?, c))) {
            Ok((info, ctx)) => {
                print_gpu(&info, &ctx);
                opened.push(ctx);
            }
            Err(e) => println!("GPU {i}: cannot open: {e}"),
        }
    }
    if opened.len() >= 2 {
        print_peer_matrix(&opened);
    } else if n == 1 {
        println!("peer access: one GPU (virtual ranks only; `check --gpus 0,0` runs real-rank kernels on it)");
    }
    print_pci_places(&opened);
    print_auto_tables(&opened);
}

/// Each GPU's place in the PCIe tree (sysfs) and the islands they form.
fn print_pci_places(ctxs: &[Arc<cudarc::driver::CudaContext>]) {
    println!();
    println!("PCIe placement (sysfs):");
    let mut places = Vec::new();
    for c in ctxs {
        let id = match driver::pci_bus_id(c) {
            Ok(id) => id,
            Err(e) => {
                println!("  GPU{}: no bus id: {e}", c.ordinal());
                return;
            }
        };
        match topology::pci_place(&id) {
            Some(p) => {
                println!(
                    "  GPU{}: {}, NUMA {}, {} via {}",
                    c.ordinal(),
                    p.bus_id,
                    p.numa.map_or("?".into(), |n| n.to_string()),
                    p.root,
                    if p.bridges.is_empty() {
                        "-".to_string()
                    } else {
                        p.bridges.join(" > ")
                    }
                );
                places.push(p);
            }
            None => {
                println!(
                    "  GPU{}: {id} not found under /sys/bus/pci/devices (a container without sysfs?)",
                    c.ordinal()
                );
                return;
            }
        }
    }
    if places.len() >= 2 {
        let islands = topology::islands(&places);
        let named: Vec<String> = islands
            .iter()
            .map(|isl| {
                let gpus: Vec<String> = isl
                    .iter()
                    .map(|&i| format!("GPU{}", ctxs[i].ordinal()))
                    .collect();
                format!("[{}]", gpus.join(" "))
            })
            .collect();
        println!(
            "  islands (one PCIe switch, else one root complex): {}",
            named.join(" ")
        );
    }
}

/// Which table `Auto` uses on this machine: the thresholds file (and
/// whether it has an entry for these GPUs) or the built-in one.
fn print_auto_tables(ctxs: &[Arc<cudarc::driver::CudaContext>]) {
    println!();
    match thresholds::file_path() {
        None => println!(
            "Auto's tables: built in ({} is `none`)",
            thresholds::ENV_VAR
        ),
        Some((path, from_env)) => println!(
            "Auto's tables: thresholds file {} ({}{}; write it with `p2p-allreduce tune`)",
            path.display(),
            if path.exists() {
                "present"
            } else {
                "not present"
            },
            if from_env {
                format!(", from {}", thresholds::ENV_VAR)
            } else {
                String::new()
            }
        ),
    }
    let Some(first) = ctxs.first() else {
        return;
    };
    let gpu = match driver::device_info(first) {
        Ok(i) => i.name,
        Err(e) => {
            println!("  cannot name GPU 0: {e}");
            return;
        }
    };
    // Groups of the first w GPUs over their slowest link, or virtual ranks
    // on one GPU.
    let groups: Vec<(usize, Link)> = if ctxs.len() >= 2 {
        (2..=ctxs.len())
            .map(|w| {
                let mut link = Link::SameDevice;
                for a in &ctxs[..w] {
                    for b in &ctxs[..w] {
                        if let Ok(Some(l)) = topology::link_between(a, b) {
                            link = topology::slowest(link, l);
                        }
                    }
                }
                (w, link)
            })
            .collect()
    } else {
        vec![
            (2, Link::SameDevice),
            (4, Link::SameDevice),
            (8, Link::SameDevice),
        ]
    };
    for (world, link) in groups {
        match thresholds::for_machine(&gpu, ctxs.len(), link, world) {
            Ok(t) => {
                let from = match t.origin() {
                    Origin::BuiltIn => "built in".to_string(),
                    Origin::File { table, .. } => format!("file: {table}"),
                    Origin::Custom => "custom".to_string(),
                };
                println!(
                    "  {world} ranks over {}: {} ({from})",
                    thresholds::link_label(link),
                    thresholds::describe_bands(t.bands(link, world))
                );
                for line in table_lines(&t, link, world) {
                    println!("    {line}");
                }
            }
            Err(e) => println!("  {world} ranks over {}: {e}", thresholds::link_label(link)),
        }
    }
}

/// The table for `world` ranks over `link` with its NCCL columns: per size
/// band our algorithm, the winner among ours, `nccl` and `nccl_symmetric`,
/// the margin, and why the band goes where it goes.
pub fn table_lines(t: &thresholds::Thresholds, link: Link, world: usize) -> Vec<String> {
    let mut out = vec![format!(
        "{:<14} {:<16} {:<16} {:>8}  goes to",
        "sizes", "ours", "winner", "margin"
    )];
    let mut low = 0usize;
    for (up_to, algo, w) in t.merged(link, world) {
        let sizes = if up_to == usize::MAX {
            format!("> {}", fmt_bytes(low as u64))
        } else {
            format!("<= {}", fmt_bytes(up_to as u64))
        };
        let margin = w
            .margin
            .map_or("-".to_string(), |m| format!("{:+.1}%", m * 100.0));
        let why = match (w.winner, w.margin) {
            (thresholds::Backend::Ours, None) => "ours (NCCL not measured here)".to_string(),
            (thresholds::Backend::Ours, Some(_)) => format!(
                "ours (NCCL not faster by more than {:.0}%)",
                thresholds::NCCL_MUST_WIN_BY * 100.0
            ),
            (b, Some(m)) => format!(
                "NCCL ({} measured {:.1}% faster than the next best; deterministic mode keeps it on ours)",
                b.name(),
                m * 100.0
            ),
            (b, None) => format!("NCCL ({} set by hand)", b.name()),
        };
        out.push(format!(
            "{sizes:<14} {:<16} {:<16} {margin:>8}  {why}",
            algo.name(),
            w.winner.name()
        ));
        low = up_to;
    }
    out
}

/// Which NCCL `bench` and `tune` would time, and whether its symmetric
/// kernels are available (the `nccl_symmetric` rows).
fn print_nccl() {
    println!();
    match nccl::library() {
        Ok((path, v)) => println!("NCCL {} from {path}", nccl::version_string(v)),
        Err(e) => {
            println!("NCCL: none: {e}");
            return;
        }
    }
    match nccl::symmetric_support() {
        Ok(()) => println!("  symmetric windows: available (ncclMemAlloc, ncclCommWindowRegister)"),
        Err(e) => println!("  symmetric windows: unavailable: {e}"),
    }
}

fn print_gpu(info: &DeviceInfo, ctx: &Arc<cudarc::driver::CudaContext>) {
    let ptx = match driver::module_for_device(ctx) {
        Ok(m) => m.describe_on(info.compute_capability),
        Err(e) => format!("no usable PTX: {e}"),
    };
    println!(
        "GPU {}: {}, cc {}.{}, {} SMs, {} -> {}",
        info.ordinal,
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        fmt_bytes(info.total_mem as u64),
        ptx
    );
}

fn print_peer_matrix(ctxs: &[Arc<cudarc::driver::CudaContext>]) {
    println!(
        "peer access (row reads column; NVLink = native peer atomics, PCIe = P2P without them):"
    );
    print!("  {:<6}", "");
    for c in ctxs {
        print!(" {:>7}", format!("GPU{}", c.ordinal()));
    }
    println!();
    for a in ctxs {
        print!("  {:<6}", format!("GPU{}", a.ordinal()));
        for b in ctxs {
            let cell = if a.ordinal() == b.ordinal() {
                "-".to_string()
            } else {
                match topology::link_between(a, b) {
                    Ok(l) => topology::link_name(l).to_string(),
                    Err(e) => {
                        eprintln!("peer query GPU{} -> GPU{}: {e}", a.ordinal(), b.ordinal());
                        "?".to_string()
                    }
                }
            };
            print!(" {cell:>7}");
        }
        println!();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use p2p_allreduce::abi::Algorithm;
    use p2p_allreduce::thresholds::{Backend, Band, Thresholds, WinnerBand};

    #[test]
    fn the_table_says_which_bands_go_to_nccl_and_why() {
        let t = Thresholds::default();
        let lines = table_lines(&t, Link::NvLink, 2);
        assert!(lines[0].contains("winner") && lines[0].contains("margin"));
        assert!(
            lines[1..]
                .iter()
                .all(|l| l.contains("ours (NCCL not measured here)")),
            "{lines:#?}"
        );
        let mut t = Thresholds::default();
        t.set_bands(
            Link::Pcie,
            2,
            vec![
                Band {
                    up_to: 1 << 20,
                    algorithm: Algorithm::OneStage,
                },
                Band {
                    up_to: usize::MAX,
                    algorithm: Algorithm::TwoStage,
                },
            ],
        )
        .expect("bands");
        t.set_winners(
            Link::Pcie,
            2,
            vec![
                WinnerBand {
                    up_to: 64 << 10,
                    winner: Backend::Ours,
                    margin: Some(0.3),
                },
                WinnerBand {
                    up_to: 2 << 20,
                    winner: Backend::Nccl,
                    margin: Some(0.125),
                },
                WinnerBand {
                    up_to: usize::MAX,
                    winner: Backend::Ours,
                    margin: Some(-0.01),
                },
            ],
        )
        .expect("winners");
        let lines = table_lines(&t, Link::Pcie, 2);
        assert_eq!(lines.len(), 5, "{lines:#?}");
        assert!(
            lines[1].starts_with("<= 64.0 KiB") && lines[1].contains("one_stage"),
            "{}",
            lines[1]
        );
        assert!(
            lines[2].contains("one_stage") && lines[2].contains("NCCL (nccl measured 12.5% faster"),
            "{}",
            lines[2]
        );
        assert!(
            lines[3].contains("two_stage")
                && lines[3].contains("nccl")
                && lines[3].contains("+12.5%"),
            "{}",
            lines[3]
        );
        assert!(
            lines[4].starts_with("> 2.0 MiB")
                && lines[4].contains("-1.0%")
                && lines[4].contains("ours (NCCL not faster"),
            "{}",
            lines[4]
        );
    }
}
